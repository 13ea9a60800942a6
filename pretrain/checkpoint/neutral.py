"""One neutral form of a checkpoint's model and optimizer state, read from and loaded into every layout.

Each engine writes its optimizer state in its own format: one torch ``state_dict`` indexed by position (one
process / DDP), ``torch.distributed.checkpoint`` shards by parameter name (FSDP2), flat per-rank partitions
(DeepSpeed ZeRO-1/2/3). What they all hold is the same: **per parameter, by its full name, the fp32 master
weight and each optimizer state of the parameter's shape** (AdamW's ``exp_avg`` and ``exp_avg_sq``), and the
optimizer's step count. The neutral form is that, as data:

- ``state-XXXXX.safetensors``: tensors named ``param/<name>`` (the fp32 weight; also the model's other
  entries, such as buffers and tied aliases) and ``<state>/<name>`` (``exp_avg/<name>`` ...), in shards of at
  most ``SHARD_BYTES``; safetensors hold no code, and a reader takes one tensor (or one slice of it) at a time;
- ``neutral.json``: the format, the layout it was read from, the optimizer step, each parameter's shape and
  state names.

A checkpoint of one engine resumes under another through it (``reshard``: converted once into the sibling
``<checkpoint>.neutral/``, each rank its ``Source.share``). Read from (``Source``: every tensor's name and size up
front, the tensors read one bounded group at a time):

- one process / DDP: ``model.safetensors`` and ``optimizer.bin`` (memory-mapped; a torch state_dict that indexes
  parameters by position: their names are the ``optimizer_params`` the checkpoint records,
  ``record_optimizer_params``);
- FSDP2: its two DCP directories, read by key without a process group, a bounded number of bytes at a time;
- ZeRO-1/2/3: each rank's memory-mapped flat partitions, gathered per parameter (``engine_files.ZeroFiles``).

Loaded into (after ``accelerator.prepare``, every rank):

- one process / DDP / FSDP2 (with TP): the optimizer's states are created as torch's ``state_dict`` API does it
  (a step with zero gradients and lr 0), then ``torch.distributed.checkpoint`` loads the weights and states in
  place through its safetensors reader (``HuggingFaceStorageReader``): each rank reads only the slices of its
  own shards (DTensors) or the full tensors (replicated);
- ZeRO-1/2/3: DeepSpeed's API for partitioned states (``safe_set_full_fp32_param``,
  ``safe_set_full_optimizer_state``), one parameter at a time; then the 16-bit (working) copies are refreshed
  from the fp32 masters, as DeepSpeed's universal load does.

The scheduler's state (``scheduler.bin``) is the same on every layout and is loaded as saved; the random
states belong to the old layout's processes and are re-seeded (the data order does not depend on them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.errors import ConfigError

FORMAT = 1
INDEX_FILE = "neutral.json"
SHARD_BYTES = 2 * 2**30
WEIGHT = "param"  # the key prefix of a weight; an optimizer state's is its own name (exp_avg, ...)

Log = Callable[[str], None]


def key(kind: str, name: str) -> str:
    return f"{kind}/{name}"


@dataclass
class Entry:
    """One parameter: its fp32 weight and optimizer states (full tensors, CPU), and the optimizer's step for it."""

    name: str
    weight: Any
    states: dict[str, Any] = field(default_factory=dict)
    step: float | None = None


@dataclass
class Source:
    """A checkpoint's state by parameter, opened (headers and metadata read, no tensor): ``params``, each parameter
    with optimizer states and the bytes its fp32 weight and states take in the neutral form (the source's order);
    ``extras``, the model's other entries (buffers, tied aliases, frozen parameters) and their bytes; ``entries``
    and ``extra_tensors`` read the named ones. A converting rank reads only its ``share``."""

    params: dict[str, int]
    extras: dict[str, int]
    entries: Callable[[list[str]], Iterator[Entry]]
    extra_tensors: Callable[[list[str]], dict[str, Any]]

    def share(self, rank: int, world: int) -> tuple[list[str], list[str]]:
        """The parameters and extras rank ``rank`` of ``world`` converts: a contiguous run of the source's order,
        split by bytes (each rank about 1/world of them; a tensor is never split)."""
        sizes = [(name, size, False) for name, size in self.params.items()]
        sizes += [(name, size, True) for name, size in self.extras.items()]
        total = max(1, sum(size for _, size, _ in sizes))
        params, extras, before = [], [], 0
        for name, size, extra in sizes:
            # the rank whose 1/world of the bytes holds the tensor's first byte
            if min(world - 1, before * world // total) == rank:
                (extras if extra else params).append(name)
            before += size
        return params, extras


# ---- writing ----------------------------------------------------------------------------------------------
def write(out: Path, entries: Iterator[Entry], extras: dict[str, Any], prefix: str = "state") -> dict[str, Any]:
    """``entries`` (the optimizer's parameters) and ``extras`` (the model's other entries) into ``out`` as
    ``<prefix>-XXXXX.safetensors`` shards of at most SHARD_BYTES; returns this part of the index (``merge``)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    pending: dict[str, Any] = {}
    size = 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            name = f"{prefix}-{len(set(files.values())):05d}.safetensors"
            save_file(pending, str(out / name), metadata={"format": "pt"})
            files.update(dict.fromkeys(pending, name))
        pending, size = {}, 0

    def add(name: str, tensor: Any) -> None:
        nonlocal size
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.is_floating_point():
            tensor = tensor.float()
        pending[name] = tensor.clone() if tensor.data_ptr() in {t.data_ptr() for t in pending.values()} else tensor
        size += tensor.numel() * tensor.element_size()
        if size >= SHARD_BYTES:
            flush()

    params: dict[str, dict[str, Any]] = {}
    steps = set()
    for entry in entries:
        add(key(WEIGHT, entry.name), entry.weight)
        for state, value in entry.states.items():
            add(key(state, entry.name), value.reshape(entry.weight.shape))
        params[entry.name] = {"shape": list(entry.weight.shape), "states": sorted(entry.states)}
        if entry.step is not None:
            steps.add(float(entry.step))
    for name, value in extras.items():
        if name not in params:
            add(key(WEIGHT, name), value)
    flush()
    return {"params": params, "extras": sorted(n for n in extras if n not in params), "files": files,
            "steps": sorted(steps)}


def merge(parts: list[dict[str, Any]], source: dict[str, Any]) -> dict[str, Any]:
    """The index of the neutral form written as ``parts`` (``write``'s, by the converting ranks)."""
    steps = {step for part in parts for step in part["steps"]}
    if len(steps) > 1:
        raise ConfigError(f"the optimizer's parameters were stepped different numbers of times ({sorted(steps)}): "
                          "the neutral form holds one step count")
    params = {name: value for part in parts for name, value in part["params"].items()}
    extras = sorted({name for part in parts for name in part["extras"]} - set(params))
    files = {name: file for part in parts for name, file in part["files"].items()}
    return {"format": FORMAT, "source": source, "step": steps.pop() if steps else None, "params": params,
            "extras": extras, "files": files}


def write_index(out: Path, index: dict[str, Any]) -> None:
    (out / INDEX_FILE).write_text(json.dumps(index, indent=1, sort_keys=True))


def read_index(view: Path) -> dict[str, Any]:
    """The neutral form's index, its shards' names kept inside ``view`` (a file it names elsewhere is refused, never
    opened)."""
    from pretrain.trust import contained

    index = json.loads((view / INDEX_FILE).read_text())
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise ConfigError(f"{view / INDEX_FILE}: neutral format {found}, this pretrain reads {FORMAT}; "
                          "delete the directory and resume again to convert the checkpoint anew")
    files = index.get("files")
    if not isinstance(files, dict) or not all(isinstance(f, str) for f in files.values()):
        raise ConfigError(f"{view / INDEX_FILE}: 'files' is not a map of tensor names to shard files; delete the "
                          "directory and resume again to convert the checkpoint anew")
    for file in set(files.values()):
        if "/" in file or "\\" in file:
            raise ConfigError(f"{view / INDEX_FILE} names {file!r}, not a shard of the directory; refused (the neutral "
                              "form's shards lie in it). Delete the directory and resume again to convert anew")
        contained(view, file, f"{view / INDEX_FILE}")
    return index


# ---- reading each engine's files (no process group) ----------------------------------------------------
def optimizer_params(model: Any, optimizer: Any) -> list[list[str]] | None:
    """Each optimizer group's parameter names, in the optimizer's order (what a one-process / DDP optimizer
    file indexes by position); None where the optimizer holds other tensors than the model's parameters
    (DeepSpeed's flat partitions)."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]
    return None if any(n is None for g in groups for n in g) else groups


def _nbytes(shape: Any, states: int = 0) -> int:
    return math.prod(shape) * 4 * (1 + states)


def from_single(checkpoint: Path, names: list[list[str]] | None, model_file: str, optimizer_file: str) -> Source:
    """A one-process / DDP checkpoint: ``model.safetensors`` and ``optimizer.bin`` (memory-mapped), whose
    positions are ``names`` (the checkpoint's recorded ``optimizer_params``)."""
    import torch
    from safetensors import safe_open

    if names is None:
        raise ConfigError(f"{checkpoint} does not record its optimizer's parameter names (written by an older "
                          "pretrain): resume it once with its own layout, then resume that run's next checkpoint "
                          "on the new layout")
    optim = torch.load(checkpoint / optimizer_file, map_location="cpu", weights_only=True, mmap=True)
    weights = safe_open(str(checkpoint / model_file), framework="pt")
    stored = set(weights.keys())
    if len(optim["param_groups"]) != len(names) or any(
            len(g["params"]) != len(n) for g, n in zip(optim["param_groups"], names, strict=True)):
        raise ConfigError(f"{checkpoint}: its optimizer's groups do not match the parameter names it records")
    index = {name: i for group, group_names in zip(optim["param_groups"], names, strict=True)
             for i, name in zip(group["params"], group_names, strict=True)}
    missing = [name for name in index if name not in stored]
    if missing:
        raise ConfigError(f"{checkpoint / model_file} lacks the parameters {missing[:3]} its optimizer holds")

    def shape(name: str) -> list[int]:
        return weights.get_slice(name).get_shape()

    def states(name: str) -> int:
        return sum(1 for k, v in optim["state"].get(index[name], {}).items() if k != "step" and hasattr(v, "numel"))

    def entries(chosen: list[str]) -> Iterator[Entry]:
        for name in chosen:
            weight = weights.get_tensor(name)
            state = optim["state"].get(index[name], {})
            yield Entry(name, weight, _shaped_states(state, weight), _step(state.get("step")))

    return Source({n: _nbytes(shape(n), states(n)) for n in index},
                  {n: _nbytes(shape(n)) for n in sorted(stored - set(index))}, entries,
                  lambda chosen: {n: weights.get_tensor(n) for n in chosen})


def from_fsdp(checkpoint: Path, model_dir: str, optimizer_dir: str) -> Source:
    """An FSDP2 checkpoint (accelerate's SHARDED_STATE_DICT: ``{"model": ...}`` and ``{"optimizer": ...}``
    through torch.distributed.checkpoint), read without a process group by key, at most SHARD_BYTES at a time."""
    from torch.distributed.checkpoint import FileSystemReader

    model_md = FileSystemReader(str(checkpoint / model_dir)).read_metadata().state_dict_metadata
    optim_md = FileSystemReader(str(checkpoint / optimizer_dir)).read_metadata().state_dict_metadata
    weights = {k.removeprefix("model."): k for k in model_md}
    per_param: dict[str, dict[str, str]] = {}
    prefix = "optimizer.state."
    for k in optim_md:
        if k.startswith(prefix):
            name, state = k[len(prefix):].rsplit(".", 1)
            per_param.setdefault(name, {})[state] = k
    missing = [n for n in per_param if n not in weights]
    if missing:
        raise ConfigError(f"{checkpoint / model_dir} lacks the parameters {missing[:3]} its optimizer holds")

    def load(directory: str, keys: list[str]) -> dict[str, Any]:
        # What torch's own converter (torch.distributed.checkpoint.format_utils.dcp_to_torch_save) calls: the
        # state dict built from the saved metadata, here for ``keys`` only
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        from pretrain.checkpoint.engine_files import flatten

        loaded: dict[str, Any] = {}
        _load_state_dict(loaded, storage_reader=FileSystemReader(str(checkpoint / directory)),
                         planner=_EmptyStateDictLoadPlanner(keys=set(keys)), no_dist=True)
        return flatten(loaded)

    def size(name: str) -> int:
        return _nbytes(model_md[weights[name]].size, sum(1 for s in per_param.get(name, {}) if s != "step"))

    def entries(chosen: list[str]) -> Iterator[Entry]:
        for chunk in _chunks(chosen, size):
            model = load(model_dir, [weights[n] for n in chunk])
            optim = load(optimizer_dir, [k for n in chunk for k in per_param[n].values()])
            for name in chunk:
                state = {s: optim[k] for s, k in per_param[name].items()}
                weight = model[weights[name]]
                yield Entry(name, weight, _shaped_states(state, weight), _step(state.get("step")))

    def extra_tensors(chosen: list[str]) -> dict[str, Any]:
        loaded = load(model_dir, [weights[n] for n in chosen]) if chosen else {}
        return {k.removeprefix("model."): v for k, v in loaded.items()}

    return Source({n: size(n) for n in per_param}, {n: size(n) for n in weights if n not in per_param}, entries,
                  extra_tensors)


def from_zero(deepspeed_dir: Path) -> Source:
    """A DeepSpeed ZeRO-1/2/3 checkpoint: each parameter's fp32 master and optimizer states gathered from every
    rank's memory-mapped flat partition (``weights.ZeroFiles``), one parameter at a time."""
    from pretrain.checkpoint.engine_files import ZeroFiles

    files = ZeroFiles(deepspeed_dir)
    weights = files.weights()
    states, step = files.states()
    trainable = [n for n in files.trainable() if n in weights]

    def entries(chosen: list[str]) -> Iterator[Entry]:
        for name in chosen:
            weight = weights[name].contiguous()
            yield Entry(name, weight, {s: v[name].contiguous() for s, v in states.items() if name in v}, step)

    return Source({n: _nbytes(weights[n].shape, len(states)) for n in trainable},
                  {n: _nbytes(v.shape) for n, v in weights.items() if n not in set(trainable)}, entries,
                  lambda chosen: {n: weights[n].contiguous() for n in chosen})


def _shaped_states(state: dict[str, Any], weight: Any) -> dict[str, Any]:
    """The optimizer states that are tensors of the parameter's size (not ``step``)."""
    return {k: v for k, v in state.items()
            if k != "step" and hasattr(v, "numel") and v.numel() == weight.numel()}


def _step(value: Any) -> float | None:
    return None if value is None else float(value)


def _chunks(names: list[str], size: Callable[[str], int]) -> Iterator[list[str]]:
    chunk, total = [], 0
    for name in names:
        chunk.append(name)
        total += size(name)
        if total >= SHARD_BYTES:
            yield chunk
            chunk, total = [], 0
    if chunk:
        yield chunk


# ---- loading into the layout of this run (every rank, after accelerator.prepare) ---------------------------
def load(view: Path, model: Any, optimizer: Any, deepspeed_engine: Any = None, log: Log = print) -> list[str]:
    """The weights and optimizer states of the neutral form ``view`` into this run's ``model`` (unwrapped:
    the parameters' own names) and ``optimizer`` (torch's), or into the DeepSpeed engine. Returns the
    parameters that have no optimizer state in the source (started fresh; normally none)."""
    index = read_index(view)
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in index["params"] and n not in index["extras"]]
    if missing:
        raise ConfigError(f"{view}: no state for this model's parameters {missing[:3]}: the checkpoint holds "
                          "another model")
    for name, p in params.items():
        saved = index["params"].get(name)
        shape = list(getattr(p, "ds_shape", p.shape))
        if saved is not None and saved["shape"] != shape:
            raise ConfigError(f"{view}: {name} has shape {saved['shape']} there and {shape} in this model")
    if deepspeed_engine is not None:
        return _load_zero(view, index, deepspeed_engine, log)
    return _load_torch(view, index, model, optimizer, log)


def _read_line(view: Path, index: dict[str, Any], read: int, share: str) -> str:
    total = sum((view / f).stat().st_size for f in set(index["files"].values()))
    return f"resume: this rank read {read / 2**20:.2f} MiB of the neutral form's {total / 2**20:.2f} MiB ({share})"


def _load_torch(view: Path, index: dict[str, Any], model: Any, optimizer: Any, log: Log = print) -> list[str]:
    import torch
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint import load as dcp_load

    from pretrain.checkpoint.engine_files import SAFETENSORS_DTYPES

    class CountingReader(HuggingFaceStorageReader):
        """torch's safetensors reader (each request a slice, read as such), counting the bytes it reads."""

        read = 0

        def _process_read_request(self, f, req, planner):
            part = f.get_slice(req.storage_index.fqn)
            itemsize = getattr(torch, SAFETENSORS_DTYPES[part.get_dtype()]).itemsize
            CountingReader.read += math.prod(req.lengths) * itemsize
            return super()._process_read_request(f, req, planner)

    _create_states(optimizer)
    by_id = {id(p): n for n, p in model.named_parameters()}
    request: dict[str, Any] = {}
    fresh = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = by_id[id(p)]
            request[key(WEIGHT, name)] = p.data
            saved = index["params"].get(name)
            if saved is None:
                fresh.append(name)
                continue
            state = optimizer.state[p]
            for s in saved["states"]:
                if s not in state:
                    raise ConfigError(f"{view}: {name} holds optimizer state {s!r}, which this run's optimizer "
                                      f"({type(optimizer).__name__}) lacks: resume with the optimizer that wrote it")
                request[key(s, name)] = state[s]
            if index["step"] is not None and "step" in state:
                step = state["step"]
                state["step"] = step.fill_(index["step"]) if torch.is_tensor(step) else index["step"]
    for name, buffer in model.named_buffers():
        if key(WEIGHT, name) in index["files"]:
            request[key(WEIGHT, name)] = buffer
    with torch.no_grad():
        dcp_load(request, storage_reader=CountingReader(str(view)))
    sharded = any(type(t).__name__ == "DTensor" for t in request.values())
    log(_read_line(view, index, CountingReader.read, "its shards' slices" if sharded else "a full replica"))
    return fresh


def _load_zero(view: Path, index: dict[str, Any], engine: Any, log: Log = print) -> list[str]:
    """Each rank reads only its share: of every tensor, the flat range its ZeRO partition (ZeRO-3) or fragment
    (ZeRO-1/2: DeepSpeed's ``_hp_mapping``) holds, through safetensors' slices (whole rows: at most a row more
    on each side), and sets it where DeepSpeed's ``safe_set_full_*`` would (they take the full tensor)."""
    import torch
    from safetensors import safe_open

    zero = engine.optimizer
    base = zero.optimizer
    # The flat fp32 partitions' states, as the optimizer's first step would create them (DeepSpeed steps one
    # sub-group's partition at a time under ZeRO-3: base.param_groups hold only the last one)
    flats = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
    names = sorted({s for saved in index["params"].values() for s in saved["states"]})
    for flat in flats:
        state = base.state[flat]
        for s in names:
            state.setdefault(s, torch.zeros_like(flat))
        if index["step"] is not None:
            state.setdefault("step", torch.tensor(0.0))
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero._lazy_init_hp_params_optimizer_state()  # ZeRO-1/2: link each parameter to its states' fragments
    handles: dict[str, Any] = {}
    read = [0]

    def handle(k: str) -> Any:
        file = index["files"][k]
        if file not in handles:
            handles[file] = safe_open(str(view / file), framework="pt")
        return handles[file]

    def tensor(k: str) -> Any:
        value = handle(k).get_tensor(k)
        read[0] += value.numel() * value.element_size()
        return value

    def flat_range(k: str, start: int, length: int) -> Any:
        """Elements [start, start + length) of tensor ``k`` flattened, reading the rows that hold them only."""
        part = handle(k).get_slice(k)
        shape = part.get_shape()
        if len(shape) == 0:
            return tensor(k).flatten()[start:start + length]
        row = math.prod(shape[1:])
        first, last = start // row, -(-(start + length) // row)
        rows = part[first:last]
        read[0] += rows.numel() * rows.element_size()
        return rows.flatten()[start - first * row:start - first * row + length]

    def set_share(param: Any, name: str, state: str | None) -> None:
        k = key(WEIGHT if state is None else state, name)
        if not hasattr(param, "ds_id"):  # ZeRO-1/2: deepspeed's set_full_hp_param, on the fragment alone
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None:
                return  # no fragment of it in this rank's partition
            address = mapping.lp_fragment_address
            mapping.get_hp_fragment(state).data.copy_(flat_range(k, address.start, address.numel))
            return
        # ZeRO-3: what safe_set_full_* calls (stage3.set_full_hp_param), for a partition that holds padding too:
        # deepspeed 0.19.8 reads past the value's end on the last rank when the size does not divide by the ranks
        partition, _ = zero._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=state)
        start = partition.numel() * zero._get_param_partition_rank(param)
        piece = flat_range(k, start, max(0, min(partition.numel(), param.ds_numel - start)))
        partition.data.zero_()
        partition.data[:piece.numel()].copy_(piece)

    fresh = []
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            saved = index["params"].get(name)
            set_share(p, name, None)
            if saved is None:
                fresh.append(name)
                continue
            for s in saved["states"]:
                set_share(p, name, s)
        if index["step"] is not None:
            for state in base.state.values():
                if "step" in state:
                    step = state["step"]
                    state["step"] = step.fill_(index["step"]) if torch.is_tensor(step) else index["step"]
        if hasattr(zero, "update_lp_params"):  # ZeRO-1/2: the working copies from the fp32 partitions
            zero.update_lp_params()
        else:  # ZeRO-3: as its universal load does
            for group_id, fp32 in enumerate(zero.fp32_partitioned_groups_flat):
                zero.fp16_partitioned_groups_flat[group_id].data.copy_(fp32.data)
            for group_id, flat in enumerate(zero.fp16_partitioned_groups_flat):
                for partitioned, q in zip(zero.fp16_partitioned_groups[group_id],
                                          zero.unflatten(flat, zero.fp16_partitioned_groups[group_id]), strict=True):
                    partitioned.data = q.data
        for name, buffer in engine.module.named_buffers():
            if key(WEIGHT, name) in index["files"]:
                buffer.copy_(tensor(key(WEIGHT, name)))
    log(_read_line(view, index, read[0], f"its share of {engine.dp_world_size} ZeRO partitions"))
    return fresh


def _create_states(optimizer: Any) -> None:
    """The optimizer's per-parameter states, created as torch's state_dict API creates them
    (``torch.distributed.checkpoint.state_dict._init_optim_state``): one step with zero gradients and lr 0, which
    changes no parameter. The class's own ``step``: the run's gate wraps the instance's (train/stability.py)."""
    import torch

    if optimizer.state:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.0) if torch.is_tensor(group["lr"]) else 0.0
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    type(optimizer).step(optimizer)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def scheduler_state(state: dict[str, Any], groups: int) -> dict[str, Any]:
    """A saved LR scheduler state for ``groups`` parameter groups: the per-group lists of another layout's
    optimizer (every group follows the one schedule) widened or narrowed to this one's."""
    state = dict(state)
    for name in ("base_lrs", "_last_lr"):
        values = state.get(name)
        if isinstance(values, list) and values and len(values) != groups:
            if len(set(values)) != 1:
                raise ConfigError(f"the checkpoint's scheduler holds {len(values)} groups with different "
                                  f"learning rates ({values}); this run's optimizer has {groups}")
            state[name] = [values[0]] * groups
    return state


def size_gib(view: Path) -> float:
    return sum(f.stat().st_size for f in view.glob("*.safetensors")) / 2**30

