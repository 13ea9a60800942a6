"""Per-device memory of a training run, before it is queued: pure arithmetic, no torch.

A recipe (or a transformers config), the batch plan and the layout (DDP, DeepSpeed ZeRO 0-3 or FSDP,
offload, number of GPUs) give each term a device holds, in bytes, with the formula that produced it:

- **parameters, gradients, optimizer states** follow the ZeRO paper's accounting (Rajbhandari et al.
  2020: 2Ψ + 2Ψ + KΨ bytes for Ψ parameters in mixed precision, K = 12 for Adam: fp32 master, momentum,
  variance; each term divided by the data-parallel degree N once ZeRO partitions it), refined to the
  buffers DeepSpeed really allocates, read from its source and measured on CPU by
  ``tests/plan/test_memory_validation.py``: ZeRO-1/2/3 keep an fp32 master partition in every precision (in
  fp32 too: a copy beside the parameters), build an fp32 copy of the gradient partition inside
  ``step()``, ZeRO-1 holds every gradient until the end of backward, ZeRO-2/3 a gradient partition plus
  a reduce bucket, ZeRO-3 a persistent bucket and the gathered parameters of the running module (with
  ZeRO++ hpZ also a secondary compute-dtype partition of the parameters within a node: 2 B x Ψ / GPUs per node).
  FSDP (as accelerate applies FSDP2) shards fp32 parameters, gradients and optimizer states like ZeRO-3
  (FULL_SHARD; hybrid, HSDP: within a node), or gradients and optimizer states only, every unit staying
  gathered from its forward to its backward (SHARD_GRAD_OP), or nothing (NO_SHARD); its buffers are the
  gathered units (a transformer block and the next one, prefetched) and a unit's gradient.
- **activations**: the tensors autograd saves for backward, per layer, for the attention kernel in use
  (sdpa / flash_attention_2: q, k, v, output and a logsumexp, no s² term; eager: the s² attention
  probabilities), for Llama-style blocks (RMSNorm with an fp32 upcast, RoPE, GQA, SwiGLU) and GPT-2
  blocks (LayerNorm, fused qkv, tanh-GELU, dropout masks), with and without activation checkpointing.
- **logits and loss**: the logits (MBS x seq x vocab in the compute dtype) and the chunked loss's gradient
  buffer of the same size and dtype, plus one fp32 chunk (pretrain/model/loss.py); the logits are freed before
  backward.
- **communication buckets**, an **autocast weight cache** (DDP in mixed precision), and an allowance for
  the CUDA context and the allocator.

The terms do not all peak together: gradients grow during backward while activations are freed, and
DeepSpeed's fp32 gradient copy exists only inside ``step()``. The total is the largest of three phase
sums (start of backward, gradient reduction, optimizer step) plus the allowance, not the sum of every
term's own peak. Each term is reported at its own peak.

The estimate is for one rank. Under tensor parallelism (FSDP2 x TP) its parameters, gradients and optimizer
states are those of one TP rank (the modules transformers' TP plan splits divided by TP, the rest whole) sharded
over the data-parallel ranks, its attention and MLP activations are divided by TP; under context parallelism every
per-token term is that of seq / CP tokens; under expert parallelism (EP x FSDP2) its shards are Ψ/N as under FSDP,
but what it unshards (a block in forward and backward, its gradient, no_sync's accumulated gradients) holds only its
own E / EP experts of each block, and the tokens' all-to-all adds its send and receive buffers; float8 adds torchao's
transient casts (``parallel``). No pipeline parallelism.

Modules: ``workload`` (what a rank computes, DeepSpeed's buffer sizes), ``activations``, ``states``
(parameters, gradients, optimizer states and buffers per engine), ``parallel`` (TP, CP, EP, float8), ``terms`` (a term's bytes, formula and
phases), ``estimate`` (the sum by phase and its report). The model's shape is ``pretrain.recipe.shape``'s, the
GPU table ``pretrain.system.hardware``'s.
"""

from __future__ import annotations

from pretrain.plan.memory.activations import ActivationEstimate, activation_memory
from pretrain.plan.memory.estimate import (
    ALLOCATOR_FRACTION,
    CUDA_CONTEXT_BYTES,
    MemoryEstimate,
    estimate,
    estimate_shape,
)
from pretrain.plan.memory.states import CLASSIC_EXAMPLE, ModelStates, classic_example_gb, model_states
from pretrain.plan.memory.terms import GIB, Phases, Term
from pretrain.plan.memory.workload import DeepSpeedBuffers, Workload, optimizer_state_bytes
from pretrain.system.hardware import GpuSpec, custom_gpu, find_gpu, gpu_for_device

__all__ = [
    "ALLOCATOR_FRACTION", "CLASSIC_EXAMPLE", "CUDA_CONTEXT_BYTES", "GIB", "ActivationEstimate", "DeepSpeedBuffers",
    "GpuSpec", "MemoryEstimate", "ModelStates", "Phases", "Term", "Workload", "activation_memory",
    "classic_example_gb", "custom_gpu", "estimate", "estimate_shape", "find_gpu", "gpu_for_device", "model_states",
    "optimizer_state_bytes",
]
