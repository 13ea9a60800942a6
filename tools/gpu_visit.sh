#!/usr/bin/env bash
# One short visit to a lent GPU machine (no package index there), in the order that matters most. The runs go
# under runs/gpu_visit; the summary files (logs, doctor.json, the benchmark's table and rows) into OUT (the
# device tool's folder that comes back; default runs/gpu_visit too), each as soon as its step ends.
#
# Prepare on a machine with an index (6 MiB of wheels: what the GPU image lacks, tools/gpu_image_packages.txt):
#   bash tools/install.sh --wheelhouse .whl --python 3.12 --platform manylinux_2_28_x86_64 \
#       --extras deepspeed,liger,float8 --have tools/gpu_image_packages.txt
# On the GPU machine, from the checkout (the .whl folder travels with it):
#   BUDGET_S=480 bash tools/gpu_visit.sh
#
# Steps: 1. the offline install of what the image lacks (its torch kept); 2. `pretrain doctor` on this GPU;
# 3. `tools/bench_gpu.py --budget` with the seconds left of BUDGET_S less GPU_TESTS_S (default 120); 4. the GPU
# tests (`pytest -m gpu`) in what is left. Measurements first: a visit cut short keeps its rows.
# GPU_VISIT_SKIP_INSTALL=1 skips step 1; BENCH_ARGS adds options to step 3 (a CPU rehearsal: --reduced).
# STARTUP_PROFILE=1 adds step 2b: one 3-step run of the benchmark's first row under cProfile (one process, no
# launcher), its top functions by cumulative time in startup_profile.txt: where launch-to-first-step goes
# (STARTUP_RECIPE picks another recipe: recipes/tiny.yaml for a CPU rehearsal).
#
# Every Python process runs this checkout's pretrain (PYTHONPATH), not the wheel step 1 installed, which may be
# older; the wheel brings the dependencies. A container that sets PYTHONDONTWRITEBYTECODE (or whose site-packages
# cannot be written) recompiles every imported module in every process (9 s per process on the first H100 visit):
# here the bytecode goes to runs/gpu_visit/pycache instead (PYTHONPYCACHEPREFIX), written once, read by the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
work=runs/gpu_visit
out="${OUT:-$work}"
budget="${BUDGET_S:-480}"
py="${PYTHON:-python3}"
mkdir -p "$work" "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] || ! "$py" -c "import os, sys, sysconfig; sys.exit(not os.access(sysconfig.get_paths()['purelib'], os.W_OK))"; then
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPYCACHEPREFIX="$PWD/$work/pycache"
fi
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
step() { echo "gpu_visit: $1 ($(left) s of $budget left)" | tee -a "$out/visit.log"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))"
} | tee "$out/visit.log"
if [ "${GPU_VISIT_SKIP_INSTALL:-0}" != 1 ]; then
  step "1. offline install"
  PYTHON="$py" bash tools/install.sh --offline .whl --extras deepspeed,liger,float8 2>&1 | tee "$out/install.log"
fi
# the checkout's code, the environment's packages (and where bytecode goes)
"$py" -c "import pretrain, transformers, accelerate, sys; print('pretrain from', pretrain.__file__, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| pycache', sys.pycache_prefix)" 2>&1 | tee -a "$out/visit.log"
step "2. pretrain doctor"
# The benchmark's data (the standard library, a 32k BPE): the recipe's hf: source would need the datasets extra,
# which the visit does not install (the first visit's doctor step was refused for it, 2026-11-26).
timeout 120 "$py" -m pretrain doctor --recipe recipes/llama-1b.yaml "output_dir=$work/doctor" \
  "logging.backends=[jsonl]" data.source=stdlib data.hf_config=null data.tokenizer=bpe \
  data.tokenizer_vocab_size=32000 data.val_fraction=0.05 2>&1 | tee "$out/doctor.log"
cp "$work/doctor/doctor.json" "$out/" 2>/dev/null
if [ "${STARTUP_PROFILE:-0}" = 1 ]; then
  step "2b. startup profile"
  timeout 240 "$py" -m cProfile -o "$work/startup.prof" pretrain/run.py --recipe "${STARTUP_RECIPE:-recipes/llama-1b.yaml}" \
    "output_dir=$work/startup" "logging.backends=[jsonl]" logging.progress=plain train.max_steps=3 train.max_tokens=null batch.global_batch_size=4 batch.micro_batch_size=4 \
    batch.gradient_accumulation_steps=null batch.local_batch_size=null \
    lr_schedule.warmup_steps=0 eval.at_start=false eval.every_steps=0 eval.batches=1 checkpoint.every_steps=0 \
    checkpoint.save_last=false checkpoint.save_final_model=false checkpoint.resume=none stability.rollback.enabled=false \
    data.source=stdlib data.hf_config=null data.tokenizer=bpe data.tokenizer_vocab_size=32000 \
    data.val_fraction=0.05 2>&1 | tail -n 20 | tee "$out/startup_run.log"
  "$py" -c "import pstats, sys; pstats.Stats(sys.argv[1], stream=sys.stdout).sort_stats('cumulative').print_stats(60)" \
    "$work/startup.prof" > "$out/startup_profile.txt" 2>&1
  cp "$work/startup.prof" "$out/" 2>/dev/null  # the whole profile, for its callers (pstats print_callers)
fi
step "3. benchmark"
tests_s="${GPU_TESTS_S:-120}"
# The owed rows, most important first (docs/performance.md, "Still owed"): llama-1b as shipped (MBS auto: 8 on an
# H100, 16 on an H200) against OLMo-core's 55k tokens/s; float8 at that larger micro-batch; selective recompute
# since its placement fix (MBS auto 16 on an H100); Llama-3.1-8B's matmuls at half depth (MBS 16 on an H200, 1 on
# an H100) in bf16 and float8; the MoE row (OLMoE-1B-7B at half depth, every expert local); float8 with the LM head; the earlier MBS 4; the eager selective/full pair.
# VISIT_ROWS replaces the list; BENCH_ARGS (e.g. --reduced) replaces it too.
rows="${VISIT_ROWS:-llama-1b/default,llama-1b/float8-tensorwise,llama-1b/ac-selective,llama-8b-16l/default,llama-8b-16l/float8-tensorwise,olmoe-1b-7b-8l/default,llama-1b/float8-lm-head,llama-1b/mbs-4,llama-1b/ac-selective-eager,llama-1b/ac-full-eager,llama-1b/compile-none}"
# shellcheck disable=SC2086  # BENCH_ARGS holds several options
"$py" tools/bench_gpu.py --budget $(( $(left) - tests_s - 10 )) --out "$work/bench" ${BENCH_ARGS:---rows $rows} 2>&1 | tee "$out/bench.log"
cp "$work/bench/bench_gpu.md" "$work/bench/bench_gpu.json" "$work/bench/bench_gpu.jsonl" "$work/bench/calibration.json" "$out/" 2>/dev/null
step "4. GPU tests"
timeout $(( $(left) > 30 ? $(left) - 5 : 30 )) "$py" -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$out/gpu_tests.log"
step "done"
