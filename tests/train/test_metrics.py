"""FLOPs per token against PyTorch's FLOP counter, the peak table, MFU and memory metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pretrain.errors import ConfigError
from pretrain.model.activation_checkpointing import apply as apply_checkpointing
from pretrain.model.build import build_model, hf_config
from pretrain.recipe.config import ModelConfig
from pretrain.train.metrics import (
    CONVENTION,
    PEAK_TFLOPS,
    Peak,
    ThroughputMonitor,
    cpu_compute_threads,
    flops_per_token,
    match_device,
    measure_cpu_peak_tflops,
    memory_metrics,
    mfu,
    resolve_peak,
)
from tests.helpers import counted_flops_per_token

SMALL = {"vocab_size": 256, "max_position_embeddings": 256, "bos_token_id": None, "eos_token_id": None,
         "pad_token_id": None}  # fmt: skip
LLAMA = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 176, **SMALL}
GPT2 = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 256,
        "bos_token_id": None, "eos_token_id": None}  # fmt: skip


def build(arch: str, checkpointing: str = "none", **config) -> tuple[torch.nn.Module, object]:
    cfg = AutoConfig.for_model(arch, use_cache=False, **config)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    apply_checkpointing(model, checkpointing)
    return model, cfg


# (arch, config, batch, seq_len): MHA, GQA, MQA with tied embeddings, GPT-2 (biases, n_inner default 4d).
TRAIN_CASES = {
    "llama-mha": ("llama", {**LLAMA, "num_key_value_heads": 4}, 2, 128),
    "llama-gqa": ("llama", {**LLAMA, "num_key_value_heads": 2}, 1, 256),
    "llama-mqa-tied": ("llama", {**LLAMA, "num_key_value_heads": 1, "tie_word_embeddings": True}, 2, 64),
    "gpt2": ("gpt2", GPT2, 2, 128),
    "gpt2-n_inner": ("gpt2", {**GPT2, "n_inner": 100}, 1, 64),
}


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_model_flops_match_flop_counter(case):
    arch, config, batch, seq_len = TRAIN_CASES[case]
    model, cfg = build(arch, **config)
    counted = counted_flops_per_token(model, cfg.vocab_size, batch, seq_len)
    flops = flops_per_token(cfg, seq_len)
    assert flops.model_flops == pytest.approx(counted, rel=0.02)
    assert flops.hardware_flops == flops.model_flops  # nothing is recomputed without checkpointing


def test_gqa_shrinks_only_key_value_weights():
    mha = flops_per_token(AutoConfig.for_model("llama", **LLAMA, num_key_value_heads=4), 128)
    gqa = flops_per_token(AutoConfig.for_model("llama", **LLAMA, num_key_value_heads=1), 128)
    d, kv_saved = 64, 3 * 16  # k and v lose 3 of 4 heads of 16 dims, in both layers
    assert mha.num_params_non_embedding - gqa.num_params_non_embedding == 2 * 2 * d * kv_saved
    # attention-score FLOPs follow the query heads, so they are unchanged
    assert mha.model_flops - gqa.model_flops == 6 * 2 * 2 * d * kv_saved


def test_tied_lm_head_still_counts():
    untied = flops_per_token(AutoConfig.for_model("llama", **LLAMA), 64)
    tied = flops_per_token(AutoConfig.for_model("llama", **LLAMA, tie_word_embeddings=True), 64)
    assert tied == untied


# Activation checkpointing recomputes each block's forward except the MLP down projection, unless a
# dropout or norm after it (GPT-2's resid_pdrop, on by default; OLMo-2's post-norm) saves its output.
CHECKPOINT_CASES = {
    "llama-gqa": ("llama", {**LLAMA, "num_key_value_heads": 2}),
    "gpt2-dropout": ("gpt2", GPT2),
    "gpt2-no-dropout": ("gpt2", {**GPT2, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "olmo2-post-norm": ("olmo2", {**LLAMA, "num_key_value_heads": 2}),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_hardware_flops_match_flop_counter_with_checkpointing(case):
    arch, config = CHECKPOINT_CASES[case]
    model, cfg = build(arch, checkpointing="full", **config)
    counted = counted_flops_per_token(model, cfg.vocab_size, 2, 128)
    flops = flops_per_token(cfg, 128, activation_checkpointing="full")
    assert flops.hardware_flops == pytest.approx(counted, rel=0.02)
    assert flops.hardware_flops > flops.model_flops


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "gemma", "olmo", "olmo2", "phi3", "gpt_neox"])
def test_other_architectures_match_flop_counter(arch):
    extra = {"head_dim": 32} if arch in ("gemma", "qwen3") else {}  # head_dim != hidden / heads
    config = {**LLAMA, **extra} if arch == "gpt_neox" else {**LLAMA, "num_key_value_heads": 2, **extra}
    model, cfg = build(arch, **config)
    counted = counted_flops_per_token(model, cfg.vocab_size, 1, 64)
    assert flops_per_token(cfg, 64).model_flops == pytest.approx(counted, rel=0.02)


def test_recipe_model_flops_per_checkpointing_policy():
    """The config and model the trainer builds (pretrain.model.build) agree under every policy: full recomputes each
    block's forward (but the down projection), every_2 blocks 0 and 2 of 3, selective no matmul and no
    attention kernel (their outputs are kept), so its hardware FLOPs are the model FLOPs."""
    base = dict(arch="llama", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=176,
                attention="eager")  # the flop counter has no formula for SDPA's CPU kernel: see the next test
    per_policy = {}
    for policy in ("none", "full", "every_2", "selective"):
        model_cfg = ModelConfig(**base, activation_checkpointing=policy)
        model = build_model(model_cfg, 256, 64, seed=0)
        counted = counted_flops_per_token(model, 256, 2, 64)
        flops = flops_per_token(hf_config(model_cfg, 256, 64), 64, activation_checkpointing=policy)
        assert flops.hardware_flops == pytest.approx(counted, rel=0.02), policy
        per_policy[policy] = flops
    model_flops = {f.model_flops for f in per_policy.values()}
    assert len(model_flops) == 1  # MFU never changes with the policy
    extra = {p: f.hardware_flops - f.model_flops for p, f in per_policy.items()}
    assert extra["none"] == extra["selective"] == 0
    assert extra["every_2"] == pytest.approx(extra["full"] * 2 / 3)  # 2 of 3 blocks


def test_selective_checkpointing_keeps_the_sdpa_kernel_output():
    """With sdpa, selective runs the attention kernel once per block (forward only), full twice."""
    from torch.utils._python_dispatch import TorchDispatchMode

    kernels = []

    class CountAttention(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("_scaled_dot_product") and "backward" not in func.__name__:
                kernels.append(func.__name__)
            return func(*args, **(kwargs or {}))

    for policy, runs in (("none", 3), ("full", 6), ("selective", 3)):
        model = build_model(ModelConfig(arch="llama", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                                        intermediate_size=176, attention="sdpa", activation_checkpointing=policy),
                            256, 64, seed=0)
        kernels.clear()
        ids = torch.randint(0, 256, (2, 64))
        with CountAttention():
            model(input_ids=ids, labels=ids).loss.backward()
        assert len(kernels) == runs, (policy, kernels)


def test_selective_checkpointing_keeps_an_moe_s_grouped_gemm_output():
    """transformers' experts run one grouped GEMM per projection (on CPU too): selective keeps its output as it keeps
    every other matmul's, so its backward recomputes none of the experts' matmuls (before: as many as full's), and
    the FLOPs model's "selective recomputes no matmul" holds for a mixture of experts."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pretrain.recipe.config import MoEConfig

    grouped = []

    class CountGroupedGemm(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("_grouped_mm"):
                grouped.append(func.__name__)
            return func(*args, **(kwargs or {}))

    counts = {}
    for policy in ("none", "full", "selective"):
        model = build_model(ModelConfig(arch="olmoe", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=None,
                                        activation_checkpointing=policy,
                                        moe=MoEConfig(num_experts=4, experts_per_token=2, expert_intermediate_size=32)),
                            256, 64, seed=0)
        grouped.clear()
        ids = torch.randint(0, 256, (2, 64))
        with CountGroupedGemm():
            model(input_ids=ids, labels=ids).loss.backward()
        counts[policy] = len(grouped)
    # forward: 2 per block (gate_up, down); backward: 2 per weight gradient and input gradient each
    assert counts["none"] > 0 and counts["full"] == counts["none"] + 4
    assert counts["selective"] == counts["none"], counts


def test_convention_and_unknown_arch():
    flops = flops_per_token(AutoConfig.for_model("llama", **LLAMA), 64)
    assert flops.convention == CONVENTION and "6 x N" in CONVENTION
    with pytest.raises(ConfigError, match="no FLOPs formula for model.arch = qwen2_moe"):
        flops_per_token(AutoConfig.for_model("qwen2_moe"), 64)


def test_llama2_7b_flops_per_token():
    """Llama-2-7B: N = 6,738,415,616 - 32000 x 4096 (input embedding) - 65 x 4096 (norms) at seq 4096."""
    cfg = AutoConfig.for_model("llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                               intermediate_size=11008, vocab_size=32000)  # fmt: skip
    flops = flops_per_token(cfg, 4096)
    assert flops.num_params_non_embedding == 6_738_415_616 - 32000 * 4096 - 65 * 4096
    assert flops.model_flops == 6 * flops.num_params_non_embedding + 12 * 32 * 32 * 128 * 4096


# ---- Peak FLOPs ----------------------------------------------------------------------------------------

REAL_NAMES = {
    "NVIDIA H100 80GB HBM3": "H100 SXM",
    "NVIDIA H100 PCIe": "H100 PCIe",
    "NVIDIA H100 NVL": "H100 NVL",
    "NVIDIA A100-SXM4-80GB": "A100 SXM",
    "NVIDIA A100-SXM4-40GB": "A100 SXM",
    "NVIDIA A100-PCIE-40GB": "A100 PCIe",
    "NVIDIA A100 80GB PCIe": "A100 PCIe",
    "NVIDIA H200": "H200 SXM",
    "NVIDIA H200 NVL": "H200 NVL",
    "NVIDIA GH200 480GB": "GH200",
    "NVIDIA B200": "B200",
    "NVIDIA GB200": "GB200",
    "NVIDIA L40S": "L40S",
    "NVIDIA L40": "L40",
    "NVIDIA L4": "L4",
    "NVIDIA A10": "A10",
    "NVIDIA A10G": "A10G",
    "Tesla T4": "T4",
    "Tesla V100-SXM2-16GB": "V100 SXM2",
    "Tesla V100-SXM2-32GB": "V100 SXM2",
    "Tesla V100-PCIE-32GB": "V100 PCIe",
    "Tesla V100S-PCIE-32GB": "V100S PCIe",
    "AMD Instinct MI300X": "MI300X",
    "AMD Instinct MI250X/MI250": "MI250X",
    "AMD Instinct MI250X": "MI250X",
    "NVIDIA GeForce RTX 4090": "RTX 4090",
    "NVIDIA RTX A6000": "RTX A6000",
}


@pytest.mark.parametrize("name", list(REAL_NAMES))
def test_match_device_real_names(name):
    assert match_device(name) == REAL_NAMES[name]


@pytest.mark.parametrize(
    "name", ["AMD Instinct MI350X", "NVIDIA GeForce RTX 3090", "NVIDIA RTX 6000 Ada Generation",
             "NVIDIA A100-SXM4-40GB MIG 3g.20gb", "NVIDIA H100", ""]
)
def test_match_device_unknown(name):
    assert match_device(name) is None


def test_table_is_dense_and_complete():
    assert set(REAL_NAMES.values()) <= set(PEAK_TFLOPS)
    for key, row in PEAK_TFLOPS.items():
        assert set(row) <= {"bf16", "fp16", "tf32", "fp32"}, key
    assert PEAK_TFLOPS["H100 SXM"]["bf16"] == pytest.approx(989.5)  # not the 1979 sparsity figure
    assert PEAK_TFLOPS["A100 SXM"]["bf16"] == 312
    assert PEAK_TFLOPS["MI300X"]["bf16"] == pytest.approx(1307.4)


def test_resolve_peak_from_table():
    assert resolve_peak("cuda", "NVIDIA H100 PCIe", "bf16", None) == Peak(
        756.5, "table", "table: H100 PCIe bf16 dense, 756.5 TFLOP/s"
    )
    assert resolve_peak("cuda", "NVIDIA A100-SXM4-80GB", torch.float16, None).tflops == 312


def test_fp32_reads_tf32_row_when_torch_allows_it():
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert resolve_peak("cuda", "NVIDIA A100-SXM4-80GB", "fp32", None).tflops == 19.5
        torch.set_float32_matmul_precision("high")
        assert resolve_peak("cuda", "NVIDIA A100-SXM4-80GB", "fp32", None).tflops == 156
    finally:
        torch.set_float32_matmul_precision(previous)


def test_unknown_device_has_no_peak_and_no_mfu():
    peak = resolve_peak("cuda", "AMD Instinct MI350X", "bf16", None)
    assert peak.tflops is None and peak.source == "unknown" and "MI350X" in peak.detail
    assert mfu(1e9, 1e4, peak.tflops) is None
    assert resolve_peak("cuda", "Tesla V100-SXM2-16GB", "bf16", None).tflops is None  # Volta has no bf16
    assert resolve_peak("mps", "Apple M2", "fp32", None).source == "unknown"


def test_recipe_peak_wins():
    assert resolve_peak("cuda", "NVIDIA H100 80GB HBM3", "bf16", 500.0) == Peak(
        500.0, "recipe", "recipe: 500.0 TFLOP/s"
    )
    assert resolve_peak("cuda", "AMD Instinct MI350X", "bf16", 2300).tflops == 2300
    assert resolve_peak("cpu", None, "fp32", 0.5).source == "recipe"  # no benchmark either


def test_cpu_peak_is_measured_within_budget():
    start = time.perf_counter()
    tflops = measure_cpu_peak_tflops("fp32")
    assert time.perf_counter() - start < 2.0
    assert 0 < tflops < 100  # positive, and no CPU reaches 100 TFLOP/s in fp32
    threads = torch.get_num_threads()
    peak = resolve_peak("cpu", None, "bf16", None)
    assert peak.source == "measured" and peak.tflops > 0 and "bf16" in peak.detail
    assert f"= {cpu_compute_threads()} thread" in peak.detail and torch.get_num_threads() == threads


def test_mfu_stays_at_most_100_percent_when_the_cpu_is_busy_during_the_peak_measurement():
    """Busy processes on every core while the peak is measured, then a matmul workload on the idle cores:
    the measured peak holds up (it was 1 GFLOP/s against 27 idle with the old multi-threaded probe, so MFU
    read ~100x too high), and MFU stays <= 100% whatever the probe gave."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.3)  # every busy process is spinning
        loaded = resolve_peak("cpu", None, "fp32").tflops
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    idle = measure_cpu_peak_tflops("fp32")
    assert loaded > 0.5 * idle, (loaded, idle)
    n, matmuls_per_step = 384, 20
    a, b = torch.randn(n, n), torch.randn(n, n)
    monitor = ThroughputMonitor(1, 1, 1, flops_per_token=2 * n**3 * matmuls_per_step, peak_tflops=loaded)
    for step in range(1, 7):
        for _ in range(matmuls_per_step):
            torch.mm(a, b)
        monitor.step_done(step)
        if step % 2 == 0:
            perf = monitor.metrics(step)
            assert 0 < perf["perf/mfu"] <= 1.0, perf


def test_mfu_arithmetic():
    # 6e9 FLOPs/token x 50,000 tokens/s = 300 TFLOP/s achieved, of a 1,000 TFLOP/s peak
    assert mfu(6e9, 50_000, 1000.0) == pytest.approx(0.3)
    assert mfu(6e9, 50_000, 0.0) is None


def test_memory_metrics_on_cpu():
    metrics = memory_metrics("cpu")
    assert set(metrics) == {"memory/peak_gib", "memory/rss_gib"}
    assert 0 < metrics["memory/rss_gib"] <= metrics["memory/peak_gib"] * 1.01 < 1024


def test_cpu_peak_is_measured_once_per_cpu_and_read_back(tmp_path, monkeypatch):
    """The measurement costs its budget (0.3 s); a later run on the same CPU, threads and torch reads the figure."""
    from pretrain.train import metrics

    calls = []
    monkeypatch.setattr(metrics, "measure_cpu_peak_tflops", lambda dtype: calls.append(dtype) or 0.125)
    assert metrics.cached_cpu_peak_tflops("fp32", tmp_path) == (0.125, None)
    (path,) = (tmp_path / "cpu_peak").iterdir()
    assert metrics.cached_cpu_peak_tflops("fp32", tmp_path) == (0.125, path) and calls == ["fp32"]
    peak = resolve_peak("cpu", None, "fp32", None, cache_dir=tmp_path)
    assert peak.tflops == 0.125 and str(path) in peak.detail and calls == ["fp32"]
    metrics.cached_cpu_peak_tflops("bf16", tmp_path)  # another dtype: its own measurement
    monkeypatch.setattr(metrics, "cpu_compute_threads", lambda: 97)  # other threads: another figure
    metrics.cached_cpu_peak_tflops("fp32", tmp_path)
    assert calls == ["fp32", "bf16", "fp32"]
    path.write_text("{torn")  # a damaged file is measured again and replaced
    monkeypatch.undo()
    monkeypatch.setattr(metrics, "measure_cpu_peak_tflops", lambda dtype: 0.5)
    assert metrics.cached_cpu_peak_tflops("fp32", tmp_path) == (0.5, None)
    assert metrics.cached_cpu_peak_tflops("fp32", tmp_path) == (0.5, path)


# ---- measured on the meta device (pretrain/model/measure.py): any architecture without a closed form

MEASURED_CLOSED = {
    "llama-gqa": ("llama", {**LLAMA, "num_key_value_heads": 2}),
    "llama-tied": ("llama", {**LLAMA, "tie_word_embeddings": True}),
    "qwen3-head-dim": ("qwen3", {**LLAMA, "num_key_value_heads": 2, "head_dim": 32}),
    "gpt_neox": ("gpt_neox", LLAMA),
    "gpt2": ("gpt2", GPT2),
}


@pytest.mark.parametrize("case", list(MEASURED_CLOSED))
def test_measured_shape_equals_the_closed_form(case):
    """Where both exist the meta-device measurement and the closed form agree exactly: the same convention."""
    from pretrain.model.measure import measure

    arch, config = MEASURED_CLOSED[case]
    cfg = AutoConfig.for_model(arch, use_cache=False, **config)
    measured, closed = measure(cfg, 64), flops_per_token(cfg, 64)
    assert measured.flops_per_token() == closed
    assert measured.num_params == sum(p.numel() for p in build(arch, **config)[0].parameters())
    # checkpointing: the measurement recomputes the whole block (an upper bound by the MLP's down projection)
    full_closed = flops_per_token(cfg, 64, activation_checkpointing="full").hardware_flops
    full_measured = measured.flops_per_token("full").hardware_flops
    width = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * cfg.hidden_size
    down_projections = 2 * cfg.num_hidden_layers * cfg.hidden_size * width
    assert full_closed <= full_measured <= full_closed + down_projections
    assert measured.flops_per_token("selective").hardware_flops == closed.model_flops


MEASURED_ONLY = {
    "bloom": {},
    "falcon": {},
    "starcoder2": {"intermediate_size": 96, "num_key_value_heads": 2},
    "gemma2": {"intermediate_size": 96, "head_dim": 16},
}


@pytest.mark.parametrize("arch", list(MEASURED_ONLY))
def test_measured_flops_without_a_closed_form_match_a_training_step(arch):
    """No formula for these: 3 x the meta forward's count is the FLOPs of a real forward + backward on CPU."""
    from pretrain.model.measure import measure

    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, **SMALL, **MEASURED_ONLY[arch]}
    model, cfg = build(arch, **config)
    with pytest.raises(ConfigError, match="no FLOPs formula"):
        flops_per_token(cfg, 64)
    measured = measure(cfg, 64)
    assert measured.num_params == sum(p.numel() for p in model.parameters())
    counted = counted_flops_per_token(model, cfg.vocab_size, 1, 64)
    assert measured.flops_per_token().model_flops == pytest.approx(counted, rel=0.02)


def test_trainer_falls_back_to_measured_flops_and_says_so():
    from pretrain.model.measure import measure
    from pretrain.recipe.config import load_recipe
    from pretrain.train.metrics import measured_flops
    from tests.helpers import TINY

    recipe = load_recipe(TINY, ["model.activation_checkpointing=full"])
    cfg = AutoConfig.for_model("bloom", hidden_size=64, n_layer=2, n_head=4, **SMALL)
    lines = []
    flops = measured_flops(recipe, cfg, lines.append)
    assert flops == measure(cfg, recipe.data.seq_len).flops_per_token("full")
    assert flops.hardware_flops > flops.model_flops
    # the perf line and run_config.json name how these FLOPs were found, not the closed form's formula
    assert flops.convention.startswith("model FLOPs/token = 3 x one forward's matmul FLOPs, counted by FlopCounterMode")
    assert lines == [f"FLOPs per token of bloom measured (no closed form): {flops.model_flops / 3:,.0f} per forward, "
                     "counted by FlopCounterMode on the meta device; training = 3 x forward"]
    assert measured_flops(recipe, AutoConfig.for_model("codegen", n_embd=64, n_head=4, **SMALL), lines.append) is None
    assert lines[-1].startswith("warning: no FLOPs count, so no TFLOP/s or MFU: model_type = 'codegen'")
