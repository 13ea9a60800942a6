"""The Accelerator for a recipe and a launch: precision, accumulation, process group, trackers.

The recipe owns precision and accumulation; the accelerate launch owns the layout (processes,
machines, DDP / FSDP / DeepSpeed). Where the launch's config also names a precision, it must agree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DDPCommunicationHookType,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DynamoBackend,
    FullyShardedDataParallelPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    TorchDynamoPlugin,
)

from pretrain.batching import BatchPlan
from pretrain.config import Recipe
from pretrain.deepspeed_config import build_deepspeed_config, read_user_config
from pretrain.errors import ConfigError
from pretrain.launch import Launch

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def check_precision(recipe: Recipe, launch: Launch) -> None:
    dtype = recipe.precision.dtype
    launched = launch.mixed_precision
    if launched not in ("no", MIXED_PRECISION[dtype]):
        raise ConfigError(
            f"the accelerate config says mixed_precision={launched} but the recipe says precision.dtype={dtype}; "
            f"the recipe owns precision: set mixed_precision: 'no' in the accelerate config (or override "
            f"precision.dtype={'fp32' if launched == 'no' else launched})"
        )
    if dtype == "fp16" and not torch.cuda.is_available():
        raise ConfigError(
            "precision.dtype=fp16 needs a CUDA GPU (fp16 on CPU would silently train in fp32 or fail); "
            "use precision.dtype=bf16 or fp32 on this machine"
        )
    if launch.engine == "ddp" and launch.world_size > 1 and ddp_kwargs(recipe) and not torch.cuda.is_available():
        raise ConfigError(
            "precision.reduce_dtype=bf16 under DDP needs CUDA and NCCL (torch's bf16 all-reduce hook); on CPU "
            "DDP reduces in fp32: remove precision.reduce_dtype=bf16 (or use a DeepSpeed ZeRO config)"
        )


def gradient_dtypes(recipe: Recipe, launch: Launch) -> dict[str, str]:
    """The dtypes a run computes, accumulates gradients and reduces them in (written to the run config).

    bf16: accumulation and reduction in precision.reduce_dtype (fp32 by default) under ZeRO-1/2/3 (through
    ``data_types.grad_accum_dtype`` and ``communication_data_type``) and FSDP (its policy's reduce dtype, which
    no_sync accumulates in too); DDP keeps fp32 gradients under autocast and accumulates in fp32 either way.
    fp16: loss-scaled fp16 gradients under DeepSpeed and FSDP, fp32 under DDP. fp32: fp32 throughout."""
    prec, engine = recipe.precision, launch.engine
    if prec.dtype == "fp32":
        return {"compute": "fp32", "grad_accum": "fp32", "reduce": "fp32"}
    if prec.dtype == "fp16":
        if engine == "ddp":
            return {"compute": "fp16", "grad_accum": "fp32", "reduce": "fp32"}
        comm = recipe.deepspeed.communication_data_type if engine == "deepspeed" else None
        return {"compute": "fp16", "grad_accum": "fp16", "reduce": comm or "fp16"}
    # DDP accumulates in its fp32 gradients whatever it reduces in (the bf16 hook compresses the all-reduce only)
    accum = "fp32" if engine == "ddp" else prec.reduce_dtype
    return {"compute": "bf16", "grad_accum": accum, "reduce": prec.reduce_dtype}


def fsdp_plugin(recipe: Recipe) -> FullyShardedDataParallelPlugin | None:
    """bf16 recipes: an FSDP plugin whose policy reduces (and, under no_sync, accumulates) gradients in
    precision.reduce_dtype; accelerate's own policy reduces in bf16. The plugin reads the rest of the FSDP
    settings (version, sharding, wrapping) from the accelerate config's FSDP_* environment as usual."""
    if recipe.precision.dtype != "bf16":
        return None
    reduce = torch.float32 if recipe.precision.reduce_dtype == "fp32" else torch.bfloat16
    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce, output_dtype=torch.bfloat16)
    else:
        from torch.distributed.fsdp import MixedPrecision

        policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce, buffer_dtype=torch.bfloat16)
    plugin.mixed_precision_policy = policy
    plugin.validate_mixed_precision_policy()
    # Accelerator(mixed_precision="bf16") calls plugin.set_mixed_precision("bf16"), which keeps a policy that is
    # already set: this one reaches fully_shard (tests/test_reduce_dtype.py checks both).
    return plugin


def ddp_kwargs(recipe: Recipe) -> DistributedDataParallelKwargs | None:
    """DDP under bf16 autocast keeps fp32 weights and gradients: fp32 reduction already. precision.reduce_dtype=bf16
    compresses the all-reduce to bf16 with torch's bf16 communication hook."""
    if recipe.precision.dtype == "bf16" and recipe.precision.reduce_dtype == "bf16":
        return DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16)
    return None


@dataclass
class Runtime:
    accelerator: Accelerator
    deepspeed_config: dict[str, Any] | None  # None unless launched with DeepSpeed
    deepspeed_optimizer: bool  # DeepSpeed builds the optimizer (DummyOptim) instead of the torch client one


def deepspeed_config(recipe: Recipe, plan: BatchPlan, launch: Launch, lr: float) -> tuple[dict, bool]:
    """The run's DeepSpeed config (recipe + launch + the user's JSON, conflicts refused) and whether
    DeepSpeed builds the optimizer."""
    user = read_user_config(launch.deepspeed_config_file) if launch.deepspeed_config_file else None
    return build_deepspeed_config(recipe, plan, launch, lr, user)


def deepspeed_plugin(recipe: Recipe, plan: BatchPlan, launch: Launch, lr: float) -> tuple[DeepSpeedPlugin, dict, bool]:
    config, ds_optimizer = deepspeed_config(recipe, plan, launch, lr)
    stage = config["zero_optimization"]["stage"]
    zero3_init = launch.zero3_init if launch.zero3_init is not None else stage == 3
    # accelerate refuses a config dict next to accelerate-config DeepSpeed fields, assuming the dict is a
    # user's file that would silently win. Ours already merged those fields (conflicts are errors).
    hidden = os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
    try:
        plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=zero3_init and stage == 3)
    finally:
        if hidden is not None:
            os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = hidden
    # accelerate silences DeepSpeed's own step printing; the recipe decides (deepspeed.steps_per_print).
    plugin.deepspeed_config["steps_per_print"] = config["steps_per_print"]
    return plugin, plugin.deepspeed_config, ds_optimizer


def build_accelerator(recipe: Recipe, plan: BatchPlan, launch: Launch, output_dir: Path, trackers: list,
                      lr: float) -> Runtime:
    check_precision(recipe, launch)
    if launch.engine == "fsdp" and not torch.cuda.is_available():
        # accelerate turns an FSDP launch without GPUs into plain data parallelism (MULTI_CPU), which would
        # then be logged and estimated as FSDP.
        raise ConfigError(
            "the accelerate config asks for FSDP, which accelerate runs on GPUs only (on CPU it would silently "
            "become plain DDP); on this machine use accelerate_configs/cpu_ddp.yaml or a DeepSpeed ZeRO config"
        )
    if not torch.cuda.is_available():
        # DeepSpeed (imported by accelerate for ZeRO and state gathering) would otherwise probe for
        # accelerators and warn on every CPU run.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    plugin, ds_config, ds_optimizer = (deepspeed_plugin(recipe, plan, launch, lr) if launch.uses_deepspeed
                                       else (None, None, False))
    handlers = []
    if not torch.cuda.is_available() and plan.world_size > 1:
        # A multi-process CPU launch needs an explicit gloo group; without it DeepSpeed and accelerate
        # can disagree about the world size. (A single process must not get one: it has no group.)
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    prec = recipe.precision
    if prec.dtype == "fp16":
        # torch's GradScaler (DDP / FSDP / single device). It has no hysteresis or floor: those two knobs
        # apply under DeepSpeed only. A fixed scale never grows and only backs off on an overflow.
        if prec.loss_scale == "dynamic":
            scaler = GradScalerKwargs(init_scale=2.0**prec.initial_scale_power, growth_interval=prec.loss_scale_window)
        else:
            scaler = GradScalerKwargs(init_scale=float(prec.loss_scale), growth_interval=2**31 - 1)
        handlers.append(scaler)
    fsdp = fsdp_plugin(recipe) if launch.engine == "fsdp" else None
    ddp = ddp_kwargs(recipe) if launch.engine == "ddp" and plan.world_size > 1 else None
    if ddp is not None:  # on CUDA only (check_precision)
        handlers.append(ddp)
    dynamo = TorchDynamoPlugin(backend=DynamoBackend.INDUCTOR) if recipe.model.compile else None
    accelerator = Accelerator(
        # No CUDA and not DeepSpeed: run as MULTI_CPU over gloo. Without this, processes started by
        # torchrun on a CPU box would each become an unrelated single-process run.
        cpu=not torch.cuda.is_available() and plugin is None,
        mixed_precision=MIXED_PRECISION[prec.dtype],
        gradient_accumulation_steps=plan.grad_accum_steps,
        # The trainer steps the LR scheduler once per optimizer step itself. By default accelerate's
        # AcceleratedScheduler would step it num_processes times per optimizer step.
        step_scheduler_with_optimizer=False,
        log_with=trackers or None,
        project_dir=str(output_dir),
        kwargs_handlers=handlers,
        dynamo_plugin=dynamo,
        deepspeed_plugin=plugin,
        fsdp_plugin=fsdp,
    )
    if accelerator.num_processes != plan.world_size:
        raise ConfigError(
            f"the launch reported WORLD_SIZE={plan.world_size} but accelerate started {accelerator.num_processes} "
            "processes; check the accelerate config's num_processes / distributed_type"
        )
    return Runtime(accelerator, ds_config, ds_optimizer)
