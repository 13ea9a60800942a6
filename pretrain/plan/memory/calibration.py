"""The activation term's calibration: one factor per kind of run, fitted on peaks measured on a GPU.

The activation formulas (activations.py) count the tensors eager autograd saves, checked tensor by tensor on CPU
(tests/plan/test_memory_validation.py). Two things move a CUDA run away from them. Compiled blocks save fewer:
Inductor's partitioner recomputes cheap pointwise ops in backward instead of keeping their outputs (llama-1b under
regional compile peaks 18% below the same run eager). And autocast over fp32 weights keeps the residual stream and
the norms in fp32, which the formula counts in the compute dtype (eager saves more than it says). So on CUDA the
activations term is scaled by the factor of its group (eager or compiled, the recompute policy, 16-bit or float8,
the engine),
least squares on the relative error of the group's rows whose peak is the backward phase (the only phase the
activations are in). A group without such a row keeps the formula (factor 1.0) and says so.

``calibration.json`` beside this file holds the measured rows (GPU, versions, each row's recipe and overrides and
its ``torch.cuda.max_memory_allocated``) and the fitted factors; ``python tools/calibrate_memory.py`` refits them
from the rows with the current estimator and prints every row's error (``--add`` takes a GPU visit's
bench_gpu.json), and tests/plan/test_memory_calibration.py fails when the file is stale or a row is more than 10% off.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

FILE = Path(__file__).with_name("calibration.json")
FLOAT8 = "float8"
MARGIN = 0.05
"""A row informs the fit when it measured this much more than the phases without activations hold."""


def group(compile_mode: str, policy: str, precision: str, float8: str, engine: str) -> str:
    """The calibration group of a run: ``compiled|eager / policy / 16-bit|fp32|float8 / engine`` (``compile_mode``
    resolved: none, regional or full, which compile the same blocks; ``engine`` the layout's: ddp for one process
    and DDP, whose autocast computes over fp32 weights, deepspeed and fsdp, which hold 16-bit copies to compute
    with, so their residual stream and norms are 16-bit: a factor fitted on one does not carry to the others)."""
    dtype = FLOAT8 if float8 != "off" else ("fp32" if precision == "fp32" else "16-bit")
    return f"{'eager' if compile_mode == 'none' else 'compiled'}/{policy}/{dtype}/{engine}"


@dataclass(frozen=True)
class Factor:
    group: str
    value: float
    rows: int
    """Measured rows it was fitted on (0: the formula, uncalibrated)."""
    measured_on: str
    """The GPU and versions of those rows."""

    @property
    def text(self) -> str:
        if not self.rows:
            return f"the eager formula as is (no measured row for {self.group})"
        return (f"x {self.value:.2f}, calibrated for {self.group} on {self.rows} measured row(s) ({self.measured_on}; "
                "pretrain/plan/memory/calibration.json)")


@cache
def _load() -> dict:
    return json.loads(FILE.read_text())


def measured_on(data: dict | None = None) -> str:
    data = data or _load()
    return "; ".join(f"{m['gpu']}, torch {m['torch']}, transformers {m['transformers']}" for m in data["measured_on"])


def factor(compile_mode: str, policy: str, precision: str, float8: str, engine: str) -> Factor:
    """The factor on the activations term of a CUDA run of this kind."""
    key = group(compile_mode, policy, precision, float8, engine)
    data = _load()
    fitted = data["factors"].get(key)
    if fitted is None:
        return Factor(key, 1.0, 0, "")
    return Factor(key, fitted["factor"], fitted["rows"], measured_on(data))


# ---- fitting (tools/calibrate_memory.py)


@dataclass(frozen=True)
class Observation:
    """One measured row against the uncalibrated estimate's phases."""

    name: str
    group: str
    measured: int
    """torch.cuda.max_memory_allocated, bytes."""
    activations: int
    """The activations term, uncalibrated."""
    backward_rest: int
    """Everything else alive in the backward phase."""
    other_phases: int
    """The largest of the other phases (gradient reduction, optimizer step): no activations in them."""

    def estimate(self, value: float) -> int:
        return max(self.backward_rest + int(value * self.activations), self.other_phases)

    def error(self, value: float) -> float:
        return self.estimate(value) / self.measured - 1

    @property
    def informative(self) -> bool:
        """Its peak can only be the backward phase: it measured more than every other phase holds (by MARGIN)."""
        return self.activations > 0 and self.measured > (1 + MARGIN) * self.other_phases


def fit(observations: Iterable[Observation]) -> dict[str, dict]:
    """Per group: the factor minimising the squared relative error of its informative rows, rounded up to 0.01
    (the safe side), and how many rows it rests on."""
    by_group: dict[str, list[Observation]] = {}
    for o in observations:
        if o.informative:
            by_group.setdefault(o.group, []).append(o)
    factors = {}
    for key, rows in sorted(by_group.items()):
        num = sum(o.activations * (o.measured - o.backward_rest) / o.measured**2 for o in rows)
        den = sum(o.activations**2 / o.measured**2 for o in rows)
        factors[key] = {"factor": math.ceil(round(num / den * 100, 6)) / 100, "rows": len(rows)}
    return factors
