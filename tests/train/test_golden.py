"""The golden-loss regression guard: the tiny recipe's first 20 steps, to 1e-6 relative, as recorded.

The 2-process DDP and ZeRO-2 golden curves are checked in tests/multiprocess/test_distributed.py, on the runs it
already makes. How to regenerate the file: tests/golden_losses.py.
"""

from __future__ import annotations

import pytest

from tests.golden_losses import load, mismatches, run_tiny

pytestmark = pytest.mark.slow


def test_tiny_recipe_first_20_steps_match_the_golden_curve(tmp_path):
    golden = load()["tiny_1proc_fp32"]
    assert len(golden) == 20
    assert mismatches("tiny_1proc_fp32", run_tiny(tmp_path / "tiny"), golden) == []
