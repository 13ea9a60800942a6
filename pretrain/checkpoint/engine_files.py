"""What the engines' own files hold, read without a process group: DeepSpeed ZeRO-1/2/3's per-rank flat partitions
by parameter (``ZeroFiles``) and DCP's nested state dicts flattened. Read by ``weights`` (the fp32 weights of any
checkpoint) and ``neutral`` (its weights and optimizer states).

Every torch.save file is memory-mapped and weights-only (the caller holds ``trust.weights_only``): a tensor is
read when it is gathered, not when its file is opened.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pretrain.errors import ConfigError

# safetensors' dtype names (safe_open's get_slice(...).get_dtype())
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def name_of(key: str) -> str:
    """A model entry's name: DeepSpeed's and DDP's keys without DDP's ``module.`` prefix."""
    return key.removeprefix("module.")


class ZeroFiles:
    """A DeepSpeed ZeRO-1/2/3 checkpoint's per-rank files, memory-mapped (their pickles read, no tensor): each
    parameter's fp32 master weight and optimizer states as lazy tensors, gathered from every rank's flat
    partition when ``contiguous()`` is called. ZeRO-3 places a parameter as DeepSpeed's own lazy ``zero_to_fp32``
    does (``GatheredTensor``), ZeRO-1/2 as its merge does (``_zero2_slices``); an optimizer state's flat tensor
    has its fp32 partition's layout (DeepSpeed's ``ds_to_universal`` slices both alike)."""

    def __init__(self, ds: Path):
        import torch
        from deepspeed.checkpoint import constants as c
        from deepspeed.utils import zero_to_fp32 as z

        # memory-mapped: a ZeRO-1/2 model-states file holds the whole 16-bit model (140 GB at 70B)
        with contextlib.redirect_stdout(sys.stderr), mmap_loads():  # its progress prints
            self.model_states = z.parse_model_states(z.get_model_state_files(str(ds)))
        files = z.get_optim_files(str(ds))
        self._optim = [torch.load(f, map_location="cpu", weights_only=True, mmap=True)[c.OPTIMIZER_STATE_DICT]
                       for f in files]
        first = self._optim[0]
        if c.ZERO_STAGE not in first:
            raise ConfigError(f"{files[0]} is not a DeepSpeed ZeRO checkpoint's optimizer file")
        self.stage = int(first[c.ZERO_STAGE])
        world = first[c.PARTITION_COUNT]
        self.world = max(world) if isinstance(world, list) else int(world)
        if self.world != len(files):
            raise ConfigError(f"{ds} holds {len(files)} optimizer files of a ZeRO world of {self.world}: a save "
                              "that did not complete, or files of two saves")
        key = c.FP32_FLAT_GROUPS if self.stage == 3 else c.SINGLE_PARTITION_OF_FP32_GROUPS
        self._fp32 = [optim[key] for optim in self._optim]
        # ZeRO-1/2's per-parameter alignment paddings (deepspeed >= 0.17 records them, under a key 0.16 has no
        # constant for)
        self._paddings = first.get("param_alignment_paddings") if self.stage < 3 else None

    def _trainable(self, flat_groups: list) -> dict[str, Any]:
        from deepspeed.utils import zero_to_fp32 as z

        if self.stage == 3:
            out: dict[str, Any] = {}
            with contextlib.redirect_stdout(sys.stderr):
                z._zero3_merge_trainable_params(out, self.world, flat_groups, self.model_states)
            return out
        return _zero2_slices(self.world, flat_groups, self.model_states[0].param_shapes, self._paddings)

    def trainable(self) -> list[str]:
        """The parameters with fp32 masters and optimizer states, in DeepSpeed's order."""
        return [name_of(name) for group in self.model_states[0].param_shapes for name in group]

    def weights(self) -> dict[str, Any]:
        """Every model entry: the trainable parameters' fp32 masters, the frozen ones, the buffers, tied aliases."""
        from deepspeed.utils import zero_to_fp32 as z

        with contextlib.redirect_stdout(sys.stderr):
            if self.stage == 3:
                lazy = dict(self.model_states[0].buffers)
                z._zero3_merge_frozen_params(lazy, self.world, self.model_states)
            else:
                lazy = dict(self.model_states[0].buffers)
                z._zero2_merge_frozen_params(lazy, self.model_states)
        lazy.update(self._trainable(self._fp32))
        for alias, source in self.model_states[0].shared_params:
            if source in lazy:
                lazy[alias] = lazy[source]
        return {name_of(k): v for k, v in lazy.items()}

    def _base_states(self, optim: dict) -> list[dict[str, Any]]:
        """One rank's optimizer state per flat group (ZeRO-1/2: the base optimizer's, a torch state_dict, or a
        list of groups when saved elastic; ZeRO-3: its sub-groups')."""
        from deepspeed.checkpoint import constants as c

        if self.stage == 3:
            state = optim[c.OPTIMIZER_STATE_DICT]["state"]
        else:
            base = optim[c.BASE_OPTIMIZER_STATE]
            state = base["state"] if isinstance(base, dict) else dict(enumerate(base))
        return [state.get(group, {}) for group in range(len(self._fp32[0]))]

    def states(self) -> tuple[dict[str, dict[str, Any]], float | None]:
        """Each optimizer state's lazy tensors by parameter name (``exp_avg``: {name: ...}), and the step count."""
        per_rank = [self._base_states(optim) for optim in self._optim]
        names = sorted({k for groups in per_rank for group in groups for k, v in group.items()
                        if k != "step" and hasattr(v, "dim") and v.dim() > 0})
        out = {}
        for state in names:
            # narrowed to the fp32 partition: a non-elastic ZeRO-1/2 save keeps the group's padding in its states only
            flats = [[groups[g][state][:self._fp32[rank][g].numel()] for g in range(len(groups))]
                     for rank, groups in enumerate(per_rank)]
            out[state] = {name_of(k): v for k, v in self._trainable(flats).items()}
        steps = {float(group["step"]) for group in per_rank[0] if "step" in group}
        if not steps and self.stage < 3:  # an elastic ZeRO-1/2 save keeps the step beside the groups
            from deepspeed.checkpoint import constants as c

            step = self._optim[0].get(c.BASE_OPTIMIZER_STATE_STEP)
            steps = {float(step)} if step is not None else set()
        if len(steps) > 1:
            raise ConfigError(f"the optimizer's groups were stepped different numbers of times ({sorted(steps)}): "
                              "the neutral form holds one step count")
        return out, steps.pop() if steps else None


class _Slices:
    """A ZeRO-1/2 parameter: ``length`` elements from ``offset`` of the concatenation of every rank's flat fp32
    partition of its group, shaped ``shape``; gathered when ``contiguous()`` is called."""

    def __init__(self, partitions: list, offset: int, shape):
        self.partitions, self.offset, self.shape = partitions, offset, shape
        self.dtype = partitions[0].dtype

    def contiguous(self):
        import torch

        start, remaining, pieces = self.offset, math.prod(self.shape), []
        for part in self.partitions:
            n = part.numel()
            if start >= n:
                start -= n
                continue
            take = min(n - start, remaining)
            pieces.append(part[start:start + take])
            remaining -= take
            start = 0
            if not remaining:
                break
        if remaining:
            raise ConfigError(f"a DeepSpeed partition ends {remaining} elements before a parameter of shape "
                              f"{tuple(self.shape)}: the checkpoint is damaged or not a ZeRO-1/2 checkpoint")
        return torch.cat(pieces).view(self.shape)


def _zero2_slices(world: int, flat_groups: list, param_shapes: list, paddings: list | None) -> dict[str, _Slices]:
    """Where each parameter of a ZeRO-1/2 checkpoint lies in the ranks' partitions: DeepSpeed's ZeRO-1/2 merge
    (``zero_to_fp32._zero2_merge_trainable_params``), with each group's concatenation left unmade."""
    out = {}
    for group, shapes in enumerate(param_shapes):
        partitions = [flat_groups[rank][group] for rank in range(world)]
        available = sum(p.numel() for p in partitions)
        pads = paddings[group] if paddings is not None else None
        if pads is not None and len(pads) != len(shapes):
            raise ConfigError(f"DeepSpeed records {len(pads)} alignment paddings for {len(shapes)} parameters of "
                              f"group {group}: the checkpoint is damaged")
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            out[name] = _Slices(partitions, offset, shape)
            offset += math.prod(shape)
            if pads is not None:
                offset += pads[i]
        align = 2 * world  # DeepSpeed pads each group to a multiple of 2 x world size
        if align * math.ceil(offset / align) != align * math.ceil(available / align):
            raise ConfigError(f"DeepSpeed's group {group} holds {available} elements, its parameters {offset}: "
                              "the checkpoint is damaged or was written by another DeepSpeed layout")
    return out


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested state dict (DCP's ``{"model": {...}}``) as one level of dotted keys."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@contextlib.contextmanager
def mmap_loads() -> Iterator[None]:
    """Every ``torch.load`` of a file path memory-maps it (DeepSpeed's model-states reader loads whole files, and a
    ZeRO-1/2 model-states file holds the whole 16-bit model)."""
    import torch

    load = torch.load

    def mapped(f, *args, **kwargs):
        if isinstance(f, (str, Path)) and "mmap" not in kwargs:
            kwargs["mmap"] = True
        return load(f, *args, **kwargs)

    torch.load = mapped
    try:
        yield
    finally:
        torch.load = load
