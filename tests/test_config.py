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


def test_minimal_recipe_gets_defaults_and_name_from_file(tmp_path):
    recipe = load_recipe(write(tmp_path / "mini.yaml", MINIMAL))
    assert recipe.name == "mini"
    assert recipe.output_dir == str(Path("runs") / "mini")
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
    """The README's recipe reference is generated from these descriptions: none may be missing."""
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


def test_readme_recipe_reference_is_up_to_date():
    """README's key reference is generated from the schema; regenerate with tools/recipe_reference.py --write."""
    from tools.recipe_reference import render_readme

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert render_readme(readme) == readme


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
