"""``batch.micro_batch_size: auto``: the largest micro-batch that fits the device, the global batch kept.

The candidates are the powers of two that divide a data-parallel rank's share of the global batch (GAS = share /
MBS: the same optimizer steps and the same training, only the accumulation split changes), the same list
pretrain-plan and pretrain-sweep try. Each is estimated with the run's own estimator (``pretrain/plan/memory``:
this launch's layout, the recipe's activation-checkpointing policy, precision and loss) against the device: the
GPU named on the command line, or the one the process sees, or on a CPU run the host's available memory divided
among its processes. The choice is the largest candidate that fits with at least ``TIGHT_FRACTION`` of the device
left (the estimate's error bars; pretrain-plan's "tight"), else the largest that fits at all; when none fits, the
smallest, with a line saying so (the estimate errs high, above all under compile: the run may still fit; the
launch's own fit check refuses it as it refuses an explicit MBS 1). A larger micro-batch is never slower in the planner's step-time model (fewer,
fuller micro-steps; for FSDP and ZeRO-3 fewer all-gathers), so the largest that fits is its fastest too.

The recompute policy is the recipe's: it is part of what fits (selective checkpointing makes room for a larger
micro-batch than none). To have a policy chosen with the size, ask pretrain-plan, which weighs every policy.

Where it is resolved: ``pretrain/run.py`` (each process, on its device; the same answer on identical GPUs,
and the run's first lines say what was chosen and why), ``--dry-run`` and ``pretrain-launch`` (the GPU named
or detected), tools/bench_gpu.py (the GPU under test). Nothing else sees ``auto``: the batch plan refuses it
unresolved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.plan import memory
from pretrain.plan.planner import TIGHT_FRACTION
from pretrain.recipe.batching import BatchConfigError, micro_batch_sizes, plan_batches
from pretrain.recipe.config import AUTO, Recipe
from pretrain.system.hardware import GpuSpec

GIB = 2**30


def is_auto(recipe: Recipe) -> bool:
    return recipe.batch.micro_batch_size == AUTO


def with_micro_batch_size(recipe: Recipe, micro_batch_size: int) -> Recipe:
    """The recipe with a concrete MBS in place of ``auto`` (the global batch kept)."""
    batch = recipe.batch.model_copy(update={"micro_batch_size": micro_batch_size})
    return recipe.model_copy(update={"batch": batch})


@dataclass(frozen=True)
class Choice:
    micro_batch_size: int
    grad_accum_steps: int
    estimate: memory.MemoryEstimate
    tried: tuple[tuple[int, memory.MemoryEstimate], ...]
    """Every candidate with its estimate, smallest first."""

    def line(self) -> str:
        est = self.estimate
        gpu = est.gpu
        policy = est.workload.activation_checkpointing
        sizes = ", ".join(str(m) for m, _ in self.tried)
        if not est.fits:
            return (f"batch: micro_batch_size auto -> {self.micro_batch_size} (GAS {self.grad_accum_steps}, global "
                    f"batch kept): none of {sizes} fits the {gpu.name} ({gpu.memory_gib:,.1f} GiB) by the estimate with "
                    f"activation checkpointing {policy}: MBS {self.micro_batch_size} {est.verdict}; pretrain-plan "
                    "--recipe R names a layout that fits (more GPUs, ZeRO-3 / FSDP, activation checkpointing)")
        tight = est.headroom_gib < TIGHT_FRACTION * gpu.memory_gib
        larger = [(m, e) for m, e in self.tried if m > self.micro_batch_size]
        why_not = ""
        if larger:
            m, e = larger[0]
            why_not = (f"; MBS {m} would need {e.total_gib:,.1f} GiB" if not e.fits
                       else f"; MBS {m} would leave {e.headroom_gib:,.1f} GiB (under {TIGHT_FRACTION:.0%})")
        return (f"batch: micro_batch_size auto -> {self.micro_batch_size} (GAS {self.grad_accum_steps}, global batch "
                f"kept): the largest of {sizes} whose estimate fits the {gpu.name} ({gpu.memory_gib:,.1f} GiB) "
                f"{'(tight) ' if tight else ''}with activation checkpointing {policy}: "
                f"{est.total_gib:,.1f} GiB, {est.headroom_gib:,.1f} free{why_not}")


def choose(recipe: Recipe, launch: Launch, gpu: GpuSpec, device: str = "cuda") -> Choice:
    """The MBS ``auto`` resolves to on ``launch`` with ``gpu``'s capacity (module docstring). Raises ConfigError
    for a global batch that does not divide over the data-parallel ranks."""
    dp = launch.data_parallel_size
    try:
        sizes = micro_batch_sizes(recipe.batch, dp)
    except BatchConfigError as exc:
        raise ConfigError(str(exc)) from None
    tried = []
    for mbs in sizes:
        candidate = with_micro_batch_size(recipe, mbs)
        plan = plan_batches(candidate.batch, dp, recipe.data.seq_len)
        tried.append((mbs, plan.grad_accum_steps, memory.estimate(candidate, plan, launch, gpu=gpu, device=device)))
    fitting = [t for t in tried if t[2].fits]
    roomy = [t for t in fitting if t[2].headroom_gib >= TIGHT_FRACTION * gpu.memory_gib]
    mbs, gas, est = (roomy or fitting or tried[:1])[-1]
    return Choice(mbs, gas, est, tuple((m, e) for m, _, e in tried))


def host_device(launch: Launch) -> GpuSpec:
    """A CPU process's capacity for ``auto``: the host's available memory (``MemAvailable``) shared by the
    launch's processes on this node."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = available / max(1, launch.gpus_per_node) / GIB
    return GpuSpec("CPU process (its share of the host's available memory)", round(share * 1024), None)


def resolve(recipe: Recipe, launch: Launch, gpu: GpuSpec | None, device: str) -> tuple[Recipe, str | None]:
    """The recipe with ``auto`` replaced by its choice on ``gpu`` (None: a CPU process, ``host_device``), and the
    line saying what was chosen and why; a recipe with a given MBS is returned as it is, with None."""
    if not is_auto(recipe):
        return recipe, None
    choice = choose(recipe, launch, gpu or host_device(launch), device="cuda" if gpu is not None else device)
    return with_micro_batch_size(recipe, choice.micro_batch_size), choice.line()


def this_process_device(launch: Launch) -> tuple[GpuSpec | None, str]:
    """The GPU this process trains on (its local rank's), or None and "cpu"."""
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true":
        return None, "cpu"
    import torch

    if not torch.cuda.is_available():
        return None, "cpu"
    from pretrain.system.hardware import gpu_for_device

    props = torch.cuda.get_device_properties(launch.local_rank % torch.cuda.device_count())
    return gpu_for_device(props.name, props.total_memory), "cuda"
