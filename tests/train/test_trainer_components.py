"""The trainer's components, each alone and without training: checkpoint state and compatibility keys,
the resume decision and save cadence, stop signals, the throughput monitor, and the log / eval cadences."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import BaseModel

import pretrain.checkpoint.resume as checkpoint
import pretrain.distributed.agreement as agreement
from pretrain.checkpoint.checkpointer import Checkpointer
from pretrain.checkpoint.reshard import ResumeSource
from pretrain.checkpoint.resume import (
    MUST_MATCH,
    ResumeChoice,
    agree_on_resume,
    check_compatible,
    recipe_field,
    resume_checkpoint,
)
from pretrain.checkpoint.rundir import STATE_FILE, read_state
from pretrain.checkpoint.state import RunState, TrainerState, TrainProgress
from pretrain.distributed.preemption import STOP_SIGNALS, StopSignals
from pretrain.errors import ConfigError
from pretrain.recipe.config import CheckpointConfig, Recipe, load_recipe
from pretrain.train.evaluation import Evaluator
from pretrain.train.metrics import ThroughputMonitor
from pretrain.train.tracking import Console, StepLog, format_duration
from tests.fakes import CountingPart, FakeAccelerator
from tests.helpers import TINY, env, free_port


@pytest.fixture(scope="module")
def recipe() -> dict:
    return load_recipe(TINY).to_dict()


# ---- checkpoint state and compatibility ------------------------------------------------------------


@pytest.mark.parametrize("key", MUST_MATCH)
def test_every_compatibility_key_names_a_recipe_field(key):
    model = Recipe
    for part in key.split("."):
        assert isinstance(model, type) and issubclass(model, BaseModel), f"{key}: {model} has no fields"
        assert part in model.model_fields, f"{key}: no field {part!r} in {model.__name__}"
        model = model.model_fields[part].annotation


def test_recipe_field_refuses_unknown_and_too_deep_keys():
    assert recipe_field("model.hidden_size").annotation is int
    for key in ("model.hiden_size", "modl.hidden_size", "train.seed.value", "nope"):
        with pytest.raises(KeyError, match="names no field"):
            recipe_field(key)


def test_compatibility_check_fails_loudly_on_an_unknown_key(recipe, monkeypatch):
    monkeypatch.setattr(checkpoint, "MUST_MATCH", (*MUST_MATCH, "model.renamed_field"))
    with pytest.raises(KeyError, match="model.renamed_field"):
        check_compatible(Path("ckpt"), recipe, recipe)


def test_compatibility_check_refuses_shape_changes_and_reports_the_rest(recipe):
    changed = json.loads(json.dumps(recipe))
    changed["optim"]["lr"] = recipe["optim"]["lr"] * 2
    changed["logging"]["project"] = "elsewhere"
    assert check_compatible(Path("ckpt"), recipe, changed) == [
        f"optim.lr: {recipe['optim']['lr']!r} -> {changed['optim']['lr']!r}"]
    changed["model"]["hidden_size"] += 8
    with pytest.raises(ConfigError, match="cannot resume from ckpt: .*model.hidden_size"):
        check_compatible(Path("ckpt"), recipe, changed)


def test_trainer_state_round_trips_and_reads_old_checkpoints(tmp_path, recipe):
    state = TrainerState(step=7, tokens_seen=7 * 512, num_steps=20, plan={"global_batch_size": 8}, recipe=recipe)
    assert TrainerState.from_json(state.to_json()) == state
    written = json.loads(state.to_json())
    assert {"step", "tokens_seen", "num_steps", "plan", "recipe", "layout", "data", "components",
            "optimizer_params", "saved_at", "python", "torch"} == set(written)

    old = {k: v for k, v in written.items() if k not in ("layout", "components", "optimizer_params")}  # before all three
    old = {**old, "samples_seen": 56, "data_cursor": {"kind": "global_step", "step": 7, "seed": 1234},
           "recipe_fingerprint": "0123456789abcdef", "saved_at": 1.5,
           "stability": {"losses": [2.0], "grad_norms": [1.0], "skipped": 1, "consecutive": 0},
           "rollbacks": [{"to_step": 4, "batches": [4, 5]}]}
    (tmp_path / STATE_FILE).write_text(json.dumps(old))
    loaded = TrainerState.read(tmp_path)
    assert (loaded.step, loaded.tokens_seen, loaded.num_steps, loaded.saved_at, loaded.layout) == (7, 3584, 20, 1.5, None)
    assert loaded.recipe == recipe
    # the parts that now hold what older checkpoints kept at the top (the rollbacks' timeline: that save's time)
    assert loaded.states() == {"progress": {"step": 7, "tokens_seen": 3584, "num_steps": 20},
                               "stability": old["stability"],
                               "rollback": {"records": old["rollbacks"], "saved_at": 1.5}}
    assert TrainerState.read(tmp_path / "missing") is None


def _fake_checkpoint(run_dir: Path, step: int) -> Path:
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    state = TrainerState(step=step, tokens_seen=step, num_steps=10, plan={}, recipe={})
    (path / STATE_FILE).write_text(state.to_json())
    return path


def test_resume_decision_needs_no_accelerator(tmp_path):
    run = tmp_path / "run"
    assert resume_checkpoint(run, CheckpointConfig(resume="auto")) is None
    assert resume_checkpoint(run, CheckpointConfig(resume="none")) is None
    _fake_checkpoint(run, 2)
    newest = _fake_checkpoint(run, 4)
    assert resume_checkpoint(run, CheckpointConfig(resume="auto")) == newest
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        resume_checkpoint(run, CheckpointConfig(resume="none"))
    assert resume_checkpoint(tmp_path / "other", CheckpointConfig(resume=str(newest))) == newest
    with pytest.raises(ConfigError, match="is not a complete checkpoint directory"):
        resume_checkpoint(run, CheckpointConfig(resume=str(tmp_path)))


def test_rank_0_decides_once_and_keeps_an_error_for_every_rank_to_raise(tmp_path):
    run = tmp_path / "run"
    assert ResumeChoice.decide(run, CheckpointConfig(resume="auto")).path is None
    newest = _fake_checkpoint(run, 4)
    choice = ResumeChoice.decide(run, CheckpointConfig(resume="auto"))
    assert (choice.path, choice.step, choice.error, choice.resume) == (str(newest), 4, None, "auto")
    refused = ResumeChoice.decide(run, CheckpointConfig(resume="none"))  # kept, not raised, before the group
    assert refused.path is None and "already holds checkpoints" in refused.error


def test_every_rank_follows_rank_0_or_every_rank_raises(tmp_path):
    """One process (accelerate's collectives pass values through): the rank follows rank 0's choice, raises
    rank 0's error, and refuses a checkpoint that it sees at another step than rank 0 recorded."""
    from accelerate import PartialState

    acc = PartialState()
    run = tmp_path / "run"
    older, newest = _fake_checkpoint(run, 2), _fake_checkpoint(run, 4)
    choice = ResumeChoice.decide(run, CheckpointConfig(resume="auto"))
    assert agree_on_resume(acc, choice, run) == newest
    assert agree_on_resume(acc, ResumeChoice.decide(tmp_path / "fresh", CheckpointConfig()), tmp_path) is None
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        agree_on_resume(acc, ResumeChoice.decide(run, CheckpointConfig(resume="none")), run)
    other_view = ResumeChoice(resume="auto", host="node-a", path=str(older), step=3)
    with pytest.raises(ConfigError) as refused:
        agree_on_resume(acc, other_view, run)
    assert str(refused.value).startswith(
        f"the ranks do not see the same checkpoint to resume from: rank 0 (host node-a) chose {older} at step 3 "
        f"(checkpoint.resume=auto), and rank 0 (host ")
    assert f"found a checkpoint at step 2 at {older.resolve()} (newest visible: {newest} at step 4)" in str(refused.value)
    assert "not on node-local disk" in str(refused.value)


def test_rank_problems_merge_ranks_with_the_same_host_and_problem(monkeypatch):
    views = [("a", None), ("a", None), ("b", "does not see it"), ("b", "does not see it"), ("c", "does not see it"),
             ("b", "sees step 2"), ("d", None), ("b", "does not see it")]
    monkeypatch.setattr(agreement, "gather_object", lambda local: views)
    assert agreement.rank_problems(None, None) == [
        "ranks 2, 3, 7 (host b) does not see it", "rank 4 (host c) does not see it", "rank 5 (host b) sees step 2"]
    monkeypatch.setattr(agreement, "gather_object", lambda local: [("a", None)] + [("b", "x")] * 8)
    assert agreement.rank_problems(None, None) == ["ranks 1-8 (host b) x"]


@pytest.mark.parametrize(
    "every, save_last, expected",
    [(0, True, [10]), (0, False, []), (4, True, [4, 8, 10]), (4, False, [4, 8]), (5, True, [5, 10])],
)
def test_checkpointer_owns_the_save_cadence(tmp_path, every, save_last, expected):
    cfg = CheckpointConfig(every_steps=every, save_last=save_last)
    checkpointer = Checkpointer(None, tmp_path, cfg, num_steps=10)
    assert [step for step in range(1, 11) if checkpointer.should_save(step)] == expected


def test_checkpointer_saves_typed_state_and_loads_it_back(tmp_path, recipe):
    logged = []
    acc = FakeAccelerator(gradient_accumulation_steps=2)
    checkpointer = Checkpointer(acc, tmp_path, CheckpointConfig(keep_last=1), num_steps=10, log=logged.append)
    for step in (3, 6):
        path = checkpointer.save(TrainerState(step=step, tokens_seen=step * 512, num_steps=10, plan={}, recipe=recipe))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000006"]
    assert read_state(path)["saved_at"] > 0 and "checkpoint: saved step 6" in logged[-1]
    checkpointer.load(ResumeSource(path, path, saved=None), seed=0)
    assert acc.loaded == str(path)
    assert acc.step == 12  # accelerate's micro-step counter, in this launch's GAS
    assert f"resume: continuing from {path} at step 6" in logged[-1]


def test_the_run_state_saves_and_loads_every_registered_part_in_order(tmp_path):
    """What a checkpoint records of the run state is the registered parts' state dicts, and a load gives each its
    own back, in registration order; a part the checkpoint predates keeps its fresh state and is named."""
    progress, counter, logged = TrainProgress(num_steps=10), CountingPart(), []
    state = RunState(log=logged.append, progress=progress, counter=counter)
    progress.advance(512)
    counter.count = 3
    record = TrainerState.of(state.state_dict(), plan={}, recipe={})
    assert (record.step, record.tokens_seen, record.num_steps, record.components) == (1, 512, 10, {"counter": {"count": 3}})
    (tmp_path / STATE_FILE).write_text(record.to_json())

    fresh_progress, fresh_counter, other = TrainProgress(num_steps=20), CountingPart(), CountingPart()
    fresh = RunState(log=logged.append, progress=fresh_progress, counter=fresh_counter, added_later=other)
    fresh.load_state_dict(TrainerState.read(tmp_path).states())
    assert (fresh_progress.step, fresh_progress.tokens_seen, fresh_progress.num_steps) == (1, 512, 20)  # the recipe's horizon
    assert (fresh_counter.count, other.count) == (3, 0)
    assert logged == ["resume: the checkpoint holds no 'added_later' state (saved by an older pretrain): it starts "
                      "afresh"]
    with pytest.raises(ValueError, match="'counter' is registered already"):
        fresh.register("counter", CountingPart())


# ---- stop signals ---------------------------------------------------------------------------------------


def _handlers() -> dict:
    return {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}


def test_stop_signals_are_recorded_inside_and_previous_handlers_restored_after():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        before = _handlers()
        with StopSignals() as stop:
            assert _handlers() != before
            assert stop.received is None and not stop.agreed(SimpleNamespace(num_processes=1))
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stop.received == signal.SIGUSR1 and stop.agreed(SimpleNamespace(num_processes=1))
        assert _handlers() == before
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # the restored handler gets it, not the loop's flag
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_ctrl_c_asks_for_a_checkpoint_and_a_second_ctrl_c_stops_at_once():
    from pretrain.distributed.supervise import CTRL_C_WINDOW_S, CtrlC

    now = [0.0]
    logged = []
    with pytest.raises(KeyboardInterrupt), StopSignals(log=logged.append) as stop:
        stop.ctrl_c = CtrlC(clock=lambda: now[0])
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.interrupted and stop.agreed(SimpleNamespace(num_processes=1))
        assert logged == ["SIGINT: stopping after the step in flight with a checkpoint (Ctrl-C again stops at once, "
                          "losing the steps since the last checkpoint)"]
        now[0] = CTRL_C_WINDOW_S  # a person pressing again (SIGINTs within the window are the same Ctrl-C)
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the second Ctrl-C did not stop the loop")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_one_ctrl_c_delivered_twice_is_one_stop_and_a_later_one_stops_at_once():
    """Under a wrapper that passes SIGINT on to its child, the terminal's Ctrl-C reaches the process twice within
    milliseconds: one stop after the step in flight (before, the copy was "Ctrl-C again" and lost the steps since
    the last checkpoint). A Ctrl-C CTRL_C_WINDOW_S after the first still stops at once."""
    from pretrain.distributed.supervise import CTRL_C_WINDOW_S, CtrlC

    now = [0.0]
    logged = []
    with StopSignals(log=logged.append) as stop:
        stop.ctrl_c = CtrlC(clock=lambda: now[0])
        os.kill(os.getpid(), signal.SIGINT)  # the terminal's
        now[0] = 0.002
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the wrapper's copy
        except KeyboardInterrupt:
            pytest.fail("the wrapper's copy of the Ctrl-C was taken for a second Ctrl-C")
        assert stop.interrupted and stop.agreed(SimpleNamespace(num_processes=1)) and len(logged) == 1
        now[0] = CTRL_C_WINDOW_S
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            raise AssertionError("the second Ctrl-C did not stop the loop")


def test_ctrl_c_is_left_alone_where_it_was_ignored():
    """A run started in the background (`cmd &`, nohup) ignores SIGINT: a Ctrl-C meant for the shell must not stop it."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as stop:
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.received is None
    finally:
        signal.signal(signal.SIGINT, previous)


def test_stop_signal_handlers_are_restored_when_the_loop_raises():
    before = _handlers()
    with pytest.raises(RuntimeError, match="boom"), StopSignals():
        raise RuntimeError("boom")
    assert _handlers() == before


# ---- throughput --------------------------------------------------------------------------------------------


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture()
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr("pretrain.train.metrics.time.perf_counter", fake)
    return fake


def _steps(monitor: ThroughputMonitor, clock: _Clock, first: int, last: int, seconds: float) -> None:
    for step in range(first, last + 1):
        clock.now += seconds
        monitor.step_done(step)


def test_throughput_skips_the_warm_up_and_excluded_time(clock):
    monitor = ThroughputMonitor(512, 8, 2, warmup_steps=1, flops_per_token=1e6, peak_tflops=0.5)
    monitor.start(0)
    _steps(monitor, clock, 1, 1, 30.0)  # compile, allocator: not measured
    assert monitor.metrics(1) == {}
    _steps(monitor, clock, 2, 3, 2.0)
    with monitor.excluded():  # an evaluation
        clock.now += 50.0
    with monitor.data_wait():
        clock.now += 1.0
    perf = monitor.metrics(3)
    assert perf["perf/step_time_s"] == pytest.approx(2.5)  # (2 + 2 + 1) s over 2 steps
    assert perf["perf/tokens_per_s"] == pytest.approx(2 * 512 / 5.0)
    assert perf["perf/tokens_per_s_per_device"] == pytest.approx(2 * 512 / 5.0 / 2)
    assert perf["perf/samples_per_s"] == pytest.approx(2 * 8 / 5.0)
    assert perf["perf/data_wait_frac"] == pytest.approx(0.2)
    per_device = perf["perf/tokens_per_s_per_device"]
    assert perf["perf/mfu"] == pytest.approx(1e6 * per_device / (0.5 * 1e12), rel=1e-12)
    assert perf["perf/tflops_per_device"] == pytest.approx(1e6 * per_device / 1e12, rel=1e-12)
    assert perf["perf/peak_tflops"] == 0.5 and perf["perf/flops_per_token"] == 1e6
    assert "perf/hfu" not in perf


def test_throughput_warm_up_counts_from_the_resumed_step(clock):
    monitor = ThroughputMonitor(512, 8, 1, warmup_steps=2)
    monitor.start(10)
    _steps(monitor, clock, 11, 11, 9.0)
    assert monitor.metrics(11) == {}
    _steps(monitor, clock, 12, 13, 1.0)  # step 12 ends the warm-up: only step 13 is measured
    perf = monitor.metrics(13)
    assert perf["perf/step_time_s"] == pytest.approx(1.0)
    assert not any(key in perf for key in ("perf/mfu", "perf/flops_per_token", "perf/tflops_per_device"))


def test_throughput_without_peak_has_no_mfu_and_with_recomputation_an_hfu(clock):
    no_peak = ThroughputMonitor(512, 8, 1, flops_per_token=1e6)
    _steps(no_peak, clock, 1, 1, 1.0)
    assert "perf/tflops_per_device" in (perf := no_peak.metrics(1)) and "perf/mfu" not in perf
    recompute = ThroughputMonitor(512, 8, 1, flops_per_token=1e6, hardware_flops_per_token=1.3e6, peak_tflops=1.0)
    _steps(recompute, clock, 1, 1, 1.0)
    perf = recompute.metrics(1)
    assert perf["perf/hfu"] == pytest.approx(1.3 * perf["perf/mfu"])


def test_mfu_never_exceeds_100_percent_a_beaten_peak_becomes_the_achieved_rate(clock):
    raised = []
    # 1e6 FLOPs/token x 512 tokens/s = 0.000512 TFLOP/s achieved against a "peak" of 0.0001
    monitor = ThroughputMonitor(512, 8, 1, flops_per_token=1e6, hardware_flops_per_token=1.5e6, peak_tflops=1e-4,
                                on_peak_raised=lambda old, new: raised.append((old, new)))
    _steps(monitor, clock, 1, 2, 1.0)
    perf = monitor.metrics(2)
    assert perf["perf/hfu"] == pytest.approx(1.0) and perf["perf/mfu"] == pytest.approx(1 / 1.5)
    assert perf["perf/peak_tflops"] == pytest.approx(1.5e6 * 512 / 1e12)
    assert raised == [(1e-4, pytest.approx(1.5e6 * 512 / 1e12))]
    _steps(monitor, clock, 3, 4, 2.0)  # half as fast: half the raised peak, which stays
    perf = monitor.metrics(4)
    assert perf["perf/hfu"] == pytest.approx(0.5) and len(raised) == 1


# ---- log and eval cadence ---------------------------------------------------------------------------------


def test_log_cadence_is_step_one_every_n_and_the_last():
    log = StepLog(None, None, every_steps=4, num_steps=10)
    assert [step for step in range(1, 11) if log.due(step)] == [1, 4, 8, 10]


def test_plain_log_line_has_elapsed_time_and_an_eta_from_the_recent_step_time(monkeypatch, capsys):
    now = [1000.0]
    monkeypatch.setattr("pretrain.train.tracking.time.monotonic", lambda: now[0])
    console = Console("plain", enabled=True)
    console.start(total_steps=1000, first_step=0)
    now[0] += 30.0  # step 1: compile and first batches
    console.step_summary(1, 1000, {"train/loss": 2.0})
    now[0] += 9 * 2.0  # steps 2-10 at 2 s each
    console.step_summary(10, 1000, {"train/loss": 1.5})
    first, second = capsys.readouterr().out.splitlines()
    assert first == "step 1/1000 | loss 2.0000 | elapsed 0:00:30 | eta 8:19:30"  # 999 steps x 30 s
    assert second == "step 10/1000 | loss 1.5000 | elapsed 0:00:48 | eta 0:33:00"  # 990 steps x 2 s
    assert format_duration(2 * 86400 + 61) == "2 days, 0:01:01"


def test_step_log_drops_none_values():
    logged = []
    acc = SimpleNamespace(log=lambda metrics, step: logged.append((step, metrics)))
    console = SimpleNamespace(step_summary=lambda step, total, metrics: None)
    out = StepLog(acc, console, every_steps=1, num_steps=2).write(2, {"train/loss": 1.0, "train/grad_norm": None})
    assert out == {"train/loss": 1.0} and logged == [(2, {"train/loss": 1.0})]


@pytest.mark.parametrize("every, at_start, expected", [(0, True, [0, 10]), (0, False, [10]), (4, True, [0, 4, 8, 10]),
                                                       (5, False, [5, 10])])
def test_eval_cadence(every, at_start, expected):
    evaluator = Evaluator(None, [], every_steps=every, num_steps=10, at_start=at_start, console=None)
    assert [step for step in range(0, 11) if evaluator.due(step)] == expected


AGREEMENT_SCRIPT = """
import os, signal, sys
from types import SimpleNamespace
import torch.distributed as dist
from pretrain.distributed.preemption import StopSignals
from pretrain.distributed.supervise import leave

dist.init_process_group("gloo")
rank = dist.get_rank()
answers = []
with StopSignals() as stop:
    for step in range(1, 7):
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is signalled, during step 3
        answers.append(stop.agreed(SimpleNamespace(num_processes=2)))
        if answers[-1]:
            break
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    f.write(repr(answers))
leave(0)  # as a worker of pretrain leaves: no teardown for gloo's threads to abort (pretrain/distributed/supervise.py)
"""


@pytest.mark.slow
def test_stop_agreement_gives_every_rank_the_same_step_without_blocking(tmp_path):
    """Two gloo processes, only rank 1 signalled in step 3: both stop after step 4 (the agreement is read one
    step after it started), and nothing is left in flight when the loop ends."""
    script = tmp_path / "agree.py"
    script.write_text(AGREEMENT_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), str(script), str(tmp_path)],
                          env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.json").read_text() == "[False, False, False, True]", rank
