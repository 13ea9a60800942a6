"""Tokenize the documents with ``Dataset.map`` (eos after each) and cut each split's token stream into
rows of seq_len + 1 tokens."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pretrain.config import DataConfig
from pretrain.data.store import _SequenceWriter
from pretrain.errors import DataError


@contextlib.contextmanager
def _tokenizers_fork_safe():
    """Forked map workers would otherwise each print a warning and disable Rust parallelism anyway."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


class _Encode:
    """Batched map function: token ids of each document followed by eos (picklable for num_proc)."""

    def __init__(self, backend, eos_id: int):
        self.backend, self.eos_id = backend, eos_id

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        encodings = self.backend.encode_batch_fast(batch["text"], add_special_tokens=False)
        return {"input_ids": [e.ids + [self.eos_id] for e in encodings]}


def _tokenize(docs, tokenizer, num_proc: int, work_dir: Path, fingerprint: str):
    import datasets

    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
    with _tokenizers_fork_safe() if num_proc > 1 else contextlib.nullcontext():
        return docs.map(
            _Encode(tokenizer.backend_tokenizer, tokenizer.eos_token_id),
            batched=True,
            batch_size=256,
            num_proc=num_proc if num_proc > 1 else None,
            remove_columns=docs.column_names,
            features=features,
            cache_file_name=str(work_dir / "tokens.arrow"),
            new_fingerprint=fingerprint,
            desc="tokenize",
        )


def _token_batches(tokens) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(per-document lengths, flat token ids) for consecutive batches of documents."""
    import pyarrow.compute as pc

    for table in tokens.with_format("arrow").iter(batch_size=4096):
        column = table.column("input_ids")
        for chunk in column.chunks:
            yield (
                pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64),
                pc.list_flatten(chunk).to_numpy(zero_copy_only=False),
            )


def _too_few_tokens(split: str, num_tokens: int, num_docs: int, data_cfg: DataConfig, hint: str) -> DataError:
    return DataError(
        f"data: the {split} split has {num_tokens:,} tokens ({num_docs:,} documents of data.source = "
        f"{data_cfg.source!r}), fewer than one sequence of data.seq_len + 1 = {data_cfg.seq_len + 1} tokens; "
        f"use a smaller data.seq_len{hint} or more data"
    )


def _pack(tokens, is_val: np.ndarray, data_cfg: DataConfig, work_dir: Path) -> dict[str, int]:
    """Write train.npy and val.npy into work_dir; return the token and sequence counts."""
    row_len = data_cfg.seq_len + 1
    lengths = np.concatenate([lengths for lengths, _ in _token_batches(tokens)])
    single = len(lengths) == 1
    if single:
        # The one document's stream (text tokens + eos) is cut before its last val_fraction of text tokens.
        num_text = int(lengths[0]) - 1
        num_val_text = max(1, round(num_text * data_cfg.val_fraction)) if num_text >= 2 else 0
        cut = num_text - num_val_text
        num_tokens = {"train": cut + 1, "val": num_val_text + 1 if num_val_text else 0}
        num_docs = {"train": 1, "val": 1 if num_val_text else 0}
    else:
        num_tokens = {"train": int(lengths[~is_val].sum()), "val": int(lengths[is_val].sum())}
        num_docs = {"train": int((~is_val).sum()), "val": int(is_val.sum())}
    hints = {"train": "", "val": ", a larger data.val_fraction"}
    for split in ("train", "val"):
        if num_tokens[split] < row_len:
            raise _too_few_tokens(split, num_tokens[split], num_docs[split], data_cfg, hints[split])
    num_sequences = {split: num_tokens[split] // row_len for split in ("train", "val")}
    writers = {split: _SequenceWriter(work_dir / f"{split}.npy", num_sequences[split], row_len) for split in num_tokens}
    start = 0
    for batch_lengths, flat in _token_batches(tokens):
        if single:
            writers["train"].write(np.concatenate([flat[:cut], flat[-1:]]))  # flat[-1] is the eos
            writers["val"].write(flat[cut:])
            continue
        doc_is_val = is_val[start : start + len(batch_lengths)]
        start += len(batch_lengths)
        token_is_val = np.repeat(doc_is_val, batch_lengths)
        writers["train"].write(flat[~token_is_val])
        writers["val"].write(flat[token_is_val])
    for writer in writers.values():
        writer.close()
    return {
        "num_train_documents": num_docs["train"],
        "num_val_documents": num_docs["val"],
        "num_train_tokens": num_tokens["train"],
        "num_val_tokens": num_tokens["val"],
        "num_train_sequences": num_sequences["train"],
        "num_val_sequences": num_sequences["val"],
    }
