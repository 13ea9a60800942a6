"""The packed data on disk, in cache_root/packed/<key>/: train.npy and val.npy (int32 rows of
seq_len + 1 tokens), stats.json and the tokenizer; written once, memory-mapped when loaded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.config import DataConfig
from pretrain.data.tokenizer import _load_saved_tokenizer

TOKENS_DTYPE = np.int32


@dataclass
class PackedData:
    """Packed token sequences of both splits, the tokenizer that made them and what it took."""

    train: np.ndarray  # int32 [num_train_sequences, seq_len + 1], usually a read-only memory map
    val: np.ndarray  # int32 [num_val_sequences, seq_len + 1]
    tokenizer: Any  # transformers.PreTrainedTokenizerFast with eos_token set
    stats: dict[str, Any]  # JSON-serialisable counts and provenance, see prepare_data


class _SequenceWriter:
    """Fills an .npy file of shape [num_sequences, row_len] from a token stream; surplus is dropped."""

    def __init__(self, path: Path, num_sequences: int, row_len: int):
        self.array = np.lib.format.open_memmap(path, mode="w+", dtype=TOKENS_DTYPE, shape=(num_sequences, row_len))
        self.flat = self.array.reshape(-1)
        self.pos = 0

    def write(self, tokens: np.ndarray):
        n = min(len(tokens), len(self.flat) - self.pos)
        self.flat[self.pos : self.pos + n] = tokens[:n]
        self.pos += n

    def close(self):
        assert self.pos == len(self.flat), (self.pos, len(self.flat))
        self.array.flush()
        del self.flat, self.array


def _load_packed(path: Path, data_cfg: DataConfig, tokenizer=None) -> PackedData:
    stats = json.loads((path / "stats.json").read_text())
    train = np.load(path / "train.npy", mmap_mode="r")
    val = np.load(path / "val.npy", mmap_mode="r")
    if data_cfg.train_subset:
        train = train[: data_cfg.train_subset]
    if data_cfg.val_subset:
        val = val[: data_cfg.val_subset]
    stats.update(
        num_train_sequences=len(train),
        num_val_sequences=len(val),
        train_subset=data_cfg.train_subset,
        val_subset=data_cfg.val_subset,
        cache_dir=str(path),
    )
    if tokenizer is None:
        tokenizer = _load_saved_tokenizer(path / "tokenizer")
    return PackedData(train=train, val=val, tokenizer=tokenizer, stats=stats)
