"""Every command in README.md and docs/*.md runs as written, from the repository's root with .venv active.

The pages' commands are extracted from their code blocks (bash blocks: one command per line, `\\`
continuations joined; `$ ` lines of console and plain blocks, with the output shown under them) and from
inline code that is a whole command (a program and its arguments, no placeholder such as `[...]`, `<...>`
or `…`). Each is either run here, because it takes seconds (`--help`, `--dry-run`, `--print-config`, the
estimator and the planner, a launch refused before it starts), or listed in SKIPPED with the reason. A
command in neither is a failure (a new command in any page must be classified), and so is a SKIPPED entry
that no longer matches a command. A command written the same way in several pages runs once. Where a page
shows a command's output, the output must be what the command prints now; where it shows `$ echo $?`, that
exit status. The sample SLURM script (docs/slurm.md) must be what `pretrain-slurm submit --dry-run` writes.
The test command of README's quick start must be the one CI (.ci/run) runs.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.cli import slurm
from pretrain.distributed.sbatch import PASSTHROUGH_ENV
from tests.helpers import ROOT, env, hub_cache_with_assets, metrics, val_losses

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
VENV_BIN = str(Path(sys.executable).parent)
INLINE_PROGRAMS = ("python ", "accelerate ", "pretrain-", "pretrain ")
PLACEHOLDERS = ("[", "<", "…", "...", "JOBID")
SAMPLE_ROOT = "/home/me/pretrain"
"""Where the sample SLURM script (docs/slurm.md) was written from (the repository's root is replaced by it)."""

# Commands the test does not run, by the start of their text, and why.
SKIPPED = {
    "pretrain-launch --config_file accelerate_configs/fsdp2_tp2.yaml --recipe R":
        "a TP 2 x FSDP 4 launch on 8 GPUs (R: any recipe); tests/multiprocess/test_tensor_parallel.py runs TP 2 x FSDP 2 on 4 CPU "
        "processes",
    "pretrain-launch --config_file accelerate_configs/fsdp2_cp2.yaml --recipe R":
        "a CP 2 x FSDP 4 launch on 8 GPUs (R: any recipe; CUDA only); tests/distributed/test_context_parallel.py checks it up to "
        "the launch, tests/test_gpu.py runs CP 2 on 2 GPUs",
    "pretrain-launch --config_file accelerate_configs/fsdp2_ep.yaml --recipe recipes/olmoe-1b-7b.yaml model.moe.ep_size=8":
        "OLMoE-1B-7B on 8 GPUs as EP 8; tests/multiprocess/test_expert_parallel.py runs EP 2 on 2 and 4 CPU processes, "
        "and the page's --dry-run of this launch runs here",
    "python -m cProfile pretrain/run.py": "a profiled training run on a GPU (tools/gpu_visit.sh STARTUP_PROFILE=1)",
    "python tools/poison_bench.py --seeds 20": "20 poisoned trainings (a minute); tests/train/test_quarantine.py runs "
                                               "two of its trials",
    "python tools/fault_harness.py": "a run under injected faults on a SLURM cluster (minutes); "
                                     "tests/cli/test_fault_harness.py runs it on the tests' private cluster",
    "bash tools/install.sh": "installs packages (network, minutes); CI's fresh-clone job runs it, tests/test_install.py "
                             "its --wheelhouse and --offline",
    "accelerate launch --config_file accelerate_configs/cpu.yaml pretrain/run.py --recipe recipes/tiny.yaml\n":
        "the demo: a 300-step training (minutes); test_the_demo_then_the_second_step_as_written runs it",
    "python pretrain/run.py --recipe recipes/tiny.yaml train.max_steps=40":
        "a training run (a minute); tests/train/test_run.py runs the entry point",
    "accelerate launch --config_file accelerate_configs/cpu_ddp.yaml pretrain/run.py --recipe recipes/tiny.yaml "
    "output_dir=runs/tiny-ddp": "run in order after the demo by test_the_demo_then_the_second_step_as_written",
    "accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 2 pretrain/run.py --recipe "
    "recipes/tiny.yaml output_dir=runs/tiny-zero2": "run in order after the demo by test_the_demo_then_the_second_step_as_written",
    "accelerate launch --config_file accelerate_configs/zero2.yaml":
        "a ZeRO-2 training (minutes); tests/multiprocess/test_distributed.py and tests/checkpoint/test_reshard.py run them",
    "accelerate launch --config_file accelerate_configs/zero1.yaml":
        "a ZeRO-1 resume on 3 processes (minutes); tests/checkpoint/test_reshard.py runs it",
    "accelerate launch --config_file accelerate_configs/cpu_ddp.yaml --num_processes 3 -m pretrain doctor":
        "3 processes measuring (10 s); tests/distributed/test_doctor.py runs it, healthy and with a slowed rank",
    "pretrain-launch --config_file accelerate_configs/zero2.yaml --recipe recipes/tiny.yaml":
        "needs an environment without deepspeed: tests/system/test_environment.py runs it in one and checks this message",
    "pretrain-launch --doctor": "the doctor, then a training (minutes); tests/distributed/test_doctor.py runs the doctor",
    "pretrain-launch --config_file accelerate_configs/zero3.yaml --num_processes 2 --recipe recipes/tiny.yaml "
    "output_dir=runs/tiny-zero3": "run in order after the demo by test_the_demo_then_the_second_step_as_written",
    "pretrain-launch --config_file accelerate_configs/zero3.yaml --num_processes 2 --recipe recipes/tiny.yaml "
    "output_dir=runs/tiny-zero3-new": "a 2-process ZeRO-3 training (a minute); the README's second step runs one",
    "pretrain-launch --config_file accelerate_configs/zero3.yaml --recipe recipes/7b.yaml":
        "needs 8 GPUs and the 7B token store",
    "pretrain-prepare-data --recipe recipes/7b.yaml": "tokenizes FineWeb from the hub (network, hours)",
    "pretrain-export runs/tiny/checkpoints/step_00000200": "needs the demo's checkpoint at step 200",
    "python pretrain/run.py --recipe recipes/tiny-continue.yaml": "needs the demo's final model (runs/tiny/final_model); "
                                                                   "tests/model/test_init_from.py runs the recipe from other models",
    "pretrain-plot runs/tiny": "needs the demo's metrics.jsonl",
    "pretrain-eval --checkpoint runs/tiny/checkpoints/step_00000300": "needs the demo's last checkpoint; "
                                                                      "tests/multiprocess/test_distributed.py runs pretrain-eval",
    "pretrain-eval --model runs/tiny/final_model": "needs the demo's final model; tests/multiprocess/test_distributed.py scores one",
    "pretrain-launch --config_file accelerate_configs/cpu_ddp.yaml --recipe recipes/mixture-tiny.yaml":
        "run in order with the lookups after it by test_the_which_walkthrough_as_written",
    "pretrain-data which --run runs/mixture-tiny": "run in order after its run by test_the_which_walkthrough_as_written",
    "pretrain-sweep --recipe recipes/tiny.yaml": "measures real runs per MBS (minutes; machine-dependent numbers)",
    "pretrain-bench --recipe recipes/tiny.yaml": "times training steps (a minute)",
    "pretrain-slurm submit --recipe recipes/7b.yaml --accelerate-config accelerate_configs/zero3.yaml "
    "--nodes 4 --processes-per-node 8 --partition": "submits to SLURM (tests/cli/test_slurm.py runs a real one)",
    "pretrain-slurm submit ... --dry-run": "the sample script below is that command's output, compared below",
    "pretrain-slurm status runs/7b": "needs a submitted job",
    "rsync -a ./ gpu-node:pretrain/": "copies the checkout to another machine (tests/test_install.py installs from a "
                                      "wheelhouse into a fresh environment)",
    "squeue": "SLURM (tests/cli/test_slurm.py runs jobs on a real SLURM)",
    "scancel": "SLURM (tests/cli/test_slurm.py preempts a job with USR1)",
    "tail -f runs/7b/slurm": "follows a job's log",
    "python -m pytest tests": "the test suite itself",
    "python -m pip install --target ../lmeval-site": "installs lm-eval beside the environment (network); "
                                                     "tests/train/test_downstream.py runs the cross-check where it is",
    "PYTHONPATH=../lmeval-site python -m pytest tests/train/test_downstream.py": "the lm-eval cross-check (20-40 s), "
                                                                           "skipped where lm-eval is not installed",
    "ruff check": "the linter (CI)",
    "python tools/recipe_reference.py --write": "rewrites docs/recipe-reference.md; tests/recipe/test_config.py checks it is current",
    "pretrain-prepare-data --workers": "an option named in the recipe reference, not a command",
    "pretrain-prepare-data --verify": "an option named in the text; tests/data/test_store.py runs it on a damaged store",
    "python -m tests.golden_losses --write": "rewrites the golden losses",
    "pretrain-plan --calibration FILE": "an option named in the text (FILE is a placeholder); tests/multiprocess/test_hybrid.py "
                                        "plans with calibration files",
    "python -m pretrain\n": "names the entry point in the map of the code (docs/architecture.md), not a command to run",
    "python tools/setup_memory.py": "measures each layout's set-up memory in real launches (minutes); "
                                    "docs/performance.md shows its output",
    "python tools/bench_startup.py": "times repeated training starts (minutes); docs/performance.md shows its output",
    "python tools/calibrate_memory.py": "refits the shipped pretrain/plan/memory/calibration.json (a GPU visit's "
                                        "rows with --add); tests/plan/test_memory_calibration.py runs it",
    "python tools/scale_bench.py --paths order-numpy-permutation": "the order before issue 50 at 1e6-1e8 rows (a "
    "minute and 400 MiB per point); tests/data/test_order.py checks the order that replaced it",
    "python tools/bench_data.py": "the data benchmark: a 0.5-2 GB corpus tokenized four times (tens of minutes)",
    "python tools/bench_gpu.py --reduced": "2 training launches (a minute or two); tests/plan/test_tools.py runs it",
    "python tools/bench_gpu.py --models llama-1b": "the GPU benchmark: needs a GPU (an hour)",
    "python tools/bench_gpu.py --budget 420": "the GPU benchmark within 7 minutes: needs a GPU",
    "accelerate launch --cpu --num_processes 2": "the trap the text warns about, not a command to run",
    "accelerate launch --config_file accelerate_configs/zero3.yaml pretrain/run.py --recipe recipes/7b.yaml":
        "the 7B on 8 GPUs (the README's first example)",
    "accelerate launch --config_file accelerate_configs/multinode_":
        "a node's part of a multi-node 7B run (GPUs); tests/multiprocess/test_hybrid.py runs hpZ on 2 x 2 CPU processes",
}
CHEAP = ("--help", "--dry-run", "--print-config", "--list-gpus")
CHEAP_PROGRAMS = ("pretrain-estimate", "pretrain-plan")


class Command:
    def __init__(self, page: str, text: str, line: int, output: str | None = None):
        self.page, self.text, self.line, self.output, self.exit_code = page, text, line, output, 0

    def __repr__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def _join_continuations(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in lines:
        if pending is not None:
            number, line = pending[0], pending[1] + " " + line.strip()
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1].rstrip())
            continue
        pending = None
        out.append((number, line))
    return out


def _mask_blocks(text: str) -> str:
    """The text with every fenced block blanked (its newlines kept, so line numbers hold)."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)


def page_commands(path: Path) -> tuple[list[Command], list[tuple[str, int, str]]]:
    """(the page's commands, the shell scripts it shows: (page, line, text))."""
    text, page = path.read_text(), str(path.relative_to(ROOT))
    commands, scripts = [], []
    for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        lang, body = block.group(1), block.group(2)
        first_line = text.count("\n", 0, block.start(2)) + 1
        lines = [(first_line + i, line) for i, line in enumerate(body.splitlines())]
        console = lang == "console" or (lang == "" and any(line.startswith("$ ") for _, line in lines))
        if lang == "bash" and body.startswith("#!"):
            scripts.append((page, first_line, body))
        elif lang in ("bash", "") and not console:
            for number, line in _join_continuations(lines):
                if line.strip() and not line.lstrip().startswith("#"):
                    commands.append(Command(page, line.strip(), number))
        elif console:
            current = None
            for number, line in lines:
                if line.startswith("$ echo $?") and current is not None:
                    current.exit_code = None  # the status is the next output line
                elif line.startswith("$ "):
                    current = Command(page, line[2:].strip(), number, "")
                    commands.append(current)
                elif current is not None:
                    if current.exit_code is None:
                        current.exit_code = int(line.strip())
                    else:
                        current.output += line + "\n"
    masked = _mask_blocks(text)
    for span in re.finditer(r"`([^`\n]+)`", masked):
        code = span.group(1)
        if code.startswith(INLINE_PROGRAMS) and " -" in code and not any(p in code for p in PLACEHOLDERS):
            commands.append(Command(page, code, masked.count("\n", 0, span.start()) + 1))
    return commands, scripts


def skip_reason(command: Command) -> str | None:
    return next((why for start, why in SKIPPED.items() if (command.text + "\n").startswith(start)), None)


def is_cheap(command: Command) -> bool:
    return (any(flag in command.text.split() for flag in CHEAP) or command.text.startswith(CHEAP_PROGRAMS)
            or command.exit_code == 2)  # refused before anything starts, as the page shows


def all_commands() -> tuple[list[Command], list[tuple[str, int, str]]]:
    commands, scripts = [], []
    for path in PAGES:
        page_cmds, page_scripts = page_commands(path)
        commands += page_cmds
        scripts += page_scripts
    return commands, scripts


def distinct(commands: list[Command]) -> list[Command]:
    """One of each command as written: a command in several pages runs once, as the page that shows its output
    (or exit status) shows it."""
    seen: dict[str, Command] = {}
    for c in commands:
        if c.text not in seen or (c.output and not seen[c.text].output):
            seen[c.text] = c
    return list(seen.values())


def checkout_without_runs(tmp_path_factory) -> Path:
    """A directory whose entries link to the checkout's, runs/ left out (made once per test process)."""
    root = tmp_path_factory.getbasetemp() / "checkout"
    if not root.is_dir():
        root.mkdir()
        for entry in ROOT.iterdir():
            if entry.name != "runs":
                (root / entry.name).symlink_to(entry)
    return root


COMMANDS, SCRIPTS = all_commands()
RUN = distinct([c for c in COMMANDS if skip_reason(c) is None])


def test_every_readme_command_is_run_or_skipped_with_a_reason():
    assert len(COMMANDS) > 20, COMMANDS  # the extraction works
    assert {c.page for c in COMMANDS} >= {"README.md", "docs/planning.md", "docs/slurm.md"}, COMMANDS
    unclassified = [c for c in RUN if not is_cheap(c)]
    assert not unclassified, f"neither cheap nor in SKIPPED (add the reason): {unclassified}"
    stale = [start for start in SKIPPED if not any((c.text + "\n").startswith(start) for c in COMMANDS)]
    assert not stale, f"SKIPPED entries that match no command of README.md or docs/*.md: {stale}"
    print("skipped:\n" + "\n".join(f"  {c!r}: {skip_reason(c)}" for c in COMMANDS if skip_reason(c)))


@pytest.mark.slow  # a process each: a minute or two for all of them
@pytest.mark.parametrize("command", RUN, ids=[f"{Path(c.page).stem}:{c.line}" for c in RUN])
def test_readme_command_runs_as_written(command, tmp_path_factory):
    path = f"{VENV_BIN}:{env()['PATH']}"  # as `. .venv/bin/activate` leaves it
    # a hub model a page starts from (recipes/continue-qwen3-1.7b.yaml) is read from a cache holding its config.json
    hub = hub_cache_with_assets(tmp_path_factory.getbasetemp() / "hub")
    # Run where the repository's files are but runs/ is not the checkout's (the user's demo): a directory of links to
    # every top-level entry but runs/, so that the pages' relative paths (and the runs/... they print) hold as written.
    proc = subprocess.run(["bash", "-c", command.text], cwd=checkout_without_runs(tmp_path_factory),
                          env=env(PATH=path, HF_HUB_CACHE=str(hub), PRETRAIN_RUNS_DIR=None), capture_output=True,
                          text=True, timeout=300)
    shown = f"exit {proc.returncode}\n{proc.stdout}{proc.stderr}"[-3000:]
    assert proc.returncode == command.exit_code, shown
    assert "Traceback" not in proc.stderr, shown
    if command.output:
        assert (proc.stdout + proc.stderr).rstrip() == command.output.rstrip(), (
            f"{command!r}: the page shows another output than the command prints now; paste its output:\n"
            + proc.stdout + proc.stderr)


def linked_checkout(tmp_path: Path) -> Path:
    """A directory of links to every top-level entry of the checkout but runs/: commands run there as written, and
    the runs they start are their own."""
    root = tmp_path / "checkout"
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name != "runs":
            (root / entry.name).symlink_to(entry)
    return root


DEMO = "accelerate launch --config_file accelerate_configs/cpu.yaml pretrain/run.py --recipe recipes/tiny.yaml"
SECOND_STEP = "**2. Several processes on one node"


def second_step() -> list[Command]:
    """The commands of README's second step (its code block), in order."""
    text = README.read_text()
    start = text.count("\n", 0, text.index(SECOND_STEP)) + 1
    block = [c for c in page_commands(README)[0] if c.line > start]
    first = block[0].line
    return [c for c in block if c.line - first < 10 and c.text.startswith(("accelerate launch", "pretrain-launch"))]


@pytest.mark.slow
def test_the_demo_then_the_second_step_as_written(tmp_path):
    """The quick start's demo exactly as README gives it, then every command of its second step in order, from a
    directory of links to the checkout (its own runs/): the demo learns (>= 3 nats below the untrained model's val
    loss, its downstream task above chance), and each command of the second step exits 0 and trains steps of its
    own: no "already complete", no refusal (two of them continue the demo's checkpoint on other layouts)."""
    root = linked_checkout(tmp_path)
    environment = env(PATH=f"{VENV_BIN}:{env()['PATH']}", PRETRAIN_RUNS_DIR=None)
    demo = next(c for c in page_commands(README)[0] if c.text == DEMO)
    start = time.perf_counter()
    proc = subprocess.run(["bash", "-c", demo.text], cwd=root, env=environment, capture_output=True, text=True,
                          timeout=900)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    val = val_losses(root / "runs" / "tiny")
    print(f"\ndemo: {elapsed:.0f}s, val loss {val}")
    assert min(val) == 0 and max(val) == 300
    assert val[0] - val[300] >= 3.0, val  # measured: 8.34 -> 4.96
    # The downstream task (docs/evaluation.md): chance 0.25 at step 0, above it once the model reads Python.
    task = {m["step"]: (m["eval/stdlib_lines/acc"], m["eval/stdlib_lines/acc_norm"])
            for m in metrics(root / "runs" / "tiny") if "eval/stdlib_lines/acc" in m}
    print(f"demo: stdlib_lines acc, acc_norm {task}")
    assert sorted(task) == [0, 50, 100, 150, 200, 250, 300]
    assert abs(task[0][0] - 0.25) <= 0.1 and min(task[300]) >= 0.32, task  # measured: (0.28, 0.255) -> (0.475, 0.51)
    commands = second_step()
    assert len(commands) == 3, commands
    for command in commands:
        proc = subprocess.run(["bash", "-c", command.text], cwd=root, env=environment, capture_output=True, text=True,
                              timeout=600)
        shown = f"{command!r}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, shown
        assert "already complete" not in proc.stdout and "refused" not in proc.stdout + proc.stderr, shown
        out = root / re.search(r"output_dir=(\S+)", command.text).group(1)
        steps = [m["step"] for m in metrics(out) if "train/loss" in m]
        first = 301 if "checkpoint.resume=runs/tiny/" in command.text else 1
        last = int(re.search(r"train.max_steps=(\d+)", command.text).group(1))
        assert steps and min(steps) >= first and max(steps) == last, (command, steps)  # logged every 10 and the last
        if first > 1:
            assert "converted through the neutral form" in proc.stdout, shown
    # ~3.5 minutes on a 2-core machine (0.7 s per step); twice that is a regression, not noise.
    assert elapsed < 420, f"the demo took {elapsed:.0f}s on this machine (it takes ~3.5 minutes on 2 cores)"


WALKTHROUGH = "## Which data a step read"


@pytest.mark.slow
def test_the_which_walkthrough_as_written(tmp_path, monkeypatch, capsys):
    """docs/data.md's pretrain-data walkthrough, its commands in order from a directory of links to the checkout (its
    own runs/): the 2-process run, then each lookup exits 0 and prints what the page says it prints (the shown
    outputs are ```text blocks: the standard library's files differ between Python versions). The lookups run in
    this process (pretrain-data's main with the command's arguments): an interpreter start each is most of their
    time."""
    from pretrain.cli.data import main
    page = ROOT / "docs" / "data.md"
    text = page.read_text()
    start = text.count("\n", 0, text.index(WALKTHROUGH)) + 1
    commands = [c.text for c in page_commands(page)[0] if start < c.line < start + 16]
    assert len(commands) == 4 and commands[0].startswith("pretrain-launch"), commands
    root = linked_checkout(tmp_path)
    environment = env(PATH=f"{VENV_BIN}:{env()['PATH']}", PRETRAIN_RUNS_DIR=None)
    proc = subprocess.run(["bash", "-c", commands[0]], cwd=root, env=environment, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, (proc.stdout[-2000:], proc.stderr[-3000:])
    monkeypatch.chdir(root)
    printed = []
    for command in commands[1:]:
        program, *args = shlex.split(command)
        assert program == "pretrain-data", command
        code = main(args)
        out, err = capsys.readouterr()
        assert code == 0, (command, err)
        printed.append(out)
    step, document, as_json = printed
    lines = step.splitlines()
    assert lines[0].startswith("step 3 of runs/mixture-tiny: 8 of 32 sequences of 129 tokens") and len(lines) == 10
    assert all(line.split()[0] == "1/0" and ".py[" in line for line in lines[2:]), step
    assert document.startswith("json/decoder.py (json:00000.train.ds:") and " in steps 1..4" in document.splitlines()[0]
    answer = json.loads(as_json)
    assert answer["origin"]["file"].startswith("json/") and answer["reads"]


def test_the_sample_slurm_script_is_what_the_tool_writes(monkeypatch):
    (page, line, shown), = SCRIPTS
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PRETRAIN_RUNS_DIR")  # the page shows the default runs/ (tests/conftest.py sets the suite's)
    args = slurm.parse_args(["submit", "--recipe", "recipes/7b.yaml", "--accelerate-config",
                             "accelerate_configs/zero3.yaml", "--nodes", "4", "--processes-per-node", "8", "--dry-run"])
    job = slurm.check_job(args)
    for name in PASSTHROUGH_ENV:  # the submitting shell's settings, copied only when set
        monkeypatch.delenv(name, raising=False)
    script = slurm.render_script(job, python=f"{ROOT}/.venv/bin/python").replace(str(ROOT), SAMPLE_ROOT)
    assert shown == script, f"{page}:{line}: regenerate the sample SLURM script; the tool writes:\n{script}"


def test_ci_runs_the_readme_test_command():
    """.ci/run runs the test command that README's quick start gives (after its install), byte for byte."""
    quick_start = next(c for c in COMMANDS if c.page == "README.md" and c.text.startswith("bash tools/install.sh --dev &&"))
    test_command = quick_start.text.split(" && ", 1)[1].removeprefix(".venv/bin/")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci, f".ci/run does not run README's test command {test_command!r} on a line of its own"
