"""Quarantined documents: ``output_dir/quarantine.json``, what ``data.exclude`` leaves out of a stream, and the edits
of ``pretrain-data quarantine``.

A document is named in store coordinates: its source (a mixture source's name, or "data"), its split file in the
store's shards/ directory and its index there (``SOURCE:FILE:INDEX``, as ``pretrain-data which`` prints them), with
the identity of that source's store (``content``: the digest of every shard file's checksum) so that a later run can
tell the same store from another. A ``stability.rollback.skip: documents`` rollback adds the documents it
quarantines (with its number, their loss per token on the window and the tokens scored); a person adds or removes
entries with ``pretrain-data quarantine``. Every write replaces the file atomically (a reader never sees half).

``data.exclude`` reads lists (files, or run directories holding one) into the global sample indices of the rows that
hold any token of a listed document of this run's stores (``resolve_exclude``); the loader leaves those rows out from
step 0 (``loader.Quarantine``). What was resolved is the run's (the rollback part's state): a resume reads it from
its checkpoint, not from lists edited since.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.data import MixtureData, PackedData
from pretrain.data.mixture import SINGLE
from pretrain.data.provenance import document_origin, document_rows, documents_rows
from pretrain.errors import ConfigError, DataError

QUARANTINE_FILE = "quarantine.json"
VERSION = 1
FIX = ("a quarantine list is what stability.rollback.skip=documents writes (output_dir/quarantine.json); restore it, "
       "or edit it with pretrain-data quarantine")


def write_json_atomic(path: Path, obj: Any) -> None:
    """``obj`` as JSON at ``path``: written to a temporary name, made durable, then renamed over it."""
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(json.dumps(obj, indent=1) + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def list_path(where: str | Path) -> Path:
    """A quarantine list's file: ``where`` itself, or ``where/quarantine.json`` for a directory."""
    where = Path(where)
    return where / QUARANTINE_FILE if where.is_dir() else where


def key(entry: dict[str, Any]) -> str:
    return f"{entry['source']}:{entry['file']}:{entry['document']}"


def _entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return f"an entry is a {type(entry).__name__}, not a document"
    for name, kind in (("source", str), ("file", str), ("document", int)):
        if not isinstance(entry.get(name), kind) or isinstance(entry.get(name), bool):
            return f"an entry's {name} is {entry.get(name)!r}"
    if entry["document"] < 0:
        return f"an entry's document is {entry['document']}"
    store = entry.get("store")
    if not (isinstance(store, dict) and isinstance(store.get("content"), str)):
        return f"{key(entry)} names no store identity (store.content)"
    return None


def read_list(where: str | Path, missing_ok: bool = False) -> dict[str, Any]:
    """A quarantine list, checked; one ConfigError naming the file and the fix when it cannot be read. ``missing_ok``:
    an absent file is an empty list (a run that has quarantined nothing yet)."""
    path = list_path(where)
    if missing_ok and not path.exists():
        return {"version": VERSION, "documents": []}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no quarantine list at {path}: pass a quarantine.json, or the run directory of a run "
                          "that holds one") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the quarantine list {path} ({exc}); {FIX}") from None
    documents = data.get("documents") if isinstance(data, dict) else None
    if not isinstance(documents, list):
        raise ConfigError(f"{path} is not a quarantine list (no documents list); {FIX}")
    for entry in documents:
        problem = _entry_problem(entry)
        if problem:
            raise ConfigError(f"{path}: {problem}; {FIX}")
    return data


def write_list(where: str | Path, data: dict[str, Any]) -> None:
    write_json_atomic(list_path(where), data)


def source_parts(data: PackedData | MixtureData) -> tuple[list[str], list, np.ndarray, list[dict[str, Any]]]:
    """(Source names, their training rows, their offsets in the global sample index, their store identities)."""
    if isinstance(data, MixtureData):
        names = data.train.names
        return (names, data.train.parts, data.train.offsets,
                [data.sources[name].identity for name in names])
    return [SINGLE], [data.train], np.array([0, len(data.train)], dtype=np.int64), [data.identity]


def store_of(identity: dict[str, Any]) -> dict[str, Any]:
    """What a list keeps of a store's identity: enough to tell it from another (``content``) and to name it."""
    return {"content": identity.get("content"), "key": identity.get("key"), "store": identity.get("store")}


def document_samples(data: PackedData | MixtureData, source: str, file: str, document: int) -> np.ndarray:
    """The global sample indices of the training rows that hold any token of the document (DataError: no such
    document)."""

    names, parts, offsets, _ = source_parts(data)
    if source not in names:
        raise DataError(f"the run has no source {source!r}; its sources are {', '.join(names)}")
    part = names.index(source)
    rows = document_rows(parts[part], file, document)
    return np.arange(rows.start, rows.stop, dtype=np.int64) + int(offsets[part])


def _file_samples(data: PackedData | MixtureData, source: str, file: str, documents: list[int]) -> list[np.ndarray]:
    """``document_samples`` of several documents of one split file: its shard found by number and its document index
    mapped once (``provenance.documents_rows``), whatever the number of shards."""
    names, parts, offsets, _ = source_parts(data)
    part = names.index(source)
    return [np.arange(rows.start, rows.stop, dtype=np.int64) + int(offsets[part])
            for rows in documents_rows(parts[part], file, documents)]


def origin(data: PackedData | MixtureData, source: str, file: str, document: int) -> dict[str, Any] | None:
    """The document's source (``provenance.document_origin``: its input file and line, record or row, with ``name``,
    the form ``pretrain-data which --document`` takes); None where the store does not record it."""
    names, parts, _, _ = source_parts(data)
    found = document_origin(parts[names.index(source)], file, document)
    return None if found is None else {"name": str(found), **found.to_dict()}


def entry(data: PackedData | MixtureData, source: str, file: str, document: int, **fields: Any) -> dict[str, Any]:
    """One list entry for a document of this run's data; ``fields``: rollback, loss_per_token, tokens, added."""
    names, _, _, identities = source_parts(data)
    return {"source": source, "file": file, "document": int(document),
            "store": store_of(identities[names.index(source)]), **fields,
            "origin": origin(data, source, file, document)}


def add_entries(where: str | Path, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ``entries`` to the list at ``where`` (created if absent), those already listed left as they are; the
    entries added."""
    data = read_list(where, missing_ok=True)
    listed = {(key(e), e["store"]["content"]) for e in data["documents"]}
    added = [e for e in entries if (key(e), e["store"]["content"]) not in listed]
    if added:
        data["documents"] = [*data["documents"], *added]
        data["version"] = VERSION
        write_list(where, data)
    return added


def parse_document(text: str) -> tuple[str, str, int]:
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[0] or not parts[2].isdigit():
        raise ConfigError(f"{text!r}: expected SOURCE:FILE:INDEX, e.g. data:00000.train.ds:12 (as `pretrain-data "
                          "which` prints them; a single source is named 'data')")
    return parts[0], parts[1], int(parts[2])


def resolve_exclude(paths: list[str], data: PackedData | MixtureData, log) -> dict[str, Any] | None:
    """``data.exclude``: the documents its lists name that belong to this run's stores, and the global sample
    indices of their rows; None when there is no list. A list that cannot be read is one ConfigError (exit 2,
    before training); documents of other stores are ignored with one line."""
    if not paths:
        return None
    names, _, _, identities = source_parts(data)
    by_content = {identity.get("content"): name for name, identity in zip(names, identities, strict=True)}
    documents, foreign = [], 0
    seen = set()
    by_file: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = {}  # one map of each split file's index
    for path in paths:
        for item in read_list(path)["documents"]:
            source = by_content.get(item["store"]["content"])
            if source is None or source != item["source"]:
                foreign += 1
                continue
            if key(item) in seen:
                continue
            seen.add(key(item))
            by_file.setdefault((source, item["file"]), []).append((path, item))
            documents.append({"source": source, "file": item["file"], "document": item["document"]})
    found = []
    for (source, file), group in by_file.items():
        try:
            found += _file_samples(data, source, file, [item["document"] for _, item in group])
        except DataError:
            for path, item in group:  # the first listed document that is not there, named
                try:
                    document_samples(data, source, file, item["document"])
                except DataError as exc:
                    raise ConfigError(f"data.exclude: {list_path(path)}: {key(item)}: {exc}; {FIX}") from None
            raise
    samples = np.unique(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)
    if foreign:
        log(f"data.exclude: {foreign} listed document(s) of other stores ignored (their store's content differs "
            "from this run's)")
    log(f"data.exclude: {len(documents)} document(s) left out from step 0 ({len(samples)} training rows), from "
        f"{', '.join(str(list_path(p)) for p in paths)}")
    return {"lists": [str(list_path(p)) for p in paths], "documents": documents,
            "samples": samples.tolist()}
