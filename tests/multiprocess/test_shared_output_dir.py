"""Every rank resumes from the checkpoint rank 0 chose, in the one output_dir rank 0 writes: two gloo
processes whose views of a path differ (tests/rank_cwd_run.py) are refused with one clear message and exit 2
on every rank, within seconds, never a hang. (Two processes that share it resume together in
tests/multiprocess/test_distributed.py, whose ZeRO runs resume from step 3.)"""

from __future__ import annotations

import os
import re

import pytest

from pretrain.checkpoint.rundir import LATEST_FILE, STATE_FILE
from pretrain.checkpoint.state import TrainerState
from tests.helpers import FAST, ROOT, accelerate_launch

pytestmark = pytest.mark.slow

ARGS = [*FAST, "train.max_steps=2", "eval.batches=1", "checkpoint.save_final_model=false"]
SHIM = str(ROOT / "tests" / "rank_cwd_run.py")
# Both failures happen at start-up, before data or model; a hang in a collective would last the gloo
# default of 30 minutes, so this limit is what makes a hang fail the test fast.
START_UP_S = 240


def launch_per_rank_cwd(root, args):
    return accelerate_launch("cpu_ddp.yaml", [*ARGS, *args], script=[SHIM, str(root)], timeout=START_UP_S)


def assert_refused_once_on_every_rank(proc, *expected: str) -> str:
    """Exit status 2 from the ranks (the launcher reports it and exits 1), the message printed once, by rank 0,
    and no traceback from our processes (the launcher's own ChildFailedError report is accelerate's)."""
    assert proc.returncode != 0
    assert re.search(r"exitcode\s*:\s*2\b", proc.stderr), proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines()
            if line.strip().startswith('File "') and (str(ROOT / "pretrain") + os.sep in line or SHIM in line)]
    assert ours == [], proc.stderr[-3000:]
    for text in expected:
        assert text in errors[0], (text, errors[0])
    return errors[0]


def fake_checkpoint(checkpoints, step: int):
    """A complete checkpoint as far as choosing one goes (trainer_state.json, written by this very layout: the
    run stops before loading)."""
    path = checkpoints / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / STATE_FILE).write_text(TrainerState(step=step, tokens_seen=0, num_steps=2, plan={"world_size": 2}, recipe={}).to_json())
    (checkpoints / LATEST_FILE).write_text(path.name + "\n")


def test_an_output_dir_that_differs_between_nodes_is_refused_on_every_rank(tmp_path):
    # output_dir=run is relative: rank 0 writes ROOT/rank0/run, rank 1 ROOT/rank1/run (node-local disk).
    proc = launch_per_rank_cwd(tmp_path, ["output_dir=run"])
    message = assert_refused_once_on_every_rank(
        proc, "output_dir = 'run' is not one directory shared by every process", "rank 0 (host ",
        f"wrote {tmp_path / 'rank0' / 'run'}/.shared-probe-", "rank 1 (host ",
        f"found no such file at {tmp_path / 'rank1' / 'run'}/.shared-probe-", "not on node-local disk")
    assert "rank 0 (host" in message and "rank 1 (host" in message
    assert list((tmp_path / "rank0" / "run").glob(".shared-probe-*")) == []  # rank 0 removed its probe


def test_ranks_that_see_different_latest_checkpoints_are_refused_on_every_rank(tmp_path):
    # output_dir is shared, but its checkpoints/ is a symlink into each process's own working directory,
    # as if it pointed at node-local scratch: rank 0's newest is step 4, rank 1's step 2.
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "checkpoints").symlink_to("/proc/self/cwd/checkpoints")
    fake_checkpoint(tmp_path / "rank0" / "checkpoints", 4)
    fake_checkpoint(tmp_path / "rank1" / "checkpoints", 2)
    proc = launch_per_rank_cwd(tmp_path, [f"output_dir={shared}"])
    assert_refused_once_on_every_rank(
        proc, "the ranks do not see the same checkpoint to resume from",
        f"chose {shared / 'checkpoints' / 'step_00000004'} at step 4 (checkpoint.resume=auto)",
        "rank 1 (host ", f"found no complete checkpoint at {tmp_path / 'rank1' / 'checkpoints' / 'step_00000004'}",
        f"newest visible: {shared / 'checkpoints' / 'step_00000002'} at step 2", "not on node-local disk")

