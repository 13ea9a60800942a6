"""stability.rollback: a run that keeps skipping goes back to the checkpoint before the trouble, skips the
window of global batches that led to it, and goes on; a resume skips the same window."""

from __future__ import annotations

import enum
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.checkpoint.background import SLOW_WRITE_ENV
from pretrain.checkpoint.integrity import checkpoint_files, verify_all
from pretrain.checkpoint.rundir import read_state, run_rollbacks
from pretrain.data.order import FilteredOrder, GlobalSampleOrder
from pretrain.errors import ConfigError, TrainingDiverged
from pretrain.recipe.config import RollbackConfig, load_recipe
from pretrain.train.goodput import read_goodput
from pretrain.train.rollback import Rollback
from pretrain.train.stability import LOSS_FACTORS_ENV
from pretrain.trust import allowed_globals
from tests.helpers import (
    FAST,
    TINY,
    OneThread,
    accelerate_launch,
    check_ok,
    free_port,
    metrics,
    train_here,
    train_losses,
)
from tests.model.test_optim import _lrs  # every optimizer step's lr of a schedule

# ---- the pieces, alone ------------------------------------------------------------------------------------


def test_skipped_batches_are_left_out_of_the_order_and_nothing_else_moves():
    order = GlobalSampleOrder(num_samples=64, global_batch_size=4, seed=0, shuffle=True, drop_last=True)
    skipping = FilteredOrder(order, [(9, 10), (3, 5)])  # two rollbacks' windows, in any order
    assert [skipping.batch_index(s) for s in range(8)] == [0, 1, 2, 6, 7, 8, 11, 12]
    assert np.array_equal(skipping.global_batch(3), order.global_batch(6))
    assert skipping.steps_available() == (16 - 5, "")  # 16 batches per epoch, 5 of them skipped
    assert skipping.epochs_read(3) == order.epochs_read(6)


def test_a_resume_restores_the_rollbacks_of_its_own_timeline_only(tmp_path):
    saved = [{"to_step": 4, "batches": [4, 8], "lr_factor": 0.5, "lr_schedule_steps": [4, 6]}]
    logged = [
        *saved,  # made before the checkpoint was saved: the checkpoint holds it
        {"checkpoint": "step_00000012", "checkpoint_saved_at": 1.0, "to_step": 12, "batches": [15, 17],
         "lr_factor": 0.5, "lr_schedule_steps": [12, 14]},  # to an earlier save of the same step: another timeline
        {"checkpoint": "step_00000012", "checkpoint_saved_at": 2.0, "to_step": 12, "batches": [16, 19],
         "lr_factor": 0.25, "lr_schedule_steps": [12, 13]},  # to the checkpoint resumed, after it was saved
    ]
    (tmp_path / "rollbacks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged))
    history = Rollback(RollbackConfig(), tmp_path)
    history.load_state_dict({"records": saved, "saved_at": 2.0})  # the save of step 12 resumed
    assert history.removals == [(4, 8), (16, 19)]  # older records: their batches
    assert [history.lr_factor(s) for s in (3, 4, 5, 6, 12, 13)] == [1.0, 0.5, 0.5, 1.0, 0.25, 1.0]
    assert history.attempts(12) == 1 and history.attempts(4) == 1


@pytest.mark.parametrize("line, named", [
    ("[1, 2]", "a list, not a rollback record"),
    ('{"to_step": 4, "batches": ["4", 8], "lr_factor": 0.5, "lr_schedule_steps": [4, 6]}', "batches = ['4', 8]"),
    ('{"to_step": 4, "batches": [0, 1000000000000], "lr_factor": 1e9, "lr_schedule_steps": [4, 6]}',
     "lr_factor = 1000000000.0 is not in (0, 1]"),
    ('{"to_step": 4, "batches": [8, 4], "lr_factor": 0.5, "lr_schedule_steps": [4, 6]}', "batches = [8, 4]"),
    ('{"to_step": -1, "batches": [4, 8], "lr_factor": 0.5, "lr_schedule_steps": [4, 6]}', "to_step = -1"),
])
def test_a_forged_or_garbage_rollback_record_is_one_message_naming_the_line(tmp_path, line, named):
    """Issue 36: the loop applies a record's skipped batches and lr window as read: a string was a traceback in the
    loop, a factor of 1e9 a run that diverges by itself. A line that is not what a rollback writes is refused."""
    good = '{"to_step": 2, "batches": [2, 3], "lr_factor": 1.0, "lr_schedule_steps": [2, 2], "checkpoint_saved_at": 1.5}'
    (tmp_path / "rollbacks.jsonl").write_text(f"{good}\n{line}\n{good}\n")
    with pytest.raises(ConfigError, match=re.escape(f"rollbacks.jsonl:2: {named}")):
        Rollback(RollbackConfig(), tmp_path)


def test_a_rollback_that_could_never_act_is_refused():
    with pytest.raises(ConfigError, match=r"stability.rollback.enabled=true cannot act: .*checkpoint.every_steps=0"):
        load_recipe(TINY, ["stability.rollback.enabled=true", "checkpoint.every_steps=0"])
    with pytest.raises(ConfigError, match=r"stability.max_consecutive_skips=0"):
        load_recipe(TINY, ["stability.rollback.enabled=true", "stability.max_consecutive_skips=0"])
    for name in ("7b", "13b", "70b", "llama-1b"):  # on in the large recipes, off in the demo
        assert load_recipe(Path(TINY).with_name(f"{name}.yaml")).stability.rollback.enabled, name
    assert not load_recipe(TINY).stability.rollback.enabled


# ---- end to end, in this process ----------------------------------------------------------------------------

# Checkpoints every 4 steps; the spike rule judges once 2 updates are in its window; 3 skips in a row would stop the
# run. The injected spike (x1000 on the loss) hits the global batches steps 7, 8 and 9 read: the run skips them,
# would stop at step 9, and rolls back to step 4 instead (the checkpoint of step 8 was saved mid-streak).
ARGS = [*FAST, "train.max_steps=12", "checkpoint.every_steps=4", "checkpoint.keep_last=0",
        "checkpoint.save_final_model=false", "stability.window_steps=4", "stability.spike_sigma=100",
        "stability.max_consecutive_skips=3",
        "stability.rollback.enabled=true", "stability.rollback.lr_factor=0.5", "stability.rollback.lr_factor_steps=2"]
SPIKE = "7:1e3,8:1e3,9:1e3"


def _train(out: Path, factors: str, *extra: str):
    with pytest.MonkeyPatch.context() as patch, OneThread():
        patch.setenv(LOSS_FACTORS_ENV, factors)  # read when the Trainer is built: it trains in this process
        return train_here([*ARGS, *extra, f"output_dir={out}"])


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory):
    out = tmp_path_factory.mktemp("rollback") / "run"
    _, _, console = _train(out, SPIKE)
    return out, console


# What a rollback record says, less when it happened (time, checkpoint_saved_at) and the reason's rounded numbers.
RECORD_KEYS = ("rollback", "stopped_at_step", "first_skipped_step", "to_step", "checkpoint", "skipped_steps", "batches",
               "lr_factor", "lr_schedule_steps", "rule")


def _rollbacks(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rollbacks.jsonl").read_text().splitlines()]


def test_a_persistent_spike_rolls_back_skips_its_window_and_ends_finite(rolled_back):
    out, console = rolled_back
    for step in (7, 8, 9):
        assert f"step {step}: update skipped by stability.spike_sigma" in console
    assert (f"stability: rollback 1/3 to {out / 'checkpoints' / 'step_00000004'} (step 4) after steps 7-9 were "
            "skipped in a row (stability.spike_sigma: loss") in console
    assert "the global batches of steps 5-9 (batches 4-8) are skipped, recorded in rollbacks.jsonl" in console
    [record] = _rollbacks(out)
    assert {k: record[k] for k in RECORD_KEYS} == {
        "rollback": 1, "stopped_at_step": 9, "first_skipped_step": 7, "to_step": 4, "checkpoint": "step_00000004",
        "skipped_steps": [5, 9], "batches": [4, 8], "lr_factor": 0.5, "lr_schedule_steps": [4, 6],
        "rule": "stability.spike_sigma"}
    # metrics.jsonl: each step once, the redone steps replacing the abandoned ones (as after a resume)
    records = [r for r in metrics(out) if "train/loss" in r]
    assert [r["step"] for r in records] == list(range(1, 13))
    by_step = {r["step"]: r for r in records}
    assert by_step[4]["stability/rollbacks"] == 0 and by_step[5]["stability/rollbacks"] == 1
    assert by_step[12]["stability/skipped_steps"] == 0 and math.isfinite(by_step[12]["train/loss"])
    assert by_step[12]["train/loss"] < by_step[1]["train/loss"]
    # lr x0.5 for the two updates after the rollback, then the schedule as it was
    recipe = load_recipe(TINY, ARGS)
    expected = _lrs(recipe.lr_schedule, 12, recipe.optim.lr)
    assert [by_step[s]["train/lr"] for s in (5, 6, 7)] == pytest.approx([expected[4] / 2, expected[5] / 2, expected[6]])
    # The mid-streak checkpoint of the abandoned attempt is set aside, not resumed; the new ones hold the rollback.
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith(("step_", ".rolled"))) == [
        ".rolled-back-step_00000008", "step_00000004", "step_00000008", "step_00000012"]
    assert (checkpoints / "latest").read_text().strip() == "step_00000012"
    assert read_state(checkpoints / "step_00000008")["components"]["rollback"]["records"] == [record]
    assert read_state(checkpoints / "step_00000004")["components"]["rollback"]["records"] == []
    # pretrain-data which reads the same order: step 5 read the global batch after the skipped ones
    from pretrain.checkpoint.rundir import read_run
    from pretrain.data.lookup import RunData

    assert [RunData.open(read_run(out)).order.batch_index(s - 1) for s in (4, 5, 12)] == [3, 9, 16]
    # goodput.json: the reload and the steps it threw away (5-9) are the rollback's time; every second is counted
    [attempt] = read_goodput(out)
    seconds = attempt["seconds"]
    assert seconds["rollback"] > 0 and seconds["productive"] > 0 and seconds["lost"] == 0 and attempt["step"] == 12
    assert sum(seconds.values()) == pytest.approx(attempt["wall_s"], abs=0.01)
    assert re.search(r"^goodput \d+\.\d% of 0:\d\d:\d\d wall over 1 attempt: .*rollback", console, re.M)


def _resumed_copy(out: Path, where: Path, resume_step: int, keep_records: bool) -> Path:
    """``out`` as a run killed before it saved anything after ``resume_step`` leaves it."""
    shutil.copytree(out, where)
    for path in (where / "checkpoints").iterdir():
        state = read_state(path) if path.is_dir() else None
        if path.name.startswith(".rolled") or (state is not None and state["step"] > resume_step):
            shutil.rmtree(path)
    (where / "checkpoints" / "latest").write_text(f"step_{resume_step:08d}\n")
    if not keep_records:
        (where / "rollbacks.jsonl").unlink()
    return where


@pytest.mark.parametrize(("resume_step", "keep_records"), [
    (4, True),  # killed right after the rollback: only rollbacks.jsonl knows the window
    (8, False),  # killed after the next checkpoint: the checkpoint alone carries the window
])
def test_a_resume_after_a_kill_skips_the_same_window_and_reproduces_the_losses(rolled_back, tmp_path, resume_step,
                                                                                keep_records):
    out, _ = rolled_back
    resumed = _resumed_copy(out, tmp_path / "resumed", resume_step, keep_records)
    _, _, console = _train(resumed, SPIKE)
    assert f"resume: continuing from {resumed / 'checkpoints' / f'step_{resume_step:08d}'}" in console
    assert "stability: rollback" not in console  # the spike's batches are skipped: no new rollback
    assert train_losses(resumed) == train_losses(out)  # exactly: the same batches, the same lr
    # goodput: the run had reached step 12; the resumed attempt did steps up to it again (lost), none new
    first, again = read_goodput(resumed)
    assert first == read_goodput(out)[0] and again["step"] == 12
    assert again["seconds"]["lost"] > 0 and again["seconds"]["productive"] == 0


def test_a_spike_that_outlasts_max_attempts_stops_the_run_as_without_rollback(tmp_path):
    out = tmp_path / "run"
    # The spike goes on past the skipped window: after the rollback steps 5-7 read batches 9-11, spiking again.
    with pytest.raises(TrainingDiverged, match=r"step 7: 3 updates in a row skipped .* stability.rollback gave up: "
                                               r"1 rollback\(s\) to .*step_00000004 \(step 4\) already"):
        _train(out, ",".join(f"{k}:1e3" for k in range(7, 13)), "stability.rollback.max_attempts=1")
    assert [r["to_step"] for r in _rollbacks(out)] == [4]


def test_a_rollback_whose_checkpoints_are_damaged_goes_further_back_and_leaves_their_timeline(tmp_path, monkeypatch):
    """A rollback verifies its target as a resume does: a damaged one is set aside and an older one loaded. Here
    the first rollback (spike on the batches of steps 5-7) goes back to step 4. The second (spike on what steps
    9-11 read) finds step 8, step 6 and step 4 damaged and goes back to step 2: the first rollback, to step 4,
    belongs to the timeline given up, as for a resume from step 2, and is in none of the new checkpoints."""
    import pretrain.train.trainer as trainer_module

    real_before = trainer_module.ResumeChoice.before
    calls = []

    def before(output_dir, step):
        calls.append(step)
        if len(calls) == 2:  # the second rollback: flip one byte of every checkpoint from step 4 on, sizes kept
            for path in sorted((Path(output_dir) / "checkpoints").glob("step_*")):
                if read_state(path)["step"] >= 4:
                    target = next(path / rel for rel in checkpoint_files(path) if rel.endswith(".safetensors"))
                    data = bytearray(target.read_bytes())
                    data[-1] ^= 0xFF
                    target.write_bytes(bytes(data))
        return real_before(output_dir, step)

    monkeypatch.setattr(trainer_module.ResumeChoice, "before", before)
    out = tmp_path / "run"
    spikes = ",".join(f"{batch}:1e3" for batch in (5, 6, 7, 12, 13, 14))  # after the first rollback step s reads batch s+3
    _, _, console = _train(out, spikes, "checkpoint.every_steps=2", "train.max_steps=14")
    assert calls == [5, 9]
    checkpoints = out / "checkpoints"
    assert f"stability: rollback 1/3 to {checkpoints / 'step_00000004'} (step 4) after steps 5-7" in console
    for step in (8, 6, 4):
        assert f"warning: checkpoint {checkpoints / f'step_{step:08d}'} is damaged" in console
    assert f"stability: rollback 1/3 to {checkpoints / 'step_00000002'} (step 2) after steps 9-11" in console
    first, second = _rollbacks(out)  # both stay in rollbacks.jsonl, the run's log
    assert (first["checkpoint"], first["batches"]) == ("step_00000004", [4, 6])
    # The window read in the attempt given up: steps 3-11, i.e. batches 2-3 and, after the first window, 7-13.
    assert {k: second[k] for k in ("rollback", "checkpoint", "to_step", "skipped_steps", "batches")} == {
        "rollback": 1, "checkpoint": "step_00000002", "to_step": 2, "skipped_steps": [3, 11], "batches": [2, 13]}
    assert read_state(checkpoints / "step_00000014")["components"]["rollback"]["records"] == [second]
    assert run_rollbacks(out) == [second]
    by_step = {r["step"]: r for r in metrics(out) if "train/loss" in r}
    assert sorted(by_step) == list(range(1, 15))
    assert by_step[14]["stability/rollbacks"] == 1 and math.isfinite(by_step[14]["train/loss"])
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith(".damaged")) == [
        ".damaged-step_00000004", ".damaged-step_00000006", ".damaged-step_00000008"]
    # A resume from the new timeline's step 8 skips the same window: the same losses.
    monkeypatch.setattr(trainer_module.ResumeChoice, "before", real_before)
    resumed = _resumed_copy(out, tmp_path / "resumed", 8, keep_records=True)
    _, _, console = _train(resumed, spikes, "checkpoint.every_steps=2", "train.max_steps=14")
    assert "stability: rollback" not in console
    assert train_losses(resumed) == train_losses(out)


# ---- end to end, on 2 processes: DDP, FSDP2, ZeRO-2 ---------------------------------------------------------

# The run above, launched once per layout. ZeRO's write their checkpoints with checkpoint.async=true, the write of
# step 8 (saved mid-streak) slowed by 2 s: step 9 runs while it is in flight, and the rollback after step 9 waits for
# it before it picks the checkpoint and sets the abandoned one aside.
LAYOUTS = {"DDP": ("cpu_ddp.yaml", []), "FSDP2": ("fsdp.yaml", []),
           "ZeRO-1, checkpoint.async": ("zero1.yaml", ["checkpoint.async=true"]),
           "ZeRO-2, checkpoint.async": ("zero2.yaml", ["checkpoint.async=true"]),
           "ZeRO-3, checkpoint.async": ("zero3.yaml", ["checkpoint.async=true"])}
SLOW_STEP_8 = "8:2"
ZERO2_ASYNC = "ZeRO-2, checkpoint.async"
# The cross-layout tolerance of tests/multiprocess/test_distributed.py (reductions in another order on 2 processes).
REL = 1e-4


def _launch(config: str, out: Path, *extra: str) -> str:
    # OMP_NUM_THREADS as pretrain-launch sets it (cores / processes); SLOW_WRITE_ENV is read by background writes
    # only (checkpoint.async).
    proc = accelerate_launch(config, [*ARGS, *extra, f"output_dir={out}"],
                             extra=["--main_process_port", str(free_port()), "--num_processes", "2"],
                             extra_env={"OMP_NUM_THREADS": "1", LOSS_FACTORS_ENV: SPIKE, SLOW_WRITE_ENV: SLOW_STEP_8})
    check_ok(proc)
    return proc.stdout


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """layout -> (run directory, console): each layout launched once, when a test first asks for it."""
    runs: dict[str, tuple[Path, str]] = {}

    def get(layout: str) -> tuple[Path, str]:
        if layout not in runs:
            config, extra = LAYOUTS[layout]
            out = tmp_path_factory.mktemp("rollback_2") / "run"
            runs[layout] = out, _launch(config, out, *extra)
        return runs[layout]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rollback_on_two_processes_is_the_one_process_rollback(rolled_back, launched, layout):
    """Every rank reloads through its engine's loader (DeepSpeed's for ZeRO), the same window is skipped and
    recorded, the lr factor acts on each engine's schedule, and the losses follow the one-process curve."""
    (single, _), (out, console) = rolled_back, launched(layout)
    assert "world size 2" in console
    assert (f"stability: rollback 1/3 to {out / 'checkpoints' / 'step_00000004'} (step 4) after steps 7-9 were "
            "skipped in a row") in console
    [record], [reference] = _rollbacks(out), _rollbacks(single)
    assert {k: record[k] for k in RECORD_KEYS} == {k: reference[k] for k in RECORD_KEYS}
    # The abandoned attempt's checkpoint of step 8 set aside once (rank 0 moves it; every rank saves the new one)
    # and complete; the new checkpoints carry the rollback.
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith(("step_", ".rolled", ".tmp"))) == [
        ".rolled-back-step_00000008", "step_00000004", "step_00000008", "step_00000012"]
    assert verify_all(checkpoints / ".rolled-back-step_00000008") is None
    assert read_state(checkpoints / ".rolled-back-step_00000008")["components"]["rollback"]["records"] == []
    assert [r["to_step"] for r in read_state(checkpoints / "step_00000012")["components"]["rollback"]["records"]] == [4]
    # Each step once, the redone ones replacing the abandoned ones; the one-process losses and lrs.
    steps = {r["step"]: r for r in metrics(out) if "train/loss" in r}
    expected = {r["step"]: r for r in metrics(single) if "train/loss" in r}
    assert sorted(steps) == list(range(1, 13))
    for step, ours in steps.items():
        assert ours["train/loss"] == pytest.approx(expected[step]["train/loss"], rel=REL), (step, ours, expected[step])
        assert ours["train/lr"] == pytest.approx(expected[step]["train/lr"], rel=1e-6), step
        assert ours["stability/rollbacks"] == expected[step]["stability/rollbacks"], step
    assert math.isfinite(steps[12]["train/loss"]) and steps[12]["stability/skipped_steps"] == 0


@pytest.mark.slow
def test_a_zero2_rollback_waits_for_the_background_write_in_flight(launched):
    out, console = launched(ZERO2_ASYNC)
    lines = console.splitlines()

    def first(prefix: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(prefix))

    # Step 8's write (slowed) finished while step 9 was judged and before the rollback chose its checkpoint.
    assert first("step 9: update skipped") < first("checkpoint: saved step 8") < first("stability: rollback 1/3")
    assert "in the background: the loop waited" in console


def _tensors(obj, prefix: str = "") -> dict[str, object]:
    """A saved state, flattened: every leaf by its path (an object's attributes, e.g. DeepSpeed's loss scaler)."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, enum.Enum)):
        items = vars(obj).items()
    else:
        return {prefix: obj}
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}/{key}").items()}


def _same_state(ours: Path, theirs: Path, name: str) -> None:
    with torch.serialization.safe_globals(list(allowed_globals())):  # as every load of a run is: weights only
        a, b = (_tensors(torch.load(p / name, weights_only=True)) for p in (ours, theirs))
    assert a.keys() == b.keys(), name
    for key, value in a.items():
        same = torch.equal(value, b[key]) if isinstance(value, torch.Tensor) else value == b[key]
        assert same, (name, key)


@pytest.mark.slow
def test_a_zero2_resume_from_an_async_checkpoint_continues_the_curve_with_the_same_files(launched, tmp_path):
    """The async checkpoint of step 8 (after the rollback) resumed by a new ZeRO-2 launch, writing synchronously:
    the rollback it carries is applied (no new rollback), the losses are the async run's exactly, and its
    checkpoint of step 12 holds what the async run's does, file for file."""
    source, _ = launched(ZERO2_ASYNC)
    out = tmp_path / "resumed"
    console = _launch("zero2.yaml", out, f"checkpoint.resume={source / 'checkpoints' / 'step_00000008'}")
    assert "step_00000008 at step 8" in console and "stability: rollback" not in console
    resumed = train_losses(out)
    assert sorted(resumed) == [9, 10, 11, 12]
    assert resumed == {s: loss for s, loss in train_losses(source).items() if s > 8}
    ours, theirs = (run / "checkpoints" / "step_00000012" for run in (source, out))
    assert verify_all(ours) is None and verify_all(theirs) is None
    assert checkpoint_files(ours) == checkpoint_files(theirs)
    # The model and each rank's ZeRO partition of the optimizer (DeepSpeed's files), and the schedule.
    for name in checkpoint_files(ours):
        if name.startswith("pytorch_model/") or name == "scheduler.bin":
            _same_state(ours, theirs, name)


