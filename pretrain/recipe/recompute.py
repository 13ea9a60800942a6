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
seeds are drawn from module names) and FSDP2's per-block hooks stay outside the checkpoint: pretrain/model/activation_checkpointing.py
turns a policy on for a built model.

No torch here: the estimator and the planner read the policy names from here.
"""

from __future__ import annotations

import re
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
