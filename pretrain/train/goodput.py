"""Goodput: where a run's wall time went, every second of it in exactly one category.

Goodput is the share of wall-clock time that produced kept optimizer steps (MaxText's term). The accounting is a
state machine on one clock: at any moment the run is in one category, and ``switch`` closes the time since the
last switch into it, so the categories of an attempt sum to its wall time by construction (from the process's
start, as the OS records it, to the last record). An *attempt* is one start of the run (a launch, a requeue);
docs/observability.md defines each category:

- ``startup``: process start to the loop, less the data build: imports, process group, model, resume load.
- ``data_build``: building or opening the token store (``ensure_data``, ``open_data``).
- ``first_step``: the attempt's first optimizer step (compilation, allocator warm-up).
- ``productive``: optimizer steps whose update was kept, and not done before.
- ``lost``: steps done again after a restart (a step at or below the step the previous attempt had reached).
- ``skipped``: steps whose update a stability rule skipped (stability.skip_*).
- ``evaluation``: in-loop evaluation (loss and downstream tasks).
- ``checkpoint``: the loop's stalls for checkpoints (the save, and waits for an asynchronous write).
- ``rollback``: a rollback's reload and the steps it threw away.
- ``final_model``: writing checkpoint.save_final_model's transformers model.
- ``shutdown``: the end of the run after the loop (trackers, process group).

Across attempts (``summarise``): ``restart``, the time between one attempt's last record and the next one's
process start (the launcher's start, a killed attempt's unrecorded tail), and, from SLURM's records where the
run is a SLURM job, ``queue``: the requeued job waiting for its next allocation.

Rank 0 writes ``output_dir/goodput.json`` (atomically: every attempt's totals so far) at checkpoints, at the end,
and on logged steps at most every ``WRITE_EVERY_S`` seconds: a process killed with SIGKILL loses at most that much
accounting, which then shows as ``restart``. Memory: 13 bytes per optimizer step of the attempt (the per-step
record a rollback reclassifies).
"""

from __future__ import annotations

import json
import os
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

GOODPUT_FILE = "goodput.json"
WRITE_EVERY_S = 5.0

# the categories of one attempt, in the order a run meets them
ATTEMPT_CATEGORIES = ("startup", "data_build", "first_step", "productive", "lost", "skipped", "evaluation",
                      "checkpoint", "rollback", "final_model", "shutdown")
# and between attempts
RUN_CATEGORIES = (*ATTEMPT_CATEGORIES, "restart", "queue")
_STEP = "step"  # the pseudo-category of a step in flight: classified when it is done
_KINDS = ("first_step", "productive", "lost", "skipped")


def process_start_time() -> float:
    """When this process started (the OS's record, so imports count as start-up), as a Unix time."""
    try:
        import psutil  # accelerate's dependency
        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - no process table to read (a sandbox): from here on
        return time.time()


class Goodput:
    """The accounting of this attempt; ``previous``: the run's earlier attempts (``read_goodput``)."""

    def __init__(self, output_dir: str | Path | None, *, write: bool, started: float | None = None,
                 previous: list[dict[str, Any]] | None = None, clock=time.time):
        self.path = Path(output_dir) / GOODPUT_FILE if output_dir is not None else None
        self.write_enabled = write and self.path is not None
        self.clock = clock
        self.started = process_start_time() if started is None else started
        self.previous = list(previous or [])
        # the step the run had reached before this attempt: steps up to it are done again ("lost")
        self.high_water = max((int(a.get("step", 0)) for a in self.previous), default=0)
        self.seconds = dict.fromkeys(ATTEMPT_CATEGORIES, 0.0)
        self.current, self._since, self._pending = "startup", self.started, 0.0
        self.step = 0  # the step the model is at (written: the next attempt's high water)
        self._first_done = False
        self._written_at = 0.0
        # per step of this attempt, for a rollback to reclassify: the step, its seconds, its kind (_KINDS index)
        self._steps, self._step_s, self._step_kind = array("l"), array("d"), array("b")
        self.id = f"{int(self.started)}-{os.getpid()}"

    @classmethod
    def open(cls, output_dir: str | Path, *, write: bool, log, started: float | None = None) -> Goodput:
        """This attempt's accounting, after the earlier attempts in ``output_dir`` (read on rank 0, ``write``). A
        goodput.json that is not what a run writes is set aside (renamed, never deleted) and a new account starts."""
        previous: list[dict[str, Any]] = []
        if write:
            try:
                previous = read_goodput(output_dir)
            except ValueError as exc:
                path = Path(output_dir) / GOODPUT_FILE
                aside = path.with_name(f"{GOODPUT_FILE}.unreadable-{int(time.time())}")
                os.replace(path, aside)
                log(f"warning: goodput: {exc}; set aside as {aside.name}, the account starts again with this attempt")
        return cls(output_dir, write=write, previous=previous, started=started)

    # ---- the clock ----------------------------------------------------------------------------------------
    def _accrue(self) -> float:
        now = self.clock()
        elapsed = max(now - self._since, 0.0)
        if self.current == _STEP:
            self._pending += elapsed
        else:
            self.seconds[self.current] += elapsed
        self._since = now
        return now

    def switch(self, category: str) -> str:
        """From now on, time goes to ``category``; returns the one it went to until now."""
        if category != _STEP and category not in self.seconds:
            raise ValueError(f"unknown goodput category {category!r}")
        self._accrue()
        previous, self.current = self.current, category
        return previous

    @contextmanager
    def phase(self, category: str) -> Iterator[None]:
        previous = self.switch(category)
        try:
            yield
        finally:
            self.switch(previous)

    # ---- the loop ---------------------------------------------------------------------------------------------
    def loop_started(self, step: int) -> None:
        """The loop starts at ``step``: time goes to the step in flight from here."""
        self.step = step
        self.switch(_STEP)

    def step_done(self, step: int, kept: bool = True) -> None:
        """Optimizer step ``step`` is done (logged too): its time since the previous one is classified."""
        self._accrue()
        if not self._first_done:
            kind = "first_step"
            self._first_done = True
        elif not kept:
            kind = "skipped"
        elif step <= self.high_water:
            kind = "lost"
        else:
            kind = "productive"
        self.seconds[kind] += self._pending
        self._steps.append(step)
        self._step_s.append(self._pending)
        self._step_kind.append(_KINDS.index(kind))
        self._pending = 0.0
        self.step = step

    def rolled_back(self, to_step: int) -> None:
        """A rollback reloaded ``to_step``: the step in flight and the steps after ``to_step`` were thrown away."""
        self._accrue()
        self.seconds["rollback"] += self._pending
        self._pending = 0.0
        while self._steps and self._steps[-1] > to_step:
            self._steps.pop()
            seconds, kind = self._step_s.pop(), _KINDS[self._step_kind.pop()]
            if kind != "first_step":  # the compilation was paid, whatever the step's fate
                self.seconds[kind] -= seconds
                self.seconds["rollback"] += seconds
        self.step = to_step

    def loop_ended(self) -> None:
        """After the loop: what is left of the step in flight (its logging) is the last step's."""
        self._accrue()
        if self._pending:
            kind = _KINDS[self._step_kind[-1]] if self._step_kind else "productive"
            self.seconds[kind] += self._pending
            self._pending = 0.0
        if self.current == _STEP:
            self.current = "shutdown"

    # ---- records ----------------------------------------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """This attempt so far: its categories sum to ``wall_s`` (up to rounding)."""
        now = self._accrue()
        seconds = dict(self.seconds)
        if self._pending:  # a step in flight: not yet classified, counted as the kind it will most likely be
            seconds["productive" if self.step >= self.high_water else "lost"] += self._pending
        return {"id": self.id, "started": round(self.started, 3), "updated": round(now, 3), "step": self.step,
                "wall_s": round(now - self.started, 3), "seconds": {k: round(v, 3) for k, v in seconds.items()}}

    def attempts(self) -> list[dict[str, Any]]:
        return [*self.previous, self.record()]

    def write(self, force: bool = True) -> None:
        """Rewrite goodput.json (rank 0) with every attempt so far; unless ``force``, at most every WRITE_EVERY_S."""
        if not self.write_enabled:
            return
        now = self.clock()
        if not force and now - self._written_at < WRITE_EVERY_S:
            return
        self._written_at = now
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps({"attempts": self.attempts()}, indent=1) + "\n")
        os.replace(tmp, self.path)  # atomic: a reader sees the old file or the whole new one

    def metrics(self) -> dict[str, float]:
        """``goodput/*`` over the run so far (every attempt, and the time between them): seconds per category and
        ``goodput/fraction``, productive seconds over wall seconds."""
        totals = summarise(self.attempts())
        metrics = {f"goodput/{name}_s": round(value, 3) for name, value in totals["seconds"].items()}
        metrics["goodput/fraction"] = totals["goodput"]
        return metrics

    def summary(self) -> str:
        return summary_line(summarise(self.attempts()))


def summarise(attempts: list[dict[str, Any]], queue: list[tuple[float, float]] = ()) -> dict[str, Any]:
    """The run's wall time (first attempt's start to the last record) by category: every attempt's, ``restart``
    for the gaps between attempts and ``queue`` for the parts of those gaps inside one of ``queue``'s
    [start, end) intervals (a SLURM job waiting after its requeue). ``goodput``: productive / wall."""
    attempts = sorted(attempts, key=lambda a: a["started"])
    seconds = dict.fromkeys(RUN_CATEGORIES, 0.0)
    for attempt in attempts:
        for name, value in attempt["seconds"].items():
            seconds[name] = seconds.get(name, 0.0) + float(value)
    for before, after in zip(attempts, attempts[1:], strict=False):
        gap_start, gap_end = before["updated"], after["started"]
        gap = max(gap_end - gap_start, 0.0)
        waited = sum(max(min(end, gap_end) - max(start, gap_start), 0.0) for start, end in queue)
        seconds["queue"] += min(waited, gap)
        seconds["restart"] += gap - min(waited, gap)
    wall = (attempts[-1]["updated"] - attempts[0]["started"]) if attempts else 0.0
    return {"wall_s": wall, "attempts": len(attempts), "seconds": seconds,
            "goodput": seconds["productive"] / wall if wall > 0 else 0.0}


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def summary_line(totals: dict[str, Any]) -> str:
    """One line: goodput, wall time, attempts, and every category with time in it, largest first."""
    wall = totals["wall_s"]
    parts = [f"{name} {_hms(value)} ({value / wall:.1%})" for name, value in
             sorted(totals["seconds"].items(), key=lambda item: -item[1]) if wall > 0 and value >= 0.0005 * wall]
    attempts = totals["attempts"]
    return (f"goodput {totals['goodput']:.1%} of {_hms(wall)} wall over {attempts} attempt"
            f"{'s' if attempts != 1 else ''}: " + ", ".join(parts))


def read_goodput(run_dir: str | Path) -> list[dict[str, Any]]:
    """The attempts in ``<run_dir>/goodput.json`` ([] when there is none yet). A file that is not what a run
    writes raises ValueError naming the problem (the trainer sets it aside and starts a new account)."""
    path = Path(run_dir) / GOODPUT_FILE
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    attempts = data.get("attempts") if isinstance(data, dict) else None
    if not isinstance(attempts, list):
        raise ValueError(f"{path} has no list of attempts")
    for number, attempt in enumerate(attempts):
        problem = _attempt_problem(attempt)
        if problem:
            raise ValueError(f"{path}: attempt {number}: {problem}")
    return attempts


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) < 1e12


def _attempt_problem(attempt: Any) -> str | None:
    if not isinstance(attempt, dict):
        return "not an object"
    for key in ("started", "updated", "wall_s"):
        if not _number(attempt.get(key)):
            return f"{key} = {attempt.get(key)!r} is not a number"
    if not isinstance(attempt.get("step"), int) or attempt["step"] < 0:
        return f"step = {attempt.get('step')!r} is not a step"
    seconds = attempt.get("seconds")
    if not isinstance(seconds, dict) or not all(k in RUN_CATEGORIES and _number(v) and v >= 0
                                                for k, v in seconds.items()):
        return "seconds is not a mapping of goodput categories to seconds"
    return None
