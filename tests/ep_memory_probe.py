"""One rank of the expert-parallel model-state measurement (launched by tests/plan/test_memory_validation.py under
accelerate_configs/fsdp.yaml, 2 processes, model.moe.ep_size=2; gloo on CPU).

fsdp_memory_probe's measurement (pretrain's own set-up, GAS 2, the bytes of every tensor alive after the no_sync
micro-step's backward and before the optimizer step) on recipes/moe-tiny.yaml's OLMoE at a small size, with expert
parallelism as the run applies it (Launch.for_recipe, model_placement with the launch). Also records which experts
each rank holds (pretrain.distributed.expert_parallel.expert_shards) and the local shapes of every expert weight, its
gradient and AdamW's exp_avg / exp_avg_sq. Writes ``rank<N>.json``: {"num_params", "layout", "snapshots",
"expert_shards", "experts": {name: {"param", "grad", "exp_avg", "exp_avg_sq"}}}.

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 tests/ep_memory_probe.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
for path in (str(_ROOT), str(_ROOT / "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

RECIPE = _ROOT / "recipes" / "moe-tiny.yaml"
WORLD, EP_SIZE = 2, 2
MICRO_BATCH_SIZE, GRAD_ACCUM_STEPS = 2, 2  # fsdp_memory_probe.measure's (asserted in main)
OVERRIDES = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.vocab_size=1024",
             "model.moe.num_experts=4", "model.moe.expert_intermediate_size=64", "data.seq_len=64",
             "precision.dtype=fp32", f"batch.micro_batch_size={MICRO_BATCH_SIZE}",
             f"batch.global_batch_size={MICRO_BATCH_SIZE * GRAD_ACCUM_STEPS * WORLD}", "train.max_steps=2",
             "lr_schedule.warmup_steps=1", "eval.tasks=[]", f"model.moe.ep_size={EP_SIZE}"]
"""The recipe the probe trains and the test estimates (one home)."""


def local_shape(tensor) -> list[int] | None:
    from torch.distributed.tensor import DTensor

    if tensor is None:
        return None
    return list((tensor.to_local() if isinstance(tensor, DTensor) else tensor).shape)


def main() -> None:
    import fsdp_memory_probe
    import torch
    from fsdp_memory_probe import live, measure, write_result

    from pretrain.distributed.accelerator import build_accelerator, model_placement
    from pretrain.distributed.expert_parallel import expert_shards
    from pretrain.distributed.layout import Launch
    from pretrain.model.build import build_model, count_parameters
    from pretrain.recipe.config import load_recipe
    from pretrain.train.preflight import check_run

    assert (MICRO_BATCH_SIZE, GRAD_ACCUM_STEPS) == (fsdp_memory_probe.MICRO_BATCH_SIZE,
                                                    fsdp_memory_probe.GRAD_ACCUM_STEPS)
    out_dir = Path(sys.argv[1])
    recipe = load_recipe(RECIPE, OVERRIDES)
    run_plan = check_run(recipe, Launch.from_env())
    launch = run_plan.launch
    assert launch.ep_size == EP_SIZE and run_plan.batch.grad_accum_steps == GRAD_ACCUM_STEPS, (launch, run_plan.batch)
    acc = build_accelerator(recipe, run_plan, out_dir, []).accelerator
    # Held before the model exists (the process group, RNG states): kept alive so that no freed address can be
    # taken by a model state and wrongly excluded.
    baseline = {ptr: tensor for ptr, (_, tensor) in live(torch.nn.Module()).items()}
    placement = model_placement(acc, launch)
    model = build_model(recipe.model, recipe.model.vocab_size, recipe.data.seq_len, seed=0, device=placement.device,
                        shard=placement.shard)
    num_params = count_parameters(model)
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    experts: dict[str, dict] = {}

    def expert_states() -> None:  # the reduced gradients, and AdamW's states since the first step
        for name, param in model.named_parameters():
            if ".experts." in name:
                state = optimizer.state.get(param, {})
                experts[name] = {"param": local_shape(param), "grad": local_shape(param.grad),
                                 "exp_avg": local_shape(state.get("exp_avg")),
                                 "exp_avg_sq": local_shape(state.get("exp_avg_sq"))}

    snapshots = measure(acc, model, optimizer, recipe.model.vocab_size, recipe.data.seq_len, baseline, expert_states)
    write_result(acc, out_dir, {"num_params": num_params, "layout": launch.describe("CPU process"),
                                "snapshots": snapshots, "expert_shards": expert_shards(model), "experts": experts})


if __name__ == "__main__":
    main()
