"""pretrain-slurm status on a long run (issue 50): it reads the end of metrics.jsonl (last step, loss, ETA), counts its
job log in one streaming pass, and never holds a whole log in memory."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pretrain.checkpoint import rundir
from pretrain.cli import slurm
from tools import scale_logs


@pytest.mark.parametrize("block", [1, 5, 16, 1 << 20])
def test_the_job_log_is_counted_in_blocks_as_if_read_whole(tmp_path, block):
    rng = random.Random(block)
    needles = ["pretrain-slurm: job 7 start ", "preempted: stopped after step"]
    text = "".join(rng.choice([*needles, "step 3/9 loss 2.0\n", "x", "\n", "pre", "pretrain-slurm: job 7 sta"])
                   for _ in range(3000))
    log = tmp_path / "slurm-7.out"
    log.write_text(text)
    assert slurm.count_in_file(log, needles, block=block) == [text.count(n) for n in needles]
    assert slurm.count_in_file(tmp_path / "missing.out", needles) == [0, 0]


def test_status_reads_the_end_of_a_long_metrics_file(tmp_path, monkeypatch):
    """20,000 logged steps (36 MB): the last step, its loss and the ETA come from the file's last block."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no scontrol
    directory = scale_logs.status_run_dir(tmp_path / "run", 20_000)
    size = (directory / rundir.METRICS_FILE).stat().st_size
    read = []
    real_open = open

    def counting_open(*args, **kwargs):
        f = real_open(*args, **kwargs)
        if Path(args[0]).name == rundir.METRICS_FILE:
            inner = f.read

            def counted(*a):
                data = inner(*a)
                read.append(len(data))
                return data

            f.read = counted
        return f

    monkeypatch.setattr(rundir, "open", counting_open, raising=False)
    text = slurm.run_status(directory)
    last = scale_logs.step_record(20_000)
    assert f"last step      20000 (train/loss {last['train/loss']:.4f})" in text
    # 1,000 steps left at 3.4 s a step
    assert "eta            0:56:40 of training to step 21000 (3.4 s/step over the last 19 steps logged" in text
    assert "starts       1 in the log (0 requeue(s)); preemptions 0" in text
    assert sum(read) <= 2 * (rundir.TAIL_BLOCK + 1) < size / 10  # two tail reads (last step, ETA) of one block


def test_status_without_a_horizon_or_pace_prints_no_eta(tmp_path):
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "jobs.jsonl").write_text(
        json.dumps({"job_id": "1", "submitted": "s", "nodes": 1, "processes_per_node": 1, "world_size": 1}) + "\n"
        + '{"job_id": "2", "subm')  # a resubmission cut off by a killed node: not a job
    (tmp_path / rundir.METRICS_FILE).write_text('{"step": 1, "train/loss": null, "time": 1.0}\n')
    text = slurm.run_status(tmp_path)
    assert "last step      1 (train/loss -)" in text and "eta" not in text and "job 2" not in text
