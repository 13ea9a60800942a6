"""Expert parallelism under FSDP2: transformers' expert plan of the architecture on transformers' expert mesh.

A mixture of experts under plain FSDP all-gathers every expert of a layer on every rank, every layer, in forward and
again in backward: the whole expert stack travels although each token uses top-k of the experts. Expert parallelism
(EP) keeps whole experts on their ranks and moves the tokens instead: each group of ``ep_size`` consecutive ranks
holds every expert once (``num_experts / ep_size`` on each), and every (token, expert) pair travels to its expert's
rank and back by two all-to-alls per layer. The layout is the anchors' (torchtitan, Megatron, NeMo AutoModel) and
transformers' own (``DistributedConfig(ep_size=...)``):

- transformers owns the mesh and the plan: ``initialize_distributed_mesh`` builds the dense view (fsdp over the
  world) and the expert view (efsdp x ep, ep innermost), and the architecture's ``base_model_ep_plan`` shards the
  expert weights ``Shard(0)`` over ep (``grouped_gemm``) and installs the all-to-all dispatch on the experts module
  (``ep_dispatch_experts``, ``AllToAllEP``). The router, the attention and everything else are untouched: the
  routing, its top-k, the load-balancing loss and the router metrics are the model's own, computed on each rank's
  own tokens exactly as without EP.
- pretrain shards the experts module over efsdp (the ``world / ep_size`` copies of each expert) before
  accelerate's FSDP2 wrapping shards the rest over the world, so every parameter lives on one rank's share only.
- The expert gradients: an expert's rank receives tokens of every rank of its EP group, and its copies across
  groups saw the other groups' tokens, so its gradient is the sum over all ``world`` data-parallel ranks' losses.
  FSDP2 divides by its group (efsdp) by default; the divide factor here is the world, as for every dense parameter
  (reduce-scatter as a sum, divided locally: FSDP2's PREMUL_SUM is NCCL-only and zeroes bf16 before torch 2.13).
- Checkpoint keys are the model's own (DTensors keep their names and global shapes), so torch.distributed.checkpoint
  reshards a checkpoint onto another EP degree or onto no EP, and pretrain-export writes the plain model.

Gradient clipping across the two meshes (dense on the world, experts on efsdp x ep) is accelerate's
``clip_grad_norm_``: it takes each mesh's norm apart and combines them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pretrain.distributed.layout import Launch

EP_IMPLEMENTATION = "all_to_all"
"""transformers' token exchange (``EPImplementationInterface``): in training every rank holds its own batch."""


def transformers_problem(ep_size: int) -> str | None:
    """Why this environment's transformers cannot run expert parallelism (None: it can), found without importing it
    (the planner answers in well under two seconds): its ``distributed/expert_parallel.py``."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec
    from pathlib import Path

    spec = find_spec("transformers")
    if spec is not None and spec.origin and (Path(spec.origin).parent / "distributed" / "expert_parallel.py").is_file():
        return None
    try:
        installed = version("transformers")
    except PackageNotFoundError:
        installed = "none"
    return (f"model.moe.ep_size = {ep_size} needs transformers' expert parallelism (transformers.distributed."
            f"expert_parallel, verified with transformers 5.24); this environment has transformers {installed}: "
            "upgrade it, or set model.moe.ep_size=1")


def ep_plan_problem(config: Any, arch: str, ep_size: int) -> str | None:
    """Why this architecture cannot run expert parallel in this environment (None: it can). ``config`` is its
    transformers config."""
    if ep_size <= 1:
        return None
    problem = transformers_problem(ep_size)
    if problem:
        return problem
    plan = getattr(config, "base_model_ep_plan", None) or {}
    if "ep_dispatch_experts" not in plan.values():
        return (f"model.arch = {arch} has no expert-parallel plan with a token dispatch in transformers (its config's "
                "base_model_ep_plan), so model.moe.ep_size cannot split its experts; set model.moe.ep_size=1")
    return None


def parallelize_experts(model: torch.nn.Module, launch: Launch, fsdp_kwargs: dict[str, Any]) -> torch.nn.Module:
    """Apply the model's expert plan on transformers' expert mesh (the model is on the meta device) and shard each
    experts module over its copies (efsdp) with ``fsdp_kwargs`` (accelerate's: mixed precision, resharding); the
    caller's FSDP2 wrapping then shards the rest over the world."""
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed import DistributedConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    from transformers.distributed.utils import initialize_distributed_mesh

    from pretrain.system.quiet import drop_expert_mesh_messages

    drop_expert_mesh_messages()
    distributed = DistributedConfig(fsdp_size=launch.world_size, ep_size=launch.ep_size,
                                    ep_implementation=EP_IMPLEMENTATION)
    _, meshes = initialize_distributed_mesh(distributed)
    _, ep_plan, _ = model._resolve_parallel_plans(distributed)
    apply_expert_parallelism(model, meshes.get_mesh("ep"), meshes.get_mesh("tp"), ep_plan,
                             ep_implementation=EP_IMPLEMENTATION)
    copies = meshes.get_mesh("efsdp")
    for name, module in model.named_modules():
        if ep_plan.get(name) != "ep_dispatch_experts":
            continue
        fully_shard(module, mesh=copies, **fsdp_kwargs)
        # the gradient of a copy sums every data-parallel rank's tokens (see the module docstring): divide by the
        # world, as FSDP2 does for the dense parameters
        module.set_gradient_divide_factor(float(launch.world_size))
        if launch.efsdp_size > 1:
            # (with one copy there is no reduce-scatter: FSDP2 applies the factor itself)
            module.set_force_sum_reduction_for_comms(True)
    return model


def expert_shards(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Each expert weight's experts on this rank: name -> (first expert, number), from its DTensor's local shard
    (what the memory test and the run's first lines report)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shards = {}
    for name, param in model.named_parameters():
        if ".experts." in name and isinstance(param, DTensor):
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            shards[name] = (offset[0], shape[0])
    return shards


def describe(model: torch.nn.Module, launch: Launch) -> str:
    """The run's line about its experts: the EP groups and the experts this rank holds."""
    shards = expert_shards(model)
    first, count = next(iter(shards.values())) if shards else (0, 0)
    copies = (f"{launch.efsdp_size} copies of each expert, FSDP-sharded among themselves" if launch.efsdp_size > 1
              else "one copy of each expert")
    return (f"experts: EP {launch.ep_size} (tokens travel by all-to-all within each group of {launch.ep_size} "
            f"consecutive ranks; {copies}): rank {launch.rank} holds experts {first}-{first + count - 1} of every "
            "MoE layer")
