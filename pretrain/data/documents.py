"""The corpus as a ``datasets.Dataset`` of documents (one column ``text``), and its train / val split."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from pretrain.config import DataConfig
from pretrain.data.cache import cache_root
from pretrain.data.readers import _generate_documents
from pretrain.data.sources import _Corpus, _resolve_corpus
from pretrain.data.split import _split_hashes, _val_mask
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


class _Documents:
    """The documents and their split, loaded on first use (a cache hit never needs them)."""

    def __init__(self, data_cfg: DataConfig, corpus: _Corpus, log: Log):
        self.data_cfg, self.corpus, self.log = data_cfg, corpus, log
        self._loaded = None

    def get(self):
        """(docs, is_val, num_decode_errors)."""
        if self._loaded is None:
            docs, num_bad = _load_documents(self.data_cfg, self.corpus, self.log)
            is_val = _val_mask(_split_hashes(docs), self.data_cfg.val_fraction)
            self._loaded = (docs, is_val, num_bad)
        return self._loaded
