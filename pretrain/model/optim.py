"""Optimizer (any torch.optim class by name) and learning-rate schedule (transformers' schedules).

The schedule is a function of the optimizer step only. It is built for the run's number of optimizer
steps and stepped once per optimizer step by the trainer, whatever the world size.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
from torch import nn

from pretrain.errors import ConfigError
from pretrain.recipe.config import LRScheduleConfig, OptimConfig


def optimizer_class(cfg: OptimConfig) -> type[torch.optim.Optimizer]:
    cls = getattr(torch.optim, cfg.name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        names = sorted(n for n, c in vars(torch.optim).items() if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
                       and c is not torch.optim.Optimizer)
        raise ConfigError(f"optim.name = {cfg.name!r} is not a torch.optim optimizer; use one of: {', '.join(names)}")
    return cls


# Optimizers the loop cannot step: it calls step() without a closure, on dense gradients, with param groups.
UNSUPPORTED = {"SparseAdam": "it takes sparse gradients only, and a transformer's are dense"}
DEVICE_ARGS = ("fused", "foreach", "capturable", "differentiable")  # checked on the run's device, not here


def check_optimizer_args(cfg: OptimConfig, lr: float | None = None) -> None:
    """Fail before any compute if the optimizer cannot run here: a class the loop cannot step, an argument the
    class does not take, or values it rejects (the class is built on a one-element parameter, in two param
    groups as the run's, without the device-dependent arguments)."""
    cls = optimizer_class(cfg)
    step = inspect.signature(cls.step).parameters.get("closure")
    if cfg.name in UNSUPPORTED or (step is not None and step.default is inspect.Parameter.empty):
        why = UNSUPPORTED.get(cfg.name, "its step() needs a closure that re-evaluates the loss")
        raise ConfigError(f"optim.name = {cfg.name!r} cannot be used by this training loop: {why}; use AdamW, "
                          "Adam, SGD, Adafactor or another torch.optim optimizer that steps on dense gradients")
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    unknown = sorted(set(cfg.args) - accepted)
    if unknown:
        raise ConfigError(
            f"optim.args has {unknown} which torch.optim.{cfg.name} does not accept; "
            f"its arguments are: {', '.join(sorted(accepted))}"
        )
    if "weight_decay" not in accepted and cfg.weight_decay:
        raise ConfigError(f"torch.optim.{cfg.name} has no weight decay; set optim.weight_decay=0")
    args = {k: v for k, v in cfg.args.items() if k not in DEVICE_ARGS}
    groups = [{"params": [nn.Parameter(torch.zeros(2, 2))], "weight_decay": cfg.weight_decay},
              {"params": [nn.Parameter(torch.zeros(2))], "weight_decay": 0.0}]
    if "weight_decay" not in accepted:
        groups = [{"params": g["params"]} for g in groups]
    try:
        cls(groups, lr=cfg.lr if lr is None else lr, **args)
    except (TypeError, ValueError, RuntimeError, IndexError, KeyError) as exc:
        raise ConfigError(f"optim: torch.optim.{cfg.name} rejects optim.args = {cfg.args} (lr {cfg.lr}): {exc}; "
                          "fix the value it names") from None


def scaled_lr(cfg: OptimConfig, global_batch_size: int) -> float:
    """The peak lr after optional batch-size scaling (linear or square-root rule)."""
    if cfg.lr_scaling == "none":
        return cfg.lr
    ratio = global_batch_size / cfg.reference_global_batch_size
    return cfg.lr * (ratio if cfg.lr_scaling == "linear" else math.sqrt(ratio))


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Two groups: matrices decay; norm weights, biases (and embeddings unless configured) do not. A parameter
    partitioned by ZeRO-3's ``zero.Init`` is an empty placeholder: its real shape is ``ds_shape``."""
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        is_embedding = id(param) in embedding_params
        if len(getattr(param, "ds_shape", param.shape)) < 2 or (is_embedding and not cfg.decay_embeddings):
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def implementation_args(cfg: OptimConfig, device_type: str) -> dict:
    """``optim.args`` plus the fastest implementation where the user chose none: on CUDA, optimizers that
    take ``fused`` (Adam, AdamW, SGD, ...) run fused (one kernel for all parameters instead of a few per
    tensor). On CPU nothing is added: torch's default there is exact to the runs recorded before, and the
    fused CPU kernel differs in the last bits. ``optim.args.fused`` / ``foreach`` decide when given."""
    args = dict(cfg.args)
    accepted = inspect.signature(optimizer_class(cfg).__init__).parameters
    if device_type == "cuda" and "fused" in accepted and not {"fused", "foreach"} & set(args):
        args["fused"] = True
    return args


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float, device_type: str = "cpu") -> torch.optim.Optimizer:
    check_optimizer_args(cfg)
    cls = optimizer_class(cfg)
    groups = [g for g in param_groups(model, cfg) if g["params"]]
    try:
        return cls(groups, lr=lr, **implementation_args(cfg, device_type))
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise ConfigError(f"optim: torch.optim.{cfg.name} rejected its arguments {cfg.args}: {exc}") from None


def check_schedule(cfg: LRScheduleConfig, num_steps: int) -> None:
    if cfg.warmup_steps >= num_steps and cfg.name != "constant":
        raise ConfigError(
            f"lr_schedule.warmup_steps ({cfg.warmup_steps}) must be smaller than the run's {num_steps} optimizer "
            "steps; lower warmup_steps or raise train.max_steps / train.max_tokens"
        )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduleConfig, num_steps: int):
    # Imported here: the checks above are what launchers and --dry-run need, without transformers' 0.9 s import.
    from transformers import get_scheduler

    check_schedule(cfg, num_steps)
    if cfg.name == "cosine":
        name, extra = "cosine_with_min_lr", {"min_lr_rate": cfg.min_lr_ratio}
    elif cfg.name == "linear":
        name, extra = "linear", {}
    elif cfg.name == "constant":
        name, extra = "constant_with_warmup", {}
    else:
        decay_steps = max(1, round(cfg.decay_fraction * num_steps))
        name = "warmup_stable_decay"
        extra = {"num_decay_steps": decay_steps, "min_lr_ratio": cfg.min_lr_ratio}
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=cfg.warmup_steps,
        num_training_steps=num_steps,
        scheduler_specific_kwargs=extra,
    )


def set_peak_lr(scheduler, lr: float) -> float:
    """Make ``lr`` the schedule's peak after a resume; returns the lr the next step uses.

    A checkpoint restores the optimizer's param groups (their lr and initial_lr) and the LambdaLR's base_lrs,
    so without this the peak lr of the run that saved it would win over the recipe's. The schedule's shape
    and length are this run's already (the LambdaLR's lambdas are built from the recipe, not loaded)."""
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's (and its DeepSpeed) wrapper
    inner.base_lrs = [lr] * len(inner.base_lrs)
    values = [base * fn(inner.last_epoch) for base, fn in zip(inner.base_lrs, inner.lr_lambdas, strict=True)]
    for group, value in zip(inner.optimizer.param_groups, values, strict=True):
        group["initial_lr"], group["lr"] = lr, value
    inner._last_lr = values
    return values[0]


class Schedule:
    """The lr schedule's rule, a stateful part of the run (pretrain/checkpoint/state.py): this recipe's peak lr and
    the rollbacks' lr factors, on top of the scheduler accelerate saves and restores. A load applies both again."""

    def __init__(self, scheduler, peak_lr: float, factor: Callable[[int], float] | None = None, log=print):
        self.scheduler = scheduler
        self.inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's (and its DeepSpeed) wrapper
        self.peak_lr = peak_lr
        self.log = log
        if factor is not None:
            self._scale(factor)

    def _scale(self, factor: Callable[[int], float]) -> None:
        """Multiply the schedule by ``factor(schedule step)`` (``Rollback.lr_factor``), inside the LambdaLR's own
        lambdas, so every engine's schedule (DeepSpeed steps it inside its step), ``set_peak_lr`` after a reload and
        a resume compute the same lr. Plain functions: LambdaLR's state_dict saves none of them (a checkpoint holds
        no callable), and a resume installs them again."""

        def scaled(schedule):
            def lr_lambda(step: int) -> float:
                return schedule(step) * factor(step)
            return lr_lambda

        self.inner.lr_lambdas = [scaled(fn) for fn in self.inner.lr_lambdas]

    @property
    def step(self) -> int:
        """The schedule's own step (updates applied: skipped ones do not count)."""
        return int(self.inner.last_epoch)

    @property
    def lr(self) -> float:
        return float(self.inner.get_last_lr()[0])

    def apply(self) -> float:
        """This recipe's peak lr over the loaded schedule state; the lr the next update uses."""
        return set_peak_lr(self.scheduler, self.peak_lr)

    def state_dict(self) -> dict[str, float]:
        return {"peak_lr": self.peak_lr, "lr": self.lr}

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        """The checkpoint's scheduler and optimizer state carry its peak lr: this recipe's is the one in force (the
        lr logged when that changes the lr the checkpoint would have used next)."""
        lr_now = self.apply()
        if state is not None and not math.isclose(lr_now, state["lr"], rel_tol=1e-6):
            self.log(f"resume: lr {lr_now:.4g} at schedule step {self.step} (the checkpoint's {state['lr']:.4g}; "
                     f"peak {self.peak_lr:.4g})")


def deepspeed_optimizer(model: nn.Module, recipe, lr: float, num_steps: int):
    """Placeholders that let DeepSpeed build its own (fused / CPU) Adam on our parameter groups.

    The schedule is still transformers': DeepSpeed calls the callable with the optimizer it built.
    """
    from accelerate.utils import DummyOptim, DummyScheduler

    optimizer = DummyOptim(param_groups(model, recipe.optim), lr=lr, weight_decay=recipe.optim.weight_decay)
    scheduler = DummyScheduler(
        optimizer, lr_scheduler_callable=lambda built: build_scheduler(built, recipe.lr_schedule, num_steps)
    )
    return optimizer, scheduler
