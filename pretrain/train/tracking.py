"""Where metrics go: metrics.jsonl, wandb and tensorboard through accelerate's trackers, and the console.

Every backend receives the same namespaced keys through ``accelerator.log``; the JSONL file is an
accelerate ``GeneralTracker`` of our own so that call sites never branch on which backends exist.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from accelerate.tracking import GeneralTracker, TensorBoardTracker, WandBTracker, on_main_process

from pretrain.checkpoint.rundir import METRICS_FILE, RUN_CONFIG_FILE, metrics_tail
from pretrain.recipe.config import Recipe


def flatten(values: dict[str, Any], prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """Nested dict -> one level with 'a/b/c' keys; lists become strings (trackers take scalars only)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(flatten(value, name, sep))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(value)
        else:
            flat[name] = value
    return flat


def finite_or_none(value: Any) -> Any:
    """A value as metrics.jsonl holds it: strict JSON has no NaN or Infinity, so a non-finite number is null
    (a skipped step says why in ``stability/skip_reason``)."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    return None if isinstance(value, float) and not math.isfinite(value) else value


class JSONLTracker(GeneralTracker):
    """Appends one JSON object per logged step to ``metrics.jsonl``; writes the run config beside it.

    On resume, lines for steps after the checkpoint are dropped first, so steps redone after a restart
    replace the lost ones instead of appearing twice.
    """

    name = "jsonl"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, output_dir: str | os.PathLike, resume_step: int | None = None):
        super().__init__()
        self.path = Path(output_dir) / METRICS_FILE
        self.config_path = Path(output_dir) / RUN_CONFIG_FILE
        self.resume_step = resume_step
        self._file = None

    @on_main_process
    def start(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._keep_until(self.resume_step if self.resume_step is not None else -1)
        # Line-buffered: a killed run keeps every line it logged.
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")

    def _keep_until(self, step: int) -> None:
        """Drop the lines of steps after ``step`` (and a torn last line), in place from the file's end.

        The lines are in step order (every resume and rollback comes through here before the run appends again), so
        the lines to drop are the file's last ones: ``metrics_tail`` reads back from the end, in fixed blocks, to the
        first line at or before ``step``, and the file is cut right after it. Memory is one block, time the lines
        dropped: a rewind of a 1e6-step run does not read its gigabytes (rewriting the file read it whole, minutes on
        rank 0 while the other ranks wait in a collective). The lines kept are the bytes the run wrote, untouched:
        what the former rewrite (``json.dumps`` of each record read back) gave for any file a run wrote.

        Why a crash cannot lose a kept line: the kept bytes are made durable first (fsync), and a truncate only
        removes bytes past the cut, never rewrites one before it; it is one metadata change, so after a crash the
        file has its old length or the new one (at worst the dropped lines are still there, and the next resume,
        which comes through here, drops them again). A step below 0 (a fresh run) keeps nothing without reading.
        """
        if not self.path.exists():
            return
        offset, ends_line = 0, True
        if step >= 0:
            tail = metrics_tail(self.path.parent, after_step=step)
            offset, ends_line = tail.offset, tail.ends_line
        with open(self.path, "r+b") as f:
            os.fsync(f.fileno())  # what is kept is on disk before anything is dropped
            f.truncate(offset)
            if not ends_line:  # a kept last line that lost its newline to the kill: the next line starts apart
                f.seek(offset)
                f.write(b"\n")
                f.flush()
            os.fsync(f.fileno())

    @on_main_process
    def rewind(self, step: int) -> None:
        """A rollback to ``step`` (stability.rollback): the lines of later steps are dropped, as on resume; the
        steps redone replace them (rollbacks.jsonl keeps what the abandoned ones were)."""
        self.finish()
        self._keep_until(step)
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")

    @property
    def tracker(self):
        return self._file

    @on_main_process
    def store_init_configuration(self, values: dict):
        tmp = self.config_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(values, indent=1, sort_keys=True, default=str))
        os.replace(tmp, self.config_path)

    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs):
        record = {"step": step, **{k: finite_or_none(v) for k, v in values.items()}, "time": round(time.time(), 3)}
        self._file.write(json.dumps(record, default=float, allow_nan=False) + "\n")

    @on_main_process
    def finish(self):
        if self._file is not None:
            self._file.close()
            self._file = None


def set_resume_step(trackers: list[GeneralTracker], step: int) -> None:
    """Before the trackers start: the run resumes from ``step`` after all (an older checkpoint than the
    one they were built for turned out to be the intact one)."""
    for tracker in trackers:
        if isinstance(tracker, JSONLTracker):
            tracker.resume_step = step


def rewind_trackers(trackers: list[GeneralTracker], step: int) -> None:
    """A rollback to ``step``: metrics.jsonl drops the later steps' lines (wandb and tensorboard keep theirs: they
    cannot take a line back; the redone steps are logged again there)."""
    for tracker in trackers:
        if isinstance(tracker, JSONLTracker):
            tracker.rewind(step)


def wandb_key_configured() -> bool:
    """Whether wandb could log in online (an env key or a netrc entry). The key itself is never read out."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("//")[-1].split("/")[0]
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


# How long a run start waits to learn whether wandb's server answers: wandb.init itself retries for minutes
# and then fails with a traceback on a node without a route out.
WANDB_PROBE_TIMEOUT_S = 3.0


def wandb_unreachable(timeout_s: float = WANDB_PROBE_TIMEOUT_S) -> str | None:
    """Why wandb's server (WANDB_BASE_URL, through HTTPS_PROXY when one is set) cannot be reached, or None.
    A TCP connect in a thread with a deadline: name resolution on a host without a network can block far longer
    than any socket timeout."""
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    target = urllib.parse.urlsplit(proxy or os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host, port = target.hostname or "", target.port or (443 if target.scheme == "https" else 80)
    outcome: dict[str, str] = {}

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome["ok"] = ""
        except OSError as exc:
            outcome["error"] = str(exc.strerror or exc)

    probe = threading.Thread(target=connect, daemon=True, name="wandb-probe")
    probe.start()
    probe.join(timeout_s)
    if "ok" in outcome:
        return None
    return f"{host}:{port}: {outcome.get('error') or f'no answer within {timeout_s:g} s'}"


def wandb_mode(output_dir: Path) -> str:
    """WANDB_MODE when it says offline or disabled; else online if wandb can log in (a key or a netrc entry)
    and its server answers, offline otherwise. Falling back from online says so in one line, with the command
    that uploads the run later."""
    mode = os.environ.get("WANDB_MODE")
    if mode and mode != "online":
        return mode
    if not mode and not wandb_key_configured():
        return "offline"
    reason = wandb_unreachable()
    if reason is None:
        return "online"
    print(f"wandb: the server is unreachable ({reason}); logging offline to {output_dir / 'wandb'} instead. "
          f"Upload it later from a machine with network: wandb sync {output_dir / 'wandb'}/offline-run-*",
          file=sys.stderr, flush=True)
    return "offline"


def _stable_run_id(output_dir: Path) -> str:
    """One wandb run id per output_dir, so a resumed run continues the same wandb run."""
    path = output_dir / ".wandb_run_id"
    if not path.exists():
        path.write_text(uuid.uuid4().hex[:12])
    return path.read_text().strip()


def build_trackers(recipe: Recipe, output_dir: Path, resume_step: int | None, is_main: bool) -> list[GeneralTracker]:
    """Tracker objects for ``Accelerator(log_with=...)``; built on every rank, active on the main one."""
    run_name = recipe.logging.run_name or recipe.name
    trackers: list[GeneralTracker] = []
    for backend in recipe.logging.backends:
        if backend == "jsonl":
            trackers.append(JSONLTracker(output_dir, resume_step))
        elif backend == "tensorboard":
            trackers.append(TensorBoardTracker(run_name, output_dir / "tensorboard"))
        elif backend == "wandb":
            run_id = _stable_run_id(output_dir) if is_main else "unused"
            trackers.append(
                WandBTracker(
                    recipe.logging.project, name=run_name, id=run_id, resume="allow", dir=str(output_dir),
                    # Only the main process starts a wandb run (accelerate's tracker is main-process only).
                    mode=wandb_mode(output_dir) if is_main else "offline",
                )
            )
    return trackers


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (``D days, H:MM:SS`` past a day), whole seconds."""
    return str(timedelta(seconds=round(max(seconds, 0.0))))


class Console:
    """Main-process console output: a rich progress bar on a terminal, plain lines in a log file.

    ``plain`` mode prints one self-contained line per logged step, which reads well in a SLURM log
    (no carriage-return redraws).
    """

    def __init__(self, mode: str, enabled: bool):
        self.enabled = enabled
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "plain"
        self.mode = mode if enabled else "none"
        self._progress = None
        self._task = None
        self._started = time.monotonic()
        self._last_line = (self._started, 0)  # (time, step) of the previous step line: the recent step time

    def print(self, message: str) -> None:
        if self.mode == "none":
            return
        if self._progress is not None:
            self._progress.console.print(message, highlight=False, markup=False)
        else:
            print(message, flush=True)

    def start(self, total_steps: int, first_step: int) -> None:
        """Training (re)starts after optimizer step ``first_step``: elapsed time counts from here."""
        self._started = time.monotonic()
        self._last_line = (self._started, first_step)
        if self.mode != "bar":
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            refresh_per_second=4,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=total_steps, completed=first_step, info="")

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def step_summary(self, step: int, total_steps: int, metrics: dict[str, Any]) -> None:
        parts = [f"step {step}/{total_steps}"]
        for key, label, fmt in (
            ("train/loss", "loss", "{:.4f}"),
            ("val/loss", "val_loss", "{:.4f}"),
            ("train/lr", "lr", "{:.2e}"),
            ("train/grad_norm", "gnorm", "{:.3f}"),
            ("perf/tokens_per_s", "tok/s", "{:,.0f}"),
            ("perf/mfu", "mfu", "{:.1%}"),
            ("memory/peak_gib", "mem", "{:.2f}GiB"),
        ):
            if metrics.get(key) is not None:
                parts.append(f"{label} {fmt.format(metrics[key])}")
        parts += self._timing(step, total_steps)
        line = " | ".join(parts)
        if self._progress is not None:
            # the bar has its own elapsed and remaining-time columns
            info = " ".join(p for p in parts[1:] if not p.startswith(("lr", "gnorm", "mem", "elapsed", "eta")))
            self._progress.update(self._task, completed=step, info=info)
        elif self.mode == "plain":
            print(line, flush=True)

    def _timing(self, step: int, total_steps: int) -> list[str]:
        """``elapsed H:MM:SS`` since training (re)started and ``eta H:MM:SS``: the steps left at the step time
        since the previous step line (wall time, so evaluations and checkpoints, which recur, are in it)."""
        now = time.monotonic()
        last_time, last_step = self._last_line
        parts = [f"elapsed {format_duration(now - self._started)}"]
        if step > last_step:
            recent_step_s = (now - last_time) / (step - last_step)
            parts.append(f"eta {format_duration(recent_step_s * max(total_steps - step, 0))}")
            self._last_line = (now, step)
        return parts

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class StepLog:
    """Which optimizer steps log their training metrics (step 1, every ``logging.every_steps``, the last),
    and where those go: every tracker through ``accelerator.log``, then the console."""

    def __init__(self, accelerator, console: Console, *, every_steps: int, num_steps: int):
        self.accelerator = accelerator
        self.console = console
        self.every_steps = every_steps
        self.num_steps = num_steps

    def due(self, step: int) -> bool:
        return step == 1 or step % self.every_steps == 0 or step == self.num_steps

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Log ``metrics`` at ``step``, leaving out None values; returns what was logged."""
        metrics = {k: v for k, v in metrics.items() if v is not None}
        self.accelerator.log(metrics, step=step)
        self.console.step_summary(step, self.num_steps, metrics)
        return metrics
