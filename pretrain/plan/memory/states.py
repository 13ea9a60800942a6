"""Model states per rank, per engine: parameters, gradients, optimizer states and communication buffers.

One function per engine (PyTorch DDP, DeepSpeed ZeRO-0, ZeRO-1/2, ZeRO-3, FSDP), each returning its terms
with the formula that produced them, by phase where they change (``Phases``), the host memory offload
needs, and the joint peak of the model states (what ``tests/plan/test_memory_validation.py`` compares with
the tensors DeepSpeed really holds). Ψ is the parameter count, N the ranks the states are divided over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.plan.memory.parallel import expert_parallel, tensor_parallel
from pretrain.plan.memory.terms import PHASES, Phases, Term, gib, num
from pretrain.plan.memory.workload import PRECISION_BYTES, DeepSpeedBuffers, Workload, optimizer_state_bytes
from pretrain.recipe.shape import ModelShape

_LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states (+ fp32 master)",
           "comm": "communication buffers"}  # fmt: skip


def _term(key: str, value: int | Phases, *lines: str) -> Term:
    formula = "\n".join(lines)
    if isinstance(value, Phases):
        return Term.phased(key, _LABELS[key], value, formula)
    return Term(key, _LABELS[key], value, formula)


@dataclass(frozen=True)
class ModelStates:
    params: Term
    grads: Term
    optimizer: Term
    comm: Term
    peak: int
    """Parameters, gradients, optimizer states and the buffers the engine keeps, at their joint peak."""
    autocast: Term | None = None
    host: dict[str, Term] = field(default_factory=dict)
    """Host memory per rank that offload needs (pinned), by term."""
    notes: tuple[str, ...] = ()
    accumulate: Term | None = None
    """One process and DDP: the largest gradient's transient when it is added to the one already there."""


@dataclass(frozen=True)
class _Run:
    """What every engine's arithmetic starts from."""

    shape: ModelShape
    workload: Workload
    layout: Launch

    @cached_property
    def P(self) -> int:
        return self.shape.num_params

    @property
    def N(self) -> int:
        return self.layout.world_size

    @property
    def b(self) -> int:
        """Bytes of the dtype the model computes in (and DeepSpeed keeps its weights and gradients in)."""
        return PRECISION_BYTES[self.workload.precision]

    @property
    def mixed(self) -> bool:
        return self.workload.precision != "fp32"

    @property
    def a(self) -> int:
        """Bytes of the dtype DeepSpeed ZeRO-1/2/3 accumulates gradients in: fp32 for bf16 recipes
        (``data_types.grad_accum_dtype``), the compute dtype otherwise."""
        return 4 if self.workload.fp32_grads else self.b

    @property
    def optimizer(self) -> tuple[int, str]:
        return optimizer_state_bytes(self.workload.optimizer, self.workload.optimizer_args)

    def part(self, x: int, ranks: int | None = None) -> int:
        """One rank's partition of ``x`` elements."""
        return -(-x // (ranks or self.N))


def model_states(shape: ModelShape, workload: Workload, layout: Launch, buffers: DeepSpeedBuffers) -> ModelStates:
    run = _Run(shape, workload, layout)
    if layout.engine == "ddp":
        return ddp_states(run)
    if layout.engine == "fsdp":
        return fsdp_states(run)
    return (zero0_states, zero12_states, zero12_states, zero3_states)[layout.zero_stage](run, buffers)


# ---- PyTorch DDP ----------------------------------------------------------------------------------


AUTOCAST_NOTE = "DDP with autocast:"


def ddp_states(run: _Run) -> ModelStates:
    """fp32 weights, gradients and optimizer states, replicated; the reducer's buckets; autocast's cache."""
    P, N, w, mixed = run.P, run.N, run.workload, run.mixed
    k, opt_text = run.optimizer
    params = _term("params", 4 * P, f"4 B x Ψ = 4 x {num(P)} (fp32 weights"
                                    f"{'; autocast computes in ' + w.precision if mixed else ''})")
    grad_phases, grads_text, added = _ddp_grads(run)
    grads = _term("grads", grad_phases, grads_text)
    optimizer = _term("optimizer", k * P, f"{k} B x Ψ ({opt_text}); no master copy: the fp32 weights are the master")
    comm = _term("comm", Phases.constant(4 * P if N > 1 else 0),
                 "DDP reducer buckets 4 B x Ψ (gradient_as_bucket_view off: a flat copy of every gradient)" if N > 1
                 else "one process: no DDP buckets")
    peak = params.bytes + optimizer.bytes + grads.bytes + comm.bytes
    if not mixed:
        return ModelStates(params, grads, optimizer, comm, peak, accumulate=added)
    autocast = Term("autocast", "autocast weight cache", 2 * P,
                    f"2 B x Ψ: autocast's {w.precision} copies of the weights, cached during forward")
    note = (f"{AUTOCAST_NOTE} activations counted with the bf16/fp16 formula (autocast keeps the residual "
            "stream and norms in fp32: expect somewhat more)")
    return ModelStates(params, grads, optimizer, comm, peak, autocast, notes=(note,), accumulate=added)


def _ddp_grads(run: _Run) -> tuple[Phases, str, Term | None]:
    """fp32 gradients by phase, one process or DDP. The trainer's ``zero_grad(set_to_none=True)`` frees them after
    every step, so at GAS 1 none is alive when backward starts and backward frees activations as it makes them:
    the backward phase holds none, the end of backward all of them (measured on an H100: llama-3b at MBS 1 peaks at
    49.43 GiB, below params + gradients + optimizer states + autocast copies alone, 53.9 GiB; docs/performance.md).
    Past the first micro-step (GAS > 1) the earlier ones' gradients are alive throughout. A gradient added to one
    already there (every micro-step after the first; at GAS 1 the tied embedding's onto the LM head's) exists
    beside it until AccumulateGrad adds it in place: the largest one is a transient at the end of backward.
    ``grad_accum_steps`` unknown (None): counted as alive throughout."""
    P, w, shape = run.P, run.workload, run.shape
    largest = max(shape.param_sizes())
    first_only = w.grad_accum_steps == 1
    added = None
    if not first_only or shape.tie_embeddings:
        added = Term.phased("accumulate", "gradient added in place", Phases(0, 4 * largest, 0),
                            f"4 B x {num(largest)}, the largest parameter's new gradient beside the one it is added to "
                            + ("(the tied embedding's onto the LM head's), " if first_only else "(every micro-step "
                               "after the first), ") + "at the end of backward")
    if first_only:
        return (Phases(0, 4 * P, 4 * P), "4 B x Ψ (fp32 gradients); GAS 1: none alive when backward starts "
                "(zero_grad(set_to_none=True) freed the last step's), all of them when it ends", added)
    return Phases.constant(4 * P), "4 B x Ψ (fp32 gradients)", added


# ---- DeepSpeed ZeRO ------------------------------------------------------------------------------
# The ZeRO paper's accounting (2Ψ + 2Ψ + KΨ, partitioned by stage) refined to the buffers DeepSpeed
# allocates: an fp32 master partition in every precision, an fp32 copy of the gradient partition inside
# step(), reduce buckets, and under ZeRO-3 the gathered parameters of the running module.


def zero0_states(run: _Run, buffers: DeepSpeedBuffers) -> ModelStates:
    P, N, b, mixed, w = run.P, run.N, run.b, run.mixed, run.workload
    k, opt_text = run.optimizer
    params = _term("params", b * P, f"{b} B x Ψ = {b} x {num(P)} ({w.precision}, replicated)")
    optimizer = _term("optimizer", (4 * P if mixed else 0) + k * P,
                      ("fp32 master 4 B x Ψ + " if mixed else "") + f"{k} B x Ψ ({opt_text})"
                      + ("" if mixed else "; fp32: the weights are the master"))
    step = b * P + (4 * P if mixed else 0)
    grads = _term("grads", Phases(b * P, b * P, step), f"{b} B x Ψ (replicated)"
                  + (f"; inside step() DeepSpeed adds fp32 copies 4 B x Ψ: {gib(step)}" if mixed else ""))
    flatten = min(P, buffers.allreduce_bucket_size) * b if N > 1 else 0
    comm = _term("comm", Phases(0, flatten, 0),
                 f"all-reduce flat buffer after backward: min(Ψ, {num(buffers.allreduce_bucket_size)}) x {b} B"
                 if N > 1 else "one rank: no all-reduce")
    return ModelStates(params, grads, optimizer, comm, params.bytes + optimizer.bytes + grads.bytes)


def _reduce_bucket(run: _Run, buffers: DeepSpeedBuffers) -> tuple[int, str, int, str]:
    """(bytes, text) of the reduce bucket(s) ZeRO-1/2/3 fill during backward, and of the largest parameter's
    gradient when it does not fit one."""
    stage, b = run.layout.zero_stage, run.b
    largest = max(run.shape.param_sizes())
    R = buffers.reduce_bucket_size
    overlap = buffers.overlap_comm if buffers.overlap_comm is not None else stage == 3
    count = 2 if (overlap and stage in (1, 2)) else 1
    bucket = (count * R * b) if buffers.contiguous_gradients or stage == 3 else 0
    pending = largest * b if largest > R else 0
    pending_text = (f" + the largest parameter's gradient {num(largest)} x {b} B (larger than the bucket, "
                    f"reduced on its own)") if pending else ""
    return bucket, f"{count} x reduce_bucket_size {num(R)} x {b} B", pending, pending_text


def _kept_large_grads(sizes: list[int], ranks: int, bucket: int) -> tuple[int, int]:
    """ZeRO-2 with fp32 accumulation of bf16 gradients (DeepSpeed's compact fp32 partition): elements of the
    gradients held on the worst rank at the end of backward, beyond the bucket and the fp32 partition, and
    how many parameters they belong to.

    A gradient larger than ``reduce_bucket_size`` bypasses the bucket and is reduced on its own, from the
    parameter's own bf16 ``.grad``. After its reduction into the fp32 partition DeepSpeed frees that ``.grad``
    on the ranks whose partition the parameter does not overlap, but keeps it on those whose partition it
    does (``copy_grads_in_partition`` returns without clearing it) until the end-of-backward epilogue clears
    every ``.grad``. And the last large gradient of backward (the first large parameter in module order: the
    embeddings) is still waiting for its reduction when the epilogue starts. So the worst rank holds, at the
    end of backward, the full gradients of every large parameter overlapping its partition plus that one.
    Partitions follow DeepSpeed's flat buffer: parameters in module order, padded to a multiple of 2N."""
    total = sum(sizes)
    part = -(-total // (2 * ranks)) * 2
    held: dict[int, set[int]] = {}
    start, last = 0, None
    for index, size in enumerate(sizes):
        if size > bucket:
            last = index if last is None else last
            for rank in range(start // part, min((start + size - 1) // part, ranks - 1) + 1):
                held.setdefault(rank, set()).add(index)
        start += size
    if last is None:
        return 0, 0
    worst = max((h | {last} for h in held.values()), key=lambda h: sum(sizes[i] for i in h), default={last})
    return sum(sizes[i] for i in worst), len(worst)


def _offloaded_optimizer(layout: Launch) -> Term:
    return _term("optimizer", 0, f"0 on the GPU: master and states are offloaded to {layout.offload_optimizer}")


def zero12_states(run: _Run, buffers: DeepSpeedBuffers) -> ModelStates:
    P, N, b, w, layout, stage = run.P, run.N, run.b, run.workload, run.layout, run.layout.zero_stage
    k, opt_text = run.optimizer
    off_opt = layout.offload_optimizer != "none"
    bucket, bucket_text, pending, pending_text = _reduce_bucket(run, buffers)
    largest, part = max(run.shape.param_sizes()), run.part(P)
    params = _term("params", b * P, f"{b} B x Ψ = {b} x {num(P)} ({w.precision}, replicated: ZeRO-{stage} keeps "
                                    "all weights)")
    host = {}
    if off_opt:
        optimizer = _offloaded_optimizer(layout)
        host = {"master": Term("master", "fp32 master partition", 4 * part, f"4 B x Ψ/N = 4 x {num(part)}"),
                "optimizer_states": Term("optimizer_states", "optimizer states", k * part, f"{k} B x Ψ/N ({opt_text})"),
                "grads": Term("grads", "fp32 gradient partition", 4 * part, "4 B x Ψ/N"),
                "bit16": Term("bit16", f"{w.precision} copy of the partition", b * part, f"{b} B x Ψ/N"),
                "accumulated": Term("accumulated", "accumulated gradients", b * part, f"{b} B x Ψ/N")}
        if layout.offload_optimizer == "cpu":
            host["staging"] = Term("staging", "gradient staging buffer", largest * b, f"{b} B x largest parameter")
    else:
        optimizer = _term("optimizer", (4 + k) * part,
                          f"fp32 master partition 4 B x Ψ/N + {k} B x Ψ/N ({opt_text}) = {4 + k} B x {num(P)} / {N}"
                          + ("; in fp32 too: DeepSpeed clones the partition" if not run.mixed else ""))
    a = run.a
    if off_opt and w.fp32_grads:
        host["accumulated"] = Term("accumulated", "accumulated gradients (fp32)", 4 * part, "4 B x Ψ/N")
    if stage == 1 and w.fp32_grads and not off_opt:
        # bf16 with fp32 accumulation: DeepSpeed's BF16_Optimizer, which accumulates every micro-step's bf16
        # gradients into a full-size fp32 buffer, replicated, all-reduced at the boundary.
        full = b * P + 4 * P
        grads = _term("grads", Phases(full, full, full),
                      f"{b} B x Ψ ({w.precision} gradients of backward) + 4 B x Ψ (BF16_Optimizer's fp32 accumulation "
                      f"buffer, full size and replicated: ZeRO-1 with fp32 accumulation partitions only the optimizer "
                      f"states) = {gib(full)}")
        comm = _term("comm", Phases.constant(0), "no reduce bucket: BF16_Optimizer all-reduces its fp32 buffer in place")
        return ModelStates(params, grads, optimizer, comm, params.bytes + optimizer.bytes + full, host=host)
    if stage == 1:
        backward = b * P
        backward_text = (f"backward: {b} B x Ψ (ZeRO-1 reduces only after the last micro-step's backward: every "
                         "gradient is full size until then)")
    else:
        if a != b and not off_opt:
            # fp32 partition of bf16 gradients: large gradients in this rank's partition are kept to the epilogue
            kept, count = _kept_large_grads(run.shape.param_sizes(), N, buffers.reduce_bucket_size)
            pending = kept * b
            pending_text = (f" + {count} gradient(s) larger than the bucket, held whole in {w.precision} to the end of "
                            f"backward on the worst rank (those overlapping its partition, and the last one "
                            f"reduced): {num(kept)} x {b} B") if kept else ""
        backward = (0 if off_opt else a * part) + pending + (largest * b if off_opt else 0)
        backward_text = (f"backward: {a} B x Ψ/N {'fp32 accumulated ' if a != b else ''}partition{pending_text}"
                         if not off_opt else
                         f"backward: a {b} B staging buffer of the largest parameter {num(largest)}{pending_text}; the "
                         "partition goes to the host")
    step = 0 if off_opt else 4 * part
    grads = _term("grads", Phases(backward, backward, step), backward_text,
                  (f"step(): fp32 copy of the partition 4 B x Ψ/N = {gib(4 * part)} (the {w.precision} partition is "
                   "freed first)" if a != 4 else f"step(): the fp32 partition 4 B x Ψ/N = {gib(4 * part)}")
                  if not off_opt else "step(): on the host")
    comm = _term("comm", Phases(bucket, bucket, 0), f"ipg reduce bucket {bucket_text}, allocated for backward; the "
                                                    "all-gather after step() writes into the parameters in place")
    peak = params.bytes + optimizer.bytes + max(backward + bucket, step)
    return ModelStates(params, grads, optimizer, comm, peak, host=host)


def zero3_states(run: _Run, buffers: DeepSpeedBuffers) -> ModelStates:
    P, N, b, w, layout, shape = run.P, run.N, run.b, run.workload, run.layout, run.shape
    k, opt_text = run.optimizer
    off_opt, off_par = layout.offload_optimizer != "none", layout.offload_params != "none"
    bucket, bucket_text, pending, pending_text = _reduce_bucket(run, buffers)
    sizes, part = shape.param_sizes(), run.part(P)
    threshold = buffers.stage3_param_persistence_threshold
    persistent = sum(x for x in sizes if x <= threshold)
    # hpZ: a secondary copy of every parameter (persistent ones too), partitioned within the group; DeepSpeed puts
    # it where the partitions live (the host under parameter offload)
    hpz = layout.hybrid_shard_size
    secondary = b * run.part(P, hpz) if hpz else 0
    secondary_text = f"hpZ's secondary partition within {hpz} GPUs {b} B x Ψ/{hpz} = {b} x {num(P)} / {hpz}"
    params = _term("params", (0 if off_par else b * part + secondary) + b * persistent,
                   (f"{b} B x Ψ/N = {b} x {num(P)} / {N}" if not off_par else f"partitions offloaded to {layout.offload_params}")
                   + f" + persistent (<= {num(threshold)} elements, kept whole) {b} B x {num(persistent)}"
                   + (f" + {secondary_text}" if hpz and not off_par else ""))
    host = {"params": Term("params", f"{w.precision} parameter partition", b * part, f"{b} B x Ψ/N")} if off_par else {}
    if off_par and hpz:
        host["secondary"] = Term("secondary", "hpZ secondary parameter partition", secondary, secondary_text)
    sub = min(part, buffers.sub_group_size + run.part(max(sizes)))
    notes = ()
    if off_opt:
        optimizer = _offloaded_optimizer(layout)
        where = "host" if layout.offload_optimizer == "cpu" else "NVMe"
        if layout.offload_optimizer == "nvme":
            notes = (f"NVMe holds the master and optimizer states: {gib((4 + k) * part)} per rank",)
        else:
            host["master"] = Term("master", f"fp32 master partition ({where})", 4 * part, "4 B x Ψ/N")
            host["optimizer_states"] = Term("optimizer_states", f"optimizer states ({where})", k * part,
                                            f"{k} B x Ψ/N ({opt_text})")
        host["grads"] = Term("grads", "gradient partition + fp32 copy of a sub-group", run.a * part + 4 * sub,
                             f"{run.a} B x Ψ/N + 4 B x min(Ψ/N, sub_group_size)")
    else:
        optimizer = _term("optimizer", 4 * part + k * part,
                          f"fp32 master partition 4 B x Ψ/N + {k} B x Ψ/N ({opt_text})")
    a = run.a
    backward = (0 if off_opt else a * part) + pending
    step = 0 if off_opt else a * part + 4 * sub
    grads = _term("grads", Phases(backward, backward, step),
                  f"backward: {a} B x Ψ/N flat gradient partition{' (fp32 accumulation)' if a != b else ''}"
                  f"{pending_text}" if not off_opt
                  else f"backward: partitions go to the host{pending_text}",
                  *([] if off_opt else [f"step(): + fp32 copy of one sub-group 4 B x min(Ψ/N, sub_group_size "
                                        f"{num(buffers.sub_group_size)}) = {gib(4 * sub)}"]))
    module = max(shape.block_params, shape.vocab_size * shape.hidden_size)
    gathered = min(buffers.stage3_max_live_parameters, module + buffers.stage3_prefetch_bucket_size) * b
    comm = _term("comm", Phases(bucket + gathered, bucket + gathered, bucket),
                 f"persistent reduce bucket {bucket_text} + gathered parameters min(max_live "
                 f"{num(buffers.stage3_max_live_parameters)}, largest module {num(module)} + prefetch "
                 f"{num(buffers.stage3_prefetch_bucket_size)}) x {b} B")
    peak = params.bytes + optimizer.bytes + max(backward + bucket, step + bucket)
    return ModelStates(params, grads, optimizer, comm, peak, host=host, notes=notes)


# ---- PyTorch FSDP -------------------------------------------------------------------------------
# As accelerate applies FSDP2 to a transformers model: every transformer block is a unit, the input
# embedding another (when untied), and the final norm with the LM head (and a tied embedding) a group it
# never reshards between forward and backward; the root keeps what is left (GPT-2's position table), also
# unsharded from forward to backward.
# The shards stay fp32: they are what the optimizer steps. In mixed precision a unit is all-gathered in the
# recipe's dtype (param_dtype) and its gradient reduce-scattered in it (reduce_dtype). No DeepSpeed
# buckets: the buffers are the gathered units and the gradient on its way to the reduce-scatter.

_GATHERS_EVERY_UNIT = ("SHARD_GRAD_OP",)
"""Strategies that keep each unit gathered from its forward to its backward (like ZeRO-2: full params)."""


def _fsdp_ranks(layout: Launch, strategy: str) -> tuple[int, str]:
    """Ranks the states are sharded over, and how the formulas say it. Under TP, FSDP shards each TP rank's part over
    the data-parallel ranks (and, under CP, the CP ranks too: accelerate's dp_shard_cp dimension)."""
    cp = layout.cp_size
    cp_text = f" x CP {cp}" if cp > 1 else ""
    if strategy == "NO_SHARD":
        return 1, "NO_SHARD: replicated, N = 1"
    if layout.hybrid_shard_size:
        n = layout.hybrid_shard_size * cp
        return n, (f"{strategy} hybrid (HSDP): sharded within N = {layout.hybrid_shard_size}{cp_text} ranks, "
                   f"{layout.num_replicas} replicas")
    n = layout.world_size // layout.tp_size
    if layout.tp_size > 1 or cp > 1:
        return n, (f"{strategy}: sharded over N = {layout.data_parallel_size}{cp_text} ranks (the world "
                   f"{layout.world_size}{f' over TP {layout.tp_size}' if layout.tp_size > 1 else ''})")
    return n, f"{strategy}: sharded over all N = {layout.world_size} ranks"


def fsdp_states(run: _Run) -> ModelStates:
    P, b, w, layout, shape = run.P, run.b, run.workload, run.layout, run.shape
    k, opt_text = run.optimizer
    if layout.offload_optimizer != "none":
        raise ConfigError("FSDP has no separate optimizer offload: fsdp_offload_params moves the parameter shards, "
                          "their gradients and the optimizer step to the CPU; use --offload-params instead")
    if layout.offload_params not in ("none", "cpu"):
        raise ConfigError(f"FSDP offloads parameters to the CPU only (fsdp_offload_params), not to "
                          f"{layout.offload_params}; use --offload-params cpu")
    strategy = layout.fsdp_sharding or "FULL_SHARD"
    ranks, sharding = _fsdp_ranks(layout, strategy)
    block, embed = shape.block_params, 0 if shape.tie_embeddings else shape.vocab_size * shape.hidden_size
    tp = tensor_parallel(shape, layout.tp_size)
    ep = expert_parallel(shape, layout.ep_size)
    psi = "Ψ"
    if tp is not None:  # every count below is one TP rank's: the split modules' 1/TP and the whole ones
        P, psi, block = tp.local(shape), "Ψ_TP", tp.block_local
        embed = -(-embed // tp.size) if "embed_tokens" in tp.split_modules else embed
    offload, part = layout.offload_params == "cpu", run.part(P, ranks)
    kept = P - shape.num_layers * block - embed  # the LM-head group and the root's leftovers
    # What a rank unshards: every parameter, or under EP the dense part and its own E / EP experts (the shards stay
    # Ψ/N: parallel.py's docstring). Measured by tests/plan/test_memory_validation.py::test_ep_model_states_match_estimate.
    unsharded, upsi = P, psi
    if ep is not None:
        unsharded, upsi, block = ep.local(shape), "Ψ_EP", ep.block_local(block)
        sharding += (f"; EP {ep.size}: the dense part over the N ranks, each rank's {ep.local_experts} of "
                     f"{ep.num_experts} experts per block over their {layout.efsdp_size} "
                     f"cop{'ies' if layout.efsdp_size > 1 else 'y'}: Ψ/N as without EP")
    unit = max(block, kept, embed)
    gas = w.grad_accum_steps or 1

    # NO_SHARD keeps whole copies and all-reduces gradients: the same terms with N = 1
    shards, frac, reduce = (("shards", f"{psi}/N", "reduce-scatter") if strategy != "NO_SHARD" else
                            ("copies", psi, "all-reduce"))
    host = {}
    if offload:
        params = _term("params", 0, f"0 on the GPU: the fp32 {shards} offloaded to cpu ({sharding})")
        optimizer = _term("optimizer", 0, f"0 on the GPU: the optimizer steps on the CPU, on the offloaded {shards}")
        host = {"params": Term("params", f"fp32 parameter {shards}", 4 * part, f"4 B x {frac}"),
                "optimizer_states": Term("optimizer_states", "optimizer states", k * part, f"{k} B x {frac} ({opt_text})"),
                "grads": Term("grads", f"fp32 gradient {shards}", 4 * part, f"4 B x {frac}")}
    else:
        params = _term("params", 4 * part, f"4 B x {frac} = 4 x {num(P)}{f' / {ranks}' if ranks > 1 else ''} "
                                           f"(fp32 {shards}; {sharding})"
                       + (f"\n{tp.formula(shape)}" if tp is not None else "")
                       + (f"\n{ep.formula(shape)}" if ep is not None else ""))
        optimizer = _term("optimizer", k * part, f"{k} B x {frac} ({opt_text}); no master copy: the fp32 {shards} "
                                                 "are the master")

    # bf16 with reduce_dtype fp32 (pretrain's default policy): FSDP2 accumulates the unsharded gradients of the
    # no_sync micro-steps in fp32 and reduce-scatters in fp32.
    r = 4 if (w.precision == "bf16" and w.reduce_dtype == "fp32") else b
    # Under TP each unsharded gradient is its parameter's TP shard, the vocab-parallel embedding's too (pretrain looks
    # its rows up locally: pretrain.distributed.tensor_parallel.local_vocab_lookup); measured by
    # tests/plan/test_memory_validation.py::test_tp_model_states_match_estimate.
    reduced = 0 if offload else 4 * part
    if gas > 1 and w.sync_each_micro_batch:
        backward = reduced
        backward_text = (f"backward: the fp32 {shards} of the micro-steps so far (batch.sync_each_micro_batch: a "
                         f"{reduce} after every micro-batch, no unsharded gradient kept between them)")
    elif gas > 1:
        backward = r * unsharded
        backward_text = (f"backward: {r} B x {upsi} unsharded{' (fp32 accumulation)' if r != b else ''} (accelerate "
                         f"skips the {reduce} on the {gas - 1} micro-steps before the last: no_sync keeps every "
                         "gradient full size until then; batch.sync_each_micro_batch=true shards them)")
    else:
        backward = 0
        backward_text = f"backward: none yet (each unit's gradient goes to the {reduce} when its backward ends)"
    grads = _term("grads", Phases(backward, reduced, reduced), backward_text,
                  f"after the {reduce}: on the host" if offload else
                  f"after the {reduce}: fp32 {shards} 4 B x {frac} = {gib(reduced)}")

    if strategy in _GATHERS_EVERY_UNIT:
        gathered, gathered_text = b * unsharded, f"every unit gathered from its forward to its backward {b} B x {upsi}"
    elif strategy == "NO_SHARD" and not run.mixed:
        gathered, gathered_text = 0, "nothing gathered (NO_SHARD computes on its fp32 copy)"
    else:
        gathered = b * (kept + 2 * block)
        gathered_text = (f"gathered {w.precision} units: LM head, final norm and the root's own parameters, kept "
                         f"from forward to backward, {num(kept)} + the block in backward and the next one "
                         f"prefetched 2 x {num(block)}"
                         + (f" (its dense part and this rank's {ep.local_experts} experts)" if ep is not None else "")
                         + f", x {b} B")
    buffers = gathered + b * unit + (4 * unit if r != b else 0)
    comm = _term("comm", Phases(buffers, buffers, 0),
                 f"{gathered_text} + one unit's unsharded gradient before its {reduce} {num(unit)} x {b} B"
                 + (f" + its fp32 copy for the fp32 {reduce} {num(unit)} x 4 B" if r != b else ""))
    peak = params.bytes + optimizer.bytes + max(grads.at(p) + comm.at(p) for p in PHASES)
    return ModelStates(params, grads, optimizer, comm, peak, host=host)


# ---- The classic example ---------------------------------------------------------------------------

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
    weights = num_params * PRECISION_BYTES[precision]
    master = num_params * 4 if precision != "fp32" else 0
    return {
        "weights": weights / 1e9,
        "gradients": weights / 1e9,
        "optimizer": (master + num_params * state_bytes) / 1e9,
        "total": (2 * weights + master + num_params * state_bytes) / 1e9,
    }
