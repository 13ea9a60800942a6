"""GPU-only paths: peak-FLOPs detection, CUDA memory stats, bf16 and fp16 with loss scaling.

Skipped on machines without CUDA (see conftest.py); run them where a GPU is available.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import FAST, accelerate_launch, check_ok, metrics

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_this_gpu_is_in_the_peak_table():
    import torch

    from pretrain.metrics import match_device, resolve_peak

    name = torch.cuda.get_device_name(0)
    assert match_device(name) is not None, f"add {name!r} to pretrain/hardware.py (CARDS)"
    peak = resolve_peak("cuda", name, "bf16")
    assert peak.source == "table" and peak.tflops > 50


def test_bf16_single_gpu_run_logs_mfu_and_cuda_memory(tmp_path):
    out = tmp_path / "run"
    check_ok(accelerate_launch("single_gpu.yaml", [*FAST, "train.max_steps=6", "precision.dtype=bf16",
                                                   f"output_dir={out}"]))
    config = json.loads((out / "run_config.json").read_text())
    assert config["perf/peak_source"] == "table" and config["dist/device"].startswith("cuda")
    assert config["optim/class"] == "AdamW" and config["optim/fused"] is True
    logged = [m for m in metrics(out) if "perf/mfu" in m]
    assert logged and all(0 < m["perf/mfu"] < 1 for m in logged)
    assert all(m["memory/peak_gib"] > 0 and "memory/reserved_gib" in m for m in logged)


def test_fp16_logs_the_dynamic_loss_scale(tmp_path):
    out = tmp_path / "run"
    check_ok(accelerate_launch("single_gpu.yaml", [*FAST, "train.max_steps=4", "precision.dtype=fp16",
                                                   "precision.initial_scale_power=12", f"output_dir={out}"]))
    scales = [m["train/loss_scale"] for m in metrics(out) if "train/loss_scale" in m]
    assert scales and scales[0] <= 2.0**12
