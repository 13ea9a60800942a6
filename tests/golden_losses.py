"""Golden per-step losses: what the code produced before the redesign, to be reproduced after it.

Regenerate (only when a change is *meant* to alter the numbers, and say why in the commit):

    python -m tests.golden_losses --write

Each curve is the per-step `train/loss` from `metrics.jsonl` of a real run of the entry point:
- ``tiny_1proc_fp32``: the first 20 optimizer steps of ``recipes/tiny.yaml`` in 1 process, fp32.
  ``train.max_steps=21`` keeps the recipe's 20-step linear warm-up: during warm-up transformers'
  cosine schedule does not depend on the horizon, so steps 1-20 are those of the 300-step demo.
- ``cpu_ddp`` and ``zero2``: the 2-process curves of ``tests/multiprocess/test_distributed.py`` (GBS 8, MBS 2).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.helpers import FAST, accelerate_launch, check_ok, train, train_losses

GOLDEN = Path(__file__).resolve().parent / "golden" / "losses.json"
REL_TOL = 1e-6

TINY_ARGS = ["train.max_steps=21", "logging.every_steps=1", "eval.batches=1", "eval.tasks=[]", "checkpoint.every_steps=0",
             "checkpoint.save_last=false", "checkpoint.save_final_model=false", "logging.progress=plain"]
TINY_STEPS = range(1, 21)

DIST_STEPS = 6
DIST_ARGS = [*FAST, "batch.micro_batch_size=2", f"train.max_steps={DIST_STEPS}", "checkpoint.every_steps=3",
             "checkpoint.keep_last=0"]
DIST_CONFIGS = {"cpu_ddp": ("cpu_ddp.yaml", []), "zero2": ("zero2.yaml", ["--num_processes", "2"])}


def load() -> dict[str, dict[int, float]]:
    raw = json.loads(GOLDEN.read_text())
    return {name: {int(step): loss for step, loss in curve.items()} for name, curve in raw["curves"].items()}


def run_tiny(out: Path) -> dict[int, float]:
    check_ok(train([*TINY_ARGS, f"output_dir={out}"]))
    losses = train_losses(out)
    return {step: losses[step] for step in TINY_STEPS}


def run_dist(name: str, out: Path) -> dict[int, float]:
    config, extra = DIST_CONFIGS[name]
    check_ok(accelerate_launch(config, [*DIST_ARGS, f"output_dir={out}"], extra=extra))
    return train_losses(out)


def mismatches(name: str, curve: dict[int, float], golden: dict[int, float]) -> list[str]:
    out = [f"{name}: steps {sorted(curve)} != golden steps {sorted(golden)}"] if sorted(curve) != sorted(golden) else []
    for step, loss in golden.items():
        got = curve.get(step)
        if got is None or abs(got - loss) > REL_TOL * abs(loss):
            out.append(f"{name} step {step}: {got!r} != golden {loss!r}")
    return out


def main(argv: list[str]) -> int:
    if argv != ["--write"]:
        print(__doc__)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        curves = {"tiny_1proc_fp32": run_tiny(Path(tmp) / "tiny")}
        for name in DIST_CONFIGS:
            curves[name] = run_dist(name, Path(tmp) / name)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"regenerate": "python -m tests.golden_losses --write", "curves": curves},
                                 indent=1) + "\n")
    print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
