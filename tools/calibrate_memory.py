"""Fit the memory estimate's activation factors on the peaks measured on a GPU, and report every row's error.

    python tools/calibrate_memory.py            # refit pretrain/plan/memory/calibration.json's factors from its rows
    python tools/calibrate_memory.py --check    # exit 1 when the file's factors are not what its rows give today
    python tools/calibrate_memory.py --add runs/gpu_visit/bench/bench_gpu.json   # a visit's rows, then refit

Each row is a benchmark row (tools/bench_gpu.py: a recipe, its overrides, the micro-batch, the resolved loss and
compile) with the ``torch.cuda.max_memory_allocated`` it measured. The row's estimate is rebuilt on this machine
with the current estimator, uncalibrated (the formula), on the row's launch (one process on one GPU); its phases
give the activations term and everything else, and pretrain.plan.memory.calibration.fit fits one factor per
group (eager or compiled, recompute policy, 16-bit or float8, engine) on the rows whose peak is the backward phase. The
table printed gives every row's error with the fitted factors: the figures for docs/performance.md.

``--add`` appends a GPU visit's finished rows (status ok, with a peak) to the file, with the GPU and versions
bench_gpu.json records, and refits: rows of the same model, setting and micro-batch from the same GPU and versions
replace the earlier ones. Run the visit's rows through ``--check`` first to see the error they had before the refit
(the out-of-sample test of the last calibration). Exit codes: 0, 1 (--check: stale), 2 (bad input).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.plan import memory
from pretrain.plan.memory import calibration
from pretrain.plan.sweep.runner import sweep_overrides
from pretrain.recipe.batching import plan_batches
from pretrain.recipe.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]

LAUNCH = "accelerate_configs/single_gpu.yaml"
"""The launch every benchmark row ran on (one process, one GPU)."""


def observe(row: dict[str, Any]) -> calibration.Observation:
    """The row against the current estimator's uncalibrated phases."""
    from bench_gpu import STDLIB_DATA  # tools/, this script's directory, is where Python looks first

    overrides = [*STDLIB_DATA, *row["overrides"], f"model.compile={row['compile']}",
                 *sweep_overrides(row["micro_batch_size"], 1, 1, 0, ROOT / "runs" / "calibrate_memory")]
    recipe = load_recipe(ROOT / row["recipe"], overrides)
    plan = plan_batches(recipe.batch, 1, recipe.data.seq_len)
    launch = Launch.from_accelerate_config(ROOT / LAUNCH)
    est = memory.estimate(recipe, plan, launch, device="cuda", loss=row["loss"], calibrated=False)
    acts = est.terms["activations"].bytes
    group = calibration.group(row["compile"], recipe.model.activation_checkpointing, recipe.precision.dtype,
                              recipe.precision.float8, launch.engine)
    return calibration.Observation(
        name=f"{row['model']} / {row['setting']} / MBS {row['micro_batch_size']}", group=group,
        measured=int(row["peak_gib"] * memory.GIB), activations=acts, backward_rest=est.phases["backward"] - acts,
        other_phases=max(v for k, v in est.phases.items() if k != "backward"))


def report(observations: list[calibration.Observation], factors: dict[str, dict]) -> str:
    lines = ["| row | group | peak GiB | estimated GiB (formula) | error % (formula) | estimated GiB | error % | fit |",
             "|---|---|---|---|---|---|---|---|"]
    for o in observations:
        value = factors.get(o.group, {}).get("factor", 1.0)
        phase = "yes" if o.informative else "no: its peak is a phase without activations"
        lines.append(f"| {o.name} | {o.group} | {o.measured / memory.GIB:.2f} | {o.estimate(1.0) / memory.GIB:.2f} | "
                     f"{100 * o.error(1.0):+.1f} | {o.estimate(value) / memory.GIB:.2f} | {100 * o.error(value):+.1f} | "
                     f"{phase} |")
    lines.append("")
    lines += [f"{k}: x {v['factor']:.2f} ({v['rows']} row(s))" for k, v in factors.items()]
    return "\n".join(lines)


def added_rows(bench_json: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the visit's GPU and versions, its rows in the file's form) from a bench_gpu.json."""
    from bench_gpu import MODELS

    try:
        data = json.loads(bench_json.read_text())
        versions = data["versions"]
        measured_on = {"gpu": data["device"], "torch": versions["torch"], "transformers": versions["transformers"]}
        rows = []
        for r in data["rows"]:
            if r.get("status") != "ok" or r.get("peak_gib") is None:
                continue
            if r["model"] not in MODELS:
                raise ConfigError(f"--add {bench_json}: row {r['model']} / {r['setting']} is not a GPU model of "
                                  "tools/bench_gpu.py (a --reduced CPU row?): only rows measured on a GPU calibrate "
                                  "the estimate")
            model = MODELS[r["model"]]
            rows.append({"visit": data.get("date", ""), **measured_on, "model": r["model"], "setting": r["setting"],
                         "recipe": model.recipe, "overrides": [*model.overrides, *r["overrides"]],
                         "micro_batch_size": r["micro_batch_size"], "loss": r["loss"], "compile": r["compile"],
                         "peak_gib": round(r["peak_gib"], 2)})
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--add {bench_json}: not a bench_gpu.json with versions and rows ({exc!r}); use the "
                          "bench_gpu.json a GPU visit wrote (tools/bench_gpu.py records the versions since 2026-11-29)") from None
    return measured_on, rows


def merge(data: dict[str, Any], measured_on: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    def key(r):
        return (r["model"], r["setting"], r["micro_batch_size"], r["gpu"], r["torch"], r["transformers"])

    new = {key(r) for r in rows}
    kept = [r for r in data["rows"] if key(r) not in new]
    seen = data["measured_on"] if measured_on in data["measured_on"] else [*data["measured_on"], measured_on]
    return {**data, "measured_on": seen, "rows": kept + rows}


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare the file's factors with a refit; write nothing")
    parser.add_argument("--add", type=Path, metavar="BENCH_GPU_JSON", help="a GPU visit's rows to add before the fit")
    parser.add_argument("--file", type=Path, default=calibration.FILE, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        try:
            data = json.loads(args.file.read_text())
            data["rows"], data["factors"], data["measured_on"]  # noqa: B018 - the keys this tool reads
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{args.file}: not a calibration file ({exc!r}); the shipped one is "
                              f"{calibration.FILE}") from None
        if args.add:
            data = merge(data, *added_rows(args.add))
        rows = [r for r in data["rows"] if not r.get("excluded")]
        observations = [observe(r) for r in rows]
    except ConfigError as exc:
        print(f"calibrate_memory: {exc}", file=sys.stderr)
        return 2
    factors = calibration.fit(observations)
    print(report(observations, factors))
    if args.check:
        if factors != data["factors"]:
            print(f"calibrate_memory: {args.file} is stale: its factors {data['factors']} are not what its rows give "
                  f"today {factors}; run python tools/calibrate_memory.py", file=sys.stderr)
            return 1
        return 0
    write_atomic(args.file, json.dumps({**data, "factors": factors}, indent=2) + "\n")
    print(f"calibrate_memory: wrote {args.file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
