"""Peak resident memory (RSS) per rank while a run sets up: model build + init + accelerator.prepare.

Two CPU processes per layout, a ~500M-parameter Llama (hidden 1536, 14 layers, vocab 32000, untied):

    python tools/setup_memory.py                                    # this checkout's pretrain
    python tools/setup_memory.py --code /work/main --layouts zero3  # another checkout's (e.g. "before")

Every layout runs the real ``Trainer`` set-up under ``accelerate launch`` (accelerate_configs cpu_ddp / zero2 /
zero3 / fsdp, 2 processes; the tiny recipe's data, the shape above); FSDP is torch's FSDP2 over gloo, as pretrain
runs it without GPUs (``pretrain.distributed.accelerator.fsdp_on_cpu``). Figures, per rank, the larger of the two:

    baseline   RSS after importing pretrain.train.trainer (python, torch, transformers, accelerate)
    pre-build  RSS just before build_model (accelerator, data, tokenizer ready)
    build      peak RSS up to the end of build_model (construction + init)
    set-up     peak RSS up to the end of set-up (+ optimizer + accelerator.prepare)

Slow and heavy (several GiB of RAM per layout): not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAG = "SETUP_MEMORY "
SHAPE = {"hidden_size": 1536, "num_layers": 14, "num_heads": 12, "num_kv_heads": 12, "intermediate_size": 4096,
         "vocab_size": 32000, "tie_embeddings": False}
CONFIGS = {"ddp": "cpu_ddp.yaml", "zero2": "zero2.yaml", "zero3": "zero3.yaml", "fsdp": "fsdp.yaml"}
LAYOUTS = tuple(CONFIGS)
GIB = 2**30


def rss_bytes() -> int:
    """The resident set size now (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status: this tool reads Linux's /proc")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def report(figures: dict) -> None:
    # one write(2) of a whole line: the two ranks share the pipe, and a print may be split between them
    os.write(1, (TAG + json.dumps({"rank": int(os.environ.get("RANK", 0)), **figures}) + "\n").encode())


def trainer_worker(overrides: list[str]) -> None:
    import pretrain.train.model_parts as parts_module
    import pretrain.train.trainer as train_module

    figures = {"baseline": rss_bytes()}
    build = parts_module.build_model

    def measured_build(*args, **kwargs):
        figures["pre_build"] = rss_bytes()
        model = build(*args, **kwargs)
        figures["build"] = peak_rss_bytes()
        figures["num_params"] = parts_module.count_parameters(model)
        return model

    parts_module.build_model = measured_build  # where the trainer's model parts are built
    from pretrain.recipe.config import load_recipe

    train_module.Trainer(load_recipe(ROOT / "recipes" / "tiny.yaml", overrides))
    figures["setup"] = peak_rss_bytes()
    report(figures)
    # DeepSpeed on CPU/gloo can abort in C++ destructors at exit; the figures are out.
    os._exit(0)


def measure(layout: str, code: Path, shape: dict) -> list[dict]:
    """Run one layout on 2 processes with ``code``'s pretrain; the figures of each rank."""
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "DS_ACCELERATOR": "cpu",
           "TOKENIZERS_PARALLELISM": "false"}
    me = [str(Path(__file__).resolve()), "--shape", json.dumps(shape)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / CONFIGS[layout]), "--num_processes", "2", *me, "--worker", "trainer"]
    with tempfile.TemporaryDirectory() as out:  # one output_dir shared by both processes, as a run's is
        run = subprocess.run([*cmd, "--output-dir", out], cwd=ROOT, env=env, capture_output=True, text=True)
    rows = [json.loads(line[len(TAG):]) for line in run.stdout.splitlines() if line.startswith(TAG)]
    if len(rows) != 2:
        raise SystemExit(f"{layout}: the run did not report (exit {run.returncode}):\n{run.stdout[-3000:]}"
                         f"\n{run.stderr[-5000:]}")
    return rows


def trainer_overrides(shape: dict) -> list[str]:
    return [*(f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in shape.items()),
            "data.seq_len=64", "batch.global_batch_size=2", "batch.micro_batch_size=1",
            "lr_schedule.warmup_steps=1", "train.max_steps=10", "logging.progress=plain", "checkpoint.resume=none"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout whose pretrain package is measured")
    parser.add_argument("--shape", type=json.loads, default=SHAPE, help="model section fields, as JSON")
    parser.add_argument("--worker", choices=("trainer",), help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "trainer":
        return trainer_worker([*trainer_overrides(args.shape), f"output_dir={args.output_dir}"])

    print(f"pretrain from {args.code}; 2 CPU processes; peak RSS per rank (the larger rank), GiB")
    print("| layout | fp32 model | baseline | pre-build | build + init | set-up | set-up - pre-build |")
    print("|---|---|---|---|---|---|---|")
    for layout in args.layouts:
        rows = measure(layout, args.code.resolve(), args.shape)
        model = rows[0]["num_params"] * 4 / GIB
        worst = {key: max(r[key] for r in rows) for key in ("baseline", "pre_build", "build", "setup")}
        net = max(r["setup"] - r["pre_build"] for r in rows) / GIB
        print(f"| {layout} | {model:.2f} | {worst['baseline'] / GIB:.2f} | {worst['pre_build'] / GIB:.2f} | "
              f"{worst['build'] / GIB:.2f} | {worst['setup'] / GIB:.2f} | {net:.2f} ({net / model:.2f}x) |",
              flush=True)


if __name__ == "__main__":
    main()
