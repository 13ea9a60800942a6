"""Will this recipe fit, with which ZeRO stage and micro batch? Per-device memory before a job is queued.

    pretrain-estimate --recipe recipes/7b.yaml --num-gpus 8 --zero 3 --micro-batch-size 1
    pretrain-estimate --recipe recipes/7b.yaml --nodes 2 --gpus-per-node 8 --zero 2 --gpu A100-40GB --explain
    pretrain-estimate --recipe recipes/70b.yaml --num-gpus 64 --zero 3 --json
    pretrain-estimate --recipe recipes/7b.yaml --num-gpus 8 --sweep          # ZeRO stages x MBS
    pretrain-estimate --model-config path/to/config.json --seq-len 4096 --num-gpus 8 --zero 3
    pretrain-estimate --recipe recipes/7b.yaml --accelerate-config accelerate_configs/fsdp.yaml --explain
    pretrain-estimate --recipe recipes/7b.yaml --nodes 8 --gpus-per-node 8 --zero 3 --hybrid   # ZeRO++ hpZ
    pretrain-estimate --recipe recipes/70b.yaml --nodes 4 --gpus-per-node 8 --fsdp --tp 8 --explain   # FSDP2 x TP
    pretrain-estimate --recipe recipes/olmoe-1b-7b.yaml --num-gpus 8 --fsdp --ep 8 --explain       # FSDP2 x EP

Without --zero, --fsdp or --accelerate-config the layout is PyTorch DDP (accelerate's MULTI_GPU). Arithmetic
only: no weights are allocated and transformers is not imported (pretrain/memory has the formulas,
pretrain/recipe/shape.py the model's shape, pretrain/system/hardware.py the GPU table); with --tp the first
estimate per transformers version reads the architecture's TP plan from a meta model, and the cache keeps it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from pretrain.cli.options import count, positive_gib
from pretrain.distributed.layout import Launch, check_offload
from pretrain.errors import EXIT_USAGE, ConfigError
from pretrain.plan import memory
from pretrain.recipe.recompute import normalize as normalize_policy
from pretrain.recipe.shape import ModelShape
from pretrain.system import hardware
from pretrain.system.hardware import resolve_gpu

SWEEP_MAX_MBS = 128
FSDP_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


def build_parser(prog: str = "pretrain-estimate") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Per-device GPU memory of a training run: parameters, gradients, optimizer states, "
        "activations, logits, buffers, and whether it fits.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = parser.add_argument_group("model (one of)")
    src.add_argument("--recipe", help="recipe YAML, e.g. recipes/7b.yaml")
    src.add_argument("--model-config", help="a transformers config.json (or its directory) instead of a recipe")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="recipe overrides, e.g. data.seq_len=2048")
    world = parser.add_argument_group("world")
    world.add_argument("--num-gpus", type=count(), help="GPUs in total on one node (= --nodes 1 --gpus-per-node N)")
    world.add_argument("--nodes", type=count(), help="nodes")
    world.add_argument("--gpus-per-node", type=count(), help="GPUs per node")
    lay = parser.add_argument_group("layout")
    lay.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="DeepSpeed ZeRO stage")
    lay.add_argument("--fsdp", nargs="?", const="FULL_SHARD", choices=FSDP_SHARDING,
                     help="PyTorch FSDP with this sharding strategy (FULL_SHARD unless given)")
    lay.add_argument("--hybrid", action="store_true",
                     help="hybrid sharding, within a node and replicated across nodes: ZeRO-3 hpZ or FSDP HSDP")
    lay.add_argument("--accelerate-config", help="an accelerate config YAML (DeepSpeed, FSDP, DDP); sets stage, offload, "
                     "world")
    lay.add_argument("--tp", type=count(), metavar="N",
                     help="tensor parallel size (FSDP2: with --fsdp or an FSDP accelerate config; accelerate's "
                     "parallelism_config_tp_size): the TP plan's modules split N ways, FSDP shards over the rest")
    lay.add_argument("--cp", type=count(), metavar="N",
                     help="context parallel size (FSDP2; accelerate's parallelism_config_cp_size): every sequence "
                     "split N ways (sdpa, no document masking)")
    lay.add_argument("--ep", type=count(), metavar="N",
                     help="expert parallel size (FSDP2, a mixture of experts; with a recipe the same as the override "
                     "model.moe.ep_size=N): each rank holds num_experts / N whole experts")
    lay.add_argument("--offload-optimizer", nargs="?", const="cpu", choices=("cpu", "nvme"),
                     help="offload the optimizer partition (cpu unless nvme is given; ZeRO >= 1)")
    lay.add_argument("--offload-params", nargs="?", const="cpu", choices=("cpu", "nvme"),
                     help="offload the parameter partitions (ZeRO-3, or FSDP's shards with its optimizer step: cpu)")
    lay.add_argument("--ds", action="append", default=[], metavar="KEY=VALUE",
                     help="DeepSpeed buffer size, e.g. --ds reduce_bucket_size=2e8 (DeepSpeed's defaults otherwise)")
    run = parser.add_argument_group("workload (override the recipe)")
    run.add_argument("--precision", choices=("fp32", "bf16", "fp16"))
    run.add_argument("--micro-batch-size", type=count(), help="MBS: sequences per GPU per forward/backward")
    run.add_argument("--seq-len", type=count(), help="tokens per sequence")
    run.add_argument("--activation-checkpointing", metavar="POLICY", type=_policy, default=None,
                     help="none, full, selective or every_N (N >= 2): what is recomputed in backward "
                     "(README: Activation checkpointing)")
    run.add_argument("--attention", choices=("sdpa", "eager", "flash_attention_2"))
    run.add_argument("--optimizer", help="torch.optim name (with --model-config; default AdamW)")
    dev = parser.add_argument_group("device")
    dev.add_argument("--gpu", help=f"GPU name (capacity from a table; default {hardware.DEFAULT_GPU}); --list-gpus shows it")
    dev.add_argument("--gpu-memory-gib", type=positive_gib, help="device capacity in GiB instead of --gpu")
    dev.add_argument("--list-gpus", action="store_true", help="print the GPU table and exit")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="one JSON object")
    out.add_argument("--explain", action="store_true", help="each term's formula with the numbers put in")
    out.add_argument("--sweep", action="store_true",
                     help="table over DDP, ZeRO stages and FSDP x MBS, largest MBS that fits per layout")
    return parser


# --------------------------------------------------------------------------------------------------
# From arguments to (shape, workload, layout, buffers, gpu)


def resolve_world(args, accelerate_config: str | None) -> tuple[int | None, int | None]:
    if args.num_gpus is not None:
        if args.nodes not in (None, 1) or (args.gpus_per_node not in (None, args.num_gpus)):
            raise ConfigError("give --num-gpus N (one node) or --nodes N --gpus-per-node G, not both")
        return 1, args.num_gpus
    if accelerate_config:
        return args.nodes, args.gpus_per_node
    return args.nodes or 1, args.gpus_per_node or 1


def resolve_layout(args) -> Launch:
    if sum(x is not None for x in (args.zero, args.fsdp, args.accelerate_config)) > 1:
        raise ConfigError("give one of --zero, --fsdp or --accelerate-config")
    nodes, gpus = resolve_world(args, args.accelerate_config)
    if args.accelerate_config:
        layout = Launch.from_accelerate_config(args.accelerate_config, num_nodes=nodes, gpus_per_node=gpus)
    elif args.zero is not None:
        layout = Launch("deepspeed", args.zero, num_nodes=nodes, gpus_per_node=gpus)
    elif args.fsdp is not None:
        # torch's FSDP1 names for hybrid sharding: within a node (--hybrid says the same of FULL_SHARD)
        hybrid = args.fsdp.startswith("HYBRID_SHARD") or args.hybrid
        sharding = {"HYBRID_SHARD": "FULL_SHARD", "HYBRID_SHARD_ZERO2": "SHARD_GRAD_OP"}.get(args.fsdp, args.fsdp)
        layout = Launch("fsdp", num_nodes=nodes, gpus_per_node=gpus, fsdp_sharding=sharding,
                        hybrid_shard_size=gpus if hybrid else None)
    else:
        layout = Launch("ddp", 0, num_nodes=nodes, gpus_per_node=gpus)
    if args.hybrid and not layout.hybrid_shard_size:
        if args.accelerate_config or layout.engine == "ddp":
            raise ConfigError("--hybrid goes with --zero 3 or --fsdp (an accelerate config says it itself: "
                              "multinode_zero3_hpz.yaml, multinode_hsdp.yaml)")
        layout = replace(layout, hybrid_shard_size=layout.gpus_per_node)
    if args.tp is not None or args.cp is not None:
        layout = _model_parallel(layout, args.tp, args.cp)
    if args.offload_optimizer or args.offload_params:
        if layout.engine == "ddp":
            raise ConfigError("--offload-optimizer / --offload-params need DeepSpeed: add --zero 1, 2 or 3 (or --fsdp "
                              "with --offload-params)")
        layout = replace(layout, offload_optimizer=args.offload_optimizer or layout.offload_optimizer,
                         offload_params=args.offload_params or layout.offload_params)
    return layout


def _model_parallel(layout: Launch, tp: int | None, cp: int | None) -> Launch:
    """``layout`` with --tp / --cp in place of its own sizes (an accelerate config's parallelism_config). HSDP keeps
    its replicas: each node's GPUs, over TP, shard one (as the planner's HSDP x TP). check_launch refuses what cannot
    run (TP spanning nodes, sizes that do not divide the world)."""
    if layout.engine != "fsdp":
        raise ConfigError("--tp / --cp compose with FSDP2 only (accelerate's parallelism_config): add --fsdp, or give "
                          "an FSDP accelerate config (accelerate_configs/fsdp2_tp2.yaml)")
    tp = tp if tp is not None else layout.tp_size
    cp = cp if cp is not None else layout.cp_size
    hybrid = layout.hybrid_shard_size
    if hybrid:
        hybrid = layout.gpus_per_node // tp if layout.gpus_per_node % tp == 0 else hybrid
    return replace(layout, tp_size=tp, cp_size=cp, hybrid_shard_size=hybrid)


def _policy(value: str) -> str:
    try:
        return normalize_policy({"true": True, "false": False}.get(value.lower(), value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def recipe_overrides(args) -> list[str]:
    extra = list(args.overrides)
    if args.precision:
        extra.append(f"precision.dtype={args.precision}")
    if args.seq_len is not None:
        extra.append(f"data.seq_len={args.seq_len}")
    if args.activation_checkpointing is not None:
        extra.append(f"model.activation_checkpointing={args.activation_checkpointing}")
    if args.attention:
        extra.append(f"model.attention={args.attention}")
    if args.ep is not None:
        extra.append(f"model.moe.ep_size={args.ep}")
    return extra


def plan_for(recipe, world_size: int, micro_batch_size: int | None):
    """The recipe's batch plan on this world size, with MBS replaced when given (GBS kept)."""
    from pretrain.recipe.batching import plan_batches, with_micro_batch_size

    batch = recipe.batch
    if micro_batch_size is not None:
        batch = with_micro_batch_size(batch, world_size, micro_batch_size)
    return plan_batches(batch, world_size, recipe.data.seq_len)


class Problem:
    """One estimate's inputs, from a recipe or a transformers config; ``at(...)`` varies stage and MBS."""

    def __init__(self, args):
        self.args = args
        self.layout = resolve_layout(args)
        self.gpu = resolve_gpu(args)
        if bool(args.recipe) == bool(args.model_config):
            raise ConfigError("give --recipe R or --model-config FILE (exactly one)")
        if args.recipe:
            from pretrain.recipe.config import load_recipe

            if args.optimizer:
                raise ConfigError("--optimizer is for --model-config; with a recipe override optim.name=NAME")
            self.recipe = load_recipe(args.recipe, recipe_overrides(args))
            self.buffers = memory.DeepSpeedBuffers.from_recipe(self.recipe).overrides(args.ds)
            self.shape = ModelShape.from_recipe(self.recipe)
            self.layout = self.layout.for_recipe(self.recipe)  # model.moe.ep_size (or --ep): the launch's EP
        else:
            if args.overrides:
                raise ConfigError(f"key.path=value overrides ({args.overrides[0]}) need --recipe")
            if args.seq_len is None:
                raise ConfigError("--model-config needs --seq-len (tokens per sequence)")
            self.recipe = None
            self.buffers = memory.DeepSpeedBuffers().overrides(args.ds)
            self.shape = ModelShape.from_hf_config(*_read_hf_config(args.model_config))
            if args.ep is not None:
                self.layout = replace(self.layout, ep_size=args.ep)

    def workload(self, micro_batch_size: int | None, world_size: int) -> memory.Workload:
        args = self.args
        if self.recipe is not None:
            plan = plan_for(self.recipe, world_size, micro_batch_size)
            return memory.Workload.from_recipe(self.recipe, plan)
        return memory.Workload(
            precision=args.precision or "bf16",
            optimizer=args.optimizer or "AdamW",
            micro_batch_size=micro_batch_size or 1,
            seq_len=args.seq_len,
            attention=args.attention or "sdpa",
            activation_checkpointing=args.activation_checkpointing or "none",
        )

    def at(self, layout: Launch | None = None, micro_batch_size: int | None = None) -> memory.MemoryEstimate:
        layout = layout or self.layout
        mbs = micro_batch_size if micro_batch_size is not None else self.args.micro_batch_size
        # TP and CP ranks share their micro-batches: the batch plan is over the data-parallel ranks
        return memory.estimate_shape(
            self.shape, self.workload(mbs, layout.data_parallel_size), layout, buffers=self.buffers, gpu=self.gpu,
            async_checkpoint=self.recipe is not None and self.recipe.checkpoint.async_,
        )


def _read_hf_config(path: str) -> tuple[dict, str]:
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise ConfigError(f"--model-config {path}: no such file (give a transformers config.json or its directory)")
    try:
        return json.loads(file.read_text()), str(file)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--model-config {file}: not valid JSON: {exc}") from None


# --------------------------------------------------------------------------------------------------
# Sweep


def sweep_mbs_values(problem: Problem) -> list[int]:
    if problem.recipe is None:
        return [2**i for i in range(8)]
    from pretrain.recipe.batching import micro_batch_sizes

    return micro_batch_sizes(problem.recipe.batch, problem.layout.world_size, largest=SWEEP_MAX_MBS)


def sweep(problem: Problem) -> tuple[list[dict], str]:
    base = problem.layout
    if base.tp_size > 1 or base.cp_size > 1 or base.ep_size > 1:
        raise ConfigError("--sweep compares DDP, ZeRO and FSDP without tensor, context or expert parallelism; drop --tp "
                          "/ --cp / --ep (or the accelerate config's parallelism_config, or model.moe.ep_size), or rank "
                          "TP / CP / EP layouts with pretrain-plan")
    world = dict(num_nodes=base.num_nodes, gpus_per_node=base.gpus_per_node)
    offload = dict(offload_optimizer=base.offload_optimizer, offload_params=base.offload_params)
    candidates = [("DDP", Launch("ddp", **world))]
    candidates += [(f"ZeRO-{stage}", Launch("deepspeed", stage, **offload, **world)) for stage in range(4)]
    if base.offload_optimizer == "none" and base.offload_params in ("none", "cpu"):  # what FSDP can offload
        candidates += [(name, Launch("fsdp", offload_params=base.offload_params, fsdp_sharding=sharding, **world))
                       for name, sharding in (("FSDP", "FULL_SHARD"), ("FSDP-SGO", "SHARD_GRAD_OP"))]
    rows = []
    for name, layout in candidates:
        try:
            check_offload(layout)
        except ConfigError:
            continue  # the offload asked for is not possible at this stage
        rows.append((name, layout))
    mbs_values = sweep_mbs_values(problem)
    results, lines = [], []
    gpu = problem.gpu
    header = f"{'layout':<8}" + "".join(f"{'MBS ' + str(m):>11}" for m in mbs_values) + "   largest MBS that fits"
    lines.append(f"GiB per device ({gpu.name}, {gpu.memory_gib:.1f} GiB); * = does not fit")
    lines.append(header)
    for name, layout in rows:
        cells, best = [], None
        for m in mbs_values:
            est = problem.at(layout, m)
            results.append({"layout": name, "zero_stage": layout.zero_stage if layout.uses_deepspeed else None,
                            "fsdp_sharding": layout.fsdp_sharding,
                            "micro_batch_size": m, "total_gib": round(est.total_gib, 4), "fits": est.fits})
            cells.append(f"{est.total_gib:>10.1f}{' ' if est.fits else '*'}")
            if est.fits:
                best = m
        lines.append(f"{name:<8}" + "".join(cells) + f"   {best if best else 'none'}")
    return results, "\n".join(lines)


# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.list_gpus:
            for spec in hardware.GPUS.values():
                print(f"{spec.name:<15}{spec.memory_gib:>8.1f} GiB   {spec.bf16_tflops:>7.1f} TFLOP/s bf16 dense   "
                      f"({spec.card})")
            return 0
        problem = Problem(args)
        if args.sweep:
            results, table = sweep(problem)
            if args.json:
                best = {}
                for r in results:
                    if r["fits"]:
                        best[r["layout"]] = max(best.get(r["layout"], 0), r["micro_batch_size"])
                print(json.dumps({"num_params": problem.shape.num_params, "gpu_memory_gib": problem.gpu.memory_gib,
                                  "cells": results, "largest_mbs": best}, indent=2))
            else:
                print(table)
            return 0
        from pretrain.recipe.config import AUTO

        note = None
        if problem.recipe is not None and problem.recipe.batch.micro_batch_size == AUTO and args.micro_batch_size is None:
            from pretrain.plan import auto_batch  # the size a run would choose on this layout and GPU

            problem.recipe, note = auto_batch.resolve(problem.recipe, problem.layout, problem.gpu, "cuda")
        est = problem.at()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if note:
        print(note, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(est.to_json(), indent=2))
    elif args.explain:
        print(est.explain())
    else:
        print(est.summary())
        if problem.recipe is not None and problem.recipe.model.init_from is not None:
            from pretrain.plan.memory.loading import load_memory

            print(f"\nmodel.init_from {problem.recipe.model.init_from}: "
                  f"{load_memory(problem.recipe, problem.layout).line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
