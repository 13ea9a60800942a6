"""The causal-LM loss without the fp32 copies of the logits.

transformers' ``ForCausalLMLoss`` upcasts a micro-batch's whole logits to fp32 and log-softmax saves an
fp32 result for backward: for llama-1b at MBS 4, seq 2048 and a 128k vocabulary that is 2.1 GB of bf16
logits plus 4.2 GB fp32 plus 4.2 GB of fp32 gradient at the start of backward. ``chunked_causal_lm_loss``
computes the same loss ``shape.loss_chunk_tokens(vocab)`` tokens at a time: each chunk is upcast, its loss summed and its gradient
(softmax - one-hot) / N written straight into a buffer of the logits' dtype, which is all backward keeps.
Peak: the logits, that buffer and one fp32 chunk. The value and the gradient are those of the plain loss
up to float summation order (tests/model/test_loss.py).

The z-loss (``stability.z_loss``, PaLM / OLMo-core): z x logsumexp(logits)^2 per target token, added to the
same sum chunk by chunk (its gradient 2 z lse x softmax joins the chunk's), so it costs no memory. It applies
only where the logits need a gradient (training): evaluation's loss stays the cross-entropy. Its share of
the returned loss is added to a ``LossTerms`` for logging (``train/z_loss``).

It replaces the model's ``loss_function`` (transformers calls it from the model's forward, so DDP, FSDP
and DeepSpeed hooks are untouched) with the same signature. A mixture of experts' forward adds its weighted
load-balancing loss to what this returns, after it (pretrain/train/router.py): nothing here adds it again. Without autograd (evaluation) no gradient is
computed.

``model.loss`` picks the implementation (``resolve_loss``, ``install_loss``): ``chunked`` (this module),
``plain`` (transformers' ``ForCausalLMLoss``, the comparison the benchmarks make), ``liger`` (Liger-Kernel's
fused linear cross-entropy through its own ``_apply_liger_kernel_to_instance``: the model's forward hands
the last hidden states and the LM-head weight to a Triton kernel that computes the loss and both gradients
chunk by chunk, so no logits exist at all in training; evaluation's forward still computes logits and this
module's loss). Liger reads ``lm_head.weight`` outside the head's own forward, which DeepSpeed ZeRO-3 has
not gathered (an empty shard: huggingface/trl#3368), so it is refused there. Its loss is the sum over
target tokens divided by ``num_items_in_batch`` (reduction "sum"), as here. With ``stability.z_loss`` Liger
adds z x lse^2 per target token itself, with the gradient (1 + 2 z lse) softmax - one-hot computed here too
(its ``lse_square_scale``, passed as a forward argument), but its model forward returns the
sum only: train/loss then includes the z-loss and train/z_loss is not logged, which is why ``auto`` keeps
``chunked`` when the z-loss is on.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

import torch
from torch import nn

from pretrain.errors import ConfigError
from pretrain.recipe import shape
from pretrain.system.environment import install_command

if TYPE_CHECKING:
    from pretrain.distributed.layout import Launch
    from pretrain.recipe.config import Recipe

LIGER_INSTALL = install_command("liger-kernel")


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum over tokens of -log softmax(logits)[target] (+ z_loss x lse^2 when training) / normaliser, and the
    z-loss part of it (not differentiable); gradient computed in forward."""

    @staticmethod
    def forward(ctx, logits, targets, normaliser, ignore_index, chunk, z_loss=0.0):
        needs_grad = ctx.needs_input_grad[0]
        z_loss = z_loss if needs_grad else 0.0
        grad = torch.empty_like(logits) if needs_grad else None
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        z_total = torch.zeros((), dtype=torch.float32, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], chunk):
                x = logits[start : start + chunk].float()
                t = targets[start : start + chunk]
                valid = t != ignore_index
                safe = torch.where(valid, t, 0)
                lse = torch.logsumexp(x, dim=-1)
                picked = x.gather(1, safe[:, None]).squeeze(1)
                total += torch.where(valid, lse - picked, 0.0).sum()
                if z_loss:
                    z_total += torch.where(valid, lse.square(), 0.0).sum() * z_loss
                if needs_grad:
                    x.sub_(lse[:, None]).exp_()  # softmax, in place of the fp32 chunk
                    if z_loss:
                        x.mul_((1 + 2 * z_loss * lse)[:, None])  # + d(z lse^2)/dlogits = 2 z lse softmax
                    x.scatter_add_(1, safe[:, None], -valid[:, None].to(x.dtype))
                    x.mul_(valid[:, None] / normaliser)
                    grad[start : start + chunk] = x
        if needs_grad:
            ctx.save_for_backward(grad)
        z_part = z_total / normaliser
        ctx.mark_non_differentiable(z_part)
        return (total + z_total) / normaliser, z_part

    @staticmethod
    def backward(ctx, grad_output, _grad_z_part):
        (grad,) = ctx.saved_tensors
        # In place: the buffer is not needed again (no double backward), and a copy would double the peak.
        return grad.mul_(grad_output.to(grad.dtype)), None, None, None, None, None


class LossTerms:
    """The z-loss part of the training losses computed since the last ``take()`` (a device tensor: no sync)."""

    def __init__(self):
        self.z_loss: torch.Tensor | None = None

    def add(self, z_part: torch.Tensor) -> None:
        self.z_loss = z_part if self.z_loss is None else self.z_loss + z_part

    def take(self) -> torch.Tensor | None:
        value, self.z_loss = self.z_loss, None
        return value


def install_z_loss(model: nn.Module, z_loss: float) -> LossTerms:
    """Make the model's loss (pretrain's chunked loss, model.build_model) add ``z_loss`` x lse^2; the terms to
    read the z-loss part from."""
    terms = LossTerms()
    model.loss_function = functools.partial(chunked_causal_lm_loss, z_loss=z_loss, terms=terms)
    return terms


def chunked_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    vocab_size: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    z_loss: float = 0.0,
    terms: LossTerms | None = None,
    **kwargs,
) -> torch.Tensor:
    """Drop-in for transformers' ``ForCausalLMLoss`` (same arguments, same value and gradient): the sum of
    token losses divided by ``num_items_in_batch``, or their mean over non-ignored targets without it.
    ``z_loss`` > 0 adds the z-loss (training only), whose part is added to ``terms``."""
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    flat = logits.reshape(-1, logits.shape[-1])
    targets = shift_labels.reshape(-1).to(flat.device)
    if num_items_in_batch is None:
        normaliser = (targets != ignore_index).sum().float()
    else:
        normaliser = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=flat.device)
    loss, z_part = _ChunkedCrossEntropy.apply(flat, targets, normaliser, ignore_index,
                                              shape.loss_chunk_tokens(flat.shape[-1]), z_loss)
    if terms is not None and z_loss and flat.requires_grad:  # training: evaluation adds no z-loss
        terms.add(z_part)
    return loss


# --------------------------------------------------------------------------------------------------
# model.loss: which implementation a run uses


def liger_unsupported(arch: str, z_loss: float = 0.0) -> str | None:
    """Why Liger-Kernel's fused linear cross-entropy cannot serve ``arch`` here (None: it can). Imports
    liger_kernel (and Triton): call it only where CUDA is."""
    try:
        from liger_kernel.transformers import functional
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        return f"liger_kernel cannot be imported ({exc}): {LIGER_INSTALL}"
    except Exception as exc:  # noqa: BLE001 - liger imports peft, transformers' integrations and Triton at import
        # time; any of them failing (a peft or Triton built for another torch raises RuntimeError, AttributeError,
        # ...) must make auto fall back to chunked, not crash every run on a CUDA box.
        return (f"importing liger_kernel failed ({type(exc).__name__}: {exc}); fix or reinstall it and what it "
                f"imports (`{LIGER_INSTALL} -U`)")
    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(arch)
    if apply_fn is None:
        known = ", ".join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))
        return f"Liger-Kernel has no kernels for model.arch={arch} (it has: {known})"
    if "fused_linear_cross_entropy" not in inspect.signature(apply_fn).parameters:
        return f"this Liger-Kernel has no fused linear cross-entropy for model.arch={arch}; upgrade: {LIGER_INSTALL} -U"
    if z_loss and "lse_square_scale" not in inspect.signature(functional.liger_fused_linear_cross_entropy).parameters:
        return f"this Liger-Kernel has no lse_square_scale (stability.z_loss); upgrade: {LIGER_INSTALL} -U"
    return None


def resolve_loss(recipe: Recipe, launch: Launch, cuda: bool | None = None) -> str:
    """The loss implementation ``model.loss`` means on this launch: chunked, plain or liger (``loss_choice``)."""
    return loss_choice(recipe, launch, cuda)[0]


def loss_choice(recipe: Recipe, launch: Launch, cuda: bool | None = None) -> tuple[str, str]:
    """(implementation, why) for ``model.loss`` on this launch. A choice that cannot run here is one ConfigError
    (check_run raises it before any process starts); ``auto`` falls back to chunked with the reason."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    choice, z_loss, arch = recipe.model.loss, recipe.stability.z_loss, recipe.model.arch
    zero3 = launch.uses_deepspeed and launch.zero_stage == 3
    if choice == "plain" and z_loss:
        raise ConfigError(f"model.loss=plain (transformers' ForCausalLMLoss) has no z-loss but stability.z_loss = "
                          f"{z_loss}; use model.loss=chunked (or auto), or set stability.z_loss=0")
    if choice == "liger":
        problems = []
        if not cuda:
            problems.append(f"model.loss=liger needs a CUDA GPU and `{LIGER_INSTALL}` (Liger-Kernel's kernels are "
                            "Triton); use model.loss=chunked (or auto) on this machine")
        if zero3:
            problems.append("model.loss=liger cannot run under DeepSpeed ZeRO-3 (Liger reads lm_head.weight "
                            "outside the head's forward, where ZeRO-3 has not gathered it); use model.loss=chunked "
                            "(or auto), or ZeRO-1/2 or FSDP")
        if cuda:
            reason = liger_unsupported(arch, z_loss)
            if reason:
                problems.append(f"model.loss=liger: {reason}; or use model.loss=chunked (or auto)")
        if problems:
            raise ConfigError(problems)
        return "liger", "model.loss=liger"
    if choice != "auto":
        return choice, f"model.loss={choice}"
    if not cuda:
        return "chunked", "auto: chunked off CUDA (Liger's kernels are Triton)"
    if zero3:
        return "chunked", "auto: chunked under DeepSpeed ZeRO-3 (Liger reads lm_head.weight where ZeRO-3 has not gathered it)"
    if z_loss:
        return "chunked", "auto: chunked with stability.z_loss (Liger's forward returns the sum only: no train/z_loss)"
    reason = liger_unsupported(arch)
    if reason is not None:
        return "chunked", f"auto: chunked, since {reason}"
    return "liger", "auto: Liger's fused linear cross-entropy (CUDA, liger_kernel importable)"


def install_loss(model: nn.Module, implementation: str, z_loss: float = 0.0) -> LossTerms | None:
    """Give the built model (before accelerate.prepare) the loss ``resolve_loss`` chose; the terms to read the
    z-loss part from (chunked with stability.z_loss), else None."""
    if implementation == "plain":
        from transformers.loss.loss_utils import ForCausalLMLoss

        model.loss_function = ForCausalLMLoss
        return None
    if z_loss and implementation == "chunked":
        return install_z_loss(model, z_loss)
    model.loss_function = chunked_causal_lm_loss  # liger: what evaluation's forward (logits computed) calls
    if implementation == "liger":
        _install_liger(model, z_loss)
    return None


def _install_liger(model: nn.Module, z_loss: float) -> None:
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    forward_before = model.forward
    # The fused linear cross-entropy only: Liger's RoPE, RMSNorm and SwiGLU kernels would change the model too.
    _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=True, cross_entropy=False, rope=False,
                                    rms_norm=False, swiglu=False)
    if model.forward == forward_before:  # Liger only logs what it does not support
        raise ConfigError(f"Liger-Kernel did not patch the {type(model).__name__}'s forward; use model.loss=chunked")
    if z_loss:
        # Liger's forward hands its keyword arguments to LigerForCausalLMLoss, which keeps those of
        # liger_fused_linear_cross_entropy: lse_square_scale is the z-loss coefficient (z x lse^2 per target
        # token, in the same sum normalised by num_items_in_batch). Training only: evaluation stays the
        # cross-entropy.
        def add_z_loss(module, args, kwargs):
            if module.training:
                kwargs = {**kwargs, "lse_square_scale": z_loss}
            return args, kwargs

        model.register_forward_pre_hook(add_z_loss, with_kwargs=True)
