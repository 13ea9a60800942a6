"""The estimate: model states, activations and buffers summed by phase, plus an allowance; its report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from pretrain.distributed.layout import Launch, check_offload, compile_choice
from pretrain.errors import ConfigError
from pretrain.plan.memory import calibration
from pretrain.plan.memory.activations import ActivationEstimate, activation_memory, activation_terms
from pretrain.plan.memory.parallel import (
    all_to_all_term,
    check_context_parallel,
    expert_parallel,
    float8_term,
    tensor_parallel,
)
from pretrain.plan.memory.states import AUTOCAST_NOTE, CLASSIC_EXAMPLE, model_states
from pretrain.plan.memory.terms import GIB, PHASES, Term, gib
from pretrain.plan.memory.workload import PRECISION_BYTES, DeepSpeedBuffers, Workload
from pretrain.recipe.shape import COUNTED_ARCHS, ModelShape
from pretrain.system.hardware import GpuSpec

ESTIMATED_ARCHS = COUNTED_ARCHS
"""Block layouts the activation formulas follow (Llama-style and GPT-2)."""
CUDA_CONTEXT_BYTES = 1 * GIB
"""CUDA context, cuBLAS / cuDNN workspaces and NCCL's communicator buffers: about 0.5-1 GiB on current
GPUs and drivers; counted as 1 GiB."""
ALLOCATOR_FRACTION = 0.05
"""PyTorch's caching allocator rounds blocks up and fragments: 5% of the tensor peak."""
CHECKPOINT_STAGING = "checkpoint"
"""The host term of checkpoint.async's copy (``checkpoint_staging``)."""
_MAIN_TERMS = ("params", "grads", "optimizer", "activations")
_ONLY_AT_BACKWARD = ("activations", "logits", "autocast", "float8")
"""Terms alive at the start of backward only (freed by the time gradients are reduced)."""


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
    (what tests/plan/test_memory_validation.py compares with the tensors DeepSpeed really holds)."""
    notes: tuple[str, ...] = ()

    # ---- totals

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def tensor_peak_bytes(self) -> int:
        """The tensors alive at the peak phase, without the allowance: what ``torch.cuda.max_memory_allocated``
        measures (the CUDA context and the allocator's rounding and fragmentation are outside it)."""
        return max(self.phases.values())

    @property
    def tensor_peak_gib(self) -> float:
        return self.tensor_peak_bytes / GIB

    @property
    def total_bytes(self) -> int:
        return self.tensor_peak_bytes + self.allowance.bytes

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
    def host_purpose(self) -> str:
        staging = CHECKPOINT_STAGING in self.host
        offload = len(self.host) > staging
        return " and ".join(what for what, used in (("offload", offload), ("checkpoint.async", staging)) if used)

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
            "num_active_params": self.shape.num_active_params,
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
            f"model      {self.shape.arch}, {self.num_params:,} parameters ({self.num_params / 1e9:.2f} B)"
            + (f", {self.shape.num_active_params:,} active per token ({self.shape.num_active_params / 1e9:.2f} B)"
               if self.shape.num_experts else ""),
            f"layout     {self.layout.describe()}",
            f"workload   {w.precision}, {w.optimizer}, MBS {w.micro_batch_size} x seq {w.seq_len:,}"
            + (f", GAS {w.grad_accum_steps}" if w.grad_accum_steps else "")
            + (", reduced after every micro-batch" if w.sync_each_micro_batch and (w.grad_accum_steps or 1) > 1
               and not self.layout.uses_deepspeed else "")
            + f", attention {w.attention}, activation checkpointing {w.activation_checkpointing}"
            + (f", float8 {w.float8}" if w.float8 != "off" else "")
            + (f" (each rank: seq / CP {self.layout.cp_size} = {w.seq_len // self.layout.cp_size:,} tokens per sequence)"
               if self.layout.cp_size > 1 else ""),
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
                f"per node ({self.layout.gpus_per_node} ranks) for {self.host_purpose}"
            )
        rows += [f"note       {n}" for n in self.notes]
        return "\n".join(rows)

    def explain(self) -> str:
        out = [self.summary(), "", "How each term is computed (Ψ parameters, N data-parallel ranks"
               + (", Ψ_TP one TP rank's parameters" if self.layout.tp_size > 1 else "")
               + (", Ψ_EP the parameters one EP rank unshards" if self.layout.ep_size > 1 else "") + "):", ""]
        out.append(f"Ψ = {self.num_params:,}: {self.shape.formula()}")
        for term in (*self.terms.values(), self.allowance):
            out.append(f"{term.label}: {gib(term.bytes)}")
            out += [f"    {line}" for line in term.formula.splitlines()]
        if self.host:
            out.append(f"host memory per rank ({self.host_purpose}):")
            out += [f"    {t.label}: {gib(t.bytes)} = {t.formula}" for t in self.host.values()]
        out.append("activation formula:")
        out += [f"    {line}" for line in self.activations.lines]
        out += ["", CLASSIC_EXAMPLE]
        return "\n".join(out)


def checkpoint_staging(states) -> Term:
    """checkpoint.async: the host copy of what this rank's checkpoint holds, taken while the loop waits and
    written in the background (pretrain/checkpoint/background.py): its parameters and optimizer states, wherever
    they live (on the device, or offloaded to the host). The worst rank is counted: rank 0, which also writes
    the replicated model under DDP and ZeRO-1/2."""
    parts = [states.params, states.optimizer,
             *(t for k, t in states.host.items() if k in ("params", "master", "optimizer_states"))]
    return Term(CHECKPOINT_STAGING, "checkpoint copy (checkpoint.async)", sum(t.bytes for t in parts),
                " + ".join(f"{t.label} {gib(t.bytes)}" for t in parts if t.bytes)
                + ": one copy of this rank's checkpoint states, written in the background")


def estimate_shape(shape: ModelShape, workload: Workload, layout: Launch, *,
                   buffers: DeepSpeedBuffers | None = None, gpu: GpuSpec | None = None,
                   device: str = "cuda", async_checkpoint: bool = False, calibrated: bool = True) -> MemoryEstimate:
    """The per-device estimate for a model shape (the core; ``estimate`` wraps it for a recipe).
    ``async_checkpoint``: checkpoint.async, whose host copy is a host term. ``calibrated``: on CUDA, the activations
    term scaled by its calibration (calibration.py: compiled blocks save fewer tensors than the eager formula
    counts); False gives the formula (what tools/calibrate_memory.py fits against)."""
    check_offload(layout)
    if shape.arch not in ESTIMATED_ARCHS:
        raise ConfigError(
            f"model type {shape.arch!r}: the memory estimator has formulas for {', '.join(ESTIMATED_ARCHS)}"
        )
    buffers = buffers or DeepSpeedBuffers()
    w = workload
    if shape.arch == "gpt2" and w.seq_len > shape.max_positions:  # learned positions
        raise ConfigError(f"seq_len {w.seq_len} is longer than the model's {shape.max_positions} positions")
    states = model_states(shape, w, layout, buffers)
    notes = states.notes
    # TP splits the blocks' attention and MLP tensors, CP the sequence: one rank's activations are those of seq / CP
    # tokens with heads and MLP width / TP (pretrain/plan/memory/parallel.py)
    check_context_parallel(w.seq_len, layout.cp_size, w.attention, w.document_masking)
    tp = tensor_parallel(shape, layout.tp_size)
    local = replace(w, seq_len=w.seq_len // layout.cp_size)
    acts = activation_memory(shape, local.micro_batch_size, local.seq_len, w.precision, w.attention,
                             w.activation_checkpointing, device, document_masking=w.document_masking,
                             tp_size=tp.size if tp is not None and tp.splits_activations else 1)
    activations, logits = activation_terms(acts, shape, local, layout)
    if calibrated and device == "cuda":
        mode = compile_choice(w.compile, device, layout)[0]
        fitted = calibration.factor(mode, w.activation_checkpointing, w.precision, w.float8, layout.engine)
        if fitted.rows:
            activations = replace(activations, bytes=int(activations.bytes * fitted.value),
                                  formula=f"({activations.formula}) {fitted.text}")
            # the calibration replaces the DDP-with-autocast caveat (its rows ran autocast)
            notes = tuple(n for n in notes if not n.startswith(AUTOCAST_NOTE)) + (f"activations {fitted.text}",)
    float8 = float8_term(w.float8, shape, local.micro_batch_size * local.seq_len, tp)
    # EP: the tokens' all-to-all buffers (pretrain/plan/memory/parallel.py)
    all_to_all = all_to_all_term(shape, local.micro_batch_size * local.seq_len, PRECISION_BYTES[w.precision],
                                 expert_parallel(shape, layout.ep_size))
    terms = {t.key: t for t in (states.params, states.grads, states.optimizer, activations, logits, states.comm,
                                all_to_all, states.accumulate, states.autocast, float8) if t is not None}
    # The terms do not all peak together: each phase sums what is alive in it.
    phases = {phase: sum(t.at(phase) for t in terms.values() if phase == "backward" or t.key not in _ONLY_AT_BACKWARD)
              for phase in PHASES}
    tensor_peak = max(phases.values())
    cuda_context = device == "cuda"
    allowance = Term(
        "allowance", "CUDA context + allocator",
        (CUDA_CONTEXT_BYTES if cuda_context else 0) + int(ALLOCATOR_FRACTION * tensor_peak),
        (f"{gib(CUDA_CONTEXT_BYTES)} CUDA context, cuBLAS and NCCL workspaces + " if cuda_context else "")
        + f"{ALLOCATOR_FRACTION:.0%} of the tensor peak {gib(tensor_peak)} (allocator rounding, fragmentation)")
    return MemoryEstimate(
        num_params=shape.num_params, shape=shape, workload=w, layout=layout, buffers=buffers, terms=terms,
        phases=phases, allowance=allowance, gpu=gpu, activations=acts,
        host={**states.host, **({CHECKPOINT_STAGING: checkpoint_staging(states)} if async_checkpoint else {})},
        model_state_bytes=states.peak, notes=notes,
    )


def estimate(recipe, plan, layout: Launch, *, gpu: GpuSpec | None = None, buffers: DeepSpeedBuffers | None = None,
             device: str = "cuda", loss: str | None = None, calibrated: bool = True) -> MemoryEstimate:
    """Per-device memory of ``recipe`` run with ``plan`` (its MBS and seq_len) on ``layout``.

    ``buffers`` defaults to the recipe's ``deepspeed`` section over DeepSpeed's defaults. ``device="cpu"``
    drops the CUDA-context allowance and uses CPU dropout masks. ``loss``: model.loss as the run resolved it
    (``Workload.from_recipe``: without it ``auto`` counts as chunked). The trainer logs ``total_gib`` as
    ``memory/estimated_gib`` and ``tensor_peak_gib`` as ``memory/estimated_tensors_gib`` beside the measured
    ``memory/peak_gib``.
    """
    layout = layout.for_recipe(recipe)  # model.moe.ep_size: the recipe's, as the launch takes it
    if plan.world_size != layout.data_parallel_size:  # TP and CP ranks share their micro-batches
        raise ConfigError(
            f"the batch plan is for {plan.world_size} data-parallel ranks but the layout has {layout.data_parallel_size} "
            f"({layout.num_nodes} x {layout.gpus_per_node} over TP {layout.tp_size} x CP {layout.cp_size})"
        )
    shape = ModelShape.from_recipe(recipe, plan.seq_len)
    return estimate_shape(
        shape, Workload.from_recipe(recipe, plan, loss), layout,
        buffers=buffers or DeepSpeedBuffers.from_recipe(recipe), gpu=gpu, device=device,
        async_checkpoint=recipe.checkpoint.async_, calibrated=calibrated,
    )
