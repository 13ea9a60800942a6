"""The sample order in constant memory (issue 50, item 1): a keyed bijection per epoch, the same guarantees as the
numpy permutation it replaces (every row once per epoch, any world size, exact resume at any step, mixtures and
exclusions), and runs begun before keeping their order."""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from pretrain.checkpoint.state import RunState
from pretrain.data.loader import RankBatchSampler
from pretrain.data.order import (
    ORDER_VERSION,
    FilteredOrder,
    GlobalSampleOrder,
    MixtureSampleOrder,
    Quarantine,
    SampleOrderVersion,
    Window,
    seat_positions,
    steps_reading,
    stream_rows,
)
from pretrain.data.permutation import KeyedPermutation
from pretrain.errors import DataError
from pretrain.recipe.batching import BatchPlan


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 16, 17, 100, 1023, 4097])
def test_keyed_permutation_is_a_bijection_with_its_inverse(n):
    perm = KeyedPermutation(n, [5, 1])
    rows = perm(np.arange(n))
    assert sorted(rows.tolist()) == list(range(n))
    assert np.array_equal(perm.inverse(rows), np.arange(n))
    assert np.array_equal(KeyedPermutation(n, [5, 1], shuffle=False)(np.arange(n)), np.arange(n))
    with pytest.raises(IndexError):
        perm(np.array([n]))


def test_keyed_permutation_shuffles_well():
    """Not a cryptographic claim: positions that are close map to rows that are not, and each key gives its own
    order. Measured: the rows at 1,000 consecutive positions of 10^6 fill the ten deciles evenly (each 100 +- 30),
    and two seeds agree on no more positions than chance."""
    n = 10**6
    rows = KeyedPermutation(n, [0, 0])(np.arange(1000))
    counts = np.bincount(rows * 10 // n, minlength=10)
    assert counts.min() > 70 and counts.max() < 130
    assert np.abs(np.diff(rows)).mean() > n / 5  # adjacent positions: about n/3 apart, as for a random order
    other = KeyedPermutation(n, [0, 1])(np.arange(1000))
    assert (rows == other).sum() <= 2


def test_a_trillion_rows_answer_any_position_in_a_few_megabytes():
    """10^12 rows (far beyond 15T tokens of 4,096-token rows): global batches at any step, and a resume's position,
    with the process's peak RSS a few MB over the interpreter's (a numpy permutation would be 8 TB)."""
    code = """
import json, resource, sys
import numpy as np
from pretrain.data.order import FilteredOrder, GlobalSampleOrder, MixtureSampleOrder, Quarantine
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
order = GlobalSampleOrder(10**12, 1024, seed=1, shuffle=True, drop_last=True)
batches = [order.global_batch(step) for step in (0, 10**6, 9 * 10**8, 976_562_499)]
mixture = MixtureSampleOrder({"web": 9 * 10**11, "code": 10**11}, {"web": 0.7, "code": 0.3}, 1024, 1, True, 4096)
mixed = mixture.global_batch(10**6)
filtered = FilteredOrder(order, [Quarantine.of(0, np.arange(0, 10**12, 10**7))])
resumed = filtered.global_batch(10**6)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grown_kib": after - before, "rows": [int(b.max()) for b in batches],
                  "distinct": [len(set(b.tolist())) for b in (*batches, mixed, resumed)]}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["grown_kib"] < 8 * 1024, result  # a few MB: the numpy temporaries of a few batches
    assert all(d == 1024 for d in result["distinct"])
    assert all(0 <= r < 10**12 for r in result["rows"])


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("world, mbs", [(1, 6), (3, 1)])
def test_each_row_once_per_epoch_on_1_and_3_ranks(drop_last, world, mbs):
    n, gbs = 50, 6
    plan = BatchPlan(gbs, mbs, gbs // (mbs * world), world, seq_len=4)
    order = GlobalSampleOrder(n, gbs, seed=4, shuffle=True, drop_last=drop_last)
    steps = 3 * n // gbs
    stream = []
    for step in range(steps):
        seen = [i for r in range(world) for micro in RankBatchSampler(order, plan, r).micro_batch_indices(step)
                for i in micro]
        assert sorted(seen) == sorted(order.global_batch(step).tolist())
        stream.extend(order.global_batch(step).tolist())
    per_epoch = (n // gbs) * gbs if drop_last else n
    for epoch in range(2):
        rows = stream[epoch * per_epoch : (epoch + 1) * per_epoch]
        assert len(set(rows)) == per_epoch  # each row at most once in an epoch, every row when nothing is dropped
    assert stream[:per_epoch] != stream[per_epoch : 2 * per_epoch]  # a new order each epoch


def test_mixture_gives_each_source_its_rows_once_per_epoch():
    rows_per_source, weights = {"code": 13, "web": 40, "math": 5}, {"code": 0.3, "web": 0.6, "math": 0.1}
    order = MixtureSampleOrder(rows_per_source, weights, 6, seed=2, shuffle=True, tokens_per_row=8)
    steps = 40
    batches = [order.global_batch(s) for s in range(steps)]
    for step, batch in enumerate(batches):
        counts = np.bincount(np.searchsorted(order.offsets, batch, side="right") - 1, minlength=3)
        assert np.array_equal(counts, order.rows_read(step + 1) - order.rows_read(step))
    for i, n in enumerate(rows_per_source.values()):
        taken = order._source_rows(i, np.arange(order.rows_read(steps)[i]))
        for epoch in range(len(taken) // n):
            assert sorted(taken[epoch * n : (epoch + 1) * n].tolist()) == list(range(n))
        mine = np.concatenate([b[(b >= order.offsets[i]) & (b < order.offsets[i + 1])] for b in batches])
        assert sorted((mine - order.offsets[i]).tolist()) == sorted(taken.tolist())


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4], [1 / 3, 1 / 3, 1 / 3]])
def test_seat_positions_invert_stream_rows(weights):
    """A source's k-th row sits at the stream position Sainte-Laguë's order gives it (ties: the earlier source)."""
    exact = [Fraction(w) for w in weights]
    exact = [w / sum(exact) for w in exact]
    order = MixtureSampleOrder({str(i): 10 for i in range(len(weights))},
                               {str(i): w for i, w in enumerate(weights)}, 4, 0, True, 1)
    h = 257
    counts = stream_rows(exact, h)
    positions = np.concatenate([seat_positions(order.seats, i, np.arange(c)) for i, c in enumerate(counts)])
    assert sorted(positions.tolist()) == list(range(h))


def _reference(order, removals: list, num_steps: int) -> list[list[int]]:
    """The filtered stream by brute force: every position of the base stream judged one by one."""
    gbs = order.global_batch_size
    windows = [r for r in removals if isinstance(r, Window)]
    quarantines = [r for r in removals if isinstance(r, Quarantine)]
    kept, batch = [], 0
    while len(kept) < num_steps * gbs:
        for j, element in enumerate(order.global_batch(batch).tolist()):
            p = batch * gbs + j
            if any(w.start <= p < w.stop for w in windows):
                continue
            if any(q.start <= p and element in set(q.samples.tolist()) for q in quarantines):
                continue
            kept.append(element)
        batch += 1
    return [kept[k * gbs : (k + 1) * gbs] for k in range(num_steps)]


ORDERS = {
    "single": lambda v: GlobalSampleOrder(50, 6, seed=3, shuffle=True, drop_last=True, version=v),
    "spanning epochs": lambda v: GlobalSampleOrder(47, 6, seed=3, shuffle=True, drop_last=False, version=v),
    "mixture": lambda v: MixtureSampleOrder({"a": 31, "b": 20, "c": 4}, {"a": 0.5, "b": 0.4, "c": 0.1}, 6, 3,
                                            True, 65, version=v),
}


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("kind", list(ORDERS))
def test_filtered_order_matches_the_brute_force_stream(kind, version):
    """Windows (whole batches and part of one), quarantines from mid-batch positions, a row in two quarantines and
    in a window: every step equals the brute-force stream, read in order and answered alone (a resume)."""
    order = ORDERS[kind](version)
    removals = [Window(12, 24), Quarantine.of(0, [5, 17]), Quarantine.of(27, [3, 5, 30, 44]), Window(40, 43),
                Quarantine.of(100, [8, 9, 10, 11, 12])]
    steps = 45
    expected = _reference(order, removals, steps)
    filtered = FilteredOrder(order, removals)
    assert [filtered.global_batch(s).tolist() for s in range(steps)] == expected
    for step in (0, 7, 23, 44):
        assert FilteredOrder(order, removals).global_batch(step).tolist() == expected[step]
    assert FilteredOrder(order, removals).batch_index(30) == filtered.batch_index(30)


@pytest.mark.parametrize("kind", list(ORDERS))
def test_positions_of_are_the_rows_occurrences(kind):
    order = ORDERS[kind](2)
    samples = np.array([0, 3, 7, 19, 30], dtype=np.int64)
    gbs, start, stop = order.global_batch_size, 5, 400
    scanned = [b * gbs + j for b in range(-(-stop // gbs)) for j, e in enumerate(order.global_batch(b).tolist())
               if e in samples and start <= b * gbs + j < stop]
    assert order.positions_of(samples, start, stop).tolist() == scanned


def test_exclusions_keep_the_world_size_invariance():
    order = FilteredOrder(ORDERS["mixture"](2), [Quarantine.of(0, [1, 2, 3]), Window(18, 30)])
    for world, mbs in [(1, 6), (3, 2), (3, 1)]:
        plan = BatchPlan(6, mbs, 6 // (mbs * world), world, seq_len=4)
        for step in range(10):
            seen = [i for r in range(world) for m in RankBatchSampler(order, plan, r).micro_batch_indices(step)
                    for i in m]
            assert sorted(seen) == sorted(order.global_batch(step).tolist())
            assert not {1, 2, 3} & set(seen)


def test_new_runs_take_the_keyed_order_and_old_checkpoints_keep_theirs():
    """The version is a part of the run state: a new run's is ORDER_VERSION, a checkpoint's is loaded, and a
    checkpoint saved before the version was recorded began with version 1 (numpy's permutation)."""
    assert SampleOrderVersion().version == ORDER_VERSION == 2
    part = SampleOrderVersion()
    RunState(log=lambda _: None, data_order=part).load_state_dict({})
    assert part.version == 1
    part = SampleOrderVersion()
    state = SampleOrderVersion().state_dict()
    assert state == {"version": 2, "kind": "keyed"}
    RunState(log=lambda _: None, data_order=part).load_state_dict({"data_order": state})
    assert part.version == 2
    with pytest.raises(DataError, match="version 7"):
        SampleOrderVersion().load_state_dict({"version": 7})
    legacy = GlobalSampleOrder(100, 10, seed=1, shuffle=True, drop_last=True, version=1)
    keyed = GlobalSampleOrder(100, 10, seed=1, shuffle=True, drop_last=True, version=2)
    assert np.array_equal(legacy.global_batch(0), np.random.default_rng([1, 0]).permutation(100)[:10])
    assert not np.array_equal(legacy.global_batch(0), keyed.global_batch(0))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("kind", list(ORDERS))
def test_steps_reading_are_the_steps_whose_batches_hold_the_rows(kind, version):
    """pretrain-data which --document: the steps that read given rows, from their positions, with and without
    removals, equal those found by reading every step."""
    order = ORDERS[kind](version)
    samples = np.array([2, 5, 13], dtype=np.int64)
    for what in (order, FilteredOrder(order, [Window(12, 24), Quarantine.of(30, [5]), Quarantine.of(0, [40])])):
        scanned = [s for s in range(40) if set(what.global_batch(s).tolist()) & set(samples.tolist())]
        assert steps_reading(what, samples, 40).tolist() == scanned
