"""What a run's throughput means: FLOPs per token, the device's peak FLOP/s, MFU, and memory.

Pure arithmetic on a transformers config plus two small probes of the running process (a CPU matmul
benchmark and memory counters). Nothing here touches torch.distributed: each process reports its own
device and the caller reduces.

FLOPs convention (the one ARCHITECTURE.md documents and every run logs as ``FlopsPerToken.convention``):

    model FLOPs per token = 6 x N + 12 x L x H x head_dim x seq_len

N is the number of weights that take part in a matmul: attention q/k/v/o, the MLP matrices and the LM
head (counted whether or not it is tied to the input embedding, because it is a real V x d matmul per
token). The input embedding and position tables are lookups, not matmuls, and are excluded. Biases and
norm weights are excluded too: they cost ~2 FLOPs per parameter per token instead of 6, are well under
1% of the total, and ``torch.utils.flop_counter.FlopCounterMode`` (the test's reference) does not count
them either. The 12 L H hd s term is QK^T and AV over the full s x s score matrix (forward 4 L H hd s,
backward twice that), as in PaLM's MFU definition; causal kernels that skip the masked half do not
lower it. ``model_flops`` is what MFU uses. ``hardware_flops`` adds what activation checkpointing
recomputes: a measure of how busy the device is, not of useful work. That is one more forward of every
decoder block (not of the LM head), less the block's last matmul, the MLP down projection, whose output
backward never needs: PyTorch's non-reentrant checkpoint stops recomputing once it has every tensor
backward saved (``torch.utils.checkpoint.set_checkpoint_early_stop``, on by default). A dropout or a
norm after the down projection (GPT-2's resid_pdrop, GPT-NeoX's hidden_dropout, OLMo-2's post-norm)
saves that output, and then it is recomputed too.
"""

from __future__ import annotations

import re
import resource
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch

from pretrain.errors import ConfigError

GIB = 2**30

# ---- FLOPs per token ------------------------------------------------------------------------------

CONVENTION = (
    "model FLOPs/token = 6 x N + 12 x L x H x head_dim x seq_len; N = matmul weights (attention, MLP, "
    "LM head whether tied or not; no embedding lookup, position table, bias or norm); attention counted "
    "over the full seq_len x seq_len scores; training = forward + backward = 3 x forward"
)

# The model_types whose matmul shapes _shape knows, each checked against FlopCounterMode in
# tests/test_metrics.py (phi3 by hand: its tiny test configs need a 32k vocabulary). Gated MLPs (SwiGLU /
# GeGLU) have three d x f matrices (phi3 fuses gate and up into one d x 2f, the same count), with
# separate q/k/v projections that grouped-query attention narrows; plain MLPs have two, and a fused
# d x 3d qkv projection (no GQA).
_GATED_MLP_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "olmo", "olmo2", "phi3")
_PLAIN_MLP_ARCHS = ("gpt2", "gpt_neox")


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs (forward + backward) per token of one sequence of ``seq_len`` tokens."""

    model_flops: float
    """6 N + 12 L H hd s: the work the model needs; MFU's numerator."""
    hardware_flops: float
    """model_flops plus the forward that activation checkpointing recomputes (equal without it)."""
    num_params_non_embedding: int
    """N: weights of every matmul, LM head included (tied or not); no embeddings, biases or norms."""
    convention: str = CONVENTION


@dataclass(frozen=True)
class _Shape:
    num_layers: int
    num_heads: int
    head_dim: int
    block_matmul_params: int  # per decoder block
    down_proj_params: int  # the block's last matmul (MLP f x d)
    down_proj_recomputed: bool  # does checkpointing's recompute reach it (see the module docstring)
    lm_head_params: int


def _shape(hf_cfg) -> _Shape:
    """The matmul shapes of a transformers config (GPT-2's n_embd/n_layer/n_head resolve through its
    attribute_map to hidden_size/num_hidden_layers/num_attention_heads)."""
    arch = hf_cfg.model_type
    d, L, H = hf_cfg.hidden_size, hf_cfg.num_hidden_layers, hf_cfg.num_attention_heads
    V = hf_cfg.vocab_size
    if arch in _GATED_MLP_ARCHS:
        head_dim = getattr(hf_cfg, "head_dim", None) or d // H
        kv_heads = getattr(hf_cfg, "num_key_value_heads", None) or H
        q, kv = H * head_dim, kv_heads * head_dim
        attention = d * q + 2 * d * kv + q * d  # q, k, v, o: GQA shrinks k and v only
        f = hf_cfg.intermediate_size
        mlp = 3 * d * f
        # OLMo-2's post-feedforward norm, or phi3's MLP dropout, saves the output
        down_proj_recomputed = arch == "olmo2" or getattr(hf_cfg, "resid_pdrop", 0.0) > 0
    elif arch in _PLAIN_MLP_ARCHS:
        head_dim = d // H
        f = (hf_cfg.n_inner if arch == "gpt2" else hf_cfg.intermediate_size) or 4 * d
        attention = 4 * d * d  # fused qkv (d x 3d) and output (d x d)
        mlp = 2 * d * f
        dropout = hf_cfg.resid_pdrop if arch == "gpt2" else hf_cfg.hidden_dropout
        down_proj_recomputed = dropout > 0  # a dropout after it saves the output
    else:
        known = ", ".join((*_GATED_MLP_ARCHS, *_PLAIN_MLP_ARCHS))
        raise ConfigError(
            f"no FLOPs formula for model.arch = {arch} (so no MFU); formulas exist for {known}. "
            "Train without MFU or add the architecture's matmul shapes to pretrain/metrics.py"
        )
    return _Shape(L, H, head_dim, attention + mlp, f * d, down_proj_recomputed, V * d)


def flops_per_token(hf_cfg, seq_len: int, *, activation_checkpointing: bool = False) -> FlopsPerToken:
    """Training FLOPs per token from a transformers config alone (no weights needed).

    ``activation_checkpointing``: every decoder block is checkpointed (transformers'
    ``activation_checkpointing_enable()`` with ``use_reentrant=False``); only ``hardware_flops`` changes.
    """
    s = _shape(hf_cfg)
    num_params = s.num_layers * s.block_matmul_params + s.lm_head_params
    attention_forward = 4 * s.num_layers * s.num_heads * s.head_dim * seq_len  # QK^T and AV, per token
    model = 6 * num_params + 3 * attention_forward
    recomputed = 0
    if activation_checkpointing:
        recomputed_params = s.block_matmul_params - (0 if s.down_proj_recomputed else s.down_proj_params)
        recomputed = 2 * s.num_layers * recomputed_params + attention_forward
    return FlopsPerToken(float(model), float(model + recomputed), num_params)


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
    """

    def __init__(self, tokens_per_step: int, samples_per_step: int, world_size: int, *, warmup_steps: int = 0,
                 flops_per_token: float | None = None, hardware_flops_per_token: float | None = None,
                 peak_tflops: float | None = None):
        self.tokens_per_step = tokens_per_step
        self.samples_per_step = samples_per_step
        self.world_size = world_size
        self.warmup_steps = warmup_steps
        self.flops_per_token = flops_per_token
        self.hardware_flops_per_token = hardware_flops_per_token
        self.peak_tflops = peak_tflops
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
                out["perf/peak_tflops"] = self.peak_tflops
                out["perf/mfu"] = mfu(self.flops_per_token, per_device, self.peak_tflops)
                if self.hardware_flops_per_token is not None:
                    out["perf/hfu"] = mfu(self.hardware_flops_per_token, per_device, self.peak_tflops)
        return out
