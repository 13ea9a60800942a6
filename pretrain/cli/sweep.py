"""Find the micro batch size that saturates the device: the tuning playbook's batch-size sweep.

    python tools/sweep_batch_size.py --recipe recipes/tiny.yaml [--accelerate-config accelerate_configs/cpu.yaml]
        [--num-processes N] [--max-memory-gib G] [--steps 5] [--warmup-steps 2] [--max-mbs 256] [--repeats 1]
        [--timeout-s S] [--out DIR] [key.path=value ...]

For MBS = 1, 2, 4, ... it launches the real entry point (``pretrain/run.py``, under ``accelerate launch``
when an accelerate config is given) for W + N optimizer steps at GAS 1 (GBS = MBS x world) and reads that
run's metrics.jsonl: tokens/s and time per step are medians over the N measured steps (the first W are
left out), peak memory is the largest logged ``memory/peak_gib`` (rank 0). The sweep stops at the first
out-of-memory error, the first peak above --max-memory-gib, any other failure, or --max-mbs; it prints a
table, writes ``<out>/sweep.json`` and ``<out>/sweep.png``, says where throughput stops scaling, and
recommends an MBS with the GAS that reaches the recipe's GBS. On a machine shared with other jobs,
``--repeats R`` re-runs every MBS that fit R - 1 more times, in interleaved rounds, and reports each
MBS's fastest run (other jobs only ever slow a run down).

Each run writes to ``<out>/mbs_<MBS>/`` and its console output to ``<out>/mbs_<MBS>.log`` and
``.stderr.log``; the checkpoint a run always saves at its last step is deleted once its metrics are read,
so a sweep of a large model does not fill the disk.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pretrain import rundir
from pretrain.batching import neighbouring_multiples
from pretrain.errors import EXIT_USAGE, ConfigError
from pretrain.launch import accelerate_command

SCALING_THRESHOLD = 1.2  # tokens/s gain from doubling MBS below which throughput has stopped scaling
NEAR_BEST = 0.95  # an MBS within this fraction of the best tokens/s is as good as the best
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


# --------------------------------------------------------------------------------------------------
# Launching one MBS


def sweep_overrides(mbs: int, world: int, steps: int, warmup_steps: int, run_dir: Path) -> list[str]:
    """Overrides that turn any recipe into a short throughput measurement at GAS 1."""
    return [
        f"batch.micro_batch_size={mbs}",
        f"batch.global_batch_size={mbs * world}",
        "batch.gradient_accumulation_steps=null",
        "batch.local_batch_size=null",
        f"train.max_steps={warmup_steps + steps}",
        "train.max_tokens=null",
        "train.log_every_steps=1",
        "train.eval_at_start=false",
        "train.eval_every_steps=0",
        "train.eval_batches=1",
        f"runtime.throughput_warmup_steps={warmup_steps}",
        "checkpoint.every_steps=0",
        "checkpoint.save_final_model=false",
        "checkpoint.save_last=false",
        "checkpoint.resume=none",
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


def run_process(command: list[str], log_prefix: Path, timeout_s: float | None) -> tuple[int, str, str]:
    """(return code, stdout, stderr). The output goes to <log_prefix>.log / .stderr.log as it is written (tail
    them during a long run); the whole process group is killed on a timeout or Ctrl-C."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out_path, err_path = log_prefix.with_suffix(".log"), log_prefix.with_suffix(".stderr.log")
    with out_path.open("w") as out, err_path.open("w") as err:
        header = f"$ {shlex.join(command)}\n"
        out.write(header)
        out.flush()
        # A session of its own so that a timeout can stop accelerate launch's workers, not only the launcher.
        proc = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env, start_new_session=True)
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


# --------------------------------------------------------------------------------------------------
# Analysis


def nearest_multiples(value: int, unit: int) -> list[int]:
    """The multiples of unit closest to value (one, or two when value lies exactly between them)."""
    options = neighbouring_multiples(value, unit)
    closest = min(abs(value - v) for v in options)
    return [v for v in options if abs(value - v) == closest]


def analyse(results: list[MBSResult], global_batch_size: int, world: int) -> dict:
    """Scaling factors (set on the results), where scaling stops, and the recommended MBS / GAS."""
    measured = [r for r in results if r.measured]
    previous = None
    for r in measured:
        if previous is not None and previous.mbs * 2 == r.mbs:
            r.scaling = r.tokens_per_s / previous.tokens_per_s
        previous = r
    stops = next((r for r in measured if r.scaling is not None and r.scaling < SCALING_THRESHOLD), None)
    analysis: dict = {
        "scaling_threshold": SCALING_THRESHOLD,
        "scaling_stops_at_mbs": stops.mbs // 2 if stops else None,
        "near_best_fraction": NEAR_BEST,
        "global_batch_size": global_batch_size,
        "world_size": world,
        "recommendation": None,
    }
    usable = [r for r in measured if r.status == "ok"]
    if not usable:
        analysis["message"] = "no MBS ran within the limits, so there is nothing to recommend"
        return analysis
    best = max(r.tokens_per_s for r in usable)
    near_best = [r for r in usable if r.tokens_per_s >= NEAR_BEST * best]
    per_rank = global_batch_size // world if global_batch_size % world == 0 else None
    dividing = [r for r in near_best if per_rank is not None and per_rank % r.mbs == 0]
    if dividing:
        pick = dividing[0]
        gas = per_rank // pick.mbs
        analysis["recommendation"] = {
            "micro_batch_size": pick.mbs,
            "gradient_accumulation_steps": gas,
            "global_batch_size": global_batch_size,
            "tokens_per_s": pick.tokens_per_s,
            "fraction_of_best": pick.tokens_per_s / best,
            "divides_global_batch_size": True,
        }
        analysis["message"] = (
            f"recommended: MBS {pick.mbs} ({pick.tokens_per_s:,.0f} tokens/s, {pick.tokens_per_s / best:.0%} of the "
            f"best) with GAS {gas} for the recipe's GBS {global_batch_size} = {pick.mbs} x {gas} x world {world}: "
            f"batch.global_batch_size={global_batch_size} batch.micro_batch_size={pick.mbs}"
        )
        return analysis
    pick = near_best[0]
    suggested = nearest_multiples(global_batch_size, pick.mbs * world)
    fallback = [r for r in usable if per_rank is not None and per_rank % r.mbs == 0]
    analysis["recommendation"] = {
        "micro_batch_size": pick.mbs,
        "gradient_accumulation_steps": None,
        "global_batch_size": global_batch_size,
        "tokens_per_s": pick.tokens_per_s,
        "fraction_of_best": pick.tokens_per_s / best,
        "divides_global_batch_size": False,
        "suggested_global_batch_sizes": suggested,
    }
    gbs_options = " or ".join(f"{g} (GAS {g // (pick.mbs * world)})" for g in suggested)
    message = (
        f"no MBS reaching {NEAR_BEST:.0%} of the best tokens/s divides the recipe's GBS {global_batch_size} / world "
        f"{world}; MBS {pick.mbs} ({pick.tokens_per_s:,.0f} tokens/s) needs a GBS that is a multiple of "
        f"{pick.mbs * world}: the nearest is {gbs_options}"
    )
    if fallback:
        alt = max(fallback, key=lambda r: r.tokens_per_s)
        message += (f"; or keep GBS {global_batch_size} with MBS {alt.mbs} (GAS {per_rank // alt.mbs}, "
                    f"{alt.tokens_per_s / best:.0%} of the best)")
    analysis["message"] = message
    return analysis


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: list[MBSResult]) -> str:
    header = ("MBS", "tokens/s", "step time (s)", "peak GiB", "scaling", "status")
    rows = [header]
    for r in results:
        rows.append((str(r.mbs), _fmt(r.tokens_per_s, ",.0f"), _fmt(r.step_time_s, ".4f"), _fmt(r.peak_gib, ".2f"),
                     "-" if r.scaling is None else f"{r.scaling:.2f}x", r.status))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i < 5 else cell for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(results: list[MBSResult], analysis: dict, path: Path, title: str, max_memory_gib: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    measured = [r for r in results if r.measured]
    failed = [r for r in results if not r.measured]
    fig, (ax_tps, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax in (ax_tps, ax_mem):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro batch size (sequences per process)")
        ax.grid(True, which="both", alpha=0.3)
        ticks = [r.mbs for r in results]
        ax.set_xticks(ticks, [str(t) for t in ticks])
    xs = [r.mbs for r in measured]
    num_runs = max((len(r.runs) for r in measured), default=1)
    label = "median step" + (f", fastest of {num_runs} runs" if num_runs > 1 else "")
    ax_tps.plot(xs, [r.tokens_per_s for r in measured], "o-", label=f"tokens/s ({label})")
    ax_tps.set_ylabel("tokens/s (all processes)")
    ax_tps.set_title("Throughput")
    ax_mem.plot(xs, [r.peak_gib for r in measured], "s-", color="tab:orange", label="peak memory (rank 0)")
    ax_mem.set_ylabel("GiB")
    ax_mem.set_title("Peak memory")
    over = [r for r in measured if r.status == "over_memory_limit"]
    if over:
        ax_mem.plot([r.mbs for r in over], [r.peak_gib for r in over], "x", color="tab:red", markersize=10,
                    label="over the memory limit")
    if max_memory_gib is not None:
        ax_mem.axhline(max_memory_gib, color="tab:red", linestyle="--", label=f"--max-memory-gib {max_memory_gib:g}")
    for r in failed:
        for ax in (ax_tps, ax_mem):
            ax.axvline(r.mbs, color="tab:red", alpha=0.6, linestyle=":", label=f"MBS {r.mbs}: {r.status}")
    rec = analysis.get("recommendation")
    if rec is not None:
        ax_tps.axvline(rec["micro_batch_size"], color="tab:green", alpha=0.6,
                       label=f"recommended MBS {rec['micro_batch_size']}")
    for ax in (ax_tps, ax_mem):
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# The command


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="sweep_batch_size",
        description="Measure tokens/s, time per step and peak memory for MBS = 1, 2, 4, ... at GAS 1, "
        "and recommend an MBS (the tuning playbook's batch-size sweep).",
        epilog="Overrides: trailing key.path=value pairs applied to the recipe, e.g. model.num_layers=2",
    )
    parser.add_argument("--recipe", required=True, help="recipe YAML, e.g. recipes/tiny.yaml")
    parser.add_argument("--accelerate-config",
                        help="accelerate config YAML; none = one process (python pretrain/run.py)")
    parser.add_argument("--num-processes", type=int, help="override the accelerate config's num_processes")
    parser.add_argument("--max-memory-gib", type=float, help="stop at the first MBS whose peak memory exceeds this")
    parser.add_argument("--steps", type=int, default=5, help="measured optimizer steps per MBS (default 5)")
    parser.add_argument("--warmup-steps", type=int, default=2,
                        help="optimizer steps per MBS left out of the measurement (default 2)")
    parser.add_argument("--max-mbs", type=int, default=256, help="largest MBS to try (default 256)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per MBS on a shared machine: rounds after the first re-run the MBS that "
                        "fit, interleaved, and each MBS reports its fastest run (default 1)")
    parser.add_argument("--timeout-s", type=float, help="kill a run that takes longer than this (default: no limit)")
    parser.add_argument("--out", help="output directory (default <recipe output_dir>/sweep)")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="recipe overrides")
    return parser.parse_intermixed_args(argv)


def check_inputs(args: argparse.Namespace) -> tuple[object, int, int, Path]:
    """Validate everything before the first launch: (recipe, world size, the recipe's GBS, output dir)."""
    from pretrain.config import load_recipe
    from pretrain.launch import Launch
    from pretrain.preflight import check_run

    problems = [f"--{name.replace('_', '-')} must be >= {low}, got {value}"
                for name, value, low in (("steps", args.steps, 1), ("warmup_steps", args.warmup_steps, 0),
                                         ("max_mbs", args.max_mbs, 1), ("repeats", args.repeats, 1),
                                         ("num_processes", args.num_processes, 1))
                if value is not None and value < low]
    if args.max_memory_gib is not None and args.max_memory_gib <= 0:
        problems.append(f"--max-memory-gib must be > 0, got {args.max_memory_gib:g}")
    if args.num_processes is not None and args.accelerate_config is None:
        problems.append("--num-processes needs --accelerate-config (without one the sweep runs one process)")
    if problems:
        raise ConfigError(problems)
    recipe = load_recipe(args.recipe, args.overrides)
    launch = (Launch.from_accelerate_config(args.accelerate_config,
                                            accelerate_args(args.accelerate_config, args.num_processes))
              if args.accelerate_config is not None else Launch())
    world = launch.world_size
    # The recipe's own GBS on this world size is the target the recommendation must reach.
    batch = recipe.batch
    gbs = batch.local_batch_size * world if batch.local_batch_size is not None else batch.global_batch_size
    out = Path(args.out or Path(recipe.output_dir) / "sweep").resolve()
    # The first launch, checked as pretrain-launch checks it: batch math, schedule, precision, DeepSpeed JSON.
    first = [*args.overrides, *sweep_overrides(1, world, args.steps, args.warmup_steps, out / "mbs_1")]
    check_run(load_recipe(args.recipe, first), launch)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out} cannot be created ({exc.strerror or exc}); choose another directory") from None
    return recipe, world, gbs, out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        recipe, world, gbs, out = check_inputs(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    results: list[MBSResult] = []
    stop = {"mbs": None, "reason": "max_mbs", "detail": f"reached --max-mbs {args.max_mbs}"}
    mbs = 1
    try:
        while mbs <= args.max_mbs:
            result = measure(mbs, args, world, out)
            results.append(result)
            if result.measured:
                print(f"sweep: MBS {mbs}: {result.tokens_per_s:,.0f} tokens/s, {result.step_time_s:.4f} s/step, "
                      f"peak {_fmt(result.peak_gib, '.2f')} GiB", flush=True)
            if result.status != "ok":
                stop = {"mbs": mbs, "reason": result.status, "detail": result.detail}
                break
            mbs *= 2
        if stop["reason"] != "failed":
            repeat_rounds(results, args, world, out)
    except KeyboardInterrupt:
        stop = {"mbs": mbs, "reason": "interrupted", "detail": "interrupted by the user"}

    analysis = analyse(results, gbs, world)
    print()
    print(format_table(results))
    print()
    if stop["reason"] in ("oom", "over_memory_limit"):
        print(f"stopped at MBS {stop['mbs']}: {stop['detail']}")
    elif stop["reason"] == "failed":
        log = out / f"mbs_{stop['mbs']}.stderr.log"
        print(f"stopped at MBS {stop['mbs']}: the run failed (full output in {log}): {stop['detail']}", file=sys.stderr)
    elif stop["reason"] == "interrupted":
        print(f"stopped at MBS {stop['mbs']}: interrupted")
    else:
        print(f"stopped: {stop['detail']}")
    if analysis["scaling_stops_at_mbs"] is not None:
        m = analysis["scaling_stops_at_mbs"]
        factor = next(r.scaling for r in results if r.mbs == 2 * m)
        print(f"throughput stops scaling at MBS {m}: doubling to MBS {2 * m} gives {factor:.2f}x tokens/s "
              f"(< {SCALING_THRESHOLD}x)")
    elif sum(r.measured for r in results) > 1:
        print(f"throughput still scales (>= {SCALING_THRESHOLD}x per doubling) up to the largest measured MBS")
    print(analysis["message"])
    print("note: gradient accumulation adds no throughput; it only reaches a large GBS with a micro batch that "
          "fits in memory")

    report = {
        "recipe": args.recipe,
        "recipe_name": recipe.name,
        "accelerate_config": args.accelerate_config,
        "world_size": world,
        "seq_len": recipe.data.seq_len,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "max_mbs": args.max_mbs,
        "repeats": args.repeats,
        "max_memory_gib": args.max_memory_gib,
        "overrides": args.overrides,
        "results": [asdict(r) for r in results],
        "stopped": stop,
        **analysis,
    }
    json_path, png_path = out / "sweep.json", out / "sweep.png"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    title = f"{recipe.name}: batch-size sweep, world {world}, seq_len {recipe.data.seq_len}"
    plot(results, analysis, png_path, title, args.max_memory_gib)
    print(f"wrote {json_path} and {png_path}")
    if stop["reason"] == "interrupted":
        return 130
    return 1 if stop["reason"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
