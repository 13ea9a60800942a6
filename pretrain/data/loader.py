"""Global sample order, each rank's slice of it, and the batches (with per-document positions under
``data.document_masking``).

The training stream is a sequence of global batches that depends only on the seed and the recipe:
epoch e is a permutation of the packed sequences drawn from ``(seed, e)``, and optimizer step k
consumes positions [k x GBS, (k+1) x GBS) of that stream. Inside a global batch, micro-step m of rank
r takes the MBS sequences at offset (m x world + r) x MBS. So the set of sequences behind every
optimizer step is the same on 1, 8 or 512 processes, and resuming needs nothing but the step number.

A mixture (``data.mixture``, ``MixtureSampleOrder``) keeps all of that and gives each source its share of
every step, not only on average: the stream's rows are dealt to the sources by Sainte-Laguë (``stream_rows``),
so after h rows source i has supplied about w_i x h of them (within about one row), and step k takes
``stream_rows((k+1) x GBS) - stream_rows(k x GBS)`` rows of each. Source i's rows come from its own
permutation per epoch, drawn from (seed, name, epoch); the GBS rows of a step are shuffled together by a
permutation drawn from (seed, step), so micro-batches and ranks see the mixture too.
"""

from __future__ import annotations

import bisect
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from fractions import Fraction

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from pretrain.data import MixtureData, PackedData
from pretrain.errors import DataError
from pretrain.recipe.batching import BatchPlan
from pretrain.recipe.config import DataConfig


def epoch_permutation(n: int, seed: list[int], shuffle: bool) -> np.ndarray:
    """Rows 0..n-1 in an epoch's order: numpy's ``Generator(seed).permutation(n)``, held as uint32 when n fits
    (half of int64's memory on every rank: 1 TB of text is ~1.2e8 rows of 2048 tokens, 0.5 GB per rank in
    uint32). ``shuffle`` into an arange draws exactly ``permutation``'s order, whatever the dtype."""
    order = np.arange(n, dtype=np.uint32 if n < 2**32 else np.int64)
    if shuffle:
        np.random.default_rng(seed).shuffle(order)
    return order


class GlobalSampleOrder:
    """Maps an optimizer step to the indices of its global batch."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int, shuffle: bool, drop_last: bool):
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
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._perm_cache: dict[int, np.ndarray] = {}

    def epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            order = epoch_permutation(self.num_samples, [self.seed, epoch], self.shuffle)
            self._perm_cache = {epoch: order}  # steps move forward: keep only the current epoch
        return self._perm_cache[epoch]

    @property
    def steps_per_epoch(self) -> float:
        return self.num_samples / self.global_batch_size

    def global_batch(self, step: int) -> np.ndarray:
        gbs, n = self.global_batch_size, self.num_samples
        if self.drop_last:
            batches_per_epoch = n // gbs
            epoch, index = divmod(step, batches_per_epoch)
            return self.epoch_order(epoch)[index * gbs : (index + 1) * gbs]
        start = step * gbs
        parts, position = [], start
        while position < start + gbs:
            epoch, offset = divmod(position, n)
            take = min(n - offset, start + gbs - position)
            parts.append(self.epoch_order(epoch)[offset : offset + take])
            position += take
        return np.concatenate(parts)


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


STEP_SHUFFLE_STREAM = 2**32  # above any crc32, so a step's permutation never shares a seed with a source's


class MixtureSampleOrder:
    """A mixture's global sample order: maps an optimizer step to the indices of its global batch in the
    ``MixtureRows`` index space (source i's row j is ``offsets[i] + j``). A pure function of (seed, step)."""

    def __init__(self, rows_per_source: dict[str, int], weights: dict[str, float], global_batch_size: int,
                 seed: int, shuffle: bool, tokens_per_row: int):
        empty = [name for name, n in rows_per_source.items() if n < 1]
        if empty:
            raise DataError(f"data.mixture source {empty[0]!r} has no training sequence of data.seq_len + 1 "
                            "tokens; give it more data or lower data.seq_len")
        self.names = list(rows_per_source)
        self.num_rows = np.array([rows_per_source[n] for n in self.names], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.num_rows)])
        exact = [Fraction(weights[n]) for n in self.names]
        self.weights = [w / sum(exact) for w in exact]
        self.global_batch_size, self.seed, self.shuffle = global_batch_size, seed, shuffle
        self.tokens_per_row = tokens_per_row
        self._source_seeds = [zlib.crc32(n.encode()) for n in self.names]  # a source's order ignores the others
        self._perm_cache: list[dict[int, np.ndarray]] = [{} for _ in self.names]

    def rows_read(self, step: int) -> np.ndarray:
        """Rows each source has supplied to optimizer steps [0, step)."""
        return np.array(stream_rows(self.weights, step * self.global_batch_size), dtype=np.int64)

    def source_order(self, source: int, epoch: int) -> np.ndarray:
        cache = self._perm_cache[source]
        if epoch not in cache:
            n = int(self.num_rows[source])
            seed = [self.seed, self._source_seeds[source], epoch]
            cache[epoch] = epoch_permutation(n, seed, self.shuffle)
            while len(cache) > 2:  # a step spans at most two epochs of a source: keep the newest two
                del cache[next(iter(cache))]
        return cache[epoch]

    def global_batch(self, step: int) -> np.ndarray:
        start, stop = self.rows_read(step), self.rows_read(step + 1)
        assert (stop >= start).all() and (stop - start).sum() == self.global_batch_size
        parts = []
        for i in range(len(self.names)):
            j = np.arange(start[i], stop[i])
            epochs, within = np.divmod(j, self.num_rows[i])
            rows = np.empty_like(j)
            for epoch in np.unique(epochs):
                mask = epochs == epoch
                rows[mask] = self.source_order(i, int(epoch))[within[mask]]
            parts.append(self.offsets[i] + rows)
        batch = np.concatenate(parts)
        if self.shuffle:
            batch = batch[np.random.default_rng([self.seed, STEP_SHUFFLE_STREAM, step]).permutation(len(batch))]
        return batch

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

    Windows alone (``skip: window`` rollbacks) are arithmetic: whole base batches left out, nothing scanned, exactly
    what the order read before quarantines existed. A quarantine's occurrences are found by scanning base batches
    forward from its start (``np.isin``), once: each scanned base batch's kept count is cached, so training, which
    reads steps in order, scans one base batch per step, and a resume scans once from the quarantine's start."""

    def __init__(self, order: GlobalSampleOrder | MixtureSampleOrder,
                 removals: Sequence[Window | Quarantine | tuple[int, int]]):
        self.order = order
        gbs = self.global_batch_size = order.global_batch_size
        removals = [as_removal(r, gbs) for r in removals]
        self.windows = _merged([(r.start, r.stop) for r in removals if isinstance(r, Window)])
        self.quarantines = sorted((r for r in removals if isinstance(r, Quarantine) and len(r.samples)),
                                  key=lambda q: q.start)
        if self.quarantines:
            total = order.num_samples if isinstance(order, GlobalSampleOrder) else int(order.offsets[-1])
            if len(np.unique(np.concatenate([q.samples for q in self.quarantines]))) >= total:
                raise DataError(f"every one of the {total} training sequences is left out (data.exclude and the "
                                "quarantines of stability.rollback.skip=documents); shorten data.exclude's lists")
        # Base batches before scan_from hold no position a quarantine acts on: windows alone decide there.
        self.scan_from = self.quarantines[0].start // gbs if self.quarantines else None
        self._cumulative = [0]  # kept elements of base batches [scan_from, scan_from + i), for each i scanned
        self._masks: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # the last base batches: (elements, kept mask)

    # ---- the base stream ----------------------------------------------------------------------------------------
    def _windowed(self, lo: int, hi: int) -> int:
        """Positions of [lo, hi) inside a window."""
        return sum(max(0, min(stop, hi) - max(start, lo)) for start, stop in self.windows)

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
            for q in self.quarantines:
                if q.start < hi:
                    hit = np.isin(elements, q.samples)
                    hit[: max(0, q.start - lo)] = False
                    keep &= ~hit
            if len(self._masks) >= 4:  # steps move forward: a step spans a few base batches
                self._masks.pop(next(iter(self._masks)))
            self._masks[batch] = elements, keep
        return self._masks[batch]

    def _kept_before(self, batch: int) -> int:
        """Kept elements of base batches [0, batch)."""
        gbs = self.global_batch_size
        if self.scan_from is None or batch <= self.scan_from:
            return batch * gbs - self._windowed(0, batch * gbs)
        while len(self._cumulative) <= batch - self.scan_from:
            scanned = self.scan_from + len(self._cumulative) - 1
            self._cumulative.append(self._cumulative[-1] + int(self._batch(scanned)[1].sum()))
        return self._kept_before(self.scan_from) + self._cumulative[batch - self.scan_from]

    def locate(self, element: int) -> tuple[int, int]:
        """(base batch, index among its kept elements) of the ``element``-th kept element of the stream (0-based)."""
        gbs = self.global_batch_size
        head = None if self.scan_from is None else self._kept_before(self.scan_from)
        if head is None or element < head:
            position = element
            for start, stop in self.windows:  # merged and sorted: each one at or before the position moves it on
                if start > position:
                    break
                position += stop - start
            batch = position // gbs
            return batch, position - batch * gbs - self._windowed(batch * gbs, position)
        rest = element - head
        while self._cumulative[-1] <= rest:  # scan on: one base batch per step read in order
            self._kept_before(self.scan_from + len(self._cumulative))
        index = bisect.bisect_right(self._cumulative, rest) - 1
        return self.scan_from + index, rest - self._cumulative[index]

    # ---- what the loader and the loop read ---------------------------------------------------------------------
    def batch_index(self, step: int) -> int:
        """The base global batch holding the first element optimizer step ``step`` (0-based) reads."""
        return self.locate(step * self.global_batch_size)[0]

    def base_position(self, step: int) -> int:
        """The flat position in the base stream of the first element optimizer step ``step`` reads (where a
        quarantine made at that step starts)."""
        batch, index = self.locate(step * self.global_batch_size)
        return batch * self.global_batch_size + int(np.flatnonzero(self._batch(batch)[1])[index])

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

    def steps_available(self) -> tuple[int, str]:
        """The base order's steps, less the elements removed before its horizon (GBS elements a step): windows
        exactly; a quarantine exactly once the scan has passed the horizon, else estimated as one occurrence of each
        of its samples (a row is read once an epoch; rows of another source or epoch make it off by their count)."""
        steps, name = self.order.steps_available()
        gbs = self.global_batch_size
        if self.scan_from is not None and len(self._cumulative) - 1 + self.scan_from >= steps:
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


class RankBatchSampler:
    """Yields this rank's micro-batches (lists of sequence indices), GAS per optimizer step, forever."""

    def __init__(self, order: GlobalSampleOrder, plan: BatchPlan, rank: int, start_step: int = 0):
        self.order, self.plan, self.rank, self.start_step = order, plan, rank, start_step

    def micro_batch_indices(self, step: int) -> list[list[int]]:
        batch = self.order.global_batch(step)
        mbs, world = self.plan.micro_batch_size, self.plan.world_size
        return [
            batch[(micro * world + self.rank) * mbs : (micro * world + self.rank + 1) * mbs].tolist()
            for micro in range(self.plan.grad_accum_steps)
        ]

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        while True:
            yield from self.micro_batch_indices(step)
            step += 1


class PackedSequences(Dataset):
    """Rows of a packed [N, seq_len + 1] token array; a row gives inputs [:-1] and targets [1:]."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.tokens[index]

    def __getitems__(self, indices: list[int]) -> np.ndarray:
        # One fancy-index read per micro-batch instead of MBS row reads (and memmap page faults).
        return self.tokens[np.asarray(indices)]


@dataclass(frozen=True)
class DocumentMasking:
    """``data.document_masking``: each token attends only within its own document of a packed row.

    A row of the store is a window of the eos-joined document stream, so documents are told apart by the
    eos token: an eos ends its document (it is that document's last input, and its target is the next
    document's first token: the loss keeps that target, so every position of a row stays a target and the
    loss normalisation is unchanged), and the token after it starts a new document at position 0. The first
    document of a row, usually the tail of one that began in an earlier row, starts at position 0 there.

    transformers turns per-document position ids into a block-causal mask for sdpa and eager
    (``masking_utils.find_packed_sequence_indices``); flash_attention_2 needs the varlen arguments
    (``cu_seq_lens_*``, ``max_length_*``), because it reads packed position ids only when the batch has one
    row. Both are computed here, in the collate function: on the CPU (in the DataLoader's workers when
    data.num_workers > 0), with ``max_length`` a host int, so the loop adds no device read of its own.
    transformers' packed-sequence detection still reads one flag back from the device per forward (once,
    before the first layer; not under torch.compile).
    """

    eos_id: int
    varlen: bool  # flash_attention_2: also the cumulative document lengths of the flattened batch


def document_positions(input_ids: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids that restart at 0 at each document start, and the starts ([MBS, seq_len] bool)."""
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    index = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    last_start = torch.where(starts, index, 0).cummax(dim=1).values
    return index - last_start, starts


@dataclass
class Batch:
    input_ids: torch.Tensor  # [MBS, seq_len]
    targets: torch.Tensor  # [MBS, seq_len]
    position_ids: torch.Tensor | None = None  # [MBS, seq_len], per document (data.document_masking)
    cu_seq_lens: torch.Tensor | None = None  # int32 [num_documents + 1], document starts of the flattened batch
    max_length: int | None = None  # the longest document of the batch (tokens): a host int, no device read

    def _map(self, fn) -> Batch:
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{name: fn(t) for name, t in tensors.items() if isinstance(t, torch.Tensor)})

    def pin_memory(self) -> Batch:
        return self._map(torch.Tensor.pin_memory)

    def to(self, device, non_blocking: bool = True) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def attention_kwargs(self) -> dict:
        """Model keyword arguments that keep attention within documents; empty without document masking."""
        if self.position_ids is None:
            return {}
        if self.cu_seq_lens is None:
            return {"position_ids": self.position_ids}
        return {"position_ids": self.position_ids, "cu_seq_lens_q": self.cu_seq_lens,
                "cu_seq_lens_k": self.cu_seq_lens, "max_length_q": self.max_length, "max_length_k": self.max_length}


class Collate:
    """Rows [MBS, seq_len + 1] -> a Batch of inputs [:-1] and targets [1:] (picklable for worker processes)."""

    def __init__(self, masking: DocumentMasking | None = None):
        self.masking = masking

    def __call__(self, rows: np.ndarray | list[np.ndarray]) -> Batch:
        tokens = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        batch = Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        if self.masking is None:
            return batch
        batch.position_ids, starts = document_positions(batch.input_ids, self.masking.eos_id)
        if self.masking.varlen:
            flat_starts = starts.reshape(-1).nonzero().reshape(-1)
            bounds = torch.cat([flat_starts, torch.tensor([starts.numel()])])
            batch.cu_seq_lens = bounds.to(torch.int32)
            batch.max_length = int(bounds.diff().max())
        return batch


def _loader(dataset: Dataset, batch_sampler, data_cfg: DataConfig, pin_memory: bool,
            masking: DocumentMasking | None) -> DataLoader:
    extra = {"prefetch_factor": data_cfg.prefetch_factor} if data_cfg.num_workers > 0 else {}
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=Collate(masking),
        num_workers=data_cfg.num_workers,
        pin_memory=pin_memory,
        persistent_workers=data_cfg.num_workers > 0,
        **extra,
    )


def build_train_loader(
    data: PackedData | MixtureData, data_cfg: DataConfig, plan: BatchPlan, rank: int, seed: int, start_step: int,
    pin_memory: bool, masking: DocumentMasking | None = None,
    skipped: Sequence[Window | Quarantine | tuple[int, int]] = (),
) -> tuple[DataLoader, GlobalSampleOrder | MixtureSampleOrder | FilteredOrder]:
    """The training loader from optimizer step ``start_step`` on, and its order; ``skipped``: what rollbacks and
    data.exclude leave out of the stream (``FilteredOrder``; a (first, last) pair: global batches)."""
    if isinstance(data, MixtureData):
        order = MixtureSampleOrder(data.train.rows_per_source, {m.name: m.weight for m in data_cfg.mixture},
                                   plan.global_batch_size, seed, data_cfg.shuffle, data_cfg.seq_len)
    else:
        order = GlobalSampleOrder(len(data.train), plan.global_batch_size, seed, data_cfg.shuffle,
                                  data_cfg.drop_last)
    if skipped:
        order = FilteredOrder(order, skipped)
    sampler = RankBatchSampler(order, plan, rank, start_step)
    return _loader(PackedSequences(data.train), sampler, data_cfg, pin_memory, masking), order


def eval_indices(num_val: int, eval_batches: int, plan: BatchPlan, rank: int) -> list[list[int]]:
    """This rank's validation micro-batches.

    The evaluated set is the first ``eval_batches`` x GBS validation sequences (all if 0), trimmed to a
    multiple of GBS so that it is the same set on any world size, and every rank runs the same number
    of forwards (ZeRO-3 gathers parameters collectively in forward).
    """
    unit = plan.global_batch_size
    wanted = num_val if eval_batches == 0 else min(num_val, eval_batches * unit)
    if wanted < unit:
        unit = plan.micro_batch_size * plan.world_size
    count = (wanted // unit) * unit
    if count == 0:
        raise DataError(
            f"the validation split has {num_val} sequences, fewer than one micro-batch per process "
            f"({plan.micro_batch_size} x {plan.world_size}); raise data.val_fraction or lower data.seq_len"
        )
    mine = np.arange(count).reshape(-1, plan.world_size, plan.micro_batch_size)[:, rank, :]
    return mine.tolist()


def build_val_loaders(data: PackedData | MixtureData, data_cfg: DataConfig, plan: BatchPlan, rank: int,
                      eval_batches: int, pin_memory: bool, masking: DocumentMasking | None = None
                      ) -> dict[str, DataLoader]:
    """Validation batches of each source ({"": ...} for a single source), with the training run's document
    masking so that val/loss measures the same task. Each source is evaluated on ``eval_batches`` global
    batches of its own validation split."""
    splits = {name: d.val for name, d in data.sources.items()} if isinstance(data, MixtureData) else {"": data.val}
    out = {}
    for name, tokens in splits.items():
        try:
            indices = eval_indices(len(tokens), eval_batches, plan, rank)
        except DataError as exc:
            raise DataError(f"data.mixture source {name!r}: {exc}" if name else str(exc)) from None
        out[name] = _loader(PackedSequences(tokens), indices, data_cfg, pin_memory, masking)
    return out


def document_masking(data_cfg: DataConfig, attention: str, tokenizer) -> DocumentMasking | None:
    """``data.document_masking``: documents end at the tokenizer's eos (the token packing appends to each)."""
    if not data_cfg.document_masking:
        return None
    return DocumentMasking(eos_id=tokenizer.eos_token_id, varlen=attention == "flash_attention_2")


class TrainData:
    """The training stream of this rank at an optimizer step: the loader, its sample order and the horizon of
    ``data.on_exhausted``. Its position is no state of its own: a pure function of (seed, step, the global batches
    rollbacks skipped), so every load (a resume, a rollback) puts it back with ``reposition``."""

    def __init__(self, data: PackedData | MixtureData, data_cfg: DataConfig, plan: BatchPlan, rank: int, seed: int,
                 num_steps: int, pin_memory: bool, masking: DocumentMasking | None):
        self.data, self.data_cfg, self.plan, self.rank, self.seed = data, data_cfg, plan, rank, seed
        self.num_steps, self.pin_memory, self.masking = num_steps, pin_memory, masking
        self.loader: DataLoader | None = None
        self.order: GlobalSampleOrder | MixtureSampleOrder | FilteredOrder | None = None
        self.stop_step: int | None = None  # data.on_exhausted=stop: the step that ends the run (None: never)
        self.batches: Iterator | None = None

    def reposition(self, step: int, skipped: Sequence[Window | Quarantine | tuple[int, int]] = ()) -> str:
        """The stream from optimizer step ``step`` on, without what ``skipped`` leaves out; the line that says
        how many epochs of each source the run reads."""
        self.loader, self.order = build_train_loader(self.data, self.data_cfg, self.plan, self.rank, self.seed, step,
                                                     self.pin_memory, self.masking, skipped=skipped)
        self.stop_step, message = data_horizon(self.order, self.num_steps, self.data_cfg.on_exhausted)
        self.batches = iter(self.loader)
        return message

    def batch_index(self, step: int) -> int:
        """The global batch of the order that optimizer step ``step`` (0-based) reads."""
        return batch_index(self.order, step)

    def val_loaders(self, eval_batches: int) -> dict[str, DataLoader]:
        return build_val_loaders(self.data, self.data_cfg, self.plan, self.rank, eval_batches, self.pin_memory,
                                 self.masking)
