"""Preemption: SIGTERM / SIGUSR1 mean "stop after the optimizer step in flight, with a checkpoint".

SLURM (``--signal``), Kubernetes and most schedulers send one of them some time before the kill. The
handlers only set a flag; they are installed for the training loop and the previous ones are restored
after it, also when the loop raises.
"""

from __future__ import annotations

import signal

import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """``with StopSignals() as stop:`` records a stop signal in ``stop.received`` instead of dying."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            # None: the previous handler was not installed from Python; the default is the closest.
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        # Only a flag: the loop finishes the optimizer step in flight, then every rank stops at the same step.
        self.received = signum

    def agreed(self, accelerator) -> bool:
        """Whether any rank was asked to stop. Every rank gets the same answer for this step, so every
        rank must call this at the same steps."""
        flag = 1.0 if self.received is not None else 0.0
        if accelerator.num_processes == 1:
            return flag > 0
        # Expensive device-to-host synchronization (one scalar per optimizer step), as in Megatron's
        # exit-signal handler: ranks are signalled microseconds apart, possibly in different steps.
        agreed = accelerator.reduce(torch.tensor([flag], device=accelerator.device), reduction="sum")
        return agreed.item() > 0
