"""One rank of the FSDP2 model-state measurement (launched by tests/plan/test_memory_validation.py under
accelerate_configs/fsdp.yaml, 2 processes; on CPU FSDP2 runs over gloo: pretrain.distributed.accelerator.fsdp_on_cpu).

pretrain's own set-up (build_accelerator, the model sharded on the meta device by model_placement,
accelerator.prepare) with ds_memory_probe's small Llama, GAS 2. It runs one optimizer step, then a second one
during which it counts the bytes of every tensor alive in the process, deduplicated by storage, that set-up
did not already hold before the model existed, at the two points where FSDP's model states peak between
collectives: after the no_sync micro-step's backward (the unsharded gradients accumulated, in
precision.reduce_dtype) and just before the optimizer step (the reduce-scattered fp32 gradient shards).
Writes ``rank<N>.json``: {"num_params", "dtype", "reduce_dtype", "snapshots": {name: {"bytes", "by_label"}}}.

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 tests/fsdp_memory_probe.py \
        OUT_DIR bf16 [precision.reduce_dtype=bf16 ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
for path in (str(_ROOT), str(_ROOT / "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

MICRO_BATCH_SIZE, GRAD_ACCUM_STEPS = 2, 2


def overrides(dtype: str) -> list[str]:
    from ds_memory_probe import MODEL, SEQ_LEN

    model = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in MODEL.items() if k != "arch"]
    return [*model, f"data.seq_len={SEQ_LEN}", f"precision.dtype={dtype}",
            f"batch.micro_batch_size={MICRO_BATCH_SIZE}", f"batch.global_batch_size={MICRO_BATCH_SIZE * GRAD_ACCUM_STEPS * 2}",
            "train.max_steps=2", "lr_schedule.warmup_steps=1"]


def live(module) -> dict[int, tuple[int, object]]:
    """ds_memory_probe.live_tensors, with the unsharded gradients under no_sync listed explicitly: FSDP2 leaves
    a unit's gradient (when not accumulated in another dtype) on its unsharded parameter's .grad, written by
    autograd, so no Python object reaches it until it is read here."""
    from ds_memory_probe import live_tensors

    unsharded = [getattr(fp._unsharded_param, "grad", None) for fp in fsdp_params(module)
                 if hasattr(fp, "_unsharded_param")]
    return live_tensors(module, unsharded)


def labels(model, optimizer) -> dict[int, str]:
    import torch
    from torch.distributed.tensor import DTensor

    names: dict[int, str] = {}

    def add(t, name):
        t = t._local_tensor if isinstance(t, DTensor) else t
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            names.setdefault(t.untyped_storage().data_ptr(), name)

    for p in model.parameters():
        add(p, "params (fp32 shards)")
        add(p.grad, "grads (fp32 shards)")
    for state in optimizer.state.values():
        for t in state.values():
            add(t, "optimizer states")
    for fp in fsdp_params(model):
        add(fp.unsharded_accumulated_grad, "unsharded accumulated grads")
        if hasattr(fp, "_unsharded_param"):
            add(fp._unsharded_param.grad, "unsharded grads")
    return names


def unsharded_grads(model) -> dict[str, dict]:
    """Each unsharded gradient FSDP holds (under no_sync), by parameter: its DTensor placements, the shape of its local
    tensor against the local shape of the parameter it belongs to, and the bytes of the storage behind it (what the
    snapshot counts)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for fp in fsdp_params(model):
        param = getattr(fp, "_unsharded_param", None)
        for grad in (fp.unsharded_accumulated_grad, getattr(param, "grad", None)):
            if grad is None:
                continue
            local = grad._local_tensor if isinstance(grad, DTensor) else grad
            out[fp._param_fqn] = {
                "placements": str(grad.placements) if isinstance(grad, DTensor) else None,
                "local_shape": list(local.shape),
                "param_local_shape": list((param._local_tensor if isinstance(param, DTensor) else param).shape),
                "storage_bytes": local.untyped_storage().nbytes(),
            }
    return out


def fsdp_params(model) -> list:
    """Every FSDPParam of the FSDP2 modules in ``model`` (torch's own bookkeeping of each sharded parameter)."""
    from torch.distributed.fsdp import FSDPModule

    return [fp for module in model.modules() if isinstance(module, FSDPModule)
            for group in module._get_fsdp_state()._fsdp_param_groups for fp in group.fsdp_params]


def measure(acc, model, optimizer, vocab: int, seq_len: int, baseline: dict, before_step=None) -> dict[str, dict]:
    """Two optimizer steps of GAS_STEPS micro-batches; during the second, the bytes alive (less ``baseline``) after the
    no_sync micro-step's backward and just before the optimizer step, by label; ``before_step`` is called there too
    (the EP probe reads its expert states)."""
    import torch
    from ds_memory_probe import settled

    snapshots: dict[str, dict] = {}

    def snapshot(name: str) -> None:
        live_now, passing = settled(lambda: live(model))
        held = {ptr: v for ptr, v in live_now.items() if ptr not in baseline}
        names = labels(model, optimizer)
        by_label: dict[str, int] = {}
        for ptr, (nbytes, _) in held.items():
            label = names.get(ptr, "other")
            by_label[label] = by_label.get(label, 0) + nbytes
        snapshots[name] = {"bytes": sum(n for n, _ in held.values()), "by_label": by_label, "passing": passing,
                           "unsharded_grads": unsharded_grads(model)}

    generator = torch.Generator().manual_seed(acc.process_index)
    for step in range(2):
        for _ in range(GRAD_ACCUM_STEPS):
            ids = torch.randint(0, vocab, (MICRO_BATCH_SIZE, seq_len), generator=generator)
            with acc.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                acc.backward(loss)
                del loss
                if step == 1 and not acc.sync_gradients:
                    snapshot("after_no_sync_backward")
                if step == 1 and acc.sync_gradients:
                    snapshot("before_optimizer_step")
                    if before_step is not None:
                        before_step()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return snapshots


def write_result(acc, out_dir: Path, result: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{acc.process_index}.json").write_text(json.dumps(result))
    acc.end_training()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    import torch

    from pretrain.distributed.accelerator import build_accelerator, model_placement
    from pretrain.distributed.layout import Launch
    from pretrain.model.build import build_model, count_parameters
    from pretrain.recipe.batching import plan_batches
    from pretrain.recipe.config import load_recipe
    from pretrain.train.preflight import check_run

    out_dir, dtype, *extra = sys.argv[1:]
    out_dir = Path(out_dir)
    recipe = load_recipe(_ROOT / "recipes" / "tiny.yaml", [*overrides(dtype), *extra])
    launch = Launch.from_env()
    plan = plan_batches(recipe.batch, launch.data_parallel_size, recipe.data.seq_len)
    assert plan.grad_accum_steps == GRAD_ACCUM_STEPS, plan
    acc = build_accelerator(recipe, check_run(recipe, launch), out_dir, []).accelerator
    # Held before the model exists (the process group, RNG states): kept alive so that no freed address can be
    # taken by a model state and wrongly excluded.
    baseline = {ptr: tensor for ptr, (_, tensor) in live(torch.nn.Module()).items()}
    placement = model_placement(acc)
    vocab = recipe.model.vocab_size
    model = build_model(recipe.model, vocab, recipe.data.seq_len, seed=0, device=placement.device,
                        shard=placement.shard)
    num_params = count_parameters(model)
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    snapshots = measure(acc, model, optimizer, vocab, recipe.data.seq_len, baseline)
    write_result(acc, out_dir, {"num_params": num_params, "dtype": dtype, "reduce_dtype": recipe.precision.reduce_dtype,
                                "snapshots": snapshots})


if __name__ == "__main__":
    main()
