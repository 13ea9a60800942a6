"""A transformers model directory written one shard at a time: the run's final_model and pretrain-export (and
model.init_from's view of a pretrain checkpoint) are written here.

``model.save_pretrained`` needs the whole state dict in memory: ~280 GB of fp32 at 70B. ``write_pretrained`` takes
the weights as a reader instead (``specs``: every tensor's shape and dtype; ``read(names)``: those tensors), and
does what ``save_pretrained`` does with them, one shard at a time:

- the config, generation config (and a remote-code model's files) are ``save_pretrained``'s own, called with an
  empty state dict;
- the shards are planned by huggingface_hub's ``split_torch_state_dict_into_shards`` (what ``save_pretrained``
  calls) on shape-only (meta) tensors, tied weights removed as ``save_pretrained`` removes them
  (``remove_tied_weights_from_state_dict``);
- each shard is read, its weights converted back to the checkpoint format as ``save_pretrained`` converts an
  offloaded model's shard (``revert_weight_conversion``: an MoE's fused experts into the hub's per-expert tensors),
  written by safetensors with ``save_pretrained``'s metadata, and dropped;
- ``model.safetensors.index.json`` when there are several shards, in ``save_pretrained``'s form.

So the peak memory is one shard (``SHARD_BYTES``, or one tensor larger than that) plus the reader's own, and a model
of one shard is byte for byte the file ``save_pretrained`` writes (tests/checkpoint/test_export.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Spec:
    """A tensor as a reader's ``read`` returns it: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: Any  # torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


SHARD_BYTES = 5 * 10**9  # "5GB", the hub's usual shard (save_pretrained's own default is 50GB: 50 GB in memory)
INDEX_FILE = "model.safetensors.index.json"


def write_pretrained(model, specs: dict[str, Spec], read: Callable[[list[str]], dict[str, Any]], directory: Path,
                     shard_bytes: int | str = SHARD_BYTES) -> list[str]:
    """``model``'s config and the weights ``specs`` names (read with ``read``, a shard at a time) as a transformers
    model directory in ``directory`` (which exists). ``model`` may live on the meta device. Returns the shard files
    written."""
    write_config(model, directory)
    plan = shard_plan(model, specs, shard_bytes)
    for filename, names in plan.filename_to_tensors.items():
        write_shard(model, read(list(names)), directory / filename)
    write_index(model, directory, plan)
    return list(plan.filename_to_tensors)


def write_config(model, directory: Path) -> None:
    """save_pretrained's files but the weights: the config, generation config (and a remote-code model's files)."""
    import os
    import shutil

    from pretrain.system.quiet import no_progress_bars

    staging = directory / ".config"
    shutil.rmtree(staging, ignore_errors=True)
    with no_progress_bars():
        model.save_pretrained(staging, state_dict={}, safe_serialization=True)
    for item in staging.iterdir():
        if item.name != INDEX_FILE and not (item.name.startswith("model") and item.name.endswith(".safetensors")):
            os.replace(item, directory / item.name)  # not the empty weights of the empty state dict
    shutil.rmtree(staging)


def shard_plan(model, specs: dict[str, Spec], shard_bytes: int | str = SHARD_BYTES):
    """save_pretrained's shard plan (huggingface_hub's ``StateDictSplit``) of ``specs``, from shapes alone, tied
    weights removed as save_pretrained removes them. The same on every rank given the same specs."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    shapes = {name: torch.empty(spec.shape, dtype=spec.dtype, device="meta") for name, spec in specs.items()}
    shapes = remove_tied_weights_from_state_dict(shapes, model)
    return split_torch_state_dict_into_shards(shapes, filename_pattern="model{suffix}.safetensors",
                                              max_shard_size=shard_bytes)


def write_shard(model, shard: dict[str, Any], path: Path) -> None:
    """One shard as save_pretrained writes it: converted back to the checkpoint format (an MoE's fused experts into
    the hub's per-expert tensors, as save_pretrained converts an offloaded model's shard), save_pretrained's
    safetensors metadata."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    save_file(revert_weight_conversion(model, shard), str(path), metadata={"format": "pt"})


def write_index(model, directory: Path, plan) -> None:
    """save_pretrained's ``model.safetensors.index.json`` of the shards written in ``directory`` (a plan of several
    shards; each shard's tensor names read back from its header: the converted names)."""
    from safetensors import safe_open

    if not plan.is_sharded:
        return
    weight_map: dict[str, str] = {}
    for filename in plan.filename_to_tensors:
        with safe_open(str(directory / filename), framework="pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), filename))
    index = {"metadata": {"total_parameters": model.num_parameters(), **plan.metadata},
             "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def in_memory(state_dict: dict[str, Any]) -> tuple[dict[str, Any], Callable[[list[str]], dict[str, Any]]]:
    """(specs, read) of a state dict already in memory (the final model gathered by the run)."""
    specs = {k: Spec(tuple(v.shape), v.dtype) for k, v in state_dict.items()}
    return specs, lambda names: {n: state_dict[n].detach().to("cpu").contiguous() for n in names}

