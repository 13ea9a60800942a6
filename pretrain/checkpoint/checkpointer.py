"""Checkpoints that survive a kill at any moment: the save, its cadence, and the restore of what was saved.

A checkpoint is ``accelerator.save_state`` (model, optimizer, scheduler, grad scaler, RNG of every
process) plus ``trainer_state.json`` (a ``TrainerState``: the run state's registered parts, plan, recipe,
layout; ``pretrain/checkpoint/state.py``), written into ``checkpoints/.tmp-step_XXXXXXXX`` and renamed to
``step_XXXXXXXX`` only when complete; then the ``latest`` pointer is replaced atomically. The data cursor is
the optimizer step: the sample order is a pure function of (seed, step), see ``pretrain/data/loader.py``.

Every checkpoint carries ``manifest.json`` (``pretrain/checkpoint/integrity.py``): each file's size and CRC-32,
every rank hashing the files it wrote, written after every other file and before the rename. Which checkpoint a
run resumes from, and whether it may, is ``pretrain/checkpoint/resume.py``'s decision; this module writes
checkpoints and restores the accelerator's state of the one decided. The ``Checkpointer`` is built once the
accelerator is, and owns the save cadence (every N optimizer steps, and the last step).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed

from pretrain.checkpoint import neutral
from pretrain.checkpoint.background import StagedSave, Writer, gather_over, injected_write_delay
from pretrain.checkpoint.integrity import record_own, write_manifest
from pretrain.checkpoint.reshard import ResumeSource, views
from pretrain.checkpoint.rundir import CHECKPOINTS_DIR, LATEST_FILE, STATE_FILE, complete_checkpoints, latest_checkpoint
from pretrain.checkpoint.state import TrainerState
from pretrain.distributed.agreement import merge_problems, rank_problems
from pretrain.errors import ConfigError, TrainingDiverged, disk_full_error, is_disk_full
from pretrain.recipe.config import CheckpointConfig
from pretrain.trust import weights_only


def set_aside(path: Path, why: str = "damaged") -> Path:
    """Move a checkpoint out of the way as ``.<why>-<name>`` (damaged, or rolled-back: kept for inspection, never
    counted, pruned or resumed); its converted siblings are derived data and are deleted."""
    for view in views(path):
        shutil.rmtree(view, ignore_errors=True)
    aside = path.with_name(f".{why}-{path.name}")
    if aside.exists():
        aside = path.with_name(f".{why}-{path.name}-{int(time.time())}")
    os.rename(path, aside)
    return aside



def nonfinite_state(optimizer) -> str | None:
    """What is not finite in this rank's part of the training state (the parameters the torch optimizer
    updates, i.e. DeepSpeed's fp32 master partitions or the model's parameters or FSDP shards, and their
    optimizer state), or None. Read before a checkpoint is written."""
    while hasattr(optimizer, "optimizer") and optimizer.optimizer is not optimizer:
        optimizer = optimizer.optimizer
    flags: dict[torch.device, list[torch.Tensor]] = {}  # by device: offloaded state lives on the CPU
    for group in optimizer.param_groups:
        for p in group["params"]:
            tensors = [p.detach(), *(v for v in optimizer.state.get(p, {}).values()
                                     if isinstance(v, torch.Tensor) and v.is_floating_point())]
            for tensor in tensors:
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # an FSDP2 shard
                flags.setdefault(local.device, []).append(torch.isfinite(local).all())
    # Expensive device-to-host synchronization: once per device, before a checkpoint.
    if all(bool(torch.stack(found).all()) for found in flags.values()):
        return None
    return "the parameters or optimizer state hold NaN or inf"


class Checkpointer:
    """Saves and restores checkpoints under ``<output_dir>/checkpoints`` and decides when to save.

    With ``checkpoint.async`` a save returns once the states are copied to host memory and the files follow
    in a thread (``pretrain/checkpoint/background.py``); ``wait()`` (the next save, the end of the run) waits for
    it. ``stalls_s``: the seconds each save held the loop (tools/bench_checkpoint.py reads them)."""

    def __init__(self, accelerator: Accelerator, output_dir: str | Path, cfg: CheckpointConfig, num_steps: int,
                 log=print):
        self.accelerator = accelerator
        self.dir = Path(output_dir) / CHECKPOINTS_DIR
        self.cfg = cfg
        self.num_steps = num_steps
        self.log = log
        self.stalls_s: list[float] = []
        self.writes_s: list[float] = []  # rank 0: each save from the start of save_state to the rename
        self.writer = Writer() if cfg.async_ else None
        # The writer thread's collectives (the checksums' gather) get a gloo group of their own: a second
        # thread's collectives on the loop's group could pair with the loop's. So does each of DCP's background
        # saves (dcp_group). Collective: every rank builds its Checkpointer. With one process too, where a process
        # group exists (FSDP on one GPU): its default group is NCCL's alone, which DCP's async_save refuses.
        self.group = (torch.distributed.new_group(backend="gloo")
                      if cfg.async_ and torch.distributed.is_available() and torch.distributed.is_initialized()
                      else None)
        self.dcp_groups: list[Any] = []

    def should_save(self, step: int) -> bool:
        """Every ``checkpoint.every_steps`` optimizer steps, and after the last one unless save_last=false."""
        if step == self.num_steps and self.cfg.save_last:
            return True
        return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

    def save(self, state: TrainerState, optimizer=None) -> Path:
        """``save_state`` into ``.tmp-step_X``, the trainer state, every rank's checksums of what it wrote
        gathered into the manifest (written last), then the rename and ``latest``. A full disk on any rank
        removes the partial checkpoint and raises the same ConfigError on every rank (exit 2): the previous
        checkpoint is untouched and the same command resumes from it. With ``optimizer``, its parameters and
        state are checked for NaN / inf on every rank first: a non-finite state is never written (nor are
        healthy ones pruned for it); TrainingDiverged instead. Asynchronous (``checkpoint.async``): the
        previous write completes first, then everything after the copy to host memory happens in the
        background, and its failure is raised by the next ``wait()``."""
        acc = self.accelerator
        begin = time.perf_counter()
        self.wait()  # one write in flight at most: its host copy is freed before the next is taken
        if optimizer is not None:
            problems = rank_problems(acc, nonfinite_state(optimizer))
            if problems:
                newest = latest_checkpoint(self.dir.parent)
                raise TrainingDiverged(
                    f"step {state.step}: not saving a checkpoint: {'; '.join(problems)}. The newest checkpoint, "
                    f"{newest or 'none'}, is kept; set stability.skip_nonfinite=true (skipped updates keep the "
                    "state finite) or lower optim.lr, then resume from it"
                )
        name = f"step_{state.step:08d}"
        final, tmp = self.dir / name, self.dir / f".tmp-{name}"
        if acc.is_main_process:
            self.dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a run killed while saving
        acc.wait_for_everyone()
        start = time.perf_counter()

        def write_state() -> None:
            if acc.is_main_process:
                (tmp / STATE_FILE).write_text(replace(state, saved_at=time.time()).to_json())

        if self.writer is None:
            self._written(state.step, tmp, lambda: acc.save_state(str(tmp), safe_serialization=True))
            self._written(state.step, tmp, write_state)
            failure = self._complete(state.step, tmp, final, start, gather_object, None)
            if failure is not None:
                raise failure
            self.stalls_s.append(time.perf_counter() - begin)
            return final
        staged = StagedSave(tmp, self.dcp_group)

        def stage() -> None:
            with staged.capturing():
                acc.save_state(str(tmp), safe_serialization=True)

        self._written(state.step, tmp, stage)
        self._written(state.step, tmp, write_state)
        stall = time.perf_counter() - begin
        self.stalls_s.append(stall)
        staged.pause_s = injected_write_delay(state.step)  # the test hook (background.SLOW_WRITE_ENV); 0 in real runs

        def background() -> ConfigError | None:
            return self._complete(state.step, tmp, final, start, lambda own: gather_over(self.group, own[0]),
                                  staged, stall)

        self.writer.submit(background)
        return final

    def dcp_group(self, index: int) -> Any:
        """The gloo group of a checkpoint's index-th DCP background save (None: one process). Made the first
        time it is asked for, on the loop's thread, where every rank reaches the same DCP saves in order."""
        if self.group is None:
            return None
        while len(self.dcp_groups) <= index:
            self.dcp_groups.append(torch.distributed.new_group(backend="gloo"))
        return self.dcp_groups[index]

    def wait(self) -> None:
        """Wait for the checkpoint write in flight, if any (``checkpoint.async``); raises its failure, on every
        rank alike. Every rank calls it at the same points (the next save, the end of the run)."""
        if self.writer is not None and (failure := self.writer.wait()) is not None:
            raise failure

    def _complete(self, step: int, tmp: Path, final: Path, start: float, gather: Callable[[list], list],
                  staged: StagedSave | None, stall: float | None = None) -> ConfigError | None:
        """The save after ``save_state``: (asynchronous: the staged writes,) every rank's checksums of its files
        gathered into the manifest, written last, then the rename, ``latest`` and pruning. Returns the full-disk
        ConfigError every rank gets (after rank 0 removed the partial checkpoint), or None. ``gather``: every
        rank's [value] onto every rank (collective: the loop's group, or the writer thread's)."""
        acc = self.accelerator
        host = socket.gethostname()

        def agree(found: list[tuple[str, str | None, bool]]) -> ConfigError | None:
            """Every rank's (host, problem, disk full) -> the failure every rank returns (None: none)."""
            if all(p is None for _, p, _ in found):
                return None
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            problems = merge_problems([(h, p) for h, p, _ in found])
            if not any(full for _, _, full in found):
                raise RuntimeError(f"the checkpoint of step {step} failed while written in the background: "
                                   f"{'; '.join(problems)}")
            return self._disk_full(step, problems)

        def attempt(write: Callable[[], Any]) -> tuple[Any, str | None, bool]:
            try:
                return write(), None, False
            except Exception as exc:
                if staged is None and not is_disk_full(exc, self.dir):
                    raise  # synchronous: as any other error of the loop
                return None, f"{type(exc).__name__}: {exc}", is_disk_full(exc, self.dir)

        if staged is not None:
            _, problem, full = attempt(staged.write)
            if (failure := agree(gather([(host, problem, full)]))) is not None:
                return failure
        hashing = time.perf_counter()
        own, problem, full = attempt(lambda: record_own(tmp, acc.process_index, acc.num_processes))
        gathered = gather([(host, problem, full, own or {})])
        if (failure := agree([(h, p, f) for h, p, f, _ in gathered])) is not None:
            return failure
        files = {rel: entry for *_, part in gathered for rel, entry in part.items()}
        hashing = time.perf_counter() - hashing
        _, problem, full = attempt(lambda: write_manifest(tmp, files, acc.num_processes) if acc.is_main_process
                                   else None)
        if (failure := agree(gather([(host, problem, full)]))) is not None:
            return failure
        if acc.is_main_process:
            if final.exists():
                shutil.rmtree(final)  # the same step saved again after a resume: the new one is equivalent
            for view in views(final):
                shutil.rmtree(view)  # converted from the replaced save
            os.rename(tmp, final)
            self._point_latest(final.name)
            self._prune(keep=final)
            size_gib = sum(entry["size"] for entry in files.values()) / 2**30
            took = time.perf_counter() - start
            self.writes_s.append(took)
            if stall is None:
                self.log(f"checkpoint: saved step {step} to {final} ({size_gib:.2f} GiB, {took:.1f}s, of which "
                         f"checksums {hashing:.1f}s)")
            else:
                self.log(f"checkpoint: saved step {step} to {final} ({size_gib:.2f} GiB, {took:.1f}s, of which "
                         f"checksums {hashing:.1f}s; in the background: the loop waited {stall:.2f}s for "
                         f"{staged.staged_bytes / 2**30:.2f} GiB copied to host memory)")
        if staged is None:
            acc.wait_for_everyone()
        return None

    def _disk_full(self, step: int, problems: list[str]) -> ConfigError:
        previous = latest_checkpoint(self.dir.parent)
        kept = (f"{previous} (step {TrainerState.read(previous).step}) is intact and the same command resumes "
                "from it" if previous is not None else "no earlier checkpoint exists")
        return disk_full_error(self.dir, f"the checkpoint of step {step} ({'; '.join(problems)})",
                               f"its partial files are removed; {kept}. Free space there (or lower "
                               "checkpoint.keep_last), then rerun the same command")

    def _point_latest(self, name: str) -> None:
        pointer_tmp = self.dir / f".{LATEST_FILE}.tmp"
        pointer_tmp.write_text(name + "\n")
        os.replace(pointer_tmp, self.dir / LATEST_FILE)

    def abandon_after(self, path: Path) -> list[Path]:
        """After a rollback to ``path`` (rank 0): the complete checkpoints of later steps hold the abandoned
        attempt; each is set aside as ``.rolled-back-step_X`` (never resumed, counted or deleted: the run's user
        deletes them) and ``latest`` names ``path`` again. Returns where they went."""
        state = TrainerState.read(path)
        moved = [set_aside(p, "rolled-back") for s, p in complete_checkpoints(self.dir.parent) if s > state.step]
        self._point_latest(path.name)
        return moved

    def _written(self, step: int, tmp: Path, write: Callable[[], Any]) -> None:
        """Run this rank's part of a checkpoint write; a full disk on any rank is one ConfigError on every
        rank, after rank 0 removed the partial checkpoint (which frees the space it took). Collective."""
        problem = None
        try:
            write()
        except Exception as exc:
            if not is_disk_full(exc, self.dir):
                raise
            problem = f"{type(exc).__name__}: {exc}"
        problems = rank_problems(self.accelerator, problem)
        if not problems:
            return
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise self._disk_full(step, problems)

    def _prune(self, keep: Path) -> None:
        """Keep the newest ``keep_last`` complete checkpoints, and always ``keep`` (the one just saved and
        verified): a checkpoint is counted by the step recorded inside, so the newest verified one is
        never pruned. Damaged ones passed over on resume are not counted (moved aside)."""
        if self.cfg.keep_last == 0:
            return
        complete = complete_checkpoints(self.dir.parent)
        for _, path in complete[: max(0, len(complete) - self.cfg.keep_last)]:
            if path != keep:
                for view in views(path):
                    shutil.rmtree(view, ignore_errors=True)
                shutil.rmtree(path, ignore_errors=True)

    def load(self, source: ResumeSource, seed: int) -> None:
        """Restore the accelerator's state (model, optimizer, scheduler, loss scaler, RNG) of the checkpoint ``source``
        prepared for this launch (``reshard.prepare_resume``: where the state is read, whether the RNG is re-seeded
        from ``seed``). The checks that it may be loaded are the resume's (pretrain/checkpoint/resume.py)."""
        state = TrainerState.read(source.checkpoint)
        with weights_only(source.load_dir):
            if source.neutral:
                self._load_neutral(source)
            else:
                self.accelerator.load_state(str(source.load_dir))
        # load_state restores accelerate's micro-step counter (which decides the micro-step that synchronises)
        # from each process's RNG file: counted in the old GAS, and missing for a process the old run lacked.
        self.accelerator.step = state.step * self.accelerator.gradient_accumulation_steps
        if source.world_changed:
            # random_states_{i}.pkl belong to the processes of the old world size (a new process finds none,
            # an old index means another process now): every process draws a fresh stream instead.
            set_seed(seed + state.step, device_specific=True)
            changed = (f"{source.saved.describe()} -> this layout: weights and optimizer states converted through "
                       "the neutral form, the scheduler as saved" if source.neutral else
                       f"world size {source.saved.world_size} -> {self.accelerator.num_processes}")
            self.log(f"resume: {changed}; each process's random stream re-seeded from (train.seed, step, process "
                     "index)")
        self.log(f"resume: continuing from {source.checkpoint} at step {state.step}")

    def _load_neutral(self, source: ResumeSource) -> None:
        """A checkpoint of another engine, through its neutral form (pretrain/checkpoint/neutral.py): the weights
        and optimizer states into this layout, the scheduler as saved; the random streams are re-seeded."""
        acc = self.accelerator
        engine = getattr(getattr(acc, "deepspeed_engine_wrapped", None), "engine", None)
        optimizer = acc._optimizers[0].optimizer
        model = acc.unwrap_model(acc._models[0], keep_torch_compile=False)
        fresh = neutral.load(source.load_dir, model, optimizer, deepspeed_engine=engine, log=self.log)
        if fresh:
            self.log(f"resume: {len(fresh)} parameter(s) without optimizer state in {source.checkpoint} start with "
                     f"fresh states: {', '.join(fresh[:5])}")
        groups = len(optimizer.param_groups)
        for i, scheduler in enumerate(acc._schedulers):
            saved = torch.load(source.load_dir / f"scheduler{'' if i == 0 else f'_{i}'}.bin", weights_only=True)
            scheduler.scheduler.load_state_dict(neutral.scheduler_state(saved, groups))
            for group, lr in zip(scheduler.scheduler.optimizer.param_groups, scheduler.scheduler.get_last_lr(), strict=True):
                group["lr"] = lr  # what optimizer.load_state_dict restores on a resume on the same engine
        if acc.scaler is not None and (source.load_dir / "scaler.pt").is_file():
            acc.scaler.load_state_dict(torch.load(source.load_dir / "scaler.pt", weights_only=True))
        elif acc.scaler is not None:
            self.log("resume: the fp16 loss scale restarts from its initial value (the checkpoint's engine kept "
                     "its own)")
