"""Expert parallelism (FSDP2 x EP) from the recipe to the run: the refusals before launch, EP 2 on 2 and 4 CPU
processes against one process, the resume on the same layout and without EP, and the export."""

from __future__ import annotations

import json

import pytest

from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.train.preflight import check_layout
from tests.helpers import (
    FAST_MODEL,
    ROOT,
    OneThread,
    accelerate_launch,
    check_ok,
    free_port,
    make_recipe,
    metrics,
    train_here,
    train_losses,
)

CONFIGS = ROOT / "accelerate_configs"
MOE_TINY = str(ROOT / "recipes" / "moe-tiny.yaml")
MOE = ["model.moe={num_experts: 4, experts_per_token: 2, expert_intermediate_size: 64}", "model.arch=olmoe",
       "model.intermediate_size=null"]


def launch(world: int, **fields) -> Launch:
    return Launch(fields.pop("engine", "fsdp"), num_nodes=1, gpus_per_node=world, **fields)


def test_the_shipped_config_with_the_recipe_s_ep_size_is_the_ep_layout():
    recipe = make_recipe(*MOE, "model.moe.ep_size=2")
    shipped = Launch.from_accelerate_config(CONFIGS / "fsdp2_ep.yaml")
    assert shipped.ep_size == 1  # accelerate's parallelism_config has no expert dimension: the recipe says it
    ep = shipped.for_recipe(recipe)
    assert (ep.ep_size, ep.efsdp_size, ep.data_parallel_size) == (2, 4, 8)  # every rank reads its own batches
    assert ep.describe() == "FSDP FULL_SHARD x EP 2 (4 copies of each expert) on 8 GPUs"
    assert check_layout(recipe, shipped).launch.ep_size == 2
    assert check_layout(recipe, shipped).batch.grad_accum_steps == check_layout(make_recipe(*MOE), shipped
                                                                                ).batch.grad_accum_steps


@pytest.mark.parametrize("overrides, layout, message", [
    (["model.moe.ep_size=3"], launch(8), "model.moe.ep_size (3) must divide model.moe.num_experts (4)"),
    (["model.moe={num_experts: 6, experts_per_token: 2, expert_intermediate_size: 64}", "model.moe.ep_size=3"],
     launch(8), "model.moe.ep_size = 3 does not divide the 8 processes"),
    (["model.moe.ep_size=2"], launch(8, engine="deepspeed", zero_stage=3), "model.moe.ep_size = 2 with DeepSpeed ZeRO"),
    (["model.moe.ep_size=2"], launch(2, engine="ddp"), "model.moe.ep_size = 2 needs FSDP2"),
    (["model.moe.ep_size=2"], launch(1, engine="ddp"), "model.moe.ep_size = 2 needs FSDP2"),
    (["model.moe.ep_size=2"], launch(8, tp_size=2), "with tp_size 2 x cp_size 1: pretrain has not verified"),
    (["model.moe.ep_size=2"], launch(8, cp_size=2), "with tp_size 1 x cp_size 2"),
    (["model.moe.ep_size=2"], Launch("fsdp", num_nodes=2, gpus_per_node=4, hybrid_shard_size=4), "with HSDP"),
])
def test_layouts_ep_cannot_run_are_refused_by_name(overrides, layout, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_layout(make_recipe(*MOE, *overrides), layout)


def test_a_dense_arch_cannot_ask_for_ep_and_an_arch_without_an_expert_plan_is_refused():
    with pytest.raises(ConfigError, match="model.moe is set but model.arch = llama is not one of the mixture-of-expert"):
        make_recipe("model.moe={num_experts: 4, experts_per_token: 2, expert_intermediate_size: 64, ep_size: 2}")
    from pretrain.distributed.expert_parallel import ep_plan_problem

    class NoPlan:  # e.g. llama4, whose experts take pre-scaled tokens: transformers gives it no base_model_ep_plan
        base_model_ep_plan = None

    assert "model.arch = llama4 has no expert-parallel plan" in ep_plan_problem(NoPlan, "llama4", 2)
    assert ep_plan_problem(NoPlan, "llama4", 1) is None
    from transformers import CONFIG_MAPPING

    for arch in ("olmoe", "qwen3_moe", "mixtral"):  # the MoE archs pretrain builds all have one
        assert ep_plan_problem(CONFIG_MAPPING[arch], arch, 2) is None


def test_the_dry_run_refuses_an_ep_size_the_launch_cannot_hold_before_any_process(capsys):
    from pretrain.run import main

    code = main(["--dry-run", "--config_file", str(CONFIGS / "fsdp2_ep.yaml"), "--num_processes", "6",
                 "--recipe", str(ROOT / "recipes" / "olmoe-1b-7b.yaml"), "batch.micro_batch_size=1",
                 "model.moe.ep_size=4"])
    err = capsys.readouterr().err
    assert code == 2 and "model.moe.ep_size = 4 does not divide the 6 processes" in err and "Traceback" not in err


# ---- moe-tiny on EP 2: one curve, exact resume, resume without EP, export ----------------------------------------
STEPS = 4
EP_ARGS = [*(a for a in FAST_MODEL if not a.startswith("model.intermediate_size")), "model.moe.num_experts=4",
           "model.moe.expert_intermediate_size=64", "batch.global_batch_size=8", "batch.micro_batch_size=2",
           "lr_schedule.warmup_steps=1", "eval.batches=2", "eval.tasks=[]", "eval.every_steps=100",
           "logging.every_steps=1", "logging.progress=plain", f"train.max_steps={STEPS}", "checkpoint.every_steps=2"]


def ep_launch(processes: int, args: list[str]):
    proc = accelerate_launch("fsdp2_ep.yaml", [*EP_ARGS, *args], recipe=MOE_TINY,
                             extra=["--num_processes", str(processes), "--main_process_port", str(free_port())],
                             extra_env={"OMP_NUM_THREADS": "1"})
    check_ok(proc)
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    """One process (in this process); EP 2 on 2 processes (each rank holds 2 of the 4 experts) and on 4 processes
    (two copies of each expert, FSDP-sharded between them); EP 2's step 2 resumed on EP 2 and on plain FSDP."""
    base = tmp_path_factory.mktemp("ep")
    with OneThread():
        train_here([*EP_ARGS, f"output_dir={base / 'one'}"], recipe=MOE_TINY)
    # only what a test reads is written: ep2's checkpoints and final model; the others' losses
    losses_only = ["checkpoint.save_final_model=false", "checkpoint.save_last=false", "checkpoint.every_steps=0",
                   "eval.at_start=false"]
    logs = {"ep2": ep_launch(2, ["model.moe.ep_size=2", f"output_dir={base / 'ep2'}"]),
            "ep2x2": ep_launch(4, ["model.moe.ep_size=2", f"output_dir={base / 'ep2x2'}", *losses_only])}
    step2 = base / "ep2" / "checkpoints" / "step_00000002"
    for name, ep_size in (("resumed", 2), ("no_ep", 1)):
        logs[name] = ep_launch(2, [f"model.moe.ep_size={ep_size}", f"checkpoint.resume={step2}",
                                   f"output_dir={base / name}", *losses_only])
    return base, logs


@pytest.mark.slow
def test_ep2_trains_the_one_process_curve_on_2_and_4_processes(ep_runs):
    """Routing, top-k and the load-balancing loss are the model's own on each rank's tokens, so EP changes where the
    experts run and nothing else: within 1e-5 of one process at every step (measured: at most 1.1e-7 relative, at
    step 2, on 2 and on 4 processes)."""
    base, logs = ep_runs
    assert "world size 2 (FSDP x EP 2, cpu:0" in logs["ep2"] and "world size 4 (FSDP x EP 2, cpu:0" in logs["ep2x2"]
    assert "rank 0 holds experts 0-1 of every MoE layer" in logs["ep2"]
    assert "2 copies of each expert" in logs["ep2x2"]
    assert "Warning" not in logs["ep2"] and "sequential all_" not in logs["ep2"]  # the expert mesh's notes dropped
    one = train_losses(base / "one")
    assert sorted(one) == list(range(1, STEPS + 1))
    router = ["train/router_aux_loss", "moe/load_max_share/layer_0", "moe/load_cv/layer_1"]
    one_router = [m[k] for m in metrics(base / "one") if "train/loss" in m for k in router]
    one_config = json.loads((base / "one" / "run_config.json").read_text())
    for name in ("ep2", "ep2x2"):
        ep = train_losses(base / name)
        assert sorted(ep) == sorted(one)
        for step in one:
            assert ep[step] == pytest.approx(one[step], rel=1e-5), (name, step, ep[step], one[step])
        # the router's loss and the experts' load, logged as without EP; the active parameters (MFU's N) the same
        ep_router = [m[k] for m in metrics(base / name) if "train/loss" in m for k in router]
        assert ep_router == pytest.approx(one_router, rel=1e-5), name
        config = json.loads((base / name / "run_config.json").read_text())
        assert (config["model/num_params"], config["model/num_active_params"]) == (
            one_config["model/num_params"], one_config["model/num_active_params"])


@pytest.mark.slow
def test_ep_resume_on_the_same_layout_is_exact_and_without_ep_continues_the_curve(ep_runs):
    base, logs = ep_runs
    ep2, resumed, no_ep = (train_losses(base / name) for name in ("ep2", "resumed", "no_ep"))
    assert sorted(resumed) == sorted(no_ep) == [3, 4]
    assert [resumed[s] for s in (3, 4)] == [ep2[s] for s in (3, 4)]
    # the DCP shards of the expert DTensors read back onto the other layout: no conversion, the same weights
    assert "was written by FSDP x EP 2 on 2 processes; loading it with FSDP on 2 processes" in logs["no_ep"]
    for step in (3, 4):
        assert no_ep[step] == pytest.approx(ep2[step], rel=1e-5), (step, no_ep[step], ep2[step])


@pytest.mark.slow
def test_export_of_an_ep_checkpoint_is_the_plain_model_with_the_run_s_logits(ep_runs, tmp_path):
    """pretrain-export of EP 2's last checkpoint gives the plain transformers model (whole experts, plain tensors,
    the names of a model trained without EP) with the logits of the run's own final_model."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from pretrain.cli import export

    base, _ = ep_runs
    assert export.main([str(base / "ep2" / "checkpoints" / f"step_{STEPS:08d}"), str(tmp_path / "exported")]) == 0
    models = [AutoModelForCausalLM.from_pretrained(d) for d in
              (tmp_path / "exported", base / "ep2" / "final_model", base / "one" / "final_model")]
    ids = torch.randint(0, models[0].config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exported, final, one = (m(input_ids=ids).logits for m in models)
    assert torch.equal(exported, final)
    torch.testing.assert_close(final, one, rtol=1e-4, atol=1e-4)
    with safe_open(tmp_path / "exported" / "model.safetensors", "pt") as ours, \
            safe_open(base / "one" / "final_model" / "model.safetensors", "pt") as plain:
        assert sorted(ours.keys()) == sorted(plain.keys())
        # every expert, in the hub's per-expert layout (transformers' conversion mapping, reversed on save)
        assert {f"model.layers.1.mlp.experts.{e}.up_proj.weight" for e in range(4)} <= set(ours.keys())
    for model in models:
        assert all(type(p) is torch.nn.Parameter for p in model.parameters())
