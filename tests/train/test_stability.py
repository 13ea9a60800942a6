"""Long runs that look after themselves: skipped non-finite and spiking updates, a run that stops itself,
healthy checkpoints only, strict-JSON metrics, z-loss; and a resume that is right (a new lr applies) or
refused (other data)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import pretrain.recipe.shape as shape
from pretrain.errors import ConfigError, TrainingDiverged
from pretrain.model.loss import chunked_causal_lm_loss
from pretrain.model.optim import build_scheduler, set_peak_lr
from pretrain.recipe.config import StabilityConfig, load_recipe
from pretrain.train.stability import LOSS_FACTORS_ENV, SkipPolicy
from pretrain.train.tracking import JSONLTracker
from tests.fakes import FakeAccelerator
from tests.helpers import FAST, TINY, accelerate_launch, check_ok, metrics, train, train_here
from tests.model.test_optim import _lrs  # every optimizer step's lr of a schedule

# The command: the tiny recipe at tiny shapes.
P = ["train.max_steps=10", "data.seq_len=64", "batch.global_batch_size=8", "batch.micro_batch_size=2",
     "lr_schedule.warmup_steps=2", "logging.progress=plain", "eval.tasks=[]"]


# ---- the rules, alone ---------------------------------------------------------------------------------


def test_nonfinite_loss_or_grad_norm_is_skipped_and_n_in_a_row_stop_the_run():
    policy = SkipPolicy(StabilityConfig(max_consecutive_skips=3))
    assert not policy.judge(2.0, 1.0).skip
    verdict = policy.judge(float("nan"), 1.0)
    assert (verdict.skip, verdict.rule, verdict.reason) == (True, "stability.skip_nonfinite", "loss is nan")
    assert policy.judge(2.0, float("inf")).reason == "gradient norm is inf"
    policy.record(1, policy.judge(2.0, 1.0), 2.0, 1.0)
    for step in (2, 3):
        policy.record(step, policy.judge(float("nan"), 1.0), float("nan"), 1.0)
    policy.record(4, policy.judge(2.0, 1.0), 2.0, 1.0)  # an applied update resets the count
    assert (policy.skipped, policy.consecutive) == (2, 0)
    for step in (5, 6):
        policy.record(step, policy.judge(2.0, float("nan")), 2.0, float("nan"))
    with pytest.raises(TrainingDiverged, match=r"step 7: 3 updates in a row skipped .*stability.skip_nonfinite"):
        policy.record(7, policy.judge(float("inf"), 1.0), float("inf"), 1.0)


def test_spike_rule_waits_for_a_half_full_window_of_applied_updates():
    policy = SkipPolicy(StabilityConfig(spike_sigma=3, window_steps=8, max_consecutive_skips=0))
    for step, loss in enumerate([3.0, 3.1, 2.9, 3.0], start=1):
        assert not policy.judge(100.0, 1.0).skip  # no rule before the window is half full
        policy.record(step, policy.judge(loss, 1.0), loss, 1.0)
    verdict = policy.judge(100.0, 1.0)
    assert verdict.rule == "stability.spike_sigma" and verdict.reason.startswith("loss 100 > mean 3")
    assert policy.judge(3.05, 50.0).reason.startswith("gradient norm 50 > mean 1")
    policy.record(5, verdict, 100.0, 1.0)
    assert list(policy.losses) == [3.0, 3.1, 2.9, 3.0]  # a skipped update never enters the window
    restored = SkipPolicy(policy.cfg)
    restored.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert restored.state_dict() == policy.state_dict()


def test_fp16_leaves_a_nonfinite_gradient_norm_to_the_loss_scaler():
    policy = SkipPolicy(StabilityConfig(), fp16=True)
    verdict = policy.judge(2.0, float("inf"))
    assert not verdict.skip and verdict.left_to_scaler
    policy.record(1, verdict, 2.0, float("inf"))
    assert (policy.skipped, len(policy.losses)) == (0, 0)
    assert policy.judge(float("nan"), float("inf")).skip


def test_non_finite_recipe_numbers_and_out_of_range_seeds_are_refused():
    for override, message in [("optim.lr=.inf", "optim.lr"), ("optim.lr=.nan", "optim.lr"),
                              ("lr_schedule.min_lr_ratio=.nan", "lr_schedule.min_lr_ratio"),
                              ("stability.spike_sigma=.inf", "stability.spike_sigma"),
                              ("train.seed=-1", "train.seed"), ("train.seed=4294967296", "train.seed")]:
        with pytest.raises(ConfigError, match=message):
            load_recipe(TINY, [override])


def test_metrics_jsonl_is_strict_json_with_null_for_non_finite(tmp_path):
    tracker = JSONLTracker(tmp_path)
    tracker.start()
    tracker.log({"train/loss": float("nan"), "train/grad_norm": torch.tensor(float("inf")), "x": 1.5}, step=3)
    tracker.finish()
    line = (tmp_path / "metrics.jsonl").read_text()
    record = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert (record["train/loss"], record["train/grad_norm"], record["x"]) == (None, None, 1.5)


def test_a_non_finite_state_is_never_checkpointed_and_the_healthy_one_is_kept(tmp_path):
    from pretrain.checkpoint.checkpointer import Checkpointer
    from pretrain.checkpoint.rundir import latest_checkpoint
    from pretrain.checkpoint.state import TrainerState
    from pretrain.recipe.config import CheckpointConfig

    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    param.grad = torch.ones(3)
    optimizer.step()
    checkpointer = Checkpointer(FakeAccelerator({}), tmp_path, CheckpointConfig(keep_last=1), num_steps=10, log=print)
    healthy = checkpointer.save(TrainerState(step=5, tokens_seen=5, num_steps=10, plan={}, recipe={}), optimizer)
    optimizer.state[param]["exp_avg_sq"][1] = float("nan")
    with pytest.raises(TrainingDiverged, match=f"step 10: not saving a checkpoint: .*NaN or inf.*{healthy}"):
        checkpointer.save(TrainerState(step=10, tokens_seen=10, num_steps=10, plan={}, recipe={}), optimizer)
    assert latest_checkpoint(tmp_path) == healthy and sorted((tmp_path / "checkpoints").iterdir())[-1] == healthy


# ---- z-loss ----------------------------------------------------------------------------------------------


def test_z_loss_is_added_chunk_by_chunk_with_its_gradient_and_only_in_training(monkeypatch):
    monkeypatch.setattr(shape, "LOSS_CHUNK_ELEMENTS", 7 * 50)  # several chunks, a ragged last one
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, 50, generator=g) * 4
    labels = torch.randint(0, 50, (3, 11), generator=g)
    labels[0, :3] = -100
    z, n = 1e-2, 30.0

    reference_x = logits.clone().requires_grad_(True)
    flat, targets = reference_x.reshape(-1, 50), labels.reshape(-1)
    valid = targets != -100
    lse = torch.logsumexp(flat, -1)
    ce = torch.nn.functional.cross_entropy(flat, targets, reduction="sum", ignore_index=-100)
    reference = (ce + z * (lse[valid] ** 2).sum()) / n
    reference.backward()

    from pretrain.model.loss import LossTerms

    terms = LossTerms()
    x = logits.clone().requires_grad_(True)
    value = chunked_causal_lm_loss(x, labels, shift_labels=labels, num_items_in_batch=n, z_loss=z, terms=terms)
    value.backward()
    assert value.item() == pytest.approx(reference.item(), rel=1e-6)
    torch.testing.assert_close(x.grad, reference_x.grad, rtol=1e-5, atol=1e-7)
    assert terms.take().item() == pytest.approx(z * (lse[valid] ** 2).sum().item() / n, rel=1e-6)
    with torch.no_grad():  # evaluation: the cross-entropy alone
        assert chunked_causal_lm_loss(logits, labels, shift_labels=labels, num_items_in_batch=n, z_loss=z,
                                      terms=terms).item() == pytest.approx(ce.item() / n, rel=1e-6)
    assert terms.take() is None


# ---- the resumed lr ------------------------------------------------------------------------------------


def test_set_peak_lr_overrides_the_loaded_schedule_state():
    recipe = load_recipe(TINY, ["lr_schedule.warmup_steps=2"])
    old = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    old_scheduler = build_scheduler(old, recipe.lr_schedule, 10)
    for _ in range(5):
        old.step()
        old_scheduler.step()
    new = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    new_scheduler = build_scheduler(new, recipe.lr_schedule, 20)
    new.load_state_dict(old.state_dict())
    new_scheduler.load_state_dict(old_scheduler.state_dict())
    assert new.param_groups[0]["lr"] == pytest.approx(old.param_groups[0]["lr"])  # the checkpoint's peak wins
    expected = _lrs(recipe.lr_schedule, 20, 1e-3)
    assert set_peak_lr(new_scheduler, 1e-3) == pytest.approx(expected[5])
    new.step()
    new_scheduler.step()
    assert new.param_groups[0]["lr"] == pytest.approx(expected[6])


# ---- end to end, one process (subprocess runs: slow, as tests/train/test_run.py) -------------------------------


def _finite_checkpoint(path: Path) -> None:
    weights = load_file(str(path / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values()), path
    optimizer = torch.load(path / "optimizer.bin", map_location="cpu", weights_only=True)
    for state in optimizer["state"].values():
        for value in state.values():
            assert not torch.is_tensor(value) or torch.isfinite(value).all(), path


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_diverging_run_skips_then_stops_naming_step_and_rule_with_finite_checkpoints(tmp_path):
    out = tmp_path / "nan"
    proc = train([*P, "checkpoint.every_steps=5", "optim.lr=1e6", f"output_dir={out}"])
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "updates in a row skipped" in proc.stderr and "stability.skip_nonfinite" in proc.stderr
    stopped = int(proc.stderr.split("error: step ")[1].split(":")[0])
    assert f"step {stopped}: update skipped by stability.skip_nonfinite" in proc.stdout
    records = metrics(out)  # strict JSON: the NaN losses are null
    skipped = [r for r in records if r.get("stability/skip_rule")]
    assert len(skipped) == 5 and skipped[-1]["step"] == stopped
    # The first skip's loss is still ln(vocab) (a uniform prediction); its gradient norm is not finite: null.
    assert skipped[0]["stability/skip_reason"] in ("gradient norm is nan", "gradient norm is inf")
    assert skipped[0]["train/grad_norm"] is None
    checkpoints = sorted((out / "checkpoints").glob("step_*"))
    assert checkpoints, "the step-5 checkpoint was written before the run stopped"
    for path in checkpoints:
        _finite_checkpoint(path)
    assert not (out / "final_model").exists()
    # Resumable: the newest checkpoint loads and the run goes on (with the stop rule off it reaches the end). In
    # this process: the exit codes and messages of the entry point are the first run's.
    _, _, console = train_here([*P, "checkpoint.every_steps=5", "optim.lr=1e-3", "stability.max_consecutive_skips=0",
                                f"output_dir={out}"])
    assert f"resume: continuing from {checkpoints[-1]}" in console
    for path in sorted((out / "checkpoints").glob("step_*")):
        _finite_checkpoint(path)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_an_injected_nan_at_step_7_of_20_is_skipped_and_training_goes_on(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv(LOSS_FACTORS_ENV, "7:nan")  # read by the loop at each step: the run trains in this process
    _, _, console = train_here([*FAST, "train.max_steps=20", f"output_dir={out}"])
    assert "step 7: update skipped by stability.skip_nonfinite: loss is nan (1 in a row, 1 in the run" in console
    records = {r["step"]: r for r in metrics(out) if "train/loss" in r or "stability/skip_rule" in r}
    assert records[7]["stability/skip_rule"] == "stability.skip_nonfinite" and records[7]["train/loss"] is None
    # The schedule did not advance on the skipped step: step 8 uses the lr step 7 would have used.
    assert records[8]["train/lr"] == records[7]["train/lr"] != records[6]["train/lr"]
    assert records[20]["stability/skipped_steps"] == 1 and records[20]["stability/consecutive_skips"] == 0
    assert math.isfinite(records[20]["train/loss"]) and records[20]["train/loss"] < records[5]["train/loss"]
    weights = load_file(str(out / "final_model" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_resume_applies_a_new_lr_and_horizon_and_records_them(tmp_path):
    out = tmp_path / "run"
    # The runs that train do so in this process; the refusal at the end is the entry point's (exit 2).
    train_here([*FAST, "train.max_steps=6", "checkpoint.every_steps=3", f"output_dir={out}"])
    _, _, console = train_here([*FAST, "train.max_steps=10", "optim.lr=1e-3", f"output_dir={out}"])
    assert "resume: applying the recipe's optim.lr: 0.003 -> 0.001; train.max_steps: 6 -> 10" in console
    recipe = load_recipe(TINY, [*FAST, "train.max_steps=10", "optim.lr=1e-3"])
    expected = _lrs(recipe.lr_schedule, 10, 1e-3)
    logged = {r["step"]: r["train/lr"] for r in metrics(out) if "train/lr" in r}
    for step in range(7, 11):
        assert logged[step] == pytest.approx(expected[step - 1], rel=1e-9), step
    config = json.loads((out / "run_config.json").read_text())
    assert config["train/lr"] == 1e-3 and config["resume/step"] == 6
    assert config["resume/lr"] == pytest.approx(expected[6])
    assert "optim.lr: 0.003 -> 0.001" in config["resume/applied"]
    # Changes the checkpoint's optimizer state would silently override are refused.
    proc = train([*FAST, "train.max_steps=12", "optim.weight_decay=0.01", f"output_dir={out}"])
    assert proc.returncode == 2 and "optim.weight_decay: 0.1 -> 0.01" in proc.stderr


def _corpus(directory: Path, names: list[str]) -> None:
    directory.mkdir(exist_ok=True)
    stdlib = Path(shutil.__file__).parent
    for name in names:
        (directory / f"{name}.txt").write_text((stdlib / f"{name}.py").read_text())


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_resume_after_the_corpus_changed_is_refused_naming_the_change(tmp_path):
    corpus, out = tmp_path / "corpus", tmp_path / "run"
    _corpus(corpus, ["shutil", "tempfile", "argparse", "inspect"])
    args = [*FAST, f"data.source={corpus}", "data.tokenizer_vocab_size=512", "checkpoint.every_steps=2",
            f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={out}"]
    train_here([*args, "train.max_steps=2"])  # in this process; the refusal below is the entry point's (exit 2)
    stores = sorted((tmp_path / "cache" / "stores").iterdir())
    _corpus(corpus, ["typing"])
    proc = train([*args, "train.max_steps=4"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = proc.stderr
    assert f"cannot resume from {out / 'checkpoints' / 'step_00000002'}" in message
    assert f"1 file(s) added: {corpus / 'typing.txt'}" in message
    assert "tokenizer bpe-512" in message and "a BPE trained on the changed files" in message
    assert sorted((tmp_path / "cache" / "stores").iterdir()) == stores  # refused before anything was built
    (corpus / "typing.txt").unlink()
    train_here([*args, "train.max_steps=4"])  # the same data again: it resumes


# ---- two processes -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_zero2_skips_a_spike_inside_deepspeed_and_a_nan_on_both_ranks(tmp_path):
    """ZeRO-2 on 2 processes: the spike at step 6 is skipped by the gate inside DeepSpeed's step, the NaN at
    step 8 by DeepSpeed's own non-finite check; both ranks agree (the run ends), the schedule holds still."""
    out = tmp_path / "zero2"
    args = [*FAST, "train.max_steps=10", "stability.window_steps=8", "stability.spike_sigma=1000",
            f"output_dir={out}"]
    proc = accelerate_launch("zero2.yaml", args, extra=["--num_processes", "2"],
                             extra_env={LOSS_FACTORS_ENV: "6:1e6,8:nan"})
    check_ok(proc)
    records = {r["step"]: r for r in metrics(out) if "train/lr" in r}
    assert records[6]["stability/skip_rule"] == "stability.spike_sigma"
    assert records[8]["stability/skip_rule"] == "stability.skip_nonfinite"
    assert records[7]["train/lr"] == records[6]["train/lr"] and records[9]["train/lr"] == records[8]["train/lr"]
    assert records[10]["stability/skipped_steps"] == 2
    assert math.isfinite(records[10]["train/loss"])
    weights = load_file(str(out / "final_model" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())
