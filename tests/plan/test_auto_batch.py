"""batch.micro_batch_size: auto (pretrain/plan/auto_batch.py): the largest micro-batch whose estimate fits the device,
the global batch kept; given a device capacity, checked against the estimator itself."""

from __future__ import annotations

import pytest

from pretrain.distributed.layout import Launch
from pretrain.plan import auto_batch, memory
from pretrain.plan.planner import TIGHT_FRACTION
from pretrain.recipe.batching import plan_batches
from pretrain.recipe.config import load_recipe
from pretrain.system.hardware import custom_gpu, find_gpu
from tests.helpers import FAST, ROOT, TINY

LLAMA_1B = ROOT / "recipes" / "llama-1b.yaml"


def fits_with_room(recipe, mbs: int, launch: Launch, gpu) -> bool:
    """MBS ``mbs`` with the estimator alone: fits, with at least TIGHT_FRACTION of the device left."""
    candidate = auto_batch.with_micro_batch_size(recipe, mbs)
    est = memory.estimate(candidate, plan_batches(candidate.batch, launch.data_parallel_size, recipe.data.seq_len),
                          launch, gpu=gpu)
    return est.fits and est.headroom_gib >= TIGHT_FRACTION * gpu.memory_gib


@pytest.mark.parametrize("gpu, launch, expected", [
    ("H100-80GB", Launch(), 8),                                       # 36% MFU at the old MBS 4, 46.5% at 8
    ("H200-141GB", Launch(), 16),
    ("A100-40GB", Launch(), 4),
    ("H100-80GB", Launch("deepspeed", 3, gpus_per_node=8), 8),       # ZeRO-3 frees the model states
])
def test_auto_picks_the_largest_micro_batch_that_fits_the_device_and_keeps_the_global_batch(gpu, launch, expected):
    recipe = load_recipe(LLAMA_1B)
    assert recipe.batch.micro_batch_size == "auto"  # the shipped GPU recipe uses it
    device = find_gpu(gpu)
    resolved, line = auto_batch.resolve(recipe, launch, device, "cuda")
    plan = plan_batches(resolved.batch, launch.data_parallel_size, recipe.data.seq_len)
    assert plan.micro_batch_size == expected, line
    assert plan.global_batch_size == 512 and plan.grad_accum_steps == 512 // (expected * launch.data_parallel_size)
    # the estimator's own answer: this size fits with room, the next power of two does not
    assert fits_with_room(recipe, expected, launch, device)
    assert not fits_with_room(recipe, 2 * expected, launch, device)
    assert line.startswith(f"batch: micro_batch_size auto -> {expected} (GAS {plan.grad_accum_steps}, global batch kept)")
    assert f"MBS {2 * expected} would " in line and device.name in line


def test_a_size_that_would_leave_less_than_the_margin_is_passed_over():
    """A capacity just above what MBS 8 needs: 8 fits, but tight; auto takes 4 (the estimate's error bars)."""
    recipe = load_recipe(LLAMA_1B)
    eight = auto_batch.with_micro_batch_size(recipe, 8)
    need = memory.estimate(eight, plan_batches(eight.batch, 1, recipe.data.seq_len), Launch(),
                           gpu=find_gpu("H100-80GB")).total_gib
    device = custom_gpu(need * 1.02)
    choice = auto_batch.choose(recipe, Launch(), device)
    assert choice.micro_batch_size == 4
    assert "MBS 8 would leave" in choice.line()


def test_when_nothing_fits_auto_takes_the_smallest_and_says_so():
    recipe = load_recipe(ROOT / "recipes" / "7b.yaml")
    resolved, line = auto_batch.resolve(recipe, Launch(), custom_gpu(16), "cuda")
    assert resolved.batch.micro_batch_size == 1
    assert "none of 1, 2, 4" in line and "does not fit" in line and "pretrain-plan" in line


def test_auto_needs_the_global_batch_and_refuses_a_bad_value_in_one_line():
    from pretrain.errors import ConfigError

    with pytest.raises(ConfigError, match="exactly one of batch.micro_batch_size and batch.gradient_accumulation_steps"):
        load_recipe(TINY, ["batch.micro_batch_size=auto", "batch.gradient_accumulation_steps=2"])
    with pytest.raises(ConfigError, match=r"batch.micro_batch_size = 'big': Input should be a positive integer or "
                                          r"auto$"):
        load_recipe(TINY, ["batch.micro_batch_size=big"])
    # a command that needs a number and meets auto unresolved says so
    with pytest.raises(ConfigError, match="batch.micro_batch_size=auto is chosen against the device"):
        plan_batches(load_recipe(TINY, ["batch.micro_batch_size=auto"]).batch, 1, 128)


def test_a_cpu_run_chooses_against_its_share_of_the_host_and_says_so_first(tmp_path, capsys):
    """pretrain/run.py on CPU: the choice against the process's share of the host's available memory (the tiny
    model fits at the whole local batch), named in the run's first line; the run trains at that size."""
    from accelerate.state import AcceleratorState, GradientState

    from pretrain import run
    from pretrain.checkpoint import rundir

    try:
        code = run.main(["--recipe", TINY, *FAST, "batch.micro_batch_size=auto", "train.max_steps=2",
                         "checkpoint.save_final_model=false", "checkpoint.every_steps=0", "checkpoint.save_last=false",
                         "stability.rollback.enabled=false", "eval.at_start=false", f"output_dir={tmp_path}"])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    out = capsys.readouterr().out
    assert code == 0, out
    first = out.splitlines()[0]
    assert first.startswith("batch: micro_batch_size auto -> 8 (GAS 1, global batch kept): the largest of 1, 2, 4, 8 "
                            "whose estimate fits the CPU process"), first
    steps = [r for r in rundir.read_metrics(tmp_path) if "train/loss" in r]
    assert [(r["batch/mbs"], r["batch/gas"], r["batch/gbs"]) for r in steps] == [(8, 1, 8)] * 2
