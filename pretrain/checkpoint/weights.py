"""The fp32 weights of a checkpoint of any layout, one bounded group of tensors at a time, on CPU, with no process
group: what pretrain-export, model.init_from's view of a pretrain checkpoint and pretrain-eval read.

``open_weights(checkpoint)`` gives a ``Weights``: every tensor's name, shape and dtype up front (read from the
files' headers and metadata, nothing materialized), and ``read(names)``, which materializes only those tensors (the
floating-point ones in fp32). A reader of a 70B checkpoint holds one group at a time, not the ~280 GB of its fp32
weights. Per layout:

- one process / DDP: ``model.safetensors``, one tensor at a time through ``safe_open``;
- FSDP2 (sharded, DCP): torch.distributed.checkpoint's loader for the group's keys only (each key's chunks read
  where the metadata places them), with no temporary consolidated copy on disk;
- DeepSpeed ZeRO-3: DeepSpeed's own lazy mode (``get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True)``):
  a tensor is gathered from every rank's fp32 partition when read;
- DeepSpeed ZeRO-1/2: DeepSpeed's lazy mode is ZeRO-3's only (its ZeRO-1/2 merge concatenates every rank's
  partition: the whole fp32 model), so a tensor here is its slices of the ranks' partitions, placed as DeepSpeed's
  merge places them (``_zero2_slices``);
- ZeRO-0 and FSDP's full state dict: their one torch.save file.

Every torch.save file is memory-mapped (``torch.load(mmap=True)``; DeepSpeed's model-states reader is given the same):
what is read lives in the page cache, which the kernel reclaims, not in this process's own memory. Every load is
weights-only (``pretrain/trust.py``) and every pickle is checked before (``check_files``).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from pretrain.errors import ConfigError
from pretrain.model.hf_save import Spec

Log = Callable[[str], None]

# safetensors' dtype names (safe_open's get_slice(...).get_dtype())
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class Weights:
    """A checkpoint's model tensors by name: ``specs`` (all of them, nothing read) and ``read(names)``."""

    def __init__(self, specs: dict[str, Spec], fetch: Callable[[list[str]], dict[str, Any]], layout: str,
                 close: Callable[[], None] = lambda: None):
        self.specs, self._fetch, self.layout, self._close = specs, fetch, layout, close

    def read(self, names: Iterable[str]) -> dict[str, Any]:
        """The tensors ``names`` (fp32 where floating point), materialized on CPU; nothing else is kept."""
        names = list(names)
        unknown = [n for n in names if n not in self.specs]
        if unknown:
            raise KeyError(f"not in the checkpoint: {unknown[:3]}")
        out = {}
        for name, tensor in self._fetch(names).items():
            tensor = tensor.float() if tensor.is_floating_point() else tensor
            out[name] = tensor.contiguous()
        return out

    def groups(self, names: Iterable[str], budget_bytes: int) -> Iterator[dict[str, Any]]:
        """``read`` of ``names`` in groups of at most ``budget_bytes`` (a larger tensor alone)."""
        group: list[str] = []
        size = 0
        for name in names:
            nbytes = self.specs[name].nbytes
            if group and size + nbytes > budget_bytes:
                yield self.read(group)
                group, size = [], 0
            group.append(name)
            size += nbytes
        if group:
            yield self.read(group)

    def close(self) -> None:
        self._close()


@contextlib.contextmanager
def open_weights(checkpoint: Path, log: Log = print) -> Iterator[Weights]:
    """The fp32 model weights of ``checkpoint`` (any layout), read as asked (module docstring). Every pickle of
    the checkpoint is checked first, and every load is weights-only."""
    from pretrain.checkpoint.reshard import _refuse_crafted, saved_layout
    from pretrain.checkpoint.rundir import read_state
    from pretrain.trust import weights_only

    state = read_state(checkpoint)
    if state is None:
        raise ConfigError(f"{checkpoint} is not a complete checkpoint")
    layout = saved_layout(checkpoint, state)
    _refuse_crafted(checkpoint)
    with weights_only(checkpoint):
        with _mmap_loads():  # while the files are opened (the reads after are of the mapped storages, or DCP's)
            weights = _open(checkpoint, layout)
        try:
            log(f"export: {len(weights.specs)} tensors of {layout.describe()} in {checkpoint} "
                f"({sum(s.nbytes for s in weights.specs.values()) / 2**30:.2f} GiB in fp32), read a group at a time")
            yield weights
        finally:
            weights.close()


def read_by_export(checkpoint: Path) -> Callable[[str], bool]:
    """Whether a checkpoint file (relative, '/'-separated) is one ``open_weights`` reads: the weights' files of the
    checkpoint's layout (a ZeRO checkpoint's optimizer files hold its fp32 weights), and the trainer state."""
    from pretrain.checkpoint.reshard import DEEPSPEED_DIR, FSDP_FULL_FILE, FSDP_SHARDED_DIR, MODEL_FILE, saved_layout
    from pretrain.checkpoint.rundir import STATE_FILE, read_state

    layout = saved_layout(checkpoint, read_state(checkpoint) or {})
    if layout.engine == "deepspeed":
        weights = (f"{DEEPSPEED_DIR}/",)
    elif layout.engine == "fsdp":
        weights = (f"{FSDP_SHARDED_DIR}/", FSDP_FULL_FILE)
    else:
        weights = (MODEL_FILE,)
    return lambda rel: rel == STATE_FILE or rel.startswith(weights)


def full_state_dict(checkpoint: Path, log: Log = print) -> dict[str, Any]:
    """The whole fp32 model state dict of a checkpoint of any layout, all of it in memory (what a test compares;
    the export reads a group at a time)."""
    with open_weights(checkpoint, log=log) as weights:
        return weights.read(weights.specs)


def _open(checkpoint: Path, layout) -> Weights:
    from pretrain.checkpoint.reshard import DEEPSPEED_DIR, FSDP_FULL_FILE, FSDP_SHARDED_DIR, MODEL_FILE

    if layout.engine == "deepspeed":
        ds = checkpoint / DEEPSPEED_DIR
        if layout.zero_stage == 0:
            return _from_torch_file(ds / "mp_rank_00_model_states.pt", "module", "ZeRO-0")
        return _from_zero(ds)
    if layout.engine == "fsdp":
        if (checkpoint / FSDP_SHARDED_DIR).is_dir():
            return _from_dcp(checkpoint / FSDP_SHARDED_DIR)
        return _from_torch_file(checkpoint / FSDP_FULL_FILE, None, "FSDP full state dict")
    if not (checkpoint / MODEL_FILE).is_file():
        raise ConfigError(f"{checkpoint} has no {MODEL_FILE} (a checkpoint saved without safetensors?); nothing to "
                          "export")
    return _from_safetensors(checkpoint / MODEL_FILE)


def _float_spec(shape, dtype) -> Spec:
    import torch

    return Spec(tuple(int(d) for d in shape), torch.float32 if dtype.is_floating_point else dtype)


def _name(key: str) -> str:
    return key.removeprefix("module.")


def _from_safetensors(path: Path) -> Weights:
    import torch
    from safetensors import safe_open

    handle = safe_open(str(path), framework="pt")
    keys = {_name(k): k for k in handle.keys()}
    specs = {}
    for name, key in keys.items():
        part = handle.get_slice(key)
        specs[name] = _float_spec(part.get_shape(), getattr(torch, _SAFETENSORS_DTYPES[part.get_dtype()]))
    return Weights(specs, lambda names: {n: handle.get_tensor(keys[n]) for n in names}, "safetensors")


def _from_torch_file(path: Path, entry: str | None, what: str) -> Weights:
    import torch

    loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    tensors = loaded[entry] if entry else loaded
    tensors = {_name(k): v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    specs = {n: _float_spec(v.shape, v.dtype) for n, v in tensors.items()}
    return Weights(specs, lambda names: {n: tensors[n] for n in names}, what)


def _from_dcp(directory: Path) -> Weights:
    """accelerate's SHARDED_STATE_DICT of the model (``{"model": {...}}``), a group of keys per DCP load."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    metadata = FileSystemReader(str(directory)).read_metadata()
    keys = {k.removeprefix("model."): k for k, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}
    specs = {name: _float_spec(md.size, md.properties.dtype)
             for name, md in ((n, metadata.state_dict_metadata[k]) for n, k in keys.items())}

    def fetch(names: list[str]) -> dict[str, Any]:
        # what torch's own converter (torch.distributed.checkpoint.format_utils.dcp_to_torch_save) calls, for
        # these keys only: each is read from the chunks the metadata places it in
        from pretrain.checkpoint.neutral import _flatten

        loaded: dict[str, Any] = {}
        _load_state_dict(loaded, storage_reader=FileSystemReader(str(directory)),
                         planner=_EmptyStateDictLoadPlanner(keys={keys[n] for n in names}), no_dist=True)
        flat = _flatten(loaded)
        return {n: flat[keys[n]] for n in names}

    return Weights(specs, fetch, "DCP")


def _from_zero(ds: Path) -> Weights:
    """DeepSpeed ZeRO-1/2/3's fp32 master weights (its optimizer files' flat partitions), plus the buffers and
    frozen parameters its model-states files hold, as DeepSpeed's ``zero_to_fp32`` reads them."""
    from deepspeed.utils import zero_to_fp32 as z

    with contextlib.redirect_stdout(sys.stderr):  # its progress prints
        model_states = z.parse_model_states(z.get_model_state_files(str(ds)))
        parsed = z.parse_optim_states(z.get_optim_files(str(ds)), str(ds))
        stage, world, flat_groups = parsed[:3]
        paddings = parsed[3] if len(parsed) > 3 else None  # ZeRO-1/2's alignment paddings (deepspeed >= 0.17)
        if stage == 3:
            lazy = z._get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, model_states, False)
        else:
            lazy = dict(model_states[0].buffers)
            z._zero2_merge_frozen_params(lazy, model_states)
            lazy.update(_zero2_slices(world, flat_groups, model_states[0].param_shapes, paddings))
            for alias, source in model_states[0].shared_params:
                if source in lazy:
                    lazy[alias] = lazy[source]
    tensors = {_name(k): v for k, v in lazy.items()}
    specs = {n: _float_spec(v.shape, v.dtype) for n, v in tensors.items()}
    return Weights(specs, lambda names: {n: tensors[n].contiguous() for n in names}, f"ZeRO-{stage}")


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


@contextlib.contextmanager
def _mmap_loads() -> Iterator[None]:
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
