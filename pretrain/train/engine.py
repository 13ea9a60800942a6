"""The engine behind the loop: the whole optimizer step, on DDP, FSDP2 and DeepSpeed behind one interface.

The loop asks the engine for one optimizer step (``train_step``, OLMo-core's ``TrainModule.train_batch``): GAS
micro-steps of forward and backward (the context-parallel split of each, the MoE router's objective), the stability
gate's all-reduced loss before the last backward, the gradient clipping (and the global gradient norm), the update
(or its skip); and for the engine's own state (the fp16 loss scale and the updates it skipped on overflow). It never
asks which engine it runs. Underneath are accelerate's own mechanisms: ``accelerator.backward`` (the
GradScaler's scaling, DeepSpeed's ``engine.backward``), ``accelerator.clip_grad_norm_`` (FSDP2's sharded
norm, DeepSpeed's clipping inside its step) and the optimizer accelerate prepared (which skips the step on
micro-steps that do not synchronise, and on a GradScaler overflow).

``Engine`` serves DDP, FSDP2 and one process; ``DeepSpeed`` differs where DeepSpeed owns the update: the
stability rules judge inside its step (``stability.DeepSpeedGate``), its fp16 optimizer owns the dynamic
loss scale, and a skipped update needs nothing undone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pretrain.distributed import context_parallel
from pretrain.distributed.layout import Launch
from pretrain.model.loss import LossTerms
from pretrain.train.router import RouterStats
from pretrain.train.stability import DeepSpeedGate, StepGate, Verdict


def loss_normaliser(global_target_tokens: int, launch: Launch, grad_accum_steps: int) -> float:
    """What each micro-step's summed token loss is divided by: N_global / (ranks x GAS), the ranks being those the
    gradients are averaged over (``context_parallel.gradient_ranks``: dp, x cp under context parallelism)."""
    return global_target_tokens / (context_parallel.gradient_ranks(launch) * grad_accum_steps)


@dataclass(frozen=True)
class Objective:
    """What a micro-step's forward and backward compute, besides the model: the loss normaliser (each micro-step's
    summed token loss / it), the z-loss terms, the MoE router's load-balancing loss, the context-parallel split, and
    the hook the last micro-step calls before gradients are synchronised (the diagnostics')."""

    grad_accum_steps: int
    normaliser: float
    grad_clip: float | None
    cp_size: int = 1
    loss_terms: LossTerms | None = None
    router: RouterStats | None = None
    before_sync: Callable[[], None] = lambda: None


@dataclass
class OptimizerStep:
    """What an optimizer step leaves for logging; device tensors, read only on logging steps."""

    loss_sum: torch.Tensor  # this process's micro-step losses, summed (with the z-loss, if any)
    grad_norm: torch.Tensor | float | None
    lr: float  # the lr this step used
    verdict: Verdict | None = None  # the stability rules' (None: stability checks off)
    loss: float | None = None  # the global loss when the rules read it (else reduced on logging steps)
    z_loss_sum: torch.Tensor | None = None  # this process's z-loss part of loss_sum (stability.z_loss)


class Engine:
    """DDP, FSDP2 or one process: the update is the torch optimizer's, through accelerate."""

    def __init__(self, accelerator, model, optimizer, scheduler, gate: StepGate | None, fp16: bool,
                 objective: Objective):
        self.accelerator = accelerator
        self.objective = objective
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.gate = gate
        self.fp16 = fp16
        self.skipped_steps = 0  # fp16 overflow: the optimizer step (and the schedule) were skipped

    @classmethod
    def build(cls, accelerator, model, optimizer, scheduler, gate: StepGate | None, objective: Objective, *,
              fp16: bool, deepspeed_config: dict[str, Any] | None) -> Engine:
        """The engine of a prepared model: DeepSpeed when the run has a DeepSpeed config, else this class."""
        if deepspeed_config is not None:
            return DeepSpeed(accelerator, model, optimizer, scheduler, gate, fp16, objective, deepspeed_config)
        return cls(accelerator, model, optimizer, scheduler, gate, fp16, objective)

    # ---- the optimizer step ---------------------------------------------------------------------------------
    def train_step(self, batches: Iterator, data_wait: Callable[[], AbstractContextManager],
                   loss_factor: float | None = None) -> OptimizerStep:
        """One optimizer step: GAS micro-steps from ``batches`` (each fetched inside ``data_wait()``); the last one
        synchronises gradients and updates (or, by the stability rules, skips the update). ``loss_factor``: the
        test hook's (stability.LOSS_FACTORS_ENV) factor on this step's loss; None in any real run."""
        device = self.accelerator.device
        loss_sum = torch.zeros((), device=device)
        lr = self.optimizer.param_groups[0]["lr"]  # the lr this step uses
        for _micro_step in range(self.objective.grad_accum_steps):
            with data_wait():
                batch = next(batches).to(device)
            loss, grad_norm, verdict = self.micro_step(batch, loss_sum, loss_factor)
            loss_sum += loss
        assert self.accelerator.sync_gradients, "the last micro-step of an optimizer step must synchronise gradients"
        terms = self.objective.loss_terms
        z_loss_sum = terms.take() if terms is not None else None
        loss = self.gate.values[0] if verdict is not None else None
        return OptimizerStep(loss_sum, grad_norm, lr, verdict, loss, z_loss_sum)

    def micro_step(self, batch, loss_before: torch.Tensor, loss_factor: float | None = None
                   ) -> tuple[torch.Tensor, Any, Verdict | None]:
        """Forward and backward of one micro-batch; on the micro-step that synchronises gradients also clip,
        judge (stability), update and step the schedule. Returns the detached loss, and the gradient norm and
        the verdict (None on the other micro-steps). ``loss_before``: this step's earlier micro-step losses."""
        acc, model, objective = self.accelerator, self.model, self.objective
        router = objective.router
        grad_norm = verdict = None
        inputs = context_parallel.forward_inputs(batch.input_ids, batch.targets, batch.attention_kwargs(),
                                                 objective.cp_size)
        # Context parallelism: forward and backward on this rank's part of every sequence, ring attention between
        # the CP ranks (nothing without CP).
        with acc.accumulate(model), context_parallel.split_sequences(acc, inputs, objective.cp_size):
            # Only the loss is kept: the output's logits are freed before backward, not at the next forward.
            output = model(**inputs, num_items_in_batch=objective.normaliser,
                           **(router.forward_kwargs if router else {}))
            # The objective (backward's) includes an MoE's weighted load-balancing loss; `loss`, which is
            # logged and gated on, is the cross-entropy (+ z-loss) as for a dense model.
            loss = total = output.loss
            if router is not None:
                loss = total - router.record(output)
            del output
            if acc.sync_gradients:
                objective.before_sync()
            if loss_factor is not None:
                loss, total = loss * loss_factor, total * loss_factor
            if acc.sync_gradients and self.gate is not None:
                # The step's global loss (cross-entropy), reduced before the last backward: DeepSpeed updates
                # inside it. Every rank gets the same value, so every rank takes the same decision.
                local = loss_before + loss.detach()
                if objective.loss_terms is not None and objective.loss_terms.z_loss is not None:
                    local = local - objective.loss_terms.z_loss
                self.gate.begin(acc.reduce(local, reduction="mean"), objective.grad_accum_steps)
            self.backward(total)
            if acc.sync_gradients:
                grad_norm = self.clip_grad_norm(objective.grad_clip)
                verdict = self.judge(grad_norm)
            self.update(verdict)  # or its skip, by the verdict
        return loss.detach(), grad_norm, verdict

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor | float:
        """Clip the synchronised gradients to ``max_norm`` (None: no clipping); the global norm before clipping,
        the same value on every rank."""
        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm or float("inf"))
        if isinstance(grad_norm, DTensor):
            # FSDP2: the norm over sharded gradients is a DTensor (each rank's partial sum, reduced on demand);
            # the gate and the logs need the plain global value, the same on every rank.
            grad_norm = grad_norm.full_tensor()
        return grad_norm

    def judge(self, grad_norm) -> Verdict | None:
        """The stability rules' verdict on this step (None: stability checks off)."""
        return self.gate.judge(grad_norm) if self.gate is not None else None

    def update(self, verdict: Verdict | None) -> None:
        """The optimizer step and the schedule's, or (a skipping verdict) neither; then the gradients are
        dropped. Called on every micro-step: accelerate's optimizer steps only on the one that synchronises."""
        if verdict is not None and verdict.skip:
            self.skip_update()
        else:
            self.optimizer.step()  # accelerate skips it on micro-steps that do not synchronise
            if self.accelerator.sync_gradients:
                if self.accelerator.optimizer_step_was_skipped:
                    self.skipped_steps += 1
                else:
                    self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_update(self) -> None:
        """No update, no schedule step; the gradients are dropped by zero_grad. fp16: clipping unscaled the
        gradients, and the scaler needs its update() before it unscales again."""
        if self.accelerator.scaler is not None:
            self.accelerator.scaler.update()

    def loss_scale(self) -> float | None:
        scaler = self.accelerator.scaler
        return scaler.get_scale() if scaler is not None else None

    def metrics(self) -> dict[str, float]:
        """fp16 only: the current loss scale and the optimizer steps skipped on overflow so far."""
        if not self.fp16:
            return {}
        out = {"train/skipped_steps": self.skipped_steps}
        scale = self.loss_scale()
        if scale is not None:
            out["train/loss_scale"] = float(scale)
        return out

    def write_config(self, output_dir: Path) -> None:
        """The engine's own configuration file in the run directory, if it has one."""


class DeepSpeed(Engine):
    """DeepSpeed ZeRO: accelerate's backward and step call the DeepSpeed engine's, which clips, steps, skips
    on overflow and owns the fp16 loss scale."""

    def __init__(self, accelerator, model, optimizer, scheduler, gate: StepGate | None, fp16: bool,
                 objective: Objective, config: dict[str, Any]):
        super().__init__(accelerator, model, optimizer, scheduler, gate, fp16, objective)
        self.config = config
        if gate is not None:
            DeepSpeedGate(gate, model)  # the update happens inside DeepSpeed's step

    def judge(self, grad_norm) -> Verdict | None:
        if self.gate is None:
            return None
        # Judged inside DeepSpeed's step (DeepSpeedGate); no verdict: DeepSpeed's own non-finite check skipped
        # the update before the torch optimizer's step was reached.
        return self.gate.verdict or self.gate.judge(float("inf"))

    def skip_update(self) -> None:
        """Nothing to undo: the gate held the update back inside DeepSpeed's step, which dropped the gradients."""

    def loss_scale(self) -> float | None:
        optimizer = self.model.optimizer  # DeepSpeedEngine: its fp16 optimizer owns the dynamic scaler
        return getattr(optimizer, "cur_scale", None) or getattr(optimizer, "loss_scale", None)

    def metrics(self) -> dict[str, float]:
        if not self.fp16:
            return {}
        out = {"train/skipped_steps": int(getattr(self.model, "skipped_steps", self.skipped_steps))}
        scale = self.loss_scale()
        if scale is not None:
            out["train/loss_scale"] = float(scale)
        return out

    def write_config(self, output_dir: Path) -> None:
        path = output_dir / "deepspeed_config.json"
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.config, indent=2, sort_keys=True, default=str))
        os.replace(tmp, path)
