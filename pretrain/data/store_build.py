"""Building a token store: the corpus cut into shards by input file (or row range), each shard tokenized by
one of N worker processes, finished shards kept across a kill, and the manifest written last.

A shard's content depends on its inputs and the tokenizer only, never on which worker wrote it or how
many there were, so the store is byte-identical for any N. A shard is complete when its record
(``shards/NNNNN.json``) exists with the inputs of the plan and its files have the recorded sizes; a
rerun keeps those and redoes the rest (files of an interrupted shard are only ever ``.tmp-`` names).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import multiprocessing
import os
import queue
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.data.documents import Log, _hf_documents, _hf_shards
from pretrain.data.readers import located_documents
from pretrain.data.sources import _Corpus
from pretrain.data.split import _doc_hash, _val_threshold
from pretrain.data.store import (
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    SplitWriter,
    _read_json,
    _write_json,
    content_digest,
    read_split_documents,
    read_split_origins,
    records_bytes,
    shard_name,
    split_files_intact,
    write_index,
)
from pretrain.data.tokenizer import _load_saved_tokenizer
from pretrain.distributed.supervise import die_with_parent
from pretrain.errors import DataError
from pretrain.recipe.config import DataConfig

ENCODE_BATCH_DOCS = 256
PROGRESS_EVERY_DOCS = 2048


@dataclass(frozen=True)
class ShardPlan:
    """The inputs of one shard: (path, format, size, mtime_ns) of local files, or one of the shards of an
    hf: stream as (data file, index, number of shards)."""

    index: int
    files: tuple[tuple[str, str, int, int], ...] = ()
    hf_shard: tuple[str, int, int] | None = None

    @property
    def inputs(self) -> list:
        return [list(f) for f in self.files] if self.hf_shard is None else [["hf", *self.hf_shard]]

    @property
    def num_input_bytes(self) -> int:
        return sum(f[2] for f in self.files)


def plan_shards(corpus: _Corpus, data_cfg: DataConfig) -> list[ShardPlan]:
    """Consecutive input files grouped until a shard holds data.store_shard_bytes (a larger file is a shard
    of its own); an hf: dataset streamed, a shard per shard of its stream (a data file: a contiguous range
    of its rows). Depends on the corpus only."""
    if corpus.kind == "hf":
        return [ShardPlan(i, hf_shard=shard) for i, shard in enumerate(_hf_shards(data_cfg))]
    shards, group, size = [], [], 0
    for path, fmt in corpus.files:
        st = os.stat(path)
        group.append((path, fmt, st.st_size, st.st_mtime_ns))
        size += st.st_size
        if size >= data_cfg.store_shard_bytes:
            shards.append(ShardPlan(len(shards), tuple(group)))
            group, size = [], 0
    if group or not shards:
        shards.append(ShardPlan(len(shards), tuple(group)))
    return shards


@dataclass(frozen=True)
class BuildSpec:
    """What every worker needs: picklable, and the same for every shard."""

    store_dir: str
    data_cfg: DataConfig
    dtype: str
    tokenizer_name: str
    vocab_size: int
    eos_token_id: int


Report = Callable[[int, int, int], Any]  # (documents, tokens, input bytes) done since the last report


def _shard_complete(shards_dir: Path, shard: ShardPlan) -> dict[str, Any] | None:
    path = shards_dir / f"{shard_name(shard.index)}.json"
    try:
        record = _read_json(path)
    except (OSError, ValueError):
        return None
    if record.get("inputs") != shard.inputs:
        return None
    if not all(split_files_intact(shards_dir, record[split]) for split in SPLITS):
        return None
    return record


def _shard_tokenizer(path: Path):
    """The store's tokenizer (backend, eos id), loaded once per process for all the shards it tokenizes:
    a load costs ~0.3 s, and the BPE's word cache stays warm across shards (a fresh one per shard made a
    worker ~1.5x slower than the tokenizer itself on 3 MB shards)."""
    stat = (path / "tokenizer.json").stat()
    return _load_backend(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _load_backend(path: str, mtime_ns: int, size: int):
    tokenizer = _load_saved_tokenizer(Path(path))
    return tokenizer.backend_tokenizer, tokenizer.eos_token_id


def tokenize_shard(spec: BuildSpec, shard: ShardPlan, report: Report) -> dict[str, Any]:
    """Tokenize one shard's documents (eos after each) into its train and val files; its record."""
    data_cfg = spec.data_cfg
    shards_dir = Path(spec.store_dir) / "shards"
    backend, eos = _shard_tokenizer(Path(spec.store_dir) / "tokenizer")
    threshold = _val_threshold(data_cfg.val_fraction)
    name = shard_name(shard.index)
    dtype = np.dtype(spec.dtype)
    writers = {split: SplitWriter(shards_dir, f"{name}.{split}", dtype, spec.tokenizer_name) for split in SPLITS}
    # For the split's tie rules (no val or no train document in the whole corpus): this shard's first
    # train document of the smallest hash and first val document of the largest, by position in the split.
    extreme: dict[str, list] = {"train": [None, -1], "val": [None, -1]}
    num_decode_errors = 0
    pending_docs = pending_tokens = 0
    input_rows: list[int] = []  # hf: the rows of the shard's stream, empty ones included
    documents = (_hf_documents(data_cfg, *shard.hf_shard[1:], rows=input_rows) if shard.hf_shard is not None
                 else located_documents([f[:2] for f in shard.files], data_cfg.text_field, data_cfg.on_decode_error))

    def flush(texts: list[str], origins: list[tuple[int, str, int]]):
        nonlocal pending_docs, pending_tokens
        encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
        hashes = [_doc_hash(text) for text in texts]
        for split in SPLITS:
            ids, lengths, where = [], [], []
            for h, encoding, origin in zip(hashes, encodings, origins, strict=True):
                if (h < threshold) != (split == "val"):
                    continue
                best, position = extreme[split]
                if best is None or (h < best if split == "train" else h > best):
                    extreme[split] = [h, len(writers[split].doc_ends) + len(lengths)]
                doc = encoding.ids  # a new list at each access: read once
                doc.append(eos)
                ids.append(doc)
                lengths.append(len(doc))
                where.append(origin)
            if lengths:
                writers[split].write(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64,
                                                 count=sum(lengths)), np.asarray(lengths, dtype=np.int64), where)
                pending_tokens += int(sum(lengths))
        pending_docs += len(texts)
        if pending_docs >= PROGRESS_EVERY_DOCS:
            report(pending_docs, pending_tokens, 0)
            pending_docs = pending_tokens = 0

    try:
        batch: list[str] = []
        origins: list[tuple[int, str, int]] = []
        for source, unit, locator, text, bad in documents:
            num_decode_errors += bad
            if not text:
                continue
            batch.append(text)
            origins.append((source, unit, locator))
            if len(batch) == ENCODE_BATCH_DOCS:
                flush(batch, origins)
                batch, origins = [], []
        if batch:
            flush(batch, origins)
        splits = {split: writers[split].commit() for split in SPLITS}
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    record = {
        "name": name,
        "inputs": shard.inputs,
        "num_decode_errors": num_decode_errors,
        "min_train_hash": extreme["train"],  # [hash, position of the document in the shard's train file]
        "max_val_hash": extreme["val"],
        **({"input_rows": input_rows[0]} if input_rows else {}),
        **splits,
    }
    _write_json(shards_dir / f"{name}.json", record)
    report(pending_docs, pending_tokens, shard.num_input_bytes)
    return record


# ---- the parallel build -----------------------------------------------------------------------------

_worker_queue: Any = None


class BuildInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a build; the message says what was kept and how to continue."""


def _init_worker(progress_queue) -> None:
    global _worker_queue
    _worker_queue = progress_queue
    # Ctrl-C reaches the whole foreground process group: the parent alone handles it (it terminates the pool and
    # says what was kept); a worker would print a KeyboardInterrupt traceback each. A worker of a parent that was
    # killed outright dies with it instead of writing on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # forked with pretrain-prepare-data's handler; Pool.terminate's
    die_with_parent()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # forked workers: one thread each, no fork warning


def _worker(args: tuple[BuildSpec, ShardPlan]) -> dict[str, Any]:
    spec, shard = args
    return tokenize_shard(spec, shard, lambda *counts: _worker_queue.put(counts))


class Progress:
    """A progress bar over input bytes with documents and tokens/s (tqdm, on stderr)."""

    def __init__(self, total_bytes: int, enabled: bool):
        from tqdm import tqdm

        # A log file (SLURM, nohup) gets a line every 30 s instead of a redraw every 0.5 s.
        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenize", disable=not enabled,
                        dynamic_ncols=True, smoothing=0.1, mininterval=0.5 if sys.stderr.isatty() else 30)
        self.docs = self.tokens = 0
        self.start = time.perf_counter()

    def __call__(self, docs: int, tokens: int, num_bytes: int) -> None:
        self.docs += docs
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.docs:,} docs, {rate / 1e3:,.1f}k tokens/s", refresh=False)
        self.bar.update(num_bytes)

    def close(self) -> None:
        self.bar.close()


def complete_shards(spec: BuildSpec, shards: list[ShardPlan]) -> dict[int, dict[str, Any]]:
    """The records of the shards that are complete, by shard index."""
    shards_dir = Path(spec.store_dir) / "shards"
    records = {}
    for shard in shards:
        record = _shard_complete(shards_dir, shard)
        if record is not None:
            records[shard.index] = record
    return records


def build_shards(spec: BuildSpec, shards: list[ShardPlan], num_workers: int, log: Log,
                 progress: bool = True) -> list[dict[str, Any]]:
    """Every shard's record: finished ones kept, the others tokenized by num_workers processes."""
    shards_dir = Path(spec.store_dir) / "shards"
    shards_dir.mkdir(parents=True, exist_ok=True)
    records = complete_shards(spec, shards)
    todo = [s for s in shards if s.index not in records]
    remove_stale_files(shards_dir, {s.index for s in todo})
    if records:
        log(f"data: resuming: {len(records)} of {len(shards)} shards are complete, {len(todo)} to tokenize")
    bar = Progress(sum(s.num_input_bytes for s in todo), progress)
    try:
        if num_workers <= 1 or len(todo) <= 1:
            for shard in todo:
                records[shard.index] = tokenize_shard(spec, shard, bar)
        else:
            _run_pool(spec, todo, num_workers, bar, records)
    except KeyboardInterrupt:
        raise BuildInterrupted(
            f"{len(records)} of {len(shards)} shards of the token store at {spec.store_dir} are complete and kept; "
            "the same command tokenizes only the rest") from None
    finally:
        bar.close()
    return [records[s.index] for s in shards]


def remove_stale_files(shards_dir: Path, redo: set[int]) -> int:
    """An interrupted build's partial files (``.tmp-NNNNN.*``) of the shards in ``redo``, removed; another task's
    shards are not touched. One listing of the directory, whatever the number of shards (a glob per shard was
    quadratic: 8,000 s at 30,000 shards). The number removed."""
    removed = 0
    with os.scandir(shards_dir) as entries:
        stale = [entry.name for entry in entries if entry.name.startswith(".tmp-")]
    for name in stale:
        number = name[len(".tmp-"):].split(".", 1)[0]
        if number.isdigit() and int(number) in redo:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shards_dir / name)
                removed += 1
    return removed


def _run_pool(spec: BuildSpec, todo: list[ShardPlan], num_workers: int, bar: Progress, records: dict) -> None:
    # forkserver, not fork: a fork of this process, which has threads (a progress bar's monitor, torch's), can leave
    # the child holding a lock no thread will release; a worker stuck so hung the pool's exit (as --verify's did)
    ctx = multiprocessing.get_context("forkserver")
    progress_queue = ctx.Queue()
    with ctx.Pool(min(num_workers, len(todo)), initializer=_init_worker, initargs=(progress_queue,)) as pool:
        results = pool.imap_unordered(_worker, [(spec, shard) for shard in todo])
        done = 0
        while done < len(todo):
            with contextlib.suppress(multiprocessing.TimeoutError):
                record = results.next(timeout=0.2)
                records[int(record["name"])] = record
                done += 1
            while True:
                try:
                    bar(*progress_queue.get_nowait())
                except queue.Empty:
                    break


# ---- the split's tie rules and the manifest ---------------------------------------------------------


def _rewrite_split(spec: BuildSpec, record: dict[str, Any], split: str, tokens: np.ndarray,
                   lengths: list[int], origins: list) -> dict[str, Any]:
    writer = SplitWriter(Path(spec.store_dir) / "shards", f"{record['name']}.{split}", np.dtype(spec.dtype),
                         spec.tokenizer_name)
    writer.write(tokens, np.asarray(lengths, dtype=np.int64), origins)
    return writer.commit()


def _documents(tokens: np.ndarray, ends: np.ndarray) -> list[np.ndarray]:
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return [tokens[s:e] for s, e in zip(starts, ends.astype(np.int64), strict=True)]


def apply_split_rules(spec: BuildSpec, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The split's rules for tiny corpora (see the pretrain.data docstring), applied by rewriting the one
    shard concerned: a single document is split inside its token stream; with no val document the train
    document of the smallest hash moves to val; with no train document the val one of the largest to train."""
    num_docs = {split: sum(r[split]["num_documents"] for r in records) for split in SPLITS}
    total = num_docs["train"] + num_docs["val"]
    if total == 0:
        raise DataError(
            f"data.source = {spec.data_cfg.source!r} has no text: every document is empty"
            + (" or was skipped for non-UTF-8 bytes (data.on_decode_error=skip)"
               if any(r["num_decode_errors"] for r in records) else "")
            + "; point data.source at files with text"
        )
    shards_dir = Path(spec.store_dir) / "shards"
    dtype = np.dtype(spec.dtype)
    if total == 1:
        (index, record, split), = [(i, r, s) for i, r in enumerate(records) for s in SPLITS
                                   if r[s]["num_documents"]]
        tokens, _ = read_split_documents(shards_dir, record[split], dtype)
        origin = read_split_origins(shards_dir, record[split])  # both parts come from the one document
        # The one document's stream (text tokens + eos) is cut before its last val_fraction of text tokens.
        num_text = len(tokens) - 1
        num_val_text = max(1, round(num_text * spec.data_cfg.val_fraction)) if num_text >= 2 else 0
        cut = num_text - num_val_text
        train = np.concatenate([tokens[:cut], tokens[-1:]])
        new = dict(record)
        new["train"] = _rewrite_split(spec, record, "train", train, [len(train)], origin)
        new["val"] = _rewrite_split(spec, record, "val", tokens[cut:], [len(tokens) - cut] if num_val_text else [],
                                    origin if num_val_text else [])
        _write_json(shards_dir / f"{record['name']}.json", new)
        return [new if i == index else r for i, r in enumerate(records)]
    for empty, donor, key, better in (("val", "train", "min_train_hash", lambda a, b: a < b),
                                      ("train", "val", "max_val_hash", lambda a, b: a > b)):
        if num_docs[empty]:
            continue
        index = None
        for i, r in enumerate(records):
            h = r[key][0]
            if h is not None and (index is None or better(h, records[index][key][0])):
                index = i
        record = records[index]
        position = record[key][1]
        tokens, ends = read_split_documents(shards_dir, record[donor], dtype)
        docs, origins = _documents(tokens, ends), read_split_origins(shards_dir, record[donor])
        moved, moved_origin = docs.pop(position), origins.pop(position)
        new = dict(record)
        new[empty] = _rewrite_split(spec, record, empty, moved, [len(moved)], [moved_origin])
        new[donor] = _rewrite_split(spec, record, donor, np.concatenate(docs) if docs else tokens[:0],
                                    [len(d) for d in docs], origins)
        new[key] = [None, -1]
        _write_json(shards_dir / f"{record['name']}.json", new)
        records = [new if i == index else r for i, r in enumerate(records)]
        num_docs = {split: sum(r[split]["num_documents"] for r in records) for split in SPLITS}
    return records


def write_manifest(store_dir: Path, build: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The store's index files, then its manifest (last: it marks the store complete). The manifest is small whatever
    the number of shards (totals, the content digest, the index files' checksums); the shards' records stay in
    shards/NNNNN.json, read by the build, --verify and tools, never when a run opens the store."""
    counts = {f"num_{split}_{what}": sum(r[split][f"num_{what}"] for r in records)
              for split in SPLITS for what in ("documents", "tokens")}
    manifest = {
        **build,
        "version": FORMAT_VERSION,
        "num_documents": counts["num_train_documents"] + counts["num_val_documents"],
        **counts,
        "num_decode_errors": sum(r.get("num_decode_errors", 0) for r in records),
        "num_shards": len(records),
        "num_bytes": records_bytes(records),
        "content": content_digest(records),
        "index": write_index(store_dir, records),
    }
    _write_json(store_dir / MANIFEST, manifest)
    return manifest
