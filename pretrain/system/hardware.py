"""Accelerators: dense peak TFLOP/s per dtype, memory and interconnect, each with its source; one name matcher.

MFU (``pretrain.train.metrics.resolve_peak``), the memory estimator's device capacity (``pretrain.plan.memory``) and
the planner's step-time model (``pretrain-plan``) all read ``CARDS``; ``match_device`` is the one way a
``torch.cuda.get_device_name()`` string finds its row. No torch here: the estimator imports it.

Peaks are dense matmul TFLOP/s. NVIDIA datasheets print most tensor-core figures with 2:4 structured
sparsity (marked by a footnote); training is dense, so those are halved. Each ``Rate`` keeps the figure as
the sheet prints it (``*`` = with sparsity, as the sheets mark it) beside the dense number used, and
``tests/system/test_hardware.py`` checks one against the other. ``fp32`` is the non-tensor-core FP32 rate on
NVIDIA (matmuls with TF32 off) and the FP32 matrix-core rate on AMD. A dtype a device lacks, or that no
source gives, is absent (V100 and T4 have no bf16 or tf32): no MFU rather than a guess.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pretrain.errors import ConfigError

MIB = 2**20


@dataclass(frozen=True)
class Rate:
    """One peak: the dense TFLOP/s used, and the figure its source prints."""

    dense: float
    printed: str
    """As printed ("1,979*": with 2:4 sparsity, the sheet's footnote; the dense rate is half)."""


@dataclass(frozen=True)
class Card:
    """One accelerator model, as ``torch.cuda.get_device_name()`` names it."""

    key: str
    pattern: str
    """Regular expression matched case-insensitively against the device name (see ``match_device``)."""
    peaks: Mapping[str, Rate]
    source: str
    """The datasheet (or document) the peaks come from."""
    per_package: int = 1
    """Devices PyTorch sees per package: the printed figure is the package's, the peak a device's share."""
    sizes: Mapping[str, int] = field(default_factory=dict)
    """GPU names the estimator and planner know (``--gpu``) -> memory in MiB as ``nvidia-smi`` reports it."""
    intra_node_gb_s: float | None = None
    """GPU-to-GPU bandwidth inside a node, one direction (GB/s): NVLink, or PCIe for PCIe cards."""
    inter_node_gb_s: float = 25.0
    """Network bandwidth per GPU between nodes (GB/s): 200 Gb/s InfiniBand per GPU unless stated."""
    link: str = ""
    """Where the bandwidths come from."""


def _rates(dense: float, printed: str, *dtypes: str) -> dict[str, Rate]:
    return dict.fromkeys(dtypes, Rate(dense, printed))


_HALF = ("bf16", "fp16")
_PCIE = "PCIe, no NVLink: ~16 GB/s one direction between cards through the host (Gen3 x16 effective)"

# Match order: first hit wins. GH200/GB200 contain "200", "H100 PCIe"/"H100 NVL" must not fall through to
# SXM, L40S before L40, V100S before V100. \b keeps A10 from matching A100 and L4 from matching L40. A
# device matching nothing has no table peak: a guess would make MFU untrustworthy.
CARDS: tuple[Card, ...] = (
    Card("GH200", r"\bGH200\b", {**_rates(989.5, "1,979*", *_HALF), "tf32": Rate(494.5, "989*"), "fp32": Rate(67, "67")},
         "NVIDIA GH200 Grace Hopper Superchip datasheet (the GPU has H100 SXM's compute)"),
    Card("GB200", r"\bGB200\b", {**_rates(2500, "5,000*", *_HALF), "tf32": Rate(1250, "2,500*"), "fp32": Rate(80, "80")},
         "NVIDIA GB200 NVL72 datasheet, per GPU (printed in PFLOPS: 5 PF* FP16/BF16, 2.5 PF* TF32)"),
    Card("B200", r"\bB200\b", {**_rates(2250, "4,500*", *_HALF), "tf32": Rate(1100, "2,200*"), "fp32": Rate(75, "75")},
         "NVIDIA HGX B200 datasheet, per GPU (printed in PFLOPS: 4.5 PF* FP16/BF16, 2.2 PF* TF32)"),
    Card("H200 NVL", r"\bH200\b.*\bNVL\b", {**_rates(835.5, "1,671*", *_HALF), "tf32": Rate(417.5, "835*"),
                                            "fp32": Rate(60, "60")}, "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL"),
    # "NVIDIA H200": the SXM part; the NVL card says NVL
    Card("H200 SXM", r"\bH200\b", {**_rates(989.5, "1,979*", *_HALF), "tf32": Rate(494.5, "989*"), "fp32": Rate(67, "67")},
         "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM", sizes={"H200-141GB": 143771}, intra_node_gb_s=450,
         inter_node_gb_s=50, link="NVLink 4, 900 GB/s per GPU both ways; 400 Gb/s NDR InfiniBand per GPU"),
    Card("H100 NVL", r"\bH100\b.*\bNVL\b", {**_rates(835.5, "1,671*", *_HALF), "tf32": Rate(417.5, "835*"),
                                            "fp32": Rate(60, "60")},
         "NVIDIA H100 Tensor Core GPU datasheet, H100 NVL (the 94GB single card)", sizes={"H100-94GB": 95830},
         intra_node_gb_s=300, inter_node_gb_s=50,
         link="NVLink bridge, 600 GB/s between a pair both ways; 400 Gb/s NDR InfiniBand per GPU"),
    # the PCIe card has HBM2e
    Card("H100 PCIe", r"\bH100\b.*(\bPCIE\b|HBM2E)", {**_rates(756.5, "1,513*", *_HALF), "tf32": Rate(378, "756*"),
                                                      "fp32": Rate(51, "51")},
         "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe"),
    # "NVIDIA H100 80GB HBM3"
    Card("H100 SXM", r"\bH100\b.*(\bSXM|HBM3)", {**_rates(989.5, "1,979*", *_HALF), "tf32": Rate(494.5, "989*"),
                                                 "fp32": Rate(67, "67")},
         "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM", sizes={"H100-80GB": 81559}, intra_node_gb_s=450,
         inter_node_gb_s=50, link="NVLink 4, 900 GB/s per GPU both ways; 400 Gb/s NDR InfiniBand per GPU"),
    Card("A100 PCIe", r"\bA100\b.*\bPCIE\b", {**_rates(312, "624*", *_HALF), "tf32": Rate(156, "312*"),
                                              "fp32": Rate(19.5, "19.5")},
         "NVIDIA A100 Tensor Core GPU datasheet (the 40/80GB PCIe cards print the SXM4 figures)"),
    # "A100-SXM4-80GB" and any other A100: both form factors have one figure
    Card("A100 SXM", r"\bA100\b", {**_rates(312, "624*", *_HALF), "tf32": Rate(156, "312*"), "fp32": Rate(19.5, "19.5")},
         "NVIDIA A100 Tensor Core GPU datasheet, A100 SXM4 40/80GB", sizes={"A100-40GB": 40960, "A100-80GB": 81920},
         intra_node_gb_s=300, link="NVLink 3, 600 GB/s per GPU both ways; 200 Gb/s HDR InfiniBand per GPU"),
    # the datasheet prints dense | sparse; its sparse BF16/FP16 figure (733) is not twice the dense one
    Card("L40S", r"\bL40S\b", {**_rates(362.05, "362.05", *_HALF), "tf32": Rate(183, "366*"),
                               "fp32": Rate(91.6, "91.6")},
         "NVIDIA L40S datasheet", sizes={"L40S-48GB": 46068}, intra_node_gb_s=25,
         link="PCIe Gen4 x16, no NVLink: ~25 GB/s one direction effective"),
    Card("L40", r"\bL40\b", {**_rates(181.05, "362.1*", *_HALF), "tf32": Rate(90.5, "181*"), "fp32": Rate(90.5, "90.5")},
         "NVIDIA L40 datasheet"),
    Card("L4", r"\bL4\b", {**_rates(121, "242*", *_HALF), "tf32": Rate(60, "120*"), "fp32": Rate(30.3, "30.3")},
         "NVIDIA L4 Tensor Core GPU datasheet", sizes={"L4-24GB": 23034}, intra_node_gb_s=16, link=_PCIE),
    # AWS's A10G (EC2 G5) is not an A10: it is a GA102 part made for AWS, NVIDIA publishes no datasheet for
    # it and AWS no tensor-core figure, so the A10 datasheet's 125 TFLOP/s (the A10 row below: datacenter
    # GA102, full-rate FP32-accumulate tensor math) does not carry over. 70 is derived, not printed: the
    # GeForce-class GA102 rate, half the A10's per SM (RTX 3090: 71 TFLOP/s dense bf16 from 82 SMs at
    # 1.695 GHz, GA102 whitepaper), at the A10G's 80 SMs and 1.71 GHz. Third-party spec comparisons give the
    # same 70 (e.g. Baseten, "NVIDIA A10 vs A10G for ML model inference"), and large bf16 GEMMs measured on a
    # G5 reach ~69.5 TFLOP/s, which would be a 56%-efficient GEMM against 125. bf16/fp16 only: nothing
    # public gives its tf32 or fp32 rates. A recipe's logging.peak_tflops overrides the table.
    Card("A10G", r"\bA10G\b", _rates(70, "70", *_HALF),
         "no NVIDIA datasheet: GA102 whitepaper per-SM rate at the A10G's 80 SMs and 1.71 GHz (see comment)",
         sizes={"A10G-24GB": 23028}, intra_node_gb_s=16, link=_PCIE),
    Card("A10", r"\bA10\b", {**_rates(125, "250*", *_HALF), "tf32": Rate(62.5, "125*"), "fp32": Rate(31.2, "31.2")},
         "NVIDIA A10 Tensor Core GPU datasheet"),
    Card("T4", r"\bT4\b", {"fp16": Rate(65, "65"), "fp32": Rate(8.1, "8.1")},
         "NVIDIA T4 Tensor Core GPU datasheet (FP16 mixed precision; no bf16 or tf32)", sizes={"T4-16GB": 15360},
         intra_node_gb_s=16, link=_PCIE),
    Card("V100S PCIe", r"\bV100S\b", {"fp16": Rate(130, "130"), "fp32": Rate(16.4, "16.4")},
         "NVIDIA V100S datasheet (Volta: fp16 tensor cores only)"),
    # SXM3 (DGX-2) is rated like SXM2
    Card("V100 SXM2", r"\bV100\b.*\bSXM[23]\b", {"fp16": Rate(125, "125"), "fp32": Rate(15.7, "15.7")},
         "NVIDIA Tesla V100 datasheet, V100 SXM2 (Volta: fp16 tensor cores only)",
         sizes={"V100-16GB": 16160, "V100-32GB": 32510}, intra_node_gb_s=150,
         link="NVLink 2, 300 GB/s per GPU both ways; 200 Gb/s InfiniBand per GPU"),
    Card("V100 PCIe", r"\bV100\b.*\bPCIE\b", {"fp16": Rate(112, "112"), "fp32": Rate(14, "14")},
         "NVIDIA Tesla V100 datasheet, V100 PCIe (Volta: fp16 tensor cores only)"),
    Card("RTX 4090", r"\bRTX 4090\b", {**_rates(165.2, "330.4*", *_HALF), "tf32": Rate(82.6, "165.2*"),
                                       "fp32": Rate(82.6, "82.6")},
         "NVIDIA Ada GPU architecture whitepaper, appendix A, GeForce RTX 4090 (tensor TFLOPS with FP32 accumulate)",
         sizes={"RTX4090-24GB": 24564}, intra_node_gb_s=16, link=_PCIE),
    Card("RTX A6000", r"\bRTX A6000\b", {**_rates(154.85, "309.7*", *_HALF), "tf32": Rate(77.4, "154.8*"),
                                         "fp32": Rate(38.7, "38.7")},
         "NVIDIA RTX A6000 datasheet and GA102 whitepaper appendix (tensor TFLOPS with FP32 accumulate)",
         sizes={"RTXA6000-48GB": 49140}, intra_node_gb_s=25,
         link="PCIe Gen4 x16 (the NVLink bridge joins pairs only): ~25 GB/s one direction effective"),
    # AMD's headline FP16/BF16/TF32 figures are dense
    Card("MI300X", r"\bMI300X\b", {**_rates(1307.4, "1307.4", *_HALF), "tf32": Rate(653.7, "653.7"),
                                   "fp32": Rate(163.4, "163.4")}, "AMD Instinct MI300X datasheet"),
    Card("MI325X", r"\bMI325X\b", {**_rates(1307.4, "1307.4", *_HALF), "tf32": Rate(653.7, "653.7"),
                                   "fp32": Rate(163.4, "163.4")}, "AMD Instinct MI325X datasheet"),
    # Each MI250X / MI250 package is two GCDs and PyTorch sees each GCD as its own device, so a device's
    # peak is half the package's. ROCm names both parts "AMD Instinct MI250X/MI250": the higher peak.
    Card("MI250X", r"\bMI250X\b", {**_rates(191.5, "383", *_HALF), "fp32": Rate(47.85, "95.7")},
         "AMD Instinct MI250X datasheet (per package)", per_package=2),
    Card("MI250", r"\bMI250\b", {**_rates(181.05, "362.1", *_HALF), "fp32": Rate(45.25, "90.5")},
         "AMD Instinct MI250 datasheet (per package)", per_package=2),
    Card("MI210", r"\bMI210\b", {**_rates(181.0, "181.0", *_HALF), "fp32": Rate(45.3, "45.3")},
         "AMD Instinct MI210 datasheet (one GCD)"),
)
CARDS_BY_KEY: dict[str, Card] = {card.key: card for card in CARDS}

PEAK_TFLOPS: dict[str, dict[str, float]] = {c.key: {dtype: r.dense for dtype, r in c.peaks.items()} for c in CARDS}
"""Dense peak TFLOP/s per card and matmul dtype (a view of ``CARDS``)."""


def match_device(name: str) -> str | None:
    """The ``CARDS`` key of a ``torch.cuda.get_device_name()`` string, or None when unknown.

    A MIG slice ("NVIDIA A100-SXM4-40GB MIG 3g.20gb") has a fraction of the GPU's SMs: None.
    """
    if re.search(r"\bMIG\b", name, re.IGNORECASE):
        return None
    return next((c.key for c in CARDS if re.search(c.pattern, name, re.IGNORECASE)), None)


# ---- GPUs the estimator and the planner know by name ----------------------------------------------


@dataclass(frozen=True)
class GpuSpec:
    """One device's capacity and, through its card, peaks and bandwidth."""

    name: str
    memory_mib: int
    """Total memory as ``nvidia-smi`` reports it (MiB)."""
    card: str | None
    """The ``CARDS`` key (None: a device the table does not know)."""

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024

    @property
    def _card(self) -> Card | None:
        return CARDS_BY_KEY.get(self.card) if self.card else None

    @property
    def bf16_tflops(self) -> float | None:
        """Dense bf16 tensor-core peak, fp16 on cards without bf16 (T4, V100): the planner's compute rate."""
        peaks = self._card.peaks if self._card else {}
        rate = peaks.get("bf16") or peaks.get("fp16")
        return rate.dense if rate else None

    @property
    def intra_node_gb_s(self) -> float | None:
        return self._card.intra_node_gb_s if self._card else None

    @property
    def inter_node_gb_s(self) -> float | None:
        return self._card.inter_node_gb_s if self._card else None


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in sorted((GpuSpec(name, mib, c.key) for c in CARDS for name, mib in c.sizes.items()),
                    key=lambda g: g.memory_mib)
}
DEFAULT_GPU = "H100-80GB"


def _norm_name(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def find_gpu(name: str) -> GpuSpec:
    """The GPU called ``name`` (case, dashes and spaces ignored). Raises ConfigError listing the known ones."""
    wanted = _norm_name(name)
    for spec in GPUS.values():
        if _norm_name(spec.name) == wanted:
            return spec
    near = difflib.get_close_matches(wanted, [_norm_name(n) for n in GPUS], n=1, cutoff=0.6)
    hint = ""
    if near:
        hint = " (did you mean " + next(n for n in GPUS if _norm_name(n) == near[0]) + "?)"
    raise ConfigError(
        f"unknown GPU {name!r}{hint}; known GPUs: {', '.join(GPUS)}; or give the capacity with --gpu-memory-gib"
    )


def gpu_for_device(device_name: str, total_memory_bytes: int) -> GpuSpec:
    """The device in use (``torch.cuda.get_device_properties``): its reported capacity, named after it, with
    the card ``match_device`` finds (None for a device the table does not know)."""
    return GpuSpec(device_name, total_memory_bytes // MIB, match_device(device_name))


def custom_gpu(memory_gib: float, like: GpuSpec | None = None) -> GpuSpec:
    if not (math.isfinite(memory_gib) and memory_gib > 0):
        raise ConfigError(f"--gpu-memory-gib must be a finite number > 0, got {memory_gib}")
    base = like or GPUS[DEFAULT_GPU]
    return replace(base, name=f"{memory_gib:g} GiB device", memory_mib=round(memory_gib * 1024))


def resolve_gpu(args) -> GpuSpec:
    """The GPU of a command's --gpu / --gpu-memory-gib (``args.gpu``, ``args.gpu_memory_gib``): a table name, or a
    capacity (with --gpu: that card's rates), else the default GPU."""
    if args.gpu_memory_gib is not None:
        like = find_gpu(args.gpu) if args.gpu else None
        return custom_gpu(args.gpu_memory_gib, like)
    return find_gpu(args.gpu or DEFAULT_GPU)
