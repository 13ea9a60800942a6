"""Plot a run's metrics.jsonl: loss, learning rate, gradient norm, throughput, MFU, memory and downstream accuracy.

    pretrain-plot runs/tiny [--out runs/tiny/metrics.png] [--smooth 0.9]

Each line of metrics.jsonl is one logged step: {"step": 10, "train/loss": 3.2, ...}; validation is logged
on lines of its own and any key may be missing from a line. A panel whose metrics never appear is left
out (MFU on a device with no known peak, for instance). The run's ``run_config.json``, when present, gives
the world size, the device type and the clipping threshold.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pretrain.checkpoint import rundir
from pretrain.errors import EXIT_USAGE, ConfigError

Series = dict[str, tuple[list[int], list[float]]]

SMOOTHED = ("train/loss", "train/grad_norm")
"""The noisy series ``--smooth`` applies to; the raw values stay, faint, behind the smoothed line."""


def read_metrics(path: Path) -> Series:
    """metric key -> (steps, values), in file order, from a metrics.jsonl (streamed by ``pretrain.checkpoint.rundir``:
    memory is the points plotted, not the file's lines).

    Where steps go backwards (a resumed run that re-logged steps), the later values replace the earlier ones.
    """
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; pass a run directory that holds metrics.jsonl")
    series: Series = {}
    for record in rundir.iter_metrics(path.parent):
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


def smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average over the logged points, debiased so that the
    first points are not pulled towards zero. ``weight`` 0 returns the values unchanged."""
    out, average = [], 0.0
    for i, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**i))
    return out


def world_size(series: Series, config: dict[str, Any]) -> int | None:
    """The run's world size when one holds for every logged point (run_config.json, else the ratio of the
    all-devices to the per-device tokens/s); None when it changed (a resume on another layout)."""
    if "perf/tokens_per_s" not in series or "perf/tokens_per_s_per_device" not in series:
        return None
    (_, total), (_, per_device) = series["perf/tokens_per_s"], series["perf/tokens_per_s_per_device"]
    ratios = {round(t / d) for t, d in zip(total, per_device, strict=False) if d > 0}
    if len(ratios) != 1:
        return None
    (ratio,) = ratios
    configured = config.get("dist/world_size")
    return ratio if configured in (None, ratio) else None


def on_gpu(series: Series, config: dict[str, Any]) -> bool:
    device = config.get("dist/device")
    return str(device).startswith("cuda") if device is not None else "memory/reserved_gib" in series


class Figure:
    """The panels, each drawn by a method of its own onto the next free axes."""

    def __init__(self, series: Series, title: str, config: dict[str, Any] | None = None, smoothing: float = 0.0):
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt

        self.series, self.config, self.smoothing = series, config or {}, smoothing
        # eval/<task>/acc and acc_norm: the tasks are the recipe's, so their keys are found, not listed
        self._keys = {**self._keys, "downstream": tuple(k for k in series if k.startswith("eval/"))}
        panels = [p for p in (self.loss, self.learning_rate, self.grad_norm, self.throughput, self.mfu, self.memory,
                              self.downstream)
                  if self._has(*self._keys[p.__name__])]
        num_rows = -(-len(panels) // 2)
        self.fig, axes = plt.subplots(num_rows, 2, figsize=(13, 3.6 * num_rows), squeeze=False)
        from matplotlib.ticker import MaxNLocator

        last_step = max(steps[-1] for steps, _ in series.values())
        for ax, draw in zip(axes.flat, panels, strict=False):  # spare axes are hidden below
            ax.set_xlabel("optimizer step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(True, alpha=0.3)
            draw(ax)
            ax.set_xlim(0, last_step * 1.02)  # every panel on the same steps
            if len(ax.get_legend_handles_labels()[0]) > 1:
                ax.legend(fontsize=8)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        self.fig.suptitle(title)
        self.fig.tight_layout()

    _keys = {
        "loss": ("train/loss", "val/loss"),
        "learning_rate": ("train/lr",),
        "grad_norm": ("train/grad_norm",),
        "throughput": ("perf/tokens_per_s",),
        "mfu": ("perf/mfu",),
        "memory": ("memory/peak_gib", "memory/reserved_gib", "memory/rss_gib", "memory/estimated_gib"),
    }

    def _has(self, *keys: str) -> bool:
        return any(key in self.series for key in keys)

    def _line(self, ax, key: str, label: str, scale: float = 1.0, **style) -> None:
        steps, values = self.series[key]
        values = [v * scale for v in values]
        marker = "o" if key.startswith("val/") or len(steps) < 30 else None
        if self.smoothing and key in SMOOTHED:
            raw = ax.plot(steps, values, alpha=0.25, linewidth=1.0, **style)[0]
            ax.plot(steps, smooth(values, self.smoothing), color=raw.get_color(), linewidth=1.5,
                    label=f"{label} (smoothed {self.smoothing:g})")
        else:
            ax.plot(steps, values, label=label, marker=marker, markersize=3, linewidth=1.2, **style)

    def loss(self, ax) -> None:
        ax.set_title("Loss")
        ax.set_ylabel("loss (nats/token)")
        for key, label in (("train/loss", "train"), ("val/loss", "validation")):
            if key in self.series:
                self._line(ax, key, label)
        if "train/tokens_seen" in self.series:
            self._tokens_axis(ax)

    def _tokens_axis(self, ax) -> None:
        """Tokens seen along the top: the logged (step, tokens) points, interpolated (exact for a constant batch,
        and still right where a resume changed it)."""
        import numpy as np
        from matplotlib.ticker import EngFormatter

        steps, tokens = (np.asarray(v, dtype=float) for v in self.series["train/tokens_seen"])
        if len(steps) < 2 or not (np.diff(steps) > 0).all() or not (np.diff(tokens) > 0).all():
            return
        # beyond the logged points (the axes' margins): the nearest segment's tokens per step
        first, last = ((tokens[1] - tokens[0]) / (steps[1] - steps[0]),
                       (tokens[-1] - tokens[-2]) / (steps[-1] - steps[-2]))

        def to_tokens(s):
            s = np.asarray(s, dtype=float)
            inside = np.interp(s, steps, tokens)
            return np.where(s < steps[0], tokens[0] + (s - steps[0]) * first,
                            np.where(s > steps[-1], tokens[-1] + (s - steps[-1]) * last, inside))

        def to_steps(t):
            t = np.asarray(t, dtype=float)
            inside = np.interp(t, tokens, steps)
            return np.where(t < tokens[0], steps[0] + (t - tokens[0]) / first,
                            np.where(t > tokens[-1], steps[-1] + (t - tokens[-1]) / last, inside))

        top = ax.secondary_xaxis("top", functions=(to_tokens, to_steps))
        top.set_xlabel("tokens seen", fontsize=9)
        top.xaxis.set_major_formatter(EngFormatter(sep=""))
        top.tick_params(labelsize=8)

    def downstream(self, ax) -> None:
        """Every task's acc (solid) and acc_norm (dashed), on the 0-1 scale."""
        ax.set_title("Downstream tasks")
        ax.set_ylabel("accuracy")
        for key in sorted(self._keys["downstream"]):
            task, _, metric = key.removeprefix("eval/").rpartition("/")
            style = {"linestyle": "--"} if metric == "acc_norm" else {}
            self._line(ax, key, f"{task} {metric}", **style)
        ax.set_ylim(0, 1)

    def learning_rate(self, ax) -> None:
        ax.set_title("Learning rate")
        ax.set_ylabel("lr")
        self._line(ax, "train/lr", "lr")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))

    def grad_norm(self, ax) -> None:
        ax.set_title("Gradient norm (before clipping)")
        ax.set_ylabel("L2 norm")
        self._line(ax, "train/grad_norm", "gradient norm")
        values = self.series["train/grad_norm"][1]
        clip = self.config.get("recipe/optim/grad_clip")
        if clip:
            ax.axhline(clip, color="grey", linestyle="--", linewidth=1, label=f"clipped to {clip:g} (optim.grad_clip)")
        positive = [v for v in values if v > 0]
        if positive and max(positive) / min(positive) > 20:  # early spikes would flatten the rest
            ax.set_yscale("log")

    def throughput(self, ax) -> None:
        """One line: tokens/s of all devices on the left axis, per device on the right (the same line divided
        by the world size), or one label where the two coincide."""
        ax.set_title("Throughput")
        steps, values = self.series["perf/tokens_per_s"]
        world = world_size(self.series, self.config)
        if world == 1:
            self._line(ax, "perf/tokens_per_s", "tokens/s")
            ax.set_ylabel("tokens/s (1 device)")
        elif world is not None:
            self._line(ax, "perf/tokens_per_s", "tokens/s")
            ax.set_ylabel(f"tokens/s, all {world} devices")
            right = ax.secondary_yaxis("right", functions=(lambda t: t / world, lambda t: t * world))
            right.set_ylabel("tokens/s per device")
        else:  # the world size changed during the run: two lines
            self._line(ax, "perf/tokens_per_s", "all devices")
            if "perf/tokens_per_s_per_device" in self.series:
                self._line(ax, "perf/tokens_per_s_per_device", "per device")
            ax.set_ylabel("tokens/s")
        ax.set_ylim(0, max(values) * 1.1)  # from zero, so a small wobble does not look like a collapse

    def mfu(self, ax) -> None:
        """MFU (and HFU) in % of one peak: a run whose peak was raised during the run (a CPU peak measured on
        a busy machine, see ThroughputMonitor) is drawn against its final, highest peak, so that no point is
        read against a lower one. 0-100% always, with 100% marked."""
        ax.set_title("Model FLOPs utilisation")
        ax.set_ylabel("% of the device's peak")
        peaks = self.series.get("perf/peak_tflops")
        final_peak = max(peaks[1]) if peaks else None
        top = 0.0
        for key, label in (("perf/mfu", "MFU"), ("perf/hfu", "HFU (with recomputation)")):
            if key not in self.series:
                continue
            steps, values = self.series[key]
            if peaks and peaks[0] == steps:
                values = [v * p / final_peak for v, p in zip(values, peaks[1], strict=True)]
            top = max(top, *(v * 100 for v in values))
            ax.plot(steps, [v * 100 for v in values], label=label, marker="o" if len(steps) < 30 else None,
                    markersize=3, linewidth=1.2)
        peak = f"100% = peak {final_peak:.3g} TFLOP/s per device" if final_peak else "100% = the device's peak"
        if top >= 40:
            ax.axhline(100, color="grey", linestyle="--", linewidth=1, label=peak)
            ax.set_ylim(0, 105)
        else:  # a 0-100 scale would flatten the line: zoom in, and say where 100% is
            ax.set_ylim(0, max(top * 1.3, 1.0))
            ax.text(0.01, 0.97, f"{peak} (above this scale)", transform=ax.transAxes, fontsize=8, va="top")

    def memory(self, ax) -> None:
        """Per-device memory, every line saying what it measures: on CPU the measured lines are the whole
        process's resident memory (Python, libraries, data buffers, tensors), while the estimate counts
        tensors only."""
        if on_gpu(self.series, self.config):
            ax.set_title("Memory per GPU")
            lines = (("memory/peak_gib", "peak allocated by tensors"),
                     ("memory/reserved_gib", "peak reserved by the allocator"),
                     ("memory/estimated_gib", "estimate (pretrain-estimate)"),
                     ("memory/rss_gib", "host RSS (CPU memory of the process)"))
        else:
            ax.set_title("Memory per process (CPU)")
            lines = (("memory/peak_gib", "peak RSS: whole process (Python, libraries, tensors)"),
                     ("memory/rss_gib", "RSS now: whole process"),
                     ("memory/estimated_gib", "estimate: tensors only (pretrain-estimate)"))
        ax.set_ylabel("GiB")
        top = 0.0
        for key, label in lines:
            if key in self.series:
                self._line(ax, key, label, linestyle=":" if key == "memory/estimated_gib" else "-")
                top = max(top, *self.series[key][1])
        if top > 0:
            ax.set_ylim(0, top * 1.15)

    def save(self, out: Path) -> Path:
        import matplotlib.pyplot as plt

        out.parent.mkdir(parents=True, exist_ok=True)
        self.fig.savefig(out, dpi=110)
        plt.close(self.fig)
        return out


def plot(series: Series, out: Path, title: str, config: dict[str, Any] | None = None, smoothing: float = 0.0) -> Path:
    return Figure(series, title, config, smoothing).save(out)


def smoothing_weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(
            f"--smooth takes an averaging weight from 0 (off) up to but not including 1, e.g. 0.9; got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pretrain-plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default RUN_DIR/metrics.png)")
    parser.add_argument("--smooth", type=smoothing_weight, default=0.0, metavar="W",
                        help="smooth the train loss and gradient norm by an exponential moving average of weight W "
                             "(0 <= W < 1, as TensorBoard's slider; 0.9 averages over ~10 logged points). Default 0: "
                             "off")
    args = parser.parse_args(argv)
    if args.run_dir.is_file() and args.run_dir.name == rundir.METRICS_FILE:
        args.run_dir = args.run_dir.parent  # the run's metrics file itself: its run directory
    try:
        if args.run_dir.is_file():
            raise ConfigError(f"{args.run_dir} is a file, not a run directory: pass the directory a run wrote (it "
                              f"holds {rundir.METRICS_FILE}), e.g. pretrain-plot runs/tiny")
        series = read_metrics(args.run_dir / "metrics.jsonl")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    config = rundir.read_run_config(args.run_dir) or {}
    out = plot(series, args.out or args.run_dir / "metrics.png", args.run_dir.resolve().name, config, args.smooth)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
