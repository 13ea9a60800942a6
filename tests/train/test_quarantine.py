"""stability.rollback's per-document scores and skip: documents: the order without a quarantined document's rows,
the poison found, the quarantine list, data.exclude and pretrain-data quarantine."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil

import numpy as np
import pytest

from pretrain.checkpoint.rundir import read_state
from pretrain.data.order import FilteredOrder, GlobalSampleOrder, MixtureSampleOrder, Quarantine, Window
from pretrain.errors import ConfigError
from tests.helpers import ROOT, OneThread, train_killed_at, train_losses

# ---- the order, alone ---------------------------------------------------------------------------------------------


def _flat(order, batches: int) -> np.ndarray:
    return np.concatenate([order.global_batch(u) for u in range(batches)])


def _filtered_by_hand(base: np.ndarray, windows, quarantines) -> np.ndarray:
    """The base stream less what the removals name, element by element (the definition)."""
    keep = np.ones(len(base), dtype=bool)
    for start, stop in windows:
        keep[start:stop] = False
    for start, samples in quarantines:
        keep[start:] &= ~np.isin(base[start:], samples)
    return base[keep]


ORDERS = {
    "single": lambda: GlobalSampleOrder(num_samples=50, global_batch_size=4, seed=3, shuffle=True, drop_last=True),
    "spanning epochs": lambda: GlobalSampleOrder(num_samples=50, global_batch_size=4, seed=3, shuffle=True,
                                                 drop_last=False),
    "mixture": lambda: MixtureSampleOrder({"a": 30, "b": 20}, {"a": 0.6, "b": 0.4}, 4, 3, True, 65),
}


def test_windows_alone_read_what_skipping_whole_batches_read():
    order = ORDERS["single"]()
    filtered = FilteredOrder(order, [(9, 10), (3, 5)])  # two rollbacks' windows as older records give them
    kept = [u for u in range(40) if not (3 <= u <= 5 or 9 <= u <= 10)]
    for step in range(20):
        assert filtered.batch_index(step) == kept[step]
        assert np.array_equal(filtered.global_batch(step), order.global_batch(kept[step]))
    assert filtered.steps_available() == (12 - 5, "")
    same = FilteredOrder(order, [Window(36, 44), Window(12, 24)])  # the same windows as positions
    assert all(np.array_equal(same.global_batch(s), filtered.global_batch(s)) for s in range(20))


@pytest.mark.parametrize("kind", list(ORDERS))
def test_a_quarantine_removes_exactly_its_rows_keeps_the_batch_size_and_fills_from_the_next_samples(kind):
    order = ORDERS[kind]()
    base = _flat(order, 80)
    samples = [int(base[5]), int(base[17]), int(base[30])]  # one before the start: read there, left out later
    windows, quarantines = [(8, 16)], [(10, samples)]
    filtered = FilteredOrder(order, [Window(8, 16), Quarantine.of(10, samples)])
    expected = _filtered_by_hand(base, windows, quarantines)
    stream = np.concatenate([filtered.global_batch(s) for s in range(60)])
    assert all(len(filtered.global_batch(s)) == 4 for s in range(60))
    assert np.array_equal(stream, expected[: len(stream)])
    assert not np.isin(stream[len(_filtered_by_hand(base[:10], windows, [])):], samples).any()
    # random access (a resume at any step, a fresh order) reads what reading in order read
    for step in (37, 2, 59, 11):
        assert np.array_equal(FilteredOrder(order, [Window(8, 16), Quarantine.of(10, samples)]).global_batch(step),
                              stream[step * 4 : (step + 1) * 4])
    assert filtered.batch_index(0) == 0 and filtered.batch_index(59) >= 59 + 2


def test_a_window_then_a_quarantine_compose_and_base_positions_name_the_first_element():
    order = ORDERS["single"]()
    base = _flat(order, 60)
    first = FilteredOrder(order, [(2, 3)])  # a window rollback: batches 2-3
    start = first.base_position(5)  # a later rollback back to step 5 quarantines from there
    assert start == (5 + 2) * 4
    samples = [int(base[start + 1]), int(base[start + 6])]
    both = FilteredOrder(order, [(2, 3), Quarantine.of(start, samples)])
    for step in range(5):  # the steps before the quarantine's start are untouched
        assert np.array_equal(both.global_batch(step), first.global_batch(step))
    expected = _filtered_by_hand(base, [(8, 16)], [(start, samples)])
    assert np.array_equal(np.concatenate([both.global_batch(s) for s in range(40)]), expected[:160])
    assert both.base_position(5) == start
    # the horizon of data.on_exhausted=stop: an estimate, one occurrence per excluded row
    assert both.steps_available() == ((12 * 4 - 8 - 2) // 4, "")


# ---- end to end: a poison document ------------------------------------------------------------------------------

def _bench():
    spec = importlib.util.spec_from_file_location("poison_bench", ROOT / "tools" / "poison_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seed", [0, 3])
def test_a_poison_document_spikes_rolls_back_and_ranks_in_the_top_3(tmp_path, seed):
    """tools/poison_bench.py's trial (its 20 seeds are the benchmark): the step that reads the poison's rows is
    skipped by the spike rule, the run rolls back, and the reloaded model ranks the poison in the window's top 3."""
    with OneThread():
        result = _bench().trial(tmp_path, seed, documents=False)
    assert result["rolled_back"] and result["poison_rank"] is not None and result["poison_rank"] <= 3, result
    ranked = [json.loads(line) for line in (tmp_path / "window" / "rollback_scores" / "rollback-0001.jsonl")
              .read_text().splitlines()]
    assert [r["rank"] for r in ranked] == list(range(1, len(ranked) + 1))
    assert all(math.isfinite(r["loss_per_token"]) and r["tokens"] > 0 for r in ranked)


@pytest.fixture(scope="module")
def quarantined(tmp_path_factory):
    """A poisoned run with skip: documents (seed 2)."""
    work = tmp_path_factory.mktemp("quarantine")
    bench = _bench()
    corpus, text = bench.write_corpus(work / "corpus", 2)
    args = [*bench.ARGS, f"data.source={corpus}", f"data.cache_dir={work / 'cache'}", "train.seed=2",
            "stability.rollback.skip=documents", "logging.progress=plain"]
    with OneThread():
        trainer, console = bench.train([*args, f"output_dir={work / 'run'}"])
    return work, args, bench.poison_document(trainer, text), console


def test_skip_documents_quarantines_the_poison_and_goes_on_without_its_rows(quarantined):
    work, _, poison, console = quarantined
    out = work / "run"
    records = [json.loads(line) for line in (out / "rollbacks.jsonl").read_text().splitlines()]
    first = records[0]
    assert first["skip"] == "documents" and first["quarantine"]["from"] == first["positions"][0]
    listed = json.loads((out / "quarantine.json").read_text())["documents"]
    assert poison in [(d["source"], d["file"], d["document"]) for d in listed]
    entry = next(d for d in listed if (d["source"], d["file"], d["document"]) == poison)
    assert entry["rollback"] == 1 and entry["tokens"] > 0 and entry["store"]["content"]
    assert "quarantined document(s)" in console and "scored" in console
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, 41)) and all(math.isfinite(v) for v in losses.values())
    # the rows of the poison are never read again after the quarantine's start (pretrain-data which's order)
    from pretrain.checkpoint.rundir import read_run
    from pretrain.data.lookup import RunData

    run = RunData.open(read_run(out))
    samples = set(first["quarantine"]["samples"])
    after = [i for s in range(first["to_step"], 40) for i in run.order.global_batch(s).tolist()]
    assert not samples & set(after)


def test_a_resume_after_a_kill_past_the_quarantine_reproduces_the_losses(quarantined, tmp_path):
    """A run killed right after the quarantine rollback (only rollbacks.jsonl knows it) and one killed after the
    next checkpoint: both resume and train what the uninterrupted run trained, loss for loss."""
    work, args, _, _ = quarantined
    out = work / "run"
    record = json.loads((out / "rollbacks.jsonl").read_text().splitlines()[0])
    bench = _bench()
    for resume_step, keep_records in ((record["to_step"], True), (record["to_step"] + 2, False)):
        copy = tmp_path / f"resumed_{resume_step}"
        shutil.copytree(out, copy)
        for path in (copy / "checkpoints").iterdir():
            state = read_state(path) if path.is_dir() else None
            if path.name.startswith(".rolled") or (state is not None and state["step"] > resume_step):
                shutil.rmtree(path)
        (copy / "checkpoints" / "latest").write_text(f"step_{resume_step:08d}\n")
        if not keep_records:  # the checkpoint alone carries the quarantine
            kept = [line for line in (copy / "rollbacks.jsonl").read_text().splitlines()
                    if json.loads(line)["to_step"] > resume_step]
            (copy / "rollbacks.jsonl").write_text("".join(line + "\n" for line in kept))
        metrics = copy / "metrics.jsonl"  # the steps after the resume are trained again, not copied
        metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                                   if json.loads(line).get("step", 0) <= resume_step))
        with OneThread():
            _, console = bench.train([*args, f"output_dir={copy}"])
        assert f"resume: continuing from {copy / 'checkpoints' / f'step_{resume_step:08d}'}" in console
        assert train_losses(copy) == train_losses(out), resume_step


@pytest.mark.slow
def test_kill_9_after_the_quarantine_resumes_on_the_uninterrupted_losses(quarantined, tmp_path):
    """The poisoned run as a real process (tests.helpers.train_killed_at): it rolls back, quarantines, retrains, and
    is killed -9 once the second checkpoint after the quarantine is complete; the same command continues from it and
    every step's loss is the uninterrupted run's (the quarantine's removal replayed from the checkpoint)."""
    work, args, _, _ = quarantined
    record = json.loads((work / "run" / "rollbacks.jsonl").read_text().splitlines()[0])
    killed_at = record["to_step"] + 4
    killed = tmp_path / "killed"
    train_killed_at(args, killed_at, killed, recipe=str(ROOT / "recipes" / "tiny.yaml"))
    assert [json.loads(line)["skip"] for line in (killed / "rollbacks.jsonl").read_text().splitlines()] == ["documents"]
    with OneThread():
        _, console = _bench().train([*args, f"output_dir={killed}"])
    resumed_from = int(re.search(r"resume: continuing from \S+/step_(\d+)", console).group(1))
    assert killed_at <= resumed_from < 40, console  # past the quarantine (kill -9 lands a step or two later)
    resumed, uninterrupted = train_losses(killed), train_losses(work / "run")
    assert sorted(resumed) == sorted(uninterrupted) == list(range(1, 41))
    assert resumed == uninterrupted


def test_data_exclude_leaves_the_listed_rows_out_from_step_0_and_a_bad_list_is_one_error(quarantined, tmp_path):
    work, args, poison, _ = quarantined
    bench = _bench()
    out = tmp_path / "excluded"
    with OneThread():
        trainer, console = bench.train([*args, f"data.exclude=[{work / 'run'}]", f"output_dir={out}",
                                        "train.max_steps=6"])
    assert "data.exclude: " in console and "left out from step 0" in console
    excluded = set(trainer.rollback.excluded["samples"])
    assert excluded and not excluded & {i for s in range(6) for i in trainer.train_data.order.global_batch(s)}
    assert read_state(out / "checkpoints" / "step_00000006")["components"]["rollback"]["excluded"]["samples"]
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"cannot read the quarantine list .*bad.json .*pretrain-data quarantine"):
        bench.train([*args, f"data.exclude=[{tmp_path / 'bad.json'}]", f"output_dir={tmp_path / 'bad'}"])


def test_pretrain_data_quarantine_lists_adds_and_removes(quarantined, capsys):
    from pretrain.cli.data import main

    work, _, poison, _ = quarantined
    out = work / "run"
    name = ":".join(map(str, poison))
    listed = json.loads((out / "quarantine.json").read_text())["documents"]
    source_name = next(d["origin"]["name"] for d in listed if (d["source"], d["file"], d["document"]) == poison)
    assert source_name == "corpus.jsonl:" + str(source_name.rsplit(":", 1)[1])  # the poison's line of the jsonl file
    assert main(["quarantine", "--run", str(out)]) == 0
    assert f"  {source_name}  ({name} in the store; rollback 1" in capsys.readouterr().out
    assert main(["quarantine", "--run", str(out), "--remove", name]) == 0
    assert poison not in [(d["source"], d["file"], d["document"])
                          for d in json.loads((out / "quarantine.json").read_text())["documents"]]
    assert main(["quarantine", "--run", str(out), "--add", source_name]) == 0  # by its input file and line
    assert "added to" in capsys.readouterr().out
    assert poison in [(d["source"], d["file"], d["document"])
                      for d in json.loads((out / "quarantine.json").read_text())["documents"]]
    assert main(["quarantine", "--run", str(out), "--add", "data:nope.ds:1"]) == 2
    assert main(["quarantine", "--run", str(out), "--remove", "data:00000.train.ds:99999"]) == 2
    assert main(["quarantine", "--run", str(out), "--remove", "garbage"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "expected SOURCE:FILE:INDEX" in err and "no training document" in err


def test_skip_documents_is_refused_under_tensor_or_context_parallelism():
    from pretrain.distributed.layout import Launch
    from pretrain.recipe.config import load_recipe
    from pretrain.train.preflight import check_layout
    from tests.helpers import FAST, TINY

    recipe = load_recipe(TINY, [*FAST, "stability.rollback.skip=documents"])
    launch = Launch("fsdp", num_nodes=1, gpus_per_node=4, tp_size=2)
    with pytest.raises(ConfigError, match="stability.rollback.skip=documents .* use skip=window"):
        check_layout(recipe, launch)

