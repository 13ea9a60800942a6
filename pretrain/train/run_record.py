"""The run record: what a run writes about itself before its first step.

``recipe.resolved.yaml``, the run config every tracker receives (``run_config.json`` through the JSONL
tracker, wandb's config, tensorboard's hparams) and the banner printed to the console.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from pretrain.checkpoint.rundir import LAUNCHES_FILE, RESOLVED_RECIPE_FILE, append_record
from pretrain.distributed.accelerator import gradient_dtypes
from pretrain.distributed.layout import Launch
from pretrain.recipe.batching import BatchPlan
from pretrain.recipe.config import Recipe
from pretrain.recipe.shape import CONVENTION
from pretrain.train.tracking import flatten


class Trainer(Protocol):
    """What the run record reads from a built trainer (pretrain.train.trainer.Trainer)."""

    recipe: Recipe
    plan: BatchPlan
    launch: Launch
    accelerator: Any
    device: Any
    output_dir: Path
    is_main: bool
    parts: Any  # train/model_parts.ModelParts: parameters, float8, loss, FLOPs, peak, memory estimate
    num_steps: int
    lr: float
    tokenizer: Any
    data: Any
    optimizer: Any
    resumed: dict[str, Any] | None

    def log(self, message: str) -> None: ...


def active_text(trainer) -> str:
    """A mixture of experts' parameters used per token (shared + top-k experts), after its total."""
    if trainer.parts.num_active_params == trainer.parts.num_params:
        return ""
    return f" ({trainer.parts.num_active_params:,} active per token)"

def run_config(trainer: Trainer) -> dict[str, Any]:
    """The nested run config of a built trainer: recipe, plan, launch, model, data, perf reference."""
    acc, flops, peak, memory = trainer.accelerator, trainer.parts.flops, trainer.parts.peak, trainer.parts.memory
    return {
        "recipe": trainer.recipe.to_dict(),
        "plan": trainer.plan.to_dict(),
        "dist": {
            **trainer.launch.to_dict(),  # engine, ZeRO stage / FSDP sharding, offload, machines
            "world_size": acc.num_processes,
            "distributed_type": str(acc.distributed_type).split(".")[-1],
            "device": str(trainer.device),
            "mixed_precision": acc.mixed_precision,
        },
        # compute, gradient accumulation and gradient reduction dtypes in use (see accelerator.gradient_dtypes)
        "dtypes": gradient_dtypes(trainer.recipe, trainer.launch),
        "model": {"num_params": trainer.parts.num_params, "num_active_params": trainer.parts.num_active_params,
                  "vocab_size": len(trainer.tokenizer)},
        # model.compile resolved for this device and layout (accelerator.compile_choice)
        "compile": {"mode": trainer.setup.compile_mode},
        # precision.float8 as applied (pretrain/model/float8.py): the torchao recipe, the Linear layers converted and
        # left out; None when off
        "float8": trainer.parts.float8.record() if trainer.parts.float8 else None,
        "loss": {"implementation": trainer.parts.loss_implementation},  # model.loss as resolved (auto: liger or chunked)
        "memory": {"estimated_gib": memory.total_gib if memory else None,
                   "estimated_tensors_gib": memory.tensor_peak_gib if memory else None},
        # the token stores' counts, and the sample order this run reads (order.SampleOrderVersion: a run begun before
        # the keyed order keeps numpy's)
        "data": {**trainer.data.stats, "order": trainer.order_version.state_dict()},
        "train": {"num_steps": trainer.num_steps, "lr": trainer.lr},
        # A resume: the checkpoint, its step, the recipe changes applied (checkpoint.APPLIED_ON_RESUME) and the
        # lr in force at that step (this recipe's schedule, not the checkpoint's).
        "resume": trainer.resumed,
        "optim": optimizer_implementation(trainer.optimizer),
        "perf": {
            "flops_per_token": flops.model_flops if flops else None,
            "hardware_flops_per_token": flops.hardware_flops if flops else None,
            "peak_tflops": peak.tflops,
            "peak_source": peak.source,
            "peak_detail": peak.detail,
            "mfu_convention": flops.convention if flops else CONVENTION,
        },
    }


def optimizer_implementation(optimizer) -> dict[str, Any]:
    """The optimizer class that steps (accelerate's and DeepSpeed's wrappers looked through) and whether
    torch runs it fused or multi-tensor (``foreach``); None where the class has no such switch."""
    while hasattr(optimizer, "optimizer") and optimizer.optimizer is not optimizer:
        optimizer = optimizer.optimizer
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    return {"class": type(optimizer).__name__, "fused": group.get("fused"), "foreach": group.get("foreach")}


def start_run_record(trainer: Trainer) -> None:
    """Write the resolved recipe, start the trackers with the run config and print the banner."""
    recipe, p, config = trainer.recipe, trainer.plan, run_config(trainer)
    if trainer.is_main:
        (trainer.output_dir / RESOLVED_RECIPE_FILE).write_text(recipe.to_yaml())
        # Which launch ran which steps (pretrain-data which splits a step by the layout that ran it): this one runs
        # the steps after the one it starts from.
        append_record(trainer.output_dir / LAUNCHES_FILE, {"from_step": trainer.step, "plan": p.to_dict(),
                                                           "layout": trainer.launch.to_dict(), "time": round(time.time(), 3)})
    trainer.accelerator.init_trackers(recipe.logging.project, config=flatten(config))
    dist = config["dist"]
    # batch.sync_each_micro_batch acts where accelerate would enter no_sync: DDP and FSDP, several ranks, GAS > 1
    each = (recipe.batch.sync_each_micro_batch and p.grad_accum_steps > 1 and p.world_size > 1
            and dist["distributed_type"] != "DEEPSPEED")
    trainer.log(
        f"pretrain: {recipe.name} | world size {dist['world_size']} "
        f"({dist['distributed_type']}{f' x EP {trainer.launch.ep_size}' if trainer.launch.ep_size > 1 else ''}, "
        f"{dist['device']}, {recipe.precision.dtype}, grads accumulated in "
        f"{config['dtypes']['grad_accum']}, reduced in {config['dtypes']['reduce']}"
        f"{' after every micro-batch' if each else ''}) | "
        f"{trainer.parts.num_params:,} params{active_text(trainer)} | GBS {p.global_batch_size} = MBS {p.micro_batch_size} x GAS "
        f"{p.grad_accum_steps} x world {p.world_size} | {p.tokens_per_step:,} tokens/step | "
        f"{trainer.num_steps} steps | lr {trainer.lr:.3g} | output {trainer.output_dir}"
    )
    if trainer.parts.flops is not None:
        trainer.log(f"perf: {trainer.parts.flops.model_flops / 1e9:.4g} GFLOP/token ({trainer.parts.flops.convention.split(';')[0]}); "
                    f"peak {trainer.parts.peak.detail}")
