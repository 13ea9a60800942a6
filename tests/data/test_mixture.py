"""Data mixtures: each source's share in every window of steps, an order that is a pure function of (seed,
step) on any world size, one store per source with a shared tokenizer, per-source metrics, the exhaustion
policy, and the errors a user sees. The end-to-end runs (1 vs 2 processes, kill -9 + rerun, stop) are slow."""

from __future__ import annotations

import json
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from pretrain.data import MixtureData, prepare_data
from pretrain.data.loader import RankBatchSampler
from pretrain.data.order import MixtureSampleOrder, data_horizon, stream_rows
from pretrain.errors import ConfigError, DataError
from pretrain.recipe.batching import plan_batches
from pretrain.recipe.config import BatchConfig, DataConfig
from tests.data.test_data import make_docs, write_corpus
from tests.data.test_store import full_manifest
from tests.helpers import (
    FAST,
    RUN,
    accelerate_launch,
    check_ok,
    make_recipe,
    metrics,
    recipe_data,
    train_here,
    train_killed_at,
    train_losses,
)

WEIGHTS = {"code": 0.2, "web": 0.7, "math": 0.1}


def shares(order: MixtureSampleOrder, steps: range) -> np.ndarray:
    """Each source's share of the rows (= tokens: every row is seq_len tokens) of these steps."""
    counts = order.rows_read(steps.stop) - order.rows_read(steps.start)
    return counts / counts.sum()


def test_every_source_gets_its_share_over_100_steps_and_in_every_window_of_10():
    order = MixtureSampleOrder({"code": 500, "web": 3000, "math": 120}, WEIGHTS, global_batch_size=8, seed=3,
                               shuffle=True, tokens_per_row=64)
    weights = np.array(list(WEIGHTS.values()))
    assert np.abs(shares(order, range(0, 100)) - weights).max() < 0.01
    for start in range(0, 91):
        assert np.abs(shares(order, range(start, start + 10)) - weights).max() < 0.05, start
    # The same from the batches themselves: rows of step k are counted by the source their index falls in.
    per_step = np.array([np.bincount(np.searchsorted(order.offsets, order.global_batch(k), side="right") - 1,
                                     minlength=3) for k in range(100)])
    assert (per_step.sum(axis=1) == 8).all()
    assert np.abs(per_step.sum(axis=0) / 800 - weights).max() < 0.01
    for start in range(0, 91):
        window = per_step[start : start + 10].sum(axis=0) / 80
        assert np.abs(window - weights).max() < 0.05, start


def test_stream_rows_never_decrease_and_stay_within_about_one_row_of_the_weights():
    rng = np.random.default_rng(0)
    for _ in range(50):
        raw = [Fraction(float(x)) for x in rng.uniform(0.01, 1, size=rng.integers(2, 7))]
        weights = [w / sum(raw) for w in raw]
        previous = [0] * len(weights)
        for rows in range(0, 600, 7):
            counts = stream_rows(weights, rows)
            assert sum(counts) == rows and all(c >= p for c, p in zip(counts, previous, strict=True))
            assert max(abs(c - float(w) * rows) for c, w in zip(counts, weights, strict=True)) < 1.5
            previous = counts


def test_order_is_a_pure_function_of_seed_and_step_and_the_same_on_any_world_size():
    rows = {"code": 50, "web": 300, "math": 7}
    a = MixtureSampleOrder(rows, WEIGHTS, 8, seed=5, shuffle=True, tokens_per_row=64)
    steps = [a.global_batch(k) for k in range(40)]
    fresh = MixtureSampleOrder(rows, WEIGHTS, 8, seed=5, shuffle=True, tokens_per_row=64)
    assert np.array_equal(fresh.global_batch(33), steps[33])  # resumed at step 33: nothing but the step
    other_seed = MixtureSampleOrder(rows, WEIGHTS, 8, seed=6, shuffle=True, tokens_per_row=64)
    assert not np.array_equal(other_seed.global_batch(0), steps[0])
    for world, mbs in ((1, 2), (2, 2), (4, 1)):
        plan = plan_batches(BatchConfig(global_batch_size=8, micro_batch_size=mbs), world, seq_len=64)
        samplers = [RankBatchSampler(a, plan, rank, start_step=10) for rank in range(world)]
        for k in (10, 11, 25):
            got = sorted(i for s in samplers for micro in s.micro_batch_indices(k) for i in micro)
            assert got == sorted(steps[k].tolist()), (world, k)


def test_each_source_reads_a_permutation_per_epoch_and_a_new_one_after():
    order = MixtureSampleOrder({"code": 50, "web": 300, "math": 7}, WEIGHTS, 8, seed=5, shuffle=True,
                               tokens_per_row=64)
    batches = np.concatenate([order.global_batch(k) for k in range(44)])  # 352 rows: math's 7 rows 5 times
    math = batches[batches >= order.offsets[2]] - order.offsets[2]
    epochs = [math[i : i + 7].tolist() for i in range(0, 35, 7)]
    assert all(sorted(e) == list(range(7)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # a new order each epoch
    # A source's order depends on its own name, not on the other sources.
    alone = MixtureSampleOrder({"math": 7, "other": 5}, {"math": 0.1, "other": 0.9}, 8, seed=5, shuffle=True,
                               tokens_per_row=64)
    epoch_3 = np.arange(21, 28)  # math's 7 rows of its epoch 3
    assert np.array_equal(alone._source_rows(0, epoch_3), order._source_rows(2, epoch_3))


def test_exhaustion_step_epochs_and_the_repeat_warning():
    order = MixtureSampleOrder({"code": 500, "web": 3000, "math": 30}, WEIGHTS, 8, seed=1, shuffle=True,
                               tokens_per_row=64)
    steps, name = order.steps_available()
    assert name == "math" and order.rows_read(steps)[2] <= 30 < order.rows_read(steps + 1)[2]
    assert order.epochs_read(100)["math"] == pytest.approx(order.rows_read(100)[2] / 30)
    assert data_horizon(order, steps, "stop") == (None, f"data: {steps} steps read code 0.122, web 0.071, "
                                                        "math 1 epochs per source")
    stop, message = data_horizon(order, 100, "stop")
    assert stop == steps and "source 'math' has been read once after step 38" in message
    assert data_horizon(order, 100, "repeat")[0] is None
    assert "warning" in data_horizon(order, 100, "repeat")[1] and "math 2.67" in data_horizon(order, 100, "repeat")[1]
    metrics_ = order.metrics(100)
    assert sum(v for k, v in metrics_.items() if k.startswith("data/tokens/")) == 100 * 8 * 64
    with pytest.raises(DataError, match="source 'math' has fewer sequences than its share of one optimizer step"):
        data_horizon(MixtureSampleOrder({"code": 50, "web": 500, "math": 1}, WEIGHTS, 80, 1, True, 64), 10, "stop")


# ---- the recipe ---------------------------------------------------------------------------------------


MIX = [{"name": "code", "source": "a", "weight": 0.2}, {"name": "web", "source": "b", "weight": 0.7},
       {"name": "math", "source": "c", "weight": 0.1}]


@pytest.mark.parametrize("data, message", [
    ({"mixture": [{**MIX[0], "weight": 0}, *MIX[1:]]}, "source 'code' has weight 0.0; every source needs a weight > 0"),
    ({"mixture": [{**MIX[0], "weight": -1}, *MIX[1:]]}, "source 'code' has weight -1.0"),
    ({"mixture": [*MIX, {**MIX[1], "source": "d"}]}, "data.mixture names source 'web' twice"),
    ({"mixture": [MIX[0], {**MIX[1], "weight": 0.6}, MIX[2]], "normalize_weights": False},
     "data.mixture weights sum to 0.9 (code 0.2 + web 0.6 + math 0.1), not 1, with data.normalize_weights=false"),
    ({"mixture": MIX, "source": "elsewhere"}, "data.source = 'elsewhere' is not used with data.mixture"),
    ({"mixture": MIX, "drop_last": False}, "data.drop_last=false applies to a single source"),
    ({"mixture": [{**MIX[0], "name": "a/b"}]}, "source name 'a/b' must be letters, digits"),
    ({"mixture": [{"name": "code", "weight": 1}]}, "missing required key 'data.mixture.0.source'"),
])
def test_bad_mixtures_are_one_clear_error(data, message):
    with pytest.raises(ConfigError) as info:
        make_recipe(data=data)
    assert message in str(info.value)


def test_weights_are_normalised_or_must_sum_to_one():
    doubled = [{**m, "weight": m["weight"] * 2} for m in MIX]
    assert make_recipe(data={"mixture": doubled}).data.mixture_weights() == pytest.approx(WEIGHTS)
    exact = make_recipe(data={"mixture": MIX, "normalize_weights": False})
    assert exact.data.mixture_weights() == pytest.approx(WEIGHTS)


# ---- stores ---------------------------------------------------------------------------------------------


def mixture_config(tmp_path: Path, **kwargs) -> DataConfig:
    sources = []
    for i, (name, weight) in enumerate(WEIGHTS.items()):
        corpus = tmp_path / "corpora" / name
        if not corpus.exists():
            write_corpus(corpus, make_docs(12, seed=20 + i))
        sources.append({"name": name, "source": str(corpus), "weight": weight})
    defaults = dict(cache_dir=str(tmp_path / "cache"), seq_len=32, tokenizer_vocab_size=300, num_proc=1,
                    val_fraction=0.2, store=str(tmp_path / "stores"), mixture=sources)
    return DataConfig(**{**defaults, **kwargs})


def test_one_store_per_source_with_one_tokenizer_read_through_one_index_space(tmp_path):
    data = prepare_data(mixture_config(tmp_path), log=lambda _: None)
    assert isinstance(data, MixtureData) and list(data.sources) == list(WEIGHTS)
    assert sorted(p.name for p in (tmp_path / "stores").iterdir() if p.is_dir()) == sorted(WEIGHTS)
    tokenizers = {(tmp_path / "stores" / n / "tokenizer" / "tokenizer.json").read_text() for n in WEIGHTS}
    assert len(tokenizers) == 1
    assert data.weights == pytest.approx(WEIGHTS)
    for i, (name, source) in enumerate(data.sources.items()):
        assert len(source.train) > 0 and data.stats["mixture"][name]["num_train_sequences"] == len(source.train)
        first = int(data.train.offsets[i])
        assert np.array_equal(data.train[first], source.train[0])
        assert np.array_equal(data.train[np.array([first + 1, first])], source.train[np.array([1, 0])])
    json.dumps(data.stats)


def test_a_source_without_files_and_a_store_of_another_tokenizer_name_the_source(tmp_path):
    cfg = mixture_config(tmp_path)
    (tmp_path / "empty").mkdir()
    empty = cfg.model_copy(update={"mixture": [*cfg.mixture[:2], cfg.mixture[2].model_copy(
        update={"source": str(tmp_path / "empty")})]})
    with pytest.raises(DataError, match=r"data.mixture source 'math': data.source = .*: the directory has no "):
        prepare_data(empty, log=lambda _: None)

    prepare_data(cfg, log=lambda _: None)
    other = cfg.model_copy(update={"tokenizer_vocab_size": 320})
    with pytest.raises(DataError, match=r"data.mixture source 'code': the token store at .*stores/code: the store "
                                        r"was made with tokenizer 'bpe-300' .* data.tokenizer is 'bpe-320'"):
        prepare_data(other, log=lambda _: None)


def test_prepare_data_cli_on_a_mixture_and_a_bad_weight_exit_2(tmp_path, capsys):
    from pretrain.cli.prepare_data import main

    cfg = mixture_config(tmp_path)
    recipe = tmp_path / "r.yaml"
    data = {k: v for k, v in cfg.model_dump(mode="json").items() if k in ("cache_dir", "seq_len", "store",
                                                                         "tokenizer_vocab_size", "val_fraction")}
    data["mixture"] = [{"name": m.name, "source": m.source, "weight": m.weight} for m in cfg.mixture]
    recipe.write_text(json.dumps(recipe_data(data=data)))
    assert main(["--recipe", str(recipe), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "tokenizer  bpe-300" in out and all(f"source {n!r} (weight {w:.4g})" in out for n, w in WEIGHTS.items())
    assert main(["--recipe", str(recipe), "data.mixture.0.weight=0"]) == 2  # a list item is not a section: error
    data["mixture"][0]["weight"] = 0
    recipe.write_text(json.dumps(recipe_data(data=data)))
    assert main(["--recipe", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "source 'code' has weight 0" in err and "Traceback" not in err


# ---- end to end (slow) ----------------------------------------------------------------------------------

E2E = [*FAST, "data.tokenizer_vocab_size=512", "data.val_fraction=0.2", "eval.every_steps=4",
       "eval.batches=1", "checkpoint.every_steps=4", "checkpoint.keep_last=0"]


def web_corpus(root: Path) -> Path:
    """A directory of jsonl files (a blank line and a record without text among them): the mixture's local source."""
    words = make_docs(1, seed=3)[0].split()
    for part in range(2):
        lines = []
        for i in range(24):
            if i == 5:
                lines.append("")  # a blank line holds no document, and is still counted
            elif i == 9:
                lines.append(json.dumps({"text": None, "id": i}))  # a record without text: no document either
            else:
                start = (part * 24 + i) * 7 % max(1, len(words) - 40)
                lines.append(json.dumps({"text": f"web page {part}-{i}: " + " ".join(words[start:start + 40]),
                                         "id": i}))
        (root / "web" / f"part-{part}").mkdir(parents=True, exist_ok=True)
        (root / "web" / f"part-{part}" / "pages.jsonl").write_text("\n".join(lines) + "\n")
    return root / "web"


def e2e_recipe(tmp_path: Path) -> str:
    """Two small standard-library packages, the first read several times over 8 steps, and a jsonl directory."""
    path = tmp_path / "mixture.yaml"
    web = web_corpus(tmp_path)
    path.write_text("base: " + str(Path(RUN).parents[1] / "recipes" / "tiny.yaml") + "\n"
                    "data:\n  mixture:\n"
                    "    - {name: json, source: 'stdlib:json', weight: 0.5}\n"
                    "    - {name: http, source: 'stdlib:http', weight: 0.3}\n"
                    f"    - {{name: web, source: '{web}', weight: 0.2}}\n")
    return str(path)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory) -> tuple[Path, Path]:
    """(run directory, recorded batches) of 8 steps of the e2e mixture on 2 DDP processes, MBS 2 x GAS 2: every
    micro-batch each rank trained on is written down by tests/record_batches_run.py."""
    base = tmp_path_factory.mktemp("two_process_mixture")
    out, recorded = base / "run", base / "recorded"
    check_ok(accelerate_launch("cpu_ddp.yaml", [*E2E, "train.max_steps=8", "batch.micro_batch_size=2",
                                                f"output_dir={out}"], recipe=e2e_recipe(base),
                               script=[str(Path(__file__).parents[1] / "record_batches_run.py"), str(recorded)]))
    return out, recorded


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_mixture_run_one_and_two_processes_agree_and_kill_9_resumes_exactly(tmp_path, two_process_run):
    recipe = e2e_recipe(tmp_path)
    args = [*E2E, "train.max_steps=8"]
    single, killed = tmp_path / "single", tmp_path / "killed"
    double = two_process_run[0]
    # The one-process runs train in this process (what run.py runs, without an interpreter start each); the
    # killed one is a real process, killed -9.
    _, _, console = train_here([*args, f"output_dir={single}"], recipe=recipe)
    assert "data: 8 steps read json" in console
    one, two = train_losses(single), train_losses(double)
    assert sorted(one) == sorted(two) == list(range(1, 9))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), (step, one[step], two[step])

    rows = {m["step"]: m for m in metrics(single) if "train/loss" in m}
    for step, m in rows.items():  # every step's tokens are split by the weights (within a row of 65 tokens)
        per_source = {k.split("/")[-1]: v for k, v in m.items() if k.startswith("data/tokens/")}
        assert sum(per_source.values()) == m["train/tokens_seen"] == step * 8 * 64
        for name, weight in (("json", 0.5), ("http", 0.3), ("web", 0.2)):
            assert abs(per_source[name] - weight * m["train/tokens_seen"]) <= 64 * 1.5, (step, name)
    evals = [m for m in metrics(single) if "val/loss" in m]
    assert [m["step"] for m in evals] == [0, 4, 8]
    for m in evals:
        weighted = 0.5 * m["val/loss/json"] + 0.3 * m["val/loss/http"] + 0.2 * m["val/loss/web"]
        assert m["val/loss"] == pytest.approx(weighted, rel=1e-12)
    config = json.loads((single / "run_config.json").read_text())
    assert config["data/mixture/json/weight"] == 0.5 and json.loads(config["recipe/data/mixture"])[1]["name"] == "http"

    train_killed_at(args, 4, killed, recipe=recipe)
    _, _, console = train_here([*args, f"output_dir={killed}"], recipe=recipe)
    assert "at step 4" in console
    resumed = train_losses(killed)
    assert sorted(resumed) == list(range(1, 9))
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(one[step], rel=1e-6, abs=1e-6), (step, resumed[step], one[step])


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_on_exhausted_stop_ends_the_run_with_a_checkpoint_where_a_source_runs_out(tmp_path):
    out = tmp_path / "run"
    # 8 training rows per source; json's 4 rows per step run out after step 2.
    _, _, console = train_here([*E2E, "train.max_steps=6", "data.train_subset=8", "data.on_exhausted=stop",
                                f"output_dir={out}"], recipe=e2e_recipe(tmp_path))
    assert "source 'json' has been read once after step 2: data.on_exhausted=stop ends the run there" in console
    assert "data: stopped after step 2/6: source 'json' has been read once" in console
    assert sorted(train_losses(out)) == [1, 2]
    assert (out / "checkpoints" / "step_00000002" / "trainer_state.json").exists()
    assert (out / "final_model").exists()


def test_a_tokenizer_moved_to_another_path_is_the_same_data_but_another_one_is_not():
    """A resume compares the tokenizer a checkpoint was trained with by its identity (what decides the token ids),
    not by its name: a tokenizer.json copied to another directory resumes; another tokenizer is refused."""
    from pretrain.data.mixture import SINGLE, data_changes

    def identity(name, digest):
        return {"source": "stdlib", "corpus_fingerprint": "c", "val_fraction": 0.1, "text_field": "text",
                "on_decode_error": "replace", "tokenizer": {"name": name, "identity": digest}}

    saved = {SINGLE: identity("/old/place/tokenizer.json", "5877271f")}
    assert data_changes(saved, {SINGLE: (identity("/new/place/tokenizer.json", "5877271f"), None)}) == []
    changed = data_changes(saved, {SINGLE: (identity("/old/place/tokenizer.json", "0badc0de"), None)})
    assert changed == ["data.source: tokenizer /old/place/tokenizer.json (identity 5877271f) -> "
                       "/old/place/tokenizer.json (identity 0badc0de)"]


# ---- pretrain-data which on the 2-process run ----------------------------------------------------------


def store_tokens(store: Path, span: dict) -> list[int]:
    """A document's tokens [start, stop) read straight from a store's files (the .ds and its .ds.index)."""
    manifest = json.loads((store / "manifest.json").read_text())
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    tokens = np.fromfile(store / "shards" / span["file"], dtype=dtype)
    ends = np.fromfile(store / "shards" / f"{span['file']}.index", dtype="<u8")
    begin = int(ends[span["document"] - 1]) if span["document"] else 0
    assert int(ends[span["document"]]) - begin == span["document_tokens"]
    return tokens[begin + span["start"] : begin + span["stop"]].astype(np.int64).tolist()


def which(capsys, *args: str) -> tuple[int, str, str]:
    from pretrain.cli.data import main

    code = main(["which", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_pretrain_data_which_names_the_documents_each_rank_trained_on(two_process_run, capsys):
    out, recorded = two_process_run
    trained = {}  # (step, rank, micro) -> the rows that rank took from its loader
    for rank in (0, 1):
        for line in (recorded / f"rank{rank}.jsonl").read_text().splitlines():
            batch = json.loads(line)
            trained[batch["step"], rank, batch["micro"]] = batch["rows"]
    assert sorted({k[0] for k in trained}) == list(range(1, 9)) and len(trained) == 8 * 2 * 2
    config = json.loads((out / "run_config.json").read_text())
    stores = {name: Path(config[f"data/mixture/{name}/cache_dir"]) for name in ("json", "http", "web")}

    for step in (1, 5, 8):
        code, text, _ = which(capsys, "--run", str(out), "--step", str(step), "--json")
        assert code == 0
        sequences = json.loads(text)
        assert len(sequences) == 8 and {(s["rank"], s["micro"]) for s in sequences} == {(0, 0), (0, 1), (1, 0), (1, 1)}
        for s in sequences:  # the named documents' tokens, read back from the store, are the ids the rank trained on
            ids = [t for span in s["documents"] for t in store_tokens(stores[s["source"]], span)]
            assert ids == trained[step, s["rank"], s["micro"]][s["position"]], (step, s)
        assert {s["source"] for s in sequences} == {"json", "http", "web"}  # 4 / 2.4 / 1.6 rows a step

    code, text, _ = which(capsys, "--run", str(out), "--step", "5", "--rank", "1", "--micro", "0")
    assert code == 0
    lines = text.splitlines()
    assert lines[0].startswith("step 5 of ") and "2 of 8 sequences of 65 tokens" in lines[0] and len(lines) == 4
    assert all(line.split()[0] == "1/0" and (".py[" in line or ".jsonl:" in line) for line in lines[2:])

    # The reverse: a document consumed at step 5 is listed with every read of it, step 5 (rank 1, micro 0) among them.
    step5 = json.loads(which(capsys, "--run", str(out), "--step", "5", "--rank", "1", "--micro", "0", "--json")[1])
    first = step5[0]
    span = first["documents"][0]
    document = f"{first['source']}:{span['file']}:{span['document']}"
    code, text, _ = which(capsys, "--run", str(out), "--document", document, "--json")
    assert code == 0
    reads = json.loads(text)["reads"]
    assert any((r["step"], r["rank"], r["micro"], r["position"], r["row"]) == (5, 1, 0, 0, first["row"]) for r in reads)
    for r in reads:  # each read holds a part of that document, and the rank really trained on that row
        assert any((d["file"], d["document"]) == (span["file"], span["document"]) for d in r["documents"])
        ids = [t for d in r["documents"] for t in store_tokens(stores[r["source"]], d)]
        assert ids == trained[r["step"], r["rank"], r["micro"]][r["position"]]

    for args, message in (
        (["--run", str(out / "nope"), "--step", "1"], "no run directory at"),
        (["--run", str(out), "--step", "9"], "has steps 1..8"),
        (["--run", str(out), "--step", "2", "--rank", "2"], "pass --rank from 0 to 1"),
        (["--run", str(out), "--document", "news:00000.train.ds:0"], "its sources are json, http, web"),
        (["--run", str(out), "--document", f"json:{span['file']}:100000"], "there is no document 100000"),
    ):
        code, _, err = which(capsys, *args)
        assert code == 2 and message in err and "Traceback" not in err, (args, err)


def source_text(origin: dict, root: Path) -> str:
    """The document an origin names, read from its input file as a person would open it."""
    path = Path(origin["path"])
    assert path == root / origin["file"] and path.is_file(), origin
    if "line" in origin:
        return json.loads(path.read_text().splitlines()[origin["line"] - 1])["text"]
    return path.read_text(encoding="utf-8")


@pytest.mark.slow
def test_pretrain_data_which_names_the_source_file_and_line_of_every_document(two_process_run, capsys):
    """Issue 37: every sequence's documents are named by their source, an input file relative to the source's
    directory and its line (jsonl) or the whole file (stdlib .py): the named line's text is the document the rank
    trained on (decoded from the store), and --document accepts that form, with or without the source's name."""
    from transformers import PreTrainedTokenizerFast

    out, _ = two_process_run
    config = json.loads((out / "run_config.json").read_text())
    stores = {name: Path(config[f"data/mixture/{name}/cache_dir"]) for name in ("json", "http", "web")}
    roots = {name: Path(json.loads((store / "manifest.json").read_text())["provenance"]["root"])
             for name, store in stores.items()}
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(stores["web"] / "tokenizer"))
    seen = {"line": 0, "file": 0}
    for step in (2, 7):
        code, text, _ = which(capsys, "--run", str(out), "--step", str(step), "--json")
        assert code == 0
        for s in json.loads(text):
            for span in s["documents"]:
                origin = span["origin"]
                whole = tokenizer.decode(store_tokens(stores[s["source"]], {**span, "start": 0,
                                                                            "stop": span["document_tokens"] - 1}))
                assert whole == source_text(origin, roots[s["source"]]), (step, s["source"], origin)
                seen["line" if "line" in origin else "file"] += 1
                if s["source"] == "web":
                    assert origin["file"].startswith("part-") and origin["file"].endswith("/pages.jsonl")
    assert seen["line"] and seen["file"]  # both kinds of source met

    # --document in the source's form, resolved to the same store document (with and without the source's name)
    step = json.loads(which(capsys, "--run", str(out), "--step", "7", "--json")[1])
    web = next(span for s in step if s["source"] == "web" for span in s["documents"])
    named = f"{web['origin']['file']}:{web['origin']['line']}"
    for form in (named, f"web:{named}"):
        code, text, err = which(capsys, "--run", str(out), "--document", form, "--json", "--text")
        assert code == 0, err
        answer = json.loads(text)
        assert (answer["source"], answer["file"], answer["index"]) == ("web", web["file"], web["document"])
        assert answer["text"].startswith(source_text(web["origin"], roots["web"]))
        assert any(r["step"] == 7 for r in answer["reads"])
    code, text, _ = which(capsys, "--run", str(out), "--document", named)
    assert code == 0 and text.startswith(f"{named} (web:{web['file']}:{web['document']} in the store): rows ")
    code, text, _ = which(capsys, "--run", str(out), "--step", "7", "--rank", "0", "--micro", "1", "--text")
    assert code == 0 and "preview" not in text.splitlines()[1] and len(text.splitlines()) > 6

    # A document of the validation split is named so: training never read it
    manifest = full_manifest(stores["web"])
    shard = next(s for s in manifest["shards"] if s["val"]["num_documents"])
    first, source, _ = shard["val"]["origin"]["runs"][0]
    line = np.fromfile(stores["web"] / "shards" / f"{shard['val']['file']}.origin", dtype=shard["val"]["origin"]["dtype"])
    held_out = f"{Path(shard['inputs'][source][0]).relative_to(roots['web'])}:{int(line[first])}"
    code, _, err = which(capsys, "--run", str(out), "--document", held_out)
    assert code == 2 and "is in the validation split of source 'web'" in err and "training never read it" in err

    part = web["origin"]["file"].split("/")[0]
    for document, message in (
        (f"{part}/pages.jsonl:6", "no training document of the run's source(s)"),  # the blank line
        (f"{part}/pages.jsonl:10", "empty lines hold no document"),  # the record without text
        ("web:nope.jsonl:1", "no training document of the run's source(s) web came from there"),
        ("hf:someone/data:3", "(none of that kind)"),
    ):
        code, _, err = which(capsys, "--run", str(out), "--document", document)
        assert code == 2 and message in err and "Traceback" not in err, (document, err)


@pytest.mark.slow
def test_pretrain_data_which_refuses_a_store_changed_at_the_same_size(two_process_run, tmp_path, capsys):
    """Issue 36: training refuses a store whose shard changed at the same size (its checksums); the lookup answered
    from it, naming other documents. It verifies the stores as the run does."""
    out, _ = two_process_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    config = json.loads((run / "run_config.json").read_text())
    for key in [k for k, v in config.items() if k.endswith("/cache_dir") and v]:  # each store copied, recorded
        copy = tmp_path / "stores" / key.replace("/", "_")
        shutil.copytree(config[key], copy)
        config[key] = str(copy)
    (run / "run_config.json").write_text(json.dumps(config))
    assert which(capsys, "--run", str(run), "--step", "3")[0] == 0
    shard = next(p for p in (tmp_path / "stores").rglob("*.ds") if p.stat().st_size > 64)
    data = bytearray(shard.read_bytes())
    data[16] ^= 0xFF  # one token changed, the size kept
    shard.write_bytes(bytes(data))
    code, _, err = which(capsys, "--run", str(run), "--step", "3")
    assert code == 2 and str(shard.name) in err and "Traceback" not in err, err


def test_pretrain_data_which_after_a_resume_on_another_world_size(two_process_run, tmp_path, capsys):
    """The 2-process run as a resume at step 4 on 1 process (MBS 2 x GAS 4) leaves it: run_config.json with that
    plan and resume/step 4, step 8's checkpoint written by it. Every step has the same sequences as before; steps
    5-8 are split by the new layout, steps 1-4 by the launch that ran them (launches.jsonl), and without that record
    (an older run directory whose checkpoints disagree on their layout) have no rank."""
    out, _ = two_process_run
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(out / "recipe.resolved.yaml", resumed)
    config = json.loads((out / "run_config.json").read_text())
    config.update({"plan/world_size": 1, "plan/grad_accum_steps": 4, "dist/world_size": 1, "resume/step": 4,
                   "resume/from": str(out / "checkpoints" / "step_00000004")})
    (resumed / "run_config.json").write_text(json.dumps(config))
    for step, world, gas in ((4, 2, 2), (8, 1, 4)):
        state = json.loads((out / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").read_text())
        assert state["plan"]["world_size"] == 2
        state["plan"].update(world_size=world, grad_accum_steps=gas)
        (resumed / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (resumed / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").write_text(json.dumps(state))

    def rows(run: Path, step: int) -> tuple[list, set]:
        code, text, err = which(capsys, "--run", str(run), "--step", str(step), "--json")
        assert code == 0, err
        answer = json.loads(text)
        return answer, {(s["source"], s["row"]) for s in answer}

    for step in (3, 6):
        before, after = rows(out, step), rows(resumed, step)
        assert after[1] == before[1] and len(after[0]) == 8  # the same global batch on any world size
    assert {(s["rank"], s["micro"]) for s in rows(resumed, 6)[0]} == {(0, m) for m in range(4)}
    # Without launches.jsonl (a run directory written before it was recorded): steps 1-4 have no rank
    assert {(s["rank"], s["micro"]) for s in rows(resumed, 3)[0]} == {(None, None)}
    code, _, err = which(capsys, "--run", str(resumed), "--step", "3", "--rank", "0")
    assert code == 2 and "ran before the resume at step 4" in err and "drop --rank and --micro" in err
    code, text, _ = which(capsys, "--run", str(resumed), "--step", "3")
    assert code == 0 and text.splitlines()[2].split()[0] == "?"
    assert "rank/micro: not recorded before the resume at step 4" in text.splitlines()[0]

    # launches.jsonl: the 2-process launch wrote its record (from step 0); the resume on 1 process adds its own.
    [launch] = [json.loads(line) for line in (out / "launches.jsonl").read_text().splitlines()]
    assert launch["from_step"] == 0 and launch["plan"]["world_size"] == 2
    one = {**launch, "from_step": 4, "plan": {**launch["plan"], "world_size": 1, "grad_accum_steps": 4}}
    (resumed / "launches.jsonl").write_text(json.dumps(launch) + "\n" + json.dumps(one) + "\n")
    assert {(s["rank"], s["micro"]) for s in rows(resumed, 3)[0]} == {(r, m) for r in range(2) for m in range(2)}
    assert rows(resumed, 3)[0] == rows(out, 3)[0]  # step 3 as the 2-process launch that ran it split it
    code, text, _ = which(capsys, "--run", str(resumed), "--step", "3", "--rank", "1")
    assert code == 0 and "rank/micro: world 2, MBS 2, GAS 2" in text.splitlines()[0]
    code, text, _ = which(capsys, "--run", str(resumed), "--step", "6")
    assert code == 0 and "rank/micro: world 1, MBS 2, GAS 4" in text.splitlines()[0]
    (resumed / "launches.jsonl").unlink()

    # Stores that no longer hold what the run trained on (another content digest than its newest checkpoint's)
    state_file = resumed / "checkpoints" / "step_00000008" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["data"]["mixture:http"]["content"] = "0" * 16
    state_file.write_text(json.dumps(state))
    code, _, err = which(capsys, "--run", str(resumed), "--step", "3")
    assert code == 2 and "not the data the run trained on (step_00000008)" in err and "holds other tokens" in err
