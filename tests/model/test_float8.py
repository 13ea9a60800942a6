"""precision.float8: torchao's Float8Linear (emulated on CPU) trains the tiny model within a measured tolerance of
the same bf16 run, resumes exactly, checkpoints the keys of a bf16 run and exports a plain HF model; the layouts,
dtypes and GPUs it cannot run on are refused with one message each."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.recipe.config import load_recipe
from tests.helpers import FAST, train_here, train_losses

# Per-step |float8 - bf16| / bf16 of the training loss, 50 steps of FAST (emulated float8 on CPU against bf16 autocast,
# same seed and data), measured on this project's 2-core CPU: at GBS 4 (this test, the keyed sample order of issue 50)
# mean 1.05e-3, median 3.9e-4, every step within 2.0e-3 but step 40: 2.9e-2, where bf16's own loss climbs from 6.65
# to 7.11 over steps 36-40 and float8 overshoots it once (7.30); with the order before, max 1.8e-3 (step 42, mean
# 4.0e-4). At GBS 8 max 1.2e-3 (tensorwise; mean 2.4e-4) and 1.3e-3 (rowwise; mean 3.9e-4). The bounds leave ~2x for
# another CPU's kernels; docs/performance.md, "float8".
RELATIVE_TOLERANCE = 5e-3  # every step but one
MEAN_TOLERANCE = 2e-3
OUTLIER_TOLERANCE = 5e-2  # the one step of an unstable stretch
STEPS, RESUME_AT = 50, 45
ARGS = [*FAST, "batch.global_batch_size=4", f"train.max_steps={STEPS}", "precision.dtype=bf16", "eval.batches=1",
        f"checkpoint.every_steps={RESUME_AT}", "checkpoint.keep_last=0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("torchao", reason="the float8 extra (torchao) is not installed")
    root = tmp_path_factory.mktemp("float8")
    out = {}
    for mode in ("off", "tensorwise"):
        _, trainer, console = train_here([*ARGS, f"precision.float8={mode}", f"output_dir={root / mode}"])
        out[mode] = (root / mode, console)
    resumed = root / "resumed"
    checkpoint = root / "tensorwise" / "checkpoints" / f"step_{RESUME_AT:08d}"
    _, _, console = train_here([*ARGS, "precision.float8=tensorwise", f"output_dir={resumed}",
                                f"checkpoint.resume={checkpoint}"])
    out["resumed"] = (resumed, console)
    return out


def test_float8_tracks_bf16_within_the_measured_tolerance(runs):
    bf16, fp8 = train_losses(runs["off"][0]), train_losses(runs["tensorwise"][0])
    assert sorted(bf16) == sorted(fp8) == list(range(1, STEPS + 1))
    relative = {step: abs(fp8[step] - bf16[step]) / bf16[step] for step in bf16}
    ordered = sorted(relative.values())
    assert ordered[-2] <= RELATIVE_TOLERANCE and ordered[-1] <= OUTLIER_TOLERANCE, relative
    assert sum(ordered) / len(ordered) <= MEAN_TOLERANCE, relative
    assert max(relative.values()) > 1e-5  # float8 really rounded the matmuls: not a bf16 run under another name
    assert fp8[STEPS] < fp8[1] - 1.0  # and it learned


def test_the_log_and_run_config_say_float8_is_on(runs):
    out, console = runs["tensorwise"]
    assert ("float8: tensorwise, 14 Linear layers converted, 1 left in high precision by precision.float8_skip "
            "(lm_head), 0 left out (dimensions not multiples of 16); emulated on CPU") in console
    assert "Failed to load" not in console and "Enum subclass" not in console  # torchao's import noise
    config = json.loads((out / "run_config.json").read_text())
    assert config["float8/recipe"] == "tensorwise" and config["float8/num_converted"] == 14
    assert config["float8/emulated"] is True and json.loads(config["float8/skipped"]) == ["lm_head"]
    assert json.loads((runs["off"][0] / "run_config.json").read_text())["float8"] is None


def test_a_float8_run_resumes_exactly(runs):
    whole, resumed = train_losses(runs["tensorwise"][0]), train_losses(runs["resumed"][0])
    assert sorted(resumed) == list(range(RESUME_AT + 1, STEPS + 1))
    assert {step: whole[step] for step in resumed} == resumed


def test_a_float8_checkpoint_has_the_keys_of_a_bf16_one(runs):
    def keys(run):
        [weights] = (run / "checkpoints" / f"step_{RESUME_AT:08d}").rglob("model*.safetensors")
        with safe_open(str(weights), "pt") as f:
            return set(f.keys())

    assert keys(runs["tensorwise"][0]) == keys(runs["off"][0])


def test_the_export_of_a_float8_run_is_a_plain_hf_model(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from pretrain.cli.export import export

    export(runs["tensorwise"][0] / "checkpoints" / f"step_{STEPS:08d}", tmp_path / "hf", log=lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert not any("float8" in type(m).__name__.lower() for m in model.modules())
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_float8_skip_patterns_and_unaligned_layers_stay_high_precision():
    from transformers import LlamaConfig, LlamaForCausalLM

    pytest.importorskip("torchao", reason="the float8 extra (torchao) is not installed")
    from pretrain.model.float8 import convert

    recipe = load_recipe("recipes/tiny.yaml", ["precision.float8=rowwise", "precision.float8_skip=[lm_head, '*.down_proj']"])
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=120, num_hidden_layers=2,
                                             num_attention_heads=4, vocab_size=256))
    report = convert(model, recipe.precision, emulate=True, fsdp2=False)
    assert report.skipped == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "lm_head"]
    # gate_proj / up_proj: 64 -> 120, and 120 is no multiple of 16
    assert report.unaligned == [f"model.layers.{i}.mlp.{p}" for i in (0, 1) for p in ("gate_proj", "up_proj")]
    assert len(report.converted) == 8 and not report.fsdp_float8_all_gather  # q, k, v, o of two layers


@pytest.mark.parametrize("launch, message", [
    (Launch("deepspeed", 2), "precision.float8=tensorwise runs under one process, DDP and FSDP2, "
                                           "not under DeepSpeed"),
])
def test_float8_is_refused_under_deepspeed(launch, message):
    from pretrain.train.preflight import check_layout

    recipe = load_recipe("recipes/tiny.yaml", ["precision.dtype=bf16", "precision.float8=tensorwise"])
    with pytest.raises(ConfigError, match=message):
        check_layout(recipe, launch)


def test_float8_is_refused_on_a_gpu_below_capability_8_9(monkeypatch):
    from pretrain.model import float8
    from pretrain.train.preflight import check_layout

    monkeypatch.setattr(float8, "cuda_device", lambda: ("NVIDIA A100-SXM4-80GB", (8, 0)))
    recipe = load_recipe("recipes/tiny.yaml", ["precision.dtype=bf16", "precision.float8=rowwise"])
    with pytest.raises(ConfigError, match=r"precision.float8=rowwise needs a GPU of compute capability 8.9 or above "
                                          r".*this NVIDIA A100-SXM4-80GB has capability 8.0; set precision.float8=off"):
        check_layout(recipe, Launch())
    monkeypatch.setattr(float8, "cuda_device", lambda: ("NVIDIA H100 80GB HBM3", (9, 0)))
    check_layout(recipe, Launch())


def test_float8_with_fp16_is_refused_by_the_recipe():
    with pytest.raises(ConfigError, match="precision.float8=tensorwise cannot run with precision.dtype=fp16"):
        load_recipe("recipes/tiny.yaml", ["precision.dtype=fp16", "precision.float8=tensorwise"])
    assert load_recipe("recipes/tiny.yaml", ["precision.float8=off"]).precision.float8 == "off"


def test_float8_without_torchao_names_the_install_command(monkeypatch):
    import importlib.util

    from pretrain.system import environment
    from pretrain.train.preflight import check_layout

    recipe = load_recipe("recipes/tiny.yaml", ["precision.float8=tensorwise"])
    # pyproject's extras (an environment installed before the float8 extra existed has older metadata)
    monkeypatch.setattr(environment, "requirements",
                        lambda: tuple(r for r in environment._from_pyproject() if r and r.extra not in ("dev", "all")))

    def version_of(package):
        return None if package == "torchao" else environment.installed_version(package)

    [problem] = environment.package_problems(recipe, Launch(), version_of=version_of)
    assert problem.startswith("torchao is not installed") and "precision.float8: tensorwise needs torchao" in problem
    assert "pip install 'torchao>=0.18'" in problem
    # the run's own check (pretrain/model/float8.py), for an environment whose metadata predates the extra
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"precision.float8=tensorwise needs torchao, which is not installed: "
                                          r"pip install 'pretrain\[float8\]'"):
        check_layout(recipe, Launch())


def test_the_cli_refuses_float8_under_deepspeed_with_exit_2(capsys):
    from pretrain.cli.launch import main

    status = main(["--config_file", "accelerate_configs/zero2.yaml", "--recipe", "recipes/tiny.yaml",
                   "batch.global_batch_size=128", "precision.dtype=bf16", "precision.float8=tensorwise"])
    err = capsys.readouterr().err
    assert status == 2 and "not under DeepSpeed" in err and "Traceback" not in err


def test_fsdp2_all_gathers_float8_weights_and_tracks_one_process(tmp_path):
    """FSDP2 on 2 CPU processes: torchao's float8 all-gather and the scales precomputed after each optimizer step
    (pretrain/model/float8.py), against the same float8 run on one process; the launch prints no torchao noise."""
    pytest.importorskip("torchao", reason="the float8 extra (torchao) is not installed")
    from tests.helpers import accelerate_launch, check_ok

    args = [*FAST, "train.max_steps=4", "eval.batches=1", "precision.dtype=bf16", "precision.float8=tensorwise"]
    proc = accelerate_launch("fsdp.yaml", [*args, f"output_dir={tmp_path / 'fsdp'}"], extra=["--num_processes", "2"])
    check_ok(proc)
    assert "FSDP2 all-gathers weights in float8" in proc.stdout
    assert "Failed to load" not in proc.stdout + proc.stderr and "Enum subclass" not in proc.stderr
    train_here([*args, f"output_dir={tmp_path / 'one'}"])
    fsdp, one = train_losses(tmp_path / "fsdp"), train_losses(tmp_path / "one")
    assert sorted(fsdp) == sorted(one) == [1, 2, 3, 4]
    assert all(abs(fsdp[s] - one[s]) <= RELATIVE_TOLERANCE * one[s] for s in one), (fsdp, one)
