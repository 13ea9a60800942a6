"""Every check a run can pass or fail without compute, in one place, for one recipe and one launch.

``pretrain-launch`` and ``pretrain-slurm`` call it before any process exists (with the launch read from
the accelerate config); each training process calls it again first thing (with the launch read from
its environment), so a run started by plain ``accelerate launch`` is held to the same checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.batching import BatchPlan, num_training_steps, plan_batches
from pretrain.config import Recipe
from pretrain.launch import Launch


@dataclass(frozen=True)
class RunPlan:
    """What a recipe means on a launch: the batch plan, the number of optimizer steps, the peak lr."""

    launch: Launch
    batch: BatchPlan
    num_steps: int
    lr: float


def check_run(recipe: Recipe, launch: Launch, packages: bool = True) -> RunPlan:
    """Raise one ConfigError for the first section that cannot run on ``launch``; else the plan.

    ``packages``: also refuse a run that needs an optional package this machine lacks (pretrain.extras). Only
    the dry run leaves it out: it plans launches for other machines (pretrain-launch checks this one's)."""
    from pretrain.errors import ConfigError
    from pretrain.extras import missing_packages
    from pretrain.loss import resolve_loss
    from pretrain.optim import check_optimizer_args, check_schedule, scaled_lr
    from pretrain.runtime import check_precision, deepspeed_config

    if packages and (problems := missing_packages(recipe, launch)):
        raise ConfigError(problems)
    batch = plan_batches(recipe.batch, launch.world_size, recipe.data.seq_len)
    num_steps = num_training_steps(recipe.train.max_steps, recipe.train.max_tokens, batch)
    lr = scaled_lr(recipe.optim, batch.global_batch_size)
    check_optimizer_args(recipe.optim, lr)
    check_schedule(recipe.lr_schedule, num_steps)
    check_precision(recipe, launch)
    if recipe.model.loss != "auto":  # auto always resolves; an explicit liger (or plain) may not run here
        resolve_loss(recipe, launch)
    if launch.uses_deepspeed:
        deepspeed_config(recipe, batch, launch, lr)  # the user's JSON against the recipe: conflicts are errors
    return RunPlan(launch, batch, num_steps, lr)
