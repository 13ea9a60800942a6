"""Issue 37: the token store records every document's source (input file and line, record or row; an hf: dataset's
row), compactly and under its checksums, and both directions are lookups."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pretrain.data import open_store, prepare_data
from pretrain.data.provenance import document_origin, find_source_document, has_provenance
from pretrain.data.store import MANIFEST
from pretrain.errors import DataError
from tests.data.test_data import make_docs
from tests.data.test_store import full_manifest, legacy_manifest, store_config


def documents(rows, manifest: dict, split: str):
    """Every document of a split: (split file, index, its tokens without the eos)."""
    for shard in manifest["shards"]:
        record = shard[split]
        path = next(p for p in rows.files if p.name == record["file"]) if record["num_tokens"] else None
        if path is None:
            continue
        tokens = np.fromfile(path, dtype="<u2")
        ends = np.fromfile(f"{path}.index", dtype="<u8")
        for index, end in enumerate(ends):
            begin = int(ends[index - 1]) if index else 0
            yield record["file"], index, tokens[begin:int(end) - 1].tolist()


def opened(source_text, store: Path, manifest: dict, data, tokenizer) -> int:
    """Checks every document of both splits against the text its origin names; the number checked."""
    checked = 0
    for split, rows in (("train", data.train), ("val", data.val)):
        for file, index, tokens in documents(rows, manifest, split):
            origin = document_origin(rows, file, index)
            assert tokenizer.decode(tokens) == source_text(origin), (split, file, index, origin)
            # and the reverse: the source form finds the same document, in this split and not the other
            located = None if origin.unit == "file" else origin.index
            name = "" if origin.dataset else origin.file
            assert find_source_document(rows, name, located) == (file, index)
            checked += 1
    return checked


def test_every_document_names_its_input_file_and_line_record_or_row(tmp_path):
    """A directory of jsonl (blank lines and text-less records among them), a JSON list, a parquet file (null rows)
    and text files: the store names each document as a person opens it, and the names find them again."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_docs(80, seed=37, words=20)
    corpus = tmp_path / "corpus"
    (corpus / "web").mkdir(parents=True)
    lines = []
    for i, doc in enumerate(docs[:40]):
        lines.append(json.dumps({"text": doc}))
        if i % 9 == 4:
            lines += ["", json.dumps({"text": None}), json.dumps({"text": "   "})]  # no document, still counted
    (corpus / "web" / "pages.jsonl").write_text("\n".join(lines) + "\n")
    (corpus / "records.json").write_text(json.dumps([{"text": d} for d in docs[40:55]]))
    pq.write_table(pa.table({"text": [d if i % 4 else None for i, d in enumerate(docs[55:75])]}),
                   corpus / "table.parquet")
    for i, doc in enumerate(docs[75:]):
        (corpus / "web" / f"note-{i}.txt").write_text(doc)
    store = tmp_path / "store"
    data = prepare_data(store_config(tmp_path, corpus, store), log=lambda _: None, num_workers=2)
    manifest = full_manifest(store)
    assert manifest["provenance"] == {"version": 1, "root": str(corpus)}

    def source_text(origin) -> str:
        path = corpus / origin.file
        assert origin.path == str(path)
        if origin.unit == "line":
            return json.loads(path.read_text().splitlines()[origin.index - 1])["text"]
        if origin.unit == "record":
            return json.loads(path.read_text())[origin.index]["text"]
        if origin.unit == "row":
            return pq.read_table(path).column("text")[origin.index].as_py()
        assert origin.unit == "file" and origin.index == 0
        return path.read_text()

    assert opened(source_text, store, manifest, data, data.tokenizer) == 40 + 15 + 15 + 5
    units = {run[2] for s in manifest["shards"] for o in (s["train"]["origin"], s["val"]["origin"])
             for run in o["runs"]}
    assert units == {"file", "line", "record", "row"}
    # Compact: one run per input file of a shard's split, 4 bytes per document
    assert all(len(s["train"]["origin"]["runs"]) <= len(s["inputs"]) for s in manifest["shards"])
    origin_bytes = sum(p.stat().st_size for p in (store / "shards").glob("*.ds.origin"))
    assert origin_bytes == 4 * manifest["num_documents"]
    assert find_source_document(data.train, "web/pages.jsonl", 6) is None  # the blank line after doc 4
    assert find_source_document(data.train, "nope.jsonl", 1) is None

    # Under the checksums: an origin file changed at the same size is refused when the store is opened
    origin_file = next(p for p in sorted((store / "shards").glob("*.train.ds.origin")) if p.stat().st_size)
    changed = bytearray(origin_file.read_bytes())
    changed[0] ^= 0x01
    origin_file.write_bytes(bytes(changed))
    with pytest.raises(DataError, match=rf"{origin_file.name}: its SHA-256 differs"):
        open_store(store_config(tmp_path, corpus, store), log=lambda _: None)


def test_a_store_built_before_provenance_trains_and_says_how_to_name_sources(tmp_path):
    """A store whose manifest predates provenance opens and reads the same rows; its documents have no origin, and a
    rebuild (delete the manifest, prepare again) tokenizes every shard anew into the same tokens, with origins."""
    from pretrain.data.lookup import RunData

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in make_docs(30, seed=5)))
    store = tmp_path / "store"
    cfg = store_config(tmp_path, corpus, store)
    new = prepare_data(cfg, log=lambda _: None, num_workers=1)
    manifest = json.loads((store / MANIFEST).read_text())
    old = {k: v for k, v in legacy_manifest(store).items() if k != "provenance"}  # a format-1 store's
    for shard in old["shards"]:
        for split in ("train", "val"):
            shard[split].pop("origin")
            (store / "shards" / f"{shard[split]['file']}.origin").unlink()
    (store / MANIFEST).write_text(json.dumps(old))
    for record in (store / "shards").glob("*.json"):
        data = json.loads(record.read_text())
        for split in ("train", "val"):
            data[split].pop("origin")
        record.write_text(json.dumps(data))

    before = open_store(cfg, log=lambda _: None)
    assert not has_provenance(before.train) and has_provenance(new.train)
    assert np.array_equal(before.train[:], new.train[:])
    assert document_origin(before.train, before.train.files[0].name, 0) is None
    notes = RunData.notes(type("Run", (), {"names": ["data"], "parts": [before.train]})())
    assert len(notes) == 1 and "built before pretrain recorded each document's source" in notes[0]
    assert str(store / MANIFEST) in notes[0] and "pretrain-prepare-data" in notes[0]

    (store / MANIFEST).unlink()
    logs = []
    rebuilt = prepare_data(cfg, log=logs.append, num_workers=1)
    assert not any("resuming" in line for line in logs)  # no shard kept: each lacked its origins
    assert has_provenance(rebuilt.train) and np.array_equal(rebuilt.train[:], new.train[:])
    assert json.loads((store / MANIFEST).read_text()) == manifest


def test_an_hf_dataset_names_the_row_of_its_split_across_data_files(tmp_path):
    """hf: the row of the split (empty rows counted) across the stream's data files, with its dataset, config and
    split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_docs(30, seed=21, words=15)
    (tmp_path / "hub" / "data").mkdir(parents=True)
    split_rows = []
    for i in range(3):
        rows = ["  "] + docs[i * 10:(i + 1) * 10]
        split_rows += rows
        pq.write_table(pa.table({"content": rows}), tmp_path / "hub" / "data" / f"train-{i:05d}-of-00003.parquet")
    store = tmp_path / "hf"
    data = prepare_data(store_config(tmp_path, f"hf:{tmp_path / 'hub'}", store, text_field="content"),
                        log=lambda _: None, num_workers=2)
    manifest = full_manifest(store)
    assert [s["input_rows"] for s in manifest["shards"]] == [11, 11, 11]
    hf = manifest["provenance"]["hf"]
    assert hf == {"dataset": str(tmp_path / "hub"), "config": None, "split": "train"}

    def source_text(origin) -> str:
        assert (origin.dataset, origin.split) == (hf["dataset"], "train") and origin.unit == "row"
        assert str(origin) == f"hf:{hf['dataset']}:{origin.index}"
        return split_rows[origin.index]

    assert opened(source_text, store, manifest, data, data.tokenizer) == 30
    # pretrain-data which --document hf:NAME:ROW: the form parsed and looked up (a row of the third data file)
    from pretrain.data.lookup import RunData

    run = type("Run", (), {"names": ["data"], "parts": [data.train], "data": data})()
    row = next(r for r in range(23, 33) if find_source_document(data.train, "", r) is not None)
    assert RunData.resolve_document(run, f"hf:{hf['dataset']}:{row}") == ("data",
                                                                           *find_source_document(data.train, "", row))
    assert find_source_document(data.train, "", 22) is None  # the third file's empty first row
