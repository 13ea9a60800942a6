"""Where a row of a split comes from in its store: shard file, document, token offsets; and the reverse.

A split's rows are cut from its shards' token files concatenated in order (``TokenRows``: row i is tokens
[i x row_len, (i+1) x row_len) of that stream), and each file's ``.ds.index`` holds its cumulative document
ends. So a row's documents follow from the store alone, with no corpus and no tokenizer: the answer names
what the store holds, which is what a run read. Memory: one memory map of an index file at a time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pretrain.data.store import TokenRows
from pretrain.errors import DataError


@dataclass(frozen=True)
class Span:
    """The part of one document a row holds: tokens [start, stop) of document ``document`` of ``file``."""

    file: str  # the shard file's name in the store's shards/ directory, e.g. 00000.train.ds
    document: int  # the document's index within that file (0-based, the .ds.index order)
    start: int  # token offsets within the document, stop exclusive
    stop: int
    document_tokens: int  # the document's length (its eos included)

    def to_dict(self) -> dict:
        return asdict(self)


def _document_ends(rows: TokenRows, shard: int) -> np.ndarray:
    path = Path(f"{rows.files[shard]}.index")
    try:
        return np.memmap(path, dtype="<u8", mode="r")
    except (OSError, ValueError) as exc:
        raise DataError(f"data: cannot read the document index {path} ({exc}); the store is damaged: check it "
                        "with pretrain-prepare-data --verify") from None


def stream_spans(rows: TokenRows, start: int, stop: int) -> list[Span]:
    """The documents behind tokens [start, stop) of a split's stream, in order."""
    spans = []
    shard = int(np.searchsorted(rows.offsets, start, side="right")) - 1
    position = start
    while position < stop:
        base, end = int(rows.offsets[shard]), int(rows.offsets[shard + 1])
        ends = _document_ends(rows, shard)
        local, local_stop = position - base, min(stop, end) - base
        document = int(np.searchsorted(ends, local, side="right"))
        while local < local_stop:
            begin = int(ends[document - 1]) if document else 0
            doc_end = int(ends[document])
            take = min(doc_end, local_stop)
            spans.append(Span(rows.files[shard].name, document, local - begin, take - begin, doc_end - begin))
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
    names = [path.name for path in rows.files]
    if file not in names:
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} files)" if len(names) > 4 else "")
        raise DataError(f"the split has no file {file!r}; its files are {shown} (the store's shards/ directory)")
    shard = names.index(file)
    ends = _document_ends(rows, shard)
    if not 0 <= document < len(ends):
        raise DataError(f"{file} holds documents 0..{len(ends) - 1}; there is no document {document}")
    base = int(rows.offsets[shard])
    start, stop = base + (int(ends[document - 1]) if document else 0), base + int(ends[document])
    return range(start // rows.row_len, min(-(-stop // rows.row_len), len(rows)))
