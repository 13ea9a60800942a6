"""Goodput (pretrain/train/goodput.py): every second of an attempt in one category, on a clock the test moves."""

from __future__ import annotations

import json

import pytest

from pretrain.train.goodput import GOODPUT_FILE, Goodput, read_goodput, summarise, summary_line


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def _attempt(clock: Clock, previous=None, out=None) -> Goodput:
    return Goodput(out, write=out is not None, started=clock.now, previous=previous, clock=clock)


def _run_steps(goodput: Goodput, clock: Clock, steps, seconds: float = 1.0, kept: bool = True) -> None:
    for step in steps:
        clock.tick(seconds)
        goodput.step_done(step, kept=kept)


def test_every_second_of_an_attempt_is_in_one_category():
    clock = Clock()
    g = _attempt(clock)
    clock.tick(7)  # imports, process group, model
    with g.phase("data_build"):
        clock.tick(3)
    clock.tick(1)  # the resume load: start-up again
    with g.phase("evaluation"):  # the step-0 evaluation
        clock.tick(2)
    g.loop_started(0)
    _run_steps(g, clock, [1], seconds=5)  # the compile
    _run_steps(g, clock, range(2, 11))
    with g.phase("checkpoint"):
        clock.tick(0.5)
    _run_steps(g, clock, [11], kept=False)  # a skipped update
    clock.tick(0.25)  # the last step's logging, after it was counted
    g.loop_ended()
    with g.phase("final_model"):
        clock.tick(4)
    g.switch("shutdown")
    clock.tick(0.25)
    record = g.record()
    assert record["seconds"] == {"startup": 8.0, "data_build": 3.0, "first_step": 5.0, "productive": 9.0, "lost": 0.0,
                                 "skipped": 1.25, "evaluation": 2.0, "checkpoint": 0.5, "rollback": 0.0,
                                 "final_model": 4.0, "shutdown": 0.25}
    assert record["wall_s"] == sum(record["seconds"].values()) == 33.0
    assert record["step"] == 11


def test_a_rollback_moves_the_steps_it_threw_away_and_its_reload_into_rollback():
    clock = Clock()
    g = _attempt(clock)
    g.loop_started(0)
    _run_steps(g, clock, range(1, 7))  # step 1: first_step; 2-6 productive
    _run_steps(g, clock, [7, 8], kept=False)  # skipped updates
    clock.tick(1)  # step 9, the streak's last: raises before it is counted
    with g.phase("rollback"):
        clock.tick(3)  # the reload of step 4's checkpoint
    g.rolled_back(4)
    _run_steps(g, clock, range(5, 8))  # the redone steps are kept
    g.loop_ended()
    seconds = g.record()["seconds"]
    # thrown away: steps 5-6 (productive), 7-8 (skipped), 9 (in flight), and the reload; step 1's compile stays
    assert seconds["rollback"] == 5 + 3 and seconds["skipped"] == 0 and seconds["first_step"] == 1
    assert seconds["productive"] == 3 + 3  # steps 2-4, and 5-7 again
    assert g.record()["step"] == 7


def test_steps_done_again_after_a_restart_are_lost_and_the_gap_is_restart_or_queue():
    clock = Clock()
    first = _attempt(clock)
    first.loop_started(0)
    _run_steps(first, clock, range(1, 13))  # reached step 12, its last checkpoint at 8, then killed
    before = first.record()
    clock.tick(30)  # 10 s of a killed tail and a relaunch, 20 s waiting for SLURM
    second = _attempt(clock, previous=[before])
    assert second.high_water == 12
    second.loop_started(8)
    _run_steps(second, clock, range(9, 16))  # 9: first_step; 10-12 lost; 13-15 productive
    second.loop_ended()
    assert second.record()["seconds"]["lost"] == 3 and second.record()["seconds"]["productive"] == 3
    queue = [(before["updated"] + 5, before["updated"] + 25)]
    totals = summarise(second.attempts(), queue=queue)
    assert totals["seconds"]["queue"] == 20 and totals["seconds"]["restart"] == 10
    assert totals["wall_s"] == 12 + 30 + 7 == sum(totals["seconds"].values())
    assert totals["goodput"] == pytest.approx((11 + 3) / 49)
    line = summary_line(totals)
    assert line.startswith("goodput 28.6% of 0:00:49 wall over 2 attempts: queue 0:00:20 (40.8%), productive")
    assert "lost 0:00:03 (6.1%)" in line and "evaluation" not in line  # categories with no time are left out


def test_the_record_is_rewritten_atomically_with_every_attempt_and_read_back(tmp_path):
    clock = Clock()
    g = _attempt(clock, out=tmp_path)
    g.loop_started(0)
    _run_steps(g, clock, range(1, 4))
    g.write()
    [attempt] = read_goodput(tmp_path)
    assert attempt["step"] == 3 and attempt["wall_s"] == 3
    clock.tick(1)
    g.write(force=False)  # within WRITE_EVERY_S of the last write: not rewritten
    assert read_goodput(tmp_path) == [attempt]
    later = _attempt(clock, previous=read_goodput(tmp_path), out=tmp_path)
    later.write()
    assert [a["id"] for a in read_goodput(tmp_path)] == [g.id, later.id]
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize(("text", "named"), [
    ("not json", "is not JSON"),
    ('{"attempts": 3}', "has no list of attempts"),
    ('{"attempts": [{"started": 1, "updated": 2, "wall_s": 1, "step": -4, "seconds": {}}]}', "step = -4"),
    ('{"attempts": [{"started": 1, "updated": 2, "wall_s": 1, "step": 4, "seconds": {"naps": 3}}]}', "seconds is not"),
])
def test_a_goodput_file_that_is_not_a_runs_is_set_aside_and_the_account_starts_again(tmp_path, text, named):
    (tmp_path / GOODPUT_FILE).write_text(text)
    with pytest.raises(ValueError, match=named):
        read_goodput(tmp_path)
    logged = []
    g = Goodput.open(tmp_path, write=True, log=logged.append)
    assert g.previous == [] and g.high_water == 0
    [aside] = tmp_path.glob(f"{GOODPUT_FILE}.unreadable-*")
    assert aside.read_text() == text  # kept as it was, for a person to look at
    assert named in logged[0] and "set aside" in logged[0]
    g.write()
    assert json.loads((tmp_path / GOODPUT_FILE).read_text())["attempts"][0]["id"] == g.id
