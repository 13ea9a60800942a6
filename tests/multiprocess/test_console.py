"""What a user sees: the console of a 2-process ZeRO-2 run holds pretrain's own lines and nothing else (no
library warning, no progress bar), each step line has elapsed time and an ETA, and MFU stays <= 100%."""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers import FAST, ROOT, TINY, check_ok, metrics, run_cmd

pytestmark = pytest.mark.slow

# Every line a run may print, by its start: the launcher's command, the data set-up (a fresh cache also trains
# the tokenizer and builds the store), the start banner, evaluations, step lines, checkpoints, the export, the
# goodput summary.
OWN_LINES = re.compile(
    r"^(launch: |tokenizer: |data: |pretrain: |perf: |compile: |loss: |eval step \d+: |step \d+/30 \| |"
    r"checkpoint: saved step |goodput [\d.]+% of |"
    r"export: )"
)
STEP_LINE = re.compile(r"^step (\d+)/30 \| .* \| elapsed \d+:\d\d:\d\d \| eta \d+:\d\d:\d\d$")


def test_zero2_run_on_2_processes_prints_only_its_own_lines(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pretrain.cli.launch", "--config_file", str(ROOT / "accelerate_configs" / "zero2.yaml"),
           "--num_processes", "2", "--recipe", TINY, *FAST, "train.max_steps=30", "logging.every_steps=10",
           "eval.every_steps=10", "checkpoint.every_steps=10", "checkpoint.keep_last=1", f"output_dir={out}"]
    # no OMP_NUM_THREADS from the caller: pretrain-launch sets it (torchrun would set 1 and warn)
    proc = run_cmd(cmd, extra_env={"OMP_NUM_THREADS": None, "PYTHONWARNINGS": None})
    check_ok(proc)
    console = proc.stdout + proc.stderr
    assert "\r" not in console and not re.search(r"\d+%\|", console), f"a progress bar:\n{console}"
    lines = console.splitlines()
    assert not [line for line in lines if "Warning" in line or "WARNING" in line], console
    others = [line for line in lines if not OWN_LINES.match(line)]
    assert others == [], "lines the user has nothing to act on:\n" + "\n".join(others)
    assert lines[0].startswith("launch: OMP_NUM_THREADS=")
    steps = [int(m.group(1)) for line in lines if (m := STEP_LINE.match(line))]
    assert steps == [1, 10, 20, 30], console  # every step line has elapsed and eta
    assert sum(line.startswith("checkpoint: saved") for line in lines) == 3
    assert len(lines) <= 22, console  # the 17 lines above, plus 5 for a fresh data cache
    mfus = [m["perf/mfu"] for m in metrics(out) if "perf/mfu" in m]
    assert len(mfus) == 3 and all(0 < value <= 1 for value in mfus), mfus
