"""pretrain-plan: feasible layouts for a recipe on a cluster, ranked by expected throughput (the planner and its
step-time model: pretrain/plan/planner.py); the best is written as an accelerate config.

    pretrain-plan --recipe recipes/7b.yaml --nodes 1 --gpus-per-node 8 --gpu H100-80GB
    pretrain-plan --recipe recipes/7b.yaml --nodes 2 --gpus-per-node 8 --gpu A100-40GB --output my.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pretrain.cli import add_recipe_arguments
from pretrain.cli.options import count, positive_gib
from pretrain.errors import EXIT_USAGE, ConfigError
from pretrain.plan import memory
from pretrain.plan.planner import (
    CALIBRATION_FILE,
    DEFAULT_BASE_MFU,
    EP_CONFIG,
    HYBRID_CONFIGS,
    accelerate_config,
    calibration,
    default_output,
    explain_choice,
    launch_command,
    nothing_fits,
    plan,
    recipe_overrides,
)
from pretrain.system import hardware


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pretrain-plan",
        description="Feasible layouts (DDP, ZeRO stage, FSDP, HSDP, FSDP x TP, HSDP x TP, CP, EP for a mixture of experts, offload, activation checkpointing, MBS, GAS) for a recipe on a "
        "cluster, ranked by expected throughput; writes the best as an accelerate config.",
    )
    add_recipe_arguments(parser, "recipes/7b.yaml")
    parser.add_argument("--nodes", type=count(), default=1, help="nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=count(), default=8, help="GPUs per node (default 8)")
    parser.add_argument("--gpu", default=hardware.DEFAULT_GPU, help=f"GPU name (default {hardware.DEFAULT_GPU})")
    parser.add_argument("--gpu-memory-gib", type=positive_gib, help="device capacity in GiB instead of the table's")
    parser.add_argument("--host-memory-gib", type=positive_gib, default=1024.0,
                        help="CPU memory per node available to offload (GiB, default 1024)")
    parser.add_argument("--calibration", metavar="FILE",
                        help="measured MFU rows (JSON list of {gpu, mfu, seq_len, mbs, ...}, as tools/bench_gpu.py writes) "
                             f"to calibrate the step-time model; default <cache root>/{CALIBRATION_FILE} if it exists, "
                             f"else {DEFAULT_BASE_MFU * 100:.0f}%% from torchtitan's published FSDP measurement")
    parser.add_argument("--top", type=count(), default=10, help="layouts to list (default 10)")
    parser.add_argument("--output", help="where to write the accelerate config (default runs/plan/<recipe>-<N>x<G>-<gpu>.yaml)")
    parser.add_argument("--json", action="store_true", help="the ranking as JSON")
    args = parser.parse_args(argv)
    try:
        from pretrain.recipe.config import load_recipe

        gpu = hardware.find_gpu(args.gpu)
        if args.gpu_memory_gib is not None:
            gpu = hardware.custom_gpu(args.gpu_memory_gib, gpu)
        recipe = load_recipe(args.recipe, args.overrides)
        calibrated = calibration(recipe, gpu, args.calibration)
        skipped: dict[str, list[str]] = {}
        ranked, considered = plan(recipe, args.nodes, args.gpus_per_node, gpu, host_memory_gib=args.host_memory_gib,
                                  base_mfu=calibrated.base_mfu, skipped=skipped)
        if not ranked:
            raise ConfigError(nothing_fits(recipe, args.nodes, args.gpus_per_node, gpu, considered, args.host_memory_gib))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    best = ranked[0]
    default = default_output(recipe, args.nodes, args.gpus_per_node, gpu)
    output = Path(args.output or default)
    if args.output and (output.is_dir() or args.output.endswith(("/", os.sep))):
        output = output / Path(default).name  # a directory: the config goes in it, under its default name
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = output.with_name(f".{output.name}.tmp")
        tmp.write_text(accelerate_config(best, args.recipe))
        os.replace(tmp, output)
    except OSError as exc:
        print(f"error: cannot write the accelerate config to {output} ({exc.strerror or exc}); give --output a "
              "file in a directory you can write", file=sys.stderr)
        return EXIT_USAGE
    overrides = [*args.overrides, *recipe_overrides(recipe, best)]
    command = launch_command(best, str(output), args.recipe, overrides)
    if args.json:
        print(json.dumps({
            "num_params": best.estimate.num_params, "considered": considered, "feasible": len(ranked),
            "config": str(output), "launch": command,
            "base_mfu": round(calibrated.base_mfu, 4), "base_mfu_source": calibrated.source,
            "ranking": [{"rank": i + 1, "layout": c.name, "engine": c.layout.engine,
                         "zero_stage": c.layout.zero_stage if c.layout.uses_deepspeed else None,
                         "fsdp_sharding": c.layout.fsdp_sharding, "hybrid_shard_size": c.layout.hybrid_shard_size,
                         "offload_optimizer": c.layout.offload_optimizer, "offload_params": c.layout.offload_params,
                         "activation_checkpointing": c.checkpointing, "micro_batch_size": c.micro_batch_size,
                         "grad_accum_steps": c.grad_accum_steps, "total_gib": round(c.estimate.total_gib, 3),
                         "tight": c.tight, "host_gib_per_node": round(c.estimate.host_bytes_per_node / memory.GIB, 1),
                         "tp_size": c.layout.tp_size, "cp_size": c.layout.cp_size, "ep_size": c.layout.ep_size,
                         "runs": c.runs,
                         "tokens_per_s_per_gpu": round(c.tokens_per_s, 1), "why": c.describe()}
                        for i, c in enumerate(ranked[: args.top])],
            "explanation": explain_choice(ranked, skipped),
        }, indent=2))
        return 0
    print(f"{recipe.name}: {best.estimate.num_params:,} parameters, GBS {best.estimate.workload.global_batch_size} x seq "
          f"{recipe.data.seq_len:,}, {recipe.precision.dtype}, on {args.nodes} x {args.gpus_per_node} {gpu.name} "
          f"({gpu.memory_gib:.1f} GiB)")
    print(f"step-time model: {calibrated.describe()}")
    print(f"{len(ranked)} of {considered} layouts fit; best first (relative step-time model, see pretrain/plan/planner.py):")
    for i, c in enumerate(ranked[: args.top]):
        print(f"{i + 1:>3}. {c.describe()}")
    print("\n" + "\n".join(explain_choice(ranked, skipped)))
    print(f"\nwrote {output}")
    if best.layout.hybrid_shard_size:
        print(f"hybrid sharding ({best.layout.hybrid_text()}), written above; the shipped "
              f"{HYBRID_CONFIGS[best.layout.engine]} is its 2 x 8 GPU template")
    if best.layout.ep_size > 1:
        print(f"expert parallelism: the shipped {EP_CONFIG} (FSDP2 full shard, as written above) with "
              f"model.moe.ep_size={best.layout.ep_size}, the recipe's (accelerate's parallelism_config has no expert "
              "dimension)")
    print(f"launch{' (on every node)' if args.nodes > 1 else ''}:\n  {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
