"""A cache this user cannot write (a team's shared, read-only cache; another user's): pretrain-prepare-data and a
run that would write into it exit 2 with one message naming the directory and the fix; a run that finds its
store there complete writes nothing into it and trains.

The processes run as an unprivileged user: root writes into a 0o555 directory regardless of its mode. Root
(CI) runs them as uid 65534 (nobody) through setpriv, with CAP_DAC_READ_SEARCH as an ambient capability: the
interpreter may live where only root can read (pyenv under /root), and reading is not what is tested; the
capability grants no write. Another user runs them as itself: its own 0o555 directory stops it too."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import FAST, RUN, TINY, check_ok, run_cmd

NOBODY = "65534"
PREPARE = [sys.executable, "-m", "pretrain.cli.prepare_data", "--recipe", TINY]


def _as_user() -> list[str]:
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv (util-linux): no unprivileged user to run the processes as, "
                    "and root writes into a read-only directory")
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]


def _read_only(path: Path) -> None:
    for root, dirs, files in os.walk(path):
        for name in files:
            Path(root, name).chmod(0o444)
        for name in dirs:
            Path(root, name).chmod(0o555)
    path.chmod(0o555)


@pytest.fixture(scope="module")
def place():
    """A directory every user can reach (pytest's tmp_path is private to its user): ``ro`` (a fresh read-only
    cache), ``filled`` (a read-only cache holding the tiny recipe's store) and ``home`` (writable: HOME and
    output_dir)."""
    base = Path(tempfile.mkdtemp(prefix="pretrain-rocache-"))
    base.chmod(0o755)
    (base / "home").mkdir(mode=0o777)
    (base / "home").chmod(0o777)  # past the umask
    (base / "ro").mkdir()
    _read_only(base / "ro")
    probe = run_cmd([*_as_user(), sys.executable, "-c", "import pretrain.run, torch, transformers"],
                    timeout=120, extra_env={"HOME": str(base / "home")})
    if probe.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"the unprivileged user cannot run this checkout with {sys.executable} (the venv and the "
                    f"checkout must be readable by others): {probe.stderr.strip()[-500:]}")
    check_ok(run_cmd(PREPARE, timeout=300, extra_env={"PRETRAIN_CACHE_DIR": str(base / "filled")}))
    _read_only(base / "filled")
    yield base
    for root, dirs, _ in os.walk(base):
        for name in dirs:
            Path(root, name).chmod(0o755)
    shutil.rmtree(base)


def _run(place: Path, cmd: list[str], cache: str):
    return run_cmd([*_as_user(), *cmd], timeout=300,
                   extra_env={"PRETRAIN_CACHE_DIR": str(place / cache), "HOME": str(place / "home")})


def _refused(proc, directory: Path, fix: str) -> None:
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    assert str(directory) in errors[0] and "is not writable (Permission denied" in errors[0], errors[0]
    assert fix in errors[0], errors[0]


def test_prepare_data_into_a_read_only_cache_is_one_message(place):
    proc = _run(place, PREPARE, "ro")
    _refused(proc, place / "ro", "PRETRAIN_CACHE_DIR environment variable) at a directory this user can write")


def test_a_tokenizer_to_train_into_a_read_only_cache_is_one_message_before_training(place):
    """The store named elsewhere (writable), the BPE tokenizer still to be trained into the read-only cache."""
    proc = _run(place, [*PREPARE, f"data.store={place / 'home' / 'store'}"], "ro")
    _refused(proc, place / "ro" / "tokenizers", "point data.cache_dir")
    assert "trained byte-level BPE" not in proc.stdout


def test_a_run_that_must_prepare_into_a_read_only_cache_is_one_message(place):
    proc = _run(place, [sys.executable, RUN, "--recipe", TINY, *FAST, "train.max_steps=2",
                        f"output_dir={place / 'home' / 'refused'}"], "ro")
    _refused(proc, place / "ro", "prepare the store where it can be written")


def test_a_run_whose_store_is_in_a_read_only_cache_trains(place):
    """Everything the run needs is there: it only reads the cache (the CPU peak it cannot cache is measured)."""
    before = sorted(p.relative_to(place / "filled") for p in (place / "filled").rglob("*"))
    out = place / "home" / "trained"
    proc = _run(place, [sys.executable, RUN, "--recipe", TINY, *FAST, "train.max_steps=2", f"output_dir={out}"],
                "filled")
    check_ok(proc)
    assert (out / "final_model").is_dir()
    assert sorted(p.relative_to(place / "filled") for p in (place / "filled").rglob("*")) == before
