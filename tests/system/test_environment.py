"""The environment check (pretrain/system/environment.py): floors from pyproject, the packages a run needs, the
device, and the refusal before any process starts, in an environment that really lacks the optional packages."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.recipe.config import load_recipe
from pretrain.system import environment
from pretrain.system.environment import DeviceFacts, check_environment, device_problems, meets, package_problems
from tests.helpers import FAST, env
from tests.helpers import ROOT as REPO

pytestmark = pytest.mark.floors  # also in CI's minimum-versions smoke set

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
OPTIONAL = ("deepspeed", "datasets", "wandb", "tensorboard", "liger-kernel", "torchao")


def versions(**found: str):
    """A version_of that knows the core packages at their floors plus ``found``."""
    table = {r.package: r.floor or "1" for r in environment.requirements() if r.extra is None}
    table.update({k.replace("_", "-"): v for k, v in found.items()})
    return lambda package: table.get(package)


def test_floors_come_from_pyproject_core_and_extras():
    reqs = {r.package: r for r in environment.requirements()}
    core = {line.split(">=")[0].strip() for line in PYPROJECT["dependencies"]}
    assert {p for p, r in reqs.items() if r.extra is None} == core
    for extra, lines in PYPROJECT["optional-dependencies"].items():
        if extra in ("dev", "all"):
            continue
        for line in lines:
            name, floor = (part.strip() for part in line.split(">="))
            assert reqs[name].extra == extra and reqs[name].floor == floor
    # The optional packages are optional: none of them is a core dependency.
    assert not core & set(OPTIONAL)
    for extra, _ in environment.needed_extras(load_recipe("recipes/tiny.yaml", [
            "data.source=hf:wikitext", "logging.backends=[wandb]", "model.loss=liger", "precision.float8=rowwise"]),
            Launch("deepspeed", 2)):
        assert extra in PYPROJECT["optional-dependencies"], extra


@pytest.mark.parametrize("version, floor, ok", [
    ("2.11.0", "2.11", True), ("2.11.0+cu130", "2.11", True), ("2.11.0a0+nv25.06", "2.11", True),
    ("2.10.1", "2.11", False), ("5.17.0", "5.17", True), ("5.9.0", "5.17", False), ("1.14.0.dev0", "1.14", True),
    ("0.19.8", "0.16.9", True), ("0.16.4", "0.16.9", False), ("anything", None, True),
])
def test_a_version_meets_its_floor_by_its_release_numbers(version, floor, ok):
    assert meets(version, floor) is ok


def test_a_zero_launch_without_deepspeed_names_it_the_version_and_the_command():
    ds = environment.requirement("deepspeed")
    problems = package_problems(None, Launch("deepspeed", 2), version_of=versions())
    assert problems == [f"deepspeed is not installed; the launch's DeepSpeed ZeRO-2 needs deepspeed >= {ds.floor}. "
                        f"Install it: pip install --no-build-isolation 'deepspeed>={ds.floor}'"]
    old = package_problems(None, Launch("deepspeed", 2), version_of=versions(deepspeed="0.1.0"))
    assert old and old[0].startswith("deepspeed 0.1.0 is installed; ")
    # DDP and FSDP need no DeepSpeed, one process neither.
    assert package_problems(None, Launch("ddp"), version_of=versions()) == []
    assert package_problems(None, Launch("fsdp"), version_of=versions()) == []


def test_a_tensor_parallel_launch_needs_the_transformers_of_its_plan_api():
    """TP calls transformers' plan API of 5.23 (pyproject's floor, 5.17, lacks it): a TP launch on an older
    transformers is refused before anything starts, with the version and the command; other layouts run on 5.17.
    With the installed transformers (5.17 in CI's floors set), the check refuses exactly when it is older."""
    from pretrain.system.environment import TP_TRANSFORMERS, installed_version

    tp = Launch("fsdp", gpus_per_node=4, tp_size=2)
    [problem] = package_problems(None, tp, version_of=versions(transformers="5.17.0"))
    assert problem == (f"transformers 5.17.0 is installed; tensor parallelism (the launch's tp_size 2) needs "
                       f"transformers >= {TP_TRANSFORMERS}. Install it: pip install 'transformers>={TP_TRANSFORMERS}'")
    assert package_problems(None, tp, version_of=versions(transformers=TP_TRANSFORMERS)) == []
    assert package_problems(None, Launch("fsdp", gpus_per_node=4), version_of=versions(transformers="5.17.0")) == []
    old = not meets(installed_version("transformers"), TP_TRANSFORMERS)
    if old:
        with pytest.raises(ConfigError, match="tensor parallelism"):
            check_environment(None, tp)
    else:
        check_environment(None, tp)


def test_a_core_package_below_its_floor_is_refused_whatever_the_run():
    torch = environment.requirement("torch")
    [problem] = package_problems(None, None, version_of=versions(torch="2.1.0"))
    assert problem.startswith(f"torch 2.1.0 is installed; pretrain needs torch >= {torch.floor}. ")


def test_the_recipe_asks_for_datasets_wandb_and_liger_only_when_it_uses_them():
    tiny = load_recipe("recipes/tiny.yaml", [])
    assert package_problems(tiny, Launch(), version_of=versions()) == []
    recipe = load_recipe("recipes/tiny.yaml", ["data.source=hf:wikitext", "logging.backends=[jsonl, wandb]",
                                               "model.loss=liger"])
    problems = package_problems(recipe, Launch(), version_of=versions())
    assert [p.split(" ")[0] for p in problems] == ["datasets", "wandb", "liger-kernel"]
    assert "data.source = 'hf:wikitext' needs datasets" in problems[0]
    assert "model.loss: liger needs liger-kernel" in problems[2]


def test_one_error_lists_every_problem_and_how_to_install_everything(monkeypatch):
    monkeypatch.setattr(environment, "installed_version", versions())
    with pytest.raises(ConfigError) as err:
        check_environment(load_recipe("recipes/tiny.yaml", ["logging.backends=[wandb]"]), Launch("deepspeed", 2))
    text = str(err.value)
    assert text.startswith("2 problems:\n  - deepspeed is not installed; ") and "\n  - wandb is not installed" in text
    assert text.endswith(environment.INSTALL_HINT)


def test_a_mixtures_hf_sources_are_named_each():
    recipe = load_recipe(REPO / "recipes" / "mixture-tiny.yaml", [
        "data.mixture=[{name: code, source: 'stdlib:json', weight: 1}, {name: web, source: 'hf:org/web', weight: 1}]"])
    assert environment.needed_extras(recipe, Launch()) == [("datasets", "data.mixture[web].source = 'hf:org/web'")]
    assert environment.needed_extras(load_recipe("recipes/tiny.yaml", []), Launch("fsdp", gpus_per_node=2)) == []


def test_a_code_path_that_needs_an_extra_now_refuses_with_the_install(monkeypatch):
    monkeypatch.setattr(environment, "installed_version", versions())
    with pytest.raises(ConfigError, match=r"datasets is not installed; data.source = 'hf:x' needs datasets >= "):
        environment.require("datasets", "data.source = 'hf:x'")


CPU_MACHINE = DeviceFacts(driver_gpus=0, torch_version="2.11.0+cu130", torch_cuda="13.0", cuda_available=False,
                          nccl_available=True, visible_devices=None)


def test_a_gpu_config_on_a_machine_without_gpus_runs_on_the_cpu():
    assert device_problems(2, CPU_MACHINE) == []  # cpu_ddp.yaml on a laptop, the test suite's own launches


def test_gpus_that_torch_cannot_see_are_refused_with_the_likely_cause():
    driver_too_old = CPU_MACHINE.__class__(**{**CPU_MACHINE.__dict__, "driver_gpus": 8})
    [problem] = device_problems(8, driver_too_old)
    assert "torch 2.11.0+cu130 (built for CUDA 13.0) sees no GPU, but the driver lists 8 NVIDIA GPU(s)" in problem
    assert "driver older than that CUDA" in problem
    cpu_build = DeviceFacts(8, "2.11.0+cpu", None, False, False, None)
    assert "is a CPU build, but this machine has 8 NVIDIA GPU(s)" in device_problems(1, cpu_build)[0]
    hidden = DeviceFacts(8, "2.11.0+cu130", "13.0", False, True, "")
    assert "CUDA_VISIBLE_DEVICES='' hides this machine's 8 GPU(s)" in device_problems(1, hidden)[0]


def test_a_multi_gpu_launch_without_nccl_is_refused():
    no_nccl = DeviceFacts(8, "2.11.0+cu130", "13.0", True, False, None)
    assert "has no NCCL" in device_problems(8, no_nccl)[0]
    assert device_problems(1, no_nccl) == []  # one process needs no collectives


# --- an environment without the optional packages, for real ------------------------------------------


@pytest.fixture(scope="module")
def core_only(tmp_path_factory) -> dict[str, str]:
    """This interpreter's site-packages without deepspeed, datasets, wandb and liger-kernel: a directory of
    links to every other entry, run with ``python -S`` (no site) and PYTHONPATH = that directory + the
    checkout. Imports of the missing packages fail as they would where they were never installed, and
    importlib.metadata does not find them."""
    import site

    source = Path(next(p for p in site.getsitepackages() if Path(p, "torch").is_dir()))
    hidden = ("deepspeed", "datasets", "wandb", "tensorboard", "liger_kernel", "liger-kernel")
    target = tmp_path_factory.mktemp("core_only")
    for entry in source.iterdir():
        name = entry.name.lower()
        if any(name == h or name.startswith((f"{h}-", f"{h}.")) for h in hidden) or name.endswith(".pth"):
            continue
        (target / entry.name).symlink_to(entry)
    variables = env(PYTHONPATH=f"{target}{os.pathsep}{REPO}")
    probe = subprocess.run([sys.executable, "-S", "-c", "import importlib.util as u, torch, accelerate, pretrain; "
                            "print([m for m in ('deepspeed', 'datasets', 'wandb', 'tensorboard', 'liger_kernel') if u.find_spec(m)])"],
                           env=variables, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stdout + probe.stderr
    return variables


@pytest.mark.slow
def test_a_zero_launch_without_deepspeed_exits_2_in_seconds_naming_the_install(core_only):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-S", "-m", "pretrain.cli.launch", "--config_file",
                           "accelerate_configs/zero2.yaml", "--recipe", "recipes/tiny.yaml"],
                          env=core_only, capture_output=True, text=True, timeout=60, cwd=REPO)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "deepspeed is not installed; the launch's DeepSpeed ZeRO-2 needs deepspeed >= " in proc.stderr
    assert "pip install --no-build-isolation 'deepspeed>=" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert elapsed < 5, f"{elapsed:.1f} s"


@pytest.mark.slow
def test_every_module_imports_without_the_optional_packages(core_only):
    proc = subprocess.run([sys.executable, "-S", "-c", "import importlib, pkgutil, sys, pretrain\n"
                           "for m in pkgutil.walk_packages(pretrain.__path__, 'pretrain.'):\n"
                           "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"],
                          env=core_only, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_the_tiny_recipe_trains_without_the_optional_packages(core_only, tmp_path):
    proc = subprocess.run([sys.executable, "-S", "pretrain/run.py", "--recipe", "recipes/tiny.yaml", *FAST,
                           f"output_dir={tmp_path / 'run'}", "train.max_steps=3", "eval.every_steps=3",
                           "eval.batches=1", "checkpoint.every_steps=3"],
                          env={**core_only, "PRETRAIN_CACHE_DIR": str(tmp_path / "cache")},  # the store built too
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "run" / "final_model" / "config.json").is_file()
    assert (tmp_path / "run" / "checkpoints" / "step_00000003" / "manifest.json").is_file()
    refused = subprocess.run([sys.executable, "-S", "pretrain/run.py", "--recipe", "recipes/tiny.yaml",
                              f"output_dir={tmp_path / 'refused'}", "logging.backends=[jsonl, wandb]"],
                             env=core_only, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "wandb is not installed; logging.backends: wandb needs wandb >= " in refused.stderr
    assert not (tmp_path / "refused").exists()  # refused before anything was written


# ---- DeepSpeed's compiled ops: a directory per environment -------------------------------------------------------
def test_each_environment_builds_its_ops_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """Issue 36: torch builds DeepSpeed's CPU op in ~/.cache/torch_extensions, one directory for every environment of
    the user, so two environments with another torch rebuilt it in turn. Keyed by the Python prefix and the torch
    version, under pretrain's cache directory; the same environment always gets the same one; the user's
    TORCH_EXTENSIONS_DIR is kept."""
    from pretrain.system.environment import OP_BUILDS_ENV, op_build_dir, use_environment_op_builds

    cache = {"PRETRAIN_CACHE_DIR": str(tmp_path / "cache")}
    here = op_build_dir(cache)
    assert here == op_build_dir(dict(cache)) and here.parent == tmp_path / "cache" / "torch_extensions"
    assert here.name.endswith(f"-torch{environment.installed_version('torch')}")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other-venv"))
    other_venv = op_build_dir(cache)
    monkeypatch.setattr(environment, "installed_version", lambda package: "0.0.1")  # no torch the floors install
    other_torch = op_build_dir(cache)
    assert len({here, other_venv, other_torch}) == 3 and other_venv.name.startswith("other-venv-")
    assert op_build_dir({}).parent == Path("~/.cache/pretrain/torch_extensions").expanduser().absolute()

    environ = dict(cache)
    assert use_environment_op_builds(environ) == other_torch and environ[OP_BUILDS_ENV] == str(other_torch)
    mine = {**cache, OP_BUILDS_ENV: str(tmp_path / "mine")}
    assert use_environment_op_builds(mine) == tmp_path / "mine" and mine[OP_BUILDS_ENV] == str(tmp_path / "mine")


def test_the_run_and_pretrain_launch_set_it_before_anything_is_built(tmp_path, monkeypatch, capsys):
    """pretrain/run.py sets it in every process before the trainer exists (DeepSpeed builds its op when the
    accelerator starts); pretrain-launch in the environment of what it starts (the doctor, accelerate launch and
    the workers), leaving its own alone."""
    from pretrain import run
    from pretrain.cli import launch as launch_cli
    from pretrain.system.environment import OP_BUILDS_ENV, op_build_dir
    from pretrain.train import trainer
    from pretrain.trust import FORCE_ENV
    from tests.helpers import TINY

    for name in (FORCE_ENV, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", OP_BUILDS_ENV):  # what main() sets: undone after
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    monkeypatch.setenv("PRETRAIN_CACHE_DIR", str(tmp_path / "cache"))
    expected = str(op_build_dir())

    seen = []

    class Trainer:
        interrupted = False

        def __init__(self, *args, **kwargs):
            seen.append(os.environ.get(OP_BUILDS_ENV))

        def train(self):
            pass

    monkeypatch.setattr(trainer, "Trainer", Trainer)
    assert run.main(["--recipe", TINY, *FAST, f"output_dir={tmp_path / 'run'}"]) == 0
    assert seen == [expected]

    monkeypatch.delenv(OP_BUILDS_ENV)
    started = []
    monkeypatch.setattr(launch_cli, "run_launcher", lambda argv, environment: started.append(environment) or 0)
    config = ["--config_file", str(REPO / "accelerate_configs" / "zero2.yaml"), "--num_processes", "2"]
    assert launch_cli.main([*config, "--recipe", TINY, *FAST]) == 0
    assert started[0][OP_BUILDS_ENV] == expected and OP_BUILDS_ENV not in os.environ
    monkeypatch.setenv(OP_BUILDS_ENV, str(tmp_path / "mine"))
    assert launch_cli.main([*config, "--recipe", TINY, *FAST]) == 0
    assert started[1][OP_BUILDS_ENV] == str(tmp_path / "mine")
    capsys.readouterr()


def test_the_suite_builds_the_ops_once_in_one_directory_whatever_cache_a_test_gives(tmp_path):
    """tests/conftest.py: every process the tests start finds DeepSpeed's op in the one directory of this environment
    (built once, as tools/install.sh builds it), also a run given a cache of its own: none rebuilds it (a minute)."""
    from pretrain.system.environment import OP_BUILDS_ENV, op_build_dir
    from tests.helpers import SUITE_CACHE

    suite = env()[OP_BUILDS_ENV]
    assert env(PRETRAIN_CACHE_DIR=str(tmp_path / "cache"))[OP_BUILDS_ENV] == suite
    if suite.startswith(str(SUITE_CACHE)):  # set by the conftest (not the user's own), as the README and CI run it
        assert suite == str(op_build_dir({"PRETRAIN_CACHE_DIR": str(SUITE_CACHE)}))


def test_an_expert_parallel_run_needs_the_transformers_and_accelerate_it_was_verified_with():
    """model.moe.ep_size calls transformers' expert plan and mesh (transformers.distributed) and accelerate's clipping
    over two device meshes: on older packages the run is refused before anything starts, naming both versions; the
    same recipe without EP runs on the floors. With the installed packages the check refuses exactly when older."""
    from pretrain.system.environment import EP_PACKAGES, installed_version
    from tests.helpers import make_recipe

    moe = ["model.arch=olmoe", "model.intermediate_size=null",
           "model.moe={num_experts: 4, experts_per_token: 2, expert_intermediate_size: 64}"]
    ep, plain = make_recipe(*moe, "model.moe.ep_size=2"), make_recipe(*moe)
    fsdp = Launch("fsdp", gpus_per_node=4)
    (_, transformers), (_, accelerate) = EP_PACKAGES
    [problem] = package_problems(ep, fsdp, version_of=versions(transformers="5.17.0", accelerate=accelerate))
    assert problem == (f"transformers 5.17.0 is installed; expert parallelism (model.moe.ep_size 2) needs transformers "
                       f">= {transformers}. Install it: pip install 'transformers>={transformers}'")
    [problem] = package_problems(ep, fsdp, version_of=versions(transformers=transformers, accelerate="1.14.0"))
    assert problem.startswith(f"accelerate 1.14.0 is installed; expert parallelism (model.moe.ep_size 2) needs "
                              f"accelerate >= {accelerate}.")
    assert package_problems(ep, fsdp, version_of=versions(transformers=transformers, accelerate=accelerate)) == []
    assert package_problems(plain, fsdp, version_of=versions(transformers="5.17.0", accelerate="1.14.0")) == []
    if any(not meets(installed_version(name), version) for name, version in EP_PACKAGES):
        with pytest.raises(ConfigError, match="expert parallelism"):
            check_environment(ep, fsdp)
    else:
        check_environment(ep, fsdp)
