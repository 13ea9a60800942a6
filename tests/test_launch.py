"""pretrain-launch: bad launches fail in seconds with one message; good ones reach accelerate launch."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import FAST, ROOT, TINY, check_ok, run_cmd, train_losses

LAUNCH = ["-m", "pretrain.cli.launch"]
CONFIGS = ROOT / "accelerate_configs"


def launch(*args: str):
    return run_cmd([sys.executable, *LAUNCH, *args], timeout=600)


def write_accelerate_config(path, deepspeed_config: dict, num_processes: int = 2):
    lines = ["compute_environment: LOCAL_MACHINE", "distributed_type: DEEPSPEED", "deepspeed_config:"]
    lines += [f"  {k}: {json.dumps(v)}" for k, v in deepspeed_config.items()]
    lines += [f"num_processes: {num_processes}", "num_machines: 1", "machine_rank: 0", "use_cpu: false"]
    path.write_text("\n".join(lines) + "\n")
    return path


def assert_clean_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def test_missing_accelerate_config_lists_the_available_ones():
    proc = launch("--config_file", str(CONFIGS / "nope.yaml"), "--recipe", TINY)
    assert_clean_error(proc, "accelerate config file not found", "zero2.yaml")


def test_gbs_indivisible_for_the_launch_world_size_shows_valid_values():
    proc = launch("--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--recipe", TINY, "batch.global_batch_size=30")
    assert_clean_error(proc, "not divisible by batch.micro_batch_size (16) x world size (2)",
                       "micro_batch_size=5 (GAS 3)")


def test_deepspeed_json_contradicting_the_recipe_names_both_values(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"train_batch_size": 64, "gradient_clipping": "auto", "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 2}}))
    config = write_accelerate_config(tmp_path / "acc.yaml", {"deepspeed_config_file": str(user)})
    proc = launch("--config_file", str(config), "--recipe", TINY)
    assert_clean_error(proc, "train_batch_size=64 but the recipe gives 32", "bf16.enabled=True but the recipe gives False")


def test_fp16_on_cpu_suggests_bf16():
    proc = launch("--config_file", str(CONFIGS / "zero2.yaml"), "--num_processes", "2", "--recipe", TINY,
                  "precision.dtype=fp16")
    assert_clean_error(proc, "precision.dtype=fp16 needs a CUDA GPU", "bf16")


def test_accelerate_mixed_precision_contradicting_the_recipe():
    proc = launch("--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--mixed_precision", "bf16", "--recipe", TINY)
    assert_clean_error(proc, "mixed_precision=bf16 but the recipe says precision.dtype=fp32")


@pytest.mark.parametrize(
    "deepspeed_config, overrides, message",
    [
        ({"zero_stage": 2, "offload_param_device": "cpu"}, [], "offload_param_device=cpu needs ZeRO stage 3"),
        ({"zero_stage": 3}, ["model.compile=true"], "model.compile=true cannot be honoured under ZeRO-3"),
        ({"zero_stage": 0, "offload_optimizer_device": "cpu"}, [], "needs ZeRO stage 1, 2 or 3"),
    ],
)
def test_zero_options_deepspeed_cannot_honour(tmp_path, deepspeed_config, overrides, message):
    config = write_accelerate_config(tmp_path / "acc.yaml", deepspeed_config)
    assert_clean_error(launch("--config_file", str(config), "--recipe", TINY, *overrides), message)


@pytest.mark.slow
def test_a_good_launch_runs_through_accelerate(tmp_path):
    out = tmp_path / "run"
    proc = launch("--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--recipe", TINY, *FAST, "train.max_steps=2",
                  f"output_dir={out}")
    check_ok(proc)
    assert "launch: " in proc.stdout and "world size 2" in proc.stdout
    assert sorted(train_losses(out)) == [1, 2]


# ---- the Launch value: the same whether read from the accelerate config or from the processes' environment


def accelerate_environment(config_file, *options: str) -> dict[str, str]:
    """What `accelerate launch --config_file F <options> run.py` exports to each process (rank 0), built by
    accelerate's own launcher code, plus what torchrun adds (WORLD_SIZE, GROUP_WORLD_SIZE, RANK)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), *options, "run.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config) if defaults else []  # as accelerate's launch_command sets it
        args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * mp_from_config)
        environment = prepare_deepspeed_cmd_env(args)[1]
    elif args.num_processes > 1 or args.use_fsdp:
        environment = prepare_multi_gpu_env(args)
    else:
        environment = {"ACCELERATE_MIXED_PRECISION": str(args.mixed_precision)}
    environment = {k: v for k, v in environment.items() if k.startswith(("ACCELERATE_", "FSDP_"))}
    return {**environment, "WORLD_SIZE": str(args.num_processes), "GROUP_WORLD_SIZE": str(args.num_machines),
            "RANK": "0"}


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_launch_read_from_the_config_equals_the_launch_the_processes_read(config, monkeypatch):
    from pretrain.launch import Launch

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    path = CONFIGS / config
    before = Launch.from_accelerate_config(path)
    assert Launch.from_env(accelerate_environment(path)) == before
    assert before.engine == {"fsdp.yaml": "fsdp"}.get(config, "deepspeed" if "zero" in config else "ddp")
    options = ["--num_processes", "4", "--num_machines", "2"]
    assert Launch.from_env(accelerate_environment(path, *options)) == Launch.from_accelerate_config(path, options)


def test_an_fsdp_launch_logs_the_estimators_fsdp_figure(monkeypatch):
    """accelerate runs FSDP on GPUs only (on CPU pretrain refuses it), so this follows the launch value: the
    environment accelerate exports for fsdp.yaml on 2 processes -> Launch -> the figure the trainer logs as
    memory/estimated_gib (pretrain.train.memory_estimate) is the estimator's FSDP figure, not DDP's."""
    import torch

    from pretrain.batching import plan_batches
    from pretrain.config import load_recipe
    from pretrain.launch import Launch
    from pretrain.memory import estimate
    from pretrain.train import memory_estimate

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    launch = Launch.from_env(accelerate_environment(CONFIGS / "fsdp.yaml", "--num_processes", "2"))
    assert (launch.engine, launch.fsdp_sharding, launch.world_size) == ("fsdp", "FULL_SHARD", 2)
    recipe = load_recipe(TINY, ["precision.dtype=bf16"])
    plan = plan_batches(recipe.batch, launch.world_size, recipe.data.seq_len)
    logged = memory_estimate(recipe, plan, launch, torch.device("cpu"), log=print)
    fsdp = estimate(recipe, plan, Launch("fsdp", gpus_per_node=2, fsdp_sharding="FULL_SHARD"), device="cpu")
    ddp = estimate(recipe, plan, Launch("ddp", gpus_per_node=2), device="cpu")
    assert "FSDP FULL_SHARD" in fsdp.layout.describe()
    assert logged == fsdp.total_gib != ddp.total_gib
