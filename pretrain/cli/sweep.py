"""Find the micro batch size that saturates the device: the tuning playbook's batch-size sweep.

    pretrain-sweep --recipe recipes/tiny.yaml [--accelerate-config accelerate_configs/cpu.yaml]
        [--num-processes N] [--max-memory-gib G] [--steps 5] [--warmup-steps 2] [--max-mbs 256] [--repeats 1]
        [--timeout-s S] [--out DIR] [key.path=value ...]

For MBS = 1, 2, 4, ... it launches the real entry point (``pretrain/run.py``, under ``accelerate launch``
when an accelerate config is given) for W + N optimizer steps at GAS 1 (GBS = MBS x world) and reads that
run's metrics.jsonl: tokens/s and time per step are medians over the N measured steps (the first W are
left out), peak memory is the largest logged ``memory/peak_gib`` (rank 0). The sweep stops at the first
out-of-memory error, the first peak above --max-memory-gib, any other failure, or --max-mbs; it prints a
table, writes ``<out>/sweep.json`` and ``<out>/sweep.png``, says where throughput stops scaling, and
recommends an MBS with the GAS that reaches the recipe's GBS. On a machine shared with other jobs,
``--repeats R`` re-runs every MBS that fit R - 1 more times, in interleaved rounds, and reports each
MBS's fastest run (other jobs only ever slow a run down).

Each run writes to ``<out>/mbs_<MBS>/`` and its console output to ``<out>/mbs_<MBS>.log`` and
``.stderr.log``; the checkpoint a run always saves at its last step is deleted once its metrics are read,
so a sweep of a large model does not fill the disk.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from pretrain.cli import recipe_parser
from pretrain.cli.options import count, positive_gib, positive_seconds
from pretrain.errors import EXIT_USAGE, ConfigError
from pretrain.plan.sweep import SCALING_THRESHOLD, MBSResult, analyse, format_table, measure, plot, repeat_rounds
from pretrain.plan.sweep.analysis import fmt
from pretrain.plan.sweep.runner import accelerate_args, sweep_overrides


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = recipe_parser("pretrain-sweep", "Measure tokens/s, time per step and peak memory for MBS = 1, 2, 4, "
                           "... at GAS 1, and recommend an MBS (the tuning playbook's batch-size sweep).",
                           overrides_example="model.num_layers=2")
    parser.add_argument("--accelerate-config",
                        help="accelerate config YAML; none = one process (python pretrain/run.py)")
    parser.add_argument("--num-processes", type=count(), help="override the accelerate config's num_processes")
    parser.add_argument("--max-memory-gib", type=positive_gib, help="stop at the first MBS whose peak memory exceeds this")
    parser.add_argument("--steps", type=count(), default=5, help="measured optimizer steps per MBS (default 5)")
    parser.add_argument("--warmup-steps", type=count(0), default=2,
                        help="optimizer steps per MBS left out of the measurement (default 2)")
    parser.add_argument("--max-mbs", type=count(), default=256, help="largest MBS to try (default 256)")
    parser.add_argument("--repeats", type=count(), default=1,
                        help="runs per MBS on a shared machine: rounds after the first re-run the MBS that "
                        "fit, interleaved, and each MBS reports its fastest run (default 1)")
    parser.add_argument("--timeout-s", type=positive_seconds, help="kill a run that takes longer than this (default: no limit)")
    parser.add_argument("--out", help="output directory (default <recipe output_dir>/sweep)")
    return parser.parse_intermixed_args(argv)


def check_inputs(args: argparse.Namespace) -> tuple[object, int, int, Path]:
    """Validate everything before the first launch: (recipe, world size, the recipe's GBS, output dir)."""
    from pretrain.distributed.layout import Launch
    from pretrain.recipe.config import load_recipe
    from pretrain.train.preflight import check_run

    if args.num_processes is not None and args.accelerate_config is None:
        raise ConfigError("--num-processes needs --accelerate-config (without one the sweep runs one process)")
    recipe = load_recipe(args.recipe, args.overrides)
    launch = (Launch.from_accelerate_config(args.accelerate_config,
                                            accelerate_args(args.accelerate_config, args.num_processes))
              if args.accelerate_config is not None else Launch())
    world = launch.world_size
    # The recipe's own GBS on this world size is the target the recommendation must reach.
    batch = recipe.batch
    gbs = batch.local_batch_size * world if batch.local_batch_size is not None else batch.global_batch_size
    out = Path(args.out or Path(recipe.output_dir) / "sweep").resolve()
    # The first launch, checked as pretrain-launch checks it: batch math, schedule, precision, DeepSpeed JSON.
    first = [*args.overrides, *sweep_overrides(1, world, args.steps, args.warmup_steps, out / "mbs_1")]
    check_run(load_recipe(args.recipe, first), launch)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out} cannot be created ({exc.strerror or exc}); choose another directory") from None
    return recipe, world, gbs, out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        recipe, world, gbs, out = check_inputs(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    results: list[MBSResult] = []
    stop = {"mbs": None, "reason": "max_mbs", "detail": f"reached --max-mbs {args.max_mbs}"}
    mbs = 1
    try:
        while mbs <= args.max_mbs:
            result = measure(mbs, args, world, out)
            results.append(result)
            if result.measured:
                print(f"sweep: MBS {mbs}: {result.tokens_per_s:,.0f} tokens/s, {result.step_time_s:.4f} s/step, "
                      f"peak {fmt(result.peak_gib, '.2f')} GiB", flush=True)
            if result.status != "ok":
                stop = {"mbs": mbs, "reason": result.status, "detail": result.detail}
                break
            mbs *= 2
        if stop["reason"] != "failed":
            repeat_rounds(results, args, world, out)
    except KeyboardInterrupt:
        stop = {"mbs": mbs, "reason": "interrupted", "detail": "interrupted by the user"}

    analysis = analyse(results, gbs, world)
    print()
    print(format_table(results))
    print()
    if stop["reason"] in ("oom", "over_memory_limit"):
        print(f"stopped at MBS {stop['mbs']}: {stop['detail']}")
    elif stop["reason"] == "failed":
        log = out / f"mbs_{stop['mbs']}.stderr.log"
        print(f"stopped at MBS {stop['mbs']}: the run failed (full output in {log}): {stop['detail']}", file=sys.stderr)
    elif stop["reason"] == "interrupted":
        print(f"stopped at MBS {stop['mbs']}: interrupted")
    else:
        print(f"stopped: {stop['detail']}")
    if analysis["scaling_stops_at_mbs"] is not None:
        m = analysis["scaling_stops_at_mbs"]
        factor = next(r.scaling for r in results if r.mbs == 2 * m)
        print(f"diminishing returns from MBS {m}: doubling to MBS {2 * m} gives {factor:.2f}x tokens/s "
              f"(< {SCALING_THRESHOLD}x); a larger MBS may still be somewhat faster (the recommendation below)")
    elif sum(r.measured for r in results) > 1:
        print(f"throughput still scales (>= {SCALING_THRESHOLD}x per doubling) up to the largest measured MBS")
    print(analysis["message"])
    print("note: gradient accumulation adds no throughput; it only reaches a large GBS with a micro batch that "
          "fits in memory")

    report = {
        "recipe": args.recipe,
        "recipe_name": recipe.name,
        "accelerate_config": args.accelerate_config,
        "world_size": world,
        "seq_len": recipe.data.seq_len,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "max_mbs": args.max_mbs,
        "repeats": args.repeats,
        "max_memory_gib": args.max_memory_gib,
        "overrides": args.overrides,
        "results": [asdict(r) for r in results],
        "stopped": stop,
        **analysis,
    }
    json_path, png_path = out / "sweep.json", out / "sweep.png"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    title = f"{recipe.name}: batch-size sweep, world {world}, seq_len {recipe.data.seq_len}"
    plot(results, analysis, png_path, title, args.max_memory_gib)
    print(f"wrote {json_path} and {png_path}")
    if stop["reason"] == "interrupted":
        return 130
    return 1 if stop["reason"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
