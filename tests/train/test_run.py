"""End to end: the real entry point trains, logs, checkpoints, resumes exactly and exports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (
    FAST,
    ROOT,
    RUN,
    TINY,
    accelerate_launch,
    check_ok,
    env,
    free_port,
    metrics,
    train,
    train_here,
    train_in_process,
    train_killed_at,
    train_losses,
)

pytestmark = pytest.mark.slow

REQUIRED_KEYS = {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "batch/mbs", "batch/gbs",
                 "batch/gas", "batch/tokens_per_step"}


def test_metrics_files_and_final_model(tmp_path):
    out = tmp_path / "run"
    # The entry point's Trainer in this process: what this test reads are the run's files, not the CLI's exit
    train_here([*FAST, "train.max_steps=6", "logging.every_steps=3", f"output_dir={out}"])
    records = metrics(out)
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == [1, 3, 6]  # step 1, every N, and the last
    for record in records:
        if "train/loss" in record:
            # Step 1 is a warm-up step (logging.throughput_warmup_steps=1): logged, but without throughput.
            required = REQUIRED_KEYS if record["step"] > 1 else REQUIRED_KEYS - {"perf/tokens_per_s"}
            assert required <= record.keys(), record["step"]
            assert record["batch/gbs"] == 8 and record["batch/mbs"] == 4 and record["batch/gas"] == 2
            assert record["batch/tokens_per_step"] == 8 * 64
    assert [r["step"] for r in records if "val/loss" in r] == [0, 6]
    resolved = (out / "recipe.resolved.yaml").read_text()
    assert "hidden_size: 64" in resolved
    run_config = json.loads((out / "run_config.json").read_text())
    assert run_config["dist/world_size"] == 1 and run_config["plan/grad_accum_steps"] == 2
    assert run_config["optim/class"] == "AdamW" and not run_config["optim/fused"]  # fused on CUDA only

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final_model")
    tokenizer = AutoTokenizer.from_pretrained(out / "final_model")
    ids = tokenizer("import os\n", return_tensors="pt").input_ids
    generated = model.generate(ids, min_new_tokens=8, max_new_tokens=8, do_sample=False)  # EOS may come first
    assert generated.shape[1] == ids.shape[1] + 8
    assert isinstance(tokenizer.decode(generated[0]), str)


STOP_ARGS = [*FAST, "train.max_steps=30", "checkpoint.every_steps=100", "checkpoint.keep_last=0"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 30-step run that kill -9 and both stop signals are compared with, and that is started again finished:
    the entry point's Trainer in this process (the curve is the same; the CLI's part is in the runs compared)."""
    reference = tmp_path_factory.mktemp("reference")
    train_here([*STOP_ARGS, f"output_dir={reference}"])
    return reference


def test_kill_9_then_rerun_resumes_exactly(tmp_path, uninterrupted):
    """kill -9 once the step-10 checkpoint is written; the same command resumes on the uninterrupted run's curve
    (that run checkpoints at step 100 only: the checkpoint cadence does not move the curve)."""
    args = [*FAST, "train.max_steps=30", "checkpoint.every_steps=10", "checkpoint.keep_last=0"]
    killed = tmp_path / "killed"
    train_killed_at(args, 10, killed)

    check_ok(again := train([*args, f"output_dir={killed}"]))  # the same command, nothing added
    assert "resume: continuing from" in again.stdout and "at step 10" in again.stdout

    expected, resumed = train_losses(uninterrupted), train_losses(killed)
    assert sorted(resumed) == list(range(1, 31))  # redone steps replaced the lost ones, none twice
    for step in range(11, 31):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), (step, resumed[step], expected[step])
    steps_logged = [m["step"] for m in metrics(killed) if "train/loss" in m]
    assert len(steps_logged) == len(set(steps_logged))


def test_finished_run_started_again_does_not_retrain(uninterrupted):
    before = (uninterrupted / "metrics.jsonl").read_text()
    again = train([*STOP_ARGS, f"output_dir={uninterrupted}"])  # the command that finished it
    check_ok(again)
    assert "run already complete at step 30/30" in again.stdout
    assert (uninterrupted / "metrics.jsonl").read_text() == before


def test_a_checkpoint_from_before_the_keyed_order_resumes_on_numpys_order(tmp_path, uninterrupted):
    """A checkpoint whose trainer_state.json records no sample order (saved before the order had versions) resumes
    on the order its run began with, numpy's permutation (version 1), and says so in its next checkpoint and in
    run_config.json; a new run takes the keyed order (version 2)."""
    import shutil

    from pretrain.checkpoint.integrity import checkpoint_files, read_manifest, record_files, write_manifest

    assert json.loads((uninterrupted / "run_config.json").read_text())["data/order/version"] == 2
    old = tmp_path / "old"
    shutil.copytree(uninterrupted, old)
    (checkpoint,) = (old / "checkpoints").glob("step_*")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["components"].pop("data_order") == {"version": 2, "kind": "keyed"}
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(checkpoint, record_files(checkpoint, checkpoint_files(checkpoint)),
                   read_manifest(checkpoint)["world_size"])
    train_here([*STOP_ARGS, "train.max_steps=31", f"output_dir={old}"])
    resumed = json.loads((old / "checkpoints" / "step_00000031" / "trainer_state.json").read_text())
    assert resumed["components"]["data_order"] == {"version": 1, "kind": "numpy"}
    assert json.loads((old / "run_config.json").read_text())["data/order/version"] == 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.source=/nonexistent/corpus"], "data.source"),
        (["batch.global_batch_size=10", "batch.micro_batch_size=4"],
         "batch.global_batch_size (10) is not divisible by batch.micro_batch_size (4)"),
        (["precision.dtype=fp16"], "precision.dtype=fp16 needs a CUDA GPU"),
        (["optim.name=Adamm"], "optim.name = 'Adamm' is not a torch.optim optimizer"),
        (["model.hiden_size=3"], "did you mean 'model.hidden_size'"),
    ],
)
def test_bad_input_is_one_message_exit_2_no_traceback(tmp_path, overrides, message):
    proc = train([*FAST, "train.max_steps=2", f"output_dir={tmp_path / 'r'}", *overrides])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_empty_corpus_and_unwritable_output_dir(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("   \n")
    proc = train([*FAST, "train.max_steps=2", f"data.source={empty}", f"output_dir={tmp_path / 'r'}",
                  f"data.cache_dir={tmp_path / 'cache'}"])
    assert proc.returncode == 2 and "has no text" in proc.stderr and "Traceback" not in proc.stderr

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = train([*FAST, "train.max_steps=2", f"output_dir={blocker / 'run'}"])
    assert proc.returncode == 2 and "is not writable" in proc.stderr and "Traceback" not in proc.stderr


def test_non_utf8_text_is_replaced_and_counted_not_fatal(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"doc{i}.txt").write_text(f"def function_{i}(x):\n    return x * {i} + 1\n" * 30)
    (corpus / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e\n".encode("latin-1") * 50)
    out = tmp_path / "run"
    _, _, console = train_here([*FAST, "train.max_steps=2", f"data.source={corpus}", "data.tokenizer_vocab_size=300",
                                f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={out}"])  # in this process
    assert "non-UTF-8" in console
    assert len(train_losses(out)) == 2


def test_print_config_and_dry_run_of_7b_without_allocating():
    proc = subprocess.run([sys.executable, RUN, "--recipe", TINY, "--print-config", "train.max_steps=40"],
                          env=env(), capture_output=True, text=True, timeout=120)
    check_ok(proc)
    assert "max_steps: 40" in proc.stdout and proc.stdout.startswith("name: tiny")

    start = time.perf_counter()
    proc = subprocess.run([sys.executable, RUN, "--recipe", str(Path(TINY).parent / "7b.yaml"), "--dry-run"],
                          env=env(WORLD_SIZE="8"), capture_output=True, text=True, timeout=120)
    check_ok(proc)
    assert "6,738,415,616 parameters" in proc.stdout
    assert "world 8: GBS 1024 = MBS 1 x GAS 128 x world 8" in proc.stdout
    assert "4,194,304" in proc.stdout  # tokens per step: 1024 x 4096
    assert time.perf_counter() - start < 60


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_stop_signal_checkpoints_the_step_in_flight_and_resume_continues(tmp_path, sig, uninterrupted):
    args, reference = STOP_ARGS, uninterrupted

    out = tmp_path / "preempted"
    proc = subprocess.Popen([sys.executable, RUN, "--recipe", TINY, *args, f"output_dir={out}"], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    while not ((out / "metrics.jsonl").exists() and '"step": 3,' in (out / "metrics.jsonl").read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(sig)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "preempted: stopped after step" in output
    (checkpoint,) = (out / "checkpoints").glob("step_*")
    stopped_at = json.loads((checkpoint / "trainer_state.json").read_text())["step"]
    assert 3 <= stopped_at < 30
    assert not (out / "final_model").exists()

    check_ok(train([*args, f"output_dir={out}"]))
    expected, resumed = train_losses(reference), train_losses(out)
    assert sorted(resumed) == list(range(1, 31))
    for step in range(stopped_at + 1, 31):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step


CTRL_C_ARGS = [*FAST, "train.max_steps=40", "checkpoint.every_steps=100", "checkpoint.keep_last=0",
               "checkpoint.save_final_model=false"]


def ctrl_c_after_step(cmd: list[str], out: Path, step: int) -> tuple[int, str]:
    """Start ``cmd`` as a terminal's foreground job, press Ctrl-C (SIGINT to its whole process group) once
    ``out``'s metrics have ``step``; its exit code and output."""
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 300
        while not ((out / "metrics.jsonl").exists() and f'"step": {step},' in (out / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, output


def _checkpoint_steps(out: Path) -> list[int]:
    return sorted(json.loads((c / "trainer_state.json").read_text())["step"] for c in (out / "checkpoints").glob("step_*"))


# A wrapper that traps SIGINT and sends it on to its child, as shell scripts and job runners do: under a terminal's
# Ctrl-C (SIGINT to the whole foreground job) its child receives the SIGINT twice, a millisecond apart.
FORWARDS_SIGINT = """
import signal, subprocess, sys
child = subprocess.Popen(sys.argv[1:])
signal.signal(signal.SIGINT, lambda signum, frame: child.send_signal(signal.SIGINT))
sys.exit(child.wait())
"""


@pytest.fixture(scope="module")
def ctrl_c(tmp_path_factory):
    """One 2-process run directory interrupted with Ctrl-C twice and then finished: under ``accelerate launch``
    after step 3; resumed by pretrain-launch under a wrapper that passes SIGINT on (FORWARDS_SIGINT) and
    interrupted again two steps later; finished by that same pretrain-launch command. Beside it, the uninterrupted
    launch its curve must continue. What each stage printed and left behind, for the two tests below (one set of
    launches serves both)."""
    root = tmp_path_factory.mktemp("ctrl_c")
    out = root / "interrupted"
    config = str(ROOT / "accelerate_configs" / "cpu_ddp.yaml")

    def pretrain_launch() -> list[str]:
        return [sys.executable, "-m", "pretrain.cli.launch", "--config_file", config, "--main_process_port",
                str(free_port()), "--recipe", TINY, *CTRL_C_ARGS, f"output_dir={out}"]

    stages = {}
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--main_process_port",
                  str(free_port()), RUN, "--recipe", TINY, *CTRL_C_ARGS, f"output_dir={out}"]
    code, output = ctrl_c_after_step(accelerate, out, 3)
    stages["accelerate launch"] = code, output, _checkpoint_steps(out), (out / "final_model").exists()
    # two steps past the first stop: the wait below sees only steps the resumed run trained
    code, output = ctrl_c_after_step([sys.executable, "-c", FORWARDS_SIGINT, *pretrain_launch()], out,
                                     max(stages["accelerate launch"][2], default=3) + 2)
    stages["pretrain-launch"] = code, output, _checkpoint_steps(out), (out / "final_model").exists()
    stages["rerun"] = subprocess.run(pretrain_launch(), env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, timeout=600)
    reference = root / "reference"
    check_ok(accelerate_launch("cpu_ddp.yaml", [*CTRL_C_ARGS, f"output_dir={reference}"],
                               extra=["--main_process_port", str(free_port())]))
    return out, reference, stages


def test_ctrl_c_of_a_two_process_launch_checkpoints_and_the_rerun_continues_the_curve(ctrl_c):
    """Ctrl-C in a terminal: SIGINT to the launcher's whole foreground process group. torchrun's agent sends
    SIGINT on to its workers (each in a session of its own); they finish the step in flight, agree on it,
    checkpoint and stop; the rerun resumes there and ends on the uninterrupted run's curve."""
    out, reference, stages = ctrl_c
    _, output, checkpoints, final_model = stages["accelerate launch"]
    assert "SIGINT: stopping after the step in flight with a checkpoint" in output, output
    assert "interrupted: stopped after step" in output, output
    (stopped_at,) = checkpoints
    assert 3 <= stopped_at < 40 and f"interrupted: stopped after step {stopped_at}/40" in output
    assert not final_model

    resumed_from = out / "checkpoints" / f"step_{stopped_at:08d}"
    assert f"resume: continuing from {resumed_from} at step {stopped_at}\n" in stages["pretrain-launch"][1]
    assert stages["rerun"].returncode == 0, stages["rerun"].stdout
    expected, resumed = train_losses(reference), train_losses(out)
    assert sorted(resumed) == list(range(1, 41))
    for step in range(1, 41):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-6), step


def test_ctrl_c_of_pretrain_launch_exits_130_without_a_traceback_and_the_same_command_continues(ctrl_c):
    """pretrain-launch takes the terminal's Ctrl-C itself (pretrain/distributed/supervise.py): the workers checkpoint the
    step they stop after, torchrun ends quietly, and the shell sees 130 (torchrun alone prints its
    SignalException traceback and exits 1). Under a wrapper that passes the SIGINT on, the second copy is the same
    Ctrl-C (before, it was "Ctrl-C again": the workers killed, no checkpoint). Rerunning the same command continues
    from that checkpoint."""
    out, _, stages = ctrl_c
    (before,) = stages["accelerate launch"][2]
    code, output, checkpoints, final_model = stages["pretrain-launch"]
    assert code == 130 and "Traceback" not in output and "SignalException" not in output, output
    assert checkpoints[:-1] == [before] and not final_model
    stopped_at = checkpoints[-1]
    assert before + 2 <= stopped_at < 40 and f"interrupted: stopped after step {stopped_at}/40 with a checkpoint" in output

    rerun = stages["rerun"]
    assert rerun.returncode == 0, rerun.stdout
    checkpoint = out / "checkpoints" / f"step_{stopped_at:08d}"
    assert f"resume: continuing from {checkpoint} at step {stopped_at}\n" in rerun.stdout, rerun.stdout
    assert sorted(train_losses(out)) == list(range(1, 41))


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "recipe file not found"),
        ("batch: {global_batch_size: 8\n", "malformed YAML"),
        ("base: me.yaml\n", "inheritance cycle"),
        ("batch: {global_batch_size: 8, micro_batch_size: 2}\ntrain: {max_steps: ten}\n", "train.max_steps = 'ten'"),
    ],
)
def test_recipe_file_errors_exit_2_without_traceback(tmp_path, text, message):
    recipe = tmp_path / "me.yaml"
    if text is not None:
        recipe.write_text(text)
    proc = subprocess.run([sys.executable, RUN, "--recipe", str(recipe)], env=env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# A handler of the caller's own, installed before the Trainer exists: it must be the one in force outside the loop.
MINE = """
import signal

def mine(signum, frame):
    pass

signal.signal(signal.SIGUSR1, mine)
"""


def test_stop_signal_handlers_are_installed_for_the_loop_only(tmp_path):
    proc = train_in_process(
        [*FAST, "train.max_steps=2", "checkpoint.save_final_model=false", f"output_dir={tmp_path / 'run'}"],
        before=MINE,
        between='assert signal.getsignal(signal.SIGUSR1) is mine, "building the trainer installed a handler"',
        after="assert signal.getsignal(signal.SIGUSR1) is mine, signal.getsignal(signal.SIGUSR1)\n"
              "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, signal.getsignal(signal.SIGTERM)\n"
              'print("handlers restored")',
    )
    check_ok(proc)
    assert "handlers restored" in proc.stdout
