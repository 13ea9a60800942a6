"""Context parallelism under FSDP2: every sequence split over the CP ranks, by accelerate and torch.

accelerate owns the mesh (``parallelism_config`` cp_size: dp_replicate x dp_shard x cp x tp, tp innermost, cp next;
FSDP2 shards over the flattened dp_shard x cp) and the model's side: ``prepare`` attaches a pre-forward hook to every
``*self_attn`` module that drops the attention mask and calls SDPA with ``is_causal=True``, and refuses models with
sliding-window or chunked layers. torch owns the ring attention: ``accelerator.maybe_context_parallel`` enters
``context_parallel`` on the cp mesh, which splits the buffers it is given along the sequence, in place, with its
head-tail load balancer (rank i of C keeps chunks i and 2C-1-i of 2C, so that every rank does the same share of the
causal attention's work), and replaces SDPA with ring attention (K/V all-gathered) in the forward and backward run
inside it.

pretrain's part is which tensors are split and what each rank's loss is divided by:

- ``forward_inputs``: the input ids; the targets, already shifted by the loader (``shift_labels``: shifting inside a
  shard would take its last token's target from the next chunk, which another rank holds); and explicit position ids
  0..seq-1, split with them, so that RoPE rotates every token by its position in the whole sequence (without them each
  shard would count from 0, and after the load balancer a rank's second chunk sits at the far end).
- ``gradient_ranks``: FSDP2 averages gradients over dp_shard x cp, and each rank's loss sums the token losses of its
  1/cp of the sequence, so a micro-step's loss is divided by N_global / (dp x cp x GAS): the gradient and the logged
  loss are then those of one process over the whole batch.
- the refusals (``recipe_problems``, ``model_problem``, ``device_problem``): what CP cannot split, named with why.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from pretrain.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from pretrain.distributed.layout import Launch

CPU_ERROR = ("NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a "
             "sharding strategy registered")
"""What torch 2.13's ring attention raises on CPU (2 processes over gloo, tiny Llama, CP 2): it dispatches the CUDA SDPA
kernels only (flash, efficient, cuDNN)."""
ATTENTION_MODULE_SUFFIX = "self_attn"
"""accelerate's CP hooks attach to the modules whose name ends so (``_attach_context_parallel_hooks``)."""


def recipe_problems(seq_len: int, cp_size: int, attention: str, document_masking: bool) -> list[str]:
    """What of a recipe context parallelism cannot split (empty: nothing). The launch (``preflight.check_layout``) and
    the estimator and planner (``plan.memory.parallel.check_context_parallel``) ask here."""
    if cp_size <= 1:
        return []
    problems = []
    chunks = 2 * cp_size
    if seq_len % chunks:
        lower, upper = seq_len // chunks * chunks, -(-seq_len // chunks) * chunks
        nearest = ", ".join(str(v) for v in (lower, upper) if v > 0)
        problems.append(f"data.seq_len {seq_len} is not divisible by 2 x cp_size = {chunks}: torch's context_parallel "
                        f"splits every sequence into {chunks} chunks and gives CP rank i chunks i and {chunks - 1}-i (its "
                        "load balancer: each rank then does the same share of the causal attention); use a multiple "
                        f"of {chunks} ({nearest})")
    if attention != "sdpa":
        problems.append(f"model.attention = {attention}: context parallelism replaces SDPA with ring attention (torch's "
                        "context_parallel dispatches the SDPA kernels only, and accelerate's hooks call SDPA with "
                        "is_causal=True); set model.attention=sdpa")
    if document_masking:
        problems.append("data.document_masking = true cannot run context parallel: its per-document position ids and "
                        "the block-causal mask built from them are not split along the sequence by CP's load balancer "
                        f"(it cuts every row into {chunks} equal chunks whatever the documents, and accelerate's hooks "
                        "drop every attention mask for plain causal attention), so tokens would attend across "
                        "documents; set data.document_masking=false or cp_size 1")
    return problems


def device_problem(cp_size: int, cuda: bool) -> str | None:
    """Why CP cannot run on this launch's device (None: it can). ``cuda``: the processes will train on CUDA GPUs."""
    if cp_size <= 1 or cuda:
        return None
    return (f"context parallelism (parallelism_config_cp_size = {cp_size}) runs on CUDA GPUs only: torch's ring "
            "attention (context_parallel) has no sharding strategy for the CPU SDPA kernel, so a CPU launch fails "
            f"inside its first forward with `{CPU_ERROR}`; launch it on 2+ GPUs, or set parallelism_config_cp_size: 1 "
            "(accelerate_configs/fsdp.yaml) on this machine")


def model_problem(model: Any, arch: str, cp_size: int) -> str | None:
    """Why this transformers model cannot run context parallel (None: it can); ``model`` may be on the meta device.

    transformers' ``supports_context_parallel`` is the library's answer (full-attention layers only: a sliding-window
    or chunked layer would lose its mask to accelerate's hooks and train as full causal, which accelerate refuses at
    prepare; attention sinks cannot be expressed by SDPA). And accelerate's hooks find the attention by its module name:
    a model that names it otherwise would keep its mask, which ring attention cannot take."""
    if cp_size <= 1:
        return None
    if not model.supports_context_parallel:
        config = model.config.get_text_config()
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            what = f"attention layers of type {sorted({t for t in layer_types if t != 'full_attention'})}"
        elif getattr(config, "sliding_window", None) is not None:
            what = f"sliding-window attention in every layer (its config's sliding_window = {config.sliding_window})"
        else:
            what = f"attention transformers' {type(model).__name__} marks as unable to run context parallel"
        fix = (" (for full attention: model.config_overrides: {sliding_window: null})"
               if getattr(config, "sliding_window", None) is not None and layer_types is None else "")
        return (f"model.arch = {arch} has {what}: context parallelism can only express full causal attention "
                "(accelerate's hooks drop every layer's mask and call SDPA with is_causal=True), so accelerate refuses "
                f"such a model at prepare; use a full-attention architecture{fix} or cp_size 1")
    if not any(name.endswith(ATTENTION_MODULE_SUFFIX) for name, _ in model.named_modules()):
        return (f"model.arch = {arch} names no attention module '*.{ATTENTION_MODULE_SUFFIX}', where accelerate's CP "
                "hooks attach (they drop the attention mask, which ring attention cannot take, for is_causal=True); "
                "use a Llama-style architecture (llama, qwen2, mistral without sliding window, ...) or cp_size 1")
    return None


def check_launch_device(launch: Launch, cuda: bool) -> None:
    """Raise the device refusal (``device_problem``) for ``launch``."""
    problem = device_problem(launch.cp_size, cuda)
    if problem:
        raise ConfigError(problem)


def gradient_ranks(launch: Launch) -> int:
    """The ranks FSDP2 averages gradients over: dp_shard x cp (x dp_replicate), the world without TP. TP ranks compute
    the same loss on the same tokens; CP ranks each the loss of their part of the sequence."""
    return launch.data_parallel_size * launch.cp_size


def forward_inputs(input_ids: torch.Tensor, targets: torch.Tensor, attention_kwargs: dict[str, Any],
                   cp_size: int) -> dict[str, Any]:
    """The model's keyword arguments for a micro-batch: the already-shifted targets as ``shift_labels`` (``labels``
    only makes the model compute its loss); under CP also position ids 0..seq-1, which ``split_sequences`` splits with
    the inputs."""
    inputs: dict[str, Any] = {"input_ids": input_ids, "labels": targets, "shift_labels": targets, **attention_kwargs}
    if cp_size > 1:
        import torch

        if attention_kwargs:  # document masking: refused before any process (recipe_problems)
            raise ConfigError("context parallelism cannot take per-document attention arguments "
                              f"({', '.join(attention_kwargs)}); set data.document_masking=false")
        batch, seq_len = input_ids.shape
        # Contiguous, not an expand: context_parallel splits a buffer in place (resize_ and copy_).
        inputs["position_ids"] = torch.arange(seq_len, device=input_ids.device).repeat(batch, 1)
    return inputs


def sequence_buffers(inputs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors CP splits along the sequence (dimension 1): inputs, targets (``labels`` is the same tensor: split
    once) and position ids."""
    return [inputs["input_ids"], inputs["shift_labels"], inputs["position_ids"]]


@contextmanager
def split_sequences(accelerator: Any, inputs: dict[str, Any], cp_size: int) -> Iterator[None]:
    """Run the block (a micro-step's forward and backward, or an evaluation forward) with ``inputs`` split along the
    sequence over the CP ranks and ring attention in place of SDPA (accelerate's ``maybe_context_parallel``); nothing
    without CP. The buffers stay split afterwards (``no_restore_buffers``): nothing reads a batch after its step."""
    if cp_size <= 1:
        yield
        return
    buffers = sequence_buffers(inputs)
    with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                            no_restore_buffers=set(buffers)):
        yield
