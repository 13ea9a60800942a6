"""tools/fault_harness.py on the tests' private SLURM cluster: a 2-process run under a schedule of faults (a
straggler, a preemption while an attempt starts, one during an evaluation, a loss spike, a preemption during an
asynchronous checkpoint write, a corrupted newest checkpoint and a killed rank) finishes by itself, on the losses of an uninterrupted run, with the
slow host excluded, and its goodput accounts for every second."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pretrain.cli.slurm import queue_intervals
from pretrain.train.goodput import read_goodput, summarise, summary_line
from tests.helpers import ROOT, accelerate_launch, check_ok, env, metrics, train_losses

sys.path.insert(0, str(ROOT / "tools"))
import fault_harness  # noqa: E402


@pytest.mark.slow
def test_the_run_finishes_by_itself_through_every_fault_on_the_uninterrupted_curve(cluster, tmp_path):
    out, report_path = tmp_path / "run", tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "fault_harness.py"), "--output", str(out),
                           "--json", str(report_path)], env=cluster.env(env()), cwd=ROOT, capture_output=True,
                          text=True, timeout=1200)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:] + cluster.logs()
    report = json.loads(report_path.read_text())

    # No human: one submission, then every job and requeue the run made for itself.
    assert report["outcome"] == "COMPLETED" and report["last_step"] == 48
    faults = [e["fault"] for e in report["events"]]
    assert faults == ["preemption"] * 3 + ["corrupted checkpoint", "killed rank"], report["events"]
    # The straggler: its node excluded, the job resubmitted itself without it and went on elsewhere.
    [first, *later] = report["jobs"]
    [slow_host] = report["excluded_hosts"]
    assert later and all(json.loads(line).get("exclude") == slow_host
                         for line in (out / "slurm" / "jobs.jsonl").read_text().splitlines()[1:])
    # stragglers.jsonl has every slow logged step (a loaded machine adds some); the verdicts are the slowed rank's
    stragglers = [json.loads(line) for line in (out / "stragglers.jsonl").read_text().splitlines()]
    verdicts = [(r["host"], r["rank"]) for r in stragglers if r["in_a_row"] >= r["window"]]
    assert verdicts and set(verdicts) == {(slow_host, 1)}, stragglers
    # The preemption while an attempt started stopped it before any step (or, had the signal come before the
    # handlers, the batch script's TERM after its grace did); the others checkpointed their step.
    log = "".join(path.read_text() for path in sorted((out / "slurm").glob("slurm-*.out")))
    assert "preempted: SIGUSR1 while the run was starting" in log or "SIGTERM" in log, log[-3000:]
    assert log.count("preempted: stopped after step") >= 2
    # The spike rolled back once; the damaged checkpoint was passed over and set aside, never deleted.
    assert len((out / "rollbacks.jsonl").read_text().splitlines()) == 1
    assert (out / "checkpoints" / ".damaged-step_00000040").is_dir()

    # The same losses as one uninterrupted 2-process run with the same spike (so the same rollback window).
    reference = tmp_path / "reference"
    check_ok(accelerate_launch("cpu_ddp.yaml", fault_harness.run_overrides(48, reference),
                               extra_env=fault_harness.spike_environment()))
    expected, got = train_losses(reference), train_losses(out)
    assert sorted(got) == sorted(expected) and max(got) == 48  # every logged step (logging.every_steps=2)
    logged = [m["step"] for m in metrics(out) if "train/loss" in m]
    assert len(logged) == len(set(logged))  # steps redone after a resume replaced the lost lines
    for step in sorted(expected):  # measured: equal to the last bit (a resume on the same layout is exact)
        assert got[step] == pytest.approx(expected[step], rel=1e-6), (step, got[step], expected[step])

    # Goodput: the faults cost time in their categories, and the categories sum to the wall time.
    seconds = report["seconds"]
    assert seconds["rollback"] > 0 and seconds["lost"] > 0 and seconds["queue"] > 0 and seconds["productive"] > 0
    assert report["category_sum_s"] == pytest.approx(report["wall_s"], rel=0.01)
    assert 0 < report["goodput"] < 1 and report["attempts"] >= 5
    events = [(json.loads(line)["job_id"], json.loads(line)["event"])
              for line in (out / "slurm" / "allocations.jsonl").read_text().splitlines()]
    second = later[-1]
    assert events == [(first, "start"), (first, "end"), *[(second, e) for e in (
        "start", "requeue", "start", "requeue", "start", "requeue", "start", "failure", "start", "end")]]

    # pretrain-slurm status across the jobs and requeues: the same figures (it was the test of a plain USR1 requeue)
    status = subprocess.run([sys.executable, "-m", "pretrain.cli.slurm", "status", str(out)], env=cluster.env(env()),
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    check_ok(status)
    assert "COMPLETED (restarts 4" in status.stdout and "5 in the log (4 requeue(s)); preemptions 2" in status.stdout
    assert "step_00000048 (step 48/48" in status.stdout
    totals = summarise(read_goodput(out), queue_intervals(out / "slurm"))
    assert f"goodput        {summary_line(totals)}" in status.stdout
