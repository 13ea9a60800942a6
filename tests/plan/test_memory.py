"""The memory estimator's arithmetic, its CLI (pretrain-estimate), the planner (pretrain-plan) and bad input.

The measurements that back the formulas are in test_memory_validation.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pretrain.cli import estimate as estimate_memory
from pretrain.cli import plan
from pretrain.distributed.layout import Launch
from pretrain.errors import EXIT_USAGE, ConfigError
from pretrain.plan import memory, planner
from pretrain.recipe.batching import plan_batches
from pretrain.recipe.config import ModelConfig, load_recipe
from pretrain.recipe.shape import ModelShape, recipe_vocab_size
from tests.helpers import shipped_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
CONFIGS = ROOT / "accelerate_configs"
R7B = str(ROOT / "recipes" / "7b.yaml")
R70B = str(ROOT / "recipes" / "70b.yaml")
LLAMA2_7B = 6_738_415_616


def shape_of(path) -> ModelShape:
    return ModelShape.from_recipe(shipped_recipe(path))


# --------------------------------------------------------------------------------------------------
# Parameters


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_parameter_count_exact_for_every_recipe(path):
    """The estimator's closed form (no transformers) equals the meta-built transformers model."""
    from pretrain.model.build import build_model, count_parameters

    recipe = shipped_recipe(path)
    vocab = recipe_vocab_size(recipe.model, recipe.data)
    model = build_model(recipe.model, vocab, recipe.data.seq_len, seed=0, meta=True)
    assert shape_of(path).num_params == count_parameters(model)


def test_llama2_7b_and_70b_counts():
    assert shape_of(R7B).num_params == LLAMA2_7B
    assert shape_of(R70B).num_params == 68_976_648_192


def test_count_from_a_transformers_config_json(tmp_path):
    llama = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
             "max_position_embeddings": 4096, "tie_word_embeddings": False}
    assert ModelShape.from_hf_config(llama).num_params == LLAMA2_7B
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    assert ModelShape.from_hf_config(gpt2).num_params == 124_439_808  # GPT-2 small, tied head
    with pytest.raises(ConfigError, match="formulas for llama"):
        ModelShape.from_hf_config({"model_type": "t5"})


def test_config_overrides_that_change_the_shape_are_followed():
    from pretrain.model.build import build_model, count_parameters

    cfg = ModelConfig(arch="llama", hidden_size=128, num_layers=2, num_heads=4, intermediate_size=256, vocab_size=512,
                      config_overrides={"attention_bias": True, "mlp_bias": True, "head_dim": 64})
    model = build_model(cfg, 512, 64, seed=0, meta=True)
    assert ModelShape.from_model_config(cfg, 512, 64).num_params == count_parameters(model)


# --------------------------------------------------------------------------------------------------
# Model states


def states(stage, precision="bf16", n=8, offload="none", params_offload="none", params=None):
    shape = shape_of(R7B) if params is None else params
    w = memory.Workload(precision=precision, micro_batch_size=1, seq_len=4096)
    return memory.estimate_shape(shape, w, Launch("deepspeed", stage, offload, params_offload, 1, n))


def test_zero_partitions_what_the_paper_says():
    P = LLAMA2_7B
    GiB = memory.GIB
    s0, s1, s2, s3 = (states(k) for k in range(4))
    # ZeRO-0: 2Ψ bf16 weights + 4Ψ fp32 master + 8Ψ Adam, replicated; gradients 2Ψ + DeepSpeed's fp32 copy 4Ψ
    assert s0.terms["params"].bytes == 2 * P
    assert s0.terms["optimizer"].bytes == 12 * P
    assert s0.terms["grads"].bytes == 6 * P
    # ZeRO-1: optimizer states (with the master) / N
    assert s1.terms["optimizer"].bytes == pytest.approx(12 * P / 8, abs=16)
    assert s1.terms["params"].bytes == 2 * P
    # ZeRO-2: the bf16 gradient partition, or inside step() its fp32 copy
    assert s2.terms["grads"].bytes == pytest.approx(4 * P / 8, abs=16)
    # ZeRO-3: parameters / N too (plus the small persistent ones)
    assert s3.terms["params"].bytes == pytest.approx(2 * P / 8, rel=1e-3)
    assert s0.model_state_bytes > s1.model_state_bytes > s2.model_state_bytes > s3.model_state_bytes
    assert s3.model_state_bytes / GiB < 20


def test_bf16_gradients_accumulate_in_fp32_unless_reduce_dtype_is_bf16():
    P = LLAMA2_7B

    def zero(stage, reduce):
        w = memory.Workload(precision="bf16", micro_batch_size=1, seq_len=4096, reduce_dtype=reduce)
        return memory.estimate_shape(shape_of(R7B), w, Launch("deepspeed", stage, "none", "none", 1, 8))

    # ZeRO-1: DeepSpeed's BF16_Optimizer keeps a full, replicated fp32 gradient buffer beside the bf16 gradients
    assert zero(1, "fp32").terms["grads"].bytes == (2 + 4) * P and zero(1, "bf16").terms["grads"].bytes == 2 * P
    assert "BF16_Optimizer" in zero(1, "fp32").terms["grads"].formula
    # ZeRO-2 / ZeRO-3: the accumulated gradient partition is fp32 (4 B x Ψ/N) instead of bf16
    for stage in (2, 3):
        fp32, bf16 = zero(stage, "fp32").terms["grads"], zero(stage, "bf16").terms["grads"]
        assert fp32.phases.backward - bf16.phases.backward == pytest.approx(2 * P / 8, abs=16)


def test_zero2_fp32_partition_keeps_large_gradients_to_the_end_of_backward():
    """A gradient larger than the reduce bucket is reduced on its own from the parameter's bf16 .grad. With the
    fp32 gradient partition DeepSpeed keeps that .grad to the end of backward on the ranks whose partition holds
    the parameter; the embeddings' gradient (the last of backward) is still pending then on every rank."""
    P, embeddings = LLAMA2_7B, 32000 * 4096

    def grads(reduce, bucket):
        w = memory.Workload(precision="bf16", micro_batch_size=1, seq_len=4096, reduce_dtype=reduce)
        return memory.estimate_shape(shape_of(R7B), w, Launch("deepspeed", 2, "none", "none", 1, 8),
                                     buffers=memory.DeepSpeedBuffers(reduce_bucket_size=bucket)).terms["grads"]

    # the default bucket (5e8 elements) holds every gradient of 7B: nothing is kept beside the partition
    assert grads("fp32", 500_000_000).phases.backward == 4 * -(-P // 8)
    # bucket 1e8: the embeddings and the LM head (131M each) are reduced on their own. The last rank's partition
    # holds the LM head, kept, and the embeddings' gradient is pending: two bf16 gradients on the worst rank.
    kept = grads("fp32", 100_000_000)
    assert kept.phases.backward == 4 * -(-P // 8) + 2 * 2 * embeddings
    assert "2 gradient(s) larger than the bucket" in kept.formula
    # bf16 accumulation (a bf16 partition that the reduced gradients are copied into): only the pending one
    assert grads("bf16", 100_000_000).phases.backward == 2 * -(-P // 8) + 2 * embeddings


def test_fp32_keeps_a_master_copy_only_where_deepspeed_clones_one():
    P = LLAMA2_7B
    assert states(0, "fp32", n=1).terms["optimizer"].bytes == 8 * P  # the weights are the master
    assert states(1, "fp32").terms["optimizer"].bytes == pytest.approx((4 + 8) * P / 8, abs=16)


def test_offload_moves_optimizer_states_to_the_host():
    on_gpu, off = states(2), states(2, offload="cpu")
    assert off.terms["optimizer"].bytes == 0 and on_gpu.terms["optimizer"].bytes > 0
    assert off.host_bytes_per_rank > on_gpu.terms["optimizer"].bytes
    assert off.host_bytes_per_node == 8 * off.host_bytes_per_rank
    both = states(3, offload="cpu", params_offload="cpu")
    assert both.terms["params"].bytes < states(3).terms["params"].bytes / 100


def fsdp(sharding="FULL_SHARD", nodes=1, gas=1, offload="none", reduce="fp32", hybrid=None):
    w = memory.Workload(precision="bf16", micro_batch_size=1, seq_len=4096, grad_accum_steps=gas, reduce_dtype=reduce)
    return memory.estimate_shape(shape_of(R7B), w, Launch("fsdp", offload_params=offload, num_nodes=nodes,
                                                          gpus_per_node=8, fsdp_sharding=sharding,
                                                          hybrid_shard_size=hybrid))


def test_fsdp_shards_what_its_strategy_says():
    P = LLAMA2_7B
    full, grad_op, no_shard = fsdp(), fsdp("SHARD_GRAD_OP"), fsdp("NO_SHARD")
    ddp = memory.estimate_shape(shape_of(R7B), memory.Workload(precision="bf16", seq_len=4096),
                                Launch("ddp", gpus_per_node=8))
    # FULL_SHARD: fp32 parameters, gradients and AdamW states / N, like ZeRO-3 (the shards are the master)
    assert (full.terms["params"].bytes, full.terms["grads"].bytes, full.terms["optimizer"].bytes) == (
        4 * P // 8, 4 * P // 8, 8 * P // 8)
    # SHARD_GRAD_OP shards the same but keeps every unit gathered (bf16) from its forward to its backward
    assert grad_op.terms["params"].bytes == full.terms["params"].bytes
    assert grad_op.terms["comm"].bytes - full.terms["comm"].bytes > 1.8 * P
    # NO_SHARD: DDP's fp32 states without the reducer's bucket copy or autocast's cache
    assert no_shard.terms["params"].bytes == 4 * P and no_shard.terms["optimizer"].bytes == 8 * P
    assert full.model_state_bytes < grad_op.model_state_bytes < no_shard.model_state_bytes < ddp.model_state_bytes
    # HSDP on 2 nodes shards within a node: what FULL_SHARD keeps on 8 GPUs
    assert fsdp(nodes=2, hybrid=8).model_state_bytes == full.model_state_bytes
    assert fsdp(nodes=2).model_state_bytes < full.model_state_bytes


def test_hybrid_sharding_memory_by_hand():
    """7B (Ψ = 6,738,415,616) in bf16 with AdamW on 4 nodes x 8 GPUs. ZeRO-3 + hpZ adds the secondary bf16
    partition within a node, 2 B x Ψ / 8, to ZeRO-3's parameters and nothing else; HSDP keeps FSDP's fp32
    shards, gradients and AdamW states over the 8 GPUs of a node instead of all 32."""
    P = LLAMA2_7B
    w = memory.Workload(precision="bf16", micro_batch_size=1, seq_len=4096, grad_accum_steps=1)

    def est(layout):
        return memory.estimate_shape(shape_of(R7B), w, layout)

    zero3 = est(Launch("deepspeed", 3, num_nodes=4, gpus_per_node=8))
    hpz = est(Launch("deepspeed", 3, num_nodes=4, gpus_per_node=8, hybrid_shard_size=8))
    assert hpz.terms["params"].bytes - zero3.terms["params"].bytes == 2 * -(-P // 8) == 1_684_603_904
    for key in ("grads", "optimizer", "comm"):
        assert hpz.terms[key].bytes == zero3.terms[key].bytes, key
    assert "hpZ's secondary partition within 8 GPUs" in hpz.explain()

    hsdp = est(Launch("fsdp", num_nodes=4, gpus_per_node=8, fsdp_sharding="FULL_SHARD", hybrid_shard_size=8))
    full = est(Launch("fsdp", num_nodes=4, gpus_per_node=8, fsdp_sharding="FULL_SHARD"))
    assert (hsdp.terms["params"].bytes, hsdp.terms["optimizer"].bytes) == (4 * P // 8, 8 * P // 8)
    assert (full.terms["params"].bytes, full.terms["optimizer"].bytes) == (4 * P // 32, 8 * P // 32)
    assert "4 replicas" in hsdp.explain()


def test_fsdp_accumulation_and_offload():
    P = LLAMA2_7B
    # accelerate's no_sync skips the reduce-scatter before the last micro-step: full gradients, accumulated in
    # fp32 under pretrain's policy (reduce_dtype fp32), in bf16 with precision.reduce_dtype=bf16
    accumulating = fsdp(gas=4)
    assert accumulating.terms["grads"].bytes == 4 * P and "no_sync" in accumulating.terms["grads"].formula
    assert fsdp(gas=4, reduce="bf16").terms["grads"].bytes == 2 * P
    assert fsdp(reduce="bf16").terms["comm"].bytes < fsdp().terms["comm"].bytes  # no fp32 copy for the reduce
    offloaded = fsdp(offload="cpu")
    assert offloaded.terms["params"].bytes == offloaded.terms["optimizer"].bytes == offloaded.terms["grads"].bytes == 0
    assert offloaded.host_bytes_per_rank == (4 + 8 + 4) * P // 8
    assert offloaded.terms["comm"].bytes == fsdp().terms["comm"].bytes  # the units are still gathered on the GPU


def test_classic_7b_example():
    """'28 GB weights, 28 GB gradients, 84 GB optimizer states, 140 GB' counts 12 B/param of optimizer state."""
    quoted = memory.classic_example_gb(7e9, "fp32", state_bytes=12)
    assert (quoted["weights"], quoted["gradients"], quoted["optimizer"], quoted["total"]) == (28, 28, 84, 140)
    fp32 = memory.classic_example_gb(7e9, "fp32", state_bytes=8)
    assert (fp32["optimizer"], fp32["total"]) == (56, 112)
    mixed = memory.classic_example_gb(7e9, "bf16", state_bytes=8)  # 2 + 2 + (4 master + 8) = 16 B/param
    assert (mixed["weights"], mixed["optimizer"], mixed["total"]) == (14, 84, 112)
    assert "12 B/param" in memory.CLASSIC_EXAMPLE
    one_gpu = memory.estimate_shape(shape_of(R7B), memory.Workload(precision="fp32", seq_len=4096),
                                    Launch("ddp", 0))
    assert one_gpu.model_state_bytes == 16 * LLAMA2_7B


def test_optimizer_state_table():
    assert memory.optimizer_state_bytes("AdamW")[0] == 8
    assert memory.optimizer_state_bytes("SGD")[0] == 0
    assert memory.optimizer_state_bytes("SGD", {"momentum": 0.9})[0] == 4
    assert memory.optimizer_state_bytes("Adam", {"amsgrad": True})[0] == 12
    k, why = memory.optimizer_state_bytes("Shampoo")
    assert k == 8 and "counted like Adam" in why


# --------------------------------------------------------------------------------------------------
# Activations


LLAMA_SMALL = ModelConfig(arch="llama", hidden_size=256, num_layers=4, num_heads=8, intermediate_size=688,
                          vocab_size=1000)


def acts(cfg=LLAMA_SMALL, seq=512, mbs=1, attention="sdpa", ckpt=False, precision="bf16"):
    shape = ModelShape.from_model_config(cfg, 1000, seq)
    return memory.activation_memory(shape, mbs, seq, precision, attention, ckpt)


def test_flash_and_sdpa_have_no_quadratic_term_eager_does():
    assert acts(seq=1024).saved_bytes == 2 * acts(seq=512).saved_bytes - 2 * 0  # linear in tokens
    assert acts(seq=1024, attention="flash_attention_2").saved_bytes == acts(seq=1024).saved_bytes
    assert acts(seq=1024, attention="eager").saved_bytes > 2 * acts(seq=512, attention="eager").saved_bytes
    assert acts(seq=512, mbs=2).saved_bytes == pytest.approx(2 * acts(seq=512).saved_bytes, rel=0.01)


def test_document_masking_adds_one_boolean_mask_for_sdpa_only():
    shape = ModelShape.from_model_config(LLAMA_SMALL, 1000, 512)
    for ckpt in (False, True):
        plain = memory.activation_memory(shape, 2, 512, "bf16", "sdpa", ckpt)
        masked = memory.activation_memory(shape, 2, 512, "bf16", "sdpa", ckpt, document_masking=True)
        assert masked.saved_bytes - plain.saved_bytes == 2 * 512 * 512  # MBS x s x s, 1 byte each
        assert "document mask" in masked.lines[-1]
    for attention in ("flash_attention_2", "eager"):
        assert (memory.activation_memory(shape, 2, 512, "bf16", attention, document_masking=True).saved_bytes
                == memory.activation_memory(shape, 2, 512, "bf16", attention).saved_bytes)
    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", ["data.document_masking=true"])
    batch_plan = plan_batches(recipe.batch, 1, recipe.data.seq_len)
    assert memory.Workload.from_recipe(recipe, batch_plan).document_masking


def test_liger_has_no_logits_term_only_its_gradients_and_one_chunk():
    """model.loss resolved to liger: no T x V logits; Liger's hidden-state and LM-head gradients, one chunk of
    next_power_of_2(ceil(T / ceil(V / H))) tokens of logits (liger-kernel 0.8.5) and the per-token loss."""
    recipe = load_recipe(ROOT / "recipes" / "llama-1b.yaml", ["batch.micro_batch_size=4"])
    batch_plan = plan_batches(recipe.batch, 1, recipe.data.seq_len)
    chunked = memory.estimate(recipe, batch_plan, Launch())  # auto, unresolved: counted as chunked
    liger = memory.estimate(recipe, batch_plan, Launch(), loss="liger")
    T, V, H = 4 * 2048, 128256, 2048
    assert chunked.terms["logits"].bytes >= 2 * 2 * T * V  # bf16 logits and the loss's bf16 gradient buffer
    chunk = 256  # next_power_of_2(ceil(8192 / ceil(128256 / 2048) = 63) = 131)
    assert liger.terms["logits"].bytes == T * H * 4 + V * H * 4 + chunk * V * 2 + 4 * T  # fp32 weights (autocast)
    deepspeed = memory.estimate(recipe, batch_plan, Launch("deepspeed", zero_stage=2), loss="liger")
    assert deepspeed.terms["logits"].bytes == T * H * 2 + V * H * 2 + chunk * V * 2 + 4 * T  # bf16 engine weights
    saved = chunked.terms["logits"].bytes - liger.terms["logits"].bytes
    assert chunked.tensor_peak_bytes - liger.tensor_peak_bytes == saved  # the logits peak at the start of backward
    assert liger.total_bytes == liger.tensor_peak_bytes + liger.allowance.bytes
    with pytest.raises(ConfigError, match="loss 'fused'"):
        memory.Workload(loss="fused")


def test_gqa_checkpointing_and_precision_reduce_activations():
    gqa = ModelConfig(**{**LLAMA_SMALL.model_dump(), "num_kv_heads": 2})
    assert acts(gqa).per_layer_bytes < acts().per_layer_bytes
    assert acts(ckpt=True).activation_bytes < acts().activation_bytes / 3
    assert acts(precision="fp32").saved_bytes > acts().saved_bytes
    assert acts().logits_saved_bytes == 2 * 512 * 1000  # the loss's bf16 gradient buffer: MBS x seq x vocab x 2 B


# --------------------------------------------------------------------------------------------------
# The API the trainer uses


def test_estimate_from_recipe_and_plan():
    recipe = load_recipe(R7B, ["batch.micro_batch_size=1"])
    batch_plan = plan_batches(recipe.batch, 8, recipe.data.seq_len)
    est = memory.estimate(recipe, batch_plan, Launch("deepspeed", 3, gpus_per_node=8),
                          gpu=memory.find_gpu("H100-80GB"))
    assert est.num_params == LLAMA2_7B and est.fits
    assert est.total_bytes == max(est.phases.values()) + est.allowance.bytes
    with pytest.raises(ConfigError, match="batch plan is for 8 data-parallel ranks"):
        memory.estimate(recipe, batch_plan, Launch("deepspeed", 3, gpus_per_node=4))
    cpu = memory.estimate(load_recipe(ROOT / "recipes" / "tiny.yaml"), plan_batches(
        load_recipe(ROOT / "recipes" / "tiny.yaml").batch, 1, 128), Launch("ddp", 0), device="cpu")
    assert cpu.fits is None and cpu.allowance.bytes < memory.GIB


def test_trainer_helpers_layout_and_device():
    # The launch a training process reads from its environment (accelerate launch's variables).
    layout = Launch.from_env({"WORLD_SIZE": "16", "GROUP_WORLD_SIZE": "2", "RANK": "9", "ACCELERATE_USE_DEEPSPEED": "true",
                              "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                              "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"})
    assert (layout.engine, layout.zero_stage, layout.offload_optimizer, layout.world_size) == ("deepspeed", 3, "cpu", 16)
    assert (layout.num_nodes, layout.gpus_per_node, layout.rank) == (2, 8, 9)
    assert Launch.from_env({"WORLD_SIZE": "4"}).engine == "ddp"
    fsdp = Launch.from_env({"WORLD_SIZE": "2", "ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "false"})
    assert (fsdp.engine, fsdp.fsdp_sharding) == ("fsdp", "SHARD_GRAD_OP")
    h100 = memory.gpu_for_device("NVIDIA H100 80GB HBM3", 85_520_809_984)
    assert h100.name == "NVIDIA H100 80GB HBM3" and h100.bf16_tflops == 989.5
    assert h100.memory_gib == pytest.approx(79.65, abs=0.01)


def test_deepspeed_buffers_from_config_and_overrides():
    buf = memory.DeepSpeedBuffers.from_deepspeed_config(
        {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 1e6}})
    assert buf.reduce_bucket_size == 500_000_000 and buf.stage3_prefetch_bucket_size == 1_000_000
    assert buf.overrides(["reduce_bucket_size=2e8", "overlap_comm=true"]).reduce_bucket_size == 200_000_000
    with pytest.raises(ConfigError, match="KEY one of"):
        buf.overrides(["bucket=1"])


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "ddp", "cpu",
                                  "multinode_zero3"])
def test_shipped_accelerate_configs_give_a_layout(name):
    path = CONFIGS / f"{name}.yaml"
    if not path.exists():
        pytest.skip(f"{path.name} is not shipped")
    layout = Launch.from_accelerate_config(path)
    if name.startswith("zero"):
        assert layout.engine == "deepspeed" and layout.zero_stage == int(name[4])
        assert (layout.offload_optimizer == "cpu") == name.endswith("offload")
    elif name == "multinode_zero3":
        assert (layout.num_nodes, layout.world_size, layout.zero_stage) == (2, 16, 3)
    else:
        assert layout.engine == "ddp"


# --------------------------------------------------------------------------------------------------
# pretrain-estimate


def run_cli(capsys, *argv):
    code = estimate_memory.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_7b(capsys):
    code, out, err = run_cli(capsys, "--recipe", R7B, "--num-gpus", "8", "--zero", "3", "--micro-batch-size", "1",
                             "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["num_params"] == LLAMA2_7B
    assert set(data["per_device"]) == {"params_gib", "grads_gib", "optimizer_gib", "activations_gib", "other_gib",
                                       "total_gib"}
    assert data["fits"] is True and data["gpu_memory_gib"] == pytest.approx(79.65, abs=0.01)


def test_cli_70b_json_is_fast_and_allocates_nothing():
    """A fresh interpreter: imports included, under 2 s; no torch, no transformers."""
    code = (
        "import sys, time; t = time.perf_counter(); from pretrain.cli.estimate import main; "
        f"rc = main(['--recipe', {R70B!r}, '--num-gpus', '64', '--zero', '3', '--json']); "
        "print('SECONDS', time.perf_counter() - t); "
        "print('HEAVY', [m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules]); sys.exit(rc)"
    )
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout
    assert json.loads(proc.stdout.split("SECONDS")[0])["num_params"] == 68_976_648_192
    assert wall < 2.0, f"{wall:.2f} s"


def test_cli_summary_explain_and_sweep(capsys):
    code, out, _ = run_cli(capsys, "--recipe", R7B, "--num-gpus", "8", "--zero", "2", "--explain")
    assert code == 0
    # a bf16 recipe accumulates the gradient partition in fp32 (precision.reduce_dtype defaults to fp32)
    assert "4 B x Ψ/N fp32 accumulated partition" in out and "the fp32 partition 4 B x Ψ/N" in out and "12 B/param" in out
    assert "no s^2 term" in out
    code, out, _ = run_cli(capsys, "--recipe", R7B, "--nodes", "2", "--gpus-per-node", "8", "--gpu", "A100-40GB",
                           "--sweep", "--activation-checkpointing", "full")
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("DDP", "ZeRO"))}
    assert rows["ZeRO-3"].rstrip().endswith("8") and rows["ZeRO-0"].rstrip().endswith("none")
    largest = {}
    for policy in ("none", "selective", "full"):
        code, out, _ = run_cli(capsys, "--recipe", R7B, "--num-gpus", "8", "--sweep", "--json",
                               "--activation-checkpointing", policy)
        largest[policy] = json.loads(out)["largest_mbs"]["ZeRO-3"]
    assert largest["none"] < largest["selective"] < largest["full"] and largest["full"] >= 8, largest


def test_cli_model_config_and_accelerate_config(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
                                  "vocab_size": 50257, "n_positions": 1024}))
    code, out, err = run_cli(capsys, "--model-config", str(tmp_path), "--seq-len", "1024", "--micro-batch-size", "8",
                             "--gpu", "a100-40gb", "--json")
    assert code == 0, err
    assert json.loads(out)["num_params"] == 124_439_808
    code, out, err = run_cli(capsys, "--recipe", R7B, "--accelerate-config", str(CONFIGS / "zero3.yaml"), "--json")
    assert code == 0, err
    layout = json.loads(out)["layout"]
    assert (layout["zero_stage"], layout["world_size"]) == (3, 8)


def test_cli_fsdp_from_the_shipped_accelerate_config(capsys):
    code, out, err = run_cli(capsys, "--recipe", R7B, "--accelerate-config", str(CONFIGS / "fsdp.yaml"), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert (data["layout"]["engine"], data["layout"]["fsdp_sharding"], data["layout"]["world_size"]) == (
        "fsdp", "FULL_SHARD", 8)
    assert data["fits"] is True
    code, out, _ = run_cli(capsys, "--recipe", R7B, "--num-gpus", "8", "--fsdp", "SHARD_GRAD_OP", "--json")
    assert json.loads(out)["per_device"]["total_gib"] > data["per_device"]["total_gib"]
    code, out, _ = run_cli(capsys, "--recipe", R7B, "--accelerate-config", str(CONFIGS / "fsdp.yaml"), "--explain")
    assert code == 0 and "FSDP FULL_SHARD on 8 GPUs" in out and "4 B x Ψ/N" in out and "prefetched" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu", "H100-800GB"], "known GPUs: T4-16GB, V100-16GB"),
        (["--zero", "2", "--offload-params"], "parameter offload needs ZeRO-3"),
        (["--zero", "0", "--offload-optimizer"], "optimizer offload needs ZeRO-1, 2 or 3"),
        (["--zero", "2", "--offload-optimizer", "nvme"], "NVMe offload needs ZeRO-3"),
        (["--offload-optimizer"], "need DeepSpeed"),
        (["--zero", "3", "--micro-batch-size", "3"], "valid for GBS 1024"),
        (["--fsdp", "--offload-optimizer"], "FSDP has no separate optimizer offload"),
        (["--fsdp", "--offload-params", "nvme"], "FSDP offloads parameters to the CPU only"),
        (["--fsdp", "--zero", "3"], "give one of --zero, --fsdp or --accelerate-config"),
        (["--zero", "3", "--ds", "bucket=1"], "KEY one of"),
        (["--zero", "3", "model.arch=t5"], "formulas for llama"),
    ],
)
def test_cli_bad_input_exits_2_without_traceback(capsys, argv, message):
    code, out, err = run_cli(capsys, "--recipe", R7B, "--num-gpus", "8", *argv)
    assert code == EXIT_USAGE
    assert message in err and "Traceback" not in err, err


def test_cli_bad_sources(capsys, tmp_path):
    assert run_cli(capsys, "--num-gpus", "8")[0] == EXIT_USAGE
    code, _, err = run_cli(capsys, "--model-config", str(tmp_path / "nope.json"), "--seq-len", "8")
    assert code == EXIT_USAGE and "no such file" in err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    code, _, err = run_cli(capsys, "--model-config", str(tmp_path))
    assert code == EXIT_USAGE and "--seq-len" in err
    code, _, err = run_cli(capsys, "--model-config", str(tmp_path), "--seq-len", "8")
    assert code == EXIT_USAGE and "missing num_attention_heads" in err
    code, _, err = run_cli(capsys, "--recipe", str(tmp_path / "missing.yaml"))
    assert code == EXIT_USAGE and "recipe file not found" in err


def test_cli_script_entry_point_runs_and_fails_cleanly():
    script = "pretrain.cli.estimate"
    ok = subprocess.run([sys.executable, "-m", script, "--recipe", R7B, "--num-gpus", "8", "--zero", "3", "--json"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and json.loads(ok.stdout)["num_params"] == LLAMA2_7B
    bad = subprocess.run([sys.executable, "-m", script, "--recipe", R7B, "--gpu", "B9000"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == EXIT_USAGE and "unknown GPU 'B9000'" in bad.stderr and "Traceback" not in bad.stderr


# --------------------------------------------------------------------------------------------------
# pretrain-plan


def test_plan_7b_on_8_h100(capsys, tmp_path):
    out_file = tmp_path / "plan.yaml"
    code = plan.main(["--recipe", R7B, "--nodes", "1", "--gpus-per-node", "8", "--gpu", "H100-80GB",
                      "--output", str(out_file)])
    out = capsys.readouterr().out
    assert code == 0
    config = yaml.safe_load(out_file.read_text())
    assert config["num_processes"] == 8 and config["mixed_precision"] == "no"
    ranked = [line for line in out.splitlines() if re.match(r"\s*\d+\. ", line)]
    assert len(ranked) == 10 and "tok/s/GPU" in ranked[0]
    assert f"accelerate launch --config_file {out_file} pretrain/run.py --recipe {R7B}" in out
    first = ranked[0].split(":")[0]  # e.g. "  1. ZeRO-3, MBS 2, GAS 64, no recompute"
    assert "offload" not in first  # no offload is needed on 80 GB
    # The written config is the first-ranked layout, single node.
    if "FSDP" in first:
        assert config["distributed_type"] == "FSDP" and config["fsdp_config"]["fsdp_version"] == 2
        assert config["fsdp_config"]["fsdp_reshard_after_forward"] == ("FULL_SHARD" in first)
    else:
        stage = int(re.search(r"ZeRO-(\d)", first).group(1))
        assert config["distributed_type"] == "DEEPSPEED" and config["deepspeed_config"]["zero_stage"] == stage
        assert "deepspeed_multinode_launcher" not in config["deepspeed_config"]
    mbs = int(re.search(r"MBS (\d+)", first).group(1))
    assert mbs == load_recipe(R7B).batch.micro_batch_size or f"batch.micro_batch_size={mbs}" in out


def test_plan_output_naming_a_directory_writes_the_config_in_it(capsys, tmp_path):
    """Issue 36: --output naming a directory was an IsADirectoryError traceback; the config now goes in it under
    its default name, and a place that cannot be written is one line, exit 2."""
    args = ["--recipe", R7B, "--nodes", "1", "--gpus-per-node", "8", "--gpu", "H100-80GB"]
    assert plan.main([*args, "--output", str(tmp_path)]) == 0
    written = tmp_path / "7b-1x8-H100-80GB.yaml"
    assert yaml.safe_load(written.read_text())["num_processes"] == 8
    assert f"--config_file {written}" in capsys.readouterr().out
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert plan.main([*args, "--output", str(blocked / "plan.yaml")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "cannot write the accelerate config" in err and "Traceback" not in err


def test_plan_7b_on_2x8_a100_40gb(capsys, tmp_path):
    out_file = tmp_path / "plan.yaml"
    code = plan.main(["--recipe", R7B, "--nodes", "2", "--gpus-per-node", "8", "--gpu", "A100-40GB",
                      "--output", str(out_file), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    config = yaml.safe_load(out_file.read_text())
    assert config["num_machines"] == 2 and config["num_processes"] == 16
    if config["distributed_type"] == "DEEPSPEED":
        assert config["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
    else:  # FSDP FULL_SHARD ranks first here: it overlaps half its traffic, ZeRO-2 none of it
        assert config["distributed_type"] == "FSDP" and data["ranking"][0]["engine"] == "fsdp"
    assert '--machine_rank "$NODE_RANK"' in data["launch"]
    assert all(r["total_gib"] <= 40.0 for r in data["ranking"])
    offloads = [r["offload_optimizer"] != "none" for r in data["ranking"] if not r["tight"]]
    assert offloads == sorted(offloads)  # offload only after every layout without it


def test_plan_considers_fsdp_and_writes_a_valid_fsdp_config(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    ranked, _ = planner.plan(load_recipe(R7B), 2, 8, memory.find_gpu("H100-80GB"))
    shipped = yaml.safe_load((CONFIGS / "fsdp.yaml").read_text())
    seen = set()
    for c in ranked:
        if c.layout.engine != "fsdp" or (c.layout.fsdp_sharding, c.layout.offload_params) in seen:
            continue
        seen.add((c.layout.fsdp_sharding, c.layout.offload_params))
        path = tmp_path / f"{c.layout.fsdp_sharding}-{c.layout.offload_params}.yaml"
        path.write_text(planner.accelerate_config(c, R7B))
        written = yaml.safe_load(path.read_text())
        assert written["distributed_type"] == "FSDP" and set(written["fsdp_config"]) == set(shipped["fsdp_config"])
        assert load_config_from_file(str(path)).num_processes == 16
        launch = Launch.from_accelerate_config(path)
        assert (launch.engine, launch.fsdp_sharding, launch.offload_params, launch.num_nodes) == (
            "fsdp", c.layout.fsdp_sharding, c.layout.offload_params, 2)
        assert c.name.startswith(f"FSDP {c.layout.fsdp_sharding}")
    assert {sharding for sharding, _ in seen} == {"FULL_SHARD", "SHARD_GRAD_OP"}


def test_plan_counts_gradient_traffic_in_the_reduction_dtype():
    """The planner's communication volume (bytes per parameter per optimizer step): gradients travel in
    precision.reduce_dtype, parameters in bf16."""
    from pretrain.system.hardware import find_gpu

    gpu = find_gpu("H100-80GB")

    def volume(layout, reduce, gas=16):
        w = memory.Workload(precision="bf16", micro_batch_size=1, seq_len=4096, grad_accum_steps=gas,
                            reduce_dtype=reduce)
        return planner.throughput(memory.estimate_shape(shape_of(R7B), w, layout), gpu)[2]

    zero = {k: Launch("deepspeed", k, gpus_per_node=8) for k in (1, 2, 3)}
    assert (volume(zero[1], "fp32"), volume(zero[1], "bf16")) == (2 * 4 + 2, 2 + 2)  # BF16_Optimizer all-reduces fp32
    assert (volume(zero[2], "fp32"), volume(zero[2], "bf16")) == (16 * 4 + 2, 16 * 2 + 2)  # every micro-step
    assert (volume(zero[3], "fp32"), volume(zero[3], "bf16")) == (16 * 4 + 2 * 16 * 2, 16 * 2 + 2 * 16 * 2)
    fsdp = Launch("fsdp", gpus_per_node=8, fsdp_sharding="FULL_SHARD")
    assert (volume(fsdp, "fp32"), volume(fsdp, "bf16")) == (4 + 2 * 16 * 2, 2 + 2 * 16 * 2)  # no_sync: once
    ddp = Launch("ddp", gpus_per_node=8)
    assert (volume(ddp, "fp32"), volume(ddp, "bf16")) == (2 * 4, 2 * 2)  # the bf16 hook compresses fp32 grads


def test_plan_nothing_fits(capsys):
    code = plan.main(["--recipe", R70B, "--nodes", "1", "--gpus-per-node", "1", "--gpu", "T4-16GB",
                      "--host-memory-gib", "512"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "no layout of 70b fits" in err
    code = plan.main(["--recipe", R7B, "--gpus-per-node", "3"])
    assert code == EXIT_USAGE and "is not divisible by the world size (3 processes); use global_batch_size=1023 or 1026" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma", "olmo", "olmo2", "phi3", "gpt2", "gpt_neox"])
def test_estimated_state_bytes_equal_the_built_models(arch):
    """The estimator's weights and gradients (fp32, one process) are the meta-built model's parameter bytes and
    AdamW's moments twice that: the states of every counted architecture come from its exact count."""
    from pretrain.model.build import build_model

    plain = arch in ("gpt2", "gpt_neox")
    cfg = ModelConfig(arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=None if plain else 2,
                      intermediate_size=96, head_dim=32 if arch in ("llama", "qwen3", "gemma") else None,
                      config_overrides={"pad_token_id": None} if arch == "phi3" else {})
    model = build_model(cfg, 512, 64, seed=0, meta=True)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shape = ModelShape.from_model_config(cfg, 512, 64)
    w = memory.Workload(precision="fp32", micro_batch_size=1, seq_len=64)
    one = memory.estimate_shape(shape, w, Launch())
    assert one.terms["params"].bytes == one.terms["grads"].bytes == param_bytes
    assert one.terms["optimizer"].bytes == 2 * param_bytes  # AdamW's two moments
