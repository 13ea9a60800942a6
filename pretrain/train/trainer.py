"""The training loop.

Names: a *micro-step* is one forward/backward on MBS sequences of one process; an *optimizer step*
(``step``) is GAS micro-steps on every process followed by one parameter update. The LR schedule,
logging, evaluation and checkpoints all count optimizer steps.

The loss of an optimizer step is the sum of token losses over the whole global batch divided by its
number of target tokens. Each micro-step's loss is normalised by N_global / (ranks x GAS): accelerate
divides by GAS and the gradient reduction averages over the ranks (the data-parallel world; under context
parallelism dp x cp, each CP rank summing its part of the sequences), which leaves exactly sum / N_global.

Each component owns its cadence and its state: the ``Engine`` (pretrain/train/engine.py) the whole optimizer step,
the ``Checkpointer`` (pretrain/checkpoint/checkpointer.py) when to save, the ``Evaluator`` when to evaluate, the
``StepLog`` which steps log, the ``ThroughputMonitor`` the measured interval, ``StopSignals`` the stop request, the
``Rollback`` (pretrain/train/rollback.py) what a streak of skipped updates does. The run's state is registered once
(``stateful_parts``, pretrain/checkpoint/state.py): a checkpoint saves it, and a resume and a rollback load it by
the one ``load``. ``Trainer.train`` only puts them in order.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from accelerate.utils import set_seed

from pretrain.checkpoint.checkpointer import Checkpointer
from pretrain.checkpoint.export import prepare_init_from
from pretrain.checkpoint.resume import Resume, ResumeChoice, Resumed
from pretrain.checkpoint.rundir import latest_checkpoint
from pretrain.checkpoint.state import RunState, Stateful, TrainerState, TrainProgress
from pretrain.data import data_identity, ensure_data, open_data
from pretrain.data.loader import TrainData, document_masking
from pretrain.data.order import SampleOrderVersion
from pretrain.data.quarantine import resolve_exclude
from pretrain.distributed.accelerator import build_accelerator, check_shared_output_dir
from pretrain.distributed.layout import Launch
from pretrain.distributed.preemption import StopSignals, signal_hook
from pretrain.distributed.supervise import RunLock
from pretrain.errors import TrainingDiverged, writable_dir
from pretrain.model.optim import Schedule
from pretrain.recipe.config import Recipe
from pretrain.train.diagnostics import Diagnostics
from pretrain.train.downstream import DownstreamEvaluator
from pretrain.train.engine import Engine, Objective, OptimizerStep, loss_normaliser
from pretrain.train.evaluation import Evaluator
from pretrain.train.final_model import FinalModel
from pretrain.train.goodput import Goodput
from pretrain.train.metrics import ThroughputMonitor, peak_warning, train_metrics
from pretrain.train.model_parts import build_model_parts
from pretrain.train.preflight import check_run
from pretrain.train.rollback import Rollback
from pretrain.train.run_record import start_run_record
from pretrain.train.stability import SkipPolicy, StepGate, TooManySkips, Verdict, injected_loss_factors
from pretrain.train.tracking import Console, StepLog, build_trackers, set_resume_step


class Trainer:
    def __init__(self, recipe: Recipe, launch: Launch | None = None, prepare_command: str | None = None,
                 notes: list[str] | tuple[str, ...] = (), stop: StopSignals | None = None,
                 started: float | None = None):
        """``notes``: lines the run's log opens with (what the entry point decided: batch.micro_batch_size auto's
        choice). ``stop``: the entry point's stop signals, installed before this is built (else ``train`` installs
        its own for the loop). ``started``: when the attempt started, for its goodput (run.py: the process's start,
        imports included); else now."""
        started = time.time() if started is None else started
        self.recipe, self.output_dir, self.stop = recipe, Path(recipe.output_dir), stop
        self.launch = (launch or Launch.from_env()).for_recipe(recipe)
        self.is_main = self.launch.is_main
        self.console = Console(recipe.logging.progress, enabled=self.is_main)
        for note in notes:
            self.log(note)
        # Everything that can be checked without compute is checked before any process group exists.
        run_plan = check_run(recipe, self.launch)
        self.plan, self.lr, self.progress = run_plan.batch, run_plan.lr, TrainProgress(run_plan.num_steps)
        writable_dir(self.output_dir, f"output_dir = {str(self.output_dir)!r}",
                     "choose another, e.g. output_dir=/tmp/my-run")
        # One run per output_dir: global rank 0 holds the lock (a second run stops here with exit 2, and a
        # rank 0 that stops takes its launch down with it).
        self.lock = RunLock.acquire(self.output_dir, log=self.log) if self.is_main else None
        # Where this attempt's wall time goes, from the process's start (pretrain/train/goodput.py).
        self.goodput = Goodput.open(self.output_dir, write=self.is_main, log=self.log, started=started)
        # The resume (pretrain/checkpoint/resume.py): decided, its data checked and its layout converted (or refused)
        # now, before any process group exists; loaded once the model and optimizer are prepared (``load``).
        self.resume = Resume.prepare(recipe, self.launch, log=self.log)
        # model.init_from's files (a hub model downloaded, a pretrain checkpoint written as a transformers model),
        # before the process group exists and before the data (whose tokenizer is the checkpoint's).
        init_from = self.reads_init_from()
        if init_from:
            prepare_init_from(recipe, self.launch, log=self.log)
        # The token store exists before the process group does: no rank ever waits for data in a collective.
        prepare_command = prepare_command or f"pretrain-prepare-data --recipe <the recipe of {recipe.name!r}>"
        with self.goodput.phase("data_build"):
            signal_hook("data_build")
            ensure_data(recipe.data, self.launch, prepare_command, log=self.log)

        self.trackers = build_trackers(recipe, self.output_dir, self.resume.step, self.is_main)
        self.setup = build_accelerator(recipe, run_plan, self.output_dir, self.trackers)
        self.accelerator, self.device = self.setup.accelerator, self.setup.accelerator.device
        self.log(f"compile: {self.setup.compile_mode} ({self.setup.compile_reason})")
        check_shared_output_dir(self.accelerator, self.output_dir)  # every rank raises the same error, or none does
        self.checkpointer = Checkpointer(self.accelerator, self.output_dir, recipe.checkpoint, self.num_steps,
                                         log=self.log)
        self.diagnostics = Diagnostics(self.accelerator, recipe.runtime, recipe.profile, self.output_dir, self.log)
        set_seed(recipe.train.seed)
        with self.goodput.phase("data_build"):
            self.data = open_data(recipe.data, log=self.log, prepare_command=prepare_command)
        self.tokenizer = self.data.tokenizer
        self.parts = build_model_parts(recipe, run_plan, self.accelerator, self.setup, len(self.tokenizer),
                                       pretrained=init_from, log=self.log, log_every_rank=self.log_every_rank)
        self.model, self.optimizer, self.scheduler = self.parts.model, self.parts.optimizer, self.parts.scheduler
        self.final_model = (FinalModel(self.accelerator, recipe, self.tokenizer, self.parts.config, self.log)
                            if recipe.checkpoint.save_final_model else None)
        self.build_step(fp16=run_plan.mixed_precision == "fp16")
        self.state = RunState(log=self.log, **self.stateful_parts())
        resumed = self.load()
        self.goodput.step = self.step
        self.resumed = None if resumed is None else {**resumed.record(), "lr": self.schedule.lr}  # run_config.json's
        if resumed is not None and resumed.step != self.resume.choice.step:
            set_resume_step(self.trackers, resumed.step)  # they were built for the checkpoint seen first
        self.build_loop(run_plan.tasks)
        start_run_record(self)

    def build_step(self, fp16: bool) -> None:
        """The optimizer step's parts: the stability rules, the rollbacks, the schedule's rule and the engine."""
        recipe, parts = self.recipe, self.parts
        self.policy = SkipPolicy(recipe.stability, fp16=fp16)
        self.gate = StepGate(self.policy) if recipe.stability.checks_steps else None
        # data.exclude's lists read now (one ConfigError before training); a resume keeps its checkpoint's reading.
        excluded = resolve_exclude(recipe.data.exclude, self.data, self.log)
        self.rollback = Rollback(recipe.stability.rollback, self.output_dir, excluded, log=self.log)
        self.order_version = SampleOrderVersion()  # a new run's sample order, or its checkpoint's once loaded
        # The rollbacks' lr factors are part of the schedule itself (without rollbacks every factor is 1).
        self.schedule = Schedule(self.scheduler, self.lr, self.rollback.lr_factor, log=self.log)
        # Packed sequences have no padding: every position of a global batch is a target (with document masking
        # too: an eos keeps the next document's first token as its target).
        objective = Objective(
            self.plan.grad_accum_steps, loss_normaliser(self.plan.tokens_per_step, self.launch,
                                                        self.plan.grad_accum_steps),
            recipe.optim.grad_clip, self.launch.cp_size, parts.loss_terms, parts.router,
            before_sync=self.diagnostics.before_sync)
        self.engine = Engine.build(self.accelerator, self.model, self.optimizer, self.scheduler, self.gate, objective,
                                   fp16=fp16, deepspeed_config=self.setup.deepspeed_config)
        self.loss_factors = injected_loss_factors()  # a test hook: {} in any real run
        if self.is_main:
            self.engine.write_config(self.output_dir)

    def stateful_parts(self) -> dict[str, Stateful]:
        """The run's state, registered once (in load order): what a checkpoint records besides the accelerator's,
        and what a resume and a rollback restore."""
        return {"progress": self.progress, "stability": self.policy, "rollback": self.rollback,
                "schedule": self.schedule, "data_order": self.order_version}

    def build_loop(self, tasks) -> None:
        """The loop's parts, from the step loaded on: the data stream, evaluation, logging and throughput."""
        recipe, pin = self.recipe, self.device.type == "cuda"
        masking = document_masking(recipe.data, recipe.model.attention, self.tokenizer)
        self.train_data = TrainData(self.data, recipe.data, self.plan, self.launch.data_rank, recipe.train.seed,
                                    self.num_steps, pin, masking, self.order_version.version)
        self.log(self.train_data.reposition(self.step, self.rollback.removals))
        downstream = DownstreamEvaluator.for_run(self.accelerator, tasks, self.tokenizer, recipe, self.plan,
                                                 self.launch, self.num_steps, self.console)
        self.evaluator = Evaluator(self.accelerator, self.train_data.val_loaders(recipe.eval),
                                   every_steps=recipe.eval.every_steps, num_steps=self.num_steps,
                                   at_start=recipe.eval.at_start, console=self.console,
                                   weights=getattr(self.data, "weights", None), cp_size=self.launch.cp_size,
                                   downstream=downstream)
        self.step_log = StepLog(self.accelerator, self.console, every_steps=recipe.logging.every_steps,
                                num_steps=self.num_steps)
        flops = self.parts.flops
        recomputes = recipe.model.activation_checkpointing != "none"  # perf/hfu too (selective's equals perf/mfu)
        self.throughput = ThroughputMonitor(
            # per device: every GPU, TP and CP ranks too (the batch plan's world is the data-parallel ranks)
            self.plan.tokens_per_step, self.plan.global_batch_size, self.launch.world_size,
            warmup_steps=recipe.logging.throughput_warmup_steps, peak_tflops=self.parts.peak.tflops,
            flops_per_token=flops.model_flops if flops else None,
            hardware_flops_per_token=flops.hardware_flops if flops and recomputes else None,
            on_peak_raised=peak_warning(self.parts.peak, self.log),
        )
        self.rolled_back = False  # the step after a rollback is always logged
        self.saved_step: int | None = None  # the step of this run's newest save
        self.preempted = self.interrupted = False  # interrupted: the stop was a Ctrl-C (SIGINT): run.py exits 130

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def num_steps(self) -> int:
        return self.progress.num_steps

    def load(self, choice: ResumeChoice | None = None) -> Resumed | None:
        """The run's one load: the accelerator's state and every registered part, from rank 0's resume choice, or
        from ``choice`` (a rollback's); None: a fresh start."""
        return self.resume.load(self.accelerator, self.checkpointer, self.state, data=data_identity(self.data),
                                choice=choice)

    def log(self, message: str) -> None:
        if self.is_main:
            self.console.print(message)

    def log_every_rank(self, message: str) -> None:
        """A line each rank prints (what the rank itself did: its share of model.init_from's weights)."""
        if self.launch.world_size == 1:
            self.log(message)
        else:
            sys.stdout.write(f"[rank {self.launch.rank}] {message}\n")  # one write: ranks' lines do not interleave
            sys.stdout.flush()

    def reads_init_from(self) -> bool:
        """Whether model.init_from's weights are read: not when a resume will load the run's own checkpoint (every
        rank sees it: the output_dir is shared)."""
        if self.recipe.model.init_from is None:
            return False
        if self.resume.source is not None:
            self.log(f"init_from: {self.recipe.model.init_from} not read: this run resumes its own checkpoint at "
                     f"step {self.resume.choice.step} (checkpoint.resume wins; model.init_from only starts a run)")
            return False
        return True

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Optimizer steps up to the horizon, or until a stop signal; returns the last logged train metrics."""
        last_metrics: dict[str, float] = {}
        if self.stop is not None:
            self.stop.immediate = False  # from here a signal is a flag: the step in flight (or the export) finishes
        if self.step >= self.num_steps:
            self.log(f"run already complete at step {self.step}/{self.num_steps}")
            if self.final_model is not None and self.final_model.path.is_dir():  # written whole, then renamed
                self.log(f"export: {self.final_model.path} is there already (delete it to export again)")
                self.final_model = None
            self.finish()
            return last_metrics
        # SIGTERM / SIGUSR1 / Ctrl-C: stop after the step in flight (the entry point installed them before the build)
        with contextlib.nullcontext(self.stop) if self.stop else StopSignals(log=self.log) as stop:
            stop.log = self.log  # immediate already off (above; a StopSignals of its own starts so)
            if self.step == 0 and self.evaluator.due(0):
                with self.goodput.phase("evaluation"):
                    self.evaluator.evaluate(self.model, 0)
            self.model.train()
            self.throughput.start(self.step)
            self.console.start(self.num_steps, self.step)
            first_step = self.step
            self.goodput.loop_started(first_step)
            with self.diagnostics.loop(first_step) as diagnostics:  # profiler window, hang watchdog
                try:
                    ended, last_metrics = self.loop(stop, diagnostics)
                except TrainingDiverged as exc:
                    self.goodput.loop_ended()
                    self.console.close()
                    with self.goodput.phase("checkpoint"):
                        self.checkpointer.wait()  # the newest checkpoint may still be written in the background
                    newest = latest_checkpoint(self.output_dir)
                    self.accelerator.end_training()
                    self.goodput.write()
                    raise TrainingDiverged(f"{exc} (newest checkpoint: {newest or 'none'})") from None
            stop.settle()  # the stop agreement in flight, while the process group exists
            self.goodput.loop_ended()
            # Outside the loop's diagnostics: the watchdog does not time the export or the preemption checkpoint.
            if ended == "preempted":
                self.interrupted = stop.interrupted
                self.stop_preempted()
            elif ended == "straggler":
                self.stop_preempted(why="straggler")
            elif ended == "exhausted":
                self.stop_exhausted(first_step)
            else:
                self.finish()
        return last_metrics

    def loop(self, stop: StopSignals, diagnostics: Diagnostics) -> tuple[str, dict[str, float]]:
        """Optimizer steps until the horizon ("done"), an agreed stop signal ("preempted"), a straggler host to
        exclude ("straggler") or data.on_exhausted=stop ("exhausted"); the last logged train metrics."""
        last_metrics: dict[str, float] = {}
        first_step = self.step
        while self.step < self.num_steps:
            if self.train_data.stop_step is not None and self.step >= self.train_data.stop_step:
                return "exhausted", last_metrics
            diagnostics.step_start(self.step + 1, timed=self.step_log.due(self.step + 1))
            if self.step == first_step:
                signal_hook("first_step")
            # The test hook (stability.LOSS_FACTORS_ENV), keyed like the data: by the global batch this step reads
            # (batch N - 1 for step N, unless a rollback skipped batches), so a rollback skips an injected spike
            # as it skips bad data, and a resume meets the same factors.
            factor = self.loss_factors.get(self.train_data.batch_index(self.step) + 1) if self.loss_factors else None
            with diagnostics.oom_snapshot():
                result = self.engine.train_step(self.train_data.batches, self.throughput.data_wait, factor)
            self.progress.advance(self.plan.tokens_per_step)
            self.throughput.step_done(self.step)
            try:
                last_metrics = self.report(result) or last_metrics
            except TooManySkips as stop_here:  # TrainingDiverged (exit 3) unless stability.rollback takes over
                with self.goodput.phase("rollback"):
                    self.rollback.roll_back(stop_here, self)
                self.goodput.rolled_back(self.step)  # the steps after the checkpoint it reloaded were thrown away
                self.goodput.write()
                self.rolled_back = True
                self.throughput.start(self.step)  # the interval restarts after the reload, as after a resume
                diagnostics.step_done()
                continue
            self.goodput.step_done(self.step, kept=not (result.verdict is not None and result.verdict.skip))
            if self.evaluator.due(self.step):
                with self.throughput.excluded(), self.goodput.phase("evaluation"):
                    signal_hook("evaluation", self.step)
                    self.evaluator.evaluate(self.model, self.step)
            if self.diagnostics.exclude_requested:  # every rank judged the same gathered step times
                return "straggler", last_metrics
            if self.checkpointer.should_save(self.step):
                with self.throughput.excluded(), self.goodput.phase("checkpoint"):
                    self.save_checkpoint()
                self.goodput.write()
            if stop.agreed(self.accelerator):  # every rank, every step; a signal during the save stops here too
                return "preempted", last_metrics
            diagnostics.step_done()
        return "done", last_metrics

    # ---- around the loop ----------------------------------------------------------------------------
    def log_train(self, result: OptimizerStep) -> dict[str, float]:
        self.goodput.write(force=False)
        return self.step_log.write(self.step, {**train_metrics(self, result), **self.goodput.metrics()})

    def report(self, result: OptimizerStep) -> dict[str, float] | None:
        """Count the step's verdict, log the step (on logging steps, and always when its update was skipped);
        the metrics logged, if any. Raises TrainingDiverged, once the step is logged, after too many skips."""
        diverged = None
        if result.verdict is not None:
            try:
                self.policy.record(self.step, result.verdict, *self.gate.values)
            except TrainingDiverged as exc:
                diverged = exc
        skipped = result.verdict is not None and result.verdict.skip
        logged = self.log_train(result) if self.step_log.due(self.step) or skipped or self.rolled_back else None
        if logged is None:
            self.console.advance(self.step)
        self.rolled_back = False
        if skipped:
            self.log_skip(result.verdict)
        if diverged is not None:
            raise diverged
        return logged

    def log_skip(self, verdict: Verdict) -> None:
        limit = self.recipe.stability.max_consecutive_skips
        then = "rolls back" if self.recipe.stability.rollback.enabled else "stops"
        self.log(f"step {self.step}: update skipped by {verdict.rule}: {verdict.reason} "
                 f"({self.policy.consecutive} in a row, {self.policy.skipped} in the run"
                 + (f"; the run {then} at {limit} in a row)" if limit else ")"))

    def save_checkpoint(self) -> None:
        """A checkpoint of the step just done, unless the training state is not finite (TrainingDiverged)."""
        signal_hook("checkpoint", self.step)
        record = TrainerState.of(self.state.state_dict(), plan=self.plan.to_dict(), recipe=self.recipe.to_dict(),
                                 layout=self.launch.to_dict(), data=data_identity(self.data),
                                 optimizer_params=self.parts.optimizer_params)
        self.checkpointer.save(record, optimizer=self.optimizer)
        self.saved_step = self.step
        signal_hook("checkpoint_written", self.step)  # checkpoint.async: the write is still in flight

    def stop_preempted(self, why: str = "") -> None:
        """A stop signal reached every rank (or, ``why="straggler"``, a straggler host is to be excluded):
        checkpoint the step just done and end; the same command resumes."""
        with self.goodput.phase("checkpoint"):
            if self.saved_step != self.step:  # the signal came during this step's own save: it is saved
                self.save_checkpoint()
            self.checkpointer.wait()  # checkpoint.async: written before the run says it has it
        self.preempted = True
        self.console.close()
        # pretrain-slurm status counts "preempted: ..."
        what = why or ("interrupted" if self.interrupted else "preempted")
        self.log(f"{what}: stopped after step {self.step}/{self.num_steps} with a checkpoint; "
                 "the same command resumes from it")
        self.end()

    def stop_exhausted(self, first_step: int) -> None:
        """data.on_exhausted=stop: a source has been read once. Checkpoint (unless this step's is there), evaluate
        and end like a finished run; the same command would stop here again."""
        if self.step > first_step and not self.checkpointer.should_save(self.step):
            with self.goodput.phase("checkpoint"):
                self.save_checkpoint()
        with self.goodput.phase("evaluation"):
            self.evaluator.evaluate_rest(self.model, self.step)
        _, source = self.train_data.order.steps_available()
        what = f"source {source!r}" if source else "the training split"
        self.log(f"data: stopped after step {self.step}/{self.num_steps}: {what} has been read once and "
                 "data.on_exhausted=stop; the checkpoint holds the run. Add data or set data.on_exhausted=repeat "
                 "to train further")
        self.finish()

    def finish(self) -> None:
        self.console.close()
        if self.final_model is not None:
            with self.goodput.phase("final_model"):
                signal_hook("final_model")
                self.final_model.save(self.model)
        self.end()

    def end(self) -> None:
        with self.goodput.phase("checkpoint"):
            self.checkpointer.wait()  # checkpoint.async: the write in flight completes before the process group goes
        self.goodput.switch("shutdown")
        self.accelerator.end_training()
        self.goodput.write()
        self.log(self.goodput.summary())
        if self.lock is not None:
            self.lock.release()
