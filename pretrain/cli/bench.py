"""How much does the toolkit's training step cost over a hand-written accelerate loop?

    pretrain-bench --recipe recipes/tiny.yaml [--steps 10] [--repeats 5] [key.path=value ...]

One process builds ``Trainer(recipe)`` and then times, on the same prepared model, optimizer, scheduler,
DataLoader and device, blocks of N optimizer steps of

- the toolkit: ``trainer.engine.train_step(batches, ...)``, the loop's whole optimizer step;
- a minimal loop: ``with accelerator.accumulate(model): loss = model(...).loss; accelerator.backward(loss);
  optimizer.step(); scheduler.step(); optimizer.zero_grad()`` over the GAS micro-batches of a step (with
  ``accelerator.clip_grad_norm_`` when the recipe clips, since both loops must do the same math),

after one warm-up block of each. The two alternate, K repeats, toolkit first in odd repeats and minimal
first in even ones, so a slow drift of the machine (other jobs, clocks) weighs on both alike. Each block is timed whole
with ``time.perf_counter``; the ratio of a repeat is toolkit tokens/s over minimal tokens/s, and the verdict
is the median ratio (goal >= 0.97); the ratio of the fastest blocks of each is printed too, since other jobs
on a shared machine only ever slow a block down. Both loops draw from one iterator over the trainer's own
DataLoader, so data loading is inside both timings. Logging, evaluation and checkpoints are not part of either
(``Trainer.train`` adds them at their own cadence).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

from pretrain.cli import recipe_parser
from pretrain.cli.options import count
from pretrain.distributed.layout import Launch
from pretrain.errors import EXIT_USAGE, ConfigError

GOAL_RATIO = 0.97


def bench_overrides(output_dir: str, num_steps: int) -> list[str]:
    """Make Trainer(recipe) cheap and harmless: no trackers but JSONL, a throwaway output_dir, no resume."""
    return [
        "logging.backends=[jsonl]",
        "logging.progress=none",
        f"output_dir={output_dir}",
        "checkpoint.resume=none",
        "checkpoint.save_final_model=false",
        f"train.max_steps={num_steps}",  # the LR schedule spans the whole benchmark
        "train.max_tokens=null",
        "lr_schedule.warmup_steps=0",
    ]


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)  # expensive device-to-host synchronization: only at block edges


def toolkit_block(trainer, batches, num_steps: int) -> None:
    for _ in range(num_steps):
        trainer.engine.train_step(batches, trainer.throughput.data_wait)


def minimal_block(trainer, batches, num_steps: int) -> None:
    acc, model, optimizer, scheduler = trainer.accelerator, trainer.model, trainer.optimizer, trainer.scheduler
    device, gas, normaliser = trainer.device, trainer.plan.grad_accum_steps, trainer.engine.objective.normaliser
    clip = trainer.recipe.optim.grad_clip
    for _ in range(num_steps):
        for _ in range(gas):
            batch = next(batches).to(device)
            with acc.accumulate(model):
                loss = model(input_ids=batch.input_ids, labels=batch.targets, shift_labels=batch.targets,
                             num_items_in_batch=normaliser, **batch.attention_kwargs()).loss
                acc.backward(loss)
                if clip and acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                if acc.sync_gradients:  # the toolkit's accelerator leaves the schedule to the loop: once per step
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)


def timed(block, trainer, batches, num_steps: int) -> float:
    """Seconds for one block of num_steps optimizer steps."""
    synchronize(trainer.device)
    start = time.perf_counter()
    block(trainer, batches, num_steps)
    synchronize(trainer.device)
    return time.perf_counter() - start


def run(recipe_path: str, overrides: list[str], num_steps: int, repeats: int, output_dir: str) -> list[dict]:
    from pretrain.recipe.config import load_recipe
    from pretrain.train.trainer import Trainer

    total_steps = num_steps * 2 * (repeats + 1)
    recipe = load_recipe(recipe_path, [*overrides, *bench_overrides(output_dir, total_steps)])
    trainer = Trainer(recipe)
    try:
        trainer.model.train()
        batches = trainer.train_data.batches
        tokens = num_steps * trainer.plan.tokens_per_step
        p = trainer.plan
        print(f"bench: {recipe.name}, {trainer.parts.num_params:,} params, {trainer.device}, {recipe.precision.dtype}, "
              f"GBS {p.global_batch_size} = MBS {p.micro_batch_size} x GAS {p.grad_accum_steps}, "
              f"{p.tokens_per_step:,} tokens/step; blocks of {num_steps} steps, {repeats} repeats", flush=True)
        timed(toolkit_block, trainer, batches, num_steps)  # warm-up: allocator, kernels, first batches
        timed(minimal_block, trainer, batches, num_steps)
        rows = []
        for repeat in range(repeats):
            order = (("toolkit", toolkit_block), ("minimal", minimal_block))
            seconds = {name: timed(block, trainer, batches, num_steps)
                       for name, block in (order if repeat % 2 == 0 else order[::-1])}
            rows.append({"repeat": repeat + 1, "toolkit_tokens_per_s": tokens / seconds["toolkit"],
                         "minimal_tokens_per_s": tokens / seconds["minimal"],
                         "ratio": seconds["minimal"] / seconds["toolkit"]})
            print(f"bench: repeat {repeat + 1}/{repeats}: ratio {rows[-1]['ratio']:.3f}", flush=True)
        return rows
    finally:
        trainer.accelerator.end_training()


def format_table(rows: list[dict]) -> str:
    lines = [f"{'repeat':>6}  {'toolkit tokens/s':>16}  {'minimal tokens/s':>16}  {'ratio':>6}",
             f"{'-' * 6}  {'-' * 16}  {'-' * 16}  {'-' * 6}"]
    for r in rows:
        lines.append(f"{r['repeat']:>6}  {r['toolkit_tokens_per_s']:>16,.0f}  {r['minimal_tokens_per_s']:>16,.0f}  "
                     f"{r['ratio']:>6.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = recipe_parser("pretrain-bench", "Time the trainer's optimizer step against a minimal accelerate loop on the same "
                           "model and data (one process).", overrides_example="batch.micro_batch_size=8")
    parser.add_argument("--steps", type=count(), default=10, help="optimizer steps per timed block (default 10)")
    parser.add_argument("--repeats", type=count(), default=5, help="timed block pairs (default 5)")
    args = parser.parse_intermixed_args(argv)
    try:
        if Launch.from_env().world_size != 1:
            raise ConfigError("pretrain-bench runs in one process: start it with python, not accelerate launch")
        with tempfile.TemporaryDirectory(prefix="bench_loop-") as output_dir:
            rows = run(args.recipe, args.overrides, args.steps, args.repeats, output_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    ratio = statistics.median(r["ratio"] for r in rows)
    # Other jobs on the machine only ever slow a block down, so the fastest blocks are a second,
    # interference-resistant estimate of the same ratio.
    best_ratio = max(r["toolkit_tokens_per_s"] for r in rows) / max(r["minimal_tokens_per_s"] for r in rows)
    print()
    print(format_table(rows))
    print(f"fastest blocks: toolkit/minimal {best_ratio:.3f}")
    verdict = "meets" if ratio >= GOAL_RATIO else "misses"
    print(f"median ratio toolkit/minimal: {ratio:.3f} ({verdict} the goal >= {GOAL_RATIO})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
