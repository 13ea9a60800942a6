"""The token store on disk: sharded, memory-mapped token files with document boundaries and a manifest.

    <store>/manifest.json                  written last: a store without it is incomplete. Small (format 2): the
                                           store's identity, totals, and its index files' checksums
    <store>/index.SPLIT.npy                format 2: one record per shard (INDEX_DTYPE: cumulative tokens,
                                           documents and input rows, origin width), read by every rank at open
    <store>/verified.jsonl                 pretrain-prepare-data --verify's record of the shards it hashed
    <store>/build.json                     what the store is for (key, tokenizer, corpus); written first
    <store>/tokenizer/                     the tokenizer (save_pretrained)
    <store>/shards/NNNNN.json              one shard's record, written after its files: its presence
                                           marks the shard complete
    <store>/shards/NNNNN.SPLIT.ds          tokens, little-endian uint16 (vocab <= 65536) or uint32
    <store>/shards/NNNNN.SPLIT.ds.index    little-endian uint64 cumulative document ends, in tokens
    <store>/shards/NNNNN.SPLIT.ds.metadata tokenizer name, token count, the count in words
    <store>/shards/NNNNN.SPLIT.ds.origin   each document's place in its input file (line, record or row):
                                           little-endian uint32 (uint64 past 2**32); the record's origin.runs say
                                           which input file each run of documents came from

The ``.ds`` / ``.ds.index`` / ``.ds.metadata`` triple is datatrove's tokenized-file layout (its
DocumentTokenizer writes it and nanotron reads it), so a split's shard files can be read by that
tooling. Every document ends with the tokenizer's eos token. Every file is written under a temporary
``.tmp-`` name and renamed when complete.

Provenance (``pretrain/data/provenance.py``): a document's input file is one entry per run of documents from one
file in the split's record (``origin.runs``: [first document, index into the shard's inputs, unit]), its place in
that file 4 bytes in the ``.ds.origin`` file, checksummed with the others. A store built before provenance was
recorded has no ``origin`` in its records and trains as before; only the lookup of source documents says it is
missing.

Reading keeps O(number of shards) memory (8 bytes a shard): each split is the concatenation of its shards' token
files in shard order, and a row of ``row_len`` tokens is cut from that stream at ``i x row_len`` (a row may
span two shards), memory-mapping a shard file on first use.

Opening (format 2, ``FORMAT_VERSION``) reads three small files whatever the number of shards: the manifest and the two
index files (their SHA-256 checked against the manifest's). No shard file is stat-ed and no shard record read: a
shard file's size is checked when it is first memory-mapped (``TokenRows._map``: a truncated file is refused before
its tokens are used), its document index and origins when provenance first reads them. A small store (at most
VERIFY_ON_OPEN_MAX_BYTES in at most VERIFY_ON_OPEN_MAX_SHARDS shards) is still hashed in full at every open. A
format-1 store (its manifest lists every shard; no index) opens as it always did: every file's size checked, its
shard list parsed (``is_indexed``). The index is written by ``write_index`` (the build's last step, before the
manifest), from the shards' records.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.errors import DataError

FORMAT = "pretrain-token-store"
FORMAT_VERSION = 2  # 2: the manifest is small and the per-shard counts are in index.SPLIT.npy
READABLE_VERSIONS = (1, 2)  # a format-1 store (every shard in its manifest) still opens, by the read path it had
# The store's key (its path under the cache) names its token stream, not its layout: it keeps the version it had
# when the layout changed, so that an unnamed store built before is still found.
KEY_VERSION = 1
MANIFEST = "manifest.json"
VERIFIED = "verified.jsonl"
BUILD = "build.json"
SPLITS = ("train", "val")
MAX_OPEN_SHARDS = 64  # memory maps each reader keeps open (each holds a file descriptor)
# Opening a store checks every shard file's size against the manifest (a stat each), and, up to this many bytes of
# shard files, every SHA-256 too: 1 GiB hashes in 1.7-2.1 s on one core of a SHA-NI Xeon (README, "A store is
# checked"). A larger store is hashed in full by `pretrain-prepare-data --verify`, once, not by every rank at every
# start (1 TB would be about half an hour per rank).
VERIFY_ON_OPEN_MAX_BYTES = 1 << 30
# ... and only in at most this many shards: every file of a shard is a stat, an open and a read (and its record one
# more) on the filesystem's metadata server, per rank. A store of tiny shards (a test's, a synthetic one) past this is
# checked as a large one: lazily by size, in full by --verify.
VERIFY_ON_OPEN_MAX_SHARDS = 1024
HASH_CHUNK_BYTES = 8 << 20
# One record per shard of a split (format 2): cumulative ends of the tokens, documents and input rows (hf: the rows of
# the stream before the next shard), and the width in bytes of its origins (0: none recorded). Little-endian.
INDEX_DTYPE = np.dtype([("tokens", "<u8"), ("documents", "<u8"), ("input_rows", "<u8"), ("origin", "u1")])


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits (vocab <= 65536), else uint32; little-endian either way."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def _count_words(n: float) -> str:
    """Human-readable count: 734, 12.3k, 3.19M."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{int(n)}"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _write_json(path: Path, obj: Any) -> None:
    _write_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def shard_name(index: int) -> str:
    return f"{index:05d}"


Origin = tuple[int, str, int]  # a document's (index into its shard's inputs, unit, locator): readers.located_documents


def origin_dtype(locators) -> np.dtype:
    """uint32 while every locator fits (a line number of a 4-billion-line file does not), else uint64."""
    return np.dtype("<u4") if max(locators, default=0) < 2**32 else np.dtype("<u8")


class SplitWriter:
    """One split of one shard: appends documents' tokens to ``.tmp-`` files; ``commit`` renames them."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype, tokenizer_name: str):
        self.directory, self.name, self.dtype, self.tokenizer_name = directory, name, dtype, tokenizer_name
        self.tmp = directory / f".tmp-{name}.ds"
        self.file = open(self.tmp, "wb")
        self.sha = hashlib.sha256()
        self.doc_ends: list[int] = []
        self.num_tokens = 0
        self.locators: list[int] = []  # each document's place in its input file
        self.runs: list[list] = []  # [first document, input index, unit] where the input file or unit changes

    def write(self, tokens: np.ndarray, doc_lengths: np.ndarray, origins: list[Origin]) -> None:
        """Append documents: their concatenated tokens, each one's length and where each came from."""
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self.file.write(data)
        self.sha.update(data)
        for source, unit, locator in origins:
            if not self.runs or self.runs[-1][1:] != [source, unit]:
                self.runs.append([len(self.locators), source, unit])
            self.locators.append(locator)
        self.doc_ends.extend((self.num_tokens + np.cumsum(doc_lengths)).tolist())
        self.num_tokens += int(np.sum(doc_lengths))

    def commit(self) -> dict[str, Any]:
        """Write the index, origins and metadata, rename all four into place; the split's record."""
        self.file.close()
        assert len(self.locators) == len(self.doc_ends), "a document without its origin"
        index = np.asarray(self.doc_ends, dtype="<u8").tobytes()
        _write_atomic(self.directory / f"{self.name}.ds.index", index)
        dtype = origin_dtype(self.locators)
        origin = np.asarray(self.locators, dtype=dtype).tobytes()
        _write_atomic(self.directory / f"{self.name}.ds.origin", origin)
        metadata = f"{self.tokenizer_name}\n{self.num_tokens}\n{_count_words(self.num_tokens)}T"
        _write_atomic(self.directory / f"{self.name}.ds.metadata", metadata.encode())
        os.replace(self.tmp, self.directory / f"{self.name}.ds")
        return {
            "file": f"{self.name}.ds",
            "num_tokens": self.num_tokens,
            "num_documents": len(self.doc_ends),
            "num_bytes": self.num_tokens * self.dtype.itemsize,
            "sha256": self.sha.hexdigest(),
            "index_sha256": hashlib.sha256(index).hexdigest(),
            "origin": {"dtype": dtype.str, "sha256": hashlib.sha256(origin).hexdigest(), "runs": self.runs},
        }

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def read_split_documents(shards_dir: Path, record: dict[str, Any], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, document ends) of one split file, read whole (used only to re-split tiny corpora)."""
    if record["num_tokens"] == 0:
        return np.zeros(0, dtype), np.zeros(0, np.uint64)
    tokens = np.fromfile(shards_dir / record["file"], dtype=dtype)
    ends = np.fromfile(shards_dir / f"{record['file']}.index", dtype="<u8")
    return tokens, ends


def read_split_origins(shards_dir: Path, record: dict[str, Any]) -> list[Origin]:
    """Every document's origin of one split file, read whole (used only to re-split tiny corpora)."""
    locators = np.fromfile(shards_dir / f"{record['file']}.origin", dtype=record["origin"]["dtype"]).tolist()
    runs = record["origin"]["runs"]
    out = []
    for k, (first, source, unit) in enumerate(runs):
        stop = runs[k + 1][0] if k + 1 < len(runs) else len(locators)
        out += [(source, unit, locator) for locator in locators[first:stop]]
    return out


def _split_files(record: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(file name, size in bytes, SHA-256) of each file of one split: tokens, document index, origins (a store built
    before provenance was recorded has none)."""
    files = [(record["file"], record["num_bytes"], record["sha256"]),
             (f"{record['file']}.index", 8 * record["num_documents"], record["index_sha256"])]
    if "origin" in record:
        size = np.dtype(record["origin"]["dtype"]).itemsize * record["num_documents"]
        files.append((f"{record['file']}.origin", size, record["origin"]["sha256"]))
    return files


def split_files_intact(shards_dir: Path, record: dict[str, Any]) -> bool:
    """Whether a split's files exist with the sizes its record gives (a cheap check: no reading). A record without
    origins (a shard written before provenance was recorded) is not: a build tokenizes it again."""
    try:
        return "origin" in record and all((shards_dir / name).stat().st_size == size
                                          for name, size, _ in _split_files(record))
    except OSError:
        return False


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


# ---- the manifest and the index (format 2) ----------------------------------------------------------


def is_indexed(manifest: dict[str, Any]) -> bool:
    """Whether the store has index files (format 2); a format-1 manifest lists every shard instead."""
    return "index" in manifest


def num_shards(manifest: dict[str, Any]) -> int:
    return manifest["num_shards"] if is_indexed(manifest) else len(manifest["shards"])


def index_name(split: str) -> str:
    return f"index.{split}.npy"


def content_digest(records: list[dict[str, Any]]) -> str:
    """A digest of every shard file's checksum, in shard order (the identity's ``content``). Format 2 computes it once,
    at build time, into the manifest; format 1 at every open, from its shard list: the same formula, so that a store's
    identity (what checkpoints record) does not depend on its format."""
    # json.dumps of [[sha256, index_sha256], ...] (hex digits need no escaping), written out: 3x faster at 100,000
    # shards, and the same bytes
    pairs = ", ".join(f'["{record[split]["sha256"]}", "{record[split]["index_sha256"]}"]'
                      for record in records for split in SPLITS)
    return hashlib.sha256(f"[{pairs}]".encode()).hexdigest()[:16]


def index_arrays(records: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Each split's index (INDEX_DTYPE, one record per shard) from the shards' records."""
    rows = np.cumsum([record.get("input_rows", 0) for record in records], dtype=np.uint64)
    out = {}
    for split in SPLITS:
        index = np.zeros(len(records), dtype=INDEX_DTYPE)
        index["tokens"] = np.cumsum([r[split]["num_tokens"] for r in records], dtype=np.uint64)
        index["documents"] = np.cumsum([r[split]["num_documents"] for r in records], dtype=np.uint64)
        index["input_rows"] = rows
        index["origin"] = [np.dtype(r[split]["origin"]["dtype"]).itemsize if "origin" in r[split] else 0
                           for r in records]
        out[split] = index
    return out


def _npy_bytes(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def write_index(store_dir: Path, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Write index.SPLIT.npy for every split (atomically); the manifest's ``index`` entry: each file's name, size
    and SHA-256."""
    entry = {}
    for split, array in index_arrays(records).items():
        data = _npy_bytes(array)
        _write_atomic(store_dir / index_name(split), data)
        entry[split] = {"file": index_name(split), "num_bytes": len(data),
                        "sha256": hashlib.sha256(data).hexdigest()}
    return entry


def _rebuild_hint(store_dir: Path) -> str:
    return (f"delete {store_dir / MANIFEST} and prepare the store again (the same run command on one node, or "
            "pretrain-prepare-data with the same recipe): the shards are kept and the index written anew")


def load_index(store_dir: Path, manifest: dict[str, Any], split: str) -> np.ndarray:
    """A split's index (INDEX_DTYPE), read whole and checked against the manifest's size and SHA-256: one open and
    one read, 25 bytes a shard. A missing or altered index is one DataError naming the rebuild."""
    entry = manifest["index"][split]
    path = store_dir / entry["file"]
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"data: the token store at {store_dir} is damaged: its index {path} cannot be read "
                        f"({exc.strerror}); {_rebuild_hint(store_dir)}") from None
    if len(data) != entry["num_bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise DataError(f"data: the token store at {store_dir} is damaged: its index {path} "
                        f"({len(data):,} bytes, the manifest records {entry['num_bytes']:,}) is not the one its manifest "
                        f"names (SHA-256); {_rebuild_hint(store_dir)}")
    import io

    index = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
    if index.dtype != INDEX_DTYPE or len(index) != manifest["num_shards"]:
        raise DataError(f"data: the token store at {store_dir}: its index {path} holds {len(index):,} records of "
                        f"{index.dtype}, not {manifest['num_shards']:,} of the store's format; {_rebuild_hint(store_dir)}")
    return index


def record_path(store_dir: Path, shard: int) -> Path:
    return store_dir / "shards" / f"{shard_name(shard)}.json"


RECORD_KEYS = ("name", "inputs", "input_rows", "train", "val")  # what a shard's record gives the store (format 1's list)


def read_record(store_dir: Path, shard: int) -> dict[str, Any]:
    """Shard ``shard``'s record (shards/NNNNN.json), as a format-1 manifest listed it; one DataError if unreadable."""
    path = record_path(store_dir, shard)
    try:
        record = _read_json(path)
    except (OSError, ValueError) as exc:
        raise DataError(f"data: the token store at {store_dir} is damaged: the shard record {path} cannot be read "
                        f"({exc}); delete {store_dir / MANIFEST} and {path}, then prepare the store again (only that "
                        "shard is tokenized again)") from None
    return {k: record[k] for k in RECORD_KEYS if k in record}


def shard_records(store_dir: Path, manifest: dict[str, Any]):
    """Every shard's record in order: a format-1 manifest's list, or (format 2) each shards/NNNNN.json read in turn.
    O(shards): for the build, --verify and tools, never for opening a store."""
    if not is_indexed(manifest):
        yield from manifest["shards"]
        return
    for shard in range(manifest["num_shards"]):
        yield read_record(store_dir, shard)


def store_bytes(manifest: dict[str, Any]) -> int:
    """Bytes of the shard files (tokens, document indexes, origins) the manifest promises."""
    if is_indexed(manifest):
        return manifest["num_bytes"]
    return sum(size for shard in manifest["shards"] for split in SPLITS for _, size, _ in _split_files(shard[split]))


def records_bytes(records: list[dict[str, Any]]) -> int:
    return sum(size for record in records for split in SPLITS for _, size, _ in _split_files(record[split]))


def shard_problems(shards_dir: Path, record: dict[str, Any], checksums: bool,
                   stats: dict[str, tuple[int, int]] | None = None) -> list[str]:
    """What in one shard differs from its record: a file missing, of another size, or (``checksums``) of another
    SHA-256. ``stats``: filled with each file's (size, mtime_ns) as found before hashing."""
    problems = []
    for split in SPLITS:
        for name, size, digest in _split_files(record[split]):
            path = shards_dir / name
            try:
                st = path.stat()
            except OSError as exc:
                problems.append(f"{path}: {exc.strerror}")
                continue
            if stats is not None:
                stats[name] = (st.st_size, st.st_mtime_ns)
            if st.st_size != size:
                problems.append(f"{path}: {st.st_size:,} bytes, the manifest records {size:,}")
            elif checksums and _file_sha256(path) != digest:
                problems.append(f"{path}: its SHA-256 differs from the manifest's (same size: the contents changed)")
    return problems


def damaged_files(store_dir: Path, manifest: dict[str, Any], checksums: bool) -> list[str]:
    """What in the store differs from what its manifest (format 2: its shards' records) promises, one entry per file:
    missing, another size, or (``checksums``) another SHA-256. Empty when intact. O(shards)."""
    shards_dir, problems = store_dir / "shards", []
    for shard in shard_records(store_dir, manifest):
        problems += shard_problems(shards_dir, shard, checksums)
    return problems


def damage_error(store_dir: Path, problems: list[str]) -> DataError:
    """The one message for a damaged store: the files, and how to rebuild only their shards."""
    shards = sorted({Path(p.split(":", 1)[0]).name.split(".", 1)[0] for p in problems})
    records = " ".join(str(store_dir / "shards" / f"{name}.json") for name in shards[:8])
    shown = "; ".join(problems[:8]) + (f"; ... ({len(problems) - 8} more)" if len(problems) > 8 else "")
    return DataError(
        f"data: the token store at {store_dir} is damaged: {shown}. Rebuild the damaged shard(s) ({len(shards)}): "
        f"delete {store_dir / MANIFEST} and {records}{' ...' if len(shards) > 8 else ''}, then prepare the store "
        "again (the same run command on one node, or pretrain-prepare-data with the same recipe); intact shards are "
        "kept"
    )


def verify_on_open(manifest: dict[str, Any]) -> bool:
    """Whether opening hashes every file: a store of at most VERIFY_ON_OPEN_MAX_BYTES in at most
    VERIFY_ON_OPEN_MAX_SHARDS shards."""
    return store_bytes(manifest) <= VERIFY_ON_OPEN_MAX_BYTES and num_shards(manifest) <= VERIFY_ON_OPEN_MAX_SHARDS


def check_files(store_dir: Path, manifest: dict[str, Any], checksums: bool | None = None) -> bool:
    """Refuse a store whose files are not what its manifest promises (``damage_error``). ``checksums``: None hashes
    every file of a small store (``verify_on_open``). Otherwise a format-1 store has every file's size checked here; a
    format-2 one nothing (each shard file's size is checked when it is first mapped: O(1) per rank at open). Whether
    the checksums were verified."""
    if checksums is None:
        checksums = verify_on_open(manifest)
    if not checksums and is_indexed(manifest):
        return False
    problems = damaged_files(store_dir, manifest, checksums)
    if problems:
        raise damage_error(store_dir, problems)
    return checksums


# ---- pretrain-prepare-data --verify: every file hashed, in parallel and resumably -------------------------------


def _read_verified(path: Path) -> dict[str, dict[str, list]]:
    """verified.jsonl: per shard, the last entry (its files' size, mtime_ns and SHA-256 when hashed). A line cut short
    by a kill is ignored."""
    entries: dict[str, dict[str, list]] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return entries
    for line in lines:
        try:
            entry = json.loads(line)
            entries[entry["shard"]] = entry["files"]
        except (ValueError, KeyError, TypeError):
            continue
    return entries


def _unchanged(shards_dir: Path, record: dict[str, Any], verified: dict[str, list] | None) -> bool:
    """Whether every file of the shard is as it was when verified: the same size and mtime, and the record's
    SHA-256 the one verified (a rebuilt shard is hashed again)."""
    if verified is None:
        return False
    for split in SPLITS:
        for name, size, digest in _split_files(record[split]):
            entry = verified.get(name)
            try:
                st = (shards_dir / name).stat()
            except OSError:
                return False
            if entry != [st.st_size, st.st_mtime_ns, digest] or st.st_size != size:
                return False
    return True


def _verify_shard(args: tuple[str, dict[str, Any]]) -> tuple[str, list[str], dict[str, list]]:
    """One shard hashed (a worker's task): (its name, its problems, each file's [size, mtime_ns, SHA-256])."""
    shards_dir, record = Path(args[0]), args[1]
    stats: dict[str, tuple[int, int]] = {}
    problems = shard_problems(shards_dir, record, checksums=True, stats=stats)
    digests = {name: digest for split in SPLITS for name, _, digest in _split_files(record[split])}
    return record["name"], problems, {name: [*stat, digests[name]] for name, stat in stats.items()}


def _init_verify_worker() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops the pool; what was recorded stays
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@dataclass
class Verified:
    """What ``verify_store`` did: shards hashed now, shards skipped (unchanged since verified.jsonl), bytes hashed."""

    hashed: int
    skipped: int
    num_bytes: int


def verify_store(store_dir: Path, manifest: dict[str, Any], workers: int = 1, log=print) -> Verified:
    """Every shard file's size and SHA-256 against its record, ``workers`` processes hashing one shard each; the index
    files against the manifest and the records' counts against the index. Resumable: each intact shard is appended to
    ``<store>/verified.jsonl`` as it is done (one line, one write, with its files' size, mtime and SHA-256), and a
    later --verify hashes only the shards not recorded there or whose files changed since. A damaged store is one
    DataError naming the files (``damage_error``); its damaged shards are not recorded."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    start = time.perf_counter()
    shards_dir = store_dir / "shards"
    records = list(shard_records(store_dir, manifest))
    problems: list[str] = []
    if is_indexed(manifest):
        for split in SPLITS:
            index = load_index(store_dir, manifest, split)
            tokens = np.diff(index["tokens"].astype(np.int64), prepend=0)
            documents = np.diff(index["documents"].astype(np.int64), prepend=0)
            for k, record in enumerate(records):
                if (record[split]["num_tokens"], record[split]["num_documents"]) != (tokens[k], documents[k]):
                    problems.append(f"{record_path(store_dir, k)}: its {split} split records "
                                    f"{record[split]['num_tokens']:,} tokens in {record[split]['num_documents']:,} "
                                    f"documents, the index {tokens[k]:,} in {documents[k]:,}")
    log_path = store_dir / VERIFIED
    done = _read_verified(log_path)
    todo = [r for r in records if not _unchanged(shards_dir, r, done.get(r["name"]))]
    skipped = len(records) - len(todo)
    if skipped:
        log(f"data: verify: {skipped} of {len(records)} shard(s) unchanged since verified ({log_path}); hashing "
            f"{len(todo)}")
    hashed_bytes = sum(size for r in todo for split in SPLITS for _, size, _ in _split_files(r[split]))
    tasks = [(str(shards_dir), r) for r in todo]
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if todo else None
    if fd is not None and os.fstat(fd).st_size and not log_path.read_bytes().endswith(b"\n"):
        os.write(fd, b"\n")  # a line cut short by a kill ends here: the next one is whole

    def record_result(name: str, found: list[str], files: dict[str, list]) -> None:
        if found:
            problems.extend(found)
        else:  # one write of one line: appended whole (O_APPEND), or cut short by a kill and ignored when read
            os.write(fd, (json.dumps({"shard": name, "files": files}, sort_keys=True) + "\n").encode())

    try:
        if workers <= 1 or len(tasks) <= 1:
            for task in tasks:
                record_result(*_verify_shard(task))
        else:
            # forkserver, not fork: a fork of a process with threads (torch's, a test runner's) can deadlock in the
            # child; and a worker that dies (killed, out of memory) is an error here, where multiprocessing.Pool
            # would wait for its result forever
            pool = ProcessPoolExecutor(min(workers, len(tasks)), mp_context=multiprocessing.get_context("forkserver"),
                                       initializer=_init_verify_worker)
            try:
                for future in as_completed([pool.submit(_verify_shard, task) for task in tasks]):
                    record_result(*future.result())
            except BrokenProcessPool:
                raise DataError(f"data: verify: a worker process of the verification of {store_dir} died (killed, or "
                                f"out of memory); the shards verified so far are recorded in {log_path}: run --verify "
                                f"again to hash the rest (with fewer --workers if memory ran out)") from None
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
    finally:
        if fd is not None:
            os.close(fd)
    if problems:
        raise damage_error(store_dir, problems)
    seconds = time.perf_counter() - start
    log(f"data: verified the token store at {store_dir}: {len(records)} shard(s), {len(todo)} hashed "
        f"({hashed_bytes / 2**30:.2f} GiB in {seconds:.1f}s with {max(1, min(workers, len(tasks)))} process(es)), "
        f"{skipped} unchanged since verified")
    return Verified(len(todo), skipped, hashed_bytes)


class ShardFiles:
    """A split's token files, one per shard in shard order, named on demand (a format-2 store's 100,000 shards are not
    100,000 Path objects per rank): ``files[k]`` is shards/NNNNN.SPLIT.ds."""

    def __init__(self, shards_dir: Path, split: str, count: int):
        self.shards_dir, self.split, self.count = shards_dir, split, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, k: int) -> Path:
        if not -self.count <= k < self.count:
            raise IndexError(f"shard {k} of {self.count}")
        return self.shards_dir / f"{shard_name(k % self.count)}.{self.split}.ds"

    def __iter__(self):
        return (self[k] for k in range(self.count))


class ShardOrigins:
    """Where each shard's documents of a split came from (provenance): its record's inputs and origin runs, read from
    shards/NNNNN.json when first asked for (a few kept), with the shard's first row of an hf: stream from the index."""

    KEEP = 64

    def __init__(self, store_dir: Path, split: str, first_rows: np.ndarray, recorded: bool):
        self.store_dir, self.split, self.first_rows = store_dir, split, first_rows
        self.recorded = recorded  # every shard has origins (the index's origin widths)
        self._cache: OrderedDict[int, dict[str, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.first_rows)

    def __getitem__(self, k: int) -> dict[str, Any]:
        k = range(len(self))[k]
        info = self._cache.get(k)
        if info is None:
            record = read_record(self.store_dir, k)
            info = {"inputs": record["inputs"], "origin": record[self.split].get("origin"),
                    "first_row": int(self.first_rows[k])}
            self._cache[k] = info
            if len(self._cache) > self.KEEP:
                self._cache.popitem(last=False)
        return info

    def __iter__(self):
        return (self[k] for k in range(len(self)))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": OrderedDict()}


class TokenRows:
    """Rows of ``row_len`` tokens cut from one split's token stream: row i is tokens [i x row_len,
    (i+1) x row_len) of its shards' files concatenated in order. Indexing returns int64 arrays.

    ``files[k]`` is shard k's file (a list, or a store's ShardFiles) and ``offsets`` the cumulative token counts from
    0 (one entry more than the shards); a shard may be empty (its file is then never mapped)."""

    def __init__(self, files, num_tokens, dtype: np.dtype, row_len: int, limit: int = 0,
                 vocab_size: int = 0, shards=None, provenance: dict[str, Any] | None = None,
                 documents: np.ndarray | None = None, first_rows: np.ndarray | None = None):
        self.vocab_size = vocab_size  # > 0: a token id at or above it is refused (not an IndexError in the embedding)
        self.files = files
        # Where each file's documents came from (pretrain/data/provenance.py): its shard's inputs, the split's origin
        # record (None: built before provenance was recorded) and, for hf:, the shard's first row of the dataset.
        self.shards = shards if shards is not None else [None] * len(files)
        self.provenance = provenance  # the manifest's: the source root, or the hf: dataset, config and split
        self.offsets = np.concatenate([[0], np.cumsum(np.asarray(num_tokens, dtype=np.int64), dtype=np.int64)])
        # Cumulative document counts (format 2's index: each shard's .ds.index size is checked against them when
        # provenance maps it) and each shard's first row of an hf: stream; None when not known.
        self.documents = documents
        self.first_rows = first_rows
        self.dtype, self.row_len = np.dtype(dtype), row_len
        num_rows = int(self.offsets[-1]) // row_len
        self.num_rows = min(num_rows, limit) if limit else num_rows
        self._open: OrderedDict[int, np.ndarray] = OrderedDict()

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_rows, self.row_len)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def size(self) -> int:
        return self.num_rows * self.row_len

    def __len__(self) -> int:
        return self.num_rows

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers get the file list, not the parent's memory maps.
        return {**self.__dict__, "_open": OrderedDict()}

    def _shard(self, index: int) -> np.ndarray:
        tokens = self._open.get(index)
        if tokens is None:
            tokens = self._map(index)
            self._open[index] = tokens
            if len(self._open) > MAX_OPEN_SHARDS:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(index)
        return tokens

    def _map(self, index: int) -> np.ndarray:
        """A shard's memory map, checked against the token count the store's manifest records (the stat is
        free: mapping needs the size anyway). A truncated file is one DataError naming the rebuild."""
        path, expected = self.files[index], int(self.offsets[index + 1] - self.offsets[index])
        try:
            found = path.stat().st_size // self.dtype.itemsize
        except OSError as exc:
            found, reason = 0, exc.strerror
        else:
            reason = f"{found:,} tokens, the manifest records {expected:,}"
        if found != expected:
            store = path.parent.parent
            raise DataError(
                f"data: the token store at {store} is damaged: {path} ({reason}). Rebuild the damaged shard: "
                f"delete {store / MANIFEST} and prepare the store again (the same run command on one node, or "
                "pretrain-prepare-data with the same recipe); intact shards are kept"
            )
        return np.memmap(path, dtype=self.dtype, mode="r")

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split's stream as int64."""
        out = np.empty(stop - start, dtype=np.int64)
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        filled = 0
        while filled < len(out):
            begin = start + filled - int(self.offsets[shard])
            take = min(len(out) - filled, int(self.offsets[shard + 1]) - start - filled)
            if take == 0:  # an empty shard of this split: nothing to map
                shard += 1
                continue
            out[filled : filled + take] = self._shard(shard)[begin : begin + take]
            if self.vocab_size and take and int(out[filled : filled + take].max()) >= self.vocab_size:
                self._out_of_vocabulary(shard, begin, out[filled : filled + take])
            filled += take
            shard += 1
        return out

    def _out_of_vocabulary(self, shard: int, begin: int, tokens: np.ndarray):
        # A max over the row on the loader's CPU (row_len integers): nothing next to the step it feeds.
        at = int(np.argmax(tokens >= self.vocab_size))
        store = self.files[shard].parent.parent
        raise DataError(
            f"data: the token store at {store} holds token id {int(tokens[at]):,} at token {begin + at:,} of "
            f"{self.files[shard]}, outside its tokenizer's vocabulary of {self.vocab_size:,} ids: the file is damaged "
            f"or was not written by this store's tokenizer. Check the store with pretrain-prepare-data --verify "
            f"(same recipe); rebuild it by deleting {store / MANIFEST} and {store / 'shards' / self.files[shard].name.split('.')[0]}.json "
            "and preparing it again"
        )

    def row(self, index: int) -> np.ndarray:
        if not -self.num_rows <= index < self.num_rows:
            raise IndexError(f"row {index} of {self.num_rows}")
        index %= self.num_rows
        return self.tokens(index * self.row_len, (index + 1) * self.row_len)

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, (int, np.integer)):
            return self.row(int(index))
        if isinstance(index, slice):
            index = range(*index.indices(self.num_rows))
        indices = list(np.asarray(index).reshape(-1)) if not isinstance(index, range) else list(index)
        out = np.empty((len(indices), self.row_len), dtype=np.int64)
        for k, i in enumerate(indices):
            out[k] = self.row(int(i))
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        rows = self[:]
        return rows if dtype is None else rows.astype(dtype)


@dataclass
class PackedData:
    """Rows of both splits read from a token store, the tokenizer that made them and the store's counts."""

    train: TokenRows  # [num_train_sequences, seq_len + 1], memory-mapped shard files
    val: TokenRows  # [num_val_sequences, seq_len + 1]
    tokenizer: Any  # transformers.PreTrainedTokenizerFast with eos_token set
    stats: dict[str, Any]  # JSON-serialisable counts and provenance, see pretrain.data.prepare
    identity: dict[str, Any] = field(default_factory=dict)  # store_identity(): what a checkpoint records


# What a store was made from (build.json / the manifest): a resume compares these (pretrain.data.data_changes).
STREAM_FIELDS = ("source", "corpus_fingerprint", "tokenizer", "val_fraction", "text_field", "on_decode_error")


def store_identity(store_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """What determines a store's token stream, small enough for every checkpoint: where it is, what it was made
    from (STREAM_FIELDS, the key), its size, and a digest of every shard file's checksum (``content``: the manifest's
    in format 2, computed from its shard list in format 1; the same digest either way)."""
    return {
        "store": str(store_dir),
        "key": manifest["key"],
        **{k: manifest[k] for k in STREAM_FIELDS if k != "tokenizer"},
        "corpus": manifest["corpus"],
        "tokenizer": {k: manifest["tokenizer"][k] for k in ("name", "identity", "vocab_size")},
        "num_train_tokens": manifest["num_train_tokens"],
        "content": manifest["content"] if is_indexed(manifest) else content_digest(manifest["shards"]),
    }


def split_rows(store_dir: Path, manifest: dict[str, Any], split: str, row_len: int, limit: int = 0,
               index: np.ndarray | None = None) -> TokenRows:
    """A split's rows. Format 2: from its index (``load_index``, or ``index`` given), nothing else read; format 1:
    from the manifest's shard list."""
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    if is_indexed(manifest):
        index = load_index(store_dir, manifest, split) if index is None else index
        first_rows = np.concatenate([[0], index["input_rows"][:-1]]).astype(np.int64)
        files = ShardFiles(store_dir / "shards", split, len(index))
        origins = ShardOrigins(store_dir, split, first_rows, recorded=bool(np.all(index["origin"] > 0)))
        return TokenRows(files, np.diff(index["tokens"].astype(np.int64), prepend=0), dtype, row_len, limit,
                         vocab_size=manifest["tokenizer"]["vocab_size"], shards=origins,
                         provenance=manifest.get("provenance"), documents=index["documents"].astype(np.int64),
                         first_rows=first_rows)
    shards = manifest["shards"]
    files = [store_dir / "shards" / shard[split]["file"] for shard in shards]
    first_rows = np.concatenate([[0], np.cumsum([shard.get("input_rows", 0) for shard in shards])]).astype(np.int64)
    where = [{"inputs": shard["inputs"], "origin": shard[split].get("origin"), "first_row": int(first)}
             for shard, first in zip(shards, first_rows, strict=False)]
    documents = np.cumsum([shard[split]["num_documents"] for shard in shards], dtype=np.int64)
    return TokenRows(files, [shard[split]["num_tokens"] for shard in shards], dtype, row_len, limit,
                     vocab_size=manifest["tokenizer"]["vocab_size"], shards=where,
                     provenance=manifest.get("provenance"), documents=documents, first_rows=first_rows[:-1])
