"""The training loop.

Names: a *micro-step* is one forward/backward on MBS sequences of one process; an *optimizer step*
(``step``) is GAS micro-steps on every process followed by one parameter update. The LR schedule,
logging, evaluation and checkpoints all count optimizer steps.

The loss of an optimizer step is the sum of token losses over the whole global batch divided by its
number of target tokens. Each micro-step's loss is normalised by N_global / (world x GAS): accelerate
divides by GAS and data parallelism averages over world, which leaves exactly sum / N_global.

Each component owns its cadence and its state: the ``Checkpointer`` (pretrain/checkpoint.py) when to
save, the ``Evaluator`` (pretrain/evaluation.py) when to evaluate, the ``StepLog`` (pretrain/tracking.py)
which steps log, the ``ThroughputMonitor`` (pretrain/metrics.py) the measured interval, ``StopSignals``
(pretrain/preemption.py) the stop request. ``Trainer.train`` only puts them in order.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed

from pretrain.batching import BatchPlan
from pretrain.checkpoint import Checkpointer, ResumeChoice, TrainerState, agree_on_resume
from pretrain.config import Recipe
from pretrain.data import cache_root, ensure_data, open_data
from pretrain.errors import ConfigError
from pretrain.evaluation import Evaluator
from pretrain.hardware import gpu_for_device
from pretrain.launch import Launch
from pretrain.loader import DocumentMasking, build_train_loader, build_val_loaders, data_horizon
from pretrain.memory import estimate
from pretrain.metrics import ThroughputMonitor, memory_metrics, resolve_peak
from pretrain.model import build_model, count_parameters, resolve_vocab_size, save_pretrained_model
from pretrain.optim import build_optimizer, build_scheduler, deepspeed_optimizer
from pretrain.preemption import StopSignals
from pretrain.preflight import check_run
from pretrain.reshard import prepare_resume
from pretrain.run_record import start_run_record
from pretrain.runtime import build_accelerator, check_shared_output_dir, model_placement
from pretrain.shape import flops_per_token
from pretrain.tracking import Console, StepLog, build_trackers


def check_output_dir(output_dir: Path) -> None:
    """Fail before any compute if the run cannot write where it is told to."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"output_dir = {str(output_dir)!r} is not writable ({exc.strerror or exc}); "
            "choose another, e.g. output_dir=/tmp/my-run"
        ) from None


def write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)


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
    except ConfigError as exc:
        log(f"warning: no FLOPs count, so no TFLOP/s or MFU: {exc}")
        flops = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = resolve_peak(device.type, name, recipe.precision.dtype, recipe.runtime.peak_tflops,
                        cache_dir=cache_root(recipe.data))
    if peak.tflops is None:
        log(f"warning: perf/mfu is not logged: {peak.detail} (runtime.peak_tflops=<dense TFLOP/s>)")
    return flops, peak


def memory_estimate(recipe: Recipe, plan: BatchPlan, launch: Launch, device: torch.device, log) -> float | None:
    """The estimator's per-device total for this very run, logged beside the measured peak."""
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = gpu_for_device(props.name, props.total_memory)
    try:
        result = estimate(recipe, plan, launch, gpu=gpu, device=device.type)
    except ConfigError as exc:
        log(f"warning: no memory estimate for this layout: {exc}")
        return None
    return result.total_gib


@dataclass
class OptimizerStep:
    """What an optimizer step leaves for logging; device tensors, read only on logging steps."""

    loss_sum: torch.Tensor  # this process's micro-step losses, summed
    grad_norm: torch.Tensor | float | None
    lr: float  # the lr this step used


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
        # Rank 0 decides which checkpoint to resume from, now: its trackers (main-process only) need the step
        # to drop the metrics of redone steps. Every rank follows that choice once the process group exists.
        # Every rank reads the same files now (errors are kept, not raised) for one purpose: a checkpoint of
        # another layout is converted (or refused) before any process group exists, by rank 0, while the other
        # ranks wait for the conversion of the checkpoint they see; agree_on_resume checks below that it is
        # rank 0's.
        seen = ResumeChoice.decide(self.output_dir, recipe.checkpoint)
        choice = seen if self.is_main else None
        self.resume = prepare_resume(Path(seen.path), self.launch, log=self.log) if seen.path else None

        # The token store exists before the process group does: no rank ever waits for data in a collective.
        prepare_command = prepare_command or f"pretrain-prepare-data --recipe <the recipe of {recipe.name!r}>"
        ensure_data(recipe.data, self.launch, prepare_command, log=self.log)

        trackers = build_trackers(recipe, self.output_dir, choice.step if choice else None, self.is_main)
        self.runtime = build_accelerator(recipe, self.plan, self.launch, self.output_dir, trackers, self.lr,
                                         load_universal=self.resume is not None and self.resume.load_universal)
        self.accelerator = self.runtime.accelerator
        self.device = self.accelerator.device
        # Collectives: every rank raises the same ConfigError, or none does.
        check_shared_output_dir(self.accelerator, self.output_dir)
        resume_from = agree_on_resume(self.accelerator, choice, self.output_dir)
        if resume_from is None:
            self.resume = None
        elif self.resume is None or self.resume.checkpoint != resume_from:
            # This rank saw another checkpoint before the process group existed; it sees rank 0's too (agreed
            # above), which rank 0 has already prepared: follow rank 0.
            self.resume = prepare_resume(resume_from, self.launch, log=self.log)
        self.checkpointer = Checkpointer(self.accelerator, self.output_dir, recipe.checkpoint, self.num_steps,
                                         log=self.log)
        set_seed(recipe.train.seed)

        self.data = open_data(recipe.data, log=self.log, prepare_command=prepare_command)
        self.tokenizer = self.data.tokenizer

        vocab = resolve_vocab_size(recipe.model, len(self.tokenizer))
        # Built on the run's device (or partitioned, or sharded first): never a full fp32 copy per rank on CPU.
        placement = model_placement(self.accelerator)
        model = build_model(recipe.model, vocab, recipe.data.seq_len, seed=recipe.train.seed,
                            device=placement.device, shard=placement.shard)
        self.num_params = count_parameters(model)
        self.flops, self.peak = throughput_reference(recipe, model.config, self.device, self.log)
        self.memory_estimate_gib = memory_estimate(recipe, self.plan, self.launch, self.device, self.log)
        if self.runtime.deepspeed_optimizer:
            optimizer, scheduler = deepspeed_optimizer(model, recipe, self.lr, self.num_steps)
        else:
            optimizer = build_optimizer(model, recipe.optim, self.lr, self.device.type)
            scheduler = build_scheduler(optimizer, recipe.lr_schedule, self.num_steps)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        if self.runtime.deepspeed_config is not None and self.is_main:
            write_json(self.output_dir / "deepspeed_config.json", self.runtime.deepspeed_config)

        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0  # fp16 overflow: the optimizer step (and the schedule) were skipped
        self.preempted = False
        if self.resume is not None:
            state = self.checkpointer.load(self.resume.checkpoint, recipe.to_dict(), self.resume)
            self.step, self.tokens_seen = state.step, state.tokens_seen

        pin = self.device.type == "cuda"
        masking = document_masking(recipe, self.tokenizer)
        self.train_loader, self.sample_order = build_train_loader(
            self.data, recipe.data, self.plan, self.accelerator.process_index, recipe.train.seed, self.step, pin,
            masking,
        )
        val_sets = build_val_loaders(
            self.data, recipe.data, self.plan, self.accelerator.process_index, recipe.train.eval_batches, pin,
            masking,
        )
        # data.on_exhausted: the step at which `stop` ends the run (None: never), and the epochs read per source.
        self.data_stop_step, message = data_horizon(self.sample_order, self.num_steps, recipe.data.on_exhausted)
        self.log(message)
        # Targets per global batch: packed sequences have no padding, so every position is a target (with
        # document masking too: an eos keeps the next document's first token as its target).
        self.global_target_tokens = self.plan.tokens_per_step
        self.loss_normaliser = self.global_target_tokens / (self.plan.world_size * self.plan.grad_accum_steps)

        cadence = recipe.train
        self.evaluator = Evaluator(self.accelerator, val_sets, every_steps=cadence.eval_every_steps,
                                   num_steps=self.num_steps, at_start=cadence.eval_at_start, console=self.console,
                                   weights=getattr(self.data, "weights", None))
        self.step_log = StepLog(self.accelerator, self.console, every_steps=cadence.log_every_steps,
                                num_steps=self.num_steps)
        flops, recomputes = self.flops, recipe.model.activation_checkpointing  # recomputation: perf/hfu too
        self.throughput = ThroughputMonitor(
            self.plan.tokens_per_step, self.plan.global_batch_size, self.plan.world_size,
            warmup_steps=recipe.runtime.throughput_warmup_steps, peak_tflops=self.peak.tflops,
            flops_per_token=flops.model_flops if flops else None,
            hardware_flops_per_token=flops.hardware_flops if flops and recomputes else None,
        )
        start_run_record(self)

    def log(self, message: str) -> None:
        if self.is_main:
            self.console.print(message)

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Optimizer steps up to the horizon, or until a stop signal; returns the last logged train metrics."""
        last_metrics: dict[str, float] = {}
        if self.step >= self.num_steps:
            self.log(f"run already complete at step {self.step}/{self.num_steps}")
            self.finish()
            return last_metrics
        with StopSignals() as stop:  # SIGTERM / SIGUSR1: stop after the step in flight
            if self.step == 0 and self.evaluator.due(0):
                self.evaluator.evaluate(self.model, 0)
            self.model.train()
            batches = iter(self.train_loader)
            self.throughput.start(self.step)
            self.console.start(self.num_steps, self.step)
            first_step = self.step
            while self.step < self.num_steps:
                if self.data_stop_step is not None and self.step >= self.data_stop_step:
                    self.stop_exhausted(first_step)
                    return last_metrics
                result = self.train_step(batches)
                self.step += 1
                self.tokens_seen += self.plan.tokens_per_step
                self.throughput.step_done(self.step)
                if self.step_log.due(self.step):
                    last_metrics = self.log_train(result)
                else:
                    self.console.advance(self.step)
                if self.evaluator.due(self.step):
                    with self.throughput.excluded():
                        self.evaluator.evaluate(self.model, self.step)
                if self.checkpointer.should_save(self.step):
                    with self.throughput.excluded():
                        self.checkpointer.save(self.state())
                elif stop.agreed(self.accelerator):
                    self.stop_preempted()
                    return last_metrics
        self.finish()
        return last_metrics

    def train_step(self, batches) -> OptimizerStep:
        """One optimizer step: GAS micro-steps; the last one synchronises gradients and updates."""
        loss_sum = torch.zeros((), device=self.device)
        lr = self.optimizer.param_groups[0]["lr"]  # the lr this step uses
        for _micro_step in range(self.plan.grad_accum_steps):
            with self.throughput.data_wait():
                batch = next(batches).to(self.device)
            loss, grad_norm = self.micro_step(batch)
            loss_sum += loss
        assert self.accelerator.sync_gradients, "the last micro-step of an optimizer step must synchronise gradients"
        return OptimizerStep(loss_sum, grad_norm, lr)

    def micro_step(self, batch) -> tuple[torch.Tensor, Any]:
        """Forward and backward of one micro-batch; on the micro-step that synchronises gradients also clip,
        update and step the schedule. Returns the detached loss, and the gradient norm (None on the others)."""
        acc, model = self.accelerator, self.model
        grad_norm = None
        with acc.accumulate(model):
            # Only the loss is kept: the output's logits are freed before backward, not at the next forward.
            loss = model(
                input_ids=batch.input_ids,
                labels=batch.targets,
                shift_labels=batch.targets,
                num_items_in_batch=self.loss_normaliser,
                **batch.attention_kwargs(),
            ).loss
            acc.backward(loss)
            if acc.sync_gradients:
                grad_norm = acc.clip_grad_norm_(model.parameters(), self.recipe.optim.grad_clip or float("inf"))
            self.optimizer.step()  # accelerate skips it on micro-steps that do not synchronise
            if acc.sync_gradients:
                if acc.optimizer_step_was_skipped:
                    self.skipped_steps += 1
                else:
                    self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), grad_norm

    # ---- around the loop ----------------------------------------------------------------------------
    def log_train(self, result: OptimizerStep) -> dict[str, float]:
        # Expensive device-to-host synchronization: only on logging steps.
        loss = self.accelerator.reduce(result.loss_sum, reduction="mean").item() / self.plan.grad_accum_steps
        metrics = {
            "train/loss": loss,
            "train/ppl": math.exp(min(loss, 50.0)),
            "train/lr": result.lr,
            "train/grad_norm": float(result.grad_norm) if result.grad_norm is not None else None,
            "train/tokens_seen": self.tokens_seen,
            **self.throughput.metrics(self.step),
            **memory_metrics(self.device),
            "memory/estimated_gib": self.memory_estimate_gib,
            **self.plan.as_metrics(),
            **self.loss_scale_metrics(),
            **self.sample_order.metrics(self.step),  # a mixture: data/tokens/<name>, data/epochs/<name>
        }
        return self.step_log.write(self.step, metrics)

    def loss_scale_metrics(self) -> dict[str, float]:
        """fp16 only: the current loss scale and the optimizer steps skipped on overflow so far."""
        if self.recipe.precision.dtype != "fp16":
            return {}
        if self.runtime.deepspeed_config is not None:
            engine = self.model  # DeepSpeedEngine: its fp16 optimizer owns the dynamic scaler
            scale = getattr(engine.optimizer, "cur_scale", None) or getattr(engine.optimizer, "loss_scale", None)
            skipped = int(getattr(engine, "skipped_steps", self.skipped_steps))
        else:
            scaler = self.accelerator.scaler
            scale = scaler.get_scale() if scaler is not None else None
            skipped = self.skipped_steps
        out = {"train/skipped_steps": skipped}
        if scale is not None:
            out["train/loss_scale"] = float(scale)
        return out

    def state(self) -> TrainerState:
        """What a checkpoint records besides the accelerator's state."""
        return TrainerState(step=self.step, tokens_seen=self.tokens_seen, num_steps=self.num_steps,
                            plan=self.plan.to_dict(), recipe=self.recipe.to_dict(), layout=self.launch.to_dict())

    def stop_preempted(self) -> None:
        """A stop signal reached every rank: checkpoint the step just done and end; the same command resumes."""
        self.checkpointer.save(self.state())
        self.preempted = True
        self.console.close()
        self.log(f"preempted: stopped after step {self.step}/{self.num_steps} with a checkpoint; "
                 "the same command resumes from it")
        self.accelerator.end_training()

    def stop_exhausted(self, first_step: int) -> None:
        """data.on_exhausted=stop: a source has been read once. Checkpoint (unless this step's is there), evaluate
        and end like a finished run; the same command would stop here again."""
        if self.step > first_step and not self.checkpointer.should_save(self.step):
            self.checkpointer.save(self.state())
        if not self.evaluator.due(self.step):
            self.evaluator.evaluate(self.model, self.step)
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
        self.accelerator.end_training()

    def export_final_model(self) -> None:
        acc = self.accelerator
        state_dict = acc.get_state_dict(self.model)  # gathers ZeRO-3 / FSDP shards: every rank takes part
        if acc.is_main_process:
            final = self.output_dir / "final_model"
            save_pretrained_model(acc.unwrap_model(self.model), state_dict, self.tokenizer, final)
            self.log(f"export: transformers model and tokenizer in {final}")
        acc.wait_for_everyone()
