"""What a run's throughput means: FLOPs per token, the device's peak FLOP/s, MFU, and memory.

FLOPs per token are the shape's (``pretrain.shape``, which documents the convention every run logs as
``FlopsPerToken.convention``); they are re-exported here for the trainer. The rest is the device side: the
peak FLOP/s from the hardware table or a CPU benchmark, MFU, and two small probes of the running process
(memory counters). Nothing here touches torch.distributed: each process reports its own device and the
caller reduces.
"""

from __future__ import annotations

import re
import resource
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch

from pretrain.shape import CONVENTION, FlopsPerToken, flops_per_token

__all__ = ["CONVENTION", "FlopsPerToken", "PEAK_TFLOPS", "Peak", "flops_per_token", "match_device",
           "measure_cpu_peak_tflops", "memory_metrics", "mfu", "normalize_dtype", "peak_rss_gib", "resolve_peak",
           "rss_gib"]

GIB = 2**30

# ---- Peak FLOP/s --------------------------------------------------------------------------------------

# Dense peak TFLOP/s per device and matmul dtype. NVIDIA datasheets print tensor-core figures with 2:4
# structured sparsity; training is dense, so those are halved here (written as `/ 2` to stay checkable
# against the sheet). `fp32` is the non-tensor-core FP32 rate on NVIDIA (matmuls with TF32 off) and the
# FP32 matrix-core rate on AMD. A dtype a device lacks is absent (V100 and T4 have no bf16 or tf32).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # NVIDIA A100 Tensor Core GPU datasheet (identical figures for the 40/80GB SXM4 and PCIe cards)
    "A100 SXM": {"bf16": 624 / 2, "fp16": 624 / 2, "tf32": 312 / 2, "fp32": 19.5},
    "A100 PCIe": {"bf16": 624 / 2, "fp16": 624 / 2, "tf32": 312 / 2, "fp32": 19.5},
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM / H100 PCIe / H100 NVL (the 94GB single-card NVL)
    "H100 SXM": {"bf16": 1979 / 2, "fp16": 1979 / 2, "tf32": 989 / 2, "fp32": 67},
    "H100 PCIe": {"bf16": 1513 / 2, "fp16": 1513 / 2, "tf32": 756 / 2, "fp32": 51},
    "H100 NVL": {"bf16": 1671 / 2, "fp16": 1671 / 2, "tf32": 835 / 2, "fp32": 60},
    # NVIDIA GH200 Grace Hopper Superchip datasheet: the GPU has H100 SXM's compute
    "GH200": {"bf16": 1979 / 2, "fp16": 1979 / 2, "tf32": 989 / 2, "fp32": 67},
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM / H200 NVL
    "H200 SXM": {"bf16": 1979 / 2, "fp16": 1979 / 2, "tf32": 989 / 2, "fp32": 67},
    "H200 NVL": {"bf16": 1671 / 2, "fp16": 1671 / 2, "tf32": 835 / 2, "fp32": 60},
    # NVIDIA GB200 NVL72 / HGX B200 datasheet, "Individual Blackwell GPU Specifications" (per GPU)
    "B200": {"bf16": 4500 / 2, "fp16": 4500 / 2, "tf32": 2200 / 2, "fp32": 75},
    "GB200": {"bf16": 5000 / 2, "fp16": 5000 / 2, "tf32": 2500 / 2, "fp32": 80},
    # NVIDIA L40S datasheet
    "L40S": {"bf16": 733 / 2, "fp16": 733 / 2, "tf32": 366 / 2, "fp32": 91.6},
    # NVIDIA L40 datasheet
    "L40": {"bf16": 362.1 / 2, "fp16": 362.1 / 2, "tf32": 181 / 2, "fp32": 90.5},
    # NVIDIA L4 Tensor Core GPU datasheet
    "L4": {"bf16": 242 / 2, "fp16": 242 / 2, "tf32": 120 / 2, "fp32": 30.3},
    # NVIDIA A10 Tensor Core GPU datasheet
    "A10": {"bf16": 250 / 2, "fp16": 250 / 2, "tf32": 125 / 2, "fp32": 31.2},
    # AWS's A10G (EC2 G5) has no NVIDIA datasheet and AWS publishes no tensor-core figure; these are the
    # A10 datasheet's (as PyTorch Lightning's table uses). A recipe's peak overrides them.
    "A10G": {"bf16": 250 / 2, "fp16": 250 / 2, "tf32": 125 / 2, "fp32": 31.2},
    # NVIDIA T4 Tensor Core GPU datasheet (FP16 mixed precision; no bf16 or tf32)
    "T4": {"fp16": 65, "fp32": 8.1},
    # NVIDIA Tesla V100 datasheet, V100 SXM2 / V100 PCIe; V100S PCIe from the V100S datasheet (Volta: fp16
    # tensor cores only)
    "V100 SXM2": {"fp16": 125, "fp32": 15.7},
    "V100 PCIe": {"fp16": 112, "fp32": 14},
    "V100S PCIe": {"fp16": 130, "fp32": 16.4},
    # AMD Instinct MI300X / MI325X datasheets (AMD's headline FP16/BF16/TF32 figures are dense)
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    "MI325X": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    # AMD Instinct MI250X / MI250 datasheets, halved: each package is two GCDs and PyTorch sees each GCD as
    # its own device, so per-device peak is half the package's (MI250X: 383 bf16, 95.7 fp32 matrix)
    "MI250X": {"bf16": 383 / 2, "fp16": 383 / 2, "fp32": 95.7 / 2},
    "MI250": {"bf16": 362.1 / 2, "fp16": 362.1 / 2, "fp32": 90.5 / 2},
    # AMD Instinct MI210 datasheet (one GCD)
    "MI210": {"bf16": 181.0, "fp16": 181.0, "fp32": 45.3},
}

# (pattern, table key), first match wins; matched case-insensitively against torch.cuda.get_device_name().
# Order matters where one name contains another: GH200/GB200 contain "200", "H100 PCIe"/"H100 NVL" must
# not fall through to SXM, L40S before L40, V100S before V100. \b keeps A10 from matching A100 and L4
# from matching L40. A device matching nothing has no table peak: a guess would make MFU untrustworthy.
_DEVICE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bGH200\b", "GH200"),
    (r"\bGB200\b", "GB200"),
    (r"\bB200\b", "B200"),
    (r"\bH200\b.*\bNVL\b", "H200 NVL"),
    (r"\bH200\b", "H200 SXM"),  # "NVIDIA H200": the SXM part; the NVL card says NVL
    (r"\bH100\b.*\bNVL\b", "H100 NVL"),
    (r"\bH100\b.*(\bPCIE\b|HBM2E)", "H100 PCIe"),  # the PCIe card has HBM2e
    (r"\bH100\b.*(\bSXM|HBM3)", "H100 SXM"),  # "NVIDIA H100 80GB HBM3"
    (r"\bA100\b.*\bPCIE\b", "A100 PCIe"),
    (r"\bA100\b", "A100 SXM"),  # "A100-SXM4-80GB" and any other A100: both form factors have one figure
    (r"\bL40S\b", "L40S"),
    (r"\bL40\b", "L40"),
    (r"\bL4\b", "L4"),
    (r"\bA10G\b", "A10G"),
    (r"\bA10\b", "A10"),
    (r"\bT4\b", "T4"),
    (r"\bV100S\b", "V100S PCIe"),
    (r"\bV100\b.*\bSXM[23]\b", "V100 SXM2"),  # SXM3 (DGX-2) is rated like SXM2
    (r"\bV100\b.*\bPCIE\b", "V100 PCIe"),
    (r"\bMI300X\b", "MI300X"),
    (r"\bMI325X\b", "MI325X"),
    (r"\bMI250X\b", "MI250X"),  # ROCm names both parts "AMD Instinct MI250X/MI250": the higher peak
    (r"\bMI250\b", "MI250"),
    (r"\bMI210\b", "MI210"),
)

_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "no": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
}  # fmt: skip


def match_device(name: str) -> str | None:
    """The ``PEAK_TFLOPS`` key of a ``torch.cuda.get_device_name()`` string, or None when unknown.

    A MIG slice ("NVIDIA A100-SXM4-40GB MIG 3g.20gb") has a fraction of the GPU's SMs: None.
    """
    if re.search(r"\bMIG\b", name, re.IGNORECASE):
        return None
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, name, re.IGNORECASE):
            return key
    return None


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
    device_type: str, device_name: str | None, dtype: str | torch.dtype, recipe_peak_tflops: float | None = None
) -> Peak:
    """This device's peak TFLOP/s for MFU.

    The recipe's value wins when given. A GPU is looked up in ``PEAK_TFLOPS`` by name (fp32 training reads
    the tf32 row when PyTorch lets fp32 matmuls use TF32); an unknown GPU or a dtype its table row lacks
    gives ``tflops=None``: no MFU, and the caller warns once. On CPU the peak is measured here.
    """
    if recipe_peak_tflops is not None:
        return Peak(float(recipe_peak_tflops), "recipe", f"recipe: {recipe_peak_tflops} TFLOP/s")
    dtype = normalize_dtype(dtype)
    if device_type == "cpu":
        tflops = measure_cpu_peak_tflops(dtype)
        threads = torch.get_num_threads()
        return Peak(
            tflops, "measured", f"measured: {tflops:.3g} TFLOP/s, {dtype} matmul on this CPU, {threads} threads"
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


def measure_cpu_peak_tflops(dtype: str | torch.dtype = "fp32", budget_s: float = 2.0) -> float:
    """Best observed square-matmul TFLOP/s on this CPU in ``dtype``, with torch's current thread count.

    Sizes 256 to 2048 share the budget equally, each repeating one matmul until its share is spent (the
    warm-up call included); the sweep ends at a size whose matmul would not fit its share. The fastest
    sample is the peak: other processes on the same cores only ever slow a sample down, so best-of-many
    is robust to them where a mean is not. Takes about ``budget_s``.
    """
    torch_dtype = _CPU_DTYPES[normalize_dtype(dtype)]
    sizes = (256, 512, 1024, 2048)
    end = time.perf_counter() + budget_s
    best_tflops = 0.0
    fastest_s = 0.0  # of the previous size
    with torch.no_grad():
        for i, n in enumerate(sizes):
            share_end = time.perf_counter() + (end - time.perf_counter()) / (len(sizes) - i)
            if time.perf_counter() + 2 * 8 * fastest_s > share_end:  # warm-up + one run, ~8x the last size
                break
            a, b = torch.randn(n, n).to(torch_dtype), torch.randn(n, n).to(torch_dtype)
            torch.mm(a, b)  # warm-up: the first call picks a kernel and touches the memory
            fastest_s = float("inf")
            while True:
                start = time.perf_counter()
                torch.mm(a, b)
                fastest_s = min(fastest_s, time.perf_counter() - start)
                if time.perf_counter() + fastest_s > share_end:
                    break
            best_tflops = max(best_tflops, 2 * n**3 / fastest_s / 1e12)
    return best_tflops


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
