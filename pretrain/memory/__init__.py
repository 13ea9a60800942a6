"""Per-device memory of a training run, before it is queued: pure arithmetic, no torch.

A recipe (or a transformers config), the batch plan and the layout (DDP or DeepSpeed ZeRO 0-3, offload,
number of GPUs) give each term a device holds, in bytes, with the formula that produced it:

- **parameters, gradients, optimizer states** follow the ZeRO paper's accounting (Rajbhandari et al.
  2020: 2Ψ + 2Ψ + KΨ bytes for Ψ parameters in mixed precision, K = 12 for Adam: fp32 master, momentum,
  variance; each term divided by the data-parallel degree N once ZeRO partitions it), refined to the
  buffers DeepSpeed really allocates, read from its source and measured on CPU by
  ``tests/test_memory_validation.py``: ZeRO-1/2/3 keep an fp32 master partition in every precision (in
  fp32 too: a copy beside the parameters), build an fp32 copy of the gradient partition inside
  ``step()``, ZeRO-1 holds every gradient until the end of backward, ZeRO-2/3 a gradient partition plus
  a reduce bucket, ZeRO-3 a persistent bucket and the gathered parameters of the running module.
- **activations**: the tensors autograd saves for backward, per layer, for the attention kernel in use
  (sdpa / flash_attention_2: q, k, v, output and a logsumexp, no s² term; eager: the s² attention
  probabilities), for Llama-style blocks (RMSNorm with an fp32 upcast, RoPE, GQA, SwiGLU) and GPT-2
  blocks (LayerNorm, fused qkv, tanh-GELU, dropout masks), with and without activation checkpointing.
- **logits and loss**: transformers' loss upcasts the logits to fp32 and log-softmax saves an fp32
  MBS x seq x vocab tensor; its gradient is another two.
- **communication buckets**, an **autocast weight cache** (DDP in mixed precision), and an allowance for
  the CUDA context and the allocator.

The terms do not all peak together: gradients grow during backward while activations are freed, and
DeepSpeed's fp32 gradient copy exists only inside ``step()``. The total is the largest of three phase
sums (start of backward, gradient reduction, optimizer step) plus the allowance, not the sum of every
term's own peak. Each term is reported at its own peak.

The estimate is for one data-parallel rank (no tensor or pipeline parallelism).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pretrain.errors import ConfigError
from pretrain.hardware import GpuSpec, custom_gpu, find_gpu, gpu_for_device
from pretrain.launch import Launch, check_offload
from pretrain.shape import COUNTED_ARCHS, ModelShape

__all__ = [
    "CLASSIC_EXAMPLE", "GIB", "ActivationEstimate", "DeepSpeedBuffers", "GpuSpec", "MemoryEstimate", "Term", "Workload",
    "activation_memory", "classic_example_gb", "custom_gpu", "estimate", "estimate_shape", "find_gpu",
    "gpu_for_device", "optimizer_state_bytes",
]

GIB = 2**30

# --------------------------------------------------------------------------------------------------
# The model's shape (pretrain.shape) as the activation formulas see it


_TANH_GELU_EAGER = {"gelu_new", "gelu_fast", "gelu_python_tanh"}
"""Activations that transformers computes op by op (tanh approximation): they save 3 more tensors."""
ESTIMATED_ARCHS = COUNTED_ARCHS
"""Block layouts the activation formulas follow (Llama-style and GPT-2)."""


# --------------------------------------------------------------------------------------------------
# What is trained and how it is laid out


_PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

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
    activation_checkpointing: bool = False
    grad_accum_steps: int | None = None
    global_batch_size: int | None = None

    def __post_init__(self):
        if self.precision not in _PRECISION_BYTES:
            raise ConfigError(f"precision {self.precision!r}: use one of fp32, bf16, fp16")
        if self.attention not in ("sdpa", "eager", "flash_attention_2"):
            raise ConfigError(f"attention {self.attention!r}: use one of sdpa, eager, flash_attention_2")
        if self.micro_batch_size < 1 or self.seq_len < 1:
            raise ConfigError(
                f"micro batch size ({self.micro_batch_size}) and seq_len ({self.seq_len}) must be >= 1"
            )

    @classmethod
    def from_recipe(cls, recipe, plan) -> Workload:
        return cls(
            precision=recipe.precision.dtype,
            optimizer=recipe.optim.name,
            optimizer_args=dict(recipe.optim.args),
            micro_batch_size=plan.micro_batch_size,
            seq_len=plan.seq_len,
            attention=recipe.model.attention,
            activation_checkpointing=recipe.model.activation_checkpointing,
            grad_accum_steps=plan.grad_accum_steps,
            global_batch_size=plan.global_batch_size,
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


# --------------------------------------------------------------------------------------------------
# Terms


@dataclass(frozen=True)
class Term:
    key: str
    label: str
    bytes: int
    formula: str
    """The formula with the numbers put in."""

    @property
    def gib(self) -> float:
        return self.bytes / GIB


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:,.2f} GiB"


def _n(x: int) -> str:
    return f"{x:,}"


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes autograd saves for backward in one micro-step, split the way the validation measures them."""

    saved_bytes: int
    """Tensors saved for backward by the forward pass (the transformer blocks and the rest), logits excluded."""
    recompute_bytes: int
    """Activation checkpointing only: one block's activations, rebuilt during backward."""
    logits_saved_bytes: int
    """fp32 log-softmax output saved by the cross-entropy (MBS x seq x vocab x 4 B)."""
    logits_peak_bytes: int
    """All logits-sized tensors alive at once at the start of backward (the logits the model returns,
    the saved fp32 log-softmax, and its incoming and outgoing fp32 gradients)."""
    per_layer_bytes: int
    """One block's saved tensors without checkpointing."""
    lines: tuple[str, ...]

    @property
    def activation_bytes(self) -> int:
        return self.saved_bytes + self.recompute_bytes


def activation_memory(shape: ModelShape, micro_batch_size: int, seq_len: int, precision: str,
                      attention: str = "sdpa", checkpointing: bool = False, device: str = "cuda") -> ActivationEstimate:
    """Saved-for-backward bytes of one micro-batch, from the per-block formula of the architecture.

    b is the activation dtype's size (2 in bf16/fp16: DeepSpeed runs the model in that dtype; 4 in fp32),
    T = MBS x seq tokens, d hidden, q = heads x head_dim, k = kv_heads x head_dim, f MLP width, h heads.
    ``device`` matters for dropout only: CUDA saves a 1-byte mask and its fused SDPA kernels apply attention
    dropout themselves; on CPU dropout saves a mask in the activation dtype and SDPA with attention
    dropout falls back to the math kernel (s^2 terms, like eager).
    """
    b = _PRECISION_BYTES[precision]
    mask = 1 if device == "cuda" else b
    B, s = micro_batch_size, seq_len
    T = B * s
    d, f, h, L, V = shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.num_layers, shape.vocab_size
    q, k = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    lines = [f"T = MBS x seq = {B} x {s} = {_n(T)} tokens, b = {b} B ({precision}), d = {d}, f = {f}, h = {h}"]
    eager = attention == "eager" or (device != "cuda" and shape.attn_dropout > 0)
    probs = B * h * s * s
    attn_dropout = probs * (mask + b) if eager and shape.attn_dropout > 0 else 0
    if shape.family == "llama":
        norm = 4 * T * d + 4 * T + 2 * b * T * d
        norm_text = "RMSNorm 4Td (fp32 input) + 4T (1/rms) + 2bTd (normalised, weighted)"
        if eager:
            softmax_bytes = 4 + (b if b != 4 else 0)  # softmax in fp32, then cast back for the matmul with v
            attn = 4 * b * T * q + softmax_bytes * probs
            attn_text = f"eager attention 4bTq (q, repeated k, v, output) + {softmax_bytes} B x MBS h s^2 (probabilities)"
        else:
            attn = b * (2 * T * q + 2 * T * k) + 4 * T * h
            attn_text = "attention b(2Tq + 2Tk) (q, k, v, output) + 4Th (fp32 logsumexp), no s^2 term"
        mlp_units = 4 + 3 * (shape.hidden_act in _TANH_GELU_EAGER)
        mlp = mlp_units * b * T * f
        mlp_text = f"gated MLP {mlp_units}bTf (gate, up, act(gate), product)"
        dropout = attn_dropout
        rope = 0 if checkpointing else 2 * s * shape.head_dim * b  # inside the checkpointed blocks
        extras_text = "ids and labels 16T" + (", RoPE cos/sin 2 s head_dim b" if rope else "") + ", final RMSNorm"
        extras = 16 * T + rope + norm
    else:
        norm = 2 * b * T * d + 8 * T
        norm_text = "LayerNorm 2bTd (input, output) + 8T (fp32 mean, rstd)"
        if eager:
            attn = 4 * b * T * d + b * probs
            attn_text = "eager attention 4bTd (q, k, v, output) + b MBS h s^2 (probabilities)"
        else:
            attn = 4 * b * T * d + 4 * T * h
            attn_text = "attention 3bTd (fused qkv) + bTd (output) + 4Th (fp32 logsumexp), no s^2 term"
        mlp_units = 2 + 3 * (shape.hidden_act in _TANH_GELU_EAGER)
        mlp = mlp_units * b * T * f
        mlp_text = f"MLP {mlp_units}bTf ({'fc output, tanh, 1 + tanh, x/2, ' if mlp_units == 5 else 'fc output, '}act output)"
        dropout = 2 * T * d * mask * (shape.resid_dropout > 0) + attn_dropout
        # eager builds a 4D float mask (MBS x 1 x s x s) that the checkpointed blocks keep as an input
        causal_mask = B * s * s * b if eager and checkpointing else 0
        extras = 16 * T + 8 * s + T * d * mask * (shape.embd_dropout > 0) + norm + causal_mask
        extras_text = "ids and labels 16T, position ids 8s, final LayerNorm" + (
            f", embedding dropout mask {mask}Td" if shape.embd_dropout > 0 else "") + (
            ", causal mask MBS s^2 b" if causal_mask else "")
    if dropout:
        lines.append(f"dropout masks per block: {_gib(dropout)} ({mask} B per element"
                     + (", attention: mask and dropped probabilities" if attn_dropout else "") + ")")
    per_layer = 2 * norm + attn + mlp + dropout
    lines += [
        f"per block: 2 x {norm_text}",
        f"         + {attn_text}",
        f"         + {mlp_text}",
        f"         = 2 x {_n(norm)} + {_n(attn)} + {_n(mlp)}{f' + {_n(dropout)}' if dropout else ''} = {_n(per_layer)} B",
    ]
    if checkpointing:
        saved = L * b * T * d + extras
        recompute = per_layer
        lines.append(
            f"checkpointing: {L} block inputs x bTd = {_gib(L * b * T * d)} + {extras_text} {_gib(extras)}; "
            f"plus one block recomputed in backward {_gib(recompute)}"
        )
    else:
        saved = L * per_layer + extras
        recompute = 0
        lines.append(f"{L} blocks x {_gib(per_layer)} + {extras_text} {_gib(extras)}")
    logits_saved = 4 * T * V
    logits_peak = (b + 12) * T * V
    return ActivationEstimate(saved, recompute, logits_saved, logits_peak, per_layer, tuple(lines))


# --------------------------------------------------------------------------------------------------
# The estimate


@dataclass(frozen=True)
class MemoryEstimate:
    num_params: int
    shape: ModelShape
    workload: Workload
    layout: Launch
    buffers: DeepSpeedBuffers
    terms: dict[str, Term]
    phases: dict[str, int]
    """Bytes alive at once in each phase: start of backward, gradient reduction, optimizer step."""
    allowance: Term
    host: dict[str, Term]
    """Host memory per rank that offload needs (pinned), by term."""
    gpu: GpuSpec | None
    activations: ActivationEstimate
    model_state_bytes: int
    """Parameters, gradients, optimizer states and the reduce buckets DeepSpeed keeps, at their joint peak
    (what tests/test_memory_validation.py compares with the tensors DeepSpeed really holds)."""
    notes: tuple[str, ...] = ()

    # ---- totals

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def total_bytes(self) -> int:
        return max(self.phases.values()) + self.allowance.bytes

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def other_bytes(self) -> int:
        return sum(t.bytes for k, t in self.terms.items() if k not in _MAIN_TERMS) + self.allowance.bytes

    @property
    def host_bytes_per_rank(self) -> int:
        return sum(t.bytes for t in self.host.values())

    @property
    def host_bytes_per_node(self) -> int:
        return self.host_bytes_per_rank * self.layout.gpus_per_node

    @property
    def gpu_memory_gib(self) -> float | None:
        return self.gpu.memory_gib if self.gpu else None

    @property
    def headroom_gib(self) -> float | None:
        return None if self.gpu is None else self.gpu.memory_gib - self.total_gib

    @property
    def fits(self) -> bool | None:
        return None if self.gpu is None else self.total_gib <= self.gpu.memory_gib

    @property
    def verdict(self) -> str:
        if self.gpu is None:
            return "no device capacity given"
        room = self.headroom_gib
        if room < 0:
            return f"does not fit: needs {-room:,.1f} GiB more than the {self.gpu.name}'s {self.gpu.memory_gib:,.1f} GiB"
        if room < 0.05 * self.gpu.memory_gib:
            return f"fits, tight: {room:,.1f} GiB headroom (< 5% of {self.gpu.memory_gib:,.1f} GiB)"
        return f"fits: {room:,.1f} GiB headroom on the {self.gpu.name} ({self.gpu.memory_gib:,.1f} GiB)"

    # ---- output

    def to_json(self) -> dict[str, Any]:
        t = self.terms
        per_device = {
            "params_gib": t["params"].gib,
            "grads_gib": t["grads"].gib,
            "optimizer_gib": t["optimizer"].gib,
            "activations_gib": t["activations"].gib,
            "other_gib": self.other_bytes / GIB,
            "total_gib": self.total_gib,
        }
        return {
            "num_params": self.num_params,
            "per_device": {k: round(v, 4) for k, v in per_device.items()},
            "gpu_memory_gib": None if self.gpu is None else round(self.gpu.memory_gib, 4),
            "fits": self.fits,
            "headroom_gib": None if self.gpu is None else round(self.headroom_gib, 4),
            "verdict": self.verdict,
            "gpu": None if self.gpu is None else self.gpu.name,
            "other_gib_detail": {k: round(v.gib, 4) for k, v in t.items() if k not in _MAIN_TERMS}
            | {"allowance": round(self.allowance.gib, 4)},
            "phases_gib": {k: round(v / GIB, 4) for k, v in self.phases.items()},
            "peak_phase": self.peak_phase,
            "host_gib_per_rank": round(self.host_bytes_per_rank / GIB, 4),
            "host_gib_per_node": round(self.host_bytes_per_node / GIB, 4),
            "layout": {**asdict(self.layout), "world_size": self.layout.world_size, "description": self.layout.describe()},
            "workload": {k: v for k, v in asdict(self.workload).items() if k != "optimizer_args"},
            "model": {"arch": self.shape.arch, "num_layers": self.shape.num_layers, "hidden_size": self.shape.hidden_size,
                      "vocab_size": self.shape.vocab_size},
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        w = self.workload
        rows = [
            f"model      {self.shape.arch}, {self.num_params:,} parameters ({self.num_params / 1e9:.2f} B)",
            f"layout     {self.layout.describe()}",
            f"workload   {w.precision}, {w.optimizer}, MBS {w.micro_batch_size} x seq {w.seq_len:,}"
            + (f", GAS {w.grad_accum_steps}" if w.grad_accum_steps else "")
            + f", attention {w.attention}, activation checkpointing {'on' if w.activation_checkpointing else 'off'}",
            "",
            "per device".ljust(34) + "GiB",
        ]
        for term in self.terms.values():
            rows.append(f"  {term.label:<32}{term.gib:>8.2f}")
        rows.append(f"  {self.allowance.label:<32}{self.allowance.gib:>8.2f}")
        phases = ", ".join(f"{k} {v / GIB:,.2f}" for k, v in self.phases.items())
        rows.append(f"  {'total (peak)':<32}{self.total_gib:>8.2f}   = max({phases}) + allowance")
        if self.gpu is not None:
            rows.append(f"  {'capacity ' + self.gpu.name:<32}{self.gpu.memory_gib:>8.2f}")
        rows += ["", f"verdict    {self.verdict}"]
        if self.host:
            rows.append(
                f"host       {self.host_bytes_per_rank / GIB:,.2f} GiB per rank, {self.host_bytes_per_node / GIB:,.2f} GiB "
                f"per node ({self.layout.gpus_per_node} ranks) for offload"
            )
        rows += [f"note       {n}" for n in self.notes]
        return "\n".join(rows)

    def explain(self) -> str:
        out = [self.summary(), "", "How each term is computed (Ψ parameters, N data-parallel ranks):", ""]
        out.append(f"Ψ = {self.num_params:,}: {self.shape.formula()}")
        for term in (*self.terms.values(), self.allowance):
            out.append(f"{term.label}: {_gib(term.bytes)}")
            out += [f"    {line}" for line in term.formula.splitlines()]
        if self.host:
            out.append("host memory per rank (offload):")
            out += [f"    {t.label}: {_gib(t.bytes)} = {t.formula}" for t in self.host.values()]
        out.append("activation formula:")
        out += [f"    {line}" for line in self.activations.lines]
        out += ["", CLASSIC_EXAMPLE]
        return "\n".join(out)


_MAIN_TERMS = ("params", "grads", "optimizer", "activations")

CLASSIC_EXAMPLE = """The classic example, "7B in fp32 with Adam: 28 GB weights, 28 GB gradients, 84 GB optimizer states,
140 GB": 7e9 x 4 B = 28 GB of weights and as much of gradients are right, but 84 GB = 12 B/param counts
an fp32 master copy on top of Adam's two states. That copy exists only in mixed precision, where the
weights the model computes with are 2-byte copies (the ZeRO paper's K = 12: 2Ψ + 2Ψ + 12Ψ = 16Ψ). In
fp32 the weights are the master: AdamW keeps exp_avg and exp_avg_sq, 8 B/param = 56 GB, and the model
states are 28 + 28 + 56 = 112 GB (16 B/param either way), before activations, logits and buffers.
accelerate's `estimate-memory` reports the largest of these instead of their sum; DeepSpeed's estimators
stop at the model states."""


def classic_example_gb(num_params: float = 7e9, precision: str = "fp32", state_bytes: int = 8) -> dict[str, float]:
    """Model states in GB (1e9 B) of a single device with Adam-style states: the worked example above."""
    weights = num_params * _PRECISION_BYTES[precision]
    master = num_params * 4 if precision != "fp32" else 0
    return {
        "weights": weights / 1e9,
        "gradients": weights / 1e9,
        "optimizer": (master + num_params * state_bytes) / 1e9,
        "total": (2 * weights + master + num_params * state_bytes) / 1e9,
    }


# --------------------------------------------------------------------------------------------------
# The arithmetic


CUDA_CONTEXT_BYTES = 1 * GIB
"""CUDA context, cuBLAS / cuDNN workspaces and NCCL's communicator buffers: about 0.5-1 GiB on current
GPUs and drivers; counted as 1 GiB."""
ALLOCATOR_FRACTION = 0.05
"""PyTorch's caching allocator rounds blocks up and fragments: 5% of the tensor peak."""


def estimate_shape(shape: ModelShape, workload: Workload, layout: Launch, *,
                   buffers: DeepSpeedBuffers | None = None, gpu: GpuSpec | None = None,
                   device: str = "cuda") -> MemoryEstimate:
    """The per-device estimate for a model shape (the core; ``estimate`` wraps it for a recipe)."""
    check_offload(layout)
    if shape.arch not in ESTIMATED_ARCHS:
        raise ConfigError(
            f"model type {shape.arch!r}: the memory estimator has formulas for {', '.join(ESTIMATED_ARCHS)}"
        )
    if layout.engine == "fsdp":
        raise ConfigError(
            "distributed_type FSDP is not modelled by the estimator (it models DDP and DeepSpeed); "
            "FULL_SHARD keeps about what ZeRO-3 keeps: estimate with --zero 3 instead"
        )
    buffers = buffers or DeepSpeedBuffers()
    w = workload
    P = shape.num_params
    N = layout.world_size
    stage = layout.zero_stage
    bp = _PRECISION_BYTES[w.precision]  # the model's (and its gradients') dtype under DeepSpeed
    bg = bp
    mixed = w.precision != "fp32"
    k_opt, opt_text = optimizer_state_bytes(w.optimizer, w.optimizer_args)
    sizes = shape.param_sizes()
    largest = max(sizes)
    notes: list[str] = []
    if shape.family == "gpt2" and w.seq_len > shape.max_positions:
        raise ConfigError(f"seq_len {w.seq_len} is longer than the model's {shape.max_positions} positions")

    cuda_context = device == "cuda"
    acts = activation_memory(shape, w.micro_batch_size, w.seq_len, w.precision, w.attention, w.activation_checkpointing,
                             device)
    if layout.engine == "ddp" and mixed:
        notes.append("DDP with autocast: activations counted with the bf16/fp16 formula (autocast keeps the residual "
                     "stream and norms in fp32: expect somewhat more)")

    host: dict[str, Term] = {}
    # Gradients and buffers differ by phase (_f: start of backward, _r: gradient reduction, _s: inside
    # step()); a term's own peak is its largest phase value.
    text: dict[str, list[str]] = {"params": [], "grads": [], "optimizer": [], "comm": [], "autocast": []}

    def part(x: int) -> int:
        return -(-x // N)

    if layout.engine == "ddp":
        params = 4 * P
        text["params"].append(f"4 B x Ψ = 4 x {_n(P)} (fp32 weights{'; autocast computes in ' + w.precision if mixed else ''})")
        grads = 4 * P
        text["grads"].append("4 B x Ψ (fp32 gradients)")
        optimizer = k_opt * P
        text["optimizer"].append(f"{k_opt} B x Ψ ({opt_text}); no master copy: the fp32 weights are the master")
        grads_f = grads_r = grads_s = grads
        comm = 4 * P if N > 1 else 0
        text["comm"].append(
            "DDP reducer buckets 4 B x Ψ (gradient_as_bucket_view off: a flat copy of every gradient)" if N > 1
            else "one process: no DDP buckets")
        comm_f = comm_r = comm_s = comm
        autocast = 2 * P if mixed else 0
        if mixed:
            text["autocast"].append(f"2 B x Ψ: autocast's {w.precision} copies of the weights, cached during forward")
        model_states_peak = params + optimizer + grads + comm
    else:
        autocast = 0
        off_opt = layout.offload_optimizer != "none"
        off_par = layout.offload_params != "none"
        R = buffers.reduce_bucket_size
        overlap = buffers.overlap_comm if buffers.overlap_comm is not None else stage == 3
        num_buckets = 2 if (overlap and stage in (1, 2)) else 1
        bucket = (num_buckets * R * bg) if buffers.contiguous_gradients or stage == 3 else 0
        bucket_text = f"{num_buckets} x reduce_bucket_size {_n(R)} x {bg} B"
        pending = largest * bg if largest > R else 0
        pending_text = (f" + the largest parameter's gradient {_n(largest)} x {bg} B (larger than the bucket, "
                        f"reduced on its own)") if pending else ""
        if stage == 0:
            params = bp * P
            text["params"].append(f"{bp} B x Ψ = {bp} x {_n(P)} ({w.precision}, replicated)")
            master = 4 * P if mixed else 0
            optimizer = master + k_opt * P
            text["optimizer"].append(
                ("fp32 master 4 B x Ψ + " if mixed else "")
                + f"{k_opt} B x Ψ ({opt_text})" + ("" if mixed else "; fp32: the weights are the master"))
            grads_f = grads_r = bg * P
            grads_s = bg * P + (4 * P if mixed else 0)
            text["grads"].append(
                f"{bg} B x Ψ (replicated)" + (f"; inside step() DeepSpeed adds fp32 copies 4 B x Ψ: {_gib(grads_s)}"
                                               if mixed else ""))
            flatten = min(P, buffers.allreduce_bucket_size) * bg if N > 1 else 0
            comm_f, comm_r, comm_s = 0, flatten, 0
            text["comm"].append(
                f"all-reduce flat buffer after backward: min(Ψ, {_n(buffers.allreduce_bucket_size)}) x {bg} B" if N > 1
                else "one rank: no all-reduce")
            model_states_peak = params + optimizer + max(grads_f, grads_s)
        elif stage in (1, 2):
            params = bp * P
            text["params"].append(f"{bp} B x Ψ = {bp} x {_n(P)} ({w.precision}, replicated: ZeRO-{stage} keeps all weights)")
            master, states = 4 * part(P), k_opt * part(P)
            optimizer = 0 if off_opt else master + states
            if off_opt:
                text["optimizer"].append(f"0 on the GPU: master and states are offloaded to {layout.offload_optimizer}")
                host["master"] = Term("master", "fp32 master partition", master, f"4 B x Ψ/N = 4 x {_n(part(P))}")
                host["optimizer_states"] = Term("optimizer_states", "optimizer states", states,
                                                f"{k_opt} B x Ψ/N ({opt_text})")
                host["grads"] = Term("grads", "fp32 gradient partition", 4 * part(P), "4 B x Ψ/N")
                host["bit16"] = Term("bit16", f"{w.precision} copy of the partition", bp * part(P), f"{bp} B x Ψ/N")
                host["accumulated"] = Term("accumulated", "accumulated gradients", bg * part(P), f"{bg} B x Ψ/N")
            else:
                text["optimizer"].append(
                    f"fp32 master partition 4 B x Ψ/N + {k_opt} B x Ψ/N ({opt_text}) = {4 + k_opt} B x "
                    f"{_n(P)} / {N}" + ("; in fp32 too: DeepSpeed clones the partition" if not mixed else ""))
            if stage == 1:
                grads_f = grads_r = bg * P
                text["grads"].append(
                    f"backward: {bg} B x Ψ (ZeRO-1 reduces only after the last micro-step's backward: every gradient "
                    f"is full size until then)")
            else:
                grads_f = grads_r = (0 if off_opt else bg * part(P)) + pending + (largest * bp if off_opt else 0)
                text["grads"].append(
                    f"backward: {bg} B x Ψ/N partition{pending_text}" if not off_opt else
                    f"backward: a {bp} B staging buffer of the largest parameter {_n(largest)}{pending_text}; the "
                    "partition goes to the host")
            grads_s = 0 if off_opt else 4 * part(P)
            text["grads"].append(
                f"step(): fp32 copy of the partition 4 B x Ψ/N = {_gib(4 * part(P))} (the {w.precision} partition is "
                f"freed first)" if not off_opt else "step(): on the host")
            comm_f = comm_r = bucket
            comm_s = 0
            text["comm"].append(f"ipg reduce bucket {bucket_text}, allocated for backward; the all-gather after "
                                "step() writes into the parameters in place")
            model_states_peak = params + optimizer + max(grads_f + comm_f, grads_s)
        else:  # ZeRO-3
            threshold = buffers.stage3_param_persistence_threshold
            persistent = sum(x for x in sizes if x <= threshold)
            params = (0 if off_par else bp * part(P)) + bp * persistent
            text["params"].append(
                (f"{bp} B x Ψ/N = {bp} x {_n(P)} / {N}" if not off_par else f"partitions offloaded to {layout.offload_params}")
                + f" + persistent (<= {_n(threshold)} elements, kept whole) {bp} B x {_n(persistent)}")
            if off_par:
                host["params"] = Term("params", f"{w.precision} parameter partition", bp * part(P), f"{bp} B x Ψ/N")
            master, states = 4 * part(P), k_opt * part(P)
            optimizer = 0 if off_opt else master + states
            sub = min(part(P), buffers.sub_group_size + part(largest))
            if off_opt:
                text["optimizer"].append(f"0 on the GPU: master and states are offloaded to {layout.offload_optimizer}")
                where = "host" if layout.offload_optimizer == "cpu" else "NVMe"
                host["master"] = Term("master", f"fp32 master partition ({where})", master, "4 B x Ψ/N")
                host["optimizer_states"] = Term("optimizer_states", f"optimizer states ({where})", states,
                                                f"{k_opt} B x Ψ/N ({opt_text})")
                host["grads"] = Term("grads", "gradient partition + fp32 copy of a sub-group", bg * part(P) + 4 * sub,
                                     f"{bg} B x Ψ/N + 4 B x min(Ψ/N, sub_group_size)")
                if layout.offload_optimizer == "nvme":
                    host.pop("master")
                    host.pop("optimizer_states")
                    notes.append(f"NVMe holds the master and optimizer states: {_gib(master + states)} per rank")
            else:
                text["optimizer"].append(f"fp32 master partition 4 B x Ψ/N + {k_opt} B x Ψ/N ({opt_text})")
            grads_f = grads_r = (0 if off_opt else bg * part(P)) + pending
            grads_s = 0 if off_opt else bg * part(P) + 4 * sub
            text["grads"].append(
                f"backward: {bg} B x Ψ/N flat gradient partition{pending_text}" if not off_opt
                else f"backward: partitions go to the host{pending_text}")
            if not off_opt:
                text["grads"].append(
                    f"step(): + fp32 copy of one sub-group 4 B x min(Ψ/N, sub_group_size {_n(buffers.sub_group_size)}) "
                    f"= {_gib(4 * sub)}")
            module = max(shape.block_params, shape.vocab_size * shape.hidden_size)
            live = min(buffers.stage3_max_live_parameters, module + buffers.stage3_prefetch_bucket_size)
            gathered = live * bp
            comm_f = comm_r = bucket + gathered
            comm_s = bucket
            text["comm"].append(
                f"persistent reduce bucket {bucket_text} + gathered parameters min(max_live "
                f"{_n(buffers.stage3_max_live_parameters)}, largest module {_n(module)} + prefetch "
                f"{_n(buffers.stage3_prefetch_bucket_size)}) x {bp} B")
            model_states_peak = params + optimizer + max(grads_f + bucket, grads_s + bucket)
        if off_opt and layout.offload_optimizer == "cpu" and stage in (1, 2):
            host["staging"] = Term("staging", "gradient staging buffer", largest * bp, f"{bp} B x largest parameter")

    grads = max(grads_f, grads_r, grads_s)
    comm = max(comm_f, comm_r, comm_s)
    activations = acts.activation_bytes
    logits = acts.logits_peak_bytes
    phase_f = params + optimizer + grads_f + comm_f + activations + logits + autocast
    phase_r = params + optimizer + grads_r + comm_r
    phase_s = params + optimizer + grads_s + comm_s
    phases = {"backward": phase_f, "reduction": phase_r, "step": phase_s}
    tensor_peak = max(phases.values())
    allowance_bytes = (CUDA_CONTEXT_BYTES if cuda_context else 0) + int(ALLOCATOR_FRACTION * tensor_peak)
    allowance = Term(
        "allowance", "CUDA context + allocator", allowance_bytes,
        (f"{_gib(CUDA_CONTEXT_BYTES)} CUDA context, cuBLAS and NCCL workspaces + " if cuda_context else "")
        + f"{ALLOCATOR_FRACTION:.0%} of the tensor peak {_gib(tensor_peak)} (allocator rounding, fragmentation)")

    b = _PRECISION_BYTES[w.precision]
    V = shape.vocab_size
    T = w.micro_batch_size * w.seq_len
    terms = {
        "params": Term("params", "parameters", params, "\n".join(text["params"])),
        "grads": Term("grads", "gradients", grads, "\n".join(text["grads"])),
        "optimizer": Term("optimizer", "optimizer states (+ fp32 master)", optimizer, "\n".join(text["optimizer"])),
        "activations": Term(
            "activations", "activations", activations,
            f"saved for backward {_gib(acts.saved_bytes)}"
            + (f" + one block recomputed {_gib(acts.recompute_bytes)}" if acts.recompute_bytes else "")
            + " (formula below)"),
        "logits": Term(
            "logits", "logits and loss", logits,
            f"T x V x ({b} B logits kept in the output + 4 B fp32 log-softmax saved + 4 + 4 B its gradients) "
            f"= {_n(T)} x {_n(V)} x {b + 12}"),
        "comm": Term("comm", "communication buffers", comm, "\n".join(text["comm"])),
    }
    if autocast:
        terms["autocast"] = Term("autocast", "autocast weight cache", autocast, "\n".join(text["autocast"]))
    est = MemoryEstimate(
        num_params=P, shape=shape, workload=w, layout=layout, buffers=buffers, terms=terms, phases=phases,
        allowance=allowance, host=host, gpu=gpu, activations=acts, model_state_bytes=model_states_peak,
        notes=tuple(notes),
    )
    return est


def estimate(recipe, plan, layout: Launch, *, gpu: GpuSpec | None = None, buffers: DeepSpeedBuffers | None = None,
             device: str = "cuda") -> MemoryEstimate:
    """Per-device memory of ``recipe`` run with ``plan`` (its MBS and seq_len) on ``layout``.

    ``buffers`` defaults to the recipe's ``deepspeed`` section over DeepSpeed's defaults. ``device="cpu"``
    drops the CUDA-context allowance and uses CPU dropout masks. The trainer logs ``total_gib`` as
    ``memory/estimated_gib`` beside the measured ``memory/peak_gib``.
    """
    if plan.world_size != layout.world_size:
        raise ConfigError(
            f"the batch plan is for {plan.world_size} processes but the layout has {layout.world_size} "
            f"({layout.num_nodes} x {layout.gpus_per_node})"
        )
    shape = ModelShape.from_recipe(recipe, plan.seq_len)
    return estimate_shape(
        shape, Workload.from_recipe(recipe, plan), layout,
        buffers=buffers or DeepSpeedBuffers.from_recipe(recipe), gpu=gpu, device=device,
    )
