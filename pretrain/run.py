"""Entry point: parse, load the recipe, build, train, close.

    accelerate launch --config_file accelerate_configs/cpu.yaml pretrain/run.py --recipe recipes/tiny.yaml [key=value ...]
    accelerate launch --config_file accelerate_configs/cpu.yaml -m pretrain.run --recipe recipes/tiny.yaml
    python pretrain/run.py --recipe recipes/tiny.yaml [--print-config | --dry-run] [key.path=value ...]
"""

from __future__ import annotations

import argparse
import sys

from pretrain.cli import add_recipe_arguments
from pretrain.errors import EXIT_DIVERGED, EXIT_USAGE, ConfigError, TrainingDiverged
from pretrain.launch import Launch
from pretrain.quiet import install_warning_filters


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pretrain",
        description="Pretrain a language model from a recipe YAML.",
        epilog="Overrides: trailing key.path=value pairs, e.g. train.max_steps=40 optim.lr=1e-3 output_dir=/tmp/run1",
    )
    add_recipe_arguments(parser, "recipes/tiny.yaml")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    mode.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve recipe and batch plan, build the model on the meta device, print the plan and exit",
    )
    return parser.parse_args(argv)


def dry_run(recipe, launch: Launch) -> None:
    from pretrain.model import count_parameters, meta_model
    from pretrain.preflight import check_run

    run_plan = check_run(recipe, launch)
    plan, steps = run_plan.batch, run_plan.num_steps
    model, vocab = meta_model(recipe)
    num_params = count_parameters(model)
    print(f"recipe           {recipe.name}")
    print(f"model            {recipe.model.arch}, {num_params:,} parameters (vocab {vocab:,})")
    print(
        f"batch plan       world {plan.world_size}: GBS {plan.global_batch_size} = MBS {plan.micro_batch_size} "
        f"x GAS {plan.grad_accum_steps} x world {plan.world_size}"
    )
    print(f"tokens per step  {plan.tokens_per_step:,} ({plan.global_batch_size} x {plan.seq_len} tokens)")
    print(f"optimizer steps  {steps:,} ({steps * plan.tokens_per_step:,} tokens)")
    print(f"output_dir       {recipe.output_dir}")


def main(argv: list[str] | None = None) -> int:
    install_warning_filters()  # before the libraries are imported: some warn on import
    from pretrain.supervise import stop_with_launcher

    stop_with_launcher()  # a worker of torchrun ends with its launcher (kill -9 of accelerate launch too)
    args = parse_args(argv)
    is_main = True
    try:
        from pretrain.config import load_recipe

        launch = Launch.from_env()
        is_main = launch.is_main
        recipe = load_recipe(args.recipe, args.overrides)
        if args.print_config:
            print(recipe.to_yaml(), end="")
            return 0
        if args.dry_run:
            dry_run(recipe, launch)
            return 0
        from pretrain.cli.prepare_data import prepare_commands
        from pretrain.train import Trainer

        prepare_command = prepare_commands(args.recipe, args.overrides, launch.num_nodes)
        Trainer(recipe, launch, prepare_command).train()
        return 0
    except ConfigError as exc:
        if is_main:
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingDiverged as exc:
        if is_main:
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_DIVERGED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
