#!/usr/bin/env bash
# Create ./.venv and install pretrain into it. Usage: bash tools/install.sh [--dev] [--venv DIR]
#   --dev   also install the test tools (pytest, ruff)
# Order matters: the CPU/CUDA torch wheel you want must be in place before anything that depends on
# torch, or pip pulls the newest CUDA build (several GB). DeepSpeed builds from source against that
# torch, hence --no-build-isolation.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
venv=".venv"
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) extra="[dev]" ;;
    --venv) venv="$2"; shift ;;
    *) echo "usage: bash tools/install.sh [--dev] [--venv DIR]" >&2; exit 2 ;;
  esac
  shift
done
TORCH_SPEC="${PRETRAIN_TORCH_SPEC:-torch==2.13.0}"   # set e.g. PRETRAIN_TORCH_SPEC=torch on a GPU machine
python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "$TORCH_SPEC"
python -m pip install --quiet --no-build-isolation deepspeed
python -m pip install --quiet -e ".${extra}"
python - <<'PY'
import torch, accelerate, transformers, deepspeed
print(f"installed: torch {torch.__version__}, accelerate {accelerate.__version__}, "
      f"transformers {transformers.__version__}, deepspeed {deepspeed.__version__}")
PY
# Without a GPU, DeepSpeed's collectives go through its shared-memory op, which it compiles (~50 s on 2 cores)
# the first time a ZeRO run starts on a machine: build it now, so that no run or test waits for it.
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  DS_ACCELERATOR=cpu python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load(verbose=False)" \
    >/dev/null 2>&1 && echo "built DeepSpeed's CPU shared-memory op" || echo "DeepSpeed's CPU shared-memory op will be built at the first ZeRO run"
fi
