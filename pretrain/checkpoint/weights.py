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
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from pretrain.checkpoint.engine_files import SAFETENSORS_DTYPES, ZeroFiles, flatten, mmap_loads
from pretrain.checkpoint.engine_files import name_of as _name
from pretrain.errors import ConfigError
from pretrain.model.hf_save import Spec

Log = Callable[[str], None]


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
        with mmap_loads():  # while the files are opened (the reads after are of the mapped storages, or DCP's)
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


def _from_safetensors(path: Path) -> Weights:
    import torch
    from safetensors import safe_open

    handle = safe_open(str(path), framework="pt")
    keys = {_name(k): k for k in handle.keys()}
    specs = {}
    for name, key in keys.items():
        part = handle.get_slice(key)
        specs[name] = _float_spec(part.get_shape(), getattr(torch, SAFETENSORS_DTYPES[part.get_dtype()]))
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
        loaded: dict[str, Any] = {}
        _load_state_dict(loaded, storage_reader=FileSystemReader(str(directory)),
                         planner=_EmptyStateDictLoadPlanner(keys={keys[n] for n in names}), no_dist=True)
        flat = flatten(loaded)
        return {n: flat[keys[n]] for n in names}

    return Weights(specs, fetch, "DCP")


def _from_zero(ds: Path) -> Weights:
    """DeepSpeed ZeRO-1/2/3's fp32 master weights (its optimizer files' flat partitions), plus the buffers and
    frozen parameters its model-states files hold, as DeepSpeed's ``zero_to_fp32`` reads them."""
    files = ZeroFiles(ds)
    tensors = files.weights()
    specs = {n: _float_spec(v.shape, v.dtype) for n, v in tensors.items()}
    return Weights(specs, lambda names: {n: tensors[n].contiguous() for n in names}, f"ZeRO-{files.stage}")
