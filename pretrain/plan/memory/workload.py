"""What one rank computes (precision, optimizer, micro-batch, attention kernel) and DeepSpeed's buffer sizes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pretrain.errors import ConfigError
from pretrain.recipe.recompute import normalize

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
LOSSES = ("chunked", "plain", "liger")
FLOAT8_MODES = ("off", "tensorwise", "rowwise")

# Optimizer state bytes per parameter (fp32 states). Keys are lower-cased torch.optim names.
_STATE_BYTES = {
    "adamw": 8, "adam": 8, "nadam": 8, "radam": 8, "adamax": 8, "adadelta": 8, "rprop": 8,
    "adagrad": 4, "asgd": 4, "lion": 4, "rmsprop": 4, "sgd": 0, "adafactor": 0, "lbfgs": 8,
}


def optimizer_state_bytes(name: str, args: dict[str, Any] | None = None) -> tuple[int, str]:
    """(bytes per parameter of optimizer state, how it was counted)."""
    args = args or {}
    key = name.lower()
    if key not in _STATE_BYTES:
        return 8, f"{name}: not in the table, counted like Adam (8 B/param: two fp32 states)"
    k = _STATE_BYTES[key]
    why = {8: "two fp32 states (e.g. exp_avg, exp_avg_sq)", 4: "one fp32 state", 0: "no per-parameter state"}[k]
    if key in ("adam", "adamw") and args.get("amsgrad"):
        k, why = 12, "exp_avg, exp_avg_sq and max_exp_avg_sq (amsgrad)"
    if key == "sgd" and args.get("momentum", 0):
        k, why = 4, "the momentum buffer"
    if key == "rmsprop":
        k += 4 * bool(args.get("momentum", 0)) + 4 * bool(args.get("centered", False))
        why = f"{k // 4} fp32 state(s)"
    if key == "adafactor":
        why = "factored second moments: rows + columns, negligible"
    return k, f"{name}: {k} B/param, {why}"


@dataclass(frozen=True)
class Workload:
    """What one rank computes per micro-step."""

    precision: str = "bf16"
    optimizer: str = "AdamW"
    optimizer_args: dict[str, Any] = field(default_factory=dict)
    micro_batch_size: int = 1
    seq_len: int = 2048
    attention: str = "sdpa"
    activation_checkpointing: str = "none"
    """The checkpointing policy (model.activation_checkpointing): none, full, selective or every_N."""
    document_masking: bool = False  # data.document_masking: sdpa then gets a MBS x s x s mask
    grad_accum_steps: int | None = None
    sync_each_micro_batch: bool = False
    """batch.sync_each_micro_batch: FSDP reduce-scatters after every micro-batch (no no_sync)."""
    global_batch_size: int | None = None
    reduce_dtype: str = "fp32"
    """bf16 only (precision.reduce_dtype): the dtype DeepSpeed and FSDP accumulate and reduce gradients in."""
    float8: str = "off"
    """precision.float8: off, tensorwise or rowwise (``parallel.float8_term``)."""
    compile: str = "none"
    """model.compile as the recipe asks (auto, none, regional, full); the estimate resolves auto for its device and
    layout (pretrain.distributed.layout.compile_choice) and scales compiled activations by their calibration."""
    loss: str = "chunked"
    """model.loss as the run resolves it (pretrain.model.loss.resolve_loss): chunked, plain or liger. Liger never
    materialises the logits, so its term differs; plain is counted as chunked."""

    def __post_init__(self):
        if self.float8 not in FLOAT8_MODES:
            raise ConfigError(f"float8 {self.float8!r}: use one of {', '.join(FLOAT8_MODES)}")
        if self.precision not in PRECISION_BYTES:
            raise ConfigError(f"precision {self.precision!r}: use one of fp32, bf16, fp16")
        if self.reduce_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"reduce_dtype {self.reduce_dtype!r}: use fp32 or bf16")
        if self.loss not in LOSSES:
            raise ConfigError(f"loss {self.loss!r}: use one of {', '.join(LOSSES)} (as pretrain.model.loss.resolve_loss "
                              "resolves model.loss)")
        if self.compile not in ("auto", "none", "regional", "full"):
            raise ConfigError(f"compile {self.compile!r}: use one of auto, none, regional, full")
        if self.attention not in ("sdpa", "eager", "flash_attention_2"):
            raise ConfigError(f"attention {self.attention!r}: use one of sdpa, eager, flash_attention_2")
        try:
            object.__setattr__(self, "activation_checkpointing", normalize(self.activation_checkpointing))
        except ValueError as exc:
            raise ConfigError(f"activation checkpointing {exc}") from None
        if self.micro_batch_size < 1 or self.seq_len < 1:
            raise ConfigError(
                f"micro batch size ({self.micro_batch_size}) and seq_len ({self.seq_len}) must be >= 1"
            )

    @property
    def fp32_grads(self) -> bool:
        """bf16 compute with gradients accumulated in fp32 (pretrain's default for bf16 recipes)."""
        return self.precision == "bf16" and self.reduce_dtype == "fp32"

    @classmethod
    def from_recipe(cls, recipe, plan, loss: str | None = None) -> Workload:
        """``loss``: model.loss as the run resolved it. Without it, ``auto`` counts as chunked: resolving auto
        needs the device and liger_kernel (pretrain.model.loss.resolve_loss), and chunked is the larger figure."""
        if loss is None:
            loss = "chunked" if recipe.model.loss == "auto" else recipe.model.loss
        return cls(
            precision=recipe.precision.dtype,
            optimizer=recipe.optim.name,
            optimizer_args=dict(recipe.optim.args),
            micro_batch_size=plan.micro_batch_size,
            seq_len=plan.seq_len,
            attention=recipe.model.attention,
            activation_checkpointing=recipe.model.activation_checkpointing,
            document_masking=recipe.data.document_masking,
            grad_accum_steps=plan.grad_accum_steps,
            sync_each_micro_batch=recipe.batch.sync_each_micro_batch,
            global_batch_size=plan.global_batch_size,
            reduce_dtype=recipe.precision.reduce_dtype,
            float8=recipe.precision.float8,
            compile=recipe.model.compile,
            loss=loss,
        )


@dataclass(frozen=True)
class DeepSpeedBuffers:
    """DeepSpeed's buffer sizes (elements); the defaults are DeepSpeed's own (``zero/config.py``)."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None
    """null = DeepSpeed's default: on for ZeRO-3 only."""
    contiguous_gradients: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    allreduce_bucket_size: int = 500_000_000
    """ZeRO-0: the engine all-reduces gradients through flat buffers of this many elements."""

    _ZERO_KEYS = (
        "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
        "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
        "sub_group_size",
    )

    @classmethod
    def from_recipe(cls, recipe) -> DeepSpeedBuffers:
        """The recipe's ``deepspeed`` section where it sets a size, DeepSpeed's defaults otherwise."""
        section = getattr(recipe, "deepspeed", None)
        values = {}
        for key in cls._ZERO_KEYS:
            value = getattr(section, key, None) if section is not None else None
            if value is not None:
                values[key] = value
        return cls(**values)

    @classmethod
    def from_deepspeed_config(cls, config: dict[str, Any]) -> DeepSpeedBuffers:
        """From a DeepSpeed config dict (its ``zero_optimization`` block; "auto" values keep the default)."""
        zero = config.get("zero_optimization") or {}
        values = {k: zero[k] for k in cls._ZERO_KEYS if zero.get(k) not in (None, "auto")}
        return cls(**{k: (bool(v) if k in ("overlap_comm", "contiguous_gradients") else int(v)) for k, v in values.items()})

    def overrides(self, items: list[str]) -> DeepSpeedBuffers:
        """``key=value`` strings (e.g. ``reduce_bucket_size=2e8``) applied over these values."""
        values = asdict(self)
        for item in items:
            key, sep, raw = item.partition("=")
            key = key.strip().removeprefix("zero_optimization.")
            if not sep or key not in values:
                raise ConfigError(
                    f"--ds {item!r}: use KEY=VALUE with KEY one of {', '.join(values)}"
                )
            if key in ("overlap_comm", "contiguous_gradients"):
                if raw.lower() not in ("true", "false"):
                    raise ConfigError(f"--ds {item!r}: {key} is true or false")
                values[key] = raw.lower() == "true"
            else:
                try:
                    values[key] = int(float(raw))
                except ValueError:
                    raise ConfigError(f"--ds {item!r}: {key} is a number of elements") from None
        return DeepSpeedBuffers(**values)
