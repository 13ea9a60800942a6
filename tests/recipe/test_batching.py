"""The batch plan and the global sample order: same GBS and data on any world size."""

from __future__ import annotations

import numpy as np
import pytest

from pretrain.data.loader import RankBatchSampler, eval_indices
from pretrain.data.order import GlobalSampleOrder
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


def test_version_1_order_is_numpys_permutation_held_in_half_the_memory():
    """A run begun before the keyed order (its checkpoint records no order version: version 1) keeps reading its
    epochs in exactly Generator(seed).permutation(n)'s order, stored as uint32."""
    import numpy as np

    from pretrain.data.order import epoch_permutation

    for n in (1, 5, 100_003):
        order = epoch_permutation(n, [11, 2], shuffle=True)
        assert order.dtype == np.uint32
        assert np.array_equal(order, np.random.default_rng([11, 2]).permutation(n))
    assert np.array_equal(epoch_permutation(6, [0, 0], shuffle=False), np.arange(6))
    order = GlobalSampleOrder(1000, 64, seed=3, shuffle=True, drop_last=True, version=1)
    assert np.array_equal(order.global_batch(2), np.random.default_rng([3, 0]).permutation(1000)[128:192])
    carried = GlobalSampleOrder(10, 4, seed=3, shuffle=True, drop_last=False, version=1)
    stream = np.concatenate([np.random.default_rng([3, e]).permutation(10) for e in range(2)])
    assert np.array_equal(carried.global_batch(2), stream[8:12])  # the batch that spans two epochs


def test_the_default_evaluation_is_a_token_budget_in_whole_global_batches():
    """eval.batches 0 takes eval.tokens' budget (at least one global batch), not the whole split (5% of a 15T-token
    corpus is 750B tokens); eval.tokens 0 asks for the whole split; eval.batches wins when set."""
    from pretrain.data.loader import eval_batches
    from pretrain.recipe.config import EvalConfig

    plan = BatchPlan(1024, 4, 32, 8, seq_len=4096)  # 4M tokens a step
    assert eval_batches(EvalConfig(), plan) == 2  # 10,485,760 tokens: two 4M-token global batches
    assert eval_batches(EvalConfig(tokens=1000), plan) == 1
    assert eval_batches(EvalConfig(tokens=0), plan) == 0
    assert eval_batches(EvalConfig(batches=7, tokens=1000), plan) == 7


def test_a_rank_computes_its_own_validation_rows_only():
    plan = BatchPlan(1024, 4, 1, 256, seq_len=4096)
    mine = eval_indices(10**9, 10**5, plan, rank=3)  # 10^8 rows evaluated: no rank lists them all
    assert len(mine) == 10**5 and mine.__sizeof__() < 1000
    first, second = next(iter(mine)), list(iter(mine))[1]
    assert first == [12, 13, 14, 15] and second == [1024 + 12, 1024 + 13, 1024 + 14, 1024 + 15]
