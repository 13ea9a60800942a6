"""Issue 50: the token store at the scale we advertise (100,000 shards). A rank opens a store in a constant number of
stats and bounded memory; a format-1 store (before the index) opens as it did; --verify runs in parallel and resumes;
the build's cleanup lists its directory once; data.exclude finds a document's shard by a lookup. The counts come from
tools/scale_store.py's count_io (stats, opens and listings of the store's paths)."""

from __future__ import annotations

import json
import os
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from pretrain.data import open_store, prepare_data
from pretrain.data import store as store_module
from pretrain.data.provenance import document_rows
from pretrain.data.quarantine import resolve_exclude
from pretrain.data.store import VERIFIED, shard_name, verify_store
from pretrain.errors import DataError
from tests.data.test_data import make_docs, write_corpus
from tests.data.test_store import legacy_manifest, store_config
from tools.scale_store import (
    DOCUMENTS_PER_SHARD,
    SEQ_LEN,
    TOKENS_PER_SHARD,
    count_io,
    data_config,
    make_cleanup_dir,
    make_store,
    open_as_rank,
)

SHARDS = 100_000
WITH_FILES = {0, 1, 50_000, 99_999}  # the only shards whose files exist: all an O(1) open may touch


@pytest.fixture(scope="module")
def big_store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("scale") / "store", SHARDS, files=WITH_FILES)


def test_a_100000_shard_store_opens_in_a_constant_number_of_stats_and_bounded_memory_per_rank(big_store):
    """Two ranks open the store and read rows: each stats, opens and lists the store's paths a few times, whatever
    its 100,000 shards (format 1 stat-ed 600,000 files and parsed a 116 MB manifest per rank), and holds a few MB."""
    for rank in range(2):
        tracemalloc.start()
        with count_io(big_store) as counted:
            data = open_as_rank(big_store)
            last = data.train[len(data.train) - 1]
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert counted["stat"] <= 60 and counted["open"] <= 16 and counted["listdir"] <= 2, (rank, counted)
        assert peak < 40 * 2**20, f"rank {rank}: {peak / 2**20:.1f} MiB"
        assert data.stats["num_shards"] == SHARDS and len(data.train) == SHARDS * TOKENS_PER_SHARD // (SEQ_LEN + 1)
        assert last[-1] == 299  # the last shard's last token: eos
    # A row of shard 50,000 is read from its file; the shards between were never touched.
    row = SHARDS // 2 * TOKENS_PER_SHARD // (SEQ_LEN + 1)
    shard_file = big_store / "shards" / f"{shard_name(SHARDS // 2)}.train.ds"
    assert data.train[row].tolist() == np.fromfile(shard_file, dtype="<u2")[: SEQ_LEN + 1].tolist()


def test_a_truncated_shard_of_a_large_store_is_refused_before_its_tokens_are_used(big_store, tmp_path):
    shard_file = big_store / "shards" / f"{shard_name(1)}.train.ds"
    whole = shard_file.read_bytes()
    try:
        shard_file.write_bytes(whole[:-10])  # five tokens short
        data = open_as_rank(big_store)  # opening does not look at shard 1
        row = TOKENS_PER_SHARD // (SEQ_LEN + 1)  # its first row
        message = (rf"the token store at {re.escape(str(big_store))} is damaged: {re.escape(str(shard_file))} "
                   rf"\(59 tokens, the manifest records 64\)\. Rebuild the damaged shard: delete .*manifest\.json")
        with pytest.raises(DataError, match=message):
            data.train[row]
    finally:
        shard_file.write_bytes(whole)


def test_a_format_1_store_still_opens_with_the_same_rows_and_identity(tmp_path):
    """A store built before format 2 (every shard in its manifest, no index) opens by the read path it had: every
    file's size checked at open, the same rows, the same identity (what checkpoints recorded), the same stats."""
    corpus = write_corpus(tmp_path / "corpus", make_docs(60, seed=50))
    store = tmp_path / "store"
    cfg = store_config(tmp_path, corpus, store)
    new = prepare_data(cfg, log=lambda _: None, num_workers=1)
    assert json.loads((store / "manifest.json").read_text())["version"] == 2
    (store / "manifest.json").write_text(json.dumps(legacy_manifest(store)))
    for index in store.glob("index.*.npy"):
        index.unlink()
    for shard in (store / "shards").glob("*.json"):
        shard.unlink()  # a format-1 store is opened from its manifest alone
    logs = []
    old = open_store(cfg, log=logs.append)
    assert np.array_equal(old.train[:], new.train[:]) and np.array_equal(old.val[:], new.val[:])
    assert old.identity == new.identity and {**old.stats, "version": 2} == new.stats
    assert "checksums verified" in logs[-1]
    first = store / "shards" / records_of(old)[0]
    first.write_bytes(first.read_bytes()[:-2])
    with pytest.raises(DataError, match=rf"{re.escape(str(first))}: [\d,]+ bytes, the manifest records"):
        open_store(cfg, log=lambda _: None)  # format 1: sizes are checked at open, as before


def records_of(data) -> list[str]:
    return [path.name for path in data.train.files]


def _built(tmp_path: Path, shards_bytes: int = 1500):
    corpus = write_corpus(tmp_path / "corpus", make_docs(80, seed=51))
    store = tmp_path / "store"
    cfg = store_config(tmp_path, corpus, store, store_shard_bytes=shards_bytes)
    prepare_data(cfg, log=lambda _: None, num_workers=1)
    return store, cfg, json.loads((store / "manifest.json").read_text())


def test_verify_runs_in_parallel_resumes_after_a_kill_and_names_a_corrupted_shard(tmp_path, monkeypatch):
    store, cfg, manifest = _built(tmp_path)
    shards = manifest["num_shards"]
    assert shards >= 8
    quiet = lambda _: None  # noqa: E731

    done = verify_store(store, manifest, workers=2, log=quiet)  # two processes
    assert (done.hashed, done.skipped) == (shards, 0)
    lines = (store / VERIFIED).read_text().splitlines()
    assert sorted(json.loads(line)["shard"] for line in lines) == [shard_name(k) for k in range(shards)]

    # Killed after three shards (the third line cut short by the kill): the rest, and the cut one, are hashed.
    (store / VERIFIED).write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])
    hashed = []
    real = store_module._file_sha256
    monkeypatch.setattr(store_module, "_file_sha256", lambda path: hashed.append(path.name) or real(path))
    done = verify_store(store, manifest, workers=1, log=quiet)
    assert (done.hashed, done.skipped) == (shards - 3, 3)
    verified_first = {json.loads(line)["shard"] for line in lines[:3]}
    assert {name.split(".")[0] for name in hashed} == {shard_name(k) for k in range(shards)} - verified_first
    assert len(hashed) == 6 * (shards - 3)  # tokens, document index, origins of both splits

    hashed.clear()  # nothing changed: nothing hashed
    assert verify_store(store, manifest, workers=1, log=quiet).hashed == 0 and hashed == []

    # A file changed since (same size, new contents and mtime): its shard alone is hashed again, and named.
    target = store / "shards" / f"{shard_name(2)}.train.ds"
    tokens = np.fromfile(target, dtype="<u2")
    tokens[len(tokens) // 2] = (int(tokens[len(tokens) // 2]) + 1) % 300
    tokens.tofile(target)
    os.utime(target, ns=(target.stat().st_atime_ns, target.stat().st_mtime_ns + 10**9))
    with pytest.raises(DataError, match=rf"damaged: {re.escape(str(target))}: its SHA-256 differs .* delete "
                                        rf"{re.escape(str(store))}/manifest\.json and "
                                        rf"{re.escape(str(store / 'shards' / shard_name(2)))}\.json"):
        verify_store(store, manifest, workers=2, log=quiet)
    assert {name.split(".")[0] for name in hashed} == {shard_name(2)}


def test_the_build_cleanup_lists_the_shards_directory_once(tmp_path):
    from pretrain.data.store_build import remove_stale_files

    shards_dir = tmp_path / "shards"
    make_cleanup_dir(shards_dir, 300)  # .tmp- files of every tenth shard
    with count_io(shards_dir) as counted:
        removed = remove_stale_files(shards_dir, set(range(0, 300, 20)))  # half of them are to redo
    assert counted["listdir"] == 1 and removed == 15
    left = sorted(p.name for p in shards_dir.glob(".tmp-*"))
    assert left == [f".tmp-{shard_name(k)}.train.ds" for k in range(10, 300, 20)]


def test_data_exclude_finds_each_document_by_a_lookup_not_a_scan(big_store, tmp_path):
    """A document of shard 50,000 of a 100,000-shard store: its rows found with one stat and map of its index file
    (format 1 listed every file's name for each listed document: O(shards) per document)."""
    data = open_as_rank(big_store)
    file = f"{shard_name(SHARDS // 2)}.train.ds"
    with count_io(big_store) as counted:
        rows = document_rows(data.train, file, 2)
    assert counted["stat"] <= 8 and counted["open"] <= 1, counted  # a constant: its own file only
    start = SHARDS // 2 * TOKENS_PER_SHARD + 2 * TOKENS_PER_SHARD // DOCUMENTS_PER_SHARD  # its first token
    assert rows == range(start // (SEQ_LEN + 1), -(-(start + 16) // (SEQ_LEN + 1)))

    listed = [{"source": "data", "file": f"{shard_name(k)}.train.ds", "document": d,
               "store": {"content": data.identity["content"]}} for k in sorted(WITH_FILES) for d in (0, 3)]
    (tmp_path / "quarantine.json").write_text(json.dumps({"version": 1, "documents": listed}))
    with count_io(big_store) as counted:
        resolved = resolve_exclude([str(tmp_path / "quarantine.json")], data, log=lambda _: None)
    assert counted["open"] <= len(WITH_FILES), counted  # one map of each split file's index
    expected = sorted({row for k in WITH_FILES for d in (0, 3) for row in
                       range((k * TOKENS_PER_SHARD + d * 16) // (SEQ_LEN + 1),
                             -(-(k * TOKENS_PER_SHARD + (d + 1) * 16) // (SEQ_LEN + 1)))})
    assert resolved["samples"] == expected and len(resolved["documents"]) == 8
    with pytest.raises(DataError, match=r"holds documents 0\.\.3; there is no document 4"):
        document_rows(data.train, file, 4)
    assert data_config(big_store).store == str(big_store)


def test_in_a_launch_local_rank_0_fingerprints_the_corpus_and_the_others_read_it(tmp_path, monkeypatch):
    """Without data.store a store's path is a hash of the corpus's fingerprint (two stats per input file): in a launched
    run local rank 0 computes it and the node's other ranks read it, stat-ing no input file; a new launch (another
    agent) fingerprints the corpus anew, so a changed corpus is still found."""
    from pretrain.data import sources

    corpus = write_corpus(tmp_path / "corpus", make_docs(40, seed=52))
    cfg = store_config(tmp_path, corpus, tmp_path / "store")
    monkeypatch.setattr(sources.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    agent = sources._agent
    monkeypatch.setattr(sources, "_agent", lambda: "4242-1")  # one launch's agent
    monkeypatch.setenv("LOCAL_RANK", "0")
    with count_io(corpus) as rank0:
        first = sources._resolve_corpus(cfg)
    assert rank0["stat"] >= 2 * len(first.files)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with count_io(corpus) as rank1:
        assert sources._resolve_corpus(cfg) == first
    assert rank1["stat"] == 0 and rank1["listdir"] == 0, rank1

    (corpus / "doc_000.txt").write_text("this document changed after the store was made")
    monkeypatch.setattr(sources, "_agent", lambda: "4243-1")  # the next launch
    assert sources._resolve_corpus(cfg).key != first.key  # rank 1 first: nothing published, it looks itself
    monkeypatch.setenv("LOCAL_RANK", "0")
    changed = sources._resolve_corpus(cfg)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert changed.key != first.key and sources._resolve_corpus(cfg) == changed
    monkeypatch.setattr(sources, "_agent", agent)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # outside a launch: computed, nothing shared
    assert sources.shared_path(cfg) is None and sources._resolve_corpus(cfg) == changed
