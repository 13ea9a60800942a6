"""model.compile: the mode resolved per device, who compiles (accelerate or pretrain, in place), and that an
in-place compile leaves the model's names and state_dict keys those of the eager model."""

from __future__ import annotations

import pytest
import torch

from pretrain.distributed.accelerator import compile_choice, compile_in_place, compile_mode, dynamo_plugin
from pretrain.distributed.layout import Launch
from pretrain.model.build import build_model
from pretrain.recipe.config import ModelConfig

pytestmark = pytest.mark.floors  # the compile decision runs in CI's minimum-versions smoke set too

DDP = Launch()
ZERO2 = Launch(engine="deepspeed", zero_stage=2, num_nodes=1, gpus_per_node=2)
FSDP = Launch(engine="fsdp", fsdp_sharding="FULL_SHARD", num_nodes=1, gpus_per_node=2)


ZERO3 = Launch(engine="deepspeed", zero_stage=3, num_nodes=1, gpus_per_node=2)


@pytest.mark.parametrize("requested, device, launch, mode", [
    ("auto", "cuda", DDP, "regional"), ("auto", "cpu", DDP, "none"), ("regional", "cpu", DDP, "regional"),
    ("full", "cuda", DDP, "full"), ("none", "cuda", DDP, "none"),
    ("auto", "cuda", ZERO2, "regional"), ("auto", "cuda", FSDP, "regional"),
    # ZeRO-3's gather hooks are compiler-disabled: auto stays eager; an explicit choice is kept
    ("auto", "cuda", ZERO3, "none"), ("regional", "cuda", ZERO3, "regional"),
])
def test_auto_is_regional_on_cuda_except_zero3_and_none_on_cpu(requested, device, launch, mode):
    assert compile_mode(requested, device, launch) == mode


def test_the_reason_names_zero3():  # the run's log line and --dry-run print it (tests/plan/test_dry_run.py)
    assert "under DeepSpeed ZeRO-3" in compile_choice("auto", "cuda", ZERO3)[1]
    assert compile_choice("auto", "cuda", ZERO2)[1].startswith("auto: regional")


def test_accelerate_compiles_under_deepspeed_and_fsdp_pretrain_in_place_otherwise():
    for launch in (ZERO2, FSDP):
        regional, full = dynamo_plugin("regional", launch), dynamo_plugin("full", launch)
        assert regional.backend.value == "INDUCTOR" and regional.use_regional_compilation
        assert full.backend.value == "INDUCTOR" and not full.use_regional_compilation
        assert dynamo_plugin("none", launch) is None
    # accelerate's regional path for DDP / one process copies the model into OptimizedModules (_orig_mod keys)
    assert dynamo_plugin("regional", DDP) is None and dynamo_plugin("full", DDP) is None


def _tiny_model():
    config = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    return build_model(config, 128, 16, seed=0, device=torch.device("cpu"))


@pytest.mark.parametrize("mode", ["regional", "full"])
def test_in_place_compile_keeps_names_and_state_dict_keys(mode):
    eager, model = _tiny_model(), _tiny_model()
    compile_in_place(model, mode, DDP)
    assert list(model.state_dict()) == list(eager.state_dict())
    assert [name for name, _ in model.named_modules()] == [name for name, _ in eager.named_modules()]
    compiled = [name for name, module in model.named_modules() if module._compiled_call_impl is not None]
    if mode == "regional":  # every block, and every other leaf child, compiled on its own
        assert {"model.layers.0", "model.layers.1", "model.embed_tokens", "model.norm", "lm_head"} <= set(compiled)
        assert "" not in compiled
    else:
        assert compiled == [""]
    compile_in_place(eager, "regional", ZERO2)  # accelerate compiles DeepSpeed's engine.module itself
    assert all(module._compiled_call_impl is None for module in eager.modules())
