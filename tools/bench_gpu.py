"""The GPU acceptance benchmark: tokens/s per GPU, MFU, HFU and peak memory (measured against the estimator)
of a 1B and a 3B Llama on one GPU, one setting at a time.

    python tools/bench_gpu.py                                   # every model x every setting, 300 measured steps
    python tools/bench_gpu.py --models llama-1b --settings default,loss-plain,mbs-8 --steps 100
    python tools/bench_gpu.py --reduced                         # CPU: the tiny recipe, 2 settings, 3 steps (CI)

Each (model, setting) is a fresh ``accelerate launch --config_file accelerate_configs/single_gpu.yaml
pretrain/run.py --recipe R <overrides>`` (``--reduced``: ``accelerate_configs/cpu.yaml``), so compile caches
and CUDA's peak-memory statistics never carry from one setting to the next. Every run trains at GAS 1 for
``--warmup-steps`` + ``--steps`` optimizer steps with logging on every step, no evaluation and no checkpoint
(pretrain-sweep's overrides, ``pretrain.sweep.runner.sweep_overrides``); the figures are medians over the
measured steps of its ``metrics.jsonl``: ``perf/tokens_per_s_per_device``, ``perf/mfu``, ``perf/hfu``, and the
largest ``memory/peak_gib`` (GPU: ``torch.cuda.max_memory_allocated``; CPU: peak RSS) against
``memory/estimated_gib`` (the estimator's figure for that very launch), error = (estimated - measured) /
measured (on CPU the measured peak is the process's RSS, imports included, which the estimator does not
model: the column means something on GPUs). HFU is MFU where nothing is recomputed (the run logs
``perf/hfu`` only with activation checkpointing). A setting that runs out of memory is a row with status
``oom``, one whose overrides this checkout's recipes refuse a row with status ``refused``; the benchmark goes
on.

Models (``MODELS``): ``llama-1b`` is recipes/llama-1b.yaml as shipped (Llama-3.2-1B, 1.24B parameters,
seq 2048, MBS 4, bf16). ``llama-3b`` is the same recipe with Llama-3.2-3B's shape (hidden 3072, 28 layers, 24
heads, 8 KV heads, MLP 8192, tied 128,256-token embedding: 3,212,749,824 parameters) at MBS 1: its fp32
weights, gradients and AdamW moments take 16 bytes x 3.21B = 51 GB, and the estimator puts the whole run at
66.3 GiB without activation checkpointing, 13.4 GiB under an H100-80GB (``python pretrain/run.py --recipe
recipes/llama-1b.yaml <these overrides> --dry-run --config_file accelerate_configs/single_gpu.yaml --gpu
H100-80GB``). No new recipe: the override set here is the whole difference. ``--data stdlib`` (the default) trains both on the standard-library corpus
with a 32k BPE (nothing downloaded: GPU machines often have no network; throughput does not depend on the
text, and the model keeps the recipe's 128,256-row vocabulary); ``--data recipe`` keeps FineWeb-Edu and the
Llama tokenizer (prepared beforehand, ``pretrain-prepare-data``).

Settings (``SETTINGS``): each a named set of recipe overrides, one knob changed from the recipe as shipped
(``default``): ``model.compile`` none | regional, ``model.activation_checkpointing`` none | full | selective |
every_2, ``model.loss`` plain | chunked | liger, and ``batch.micro_batch_size``. ``--settings`` picks some;
trailing ``key=value`` arguments apply to every run.

Outputs in ``--out`` (default runs/bench_gpu): ``bench_gpu.md`` (the table, printed too), ``bench_gpu.json``
(``{"device": ..., "rows": [row, ...]}``, a row per (model, setting) with every figure and its status), and
``calibration.json``, what the planner reads: a JSON list, one object per run that measured, with

    gpu               the device's name (nvidia-smi's, or the CPU's model name with --reduced)
    model             the MODELS name (llama-1b, llama-3b; tiny with --reduced)
    params            parameters the run counted (run_config.json model.num_params)
    seq_len           tokens per sequence
    mbs               sequences per forward (the micro-batch; GAS 1, one process)
    mfu               median perf/mfu over the measured steps (a fraction, 0-1)
    hfu               median perf/hfu, only where activation checkpointing recomputed (the planner then
                      compares hardware FLOPs)
    tokens_per_s      median perf/tokens_per_s_per_device (tokens/s on that one GPU)
    settings          the setting's name and its overrides: {"name": ..., "overrides": [...]}
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain import rundir
from pretrain.batching import plan_batches
from pretrain.config import load_recipe
from pretrain.errors import ConfigError
from pretrain.sweep.runner import launch_command, run_process, stderr_tail, sweep_overrides

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Model:
    recipe: str
    overrides: tuple[str, ...] = ()


MODELS = {
    "llama-1b": Model("recipes/llama-1b.yaml"),
    "llama-3b": Model("recipes/llama-1b.yaml", (
        "model.hidden_size=3072", "model.num_layers=28", "model.num_heads=24", "model.num_kv_heads=8",
        "model.intermediate_size=8192", "batch.micro_batch_size=1",
    )),
}
# --reduced: recipes/tiny.yaml at pretrain-sweep's test shape (2 layers, 64 wide, 64-token sequences), fp32 on CPU.
REDUCED_MODELS = {
    "tiny": Model("recipes/tiny.yaml", ("model.hidden_size=64", "model.num_layers=2", "model.intermediate_size=128",
                                        "data.seq_len=64", "batch.micro_batch_size=4")),
}
# Trains on the standard library with a 32k BPE: nothing to download (see the module docstring).
STDLIB_DATA = ("data.source=stdlib", "data.hf_config=null", "data.tokenizer=bpe", "data.tokenizer_vocab_size=32000",
               "data.val_fraction=0.05")

SETTINGS: dict[str, tuple[str, ...]] = {
    "default": (),
    "compile-none": ("model.compile=none",),
    "compile-regional": ("model.compile=regional",),
    "ac-none": ("model.activation_checkpointing=none",),
    "ac-full": ("model.activation_checkpointing=full",),
    "ac-selective": ("model.activation_checkpointing=selective",),
    "ac-every_2": ("model.activation_checkpointing=every_2",),
    "loss-plain": ("model.loss=plain",),
    "loss-chunked": ("model.loss=chunked",),
    "loss-liger": ("model.loss=liger",),
    "mbs-1": ("batch.micro_batch_size=1",),
    "mbs-2": ("batch.micro_batch_size=2",),
    "mbs-8": ("batch.micro_batch_size=8",),
    # the stability rules read each step's loss and gradient norm: one device-to-host sync per optimizer step
    "no-step-checks": ("stability.skip_nonfinite=false", "stability.spike_sigma=null"),
}
REDUCED_SETTINGS = ("loss-plain", "loss-chunked")

COLUMNS = ("model", "setting", "loss", "MBS", "tokens/s/GPU", "MFU", "HFU", "peak GiB", "estimated GiB", "error %",
           "status")


def device_name(reduced: bool) -> str:
    """The GPU's name from nvidia-smi (this process never initialises CUDA: it would hold memory on the GPU the
    runs measure), or the CPU's."""
    if not reduced and shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def read_figures(run_dir: Path) -> dict[str, Any]:
    """Medians over the measured steps of one finished run, its peak memory and the estimate. Raises ValueError."""
    records = rundir.read_metrics(run_dir)
    perf = [r for r in records if "train/loss" in r and r.get("perf/tokens_per_s_per_device") is not None]
    if not perf:
        raise ValueError(f"{run_dir / rundir.METRICS_FILE} holds no perf/tokens_per_s_per_device")

    def median(key):
        values = [r[key] for r in perf if r.get(key) is not None]
        return statistics.median(values) if values else None

    mfu = median("perf/mfu")
    # perf/hfu is logged where activation checkpointing recomputes; otherwise the hardware does the model's FLOPs.
    hfu = median("perf/hfu") if any("perf/hfu" in r for r in perf) else mfu
    peaks = [r["memory/peak_gib"] for r in records if r.get("memory/peak_gib") is not None]
    estimates = [r["memory/estimated_gib"] for r in records if r.get("memory/estimated_gib") is not None]
    peak = max(peaks) if peaks else None
    estimate = estimates[-1] if estimates else None
    config = rundir.read_run_config(run_dir) or {}
    return {
        "tokens_per_s_per_gpu": median("perf/tokens_per_s_per_device"),
        "mfu": mfu,
        "hfu": hfu,
        "step_time_s": median("perf/step_time_s"),
        "peak_gib": peak,
        "estimated_gib": estimate,
        "estimate_error_pct": (estimate - peak) / peak * 100 if peak and estimate is not None else None,
        "num_measured_steps": len(perf),
        "loss": config.get("loss/implementation"),  # model.loss as the run resolved it
        "params": config.get("model/num_params"),
    }


def run_one(model_name: str, model: Model, setting: str, args: argparse.Namespace) -> dict[str, Any]:
    overrides = [*model.overrides, *args.data_overrides, *SETTINGS[setting], *args.overrides]
    row: dict[str, Any] = {"model": model_name, "setting": setting, "overrides": list(SETTINGS[setting]),
                           "micro_batch_size": None, "status": "ok", "detail": ""}
    try:
        loaded = load_recipe(ROOT / model.recipe, overrides)
    except ConfigError as exc:  # a setting this checkout's recipes do not have: a row, and the others still run
        print(f"bench_gpu: {model_name} / {setting}: refused: {exc}", flush=True)
        return {**row, "status": "refused", "detail": str(exc)}
    mbs = plan_batches(loaded.batch, 1, loaded.data.seq_len).micro_batch_size
    row.update(micro_batch_size=mbs, seq_len=loaded.data.seq_len, dtype=loaded.precision.dtype)
    run_dir = args.out / model_name / setting
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    # The setting's and the user's overrides last: they win over the measurement's (MBS agrees by construction).
    command = launch_command(args.accelerate_config, None, str(ROOT / model.recipe),
                             [*sweep_overrides(mbs, 1, args.steps, args.warmup_steps, run_dir), *overrides])
    print(f"bench_gpu: {model_name} / {setting}: MBS {mbs}, {args.warmup_steps} + {args.steps} steps ...", flush=True)
    code, stdout, stderr = run_process(command, run_dir / "run", args.timeout_s)
    if code != 0:
        out_of_memory = "out of memory" in stderr.lower() or "OutOfMemoryError" in stderr
        row.update(status="oom" if out_of_memory else "failed", detail=stderr_tail(stderr, stdout))
        return row
    try:
        row.update(read_figures(run_dir))
    except (ValueError, ConfigError) as exc:
        row.update(status="failed", detail=str(exc))
    return row


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [r["model"], r["setting"], r.get("loss") or "-", fmt(r["micro_batch_size"], "d"),
                 fmt(r.get("tokens_per_s_per_gpu"), ",.0f"), fmt(r.get("mfu"), ".1%"), fmt(r.get("hfu"), ".1%"),
                 fmt(r.get("peak_gib"), ".2f"), fmt(r.get("estimated_gib"), ".2f"),
                 fmt(r.get("estimate_error_pct"), "+.1f"), r["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def calibration(rows: list[dict[str, Any]], gpu: str) -> list[dict[str, Any]]:
    """The rows pretrain-plan --calibration reads (pretrain.cli.plan.read_calibration)."""
    return [{"gpu": gpu, "model": r["model"], "params": r["params"], "seq_len": r["seq_len"],
             "mbs": r["micro_batch_size"], "mfu": r["mfu"], **({"hfu": r["hfu"]} if r["hfu"] != r["mfu"] else {}),
             "tokens_per_s": r["tokens_per_s_per_gpu"], "settings": {"name": r["setting"], "overrides": r["overrides"]}}
            for r in rows if r["status"] == "ok"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reduced", action="store_true",
                        help="CPU: tiny recipe, accelerate_configs/cpu.yaml, 3 steps, settings loss-plain,loss-chunked")
    parser.add_argument("--models", help=f"comma-separated, of: {', '.join(MODELS)} (default: all)")
    parser.add_argument("--settings", help=f"comma-separated, of: {', '.join(SETTINGS)} (default: all)")
    parser.add_argument("--steps", type=int, help="measured optimizer steps per run (default 300; --reduced 3)")
    parser.add_argument("--warmup-steps", type=int,
                        help="steps left out of the figures (compile, allocator warm-up; default 20; --reduced 1)")
    parser.add_argument("--data", choices=("stdlib", "recipe"), default="stdlib",
                        help="stdlib: the offline standard-library corpus (default); recipe: the recipe's own data")
    parser.add_argument("--accelerate-config", help="default accelerate_configs/single_gpu.yaml (--reduced: cpu.yaml)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per run")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_gpu")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides applied to every run")
    args = parser.parse_args(argv)
    models = REDUCED_MODELS if args.reduced else MODELS
    names = args.models.split(",") if args.models else list(models)
    settings = args.settings.split(",") if args.settings else list(REDUCED_SETTINGS if args.reduced else SETTINGS)
    unknown = [n for n in names if n not in models] + [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown model or setting {', '.join(unknown)}; models: {', '.join(models)}; "
                     f"settings: {', '.join(SETTINGS)}")
    args.models, args.settings = {n: models[n] for n in names}, settings
    args.steps = args.steps or (3 if args.reduced else 300)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else (1 if args.reduced else 20)
    config = args.accelerate_config or f"accelerate_configs/{'cpu' if args.reduced else 'single_gpu'}.yaml"
    args.accelerate_config = str(ROOT / config) if not Path(config).is_absolute() else config
    args.data_overrides = STDLIB_DATA if args.data == "stdlib" and not args.reduced else ()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = device_name(args.reduced)
    rows = [run_one(name, model, setting, args) for name, model in args.models.items() for setting in args.settings]
    text = table(rows)
    print(f"\n{gpu}: {args.steps} measured steps after {args.warmup_steps} ({args.accelerate_config})\n\n{text}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['model']} / {r['setting']}: {r['status']}: {r['detail']}")
    (args.out / "bench_gpu.md").write_text(text)
    (args.out / "bench_gpu.json").write_text(json.dumps({"device": gpu, "steps": args.steps,
                                                         "warmup_steps": args.warmup_steps, "rows": rows}, indent=2))
    (args.out / "calibration.json").write_text(json.dumps(calibration(rows, gpu), indent=2) + "\n")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
