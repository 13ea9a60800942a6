"""Where a recipe's token store is, building it (``prepare_store``), opening it (``open_store``), and making
sure it exists before a run's process group does (``ensure_store``, ``ensure_stores``). One store: a
mixture's sources each have theirs (``pretrain/data/mixture.py``)."""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.data.cache import STORE_FIX, _hash, cache_root
from pretrain.data.documents import Log, _default_num_proc
from pretrain.data.provenance import provenance_header
from pretrain.data.sources import _Corpus, _resolve_corpus
from pretrain.data.store import (
    BUILD,
    FORMAT,
    FORMAT_VERSION,
    KEY_VERSION,
    MANIFEST,
    READABLE_VERSIONS,
    STREAM_FIELDS,
    PackedData,
    _count_words,
    _read_json,
    _write_json,
    check_files,
    is_indexed,
    num_shards,
    shard_records,
    split_rows,
    store_identity,
    token_dtype,
    verify_store,
)
from pretrain.data.store_build import (
    BuildSpec,
    apply_split_rules,
    build_shards,
    complete_shards,
    plan_shards,
    write_manifest,
)
from pretrain.data.tokenizer import _bpe_key, _get_tokenizer, _load_saved_tokenizer
from pretrain.errors import DataError, writable_dir
from pretrain.recipe.config import DataConfig

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


def locate_store(data_cfg: DataConfig, log: Log = print, tokenizer: tuple[Any, str, str] | None = None,
                 corpus: _Corpus | None = None) -> StoreTarget:
    """The recipe's store and its identity, from a stat of the corpus and the tokenizer's identity (a
    pretrained tokenizer is loaded; a BPE's identity is known without training it). A mixture's source
    passes the mixture's (tokenizer or None, identity, name) and its resolved corpus."""
    corpus = corpus or _resolve_corpus(data_cfg)
    if tokenizer is not None:
        tokenizer, identity, name = tokenizer
    elif data_cfg.tokenizer == "bpe":
        tokenizer, identity, name = None, _bpe_key(data_cfg, corpus), _tokenizer_name(data_cfg)
    else:
        tokenizer, identity, name = _get_tokenizer(data_cfg, corpus, log)
    key = _hash({"version": KEY_VERSION, "documents": corpus.key, "tokenizer": identity,
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


IDENTITY = ("format", "version", "key", "source", "corpus", "corpus_fingerprint", "text_field", "on_decode_error",
            "val_fraction", "tokenizer")  # build.json: what a store is for


def _tokenizer_name(data_cfg: DataConfig) -> str:
    return f"bpe-{data_cfg.tokenizer_vocab_size}" if data_cfg.tokenizer == "bpe" else data_cfg.tokenizer


def _check_identity(target: StoreTarget, found: dict[str, Any], what: str, fingerprints: bool = True) -> None:
    """One clear error when the store at target.path was made for other data or another tokenizer. Without
    fingerprints, only what the recipe itself says is compared (the tokenizer by name, not content; the
    source by name, not its files' sizes and times)."""
    want = target.build
    where = f"the token store at {target.path}"
    fix = "point data.store at another directory (or delete this one) and run pretrain-prepare-data"
    if found.get("format") != FORMAT or found.get("version") not in READABLE_VERSIONS:
        raise DataError(f"{where} holds {found.get('format')} version {found.get('version')}, not {FORMAT} "
                        f"version {' or '.join(map(str, READABLE_VERSIONS))}; {fix}")
    compared = "identity" if fingerprints else "name"
    if found["tokenizer"][compared] != want["tokenizer"][compared]:
        raise DataError(
            f"{where}: the {what} was made with tokenizer {found['tokenizer']['name']!r} (identity "
            f"{found['tokenizer']['identity']}), but this recipe's data.tokenizer is {want['tokenizer']['name']!r} "
            f"(identity {want['tokenizer'].get('identity', 'not computed')}); token ids of one tokenizer mean "
            f"nothing to another. Set data.tokenizer to the store's tokenizer, or {fix}"
        )
    differ = [k for k in ("source", "corpus_fingerprint", "text_field", "on_decode_error", "val_fraction")
              if (fingerprints or k != "corpus_fingerprint") and found.get(k) != want[k]]
    if differ:
        pairs = ", ".join(f"{k} {found.get(k)!r} (recipe: {want[k]!r})" for k in differ)
        raise DataError(f"{where}: the {what} was made from other data: {pairs}; {fix}")


def _manifest(target: StoreTarget, fingerprints: bool = True) -> dict[str, Any] | None:
    _refuse_foreign_directory(target.path)  # not its manifest.json either
    try:
        manifest = _read_json(target.path / MANIFEST)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise DataError(f"{target.path / MANIFEST}: unreadable ({exc}); delete the store and prepare it again") from None
    _check_identity(target, manifest, "store", fingerprints)
    return manifest


def _named_store(data_cfg: DataConfig) -> StoreTarget | None:
    """The complete store data.store names, opened from its manifest alone: what a rank does. The recipe's
    source, tokenizer name, text field, decode policy and val_fraction are checked against it; the input
    files are not stat-ed nor the tokenizer loaded (pretrain-prepare-data, pretrain-launch and
    pretrain-slurm compare those fingerprints once, in one process). None if no store is named or it has
    no manifest yet."""
    if not data_cfg.store:
        return None
    path = Path(data_cfg.store).expanduser().absolute()
    stated = {"format": FORMAT, "version": FORMAT_VERSION, "source": data_cfg.source,
              "text_field": data_cfg.text_field, "on_decode_error": data_cfg.on_decode_error,
              "val_fraction": data_cfg.val_fraction, "tokenizer": {"name": _tokenizer_name(data_cfg)}}
    target = StoreTarget(path, stated, corpus=None, tokenizer=None)
    manifest = _manifest(target, fingerprints=False)
    if manifest is None:
        return None
    return StoreTarget(path, {k: manifest[k] for k in IDENTITY}, corpus=None, tokenizer=None)


def find_store(data_cfg: DataConfig, log: Log = print) -> StoreTarget:
    """The store a run opens: a named, complete one from its manifest alone, else located (locate_store)."""
    return _named_store(data_cfg) or locate_store(data_cfg, log)


@contextlib.contextmanager
def _store_lock(path: Path):
    """An exclusive lock beside the store (flock: released if the holder dies), so that two builders of one
    store never run at once. A directory pretrain cannot write is one DataError naming it."""
    writable_dir(path.parent, f"data: the token store's directory {path.parent}", STORE_FIX, DataError)
    handle = open(path.with_name(f".{path.name}.lock"), "w")
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _refuse_foreign_directory(path: Path) -> None:
    """pretrain writes only into a store it created: an existing, non-empty directory without the store's
    build.json (written first, before any shard) is someone else's."""
    if path.exists() and not path.is_dir():
        raise DataError(f"data: {path} is a file, not a token store directory; pretrain does not write over a file "
                        "it did not create. Point data.store at a new or empty directory, or at a store "
                        "pretrain-prepare-data built")
    if path.is_dir() and not (path / BUILD).is_file() and any(path.iterdir()):
        raise DataError(
            f"data: {path} already exists and is not a token store (no {BUILD}); pretrain does not write into a "
            "directory it did not create. Point data.store at a new or empty directory, or at a store "
            "pretrain-prepare-data built"
        )


def _set_up(target: StoreTarget, data_cfg: DataConfig, log: Log) -> BuildSpec:
    """build.json and the tokenizer written into the store (once; checked on a rerun): what every shard
    needs. The caller holds the store's lock."""
    _refuse_foreign_directory(target.path)
    writable_dir(target.path, f"data: the token store {target.path}", STORE_FIX, DataError)
    if (target.path / BUILD).is_file():
        _check_identity(target, _read_json(target.path / BUILD), "partly built store")
    else:
        _write_json(target.path / BUILD, target.build)
    tokenizer_dir = target.path / "tokenizer"
    if not tokenizer_dir.is_dir():
        tokenizer = target.tokenizer
        if tokenizer is None:
            tokenizer, _, _ = _get_tokenizer(data_cfg, target.corpus, log)
        tmp = target.path / ".tmp-tokenizer"
        shutil.rmtree(tmp, ignore_errors=True)
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(tokenizer_dir)
    return _spec(target, data_cfg)


def _spec(target: StoreTarget, data_cfg: DataConfig) -> BuildSpec:
    """What the shard builders need, from a store whose build.json and tokenizer are written."""
    if not (target.path / BUILD).is_file() or not (target.path / "tokenizer").is_dir():
        raise StoreMissing(f"data: the token store at {target.path} has not been set up (no build.json or "
                           "tokenizer/): pretrain-prepare-data --slurm writes them before it submits the array job")
    _check_identity(target, _read_json(target.path / BUILD), "partly built store")
    tokenizer = target.tokenizer or _load_saved_tokenizer(target.path / "tokenizer")
    return BuildSpec(str(target.path), data_cfg, token_dtype(len(tokenizer)).str, target.build["tokenizer"]["name"],
                     len(tokenizer), tokenizer.eos_token_id)


def _finish(target: StoreTarget, spec: BuildSpec, records: list[dict[str, Any]], log: Log, start: float) -> None:
    """The split's tie rules, then the manifest (written last: it marks the store complete)."""
    records = apply_split_rules(spec, records)
    dtype = np.dtype(spec.dtype)
    build = {**target.build, "dtype": dtype.name, "byte_order": "little",
             "tokenizer": {**target.build["tokenizer"], "vocab_size": spec.vocab_size,
                           "eos_token_id": spec.eos_token_id},
             "split": "val when sha1(text)[:8] as a fraction of 2**64 < val_fraction (pretrain/data/split.py)",
             "provenance": provenance_header(target.corpus, spec.data_cfg)}
    m = write_manifest(target.path, build, records)
    log(f"data: {m['num_documents']:,} documents ({m['num_train_documents']:,} train / "
        f"{m['num_val_documents']:,} val), {_count_words(m['num_train_tokens'])} train / "
        f"{_count_words(m['num_val_tokens'])} val tokens ({dtype.name}) in {len(records)} shard(s), "
        f"built in {time.perf_counter() - start:.1f}s at {target.path}")


def set_up_store(data_cfg: DataConfig, log: Log = print) -> tuple[StoreTarget, int]:
    """Write the store's build.json and tokenizer (training a BPE if need be) without tokenizing anything:
    what the tasks of a SLURM array need first. (target, number of shards); 0 shards: already complete."""
    target = locate_store(data_cfg, log)
    with _store_lock(target.path):
        if _manifest(target) is not None:
            return target, 0
        _set_up(target, data_cfg, log)
    return target, len(plan_shards(target.corpus, data_cfg))


def prepare_store(data_cfg: DataConfig, num_workers: int | None = None, log: Log = print,
                  progress: bool = False, target: StoreTarget | None = None) -> StoreTarget:
    """Build the recipe's store unless it is complete; resume an interrupted build. A mixture's source
    passes its target with the mixture's tokenizer loaded."""
    target = target or locate_store(data_cfg, log)
    with _store_lock(target.path):
        if _manifest(target) is not None:
            return target
        start = time.perf_counter()
        spec = _set_up(target, data_cfg, log)
        shards = plan_shards(target.corpus, data_cfg)
        workers = num_workers or data_cfg.num_proc or _default_num_proc()
        log(f"data: tokenizing {target.corpus.description} into {len(shards)} shard(s) with {workers} "
            f"worker(s) -> {target.path}")
        _finish(target, spec, build_shards(spec, shards, workers, log, progress), log, start)
    return target


def prepare_store_part(data_cfg: DataConfig, task_index: int, num_tasks: int, num_workers: int | None = None,
                       log: Log = print, progress: bool = False) -> list[int]:
    """One task of an array: tokenize the shards i with i mod num_tasks == task_index of a store that
    set_up_store prepared, keeping complete ones. Tasks share no file, so they need no lock (which a
    cluster filesystem may not give across nodes). The indices of this task's shards."""
    target = locate_store(data_cfg, log)
    if _manifest(target) is not None:
        log(f"data: the token store at {target.path} is complete; nothing to do")
        return []
    spec = _spec(target, data_cfg)
    shards = plan_shards(target.corpus, data_cfg)
    mine = [s for s in shards if s.index % num_tasks == task_index]
    workers = num_workers or data_cfg.num_proc or _default_num_proc()
    log(f"data: task {task_index} of {num_tasks}: tokenizing {len(mine)} of {len(shards)} shard(s) of "
        f"{target.corpus.description} with {workers} worker(s) -> {target.path}")
    build_shards(spec, mine, workers, log, progress)
    return [s.index for s in mine]


def finish_store(data_cfg: DataConfig, log: Log = print) -> StoreTarget:
    """The last step of an array build: the manifest, once every shard's record exists (nothing is
    tokenized here; missing shards are an error naming them)."""
    target = locate_store(data_cfg, log)
    with _store_lock(target.path):
        if _manifest(target) is not None:
            return target
        start = time.perf_counter()
        spec = _spec(target, data_cfg)
        shards = plan_shards(target.corpus, data_cfg)
        records = complete_shards(spec, shards)
        missing = [s.index for s in shards if s.index not in records]
        if missing:
            shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
            raise DataError(f"data: {len(missing)} of {len(shards)} shards of the token store at {target.path} are "
                            f"not complete (shards {shown}); a task of the array failed or is still running. Submit "
                            "the array again (complete shards are kept), or prepare the rest on this machine with "
                            "pretrain-prepare-data without --finish")
        _finish(target, spec, [records[s.index] for s in shards], log, start)
    return target


def _too_few_tokens(split: str, manifest: dict[str, Any], data_cfg: DataConfig) -> DataError:
    hint = ", a larger data.val_fraction" if split == "val" else ""
    return DataError(
        f"data: the {split} split has {manifest[f'num_{split}_tokens']:,} tokens "
        f"({manifest[f'num_{split}_documents']:,} documents of data.source = {data_cfg.source!r}), fewer than one "
        f"sequence of data.seq_len + 1 = {data_cfg.seq_len + 1} tokens; use a smaller data.seq_len{hint} or more data"
    )


def open_store(data_cfg: DataConfig, log: Log = print, target: StoreTarget | None = None,
               prepare_command: str = "pretrain-prepare-data --recipe RECIPE",
               checksums: bool | None = None) -> PackedData:
    """The store's rows of seq_len + 1 tokens (memory-mapped) and its tokenizer; StoreMissing if it has not
    been prepared, DataError if it was made for other data or another tokenizer, or if its files are not what
    its manifest promises (``store.check_files``: sizes always; ``checksums``, None: every SHA-256 of a store
    up to VERIFY_ON_OPEN_MAX_BYTES)."""
    start = time.perf_counter()
    target = target or find_store(data_cfg, log)
    manifest = _manifest(target)
    if manifest is None:
        raise StoreMissing(f"data: no token store at {target.path} for data.source = {data_cfg.source!r} "
                           f"(tokenizer {target.build['tokenizer']['name']}); prepare it first: {prepare_command}")
    # A small store: every file's SHA-256 against its record. Otherwise a format-1 store has every file's size checked
    # here; a format-2 store's shard files are checked by size when first mapped (nothing per shard at open).
    verified = check_files(target.path, manifest, checksums)
    row_len = data_cfg.seq_len + 1
    train = split_rows(target.path, manifest, "train", row_len, data_cfg.train_subset)
    val = split_rows(target.path, manifest, "val", row_len, data_cfg.val_subset)
    for split, rows in (("train", train), ("val", val)):
        if rows.num_tokens < row_len:
            raise _too_few_tokens(split, manifest, data_cfg)
    tokenizer = target.tokenizer or _load_saved_tokenizer(target.path / "tokenizer")
    stats = {k: v for k, v in manifest.items()
             if k not in ("shards", "num_shards", "num_bytes", "content") and not isinstance(v, dict)}
    stats.update(
        tokenizer=manifest["tokenizer"]["name"],
        vocab_size=manifest["tokenizer"]["vocab_size"],
        eos_token_id=manifest["tokenizer"]["eos_token_id"],
        num_shards=num_shards(manifest),
        seq_len=data_cfg.seq_len,
        num_train_sequences=len(train),
        num_val_sequences=len(val),
        train_subset=data_cfg.train_subset,
        val_subset=data_cfg.val_subset,
        cache_dir=str(target.path),
    )
    bad = manifest.get("num_decode_errors", 0)
    log(f"data: {len(train):,} train / {len(val):,} val sequences of {row_len} tokens from the store at "
        f"{target.path} ({num_shards(manifest)} shard(s), "
        f"{_checked(manifest, verified)}, {time.perf_counter() - start:.2f}s)"
        + (f"; {bad:,} document(s) had non-UTF-8 bytes ({'replaced with U+FFFD' if data_cfg.on_decode_error == 'replace' else 'skipped'}, data.on_decode_error)"
           if bad else ""))
    return PackedData(train=train, val=val, tokenizer=tokenizer, stats=stats,
                      identity=store_identity(target.path, manifest))


def verify_stores(paths: list[Path], workers: int | None = None, log: Log = print) -> None:
    """pretrain-prepare-data --verify: every shard file of each complete store hashed against its record by
    ``workers`` processes, resumably (``store.verify_store``); a damaged store is one DataError naming its shards."""
    workers = workers or _default_num_proc()
    for path in paths:
        try:
            manifest = _read_json(path / MANIFEST)
        except (OSError, ValueError) as exc:
            raise DataError(f"{path / MANIFEST}: unreadable ({exc}); delete the store and prepare it again") from None
        verify_store(path, manifest, workers, log)


def _checked(manifest: dict[str, Any], verified: bool) -> str:
    if verified:
        return "checksums verified"
    return "sizes checked as shards are read" if is_indexed(manifest) else "sizes verified"


def planned_identity(target: StoreTarget) -> dict[str, Any]:
    """What the store a run is about to open (or build) is made from, before anything is built: the fields of
    ``store_identity`` that build.json holds (a named store's: from its manifest)."""
    build = target.build
    return {"store": str(target.path), "key": build["key"], "corpus": build["corpus"],
            **{k: build[k] for k in STREAM_FIELDS}}


def corpus_file_changes(saved_store: str, data_cfg: DataConfig | None) -> str | None:
    """Which input files differ between the store at ``saved_store`` (its manifest's shard inputs) and
    data.source now: added, removed, changed (size or mtime); None if that store's manifest is gone (or no
    data section is given)."""
    if data_cfg is None:
        return None
    try:
        manifest = _read_json(Path(saved_store) / MANIFEST)
    except (OSError, ValueError):
        return None
    try:
        old = {f[0]: (f[2], f[3]) for shard in shard_records(Path(saved_store), manifest) for f in shard["inputs"]
               if f[0] != "hf"}
    except DataError:
        return None
    new = {}
    for path, _ in _resolve_corpus(data_cfg).files:
        st = Path(path).stat()
        new[path] = (st.st_size, st.st_mtime_ns)
    parts = []
    for what, names in (("added", sorted(set(new) - set(old))), ("removed", sorted(set(old) - set(new))),
                        ("changed (size or mtime)", sorted(p for p in set(old) & set(new) if old[p] != new[p]))):
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            parts.append(f"{len(names)} file(s) {what}: {shown}")
    return "; ".join(parts) or None


def store_ready(target: StoreTarget) -> bool:
    """Whether the store is complete (its manifest written); DataError if it is another tokenizer's or data's."""
    return _manifest(target) is not None


def ensure_stores(targets: list[StoreTarget], launch, prepare: Callable[[], Any], prepare_command: str,
                  log: Log = print, poll_s: float = 1.0) -> None:
    """Make sure the stores exist before any process group does, so that no rank waits for them in a
    collective. Missing stores are prepared (``prepare()``) by local rank 0 of a single-node launch while the
    node's other processes poll for their manifests; a multi-node launch stops at once with the command
    that prepares them."""
    missing = [t for t in targets if not store_ready(t)]
    if not missing:
        return
    if launch.num_nodes > 1:
        where = ", ".join(f"{t.path} (data.source = {t.build['source']!r})" for t in missing)
        raise StoreMissing(
            f"data: no token store at {where}; a {launch.num_nodes}-node launch does not tokenize (every node "
            f"would wait on one). Prepare it once, on a machine that sees the data and this path (or as a SLURM "
            f"array job), then launch again:\n    {prepare_command}"
        )
    if launch.local_rank == 0:
        prepare()
        return
    # The launcher (torchrun) ends these processes if local rank 0 fails, so polling needs no timeout.
    waited, last_log = time.perf_counter(), time.perf_counter()
    while not all(store_ready(t) for t in missing):
        if time.perf_counter() - last_log >= WAIT_LOG_EVERY_S:
            log(f"data: rank {launch.rank} waiting {time.perf_counter() - waited:.0f}s for local rank 0 to "
                f"prepare {', '.join(str(t.path) for t in missing)}")
            last_log = time.perf_counter()
        time.sleep(poll_s)


def _multi_node_missing(target: StoreTarget, data_cfg: DataConfig, num_nodes: int, prepare_command: str):
    return StoreMissing(
        f"data: no token store at {target.path} for data.source = {data_cfg.source!r}; a {num_nodes}-node launch "
        f"does not tokenize (every node would wait on one). Prepare it once, on a machine that sees the data and "
        f"this path (or as a SLURM array job), then launch again:\n    {prepare_command}"
    )


def check_store(data_cfg: DataConfig, num_nodes: int, prepare_command: str) -> None:
    """Before a launch, in one process (pretrain-launch, pretrain-slurm): a store made for other data is
    refused (its fingerprints compared: the ranks only read its manifest), and so is a missing one for a
    multi-node launch, with the command that prepares it. A single-node launch prepares a missing store
    itself (ensure_store), so an unnamed store is left to it."""
    named = Path(data_cfg.store).expanduser().absolute() if data_cfg.store else None
    if named is not None and not (named / MANIFEST).is_file():
        target = StoreTarget(named, {}, corpus=None, tokenizer=None)  # missing: nothing else to look at
    elif named is None and num_nodes == 1:
        return
    else:
        target = locate_store(data_cfg, log=lambda _: None)
        if _manifest(target) is not None:
            return
    if num_nodes > 1:
        raise _multi_node_missing(target, data_cfg, num_nodes, prepare_command)


def ensure_store(data_cfg: DataConfig, launch, prepare_command: str, log: Log = print,
                 poll_s: float = 1.0) -> None:
    """``ensure_stores`` for the single store of data_cfg. A named store (data.store) is opened from its
    manifest alone: the launchers checked it (check_store)."""
    if _named_store(data_cfg) is not None:
        return
    target = locate_store(data_cfg, log=lambda _: None)
    ensure_stores([target], launch, lambda: prepare_store(data_cfg, log=log, progress=launch.world_size == 1),
                  prepare_command, log, poll_s)


def prepare_commands(recipe_path: str, overrides: list[str], num_nodes: int, sbatch_args: list[str] = ()) -> str:
    """The commands that prepare a recipe's store: on one machine, and as a SLURM array of num_nodes tasks."""
    from pretrain.distributed.layout import shell_join

    local = shell_join(["pretrain-prepare-data", "--recipe", recipe_path, *overrides])
    array = shell_join(["pretrain-prepare-data", "--recipe", recipe_path, "--slurm", "--array", str(num_nodes),
                        *sbatch_args, *overrides])
    return f"{local}\nor as a SLURM array job of {num_nodes} tasks (one node each):\n    {array}"
