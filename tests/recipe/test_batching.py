"""The batch plan and the global sample order: same GBS and data on any world size."""

from __future__ import annotations

import numpy as np
import pytest

from pretrain.data.loader import GlobalSampleOrder, RankBatchSampler, eval_indices
from pretrain.errors import BatchConfigError, DataError
from pretrain.recipe.batching import BatchPlan, num_training_steps, plan_batches
from pretrain.recipe.config import BatchConfig


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_gbs_and_mbs_give_gas(world):
    plan = plan_batches(BatchConfig(global_batch_size=32, micro_batch_size=2), world, seq_len=128)
    assert plan.global_batch_size == 32
    assert plan.grad_accum_steps == 32 // (2 * world)
    assert plan.tokens_per_step == 32 * 128


def test_gbs_and_gas_give_mbs():
    plan = plan_batches(BatchConfig(global_batch_size=64, gradient_accumulation_steps=4), 8, seq_len=16)
    assert (plan.micro_batch_size, plan.grad_accum_steps) == (2, 4)


def test_local_batch_size_scales_gbs_with_world():
    plan = plan_batches(BatchConfig(local_batch_size=4), 8, seq_len=16)
    assert (plan.global_batch_size, plan.micro_batch_size, plan.grad_accum_steps) == (32, 4, 1)


def test_indivisible_mbs_proposes_valid_values():
    with pytest.raises(BatchConfigError) as info:
        plan_batches(BatchConfig(global_batch_size=24, micro_batch_size=5), 2, seq_len=16)
    message = str(info.value)
    assert "batch.global_batch_size (24) is not divisible by batch.micro_batch_size (5) x world size (2) = 10" in message
    assert "micro_batch_size=4 (GAS 3)" in message and "micro_batch_size=12 (GAS 1)" in message
    assert "global_batch_size=20 or 30" in message


def test_gbs_not_divisible_by_world():
    with pytest.raises(BatchConfigError, match=r"\(30\) is not divisible by the world size \(4 processes\).*28 or 32"):
        plan_batches(BatchConfig(global_batch_size=30, micro_batch_size=1), 4, seq_len=16)


def test_indivisible_gas():
    with pytest.raises(BatchConfigError, match=r"gradient_accumulation_steps \(3\) x world size \(2\) = 6"):
        plan_batches(BatchConfig(global_batch_size=16, gradient_accumulation_steps=3), 2, seq_len=16)


def test_max_tokens_rounds_up_to_whole_steps():
    plan = BatchPlan(8, 2, 4, 1, seq_len=100)
    assert num_training_steps(None, 801, plan) == 2
    assert num_training_steps(None, 800, plan) == 1
    assert num_training_steps(5, None, plan) == 5


def _step_samples(order, plan, step):
    """Union over ranks and micro-steps of what every rank reads at `step`."""
    seen = []
    for rank in range(plan.world_size):
        for micro in RankBatchSampler(order, plan, rank).micro_batch_indices(step):
            seen.extend(micro)
    return seen


@pytest.mark.parametrize("world, mbs", [(1, 8), (2, 4), (2, 1), (4, 2), (8, 1)])
def test_every_layout_sees_the_same_global_batches(world, mbs):
    gbs, n = 8, 50
    plan = BatchPlan(gbs, mbs, gbs // (mbs * world), world, seq_len=4)
    reference = GlobalSampleOrder(n, gbs, seed=7, shuffle=True, drop_last=True)
    order = GlobalSampleOrder(n, gbs, seed=7, shuffle=True, drop_last=True)
    for step in range(15):  # crosses two epoch boundaries (6 batches per epoch)
        got = _step_samples(order, plan, step)
        assert sorted(got) == sorted(reference.global_batch(step).tolist())
        assert len(set(got)) == gbs  # no rank reads a sample twice within a step


def test_drop_last_epochs_are_permutations_and_differ():
    order = GlobalSampleOrder(20, 5, seed=1, shuffle=True, drop_last=True)
    epoch0 = np.concatenate([order.global_batch(s) for s in range(4)])
    epoch1 = np.concatenate([order.global_batch(s) for s in range(4, 8)])
    assert sorted(epoch0) == list(range(20)) == sorted(epoch1)
    assert not np.array_equal(epoch0, epoch1)


def test_no_drop_last_carries_leftovers_across_epochs():
    order = GlobalSampleOrder(10, 4, seed=1, shuffle=False, drop_last=False)
    stream = np.concatenate([order.global_batch(s) for s in range(5)])
    assert stream.tolist() == list(range(10)) * 2


def test_resume_start_step_continues_the_same_stream():
    plan = BatchPlan(8, 2, 2, 2, seq_len=4)
    order = GlobalSampleOrder(40, 8, seed=3, shuffle=True, drop_last=True)
    full = iter(RankBatchSampler(order, plan, rank=1))
    uninterrupted = [next(full) for _ in range(2 * 12)]
    resumed = iter(RankBatchSampler(order, plan, rank=1, start_step=5))
    assert [next(resumed) for _ in range(2 * 7)] == uninterrupted[2 * 5 :]


def test_training_split_smaller_than_a_batch_is_a_clear_error():
    with pytest.raises(DataError, match="fewer than one global batch"):
        GlobalSampleOrder(3, 8, seed=0, shuffle=True, drop_last=True)


@pytest.mark.parametrize("world, mbs", [(1, 4), (2, 2), (4, 1)])
def test_eval_set_is_the_same_on_any_world_size(world, mbs):
    plan = BatchPlan(8, mbs, 8 // (mbs * world), world, seq_len=4)
    covered = sorted(i for r in range(world) for micro in eval_indices(30, 0, plan, r) for i in micro)
    assert covered == list(range(24))  # trimmed to a multiple of GBS, identical for every layout
    counts = {len(eval_indices(30, 0, plan, r)) for r in range(world)}
    assert len(counts) == 1  # equal forwards on every rank (ZeRO-3 needs that)


def test_epoch_order_is_numpys_permutation_held_in_half_the_memory():
    """The epoch's order is exactly Generator(seed).permutation(n) (so a resume or another world size reads the
    same rows), stored as uint32: at 1.2e8 rows (1 TB of text at 2048 tokens) 0.5 GB per rank, not 1 GB."""
    import numpy as np

    from pretrain.data.loader import epoch_permutation

    for n in (1, 5, 100_003):
        order = epoch_permutation(n, [11, 2], shuffle=True)
        assert order.dtype == np.uint32
        assert np.array_equal(order, np.random.default_rng([11, 2]).permutation(n))
    assert np.array_equal(epoch_permutation(6, [0, 0], shuffle=False), np.arange(6))
    order = GlobalSampleOrder(1000, 64, seed=3, shuffle=True, drop_last=True)
    assert np.array_equal(order.global_batch(2), np.random.default_rng([3, 0]).permutation(1000)[128:192])
