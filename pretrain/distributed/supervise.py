"""One run per output_dir, and no worker outliving its launcher.

**The run lock.** Global rank 0 holds an exclusive ``fcntl.flock`` on ``<output_dir>/run.lock`` for the
whole run, and writes its pid, host and start time into it. A second run on the same output_dir (from any
node, as long as the filesystem gives flock across nodes) is refused with exit 2 naming the holder. Only
global rank 0 takes it: the other processes of the same launch follow rank 0 (a rank 0 that stops takes its
launch down: torchrun ends the other workers), and a second launch, wherever it starts, has a rank 0 of its
own that finds the lock held. The kernel releases a flock when its holder dies, however it dies
(``kill -9`` too), so a lock left by a dead run is simply taken over; the file's old contents are then
reported. NFSv4 gives flock across clients (a dead client's lock lapses with its lease, ~90 s); Lustre only
when mounted with ``-o flock`` (``localflock`` locks within one node only); where the filesystem refuses
flock the run warns and goes on unlocked.

**Workers stop with their launcher.** torchrun (which ``accelerate launch`` runs in its own process) starts
each worker in a session of its own, so ``kill -9`` of the launcher's process group leaves the workers
training, and a relaunch would then write into the same output_dir. A worker started by torchrun's elastic
agent (``TORCHELASTIC_RUN_ID`` set) therefore asks the kernel for SIGKILL when its parent — the agent's
main thread, which started it — exits (``prctl(PR_SET_PDEATHSIG)``, Linux). A process started any other
way (``python pretrain/run.py`` under nohup, say) keeps running when its parent exits.

**A worker's exit code is its own.** A CPU/gloo process that has joined a process group sometimes aborted
in the interpreter's teardown after its last line ("terminate called without an active exception",
SIGABRT, exit -6: seen in about 1 of 3 full CI runs), even after ``destroy_process_group``: gloo's C++
threads still hold work objects whose tensors reach back into Python while the interpreter is being torn
down (pytorch/pytorch#179291 describes the mechanism; torch has no fix). SLURM counts -6 as a failure, and
a run that succeeded or was refused with exit 2 must say so. ``leave(code)`` therefore ends a worker of a
multi-process launch the way torch's own multiprocessing tests end theirs: flush what Python buffers
(streams, logging), then ``os._exit(code)``, skipping the teardown. Everything a run writes is closed
before: trackers by ``end_training``, checkpoints and the final model synchronously, the run lock
released (the kernel would release it anyway).

**pretrain-launch takes Ctrl-C itself.** torchrun's elastic agent turns the SIGINT a terminal sends it into
a ``SignalException`` that it re-raises after its workers' checkpoint: a traceback, and exit 1 instead of
130. ``run_launcher`` therefore runs ``accelerate launch`` as a child in a session of its own, so the
terminal's SIGINT reaches pretrain-launch alone, which sends it to the launcher's children (torchrun's
workers, or the one process of a single-process launch), exactly as the agent would. Their environment
says that the launcher reports the interrupt (``LAUNCHER_REPORTS_INTERRUPT``): a worker that stopped with
its checkpoint exits 0, which torchrun ends on quietly (any other code is a failure to it, with its
``ChildFailedError`` report), and pretrain-launch exits 130. A second Ctrl-C (or a first one before any
worker exists) SIGKILLs the launcher's process group; the workers die with their launcher (above). SIGINTs
within ``CTRL_C_WINDOW_S`` (1 s) of a Ctrl-C's first are that same Ctrl-C (``CtrlC``): under a wrapper that
passes SIGINT on to its child (a script or job runner that traps it, ``timeout --foreground``) the terminal's
SIGINT reaches pretrain-launch twice within milliseconds, and the second must not kill the workers. The
other signals that reached ``accelerate launch`` when pretrain-launch exec'd it (SIGTERM, SIGHUP, SIGQUIT,
SIGUSR1, SIGUSR2) are sent on to it unchanged, and the launcher asks for SIGKILL when pretrain-launch dies,
so ``kill -9`` of pretrain-launch or of its process group still ends the whole run. (pretrain-slurm's
node command runs ``accelerate launch`` directly: its signals are the job script's.)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from pretrain.errors import EXIT_INTERRUPTED, EXIT_USAGE, ConfigError

LOCK_FILE = "run.lock"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def run_worker(body: Callable[[], int]) -> int:
    """``body()``'s exit code; in a worker of a multi-process launch (WORLD_SIZE > 1) the process then leaves
    through ``leave`` (a defect's traceback is printed and the worker exits 1). A failure that follows another
    rank's refusal (``refuse``: a collective whose peer has left) is that refusal: the main process says it in
    one line, every such rank exits 2, no traceback."""
    if os.environ.get("WORLD_SIZE", "1").strip() in ("", "0", "1"):
        return body()
    try:
        code = body()
    except Exception:  # a defect: its traceback, then exit 1 (not the teardown's SIGABRT)
        from pretrain.distributed.agreement import peer_refusal

        refused = peer_refusal()
        if refused is None:
            traceback.print_exc()
            code = 1
        else:
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {refused}", file=sys.stderr)
            code = EXIT_USAGE
    leave(code)


def leave(code: int) -> NoReturn:
    """End a worker of a multi-process launch with ``code`` through ``os._exit``, after flushing (see the
    module docstring).

    The process group is destroyed first where it still exists and nothing failed (``code == 0``): a rank
    that failed must not wait in ``destroy_process_group`` for peers that may still be inside a collective
    (torchtitan calls it on success only, for the same reason)."""
    if code == 0 and "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to flush into
            pass
    os._exit(code)


def _holder_text(raw: str) -> str:
    try:
        holder = json.loads(raw)
        return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name yet" if not raw.strip() else f"{raw.strip()!r}"


class RunLock:
    """``RunLock.acquire(output_dir)``: the output_dir's lock, held until ``release()`` or the process ends."""

    def __init__(self, path: Path, fd: int | None, previous: str | None):
        self.path = path
        self.fd = fd  # None: the filesystem gives no flock; running unlocked
        self.previous = previous  # the holder a dead run left in the file, if any

    @classmethod
    def acquire(cls, output_dir: str | Path, log=print) -> RunLock:
        path = Path(output_dir) / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
            os.close(fd)
            raise ConfigError(
                f"output_dir = {str(output_dir)!r} is in use by another run ({holder}), which holds {path}. "
                "Two runs in one output_dir would overwrite each other's checkpoints and metrics: wait for it "
                "to end or stop it, or choose another output_dir. (A lock whose holder died is released by the "
                "operating system and taken over automatically; nothing needs deleting.)"
            ) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _UNSUPPORTED:
                raise
            log(f"warning: the filesystem of {path} refuses flock ({exc.strerror}); running without the "
                "one-run-per-output_dir lock (on Lustre, mount with -o flock)")
            return cls(path, None, None)
        raw = os.pread(fd, 1 << 16, 0).decode(errors="replace")
        previous = _holder_text(raw) if raw.strip() else None
        if previous:
            log(f"run lock: taking over {path} from a run that ended without releasing it ({previous}); the "
                "operating system released its lock when it died")
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        return cls(path, fd, previous)

    def release(self) -> None:
        """Empty the file (so the next run does not report a dead holder) and unlock."""
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def stop_with_launcher() -> bool:
    """Under torchrun, have the kernel SIGKILL this process when the launcher that started it dies. Whether
    it was set (Linux, started by torchrun's elastic agent)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    return die_with_parent()


LAUNCHER_REPORTS_INTERRUPT = "PRETRAIN_LAUNCHER_REPORTS_INTERRUPT"
"""Set to 1 in the workers' environment by pretrain-launch, which exits 130 itself after a Ctrl-C."""
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
"""What pretrain-launch sends on to ``accelerate launch`` as it is (SIGINT is its own)."""


CTRL_C_WINDOW_S = 1.0
"""SIGINTs that arrive within this many seconds of the first SIGINT of a Ctrl-C are that same Ctrl-C. A terminal's
Ctrl-C sends SIGINT to every process of its foreground job; a wrapper that traps SIGINT and sends it on to its child
(a shell script or job runner, ``timeout --foreground``) makes the child receive it a second time, milliseconds
later. Counted as two, that would be "Ctrl-C again": stop at once, losing the steps since the last checkpoint. A
person pressing Ctrl-C again to insist does so later than this (pretrain-launch's and the workers' ``StopSignals``
count presses the same way)."""


class CtrlC:
    """Ctrl-C presses counted from SIGINTs: a SIGINT within ``window_s`` of the first SIGINT of the last press is
    part of that press (``CTRL_C_WINDOW_S``)."""

    def __init__(self, window_s: float = CTRL_C_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self.presses = 0
        self._first: float | None = None  # when the last press's first SIGINT arrived

    def press(self) -> bool:
        """Count one SIGINT; whether it is a new press (False: the last press again, delivered twice)."""
        now = self.clock()
        if self._first is not None and now - self._first < self.window_s:
            return False
        self._first = now
        self.presses += 1
        return True


def interrupted_exit_code() -> int:
    """A run stopped by Ctrl-C with its checkpoint: 130, or 0 under pretrain-launch, which reports the 130 (torchrun
    and accelerate's single-process launcher report any other code as a failure, with a traceback)."""
    return 0 if os.environ.get(LAUNCHER_REPORTS_INTERRUPT) == "1" else EXIT_INTERRUPTED


def run_launcher(command: list[str], environment: dict[str, str]) -> int:
    """Run ``command`` (``accelerate launch ...``) as pretrain-launch's child, taking Ctrl-C for it (see the module
    docstring); the exit code for the shell: 130 after a Ctrl-C, else the launcher's (128 + N for signal N)."""
    import psutil

    handled = (*FORWARDED_SIGNALS, signal.SIGINT)
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    parent = os.getpid()
    launcher: subprocess.Popen | None = None
    state = {"stopped": None}  # why the launcher's process group was SIGKILLed
    ctrl_c = CtrlC()

    def in_child() -> None:  # between fork and exec: the launcher dies with pretrain-launch, and takes signals
        if libc is not None:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # pretrain-launch died before the request: nothing would signal us now
                os._exit(128 + signal.SIGKILL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)

    def stop_now(why: str) -> None:
        state["stopped"] = why
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)

    def on_interrupt(signum, frame) -> None:
        if not ctrl_c.press():
            return  # the same Ctrl-C again (a wrapper passing on the terminal's SIGINT): sent on already
        if launcher is None:  # caught by Python before this handler was installed, run now: stopped once started
            return
        try:
            workers = psutil.Process(launcher.pid).children()
        except psutil.NoSuchProcess:
            return  # it has just exited: wait() returns its code
        if ctrl_c.presses > 1:
            return stop_now("Ctrl-C again: stopped every process at once; the steps since the last checkpoint "
                            "are lost")
        if not workers:
            return stop_now("stopped the launch before its processes started")
        for worker in workers:  # as torchrun's agent sends it: to each worker, not to the worker's own children
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGINT)

    def forward(signum, frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(launcher.pid, signum)

    handlers = {signal.SIGINT: on_interrupt, **dict.fromkeys(FORWARDED_SIGNALS, forward)}
    # Started in the background (`cmd &`, nohup): an ignored signal stays ignored, in the launcher too.
    handlers = {sig: h for sig, h in handlers.items() if signal.getsignal(sig) != signal.SIG_IGN}
    # The signals wait until the launcher exists (the handlers need its pid); the child unblocks them.
    signal.pthread_sigmask(signal.SIG_BLOCK, handled)
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        launcher = subprocess.Popen(command, env={**environment, LAUNCHER_REPORTS_INTERRUPT: "1"},
                                    start_new_session=True, preexec_fn=in_child)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
    if ctrl_c.presses:
        stop_now("stopped the launch before its processes started")
    try:
        code = launcher.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if state["stopped"] is not None:
        print(f"interrupted: {state['stopped']}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    if ctrl_c.presses and code == 0:  # the workers stopped with their checkpoint, and said so
        return EXIT_INTERRUPTED
    return code if code >= 0 else 128 - code


def die_with_parent() -> bool:
    """Have the kernel SIGKILL this process when the thread that started it exits, however it exits (a worker
    of ``kill -9``-ed parent must not go on writing). Whether it was set (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() == 1:  # the launcher died before the request was made: nothing would signal us now
        os.kill(os.getpid(), signal.SIGKILL)
    return True
