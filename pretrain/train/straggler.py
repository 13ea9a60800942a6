"""``runtime.straggler``: a rank persistently slower than the others, named in the log and the run's records, and
acted on.

The evidence is the per-rank step time the run already measures on logging steps (``diagnostics.StepTimer``: each
rank's own part of the step before the gradient synchronisation, gathered by one all-gather): every rank holds the
same list of times, so every rank reaches the same verdict at the same step with no further collective. A logged
step is *slow* when the slowest rank's time is at least ``factor`` times the median of the other ranks' times (and at
least ``MIN_EXCESS_S`` more); a
host is a straggler when the slowest rank of ``window`` slow logged steps in a row is on it. Then:

- ``warn``: the log names the rank, its host and the ratio (once per confirmation, then again only if it gets worse
  or changes hosts); ``output_dir/stragglers.jsonl`` has one line per slow logged step.
- ``exclude`` (under ``pretrain-slurm``): the run stops after the step with a checkpoint, as after a preemption;
  rank 0 adds the host to ``slurm/excluded_hosts`` (``pretrain doctor``'s list) and writes
  ``slurm/exclude_request.json``, and the job's batch script, seeing it once training has exited, submits the job
  again with ``--exclude`` of every excluded host (the path the doctor's failures take). Outside a SLURM job there is
  nothing to requeue: ``exclude`` warns, and says so at the start.

A run on one rank has no straggler. A rank slowed by its place in a collective (ZeRO-3 or FSDP's forward
all-gathers) shows less (docs/troubleshooting.md); the factor is against the others' median, so one slow host of
many stands out while a uniformly slow cluster does not.

Test hook: ``PRETRAIN_TEST_SLOW=<rank>:<seconds>[:<host>]`` makes that rank's every optimizer step that many seconds
longer (inside the timed part), on any host or only on ``<host>`` (``doctor.host_name``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pretrain.checkpoint.rundir import append_record
from pretrain.distributed.doctor import append_excluded
from pretrain.distributed.sbatch import EXCLUDE_REQUEST, EXCLUDED_HOSTS, SLURM_SUBDIR
from pretrain.recipe.config import StragglerConfig

STRAGGLERS_FILE = "stragglers.jsonl"
# A rank at most this much slower than the others' median is no straggler, whatever the ratio: steps of milliseconds
# (a small model on CPU) differ by more than 1.5x in timer noise, and a node that costs under 50 ms a step is not
# worth an allocation.
MIN_EXCESS_S = 0.05
SLOW_ENV = "PRETRAIN_TEST_SLOW"


@dataclass(frozen=True)
class Slow:
    """One slow logged step: the slowest rank, its host, its time, the others' median, and the streak so far."""

    step: int
    rank: int
    host: str
    seconds: float
    others_median_s: float
    ratio: float
    in_a_row: int


def slow_seconds(rank: int, host: str, environ=os.environ) -> float:
    """The test hook: how many seconds longer this rank's optimizer steps take (0: not slowed)."""
    value = environ.get(SLOW_ENV)
    if not value:
        return 0.0
    parts = value.split(":")
    if int(parts[0]) != rank or (len(parts) > 2 and parts[2] != host):
        return 0.0
    return float(parts[1])


class StragglerWatch:
    """The verdicts of ``runtime.straggler`` over the logged steps' per-rank times (``observe``)."""

    def __init__(self, cfg: StragglerConfig, hosts: list[str], output_dir: Path, *, is_main: bool, log,
                 under_slurm: bool):
        self.cfg, self.hosts, self.output_dir = cfg, hosts, Path(output_dir)
        self.is_main, self.log = is_main, log
        self.can_exclude = cfg.action == "exclude" and under_slurm
        self.streak: Slow | None = None
        self.warned: Slow | None = None
        self.excluded: Slow | None = None  # set once: the run stops after this step
        if cfg.action == "exclude" and not under_slurm:
            log("runtime.straggler.action=exclude: this run is not a SLURM job (no SLURM_JOB_ID), so a straggler host "
                "is named but not excluded (the job of pretrain-slurm submit resubmits itself without it)")

    def observe(self, step: int, times: list[float]) -> Slow | None:
        """Every rank's own step time at logged step ``step``: the slow step if it is one (after it is recorded)."""
        cfg = self.cfg
        if cfg.action == "off" or len(times) < 2:
            return None
        rank = max(range(len(times)), key=times.__getitem__)
        others = statistics.median(t for r, t in enumerate(times) if r != rank)
        ratio = times[rank] / others if others > 0 else float("inf")
        if ratio < cfg.factor or times[rank] - others < MIN_EXCESS_S:
            self.streak = None
            return None
        host = self.hosts[rank]
        in_a_row = self.streak.in_a_row + 1 if self.streak is not None and self.streak.host == host else 1
        slow = Slow(step, rank, host, round(times[rank], 6), round(others, 6), round(ratio, 3), in_a_row)
        self.streak = slow
        if self.is_main:
            append_record(self.output_dir / STRAGGLERS_FILE, {**asdict(slow), "factor": cfg.factor,
                                                              "window": cfg.window, "time": round(time.time(), 3)})
        if in_a_row >= cfg.window:
            self._act(slow)
        return slow

    def _act(self, slow: Slow) -> None:
        if self.can_exclude and self.excluded is None:
            self.excluded = slow
            if self.is_main:
                slurm_dir = self.output_dir / SLURM_SUBDIR
                append_excluded(slurm_dir / EXCLUDED_HOSTS, [slow.host])
                request = slurm_dir / EXCLUDE_REQUEST
                tmp = request.with_name(f".{request.name}.tmp")
                tmp.write_text(json.dumps({**asdict(slow), "job_id": os.environ.get("SLURM_JOB_ID")}) + "\n")
                os.replace(tmp, request)
            self.log(f"straggler: {self._named(slow)}; runtime.straggler.action=exclude: stopping after this step "
                     f"with a checkpoint, {slow.host} added to {SLURM_SUBDIR}/{EXCLUDED_HOSTS}; the job resubmits "
                     "itself without it")
            return
        last = self.warned
        if last is None or last.host != slow.host or slow.ratio > 1.25 * last.ratio:
            self.warned = slow
            self.log(f"warning: straggler: {self._named(slow)} (runtime.straggler.action={self.cfg.action}; "
                     f"recorded in {STRAGGLERS_FILE})")

    def _named(self, slow: Slow) -> str:
        return (f"rank {slow.rank} on host {slow.host} took {slow.seconds:.3g} s for its part of step {slow.step}, "
                f"{slow.ratio:.2f}x the other ranks' median {slow.others_median_s:.3g} s, {slow.in_a_row} logged steps "
                f"in a row at >= {self.cfg.factor:g}x (runtime.straggler.factor, window {self.cfg.window})")
