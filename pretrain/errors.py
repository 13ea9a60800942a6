"""User-facing errors.

Every problem a user can fix (a recipe key, a file, a launch option) raises a ``ConfigError`` whose
message names the key or file, the bad value and the fix. ``pretrain/run.py`` and the CLIs print it
without a traceback and exit with status 2. Asserts are for internal invariants only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path

EXIT_USAGE = 2


class ConfigError(Exception):
    """A problem in the recipe, the launch or the input files that the user can fix."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(self._format())

    def _format(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0]
        lines = [f"{len(self.problems)} problems:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


class DataError(ConfigError):
    """The data source, tokenizer or corpus cannot be used as configured."""


class BatchConfigError(ConfigError):
    """The batch sizes do not divide for this world size."""


# A write that failed on a nearly full filesystem is reported as disk full even when the library wraps the
# OSError (torch.save: "file write failed"; safetensors: "os error 28").
DISK_FULL_FREE_BYTES = 64 * 2**20


def is_disk_full(exc: BaseException, path: str | os.PathLike) -> bool:
    """Whether ``exc``, raised while writing under ``path``, means the filesystem is full."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left on device" in str(exc) or "os error 28" in str(exc):
        return True
    if not isinstance(exc, (OSError, RuntimeError)):
        return False
    try:
        return shutil.disk_usage(path).free < DISK_FULL_FREE_BYTES
    except OSError:
        return False


def disk_full_error(path: str | os.PathLike, writing: str, fix: str) -> ConfigError:
    free = "unknown"
    with contextlib.suppress(OSError):
        free = f"{shutil.disk_usage(path).free / 2**30:.2f} GiB free"
    return ConfigError(f"disk full: no space left on the filesystem of {path} ({free}) while writing {writing}; "
                       f"{fix}")


def writable_dir(path: str | os.PathLike, what: str, fix: str, error: type[ConfigError] = ConfigError) -> Path:
    """``path``, created if missing and proven writable by this user (a file created and removed in it), or one
    ``error`` (a ConfigError): "<what> is not writable (<reason>); <fix>". A probe, not ``os.access``: root without
    CAP_DAC_OVERRIDE, ACLs, a read-only mount and another user's directory all answer only to a real write."""
    path = Path(path)
    if path.exists() and not path.is_dir():  # not a permission problem: another thing stands there
        raise error(f"{what} is a file, not a directory ({path}); {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        at = f" at {exc.filename}" if exc.filename and str(exc.filename) != str(path) else ""
        raise error(f"{what} is not writable ({exc.strerror or exc}{at}); {fix}") from None
    return path


EXIT_DIVERGED = 3
# Ctrl-C (SIGINT): the run checkpointed the step in flight and stopped; the shell's code for an interrupt (128 + 2),
# so `run && next` does not go on as if training had finished. SIGTERM / SIGUSR1 (a scheduler) exit 0.
EXIT_INTERRUPTED = 130


class TrainingDiverged(Exception):
    """The run stopped itself: its updates kept being unusable (stability.max_consecutive_skips) or its state
    turned non-finite. Printed without a traceback, exit status 3 (not 0: a scheduler must not take the run for
    finished; not 2: the recipe was valid). The newest checkpoint on disk holds the last healthy state."""
