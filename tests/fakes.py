"""The one stand-in for accelerate's ``Accelerator`` in the tests that run a part without a process group."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch


class FakeAccelerator:
    """One process of accelerate's Accelerator, as far as the Checkpointer (save, load) and the loop's collectives use
    it. ``save_state`` writes ``files`` ({name: bytes, or what torch.save writes}) in their order, after ``on_save``
    (called with the directory) and before raising ``fail_with``; ``load_state`` records each directory read; ``reduce`` returns this rank's value."""

    is_main_process = True
    num_processes = 1
    process_index = 0
    sync_gradients = True
    device = torch.device("cpu")

    def __init__(self, files: dict[str, Any] | None = None, *, fail_with: BaseException | None = None,
                 gradient_accumulation_steps: int = 1,
                 on_save: Callable[[Path], None] | None = None):
        self.files = files if files is not None else {"model.safetensors": b"weights"}
        self.fail_with = fail_with
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.on_save = on_save
        self.loads: list[str] = []  # the directories load_state read

    @property
    def loaded(self) -> str | None:
        return self.loads[-1] if self.loads else None

    def wait_for_everyone(self) -> None:
        pass

    def save_state(self, path, safe_serialization=True) -> None:
        if self.on_save is not None:
            self.on_save(Path(path))
        Path(path).mkdir(parents=True, exist_ok=True)
        for name, content in self.files.items():
            if isinstance(content, bytes):
                (Path(path) / name).write_bytes(content)
            else:
                torch.save(content, Path(path) / name)
        if self.fail_with is not None:
            raise self.fail_with

    def load_state(self, path) -> None:
        self.loads.append(path)

    def reduce(self, tensor, reduction):
        return tensor

    def accumulate(self, model):
        return nullcontext()


class CountingPart:
    """A stateful part of the run as a later feature adds one (pretrain/checkpoint/state.py's protocol): a count."""

    def __init__(self):
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        self.count = 0 if state is None else state["count"]
