"""Exit codes of consecutive 2-process CPU (gloo) launches: each run must exit with its own code, never with the
interpreter teardown's SIGABRT (-6) that gloo's threads used to cause (pretrain/distributed/supervise.py ``leave``).

    python -m tools.exit_codes [--runs 20] [--kinds ddp,zero2,fsdp,refused]      (from the repository's root)

Runs ``--runs`` launches of ``pretrain/run.py`` under ``accelerate launch``, cycling through the kinds:

- ``ddp``, ``zero2``, ``fsdp``: accelerate_configs/cpu_ddp.yaml, zero2.yaml, fsdp.yaml on 2 processes, the tests'
  FAST shapes, 2 steps, no final model: expected exit 0.
- ``refused``: cpu_ddp with every process in a working directory of its own (tests/rank_cwd_run.py) and a relative
  output_dir, so the two ranks see two directories: refused after the process group exists (the shared output_dir
  check), each rank exits 2; accelerate launch then reports the ranks' codes and exits 1.

Each run prints its kind, the launcher's code and every rank's code (read from torchrun's failure report; a run
that succeeded reports none, its ranks all exited 0), and whether that is what was expected; then one summary line.
Exit status: 0 if every run exited as expected, else 1. The data cache is the tests' (.cache/pretrain); a first run
may tokenize the tiny corpus.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers import FAST, RUN, TINY, env, free_port  # the tests' FAST shapes, environment, free ports

ROOT = Path(__file__).resolve().parents[1]

KINDS = {  # kind -> (accelerate config, launcher options, script, expected launcher code, expected rank code)
    "ddp": ("cpu_ddp.yaml", [], [RUN], 0, 0),
    "zero2": ("zero2.yaml", ["--num_processes", "2"], [RUN], 0, 0),
    "fsdp": ("fsdp.yaml", ["--num_processes", "2"], [RUN], 0, 0),
    "refused": ("cpu_ddp.yaml", [], [str(ROOT / "tests" / "rank_cwd_run.py")], 1, 2),
}
# torchrun's ChildFailedError report: one block per failed rank.
RANK_CODE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def launch(kind: str, workdir: Path) -> tuple[int, dict[int, int], str]:
    config, options, script, _, _ = KINDS[kind]
    if kind == "refused":
        script, output_dir = [*script, str(workdir)], "run"  # relative: rank<R>/run on each rank
    else:
        output_dir = str(workdir / "run")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" / config),
           "--main_process_port", str(free_port()), *options, *script, "--recipe", TINY, *FAST,
           "batch.micro_batch_size=2", "train.max_steps=2", "checkpoint.save_final_model=false",
           f"output_dir={output_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    ranks = {int(rank): int(code) for rank, code in RANK_CODE.findall(output)}
    if proc.returncode == 0:
        ranks = {0: 0, 1: 0}  # torchrun reports only failures: both ranks exited 0
    return proc.returncode, ranks, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="launches in all, cycling through the kinds")
    parser.add_argument("--kinds", default="ddp,zero2,fsdp,refused", help=f"comma-separated, of {', '.join(KINDS)}")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"error: unknown kind(s) {', '.join(unknown)}; choose from {', '.join(KINDS)}", file=sys.stderr)
        return 2
    bad, aborts, start = [], 0, time.perf_counter()
    for i in range(args.runs):
        kind = kinds[i % len(kinds)]
        with tempfile.TemporaryDirectory(prefix="exit-codes-") as tmp:
            t0 = time.perf_counter()
            code, ranks, output = launch(kind, Path(tmp))
        _, _, _, want_code, want_rank = KINDS[kind]
        ok = code == want_code and sorted(ranks) == [0, 1] and set(ranks.values()) == {want_rank}
        aborts += sum(c == -6 for c in ranks.values())
        rank_text = " ".join(f"rank{r}={c}" for r, c in sorted(ranks.items())) or "ranks: none reported"
        print(f"run {i + 1:2d}/{args.runs} {kind:8s} launcher exit {code} | {rank_text} | expected {want_code} / "
              f"ranks {want_rank}: {'ok' if ok else 'UNEXPECTED'} ({time.perf_counter() - t0:.1f}s)", flush=True)
        if not ok:
            bad.append(i + 1)
            print(output[-3000:], flush=True)
    print(f"summary: {args.runs - len(bad)}/{args.runs} runs exited as expected, {aborts} rank(s) aborted (-6), "
          f"in {time.perf_counter() - start:.0f}s" + (f"; unexpected: runs {bad}" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
