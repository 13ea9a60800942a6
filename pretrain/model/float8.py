"""float8 training of the Linear layers (``precision.float8``) with torchao's own ``convert_to_float8_training``.

Why torchao directly and not accelerate's torchao backend (``mixed_precision="fp8"`` + ``AORecipeKwargs``):

- pretrain shards FSDP2 on the meta device, before ``accelerator.prepare`` (``accelerator.shard_fsdp2``), and
  accelerate converts in ``prepare`` (``_prepare_ao``): after ``fully_shard``, where torchao's float8 all-gather
  (``enable_fsdp_float8_all_gather``, whose weight wrapper must exist when FSDP2 shards) cannot be set up. Here the
  Linear layers are swapped on the meta model, before sharding, as torchtitan's float8 converter does.
- ``mixed_precision="fp8"`` replaces the recipe's ``bf16`` in accelerate's state: pretrain's FSDP mixed-precision
  policy (``precision.reduce_dtype``) and the run record read that one flag; here the run stays a bf16 (or fp32)
  run whose Linear matmuls are float8.
- accelerate on a GPU below compute capability 8.9 silently trains in fp16 instead; pretrain refuses
  (``check_float8``).
After the optimizer step, FSDP2 + tensorwise runs torchao's ``precompute_float8_dynamic_scale_for_fsdp`` (one
all-reduce for every weight's scale instead of one per weight), as accelerate's and torchtitan's paths do.

The swap keeps every module name and parameter (``Float8Linear`` is an ``nn.Linear`` with the same ``weight`` and
``bias``): checkpoints have the keys of a bf16 run, resume and export read them unchanged, and the exported model is
plain Linear layers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch

from pretrain.errors import ConfigError
from pretrain.system import quiet

# Hopper (9.0) and Ada (8.9) have float8 tensor cores; torch's float8 matmul (torch._scaled_mm) needs one.
MIN_CAPABILITY = (8, 9)


def check_float8(recipe, launch, cuda_device: tuple[str, tuple[int, int]] | None) -> None:
    """One ConfigError where ``precision.float8`` cannot run on ``launch``: a DeepSpeed layout, no torchao, or a
    CUDA device (name, compute capability) below 8.9. ``cuda_device`` None: no CUDA (emulated on CPU)."""
    mode = recipe.precision.float8
    if mode == "off":
        return
    if launch.uses_deepspeed:
        raise ConfigError(
            f"precision.float8={mode} runs under one process, DDP and FSDP2, not under DeepSpeed (ZeRO-{launch.zero_stage} "
            "does not take torchao's Float8Linear weights); use accelerate_configs/fsdp.yaml (FSDP2) or set "
            "precision.float8=off"
        )
    # torchao is checked with every other package by pretrain/system/environment.py (the float8 extra, from the
    # installed metadata); this is the run's own check, for an environment whose metadata predates the extra.
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"precision.float8={mode} needs torchao, which is not installed: pip install "
                          "'pretrain[float8]' (or pip install 'torchao>=0.18'; tools/install.sh --extras float8)")
    if cuda_device is not None:
        check_capability(mode, *cuda_device)


def check_capability(mode: str, name: str, capability: tuple[int, int]) -> None:
    if tuple(capability) < MIN_CAPABILITY:
        raise ConfigError(
            f"precision.float8={mode} needs a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or above "
            f"(H100, H200, L40S, RTX 4090: float8 tensor cores); this {name} has capability "
            f"{capability[0]}.{capability[1]}; set precision.float8=off"
        )


def cuda_device() -> tuple[str, tuple[int, int]] | None:
    """This process's GPU 0 (name, compute capability), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0))


@dataclass
class Float8Report:
    """What ``convert`` did, for the log and the run record."""

    recipe: str
    emulated: bool
    fsdp_float8_all_gather: bool
    converted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # matched precision.float8_skip
    unaligned: list[str] = field(default_factory=list)  # a dimension not a multiple of 16

    def record(self) -> dict:
        return {"recipe": self.recipe, "emulated": self.emulated,
                "fsdp_float8_all_gather": self.fsdp_float8_all_gather, "num_converted": len(self.converted),
                "skipped": self.skipped, "num_unaligned": len(self.unaligned)}

    def line(self) -> str:
        how = "emulated on CPU (for tests only: no float8 matmul, no speed-up)" if self.emulated else "float8 matmuls"
        gather = ", FSDP2 all-gathers weights in float8" if self.fsdp_float8_all_gather else ""
        return (f"float8: {self.recipe}, {len(self.converted)} Linear layers converted, {len(self.skipped)} left in "
                f"high precision by precision.float8_skip ({', '.join(self.skipped) or 'none'}), "
                f"{len(self.unaligned)} left out (dimensions not multiples of 16); {how}{gather}")


def _skipped(name: str, patterns: list[str]) -> bool:
    return any(fnmatchcase(name, p) or fnmatchcase(name, "*." + p) for p in patterns)


def convert(model: torch.nn.Module, precision, *, emulate: bool, fsdp2: bool) -> Float8Report:
    """Swap the model's Linear layers for torchao's Float8Linear in place (on the meta model, before FSDP2 shards it:
    ``build_model``'s ``convert``), except those precision.float8_skip names and those torchao cannot take."""
    quiet.drop_torchao_import_messages()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(precision.float8)
    # The float8 all-gather exists for tensorwise scaling only (torchao: rowwise scales are per row of the full
    # weight, which a shard does not have).
    gather = fsdp2 and precision.float8 == "tensorwise"
    config = dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=gather)
    report = Float8Report(precision.float8, emulate, gather)

    def take(module: torch.nn.Module, name: str) -> bool:
        if not isinstance(module, torch.nn.Linear):
            return True  # a parent: torchao recurses into it
        if _skipped(name, precision.float8_skip):
            report.skipped.append(name)
            return False
        if module.in_features % 16 or module.out_features % 16:
            report.unaligned.append(name)
            return False
        report.converted.append(name)
        return True

    convert_to_float8_training(model, module_filter_fn=take, config=config)
    return report


def after_optimizer_step(model: torch.nn.Module, report: Float8Report | None) -> None:
    """FSDP2 + tensorwise: every float8 weight's scale from one all-reduce of the new weights' amaxes, for the next
    forward's float8 all-gather (torchao's ``precompute_float8_dynamic_scale_for_fsdp``)."""
    if report is not None and report.fsdp_float8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
