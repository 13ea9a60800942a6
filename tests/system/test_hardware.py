"""The one hardware table: every peak against the figure its source prints, one matcher, one GPU list."""

from __future__ import annotations

import pytest

from pretrain.errors import ConfigError
from pretrain.plan import memory
from pretrain.system import hardware
from pretrain.system.hardware import CARDS, GPUS, find_gpu, gpu_for_device, match_device
from pretrain.train import metrics


@pytest.mark.parametrize("card", CARDS, ids=lambda c: c.key)
def test_every_peak_is_its_printed_figure_made_dense(card):
    """A figure printed with 2:4 sparsity ("1,979*") is twice the dense rate; a package of several devices
    (MI250X: two GCDs) shares its figure among them."""
    assert card.source.strip(), card.key
    assert set(card.peaks) <= {"bf16", "fp16", "tf32", "fp32"}, card.key
    for dtype, rate in card.peaks.items():
        printed = float(rate.printed.rstrip("*").replace(",", ""))
        sparse = rate.printed.endswith("*")
        assert rate.dense == pytest.approx(printed / (2 if sparse else 1) / card.per_package), (card.key, dtype)
    if card.key in ("A100 SXM", "H100 SXM", "B200", "L4"):
        assert all(rate.printed.endswith("*") for dtype, rate in card.peaks.items() if dtype != "fp32")


def test_known_gpus_have_memory_bandwidth_and_their_source():
    assert list(GPUS)[:2] == ["T4-16GB", "V100-16GB"]
    assert [g.memory_mib for g in GPUS.values()] == sorted(g.memory_mib for g in GPUS.values())
    for gpu in GPUS.values():
        card = hardware.CARDS_BY_KEY[gpu.card]
        assert gpu.bf16_tflops and gpu.intra_node_gb_s and gpu.inter_node_gb_s and card.link.strip(), gpu.name


def test_one_table_for_mfu_the_estimator_and_the_planner():
    """The MFU peak of a card and the planner's compute rate for the same card are one number."""
    assert metrics.PEAK_TFLOPS is hardware.PEAK_TFLOPS and metrics.match_device is match_device
    assert memory.find_gpu is find_gpu and memory.gpu_for_device is gpu_for_device
    for gpu in GPUS.values():
        peaks = hardware.PEAK_TFLOPS[gpu.card]
        assert gpu.bf16_tflops == peaks.get("bf16", peaks.get("fp16")), gpu.name
    assert find_gpu("a10g-24gb").bf16_tflops == metrics.resolve_peak("cuda", "NVIDIA A10G", "bf16").tflops == 70


def test_the_device_in_use():
    h100 = gpu_for_device("NVIDIA H100 80GB HBM3", 85_520_809_984)
    assert (h100.card, h100.bf16_tflops, round(h100.memory_gib, 2)) == ("H100 SXM", 989.5, 79.65)
    unknown = gpu_for_device("NVIDIA GeForce RTX 3090", 25_447_170_048)
    assert unknown.card is None and unknown.bf16_tflops is None and unknown.memory_gib > 23


def test_find_gpu_ignores_case_and_dashes_and_suggests():
    assert find_gpu("h100 80gb") is GPUS["H100-80GB"]
    with pytest.raises(ConfigError, match=r"did you mean H100-80GB\?.*known GPUs: T4-16GB"):
        find_gpu("H100-800GB")
