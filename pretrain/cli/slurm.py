"""`pretrain-slurm`: submit a recipe to a SLURM cluster as one multi-node job that survives preemption.

    pretrain-slurm submit --recipe recipes/7b.yaml [key.path=value ...] \\
        --accelerate-config accelerate_configs/zero3.yaml --nodes 4 --processes-per-node 8 \\
        [--partition P --account A --qos Q --time 2-00:00:00 --constraint C --exclusive ...] [--dry-run]
    pretrain-slurm status runs/7b

`submit` checks the recipe and the launch for the job's world size (nodes x processes per node) first,
exactly as `pretrain-launch` does (the checkpoint it would resume too: a refusal gives the submission that
resumes it), then writes `<output_dir>/slurm/job.sbatch` and hands it to `sbatch`.
The script runs one `srun` task per node; each task `exec`s `accelerate launch` with its own
`--machine_rank` (evaluated on the node) and the first node's address.

Preemption: SLURM sends USR1 to the batch shell `--signal-lead-s` seconds before the time limit (or
anyone sends it with `scancel --signal=USR1 --batch JOB`). The script forwards USR1 to every process of
the training step; every trainer rank finishes the optimizer step in flight, all ranks agree on the step,
a checkpoint is written, the ranks exit 0, and the script requeues the job (`scontrol requeue`). The
requeued job runs the same command, which resumes from the latest checkpoint by itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pretrain.checkpoint import rundir
from pretrain.cli import add_recipe_arguments
from pretrain.cli.options import add_sbatch_options, count, slurm_time_seconds
from pretrain.distributed.layout import (
    DOCTOR_ENTRY,
    RUN_PY,
    Launch,
    accelerate_command,
    config_uses_cpu,
    read_accelerate_config,
    shell_join,
)
from pretrain.distributed.sbatch import (
    ALLOCATIONS,
    EXCLUDE_REQUEST,
    EXCLUDED_HOSTS,
    SLURM_SUBDIR,
    environment_lines,
    require_sbatch,
    sbatch,
    sbatch_option_problems,
    sbatch_options,
)
from pretrain.errors import EXIT_USAGE, ConfigError
from pretrain.train.goodput import read_goodput, summarise, summary_line

DEFAULT_PORT_BASE = 20000  # --port auto: 20000 + job id mod 10000, below the Linux ephemeral range
MAX_SIGNAL_LEAD_S = 65535  # sbatch --signal=<sig>@<sig_time>: sig_time is at most 65535 s


@dataclass
class Job:
    """Everything the batch script needs, resolved and checked."""

    recipe_path: Path
    overrides: list[str]
    accelerate_config: Path
    distributed_type: str
    num_nodes: int
    processes_per_node: int
    gpus_per_node: int
    cpus_per_node: int | None
    job_name: str
    output_dir: Path
    workdir: Path
    port: str  # "auto" or a number
    signal_lead_s: int
    stop_grace_s: int  # after forwarding USR1, seconds before ranks still running get TERM
    max_failure_requeues: int  # requeues after a failed training (not 0, 2, 3, 130)
    sbatch_options: list[str]  # --partition=..., --account=..., raw --sbatch-arg values
    doctor: bool = True  # run pretrain doctor on every node before training

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.processes_per_node

    @property
    def slurm_dir(self) -> Path:
        return self.output_dir / SLURM_SUBDIR


# ---- command line ---------------------------------------------------------------------------------
def add_submit_arguments(submit: argparse.ArgumentParser) -> None:
    add_recipe_arguments(submit, "recipes/7b.yaml")
    submit.add_argument("--accelerate-config", required=True,
                        help="accelerate config, e.g. accelerate_configs/zero3.yaml (its num_machines / "
                        "num_processes / machine_rank / main_process_* are replaced for the job)")
    submit.add_argument("--nodes", type=count(), required=True, help="number of nodes (machines)")
    submit.add_argument("--processes-per-node", type=count(), required=True,
                        help="training processes per node: the GPUs per node on a GPU cluster")
    submit.add_argument("--gpus-per-node", type=count(0), default=None,
                        help="GPUs to request per node (#SBATCH --gpus-per-node); default: none when the accelerate "
                        "config runs on CPUs (use_cpu: true or MULTI_CPU), else --processes-per-node; 0 = request none")
    submit.add_argument("--cpus-per-node", type=count(), default=None,
                        help="CPU cores to request per node (#SBATCH --cpus-per-task); default: SLURM's default "
                        "for the partition (often DefCpuPerGPU x GPUs)")
    add_sbatch_options(submit, time_help=" (the USR1 warning needs a time limit)")
    submit.add_argument("--port", default="auto",
                        help="rendezvous port on the first node; auto (default) = 20000 + job id mod 10000, "
                        "so two jobs sharing a node do not collide")
    submit.add_argument("--signal-lead-s", type=count(1, MAX_SIGNAL_LEAD_S), default=300,
                        help="seconds before the time limit at which SLURM sends USR1 (checkpoint, requeue); "
                        "default 300")
    submit.add_argument("--max-failure-requeues", type=count(0, 1000), default=3,
                        help="times the job requeues itself after training failed (a killed rank, a lost node, a hang "
                        "caught by runtime.hang_timeout_s: any exit but 0, 2 = refused, 3 = diverged, 130 = "
                        "interrupted); it resumes from the newest verified checkpoint; default 3, 0 = never")
    submit.add_argument("--no-doctor", action="store_true",
                        help="skip the health check (pretrain doctor) every job runs on its nodes before training")
    submit.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")


SUBMIT_EPILOG = ("Recipe overrides: trailing key.path=value pairs, e.g. train.max_steps=1000 optim.lr=1e-4. "
                 "Pass options sbatch knows but this tool does not with --sbatch-arg=--mail-type=END (repeatable).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain-slurm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_submit_arguments(sub.add_parser("submit", help="write the sbatch script into the run's output_dir and "
                                        "submit it", epilog=SUBMIT_EPILOG))
    status = sub.add_parser("status", help="show a run's SLURM jobs, their requeues and the latest checkpoint")
    status.add_argument("run_dir", help="the run's output_dir, e.g. runs/7b")
    return parser


def submit_parser() -> argparse.ArgumentParser:
    submit = argparse.ArgumentParser(prog="pretrain-slurm submit", epilog=SUBMIT_EPILOG)
    add_submit_arguments(submit)
    return submit


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["submit"]:
        # Overrides may come before, between or after the options.
        args = submit_parser().parse_intermixed_args(argv[1:])
        args.command = "submit"
        return args
    return build_parser().parse_args(argv)


# ---- checking a submission ------------------------------------------------------------------------
def check_job(args: argparse.Namespace) -> Job:
    """Validate the whole submission (options, accelerate config, recipe, launch); raise one ConfigError."""
    from pretrain.recipe.config import load_recipe
    from pretrain.system.environment import check_environment
    from pretrain.train.preflight import check_run

    problems = []
    limit_s = slurm_time_seconds(args.time) if args.time else None
    if limit_s is not None and args.signal_lead_s >= limit_s:
        problems.append(f"--signal-lead-s {args.signal_lead_s} is not shorter than --time {args.time} ({limit_s} s): "
                        "SLURM would send the checkpoint signal before the job starts; give a longer --time or a "
                        f"--signal-lead-s below {limit_s} (the default 300 s suits limits of an hour or more)")
    if args.port != "auto" and not (args.port.isdigit() and 1024 <= int(args.port) <= 65535):
        problems.append(f"--port must be auto or a port number 1024-65535 (got {args.port!r})")
    problems += sbatch_option_problems(args)
    if problems:
        raise ConfigError(problems)

    config_path = Path(args.accelerate_config).resolve()
    world_size = args.nodes * args.processes_per_node
    launch = Launch.from_accelerate_config(config_path, num_nodes=args.nodes, gpus_per_node=args.processes_per_node)
    config = read_accelerate_config(config_path)
    distributed_type = str(config.get("distributed_type", "NO")).upper()
    if world_size > 1 and distributed_type == "NO":
        raise ConfigError(
            f"accelerate config {args.accelerate_config} runs one process (distributed_type: NO) but the job has "
            f"{args.nodes} node(s) x {args.processes_per_node} process(es) = {world_size}; use a distributed one "
            "such as accelerate_configs/ddp.yaml, fsdp.yaml or zero3.yaml (cpu_ddp.yaml on CPU nodes)"
        )

    recipe_path = Path(args.recipe).resolve()
    recipe = load_recipe(recipe_path, args.overrides)
    # The packages the job needs, in this environment (a job's nodes run the python that submits it).
    check_environment(recipe, launch)
    # The checkpoint the job would resume, read where the nodes read it (output_dir is on a filesystem this
    # machine shares with them: the script and the log are written there): a job whose nodes could not load it
    # is not queued, and the refusal gives the submission that resumes it.
    from pretrain.cli.prelaunch import check_resume
    from pretrain.plan import auto_batch

    check_resume(recipe, launch, SubmitSpelling(args, cpu=requested_gpus(args, config) == 0))
    # on the job's world size, before anything is written (micro_batch_size auto: each node's processes choose it
    # on their GPUs; any size dividing the batch checks the rest)
    check_run(auto_batch.with_micro_batch_size(recipe, 1) if auto_batch.is_auto(recipe) else recipe, launch)
    check_data(args, recipe, recipe_path)
    output_dir = Path(recipe.output_dir).resolve()
    options = sbatch_options(args)
    return Job(
        recipe_path=recipe_path,
        # The run directory is pinned to an absolute path: the script and its log live there.
        overrides=[*(o for o in args.overrides if not o.startswith("output_dir=")), f"output_dir={output_dir}"],
        accelerate_config=config_path,
        distributed_type=distributed_type,
        num_nodes=args.nodes,
        processes_per_node=args.processes_per_node,
        gpus_per_node=requested_gpus(args, config),
        cpus_per_node=args.cpus_per_node,
        job_name=args.job_name or recipe.name,
        output_dir=output_dir,
        workdir=Path.cwd().resolve(),
        port=args.port,
        signal_lead_s=args.signal_lead_s,
        # Ranks still starting up ignore USR1 and have nothing to save: TERM them well before the time limit.
        stop_grace_s=max(60, args.signal_lead_s - 60),
        max_failure_requeues=args.max_failure_requeues,
        sbatch_options=options,
        doctor=not args.no_doctor,
    )


class SubmitSpelling:
    """How pretrain-slurm spells the submission that resumes a checkpoint (``cli/prelaunch.py``'s ``check_resume``):
    this submission's options, with another accelerate config and, when only the saved number of processes
    resumes it, the nodes that make that number at this many processes per node."""

    intro = "This submission resumes it:"

    def __init__(self, args: argparse.Namespace, cpu: bool):
        self.args, self.cpu = args, cpu

    def on_cpu(self) -> bool:
        return self.cpu  # the job's nodes, not this login node, run it

    def __call__(self, config: Path, world: int) -> tuple[Launch, list[str]] | None:
        from pretrain.cli.prelaunch import shown_config

        per_node = self.args.processes_per_node
        if world % per_node:
            return None
        launch = Launch.from_accelerate_config(config, num_nodes=world // per_node, gpus_per_node=per_node)
        changes = {"accelerate_config": shown_config(config), "nodes": world // per_node}
        return launch, ["pretrain-slurm", "submit", *submit_options(self.args, changes), *self.args.overrides]


def submit_options(args: argparse.Namespace, changes: dict) -> list[str]:
    """The options of a parsed submission as its parser takes them (the defaults left out), ``changes`` applied."""
    out = []
    for action in submit_parser()._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag is None or flag == "--help":
            continue  # the overrides (positional) go last
        value = changes.get(action.dest, getattr(args, action.dest))
        if value == action.default:
            continue
        if action.nargs == 0:  # a flag
            out.append(flag)
        elif isinstance(value, list):  # --sbatch-arg: its values start with -- themselves
            out += [f"{flag}={v}" for v in value]
        else:
            out += [flag, str(value)]
    return out


def requested_gpus(args: argparse.Namespace, config: dict) -> int:
    """GPUs per node to request: --gpus-per-node if given, else none for a CPU accelerate config (use_cpu: true,
    MULTI_CPU; SLURM refuses a GPU request on a cluster without GPUs) and one per process otherwise."""
    if args.gpus_per_node is not None:
        return args.gpus_per_node
    return 0 if config_uses_cpu(config) else args.processes_per_node


def check_data(args: argparse.Namespace, recipe, recipe_path: Path) -> None:
    """No node of the job tokenizes: a multi-node job whose token store is missing is not submitted; the
    error gives the commands that prepare it, on one machine or as a SLURM array on the same partition.
    A dry run only warns."""
    if args.nodes == 1 and not recipe.data.store:
        return  # the job's one node prepares it before its process group (ensure_data)
    from pretrain import data
    from pretrain.data.prepare import prepare_commands

    cluster = [f"--{name}={value}" for name in ("partition", "account", "qos") if (value := getattr(args, name))]
    try:
        data.check_data(recipe.data, args.nodes, prepare_commands(str(recipe_path), args.overrides, args.nodes, cluster))
    except ConfigError as exc:
        if not args.dry_run:
            raise
        print(f"warning: {exc}", file=sys.stderr)


# ---- the batch script -----------------------------------------------------------------------------
def _single_quote(text: str) -> str:
    """Quote for bash so that nothing expands here: `$SLURM_NODEID` is expanded by the node's own shell."""
    return "'" + text.replace("'", "'\"'\"'") + "'"


def node_command(job: Job, entry: tuple[str, ...] = (str(RUN_PY),), extra: tuple[str, ...] = ()) -> str:
    """What each node runs: its own accelerate launch of ``entry`` (training, or ``DOCTOR_ENTRY`` with its
    ``extra`` options). `$SLURM_NODEID` and friends expand on the node."""
    per_process = job.processes_per_node
    threads = f"$(( SLURM_CPUS_ON_NODE / {per_process} > 0 ? SLURM_CPUS_ON_NODE / {per_process} : 1 ))"
    node_args = ["--num_machines", "$SLURM_NNODES", "--machine_rank", "$SLURM_NODEID",
                 "--main_process_ip", "$MASTER_ADDR", "--main_process_port", "$MASTER_PORT"]
    if job.distributed_type == "DEEPSPEED":
        # torchrun on every node: no hostfile, no passwordless ssh (whatever the config file says).
        node_args += ["--deepspeed_multinode_launcher", "standard"]
    argv = accelerate_command(job.recipe_path, [*job.overrides, *extra], accelerate_args=node_args,
                              config_file=job.accelerate_config, num_processes=job.world_size,
                              launcher=["$PRETRAIN_PYTHON", "-m", "accelerate.commands.launch"], entry=entry)
    # One option (and its value) a line; the entry point, recipe and overrides on the last.
    cut = len(argv) - len(entry) - 2 - len(job.overrides) - len(extra)
    lines, i = [argv[:3]], 3
    while i < cut:
        lines.append(argv[i:i + 2])
        i += 2
    lines.append(argv[cut:])
    return "\n    ".join([
        "",
        # The launcher ignores USR1 (its default action would kill it); the trainer ranks catch it.
        'trap "" USR1',
        f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-{threads}}}"',
        "exec " + " \\\n      ".join(shell_join(line) for line in lines),
    ])


def render_script(job: Job, python: str = sys.executable) -> str:
    lines = [
        "#!/bin/bash",
        "# Written by pretrain-slurm submit (pretrain/cli/slurm.py). Submit again with: sbatch <this file>",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.num_nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if job.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_node:
        lines.append(f"#SBATCH --cpus-per-task={job.cpus_per_node}")
    lines += [f"#SBATCH {option}" for option in job.sbatch_options]
    lines += [
        f"#SBATCH --chdir={job.workdir}",
        f"#SBATCH --output={job.slurm_dir}/slurm-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{job.signal_lead_s}",
        "",
        "set -u",
        f"RUN_DIR={shlex.quote(str(job.output_dir))}",
        *environment_lines(python),
    ]
    port = (f"$(( {DEFAULT_PORT_BASE} + SLURM_JOB_ID % 10000 ))" if job.port == "auto" else job.port)
    lines += [
        "",
        "# Rendezvous: the first node of the allocation, at the address SLURM itself uses for it.",
        'FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        'MASTER_ADDR=$(scontrol show node "$FIRST_NODE" --oneliner 2>/dev/null | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p")',
        'export MASTER_ADDR="${MASTER_ADDR:-$FIRST_NODE}"',
        f"export MASTER_PORT={port}",
        "",
        "# NCCL (GPU clusters): fail fast on a lost peer instead of hanging; say which network to use.",
        "export NCCL_ASYNC_ERROR_HANDLING=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        'export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"',
        "# export NCCL_SOCKET_IFNAME=ib0    # the interface that reaches the other nodes (ip -br addr)",
        "# export NCCL_IB_HCA=mlx5          # InfiniBand adapters NCCL may use",
        "# export GLOO_SOCKET_IFNAME=ib0    # the same for gloo (CPU runs)",
        "",
        "# Preemption: USR1 (the time limit is near, or scancel --signal=USR1 --batch) or TERM. Every rank",
        "# finishes its optimizer step and checkpoints; after USR1 the job is requeued and resumes from it.",
        "# Ranks that are still starting (no checkpoint to lose) get TERM after a grace period.",
        "STOP_SIGNAL='' SRUN_PID='' WATCHDOG_PID=''",
        "escalate_later() {  # runs in the background; killed once srun has exited",
        "  trap 'kill \"$SLEEP_PID\" 2>/dev/null; exit 0' TERM",
        '  sleep "$1" & SLEEP_PID=$!',
        '  wait "$SLEEP_PID" || return',
        '  echo "pretrain-slurm: ranks still running $1 s after the stop signal: sending them TERM"',
        '  scancel --signal=TERM "$SLURM_JOB_ID"  # every step of the job, not this batch shell',
        "}",
        "forward_stop() {",
        '  kill -USR1 "$SRUN_PID"  # srun forwards USR1 to every process of the step',
        f"  escalate_later {job.stop_grace_s} &",
        "  WATCHDOG_PID=$!",
        "}",
        "stop_training() {",
        '  [ -n "$STOP_SIGNAL" ] && return',
        "  STOP_SIGNAL=$1",
        '  echo "pretrain-slurm: $1 at $(date -Is): every rank checkpoints the step in flight and stops"',
        '  [ -n "$SRUN_PID" ] && forward_stop',
        "}",
        "trap 'stop_training USR1' USR1",
        "trap 'stop_training TERM' TERM",
        "# The allocation's start, requeue and end times: pretrain-slurm status counts the queue time between them.",
        "record_event() {",
        f'  printf \'{{"job_id": "%s", "event": "%s", "time": %s}}\\n\' "$SLURM_JOB_ID" "$1" "$(date +%s.%N)" '
        f'>> "$RUN_DIR/{SLURM_SUBDIR}/{ALLOCATIONS}"',
        "}",
        *resubmit_lines(job),
        "",
        "record_event start",
        'echo "pretrain-slurm: job $SLURM_JOB_ID start $(( ${SLURM_RESTART_COUNT:-0} + 1 )) at $(date -Is) '
        'on $SLURM_JOB_NODELIST, rendezvous $MASTER_ADDR:$MASTER_PORT"',
        *(doctor_lines(job) if job.doctor else []),
        'srun --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 '
        '--cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=1 \\',
        f"  bash -c {_single_quote(node_command(job))} &",
        "SRUN_PID=$!",
        '[ -n "$STOP_SIGNAL" ] && forward_stop  # a signal that came before srun started',
        "# A trapped signal interrupts wait; keep waiting until srun has really exited.",
        'while kill -0 "$SRUN_PID" 2>/dev/null; do wait "$SRUN_PID"; done',
        'wait "$SRUN_PID"; STATUS=$?',
        '[ -n "$WATCHDOG_PID" ] && kill "$WATCHDOG_PID" 2>/dev/null',
        "# runtime.straggler.action=exclude: training stopped with a checkpoint and named a host to leave out.",
        f'if [ -f "$RUN_DIR/{SLURM_SUBDIR}/{EXCLUDE_REQUEST}" ]; then',
        f'  rm -f "$RUN_DIR/{SLURM_SUBDIR}/{EXCLUDE_REQUEST}"',
        '  resubmit_excluding straggler "training stopped (exit $STATUS) to leave a slow host out"',
        "  record_event end",
        "  exit 0",
        "fi",
        'if [ "$STOP_SIGNAL" = USR1 ]; then',
        '  echo "pretrain-slurm: training stopped (exit $STATUS); requeueing job $SLURM_JOB_ID at $(date -Is)"',
        "  record_event requeue",
        '  scontrol requeue "$SLURM_JOB_ID" && exit 0',
        '  echo "pretrain-slurm: scontrol requeue failed; resubmit with: sbatch $RUN_DIR/slurm/job.sbatch"',
        "fi",
        'echo "pretrain-slurm: training exited with $STATUS at $(date -Is)"',
        "# A failure that another allocation may not repeat (a killed rank, a lost node, a hang): requeue, at most",
        "# --max-failure-requeues times; not a refusal (2), a divergence (3) or a Ctrl-C (130).",
        'case "$STATUS" in 0|2|3|130) ;; *)',
        f'  FAILURES=$(grep -c \'"event": "failure"\' "$RUN_DIR/{SLURM_SUBDIR}/{ALLOCATIONS}")',
        f'  if [ "$FAILURES" -lt {job.max_failure_requeues} ]; then',
        "    record_event failure",
        f'    echo "pretrain-slurm: requeueing job $SLURM_JOB_ID after a failure ($(( FAILURES + 1 )) of '
        f'{job.max_failure_requeues}); it resumes from the newest verified checkpoint"',
        '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "  fi",
        "  echo \"pretrain-slurm: not requeued: $FAILURES failure(s) so far, --max-failure-requeues "
        f'{job.max_failure_requeues}\"',
        "esac",
        "record_event end",
        'exit "$STATUS"',
    ]
    return "\n".join(lines) + "\n"


def resubmit_lines(job: Job) -> list[str]:
    """``resubmit_excluding WHO WHY``: submit this script again as a new job with ``--exclude`` of every host in
    excluded_hosts (pretrain doctor's failures, runtime.straggler's hosts), recorded in jobs.jsonl."""
    excluded = f"$RUN_DIR/{SLURM_SUBDIR}/{EXCLUDED_HOSTS}"
    return [
        "# A new job of this script without the excluded hosts (a running job's exclude list cannot change).",
        "resubmit_excluding() {  # $1: who asks (doctor, straggler); $2: why",
        f'  EXCLUDE=$(sort -u "{excluded}" | paste -sd, -)',
        '  echo "pretrain-slurm: $1: $2; resubmitting this job without $EXCLUDE"',
        f'  if NEW_JOB=$(sbatch --parsable --exclude="$EXCLUDE" "$RUN_DIR/{SLURM_SUBDIR}/job.sbatch"); then',
        "    NEW_JOB=${NEW_JOB%%;*}",
        '    printf \'{"job_id": "%s", "submitted": "%s", "script": "%s", "nodes": %s, "processes_per_node": %s, '
        '"world_size": %s, "argv": [], "exclude": "%s", "resubmitted_from": "%s", "by": "%s"}\\n\' "$NEW_JOB" '
        f'"$(date -Iseconds | cut -c1-19)" "$RUN_DIR/{SLURM_SUBDIR}/job.sbatch" {job.num_nodes} '
        f'{job.processes_per_node} {job.world_size} "$EXCLUDE" "$SLURM_JOB_ID" "$1" '
        f'>> "$RUN_DIR/{SLURM_SUBDIR}/jobs.jsonl"',
        '    echo "pretrain-slurm: submitted job $NEW_JOB excluding $EXCLUDE"',
        "  else",
        '    echo "pretrain-slurm: the resubmission without $EXCLUDE failed (above); fix or replace the nodes, '
        f'then: sbatch --exclude=$EXCLUDE $RUN_DIR/{SLURM_SUBDIR}/job.sbatch"',
        "  fi",
        "}",
    ]


def doctor_lines(job: Job) -> list[str]:
    """The health check before training: pretrain doctor on every node; unhealthy nodes are excluded from a
    new submission of this script (a running job's exclude list cannot change)."""
    command = node_command(job, DOCTOR_ENTRY, ("--exclude-file", str(job.slurm_dir / EXCLUDED_HOSTS)))
    return [
        "# Health check (pretrain doctor) on every node first; submitted with --no-doctor it is left out.",
        'srun --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 '
        '--cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=1 \\',
        f"  bash -c {_single_quote(command)}",
        "DOCTOR_STATUS=$?",
        'if [ "$DOCTOR_STATUS" = 1 ]; then',
        '  resubmit_excluding doctor "unhealthy node(s) named above"',
        "  record_event end",
        "  exit 1",
        'elif [ "$DOCTOR_STATUS" != 0 ]; then',
        '  echo "pretrain-slurm: doctor exited with $DOCTOR_STATUS at $(date -Is); not training"',
        "  record_event end",
        '  exit "$DOCTOR_STATUS"',
        "fi",
    ]


def excluded_hosts(slurm_dir: Path) -> list[str]:
    """The nodes pretrain doctor excluded from this run's jobs."""
    path = slurm_dir / EXCLUDED_HOSTS
    return sorted(set(path.read_text().split())) if path.is_file() else []


# ---- submit / status --------------------------------------------------------------------------------
def submit(job: Job, script: str) -> str:
    """Write the script and the submission record into the run directory, sbatch it, return the job id."""
    job.slurm_dir.mkdir(parents=True, exist_ok=True)
    path = job.slurm_dir / "job.sbatch"
    path.write_text(script)
    path.chmod(0o755)
    exclude = excluded_hosts(job.slurm_dir)
    job_id = sbatch(path, *([f"--exclude={','.join(exclude)}"] if exclude else []))
    record = {"job_id": job_id, "submitted": datetime.datetime.now().isoformat(timespec="seconds"),
              "script": str(path), "nodes": job.num_nodes, "processes_per_node": job.processes_per_node,
              "world_size": job.world_size, "argv": sys.argv[1:], "exclude": ",".join(exclude)}
    with open(job.slurm_dir / "jobs.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    return job_id


def scontrol_job(job_id: str) -> dict[str, str]:
    """`scontrol show job` fields (JobState, Restarts, NodeList, ...); empty when SLURM no longer knows it."""
    if shutil.which("scontrol") is None:
        return {}
    try:
        proc = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    fields: dict[str, str] = {}
    for token in proc.stdout.split() if proc.returncode == 0 else []:
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


LOG_BLOCK = 1 << 20  # bytes of a job log read at a time (the log grows with the run's logged steps)
ETA_WINDOW = 20  # the last logged training steps whose pace the ETA goes by


def count_in_file(path: Path, needles: list[str], block: int = LOG_BLOCK) -> list[int]:
    """How often each of ``needles`` occurs in ``path``, in one streaming pass: memory is one block (an occurrence
    across two blocks is counted once, from the bytes kept of the block before). [0, ...] when there is no file."""
    patterns = [needle.encode() for needle in needles]
    counts = [0] * len(patterns)
    if not path.is_file():
        return counts
    keep = max(len(p) for p in patterns) - 1
    tail = b""
    with open(path, "rb") as f:
        while chunk := f.read(block):
            data = tail + chunk
            for i, pattern in enumerate(patterns):
                # those wholly inside ``tail`` were counted with the block before
                counts[i] += data.count(pattern) - tail.count(pattern)
            tail = data[-keep:] if keep else b""
    return counts


def run_status(run_dir: Path) -> str:
    """Every submission's job (jobs.jsonl: one line a submission), its state and its log's starts and preemptions
    (the log counted in one streaming pass: it grows with the run), then the latest checkpoint, the last logged step
    and the ETA (read from the end of metrics.jsonl) and the goodput (goodput.json: one record an attempt). Nothing
    read whole grows with the run's steps."""
    records_path = run_dir / SLURM_SUBDIR / "jobs.jsonl"
    if not records_path.is_file():
        raise ConfigError(f"{run_dir} has no SLURM submissions ({records_path} is missing); submit with "
                          "pretrain-slurm submit --recipe R ... (the run directory is the recipe's output_dir)")
    out = []
    for record in rundir.read_appended(records_path):
        job_id = record["job_id"]
        fields = scontrol_job(job_id)
        log = run_dir / SLURM_SUBDIR / f"slurm-{job_id}.out"
        starts, preempted = count_in_file(log, [f"pretrain-slurm: job {job_id} start ", "preempted: stopped after step"])
        if fields:
            state = (f"{fields.get('JobState', '?')} (restarts {fields.get('Restarts', '?')}, nodes "
                     f"{fields.get('NodeList', '?')}, run time {fields.get('RunTime', '?')}, reason {fields.get('Reason', '?')})")
        elif shutil.which("scontrol") is None:
            state = "unknown: scontrol is not available here (run status on a node of the cluster)"
        else:
            state = f"no longer known to slurmctld (sacct -j {job_id} shows finished jobs where accounting is on)"
        out.append(f"job {job_id}  submitted {record['submitted']}  {record['nodes']} node(s) x "
                   f"{record['processes_per_node']} = world {record['world_size']}")
        out.append(f"  state        {state}")
        out.append(f"  starts       {starts} in the log ({max(starts - 1, 0)} requeue(s)); preemptions {preempted}")
        out.append(f"  log          {log}")
    out.append(f"checkpoint     {latest_checkpoint(run_dir)}")
    out.append(f"last step      {last_logged_step(run_dir)}")
    eta = training_eta(run_dir)
    if eta:
        out.append(f"eta            {eta}")
    out.append(f"goodput        {run_goodput(run_dir)}")
    return "\n".join(out)


def queue_intervals(slurm_dir: Path) -> list[tuple[float, float]]:
    """[requeue or end, next start) of the batch script's records: the job waiting for an allocation."""
    path = slurm_dir / ALLOCATIONS
    events = []
    if path.is_file():
        with open(path, encoding="utf-8", errors="replace") as lines:  # a line an allocation's event: streamed
            for line in lines:
                try:
                    record = json.loads(line)
                    events.append((float(record["time"]), str(record["event"])))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue  # a line cut off by a killed node: the interval it would open or close is left out
    events.sort()
    intervals, waiting_since = [], None
    for when, event in events:
        if event in ("requeue", "failure", "end"):
            waiting_since = when
        elif event == "start" and waiting_since is not None:
            intervals.append((waiting_since, when))
            waiting_since = None
    return intervals


def run_goodput(run_dir: Path) -> str:
    """The run's goodput over every attempt (goodput.json), the time between them split into SLURM's queue time
    (allocations.jsonl) and the rest (restart)."""
    try:
        attempts = read_goodput(run_dir)
    except ValueError as exc:
        return f"unreadable: {exc}"
    if not attempts:
        return "no attempt recorded yet"
    return summary_line(summarise(attempts, queue_intervals(run_dir / SLURM_SUBDIR)))


def latest_checkpoint(run_dir: Path) -> str:
    path = rundir.latest_checkpoint(run_dir)
    if path is None:
        return "none yet"
    state = rundir.read_state(path)
    return f"{path} (step {state['step']}/{state.get('num_steps', '?')}, {state.get('tokens_seen', 0):,} tokens)"


def _trained(record: dict) -> bool:
    return "train/loss" in record


def last_logged_step(run_dir: Path) -> str:
    """The last logged training step and its loss, from the last lines of metrics.jsonl (read from its end)."""
    if not (run_dir / rundir.METRICS_FILE).is_file():
        return "nothing logged yet"
    train = rundir.metrics_tail(run_dir, last=1, select=_trained).records
    if not train:
        return "no training step logged yet"
    loss = train[-1]["train/loss"]
    return f"{train[-1]['step']} (train/loss {loss:.4f})" if loss is not None else f"{train[-1]['step']} (train/loss -)"


def training_eta(run_dir: Path) -> str | None:
    """The training time left to the horizon (run_config.json's train/num_steps) at the pace of the last ETA_WINDOW
    logged training steps (their ``time``s, read from the end of metrics.jsonl); None when it cannot be told (fewer
    than two logged steps, no horizon, the run done). Queue time and restarts are not in it."""
    num_steps = (rundir.read_run_config(run_dir) or {}).get("train/num_steps")
    train = rundir.metrics_tail(run_dir, last=ETA_WINDOW, select=_trained).records
    if not isinstance(num_steps, int) or len(train) < 2:
        return None
    first, last = train[0], train[-1]
    steps, seconds = last["step"] - first["step"], (last.get("time") or 0) - (first.get("time") or 0)
    if steps <= 0 or seconds <= 0 or last["step"] >= num_steps:
        return None
    left = (num_steps - last["step"]) * seconds / steps
    return (f"{datetime.timedelta(seconds=round(left))} of training to step {num_steps} ({seconds / steps:.3g} s/step over the last "
            f"{steps} steps logged; queue time and restarts not counted)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "status":
            print(run_status(Path(args.run_dir)))
            return 0
        if not args.dry_run:
            require_sbatch()
        job = check_job(args)
        script = render_script(job)
        if args.dry_run:
            print(script, end="")
            return 0
        job_id = submit(job, script)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"submitted job {job_id}: {job.num_nodes} node(s) x {job.processes_per_node} process(es), "
          f"script {job.slurm_dir / 'job.sbatch'}")
    print(f"log: {job.slurm_dir / f'slurm-{job_id}.out'}   status: pretrain-slurm status {job.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
