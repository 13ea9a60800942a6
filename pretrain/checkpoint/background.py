"""Asynchronous checkpoints (``checkpoint.async``): the loop waits for a copy of the states in host memory,
a thread writes the files.

The files are accelerate's ``save_state``'s own, byte for byte the same format as a synchronous save:
``save_state`` runs as always on the loop's thread and decides every file (each engine's layout, the RNG
states, DeepSpeed's ``latest`` and recovery script), but while it runs (``StagedSave.capturing``) the calls that
write tensors are taken over on that thread only, for files inside the checkpoint being written:

- ``torch.save`` (accelerate's optimizer, scheduler, scaler and RNG files; DeepSpeed's model and ZeRO files
  through its default ``TorchCheckpointEngine``) and accelerate's safetensors ``save_file`` (the model of DDP
  and one process): the object is copied (tensors to new CPU tensors, everything else deep-copied) and the
  call is made later, by the writer thread, with the copy;
- ``torch.distributed.checkpoint.save`` (FSDP2's sharded model and optimizer, as accelerate writes them for
  ``SHARDED_STATE_DICT``) becomes ``torch.distributed.checkpoint.async_save``: DCP stages the shards to CPU
  itself, then plans and writes in a thread of its own over a gloo process group of the checkpointer's, one per
  DCP save (collectives of other threads must not share the loop's group, nor each other's).

The copy is what the loop waits for; the training state may change as soon as ``save_state`` returns. The
writer thread then writes the files, checksums its rank's share, and rank 0 writes the manifest and renames
``.tmp-step_X`` into place and updates ``latest`` exactly as a synchronous save does (``Checkpointer``), so a
kill at any moment leaves the previous checkpoint as ``latest``. One write is in flight at a time: the next
save, and the end of the run, wait for it. Host memory: one copy of the rank's checkpoint states
(``pretrain/plan/memory``'s ``checkpoint`` host term).

DeepSpeed 0.19.8 has asynchronous engines of its own behind ``checkpoint.writer`` (``FastCheckpointEngine``:
DeepNVMe's ``async_io`` op, GPU and libaio; with ``decoupled: true`` a writer process that commits at the next
optimizer step) and DataStates (an external package). pretrain does not use them: they complete on their own
schedule, outside the manifest and the rename that make a checkpoint trusted, and need an op not built on CPU
(a user's JSON asking for the decoupled writer, or for its writer with checkpoint.async, is refused:
``pretrain/distributed/deepspeed.py``). The copy above goes through DeepSpeed's default engine, so the files are
the ones DeepSpeed's loader and converters read.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

from pretrain.trust import is_inside

# A test hook: "STEP:SECONDS" makes the background write of step STEP's checkpoint pause SECONDS after its first
# file (the tests kill a run while that write is in flight, half written). Unset in any real run.
SLOW_WRITE_ENV = "PRETRAIN_TEST_SLOW_CHECKPOINT_WRITE"


def injected_write_delay(step: int) -> float:
    value = os.environ.get(SLOW_WRITE_ENV, "")
    if not value:
        return 0.0
    slow_step, seconds = value.split(":")
    return float(seconds) if int(slow_step) == step else 0.0


class StagedSave:
    """One checkpoint's tensor writes, captured on the loop's thread and made later by the writer thread."""

    def __init__(self, directory: Path, dcp_group: Callable[[int], Any] = lambda index: None):
        self.directory = Path(directory)
        # The process group the index-th DCP save of this checkpoint coordinates over (None: the default): each
        # async_save plans and writes in a thread of its own, so two of them (model, optimizer) at once need two
        # groups, or their collectives could pair across ranks.
        self.dcp_group = dcp_group
        self.writes: list[Callable[[], Any]] = []
        self.futures: list[Any] = []
        self.staged_bytes = 0
        self.pause_s = 0.0  # the test hook's pause (SLOW_WRITE_ENV)

    def _copy(self, obj: Any, whole_storages: bool) -> Any:
        """``obj`` with every tensor copied to new CPU memory (even on CPU: ``.to("cpu")`` alone would alias the
        live state the loop goes on updating) and everything else deep-copied. ``whole_storages`` (for
        ``torch.save``, which writes whole storages and keeps their sharing): each storage is copied once and
        its tensors are rebuilt as the same views of the copy, so the file is what the live objects would give."""
        storages: dict[tuple, torch.UntypedStorage] = {}

        def leaf(value):
            if not isinstance(value, torch.Tensor):
                return copy.deepcopy(value)
            if not whole_storages or type(value) not in (torch.Tensor, torch.nn.Parameter) or value.is_meta:
                copied = value.detach().to("cpu", copy=True)
                self.staged_bytes += copied.numel() * copied.element_size()
                return copied
            storage = value.untyped_storage()
            key = (storage.device, storage.data_ptr(), storage.nbytes())
            if key not in storages:
                storages[key] = storage.clone() if storage.device.type == "cpu" else storage.cpu()
                self.staged_bytes += storage.nbytes()
            return torch.empty(0, dtype=value.dtype).set_(storages[key], value.storage_offset(), value.size(),
                                                          value.stride())

        return tree_map(leaf, obj)

    def _ours(self, thread: int, target: Any) -> bool:
        return (threading.get_ident() == thread and isinstance(target, (str, os.PathLike))
                and is_inside(Path(target), self.directory))

    @contextmanager
    def capturing(self) -> Iterator[StagedSave]:
        """Within: this thread's tensor writes into the checkpoint are copied and deferred (module docstring)."""
        import accelerate.utils.other as accelerate_other
        import torch.distributed.checkpoint as dcp

        thread = threading.get_ident()
        torch_save, safe_save_file, dcp_save = torch.save, accelerate_other.safe_save_file, dcp.save

        def save(obj, f, *args, **kwargs):
            if not self._ours(thread, f):
                return torch_save(obj, f, *args, **kwargs)
            self.writes.append(partial(torch_save, self._copy(obj, whole_storages=True), f, *args, **kwargs))
            return None

        def save_file(tensors, filename, *args, **kwargs):
            if not self._ours(thread, filename):
                return safe_save_file(tensors, filename, *args, **kwargs)
            copied = self._copy(tensors, whole_storages=False)  # safetensors writes each tensor's own bytes
            self.writes.append(partial(safe_save_file, copied, filename, *args, **kwargs))
            return None

        def save_dcp(state_dict, *, checkpoint_id=None, storage_writer=None, planner=None, process_group=None,
                     **kwargs):
            target = checkpoint_id if checkpoint_id is not None else getattr(storage_writer, "path", None)
            if not self._ours(thread, target):
                return dcp_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                                planner=planner, process_group=process_group, **kwargs)
            self.staged_bytes += _tensor_bytes(state_dict)
            response = dcp.async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                                      planner=planner, process_group=self.dcp_group(len(self.futures)))
            self.futures.append(getattr(response, "upload_completion", response))
            return None

        torch.save, accelerate_other.safe_save_file, dcp.save = save, save_file, save_dcp
        try:
            yield self
        finally:
            torch.save, accelerate_other.safe_save_file, dcp.save = torch_save, safe_save_file, dcp_save

    def write(self) -> None:
        """The deferred writes, then DCP's background saves (the writer thread; raises what they raise)."""
        for index, write in enumerate(self.writes):
            write()
            if index == 0 and self.pause_s:
                time.sleep(self.pause_s)
        self.writes.clear()
        for future in self.futures:
            future.result()
        self.futures.clear()


def _tensor_bytes(state_dict: Any) -> int:
    total = 0

    def leaf(value):
        nonlocal total
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor's shard on this rank
            total += local.numel() * local.element_size()
        return value

    tree_map(leaf, state_dict)
    return total


def gather_over(group: Any, value: Any) -> list[Any]:
    """Every rank's ``value`` over ``group`` (the writer thread's own process group; [value] for one process)."""
    if group is None:
        return [value]
    out: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, value, group=group)
    return out


class Writer:
    """The one background write of a checkpointer: at most one in flight."""

    def __init__(self) -> None:
        self.pending: Future | None = None
        self.thread: threading.Thread | None = None

    def submit(self, job: Callable[[], Any]) -> None:
        assert self.pending is None, "a checkpoint write is still in flight: wait() for it first"
        future: Future = Future()

        def run():
            try:
                future.set_result(job())
            except BaseException as exc:  # handed to the loop's thread, which raises it at wait()
                future.set_exception(exc)

        # Not a daemon: an interpreter that exits normally finishes the write first (a kill -9 cannot; the
        # checkpoint then stays under its temporary name and `latest` names the previous one).
        self.thread = threading.Thread(target=run, name="pretrain-checkpoint-writer")
        self.pending = future
        self.thread.start()

    def wait(self) -> Any:
        """The in-flight write's result (None if there is none); raises what it raised."""
        if self.pending is None:
            return None
        pending, thread = self.pending, self.thread
        self.pending = self.thread = None
        thread.join()
        return pending.result()
