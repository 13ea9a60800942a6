"""The chunked causal-LM loss is transformers' ForCausalLMLoss in value and gradient, in fewer bytes; model.loss
resolves per device and launch, and each implementation is installed by its own mechanism."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.loss.loss_utils import ForCausalLMLoss

import pretrain.model.loss
import pretrain.recipe.shape as shape
from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.model.loss import chunked_causal_lm_loss, install_loss, resolve_loss
from pretrain.train.preflight import check_run
from tests.helpers import make_recipe

V = 50


def _both(logits, **kwargs):
    results = []
    for fn in (ForCausalLMLoss, chunked_causal_lm_loss):
        x = logits.detach().clone().requires_grad_(True)
        value = fn(x, vocab_size=V, **kwargs)
        value.backward()
        results.append((value.detach(), x.grad))
    return results


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(shape, "LOSS_CHUNK_ELEMENTS", 7 * V)  # 7 tokens a chunk: several chunks, a ragged last one


@pytest.mark.parametrize("normalised", [True, False], ids=["sum/num_items", "mean"])
def test_fp32_value_and_gradient_equal_transformers(normalised):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, V, generator=g) * 4
    labels = torch.randint(0, V, (3, 11), generator=g)
    labels[0, :3] = -100  # ignored targets count neither in the sum nor in the mean
    kwargs = {"labels": labels, "shift_labels": labels}
    if normalised:
        kwargs["num_items_in_batch"] = 40.0
    (plain, plain_grad), (chunked, chunked_grad) = _both(logits, **kwargs)
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    torch.testing.assert_close(chunked_grad, plain_grad, rtol=1e-5, atol=1e-8)
    assert chunked_grad[0, :3].abs().sum() == 0


def test_unshifted_labels_are_shifted_as_transformers_does():
    g = torch.Generator().manual_seed(1)
    logits, labels = torch.randn(2, 9, V, generator=g), torch.randint(0, V, (2, 9), generator=g)
    (plain, plain_grad), (chunked, chunked_grad) = _both(logits, labels=labels)
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    torch.testing.assert_close(chunked_grad, plain_grad, rtol=1e-5, atol=1e-8)


def test_bf16_logits_keep_only_a_bf16_gradient():
    """With bf16 logits the gradient is that of the plain loss rounded to bf16, and backward keeps one
    bf16 logits-sized tensor (the plain loss keeps an fp32 log-softmax: twice the bytes)."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(4, 16, V, generator=g) * 3).to(torch.bfloat16)
    labels = torch.randint(0, V, (4, 16), generator=g)
    kwargs = {"labels": labels, "shift_labels": labels, "num_items_in_batch": 64.0}
    (plain, plain_grad), (chunked, chunked_grad) = _both(logits, **kwargs)
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    assert chunked_grad.dtype == torch.bfloat16
    torch.testing.assert_close(chunked_grad.float(), plain_grad.float(), rtol=1e-2, atol=1e-5)

    saved = []
    x = logits.detach().clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        chunked_causal_lm_loss(x, vocab_size=V, **kwargs)
    assert sum(t.numel() * t.element_size() for t in saved) == logits.numel() * 2


def test_without_autograd_no_gradient_is_computed():
    logits = torch.randn(2, 5, V)
    with torch.no_grad():
        value = chunked_causal_lm_loss(logits, labels=torch.randint(0, V, (2, 5)), vocab_size=V)
    assert torch.isfinite(value) and not value.requires_grad


# --------------------------------------------------------------------------------------------------
# model.loss: the implementation a run uses


ZERO3 = Launch("deepspeed", zero_stage=3)


@pytest.fixture
def liger_supports(monkeypatch):
    """liger_kernel importable and supporting the arch, whatever this machine has (it cannot run here)."""
    monkeypatch.setattr(pretrain.model.loss, "liger_unsupported", lambda arch, z_loss=0.0: None)


@pytest.mark.parametrize(("overrides", "launch", "cuda", "expected"), [
    ((), Launch(), False, "chunked"),  # no CUDA
    ((), Launch(), True, "liger"),
    ((), ZERO3, True, "chunked"),  # ZeRO-3 has not gathered lm_head.weight where Liger reads it
    (("stability.z_loss=1e-4",), Launch(), True, "chunked"),  # Liger's forward drops the z-loss part
    (("model.loss=chunked",), Launch(), True, "chunked"),
    (("model.loss=plain",), Launch(), True, "plain"),
    (("model.loss=liger", "stability.z_loss=1e-4"), Launch(), True, "liger"),
])
def test_the_loss_resolves_per_device_and_launch(liger_supports, overrides, launch, cuda, expected):
    assert resolve_loss(make_recipe(*overrides), launch, cuda=cuda) == expected


def test_auto_is_chunked_where_liger_kernel_is_missing_or_has_no_kernel(monkeypatch):
    # import liger_kernel (and its submodules, which an earlier test of this process may have imported) raises
    for name in ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.monkey_patch"):
        monkeypatch.setitem(sys.modules, name, None)
    assert "pip install 'liger-kernel>=" in pretrain.model.loss.liger_unsupported("llama")
    assert resolve_loss(make_recipe(), Launch(), cuda=True) == "chunked"
    with pytest.raises(ConfigError, match="pip install 'liger-kernel>="):
        resolve_loss(make_recipe("model.loss=liger"), Launch(), cuda=True)


def test_a_liger_import_failing_with_any_exception_falls_back_to_chunked(monkeypatch):
    """liger_kernel imports peft and Triton: one built for another torch fails with RuntimeError, not ImportError."""
    import builtins

    real_import = builtins.__import__

    def broken_peft(name, *args, **kwargs):
        if name.startswith("liger_kernel"):
            raise RuntimeError("peft: operator torchvision::nms does not exist")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken_peft)
    reason = pretrain.model.loss.liger_unsupported("llama")
    assert "importing liger_kernel failed (RuntimeError: peft: operator torchvision::nms" in reason
    implementation, why = pretrain.model.loss.loss_choice(make_recipe(), Launch(), cuda=True)
    assert implementation == "chunked" and "RuntimeError" in why
    with pytest.raises(ConfigError, match="model.loss=liger: importing liger_kernel failed") as exc:
        resolve_loss(make_recipe("model.loss=liger"), Launch(), cuda=True)
    assert len(exc.value.problems) == 1  # one message, naming the import failure


@pytest.mark.parametrize(("overrides", "launch", "message"), [
    (("model.loss=liger",), Launch(), "needs a CUDA GPU and `pip install 'liger-kernel>="),
    (("model.loss=liger",), ZERO3, "cannot run under DeepSpeed ZeRO-3"),
    (("model.loss=plain", "stability.z_loss=1e-4"), Launch(), "has no z-loss"),
])
def test_a_loss_that_cannot_run_is_refused_before_launch(overrides, launch, message):
    with pytest.raises(ConfigError, match=message):
        check_run(make_recipe(*overrides), launch)  # pretrain-launch and every process call it first


def _tiny_llama():
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         vocab_size=V)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_plain_and_chunked_give_the_model_the_same_loss_and_gradients():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, 16), generator=g)
    targets = ids.clone()
    targets[0, :4] = -100
    results = []
    for implementation in ("plain", "chunked"):
        model = _tiny_llama()
        assert install_loss(model, implementation) is None
        loss = model(input_ids=ids, labels=targets, shift_labels=targets, num_items_in_batch=25.0).loss
        loss.backward()
        results.append((loss.item(), [p.grad for p in model.parameters()]))
    (plain, plain_grads), (chunked, chunked_grads) = results
    assert chunked == pytest.approx(plain, rel=1e-6)
    for a, b in zip(plain_grads, chunked_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_liger_is_applied_by_its_own_instance_patch_with_the_z_loss_in_training_only(monkeypatch):
    """Liger-Kernel itself cannot run here (Triton, CUDA): a stand-in for its instance patch records what
    the patched forward is given, as Liger's forward hands its keyword arguments to its loss."""
    calls = {}

    def apply(model, **kwargs):
        calls["apply"] = kwargs
        original = model.forward

        def forward(*args, **kw):
            calls["forward"] = dict(kw)
            kw.pop("lse_square_scale", None)
            return original(*args, **kw)

        model.forward = forward

    patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    patch._apply_liger_kernel_to_instance = apply
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", patch)
    model = _tiny_llama()
    assert install_loss(model, "liger", z_loss=1e-4) is None
    assert calls["apply"] == {"fused_linear_cross_entropy": True, "cross_entropy": False, "rope": False,
                              "rms_norm": False, "swiglu": False}
    ids = torch.randint(0, V, (1, 8))
    model.train()
    model(input_ids=ids, labels=ids)
    assert calls["forward"]["lse_square_scale"] == 1e-4
    model.eval()
    model(input_ids=ids, labels=ids)
    assert "lse_square_scale" not in calls["forward"]  # evaluation: the cross-entropy alone
    assert model.loss_function is chunked_causal_lm_loss  # what evaluation's forward (logits computed) calls


def test_liger_that_patches_nothing_is_an_error(monkeypatch):
    patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    patch._apply_liger_kernel_to_instance = lambda model, **kwargs: None  # Liger only logs an unknown type
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", patch)
    with pytest.raises(ConfigError, match="did not patch"):
        install_loss(_tiny_llama(), "liger")
