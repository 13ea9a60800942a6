"""`pretrain-prepare-data --slurm`: a recipe's token store tokenized by a SLURM array job.

    pretrain-prepare-data --recipe R --slurm --array 16 [--max-running 8] [--cpus-per-task 32] \\
        [--partition P --account A --qos Q --time 04:00:00 ...] [--dry-run] [key.path=value ...]

The submitting process checks the recipe and sets the store up (build.json and the tokenizer: a BPE is
trained here, once), then submits two jobs with pretrain's own sbatch support (pretrain/distributed/sbatch.py):

    prepare.sbatch  an array of N tasks, one node each: shard i is tokenized by task i mod N with
                    --workers processes (default: the CPUs SLURM gives the task); complete shards are kept,
                    so resubmitting after a failed or preempted task redoes only what is missing
    finish.sbatch   after the whole array succeeded (afterok): the manifest, once every shard's record
                    exists; nothing is tokenized there

Shards depend on their inputs only, so the store is byte-identical to a local build; a local
`pretrain-prepare-data` run after the array does the finish step too. Scripts and logs go to
``<store>.slurm/`` beside the store (the store directory holds the store only).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from pretrain.distributed.sbatch import (
    environment_lines,
    require_sbatch,
    sbatch,
    sbatch_option_problems,
    sbatch_options,
)
from pretrain.errors import ConfigError


@dataclass
class ArrayJob:
    """The two batch scripts of an array preparation, resolved and checked."""

    recipe_path: Path
    overrides: list[str]  # data.store pinned to the store's absolute path
    store: Path
    num_tasks: int
    max_running: int | None
    cpus_per_task: int | None
    workers: int | None
    job_name: str
    workdir: Path
    options: list[str]

    @property
    def slurm_dir(self) -> Path:
        return self.store.with_name(f"{self.store.name}.slurm")


def check_arguments(args: argparse.Namespace) -> None:
    """One ConfigError for every SLURM option that is wrong or given without --slurm."""
    if not args.slurm:
        given = [f"--{name.replace('_', '-')}" for name in ("array", "max_running", "cpus_per_task", "partition",
                                                           "account", "qos", "time", "constraint", "job_name")
                 if getattr(args, name) is not None]
        given += ["--exclusive"] * args.exclusive + ["--sbatch-arg"] * bool(args.sbatch_arg) + ["--dry-run"] * args.dry_run
        if given:
            raise ConfigError(f"{', '.join(given)} only apply with --slurm (submit the preparation as a SLURM array job)")
        return
    problems = sbatch_option_problems(args)
    if args.array is None:
        problems.append("--slurm needs --array N: the number of array tasks (one node each) that share the shards")
    if args.task is not None or args.finish:
        problems.append("--slurm submits the array; --task and --finish are what its jobs run")
    if problems:
        raise ConfigError(problems)


def array_job(args: argparse.Namespace, recipe, store: Path) -> ArrayJob:
    return ArrayJob(
        recipe_path=Path(args.recipe).resolve(),
        overrides=[*(o for o in args.overrides if not o.startswith("data.store=")), f"data.store={store}"],
        store=store,
        num_tasks=args.array,
        max_running=args.max_running,
        cpus_per_task=args.cpus_per_task,
        workers=args.workers,
        job_name=args.job_name or f"prepare-{recipe.name}",
        workdir=Path.cwd().resolve(),
        options=sbatch_options(args),
    )


def _command(job: ArrayJob, *extra: str) -> str:
    argv = ['"$PRETRAIN_PYTHON"', "-m", "pretrain.cli.prepare_data", "--recipe", str(job.recipe_path), *extra,
            *job.overrides]
    # $-words are expanded on the node; everything else is quoted.
    return " ".join(a if a.startswith('"$') else shlex.quote(a) for a in argv)


def _header(job: ArrayJob, name: str, output: str) -> list[str]:
    lines = ["#!/bin/bash", "# Written by pretrain-prepare-data --slurm (pretrain/data/array_build.py).",
             f"#SBATCH --job-name={name}", "#SBATCH --nodes=1", "#SBATCH --ntasks=1"]
    if job.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={job.cpus_per_task}")
    lines += [f"#SBATCH {option}" for option in job.options]
    return [*lines, f"#SBATCH --chdir={job.workdir}", f"#SBATCH --output={job.slurm_dir}/{output}", ""]


def render_array_script(job: ArrayJob, python: str = sys.executable) -> str:
    throttle = f"%{job.max_running}" if job.max_running else ""
    workers = str(job.workers) if job.workers else '"${SLURM_CPUS_PER_TASK:-$SLURM_CPUS_ON_NODE}"'
    lines = _header(job, job.job_name, "prepare-%A_%a.out")
    lines.insert(lines.index("#SBATCH --ntasks=1") + 1, f"#SBATCH --array=0-{job.num_tasks - 1}{throttle}")
    lines += ["set -eu", *environment_lines(python), "export TOKENIZERS_PARALLELISM=false",
              "exec " + _command(job, "--task", '"$SLURM_ARRAY_TASK_ID"', "--num-tasks", str(job.num_tasks),
                                 "--workers", workers)]
    return "\n".join(lines) + "\n"


def render_finish_script(job: ArrayJob, python: str = sys.executable) -> str:
    lines = _header(job, f"{job.job_name}-finish", "finish-%j.out")
    lines.insert(lines.index("#SBATCH --ntasks=1") + 1, "#SBATCH --kill-on-invalid-dep=yes")
    lines += ["set -eu", *environment_lines(python), "exec " + _command(job, "--finish")]
    return "\n".join(lines) + "\n"


def submit(job: ArrayJob, array_script: str, finish_script: str) -> tuple[str, str]:
    """Write both scripts into <store>.slurm/, submit the array and the finish job after it; their ids."""
    job.slurm_dir.mkdir(parents=True, exist_ok=True)
    paths = job.slurm_dir / "prepare.sbatch", job.slurm_dir / "finish.sbatch"
    for path, text in zip(paths, (array_script, finish_script), strict=True):
        path.write_text(text)
        path.chmod(0o755)
    array_id = sbatch(paths[0])
    return array_id, sbatch(paths[1], f"--dependency=afterok:{array_id}")


def prepare_on_slurm(args: argparse.Namespace, recipe) -> int:
    """Set the store up here, then submit (or print, --dry-run) the array and its finish job."""
    from pretrain.data.prepare import locate_store, set_up_store

    if args.dry_run:
        target = locate_store(recipe.data, log=lambda _: None)
        job = array_job(args, recipe, target.path)
        print(f"# {job.slurm_dir / 'prepare.sbatch'}\n{render_array_script(job)}")
        print(f"# {job.slurm_dir / 'finish.sbatch'} (sbatch --dependency=afterok:<array job>)\n"
              f"{render_finish_script(job)}", end="")
        return 0
    require_sbatch()
    target, num_shards = set_up_store(recipe.data)
    if num_shards == 0:
        print(f"data: the token store at {target.path} is complete; nothing to submit")
        return 0
    job = array_job(args, recipe, target.path)
    array_id, finish_id = submit(job, render_array_script(job), render_finish_script(job))
    idle = f" ({job.num_tasks - num_shards} of them have no shard)" if job.num_tasks > num_shards else ""
    print(f"submitted array job {array_id}: {num_shards} shard(s) over {job.num_tasks} task(s){idle}; "
          f"job {finish_id} writes the manifest after it")
    print(f"logs: {job.slurm_dir}/   store: {target.path}")
    return 0
