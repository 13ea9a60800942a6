"""pretrain-sweep, pretrain-bench and tools/bench_gpu.py: real launches on tiny settings, the sweep's stops and
its analysis on made-up numbers, and bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import matplotlib.image
import pytest

from pretrain.cli import sweep as sweep_batch_size
from pretrain.plan.sweep import MBSResult, analyse, nearest_multiples
from pretrain.plan.sweep import runner as sweep_runner
from tests.helpers import FAST_MODEL, ROOT, TINY, check_ok, env, run_cmd

SWEEP = ["-m", "pretrain.cli.sweep"]
BENCH = ["-m", "pretrain.cli.bench"]
# The tests' small model; a given peak skips the CPU peak measurement (2 s a run).
SMALL = [*FAST_MODEL, "logging.peak_tflops=1"]
TINY_GBS = 32  # recipes/tiny.yaml


def check_png(path) -> None:
    assert path.stat().st_size > 10_000
    height, width, _ = matplotlib.image.imread(path).shape
    assert height >= 400 and width >= 1000


# --------------------------------------------------------------------------------------------------
# The sweep, launched for real


@pytest.mark.slow
def test_sweep_measures_each_mbs_and_recommends(tmp_path):
    out = tmp_path / "sweep"
    proc = run_cmd([sys.executable, *SWEEP, "--recipe", TINY, "--max-mbs", "4", "--steps", "2", "--warmup-steps", "1",
                    "--out", str(out), *SMALL], timeout=180)
    check_ok(proc)
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["MBS", "tokens/s"])
    assert lines[header].split() == ["MBS", "tokens/s", "step", "time", "(s)", "peak", "GiB", "scaling", "status"]
    rows = [line.split() for line in lines[header + 2 : header + 5]]
    assert [row[0] for row in rows] == ["1", "2", "4"]
    assert all(row[-1] == "ok" for row in rows)
    assert rows[0][4] == "-" and all(row[4].endswith("x") for row in rows[1:])
    assert "stopped: reached --max-mbs 4" in proc.stdout
    assert "gradient accumulation adds no throughput" in proc.stdout

    report = json.loads((out / "sweep.json").read_text())
    assert [r["mbs"] for r in report["results"]] == [1, 2, 4]
    for r in report["results"]:
        assert r["status"] == "ok" and r["num_measured_steps"] == 2
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["peak_gib"] > 0
        assert not (out / f"mbs_{r['mbs']}" / "checkpoints").exists()  # the end-of-run checkpoint is cleaned up
    assert report["results"][0]["scaling"] is None
    assert report["results"][1]["scaling"] == pytest.approx(
        report["results"][1]["tokens_per_s"] / report["results"][0]["tokens_per_s"])
    assert report["world_size"] == 1 and report["global_batch_size"] == TINY_GBS
    rec = report["recommendation"]
    assert rec["micro_batch_size"] in (1, 2, 4)
    assert rec["micro_batch_size"] * rec["gradient_accumulation_steps"] == TINY_GBS
    assert rec["fraction_of_best"] >= 0.95
    assert f"recommended: MBS {rec['micro_batch_size']}" in proc.stdout
    assert report["stopped"]["reason"] == "max_mbs"
    check_png(out / "sweep.png")

    # Each run really trained at that MBS and GAS 1.
    for mbs in (1, 2, 4):
        steps = [json.loads(x) for x in (out / f"mbs_{mbs}" / "metrics.jsonl").read_text().splitlines()]
        assert {(s["batch/mbs"], s["batch/gas"]) for s in steps if "train/loss" in s} == {(mbs, 1)}


# --------------------------------------------------------------------------------------------------
# The sweep with a stand-in for the entry point: out-of-memory and other failures, deterministically

FAKE_RUN = r"""
import json, os, sys
mbs, run_dir = int(sys.argv[1]), sys.argv[2]
if mbs == int(os.environ["FAKE_OOM_AT"]):
    sys.exit("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
if mbs == int(os.environ["FAKE_FAIL_AT"]):
    print("Traceback (most recent call last):\nValueError: boom in the data loader", file=sys.stderr)
    sys.exit(1)
os.makedirs(run_dir)
tps = {1: 1000.0, 2: 1900.0, 4: 2000.0}[mbs]
with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    for step in (1, 2, 3):
        line = {"step": step, "train/loss": 8.0, "batch/mbs": mbs, "batch/gas": 1, "batch/gbs": mbs,
                "memory/peak_gib": 0.5 * mbs}
        if step > 1:
            line.update({"perf/tokens_per_s": tps + step, "perf/tokens_per_s_per_device": tps + step,
                         "perf/step_time_s": mbs * 64 / tps})
        f.write(json.dumps(line) + "\n")
"""


@pytest.fixture
def fake_entry_point(monkeypatch):
    def command(accelerate_config, num_processes, recipe, overrides):
        values = dict(o.split("=", 1) for o in overrides)
        return [sys.executable, "-c", FAKE_RUN, values["batch.micro_batch_size"], values["output_dir"]]

    monkeypatch.setattr(sweep_runner, "launch_command", command)
    monkeypatch.setenv("FAKE_OOM_AT", "0")
    monkeypatch.setenv("FAKE_FAIL_AT", "0")
    return monkeypatch


def test_sweep_survives_out_of_memory(tmp_path, fake_entry_point, capsys):
    fake_entry_point.setenv("FAKE_OOM_AT", "4")
    out = tmp_path / "sweep"
    assert sweep_batch_size.main(["--recipe", TINY, "--out", str(out), "--repeats", "2", *SMALL]) == 0
    stdout = capsys.readouterr().out
    assert "stopped at MBS 4: out of memory (torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in stdout
    assert re.search(r"^\s+4\s+-\s+-\s+-\s+-\s+oom$", stdout, re.MULTILINE)
    # MBS 2 reaches 95% of the best; GAS 16 reaches the tiny recipe's GBS 32 on one process.
    assert "recommended: MBS 2" in stdout and "with GAS 16" in stdout
    assert "the smallest MBS within 95% of it" in stdout  # why this MBS, whatever the scaling line says
    report = json.loads((out / "sweep.json").read_text())
    assert [(r["mbs"], r["status"]) for r in report["results"]] == [(1, "ok"), (2, "ok"), (4, "oom")]
    assert report["stopped"]["mbs"] == 4 and report["stopped"]["reason"] == "oom"
    assert report["recommendation"]["micro_batch_size"] == 2
    assert report["recommendation"]["gradient_accumulation_steps"] == 16
    assert report["results"][1]["tokens_per_s"] == pytest.approx(1902.5)  # median of the measured steps
    assert report["results"][1]["scaling"] == pytest.approx(1902.5 / 1002.5)
    assert [len(r["runs"]) for r in report["results"]] == [2, 2, 0]  # --repeats re-runs only what fit
    check_png(out / "sweep.png")
    assert "OutOfMemoryError" in (out / "mbs_4.stderr.log").read_text()


def test_sweep_stops_above_the_memory_limit_and_still_reports(tmp_path, fake_entry_point, capsys):
    out = tmp_path / "sweep"
    # The stand-in peaks at 0.5 GiB x MBS: MBS 1 fits, MBS 2 does not, MBS 4 is never tried.
    assert sweep_batch_size.main(["--recipe", TINY, "--out", str(out), "--max-memory-gib", "0.8", *SMALL]) == 0
    stdout = capsys.readouterr().out
    assert "stopped at MBS 2: peak 1.00 GiB > --max-memory-gib 0.8" in stdout
    assert "recommended: MBS 1" in stdout and "with GAS 32" in stdout
    assert not (out / "mbs_4.log").exists()
    report = json.loads((out / "sweep.json").read_text())
    assert [(r["mbs"], r["status"]) for r in report["results"]] == [(1, "ok"), (2, "over_memory_limit")]
    assert report["stopped"]["reason"] == "over_memory_limit"
    assert report["recommendation"]["micro_batch_size"] == 1  # the faster MBS 2 does not fit
    check_png(out / "sweep.png")


def test_sweep_reports_another_failure_with_its_stderr(tmp_path, fake_entry_point, capsys):
    fake_entry_point.setenv("FAKE_FAIL_AT", "2")
    out = tmp_path / "sweep"
    assert sweep_batch_size.main(["--recipe", TINY, "--out", str(out), *SMALL]) == 1
    captured = capsys.readouterr()
    assert "stopped at MBS 2: the run failed" in captured.err
    assert "ValueError: boom in the data loader" in captured.err
    report = json.loads((out / "sweep.json").read_text())
    assert [(r["mbs"], r["status"]) for r in report["results"]] == [(1, "ok"), (2, "failed")]
    assert report["recommendation"]["micro_batch_size"] == 1
    check_png(out / "sweep.png")


# --------------------------------------------------------------------------------------------------
# The analysis


def results(tokens_per_s: dict[int, float], status: dict[int, str] | None = None) -> list[MBSResult]:
    status = status or {}
    return [MBSResult(m, status.get(m, "ok"), tokens_per_s=t, step_time_s=m / t, peak_gib=1.0)
            for m, t in tokens_per_s.items()]


CURVE = {1: 100.0, 2: 200.0, 4: 390.0, 8: 420.0, 16: 430.0}


def test_analysis_finds_where_scaling_stops_and_the_smallest_near_best_mbs():
    rs = results(CURVE)
    analysis = analyse(rs, global_batch_size=32, world=1)
    assert [r.scaling for r in rs] == pytest.approx([None, 2.0, 1.95, 420 / 390, 430 / 420])
    assert analysis["scaling_stops_at_mbs"] == 4  # doubling 4 -> 8 gains only 1.08x
    rec = analysis["recommendation"]
    assert (rec["micro_batch_size"], rec["gradient_accumulation_steps"]) == (8, 4)  # 420 >= 0.95 x 430
    assert rec["fraction_of_best"] == pytest.approx(420 / 430)


def test_analysis_divides_per_process_and_skips_runs_over_the_limit():
    rs = results(CURVE, status={16: "over_memory_limit"})
    rec = analyse(rs, global_batch_size=32, world=2)["recommendation"]
    # Without MBS 16 the best is 420 (MBS 8): MBS 8 x GAS 2 x world 2 = 32.
    assert (rec["micro_batch_size"], rec["gradient_accumulation_steps"]) == (8, 2)


def test_analysis_suggests_the_nearest_gbs_when_no_good_mbs_divides():
    analysis = analyse(results(CURVE), global_batch_size=20, world=1)
    rec = analysis["recommendation"]
    assert rec["micro_batch_size"] == 8 and rec["gradient_accumulation_steps"] is None
    assert rec["divides_global_batch_size"] is False and rec["suggested_global_batch_sizes"] == [16, 24]
    assert "no MBS reaching 95%" in analysis["message"]
    assert "16 (GAS 2) or 24 (GAS 3)" in analysis["message"]
    assert "keep GBS 20 with MBS 4 (GAS 5" in analysis["message"]


def test_analysis_without_scaling_stop_or_usable_runs():
    analysis = analyse(results({1: 100.0, 2: 250.0}), global_batch_size=8, world=1)
    assert analysis["scaling_stops_at_mbs"] is None
    assert analysis["recommendation"]["micro_batch_size"] == 2
    empty = analyse([MBSResult(1, "oom")], global_batch_size=8, world=1)
    assert empty["recommendation"] is None and "nothing to recommend" in empty["message"]


def test_repeated_runs_report_the_fastest_run_and_the_largest_peak():
    first = MBSResult(4, "ok", tokens_per_s=100.0, tokens_per_s_per_device=100.0, step_time_s=1.0, peak_gib=2.0)
    first.runs = [{"tokens_per_s": 100.0, "tokens_per_s_per_device": 100.0, "step_time_s": 1.0, "peak_gib": 2.0}]
    for tps, peak in ((50.0, 2.5), (120.0, 1.9)):
        again = MBSResult(4, "ok", tokens_per_s=tps)
        again.runs = [{"tokens_per_s": tps, "tokens_per_s_per_device": tps, "step_time_s": 100 / tps, "peak_gib": peak}]
        sweep_runner.add_run(first, again)
    assert (first.tokens_per_s, first.step_time_s, first.peak_gib) == (120.0, 100 / 120, 2.5)
    sweep_runner.add_run(first, MBSResult(4, "oom", detail="out of memory"))
    assert len(first.runs) == 3 and first.status == "ok" and "a repeat run oom" in first.detail


def test_nearest_multiples():
    assert nearest_multiples(20, 8) == [16, 24]
    assert nearest_multiples(30, 8) == [32]
    assert nearest_multiples(3, 8) == [8]


# --------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.slow
def test_sweep_missing_recipe_is_one_error_line(tmp_path):
    proc = run_cmd([sys.executable, *SWEEP, "--recipe", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "o")],
                   timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: recipe file not found") and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--accelerate-config", "accelerate_configs/nope.yaml"], "accelerate config file not found"),
        (["--num-processes", "2"], "--num-processes needs --accelerate-config"),
        (["model.hiden_size=64"], "unknown key 'model.hiden_size'"),
    ],
)
def test_sweep_bad_input_exits_2(tmp_path, capsys, args, message):
    assert sweep_batch_size.main(["--recipe", TINY, "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert not (tmp_path / "o").exists()


def test_bench_missing_recipe_exits_2(tmp_path, capsys):
    from pretrain.cli.bench import main

    assert main(["--recipe", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err.startswith("error: recipe file not found")


# --------------------------------------------------------------------------------------------------
# The loop benchmark


@pytest.mark.slow
def test_bench_loop_prints_a_ratio():
    proc = run_cmd([sys.executable, *BENCH, "--recipe", TINY, "--steps", "1", "--repeats", "2", *SMALL,
                    "batch.global_batch_size=8", "batch.micro_batch_size=4"], timeout=180)
    check_ok(proc)
    assert re.search(r"repeat\s+toolkit tokens/s\s+minimal tokens/s\s+ratio", proc.stdout)
    ratio = re.search(r"median ratio toolkit/minimal: ([0-9.]+)", proc.stdout)
    assert ratio and float(ratio.group(1)) > 0


def test_bench_startup_init_times_threads_against_one_with_the_same_values():
    """tools/bench_startup.py --init: the weights' init on threads against one thread, same values checked."""
    proc = run_cmd([sys.executable, str(ROOT / "tools" / "bench_startup.py"), "--init", TINY, "--repeats", "1",
                    "model.num_layers=4"], timeout=180)
    check_ok(proc)
    assert proc.stdout.count("same values: True") == 2 and "same values: False" not in proc.stdout
    assert re.search(r"init_weights: one thread [0-9.]+ s, \d+ threads [0-9.]+ s \(medians of 1\): [0-9.]+x", proc.stdout)


# --------------------------------------------------------------------------------------------------
# tools/bench_gpu.py: the GPU acceptance benchmark, reduced to the tiny recipe on CPU


BENCH_GPU = [sys.executable, str(ROOT / "tools" / "bench_gpu.py")]


def bench_gpu_module(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "tools" / "bench_gpu.py")
    bench_gpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu", bench_gpu)  # its dataclasses look their module up
    spec.loader.exec_module(bench_gpu)
    return bench_gpu


@pytest.mark.slow
def test_bench_gpu_reduced_within_a_budget_writes_a_row_per_setting(tmp_path):
    out = tmp_path / "bench"
    proc = run_cmd([*BENCH_GPU, "--reduced", "--budget", "60", "--steps", "2", "--out", str(out)], timeout=300)
    check_ok(proc)
    report = json.loads((out / "bench_gpu.json").read_text())
    rows = report["rows"]
    assert report["budget_s"] == 60
    # the default first (on CPU: chunked, no compile), then the comparison; a busy machine may leave the second
    # row to the budget, never the first
    assert [(r["setting"], r["loss"], r["compile"]) for r in rows] == [("default", "chunked", "none"),
                                                                       ("loss-plain", "plain", "none")]
    assert rows[0]["status"] == "ok" and rows[1]["status"] in ("ok", "budget")
    assert sum(r.get("wall_s", 0) for r in rows) <= 60
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        assert r["tokens_per_s_per_gpu"] > 0 and 0 < r["mfu"] <= 1 and r["hfu"] == r["mfu"]  # nothing recomputed
        assert r["num_measured_steps"] == 2 and r["micro_batch_size"] == 4 and r["peak_gib"] > 0
        assert r["first_step_s"] > 0 and r["cold_compile_s"] >= 0 and r["startup_s"] > 0
        # the same basis as max_memory_allocated: the estimate without its allowance, below the total
        assert 0 < r["estimated_gib"] < r["estimated_total_gib"]
        assert r["estimate_error_pct"] == pytest.approx((r["estimated_gib"] - r["peak_gib"]) / r["peak_gib"] * 100)
    assert [json.loads(line) for line in (out / "bench_gpu.jsonl").read_text().splitlines()] == rows
    table = (out / "bench_gpu.md").read_text().splitlines()
    assert table[0].split(" | ")[8:14] == ["cold compile s", "step s", "peak GiB", "estimated GiB", "error %",
                                           "est. total GiB"]
    assert [line.split(" | ")[1] for line in table[2:]] == ["default", "loss-plain"]
    assert table[0] in proc.stdout
    calibration = json.loads((out / "calibration.json").read_text())
    assert [c["settings"]["name"] for c in calibration] == [r["setting"] for r in ok]
    for c, r in zip(calibration, ok, strict=True):
        assert set(c) == {"gpu", "model", "params", "seq_len", "mbs", "mfu", "tokens_per_s", "settings"}
        assert c["model"] == "tiny" and c["seq_len"] == 64 and c["params"] > 0 and c["gpu"] == report["device"]
        assert (c["mfu"], c["tokens_per_s"], c["mbs"]) == (r["mfu"], r["tokens_per_s_per_gpu"], 4)
    # the planner reads these rows as they are (here relabelled as an H100's, since this run measured a CPU)
    from pretrain.plan.planner import mbs_efficiency, read_calibration
    from pretrain.system import hardware

    relabelled = tmp_path / "calibration.json"
    relabelled.write_text(json.dumps([{**c, "gpu": "NVIDIA H100 80GB HBM3"} for c in calibration]))
    base = read_calibration(relabelled, hardware.find_gpu("H100-80GB")).base_mfu
    assert base == pytest.approx(min(1.0, statistics.median(c["mfu"] / mbs_efficiency(4 * 64) for c in calibration)))


@pytest.mark.slow
def test_bench_gpu_killed_with_sigkill_keeps_its_finished_rows(tmp_path):
    out = tmp_path / "bench"
    cmd = [*BENCH_GPU, "--reduced", "--steps", "1", "--settings", "default,loss-plain,ac-full", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    rows_file, deadline = out / "bench_gpu.jsonl", time.time() + 240
    try:
        while not (rows_file.exists() and rows_file.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.time() < deadline, "the first row never finished"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)  # the benchmark only: the row in flight is in a session of its own
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        running = out / "running.json"
        if running.exists():  # the row that was in flight: its group, as the file says
            os.killpg(json.loads(running.read_text())["pgid"], signal.SIGKILL)
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert 1 <= len(rows) < 3 and rows[0]["setting"] == "default" and rows[0]["status"] == "ok"
    assert json.loads((out / "bench_gpu.json").read_text())["rows"] == rows
    table = (out / "bench_gpu.md").read_text().splitlines()
    assert [line.split(" | ")[1] for line in table[2:]] == [r["setting"] for r in rows]
    assert json.loads((out / "calibration.json").read_text())[0]["settings"]["name"] == "default"


def test_bench_gpu_skips_what_does_not_fit_repeats_or_outlasts_the_budget(tmp_path):
    """No launch: the estimator refuses rows for a tiny device, the default's duplicates are not run, and a
    budget shorter than a row's expected time starts nothing (each row says so)."""
    out = tmp_path / "bench"
    settings = "default,compile-none,ac-none,loss-plain,loss-liger"
    proc = run_cmd([*BENCH_GPU, "--reduced", "--settings", settings, "--device-memory-gib", "0.001", "--out",
                    str(out)], timeout=120)
    assert proc.returncode == 1, proc.stderr  # a refused row is a failure; no-fit rows are answers
    rows = json.loads((out / "bench_gpu.json").read_text())["rows"]
    # on CPU compile-none and ac-none are the default run; liger cannot run here (refused, with the reason)
    assert [(r["setting"], r["status"]) for r in rows] == [("default", "no-fit"), ("loss-liger", "refused"),
                                                           ("loss-plain", "no-fit")]
    assert "does not fit" in rows[0]["detail"] and "needs a CUDA GPU" in rows[1]["detail"]
    assert "tiny / compile-none: the same run as tiny / default" in proc.stdout
    assert "tiny / ac-none: the same run as tiny / default" in proc.stdout
    proc = run_cmd([*BENCH_GPU, "--reduced", "--budget", "1", "--out", str(out)], timeout=120)
    check_ok(proc)
    rows = json.loads((out / "bench_gpu.json").read_text())["rows"]
    assert [(r["setting"], r["status"]) for r in rows] == [("default", "budget"), ("loss-plain", "budget")]
    assert re.match(r"not started: expected \d+ s, [01] s of the budget left", rows[0]["detail"])
    assert not (out / "tiny" / "default").exists()


def test_bench_gpu_rows_run_in_the_documented_priority_order(monkeypatch):
    bench_gpu = bench_gpu_module(monkeypatch)
    rows = bench_gpu.ordered_rows(["llama-1b", "llama-3b"], list(bench_gpu.SETTINGS))
    head = len(bench_gpu.PRIORITY_SETTINGS) + 1
    assert rows[:head] == [("llama-1b", s) for s in bench_gpu.PRIORITY_SETTINGS] + [("llama-3b", "default")]
    assert rows[head:head + 3] == [("llama-1b", "loss-plain"), ("llama-1b", "mbs-1"), ("llama-1b", "no-step-checks")]
    assert len(rows) == len(set(rows)) == 2 * len(bench_gpu.SETTINGS)
    for flag in ("--budget", "--device-memory-gib"):
        with pytest.raises(SystemExit) as exc:
            bench_gpu.parse_args([flag, "0"])
        assert exc.value.code == 2


def test_bench_gpu_unknown_setting_exits_2(capsys, monkeypatch):
    bench_gpu = bench_gpu_module(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        bench_gpu.parse_args(["--settings", "default,loss-fused"])
    assert exc.value.code == 2
    assert "unknown model or setting loss-fused" in capsys.readouterr().err


def gpu_recipes() -> list[str]:
    """The shipped recipes written for GPUs: every one not trained in fp32 (the CPU recipes are)."""
    from pretrain.recipe.config import load_recipe_dict
    from tests.helpers import shipped_recipe

    return [path.stem for path in sorted((ROOT / "recipes").glob("*.yaml"))
            if load_recipe_dict(path) is not None and shipped_recipe(path).precision.dtype != "fp32"]


def test_every_benchmark_row_of_every_gpu_recipe_plans_as_the_gpu_would_run_it(tmp_path, monkeypatch):
    """tools/bench_gpu.py's planning of every (model, setting) of the benchmark and of every shipped GPU recipe
    (pretrain-sweep's rows use the same overrides) with the whole override set a GPU visit gives (the sweep's
    measurement overrides, the stdlib data, the setting's), on one H100 80GB and one H200 (single_gpu.yaml,
    CUDA): the recipe loads, the run's own checks pass and the estimator answers, so each row is a launch or a
    no-fit, never refused; the one exception is Liger, which needs the CUDA GPU this machine lacks. (After
    recipes/llama-1b.yaml turned rollback on, every row of the documented visit was refused: rollback needs a
    checkpoint, the measurement writes none.)"""
    from huggingface_hub import constants

    from pretrain.distributed.layout import Launch
    from pretrain.system.hardware import gpu_for_device
    from tests.helpers import INIT_FROM_ASSETS, hub_cache_with_assets

    hub = hub_cache_with_assets(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub read both at its import, which an earlier test of this process may have made
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    bench_gpu = bench_gpu_module(monkeypatch)
    models = dict(bench_gpu.MODELS)
    for name in gpu_recipes():
        models.setdefault(name, bench_gpu.Model(f"recipes/{name}.yaml"))
    assert {"llama-1b", "7b", "70b", "olmoe-1b-7b", "continue-qwen3-1.7b"} <= set(models)
    args = bench_gpu.parse_args(["--budget", "480", "--out", str(tmp_path / "bench")])
    args.launch = Launch.from_accelerate_config(args.accelerate_config)
    fits = {}
    for gpu_name, gib in (("NVIDIA H100 80GB HBM3", 80), ("NVIDIA H200", 141)):
        args.gpu = gpu_for_device(gpu_name, gib * 2**30)
        for name, model in models.items():
            for setting in bench_gpu.SETTINGS:
                planned = bench_gpu.plan_row(name, model, setting, args)
                if isinstance(planned, dict):  # refused
                    if setting.startswith("ep-"):  # expert parallelism: an MoE recipe on 2+ GPUs of FSDP2 only
                        assert "model.moe" in planned["detail"], (name, setting, planned["detail"])
                        continue
                    assert setting == "loss-liger" and "needs a CUDA GPU" in planned["detail"], (name, setting, planned["detail"])
                    continue
                assert "stability.rollback.enabled=false" in planned.command
                assert planned.estimate is not None, (name, setting, planned.row["detail"])
                fits[gpu_name, name, setting] = planned.estimate.fits
    # the rows a visit measures first fit both GPUs
    assert all(fits[gpu, "llama-1b", s] for gpu in ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
               for s in bench_gpu.PRIORITY_SETTINGS if s != "loss-liger")
    assert INIT_FROM_ASSETS  # continue-qwen3-1.7b planned from the assets' config (its hub id, offline)
    # the visit's owed rows (tools/gpu_visit.sh) are rows of the benchmark; the first ones fit both GPUs
    visit = re.search(r'rows="\$\{VISIT_ROWS:-([^}]+)\}"', (ROOT / "tools" / "gpu_visit.sh").read_text()).group(1)
    owed = [tuple(r.split("/")) for r in visit.split(",")]
    assert all(m in bench_gpu.MODELS and st in bench_gpu.SETTINGS for m, st in owed), owed
    assert all(fits[(gpu, *row)] for gpu in ("NVIDIA H100 80GB HBM3", "NVIDIA H200") for row in owed[:3])
    # 4.54B parameters: 67.7 GiB of fp32 weights, gradients and AdamW moments at the optimizer step, which fits
    # both; the H200 fits a larger micro-batch
    assert fits["NVIDIA H200", "llama-8b-16l", "default"] and fits["NVIDIA H100 80GB HBM3", "llama-8b-16l", "default"]


def test_bench_gpu_rows_run_the_named_pairs_in_the_given_order(tmp_path):
    """--rows (the visit's owed rows): exactly the pairs named, in that order (here no-fit rows: nothing launches)."""
    out = tmp_path / "bench"
    proc = run_cmd([*BENCH_GPU, "--reduced", "--rows", "tiny/loss-plain,tiny/default", "--device-memory-gib", "0.001",
                    "--out", str(out)], timeout=120)
    check_ok(proc)
    rows = json.loads((out / "bench_gpu.json").read_text())["rows"]
    assert [(r["model"], r["setting"], r["status"]) for r in rows] == [("tiny", "loss-plain", "no-fit"),
                                                                       ("tiny", "default", "no-fit")]
