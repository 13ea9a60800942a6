"""tools/install.sh --wheelhouse / --offline: pretrain onto a machine without an index whose environment has torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FAST, ROOT, TINY, env
from tools.wheelhouse import stub_wheel

INSTALL = str(ROOT / "tools" / "install.sh")


def _run(cmd: list[str], cwd: Path, extra: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    # PYTHONPATH would put this checkout's pretrain in front of the installed one (and make pip take it as installed).
    return subprocess.run(cmd, cwd=cwd, env=env(PYTHONPATH=None, **(extra or {})), capture_output=True, text=True,
                          timeout=timeout)


def _air_gapped() -> dict:
    """pip as on a machine without an index: no configuration (this one's names an index and a wheel folder)."""
    return {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": None, "PIP_INDEX_URL": None, "PIP_EXTRA_INDEX_URL": None,
            "PIP_CONSTRAINT": None}


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin" / "python"


def _with_this_torch(python: Path) -> None:
    """This environment's torch (the CPU build install.sh put here) and what it requires, put into the fresh
    environment of ``python`` file by file where ``pip install torch`` puts them: hard links (seconds) where pip would
    unpack a wheel of several hundred MB. What the fresh environment already has of those (setuptools) is
    uninstalled first, as pip would upgrade it. A hard link is a file of the fresh environment's own: pip replacing
    or removing it there leaves this environment's file as it was."""
    import shutil
    from importlib.metadata import distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    names, todo = set(), ["torch"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name not in names:
            names.add(name)
            todo += [r.name for r in map(Requirement, distribution(name).requires or [])
                     if r.marker is None or r.marker.evaluate({"extra": ""})]
    site = python.parent.parent / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    present = {canonicalize_name(p.name.split("-")[0]) for p in site.glob("*.dist-info")}
    if names & present:
        out = _run([str(python), "-m", "pip", "uninstall", "-y", "-q", *sorted(names & present)], cwd=python.parent)
        assert out.returncode == 0, out.stderr
    for name in names:
        for file in distribution(name).files or []:
            if file.parts[0] == "..":  # console scripts (bin/torchrun): this environment's, not needed there
                continue
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(file.locate(), target)
            except OSError:  # another file system, or a file pip listed but did not keep
                if Path(file.locate()).is_file():
                    shutil.copy2(file.locate(), target)


def _torch_version(python: Path) -> str:
    out = _run([str(python), "-c", "from importlib.metadata import version; print(version('torch'))"], cwd=python.parent)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _offline_install(python: Path, wheelhouse: Path, *args: str) -> subprocess.CompletedProcess:
    return _run(["bash", INSTALL, "--offline", str(wheelhouse), *args], cwd=wheelhouse.parent,
                extra={"PYTHON": str(python), **_air_gapped()})


def test_the_offline_install_never_replaces_torch(tmp_path):
    """A wheelhouse whose pretrain wants another torch, which the wheelhouse also holds: the install fails and the
    environment's torch stays; plain pip, without install.sh's pin, would have swapped it."""
    python = _venv(tmp_path / "env")
    stub_wheel(tmp_path / "installed", "torch", "1.0")
    stub_wheel(tmp_path / "wheels", "torch", "9.0")
    stub_wheel(tmp_path / "wheels", "pretrain", "0.0.1", ("torch>=9",))
    setup = _run([str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(tmp_path / "installed"),
                  "torch==1.0"], cwd=tmp_path, extra=_air_gapped())
    assert setup.returncode == 0, setup.stderr

    refused = _offline_install(python, tmp_path / "wheels", "--extras", "")
    assert refused.returncode != 0
    assert "torch 1.0 is unchanged" in refused.stderr
    assert _torch_version(python) == "1.0"

    unpinned = _run([str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(tmp_path / "wheels"),
                     "pretrain"], cwd=tmp_path, extra=_air_gapped())
    assert unpinned.returncode == 0, unpinned.stderr
    assert _torch_version(python) == "9.0"


def test_the_offline_install_needs_torch_and_a_wheelhouse(tmp_path):
    python = _venv(tmp_path / "env")
    empty = _offline_install(python, tmp_path / "nothing")
    assert empty.returncode == 2 and "holds no pretrain wheel" in empty.stderr
    stub_wheel(tmp_path / "wheels", "pretrain", "0.0.1")
    no_torch = _offline_install(python, tmp_path / "wheels")
    assert no_torch.returncode == 2 and "has no torch" in no_torch.stderr


def test_a_stand_in_with_a_hyphenated_name_satisfies_a_requirement(tmp_path):
    """The wheelhouse's completeness check stands in for what the target has (e.g. the GPU image's py-cpuinfo,
    which deepspeed requires) with empty wheels: a hyphen in the file name would make pip read the project as
    "py" at version "cpuinfo" and fail the check, as it did on 2026-11-26."""
    stub_wheel(tmp_path / "wheels", "py-cpuinfo", "9.0.0")
    stub_wheel(tmp_path / "wheels", "needs-it", "1.0", ("py-cpuinfo",))
    out = _run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--no-index",
                "--target", str(tmp_path / "t"), "--find-links", str(tmp_path / "wheels"), "needs-it"],
               cwd=tmp_path, extra=_air_gapped())
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_a_wheelhouse_installs_offline_next_to_torch_and_trains(tmp_path):
    """docs/install.md's three commands: the wheelhouse (needs the index), then a fresh environment with torch installs
    from it alone and trains the tiny recipe with the installed pretrain."""
    wheelhouse = tmp_path / "wheels"
    built = _run(["bash", INSTALL, "--wheelhouse", str(wheelhouse)], cwd=tmp_path, extra={"PYTHON": sys.executable})
    if built.returncode != 0:
        pytest.fail("building the wheelhouse needs the package index (PyPI) reachable from this machine; pip said:\n"
                    + built.stderr[-3000:])
    wheels = sorted(p.name for p in wheelhouse.glob("*.whl"))
    assert any(w.startswith("pretrain-") for w in wheels) and any(w.startswith("deepspeed-") for w in wheels)
    assert not [w for w in wheels if w.startswith(("torch-", "triton-", "nvidia_cu"))], wheels

    python = _venv(tmp_path / "env")
    _with_this_torch(python)
    before = _torch_version(python)
    check = _run([str(python), "-m", "pip", "check"], cwd=tmp_path)  # torch and what it needs, as pip installs them
    assert check.returncode == 0, check.stdout + check.stderr

    installed = _offline_install(python, wheelhouse)
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert _torch_version(python) == before
    assert "liger left out" in installed.stdout  # a CPU torch brings no triton
    where = _run([str(python), "-c", "import deepspeed, datasets, wandb, tensorboard, pretrain; print(pretrain.__file__)"],
                 cwd=tmp_path)
    assert where.returncode == 0 and where.stdout.startswith(str(tmp_path / "env")), where.stderr[-2000:]

    train = _run([str(python.parent / "pretrain-train"), "--recipe", TINY, *FAST, "train.max_steps=3",
                  f"output_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    assert (tmp_path / "run" / "final_model" / "config.json").exists()


def test_what_the_target_has_is_left_out_of_the_wheelhouse(tmp_path):
    """--have: a package the target holds at a version that meets the requirement is not downloaded, nor what only
    it needs; one at a version too old, or absent, is. (A pip report in the shape `pip install --report` writes.)"""
    from tools.wheelhouse import needed_without_torch, read_have

    def item(name, version, *requires, extras=()):
        return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)},
                "requested_extras": list(extras)}

    report = {"environment": {}, "install": [
        item("pretrain", "0.1.0", "accelerate>=1.14", "pydantic>=2.7", "torch>=2.11",
             'deepspeed>=0.16.9; extra == "deepspeed"', extras=("deepspeed",)),
        item("accelerate", "1.15.0", "huggingface-hub>=0.21"), item("huggingface-hub", "1.33.0"),
        item("pydantic", "2.14.4", "pydantic-core==2.50.5"), item("pydantic-core", "2.50.5"),
        item("deepspeed", "0.19.8", "hjson", "torch"), item("hjson", "3.1.0"), item("torch", "2.11.0")]}
    have_file = tmp_path / "freeze.txt"
    have_file.write_text("# the image\naccelerate==1.15.0\npydantic==2.5.0\nhjson\n-e git+https://x#egg=y\n")
    have = read_have(have_file)
    assert have == {"accelerate": "1.15.0", "pydantic": "2.5.0", "hjson": None}
    assert needed_without_torch(report, "3.12", have) == {"pretrain": "0.1.0", "pydantic": "2.14.4",
                                                          "pydantic-core": "2.50.5", "deepspeed": "0.19.8"}
    assert set(needed_without_torch(report, "3.12")) == {"pretrain", "accelerate", "huggingface-hub", "pydantic",
                                                         "pydantic-core", "deepspeed", "hjson"}
