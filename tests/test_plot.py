"""pretrain-plot: a PNG from a metrics.jsonl, and clear errors when there is nothing to plot."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import matplotlib.image

from pretrain.cli.plot import main, read_metrics


def write_metrics(run_dir, num_steps: int = 60, mfu: bool = True) -> None:
    lines = []
    for step in [1, *range(5, num_steps + 1, 5)]:
        record = {
            "step": step,
            "train/loss": 3.0 + 7.0 * math.exp(-step / 20),
            "train/lr": 1e-3 * min(1.0, step / 10),
            "perf/tokens_per_s": 5000.0 + step,
            "memory/peak_gib": 1.5,
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


def test_runs_as_a_script(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pretrain.cli.plot", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
