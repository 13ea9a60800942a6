"""One curve on any layout: 1 process, DDP, ZeRO 1-3 and FSDP2 on CPU (gloo) give the same per-step losses."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from tests import golden_losses
from tests.helpers import FAST, TINY, accelerate_launch, check_ok, free_port, run_cmd, train, train_losses

pytestmark = pytest.mark.slow

STEPS = golden_losses.DIST_STEPS
# GBS 8 everywhere; MBS 2: one process accumulates 4 micro-batches, two processes 2 each.
CURVE = golden_losses.DIST_ARGS


# The runs with model.compile=regional (each resumed from an eager checkpoint); the others run eager (auto = none
# on CPU).
COMPILED = ("ZeRO-2 resumed at 3", "ZeRO-3 resumed at 3", "cpu_ddp, GAS 2 resumed at 3",
            "cpu_ddp resumed at 3 in 1 process", "FSDP resumed at 3")


# Runs with an activation checkpointing policy (the others: none, as the curve's recipe says).
SELECTIVE = {"FSDP": "selective"}

# The run that reduce-scatters after every micro-batch (batch.sync_each_micro_batch, no no_sync): FSDP2's gradient
# shards accumulate instead of its unsharded gradients, and the curve must not move.
SYNC_EACH = ("FSDP resumed at 3",)

# The fresh runs score the demo's downstream task at steps 0 and 6 (15 examples: ranks hold 8 and 7, so one rank
# pads its forward calls); every layout must count what one process counts (test_downstream_counts_on_every_layout).
# final_model in shards of 200 kB (the 1 MB embedding alone, the blocks in a few): written by both ranks at once
FINAL_SHARD, PARALLEL_FINAL = "200KB", ("cpu_ddp, GAS 2", "ZeRO-3", "FSDP")
TASK = ["eval.tasks=[{name: lines, path: recipes/tasks/stdlib_lines.jsonl, limit: 15}]"]


def run_config(run_dir) -> dict:
    return json.loads((run_dir / "run_config.json").read_text())


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    root = tmp_path_factory.mktemp("curves")
    runs = {}
    # As pretrain-launch sets it (cores / processes per node); without it torchrun warns that it set 1 itself.
    threads = {"OMP_NUM_THREADS": "1"}
    # The store first, by pretrain-prepare-data: its tokenize progress bar is pretrain's own output, not library noise,
    # and the runs are checked for noise whichever test file built the suite's shared store before (or none did).
    check_ok(run_cmd([sys.executable, "-m", "pretrain.cli.prepare_data", "--recipe", TINY, *CURVE]))
    proc = train([*CURVE, *TASK, f"output_dir={root / 'single'}"])
    check_ok(proc)
    runs["1 process, GAS 4"] = keep_console(proc, root / "single")
    for name, config in [("cpu_ddp, GAS 2", "cpu_ddp.yaml"), ("ZeRO-1", "zero1.yaml"), ("ZeRO-2", "zero2.yaml"),
                         ("ZeRO-3", "zero3.yaml"), ("FSDP", "fsdp.yaml")]:
        out = root / config.removesuffix(".yaml")
        # a free rendezvous port: accelerate warns (noise) and moves off 29500 when another run holds it
        extra = ["--main_process_port", str(free_port())] + ([] if config == "cpu_ddp.yaml" else ["--num_processes", "2"])
        # FSDP with selective activation checkpointing (kept outputs and recomputed ops across FSDP2's
        # per-block gathers; refused under ZeRO-3): the curve must not move.
        policy = [f"model.activation_checkpointing={SELECTIVE[name]}"] if name in SELECTIVE else []
        policy += [f"checkpoint.final_model_shard_size={FINAL_SHARD}"] if name in PARALLEL_FINAL else []
        proc = accelerate_launch(config, [*CURVE, *TASK, f"output_dir={out}", *policy], extra=extra,
                                 extra_env=threads)
        check_ok(proc)
        runs[name] = keep_console(proc, out)
    # Resume from the step-3 checkpoint of the ZeRO-2 / ZeRO-3 / DDP / FSDP runs into a fresh directory, with regional
    # compile (COMPILED): an eager checkpoint loads into the compiled model, the
    # losses stay the eager ones (test_one_curve_on_every_layout) and the checkpoints it writes keep plain keys.
    for name, config in [("ZeRO-2 resumed at 3", "zero2.yaml"), ("ZeRO-3 resumed at 3", "zero3.yaml"),
                         ("cpu_ddp, GAS 2 resumed at 3", "cpu_ddp.yaml"), ("FSDP resumed at 3", "fsdp.yaml")]:
        source = runs[name.split(" resumed")[0]] / "checkpoints" / "step_00000003"
        out = root / f"{config.removesuffix('.yaml')}_resumed"
        compiled = ["model.compile=regional"] if name in COMPILED else []
        compiled += ["batch.sync_each_micro_batch=true"] if name in SYNC_EACH else []
        extra = ["--main_process_port", str(free_port())] + ([] if config == "cpu_ddp.yaml" else ["--num_processes", "2"])
        proc = accelerate_launch(config, [*CURVE, f"output_dir={out}", f"checkpoint.resume={source}", *compiled],
                                 extra=extra, extra_env=threads)
        check_ok(proc)
        assert "at step 3" in proc.stdout
        runs[name] = keep_console(proc, out)
    # The 2-process DDP checkpoint continues in one process (compiled): model keys renamed, RNG re-seeded,
    # GAS 2 -> 4.
    out = root / "cpu_ddp_resumed_1"
    proc = train([*CURVE, f"output_dir={out}", "model.compile=regional",
                  f"checkpoint.resume={runs['cpu_ddp, GAS 2'] / 'checkpoints' / 'step_00000003'}"])
    check_ok(proc)
    assert "at step 3" in proc.stdout and "re-seeded" in proc.stdout
    runs["cpu_ddp resumed at 3 in 1 process"] = keep_console(proc, out)
    return runs


def keep_console(proc, run_dir):
    """The run's console (stdout, then stderr) beside its files, for test_no_library_noise_on_any_layout."""
    (run_dir / "console.txt").write_text(proc.stdout + proc.stderr)
    return run_dir


def test_no_library_noise_on_any_layout(curves):
    """No library warning, tied-weight save warning, DeepSpeed op print or progress bar on any layout, fresh or
    resumed (tests/multiprocess/test_console.py reads one launch line by line, through pretrain-launch)."""
    noise = re.compile(r"Warning|Removed shared tensor|built successfully|\d+%\||\r")
    for name, run_dir in curves.items():
        console = (run_dir / "console.txt").read_text()
        assert not noise.search(console), f"{name}:\n{console}"


def test_layouts_report_their_real_world_size(curves):
    for name, run_dir in curves.items():
        config = run_config(run_dir)
        expected = 1 if name.startswith("1 process") or name.endswith("in 1 process") else 2
        assert config["dist/world_size"] == expected, name
        assert list(run_dir.glob(".shared-probe-*")) == [], name  # the shared output_dir probe is removed
        assert config["plan/global_batch_size"] == 8
        assert config["plan/grad_accum_steps"] == 8 // (2 * expected)
        if "ZeRO" in name:
            assert config["dist/distributed_type"] == "DEEPSPEED"
        if "FSDP" in name:  # FSDP2 over gloo (runtime.fsdp_on_cpu), not accelerate's silent fallback to DDP
            assert config["dist/distributed_type"] == "FSDP"
        assert config["recipe/model/activation_checkpointing"] == SELECTIVE.get(name, "none"), name
        assert config["recipe/batch/sync_each_micro_batch"] == (name in SYNC_EACH), name
        said = "reduced in fp32 after every micro-batch)" in (run_dir / "console.txt").read_text()
        assert said == (name in SYNC_EACH), name
        # DeepSpeed steps the torch client optimizer (deepspeed.optimizer=auto, no optimizer in its JSON)
        assert config["optim/class"] == "AdamW" and not config["optim/fused"], name


def test_one_curve_on_every_layout(curves):
    losses = {name: train_losses(run_dir) for name, run_dir in curves.items()}
    reference = losses["1 process, GAS 4"]
    header = "step | " + " | ".join(f"{name:>20}" for name in losses)
    print("\n" + header)
    for step in range(1, STEPS + 1):
        print(f"{step:4d} | " + " | ".join(f"{curve[step]:20.7f}" if step in curve else " " * 20
                                            for curve in losses.values()))
    for name, curve in losses.items():
        for step, loss in curve.items():
            assert loss == pytest.approx(reference[step], rel=1e-4), (name, step, loss, reference[step])
        expected_steps = range(4, STEPS + 1) if "resumed" in name else range(1, STEPS + 1)
        assert sorted(curve) == list(expected_steps), name


def test_regional_compile_runs_on_every_engine_with_plain_checkpoint_keys(curves):
    """The compiled runs record compile/mode regional (auto resolves to none on CPU), and the checkpoint each
    wrote keeps the eager model's keys (no ``_orig_mod.``), so it resumes and exports without compile."""
    from safetensors import safe_open

    for name, run_dir in curves.items():
        assert run_config(run_dir)["compile/mode"] == ("regional" if name in COMPILED else "none"), name
    for name in ("cpu_ddp, GAS 2 resumed at 3", "cpu_ddp resumed at 3 in 1 process"):
        with safe_open(curves[name] / "checkpoints" / "step_00000006" / "model.safetensors", "pt") as saved:
            keys = list(saved.keys())
        assert "model.layers.0.mlp.up_proj.weight" in keys and not [k for k in keys if "_orig_mod" in k], name
    states = torch.load(curves["ZeRO-2 resumed at 3"] / "checkpoints" / "step_00000006" / "pytorch_model" /
                        "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    keys = list(states["module"])
    assert "model.layers.0.mlp.up_proj.weight" in keys and not [k for k in keys if "_orig_mod" in k]
    import torch.distributed.checkpoint as dcp  # FSDP: the torch.distributed.checkpoint shards' keys

    step6 = curves["FSDP resumed at 3"] / "checkpoints" / "step_00000006"
    keys = list(dcp.FileSystemReader(str(step6 / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata)
    assert "model.model.layers.0.mlp.up_proj.weight" in keys and not [k for k in keys if "_orig_mod" in k]


def downstream(run_dir) -> dict[int, tuple[float, float]]:
    return {m["step"]: (m["eval/lines/acc"], m["eval/lines/acc_norm"])
            for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval/lines/acc" in m}


def test_downstream_counts_on_every_layout(curves):
    """Sharded over 2 ranks (DDP, ZeRO 1-3, FSDP2: the model called as each engine wraps it), the task's acc and
    acc_norm are one process's; pretrain-eval on a ZeRO-3 checkpoint and on the final model gives them again."""
    import subprocess
    import sys

    from pretrain.train.downstream import evaluate_model, load_exported_model, read_task
    from tests.helpers import ROOT, env

    reference = downstream(curves["1 process, GAS 4"])
    assert sorted(reference) == [0, STEPS]
    for name in ("cpu_ddp, GAS 2", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP"):
        assert downstream(curves[name]) == reference, name
    proc = subprocess.run([sys.executable, "-m", "pretrain", "eval", "--checkpoint",
                           str(curves["ZeRO-3"] / "checkpoints" / f"step_{STEPS:08d}"), "--task",
                           "recipes/tasks/stdlib_lines.jsonl", "--limit", "15", "--json"],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)["tasks"]["stdlib_lines"]
    assert (result["acc"], result["acc_norm"], result["num_examples"]) == (*reference[STEPS], 15)
    model, tokenizer, window = load_exported_model(curves["1 process, GAS 4"] / "final_model")
    task = read_task(ROOT / "recipes" / "tasks" / "stdlib_lines.jsonl", limit=15)
    [score] = evaluate_model(model, tokenizer, window, [task], batch_tokens=256)
    assert (score.acc, score.acc_norm) == reference[STEPS]


def test_ddp_and_zero2_curves_match_the_golden_curves(curves):
    """Recorded before the redesign (tests/golden/losses.json); any later change must reproduce them."""
    golden = golden_losses.load()
    problems = []
    for name, run in [("cpu_ddp", "cpu_ddp, GAS 2"), ("zero2", "ZeRO-2")]:
        problems += golden_losses.mismatches(name, train_losses(curves[run]), golden[name])
    assert problems == []


def test_zero2_deepspeed_config_has_the_batch_triple(curves):
    config = json.loads((curves["ZeRO-2"] / "deepspeed_config.json").read_text())
    assert config["train_batch_size"] == 8
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 2
    assert config["zero_optimization"]["stage"] == 2
    assert config["gradient_clipping"] == 1.0


def test_zero3_final_model_is_the_gathered_full_model(curves):
    from transformers import AutoModelForCausalLM

    zero3 = AutoModelForCausalLM.from_pretrained(curves["ZeRO-3"] / "final_model")
    single = AutoModelForCausalLM.from_pretrained(curves["1 process, GAS 4"] / "final_model")
    for (name, a), (_, b) in zip(single.state_dict().items(), zero3.state_dict().items(), strict=True):
        assert a.shape == b.shape, name
        # Same init and data; only the reduction order differs (Adam turns that into ~1e-4 after 6 steps).
        # A missing or garbled partition would differ by the weights' own scale (~0.02).
        assert (a - b).abs().max().item() < 1e-3, name
        assert b.abs().max().item() > 0, name


@pytest.mark.parametrize("config", ["zero2_offload.yaml", "zero3_offload.yaml"])
def test_offload_configs_run_the_tiny_recipe(tmp_path, config):
    out = tmp_path / "run"
    check_ok(accelerate_launch(config, ["train.max_steps=2", "lr_schedule.warmup_steps=1", "eval.batches=1", "eval.tasks=[]",
                                        "logging.progress=plain", f"output_dir={out}"], extra=["--num_processes", "2"]))
    assert run_config(out)["dist/world_size"] == 2
    assert len(train_losses(out)) == 2


def test_local_batch_size_with_linear_lr_scaling_logs_effective_gbs_and_lr(tmp_path):
    out = tmp_path / "run"
    args = [*FAST, "train.max_steps=2", "batch.global_batch_size=null", "batch.micro_batch_size=null",
            "batch.local_batch_size=4", "optim.lr=1e-3", "optim.lr_scaling=linear",
            "optim.reference_global_batch_size=4", f"output_dir={out}"]
    proc = accelerate_launch("cpu_ddp.yaml", args)
    check_ok(proc)
    assert "GBS 8 = MBS 4 x GAS 1 x world 2" in proc.stdout
    config = run_config(out)
    assert config["plan/global_batch_size"] == 8
    assert config["train/lr"] == pytest.approx(2e-3)  # 1e-3 x (8 / 4)


def _logits(model_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        return model(torch.arange(64).reshape(2, 32) % model.config.vocab_size).logits


@pytest.mark.parametrize("run", ["ZeRO-3", "FSDP", "FSDP resumed at 3", "cpu_ddp, GAS 2",
                                 "cpu_ddp resumed at 3 in 1 process"])
def test_export_of_the_last_checkpoint_gives_the_final_models_logits(curves, tmp_path, run):
    """pretrain-export of the step-6 checkpoint (ZeRO-3: the fp32 partitions of 2 ranks merged; FSDP: the
    torch.distributed.checkpoint shards of 2 ranks, through accelerate's merge_fsdp_weights, also of a compiled
    run; DDP: the saved module) is the model the run itself wrote at step 6."""
    import contextlib
    import io

    from pretrain.cli import export

    out = tmp_path / "exported"
    # pretrain-export's main in this process: the conversion under test, without an interpreter start per case
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert export.main([str(curves[run] / "checkpoints" / "step_00000006"), str(out)]) == 0
    assert "export:" in printed.getvalue()
    torch.testing.assert_close(_logits(out), _logits(curves[run] / "final_model"), rtol=0, atol=1e-6)
    assert (out / "tokenizer.json").is_file()
    if run in PARALLEL_FINAL:  # the final model's shards were written by the two ranks, each its own, at once
        index = json.loads((curves[run] / "final_model" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 3
        assert "written by 2 rank(s) in parallel" in (curves[run] / "console.txt").read_text()


def test_a_dcp_shard_that_is_not_a_tensor_file_stops_every_rank_with_one_message(curves, tmp_path, capsys,
                                                                                 monkeypatch):
    """Issue 36: the FSDP run's step-3 checkpoint (this module's, copied) with rank 1's DCP model shard replaced by
    random bytes and its checksum updated in the manifest. Before, DCP's reader failed on it in every rank, each with
    its traceback. Resumed through accelerate launch every rank exits 2 and none prints a traceback, rank 0 says
    why once (rank 1 found it in its own shard); pretrain-launch refuses it before any process starts, and
    pretrain-export before any read."""
    import os
    import shutil
    import socket

    from pretrain.cli import export
    from pretrain.cli import launch as launch_cli
    from pretrain.trust import FORCE_ENV
    from tests.checkpoint.test_trust import _replace
    from tests.helpers import ROOT, TINY

    crafted = tmp_path / "crafted" / "step_00000003"
    shutil.copytree(curves["FSDP"] / "checkpoints" / "step_00000003", crafted)
    shard = "pytorch_model_fsdp_0/__1_0.distcp"
    _replace(crafted, shard, lambda path: path.write_bytes(os.urandom(path.stat().st_size)))
    message = f"{crafted / shard} is not a tensor file torch.distributed.checkpoint writes"
    resume = [*CURVE, f"output_dir={tmp_path / 'run'}", f"checkpoint.resume={crafted}"]
    proc = accelerate_launch("fsdp.yaml", resume, extra=["--num_processes", "2", "--main_process_port",
                                                         str(free_port())], extra_env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0 and proc.stderr.count("exitcode  : 2") == 2, proc.stderr[-3000:]
    assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert f"rank 1 (host {socket.gethostname()}) {message}" in proc.stderr, proc.stderr[-3000:]
    workers = proc.stderr.split('Traceback (most recent call last):\n  File "<frozen runpy>"')[0]  # then the launcher's
    assert "Traceback" not in workers, proc.stderr[-3000:]

    # pretrain-launch and pretrain-export in this process: what enforce() sets in os.environ is undone after the test
    for name in (FORCE_ENV, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    launched = []
    monkeypatch.setattr(launch_cli, "run_launcher", lambda argv, environment: launched.append(argv) or 0)
    capsys.readouterr()
    code = launch_cli.main(["--config_file", str(ROOT / "accelerate_configs" / "fsdp.yaml"), "--num_processes", "2",
                            "--recipe", TINY, *resume])
    out, err = capsys.readouterr()
    assert code == 2 and launched == [] and message in err and "Traceback" not in err, err[-3000:]
    code = export.main([str(crafted), str(tmp_path / "exported")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err[-3000:]
    assert not (tmp_path / "exported").exists()
