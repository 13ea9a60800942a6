"""Where a row of a split comes from: in its store (shard file, document, token offsets) and in the corpus (the
input file and line, record or row; for ``hf:``, the dataset's row); and the reverse.

A split's rows are cut from its shards' token files concatenated in order (``TokenRows``: row i is tokens
[i x row_len, (i+1) x row_len) of that stream), and each file's ``.ds.index`` holds its cumulative document
ends. So a row's documents follow from the store alone, with no corpus and no tokenizer: the answer names
what the store holds, which is what a run read. Memory: one memory map of an index file at a time.

The source document (``Origin``) is the store's too: each split file's record lists the runs of documents that came
from one input file (``origin.runs``) and its ``.ds.origin`` file holds each document's line, record or row
(``pretrain/data/store.py``). Both directions are lookups: a document's origin is one read of 4 bytes, and a source
line is found by a binary search in the one run of the one shard that read its file (the manifest names it).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.data.store import TokenRows
from pretrain.errors import DataError

PROVENANCE_VERSION = 1
NO_PROVENANCE = ("was built before pretrain recorded each document's source (no origins in its manifest), so "
                 "documents are named by store coordinates only; to name input files and lines, rebuild it: delete "
                 "{manifest} and run pretrain-prepare-data with the run's recipe (every shard is tokenized again into "
                 "the same tokens; checkpoints and run directories stay valid)")


def provenance_header(corpus, data_cfg) -> dict[str, Any]:
    """The manifest's ``provenance``: what input files are named relative to (local and stdlib sources), or the
    ``hf:`` dataset, config and split a row number refers to."""
    if corpus.kind == "hf":
        return {"version": PROVENANCE_VERSION,
                "hf": {"dataset": corpus.root, "config": data_cfg.hf_config, "split": data_cfg.hf_split}}
    return {"version": PROVENANCE_VERSION, "root": corpus.root}


@dataclass(frozen=True)
class Origin:
    """Where a document came from: its input file (relative to the source's root) and its place there, as the reader
    counted (``readers.UNITS``: a whole file; a line, 1-based; a record or row, 0-based); for ``hf:``, the row of the
    dataset's split (``dataset``, ``config``, ``split``), empty rows counted."""

    file: str  # relative to the source root; hf: the data file the shard streamed ("" when not known)
    unit: str  # file | line | record | row
    index: int  # the line, record or row (0 for a whole file); hf: the row of the split
    path: str = ""  # the input file's absolute path when the store was built (local and stdlib sources)
    dataset: str = ""  # hf: the dataset name, and its config and split
    config: str | None = None
    split: str = ""

    def __str__(self) -> str:
        if self.dataset:
            return f"hf:{self.dataset}:{self.index}"
        return self.file if self.unit == "file" else f"{self.file}:{self.index}"

    def to_dict(self) -> dict[str, Any]:
        if self.dataset:
            return {"dataset": self.dataset, "config": self.config, "split": self.split, "row": self.index,
                    "data_file": self.file}
        return {"file": self.file, **({} if self.unit == "file" else {self.unit: self.index}), "path": self.path}


def _shard_index(rows: TokenRows, file: str) -> int:
    """The shard of split file ``file`` (NNNNN.SPLIT.ds): its number, checked against the split's file of that
    number, in O(1) (a list of every name per lookup made data.exclude O(shards) per document). Files not named by
    number (a TokenRows made of other files) are searched."""
    number = file.split(".", 1)[0]
    if number.isdigit() and int(number) < len(rows.files) and rows.files[int(number)].name == file:
        return int(number)
    if isinstance(rows.files, list):
        for k, path in enumerate(rows.files):
            if path.name == file:
                return k
    names = [rows.files[k].name for k in range(min(4, len(rows.files)))]
    shown = ", ".join(names) + (f", ... ({len(rows.files)} files)" if len(rows.files) > 4 else "")
    raise DataError(f"the split has no file {file!r}; its files are {shown} (the store's shards/ directory)")


def _checked_map(path: Path, dtype: np.dtype, count: int | None) -> np.ndarray:
    """A shard's document index or origins, memory-mapped after its size is checked against ``count`` entries (the
    store's index; None: not known, not checked). A missing or truncated file is one DataError."""
    try:
        size = path.stat().st_size
        if count is not None and size != count * dtype.itemsize:
            raise ValueError(f"{size:,} bytes, the store records {count * dtype.itemsize:,}")
        return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    except (OSError, ValueError) as exc:
        raise DataError(f"data: cannot read {path} ({exc}); the store is damaged: check it with pretrain-prepare-data "
                        "--verify") from None


def _num_documents(rows: TokenRows, shard: int) -> int | None:
    if rows.documents is None:
        return None
    return int(rows.documents[shard]) - (int(rows.documents[shard - 1]) if shard else 0)


def _locators(rows: TokenRows, shard: int) -> np.ndarray:
    origin = rows.shards[shard]["origin"]
    return _checked_map(Path(f"{rows.files[shard]}.origin"), np.dtype(origin["dtype"]), _num_documents(rows, shard))


def has_provenance(rows: TokenRows) -> bool:
    """Whether the store records its documents' sources (every shard of a store built since it did). A format-2
    store answers from its index (every shard's origin width), without reading a record."""
    recorded = getattr(rows.shards, "recorded", None)
    if recorded is not None:
        return recorded
    return all(shard is not None and shard["origin"] is not None for shard in rows.shards)


def _origin(rows: TokenRows, shard: int, document: int, locators: np.ndarray) -> Origin:
    info = rows.shards[shard]
    runs = info["origin"]["runs"]
    run = int(np.searchsorted([r[0] for r in runs], document, side="right")) - 1
    _, source, unit = runs[run]
    locator = int(locators[document])
    where = rows.provenance or {}
    hf = where.get("hf")
    entry = info["inputs"][source]
    if hf:  # an hf: shard's one input: ["hf", data file, index, count]
        return Origin(entry[1], "row", info["first_row"] + locator, "", hf["dataset"], hf["config"], hf["split"])
    path = entry[0]
    root = where.get("root", "")
    inside = root and (path == root or path.startswith(root.rstrip(os.sep) + os.sep))
    return Origin(os.path.relpath(path, root) if inside else path, unit, locator, path)


def document_origin(rows: TokenRows, file: str, document: int) -> Origin | None:
    """The source of document ``document`` of split file ``file``; None for a store built before provenance was
    recorded (``NO_PROVENANCE`` says how to rebuild it)."""
    shard = _shard_index(rows, file)
    if rows.shards[shard] is None or rows.shards[shard]["origin"] is None:
        return None
    return _origin(rows, shard, document, _locators(rows, shard))


def find_source_document(rows: TokenRows, file: str, index: int | None) -> tuple[str, int] | None:
    """(split file, document index) of the document read from input ``file`` at line / record / row ``index`` (None:
    a whole text file; hf: ``file`` is "" and ``index`` the row of the split), or None when this split holds no such
    document. ``file`` matches an input by its name relative to the source root or its absolute path. A lookup: the
    manifest's inputs name the shard, a binary search in that run's locators finds the document."""
    root = (rows.provenance or {}).get("root", "")
    hf = bool((rows.provenance or {}).get("hf"))
    shards = range(len(rows.files))
    if hf:  # the one shard whose rows hold it: the last that starts at or before it
        if index is None:
            return None
        if rows.first_rows is not None:
            at = int(np.searchsorted(rows.first_rows, index, side="right")) - 1
        else:
            starts = [info["first_row"] if info is not None else -1 for info in rows.shards]
            at = bisect.bisect_right(starts, index) - 1
        shards = shards[at:at + 1] if at >= 0 else []
    for shard in shards:
        info = rows.shards[shard]
        if info is None or info["origin"] is None:
            continue
        if hf:
            wanted, source = index - info["first_row"], 0
        else:
            names = [entry[0] for entry in info["inputs"]]
            matches = [k for k, name in enumerate(names)
                       if name == file or (root and os.path.relpath(name, root) == os.path.normpath(file))]
            if not matches:
                continue
            source, wanted = matches[0], 0 if index is None else index
        runs = info["origin"]["runs"]
        locators = _locators(rows, shard)
        for k, (first, run_source, unit) in enumerate(runs):
            if run_source != source:
                continue
            stop = runs[k + 1][0] if k + 1 < len(runs) else len(locators)
            found = first + int(np.searchsorted(locators[first:stop], wanted))
            if found < stop and int(locators[found]) == wanted and (index is not None or unit == "file"):
                return rows.files[shard].name, found
    return None


@dataclass(frozen=True)
class Span:
    """The part of one document a row holds: tokens [start, stop) of document ``document`` of ``file``."""

    file: str  # the shard file's name in the store's shards/ directory, e.g. 00000.train.ds
    document: int  # the document's index within that file (0-based, the .ds.index order)
    start: int  # token offsets within the document, stop exclusive
    stop: int
    document_tokens: int  # the document's length (its eos included)
    origin: Origin | None = None  # the source document (None: a store built before provenance was recorded)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["origin"] = self.origin.to_dict() if self.origin is not None else None
        return out


def _document_ends(rows: TokenRows, shard: int) -> np.ndarray:
    return _checked_map(Path(f"{rows.files[shard]}.index"), np.dtype("<u8"), _num_documents(rows, shard))


def stream_spans(rows: TokenRows, start: int, stop: int) -> list[Span]:
    """The documents behind tokens [start, stop) of a split's stream, in order."""
    spans = []
    shard = int(np.searchsorted(rows.offsets, start, side="right")) - 1
    position = start
    while position < stop:
        base, end = int(rows.offsets[shard]), int(rows.offsets[shard + 1])
        if end == base:  # an empty shard of this split
            shard += 1
            continue
        ends = _document_ends(rows, shard)
        known = rows.shards[shard] is not None and rows.shards[shard]["origin"] is not None
        locators = _locators(rows, shard) if known else None
        local, local_stop = position - base, min(stop, end) - base
        document = int(np.searchsorted(ends, local, side="right"))
        while local < local_stop:
            begin = int(ends[document - 1]) if document else 0
            doc_end = int(ends[document])
            take = min(doc_end, local_stop)
            origin = _origin(rows, shard, document, locators) if known else None
            spans.append(Span(rows.files[shard].name, document, local - begin, take - begin, doc_end - begin, origin))
            local, document = take, document + 1
        position = min(stop, end)
        shard += 1
    return spans


def row_spans(rows: TokenRows, index: int) -> list[Span]:
    """The documents row ``index`` of a split holds (a packed row usually spans several)."""
    if not 0 <= index < len(rows):
        raise IndexError(f"row {index} of {len(rows)}")
    return stream_spans(rows, index * rows.row_len, (index + 1) * rows.row_len)


def document_rows(rows: TokenRows, file: str, document: int) -> range:
    """The rows of a split that hold any token of ``document`` of ``file`` (empty: its tokens lie in the tail
    beyond the last whole row, or beyond data.train_subset, and are never read). An unknown file or index is one
    DataError naming what the split holds."""
    return documents_rows(rows, file, [document])[0]


def documents_rows(rows: TokenRows, file: str, documents: list[int]) -> list[range]:
    """``document_rows`` of several documents of one split file: the shard found by its number (O(1)), its document
    index mapped once (its size checked against the store's index) and each document's rows computed from it."""
    shard = _shard_index(rows, file)
    ends = _document_ends(rows, shard)
    base = int(rows.offsets[shard])
    out = []
    for document in documents:
        if not 0 <= document < len(ends):
            raise DataError(f"{file} holds documents 0..{len(ends) - 1}; there is no document {document}")
        start, stop = base + (int(ends[document - 1]) if document else 0), base + int(ends[document])
        out.append(range(start // rows.row_len, min(-(-stop // rows.row_len), len(rows))))
    return out
