"""`pretrain-launch`: check a launch before any process starts, then hand it to `accelerate launch`.

    pretrain-launch --config_file accelerate_configs/zero2.yaml [--num_processes 2 ...] \\
        --recipe recipes/tiny.yaml [key.path=value ...]

Everything `accelerate launch` would only discover inside N processes (a missing accelerate config, a
batch size that does not divide for its world size, a DeepSpeed JSON that contradicts the recipe, fp16
without a GPU) is reported here as one message with exit code 2. Then the command is exactly
`accelerate launch <accelerate args> pretrain/run.py --recipe ... [overrides]`.
"""

from __future__ import annotations

import os
import shlex
import sys

from pretrain.errors import EXIT_USAGE, ConfigError
from pretrain.launch import accelerate_command, option_value


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(accelerate launch arguments, run.py arguments starting at --recipe)."""
    if "--recipe" not in argv:
        raise ConfigError("usage: pretrain-launch --config_file FILE [accelerate launch options] --recipe R [key=value ...]")
    cut = argv.index("--recipe")
    return argv[:cut], argv[cut:]


def preflight(accelerate_args: list[str], run_args: list[str]) -> None:
    """Raise ConfigError for anything that would fail inside the launched processes."""
    from pretrain.config import load_recipe
    from pretrain.launch import Launch
    from pretrain.preflight import check_run

    launch = Launch.from_accelerate_config(option_value(accelerate_args, "--config_file"), accelerate_args)
    recipe_path, overrides = run_args[1] if len(run_args) > 1 else "", run_args[2:]
    check_run(load_recipe(recipe_path, [o for o in overrides if not o.startswith("--")]), launch)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        accelerate_args, run_args = split_args(argv)
        preflight(accelerate_args, run_args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    command = accelerate_command(run_args[1], run_args[2:], accelerate_args=accelerate_args)
    print("launch: " + " ".join(shlex.quote(c) for c in command), flush=True)
    os.execv(sys.executable, command)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
