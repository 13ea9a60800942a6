"""Activation checkpointing policies: their names, which blocks they checkpoint, which ops they save.

``model.activation_checkpointing`` is one of

- ``none``: every block keeps the tensors autograd saves (the fastest, the most memory);
- ``full``: every decoder block is checkpointed: it keeps only its input and is run again in backward
  (one extra forward of the blocks);
- ``every_N`` (N >= 2): blocks 0, N, 2N, ... are checkpointed, the others keep their tensors (Megatron's
  and torchtitan's "every n-th layer": 1/N of full's recompute, memory in between);
- ``selective``: every block is checkpointed under torch's op-level selective checkpointing
  (``create_selective_checkpoint_contexts``, torchtitan's ``op`` mode): the outputs of the compute-heavy ops
  (matmuls, the attention kernels: ``SAVED_OPS``) are kept, the cheap memory-heavy ones (norms, activation
  functions, RoPE, elementwise, dropout) are recomputed in backward. torchtitan keeps every other ``mm``
  output only (its per-rank memory budget at 8k+ sequences); pretrain keeps them all, so that selective
  recomputes no matmul at all (its HFU equals its MFU up to elementwise work) and ``every_N`` is the knob
  that trades memory back for matmul recompute.

Blocks are transformers' ``GradientCheckpointingLayer``s: transformers' own ``activation_checkpointing_enable``
(``gradient_checkpointing_enable`` before transformers 5.23) sets the flag and the checkpoint function on them (``every_n_layers`` for every_N, a ``context_fn`` in the
checkpoint's keyword arguments for selective), so no module is wrapped or renamed (the per-module init
seeds are drawn from module names) and FSDP2's per-block hooks stay outside the checkpoint.

No torch import at module level: the estimator and the planner read the policy names from here.
"""

from __future__ import annotations

import re
from functools import cache, partial
from typing import Any

POLICIES = ("none", "full", "selective", "every_N")
"""The values ``model.activation_checkpointing`` accepts (every_N: every_2, every_3, ...)."""

_EVERY = re.compile(r"every_(\d+)")


def normalize(value: Any) -> str:
    """A recipe's value as the policy string: booleans of old recipes (true = full, false = none), or a
    policy name; anything else raises ValueError naming the allowed values."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if isinstance(value, str):
        name = value.strip().lower()
        if name in ("none", "full", "selective"):
            return name
        match = _EVERY.fullmatch(name)
        if match and int(match.group(1)) >= 2:
            return f"every_{int(match.group(1))}"
        if match:
            raise ValueError(f"{value!r}: every_N needs N >= 2 (every_1 is full); use none, full, selective or every_N")
    raise ValueError(
        f"{value!r} is not a checkpointing policy: use none, full, selective or every_N with an integer N >= 2 "
        "(e.g. every_2: blocks 0, 2, 4, ... are checkpointed); true and false still mean full and none"
    )


def every_n(policy: str) -> int:
    """The block period of a policy that checkpoints whole blocks: 1 for full and selective (every block),
    N for every_N, 0 for none."""
    if policy == "none":
        return 0
    if policy.startswith("every_"):
        return int(policy.removeprefix("every_"))
    return 1


def checkpointed_blocks(policy: str, num_layers: int) -> int:
    """How many of ``num_layers`` blocks the policy checkpoints: blocks 0, N, 2N, ... (transformers'
    ``every_n_layers`` counts the same way)."""
    n = every_n(policy)
    return 0 if n == 0 else -(-num_layers // n)


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


PLANNER_POLICIES = ("none", "selective", "every_2", "full")
"""The policies pretrain-plan tries, least recompute first (its tie-break): selective recomputes no matmul,
every_2 half of full's, full one forward of the blocks."""


def runs_under_zero3(policy: str) -> bool:
    """Whether DeepSpeed ZeRO-3 can run the policy: not selective. ZeRO-3 gathers each sub-module's parameters
    in hooks inside the block; in the recompute they run other ops than in the forward (measured on CPU:
    "aten.empty.memory_format encountered during backward but not found in storage"), and torch's selective
    checkpointing requires the recompute to replay the forward's ops."""
    return policy != "selective"


def recompute_label(policy: str) -> str:
    """How the planning commands name a policy in one line: no recompute, recompute (full), recompute every_2."""
    return {"none": "no recompute", "full": "recompute"}.get(policy, f"recompute {policy}")
