"""A stop signal (SIGUSR1, as SLURM sends before its time limit) in every phase of a run: the data build, the first
step's compilation, an evaluation, a synchronous checkpoint save, an asynchronous checkpoint write still in flight,
and the final export. Each attempt either checkpoints the step in flight or stops before anything was trained, and
the next attempt (the same command, as a requeued job runs it) continues the same curve: the losses of the chain of
attempts are those of one uninterrupted run, and no step is done twice.

The signal comes from inside at the very point (``preemption.signal_hook``, PRETRAIN_TEST_SIGNAL): the process sends
itself SIGUSR1 there, which is what the handlers receive from SLURM's batch script through srun."""

from __future__ import annotations

import json

import pytest

from pretrain.train.goodput import read_goodput
from tests.helpers import FAST, check_ok, train, train_losses

ARGS = [*FAST, "train.max_steps=16", "checkpoint.every_steps=4", "eval.every_steps=4", "checkpoint.keep_last=0"]

# (the hook, the step it names, what the attempt's log says, the step it stopped after)
PHASES = [
    ("data_build", "preempted: SIGUSR1 while the run was starting", None),
    ("first_step", "preempted: stopped after step 1/16 with a checkpoint", 1),
    ("evaluation:4", "preempted: stopped after step 4/16 with a checkpoint", 4),
    ("checkpoint:8", "preempted: stopped after step 8/16 with a checkpoint", 8),
    ("checkpoint_written:12", "preempted: stopped after step 12/16 with a checkpoint", 12),  # checkpoint.async
    ("final_model", "export: transformers model and tokenizer in", 16),
]


@pytest.mark.slow
def test_a_stop_signal_in_every_phase_checkpoints_or_stops_clean_and_the_chain_is_one_run(tmp_path):
    reference = tmp_path / "reference"
    check_ok(train([*ARGS, f"output_dir={reference}", f"data.cache_dir={tmp_path / 'reference-cache'}"]))
    out, cache = tmp_path / "run", tmp_path / "cache"  # a cache of its own: the first attempt builds the store
    for hook, said, stopped_after in PHASES:
        asynchronous = "true" if hook.startswith("checkpoint_written") else "false"
        proc = train([*ARGS, f"output_dir={out}", f"data.cache_dir={cache}", f"checkpoint.async={asynchronous}"],
                     extra_env={"PRETRAIN_TEST_SIGNAL": hook})
        check_ok(proc)  # exit 0: a preemption is not a failure
        assert said in proc.stdout, (hook, proc.stdout[-3000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        if stopped_after is not None:
            latest = (out / "checkpoints" / "latest").read_text().strip()
            assert latest == f"step_{stopped_after:08d}", (hook, latest)
    assert "SIGUSR1: stopping after the step in flight" not in proc.stdout  # the export finishes: the run is complete
    assert (out / "final_model" / "config.json").is_file()
    exported = (out / "final_model" / "model.safetensors").stat().st_mtime_ns
    again = train([*ARGS, f"output_dir={out}", f"data.cache_dir={cache}"])  # the requeue after the export's signal
    check_ok(again)
    assert "run already complete at step 16/16" in again.stdout and "is there already" in again.stdout
    assert (out / "final_model" / "model.safetensors").stat().st_mtime_ns == exported

    assert train_losses(out) == train_losses(reference)  # exactly: every stop kept its step, every resume is exact
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in line]
    assert logged == list(range(1, 17))
    # goodput: no attempt did a step again (each stop checkpointed the step in flight); the data build's attempt
    # stopped before its first record, so its seconds are the restart before the next one
    attempts = read_goodput(out)
    assert len(attempts) == len(PHASES)  # the five that got past the start, and the "already complete" one
    assert all(a["seconds"]["lost"] == 0 for a in attempts)
    assert [a["step"] for a in attempts] == [1, 4, 8, 12, 16, 16]
