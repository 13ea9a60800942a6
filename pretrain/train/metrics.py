"""What a run's throughput means: FLOPs per token, the device's peak FLOP/s, MFU, and memory.

FLOPs per token are the shape's (``pretrain.recipe.shape``, which documents the convention every run logs as
``FlopsPerToken.convention``); they are re-exported here for the trainer. The rest is the device side: the
peak FLOP/s from the hardware table or a CPU benchmark, MFU, and two small probes of the running process
(memory counters). Nothing here touches torch.distributed: each process reports its own device and the
caller reduces.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from pretrain.data import cache_root
from pretrain.distributed.layout import Launch, usable_cores
from pretrain.errors import ConfigError
from pretrain.recipe.batching import BatchPlan
from pretrain.recipe.config import Recipe
from pretrain.recipe.shape import CONVENTION, FlopsPerToken, flops_per_token
from pretrain.system.hardware import PEAK_TFLOPS, gpu_for_device, match_device

if TYPE_CHECKING:
    from pretrain.plan.memory import MemoryEstimate
    from pretrain.train.engine import OptimizerStep

__all__ = ["CONVENTION", "FlopsPerToken", "PEAK_TFLOPS", "Peak", "cpu_compute_threads", "flops_per_token",
           "match_device", "measure_cpu_core_tflops", "measure_cpu_peak_tflops", "memory_metrics", "mfu",
           "normalize_dtype", "peak_rss_gib", "resolve_peak", "rss_gib"]

GIB = 2**30

# ---- Peak FLOP/s --------------------------------------------------------------------------------------

_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "no": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
}  # fmt: skip


def normalize_dtype(dtype: str | torch.dtype) -> str:
    """``fp32`` / ``tf32`` / ``bf16`` / ``fp16`` from a recipe dtype, an accelerate mixed-precision name or a
    torch dtype."""
    name = str(dtype).removeprefix("torch.").lower()
    if name not in _DTYPE_ALIASES:
        raise ValueError(f"unknown matmul dtype {dtype!r}; expected one of fp32, tf32, bf16, fp16")
    return _DTYPE_ALIASES[name]


@dataclass(frozen=True)
class Peak:
    """Peak dense matmul TFLOP/s of one device in the training dtype, and where the number came from."""

    tflops: float | None
    source: Literal["table", "recipe", "measured", "unknown"]
    detail: str = ""
    """One line for the log and the run config: which table row, benchmark or reason."""


def _cuda_fp32_uses_tf32() -> bool:
    """fp32 matmuls run on TF32 tensor cores when PyTorch allows it (off by default)."""
    return torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32


def resolve_peak(
    device_type: str, device_name: str | None, dtype: str | torch.dtype, recipe_peak_tflops: float | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Peak:
    """This device's peak TFLOP/s for MFU.

    The recipe's value wins when given. A GPU is looked up by name in ``pretrain.system.hardware``'s table (fp32
    training reads the tf32 row when PyTorch lets fp32 matmuls use TF32); an unknown GPU or a dtype its
    table row lacks gives ``tflops=None``: no MFU, and the caller warns once. On CPU the peak is measured
    here (``measure_cpu_peak_tflops``), or read from ``cache_dir`` where an earlier run measured it
    (``cached_cpu_peak_tflops``).
    """
    if recipe_peak_tflops is not None:
        return Peak(float(recipe_peak_tflops), "recipe", f"recipe: {recipe_peak_tflops} TFLOP/s")
    dtype = normalize_dtype(dtype)
    if device_type == "cpu":
        tflops, cached = cached_cpu_peak_tflops(dtype, cache_dir)
        threads = cpu_compute_threads()
        return Peak(
            tflops, "measured",
            f"measured: {tflops:.3g} TFLOP/s = {threads} thread{'s' * (threads > 1)} x {tflops / threads:.3g} (the fastest "
            f"of many short one-thread {dtype} matmuls on this CPU)"
            + (f"; by an earlier run: {cached}, delete it to measure again" if cached else "")
        )
    if device_type != "cuda":  # ROCm reports "cuda" too
        return Peak(None, "unknown", f"no peak table for device type {device_type!r}; set the recipe's peak")
    key = match_device(device_name or "")
    if key is None:
        return Peak(None, "unknown", f"{device_name!r} is not in the peak-FLOPs table; set the recipe's peak")
    if dtype == "fp32" and _cuda_fp32_uses_tf32() and "tf32" in PEAK_TFLOPS[key]:
        dtype = "tf32"
    tflops = PEAK_TFLOPS[key].get(dtype)
    if tflops is None:
        return Peak(None, "unknown", f"{key} has no {dtype} matmul peak in the table; set the recipe's peak")
    return Peak(tflops, "table", f"table: {key} {dtype} dense, {tflops:g} TFLOP/s")


_CPU_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_compute_threads() -> int:
    """The threads this process's matmuls run on: torch's intra-op threads, at most the cores it may use."""
    return max(1, min(torch.get_num_threads(), usable_cores()))


def measure_cpu_core_tflops(dtype: str | torch.dtype = "fp32", budget_s: float = 0.3) -> float:
    """One core's matmul TFLOP/s in ``dtype``: the fastest of many short one-thread square matmuls.

    Each sample (n = 128 to 384, 0.05-1.5 ms on a 2020s core) is shorter than a scheduler time slice, so a
    sample that runs inside one runs at the core's full speed whatever else the machine is doing, and the
    fastest of many is that speed: 89 GFLOP/s fp32 on an idle EPYC core and 89 with four busy processes
    on its two cores. A multi-threaded sample needs every thread on a core at once, which a busy machine
    rarely grants: there the same probe on 2 threads measured 1 GFLOP/s against 150 idle. Takes about
    ``budget_s``; the thread count is restored after.
    """
    torch_dtype = _CPU_DTYPES[normalize_dtype(dtype)]
    sizes = (128, 256, 384)
    best_tflops = 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for n in sizes:
                a, b = torch.randn(n, n).to(torch_dtype), torch.randn(n, n).to(torch_dtype)
                torch.mm(a, b)  # warm-up: the first call picks a kernel and touches the memory
                fastest_s, share_end = float("inf"), time.perf_counter() + budget_s / len(sizes)
                while True:
                    start = time.perf_counter()
                    torch.mm(a, b)
                    fastest_s = min(fastest_s, time.perf_counter() - start)
                    if time.perf_counter() >= share_end:
                        break
                best_tflops = max(best_tflops, 2 * n**3 / fastest_s / 1e12)
    finally:
        torch.set_num_threads(threads)
    return best_tflops


def measure_cpu_peak_tflops(dtype: str | torch.dtype = "fp32", budget_s: float = 0.3) -> float:
    """This process's CPU peak: ``cpu_compute_threads()`` x one core's measured rate (``measure_cpu_core_tflops``).

    Like a GPU datasheet peak it is what the cores could do together, not what a multi-threaded matmul reaches
    (about 0.8-0.9 of it: threads share caches and memory bandwidth, and one core alone may clock higher).
    """
    return cpu_compute_threads() * measure_cpu_core_tflops(dtype, budget_s)


def _cpu_identity(dtype: str) -> dict[str, object]:
    """What a CPU matmul peak depends on: the processor, the cores this process may use, torch's threads and
    build, the dtype."""
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # "probe": the measurement's method; a figure an older method measured is measured again.
    return {"probe": "threads x fastest short one-thread matmul", "cpu": model, "cores": cores, "threads": cpu_compute_threads(), "torch": torch.__version__,
            "dtype": dtype}


def cached_cpu_peak_tflops(dtype: str, cache_dir: str | os.PathLike | None) -> tuple[float, Path | None]:
    """(TFLOP/s, the cache file it was read from, or None when measured now). ``measure_cpu_peak_tflops`` costs
    its budget (0.3 s) at every start; the figure depends only on ``_cpu_identity``, so it is kept in
    ``cache_dir/cpu_peak/`` (written atomically) and read back by later runs. No ``cache_dir``: measured."""
    if cache_dir is None:
        return measure_cpu_peak_tflops(dtype), None
    identity = _cpu_identity(dtype)
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / "cpu_peak" / f"{key}.json"
    try:
        tflops = float(json.loads(path.read_text())["tflops"])
        if tflops > 0:
            return tflops, path
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: measure, and replace it
    tflops = measure_cpu_peak_tflops(dtype)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**identity, "tflops": tflops, "measured_at": time.time()}))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: measure every time, as without one
    return tflops, None


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation (a fraction, not %): achieved model FLOP/s over the device's peak; None
    without a peak."""
    if peak_tflops is None or peak_tflops <= 0:
        return None
    return flops_per_token * tokens_per_s_per_device / (peak_tflops * 1e12)


# ---- Memory -------------------------------------------------------------------------------------------


def rss_gib() -> float:
    """This process's resident set size now (GiB)."""
    import psutil

    return psutil.Process().memory_info().rss / GIB


def peak_rss_gib() -> float:
    """This process's peak resident set size since it started (GiB)."""
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max_rss / GIB if sys.platform == "darwin" else max_rss * 1024 / GIB  # bytes on macOS, KiB on Linux


def memory_metrics(device: torch.device | str) -> dict[str, float]:
    """``memory/peak_gib`` (GPU: peak allocated by tensors; CPU: peak RSS), ``memory/reserved_gib`` (GPU:
    peak held by the caching allocator) and ``memory/rss_gib`` (host RSS now). Peaks run from process
    start (or the caller's ``torch.cuda.reset_peak_memory_stats``)."""
    device = torch.device(device)
    metrics = {}
    if device.type == "cuda":
        metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        metrics["memory/reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    else:
        metrics["memory/peak_gib"] = peak_rss_gib()
    metrics["memory/rss_gib"] = rss_gib()
    return metrics


# ---- Throughput -----------------------------------------------------------------------------------------


class _Stopwatch:
    """A reusable ``with`` block whose wall time is handed to ``add(seconds)``."""

    def __init__(self, add):
        self.add = add
        self.start = 0.0

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc_info):
        self.add(time.perf_counter() - self.start)


class ThroughputMonitor:
    """``perf/*`` metrics (tokens/s, TFLOP/s, MFU) over the optimizer steps since the last log.

    The interval is wall time minus what runs inside ``excluded()`` (evaluation, checkpoints). The first
    ``warmup_steps`` optimizer steps after ``start`` are never measured (compile, allocator, first batches):
    a log step inside them gets no ``perf/*`` keys. Time inside ``data_wait()`` counts, and is reported as
    ``perf/data_wait_frac``. ``flops_per_token`` is the model FLOPs (MFU); ``hardware_flops_per_token``,
    when given, adds ``perf/hfu``; no MFU without ``peak_tflops`` and no TFLOP/s without FLOPs.

    MFU and HFU never exceed 100%, by construction: a device cannot compute faster than its peak, so an interval
    whose hardware FLOP/s beat the peak proves the peak too low, and that rate becomes the peak from then on
    (``perf/peak_tflops`` logs the one in use). This is what keeps a CPU peak measured on a busy machine from
    reporting MFU above 100%; a table or recipe peak that is beaten is wrong, and ``on_peak_raised(old, new)``
    is called so that the caller can say so.
    """

    def __init__(self, tokens_per_step: int, samples_per_step: int, world_size: int, *, warmup_steps: int = 0,
                 flops_per_token: float | None = None, hardware_flops_per_token: float | None = None,
                 peak_tflops: float | None = None, on_peak_raised: Callable[[float, float], None] | None = None):
        self.tokens_per_step = tokens_per_step
        self.samples_per_step = samples_per_step
        self.world_size = world_size
        self.warmup_steps = warmup_steps
        self.flops_per_token = flops_per_token
        self.hardware_flops_per_token = hardware_flops_per_token
        self.peak_tflops = peak_tflops
        self.on_peak_raised = on_peak_raised
        self._excluded = _Stopwatch(self._exclude)
        self._data_wait = _Stopwatch(self._wait)
        self.start(0)

    def start(self, step: int) -> None:
        """Training (re)starts after optimizer step ``step``: the warm-up counts from here."""
        self.warmup_until = step + self.warmup_steps
        self._restart()

    def _restart(self) -> None:
        self.started = time.perf_counter()
        self.steps = 0
        self.excluded_s = 0.0
        self.data_wait_s = 0.0

    def _exclude(self, seconds: float) -> None:
        self.excluded_s += seconds

    def _wait(self, seconds: float) -> None:
        self.data_wait_s += seconds

    def excluded(self) -> _Stopwatch:
        """``with monitor.excluded():`` time that is not training (evaluation, checkpoints)."""
        return self._excluded

    def data_wait(self) -> _Stopwatch:
        """``with monitor.data_wait():`` time spent waiting for a batch."""
        return self._data_wait

    def step_done(self, step: int) -> None:
        """Optimizer step ``step`` is done; the last warm-up step starts the first measured interval."""
        self.steps += 1
        if step == self.warmup_until:
            self._restart()

    def metrics(self, step: int) -> dict[str, float]:
        """The ``perf/*`` metrics of the interval ending at ``step`` ({} in the warm-up); starts the next."""
        out = self._interval_metrics() if step > self.warmup_until and self.steps > 0 else {}
        self._restart()
        return out

    def _interval_metrics(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.started - self.excluded_s, 1e-9)
        tokens = self.steps * self.tokens_per_step
        per_device = tokens / elapsed / self.world_size
        out = {
            "perf/tokens_per_s": tokens / elapsed,
            "perf/tokens_per_s_per_device": per_device,
            "perf/samples_per_s": self.steps * self.samples_per_step / elapsed,
            "perf/step_time_s": elapsed / self.steps,
            "perf/data_wait_frac": self.data_wait_s / elapsed,
        }
        if self.flops_per_token is not None:
            out["perf/flops_per_token"] = self.flops_per_token
            out["perf/tflops_per_device"] = self.flops_per_token * per_device / 1e12
            if self.peak_tflops is not None:
                self._raise_peak_to((self.hardware_flops_per_token or self.flops_per_token) * per_device / 1e12)
                out["perf/peak_tflops"] = self.peak_tflops
                out["perf/mfu"] = mfu(self.flops_per_token, per_device, self.peak_tflops)
                if self.hardware_flops_per_token is not None:
                    out["perf/hfu"] = mfu(self.hardware_flops_per_token, per_device, self.peak_tflops)
        return out

    def _raise_peak_to(self, achieved_tflops: float) -> None:
        """The interval's hardware TFLOP/s (HFU >= MFU) is a lower bound of the device's peak."""
        if achieved_tflops > self.peak_tflops:
            if self.on_peak_raised is not None:
                self.on_peak_raised(self.peak_tflops, achieved_tflops)
            self.peak_tflops = achieved_tflops


def throughput_reference(recipe: Recipe, hf_config, device: torch.device, log):
    """FLOPs per token of this model and the device's peak, for tokens/s -> TFLOP/s -> MFU.

    The FLOPs keep the dense convention (``shape.CONVENTION``: attention over the whole seq_len) with
    ``data.document_masking`` too, although attention within documents does less work (flash_attention_2
    skips the blocks across documents; sdpa and eager compute them and mask them out), so MFU stays
    comparable across runs and with other code bases.
    """
    try:
        flops = flops_per_token(hf_config, recipe.data.seq_len,
                                activation_checkpointing=recipe.model.activation_checkpointing)
    except ConfigError:
        flops = measured_flops(recipe, hf_config, log)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = resolve_peak(device.type, name, recipe.precision.dtype, recipe.logging.peak_tflops,
                        cache_dir=cache_root(recipe.data))
    if peak.tflops is None:
        log(f"warning: perf/mfu is not logged: {peak.detail} (logging.peak_tflops=<dense TFLOP/s>)")
    return flops, peak


def measured_flops(recipe: Recipe, hf_config, log) -> FlopsPerToken | None:
    """No closed form for this architecture: its FLOPs per token counted on the meta device (model/measure.py),
    the same convention, one line saying so; None (no MFU) when even that fails."""
    from pretrain.model.measure import measure
    try:
        measured = measure(hf_config, recipe.data.seq_len)
    except ConfigError as exc:
        log(f"warning: no FLOPs count, so no TFLOP/s or MFU: {exc}")
        return None
    log(f"FLOPs per token of {hf_config.model_type} measured (no closed form): {measured.forward_flops_per_token:,.0f} "
        "per forward, counted by FlopCounterMode on the meta device; training = 3 x forward")
    return measured.flops_per_token(recipe.model.activation_checkpointing)


def memory_estimate(recipe: Recipe, plan: BatchPlan, launch: Launch, device: torch.device, log,
                    loss: str | None = None) -> MemoryEstimate | None:
    """The estimator's figures for this very run (``loss``: model.loss as resolved), logged beside the measured
    peak: its total (what the fit is judged on) and its tensors alone (what max_memory_allocated measures)."""
    from pretrain.plan.memory import estimate  # the estimator's tables: only a training process needs them here
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = gpu_for_device(props.name, props.total_memory)
    try:
        return estimate(recipe, plan, launch, gpu=gpu, device=device.type, loss=loss)
    except ConfigError as exc:
        log(f"warning: no memory estimate for this layout: {exc}")
        return None


def peak_warning(peak: Peak, log) -> Callable[[float, float], None]:
    """ThroughputMonitor's ``on_peak_raised``: this run beat the peak it was given and MFU now uses the achieved
    rate. A CPU peak measured while other processes held the cores is expected to be beaten: nothing to act on. A
    table or recipe peak that is beaten is wrong: said once."""

    def raised(peak_tflops: float, achieved_tflops: float) -> None:
        if peak.source != "measured" and peak_tflops == peak.tflops:
            log(f"warning: this run computes {achieved_tflops:.4g} TFLOP/s per device, above the peak it was "
                f"given ({peak.detail}); MFU uses the achieved rate as the peak from now on. Set "
                "logging.peak_tflops to this device's dense peak for the training dtype")

    return raised


def train_metrics(run, result: OptimizerStep) -> dict[str, float | None]:
    """Everything a logged optimizer step reports (``run``: the Trainer, which imports this module; ``result``: the
    engine's step)."""
    z_loss = None
    if result.z_loss_sum is not None:
        # Expensive device-to-host synchronization: only on logging steps.
        loss_sum, z_sum = run.accelerator.reduce(torch.stack([result.loss_sum, result.z_loss_sum]),
                                                  reduction="mean").tolist()
        z_loss = z_sum / run.plan.grad_accum_steps
        loss = (loss_sum - z_sum) / run.plan.grad_accum_steps
    elif result.loss is not None:
        loss = result.loss  # the stability rules read it this step
    else:
        # Expensive device-to-host synchronization: only on logging steps.
        loss = run.accelerator.reduce(result.loss_sum, reduction="mean").item() / run.plan.grad_accum_steps
    memory = run.parts.memory
    return {
        "train/loss": loss,
        "train/z_loss": z_loss,
        "train/ppl": math.exp(min(loss, 50.0)),
        "train/lr": result.lr,
        "train/grad_norm": float(result.grad_norm) if result.grad_norm is not None else None,
        "train/tokens_seen": run.progress.tokens_seen,
        **(run.parts.router.metrics(run.accelerator) if run.parts.router else {}),  # collective
        **run.throughput.metrics(run.step),
        **memory_metrics(run.device),
        "memory/estimated_gib": memory.total_gib if memory else None,
        # no allowance: max_memory_allocated's basis
        "memory/estimated_tensors_gib": memory.tensor_peak_gib if memory else None,
        **run.plan.as_metrics(),
        **run.engine.metrics(),  # fp16: train/loss_scale, train/skipped_steps
        **run.train_data.order.metrics(run.step),  # a mixture: data/tokens/<name>, data/epochs/<name>
        **run.diagnostics.step_time_metrics(run.step),  # collective: perf/step_time_max_s, _min_s, _slowest_rank
        **(run.policy.metrics(result.verdict) if run.gate is not None else {}),
        **(run.rollback.metrics() if run.gate is not None else {}),  # stability/rollbacks
    }
