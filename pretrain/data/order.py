"""The global sample order: which rows each optimizer step's global batch holds, computed in constant memory.

The training stream is a sequence of global batches that depends only on the seed and the recipe: epoch e is a
permutation of the packed sequences keyed by ``(seed, e)``, and optimizer step k consumes positions
[k x GBS, (k+1) x GBS) of that stream. Inside a global batch, micro-step m of rank r takes the MBS sequences at
offset (m x world + r) x MBS (``loader.RankBatchSampler``). So the set of sequences behind every optimizer step is
the same on 1, 8 or 512 processes, and resuming needs nothing but the step number.

A mixture (``data.mixture``, ``MixtureSampleOrder``) keeps all of that and gives each source its share of every
step, not only on average: the stream's rows are dealt to the sources by Sainte-Laguë (``stream_rows``), so after h
rows source i has supplied about w_i x h of them (within about one row), and step k takes
``stream_rows((k+1) x GBS) - stream_rows(k x GBS)`` rows of each. Source i's rows come from its own permutation per
epoch, keyed by (seed, name, epoch); the GBS rows of a step are shuffled together by a permutation keyed by
(seed, step), so micro-batches and ranks see the mixture too.

**Order versions** (the checkpoint records the version a run began with, ``SampleOrderVersion``, so no running job
changes its data on upgrade):

- 2 (``keyed``, every run begun since): each permutation is a ``permutation.KeyedPermutation``, a keyed bijection
  evaluated element by element. A step's rows cost O(GBS) time and memory whatever the corpus (10^12 rows as
  10^3), and every permutation can be inverted, so the positions of given rows are computed, not searched for:
  ``positions_of`` answers a quarantine's occurrences in O(rows x epochs).
- 1 (``numpy``, runs begun before): numpy's ``Generator(seed).permutation`` of each whole epoch (14.6 GB per rank at
  3.7e9 rows); kept bit for bit so that those runs resume on the data they trained on. Its occurrences are found by
  scanning the batches.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from pretrain.data.permutation import ROUNDS, KeyedPermutation, derived_keys
from pretrain.errors import DataError

ORDER_VERSION = 2  # what a new run uses
ORDER_KINDS = {1: "numpy", 2: "keyed"}
STEP_SHUFFLE_STREAM = 2**32  # above any crc32, so a step's permutation never shares a seed with a source's
SCAN_CHUNK_BATCHES = 16  # a version-1 order's occurrences are scanned this many base batches ahead at a time


class SampleOrderVersion:
    """The run's order version as a stateful part (``checkpoint.state.RunState``): a new run takes
    ``ORDER_VERSION``; a resume takes its checkpoint's; a checkpoint saved before the version was recorded began
    with version 1 (``state_when_absent``), whatever pretrain reads it."""

    state_when_absent = {"version": 1}

    def __init__(self, version: int = ORDER_VERSION):
        self.version = version

    def state_dict(self) -> dict[str, int | str]:
        return {"version": self.version, "kind": ORDER_KINDS[self.version]}

    def load_state_dict(self, state: dict) -> None:
        version = int(state["version"])
        if version not in ORDER_KINDS:
            raise DataError(f"the checkpoint's sample order is version {version}, which this pretrain does not know "
                            f"(it knows {sorted(ORDER_KINDS)}); resume it with the pretrain that wrote it")
        self.version = version


def epoch_permutation(n: int, seed: list[int], shuffle: bool) -> np.ndarray:
    """Version 1's epoch: rows 0..n-1 in numpy's ``Generator(seed).permutation(n)`` order, held as uint32 when n
    fits. ``shuffle`` into an arange draws exactly ``permutation``'s order, whatever the dtype."""
    order = np.arange(n, dtype=np.uint32 if n < 2**32 else np.int64)
    if shuffle:
        np.random.default_rng(seed).shuffle(order)
    return order


class _EpochPermutations:
    """Rows of one set of rows (a split, a mixture's source) per epoch: version 1's whole arrays (the newest two
    kept: a step spans at most two epochs), version 2's keyed permutations."""

    def __init__(self, n: int, seed: list[int], shuffle: bool, version: int):
        self.n, self.seed, self.shuffle, self.version = n, seed, shuffle, version
        self._cache: dict[int, KeyedPermutation | np.ndarray] = {}

    def _epoch(self, epoch: int) -> KeyedPermutation | np.ndarray:
        if epoch not in self._cache:
            if self.version == 1:
                self._cache[epoch] = epoch_permutation(self.n, [*self.seed, epoch], self.shuffle)
            else:
                self._cache[epoch] = KeyedPermutation(self.n, [*self.seed, epoch], self.shuffle)
            while len(self._cache) > 2:
                del self._cache[next(iter(self._cache))]
        return self._cache[epoch]

    def rows(self, epoch: int, within: np.ndarray) -> np.ndarray:
        perm = self._epoch(epoch)
        return perm[within] if isinstance(perm, np.ndarray) else perm(within)

    def rows_at(self, flat: np.ndarray, per_epoch: int) -> np.ndarray:
        """Rows at positions ``flat`` (ascending) of the concatenated epochs (``per_epoch`` positions each)."""
        epochs, within = np.divmod(flat, per_epoch)
        for older in [e for e in self._cache if len(epochs) and e < epochs[0]]:
            del self._cache[older]  # steps move forward: version 1 holds only the epochs a step reads
        if len(epochs) and epochs[0] == epochs[-1]:
            return self.rows(int(epochs[0]), within).astype(np.int64)
        rows = np.empty(len(flat), dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            rows[mask] = self.rows(int(epoch), within[mask])
        return rows

    def positions(self, epoch: int, rows: np.ndarray) -> np.ndarray:
        """Version 2: the positions of ``rows`` in ``epoch``'s order."""
        return KeyedPermutation(self.n, [*self.seed, epoch], self.shuffle).inverse(rows)


def _scan_positions(order, samples: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Flat positions in [start, stop) whose element is one of ``samples``, found by reading the base batches
    (version 1's orders, which cannot be inverted without materialising them)."""
    gbs = order.global_batch_size
    found = []
    for batch in range(start // gbs, -(-stop // gbs)):
        hits = np.flatnonzero(np.isin(order.global_batch(batch), samples)) + batch * gbs
        found.append(hits[(hits >= start) & (hits < stop)])
    return np.concatenate(found) if found else np.empty(0, dtype=np.int64)


def steps_reading(order, samples: np.ndarray, num_steps: int) -> np.ndarray:
    """The optimizer steps (0-based, < ``num_steps``) whose global batch holds one of ``samples``: from the samples'
    positions (``positions_of``), not by reading every step (``pretrain-data which --document``)."""
    if isinstance(order, FilteredOrder):
        return order.steps_reading(samples, num_steps)
    gbs = order.global_batch_size
    return np.unique(order.positions_of(np.unique(samples), 0, num_steps * gbs) // gbs)


class GlobalSampleOrder:
    """Maps an optimizer step to the indices of its global batch (a single training split)."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, shuffle: bool, drop_last: bool,
                 version: int = ORDER_VERSION):
        if num_samples < 1:
            raise DataError("the training split has no sequences; add data or lower data.seq_len")
        if drop_last and num_samples < global_batch_size:
            raise DataError(
                f"the training split has {num_samples} sequences, fewer than one global batch "
                f"({global_batch_size}); lower batch.global_batch_size or data.seq_len, add data, "
                "or set data.drop_last=false to let batches span epochs"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed, self.shuffle, self.drop_last, self.version = seed, shuffle, drop_last, version
        # positions of the stream per epoch: drop_last leaves out the rows that do not fill a global batch
        self.per_epoch = (num_samples // global_batch_size) * global_batch_size if drop_last else num_samples
        self._epochs = _EpochPermutations(num_samples, [seed], shuffle, version)
        self.analytic = version >= 2  # positions_of computes; version 1 scans
        self.scan_chunk = self.per_epoch if self.analytic else SCAN_CHUNK_BATCHES * global_batch_size

    @property
    def steps_per_epoch(self) -> float:
        return self.num_samples / self.global_batch_size

    def global_batch(self, step: int) -> np.ndarray:
        gbs = self.global_batch_size
        return self._epochs.rows_at(np.arange(step * gbs, (step + 1) * gbs, dtype=np.int64), self.per_epoch)

    def positions_of(self, samples: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Flat positions in [start, stop) of the stream whose element is one of ``samples`` (unique rows)."""
        if not self.analytic:
            return _scan_positions(self, samples, start, stop)
        samples = samples[(samples >= 0) & (samples < self.num_samples)]
        found = []
        for epoch in range(start // self.per_epoch, (stop - 1) // self.per_epoch + 1):
            within = self._epochs.positions(epoch, samples)
            flat = epoch * self.per_epoch + within[within < self.per_epoch]  # drop_last's rows are not read
            found.append(flat[(flat >= start) & (flat < stop)])
        return np.sort(np.concatenate(found)) if found else np.empty(0, dtype=np.int64)

    def steps_available(self) -> tuple[int, str]:
        """Optimizer steps before the split has been read once (its name: "" for the one training split)."""
        return self.num_samples // self.global_batch_size, ""

    def epochs_read(self, step: int) -> dict[str, float]:
        """Epochs of the training split read by steps [0, step)."""
        if self.drop_last:
            return {"": step / (self.num_samples // self.global_batch_size)}
        return {"": step * self.global_batch_size / self.num_samples}

    def metrics(self, step: int) -> dict[str, float]:
        return {}


def stream_rows(weights: Sequence[Fraction], num_rows: int) -> list[int]:
    """How many of the stream's first ``num_rows`` rows each source supplies, by Sainte-Laguë (Webster).

    Row p of the stream belongs to the source owning the p-th highest of the priorities w_i / (s + 1/2),
    s = 0, 1, 2, ... (ties: the earlier source). The first h rows are a prefix of that one fixed order, so a
    source's count never decreases as h grows (a step never takes a negative count), and it stays close to
    w_i x h: within 1/2 + n/2 x w_i rows for n sources, in practice within one. Exact arithmetic (weights as
    fractions summing to 1), so every process computes the same counts; O(n^2) whatever h is.
    """
    half = Fraction(1, 2)
    counts = [math.floor(w * num_rows + half) for w in weights]  # every priority >= 1 / num_rows: a prefix
    total = sum(counts)
    candidates = range(len(weights))
    while total < num_rows:  # the next rows of the order: highest priority, ties to the earlier source
        i = max(candidates, key=lambda i: (weights[i] / (counts[i] + half), -i))
        counts[i] += 1
        total += 1
    while total > num_rows:  # the last rows taken: lowest priority, ties to the later source
        i = min((i for i in candidates if counts[i] > 0), key=lambda i: (weights[i] / (counts[i] - half), -i))
        counts[i] -= 1
        total -= 1
    return counts


def seat_positions(seats: Sequence[int], source: int, k: np.ndarray) -> np.ndarray:
    """The stream positions of source ``source``'s rows ``k`` (0-based, its k-th row of the stream) in
    ``stream_rows``' order, in O(sources) per row: row (i, k) has priority seats[i] / (2k + 1) (``seats``: the
    weights as integers over a common denominator); the rows before it are its own k earlier ones and, of each
    other source j, those of higher priority, or equal priority when j is the earlier source. Exact (Python
    integers: a float weight's denominator is 2**53)."""
    odd = (2 * np.asarray(k, dtype=np.int64) + 1).astype(object)
    m = seats[source]
    position = np.asarray(k, dtype=np.int64).astype(object)
    for j, a in enumerate(seats):
        if j == source:
            continue
        n = a * odd  # (j, s) precedes iff m x (2s + 1) < n (<= n when j is the earlier source)
        position = position + ((n + m) // (2 * m) if j < source else (n + m - 1) // (2 * m))
    return position.astype(np.int64)


class MixtureSampleOrder:
    """A mixture's global sample order: maps an optimizer step to the indices of its global batch in the
    ``MixtureRows`` index space (source i's row j is ``offsets[i] + j``). A pure function of (seed, step)."""

    def __init__(self, rows_per_source: dict[str, int], weights: dict[str, float], global_batch_size: int,
                 seed: int, shuffle: bool, tokens_per_row: int, version: int = ORDER_VERSION):
        empty = [name for name, n in rows_per_source.items() if n < 1]
        if empty:
            raise DataError(f"data.mixture source {empty[0]!r} has no training sequence of data.seq_len + 1 "
                            "tokens; give it more data or lower data.seq_len")
        self.names = list(rows_per_source)
        self.num_rows = np.array([rows_per_source[n] for n in self.names], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.num_rows)])
        exact = [Fraction(weights[n]) for n in self.names]
        self.weights = [w / sum(exact) for w in exact]
        denominator = math.lcm(*(w.denominator for w in self.weights))
        self.seats = [int(w * denominator) for w in self.weights]
        self.global_batch_size, self.seed, self.shuffle, self.version = global_batch_size, seed, shuffle, version
        self.tokens_per_row = tokens_per_row
        source_seeds = [zlib.crc32(n.encode()) for n in self.names]  # a source's order ignores the others
        self._sources = [_EpochPermutations(int(n), [seed, s], shuffle, version)
                         for n, s in zip(self.num_rows, source_seeds, strict=True)]
        self._step_keys = np.random.SeedSequence([seed, STEP_SHUFFLE_STREAM]).generate_state(ROUNDS, dtype=np.uint64)
        self.analytic = version >= 2
        longest_epoch = max(math.ceil(n / w) for n, w in zip(self.num_rows.tolist(), self.weights, strict=True))
        self.scan_chunk = (max(longest_epoch, SCAN_CHUNK_BATCHES * global_batch_size) if self.analytic
                           else SCAN_CHUNK_BATCHES * global_batch_size)

    def rows_read(self, step: int) -> np.ndarray:
        """Rows each source has supplied to optimizer steps [0, step)."""
        return np.array(stream_rows(self.weights, step * self.global_batch_size), dtype=np.int64)

    def _source_rows(self, source: int, k: np.ndarray) -> np.ndarray:
        """Source ``source``'s rows that are its k-th rows of the stream (epoch k // n, in that epoch's order)."""
        return self._sources[source].rows_at(k, int(self.num_rows[source]))

    def _step_shuffle(self, steps: np.ndarray) -> KeyedPermutation:
        """The permutations of [0, GBS) that shuffle ``steps``' batches (one per element of ``steps``)."""
        return KeyedPermutation(self.global_batch_size, keys=derived_keys(self._step_keys, steps))

    def global_batch(self, step: int) -> np.ndarray:
        gbs = self.global_batch_size
        start, stop = self.rows_read(step), self.rows_read(step + 1)
        assert (stop >= start).all() and (stop - start).sum() == gbs
        if self.version == 1:
            return self._global_batch_v1(step, start, stop)
        batch = np.empty(gbs, dtype=np.int64)
        for i in range(len(self.names)):
            k = np.arange(start[i], stop[i], dtype=np.int64)
            if len(k):  # in the stream's order: the step's row t is its position t of stream_rows' order
                batch[seat_positions(self.seats, i, k) - step * gbs] = self.offsets[i] + self._source_rows(i, k)
        if self.shuffle:
            positions = np.arange(gbs, dtype=np.int64)
            batch = batch[self._step_shuffle(np.array([step]))(positions)]
        return batch

    def _global_batch_v1(self, step: int, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
        """Version 1: the sources' rows one source after the other, shuffled by numpy's permutation of the step."""
        parts = [self.offsets[i] + self._source_rows(i, np.arange(start[i], stop[i], dtype=np.int64))
                 for i in range(len(self.names))]
        batch = np.concatenate(parts)
        if self.shuffle:
            batch = batch[np.random.default_rng([self.seed, STEP_SHUFFLE_STREAM, step]).permutation(len(batch))]
        return batch

    def positions_of(self, samples: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Flat positions in [start, stop) of the stream whose element is one of ``samples`` (unique global rows):
        each sample's position in its source's epochs, its stream position (``seat_positions``), and its place in
        its step's shuffle (the inverse permutation)."""
        if not self.analytic:
            return _scan_positions(self, samples, start, stop)
        gbs = self.global_batch_size
        first_step, end_step = start // gbs, -(-stop // gbs)
        lo, hi = self.rows_read(first_step), self.rows_read(end_step)
        source_of = np.searchsorted(self.offsets, samples, side="right") - 1
        found = []
        for i in range(len(self.names)):
            rows = samples[source_of == i] - self.offsets[i]
            n = int(self.num_rows[i])
            rows = rows[(rows >= 0) & (rows < n)]
            if not len(rows) or hi[i] <= lo[i]:
                continue
            for epoch in range(int(lo[i]) // n, (int(hi[i]) - 1) // n + 1):
                k = epoch * n + self._sources[i].positions(epoch, rows)
                k = k[(k >= lo[i]) & (k < hi[i])]
                if not len(k):
                    continue
                t = seat_positions(self.seats, i, k)
                steps, within = np.divmod(t, gbs)
                if self.shuffle:
                    within = self._step_shuffle(steps).inverse(within)
                flat = steps * gbs + within
                found.append(flat[(flat >= start) & (flat < stop)])
        return np.sort(np.concatenate(found)) if found else np.empty(0, dtype=np.int64)

    def steps_available(self) -> tuple[int, str]:
        """Optimizer steps before the first source has been read once, and that source."""
        first = None
        for i, name in enumerate(self.names):
            def runs_out(step: int, i: int = i) -> bool:  # step `step` needs a row beyond source i's first epoch
                return self.rows_read(step + 1)[i] > self.num_rows[i]
            hi = 1
            while not runs_out(hi):
                hi *= 2
            lo = 0
            while lo < hi:  # the first step that runs out
                mid = (lo + hi) // 2
                lo, hi = (mid + 1, hi) if not runs_out(mid) else (lo, mid)
            if first is None or lo < first[0]:
                first = (lo, name)
        return first

    def epochs_read(self, step: int) -> dict[str, float]:
        """Epochs of each source read by steps [0, step)."""
        return {name: float(n / total) for name, n, total in zip(self.names, self.rows_read(step), self.num_rows,
                                                                  strict=True)}

    def metrics(self, step: int) -> dict[str, float]:
        """``data/tokens/<name>`` (training tokens of each source in steps [0, step)) and ``data/epochs/<name>``."""
        rows, epochs = self.rows_read(step), self.epochs_read(step)
        out = {f"data/tokens/{name}": int(n) * self.tokens_per_row for name, n in zip(self.names, rows, strict=True)}
        return {**out, **{f"data/epochs/{name}": e for name, e in epochs.items()}}


def data_horizon(order: GlobalSampleOrder | MixtureSampleOrder, num_steps: int, on_exhausted: str
                 ) -> tuple[int | None, str]:
    """(The step at which ``data.on_exhausted=stop`` ends the run, else None; the log line that says how many
    epochs of each source the run reads.)"""
    read = order.epochs_read(num_steps)
    amounts = ", ".join(f"{name} {e:.3g}" if name else f"{e:.3g}" for name, e in read.items())
    what = "epochs of the training split" if "" in read else "epochs per source"
    steps, name = order.steps_available()
    first = f"source {name!r}" if name else "the training split"
    if steps >= num_steps:
        return None, f"data: {num_steps} steps read {amounts} {what}"
    if on_exhausted == "stop":
        if steps == 0:
            raise DataError(f"data.on_exhausted=stop, but {first} has fewer sequences than its share of one "
                            "optimizer step; add data, lower batch.global_batch_size, or use repeat")
        return steps, (f"data: {first} has been read once after step {steps}: data.on_exhausted=stop ends the run "
                       f"there (of {num_steps} steps) with a checkpoint")
    return None, (f"warning: data: {num_steps} steps read {amounts} {what}; {first} runs out first, after step "
                  f"{steps}. data.on_exhausted=repeat: each source read again goes on in a new order per epoch "
                  "(`stop` would end the run there)")


@dataclass(frozen=True)
class Window:
    """Flat positions [start, stop) of the base order's stream left out (a ``skip: window`` rollback's window: its
    global batches [first, last] are positions [first x GBS, (last + 1) x GBS))."""

    start: int
    stop: int


@dataclass(frozen=True, eq=False)
class Quarantine:
    """Every occurrence of the global sample indices ``samples`` left out of the base order's stream from flat
    position ``start`` on (a ``skip: documents`` rollback's quarantined rows; ``data.exclude``'s, from 0)."""

    start: int
    samples: np.ndarray  # sorted, unique int64

    @classmethod
    def of(cls, start: int, samples: Sequence[int]) -> Quarantine:
        return cls(int(start), np.unique(np.asarray(list(samples), dtype=np.int64)))


def as_removal(item: Window | Quarantine | tuple[int, int], global_batch_size: int) -> Window | Quarantine:
    """A removal; a (first, last) pair of global batches (an older rollback record's ``batches``) as its Window."""
    if isinstance(item, (Window, Quarantine)):
        return item
    first, last = (int(v) for v in item)
    return Window(first * global_batch_size, (last + 1) * global_batch_size)


def _merged(windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, stop in sorted(w for w in windows if w[1] > w[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


class FilteredOrder:
    """A sample order with elements of its stream left out (``stability.rollback``, ``data.exclude``).

    The base order's stream is the concatenation of its global batches (flat position p = base batch u x GBS +
    the position in the batch). A ``Window`` leaves out a range of positions; a ``Quarantine`` every occurrence of its
    samples from its start on; optimizer step k reads elements [k x GBS, (k+1) x GBS) of what is left. So the stream
    stays a pure function of (seed, step, the removals), a resume that knows them reads what the run read, and the
    slots a quarantine frees are filled by the next samples of the stream (the global batch size stays).

    The positions a quarantine removes are computed by the base order (``positions_of``: inverted permutations,
    version 2) a chunk of the stream at a time and kept sorted (``_removed``, those outside every window): the
    element-th kept position is then a fixed point of p = element + (positions removed before p + 1), each
    evaluation a bisection. A resume at step 10^6 costs O(quarantined rows x epochs), not O(steps); a step costs
    O(GBS + log of the removed positions)."""

    def __init__(self, order: GlobalSampleOrder | MixtureSampleOrder,
                 removals: Sequence[Window | Quarantine | tuple[int, int]]):
        self.order = order
        gbs = self.global_batch_size = order.global_batch_size
        removals = [as_removal(r, gbs) for r in removals]
        self.windows = _merged([(r.start, r.stop) for r in removals if isinstance(r, Window)])
        self._window_starts = np.array([w[0] for w in self.windows], dtype=np.int64)
        self._window_stops = np.array([w[1] for w in self.windows], dtype=np.int64)
        self._window_before = np.concatenate([[0], np.cumsum(self._window_stops - self._window_starts)])
        self.quarantines = sorted((r for r in removals if isinstance(r, Quarantine) and len(r.samples)),
                                  key=lambda q: q.start)
        if self.quarantines:
            total = order.num_samples if isinstance(order, GlobalSampleOrder) else int(order.offsets[-1])
            if len(np.unique(np.concatenate([q.samples for q in self.quarantines]))) >= total:
                raise DataError(f"every one of the {total} training sequences is left out (data.exclude and the "
                                "quarantines of stability.rollback.skip=documents); shorten data.exclude's lists")
        self._removed = np.empty(0, dtype=np.int64)  # sorted positions < _covered that a quarantine removes
        self._covered = 0 if self.quarantines else math.inf
        self._masks: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # the last base batches: (elements, kept mask)

    # ---- the base stream ----------------------------------------------------------------------------------------
    def _windowed(self, lo: int, hi: int) -> int:
        """Positions of [lo, hi) inside a window."""
        return self._windowed_before(hi) - self._windowed_before(lo)

    def _windowed_before(self, position: int) -> int:
        i = int(np.searchsorted(self._window_starts, position, side="right"))  # windows starting at or before it
        if i == 0:
            return 0
        return int(self._window_before[i - 1]) + min(position, int(self._window_stops[i - 1])) - int(
            self._window_starts[i - 1])

    def _cover(self, stop: int) -> None:
        """Compute the quarantines' positions up to ``stop`` (a chunk of the stream at least)."""
        if stop <= self._covered:
            return
        start, stop = self._covered, max(stop, self._covered + self.order.scan_chunk)
        found = [self.order.positions_of(q.samples, max(q.start, start), stop)
                 for q in self.quarantines if q.start < stop]
        new = np.unique(np.concatenate(found)) if found else np.empty(0, dtype=np.int64)
        if self.windows and len(new):
            i = np.searchsorted(self._window_starts, new, side="right") - 1
            inside = (i >= 0) & (new < self._window_stops[np.maximum(i, 0)])
            new = new[~inside]
        self._removed = np.concatenate([self._removed, new])
        self._covered = stop

    def _removed_before(self, position: int) -> int:
        """Positions of [0, position) left out, by a window or a quarantine."""
        self._cover(position)
        return self._windowed_before(position) + int(np.searchsorted(self._removed, position))

    def _batch(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """Base batch ``batch``'s elements and the mask of those kept."""
        if batch not in self._masks:
            gbs = self.global_batch_size
            lo, hi = batch * gbs, (batch + 1) * gbs
            elements = self.order.global_batch(batch)
            keep = np.ones(gbs, dtype=bool)
            for start, stop in self.windows:
                if start < hi and stop > lo:
                    keep[max(start, lo) - lo : min(stop, hi) - lo] = False
            self._cover(hi)
            removed = self._removed[np.searchsorted(self._removed, lo) : np.searchsorted(self._removed, hi)]
            keep[removed - lo] = False
            if len(self._masks) >= 4:  # steps move forward: a step spans a few base batches
                self._masks.pop(next(iter(self._masks)))
            self._masks[batch] = elements, keep
        return self._masks[batch]

    def _kept_before(self, batch: int) -> int:
        """Kept elements of base batches [0, batch)."""
        return batch * self.global_batch_size - self._removed_before(batch * self.global_batch_size)

    def position(self, element: int) -> int:
        """The flat position in the base stream of the ``element``-th kept element (0-based): the least fixed point
        of p = element + removed(p + 1), reached from below (each iterate is at most the answer)."""
        position = element
        while True:
            following = element + self._removed_before(position + 1)
            i = int(np.searchsorted(self._window_starts, following, side="right")) - 1
            if i >= 0 and following < self._window_stops[i]:  # inside a window: the answer lies past its end
                following = int(self._window_stops[i])
            if following == position:
                return position
            position = following

    def locate(self, element: int) -> tuple[int, int]:
        """(base batch, index among its kept elements) of the ``element``-th kept element of the stream (0-based)."""
        batch = self.position(element) // self.global_batch_size
        return batch, element - self._kept_before(batch)

    # ---- what the loader and the loop read ---------------------------------------------------------------------
    def batch_index(self, step: int) -> int:
        """The base global batch holding the first element optimizer step ``step`` (0-based) reads."""
        return self.position(step * self.global_batch_size) // self.global_batch_size

    def base_position(self, step: int) -> int:
        """The flat position in the base stream of the first element optimizer step ``step`` reads (where a
        quarantine made at that step starts)."""
        return self.position(step * self.global_batch_size)

    def global_batch(self, step: int) -> np.ndarray:
        gbs = self.global_batch_size
        batch, index = self.locate(step * gbs)
        parts, have = [], 0
        while have < gbs:
            elements, keep = self._batch(batch)
            part = elements[keep][index : index + gbs - have]
            parts.append(part)
            have += len(part)
            batch, index = batch + 1, 0
        return np.concatenate(parts)

    def steps_reading(self, samples: np.ndarray, num_steps: int) -> np.ndarray:
        """``steps_reading`` of what is left: each occurrence not removed, at its kept index."""
        gbs = self.global_batch_size
        stop = self.position(num_steps * gbs) if num_steps else 0
        positions = self.order.positions_of(np.unique(samples), 0, stop)
        self._cover(stop)
        i = np.searchsorted(self._window_starts, positions, side="right") - 1
        windowed = (i >= 0) & (positions < self._window_stops[np.maximum(i, 0)]) if self.windows else False
        quarantined = np.isin(positions, self._removed)
        kept = positions[~(windowed | quarantined)]
        kept_index = np.array([p - self._removed_before(int(p)) for p in kept], dtype=np.int64)
        return np.unique(kept_index // gbs)

    def steps_available(self) -> tuple[int, str]:
        """The base order's steps, less the elements removed before its horizon (GBS elements a step): exactly when
        the base order computes its positions (version 2) or its scan has passed the horizon, else estimated as one
        occurrence of each quarantined sample (a row is read once an epoch; rows of another source or epoch make it
        off by their count)."""
        steps, name = self.order.steps_available()
        gbs = self.global_batch_size
        if self.order.analytic or self._covered >= steps * gbs:
            return self._kept_before(steps) // gbs, name
        removed = self._windowed(0, steps * gbs) + sum(len(q.samples) for q in self.quarantines
                                                      if q.start < steps * gbs)
        return max(0, (steps * gbs - removed) // gbs), name

    def epochs_read(self, step: int) -> dict[str, float]:
        return self.order.epochs_read(self.batch_index(step))

    def metrics(self, step: int) -> dict[str, float]:
        return self.order.metrics(self.batch_index(step))


def removals_of(records: Sequence[dict], excluded: dict | None = None) -> list[Window | Quarantine]:
    """What a run's records leave out of its order: data.exclude's rows (``excluded``, its resolution) from 0, then
    each rollback's quarantine (``skip: documents``) or window (``positions``, else the older ``batches``: a pair of
    global batches, turned into positions by the order)."""
    out: list = [Quarantine.of(0, excluded["samples"])] if excluded and excluded.get("samples") else []
    for record in records:
        if "excluded" in record:  # rundir.run_rollbacks' entry for data.exclude's resolution
            if record["excluded"] and record["excluded"].get("samples"):
                out.append(Quarantine.of(0, record["excluded"]["samples"]))
        elif record.get("quarantine"):
            out.append(Quarantine.of(record["quarantine"]["from"], record["quarantine"]["samples"]))
        elif record.get("positions"):
            out.append(Window(int(record["positions"][0]), int(record["positions"][1])))
        else:
            out.append((int(record["batches"][0]), int(record["batches"][1])))
    return out


def batch_index(order, step: int) -> int:
    """The base global batch of ``order`` holding optimizer step ``step``'s (0-based) first element: ``step`` unless
    elements are left out (``FilteredOrder``)."""
    return order.batch_index(step) if isinstance(order, FilteredOrder) else step
