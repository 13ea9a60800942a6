"""Data: corpus loading, the document split, tokenizer, packing, the cache, and the errors users see."""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402

from pretrain.data import cache as data_cache  # noqa: E402
from pretrain.data import load_documents, prepare_data  # noqa: E402
from pretrain.data import sources as data_sources  # noqa: E402
from pretrain.data import split as data_split  # noqa: E402
from pretrain.errors import DataError  # noqa: E402
from pretrain.recipe.config import DataConfig  # noqa: E402

WORDS = (
    "the cat sat on a mat while data flows through tokens and every model learns some words "
    "from text that people write in files def return import class self value"
).split()


def make_docs(n: int, seed: int = 0, words: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(words + rng.randrange(40))) for i in range(n)]


def write_corpus(directory: Path, docs: list[str], names: list[str] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (directory / (names[i] if names else f"doc_{i:03d}.txt")).write_text(doc, encoding="utf-8")
    return directory


def config(tmp_path: Path, source, **kwargs) -> DataConfig:
    defaults = dict(cache_dir=str(tmp_path / "cache"), seq_len=32, tokenizer_vocab_size=300, num_proc=1)
    return DataConfig(source=str(source), **{**defaults, **kwargs})


def is_val_by_rule(text: str, val_fraction: float) -> bool:
    """The documented split rule: sha1(text)[:8] read as a fraction of 2**64, below val_fraction."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big") < val_fraction * 2**64


def pieces(tokenizer, rows: np.ndarray) -> list[str]:
    """Complete documents in a packed split: the text between eos tokens (the cut-off last one dropped)."""
    eos = tokenizer.eos_token_id
    stream = np.asarray(rows).reshape(-1).tolist()
    out, current = [], []
    for token in stream:
        if token == eos:
            out.append(tokenizer.decode(current))
            current = []
        else:
            current.append(token)
    return out


# --------------------------------------------------------------------------------------------------
# Packing and the split


def test_sequences_are_the_eos_joined_token_stream_of_each_split(tmp_path):
    docs = make_docs(40)
    cfg = config(tmp_path, write_corpus(tmp_path / "corpus", docs), val_fraction=0.25)
    data = prepare_data(cfg, log=lambda _: None)
    tok, eos = data.tokenizer, data.tokenizer.eos_token_id
    assert tok.eos_token == "<|endoftext|>" and len(tok) <= 300

    for split, rows in (("train", data.train), ("val", data.val)):
        split_docs = [d for d in docs if is_val_by_rule(d, 0.25) == (split == "val")]
        assert split_docs, f"the fixture should put documents in {split}"
        stream = [t for d in split_docs for t in [*tok(d, add_special_tokens=False)["input_ids"], eos]]
        # Stored as uint16 (a vocabulary of at most 65536), read as int64 rows.
        assert rows.dtype == np.uint16 and rows.ndim == 2 and rows.shape[1] == 33 and rows[0].dtype == np.int64
        assert len(rows) == len(stream) // 33  # only the remainder that does not fill a row is dropped
        np.testing.assert_array_equal(np.asarray(rows).reshape(-1), np.array(stream[: rows.size], dtype=np.int32))
        assert data.stats[f"num_{split}_tokens"] == len(stream)
        assert data.stats[f"num_{split}_documents"] == len(split_docs)
        assert data.stats[f"num_{split}_sequences"] == len(rows)
    assert tok.decode(tok(docs[0], add_special_tokens=False)["input_ids"]) == docs[0]  # byte-level: lossless
    assert data.stats["num_documents"] == 40 and data.stats["num_decode_errors"] == 0
    json.dumps(data.stats)


def test_val_split_is_by_document_disjoint_and_independent_of_file_names_and_order(tmp_path):
    docs = make_docs(30, seed=1)
    forward = config(tmp_path, write_corpus(tmp_path / "a", docs), val_fraction=0.3)
    backward = config(  # same texts, file names sorting in the opposite order
        tmp_path,
        write_corpus(tmp_path / "b", docs, names=[f"x_{len(docs) - i:03d}.txt" for i in range(len(docs))]),
        val_fraction=0.3,
    )

    def val_texts(cfg):
        documents = load_documents(cfg, log=lambda _: None)
        mask = data_split._val_mask(data_split._split_hashes(documents), cfg.val_fraction)
        pairs = list(zip(documents["text"], mask, strict=True))
        return {t for t, v in pairs if v}, {t for t, v in pairs if not v}

    val_a, train_a = val_texts(forward)
    val_b, train_b = val_texts(backward)
    assert val_a == val_b and train_a == train_b
    assert val_a and train_a and not val_a & train_a

    data = prepare_data(forward, log=lambda _: None)
    train_pieces, val_pieces = pieces(data.tokenizer, data.train), pieces(data.tokenizer, data.val)
    assert train_pieces and val_pieces
    assert set(train_pieces) <= train_a and set(val_pieces) <= val_a


def test_tiny_corpus_still_gets_a_validation_document(tmp_path):
    docs = make_docs(3, seed=2, words=200)
    cfg = config(tmp_path, write_corpus(tmp_path / "corpus", docs), val_fraction=0.01)
    data = prepare_data(cfg, log=lambda _: None)
    assert data.stats["num_val_documents"] == 1 and data.stats["num_train_documents"] == 2
    assert len(data.val) >= 1


def test_single_document_is_split_inside_its_token_stream(tmp_path):
    doc = make_docs(1, seed=3, words=1500)[0]
    cfg = config(tmp_path, write_corpus(tmp_path / "corpus", [doc]), val_fraction=0.2)
    data = prepare_data(cfg, log=lambda _: None)
    ids = data.tokenizer(doc, add_special_tokens=False)["input_ids"]
    eos = data.tokenizer.eos_token_id
    cut = len(ids) - round(len(ids) * 0.2)
    train_stream, val_stream = [*ids[:cut], eos], [*ids[cut:], eos]
    np.testing.assert_array_equal(np.asarray(data.train).reshape(-1), train_stream[: data.train.size])
    np.testing.assert_array_equal(np.asarray(data.val).reshape(-1), val_stream[: data.val.size])
    assert len(data.val) == len(val_stream) // 33 >= 1


# --------------------------------------------------------------------------------------------------
# The cache


def test_second_call_is_cached_fast_and_identical_and_subsets_reuse_it(tmp_path):
    cfg = config(tmp_path, write_corpus(tmp_path / "corpus", make_docs(40, seed=4)))
    first = prepare_data(cfg, log=lambda _: None)
    messages = []
    start = time.perf_counter()
    second = prepare_data(cfg, log=messages.append)
    assert time.perf_counter() - start < 1.0
    assert [m for m in messages if "from the store at" in m] and not [m for m in messages if "tokeniz" in m]
    np.testing.assert_array_equal(first.train, second.train)
    np.testing.assert_array_equal(first.val, second.val)
    assert first.stats == second.stats
    assert first.tokenizer.get_vocab() == second.tokenizer.get_vocab()

    messages.clear()
    subset = prepare_data(cfg.model_copy(update={"train_subset": 3, "val_subset": 1}), log=messages.append)
    assert not [m for m in messages if "tokeniz" in m]
    np.testing.assert_array_equal(subset.train, first.train[:3])
    np.testing.assert_array_equal(subset.val, first.val[:1])
    assert subset.stats["num_train_sequences"] == 3 and subset.stats["num_val_sequences"] == 1

    store = Path(first.stats["cache_dir"])
    assert [p.name for p in store.parent.iterdir() if not p.name.endswith(".lock")] == [store.name]
    assert {p.name for p in store.iterdir()} == {"manifest.json", "build.json", "tokenizer", "shards", "index.train.npy",
                                                  "index.val.npy"}
    assert not [p for p in store.rglob(".tmp-*")]  # no temporary files left behind


def test_changed_corpus_is_rebuilt_and_another_seq_len_reuses_the_store(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", make_docs(40, seed=5))
    first = prepare_data(config(tmp_path, corpus), log=lambda _: None)
    messages = []
    shorter = prepare_data(config(tmp_path, corpus, seq_len=16), log=messages.append)
    assert shorter.train.shape[1] == 17 and shorter.stats["cache_dir"] == first.stats["cache_dir"]
    assert not [m for m in messages if "tokeniz" in m]
    np.testing.assert_array_equal(np.asarray(shorter.train).reshape(-1)[:33 * 5],
                                  np.asarray(first.train).reshape(-1)[:33 * 5])
    (corpus / "doc_000.txt").write_text("a changed document " * 50)
    changed = prepare_data(config(tmp_path, corpus), log=lambda _: None)
    assert changed.stats["cache_dir"] != first.stats["cache_dir"]


def test_num_proc_does_not_change_the_result(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", make_docs(60, seed=6))
    one = prepare_data(config(tmp_path, corpus, num_proc=1, cache_dir=str(tmp_path / "c1")), log=lambda _: None)
    two = prepare_data(config(tmp_path, corpus, num_proc=2, cache_dir=str(tmp_path / "c2")), log=lambda _: None)
    np.testing.assert_array_equal(one.train, two.train)
    np.testing.assert_array_equal(one.val, two.val)


def test_publish_tolerates_losing_the_race(tmp_path):
    target = tmp_path / "packed" / "key"
    target.mkdir(parents=True)
    (target / "train.npy").write_text("winner")
    mine = data_cache._make_tmp_dir(target.parent, "key")
    (mine / "train.npy").write_text("loser")
    assert data_cache._publish(mine, target) is False
    assert not mine.exists() and (target / "train.npy").read_text() == "winner"


# --------------------------------------------------------------------------------------------------
# Formats


def test_jsonl_and_json_records_with_a_custom_text_field(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [{"content": "first doc", "id": 1}, None, {"content": "second doc"}, {"content": None}, {"content": "  "}]
    (corpus / "a.jsonl").write_text("\n".join("" if x is None else json.dumps(x) for x in lines) + "\n")
    (corpus / "b.json").write_text(json.dumps([{"content": "third doc"}, {"content": "fourth \ud800 doc"}]))
    docs = load_documents(config(tmp_path, corpus, text_field="content"), log=lambda _: None)
    assert docs.column_names == ["text"]
    assert docs["text"] == ["first doc", "second doc", "third doc", "fourth \ufffd doc"]


def test_jsonl_line_without_the_text_field_names_file_line_and_field(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "ok too"}\n{"body": "no text here"}\n')
    with pytest.raises(DataError, match=r"data\.jsonl:3: no field 'text' \(data\.text_field\).*body"):
        load_documents(config(tmp_path, path), log=lambda _: None)
    path.write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"data\.jsonl:2: invalid JSON"):
        load_documents(config(tmp_path, path), log=lambda _: None)


def test_parquet_documents_and_a_missing_column(tmp_path):
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"text": ["alpha", None, "beta", ""], "lang": ["en"] * 4}), path)
    docs = load_documents(config(tmp_path, path), log=lambda _: None)
    assert docs["text"] == ["alpha", "beta"]
    with pytest.raises(DataError, match=r"part-0\.parquet: no column 'body'.*columns are: text, lang"):
        load_documents(config(tmp_path, path, text_field="body"), log=lambda _: None)


def test_directory_and_glob_sources(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / ".hidden").mkdir()
    (corpus / "a.txt").write_text("text file")
    (corpus / "b.md").write_text("# markdown file")
    (corpus / "c.jsonl").write_text('{"text": "jsonl line 1"}\n{"text": "jsonl line 2"}\n')
    pq.write_table(pa.table({"text": ["parquet row"]}), corpus / "sub" / "d.parquet")
    (corpus / "notes.csv").write_text("ignored,file")
    (corpus / ".hidden" / "e.txt").write_text("ignored hidden file")
    docs = load_documents(config(tmp_path, corpus), log=lambda _: None)
    assert docs["text"] == ["text file", "# markdown file", "jsonl line 1", "jsonl line 2", "parquet row"]
    only_jsonl = load_documents(config(tmp_path, corpus, format="jsonl"), log=lambda _: None)
    assert only_jsonl["text"] == ["jsonl line 1", "jsonl line 2"]
    globbed = load_documents(config(tmp_path, f"{corpus}/**/*.parquet"), log=lambda _: None)
    assert globbed["text"] == ["parquet row"]


@pytest.mark.parametrize("policy", ["replace", "skip"])
def test_non_utf8_documents_are_replaced_or_skipped_and_counted(tmp_path, policy):
    corpus = write_corpus(tmp_path / "corpus", make_docs(30, seed=7))
    (corpus / "latin1.txt").write_bytes("café olé ".encode("latin-1") * 40)
    (corpus / "lines.jsonl").write_bytes(b'{"text": "good line"}\n{"text": "bad \xff line"}\n')
    messages = []
    cfg = config(tmp_path, corpus, on_decode_error=policy)
    texts = load_documents(cfg, log=messages.append)["text"]
    assert messages == [
        "data: 2 documents had non-UTF-8 bytes: " + ("replaced with U+FFFD" if policy == "replace" else "skipped")
    ]
    assert "good line" in texts
    if policy == "replace":
        assert "bad \ufffd line" in texts and any(t.startswith("caf\ufffd ol\ufffd") for t in texts)
        assert len(texts) == 33
    else:
        assert not any("\ufffd" in t for t in texts) and len(texts) == 31
    data = prepare_data(cfg, log=lambda _: None)
    assert data.stats["num_decode_errors"] == 2


def test_stdlib_corpus_is_the_standard_library_without_tests(tmp_path):
    files = data_sources._stdlib_files()
    assert files == sorted(files) and len(files) > 300
    assert all(f.suffix == ".py" for f in files)
    assert not any(set(f.parts) & {"site-packages", "dist-packages", "test", "tests", "idle_test"} for f in files)
    assert any(f.name == "functools.py" for f in files)
    docs = load_documents(DataConfig(source="stdlib", cache_dir=str(tmp_path / "cache")), log=lambda _: None)
    assert 300 < len(docs) <= len(files)
    assert all(t.strip() for t in docs["text"][:50])


# --------------------------------------------------------------------------------------------------
# Tokenizers


def test_a_saved_tokenizer_directory_gives_the_same_sequences(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", make_docs(40, seed=8))
    trained = prepare_data(config(tmp_path, corpus), log=lambda _: None)
    tokenizer_dir = Path(trained.stats["cache_dir"]) / "tokenizer"
    loaded = prepare_data(config(tmp_path, corpus, tokenizer=str(tokenizer_dir)), log=lambda _: None)
    assert loaded.stats["cache_dir"] != trained.stats["cache_dir"]
    np.testing.assert_array_equal(loaded.train, trained.train)
    np.testing.assert_array_equal(loaded.val, trained.val)


def test_tokenizer_without_eos_is_an_error(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "words.json"))
    corpus = write_corpus(tmp_path / "corpus", make_docs(5))
    with pytest.raises(DataError, match=r"data\.tokenizer = .*words\.json' has no eos_token"):
        prepare_data(config(tmp_path, corpus, tokenizer=str(tmp_path / "words.json")), log=lambda _: None)


# --------------------------------------------------------------------------------------------------
# Errors a user can act on


@pytest.mark.parametrize(
    "source, message",
    [
        ("missing_dir", r"data\.source = '.*missing_dir': no such file or directory.*`stdlib`"),
        ("corpus/*.nothing", r"data\.source = '.*\*\.nothing': the glob matches no files"),
        ("empty_dir", r"data\.source = '.*empty_dir': the directory has no \.txt"),
        ("blank", r"data\.source = '.*blank' has no text"),
    ],
)
def test_bad_sources_raise_data_error_naming_the_key(tmp_path, source, message):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "empty_dir").mkdir()
    write_corpus(tmp_path / "blank", ["", "  \n\t", "\n"])
    with pytest.raises(DataError, match=message):
        prepare_data(config(tmp_path, tmp_path / source), log=lambda _: None)


def test_corpus_shorter_than_one_sequence(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", make_docs(4, words=5))
    with pytest.raises(DataError, match=r"has \d+ tokens .* fewer than one sequence of data\.seq_len \+ 1 = 1025"):
        prepare_data(config(tmp_path, corpus, seq_len=1024), log=lambda _: None)
    # seq_len applies when a store is opened: the store built before the error serves a shorter one.
    messages = []
    assert len(prepare_data(config(tmp_path, corpus, seq_len=8), log=messages.append).train) > 0
    assert not [m for m in messages if "tokeniz" in m]


def test_missing_tokenizer_path(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", make_docs(5))
    with pytest.raises(DataError, match=r"data\.tokenizer = '\./no/such/tokenizer': no such file or directory"):
        prepare_data(config(tmp_path, corpus, tokenizer="./no/such/tokenizer"), log=lambda _: None)


def test_unreachable_hub_dataset_suggests_local_files(tmp_path):
    with pytest.raises(DataError, match=r"data\.source = 'hf:.*could not be loaded.*local files"):
        load_documents(config(tmp_path, "hf:no-such-user/no-such-dataset-xyz"), log=lambda _: None)


# --------------------------------------------------------------------------------------------------
# tools/prepare_data.py


def test_prepare_data_cli(tmp_path, capsys):
    from pretrain.cli.prepare_data import main

    corpus = write_corpus(tmp_path / "corpus", make_docs(40, seed=9))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "batch: {global_batch_size: 8, micro_batch_size: 2}\ntrain: {max_steps: 10}\n"
        f"data: {{source: {corpus}, seq_len: 32, tokenizer_vocab_size: 300, num_proc: 1}}\n"
    )
    assert main(["--recipe", str(recipe), f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    out = capsys.readouterr().out
    assert "sequences" in out and "33 tokens each" in out and str(tmp_path / "cache" / "stores") in out

    assert main(["--recipe", str(recipe), f"data.source={tmp_path / 'nope'}"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: data.source = ") and "Traceback" not in captured.err
