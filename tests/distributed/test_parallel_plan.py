"""Tensor parallelism, context parallelism and float8 in the estimator, the planner, pretrain-estimate and --dry-run:
arithmetic and refusals, no launches. The TP terms are measured against a real TP run in
test_memory_validation.py::test_tp_model_states_match_estimate."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from pretrain import run
from pretrain.cli import estimate as estimate_cli
from pretrain.distributed.layout import Launch
from pretrain.errors import EXIT_USAGE, ConfigError
from pretrain.plan import memory, planner
from pretrain.plan.memory import parallel
from pretrain.recipe.config import load_recipe
from pretrain.recipe.shape import ModelShape
from tests.helpers import ROOT

R7B = str(ROOT / "recipes" / "7b.yaml")
R70B = str(ROOT / "recipes" / "70b.yaml")
TP2 = str(ROOT / "accelerate_configs" / "fsdp2_tp2.yaml")


def shape_of(path: str) -> ModelShape:
    return ModelShape.from_recipe(load_recipe(path))


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = estimate_cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


# ---- float8 ------------------------------------------------------------------------------------------


def test_float8_term_counts_the_largest_linear_s_transient_casts():
    """torchao keeps the bf16 input and weight for backward: only the running Linear's float8 copies exist, two
    weight-sized and two activation-sized at 1 B, plus the scales; TP divides the weight and the split widths."""
    shape = shape_of(R7B)  # d 4096, f 11008: the largest block Linear is gate/up/down, d x f
    d, f, tokens = 4096, 11008, 2 * 4096
    assert parallel.float8_term("off", shape, tokens, None) is None
    tensorwise = parallel.float8_term("tensorwise", shape, tokens, None)
    assert tensorwise.bytes == 2 * d * f + 2 * tokens * f + 4 * 4
    rowwise = parallel.float8_term("rowwise", shape, tokens, None)
    assert rowwise.bytes == 2 * d * f + 2 * tokens * f + 4 * 2 * (f + tokens)  # one fp32 scale per row
    tp = parallel.tensor_parallel(shape, 2)
    split = parallel.float8_term("tensorwise", shape, tokens, tp)
    assert split.bytes == 2 * d * f // 2 + 2 * tokens * (f // 2) + 4 * 4
    # in the estimate: alive in forward and backward, not at the optimizer step
    workload = memory.Workload(precision="bf16", micro_batch_size=2, seq_len=4096, grad_accum_steps=8,
                               float8="tensorwise")
    est = memory.estimate_shape(shape, workload, Launch("fsdp", gpus_per_node=8, fsdp_sharding="FULL_SHARD"))
    assert est.terms["float8"].bytes == tensorwise.bytes
    assert est.terms["float8"].at("backward") == tensorwise.bytes and est.terms["float8"].at("step") == 0


# ---- context parallelism -----------------------------------------------------------------------------


def test_context_parallel_refusals_name_each_problem_and_its_fix():
    parallel.check_context_parallel(8192, 4, "sdpa", False)  # runs
    parallel.check_context_parallel(4097, 1, "eager", True)  # cp 1: nothing to check
    with pytest.raises(ConfigError) as exc:
        parallel.check_context_parallel(4100, 4, "eager", True)
    text = str(exc.value)
    assert text.startswith("3 problems:")
    assert "data.seq_len 4100 is not divisible by 2 x cp_size = 8" in text and "use a multiple of 8 (4096, 4104)" in text
    assert "model.attention = eager" in text and "set model.attention=sdpa" in text
    assert "data.document_masking = true cannot run context parallel" in text and "data.document_masking=false" in text
    # the estimator refuses the same, before any arithmetic
    workload = memory.Workload(precision="bf16", micro_batch_size=1, seq_len=8192, grad_accum_steps=4,
                               document_masking=True)
    with pytest.raises(ConfigError, match="document_masking"):
        memory.estimate_shape(shape_of(R7B), workload, Launch("fsdp", gpus_per_node=8, fsdp_sharding="FULL_SHARD",
                                                              cp_size=2))


def test_tp_groups_never_span_nodes():
    with pytest.raises(ConfigError, match=r"tp_size 4 does not divide the 6 GPUs per node, so TP groups would span "
                                          r"nodes .* use a tp_size that divides the GPUs per node"):
        Launch("fsdp", num_nodes=2, gpus_per_node=6, fsdp_sharding="FULL_SHARD", tp_size=4)
    with pytest.raises(ConfigError, match="needs FSDP2"):
        Launch("deepspeed", 3, gpus_per_node=8, tp_size=2)
    assert Launch("fsdp", num_nodes=2, gpus_per_node=8, fsdp_sharding="FULL_SHARD", tp_size=8).data_parallel_size == 2


# ---- pretrain-estimate --tp / --cp ----------------------------------------------------------------------


def test_estimate_tp_option_equals_the_shipped_tp_config(capsys):
    """--fsdp --tp 2 on 8 GPUs is accelerate_configs/fsdp2_tp2.yaml's layout: the same figures, the TP formulas in
    --explain, and the batch plan over the 4 data-parallel ranks (TP ranks share their micro-batches)."""
    code, from_config, err = cli(capsys, "--recipe", R7B, "--accelerate-config", TP2, "--json")
    assert code == 0, err
    code, from_options, err = cli(capsys, "--recipe", R7B, "--num-gpus", "8", "--fsdp", "--tp", "2", "--json")
    assert code == 0, err
    assert from_options == from_config
    code, out, _ = cli(capsys, "--recipe", R7B, "--num-gpus", "8", "--fsdp", "--tp", "2", "--explain",
                       "batch.micro_batch_size=1")
    assert code == 0
    assert "Ψ_TP = (32 x " in out and "split by the TP plan: " in out and "x TP 2" in out
    assert "MBS 1 x seq 4,096, GAS 256" in out  # GBS 1024 = MBS 1 x GAS 256 x 4 data-parallel ranks
    code, out, _ = cli(capsys, "--recipe", R7B, "--num-gpus", "8", "--fsdp", "--tp", "2", "--cp", "2",
                       "data.seq_len=8192", "--explain")
    assert code == 0 and "x CP 2" in out


@pytest.mark.parametrize("argv, message", [
    (["--num-gpus", "8", "--zero", "3", "--tp", "2"], "--tp / --cp compose with FSDP2 only"),
    (["--nodes", "2", "--gpus-per-node", "6", "--fsdp", "--tp", "4"], "would span nodes"),
    (["--num-gpus", "8", "--fsdp", "--cp", "2", "data.document_masking=true"], "data.document_masking = true cannot run"),
    (["--num-gpus", "8", "--fsdp", "--tp", "2", "--sweep"], "--sweep compares DDP, ZeRO and FSDP without"),
])
def test_estimate_tp_cp_refusals_exit_2_with_one_message(capsys, argv, message):
    code, out, err = cli(capsys, "--recipe", R7B, *argv)
    assert code == EXIT_USAGE and message in err and not out


# ---- --dry-run -----------------------------------------------------------------------------------------


def test_dry_run_of_a_tp_config_prints_the_tp_terms(capsys):
    """--dry-run on fsdp2_tp2.yaml: the TP layout, the batch plan over its 4 data-parallel ranks, pretrain-estimate's
    figure for the same config, and TP's all-reduces in the speed."""
    code = run.main(["--recipe", R7B, "--dry-run", "--config_file", TP2, "--gpu", "H100-80GB",
                     "batch.micro_batch_size=1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Traceback" not in err
    assert "layout           FSDP FULL_SHARD x TP 2 (4-way data parallel) on 8 GPUs" in out
    assert "batch plan       world 4: GBS 1024 = MBS 1 x GAS 256 x world 4" in out
    assert "verdict    fits:" in out
    # the speed is the planner's for this very layout, batch and recompute: TP's all-reduces included
    speed = re.search(r"^speed +~([\d,]+) tokens/s per GPU", out, re.MULTILINE).group(1)
    recipe = load_recipe(R7B)
    ranked, _ = planner.plan(recipe, 1, 8, memory.find_gpu("H100-80GB"))
    [same] = [c for c in ranked if (c.layout.tp_size, c.layout.cp_size, c.layout.hybrid_shard_size) == (2, 1, None)
              and c.layout.fsdp_sharding == "FULL_SHARD" and c.micro_batch_size == 1 and not c.sync_each_micro_batch
              and c.checkpointing == recipe.model.activation_checkpointing]
    assert f"{same.tokens_per_s:,.0f}" == speed and same.tp_comm_s > 0
    assert estimate_cli.main(["--recipe", R7B, "--accelerate-config", TP2, "--gpu", "H100-80GB",
                              "batch.micro_batch_size=1"]) == 0
    total = re.search(r"total \(peak\)\s+([\d.]+)", capsys.readouterr().out).group(1)
    assert re.search(rf"total \(peak\)\s+{re.escape(total)}\b", out)


# ---- the TP plan, read once ----------------------------------------------------------------------------


def test_tp_plan_is_read_from_a_model_once_then_from_the_cache(tmp_path, monkeypatch):
    """The plan transformers applies (the config's block plan, the vocab-parallel embedding, the LM head), read from
    a meta model once per transformers version and kept under the cache root: a fresh interpreter then sizes TP
    without importing torch or transformers. A damaged file is read again and replaced."""
    monkeypatch.setenv("PRETRAIN_CACHE_DIR", str(tmp_path))
    parallel.tp_plan.cache_clear()
    try:
        plan, base = parallel.tp_plan("llama")
        assert (plan, base) == parallel.read_tp_plan("llama")
        assert plan["embed_tokens"] == "embedding_rowwise" and plan["lm_head"] == "colwise_gather_output"
        assert base["layers.*.mlp.down_proj"] == plan["layers.*.mlp.down_proj"] == "rowwise"
        (path,) = (tmp_path / parallel.TP_PLAN_CACHE).glob("transformers-*/llama.json")
        assert json.loads(path.read_text()) == {"tp_plan": plan, "base_model_tp_plan": base}
        code = ("import sys, time; t = time.perf_counter(); from pretrain.cli.estimate import main; "
                f"rc = main(['--recipe', {R70B!r}, '--nodes', '4', '--gpus-per-node', '8', '--fsdp', '--tp', '8', "
                "'--json']); print('SECONDS', time.perf_counter() - t); "
                "print('HEAVY', [m for m in ('torch', 'transformers') if m in sys.modules]); sys.exit(rc)")
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env={**os.environ})
        assert proc.returncode == 0, proc.stderr
        # what made it slow (seconds of imports) is gone; the wall time is left to the untimed 70B test's kind
        assert "HEAVY []" in proc.stdout, proc.stdout[-300:]
        assert json.loads(proc.stdout.split("SECONDS")[0])["layout"]["tp_size"] == 8
        path.write_text("{")
        parallel.tp_plan.cache_clear()
        assert parallel.tp_plan("llama") == (plan, base)
        assert json.loads(path.read_text())["tp_plan"] == plan
    finally:
        parallel.tp_plan.cache_clear()


# ---- the planner ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len, chosen, families", [
    # 8192: ZeRO-3 fits MBS 2 with full recompute; so does FSDP reduce-scattering after every micro-batch (with
    # no_sync's unsharded gradients it would not), with the same collectives (two gathers and a reduce-scatter per
    # micro-step): a tie, kept in the planner's order. CP pays its K/V exchange, TP its all-reduces.
    (8192, "ZeRO-3", ["ZeRO", "FSDP / HSDP", "FSDP x CP", "FSDP x TP", "FSDP x TP x CP"]),
    # 32768: FSDP x CP 2 reduce-scattering each micro-batch fits MBS 1 without offload and without TP's all-reduces;
    # ZeRO-3 and FSDP fit only with CPU offload, which ranks after every layout without it, and the explanation says
    # so where the model's tokens/s would say otherwise
    (32768, "FSDP FULL_SHARD x CP 2, reduce-scatter each micro-batch",
     ["FSDP x CP", "FSDP x TP x CP", "ZeRO", "FSDP / HSDP"]),
])
def test_planner_ranks_tp_and_cp_layouts_for_70b_on_4x8_h100_and_says_why(seq_len, chosen, families):
    skipped: dict[str, list[str]] = {}
    recipe = load_recipe(R70B, [f"data.seq_len={seq_len}"])
    ranked, _ = planner.plan(recipe, 4, 8, memory.find_gpu("H100-80GB"), skipped=skipped)
    assert ranked[0].name == chosen and ranked[0].runs
    lines = planner.explain_choice(ranked, skipped)
    assert lines[0].startswith(f"chose {chosen}, MBS ")
    best = {line[2:18].strip(): line for line in lines[1:] if not line.strip().startswith("not considered")}
    assert list(best) == families, lines
    assert "sharding collectives" in best["ZeRO"]
    for family in families:  # what costs the TP / CP layouts their time, in seconds
        if "TP" in family:
            assert re.search(r"TP all-reduces \d+ s", best[family]) and "sharding collectives" in best[family]
    assert re.search(r"CP K/V exchange \d+ s", best["FSDP x TP x CP"])
    if seq_len == 32768:
        for family in ("ZeRO", "FSDP / HSDP"):
            assert "offload" in best[family] and "not chosen: CPU offload ranks after every layout" in best[family]
        assert "offload 34 s" in best["ZeRO"]


def test_fsdp_reduce_scatter_each_micro_batch_trades_reduce_scatters_for_the_unsharded_gradients():
    """batch.sync_each_micro_batch under FSDP (7B, 8 H100, MBS 4, GAS 32): through accumulation the GPU holds the fp32
    gradient shards (4 B x Ψ/8) instead of no_sync's unsharded fp32 gradients (4 B x Ψ), which is what lets MBS 4
    fit, for 31 more reduce-scatters per step (4 B x Ψ each). The planner weighs both, chooses it here, and says
    the override."""
    recipe = load_recipe(R7B)
    gpu = memory.find_gpu("H100-80GB")
    shape = ModelShape.from_recipe(recipe)
    layout = Launch("fsdp", gpus_per_node=8, fsdp_sharding="FULL_SHARD")

    def estimate(sync_each: bool):
        workload = memory.Workload(precision="bf16", micro_batch_size=4, seq_len=recipe.data.seq_len,
                                   activation_checkpointing="selective", grad_accum_steps=32,
                                   sync_each_micro_batch=sync_each)
        return memory.estimate_shape(shape, workload, layout, gpu=gpu)

    no_sync, each = estimate(False), estimate(True)
    assert no_sync.terms["grads"].at("backward") == 4 * shape.num_params
    assert each.terms["grads"].at("backward") == each.terms["grads"].at("step") == no_sync.terms["grads"].at("step")
    assert each.terms["grads"].at("step") <= 4 * shape.num_params / 8 + 4
    assert not no_sync.fits and each.fits
    assert "GAS 32, reduced after every micro-batch," in each.summary() and "reduced after" not in no_sync.summary()
    volume = {name: planner.throughput(est, gpu)[2] for name, est in (("no_sync", no_sync), ("each", each))}
    assert volume["each"] - volume["no_sync"] == 31 * 4
    ranked, _ = planner.plan(recipe, 1, 8, gpu)
    best = ranked[0]
    assert best.name == "FSDP FULL_SHARD, reduce-scatter each micro-batch" and best.micro_batch_size == 4
    assert planner.recipe_overrides(recipe, best)[-1] == "batch.sync_each_micro_batch=true"
    # the same layout with no_sync is ranked too, at the largest MBS its unsharded gradients leave room for
    assert any(c.name == "FSDP FULL_SHARD" and c.micro_batch_size == 2 for c in ranked)
