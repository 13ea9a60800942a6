"""One rank of the DeepSpeed model-state measurement (launched twice by tests/plan/test_memory_validation.py).

For each (ZeRO stage, dtype) it builds a small Llama, wraps it with ``deepspeed.initialize`` (gloo, CPU,
a torch AdamW client optimizer so no op is JIT-built), runs two training steps and, during the second,
counts the bytes of every tensor alive in the process, deduplicated by storage, at the two points where
model states peak: after backward (full or partitioned gradients and the reduce buckets held) and just
before the inner optimizer's step (fp32 gradient partition created, optimizer states present). Writes one
JSON file per rank: {"num_params": ..., "results": [{"zero_stage", "dtype", "measured_bytes", ...}]}.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 DS_ACCELERATOR=cpu \
        python tests/ds_memory_probe.py --out /tmp/probe --cases 0:fp32,3:bf16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# The model and the DeepSpeed knobs that the estimate is computed for (the test reads these too).
MODEL = {
    "arch": "llama",
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "intermediate_size": 352,
    "vocab_size": 2048,
    "tie_embeddings": False,
}
SEQ_LEN = 32
MICRO_BATCH_SIZE = 2
REDUCE_BUCKET_SIZE = 100_000  # elements; DeepSpeed's 5e8 default would dwarf a model this small
ALLGATHER_BUCKET_SIZE = 100_000
STAGE3_PREFETCH_BUCKET_SIZE = 50_000
STAGE3_PARAM_PERSISTENCE_THRESHOLD = 1_000
STAGE3_MAX_LIVE_PARAMETERS = 1_000_000


def reduce_dtype(zero_stage: int, dtype: str) -> str:
    """precision.reduce_dtype of the recipe each case stands for: fp32 (the default) except bf16 ZeRO-0, which
    cannot accumulate bf16 gradients in fp32."""
    return "bf16" if dtype == "bf16" and zero_stage == 0 else "fp32"


def ds_config(zero_stage: int, dtype: str, world_size: int) -> dict:
    zero = {
        "stage": zero_stage,
        "reduce_bucket_size": REDUCE_BUCKET_SIZE,
        "allgather_bucket_size": ALLGATHER_BUCKET_SIZE,
    }
    if zero_stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=STAGE3_PREFETCH_BUCKET_SIZE,
            stage3_param_persistence_threshold=STAGE3_PARAM_PERSISTENCE_THRESHOLD,
            stage3_max_live_parameters=STAGE3_MAX_LIVE_PARAMETERS,
        )
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "gradient_accumulation_steps": 1,
        "train_batch_size": MICRO_BATCH_SIZE * world_size,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        # As pretrain writes it for a bf16 recipe (deepspeed_config.gradient_dtype_fields)
        **({"data_types": {"grad_accum_dtype": reduce_dtype(zero_stage, dtype)},
            "communication_data_type": reduce_dtype(zero_stage, dtype)} if dtype == "bf16" else {}),
    }


def live_tensors(module=None, extra=()) -> dict[int, tuple[int, object]]:
    """Every CPU tensor reachable by the garbage collector, by storage: {data_ptr: (nbytes, tensor)}.

    A gradient that autograd wrote and no Python code has read yet has no Python object, so the
    garbage collector cannot see it: the module's ``.grad`` tensors (and ``extra`` ones) are listed
    explicitly. A DTensor (FSDP2) owns no storage of its own: it is counted by its local shard.
    """
    import torch
    from torch.distributed.tensor import DTensor

    gc.collect()
    seen: dict[int, tuple[int, object]] = {}
    grads = [p.grad for p in module.parameters()] if module is not None else []
    for obj in [*grads, *extra, *gc.get_objects()]:
        if isinstance(obj, DTensor):
            obj = obj._local_tensor
        if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
            continue
        storage = obj.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (nbytes, obj)
    return seen


def settled(take, pause_s: float = 0.1) -> tuple[dict[int, tuple[int, object]], list[list]]:
    """What ``take()`` (a live_tensors call) finds twice, ``pause_s`` apart, at one point of the training code:
    the storages of the same size in both takes, and, apart, [nbytes, shape, dtype] of each storage found in
    only one. Nothing of the training runs between the takes, so whatever it holds at that point is in both;
    a storage in one take only is held by something else for a moment, not a model state. One CI run (a loaded
    machine) counted one storage of exactly the embedding's size (1 MiB) too many after the FSDP2 no_sync
    backward: the size of the embedding unit's all-gather buffer, the last collective before that point, which
    gloo's worker thread owns until it drops its work object, after the collective has already returned."""
    # The first take keeps no tensor: a reference from here would hold what was about to be dropped.
    first = {ptr: [nbytes, list(tensor.shape), str(tensor.dtype)] for ptr, (nbytes, tensor) in take().items()}
    time.sleep(pause_s)
    second = take()
    held = {ptr: v for ptr, v in second.items() if ptr in first and first[ptr][0] == v[0]}
    passing = [first[ptr] for ptr in first if ptr not in held]
    passing += [[nbytes, list(tensor.shape), str(tensor.dtype)] for ptr, (nbytes, tensor) in second.items()
                if ptr not in held]
    return held, sorted(passing, key=lambda row: -row[0])


def labels(engine) -> dict[int, str]:
    """Names for the storages the engine holds (for the breakdown printed beside the total)."""
    import torch

    names: dict[int, str] = {}

    def add(t, name):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().nbytes():
            names.setdefault(t.untyped_storage().data_ptr(), name)

    for p in engine.module.parameters():
        add(getattr(p, "ds_tensor", None), "params (ds_tensor partitions)")
        add(p.grad, "grads (param.grad)")
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    for state in inner.state.values():
        for t in state.values():
            add(t, "optimizer states")
    for group in inner.param_groups:
        for p in group["params"]:
            add(p, "master weights (fp32)")
            add(p.grad, "fp32 grad partition")
    if opt is not inner:
        for attr, value in vars(opt).items():
            items = value if isinstance(value, (list, tuple)) else list(value.values()) if isinstance(value, dict) else [value]
            for item in items:
                for t in item if isinstance(item, (list, tuple)) else [item]:
                    add(t, f"optimizer.{attr}")
    for p in engine.module.parameters():
        add(p.data, "params")
    return names


def measure(zero_stage: int, dtype: str, world_size: int) -> dict:
    import deepspeed
    import torch

    from pretrain.model.build import build_model, count_parameters
    from pretrain.recipe.config import ModelConfig

    model_cfg = ModelConfig(**{k: v for k, v in MODEL.items() if k != "vocab_size"}, vocab_size=MODEL["vocab_size"])
    model = build_model(model_cfg, MODEL["vocab_size"], SEQ_LEN, seed=0)
    num_params = count_parameters(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # What the process held before DeepSpeed (the model itself is counted below), excluded by storage address.
    # The tensors are kept alive while the case runs: one freed meanwhile would leave its address to a new
    # allocation (a gradient), which would then be wrongly excluded.
    model_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    baseline = {ptr: tensor for ptr, (_, tensor) in live_tensors().items() if ptr not in model_ptrs}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(zero_stage, dtype, world_size))
    snapshots: dict[str, dict] = {}

    def snapshot(name):
        live, passing = settled(lambda: live_tensors(engine.module))
        held = {ptr: v for ptr, v in live.items() if ptr not in baseline}
        names = labels(engine)
        by_label: dict[str, int] = {}
        for ptr, (nbytes, _) in held.items():
            label = names.get(ptr, "other")
            by_label[label] = by_label.get(label, 0) + nbytes
        snapshots[name] = {"bytes": sum(n for n, _ in held.values()), "by_label": by_label, "passing": passing}

    inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    real_step = inner.step
    armed = {"on": False}

    def step_with_snapshot(*args, **kwargs):
        if armed["on"]:
            snapshot("before_inner_step")
        return real_step(*args, **kwargs)

    inner.step = step_with_snapshot
    real_reduce = engine.allreduce_gradients

    def reduce_with_snapshot(*args, **kwargs):
        if armed["on"]:
            snapshot("before_grad_reduction")  # ZeRO 0/1: every gradient is still full-size here
        return real_reduce(*args, **kwargs)

    engine.allreduce_gradients = reduce_with_snapshot
    generator = torch.Generator().manual_seed(engine.global_rank)
    for step in range(2):
        ids = torch.randint(0, MODEL["vocab_size"], (MICRO_BATCH_SIZE, SEQ_LEN), generator=generator)
        armed["on"] = step == 1
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if step == 1:
            del loss
            snapshot("after_backward")
        engine.step()
    snapshot("after_step")
    peak = max(snapshots.values(), key=lambda s: s["bytes"])
    result = {
        "zero_stage": zero_stage,
        "dtype": dtype,
        "num_params": num_params,
        "measured_bytes": peak["bytes"],
        "snapshots": snapshots,
    }
    inner.step = real_step
    engine.allreduce_gradients = real_reduce
    if hasattr(engine, "destroy"):
        engine.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="0:fp32,1:fp32,2:fp32,3:fp32,0:bf16,1:bf16,2:bf16,3:bf16")
    args = parser.parse_args()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    results = []
    for case in args.cases.split(","):
        stage, dtype = case.split(":")
        results.append(measure(int(stage), dtype, world_size))
        gc.collect()  # the previous engine's tensors must not count in the next case
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps({"world_size": world_size, "results": results}))
    sys.stdout.flush()
    sys.stderr.flush()
    # DeepSpeed on CPU/gloo can abort in interpreter teardown ("terminate called without an active
    # exception"); the results are written, so leave without running it.
    os._exit(0)


if __name__ == "__main__":
    main()
