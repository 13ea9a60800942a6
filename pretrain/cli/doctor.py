"""`pretrain doctor`: check every rank of a launch (compute, memory, host copies, collectives, output_dir) and
name the hosts below the threshold. Run it under the launcher that will train:

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml --num_processes 3 -m pretrain doctor \\
        --recipe recipes/tiny.yaml [key.path=value ...]
    pretrain-launch --doctor --config_file ... --recipe ...    (the check, then training if it passes)
    pretrain-slurm submit ...                                   (the check first in every job; --no-doctor: off)

Without a recipe: ``--output-dir DIR --dtype bf16``. Exit 0: every host healthy; 1: the hosts below the
threshold are named with the figure, its value and the median (also in output_dir/doctor.json); 2: bad input.
What each figure is and how the verdict is made: pretrain/distributed/doctor.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pretrain.distributed.doctor import (
    DEFAULT_THRESHOLD,
    EXIT_UNHEALTHY,
    HOSTNAME_ENV,
    SLOW_FACTOR_ENV,
    SLOW_RANK_ENV,
    Settings,
    append_excluded,
    failing_hosts,
    host_tables,
    run_checks,
    tracker_values,
    verdict_text,
    write_report,
)
from pretrain.distributed.supervise import run_worker
from pretrain.errors import EXIT_USAGE, ConfigError

EPILOG = (f"Test hooks (environment): {SLOW_RANK_ENV}=R[,R...] makes those ranks' timed regions "
          f"{SLOW_FACTOR_ENV} (default 4) times as long, so their hosts are named; {HOSTNAME_ENV}=NAME or "
          "NAME0,NAME1,... (one per rank) gives ranks host names (on one machine, several 'hosts'). "
          "Recipe overrides: trailing key.path=value pairs.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain-doctor", description=__doc__.split("\n\n")[0], epilog=EPILOG)
    parser.add_argument("--recipe", help="recipe YAML: output_dir, precision.dtype, logging (peak_tflops, trackers)")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="recipe overrides (values are YAML)")
    parser.add_argument("--output-dir", help="without a recipe: the directory to check (doctor.json goes there)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="without a recipe: the matmul dtype "
                        "(default fp32)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help=f"a rank fails a figure below this fraction of the figure's median over all ranks "
                        f"(default {DEFAULT_THRESHOLD})")
    parser.add_argument("--exclude-file", help="append the failing hosts to this file, one a line (pretrain-slurm's "
                        "job passes output_dir/slurm/excluded_hosts and requeues without them)")
    return parser


def settings_from_args(args: argparse.Namespace):
    """(Settings, recipe or None); ConfigError for bad input."""
    problems = []
    if not 0 < args.threshold <= 1:
        problems.append(f"--threshold must be a fraction in (0, 1], e.g. 0.8 (got {args.threshold})")
    if args.recipe is None and args.output_dir is None:
        problems.append("give --recipe R (its output_dir and precision.dtype) or --output-dir DIR [--dtype bf16]")
    if args.recipe is not None and (args.output_dir is not None or args.dtype is not None):
        problems.append("--output-dir and --dtype are for a check without a recipe; with --recipe override "
                        "output_dir=... or precision.dtype=... instead")
    if args.recipe is None and args.overrides:
        problems.append(f"overrides {args.overrides} need --recipe")
    if problems:
        raise ConfigError(problems)
    exclude = Path(args.exclude_file) if args.exclude_file else None
    if args.recipe is None:
        return Settings(Path(args.output_dir), args.dtype or "fp32", args.threshold, exclude_file=exclude), None
    from pretrain.data import cache_root
    from pretrain.recipe.config import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    return Settings(Path(recipe.output_dir), recipe.precision.dtype, args.threshold, recipe.logging.peak_tflops,
                    cache_root(recipe.data), exclude), recipe


def start(recipe, settings: Settings):
    """The process group (gloo on CPU, as training joins it) and, with a recipe, its trackers under
    output_dir/doctor/ (the run's own metrics.jsonl is the training's: a fresh run rewrites it)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from pretrain.distributed.layout import Launch
    from pretrain.system.environment import check_environment
    from pretrain.train.tracking import build_trackers

    launch = Launch.from_env()
    # The environment first: a package below its floor, one the recipe asks for, GPUs torch cannot see.
    check_environment(recipe, launch, gpu_launch=os.environ.get("ACCELERATE_USE_CPU", "").lower() != "true")
    cpu = not torch.cuda.is_available()
    if recipe is not None and launch.is_main:
        (settings.output_dir / "doctor").mkdir(parents=True, exist_ok=True)  # the trackers write there at once
    trackers = (build_trackers(recipe, settings.output_dir / "doctor", None, launch.is_main)
                if recipe is not None else [])
    handlers = [InitProcessGroupKwargs(backend="gloo")] if cpu and launch.world_size > 1 else []
    accelerator = Accelerator(cpu=cpu, log_with=trackers or None, project_dir=str(settings.output_dir / "doctor"),
                              kwargs_handlers=handlers)
    if accelerator.num_processes != launch.world_size:
        raise ConfigError(f"the launch reported WORLD_SIZE={launch.world_size} but accelerate started "
                          f"{accelerator.num_processes} processes; check the accelerate config")
    return accelerator


def matmul(settings: Settings, device):
    """The torch dtype the checks multiply in, and this device's peak in it (the run's own resolution)."""
    import torch

    from pretrain.train.metrics import _CPU_DTYPES, resolve_peak

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = resolve_peak(device.type, name, settings.dtype, settings.peak_tflops, cache_dir=settings.cache_dir)
    return _CPU_DTYPES[settings.dtype], peak  # the torch dtype of a recipe dtype (not CPU-specific)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return run_worker(lambda: check(args))  # a worker's exit code is its own (pretrain/distributed/supervise.py)


def check_writable(settings) -> None:
    """Where the report and the exclude file go can be written: found before any check runs (it was a
    traceback after them)."""
    from pretrain.errors import writable_dir

    writable_dir(settings.output_dir, f"the doctor's output_dir {settings.output_dir}",
                 "give --output-dir (or the recipe's output_dir) a directory you can write")
    exclude = settings.exclude_file
    if exclude is None:
        return
    if exclude.is_dir():
        raise ConfigError(f"--exclude-file {exclude} is a directory; give the file pretrain-slurm reads, e.g. "
                          "runs/exclude.txt")
    writable_dir(exclude.parent, f"--exclude-file's directory {exclude.parent}",
                 "give --exclude-file a file in a directory you can write")
    if exclude.exists():
        try:
            with open(exclude, "a"):
                pass
        except OSError as exc:
            raise ConfigError(f"--exclude-file {exclude} cannot be appended to ({exc.strerror or exc}); give a file "
                              "you can write") from None


def check(args: argparse.Namespace) -> int:
    try:
        settings, recipe = settings_from_args(args)
        check_writable(settings)  # every rank, before the process group: each stops alike (a shared filesystem)
        accelerator = start(recipe, settings)
        report, failures = run_checks(settings, accelerator, *matmul(settings, accelerator.device))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if accelerator.is_main_process:
        path = write_report(report, settings.output_dir)
        if recipe is not None:
            accelerator.init_trackers(recipe.logging.project, config={"doctor/threshold": settings.threshold})
            accelerator.log(tracker_values(report), step=0)
        hosts = failing_hosts(failures)
        if hosts and settings.exclude_file is not None:
            append_excluded(settings.exclude_file, list(hosts))
        print(f"doctor: {report['world_size']} rank(s) on {len(report['hosts'])} host(s), {settings.dtype}, "
              f"peak {report['peak']}")
        print(host_tables(report["ranks"], settings.threshold, report["peak_tflops"]))
        print(verdict_text(failures, settings.threshold, len(report["hosts"])))
        print(f"doctor: figures in {path}", flush=True)
    accelerator.wait_for_everyone()  # no rank leaves (and tears the group down) before rank 0's report
    accelerator.end_training()
    return EXIT_UNHEALTHY if failures else 0


if __name__ == "__main__":
    sys.exit(main())
