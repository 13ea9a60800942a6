"""Entry point: parse, load the recipe, build, train, close.

    accelerate launch --config_file accelerate_configs/cpu.yaml pretrain/run.py --recipe recipes/tiny.yaml [key=value ...]
    accelerate launch --config_file accelerate_configs/cpu.yaml -m pretrain.run --recipe recipes/tiny.yaml
    python pretrain/run.py --recipe recipes/tiny.yaml [--print-config | --dry-run] [key.path=value ...]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from pretrain.cli import add_recipe_arguments
from pretrain.cli.options import add_dry_run_arguments, check_options
from pretrain.distributed.layout import Launch
from pretrain.errors import EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_USAGE, ConfigError, TrainingDiverged
from pretrain.system.environment import check_environment, use_environment_op_builds
from pretrain.system.quiet import install_warning_filters


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(  # prog: as invoked (run.py, pretrain-train, pretrain train)
        description="Pretrain a language model from a recipe YAML.",
        epilog="Overrides: trailing key.path=value pairs, e.g. train.max_steps=40 optim.lr=1e-3 output_dir=/tmp/run1",
    )
    add_recipe_arguments(parser, "recipes/tiny.yaml")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    mode.add_argument(
        "--dry-run",
        action="store_true",
        help="check the recipe on a launch and exit: batch plan, parameters, the memory estimate per GPU and whether "
        "it fits, the speed pretrain-plan's model expects, the best layout (or what would fit); see the options below",
    )
    add_dry_run_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    install_warning_filters()  # before the libraries are imported: some warn on import
    from pretrain.distributed.supervise import run_worker, stop_with_launcher

    stop_with_launcher()  # a worker of torchrun ends with its launcher (kill -9 of accelerate launch too)
    args = parse_args(argv)
    # A worker of a multi-process launch leaves without the interpreter's teardown, whose gloo threads could
    # turn its exit code into SIGABRT (pretrain/distributed/supervise.py).
    return run_worker(lambda: _main(args))


STARTING = "imports, the token store, the model or the resume"


def _main(args: argparse.Namespace) -> int:
    from pretrain.distributed.preemption import StopSignals

    # The stop signals from the start to the end: while the run starts a signal stops it at once (StopRequested), from
    # the training loop on it stops after the step in flight with a checkpoint (distributed/preemption.py).
    with StopSignals(immediate=True) as stop:
        return _run(args, stop)


def _run(args: argparse.Namespace, stop) -> int:
    is_main = True
    try:
        from pretrain.recipe.config import AUTO, load_recipe
        from pretrain.trust import enforce

        enforce()  # every torch.load of this run is weights-only (pretrain/trust.py)
        use_environment_op_builds()  # DeepSpeed's ops built in this environment's own directory, not every venv's

        launch = Launch.from_env()
        is_main = launch.is_main
        check_options(args)
        check_environment(None, launch)  # the core packages (pydantic before the recipe needs it), the engine's
        recipe = load_recipe(args.recipe, args.overrides)
        if args.print_config:
            print(recipe.to_yaml(), end="")
            return 0
        if args.dry_run:  # the planner, imported only here: the training entry never loads it
            from pretrain.cli.dry_run import dry_run

            return dry_run(recipe, args, launch) if is_main else 0
        launch = launch.for_recipe(recipe)  # model.moe.ep_size: expert parallelism is the recipe's (Launch.ep_size)
        # The recipe's packages, and GPUs that torch cannot see (unless accelerate launch --cpu / use_cpu).
        check_environment(recipe, launch, gpu_launch=os.environ.get("ACCELERATE_USE_CPU", "").lower() != "true")
        from pretrain.data.prepare import prepare_commands
        from pretrain.distributed.supervise import interrupted_exit_code
        from pretrain.train.goodput import process_start_time
        from pretrain.train.trainer import Trainer

        notes = []
        if recipe.batch.micro_batch_size == AUTO:  # the largest MBS that fits this process's device
            from pretrain.plan import auto_batch

            recipe, note = auto_batch.resolve(recipe, launch, *auto_batch.this_process_device(launch))
            notes.append(note)
        prepare_command = prepare_commands(args.recipe, args.overrides, launch.num_nodes)
        trainer = Trainer(recipe, launch, prepare_command, notes=notes, stop=stop,
                          started=process_start_time())  # goodput: imports are start-up too
        trainer.train()
        # Ctrl-C: checkpointed, yet not finished (130, or 0 when pretrain-launch reports the 130)
        return interrupted_exit_code() if trainer.interrupted else 0
    except ConfigError as exc:
        from pretrain.distributed.agreement import refuse

        refuse(str(exc))  # a rank that refuses alone: the others, failing in their next collective, say why
        if is_main:
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingDiverged as exc:
        if is_main:
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_DIVERGED
    except KeyboardInterrupt as exc:  # StopRequested, a store build's BuildInterrupted, or a second Ctrl-C
        if stop.immediate and stop.received not in (None, signal.SIGINT):  # SIGUSR1/SIGTERM while starting
            if is_main:
                from pretrain.distributed.preemption import StopRequested

                name = signal.Signals(stop.received).name
                kept = "" if isinstance(exc, StopRequested) else f" ({exc})"
                print(f"preempted: {name} while the run was starting ({STARTING}){kept}; nothing was trained "
                      "since the checkpoint it resumes from: the same command resumes", flush=True)
            return 0
        # Ctrl-C outside the loop, or a second one inside it: no checkpoint (a store build says what it kept)
        print(f"interrupted: {exc}" if str(exc) else "interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
