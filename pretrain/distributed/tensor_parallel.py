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
from typing import Any

import torch

from pretrain.errors import ConfigError

TP_SHIM_NAME = "ReplicateParallel"
"""What accelerate 1.15's ``_prepare_tp`` imports from ``transformers.integrations.tensor_parallel``."""


def tp_plan_problem(config: Any, arch: str, tp_size: int, tie_embeddings: bool) -> str | None:
    """Why this architecture cannot run tensor parallel (None: it can). ``config`` is its transformers config."""
    if tp_size <= 1:
        return None
    if not getattr(config, "base_model_tp_plan", None):
        return (f"model.arch = {arch} has no tensor-parallel plan in transformers (its config has no "
                f"base_model_tp_plan), so parallelism_config_tp_size = {tp_size} cannot split it; use an "
                "architecture with a plan (llama, qwen2, mistral, ...) or set tp_size to 1 (accelerate_configs/fsdp.yaml)")
    if tie_embeddings:
        # Measured (transformers 5.24, FSDP2 x TP 2 on CPU): with the LM head tied to the vocab-parallel embedding
        # the first loss is 5.5363 against 5.5669 on one process; untied it agrees to 1e-7.
        return ("model.tie_embeddings = true cannot run tensor parallel here: the LM head tied to the vocab-parallel "
                "embedding computes a different loss from one process (measured 5.536 vs 5.567 on the first step); "
                "set model.tie_embeddings=false")
    for head, style in (getattr(config, "base_model_tp_plan", None) or {}).items():
        if style not in SUPPORTED_STYLES:
            return (f"model.arch = {arch}: its tensor-parallel plan uses the style {style!r} (on {head}), which pretrain "
                    f"has not verified against one process (verified: {', '.join(sorted(SUPPORTED_STYLES))}); set "
                    "tp_size to 1")
    return None


SUPPORTED_STYLES = frozenset({"colwise", "rowwise", "embedding_rowwise", "colwise_gather_output"})
"""TP styles whose training loss pretrain's tests compare with one process (Llama-like dense blocks)."""


def parallelize(model: torch.nn.Module, tp_mesh) -> torch.nn.Module:
    """Apply the model's own TP plan on ``tp_mesh`` (the model is on the meta device), then make every parameter the
    plan leaves whole (norms) a replicated DTensor that runs its forward on the local tensor: FSDP2 then shards one
    kind of parameter over a 2-D mesh, and gradient clipping sees one mesh."""
    from torch.distributed.tensor import DTensor, Replicate
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, apply_tensor_parallelism

    plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp_mesh.size()))
    names = set(dict(model.named_modules())) | set(dict(model.named_parameters()))
    # A tied LM head's weight is the embedding's (named_parameters lists it once): the embedding's entry shards it.
    apply_tensor_parallelism(model, tp_mesh, {name: style for name, style in plan.items() if name in names})
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
