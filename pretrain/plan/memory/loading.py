"""model.init_from's load: what each rank reads of the checkpoint and the most it holds at once beside its
parameters (``pretrain.model.pretrained`` reads a rank's region of every tensor; of an MoE layer's experts, those in
its rows, which this counts as all of them: an upper bound). Read from the recipe and the checkpoint's config.json
alone: no weights are needed."""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.distributed.layout import Launch
from pretrain.plan.memory.states import _fsdp_ranks
from pretrain.recipe.init_from import checkpoint_config
from pretrain.recipe.shape import ModelShape

GIB = 2**30
# config.json's dtype (transformers 5 writes `dtype`, 4 wrote `torch_dtype`) -> bytes per element in the files
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class LoadMemory:
    checkpoint_bytes: int
    """The checkpoint's tensors (config.json's dtype)."""
    read_bytes: int
    """What one rank reads: its share of every tensor (an MoE's fused experts whole)."""
    at_once_bytes: int
    """The most host memory the load holds at once beside the rank's parameters: the largest read."""
    ranks: int
    """The ranks each tensor is split over (1: every rank reads the whole model)."""
    dtype: str

    def line(self) -> str:
        share = "'s share" if self.ranks > 1 else ""
        split = (f"each rank reads 1/{self.ranks} of each tensor" if self.ranks > 1 else
                 "every rank reads the whole model (its layout holds it whole)")
        return (f"{self.checkpoint_bytes / GIB:,.2f} GiB of {self.dtype} weights; {split}: {self.read_bytes / GIB:,.2f} "
                f"GiB per rank, at most {self.at_once_bytes / GIB:,.3f} GiB of host memory at once beside its "
                f"parameters (the largest tensor{share})")


def split_ranks(launch: Launch) -> int:
    """The ranks one parameter's values are split over: FSDP's shard group (x TP), ZeRO-3's partition; else 1."""
    if launch.engine == "fsdp" and (launch.fsdp_sharding or "FULL_SHARD") != "NO_SHARD":
        return _fsdp_ranks(launch, launch.fsdp_sharding or "FULL_SHARD")[0] * launch.tp_size
    if launch.engine == "deepspeed" and launch.zero_stage == 3:
        return launch.world_size
    return launch.tp_size


def load_memory(recipe, launch: Launch) -> LoadMemory | None:
    """The load of ``recipe``'s model.init_from on ``launch`` (None: the recipe starts from random weights)."""
    if recipe.model.init_from is None:
        return None
    config = checkpoint_config(recipe.model.init_from) or {}  # {}: a pretrain checkpoint, viewed in fp32
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    size = _DTYPE_BYTES.get(dtype, 4)
    shape = ModelShape.from_recipe(recipe)
    sizes = shape.param_sizes()
    ranks = split_ranks(launch)
    fused = 0
    if shape.num_experts:  # gate_up_proj, assembled whole from the per-expert tensors before it is sliced
        fused = shape.num_experts * 2 * shape.intermediate_size * shape.hidden_size
        expert_total = 3 * shape.num_experts * shape.intermediate_size * shape.hidden_size * shape.num_layers
        read = (sum(sizes) - expert_total) / ranks + expert_total
    else:
        read = sum(sizes) / ranks
    at_once = max(-(-max(sizes) // ranks), fused)
    return LoadMemory(sum(sizes) * size, int(read * size), at_once * size, ranks, dtype)
