"""Expert parallelism (model.moe.ep_size, FSDP2 x EP) in the memory estimator and the planner: the per-rank figures
against plain FSDP's by hand, the all-to-all buffers and volume, which layouts the planner weighs, what it picks and
how it explains the pick. The per-rank bytes against what EP ranks really hold: test_memory_validation.py
(test_ep_model_states_match_estimate)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pretrain.cli import estimate as estimate_memory
from pretrain.cli import plan as plan_cli
from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.plan import memory, planner
from pretrain.recipe.config import load_recipe
from pretrain.recipe.shape import ModelShape

ROOT = Path(__file__).resolve().parents[2]
OLMOE = str(ROOT / "recipes" / "olmoe-1b-7b.yaml")
QWEN3_30B = str(ROOT / "recipes" / "qwen3-30b-a3b.yaml")
R7B = str(ROOT / "recipes" / "7b.yaml")
H100 = memory.find_gpu("H100-80GB")


def fsdp(world: int = 8, ep: int = 1, nodes: int = 1) -> Launch:
    return Launch("fsdp", num_nodes=nodes, gpus_per_node=world // nodes, fsdp_sharding="FULL_SHARD", ep_size=ep)


# ---- the estimator --------------------------------------------------------------------------------


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_ep_keeps_each_rank_s_shards_and_shrinks_what_it_unshards_by_the_expert_fraction(ep):
    """olmoe-1b-7b on 8 GPUs, bf16, GAS 16 under no_sync: the parameter, gradient and optimizer shards are plain
    FSDP's (Ψ/N either way); the unsharded block (gathered in forward and backward) and the unsharded gradients lose
    (1 - 1/EP) of the experts; the all-to-all's send and receive buffers appear."""
    shape = ModelShape.from_recipe(load_recipe(OLMOE))
    w = memory.Workload(precision="bf16", micro_batch_size=2, seq_len=4096, grad_accum_steps=16)
    plain, est = (memory.estimate_shape(shape, w, fsdp(8, size), gpu=H100) for size in (1, ep))
    copies = f" ({8 // ep} copies of each expert)" if ep < 8 else ""  # EP 8: each expert once, on one GPU
    assert est.layout.describe() == f"FSDP FULL_SHARD x EP {ep}{copies} on 8 GPUs"
    assert f"layout     {est.layout.describe()}" in est.summary()
    for key in ("params", "optimizer"):
        assert est.terms[key].bytes == plain.terms[key].bytes
    assert est.terms["grads"].at("step") == plain.terms["grads"].at("step") == 4 * -(-shape.num_params // 8)

    L, E, d, f = shape.num_layers, shape.num_experts, shape.hidden_size, shape.intermediate_size
    experts = E * 3 * d * f  # one block's experts
    fraction = experts / shape.block_params
    block_ep = shape.block_params * (1 - fraction * (1 - 1 / ep))
    assert block_ep == pytest.approx(shape.block_params - experts + experts / ep)
    # no_sync's unsharded fp32 gradients: Ψ_EP = Ψ - L x (1 - 1/EP) x E x 3df instead of Ψ
    psi_ep = shape.num_params - L * (experts - experts // ep)
    assert plain.terms["grads"].at("backward") == 4 * shape.num_params
    assert est.terms["grads"].at("backward") == 4 * psi_ep
    # the gathered units: the LM head's group kept + 2 blocks (the running one and the prefetched next), bf16; and one
    # unit's unsharded gradient (bf16, with its fp32 copy for the fp32 reduce-scatter)
    kept = shape.vocab_size * d + d  # LM head and final norm (the embedding is its own unit)
    unit_plain, unit_ep = max(shape.block_params, kept), max(round(block_ep), kept)
    assert plain.terms["comm"].bytes == 2 * (kept + 2 * shape.block_params) + 6 * unit_plain
    assert est.terms["comm"].bytes == 2 * (kept + 2 * round(block_ep)) + 6 * unit_ep
    # the all-to-all in flight: send and receive, T x top-k x d x 2 B each; none without EP
    T, k = 2 * 4096, shape.experts_per_token
    assert "all_to_all" not in plain.terms
    assert est.terms["all_to_all"].bytes == 2 * T * k * d * 2 and est.terms["all_to_all"].at("step") == 0
    assert "EP all-to-all buffers" in est.summary() and "Ψ_EP = " in est.explain()
    assert est.total_bytes < plain.total_bytes


def test_the_recipe_s_ep_size_is_the_estimate_s_and_pretrain_estimate_says_it(capsys):
    """pretrain-estimate --ep N is the recipe override model.moe.ep_size=N; memory.estimate takes the recipe's EP
    onto the launch (Launch.for_recipe), as the run does."""
    args = ["--recipe", OLMOE, "--num-gpus", "8", "--fsdp", "--micro-batch-size", "2", "--json"]
    answers = []
    for extra in (["--ep", "4"], ["model.moe.ep_size=4"], []):
        assert estimate_memory.main([*args, *extra]) == 0
        answers.append(json.loads(capsys.readouterr().out))
    assert answers[0] == answers[1] != answers[2]
    assert answers[0]["layout"]["ep_size"] == 4 and answers[2]["layout"]["ep_size"] == 1
    assert answers[0]["layout"]["description"] == "FSDP FULL_SHARD x EP 4 (2 copies of each expert) on 8 GPUs"
    assert answers[0]["other_gib_detail"]["all_to_all"] > 0 and "all_to_all" not in answers[2]["other_gib_detail"]
    recipe = load_recipe(OLMOE, ["model.moe.ep_size=4", "batch.micro_batch_size=2"])
    from pretrain.recipe.batching import plan_batches

    est = memory.estimate(recipe, plan_batches(recipe.batch, 8, recipe.data.seq_len), fsdp(8), gpu=H100)
    assert est.layout.ep_size == 4 and round(est.total_gib, 4) == answers[0]["per_device"]["total_gib"]


@pytest.mark.parametrize("argv, message", [
    (["--recipe", OLMOE, "--num-gpus", "8", "--ep", "8"], "model.moe.ep_size = 8 needs FSDP2"),
    (["--recipe", OLMOE, "--num-gpus", "8", "--fsdp", "--ep", "3"], "must divide model.moe.num_experts (64)"),
    (["--recipe", OLMOE, "--num-gpus", "8", "--fsdp", "--ep", "8", "--sweep"], "--sweep compares DDP, ZeRO and FSDP"),
    (["--model-config", str(ROOT / "tests" / "assets" / "qwen3-1.7b"), "--seq-len", "512", "--num-gpus", "8",
      "--fsdp", "--ep", "2"], "needs a mixture of experts; model.arch = qwen3 here is dense"),
])
def test_ep_the_estimator_cannot_size_is_refused_with_the_fix(capsys, argv, message):
    assert estimate_memory.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_expert_parallel_refuses_a_dense_shape_and_experts_that_do_not_divide():
    dense = ModelShape.from_recipe(load_recipe(R7B))
    olmoe = ModelShape.from_recipe(load_recipe(OLMOE))
    assert memory.parallel.expert_parallel(dense, 1) is None
    with pytest.raises(ConfigError, match="needs a mixture of experts"):
        memory.parallel.expert_parallel(dense, 2)
    with pytest.raises(ConfigError, match=r"model.moe.ep_size \(3\) must divide model.moe.num_experts \(64\)"):
        memory.parallel.expert_parallel(olmoe, 3)
    assert memory.parallel.expert_parallel(olmoe, 64).local_experts == 1


# ---- the planner ----------------------------------------------------------------------------------


def test_ep_layouts_are_every_size_dividing_the_experts_and_the_world_and_none_for_a_dense_model():
    def sizes(nodes, gpus, experts):
        return sorted(lay.ep_size for lay in planner.layouts(nodes, gpus, experts) if lay.ep_size > 1)

    assert sizes(1, 8, 0) == [] and sizes(2, 8, 0) == []
    assert sizes(1, 8, 64) == [2, 4, 8]
    assert sizes(2, 8, 128) == [2, 4, 8, 16]
    assert sizes(1, 6, 64) == [2]  # 3 and 6 divide the world, not the experts
    assert sizes(1, 8, 6) == [2]  # 3 and 6 divide the experts, not the world
    assert all(lay.engine == "fsdp" and lay.fsdp_sharding == "FULL_SHARD" for lay in planner.layouts(1, 8, 64)
               if lay.ep_size > 1)


def test_the_planner_never_offers_ep_for_a_dense_recipe():
    ranked, _ = planner.plan(load_recipe(R7B), 1, 8, H100)
    assert ranked and all(c.layout.ep_size == 1 for c in ranked)
    lines = planner.explain_choice(ranked)
    assert not any("EP" in line or "expert parallelism" in line for line in lines), lines


def test_the_planner_weighs_ep_for_olmoe_on_8_h100_and_says_why_it_loses():
    """olmoe-1b-7b on 1 x 8 H100 (GBS 1024 x 4096): every EP size is weighed; at MBS 8 a micro-batch's all-to-alls
    (T k d b = 1 GiB each, 64 of them: selective keeps their outputs, full would send them again) cost more than the
    expert gathers EP saves, so FSDP FULL_SHARD stays the pick and the explanation gives both in seconds."""
    recipe = load_recipe(OLMOE)
    ranked, _ = planner.plan(recipe, 1, 8, H100)
    assert {c.layout.ep_size for c in ranked} == {1, 2, 4, 8}
    best = ranked[0]
    assert best.layout.ep_size == 1 and best.name == "FSDP FULL_SHARD"
    ep = next(c for c in ranked if c.layout.ep_size > 1)
    assert ep.tokens_per_s < best.tokens_per_s
    # the all-to-all seconds by hand: GAS x (4 L + 2 L if full recomputes them) x (EP-1)/EP x T k d b over NVLink
    shape, w = ep.estimate.shape, ep.estimate.workload
    T, size = w.micro_batch_size * w.seq_len, ep.layout.ep_size
    count = 4 * shape.num_layers + (2 * shape.num_layers if ep.checkpointing == "full" else 0)
    expected = w.grad_accum_steps * count * (size - 1) / size * T * 8 * 2048 * 2 / (H100.intra_node_gb_s * 1e9)
    assert ep.ep_comm_s == pytest.approx(expected)
    lines = planner.explain_choice(ranked)
    assert any(line.startswith("  FSDP x EP ") and f"EP all-to-alls {ep.ep_comm_s:.1f} s" in line for line in lines)
    head = next(i for i, line in enumerate(lines) if line.startswith("expert parallelism "))
    assert lines[head].startswith(f"expert parallelism loses: {ep.name}, MBS {ep.micro_batch_size}")
    assert f"for {best.name}, MBS {best.micro_batch_size}, the best without EP" in lines[head]
    assert f"EP all-to-alls {ep.ep_comm_s:.2f} s" in lines[head + 1]
    assert f"communication {best.comm_s:.2f} s" in lines[head + 1]
    assert re.search(rf"EP {size}'s all-to-alls inside a node \(NVLink\): {count} per micro-batch", lines[head + 2])
    # EP's expert traffic: only its E/EP experts, among their world/EP copies: less than plain FSDP's at the same MBS
    same = next(c for c in ranked if c.layout.ep_size == 1 and c.micro_batch_size == ep.micro_batch_size
                and c.checkpointing == ep.checkpointing and c.sync_each_micro_batch == ep.sync_each_micro_batch)
    assert ep.comm_s - ep.ep_comm_s < same.comm_s
    # the recipe asking for EP gets a plan that turns it off, said as an override
    asked = load_recipe(OLMOE, ["model.moe.ep_size=8"])
    assert "model.moe.ep_size=1" in planner.recipe_overrides(asked, planner.plan(asked, 1, 8, H100)[0][0])


def test_the_planner_picks_ep_8_for_qwen3_30b_a3b_on_2x8_h100_and_launches_it_with_the_ep_config(capsys, tmp_path):
    """recipes/qwen3-30b-a3b.yaml on 2 x 8 H100: plain FSDP gathers the 28.9B expert weights across the nodes every
    micro-step; EP 8 keeps each node's all-to-alls on NVLink and moves only each GPU's 16 experts between its 2
    copies. The pick is FSDP x EP 8, launched with accelerate_configs/fsdp2_ep.yaml and model.moe.ep_size=8; EP 16
    (all-to-alls across the nodes) ranks below it."""
    out_file = tmp_path / "plan.yaml"
    assert plan_cli.main(["--recipe", QWEN3_30B, "--nodes", "2", "--gpus-per-node", "8", "--gpu", "H100-80GB",
                          "--output", str(out_file), "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    best = answer["ranking"][0]
    assert best["layout"].startswith("FSDP FULL_SHARD x EP 8") and best["ep_size"] == 8
    assert answer["launch"].startswith(
        "accelerate launch --config_file accelerate_configs/fsdp2_ep.yaml --num_machines 2 --num_processes 16 ")
    assert "model.moe.ep_size=8" in answer["launch"].split()
    assert answer["explanation"][0].startswith("chose FSDP FULL_SHARD x EP 8")
    assert any(line.startswith("expert parallelism wins: FSDP FULL_SHARD x EP 8") for line in answer["explanation"])
    config = yaml.safe_load(out_file.read_text())
    assert config["distributed_type"] == "FSDP" and config["num_processes"] == 16
    assert config["fsdp_config"]["fsdp_reshard_after_forward"] is True and "parallelism_config" not in config
    assert "model.moe.ep_size=8" in out_file.read_text()  # the written config's comment says where EP comes from
    ranked, _ = planner.plan(load_recipe(QWEN3_30B), 2, 8, H100)
    rate = {}
    for c in ranked:
        rate.setdefault(c.layout.ep_size, c.tokens_per_s)
    assert rate[8] > rate[16] and rate[8] > rate[1]
    ep16 = next(c for c in ranked if c.layout.ep_size == 16)
    across = replace(ep16.estimate.layout, gpus_per_node=16, num_nodes=1)  # the same all-to-alls on NVLink
    assert planner.expert_parallel_comm(ep16.estimate, H100) == pytest.approx(
        planner.expert_parallel_comm(replace(ep16.estimate, layout=across), H100) * H100.intra_node_gb_s
        / H100.inter_node_gb_s)
