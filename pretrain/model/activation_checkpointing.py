"""An activation checkpointing policy (``model.activation_checkpointing``, named and explained in
pretrain/recipe/recompute.py) turned on for a built transformers model: which ops selective checkpointing keeps, and
the model's own switch."""

from __future__ import annotations

from functools import cache, partial
from typing import Any

from pretrain.recipe.recompute import every_n


@cache
def _saved_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps: matmuls and every attention kernel this torch
    build (and flash-attn, when installed) registers."""
    import torch

    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_flash_attention_forward", "_efficient_attention_forward"):
        packet = getattr(aten, name, None)
        if packet is not None:
            ops.update(getattr(packet, overload) for overload in packet.overloads())
    flash = getattr(torch.ops, "flash_attn", None)  # flash-attn >= 2.6 registers its kernels as torch ops
    for name in ("_flash_attn_forward", "_flash_attn_varlen_forward"):
        packet = getattr(flash, name, None) if flash is not None else None
        if packet is not None:
            ops.update(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(ops)


def _selective_policy(saved_ops, ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in saved_ops else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn():
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for the selective policy."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(partial(_selective_policy, _saved_ops()))


def apply(model, policy: str) -> None:
    """Turn the policy on for a transformers model, through its own switch: ``activation_checkpointing_enable``
    (transformers >= 5.23), or the same switch under its earlier name, ``gradient_checkpointing_enable``
    (deprecated from 5.23, with the same ``every_n_layers`` and checkpoint keyword arguments), so that every
    transformers pyproject admits runs every policy."""
    if policy == "none":
        return
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective":
        kwargs["context_fn"] = selective_context_fn
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n(policy))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, every_n_layers=every_n(policy))
