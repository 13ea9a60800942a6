"""Every kind of checkpoint resumed on every other kind, end to end: the table of docs/checkpoints.md.

    python tools/resume_matrix.py [--out DIR] [--steps 6]

Six uninterrupted runs of the tests' small model (one process, DDP on 2, FSDP2 on 2, ZeRO-1/2/3 on 2; GBS 6,
MBS 1, a checkpoint at half the steps), then each one's middle checkpoint resumed under each of the five other
kinds (two processes, three for DDP, one for one process), to the end. Each cell is the largest relative
difference of the resumed run's per-step loss from its source's uninterrupted loss, or what failed (36 launches:
minutes on 2 CPU cores). tests/checkpoint/test_reshard.py checks a ring of six of these pairs and the neutral
states in the suite.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = {  # name: (accelerate config, processes as a source, processes as a target)
    "one process": ("cpu.yaml", 1, 1),
    "DDP": ("cpu_ddp.yaml", 2, 3),
    "FSDP2": ("fsdp.yaml", 2, 2),
    "ZeRO-1": ("zero1.yaml", 2, 2),
    "ZeRO-2": ("zero2.yaml", 2, 2),
    "ZeRO-3": ("zero3.yaml", 2, 2),
}
MODEL = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.intermediate_size=128",
         "data.seq_len=64", "eval.every_steps=0", "eval.tasks=[]", "lr_schedule.warmup_steps=1",
         "logging.every_steps=1"]


def launch(config: str, processes: int, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / config),
           "--num_processes", str(processes), str(ROOT / "pretrain" / "run.py"), "--recipe",
           str(ROOT / "recipes" / "tiny.yaml"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "train/loss" in record:
            out[record["step"]] = record["train/loss"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="resume-matrix-"))
    middle = args.steps // 2
    common = [*MODEL, "batch.global_batch_size=6", "batch.micro_batch_size=1", f"train.max_steps={args.steps}",
              f"checkpoint.every_steps={middle}", "checkpoint.keep_last=0", "checkpoint.save_final_model=false"]
    sources = {}
    for name, (config, processes, _) in KINDS.items():
        run = out / name.replace(" ", "_")
        proc = launch(config, processes, [*common, f"output_dir={run}"])
        if proc.returncode != 0:
            print(f"source {name} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
            return 1
        sources[name] = run
        print(f"source {name}: {len(losses(run))} steps", file=sys.stderr)
    cells: dict[tuple[str, str], str] = {}
    for source, run in sources.items():
        checkpoint = run / "checkpoints" / f"step_{middle:08d}"
        reference = losses(run)
        for target, (config, _, processes) in KINDS.items():
            if target == source:
                cells[source, target] = "(same kind)"
                continue
            resumed = out / f"{source}_to_{target}".replace(" ", "_")
            proc = launch(config, processes, [*common, f"output_dir={resumed}", f"checkpoint.resume={checkpoint}"])
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["?"])[-1]
                cells[source, target] = f"exit {proc.returncode}: {last[:80]}"
            else:
                curve = losses(resumed)
                worst = max(abs(loss / reference[step] - 1) for step, loss in curve.items())
                cells[source, target] = f"{worst:.0e}" if worst else "0"
            print(f"{source} -> {target} on {processes}: {cells[source, target]}", file=sys.stderr)
    names = list(KINDS)
    print(f"| written by \\ resumed by | {' | '.join(f'{n} ({KINDS[n][2]})' for n in names)} |")
    print(f"|---|{'---|' * len(names)}")
    for source in names:
        print(f"| {source} ({KINDS[source][1]}) | {' | '.join(cells[source, t] for t in names)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
