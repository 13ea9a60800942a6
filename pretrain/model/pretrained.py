"""``model.init_from``: a pretrained causal LM's weights loaded into the model the run built, each rank reading
only what it holds.

The model is built as for a run from scratch (on the meta device, sharded by FSDP2 with or without TP, or
partitioned by ZeRO-3's ``zero.Init``); instead of the seeded init, every parameter is filled from the
checkpoint's safetensors files. A rank reads, tensor by tensor, only the region of the file its layout gives it:
an FSDP2 / TP shard (the DTensor's local slice), a ZeRO-3 partition (the rows that hold its flat range), or the
whole tensor (one process, DDP, ZeRO-1/2). safetensors' ``get_slice`` maps the file and copies just that region,
so a rank never holds more than its share plus the region being copied.

Names go through transformers' own conversion mapping (``get_model_conversion_mapping``: the renamings and the
MoE experts' merge, per-expert ``gate_proj`` / ``up_proj`` tensors stacked into the fused ``gate_up_proj``), so a
checkpoint loads exactly as ``from_pretrained`` would load it. Of a converted tensor a rank reads the experts in its
region's rows (the whole tensor where its layout holds it whole) and assembles them before keeping its slice.

Pickle weights (``pytorch_model.bin``) are refused: nothing of a checkpoint is unpickled.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, PreTrainedConfig, PreTrainedModel

from pretrain.errors import ConfigError
from pretrain.recipe.init_from import (
    HUB_PATTERNS,
    INDEX_FILE,
    PICKLE_WEIGHTS,
    WEIGHTS_FILE,
    fetch_config,
    hf_view,
    hub_error,
    is_local,
    local_dir,
    pretrain_checkpoint,
)
from pretrain.trust import is_inside

__all__ = ["LoadReport", "check_weight_files", "load_pretrained", "model_dir", "pretrained_config"]

_CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def model_dir(init_from: str) -> Path:
    """The local directory of ``init_from``'s config, weights and tokenizer: the directory itself, or a hub id's
    snapshot (downloaded once into the Hugging Face cache, safetensors and tokenizer files only; asked every time, so
    that an interrupted download is completed: a complete snapshot costs the hub one request, offline none)."""
    found = local_dir(init_from)
    if found is not None and is_local(init_from):
        return found
    checkpoint = pretrain_checkpoint(init_from)
    if checkpoint is not None:
        raise ConfigError(f"model.init_from = {init_from}: its transformers view {hf_view(checkpoint)} is not written "
                          "yet (the run's first process writes it before training: pretrain.checkpoint.export)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(init_from, allow_patterns=list(HUB_PATTERNS)))
    except Exception as exc:  # noqa: BLE001 - every failure is one message
        raise hub_error(init_from, exc, "safetensors weights") from None


def check_weight_files(init_from: str) -> None:
    """The weight files of ``init_from``, where they are on this machine already (a local directory, a hub snapshot
    in the cache, a pretrain checkpoint's view): pickle-only weights and an index naming a file outside its
    directory are refused before anything starts (``preflight.check_run``). Nothing is downloaded or read beyond
    the index and the safetensors headers."""
    found = local_dir(init_from)
    if found is not None and (is_local(init_from) or _has_weights(found)):
        with WeightFiles(found):
            pass


def _has_weights(directory: Path) -> bool:
    return (directory / INDEX_FILE).is_file() or (directory / WEIGHTS_FILE).is_file()


def pretrained_config(init_from: str, attention: str | None = None) -> PreTrainedConfig:
    """The checkpoint's transformers config (no weights read), refused unless it is a causal LM of transformers'
    own architectures."""
    directory = fetch_config(init_from)
    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
    except (ValueError, KeyError, OSError, TypeError) as exc:
        raise ConfigError(f"model.init_from = {init_from!r}: transformers cannot read its config.json ({exc})") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = getattr(config, "architectures", None) or []
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
            names and not any(n.endswith(_CAUSAL_LM_SUFFIXES) for n in names)):
        raise ConfigError(f"model.init_from = {init_from!r} is not a causal language model ({config.model_type}, "
                          f"{', '.join(names) or 'no architectures'}); pretrain continues decoder-only LMs "
                          "(…ForCausalLM)")
    return config


def _weight_path(directory: Path, name: str, what: str) -> Path:
    """A weights file a directory (or its index) names, refused unless it lies inside: in the directory itself, or
    for a hub snapshot (whose files are links into the cache's blobs/) inside that model's cache folder."""
    root = directory.parents[1] if directory.parent.name == "snapshots" else directory
    if isinstance(name, str) and (directory / name).is_symlink() and not is_inside(directory / name, root):
        raise ConfigError(f"{directory / name} is a symbolic link to {(directory / name).resolve()}, outside {directory}; "
                          "refused (pretrain reads nothing outside the model's directory): copy the file in instead")
    if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts or not is_inside(directory / name, root):
        raise ConfigError(f"{what} names {name!r}, which is not inside {directory}; refused (pretrain reads nothing a "
                          "file names outside its own directory). Correct or remove it")
    return directory / name


class WeightFiles:
    """A model directory's safetensors files: which file holds each key (model.safetensors.index.json, every file
    it names inside the directory), opened once each, read by region."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"model.init_from: {index} does not read as a safetensors index ({exc})") from None
            names = {name: _weight_path(directory, name, f"{index}") for name in set(weight_map.values())}
            self.files = {key: names[name] for key, name in weight_map.items()}
        elif (directory / WEIGHTS_FILE).is_file():
            from safetensors import safe_open

            path = _weight_path(directory, WEIGHTS_FILE, f"model.init_from = {directory}")
            with _readable(path), safe_open(path, framework="pt") as handle:
                self.files = dict.fromkeys(handle.keys(), path)
        else:
            pickles = [name for name in PICKLE_WEIGHTS if (directory / name).exists()]
            if pickles:
                raise ConfigError(f"model.init_from = {directory} holds pickle weights only ({pickles[0]}), which "
                                  "pretrain never unpickles; convert them to safetensors where you trust the file "
                                  "(transformers: from_pretrained(dir).save_pretrained(new_dir)) and start from that")
            raise ConfigError(f"model.init_from = {directory} has no {WEIGHTS_FILE} nor {INDEX_FILE}; give a "
                              "directory written by save_pretrained")
        missing = sorted({str(p.relative_to(directory)) for p in self.files.values() if not p.is_file()})
        if missing:
            raise ConfigError(f"model.init_from = {directory}: {INDEX_FILE} names {', '.join(missing[:3])}, which is not "
                              "there (an interrupted download or copy?); download or copy the model again")
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> WeightFiles:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _handle(self, key: str):
        path = self.files[key]
        if path not in self._handles:
            from safetensors import safe_open

            with _readable(path):
                self._handles[path] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._handles[path]

    def shape(self, key: str) -> list[int]:
        return list(self._handle(key).get_slice(key).get_shape())

    def read(self, key: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor ``key``, or only ``region`` of it (the file's bytes of that region, nothing more)."""
        tensor_slice = self._handle(key).get_slice(key)
        return tensor_slice[region] if region else tensor_slice[:]


@contextlib.contextmanager
def _readable(path: Path):
    """A safetensors file that does not open (truncated, not safetensors) as one ConfigError naming it."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as exc:
        raise ConfigError(f"model.init_from: {path} does not read as safetensors ({exc}); download or copy it "
                          "again") from None


@dataclass
class LoadReport:
    """What one rank read: its share of the checkpoint, and the most it held at once beyond its parameters."""

    num_tensors: int = 0
    read_bytes: int = 0
    """Bytes this rank copied out of the files (its share of every tensor, the whole of a converted one)."""
    largest_read_bytes: int = 0
    """The most bytes read for one parameter: the host memory the load needs beside the rank's parameters."""
    checkpoint_bytes: int = 0
    """The whole checkpoint's tensors, for comparison."""
    seconds: float = 0.0
    ignored: list[str] = field(default_factory=list)
    """Checkpoint keys no parameter takes (buffers saved by older versions, …)."""

    def line(self, source: str) -> str:
        ignored = f"; ignored {len(self.ignored)} keys ({', '.join(self.ignored[:3])})" if self.ignored else ""
        return (f"init_from: {self.num_tensors} tensors from {source} in {self.seconds:.1f}s; this rank read "
                f"{size_text(self.read_bytes)} of {size_text(self.checkpoint_bytes)}, at most "
                f"{size_text(self.largest_read_bytes)} at once{ignored}")


def size_text(num_bytes: int) -> str:
    """``num_bytes`` in the largest binary unit that keeps it at 1 or more (2 decimals): 305.00 KiB, 65.20 GiB."""
    value, unit = float(num_bytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.2f} {unit}"


@dataclass
class _Source:
    """Where one parameter comes from: a checkpoint key, or a converter's several keys and its operations."""

    keys: dict[str, list[str]]  # source pattern (or the key itself) -> checkpoint keys, in order
    converter: object | None = None


def _sources(model: PreTrainedModel, keys: list[str]) -> tuple[dict[str, _Source], list[str]]:
    """Each parameter's checkpoint keys, through transformers' conversion mapping of ``model``; and the keys that
    map to no parameter."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    state = dict.fromkeys(model.state_dict(), True)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    sources: dict[str, _Source] = {}
    ignored = []
    for key in sorted(keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if target not in params:
            ignored.append(key)
            continue
        if pattern is None:
            sources[target] = _Source({key: [key]})
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        source = sources.setdefault(target, _Source({p: [] for p in converter.source_patterns}, converter))
        source.keys[pattern].append(key)
    return sources, ignored


def _full(files: WeightFiles, source: _Source, experts: slice | None = None) -> torch.Tensor:
    """A converted parameter put together from its sources by the converter's operations (transformers'):
    whole, or only ``experts`` (a range of dim 0) when the first operation stacks one tensor per expert along it."""
    keys = {pattern: keys[experts] if experts else keys for pattern, keys in source.keys.items()}
    collected: dict[str, object] = {pattern: [files.read(k) for k in ks] for pattern, ks in keys.items()}
    converter = source.converter
    for op in converter.operations:
        collected = op.convert(collected, source_patterns=converter.source_patterns,
                               target_patterns=converter.target_patterns)
    (tensor,) = collected.values()
    return tensor


def _stacks_experts(source: _Source) -> bool:
    """The converter stacks one checkpoint tensor per expert along dim 0 first (MoE experts: transformers'
    MergeModulelist(dim=0)): a range of dim 0 then needs only those experts' tensors."""
    from transformers.core_model_loading import MergeModulelist

    first = source.converter.operations[0]
    return isinstance(first, MergeModulelist) and first.dim == 0


def _region(param: torch.Tensor) -> tuple[slice, ...] | None:
    """The region of the full tensor this rank holds: a DTensor's local slice; None for the whole tensor."""
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    return None


def _zero3_range(param: torch.Tensor) -> tuple[int, int]:
    """A ZeRO-3 parameter's flat range [start, end) of the full tensor held in this rank's partition."""
    import torch.distributed as dist

    numel = param.partition_numel()
    start = dist.get_rank(group=param.ds_process_group) * numel
    return min(start, param.ds_numel), min(start + numel, param.ds_numel)


def load_pretrained(model: PreTrainedModel, init_from: str, log: Callable[[str], None] = print) -> LoadReport:
    """Fill every parameter of ``model`` (built, sharded or partitioned, storage allocated) from ``init_from``'s
    safetensors, this rank's share only. Every parameter must be found, with the checkpoint's shape."""
    start = time.perf_counter()
    directory = model_dir(init_from)
    report = LoadReport()
    with WeightFiles(directory) as files, torch.no_grad():
        sources, report.ignored = _sources(model, list(files.files))
        named = dict(model.named_parameters())
        missing = sorted(set(named) - set(sources))
        if missing:
            raise ConfigError(f"model.init_from = {init_from}: its checkpoint has no weights for {len(missing)} of the "
                              f"model's parameters ({', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}); is it "
                              "a complete save_pretrained directory of this architecture?")
        for name, param in named.items():
            source = sources[name]
            full_shape = list(getattr(param, "ds_shape", param.shape))
            if source.converter is None:
                (key,) = source.keys
                if files.shape(key) != full_shape:
                    raise ConfigError(f"model.init_from = {init_from}: {key} has shape {files.shape(key)} in the "
                                      f"checkpoint, the model's {name} {full_shape}; its config.json does not match "
                                      "its weights")
                report.checkpoint_bytes += _nbytes(files, key)
            read = _load_one(param, files, source, full_shape)
            report.read_bytes += read
            report.largest_read_bytes = max(report.largest_read_bytes, read)
            report.num_tensors += 1
        report.checkpoint_bytes += sum(_nbytes(files, k) for s in sources.values() if s.converter
                                       for keys in s.keys.values() for k in keys)
    report.seconds = time.perf_counter() - start
    return report


def _nbytes(files: WeightFiles, key: str) -> int:
    tensor_slice = files._handle(key).get_slice(key)
    dtype = tensor_slice.get_dtype()
    size = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}.get(dtype, 4)
    return math.prod(tensor_slice.get_shape()) * size


def _load_one(param: torch.Tensor, files: WeightFiles, source: _Source, full_shape: list[int]) -> int:
    """Copy this rank's share of one parameter; the bytes read for it."""
    converted = source.converter is not None
    key = None if converted else next(iter(source.keys))
    row = math.prod(full_shape[1:]) if len(full_shape) > 1 else 1

    if converted and _stacks_experts(source) and {len(keys) for keys in source.keys.values()} != {full_shape[0]}:
        found = ", ".join(f"{len(keys)} {pattern}" for pattern, keys in source.keys.items())
        raise ConfigError(f"model.init_from: the checkpoint has {found} tensors for a parameter of {full_shape[0]} "
                          "experts; its config.json does not match its weights")

    def read(region: tuple[slice, ...] | None) -> torch.Tensor:
        if not converted:
            return files.read(key, region)
        if region and _stacks_experts(source):  # only the experts in the region's rows
            experts = region[0]
            part = _full(files, source, experts)
            if list(part.shape[1:]) != full_shape[1:]:
                raise ConfigError(f"model.init_from: one expert of {'/'.join(source.keys)} has shape "
                                  f"{list(part.shape[1:])}, the model's {full_shape[1:]}; its config.json does not "
                                  "match its weights")
            return part[(slice(None), *region[1:])]
        full = _full(files, source)
        if list(full.shape) != full_shape:
            raise ConfigError(f"model.init_from: the converted {'/'.join(source.keys)} has shape {list(full.shape)}, "
                              f"the model's parameter {full_shape}; its config.json does not match its weights")
        return full[region] if region else full

    if hasattr(param, "ds_id"):  # ZeRO-3: the rows that hold this partition's flat range
        begin, end = _zero3_range(param)
        if end <= begin:
            return 0
        first, last = begin // row, -(-end // row)
        rows = read((slice(first, last),))
        param.ds_tensor.data.reshape(-1)[:end - begin].copy_(rows.reshape(-1)[begin - first * row:end - first * row])
        return rows.numel() * rows.element_size()
    region = _region(param)
    if region is not None and any(s.stop <= s.start for s in region):
        return 0  # an empty shard (more ranks than rows)
    value = read(region)
    local = param.to_local() if isinstance(param, DTensor) else param.data
    local.copy_(value.reshape(local.shape))
    return value.numel() * value.element_size()
