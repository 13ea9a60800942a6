"""Numbers at the edges of their types on every command's options (pretrain/cli/options.py), SLURM durations
checked against each other, and wandb asked to log online from a machine with no network. In-process: each
command's main(argv); argparse's refusal is SystemExit(2) with one line naming the option."""

from __future__ import annotations

import argparse
import importlib
import os
import time

import pytest

from pretrain.cli.options import count, number, slurm_time_seconds
from tests.helpers import ROOT, TINY

CPU = str(ROOT / "accelerate_configs" / "cpu.yaml")
SLURM = ["submit", "--dry-run", "--recipe", TINY, "--accelerate-config", CPU, "--nodes", "1",
         "--processes-per-node", "1"]
HUGE = str(10**400)

OPTION_CASES = [
    # (command module, argv, the option argparse names, what the message says)
    ("pretrain.run", ["--recipe", TINY, "--dry-run", "--num-processes", "0"], "--num-processes", "from 1 to"),
    ("pretrain.run", ["--recipe", TINY, "--dry-run", "--nodes", HUGE], "--nodes", "from 1 to"),
    ("pretrain.run", ["--recipe", TINY, "--dry-run", "--gpu-memory-gib", "nan"], "--gpu-memory-gib", "finite"),
    ("pretrain.cli.estimate", ["--recipe", TINY, "--num-gpus", "-8"], "--num-gpus", "from 1 to"),
    ("pretrain.cli.estimate", ["--recipe", TINY, "--seq-len", "1e3"], "--seq-len", "whole number"),
    ("pretrain.cli.estimate", ["--recipe", TINY, "--gpu-memory-gib", "inf"], "--gpu-memory-gib", "finite"),
    ("pretrain.cli.plan", ["--recipe", TINY, "--top", "0"], "--top", "from 1 to"),
    ("pretrain.cli.plan", ["--recipe", TINY, "--host-memory-gib", "nan"], "--host-memory-gib", "finite"),
    ("pretrain.cli.plan", ["--recipe", TINY, "--gpus-per-node", str(2**40)], "--gpus-per-node", "2,147,483,647"),
    ("pretrain.cli.sweep", ["--recipe", TINY, "--timeout-s", "0"], "--timeout-s", "> 0"),
    ("pretrain.cli.sweep", ["--recipe", TINY, "--timeout-s", "nan"], "--timeout-s", "finite"),
    ("pretrain.cli.sweep", ["--recipe", TINY, "--timeout-s", "1e400"], "--timeout-s", "finite"),
    ("pretrain.cli.sweep", ["--recipe", TINY, "--max-memory-gib", "inf"], "--max-memory-gib", "finite"),
    ("pretrain.cli.sweep", ["--recipe", TINY, "--warmup-steps", "-1"], "--warmup-steps", "from 0 to"),
    ("pretrain.cli.sweep", ["--recipe", TINY, "--steps", "0"], "--steps", "from 1 to"),
    ("pretrain.cli.prepare_data", ["--recipe", TINY, "--workers", HUGE], "--workers", "from 1 to"),
    ("pretrain.cli.prepare_data", ["--recipe", TINY, "--task", "-1", "--num-tasks", "2"], "--task", "from 0 to"),
    ("pretrain.cli.prepare_data", ["--recipe", TINY, "--slurm", "--array", "0"], "--array", "from 1 to"),
    ("pretrain.cli.bench", ["--recipe", TINY, "--steps", "0"], "--steps", "from 1 to"),
    ("pretrain.cli.slurm", [*SLURM, "--nodes", "0"], "--nodes", "from 1 to"),
    ("pretrain.cli.slurm", [*SLURM, "--gpus-per-node", "-1"], "--gpus-per-node", "from 0 to"),
    ("pretrain.cli.slurm", [*SLURM, "--signal-lead-s", "nan"], "--signal-lead-s", "from 1 to 65,535"),
    ("pretrain.cli.slurm", [*SLURM, "--signal-lead-s", "0"], "--signal-lead-s", "from 1 to 65,535"),
    ("pretrain.cli.slurm", [*SLURM, "--time", "0"], "--time", "no time at all"),
    ("pretrain.cli.slurm", [*SLURM, "--time", "-5"], "--time", "not a SLURM time"),
    ("pretrain.cli.slurm", [*SLURM, "--time", "1:75:00"], "--time", "minutes and seconds to 59"),
    ("pretrain.cli.slurm", [*SLURM, "--time", "99999999999"], "--time", "more than a year"),
]


@pytest.mark.parametrize(("module", "argv", "option", "message"), OPTION_CASES,
                         ids=[f"{c[0].split('.')[-1]} {' '.join(c[1][-2:])[:40]}" for c in OPTION_CASES])
def test_numbers_at_the_edges_of_their_types_are_refused_by_argparse(capsys, module, argv, option, message):
    started = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert f"error: argument {option}" in err and message in err and "Traceback" not in err, err
    assert len(err.splitlines()[-1]) < 300 and time.monotonic() - started < 5


@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 1800), ("30:15", 1815), ("4:00:00", 14400), ("2-00:00:00", 172800), ("1-12", 129600),
    ("1-0:30", 88200), ("UNLIMITED", None), ("infinite", None),
])
def test_slurm_time_formats(text, seconds):
    assert slurm_time_seconds(text) == seconds


@pytest.mark.parametrize(("time_limit", "lead"), [("5", "300"), ("1:00:00", "7200"), ("10:00", "600")])
def test_the_signal_lead_must_be_shorter_than_the_time_limit(tmp_path, capsys, time_limit, lead):
    from pretrain.cli import slurm

    code = slurm.main([*SLURM, "--time", time_limit, "--signal-lead-s", lead, f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and f"--signal-lead-s {lead} is not shorter than --time" in err
    assert not (tmp_path / "run").exists()


def test_a_lead_inside_the_limit_is_accepted(tmp_path, capsys):
    from pretrain.cli import slurm

    assert slurm.main([*SLURM, "--time", "10:00", "--signal-lead-s", "120", f"output_dir={tmp_path / 'run'}"]) == 0
    assert "#SBATCH --signal=B:USR1@120" in capsys.readouterr().out


def test_types_refuse_what_python_would_accept():
    with pytest.raises(argparse.ArgumentTypeError):
        count()("True")
    with pytest.raises(argparse.ArgumentTypeError):
        number()("-0.0")
    assert number(inclusive=True)("0") == 0.0 and count(0)("+7") == 7


def test_wandb_online_without_a_network_falls_back_to_offline_in_seconds(tmp_path, monkeypatch, capsys):
    """A fake key and no WANDB_MODE: wandb would try to log in online and fail after minutes. The run's tracker
    mode is decided in seconds instead, offline, with one line that says how to upload later (and no key)."""
    from pretrain.train import tracking

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "fake-key-0123456789")
    # Unreachable on any machine: a TEST-NET-1 address (RFC 5737) that is never routed.
    monkeypatch.setenv("WANDB_BASE_URL", "https://192.0.2.1:9")
    started = time.monotonic()
    assert tracking.wandb_mode(tmp_path) == "offline"
    assert time.monotonic() - started < tracking.WANDB_PROBE_TIMEOUT_S + 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "wandb: the server is unreachable (192.0.2.1:9" in err
    assert f"wandb sync {tmp_path / 'wandb'}/offline-run-*" in err and "fake-key" not in err


def test_wandb_mode_set_by_the_user_is_kept_without_a_probe(tmp_path, monkeypatch, capsys):
    from pretrain.train import tracking

    monkeypatch.setenv("WANDB_API_KEY", "fake-key-0123456789")
    for mode in ("offline", "disabled"):
        monkeypatch.setenv("WANDB_MODE", mode)
        assert tracking.wandb_mode(tmp_path) == mode
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert tracking.wandb_mode(tmp_path) == "offline"  # nothing to log in with: offline, silently
    assert capsys.readouterr().err == "" and os.environ.get("WANDB_MODE") is None
