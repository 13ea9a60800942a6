"""The run directory's logs at scale (issue 50): a resume's rewind of metrics.jsonl and pretrain-slurm status's reading
of a run directory, on synthetic logs of a 1e4- to 1e6-step run. tools/scale_bench.py runs each function in a
subprocess at three sizes and records its time and peak RSS; by hand:

    python tools/scale_logs.py rewind 1000000 --workdir /tmp/scale-logs
    python tools/scale_logs.py status 1000000 --workdir /tmp/scale-logs

A line is what a logged optimizer step writes (``JSONLTracker.log`` of ``train_metrics``: a 6-source mixture's keys,
the goodput keys and the tracker's ``time``: 1.8 KB), one a step. The files are written once per size and directory
(``<workdir>/<kind>-<num_lines>/``, by ``prepare_<measure>`` unmeasured, else by the measure itself) and kept:
``measure_rewind`` appends back the 100 lines it drops, so the next call rewinds the same file, and its time is the
rewind's alone. Each measure returns the bytes the process read (``/proc/self/io``'s rchar: every read(2), whoever
makes it) beside the size of the file.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

from pretrain.checkpoint.rundir import METRICS_FILE
from pretrain.cli.slurm import run_status
from pretrain.train.tracking import JSONLTracker

DROPPED = 100  # the lines a resume drops: the steps logged after its checkpoint
JOB_ID = "4242"

SOURCES = {"web": 2_516_582, "code": 838_861, "books": 419_430, "math": 209_715, "wiki": 125_829, "arxiv": 83_887}
GOODPUT = ("startup", "data_build", "first_step", "productive", "lost", "skipped", "evaluation", "checkpoint",
           "rollback", "final_model", "shutdown", "restart", "queue")


def step_record(step: int) -> dict:
    """What a logged step of a 7B run on 64 GPUs writes to metrics.jsonl (the keys of docs/architecture.md)."""
    loss = 2.0 + 8.0 / (1.0 + step / 1000.0)
    return {
        "step": step, "train/loss": loss, "train/z_loss": 1.234e-4, "train/ppl": 2.718281828 ** loss, "train/lr": 3e-4 * (1 - step / 4e6),
        "train/grad_norm": 0.25 + (step % 97) / 1000.0, "train/tokens_seen": step * 4_194_304,
        "stability/skipped_steps": 0, "stability/consecutive_skips": 0, "stability/rollbacks": 0,
        "perf/tokens_per_s": 1_234_567.891, "perf/step_time_max_s": 3.412345, "perf/step_time_min_s": 3.301234,
        "perf/step_time_slowest_rank": step % 64, "perf/tokens_per_s_per_device": 19_290.123,
        "perf/samples_per_s": 301.4, "perf/step_time_s": 3.398765, "perf/data_wait_frac": 0.0012345,
        "perf/flops_per_token": 45_678_901_234, "perf/tflops_per_device": 412.345678, "perf/peak_tflops": 989.5,
        "perf/mfu": 0.41672311, "perf/hfu": 0.5556308, "memory/peak_gib": 61.234567, "memory/reserved_gib": 70.5,
        "memory/rss_gib": 31.456789, "memory/estimated_gib": 63.1, "memory/estimated_tensors_gib": 58.9,
        "batch/mbs": 2, "batch/gbs": 1024, "batch/gas": 8, "batch/tokens_per_step": 4_194_304,
        **{f"data/tokens/{name}": step * share for name, share in SOURCES.items()},
        **{f"data/epochs/{name}": step * share / 3e12 for name, share in SOURCES.items()},
        **{f"goodput/{name}_s": round(step * 3.4 * share, 3)
           for name, share in zip(GOODPUT, (0.001, 0.0005, 0.0001, 0.93, 0.01, 0.0, 0.02, 0.015, 0.0, 0.0, 0.0,
                                            0.008, 0.01), strict=True)},
        "goodput/fraction": 0.93,
        "time": round(1.7e9 + step * 3.4, 3),
    }


def lines(first: int, last: int):
    """metrics.jsonl's lines for steps first..last, as JSONLTracker.log writes them."""
    for step in range(first, last + 1):
        yield json.dumps(step_record(step), allow_nan=False) + "\n"


def bytes_read() -> int:
    """What this process has read so far (read(2) and friends), or -1 where /proc does not say."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration):
        return -1


def _write(path: Path, chunks) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        buffer = []
        for chunk in chunks:
            buffer.append(chunk)
            if len(buffer) >= 4096:
                f.write("".join(buffer))
                buffer.clear()
        f.write("".join(buffer))
    os.replace(tmp, path)


def metrics_file(directory: Path, num_lines: int) -> Path:
    """``directory/metrics.jsonl`` of ``num_lines`` logged steps, written when missing (or of another size)."""
    directory.mkdir(parents=True, exist_ok=True)
    path, sized = directory / METRICS_FILE, directory / "metrics.size"
    if not (path.is_file() and sized.is_file() and sized.read_text() == str(path.stat().st_size)):
        _write(path, lines(1, num_lines))
        sized.write_text(str(path.stat().st_size))
    return path


def prepare_measure_rewind(num_lines: int, workdir: Path) -> None:
    metrics_file(Path(workdir) / f"rewind-{num_lines}", num_lines)


def measure_rewind(num_lines: int, workdir: Path) -> dict:
    """A resume from step num_lines - 100 of a run that logged num_lines steps: JSONLTracker's start, the real rewind
    (rank 0's, while the other ranks wait). The dropped lines are appended back afterwards."""
    directory = Path(workdir) / f"rewind-{num_lines}"
    path = metrics_file(directory, num_lines)
    size = path.stat().st_size
    before = bytes_read()
    tracker = JSONLTracker(directory, resume_step=max(num_lines - DROPPED, 0))
    tracker.start()
    tracker.finish()
    read = bytes_read() - before
    kept = path.stat().st_size
    with open(path, "a") as f:  # the file as it was, for the next call
        f.write("".join(lines(max(num_lines - DROPPED, 0) + 1, num_lines)))
    assert path.stat().st_size == size, (size, kept, path.stat().st_size)
    return {"file_bytes": size, "bytes_read": read, "bytes_dropped": size - kept}


def status_run_dir(directory: Path, num_lines: int) -> Path:
    """A run directory as pretrain-slurm status finds it after num_lines logged steps: metrics.jsonl, the job's log
    (a console line a logged step, a start and a preemption every 100,000 steps), run_config.json, a checkpoint,
    goodput.json and the SLURM records."""
    directory.mkdir(parents=True, exist_ok=True)
    metrics_file(directory, num_lines)
    slurm = directory / "slurm"
    slurm.mkdir(exist_ok=True)
    (slurm / "jobs.jsonl").write_text(json.dumps({"job_id": JOB_ID, "submitted": "2025-01-01T00:00:00", "nodes": 8,
                                                  "processes_per_node": 8, "world_size": 64}) + "\n")
    log = slurm / f"slurm-{JOB_ID}.out"
    if not log.is_file():
        def console():
            for step in range(1, num_lines + 1):
                if step % 100_000 == 1:
                    yield f"pretrain-slurm: job {JOB_ID} start {step // 100_000 + 1} at 2025-01-01T00:00:00\n"
                yield (f"step {step}/{num_lines + 1000} loss 2.3456 lr 2.99e-04 gnorm 0.251 tok/s 1,234,567 "
                       f"mfu 41.7% mem 61.2 GiB elapsed 1:23:45 eta 12:34:56\n")
                if step % 100_000 == 0:
                    yield f"preempted: stopped after step {step}/{num_lines + 1000}\n"
        _write(log, console())
    (directory / "run_config.json").write_text(json.dumps({"train/num_steps": num_lines + 1000}))
    checkpoint = directory / "checkpoints" / f"step_{num_lines:08d}"
    checkpoint.mkdir(parents=True, exist_ok=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": num_lines, "num_steps": num_lines + 1000,
                                                               "tokens_seen": num_lines * 4_194_304}))
    (directory / "checkpoints" / "latest").write_text(checkpoint.name)
    attempts = [{"id": f"a{i}", "started": 1.7e9 + i * 340_000.0, "updated": 1.7e9 + i * 340_000.0 + 339_000.0,
                 "step": (i + 1) * 100_000, "wall_s": 339_000.0,
                 "seconds": {"startup": 300.0, "productive": 330_000.0, "checkpoint": 8_700.0}}
                for i in range(max(num_lines // 100_000, 1))]
    (directory / "goodput.json").write_text(json.dumps({"attempts": attempts}))
    (slurm / "allocations.jsonl").write_text("".join(
        json.dumps({"job_id": JOB_ID, "event": event, "time": a["started"] + offset}) + "\n"
        for a in attempts for event, offset in (("start", 0.0), ("requeue", 339_100.0))))
    return directory


def prepare_measure_status(num_lines: int, workdir: Path) -> None:
    status_run_dir(Path(workdir) / f"status-{num_lines}", num_lines)


def measure_status(num_lines: int, workdir: Path) -> dict:
    """``pretrain-slurm status``'s reading of a run directory after num_lines logged steps (scontrol absent)."""
    directory = Path(workdir) / f"status-{num_lines}"
    if not (directory / "goodput.json").is_file():
        status_run_dir(directory, num_lines)
    before = bytes_read()
    text = run_status(directory)
    read = bytes_read() - before
    assert f"last step      {num_lines} " in text, text
    return {"metrics_bytes": (directory / METRICS_FILE).stat().st_size,
            "log_bytes": (directory / "slurm" / f"slurm-{JOB_ID}.out").stat().st_size, "bytes_read": read}


MEASURES = {"rewind": measure_rewind, "status": measure_status}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("measure", choices=sorted(MEASURES))
    parser.add_argument("num_lines", type=int)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/scale-logs"))
    parser.add_argument("--prepare", action="store_true", help="write the files only, measure nothing")
    args = parser.parse_args(argv)
    if args.prepare:
        (prepare_measure_rewind if args.measure == "rewind" else prepare_measure_status)(args.num_lines, args.workdir)
        return 0
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    counters = MEASURES[args.measure](args.num_lines, args.workdir)
    seconds = time.perf_counter() - started
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"measure": args.measure, "num_lines": args.num_lines, "seconds": round(seconds, 3),
                      "peak_rss_mib": round(peak_mib, 1), "peak_rss_before_mib": round(rss_before, 1), **counters}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
