"""Tensor parallelism (FSDP2 x TP) from the accelerate config to the run: the shipped layouts, the refusals before
launch, the accelerate 1.15 / transformers 5.24 shim, and TP 2 x FSDP 2 on 4 CPU processes against one process."""

from __future__ import annotations

import pytest

from pretrain.distributed import tensor_parallel
from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.train.preflight import check_layout
from tests.helpers import FAST, ROOT, accelerate_launch, check_ok, free_port, make_recipe, train_here, train_losses

CONFIGS = ROOT / "accelerate_configs"


def test_shipped_tp_configs_give_the_data_parallel_size():
    two_d = Launch.from_accelerate_config(CONFIGS / "fsdp2_tp2.yaml")
    assert (two_d.tp_size, two_d.world_size, two_d.data_parallel_size, two_d.hybrid_shard_size) == (2, 8, 4, None)
    assert "x TP 2 (4-way data parallel)" in two_d.describe()
    three_d = Launch.from_accelerate_config(CONFIGS / "hsdp_tp.yaml")
    assert (three_d.tp_size, three_d.data_parallel_size, three_d.hybrid_shard_size, three_d.num_replicas) == (2, 8, 4, 2)
    # ranks r, r+1 of a TP pair read the same micro-batches
    assert [Launch("fsdp", num_nodes=1, gpus_per_node=4, rank=r, tp_size=2).data_rank for r in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("parallelism, message", [
    ("parallelism_config_tp_size: 3", "parallelism_config_tp_size = 3 must be a whole number that divides the 8"),
    ("parallelism_config_tp_size: 2\n  parallelism_config_dp_shard_size: 2", "dp_shard_size x tp_size (2) must be"),
    # CP 2 x TP 2 x FSDP 2 = 8: accelerate composes them; a dp_shard_size that leaves out the cp ranks does not
    ("parallelism_config_tp_size: 2\n  parallelism_config_cp_size: 2\n  parallelism_config_dp_shard_size: 4",
     "dp_shard_size x cp_size (2) x tp_size (2) must be the world size (dp_shard_size 2)"),
])
def test_bad_parallelism_configs_are_refused_by_name(tmp_path, parallelism, message):
    path = tmp_path / "acc.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n"
                    f"parallelism_config:\n  {parallelism}\n")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Launch.from_accelerate_config(path)


def test_an_architecture_without_a_tp_plan_is_refused_naming_it():
    launch = Launch("fsdp", num_nodes=1, gpus_per_node=4, tp_size=2)
    with pytest.raises(ConfigError, match="model.arch = gpt2 has no tensor-parallel plan in transformers"):
        check_layout(make_recipe("model.arch=gpt2", "model.tie_embeddings=false"), launch)
    check_layout(make_recipe("model.arch=llama", "model.tie_embeddings=true"), launch)


def test_widths_tp_cannot_split_are_refused_before_any_process(capsys):
    """Issue 36: a TP degree that does not divide the heads reached the ranks (transformers' shape error in every
    process); --dry-run answered "no estimate" and exit 0. The run's checks, and so launch and dry run, refuse it."""
    from pretrain.run import main

    launch = Launch("fsdp", num_nodes=1, gpus_per_node=4, tp_size=2)
    for overrides, what in ((("model.num_heads=3", "model.num_kv_heads=3", "model.hidden_size=96"), "num_heads = 3"),
                            (("model.num_kv_heads=1",), "num_kv_heads = 1"),
                            (("model.intermediate_size=129",), "intermediate_size = 129")):
        with pytest.raises(ConfigError, match=f"model.{what} is not divisible by tp_size 2"):
            check_layout(make_recipe(*overrides), launch)
    code = main(["--dry-run", "--config_file", str(CONFIGS / "fsdp2_tp2.yaml"), "--recipe", str(ROOT / "recipes" / "tiny.yaml"),
                 "batch.micro_batch_size=8", "model.num_heads=3", "model.num_kv_heads=3", "model.hidden_size=96"])
    err = capsys.readouterr().err
    assert code == 2 and "model.num_heads = 3 is not divisible by tp_size 2" in err and "Traceback" not in err


def test_replicate_parallel_stand_in_is_importable_and_refuses_use():
    """accelerate 1.15's _prepare_tp imports ReplicateParallel from transformers, which 5.24 removed: without the
    stand-in every FSDP2 + TP prepare fails with ImportError; if accelerate ever instantiates it, it must fail loudly."""
    tensor_parallel.allow_accelerate_tp_prepare()
    from transformers.integrations.tensor_parallel import ReplicateParallel

    with pytest.raises(RuntimeError, match="every parameter must be a DTensor before prepare"):
        ReplicateParallel()


# recipes/tiny.yaml as shipped (tied embeddings) on the smallest shapes, fp32.
TP_ARGS = [*FAST, "precision.dtype=fp32", "train.max_steps=5"]
TP_LAUNCH = ["--num_processes", "4", "--parallelism_config_dp_shard_size", "2"]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """One process (in this process), TP 2 x FSDP 2 on 4 processes (checkpoints at steps 3 and 5), and its resume
    from step 3 on the same layout: two launches shared by the curve, resume and export tests."""
    base = tmp_path_factory.mktemp("tp")
    train_here([*TP_ARGS, f"output_dir={base / 'one'}"])
    tp = accelerate_launch("fsdp2_tp2.yaml", [*TP_ARGS, "checkpoint.every_steps=3", f"output_dir={base / 'tp'}"],
                           extra=[*TP_LAUNCH, "--main_process_port", str(free_port())])
    check_ok(tp)
    step3 = base / "tp" / "checkpoints" / "step_00000003"
    resumed = accelerate_launch("fsdp2_tp2.yaml", [*TP_ARGS, f"checkpoint.resume={step3}", f"output_dir={base / 'resumed'}"],
                                extra=[*TP_LAUNCH, "--main_process_port", str(free_port())])
    check_ok(resumed)
    # ... and on one process (another engine: through the neutral form, the DTensors of the (dp_shard, tp) mesh read
    # back whole)
    log = train_here([*TP_ARGS, f"checkpoint.resume={step3}", f"output_dir={base / 'one_from_tp'}"])[2]
    assert "converted through the neutral form" in log, log[-2000:]
    return base, tp.stdout + tp.stderr


def test_tp2_fsdp2_trains_the_one_process_curve_with_tied_embeddings(tp_runs):
    """The tiny recipe as shipped ties the LM head to the embedding: under TP both must stay one vocab-sharded tensor
    (before the re-tie the head became a second, separately seeded parameter: step 1 was 5.5363 against 5.5669)."""
    base, log = tp_runs
    assert "GBS 8 = MBS 4 x GAS 1 x world 2" in log  # the batch plan's world is the data-parallel size
    one, tp = train_losses(base / "one"), train_losses(base / "tp")
    assert sorted(tp) == [1, 2, 3, 4, 5]
    for step in one:
        assert tp[step] == pytest.approx(one[step], rel=1e-5), (step, tp[step], one[step])


def test_tp_resume_on_the_same_layout_is_exact(tp_runs):
    base, _ = tp_runs
    tp, resumed = train_losses(base / "tp"), train_losses(base / "resumed")
    assert sorted(resumed) == [4, 5]
    assert [resumed[s] for s in (4, 5)] == [tp[s] for s in (4, 5)]


def test_a_tp_checkpoint_continues_on_one_process(tp_runs):
    """TP 2 x FSDP 2's step 3 resumed by one process (weights and Adam states converted through the neutral form)
    gives the TP run's steps 4 and 5."""
    base, _ = tp_runs
    tp, resumed = train_losses(base / "tp"), train_losses(base / "one_from_tp")
    assert sorted(resumed) == [4, 5]
    for step in (4, 5):
        assert resumed[step] == pytest.approx(tp[step], rel=1e-5), (step, resumed[step], tp[step])


def test_export_of_a_tp_checkpoint_is_the_run_s_final_model(tp_runs, tmp_path):
    """pretrain-export of the TP run's last checkpoint (DCP shards of DTensors over the (dp_shard, tp) mesh) gives a
    whole transformers model, tied, with the logits of the run's own final_model and of the one-process run's."""
    import torch
    from transformers import AutoModelForCausalLM

    from pretrain.cli import export

    base, _ = tp_runs
    assert export.main([str(base / "tp" / "checkpoints" / "step_00000005"), str(tmp_path / "exported")]) == 0
    models = [AutoModelForCausalLM.from_pretrained(d) for d in
              (tmp_path / "exported", base / "tp" / "final_model", base / "one" / "final_model")]
    ids = torch.randint(0, models[0].config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exported, final, one = (m(input_ids=ids).logits for m in models)
    assert torch.equal(exported, final)
    torch.testing.assert_close(final, one, rtol=1e-4, atol=1e-4)
    for model in models:
        assert sum(p.numel() for p in model.parameters()) == 606_528 - 64 * 4096  # the head is the embedding
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # plain tensors, not DTensor shards


def test_a_tie_whose_plan_entries_disagree_is_refused():
    """The LM head is re-tied to the embedding's DTensor only where its own plan entry would shard it the same way."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(8, 4, device="meta")
    model.head = torch.nn.Linear(4, 8, bias=False, device="meta")
    model.head.weight = model.embed.weight
    tied = tensor_parallel._tied_slots(model)
    assert tied == [["embed.weight", "head.weight"]]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        apply_tensor_parallelism(model, mesh, {"embed.weight": "embedding_rowwise"})
        tensor_parallel._retie(model, tied, {"head": "colwise_gather_output"}, mesh)  # Shard(0) both: one tensor
        assert model.head.weight is model.embed.weight
        with pytest.raises(ConfigError, match="head.weight is tied to embed.weight, but transformers' TP plan places"):
            tensor_parallel._retie(model, tied, {"head": "rowwise"}, mesh)  # Shard(1): cannot share
    finally:
        dist.destroy_process_group()


def test_tp_leaving_fsdp_no_rank_to_shard_is_refused_before_any_process():
    """TP 2 on 2 processes (the CP page's --parallelism_config_dp_shard_size 1, used for TP) passed pretrain-launch and
    then failed in every rank with accelerate's FSDP message about expert parallelism; it is refused here, saying how."""
    with pytest.raises(ConfigError, match=r"tp_size 2 on 2 processes leaves FSDP no rank to shard over .* "
                                          r"--num_processes 4 --parallelism_config_dp_shard_size 2"):
        Launch.from_accelerate_config(CONFIGS / "fsdp2_tp2.yaml",
                                      ["--num_processes", "2", "--parallelism_config_dp_shard_size", "1"])
    four = Launch.from_accelerate_config(CONFIGS / "fsdp2_tp2.yaml",
                                         ["--num_processes", "4", "--parallelism_config_dp_shard_size", "2"])
    assert (four.tp_size, four.data_parallel_size) == (2, 2)
