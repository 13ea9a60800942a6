"""Malformed recipes (out-of-range and non-finite numbers and seeds, odd YAML structure, transformers config
overrides the library rejects, optimizers the loop cannot step) are one ConfigError, exit 2, before any
process starts: from ``--dry-run`` and from ``pretrain-launch``'s checks. In-process: an exception that
escapes fails the test as a traceback would."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pretrain.cli.prelaunch import preflight
from pretrain.errors import ConfigError
from tests.helpers import ROOT, TINY

CASES = [
    # (id, recipe text on top of the tiny recipe, overrides, what the message must name)
    ("infinite lr", "", ["optim.lr=.inf"], "optim.lr"),
    ("nan min_lr_ratio", "", ["lr_schedule.min_lr_ratio=.nan"], "lr_schedule.min_lr_ratio"),
    ("infinite peak_tflops", "", ["logging.peak_tflops=1e400"], "logging.peak_tflops"),
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
    # Well-typed but absurd: each refused by its schema bound, before anything is sized by it.
    ("a global batch of 2**62 sequences", "", ["batch.global_batch_size=4611686018427387904"],
     "batch.global_batch_size = 4611686018427387904: Input should be less than or equal to 16777216"),
    ("a micro-batch past the bound", "", ["batch.micro_batch_size=16777217"],
     "batch.micro_batch_size = 16777217: Input should be less than or equal to 16777216"),
    ("a sequence of 2**40 tokens", "", ["data.seq_len=1099511627776"], "data.seq_len = 1099511627776"),
    ("2**40 loader workers", "", ["data.num_workers=1099511627776"], "data.num_workers = 1099511627776"),
    ("a watchdog of 1e-300 s", "", ["runtime.hang_timeout_s=1e-300"], "runtime.hang_timeout_s"),
    ("a minimum loss scale of 1e308", "", ["precision.min_loss_scale=1e308"], "precision.min_loss_scale"),
    ("a minimum loss scale fp16 cannot hold", "", ["precision.min_loss_scale=1e-30"], "precision.min_loss_scale"),
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


# ---- YAML surprises (pretrain/recipe/safe_yaml.py): recipes, overrides and accelerate configs -------------------------
def _bomb(levels: int = 9) -> str:
    """"Billion laughs": 10**levels list items from a few hundred bytes of aliases."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\noptim:\n  args: {{betas: *l{levels}}}"


YAML_CASES = [
    # (id, recipe file content (bytes: written as is), overrides, what the message must name)
    ("a duplicate section", "train: {max_steps: 3}\ntrain: {max_steps: 5}", [], "duplicate key 'train' (first at line 2)"),
    ("a duplicate nested key", "optim:\n  lr: 1.0e-3\n  lr: 2.0e-3", [], "line 4, column 3: duplicate key 'lr'"),
    ("a duplicate key in an override", "", ["optim.args={eps: 1.0e-8, eps: 1.0e-6}"], "duplicate key 'eps'"),
    ("an alias bomb", _bomb(), [], "aliases expand this document to more than 100,000 values"),
    ("an alias bomb in an override", "", ["optim.args={a: &a [1,1,1,1,1,1,1,1,1,1], "
                                          + ", ".join(f"{c}: &{c} [{', '.join(['*' + p] * 10)}]"
                                                      for p, c in zip("abcdef", "bcdefg", strict=True)) + "}"],
     "override 'optim.args="),
    ("a recursive alias", "optim:\n  args: &a {x: *a}", [], "recursive alias"),
    ("an integer beyond 64 bits", f"train: {{max_steps: {10**400}}}", [], "(401 digits) is beyond a 64-bit integer"),
    ("an override beyond 64 bits", "", [f"train.max_steps={2**64}"], "(20 digits) is beyond a 64-bit integer"),
    ("a nesting deeper than the parser's stack", "optim:\n  args: {x: " + "[" * 5000 + "]" * 5000 + "}", [],
     "nested too deeply"),
    ("latin-1 bytes", "description: caf\xe9".encode("latin-1"), [], "is not UTF-8 text (byte 0xe9"),
    ("UTF-16", "train: {max_steps: 3}".encode("utf-16"), [], "is not UTF-8 text (byte 0xff"),
    ("a NUL byte", b"description: a\x00b", [], "special characters are not allowed"),
    ("a python tag", "optim: !!python/object:os.system {}", [], "could not determine a constructor"),
    ("two documents", "train: {max_steps: 3}\n---\ntrain: {max_steps: 5}", [], "but found another document"),
    ("a huge string in a wrong-typed field", "train: [" + ", ".join(["x" * 50] * 200) + "]", [], "train = ["),
]


@pytest.mark.parametrize(("content", "overrides", "message"), [c[1:] for c in YAML_CASES],
                         ids=[c[0] for c in YAML_CASES])
def test_yaml_surprises_are_one_message_in_bounded_time(tmp_path, capsys, content, overrides, message):
    import time

    from pretrain.run import main

    recipe = TINY
    if content:
        recipe = tmp_path / "recipe.yaml"
        head = f"base: {TINY}\n"
        recipe.write_bytes(head.encode() + content if isinstance(content, bytes) else (head + content).encode())
    started = time.monotonic()
    assert main(["--recipe", str(recipe), "--dry-run", *overrides, f"output_dir={tmp_path / 'run'}"]) == 2
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err) < 2000, err


def test_whole_file_surprises(tmp_path):
    from pretrain.recipe.config import load_recipe

    for content, message in [(b"", "is empty"), (b"# only a comment\n", "is empty"),
                             (b"- a\n- b\n", "must be a YAML mapping of sections, got a list"),
                             (b"x" * (5 * 2**20), "is 5.0 MiB")]:
        (tmp_path / "r.yaml").write_bytes(content)
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_recipe(tmp_path / "r.yaml")


def test_yaml_that_is_only_unusual_still_loads(tmp_path):
    """A BOM, anchors reused a few times, and merge keys overridden by a later key are ordinary YAML."""
    from pretrain.recipe.config import load_recipe

    text = (f"base: {TINY}\noptim:\n  <<: {{weight_decay: 0.0, lr: 1.0e-3}}\n  lr: 2.0e-3\n"
            "lr_schedule: {warmup_steps: &w 5}\ntrain: {max_steps: 300}\nlogging: {every_steps: *w}\n")
    (tmp_path / "r.yaml").write_bytes(b"\xef\xbb\xbf" + text.encode())
    recipe = load_recipe(tmp_path / "r.yaml", ["optim.args={betas: [0.9, 0.95]}"])
    assert (recipe.optim.lr, recipe.optim.weight_decay, recipe.logging.every_steps) == (2e-3, 0.0, 5)


ACCELERATE_CASES = [
    ("num_processes: 2\nnum_processes: 4", "duplicate key 'num_processes'"),
    ("num_processes: .nan", "num_processes = 'nan' must be a whole number from 1"),
    (f"num_processes: {2**40}", "num_processes = '1099511627776' must be a whole number from 1"),
    ("num_processes: -2", "num_processes = '-2' must be a whole number from 1"),
    ("num_machines: two", "num_machines = 'two' must be a whole number from 1"),
    ("", "is empty"),
    ("- 1", "must be a YAML mapping, got a list"),
]


@pytest.mark.parametrize(("text", "message"), ACCELERATE_CASES, ids=[c[1] for c in ACCELERATE_CASES])
def test_malformed_accelerate_configs_are_one_message(tmp_path, capsys, text, message):
    from pretrain.run import main

    config = tmp_path / "accelerate.yaml"
    config.write_text(text if text in ("", "- 1") else f"distributed_type: MULTI_CPU\nuse_cpu: true\n{text}\n")
    assert main(["--recipe", TINY, "--dry-run", "--config_file", str(config), f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight(["--config_file", str(config)], ["--recipe", TINY, f"output_dir={tmp_path / 'run'}"])
