"""--dry-run, the one planning answer: the launch, the batch plan, the memory estimate and the fit, the speed,
the best layout, and what would fit when nothing does; pretrain-launch refuses with the same words."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from pretrain import run
from pretrain.cli import plan
from pretrain.errors import EXIT_USAGE
from pretrain.recipe.config import load_recipe
from pretrain.system.hardware import find_gpu
from tests.helpers import ROOT, RUN, TINY, env

R7B = str(ROOT / "recipes" / "7b.yaml")
R70B = str(ROOT / "recipes" / "70b.yaml")
CONFIGS = ROOT / "accelerate_configs"


def dry_run(capsys, *args: str) -> tuple[int, str, str]:
    code = run.main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_num_processes_plans_for_that_world_with_the_estimate_and_the_best_layout(capsys):
    code, out, err = dry_run(capsys, "--recipe", R7B, "--dry-run", "--num-processes", "8", "--gpu", "H100-80GB")
    assert code == 0, err
    assert "6,738,415,616 parameters" in out
    assert "layout           PyTorch DDP on 8 GPUs" in out
    assert "world 8: GBS 1024 = MBS 1 x GAS 128 x world 8" in out
    # the estimator's table for this very layout, as pretrain-estimate prints it
    assert "memory per GPU (H100-80GB)" in out and "optimizer states (+ fp32 master)" in out
    assert re.search(r"total \(peak\)\s+165\.25", out), out
    # DDP does not fit: pretrain-launch's verdict and pretrain-plan's best layout for the same 8 GPUs
    assert "estimated 165.3 GiB per GPU, does not fit" in out and "pretrain-launch refuses this launch" in out
    assert ("pretrain-plan's best layout on 1 x 8 H100-80GB: FSDP FULL_SHARD, reduce-scatter each micro-batch, MBS 4, "
            "GAS 32, recompute selective: 73.3 GiB") in out
    assert re.search(r"speed +~[\d,]+ tokens/s per GPU: ~[\d.]+ s per optimizer step, the run's 476,838 steps in "
                     r"~[\d.,]+ (days|years)", out), out


def test_a_plan_made_without_the_runs_packages_names_them_instead_of_refusing(capsys, monkeypatch):
    """recipes/7b.yaml reads an hf: source (datasets) and logs to wandb; a dry run on a machine without them (a
    laptop planning a cluster run) answers the whole plan and lists what to install, exit 0."""
    from pretrain.system import environment

    real = environment.installed_version
    monkeypatch.setattr(environment, "installed_version",
                        lambda package: None if package in ("datasets", "wandb") else real(package))
    code, out, err = dry_run(capsys, "--recipe", R7B, "--dry-run", "--num-processes", "8", "--gpu", "H100-80GB")
    assert code == 0, err
    assert "memory per GPU (H100-80GB)" in out and "pretrain-plan's best layout" in out
    packages = out[out.index("packages "):]
    assert "datasets is not installed; data.source = 'hf:" in packages and "pip install 'datasets" in packages
    assert "wandb is not installed; logging.backends: wandb needs wandb" in packages


def test_the_shipped_fsdp_config_gets_an_fsdp_answer(capsys):
    code, out, err = dry_run(capsys, "--recipe", R7B, "--dry-run", "--config_file", str(CONFIGS / "fsdp.yaml"),
                             "--gpu", "H100-80GB")
    assert code == 0, err
    assert f"layout           FSDP FULL_SHARD on 8 GPUs ({CONFIGS / 'fsdp.yaml'})" in out
    assert "verdict    fits:" in out and "pretrain-plan    best of" in out and "speed" in out
    # the same figure pretrain-estimate gives for the shipped config
    from pretrain.cli import estimate

    assert estimate.main(["--recipe", R7B, "--accelerate-config", str(CONFIGS / "fsdp.yaml")]) == 0
    total = re.search(r"total \(peak\)\s+([\d.]+)", capsys.readouterr().out).group(1)
    assert re.search(rf"total \(peak\)\s+{re.escape(total)}\b", out)


def test_a_config_file_with_num_processes_overrides_its_count(capsys):
    code, out, _ = dry_run(capsys, "--recipe", R7B, "--dry-run", "--config_file", str(CONFIGS / "zero3.yaml"),
                           "--nodes", "2", "--num_processes", "32", "--gpu", "A100-80GB")
    assert code == 0 and "DeepSpeed ZeRO-3 on 2 x 16 GPUs" in out and "MBS 2 x GAS 16 x world 32" in out, out
    # the recipe's micro_batch_size auto: the largest that fits an A100 80GB on this layout, said under the plan
    assert "micro_batch_size auto -> 2 (GAS 16, global batch kept): the largest of 1, 2, 4, 8, 16, 32" in out, out
    # model.compile auto is eager under ZeRO-3 (accelerator.compile_choice), said here as in the run's log
    assert re.search(r"^compile +auto: none under DeepSpeed ZeRO-3", out, re.MULTILINE), out


def test_without_a_gpu_the_estimate_is_for_a_cpu_process(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = dry_run(capsys, "--recipe", TINY, "--dry-run")
    assert code == 0, err
    assert "world 1: GBS 32 = MBS 16 x GAS 2 x world 1" in out and "1,377,408 parameters" in out
    assert "memory per process (CPU" in out and "--gpu NAME" in out and "speed" not in out
    assert "layout           one process (no data parallelism) on 1 CPU process\n" in out  # no GPU where there is none


def test_nothing_fits_says_what_would(capsys):
    code, out, err = dry_run(capsys, "--recipe", R70B, "--dry-run", "--config_file", str(CONFIGS / "zero3.yaml"),
                             "--gpu", "H100-80GB")
    assert code == 0, err
    assert "no layout of 70b fits 1 x 8 H100-80GB" in out, out
    more = re.search(r"- more GPUs: (\d+) x 8 H100-80GB \((\d+) GPUs, the fewest that fit\)", out)
    assert more, out
    nodes = int(more.group(1))
    recipe, gpu = load_recipe(R70B), find_gpu("H100-80GB")
    assert plan.plan(recipe, nodes, 8, gpu)[0]  # it does fit there ...
    smaller = [n for n in range(2, nodes) if 1024 % (8 * n) == 0]
    assert all(not plan.plan(recipe, n, 8, gpu)[0] for n in smaller)  # ... and on no smaller world
    # the fewest GPUs fit without offload (FSDP x TP 8 x CP 2 holding gradient shards, not no_sync's unsharded ones):
    # no second, offload-free answer is needed
    assert re.search(r"GPUs, the fewest that fit\): FSDP FULL_SHARD x TP 8 x CP 2, reduce-scatter each micro-batch, ",
                     out), out
    assert "without offload" not in out
    assert re.search(r"- CPU offload on 1 x 8 H100-80GB: ZeRO-3 \+offload opt\+params, .* GiB of CPU memory per node "
                     r"\(if the nodes have it: pretrain-plan with --host-memory-gib \d+", out), out
    assert "- a larger GPU: 1 x 8 H200-141GB" in out or "- a larger GPU" not in out


def test_pretrain_launch_refuses_with_the_same_advice(capsys, monkeypatch):
    from pretrain.cli import launch as launch_cli

    monkeypatch.setattr(launch_cli.os, "execv", lambda *a: pytest.fail("launched"))
    code = launch_cli.main(["--config_file", str(CONFIGS / "zero3.yaml"), "--gpu", "H100-80GB", "--recipe", R70B])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "no layout of 70b fits 1 x 8 H100-80GB" in err and "- more GPUs:" in err
    advice = err[err.index("no layout of"):err.index("\nOr launch this layout anyway")]
    _, out, _ = dry_run(capsys, "--recipe", R70B, "--dry-run", "--config_file", str(CONFIGS / "zero3.yaml"),
                        "--gpu", "H100-80GB")
    assert advice in out


def test_plan_options_need_dry_run(capsys):
    code, _, err = dry_run(capsys, "--recipe", TINY, "--num-processes", "8")
    assert code == EXIT_USAGE and "--num-processes describe the launch a --dry-run plans for" in err
    with pytest.raises(SystemExit) as exc:  # argparse's refusal (pretrain/cli/options.py)
        run.main(["--recipe", TINY, "--dry-run", "--num-processes", "0"])
    assert exc.value.code == EXIT_USAGE and "--num-processes" in capsys.readouterr().err


def test_dry_run_of_70b_answers_in_seconds():
    """A fresh process: no model is built for an architecture shape.py counts."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, RUN, "--recipe", R70B, "--dry-run", "--nodes", "8", "--num-processes", "64",
                           "--gpu", "H100-80GB"], env=env(), capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert "68,976,648,192 parameters (vocab 32,000)" in proc.stdout
    assert "pretrain-plan's best layout on 8 x 8 H100-80GB" in proc.stdout
    assert elapsed < 15, elapsed


def test_a_moved_key_stops_the_entry_point_with_one_message_naming_the_new_key(tmp_path):
    """An old recipe (train.eval_every_steps) and an old override each: exit 2, one line each, no traceback."""
    recipe = tmp_path / "foo.yaml"
    recipe.write_text(f"base: {TINY}\ntrain: {{eval_every_steps: 5}}\n")
    proc = subprocess.run([sys.executable, RUN, "--recipe", str(recipe), "--dry-run", "runtime.profile.start_step=2"],
                          env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr, proc.stderr
    assert f"train.eval_every_steps moved to eval.every_steps in pretrain 0.2: rename it in {recipe}" in proc.stderr
    proc = subprocess.run([sys.executable, RUN, "--recipe", TINY, "--dry-run", "train.log_every_steps=1"],
                          env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().endswith("train.log_every_steps moved to logging.every_steps in pretrain 0.2: rename it "
                                        "in the override 'train.log_every_steps=1' (logging.every_steps=1)")


@pytest.mark.parametrize("name, arch, num_params", [("qwen3-25m", "qwen3", 25_699_840), ("gemma-25m", "gemma", 24_125_952),
                                                    ("gpt-neox-25m", "gpt_neox", 27_315_200)])
def test_dry_run_of_architectures_beyond_llama_gives_parameters_memory_and_speed(capsys, name, arch, num_params):
    code, out, err = dry_run(capsys, "--recipe", str(ROOT / "recipes" / f"{name}.yaml"), "--dry-run", "--gpu", "H100-80GB")
    assert code == 0, err
    assert f"model            {arch}, {num_params:,} parameters (vocab 4,096)" in out
    assert "no estimate" not in out and re.search(r"total \(peak\)\s+\d+\.\d+", out), out
    assert re.search(r"speed +~[\d,]+ tokens/s per GPU", out) and "pretrain-plan    best of" in out, out


def test_dry_run_of_an_architecture_without_a_closed_form_measures_its_flops(capsys):
    """granite has no closed form; its matmuls are Llama's, so the measured FLOPs are the tiny Llama's formula."""
    from pretrain.recipe.shape import ModelShape

    code, out, err = dry_run(capsys, "--recipe", TINY, "--dry-run", "--gpu", "H100-80GB", "model.arch=granite")
    assert code == 0, err
    assert "model            granite, 1,377,408 parameters (vocab 4,096)" in out
    assert "memory           no estimate: model.arch = 'granite'" in out and "no memory estimate yet" in out
    llama = ModelShape.from_recipe(load_recipe(TINY)).flops_per_token(128).model_flops
    assert f"FLOPs/token      {llama:,.0f} (measured on the meta device, no closed form: the run logs MFU)" in out
