"""The run directory, read: the one reader of what a run writes, for the trainer, slurm, sweep, plot and the lookup.

What a run directory holds is described once, in docs/checkpoints.md ("The run directory"); the names
this module reads are the constants below.

One rule for ``metrics.jsonl``: a last line that is not complete JSON was cut off by a killed run and is
skipped; any other line that is not a JSON object with an integer ``step`` means the file is damaged.
The logs a run appends to grow with its steps (``metrics.jsonl``: ~2 KB a logged step, gigabytes at 1e6 steps), so
nothing here reads one whole into memory: ``iter_metrics`` streams it a line at a time (a plot, which needs every
point), and ``read_tail`` reads from the end in fixed blocks only the lines asked for (the last K, those after a
step: a resume's and a rollback's rewind, ``pretrain-slurm status``). Lines are in step order: every resume and
rollback drops the later steps before the run appends again (``tracking.JSONLTracker``).
A checkpoint is complete when its ``trainer_state.json`` reads; the newest is found through ``latest``,
else by the step recorded inside each (never by folder name).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.errors import ConfigError
from pretrain.trust import contained

if TYPE_CHECKING:
    from pretrain.data.lookup import RunRecord

METRICS_FILE = "metrics.jsonl"
RUN_CONFIG_FILE = "run_config.json"
RESOLVED_RECIPE_FILE = "recipe.resolved.yaml"
CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"
ROLLBACKS_FILE = "rollbacks.jsonl"
LAUNCHES_FILE = "launches.jsonl"


TAIL_BLOCK = 1 << 20  # bytes read at a time from a log's end: the reader's memory, whatever the file's size


def _damaged(path: Path, where: str, what: str) -> ConfigError:
    return ConfigError(f"{path}:{where} is not JSON ({what}); the file is damaged")


def _metrics_record(path: Path, where: str, record: Any) -> dict[str, Any]:
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise ConfigError(f"{path}:{where}: expected a JSON object with an integer 'step'")
    return record


def _not_utf8(path: Path, byte: int) -> ConfigError:
    return ConfigError(f"{path} is not UTF-8 text (byte {byte:,}): not a metrics file a run wrote, or damaged")


def iter_metrics(run_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Every record of ``<run_dir>/metrics.jsonl`` in file order, streamed: one line in memory at a time (nothing
    when the file does not exist yet)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return
    with open(path, "rb") as f:
        offset, torn = 0, None  # torn: a line that is not JSON, damage unless it is the last
        for number, raw in enumerate(f, start=1):
            if torn is not None:
                raise _damaged(path, str(torn[0]), torn[1])
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, offset + exc.start) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                torn = (number, exc.msg)  # the last line, cut off mid-write by a killed run, is skipped
                continue
            yield _metrics_record(path, str(number), record)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of ``<run_dir>/metrics.jsonl`` in file order ([] when the file does not exist yet). For a short
    run's file (a sweep's, a test's): a long run's is streamed (``iter_metrics``) or read from the end
    (``read_tail``)."""
    return list(iter_metrics(run_dir))


@dataclass(frozen=True)
class Tail:
    """What ``read_tail`` read from a JSON-lines file's end."""

    records: list[dict[str, Any]]  # oldest first
    offset: int  # the byte where the lines returned start: the file cut here keeps exactly the lines before them
    ends_line: bool  # whether the bytes before ``offset`` end with a newline (or are none)
    bytes_read: int  # what it cost


class _Counted:
    """A binary file's seek and read, counting the bytes read (``Tail.bytes_read``)."""

    def __init__(self, f):
        self.f, self.bytes_read = f, 0

    def seek(self, offset: int) -> None:
        self.f.seek(offset)

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        self.bytes_read += len(data)
        return data


def _lines_from_end(f, size: int, block: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line without its newline) of each line of ``f[:size]``, the last first, read backwards ``block`` bytes
    at a time: memory is one block and the longest line, time the lines yielded (not the file)."""
    end, carry = size, b""  # carry: the start of a line whose beginning is in a block not read yet
    while end > 0:
        start = max(end - block, 0)
        f.seek(start)
        data = f.read(end - start) + carry
        lines = data.split(b"\n")
        carry = lines[0]  # may begin before ``start``
        position = start + len(data)
        for line in reversed(lines[1:]):
            position -= len(line)
            yield position, line
            position -= 1  # its newline
        end = start
    yield 0, carry


def read_tail(path: str | Path, *, last: int | None = None, after_step: int | None = None,
              select: Callable[[dict[str, Any]], bool] | None = None, metrics: bool = True,
              block: int | None = None) -> Tail:
    """Records of a JSON-lines file a run appends to, read from its end (the run directory's one way to read a long
    log): the last ``last`` records (those ``select`` keeps, when given), and/or every record after step
    ``after_step`` (lines are in step order: reading stops at the first, from the end, at or before it). The rules of
    ``read_metrics``: blank lines are skipped, a last line that is not complete JSON (a killed run's) is not a record,
    any other line that is not JSON is damage; with ``metrics`` every record must have an integer ``step``. Reads
    ``block`` bytes (default ``TAIL_BLOCK``) at a time: memory is bounded by the block (and the longest line), time by the lines read."""
    path = Path(path)
    if last is None and after_step is None:
        raise ValueError("read_tail: give last or after_step (a whole file is read by streaming it)")
    if after_step is not None and not metrics:
        raise ValueError("read_tail: after_step reads records with a step (metrics=True)")
    if (last is not None and last <= 0) or not path.is_file():
        size = path.stat().st_size if path.is_file() else 0
        return Tail([], size, True, 0)

    block = block or TAIL_BLOCK
    with open(path, "rb") as raw:
        size = os.fstat(raw.fileno()).st_size
        f = _Counted(raw)
        records: list[dict[str, Any]] = []
        offset, newest = size, True  # newest: no complete line seen yet from the end (the torn line's place)
        for start, line in _lines_from_end(f, size, block):
            if not line.strip():
                continue
            end_of_line = start + len(line)
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as exc:
                if newest:
                    newest = False
                    offset = start
                    continue  # a torn last line, as below (a crash can leave any bytes in a file's last block)
                raise _not_utf8(path, start + exc.start) from None
            except json.JSONDecodeError as exc:
                if newest:
                    newest = False
                    offset = start  # cut off mid-write by a killed run: never a record, dropped with what follows
                    continue
                raise _damaged(path, f"byte {start:,}", exc.msg) from None
            newest = False
            if metrics:
                _metrics_record(path, f"byte {start:,}", record)
            if after_step is not None and record["step"] <= after_step:
                # the first record to keep: the cut goes right after its line (its newline, if it has one)
                offset = min(end_of_line + 1, size)
                break
            if select is None or select(record):
                records.append(record)
            offset = start
            if last is not None and len(records) >= last:
                break
        else:
            offset = 0 if after_step is not None else offset  # every line read: nothing before them is kept
        ends_line = True
        if offset > 0:
            raw.seek(offset - 1)
            ends_line = raw.read(1) == b"\n"
    records.reverse()
    return Tail(records, offset, ends_line, f.bytes_read)


def metrics_tail(run_dir: str | Path, *, last: int | None = None, after_step: int | None = None,
                 select: Callable[[dict[str, Any]], bool] | None = None) -> Tail:
    """``read_tail`` of ``<run_dir>/metrics.jsonl``."""
    return read_tail(Path(run_dir) / METRICS_FILE, last=last, after_step=after_step, select=select)


def read_run_config(run_dir: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / RUN_CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_appended(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file a run appends to a line per event (a launch, a rollback, a submission), oldest
    first; [] when there is none. A torn last line (a run killed while appending) is skipped, as in metrics.jsonl. For
    the logs of few lines: one that grows with the steps is read from its end (``read_tail``)."""
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
                continue
            raise ConfigError(f"{path}:{number} is not JSON ({exc.msg}); the file is damaged") from None
        records.append(record)
    return records


def read_rollbacks(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of ``<run_dir>/rollbacks.jsonl`` (stability.rollback), oldest first, each checked to be what a
    rollback writes: the loop applies its batches (skipped), lr factor and window, so a record edited or damaged into
    anything else (a string for a number, a factor of 1e9, a window of every batch) is one ConfigError naming the line,
    not a traceback or a run that trains on other data."""
    path = Path(run_dir) / ROLLBACKS_FILE
    records = read_appended(path)
    for number, record in enumerate(records, start=1):
        problem = _rollback_problem(record)
        if problem:
            raise ConfigError(f"{path}:{number}: {problem}, which stability.rollback never writes: the file was edited "
                              "or damaged. Restore it from a copy, or delete that line to drop the rollback it records "
                              "(its skipped batches are then trained)")
    return records


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rollback_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return f"a {type(record).__name__}, not a rollback record"
    for key in ("batches", "lr_schedule_steps"):  # what the loop applies (skipped_steps is for people)
        pair = record.get(key)
        if not (isinstance(pair, list) and len(pair) == 2 and all(_is_int(v) and v >= 0 for v in pair)
                and pair[0] <= pair[1]):
            return f"{key} = {pair!r} is not a range [first, last] of steps or batches"
    if not _is_int(record.get("to_step")) or record["to_step"] < 0:
        return f"to_step = {record.get('to_step')!r} is not a step"
    positions = record.get("positions")
    if positions is not None and not (isinstance(positions, list) and len(positions) == 2
                                      and all(_is_int(v) and v >= 0 for v in positions) and positions[0] <= positions[1]):
        return f"positions = {positions!r} is not a range [start, stop) of the order's stream"
    quarantine = record.get("quarantine")
    if quarantine is not None and not (
            isinstance(quarantine, dict) and _is_int(quarantine.get("from")) and quarantine["from"] >= 0
            and isinstance(quarantine.get("samples"), list)
            and all(_is_int(v) and v >= 0 for v in quarantine["samples"])):
        return "quarantine is not {from: a position, samples: [sample indices]}"
    factor = record.get("lr_factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
        return f"lr_factor = {factor!r} is not in (0, 1]"
    saved_at = record.get("checkpoint_saved_at")
    if saved_at is not None and (not isinstance(saved_at, (int, float)) or isinstance(saved_at, bool)):
        return f"checkpoint_saved_at = {saved_at!r} is not a time"
    return None


def read_launches(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of ``<run_dir>/launches.jsonl``, oldest first: each start of the run, the step it started from
    (``from_step``) and its batch plan and layout. Step s was run by the last launch with from_step < s."""
    return read_appended(Path(run_dir) / LAUNCHES_FILE)


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One JSON line appended and made durable before the caller goes on (a killed run loses no record)."""
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")
        out.flush()
        os.fsync(out.fileno())


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
            # pretrain writes real directories here: a symbolic link is someone else's (never counted, pruned or
            # moved: the run does not delete through it what it does not own)
            state = (read_state(path) if path.is_dir() and not path.is_symlink() and not path.name.startswith(".")
                     else None)
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
        if name and not path.is_symlink() and read_state(path) is not None:
            return path
    complete = complete_checkpoints(run_dir)
    return complete[-1][1] if complete else None


def saved_rollbacks(state: dict[str, Any]) -> dict[str, Any]:
    """A trainer state's rollback part: ``components.rollback``, or what a checkpoint of an earlier version kept at its
    top (``rollbacks``, its ``saved_at`` naming that save)."""
    components = state.get("components")
    if components is not None:
        return components.get("rollback") or {"records": [], "saved_at": None}
    return {"records": state.get("rollbacks") or [], "saved_at": state.get("saved_at")}


def timeline_rollbacks(saved: dict[str, Any] | None, logged: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rollbacks of the timeline a checkpoint continues: those it holds (``saved``, its rollback part), then those
    of ``logged`` (rollbacks.jsonl's) made to that very save after it was written. Rollbacks to other checkpoints, or
    to an earlier save of the same step, belong to another timeline (a resume from an older checkpoint abandons
    them)."""
    saved = saved or {"records": [], "saved_at": None}
    after = [r for r in logged if r.get("checkpoint_saved_at") == saved["saved_at"]]
    return [*saved["records"], *after]


def run_rollbacks(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rollbacks of a run directory's timeline, as a resume would restore them (``pretrain-data which``'s); led,
    when the run resolved a data.exclude, by ``{"excluded": its resolution}`` (the rows it left out from step 0:
    ``loader.removals_of`` reads both)."""
    newest = latest_checkpoint(run_dir)
    state = read_state(newest) if newest is not None else None
    if state is None:
        return []
    saved = saved_rollbacks(state)
    excluded = [{"excluded": saved["excluded"]}] if saved.get("excluded") else []
    return [*excluded, *timeline_rollbacks(saved, read_rollbacks(run_dir))]


def read_run(run_dir: str | Path) -> RunRecord:
    """What a run directory records of the data its steps read (``pretrain-data which``): the resolved recipe,
    run_config.json, the plan of every checkpoint left, the newest checkpoint's data identity, the rollbacks of its
    timeline and the launches that ran it. One ConfigError when it is not a run directory."""
    from pretrain.data.lookup import RunRecord
    from pretrain.recipe.config import load_recipe

    run_dir = Path(run_dir)
    fix = ("pass --run the output_dir of a run (it holds run_config.json and recipe.resolved.yaml, written when "
           "the run starts)")
    if not run_dir.is_dir():
        raise ConfigError(f"no run directory at {run_dir}; {fix}")
    config = read_run_config(run_dir)
    if config is None or not (run_dir / RESOLVED_RECIPE_FILE).is_file():
        missing = RUN_CONFIG_FILE if config is None else RESOLVED_RECIPE_FILE
        raise ConfigError(f"{run_dir} is not a run directory: no readable {missing}; {fix}")
    plans = [(read_state(path) or {}).get("plan") or {} for _, path in complete_checkpoints(run_dir)]
    newest = latest_checkpoint(run_dir)
    trained_on = (read_state(newest) or {}).get("data") if newest is not None else None
    return RunRecord(run_dir, run_dir / RUN_CONFIG_FILE, load_recipe(run_dir / RESOLVED_RECIPE_FILE), config, plans,
                     (newest.name, trained_on) if trained_on else None, run_rollbacks(run_dir), read_launches(run_dir))
