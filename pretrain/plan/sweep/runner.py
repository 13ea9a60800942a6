"""Running one micro batch size: a short real training run at GAS 1, its output and its metrics.

Each run is the real entry point (``pretrain/run.py``, under ``accelerate launch`` when an accelerate
config is given), started in its own process group so a timeout or Ctrl-C ends all of its processes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.checkpoint import rundir
from pretrain.distributed.layout import accelerate_command

OOM_PATTERN = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)
STDERR_TAIL_LINES = 25


@dataclass
class MBSResult:
    mbs: int
    status: str  # ok | over_memory_limit | oom | failed
    tokens_per_s: float | None = None  # all processes together
    tokens_per_s_per_device: float | None = None
    step_time_s: float | None = None
    peak_gib: float | None = None  # rank 0
    scaling: float | None = None  # tokens/s over the previous (half) MBS's
    num_measured_steps: int = 0  # per run
    output_dir: str = ""
    detail: str = ""
    runs: list[dict] = field(default_factory=list)  # one entry per run of this MBS (--repeats)

    @property
    def measured(self) -> bool:
        return self.tokens_per_s is not None



def sweep_overrides(mbs: int, world: int, steps: int, warmup_steps: int, run_dir: Path) -> list[str]:
    """Overrides that turn any recipe into a short throughput measurement at GAS 1."""
    return [
        f"batch.micro_batch_size={mbs}",
        f"batch.global_batch_size={mbs * world}",
        "batch.gradient_accumulation_steps=null",
        "batch.local_batch_size=null",
        f"train.max_steps={warmup_steps + steps}",
        "train.max_tokens=null",
        "logging.every_steps=1",
        "eval.at_start=false",
        "eval.every_steps=0",
        "eval.batches=1",
        f"logging.throughput_warmup_steps={warmup_steps}",
        "checkpoint.every_steps=0",
        "checkpoint.save_final_model=false",
        "checkpoint.save_last=false",
        "checkpoint.resume=none",
        "stability.rollback.enabled=false",  # no checkpoint to roll back to (and a measurement does not)
        "logging.backends=[jsonl]",
        "logging.progress=plain",
        "lr_schedule.warmup_steps=0",
        f"output_dir={run_dir}",
    ]


def accelerate_args(accelerate_config: str | None, num_processes: int | None) -> list[str]:
    if accelerate_config is None:
        return []
    args = ["--config_file", accelerate_config]
    if num_processes is not None:
        args += ["--num_processes", str(num_processes)]
    return args


def launch_command(accelerate_config: str | None, num_processes: int | None, recipe: str,
                   overrides: list[str]) -> list[str]:
    if accelerate_config is None:
        return accelerate_command(recipe, overrides, launcher=[sys.executable])  # one process, no accelerate
    return accelerate_command(recipe, overrides, accelerate_args=accelerate_args(accelerate_config, num_processes))


def run_process(command: list[str], log_prefix: Path, timeout_s: float | None,
                on_start: Callable[[int], None] | None = None) -> tuple[int, str, str]:
    """(return code, stdout, stderr). The output goes to <log_prefix>.log / .stderr.log as it is written (tail
    them during a long run); the whole process group is killed on a timeout or Ctrl-C. ``on_start(pgid)`` is
    called once the group exists (a caller that may itself be killed records it)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out_path, err_path = log_prefix.with_suffix(".log"), log_prefix.with_suffix(".stderr.log")
    with out_path.open("w") as out, err_path.open("w") as err:
        header = f"$ {shlex.join(command)}\n"
        out.write(header)
        out.flush()
        # A session of its own so that a timeout can stop accelerate launch's workers, not only the launcher.
        proc = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env, start_new_session=True)
        if on_start is not None:
            on_start(proc.pid)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            err.write(f"\nsweep: killed after the --timeout-s limit of {timeout_s:g} s\n")
            code = -1
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    stdout = out_path.read_text(errors="replace").removeprefix(header)  # the run's output, not our command line
    return code, stdout, err_path.read_text(errors="replace")


def read_run(run_dir: Path, mbs: int, world: int) -> dict[str, float | int]:
    """Medians of the measured steps and the peak memory of one finished run. Raises ValueError."""
    path = run_dir / rundir.METRICS_FILE
    if not path.is_file():
        raise ValueError(f"{path} was not written")
    records = rundir.read_metrics(run_dir)
    train = [r for r in records if "train/loss" in r]
    perf = [r for r in train if "perf/tokens_per_s" in r]
    if not perf:
        raise ValueError(f"{path} holds no perf/tokens_per_s (were all steps warm-up steps?)")
    logged = {(r.get("batch/mbs"), r.get("batch/gas"), r.get("batch/gbs")) for r in train}
    if logged != {(mbs, 1, mbs * world)}:
        raise ValueError(f"expected MBS {mbs}, GAS 1, GBS {mbs * world} but the run logged (MBS, GAS, GBS) {logged}")
    peaks = [r["memory/peak_gib"] for r in records if "memory/peak_gib" in r]
    return {
        "tokens_per_s": statistics.median(r["perf/tokens_per_s"] for r in perf),
        "tokens_per_s_per_device": statistics.median(r["perf/tokens_per_s_per_device"] for r in perf),
        "step_time_s": statistics.median(r["perf/step_time_s"] for r in perf),
        "peak_gib": max(peaks) if peaks else None,
        "num_measured_steps": len(perf),
    }


def stderr_tail(stderr: str, stdout: str) -> str:
    lines = (stderr.strip() or stdout.strip()).splitlines()
    return "\n".join(lines[-STDERR_TAIL_LINES:])


def measure(mbs: int, args: argparse.Namespace, world: int, out: Path, label: str = "") -> MBSResult:
    run_dir = out / f"mbs_{mbs}"
    if run_dir.exists():  # a previous sweep's run: resume=none would refuse to start there
        shutil.rmtree(run_dir)
    overrides = [*args.overrides, *sweep_overrides(mbs, world, args.steps, args.warmup_steps, run_dir)]
    command = launch_command(args.accelerate_config, args.num_processes, args.recipe, overrides)
    print(f"sweep{label}: MBS {mbs} (GBS {mbs * world}, GAS 1): {args.warmup_steps} warm-up + {args.steps} "
          f"measured steps, output in {out / f'mbs_{mbs}.log'} and .stderr.log", flush=True)
    code, stdout, stderr = run_process(command, out / f"mbs_{mbs}", args.timeout_s)
    result = MBSResult(mbs, "failed", output_dir=str(run_dir))
    if code != 0:
        oom_lines = [line.strip() for line in (stdout + "\n" + stderr).splitlines() if OOM_PATTERN.search(line)]
        if oom_lines:
            result.status, result.detail = "oom", f"out of memory ({oom_lines[-1][:300]})"
        elif code in (-signal.SIGKILL, 128 + signal.SIGKILL):
            result.status = "oom"
            result.detail = "killed by SIGKILL, most likely the kernel's out-of-memory killer (host memory)"
        else:
            result.detail = f"exit code {code}:\n{stderr_tail(stderr, stdout)}"
        return result
    try:
        result.__dict__.update(read_run(run_dir, mbs, world))
        result.runs = [{k: getattr(result, k) for k in RUN_KEYS}]
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        result.detail = f"the run finished but its metrics cannot be used: {exc}"
        return result
    result.status = "ok"
    if args.max_memory_gib is not None and result.peak_gib is not None and result.peak_gib > args.max_memory_gib:
        result.status = "over_memory_limit"
        result.detail = f"peak {result.peak_gib:.2f} GiB > --max-memory-gib {args.max_memory_gib:g}"
    return result


RUN_KEYS = ("tokens_per_s", "tokens_per_s_per_device", "step_time_s", "peak_gib")


def add_run(result: MBSResult, again: MBSResult) -> None:
    """Fold a repeated run of the same MBS into result, which then reports its fastest run (other jobs on
    the machine only ever slow a run down, so the fastest is the least disturbed) and the largest peak."""
    if not again.measured:
        result.detail = (result.detail + "; " if result.detail else "") + f"a repeat run {again.status}: {again.detail}"
        return
    result.runs += again.runs
    fastest = max(result.runs, key=lambda run: run["tokens_per_s"])
    for key in RUN_KEYS[:3]:
        setattr(result, key, fastest[key])
    peaks = [run["peak_gib"] for run in result.runs if run["peak_gib"] is not None]
    result.peak_gib = max(peaks) if peaks else None


def repeat_rounds(results: list[MBSResult], args: argparse.Namespace, world: int, out: Path) -> None:
    """Rounds 2..R over the MBS that ran within the limits, in alternating order, so that a burst of
    load from other jobs spoils one run of an MBS instead of its whole measurement."""
    ok = [r for r in results if r.status == "ok"]
    for round_index in range(1, args.repeats):
        for r in ok if round_index % 2 == 0 else ok[::-1]:
            again = measure(r.mbs, args, world, out, label=f" (round {round_index + 1}/{args.repeats})")
            add_run(r, again)
            if args.max_memory_gib is not None and r.peak_gib is not None and r.peak_gib > args.max_memory_gib:
                r.status = "over_memory_limit"
                r.detail = f"peak {r.peak_gib:.2f} GiB > --max-memory-gib {args.max_memory_gib:g} in a repeat run"
            if again.measured:
                print(f"sweep: MBS {r.mbs}: {again.tokens_per_s:,.0f} tokens/s this run, {r.tokens_per_s:,.0f} "
                      f"the fastest of {len(r.runs)} runs", flush=True)
