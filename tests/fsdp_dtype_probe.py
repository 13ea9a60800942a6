"""FSDP ranks (launched by tests/multiprocess/test_reduce_dtype.py under accelerate_configs/fsdp.yaml, on CPU or GPUs): builds
pretrain's accelerator for a bf16 recipe, prepares a tiny model, runs one optimizer step of GAS micro-steps and
prints, on a line starting with ``DTYPES``, the dtypes FSDP2 really used: each FSDPParam's reduce dtype (None
when it equals the bf16 compute dtype), the dtype of the unsharded gradients accumulated over the no_sync
micro-step, and of the sharded gradients after the reduce-scatter (rank 0's).

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 tests/fsdp_dtype_probe.py \
        OUT_DIR --recipe recipes/tiny.yaml precision.dtype=bf16 [key=value ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

VOCAB_SIZE = 256


def main() -> None:
    import torch
    from torch.distributed.fsdp import FSDPModule

    from pretrain.distributed.accelerator import build_accelerator
    from pretrain.distributed.layout import Launch
    from pretrain.model.build import build_model
    from pretrain.recipe.batching import plan_batches
    from pretrain.recipe.config import load_recipe
    from pretrain.train.preflight import check_run

    out_dir, _, recipe_path, *overrides = sys.argv[1:]
    recipe = load_recipe(recipe_path, overrides)
    launch = Launch.from_env()
    plan = plan_batches(recipe.batch, launch.world_size, recipe.data.seq_len)
    assert plan.grad_accum_steps > 1, "the probe needs a no_sync micro-step: GAS > 1"
    acc = build_accelerator(recipe, check_run(recipe, launch), Path(out_dir), []).accelerator
    model = build_model(recipe.model, VOCAB_SIZE, recipe.data.seq_len, seed=0)
    model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    fsdp_params = [fp for module in model.modules() if isinstance(module, FSDPModule)
                   for group in module._get_fsdp_state()._fsdp_param_groups for fp in group.fsdp_params]
    ids = torch.randint(0, VOCAB_SIZE, (plan.micro_batch_size, recipe.data.seq_len), device=acc.device)
    accumulated: set[str] = set()
    for _ in range(plan.grad_accum_steps):
        with acc.accumulate(model):
            acc.backward(model(input_ids=ids, labels=ids).loss)
            if not acc.sync_gradients:  # no_sync: the unsharded gradients are kept and accumulated
                for fp in fsdp_params:
                    grad = fp.unsharded_accumulated_grad
                    grad = grad if grad is not None else fp._unsharded_param.grad
                    if grad is not None:
                        accumulated.add(str(grad.dtype))
    result = {
        "num_fsdp_params": len(fsdp_params),
        "reduce_dtypes": sorted({str(fp.reduce_dtype) for fp in fsdp_params}),
        "param_dtypes": sorted({str(fp.param_dtype) for fp in fsdp_params}),
        "accumulated_grad_dtypes": sorted(accumulated),
        "sharded_grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
    }
    if acc.is_main_process:
        print("DTYPES " + json.dumps(result), flush=True)
    acc.end_training()
    # The figures are out. Leaving through the interpreter's teardown aborted in C++ in 2 of 8 runs on CPU/gloo
    # ("terminate called without an active exception", as tests/ds_memory_probe.py sees under DeepSpeed).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
