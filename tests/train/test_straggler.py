"""runtime.straggler (pretrain/train/straggler.py): a rank persistently slower than the others is named, recorded
and, under SLURM with action=exclude, its host left out of the next job."""

from __future__ import annotations

import json

import pytest

from pretrain.distributed.sbatch import EXCLUDE_REQUEST, EXCLUDED_HOSTS, SLURM_SUBDIR
from pretrain.recipe.config import StragglerConfig
from pretrain.train.straggler import STRAGGLERS_FILE, StragglerWatch, slow_seconds

HOSTS = ["a", "a", "b", "b"]


def _watch(tmp_path, action="warn", under_slurm=True, **cfg):
    logged: list[str] = []
    watch = StragglerWatch(StragglerConfig(action=action, **cfg), HOSTS, tmp_path, is_main=True, log=logged.append,
                           under_slurm=under_slurm)
    return watch, logged


def _records(tmp_path) -> list[dict]:
    path = tmp_path / STRAGGLERS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_host_slow_for_window_logged_steps_in_a_row_is_named_once(tmp_path):
    watch, logged = _watch(tmp_path, factor=1.5, window=3)
    assert watch.observe(10, [1.0, 1.1, 1.0, 1.05]) is None  # spread, not a straggler
    assert watch.observe(20, [1.0, 1.0, 1.6, 1.0]).in_a_row == 1  # rank 2 (host b) 1.6x the others' median
    assert watch.observe(30, [1.0, 1.0, 1.0, 2.0]).in_a_row == 2  # rank 3: the same host, so the streak goes on
    assert logged == []
    slow = watch.observe(40, [1.0, 1.0, 1.7, 1.0])
    assert (slow.rank, slow.host, slow.ratio, slow.in_a_row) == (2, "b", 1.7, 3)
    [line] = logged
    assert line.startswith("warning: straggler: rank 2 on host b took 1.7 s for its part of step 40, 1.70x the other "
                           "ranks' median 1 s, 3 logged steps in a row at >= 1.5x")
    watch.observe(50, [1.0, 1.0, 1.8, 1.0])  # no worse than 1.25x the ratio warned of: not said again
    assert len(logged) == 1 and watch.excluded is None  # warn does not stop the run
    assert [r["step"] for r in _records(tmp_path)] == [20, 30, 40, 50]
    assert _records(tmp_path)[2] == {**_records(tmp_path)[2], "rank": 2, "host": "b", "seconds": 1.7,
                                     "others_median_s": 1.0, "in_a_row": 3, "factor": 1.5, "window": 3}


def test_the_streak_breaks_on_a_normal_step_or_another_host(tmp_path):
    watch, logged = _watch(tmp_path, window=2)
    watch.observe(1, [3.0, 1.0, 1.0, 1.0])  # host a
    watch.observe(2, [1.0, 1.0, 1.0, 1.0])  # normal: the streak is over
    assert watch.observe(3, [3.0, 1.0, 1.0, 1.0]).in_a_row == 1
    assert watch.observe(4, [1.0, 1.0, 3.0, 1.0]).in_a_row == 1  # host b now
    assert logged == []


def test_exclude_under_slurm_writes_the_host_and_the_request_and_stops(tmp_path):
    watch, logged = _watch(tmp_path, action="exclude", window=2)
    (tmp_path / SLURM_SUBDIR).mkdir()
    (tmp_path / SLURM_SUBDIR / EXCLUDED_HOSTS).write_text("c\n")  # a node the doctor excluded before
    watch.observe(5, [1.0, 1.0, 1.0, 4.0])
    assert watch.excluded is None
    watch.observe(10, [1.0, 1.0, 1.0, 4.0])
    assert watch.excluded is not None and watch.excluded.host == "b"
    assert (tmp_path / SLURM_SUBDIR / EXCLUDED_HOSTS).read_text() == "c\nb\n"
    request = json.loads((tmp_path / SLURM_SUBDIR / EXCLUDE_REQUEST).read_text())
    assert request["host"] == "b" and request["step"] == 10
    assert "stopping after this step with a checkpoint, b added to slurm/excluded_hosts" in logged[0]


def test_exclude_outside_slurm_warns_and_says_so_at_the_start(tmp_path):
    watch, logged = _watch(tmp_path, action="exclude", under_slurm=False, window=1)
    assert "not a SLURM job" in logged[0]
    watch.observe(5, [1.0, 9.0, 1.0, 1.0])
    assert watch.excluded is None and logged[1].startswith("warning: straggler: rank 1 on host a")
    assert not (tmp_path / SLURM_SUBDIR).exists()


def test_off_and_one_rank_never_judge(tmp_path):
    watch, _ = _watch(tmp_path, action="off", window=1)
    assert watch.observe(1, [1.0, 9.0, 1.0, 1.0]) is None
    lone = StragglerWatch(StragglerConfig(window=1), ["a"], tmp_path, is_main=True, log=print, under_slurm=False)
    assert lone.observe(1, [5.0]) is None and not _records(tmp_path)


@pytest.mark.parametrize(("value", "rank", "host", "expected"), [
    ("1:0.25", 1, "n1", 0.25), ("1:0.25", 0, "n1", 0.0), ("1:0.25:n1", 1, "n1", 0.25), ("1:0.25:n1", 1, "n2", 0.0),
])
def test_the_slow_rank_hook(value, rank, host, expected):
    assert slow_seconds(rank, host, {"PRETRAIN_TEST_SLOW": value}) == expected


def test_milliseconds_of_timer_noise_are_no_straggler_whatever_the_ratio(tmp_path):
    """A tiny model's steps take milliseconds: 1.6x there is 5 ms (measured on 2 CPU processes: a rank at 0.0128 s
    against 0.008 s), not a host worth excluding."""
    watch, logged = _watch(tmp_path, action="exclude", window=1)
    assert watch.observe(22, [0.008, 0.0128, 0.008, 0.008]) is None
    assert watch.excluded is None and not _records(tmp_path)
    assert watch.observe(24, [0.008, 0.31, 0.008, 0.008]).ratio == pytest.approx(38.75)  # 0.3 s more: it is one
