"""The resume, decided in one place: which checkpoint, whether this run may continue from it, and loading it.

``Resume`` owns the whole decision, its checks and its effect, so that the run and the commands that check a
launch before any process starts ask the same object and cannot disagree (pretrain-launch, ``--dry-run`` and
pretrain-slurm call ``Resume.plan``; every training process calls ``Resume.prepare`` and ``Resume.load``).

- **Choice** (``ResumeChoice.decide``, rank 0's, plain file reads before any process group exists, because the
  trackers need the step): the checkpoint ``checkpoint.resume`` names, the newest whose files have the sizes its
  manifest records, the older ones kept as fallbacks; an error is kept, not raised (rank 0 leaving alone would
  leave the others waiting).
- **Data** (``check_resume_data``, before any store is prepared) and **recipe** (``check_compatible``): the
  checkpoint continues only what it trained, on the same tokens in the same order.
- **Layout** (``reshard.prepare_resume``): refused, or converted by every rank, each its share, agreeing through
  the launcher's store (a conversion may outlast any collective timeout); every rank takes rank 0's choice of
  checkpoint through the same store first.
- **Agreement** (``agree_on_resume``, collective): every rank takes rank 0's choice, checks that it sees that very
  checkpoint and verifies the checksums of its share of the files; damage moves every rank to the next fallback
  together, so ranks never load different steps. A damaged checkpoint passed over is moved aside to
  ``.damaged-step_X`` (never deleted); when none is intact the run stops with exit 2 and leaves them in place.
- **Load** (``Resume.load``, collective, once the model and optimizer are prepared): the accelerator's state
  (``Checkpointer.load``), then the run state's registered parts (``RunState.load_state_dict``). A resume and a
  stability rollback are the same call with another choice (``ResumeChoice.before``).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from pydantic import BaseModel

from pretrain.checkpoint.checkpointer import Checkpointer, set_aside
from pretrain.checkpoint.integrity import MANIFEST_FILE, Unverified, check_sizes, own_files, verify_own
from pretrain.checkpoint.reshard import ResumePlan, ResumeSource, plan_resume, prepare_resume
from pretrain.checkpoint.rundir import CHECKPOINTS_DIR, STATE_FILE, complete_checkpoints, latest_checkpoint, read_state
from pretrain.checkpoint.state import RunState, TrainerState
from pretrain.data import data_changes, planned_data_identity
from pretrain.distributed.accelerator import SHARED_FS_HINT
from pretrain.distributed.agreement import from_rank0, rank_problems
from pretrain.distributed.layout import Launch
from pretrain.distributed.peers import Peers
from pretrain.errors import ConfigError
from pretrain.recipe.config import CheckpointConfig, DataConfig, Recipe, renamed_keys
from pretrain.trust import check_files, is_inside

Log = Callable[[str], None]

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
    if path.name.startswith("."):
        # pretrain's own hidden names: a save in progress or cut short (.tmp-step_X, its manifest maybe not
        # written yet, so it would pass as a checkpoint from before manifests), one set aside as damaged or
        # rolled back, a conversion's work directory
        kind = "a save that did not finish" if path.name.startswith(".tmp-") else "a checkpoint set aside"
        raise ConfigError(
            f"checkpoint.resume = {cfg.resume!r} is {kind} (its name starts with '.'), not a checkpoint to resume; "
            f"give a complete one, e.g. {path.parent / path.name.lstrip('.').split('-', 1)[-1]} if it exists, or "
            "use auto"
        )
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
    def from_dict(cls, values: dict[str, Any]) -> ResumeChoice:
        """A choice sent as JSON (``asdict``'s form: its pairs came back as lists)."""
        pairs = {name: tuple(tuple(pair) for pair in values.get(name) or ()) for name in ("fallbacks", "damaged")}
        return cls(**{**values, **pairs})

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



def agree_on_resume(accelerator: Accelerator, choice: ResumeChoice | None, output_dir: str | Path,
                    log: Log = print) -> Path | None:
    """Every rank takes rank 0's ``choice`` (None on the other ranks), checks that it sees that very
    checkpoint, complete and at the same step, and verifies the checksums of its share of the files; damage
    found by any rank moves every rank on to the next fallback. The checkpoint to load, or None to start
    fresh. Any problem raises the same ConfigError on every rank. Collective: every rank calls it once the
    process group exists. Rank 0 logs the damage and moves the damaged checkpoints passed over aside."""
    choice = from_rank0(choice)
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


@dataclass(frozen=True)
class Resumed:
    """What a load restored (the run state's parts hold the rest)."""

    checkpoint: Path  # the checkpoint loaded
    step: int
    applied: list[str]  # the recipe's changes applied on resume (APPLIED_ON_RESUME)

    def record(self) -> dict[str, Any]:
        """What run_config.json records of the resume (``resume``)."""
        return {"from": str(self.checkpoint), "step": self.step, "applied": self.applied}


class Resume:
    """The resume of one run on one launch (``prepare``), loaded once the process group exists (``load``)."""

    def __init__(self, recipe: Recipe, launch: Launch, choice: ResumeChoice, source: ResumeSource | None, log: Log,
                 peers: Peers | None = None):
        self.recipe = recipe
        self.launch = launch
        self.peers = peers  # the launcher's store: the ranks share a conversion's work through it
        self.choice = choice  # what this process saw; rank 0's is the one every rank follows
        self.source = source  # the checkpoint this process saw, prepared for this launch (None: fresh start)
        self.log = log

    # ---- before any process exists: pretrain-launch, --dry-run, pretrain-slurm ------------------------------
    @staticmethod
    def checkpoint(recipe: Recipe) -> Path | None:
        """The checkpoint the run would resume (as rank 0 decides it), None for a fresh start; ConfigError for
        what the run would refuse about its checkpoints, or a file holding a crafted pickle."""
        from pretrain.checkpoint.integrity import checkpoint_files

        choice = ResumeChoice.decide(recipe.output_dir, recipe.checkpoint)
        if choice.error is not None:
            raise ConfigError(choice.error)
        if choice.path is None:
            return None
        # A checkpoint file that names a type the weights-only load refuses (a crafted pickle): exit 2 here, not
        # inside the workers, whose 2 torchrun reports as its own 1 (pretrain/trust.py; the run checks again).
        if refused := check_files(Path(choice.path), checkpoint_files(Path(choice.path))):
            raise ConfigError(refused)
        return Path(choice.path)

    @classmethod
    def plan(cls, recipe: Recipe, launch: Launch, checkpoint: Path | None = None) -> ResumePlan | None:
        """How the run would resume on ``launch`` (its ``checkpoint``, else the one ``Resume.checkpoint``
        chooses): the plan, None for a fresh start, or LayoutRefused. Plain file reads, no conversion: the same
        decision ``prepare`` acts on."""
        checkpoint = checkpoint or cls.checkpoint(recipe)
        return None if checkpoint is None else plan_resume(checkpoint, launch)

    # ---- every process, before the process group ------------------------------------------------------------
    @classmethod
    def prepare(cls, recipe: Recipe, launch: Launch, log: Log = print) -> Resume:
        """Decide, check the data, and convert (or refuse) the checkpoint for this launch; plain file reads and
        the launcher's store (every rank converts its share of rank 0's choice)."""
        # Every rank decides (errors are kept, not raised) for one purpose: the conversion it takes part in is the
        # one of the checkpoint it sees; ``load`` checks that it is rank 0's. Through the launcher's store every rank
        # sees rank 0's choice (a rank that saw another checkpoint, in a save's last moments, would convert another).
        peers = Peers.of_launch(launch)
        seen = ResumeChoice.decide(recipe.output_dir, recipe.checkpoint)
        if peers is not None:
            choice = peers.scope("resume-choice")
            seen = ResumeChoice.from_dict(choice.decide("choice", asdict(seen)))
            # A rank that does not see rank 0's checkpoint (node-local disk) prepares nothing, nor does any other:
            # agree_on_resume then refuses on every rank, naming what each sees
            choice.publish("sees", seen.path is None or read_state(Path(seen.path)) is not None)
            if not choice.decide("all see", all(choice.gather("sees")) if choice.is_main else None):
                return cls(recipe, launch, seen, None, log, peers)
        if seen.path:
            check_resume_data(Path(seen.path), recipe.data)  # before the store is prepared: exit 2 at once
        source = prepare_resume(Path(seen.path), launch, log=log, peers=peers) if seen.path else None
        return cls(recipe, launch, seen, source, log, peers)

    @property
    def step(self) -> int | None:
        """Rank 0's resume step, for its trackers (which drop the metrics of redone steps); None elsewhere or
        for a fresh start."""
        return self.choice.step if self.launch.is_main else None

    # ---- every process, collective, after accelerator.prepare -----------------------------------------------
    def load(self, accelerator: Accelerator, checkpointer: Checkpointer, state: RunState, *,
             data: dict[str, Any], choice: ResumeChoice | None = None) -> Resumed | None:
        """Agree on rank 0's ``choice`` (this resume's own unless given: a rollback's ``ResumeChoice.before``; None
        on the other ranks), check it against this recipe and the opened ``data`` (the stores' ``data_identity``),
        then restore it: the accelerator's state by ``checkpointer``, then every registered part of ``state``.
        None: a fresh start. Any problem raises the same ConfigError on every rank."""
        if choice is None and self.launch.is_main:
            choice = self.choice
        resume_from = agree_on_resume(accelerator, choice, self.recipe.output_dir, log=self.log)
        if resume_from is None:
            self.source = None
            return None
        if self.source is None or self.source.checkpoint != resume_from:
            # This rank saw another checkpoint before the process group existed (or the checksums sent every
            # rank to an older one, or a rollback goes back to one): follow rank 0, which prepares it first.
            self.source = prepare_resume(resume_from, self.launch, log=self.log, peers=self.peers)
        record = TrainerState.read(resume_from)
        applied = self.check(resume_from, record, data)
        checkpointer.load(self.source, seed=self.recipe.train.seed)
        state.load_state_dict(record.states())
        return Resumed(resume_from, record.step, applied)

    def check(self, path: Path, record: TrainerState, data: dict[str, Any]) -> list[str]:
        """Refuse a recipe or data this checkpoint cannot continue; log the other differences. Returns the changes
        applied on resume."""
        other = check_compatible(path, record.recipe, self.recipe.to_dict())
        if record.data is not None:
            changes = data_changes(record.data, {name: (found, None) for name, found in data.items()}, opened=data)
            if changes:
                raise _data_refusal(path, changes)
        applied = [d for d in other if d.startswith(APPLIED_ON_RESUME)]
        other = [d for d in other if d not in applied]
        if applied:
            self.log(f"resume: applying the recipe's {'; '.join(applied)}")
        if other:
            self.log(f"resume: recipe differs from the checkpoint's in: {'; '.join(other)}")
        return applied
