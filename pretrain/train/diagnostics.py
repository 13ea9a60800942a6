"""Seeing why a run is slow or stuck: traces, per-rank step times, a hang watchdog, OOM memory snapshots.

- ``profile``: torch.profiler through accelerate (``ProfileKwargs`` + ``Accelerator.profile``) on a
  schedule that records optimizer steps [start_step, start_step + num_steps); each rank writes its Chrome
  trace ``output_dir/profile/rank<R>_steps<A>-<B>.json`` as soon as the window closes (Perfetto or
  chrome://tracing open it). Outside the window the profiler records nothing.
- Per-rank step time, on logging steps only: each rank times its own part of the step before the gradient
  synchronisation (its batches, every forward, the backward passes of micro-steps that do not synchronise)
  — the part a straggler is slow in; time spent waiting for the others is left out, otherwise every rank
  of a synchronous step would report the same time. CUDA events on a GPU (no synchronisation outside
  logging steps), the host clock on CPU. One all-gather of one number per rank gives
  ``perf/step_time_max_s``, ``perf/step_time_min_s`` and ``perf/step_time_slowest_rank``. Under ZeRO-2/3 and
  FSDP the forward and the micro-step reductions are themselves collective, so a straggler shows less.
- ``runtime.hang_timeout_s``: ``faulthandler.dump_traceback_later`` re-armed after every optimizer step (with
  its evaluation and checkpoint). If it fires, every thread's Python stack goes to
  ``output_dir/hang/rank<R>.txt`` (faulthandler's C watchdog thread needs no GIL, so a rank stuck inside a
  collective dumps too) and the process exits 1 ``HANG_EXIT_GRACE_S`` later; the other ranks, waiting for it
  in a collective, have fired meanwhile, and the launcher's non-zero exit lets the job be requeued. The
  files are removed after a run that did not hang.
- ``runtime.memory_snapshot_on_oom`` (CUDA): the allocator records its history from the start, and a
  training step that raises ``torch.OutOfMemoryError`` first dumps ``output_dir/memory_snapshot_rank<R>.pickle``.
- ``runtime.straggler``: the per-rank step times judged (``train/straggler.py``): a rank persistently slower than the
  others is named, or its host excluded.
- Test hooks: ``PRETRAIN_TEST_STALL=<rank>:<step>`` makes that rank sleep before that optimizer step (read
  here only; the hang tests use it); ``PRETRAIN_TEST_SLOW`` (``straggler.SLOW_ENV``) slows a rank's every step.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProfileKwargs, gather_object

from pretrain.distributed.doctor import host_name
from pretrain.recipe.config import ProfileConfig, RuntimeConfig
from pretrain.train.straggler import StragglerWatch, slow_seconds

PROFILE_DIR = "profile"
HANG_DIR = "hang"
HANG_EXIT_GRACE_S = 10.0  # between a rank's stack dump and its exit: the other ranks dump meanwhile
HANG_EXIT_STATUS = 1
STALL_ENV = "PRETRAIN_TEST_STALL"


def profile_schedule(start_step: int, num_steps: int, first_step: int) -> dict[str, int] | None:
    """``torch.profiler.schedule`` options that record optimizer steps [start_step, start_step + num_steps)
    of a loop whose first step is ``first_step + 1`` (one warm-up step before, when there is one); None when
    the window is already past."""
    before = start_step - first_step - 1  # steps of this loop before the window
    if before < 0:
        return None
    warmup = min(1, before)
    return {"skip_first": before - warmup, "wait": 0, "warmup": warmup, "active": num_steps, "repeat": 1}


class StepTimer:
    """This rank's time for its own part of one optimizer step (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._start: Any = None
        self._stop: Any = None

    def start(self) -> None:
        if self.cuda:
            self._start, self._stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start, self._stop = time.perf_counter(), None

    def stop(self) -> None:
        if self._start is None:
            return
        if self.cuda:
            self._stop.record()
        elif self._stop is None:
            self._stop = time.perf_counter()

    def seconds(self) -> float | None:
        if self._start is None or self._stop is None:
            return None
        if self.cuda:
            self._stop.synchronize()  # device-to-host synchronisation: logging steps only
            return self._start.elapsed_time(self._stop) / 1000
        return self._stop - self._start


class HangWatchdog:
    """Unless ``kick()`` comes again within ``timeout_s``: dump every thread's stack, then exit 1 after
    ``HANG_EXIT_GRACE_S``.

    The dump is faulthandler's (a C thread: it needs no GIL, so a rank stuck in a collective or in C code dumps
    too). The exit waits a little so that every rank dumps: the ranks kicked their watchdogs within
    milliseconds of each other (after a step that ended in a collective), and a rank that left at once would
    make the collective the others wait in fail before their own dumps. The exit is a Python thread's
    ``os._exit``: a rank that holds the GIL forever has dumped but is ended by the launcher instead, once
    the other ranks have exited."""

    def __init__(self, timeout_s: float, output_dir: Path, rank: int):
        self.timeout_s = timeout_s
        self.path = output_dir / HANG_DIR / f"rank{rank}.txt"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "w")  # noqa: SIM115 (open for faulthandler until stop())
        self.file.write(f"rank {rank} (host {socket.gethostname()}, pid {os.getpid()}): no optimizer step completed "
                        f"within runtime.hang_timeout_s = {timeout_s:g} s; the Python stack of every thread:\n")
        self.file.flush()
        self.deadline = math.inf
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._exit_when_overdue, name="hang-watchdog", daemon=True)
        self.thread.start()

    def kick(self) -> None:
        faulthandler.dump_traceback_later(self.timeout_s, exit=False, file=self.file)
        self.deadline = time.monotonic() + self.timeout_s + HANG_EXIT_GRACE_S

    def _exit_when_overdue(self) -> None:
        while not self.stopped.wait(1.0):
            if time.monotonic() > self.deadline:
                self.file.write(f"\nexiting with status {HANG_EXIT_STATUS}\n")
                self.file.flush()
                os._exit(HANG_EXIT_STATUS)

    def stop(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self.stopped.set()
        self.thread.join()
        self.file.close()
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()  # the last rank out removes the directory


def _stall_hook(rank: int) -> int | None:
    """The step ``PRETRAIN_TEST_STALL`` makes this rank sleep before, if any."""
    value = os.environ.get(STALL_ENV)
    if not value:
        return None
    stall_rank, step = (int(v) for v in value.split(":"))
    return step if stall_rank == rank else None


class Diagnostics:
    """The run's profiler, per-rank step timer, hang watchdog and OOM snapshot, as the loop uses them."""

    def __init__(self, accelerator: Accelerator, cfg: RuntimeConfig, profile: ProfileConfig, output_dir: Path, log):
        self.accelerator = accelerator
        self.cfg = cfg
        self.profile = profile
        self.output_dir = output_dir
        self.log = log
        self.rank = accelerator.process_index
        self.device = accelerator.device
        self.timer = StepTimer(self.device)
        self.stall_step = _stall_hook(self.rank)
        self.host = host_name(self.rank)
        self.slow_s = slow_seconds(self.rank, self.host)
        self.stragglers: StragglerWatch | None = None  # made by loop(): it gathers every rank's host
        self.watchdog: HangWatchdog | None = None
        self.profiler = None
        self.snapshot = cfg.memory_snapshot_on_oom and self.device.type == "cuda"
        if cfg.memory_snapshot_on_oom and not self.snapshot:
            log(f"warning: runtime.memory_snapshot_on_oom needs a CUDA device; this run is on {self.device.type}, "
                "so no memory snapshot is recorded")
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    @contextlib.contextmanager
    def loop(self, first_step: int):
        """Around the training loop: the profiler's window and the hang watchdog."""
        with contextlib.ExitStack() as stack:
            if self.stragglers is None and self.cfg.straggler.action != "off":
                world = self.accelerator.num_processes
                hosts = gather_object([self.host]) if world > 1 else [self.host]  # collective: once per run
                self.stragglers = StragglerWatch(self.cfg.straggler, hosts, self.output_dir,
                                                 is_main=self.accelerator.is_main_process, log=self.log,
                                                 under_slurm="SLURM_JOB_ID" in os.environ)
            self.profiler = self._start_profiler(stack, first_step)
            if self.cfg.hang_timeout_s:
                self.watchdog = HangWatchdog(self.cfg.hang_timeout_s, self.output_dir, self.rank)
                stack.callback(self.watchdog.stop)
                self.watchdog.kick()
            yield self

    def _start_profiler(self, stack: contextlib.ExitStack, first_step: int):
        prof = self.profile
        if not prof.start_step:
            return None
        schedule = profile_schedule(prof.start_step, prof.num_steps, first_step)
        if schedule is None:
            self.log(f"profile: profile.start_step={prof.start_step} is before this run's first step "
                     f"({first_step + 1}); nothing is traced")
            return None
        last = prof.start_step + prof.num_steps - 1
        path = self.output_dir / PROFILE_DIR / f"rank{self.rank}_steps{prof.start_step}-{last}.json"

        def export(profiler) -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(path))
            self.log(f"profile: steps {prof.start_step}-{last} traced into {path.parent}/ (one file per rank)")

        handler = ProfileKwargs(
            activities=["cpu", "cuda"] if self.device.type == "cuda" else ["cpu"], schedule_option=schedule,
            on_trace_ready=export, record_shapes=prof.record_shapes, profile_memory=prof.profile_memory,
            with_stack=prof.with_stack,
        )
        return stack.enter_context(self.accelerator.profile(handler))

    def step_start(self, step: int, timed: bool) -> None:
        """Before optimizer step ``step``; ``timed``: it is a logging step."""
        if step == self.stall_step:
            time.sleep(3600)
        if timed:
            self.timer.start()

    def before_sync(self) -> None:
        """Just before the backward pass that synchronises gradients."""
        if self.slow_s:  # the test hook: slower compute (after the forward, whose DDP buffer broadcast is collective)
            time.sleep(self.slow_s)
        self.timer.stop()

    @property
    def exclude_requested(self) -> bool:
        """runtime.straggler.action=exclude confirmed a straggler host: the run stops after this step."""
        return self.stragglers is not None and self.stragglers.excluded is not None

    def step_done(self) -> None:
        if self.profiler is not None:
            self.profiler.step()
        if self.watchdog is not None:
            self.watchdog.kick()

    def step_time_metrics(self, step: int) -> dict[str, float]:
        """Collective (every rank, logging steps only): the spread of the ranks' own step times, judged by
        runtime.straggler (the same times on every rank: the same verdict)."""
        seconds = self.timer.seconds()
        self.timer = StepTimer(self.device)
        local = torch.tensor([-1.0 if seconds is None else seconds], device=self.device, dtype=torch.float64)
        times = self.accelerator.gather(local).tolist()  # device-to-host synchronisation: logging steps only
        if min(times) < 0:
            return {}
        if self.stragglers is not None:
            self.stragglers.observe(step, times)
        slowest = max(range(len(times)), key=times.__getitem__)
        return {"perf/step_time_max_s": times[slowest], "perf/step_time_min_s": min(times),
                "perf/step_time_slowest_rank": slowest}

    @contextlib.contextmanager
    def oom_snapshot(self):
        """Around a training step: on CUDA out-of-memory, dump the allocator's history, then re-raise."""
        try:
            yield
        except torch.OutOfMemoryError:
            if self.snapshot:
                path = self.output_dir / f"memory_snapshot_rank{self.rank}.pickle"
                torch.cuda.memory._dump_snapshot(str(path))
                print(f"rank {self.rank}: out of memory; the allocator's history is in {path} "
                      "(open it at https://pytorch.org/memory_viz)", flush=True)
            raise
