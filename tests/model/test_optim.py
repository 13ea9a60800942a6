"""Optimizer groups, argument checks and the LR schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pretrain.errors import ConfigError
from pretrain.model.optim import (
    build_optimizer,
    build_scheduler,
    check_optimizer_args,
    implementation_args,
    param_groups,
    scaled_lr,
)
from pretrain.recipe.config import LRScheduleConfig, OptimConfig


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


def test_norms_and_biases_never_decay_embeddings_configurable():
    model = Tiny()
    decay, no_decay = param_groups(model, OptimConfig(weight_decay=0.1))
    assert {id(p) for p in decay["params"]} == {id(model.embed.weight), id(model.proj.weight)}
    assert no_decay["weight_decay"] == 0.0
    decay, no_decay = param_groups(model, OptimConfig(weight_decay=0.1, decay_embeddings=False))
    assert {id(p) for p in decay["params"]} == {id(model.proj.weight)}
    assert id(model.embed.weight) in {id(p) for p in no_decay["params"]}


def test_parameters_partitioned_by_zero3_are_grouped_by_their_real_shape():
    """Under ZeRO-3's zero.Init every parameter is an empty 1-D placeholder (its shape in ``ds_shape``): grouped
    by ``.ndim`` every matrix would train without weight decay, as ZeRO-3 runs did before this was fixed."""
    model = Tiny()
    for param in model.parameters():
        param.ds_shape = param.shape
        param.data = torch.empty(0)
    decay, no_decay = param_groups(model, OptimConfig(weight_decay=0.1))
    assert {id(p) for p in decay["params"]} == {id(model.embed.weight), id(model.proj.weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model.proj.bias), id(model.norm.weight), id(model.norm.bias)}


def test_optimizer_by_name_with_passthrough_args():
    opt = build_optimizer(Tiny(), OptimConfig(name="AdamW", lr=1e-3, args={"betas": [0.9, 0.95]}), lr=1e-3)
    assert isinstance(opt, torch.optim.AdamW)
    assert tuple(opt.param_groups[0]["betas"]) == (0.9, 0.95)
    opt = build_optimizer(Tiny(), OptimConfig(name="SGD", args={"momentum": 0.9}), lr=0.1)
    assert isinstance(opt, torch.optim.SGD)


def test_unknown_optimizer_and_argument_are_errors():
    with pytest.raises(ConfigError, match="optim.name = 'AdamX' is not a torch.optim optimizer; use one of: .*AdamW"):
        check_optimizer_args(OptimConfig(name="AdamX"))
    with pytest.raises(ConfigError, match=r"optim.args has \['beta'\] which torch.optim.AdamW does not accept"):
        check_optimizer_args(OptimConfig(args={"beta": 0.9}))


def test_lr_scaling_rules():
    assert scaled_lr(OptimConfig(lr=1e-3), 512) == 1e-3
    cfg = OptimConfig(lr=1e-3, lr_scaling="linear", reference_global_batch_size=256)
    assert scaled_lr(cfg, 512) == pytest.approx(2e-3)
    cfg = OptimConfig(lr=1e-3, lr_scaling="sqrt", reference_global_batch_size=256)
    assert scaled_lr(cfg, 1024) == pytest.approx(2e-3)


def _lrs(cfg: LRScheduleConfig, steps: int, lr: float = 1.0) -> list[float]:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    sched = build_scheduler(opt, cfg, steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_cosine_warms_up_then_decays_to_min_ratio():
    lrs = _lrs(LRScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1), 110)
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(0.5)
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), rel=1e-6)
    assert min(lrs[10:]) >= 0.1 - 1e-9 and lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_wsd_is_flat_then_decays_over_the_last_fraction():
    lrs = _lrs(LRScheduleConfig(name="wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.0), 100)
    assert lrs[10:80] == pytest.approx([1.0] * 70)
    assert lrs[-1] < 0.05


def test_linear_and_constant():
    assert _lrs(LRScheduleConfig(name="linear", warmup_steps=0), 10)[5] == pytest.approx(0.5)
    assert _lrs(LRScheduleConfig(name="constant", warmup_steps=2), 10)[2:] == pytest.approx([1.0] * 8)


def test_warmup_longer_than_run_is_an_error():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ConfigError, match=r"lr_schedule.warmup_steps \(50\) must be smaller than the run's 20"):
        build_scheduler(opt, LRScheduleConfig(warmup_steps=50), 20)


def test_optimizers_run_fused_on_cuda_unless_the_recipe_chooses():
    """On CUDA an optimizer with a fused kernel gets it; on CPU nothing changes (exact to the golden runs);
    optim.args.fused / foreach always win; an optimizer without the switch gets nothing."""
    adamw = OptimConfig(name="AdamW")
    assert implementation_args(adamw, "cuda") == {"fused": True}
    assert implementation_args(adamw, "cpu") == {}
    assert implementation_args(OptimConfig(name="AdamW", args={"foreach": False}), "cuda") == {"foreach": False}
    assert implementation_args(OptimConfig(name="AdamW", args={"fused": False}), "cuda") == {"fused": False}
    assert implementation_args(OptimConfig(name="RMSprop"), "cuda") == {}
    opt = build_optimizer(Tiny(), adamw, lr=1e-3)
    assert opt.param_groups[0]["fused"] in (None, False)


@pytest.mark.gpu
def test_adamw_built_for_cuda_is_fused():
    model = Tiny().cuda()
    opt = build_optimizer(model, OptimConfig(name="AdamW"), lr=1e-3, device_type="cuda")
    assert opt.param_groups[0]["fused"] is True
    model.norm(model.proj(model.embed(torch.zeros(2, 4, dtype=torch.long, device="cuda")))).sum().backward()
    opt.step()
