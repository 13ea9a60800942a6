"""`pretrain doctor`: a health check of every rank of a launch, judged per host before a run spends its hours.

Each rank measures, under the same launcher as training:

- ``matmul_tflops``: a square matmul in the run's dtype (2 n^3 FLOPs), against the device's dense peak
  (``train/metrics.resolve_peak``, which the command resolves: the hardware table on GPUs, the measured per-core peak
  on CPUs);
- ``memory_gb_s``: a device-to-device tensor copy (bytes read + bytes written);
- ``h2d_gb_s``: a pinned host-to-device copy (GPUs only; a CPU has no device to copy to);
- ``allreduce_busbw_gb_s`` / ``allgather_busbw_gb_s``: over every rank; ``node_allreduce_busbw_gb_s``:
  within this rank's host (one ``new_group`` per host; none for a host with one rank). Bus bandwidth as
  nccl-tests defines it, so that figures compare across world sizes: algbw = bytes / time (bytes = the
  all-reduce's buffer; the all-gather's whole output), busbw = algbw x 2(n-1)/n for all-reduce and
  algbw x (n-1)/n for all-gather (``bus_bandwidth``);
- ``write_mb_s``: a file written to output_dir and fsync'd; and whether every rank sees the file rank 0
  writes there (``accelerator.check_shared_output_dir``).

Each figure is the median of a few short repeats. On GPUs the ranks measure at once (each has its own
device, and concurrent checkpoint writes are what output_dir will see); on CPUs they take turns, because
the processes of one host share its cores and concurrent timings would measure the contention, not the rank.

The verdict (``judge``): a rank fails a figure below ``threshold`` (default 0.8) x the median of that figure
over all ranks that have it; a host fails when any of its ranks fails a figure. The disk (``write_mb_s``) is the
host's, shared by its ranks: a host's best write is judged against the median of the hosts' best writes. An output_dir that some
rank does not see fails the check too, without naming a host to exclude (another node does not mend a
mount). In a real job a slow link slows every rank of a world collective alike, so those figures rarely
single out a host: a slow network shows in the figure itself, against the interconnect and earlier runs.

Test hooks (environment, read here only): ``PRETRAIN_DOCTOR_SLOW_RANK=R[,R...]`` makes those ranks'
timed regions ``PRETRAIN_DOCTOR_SLOW_FACTOR`` (default 4) times as long (a sleep inside the region), so
their figures are 1/factor of the real ones; ``PRETRAIN_DOCTOR_HOSTNAME=NAME`` or ``NAME0,NAME1,...`` (one
per rank) gives ranks host names, so that ranks on one machine stand for several hosts. Without the
override a rank's host is ``SLURMD_NODENAME`` under SLURM (the name ``--exclude`` takes), else its hostname.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXIT_UNHEALTHY = 1
"""A host is below the threshold (2 stays the exit code of bad input)."""
DEFAULT_THRESHOLD = 0.8
DOCTOR_FILE = "doctor.json"
SLOW_RANK_ENV, SLOW_FACTOR_ENV = "PRETRAIN_DOCTOR_SLOW_RANK", "PRETRAIN_DOCTOR_SLOW_FACTOR"
HOSTNAME_ENV = "PRETRAIN_DOCTOR_HOSTNAME"

# name -> the table's header (with its unit); higher is better for every one. Order is the table's.
FIGURES: dict[str, str] = {
    "matmul_tflops": "matmul TFLOP/s",
    "memory_gb_s": "memory GB/s",
    "h2d_gb_s": "h2d GB/s",
    "allreduce_busbw_gb_s": "all-reduce busbw GB/s",
    "allgather_busbw_gb_s": "all-gather busbw GB/s",
    "node_allreduce_busbw_gb_s": "node all-reduce busbw GB/s",
    "write_mb_s": "output_dir write MB/s",
}


@dataclass(frozen=True)
class Sizes:
    """How big each measurement is: large enough to reach the device's rate, small enough to take well under
    a second per repeat."""

    matmul_n: int
    copy_mib: int
    collective_mib: int
    write_mib: int
    repeats: int


GPU_SIZES = Sizes(matmul_n=8192, copy_mib=1024, collective_mib=256, write_mib=256, repeats=5)
CPU_SIZES = Sizes(matmul_n=640, copy_mib=64, collective_mib=4, write_mib=16, repeats=7)


# ---- the math, on plain numbers -------------------------------------------------------------------
def bus_bandwidth(op: str, num_bytes: int, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth in GB/s (1e9 bytes/s): algbw x 2(n-1)/n (all_reduce), algbw x (n-1)/n
    (all_gather, num_bytes = the gathered output)."""
    factor = {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world}[op]
    return num_bytes / seconds / 1e9 * factor


@dataclass(frozen=True)
class Failure:
    host: str | None
    rank: int
    figure: str
    value: float | None
    median: float | None
    why: str


HOST_FIGURE = "write_mb_s"
"""The figure of a resource the ranks of a host share (output_dir's disk): judged per host."""


def medians(ranks: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each figure's median over the ranks that measured it."""
    out = {}
    for name in FIGURES:
        values = [r["figures"][name] for r in ranks if r["figures"].get(name) is not None]
        if values:
            out[name] = statistics.median(values)
    return out


def judge(ranks: Sequence[Mapping[str, Any]], threshold: float, shared_problem: str | None = None) -> list[Failure]:
    """Every (rank, figure) below threshold x the figure's median, and an output_dir the ranks do not share
    (``accelerator.check_shared_output_dir``'s message, which names the ranks and hosts: the job's problem, host
    None, since excluding a host does not mend a mount). ``ranks``: [{"rank", "host", "figures": {name: value or None}}]."""
    mid = medians(ranks)
    # output_dir's disk is the host's, shared by its ranks: a host is judged by its best write (its ranks' writes
    # queue behind each other, and one of three ranks on a healthy host measured 0.70 of the median), against the
    # median of the hosts' best writes
    best = {}
    for r in ranks:
        value = r["figures"].get(HOST_FIGURE)
        if value is not None and value > best.get(r["host"], (None, -1.0))[1]:
            best[r["host"]] = (r["rank"], value)
    if best:
        mid[HOST_FIGURE] = statistics.median(v for _, v in best.values())
    failures = []
    for r in ranks:
        for name, value in r["figures"].items():
            if name == HOST_FIGURE and best.get(r["host"], (None,))[0] != r["rank"]:
                continue  # the host's best rank speaks for its disk
            if value is not None and name in mid and value < threshold * mid[name]:
                failures.append(Failure(r["host"], r["rank"], name, value, mid[name],
                                        f"{FIGURES[name]} {value:.4g} is {value / mid[name]:.2f} of the median "
                                        f"{mid[name]:.4g} (threshold {threshold:g})"))
    if shared_problem is not None:
        failures.append(Failure(None, 0, "shared", None, None, shared_problem))
    return failures


def failing_hosts(failures: Sequence[Failure]) -> dict[str, list[str]]:
    """host -> its reasons ("rank 2: matmul TFLOP/s 1.2 is 0.25 of ..."), hosts in order of first failure."""
    out: dict[str, list[str]] = {}
    for f in failures:
        if f.host is not None:
            out.setdefault(f.host, []).append(f"rank {f.rank}: {f.why}")
    return out


def _cell(value: float | None, median: float | None, failed: bool) -> str:
    if value is None:
        return "-"
    ratio = f" x{value / median:.2f}" if median else ""
    return f"{value:.4g}{ratio}{' !' if failed else ''}"


def host_tables(ranks: Sequence[Mapping[str, Any]], threshold: float, peak_tflops: float | None) -> str:
    """One table per host: a row per rank, each figure with its ratio to the median over all ranks (x1.00)
    and the matmul's share of the peak; ``!`` marks a figure below the threshold."""
    mid = medians(ranks)
    failed = {(f.rank, f.figure) for f in judge(ranks, threshold)}
    names = [n for n in FIGURES if n in mid]
    headers = ["rank", *(FIGURES[n] for n in names), "matmul of peak"]
    blocks = []
    for host in sorted({r["host"] for r in ranks}):
        rows = []
        for r in sorted((r for r in ranks if r["host"] == host), key=lambda r: r["rank"]):
            tflops = r["figures"].get("matmul_tflops")
            of_peak = f"{tflops / peak_tflops:.0%}" if tflops is not None and peak_tflops else "-"
            rows.append([str(r["rank"]), *(_cell(r["figures"].get(n), mid[n], (r["rank"], n) in failed) for n in names),
                         of_peak])
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
        lines = [f"host {host}", "  " + "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
        blocks.append("\n".join(lines))
    medians_line = "median: " + ", ".join(f"{FIGURES[n]} {mid[n]:.4g}" for n in names)
    return "\n\n".join(blocks) + "\n" + medians_line


def verdict_text(failures: Sequence[Failure], threshold: float, num_hosts: int) -> str:
    hosts = failing_hosts(failures)
    if not failures:
        return f"doctor: all {num_hosts} host(s) healthy (every figure at least {threshold:g} x its median)"
    lines = [f"doctor: {len(hosts)} of {num_hosts} host(s) below the threshold: {', '.join(hosts) or 'none'}"]
    lines += [f"  host {host}: {reason}" for host, reasons in hosts.items() for reason in reasons]
    lines += [f"  output_dir: {f.why}" for f in failures if f.host is None]
    return "\n".join(lines)


# ---- test hooks and host names --------------------------------------------------------------------
def host_name(rank: int, environ: Mapping[str, str] = os.environ) -> str:
    """This rank's host: the test hook's name, else SLURM's node name (what --exclude takes), else hostname."""
    if names := environ.get(HOSTNAME_ENV):
        parts = names.split(",")
        return parts[rank] if len(parts) > 1 else parts[0]
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def slow_factor(rank: int, environ: Mapping[str, str] = os.environ) -> float:
    """The test hook: how many times longer this rank's timed regions take (1: not slowed)."""
    ranks = {int(r) for r in environ.get(SLOW_RANK_ENV, "").split(",") if r.strip()}
    return float(environ.get(SLOW_FACTOR_ENV, "4")) if rank in ranks else 1.0


# ---- the measurements (torch) -----------------------------------------------------------------------
class Timer:
    """The median seconds of ``repeats`` runs of a function, synchronised with the device; the slow-rank
    hook sleeps inside the timed region."""

    def __init__(self, device, repeats: int, slow: float):
        self.device, self.repeats, self.slow = device, repeats, slow

    def __call__(self, fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> float:
        import torch

        fn()  # warm-up: allocator, kernels, connections
        times = []
        for _ in range(self.repeats):
            if before is not None:
                before()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - start
            time.sleep(elapsed * (self.slow - 1))
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def measure_local(device, dtype, sizes: Sizes, timer: Timer, output_dir: Path, rank: int) -> dict[str, float | None]:
    """The figures that involve this rank alone."""
    import torch

    n = sizes.matmul_n
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    matmul_s = timer(lambda: a @ b)
    src = torch.empty(sizes.copy_mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timer(lambda: dst.copy_(src))
    h2d = None
    if device.type == "cuda":
        host = torch.empty_like(src, device="cpu").pin_memory()
        h2d = src.numel() / timer(lambda: src.copy_(host, non_blocking=True)) / 1e9
    payload = os.urandom(sizes.write_mib * 2**20)
    probe = output_dir / f".doctor-write-{rank}-{secrets.token_hex(4)}"

    def write():
        with open(probe, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())

    try:
        write_s = timer(write)
    finally:
        probe.unlink(missing_ok=True)
    return {"matmul_tflops": 2 * n**3 / matmul_s / 1e12, "memory_gb_s": 2 * sizes.copy_mib * 2**20 / copy_s / 1e9,
            "h2d_gb_s": h2d, "write_mb_s": len(payload) / write_s / 1e6}


def measure_collectives(device, sizes: Sizes, timer: Timer, node_group, node_size: int) -> dict[str, float | None]:
    """All-reduce and all-gather over every rank, all-reduce within this host; every rank calls this."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1  # one process: no group, nothing to measure
    out: dict[str, float | None] = dict.fromkeys(("allreduce_busbw_gb_s", "allgather_busbw_gb_s",
                                                  "node_allreduce_busbw_gb_s"))
    if world == 1:
        return out
    numel = sizes.collective_mib * 2**20 // 4
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    # A barrier before each repeat starts every rank's clock together.
    seconds = timer(lambda: dist.all_reduce(buf), before=dist.barrier)
    out["allreduce_busbw_gb_s"] = bus_bandwidth("all_reduce", buf.numel() * 4, seconds, world)
    shard = buf[: numel // world].contiguous()
    gathered = torch.empty(shard.numel() * world, dtype=torch.float32, device=device)
    seconds = timer(lambda: dist.all_gather_single(gathered, shard), before=dist.barrier)
    out["allgather_busbw_gb_s"] = bus_bandwidth("all_gather", gathered.numel() * 4, seconds, world)
    # Every rank times the world group's figures; the node groups run one after another below.
    if node_size > 1:
        seconds = timer(lambda: dist.all_reduce(buf, group=node_group), before=lambda: dist.barrier(group=node_group))
        out["node_allreduce_busbw_gb_s"] = bus_bandwidth("all_reduce", buf.numel() * 4, seconds, node_size)
    return out


# ---- one check, every rank ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    output_dir: Path
    dtype: str  # fp32 | bf16 | fp16
    threshold: float = DEFAULT_THRESHOLD
    peak_tflops: float | None = None  # the recipe's logging.peak_tflops
    cache_dir: Path | None = None  # where the CPU peak is cached (the data cache)
    exclude_file: Path | None = None  # failing hosts are appended here (pretrain-slurm's job)


def run_checks(settings: Settings, accelerator, matmul_dtype, peak) -> tuple[dict[str, Any], list[Failure]]:
    """Measure on every rank, gather onto every rank, judge. Collective: every rank calls it. ``matmul_dtype``: the
    torch dtype of ``settings.dtype``; ``peak``: this rank's device peak (``train/metrics.Peak``), by the command."""
    import torch
    import torch.distributed as dist
    from accelerate.utils import gather_object

    from pretrain.distributed.accelerator import check_shared_output_dir
    from pretrain.errors import ConfigError

    rank, world = accelerator.process_index, accelerator.num_processes
    device = accelerator.device
    host = host_name(rank)
    sizes = GPU_SIZES if device.type == "cuda" else CPU_SIZES
    timer = Timer(device, sizes.repeats, slow_factor(rank))
    settings.output_dir.mkdir(parents=True, exist_ok=True)

    shared_problem = None
    try:
        check_shared_output_dir(accelerator, settings.output_dir)
    except ConfigError as exc:  # the same message on every rank, naming the ranks and hosts that saw no file
        shared_problem = str(exc)
    hosts = gather_object([host]) if world > 1 else [host]
    node_group, node_size = None, 1
    if world > 1:
        for name in sorted(set(hosts)):  # every rank creates every group, in the same order
            members = [r for r, h in enumerate(hosts) if h == name]
            group = dist.new_group(members)
            if name == host:
                node_group, node_size = group, len(members)

    dtype = matmul_dtype
    if device.type == "cuda":
        figures = measure_local(device, dtype, sizes, timer, settings.output_dir, rank)
    else:  # CPU ranks of one host share its cores: one at a time
        figures = {}
        for turn in range(world):
            if turn == rank:
                figures = measure_local(device, dtype, sizes, timer, settings.output_dir, rank)
            if world > 1:
                dist.barrier()
    figures.update(measure_collectives(device, sizes, timer, node_group, node_size))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    mine = {"rank": rank, "host": host, "device": name or "cpu", "figures": figures, "peak_tflops": peak.tflops,
            "peak_source": peak.source}
    ranks = gather_object([mine]) if world > 1 else [mine]
    failures = judge(ranks, settings.threshold, shared_problem)
    report = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "dtype": settings.dtype, "threshold": settings.threshold,
              "world_size": world, "peak_tflops": peak.tflops, "peak": peak.detail,
              "hosts": {h: [r["rank"] for r in ranks if r["host"] == h] for h in sorted(set(hosts))},
              "medians": medians(ranks), "ranks": ranks, "shared_output_dir": shared_problem is None,
              "shared_problem": shared_problem, "passed": not failures,
              "failing_hosts": failing_hosts(failures), "sizes": sizes.__dict__,
              "busbw": "nccl-tests: all-reduce algbw x 2(n-1)/n, all-gather algbw x (n-1)/n; GB = 1e9 bytes"}
    return report, failures


def write_report(report: Mapping[str, Any], output_dir: Path) -> Path:
    """output_dir/doctor.json, atomically (a reader never sees half of it)."""
    path = output_dir / DOCTOR_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)
    return path


def append_excluded(path: Path, hosts: Sequence[str]) -> None:
    """Add failing hosts to the exclude file (one a line, each once): pretrain-slurm's job reads it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    known = path.read_text().split() if path.exists() else []
    new = [h for h in hosts if h not in known]
    if new:
        with open(path, "a") as f:
            f.write("".join(f"{h}\n" for h in new))


def tracker_values(report: Mapping[str, Any]) -> dict[str, float]:
    """doctor/<figure>/median, doctor/<figure>/min and doctor/failing_hosts for the trackers."""
    values: dict[str, float] = {"doctor/failing_hosts": len(report["failing_hosts"])}
    for name, mid in report["medians"].items():
        mine = [r["figures"][name] for r in report["ranks"] if r["figures"].get(name) is not None]
        values[f"doctor/{name}/median"] = mid
        values[f"doctor/{name}/min"] = min(mine)
    return values
