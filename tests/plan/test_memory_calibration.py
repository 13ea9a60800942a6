"""The memory estimate against the peaks measured on a GPU (pretrain/plan/memory/calibration.json).

The rows are tools/bench_gpu.py's, measured on an H100 (docs/performance.md); the factors are fitted on them by
tools/calibrate_memory.py. Regenerate the factors after an estimator change with ``python tools/calibrate_memory.py``
(it prints every row's error); add a GPU visit's rows with ``--add runs/gpu_visit/bench/bench_gpu.json``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pretrain.distributed.layout import Launch
from pretrain.plan import memory
from pretrain.plan.memory import calibration
from pretrain.recipe.batching import plan_batches
from pretrain.recipe.config import load_recipe
from tests.helpers import ROOT, run_cmd

TOOL = ROOT / "tools" / "calibrate_memory.py"


@pytest.fixture(scope="module")
def tool():
    sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location("calibrate_memory", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def observed(tool):
    data = json.loads(calibration.FILE.read_text())
    rows = [r for r in data["rows"] if not r.get("excluded")]
    return data, [tool.observe(r) for r in rows]


def test_every_measured_row_is_within_10_percent_and_the_file_is_what_its_rows_give(observed):
    """Issue 35's bar: each benchmark row's estimate within 10% of its measured peak, eager or compiled, bf16 or
    float8. The formula alone misses the compiled rows (MBS 8 +17%, float8 +35%): the calibration is what holds."""
    data, observations = observed
    assert len(observations) >= 7 and {o.group for o in observations} >= {
        "compiled/none/16-bit/ddp", "eager/none/16-bit/ddp", "compiled/none/float8/ddp", "compiled/full/16-bit/ddp"}
    factors = calibration.fit(observations)
    assert factors == data["factors"], "stale: run python tools/calibrate_memory.py"
    errors = {o.name: o.error(factors.get(o.group, {}).get("factor", 1.0)) for o in observations}
    assert all(abs(e) <= 0.10 for e in errors.values()), errors
    formula = {o.name: o.error(1.0) for o in observations}
    assert max(formula.values()) > 0.30, formula  # float8 under compile, uncalibrated
    # compiled blocks save fewer tensors than the eager formula counts; eager on CUDA under autocast more
    assert factors["compiled/none/16-bit/ddp"]["factor"] < 0.9 < 1.1 < factors["eager/none/16-bit/ddp"]["factor"]


def test_a_row_whose_peak_is_the_optimizer_step_is_not_fitted_and_still_holds(observed):
    """llama-3b at MBS 1 and GAS 1 measured 49.43 GiB: less than its fp32 weights, gradients, AdamW moments and
    autocast copies (53.9 GiB), so the gradients cannot be alive with the activations. With the trainer's
    zero_grad(set_to_none=True) they are not at GAS 1 (states.py), and the peak is the end of backward: every
    gradient plus the tied embedding's added onto the LM head's."""
    _, observations = observed
    row = next(o for o in observations if o.name.startswith("llama-3b"))
    assert not row.informative
    assert abs(row.error(1.0)) < 0.05
    assert row.other_phases > row.backward_rest + 0.77 * row.activations


def test_the_estimate_applies_the_factor_on_cuda_for_the_measured_engine_only():
    recipe = load_recipe(ROOT / "recipes" / "llama-1b.yaml", ["batch.micro_batch_size=4"])
    plan = plan_batches(recipe.batch, 1, recipe.data.seq_len)
    one = Launch()
    fitted = calibration.factor("regional", "none", "bf16", "off", "ddp")
    assert fitted.rows >= 2 and "H100" in fitted.measured_on
    formula = memory.estimate(recipe, plan, one, calibrated=False)
    cuda = memory.estimate(recipe, plan, one)
    assert cuda.terms["activations"].bytes == int(formula.terms["activations"].bytes * fitted.value)
    assert any("calibrated for compiled/none/16-bit/ddp" in n and "H100" in n for n in cuda.notes), cuda.notes
    # on CPU the formula is what the saved tensors are checked against (test_memory_validation.py)
    cpu = memory.estimate(recipe, plan, one, device="cpu")
    assert cpu.terms["activations"].bytes == memory.estimate(recipe, plan, one, device="cpu",
                                                             calibrated=False).terms["activations"].bytes
    # DeepSpeed computes over bf16 weights: no row measured it, the formula stands
    zero2 = Launch("deepspeed", 2)
    assert (memory.estimate(recipe, plan, zero2).terms["activations"].bytes
            == memory.estimate(recipe, plan, zero2, calibrated=False).terms["activations"].bytes)
    # eager (model.compile none) has its own factor
    eager = load_recipe(ROOT / "recipes" / "llama-1b.yaml", ["batch.micro_batch_size=4", "model.compile=none"])
    assert (memory.estimate(eager, plan, one).terms["activations"].bytes
            > formula.terms["activations"].bytes > cuda.terms["activations"].bytes)


def test_gradients_are_alive_in_backward_only_past_the_first_micro_step():
    recipe = load_recipe(ROOT / "recipes" / "llama-1b.yaml", ["batch.micro_batch_size=4"])
    one = Launch()
    first = memory.estimate(recipe, plan_batches(recipe.batch, 1, recipe.data.seq_len), one)  # GAS 128
    gas1 = load_recipe(ROOT / "recipes" / "llama-1b.yaml", ["batch.micro_batch_size=4", "batch.global_batch_size=4"])
    single = memory.estimate(gas1, plan_batches(gas1.batch, 1, gas1.data.seq_len), one)
    P = single.num_params
    assert single.terms["grads"].at("backward") == 0 and single.terms["grads"].at("reduction") == 4 * P
    assert first.terms["grads"].at("backward") == 4 * P
    assert single.phases["backward"] == first.phases["backward"] - 4 * P


def test_add_takes_a_visits_rows_and_refits(tmp_path, tool, capsys):
    """A visit's bench_gpu.json (its GPU and versions, its ok rows) joins the rows; the refit is written."""
    file = tmp_path / "calibration.json"
    file.write_text(calibration.FILE.read_text())
    bench = tmp_path / "bench_gpu.json"
    row = {"model": "llama-1b", "setting": "mbs-4", "overrides": ["batch.micro_batch_size=4"], "micro_batch_size": 4,
           "loss": "liger", "compile": "regional", "peak_gib": 27.0, "status": "ok"}
    bench.write_text(json.dumps({"device": "NVIDIA H200", "date": "2026-12-01",
                                 "versions": {"torch": "2.11.0", "transformers": "5.17.0"},
                                 "rows": [row, {**row, "setting": "default", "status": "no-fit", "peak_gib": None}]}))
    assert tool.main(["--file", str(file), "--add", str(bench)]) == 0
    out = capsys.readouterr().out
    data = json.loads(file.read_text())
    added = [r for r in data["rows"] if r["gpu"] == "NVIDIA H200"]
    assert len(added) == 1 and added[0]["peak_gib"] == 27.0 and added[0]["recipe"] == "recipes/llama-1b.yaml"
    assert {"gpu": "NVIDIA H200", "torch": "2.11.0", "transformers": "5.17.0"} in data["measured_on"]
    assert data["factors"]["compiled/none/16-bit/ddp"]["rows"] == 3
    assert "| llama-1b / mbs-4 / MBS 4 | compiled/none/16-bit/ddp | 27.00 |" in out
    # --check on the refitted file: up to date
    assert tool.main(["--file", str(file), "--check"]) == 0
    # a file that is not a visit's: one line, exit 2
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    capsys.readouterr()
    assert tool.main(["--file", str(file), "--add", str(bad)]) == 2
    assert "not a bench_gpu.json" in capsys.readouterr().err
    # a CPU rehearsal's rows (tools/bench_gpu.py --reduced) calibrate nothing
    bad.write_text(json.dumps({"device": "AMD EPYC", "versions": {"torch": "2.13.0", "transformers": "5.17.0"},
                               "rows": [{**row, "model": "tiny", "setting": "default"}]}))
    assert tool.main(["--file", str(file), "--add", str(bad)]) == 2
    assert "only rows measured on a GPU" in capsys.readouterr().err
    # no calibration file there: one line, exit 2
    assert tool.main(["--file", str(tmp_path / "missing.json"), "--check"]) == 2
    assert "not a calibration file" in capsys.readouterr().err
    # and as a script, as the docs run it (the tool's own directory first on the path)
    proc = run_cmd([sys.executable, str(TOOL), "--file", str(file), "--check"], timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_check_says_when_the_file_is_stale(tmp_path, tool, capsys):
    file = tmp_path / "calibration.json"
    data = json.loads(calibration.FILE.read_text())
    data["factors"]["compiled/none/16-bit/ddp"]["factor"] = 0.5
    file.write_text(json.dumps(data))
    assert tool.main(["--file", str(file), "--check"]) == 1
    assert "is stale" in capsys.readouterr().err
    assert json.loads(file.read_text())["factors"]["compiled/none/16-bit/ddp"]["factor"] == 0.5  # --check writes nothing


def test_the_calibration_ships_with_the_package():
    assert calibration.FILE.parent == Path(memory.__file__).parent
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "plan/memory/calibration.json" in pyproject
