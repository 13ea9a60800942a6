"""Tensor parallelism under FSDP2: transformers' TP plan of the architecture on accelerate's device mesh.

accelerate owns the mesh (``parallelism_config``: dp_replicate x dp_shard x tp, tp innermost) and transformers owns
what is split (the architecture's ``base_model_tp_plan``: colwise q/k/v/gate/up, rowwise o/down, a vocab-parallel
embedding and LM head). pretrain applies the plan to the model on the meta device, then FSDP2 shards the result over
the data-parallel dimension (``shard_fsdp2``), so no rank ever allocates more than its 1/(tp x shard) of a weight.

Two version traps of accelerate 1.15 + transformers 5.24, handled here and nowhere else:

- accelerate's ``Accelerator.prepare`` under FSDP2 + TP imports ``ReplicateParallel`` from
  ``transformers.integrations.tensor_parallel``, which transformers 5.24 no longer has, to wrap every parameter that
  is not yet a DTensor. pretrain hands prepare a model whose every parameter already is one (``parallelize``), so
  the class is imported but never used: ``allow_accelerate_tp_prepare`` installs a stand-in of that name that
  raises if accelerate ever does instantiate it (a future accelerate that needs it fails loudly, not silently).
- accelerate builds its device mesh only for accelerator launches (a CPU launch is MULTI_CPU, which its
  ``ParallelismConfig`` refuses); on CPU pretrain builds the same mesh once the process group exists
  (``attach_parallelism``), as it switches the state to FSDP there (``fsdp_on_cpu``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pretrain.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a model is split: tp_plan_problem is asked before any process starts
    import torch

TP_SHIM_NAME = "ReplicateParallel"
"""What accelerate 1.15's ``_prepare_tp`` imports from ``transformers.integrations.tensor_parallel``."""


def tp_plan_problem(config: Any, arch: str, tp_size: int) -> str | None:
    """Why this architecture cannot run tensor parallel (None: it can). ``config`` is its transformers config."""
    if tp_size <= 1:
        return None
    if not getattr(config, "base_model_tp_plan", None):
        return (f"model.arch = {arch} has no tensor-parallel plan in transformers (its config has no "
                f"base_model_tp_plan), so parallelism_config_tp_size = {tp_size} cannot split it; use an "
                "architecture with a plan (llama, qwen2, mistral, ...) or set tp_size to 1 (accelerate_configs/fsdp.yaml)")
    for head, style in (getattr(config, "base_model_tp_plan", None) or {}).items():
        if style not in SUPPORTED_STYLES:
            return (f"model.arch = {arch}: its tensor-parallel plan uses the style {style!r} (on {head}), which pretrain "
                    f"has not verified against one process (verified: {', '.join(sorted(SUPPORTED_STYLES))}); set "
                    "tp_size to 1")
    return None


def tp_shape_problem(num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int) -> str | None:
    """Why a model of these widths cannot be split over ``tp_size`` ranks (None: it can): every TP rank needs whole
    attention heads (query and key/value) and an equal share of the MLP."""
    for what, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("intermediate_size", intermediate_size)):
        if tp_size > 1 and value % tp_size:
            return (f"model.{what} = {value} is not divisible by tp_size {tp_size}: every TP rank needs whole heads "
                    "and an equal share of the MLP; use a tp_size that divides it")
    return None


SUPPORTED_STYLES = frozenset({"colwise", "rowwise", "embedding_rowwise", "colwise_gather_output"})
"""TP styles whose training loss pretrain's tests compare with one process (Llama-like dense blocks)."""


def parallelize(model: torch.nn.Module, tp_mesh) -> torch.nn.Module:
    """Apply the model's own TP plan on ``tp_mesh`` (the model is on the meta device), then make every parameter the
    plan leaves whole (norms) a replicated DTensor that runs its forward on the local tensor: FSDP2 then shards one
    kind of parameter over a 2-D mesh, and gradient clipping sees one mesh."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, apply_tensor_parallelism

    plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp_mesh.size()))
    names = set(dict(model.named_modules())) | set(dict(model.named_parameters()))
    tied = _tied_slots(model)
    # A tied LM head's weight is the embedding's (named_parameters lists it once): the embedding's entry shards it,
    # and _retie points the head at that DTensor.
    apply_tensor_parallelism(model, tp_mesh, {name: style for name, style in plan.items() if name in names})
    _retie(model, tied, plan, tp_mesh)
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if style == "embedding_rowwise" and isinstance(modules.get(name), torch.nn.Embedding):
            local_vocab_lookup(modules[name], tp_mesh)
    local = ALL_PARALLEL_STYLES["local_params"]
    for name, param in list(model.named_parameters()):
        if isinstance(param, DTensor):
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        owner._parameters[attr] = torch.nn.Parameter(DTensor.from_local(param, tp_mesh, [Replicate()], run_check=False),
                                                     requires_grad=param.requires_grad)
        if not getattr(owner, "_pretrain_local_params", False):
            local.install_forward(owner, tp_mesh)
            owner._pretrain_local_params = True
    return model


def local_vocab_lookup(embedding: torch.nn.Module, tp_mesh) -> None:
    """Make a vocab-parallel embedding (``embedding_rowwise``: weight Shard(0) over TP) look its rows up in its local
    shard, so that its weight's gradient is born as the local V/TP x d shard.

    transformers' EmbeddingParallel leaves the lookup to DTensor's embedding op, whose backward
    (``embedding_dense_backward``) has no vocab-sharded strategy: every TP rank builds a gradient of the whole V x d
    table, and FSDP2 redistributes it to Shard(0) only when it reduce-scatters. Under no_sync (gradient accumulation)
    that whole table is what FSDP2 keeps as the unsharded gradient through every micro-step: (TP - 1)/TP x V x d more
    than the shard, 3.7 GB in fp32 per GPU for a 128k-vocabulary 70B at TP 8 (measured on CPU:
    tests/plan/test_memory_validation.py::test_tp_model_states_match_estimate). Here each rank masks the ids outside its
    rows, runs the module's own forward on its local rows (a scaled embedding keeps its scale) and sums the ranks'
    partial lookups with one all-reduce, as transformers does; the local weight's ``to_local`` hands its gradient
    back as Shard(0)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    original = type(embedding).forward
    rank, size = tp_mesh.get_local_rank(), tp_mesh.size()

    def forward(input_ids):
        weight = embedding._parameters["weight"]  # FSDP2's unsharded parameter in forward: a Shard(0) DTensor on TP
        local = weight.to_local()
        start = rank * -(-weight.shape[0] // size)  # DTensor's Shard(0) chunks like torch.chunk
        outside = (input_ids < start) | (input_ids >= start + local.shape[0])
        padding_idx = embedding.padding_idx
        local_padding = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < local.shape[0] \
            else None
        embedding._parameters["weight"], embedding.padding_idx = local, local_padding
        try:
            out = original(embedding, (input_ids - start).masked_fill(outside, 0))
        finally:
            embedding._parameters["weight"], embedding.padding_idx = weight, padding_idx
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return DTensor.from_local(out, tp_mesh, [Partial()], run_check=False).redistribute(placements=[Replicate()]
                                                                                          ).to_local()

    embedding.forward = forward


def _tied_slots(model: torch.nn.Module) -> list[list[str]]:
    """The parameter names that share one tensor (``tie_embeddings``: the embedding's and the LM head's weight), the
    name named_parameters keeps first; groups of one are left out."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _retie(model: torch.nn.Module, tied: list[list[str]], plan: dict[str, str], tp_mesh) -> None:
    """Point every alias of a tied parameter at the DTensor the plan made of its first name.

    ``apply_tensor_parallelism`` replaces the embedding's Parameter with a DTensor one and leaves the LM head's slot
    holding the old meta tensor: the head would then become a second, replicated parameter, initialised with the head's
    seed and trained apart (measured before this: step-1 loss 5.5363 against 5.5669 on one process). Re-tied, the one
    vocab-sharded tensor serves both: the embedding's rowwise lookup and the head's colwise matmul both want it
    Shard(0) over the vocabulary. An alias whose own plan entry would place it otherwise cannot share the tensor and
    is refused.
    """
    import torch
    from torch.distributed.tensor import DTensor
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    for first, *aliases in tied:
        owner_name, _, attr = first.rpartition(".")
        shared = getattr(model.get_submodule(owner_name), attr)
        for alias in aliases:
            module_name, _, alias_attr = alias.rpartition(".")
            module = model.get_submodule(module_name)
            style = plan.get(alias) or plan.get(module_name)
            if style is not None and isinstance(shared, DTensor):
                probe = torch.nn.Module()
                probe.weight = torch.nn.Parameter(torch.empty(shared.shape, device="meta"))
                ALL_PARALLEL_STYLES[style].shard_param(probe, "weight", tp_mesh)
                wanted = getattr(probe.weight, "placements", None)
                if wanted != shared.placements:
                    raise ConfigError(
                        f"{alias} is tied to {first}, but transformers' TP plan places it {wanted} ({style}) and "
                        f"{first} {shared.placements}: one tensor cannot be both; set model.tie_embeddings=false")
            module._parameters[alias_attr] = shared


def allow_accelerate_tp_prepare() -> None:
    """Let accelerate 1.15's ``_prepare_tp`` import ``ReplicateParallel`` under transformers 5.24 (see the module
    docstring). Only when transformers lacks it; the stand-in refuses to be used."""
    import transformers.integrations.tensor_parallel as hf_tp

    if hasattr(hf_tp, TP_SHIM_NAME):
        return

    class ReplicateParallel:
        """Stand-in for the class transformers 5.24 removed; accelerate only imports it for a model whose every
        parameter is already a DTensor (pretrain's), and instantiates it only for one that is not."""

        def __init__(self, *args, **kwargs):
            raise RuntimeError("accelerate tried to tensor-parallelize a parameter pretrain had not: every parameter "
                               "must be a DTensor before prepare (pretrain.distributed.tensor_parallel.parallelize)")

    hf_tp.ReplicateParallel = ReplicateParallel


def hidden_parallelism_env(on_cpu: bool) -> dict[str, str]:
    """Remove (and return) accelerate's parallelism switch from the environment for a CPU launch, so that the
    Accelerator is built without a mesh it would refuse; ``attach_parallelism`` adds it afterwards."""
    if not on_cpu:
        return {}
    value = os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    return {} if value is None else {"ACCELERATE_USE_PARALLELISM_CONFIG": value}


def attach_parallelism(accelerator, launch) -> None:
    """On CPU, after ``fsdp_on_cpu``: accelerate's ``ParallelismConfig`` for the launch and its device mesh, built as
    accelerate builds them on GPUs (same sizes, same dimension order), and validated by accelerate."""
    from accelerate.parallelism_config import ParallelismConfig

    if launch.tp_size <= 1:
        return
    config = ParallelismConfig(dp_shard_size=launch.data_parallel_size, tp_size=launch.tp_size)
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = config.get_device_mesh("cpu")
    try:
        config._validate_accelerator(accelerator)
    except ValueError as exc:
        raise ConfigError(f"tensor parallelism on CPU: {exc}") from None
