"""Each rank's slice of the global sample order (``pretrain/data/order.py``), the batches (with per-document
positions under ``data.document_masking``), the validation batches, and ``TrainData``: the stream at a step.

Inside a global batch, micro-step m of rank r takes the MBS sequences at offset (m x world + r) x MBS, so the set of
sequences behind every optimizer step is the same on 1, 8 or 512 processes, and resuming needs nothing but the step
number (and what the order leaves out: ``order.FilteredOrder``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from pretrain.data import MixtureData, PackedData
from pretrain.data.order import (
    ORDER_VERSION,
    FilteredOrder,
    GlobalSampleOrder,
    MixtureSampleOrder,
    Quarantine,
    Window,
    batch_index,
    data_horizon,
)
from pretrain.errors import DataError
from pretrain.recipe.batching import BatchPlan
from pretrain.recipe.config import DataConfig, EvalConfig


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
    skipped: Sequence[Window | Quarantine | tuple[int, int]] = (), order_version: int = ORDER_VERSION,
) -> tuple[DataLoader, GlobalSampleOrder | MixtureSampleOrder | FilteredOrder]:
    """The training loader from optimizer step ``start_step`` on, and its order (``order_version``: the run's,
    ``order.SampleOrderVersion``); ``skipped``: what rollbacks and data.exclude leave out of the stream
    (``FilteredOrder``; a (first, last) pair: global batches)."""
    if isinstance(data, MixtureData):
        order = MixtureSampleOrder(data.train.rows_per_source, {m.name: m.weight for m in data_cfg.mixture},
                                   plan.global_batch_size, seed, data_cfg.shuffle, data_cfg.seq_len,
                                   version=order_version)
    else:
        order = GlobalSampleOrder(len(data.train), plan.global_batch_size, seed, data_cfg.shuffle,
                                  data_cfg.drop_last, version=order_version)
    if skipped:
        order = FilteredOrder(order, skipped)
    sampler = RankBatchSampler(order, plan, rank, start_step)
    return _loader(PackedSequences(data.train), sampler, data_cfg, pin_memory, masking), order


@dataclass(frozen=True)
class EvalMicroBatches:
    """One rank's validation micro-batches, computed rather than listed (a rank holds none of the others' rows):
    micro-batch u is rows [(u x world + rank) x MBS, + MBS) of the split. A DataLoader's batch sampler."""

    num_micro_batches: int
    world_size: int
    micro_batch_size: int
    rank: int

    def __len__(self) -> int:
        return self.num_micro_batches

    def __iter__(self) -> Iterator[list[int]]:
        for micro in range(self.num_micro_batches):
            start = (micro * self.world_size + self.rank) * self.micro_batch_size
            yield list(range(start, start + self.micro_batch_size))


def eval_indices(num_val: int, eval_batches: int, plan: BatchPlan, rank: int) -> EvalMicroBatches:
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
    return EvalMicroBatches(count // (plan.world_size * plan.micro_batch_size), plan.world_size,
                            plan.micro_batch_size, rank)


def eval_batches(eval_cfg: EvalConfig, plan: BatchPlan) -> int:
    """Validation global batches per evaluation (0: the whole split): eval.batches, else eval.tokens' budget in
    whole global batches, at least one."""
    if eval_cfg.batches or not eval_cfg.tokens:
        return eval_cfg.batches
    return max(1, eval_cfg.tokens // plan.tokens_per_step)


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
    rollbacks skipped), so every load (a resume, a rollback) puts it back with ``reposition``. ``order_version``: the
    run's sample order (``order.SampleOrderVersion``, loaded with the checkpoint)."""

    def __init__(self, data: PackedData | MixtureData, data_cfg: DataConfig, plan: BatchPlan, rank: int, seed: int,
                 num_steps: int, pin_memory: bool, masking: DocumentMasking | None, order_version: int = ORDER_VERSION):
        self.data, self.data_cfg, self.plan, self.rank, self.seed = data, data_cfg, plan, rank, seed
        self.order_version = order_version
        self.num_steps, self.pin_memory, self.masking = num_steps, pin_memory, masking
        self.loader: DataLoader | None = None
        self.order: GlobalSampleOrder | MixtureSampleOrder | FilteredOrder | None = None
        self.stop_step: int | None = None  # data.on_exhausted=stop: the step that ends the run (None: never)
        self.batches: Iterator | None = None

    def reposition(self, step: int, skipped: Sequence[Window | Quarantine | tuple[int, int]] = ()) -> str:
        """The stream from optimizer step ``step`` on, without what ``skipped`` leaves out; the line that says
        how many epochs of each source the run reads."""
        self.loader, self.order = build_train_loader(self.data, self.data_cfg, self.plan, self.rank, self.seed, step,
                                                     self.pin_memory, self.masking, skipped=skipped,
                                                     order_version=self.order_version)
        self.stop_step, message = data_horizon(self.order, self.num_steps, self.data_cfg.on_exhausted)
        self.batches = iter(self.loader)
        return message

    def batch_index(self, step: int) -> int:
        """The global batch of the order that optimizer step ``step`` (0-based) reads."""
        return batch_index(self.order, step)

    def val_loaders(self, eval_cfg: EvalConfig) -> dict[str, DataLoader]:
        return build_val_loaders(self.data, self.data_cfg, self.plan, self.rank, eval_batches(eval_cfg, self.plan),
                                 self.pin_memory, self.masking)
