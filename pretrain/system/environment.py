"""The software environment a launch needs, checked before any process starts.

pyproject.toml is the one home of the version floors: its ``dependencies`` are what every run needs (the
core), its extras what some runs need (``deepspeed`` for a ZeRO layout, ``datasets`` for an ``hf:`` source,
``wandb`` for that backend, ``liger`` for ``model.loss: liger``). They are read from the installed package's
metadata (``importlib.metadata``), or from the checkout's pyproject.toml where pretrain runs from a checkout
on ``PYTHONPATH`` without being installed (an air-gapped GPU node often does). ``pip install -e .`` in an
environment that already holds an older accelerate says "requirement satisfied" only when it is; but a
package upgraded or downgraded later, or a checkout run from PYTHONPATH, meets nothing at install time, and
the crash would come inside N processes. Hence ``check_environment``: every problem at once, as one
ConfigError (exit 2) naming the package, the version found, the version needed and the command that fixes
it, from ``pretrain-launch``, ``--dry-run`` and ``pretrain/run.py`` before any process group, model or
GPU is touched.

A version meets its floor when its release numbers do (``2.11.0a0+nv25.06``, an NGC build, meets
``>=2.11``): clusters run vendor builds whose pre-release tag says nothing about their API.

The device, for launches that will use GPUs (not ``use_cpu`` / ``--cpu``): a machine whose driver shows
NVIDIA GPUs (``/proc/driver/nvidia/gpus``) where torch sees none would train on the CPU for hours without a
word: refused, naming torch's CUDA version (a torch built for a newer CUDA than the driver is the usual
cause) and ``CUDA_VISIBLE_DEVICES`` when it hides them; a CPU build of torch there, the same; a multi-process
GPU launch whose torch has no NCCL, refused. Machines without NVIDIA GPUs run GPU configs on the CPU, as
the test suite does on purpose (``accelerate_configs/cpu_ddp.yaml``).

Compiled ops: torch builds C++ extensions (DeepSpeed's ops: its CPU shared-memory collectives on a machine
without GPUs, its JIT CUDA ops) in ``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``, one
directory for every environment of the user: two virtual environments with another torch rebuild the op in turn
(about a minute each time, four on busy cores), each over the other's. Unless the user set it,
``use_environment_op_builds`` points it at a directory of this environment's own (its Python prefix and torch
version, under pretrain's cache directory), before anything is built: pretrain/run.py in every process,
pretrain-launch for what it starts, tools/install.sh where it builds the op at install, the test suite once.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pretrain.errors import ConfigError

if TYPE_CHECKING:
    from pretrain.recipe.config import Recipe


class Launch(Protocol):
    """What these checks read of a launch (distributed.layout.Launch, one layer up, has it)."""

    uses_deepspeed: bool
    zero_stage: int | None
    world_size: int

DISTRIBUTION = "pretrain"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
BUILD_FROM_SOURCE = {"deepspeed"}
"""Packages whose pip install must build against the installed torch (``--no-build-isolation``)."""


@dataclass(frozen=True)
class Requirement:
    package: str  # the distribution's name, as pip knows it
    floor: str | None  # the lowest version pyproject admits (None: any)
    extra: str | None  # None: core; else the extra that lists it

    def install_command(self) -> str:
        spec = f"{self.package}>={self.floor}" if self.floor else self.package
        isolation = " --no-build-isolation" if self.package in BUILD_FROM_SOURCE else ""
        return f"pip install{isolation} '{spec}'"


_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?:>=\s*([0-9][^,;\s]*))?")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def _parse(line: str, extra: str | None = None) -> Requirement | None:
    spec, _, marker = line.partition(";")
    match = _REQUIREMENT.match(spec)
    if match is None:
        return None
    found = _EXTRA.search(marker)
    return Requirement(_canonical(match.group(1)), match.group(2), found.group(1) if found else extra)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def requirements() -> tuple[Requirement, ...]:
    """pyproject's dependencies and extras (not ``dev`` nor ``all``, which only gathers the others)."""
    try:
        lines = metadata.requires(DISTRIBUTION) or []
        parsed = [_parse(line) for line in lines]
    except metadata.PackageNotFoundError:
        parsed = _from_pyproject()
    return tuple(r for r in parsed if r is not None and r.extra not in ("dev", "all") and r.package != DISTRIBUTION)


def _from_pyproject() -> list[Requirement | None]:
    if not PYPROJECT.is_file() or sys.version_info < (3, 11):
        return []  # neither installed nor a checkout with a readable pyproject (tomllib: 3.11+): nothing to check
    import tomllib

    project = tomllib.loads(PYPROJECT.read_text()).get("project", {})
    parsed = [_parse(line) for line in project.get("dependencies", [])]
    for extra, lines in project.get("optional-dependencies", {}).items():
        parsed += [_parse(line, extra) for line in lines]
    return parsed


def requirement(package: str) -> Requirement:
    for req in requirements():
        if req.package == _canonical(package):
            return req
    return Requirement(_canonical(package), None, None)


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string (2.11.0a0+nv25.06 -> (2, 11, 0)), trailing zeros dropped."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    numbers = [int(n) for n in match.group(1).split(".")] if match else [0]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def meets(version: str, floor: str | None) -> bool:
    return floor is None or _release(version) >= _release(floor)


def package_problem(req: Requirement, why: str, version_of=None) -> str | None:
    """One line when ``req`` is missing or below its floor, else None."""
    found = (version_of or installed_version)(req.package)
    if found is not None and meets(found, req.floor):
        return None
    needed = f">= {req.floor}" if req.floor else "any version"
    state = "is not installed" if found is None else f"{found} is installed"
    return f"{req.package} {state}; {why} needs {req.package} {needed}. Install it: {req.install_command()}"


def needed_extras(recipe: Recipe | None, launch: Launch | None) -> list[tuple[str, str]]:
    """(extra, the recipe key or launch that asks for it) for each optional part this run uses."""
    needed: list[tuple[str, str]] = []
    if launch is not None and launch.uses_deepspeed:
        needed.append(("deepspeed", f"the launch's DeepSpeed ZeRO-{launch.zero_stage}"))
    if recipe is not None:
        data = recipe.data
        sources = ([(f"data.mixture[{m.name}].source", m.source) for m in data.mixture]
                   or [("data.source", data.source)])
        hf = [f"{key} = {source!r}" for key, source in sources if source.startswith("hf:")]
        if hf:
            needed.append(("datasets", ", ".join(hf)))
        for backend in ("wandb", "tensorboard"):
            if backend in recipe.logging.backends:
                needed.append((backend, f"logging.backends: {backend}"))
        if recipe.model.loss == "liger":
            needed.append(("liger", "model.loss: liger"))
        if recipe.precision.float8 != "off":
            needed.append(("float8", f"precision.float8: {recipe.precision.float8}"))
    return needed


def extra_requirements(extra: str) -> list[Requirement]:
    return [req for req in requirements() if req.extra == extra]


def require(extra: str, feature: str) -> None:
    """Raise one ConfigError when ``extra``'s packages are missing or too old here: for a code path that needs
    them now (an hf: source read by pretrain-prepare-data, say)."""
    if problems := [p for req in extra_requirements(extra) if (p := package_problem(req, feature))]:
        raise ConfigError(_listed(problems) + f"\n{INSTALL_HINT}")


def install_command(package: str) -> str:
    return requirement(package).install_command()


TP_TRANSFORMERS = "5.23"
"""The transformers a tensor-parallel launch needs: the TP plan API pretrain/distributed/tensor_parallel.py calls
(``PreTrainedModel._resolve_parallel_plans``, ``apply_tensor_parallelism`` with a plan, the ``local_params``
style) came with 5.23; pyproject's floor (5.17) runs every other layout."""


EP_PACKAGES = (("transformers", "5.24"), ("accelerate", "1.15"))
"""What expert parallelism (model.moe.ep_size) needs: transformers' expert plan, expert mesh and all-to-all dispatch
(``transformers.distributed``: ``DistributedConfig(ep_size=...)``, ``initialize_distributed_mesh``,
``apply_expert_parallelism``) and accelerate's gradient clipping over parameters on two device meshes (the dense
part's and the experts'), as verified (tests/multiprocess/test_expert_parallel.py); the pyproject floors run every
other layout."""


def package_problems(recipe: Recipe | None, launch: Launch | None, version_of=None) -> list[str]:
    """Every core dependency below its floor or missing, every extra this run needs that is, and a transformers
    older than a feature of the launch needs (tensor parallelism: ``TP_TRANSFORMERS``; expert parallelism:
    ``EP_PACKAGES``)."""
    version_of = version_of or installed_version
    problems = [package_problem(req, "pretrain", version_of) for req in requirements() if req.extra is None]
    for extra, why in needed_extras(recipe, launch):
        problems += [package_problem(req, why, version_of) for req in extra_requirements(extra)]
    if launch is not None and launch.tp_size > 1 and not any(problems):
        problems.append(package_problem(Requirement("transformers", TP_TRANSFORMERS, None),
                                        f"tensor parallelism (the launch's tp_size {launch.tp_size})", version_of))
    moe = recipe.model.moe if recipe is not None else None
    ep_size = moe.ep_size if moe is not None else (launch.ep_size if launch is not None else 1)
    if ep_size > 1 and not any(problems):
        problems += [package_problem(Requirement(name, version, None), f"expert parallelism (model.moe.ep_size "
                                     f"{ep_size})", version_of) for name, version in EP_PACKAGES]
    return [p for p in problems if p]


@dataclass(frozen=True)
class DeviceFacts:
    """What the machine and torch say about GPUs (gathered by ``device_facts``; tests build their own)."""

    driver_gpus: int  # NVIDIA GPUs the driver lists (/proc/driver/nvidia/gpus)
    torch_version: str
    torch_cuda: str | None  # the CUDA torch was built for (None: a CPU build)
    cuda_available: bool
    nccl_available: bool
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES


def device_facts() -> DeviceFacts:
    import torch
    import torch.distributed as dist

    gpus = Path("/proc/driver/nvidia/gpus")
    driver_gpus = sum(1 for _ in gpus.iterdir()) if gpus.is_dir() else 0
    cuda = torch.version.cuda
    available = bool(cuda) and torch.cuda.is_available()
    nccl = dist.is_available() and dist.is_nccl_available()
    return DeviceFacts(driver_gpus, torch.__version__, cuda, available, nccl, os.environ.get("CUDA_VISIBLE_DEVICES"))


def device_problems(world_size: int, facts: DeviceFacts) -> list[str]:
    """A GPU launch's problems: GPUs torch cannot see, or several processes without NCCL."""
    problems = []
    if facts.driver_gpus and not facts.cuda_available:
        if facts.torch_cuda is None:
            problems.append(
                f"torch {facts.torch_version} is a CPU build, but this machine has {facts.driver_gpus} NVIDIA GPU(s): "
                "the run would train on the CPU. Install a CUDA build of torch (pip install torch, or the wheel for "
                "your CUDA from download.pytorch.org), or launch on CPUs on purpose (accelerate launch --cpu)")
        elif facts.visible_devices is not None and not facts.visible_devices.strip(" ,"):
            problems.append(
                f"CUDA_VISIBLE_DEVICES={facts.visible_devices!r} hides this machine's {facts.driver_gpus} GPU(s) from "
                "torch: unset it or name the GPUs (CUDA_VISIBLE_DEVICES=0,1), or launch on CPUs on purpose "
                "(accelerate launch --cpu)")
        else:
            hidden = (f"; CUDA_VISIBLE_DEVICES={facts.visible_devices!r} is set"
                      if facts.visible_devices is not None else "")
            problems.append(
                f"torch {facts.torch_version} (built for CUDA {facts.torch_cuda}) sees no GPU, but the driver lists "
                f"{facts.driver_gpus} NVIDIA GPU(s){hidden}: usually a driver older than that CUDA (nvidia-smi shows "
                "the driver's CUDA version). Install the torch build for the driver's CUDA, or update the driver")
    if facts.cuda_available and world_size > 1 and not facts.nccl_available:
        problems.append(
            f"torch {facts.torch_version} has no NCCL, which a {world_size}-process GPU launch communicates with: "
            "install a torch build with NCCL (the PyPI and download.pytorch.org Linux CUDA wheels have it)")
    return problems


def check_environment(recipe: Recipe | None, launch: Launch | None, *, gpu_launch: bool = False,
                      facts: DeviceFacts | None = None) -> None:
    """Raise one ConfigError listing every package and device problem of this run, before anything starts.

    ``gpu_launch``: the launch runs on GPUs where the machine has them (not ``--cpu`` / ``use_cpu``): the
    device is checked too."""
    problems = package_problems(recipe, launch)
    if problems:
        raise ConfigError(_listed(problems) + f"\n{INSTALL_HINT}")
    if gpu_launch:  # torch is imported only now that it is known to be there at its floor
        if problems := device_problems(launch.world_size if launch else 1, facts or device_facts()):
            raise ConfigError(problems)


INSTALL_HINT = ("(bash tools/install.sh installs pretrain with every optional package; on a node without a package "
                "index: bash tools/install.sh --offline DIR, docs/install.md, \"Air-gapped\")")


CACHE_ENV = "PRETRAIN_CACHE_DIR"
OP_BUILDS_ENV = "TORCH_EXTENSIONS_DIR"  # where torch.utils.cpp_extension builds (read at each build)
OP_BUILDS_DIR = "torch_extensions"


def cache_home(environ: dict[str, str] | os._Environ = os.environ) -> Path:
    """pretrain's cache directory apart from a recipe: ``$PRETRAIN_CACHE_DIR``, else ``~/.cache/pretrain`` (a recipe's
    data.cache_dir replaces it for its tokenizers and stores: pretrain/data/cache.py ``cache_root``)."""
    return Path(environ.get(CACHE_ENV) or "~/.cache/pretrain").expanduser().absolute()


def op_build_dir(environ: dict[str, str] | os._Environ = os.environ) -> Path:
    """This environment's own directory for compiled ops: ``<cache home>/torch_extensions/<the environment's
    directory name>-<8 hex digits of its Python prefix>-torch<version>``, e.g.
    ``~/.cache/pretrain/torch_extensions/venv-3f2a9c1e-torch2.13.0+cpu``."""
    prefix = Path(sys.prefix).resolve()
    key = hashlib.sha256(str(prefix).encode()).hexdigest()[:8]
    name = prefix.name.lstrip(".") or "python"
    return cache_home(environ) / OP_BUILDS_DIR / f"{name}-{key}-torch{installed_version('torch') or 'none'}"


def use_environment_op_builds(environ: dict[str, str] | os._Environ = os.environ) -> Path:
    """``TORCH_EXTENSIONS_DIR`` in ``environ`` (this process's, or the one a launcher passes on) set to
    ``op_build_dir()`` unless the user set it (theirs is kept); the directory in force. Call before DeepSpeed
    builds anything: torch reads it at each build."""
    if not environ.get(OP_BUILDS_ENV):
        environ[OP_BUILDS_ENV] = str(op_build_dir(environ))
    return Path(environ[OP_BUILDS_ENV])


def _listed(problems: list[str]) -> str:
    return str(ConfigError(problems))


def describe(packages: Iterable[str] = ("torch", "accelerate", "transformers", "deepspeed")) -> str:
    """``torch 2.13.0, accelerate 1.15.0, ...`` as installed (for banners and error reports)."""
    return ", ".join(f"{p} {installed_version(p) or 'absent'}" for p in packages)
