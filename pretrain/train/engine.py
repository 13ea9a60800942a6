"""The engine behind the loop: DDP, FSDP2 and DeepSpeed behind one interface.

The loop asks the engine for the backward, the gradient clipping (and the global gradient norm), the update
(or its skip) and the engine's own state (the fp16 loss scale and the updates it skipped on overflow); it
never asks which engine it runs. Underneath are accelerate's own mechanisms: ``accelerator.backward`` (the
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
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pretrain.train.stability import DeepSpeedGate, StepGate, Verdict


class Engine:
    """DDP, FSDP2 or one process: the update is the torch optimizer's, through accelerate."""

    def __init__(self, accelerator, model, optimizer, scheduler, gate: StepGate | None, fp16: bool):
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.gate = gate
        self.fp16 = fp16
        self.skipped_steps = 0  # fp16 overflow: the optimizer step (and the schedule) were skipped

    @classmethod
    def build(cls, accelerator, model, optimizer, scheduler, gate: StepGate | None, *, fp16: bool,
              deepspeed_config: dict[str, Any] | None) -> Engine:
        """The engine of a prepared model: DeepSpeed when the run has a DeepSpeed config, else this class."""
        if deepspeed_config is not None:
            return DeepSpeed(accelerator, model, optimizer, scheduler, gate, fp16, deepspeed_config)
        return cls(accelerator, model, optimizer, scheduler, gate, fp16)

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
                 config: dict[str, Any]):
        super().__init__(accelerator, model, optimizer, scheduler, gate, fp16)
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
