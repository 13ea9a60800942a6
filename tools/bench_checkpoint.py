"""Checkpoint stall benchmark: the seconds the training loop is blocked by each save, ``checkpoint.async`` false
against true, on a ~0.5B Llama on CPU (one process).

    python tools/bench_checkpoint.py [--steps 6] [--every 2] [--repeats 1] [--small]

The model is the tiny recipe (recipes/tiny.yaml: its data, tokenizer and fp32 AdamW) at the 0.5B shape of the
set-up memory figures (tools/setup_memory.py): 494.7M parameters, hidden 1536, 14 blocks of 12 heads, SwiGLU
width 4096, vocabulary 32000, untied. One sequence of 32 tokens per step: the steps are short; the checkpoints
(fp32 weights and AdamW's two moments, 5.5 GiB) are what is measured.
``--small`` uses the tests' 2-block model instead (seconds, to try the tool).

Each mode runs as a fresh process through the Trainer (pretrain/run.py's code) into a temporary output_dir that
is deleted afterwards: ``--steps`` optimizer steps with a checkpoint every ``--every`` and at the last step
(keep_last 1, no final model). It prints, per save, the loop's stall (``Checkpointer.stalls_s``: from the call
of the save to its return, the wait for a previous background write included) and the time until the checkpoint
was complete (``writes_s``: save_state to the rename, in the background when async), then the medians. With
``--repeats`` the two modes alternate (sync first in odd repeats), so a drifting shared machine weighs on both.
Run it on a quiet machine and give the load (``uptime``) with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "BENCH "
# docs/performance.md's 0.5B model (tools/setup_memory.py's): 494.7M parameters.
HALF_B = ["model.hidden_size=1536", "model.num_layers=14", "model.num_heads=12", "model.num_kv_heads=12",
          "model.intermediate_size=4096", "model.vocab_size=32000", "model.tie_embeddings=false", "data.seq_len=32",
          "batch.global_batch_size=1", "batch.micro_batch_size=1"]
SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=4",
         "model.intermediate_size=128", "data.seq_len=32", "batch.global_batch_size=1", "batch.micro_batch_size=1"]


def child(mode: str, output_dir: str, steps: int, every: int, small: bool) -> None:
    """One run in this process: the Trainer as pretrain/run.py builds it; prints the figures as one JSON line."""
    from pretrain.recipe.config import load_recipe
    from pretrain.train.trainer import Trainer

    overrides = [*(SMALL if small else HALF_B), f"train.max_steps={steps}", "train.max_tokens=null",
                 "lr_schedule.warmup_steps=1", "eval.at_start=false", "eval.batches=1",
                 f"checkpoint.every_steps={every}", "checkpoint.keep_last=1", "checkpoint.save_final_model=false",
                 "checkpoint.resume=none", f"checkpoint.async={mode == 'async'}", "logging.every_steps=1",
                 "logging.progress=plain", f"output_dir={output_dir}"]
    trainer = Trainer(load_recipe(str(ROOT / "recipes" / "tiny.yaml"), overrides))
    trainer.train()
    steps_s = [m["perf/step_time_s"] for m in map(json.loads, (Path(output_dir) / "metrics.jsonl").open())
               if m.get("perf/step_time_s") is not None]
    print(MARKER + json.dumps({"mode": mode, "num_params": trainer.parts.num_params, "stalls_s": trainer.checkpointer.stalls_s,
                               "writes_s": trainer.checkpointer.writes_s, "step_time_s": steps_s}), flush=True)


def run(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=args.tmp) as tmp:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, tmp, "--steps", str(args.steps),
               "--every", str(args.every), *(["--small"] if args.small else [])]
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True,
                              text=True)
        found = [line[len(MARKER):] for line in proc.stdout.splitlines() if line.startswith(MARKER)]
        if proc.returncode != 0 or not found:
            sys.exit(f"bench_checkpoint: the {mode} run exited {proc.returncode}:\n{proc.stdout[-3000:]}"
                     f"\n{proc.stderr[-3000:]}")
        return json.loads(found[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    parser.add_argument("--every", type=int, default=2, help="checkpoint every N steps (default 2)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode (default 1)")
    parser.add_argument("--small", action="store_true", help="the tests' 2-block model instead of 0.5B")
    parser.add_argument("--tmp", default=None, help="where the runs' output_dirs go (default: the system's temp)")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "OUTPUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], args.steps, args.every, args.small)
        return 0
    if args.steps < 1 or args.every < 1 or args.repeats < 1:
        parser.error("--steps, --every and --repeats must be >= 1")
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    for i in range(args.repeats):
        for mode in (("sync", "async") if i % 2 == 0 else ("async", "sync")):
            result = run(mode, args)
            results[mode].append(result)
            print(f"repeat {i + 1}  {mode:<5}  stall per save " + " ".join(f"{s:6.2f}" for s in result["stalls_s"])
                  + " s;  complete after " + " ".join(f"{s:6.2f}" for s in result["writes_s"]) + " s", flush=True)
    params = results["sync"][0]["num_params"]
    print(f"\n{params / 1e9:.2f}B parameters, {args.steps} steps, a checkpoint every {args.every} and at the end; "
          f"load average at the end {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"{'':<7}{'stall median':>14}{'stall max':>11}{'complete median':>17}{'step median':>13}")
    for mode, found in results.items():
        stalls = [s for r in found for s in r["stalls_s"]]
        writes = [s for r in found for s in r["writes_s"]]
        steps = [s for r in found for s in r["step_time_s"]]
        print(f"{mode:<7}{statistics.median(stalls):13.2f}s{max(stalls):10.2f}s{statistics.median(writes):16.2f}s"
              f"{statistics.median(steps):12.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
