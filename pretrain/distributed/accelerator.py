"""The Accelerator for a recipe and a launch: precision, accumulation, process group, trackers.

The recipe owns precision and accumulation; the accelerate launch owns the layout (processes,
machines, DDP / FSDP / DeepSpeed). Where the launch's config also names a precision, it must agree.
Once the process group exists, ``check_shared_output_dir`` makes sure every process sees the one
``output_dir`` rank 0 writes; ``agreement.rank_problems`` is how every rank learns what every other rank found.
"""

from __future__ import annotations

import copy
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DDPCommunicationHookType,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DistributedType,
    DynamoBackend,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    TorchDynamoPlugin,
)

from pretrain.distributed.agreement import from_rank0, rank_problems
from pretrain.distributed.context_parallel import check_launch_device
from pretrain.distributed.deepspeed import build_deepspeed_config, read_user_config
from pretrain.distributed.layout import Launch, compile_choice  # noqa: F401  (compile_choice: its home is layout.py)
from pretrain.distributed.tensor_parallel import (
    allow_accelerate_tp_prepare,
    attach_parallelism,
    hidden_parallelism_env,
    parallelize,
)
from pretrain.errors import ConfigError
from pretrain.recipe.batching import BatchPlan
from pretrain.recipe.config import Recipe
from pretrain.system import quiet

if TYPE_CHECKING:
    from pretrain.distributed.run_plan import RunPlan

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def check_precision(recipe: Recipe, launch: Launch) -> str:
    """accelerate's mixed_precision for the recipe's dtype on this launch, or one ConfigError."""
    dtype = recipe.precision.dtype
    launched = launch.mixed_precision
    if launched not in ("no", MIXED_PRECISION[dtype]):
        raise ConfigError(
            f"the accelerate config says mixed_precision={launched} but the recipe says precision.dtype={dtype}; "
            f"the recipe owns precision: set mixed_precision: 'no' in the accelerate config (or override "
            f"precision.dtype={'fp32' if launched == 'no' else launched})"
        )
    if dtype == "fp16" and not torch.cuda.is_available():
        raise ConfigError(
            "precision.dtype=fp16 needs a CUDA GPU (fp16 on CPU would silently train in fp32 or fail); "
            "use precision.dtype=bf16 or fp32 on this machine"
        )
    if launch.engine == "ddp" and launch.world_size > 1 and ddp_kwargs(recipe) and not torch.cuda.is_available():
        raise ConfigError(
            "precision.reduce_dtype=bf16 under DDP needs CUDA and NCCL (torch's bf16 all-reduce hook); on CPU "
            "DDP reduces in fp32: remove precision.reduce_dtype=bf16 (or use a DeepSpeed ZeRO config)"
        )
    return MIXED_PRECISION[dtype]


def gradient_dtypes(recipe: Recipe, launch: Launch) -> dict[str, str]:
    """The dtypes a run computes, accumulates gradients and reduces them in (written to the run config).

    bf16: accumulation and reduction in precision.reduce_dtype (fp32 by default) under ZeRO-1/2/3 (through
    ``data_types.grad_accum_dtype`` and ``communication_data_type``) and FSDP (its policy's reduce dtype, which
    no_sync accumulates in too); DDP keeps fp32 gradients under autocast and accumulates in fp32 either way.
    fp16: loss-scaled fp16 gradients under DeepSpeed and FSDP, fp32 under DDP. fp32: fp32 throughout."""
    prec, engine = recipe.precision, launch.engine
    if prec.dtype == "fp32":
        return {"compute": "fp32", "grad_accum": "fp32", "reduce": "fp32"}
    if prec.dtype == "fp16":
        if engine == "ddp":
            return {"compute": "fp16", "grad_accum": "fp32", "reduce": "fp32"}
        comm = recipe.deepspeed.communication_data_type if engine == "deepspeed" else None
        return {"compute": "fp16", "grad_accum": "fp16", "reduce": comm or "fp16"}
    # DDP accumulates in its fp32 gradients whatever it reduces in (the bf16 hook compresses the all-reduce only)
    accum = "fp32" if engine == "ddp" else prec.reduce_dtype
    return {"compute": "bf16", "grad_accum": accum, "reduce": prec.reduce_dtype}


def fsdp_plugin(recipe: Recipe) -> FullyShardedDataParallelPlugin | None:
    """bf16 recipes: an FSDP plugin whose policy reduces (and, under no_sync, accumulates) gradients in
    precision.reduce_dtype; accelerate's own policy reduces in bf16. The plugin reads the rest of the FSDP
    settings (version, sharding, wrapping) from the accelerate config's FSDP_* environment as usual."""
    if recipe.precision.dtype != "bf16":
        return None
    reduce = torch.float32 if recipe.precision.reduce_dtype == "fp32" else torch.bfloat16
    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        # No output_dtype (accelerate's own policy sets bf16): FSDP2 casts every floating tensor the root module
        # returns, and the model returns its loss, computed in fp32 from upcast logits; cast to bf16 it would
        # be logged, judged by the step gate and back-propagated from 8 bits of mantissa (0.03 apart at loss 8).
        # The logits are bf16 either way, as in torchtitan, whose policy sets no output dtype either.
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    else:
        from torch.distributed.fsdp import MixedPrecision

        policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce, buffer_dtype=torch.bfloat16)
    plugin.mixed_precision_policy = policy
    plugin.validate_mixed_precision_policy()
    # Accelerator(mixed_precision="bf16") calls plugin.set_mixed_precision("bf16"), which keeps a policy that is
    # already set: this one reaches fully_shard (tests/multiprocess/test_reduce_dtype.py checks both).
    return plugin


def ddp_kwargs(recipe: Recipe) -> DistributedDataParallelKwargs | None:
    """DDP under bf16 autocast keeps fp32 weights and gradients: fp32 reduction already. precision.reduce_dtype=bf16
    compresses the all-reduce to bf16 with torch's bf16 communication hook."""
    if recipe.precision.dtype == "bf16" and recipe.precision.reduce_dtype == "bf16":
        return DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16)
    return None


@dataclass
class AcceleratorSetup:
    accelerator: Accelerator
    deepspeed_config: dict[str, Any] | None  # None unless launched with DeepSpeed
    deepspeed_optimizer: bool  # DeepSpeed builds the optimizer (DummyOptim) instead of the torch client one
    compile_mode: str = "none"  # model.compile resolved for this device and layout: none, regional or full
    compile_reason: str = ""  # why (compile_choice), for the log


def compile_mode(requested: str, device_type: str, launch: Launch) -> str:
    """``model.compile`` resolved (``compile_choice``): none, regional or full."""
    return compile_choice(requested, device_type, launch)[0]


def dynamo_plugin(mode: str, launch: Launch) -> TorchDynamoPlugin | None:
    """accelerate's TorchDynamoPlugin where accelerate compiles in place, else None.

    Under DeepSpeed accelerate compiles after deepspeed.initialize, in place (``compile_regions_deepspeed``:
    ``block.compile()`` for each repeated block; full: ``engine.compile()``), and under FSDP2 before
    fully_shard (``compile_regions_fsdp2``). Under DDP and one process accelerate's regional path
    (``compile_regions``) builds a copy of the model whose blocks are OptimizedModules: every state_dict key
    gains ``_orig_mod.`` and checkpoints would no longer load without compile (nor export); there
    ``compile_in_place`` compiles the model before prepare instead, with the same accelerate function."""
    if mode == "none" or launch.engine == "ddp":
        return None
    return TorchDynamoPlugin(backend=DynamoBackend.INDUCTOR, use_regional_compilation=mode == "regional")


def unwrap(model: torch.nn.Module, launch: Launch) -> torch.nn.Module:
    """The model ``accelerator.prepare`` returned, without its wrappers (DDP's, DeepSpeed's engine, a compiled
    OptimizedModule): ``accelerator.unwrap_model`` under DeepSpeed, the same unwrapping here otherwise, because
    accelerate's imports DeepSpeed whenever it is installed (0.4 s on CPU; more on a CUDA machine) even for a
    run that does not use it."""
    if launch.uses_deepspeed:
        from accelerate.utils import extract_model_from_parallel

        return extract_model_from_parallel(model, keep_torch_compile=False)
    model = getattr(model, "_orig_mod", model)
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = getattr(model.module, "_orig_mod", model.module)
    return model


def compile_in_place(model: torch.nn.Module, mode: str, launch: Launch) -> None:
    """Compile ``model`` in place before accelerate's prepare (one process and DDP; see ``dynamo_plugin``).
    Module names, parameters and state_dict keys stay those of the eager model."""
    if mode == "none" or launch.engine != "ddp":
        return
    from accelerate.utils import compile_regions_fsdp2

    kwargs = TorchDynamoPlugin(backend=DynamoBackend.INDUCTOR).to_kwargs()
    if mode == "regional":
        # The in-place variant of accelerate's regional compile (written for FSDP2, engine-independent): each
        # block of a repeated ModuleList, and each other leaf child, gets module.compile(); blocks of one class
        # share the compiled code.
        compile_regions_fsdp2(model, **kwargs)
    else:
        model.compile(**kwargs)


def deepspeed_config(recipe: Recipe, plan: BatchPlan, launch: Launch, lr: float) -> tuple[dict, bool]:
    """The run's DeepSpeed config (recipe + launch + the user's JSON, conflicts refused) and whether
    DeepSpeed builds the optimizer."""
    user = read_user_config(launch.deepspeed_config_file) if launch.deepspeed_config_file else None
    return build_deepspeed_config(recipe, plan, launch, lr, user)


def deepspeed_plugin(config: dict, launch: Launch) -> tuple[DeepSpeedPlugin, dict]:
    """accelerate's plugin for the DeepSpeed ``config`` check_run built (a copy: the plan keeps its own)."""
    config = copy.deepcopy(config)
    stage = config["zero_optimization"]["stage"]
    zero3_init = launch.zero3_init if launch.zero3_init is not None else stage == 3
    # accelerate refuses a config dict next to accelerate-config DeepSpeed fields, assuming the dict is a
    # user's file that would silently win. Ours already merged those fields (conflicts are errors).
    hidden = os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
    try:
        plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=zero3_init and stage == 3)
    finally:
        if hidden is not None:
            os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = hidden
    # accelerate silences DeepSpeed's own step printing; the recipe decides (deepspeed.steps_per_print).
    plugin.deepspeed_config["steps_per_print"] = config["steps_per_print"]
    return plugin, plugin.deepspeed_config


def build_accelerator(recipe: Recipe, run_plan: RunPlan, output_dir: Path, trackers: list) -> AcceleratorSetup:
    """The accelerator for ``run_plan`` (check_run's: the precision and the DeepSpeed config are its decisions,
    not taken again here)."""
    plan, launch = run_plan.batch, run_plan.launch
    # A CP launch that reached CPU processes (plain accelerate launch; pretrain-launch refuses it before): refused
    # before the process group, not inside the first forward.
    check_launch_device(launch, cuda=torch.cuda.is_available()
                        and os.environ.get("ACCELERATE_USE_CPU", "false").lower() != "true")
    if launch.engine == "fsdp" and not torch.cuda.is_available():
        check_fsdp_on_cpu(launch)
    if not torch.cuda.is_available():
        # DeepSpeed (imported by accelerate for ZeRO and state gathering) would otherwise probe for
        # accelerators and warn on every CPU run.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    plugin, ds_config, ds_optimizer = None, None, False
    if run_plan.deepspeed is not None:
        if not torch.cuda.is_available():
            check_deepspeed_op_lock()
        plugin, ds_config = deepspeed_plugin(run_plan.deepspeed[0], launch)
        ds_optimizer = run_plan.deepspeed[1]
    handlers = []
    timeout = recipe.runtime.collective_timeout_s
    group = {"timeout": timedelta(seconds=timeout)} if timeout else {}
    if not torch.cuda.is_available() and launch.world_size > 1:
        # A multi-process CPU launch needs an explicit gloo group; without it DeepSpeed and accelerate
        # can disagree about the world size. (A single process must not get one: it has no group.)
        handlers.append(InitProcessGroupKwargs(backend="gloo", **group))
    elif group and launch.world_size > 1:
        handlers.append(InitProcessGroupKwargs(**group))
    prec = recipe.precision
    if prec.dtype == "fp16":
        # torch's GradScaler (DDP / FSDP / single device). It has no hysteresis or floor: those two knobs
        # apply under DeepSpeed only. A fixed scale never grows and only backs off on an overflow.
        if prec.loss_scale == "dynamic":
            scaler = GradScalerKwargs(init_scale=2.0**prec.initial_scale_power, growth_interval=prec.loss_scale_window)
        else:
            scaler = GradScalerKwargs(init_scale=float(prec.loss_scale), growth_interval=2**31 - 1)
        handlers.append(scaler)
    fsdp = fsdp_plugin(recipe) if launch.engine == "fsdp" else None
    ddp = ddp_kwargs(recipe) if launch.engine == "ddp" and plan.world_size > 1 else None
    if ddp is not None:  # on CUDA only (check_precision)
        handlers.append(ddp)
    mode, compile_reason = compile_choice(recipe.model.compile, "cuda" if torch.cuda.is_available() else "cpu", launch)
    dynamo = dynamo_plugin(mode, launch)
    on_cpu = not torch.cuda.is_available()
    hidden = hidden_parallelism_env(on_cpu and launch.engine == "fsdp")
    with quiet.dropping_stdout_lines(quiet.DEEPSPEED_BUILT):  # the process group starts here
        accelerator = Accelerator(
            # No CUDA and not DeepSpeed: run as MULTI_CPU over gloo. Without this, processes started by
            # torchrun on a CPU box would each become an unrelated single-process run.
            cpu=not torch.cuda.is_available() and plugin is None,
            mixed_precision=run_plan.mixed_precision,
            # batch.sync_each_micro_batch: accelerate's accumulate() then leaves out no_sync (FSDP reduce-scatters
            # every micro-batch into its fp32 shards).
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=plan.grad_accum_steps, sync_each_batch=recipe.batch.sync_each_micro_batch),
            # The trainer steps the LR scheduler once per optimizer step itself. By default accelerate's
            # AcceleratedScheduler would step it num_processes times per optimizer step.
            step_scheduler_with_optimizer=False,
            log_with=trackers or None,
            project_dir=str(output_dir),
            kwargs_handlers=handlers,
            dynamo_plugin=dynamo,
            deepspeed_plugin=plugin,
            fsdp_plugin=fsdp,
        )
    os.environ.update(hidden)
    if launch.engine == "fsdp" and on_cpu:
        fsdp_on_cpu(accelerator, fsdp if fsdp is not None else FullyShardedDataParallelPlugin())
        attach_parallelism(accelerator, launch)
    if launch.tp_size > 1:
        allow_accelerate_tp_prepare()
    if accelerator.num_processes != launch.world_size:
        raise ConfigError(
            f"the launch reported WORLD_SIZE={launch.world_size} but accelerate started {accelerator.num_processes} "
            "processes; check the accelerate config's num_processes / distributed_type"
        )
    return AcceleratorSetup(accelerator, ds_config, ds_optimizer, mode, compile_reason)


# DeepSpeed compiles its CPU shared-memory collectives op (deepspeed_shm_comm) the first time a ZeRO process starts
# without a GPU, under torch's build lock. A build takes about a minute (four on busy cores); a process killed during
# it leaves the lock behind, and every later ZeRO process on the machine waits on it forever, printing nothing.
STALE_BUILD_LOCK_S = 15 * 60


def check_deepspeed_op_lock(environ: Mapping[str, str] = os.environ, now: float | None = None) -> None:
    """Refuse to start (one message) where the shared-memory op's build lock is older than any build: left by a killed
    build, it would hang the run. pretrain does not delete it: another tool's file, and the user's to remove."""
    import sys

    from torch.utils.cpp_extension import get_default_build_root

    # Where torch builds it (torch.utils.cpp_extension._get_build_directory): in TORCH_EXTENSIONS_DIR itself (pretrain
    # sets this environment's own: pretrain/system/environment.py), else in the default root's folder for this
    # interpreter and torch build
    if environ.get("TORCH_EXTENSIONS_DIR"):
        builds = Path(environ["TORCH_EXTENSIONS_DIR"])
    else:
        device = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        builds = (Path(get_default_build_root())
                  / f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{device}")
    lock = builds / "deepspeed_shm_comm" / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except OSError:
        return
    if age > STALE_BUILD_LOCK_S:
        raise ConfigError(
            f"DeepSpeed's CPU op build lock {lock} is {age / 60:.0f} minutes old: a build of its shared-memory op was "
            "killed mid-way, and every ZeRO process would wait on this lock forever. Delete it (`rm "
            f"{lock}`) and launch again; the op is then rebuilt once (about a minute)")


def check_fsdp_on_cpu(launch: Launch, environ: Mapping[str, str] = os.environ) -> None:
    """What of FSDP runs without GPUs (``fsdp_on_cpu``): FSDP2, resharded after forward or not (FULL_SHARD,
    SHARD_GRAD_OP), on one process group, without parameter offload. Read from the launch before any plugin or
    group is made (accelerate's FSDP1 plugin itself fails on a machine without GPUs when it is to sync module
    states)."""
    if environ.get("FSDP_VERSION", "1") != "2":  # accelerate's default is FSDP1
        raise ConfigError(
            "the accelerate config asks for FSDP1 (fsdp_version: 1), which pretrain runs on GPUs only; on CPU set "
            "fsdp_version: 2 (accelerate_configs/fsdp.yaml) or use accelerate_configs/cpu_ddp.yaml"
        )
    if launch.hybrid_shard_size:  # (the mesh attach_parallelism builds on CPU is dp_shard x tp only)
        raise ConfigError(
            "the accelerate config asks for HSDP (hybrid sharding over a 2-D device mesh), which pretrain runs on "
            "GPUs only; on CPU use accelerate_configs/fsdp.yaml (full sharding) or multinode_zero3_hpz.yaml"
        )
    if launch.offload_params != "none":
        raise ConfigError(
            "the accelerate config asks FSDP to offload parameters (fsdp_offload_params: true), which moves the "
            "shards from the GPUs to the CPU: without GPUs there is nothing to offload (torch's CPUOffloadPolicy "
            "fails); set fsdp_offload_params: false"
        )


def fsdp_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """Run an FSDP launch as FSDP on a machine without GPUs.

    accelerate starts FSDP only on an accelerator; without one it runs the launch as plain data parallelism
    (MULTI_CPU) and drops the plugin, so the run would train, log and be estimated as something it is not.
    torch's FSDP2 itself runs on CPU over gloo (sharding, the mixed-precision policy's reduce dtype, no_sync,
    torch.distributed.checkpoint), so pretrain switches the state to FSDP after the process group exists, as
    accelerate's own ``AcceleratorState`` does on GPUs: the shared ``distributed_type`` of both states (a later
    ``AcceleratorState()`` re-reads the partial state's) and the plugin, with the run's mixed precision. From
    there accelerate's FSDP paths (``fsdp2_prepare_model``, ``save_fsdp_model``, ``load_fsdp_model``) run
    unchanged, which is what lets the tests run pretrain's whole FSDP path (sharded init, resharded resume,
    export) on CPU; on CPU it is for testing a layout, not for speed.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)  # keeps a policy fsdp_plugin() already set
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


SHARED_FS_HINT = (
    "put output_dir (and any checkpoint.resume path) on a filesystem every node mounts at the same path "
    "(NFS, Lustre, GPFS, ...), not on node-local disk"
)
# A file rank 0 has closed is visible on a shared filesystem as soon as another node opens it (close-to-open
# consistency); a node that does not see it at once is given this long before it counts as not sharing.
PROBE_WAIT_S = 3.0


def _sees(probe: Path, token: str) -> bool:
    try:
        return probe.read_text() == token
    except OSError:
        return False


def check_shared_output_dir(accelerator: Accelerator, output_dir: Path) -> None:
    """Raise ConfigError on every rank unless every process sees the directory rank 0 writes as output_dir.

    Rank 0 alone writes checkpoints, ``checkpoints/latest`` and the metrics, while every rank writes its
    own part of a checkpoint (RNG state; DeepSpeed's shards) and reads it back on resume: node-local
    output_dirs would make ranks resume from different steps, or hang. Rank 0 writes one small file with
    a random name and content; every rank reads it back; rank 0 removes it. One process: nothing to check.
    """
    if accelerator.num_processes == 1:
        return
    written = None
    if accelerator.is_main_process:
        probe = output_dir / f".shared-probe-{secrets.token_hex(8)}"
        probe.write_text(probe.name)
        written = (probe.name, socket.gethostname(), str(probe.resolve()))
    name, host, where = from_rank0(written)
    probe = output_dir / name
    deadline = time.monotonic() + PROBE_WAIT_S
    while not (seen := _sees(probe, name)) and time.monotonic() < deadline:
        time.sleep(0.2)
    problems = rank_problems(accelerator, None if seen else f"found no such file at {probe.resolve()}")
    if accelerator.is_main_process:  # every rank has read (or given up on) the probe by now
        probe.unlink(missing_ok=True)
    if problems:
        raise ConfigError(
            f"output_dir = {str(output_dir)!r} is not one directory shared by every process: rank 0 (host {host}) "
            f"wrote {where}, and {'; '.join(problems)}. Checkpoints, checkpoints/latest and metrics are written "
            f"by rank 0 and read back by every rank: {SHARED_FS_HINT}"
        )


@dataclass(frozen=True)
class ModelPlacement:
    """Where ``pretrain.model.build.build_model`` allocates this rank's parameters, and how it shards them first."""

    device: torch.device
    shard: Callable[[torch.nn.Module], torch.nn.Module] | None = None


def model_placement(accelerator: Accelerator, launch: Launch | None = None) -> ModelPlacement:
    """The run's device, so a GPU run never holds a full fp32 copy of the model in host memory.

    FSDP2 shards the model while it is still on the meta device (``shard_fsdp2``), so each rank allocates
    only its shard, on the GPU, or on CPU when FSDP offloads parameters. FSDP1 wraps a built model: it is
    built on CPU, as accelerate expects. DeepSpeed ZeRO-3 partitions at construction (zero.Init) and
    ignores the device; ZeRO-0/1/2, DDP and a single device build the whole model on the run's device.
    """
    if accelerator.is_fsdp2:
        from torch.distributed.fsdp import CPUOffloadPolicy

        offload = isinstance(accelerator.state.fsdp_plugin.cpu_offload, CPUOffloadPolicy)
        return ModelPlacement(torch.device("cpu") if offload else accelerator.device,
                              partial(shard_fsdp2, accelerator, ep_launch=launch if launch and launch.ep_size > 1 else None))
    if accelerator.distributed_type == DistributedType.FSDP:
        return ModelPlacement(torch.device("cpu"))
    return ModelPlacement(accelerator.device)


def shard_fsdp2(accelerator: Accelerator, model: torch.nn.Module, ep_launch: Launch | None = None) -> torch.nn.Module:
    """accelerate's own FSDP2 wrapping (``fsdp2_prepare_model``: the auto-wrap policy, the embedding and
    output groups, mixed-precision and offload policies, the device mesh) applied to the model on the meta
    device; ``accelerator.prepare`` then finds an FSDP module and keeps its sharding.

    ``cpu_ram_efficient_loading`` (rank 0 broadcasts a full state dict to the shards) is for weights that
    were loaded; here nothing is loaded yet (every rank draws its own shard), so it is off for this call.
    """
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    config = accelerator.parallelism_config
    if config is not None and config.tp_enabled:
        # TP first, on the meta model (transformers' plan on the mesh's tp dimension); fully_shard then shards the
        # DTensors over dp_shard, as accelerate's own TP + FSDP2 path does.
        model = parallelize(model, accelerator.torch_device_mesh["tp"])
    plugin = accelerator.state.fsdp_plugin
    if ep_launch is not None:
        # EP first, on the meta model: the experts split over ep and sharded over their copies; accelerate's
        # wrapping below then leaves them to their own FSDP group (pretrain/distributed/expert_parallel.py)
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from pretrain.distributed.expert_parallel import parallelize_experts

        model = parallelize_experts(model, ep_launch, {
            "reshard_after_forward": plugin.reshard_after_forward,
            "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy()})
    loading = plugin.cpu_ram_efficient_loading
    plugin.cpu_ram_efficient_loading = False
    try:
        return fsdp2_prepare_model(accelerator, model)
    finally:
        plugin.cpu_ram_efficient_loading = loading
