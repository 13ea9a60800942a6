"""The processes of a launch working together before their process group exists, through the launcher's store.

A resume that converts a checkpoint runs before the process group exists: a conversion of a 70B checkpoint takes
longer than any collective timeout, and a rank waiting in a collective for it would be killed. The ranks still
share the work (each converts and checks its share) and must agree on it; they do so through the key-value store
torchrun's agent hosts for them (``TORCHELASTIC_USE_AGENT_STORE``, at ``MASTER_ADDR:MASTER_PORT``; accelerate
launch starts torchrun), the one the process group connects to later, with a timeout of pretrain's own (hours, not
the collective's minutes). Keys live under ``pretrain/<attempt>/<scope>/`` (the attempt: torchrun's restart count),
so a restarted attempt and each exchange of one attempt have their own; every rank opens the same scopes in the
same order.

``Peers.of_launch`` is None where there is no such store (one process; a launcher other than torchrun): the
callers then do the work on rank 0 alone, the others waiting on the filesystem (reshard's fallback).
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from pretrain.distributed.layout import Launch, launcher_store
from pretrain.errors import ConfigError

TIMEOUT_S = 4 * 3600.0  # how long a rank waits for a peer's key (a conversion of a 70B checkpoint by one rank)


class Peers:
    """This rank and ``world`` others, exchanging JSON values by key in one scope of the launcher's store."""

    def __init__(self, store: Any, rank: int, world: int, prefix: str, timeout_s: float = TIMEOUT_S):
        self._store, self.rank, self.world, self._prefix, self.timeout_s = store, rank, world, prefix, timeout_s
        self._scopes = 0

    @classmethod
    def of_launch(cls, launch: Launch, timeout_s: float = TIMEOUT_S) -> Peers | None:
        where = launcher_store()
        if where is None or launch.world_size <= 1:
            return None
        from torch.distributed import TCPStore

        host, port, attempt = where
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        return cls(store, launch.rank, launch.world_size, f"pretrain/{attempt}", timeout_s)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def scope(self, name: str) -> Peers:
        """A fresh namespace for one exchange (every rank calls ``scope`` with the same names in the same order)."""
        self._scopes += 1
        return Peers(self._store, self.rank, self.world, f"{self._prefix}/{self._scopes}-{name}", self.timeout_s)

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def _get(self, name: str, what: str) -> Any:
        try:
            return json.loads(self._store.get(self._key(name)))
        except RuntimeError as exc:  # the store's timeout (DistStoreError) or its host gone
            raise ConfigError(f"waited {self.timeout_s / 3600:.1f} h for {what} ({exc}); check that rank's log") from None

    def publish(self, name: str, value: Any) -> None:
        """This rank's ``value`` under ``name`` (read by ``gather`` or by rank 0's ``decide``)."""
        self._store.set(self._key(f"{name}/{self.rank}"), json.dumps(value))

    def gather(self, name: str) -> list[Any]:
        """Every rank's published ``name``, by rank (rank 0 calls it; each waits up to the timeout)."""
        return [self._get(f"{name}/{rank}", f"rank {rank}'s {name}") for rank in range(self.world)]

    def decide(self, name: str, value: Any = None) -> Any:
        """Rank 0's ``value`` on every rank (rank 0 passes it; the others wait for it)."""
        if self.is_main:
            self._store.set(self._key(name), json.dumps(value))
            return value
        return self._get(name, f"rank 0's {name}")
