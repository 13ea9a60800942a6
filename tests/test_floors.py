"""The minimum-versions smoke set: the end-to-end half, run by CI in an environment holding pyproject's floors.

``bash tools/floors.sh`` builds that environment (torch, accelerate, transformers and deepspeed at the
versions pyproject.toml names as their minimums) and runs ``pytest -m floors`` in it: this module, plus the
in-process tests marked ``floors`` elsewhere (every activation-checkpointing policy, the compile decision and
in-place compile, the environment check). Here the module is skipped unless PRETRAIN_FLOORS=1 (the main
suite trains the same layouts at length in tests/multiprocess/test_distributed.py).
"""

from __future__ import annotations

import os
import sys
from importlib import metadata

import pytest
import torch

from pretrain.system import environment

from .helpers import FAST, accelerate_launch, check_ok, run_cmd, train, train_losses

pytestmark = [
    pytest.mark.floors,
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("PRETRAIN_FLOORS") != "1",
                       reason="the minimum-versions smoke set: CI runs it in its own environment (tools/floors.sh)"),
]

ARGS = [*FAST, "batch.micro_batch_size=2", "train.max_steps=4", "checkpoint.every_steps=2", "eval.every_steps=4",
        "eval.batches=1"]
TESTED = ("torch", "accelerate", "transformers", "deepspeed")


def test_this_environment_holds_the_floors():
    """The point of the set: every package it tests is at the floor pyproject declares."""
    for package in TESTED:
        floor = environment.requirement(package).floor
        assert floor is not None, f"pyproject.toml gives {package} no floor"
        assert environment._release(metadata.version(package)) == environment._release(floor), (
            f"{package} {metadata.version(package)} is installed, pyproject's floor is {floor}")


def test_one_process_ddp_and_zero2_train_one_curve_and_export(tmp_path):
    single = tmp_path / "single"
    check_ok(train([*ARGS, f"output_dir={single}"]))
    runs = {"1 process": single}
    for name, config, extra in [("DDP", "cpu_ddp.yaml", []), ("ZeRO-2", "zero2.yaml", ["--num_processes", "2"])]:
        out = tmp_path / name
        proc = accelerate_launch(config, [*ARGS, f"output_dir={out}"], extra=extra, extra_env={"OMP_NUM_THREADS": "1"})
        check_ok(proc)
        runs[name] = out
    curves = {name: train_losses(out) for name, out in runs.items()}
    reference = curves["1 process"]
    assert sorted(reference) == [1, 2, 3, 4] and reference[4] < reference[1]
    for name, curve in curves.items():
        assert curve == pytest.approx(reference, rel=1e-5), name
    # pretrain-export of the ZeRO-2 checkpoint is the model the run wrote itself.
    exported = tmp_path / "exported"
    check_ok(run_cmd([sys.executable, "-m", "pretrain", "export", str(runs["ZeRO-2"] / "checkpoints" / "step_00000004"),
                      str(exported)]))
    from transformers import AutoModelForCausalLM

    ids = torch.arange(64).reshape(2, 32) % 512
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(d)(ids).logits for d in (exported, runs["ZeRO-2"] / "final_model")]
    torch.testing.assert_close(*logits, rtol=0, atol=1e-6)
