"""Every shipped recipe loads, builds on the meta device, and has the parameter count it claims."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pretrain.model.build import build_model, closed_form_num_params, count_parameters, resolve_vocab_size
from pretrain.recipe.config import load_recipe
from tests.helpers import shipped_recipe

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))

# Published counts (Llama 2 model cards) and the counts the recipes state in their comments.
EXPECTED_NUM_PARAMS = {
    "7b": 6_738_415_616,
    "13b": 13_015_864_320,
    "70b": 68_976_648_192,
    "llama-1b": 1_235_814_400,  # = Llama-3.2-1B
    "gpt2-124m": 124_475_904,  # GPT-2 small with the vocabulary padded to 50,304
    "continue-qwen3-1.7b": 1_720_574_976,  # Qwen3-1.7B from its config.json (tests/assets), tied embedding once
    "qwen3-30b-a3b": 30_532_122_624,  # Qwen/Qwen3-30B-A3B's 30.5B (heads of 128: model.head_dim)
}


def build(recipe):
    """Meta-build the recipe's model; a null model.vocab_size comes from its (untrained) tokenizer's size."""
    tokenizer_size = recipe.data.tokenizer_vocab_size if recipe.model.vocab_size is None else None
    vocab_size = resolve_vocab_size(recipe.model, tokenizer_size)
    start = time.perf_counter()
    model = build_model(recipe.model, vocab_size, recipe.data.seq_len, seed=recipe.train.seed, meta=True)
    return model, vocab_size, time.perf_counter() - start


def test_recipes_exist():
    assert {p.stem for p in RECIPES} >= set(EXPECTED_NUM_PARAMS)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_builds_with_its_closed_form_parameter_count(path):
    recipe = shipped_recipe(path)
    model, vocab_size, seconds = build(recipe)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert seconds < 10, f"meta build of {path.name} took {seconds:.1f} s"
    assert count_parameters(model) == closed_form_num_params(recipe.model, vocab_size, recipe.data.seq_len)
    if recipe.name in EXPECTED_NUM_PARAMS:
        assert count_parameters(model) == EXPECTED_NUM_PARAMS[recipe.name]


def test_larger_llama2_recipes_inherit_the_7b_run():
    base = load_recipe(RECIPES[0].parent / "7b.yaml")
    for name in ("13b", "70b"):
        recipe = load_recipe(RECIPES[0].parent / f"{name}.yaml")
        assert recipe.name == name
        assert (recipe.data, recipe.batch, recipe.train, recipe.precision) == (
            base.data, base.batch, base.train, base.precision
        )
        assert recipe.model.activation_checkpointing == "full" and recipe.model.norm_eps == 1e-5


# Each large recipe's activation checkpointing is the cheapest policy that fits its documented target (the
# command in its comment): (recipe, estimate arguments, policies that must not fit, the recipe's policy).
CHECKPOINTING_CHOICES = [
    ("7b", ["--accelerate-config", "accelerate_configs/zero3.yaml", "--num-gpus", "8"], [], "none"),
    ("7b", ["--accelerate-config", "accelerate_configs/fsdp.yaml", "--num-gpus", "8"], [], "none"),
    ("llama-1b", ["--accelerate-config", "accelerate_configs/zero3.yaml", "--num-gpus", "8"], [], "none"),
    ("13b", ["--accelerate-config", "accelerate_configs/fsdp.yaml", "--num-gpus", "8"],
     ["none", "selective", "every_2"], "full"),
    ("70b", ["--zero", "3", "--nodes", "4", "--gpus-per-node", "8"], ["none", "selective", "every_2"], "full"),
]


@pytest.mark.parametrize("name, layout, too_big, policy", CHECKPOINTING_CHOICES,
                         ids=[f"{c[0]}-{c[1][1]}" for c in CHECKPOINTING_CHOICES])
def test_recipe_checkpointing_is_the_cheapest_that_fits(capsys, name, layout, too_big, policy):
    import json

    from pretrain.cli.estimate import main as estimate

    recipe = RECIPES[0].parent / f"{name}.yaml"
    assert load_recipe(recipe).model.activation_checkpointing == policy

    def fits(*extra: str) -> bool:
        assert estimate(["--recipe", str(recipe), *layout, "--gpu", "H100-80GB", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["fits"]

    assert fits()
    for cheaper in too_big:
        assert not fits("--activation-checkpointing", cheaper), cheaper
