"""The batch plan: GBS, MBS and GAS for a given world size.

GBS (global batch size) is sequences per optimizer step across all processes; MBS (micro batch size)
is sequences per process per forward/backward; GAS = GBS / (MBS x world). A recipe gives GBS with
either MBS or GAS, or ``local_batch_size`` alone (GAS = 1, GBS = world x local). Nothing is rounded:
a combination that does not divide is an error that lists the valid values for this world size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pretrain.errors import BatchConfigError
from pretrain.recipe.config import AUTO, BatchConfig


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    world_size: int
    seq_len: int

    def __post_init__(self):
        assert self.global_batch_size == self.micro_batch_size * self.grad_accum_steps * self.world_size

    @property
    def local_batch_size(self) -> int:
        """Sequences one process sees per optimizer step."""
        return self.micro_batch_size * self.grad_accum_steps

    @property
    def tokens_per_step(self) -> int:
        """Target tokens per optimizer step across all processes."""
        return self.global_batch_size * self.seq_len

    def as_metrics(self) -> dict[str, int]:
        return {
            "batch/mbs": self.micro_batch_size,
            "batch/gbs": self.global_batch_size,
            "batch/gas": self.grad_accum_steps,
            "batch/tokens_per_step": self.tokens_per_step,
        }

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "tokens_per_step": self.tokens_per_step}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _valid_pairs(gbs: int, world: int) -> str:
    """'MBS x GAS' pairs that reach gbs on this world size, smallest GAS first."""
    if gbs % world:
        return ""
    per_rank = gbs // world
    pairs = [f"micro_batch_size={m} (GAS {per_rank // m})" for m in reversed(_divisors(per_rank))]
    return ", ".join(pairs[:8])


def neighbouring_multiples(value: int, unit: int) -> list[int]:
    """The positive multiples of ``unit`` just below (or at) and just above ``value``."""
    lower = (value // unit) * unit
    return [v for v in (lower, lower + unit) if v > 0]


def _nearest_multiples(value: int, unit: int) -> str:
    return " or ".join(str(v) for v in neighbouring_multiples(value, unit))


def local_batch_size(batch: BatchConfig, world_size: int) -> int:
    """Sequences per process per optimizer step (MBS x GAS): GBS / world, or the recipe's local_batch_size. Raises
    BatchConfigError when the GBS does not divide over the world."""
    if batch.local_batch_size is not None:
        return batch.local_batch_size
    gbs = batch.global_batch_size
    if gbs % world_size:
        raise BatchConfigError(
            f"batch.global_batch_size ({gbs}) is not divisible by the world size ({world_size} processes); "
            f"use global_batch_size={_nearest_multiples(gbs, world_size)} or a world size that divides {gbs}"
        )
    return gbs // world_size


def micro_batch_sizes(batch: BatchConfig, world_size: int, largest: int | None = None) -> list[int]:
    """The MBS a planner or a sweep tries on ``world_size`` processes: the powers of two that divide the local batch
    (GAS = local / MBS, GBS kept), up to ``largest``."""
    local = local_batch_size(batch, world_size)
    return [m for m in (2**i for i in range(local.bit_length())) if local % m == 0 and m <= (largest or local)]


def with_micro_batch_size(batch: BatchConfig, world_size: int, micro_batch_size: int) -> BatchConfig:
    """The batch section with MBS ``micro_batch_size`` and the same global batch on ``world_size`` processes."""
    if micro_batch_size < 1:
        raise BatchConfigError(f"the micro-batch size must be >= 1, got {micro_batch_size}")
    gbs = batch.global_batch_size or batch.local_batch_size * world_size
    return BatchConfig(global_batch_size=gbs, micro_batch_size=micro_batch_size)


def plan_batches(batch: BatchConfig, world_size: int, seq_len: int) -> BatchPlan:
    """Resolve the recipe's batch section for ``world_size`` processes. Raises BatchConfigError."""
    if world_size < 1:
        raise BatchConfigError(f"world size must be >= 1, got {world_size}")
    world = world_size
    if batch.local_batch_size is not None:
        lbs = batch.local_batch_size
        return BatchPlan(lbs * world, lbs, 1, world, seq_len)

    gbs = batch.global_batch_size
    assert gbs is not None
    local_batch_size(batch, world)  # GBS divides over the world
    if batch.micro_batch_size == AUTO:
        raise BatchConfigError(
            "batch.micro_batch_size=auto is chosen against the device (pretrain/plan/auto_batch.py: pretrain/run.py, "
            "--dry-run and pretrain-launch resolve it); this command needs a number: give batch.micro_batch_size=N")
    if batch.micro_batch_size is not None:
        mbs = batch.micro_batch_size
        if gbs % (mbs * world):
            raise BatchConfigError(
                f"batch.global_batch_size ({gbs}) is not divisible by batch.micro_batch_size ({mbs}) x world size "
                f"({world}) = {mbs * world}; valid for GBS {gbs} on {world} processes: {_valid_pairs(gbs, world)}; "
                f"or keep MBS {mbs} with global_batch_size={_nearest_multiples(gbs, mbs * world)}"
            )
        return BatchPlan(gbs, mbs, gbs // (mbs * world), world, seq_len)

    gas = batch.gradient_accumulation_steps
    assert gas is not None
    if gbs % (gas * world):
        raise BatchConfigError(
            f"batch.global_batch_size ({gbs}) is not divisible by batch.gradient_accumulation_steps ({gas}) x "
            f"world size ({world}) = {gas * world}; valid for GBS {gbs} on {world} processes: "
            f"{_valid_pairs(gbs, world)}; or keep GAS {gas} with "
            f"global_batch_size={_nearest_multiples(gbs, gas * world)}"
        )
    return BatchPlan(gbs, gbs // (gas * world), gas, world, seq_len)


def num_training_steps(max_steps: int | None, max_tokens: int | None, plan: BatchPlan) -> int:
    """Optimizer steps of the run: max_steps, or max_tokens rounded up to whole steps."""
    if max_steps is not None:
        return max_steps
    assert max_tokens is not None
    return -(-max_tokens // plan.tokens_per_step)
