"""The causal-LM loss without the fp32 copies of the logits.

transformers' ``ForCausalLMLoss`` upcasts a micro-batch's whole logits to fp32 and log-softmax saves an
fp32 result for backward: for llama-1b at MBS 4, seq 2048 and a 128k vocabulary that is 2.1 GB of bf16
logits plus 4.2 GB fp32 plus 4.2 GB of fp32 gradient at the start of backward. ``chunked_causal_lm_loss``
computes the same loss ``shape.loss_chunk_tokens(vocab)`` tokens at a time: each chunk is upcast, its loss summed and its gradient
(softmax - one-hot) / N written straight into a buffer of the logits' dtype, which is all backward keeps.
Peak: the logits, that buffer and one fp32 chunk. The value and the gradient are those of the plain loss
up to float summation order (tests/test_loss.py).

It replaces the model's ``loss_function`` (transformers calls it from the model's forward, so DDP, FSDP
and DeepSpeed hooks are untouched) with the same signature. Without autograd (evaluation) no gradient is
computed.
"""

from __future__ import annotations

import torch
from torch import nn

from pretrain import shape


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over tokens of -log softmax(logits)[target] / normaliser; gradient computed in forward."""

    @staticmethod
    def forward(ctx, logits, targets, normaliser, ignore_index, chunk):
        needs_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(logits) if needs_grad else None
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], chunk):
                x = logits[start : start + chunk].float()
                t = targets[start : start + chunk]
                valid = t != ignore_index
                safe = torch.where(valid, t, 0)
                lse = torch.logsumexp(x, dim=-1)
                picked = x.gather(1, safe[:, None]).squeeze(1)
                total += torch.where(valid, lse - picked, 0.0).sum()
                if needs_grad:
                    x.sub_(lse[:, None]).exp_()  # softmax, in place of the fp32 chunk
                    x.scatter_add_(1, safe[:, None], -valid[:, None].to(x.dtype))
                    x.mul_(valid[:, None] / normaliser)
                    grad[start : start + chunk] = x
        if needs_grad:
            ctx.save_for_backward(grad)
        return total / normaliser

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        # In place: the buffer is not needed again (no double backward), and a copy would double the peak.
        return grad.mul_(grad_output.to(grad.dtype)), None, None, None, None


def chunked_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    vocab_size: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """Drop-in for transformers' ``ForCausalLMLoss`` (same arguments, same value and gradient): the sum of
    token losses divided by ``num_items_in_batch``, or their mean over non-ignored targets without it."""
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    flat = logits.reshape(-1, logits.shape[-1])
    targets = shift_labels.reshape(-1).to(flat.device)
    if num_items_in_batch is None:
        normaliser = (targets != ignore_index).sum().float()
    else:
        normaliser = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=flat.device)
    return _ChunkedCrossEntropy.apply(flat, targets, normaliser, ignore_index, shape.loss_chunk_tokens(flat.shape[-1]))
