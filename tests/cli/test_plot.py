"""pretrain-plot: a PNG from a metrics.jsonl, and clear errors when there is nothing to plot."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest

from pretrain.cli.plot import Figure, main, read_metrics, smooth


def write_metrics(run_dir, num_steps: int = 60, mfu: bool = True, world: int = 1) -> None:
    lines = []
    for step in [1, *range(5, num_steps + 1, 5)]:
        record = {
            "step": step,
            "train/loss": 3.0 + 7.0 * math.exp(-step / 20) + 0.2 * (-1) ** step,
            "train/lr": 1e-3 * min(1.0, step / 10),
            "train/grad_norm": 5.0 * math.exp(-step / 10) + 0.3,
            "train/tokens_seen": step * 4096,
            "perf/tokens_per_s": 5000.0 * world + step,
            "perf/tokens_per_s_per_device": (5000.0 * world + step) / world,
            "memory/peak_gib": 1.5,
            "memory/rss_gib": 1.2,
            "memory/estimated_gib": 0.4,
            "time": 1700000000.0 + step,
        }
        if mfu:
            record["perf/mfu"] = 0.3
        lines.append(record)
        if step % 20 == 0:  # validation is logged on lines of its own
            lines.append({"step": step, "val/loss": 3.2 + 7.0 * math.exp(-step / 20), "val/tokens": 1024})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_plot_writes_a_png(tmp_path, capsys):
    write_metrics(tmp_path)
    assert main([str(tmp_path)]) == 0
    png = tmp_path / "metrics.png"
    assert png.stat().st_size > 10_000
    height, width, channels = matplotlib.image.imread(png).shape
    assert height > 500 and width > 1000 and channels in (3, 4)
    assert str(png) in capsys.readouterr().out


def test_plot_out_option_and_missing_mfu(tmp_path):
    write_metrics(tmp_path, mfu=False)
    out = tmp_path / "plots" / "run.png"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    assert not (tmp_path / "metrics.png").exists()


def test_read_metrics_keeps_separate_val_lines_and_relogged_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [
        {"step": 1, "train/loss": 5.0},
        {"step": 2, "train/loss": 4.0},
        {"step": 2, "val/loss": 4.5},
        {"step": 3, "train/loss": 3.9},
        {"step": 2, "train/loss": 4.1},  # a resumed run re-logs step 2: it replaces steps 2 and 3
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 4, "train/lo')
    series = read_metrics(path)
    assert series["train/loss"] == ([1, 2], [5.0, 4.1])
    assert series["val/loss"] == ([2], [4.5])
    assert "time" not in series


def test_missing_and_empty_files_are_clear_errors(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "metrics.jsonl does not exist" in err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "holds no metrics" in err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\nnot json\n{"step": 2}\n')
    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl:2 is not JSON" in capsys.readouterr().err
    assert not (tmp_path / "metrics.png").exists()


def test_a_file_that_is_not_a_run_directory_is_named_as_such(tmp_path, capsys):
    """Issue 36: a file given where a run directory goes was reported as "FILE/metrics.jsonl does not exist";
    a metrics file that is not text was a UnicodeDecodeError traceback. The run's own metrics.jsonl is accepted."""
    other = tmp_path / "notes.jsonl"
    other.write_text('{"step": 1}\n')
    assert main([str(other)]) == 2
    err = capsys.readouterr().err
    assert f"{other} is a file, not a run directory" in err and "does not exist" not in err
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe\x00binary\n")
    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl is not UTF-8 text" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\n{"step": 2, "train/loss": 1.5}\n')
    assert main([str(tmp_path / "metrics.jsonl")]) == 0 and (tmp_path / "metrics.png").is_file()


def test_runs_as_a_script(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pretrain.cli.plot", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr


def panels(series, config=None, smoothing=0.0) -> dict:
    figure = Figure(series, "run", config, smoothing)
    return {ax.get_title(): ax for ax in figure.fig.axes if ax.get_visible() and ax.get_title()}


def labels(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines()]


def test_single_device_throughput_is_one_line_and_every_panel_is_there(tmp_path):
    write_metrics(tmp_path)
    axes = panels(read_metrics(tmp_path / "metrics.jsonl"), {"dist/world_size": 1, "dist/device": "cpu",
                                                            "recipe/optim/grad_clip": 1.0})
    assert set(axes) == {"Loss", "Learning rate", "Gradient norm (before clipping)", "Throughput",
                         "Model FLOPs utilisation", "Memory per process (CPU)"}
    assert labels(axes["Throughput"]) == ["tokens/s"] and axes["Throughput"].get_ylabel() == "tokens/s (1 device)"
    # tokens seen on a secondary (top) axis of the loss panel
    assert any(child.get_xlabel() == "tokens seen" for child in axes["Loss"].child_axes)
    assert "clipped to 1 (optim.grad_clip)" in labels(axes["Gradient norm (before clipping)"])
    memory = labels(axes["Memory per process (CPU)"])
    assert any("whole process" in label for label in memory) and any("tensors only" in label for label in memory)


def test_several_devices_one_line_with_a_per_device_axis(tmp_path):
    write_metrics(tmp_path, world=4)
    ax = panels(read_metrics(tmp_path / "metrics.jsonl"))["Throughput"]
    assert labels(ax) == ["tokens/s"] and ax.get_ylabel() == "tokens/s, all 4 devices"
    (right,) = ax.child_axes
    assert right.get_ylabel() == "tokens/s per device"


def test_mfu_panel_marks_100_percent_and_uses_the_final_peak(tmp_path):
    series = {"perf/mfu": ([10, 20], [0.9, 0.5]), "perf/peak_tflops": ([10, 20], [0.1, 0.2])}
    ax = panels(series)["Model FLOPs utilisation"]
    (mfu_line, hundred) = ax.get_lines()
    assert list(mfu_line.get_ydata()) == pytest.approx([45.0, 50.0])  # 0.9 of 0.1 TFLOP/s is 45% of 0.2
    assert list(hundred.get_ydata()) == [100, 100] and ax.get_ylim() == (0, 105)
    assert hundred.get_label() == "100% = peak 0.2 TFLOP/s per device"
    low = panels({"perf/mfu": ([10, 20], [0.02, 0.03])})["Model FLOPs utilisation"]
    assert len(low.get_lines()) == 1 and low.get_ylim() == pytest.approx((0, 3.9))  # zoomed in, 100% said
    assert [t.get_text() for t in low.texts] == ["100% = the device's peak (above this scale)"]


def test_smoothing_keeps_the_raw_line_faint_behind(tmp_path):
    assert smooth([1.0, 3.0], 0.0) == [1.0, 3.0]
    assert smooth([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # debiased: no pull towards 0
    write_metrics(tmp_path)
    ax = panels(read_metrics(tmp_path / "metrics.jsonl"), smoothing=0.6)["Loss"]
    raw, smoothed, validation = ax.get_lines()
    assert raw.get_alpha() == 0.25 and smoothed.get_label() == "train (smoothed 0.6)"
    assert validation.get_label() == "validation"  # evaluations are not smoothed
    # the +-0.2 zig-zag of the raw loss is damped
    assert (np.diff(raw.get_ydata()[-6:]) > 0).any() and (np.diff(smoothed.get_ydata()[-6:]) < 0).all()
    assert main([str(tmp_path), "--smooth", "0.9"]) == 0


@pytest.mark.parametrize("weight", ["1", "-0.1", "high"])
def test_bad_smoothing_weight_is_a_usage_error(tmp_path, capsys, weight):
    write_metrics(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--smooth", weight])
    assert exit_info.value.code == 2 and "--smooth takes an averaging weight" in capsys.readouterr().err


def test_downstream_tasks_have_a_panel(tmp_path):
    """eval/<task>/acc and acc_norm (the recipe's eval.tasks): one panel, a line per task and metric, 0-1."""
    write_metrics(tmp_path)
    extra = [{"step": step, "eval/lines/acc": 0.25 + step / 200, "eval/lines/acc_norm": 0.3 + step / 200,
              "eval/arc/acc": 0.3} for step in (0, 30, 60)]
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in extra))
    axes = panels(read_metrics(tmp_path / "metrics.jsonl"))
    assert sorted(labels(axes["Downstream tasks"])) == ["arc acc", "lines acc", "lines acc_norm"]
    assert axes["Downstream tasks"].get_ylim() == (0, 1)
