"""The numbers a pretrain command takes on its command line, checked as argparse reads them.

Every count, size, capacity and duration option of every command uses one of these types, so a value at the
edge of its type (0 or -1 processes, nan or inf GiB, a 400-digit integer, a zero timeout, a SLURM time that
is not one) is refused as argparse refuses any bad option: one line naming the option, the value and what it
must be, exit status 2, before anything is read or started.
"""

from __future__ import annotations

import argparse
import math
import re

from pretrain.distributed.layout import MAX_COUNT  # the bound of every count; the layout checks it too
from pretrain.errors import ConfigError

# The longest duration any option takes (seconds): a year, far beyond any job, well inside timedelta and
# threading's limits.
MAX_SECONDS = 365 * 86400


def _shown(text: str) -> str:
    return repr(text if len(text) <= 24 else f"{text[:20]}...")


def count(minimum: int = 1, maximum: int = MAX_COUNT):
    """An argparse type: a whole number from ``minimum`` to ``maximum``."""

    def parse(text: str) -> int:
        digits = text.strip()
        if not re.fullmatch(r"[+-]?\d{1,12}", digits) or not minimum <= int(digits) <= maximum:
            raise argparse.ArgumentTypeError(f"expected a whole number from {minimum} to {maximum:,}, "
                                             f"got {_shown(text)}")
        return int(digits)

    return parse


def number(minimum: float = 0.0, maximum: float = math.inf, *, unit: str = "", inclusive: bool = False):
    """An argparse type: a finite number above ``minimum`` (``inclusive``: or equal to it), at most ``maximum``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = value >= minimum if inclusive else value > minimum
        if not (math.isfinite(value) and above and value <= maximum):
            bound = f"{'>=' if inclusive else '>'} {minimum:g}" + (f" and <= {maximum:g}" if maximum < math.inf else "")
            raise argparse.ArgumentTypeError(f"expected a finite number {bound}{unit}, got {_shown(text)}")
        return value

    return parse


positive_gib = number(unit=" (GiB)")
positive_seconds = number(maximum=MAX_SECONDS, unit=" (seconds)")

# sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds (man sbatch), or no limit at all.
_SLURM_TIME = re.compile(r"(?:(?P<days>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                         r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)")
SLURM_UNLIMITED = ("infinite", "unlimited")


def slurm_time_seconds(text: str) -> int | None:
    """The seconds an sbatch --time value allows; None for no limit (INFINITE / UNLIMITED). Raises
    ArgumentTypeError for anything sbatch would refuse or read as something else."""
    value = text.strip()
    if value.lower() in SLURM_UNLIMITED:
        return None
    match = _SLURM_TIME.fullmatch(value) if len(value) <= 24 else None
    fix = "give e.g. 30 (minutes), 4:00:00 (hours) or 2-00:00:00 (days-hours:minutes:seconds)"
    if match is None:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not a SLURM time; {fix}")
    g = {k: int(v) for k, v in match.groupdict().items() if v is not None}
    if "days" in g:
        seconds, parts = g["days"] * 86400 + g["dh"] * 3600 + g.get("dm", 0) * 60 + g.get("ds", 0), \
            [g["dh"] < 24, g.get("dm", 0) < 60, g.get("ds", 0) < 60]
    elif "c" in g:
        seconds, parts = g["a"] * 3600 + g["b"] * 60 + g["c"], [g["b"] < 60, g["c"] < 60]
    else:
        seconds, parts = g["a"] * 60 + g.get("b", 0), [g.get("b", 0) < 60]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{_shown(text)}: hours run to 23, minutes and seconds to 59; {fix}")
    if seconds == 0:
        # sbatch reads 0 as "no limit"; here it is far more likely a mistake, and the preemption warning
        # (--signal-lead-s) is timed from the limit.
        raise argparse.ArgumentTypeError(f"{_shown(text)} is no time at all (sbatch would read it as no limit); "
                                         f"leave --time out for the partition's default, or {fix}")
    if seconds > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is more than a year; {fix}")
    return seconds


def slurm_time(text: str) -> str:
    """An argparse type: an sbatch --time value, checked (slurm_time_seconds) and passed on as written."""
    slurm_time_seconds(text)
    return text.strip()


def add_sbatch_options(parser: argparse.ArgumentParser, time_help: str = "") -> None:
    """The cluster options: partition, account, qos, time, constraint, exclusive, job name, raw #SBATCH lines."""
    parser.add_argument("--partition", help="#SBATCH --partition")
    parser.add_argument("--account", help="#SBATCH --account")
    parser.add_argument("--qos", help="#SBATCH --qos")
    parser.add_argument("--time", type=slurm_time, help=f"#SBATCH --time, e.g. 2-00:00:00{time_help}")
    parser.add_argument("--constraint", help="#SBATCH --constraint, e.g. h100")
    parser.add_argument("--exclusive", action="store_true", help="#SBATCH --exclusive (whole nodes)")
    parser.add_argument("--job-name", help="#SBATCH --job-name; default: the recipe name")
    parser.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                        help="extra #SBATCH line, e.g. --sbatch-arg=--mem=0 (repeatable)")


# ---- --dry-run's options: declared with the entry point's, read by the dry run (cli/dry_run.py) ----------------

DRY_RUN_OPTIONS = ("num_processes", "nodes", "config_file", "gpu", "gpu_memory_gib")


def add_dry_run_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--dry-run: the launch and the GPU to plan for")
    group.add_argument("--num-processes", "--num_processes", type=count(), dest="num_processes",
                       help="processes (GPUs) in all, as accelerate launch's --num_processes")
    group.add_argument("--nodes", "--num_machines", type=count(), dest="nodes", help="machines (default 1)")
    group.add_argument("--config_file", "--accelerate-config", dest="config_file",
                       help="an accelerate config (DDP, FSDP, DeepSpeed ZeRO): the layout; default DDP")
    group.add_argument("--gpu", help="GPU model, a name from pretrain-estimate --list-gpus (default: this machine's)")
    group.add_argument("--gpu-memory-gib", type=positive_gib, help="a device capacity the GPU table lacks (GiB)")


def check_options(args: argparse.Namespace) -> None:
    given = [name for name in DRY_RUN_OPTIONS if getattr(args, name) is not None]
    if given and not args.dry_run:
        names = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ConfigError(f"{names} describe the launch a --dry-run plans for; add --dry-run (a training launch takes "
                          "them from accelerate launch: accelerate launch --config_file F --num_processes N "
                          "pretrain/run.py ...)")
