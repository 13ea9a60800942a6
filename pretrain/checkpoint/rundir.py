"""The run directory, read: the one reader of what a run writes, for the trainer, slurm, sweep and plot.

What a run directory holds is described once, in docs/checkpoints.md ("The run directory"); the names
this module reads are the constants below.

One rule for ``metrics.jsonl``: a last line that is not complete JSON was cut off by a killed run and is
skipped; any other line that is not a JSON object with an integer ``step`` means the file is damaged.
A checkpoint is complete when its ``trainer_state.json`` reads; the newest is found through ``latest``,
else by the step recorded inside each (never by folder name).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pretrain.errors import ConfigError
from pretrain.trust import contained

METRICS_FILE = "metrics.jsonl"
RUN_CONFIG_FILE = "run_config.json"
CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"
ROLLBACKS_FILE = "rollbacks.jsonl"


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of ``<run_dir>/metrics.jsonl`` in file order ([] when the file does not exist yet)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                continue  # cut off mid-write by a killed run
            raise ConfigError(f"{path}:{number} is not JSON ({exc.msg}); the file is damaged") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ConfigError(f"{path}:{number}: expected a JSON object with an integer 'step'")
        records.append(record)
    return records


def read_run_config(run_dir: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / RUN_CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_rollbacks(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of ``<run_dir>/rollbacks.jsonl`` (stability.rollback), oldest first; [] when there is none.
    A torn last line (a run killed while appending) is skipped, as in metrics.jsonl."""
    path = Path(run_dir) / ROLLBACKS_FILE
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                continue
            raise ConfigError(f"{path}:{number} is not JSON ({exc.msg}); the file is damaged") from None
        records.append(record)
    return records


def read_state(checkpoint: str | Path) -> dict[str, Any] | None:
    """A checkpoint's trainer state, or None when the checkpoint is incomplete (or not one)."""
    try:
        return json.loads((Path(checkpoint) / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first, by the step recorded inside."""
    found = []
    directory = Path(run_dir) / CHECKPOINTS_DIR
    if directory.is_dir():
        for path in directory.iterdir():
            state = read_state(path) if path.is_dir() and not path.name.startswith(".") else None
            if state is not None:
                found.append((int(state["step"]), path))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint: the one ``latest`` names, else the highest recorded step."""
    directory = Path(run_dir) / CHECKPOINTS_DIR
    pointer = directory / LATEST_FILE
    if pointer.is_file():
        name = pointer.read_text().strip()
        path = contained(directory, name, str(pointer)) if name else directory
        if name and read_state(path) is not None:
            return path
    complete = complete_checkpoints(run_dir)
    return complete[-1][1] if complete else None
