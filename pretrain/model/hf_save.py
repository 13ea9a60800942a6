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


def write_pretrained(model, specs: dict[str, Any], read: Callable[[list[str]], dict[str, Any]], directory: Path,
                     shard_bytes: int = SHARD_BYTES) -> list[str]:
    """``model``'s config and the weights ``specs`` names (read with ``read``, a shard at a time) as a transformers
    model directory in ``directory`` (which exists). ``model`` may live on the meta device. Returns the shard files
    written."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model.save_pretrained(directory, state_dict={}, safe_serialization=True)  # the config and what goes with it
    for stale in [*directory.glob("model*.safetensors"), directory / INDEX_FILE]:
        stale.unlink(missing_ok=True)  # the empty weights of the empty state dict
    shapes = {name: torch.empty(spec.shape, dtype=spec.dtype, device="meta") for name, spec in specs.items()}
    shapes = remove_tied_weights_from_state_dict(shapes, model)
    split = split_torch_state_dict_into_shards(shapes, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=shard_bytes)
    weight_map: dict[str, str] = {}
    for filename, names in split.filename_to_tensors.items():
        shard = read(list(names))
        shard = revert_weight_conversion(model, shard)
        weight_map.update(dict.fromkeys(shard, filename))
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
        del shard
    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return list(split.filename_to_tensors)


def in_memory(state_dict: dict[str, Any]) -> tuple[dict[str, Any], Callable[[list[str]], dict[str, Any]]]:
    """(specs, read) of a state dict already in memory (the final model gathered by the run)."""
    specs = {k: Spec(tuple(v.shape), v.dtype) for k, v in state_dict.items()}
    return specs, lambda names: {n: state_dict[n].detach().to("cpu").contiguous() for n in names}

