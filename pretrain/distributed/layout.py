"""The launch, read once: how many processes on how many machines, which engine, ZeRO stage, offload.

A ``Launch`` is built in exactly one of two ways and then passed around as a value:

- ``Launch.from_env()`` inside a training process, from what ``accelerate launch`` / torchrun exported
  (``WORLD_SIZE``, ``RANK``, ``GROUP_WORLD_SIZE``, ``ACCELERATE_*``);
- ``Launch.from_accelerate_config(path, args)`` before any process exists (``pretrain-launch``,
  ``pretrain-slurm``, ``pretrain-estimate``), from the accelerate config file and the command-line
  options that override it: the same value the processes will build from their environment.

The batch plan, the pre-launch checks, the Accelerator builder, the DeepSpeed config and the memory
estimator all read this value; no other module reads the launch environment or parses an accelerate
config. ``accelerate_command`` is the one place that writes an ``accelerate launch`` command line.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pretrain.errors import ConfigError
from pretrain.recipe import safe_yaml

RUN_PY = Path(__file__).resolve().parents[1] / "run.py"
"""The training entry point every launch command starts."""
DOCTOR_ENTRY = ("-m", "pretrain", "doctor")
"""`pretrain doctor` as accelerate launch starts it (``-m``: a module, in every process)."""

# The largest count any option takes (processes, nodes, steps, workers, ...): a C int, as torch, SLURM and
# the OS take them; a larger number is a typo, not a cluster. (Here, below cli/options.py, which reads it.)
MAX_COUNT = 2**31 - 1
ENGINES = ("ddp", "fsdp", "deepspeed")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# accelerate's distributed types that are plain data parallelism (or one process).
_DDP_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_HPU")
# accelerate config keys (and their `accelerate launch --<key>` options) under deepspeed_config, and the
# environment variables accelerate launch turns them into.
_DEEPSPEED_ENV = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
}
HPZ_KEY = "zero_hpz_partition_size"
"""DeepSpeed ZeRO++'s hierarchical partitioning (hpZ): a DeepSpeed JSON's zero_optimization key. "auto": the
launch's GPUs per node."""
# accelerate's parallelism_config keys (accelerate config file, `accelerate launch --<key>`) and the environment
# variables accelerate launch exports for them. pretrain runs data parallelism and, under FSDP2, tensor parallelism
# (tp_size: transformers' TP plan of the architecture, pretrain/distributed/tensor_parallel.py) and context
# parallelism (cp_size: pretrain/distributed/context_parallel.py); not SP.
_PARALLELISM_ENV = {
    "parallelism_config_dp_replicate_size": "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
    "parallelism_config_dp_shard_size": "PARALLELISM_CONFIG_DP_SHARD_SIZE",
    "parallelism_config_tp_size": "PARALLELISM_CONFIG_TP_SIZE",
    "parallelism_config_cp_size": "PARALLELISM_CONFIG_CP_SIZE",
    "parallelism_config_sp_size": "PARALLELISM_CONFIG_SP_SIZE",
}


@dataclass(frozen=True)
class Launch:
    """How a run is (or will be) distributed. The first six fields are what memory depends on."""

    engine: str = "ddp"
    """ddp (PyTorch DDP, or one process), fsdp (accelerate's FSDP) or deepspeed."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3 (0 unless engine is deepspeed)."""
    offload_optimizer: str = "none"
    """DeepSpeed optimizer-state offload device: none, cpu or nvme."""
    offload_params: str = "none"
    """DeepSpeed (ZeRO-3) or FSDP parameter offload device: none, cpu or nvme."""
    num_nodes: int = 1
    gpus_per_node: int = 1
    """Processes per node (one per GPU on a GPU cluster)."""
    rank: int = 0
    """This process's global rank (0 outside a launched process)."""
    local_rank: int = 0
    """This process's rank on its node (0 outside a launched process)."""
    mixed_precision: str = "no"
    """What the accelerate config says about precision; the recipe owns it, so this must agree or be 'no'."""
    fsdp_sharding: str | None = None
    """FSDP's sharding strategy (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, ...)."""
    zero3_init: bool | None = None
    """accelerate's zero3_init_flag (None: not set, pretrain decides)."""
    deepspeed_config_file: str | None = None
    """A user's DeepSpeed JSON named by the accelerate config, merged with the recipe's fields."""
    deepspeed_fields: Mapping[str, str] = field(default_factory=dict)
    """gradient_accumulation_steps / gradient_clipping as the accelerate config gave them (checked, not used)."""
    hybrid_shard_size: int | None = None
    """Hybrid sharding: the ranks (one node's GPUs) that shard one replica of the parameters; the replicas span
    the nodes. DeepSpeed ZeRO-3 hpZ (zero_optimization.zero_hpz_partition_size: a secondary copy of the
    compute-dtype parameters partitioned within the group, where backward gathers them) or FSDP2 HSDP
    (accelerate's parallelism_config dp_shard_size: every state sharded within the group, dp_replicate_size
    copies). None: sharded over the whole world."""
    tp_size: int = 1
    """Tensor parallelism (FSDP2 only, accelerate's parallelism_config tp_size): each group of tp_size consecutive
    ranks splits every layer's matmuls and sees the same micro-batches; FSDP shards over the other dimension."""
    cp_size: int = 1
    """Context parallelism (FSDP2 only, accelerate's parallelism_config cp_size): each group of cp_size x tp_size ranks
    reads the same micro-batches and splits every sequence of them over its cp ranks (pretrain/distributed/
    context_parallel.py); FSDP shards over dp_shard x cp (accelerate's dp_shard_cp)."""
    ep_size: int = 1
    """Expert parallelism (FSDP2 only; the recipe's model.moe.ep_size, set by ``for_recipe``: accelerate's
    parallelism_config has no expert dimension): each group of ep_size consecutive ranks holds the experts split
    between them; the world stays data parallel, and the dense part is FSDP over it (pretrain/distributed/
    expert_parallel.py)."""

    def __post_init__(self):
        check_launch(self)

    def for_recipe(self, recipe) -> Launch:
        """This launch with the layout choices the recipe makes (model.moe.ep_size), checked against it."""
        moe = recipe.model.moe
        ep_size = moe.ep_size if moe is not None else 1
        return self if ep_size == self.ep_size else replace(self, ep_size=ep_size)

    # ---- derived ------------------------------------------------------------------------------
    @property
    def efsdp_size(self) -> int:
        """Copies of each expert (one per group of ep_size ranks), FSDP-sharded among themselves: world / ep_size."""
        return self.world_size // self.ep_size

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def uses_deepspeed(self) -> bool:
        return self.engine == "deepspeed"

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data: the world over the tensor- and context-parallel sizes (the batch plan's
        world)."""
        return self.world_size // (self.tp_size * self.cp_size)

    @property
    def data_rank(self) -> int:
        """This process's rank among the data-parallel ranks. accelerate's device mesh puts tp innermost, then cp
        (dp_replicate, dp_shard, cp, tp): the tp x cp consecutive ranks of one group read the same micro-batches (TP
        splits the layers, CP the sequences)."""
        return self.rank // (self.tp_size * self.cp_size)

    @property
    def num_replicas(self) -> int:
        """Copies of the sharded states: world / hybrid_shard_size (1 unless hybrid)."""
        return self.data_parallel_size // self.hybrid_shard_size if self.hybrid_shard_size else 1

    def hybrid_text(self) -> str:
        """How describe() and the planner name the hybrid part ("" when not hybrid)."""
        if not self.hybrid_shard_size:
            return ""
        what = "hpZ" if self.uses_deepspeed else "HSDP"
        return f"{what}: sharded within {self.hybrid_shard_size} GPUs, {self.num_replicas} replicas"

    def describe(self, unit: str = "GPU") -> str:
        """The layout in a line, its processes counted as ``unit`` (a dry run on a CPU: "CPU process")."""
        if self.engine == "ddp":
            what = "PyTorch DDP" if self.world_size > 1 else "one process (no data parallelism)"
        elif self.engine == "fsdp":
            what = f"FSDP {self.fsdp_sharding or 'FULL_SHARD'}"
            if self.hybrid_shard_size:
                what += f" ({self.hybrid_text()})"
            if self.tp_size > 1 or self.cp_size > 1:
                what += "".join(f" x {name} {size}" for name, size in (("TP", self.tp_size), ("CP", self.cp_size))
                                if size > 1) + f" ({self.data_parallel_size}-way data parallel)"
            if self.ep_size > 1:
                what += f" x EP {self.ep_size}" + (f" ({self.efsdp_size} copies of each expert)"
                                                   if self.efsdp_size > 1 else "")
            if self.offload_params != "none":
                what += f" (offload params -> {self.offload_params})"
        else:
            what = f"DeepSpeed ZeRO-{self.zero_stage}"
            if self.hybrid_shard_size:
                what += f" ({self.hybrid_text()})"
            offload = [f"optimizer -> {self.offload_optimizer}"] * (self.offload_optimizer != "none")
            offload += [f"params -> {self.offload_params}"] * (self.offload_params != "none")
            if offload:
                what += f" (offload {', '.join(offload)})"
        gpus = f"{self.num_nodes} x {self.gpus_per_node}" if self.num_nodes > 1 else f"{self.gpus_per_node}"
        plural = ("es" if unit.endswith("s") else "s") if self.world_size > 1 else ""
        return f"{what} on {gpus} {unit}{plural}"

    def to_dict(self) -> dict[str, Any]:
        """What the run config records about the launch."""
        return {
            "engine": self.engine, "zero_stage": self.zero_stage if self.uses_deepspeed else None,
            "fsdp_sharding": self.fsdp_sharding, "offload_optimizer": self.offload_optimizer,
            "offload_params": self.offload_params, "world_size": self.world_size, "num_machines": self.num_nodes,
            "hybrid_shard_size": self.hybrid_shard_size, "tp_size": self.tp_size, "cp_size": self.cp_size,
            "ep_size": self.ep_size,
        }  # fmt: skip

    # ---- built from the environment of a launched process ---------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Launch:
        """This process's launch, from the variables accelerate launch / torchrun export.

        ``python pretrain/run.py`` exports none of them: one process, engine ddp.
        """
        world_size = int(environ.get("WORLD_SIZE", "1") or 1)
        # torchrun exports GROUP_WORLD_SIZE: one rendezvous group per node.
        num_nodes = int(environ.get("GROUP_WORLD_SIZE", "1") or 1)
        if world_size % num_nodes:
            num_nodes = 1  # an unusual torchrun set-up: count processes, not nodes
        common = dict(num_nodes=num_nodes, gpus_per_node=world_size // num_nodes,
                      rank=int(environ.get("RANK", "0") or 0), local_rank=int(environ.get("LOCAL_RANK", "0") or 0),
                      mixed_precision=environ.get("ACCELERATE_MIXED_PRECISION", "no").lower())
        if environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            _refuse_cp_outside_fsdp(environ.get("PARALLELISM_CONFIG_CP_SIZE")
                                    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true"
                                    else None, "the accelerate launch environment", "DeepSpeed")
            ds = {key: environ.get(var) for key, var in _DEEPSPEED_ENV.items()}
            return cls._deepspeed(ds, "the accelerate launch environment", **common)
        if environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            offload = environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"
            parallelism = ({key: environ.get(var) for key, var in _PARALLELISM_ENV.items()}
                           if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true" else {})
            strategy, hybrid, tp, cp = _fsdp_layout(
                environ.get("FSDP_SHARDING_STRATEGY"), environ.get("FSDP_RESHARD_AFTER_FORWARD"),
                environ.get("FSDP_VERSION"), parallelism, common["num_nodes"], common["gpus_per_node"],
                "the accelerate launch environment")
            return cls("fsdp", offload_params="cpu" if offload else "none", fsdp_sharding=strategy,
                       hybrid_shard_size=hybrid, tp_size=tp, cp_size=cp, **common)
        _refuse_cp_outside_fsdp(environ.get("PARALLELISM_CONFIG_CP_SIZE")
                                if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true" else None,
                                "the accelerate launch environment", "DDP")
        return cls("ddp", **common)

    # ---- built from an accelerate config file, before any process exists -------------------------
    @classmethod
    def from_accelerate_config(cls, path: str | os.PathLike | None, accelerate_args: Sequence[str] = (), *,
                               num_nodes: int | None = None, gpus_per_node: int | None = None) -> Launch:
        """The launch ``accelerate launch --config_file path <accelerate_args>`` would start.

        Command-line options (``--num_processes``, ``--num_machines``, ``--mixed_precision``,
        ``--zero_stage``, ...) override the file, as they do for accelerate; ``num_nodes`` /
        ``gpus_per_node`` override both (a planner asking "what if").
        """
        config = read_accelerate_config(path) if path is not None else {}
        source = f"accelerate config {path}" if path is not None else "the accelerate launch options"
        kind = str(option_value(accelerate_args, "--distributed_type") or config.get("distributed_type", "NO")).upper()
        if "--use_deepspeed" in accelerate_args:
            kind = "DEEPSPEED"
        elif "--use_fsdp" in accelerate_args:
            kind = "FSDP"
        nodes = num_nodes or _count(option_value(accelerate_args, "--num_machines") or config.get("num_machines", 1)
                                    or 1, "num_machines", source)
        processes = _count(option_value(accelerate_args, "--num_processes") or config.get("num_processes", 1) or 1,
                           "num_processes", source)
        if gpus_per_node is None:
            if processes % nodes:
                raise ConfigError(f"{source}: num_processes ({processes}) is not divisible by num_machines ({nodes})")
            gpus_per_node = processes // nodes
        precision = str(option_value(accelerate_args, "--mixed_precision") or config.get("mixed_precision", "no")).lower()
        common = dict(num_nodes=nodes, gpus_per_node=gpus_per_node, mixed_precision=precision)
        parallelism = dict(config.get("parallelism_config") or {})
        for key in _PARALLELISM_ENV:
            value = option_value(accelerate_args, f"--{key}")
            if value is not None:
                parallelism[key] = value
        if kind in _DDP_TYPES:
            _refuse_cp_outside_fsdp(parallelism.get("parallelism_config_cp_size"), source, "DDP")
            return cls("ddp", **common)
        if kind == "FSDP":
            fsdp = config.get("fsdp_config") or {}
            offload = str(fsdp.get("fsdp_offload_params", False)).lower() == "true"
            strategy, hybrid, tp, cp = _fsdp_layout(
                option_value(accelerate_args, "--fsdp_sharding_strategy") or fsdp.get("fsdp_sharding_strategy"),
                option_value(accelerate_args, "--fsdp_reshard_after_forward") or fsdp.get("fsdp_reshard_after_forward"),
                option_value(accelerate_args, "--fsdp_version") or fsdp.get("fsdp_version"), parallelism, nodes,
                gpus_per_node, source)
            return cls("fsdp", offload_params="cpu" if offload else "none", fsdp_sharding=strategy,
                       hybrid_shard_size=hybrid, tp_size=tp, cp_size=cp, **common)
        if kind != "DEEPSPEED":
            raise ConfigError(f"{source}: distributed_type {kind} is not supported; use DEEPSPEED, FSDP, "
                              "MULTI_GPU, MULTI_CPU or NO")
        _refuse_cp_outside_fsdp(parallelism.get("parallelism_config_cp_size"), source, "DeepSpeed")
        ds = dict(config.get("deepspeed_config") or {})
        for key in _DEEPSPEED_ENV:
            value = option_value(accelerate_args, f"--{key}")
            if value is not None:
                ds[key] = value
        return cls._deepspeed({k: None if v is None else str(v) for k, v in ds.items()}, source, **common)

    @classmethod
    def _deepspeed(cls, ds: Mapping[str, str | None], source: str, **common) -> Launch:
        """DeepSpeed fields from accelerate's names (file keys and environment agree on them)."""
        config_file = ds.get("deepspeed_config_file")
        config_file = config_file if config_file not in (None, "", "none") else None
        zero: dict[str, Any] = {}
        if config_file is not None and Path(config_file).is_file():
            try:  # a missing or broken file is reported by the DeepSpeed config builder, with its fix
                zero = json.loads(Path(config_file).read_text()).get("zero_optimization") or {}
            except (OSError, json.JSONDecodeError, AttributeError):
                zero = {}
        stage = ds.get("zero_stage")
        stage = stage if stage not in (None, "") else zero.get("stage", 2)
        try:
            stage = int(stage)
        except (TypeError, ValueError):
            raise ConfigError(f"{source}: deepspeed_config.zero_stage = {stage!r}; use 0, 1, 2 or 3") from None
        off_opt = ds.get("offload_optimizer_device") or (zero.get("offload_optimizer") or {}).get("device") or "none"
        off_par = ds.get("offload_param_device") or (zero.get("offload_param") or {}).get("device") or "none"
        init = ds.get("zero3_init_flag")
        fields = {k: str(ds[k]) for k in ("gradient_accumulation_steps", "gradient_clipping") if ds.get(k) is not None}
        hpz = _hpz_size(zero.get(HPZ_KEY), common["gpus_per_node"], config_file)
        return cls("deepspeed", stage, str(off_opt).lower(), str(off_par).lower(),
                   zero3_init=None if init in (None, "") else str(init).lower() == "true",
                   deepspeed_config_file=config_file, deepspeed_fields=fields, hybrid_shard_size=hpz, **common)


def _hpz_size(value: Any, gpus_per_node: int, config_file: str | None) -> int | None:
    """zero_optimization.zero_hpz_partition_size of a DeepSpeed JSON: "auto" is the GPUs per node; 0 or 1
    (DeepSpeed's default) is no hpZ."""
    if value in (None, 0, 1, "0", "1"):
        return None
    if str(value).lower() == "auto":
        return gpus_per_node
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = -1
    if size < 0 or str(size) != str(value).strip():
        raise ConfigError(f"{config_file}: zero_optimization.{HPZ_KEY} = {value!r}; use \"auto\" (the GPUs per node) "
                          "or a whole number of GPUs that divides the world size")
    return size


def _fsdp_layout(strategy: str | int | None, reshard_after_forward: str | bool | None, version: str | int | None,
                 parallelism: Mapping[str, Any], nodes: int, gpus_per_node: int,
                 source: str) -> tuple[str, int | None, int, int]:
    """(sharding strategy, hybrid_shard_size, tp_size, cp_size) of an FSDP launch. HSDP: FSDP2 with accelerate's
    parallelism_config (dp_replicate_size x dp_shard_size [x cp_size] [x tp_size]); FSDP1's HYBRID_SHARD strategies
    shard within a node (torch's default)."""
    name = _fsdp_strategy(strategy, reshard_after_forward)
    fsdp2 = str(version or "1") == "2"
    if name.startswith("HYBRID_SHARD"):
        if fsdp2:
            raise ConfigError(f"{source}: FSDP2 has no {name} strategy (accelerate takes only true / false for "
                              "fsdp_reshard_after_forward); hybrid sharding with FSDP2 is accelerate's parallelism_config: "
                              "see accelerate_configs/multinode_hsdp.yaml")
        return ("FULL_SHARD" if name == "HYBRID_SHARD" else "SHARD_GRAD_OP"), gpus_per_node, 1, 1
    sizes = {}
    for key, value in parallelism.items():
        if key not in _PARALLELISM_ENV or value in (None, ""):
            continue
        try:
            sizes[key] = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{source}: parallelism_config.{key} = {value!r}; use a whole number") from None
    if sizes.get("parallelism_config_sp_size", 1) != 1:
        raise ConfigError(f"{source}: parallelism_config_sp_size = {sizes['parallelism_config_sp_size']}: DeepSpeed's "
                          "sequence parallelism (Ulysses) is not supported by pretrain; set it to 1 (context "
                          "parallelism is parallelism_config_cp_size, under FSDP2)")
    world = nodes * gpus_per_node
    tp = sizes.get("parallelism_config_tp_size", 1)
    if tp < 1 or world % tp:
        raise ConfigError(f"{source}: parallelism_config_tp_size = {tp} must be a whole number that divides the "
                          f"{world} processes")
    if tp > 1 and not fsdp2:
        raise ConfigError(f"{source}: parallelism_config_tp_size = {tp} needs fsdp_version: 2 (accelerate composes "
                          "TP with FSDP2 only); see accelerate_configs/fsdp2_tp2.yaml")
    cp = sizes.get("parallelism_config_cp_size", 1)
    if cp < 1 or world % (tp * cp):
        raise ConfigError(f"{source}: parallelism_config_cp_size = {cp}" + (f" x tp_size {tp}" if tp > 1 else "")
                          + f" must be a whole number that divides the {world} processes")
    if cp > 1 and not fsdp2:
        raise ConfigError(f"{source}: parallelism_config_cp_size = {cp} needs fsdp_version: 2 (accelerate composes "
                          "context parallelism with FSDP2 only: FSDP shards over dp_shard x cp); see "
                          "accelerate_configs/fsdp2_cp2.yaml")
    dp = world // (tp * cp)
    replicate = sizes.get("parallelism_config_dp_replicate_size", 1)
    shard = sizes.get("parallelism_config_dp_shard_size", 1)
    model_text = "".join(f" x {key} ({size})" for key, size in (("cp_size", cp), ("tp_size", tp)) if size > 1)
    if replicate <= 1:
        if sizes.get("parallelism_config_dp_shard_size", dp) not in (1, dp) or (tp * cp > 1 and shard != dp):
            raise ConfigError(f"{source}: parallelism_config_dp_shard_size = {shard}{model_text} but the launch has "
                              f"{world} processes; without dp_replicate_size, dp_shard_size{model_text} must be the "
                              f"world size (dp_shard_size {dp})")
        return name, None, tp, cp
    if not fsdp2:
        raise ConfigError(f"{source}: parallelism_config (dp_replicate_size {replicate}) needs fsdp_version: 2; "
                          "accelerate refuses it with FSDP1")
    if replicate * shard * tp * cp != world:
        per_node = gpus_per_node // (tp * cp) if tp * cp > 1 else gpus_per_node
        raise ConfigError(
            f"{source}: parallelism_config dp_replicate_size ({replicate}) x dp_shard_size ({shard}){model_text} = "
            f"{replicate * shard * tp * cp}, but the launch has {nodes} x {gpus_per_node} = {world} processes; "
            f"for hybrid sharding set dp_shard_size to the GPUs per node ({per_node}"
            f"{' over ' + ' x '.join(k for k, v in (('cp_size', cp), ('tp_size', tp)) if v > 1) if tp * cp > 1 else ''}"
            f") and dp_replicate_size to the nodes ({nodes})")
    if shard <= 1:
        raise ConfigError(f"{source}: parallelism_config dp_shard_size = {shard} leaves FSDP nothing to shard over; "
                          f"set it to the GPUs per node ({gpus_per_node}), or use accelerate_configs/ddp.yaml for "
                          "plain data parallelism")
    return name, shard, tp, cp


def _refuse_cp_outside_fsdp(cp_size: Any, source: str, engine: str) -> None:
    """accelerate composes context parallelism with FSDP2 only; under DDP or DeepSpeed its parallelism_config cp_size
    would still split the sequences, with gradients averaged as if every rank had its own batch."""
    if cp_size in (None, "") or str(cp_size).strip() == "1":
        return
    raise ConfigError(f"{source}: parallelism_config_cp_size = {cp_size} with {engine}: context parallelism runs under "
                      "FSDP2 only (accelerate composes it with FSDP2, which shards over dp_shard x cp); use "
                      "accelerate_configs/fsdp2_cp2.yaml, or set parallelism_config_cp_size to 1")


def _fsdp_strategy(strategy: str | int | None, reshard_after_forward: str | bool | None) -> str:
    """FSDP1's sharding strategy (a name or torch's 1-based enum number), or FSDP2's
    reshard_after_forward (true: FULL_SHARD, false: SHARD_GRAD_OP; accelerate also accepts a name there)."""
    names = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
    for value in (strategy, reshard_after_forward):
        text = str(value).upper() if value not in (None, "") else ""
        if text in ("TRUE", "FALSE"):
            return "FULL_SHARD" if text == "TRUE" else "SHARD_GRAD_OP"
        if text.isdigit() and 1 <= int(text) <= len(names):
            return names[int(text) - 1]
        if text in names:
            return text
    return "FULL_SHARD"


def check_launch(launch: Launch) -> None:
    """Reject what DeepSpeed, FSDP or DDP cannot run, with the fix."""
    problems = []
    if launch.engine not in ENGINES:
        problems.append(f"engine {launch.engine!r}: use one of {', '.join(ENGINES)}")
    if launch.num_nodes < 1 or launch.gpus_per_node < 1:
        problems.append(f"nodes ({launch.num_nodes}) and GPUs per node ({launch.gpus_per_node}) must be >= 1")
    if launch.zero_stage not in (0, 1, 2, 3):
        problems.append(f"ZeRO stage {launch.zero_stage!r}: DeepSpeed has stages 0, 1, 2 and 3")
    for what, device in (("offload_optimizer", launch.offload_optimizer), ("offload_params", launch.offload_params)):
        if device not in OFFLOAD_DEVICES:
            problems.append(f"{what} device {device!r}: use none, cpu or nvme")
    if (launch.fsdp_sharding or "").startswith("HYBRID_SHARD"):
        problems.append(f"fsdp_sharding {launch.fsdp_sharding}: give FULL_SHARD or SHARD_GRAD_OP with hybrid_shard_size "
                        "(the GPUs that shard one replica)")
    if launch.tp_size > 1 and launch.engine != "fsdp":
        problems.append(f"tensor parallelism (tp_size {launch.tp_size}) needs FSDP2 (accelerate composes TP with FSDP2 "
                        "only); use accelerate_configs/fsdp2_tp2.yaml")
    if launch.tp_size < 1 or launch.world_size % launch.tp_size:
        problems.append(f"tp_size {launch.tp_size} must divide the world size ({launch.world_size})")
    elif launch.tp_size > 1 and launch.gpus_per_node % launch.tp_size:
        # TP all-reduces activations twice per block in forward and in backward, on the critical path: over the
        # network instead of NVLink that costs more than TP saves. Consecutive ranks form a TP group, so a tp_size
        # that divides the GPUs per node keeps every group inside one node.
        problems.append(f"tp_size {launch.tp_size} does not divide the {launch.gpus_per_node} GPUs per node, so TP groups "
                        "would span nodes (its per-block collectives need NVLink); use a tp_size that divides the GPUs "
                        "per node (2, 4 or 8 on 8-GPU nodes)")
    if launch.cp_size > 1 and launch.engine != "fsdp":
        problems.append(f"context parallelism (cp_size {launch.cp_size}) needs FSDP2 (accelerate composes CP with FSDP2 "
                        "only)")
    if launch.cp_size < 1 or launch.world_size % (launch.tp_size * max(launch.cp_size, 1)):
        problems.append(f"tp_size {launch.tp_size} x cp_size {launch.cp_size} must divide the world size "
                        f"({launch.world_size})")
    dp_shard = launch.hybrid_shard_size or launch.data_parallel_size
    if not problems and launch.engine == "fsdp" and launch.tp_size > 1 and launch.cp_size == 1 and dp_shard == 1:
        problems.append(f"tp_size {launch.tp_size} on {launch.world_size} processes leaves FSDP no rank to shard over "
                        "(dp_shard_size 1, cp_size 1), which accelerate refuses in every process; give FSDP ranks too, "
                        f"e.g. --num_processes {2 * launch.tp_size} --parallelism_config_dp_shard_size 2 "
                        f"(TP {launch.tp_size} x FSDP 2)")
    if launch.hybrid_shard_size is not None and not problems:
        problems += _hybrid_problems(launch)
    if launch.ep_size > 1 and not problems:
        problems += _expert_parallel_problems(launch)
    if problems:
        raise ConfigError(problems)


def _expert_parallel_problems(launch: Launch) -> list[str]:
    """What expert parallelism (model.moe.ep_size) cannot run on: one message each, with the fix."""
    ep = launch.ep_size
    if launch.engine == "deepspeed":
        return [f"model.moe.ep_size = {ep} with DeepSpeed ZeRO: pretrain's expert parallelism is EP x FSDP2 (DeepSpeed's "
                "own MoE layers are not transformers' models); use accelerate_configs/fsdp2_ep.yaml, or set "
                "model.moe.ep_size=1"]
    if launch.engine != "fsdp":
        return [f"model.moe.ep_size = {ep} needs FSDP2 (the dense part is sharded over every rank while the experts "
                "are split by EP); use accelerate_configs/fsdp2_ep.yaml, or set model.moe.ep_size=1"]
    if launch.world_size % ep:
        return [f"model.moe.ep_size = {ep} does not divide the {launch.world_size} processes: each group of ep_size "
                "consecutive ranks holds every expert once; use an ep_size that divides the world (and "
                "model.moe.num_experts)"]
    if launch.tp_size > 1 or launch.cp_size > 1:
        return [f"model.moe.ep_size = {ep} with tp_size {launch.tp_size} x cp_size {launch.cp_size}: pretrain has not "
                "verified transformers' expert plan composed with its tensor or context plan against one process; use "
                "EP alone (accelerate_configs/fsdp2_ep.yaml) or TP/CP alone"]
    if launch.hybrid_shard_size:
        return [f"model.moe.ep_size = {ep} with HSDP (dp_replicate_size): the expert mesh would need a replicate "
                "dimension pretrain has not verified; use full sharding (accelerate_configs/fsdp2_ep.yaml)"]
    if launch.offload_params != "none":
        return [f"model.moe.ep_size = {ep} with FSDP parameter offload: the experts' all-to-all runs on the GPUs' "
                "copies; set fsdp_offload_params: false"]
    return []


def _hybrid_problems(launch: Launch) -> list[str]:
    """Hybrid sharding DeepSpeed or FSDP cannot run, or that would replicate nothing."""
    size, world = launch.hybrid_shard_size, launch.data_parallel_size
    what = f"{HPZ_KEY} = {size}" if launch.uses_deepspeed else f"parallelism_config dp_shard_size = {size}"
    fix = (f"use the GPUs per node ({launch.gpus_per_node}; \"auto\" in the DeepSpeed JSON)" if launch.uses_deepspeed
           else f"set dp_shard_size to the GPUs per node ({launch.gpus_per_node}) and dp_replicate_size to the nodes")
    if launch.engine == "ddp":
        return ["hybrid sharding needs DeepSpeed ZeRO-3 (hpZ) or FSDP (HSDP); DDP shards nothing"]
    if launch.uses_deepspeed and launch.zero_stage != 3:
        return [f"{what} (hpZ) needs ZeRO-3 (got ZeRO-{launch.zero_stage}): it partitions a secondary copy of the "
                "parameters, which only ZeRO-3 partitions; use zero_stage 3 (multinode_zero3_hpz.yaml) or remove "
                f"{HPZ_KEY}"]
    if size < 2:
        return [f"{what}: a group of fewer than 2 GPUs shards nothing; {fix}"]
    if world % size:
        return [f"{what} does not divide the world size ({launch.num_nodes} x {launch.gpus_per_node} = {world}); {fix}"]
    if launch.num_nodes == 1:
        return [f"{what} on one node: hybrid sharding keeps a copy per node so that the gathers stay inside it, and "
                "one node has nothing to replicate across; use accelerate_configs/zero3.yaml or fsdp.yaml"]
    if size == world:
        return [f"{what} equals the world size ({world}): nothing is replicated, only memory is spent; {fix}"]
    return []


def check_offload(launch: Launch) -> None:
    """Offload combinations the engine cannot run, worded for the estimator's and planner's options.
    (A training launch gets the same verdicts from the DeepSpeed config builder, worded for the
    accelerate config.)"""
    problems = []
    if launch.engine == "ddp":
        if launch.offload_optimizer != "none" or launch.offload_params != "none":
            problems.append("offload needs DeepSpeed ZeRO (DDP keeps everything on the GPU); pass --zero 1, 2 or 3")
    elif launch.engine == "deepspeed":
        if launch.offload_params != "none" and launch.zero_stage != 3:
            problems.append(
                f"parameter offload needs ZeRO-3 (got ZeRO-{launch.zero_stage}): DeepSpeed offloads parameters only "
                "when it partitions them; use --zero 3 or drop --offload-params"
            )
        if launch.offload_optimizer != "none" and launch.zero_stage == 0:
            problems.append(
                "optimizer offload needs ZeRO-1, 2 or 3 (got ZeRO-0): DeepSpeed offloads the optimizer partition that "
                "ZeRO creates; use --zero 1 or higher or drop --offload-optimizer"
            )
        if "nvme" in (launch.offload_optimizer, launch.offload_params) and launch.zero_stage != 3:
            problems.append(
                f"NVMe offload needs ZeRO-3 (ZeRO-Infinity), got ZeRO-{launch.zero_stage}; use cpu or --zero 3"
            )
    if problems:
        raise ConfigError(problems)


def _count(value: Any, key: str, source: str) -> int:
    """A process or machine count from an accelerate config or option: a whole number from 1 to 2**31 - 1
    (a YAML float such as .nan or 2.5, text, or a 400-digit integer is refused by name)."""
    text = str(value).strip()
    if isinstance(value, bool) or not text.lstrip("-").isdigit() or len(text) > 12 or not 1 <= int(text) <= MAX_COUNT:
        raise ConfigError(f"{source}: {key} = {text[:40]!r} must be a whole number from 1 to {MAX_COUNT:,}")
    return int(text)


def read_accelerate_config(path: str | os.PathLike) -> dict[str, Any]:
    """An accelerate config file as a mapping; a missing or malformed file is a ConfigError with the fix."""
    file = Path(path)
    if not file.is_file():
        near = sorted(p.name for p in file.parent.glob("*.yaml")) if file.parent.is_dir() else []
        hint = f"; files in {file.parent}: {', '.join(near)}" if near else ""
        raise ConfigError(f"accelerate config file not found: {path}{hint}")
    config = safe_yaml.read(file, "accelerate config")
    if config is None:
        raise ConfigError(f"accelerate config {path} is empty; write one with `accelerate config` or start from "
                          "accelerate_configs/ddp.yaml")
    if not isinstance(config, dict):
        raise ConfigError(f"accelerate config {path} must be a YAML mapping, got a {type(config).__name__}")
    return config


def config_uses_cpu(config: Mapping[str, Any]) -> bool:
    """Whether an accelerate config (as ``read_accelerate_config`` returns it) runs on CPUs: ``use_cpu: true``
    or ``distributed_type: MULTI_CPU``. (``cpu_ddp.yaml`` is MULTI_GPU on purpose and says use_cpu: false:
    on a CPU machine pretrain joins its processes over gloo itself.)"""
    return (str(config.get("use_cpu", False)).lower() == "true"
            or str(config.get("distributed_type", "NO")).upper() == "MULTI_CPU")


def option_value(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` in a command line (the last one wins)."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: a SLURM or cgroup allocation, not the machine)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads_per_process(processes_per_node: int) -> int:
    """``OMP_NUM_THREADS`` for each of a node's processes: the usable cores shared out.

    torchrun sets 1 when the variable is unset and warns that the user should tune it; on CPU one thread per
    process leaves cores idle, and on a GPU node it starves the host-side work of each rank. Sharing the cores
    out is what that warning asks for; pretrain-launch sets it unless the user has.
    """
    return max(1, usable_cores() // max(1, processes_per_node))


def accelerate_command(recipe: str | os.PathLike, overrides: Sequence[str] = (), *,
                       accelerate_args: Sequence[str] = (), config_file: str | os.PathLike | None = None,
                       num_processes: int | str | None = None,
                       launcher: Sequence[str] = (sys.executable, "-m", "accelerate.commands.launch"),
                       run_py: str | os.PathLike = RUN_PY, entry: Sequence[str] | None = None) -> list[str]:
    """The argv that starts training: ``<launcher> [--config_file F] [--num_processes N] <accelerate_args>
    <run_py> --recipe R <overrides>``. Every tool that starts or prints a launch builds it here; ``entry``
    replaces ``run_py`` (``DOCTOR_ENTRY``: the health check under the same launch).

    ``launcher=()`` with no config file means one process without accelerate (``python run.py``): pass
    ``launcher=(sys.executable,)``. Shell variables in ``accelerate_args`` (``"$SLURM_NODEID"``) are left
    for the caller's shell rendering (see ``shell_join``).
    """
    command = list(launcher)
    if config_file is not None:
        command += ["--config_file", str(config_file)]
    if num_processes is not None:
        command += ["--num_processes", str(num_processes)]
    return [*command, *accelerate_args, *(entry or [str(run_py)]), "--recipe", str(recipe), *overrides]


def shell_join(argv: Sequence[str]) -> str:
    """A command line for a shell script: quoted, except tokens that are a shell variable ("$NAME"),
    which are double-quoted so that the node's own shell expands them."""
    return " ".join(f'"{a}"' if a.startswith("$") and a[1:].replace("_", "").isalnum() else shlex.quote(a)
                    for a in argv)


def compile_choice(requested: str, device_type: str, launch: Launch) -> tuple[str, str]:
    """``model.compile`` resolved for the device and layout the run trains on, and why: the one place ``auto``
    is decided (the run, its log, ``--dry-run`` and tools/bench_gpu.py all ask here).

    ``auto`` is regional on CUDA, except under DeepSpeed ZeRO-3, context and expert parallelism, and none elsewhere. On CPU inductor spends
    minutes compiling C++ for a small gain. Under ZeRO-3 DeepSpeed gathers and releases each module's
    parameters in hooks it marks compiler-disabled, so every block breaks into small graphs at each hook: a
    long compile for little fused code. Until a measurement says otherwise, ZeRO-3 runs eager. The other
    values are kept as given."""
    if requested != "auto":
        return requested, f"model.compile={requested}"
    if device_type != "cuda":
        return "none", "auto: none off CUDA (inductor's CPU compile costs minutes for a small gain)"
    if launch.cp_size > 1:
        return "none", ("auto: none under context parallelism (torch's context_parallel swaps SDPA for ring attention "
                        "by patching it around every step, which compiled blocks have not been verified to follow; "
                        "model.compile=regional forces it)")
    if launch.ep_size > 1:
        return "none", ("auto: none under expert parallelism (transformers' all-to-all reads each layer's split sizes "
                        "back to the host: every block breaks its graph there, unverified compiled); model.compile="
                        "regional forces it")
    if launch.uses_deepspeed and launch.zero_stage == 3:
        return "none", ("auto: none under DeepSpeed ZeRO-3 (its parameter gather hooks are compiler-disabled: each "
                        "block breaks into small graphs, a long compile for little gain); model.compile=regional "
                        "forces it")
    return "regional", "auto: regional on CUDA (each repeated block compiled once)"


def launcher_store(environ: Mapping[str, str] = os.environ) -> tuple[str, int, str] | None:
    """The key-value store torchrun's agent hosts for its workers (accelerate launch starts torchrun): its host, port
    and this attempt's name (torchrun's restart count), or None where no agent hosts one (one process started with
    python, or a launcher other than torchrun). The workers' process group uses the same store later."""
    if int(environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    host, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if not host or not (port or "").isdigit():
        return None
    return host, int(port), environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
