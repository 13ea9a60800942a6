"""The package's shape: what installs, what commands exist, how the entry point can be started."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
import zipfile

import pytest
import tomllib

from pretrain.cli import COMMANDS
from tests.helpers import ROOT, TINY, env

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_wheel_installs_pretrain_and_nothing_named_tools(tmp_path):
    """What `pip install .` puts in site-packages: the pretrain package, its metadata, no top-level tools; and
    setuptools has nothing to say about pyproject.toml (-v shows what a quiet install hides)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    build_log = proc.stdout + proc.stderr
    assert not re.search(r"deprecat|BuildBackendWarning|SetuptoolsWarning", build_log, re.IGNORECASE), build_log
    (wheel,) = tmp_path.glob("pretrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"pretrain", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, top_level
    assert "pretrain/run.py" in names and "pretrain/cli/launch.py" in names and "pretrain/data/__init__.py" in names


def test_no_sys_path_manipulation_in_the_product():
    offenders = [f"{path.relative_to(ROOT)}:{number}" for folder in ("pretrain", "tools")
                 for path in (ROOT / folder).rglob("*.py")
                 for number, line in enumerate(path.read_text().splitlines(), start=1) if "sys.path" in line]
    assert offenders == []


def test_no_module_beside_run_py_shadows_a_library():
    """`python pretrain/run.py` puts pretrain/ first on sys.path: a module there named like a library
    (once: pretrain/deepspeed.py) would be imported instead of it by every library that imports it."""
    names = {p.stem for p in (ROOT / "pretrain").glob("*.py") if not p.stem.startswith("__")}
    names |= {p.name for p in (ROOT / "pretrain").iterdir() if (p / "__init__.py").is_file()}
    code = ("import importlib.util, json, sys; sys.path = [p for p in sys.path if p not in ('', '.')]; "
            f"print(json.dumps([n for n in {sorted(names)!r} if n in sys.stdlib_module_names "
            "or importlib.util.find_spec(n) is not None]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"modules in pretrain/ that shadow a library: {proc.stdout}"


@pytest.mark.parametrize("script,target", sorted(PYPROJECT["project"]["scripts"].items()))
def test_every_console_script_names_a_main_function(script, target):
    module, function = target.split(":")
    assert callable(getattr(importlib.import_module(module), function)), script


def test_one_entry_point_lists_and_dispatches_every_command(capsys):
    from pretrain.cli import COMMANDS, main

    for name, (module, _) in COMMANDS.items():
        assert callable(importlib.import_module(module).main), name
    assert main([]) == 2
    listing = capsys.readouterr().out
    assert all(name in listing for name in COMMANDS)
    assert main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
    assert main(["train", "--recipe", TINY, "--print-config"]) == 0
    assert "name: tiny" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("form", ["script", "module"])
def test_accelerate_launch_starts_the_entry_point_as_a_script_or_a_module(form):
    run = [str(ROOT / "pretrain" / "run.py")] if form == "script" else ["-m", "pretrain.run"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu.yaml"), *run, "--recipe", TINY, "--dry-run"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "batch plan       world 1: GBS 32 = MBS 16 x GAS 2 x world 1" in proc.stdout


@pytest.mark.parametrize("name", [n for n in COMMANDS if n != "train"])
def test_each_command_names_itself_in_its_usage(name, capsys, monkeypatch):
    """`--help` says `pretrain-<name>` whatever the process is called (the sweep's once said sweep_batch_size).
    `train` is left out: pretrain/run.py, pretrain-train and `pretrain train` all start it, and its usage
    names the one used."""
    monkeypatch.setattr(sys, "argv", ["some_module.py"])
    try:
        code = importlib.import_module(COMMANDS[name][0]).main(["--help"])
    except SystemExit as exc:  # argparse's --help
        code = exc.code
    out = capsys.readouterr().out
    assert code == 0 and f"pretrain-{name}" in out.split("\n\n")[0] and "some_module" not in out, out[:300]
    assert f'pretrain-{name} = "{COMMANDS[name][0]}:main"' in (ROOT / "pyproject.toml").read_text()


def test_the_training_entry_does_not_load_the_planner():
    """pretrain/run.py parses and checks a training launch without importing the dry run, the planner or the
    estimator (imported when --dry-run asks); ``--help`` still lists the dry run's options."""
    code = ("import sys; from pretrain import run; args = run.parse_args(['--recipe', 'recipes/tiny.yaml']); "
            "run.check_options(args); "
            "print(sorted(m for m in sys.modules if m.startswith(('pretrain.plan', 'pretrain.cli.dry_run'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    helped = subprocess.run([sys.executable, "-m", "pretrain.run", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert "--num-processes" in helped.stdout and "--gpu-memory-gib" in helped.stdout
