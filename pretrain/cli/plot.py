"""Plot a run's metrics.jsonl: loss (train and validation), learning rate, throughput, MFU and memory.

    pretrain-plot runs/tiny [--out runs/tiny/metrics.png]

Each line of metrics.jsonl is one logged step: {"step": 10, "train/loss": 3.2, ...}; validation is logged
on lines of its own and any key may be missing from a line. A panel whose metrics never appear is left
out (MFU on a device with no known peak, for instance).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrain import rundir
from pretrain.errors import EXIT_USAGE, ConfigError

# (panel title, y label, [(metric key, legend label)], scale applied to values)
PANELS = (
    ("Loss", "loss (nats/token)", [("train/loss", "train"), ("val/loss", "validation")], 1.0),
    ("Learning rate", "lr", [("train/lr", "lr")], 1.0),
    ("Throughput", "tokens/s", [("perf/tokens_per_s", "all devices"), ("perf/tokens_per_s_per_device", "per device")],
     1.0),
    ("MFU", "MFU (%)", [("perf/mfu", "model FLOPs utilisation")], 100.0),
    ("Memory", "GiB", [("memory/peak_gib", "peak"), ("memory/reserved_gib", "reserved"), ("memory/rss_gib", "host RSS"),
                       ("memory/estimated_gib", "estimate (pretrain-estimate)")],
     1.0),
)  # fmt: skip


def read_metrics(path: Path) -> dict[str, tuple[list[int], list[float]]]:
    """metric key -> (steps, values), in file order, from a metrics.jsonl (read by ``pretrain.rundir``).

    Where steps go backwards (a resumed run that re-logged steps), the later values replace the earlier ones.
    """
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; pass a run directory that holds metrics.jsonl")
    series: dict[str, tuple[list[int], list[float]]] = {}
    for record in rundir.read_metrics(path.parent):
        step = record["step"]
        for key, value in record.items():
            if key in ("step", "time") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            steps, values = series.setdefault(key, ([], []))
            while steps and steps[-1] >= step:  # re-logged after a resume: drop the superseded points
                steps.pop()
                values.pop()
            steps.append(step)
            values.append(float(value))
    if not series:
        raise ConfigError(f"{path} holds no metrics (is the run still starting?)")
    return series


def plot(series: dict[str, tuple[list[int], list[float]]], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    panels = [p for p in PANELS if any(key in series for key, _ in p[2])]
    num_cols = 2
    num_rows = -(-len(panels) // num_cols)
    fig, axes = plt.subplots(num_rows, num_cols, figsize=(12, 3.4 * num_rows), squeeze=False)
    for ax, (name, ylabel, keys, scale) in zip(axes.flat, panels, strict=False):  # spare axes are hidden below
        top = 0.0
        for key, label in keys:
            if key not in series:
                continue
            steps, values = series[key]
            top = max(top, max(values) * scale)
            marker = "o" if key.startswith("val/") or len(steps) < 30 else None
            ax.plot(steps, [v * scale for v in values], label=label, marker=marker, markersize=3, linewidth=1.2)
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if name == "Learning rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        if name in ("MFU", "Memory", "Throughput") and top > 0:
            ax.set_ylim(0, top * 1.1)  # from zero, so a small wobble does not look like a collapse
        if len(ax.get_lines()) > 1:
            ax.legend()
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pretrain-plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    try:
        series = read_metrics(args.run_dir / "metrics.jsonl")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = plot(series, args.out or args.run_dir / "metrics.png", args.run_dir.resolve().name)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
