"""The token store's scale paths on synthetic stores (issue 50: 100,000 shards), for tools/scale_bench.py and by hand.

    python tools/scale_store.py open 30000 /tmp/scale        # build the synthetic store if missing, then time the open
    python tools/scale_store.py cleanup 30000 /tmp/scale
    python tools/scale_store.py resolve-exclude 30000 /tmp/scale

Each measured function is ``fn(size, workdir)``, with a ``prepare_<name>(size, workdir)`` that writes what it needs
first (unmeasured; the bench runs it in a process of its own). A synthetic store is what ``pretrain-prepare-data``
writes, shard files and records included, with every shard holding the same few tokens (their contents do not matter
here) and ``store_build.write_manifest`` writing the manifest: the code it is run with decides the format, so the same
file measures an older checkout (``PYTHONPATH=<checkout> python tools/scale_store.py ...``). ``sparse`` stores (the
tests') write the files of only the shards named, which is all an O(1) open may touch.

``count_io()`` counts the stats, opens and directory listings of paths under a directory (an audit hook for opens and
listings, os.stat / os.lstat wrapped for stats): the tests assert a constant bound with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

TOKENS_PER_SHARD = 64  # train tokens of each synthetic shard: 4 documents of 16
VAL_TOKENS_PER_SHARD = 8  # one validation document
SEQ_LEN = 31  # rows of 32 tokens
VOCAB = 300
DOCUMENTS_PER_SHARD = 4


# ---- counting what touches a directory ------------------------------------------------------------------------

_active: list[tuple[str, Counter]] = []
_hooked = False


def _audit(event: str, args) -> None:
    if not _active or event not in ("open", "os.listdir", "os.scandir"):
        return
    path = args[0] if args else None
    if isinstance(path, (str, bytes, os.PathLike)):
        path = os.fsdecode(os.fspath(path))
        for root, counter in _active:
            if path.startswith(root):
                counter["open" if event == "open" else "listdir"] += 1


@contextlib.contextmanager
def count_io(directory: Path):
    """A Counter of the stats ("stat"), opens ("open") and listings ("listdir") of paths under ``directory`` while the
    block runs (this process only)."""
    global _hooked
    if not _hooked:
        sys.addaudithook(_audit)  # cannot be removed: it counts only while a block is active
        _hooked = True
    counter: Counter = Counter()
    root = os.path.abspath(directory)
    stat, lstat = os.stat, os.lstat

    def counted(real):
        def wrapper(path, *args, **kwargs):
            if isinstance(path, (str, bytes, os.PathLike)) and os.fsdecode(os.fspath(path)).startswith(root):
                counter["stat"] += 1
            return real(path, *args, **kwargs)
        return wrapper

    os.stat, os.lstat = counted(stat), counted(lstat)
    _active.append((root, counter))
    try:
        yield counter
    finally:
        _active.remove((root, counter))
        os.stat, os.lstat = stat, lstat


# ---- a synthetic store --------------------------------------------------------------------------------------


def _tokenizer(directory: Path) -> None:
    """A tiny word-level tokenizer (VOCAB ids, eos among them) saved as a store's tokenizer/."""
    if (directory / "tokenizer.json").is_file():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<eos>": VOCAB - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(str(directory))


def _split_files(split: str, num_tokens: int, num_documents: int) -> dict[str, bytes]:
    """The bytes of one shard's split files (the same for every shard), by suffix."""
    rng = np.random.default_rng(num_tokens)
    tokens = rng.integers(0, VOCAB - 1, num_tokens).astype("<u2")
    ends = np.linspace(num_tokens // num_documents, num_tokens, num_documents).astype("<u8")
    tokens[ends.astype(np.int64) - 1] = VOCAB - 1  # every document ends with eos
    return {"": tokens.tobytes(), ".index": ends.tobytes(),
            ".origin": np.arange(num_documents, dtype="<u4").tobytes(),
            ".metadata": f"synthetic\n{num_tokens}\n{num_tokens}T".encode()}


SPLIT_SHAPES = {"train": (TOKENS_PER_SHARD, DOCUMENTS_PER_SHARD), "val": (VAL_TOKENS_PER_SHARD, 1)}


def data_config(store: Path):
    from pretrain.recipe.config import DataConfig

    return DataConfig(source="synthetic", tokenizer="synthetic", store=str(store), seq_len=SEQ_LEN, val_fraction=0.05)


def make_store(store: Path, num_shards: int, files: str | set[int] = "all") -> Path:
    """A complete synthetic store of ``num_shards`` shards at ``store`` (kept if its manifest exists). ``files``:
    "all", or the shards whose files and records are written (the others exist only in the manifest or index)."""
    from pretrain.data.store import FORMAT, FORMAT_VERSION, _write_json, shard_name
    from pretrain.data.store_build import write_manifest

    if (store / "manifest.json").is_file():
        return store
    shards_dir = store / "shards"
    shards_dir.mkdir(parents=True, exist_ok=True)
    _tokenizer(store / "tokenizer")
    contents = {split: _split_files(split, *shape) for split, shape in SPLIT_SHAPES.items()}
    split_record = {}
    for split, parts in contents.items():
        num_tokens, num_documents = SPLIT_SHAPES[split]
        split_record[split] = {
            "num_tokens": num_tokens, "num_documents": num_documents, "num_bytes": 2 * num_tokens,
            "sha256": hashlib.sha256(parts[""]).hexdigest(), "index_sha256": hashlib.sha256(parts[".index"]).hexdigest(),
            "origin": {"dtype": "<u4", "sha256": hashlib.sha256(parts[".origin"]).hexdigest(),
                       "runs": [[0, 0, "line"]]},
        }
    written = range(num_shards) if files == "all" else sorted(files)
    records, corpus = [], str(store / "corpus")
    for k in range(num_shards):
        name = shard_name(k)
        record = {"name": name, "inputs": [[f"{corpus}/{name}.jsonl", "jsonl", 1, 0]],
                  "num_decode_errors": 0, "min_train_hash": [None, -1], "max_val_hash": [None, -1],
                  **{split: {**split_record[split], "file": f"{name}.{split}.ds"} for split in SPLIT_SHAPES}}
        records.append(record)
    for k in written:
        name = shard_name(k)
        for split, parts in contents.items():
            for suffix, data in parts.items():
                (shards_dir / f"{name}.{split}.ds{suffix}").write_bytes(data)
        _write_json(shards_dir / f"{name}.json", records[k])
    cfg = data_config(store)
    build = {"format": FORMAT, "version": FORMAT_VERSION, "key": "synthetic", "source": cfg.source,
             "corpus": "synthetic", "corpus_fingerprint": "synthetic", "text_field": cfg.text_field,
             "on_decode_error": cfg.on_decode_error, "val_fraction": cfg.val_fraction,
             "tokenizer": {"name": cfg.tokenizer, "identity": "synthetic", "vocab_size": VOCAB,
                           "eos_token_id": VOCAB - 1},
             "dtype": "uint16", "byte_order": "little", "split": "synthetic",
             "provenance": {"version": 1, "root": str(store / "corpus")}}
    _write_json(store / "build.json", build)
    write_manifest(store, build, records)
    return store


def open_as_rank(store: Path):
    """What a rank does with a named store: open it (manifest, index, tokenizer) and read one row."""
    from pretrain.data import open_store

    data = open_store(data_config(store), log=lambda _: None)
    assert data.train[0].shape == (SEQ_LEN + 1,)
    return data


# ---- the measured paths -----------------------------------------------------------------------------------


def _store(num_shards: int, workdir: Path) -> Path:
    return Path(workdir) / f"store-{num_shards}"


def prepare_measure_open(num_shards: int, workdir: Path) -> None:
    make_store(_store(num_shards, workdir), num_shards)


def measure_open(num_shards: int, workdir: Path) -> dict:
    """Open a synthetic store of num_shards shards as a rank does (built first if missing) and read one row; the
    stats, opens and listings of the store's files it took."""
    store = _store(num_shards, workdir)
    make_store(store, num_shards)
    with count_io(store) as counted:
        open_as_rank(store)
    return dict(counted)


def prepare_measure_cleanup(num_shards: int, workdir: Path) -> None:
    make_cleanup_dir(Path(workdir) / f"cleanup-{num_shards}", num_shards)


def make_cleanup_dir(shards_dir: Path, num_shards: int) -> None:
    """A shards/ directory of num_shards complete shards' files (empty) and one interrupted shard's .tmp- files in
    ten (made again if a cleanup removed them)."""
    from pretrain.data.store import shard_name

    shards_dir.mkdir(parents=True, exist_ok=True)
    complete = (shards_dir / f"{shard_name(num_shards - 1)}.json").exists()
    for k in range(num_shards):
        name = shard_name(k)
        if not complete:
            for suffix in (".json", ".train.ds", ".val.ds"):
                (shards_dir / f"{name}{suffix}").touch()
        if k % 10 == 0:
            (shards_dir / f".tmp-{name}.train.ds").touch()


def measure_cleanup(num_shards: int, workdir: Path) -> dict:
    """The build's removal of an interrupted build's .tmp- files, every shard to redo (the worst case), in a directory
    of num_shards shards; the listings it took. Measures store_build.remove_stale_files where it exists, else the
    per-shard glob the build ran before it."""
    from pretrain.data import store_build
    from pretrain.data.store import shard_name

    shards_dir = Path(workdir) / f"cleanup-{num_shards}"
    make_cleanup_dir(shards_dir, num_shards)
    start = time.perf_counter()
    with count_io(shards_dir) as counted:
        if hasattr(store_build, "remove_stale_files"):
            store_build.remove_stale_files(shards_dir, set(range(num_shards)))
        else:  # the code before issue 50: a glob of the directory per shard
            for k in range(num_shards):
                for stale in shards_dir.glob(f".tmp-{shard_name(k)}.*"):
                    stale.unlink(missing_ok=True)
    return {**counted, "cleanup_s": round(time.perf_counter() - start, 3)}


EXCLUDE_SHARDS = 10_000  # the store whose documents data.exclude lists (the cost per document grew with its shards)


def prepare_measure_resolve_exclude(num_docs: int, workdir: Path) -> None:
    make_store(_store(EXCLUDE_SHARDS, workdir), EXCLUDE_SHARDS)
    _exclude_list(num_docs, workdir)


def _exclude_list(num_docs: int, workdir: Path) -> Path:
    """A quarantine list of num_docs training documents spread over the store's shards."""
    path = Path(workdir) / f"exclude-{num_docs}.json"
    if path.is_file():
        return path
    from pretrain.data.store import shard_name

    store = _store(EXCLUDE_SHARDS, workdir)
    content = json.loads((store / "manifest.json").read_text()).get("content")
    if content is None:  # a format-1 store (an older checkout): its identity's content, as it computes it
        from pretrain.data.store import store_identity

        content = store_identity(store, json.loads((store / "manifest.json").read_text()))["content"]
    documents = [{"source": "data", "file": f"{shard_name((i * 7919) % EXCLUDE_SHARDS)}.train.ds",
                  "document": (i // EXCLUDE_SHARDS) % DOCUMENTS_PER_SHARD, "store": {"content": content}}
                 for i in range(num_docs)]  # distinct up to 40,000 documents
    path.write_text(json.dumps({"version": 1, "documents": documents}))
    return path


def measure_resolve_exclude(num_docs: int, workdir: Path) -> dict:
    """data.exclude of num_docs documents of a 10,000-shard synthetic store resolved as a rank does at start (the store
    opened first, unmeasured apart: the figure is the whole start)."""
    from pretrain.data.quarantine import resolve_exclude

    store = _store(EXCLUDE_SHARDS, workdir)
    make_store(store, EXCLUDE_SHARDS)
    listed = _exclude_list(num_docs, workdir)
    data = open_as_rank(store)
    start = time.perf_counter()
    resolved = resolve_exclude([str(listed)], data, log=lambda _: None)
    return {"documents": len(resolved["documents"]), "rows": len(resolved["samples"]),
            "resolve_s": round(time.perf_counter() - start, 3)}


def main(argv: list[str]) -> int:
    import resource

    what, size, workdir = argv[0], int(argv[1]), Path(argv[2])
    fn = {"open": measure_open, "cleanup": measure_cleanup, "resolve-exclude": measure_resolve_exclude}[what]
    prepare = {"open": prepare_measure_open, "cleanup": prepare_measure_cleanup,
               "resolve-exclude": prepare_measure_resolve_exclude}[what]
    if "--prepare" in argv:
        prepare(size, workdir)
        return 0
    start = time.perf_counter()
    counters = fn(size, workdir)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"path": what, "size": size, "seconds": round(seconds, 3), "peak_rss_mib": round(peak, 1),
                      **counters}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
