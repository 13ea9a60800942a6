"""Every check a run can pass or fail without compute, in one place, for one recipe and one launch.

``pretrain-launch`` and ``pretrain-slurm`` call it before any process exists (with the launch read from
the accelerate config); each training process calls it again first thing (with the launch read from
its environment), so a run started by plain ``accelerate launch`` is held to the same checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.distributed.layout import Launch
from pretrain.recipe.batching import BatchPlan, num_training_steps, plan_batches
from pretrain.recipe.config import Recipe


@dataclass(frozen=True)
class RunPlan:
    """What a recipe means on a launch: the batch plan, the number of optimizer steps, the peak lr."""

    launch: Launch
    batch: BatchPlan
    num_steps: int
    lr: float


def check_run(recipe: Recipe, launch: Launch) -> RunPlan:
    """Raise one ConfigError for the first section that cannot run on ``launch``; else the plan."""
    from pretrain.model.loss import resolve_loss
    from pretrain.model.optim import check_optimizer_args, check_schedule

    batch, lr = check_layout(recipe, launch)
    num_steps = num_training_steps(recipe.train.max_steps, recipe.train.max_tokens, batch)
    check_optimizer_args(recipe.optim, lr)
    check_schedule(recipe.lr_schedule, num_steps)
    if recipe.model.loss != "auto":  # auto always resolves; an explicit liger (or plain) may not run here
        resolve_loss(recipe, launch)
    return RunPlan(launch, batch, num_steps, lr)


def check_layout(recipe: Recipe, launch: Launch) -> tuple[BatchPlan, float]:
    """The checks of ``check_run`` that depend on the launch's layout, and no torch optimizer (building one
    imports torch._dynamo: seconds): the batch plan for its world size, the precision on its engine and
    device, a DeepSpeed JSON against the recipe. The batch plan and the peak lr."""
    from pretrain.distributed.accelerator import check_precision, deepspeed_config
    from pretrain.model.optim import scaled_lr

    batch = plan_batches(recipe.batch, launch.world_size, recipe.data.seq_len)
    lr = scaled_lr(recipe.optim, batch.global_batch_size)
    check_precision(recipe, launch)
    if launch.uses_deepspeed:
        deepspeed_config(recipe, batch, launch, lr)  # the user's JSON against the recipe: conflicts are errors
    return batch, lr
