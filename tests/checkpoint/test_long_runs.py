"""Long runs that look after themselves: verified checkpoints and their fallback, the run lock, workers that
die with their launcher, full disks and damaged caches, and the diagnostics of a slow or stuck run."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pretrain.checkpoint.checkpointer import Checkpointer
from pretrain.checkpoint.integrity import (
    MANIFEST_FILE,
    Unverified,
    check_sizes,
    owner,
    record_own,
    verify_all,
    verify_own,
    write_manifest,
)
from pretrain.checkpoint.resume import ResumeChoice, agree_on_resume
from pretrain.checkpoint.rundir import STATE_FILE
from pretrain.checkpoint.state import TrainerState
from pretrain.data.store import TokenRows
from pretrain.distributed.supervise import RunLock
from pretrain.errors import ConfigError, DataError
from pretrain.recipe.config import CheckpointConfig
from pretrain.train.diagnostics import profile_schedule
from tests.fakes import FakeAccelerator
from tests.helpers import FAST, ROOT, RUN, TINY, env, free_port, train, train_here

# ---- the manifest -------------------------------------------------------------------------------------------


def test_each_file_is_hashed_by_the_rank_that_wrote_it():
    assert owner("model.safetensors", 8) == 0 and owner("optimizer.bin", 8) == 0
    assert owner("random_states_5.pkl", 8) == 5 and owner("random_states_5.pkl", 4) == 1
    assert owner("pytorch_model/bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt", 8) == 3
    assert owner("pytorch_model/zero_pp_rank_6_mp_rank_00_model_states.pt", 8) == 6
    assert owner("pytorch_model/mp_rank_00_model_states.pt", 8) == 0
    assert owner("pytorch_model_fsdp_0/__7_0.distcp", 8) == 7 and owner("pytorch_model_fsdp_0/.metadata", 8) == 0


def _checkpoint_dir(path: Path, step: int, world: int = 2, manifest: bool = True) -> Path:
    """A checkpoint as Checkpointer.save leaves it, with files of two ranks and a manifest written per rank."""
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(os.urandom(3 * 4096))
    for rank in (0, 1):  # torch.save archives, as accelerate writes them (anything else is refused unread)
        torch.save({"rank": torch.tensor(rank)}, path / f"random_states_{rank}.pkl")
    (path / STATE_FILE).write_text(TrainerState(step=step, tokens_seen=0, num_steps=10, plan={}, recipe={}).to_json())
    if manifest:
        files = {}
        for rank in range(world):
            files.update(record_own(path, rank, world))
        write_manifest(path, files, world)
    return path


def _flip(path: Path, offset: int = 4096) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_manifest_finds_truncation_by_size_and_a_bit_flip_by_checksum(tmp_path):
    ckpt = _checkpoint_dir(tmp_path / "step_00000004", 4)
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    assert sorted(manifest["files"]) == ["model.safetensors", "random_states_0.pkl", "random_states_1.pkl", STATE_FILE]
    assert check_sizes(ckpt) is None and verify_own(ckpt, 0, 2) is None and verify_all(ckpt) is None
    _flip(ckpt / "model.safetensors")
    assert check_sizes(ckpt) is None  # same size
    assert "model.safetensors has another crc32 than the manifest records (bytes from 0)" in verify_own(ckpt, 0, 2)
    assert verify_own(ckpt, 1, 2) is None
    assert "model.safetensors" in verify_all(ckpt)
    # pretrain-export checks the checksums of what it reads (every file's size, always)
    assert verify_all(ckpt, only=lambda rel: rel != "model.safetensors") is None
    assert "model.safetensors" in verify_all(ckpt, only=lambda rel: rel == "model.safetensors")
    os.truncate(ckpt / "random_states_1.pkl", 2)
    assert "random_states_1.pkl is 2 bytes, the manifest records 1," in check_sizes(ckpt)
    (ckpt / MANIFEST_FILE).write_text("{not json")
    assert "unreadable" in check_sizes(ckpt)
    (ckpt / MANIFEST_FILE).unlink()
    with pytest.raises(Unverified):
        check_sizes(ckpt)
    assert verify_own(ckpt, 0, 1) is None  # written before manifests: resumed unverified


def test_a_big_file_is_checksummed_in_segments_by_several_threads(tmp_path, monkeypatch):
    import pretrain.checkpoint.integrity as integrity

    monkeypatch.setattr(integrity, "SEGMENT_BYTES", 4096)
    monkeypatch.setattr(integrity, "MIN_SEGMENT_BYTES", 4096)  # the bound a manifest read from disk must keep
    ckpt = _checkpoint_dir(tmp_path / "step_00000004", 4)  # model.safetensors: 3 x 4096 bytes
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    assert manifest["segment_bytes"] == 4096 and len(manifest["files"]["model.safetensors"]["crc32"]) == 3
    _flip(ckpt / "model.safetensors", offset=2 * 4096 + 7)
    assert "model.safetensors has another crc32 than the manifest records (bytes from 8,192)" in verify_all(ckpt)


@pytest.mark.parametrize("change, named", [
    ({"segment_bytes": 1}, "segment_bytes = 1, outside"),       # billions of CRC calls: hours of every resume
    ({"segment_bytes": 2**50}, "segment_bytes = 1,125,899,906,842,624, outside"),
    ({"world_size": 0}, "world_size = 0"),
    ({"world_size": "8"}, "world_size = '8'"),
])
def test_a_manifest_number_out_of_bounds_is_damage_found_at_once(tmp_path, change, named):
    """Issue 36: every number of a manifest is bounded before it sizes any work; the checkpoint is then damaged
    (passed over for an older one on resume, refused by export), found by the size check in no time."""
    import time

    ckpt = _checkpoint_dir(tmp_path / "step_00000004", 4)
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    (ckpt / MANIFEST_FILE).write_text(json.dumps({**manifest, **change}))
    start = time.perf_counter()
    for found in (check_sizes(ckpt), verify_own(ckpt, 0, 1), verify_all(ckpt)):
        assert named in found and "damaged or not written by pretrain" in found, found
    assert time.perf_counter() - start < 5


def test_a_manifest_entry_whose_checksums_do_not_match_its_size_is_damage(tmp_path):
    ckpt = _checkpoint_dir(tmp_path / "step_00000004", 4)
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    manifest["files"]["model.safetensors"]["crc32"] *= 3  # three segments' CRCs for a file of one segment
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert "records 'model.safetensors' as" in check_sizes(ckpt)


def test_rank_0_passes_over_a_truncated_newest_and_every_rank_over_a_corrupted_one(tmp_path):
    """The size check (rank 0, before the process group) and the checksums (every rank, after) each move the
    resume to the previous intact checkpoint; the damaged ones are moved aside, named in the warning."""
    from accelerate import PartialState

    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    older = _checkpoint_dir(ckpts / "step_00000002", 2)
    middle = _checkpoint_dir(ckpts / "step_00000004", 4)
    newest = _checkpoint_dir(ckpts / "step_00000006", 6)
    (ckpts / "latest").write_text("step_00000006\n")
    os.truncate(newest / "model.safetensors", 100)
    _flip(middle / "model.safetensors")
    choice = ResumeChoice.decide(run, CheckpointConfig())
    assert (choice.path, choice.step) == (str(middle), 4) and choice.fallbacks == ((str(older), 2),)
    assert choice.damaged[0][0] == str(newest) and "is 100 bytes" in choice.damaged[0][1]
    logged = []
    assert agree_on_resume(PartialState(), choice, run, log=logged.append) == older
    assert sorted(p.name for p in ckpts.iterdir()) == [".damaged-step_00000004", ".damaged-step_00000006", "latest",
                                                       "step_00000002"]
    assert any(f"{newest} is damaged" in m and "model.safetensors is 100 bytes" in m for m in logged)
    assert any(f"{middle} is damaged" in m and "model.safetensors has another crc32" in m for m in logged)


def test_no_intact_checkpoint_is_an_error_and_leaves_them_in_place(tmp_path):
    from accelerate import PartialState

    run = tmp_path / "run"
    only = _checkpoint_dir(run / "checkpoints" / "step_00000004", 4)
    _flip(only / "model.safetensors")
    with pytest.raises(ConfigError, match="no checkpoint in .* is intact"):
        agree_on_resume(PartialState(), ResumeChoice.decide(run, CheckpointConfig()), run)
    assert only.is_dir()
    refused = ResumeChoice.decide(tmp_path / "other", CheckpointConfig(resume=str(only)))
    assert refused.error is None  # sizes are right: the checksum finds it once every rank can check
    os.truncate(only / "random_states_0.pkl", 1)
    refused = ResumeChoice.decide(tmp_path / "other", CheckpointConfig(resume=str(only)))
    assert refused.error.startswith(f"cannot resume from checkpoint.resume = {str(only)!r}: it is damaged")


def test_a_checkpoint_without_manifest_resumes_with_a_warning(tmp_path):
    from accelerate import PartialState

    run = tmp_path / "run"
    old = _checkpoint_dir(run / "checkpoints" / "step_00000004", 4, manifest=False)
    logged = []
    assert agree_on_resume(PartialState(), ResumeChoice.decide(run, CheckpointConfig()), run, log=logged.append) == old
    assert "has no manifest" in logged[-1]


def test_a_save_cut_short_named_as_the_resume_is_refused(tmp_path):
    """Issue 36: a .tmp-step_X killed before its manifest has the trainer state and no manifest, so it passed as a
    checkpoint from before manifests and was resumed, unverified, from a partial save."""
    run = tmp_path / "run"
    partial = _checkpoint_dir(run / "checkpoints" / ".tmp-step_00000006", 6, manifest=False)
    choice = ResumeChoice.decide(tmp_path / "other", CheckpointConfig(resume=str(partial)))
    assert choice.path is None and "is a save that did not finish" in choice.error, choice.error
    assert "step_00000006 if it exists" in choice.error
    aside = _checkpoint_dir(run / "checkpoints" / ".damaged-step_00000004", 4)
    choice = ResumeChoice.decide(tmp_path / "other", CheckpointConfig(resume=str(aside)))
    assert choice.path is None and "is a checkpoint set aside" in choice.error


def test_a_step_directory_that_is_a_symlink_is_not_the_runs_own(tmp_path):
    """Issue 36: a checkpoints/step_X that links elsewhere was counted, resumed by auto and pruned through (pretrain
    deletes only what it owns): it is passed over, and latest naming it is refused like any path out."""
    from pretrain.checkpoint.rundir import complete_checkpoints, latest_checkpoint

    run = tmp_path / "run"
    own = _checkpoint_dir(run / "checkpoints" / "step_00000002", 2)
    elsewhere = _checkpoint_dir(tmp_path / "elsewhere" / "step_00000008", 8)
    (run / "checkpoints" / "step_00000008").symlink_to(elsewhere, target_is_directory=True)
    assert complete_checkpoints(run) == [(2, own)] and latest_checkpoint(run) == own
    assert ResumeChoice.decide(run, CheckpointConfig()).path == str(own)
    (run / "checkpoints" / "latest").write_text("step_00000008\n")  # latest naming it: refused, as any path out
    assert "is not inside" in ResumeChoice.decide(run, CheckpointConfig()).error
    assert sorted(p.name for p in elsewhere.iterdir())  # untouched


def _state(step: int) -> TrainerState:
    return TrainerState(step=step, tokens_seen=0, num_steps=10, plan={}, recipe={})


def test_a_full_disk_while_saving_is_one_message_and_loses_nothing(tmp_path):
    Checkpointer(FakeAccelerator({"model.safetensors": b"w" * 1000}), tmp_path, CheckpointConfig(keep_last=1), num_steps=10).save(_state(3))
    full = Checkpointer(FakeAccelerator({"model.safetensors": b"w" * 1000}, fail_with=OSError(errno.ENOSPC, "No space left on device")), tmp_path,
                        CheckpointConfig(keep_last=1), num_steps=10)
    with pytest.raises(ConfigError) as exc:
        full.save(_state(6))
    message = str(exc.value)
    assert message.startswith(f"disk full: no space left on the filesystem of {tmp_path / 'checkpoints'}")
    assert "the checkpoint of step 6" in message and "step_00000003 (step 3) is intact" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000003"]
    assert verify_all(tmp_path / "checkpoints" / "step_00000003") is None
    other = Checkpointer(FakeAccelerator(fail_with=RuntimeError("something else")), tmp_path, CheckpointConfig(), num_steps=10)
    with pytest.raises(RuntimeError, match="something else"):  # not a full disk: not dressed up as one
        other.save(_state(9))


def test_a_full_disk_during_the_export_is_one_message(tmp_path, monkeypatch):
    import transformers

    from pretrain.model.build import save_pretrained_model

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32))

    def full(*args, **kwargs):
        Path(args[0] if args else kwargs["save_directory"]).mkdir(parents=True, exist_ok=True)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(model), "save_pretrained", lambda self, *a, **k: full(*a, **k))
    with pytest.raises(ConfigError, match=r"^disk full: .* while writing the model to .*final_model; the partial copy"):
        tokenizer = SimpleNamespace(bos_token_id=None, eos_token_id=0, pad_token_id=None)  # never reached
        save_pretrained_model(model, model.state_dict(), tokenizer, tmp_path / "final_model", [])
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_token_store_names_the_rebuild(tmp_path):
    shards = tmp_path / "store" / "shards"
    shards.mkdir(parents=True)
    np.arange(100, dtype=np.uint16).tofile(shards / "a.ds")
    np.arange(50, dtype=np.uint16).tofile(shards / "b.ds")
    rows = TokenRows([shards / "a.ds", shards / "b.ds"], [100, 60], np.dtype("<u2"), row_len=10)
    assert rows[0].tolist() == list(range(10))
    with pytest.raises(DataError, match=r"store.*b\.ds \(50 tokens, the manifest records 60\).*delete .*manifest.json"):
        rows[12]


# ---- the run lock ---------------------------------------------------------------------------------------------


def test_one_lock_per_output_dir_and_a_dead_holder_is_taken_over(tmp_path):
    lock = RunLock.acquire(tmp_path)
    with pytest.raises(ConfigError, match=rf"in use by another run \(pid {os.getpid()} on host .*\), which holds"):
        RunLock.acquire(tmp_path)
    lock.release()
    RunLock.acquire(tmp_path).release()
    # A holder that dies without releasing: the kernel drops its flock, its name stays in the file.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pretrain.distributed.supervise import RunLock; "
                               f"RunLock.acquire({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)"],
                              env=env(PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ConfigError, match=f"pid {holder.pid}"):
        RunLock.acquire(tmp_path)
    holder.kill()
    holder.wait()
    logged = []
    taken = RunLock.acquire(tmp_path, log=logged.append)
    assert f"pid {holder.pid}" in taken.previous and "taking over" in logged[0]
    taken.release()


def test_a_second_run_on_a_locked_output_dir_exits_2(tmp_path):
    lock = RunLock.acquire(tmp_path)
    proc = train([*FAST, "train.max_steps=2", f"output_dir={tmp_path}"], timeout=300)
    lock.release()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"is in use by another run (pid {os.getpid()}" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


# ---- diagnostics, no processes ----------------------------------------------------------------------------------


def test_profile_schedule_records_the_asked_steps():
    # A fresh run (first loop step 1): steps 3-4 traced after one warm-up step (step 2).
    assert profile_schedule(3, 2, 0) == {"skip_first": 1, "wait": 0, "warmup": 1, "active": 2, "repeat": 1}
    assert profile_schedule(1, 1, 0) == {"skip_first": 0, "wait": 0, "warmup": 0, "active": 1, "repeat": 1}
    assert profile_schedule(8, 3, 5)["skip_first"] == 1  # resumed at step 5: steps 6 skipped, 7 warm-up
    assert profile_schedule(3, 2, 5) is None


# ---- end to end ---------------------------------------------------------------------------------------------------

SMALL = [*FAST, "eval.batches=1", "eval.at_start=false", "checkpoint.save_final_model=false"]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_damaged_newest_checkpoint_falls_back_and_a_damaged_only_one_stops(tmp_path):
    """Bit-flipped and truncated model.safetensors of the newest checkpoint: each run resumes from the previous
    one with a warning naming the file; with only the damaged checkpoint the run exits 2."""
    args = [*SMALL, "train.max_steps=6", "checkpoint.every_steps=3"]
    base = tmp_path / "base"
    # The runs that succeed train in this process (what run.py runs, seconds instead of an interpreter start
    # each); the refusal's exit code and message are the entry point's, so that run is a subprocess.
    train_here([*args, f"output_dir={base}"])
    assert (base / "checkpoints" / "step_00000006" / MANIFEST_FILE).is_file()
    for damage in ("flip", "truncate"):
        run = tmp_path / damage
        shutil.copytree(base, run)
        weights = run / "checkpoints" / "step_00000006" / "model.safetensors"
        _flip(weights) if damage == "flip" else os.truncate(weights, weights.stat().st_size // 2)
        _, _, console = train_here([*args, f"output_dir={run}"])
        warning = next(line for line in console.splitlines() if line.startswith("warning: checkpoint"))
        assert f"checkpoint {run / 'checkpoints' / 'step_00000006'} is damaged (" in warning and str(weights) in warning
        assert f"resume: continuing from {run / 'checkpoints' / 'step_00000003'} at step 3" in console
        assert (run / "checkpoints" / ".damaged-step_00000006").is_dir()
        assert verify_all(run / "checkpoints" / "step_00000006") is None  # saved again, intact
        assert [m["step"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if "train/loss" in m] == [1, 2, 3, 4, 5, 6]
    only = tmp_path / "only"
    shutil.copytree(base, only)
    shutil.rmtree(only / "checkpoints" / "step_00000003")
    _flip(only / "checkpoints" / "step_00000006" / "model.safetensors")
    proc = train([*args, f"output_dir={only}"], timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "cannot resume: no checkpoint in" in proc.stderr and "model.safetensors has another crc32" in proc.stderr
    assert "Traceback" not in proc.stderr and (only / "checkpoints" / "step_00000006").is_dir()


def _launch(config: str, args: list[str], extra_env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / config),
           "--main_process_port", str(free_port()), RUN, "--recipe", TINY, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env(**(extra_env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_workers_die_with_their_launcher(tmp_path):
    """kill -9 of the accelerate launch process group (torchrun put the workers in sessions of their own)."""
    out = tmp_path / "run"
    launcher = _launch("cpu_ddp.yaml", [*SMALL, "train.max_steps=100000", f"output_dir={out}"])
    workers: list[int] = []
    try:
        deadline = time.time() + 300
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert launcher.poll() is None, launcher.stdout.read()
            assert time.time() < deadline, "no step logged within 300 s"
            time.sleep(0.2)
        workers = [pid for pid in _children(launcher.pid) if "pretrain/run.py" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(workers) == 2 and all(os.getsid(w) != os.getsid(launcher.pid) for w in workers)
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + 5
        while any(map(_alive, workers)) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, workers)), f"workers {[w for w in workers if _alive(w)]} outlived the launcher"
    finally:  # whatever failed, no worker outlives the test
        for pid in [*workers, *_children(launcher.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)


@pytest.mark.slow
def test_two_processes_profile_log_per_rank_step_times_and_a_stalled_rank_dumps_every_stack(tmp_path):
    """One 2-process launch: steps 2-3 traced per rank (JSON), the per-rank step-time keys on every logging step,
    then rank 1 stalls before step 5: both ranks' stacks are dumped into output_dir/hang and the launch fails."""
    out = tmp_path / "run"
    # A 5 s watchdog: over ten times a step (and a trace export) of this model, and the test waits it out (plus
    # HANG_EXIT_GRACE_S) once rank 1 stalls.
    launcher = _launch("cpu_ddp.yaml", [*SMALL, "train.max_steps=8", f"output_dir={out}", "profile.start_step=2",
                                        "runtime.hang_timeout_s=5"], extra_env={"PRETRAIN_TEST_STALL": "1:5"})
    try:
        output, _ = launcher.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode != 0, output[-4000:]
    traces = sorted((out / "profile").glob("*.json"))
    assert [t.name for t in traces] == ["rank0_steps2-3.json", "rank1_steps2-3.json"], output[-4000:]
    for trace in traces:
        assert json.loads(trace.read_text())["traceEvents"]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in logged if "train/loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    for m in steps:
        assert 0 < m["perf/step_time_min_s"] <= m["perf/step_time_max_s"] and m["perf/step_time_slowest_rank"] in (0, 1)
    stacks = {rank: (out / "hang" / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    for rank, text in stacks.items():
        assert f"rank {rank} (host" in text and "runtime.hang_timeout_s = 5 s" in text and "most recent call first" in text
    assert "step_start" in stacks[1]  # the stalled rank sleeps in the test hook
    assert "step_time_metrics" in stacks[0] or "train_step" in stacks[0]  # the other waits for it in a collective


def test_an_out_of_memory_step_dumps_the_allocator_history_first(tmp_path, monkeypatch):
    """The CUDA path with the two CUDA calls replaced (no GPU here): record at start, dump on OOM, re-raise."""
    import torch

    from pretrain.recipe.config import ProfileConfig, RuntimeConfig
    from pretrain.train.diagnostics import Diagnostics

    recorded, logged = [], []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: recorded.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: Path(path).write_text("snapshot"))
    accelerator = type("Acc", (), {"process_index": 3, "device": torch.device("cuda", 0)})()
    diagnostics = Diagnostics(accelerator, RuntimeConfig(memory_snapshot_on_oom=True), ProfileConfig(), tmp_path, logged.append)
    assert recorded and not logged
    with pytest.raises(torch.OutOfMemoryError), diagnostics.oom_snapshot():
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert (tmp_path / "memory_snapshot_rank3.pickle").read_text() == "snapshot"
    on_cpu = type("Acc", (), {"process_index": 0, "device": torch.device("cpu")})()
    Diagnostics(on_cpu, RuntimeConfig(memory_snapshot_on_oom=True), ProfileConfig(), tmp_path, logged.append)
    assert "needs a CUDA device" in logged[-1]
