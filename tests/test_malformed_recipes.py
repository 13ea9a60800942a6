"""Malformed recipes (out-of-range and non-finite numbers and seeds, odd YAML structure, transformers config
overrides the library rejects, optimizers the loop cannot step) are one ConfigError, exit 2, before any
process starts: from ``--dry-run`` and from ``pretrain-launch``'s checks. In-process: an exception that
escapes fails the test as a traceback would."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pretrain.cli.launch import preflight
from pretrain.errors import ConfigError
from tests.helpers import ROOT, TINY

CASES = [
    # (id, recipe text on top of the tiny recipe, overrides, what the message must name)
    ("infinite lr", "", ["optim.lr=.inf"], "optim.lr"),
    ("nan min_lr_ratio", "", ["lr_schedule.min_lr_ratio=.nan"], "lr_schedule.min_lr_ratio"),
    ("infinite peak_tflops", "", ["runtime.peak_tflops=1e400"], "runtime.peak_tflops"),
    ("negative seed", "", ["train.seed=-1"], "train.seed"),
    ("seed beyond numpy's range", "", ["train.seed=4294967296"], "train.seed"),
    ("a list where a section goes", "optim: [AdamW, 3.0e-3]", [], "optim"),
    ("an empty section", "model:", [], "model"),
    ("a mapping where the mixture list goes", "data:\n  mixture: {web: 1}", [], "data.mixture"),
    ("a list where config_overrides' mapping goes", "model:\n  config_overrides: [silu]", [],
     "model.config_overrides"),
    ("an activation transformers does not have", "", ["model.config_overrides={hidden_act: nope}"], "hidden_act"),
    ("a rope type missing its keys", "", ["model.config_overrides={rope_scaling: {type: linear}}"], "factor"),
    ("a width no machine can hold", "", ["model.hidden_size=1000000000", "model.intermediate_size=8"],
     "model.hidden_size (1000000000)"),
    ("a vocabulary past the store's uint32", "", ["data.tokenizer_vocab_size=1000000000000"],
     "data.tokenizer_vocab_size"),
    ("an optimizer that needs a closure", "", ["optim.name=LBFGS"], "closure"),
    ("an optimizer for sparse gradients", "", ["optim.name=SparseAdam", "optim.weight_decay=0"], "sparse"),
    ("one beta", "", ["optim.args={betas: [0.9]}"], "optim.args"),
    ("a beta above 1", "", ["optim.args={betas: [1.5, 0.95]}"], "beta"),
    ("a negative eps", "", ["optim.args={eps: -1.0}"], "eps"),
    ("a timeout past timedelta", "", ["runtime.collective_timeout_s=1e300"], "runtime.collective_timeout_s"),
    ("a loss-scale power past float", "", ["precision.initial_scale_power=5000"], "precision.initial_scale_power"),
]


def _recipe(tmp_path: Path, text: str) -> str:
    if not text:
        return TINY
    path = tmp_path / "recipe.yaml"
    path.write_text(f"base: {TINY}\n{text}\n")
    return str(path)


@pytest.mark.parametrize(("text", "overrides", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_dry_run_and_launch_checks_refuse_with_one_message(tmp_path, capsys, text, overrides, message):
    from pretrain.run import main

    recipe = _recipe(tmp_path, text)
    assert main(["--recipe", recipe, "--dry-run", *overrides, f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight(["--config_file", str(ROOT / "accelerate_configs" / "cpu.yaml")],
                  ["--recipe", recipe, *overrides, f"output_dir={tmp_path / 'run'}"])
