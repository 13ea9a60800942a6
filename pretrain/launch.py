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
from pathlib import Path

if __package__ in (None, ""):
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

import yaml  # noqa: E402

from pretrain.errors import EXIT_USAGE, ConfigError  # noqa: E402

RUN_PY = Path(__file__).resolve().parent / "run.py"


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(accelerate launch arguments, run.py arguments starting at --recipe)."""
    if "--recipe" not in argv:
        raise ConfigError("usage: pretrain-launch --config_file FILE [accelerate launch options] --recipe R [key=value ...]")
    cut = argv.index("--recipe")
    return argv[:cut], argv[cut:]


def _option(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def read_accelerate_config(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        near = sorted(p.name for p in file.parent.glob("*.yaml")) if file.parent.is_dir() else []
        hint = f"; files in {file.parent}: {', '.join(near)}" if near else ""
        raise ConfigError(f"accelerate config file not found: {path}{hint}")
    try:
        config = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"accelerate config {path} is not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"accelerate config {path} must be a YAML mapping")
    return config


def launch_environment(config: dict, accelerate_args: list[str]) -> dict[str, str]:
    """The environment variables `accelerate launch` will give the processes (the parts pretrain reads)."""
    num_processes = _option(accelerate_args, "--num_processes") or config.get("num_processes", 1)
    env = {"WORLD_SIZE": str(num_processes),
           "ACCELERATE_MIXED_PRECISION": str(_option(accelerate_args, "--mixed_precision") or config.get("mixed_precision", "no"))}
    if str(config.get("distributed_type", "")).upper() == "DEEPSPEED" or "--use_deepspeed" in accelerate_args:
        ds = config.get("deepspeed_config") or {}
        env["ACCELERATE_USE_DEEPSPEED"] = "true"
        mapping = {
            "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
            "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
            "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
            "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
            "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
            "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
            "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
        }
        for key, var in mapping.items():
            value = _option(accelerate_args, f"--{key}")
            value = value if value is not None else ds.get(key)
            if value is not None:
                env[var] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def preflight(accelerate_args: list[str], run_args: list[str]) -> None:
    """Raise ConfigError for anything that would fail inside the launched processes."""
    from unittest import mock

    config_file = _option(accelerate_args, "--config_file")
    config = read_accelerate_config(config_file) if config_file else {}
    env = launch_environment(config, accelerate_args)
    recipe_path, overrides = run_args[1] if len(run_args) > 1 else "", run_args[2:]

    from pretrain.batching import plan_batches
    from pretrain.config import load_recipe
    from pretrain.optim import check_optimizer_args, scaled_lr

    recipe = load_recipe(recipe_path, [o for o in overrides if not o.startswith("--")])
    with mock.patch.dict(os.environ, env):
        from pretrain.deepspeed import DeepSpeedLaunch, build_deepspeed_config, is_deepspeed_launch, read_user_config
        from pretrain.runtime import check_precision

        plan = plan_batches(recipe.batch, int(env["WORLD_SIZE"]), recipe.data.seq_len)
        check_optimizer_args(recipe.optim)
        check_precision(recipe)
        if is_deepspeed_launch():
            launch = DeepSpeedLaunch.from_env()
            user = read_user_config(launch.config_file) if launch.config_file else None
            build_deepspeed_config(recipe, plan, launch, scaled_lr(recipe.optim, plan.global_batch_size), user)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        accelerate_args, run_args = split_args(argv)
        preflight(accelerate_args, run_args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    command = [sys.executable, "-m", "accelerate.commands.launch", *accelerate_args, str(RUN_PY), *run_args]
    print("launch: " + " ".join(shlex.quote(c) for c in command), flush=True)
    os.execv(sys.executable, command)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
