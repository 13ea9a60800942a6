"""Hybrid sharding (ZeRO-3 + hpZ, FSDP2 HSDP) from the accelerate config to the DeepSpeed JSON, the estimator and
the planner; and the planner's base MFU, calibrated from measured rows."""

from __future__ import annotations

import json
import os
import sys

import pytest
import yaml

from pretrain.cli import plan
from pretrain.distributed.deepspeed import build_deepspeed_config
from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.plan import memory, planner
from pretrain.recipe.batching import plan_batches
from pretrain.recipe.config import load_recipe
from pretrain.system.hardware import find_gpu
from tests.helpers import ROOT, TINY, make_recipe

CONFIGS = ROOT / "accelerate_configs"
HPZ, HSDP = CONFIGS / "multinode_zero3_hpz.yaml", CONFIGS / "multinode_hsdp.yaml"
R7B = str(ROOT / "recipes" / "7b.yaml")
H100 = find_gpu("H100-80GB")


# ---- the accelerate configs -> Launch


def test_shipped_hybrid_configs_parse_to_a_node_sized_shard_group(monkeypatch):
    monkeypatch.chdir(ROOT)  # the hpZ config names its DeepSpeed JSON relative to the repository root
    hpz = Launch.from_accelerate_config(HPZ)
    assert (hpz.engine, hpz.zero_stage, hpz.num_nodes, hpz.gpus_per_node, hpz.hybrid_shard_size) == (
        "deepspeed", 3, 2, 8, 8)
    assert hpz.num_replicas == 2 and "hpZ: sharded within 8 GPUs, 2 replicas" in hpz.describe()
    # "auto" follows the launch: 4 nodes of 4 GPUs shard within 4
    options = ["--num_machines", "4", "--num_processes", "16"]
    assert Launch.from_accelerate_config(HPZ, options).hybrid_shard_size == 4
    hsdp = Launch.from_accelerate_config(HSDP)
    assert (hsdp.engine, hsdp.fsdp_sharding, hsdp.hybrid_shard_size, hsdp.num_replicas) == ("fsdp", "FULL_SHARD", 8, 2)
    assert Launch.from_accelerate_config(HSDP).to_dict()["hybrid_shard_size"] == 8
    assert Launch.from_accelerate_config(CONFIGS / "multinode_zero3.yaml").hybrid_shard_size is None


def write(tmp_path, zero: dict, processes=16, machines=2):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": zero}))
    path = tmp_path / "acc.yaml"
    path.write_text(f"distributed_type: DEEPSPEED\nnum_processes: {processes}\nnum_machines: {machines}\n"
                    f"deepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n")
    return path


@pytest.mark.parametrize("zero, processes, machines, message", [
    ({"stage": 2, "zero_hpz_partition_size": "auto"}, 16, 2, "(hpZ) needs ZeRO-3 (got ZeRO-2)"),
    ({"stage": 3, "zero_hpz_partition_size": 3}, 16, 2, "zero_hpz_partition_size = 3 does not divide the world size"),
    ({"stage": 3, "zero_hpz_partition_size": "auto"}, 8, 1, "zero_hpz_partition_size = 8 on one node"),
    ({"stage": 3, "zero_hpz_partition_size": 16}, 16, 2, "equals the world size (16): nothing is replicated"),
    ({"stage": 3, "zero_hpz_partition_size": "eight"}, 16, 2, 'use "auto" (the GPUs per node)'),
])
def test_hpz_that_cannot_help_or_run_is_refused(tmp_path, zero, processes, machines, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Launch.from_accelerate_config(write(tmp_path, zero, processes, machines))


def hsdp_config(tmp_path, replicate, shard, processes=16, machines=2, version=2, extra=""):
    path = tmp_path / "hsdp.yaml"
    path.write_text(f"distributed_type: FSDP\nnum_processes: {processes}\nnum_machines: {machines}\n"
                    f"fsdp_config:\n  fsdp_version: {version}\n  fsdp_reshard_after_forward: true\n"
                    f"parallelism_config:\n  parallelism_config_dp_replicate_size: {replicate}\n"
                    f"  parallelism_config_dp_shard_size: {shard}\n{extra}")
    return path


@pytest.mark.parametrize("replicate, shard, version, extra, message", [
    (4, 8, 2, "", r"dp_replicate_size \(4\) x dp_shard_size \(8\) = 32, but the launch has 2 x 8 = 16"),
    (16, 1, 2, "", "dp_shard_size = 1 leaves FSDP nothing to shard over"),
    (2, 8, 1, "", "needs fsdp_version: 2"),
    (2, 8, 2, "  parallelism_config_cp_size: 2\n", r"x cp_size \(2\) = 32, but the launch has 2 x 8 = 16"),
    (2, 8, 2, "  parallelism_config_tp_size: 2\n", r"x tp_size \(2\) = 32, but the launch has 2 x 8 = 16"),
])
def test_hsdp_sizes_that_do_not_match_the_launch_are_refused(tmp_path, replicate, shard, version, extra, message):
    with pytest.raises(ConfigError, match=message):
        Launch.from_accelerate_config(hsdp_config(tmp_path, replicate, shard, version=version, extra=extra))


def test_fsdp2_with_fsdp1s_hybrid_strategy_name_points_to_the_hsdp_config(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 16\nnum_machines: 2\nfsdp_config:\n  fsdp_version: 2\n"
                    "  fsdp_reshard_after_forward: HYBRID_SHARD\n")
    with pytest.raises(ConfigError, match="multinode_hsdp.yaml"):
        Launch.from_accelerate_config(path)
    # FSDP1's HYBRID_SHARD shards within a node, as torch does
    path.write_text("distributed_type: FSDP\nnum_processes: 16\nnum_machines: 2\nfsdp_config:\n  fsdp_version: 1\n"
                    "  fsdp_sharding_strategy: HYBRID_SHARD\n")
    fsdp1 = Launch.from_accelerate_config(path)
    assert (fsdp1.fsdp_sharding, fsdp1.hybrid_shard_size) == ("FULL_SHARD", 8)


def test_pretrain_launch_refuses_hpz_on_one_node_before_accelerate(tmp_path, capsys, monkeypatch):
    from pretrain.cli import launch as launch_cli

    started = []
    monkeypatch.setattr(launch_cli, "run_launcher", lambda argv, environment: started.append(argv) or 0)
    config = write(tmp_path, {"stage": 3, "zero_hpz_partition_size": "auto"}, processes=2, machines=1)
    assert launch_cli.main(["--config_file", str(config), "--recipe", TINY]) == 2
    err = capsys.readouterr().err
    assert "on one node" in err and "accelerate_configs/zero3.yaml" in err and not started


# ---- the DeepSpeed config


def ds_config(launch: Launch, user=None):
    recipe = make_recipe(batch={"global_batch_size": 64, "micro_batch_size": 1})
    batch = plan_batches(recipe.batch, launch.world_size, recipe.data.seq_len)
    return build_deepspeed_config(recipe, batch, launch, recipe.optim.lr, user)[0]["zero_optimization"]


def test_deepspeed_json_holds_the_resolved_hpz_partition_size(monkeypatch):
    monkeypatch.chdir(ROOT)
    launch = Launch.from_accelerate_config(HPZ, ["--num_machines", "4", "--num_processes", "32"])
    user = json.loads((CONFIGS / "zero3_hpz.json").read_text())
    zero = ds_config(launch, user)
    assert zero["zero_hpz_partition_size"] == 8 and zero["stage"] == 3  # "auto" resolved to the GPUs per node
    plain = ds_config(Launch("deepspeed", 3, num_nodes=4, gpus_per_node=8), {"zero_optimization": {
        "stage": 3, "zero_hpz_partition_size": 1}})
    assert "zero_hpz_partition_size" not in plain


# ---- the planner


def test_planner_picks_hybrid_for_7b_on_8_nodes_of_8_h100_and_not_on_one_node():
    recipe = load_recipe(R7B)
    ranked, _ = planner.plan(recipe, 8, 8, H100)
    best = ranked[0]
    flat = next(c for c in ranked if not c.layout.hybrid_shard_size)
    # a hybrid group of one node's 8 GPUs (HSDP x TP 2 shards over 4 TP pairs of the node)
    assert best.layout.hybrid_shard_size * best.layout.tp_size == 8 and best.tokens_per_s > flat.tokens_per_s
    assert best.comm_s < flat.comm_s
    one_node, _ = planner.plan(recipe, 1, 8, H100)
    assert one_node and not any(c.layout.hybrid_shard_size for c in one_node)


def test_hybrid_communication_keeps_the_gathers_in_the_node():
    """Bytes per parameter per step, GAS 4, bf16 with fp32 gradient reduction: ZeRO-3 sends 4 x 4 (reduce) +
    8 x 2 (gathers) over all GPUs; hpZ moves the backward half of the gathers onto NVLink; HSDP gathers and
    reduce-scatters in the node and all-reduces only its 1/8 shard across nodes (2 x 4 / 8)."""
    w = memory.Workload(precision="bf16", micro_batch_size=1, seq_len=4096, grad_accum_steps=4)
    shape = planner.ModelShape.from_recipe(load_recipe(R7B))

    def model(layout):
        return planner.throughput(memory.estimate_shape(shape, w, layout), H100)

    zero3 = model(Launch("deepspeed", 3, num_nodes=8, gpus_per_node=8))
    hpz = model(Launch("deepspeed", 3, num_nodes=8, gpus_per_node=8, hybrid_shard_size=8))
    hsdp = model(Launch("fsdp", num_nodes=8, gpus_per_node=8, fsdp_sharding="FULL_SHARD", hybrid_shard_size=8))
    assert zero3[2] == hpz[2] == 4 * 4 + 8 * 2
    assert hsdp[2] == 8 * 2 + 4 + 2 * 4 / 8
    P, exposed = shape.num_params, 0.5
    network, nvlink = H100.inter_node_gb_s * 1e9, H100.intra_node_gb_s * 1e9
    assert hpz[1] == pytest.approx(exposed * P * ((16 + 8) * 63 / 64 / network + 8 * 7 / 8 / nvlink))
    assert hsdp[1] == pytest.approx(exposed * P * ((16 + 4) * 7 / 8 / nvlink + 1 * 7 / 8 / network))


def test_written_hybrid_configs_read_back_as_the_planned_layout(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the hpZ config's JSON path is the shipped one, relative to the repository
    ranked, _ = planner.plan(load_recipe(R7B), 4, 8, H100)
    for engine in ("deepspeed", "fsdp"):
        c = next(c for c in ranked if c.layout.hybrid_shard_size and c.layout.engine == engine)
        path = tmp_path / f"{engine}.yaml"
        path.write_text(planner.accelerate_config(c, R7B))
        assert Launch.from_accelerate_config(path).to_dict() == c.layout.to_dict()


# ---- the base MFU: calibrated from measurements


def test_default_base_mfu_is_torchtitans_eager_fsdp_figure_not_an_assumed_half():
    # 33% MFU at 16,384 tokens per micro-batch, divided by the model's own MBS factor
    assert planner.DEFAULT_BASE_MFU == pytest.approx(0.33 / (16384 / (16384 + 1024)), abs=0.005)
    assert "torchtitan" in planner.DEFAULT_MFU_SOURCE


def test_calibration_rows_give_the_median_base_for_this_gpu(tmp_path):
    rows = [{"gpu": "H100-80GB", "model": "7b", "params": 6738415616, "seq_len": 4096, "mbs": 1, "mfu": 0.32},
            {"gpu": "NVIDIA H100 80GB HBM3", "seq_len": 4096, "mbs": 2, "mfu": 0.36},  # the CUDA device name
            {"gpu": "H100-80GB", "seq_len": 4096, "mbs": 4, "mfu": 0.30, "hfu": 0.40},  # recompute: hfu counts
            {"gpu": "A100-80GB", "seq_len": 2048, "mbs": 1, "mfu": 0.5}]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(rows))
    got = planner.read_calibration(path, H100)
    bases = sorted([0.32 / (4096 / 5120), 0.36 / (8192 / 9216), 0.40 / (16384 / 17408)])
    assert got.base_mfu == pytest.approx(bases[1])
    assert "median of 3 measurements on H100 SXM" in got.source and str(path) in got.source
    other = planner.read_calibration(path, find_gpu("L4-24GB"))
    assert other.base_mfu == planner.DEFAULT_BASE_MFU and "no measurement on L4" in other.source
    assert planner.read_calibration(path, find_gpu("A100-40GB")).base_mfu == pytest.approx(0.5 / (2048 / 3072))


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not valid JSON"),
    ('{"gpu": "H100"}', "expected a JSON list of rows"),
    ('[{"gpu": "H100", "mfu": 0.3}]', "row 0: missing seq_len, mbs"),
    ('[{"gpu": "H100", "mfu": 38, "seq_len": 4096, "mbs": 1}]', "as a fraction in (0, 1]"),
    ('[{"gpu": "H100", "mfu": 0.3, "seq_len": 0, "mbs": 1}]', "seq_len = 0"),
    ('[{"gpu": "TPU-v9", "mfu": 0.3, "seq_len": 4096, "mbs": 1}]', "row 0: "),
])
def test_a_bad_calibration_file_is_one_error_naming_it(tmp_path, capsys, text, message):
    path = tmp_path / "cal.json"
    path.write_text(text)
    code = plan.main(["--recipe", R7B, "--nodes", "1", "--calibration", str(path), "--output", str(tmp_path / "o.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and str(path) in err and message in err, err
    assert not (tmp_path / "o.yaml").exists()


def test_pretrain_plan_prints_its_base_mfu_and_reads_the_cache_roots_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PRETRAIN_CACHE_DIR", str(tmp_path / "cache"))
    args = ["--recipe", R7B, "--nodes", "1", "--top", "1", "--output", str(tmp_path / "o.yaml")]
    assert plan.main(args) == 0
    default = capsys.readouterr().out
    assert f"base MFU 35.0% ({planner.DEFAULT_MFU_SOURCE})" in default
    # the planner may have cached a TP plan there already (tp_plans/: the first lookup in this process writes it)
    (tmp_path / "cache").mkdir(exist_ok=True)
    cal = tmp_path / "cache" / planner.CALIBRATION_FILE
    cal.write_text(json.dumps([{"gpu": "H100-80GB", "seq_len": 4096, "mbs": 4, "mfu": 0.47}]))
    assert plan.main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["base_mfu"] == pytest.approx(0.47 / (16384 / 17408), abs=1e-4) and str(cal) in data["base_mfu_source"]
    # a higher measured rate: more tokens/s for the same layout
    assert plan.main(args) == 0
    assert "base MFU 49.9% (median of 1 measurement on H100 SXM" in capsys.readouterr().out


def test_hybrid_template_configs_are_what_the_planner_writes():
    """The shipped hybrid configs hold what pretrain-plan writes for 2 x 8 GPUs (the sizes and the hpZ JSON)."""
    hsdp = yaml.safe_load(HSDP.read_text())
    assert hsdp["parallelism_config"] == {"parallelism_config_dp_replicate_size": 2,
                                          "parallelism_config_dp_shard_size": 8}
    hpz = yaml.safe_load(HPZ.read_text())
    assert hpz["deepspeed_config"]["deepspeed_config_file"] == planner.HPZ_JSON
    assert planner.HYBRID_CONFIGS == {"deepspeed": str(HPZ.relative_to(ROOT)), "fsdp": str(HSDP.relative_to(ROOT))}


# ---- end to end: hpZ on two "nodes" of two CPU processes each


@pytest.mark.slow
def test_zero3_hpz_on_two_nodes_of_two_processes_trains_the_layout_independent_curve(tmp_path):
    """multinode_zero3_hpz.yaml as shipped (the JSON's "auto" -> 2 GPUs per node) on 2 machines x 2 processes of
    this host, each machine its own accelerate launch: DeepSpeed partitions a secondary copy within each pair of
    ranks and gathers from it in backward, and the losses are the golden 2-process curve (every layout trains
    the same curve). Three steps, no checkpoints: the smallest run that takes hpZ through forward, backward and
    the optimizer step's re-partition twice."""
    import signal
    import subprocess

    from pretrain.cli import prepare_data
    from tests import golden_losses
    from tests.helpers import RUN, env, free_port, train_losses

    out = tmp_path / "hpz"
    args = [*golden_losses.DIST_ARGS, "train.max_steps=3", "checkpoint.every_steps=0", "checkpoint.save_last=false",
            "checkpoint.save_final_model=false", f"output_dir={out}"]
    # a multi-node launch does not prepare its token store (docs/data.md): the curve's store, found or built once
    assert prepare_data.main(["--recipe", TINY, *args]) == 0
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(HPZ),
                               "--num_machines", "2", "--num_processes", "4", "--machine_rank", str(rank),
                               "--main_process_ip", "127.0.0.1", "--main_process_port", port, RUN, "--recipe", TINY,
                               *args], cwd=ROOT, env=env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for rank in (0, 1)]
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-4000:] for log in logs)
    run_config = json.loads((out / "run_config.json").read_text())
    assert (run_config["dist/world_size"], run_config["dist/num_machines"], run_config["dist/hybrid_shard_size"]) == (
        4, 2, 2)
    assert json.loads((out / "deepspeed_config.json").read_text())["zero_optimization"]["zero_hpz_partition_size"] == 2
    golden = golden_losses.load()["zero2"]
    losses = train_losses(out)
    assert sorted(losses) == [1, 2, 3]
    for step, loss in losses.items():
        assert loss == pytest.approx(golden[step], rel=1e-4), (step, loss, golden[step])
