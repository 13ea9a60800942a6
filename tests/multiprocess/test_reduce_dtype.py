"""bf16 gradients accumulated and reduced in fp32 (the default) versus reduced in bf16, measured.

Two CPU processes, a tiny bf16 model, GBS 16 = MBS 1 x GAS 8 x 2 ranks, 5 optimizer steps, under ZeRO-2
and FSDP2 (over gloo: pretrain.distributed.accelerator.fsdp_on_cpu). ZeRO-3 measured as ZeRO-2 did (the figures below)
from the same DeepSpeed settings (data_types.grad_accum_dtype, communication_data_type: written for stages 1-3 alike,
tests/distributed/test_deepspeed_config.py), so its three launches (32 s) left the suite. The reference is an fp32-precision run of the same seed, data
and layout: its gradients have no bf16 rounding anywhere, so it is the "true" gradient both bf16 runs try to
reproduce, and it is independent of the thing measured (a bf16 run with fp32 reduction as the reference would be
at distance 0 from itself). Both bf16 runs share the bf16 forward and backward; they differ only in the dtype the
gradients are accumulated over the 8 micro-steps and reduced across the ranks in (``precision.reduce_dtype``), so
the one closer to the reference is the more accurate accumulation and reduction. Run with ``-s`` to see the table.

What is asserted, for each layout: the fp32-reduction run is closer to the reference (1) in gradient norm at
step 1 (same weights and the same bf16 micro-batch gradients in both bf16 runs: the purest view of the
accumulation and reduction error; measured 1.57e-4 vs 1.99e-4 under ZeRO-2 and ZeRO-3, 1.57e-4 vs 2.97e-4 under
FSDP) and (2) in its weights after the 5 steps (the L2 distance of the exported fp32 master weights).
What is printed but not asserted: the grad norms of steps 2-5 and the loss after 5 steps. Both bf16 runs sit
1.3e-4 to 2.6e-4 from the fp32 reference in loss, an offset of the bf16 forward they share, while they differ
from each other by only 1e-5 to 4e-5, so a scalar lands on either side of the other by chance (see the comment
in the test for the figures).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.helpers import FAST, ROOT, TINY, accelerate_environment, accelerate_launch, check_ok, metrics, run_cmd

STEPS = 5
ARGS = [*FAST, f"train.max_steps={STEPS}", "batch.global_batch_size=16", "batch.micro_batch_size=1",
        "eval.at_start=false", "eval.batches=1", "optim.grad_clip=0", "checkpoint.save_final_model=false"]
ARMS = {"fp32 reference": ["precision.dtype=fp32"],
        "bf16, fp32 reduce": ["precision.dtype=bf16"],
        "bf16, bf16 reduce": ["precision.dtype=bf16", "precision.reduce_dtype=bf16"]}
STAGES = {"ZeRO-2": "zero2.yaml", "FSDP": "fsdp.yaml"}
DEEPSPEED_STAGES = ("ZeRO-2",)


def _curve(run_dir) -> tuple[list[float], list[float]]:
    rows = {m["step"]: m for m in metrics(run_dir) if "train/loss" in m}
    steps = sorted(rows)
    assert steps == list(range(1, STEPS + 1)), steps
    return [rows[s]["train/grad_norm"] for s in steps], [rows[s]["train/loss"] for s in steps]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("reduce_dtype")
    out = {}
    for stage, config in STAGES.items():
        for arm, extra in ARMS.items():
            run_dir = base / f"{config[:-5]}-{arm.replace(' ', '').replace(',', '-')}"
            args = [*ARGS, *extra, f"output_dir={run_dir}"]
            check_ok(accelerate_launch(config, args, extra=["--num_processes", "2"]))
            out[stage, arm] = run_dir
    return out


def _weights(run_dir, out) -> dict:
    """The fp32 master weights after the last step: the run's last checkpoint through pretrain-export."""
    import contextlib
    import io

    from safetensors.torch import load_file

    from pretrain.cli import export

    with contextlib.redirect_stdout(io.StringIO()):
        assert export.main([str(run_dir / "checkpoints" / f"step_{STEPS:08d}"), str(out)]) == 0
    return load_file(str(out / "model.safetensors"))


def _distance(a: dict, b: dict) -> float:
    return sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a).item() ** 0.5


@pytest.mark.slow
def test_fp32_reduction_gradients_are_closer_to_the_fp32_reference_than_bf16_reduction(runs, tmp_path):
    lines = [f"{'layout':8} {'run':18} " + " ".join(f"gnorm{s}".rjust(10) for s in range(1, STEPS + 1))
             + f" {'loss' + str(STEPS):>10} {'|dgnorm|':>10} {'|dloss|':>10} {'|dweights|':>10}"]
    verdicts = []
    for stage in STAGES:
        ref_g, ref_l = _curve(runs[stage, "fp32 reference"])
        ref_w = _weights(runs[stage, "fp32 reference"], tmp_path / stage / "reference")
        dist = {}
        for arm in ARMS:
            g, loss = _curve(runs[stage, arm])
            weights = _weights(runs[stage, arm], tmp_path / stage / arm.replace(" ", "").replace(",", "-"))
            dist[arm] = (sum(abs(a - b) for a, b in zip(g, ref_g, strict=True)), abs(loss[-1] - ref_l[-1]),
                         abs(g[0] - ref_g[0]), _distance(weights, ref_w))
            lines.append(f"{stage:8} {arm:18} " + " ".join(f"{x:10.6f}" for x in g)
                         + f" {loss[-1]:10.6f} {dist[arm][0]:10.2e} {dist[arm][1]:10.2e} {dist[arm][3]:10.3e}")
        verdicts.append((stage, dist["bf16, fp32 reduce"], dist["bf16, bf16 reduce"]))
    print("\n" + "\n".join(lines))
    # Step 1 is the clean scalar comparison: every arm computes its gradient on the same initial weights, so
    # the accumulation and reduction dtype is the only difference from the reference. From step 2 on, the bf16
    # forward and backward move both bf16 runs off the reference by about as much as the reduction does, and a
    # scalar (the grad norm, the loss) then lands on either side: the 5-step sums and the loss are printed, not
    # ordered (measured: loss-5 distance 2.59e-4 fp32 vs 2.48e-4 bf16 under ZeRO-2, 1.34e-4 vs 1.76e-4 ZeRO-3,
    # 2.02e-4 vs 2.27e-4 FSDP). The weights after 5 steps are 344k numbers: the shared bf16-compute error and
    # each run's own reduction error add up in squares there, so the distance to the reference orders the runs
    # (measured: 3.710e-2 vs 3.774e-2 ZeRO-2, 3.714e-2 vs 3.760e-2 ZeRO-3, 4.085e-2 vs 4.305e-2 FSDP).
    for stage, fp32, bf16 in verdicts:
        assert fp32[2] < bf16[2], f"{stage}: step-1 grad-norm distance fp32 reduce {fp32[2]:.3e} >= bf16 {bf16[2]:.3e}"
        assert fp32[3] < bf16[3], f"{stage}: step-{STEPS} weight distance fp32 reduce {fp32[3]:.3e} >= bf16 {bf16[3]:.3e}"


@pytest.mark.slow
def test_written_deepspeed_config_and_run_config_record_the_dtypes(runs):
    for stage in DEEPSPEED_STAGES:
        fp32 = json.loads((runs[stage, "bf16, fp32 reduce"] / "deepspeed_config.json").read_text())
        assert fp32["data_types"] == {"grad_accum_dtype": "fp32"} and fp32["communication_data_type"] == "fp32"
        bf16 = json.loads((runs[stage, "bf16, bf16 reduce"] / "deepspeed_config.json").read_text())
        assert bf16["data_types"] == {"grad_accum_dtype": "bf16"} and bf16["communication_data_type"] == "bf16"
        ref = json.loads((runs[stage, "fp32 reference"] / "deepspeed_config.json").read_text())
        assert "data_types" not in ref and "communication_data_type" not in ref
        for arm, dtypes in (("fp32 reference", ("fp32", "fp32", "fp32")), ("bf16, fp32 reduce", ("bf16", "fp32", "fp32")),
                            ("bf16, bf16 reduce", ("bf16", "bf16", "bf16"))):
            config = json.loads((runs[stage, arm] / "run_config.json").read_text())
            assert (config["dtypes/compute"], config["dtypes/grad_accum"], config["dtypes/reduce"]) == dtypes, arm


def test_bf16_ddp_reduction_on_cpu_is_refused_before_launch(monkeypatch):
    """torch's bf16 all-reduce hook needs CUDA and NCCL: on CPU the option is refused by the pre-flight check
    (pretrain-launch, and every rank's build_accelerator), not silently dropped; one process has no all-reduce."""
    import torch

    from pretrain.distributed.layout import Launch
    from pretrain.errors import ConfigError
    from pretrain.recipe.config import load_recipe
    from pretrain.train.preflight import check_run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fast = load_recipe(TINY, [*FAST, "precision.dtype=bf16", "precision.reduce_dtype=bf16"])
    with pytest.raises(ConfigError, match="precision.reduce_dtype=bf16 under DDP needs CUDA and NCCL"):
        check_run(fast, Launch("ddp", gpus_per_node=2))
    check_run(fast, Launch("ddp", gpus_per_node=1))
    check_run(load_recipe(TINY, [*FAST, "precision.dtype=bf16"]), Launch("ddp", gpus_per_node=2))


def _relative_error_of_summed_gradient(gas: int, ranks: int = 8, n: int = 10_000) -> dict[str, float]:
    """Every rank sums ``gas`` micro-batch gradients, then the ranks' sums are added up (a ring reduction),
    each addition rounded to the accumulation dtype; the inputs are bf16, as backward produces them, so only the
    accumulation and the reduction differ. Gradients: noise 3x their mean, per element."""
    import torch

    gen = torch.Generator().manual_seed(0)
    grads = (torch.randn(n, generator=gen) + 3 * torch.randn(ranks, gas, n, generator=gen)).to(torch.bfloat16)
    exact = grads.double().sum((0, 1))
    error = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        acc = torch.zeros(ranks, n, dtype=dtype)
        for micro in range(gas):
            acc += grads[:, micro].to(dtype)
        total = acc[0]
        for rank in range(1, ranks):
            total = total + acc[rank]
        error[name] = ((total.double() - exact).norm() / exact.norm()).item()
    return error


def test_bf16_accumulation_and_reduction_error_grows_with_gas():
    """docs/distributed.md's numbers for the cost of precision.reduce_dtype=bf16 (run with -s to see them): relative
    error of the summed gradient over 8 ranks, 0.34% at GAS 1 and 0.50% at GAS 128 in bf16, at most 4e-8 in fp32."""
    one, many = _relative_error_of_summed_gradient(1), _relative_error_of_summed_gradient(128)
    print(f"\nGAS 1: {one}\nGAS 128: {many}")
    assert one["fp32"] < 1e-7 and many["fp32"] < 1e-7
    assert 2e-3 < one["bf16"] < many["bf16"] < 1e-2


def use_launch_env(monkeypatch, launch_env: dict[str, str]) -> None:
    """This process's environment as a rank's: accelerate's variables are the launch's only (in-process tests
    before this one leave some in os.environ, e.g. ACCELERATE_USE_DEEPSPEED)."""
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(key)
    for key, value in launch_env.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
def test_fsdp_launch_gets_a_policy_that_reduces_in_precision_reduce_dtype(monkeypatch, reduce):
    """The plugin pretrain hands accelerate for an accelerate_configs/fsdp.yaml launch: FSDP2 with the config's
    sharding and a MixedPrecisionPolicy computing in bf16 and reducing in precision.reduce_dtype, which
    Accelerator(mixed_precision="bf16") keeps (it calls plugin.set_mixed_precision, as AcceleratorState does)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from pretrain.distributed.accelerator import MIXED_PRECISION, fsdp_plugin
    from pretrain.distributed.layout import Launch
    from pretrain.recipe.config import load_recipe

    use_launch_env(monkeypatch, accelerate_environment(ROOT / "accelerate_configs" / "fsdp.yaml"))
    recipe = load_recipe(TINY, ["precision.dtype=bf16", f"precision.reduce_dtype={reduce}"])
    assert Launch.from_env(dict(os.environ)).engine == "fsdp"
    plugin = fsdp_plugin(recipe)
    policy = plugin.mixed_precision_policy
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True  # the accelerate config's settings
    expected = torch.float32 if reduce == "fp32" else torch.bfloat16
    assert policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=expected)
    plugin.set_mixed_precision(MIXED_PRECISION[recipe.precision.dtype])
    assert plugin.mixed_precision_policy is policy
    assert fsdp_plugin(load_recipe(TINY, ["precision.dtype=fp32"])) is None  # fp32: accelerate's defaults


def test_fsdp1_gets_the_same_reduce_dtype(monkeypatch):
    import torch
    from torch.distributed.fsdp import MixedPrecision

    from pretrain.distributed.accelerator import fsdp_plugin
    from pretrain.recipe.config import load_recipe

    # FSDP1 (a user's accelerate config); module-state syncing, which needs a GPU here, is beside the point
    fsdp1 = {"FSDP_VERSION": "1", "FSDP_SYNC_MODULE_STATES": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"}
    use_launch_env(monkeypatch, {**accelerate_environment(ROOT / "accelerate_configs" / "fsdp.yaml"), **fsdp1})
    policy = fsdp_plugin(load_recipe(TINY, ["precision.dtype=bf16"])).mixed_precision_policy
    assert isinstance(policy, MixedPrecision) and policy.reduce_dtype == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
def test_fsdp_accumulates_and_reduces_in_precision_reduce_dtype(tmp_path, reduce):
    """Two real FSDP2 ranks (tests/fsdp_dtype_probe.py; on CPU over gloo, on a GPU box with NCCL): the policy
    reaches fully_shard, the no_sync micro-step accumulates the unsharded gradients in precision.reduce_dtype,
    the sharded gradients end in fp32."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "fsdp.yaml"), "--num_processes", "2", "--main_process_port", "0",
           str(ROOT / "tests" / "fsdp_dtype_probe.py"), str(tmp_path), "--recipe", TINY, *FAST,
           "precision.dtype=bf16", f"precision.reduce_dtype={reduce}", "batch.micro_batch_size=1"]  # GAS 4
    proc = run_cmd(cmd, timeout=600)
    check_ok(proc)
    dtypes = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("DTYPES "))[7:])
    assert dtypes["num_fsdp_params"] > 0 and dtypes["param_dtypes"] == ["torch.bfloat16"]
    # FSDP2 records no reduce dtype where it equals the compute dtype (nothing to cast)
    assert dtypes["reduce_dtypes"] == (["torch.float32"] if reduce == "fp32" else ["None"])
    assert dtypes["accumulated_grad_dtypes"] == [f"torch.{'float32' if reduce == 'fp32' else 'bfloat16'}"]
    assert dtypes["sharded_grad_dtypes"] == ["torch.float32"]
