"""The corpus's documents: all of them as a ``datasets.Dataset`` (one column ``text``) with their train / val
split, the documents of one input file or row range (a store shard), and a bounded sample of the
training documents (what a BPE tokenizer is trained on)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from pretrain.config import DataConfig
from pretrain.data.cache import cache_root
from pretrain.data.readers import _generate_documents
from pretrain.data.sources import _Corpus, _resolve_corpus
from pretrain.data.split import _doc_hash, _val_mask, _val_threshold
from pretrain.errors import DataError

Log = Callable[[str], Any]


def _default_num_proc() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))  # respects taskset / slurm cpu binding, unlike cpu_count
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


def _find_data_error(exc: BaseException) -> DataError | None:
    """datasets wraps exceptions raised inside a generator; find ours to report it as it was raised."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, DataError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _load_files(data_cfg: DataConfig, corpus: _Corpus):
    import datasets

    features = datasets.Features({"text": datasets.Value("string"), "decode_error": datasets.Value("bool")})
    try:
        with _quiet_datasets():
            return datasets.Dataset.from_generator(
                _generate_documents,
                features=features,
                cache_dir=str(cache_root(data_cfg) / "datasets"),
                gen_kwargs={
                    "files": list(corpus.files),
                    "text_field": data_cfg.text_field,
                    "on_decode_error": data_cfg.on_decode_error,
                },
                fingerprint=corpus.key,
            )
    except Exception as exc:
        ours = _find_data_error(exc)
        if ours is not None:
            raise ours from None
        raise


def _load_hf(data_cfg: DataConfig, num_proc: int):
    import datasets

    name = data_cfg.source[3:]
    try:
        ds = datasets.load_dataset(name, data_cfg.hf_config, split=data_cfg.hf_split)
    except Exception as exc:
        raise DataError(
            f"data.source = {data_cfg.source!r}: the dataset could not be loaded ({type(exc).__name__}: {exc}). "
            "Check the name, data.hf_config and data.hf_split and the network connection, or download the "
            "data and point data.source at the local files"
        ) from None
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"data.source = {data_cfg.source!r}: expected one split, got {type(ds).__name__}")
    field = data_cfg.text_field
    if field not in ds.column_names:
        raise DataError(
            f"data.source = {data_cfg.source!r} has no column {field!r} (data.text_field); its columns are: "
            f"{', '.join(ds.column_names)}. Set data.text_field to the column that holds the text"
        )
    dtype = getattr(ds.features[field], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise DataError(
            f"data.source = {data_cfg.source!r}: column {field!r} (data.text_field) holds {ds.features[field]}, "
            "not text; set data.text_field to the column that holds the text"
        )
    ds = ds.select_columns([field])
    if field != "text":
        ds = ds.rename_column(field, "text")
    return ds.filter(
        _non_empty, batched=True, num_proc=num_proc if len(ds) >= 10_000 else None, desc="drop empty documents"
    )


def _non_empty(batch: dict[str, list]) -> list[bool]:
    return [isinstance(t, str) and bool(t.strip()) for t in batch["text"]]


@contextlib.contextmanager
def _quiet_datasets():
    """datasets logs a line per cache hit/miss at WARNING on some paths; our own log says what happened."""
    import datasets

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)


def _load_documents(data_cfg: DataConfig, corpus: _Corpus, log: Log):
    """(documents dataset with one column "text", number of documents with non-UTF-8 bytes)."""
    import pyarrow.compute as pc

    if corpus.kind == "hf":
        ds, num_bad = _load_hf(data_cfg, data_cfg.num_proc or _default_num_proc()), 0
    else:
        ds = _load_files(data_cfg, corpus)
        num_bad = int(pc.sum(ds.data.column("decode_error")).as_py() or 0)
        if num_bad:
            action = "skipped" if data_cfg.on_decode_error == "skip" else "replaced with U+FFFD"
            log(f"data: {num_bad} documents had non-UTF-8 bytes: {action}")
        keep = pc.greater(pc.utf8_length(ds.data.column("text")), 0).to_numpy(zero_copy_only=False)
        if not keep.all():
            ds = ds.select(np.flatnonzero(keep))
        ds = ds.remove_columns("decode_error")
    if len(ds) == 0:
        raise DataError(
            f"data.source = {data_cfg.source!r} has no text: every document is empty"
            + (" or was skipped for non-UTF-8 bytes (data.on_decode_error=skip)" if num_bad else "")
            + "; point data.source at files with text"
        )
    return ds, num_bad


def load_documents(data_cfg: DataConfig, log: Log = print):
    """The corpus as a ``datasets.Dataset`` with one column "text": one row per document, in a fixed order.

    ``stdlib``: one document per standard-library .py file. A local text file is one document, a jsonl
    line or parquet row is one document. Empty (whitespace-only) documents are dropped.
    """
    return _load_documents(data_cfg, _resolve_corpus(data_cfg), log)[0]


def _file_documents(files: Sequence[tuple[str, str]], data_cfg: DataConfig) -> Iterator[tuple[str, bool]]:
    """(text, had non-UTF-8 bytes) of each document of these files, in order; a document skipped for its
    bytes (data.on_decode_error=skip) comes as ("", True) so that it is counted, and empty ones not at all."""
    for row in _generate_documents(list(files), data_cfg.text_field, data_cfg.on_decode_error):
        if row["text"] or row["decode_error"]:
            yield row["text"], row["decode_error"]


def _hf_documents(data_cfg: DataConfig, start: int, stop: int) -> Iterator[tuple[str, bool]]:
    """Rows [start, stop) of an ``hf:`` dataset (already downloaded and filtered: a datasets cache hit)."""
    ds = _load_hf(data_cfg, 1).select(range(start, stop))
    for batch in ds.iter(batch_size=1000):
        for text in batch["text"]:
            yield text, False


def _sample_train_texts(data_cfg: DataConfig, corpus: _Corpus, budget_bytes: int) -> list[str]:
    """The training documents a BPE is trained on: all of them when the corpus is at most ``budget_bytes``
    (by file size), else the first budget / number-of-files bytes of documents of every file (the first
    ``budget_bytes`` of an ``hf:`` dataset). The split is the store's: by document hash."""
    texts: list[str] = []
    if corpus.kind == "hf":
        ds = _load_hf(data_cfg, data_cfg.num_proc or _default_num_proc())
        taken, whole = 0, True
        for batch in ds.iter(batch_size=1000):
            texts += batch["text"]
            taken += sum(len(t.encode()) for t in batch["text"])
            if taken >= budget_bytes:
                whole = False
                break
    else:
        whole = sum(os.path.getsize(path) for path, _ in corpus.files) <= budget_bytes
        per_file = budget_bytes if whole else max(1, budget_bytes // len(corpus.files))
        for file in corpus.files:
            taken = 0
            for text, _ in _file_documents([file], data_cfg):
                if not text:
                    continue
                texts.append(text)
                taken += len(text.encode())
                if not whole and taken >= per_file:
                    break
    hashes = np.fromiter((_doc_hash(t) for t in texts), dtype=np.uint64, count=len(texts))
    # Over the whole corpus the split's tie rules apply too (they matter only for tiny corpora).
    is_val = _val_mask(hashes, data_cfg.val_fraction) if whole else hashes < np.uint64(
        _val_threshold(data_cfg.val_fraction))
    return [t for t, v in zip(texts, is_val, strict=True) if not v]
