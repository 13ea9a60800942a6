"""Validation: the loss over the evaluation set, at its own cadence.

The evaluation set is the same on any world size (``pretrain/loader.py``): every rank sums token losses
over its share and one reduction gives the exact mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Evaluator:
    """Evaluates at step 0 (``train.eval_at_start``), every ``train.eval_every_steps`` optimizer steps and
    after the last one; logs ``val/*`` through the accelerator's trackers and one console line."""

    accelerator: Any
    val_loader: Any  # an iterable of batches, the same on every pass
    every_steps: int
    num_steps: int
    at_start: bool
    console: Any

    def due(self, step: int) -> bool:
        if step == 0:
            return self.at_start
        return step == self.num_steps or (self.every_steps > 0 and step % self.every_steps == 0)

    @torch.no_grad()
    def evaluate(self, model, step: int) -> dict[str, float]:
        device = self.accelerator.device
        model.eval()
        totals = torch.zeros(2, device=device, dtype=torch.float64)
        for batch in self.val_loader:
            batch = batch.to(device)
            out = model(input_ids=batch.input_ids, labels=batch.targets, shift_labels=batch.targets,
                        num_items_in_batch=1.0, **batch.attention_kwargs())
            totals[0] += out.loss.double()
            totals[1] += batch.targets.numel()
        model.train()
        # Expensive device-to-host synchronization.
        loss_sum, count = self.accelerator.reduce(totals, reduction="sum").tolist()
        val_loss = loss_sum / count
        metrics = {"val/loss": val_loss, "val/ppl": math.exp(min(val_loss, 50.0)), "val/tokens": int(count)}
        self.accelerator.log(metrics, step=step)
        self.console.print(f"eval step {step}: val_loss {val_loss:.4f} | val_ppl {metrics['val/ppl']:.2f}")
        return metrics
