"""The training loop.

Names: a *micro-step* is one forward/backward on MBS sequences of one process; an *optimizer step*
(``step``) is GAS micro-steps on every process followed by one parameter update. The LR schedule,
logging, evaluation and checkpoints all count optimizer steps.

The loss of an optimizer step is the sum of token losses over the whole global batch divided by its
number of target tokens. Each micro-step's loss is normalised by N_global / (ranks x GAS): accelerate
divides by GAS and the gradient reduction averages over the ranks (the data-parallel world; under context
parallelism dp x cp, each CP rank summing its part of the sequences), which leaves exactly sum / N_global.

Each component owns its cadence and its state: the ``Checkpointer`` (pretrain/checkpoint/checkpointer.py) when to
save, the ``Evaluator`` (pretrain/train/evaluation.py) when to evaluate, the ``StepLog`` (pretrain/train/tracking.py)
which steps log, the ``ThroughputMonitor`` (pretrain/train/metrics.py) the measured interval, ``StopSignals``
(pretrain/distributed/preemption.py) the stop request. ``Trainer.train`` only puts them in order.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list, set_seed

from pretrain.checkpoint.checkpointer import Checkpointer, ResumeChoice, TrainerState
from pretrain.checkpoint.export import prepare_init_from
from pretrain.checkpoint.rundir import ROLLBACKS_FILE, latest_checkpoint
from pretrain.data import cache_root, data_identity, ensure_data, open_data, sample_val_texts
from pretrain.distributed import context_parallel
from pretrain.distributed.accelerator import (
    build_accelerator,
    check_shared_output_dir,
    compile_in_place,
    model_placement,
)
from pretrain.distributed.layout import Launch
from pretrain.distributed.preemption import StopSignals
from pretrain.distributed.supervise import RunLock
from pretrain.errors import ConfigError, TrainingDiverged, writable_dir
from pretrain.model import float8
from pretrain.model.build import (
    build_model,
    count_active_parameters,
    count_parameters,
    resolve_vocab_size,
    save_pretrained_model,
)
from pretrain.model.export import check_tokenizer_round_trip
from pretrain.model.loss import install_loss
from pretrain.model.measure import measure
from pretrain.model.optim import build_optimizer, build_scheduler, deepspeed_optimizer, set_peak_lr
from pretrain.plan.memory import MemoryEstimate, estimate
from pretrain.recipe.batching import BatchPlan
from pretrain.recipe.config import Recipe
from pretrain.recipe.shape import FlopsPerToken, flops_per_token
from pretrain.system.hardware import gpu_for_device
from pretrain.system.quiet import TiedWeightsSaved
from pretrain.train.diagnostics import Diagnostics
from pretrain.train.downstream import DownstreamEvaluator
from pretrain.train.engine import Engine
from pretrain.train.evaluation import Evaluator
from pretrain.train.loader import (
    DocumentMasking,
    batch_index,
    build_train_loader,
    build_val_loaders,
    data_horizon,
)
from pretrain.train.metrics import ThroughputMonitor, memory_metrics, resolve_peak
from pretrain.train.preflight import check_run
from pretrain.train.resume import Resume
from pretrain.train.router import RouterStats
from pretrain.train.run_record import start_run_record
from pretrain.train.stability import (
    Rollbacks,
    SkipPolicy,
    StepGate,
    TooManySkips,
    Verdict,
    injected_loss_factors,
    scale_schedule,
)
from pretrain.train.tracking import Console, StepLog, build_trackers, rewind_trackers


def loss_normaliser(global_target_tokens: int, launch: Launch, grad_accum_steps: int) -> float:
    """What each micro-step's summed token loss is divided by: N_global / (ranks x GAS), the ranks being those the
    gradients are averaged over (``context_parallel.gradient_ranks``: dp, x cp under context parallelism)."""
    return global_target_tokens / (context_parallel.gradient_ranks(launch) * grad_accum_steps)


def check_output_dir(output_dir: Path) -> None:
    """Fail before any compute if the run cannot write where it is told to."""
    writable_dir(output_dir, f"output_dir = {str(output_dir)!r}", "choose another, e.g. output_dir=/tmp/my-run")


def document_masking(recipe: Recipe, tokenizer) -> DocumentMasking | None:
    """``data.document_masking``: documents end at the tokenizer's eos (the token packing appends to each)."""
    if not recipe.data.document_masking:
        return None
    return DocumentMasking(eos_id=tokenizer.eos_token_id, varlen=recipe.model.attention == "flash_attention_2")


def throughput_reference(recipe: Recipe, hf_config, device: torch.device, log):
    """FLOPs per token of this model and the device's peak, for tokens/s -> TFLOP/s -> MFU.

    The FLOPs keep the dense convention (``shape.CONVENTION``: attention over the whole seq_len) with
    ``data.document_masking`` too, although attention within documents does less work (flash_attention_2
    skips the blocks across documents; sdpa and eager compute them and mask them out), so MFU stays
    comparable across runs and with other code bases.
    """
    try:
        flops = flops_per_token(hf_config, recipe.data.seq_len,
                                activation_checkpointing=recipe.model.activation_checkpointing)
    except ConfigError:
        flops = measured_flops(recipe, hf_config, log)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = resolve_peak(device.type, name, recipe.precision.dtype, recipe.logging.peak_tflops,
                        cache_dir=cache_root(recipe.data))
    if peak.tflops is None:
        log(f"warning: perf/mfu is not logged: {peak.detail} (logging.peak_tflops=<dense TFLOP/s>)")
    return flops, peak


def measured_flops(recipe: Recipe, hf_config, log) -> FlopsPerToken | None:
    """No closed form for this architecture: its FLOPs per token counted on the meta device (model/measure.py),
    the same convention, one line saying so; None (no MFU) when even that fails."""
    try:
        measured = measure(hf_config, recipe.data.seq_len)
    except ConfigError as exc:
        log(f"warning: no FLOPs count, so no TFLOP/s or MFU: {exc}")
        return None
    log(f"FLOPs per token of {hf_config.model_type} measured (no closed form): {measured.forward_flops_per_token:,.0f} "
        "per forward, counted by FlopCounterMode on the meta device; training = 3 x forward")
    return measured.flops_per_token(recipe.model.activation_checkpointing)


def memory_estimate(recipe: Recipe, plan: BatchPlan, launch: Launch, device: torch.device, log,
                    loss: str | None = None) -> MemoryEstimate | None:
    """The estimator's figures for this very run (``loss``: model.loss as resolved), logged beside the measured
    peak: its total (what the fit is judged on) and its tensors alone (what max_memory_allocated measures)."""
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = gpu_for_device(props.name, props.total_memory)
    try:
        return estimate(recipe, plan, launch, gpu=gpu, device=device.type, loss=loss)
    except ConfigError as exc:
        log(f"warning: no memory estimate for this layout: {exc}")
        return None


@dataclass
class OptimizerStep:
    """What an optimizer step leaves for logging; device tensors, read only on logging steps."""

    loss_sum: torch.Tensor  # this process's micro-step losses, summed (with the z-loss, if any)
    grad_norm: torch.Tensor | float | None
    lr: float  # the lr this step used
    verdict: Verdict | None = None  # the stability rules' (None: stability checks off)
    loss: float | None = None  # the global loss when the rules read it (else reduced on logging steps)
    z_loss_sum: torch.Tensor | None = None  # this process's z-loss part of loss_sum (stability.z_loss)


class Trainer:
    def __init__(self, recipe: Recipe, launch: Launch | None = None, prepare_command: str | None = None):
        self.recipe = recipe
        self.output_dir = Path(recipe.output_dir)
        self.launch = launch or Launch.from_env()
        self.is_main = self.launch.is_main
        self.console = Console(recipe.logging.progress, enabled=self.is_main)

        # Everything that can be checked without compute is checked before any process group exists.
        run_plan = check_run(recipe, self.launch)
        self.plan: BatchPlan = run_plan.batch
        self.num_steps = run_plan.num_steps
        self.lr = run_plan.lr
        check_output_dir(self.output_dir)
        # One run per output_dir: global rank 0 holds the lock (a second run stops here with exit 2, and a
        # rank 0 that stops takes its launch down with it).
        self.lock = RunLock.acquire(self.output_dir, log=self.log) if self.is_main else None
        # The resume (pretrain/train/resume.py): decided, its data checked and its layout converted (or refused) now,
        # before any process group exists; loaded once the model and optimizer are prepared (below).
        self.resume = Resume.prepare(recipe, self.launch, log=self.log)

        # model.init_from's files (a hub model downloaded, a pretrain checkpoint written as a transformers model),
        # before the process group exists and before the data (whose tokenizer is the checkpoint's).
        if recipe.model.init_from is not None and self.resume.source is None:
            prepare_init_from(recipe, self.launch, log=self.log)
        # The token store exists before the process group does: no rank ever waits for data in a collective.
        prepare_command = prepare_command or f"pretrain-prepare-data --recipe <the recipe of {recipe.name!r}>"
        ensure_data(recipe.data, self.launch, prepare_command, log=self.log)

        self.trackers = build_trackers(recipe, self.output_dir, self.resume.step, self.is_main)
        self.setup = build_accelerator(recipe, run_plan, self.output_dir, self.trackers,
                                         load_universal=self.resume.load_universal)
        self.accelerator = self.setup.accelerator
        self.log(f"compile: {self.setup.compile_mode} ({self.setup.compile_reason})")
        self.device = self.accelerator.device
        # Collectives: every rank raises the same ConfigError, or none does.
        check_shared_output_dir(self.accelerator, self.output_dir)
        self.checkpointer = Checkpointer(self.accelerator, self.output_dir, recipe.checkpoint, self.num_steps,
                                         log=self.log)
        self.diagnostics = Diagnostics(self.accelerator, recipe.runtime, recipe.profile, self.output_dir, self.log)
        set_seed(recipe.train.seed)

        self.data = open_data(recipe.data, log=self.log, prepare_command=prepare_command)
        self.tokenizer = self.data.tokenizer

        vocab = resolve_vocab_size(recipe.model, len(self.tokenizer))
        # Built on the run's device (or partitioned, or sharded first): never a full fp32 copy per rank on CPU.
        placement = model_placement(self.accelerator)
        self.float8: float8.Float8Report | None = None

        def to_float8(meta_model):  # on the meta model, before FSDP2 shards it (pretrain/model/float8.py)
            self.float8 = float8.convert(meta_model, recipe.precision, emulate=self.device.type != "cuda",
                                         fsdp2=self.accelerator.is_fsdp2)

        model = build_model(recipe.model, vocab, recipe.data.seq_len, seed=recipe.train.seed,
                            device=placement.device, shard=placement.shard,
                            convert=to_float8 if recipe.precision.float8 != "off" else None,
                            pretrained=self.pretrained_weights(), log=self.log_every_rank)
        if self.float8 is not None:
            self.log(self.float8.line())
        self.num_params = count_parameters(model)
        self.num_active_params = count_active_parameters(model)
        self.val_texts = self.check_export_tokenizer(model.config)
        self.loss_implementation, why = run_plan.loss  # model.loss (auto: liger on CUDA, if it can)
        self.log(f"loss: {self.loss_implementation} ({why})")
        self.loss_terms = install_loss(model, self.loss_implementation, recipe.stability.z_loss)
        self.router = RouterStats.for_model(model.config)  # MoE: the load-balancing loss and expert load
        TiedWeightsSaved.install(model)  # checkpoints leave out the tied LM head copy; loading ties it again
        self.flops, self.peak = throughput_reference(recipe, model.config, self.device, self.log)
        # The estimate of the model just built: its vocabulary, whatever the estimator could read of the tokenizer.
        built = recipe.model_copy(update={"model": recipe.model.model_copy(update={"vocab_size": vocab})})
        estimated = memory_estimate(built, self.plan, self.launch, self.device, self.log, self.loss_implementation)
        self.memory_estimate_gib = estimated.total_gib if estimated else None
        self.memory_estimate_tensors_gib = estimated.tensor_peak_gib if estimated else None
        if self.setup.deepspeed_optimizer:
            optimizer, scheduler = deepspeed_optimizer(model, recipe, self.lr, self.num_steps)
        else:
            optimizer = build_optimizer(model, recipe.optim, self.lr, self.device.type)
            scheduler = build_scheduler(optimizer, recipe.lr_schedule, self.num_steps)
        if self.float8 is not None and self.float8.fsdp_float8_all_gather:
            # torch's optimizer hook, on the optimizer accelerate wraps: after every update that happened
            optimizer.register_step_post_hook(lambda *_: float8.after_optimizer_step(model, self.float8))
        compile_in_place(model, self.setup.compile_mode, self.launch)  # one process / DDP; else accelerate's
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        fp16 = recipe.precision.dtype == "fp16"
        self.policy = SkipPolicy(recipe.stability, fp16=fp16)
        self.gate = StepGate(self.policy) if recipe.stability.checks_steps else None
        # stability.rollback's history: the batches skipped and the lr factors, part of the schedule itself (a
        # resume restores them below, before the lr is set; without rollbacks every factor is 1).
        self.rollbacks = Rollbacks(recipe.stability.rollback)
        scale_schedule(self.scheduler, self.rollbacks.lr_factor)
        self.rolled_back = False  # the step after a rollback is always logged
        # Backward, clipping, the update and the loss scale: the engine's (pretrain/train/engine.py).
        self.engine = Engine.build(self.accelerator, self.model, self.optimizer, self.scheduler, self.gate,
                                   fp16=fp16, deepspeed_config=self.setup.deepspeed_config)
        self.loss_factors = injected_loss_factors()  # a test hook: {} in any real run
        if self.is_main:
            self.engine.write_config(self.output_dir)

        self.step = 0
        self.tokens_seen = 0
        self.preempted = False
        self.interrupted = False  # the stop was a Ctrl-C (SIGINT): run.py exits 130
        self.resumed: dict | None = None  # what run_config.json records of the resume
        resumed = self.resume.load(self.accelerator, self.checkpointer, trackers=self.trackers,
                                   data=data_identity(self.data), scheduler=self.scheduler, policy=self.policy,
                                   rollbacks=self.rollbacks, lr=self.lr, num_steps=self.num_steps)
        if resumed is not None:
            self.step, self.tokens_seen, self.resumed = resumed.step, resumed.tokens_seen, resumed.record

        pin = self.device.type == "cuda"
        masking = document_masking(recipe, self.tokenizer)
        self.masking = masking
        self.train_loader, self.sample_order = build_train_loader(
            self.data, recipe.data, self.plan, self.launch.data_rank, recipe.train.seed, self.step, pin,
            masking, skipped=self.rollbacks.skipped,
        )
        val_sets = build_val_loaders(
            self.data, recipe.data, self.plan, self.launch.data_rank, recipe.eval.batches, pin,
            masking,
        )
        # data.on_exhausted: the step at which `stop` ends the run (None: never), and the epochs read per source.
        self.data_stop_step, message = data_horizon(self.sample_order, self.num_steps, recipe.data.on_exhausted)
        self.log(message)
        # Targets per global batch: packed sequences have no padding, so every position is a target (with
        # document masking too: an eos keeps the next document's first token as its target).
        self.global_target_tokens = self.plan.tokens_per_step
        self.loss_normaliser = loss_normaliser(self.global_target_tokens, self.launch, self.plan.grad_accum_steps)

        self.evaluator = Evaluator(self.accelerator, val_sets, every_steps=recipe.eval.every_steps,
                                   num_steps=self.num_steps, at_start=recipe.eval.at_start, console=self.console,
                                   weights=getattr(self.data, "weights", None), cp_size=self.launch.cp_size,
                                   downstream=self.downstream_evaluator(run_plan.tasks))
        self.step_log = StepLog(self.accelerator, self.console, every_steps=recipe.logging.every_steps,
                                num_steps=self.num_steps)
        # any checkpointing policy: perf/hfu too (selective's equals perf/mfu: it recomputes no matmul)
        flops, recomputes = self.flops, recipe.model.activation_checkpointing != "none"
        self.throughput = ThroughputMonitor(
            # per device: every GPU, TP and CP ranks too (the batch plan's world is the data-parallel ranks)
            self.plan.tokens_per_step, self.plan.global_batch_size, self.launch.world_size,
            warmup_steps=recipe.logging.throughput_warmup_steps, peak_tflops=self.peak.tflops,
            flops_per_token=flops.model_flops if flops else None,
            hardware_flops_per_token=flops.hardware_flops if flops and recomputes else None,
            on_peak_raised=self.peak_raised,
        )
        start_run_record(self)

    def downstream_evaluator(self, tasks) -> DownstreamEvaluator | None:
        """eval.tasks (read and checked by check_run): each rank's share tokenized once, scored in forward calls of
        at most MBS x seq_len padded tokens (logits no larger than a training micro-batch's)."""
        if not tasks:
            return None
        recipe = self.recipe
        return DownstreamEvaluator(
            self.accelerator, tasks, self.tokenizer, max_len=recipe.data.seq_len,
            # under CP every rank scores whole requests: the rows a CP rank's share of a micro-batch holds
            batch_tokens=self.plan.micro_batch_size * recipe.data.seq_len // self.launch.cp_size,
            data_rank=self.launch.data_rank,
            data_world=self.launch.data_parallel_size, every_steps=recipe.eval.every_steps,
            num_steps=self.num_steps, at_start=recipe.eval.at_start, console=self.console,
        )

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

    def pretrained_weights(self) -> bool:
        """Whether model.init_from's weights are read: not when a resume will load the run's own checkpoint."""
        init_from = self.recipe.model.init_from
        if init_from is None:
            return False
        if self.resume.source is not None:  # every rank sees the checkpoint (the output_dir is shared)
            self.log(f"init_from: {init_from} not read: this run resumes its own checkpoint at step "
                     f"{self.resume.choice.step} (checkpoint.resume wins; model.init_from only starts a run)")
            return False
        return True

    def peak_raised(self, peak_tflops: float, achieved_tflops: float) -> None:
        """This run beat the peak it was given; MFU now uses the achieved rate (ThroughputMonitor). A CPU peak
        measured while other processes held the cores is expected to be beaten: nothing to act on. A table or
        recipe peak that is beaten is wrong: said once."""
        if self.peak.source != "measured" and peak_tflops == self.peak.tflops:
            self.log(f"warning: this run computes {achieved_tflops:.4g} TFLOP/s per device, above the peak it was "
                     f"given ({self.peak.detail}); MFU uses the achieved rate as the peak from now on. Set "
                     "logging.peak_tflops to this device's dense peak for the training dtype")

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Optimizer steps up to the horizon, or until a stop signal; returns the last logged train metrics."""
        last_metrics: dict[str, float] = {}
        if self.step >= self.num_steps:
            self.log(f"run already complete at step {self.step}/{self.num_steps}")
            self.finish()
            return last_metrics
        with StopSignals(log=self.log) as stop:  # SIGTERM / SIGUSR1 / Ctrl-C: stop after the step in flight
            if self.step == 0 and self.evaluator.due(0):
                self.evaluator.evaluate(self.model, 0)
            self.model.train()
            batches = iter(self.train_loader)
            self.throughput.start(self.step)
            self.console.start(self.num_steps, self.step)
            first_step = self.step
            with self.diagnostics.loop(first_step) as diagnostics:  # profiler window, hang watchdog
                try:
                    ended, last_metrics = self.loop(batches, stop, diagnostics)
                except TrainingDiverged as exc:
                    self.console.close()
                    self.checkpointer.wait()  # the newest checkpoint may still be written in the background
                    newest = latest_checkpoint(self.output_dir)
                    self.accelerator.end_training()
                    raise TrainingDiverged(f"{exc} (newest checkpoint: {newest or 'none'})") from None
            # Outside the loop's diagnostics: the watchdog does not time the export or the preemption checkpoint.
            if ended == "preempted":
                self.interrupted = stop.interrupted
                self.stop_preempted()
            elif ended == "exhausted":
                self.stop_exhausted(first_step)
            else:
                self.finish()
        return last_metrics

    def loop(self, batches, stop: StopSignals, diagnostics: Diagnostics) -> tuple[str, dict[str, float]]:
        """Optimizer steps until the horizon ("done"), an agreed stop signal ("preempted") or
        data.on_exhausted=stop ("exhausted"); the last logged train metrics."""
        last_metrics: dict[str, float] = {}
        while self.step < self.num_steps:
            if self.data_stop_step is not None and self.step >= self.data_stop_step:
                return "exhausted", last_metrics
            diagnostics.step_start(self.step + 1, timed=self.step_log.due(self.step + 1))
            with diagnostics.oom_snapshot():
                result = self.train_step(batches)
            self.step += 1
            self.tokens_seen += self.plan.tokens_per_step
            self.throughput.step_done(self.step)
            try:
                last_metrics = self.report(result) or last_metrics
            except TooManySkips as stop_here:  # TrainingDiverged (exit 3) unless stability.rollback takes over
                batches = self.roll_back(stop_here)
                self.throughput.start(self.step)  # the interval restarts after the reload, as after a resume
                diagnostics.step_done()
                continue
            if self.evaluator.due(self.step):
                with self.throughput.excluded():
                    self.evaluator.evaluate(self.model, self.step)
            if self.checkpointer.should_save(self.step):
                with self.throughput.excluded():
                    self.save_checkpoint()
            elif stop.agreed(self.accelerator):
                return "preempted", last_metrics
            diagnostics.step_done()
        return "done", last_metrics

    def train_step(self, batches) -> OptimizerStep:
        """One optimizer step: GAS micro-steps; the last one synchronises gradients and updates (or, by the
        stability rules, skips the update)."""
        loss_sum = torch.zeros((), device=self.device)
        lr = self.optimizer.param_groups[0]["lr"]  # the lr this step uses
        for _micro_step in range(self.plan.grad_accum_steps):
            with self.throughput.data_wait():
                batch = next(batches).to(self.device)
            loss, grad_norm, verdict = self.micro_step(batch, loss_sum)
            loss_sum += loss
        assert self.accelerator.sync_gradients, "the last micro-step of an optimizer step must synchronise gradients"
        z_loss_sum = self.loss_terms.take() if self.loss_terms is not None else None
        loss = self.gate.values[0] if verdict is not None else None
        return OptimizerStep(loss_sum, grad_norm, lr, verdict, loss, z_loss_sum)

    def micro_step(self, batch, loss_before: torch.Tensor) -> tuple[torch.Tensor, Any, Verdict | None]:
        """Forward and backward of one micro-batch; on the micro-step that synchronises gradients also clip,
        judge (stability), update and step the schedule. Returns the detached loss, and the gradient norm and
        the verdict (None on the other micro-steps). ``loss_before``: this step's earlier micro-step losses."""
        acc, model, engine = self.accelerator, self.model, self.engine
        grad_norm = verdict = None
        inputs = context_parallel.forward_inputs(batch.input_ids, batch.targets, batch.attention_kwargs(),
                                                 self.launch.cp_size)
        # Context parallelism: forward and backward on this rank's part of every sequence, ring attention between
        # the CP ranks (nothing without CP).
        with acc.accumulate(model), context_parallel.split_sequences(acc, inputs, self.launch.cp_size):
            # Only the loss is kept: the output's logits are freed before backward, not at the next forward.
            output = model(**inputs, num_items_in_batch=self.loss_normaliser,
                           **(self.router.forward_kwargs if self.router else {}))
            # The objective (backward's) includes an MoE's weighted load-balancing loss; `loss`, which is
            # logged and gated on, is the cross-entropy (+ z-loss) as for a dense model.
            loss = objective = output.loss
            if self.router is not None:
                loss = objective - self.router.record(output)
            del output
            if acc.sync_gradients:
                self.diagnostics.before_sync()
            # The test hook (stability.LOSS_FACTORS_ENV), keyed like the data: by the global batch this step reads
            # (batch N - 1 for step N, unless a rollback skipped batches), so a rollback skips an injected spike
            # as it skips bad data, and a resume meets the same factors.
            data_step = batch_index(self.sample_order, self.step) + 1 if self.loss_factors else None
            if data_step in self.loss_factors:
                factor = self.loss_factors[data_step]
                loss, objective = loss * factor, objective * factor
            if acc.sync_gradients and self.gate is not None:
                # The step's global loss (cross-entropy), reduced before the last backward: DeepSpeed updates
                # inside it. Every rank gets the same value, so every rank takes the same decision.
                local = loss_before + loss.detach()
                if self.loss_terms is not None and self.loss_terms.z_loss is not None:
                    local = local - self.loss_terms.z_loss
                self.gate.begin(acc.reduce(local, reduction="mean"), self.plan.grad_accum_steps)
            engine.backward(objective)
            if acc.sync_gradients:
                grad_norm = engine.clip_grad_norm(self.recipe.optim.grad_clip)
                verdict = engine.judge(grad_norm)
            engine.update(verdict)  # or its skip, by the verdict
        return loss.detach(), grad_norm, verdict

    def log_skip(self, verdict: Verdict) -> None:
        limit = self.recipe.stability.max_consecutive_skips
        then = "rolls back" if self.recipe.stability.rollback.enabled else "stops"
        self.log(f"step {self.step}: update skipped by {verdict.rule}: {verdict.reason} "
                 f"({self.policy.consecutive} in a row, {self.policy.skipped} in the run"
                 + (f"; the run {then} at {limit} in a row)" if limit else ")"))

    def roll_back(self, stop: TooManySkips):
        """stability.rollback, instead of the stop ``stop``: reload the newest verified checkpoint saved before
        the streak's first skipped step, skip the global batches from its step to ``stop.step``, and go on (in this
        process: the load is the resume's own, Resume.roll_back). Every rank gets here at the same step (the
        verdicts are the same on every rank) and takes rank 0's choice of checkpoint. Returns the batches from the
        checkpoint's step on. Raises ``stop`` (exit 3) when rollback is off, when no checkpoint precedes the
        streak, or after max_attempts rollbacks to that checkpoint."""
        cfg = self.recipe.stability.rollback
        if not cfg.enabled:
            raise stop
        first = stop.first_skipped_step
        self.checkpointer.wait()  # checkpoint.async: a write in flight is finished (and listed) before the choice
        choice = ResumeChoice.before(self.output_dir, first) if self.is_main else None
        [choice] = broadcast_object_list([choice])
        if choice.path is None and choice.error is None:
            raise TrainingDiverged(f"{stop}. stability.rollback: no checkpoint was saved before step {first}, the "
                                   "first skip of the streak (checkpoint.every_steps)") from None
        if choice.step is not None and self.rollbacks.attempts(choice.step) >= cfg.max_attempts:
            raise TrainingDiverged(f"{stop}. stability.rollback gave up: {cfg.max_attempts} rollback(s) to "
                                   f"{choice.path} (step {choice.step}) already (stability.rollback.max_attempts)"
                                   ) from None
        resumed = self.resume.roll_back(self.accelerator, choice if self.is_main else None, self.checkpointer,
                                        data=data_identity(self.data), scheduler=self.scheduler,
                                        policy=self.policy, rollbacks=self.rollbacks, lr=self.lr, num_steps=self.num_steps)
        back_to = resumed.step
        skipped_first_step = back_to + 1
        # The window in the order's global batches: those steps back_to + 1 .. stop.step read in the attempt given
        # up (consecutive batches: every earlier rollback's window lies before back_to's batch).
        batches = [batch_index(self.sample_order, back_to), batch_index(self.sample_order, stop.step - 1)]
        inner = getattr(self.scheduler, "scheduler", self.scheduler)
        schedule_step = int(inner.last_epoch)
        number = len(self.rollbacks.records) + 1
        record = {
            "rollback": number, "stopped_at_step": stop.step, "first_skipped_step": first,
            "rule": stop.verdict.rule, "reason": stop.verdict.reason,
            "checkpoint": resumed.checkpoint.name, "checkpoint_saved_at": resumed.saved_at, "to_step": back_to,
            "skipped_steps": [skipped_first_step, stop.step], "batches": batches,
            "lr_factor": cfg.lr_factor, "lr_schedule_steps": [schedule_step, schedule_step + cfg.lr_factor_steps],
            "time": round(time.time(), 3),
        }
        self.rollbacks.records.append(record)
        lr_now = set_peak_lr(self.scheduler, self.lr)  # again: the new window's factor, from the next update
        if self.is_main:
            # The record first, made durable: a run killed from here on resumes with this rollback applied.
            with open(self.output_dir / ROLLBACKS_FILE, "a", encoding="utf-8") as records:
                records.write(json.dumps(record) + "\n")
                records.flush()
                os.fsync(records.fileno())
            moved = self.checkpointer.abandon_after(resumed.checkpoint)
            rewind_trackers(self.trackers, back_to)
        self.accelerator.wait_for_everyone()
        self.step, self.tokens_seen = back_to, resumed.tokens_seen
        pin = self.device.type == "cuda"
        self.train_loader, self.sample_order = build_train_loader(
            self.data, self.recipe.data, self.plan, self.launch.data_rank, self.recipe.train.seed, self.step, pin,
            self.masking, skipped=self.rollbacks.skipped,
        )
        self.data_stop_step, _ = data_horizon(self.sample_order, self.num_steps, self.recipe.data.on_exhausted)
        self.rolled_back = True
        lr_text = (f"; lr x{cfg.lr_factor:g} for the next {cfg.lr_factor_steps} updates (now {lr_now:.4g})"
                   if cfg.lr_factor != 1 and cfg.lr_factor_steps else "")
        aside = f"; set aside: {', '.join(p.name for p in moved)}" if self.is_main and moved else ""
        self.log(f"stability: rollback {self.rollbacks.attempts(back_to)}/{cfg.max_attempts} to {resumed.checkpoint} "
                 f"(step {back_to}) after steps {first}-{stop.step} were skipped in a row ({stop.verdict.rule}: "
                 f"{stop.verdict.reason}); the global batches of steps {skipped_first_step}-{stop.step} "
                 f"(batches {batches[0]}-{batches[1]}) are skipped, recorded in {ROLLBACKS_FILE}{lr_text}{aside}")
        return iter(self.train_loader)

    # ---- around the loop ----------------------------------------------------------------------------
    def log_train(self, result: OptimizerStep) -> dict[str, float]:
        z_loss = None
        if result.z_loss_sum is not None:
            # Expensive device-to-host synchronization: only on logging steps.
            loss_sum, z_sum = self.accelerator.reduce(torch.stack([result.loss_sum, result.z_loss_sum]),
                                                      reduction="mean").tolist()
            z_loss = z_sum / self.plan.grad_accum_steps
            loss = (loss_sum - z_sum) / self.plan.grad_accum_steps
        elif result.loss is not None:
            loss = result.loss  # the stability rules read it this step
        else:
            # Expensive device-to-host synchronization: only on logging steps.
            loss = self.accelerator.reduce(result.loss_sum, reduction="mean").item() / self.plan.grad_accum_steps
        metrics = {
            "train/loss": loss,
            "train/z_loss": z_loss,
            "train/ppl": math.exp(min(loss, 50.0)),
            "train/lr": result.lr,
            "train/grad_norm": float(result.grad_norm) if result.grad_norm is not None else None,
            "train/tokens_seen": self.tokens_seen,
            **(self.router.metrics(self.accelerator) if self.router else {}),  # collective
            **self.throughput.metrics(self.step),
            **memory_metrics(self.device),
            "memory/estimated_gib": self.memory_estimate_gib,
            "memory/estimated_tensors_gib": self.memory_estimate_tensors_gib,  # no allowance: max_memory_allocated's basis
            **self.plan.as_metrics(),
            **self.engine.metrics(),  # fp16: train/loss_scale, train/skipped_steps
            **self.sample_order.metrics(self.step),  # a mixture: data/tokens/<name>, data/epochs/<name>
            **self.diagnostics.step_time_metrics(),  # collective: perf/step_time_max_s, _min_s, _slowest_rank
            **(self.policy.metrics(result.verdict) if self.gate is not None else {}),
            **(self.rollbacks.metrics() if self.gate is not None else {}),  # stability/rollbacks
        }
        return self.step_log.write(self.step, metrics)

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
        logged = None
        if self.step_log.due(self.step) or skipped or self.rolled_back:
            logged = self.log_train(result)
            self.rolled_back = False
        else:
            self.console.advance(self.step)
        if skipped:
            self.log_skip(result.verdict)
        if diverged is not None:
            raise diverged
        return logged

    def state(self) -> TrainerState:
        """What a checkpoint records besides the accelerator's state."""
        return TrainerState(step=self.step, tokens_seen=self.tokens_seen, num_steps=self.num_steps,
                            plan=self.plan.to_dict(), recipe=self.recipe.to_dict(), layout=self.launch.to_dict(),
                            data=data_identity(self.data), stability=self.policy.state_dict(),
                            rollbacks=list(self.rollbacks.records))

    def save_checkpoint(self) -> None:
        """A checkpoint of the step just done, unless the training state is not finite (TrainingDiverged)."""
        self.checkpointer.save(self.state(), optimizer=self.optimizer)

    def stop_preempted(self) -> None:
        """A stop signal reached every rank: checkpoint the step just done and end; the same command resumes."""
        self.save_checkpoint()
        self.checkpointer.wait()  # checkpoint.async: written before the run says it has it
        self.preempted = True
        self.console.close()
        what = "interrupted" if self.interrupted else "preempted"  # pretrain-slurm status counts "preempted: ..."
        self.log(f"{what}: stopped after step {self.step}/{self.num_steps} with a checkpoint; "
                 "the same command resumes from it")
        self.end()

    def stop_exhausted(self, first_step: int) -> None:
        """data.on_exhausted=stop: a source has been read once. Checkpoint (unless this step's is there), evaluate
        and end like a finished run; the same command would stop here again."""
        if self.step > first_step and not self.checkpointer.should_save(self.step):
            self.save_checkpoint()
        self.evaluator.evaluate_rest(self.model, self.step)
        _, source = self.sample_order.steps_available()
        what = f"source {source!r}" if source else "the training split"
        self.log(f"data: stopped after step {self.step}/{self.num_steps}: {what} has been read once and "
                 "data.on_exhausted=stop; the checkpoint holds the run. Add data or set data.on_exhausted=repeat "
                 "to train further")
        self.finish()

    def finish(self) -> None:
        self.console.close()
        if self.recipe.checkpoint.save_final_model:
            self.export_final_model()
        self.end()

    def end(self) -> None:
        self.checkpointer.wait()  # checkpoint.async: the write in flight completes before the process group goes
        self.accelerator.end_training()
        if self.lock is not None:
            self.lock.release()

    def check_export_tokenizer(self, config) -> list[str]:
        """The final model's tokenizer check (pretrain.model.export), now rather than after training: rank 0
        encodes a validation sample both ways; a tokenizer that will not load back with the training ids is
        one ConfigError on every rank. Returns the sample (rank 0's; [] elsewhere) for the export to check again."""
        if not self.recipe.checkpoint.save_final_model:
            return []
        texts, problem = [], None
        if self.is_main:
            texts = sample_val_texts(self.recipe.data)
            try:
                check_tokenizer_round_trip(config, self.tokenizer, texts)
            except ConfigError as exc:
                problem = str(exc)
        [problem] = broadcast_object_list([problem])
        if problem is not None:
            raise ConfigError(f"{problem} (checkpoint.save_final_model=false trains without the final export)")
        return texts

    def export_final_model(self) -> None:
        acc = self.accelerator
        state_dict = acc.get_state_dict(self.model)  # gathers ZeRO-3 / FSDP shards: every rank takes part
        if acc.is_main_process:
            final = self.output_dir / "final_model"
            save_pretrained_model(acc.unwrap_model(self.model), state_dict, self.tokenizer, final, self.val_texts)
            self.log(f"export: transformers model and tokenizer in {final}")
        acc.wait_for_everyone()
