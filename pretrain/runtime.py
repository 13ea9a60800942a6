"""The Accelerator for a recipe and a launch: precision, accumulation, process group, trackers.

The recipe owns precision and accumulation; the accelerate launch owns the layout (processes,
machines, DDP / FSDP / DeepSpeed). Where the launch's config also names a precision, it must agree.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DynamoBackend, GradScalerKwargs, InitProcessGroupKwargs, TorchDynamoPlugin

from pretrain.batching import BatchPlan
from pretrain.config import Recipe
from pretrain.errors import ConfigError

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def launch_world_size() -> int:
    """Processes in this launch, as set by `accelerate launch` / torchrun (1 for `python run.py`)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_precision(recipe: Recipe) -> None:
    dtype = recipe.precision.dtype
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
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


def build_accelerator(recipe: Recipe, plan: BatchPlan, output_dir: Path, trackers: list) -> Accelerator:
    check_precision(recipe)
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
    dynamo = TorchDynamoPlugin(backend=DynamoBackend.INDUCTOR) if recipe.model.compile else None
    accelerator = Accelerator(
        mixed_precision=MIXED_PRECISION[prec.dtype],
        gradient_accumulation_steps=plan.grad_accum_steps,
        # The trainer steps the LR scheduler once per optimizer step itself. By default accelerate's
        # AcceleratedScheduler would step it num_processes times per optimizer step.
        step_scheduler_with_optimizer=False,
        log_with=trackers or None,
        project_dir=str(output_dir),
        kwargs_handlers=handlers,
        dynamo_plugin=dynamo,
    )
    if accelerator.num_processes != plan.world_size:
        raise ConfigError(
            f"the launch reported WORLD_SIZE={plan.world_size} but accelerate started {accelerator.num_processes} "
            "processes; check the accelerate config's num_processes / distributed_type"
        )
    return accelerator
