"""An activation checkpointing policy (``model.activation_checkpointing``, named and explained in
pretrain/recipe/recompute.py) turned on for a built transformers model: which ops selective checkpointing keeps, and
the model's own switch."""

from __future__ import annotations

from functools import cache, partial
from typing import Any

from pretrain.recipe.recompute import every_n


@cache
def _saved_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps: matmuls (a mixture of experts' grouped GEMM too, which
    transformers' experts run on CPU and GPU alike), every attention kernel this torch build (and flash-attn, when
    installed) registers, and expert parallelism's token all-to-all (as torchtitan keeps it: a recompute would send
    every routed token across the GPUs again)."""
    import torch

    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
    for packet in (getattr(aten, "_grouped_mm", None),
                   getattr(getattr(torch.ops, "_c10d_functional", None), "all_to_all_single", None)):
        if packet is not None:
            ops.update(getattr(packet, overload) for overload in packet.overloads())
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


def _run(function, *args):
    """The checkpoint function transformers < 5.23 calls around a layer's ``__call__``, once
    ``_checkpoint_in_forward`` has moved the checkpoint into the layer's forward: it runs the call as is."""
    return function(*args)


def _checkpointed_forward(self, *args, **kwargs):
    """A layer's forward under its checkpoint, as transformers >= 5.23 places it (``GradientCheckpointingLayer``
    wraps ``forward``): inside ``Module._call_impl``, so inside the region ``module.compile()`` compiles."""
    import torch

    forward = type(self).forward
    if self.training and torch.is_grad_enabled():
        return self._pretrain_checkpoint(partial(forward, self, **kwargs), *args)
    return forward(self, *args, **kwargs)


def _checkpoint_in_forward(model) -> None:
    """Move each checkpointed layer's checkpoint from around its ``__call__`` into its forward where the installed
    transformers (5.17-5.22) places it around ``__call__``.

    Why: regional compile (``module.compile()`` on each block) compiles ``Module._call_impl``, which calls
    forward. transformers < 5.23 checkpoints ``__call__``, outside the compiled code, so torch's checkpoint sees one
    opaque compiled function: selective checkpointing's policy never meets a matmul, the whole compiled block is
    saved as full's and replayed in backward (measured on CPU, a 2-layer llama, transformers 5.17: 60 matmuls in
    backward against full's 46 and none's 30). Inside the compiled region dynamo traces the checkpoint and the
    partitioner follows the policy (5.17 with this: 30, as 5.24's own placement). transformers 5.23 made the same
    move (so FSDP2's hooks stay outside the checkpoint); its layers are left as they are. The flag and its
    ``every_n_layers`` pattern stay transformers' (``gradient_checkpointing`` on the checkpointed layers); the
    ``__call__`` wrapper keeps its cache handling and calls ``_run``."""
    from types import MethodType

    from transformers.modeling_layers import GradientCheckpointingLayer

    if "__call__" not in GradientCheckpointingLayer.__dict__:
        return
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
            module._pretrain_checkpoint = module._gradient_checkpointing_func
            module._gradient_checkpointing_func = _run
            module.forward = MethodType(_checkpointed_forward, module)


def apply(model, policy: str) -> None:
    """Turn the policy on for a transformers model, through its own switch: ``activation_checkpointing_enable``
    (transformers >= 5.23), or the same switch under its earlier name, ``gradient_checkpointing_enable``
    (deprecated from 5.23, with the same ``every_n_layers`` and checkpoint keyword arguments), so that every
    transformers pyproject admits runs every policy; on those earlier versions the checkpoint is then moved
    into each layer's forward, where 5.23 puts it (``_checkpoint_in_forward``)."""
    if policy == "none":
        return
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective":
        kwargs["context_fn"] = selective_context_fn
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n(policy))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, every_n_layers=every_n(policy))
        _checkpoint_in_forward(model)
