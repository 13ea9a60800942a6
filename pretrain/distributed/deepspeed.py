"""The DeepSpeed config of a run: built from the recipe and the batch plan, merged with the launch.

One source of truth per field. The recipe owns the batch triple, optimizer, schedule, precision and
clipping; the accelerate config owns the ZeRO stage and offload. A user's own DeepSpeed JSON
(``deepspeed_config_file`` in the accelerate config) is merged: its recipe-owned fields must be
``"auto"``, absent, or equal to the recipe's value, otherwise the run stops with both values named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pretrain.distributed.layout import HPZ_KEY, Launch
from pretrain.errors import ConfigError
from pretrain.recipe import recompute
from pretrain.recipe.batching import BatchPlan
from pretrain.recipe.config import Recipe

_DS_OPTIMIZERS = {"AdamW": "AdamW", "Adam": "Adam"}


def read_user_config(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"deepspeed_config_file = {path!r} (from the accelerate config) does not exist; fix the path or remove "
            "the key to let pretrain build the DeepSpeed config from the recipe"
        )
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {exc}") from None


def uses_deepspeed_optimizer(recipe: Recipe, user: dict[str, Any] | None) -> bool:
    choice = recipe.deepspeed.optimizer
    wanted = choice == "deepspeed" or (choice == "auto" and bool(user and user.get("optimizer")))
    if wanted and recipe.optim.name not in _DS_OPTIMIZERS:
        raise ConfigError(
            f"DeepSpeed's optimizers cover {sorted(_DS_OPTIMIZERS)}, not optim.name={recipe.optim.name}; set "
            "deepspeed.optimizer=torch (and remove `optimizer` from the DeepSpeed JSON) to use it as a client optimizer"
        )
    return wanted


def _precision_block(recipe: Recipe) -> dict[str, Any]:
    prec = recipe.precision
    if prec.dtype == "fp16":
        return {
            "fp16": {
                "enabled": True,
                "loss_scale": 0 if prec.loss_scale == "dynamic" else float(prec.loss_scale),
                "initial_scale_power": prec.initial_scale_power,
                "loss_scale_window": prec.loss_scale_window,
                "hysteresis": prec.hysteresis,
                "min_loss_scale": prec.min_loss_scale,
            },
            "bf16": {"enabled": False},
        }
    return {"fp16": {"enabled": False}, "bf16": {"enabled": prec.dtype == "bf16"}}


def gradient_dtype_fields(recipe: Recipe) -> dict[str, Any]:
    """bf16 recipes: DeepSpeed accumulates gradients (``data_types.grad_accum_dtype``) and reduces them
    (``communication_data_type``) in ``precision.reduce_dtype``, fp32 by default. The two are independent in
    DeepSpeed (both default to the model dtype, bf16), so both are set. Other dtypes: DeepSpeed's defaults (the
    compute dtype), or the recipe's ``deepspeed.communication_data_type``."""
    prec = recipe.precision
    if prec.dtype != "bf16":
        comm = recipe.deepspeed.communication_data_type
        return {} if comm is None else {"communication_data_type": comm}
    return {"data_types": {"grad_accum_dtype": prec.reduce_dtype}, "communication_data_type": prec.reduce_dtype}


def recipe_fields(recipe: Recipe, plan: BatchPlan, lr: float, ds_optimizer: bool) -> dict[str, Any]:
    """The DeepSpeed fields the recipe owns."""
    fields: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "gradient_clipping": float(recipe.optim.grad_clip or 0.0),
        **_precision_block(recipe),
        **gradient_dtype_fields(recipe),
    }
    if ds_optimizer:
        args = dict(recipe.optim.args)
        params = {"lr": lr, "weight_decay": recipe.optim.weight_decay}
        for key in ("betas", "eps"):
            if key in args:
                params[key] = args.pop(key)
        if args:
            raise ConfigError(
                f"optim.args {sorted(args)} have no DeepSpeed optimizer equivalent; remove them or use deepspeed.optimizer=torch"
            )
        fields["optimizer"] = {"type": _DS_OPTIMIZERS[recipe.optim.name], "params": params}
    return fields


def _zero_block(recipe: Recipe, launch: Launch, user_zero: dict[str, Any]) -> dict[str, Any]:
    ds = recipe.deepspeed
    stage = launch.zero_stage  # the accelerate config's, else the user JSON's, else 2 (see Launch)
    zero = dict(user_zero)
    zero["stage"] = stage
    # The launch's offload device, unless the user's JSON already has that device (and maybe more settings).
    for key, device in (("offload_optimizer", launch.offload_optimizer), ("offload_param", launch.offload_params)):
        if device != "none" and (user_zero.get(key) or {}).get("device") != device:
            zero[key] = {"device": device, "pin_memory": True}
    optional = {
        "reduce_bucket_size": ds.reduce_bucket_size,
        "allgather_bucket_size": ds.allgather_bucket_size,
        "overlap_comm": ds.overlap_comm,
        "contiguous_gradients": ds.contiguous_gradients,
        "stage3_prefetch_bucket_size": ds.stage3_prefetch_bucket_size,
        "stage3_param_persistence_threshold": ds.stage3_param_persistence_threshold,
        "stage3_max_live_parameters": ds.stage3_max_live_parameters,
    }
    zero.update({k: v for k, v in optional.items() if v is not None})
    if launch.hybrid_shard_size:
        # hpZ: the launch resolved the JSON's value ("auto": the GPUs per node) and checked it against the world.
        zero[HPZ_KEY] = launch.hybrid_shard_size
    else:
        zero.pop(HPZ_KEY, None)  # 0 or 1: DeepSpeed's own "no hpZ"
    if stage == 3:
        # The final export gathers the full weights (transformers save_pretrained needs them).
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    return zero


def check_zero(recipe: Recipe, zero: dict[str, Any]) -> None:
    stage = zero.get("stage")
    problems = []
    if stage not in (0, 1, 2, 3):
        problems.append(f"zero_optimization.stage = {stage!r}: DeepSpeed has stages 0, 1, 2 and 3")
    param_device = (zero.get("offload_param") or {}).get("device", "none")
    if param_device != "none" and stage != 3:
        problems.append(
            f"offload_param_device={param_device} needs ZeRO stage 3 (got stage {stage}): DeepSpeed offloads "
            "parameters only when it partitions them; use zero3_offload.yaml or set offload_param_device: none"
        )
    opt_device = (zero.get("offload_optimizer") or {}).get("device", "none")
    if opt_device != "none" and stage == 0:
        problems.append(f"offload_optimizer_device={opt_device} needs ZeRO stage 1, 2 or 3 (got stage 0)")
    if stage == 3 and not recompute.runs_under_zero3(recipe.model.activation_checkpointing):
        problems.append(
            "model.activation_checkpointing=selective cannot run under ZeRO-3 (its parameters are gathered by hooks "
            "inside each block, which run other ops when the block is recomputed than in its forward, and torch's "
            "selective checkpointing replays the forward's ops); use every_N or full, or ZeRO-1/2"
        )
    if stage == 0 and recipe.precision.dtype == "bf16" and recipe.precision.reduce_dtype == "fp32":
        problems.append(
            "ZeRO stage 0 with precision.dtype=bf16 cannot accumulate gradients in fp32 (DeepSpeed's stage 0 keeps "
            "bf16 gradients: data_types.grad_accum_dtype=fp32 is not implemented there); use ZeRO-1 (zero1.yaml), "
            "DDP, or accept bf16 accumulation and reduction with precision.reduce_dtype=bf16"
        )
    if problems:
        raise ConfigError(problems)


def build_deepspeed_config(
    recipe: Recipe, plan: BatchPlan, launch: Launch, lr: float, user: dict[str, Any] | None = None
) -> tuple[dict[str, Any], bool]:
    """(DeepSpeed config dict, whether DeepSpeed builds the optimizer). Raises ConfigError on conflicts."""
    user = dict(user or {})
    source = launch.deepspeed_config_file or "the DeepSpeed config"
    ds_optimizer = uses_deepspeed_optimizer(recipe, user)
    ours = recipe_fields(recipe, plan, lr, ds_optimizer)
    conflicts = []
    for key, value in ours.items():
        if key in ("fp16", "bf16", "optimizer", "data_types"):
            conflicts += _nested_conflicts(key, user.get(key), value, source)
        elif key in user and user[key] != "auto" and user[key] != value:
            conflicts.append(f"{source} has {key}={user[key]!r} but the recipe gives {value!r}")
    if user.get("scheduler"):
        conflicts.append(
            f"{source} has a `scheduler` block; the recipe owns the LR schedule (lr_schedule), remove the block"
        )
    conflicts += _checkpoint_writer_conflicts(recipe, user.get("checkpoint"), source)
    gas, clip_given = (launch.deepspeed_fields.get(k) for k in ("gradient_accumulation_steps", "gradient_clipping"))
    if gas not in (None, "auto") and int(gas) != plan.grad_accum_steps:
        conflicts.append(
            f"the accelerate config has gradient_accumulation_steps={gas} but the recipe's "
            f"batch plan gives GAS {plan.grad_accum_steps} (GBS {plan.global_batch_size} / (MBS {plan.micro_batch_size} "
            f"x world {plan.world_size})); remove it from the accelerate config"
        )
    clip = float(recipe.optim.grad_clip or 0.0)
    if clip_given not in (None, "auto", "none") and float(clip_given) != clip:
        conflicts.append(
            f"the accelerate config has gradient_clipping={clip_given} but the recipe has "
            f"optim.grad_clip={recipe.optim.grad_clip}; remove it from the accelerate config"
        )
    if conflicts:
        raise ConfigError(conflicts)

    config = {k: v for k, v in user.items() if k not in ours and k != "scheduler"}
    config.update(ours)
    config["zero_optimization"] = _zero_block(recipe, launch, user.get("zero_optimization") or {})
    check_zero(recipe, config["zero_optimization"])
    ds = recipe.deepspeed
    if not ds_optimizer:
        # Allows the client torch optimizer with optimizer offload (DeepSpeed otherwise insists on its CPU Adam).
        config["zero_force_ds_cpu_optimizer"] = False
    config["prescale_gradients"] = ds.prescale_gradients
    config["steps_per_print"] = ds.steps_per_print or 2**31 - 1
    config["wall_clock_breakdown"] = ds.wall_clock_breakdown
    config["dump_state"] = ds.dump_state
    return config, ds_optimizer


def _checkpoint_writer_conflicts(recipe: Recipe, checkpoint: Any, source: str) -> list[str]:
    """DeepSpeed's own checkpoint writers (``checkpoint.writer`` of its JSON) against pretrain's checkpoints, whose
    manifest (checksums of every file) is written and the directory renamed into place once save_state returns."""
    writer = checkpoint.get("writer") if isinstance(checkpoint, dict) else None
    if not writer:
        return []
    if isinstance(writer, dict) and writer.get("decoupled"):
        # DeepSpeed commits a decoupled write at the next optimizer step, after save_checkpoint has returned.
        return [f"{source} has checkpoint.writer.decoupled=true: DeepSpeed's decoupled writer finishes a checkpoint's "
                "files at the next optimizer step, after pretrain has checksummed them and made the checkpoint "
                "`latest`, so a resume could meet it half written; remove checkpoint.writer (checkpoint.async=true in "
                "the recipe writes in the background and lists a checkpoint only once it is complete)"]
    if recipe.checkpoint.async_:
        # FastCheckpointEngine hands torch.save a DeepNVMe file writer, not a path: nothing for the staging to take.
        return [f"{source} has checkpoint.writer (DeepSpeed's FastCheckpointEngine) and the recipe has "
                "checkpoint.async=true: that engine writes through DeepNVMe's file writer, which checkpoint.async "
                "cannot stage, so every save would block the loop; remove checkpoint.writer, or set "
                "checkpoint.async=false to keep DeepSpeed's writer"]
    return []


def _nested_conflicts(key: str, theirs: Any, ours: dict[str, Any], source: str) -> list[str]:
    if not isinstance(theirs, dict):
        return []
    out = []
    for sub, value in theirs.items():
        if value == "auto":
            continue
        if key == "optimizer" and sub == "params" and isinstance(value, dict):
            for param, param_value in value.items():
                mine = ours.get("params", {}).get(param)
                if param_value != "auto" and mine is not None and _differs(param_value, mine):
                    out.append(f"{source} has optimizer.params.{param}={param_value!r} but the recipe gives {mine!r}")
        elif sub in ours and _differs(value, ours[sub]):
            out.append(f"{source} has {key}.{sub}={value!r} but the recipe gives {ours[sub]!r}")
    return out


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(float(a) - float(b)) > 1e-12 * max(1.0, abs(float(b)))
    return a != b
