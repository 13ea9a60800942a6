#!/usr/bin/env bash
# Install pretrain. Three ways:
#   bash tools/install.sh [--dev] [--venv DIR]
#       create ./.venv (or DIR) with torch, every extra and pretrain (editable); --dev adds pytest and ruff.
#   bash tools/install.sh --wheelhouse DIR [--python 3.12] [--platform manylinux_2_28_x86_64] [--extras all] [--have FILE]
#       on a machine with an index (the active Python needs pip; the project's .venv will do): the wheels pretrain
#       needs on a target whose environment already has torch (pretrain, DeepSpeed built without ops, the rest for
#       that Python and platform; never torch). Copy DIR to the target. --have FILE: the target's
#       `pip list --format=freeze`; what it already has (at a version that will do) is left out.
#   bash tools/install.sh --offline DIR [--extras all]
#       on the target, with its environment active: pretrain[extras] from DIR alone, keeping its torch.
# --wheelhouse and --offline use python3 from PATH (the active environment); PYTHON=/path/to/python picks another.
# Order matters in the first: the CPU/CUDA torch wheel you want must be in place before anything that depends on
# torch, or pip pulls the newest CUDA build (several GB). DeepSpeed builds from source against that torch, hence
# --no-build-isolation.
set -euo pipefail
usage="usage: bash tools/install.sh [--dev] [--venv DIR] | --wheelhouse DIR [--python X.Y] [--platform TAG] [--extras LIST] [--have FILE] | --offline DIR [--extras LIST]"
mode=venv extra="" venv=".venv" dir="" target=() extras="all"
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) extra=",dev" ;;
    --venv) venv="$2"; shift ;;
    --wheelhouse) mode=wheelhouse; dir="$2"; shift ;;
    --offline) mode=offline; dir="$2"; shift ;;
    --python|--platform) target+=("$1" "$2"); shift ;;
    --have) target+=("$1" "$(realpath -m "$2")"); shift ;;   # the target's pip list --format=freeze
    --extras) extras="$2"; shift ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done
PY="${PYTHON:-python3}"
[ -z "$dir" ] || dir=$(realpath -m "$dir")   # the user's path, from where they ran this
cd "$(dirname "$0")/.."

if [ "$mode" = wheelhouse ]; then
  exec "$PY" tools/wheelhouse.py "$dir" --extras "$extras" "${target[@]}"
fi

if [ "$mode" = offline ]; then
  if ! ls "$dir"/pretrain-*.whl >/dev/null 2>&1; then
    echo "error: $dir holds no pretrain wheel; build it on a machine with an index: bash tools/install.sh --wheelhouse $dir" >&2
    exit 2
  fi
  torch_version=$("$PY" -c "from importlib.metadata import version; print(version('torch'))" 2>/dev/null) || {
    echo "error: $("$PY" -c 'import sys; print(sys.executable)') has no torch: activate the environment that holds this machine's torch build (the wheelhouse leaves torch out)" >&2
    exit 2
  }
  if [ "$extras" = all ]; then extras="deepspeed,datasets,wandb,tensorboard,liger,float8"; fi
  # Liger's kernels are Triton's, which comes with a CUDA build of torch; without it there is no Liger to install.
  if [[ ",$extras," == *",liger,"* ]] && ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('triton') is None)"; then
    extras=$(echo ",$extras," | sed 's/,liger,/,/; s/^,//; s/,$//')
    echo "liger left out: it needs triton, which this torch ($torch_version) does not bring"
  fi
  # A PYTHONPATH holding a checkout (or a --target folder) makes pip take pretrain, or a dependency, as installed.
  unset PYTHONPATH
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  # The pin keeps pip from replacing torch, whatever a wheel asks for: a requirement torch $torch_version cannot
  # meet fails the install instead of swapping the build that matches this machine's driver.
  echo "torch==$torch_version" >"$constraints"
  if ! "$PY" -m pip install --quiet --no-index --find-links "$dir" --constraint "$constraints" "pretrain${extras:+[$extras]}"; then
    echo "error: pip could not install pretrain${extras:+[$extras]} from $dir next to this environment's torch (why: above); torch $torch_version is unchanged. Build the wheelhouse for this machine's Python and platform (--python, --platform)" >&2
    exit 1
  fi
  # From / : the installed pretrain, not this checkout's.
  (cd / && "$PY" -c "import torch, pretrain.run; print(f'installed pretrain[$extras] from $dir; torch {torch.__version__} kept')")
  exit 0
fi

TORCH_SPEC="${PRETRAIN_TORCH_SPEC:-torch==2.13.0}"   # set e.g. PRETRAIN_TORCH_SPEC=torch on a GPU machine
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "$TORCH_SPEC"
python -m pip install --quiet --no-build-isolation deepspeed
python -m pip install --quiet -e ".[all${extra}]"
python - <<'PY'
import torch, accelerate, transformers, deepspeed
print(f"installed: torch {torch.__version__}, accelerate {accelerate.__version__}, "
      f"transformers {transformers.__version__}, deepspeed {deepspeed.__version__}")
PY
# Without a GPU, DeepSpeed's collectives go through its shared-memory op, which it compiles (~50 s on 2 cores)
# the first time a ZeRO run starts in an environment: build it now, so that no run or test waits for it. It goes
# where pretrain's runs look for it: this environment's own directory under $PRETRAIN_CACHE_DIR (default
# ~/.cache/pretrain), not torch's ~/.cache/torch_extensions that every environment shares (pretrain/system/environment.py).
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  ops=$(python -c "from pretrain.system.environment import use_environment_op_builds as own; print(own())")
  DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$ops" python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load(verbose=False)" \
    >/dev/null 2>&1 && echo "built DeepSpeed's CPU shared-memory op in $ops" || echo "DeepSpeed's CPU shared-memory op will be built at the first ZeRO run"
fi
