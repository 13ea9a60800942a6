"""metrics.jsonl rewound in place from its end (issue 50): a resume's and a rollback's rewind keeps exactly the lines
of steps <= N, drops a torn last line, and reads a bounded number of bytes whatever the lines kept; the run
directory's readers read the end of a log (``rundir.read_tail``) or stream it (``rundir.iter_metrics``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pretrain.checkpoint import rundir
from pretrain.errors import ConfigError
from pretrain.train.tracking import JSONLTracker


def rewrite_reference(path: Path, step: int) -> str:
    """What the rewind wrote before issue 50 (the file read whole, json.dumps of every record at or before step)."""
    lines = path.read_text().splitlines()
    kept = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue
            raise
        if record["step"] <= step:
            kept.append(record)
    return "".join(json.dumps(r) + "\n" for r in kept)


def write_lines(path: Path, steps: int, torn: bool = False, pad: int = 0) -> None:
    """A run's metrics.jsonl (as JSONLTracker.log writes it), with a validation line every 50 steps, fast; ``pad``
    more bytes a line."""
    extra = {f"perf/key_{i}": 0.123456789 for i in range(pad // 28)}
    with open(path, "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, "train/loss": 3.0 - step * 1e-5, "train/lr": 3e-4,
                                "perf/tokens_per_s": 1234.5, **extra, "time": 1.7e9 + step}) + "\n")
            if step % 50 == 0:
                f.write(json.dumps({"step": step, "val/loss": 2.5, "time": 1.7e9 + step}) + "\n")
        if torn:
            f.write(f'{{"step": {steps + 1}, "train/loss": 2.9')  # a killed run's half line


class CountingOpen:
    """rundir's ``open``, counting the bytes read through every file it opens."""

    def __init__(self):
        self.bytes_read = 0

    def __call__(self, *args, **kwargs):
        f = open(*args, **kwargs)  # noqa: SIM115 - handed back to the caller, who closes it
        counter, read = self, f.read

        def counted(*a):
            data = read(*a)
            counter.bytes_read += len(data)
            return data

        f.read = counted
        return f


@pytest.fixture
def counting(monkeypatch):
    opener = CountingOpen()
    monkeypatch.setattr(rundir, "open", opener, raising=False)
    return opener


@pytest.mark.parametrize("steps", [20_000, 40_000])
def test_a_rewind_keeps_the_steps_up_to_n_drops_a_torn_line_and_reads_only_the_end(tmp_path, counting, steps):
    path = tmp_path / rundir.METRICS_FILE
    write_lines(path, steps, torn=True, pad=400)  # 10 MB at 20,000 lines
    size = path.stat().st_size
    keep = steps - 100
    expected = rewrite_reference(path, keep)

    tracker = JSONLTracker(tmp_path, resume_step=keep)
    tracker.start()  # a resume: rewinds to resume_step
    tracker.finish()

    assert path.read_text() == expected  # byte-identical to the former rewrite
    records = rundir.read_metrics(tmp_path)
    assert {r["step"] for r in records} == set(range(1, keep + 1)) and records[-1]["step"] == keep
    dropped = size - len(expected)
    # what was read: the dropped lines, the kept line the search stops at and at most one block's slack, not the
    # kept 19,900 (or 39,900) lines: the same bound at both sizes
    assert dropped < counting.bytes_read <= dropped + rundir.TAIL_BLOCK + 1
    assert counting.bytes_read < size / 8


def test_the_bytes_a_rewind_reads_do_not_grow_with_the_lines_kept(tmp_path, counting, monkeypatch):
    monkeypatch.setattr(rundir, "TAIL_BLOCK", 4096)
    read = {}
    for steps in (2_000, 20_000):
        directory = tmp_path / str(steps)
        directory.mkdir()
        write_lines(directory / rundir.METRICS_FILE, steps)
        counting.bytes_read = 0
        JSONLTracker(directory)._keep_until(steps - 100)
        read[steps] = counting.bytes_read
        assert [r["step"] for r in rundir.read_metrics(directory)][-1] == steps - 100
    assert read[2_000] == read[20_000] <= 4 * 4096 + 1  # 102 lines of ~120 bytes: four blocks of 4 KiB


def test_a_rollback_rewinds_the_open_file_and_appends_after_the_cut(tmp_path):
    tracker = JSONLTracker(tmp_path)
    tracker.start()
    for step in range(1, 11):
        tracker.log({"train/loss": 1.0 / step}, step=step)
    tracker.rewind(4)
    tracker.log({"train/loss": 0.5}, step=5)
    tracker.finish()
    records = rundir.read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and records[-1]["train/loss"] == 0.5


def test_a_fresh_start_empties_the_file_without_reading_it(tmp_path, counting):
    write_lines(tmp_path / rundir.METRICS_FILE, 1_000)
    JSONLTracker(tmp_path, resume_step=None).start()
    assert (tmp_path / rundir.METRICS_FILE).read_text() == "" and counting.bytes_read == 0


@pytest.mark.parametrize("seed", range(2))
def test_the_rewind_is_the_former_rewrite_on_every_shape_of_file(tmp_path, seed):
    """Random files a run can leave (steps repeated by evaluations, a torn last line, a kept last line without its
    newline, blank lines, nothing at all) and every step to rewind to, read in blocks of 1 to 64 bytes."""
    rng = random.Random(seed)
    path = tmp_path / rundir.METRICS_FILE
    for _ in range(80):
        step, lines = 0, []
        for _ in range(rng.randint(0, 25)):
            step += rng.choice([0, 1, 1, 2])
            lines.append(json.dumps({"step": step, "train/loss": rng.random(), "pad": "x" * rng.randint(0, 40)}))
        text = "\n".join(lines)
        ending = rng.random()
        if ending < 0.4 and text:
            text += "\n"
        elif ending < 0.6:
            text += ("\n" if text else "") + '{"step": 99, "train/lo'
        elif ending < 0.7 and text:
            text += "\n\n"
        for keep in range(-1, step + 2):
            path.write_text(text)
            expected = rewrite_reference(path, keep)
            for block in (1, 7, 64):
                tail = rundir.read_tail(path, after_step=keep, block=block)
                assert [r["step"] for r in tail.records] == [json.loads(x)["step"] for x in lines
                                                             if json.loads(x)["step"] > keep]
            JSONLTracker(tmp_path)._keep_until(keep)
            assert path.read_text() == expected, (text, keep)


def test_damage_in_the_lines_a_rewind_reads_is_one_message(tmp_path):
    path = tmp_path / rundir.METRICS_FILE
    path.write_text('{"step": 1}\n{"step": 2}\nnot json\n{"step": 3}\n')
    with pytest.raises(ConfigError, match="is not JSON .* the file is damaged"):
        JSONLTracker(tmp_path)._keep_until(1)
    path.write_text('{"step": 1}\n["a list"]\n{"step": 3}\n')
    with pytest.raises(ConfigError, match="expected a JSON object with an integer 'step'"):
        JSONLTracker(tmp_path)._keep_until(1)
    assert path.read_text() == '{"step": 1}\n["a list"]\n{"step": 3}\n'  # refused: nothing dropped


def test_read_tail_gives_the_last_records_a_reader_asks_for(tmp_path, counting):
    path = tmp_path / rundir.METRICS_FILE
    write_lines(path, 20_000, torn=True)
    counting.bytes_read = 0
    tail = rundir.read_tail(path, last=3, select=lambda r: "train/loss" in r, block=4096)
    assert [r["step"] for r in tail.records] == [19_998, 19_999, 20_000] and counting.bytes_read <= 4096 + 1
    assert [r["step"] for r in rundir.read_tail(path, last=2, block=4096).records] == [20_000, 20_000]  # val line
    assert rundir.read_tail(tmp_path / "missing.jsonl", last=5).records == []


def test_iter_metrics_streams_with_the_rules_of_read_metrics(tmp_path):
    path = tmp_path / rundir.METRICS_FILE
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "tr')
    assert [r["step"] for r in rundir.iter_metrics(tmp_path)] == [1, 2]
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2 is not JSON"):
        list(rundir.iter_metrics(tmp_path))
    path.write_bytes(b'{"step": 1}\n\xff\n')
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 12\)"):
        list(rundir.iter_metrics(tmp_path))
    assert list(rundir.iter_metrics(tmp_path / "nothing")) == []
