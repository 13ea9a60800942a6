"""What pretrain trusts of the files it reads: no code from a checkpoint, no path out of its directory.

A checkpoint is data, and may come from anyone (a shared filesystem, a copied run). Its manifest's CRCs
(``pretrain/checkpoint/integrity.py``) detect accidents, not attacks: whoever can replace a file can update its CRC.
So two rules hold for every file pretrain, or a library it calls, reads from a checkpoint:

- **No unpickling beyond torch's weights-only unpickler.** ``enforce()`` (called first by the entry point
  and pretrain-export) sets ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1``, torch's own switch that makes every
  ``torch.load`` in this process, and in the processes it starts, ``weights_only=True`` whatever the caller
  passes: DeepSpeed's checkpoint engine, ``zero_to_fp32`` and torch.distributed.checkpoint
  pass ``weights_only=False``. The few types their states hold beyond tensors and containers are allowed by
  name (``ALLOWED``, registered with ``torch.serialization.add_safe_globals``); anything else is refused
  without being constructed. DCP's ``.metadata`` is read by a plain ``pickle.load``, so ``check_files`` reads
  it first (once) with an unpickler restricted to DCP's metadata types (the standard library's ``find_class``
  hook); each entry it maps to a ``.distcp`` file must be a torch.save archive there (DCP writes every tensor
  and value as one), whose pickle is read without running it: random bytes in a shard are refused by name
  before DCP's reader fails on them in every rank. ``check_files`` runs before any load (each rank its own
  files, rank 0 before a conversion, pretrain-export on all) so that a refused file is one ConfigError naming
  the file and the type, on every rank, exit 2; ``weights_only`` turns an unpickling error raised by a load
  despite that into the same message.
- **A path read from a file stays inside its directory** (``contained``): a manifest entry inside its
  checkpoint, ``checkpoints/latest`` inside ``checkpoints/``, a recipe's name inside ``runs/``. pretrain
  moves, renames or deletes nothing outside the run's own output_dir (``owned``); ``check_output_dir``
  refuses an output_dir that is a filesystem root or the home directory. ``checkpoint.resume`` is the
  user's own choice and may name a checkpoint anywhere: it is read, never moved.

No torch import at module level: the recipe loader uses ``contained`` and ``check_output_dir``.
"""

from __future__ import annotations

import functools
import importlib
import io
import os
import pickle
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pretrain.errors import ConfigError

FORCE_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"

# The types beyond tensors and containers that the states pretrain loads hold, by module (found by loading
# real ZeRO-1/2/3, DDP and FSDP checkpoints with weights_only=True). accelerate's RNG files need numpy's,
# which accelerate allows itself (accelerate.utils.other.TORCH_SAFE_GLOBALS); they are added here too so that
# check_files reads those files as the load will.
ALLOWED = {
    "deepspeed.runtime.zero.config": ("ZeroStageEnum",),
    "deepspeed.runtime.fp16.loss_scaler": ("LossScaler", "DynamicLossScaler"),
    "deepspeed.utils.tensor_fragment": ("fragment_address",),
}
# DCP's .metadata (a plain pickle): its dataclasses, and the torch / pathlib values they hold.
DCP_METADATA = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.serialization": ("_get_layout",),
    "torch": ("Size", "strided", "contiguous_format", "preserve_format", "channels_last", "channels_last_3d",
              "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
              "float8_e4m3fn", "float8_e5m2", "complex64", "complex128"),
    "pathlib": ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"),
    "collections": ("OrderedDict",),
}
# Files that are pickles (torch.save zips, or DCP's metadata); safetensors and JSON hold no code.
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".metadata")
DCP_SHARD_SUFFIX = ".distcp"  # a DCP shard: torch.save archives end to end, mapped by the .metadata


@functools.cache
def allowed_globals() -> tuple:
    """The objects of ALLOWED that are installed (DeepSpeed's only where deepspeed is), plus accelerate's."""
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    out = list(TORCH_SAFE_GLOBALS)
    for module_name, names in ALLOWED.items():
        if importlib.util.find_spec(module_name.split(".")[0]) is None:
            continue
        module = importlib.import_module(module_name)
        out += [getattr(module, name) for name in names]
    return tuple(out)


def enforce() -> None:
    """Every torch.load of this process (and of the processes it starts) is weights-only, with ALLOWED."""
    os.environ[FORCE_ENV] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)  # torch refuses both set


@contextmanager
def weights_only(directory: Path) -> Iterator[None]:
    """Loads from ``directory``: weights-only (``enforce``) with ALLOWED registered; an unpickling refusal is
    the ConfigError ``check_files`` gives, naming the file and type (found after the fact)."""
    import torch

    enforce()
    torch.serialization.add_safe_globals(list(allowed_globals()))
    try:
        yield
    except pickle.UnpicklingError as exc:
        files = [str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()]
        raise ConfigError(check_files(directory, files) or refusal(directory, refused_global(str(exc)))) from None


def refused_global(message: str) -> str:
    """The type torch's weights-only unpickler refused, from its error message ("Unsupported global: GLOBAL
    os.makedirs was not an allowed global ..."), or its first line."""
    import re

    found = re.search(r"GLOBAL ([\w.]+)", message)
    return found.group(1) if found else message.strip().splitlines()[0]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in DCP_METADATA.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_metadata(path: Path) -> tuple[object | None, str | None]:
    """A DCP ``.metadata`` unpickled with only DCP_METADATA's types: (the metadata, None), or (None, what refused
    it: the first type it names beyond those, or why it is unreadable). Nothing else is constructed."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(io.BytesIO(f.read())).load(), None
    except pickle.UnpicklingError as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - a malformed pickle is refused, whatever it raises
        return None, f"unreadable ({type(exc).__name__}: {exc})"


def refused_types(file: Path | io.IOBase) -> list[str]:
    """The types a torch.save file (or a file-like window on one) names that the weights-only load would refuse
    (none: []); nothing is run: torch.serialization.get_unsafe_globals_in_checkpoint reads only its pickle, not
    the tensors. (DCP's ``.metadata`` is ``read_metadata``'s.)"""
    import torch

    torch.serialization.add_safe_globals(list(allowed_globals()))
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(file if isinstance(file, io.IOBase)
                                                                            else str(file)))
    except Exception as exc:  # noqa: BLE001 - a zip torch cannot read is refused, whatever it raises
        return [f"unreadable ({type(exc).__name__}: {exc})"]


def outside_storage(path: Path, metadata: object) -> str | None:
    """The refusal for a DCP ``.metadata`` (its ``metadata``, read by ``read_metadata``) that names a storage file
    outside its checkpoint directory, or None. torch's FileSystemReader reads ``directory / relative_path`` for
    every entry, wherever that leads."""
    directory = path.parent
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return (f"{path} has no storage_data: it is not the metadata torch.distributed.checkpoint writes, and "
                "pretrain does not load it. Restore the checkpoint from a copy you trust, or resume from another one")
    outside = sorted({repr(getattr(info, "relative_path", None)) for info in storage.values()
                      if not isinstance(getattr(info, "relative_path", None), str) or not info.relative_path
                      or Path(info.relative_path).is_absolute() or not is_inside(directory / info.relative_path, directory)})
    if not outside:
        return None
    return (f"{path} names storage files outside its checkpoint {directory} ({', '.join(outside[:3])}"
            f"{' ...' if len(outside) > 3 else ''}), which pretrain does not read (a path read from a file stays "
            "inside its directory). Restore the checkpoint from a copy you trust, or resume from another one")


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a seekable file of their own (a DCP entry)."""

    def __init__(self, f, offset: int, length: int):
        self._f, self._offset, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer)[: max(0, self._length - self._pos)]
        self._f.seek(self._offset + self._pos)
        read = self._f.readinto(view) or 0
        self._pos += read
        return read


def not_a_tensor_file(path: Path, what: str) -> str:
    return (f"{path} is not a tensor file torch.distributed.checkpoint writes ({what}): it was damaged or replaced, "
            "and pretrain does not read it. Restore the checkpoint from a copy you trust, or resume from another one")


def distcp_problem(path: Path, metadata: object) -> str | None:
    """The refusal for a DCP shard whose entries (as its directory's ``.metadata`` maps them) are not each a
    torch.save archive there, or name a type the weights-only load refuses; None when every entry is one (or
    the metadata names none in it). Each entry's central directory and pickle are read, not its tensors."""
    storage = getattr(metadata, "storage_data", None)
    entries = sorted(((getattr(index, "fqn", str(index)), info) for index, info in (storage or {}).items()
                      if getattr(info, "relative_path", None) == path.name), key=lambda entry: entry[1].offset)
    if not entries:
        return None
    size = path.stat().st_size
    with open(path, "rb") as f:
        for name, info in entries:
            offset, length = getattr(info, "offset", None), getattr(info, "length", None)
            if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 < length
                    and offset + length <= size):
                return not_a_tensor_file(path, f"the metadata places its entry {name} at bytes {offset!r} + "
                                               f"{length!r} of a {size:,}-byte file")
            if getattr(info, "transform_descriptors", None):
                return not_a_tensor_file(path, f"its entry {name} is stored through {info.transform_descriptors}, "
                                               "which pretrain never writes")
            window = _Window(f, offset, length)
            if not zipfile.is_zipfile(window):
                return not_a_tensor_file(path, f"its entry {name} at byte {offset:,} is not a torch.save archive")
            window.seek(0)
            refused = refused_types(window)
            if refused and refused[0].startswith("unreadable ("):
                return not_a_tensor_file(path, f"its entry {name} at byte {offset:,} is {refused[0]}")
            if refused:
                return refusal(path, f"{', '.join(refused)} (its entry {name})")
    return None


def refusal(where: Path, found: str) -> str:
    return (f"{where} holds a pickle that names {found}, which pretrain does not load: a checkpoint is "
            "read with torch.load(weights_only=True), and only tensors, containers and the types DeepSpeed and "
            "accelerate save are allowed (pretrain/trust.py). The file was not written by pretrain as it is: "
            "restore the checkpoint from a copy you trust, or resume from another one")


def not_an_archive(path: Path) -> str:
    return (f"{path} is not an archive torch.save writes (a zip since torch 1.6; every checkpoint file pretrain and "
            "the libraries it calls write is one): it was damaged or replaced, and pretrain does not read it. Restore "
            "the checkpoint from a copy you trust, or resume from another one")


def check_files(directory: Path, relpaths: Iterable[str]) -> str | None:
    """The refusal for the first file among ``relpaths`` (of ``directory``) that the loads would run or fail on:
    a pickle that names a type the load would refuse, or that is not a zip archive (the legacy format, whose
    pickle torch reads only by loading it, or bytes that are no archive at all); a DCP ``.metadata`` naming
    storage outside its directory; a DCP shard (``.distcp``) whose entries are not torch.save archives
    (``distcp_problem``, against its directory's ``.metadata``). None when there is none. Each ``.metadata`` is
    read once, also for the shards beside it (a rank checking its own shards reads rank 0's metadata)."""
    metadata: dict[Path, tuple[object | None, str | None]] = {}

    def dcp_metadata(path: Path) -> tuple[object | None, str | None]:
        if path not in metadata:
            metadata[path] = read_metadata(path) if path.is_file() else (None, None)
        return metadata[path]

    for rel in sorted(relpaths):
        path = directory / rel
        if not path.is_file():
            continue
        if path.name.endswith(".metadata"):
            found, refused = dcp_metadata(path)
            if refused:
                return refusal(path, refused)
            if outside := outside_storage(path, found):
                return outside
        elif path.name.endswith(PICKLE_SUFFIXES):
            if not zipfile.is_zipfile(path):
                return not_an_archive(path)
            refused = refused_types(path)
            if refused:
                return refusal(path, ", ".join(refused))
        elif path.name.endswith(DCP_SHARD_SUFFIX):
            found, refused = dcp_metadata(path.parent / ".metadata")
            if found is not None and refused is None and outside_storage(path.parent / ".metadata", found) is None:
                if problem := distcp_problem(path, found):
                    return problem
    return None


# ---- paths ---------------------------------------------------------------------------------------------------
def is_inside(path: Path, directory: Path) -> bool:
    """Whether ``path`` resolves (symbolic links followed) to ``directory`` or below it."""
    return Path(path).resolve().is_relative_to(Path(directory).resolve())


def contained(directory: Path, relative: str, what: str) -> Path:
    """``directory / relative``, refused (ConfigError naming ``what`` and the value) unless it resolves inside
    ``directory``: an absolute path, ``..`` or a link out are refused."""
    path = Path(directory) / relative
    if not relative or Path(relative).is_absolute() or not is_inside(path, directory) \
            or path.resolve() == Path(directory).resolve():
        raise ConfigError(f"{what} names {relative!r}, which is not inside {directory}; refused (pretrain reads "
                          f"nothing a file names outside its own directory). Correct or remove it")
    return path


def check_output_dir(output_dir: str) -> None:
    """Refuse an output_dir that is a filesystem root or the home directory: a run writes run.lock,
    metrics.jsonl and checkpoints/ into it, and moves and deletes within it."""
    resolved = Path(output_dir).resolve()
    if resolved == Path(resolved.anchor) or resolved == Path.home().resolve():
        raise ConfigError(f"output_dir = {output_dir!r} is {resolved}, a filesystem root or the home directory; "
                          "a run writes and deletes files in its output_dir: give a directory of its own, e.g. "
                          "output_dir=runs/my-run")
