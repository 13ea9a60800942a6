#!/usr/bin/env bash
# The minimum-versions smoke set: a virtual environment holding the floors pyproject.toml declares for torch,
# accelerate, transformers and deepspeed (the rest at their newest), and `pytest -m floors` in it: a tiny run
# on one process, DDP and ZeRO-2 (one curve) and pretrain-export, every activation-checkpointing policy, the
# compile decision and in-place compile, the environment check. CI runs it after the main suite, so that a
# floor in pyproject is a version the code has run on, not a guess.
#
#   bash tools/floors.sh [VENV]        (default .venv-floors; about 4 minutes on 2 cores, 6 GB of disk)
#
# PyPI has no CPU build of an older torch, so the floor's torch is its CUDA build (2.6 GB with its NVIDIA
# libraries): it runs on the CPU here, exactly as on a GPU machine whose GPUs it cannot see.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-floors}"
start=$(date +%s)
floors=$(python3 - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
lines = project["dependencies"] + [l for v in project["optional-dependencies"].values() for l in v]
for name in ("torch", "accelerate", "transformers", "deepspeed"):
    [floor] = [m.group(1) for l in lines if (m := re.fullmatch(rf"{name}\s*>=\s*([0-9.]+)", l.strip()))]
    print(f"{name}=={floor}")
PY
)
read -r torch_pin accelerate_pin transformers_pin deepspeed_pin <<<"$(echo $floors)"
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install --quiet --upgrade pip wheel setuptools
python -m pip install --quiet "$torch_pin"
python -m pip install --quiet --no-build-isolation "$deepspeed_pin"
constraints="$venv/floors.txt"
printf '%s\n' $floors > "$constraints"
python -m pip install --quiet -c "$constraints" "$accelerate_pin" "$transformers_pin" -e ".[dev]"
echo "floors: installed $(echo $floors) in $(( $(date +%s) - start ))s"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline DS_ACCELERATOR=cpu PRETRAIN_FLOORS=1
export PRETRAIN_CACHE_DIR="${PRETRAIN_CACHE_DIR:-$PWD/.cache/pretrain}"
set +e
python -m pytest -m floors -q -p no:cacheprovider tests 2>&1 | tee "$venv/pytest.log" | tail -n 3
status=${PIPESTATUS[0]}
set -e
summary=$(grep -E '^[0-9]+ (passed|failed)' "$venv/pytest.log" | tail -n 1)
if [ "$status" -eq 0 ]; then
  echo "CI: minimum-versions smoke set passed ($(echo $floors | tr ' ' ','), $summary)"
else
  cat "$venv/pytest.log" | tail -n 80
  echo "CI: minimum-versions smoke set FAILED ($(echo $floors | tr ' ' ','), $summary)"
fi
exit "$status"
