"""The DeepSpeed config built from a recipe, and how a user's JSON merges with it."""

from __future__ import annotations

import json

import pytest

from pretrain.distributed.deepspeed import build_deepspeed_config
from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.recipe.batching import plan_batches
from tests.helpers import make_recipe


def launch(stage=2, opt="none", param="none", config_file=None, gas=None, clip=None):
    fields = {k: v for k, v in (("gradient_accumulation_steps", gas), ("gradient_clipping", clip)) if v is not None}
    return Launch("deepspeed", stage, opt, param, deepspeed_config_file=config_file, deepspeed_fields=fields)


def build(r, lau=None, user=None, world=4):
    plan = plan_batches(r.batch, world, r.data.seq_len)
    return build_deepspeed_config(r, plan, lau or launch(), r.optim.lr, user)


def test_batch_triple_precision_and_clipping_come_from_the_recipe():
    config, ds_opt = build(make_recipe(precision={"dtype": "bf16"}, optim={"grad_clip": 0.5}))
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (64, 4, 4)
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert config["gradient_clipping"] == 0.5
    assert config["zero_optimization"]["stage"] == 2
    assert ds_opt is False and config["zero_force_ds_cpu_optimizer"] is False


def test_fp16_block_carries_the_loss_scale_knobs():
    config, _ = build(make_recipe(precision={"dtype": "fp16", "initial_scale_power": 12, "loss_scale_window": 500,
                                        "hysteresis": 3, "min_loss_scale": 0.5}))
    assert config["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                              "hysteresis": 3, "min_loss_scale": 0.5}
    fixed, _ = build(make_recipe(precision={"dtype": "fp16", "loss_scale": 1024}))
    assert fixed["fp16"]["loss_scale"] == 1024.0


def test_user_json_auto_fields_are_filled_and_its_own_fields_kept(tmp_path):
    user = {"train_batch_size": "auto", "gradient_accumulation_steps": "auto", "optimizer": {"type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}, "activation_checkpointing": {"x": 1}}
    # The accelerate config names the JSON and no stage: the launch takes the JSON's.
    (tmp_path / "ds.json").write_text(json.dumps(user))
    (tmp_path / "acc.yaml").write_text(f"distributed_type: DEEPSPEED\nnum_processes: 4\ndeepspeed_config:\n"
                                       f"  deepspeed_config_file: {tmp_path / 'ds.json'}\n")
    config, ds_opt = build(make_recipe(optim={"args": {"betas": [0.9, 0.95]}}),
                           Launch.from_accelerate_config(tmp_path / "acc.yaml"), user)
    assert ds_opt is True  # the user's JSON asks for DeepSpeed's optimizer
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]}}
    assert config["zero_optimization"]["reduce_bucket_size"] == 1000 and config["zero_optimization"]["stage"] == 3
    assert config["activation_checkpointing"] == {"x": 1}
    assert config["train_batch_size"] == 64


def test_user_json_conflicts_are_all_named():
    user = {"gradient_accumulation_steps": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
            "scheduler": {"type": "WarmupLR"}}
    with pytest.raises(ConfigError) as info:
        build(make_recipe(), launch(config_file="ds.json"), user)
    text = str(info.value)
    assert "ds.json has gradient_accumulation_steps=8 but the recipe gives 4" in text
    assert "ds.json has optimizer.params.lr=0.1 but the recipe gives 0.0003" in text
    assert "the recipe owns the LR schedule" in text


def test_accelerate_config_gas_or_clipping_disagreeing():
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=2 but the recipe's batch plan gives GAS 4"):
        build(make_recipe(), launch(gas="2"))
    with pytest.raises(ConfigError, match="gradient_clipping=2.0 but the recipe has optim.grad_clip=1.0"):
        build(make_recipe(), launch(clip="2.0"))


def test_offload_and_recipe_deepspeed_section():
    config, _ = build(make_recipe(deepspeed={"communication_data_type": "bf16", "reduce_bucket_size": 123,
                                        "wall_clock_breakdown": True}), launch(stage=3, opt="cpu", param="cpu"))
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert zero["reduce_bucket_size"] == 123 and zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert config["communication_data_type"] == "bf16" and config["wall_clock_breakdown"] is True


def test_deepspeed_optimizer_for_sgd_is_refused():
    with pytest.raises(ConfigError, match="DeepSpeed's optimizers cover"):
        build(make_recipe(optim={"name": "SGD", "weight_decay": 0.0}, deepspeed={"optimizer": "deepspeed"}))


# ---- gradient accumulation and reduction dtypes (precision.reduce_dtype) ---------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_accumulates_and_reduces_in_fp32_by_default(stage):
    config, _ = build(make_recipe(precision={"dtype": "bf16"}), launch(stage=stage))
    assert config["data_types"] == {"grad_accum_dtype": "fp32"} and config["communication_data_type"] == "fp32"


def test_bf16_reduction_is_opt_in():
    config, _ = build(make_recipe(precision={"dtype": "bf16", "reduce_dtype": "bf16"}), launch(stage=2))
    assert config["data_types"] == {"grad_accum_dtype": "bf16"} and config["communication_data_type"] == "bf16"


def test_fp32_recipe_keeps_deepspeed_defaults():
    config, _ = build(make_recipe())
    assert "data_types" not in config and "communication_data_type" not in config
    config, _ = build(make_recipe(deepspeed={"communication_data_type": "bf16"}))
    assert config["communication_data_type"] == "bf16"


def test_zero0_bf16_needs_bf16_reduction():
    with pytest.raises(ConfigError, match="ZeRO stage 0 with precision.dtype=bf16 cannot accumulate.*ZeRO-1"):
        build(make_recipe(precision={"dtype": "bf16"}), launch(stage=0))
    config, _ = build(make_recipe(precision={"dtype": "bf16", "reduce_dtype": "bf16"}), launch(stage=0))
    assert config["data_types"] == {"grad_accum_dtype": "bf16"}


def test_communication_data_type_and_reduce_dtype_have_one_source_of_truth():
    same, _ = build(make_recipe(precision={"dtype": "bf16"}, deepspeed={"communication_data_type": "fp32"}))
    assert same["communication_data_type"] == "fp32"
    conflict = "deepspeed.communication_data_type=bf16 conflicts with precision.reduce_dtype=fp32"
    with pytest.raises(ConfigError, match=conflict):
        make_recipe(precision={"dtype": "bf16"}, deepspeed={"communication_data_type": "bf16"})
    with pytest.raises(ConfigError, match="precision.reduce_dtype=bf16 applies to bf16 recipes only"):
        make_recipe(precision={"dtype": "fp32", "reduce_dtype": "bf16"})


def test_user_json_grad_accum_dtype_must_agree():
    with pytest.raises(ConfigError, match="data_types.grad_accum_dtype='bf16' but the recipe gives 'fp32'"):
        build(make_recipe(precision={"dtype": "bf16"}), user={"data_types": {"grad_accum_dtype": "bf16"}})
    with pytest.raises(ConfigError, match="communication_data_type='bf16' but the recipe gives 'fp32'"):
        build(make_recipe(precision={"dtype": "bf16"}), user={"communication_data_type": "bf16"})


def test_fsdp_policy_and_ddp_hook_follow_reduce_dtype(monkeypatch):
    import torch
    from accelerate.utils import DDPCommunicationHookType

    from pretrain.distributed.accelerator import ddp_kwargs, fsdp_plugin, gradient_dtypes

    monkeypatch.setenv("FSDP_VERSION", "2")
    bf16, fast = make_recipe(precision={"dtype": "bf16"}), make_recipe(precision={"dtype": "bf16", "reduce_dtype": "bf16"})
    policy = fsdp_plugin(bf16).mixed_precision_policy
    bf16_, fp32_ = torch.bfloat16, torch.float32
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (bf16_, fp32_, None)  # fp32 loss
    assert fsdp_plugin(fast).mixed_precision_policy.reduce_dtype == torch.bfloat16
    assert fsdp_plugin(make_recipe()) is None
    assert ddp_kwargs(bf16) is None and ddp_kwargs(fast).comm_hook == DDPCommunicationHookType.BF16
    fsdp, ddp = Launch("fsdp"), Launch("ddp")
    assert gradient_dtypes(bf16, fsdp) == {"compute": "bf16", "grad_accum": "fp32", "reduce": "fp32"}
    assert gradient_dtypes(fast, fsdp) == {"compute": "bf16", "grad_accum": "bf16", "reduce": "bf16"}
    assert gradient_dtypes(fast, ddp) == {"compute": "bf16", "grad_accum": "fp32", "reduce": "bf16"}
    assert gradient_dtypes(make_recipe(), launch()) == {"compute": "fp32", "grad_accum": "fp32", "reduce": "fp32"}


def test_selective_checkpointing_is_refused_under_zero3_only():
    """ZeRO-3's gathering hooks run other ops in the recompute than in the forward: a 2-process CPU ZeRO-3 run
    of the tiny model failed with torch's "aten.empty.memory_format encountered during backward but not found
    in storage"; ZeRO-2 and DDP ran it."""
    selective = make_recipe(model={"activation_checkpointing": "selective"})
    with pytest.raises(ConfigError, match="activation_checkpointing=selective cannot run under ZeRO-3"):
        build(selective, launch(stage=3))
    for stage in (1, 2):
        build(selective, launch(stage=stage))
    build(make_recipe(model={"activation_checkpointing": "every_2"}), launch(stage=3))


@pytest.mark.parametrize("mode", ["auto", "regional", "full"])
def test_compile_is_accepted_under_every_zero_stage(mode):
    """accelerate compiles DeepSpeed's engine.module in place, ZeRO-3 included (the former refusal is gone; the
    compiled ZeRO-2 and ZeRO-3 runs are in tests/multiprocess/test_distributed.py)."""
    for stage in (1, 2, 3):
        config, _ = build(make_recipe(model={"compile": mode}), launch(stage=stage))
        assert config["zero_optimization"]["stage"] == stage


def test_a_stale_build_lock_of_deepspeeds_cpu_op_is_one_message_instead_of_a_hang(tmp_path, monkeypatch):
    """A ZeRO process killed while DeepSpeed compiled its shared-memory op leaves torch's build lock: every later ZeRO
    process waited on it forever (seen in this project's CI). An old lock is refused naming the file; a lock younger
    than any build (a build in progress) is waited on as torch does."""
    import os
    import sys

    from pretrain.distributed.accelerator import STALE_BUILD_LOCK_S, check_deepspeed_op_lock

    environ = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}  # torch builds in it directly (pretrain sets this environment's)
    check_deepspeed_op_lock(environ)  # nothing built yet
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    check_deepspeed_op_lock(environ)  # a build in progress
    os.utime(lock, (lock.stat().st_atime, lock.stat().st_mtime - STALE_BUILD_LOCK_S - 60))
    with pytest.raises(ConfigError, match=r"DeepSpeed's CPU op build lock .*/deepspeed_shm_comm/lock is 16 minutes "
                                          r"old: .* Delete it \(`rm .*lock`\) and launch again"):
        check_deepspeed_op_lock(environ)
    assert lock.exists()  # not pretrain's file to delete
    # without TORCH_EXTENSIONS_DIR (pretrain sets it; a caller of this function may not): torch's folder for this
    # interpreter and torch build in its default root
    import torch
    import torch.utils.cpp_extension

    monkeypatch.setattr(torch.utils.cpp_extension, "get_default_build_root", lambda: str(tmp_path / "default"))
    device = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    folder = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{device}"
    (tmp_path / "default" / folder / "deepspeed_shm_comm").mkdir(parents=True)
    os.replace(lock, tmp_path / "default" / folder / "deepspeed_shm_comm" / "lock")
    with pytest.raises(ConfigError, match=f"/default/{folder}/deepspeed_shm_comm/lock is 16 minutes old"):
        check_deepspeed_op_lock({})


def test_deepspeeds_own_checkpoint_writers_that_would_bypass_pretrains_checkpoints_are_refused():
    decoupled = {"checkpoint": {"writer": {"type": "fast", "decoupled": True}}}
    with pytest.raises(ConfigError, match=r"checkpoint\.writer\.decoupled=true: .* remove checkpoint\.writer"):
        build(make_recipe(), user=decoupled)
    fast = {"checkpoint": {"writer": {"type": "fast"}}}
    with pytest.raises(ConfigError, match=r"checkpoint\.writer .* checkpoint\.async=true: .* set checkpoint\.async=false"):
        build(make_recipe("checkpoint.async=true"), user=fast)
    config, _ = build(make_recipe(), user=fast)  # synchronous saves: DeepSpeed's writer finishes inside the save
    assert config["checkpoint"] == fast["checkpoint"]
    config, _ = build(make_recipe("checkpoint.async=true"), user={"checkpoint": {"tag_validation": "Warn"}})
    assert config["checkpoint"] == {"tag_validation": "Warn"}
