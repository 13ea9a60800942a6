"""A real, private SLURM cluster on this machine for the tests: munged, slurmctld and two slurmd "nodes".

Everything lives in one temporary directory (munge key and socket, slurm.conf, state, spool, logs); the
daemons run in the foreground as our own child processes and are stopped by PID. Clients (sbatch,
squeue, scontrol, and tools/slurm.py) find this cluster through ``SLURM_CONF`` in ``cluster.env()``.
Debian's packages are installed with apt-get when they are missing; where that is impossible the tests
skip with the reason (``SlurmUnavailable``).

Both nodes are this host (NodeAddr=127.0.0.1) with one CPU each, so a 2-node job is 2 processes here.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
DAEMONS = ["munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo"]
NODES = ["n1", "n2"]


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be installed or started here; the message says why."""


def _missing_programs() -> list[str]:
    found = {name: shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin") for name in DAEMONS}
    return [name for name, path in found.items() if path is None]


def ensure_installed(timeout_s: float = 600) -> None:
    """Install Debian's SLURM and munge packages with apt-get if any program is missing."""
    missing = _missing_programs()
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"SLURM is not installed ({', '.join(missing)} missing) and there is no apt-get")
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"SLURM is not installed ({', '.join(missing)} missing) and apt-get needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed: {exc}") from None
        if proc.returncode != 0:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
    if missing := _missing_programs():
        raise SlurmUnavailable(f"apt-get installed {' '.join(PACKAGES)} but {', '.join(missing)} is still missing")


def _free_ports(count: int) -> list[int]:
    """Ports that are free now (bound and released), distinct from each other."""
    sockets, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def _program(name: str) -> str:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin") or name


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket.2"
        self.host = socket.gethostname().split(".")[0]
        self.procs: dict[str, subprocess.Popen] = {}

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this process's environment) plus what a client needs to reach this cluster."""
        out = dict(os.environ if base is None else base)
        out["SLURM_CONF"] = str(self.conf)
        out["PATH"] = out.get("PATH", "") + ":/usr/sbin:/sbin"
        return out

    # ---- start / stop -------------------------------------------------------------------------
    def start(self, timeout_s: float = 60) -> SlurmCluster:
        if os.geteuid() != 0:
            raise SlurmUnavailable("slurmd must run as root to start jobs; run the tests as root")
        for sub in ("munge", "state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn("munged", [_program("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={self.root / 'run' / 'munged.pid'}",
                               f"--log-file={self.root / 'log' / 'munged.log'}",
                               f"--seed-file={self.root / 'munge' / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), timeout_s, "munged did not open its socket")
        self.write_conf()
        self._spawn("slurmctld", [_program("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self._ping(), timeout_s, "slurmctld did not answer `scontrol ping`")
        for node in NODES:
            self._spawn(f"slurmd-{node}", [_program("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
        self._wait(self._nodes_idle, timeout_s, "the nodes did not become idle in `sinfo`")
        return self

    def stop(self) -> None:
        # Jobs first (a slurmd that stops leaves its job steps running), then slurmd, the controller and
        # munged, each by its PID.
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            self.run("scancel", f"--user={getpass.getuser()}")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self.run("squeue", "--noheader").stdout.strip():
                time.sleep(0.5)
        for name in [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)

    def __enter__(self) -> SlurmCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def write_conf(self) -> None:
        ctld_port, *node_ports = _free_ports(1 + len(NODES))
        r = self.root
        lines = [
            "ClusterName=pretraintest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmUser={getpass.getuser()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            "JobRequeue=1",
            "KillWait=30",
            "MinJobAge=600",
            "InactiveLimit=0",
            "Waittime=0",
            # Start a requeued job within seconds, not minutes: a requeued job waits for cred_expire
            # (AuthInfo above) and then for the next scheduling pass.
            "SchedulerParameters=sched_interval=2,bf_interval=2",
        ]
        for node, port in zip(NODES, node_ports, strict=True):
            lines.append(f"NodeName={node} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} CPUs=1 State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    # ---- helpers ----------------------------------------------------------------------------------
    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([_program(cmd[0]), *cmd[1:]], env=self.env(), capture_output=True, text=True,
                              timeout=timeout)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ...); empty once the job is forgotten."""
        proc = self.run("scontrol", "show", "job", "--oneliner", job_id)
        fields = {}
        for token in proc.stdout.split():
            key, sep, value = token.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields

    def logs(self) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*.log")):
            out.append(f"==> {path.name} <==\n" + "\n".join(path.read_text(errors="replace").splitlines()[-40:]))
        return "\n".join(out)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "wb")  # the child keeps its own descriptor
        self.procs[name] = subprocess.Popen(cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def _ping(self) -> bool:
        proc = self.run("scontrol", "ping")
        return proc.returncode == 0 and "UP" in proc.stdout

    def _nodes_idle(self) -> bool:
        proc = self.run("sinfo", "--noheader", "--Node", "--format=%N %t")
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in NODES)

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with {proc.returncode} while starting:\n{self.logs()}"
                                           + self._stdout_tail(name))
            if ready():
                return
            time.sleep(0.2)
        raise SlurmUnavailable(f"{what} within {timeout_s:.0f}s:\n{self.logs()}")

    def _stdout_tail(self, name: str) -> str:
        path = self.root / "log" / f"{name}.stdout"
        return f"\n==> {path.name} <==\n{path.read_text(errors='replace')[-2000:]}" if path.exists() else ""
