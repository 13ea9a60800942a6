"""What a recipe means on a launch, decided once before any process group exists and passed on (``RunPlan``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pretrain.distributed.layout import Launch
from pretrain.recipe.batching import BatchPlan
from pretrain.recipe.config import Recipe


@dataclass(frozen=True)
class RunPlan:
    """What a recipe means on a launch: the batch plan, the number of optimizer steps, the peak lr, and the
    decisions the checks took, passed on to the run rather than taken again: accelerate's mixed_precision and the
    DeepSpeed config (``train/preflight.check_run`` makes it)."""

    launch: Launch
    batch: BatchPlan
    num_steps: int
    lr: float
    mixed_precision: str = "no"  # accelerate's name for precision.dtype (checked against the launch's)
    # The DeepSpeed config (recipe + launch + the user's JSON) and whether DeepSpeed builds the optimizer;
    # None unless the launch uses DeepSpeed. The run's plugin is built from a copy.
    deepspeed: tuple[dict[str, Any], bool] | None = field(default=None, repr=False)
    recipe: Recipe | None = field(default=None, repr=False, compare=False)
    tasks: tuple = field(default=(), repr=False, compare=False)  # eval.tasks, read and checked (train/downstream.py)
