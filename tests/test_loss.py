"""The chunked causal-LM loss is transformers' ForCausalLMLoss in value and gradient, in fewer bytes."""

from __future__ import annotations

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

import pretrain.shape as shape
from pretrain.loss import chunked_causal_lm_loss

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
