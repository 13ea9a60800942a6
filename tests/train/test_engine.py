"""The engine the loop asks for backward, clipping and the update (pretrain/train/engine.py), on one CPU process:
a skipped update leaves the weights and the schedule where they were, an applied one moves both, and the
gradient norm is the one before clipping."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate import Accelerator

from pretrain.recipe.config import StabilityConfig
from pretrain.train.engine import Engine, Objective
from pretrain.train.stability import SkipPolicy, StepGate


@pytest.fixture()
def engine():
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False)
    model = torch.nn.Linear(4, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    gate = StepGate(SkipPolicy(StabilityConfig()))
    return Engine.build(accelerator, model, optimizer, scheduler, gate, Objective(1, 1.0, grad_clip=1.0), fp16=False,
                        deepspeed_config=None)


def _backward(engine: Engine, loss_value: float) -> torch.Tensor:
    loss = engine.model(torch.ones(1, 4)).sum() * 0 + engine.model.weight.sum() * 3.0
    engine.gate.begin(torch.tensor(loss_value), 1)
    engine.backward(loss)
    return engine.clip_grad_norm(1.0)


def test_a_skipped_update_keeps_weights_and_schedule_and_an_applied_one_moves_both(engine):
    assert type(engine) is Engine  # no DeepSpeed config: the torch optimizer's update, through accelerate
    before = engine.model.weight.detach().clone()
    grad_norm = _backward(engine, math.nan)  # a non-finite loss: skip_nonfinite skips the update
    assert float(grad_norm) == pytest.approx(6.0)  # |(3, 3, 3, 3)|, before clipping to 1
    verdict = engine.judge(grad_norm)
    assert verdict.skip and verdict.rule == "stability.skip_nonfinite"
    engine.update(verdict)
    assert torch.equal(engine.model.weight, before)
    assert engine.scheduler.get_last_lr() == [0.1]
    assert engine.model.weight.grad is None  # dropped: the next step starts from zero

    grad_norm = _backward(engine, 1.0)
    engine.update(engine.judge(grad_norm))
    # clipped to norm 1: each of the four gradients is 3/6, and SGD at lr 0.1 moves each weight by 0.05
    assert torch.allclose(engine.model.weight, before - 0.05)
    assert engine.scheduler.get_last_lr() == [pytest.approx(0.05)]
    assert engine.metrics() == {}  # not fp16: no loss scale to log

