"""Preemption and Ctrl-C: SIGTERM / SIGUSR1 / SIGINT mean "stop after the optimizer step in flight, with a
checkpoint".

SLURM (``--signal``), Kubernetes and most schedulers send SIGTERM or SIGUSR1 some time before the kill. Ctrl-C
sends SIGINT: to ``python pretrain/run.py`` directly; under ``accelerate launch`` (torchrun) to the launcher
only (torchrun starts each worker in a session of its own), whose elastic agent sends SIGINT on to every
worker, waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default 30) for them to exit, then SIGKILLs them;
under ``pretrain-launch`` to pretrain-launch only, which sends it to the workers itself, so that torchrun
does not report the stop as its own failure (``supervise.run_launcher``).
The handlers are installed by the entry point before the trainer is built and kept until the process ends
(``run.py``), so a signal is never lost because the run was elsewhere than the loop. While the run starts
(building the token store, the model, loading the checkpoint: ``immediate``) a signal raises ``StopRequested`` at
once, since nothing has been trained that a checkpoint would keep (a store build keeps its finished shards); from
the loop on, the handlers only set a flag: the optimizer step in flight finishes (with its evaluation, and its
checkpoint write, also an asynchronous one), then every rank checkpoints and stops. A signal during the final
export lets it finish: the run is complete. The previous handlers are restored at the end, also when the run
raises. A second Ctrl-C is the user insisting: it goes to the previous handler
(Python's KeyboardInterrupt), so the process stops at once. SIGINTs within ``supervise.CTRL_C_WINDOW_S`` (1 s)
of a Ctrl-C's first are that same Ctrl-C, not a second one (``supervise.CtrlC``: a wrapper that passes the
terminal's SIGINT on to its child delivers it twice). (Under torchrun the second Ctrl-C ends the agent, and every
worker dies with it: ``supervise.stop_with_launcher``.)

Every rank must stop after the same step. With several processes the flags are summed by a non-blocking
all-reduce on a host-side (gloo) group, started after step k and read after step k+1: the step never waits
for the device or the network for it (Megatron all-reduces a device tensor every step, which is a
device-to-host synchronisation per step). The price is one step of latency between the signal and the stop,
well inside any scheduler's grace period.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pretrain.distributed.supervise import CtrlC

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
SIGNAL_AT_ENV = "PRETRAIN_TEST_SIGNAL"  # test hook: "<point>[:<step>[:<rank>]]" (signal_hook)
# test hook: "<point>:<step>:<seconds>[,...]": there, every rank pauses that long after rank 0 has created the file
# <point>-<step> in the directory PRETRAIN_TEST_PAUSE_DIR (tools/fault_harness.py signals the job meanwhile); once
# per run (not again where that file exists)
PAUSE_AT_ENV, PAUSE_DIR_ENV = "PRETRAIN_TEST_PAUSE", "PRETRAIN_TEST_PAUSE_DIR"


class StopRequested(KeyboardInterrupt):
    """A stop signal while the run starts (``StopSignals.immediate``): nothing is trained since the checkpoint the
    run would resume from, so it stops at once (a store build keeps its finished shards)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} while the run was starting")


def signal_hook(point: str, step: int | None = None) -> None:
    """The test hooks at ``point`` (data_build, first_step, evaluation, checkpoint, checkpoint_written,
    final_model): PRETRAIN_TEST_SIGNAL sends SIGUSR1 to this process there (of ``step`` when the hook names one, on
    ``rank`` when it names one); PRETRAIN_TEST_PAUSE pauses there. Nothing in a real run (both unset)."""
    if pauses := os.environ.get(PAUSE_AT_ENV):
        for pause in pauses.split(","):
            want_point, want_step, seconds = pause.split(":")
            marker = Path(os.environ[PAUSE_DIR_ENV]) / f"{point}-{step}"
            if want_point == point and int(want_step) == step and not marker.exists():  # once per run
                if os.environ.get("RANK", "0") == "0":
                    marker.touch()
                time.sleep(float(seconds))
    value = os.environ.get(SIGNAL_AT_ENV)
    if not value:
        return
    want_point, want_step, want_rank = (value.split(":") + ["", ""])[:3]
    if want_point != point or (want_step and step is not None and int(want_step) != step):
        return
    if want_rank and int(want_rank) != int(os.environ.get("RANK", "0")):
        return
    os.kill(os.getpid(), signal.SIGUSR1)


class StopSignals:
    """``with StopSignals() as stop:`` records a stop signal in ``stop.received`` instead of dying."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS, log=None, immediate: bool = False):
        self.signals = signals
        self.log = log  # the run's rank-0 log: says once what a Ctrl-C will do
        # While the run starts (data build, model, resume load) a signal raises StopRequested at once: nothing is
        # trained yet. The loop sets it False: from then on a signal is a flag, and the step in flight finishes.
        self.immediate = immediate
        self.received: int | None = None
        self.ctrl_c = CtrlC()  # SIGINTs counted as Ctrl-C presses (one press may arrive twice)
        self._announced = False
        self._previous: dict[int, object] = {}
        self._group = None  # the gloo group of the agreement, made on the first multi-process call
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def __enter__(self) -> StopSignals:
        for sig in self.signals:
            if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started in the background (`cmd &`, nohup): Ctrl-C was never meant for this process
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        if exc_type is None:
            self.settle()
        self._pending = None
        for sig, handler in self._previous.items():
            # None: the previous handler was not installed from Python; the default is the closest.
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def settle(self) -> None:
        """Wait for the agreement in flight, if any (every rank started it): nothing is left in flight. Called
        after the loop, while the process group still exists."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT and not self.ctrl_c.press():
            return  # the same Ctrl-C delivered again (a wrapper passing on the terminal's SIGINT): one stop
        if self.immediate:
            self.received = signum
            raise StopRequested(signum)
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            # A second Ctrl-C: stop now, as if pretrain had no handler (the steps since the last checkpoint are lost).
            previous = self._previous.get(signal.SIGINT)
            if callable(previous):
                previous(signum, frame)
            raise KeyboardInterrupt
        # Only a flag: the loop finishes the optimizer step in flight, then every rank stops at the same step.
        self.received = signum

    @property
    def interrupted(self) -> bool:
        """Whether the stop was asked for by SIGINT (Ctrl-C): the run exits 130 after its checkpoint."""
        return self.received == signal.SIGINT

    def agreed(self, accelerator) -> bool:
        """Whether a rank was asked to stop, with the same answer on every rank. Every rank must call this
        at the same steps. One process: this process's flag. Several: the flags as they were at the
        previous call, summed over ranks (see the module docstring); once it says stop, nothing is left
        in flight."""
        flag = 1.0 if self.received is not None else 0.0
        if self.received is not None and not self._announced and self.log is not None:
            self._announced = True
            name = signal.Signals(self.received).name
            again = " (Ctrl-C again stops at once, losing the steps since the last checkpoint)" if self.interrupted else ""
            self.log(f"{name}: stopping after the step in flight with a checkpoint{again}")
        if accelerator.num_processes == 1:
            return flag > 0
        stop = False
        if self._pending is not None:
            work, total = self._pending
            work.wait()  # started a whole step ago: done by now
            stop = total.item() > 0  # a host tensor: no device synchronisation
            self._pending = None
        if not stop:
            import torch  # here, not at import: the entry point installs the handlers before it imports torch
            import torch.distributed as dist

            if self._group is None:
                self._group = dist.new_group(backend="gloo")  # collective: every rank is here at this step
            total = torch.tensor([flag])
            self._pending = (dist.all_reduce(total, group=self._group, async_op=True), total)
        return stop
