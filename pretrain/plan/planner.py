"""Which layout should this recipe run with? Feasible layouts ranked by expected throughput (pretrain-plan,
--dry-run and pretrain-launch ask it; pretrain/cli/plan.py is the command).

Every combination of DDP / ZeRO stage / FSDP (FULL_SHARD, SHARD_GRAD_OP), on more than one node also hybrid
sharding (ZeRO-3 with ZeRO++ hpZ, FSDP2 HSDP: sharded within a node, replicated across nodes), for a mixture of
experts also FSDP2 x EP (FULL_SHARD, every EP size that divides both the experts and the world), offload,
activation checkpointing policy (none, selective, every_2, full: pretrain/recipe/recompute.py) and micro batch
size that divides the recipe's global batch is estimated with
pretrain/memory; those that fit the GPU are
ranked by a simple step-time model (below), the best is written as an accelerate config, and the launch
command is printed.

Step time = compute + exposed communication + offload traffic, per optimizer step, per GPU:

- compute: FLOPs per token (pretrain/recipe/shape.py's convention, 6 x matmul weights + 12 x layers x heads x
  head_dim x seq; its hardware FLOPs, which add what the checkpointing policy recomputes: full one
  forward of the blocks, every_2 half of that, selective no matmul) x tokens per GPU / (peak bf16 FLOP/s x
  base MFU x T / (T + 1024)), where T = MBS x seq tokens: a small micro-batch leaves the GPU under-used (the
  heuristic halves the rate at 1,024 tokens). The base MFU is calibrated from measurements
  (``Calibration``): the rows of a calibration file (--calibration, or <cache root>/calibration.json when it
  exists) for this GPU, each measured MFU divided by its own T / (T + 1024); without one, torchtitan's
  published eager FSDP2 figure (DEFAULT_BASE_MFU).
- communication per GPU, ring algorithms ((N-1)/N of each volume), gradients in the dtype they are
  reduced in (fp32 for bf16 recipes unless precision.reduce_dtype=bf16; DDP's are fp32 unless its bf16
  hook compresses them), parameters in the compute dtype: DDP and ZeRO-0 all-reduce the gradients once
  per optimizer step (2 x Ψ); ZeRO-1 reduces them and all-gathers the parameters once (Ψ + Ψ; with fp32
  accumulation DeepSpeed's BF16_Optimizer all-reduces its fp32 buffer: 2 x Ψ + Ψ); ZeRO-2
  reduce-scatters at every micro-step and all-gathers the parameters once (GAS + 1); ZeRO-3 all-gathers
  the parameters twice and reduce-scatters once per micro-step (2 x GAS + GAS); FSDP all-gathers the
  parameters at every micro-step (FULL_SHARD twice, SHARD_GRAD_OP once) and reduce-scatters once per
  optimizer step (accelerate's no_sync): 2 x GAS + 1 or GAS + 1; with batch.sync_each_micro_batch at every
  micro-step (2 x GAS + GAS or GAS + GAS), holding fp32 gradient shards instead of unsharded gradients
  through accumulation: the planner weighs both for every sharded FSDP layout with GAS > 1. Hybrid
  sharding keeps gathers inside a node: ZeRO-3 hpZ gathers for backward from its node-local secondary partition (the forward gather and the
  reduce-scatter still span every GPU); HSDP gathers and reduce-scatters within the node, and only
  all-reduces each gradient shard across the nodes' replicas once per reduce-scatter (2 x Ψ / GPUs per
  node). Expert parallelism (FSDP2 x EP: pretrain/distributed/expert_parallel.py) splits FSDP's traffic in two: the
  dense part Ψ_dense = Ψ - X (X: every block's experts, E x 3 d f each) is gathered and reduce-scattered over the
  world as above, each rank's experts X / EP over their world / EP copies only (none when EP is the world; across
  nodes unless one node holds the world, the copies being EP ranks apart). Bandwidth: NVLink for a collective
  inside a node, the network per GPU for one across nodes. DDP overlaps half of it with backward, ZeRO-3 and FSDP
  half (prefetch), ZeRO-0/1/2 none (DeepSpeed's defaults).
- EP's token all-to-alls (``expert_parallel_comm``): 4 per MoE layer and micro-batch (dispatch and combine in
  forward, both again in backward), 2 more per block whose forward full or every_N recomputes (selective keeps the
  all-to-alls' outputs, as torchtitan does: pretrain/model/activation_checkpointing.py), each
  T x top-k x d x b bytes of which (EP - 1) / EP leave the rank (T = MBS x seq): GAS x (4 L + 2 x recomputed) x
  (EP - 1)/EP x T k d b per step, on NVLink when an EP group fits a node (EP divides the GPUs per node), else all
  of it at the network's bandwidth (conservative: part of it stays inside a node), exposed in full (the experts
  wait for their tokens). Compute is unchanged: the model does not credit EP's larger per-expert matmuls (every
  expert's tokens from EP ranks at once), nor charge the imbalance of tokens between experts.
- offload: the optimizer step on the CPU, 1e9 parameters/s per node shared by its GPUs' partitions
  (the recipe's torch optimizer runs there; DeepSpeed's CPU Adam is faster), plus PCIe copies
  (gradients down every micro-step, parameters up, 25 GB/s); parameter offload re-reads the partition
  from the host twice per micro-step. FSDP's parameter offload does both: its optimizer steps on the
  CPU too.

Layouts with less than 5% of the GPU left over are listed after the others (marked "tight"): the
estimate's error bars are a few GiB. Offload comes after every layout without it: its cost depends on
the host (cores, memory bandwidth, NUMA) far more than this model knows, and it needs host memory.
Within those groups layouts are ranked by the model's tokens/s; ties go to less recompute (none before
selective: selective's recomputed norms and elementwise ops are not in the FLOPs count), then to less
communication, then to EP groups inside a node, then to the larger micro-batch. The model ranks layouts; it does not predict absolute throughput.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from pretrain.distributed.layout import Launch, accelerate_command, shell_join
from pretrain.errors import ConfigError
from pretrain.plan import memory
from pretrain.recipe.batching import BatchPlan, local_batch_size, micro_batch_sizes
from pretrain.recipe.config import runs_root
from pretrain.recipe.recompute import PLANNER_POLICIES, recompute_label, runs_under_zero3
from pretrain.recipe.shape import ModelShape
from pretrain.system import hardware

MBS_HALF_RATE_TOKENS = 1024
DEFAULT_BASE_MFU = 0.35
"""The base MFU without a calibration file, from a published measurement of an eager PyTorch FSDP stack:
torchtitan (pytorch/torchtitan, docs/performance.md, Table 1) trains Llama 3.1 8B with FSDP2 on 8 H100 at
33% MFU without torch.compile (local batch 2 x seq 8,192 = 16,384 tokens per micro-batch, selective activation
checkpointing, bf16); 0.33 / (16,384 / (16,384 + 1,024)) = 0.35 at this model's large-micro-batch limit."""
DEFAULT_MFU_SOURCE = ("default: torchtitan's Llama 3.1 8B FSDP2 on 8 H100, 33% MFU eager at 16,384 tokens per "
                      "micro-batch (pytorch/torchtitan docs/performance.md); measure your own with --calibration")
HPZ_JSON = "accelerate_configs/zero3_hpz.json"
"""The shipped DeepSpeed JSON of ZeRO-3 + hpZ (partition size "auto": the GPUs per node)."""
HYBRID_CONFIGS = {"deepspeed": "accelerate_configs/multinode_zero3_hpz.yaml", "fsdp": "accelerate_configs/multinode_hsdp.yaml"}
"""The shipped accelerate configs of the hybrid layouts."""
EP_CONFIG = "accelerate_configs/fsdp2_ep.yaml"
"""The shipped accelerate config of FSDP2 x EP (FSDP2 full shard; the EP size is the recipe's model.moe.ep_size:
accelerate's parallelism_config has no expert dimension)."""
CALIBRATION_FILE = "calibration.json"
"""The calibration file pretrain-plan reads from the cache root (``$PRETRAIN_CACHE_DIR``, data.cache_dir or
~/.cache/pretrain) when --calibration is not given."""
HOST_OPTIMIZER_PARAMS_PER_S = 1e9
TIGHT_FRACTION = 0.05
PCIE_GB_S = 25.0
_EXPOSED = {"ddp": 0.5, "fsdp": 0.5, 0: 1.0, 1: 1.0, 2: 1.0, 3: 0.5}
FSDP_CONFIG = """fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: {reshard}
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: {offload}
  fsdp_state_dict_type: SHARDED_STATE_DICT"""
"""accelerate_configs/fsdp.yaml's block: FSDP2, a unit per transformer block; reshard_after_forward true is
FULL_SHARD, false SHARD_GRAD_OP."""


def layout_name(lay: Launch) -> str:
    """The planner's short name of a layout: DDP, ZeRO-3 +offload opt, FSDP FULL_SHARD, ..."""
    if lay.engine == "ddp":
        return "DDP"
    if lay.engine == "fsdp":
        return (f"FSDP {lay.fsdp_sharding}" + (" (HSDP)" if lay.hybrid_shard_size else "")
                + (f" x TP {lay.tp_size}" if lay.tp_size > 1 else "") + (f" x CP {lay.cp_size}" if lay.cp_size > 1 else "")
                + (f" x EP {lay.ep_size}" if lay.ep_size > 1 else "")
                + (" +offload params" if lay.offload_params != "none" else ""))
    hpz = " (hpZ)" if lay.hybrid_shard_size else ""
    if lay.offload_params != "none":
        return f"ZeRO-{lay.zero_stage}{hpz} +offload opt+params"
    return f"ZeRO-{lay.zero_stage}{hpz}" + (" +offload opt" if lay.offload_optimizer != "none" else "")


@dataclass(frozen=True)
class Candidate:
    layout: Launch
    checkpointing: str
    """The activation checkpointing policy (pretrain/recipe/recompute.py)."""
    micro_batch_size: int
    grad_accum_steps: int
    estimate: memory.MemoryEstimate
    compute_s: float
    comm_s: float
    comm_volume: float
    """Bytes each GPU sends per optimizer step, per parameter (x Ψ)."""
    offload_s: float
    tokens_per_s: float
    tp_comm_s: float = 0.0
    """Of comm_s: TP's activation all-reduces (and the LM head's gather), exposed."""
    cp_comm_s: float = 0.0
    """Of comm_s: CP's K/V exchange, exposed."""
    ep_comm_s: float = 0.0
    """Of comm_s: EP's token all-to-alls, exposed."""
    runs: bool = True
    """False for a layout pretrain's launch refuses (``cp_runs``: context parallelism, were the layout parser to
    refuse it again): ranked, never chosen."""

    @property
    def tight(self) -> bool:
        return self.estimate.headroom_gib < TIGHT_FRACTION * self.estimate.gpu.memory_gib

    @property
    def sync_each_micro_batch(self) -> bool:
        return self.estimate.workload.sync_each_micro_batch

    @property
    def name(self) -> str:
        return layout_name(self.layout) + (", reduce-scatter each micro-batch" if self.sync_each_micro_batch else "")

    def describe(self) -> str:
        est = self.estimate
        recompute = recompute_label(self.checkpointing)
        tokens = self.micro_batch_size * est.workload.seq_len
        eff = tokens / (tokens + MBS_HALF_RATE_TOKENS)
        offload = f" + offload {self.offload_s:.2f} s (CPU optimizer step, PCIe copies)" if self.offload_s else ""
        return (
            f"{self.name}, MBS {self.micro_batch_size}, GAS {self.grad_accum_steps}, {recompute}: "
            f"{est.total_gib:.1f} GiB ({est.headroom_gib:.1f} free{', tight' if self.tight else ''}); "
            f"~{self.tokens_per_s:,.0f} tok/s/GPU: "
            f"compute {self.compute_s:.2f} s ({tokens:,} tokens/micro-batch -> {eff:.0%} of the efficient rate"
            f"{'' if self.checkpointing == 'none' else ', + ' + recompute}) + comm {self.comm_s:.2f} s exposed "
            f"({round(self.comm_volume, 2):g} B x {'Ψ_TP' if self.layout.tp_size > 1 else 'Ψ'} per step"
            + (f"; of it TP {self.tp_comm_s:.2f} s" if self.tp_comm_s else "")
            + (f"; CP {self.cp_comm_s:.2f} s" if self.cp_comm_s else "")
            + (f"; EP all-to-all {self.ep_comm_s:.2f} s" if self.ep_comm_s else "") + f"){offload}"
            + ("" if self.runs else " [not chosen: pretrain's launch refuses parallelism_config_cp_size today]")
        )


def layouts(nodes: int, gpus: int, num_experts: int = 0) -> list[Launch]:
    """Every layout the planner weighs on ``nodes`` x ``gpus`` (``num_experts``: a mixture of experts' experts per
    block, which EP layouts split; 0 for a dense model: none)."""
    out = [Launch("ddp", 0, num_nodes=nodes, gpus_per_node=gpus)]
    for stage in range(4):
        out.append(Launch("deepspeed", stage, num_nodes=nodes, gpus_per_node=gpus))
        if stage >= 1:
            out.append(Launch("deepspeed", stage, "cpu", num_nodes=nodes, gpus_per_node=gpus))
        if stage == 3:
            out.append(Launch("deepspeed", 3, "cpu", "cpu", num_nodes=nodes, gpus_per_node=gpus))
    for sharding, offload in (("FULL_SHARD", "none"), ("SHARD_GRAD_OP", "none"), ("FULL_SHARD", "cpu")):
        out.append(Launch("fsdp", offload_params=offload, num_nodes=nodes, gpus_per_node=gpus, fsdp_sharding=sharding))
    if nodes > 1 and gpus > 1:  # hybrid: shard within a node, replicate across nodes
        out.append(Launch("deepspeed", 3, num_nodes=nodes, gpus_per_node=gpus, hybrid_shard_size=gpus))
        for sharding in ("FULL_SHARD", "SHARD_GRAD_OP"):
            out.append(Launch("fsdp", num_nodes=nodes, gpus_per_node=gpus, fsdp_sharding=sharding,
                              hybrid_shard_size=gpus))
    return out + parallel_layouts(nodes, gpus) + expert_layouts(nodes, gpus, num_experts)


def expert_layouts(nodes: int, gpus: int, num_experts: int) -> list[Launch]:
    """FSDP2 (FULL_SHARD) x EP for every EP size > 1 that divides both the experts and the world (what the recipe's
    schema and check_launch accept); none for a dense model (``num_experts`` 0). EP groups larger than a node are
    weighed too: their all-to-alls cross the network, which the step-time model charges."""
    world = nodes * gpus
    return [Launch("fsdp", num_nodes=nodes, gpus_per_node=gpus, fsdp_sharding="FULL_SHARD", ep_size=ep)
            for ep in range(2, world + 1) if num_experts and not num_experts % ep and not world % ep]


MODEL_PARALLEL_SIZES = (2, 4, 8)
"""TP and CP sizes the planner tries (TP only where it divides the GPUs per node: TP never spans nodes)."""


def parallel_layouts(nodes: int, gpus: int) -> list[Launch]:
    """FSDP2 x TP (2-D), HSDP x TP (3-D, several nodes), FSDP2 x CP and FSDP2 x TP x CP, FULL_SHARD: the shapes
    accelerate's parallelism_config builds (dp_replicate, dp_shard, cp, tp)."""
    world, out = nodes * gpus, []
    for tp in (1, *MODEL_PARALLEL_SIZES):
        if tp > 1 and (gpus % tp or tp >= world):
            continue
        for cp in (1, *MODEL_PARALLEL_SIZES):
            if (tp, cp) == (1, 1) or world % (tp * cp) or world // tp < 2:  # FSDP needs ranks to shard over
                continue
            out.append(Launch("fsdp", num_nodes=nodes, gpus_per_node=gpus, fsdp_sharding="FULL_SHARD", tp_size=tp,
                              cp_size=cp))
            if nodes > 1 and gpus // tp > 1 and cp == 1:  # HSDP x TP: shard within a node, replicas across nodes
                out.append(Launch("fsdp", num_nodes=nodes, gpus_per_node=gpus, fsdp_sharding="FULL_SHARD",
                                  hybrid_shard_size=gpus // tp, tp_size=tp))
    return out


def cp_runs() -> bool:
    """Whether pretrain's launch accepts an accelerate config with cp_size > 1 (read from the layout parser, the one
    place that decides; True since the loop splits sequences under accelerate's context parallelism,
    pretrain/distributed/context_parallel.py). The planner plans GPUs, where CP runs; its refusals on CPU are the
    launch's."""
    try:
        Launch.from_accelerate_config(None, ["--use_fsdp", "--fsdp_version", "2", "--num_processes", "2",
                                             "--parallelism_config_cp_size", "2", "--parallelism_config_dp_shard_size", "1"])
    except ConfigError:
        return False
    return True


def model_parallel_comm(est: memory.MemoryEstimate, gpu: hardware.GpuSpec) -> tuple[float, float]:
    """(TP s, CP s) of exposed communication per optimizer step, per GPU.

    TP (transformers' plan, no sequence parallelism): each block all-reduces its attention and MLP outputs in
    forward (rowwise o, down) and the gradients of its colwise inputs in backward: 4 all-reduces of T x d per
    block and micro-step, 2 more per block whose forward checkpointing recomputes; the vocab-parallel embedding and
    the LM head add 2 all-reduces of T x d and an all-gather of the T x V logits. Ring all-reduce moves
    2 (TP-1)/TP of the bytes, all-gather (TP-1)/TP, on NVLink (TP stays inside a node), on the critical path:
    exposed in full. T = MBS x seq / CP, b the compute dtype's bytes.
    CP (torch's context_parallel under accelerate, all-gather rotation): each block all-gathers the other chunks'
    K and V in forward (2 b T k/TP per chunk, CP - 1 chunks), again in backward, and reduce-scatters their
    gradients: 3 x (CP - 1) x 2 b T k/TP per block and micro-step (+1 per recomputed forward); on NVLink when the
    TP x CP group fits a node, else the network; exposed in full (the all-gather precedes the attention)."""
    from pretrain.recipe.recompute import checkpointed_blocks

    w, lay, shape = est.workload, est.layout, est.shape
    tp, cp = lay.tp_size, lay.cp_size
    if tp == 1 and cp == 1:
        return 0.0, 0.0
    gas = w.grad_accum_steps or 1
    b = 2 if w.precision != "fp32" else 4
    T = w.micro_batch_size * w.seq_len // cp
    L, d, V = shape.num_layers, shape.hidden_size, shape.vocab_size
    recomputed = checkpointed_blocks(w.activation_checkpointing, L) if w.activation_checkpointing != "selective" else 0
    tp_s = cp_s = 0.0
    if tp > 1:
        all_reduces = 4 * L + 2 * recomputed + 2
        volume = all_reduces * 2 * (tp - 1) / tp * b * T * d + (tp - 1) / tp * b * T * V
        tp_s = gas * volume / (gpu.intra_node_gb_s * 1e9)
    if cp > 1:
        kv = 2 * b * T * shape.num_kv_heads * shape.head_dim // tp
        volume = (3 * L + recomputed) * (cp - 1) * kv
        bandwidth = gpu.intra_node_gb_s if tp * cp <= lay.gpus_per_node else gpu.inter_node_gb_s
        cp_s = gas * volume / (bandwidth * 1e9)
    return tp_s, cp_s


def all_to_alls_per_micro_batch(shape: ModelShape, policy: str) -> int:
    """EP's all-to-alls of one micro-batch: dispatch and combine of every MoE layer in forward and in backward, and
    again in every forward full or every_N recomputes (selective keeps their outputs, with those of the matmuls and
    attention: pretrain/model/activation_checkpointing.py)."""
    from pretrain.recipe.recompute import checkpointed_blocks

    L = shape.num_layers
    recomputed = 0 if policy == "selective" else checkpointed_blocks(policy, L)
    return 4 * L + 2 * recomputed


def expert_parallel_comm(est: memory.MemoryEstimate, gpu: hardware.GpuSpec) -> float:
    """EP's exposed token all-to-alls per optimizer step, per GPU, in seconds (the module docstring): GAS x
    ``all_to_alls_per_micro_batch`` x (EP - 1)/EP x T k d b, on NVLink when an EP group fits a node, else the
    network; exposed in full."""
    w, lay, shape = est.workload, est.layout, est.shape
    ep = lay.ep_size
    if ep == 1:
        return 0.0
    b = memory.workload.PRECISION_BYTES[w.precision]
    one = memory.parallel.all_to_all_bytes(shape, w.micro_batch_size * w.seq_len, b)
    volume = all_to_alls_per_micro_batch(shape, w.activation_checkpointing) * (ep - 1) / ep * one
    bandwidth = gpu.intra_node_gb_s if lay.gpus_per_node % ep == 0 else gpu.inter_node_gb_s
    return (w.grad_accum_steps or 1) * volume / (bandwidth * 1e9)


def throughput(est: memory.MemoryEstimate, gpu: hardware.GpuSpec, base_mfu: float = DEFAULT_BASE_MFU
               ) -> tuple[float, float, float, float, float]:
    """(compute s, exposed comm s, comm volume in Ψ units, offload s, tokens/s per GPU) per optimizer step."""
    w, lay, shape = est.workload, est.layout, est.shape
    gas = w.grad_accum_steps or 1
    tokens = w.micro_batch_size * w.seq_len
    # TP and CP ranks share a data-parallel rank's tokens: each GPU computes 1/(TP x CP) of them, on micro-batches
    # of seq / CP tokens per sequence
    split = lay.tp_size * lay.cp_size
    tokens_per_step = tokens * gas / split
    flops = shape.flops_per_token(w.seq_len, w.activation_checkpointing).hardware_flops * tokens_per_step
    rate = gpu.bf16_tflops * 1e12 * base_mfu * mbs_efficiency(tokens // lay.cp_size)
    compute = flops / rate
    N = lay.world_size // lay.tp_size  # the ranks FSDP shards over (dp_shard x cp); the world without TP
    tp_plan = memory.parallel.tensor_parallel(shape, lay.tp_size)
    P = tp_plan.local(shape) if tp_plan else est.num_params  # one TP rank's parameters
    b = 2 if w.precision != "fp32" else 4
    # gradients travel in the dtype they are reduced in: fp32 for bf16 recipes unless precision.reduce_dtype=bf16
    r = 4 if w.precision == "fp32" or w.fp32_grads else b
    G = lay.hybrid_shard_size * lay.cp_size if lay.hybrid_shard_size else None
    # (bytes per parameter per step, ranks in the collective, whether they share a node: NVLink, else the network[,
    # the parameters it moves: P unless given])
    single, in_node = lay.num_nodes == 1, bool(G) and G * lay.tp_size <= lay.gpus_per_node
    if lay.engine == "ddp":
        # DDP's gradients are fp32 under autocast; precision.reduce_dtype=bf16 compresses the all-reduce
        key, r = "ddp", (2 if w.precision == "bf16" and not w.fp32_grads else 4)
        collectives = [(2.0 * r, N, single)]
    elif lay.engine == "fsdp":
        key = "fsdp"
        gathers = 2.0 * gas if lay.fsdp_sharding == "FULL_SHARD" else float(gas)
        reduces = float(gas) if w.sync_each_micro_batch else 1.0  # no_sync: once per optimizer step
        ep = memory.parallel.expert_parallel(shape, lay.ep_size)
        if G:  # HSDP: gathers and the reduce-scatter inside the group, then the shard all-reduced across replicas
            collectives = [(gathers * b, G, in_node), (reduces * r, G, in_node),
                           (reduces * 2.0 * r / G, lay.num_replicas, False)]
        elif ep is not None:  # EP: the dense part over the world, each rank's experts over their copies only
            experts = ep.num_layers * ep.expert_block
            collectives = [(gathers * b + reduces * r, N, single, P - experts),
                           (gathers * b + reduces * r, lay.efsdp_size, single, experts // ep.size)]
        else:
            collectives = [(gathers * b + reduces * r, N, single)]
    else:
        key = lay.zero_stage
        reduces, gathers = {0: (2.0, 0.0), 1: (1.0, 1.0), 2: (float(gas), 1.0), 3: (float(gas), 2.0 * gas)}[key]
        if key == 1 and w.fp32_grads:
            reduces = 2.0  # BF16_Optimizer all-reduces its full fp32 gradient buffer
        if G:  # hpZ: backward gathers from the secondary partition inside the group
            collectives = [(reduces * r + gathers / 2 * b, N, single), (gathers / 2 * b, G, in_node)]
        else:
            collectives = [(reduces * r + gathers * b, N, single)]
    collectives = [(v, ranks, inside, *(moved or (P,))) for v, ranks, inside, *moved in collectives]
    volume = sum(v * params for v, _, _, params in collectives) / P  # bytes per parameter per step
    comm = 0.0
    for v, ranks, inside, params in collectives:
        if ranks > 1:
            bandwidth = (gpu.intra_node_gb_s if inside else gpu.inter_node_gb_s) * 1e9
            comm += v * params * (ranks - 1) / ranks / bandwidth * _EXPOSED[key]
    tp_s, cp_s = model_parallel_comm(est, gpu)
    comm += tp_s + cp_s + expert_parallel_comm(est, gpu)
    offload = 0.0
    part = P / N
    params_on_host = lay.offload_params != "none"
    if lay.offload_optimizer != "none" or (lay.engine == "fsdp" and params_on_host):
        offload += part * lay.gpus_per_node / HOST_OPTIMIZER_PARAMS_PER_S + (4 + b) * part * gas / (PCIE_GB_S * 1e9)
    if params_on_host:
        offload += 2 * b * part * gas / (PCIE_GB_S * 1e9)
    return compute, comm, volume, offload, tokens_per_step / (compute + comm + offload)


def mbs_efficiency(tokens: int) -> float:
    """The fraction of the base rate a micro-batch of ``tokens`` tokens reaches: T / (T + 1024)."""
    return tokens / (tokens + MBS_HALF_RATE_TOKENS)


@dataclass(frozen=True)
class Calibration:
    """The base MFU the step-time model computes at, and where it comes from."""

    base_mfu: float
    source: str

    def describe(self) -> str:
        return f"base MFU {self.base_mfu:.1%} ({self.source})"


DEFAULT_CALIBRATION = Calibration(DEFAULT_BASE_MFU, DEFAULT_MFU_SOURCE)


def read_calibration(path: str | Path, gpu: hardware.GpuSpec) -> Calibration:
    """The base MFU for ``gpu`` from a calibration file: a JSON list of measured rows, each an object with
    ``gpu`` (a name the GPU table knows, or the CUDA device name: rows count for every GPU of that card), ``mfu`` (the measured model-FLOPs utilization as a fraction, e.g.
    0.38), ``seq_len`` and ``mbs`` (the micro-batch the run had), optionally ``hfu`` (used instead of ``mfu``
    when the run recomputed activations: the model compares hardware FLOPs), ``model`` and ``params``.
    Each row gives mfu / (T / (T + 1024)) with T = mbs x seq_len, the base the model's MBS effect starts
    from; the median of the rows for ``gpu`` is the base. No row for this GPU: the default, saying so."""
    file = Path(path)
    try:
        rows = json.loads(file.read_text())
    except OSError as exc:
        raise ConfigError(f"calibration file {file}: cannot be read ({exc.strerror or exc}); pass a JSON list of "
                          "measured rows (tools/bench_gpu.py writes one) or leave out --calibration") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"calibration file {file} is not valid JSON: {exc}; fix it, or remove it to plan with the "
                          "default base MFU") from None
    if not isinstance(rows, list):
        raise ConfigError(f"calibration file {file}: expected a JSON list of rows "
                          '[{"gpu": "H100-80GB", "mfu": 0.38, "seq_len": 4096, "mbs": 2, ...}], got a '
                          f"{type(rows).__name__}")
    bases, cards = [], set()
    for i, row in enumerate(rows):
        where = f"calibration file {file}, row {i}"
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected an object with gpu, mfu, seq_len and mbs, got {row!r}")
        missing = [k for k in ("gpu", "mfu", "seq_len", "mbs") if k not in row]
        if missing:
            raise ConfigError(f"{where}: missing {', '.join(missing)} (each row needs gpu, mfu, seq_len and mbs)")
        utilization = row.get("hfu", row["mfu"])
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
            raise ConfigError(f"{where}: mfu/hfu = {utilization!r}; give the measured utilization as a fraction in "
                              "(0, 1], e.g. 0.38 for 38%")
        for key in ("seq_len", "mbs"):
            if isinstance(row[key], bool) or not isinstance(row[key], int) or row[key] < 1:
                raise ConfigError(f"{where}: {key} = {row[key]!r}; give a whole number >= 1")
        card = _row_card(str(row["gpu"]), where)
        cards.add(card)
        if card == gpu.card:
            bases.append(utilization / mbs_efficiency(row["mbs"] * row["seq_len"]))
    if not bases:
        others = f" (it has {', '.join(sorted(cards))})" if cards else " (it has no rows)"
        return Calibration(DEFAULT_BASE_MFU, f"{file} has no measurement on {gpu.card or gpu.name}{others}; "
                                             f"{DEFAULT_MFU_SOURCE}")
    base = min(1.0, statistics.median(bases))
    return Calibration(base, f"median of {len(bases)} measurement{'s' if len(bases) > 1 else ''} on {gpu.card} in "
                             f"{file}, each MFU / (T / (T + 1024)) at its own micro-batch of T tokens")


def _row_card(name: str, where: str) -> str:
    """The card (hardware.CARDS key) of a calibration row's GPU: a name --gpu accepts ("H100-80GB") or the
    device's own name ("NVIDIA H100 80GB HBM3", torch.cuda.get_device_name()). MFU is a fraction of the card's
    peak, so rows of one card calibrate every memory size of it."""
    try:
        return hardware.find_gpu(name).card
    except ConfigError as exc:
        card = hardware.match_device(name)
        if card is None:
            raise ConfigError(f"{where}: {exc} (or a CUDA device name such as 'NVIDIA H100 80GB HBM3')") from None
        return card


def default_calibration_path(recipe) -> Path:
    """<cache root>/calibration.json (the data cache's root: data.cache_dir, $PRETRAIN_CACHE_DIR or
    ~/.cache/pretrain)."""
    from pretrain.data.cache import cache_root

    return cache_root(recipe.data) / CALIBRATION_FILE


def calibration(recipe, gpu: hardware.GpuSpec, path: str | Path | None = None) -> Calibration:
    """The base MFU for planning ``recipe`` on ``gpu``: the given file's, else the default file's when it exists,
    else DEFAULT_BASE_MFU."""
    if path is None:
        path = default_calibration_path(recipe)
        if not path.is_file():
            return DEFAULT_CALIBRATION
    return read_calibration(path, gpu)


def _model_parallel_problem(shape: ModelShape, workload: memory.Workload, layout: Launch) -> str | None:
    """Why the recipe cannot run this TP / CP / EP layout (the estimator's refusal, which is the launch's), or None."""
    try:
        memory.parallel.tensor_parallel(shape, layout.tp_size)
        memory.parallel.expert_parallel(shape, layout.ep_size)
        memory.parallel.check_context_parallel(workload.seq_len, layout.cp_size, workload.attention,
                                               workload.document_masking)
    except ConfigError as exc:
        return str(exc)
    return None


def _estimates(recipe, nodes: int, gpus: int, gpu: hardware.GpuSpec, buffers: memory.DeepSpeedBuffers | None = None,
               skipped: dict[str, list[str]] | None = None):
    """(layout, recompute, MBS, GAS, estimate) for every combination the planner considers, fitting or not.
    ``skipped`` collects the TP / CP / EP layouts the recipe cannot run, by reason. The layouts are the planner's
    (``layouts``), whatever model.moe.ep_size the recipe sets: a pick whose EP differs says so in its overrides."""
    shape = ModelShape.from_recipe(recipe)
    buffers = buffers or memory.DeepSpeedBuffers.from_recipe(recipe)
    world = nodes * gpus
    gbs = local_batch_size(recipe.batch, world) * world
    # The recipe's workload (one home: Workload.from_recipe); each candidate below varies its batch split and policy.
    base = memory.Workload.from_recipe(recipe, BatchPlan(gbs, gbs // world, 1, world, recipe.data.seq_len))
    for layout in layouts(nodes, gpus, shape.num_experts):
        if layout.uses_deepspeed and layout.zero_stage == 0 and base.fp32_grads:
            continue  # ZeRO-0 cannot accumulate bf16 gradients in fp32 (the launch refuses it)
        if layout.tp_size > 1 or layout.cp_size > 1 or layout.ep_size > 1:
            why = _model_parallel_problem(shape, base, layout)
            if why:
                if skipped is not None:
                    skipped.setdefault(why, []).append(layout_name(layout))
                continue
        dp = layout.data_parallel_size
        if dp != world and gbs % dp:
            continue  # a TP / CP layout whose data-parallel ranks do not divide the batch (the world's own error stays)
        for ckpt in PLANNER_POLICIES:
            if layout.uses_deepspeed and layout.zero_stage == 3 and not runs_under_zero3(ckpt):
                continue  # the launch refuses it (deepspeed_config)
            for mbs in micro_batch_sizes(recipe.batch, dp):
                gas = gbs // (mbs * dp)
                # FSDP with accumulation: no_sync (unsharded gradients, one reduce-scatter) or a reduce-scatter
                # after every micro-batch (batch.sync_each_micro_batch: sharded gradients, GAS of them)
                sharded = layout.engine == "fsdp" and layout.fsdp_sharding != "NO_SHARD"
                for sync_each in ((False, True) if sharded and gas > 1 else (False,)):
                    workload = replace(base, micro_batch_size=mbs, activation_checkpointing=ckpt, grad_accum_steps=gas,
                                       sync_each_micro_batch=sync_each)
                    yield layout, ckpt, mbs, gas, memory.estimate_shape(
                        shape, workload, layout, buffers=buffers, gpu=gpu, async_checkpoint=recipe.checkpoint.async_)


def plan(recipe, nodes: int, gpus: int, gpu: hardware.GpuSpec, buffers: memory.DeepSpeedBuffers | None = None,
         host_memory_gib: float = 1024.0, base_mfu: float = DEFAULT_BASE_MFU,
         skipped: dict[str, list[str]] | None = None):
    """(feasible candidates best first, number considered). Offload must also fit the host's memory. Layouts the
    launch refuses today (CP) are ranked after every runnable one, so the first candidate is always one to run."""
    feasible, considered = [], 0
    cp_ok = cp_runs()
    for layout, ckpt, mbs, gas, est in _estimates(recipe, nodes, gpus, gpu, buffers, skipped):
        considered += 1
        if not est.fits or est.host_bytes_per_node > host_memory_gib * memory.GIB:
            continue
        compute, comm, volume, offload, rate = throughput(est, gpu, base_mfu)
        tp_s, cp_s = model_parallel_comm(est, gpu)
        feasible.append(Candidate(layout, ckpt, mbs, gas, est, compute, comm, volume, offload, rate, tp_s, cp_s,
                                  expert_parallel_comm(est, gpu), runs=cp_ok or layout.cp_size == 1))
    # ties (selective's recompute is elementwise work the FLOPs model does not count) go to less recompute
    feasible.sort(key=lambda c: (not c.runs, c.tight, c.offload_s > 0, -round(c.tokens_per_s, 6),
                                 PLANNER_POLICIES.index(c.checkpointing), c.comm_volume,
                                 c.layout.gpus_per_node % c.layout.ep_size != 0, -c.micro_batch_size))
    return feasible, considered


def family(c: Candidate) -> str:
    """The layout family the explanation compares: ZeRO / FSDP / HSDP (data parallel only), then TP, CP and EP ones."""
    lay = c.layout
    if lay.engine != "fsdp" or (lay.tp_size == 1 and lay.cp_size == 1 and lay.ep_size == 1):
        return "DDP" if lay.engine == "ddp" else "ZeRO" if lay.uses_deepspeed else "FSDP / HSDP"
    dims = (["HSDP" if lay.hybrid_shard_size else "FSDP"] + ["TP"] * (lay.tp_size > 1) + ["CP"] * (lay.cp_size > 1)
            + ["EP"] * (lay.ep_size > 1))
    return " x ".join(dims)


def explain_choice(ranked: list[Candidate], skipped: dict[str, list[str]] | None = None) -> list[str]:
    """Why the first candidate: the best of every layout family beside it (tokens/s, memory, what costs time), and
    the TP / CP layouts the recipe cannot run, with the reason."""
    if not ranked:
        return []
    best, lines, seen = ranked[0], [], {}
    for c in ranked:
        seen.setdefault(family(c), c)
    lines.append(f"chose {best.name}, MBS {best.micro_batch_size}, {recompute_label(best.checkpointing)}: "
                 f"~{best.tokens_per_s:,.0f} tok/s/GPU, {best.estimate.total_gib:.1f} GiB per GPU; the best of each "
                 "family:")
    for name, c in seen.items():
        ratio = c.tokens_per_s / best.tokens_per_s
        why = []
        if c.offload_s:
            why.append(f"offload {c.offload_s:.0f} s")
        if c.checkpointing != "none":
            why.append(f"{recompute_label(c.checkpointing)} to fit")
        if c.tp_comm_s:
            why.append(f"TP all-reduces {c.tp_comm_s:.0f} s")
        if c.cp_comm_s:
            why.append(f"CP K/V exchange {c.cp_comm_s:.0f} s")
        if c.ep_comm_s:
            why.append(f"EP all-to-alls {c.ep_comm_s:.1f} s")
        fsdp_s = c.comm_s - c.tp_comm_s - c.cp_comm_s - c.ep_comm_s
        if fsdp_s > 0.01:
            why.append(f"sharding collectives {fsdp_s:.0f} s")
        if not c.runs:
            why.append("not runnable yet: pretrain refuses cp_size")
        elif c.tokens_per_s > best.tokens_per_s and c.offload_s and not best.offload_s:
            # the sort's rule, said where it overrides the model's tokens/s (the module docstring)
            why.append("not chosen: CPU offload ranks after every layout without it (its cost depends on the host "
                       "far more than this model knows, and it needs host memory)")
        elif c.tokens_per_s > best.tokens_per_s and c.tight and not best.tight:
            why.append(f"not chosen: tight (under {TIGHT_FRACTION:.0%} of the GPU free)")
        lines.append(f"  {name:<16} {c.name}, MBS {c.micro_batch_size}: ~{c.tokens_per_s:,.0f} tok/s/GPU ({ratio:.0%}), "
                     f"{c.estimate.total_gib:.1f} GiB; compute {c.compute_s:.0f} s"
                     + (f" + {', '.join(why)}" if why else ""))
    for reason, names in (skipped or {}).items():
        lines.append(f"  not considered: {', '.join(sorted(set(names))[:3])}{' ...' if len(set(names)) > 3 else ''}: "
                     f"{reason}")
    return lines + explain_expert_parallel(ranked)


def _sharding_s(c: Candidate) -> float:
    """Of a candidate's exposed communication: the sharding collectives (FSDP's or ZeRO's gathers and reductions)."""
    return c.comm_s - c.tp_comm_s - c.cp_comm_s - c.ep_comm_s


def explain_expert_parallel(ranked: list[Candidate]) -> list[str]:
    """A mixture of experts: why the best EP layout wins or loses against the best without EP, in seconds per step
    (its all-to-alls against the expert traffic it saves) and GiB per GPU. Nothing for a dense model (no EP
    layout is ranked)."""
    ep = next((c for c in ranked if c.layout.ep_size > 1), None)
    other = next((c for c in ranked if c.layout.ep_size == 1), None)
    if ep is None or other is None:
        return []
    lay, shape, w = ep.layout, ep.estimate.shape, ep.estimate.workload
    b = memory.workload.PRECISION_BYTES[w.precision]
    tokens = w.micro_batch_size * w.seq_len
    a2a = memory.parallel.all_to_all_bytes(shape, tokens, b)
    where = "inside a node (NVLink)" if lay.gpus_per_node % lay.ep_size == 0 else "across nodes (the network)"
    local, E = shape.num_experts // lay.ep_size, shape.num_experts
    other_comm = f"communication {other.comm_s:.2f} s" + (f" + offload {other.offload_s:.2f} s" if other.offload_s else "")
    return [
        f"expert parallelism {'wins' if ranked[0] is ep else 'loses'}: {ep.name}, MBS {ep.micro_batch_size}, "
        f"{recompute_label(ep.checkpointing)}: ~{ep.tokens_per_s:,.0f} tok/s/GPU against ~{other.tokens_per_s:,.0f} "
        f"({ep.tokens_per_s / other.tokens_per_s:.0%}) for {other.name}, MBS {other.micro_batch_size}, the best "
        "without EP",
        f"  per step: compute {ep.compute_s:.2f} s + EP all-to-alls {ep.ep_comm_s:.2f} s + sharding collectives "
        f"{_sharding_s(ep):.2f} s, against compute {other.compute_s:.2f} s + {other_comm}",
        f"  EP {lay.ep_size}'s all-to-alls {where}: {all_to_alls_per_micro_batch(shape, w.activation_checkpointing)} per "
        f"micro-batch (4 per MoE layer, 2 more per recomputed one) x GAS {ep.grad_accum_steps}, each T {tokens:,} x "
        f"top-{shape.experts_per_token} x d {shape.hidden_size:,} x {b} B = {a2a / 1e9:.2f} GB of which "
        f"{lay.ep_size - 1}/{lay.ep_size} leave the GPU; its sharding collectives move each GPU's {local} of {E} "
        f"experts among their {lay.efsdp_size} cop{'ies' if lay.efsdp_size > 1 else 'y'}, not every expert to every GPU",
        f"  memory: {ep.estimate.total_gib:.1f} GiB per GPU against {other.estimate.total_gib:.1f}: the shards are Ψ/N "
        f"with or without EP, but what a GPU unshards holds {local} of each block's {E} experts",
    ]


MAX_SEARCH_GPUS = 16384
"""The largest world the search for a cluster that fits looks at."""


def _larger_worlds(recipe, nodes: int, gpus: int) -> tuple[list[tuple[int, int]], bool]:
    """(nodes, GPUs per node) for worlds larger than the given one, smallest first: more GPUs in a single node
    (up to 8), more nodes of ``gpus`` GPUs. With a global batch only the worlds it divides by (all of them, so
    the first that fits is the fewest GPUs); with local_batch_size the node count doubles (not exhaustive).
    And whether the list is exhaustive."""
    gbs = recipe.batch.global_batch_size
    out = [(1, g) for g in range(gpus + 1, 9)] if nodes == 1 else []
    if gbs is None:
        out += [(nodes * 2**k, gpus) for k in range(1, 32) if nodes * 2**k * gpus <= MAX_SEARCH_GPUS]
    else:
        out += [(n, gpus) for n in range(nodes + 1, MAX_SEARCH_GPUS // gpus + 1)]
        out = [(n, g) for n, g in out if gbs % (n * g) == 0]
    return sorted(out, key=lambda w: (w[0] * w[1], w[0])), gbs is not None


def _smallest_fit(recipe, nodes: int, gpus: int, gpu: hardware.GpuSpec, host_memory_gib: float):
    """(nodes, GPUs per node, best candidate, exhaustive) for the first of ``_larger_worlds`` that some layout
    fits, or None. A larger world only shrinks what each GPU holds, so the first that fits is the smallest."""
    worlds, exhaustive = _larger_worlds(recipe, nodes, gpus)
    for n, g in worlds:
        ranked, _ = plan(recipe, n, g, gpu, host_memory_gib=host_memory_gib)
        if ranked:
            return n, g, ranked[0], exhaustive
    return None


def nothing_fits(recipe, nodes: int, gpus: int, gpu: hardware.GpuSpec, considered: int,
                 host_memory_gib: float = 1024.0) -> str:
    """What to say when ``plan`` finds no layout (pretrain-plan's error, pretrain-launch's and --dry-run's
    advice): the smallest layout's need, then what would fit: more GPUs (the fewest), CPU offload with more
    host memory, a larger GPU."""
    smallest = min(_estimates(recipe, nodes, gpus, gpu), key=lambda e: (e[4].total_bytes, e[4].host_bytes_per_node))
    layout, ckpt, mbs, gas, est = smallest
    sync_each = ", reduce-scatter each micro-batch" if est.workload.sync_each_micro_batch else ""
    lowest = (f"{layout_name(layout)}{sync_each}, MBS {mbs}, GAS {gas}, {recompute_label(ckpt)}: "
              f"{est.total_gib:,.1f} GiB per GPU")
    if est.host:
        lowest += f" and {est.host_bytes_per_node / memory.GIB:,.0f} GiB of CPU memory per node"
    lines = [f"no layout of {recipe.name} fits {nodes} x {gpus} {gpu.name} ({gpu.memory_gib:,.1f} GiB; {considered} "
             f"considered: DDP, ZeRO-0 to 3, FSDP, FSDP and HSDP x TP, FSDP x CP, "
             + ("FSDP x EP, " if recipe.model.moe is not None else "") + f"CPU offload with {host_memory_gib:g} "
             "GiB of CPU memory per node, "
             "every power-of-two MBS down to 1, activation checkpointing none, selective, every_2 and full). The "
             "smallest is "
             f"{lowest}. What would fit:"]
    found = _smallest_fit(recipe, nodes, gpus, gpu, host_memory_gib)
    if found and found[2].offload_s > 0:  # the fewest GPUs need offload: also the fewest that do not
        found = [found, _smallest_fit(recipe, found[0], found[1], gpu, host_memory_gib=0.0)]
    else:
        found = [found]
    for fit in found:
        if fit is None:
            lines.append(f"- more GPUs: no world of up to {MAX_SEARCH_GPUS:,} {gpu.name} that divides the global batch "
                         f"fits{' without offload' if len(found) > 1 else ''}")
            continue
        n, g, best, exhaustive = fit
        fewest = "the fewest that fit" if exhaustive else "doubling the nodes"
        lines.append(f"- more GPUs: {n} x {g} {gpu.name} ({n * g} GPUs, {fewest}"
                     f"{' without offload' if best.offload_s == 0 and len(found) > 1 else ''}): {best.name}, MBS "
                     f"{best.micro_batch_size}, GAS {best.grad_accum_steps}, "
                     f"{recompute_label(best.checkpointing)}: {best.estimate.total_gib:,.1f} GiB per "
                     f"GPU (pretrain-plan with --nodes {n} --gpus-per-node {g} writes its config)")
    offloaded, _ = plan(recipe, nodes, gpus, gpu, host_memory_gib=float("inf"))
    if offloaded:
        best = offloaded[0]
        need = best.estimate.host_bytes_per_node / memory.GIB
        lines.append(f"- CPU offload on {nodes} x {gpus} {gpu.name}: {best.name}, MBS {best.micro_batch_size}, "
                     f"{recompute_label(best.checkpointing)}: {best.estimate.total_gib:,.1f} GiB per "
                     f"GPU and {need:,.0f} GiB of CPU memory per node (if the nodes have it: pretrain-plan with "
                     f"--host-memory-gib {math.ceil(need)}; slow: the optimizer steps on the CPU)")
    else:
        lines.append(f"- CPU offload on {nodes} x {gpus} {gpu.name}: does not fit either, whatever the CPU memory")
    larger = [g for g in hardware.GPUS.values() if g.memory_mib > gpu.memory_mib and g.bf16_tflops]
    for other in sorted(larger, key=lambda g: g.memory_mib):
        ranked, _ = plan(recipe, nodes, gpus, other, host_memory_gib=host_memory_gib)
        if ranked:
            best = ranked[0]
            lines.append(f"- a larger GPU: {nodes} x {gpus} {other.name}: {best.name}, MBS {best.micro_batch_size}, "
                         f"{best.estimate.total_gib:,.1f} GiB per GPU")
            break
    lines.append("- or a shorter data.seq_len (activations and logits shrink with it)")
    return "\n".join(lines)


def default_output(recipe, nodes: int, gpus: int, gpu: hardware.GpuSpec) -> Path:
    """Where pretrain-plan writes the best layout's accelerate config unless given --output."""
    return runs_root() / "plan" / f"{recipe.name}-{nodes}x{gpus}-{gpu.name}.yaml"


def accelerate_config(c: Candidate, recipe_path: str) -> str:
    lay = c.layout
    lines = [
        f"# Written by pretrain-plan for {recipe_path}: {c.name}, MBS {c.micro_batch_size}, GAS {c.grad_accum_steps}, "
        f"activation checkpointing {c.checkpointing}.",
        f"# Estimated {c.estimate.total_gib:.1f} GiB per GPU of {c.estimate.gpu.memory_gib:.1f} ({c.estimate.gpu.name}).",
        "# The recipe owns precision and batch sizes: keep mixed_precision 'no' here.",
        *([f"# EP {lay.ep_size} is the recipe's: launch with model.moe.ep_size={lay.ep_size} (accelerate's "
           f"parallelism_config has no expert dimension); {EP_CONFIG} is this layout's 8-GPU config."]
          if lay.ep_size > 1 else []),
        "compute_environment: LOCAL_MACHINE",
    ]
    if lay.engine == "ddp":
        lines.append("distributed_type: MULTI_GPU" if lay.world_size > 1 else "distributed_type: 'NO'")
    elif lay.engine == "fsdp":
        lines += ["distributed_type: FSDP", FSDP_CONFIG.format(
            reshard="true" if lay.fsdp_sharding == "FULL_SHARD" else "false",
            offload="true" if lay.offload_params != "none" else "false")]
        if lay.hybrid_shard_size:  # HSDP: accelerate's device mesh, as accelerate_configs/multinode_hsdp.yaml
            lines += ["parallelism_config:", f"  parallelism_config_dp_replicate_size: {lay.num_replicas}",
                      f"  parallelism_config_dp_shard_size: {lay.hybrid_shard_size}"]
        elif lay.tp_size > 1 or lay.cp_size > 1:  # as accelerate_configs/fsdp2_tp2.yaml
            lines += ["parallelism_config:", f"  parallelism_config_dp_shard_size: {lay.data_parallel_size}"]
        if lay.tp_size > 1:
            lines.append(f"  parallelism_config_tp_size: {lay.tp_size}")
        if lay.cp_size > 1:
            lines.append(f"  parallelism_config_cp_size: {lay.cp_size}")
    elif lay.hybrid_shard_size:  # ZeRO-3 + hpZ: the ZeRO block is the shipped JSON's (accelerate has no hpZ key)
        lines += ["distributed_type: DEEPSPEED", "deepspeed_config:", "  deepspeed_multinode_launcher: standard",
                  f"  deepspeed_config_file: {HPZ_JSON}   # relative to the directory you launch from",
                  "  zero3_init_flag: true"]
    else:
        lines += ["distributed_type: DEEPSPEED", "deepspeed_config:"]
        if lay.num_nodes > 1:
            lines.append("  deepspeed_multinode_launcher: standard")
        lines += [
            f"  zero_stage: {lay.zero_stage}",
            f"  offload_optimizer_device: {lay.offload_optimizer}",
            f"  offload_param_device: {lay.offload_params}",
            f"  zero3_init_flag: {'true' if lay.zero_stage == 3 else 'false'}",
        ]
        if lay.zero_stage == 3:
            lines.append("  zero3_save_16bit_model: true")
    lines += [f"num_machines: {lay.num_nodes}", f"num_processes: {lay.world_size}", "machine_rank: 0"]
    if lay.num_nodes > 1:
        lines += ["main_process_ip: 127.0.0.1   # the first node's address; or pass --main_process_ip",
                  "main_process_port: 29500"]
    lines += ["mixed_precision: 'no'", "main_training_function: main", "rdzv_backend: static", "same_network: true",
              "use_cpu: false"]
    return "\n".join(lines) + "\n"


def recipe_overrides(recipe, c: Candidate) -> list[str]:
    batch, out = recipe.batch, []
    moe = recipe.model.moe
    if moe is not None and c.layout.ep_size != moe.ep_size:  # EP's size is the recipe's (no accelerate dimension)
        out.append(f"model.moe.ep_size={c.layout.ep_size}")
    if batch.local_batch_size is not None:
        if c.micro_batch_size != batch.local_batch_size:
            out += ["batch.local_batch_size=null", f"batch.global_batch_size={c.estimate.workload.global_batch_size}",
                    f"batch.micro_batch_size={c.micro_batch_size}"]
    elif batch.micro_batch_size is not None:
        if c.micro_batch_size != batch.micro_batch_size:
            out.append(f"batch.micro_batch_size={c.micro_batch_size}")
    elif c.grad_accum_steps != batch.gradient_accumulation_steps:
        out.append(f"batch.gradient_accumulation_steps={c.grad_accum_steps}")
    if c.checkpointing != recipe.model.activation_checkpointing:
        out.append(f"model.activation_checkpointing={c.checkpointing}")
    if not c.layout.uses_deepspeed and c.sync_each_micro_batch != batch.sync_each_micro_batch:
        out.append(f"batch.sync_each_micro_batch={str(c.sync_each_micro_batch).lower()}")
    return out


def launch_command(c: Candidate, config_path: str, recipe_path: str, overrides: list[str]) -> str:
    """The launch of ``c``: ``config_path`` (the config pretrain-plan wrote), or for FSDP2 x EP the shipped EP_CONFIG
    with this world's processes (its EP size is in ``overrides``: model.moe.ep_size)."""
    lay, node_args = c.layout, []
    if lay.ep_size > 1:
        config_path = EP_CONFIG
        node_args = (["--num_machines", str(lay.num_nodes)] if lay.num_nodes > 1 else []) + [
            "--num_processes", str(lay.world_size)]
    if lay.num_nodes > 1:
        node_args += ["--machine_rank", "$NODE_RANK", "--main_process_ip", "$MASTER_ADDR", "--main_process_port", "29500"]
    return shell_join(accelerate_command(recipe_path, overrides, config_file=config_path, accelerate_args=node_args,
                                         launcher=["accelerate", "launch"], run_py="pretrain/run.py"))
