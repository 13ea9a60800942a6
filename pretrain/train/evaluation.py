"""Validation: the loss over the evaluation set, at its own cadence.

The evaluation set is the same on any world size (``pretrain/data/loader.py``): every rank sums token losses
over its share and one reduction gives the exact mean. A mixture is evaluated per source (each on its own
validation split); its ``val/loss`` is the mean of the sources' losses weighted by the mixture's weights,
the loss expected on the mixture whatever the sizes of the validation splits. Under context parallelism a batch is
evaluated as it is trained: split along the sequence over the CP ranks, each summing the losses of its part, and
counting its part's targets, so that the one reduction still gives the exact mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pretrain.distributed import context_parallel


@dataclass
class Evaluator:
    """Evaluates at step 0 (``eval.at_start``), every ``eval.every_steps`` optimizer steps and
    after the last one; logs ``val/*`` (a mixture also ``val/loss/<name>``, ``val/tokens/<name>``) through
    the accelerator's trackers and one console line. The downstream tasks, if any, keep their own cadence."""

    accelerator: Any
    val_sets: dict[str, Any]  # name ("" for a single source) -> an iterable of batches, the same on every pass
    every_steps: int
    num_steps: int
    at_start: bool
    console: Any
    weights: dict[str, float] | None = None  # a mixture's normalised weights, by name
    cp_size: int = 1  # context parallelism: each rank evaluates its part of every sequence
    downstream: Any = None  # the recipe's eval.tasks (pretrain/train/downstream.py), each at its own cadence

    def val_due(self, step: int) -> bool:
        if step == 0:
            return self.at_start
        return step == self.num_steps or (self.every_steps > 0 and step % self.every_steps == 0)

    def due(self, step: int) -> bool:
        return self.val_due(step) or (self.downstream is not None and self.downstream.due(step))

    def evaluate(self, model, step: int, everything: bool = False) -> dict[str, float]:
        """What is due at ``step`` (``everything``: the validation loss and every task, as at a run's end)."""
        metrics = self.validate(model, step) if everything or self.val_due(step) else {}
        if self.downstream is not None:
            metrics.update(self.downstream.evaluate(model, step, every_task=everything))
        return metrics

    def evaluate_rest(self, model, step: int) -> dict[str, float]:
        """At an early end (data exhausted): what the loop did not evaluate at ``step``, so that the run's last step
        has the validation loss and every task, as a finished run's has."""
        metrics = {} if self.val_due(step) else self.validate(model, step)
        if self.downstream is not None:
            due = set(self.downstream.due_tasks(step))
            metrics.update(self.downstream.evaluate(
                model, step, tasks=[i for i in range(len(self.downstream.tasks)) if i not in due]))
        return metrics

    @torch.no_grad()
    def validate(self, model, step: int) -> dict[str, float]:
        device = self.accelerator.device
        model.eval()
        totals = torch.zeros(len(self.val_sets), 2, device=device, dtype=torch.float64)
        for i, batches in enumerate(self.val_sets.values()):
            for batch in batches:
                batch = batch.to(device)
                inputs = context_parallel.forward_inputs(batch.input_ids, batch.targets, batch.attention_kwargs(),
                                                         self.cp_size)
                with context_parallel.split_sequences(self.accelerator, inputs, self.cp_size):
                    out = model(**inputs, num_items_in_batch=1.0)
                    totals[i, 0] += out.loss.double()
                    totals[i, 1] += inputs["shift_labels"].numel()  # this rank's targets (under CP: its part)
        model.train()
        # Expensive device-to-host synchronization (one for all sources).
        sums = self.accelerator.reduce(totals, reduction="sum").tolist()
        losses = {name: loss_sum / count for name, (loss_sum, count) in zip(self.val_sets, sums, strict=True)}
        if self.weights is None:
            val_loss = losses[""]
        else:
            val_loss = math.fsum(self.weights[name] * loss for name, loss in losses.items())
        metrics = {"val/loss": val_loss, "val/ppl": math.exp(min(val_loss, 50.0)),
                   "val/tokens": int(sum(count for _, count in sums))}
        line = f"eval step {step}: val_loss {val_loss:.4f} | val_ppl {metrics['val/ppl']:.2f}"
        if self.weights is not None:
            for name, (_, count) in zip(self.val_sets, sums, strict=True):
                metrics[f"val/loss/{name}"], metrics[f"val/tokens/{name}"] = losses[name], int(count)
            line += " | " + " ".join(f"{name} {loss:.4f}" for name, loss in losses.items())
        self.accelerator.log(metrics, step=step)
        self.console.print(line)
        return metrics
