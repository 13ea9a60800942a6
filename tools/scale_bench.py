"""Scale benchmark of the data path: memory and time of each path at three sizes, the growth exponent, and the
figure extrapolated to the advertised scale (15T tokens, 100,000 shards, 1e6 steps, 1,024 ranks).

    python tools/scale_bench.py [--paths order,store-open] [--quick] [--baseline] [--write]
                                [--sizes PATH=1e6,1e7,1e8] [--target PATH=3.66e9] [--add NAME=module:function]
                                [--repeats N] [--warm] [--workdir D] [--json FILE] [--timeout S]
    python tools/scale_bench.py --list                               # the registry
    python tools/scale_bench.py --one order 1e8 [--workdir D]        # one point in this process: its JSON line

A path is a function ``fn(size: int, workdir: pathlib.Path)`` doing the work of one data path at one size on CPU,
with synthetic stores and orders (REGISTRY below: tools/scale_order.py, tools/scale_store.py, tools/scale_logs.py).
It may return a dict of counters (e.g. ``{"stats": 3, "bytes_read": 4096}``), printed beside the figures. Its module
may have ``prepare_<function name>(size, workdir)``: unmeasured set-up (writing a synthetic store), run first in a
process of its own so that the measured process touches nothing big before the call.

Each (path, size) is measured in a fresh interpreter (this file re-invoked with ``--one PATH SIZE``): the module is
imported, the peak-RSS mark reset to the current RSS (``/proc/self/clear_refs``) where Linux allows, then the call is
timed (``time.perf_counter``) and its memory is the growth of the peak RSS (a high-water mark: VmHWM, else
``ru_maxrss``, see peak_rss) over its value right before the call. The child prints one JSON line; the parent fits ``value ~ size^k`` by least squares on
log-log over the three points (time above a 1 ms floor, memory above 1 MiB: a value below its floor counts as the
floor, so a path under it everywhere is "bounded"), extrapolates from the largest measured point to the target
size with that exponent, and prints a markdown table. ``--write`` puts it, with the command, the date and the
machine, in docs/performance.md's "## Scale" section (between its markers; the rest of the file unchanged).

A path's ``imports`` (REGISTRY) are imported before the call: the process that does the work in a run has them
already. A path whose module is missing is "not available" in the table; one that fails or times out is "failed".
``--baseline`` adds the comparison rows (``order-numpy-permutation``: today's sample order). Sizes and targets of
the registry can be overridden; ``--add`` measures any other function (sizes from ``--sizes``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np  # here, not in measure_numpy_permutation: an import inside a measured call is measured
import numpy.random  # noqa: F401  (numpy loads it lazily: 7 MB and 30 ms the baseline would count)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "performance.md"
MARKER = "SCALE "
HEADING = "## Scale"
BEGIN = "<!-- tools/scale_bench.py --write: from here to the end marker -->"
END = "<!-- end of tools/scale_bench.py --write -->"
TIME_FLOOR_S = 1e-3  # below it a measured time counts as the floor (timer and interpreter noise)
MEMORY_FLOOR = 2**20  # 1 MiB: RSS growth below it counts as the floor (page and allocator granularity)
BOUNDED = 0.2  # an exponent below it: the cost does not grow with the size

# ---- the advertised scale -------------------------------------------------------------------------
TOKENS = 15 * 10**12  # 15T training tokens
ROW_TOKENS = 4096  # tokens per packed row (sequence)
SHARDS = 100_000  # shard files of one store
STEPS = 10**6  # optimizer steps of the run
RANKS = 1024  # processes
ROWS = TOKENS // ROW_TOKENS  # 15e12 / 4,096 = 3,662,109,375 = 3.66e9 training rows
GBS_ROWS = round(TOKENS / STEPS / ROW_TOKENS)  # 15e12 tokens / 1e6 steps / 4,096 = 3,662 rows per global batch
VAL_ROWS = round(TOKENS * 0.05 / ROW_TOKENS)  # data.val_fraction's default 0.05: 15e12 x 0.05 / 4,096 = 1.83e8
EXCLUDED_ROWS = 100_000  # issue 50's figure: 1e5 quarantined rows left out at a resume at step 1e6
LOG_LINES = 3_600_000  # issue 50's figure: a 1e6-step run's log, about 3.6 lines per step


@dataclass(frozen=True)
class ScalePath:
    name: str
    function: str  # "module:function": tools.NAME is this checkout's tools/NAME.py, any other an importable module
    sizes: tuple[int, ...]  # the three measured sizes
    quick: tuple[int, ...]  # --quick's sizes (a smoke run)
    unit: str  # what the size counts
    target: int  # the size at the advertised scale
    derivation: str  # how the target follows from the scale
    per: str  # what the figure is per
    baseline: bool = False  # a comparison row: run with --baseline or when named in --paths
    # modules imported before the call is measured: the process doing the work in a run has them already, so a
    # function that imports them inside its call does not count their import as the path's cost ("module:name"
    # also asks the module for a name it loads lazily)
    imports: tuple[str, ...] = ()
    # one unmeasured call first, in a process of its own (--warm does it for every path): for a function that writes
    # its inputs into workdir on its first call and keeps them, so that the measured call is the path's work alone
    warm: bool = False


# transformers' tokenizer classes, loaded on first use (0.8 s and 30 MiB): a rank has them before it opens a store
TOKENIZER = "transformers:PreTrainedTokenizerFast"
ORDER = ("pretrain.data.loader", "pretrain.data.order")  # a rank's sample order, imported at start

REGISTRY: list[ScalePath] = [
    ScalePath("order", "tools.scale_order:measure_order", (10**6, 10**7, 10**8), (10**4, 10**5, 10**6), "rows",
              ROWS, "15e12 tokens / 4,096-token rows = 3.66e9 rows", "rank, at resume", imports=ORDER),
    ScalePath("mixture-order", "tools.scale_order:measure_mixture_order", (10**6, 10**7, 10**8),
              (10**4, 10**5, 10**6), "rows", ROWS, "15e12 tokens / 4,096-token rows = 3.66e9 rows (all sources)",
              "rank, at resume", imports=ORDER),
    ScalePath("exclusion-resume", "tools.scale_order:measure_exclusion_resume", (10**3, 10**4, 10**5),
              (10, 100, 1000), "excluded rows", EXCLUDED_ROWS, "1e5 quarantined rows at a resume at step 1e6",
              "rank, at resume", imports=ORDER),
    ScalePath("eval-indices", "tools.scale_order:measure_eval_indices", (10**5, 10**6, 10**7), (10**3, 10**4, 10**5),
              "validation rows", VAL_ROWS, "15e12 tokens x 0.05 (data.val_fraction) / 4,096 = 1.83e8 rows",
              "rank, per evaluation", imports=ORDER),
    ScalePath("store-open", "tools.scale_store:measure_open", (2_000, 10_000, 30_000), (20, 100, 300), "shards",
              SHARDS, "100,000 shard files", "rank, at start",
              imports=("pretrain.data", "pretrain.data.store", TOKENIZER)),
    ScalePath("store-cleanup", "tools.scale_store:measure_cleanup", (2_000, 10_000, 30_000), (20, 100, 300),
              "shards", SHARDS, "100,000 shard files", "job",
              imports=("pretrain.data", "pretrain.data.store", "pretrain.data.store_build", TOKENIZER)),
    ScalePath("resolve-exclude", "tools.scale_store:measure_resolve_exclude", (10**3, 10**4, 10**5),
              (10, 100, 1000), "documents", EXCLUDED_ROWS, "1e5 quarantined documents' rows (as exclusion-resume)",
              "rank, at start",
              imports=("pretrain.data", "pretrain.data.store", "pretrain.data.quarantine", TOKENIZER)),
    ScalePath("rewind", "tools.scale_logs:measure_rewind", (10**4, 10**5, 10**6), (10**2, 10**3, 10**4), "log lines",
              LOG_LINES, "3.6e6 lines: a 1e6-step run's log", "rollback",
              imports=("pretrain.train.tracking", "pretrain.checkpoint.rundir"), warm=True),
    ScalePath("status", "tools.scale_logs:measure_status", (10**4, 10**5, 10**6), (10**2, 10**3, 10**4), "log lines",
              LOG_LINES, "3.6e6 lines: a 1e6-step run's log", "command", imports=("pretrain.cli.slurm",),
              warm=True),
    ScalePath("order-numpy-permutation", "tools.scale_bench:measure_numpy_permutation", (10**6, 10**7, 10**8),
              (10**4, 10**5, 10**6), "rows", ROWS, "15e12 tokens / 4,096-token rows = 3.66e9 rows",
              "rank, at resume", baseline=True),
]


# ---- the baseline: today's sample order -----------------------------------------------------------
def measure_numpy_permutation(size: int, workdir: Path) -> dict:
    """The comparison row: today's order (pretrain/data/loader.py ``epoch_permutation``, kept here as it is before
    its replacement), answering one global batch (3,662 rows) at step 1e6 as a rank does at resume: the epoch's
    whole permutation, held as uint32, is drawn first."""
    seed, batches_per_epoch = 0, max(size // GBS_ROWS, 1)
    epoch, index = divmod(STEPS, batches_per_epoch)
    # epoch_permutation(n, [seed, epoch], shuffle=True), its 3 lines at ec3eb12 (numpy's permutation order), kept as
    # the comparison row after the order that replaces it lands:
    order = np.arange(size, dtype=np.uint32 if size < 2**32 else np.int64)
    np.random.default_rng([seed, epoch]).shuffle(order)
    batch = order[index * GBS_ROWS:(index + 1) * GBS_ROWS].copy()
    return {"batch_rows": int(batch.size), "held_bytes": int(order.nbytes)}


# ---- one point, in a fresh interpreter ------------------------------------------------------------
class NotAvailable(Exception):
    pass


def _import(module_name: str):
    """A module by name; ``tools.NAME`` from this checkout's tools/NAME.py (tools/ is no package on the path: the
    project's modules import the installed ``pretrain``, never a path added to the import path)."""
    if module_name in sys.modules:
        return sys.modules[module_name]
    folder, _, name = module_name.partition(".")
    path = ROOT / "tools" / f"{name}.py"
    if folder != "tools" or not path.is_file():
        return importlib.import_module(module_name)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def load(spec: str):
    """The function and its optional prepare_<name> of "module:function"; NotAvailable if the module or the
    function is missing (an import error inside the module is raised as it is)."""
    module_name, _, function_name = spec.partition(":")
    try:
        module = _import(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise NotAvailable(f"no module {module_name}") from None
        raise
    fn = getattr(module, function_name, None)
    if fn is None:
        raise NotAvailable(f"{module_name} has no {function_name}")
    return fn, getattr(module, f"prepare_{function_name}", None)


def reset_peak() -> bool:
    """Lower the peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0; False where not allowed)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss() -> tuple[int, str]:
    """The process's peak RSS in bytes, and where it was read. Linux: VmHWM, this address space's own high-water
    mark. ru_maxrss is the larger of that and the peak of the image exec replaced, which for a child started by
    fork or vfork is its parent's: under a parent of 300 MB, no call below 300 MB would show any growth."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "VmHWM"
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak if sys.platform == "darwin" else peak * 1024), "ru_maxrss"  # KiB on Linux, bytes on macOS


def one(name: str, spec: str, size: int, workdir: Path, prepare_only: bool, imports: tuple[str, ...] = (),
        warm: bool = False) -> dict:
    """Measure one point in this process, the figures as a dict; or, prepare_only, only its set-up: the module's
    prepare_<function> and, when warm, one call of the function itself."""
    try:
        fn, prepare = load(spec)
    except NotAvailable as exc:
        return {"path": name, "size": size, "status": "not available", "error": str(exc)}
    for item in imports:  # one the checkout does not have (yet, or any more) is left to the call
        module, _, attribute = item.partition(":")
        try:
            loaded = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        if attribute:  # a lazily loaded name (transformers'): loaded by asking for it
            getattr(loaded, attribute, None)
    workdir.mkdir(parents=True, exist_ok=True)
    if prepare_only:
        if prepare is not None:
            prepare(size, workdir)
        if warm:
            fn(size, workdir)
        return {"path": name, "size": size, "status": "prepared"}
    if prepare is not None or warm:  # its own process: what it allocates is not in this one's heap
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", name, str(size),
                               "--workdir", str(workdir), "--function", spec, "--prepare-only",
                               *(["--imports", ",".join(imports)] if imports else []), *(["--warm"] if warm else [])],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return {"path": name, "size": size, "status": "failed",
                    "error": "prepare: " + last_line(proc.stderr or proc.stdout)}
    gc.collect()
    reset = reset_peak()
    rss_before, (before, source) = current_rss(), peak_rss()
    start = time.perf_counter()
    counters = fn(size, workdir)
    seconds = time.perf_counter() - start
    after, _ = peak_rss()
    return {"path": name, "size": size, "status": "ok", "seconds": seconds, "rss_growth": max(after - before, 0),
            "peak_before": before, "peak_after": after, "peak_source": source, "rss_before": rss_before,
            "peak_reset": reset, "counters": counters if isinstance(counters, dict) else {}}


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def run_point(path: ScalePath, size: int, workdir: Path, timeout: float) -> dict:
    """One point measured by a fresh interpreter (this file with --one)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", path.name, str(size), "--workdir", str(workdir),
           "--function", path.function, *(["--imports", ",".join(path.imports)] if path.imports else []),
           *(["--warm"] if path.warm else [])]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"path": path.name, "size": size, "status": "failed", "error": f"timed out after {timeout:g} s"}
    found = [line[len(MARKER):] for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    if proc.returncode != 0 or not found:
        return {"path": path.name, "size": size, "status": "failed",
                "error": f"exit {proc.returncode}: " + last_line(proc.stderr or proc.stdout)}
    return json.loads(found[-1])


# ---- the fit --------------------------------------------------------------------------------------
def fit_exponent(sizes: list[float], values: list[float], floor: float = 0.0) -> float:
    """k of value ~ size^k: the least-squares slope of log(max(value, floor)) on log(size)."""
    if len(sizes) < 2 or len(sizes) != len(values):
        raise ValueError("a fit needs at least two points, one value per size")
    xs = [math.log(s) for s in sizes]
    ys = [math.log(max(v, floor, 1e-300)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a fit needs at least two different sizes")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def extrapolate(size: float, value: float, target: float, exponent: float) -> float:
    """value at target from the point (size, value) along size^exponent (a negative exponent counts as 0)."""
    return value * (target / size) ** max(exponent, 0.0)


@dataclass
class Result:
    path: ScalePath
    sizes: tuple[int, ...]
    target: int
    points: list[dict]

    @property
    def status(self) -> str:
        for point in self.points:
            if point["status"] != "ok":
                return point["status"]
        return "ok"

    def fits(self) -> dict:
        """Exponents, extrapolated figures and the verdict of a path whose points all succeeded."""
        sizes = [p["size"] for p in self.points]
        times = [p["seconds"] for p in self.points]
        memory = [p["rss_growth"] for p in self.points]
        k_time = fit_exponent(sizes, times, TIME_FLOOR_S)
        k_memory = fit_exponent(sizes, memory, MEMORY_FLOOR)
        time_at = extrapolate(sizes[-1], max(times[-1], TIME_FLOOR_S), self.target, k_time)
        memory_at = extrapolate(sizes[-1], max(memory[-1], MEMORY_FLOOR), self.target, k_memory)
        return {"k_time": k_time, "k_memory": k_memory, "time_at_target": time_at, "memory_at_target": memory_at,
                "memory_bounded_below_floor": max(memory) < MEMORY_FLOOR, "time_below_floor": max(times) < TIME_FLOOR_S,
                "verdict": verdict(k_time, k_memory)}


def verdict(k_time: float, k_memory: float) -> str:
    if k_time < BOUNDED and k_memory < BOUNDED:
        return "bounded"
    part = {True: "bounded", False: None}
    time_part = part[k_time < BOUNDED] or f"grows as size^{k_time:.2f}"
    memory_part = part[k_memory < BOUNDED] or f"grows as size^{k_memory:.2f}"
    return f"time {time_part}; memory {memory_part}"


# ---- the table ------------------------------------------------------------------------------------
def fmt_size(n: float) -> str:
    if n < 1_000_000:
        return f"{int(n):,}"
    exponent = int(math.floor(math.log10(n)))
    mantissa = n / 10**exponent
    text = f"{mantissa:.2f}".rstrip("0").rstrip(".")
    return f"{text}e{exponent}"


def fmt_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def fmt_bytes(b: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale or unit == "KiB":
            value = b / scale
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}" if value < 100 else \
                f"{value:,.0f} {unit}"
    raise AssertionError("unreachable")


COLUMNS = ["path", "size (unit)", "per", "time", "RSS growth", "k time", "k memory", "target", "time at target",
           "memory at target", "verdict"]


def render_table(results: list[Result]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        sizes = " / ".join(fmt_size(s) for s in r.sizes)
        head = [f"`{r.path.name}`", f"{sizes} ({r.path.unit})", r.path.per]
        status = r.status
        if status != "ok":
            error = next(p.get("error", "") for p in r.points if p["status"] != "ok")
            cells = ["", "", "", "", fmt_size(r.target), "", "", f"{status}: {error}".replace("|", "\\|")]
        else:
            f = r.fits()
            times = " / ".join(fmt_seconds(p["seconds"]) for p in r.points)
            memory = " / ".join(fmt_bytes(p["rss_growth"]) for p in r.points)
            k_memory = f"{f['k_memory']:.2f}" if not f["memory_bounded_below_floor"] else "bounded (< 1 MiB)"
            k_time = f"{f['k_time']:.2f}" if not f["time_below_floor"] else "bounded (< 1 ms)"
            time_at = fmt_seconds(f["time_at_target"]) if not f["time_below_floor"] else "< 1 ms"
            memory_at = fmt_bytes(f["memory_at_target"]) if not f["memory_bounded_below_floor"] else "< 1 MiB"
            cells = [times, memory, k_time, k_memory, fmt_size(r.target), time_at, memory_at, f["verdict"]]
        lines.append("| " + " | ".join(head + cells) + " |")
    return "\n".join(lines) + "\n"


def counters_lines(results: list[Result]) -> list[str]:
    """One line per path that returned counters: each counter's values at the sizes measured."""
    out = []
    for r in results:
        points = [p for p in r.points if p["status"] == "ok"]
        names = list(dict.fromkeys(k for p in points for k in p.get("counters") or {}))
        if names:
            values = ["{} {}".format(k, " / ".join(fmt_counter((p.get("counters") or {}).get(k)) for p in points))
                      for k in names]
            out.append(f"- `{r.path.name}` at {' / '.join(fmt_size(p['size']) for p in points)}: {'; '.join(values)}")
    return out


def fmt_counter(value) -> str:
    if value is None:
        return "-"
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}" if isinstance(value, float) else str(value)


# ---- docs/performance.md --------------------------------------------------------------------------
def machine() -> str:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpus} CPUs (nproc), {model}, Python {platform.python_version()}"


def replace_section(text: str, body: str) -> str:
    """text with the generated part of its "## Scale" section replaced by body: between BEGIN and END when the
    section has them, else the whole section (from after its heading line to the next "## " heading); a file
    without the section gets it at the end. Everything else is left byte for byte."""
    block = f"{BEGIN}\n{body.rstrip(chr(10))}\n{END}\n"
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.rstrip("\r\n") == HEADING]
    if not starts:
        sep = "" if not text or text.endswith("\n\n") else "\n" if text.endswith("\n") else "\n\n"
        return f"{text}{sep}{HEADING}\n\n{block}"
    first = starts[0] + 1
    last = next((i for i in range(first, len(lines)) if lines[i].startswith("## ")), len(lines))
    section = "".join(lines[first:last])
    if BEGIN in section and END in section and section.index(BEGIN) < section.index(END):
        before, rest = section.split(BEGIN, 1)
        after = rest.split(END, 1)[1]
        after = after[1:] if after.startswith("\n") else after
        new_section = before + block + after
    else:
        new_section = "\n" + block + ("\n" if last < len(lines) else "")
    return "".join(lines[:first]) + new_section + "".join(lines[last:])


def report(results: list[Result], command: str) -> str:
    out = [f"Measured {datetime.date.today().isoformat()} on {machine()}, load average "
           f"{os.getloadavg()[0]:.2f} at the end:", "", f"    {command}", "", render_table(results).rstrip("\n")]
    counters = counters_lines(results)
    if counters:
        out += ["", "Counters the paths returned:", "", *counters]
    return "\n".join(out) + "\n"


# ---- the parent -----------------------------------------------------------------------------------
def parse_overrides(items: list[str], what: str, parser) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            parser.error(f"{what} takes NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def as_size(text: str, parser) -> int:
    try:
        value = float(text)
    except ValueError:
        parser.error(f"not a size: {text!r}")
    if value < 1 or value != int(value):
        parser.error(f"a size is a positive whole number: {text!r}")
    return int(value)


def select(args, parser) -> list[tuple[ScalePath, tuple[int, ...], int]]:
    registry = {p.name: p for p in REGISTRY}
    for name, spec in parse_overrides(args.add, "--add", parser).items():
        if ":" not in spec:
            parser.error(f"--add {name}={spec}: expected module:function")
        registry[name] = ScalePath(name, spec, (), (), "size", 0, "given with --target", "call")
    sizes = {name: tuple(as_size(s, parser) for s in value.split(","))
             for name, value in parse_overrides(args.sizes, "--sizes", parser).items()}
    targets = {name: as_size(value, parser) for name, value in parse_overrides(args.target, "--target", parser).items()}
    for name in [*sizes, *targets]:
        if name not in registry:
            parser.error(f"unknown path {name!r}; known: {', '.join(registry)}")
    if args.paths:
        names = [n.strip() for n in args.paths.split(",") if n.strip()]
        unknown = [n for n in names if n not in registry]
        if unknown:
            parser.error(f"unknown path(s) {', '.join(unknown)}; known: {', '.join(registry)}")
    else:
        names = [name for name, p in registry.items() if not p.baseline or args.baseline]
    chosen = []
    for name in names:
        path = registry[name]
        size_list = sizes.get(name) or (path.quick if args.quick else path.sizes)
        if len(size_list) < 2 or len(set(size_list)) < 2:
            parser.error(f"{name}: give at least two different sizes (--sizes {name}=a,b,c)")
        target = targets.get(name, path.target) or max(size_list)
        chosen.append((replace(path, target=target, warm=path.warm or args.warm), tuple(sorted(size_list)), target))
    return chosen


def measure(path: ScalePath, sizes: tuple[int, ...], target: int, workdir: Path, repeats: int, timeout: float,
            log) -> Result:
    points = []
    for size in sizes:
        tries = []
        for _ in range(repeats):
            point = run_point(path, size, workdir / path.name / str(size), timeout)
            tries.append(point)
            if point["status"] != "ok":
                break
        point = tries[-1]
        if point["status"] == "ok":  # the least disturbed of the repeats
            point = dict(min(tries, key=lambda p: p["seconds"]), rss_growth=min(p["rss_growth"] for p in tries))
            log(f"{path.name:<24} {fmt_size(size):>10} {path.unit:<16} {fmt_seconds(point['seconds']):>10} "
                f"{fmt_bytes(point['rss_growth']):>10}")
        else:
            log(f"{path.name:<24} {fmt_size(size):>10} {path.unit:<16} {point['status']}: {point.get('error', '')}")
        points.append(point)
        if point["status"] != "ok":
            break
    return Result(path, sizes, target, points)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default="", help="comma-separated path names (default: all but the baselines)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of the harness")
    parser.add_argument("--baseline", action="store_true", help="add the comparison rows (today's sample order)")
    parser.add_argument("--write", action="store_true", help="put the table in docs/performance.md's Scale section")
    parser.add_argument("--doc", type=Path, default=DOC, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", action="append", default=[], metavar="PATH=A,B,C", help="a path's sizes")
    parser.add_argument("--target", action="append", default=[], metavar="PATH=N", help="a path's target size")
    parser.add_argument("--add", action="append", default=[], metavar="NAME=module:function",
                        help="measure another function (its sizes with --sizes, its target with --target)")
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per point; the fastest is kept")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per point (default 1800)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the synthetic inputs go, kept for the next run (default: a temporary directory)")
    parser.add_argument("--json", type=Path, default=None, help="also write every point's figures here")
    parser.add_argument("--list", action="store_true", help="print the registry and exit")
    parser.add_argument("--one", nargs=2, metavar=("PATH", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--function", help=argparse.SUPPRESS)
    parser.add_argument("--imports", default="", help=argparse.SUPPRESS)
    parser.add_argument("--prepare-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true",
                        help="one unmeasured call of every path first, in a process of its own (some paths do it "
                             "anyway: those whose function writes its inputs on its first call)")
    args = parser.parse_args(argv)

    if args.one:  # the child: one point
        name, size = args.one[0], int(float(args.one[1]))
        spec, imports, warm = args.function, tuple(m for m in args.imports.split(",") if m), args.warm
        if spec is None:  # by hand: `--one order 1e8 --workdir D` measures the registry's path as the parent would
            registered = {p.name: p for p in REGISTRY}
            if name not in registered:
                parser.error(f"unknown path {name!r}; known: {', '.join(registered)}")
            spec, imports, warm = registered[name].function, registered[name].imports, warm or registered[name].warm
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="scale-bench-one-"))
        print(MARKER + json.dumps(one(name, spec, size, workdir, args.prepare_only, imports, warm)), flush=True)
        return 0
    if args.list:
        for p in REGISTRY:
            print(f"{p.name:<24} {p.function:<44} {' / '.join(fmt_size(s) for s in p.sizes):<22} "
                  f"{p.unit:<16} target {fmt_size(p.target):<8} ({p.derivation}); per {p.per}"
                  + ("; baseline" if p.baseline else ""))
        return 0
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    chosen = select(args, parser)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="scale-bench-")
    workdir = args.workdir or Path(tmp.name)
    try:
        results = [measure(path, sizes, target, workdir, args.repeats, args.timeout, log)
                   for path, sizes, target in chosen]
        command = "python tools/scale_bench.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
        text = report(results, command)
        print(text, end="", flush=True)  # before the clean-up: deleting 100,000s of synthetic files takes minutes
    finally:
        if tmp is not None:
            log(f"deleting the synthetic inputs in {workdir}")
            tmp.cleanup()
    if args.json:
        args.json.write_text(json.dumps([{"path": r.path.name, "function": r.path.function, "unit": r.path.unit,
                                          "per": r.path.per, "target": r.target, "points": r.points,
                                          **(r.fits() if r.status == "ok" else {})} for r in results], indent=1))
    if args.write:
        with open(args.doc, encoding="utf-8", newline="") as f:  # newline="": the file's bytes as they are
            current = f.read()
        with open(args.doc, "w", encoding="utf-8", newline="") as f:
            f.write(replace_section(current, text))
        log(f"wrote the table into {args.doc}'s {HEADING!r} section")
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
