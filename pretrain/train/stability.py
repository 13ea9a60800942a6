"""Updates that would damage a run: skipped, counted, and a run that keeps producing them stopped.

The ``stability`` recipe section. Every optimizer step's loss (the global mean, reduced before the step's
last backward) and gradient norm (the global norm, as the engine computes it) are judged before the update:

- ``skip_nonfinite``: a NaN or infinite loss or gradient norm skips the update;
- ``spike_sigma``: so does a loss or gradient norm more than k standard deviations above the mean of the
  last ``window_steps`` applied updates (OLMo-core's ``SkipStepOptimizer`` rule; as there, the rule waits
  until the window is half full; unlike there, skipped steps never enter it, so a spike does not widen the
  band the next one is judged by);
- ``max_consecutive_skips``: that many skipped updates in a row stop the run (``TrainingDiverged``, exit 3),
  like llm-foundry's kill-loss-spike callback, leaving the newest checkpoint (always healthy: see
  ``pretrain/checkpoint/checkpointer.py``) to resume from with other settings;
- ``rollback`` (``pretrain/train/rollback.py``): instead of that stop, what a person does by hand (bigscience's and metaseq's
  restarts, PaLM's "restart ~100 steps before the spike and skip 200-500 batches"): reload the newest verified
  checkpoint saved before the streak's first skip, skip the global batches from its step to the stop, and go
  on, optionally at a lower lr for a while; at most ``max_attempts`` times to one checkpoint.

A skipped update leaves the weights, the optimizer state and the LR schedule as they were; the step's data
is consumed (the data cursor is the optimizer step). The decision is a pure function of values every rank
holds identically (an all-reduced loss, a global gradient norm, the same window), so every rank takes it.
It costs one device-to-host synchronisation per optimizer step (the two numbers), and one tiny all-reduce.

Under DeepSpeed the update happens inside ``accelerator.backward`` (``engine.step()``): ``DeepSpeedGate``
puts the decision between DeepSpeed's gradient norm and its call of the wrapped torch optimizer's ``step``,
and marks a held-back update as DeepSpeed marks its own skips (so the LR schedule holds still); DeepSpeed's
own non-finite check (fp16 always, bf16
``check_grad_overflow``, fp32 ZeRO) may skip first, which is counted the same way. Under fp16 a non-finite
gradient norm is the loss scaler's business (it skips the step and lowers the scale; ``train/skipped_steps``).
"""

from __future__ import annotations

import functools
import math
import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from pretrain.errors import TrainingDiverged
from pretrain.recipe.config import StabilityConfig

# A test hook: "STEP:FACTOR,..." (e.g. "7:nan" or "8:1000"): the loss of optimizer step STEP (1-based) is
# multiplied by FACTOR before backward, on every rank.
LOSS_FACTORS_ENV = "PRETRAIN_TEST_LOSS_FACTORS"


def injected_loss_factors() -> dict[int, float]:
    """The factors ``PRETRAIN_TEST_LOSS_FACTORS`` gives by step ({} when unset): read once, by the trainer."""
    out = {}
    for item in os.environ.get(LOSS_FACTORS_ENV, "").split(","):
        if item.strip():
            step, _, factor = item.partition(":")
            out[int(step)] = float(factor)
    return out


@dataclass(frozen=True)
class Verdict:
    """What happens to one optimizer step's update."""

    skip: bool
    rule: str | None = None  # the recipe key whose rule skipped it
    reason: str | None = None  # what was seen, for the console and the metrics
    left_to_scaler: bool = False  # fp16: a non-finite gradient norm the loss scaler skips (not counted here)


APPLY = Verdict(skip=False)


class TooManySkips(TrainingDiverged):
    """The stop of ``stability.max_consecutive_skips`` (exit 3 unless ``stability.rollback`` takes over): the
    step that stopped the run and the first skipped step of its streak."""

    def __init__(self, message: str, step: int, first_skipped_step: int, verdict: Verdict):
        super().__init__(message)
        self.step, self.first_skipped_step, self.verdict = step, first_skipped_step, verdict


def _mean_std(values: deque) -> tuple[float, float]:
    mean = math.fsum(values) / len(values)
    var = math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var)


class SkipPolicy:
    """The rules of the ``stability`` section over a rolling window; its state goes into checkpoints."""

    def __init__(self, cfg: StabilityConfig, fp16: bool = False):
        self.cfg = cfg
        self.fp16 = fp16
        self.losses: deque[float] = deque(maxlen=cfg.window_steps)
        self.grad_norms: deque[float] = deque(maxlen=cfg.window_steps)
        self.skipped = 0  # updates skipped by these rules, over the whole run
        self.consecutive = 0

    def judge(self, loss: float, grad_norm: float | None) -> Verdict:
        """The verdict on a step's update from its global loss and gradient norm (None: not known)."""
        cfg = self.cfg
        if cfg.skip_nonfinite and not math.isfinite(loss):
            return Verdict(True, "stability.skip_nonfinite", f"loss is {loss}")
        if grad_norm is not None and not math.isfinite(grad_norm):
            if self.fp16:
                return Verdict(False, left_to_scaler=True)
            if cfg.skip_nonfinite:
                return Verdict(True, "stability.skip_nonfinite", f"gradient norm is {grad_norm}")
        if cfg.spike_sigma is not None and len(self.losses) >= max(2, cfg.window_steps // 2):
            for name, value, window in (("loss", loss, self.losses), ("gradient norm", grad_norm, self.grad_norms)):
                if value is None or not math.isfinite(value):
                    continue
                mean, std = _mean_std(window)
                if value > mean + cfg.spike_sigma * std:
                    return Verdict(True, "stability.spike_sigma",
                                   f"{name} {value:.4g} > mean {mean:.4g} + {cfg.spike_sigma:g} x std {std:.3g} of "
                                   f"the last {len(window)} updates")
        return APPLY

    def record(self, step: int, verdict: Verdict, loss: float, grad_norm: float | None) -> None:
        """Count the verdict; an applied update enters the window. TrainingDiverged after too many skips in a row."""
        if verdict.left_to_scaler:
            return
        if not verdict.skip:
            self.consecutive = 0
            if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)):
                self.losses.append(loss)
                self.grad_norms.append(grad_norm if grad_norm is not None else 0.0)
            return
        self.skipped += 1
        self.consecutive += 1
        limit = self.cfg.max_consecutive_skips
        if limit and self.consecutive >= limit:
            raise TooManySkips(
                f"step {step}: {self.consecutive} updates in a row skipped (the last by {verdict.rule}: "
                f"{verdict.reason}); stopping at stability.max_consecutive_skips = {limit}. The newest checkpoint "
                "holds the last healthy state: lower optim.lr (a resume applies it) or optim.grad_clip, then run "
                "the same command again", step, step - self.consecutive + 1, verdict,
            )

    def metrics(self, verdict: Verdict | None) -> dict[str, Any]:
        out: dict[str, Any] = {"stability/skipped_steps": self.skipped, "stability/consecutive_skips": self.consecutive}
        if verdict is not None and verdict.skip:
            out["stability/skip_rule"] = verdict.rule
            out["stability/skip_reason"] = verdict.reason
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms), "skipped": self.skipped,
                "consecutive": self.consecutive}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The checkpoint's window and counts replace this policy's (a rollback reloads into a running policy)."""
        self.losses.clear()
        self.grad_norms.clear()
        self.skipped = self.consecutive = 0
        if not state:
            return
        self.losses.extend(state["losses"])
        self.grad_norms.extend(state["grad_norms"])
        self.skipped, self.consecutive = int(state["skipped"]), int(state["consecutive"])


def _grad_norm_of(optimizer) -> torch.Tensor:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())


class StepGate:
    """One optimizer step's judgement: the trainer gives the reduced loss before the step's last backward;
    the verdict is taken once the gradient norm is known (by the trainer, or inside DeepSpeed's step)."""

    def __init__(self, policy: SkipPolicy):
        self.policy = policy
        self.loss: torch.Tensor | None = None
        self.divisor = 1
        self.verdict: Verdict | None = None
        self.values: tuple[float, float | None] = (math.nan, None)

    def begin(self, loss_sum: torch.Tensor, num_micro_steps: int) -> None:
        """The step's all-reduced sum of micro-step losses (the loss is that / GAS, divided on the host as the
        logged loss always was)."""
        self.loss, self.divisor, self.verdict, self.values = loss_sum, num_micro_steps, None, (math.nan, None)

    def judge(self, grad_norm) -> Verdict:
        """The verdict (taken once per step; later calls return it)."""
        if self.verdict is None:
            norm = grad_norm if isinstance(grad_norm, torch.Tensor) or grad_norm is None else torch.tensor(grad_norm)
            # Expensive device-to-host synchronization: the step's loss and gradient norm, once per step.
            if norm is None:
                loss, value = self.loss.item(), None
            else:
                loss, value = torch.stack([self.loss.float(), norm.float().to(self.loss.device)]).tolist()
            loss /= self.divisor
            self.values = (loss, value)
            self.verdict = self.policy.judge(loss, value)
        return self.verdict


class DeepSpeedGate:
    """The gate inside ``engine.step()``: the torch optimizer DeepSpeed steps runs only when the gate lets the
    update through. DeepSpeed computes the global gradient norm (``_global_grad_norm``) before it calls the
    torch optimizer; ZeRO-1/2 with offload and ZeRO-3 call it once per group or sub-group, which all share the
    step's one verdict. A held-back update leaves DeepSpeed's fp32 master partitions unchanged (it copies them
    to the model's parameters as after any step), and is marked as DeepSpeed marks its own skipped steps
    (``overflow``), so that neither the engine nor accelerate steps the LR schedule."""

    def __init__(self, gate: StepGate, engine):
        wrapper = engine.optimizer
        base = getattr(wrapper, "optimizer", None) or wrapper  # the torch optimizer DeepSpeed steps

        def grad_norm():
            if wrapper is base:  # ZeRO-0 fp32: no wrapper keeps a norm; the gradients' (after DeepSpeed's clip)
                return _grad_norm_of(base)
            return getattr(wrapper, "_global_grad_norm", None)  # None: the loss alone is judged

        step = base.step

        # functools.wraps keeps the LR scheduler's mark on the step it wrapped (torch warns when it is missing).
        @functools.wraps(step)
        def gated_step(*args, **kwargs):
            skip = gate.judge(grad_norm()).skip
            # Read by the engine after the optimizer's step (and by accelerate's step_was_skipped); ZeRO's
            # optimizers reset it at their next step, a plain one is set here every step.
            wrapper.overflow = skip
            return None if skip else step(*args, **kwargs)

        base.step = gated_step
