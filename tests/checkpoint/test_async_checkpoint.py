"""checkpoint.async: the loop waits for a host copy of the states, the files follow in a thread; the same files,
the same curve, and a kill -9 during a background write leaves the previous checkpoint to resume from."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pretrain.checkpoint.background import SLOW_WRITE_ENV, StagedSave
from pretrain.checkpoint.checkpointer import Checkpointer
from pretrain.checkpoint.integrity import checkpoint_files, verify_all
from pretrain.checkpoint.rundir import complete_checkpoints
from pretrain.checkpoint.state import TrainerState
from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.plan import memory
from pretrain.recipe.config import CheckpointConfig, load_recipe
from pretrain.recipe.shape import ModelShape
from tests.fakes import FakeAccelerator
from tests.helpers import FAST, RUN, TINY, env, metrics, train_here, train_losses

pytestmark = pytest.mark.slow

# Checkpoints at 2, 4 and 6, all kept; the curve does not depend on where checkpoints are taken.
ARGS = [*FAST, "train.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=0",
        "checkpoint.save_final_model=false"]


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory):
    out = tmp_path_factory.mktemp("sync")
    train_here([*ARGS, f"output_dir={out}"])
    return out


@pytest.fixture(scope="module")
def in_background(tmp_path_factory):
    """The same run with checkpoint.async=true, the write of step 4 slowed: step 5 runs while it is in flight."""
    out = tmp_path_factory.mktemp("async")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SLOW_WRITE_ENV, "4:2")
        _, trainer, console = train_here([*ARGS, "checkpoint.async=true", f"output_dir={out}"])
    return out, trainer, console


def test_async_saves_write_the_same_checkpoints_and_leave_the_curve_alone(synchronous, in_background):
    out, trainer, console = in_background
    assert train_losses(out) == train_losses(synchronous)
    # The run's end waited for the last write: every checkpoint complete and verified, `latest` the last one.
    assert [step for step, _ in complete_checkpoints(out)] == [2, 4, 6]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    for step in (2, 4, 6):
        ours, theirs = (run / "checkpoints" / f"step_{step:08d}" for run in (out, synchronous))
        assert verify_all(ours) is None
        assert checkpoint_files(ours) == checkpoint_files(theirs)  # the same files: resume, export, reshard alike
    # Step 4's copy was taken at step 4: written while later steps updated the live tensors, it holds what the
    # synchronous save of step 4 holds.
    ours, theirs = (run / "checkpoints" / "step_00000004" for run in (out, synchronous))
    model = load_file(ours / "model.safetensors")
    assert model.keys() == load_file(theirs / "model.safetensors").keys()
    assert all(torch.equal(model[k], load_file(theirs / "model.safetensors")[k]) for k in model)
    optimizer, reference = (torch.load(p / "optimizer.bin", weights_only=True) for p in (ours, theirs))
    for index, state in reference["state"].items():
        assert all(torch.equal(optimizer["state"][index][k], v) for k, v in state.items())
    assert "in the background: the loop waited" in console


def test_kill_9_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path, synchronous):
    out = tmp_path / "killed"
    args = [*ARGS, "checkpoint.async=true", f"output_dir={out}"]
    proc = subprocess.Popen([sys.executable, RUN, "--recipe", TINY, *args], env=env(**{SLOW_WRITE_ENV: "4:600"}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    pending, deadline = out / "checkpoints" / ".tmp-step_00000004", time.time() + 300
    try:
        # The loop went on to step 5 while step 4's write is in flight, its first file written.
        while not (pending.is_dir() and any(m["step"] == 5 for m in _metrics(out))):
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "step 5 was not reached"
            time.sleep(0.05)
        assert (pending / "model.safetensors").is_file() and not (pending / "manifest.json").exists()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"

    _, _, console = train_here(args)  # the same recipe and overrides, in this process
    assert "resume: continuing from" in console and "step_00000002 at step 2" in console
    expected, resumed = train_losses(synchronous), train_losses(out)
    assert sorted(resumed) == list(range(1, 7))
    for step in range(3, 7):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), (step, resumed[step], expected[step])
    assert [step for step, _ in complete_checkpoints(out)] == [2, 4, 6]
    assert not (out / "checkpoints" / ".tmp-step_00000004").exists()


def _metrics(out: Path) -> list[dict]:
    try:
        return metrics(out)
    except (OSError, ValueError):  # not there yet, or a line being written
        return []


def _torch_saving(weights: torch.Tensor, found: list | None = None) -> FakeAccelerator:
    """save_state writing with torch.save (the test hook pauses after scheduler.bin); ``found``: the complete
    checkpoints each save_state found."""
    return FakeAccelerator({"scheduler.bin": {"step": torch.zeros(1)}, "optimizer.bin": {"w": weights}},
                           on_save=None if found is None else lambda path: found.append(
                               [step for step, _ in complete_checkpoints(path.parents[1])]))


def _state(step: int) -> TrainerState:
    return TrainerState(step=step, tokens_seen=0, num_steps=10, plan={}, recipe={})


def test_a_full_disk_in_the_background_is_one_message_and_loses_nothing(tmp_path, monkeypatch):
    checkpointer = Checkpointer(_torch_saving(torch.ones(4)), tmp_path, CheckpointConfig(keep_last=1, **{"async": True}),
                                num_steps=10, log=lambda _: None)
    checkpointer.save(_state(3))
    checkpointer.wait()

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(StagedSave, "write", full)
    checkpointer.save(_state(6))  # returns: the write fails in the background
    with pytest.raises(ConfigError) as exc:
        checkpointer.wait()
    message = str(exc.value)
    assert message.startswith(f"disk full: no space left on the filesystem of {tmp_path / 'checkpoints'}")
    assert "the checkpoint of step 6" in message and "step_00000003 (step 3) is intact" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000003"]
    assert verify_all(tmp_path / "checkpoints" / "step_00000003") is None


def test_the_estimate_counts_the_host_copy():
    shape = ModelShape.from_recipe(load_recipe(TINY))
    work = memory.Workload(precision="bf16", micro_batch_size=1, seq_len=128)
    for launch in (Launch("ddp"), Launch("fsdp", gpus_per_node=4, fsdp_sharding="FULL_SHARD")):
        plain = memory.estimate_shape(shape, work, launch)
        staged = memory.estimate_shape(shape, work, launch, async_checkpoint=True)
        copy = staged.host["checkpoint"]
        assert copy.bytes == plain.terms["params"].bytes + plain.terms["optimizer"].bytes
        assert staged.host_bytes_per_rank == plain.host_bytes_per_rank + copy.bytes
        assert staged.total_bytes == plain.total_bytes  # device memory unchanged
        assert "checkpoint.async" in staged.summary() + staged.explain()
        assert "checkpoint.async" not in plain.summary() + plain.explain()


def test_the_key_is_async_in_recipes_and_in_what_checkpoints_record():
    recipe = load_recipe(TINY, ["checkpoint.async=true"])
    assert recipe.checkpoint.async_ is True and recipe.to_dict()["checkpoint"]["async"] is True
    assert load_recipe(TINY).to_dict()["checkpoint"]["async"] is False
    with pytest.raises(ConfigError, match=r"did you mean 'checkpoint\.async'"):
        load_recipe(TINY, ["checkpoint.asyn=true"])


def test_at_most_one_write_is_in_flight_and_the_copy_is_taken_at_the_save(tmp_path, monkeypatch):
    """A save waits for the write in flight before it copies anything (one copy in host memory at a time); what is
    written is the state at the save, not what the loop made of it meanwhile."""
    weights, found = torch.ones(4), []
    accelerator = _torch_saving(weights, found)
    checkpointer = Checkpointer(accelerator, tmp_path, CheckpointConfig(keep_last=0, **{"async": True}),
                                num_steps=10, log=lambda _: None)
    monkeypatch.setenv(SLOW_WRITE_ENV, "3:1.5")
    checkpointer.save(_state(3))
    weights += 1  # the loop goes on while step 3 is written
    started = time.perf_counter()
    checkpointer.save(_state(6))
    assert time.perf_counter() - started >= 1.0  # waited for step 3's slowed write
    checkpointer.wait()
    assert found == [[], [3]]  # step 6 was copied once step 3 was complete
    saved = [torch.load(tmp_path / "checkpoints" / f"step_{s:08d}" / "optimizer.bin", weights_only=True)["w"]
             for s in (3, 6)]
    assert saved[0].tolist() == [1.0] * 4 and saved[1].tolist() == [2.0] * 4
    assert checkpointer.stalls_s[0] < 1.0 <= checkpointer.stalls_s[1]


def test_one_process_with_a_process_group_saves_over_a_gloo_group_of_its_own(tmp_path):
    """FSDP on one GPU has a process group whose default backend is NCCL alone, which DCP's async_save refuses
    (it plans on CPU): the checkpointer gives each background DCP save a gloo group of its own with one process
    too, as with several. (Here the default group is gloo: what is checked is that the save does not use it.)"""
    import torch.distributed as dist

    from pretrain.checkpoint.background import gather_over

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        checkpointer = Checkpointer(_torch_saving(torch.ones(4)), tmp_path,
                                    CheckpointConfig(keep_last=1, **{"async": True}), num_steps=10,
                                    log=lambda _: None)
        groups = [checkpointer.dcp_group(0), checkpointer.dcp_group(1)]
        assert all(g is not None and g is not dist.group.WORLD for g in groups) and groups[0] is not groups[1]
        assert {dist.get_backend(g) for g in groups} == {"gloo"}
        assert gather_over(checkpointer.group, {"rank": 0}) == [{"rank": 0}]
    finally:
        dist.destroy_process_group()
