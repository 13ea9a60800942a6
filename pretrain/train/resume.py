"""Resume as one object: which checkpoint, whether this run may continue from it, and loading it.

``Resume`` owns the whole decision, its checks and its effect, so that the run and the commands that check a
launch before any process starts ask the same object and cannot disagree (pretrain-launch, ``--dry-run`` and
pretrain-slurm call ``Resume.plan``; every training process calls ``Resume.prepare`` and ``Resume.load``).

Two phases, because a run needs the answer on both sides of the process group:

- ``Resume.prepare`` (every process, before the process group exists): rank 0's choice of the checkpoint
  (``checkpoint.ResumeChoice``: the newest whose files have their manifest's sizes, older ones as fallbacks;
  an error is kept, not raised), the data it was trained on against this run's (``check_resume_data``, before
  any store is prepared), and its layout against this launch (``reshard.prepare_resume``: refused, or
  converted by rank 0 while the others wait on the filesystem: a conversion may outlast any collective
  timeout). The trackers need the step (``step``) and the DeepSpeed plugin whether to load a universal
  checkpoint (``load_universal``) before the accelerator exists.
- ``Resume.load`` (every process, collective, once the model, optimizer and scheduler are prepared): every
  rank takes rank 0's choice and verifies its share of the files (``checkpoint.agree_on_resume``: damage
  moves every rank to the next fallback), prepares that checkpoint if it is not the one seen first, restores
  the accelerator's state (``Checkpointer.load``), the stability rules' window, the run's rollbacks and this
  recipe's peak lr. ``Resume.roll_back`` (stability.rollback) does the same in a running process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.checkpoint.checkpointer import ResumeChoice, TrainerState, agree_on_resume, check_resume_data
from pretrain.checkpoint.reshard import ResumePlan, ResumeSource, plan_resume, prepare_resume
from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.recipe.config import Recipe

Log = Callable[[str], None]


@dataclass(frozen=True)
class Resumed:
    """What a resume restored that the loop continues from."""

    step: int
    tokens_seen: int
    record: dict[str, Any]  # what run_config.json records of the resume (``resume``)
    checkpoint: Path | None = None  # the checkpoint loaded
    saved_at: float | None = None  # its trainer state's save time: which save of that step it is


class Resume:
    """The resume of one run on one launch (``prepare``), loaded once the process group exists (``load``)."""

    def __init__(self, recipe: Recipe, launch: Launch, choice: ResumeChoice, source: ResumeSource | None, log: Log):
        self.recipe = recipe
        self.launch = launch
        self.choice = choice  # what this process saw; rank 0's is the one every rank follows
        self.source = source  # the checkpoint this process saw, prepared for this launch (None: fresh start)
        self.log = log

    # ---- before any process exists: pretrain-launch, --dry-run, pretrain-slurm ------------------------------
    @staticmethod
    def checkpoint(recipe: Recipe) -> Path | None:
        """The checkpoint the run would resume (as rank 0 decides it), None for a fresh start; ConfigError for
        what the run would refuse about its checkpoints, or a file holding a crafted pickle."""
        from pretrain.checkpoint.integrity import checkpoint_files
        from pretrain.trust import check_files

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
        """Decide, check the data, and convert (or refuse) the checkpoint for this launch; plain file reads
        (rank 0 converts, the others wait for the conversion of the checkpoint they see)."""
        # Every rank decides (errors are kept, not raised) for one purpose: the conversion it waits for is the
        # one of the checkpoint it sees; ``load`` checks that it is rank 0's.
        seen = ResumeChoice.decide(recipe.output_dir, recipe.checkpoint)
        if seen.path:
            check_resume_data(Path(seen.path), recipe.data)  # before the store is prepared: exit 2 at once
        source = prepare_resume(Path(seen.path), launch, log=log) if seen.path else None
        return cls(recipe, launch, seen, source, log)

    @property
    def step(self) -> int | None:
        """Rank 0's resume step, for its trackers (which drop the metrics of redone steps); None elsewhere or
        for a fresh start."""
        return self.choice.step if self.launch.is_main else None

    @property
    def load_universal(self) -> bool:
        """DeepSpeed's checkpoint.load_universal: the checkpoint was converted to a universal checkpoint."""
        return self.source is not None and self.source.load_universal

    # ---- every process, collective, after accelerator.prepare -----------------------------------------------
    def load(self, accelerator, checkpointer, *, trackers: list, data: dict[str, Any], scheduler, policy,
             rollbacks, lr: float, num_steps: int) -> Resumed | None:
        """Agree on rank 0's checkpoint, then restore it: the accelerator's state (model, optimizer,
        scheduler, RNG, by ``checkpointer``), the stability ``policy``'s window, the ``rollbacks`` of the run's
        timeline (the checkpoint's, and rollbacks.jsonl's to that checkpoint since), and this recipe's peak
        ``lr`` on the ``scheduler``. None: a fresh start. Any problem raises the same ConfigError on every rank."""
        from pretrain.checkpoint.rundir import read_rollbacks
        from pretrain.train.tracking import set_resume_step

        choice = self.choice if self.launch.is_main else None
        resume_from = agree_on_resume(accelerator, choice, self.recipe.output_dir, log=self.log)
        if resume_from is None:
            self.source = None
            return None
        if self.source is None or self.source.checkpoint != resume_from:
            # The trackers were built for the step of the checkpoint seen first.
            set_resume_step(trackers, TrainerState.read(resume_from).step)

        def restore(state: TrainerState) -> None:  # before the lr: the rollbacks' lr factors are in the schedule
            rollbacks.restore(state.rollbacks, read_rollbacks(self.recipe.output_dir), resume_from.name,
                              state.saved_at)

        return self._restore(resume_from, checkpointer, data=data, scheduler=scheduler, policy=policy, lr=lr,
                             num_steps=num_steps, before_lr=restore)

    def roll_back(self, accelerator, choice, checkpointer, *, data: dict[str, Any], scheduler, policy, rollbacks,
                  lr: float, num_steps: int) -> Resumed:
        """stability.rollback, in the running process (collective): agree on rank 0's ``choice`` (a
        ``ResumeChoice.before``: None on the other ranks) and restore it as ``load`` does, by the same
        machinery (checksums, fallbacks, ``Checkpointer.load``), ``rollbacks`` included: the timeline of the
        checkpoint loaded (where a damaged checkpoint sent the load to an older one, the rollbacks made since that
        one belong to the timeline given up). The caller adds this rollback's record."""
        resume_from = agree_on_resume(accelerator, choice, self.recipe.output_dir, log=self.log)
        assert resume_from is not None, "a rollback has a checkpoint to go back to"
        # The run's records, not rollbacks.jsonl: rank 0 appends this rollback's record to the file once it has
        # reloaded, maybe before another rank reads it.
        live = list(rollbacks.records)

        def restore(state: TrainerState) -> None:
            rollbacks.restore(state.rollbacks, live, resume_from.name, state.saved_at)

        return self._restore(resume_from, checkpointer, data=data, scheduler=scheduler, policy=policy, lr=lr,
                             num_steps=num_steps, before_lr=restore)

    def _restore(self, resume_from: Path, checkpointer, *, data, scheduler, policy, lr: float, num_steps: int,
                 before_lr=None) -> Resumed:
        from pretrain.model.optim import set_peak_lr

        if self.source is None or self.source.checkpoint != resume_from:
            # This rank saw another checkpoint before the process group existed (or the checksums sent every
            # rank to an older one, or a rollback goes back to one): follow rank 0, which prepares it first.
            self.source = prepare_resume(resume_from, self.launch, log=self.log)
        state, applied = checkpointer.load(self.source.checkpoint, self.recipe.to_dict(), self.source, data=data)
        policy.load_state_dict(state.stability)
        if before_lr is not None:
            before_lr(state)
        # The checkpoint's scheduler and optimizer state carry its peak lr: this recipe's is the one in force.
        lr_now = set_peak_lr(scheduler, lr)
        if applied:
            self.log(f"resume: lr {lr_now:.4g} at step {state.step} (peak {lr:.4g}, {num_steps} steps)")
        record = {"from": str(self.source.checkpoint), "step": state.step, "applied": applied, "lr": lr_now}
        return Resumed(state.step, state.tokens_seen, record, Path(resume_from), state.saved_at)
