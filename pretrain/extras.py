"""The optional packages: which feature needs which, and the one error when a feature asked for lacks its package.

pretrain's core dependencies (pyproject.toml's ``dependencies``) import every module, run every command and train
on local data with jsonl logging on one process, DDP or FSDP. Each extra there is a package that only one feature
needs, so an air-gapped image that already has torch needs the fewest wheels (tools/install.sh --wheelhouse). No
module imports an optional package at module level; a recipe or launch that asks for a feature whose package is not
installed is refused by ``preflight.check_run`` before any process starts, naming the package to install, instead
of failing with an ImportError deep inside accelerate or datasets.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pretrain.errors import ConfigError

if TYPE_CHECKING:
    from pretrain.config import Recipe
    from pretrain.launch import Launch


@dataclass(frozen=True)
class Extra:
    module: str  # what is imported
    install: str  # the command that adds it to an environment with an index


# The keys are pyproject.toml's extras (tests/test_extras.py holds the two to the same names).
EXTRAS = {
    # DeepSpeed compiles its ops against the installed torch, hence no build isolation (tools/install.sh).
    "deepspeed": Extra("deepspeed", "pip install --no-build-isolation deepspeed"),
    "datasets": Extra("datasets", "pip install datasets"),
    "wandb": Extra("wandb", "pip install wandb"),
    # accelerate's tracker writes through torch.utils.tensorboard, which needs the tensorboard package.
    "tensorboard": Extra("tensorboard", "pip install tensorboard"),
    "liger": Extra("liger_kernel", "pip install liger-kernel"),
}
OFFLINE = "without an index: bash tools/install.sh --offline DIR (README: Install on an air-gapped machine)"


def installed(extra: str) -> bool:
    """Whether the extra's package can be imported here (found, not imported: importing deepspeed takes seconds)."""
    return importlib.util.find_spec(EXTRAS[extra].module) is not None


def missing_message(extra: str, feature: str) -> str | None:
    """The problem ``feature`` has here without ``extra``'s package (None: it is installed)."""
    if installed(extra):
        return None
    return (f"{feature} needs {EXTRAS[extra].module}, which is not installed: `{EXTRAS[extra].install}` (pretrain's "
            f"`{extra}` extra), or {OFFLINE}")


def require(extra: str, feature: str) -> None:
    """Raise the ConfigError ``missing_message`` describes: for a code path that needs the package at once."""
    message = missing_message(extra, feature)
    if message is not None:
        raise ConfigError(message)


def needed(recipe: Recipe, launch: Launch) -> dict[str, str]:
    """The extras this run asks for: {extra: the recipe key or launch that asks for it}. model.loss=liger is
    pretrain.loss's to judge (auto takes Liger only where it is installed)."""
    out: dict[str, str] = {}
    if launch.uses_deepspeed:
        out["deepspeed"] = "a DeepSpeed launch (the accelerate config's distributed_type: DEEPSPEED)"
    data = recipe.data
    sources = [(f"data.mixture[{m.name}].source", m.source) for m in data.mixture] or [("data.source", data.source)]
    hf = [f"{key} = {source!r}" for key, source in sources if source.startswith("hf:")]
    if hf:
        out["datasets"] = ", ".join(hf)
    for backend in ("wandb", "tensorboard"):
        if backend in recipe.logging.backends:
            out[backend] = f"logging.backends: [{backend}]"
    return out


def missing_packages(recipe: Recipe, launch: Launch) -> list[str]:
    """One problem per extra this run needs that is not installed here."""
    return [p for extra, feature in needed(recipe, launch).items() if (p := missing_message(extra, feature))]
