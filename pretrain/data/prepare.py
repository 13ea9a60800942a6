"""Where a recipe's token store is, building it (``prepare_store``), opening it (``open_store``), and making
sure it exists before a run's process group does (``ensure_store``)."""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.config import DataConfig
from pretrain.data.build import BuildSpec, apply_split_rules, build_shards, plan_shards, write_manifest
from pretrain.data.cache import _hash, cache_root
from pretrain.data.documents import Log, _default_num_proc
from pretrain.data.sources import _Corpus, _resolve_corpus
from pretrain.data.store import (
    BUILD,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PackedData,
    _count_words,
    _read_json,
    _write_json,
    split_rows,
    token_dtype,
)
from pretrain.data.tokenizer import _bpe_key, _get_tokenizer, _load_saved_tokenizer
from pretrain.errors import DataError

WAIT_LOG_EVERY_S = 60.0


class StoreMissing(DataError):
    """The recipe's token store has not been prepared (or not finished)."""


@dataclass
class StoreTarget:
    """The store a recipe's data section asks for: where it is and what it must hold."""

    path: Path
    build: dict[str, Any]  # build.json: what the store is for
    corpus: _Corpus
    tokenizer: Any  # loaded, or None for a bpe tokenizer not trained yet


def locate_store(data_cfg: DataConfig, log: Log = print) -> StoreTarget:
    """The recipe's store and its identity, from a stat of the corpus and the tokenizer's identity (a
    pretrained tokenizer is loaded; a BPE's identity is known without training it)."""
    corpus = _resolve_corpus(data_cfg)
    if data_cfg.tokenizer == "bpe":
        tokenizer, identity, name = None, _bpe_key(data_cfg, corpus), f"bpe-{data_cfg.tokenizer_vocab_size}"
    else:
        tokenizer, identity, name = _get_tokenizer(data_cfg, corpus, log)
    key = _hash({"version": FORMAT_VERSION, "documents": corpus.key, "tokenizer": identity,
                 "val_fraction": data_cfg.val_fraction})
    path = Path(data_cfg.store).expanduser().absolute() if data_cfg.store else cache_root(data_cfg) / "stores" / key
    build = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "key": key,
        "source": data_cfg.source,
        "corpus": corpus.description,
        "corpus_fingerprint": corpus.key,
        "text_field": data_cfg.text_field,
        "on_decode_error": data_cfg.on_decode_error,
        "val_fraction": data_cfg.val_fraction,
        "tokenizer": {"name": name, "identity": identity},
    }
    return StoreTarget(path, build, corpus, tokenizer)


def _check_identity(target: StoreTarget, found: dict[str, Any], what: str) -> None:
    """One clear error when the store at target.path was made for other data or another tokenizer."""
    want = target.build
    where = f"the token store at {target.path}"
    fix = "point data.store at another directory (or delete this one) and run pretrain-prepare-data"
    if found.get("format") != FORMAT or found.get("version") != FORMAT_VERSION:
        raise DataError(f"{where} holds {found.get('format')} version {found.get('version')}, not {FORMAT} "
                        f"version {FORMAT_VERSION}; {fix}")
    if found["tokenizer"]["identity"] != want["tokenizer"]["identity"]:
        raise DataError(
            f"{where}: the {what} was made with tokenizer {found['tokenizer']['name']!r} (identity "
            f"{found['tokenizer']['identity']}), but this recipe's data.tokenizer is {want['tokenizer']['name']!r} "
            f"(identity {want['tokenizer']['identity']}); token ids of one tokenizer mean nothing to another. "
            f"Set data.tokenizer to the store's tokenizer, or {fix}"
        )
    differ = [k for k in ("source", "corpus_fingerprint", "text_field", "on_decode_error", "val_fraction")
              if found.get(k) != want[k]]
    if differ:
        pairs = ", ".join(f"{k} {found.get(k)!r} (recipe: {want[k]!r})" for k in differ)
        raise DataError(f"{where}: the {what} was made from other data: {pairs}; {fix}")


def _manifest(target: StoreTarget) -> dict[str, Any] | None:
    try:
        manifest = _read_json(target.path / MANIFEST)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise DataError(f"{target.path / MANIFEST}: unreadable ({exc}); delete the store and prepare it again") from None
    _check_identity(target, manifest, "store")
    return manifest


@contextlib.contextmanager
def _store_lock(path: Path):
    """An exclusive lock beside the store (flock: released if the holder dies), so that two builders of one
    store never run at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare_store(data_cfg: DataConfig, num_workers: int | None = None, log: Log = print,
                  progress: bool = False) -> StoreTarget:
    """Build the recipe's store unless it is complete; resume an interrupted build."""
    target = locate_store(data_cfg, log)
    with _store_lock(target.path):
        if _manifest(target) is not None:
            return target
        start = time.perf_counter()
        target.path.mkdir(parents=True, exist_ok=True)
        if (target.path / BUILD).is_file():
            _check_identity(target, _read_json(target.path / BUILD), "partly built store")
        else:
            _write_json(target.path / BUILD, target.build)
        tokenizer = target.tokenizer
        if tokenizer is None:
            tokenizer, _, _ = _get_tokenizer(data_cfg, target.corpus, log)
        tokenizer_dir = target.path / "tokenizer"
        if not tokenizer_dir.is_dir():
            tmp = target.path / ".tmp-tokenizer"
            shutil.rmtree(tmp, ignore_errors=True)
            tokenizer.save_pretrained(str(tmp))
            tmp.rename(tokenizer_dir)
        dtype = token_dtype(len(tokenizer))
        spec = BuildSpec(str(target.path), data_cfg, dtype.str, target.build["tokenizer"]["name"])
        shards = plan_shards(target.corpus, data_cfg)
        workers = num_workers or data_cfg.num_proc or _default_num_proc()
        log(f"data: tokenizing {target.corpus.description} into {len(shards)} shard(s) with {workers} "
            f"worker(s) -> {target.path}")
        records = apply_split_rules(spec, build_shards(spec, shards, workers, log, progress))
        build = {**target.build, "dtype": dtype.name, "byte_order": "little",
                 "tokenizer": {**target.build["tokenizer"], "vocab_size": len(tokenizer),
                               "eos_token_id": tokenizer.eos_token_id},
                 "split": "val when sha1(text)[:8] as a fraction of 2**64 < val_fraction (pretrain/data/split.py)"}
        m = write_manifest(target.path, build, records)
        log(f"data: {m['num_documents']:,} documents ({m['num_train_documents']:,} train / "
            f"{m['num_val_documents']:,} val), {_count_words(m['num_train_tokens'])} train / "
            f"{_count_words(m['num_val_tokens'])} val tokens ({dtype.name}) in {len(records)} shard(s), "
            f"built in {time.perf_counter() - start:.1f}s at {target.path}")
    return target


def _too_few_tokens(split: str, manifest: dict[str, Any], data_cfg: DataConfig) -> DataError:
    hint = ", a larger data.val_fraction" if split == "val" else ""
    return DataError(
        f"data: the {split} split has {manifest[f'num_{split}_tokens']:,} tokens "
        f"({manifest[f'num_{split}_documents']:,} documents of data.source = {data_cfg.source!r}), fewer than one "
        f"sequence of data.seq_len + 1 = {data_cfg.seq_len + 1} tokens; use a smaller data.seq_len{hint} or more data"
    )


def open_store(data_cfg: DataConfig, log: Log = print, target: StoreTarget | None = None,
               prepare_command: str = "pretrain-prepare-data --recipe RECIPE") -> PackedData:
    """The store's rows of seq_len + 1 tokens (memory-mapped) and its tokenizer; StoreMissing if it has not
    been prepared, DataError if it was made for other data or another tokenizer."""
    start = time.perf_counter()
    target = target or locate_store(data_cfg, log)
    manifest = _manifest(target)
    if manifest is None:
        raise StoreMissing(f"data: no token store at {target.path} for data.source = {data_cfg.source!r} "
                           f"(tokenizer {target.build['tokenizer']['name']}); prepare it first: {prepare_command}")
    row_len = data_cfg.seq_len + 1
    train = split_rows(target.path, manifest, "train", row_len, data_cfg.train_subset)
    val = split_rows(target.path, manifest, "val", row_len, data_cfg.val_subset)
    for split, rows in (("train", train), ("val", val)):
        if rows.num_tokens < row_len:
            raise _too_few_tokens(split, manifest, data_cfg)
    tokenizer = target.tokenizer or _load_saved_tokenizer(target.path / "tokenizer")
    stats = {k: v for k, v in manifest.items() if k != "shards" and not isinstance(v, dict)}
    stats.update(
        tokenizer=manifest["tokenizer"]["name"],
        vocab_size=manifest["tokenizer"]["vocab_size"],
        eos_token_id=manifest["tokenizer"]["eos_token_id"],
        num_shards=len(manifest["shards"]),
        seq_len=data_cfg.seq_len,
        num_train_sequences=len(train),
        num_val_sequences=len(val),
        train_subset=data_cfg.train_subset,
        val_subset=data_cfg.val_subset,
        cache_dir=str(target.path),
    )
    log(f"data: {len(train):,} train / {len(val):,} val sequences of {row_len} tokens from the store at "
        f"{target.path} ({len(manifest['shards'])} shard(s), {time.perf_counter() - start:.2f}s)")
    return PackedData(train=train, val=val, tokenizer=tokenizer, stats=stats)


def prepare_data(data_cfg: DataConfig, log: Log = print, num_workers: int | None = None,
                 progress: bool = False) -> PackedData:
    """The store for data_cfg, built first if needed, opened (see the pretrain.data docstring)."""
    return open_store(data_cfg, log, prepare_store(data_cfg, num_workers, log, progress))


def ensure_store(data_cfg: DataConfig, launch, prepare_command: str, log: Log = print,
                 poll_s: float = 1.0) -> None:
    """Make sure the store exists before any process group does, so that no rank waits for it in a
    collective. A missing store is prepared by local rank 0 of a single-node launch while the node's other
    processes poll for its manifest; a multi-node launch stops at once with the command that prepares it."""
    target = locate_store(data_cfg, log=lambda _: None)
    if _manifest(target) is not None:
        return
    if launch.num_nodes > 1:
        raise StoreMissing(
            f"data: no token store at {target.path} for data.source = {data_cfg.source!r}; a {launch.num_nodes}-node "
            f"launch does not tokenize (every node would wait on one). Prepare it once, on a machine that sees the "
            f"data and this path, then launch again:\n    {prepare_command}"
        )
    if launch.local_rank == 0:
        prepare_store(data_cfg, log=log, progress=launch.world_size == 1)
        return
    # The launcher (torchrun) ends these processes if local rank 0 fails, so polling needs no timeout.
    waited, last_log = time.perf_counter(), time.perf_counter()
    while _manifest(target) is None:
        if time.perf_counter() - last_log >= WAIT_LOG_EVERY_S:
            log(f"data: rank {launch.rank} waiting {time.perf_counter() - waited:.0f}s for local rank 0 to "
                f"prepare {target.path}")
            last_log = time.perf_counter()
        time.sleep(poll_s)
