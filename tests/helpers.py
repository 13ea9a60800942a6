"""Launch the real entry point in subprocesses and read what runs write."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = str(ROOT / "pretrain" / "run.py")
TINY = str(ROOT / "recipes" / "tiny.yaml")

# A smaller, faster variant of the tiny recipe for tests that check mechanics, not learning.
FAST = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.intermediate_size=128",
    "data.seq_len=64",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "lr_schedule.warmup_steps=1",
    "train.eval_batches=2",
    "train.log_every_steps=1",
    "logging.progress=plain",
]


def free_port() -> int:
    """A TCP port free now on localhost, for a rendezvous (29500 may be held by another run or test)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env(**extra: str | None) -> dict[str, str]:
    """The test environment: offline hub, CPU DeepSpeed, a shared data cache. A None value removes a variable."""
    out = dict(os.environ)
    out.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "DS_ACCELERATOR": "cpu",
                "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    out.setdefault("PRETRAIN_CACHE_DIR", str(ROOT / ".cache" / "pretrain"))
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def run_cmd(cmd: list[str], timeout: float = 600, extra_env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own; on a timeout (or an interrupt) the whole session is killed, so the
    workers of a hung ``accelerate launch`` do not outlive the test."""
    with subprocess.Popen(cmd, cwd=ROOT, env=env(**(extra_env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def train(args: list[str], recipe: str = TINY, timeout: float = 600, extra_env: dict | None = None):
    return run_cmd([sys.executable, RUN, "--recipe", recipe, *args], timeout=timeout, extra_env=extra_env)


def accelerate_launch(config: str, args: list[str], recipe: str = TINY, extra: list[str] = (), timeout: float = 900,
                      script: list[str] = (RUN,)):
    """``accelerate launch`` of ``script`` (the entry point, or a test's wrapper of it and its arguments)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / config),
           *extra, *script, "--recipe", recipe, *args]
    return run_cmd(cmd, timeout=timeout)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["train/loss"] for m in metrics(run_dir) if "train/loss" in m}


def val_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["val/loss"] for m in metrics(run_dir) if "val/loss" in m}


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
