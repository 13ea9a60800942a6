"""The training loop.

Names: a *micro-step* is one forward/backward on MBS sequences of one process; an *optimizer step*
(``step``) is GAS micro-steps on every process followed by one parameter update. The LR schedule,
logging, evaluation and checkpoints all count optimizer steps.

The loss of an optimizer step is the sum of token losses over the whole global batch divided by its
number of target tokens. Each micro-step's loss is normalised by N_global / (world x GAS): accelerate
divides by GAS and data parallelism averages over world, which leaves exactly sum / N_global.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed

from pretrain.batching import BatchPlan
from pretrain.checkpoint import Checkpointer, TrainerState, resume_checkpoint
from pretrain.config import Recipe
from pretrain.data import prepare_data
from pretrain.errors import ConfigError
from pretrain.launch import Launch
from pretrain.loader import build_train_loader, build_val_loader
from pretrain.memory import estimate, gpu_for_device
from pretrain.metrics import CONVENTION, ThroughputMonitor, flops_per_token, memory_metrics, resolve_peak
from pretrain.model import build_model, count_parameters, resolve_vocab_size
from pretrain.optim import build_optimizer, build_scheduler, deepspeed_optimizer
from pretrain.preemption import StopSignals
from pretrain.preflight import check_run
from pretrain.runtime import build_accelerator
from pretrain.tracking import Console, build_trackers, flatten


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


class Trainer:
    def __init__(self, recipe: Recipe, launch: Launch | None = None):
        self.recipe = recipe
        self.output_dir = Path(recipe.output_dir)
        self.launch = launch or Launch.from_env()
        self.is_main = self.launch.is_main

        # Everything that can be checked without compute is checked before any process group exists.
        run_plan = check_run(recipe, self.launch)
        self.plan: BatchPlan = run_plan.batch
        self.num_steps = run_plan.num_steps
        self.lr = run_plan.lr
        check_output_dir(self.output_dir)

        self.console = Console(recipe.logging.progress, enabled=self.is_main)
        resume_from = resume_checkpoint(self.output_dir, recipe.checkpoint)
        resume_step = TrainerState.read(resume_from).step if resume_from is not None else None

        trackers = build_trackers(recipe, self.output_dir, resume_step, self.is_main)
        self.runtime = build_accelerator(recipe, self.plan, self.launch, self.output_dir, trackers, self.lr)
        self.accelerator = self.runtime.accelerator
        self.device = self.accelerator.device
        self.checkpointer = Checkpointer(self.accelerator, self.output_dir, recipe.checkpoint, self.num_steps,
                                         log=self.log)
        set_seed(recipe.train.seed)

        with self.accelerator.main_process_first():
            self.data = prepare_data(recipe.data, log=self.log)
        self.tokenizer = self.data.tokenizer

        vocab = resolve_vocab_size(recipe.model, len(self.tokenizer))
        model = build_model(recipe.model, vocab, recipe.data.seq_len, seed=recipe.train.seed)
        self.num_params = count_parameters(model)
        self.flops, self.peak = self._throughput_reference(model.config)
        self.memory_estimate_gib = self._memory_estimate()
        if self.runtime.deepspeed_optimizer:
            optimizer, scheduler = deepspeed_optimizer(model, recipe, self.lr, self.num_steps)
        else:
            optimizer = build_optimizer(model, recipe.optim, self.lr)
            scheduler = build_scheduler(optimizer, recipe.lr_schedule, self.num_steps)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        if self.runtime.deepspeed_config is not None and self.is_main:
            write_json(self.output_dir / "deepspeed_config.json", self.runtime.deepspeed_config)

        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0  # fp16 overflow: the optimizer step (and the schedule) were skipped
        self.preempted = False
        if resume_from is not None:
            state = self.checkpointer.load(resume_from, recipe.to_dict())
            self.step, self.tokens_seen = state.step, state.tokens_seen

        pin = self.device.type == "cuda"
        self.train_loader, self.sample_order = build_train_loader(
            self.data.train, recipe.data, self.plan, self.accelerator.process_index, recipe.train.seed, self.step, pin
        )
        self.val_loader = build_val_loader(
            self.data.val, recipe.data, self.plan, self.accelerator.process_index, recipe.train.eval_batches, pin
        )
        # Targets per global batch: packed sequences have no padding, so every position is a target.
        self.global_target_tokens = self.plan.tokens_per_step
        self.loss_normaliser = self.global_target_tokens / (self.plan.world_size * self.plan.grad_accum_steps)
        flops, recomputes = self.flops, recipe.model.activation_checkpointing  # recomputation: perf/hfu too
        self.throughput = ThroughputMonitor(
            self.plan.tokens_per_step, self.plan.global_batch_size, self.plan.world_size,
            warmup_steps=recipe.runtime.throughput_warmup_steps, peak_tflops=self.peak.tflops,
            flops_per_token=flops.model_flops if flops else None,
            hardware_flops_per_token=flops.hardware_flops if flops and recomputes else None,
        )
        self._start_run_record()

    # ---- setup helpers ----------------------------------------------------------------------------
    def log(self, message: str) -> None:
        if self.is_main:
            if hasattr(self, "console"):
                self.console.print(message)
            else:
                print(message, flush=True)

    def _throughput_reference(self, hf_config):
        """FLOPs per token of this model and the device's peak, for tokens/s -> TFLOP/s -> MFU."""
        recipe = self.recipe
        try:
            flops = flops_per_token(hf_config, recipe.data.seq_len,
                                    activation_checkpointing=recipe.model.activation_checkpointing)
        except ConfigError as exc:
            self.log(f"warning: no FLOPs count, so no TFLOP/s or MFU: {exc}")
            flops = None
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        peak = resolve_peak(self.device.type, name, recipe.precision.dtype, recipe.runtime.peak_tflops)
        if peak.tflops is None:
            self.log(f"warning: perf/mfu is not logged: {peak.detail} (runtime.peak_tflops=<dense TFLOP/s>)")
        return flops, peak

    def _memory_estimate(self) -> float | None:
        """The estimator's per-device total for this very run, logged beside the measured peak."""
        gpu = None
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            gpu = gpu_for_device(props.name, props.total_memory)
        try:
            result = estimate(self.recipe, self.plan, self.launch, gpu=gpu, device=self.device.type)
        except ConfigError as exc:
            self.log(f"warning: no memory estimate for this layout: {exc}")
            return None
        return result.total_gib

    def run_config(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe.to_dict(),
            "plan": self.plan.to_dict(),
            "dist": {
                "world_size": self.accelerator.num_processes,
                "num_machines": self.launch.num_nodes,
                "engine": self.launch.engine,
                "distributed_type": str(self.accelerator.distributed_type).split(".")[-1],
                "device": str(self.device),
                "mixed_precision": self.accelerator.mixed_precision,
            },
            "model": {"num_params": self.num_params, "vocab_size": len(self.tokenizer)},
            "memory": {"estimated_gib": self.memory_estimate_gib},
            "data": self.data.stats,
            "train": {"num_steps": self.num_steps, "lr": self.lr},
            "perf": {
                "flops_per_token": self.flops.model_flops if self.flops else None,
                "hardware_flops_per_token": self.flops.hardware_flops if self.flops else None,
                "peak_tflops": self.peak.tflops,
                "peak_source": self.peak.source,
                "peak_detail": self.peak.detail,
                "mfu_convention": CONVENTION,
            },
        }

    def _start_run_record(self) -> None:
        config = self.run_config()
        if self.is_main:
            (self.output_dir / "recipe.resolved.yaml").write_text(self.recipe.to_yaml())
        self.accelerator.init_trackers(self.recipe.logging.project, config=flatten(config))
        p = self.plan
        self.log(
            f"pretrain: {self.recipe.name} | world size {config['dist']['world_size']} "
            f"({config['dist']['distributed_type']}, {config['dist']['device']}, {self.recipe.precision.dtype}) | "
            f"{self.num_params:,} params | GBS {p.global_batch_size} = MBS {p.micro_batch_size} x GAS "
            f"{p.grad_accum_steps} x world {p.world_size} | {p.tokens_per_step:,} tokens/step | "
            f"{self.num_steps} steps | lr {self.lr:.3g} | output {self.output_dir}"
        )
        if self.flops is not None:
            self.log(f"perf: {self.flops.model_flops / 1e9:.4g} GFLOP/token ({CONVENTION.split(';')[0]}); "
                     f"peak {self.peak.detail}")

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        recipe = self.recipe
        last_metrics: dict[str, float] = {}
        if self.step >= self.num_steps:
            self.log(f"run already complete at step {self.step}/{self.num_steps}")
            self.finish()
            return last_metrics
        with StopSignals() as stop:  # SIGTERM / SIGUSR1: stop after the step in flight
            if self.step == 0 and recipe.train.eval_at_start:
                self.evaluate()
            self.model.train()
            batches = iter(self.train_loader)
            self.throughput.start(self.step)
            self.console.start(self.num_steps, self.step)
            while self.step < self.num_steps:
                step_metrics = self.train_step(batches)
                self.step += 1
                self.tokens_seen += self.plan.tokens_per_step
                self.throughput.step_done(self.step)
                if self.should_log():
                    last_metrics = self.log_train(step_metrics)
                else:
                    self.console.advance(self.step)
                if self.should_eval():
                    with self.throughput.excluded():
                        self.evaluate()
                if self.checkpointer.should_save(self.step):
                    with self.throughput.excluded():
                        self.checkpointer.save(self.state())
                elif stop.agreed(self.accelerator):
                    self.checkpointer.save(self.state())
                    self.preempted = True
                    self.console.close()
                    self.log(f"preempted: stopped after step {self.step}/{self.num_steps} with a checkpoint; "
                             "the same command resumes from it")
                    self.accelerator.end_training()
                    return last_metrics
        self.finish()
        return last_metrics

    def train_step(self, batches) -> dict[str, torch.Tensor]:
        """One optimizer step: GAS micro-steps, clipping, update, schedule."""
        acc, model = self.accelerator, self.model
        loss_sum = torch.zeros((), device=self.device)
        grad_norm = None
        lr = self.optimizer.param_groups[0]["lr"]  # the lr this step uses
        for _micro_step in range(self.plan.grad_accum_steps):
            with self.throughput.data_wait():
                batch = next(batches).to(self.device)
            with acc.accumulate(model):
                out = model(
                    input_ids=batch.input_ids,
                    labels=batch.targets,
                    shift_labels=batch.targets,
                    num_items_in_batch=self.loss_normaliser,
                )
                acc.backward(out.loss)
                loss_sum += out.loss.detach()
                if acc.sync_gradients:
                    clip = self.recipe.optim.grad_clip or float("inf")
                    grad_norm = acc.clip_grad_norm_(model.parameters(), clip)
                self.optimizer.step()
                if acc.sync_gradients:
                    if acc.optimizer_step_was_skipped:
                        self.skipped_steps += 1
                    else:
                        self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
        assert acc.sync_gradients, "the last micro-step of an optimizer step must synchronise gradients"
        return {"loss_sum": loss_sum, "grad_norm": grad_norm, "lr": lr}

    def should_log(self) -> bool:
        every = self.recipe.train.log_every_steps
        return self.step == 1 or self.step % every == 0 or self.step == self.num_steps

    def should_eval(self) -> bool:
        every = self.recipe.train.eval_every_steps
        return self.step == self.num_steps or (every > 0 and self.step % every == 0)

    def log_train(self, step_metrics: dict) -> dict[str, float]:
        # Expensive device-to-host synchronization: only on logging steps.
        loss = self.accelerator.reduce(step_metrics["loss_sum"], reduction="mean").item() / self.plan.grad_accum_steps
        grad_norm = step_metrics["grad_norm"]
        metrics = {
            "train/loss": loss,
            "train/ppl": math.exp(min(loss, 50.0)),
            "train/lr": step_metrics["lr"],
            "train/grad_norm": float(grad_norm) if grad_norm is not None else None,
            "train/tokens_seen": self.tokens_seen,
            **self.throughput.metrics(self.step),
            **memory_metrics(self.device),
            **({"memory/estimated_gib": self.memory_estimate_gib} if self.memory_estimate_gib is not None else {}),
            **self.plan.as_metrics(),
            **self.loss_scale_metrics(),
        }
        metrics = {k: v for k, v in metrics.items() if v is not None}
        self.accelerator.log(metrics, step=self.step)
        self.console.step_summary(self.step, self.num_steps, metrics)
        return metrics

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

    @torch.no_grad()
    def evaluate(self) -> None:
        """Validation loss over the evaluation set (the same set on any world size)."""
        self.model.eval()
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)
        for batch in self.val_loader:
            batch = batch.to(self.device)
            out = self.model(input_ids=batch.input_ids, labels=batch.targets, shift_labels=batch.targets,
                             num_items_in_batch=1.0)
            totals[0] += out.loss.double()
            totals[1] += batch.targets.numel()
        self.model.train()
        # Expensive device-to-host synchronization.
        loss_sum, count = self.accelerator.reduce(totals, reduction="sum").tolist()
        val_loss = loss_sum / count
        metrics = {"val/loss": val_loss, "val/ppl": math.exp(min(val_loss, 50.0)), "val/tokens": int(count)}
        self.accelerator.log(metrics, step=self.step)
        self.console.print(f"eval step {self.step}: val_loss {val_loss:.4f} | val_ppl {metrics['val/ppl']:.2f}")

    def state(self) -> TrainerState:
        """What a checkpoint records besides the accelerator's state."""
        return TrainerState(step=self.step, tokens_seen=self.tokens_seen, num_steps=self.num_steps,
                            plan=self.plan.to_dict(), recipe=self.recipe.to_dict())

    def finish(self) -> None:
        self.console.close()
        if self.recipe.checkpoint.save_final_model:
            self.export_final_model()
        self.accelerator.end_training()

    def export_final_model(self) -> None:
        acc = self.accelerator
        state_dict = acc.get_state_dict(self.model)  # gathers ZeRO-3 / FSDP shards: every rank takes part
        if acc.is_main_process:
            final, tmp = self.output_dir / "final_model", self.output_dir / ".tmp-final_model"
            if tmp.exists():
                shutil.rmtree(tmp)
            model = acc.unwrap_model(self.model)
            model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            self.log(f"export: transformers model and tokenizer in {final}")
        acc.wait_for_everyone()

