"""Run a recipe as a pretrain-slurm job under a schedule of injected faults, and report whether the run finished
by itself and what the faults cost (goodput).

    python tools/fault_harness.py --output /tmp/harness              # the default schedule on 1 node x 2 processes
    python tools/fault_harness.py --output /tmp/clean --faults none  # the same run without faults
    python tools/fault_harness.py --output DIR --json report.json    # the report as JSON too
    python tools/fault_harness.py --output DIR --faults both --local-cluster   # the benchmark: both, side by side

It needs a SLURM cluster with at least two nodes (sbatch, scontrol, scancel on PATH; SLURM_CONF where it is not
the default), or ``--local-cluster``: the tests' private cluster on this machine (tests/slurm_cluster.py, from a
checkout; root, Debian's SLURM packages), started for the run and stopped after it. The run is the tiny
recipe on its smallest shape (``SHAPE``), ``--steps`` optimizer steps, a checkpoint every 4 steps, an evaluation
every 8, with ``runtime.straggler.action=exclude``. The schedule (``--faults all``), in the order the run meets it:

1. **a straggler**: rank 1 is slowed by ``--slow-s`` per step on the job's first node; the run names it after
   ``straggler.window`` slow logged steps, checkpoints, and the job submits itself again without that node;
2. **a preemption while an attempt starts**: USR1 to the new job's batch script while its processes import and
   build the store and the model: the run stops before any step, the job requeues;
3. **a preemption during an evaluation**: the evaluation of step 16 pauses while the harness sends USR1 to the
   batch script (``scancel --signal=USR1 --batch``): every rank checkpoints and the job requeues;
4. **a loss spike**: the loss of 3 global batches in a row is multiplied by 1e3 (the stability test hook): every
   update is skipped, and stability.rollback reloads the checkpoint before them and skips their window;
5. **a preemption during an asynchronous checkpoint write**: the background write of step 28 is held while the
   harness sends USR1;
6. **a corrupted newest checkpoint and a killed rank**, in the attempt after that: once step 40's checkpoint is
   complete (the ranks pause there for the harness) the harness flips bytes of its model file, then kills rank 1
   with SIGKILL; the job requeues after the failure and the resume
   passes over the damaged checkpoint to the one before.

The report: the job's outcome, every job and attempt, the steps, the excluded host, the faults as they were
injected, and the run's goodput (``pretrain-slurm status``'s figures): its categories and their sum against the
wall time. ``--faults none`` runs the same job with none of them (the clean figure the benchmark compares).
Exit status: 0 when the run completed by itself, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pretrain.checkpoint import rundir
from pretrain.cli.slurm import queue_intervals
from pretrain.distributed.preemption import PAUSE_AT_ENV, PAUSE_DIR_ENV
from pretrain.train.goodput import read_goodput, summarise, summary_line

ROOT = Path(__file__).resolve().parents[1]

TINY = ROOT / "recipes" / "tiny.yaml"
# The smallest shape that still trains: 2 blocks of width 64, 64-token sequences, GBS 8.
SHAPE = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.intermediate_size=128",
         "data.seq_len=64", "batch.global_batch_size=8", "batch.micro_batch_size=4", "lr_schedule.warmup_steps=1",
         "eval.batches=2", "eval.tasks=[]", "logging.progress=plain"]
EVAL_PAUSE_STEP, ASYNC_WRITE_STEP, CORRUPT_STEP = 16, 28, 40
SPIKE_BATCHES = (21, 22, 23)  # steps 22-24 of a run that has skipped no batch: after the evaluation's requeue
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def run_overrides(steps: int, output: Path) -> list[str]:
    """The recipe's overrides, the same with and without faults (the reference run uses them too)."""
    return [*SHAPE, f"train.max_steps={steps}", "checkpoint.every_steps=4", "checkpoint.keep_last=0",
            "checkpoint.async=true", "eval.every_steps=8", "logging.every_steps=2",
            # the slowed rank is ~30x the other; 3x three logged steps in a row is never the noise of a loaded machine
            "runtime.straggler.action=exclude", "runtime.straggler.factor=3", "runtime.straggler.window=3",
            "stability.window_steps=4", "stability.spike_sigma=100", "stability.max_consecutive_skips=3",
            "stability.rollback.enabled=true", f"output_dir={output}"]


def spike_environment() -> dict[str, str]:
    """The loss spike (the stability test hook), keyed by global batch: the reference run gets it too."""
    return {"PRETRAIN_TEST_LOSS_FACTORS": ",".join(f"{batch}:1e3" for batch in SPIKE_BATCHES)}


def slurm(*args: str, check: bool = True) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def job_fields(job_id: str) -> dict[str, str]:
    out = slurm("scontrol", "show", "job", "--oneliner", job_id, check=False)
    fields: dict[str, str] = {}
    for token in out.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def first_idle_node() -> str:
    """The node SLURM gives a 1-node job on an idle cluster: the first idle one by name."""
    nodes = sorted(slurm("sinfo", "-h", "-N", "-t", "idle", "-o", "%N").split())
    if len(nodes) < 2:
        raise RuntimeError(f"the harness needs 2 idle SLURM nodes (one to exclude), found {nodes or 'none'}")
    return nodes[0]


class Harness:
    def __init__(self, output: Path, steps: int, faults: bool, processes: int, slow_s: float, timeout_s: float,
                 config: str):
        self.output, self.steps, self.faults = output, steps, faults
        self.processes, self.slow_s, self.timeout_s, self.config = processes, slow_s, timeout_s, config
        self.events: list[dict] = []  # the faults as injected
        self.pause_dir = output.parent / f".{output.name}-pauses"
        self.started = time.time()

    # ---- the job ----------------------------------------------------------------------------------------------
    def jobs(self) -> list[str]:
        path = self.output / "slurm" / "jobs.jsonl"
        return [json.loads(line)["job_id"] for line in path.read_text().splitlines()] if path.is_file() else []

    def current_job(self) -> str:
        return self.jobs()[-1]

    def submit(self) -> str:
        env = dict(os.environ)
        if self.faults:
            self.node = first_idle_node()
            env.update(spike_environment())
            env["PRETRAIN_TEST_SLOW"] = f"1:{self.slow_s}:{self.node}"
            env[PAUSE_AT_ENV] = (f"evaluation:{EVAL_PAUSE_STEP}:2,checkpoint_written:{ASYNC_WRITE_STEP}:0,"
                                 f"checkpoint_written:{CORRUPT_STEP}:3")  # the last: the rank to kill is still there
            env[PAUSE_DIR_ENV] = str(self.pause_dir)
            env["PRETRAIN_TEST_SLOW_CHECKPOINT_WRITE"] = f"{ASYNC_WRITE_STEP}:2"
            self.pause_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pretrain.cli.slurm", "submit", "--recipe", str(TINY), "--accelerate-config",
               str(ROOT / "accelerate_configs" / self.config), "--nodes", "1", "--processes-per-node",
               str(self.processes), "--gpus-per-node", "0", "--no-doctor",
               *run_overrides(self.steps, self.output)]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"pretrain-slurm submit failed (exit {proc.returncode}): {proc.stderr.strip()}")
        return self.current_job()

    def starts(self) -> int:
        """The allocations started so far (the batch script's records)."""
        path = self.output / "slurm" / "allocations.jsonl"
        return path.read_text().count('"event": "start"') if path.is_file() else 0

    def note(self, fault: str, **details) -> None:
        self.events.append({"fault": fault, "at_s": round(time.time() - self.started, 1), **details})
        print(f"harness: {fault} {details}", flush=True)

    def preempt(self, why: str) -> None:
        job = self.current_job()
        slurm("scancel", "--signal=USR1", "--batch", job)
        self.note("preemption", during=why, job=job)

    # ---- the schedule ---------------------------------------------------------------------------------------------
    def drive(self) -> dict[str, str]:
        """Inject the faults as the run reaches them, one per attempt (steps of milliseconds outrun a signal's way
        through slurmctld, the batch script and srun: each fault waits for the attempt after the one before);
        return the last job's fields once every job has ended."""
        deadline = time.monotonic() + self.timeout_s
        schedule = ["start", "evaluation", "async_write", "corrupt_and_kill"] if self.faults else []
        armed_at, seen_starting = 0, None  # the allocations started when the last fault was injected
        while time.monotonic() < deadline:
            fault = schedule[0] if schedule and self.starts() > armed_at else None
            done = False
            if fault == "start" and len(self.jobs()) > 1:  # the job resubmitted without the straggler's node
                pid = rank_pid(self.output, rank=0)
                seen_starting = (seen_starting or time.monotonic()) if pid is not None else None
                # the process has installed its handlers (its first second: the interpreter and pretrain's imports)
                if seen_starting is not None and time.monotonic() - seen_starting > 1.5:
                    self.preempt("the start of an attempt (imports, the store, the model)")
                    done = True
            elif fault == "evaluation" and (self.pause_dir / f"evaluation-{EVAL_PAUSE_STEP}").exists():
                self.preempt(f"the evaluation of step {EVAL_PAUSE_STEP}")
                done = True
            elif fault == "async_write" and (self.pause_dir / f"checkpoint_written-{ASYNC_WRITE_STEP}").exists():
                self.preempt(f"the asynchronous write of step {ASYNC_WRITE_STEP}'s checkpoint")
                done = True
            elif fault == "corrupt_and_kill":
                done = self.corrupt_and_kill()
            if done:
                schedule.pop(0)
                armed_at = self.starts()
            job = self.current_job()
            fields = job_fields(job)
            # a job that resubmitted itself (a straggler host) appended its successor before it ended
            if fields.get("JobState") in FINAL_STATES and self.current_job() == job:
                return fields
            time.sleep(0.1)
        raise TimeoutError(f"the run did not end within {self.timeout_s:.0f} s")

    def corrupt_and_kill(self) -> bool:
        checkpoint = self.output / "checkpoints" / f"step_{CORRUPT_STEP:08d}"
        if not ((self.pause_dir / f"checkpoint_written-{CORRUPT_STEP}").exists()
                and (checkpoint / "manifest.json").is_file()):
            return False
        weights = sorted(checkpoint.glob("model*.safetensors")) or sorted(checkpoint.glob("pytorch_model*.bin"))
        target = weights[0]
        with open(target, "r+b") as f:  # the same size, other bytes: the manifest's CRC-32 no longer matches
            f.seek(target.stat().st_size // 2)
            chunk = f.read(64)
            f.seek(target.stat().st_size // 2)
            f.write(bytes(b ^ 0xFF for b in chunk))
        self.note("corrupted checkpoint", file=str(target.relative_to(self.output)))
        pid = rank_pid(self.output, rank=1)
        if pid is None:
            self.note("no rank to kill", rank=1)
        else:
            os.kill(pid, signal.SIGKILL)
            self.note("killed rank", rank=1, pid=pid, signal="SIGKILL")
        return True

    # ---- the report ---------------------------------------------------------------------------------------------------
    def report(self, fields: dict[str, str]) -> dict:
        out = self.output
        attempts = read_goodput(out)
        totals = summarise(attempts, queue_intervals(out / "slurm"))
        train = [m for m in rundir.read_metrics(out) if "train/loss" in m]
        excluded = (out / "slurm" / "excluded_hosts")
        category_sum = sum(totals["seconds"].values())
        return {
            "faults": "all" if self.faults else "none", "outcome": fields.get("JobState"),
            "completed": fields.get("JobState") == "COMPLETED" and bool(train) and train[-1]["step"] == self.steps,
            "last_step": train[-1]["step"] if train else None, "jobs": self.jobs(),
            "attempts": len(attempts), "excluded_hosts": excluded.read_text().split() if excluded.exists() else [],
            "events": self.events, "goodput": totals["goodput"], "wall_s": round(totals["wall_s"], 2),
            "seconds": {k: round(v, 2) for k, v in totals["seconds"].items()},
            "category_sum_s": round(category_sum, 2),
            "harness_wall_s": round(time.time() - self.started, 1),
            "summary": summary_line(totals), "losses": {m["step"]: m["train/loss"] for m in train},
        }


def rank_pid(output: Path, rank: int) -> int | None:
    """The training process of ``rank`` of the run writing ``output`` (this machine's /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (any(arg.endswith(b"pretrain/run.py") for arg in cmdline) and f"output_dir={output}".encode() in cmdline
                and f"RANK={rank}".encode() in environ):
            return int(entry.name)
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, type=Path, help="the run directory (must not exist)")
    parser.add_argument("--faults", choices=["all", "none", "both"], default="all",
                        help="both: the run with every fault, then without any, and their goodput side by side")
    parser.add_argument("--steps", type=int, default=48, help="optimizer steps (at least 44: the schedule's last "
                        "fault is at step 40)")
    parser.add_argument("--processes", type=int, default=2, help="processes on the one node (at least 2)")
    parser.add_argument("--slow-s", type=float, default=0.3, help="seconds the straggler adds to each step")
    parser.add_argument("--config", default="cpu_ddp.yaml", help="the accelerate config (accelerate_configs/)")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--json", type=Path, help="write the report here too")
    parser.add_argument("--local-cluster", action="store_true",
                        help="start the tests' private SLURM cluster on this machine for the run (a checkout, root)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problems = []
    if args.output.exists():
        problems.append(f"--output {args.output} exists: give a new directory (the harness starts a run)")
    if args.steps < CORRUPT_STEP + 4:
        problems.append(f"--steps {args.steps}: at least {CORRUPT_STEP + 4} (the last fault is at step {CORRUPT_STEP})")
    if args.processes < 2:
        problems.append("--processes must be at least 2 (a straggler and a killed rank need another rank)")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    with local_cluster() if args.local_cluster else contextlib.nullcontext():
        if args.faults != "both":
            reports = [run_one(args, args.output.resolve(), args.faults == "all")]
        else:
            reports = [run_one(args, args.output.resolve() / name, faults) for name, faults in
                       (("faults", True), ("clean", False))]
    if args.json:
        args.json.write_text(json.dumps(reports[0] if len(reports) == 1 else reports, indent=1) + "\n")
    if len(reports) == 2:
        print("\nharness: goodput side by side (the same run, the same machine, one invocation)")
        print(f"{'category':>12} | {'faults (s)':>10} | {'clean (s)':>10}")
        for name in reports[0]["seconds"]:
            print(f"{name:>12} | {reports[0]['seconds'][name]:10.2f} | {reports[1]['seconds'][name]:10.2f}")
        print(f"{'wall':>12} | {reports[0]['wall_s']:10.2f} | {reports[1]['wall_s']:10.2f}")
        print(f"{'goodput':>12} | {reports[0]['goodput']:10.1%} | {reports[1]['goodput']:10.1%}")
    return 0 if all(r["completed"] for r in reports) else 1


def run_one(args: argparse.Namespace, output: Path, faults: bool) -> dict:
    harness = Harness(output, args.steps, faults, args.processes, args.slow_s, args.timeout_s, args.config)
    harness.submit()
    report = harness.report(harness.drive())
    print(f"harness ({report['faults']}): {report['outcome']} at step {report['last_step']}/{args.steps} after "
          f"{len(report['jobs'])} job(s), {report['attempts']} attempt(s); excluded {report['excluded_hosts'] or 'none'}")
    print(f"harness ({report['faults']}): {report['summary']}")
    print(f"harness ({report['faults']}): categories sum to {report['category_sum_s']:.2f} s of "
          f"{report['wall_s']:.2f} s wall")
    return report


@contextlib.contextmanager
def local_cluster():
    """The tests' private SLURM cluster (two one-CPU nodes on 127.0.0.1), its SLURM_CONF in this environment."""
    import importlib.util
    import shutil
    import tempfile

    spec = importlib.util.spec_from_file_location("slurm_cluster", ROOT / "tests" / "slurm_cluster.py")
    slurm_cluster = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(slurm_cluster)
    SlurmCluster, ensure_installed = slurm_cluster.SlurmCluster, slurm_cluster.ensure_installed
    ensure_installed()
    root = Path(tempfile.mkdtemp(prefix="pretrain-slurm-"))  # short: the munge socket path must fit
    cluster = SlurmCluster(root)
    saved = dict(os.environ)
    try:
        cluster.start()
        os.environ.update(cluster.env())
        yield cluster
    finally:
        os.environ.clear()
        os.environ.update(saved)
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
