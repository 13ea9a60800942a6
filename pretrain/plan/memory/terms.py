"""A term of the estimate: bytes with the formula that produced them, and their value in each phase."""

from __future__ import annotations

from dataclasses import dataclass, fields

GIB = 2**30


@dataclass(frozen=True)
class Phases:
    """Bytes of one term in each phase, for terms that change between them (gradients, buffers): at the
    start of backward (activations at their peak), during the gradient reduction, inside step()."""

    backward: int
    reduction: int
    step: int

    @classmethod
    def constant(cls, num_bytes: int) -> Phases:
        return cls(num_bytes, num_bytes, num_bytes)

    @property
    def peak(self) -> int:
        return max(self.backward, self.reduction, self.step)


PHASES = tuple(f.name for f in fields(Phases))


@dataclass(frozen=True)
class Term:
    key: str
    label: str
    bytes: int
    """At the term's own peak."""
    formula: str
    """The formula with the numbers put in."""
    phases: Phases | None = None
    """By phase, where the term changes between phases."""

    @classmethod
    def phased(cls, key: str, label: str, phases: Phases, formula: str) -> Term:
        return cls(key, label, phases.peak, formula, phases)

    @property
    def gib(self) -> float:
        return self.bytes / GIB

    def at(self, phase: str) -> int:
        """Bytes alive in ``phase`` (one of ``PHASES``)."""
        return getattr(self.phases, phase) if self.phases is not None else self.bytes


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:,.2f} GiB"


def num(x: int) -> str:
    return f"{x:,}"
