"""The model side of a run, built once: the model (seeded, or model.init_from's weights), float8, its loss and
router, the optimizer and schedule, prepared by accelerate (sharded, partitioned or replicated as the launch says);
and the references its speed and memory are measured against (FLOPs per token, the device's peak, the estimate)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pretrain.checkpoint.neutral import optimizer_params
from pretrain.distributed.accelerator import AcceleratorSetup, compile_in_place, model_placement, unwrap
from pretrain.distributed.run_plan import RunPlan
from pretrain.model import float8
from pretrain.model.build import build_model, count_active_parameters, count_parameters, resolve_vocab_size
from pretrain.model.loss import LossTerms, install_loss, loss_choice
from pretrain.model.optim import build_optimizer, build_scheduler, deepspeed_optimizer
from pretrain.plan.memory import MemoryEstimate
from pretrain.recipe.config import Recipe
from pretrain.recipe.shape import FlopsPerToken
from pretrain.system.quiet import TiedWeightsSaved
from pretrain.train.metrics import Peak, memory_estimate, throughput_reference
from pretrain.train.router import RouterStats

Log = Callable[[str], None]


@dataclass
class ModelParts:
    model: Any  # as accelerate prepared it (DDP, FSDP2, a DeepSpeed engine, or the module itself)
    config: Any  # the transformers config of the model built
    optimizer: Any
    scheduler: Any
    num_params: int
    num_active_params: int  # per token: an MoE's routed experts counted top-k times
    float8: float8.Float8Report | None
    loss_implementation: str  # model.loss as resolved (auto: liger on CUDA, if it can)
    loss_terms: LossTerms | None
    router: RouterStats | None  # MoE: the load-balancing loss and expert load
    flops: FlopsPerToken | None
    peak: Peak
    memory: MemoryEstimate | None  # the estimator's figures for this very run (logged beside the measured peak)
    optimizer_params: list[list[str]] | None = None  # recorded in each checkpoint (neutral.optimizer_params)


def build_model_parts(recipe: Recipe, run_plan: RunPlan, accelerator, setup: AcceleratorSetup, vocab_size: int, *,
                      pretrained: bool, log: Log, log_every_rank: Log) -> ModelParts:
    """Build, load (``pretrained``: model.init_from's weights), convert, and prepare; ``vocab_size``: the
    tokenizer's."""
    device, launch = accelerator.device, run_plan.launch
    vocab = resolve_vocab_size(recipe.model, vocab_size)
    # Built on the run's device (or partitioned, or sharded first): never a full fp32 copy per rank on CPU.
    placement = model_placement(accelerator, launch)
    converted: list[float8.Float8Report] = []

    def to_float8(meta_model):  # on the meta model, before FSDP2 shards it (pretrain/model/float8.py)
        converted.append(float8.convert(meta_model, recipe.precision, emulate=device.type != "cuda",
                                        fsdp2=accelerator.is_fsdp2))

    model = build_model(recipe.model, vocab, recipe.data.seq_len, seed=recipe.train.seed, device=placement.device,
                        shard=placement.shard, convert=to_float8 if recipe.precision.float8 != "off" else None,
                        pretrained=pretrained, log=log_every_rank)
    if launch.ep_size > 1:
        from pretrain.distributed.expert_parallel import describe

        log(describe(model, launch))
    f8 = converted[0] if converted else None
    if f8 is not None:
        log(f8.line())
    loss_implementation, why = loss_choice(recipe, launch)  # auto: liger on CUDA, if it can
    log(f"loss: {loss_implementation} ({why})")
    loss_terms = install_loss(model, loss_implementation, recipe.stability.z_loss)
    router = RouterStats.for_model(model.config)
    TiedWeightsSaved.install(model)  # checkpoints leave out the tied LM head copy; loading ties it again
    flops, peak = throughput_reference(recipe, model.config, device, log)
    # The estimate of the model just built: its vocabulary, whatever the estimator could read of the tokenizer.
    built = recipe.model_copy(update={"model": recipe.model.model_copy(update={"vocab_size": vocab})})
    estimated = memory_estimate(built, run_plan.batch, launch, device, log, loss_implementation)
    if setup.deepspeed_optimizer:
        optimizer, scheduler = deepspeed_optimizer(model, recipe, run_plan.lr, run_plan.num_steps)
    else:
        optimizer = build_optimizer(model, recipe.optim, run_plan.lr, device.type)
        scheduler = build_scheduler(optimizer, recipe.lr_schedule, run_plan.num_steps)
    if f8 is not None and f8.fsdp_float8_all_gather:
        # torch's optimizer hook, on the optimizer accelerate wraps: after every update that happened
        optimizer.register_step_post_hook(lambda *_: float8.after_optimizer_step(model, f8))
    num_params, num_active = count_parameters(model), count_active_parameters(model)
    compile_in_place(model, setup.compile_mode, launch)  # one process / DDP; else accelerate's
    config = model.config
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    names = optimizer_params(unwrap(model, launch), optimizer.optimizer)
    return ModelParts(model, config, optimizer, scheduler, num_params, num_active, f8, loss_implementation, loss_terms,
                      router, flops, peak, estimated, names)
