"""``stability.rollback``: the run's rollbacks as a stateful part, and the rollback itself as its hook.

Instead of the stop of ``stability.max_consecutive_skips``, what a person does by hand (bigscience's and metaseq's
restarts, PaLM's "restart ~100 steps before the spike and skip 200-500 batches"): reload the newest verified
checkpoint saved before the streak's first skip, skip the global batches from its step to the stop, and go on,
optionally at a lower lr for a while; at most ``max_attempts`` times to one checkpoint. Like OLMo-core's stability
monitor and ``steps_to_skip``, what was skipped is data the loop consults: the sample order leaves out ``skipped``
(``loader.FilteredOrder``) and the schedule multiplies its lr by ``lr_factor`` (``optim.Schedule``).

Before it goes on, the reloaded model scores the window's documents (``document_scores``: one forward per
micro-batch, the loss per token of each document, ranked, in ``output_dir/rollback_scores/``). With ``skip: documents``
the rollback leaves out only the rows holding the ``num_quarantined`` top-ranked documents, from the window's first
sample on (``loader.Quarantine``), lists them in ``output_dir/quarantine.json`` and retrains the window without them.

One record per rollback (docs/checkpoints.md lists its keys): ``batches``, the first and last global batch index of
the window (step N of a run without rollbacks reads batch N - 1), ``positions``, the window in the order's flat
stream, and with ``skip: documents`` ``quarantine`` (``from``: the flat position it starts at, ``samples``: the
global sample indices left out) instead of the window; ``lr_schedule_steps``, the schedule steps [start, stop) whose
lr is multiplied by ``lr_factor``. ``data.exclude``'s resolution (``excluded``) is this part's state too, so a resume
reads what its run resolved, not the lists as edited since. The records are the run's own timeline: a checkpoint holds
those before it (this part's state) and ``output_dir/rollbacks.jsonl`` gets each as it happens, so a run killed after
a rollback and before its next checkpoint resumes from the checkpoint the rollback reloaded with the rollback applied.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pretrain.checkpoint.resume import ResumeChoice
from pretrain.checkpoint.rundir import ROLLBACKS_FILE, append_record, read_rollbacks, timeline_rollbacks
from pretrain.data.order import FilteredOrder, removals_of
from pretrain.data.quarantine import QUARANTINE_FILE, add_entries, document_samples, entry
from pretrain.distributed.agreement import from_rank0
from pretrain.errors import TrainingDiverged
from pretrain.recipe.config import RollbackConfig
from pretrain.train.document_scores import SCORES_DIR, describe, name_sources, score_window, write_scores
from pretrain.train.stability import TooManySkips
from pretrain.train.tracking import rewind_trackers


class Rollback:
    """The rollbacks of this run's timeline (``records``) and the rollback that adds one (``roll_back``)."""

    def __init__(self, cfg: RollbackConfig, output_dir: str | Path | None = None,
                 excluded: dict[str, Any] | None = None, log=print):
        """``excluded``: data.exclude as this start resolved it (``quarantine.resolve_exclude``); a checkpoint's
        resolution replaces it at a load."""
        self.cfg, self.log = cfg, log
        self.excluded = self.resolved = excluded
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.records: list[dict[str, Any]] = []
        # Every record of rollbacks.jsonl, of any timeline, and those this process adds: a load keeps those made to
        # the very snapshot it loads (read once: rank 0 appends to the file while other ranks may still be loading).
        self.logged = read_rollbacks(self.output_dir) if self.output_dir is not None else []
        self.loaded_at: float | None = None  # the save time of the snapshot loaded last: a rollback's record names it

    # ---- the part's state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # saved_at tells two saves of one step apart: rollbacks to the one given up belong to another timeline.
        return {"records": list(self.records), "saved_at": time.time(), "excluded": self.excluded}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A snapshot's rollbacks, then those rollbacks.jsonl records as made to that very snapshot after it was
        saved (``rundir.timeline_rollbacks``); and the snapshot's data.exclude resolution (a checkpoint written
        before data.exclude existed: none)."""
        self.loaded_at = state["saved_at"] if state else None
        self.records = timeline_rollbacks(state, self.logged)
        if state is None:
            self.excluded = self.resolved
            return
        self.excluded = state.get("excluded")
        if _samples(self.excluded) != _samples(self.resolved):
            self.log(f"data.exclude: the checkpoint's resolution is kept ({len(_samples(self.excluded))} rows left "
                     f"out); the lists now name {len(_samples(self.resolved))} rows. A resume reads what its run "
                     "read: start a new run (or model.init_from) to apply the lists as they are now")

    # ---- what the loop and the schedule consult ---------------------------------------------------------------
    @property
    def removals(self) -> list:
        """What the order leaves out (``loader.FilteredOrder``): data.exclude's rows from step 0, then each
        rollback's window or quarantine."""
        return removals_of(self.records, self.excluded)

    def attempts(self, to_step: int) -> int:
        """Rollbacks so far to the checkpoint of ``to_step`` (checkpoints of later steps are set aside at each
        rollback, so one step names one checkpoint of this timeline)."""
        return sum(1 for r in self.records if r["to_step"] == to_step)

    def lr_factor(self, schedule_step: int) -> float:
        """What the schedule's lr is multiplied by at ``schedule_step`` (1.0 outside every rollback's window). Windows
        that overlap multiply: a second rollback to the same checkpoint runs at lr_factor squared."""
        factor = 1.0
        for record in self.records:
            start, stop = record["lr_schedule_steps"]
            if start <= schedule_step < stop:
                factor *= record["lr_factor"]
        return factor

    def metrics(self) -> dict[str, int]:
        return {"stability/rollbacks": len(self.records)}

    # ---- the hook: the loop's TooManySkips -----------------------------------------------------------------------
    def roll_back(self, stop: TooManySkips, run) -> None:
        """Reload the newest verified checkpoint saved before the streak's first skipped step (``run``: the Trainer,
        whose one ``load`` it calls), skip the global batches from its step to ``stop.step``, and go on. Every rank gets here at the
        same step (the verdicts are the same on every rank) and takes rank 0's choice of checkpoint. Raises ``stop``
        (exit 3) when rollback is off, and TrainingDiverged when no checkpoint precedes the streak or after
        max_attempts rollbacks to that checkpoint."""
        cfg = self.cfg
        if not cfg.enabled:
            raise stop
        first = stop.first_skipped_step
        run.checkpointer.wait()  # checkpoint.async: a write in flight is finished (and listed) before the choice
        choice = ResumeChoice.before(run.output_dir, first) if run.is_main else None
        choice = from_rank0(choice)
        if choice.path is None and choice.error is None:
            raise TrainingDiverged(f"{stop}. stability.rollback: no checkpoint was saved before step {first}, the "
                                   "first skip of the streak (checkpoint.every_steps)") from None
        if choice.step is not None and self.attempts(choice.step) >= cfg.max_attempts:
            raise TrainingDiverged(f"{stop}. stability.rollback gave up: {cfg.max_attempts} rollback(s) to "
                                   f"{choice.path} (step {choice.step}) already (stability.rollback.max_attempts)"
                                   ) from None
        # The window in the order's global batches: those steps back_to + 1 .. stop.step read in the attempt given
        # up (consecutive batches: every earlier rollback's window lies before back_to's batch).
        order = run.train_data.order  # the order the attempt given up read (the load does not reposition it)
        last_batch = run.train_data.batch_index(stop.step - 1)
        resumed = run.load(choice if run.is_main else None)
        back_to = resumed.step
        batches = [run.train_data.batch_index(back_to), last_batch]
        positions = [_base_position(order, back_to), _base_position(order, stop.step)]
        schedule_step = run.schedule.step
        number = len(self.records) + 1
        # The reloaded model scores the window's documents (one forward per micro-batch, every rank alike). Not under
        # tensor or context parallelism, where a rank's forward is not one of whole rows (skip=documents is refused
        # there before the run starts).
        scores = []
        if run.launch.tp_size == 1 and run.launch.cp_size == 1:
            scores = score_window(run.model, run.accelerator, run.data, order, run.plan, run.launch.data_rank,
                                  back_to, stop.step, run.train_data.masking)
            name_sources(run.data, scores)
        record = {
            "rollback": number, "stopped_at_step": stop.step, "first_skipped_step": first,
            "rule": stop.verdict.rule, "reason": stop.verdict.reason,
            "checkpoint": resumed.checkpoint.name, "checkpoint_saved_at": self.loaded_at, "to_step": back_to,
            "skipped_steps": [back_to + 1, stop.step], "batches": batches, "positions": positions,
            "skip": cfg.skip,
            "lr_factor": cfg.lr_factor, "lr_schedule_steps": [schedule_step, schedule_step + cfg.lr_factor_steps],
            "time": round(time.time(), 3),
        }
        quarantined = []
        if cfg.skip == "documents":
            quarantined = scores[: cfg.num_quarantined]
            samples = sorted({int(i) for d in quarantined
                              for i in document_samples(run.data, d["source"], d["file"], d["document"])})
            record["quarantine"] = {"from": positions[0], "samples": samples,
                                    "documents": [{k: d[k] for k in ("source", "file", "document",
                                                                      "loss_per_token", "tokens")}
                                                  for d in quarantined]}
        self.records.append(record)
        self.logged.append(record)
        lr_now = run.schedule.apply()  # again: the new window's factor, from the next update
        moved = []
        if run.is_main:
            # The record first, made durable: a run killed from here on resumes with this rollback applied.
            append_record(run.output_dir / ROLLBACKS_FILE, record)
            if scores:
                write_scores(run.output_dir, number, scores)
            if quarantined:
                add_entries(run.output_dir, [
                    entry(run.data, d["source"], d["file"], d["document"], rollback=number,
                          loss_per_token=d["loss_per_token"], tokens=d["tokens"], added="rollback")
                    for d in quarantined])
            moved = run.checkpointer.abandon_after(resumed.checkpoint)
            rewind_trackers(run.trackers, back_to)
        run.accelerator.wait_for_everyone()
        run.train_data.reposition(back_to, self.removals)
        if scores:
            run.log(f"stability: rollback {number} scored {len(scores)} document(s) of steps {back_to + 1}-{stop.step} "
                    f"by loss per token, highest: {describe(scores)} ({SCORES_DIR}/rollback-{number:04d}.jsonl)")
        lr_text = (f"; lr x{cfg.lr_factor:g} for the next {cfg.lr_factor_steps} updates (now {lr_now:.4g})"
                   if cfg.lr_factor != 1 and cfg.lr_factor_steps else "")
        aside = f"; set aside: {', '.join(p.name for p in moved)}" if moved else ""
        run.log(f"stability: rollback {self.attempts(back_to)}/{cfg.max_attempts} to {resumed.checkpoint} "
                f"(step {back_to}) after steps {first}-{stop.step} were skipped in a row ({stop.verdict.rule}: "
                f"{stop.verdict.reason}); " + (
                    f"the global batches of steps {back_to + 1}-{stop.step} (batches {batches[0]}-{batches[1]}) are "
                    f"skipped" if not quarantined else
                    f"steps {back_to + 1}-{stop.step} are retrained without the rows of {len(quarantined)} "
                    f"quarantined document(s) ({len(record['quarantine']['samples'])} rows, listed in "
                    f"{QUARANTINE_FILE})") + f", recorded in {ROLLBACKS_FILE}{lr_text}{aside}")


def _samples(excluded: dict[str, Any] | None) -> list[int]:
    return list(excluded["samples"]) if excluded else []


def _base_position(order, step: int) -> int:
    """The flat position of step ``step``'s first element in the base order's stream."""
    if isinstance(order, FilteredOrder):
        return order.base_position(step)
    return step * order.global_batch_size


