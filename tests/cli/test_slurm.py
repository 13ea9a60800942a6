"""pretrain-slurm: the generated batch script, bad input, and real multi-node jobs on a private SLURM.

The unit tests read the script and run it with stand-in `srun` / `scontrol` / `sbatch` programs. The slow
tests start munged, slurmctld and two slurmd "nodes" on this machine (tests/slurm_cluster.py), submit
the tiny recipe as a 2-node job under DDP and ZeRO-2, and preempt one with USR1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pretrain.checkpoint.reshard import CheckpointLayout
from pretrain.cli import slurm
from pretrain.distributed.layout import Launch
from tests.helpers import (
    FAST,
    ROOT,
    TINY,
    accelerate_launch,
    check_ok,
    env,
    train_losses,
)
from tests.slurm_cluster import SlurmCluster

SLURM_TOOL = ["-m", "pretrain.cli.slurm"]
CONFIGS = ROOT / "accelerate_configs"
SEVEN_B = str(ROOT / "recipes" / "7b.yaml")
# GBS 8 = MBS 2 x GAS 2 x world 2: the layout of tests/multiprocess/test_distributed.py's cpu_ddp run.
CURVE = [*FAST, "batch.micro_batch_size=2", "checkpoint.keep_last=0"]
# The training tests leave the health check out: tests/distributed/test_doctor.py runs it on this cluster.
TWO_NODES = ["--nodes", "2", "--processes-per-node", "1", "--gpus-per-node", "0", "--no-doctor"]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> list[str]:
    """Overrides that give the tiny recipe a prepared token store of a tiny corpus (a multi-node job is
    not submitted without its store)."""
    from pretrain.cli import prepare_data
    from tests.data.test_data import make_docs, write_corpus

    root = tmp_path_factory.mktemp("store")
    overrides = [f"data.source={write_corpus(root / 'corpus', make_docs(24, seed=22))}", f"data.store={root / 'store'}",
                 f"data.cache_dir={root / 'cache'}"]
    assert prepare_data.main(["--recipe", TINY, *overrides]) == 0
    return overrides


def dry_run(capsys, *args: str) -> str:
    assert slurm.main(["submit", *args, "--dry-run"]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def sbatch_lines(script: str) -> list[str]:
    """The #SBATCH directives (sbatch stops reading them at the first command)."""
    lines = []
    for line in script.splitlines()[1:]:
        if line.startswith("#SBATCH "):
            lines.append(line.removeprefix("#SBATCH "))
        elif line.strip() and not line.startswith("#"):
            break
    return lines


def fake_programs(bin_dir: Path, log_dir: Path) -> None:
    """Stand-ins for sbatch, scontrol and srun that record what they were asked to do."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    programs = {
        "sbatch": f"""#!/bin/bash
            echo "$@" >> {log_dir}/sbatch.calls
            echo "4242;cluster"
        """,
        "scontrol": f"""#!/bin/bash
            case "$1 $2" in
              "show hostnames") printf 'gpu-a17\\ngpu-a18\\n' ;;
              "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=192.0.2.17 NodeHostName=$3" ;;
              "show job") echo "JobId=$4 JobName=tiny JobState=RUNNING Reason=None Restarts=2 RunTime=00:01:02 NodeList=gpu-a[17-18]" ;;
              *) echo "$@" >> {log_dir}/scontrol.calls ;;
            esac
        """,
        # One task per node, each with its own SLURM_NODEID, like srun --ntasks-per-node=1; USR1 is
        # forwarded to the tasks as srun does.
        "srun": """#!/bin/bash
            while [[ "$1" == --* ]]; do shift; done
            pids=()
            for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node "$@" & pids+=($!); done
            trap 'kill -USR1 "${pids[@]}"' USR1
            for pid in "${pids[@]}"; do while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done; done
        """,
        # scancel --signal=TERM JOB: TERM to every process of the job's steps (here: the fake trainers).
        "scancel": f"""#!/bin/bash
            echo "$@" >> {log_dir}/scancel.calls
            [ "$1" = --signal=TERM ] && kill -TERM $(cat {log_dir}/node*.pid)
        """,
    }
    for name, text in programs.items():
        path = bin_dir / name
        path.write_text(textwrap.dedent(text).lstrip())
        path.chmod(0o755)


# ---- the generated script -------------------------------------------------------------------------
def test_dry_run_4_nodes_x_8_gpus_zero3_7b(capsys, monkeypatch):
    monkeypatch.delenv("PRETRAIN_RUNS_DIR")  # the default output_dir, runs/7b (a dry run writes nothing there)
    run_dir = ROOT / "runs" / "7b" / "slurm"
    existed = run_dir.exists()
    script = dry_run(capsys, "--recipe", SEVEN_B, "--accelerate-config", str(CONFIGS / "zero3.yaml"),
                     "--nodes", "4", "--processes-per-node", "8")
    directives = sbatch_lines(script)
    for expected in ["--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--requeue", "--open-mode=append",
                     "--signal=B:USR1@300", "--job-name=7b", f"--chdir={Path.cwd()}",
                     f"--output={ROOT / 'runs' / '7b' / 'slurm'}/slurm-%j.out"]:
        assert expected in directives, (expected, directives)
    assert "--num_processes 32" in script
    assert "--deepspeed_multinode_launcher standard" in script
    assert "scontrol requeue" in script and "trap 'stop_training USR1' USR1" in script
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in script and "# export NCCL_SOCKET_IFNAME" in script
    assert f"export PRETRAIN_PYTHON={sys.executable}" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert run_dir.exists() == existed  # a dry run writes nothing


def test_sbatch_options_become_directives(capsys):
    script = dry_run(capsys, "--recipe", TINY, "--accelerate-config", str(CONFIGS / "ddp.yaml"), "--nodes", "2",
                     "--processes-per-node", "4", "--partition", "gpu", "--account", "proj42", "--qos", "high",
                     "--time", "1-00:00:00", "--constraint", "h100", "--exclusive", "--job-name", "tiny-2n",
                     "--cpus-per-node", "64", "--signal-lead-s", "600", "--sbatch-arg=--mem=0",
                     "--sbatch-arg=--mail-type=END", "train.max_steps=40", "batch.micro_batch_size=4")
    directives = sbatch_lines(script)
    for expected in ["--partition=gpu", "--account=proj42", "--qos=high", "--time=1-00:00:00",
                     "--constraint=h100", "--exclusive", "--job-name=tiny-2n", "--cpus-per-task=64",
                     "--gpus-per-node=4", "--signal=B:USR1@600", "--mem=0", "--mail-type=END"]:
        assert expected in directives, (expected, directives)
    assert "train.max_steps=40" in script and "--num_processes 8" in script
    assert "--deepspeed_multinode_launcher" not in script  # DDP: torchrun on each node anyway
    assert "OMP_NUM_THREADS:-$(( SLURM_CPUS_ON_NODE / 4" in script


def test_cpu_nodes_request_no_gpus(capsys):
    script = dry_run(capsys, "--recipe", TINY, "--accelerate-config", str(CONFIGS / "cpu_ddp.yaml"), *TWO_NODES)
    assert not any(line.startswith("--gpus") for line in sbatch_lines(script))


def test_a_cpu_accelerate_config_requests_no_gpus_by_itself(capsys, tmp_path, store):
    """use_cpu: true (cpu.yaml) or MULTI_CPU: no --gpus-per-node, which a cluster without GPUs refuses."""
    script = dry_run(capsys, "--recipe", TINY, "--accelerate-config", str(CONFIGS / "cpu.yaml"), "--nodes", "1",
                     "--processes-per-node", "1")
    assert not any(line.startswith("--gpus") for line in sbatch_lines(script)), script
    multi_cpu = tmp_path / "multi_cpu.yaml"
    multi_cpu.write_text((CONFIGS / "cpu_ddp.yaml").read_text().replace("distributed_type: MULTI_GPU",
                                                                          "distributed_type: MULTI_CPU"))
    script = dry_run(capsys, "--recipe", TINY, "--accelerate-config", str(multi_cpu), "--nodes", "2",
                     "--processes-per-node", "2", "batch.micro_batch_size=8", *store)
    assert not any(line.startswith("--gpus") for line in sbatch_lines(script)), script
    # a GPU config still requests one GPU per process, and --gpus-per-node still wins
    script = dry_run(capsys, "--recipe", TINY, "--accelerate-config", str(CONFIGS / "ddp.yaml"), "--nodes", "2",
                     "--processes-per-node", "2", "batch.micro_batch_size=8", *store)
    assert "--gpus-per-node=2" in sbatch_lines(script)
    script = dry_run(capsys, "--recipe", TINY, "--accelerate-config", str(CONFIGS / "cpu.yaml"), "--nodes", "1",
                     "--processes-per-node", "1", "--gpus-per-node", "1")
    assert "--gpus-per-node=1" in sbatch_lines(script)


def test_each_node_evaluates_its_own_rank_and_the_first_nodes_address(tmp_path, monkeypatch, store):
    """Run the generated script with stand-in srun/scontrol: every node's launch gets its own rank."""
    fake_programs(tmp_path / "bin", tmp_path)
    python = tmp_path / "bin" / "fake-python"  # records its arguments and environment, per node
    python.write_text("#!/bin/bash\n"
                      'printf "%s\\n" "$@" > "$ARGS_DIR/node$SLURM_NODEID.args"\n'
                      'echo "$MASTER_ADDR $MASTER_PORT $OMP_NUM_THREADS" > "$ARGS_DIR/node$SLURM_NODEID.env"\n')
    python.chmod(0o755)
    tricky = "logging.run_name=it's $HOME and \"quotes\""
    args = slurm.parse_args(["submit", "--recipe", TINY, "--accelerate-config", str(CONFIGS / "zero2.yaml"),
                             *TWO_NODES, tricky, f"output_dir={tmp_path / 'run'}", *store])
    job = slurm.check_job(args)
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.render_script(job, python=str(python)))
    # A job's environment without OMP_NUM_THREADS (the test runner may set it): the script derives it from the CPUs.
    job_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    run_env = {**job_env, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "ARGS_DIR": str(tmp_path),
               "SLURM_JOB_ID": "1234", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-a[17-18]",
               "SLURM_CPUS_ON_NODE": "4"}
    proc = subprocess.run(["bash", str(script)], env=run_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for node in (0, 1):
        argv = (tmp_path / f"node{node}.args").read_text().splitlines()
        option = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
        assert argv[:2] == ["-m", "accelerate.commands.launch"]
        assert option["--machine_rank"] == str(node)
        assert option["--num_machines"] == "2" and option["--num_processes"] == "2"
        assert option["--main_process_ip"] == "192.0.2.17"  # the first node's NodeAddr
        assert option["--main_process_port"] == str(20000 + 1234)
        assert option["--deepspeed_multinode_launcher"] == "standard"
        assert tricky in argv  # overrides arrive verbatim through two shells
        assert argv[argv.index("--recipe") - 1] == str(ROOT / "pretrain" / "run.py")
        assert (tmp_path / f"node{node}.env").read_text().split() == ["192.0.2.17", "21234", "4"]
    assert "rendezvous 192.0.2.17:21234" in proc.stdout


def fake_trainer(path: Path, catch_usr1: bool = True) -> Path:
    """A node's launcher plus trainer: says when it runs, stops cleanly on USR1 (or TERM), writes which."""
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""
        import os, pathlib, signal, sys, time
        node = pathlib.Path(os.environ["ARGS_DIR"]) / ("node" + os.environ["SLURM_NODEID"])
        def stop(signum, frame):
            node.with_suffix(".stopped").write_text(signal.Signals(signum).name)
            sys.exit(0)
        if {catch_usr1}:
            signal.signal(signal.SIGUSR1, stop)
        signal.signal(signal.SIGTERM, stop)
        node.with_suffix(".pid").write_text(f"{{os.getpid()}}\\n")
        time.sleep(60)
        sys.exit(3)
    """))
    path.chmod(0o755)
    return path


def run_batch_script_and_signal(tmp_path: Path, sig: str, store: list[str], catch_usr1: bool = True, **job_changes):
    """The generated script with stand-in srun/scontrol/scancel; `sig` is sent once both nodes run."""
    fake_programs(tmp_path / "bin", tmp_path)
    python = fake_trainer(tmp_path / "bin" / "fake-python", catch_usr1)
    args = slurm.parse_args(["submit", "--recipe", TINY, "--accelerate-config", str(CONFIGS / "cpu_ddp.yaml"),
                             *TWO_NODES, f"output_dir={tmp_path / 'run'}", *store])
    job = dataclasses.replace(slurm.check_job(args), **job_changes)
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.render_script(job, python=str(python)))
    run_env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "ARGS_DIR": str(tmp_path),
               "SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_CPUS_ON_NODE": "2"}
    proc = subprocess.Popen(["bash", str(script)], env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"node{n}.pid").exists() for n in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)
        proc.send_signal(getattr(signal, f"SIG{sig}"))
        output, _ = proc.communicate(timeout=30)
    finally:  # whatever happened, leave no fake trainer behind (checked by its command line: PIDs get reused)
        for pid_file in tmp_path.glob("node*.pid"):
            with contextlib.suppress(OSError, ValueError):
                pid = int(pid_file.read_text())
                if str(python).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
        proc.kill()
    stopped_by = [(tmp_path / f"node{n}.stopped").read_text() for n in (0, 1)]
    calls = {name: (tmp_path / f"{name}.calls").read_text() if (tmp_path / f"{name}.calls").exists() else ""
             for name in ("scontrol", "scancel")}
    return proc.returncode, output, stopped_by, calls


@pytest.mark.parametrize("sig, requeued", [("USR1", True), ("TERM", False)])
def test_batch_script_forwards_the_signal_then_requeues_after_usr1(tmp_path, sig, requeued, store):
    """USR1 to the batch shell reaches every node's ranks; once they exit, the job requeues itself."""
    code, output, stopped_by, calls = run_batch_script_and_signal(tmp_path, sig, store)
    # The launchers ignore USR1 (its default action would kill them); the ranks get it from srun.
    assert stopped_by == ["SIGUSR1", "SIGUSR1"], output
    assert code == 0 and f"pretrain-slurm: {sig} at" in output, output
    assert ("requeue 77" in calls["scontrol"]) == requeued, output
    assert ("requeueing job 77" in output) == requeued
    assert calls["scancel"] == ""  # no escalation: every rank stopped in time


def test_ranks_that_ignore_usr1_get_term_after_the_grace_period(tmp_path, store):
    """A rank still starting up has not installed its handler: the watchdog stops it with TERM."""
    code, output, stopped_by, calls = run_batch_script_and_signal(tmp_path, "USR1", store, catch_usr1=False,
                                                                  stop_grace_s=1)
    assert calls["scancel"].split() == ["--signal=TERM", "77"], output
    assert stopped_by == ["SIGTERM", "SIGTERM"] and "ranks still running 1 s after the stop signal" in output
    assert code == 0 and "requeue 77" in calls["scontrol"]


def test_submit_writes_the_script_into_the_run_dir_and_status_reads_it(tmp_path, capsys, monkeypatch, store):
    fake_programs(tmp_path / "bin", tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    out = tmp_path / "run"
    code = slurm.main(["submit", "--recipe", TINY, "--accelerate-config", str(CONFIGS / "cpu_ddp.yaml"), *TWO_NODES,
                       f"output_dir={out}", *store])
    printed = capsys.readouterr().out
    assert code == 0 and "submitted job 4242" in printed
    assert (tmp_path / "sbatch.calls").read_text().split() == ["--parsable", str(out / "slurm" / "job.sbatch")]
    assert "#SBATCH --requeue" in (out / "slurm" / "job.sbatch").read_text()
    (record,) = [json.loads(line) for line in (out / "slurm" / "jobs.jsonl").read_text().splitlines()]
    assert record["job_id"] == "4242" and record["world_size"] == 2

    (out / "slurm" / "slurm-4242.out").write_text("pretrain-slurm: job 4242 start 1\npreempted: stopped after step 8/40\n"
                                                   "pretrain-slurm: job 4242 start 2\n")
    (out / "checkpoints" / "step_00000008").mkdir(parents=True)
    (out / "checkpoints" / "step_00000008" / "trainer_state.json").write_text(
        json.dumps({"step": 8, "num_steps": 40, "tokens_seen": 4096}))
    (out / "checkpoints" / "latest").write_text("step_00000008")
    assert slurm.main(["status", str(out)]) == 0
    status = capsys.readouterr().out
    assert "RUNNING (restarts 2" in status
    assert "2 in the log (1 requeue(s)); preemptions 1" in status
    assert "step_00000008 (step 8/40, 4,096 tokens)" in status


# ---- bad input: one message, exit 2, nothing submitted --------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        ([*TWO_NODES, "batch.global_batch_size=30"],
         "batch.global_batch_size (30) is not divisible by batch.micro_batch_size (16) x world size (2)"),
        ([*TWO_NODES, "model.hiden_size=3"], "did you mean 'model.hidden_size'"),
        ([*TWO_NODES, "precision.dtype=fp16"], "precision.dtype=fp16 needs a CUDA GPU"),
        ([*TWO_NODES, "--port", "80"], "--port must be auto or a port number 1024-65535"),
    ],
)
def test_bad_input_fails_before_anything_is_written_or_submitted(tmp_path, capsys, monkeypatch, args, message):
    fake_programs(tmp_path / "bin", tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    out = tmp_path / "run"
    code = slurm.main(["submit", "--recipe", TINY, "--accelerate-config", str(CONFIGS / "cpu_ddp.yaml"), *args,
                       f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err, err
    assert not out.exists() and not (tmp_path / "sbatch.calls").exists()


def test_a_multi_node_job_without_its_store_is_not_submitted_and_gets_the_prepare_commands(tmp_path, capsys,
                                                                                          monkeypatch, store):
    fake_programs(tmp_path / "bin", tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    missing = tmp_path / "missing"
    argv = ["submit", "--recipe", TINY, "--accelerate-config", str(CONFIGS / "cpu_ddp.yaml"), *TWO_NODES,
            "--partition", "cpu", f"output_dir={tmp_path / 'run'}", *store[:1], f"data.store={missing}"]
    assert slurm.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: data: no token store at {missing} ") and "a 2-node launch does not tokenize" in err
    overrides = f"output_dir={tmp_path / 'run'} {store[0]} data.store={missing}"
    assert f"\n    pretrain-prepare-data --recipe {TINY} {overrides}\n" in err
    assert f"    pretrain-prepare-data --recipe {TINY} --slurm --array 2 --partition=cpu {overrides}" in err
    assert not (tmp_path / "sbatch.calls").exists() and not (tmp_path / "run").exists() and not missing.exists()
    assert slurm.main([*argv, "--dry-run"]) == 0  # a dry run prints the script and warns
    assert capsys.readouterr().err.startswith(f"warning: data: no token store at {missing} ")


def test_a_store_made_from_other_data_is_refused_before_submitting(tmp_path, capsys, monkeypatch, store):
    fake_programs(tmp_path / "bin", tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert slurm.main(["submit", "--recipe", TINY, "--accelerate-config", str(CONFIGS / "cpu_ddp.yaml"), *TWO_NODES,
                       f"output_dir={tmp_path / 'run'}", *store, "data.val_fraction=0.3"]) == 2
    # (a BPE is trained on the training documents: another val_fraction is another tokenizer)
    assert "the store was made with tokenizer 'bpe-4096' (identity" in capsys.readouterr().err
    assert not (tmp_path / "sbatch.calls").exists()


@pytest.mark.parametrize("saved, config, resumed_by", [
    # a DDP checkpoint of an older pretrain (no optimizer parameter names: it converts for no other engine). CPU nodes
    # (--gpus-per-node 0): cpu_ddp
    (Launch("ddp", gpus_per_node=2), "zero3.yaml", "cpu_ddp.yaml"),
])
def test_a_checkpoint_the_job_cannot_resume_is_not_submitted_and_gets_the_submission_that_does(
        tmp_path, capsys, monkeypatch, store, saved, config, resumed_by):
    """pretrain-launch's resume check (tests/checkpoint/test_reshard.py), asked for the job's launch on the submitting
    machine: refused before anything is written or queued, with a pretrain-slurm submit command (the same
    options) that passes the same checks and submits."""
    from tests.checkpoint.test_reshard import make_checkpoint

    fake_programs(tmp_path / "bin", tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    make_checkpoint(out / "checkpoints" / "step_00000003", world=saved.world_size, layout=saved.to_dict())
    argv = ["submit", "--recipe", TINY, "--accelerate-config", str(CONFIGS / config), *TWO_NODES, "--partition", "cpu",
            "--sbatch-arg=--mem=0", f"output_dir={out}", *store]
    for extra in ([], ["--dry-run"]):  # the script a dry run prints would fail on the nodes as well
        assert slurm.main([*argv, *extra]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and "Traceback" not in captured.err
    err = captured.err.splitlines()
    assert err[0].startswith(f"error: cannot resume {out / 'checkpoints' / 'step_00000003'}")
    assert CheckpointLayout.of(saved).describe() in err[0] and err[-2] == "This submission resumes it:"
    command = shlex.split(err[-1])
    assert command[:2] == ["pretrain-slurm", "submit"]
    assert command[command.index("--accelerate-config") + 1] == f"accelerate_configs/{resumed_by}"
    for option in ("--partition", "cpu", "--sbatch-arg=--mem=0", "--no-doctor", f"output_dir={out}", *store):
        assert option in command, command
    assert "--dry-run" in command and not (out / "slurm").exists() and not (tmp_path / "sbatch.calls").exists()
    command.remove("--dry-run")
    assert slurm.main(command[1:]) == 0, capsys.readouterr().err
    assert "submitted job 4242: 2 node(s) x 1 process(es)" in capsys.readouterr().out


def test_single_process_accelerate_config_on_two_nodes(capsys):
    code = slurm.main(["submit", "--recipe", TINY, "--accelerate-config", str(CONFIGS / "cpu.yaml"), *TWO_NODES,
                       "--dry-run"])
    assert code == 2 and "runs one process (distributed_type: NO)" in capsys.readouterr().err


def test_no_slurm_here_is_one_clear_message_without_traceback(tmp_path):
    """The real CLI, on a PATH without sbatch: exit 2, one line, and no run directory."""
    out = tmp_path / "run"
    no_slurm = {**env(), "PATH": os.path.dirname(sys.executable)}
    cmd = [sys.executable, *SLURM_TOOL, "submit", "--recipe", TINY, "--accelerate-config",
           str(CONFIGS / "cpu_ddp.yaml"), *TWO_NODES, f"output_dir={out}"]
    proc = subprocess.run(cmd, env=no_slurm, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: SLURM is not available here: `sbatch` is not on PATH"), proc.stderr
    assert "--dry-run" in proc.stderr and not out.exists()

    proc = subprocess.run([*cmd[:-1], "--nodes", "0"], env=no_slurm, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_status_of_a_run_never_submitted(tmp_path, capsys):
    assert slurm.main(["status", str(tmp_path)]) == 2
    assert "has no SLURM submissions" in capsys.readouterr().err


# ---- a real SLURM: two nodes on this machine ------------------------------------------------------
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}


def submit(cluster: SlurmCluster, config: str, overrides: list[str]) -> str:
    cmd = [sys.executable, *SLURM_TOOL, "submit", "--recipe", TINY, "--accelerate-config", str(CONFIGS / config),
           *TWO_NODES, *overrides]
    proc = subprocess.run(cmd, env=cluster.env(env()), cwd=ROOT, capture_output=True, text=True, timeout=120)
    check_ok(proc)
    return re.search(r"submitted job (\d+)", proc.stdout).group(1)


def wait_for_job(cluster: SlurmCluster, job_id: str, log: Path, timeout_s: float = 300) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fields = cluster.job(job_id)
        if fields.get("JobState") in FINAL_STATES:
            return fields
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not finish within {timeout_s}s: {cluster.job(job_id)}\n"
                         f"{read(log)[-4000:]}\n{cluster.logs()}")


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else f"({path} does not exist)"


def local_two_process_run(run_dir: Path, overrides: list[str]) -> dict[int, float]:
    check_ok(accelerate_launch("cpu_ddp.yaml", [*overrides, f"output_dir={run_dir}"]))
    return train_losses(run_dir)


@pytest.fixture(scope="module")
def six_step_reference(tmp_path_factory):
    return local_two_process_run(tmp_path_factory.mktemp("local") / "ddp", [*CURVE, "train.max_steps=6"])


@pytest.mark.slow
@pytest.mark.parametrize("config, distributed_type", [("cpu_ddp.yaml", "MULTI_CPU"), ("zero2.yaml", "DEEPSPEED")])
def test_two_node_job_trains_like_a_local_two_process_run(cluster, six_step_reference, tmp_path, config,
                                                          distributed_type):
    out = tmp_path / "run"
    start = time.perf_counter()
    job_id = submit(cluster, config, [*CURVE, "train.max_steps=6", f"output_dir={out}"])
    log = out / "slurm" / f"slurm-{job_id}.out"
    fields = wait_for_job(cluster, job_id, log)
    print(f"\n{config}: job {job_id} {fields['JobState']} in {time.perf_counter() - start:.0f}s on {fields['NodeList']}")
    assert fields["JobState"] == "COMPLETED", read(log)[-6000:]
    assert fields["NumNodes"] == "2"
    run_config = json.loads((out / "run_config.json").read_text())
    assert run_config["dist/world_size"] == 2 and run_config["dist/distributed_type"] == distributed_type
    assert run_config["dist/num_machines"] == 2  # one process on each of the two SLURM nodes
    assert "world size 2" in read(log)

    losses = train_losses(out)
    print("step | local 2 processes | SLURM 2 nodes")
    for step in sorted(six_step_reference):
        print(f"{step:4d} | {six_step_reference[step]:17.7f} | {losses.get(step, float('nan')):13.7f}")
    assert sorted(losses) == list(range(1, 7))
    for step, loss in losses.items():
        assert loss == pytest.approx(six_step_reference[step], rel=1e-4), (step, loss, six_step_reference[step])
    assert (out / "final_model").is_dir()


# ---- pretrain-prepare-data --slurm: the token store as an array job -------------------------------
def prepare_recipe(tmp_path: Path) -> tuple[Path, Path]:
    """The tiniest corpus that still makes several shards, and a recipe that names it."""
    from tests.data.test_data import make_docs, write_corpus

    corpus = write_corpus(tmp_path / "corpus", make_docs(24, seed=21))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("batch: {global_batch_size: 8, micro_batch_size: 2}\ntrain: {max_steps: 10}\n"
                      f"data: {{source: {corpus}, seq_len: 32, tokenizer_vocab_size: 300, store_shard_bytes: 1500, "
                      f"val_fraction: 0.2, cache_dir: {tmp_path / 'cache'}}}\n")
    return corpus, recipe


def test_prepare_dry_run_prints_the_array_and_its_finish_job(tmp_path, capsys):
    from pretrain.cli import prepare_data

    _, recipe = prepare_recipe(tmp_path)
    store = tmp_path / "store"
    assert prepare_data.main(["--recipe", str(recipe), "--slurm", "--array", "4", "--max-running", "2",
                              "--partition", "cpu", "--cpus-per-task", "16", "--dry-run", f"data.store={store}"]) == 0
    out = capsys.readouterr().out
    array, finish = out.split(f"# {tmp_path / 'store.slurm' / 'finish.sbatch'}")
    assert sbatch_lines(array.split("\n", 1)[1])[:6] == ["--job-name=prepare-r", "--nodes=1", "--ntasks=1",
                                                         "--array=0-3%2", "--cpus-per-task=16", "--partition=cpu"]
    assert '--task "$SLURM_ARRAY_TASK_ID" --num-tasks 4 --workers "${SLURM_CPUS_PER_TASK:-$SLURM_CPUS_ON_NODE}"' in array
    assert f"--output={tmp_path / 'store.slurm'}/prepare-%A_%a.out" in array
    assert "--kill-on-invalid-dep=yes" in finish and "--finish" in finish and f"data.store={store}" in finish
    for script in (array.split("\n", 1)[1], finish.split("\n", 1)[1]):
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert not store.exists() and not (tmp_path / "store.slurm").exists()  # a dry run writes nothing


@pytest.mark.parametrize("args, message", [
    (["--slurm"], "--slurm needs --array N"),
    (["--array", "4"], "--array only apply with --slurm"),
    (["--slurm", "--array", "2", "--partition", "a b"], "--partition = 'a b' must be one word"),
    (["--task", "2", "--num-tasks", "2"], "the task must be 0 .. 1"),
    (["--task", "0"], "--task I and --num-tasks N go together"),
])
def test_prepare_slurm_bad_input_is_one_message(tmp_path, capsys, args, message):
    from pretrain.cli import prepare_data

    _, recipe = prepare_recipe(tmp_path)
    assert prepare_data.main(["--recipe", str(recipe), *args, f"data.store={tmp_path / 'store'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "store").exists()


def test_finish_without_every_shard_names_the_missing_ones(tmp_path, capsys):
    from pretrain.cli import prepare_data

    _, recipe = prepare_recipe(tmp_path)
    store = tmp_path / "store"
    argv = ["--recipe", str(recipe), f"data.store={store}"]
    assert prepare_data.main([*argv, "--task", "0", "--num-tasks", "2"]) == 2  # not set up yet
    assert "has not been set up" in capsys.readouterr().err
    from pretrain.data.prepare import set_up_store
    from pretrain.recipe.config import load_recipe

    _, num_shards = set_up_store(load_recipe(recipe, [f"data.store={store}"]).data, log=lambda _: None)
    assert num_shards >= 4
    assert prepare_data.main([*argv, "--task", "1", "--num-tasks", "2"]) == 0
    assert prepare_data.main([*argv, "--finish"]) == 2
    missing = ", ".join(str(i) for i in range(0, num_shards, 2))
    assert f"of {num_shards} shards of the token store at {store} are not complete (shards {missing})" in capsys.readouterr().err
    assert not (store / "manifest.json").exists()


@pytest.mark.slow
def test_array_job_on_two_nodes_writes_the_store_byte_identical_to_a_local_build(cluster, tmp_path):
    from tests.data.test_store import checksums

    _, recipe = prepare_recipe(tmp_path)
    local, remote = tmp_path / "local", tmp_path / "remote"
    # The local reference build, by the CLI in a process of its own as a user runs it: built in this test process, the
    # store's tokenizer/tokenizer_config.json once differed from the array job's (a full suite's earlier tests in the
    # same worker had left transformers' process state behind); the guarantee is between the commands.
    check_ok(subprocess.run([sys.executable, "-m", "pretrain.cli.prepare_data", "--recipe", str(recipe), "--workers", "1",
                             f"data.store={local}"], env=env(), cwd=ROOT, capture_output=True, text=True, timeout=300))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pretrain.cli.prepare_data", "--recipe", str(recipe), "--slurm",
                           "--array", "2", f"data.store={remote}"], env=cluster.env(env()), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    check_ok(proc)
    array_id, finish_id = re.search(r"submitted array job (\d+): .* job (\d+) writes the manifest", proc.stdout).groups()
    logs = tmp_path / "remote.slurm"
    finish = wait_for_job(cluster, finish_id, logs / f"finish-{finish_id}.out")
    task_logs = {i: read(logs / f"prepare-{array_id}_{i}.out") for i in range(2)}
    print(f"\narray {array_id} + finish {finish_id}: {finish['JobState']} in {time.perf_counter() - start:.0f}s")
    assert finish["JobState"] == "COMPLETED", (task_logs, read(logs / f"finish-{finish_id}.out"))
    nodes = set()
    for i in range(2):
        task = cluster.job(f"{array_id}_{i}")
        assert task["JobState"] == "COMPLETED", task_logs[i]
        nodes.add(task["NodeList"])
        assert re.search(rf"task {i} of 2: tokenizing \d+ of \d+ shard\(s\)", task_logs[i]), task_logs[i]
    assert nodes == {"n1", "n2"}  # one task on each node
    assert "data: tokenizing" not in read(logs / f"finish-{finish_id}.out")  # the finish job only writes the manifest
    built, reference = checksums(remote), checksums(local)
    assert set(built) == set(reference)
    differ = sorted(k for k, v in built.items() if reference[k] != v)
    assert not differ, {k: ((local / k).read_text()[:2000], (remote / k).read_text()[:2000]) for k in differ
                        if k.endswith(".json")} or differ
