"""Recipe loading: inheritance, overrides, and the errors users see for bad recipes."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pretrain.errors import ConfigError
from pretrain.recipe.config import Recipe, apply_overrides, load_recipe

MINIMAL = """
batch: {global_batch_size: 8, micro_batch_size: 2}
train: {max_steps: 10}
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_minimal_recipe_gets_defaults_and_name_from_file(tmp_path, monkeypatch):
    monkeypatch.delenv("PRETRAIN_RUNS_DIR")  # the suite's own runs directory (tests/conftest.py)
    recipe = load_recipe(write(tmp_path / "mini.yaml", MINIMAL))
    assert recipe.name == "mini"
    assert recipe.output_dir == str(Path("runs") / "mini")
    monkeypatch.setenv("PRETRAIN_RUNS_DIR", str(tmp_path / "scratch"))
    assert load_recipe(write(tmp_path / "mini.yaml", MINIMAL)).output_dir == str(tmp_path / "scratch" / "mini")
    assert recipe.model.arch == "llama"
    assert recipe.optim.name == "AdamW"


def test_overrides_parse_yaml_scalars_and_lists(tmp_path):
    recipe = load_recipe(
        write(tmp_path / "r.yaml", MINIMAL),
        ["train.max_steps=40", "optim.lr=1e-3", "batch.micro_batch_size=4", "output_dir=/tmp/run1",
         "optim.args.betas=[0.9, 0.95]", "logging.backends=[jsonl, tensorboard]"],
    )
    assert recipe.train.max_steps == 40
    assert recipe.optim.lr == pytest.approx(1e-3)
    assert recipe.batch.micro_batch_size == 4
    assert recipe.output_dir == "/tmp/run1"
    assert recipe.optim.args["betas"] == [0.9, 0.95]
    assert recipe.logging.backends == ["jsonl", "tensorboard"]


def test_base_inheritance_deep_merges_and_chains(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "root.yaml", MINIMAL + "model: {hidden_size: 64, num_heads: 4}\noptim: {lr: 0.01}\n")
    write(tmp_path / "sub" / "mid.yaml", "base: ../root.yaml\nmodel: {num_layers: 3}\n")
    child = write(tmp_path / "child.yaml", "base: sub/mid.yaml\noptim: {weight_decay: 0.0}\n")
    recipe = load_recipe(child)
    assert (recipe.model.hidden_size, recipe.model.num_layers) == (64, 3)
    assert (recipe.optim.lr, recipe.optim.weight_decay) == (0.01, 0.0)
    assert recipe.name == "child"


def test_base_cycle_is_an_error_naming_the_chain(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n" + MINIMAL)
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"inheritance cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_recipe(tmp_path / "a.yaml")


def test_a_missing_base_names_the_recipe_that_asked_for_it(tmp_path):
    """Issue 36: a missing base: was "recipe file not found: .../tny.yaml", with no word of which recipe named it."""
    write(tmp_path / "tiny.yaml", MINIMAL)
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "child.yaml", "base: ../tny.yaml\n")
    with pytest.raises(ConfigError, match=r"child\.yaml: base: \.\./tny\.yaml names .*tny\.yaml, which does not "
                                          r"exist \(did you mean .*tiny\.yaml\?\)"):
        load_recipe(tmp_path / "sub" / "child.yaml")


def test_missing_file_suggests_the_closest(tmp_path):
    write(tmp_path / "tiny.yaml", MINIMAL)
    with pytest.raises(ConfigError, match=r"recipe file not found: .*tine\.yaml \(did you mean .*tiny\.yaml\?\)"):
        load_recipe(tmp_path / "tine.yaml")


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path / "bad.yaml", "batch: {global_batch_size: 8\ntrain: [\n")
    with pytest.raises(ConfigError, match=r"malformed YAML in .*bad\.yaml at line \d+"):
        load_recipe(path)


def test_unknown_key_suggests_closest_valid_key(tmp_path):
    path = write(tmp_path / "r.yaml", MINIMAL + "model: {hiden_size: 64}\n")
    with pytest.raises(ConfigError, match=r"unknown key 'model.hiden_size': did you mean 'model.hidden_size'\?"):
        load_recipe(path)


def test_unknown_section_and_override_key_are_errors(tmp_path):
    path = write(tmp_path / "r.yaml", MINIMAL)
    with pytest.raises(ConfigError, match=r"unknown key 'optimizer'.*did you mean 'optim'"):
        load_recipe(path, ["optimizer.lr=1"])
    with pytest.raises(ConfigError, match=r"unknown key 'train.max_step'.*did you mean 'train.max_steps'"):
        load_recipe(path, ["train.max_step=3"])


def test_wrong_type_names_key_and_value(tmp_path):
    path = write(tmp_path / "r.yaml", MINIMAL)
    with pytest.raises(ConfigError, match=r"model.num_layers = 'four'"):
        load_recipe(path, ["model.num_layers=four"])


def test_all_problems_reported_at_once(tmp_path):
    path = write(tmp_path / "r.yaml", MINIMAL + "model: {hiden_size: 64, num_layers: -1}\n")
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    assert len(info.value.problems) == 2
    assert "hiden_size" in str(info.value) and "num_layers" in str(info.value)


@pytest.mark.parametrize(
    "batch, message",
    [
        ("{global_batch_size: 8}", "give exactly one of batch.micro_batch_size and batch.gradient_accumulation_steps"),
        ("{global_batch_size: 8, micro_batch_size: 2, gradient_accumulation_steps: 2}", "give exactly one of"),
        ("{local_batch_size: 4, micro_batch_size: 2}", "batch.local_batch_size stands alone"),
        ("{micro_batch_size: 2}", "give batch.global_batch_size"),
    ],
)
def test_batch_section_combinations(tmp_path, batch, message):
    path = write(tmp_path / "r.yaml", f"batch: {batch}\ntrain: {{max_steps: 10}}\n")
    with pytest.raises(ConfigError, match=message):
        load_recipe(path)


def test_horizon_is_exactly_one_of_steps_and_tokens(tmp_path):
    path = write(tmp_path / "r.yaml", "batch: {local_batch_size: 2}\ntrain: {max_steps: 10, max_tokens: 100}\n")
    with pytest.raises(ConfigError, match="exactly one of train.max_steps and train.max_tokens"):
        load_recipe(path)


def test_heads_must_divide(tmp_path):
    path = write(tmp_path / "r.yaml", MINIMAL)
    with pytest.raises(ConfigError, match=r"model.hidden_size \(100\) must be divisible by model.num_heads \(3\)"):
        load_recipe(path, ["model.hidden_size=100", "model.num_heads=3"])


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        apply_overrides({}, ["train.max_steps"])


def test_recipe_is_frozen(tmp_path):
    recipe = load_recipe(write(tmp_path / "r.yaml", MINIMAL))
    with pytest.raises(ValidationError, match="frozen"):
        recipe.train = None  # type: ignore[misc]


def test_every_field_is_documented():
    """docs/recipe-reference.md is generated from these descriptions: none may be missing."""
    missing = []

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                walk(annotation, f"{prefix}{name}.")
            elif not field.description:
                missing.append(prefix + name)

    walk(Recipe, "")
    assert missing == []


def test_the_recipe_reference_page_is_generated_from_the_schema():
    """docs/recipe-reference.md is what tools/recipe_reference.py writes from the schema now."""
    from tools.recipe_reference import COMMAND, PAGE, page

    committed = PAGE.read_text() if PAGE.exists() else ""
    assert committed == page(), f"{PAGE.name} is not what the recipe schema gives: regenerate it with `{COMMAND}`"


@pytest.mark.parametrize("value, policy", [
    ("true", "full"), ("false", "none"), ("none", "none"), ("full", "full"), ("selective", "selective"),
    ("every_2", "every_2"), ("Every_4", "every_4"),
])
def test_activation_checkpointing_policies_and_old_booleans(tmp_path, value, policy):
    path = write(tmp_path / "r.yaml", MINIMAL)
    recipe = load_recipe(path, [f"model.activation_checkpointing={value}"])
    assert recipe.model.activation_checkpointing == policy  # the string is what the run config records
    assert recipe.model.model_dump()["activation_checkpointing"] == policy
    assert load_recipe(path).model.activation_checkpointing == "none"


@pytest.mark.parametrize("value", ["every_1", "every_0", "every_x", "sometimes", "2"])
def test_bad_activation_checkpointing_names_the_allowed_values(tmp_path, value):
    path = write(tmp_path / "r.yaml", MINIMAL)
    with pytest.raises(ConfigError, match=r"model.activation_checkpointing.*none, full, selective or every_N"):
        load_recipe(path, [f"model.activation_checkpointing={value}"])


@pytest.mark.parametrize("given, mode", [(None, "auto"), ("true", "regional"), ("false", "none"),
                                         ("regional", "regional"), ("full", "full"), ("none", "none")])
def test_model_compile_takes_a_mode_or_the_old_bool(tmp_path, given, mode):
    overrides = [] if given is None else [f"model.compile={given}"]
    recipe = load_recipe(write(tmp_path / "r.yaml", MINIMAL), overrides)
    assert recipe.model.compile == mode
    assert recipe.to_dict()["model"]["compile"] == mode  # the resolved recipe records the mode, not the bool


def test_model_compile_unknown_mode_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"model.compile = 'max'"):
        load_recipe(write(tmp_path / "r.yaml", MINIMAL), ["model.compile=max"])


# --- keys that moved to another section (config.MOVED_KEYS): refused with the new key, never renamed silently


def test_moved_keys_name_new_keys_of_the_schema_and_old_keys_it_refuses():
    """The table is checked against the schema: every new key exists and no old key is valid any more."""
    from pretrain.checkpoint.resume import recipe_field
    from pretrain.recipe.config import MOVED_KEYS

    for old, new in MOVED_KEYS.items():
        recipe_field(new)
        with pytest.raises(KeyError):
            recipe_field(old)


def test_moved_key_in_a_recipe_names_the_new_key_and_the_file(tmp_path):
    path = write(tmp_path / "foo.yaml", MINIMAL.replace("{max_steps: 10}", "{max_steps: 10, eval_every_steps: 5}")
                 + "runtime: {profile: {start_step: 2}, peak_tflops: 100}\n")
    with pytest.raises(ConfigError) as exc:
        load_recipe(path)
    assert exc.value.problems == [
        f"train.eval_every_steps moved to eval.every_steps in pretrain 0.2: rename it in {path}",
        f"runtime.peak_tflops moved to logging.peak_tflops in pretrain 0.2: rename it in {path}",
        f"runtime.profile moved to profile in pretrain 0.2: rename it in {path}",
    ]


def test_moved_key_in_an_inherited_recipe_names_that_file(tmp_path):
    base = write(tmp_path / "base.yaml", MINIMAL.replace("{max_steps: 10}", "{max_steps: 10, log_every_steps: 1}"))
    child = write(tmp_path / "child.yaml", "base: base.yaml\noptim: {lr: 1.0e-3}\n")
    with pytest.raises(ConfigError, match=r"^train\.log_every_steps moved to logging\.every_steps in pretrain 0\.2: "
                       rf"rename it in {base.resolve()}$"):
        load_recipe(child)


@pytest.mark.parametrize("override, message", [
    ("train.eval_every_steps=5", "train.eval_every_steps moved to eval.every_steps in pretrain 0.2: rename it in the "
                                 "override 'train.eval_every_steps=5' (eval.every_steps=5)"),
    ("runtime.profile.start_step=2", "runtime.profile.start_step moved to profile.start_step in pretrain 0.2: rename "
                                     "it in the override 'runtime.profile.start_step=2' (profile.start_step=2)"),
])
def test_moved_key_in_an_override_names_the_new_key(tmp_path, override, message):
    with pytest.raises(ConfigError) as exc:
        load_recipe(write(tmp_path / "r.yaml", MINIMAL), [override])
    assert str(exc.value) == message


def test_new_keys_load_and_unknown_keys_in_new_sections_are_still_refused(tmp_path):
    path = write(tmp_path / "r.yaml", MINIMAL + "eval: {every_steps: 5, batches: 2, at_start: false}\n"
                 "logging: {every_steps: 3, peak_tflops: 100, throughput_warmup_steps: 2}\nprofile: {start_step: 4}\n")
    recipe = load_recipe(path)
    assert (recipe.eval.every_steps, recipe.eval.batches, recipe.eval.at_start) == (5, 2, False)
    assert (recipe.logging.every_steps, recipe.logging.peak_tflops, recipe.logging.throughput_warmup_steps) == (3, 100, 2)
    assert recipe.profile.start_step == 4
    with pytest.raises(ConfigError, match=r"unknown key 'eval\.every_step': did you mean 'eval\.every_steps'\?"):
        load_recipe(path, ["eval.every_step=1"])


def test_a_recorded_recipe_of_an_older_pretrain_is_renamed_not_refused(tmp_path):
    """A checkpoint's recipe is nobody's to edit: resume compares it, and export validates it, after renaming."""
    from pretrain.checkpoint.resume import check_compatible
    from pretrain.recipe.config import renamed_keys

    new = load_recipe(write(tmp_path / "r.yaml", MINIMAL), ["eval.batches=3", "profile.start_step=2"]).to_dict()
    old = {**new, "train": {**new["train"], "eval_batches": 3}, "runtime": {**new["runtime"], "profile": new["profile"]},
           "eval": {k: v for k, v in new["eval"].items() if k != "batches"}}
    del old["profile"]
    assert renamed_keys(old) == new
    assert check_compatible(tmp_path, old, new) == []
    Recipe.model_validate(renamed_keys(old))
