"""The token store: byte-identical for any number of workers, resumable after kill -9, refused when made
with another tokenizer, and prepared before any process group exists."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pretrain.data import StoreMissing, ensure_store, open_store, prepare_data
from pretrain.data.store import shard_records
from pretrain.distributed.layout import Launch
from pretrain.errors import DataError
from pretrain.recipe.config import DataConfig
from tests.data.test_data import make_docs, write_corpus
from tests.helpers import FAST, ROOT, TINY, accelerate_launch, env, train, train_losses


def store_config(tmp_path: Path, corpus: Path, store: Path, **kwargs) -> DataConfig:
    defaults = dict(cache_dir=str(tmp_path / "cache"), seq_len=32, tokenizer_vocab_size=300, num_proc=1,
                    store=str(store), store_shard_bytes=2000, val_fraction=0.2)
    return DataConfig(source=str(corpus), **{**defaults, **kwargs})


def records(store: Path) -> list[dict]:
    """Every shard's record of a complete store, in order (a format-2 manifest lists none: they are the
    shards/NNNNN.json files)."""
    return list(shard_records(store, json.loads((store / "manifest.json").read_text())))


def full_manifest(store: Path) -> dict:
    """A complete store's manifest with its shards' records under "shards" (as format 1 listed them)."""
    return {**json.loads((store / "manifest.json").read_text()), "shards": records(store)}


def legacy_manifest(store: Path) -> dict:
    """The format-1 manifest of a store (what write_manifest wrote before the index): every shard's record in it,
    no index; with it (and without index.*.npy) the store is what a build before format 2 left."""
    manifest = json.loads((store / "manifest.json").read_text())
    old = {k: v for k, v in manifest.items() if k not in ("num_shards", "num_bytes", "content", "index")}
    return {**old, "version": 1, "shards": records(store)}


def checksums(store: Path) -> dict[str, str]:
    """sha256 of every file of a store, by relative path."""
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file()}


def test_one_and_two_workers_write_byte_identical_stores_readable_as_datatrove_files(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", make_docs(60, seed=11))
    one = tmp_path / "one"
    two = tmp_path / "two"
    data = prepare_data(store_config(tmp_path, corpus, one), log=lambda _: None, num_workers=1)
    prepare_data(store_config(tmp_path, corpus, two), log=lambda _: None, num_workers=2)
    manifest = json.loads((one / "manifest.json").read_text())
    assert len(records(one)) > 3 and manifest["dtype"] == "uint16" and manifest["num_shards"] == len(records(one))
    assert checksums(one) == checksums(two)  # every shard file, the tokenizer and the manifest

    # The manifest's checksums are those of the files, and a shard read the way datatrove / nanotron read
    # it (raw little-endian uint16 tokens, uint64 document ends) holds eos-terminated documents.
    eos = data.tokenizer.eos_token_id
    stream = []
    for shard in records(one):
        path = one / "shards" / shard["train"]["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == shard["train"]["sha256"]
        tokens = np.fromfile(path, dtype="<u2")
        ends = np.fromfile(f"{path}.index", dtype="<u8")
        assert len(ends) == shard["train"]["num_documents"] and (len(ends) == 0 or ends[-1] == len(tokens))
        assert all(tokens[e - 1] == eos for e in ends)
        stream += tokens.tolist()
    rows = np.asarray(data.train)
    assert rows.reshape(-1).tolist() == stream[: rows.size]  # rows span shard boundaries seamlessly


def test_kill_9_mid_build_then_rerun_gives_the_uninterrupted_store(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", make_docs(400, seed=12, words=200))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("batch: {global_batch_size: 8, micro_batch_size: 2}\ntrain: {max_steps: 10}\n"
                      f"data: {{source: {corpus}, seq_len: 32, tokenizer_vocab_size: 300, store_shard_bytes: 4000}}\n")
    cmd = [sys.executable, "-m", "pretrain.cli.prepare_data", "--recipe", str(recipe), "--workers", "1",
           f"data.cache_dir={tmp_path / 'cache'}"]
    killed, whole = tmp_path / "killed", tmp_path / "whole"

    proc = subprocess.Popen([*cmd, f"data.store={killed}"], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not list((killed / "shards").glob("00001.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (killed / "manifest.json").exists(), "killed too late"
    finished = {p.name: p.stat().st_mtime_ns for p in (killed / "shards").glob("0000[01].*")}

    rerun = subprocess.run([*cmd, f"data.store={killed}"], cwd=ROOT, env=env(), capture_output=True, text=True,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    resumed = re.search(r"resuming: (\d+) of (\d+) shards are complete", rerun.stdout)
    assert resumed and 2 <= int(resumed[1]) < int(resumed[2]), rerun.stdout
    assert {p: (killed / "shards" / p).stat().st_mtime_ns for p in finished} == finished  # kept, not redone

    assert subprocess.run([*cmd, f"data.store={whole}"], cwd=ROOT, env=env(), capture_output=True,
                          timeout=300).returncode == 0
    assert [s["train"]["sha256"] for s in records(killed)] == [s["train"]["sha256"] for s in records(whole)]
    assert checksums(killed) == checksums(whole)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_build_says_what_it_kept_in_one_line(tmp_path, how):
    """Ctrl-C (SIGINT to the whole process group: the parent and its pool's workers) or SIGTERM of the parent:
    no worker traceback, one line on what was kept and how to continue, exit 130; the rerun finishes the store."""
    corpus = write_corpus(tmp_path / "corpus", make_docs(400, seed=12, words=200))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("batch: {global_batch_size: 8, micro_batch_size: 2}\ntrain: {max_steps: 10}\n"
                      f"data: {{source: {corpus}, seq_len: 32, tokenizer_vocab_size: 300, store_shard_bytes: 4000}}\n")
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "pretrain.cli.prepare_data", "--recipe", str(recipe), "--workers", "2",
           f"data.cache_dir={tmp_path / 'cache'}", f"data.store={store}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while not list((store / "shards").glob("0000[01].json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and not (store / "manifest.json").exists(), (proc.returncode, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    kept = re.search(r"interrupted: (\d+) of (\d+) shards of the token store at (.+) are complete and kept; the "
                     r"same command tokenizes only the rest\n", err)
    assert kept and kept[3] == str(store) and int(kept[1]) < int(kept[2]), err
    rerun = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and (store / "manifest.json").is_file(), rerun.stderr


def test_a_store_made_with_another_tokenizer_is_refused(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", make_docs(30, seed=13))
    store = tmp_path / "store"
    prepare_data(store_config(tmp_path, corpus, store), log=lambda _: None)
    other = store_config(tmp_path, corpus, store, tokenizer_vocab_size=320)
    message = r"made with tokenizer 'bpe-300' .* this recipe's data\.tokenizer is 'bpe-320'"
    with pytest.raises(DataError, match=message):
        open_store(other, log=lambda _: None)
    with pytest.raises(DataError, match=message):
        prepare_data(other, log=lambda _: None)  # never overwritten either

    from pretrain.cli.prepare_data import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text("batch: {global_batch_size: 8, micro_batch_size: 2}\ntrain: {max_steps: 10}\n"
                      f"data: {{source: {corpus}, store: {store}, tokenizer_vocab_size: 320, val_fraction: 0.2}}\n")
    assert main(["--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err) and "Traceback" not in err


def _corrupt_same_size(path: Path, value: int) -> None:
    """Overwrite the middle token of a shard file in place: its size stays what the manifest records."""
    tokens = np.fromfile(path, dtype="<u2")
    tokens[len(tokens) // 2] = value
    tokens.tofile(path)


def _prepared_store(tmp_path: Path, shard_index: int):
    """(corpus, store, data config, the train file of shard ``shard_index``) of a small prepared store."""
    corpus = write_corpus(tmp_path / "corpus", make_docs(30, seed=17))
    store = tmp_path / "store"
    data_cfg = store_config(tmp_path, corpus, store)
    prepare_data(data_cfg, log=lambda _: None)
    return corpus, store, data_cfg, store / "shards" / records(store)[shard_index]["train"]["file"]


def test_a_same_size_corrupted_shard_is_refused_naming_it(tmp_path, capsys, monkeypatch):
    from pretrain.cli.prepare_data import main
    from pretrain.data import store as store_module

    corpus, store, data_cfg, shard = _prepared_store(tmp_path, shard_index=1)
    # In the vocabulary (300 ids): only the checksum can tell.
    middle = np.fromfile(shard, dtype="<u2")[shard.stat().st_size // 4]
    _corrupt_same_size(shard, (int(middle) + 1) % 300)
    named = rf"{re.escape(str(shard))}: its SHA-256 differs from the manifest's .* delete {re.escape(str(store))}/manifest\.json"

    # A small store (up to VERIFY_ON_OPEN_MAX_BYTES) is hashed whenever it is opened: by training too.
    with pytest.raises(DataError, match=named):
        open_store(data_cfg, log=lambda _: None)
    # A larger one is checked by size on open; pretrain-prepare-data --verify hashes it and names the shard.
    monkeypatch.setattr(store_module, "VERIFY_ON_OPEN_MAX_BYTES", 0)
    logged = []
    assert len(open_store(data_cfg, log=logged.append).train) > 0
    assert "sizes checked as shards are read" in logged[-1]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("batch: {global_batch_size: 8, micro_batch_size: 2}\ntrain: {max_steps: 10}\n"
                      f"data: {{source: {corpus}, store: {store}, tokenizer_vocab_size: 300, val_fraction: 0.2, "
                      f"seq_len: 32, store_shard_bytes: 2000}}\n")
    assert main(["--recipe", str(recipe)]) == 0  # no --verify: complete by its sizes
    capsys.readouterr()
    assert main(["--recipe", str(recipe), "--verify"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(named, err) and "Traceback" not in err


def test_a_token_outside_the_vocabulary_is_refused_naming_the_shard(tmp_path, monkeypatch):
    """Past the checks on open (a large store is checked by size only): the loader's rows refuse an id the
    embedding has no row for, instead of an IndexError inside the model."""
    from pretrain.data import store as store_module

    _, store, data_cfg, shard = _prepared_store(tmp_path, shard_index=0)
    _corrupt_same_size(shard, 40000)
    monkeypatch.setattr(store_module, "VERIFY_ON_OPEN_MAX_BYTES", 0)
    rows = open_store(data_cfg, log=lambda _: None).train
    with pytest.raises(DataError, match=rf"token id 40,000 at token \d+ of {re.escape(str(shard))}, outside its "
                                        r"tokenizer's vocabulary of 300 ids"):
        rows[:]


def test_a_directory_that_is_not_a_store_is_never_written_into(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", make_docs(10, seed=19))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "manifest.json").write_text("my own file")
    with pytest.raises(DataError, match=rf"{re.escape(str(mine))} already exists and is not a token store"):
        prepare_data(store_config(tmp_path, corpus, mine), log=lambda _: None)
    assert sorted(p.name for p in mine.iterdir()) == ["manifest.json"]
    assert (mine / "manifest.json").read_text() == "my own file"


def test_a_store_or_output_dir_that_is_a_file_is_called_a_file(tmp_path):
    """Issue 36: a data.store that is a regular file was "manifest.json: unreadable (Not a directory); delete the
    store", advice to delete a file pretrain does not own; an output_dir that is one was "not writable"."""
    from pretrain.errors import ConfigError, writable_dir

    corpus = write_corpus(tmp_path / "corpus", make_docs(10, seed=19))
    mine = tmp_path / "notes.txt"
    mine.write_text("my own file")
    with pytest.raises(DataError, match=rf"{re.escape(str(mine))} is a file, not a token store directory") as caught:
        prepare_data(store_config(tmp_path, corpus, mine), log=lambda _: None)
    assert "delete" not in str(caught.value) and mine.read_text() == "my own file"
    with pytest.raises(ConfigError, match=rf"output_dir is a file, not a directory \({re.escape(str(mine))}\)"):
        writable_dir(mine, "output_dir", "choose another")


def test_multi_node_launch_without_a_store_stops_with_the_command(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", make_docs(10, seed=14))
    cfg = store_config(tmp_path, corpus, tmp_path / "store")
    with pytest.raises(StoreMissing, match=r"2-node launch does not tokenize.*\n    pretrain-prepare-data --recipe x"):
        ensure_store(cfg, Launch(num_nodes=2, gpus_per_node=2), "pretrain-prepare-data --recipe x", log=print)
    assert not (tmp_path / "store").exists()

    # The entry point on a node of a 2-node launch: exit 2 with the exact command, before any process group.
    store = tmp_path / "store2"
    overrides = [*FAST, "batch.micro_batch_size=2", f"data.store={store}", f"output_dir={tmp_path / 'run'}"]
    proc = train(overrides, extra_env={"WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
                 timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"pretrain-prepare-data --recipe {TINY} " in proc.stderr and f"data.store={store}" in proc.stderr
    assert not store.exists()


SLOW_BUILD_RUN = """
import os, sys, time
from pretrain.data import prepare
from pretrain.run import main

finish = prepare._finish


def slow_finish(*args, **kwargs):  # the build outlasts the collective timeout however fast this machine is
    time.sleep(float(os.environ["SLOW_BUILD_S"]))
    return finish(*args, **kwargs)


prepare._finish = slow_finish
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_two_process_launch_prepares_the_missing_store_before_the_process_group(tmp_path):
    # Local rank 0's build is made to last longer than this collective timeout (a wrapper of run.py sleeps before
    # the manifest is written): had rank 1 waited for rank 0 in a barrier (the old main_process_first), the run
    # would die with a gloo timeout. (A shorter timeout would risk the run's ordinary collectives on a loaded
    # machine.)
    timeout_s = 4
    store = tmp_path / "store"
    out = tmp_path / "run"
    script = tmp_path / "slow_build_run.py"
    script.write_text(SLOW_BUILD_RUN)
    proc = accelerate_launch("cpu_ddp.yaml", [*FAST, "batch.micro_batch_size=2", "train.max_steps=2",
                                              f"runtime.collective_timeout_s={timeout_s}", f"data.store={store}",
                                              f"output_dir={out}", "checkpoint.save_final_model=false"],
                             script=[str(script)], extra_env={"SLOW_BUILD_S": str(timeout_s + 2)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = proc.stdout + proc.stderr
    built = re.search(r"built in ([\d.]+)s at " + re.escape(str(store)), logs)
    assert built and float(built[1]) > timeout_s, logs[-3000:]
    assert logs.count("data: tokenizing") == 1  # local rank 0 prepared; rank 1 only waited
    assert (store / "manifest.json").is_file() and sorted(train_losses(out)) == [1, 2]


def test_hf_source_is_streamed_shard_by_data_file_and_tokenized_like_the_same_local_files(tmp_path, monkeypatch):
    """`hf:` goes through load_dataset_builder + as_streaming_dataset (what load_dataset(streaming=True) does),
    here on a local directory of parquet files, which load_dataset reads as it reads a hub dataset's: each
    data file is a shard of the stream and of the store, and nothing is downloaded or converted to Arrow."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    def no_download(*args, **kwargs):
        raise AssertionError("the hf: source was downloaded instead of streamed")

    monkeypatch.setattr(datasets.builder.DatasetBuilder, "download_and_prepare", no_download)
    docs = make_docs(45, seed=15)
    (tmp_path / "hub" / "data").mkdir(parents=True)
    for i in range(3):
        rows = docs[i * 15:(i + 1) * 15] + ["   "]  # whitespace-only rows are dropped, like local ones
        pq.write_table(pa.table({"content": rows, "id": list(range(len(rows)))}),
                       tmp_path / "hub" / "data" / f"train-{i:05d}-of-00003.parquet")
    hf = store_config(tmp_path, f"hf:{tmp_path / 'hub'}", tmp_path / "hf", text_field="content")
    data = prepare_data(hf, log=lambda _: None, num_workers=2)
    manifest = json.loads((tmp_path / "hf" / "manifest.json").read_text())
    files = sorted(str(p) for p in (tmp_path / "hub" / "data").glob("*.parquet"))
    assert [s["inputs"] for s in records(tmp_path / "hf")] == [[["hf", f, i, 3]] for i, f in enumerate(files)]
    assert manifest["num_documents"] == 45
    prepare_data(store_config(tmp_path, f"hf:{tmp_path / 'hub'}", tmp_path / "hf1", text_field="content"),
                 log=lambda _: None, num_workers=1)
    assert checksums(tmp_path / "hf") == checksums(tmp_path / "hf1")

    # The same parquet files as a local source (one shard each): the same tokenizer and token files.
    local = store_config(tmp_path, tmp_path / "hub", tmp_path / "local", text_field="content", store_shard_bytes=1)
    prepare_data(local, log=lambda _: None, num_workers=1)
    hf_sums, local_sums = checksums(tmp_path / "hf"), checksums(tmp_path / "local")
    token_files = [k for k in hf_sums if k.endswith((".ds", ".ds.index")) or k.startswith("tokenizer/")]
    assert len(token_files) > 12 and {k: hf_sums[k] for k in token_files} == {k: local_sums[k] for k in token_files}
    assert data.stats["num_train_tokens"] + data.stats["num_val_tokens"] > 0


def test_hf_source_without_the_text_column_is_one_clear_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "hub").mkdir()
    pq.write_table(pa.table({"body": ["some text"]}), tmp_path / "hub" / "train.parquet")
    with pytest.raises(DataError, match=r"has no column 'text' \(data.text_field\); its columns are: body"):
        prepare_data(store_config(tmp_path, f"hf:{tmp_path / 'hub'}", tmp_path / "s"), log=lambda _: None)
    with pytest.raises(DataError, match=r"'hf:no-such-user/no-such-dataset-xyz': the dataset could not be opened for "
                                        r"streaming .* point data.source at the local files"):
        prepare_data(store_config(tmp_path, "hf:no-such-user/no-such-dataset-xyz", tmp_path / "s2"),
                     log=lambda _: None)


def test_a_named_store_is_opened_by_ranks_from_its_manifest_alone(tmp_path, monkeypatch):
    """A rank neither stats the corpus nor loads data.tokenizer to open a named store; it checks what the
    recipe says. The launchers (check_store, one process) compare the fingerprints."""
    from pretrain.data import prepare
    from pretrain.data.prepare import check_store

    corpus = write_corpus(tmp_path / "corpus", make_docs(20, seed=16))
    cfg = store_config(tmp_path, corpus, tmp_path / "store")
    prepare_data(cfg, log=lambda _: None)

    def not_on_a_rank(*args, **kwargs):
        raise AssertionError("a rank looked at the corpus or the recipe's tokenizer")

    with monkeypatch.context() as patch:
        patch.setattr(prepare, "_resolve_corpus", not_on_a_rank)
        patch.setattr(prepare, "_get_tokenizer", not_on_a_rank)
        ensure_store(cfg, Launch(num_nodes=2, gpus_per_node=2), "pretrain-prepare-data --recipe x", log=print)
        assert len(open_store(cfg, log=lambda _: None).train) > 0
        with pytest.raises(DataError, match=r"made with tokenizer 'bpe-300' .* data\.tokenizer is 'bpe-320'"):
            open_store(store_config(tmp_path, corpus, tmp_path / "store", tokenizer_vocab_size=320), log=print)
        with pytest.raises(DataError, match=r"made from other data: val_fraction 0\.2 \(recipe: 0\.3\)"):
            open_store(store_config(tmp_path, corpus, tmp_path / "store", val_fraction=0.3), log=print)

    check_store(cfg, 2, "x")  # the launcher's full check passes on the unchanged corpus
    (corpus / "doc_000.txt").write_text("this document changed after the store was made")
    with pytest.raises(DataError, match=f"the token store at {tmp_path / 'store'}: the store was made"):
        check_store(cfg, 2, "x")
