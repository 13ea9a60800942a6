"""The corpus's documents: all of them as a ``datasets.Dataset`` (one column ``text``) with their train / val
split, the documents of one input file or row range (a store shard), and a bounded sample of the
training documents (what a BPE tokenizer is trained on)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from pretrain.data.cache import cache_root
from pretrain.data.readers import _generate_documents, located_documents
from pretrain.data.sources import _Corpus, _resolve_corpus
from pretrain.data.split import _doc_hash, _val_mask, _val_threshold
from pretrain.errors import DataError
from pretrain.recipe.config import DataConfig
from pretrain.system.environment import require

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


def _import_datasets(data_cfg: DataConfig):
    """datasets, or the ConfigError that names it: only an hf: source (and load_documents) needs it."""
    require("datasets", f"data.source = {data_cfg.source!r}" if data_cfg.source.startswith("hf:")
            else "load_documents (a datasets.Dataset of the documents)")
    import datasets

    return datasets


def _load_files(data_cfg: DataConfig, corpus: _Corpus):
    datasets = _import_datasets(data_cfg)

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
    datasets = _import_datasets(data_cfg)

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
    for _, _, _, text, bad in located_documents(list(files), data_cfg.text_field, data_cfg.on_decode_error):
        yield text, bad


def _hf_stream(data_cfg: DataConfig):
    """(an ``hf:`` source as a streaming ``datasets.IterableDataset``, its data files), checked.

    Nothing is downloaded: ``load_dataset(..., streaming=True)`` is ``load_dataset_builder`` then
    ``as_streaming_dataset``; the builder is kept for the list of data files it resolved (on the hub, at the
    dataset's revision). The name is what ``load_dataset`` takes: a hub dataset or a local directory."""
    datasets = _import_datasets(data_cfg)

    try:
        ds, files = _open_hf_stream(data_cfg.source[3:], data_cfg.hf_config, data_cfg.hf_split)
    except Exception as exc:
        raise DataError(
            f"data.source = {data_cfg.source!r}: the dataset could not be opened for streaming ({type(exc).__name__}: "
            f"{exc}). Check the name, data.hf_config and data.hf_split and the network connection, or download the "
            "data and point data.source at the local files"
        ) from None
    if not isinstance(ds, datasets.IterableDataset):
        raise DataError(f"data.source = {data_cfg.source!r}: expected one split, got {type(ds).__name__}; set "
                        "data.hf_split")
    field = data_cfg.text_field
    if ds.features is not None:  # known from the files' schema (parquet); else checked on the first row
        if field not in ds.features:
            raise DataError(
                f"data.source = {data_cfg.source!r} has no column {field!r} (data.text_field); its columns are: "
                f"{', '.join(ds.features)}. Set data.text_field to the column that holds the text"
            )
        if getattr(ds.features[field], "dtype", None) not in ("string", "large_string"):
            raise DataError(
                f"data.source = {data_cfg.source!r}: column {field!r} (data.text_field) holds {ds.features[field]}, "
                "not text; set data.text_field to the column that holds the text"
            )
    return ds, files


@functools.lru_cache(maxsize=4)
def _open_hf_stream(name: str, config: str | None, split: str):
    """Resolved once per process (a worker tokenizes many shards of one stream; on the hub, resolving the
    data files costs requests)."""
    import datasets

    with _quiet_datasets():
        builder = datasets.load_dataset_builder(name, config)
        ds = builder.as_streaming_dataset(split=split)
    data_files = (builder.config.data_files or {}).get(split) or []
    return ds, [str(f) for f in data_files]


def _hf_shards(data_cfg: DataConfig) -> list[tuple[str, int, int]]:
    """The stream's own shards (datasets': one per data file), as (data file or "", index, count): each
    is a contiguous range of the dataset's rows, read without reading the others."""
    ds, files = _hf_stream(data_cfg)
    num = ds.n_shards
    return [(files[i] if len(files) == num else "", i, num) for i in range(num)]


def _hf_documents(data_cfg: DataConfig, index: int, num_shards: int, rows: list[int] | None = None
                  ) -> Iterator[tuple[int, str, int, str, bool]]:
    """The non-empty documents of shard ``index`` of ``num_shards`` of an ``hf:`` stream, in order, located like a
    file's (``readers.located_documents``): (0, "row", the row within the shard, text, False). ``rows``: [0] is set
    to the number of rows the shard holds, empty ones included (the store adds the earlier shards' to name a row of
    the split)."""
    ds, _ = _hf_stream(data_cfg)
    if ds.n_shards != num_shards:
        raise DataError(f"data.source = {data_cfg.source!r} now has {ds.n_shards} data files, not {num_shards} as "
                        "when its shards were planned; the dataset changed: prepare the store again")
    for row, text in _stream_documents(ds.shard(num_shards=num_shards, index=index, contiguous=True), data_cfg,
                                       rows):
        yield 0, "row", row, text, False


def _stream_documents(ds, data_cfg: DataConfig, rows: list[int] | None = None) -> Iterator[tuple[int, str]]:
    """(row, text) of every non-empty row, the row counted over all of them (``rows[0]``: how many there were)."""
    field = data_cfg.text_field
    if ds.features is not None:
        ds = ds.select_columns([field])
    count = 0
    for number, row in enumerate(ds):
        count = number + 1
        if field not in row:
            raise DataError(f"data.source = {data_cfg.source!r}: a row has no field {field!r} (data.text_field); "
                            f"its fields: {', '.join(row)}. Set data.text_field to the field that holds the text")
        text = row[field]
        if isinstance(text, str) and text.strip():
            yield number, text
        elif text is not None and not isinstance(text, str):
            raise DataError(f"data.source = {data_cfg.source!r}: field {field!r} holds {type(text).__name__}, not text")
    if rows is not None:
        rows[:] = [count]


def _hf_texts(data_cfg: DataConfig) -> Iterator[str]:
    """Every non-empty document of an ``hf:`` stream, in order."""
    for _, text in _stream_documents(_hf_stream(data_cfg)[0], data_cfg):
        yield text


def _sample_train_texts(data_cfg: DataConfig, corpus: _Corpus, budget_bytes: int) -> list[str]:
    """The training documents a BPE is trained on: all of them when the corpus is at most ``budget_bytes``
    (by file size), else the first budget / number-of-files bytes of documents of every file (the first
    ``budget_bytes`` of an ``hf:`` dataset). The split is the store's: by document hash."""
    texts: list[str] = []
    if corpus.kind == "hf":
        taken, whole = 0, True
        for text in _hf_texts(data_cfg):  # streamed: only the first budget_bytes are read
            texts.append(text)
            taken += len(text.encode())
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


VAL_SAMPLE_DOCUMENTS = 30
"""Documents an export's tokenizer round-trip check encodes (pretrain.model.export_checks)."""


def sample_val_texts(data_cfg: DataConfig, num_docs: int = VAL_SAMPLE_DOCUMENTS,
                     budget_bytes: int = 8 * 2**20) -> list[str]:
    """Up to ``num_docs`` validation documents (the store's split, by document hash), in corpus order, found
    within the first ``budget_bytes`` of documents read; topped up with training documents when that many
    are not found there (tiny corpora: any text tells whether two tokenizers agree). A mixture: its sources
    in turn. Bounded: an export never reads a whole corpus."""
    configs = [data_cfg.source_config(name) for name in data_cfg.mixture_weights()] or [data_cfg]
    threshold = np.uint64(_val_threshold(data_cfg.val_fraction))
    val: list[str] = []
    train: list[str] = []
    for source_cfg in configs:
        corpus = _resolve_corpus(source_cfg)
        texts = (_hf_texts(source_cfg) if corpus.kind == "hf"
                 else (text for text, _ in _file_documents(corpus.files, source_cfg) if text))
        taken = 0
        for text in texts:
            (val if np.uint64(_doc_hash(text)) < threshold else train).append(text)
            taken += len(text.encode())
            if len(val) >= num_docs or taken >= budget_bytes // len(configs):
                break
    return (val + train)[:num_docs]
