"""Only the core dependencies are required: an optional package is needed only by the feature that asks for it."""

from __future__ import annotations

import sys

import pytest

import pretrain.extras as extras
from pretrain.config import load_recipe
from pretrain.errors import ConfigError
from pretrain.launch import Launch
from pretrain.preflight import check_run
from tests.helpers import FAST, ROOT, RUN, TINY, run_cmd

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OPTIONAL_MODULES = sorted(extra.module for extra in extras.EXTRAS.values())


def test_pyprojects_extras_are_the_tables():
    optional = PYPROJECT["optional-dependencies"]
    assert set(optional) - {"all", "dev"} == set(extras.EXTRAS)
    assert optional["all"] == [f"pretrain[{','.join(extras.EXTRAS)}]"]
    core = " ".join(PYPROJECT["dependencies"]).replace("_", "-")
    for name in extras.EXTRAS:
        package = optional[name][0].split(">")[0]
        assert package not in core, f"{package} is both a core dependency and the {name} extra"
        assert package in extras.EXTRAS[name].install


def test_a_run_that_needs_missing_packages_is_refused_naming_each(monkeypatch):
    monkeypatch.setattr(extras, "installed", lambda extra: False)
    recipe = load_recipe(TINY, ["logging.backends=[jsonl,wandb,tensorboard]", "data.source=hf:org/corpus"])
    with pytest.raises(ConfigError) as exc:
        check_run(recipe, Launch("deepspeed", zero_stage=2))
    message = str(exc.value)
    assert message.startswith("4 problems:")
    for feature, install in [("a DeepSpeed launch", "pip install --no-build-isolation deepspeed"),
                             ("data.source = 'hf:org/corpus'", "pip install datasets"),
                             ("logging.backends: [wandb]", "pip install wandb"),
                             ("logging.backends: [tensorboard]", "pip install tensorboard")]:
        assert f"{feature}" in message and f"`{install}`" in message
    check_run(recipe, Launch("deepspeed", zero_stage=2), packages=False)  # the dry run plans for other machines


def test_a_mixtures_hf_sources_are_named(monkeypatch):
    monkeypatch.setattr(extras, "installed", lambda extra: extra != "datasets")
    recipe = load_recipe(ROOT / "recipes" / "mixture-tiny.yaml", [
        "data.mixture=[{name: code, source: 'stdlib:json', weight: 1}, {name: web, source: 'hf:org/web', weight: 1}]"])
    assert extras.needed(recipe, Launch()) == {"datasets": "data.mixture[web].source = 'hf:org/web'"}
    with pytest.raises(ConfigError, match=r"data.mixture\[web\].source = 'hf:org/web' needs datasets"):
        check_run(recipe, Launch())


def test_the_tiny_recipe_needs_no_optional_package(monkeypatch):
    monkeypatch.setattr(extras, "installed", lambda extra: False)
    assert extras.needed(load_recipe(TINY), Launch("fsdp", gpus_per_node=2)) == {}
    check_run(load_recipe(TINY), Launch())


# Run in a fresh interpreter where the optional packages cannot be imported: sys.modules[name] = None makes
# `import name` raise ImportError and importlib.util.find_spec(name) return None, as when it is not installed.
HIDE = f"import sys\nfor name in {OPTIONAL_MODULES!r}: sys.modules[name] = None\n"


def _without_optional_packages(code: str):
    return run_cmd([sys.executable, "-c", HIDE + code], timeout=600)


@pytest.mark.slow
def test_every_module_imports_and_the_tiny_recipe_trains_without_optional_packages(tmp_path):
    imports = _without_optional_packages(
        "import importlib, pkgutil, pretrain\n"
        "for m in pkgutil.walk_packages(pretrain.__path__, 'pretrain.'):\n"
        "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
        f"assert not any(sys.modules.get(n) for n in {OPTIONAL_MODULES!r})\n")
    assert imports.returncode == 0, imports.stderr
    train = f"import runpy\nsys.argv = {[RUN, '--recipe', TINY, *FAST, 'train.max_steps=2', f'output_dir={tmp_path}']!r}\n"
    trained = _without_optional_packages(train + f"runpy.run_path({RUN!r}, run_name='__main__')")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (tmp_path / "final_model" / "config.json").exists()
    refused = _without_optional_packages(train.replace("train.max_steps=2", "logging.backends=[wandb]")
                                         + f"runpy.run_path({RUN!r}, run_name='__main__')")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "logging.backends: [wandb] needs wandb, which is not installed: `pip install wandb`" in refused.stderr
