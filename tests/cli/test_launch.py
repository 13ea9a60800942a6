"""pretrain-launch: bad launches fail in seconds with one message; good ones reach accelerate launch."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.helpers import FAST, ROOT, TINY, accelerate_environment, check_ok, run_cmd, train_losses

LAUNCH = ["-m", "pretrain.cli.launch"]
CONFIGS = ROOT / "accelerate_configs"


def launch(*args: str):
    return run_cmd([sys.executable, *LAUNCH, *args], timeout=600)


def write_accelerate_config(path, deepspeed_config: dict, num_processes: int = 2):
    lines = ["compute_environment: LOCAL_MACHINE", "distributed_type: DEEPSPEED", "deepspeed_config:"]
    lines += [f"  {k}: {json.dumps(v)}" for k, v in deepspeed_config.items()]
    lines += [f"num_processes: {num_processes}", "num_machines: 1", "machine_rank: 0", "use_cpu: false"]
    path.write_text("\n".join(lines) + "\n")
    return path


def assert_clean_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def test_missing_accelerate_config_lists_the_available_ones():
    proc = launch("--config_file", str(CONFIGS / "nope.yaml"), "--recipe", TINY)
    assert_clean_error(proc, "accelerate config file not found", "zero2.yaml")


def test_gbs_indivisible_for_the_launch_world_size_shows_valid_values():
    proc = launch("--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--recipe", TINY, "batch.global_batch_size=30")
    assert_clean_error(proc, "not divisible by batch.micro_batch_size (16) x world size (2)",
                       "micro_batch_size=5 (GAS 3)")


def test_deepspeed_json_contradicting_the_recipe_names_both_values(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"train_batch_size": 64, "gradient_clipping": "auto", "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 2}}))
    config = write_accelerate_config(tmp_path / "acc.yaml", {"deepspeed_config_file": str(user)})
    proc = launch("--config_file", str(config), "--recipe", TINY)
    assert_clean_error(proc, "train_batch_size=64 but the recipe gives 32", "bf16.enabled=True but the recipe gives False")


def test_fp16_on_cpu_suggests_bf16():
    proc = launch("--config_file", str(CONFIGS / "zero2.yaml"), "--num_processes", "2", "--recipe", TINY,
                  "precision.dtype=fp16")
    assert_clean_error(proc, "precision.dtype=fp16 needs a CUDA GPU", "bf16")


def test_accelerate_mixed_precision_contradicting_the_recipe():
    proc = launch("--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--mixed_precision", "bf16", "--recipe", TINY)
    assert_clean_error(proc, "mixed_precision=bf16 but the recipe says precision.dtype=fp32")


@pytest.mark.parametrize(
    "deepspeed_config, overrides, message",
    [
        ({"zero_stage": 2, "offload_param_device": "cpu"}, [], "offload_param_device=cpu needs ZeRO stage 3"),
        ({"zero_stage": 0, "offload_optimizer_device": "cpu"}, [], "needs ZeRO stage 1, 2 or 3"),
    ],
)
def test_zero_options_deepspeed_cannot_honour(tmp_path, deepspeed_config, overrides, message):
    config = write_accelerate_config(tmp_path / "acc.yaml", deepspeed_config)
    assert_clean_error(launch("--config_file", str(config), "--recipe", TINY, *overrides), message)


@pytest.mark.slow
def test_a_good_launch_runs_through_accelerate(tmp_path):
    out = tmp_path / "run"
    proc = launch("--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--recipe", TINY, *FAST, "train.max_steps=2",
                  f"output_dir={out}")
    check_ok(proc)
    assert "launch: " in proc.stdout and "world size 2" in proc.stdout
    assert sorted(train_losses(out)) == [1, 2]


# ---- the Launch value: the same whether read from the accelerate config or from the processes' environment


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_launch_read_from_the_config_equals_the_launch_the_processes_read(config, monkeypatch):
    from pretrain.distributed.layout import Launch

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    path = CONFIGS / config
    before = Launch.from_accelerate_config(path)
    assert Launch.from_env(accelerate_environment(path)) == before
    assert before.engine == ("fsdp" if "sdp" in config else "deepspeed" if "zero" in config else "ddp")
    options = ["--num_processes", "4", "--num_machines", "2"]
    # the mesh's sizes are the config's own numbers, not derived (TP 2 stays inside a node)
    if "hsdp" in config:  # HSDP x TP: 8 processes, as 2 replicas x FSDP 2 x TP 2
        options = ["--num_processes", "8", "--num_machines", "2"] if "tp" in config else options
        options += ["--parallelism_config_dp_replicate_size", "2", "--parallelism_config_dp_shard_size", "2"]
    elif "tp" in config or "_cp" in config:  # fsdp2_tp2, fsdp2_cp2: TP 2 or CP 2 x FSDP 2
        options += ["--parallelism_config_dp_shard_size", "2"]
    assert Launch.from_env(accelerate_environment(path, *options)) == Launch.from_accelerate_config(path, options)


def test_an_fsdp_launch_logs_the_estimators_fsdp_figure(monkeypatch):
    """The environment accelerate exports for fsdp.yaml on 2 processes -> Launch -> the figure the trainer logs
    as memory/estimated_gib (pretrain.train.metrics.memory_estimate) is the estimator's FSDP figure, not DDP's."""
    import torch

    from pretrain.distributed.layout import Launch
    from pretrain.plan.memory import estimate
    from pretrain.recipe.batching import plan_batches
    from pretrain.recipe.config import load_recipe
    from pretrain.train.metrics import memory_estimate

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    launch = Launch.from_env(accelerate_environment(CONFIGS / "fsdp.yaml", "--num_processes", "2"))
    assert (launch.engine, launch.fsdp_sharding, launch.world_size) == ("fsdp", "FULL_SHARD", 2)
    recipe = load_recipe(TINY, ["precision.dtype=bf16"])
    plan = plan_batches(recipe.batch, launch.world_size, recipe.data.seq_len)
    logged = memory_estimate(recipe, plan, launch, torch.device("cpu"), log=print)
    fsdp = estimate(recipe, plan, Launch("fsdp", gpus_per_node=2, fsdp_sharding="FULL_SHARD"), device="cpu")
    ddp = estimate(recipe, plan, Launch("ddp", gpus_per_node=2), device="cpu")
    assert "FSDP FULL_SHARD" in fsdp.layout.describe()
    assert logged.total_gib == fsdp.total_gib != ddp.total_gib


@pytest.mark.parametrize("env, launch_kwargs, words", [
    ({"FSDP_VERSION": "1"}, {}, ["FSDP1 (fsdp_version: 1)", "runs on GPUs only", "fsdp_version: 2"]),
    ({}, {"hybrid_shard_size": 2, "num_nodes": 2}, ["HSDP", "runs on GPUs only", "accelerate_configs/fsdp.yaml"]),
    ({}, {"offload_params": "cpu"}, ["fsdp_offload_params: true", "nothing to offload", "fsdp_offload_params: false"]),
])
def test_what_of_fsdp_cannot_run_on_cpu_is_refused_naming_what_can(env, launch_kwargs, words):
    """FSDP2 runs on CPU over gloo (runtime.fsdp_on_cpu; tests/multiprocess/test_distributed.py trains it); FSDP1 and HSDP
    (accelerate makes their device or 2-D mesh for GPU launches only) and parameter offload (from a GPU that
    is not there) are refused before any process group."""
    from pretrain.distributed.accelerator import check_fsdp_on_cpu
    from pretrain.distributed.layout import Launch
    from pretrain.errors import ConfigError

    environ = {**accelerate_environment(CONFIGS / "fsdp.yaml"), **env}
    check_fsdp_on_cpu(Launch("fsdp", gpus_per_node=2, fsdp_sharding="FULL_SHARD"),
                      accelerate_environment(CONFIGS / "fsdp.yaml"))  # the shipped config passes
    with pytest.raises(ConfigError) as info:
        check_fsdp_on_cpu(Launch("fsdp", gpus_per_node=2, fsdp_sharding="FULL_SHARD", **launch_kwargs), environ)
    for word in words:
        assert word in str(info.value)


# ---- memory: a launch the estimator says does not fit its GPUs is refused, naming a layout that fits


R7B = str(ROOT / "recipes" / "7b.yaml")


@pytest.fixture
def execv(monkeypatch):
    """Record the command pretrain-launch would start instead of starting accelerate launch."""
    from pretrain.cli import launch as launch_cli

    calls = []
    monkeypatch.setattr(launch_cli, "run_launcher", lambda argv, environment: calls.append(argv) or 0)
    return calls


def launch_in_process(capsys, *args: str):
    from pretrain.cli.launch import main

    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_7b_ddp_on_h100_is_refused_naming_the_estimate_and_a_layout_that_fits(capsys, execv):
    code, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "ddp.yaml"), "--gpu", "H100-80GB",
                                     "--recipe", R7B)
    assert code == 2 and execv == []
    assert "7b on PyTorch DDP on 8 GPUs (MBS 1, GAS 128, no recompute): estimated 165.3 GiB per GPU" in err, err
    assert "does not fit: needs 85.6 GiB more than the H100-80GB's 79.6 GiB" in err
    assert ("pretrain-plan's best layout on 1 x 8 H100-80GB: FSDP FULL_SHARD, reduce-scatter each micro-batch, MBS 4, "
            "GAS 32, recompute selective: 73.3 GiB") in err
    assert f"pretrain-plan --recipe {R7B} --nodes 1 --gpus-per-node 8 --gpu H100-80GB\n" in err
    assert "--force" in err


def test_the_suggested_commands_write_a_layout_that_passes(capsys, execv, tmp_path, monkeypatch):
    """Run the two commands the refusal prints: pretrain-plan writes the config, pretrain-launch accepts it."""
    from pretrain.cli import plan

    monkeypatch.chdir(tmp_path)
    _, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "ddp.yaml"), "--gpu", "H100-80GB",
                                  "--recipe", R7B, "optim.lr=1.5e-4")
    plan_line, launch_line = (line.split() for line in err.splitlines() if line.startswith("  pretrain-"))
    assert plan_line[0] == "pretrain-plan" and "optim.lr=1.5e-4" in plan_line
    assert plan.main(plan_line[1:]) == 0
    capsys.readouterr()
    assert launch_line[0] == "pretrain-launch" and (tmp_path / launch_line[2]).is_file()
    code, out, err = launch_in_process(capsys, "--gpu", "H100-80GB", *launch_line[1:])
    assert code == 0 and err == "" and len(execv) == 1, err
    assert "batch.micro_batch_size=4" in execv[0] and "model.activation_checkpointing=selective" in execv[0]


def test_force_launches_anyway_with_one_warning_and_keeps_its_options_from_accelerate(capsys, execv):
    code, out, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "ddp.yaml"), "--gpu=H100-80GB",
                                       "--force", "--recipe", R7B)
    assert code == 0, err
    assert err.count("\n") == 1 and err.startswith("warning: --force: 7b on PyTorch DDP on 8 GPUs")
    assert "165.3 GiB per GPU" in err and "launching anyway" in err
    (command,) = execv
    assert "--gpu=H100-80GB" not in command and "--force" not in command and "--gpu" not in command
    assert command[command.index("--config_file") + 1] == str(CONFIGS / "ddp.yaml")
    assert "launch: " in out


@pytest.mark.parametrize("given", [None, "3"])
def test_threads_per_process_are_the_cores_shared_out_unless_set(capsys, monkeypatch, given):
    """torchrun would set OMP_NUM_THREADS=1 and warn; pretrain-launch shares the cores out (or keeps the user's)."""
    from pretrain.cli import launch as launch_cli

    environments = []
    monkeypatch.setattr(launch_cli, "run_launcher", lambda argv, environment: environments.append(environment) or 0)
    monkeypatch.setattr("pretrain.distributed.layout.usable_cores", lambda: 16)
    if given is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", given)
    code, out, _ = launch_in_process(capsys, "--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--recipe", TINY)
    assert code == 0 and environments[0]["OMP_NUM_THREADS"] == (given or "8")  # 16 cores, 2 processes
    assert out.startswith("launch: OMP_NUM_THREADS=8 ") == (given is None)
    assert os.environ.get("OMP_NUM_THREADS") == given  # this process's environment is left alone


def test_a_layout_that_fits_passes_the_check(capsys, execv):
    code, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "zero3.yaml"), "--gpu", "H100-80GB",
                                     "--recipe", R7B)
    assert code == 0 and err == "" and len(execv) == 1, err
    assert "H100-80GB" not in " ".join(execv[0])


def test_the_check_uses_the_launch_world_size_and_the_recipe_batch(capsys, execv):
    # ZeRO-3 on 8 H100s fits at MBS 1; at MBS 16 without recompute the activations do not.
    code, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "zero3.yaml"), "--gpu", "H100-80GB",
                                     "--recipe", R7B, "batch.micro_batch_size=16", "model.activation_checkpointing=false")
    assert code == 2 and "DeepSpeed ZeRO-3 on 8 GPUs (MBS 16, GAS 8, no recompute)" in err, err
    assert err.count("batch.micro_batch_size=") == 2, err  # the plan's MBS replaces the user's in the launch
    # on 1 GPU the states alone are over 80 GiB: the best layout offloads
    code, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "zero3.yaml"), "--num_processes", "1",
                                     "--gpu", "H100-80GB", "--recipe", R7B)
    assert code == 2 and "on 1 x 1 H100-80GB: ZeRO-" in err and "+offload opt" in err, err


def test_nothing_fits_says_so_with_the_planners_advice(capsys, execv):
    code, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "single_gpu.yaml"), "--gpu", "T4-16GB",
                                     "--recipe", str(ROOT / "recipes" / "70b.yaml"))
    assert code == 2 and execv == []
    assert "no layout of 70b fits 1 x 1 T4-16GB" in err and "What would fit:" in err, err
    assert "- more GPUs: " in err and "- CPU offload on 1 x 1 T4-16GB" in err and "data.seq_len" in err, err


@pytest.mark.parametrize("gpu, message", [
    ("B9000", "unknown GPU 'B9000'; known GPUs: T4-16GB"),
    ("h10080gb", None),  # the estimator's lookup: case, dashes and spaces ignored
    ("0,1", "accelerate selects devices with --gpu_ids"),
])
def test_gpu_names_are_the_estimators(capsys, execv, gpu, message):
    code, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "zero3.yaml"), "--gpu", gpu,
                                     "--recipe", R7B)
    assert (code, message is None) == (0, True) or (code == 2 and message in err), err


def test_help_documents_the_own_options(capsys):
    code, out, _ = launch_in_process(capsys, "--help")
    assert code == 0 and "--gpu NAME" in out and "--force" in out
    code, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "ddp.yaml"))
    assert code == 2 and "[--gpu NAME | --gpu-memory-gib GIB] [--force] [--doctor] --recipe R" in err


def test_own_options_need_their_values(capsys, execv):
    code, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "ddp.yaml"), "--gpu", "--recipe", R7B)
    assert code == 2 and "--gpu needs a value" in err and "usage: pretrain-launch" in err
    code, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "ddp.yaml"), "--gpu-memory-gib", "lots",
                                     "--recipe", R7B)
    assert code == 2 and "--gpu-memory-gib must be a number of GiB, got 'lots'" in err


def test_gpu_memory_gib_alone_checks_that_capacity(capsys, execv):
    code, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "ddp.yaml"), "--gpu-memory-gib", "100",
                                     "--recipe", R7B)
    assert code == 2 and "the 100 GiB device's 100.0 GiB" in err, err
    assert "--gpu H100-80GB --gpu-memory-gib 100.0\n" in err  # the planner's rates: the estimator's default card


def fake_cuda(monkeypatch, name: str | None, total_mib: int = 0):
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: name is not None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name=name, total_memory=total_mib * 2**20))


def test_without_gpu_the_gpu_of_this_machine_is_checked(capsys, execv, monkeypatch):
    fake_cuda(monkeypatch, "NVIDIA H100 80GB HBM3", 81559)
    code, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "ddp.yaml"), "--recipe", R7B)
    assert code == 2 and "the NVIDIA H100 80GB HBM3's 79.6 GiB (GPU 0 of this machine" in err, err
    assert "--gpus-per-node 8 --gpu H100-80GB\n" in err  # the table's name for the detected card and size
    fake_cuda(monkeypatch, "NVIDIA A100-SXM4-40GB MIG 3g.20gb", 19968)  # a MIG slice: no card, its capacity
    code, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "ddp.yaml"), "--recipe", R7B)
    assert code == 2 and "--gpus-per-node 8 --gpu-memory-gib 19.5\n" in err, err


def test_no_gpu_known_means_no_check(capsys, execv, monkeypatch):
    fake_cuda(monkeypatch, None)  # a login node or a CPU machine, no --gpu
    code, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "ddp.yaml"), "--recipe", R7B)
    assert code == 0 and err == "" and len(execv) == 1, err
    fake_cuda(monkeypatch, "NVIDIA H100 80GB HBM3", 81559)  # a CPU launch on a GPU machine: its GPU is not used
    code, _, err = launch_in_process(capsys, "--config_file", str(CONFIGS / "ddp.yaml"), "--cpu", "--recipe", R7B)
    assert code == 0 and err == "" and len(execv) == 2, err


def test_the_planning_page_shows_the_real_refusal(capsys, execv, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PRETRAIN_RUNS_DIR")  # the page shows the default runs/plan/ (tests/conftest.py sets the suite's)
    args = ["--config_file", "accelerate_configs/ddp.yaml", "--gpu", "H100-80GB", "--recipe", "recipes/7b.yaml"]
    code, _, err = launch_in_process(capsys, *args)
    assert code == 2
    assert f"$ pretrain-launch {' '.join(args)}\n{err}$ echo $?\n2\n" in (ROOT / "docs" / "planning.md").read_text()


def test_a_multi_node_launch_without_its_store_stops_before_accelerate_with_the_prepare_commands(
        capsys, execv, tmp_path):
    from tests.data.test_data import make_docs, write_corpus

    corpus = write_corpus(tmp_path / "corpus", make_docs(40, seed=31))
    store = tmp_path / "store"
    node = ["--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--num_machines", "2", "--num_processes", "2",
            "--machine_rank", "0", "--main_process_ip", "127.0.0.1", "--main_process_port", "29555"]
    overrides = [f"data.source={corpus}", f"data.store={store}", f"data.cache_dir={tmp_path / 'cache'}",
                 "data.val_fraction=0.2"]
    code, _, err = launch_in_process(capsys, *node, "--recipe", TINY, *overrides)
    assert code == 2 and execv == []
    assert err.startswith(f"error: data: no token store at {store} ") and "a 2-node launch does not tokenize" in err
    assert f"\n    pretrain-prepare-data --recipe {TINY} {' '.join(overrides)}\n" in err
    assert f"\n    pretrain-prepare-data --recipe {TINY} --slurm --array 2 {' '.join(overrides)}" in err
    assert not store.exists()

    from pretrain.cli.prepare_data import main as prepare

    assert prepare(["--recipe", TINY, *overrides]) == 0  # the printed command, then the same launch goes on
    capsys.readouterr()
    code, _, err = launch_in_process(capsys, *node, "--recipe", TINY, *overrides)
    assert code == 0 and len(execv) == 1, err


def test_a_multi_node_launch_of_a_mixture_without_its_stores_stops_before_accelerate(capsys, execv, tmp_path):
    """Every source of a mixture needs its store before a multi-node launch; --slurm is for one source."""
    mixture = str(ROOT / "recipes" / "mixture-tiny.yaml")
    node = ["--config_file", str(CONFIGS / "cpu_ddp.yaml"), "--num_machines", "2", "--num_processes", "2",
            "--machine_rank", "0", "--main_process_ip", "127.0.0.1", "--main_process_port", "29555"]
    store = tmp_path / "stores"
    code, _, err = launch_in_process(capsys, *node, "--recipe", mixture, f"data.store={store}")
    assert code == 2 and execv == [], err
    assert err.startswith("error: data: the mixture has no token store for source(s) 'email' at ")
    assert "'json' at " in err and f"\n    pretrain-prepare-data --recipe {mixture} data.store={store}\n" in err
    assert "--slurm" not in err and not store.exists()

    from pretrain.cli.prepare_data import main as prepare

    assert prepare(["--recipe", mixture, "--slurm", "--array", "2", f"data.store={store}"]) == 2
    assert "a data.mixture is prepared on one machine" in capsys.readouterr().err


def test_gemma2_with_eager_attention_passes_the_checks_and_trains(tmp_path):
    """The pre-launch checks build the model as the run does (the recipe's attention): gemma2, which refuses sdpa
    (logit soft-capping), launches and trains with model.attention=eager."""
    out = tmp_path / "gemma2"
    proc = launch("--config_file", str(CONFIGS / "cpu.yaml"), "--recipe", TINY, *FAST, "model.arch=gemma2",
                  "model.attention=eager", "model.num_kv_heads=2", "train.max_steps=2", f"output_dir={out}")
    check_ok(proc)
    assert sorted(train_losses(out)) == [1, 2]
