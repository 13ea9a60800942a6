"""The run's own state, registered once: what a checkpoint records besides the accelerator's.

Every stateful part of a run (its progress, the stability rules' window, the rollbacks, the schedule's rule, and what
later features add) has ``state_dict()`` / ``load_state_dict()`` and is registered by name in one ``RunState``, as
torchtitan's trainer registers its ``states`` with its checkpointer. A checkpoint writes the mapping's state dicts
into ``trainer_state.json`` (a ``TrainerState``); a resume and a rollback load them back with the same one call, in
registration order (a part may read a part registered before it). Model, optimizer, scheduler, loss scaler and RNG
are the accelerator's (``save_state``), not listed here.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from pretrain.checkpoint.rundir import read_state, saved_rollbacks

PROGRESS = "progress"  # the part whose state is the record's step, tokens_seen and num_steps


class Stateful(Protocol):
    """What ``RunState`` registers: torch's ``Stateful`` protocol, with JSON-able state."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class TrainProgress:
    """Where the run is: optimizer steps done (also the data cursor) and the tokens they trained on. ``num_steps`` is
    recorded (pretrain-slurm status prints step/num_steps) but not loaded: the horizon is this recipe's."""

    num_steps: int
    step: int = 0
    tokens_seen: int = 0

    def advance(self, tokens: int) -> None:
        self.step += 1
        self.tokens_seen += tokens

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


class RunState:
    """The run's stateful parts by name, in the order they are loaded."""

    def __init__(self, log: Callable[[str], None] = print, **parts: Stateful):
        self.parts: dict[str, Stateful] = {}
        self.log = log
        for name, part in parts.items():
            self.register(name, part)

    def register(self, name: str, part: Stateful) -> None:
        if name in self.parts:
            raise ValueError(f"a run state part named {name!r} is registered already")
        self.parts[name] = part

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        """Each part its saved state, in registration order. A part the checkpoint has no state for (it was saved
        before the part existed) keeps the state it was built with, and says so; unless the part says what such a
        checkpoint meant (``state_when_absent``: the sample order's version 1)."""
        for name, part in self.parts.items():
            if name in states:
                part.load_state_dict(states[name])
            elif getattr(part, "state_when_absent", None) is not None:
                part.load_state_dict(part.state_when_absent)
            else:
                self.log(f"resume: the checkpoint holds no {name!r} state (saved by an older pretrain): it starts "
                         "afresh")


@dataclass(frozen=True)
class TrainerState:
    """``trainer_state.json``: the run state's parts (``progress`` at the top: what status and every reader of a
    checkpoint reads first; the others under ``components``) and what the resume checks read (plan, recipe,
    layout, data)."""

    step: int  # optimizer steps done; also the data cursor
    tokens_seen: int
    num_steps: int  # the horizon when saved (pretrain-slurm status prints step/num_steps)
    plan: dict[str, Any]  # BatchPlan.to_dict() when saved
    recipe: dict[str, Any]  # the resolved recipe when saved: the compatibility check reads it
    layout: dict[str, Any] | None = None  # Launch.to_dict() when saved (None: saved before it was recorded)
    data: dict[str, Any] | None = None  # the token store(s) trained on (pretrain.data.data_identity; None: older)
    components: dict[str, Any] = field(default_factory=dict)  # every other registered part's state, by name
    # each optimizer group's parameter names in the optimizer's order: how a one-process / DDP optimizer file,
    # indexed by position, is read by name (pretrain/checkpoint/neutral.py); None under DeepSpeed (flat partitions)
    optimizer_params: list[list[str]] | None = None
    python: str = field(default_factory=lambda: sys.version.split()[0])
    torch: str = field(default_factory=lambda: _torch_version())
    saved_at: float | None = None  # time.time() of the save

    @classmethod
    def of(cls, states: dict[str, Any], **record: Any) -> TrainerState:
        """The record of ``RunState.state_dict()`` (``record``: plan, recipe, layout, data)."""
        progress = states[PROGRESS]
        components = {name: state for name, state in states.items() if name != PROGRESS}
        return cls(step=progress["step"], tokens_seen=progress["tokens_seen"], num_steps=progress["num_steps"],
                   components=components, **record)

    def states(self) -> dict[str, Any]:
        """What ``RunState.load_state_dict`` takes."""
        return {PROGRESS: {"step": self.step, "tokens_seen": self.tokens_seen, "num_steps": self.num_steps},
                **self.components}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainerState:
        """Keys this class does not know are ignored. A record written before the parts were registered (top-level
        ``stability`` and ``rollbacks``) is read as the parts that now hold them."""
        values = dict(values)
        if "components" not in values:
            legacy = {}
            if values.get("stability") is not None:
                legacy["stability"] = values["stability"]
            legacy["rollback"] = saved_rollbacks(values)
            values["components"] = legacy
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def from_json(cls, text: str) -> TrainerState:
        return cls.from_dict(json.loads(text))

    @classmethod
    def read(cls, checkpoint: str | Path) -> TrainerState | None:
        """The state of a complete checkpoint, or None (incomplete, or not a checkpoint)."""
        values = read_state(checkpoint)
        return None if values is None else cls.from_dict(values)


def _torch_version() -> str:
    import torch  # only when a record is made: readers of checkpoints (pretrain-slurm status) need no torch

    return torch.__version__
