"""User-facing errors.

Every problem a user can fix (a recipe key, a file, a launch option) raises a ``ConfigError`` whose
message names the key or file, the bad value and the fix. ``pretrain/run.py`` and the CLIs print it
without a traceback and exit with status 2. Asserts are for internal invariants only.
"""

from __future__ import annotations

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


EXIT_DIVERGED = 3


class TrainingDiverged(Exception):
    """The run stopped itself: its updates kept being unusable (stability.max_consecutive_skips) or its state
    turned non-finite. Printed without a traceback, exit status 3 (not 0: a scheduler must not take the run for
    finished; not 2: the recipe was valid). The newest checkpoint on disk holds the last healthy state."""
