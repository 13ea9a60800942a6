"""The token store on disk: sharded, memory-mapped token files with document boundaries and a manifest.

    <store>/manifest.json                  written last: a store without it is incomplete
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

Reading keeps O(number of shards) memory: each split is the concatenation of its shards' token files
in shard order, and a row of ``row_len`` tokens is cut from that stream at ``i x row_len`` (a row may
span two shards), memory-mapping a shard file on first use.
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
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BUILD = "build.json"
SPLITS = ("train", "val")
MAX_OPEN_SHARDS = 64  # memory maps each reader keeps open (each holds a file descriptor)
# Opening a store checks every shard file's size against the manifest (a stat each), and, up to this many bytes of
# shard files, every SHA-256 too: 1 GiB hashes in 1.7-2.1 s on one core of a SHA-NI Xeon (README, "A store is
# checked"). A larger store is hashed in full by `pretrain-prepare-data --verify`, once, not by every rank at every
# start (1 TB would be about half an hour per rank).
VERIFY_ON_OPEN_MAX_BYTES = 1 << 30
HASH_CHUNK_BYTES = 8 << 20


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


def store_bytes(manifest: dict[str, Any]) -> int:
    """Bytes of the shard files (tokens, document indexes, origins) the manifest promises."""
    return sum(size for shard in manifest["shards"] for split in SPLITS for _, size, _ in _split_files(shard[split]))


def damaged_files(store_dir: Path, manifest: dict[str, Any], checksums: bool) -> list[str]:
    """What in the store differs from what its manifest promises, one entry per file: missing, another size, or
    (``checksums``) another SHA-256. Empty when intact."""
    shards_dir, problems = store_dir / "shards", []
    for shard in manifest["shards"]:
        for split in SPLITS:
            for name, size, digest in _split_files(shard[split]):
                path = shards_dir / name
                try:
                    found = path.stat().st_size
                except OSError as exc:
                    problems.append(f"{path}: {exc.strerror}")
                    continue
                if found != size:
                    problems.append(f"{path}: {found:,} bytes, the manifest records {size:,}")
                elif checksums and _file_sha256(path) != digest:
                    problems.append(f"{path}: its SHA-256 differs from the manifest's (same size: the contents changed)")
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


def check_files(store_dir: Path, manifest: dict[str, Any], checksums: bool | None = None) -> bool:
    """Refuse a store whose files are not what its manifest promises (``damage_error``). ``checksums``: None
    hashes every file when the store is at most VERIFY_ON_OPEN_MAX_BYTES (else sizes only). Whether the
    checksums were verified."""
    if checksums is None:
        checksums = store_bytes(manifest) <= VERIFY_ON_OPEN_MAX_BYTES
    problems = damaged_files(store_dir, manifest, checksums)
    if problems:
        raise damage_error(store_dir, problems)
    return checksums


class TokenRows:
    """Rows of ``row_len`` tokens cut from one split's token stream: row i is tokens [i x row_len,
    (i+1) x row_len) of its shards' files concatenated in order. Indexing returns int64 arrays."""

    def __init__(self, files: list[Path], num_tokens: list[int], dtype: np.dtype, row_len: int, limit: int = 0,
                 vocab_size: int = 0, shards: list[dict[str, Any]] | None = None,
                 provenance: dict[str, Any] | None = None):
        self.vocab_size = vocab_size  # > 0: a token id at or above it is refused (not an IndexError in the embedding)
        keep = [i for i, n in enumerate(num_tokens) if n > 0]
        self.files = [files[i] for i in keep]
        # Where each file's documents came from (pretrain/data/provenance.py): its shard's inputs, the split's origin
        # record (None: built before provenance was recorded) and, for hf:, the shard's first row of the dataset.
        self.shards = [shards[i] for i in keep] if shards is not None else [None] * len(keep)
        self.provenance = provenance  # the manifest's: the source root, or the hf: dataset, config and split
        self.offsets = np.concatenate([[0], np.cumsum([num_tokens[i] for i in keep], dtype=np.int64)])
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
    from (STREAM_FIELDS, the key), its size, and a digest of every shard file's checksum (``content``)."""
    checksums = [[shard[split]["sha256"], shard[split]["index_sha256"]] for shard in manifest["shards"]
                 for split in SPLITS]
    return {
        "store": str(store_dir),
        "key": manifest["key"],
        **{k: manifest[k] for k in STREAM_FIELDS if k != "tokenizer"},
        "corpus": manifest["corpus"],
        "tokenizer": {k: manifest["tokenizer"][k] for k in ("name", "identity", "vocab_size")},
        "num_train_tokens": manifest["num_train_tokens"],
        "content": hashlib.sha256(json.dumps(checksums).encode()).hexdigest()[:16],
    }


def split_rows(store_dir: Path, manifest: dict[str, Any], split: str, row_len: int, limit: int = 0) -> TokenRows:
    shards = manifest["shards"]
    files = [store_dir / "shards" / shard[split]["file"] for shard in shards]
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    first_rows = np.concatenate([[0], np.cumsum([shard.get("input_rows", 0) for shard in shards])]).tolist()
    where = [{"inputs": shard["inputs"], "origin": shard[split].get("origin"), "first_row": first}
             for shard, first in zip(shards, first_rows, strict=False)]
    return TokenRows(files, [shard[split]["num_tokens"] for shard in shards], dtype, row_len, limit,
                     vocab_size=manifest["tokenizer"]["vocab_size"], shards=where,
                     provenance=manifest.get("provenance"))
