"""What every SLURM batch script of pretrain shares (training jobs of pretrain-slurm, the array build of
pretrain-prepare-data --slurm): the #SBATCH options, the script's environment, submission through sbatch.
(The argparse options that fill them: cli/options.py's add_sbatch_options.)"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from pretrain.errors import ConfigError

# Environment variables copied into the script when set at submission, so that a requeued job (or
# `sbatch job.sbatch` by hand) sees the same data, cache and offline settings.
PASSTHROUGH_ENV = ("HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE", "TRANSFORMERS_OFFLINE",
                   "PRETRAIN_CACHE_DIR", "WANDB_MODE", "WANDB_DIR", "DS_ACCELERATOR", "TOKENIZERS_PARALLELISM",
                   "TORCH_EXTENSIONS_DIR")


# The run directory's SLURM part (pretrain-slurm writes it; a run's runtime.straggler writes the last two).
SLURM_SUBDIR = "slurm"  # inside the run's output_dir: job.sbatch, jobs.jsonl, slurm-<jobid>.out, excluded_hosts
EXCLUDED_HOSTS = "excluded_hosts"  # nodes to leave out of the next job, one a line (pretrain doctor, stragglers)
EXCLUDE_REQUEST = "exclude_request.json"  # a run stopped to leave a straggler host out: the batch script resubmits
ALLOCATIONS = "allocations.jsonl"  # each start, requeue and end of the batch script, with its Unix time (goodput)


SBATCH_WORDS = ("job_name", "partition", "account", "qos", "time", "constraint")


def sbatch_option_problems(args: argparse.Namespace) -> list[str]:
    return [f"--{name.replace('_', '-')} = {value!r} must be one word (sbatch reads #SBATCH lines word by word)"
            for name in SBATCH_WORDS if (value := getattr(args, name)) is not None
            and (not value or any(c.isspace() for c in value))]


def sbatch_options(args: argparse.Namespace) -> list[str]:
    """--partition=..., --account=..., ... and the raw --sbatch-arg values, as #SBATCH lines take them."""
    options = [f"--{name}={value}" for name, value in
               (("partition", args.partition), ("account", args.account), ("qos", args.qos), ("time", args.time),
                ("constraint", args.constraint)) if value]
    if args.exclusive:
        options.append("--exclusive")
    return options + args.sbatch_arg


def environment_lines(python: str = sys.executable) -> list[str]:
    """The batch script's environment: this Python first on PATH, and the data / cache / offline settings
    of the submitting shell (so that a requeued job, or `sbatch <script>` by hand, sees them too)."""
    lines = [f"export PRETRAIN_PYTHON={shlex.quote(python)}", 'export PATH="$(dirname "$PRETRAIN_PYTHON"):$PATH"']
    lines += [f"export {name}={shlex.quote(os.environ[name])}" for name in PASSTHROUGH_ENV if name in os.environ]
    return [*lines, "export PYTHONUNBUFFERED=1"]


def require_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise ConfigError("SLURM is not available here: `sbatch` is not on PATH. Submit from a login node of "
                          "the cluster, or add --dry-run to print the batch script without submitting")


def sbatch(script: Path, *options: str) -> str:
    """Submit a batch script; its job id."""
    proc = subprocess.run(["sbatch", "--parsable", *options, str(script)], capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        raise ConfigError(f"sbatch refused {script} (exit {proc.returncode}): "
                          f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]
