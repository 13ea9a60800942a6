"""The documents in one file: a text file is one document; a jsonl line, JSON record or parquet row is one.
Non-UTF-8 bytes are replaced or the document skipped, as data.on_decode_error says.

Each reader yields ``(unit, locator, text, had_bad_bytes)``: where the document sits in its file, as a person opens
it (``UNITS``): the file itself (a text file), a line (1-based, as editors and ``sed -n`` count), a record of a JSON
list or a row of a parquet file (0-based, as Python, pandas and pyarrow index them). The token store keeps them
(``pretrain/data/provenance.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pretrain.errors import DataError

UNITS = ("file", "line", "record", "row")  # a document is a whole file, a jsonl line, a JSON record, a parquet row
Located = tuple[str, int, "str | None", bool]  # (unit, locator, text or None when skipped, had non-UTF-8 bytes)


def _decode(raw: bytes, policy: str) -> tuple[str | None, bool]:
    """(text, had_bad_bytes); text is None when the document is to be skipped."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        if policy == "skip":
            return None, True
        return raw.decode("utf-8", errors="replace"), True


def _clean_surrogates(text: str, policy: str) -> tuple[str | None, bool]:
    """JSON escapes can produce lone surrogates, which are not valid UTF-8 for Arrow or tokenizers."""
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:
        if policy == "skip":
            return None, True
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text), True


def _json_text(obj: Any, field: str, where: str) -> str | None:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with a {field!r} field, got {type(obj).__name__}")
    if field not in obj:
        fields = ", ".join(map(str, list(obj)[:20])) or "none"
        raise DataError(
            f"{where}: no field {field!r} (data.text_field); this record has fields: {fields}. "
            "Set data.text_field to the field that holds the text"
        )
    value = obj[field]
    if value is None:
        return None
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is a {type(value).__name__}, not text")
    return value


def _json_records(path: str, field: str, policy: str) -> Iterator[Located] | None:
    """Documents of a .json file holding one JSON value (a list of records or one record); None if the
    file is JSON lines instead. Non-UTF-8 bytes count once for the whole file; `skip` skips the file."""
    text, bad = _decode(_read_bytes(path), "replace")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            return None
        raise DataError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None

    def records():
        if bad and policy == "skip":
            yield "file", 0, None, True
            return
        for i, obj in enumerate(value if isinstance(value, list) else [value]):
            doc = _json_text(obj, field, f"{path}[{i}]")
            if doc is not None:
                doc, bad_doc = _clean_surrogates(doc, policy)
                yield "record", i, doc, bad_doc or (bad and i == 0)

    return records()


def _jsonl_documents(path: str, field: str, policy: str) -> Iterator[Located]:
    if path.lower().endswith(".json"):
        records = _json_records(path, field, policy)
        if records is not None:
            yield from records
            return
    try:
        f = open(path, "rb")  # streamed, not read whole: a .jsonl file may be larger than memory
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror}); fix its permissions or remove it") from None
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            text, bad = _decode(line, policy)
            if text is None:
                yield "line", lineno, None, True
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}: invalid JSON ({exc.msg}); each line of a .jsonl file must be one JSON object"
                ) from None
            doc = _json_text(obj, field, f"{path}:{lineno}")
            if doc is not None:
                doc, bad_doc = _clean_surrogates(doc, policy)
                yield "line", lineno, doc, bad or bad_doc


def _read_bytes(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror}); fix its permissions or remove it") from None


def _parquet_documents(path: str, field: str, policy: str) -> Iterator[Located]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: not a readable parquet file ({exc})") from None
    columns = parquet.schema_arrow.names
    if field not in columns:
        raise DataError(
            f"{path}: no column {field!r} (data.text_field); the columns are: {', '.join(columns)}. "
            "Set data.text_field to the column that holds the text"
        )
    row = -1
    for batch in parquet.iter_batches(columns=[field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            row += 1
            if value is None:
                continue
            if isinstance(value, bytes):
                yield ("row", row, *_decode(value, policy))
            elif isinstance(value, str):
                yield "row", row, value, False
            else:
                raise DataError(f"{path}: column {field!r} holds {type(value).__name__}, not text")


def located_documents(files: list[tuple[str, str]], text_field: str, on_decode_error: str
                      ) -> Iterator[tuple[int, str, int, str, bool]]:
    """(input index, unit, locator, text, had non-UTF-8 bytes) of every document of these files, in order; a document
    skipped for its bytes comes with text "" so that it can be counted, and empty (whitespace-only) ones not at all."""
    for index, (path, fmt) in enumerate(files):
        if fmt == "text":
            text, bad = _decode(_read_bytes(path), on_decode_error)
            if text is not None and text.startswith("\ufeff"):
                text = text[1:]
            docs: Iterator[Located] = iter([("file", 0, text, bad)])
        elif fmt == "jsonl":
            docs = _jsonl_documents(path, text_field, on_decode_error)
        else:
            docs = _parquet_documents(path, text_field, on_decode_error)
        for unit, locator, text, bad in docs:
            usable = text is not None and bool(text.strip())
            if usable or bad:
                yield index, unit, locator, text if usable else "", bad


def _generate_documents(files: list[tuple[str, str]], text_field: str, on_decode_error: str):
    """Rows of the documents dataset; a skipped document is kept as "" so that it can be counted."""
    num_rows = 0
    for _, _, _, text, bad in located_documents(files, text_field, on_decode_error):
        num_rows += 1
        yield {"text": text, "decode_error": bad}
    if num_rows == 0:  # datasets cannot build an empty split; one "" row is dropped like any empty one
        yield {"text": "", "decode_error": False}
