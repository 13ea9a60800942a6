"""Global sample order and each rank's slice of it.

The training stream is a sequence of global batches that depends only on the seed and the recipe:
epoch e is a permutation of the packed sequences drawn from ``(seed, e)``, and optimizer step k
consumes positions [k x GBS, (k+1) x GBS) of that stream. Inside a global batch, micro-step m of rank
r takes the MBS sequences at offset (m x world + r) x MBS. So the set of sequences behind every
optimizer step is the same on 1, 8 or 512 processes, and resuming needs nothing but the step number.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

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


@dataclass
class Batch:
    input_ids: torch.Tensor  # [MBS, seq_len]
    targets: torch.Tensor  # [MBS, seq_len]

    def pin_memory(self) -> Batch:
        return Batch(self.input_ids.pin_memory(), self.targets.pin_memory())

    def to(self, device, non_blocking: bool = True) -> Batch:
        return Batch(self.input_ids.to(device, non_blocking=non_blocking), self.targets.to(device, non_blocking=non_blocking))


def collate(rows: np.ndarray | list[np.ndarray]) -> Batch:
    tokens = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _loader(dataset: Dataset, batch_sampler, data_cfg: DataConfig, pin_memory: bool) -> DataLoader:
    extra = {"prefetch_factor": data_cfg.prefetch_factor} if data_cfg.num_workers > 0 else {}
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate,
        num_workers=data_cfg.num_workers,
        pin_memory=pin_memory,
        persistent_workers=data_cfg.num_workers > 0,
        **extra,
    )


def build_train_loader(
    tokens: np.ndarray, data_cfg: DataConfig, plan: BatchPlan, rank: int, seed: int, start_step: int, pin_memory: bool
) -> tuple[DataLoader, GlobalSampleOrder]:
    order = GlobalSampleOrder(len(tokens), plan.global_batch_size, seed, data_cfg.shuffle, data_cfg.drop_last)
    sampler = RankBatchSampler(order, plan, rank, start_step)
    return _loader(PackedSequences(tokens), sampler, data_cfg, pin_memory), order


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
                     pin_memory: bool) -> DataLoader:
    return _loader(PackedSequences(tokens), eval_indices(len(tokens), eval_batches, plan, rank), data_cfg, pin_memory)
