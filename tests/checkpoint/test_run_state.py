"""The run's state registered once (pretrain/checkpoint/state.py): a stateful part a later feature adds is one
registration, and a resume and a rollback both give it back its state at the checkpoint they load."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.train.stability import LOSS_FACTORS_ENV
from pretrain.train.trainer import Trainer
from tests.fakes import CountingPart
from tests.helpers import OneThread, train_here
from tests.train.test_rollback import ARGS, SPIKE


class CountingTrainer(Trainer):
    def stateful_parts(self):
        self.counted = CountingPart()  # here: the optimizer steps its timeline trained
        return {**super().stateful_parts(), "counted": self.counted}  # the one registration

    def report(self, result):
        self.counted.count += 1  # what the part does: counts each step reported
        return super().report(result)


def _train(out: Path, factors: str, *extra: str) -> CountingTrainer:
    with pytest.MonkeyPatch.context() as patch, OneThread():
        patch.setenv(LOSS_FACTORS_ENV, factors)
        _, trainer, _ = train_here([*ARGS, *extra, f"output_dir={out}"], trainer_class=CountingTrainer)
    return trainer


def test_a_part_registered_once_comes_back_from_a_resume_and_from_a_rollback(tmp_path):
    """Unregistered, the count would restart at 0 after the resume (4 of the 12 steps) and go on counting the
    abandoned steps through the rollback (17); registered, each load gives back the checkpoint's count."""
    first = _train(tmp_path / "run", "", "train.max_steps=8")
    assert (first.step, first.counted.count) == (8, 8)
    resumed = _train(tmp_path / "run", "")  # ARGS' 12 steps, from the checkpoint of step 8
    assert resumed.resumed["step"] == 8
    assert (resumed.step, resumed.counted.count) == (12, 12)

    rolled = _train(tmp_path / "spiked", SPIKE)  # skips steps 7-9, rolls back to step 4, trains 5-12 again
    assert rolled.rollback.records and rolled.rollback.records[0]["to_step"] == 4
    assert (rolled.step, rolled.counted.count) == (12, 12)
