"""Checkpoints that survive a kill at any moment and resume exactly.

A checkpoint is ``accelerator.save_state`` (model, optimizer, scheduler, grad scaler, RNG of every
process) plus ``trainer_state.json`` (a ``TrainerState``: step, tokens seen, horizon, plan, recipe),
written into ``checkpoints/.tmp-step_XXXXXXXX`` and renamed to ``step_XXXXXXXX`` only when complete;
then the ``latest`` pointer is replaced atomically. The data cursor is the optimizer step: the sample
order is a pure function of (seed, step), see ``pretrain/train/loader.py``. Resume reads ``latest`` (or, if it
is missing, the newest complete checkpoint by the step recorded inside it, never by folder name).

Every checkpoint carries ``manifest.json`` (``pretrain/checkpoint/integrity.py``): each file's size and CRC-32, every
rank hashing the files it wrote, written after every other file and before the rename. Which checkpoint a
run resumes from is decided once, by rank 0 (``ResumeChoice.decide``: plain file reads, before any process
group exists, because the trackers need the resume step): the newest whose files have the sizes its
manifest records, the older ones kept as fallbacks. Once the process group exists every rank takes
that choice, checks that it sees the same checkpoint and verifies the checksums of its share of the files
(``agree_on_resume``); damage found there moves every rank on to the next fallback together, so ranks never
load different steps. A damaged checkpoint that was passed over is moved aside to ``.damaged-step_X`` (never
deleted: inspect it, then delete it); when no checkpoint is intact the run stops with exit 2 and leaves them
in place. The ``Checkpointer`` is built once the
accelerator is, and owns the save cadence (every N optimizer steps, and the last step).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object, set_seed
from pydantic import BaseModel

from pretrain.checkpoint.background import StagedSave, Writer, gather_over, injected_write_delay
from pretrain.checkpoint.integrity import (
    MANIFEST_FILE,
    Unverified,
    check_sizes,
    own_files,
    record_own,
    verify_own,
    write_manifest,
)
from pretrain.checkpoint.reshard import ResumeSource, views
from pretrain.checkpoint.rundir import (
    CHECKPOINTS_DIR,
    LATEST_FILE,
    STATE_FILE,
    complete_checkpoints,
    latest_checkpoint,
    read_state,
)
from pretrain.data import data_changes, planned_data_identity
from pretrain.distributed.accelerator import SHARED_FS_HINT, merge_problems, rank_problems
from pretrain.errors import ConfigError, TrainingDiverged, disk_full_error, is_disk_full
from pretrain.recipe.config import CheckpointConfig, DataConfig, Recipe, renamed_keys
from pretrain.trust import check_files, is_inside, weights_only

# Recipe keys whose change makes a checkpoint unusable: the weights' shapes or meaning, the sample stream, or
# optimizer hyper-parameters the checkpoint's optimizer state would silently override (its param groups carry
# weight decay, betas, eps) differ. The data behind the stream (the store, its sources' fingerprints, the
# tokenizer) is checked apart (check_resume_data). APPLIED_ON_RESUME changes take effect, logged and recorded
# (run_config.json's ``resume``); anything else (precision, kernels, data.document_masking, cadences, logging)
# may change with a logged note: document masking changes what the model attends to, not the weights or stream.
MUST_MATCH = (
    *(f"model.{k}" for k in ("arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                             "intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta",
                             "norm_eps", "tie_embeddings", "config_overrides")),
    *(f"data.{k}" for k in ("source", "format", "text_field", "hf_config", "hf_split", "tokenizer",
                            "tokenizer_vocab_size", "seq_len", "train_subset", "val_fraction", "shuffle",
                            "drop_last", "on_decode_error", "mixture", "normalize_weights")),
    *(f"optim.{k}" for k in ("name", "weight_decay", "args", "decay_embeddings")),
    "batch.global_batch_size",
    "train.seed",
)
# Changes a resume applies: the peak lr replaces the checkpoint's (optim.set_peak_lr), the schedule is rebuilt
# for the new horizon and shape, clipping and the stability rules are read every step.
APPLIED_ON_RESUME = ("optim.lr", "optim.lr_scaling", "optim.reference_global_batch_size", "optim.grad_clip",
                     "lr_schedule.", "train.max_steps", "train.max_tokens", "stability.")


@dataclass(frozen=True)
class TrainerState:
    """What a checkpoint records besides ``save_state``: what resume reads back, and what status prints."""

    step: int  # optimizer steps done; also the data cursor
    tokens_seen: int
    num_steps: int  # the horizon when saved (pretrain-slurm status prints step/num_steps)
    plan: dict[str, Any]  # BatchPlan.to_dict() when saved
    recipe: dict[str, Any]  # the resolved recipe when saved: the compatibility check reads it
    layout: dict[str, Any] | None = None  # Launch.to_dict() when saved (None: saved before it was recorded)
    data: dict[str, Any] | None = None  # the token store(s) trained on (pretrain.data.data_identity; None: older)
    stability: dict[str, Any] | None = None  # SkipPolicy.state_dict(): the rolling window and skip counts
    rollbacks: list[dict[str, Any]] | None = None  # stability.Rollbacks.records: the rollbacks before this save
    python: str = field(default_factory=lambda: sys.version.split()[0])
    torch: str = field(default_factory=lambda: torch.__version__)
    saved_at: float | None = None  # time.time() of the save

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainerState:
        """Keys this class does not know (older checkpoints wrote more) are ignored."""
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


def recipe_field(dotted: str) -> Any:
    """The pydantic field a dotted recipe key names, e.g. ``model.hidden_size``; KeyError if none does."""
    model: Any = Recipe
    info = None
    for part in dotted.split("."):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            raise KeyError(f"{dotted!r} names no field of the recipe schema (pretrain.recipe.config.Recipe)")
        info = model.model_fields[part]
        model = info.annotation
    return info


def _lookup(tree: dict, dotted: str):
    node: Any = tree
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += _diff(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else key)
        return out
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


def check_compatible(path: Path, saved: dict[str, Any], recipe: dict[str, Any]) -> list[str]:
    """Raise ConfigError if ``recipe`` changed a ``MUST_MATCH`` key since the checkpoint at ``path`` was
    saved with ``saved``; else the other differences, for a warning. A key naming no recipe field is a bug
    here, and raises KeyError rather than comparing None with None."""
    saved = renamed_keys(saved)  # a checkpoint of an older pretrain: its moved keys are no change
    for key in MUST_MATCH:
        recipe_field(key)
    changed = [key for key in MUST_MATCH if _lookup(saved, key) != _lookup(recipe, key)]
    if changed:
        details = "; ".join(d for key in changed for d in _diff(_lookup(saved, key), _lookup(recipe, key), key))
        raise ConfigError(
            f"cannot resume from {path}: the recipe changed where an exact continuation needs it unchanged "
            f"({details}); restore those values, set checkpoint.resume=none with a new output_dir, "
            "or delete the checkpoints"
        )
    return [d for d in _diff(saved, recipe) if not d.startswith(("checkpoint.", "logging."))]


def _data_refusal(path: Path, changes: list[str]) -> ConfigError:
    return ConfigError(
        f"cannot resume from {path}: the data it was trained on differs from this run's ({'; '.join(changes)}); "
        "its weights would continue on other token ids or another sample order. Restore that data (or point "
        "data.store at the store it names), or train on the new data as a new run: a new output_dir"
    )


def check_resume_data(path: Path, data_cfg: DataConfig) -> None:
    """Refuse to resume ``path`` when the data this run would read is not what it was trained on: the store's
    sources (their files' fingerprints), tokenizer, split. Every rank, before any store is prepared (a changed
    corpus would otherwise be tokenized, and a BPE retrained, first); every rank reads the same files, so every
    rank raises together. A checkpoint that recorded no data (older) is not checked here."""
    state = TrainerState.read(path)
    if state is None or state.data is None:
        return
    changes = data_changes(state.data, planned_data_identity(data_cfg, log=lambda _: None))
    if changes:
        raise _data_refusal(path, changes)


def resume_checkpoint(output_dir: str | Path, cfg: CheckpointConfig) -> Path | None:
    """The checkpoint to resume from according to ``checkpoint.resume`` (not verified), or None to start fresh.

    Plain file reads, needing no accelerator. ``ResumeChoice.decide`` verifies it and finds the fallbacks.
    """
    directory = Path(output_dir) / CHECKPOINTS_DIR
    if cfg.resume == "none":
        if complete_checkpoints(output_dir):
            raise ConfigError(
                f"checkpoint.resume=none but {directory} already holds checkpoints; resume them with "
                "checkpoint.resume=auto, or choose a new output_dir (nothing is overwritten)"
            )
        return None
    if cfg.resume == "auto":
        return latest_checkpoint(output_dir)
    path = Path(cfg.resume)
    if read_state(path) is None:
        raise ConfigError(
            f"checkpoint.resume = {cfg.resume!r} is not a complete checkpoint directory (no {STATE_FILE}); "
            f"give a path like {directory}/step_00000100, or use auto / none"
        )
    return path


def _candidates(output_dir: str | Path, cfg: CheckpointConfig) -> list[Path]:
    """The checkpoint ``checkpoint.resume`` names, then (auto) every older complete one, newest first."""
    path = resume_checkpoint(output_dir, cfg)
    if path is None or cfg.resume != "auto":
        return [] if path is None else [path]
    step = TrainerState.read(path).step
    return [path, *(p for s, p in reversed(complete_checkpoints(output_dir)) if s < step)]


def no_intact_checkpoint(damaged: list[tuple[str, str]], resume: str) -> str:
    found = "; ".join(f"{path}: {problem}" for path, problem in damaged)
    if resume == "auto":
        return (f"cannot resume: no checkpoint in {Path(damaged[0][0]).parent} is intact ({found}). Restore the "
                "damaged files from a copy, or move the damaged checkpoints out of checkpoints/ to start this "
                "output_dir afresh (nothing was changed)")
    return (f"cannot resume from checkpoint.resume = {resume!r}: it is damaged ({found}); restore it from a copy "
            "or give another checkpoint")


@dataclass(frozen=True)
class ResumeChoice:
    """Rank 0's answer to "which checkpoint does this run resume from?", as every rank receives it."""

    resume: str  # checkpoint.resume, for messages
    host: str  # rank 0's host, for messages
    path: str | None = None  # None: start fresh
    step: int | None = None  # the step recorded inside ``path``
    error: str | None = None  # the ConfigError deciding raised, held until every rank can raise it
    fallbacks: tuple[tuple[str, int], ...] = ()  # (path, step) of the older complete checkpoints, newest first
    damaged: tuple[tuple[str, str], ...] = ()  # (path, problem) of newer checkpoints passed over

    @classmethod
    def decide(cls, output_dir: str | Path, cfg: CheckpointConfig) -> ResumeChoice:
        """Rank 0's decision, before the process group exists (the trackers need its step): the newest
        checkpoint whose files have the sizes its manifest records (one stat per file). Every rank decides
        too (a conversion it waits for is the one of the checkpoint it sees) and takes rank 0's choice once
        the process group exists. A ConfigError is kept, not raised: rank 0 leaving alone would leave the
        other ranks waiting for it."""
        choice = cls(resume=cfg.resume, host=socket.gethostname())
        try:
            candidates = _candidates(output_dir, cfg)
        except ConfigError as exc:
            return replace(choice, error=str(exc))
        return choice.first_intact(candidates)

    @classmethod
    def before(cls, output_dir: str | Path, step: int) -> ResumeChoice:
        """The newest complete checkpoint of ``output_dir`` saved before optimizer step ``step`` whose files have
        their manifest's sizes, older ones as fallbacks (stability.rollback's target: rank 0 decides, and
        ``agree_on_resume`` verifies it on every rank as for a resume). ``path`` None: there is none."""
        choice = cls(resume="auto", host=socket.gethostname())
        return choice.first_intact([p for s, p in reversed(complete_checkpoints(output_dir)) if s < step])

    def first_intact(self, candidates: list[Path]) -> ResumeChoice:
        """This choice of the first of ``candidates`` (newest first) whose files have their manifest's sizes."""
        choice = self
        if not candidates:
            return choice
        damaged = []
        for index, path in enumerate(candidates):
            try:
                problem = check_sizes(path)
            except Unverified:
                problem = None  # written before manifests existed: agree_on_resume warns
            if problem is None:
                # The older ones are not stat-ed now (every rank decides, and a 512-rank ZeRO checkpoint has
                # ~1000 files): agree_on_resume's checksums find a missing or cut file there too.
                fallbacks = tuple((str(p), TrainerState.read(p).step) for p in candidates[index + 1:])
                return replace(choice, path=str(path), step=TrainerState.read(path).step, fallbacks=fallbacks,
                               damaged=tuple(damaged))
            damaged.append((str(path), problem))
        return replace(choice, error=no_intact_checkpoint(damaged, choice.resume))


def _sees(path: Path, step: int, output_dir: str | Path) -> str | None:
    state = TrainerState.read(path)
    if state is not None and state.step == step:
        return None
    seen = "no complete checkpoint" if state is None else f"a checkpoint at step {state.step}"
    newest = latest_checkpoint(output_dir)
    own = (f"newest visible: {newest} at step {TrainerState.read(newest).step}" if newest is not None
           else "no checkpoint visible in output_dir")
    return f"found {seen} at {path.resolve()} ({own})"


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


def agree_on_resume(accelerator: Accelerator, choice: ResumeChoice | None, output_dir: str | Path,
                    log: Callable[[str], None] = print) -> Path | None:
    """Every rank takes rank 0's ``choice`` (None on the other ranks), checks that it sees that very
    checkpoint, complete and at the same step, and verifies the checksums of its share of the files; damage
    found by any rank moves every rank on to the next fallback. The checkpoint to load, or None to start
    fresh. Any problem raises the same ConfigError on every rank. Collective: every rank calls it once the
    process group exists. Rank 0 logs the damage and moves the damaged checkpoints passed over aside."""
    [choice] = broadcast_object_list([choice])
    if choice.error is not None:
        raise ConfigError(choice.error)
    if choice.path is None:
        return None
    damaged = list(choice.damaged)
    chosen = None
    for name, step in ((choice.path, choice.step), *choice.fallbacks):
        path = Path(name)
        problems = rank_problems(accelerator, _sees(path, step, output_dir))
        if problems:
            raise ConfigError(
                f"the ranks do not see the same checkpoint to resume from: rank 0 (host {choice.host}) chose "
                f"{path} at step {step} (checkpoint.resume={choice.resume}), and {'; '.join(problems)}. Every "
                f"rank must load the checkpoint rank 0 chose: {SHARED_FS_HINT}"
            )
        damage = rank_problems(accelerator, verify_own(path, accelerator.process_index, accelerator.num_processes))
        # A file whose checksum matches may still have been crafted (whoever replaces a file can update the
        # manifest): each rank reads the pickles of its share without running them; one is refused, not passed
        # over as damage.
        refused = rank_problems(accelerator, check_files(path, own_files(path, accelerator.process_index,
                                                                         accelerator.num_processes)))
        if refused:
            raise ConfigError(f"cannot resume from {path}: {'; '.join(refused)}")
        if not damage:
            chosen = (path, step)
            break
        damaged.append((name, "; ".join(damage)))
    if chosen is None:
        raise ConfigError(no_intact_checkpoint(damaged, choice.resume))
    path, step = chosen
    if accelerator.is_main_process:  # every rank has verified (and given up on) the damaged ones by now
        for name, problem in damaged:
            if not is_inside(Path(name), Path(output_dir) / CHECKPOINTS_DIR):
                # not this run's (rank 0 decides among its own checkpoints only): pretrain moves nothing it
                # does not own
                log(f"warning: checkpoint {name} is damaged ({problem}); resuming from the previous intact "
                    f"checkpoint {path} (step {step}) instead. {name} is outside {output_dir}: left in place")
                continue
            aside = set_aside(Path(name))
            log(f"warning: checkpoint {name} is damaged ({problem}); resuming from the previous intact checkpoint "
                f"{path} (step {step}) instead. The damaged one is moved to {aside}: inspect it, then delete it")
        if not (path / MANIFEST_FILE).is_file():
            log(f"warning: checkpoint {path} has no manifest (written before checkpoints were verified): resumed "
                "without checking its files")
    return path


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
        # saves (dcp_group). Collective: every rank builds its Checkpointer.
        self.group = (torch.distributed.new_group(backend="gloo")
                      if cfg.async_ and accelerator.num_processes > 1 else None)
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

    def load(self, path: Path, recipe: dict[str, Any], source: ResumeSource | None = None,
             data: dict[str, Any] | None = None) -> tuple[TrainerState, list[str]]:
        """Restore everything from ``path``; returns its trainer state and the APPLIED_ON_RESUME changes.
        Refuses an incompatible recipe, and (``data``: the opened stores' ``data_identity``) a store holding
        other tokens. ``source``: the checkpoint as ``reshard.prepare_resume`` prepared it for this launch
        (where the state is read, whether the RNG is re-seeded); None: as saved."""
        source = source or ResumeSource(path, path, saved=None)
        state = TrainerState.read(path)
        assert state is not None
        other = check_compatible(path, state.recipe, recipe)
        if state.data is not None and data is not None:
            changes = data_changes(state.data, {name: (found, None) for name, found in data.items()}, opened=data)
            if changes:
                raise _data_refusal(path, changes)
        applied = [d for d in other if d.startswith(APPLIED_ON_RESUME)]
        other = [d for d in other if d not in applied]
        if applied:
            self.log(f"resume: applying the recipe's {'; '.join(applied)}")
        if other:
            self.log(f"resume: recipe differs from the checkpoint's in: {'; '.join(other)}")
        engine = getattr(getattr(self.accelerator, "deepspeed_engine_wrapped", None), "engine", None)
        if engine is not None:
            # DeepSpeed reads checkpoint.load_universal from its config at every load_checkpoint; the config was
            # built for the checkpoint the run started from, and a rollback may load the other kind (a checkpoint
            # this run wrote after a resume on another world size, or the universal view of one it resumed).
            engine._config.load_universal_checkpoint = source.load_universal
        with weights_only(source.load_dir):
            self.accelerator.load_state(str(source.load_dir))
        # load_state restores accelerate's micro-step counter (which decides the micro-step that synchronises)
        # from each process's RNG file: counted in the old GAS, and missing for a process the old run lacked.
        self.accelerator.step = state.step * self.accelerator.gradient_accumulation_steps
        if source.world_changed:
            # random_states_{i}.pkl belong to the processes of the old world size (a new process finds none,
            # an old index means another process now): every process draws a fresh stream instead.
            set_seed(int(recipe["train"]["seed"]) + state.step, device_specific=True)
            self.log(f"resume: world size {source.saved.world_size} -> {self.accelerator.num_processes}: "
                     "each process's random stream re-seeded from (train.seed, step, process index)")
        self.log(f"resume: continuing from {path} at step {state.step}")
        return state, applied
