"""Global sample order, each rank's slice of it, and the batches (with per-document positions under
``data.document_masking``).

The training stream is a sequence of global batches that depends only on the seed and the recipe:
epoch e is a permutation of the packed sequences drawn from ``(seed, e)``, and optimizer step k
consumes positions [k x GBS, (k+1) x GBS) of that stream. Inside a global batch, micro-step m of rank
r takes the MBS sequences at offset (m x world + r) x MBS. So the set of sequences behind every
optimizer step is the same on 1, 8 or 512 processes, and resuming needs nothing but the step number.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from pretrain.batching import BatchPlan
from pretrain.config import DataConfig
from pretrain.errors import DataError


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
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
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
    tokens: np.ndarray, data_cfg: DataConfig, plan: BatchPlan, rank: int, seed: int, start_step: int, pin_memory: bool,
    masking: DocumentMasking | None = None,
) -> tuple[DataLoader, GlobalSampleOrder]:
    order = GlobalSampleOrder(len(tokens), plan.global_batch_size, seed, data_cfg.shuffle, data_cfg.drop_last)
    sampler = RankBatchSampler(order, plan, rank, start_step)
    return _loader(PackedSequences(tokens), sampler, data_cfg, pin_memory, masking), order


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


def build_val_loader(tokens: np.ndarray, data_cfg: DataConfig, plan: BatchPlan, rank: int, eval_batches: int,
                     pin_memory: bool, masking: DocumentMasking | None = None) -> DataLoader:
    """Validation batches, with the training run's document masking so that val/loss measures the same task."""
    indices = eval_indices(len(tokens), eval_batches, plan, rank)
    return _loader(PackedSequences(tokens), indices, data_cfg, pin_memory, masking)
