"""Every rank agrees: the one place where what one rank finds becomes every rank's decision.

A run of N processes must never have one rank stop while the others wait for it in a collective (they would hang
until the collective timeout, or die with the backend's traceback). Every refusal or failure found by one rank
during set-up, resume, rollback, load or save goes through one of three doors, each used the same way everywhere:

- ``rank_problems`` (collective, every rank at the same point): every rank's problem or None, gathered onto every
  rank as ``"rank 3 (host b) <problem>"`` lines; every rank then raises the same error, or goes on, together. The
  shared output directory's check, the resume's checks (the checkpoint each rank sees, its checksums, the trust
  check of its own files), a save's disk-full and non-finite checks.
- ``from_rank0`` (collective): a decision only rank 0 can make (which checkpoint to resume or roll back to, whether
  the final export's tokenizer reads back), given to every rank, so that every rank acts on the same one.
- ``refuse`` / ``peer_refusal``: a rank that refuses alone, where no collective brings the ranks together (inside a
  library's load, for one rank's own file): its message goes into the process group's store, the first of the run
  kept, and a peer whose next collective fails because it left prints that message and exits 2 instead of its
  backend's traceback (``supervise.run_worker``).

Each ends the run the same way on every rank: one message (rank 0 prints it), exit 2 for a refusal.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

from accelerate.utils import broadcast_object_list, gather_object

REFUSAL_KEY = "pretrain/refusal"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def rank_problems(accelerator, problem: str | None) -> list[str]:
    """Every rank's problem (None: none), gathered onto every rank as ``"rank 3 (host b) <problem>"`` lines,
    ranks with the same host and problem merged. Collective: every rank calls it, and every rank gets the
    same list, so every rank raises (or goes on) together instead of some waiting forever for the others."""
    return merge_problems(gather_object([(socket.gethostname(), problem)]))


def merge_problems(gathered: list[tuple[str, str | None]]) -> list[str]:
    """Every rank's (host, problem or None), in rank order, as rank_problems words them."""
    merged: dict[tuple[str, str], list[int]] = {}
    for rank, (host, found) in enumerate(gathered):
        if found is not None:
            merged.setdefault((host, found), []).append(rank)
    return [f"{_ranks(ranks)} (host {host}) {found}" for (host, found), ranks in merged.items()]


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (what the others pass is ignored). Collective; a picklable value."""
    [value] = broadcast_object_list([value])
    return value


def _store():
    """The default process group's key-value store (torchrun's TCPStore), or None without one."""
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.distributed_c10d._get_default_store()


def refuse(message: str) -> None:
    """This rank stops the run with ``message`` (a ConfigError: exit 2): recorded in the process group's store,
    the first refusal of the run kept, so that a rank whose next collective fails because this one has left
    says the same thing instead of its backend's traceback (``supervise.run_worker``). A refusal that every rank
    reaches together is decided before any collective (``rank_problems``); this is for the rest. Nothing is
    recorded without a process group, and a store that cannot be reached is passed over: the refusal is still
    this rank's exit 2 and message."""
    try:
        store = _store()
        if store is not None:
            import torch.distributed as dist

            store.compare_set(REFUSAL_KEY, "", f"rank {dist.get_rank()} (host {socket.gethostname()}) {message}")
    except Exception:  # noqa: BLE001 - the store lives in a peer that may have left too
        pass


def peer_refusal() -> str | None:
    """The run's refusal another rank recorded (``refuse``), or None."""
    try:
        store = _store()
        if store is not None and store.check([REFUSAL_KEY]):
            return store.get(REFUSAL_KEY).decode()
    except Exception:  # noqa: BLE001 - unreachable: no refusal known
        return None
    return None
