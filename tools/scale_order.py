"""The sample order's paths for tools/scale_bench.py: what a rank computes of the order at a resume (the order built,
its global batch at a far step, the next steps), with and without exclusions, and its validation rows.

Each ``measure_*(size, workdir)`` does one path's work at one size; tools/scale_bench.py times it in a fresh process
and records its peak RSS growth. No store is needed: the order depends only on the row counts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pretrain.data.loader import RankBatchSampler, eval_batches, eval_indices
from pretrain.data.order import FilteredOrder, GlobalSampleOrder, MixtureSampleOrder, Quarantine
from pretrain.recipe.batching import BatchPlan
from pretrain.recipe.config import EvalConfig

GBS = 3662  # rows of 4,096 tokens in a 15M-token global batch: 15e12 tokens over 1e6 steps
RESUME_STEP = 10**6
PLAN = BatchPlan(1024, 4, 32, 8, seq_len=4096)  # a 4M-token global batch (recipes/7b.yaml's) on 8 ranks


def _resume(order, steps: int = 3) -> dict:
    """A rank's reads at a resume: the global batches of ``steps`` steps from the far step, its micro-batches."""
    gbs = order.global_batch_size
    plan = BatchPlan(gbs, 1, 1, gbs, seq_len=4096)  # one row per rank: the order's cost, not the slicing's
    start = RESUME_STEP  # data.on_exhausted=repeat: a small split is in a later epoch by then
    sampler = RankBatchSampler(order, plan, rank=7, start_step=start)
    rows = [sampler.micro_batch_indices(step) for step in range(start, start + steps)]
    return {"step": start, "rows_read": sum(len(m) for step in rows for m in step)}


def measure_order(size: int, workdir: Path) -> dict:
    """A single source of ``size`` rows: the order a rank builds at a resume and its next steps."""
    return _resume(GlobalSampleOrder(size, GBS, seed=1, shuffle=True, drop_last=True))


def measure_mixture_order(size: int, workdir: Path) -> dict:
    """Three sources (70/20/10% of ``size`` rows, weights 0.6/0.3/0.1): the same at a resume."""
    rows = {"web": size * 7 // 10, "code": size * 2 // 10, "math": size - size * 9 // 10}
    return _resume(MixtureSampleOrder(rows, {"web": 0.6, "code": 0.3, "math": 0.1}, GBS, seed=1, shuffle=True,
                                      tokens_per_row=4096))


def measure_exclusion_resume(size: int, workdir: Path) -> dict:
    """``size`` quarantined rows (data.exclude's, from step 0) of the 3.66e9-row order, a resume at step 1e6 and its
    next steps."""
    rows = 3_662_109_375
    excluded = np.random.default_rng(0).choice(rows, size=size, replace=False)
    order = FilteredOrder(GlobalSampleOrder(rows, GBS, seed=1, shuffle=True, drop_last=True),
                          [Quarantine.of(0, excluded)])
    return _resume(order)


def measure_eval_indices(size: int, workdir: Path) -> dict:
    """A validation split of ``size`` rows under the default evaluation (eval.tokens): a rank's micro-batches,
    listed as the loader reads them."""
    batches = eval_batches(EvalConfig(), PLAN)
    mine = eval_indices(size, batches, PLAN, rank=PLAN.world_size - 1)
    return {"micro_batches": len(mine), "rows": sum(len(m) for m in mine)}
