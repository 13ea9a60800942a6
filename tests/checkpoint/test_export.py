"""The tokenizer and the vocabulary are one fact, and an exported model is used as it was trained: a recipe
with its own tokenizer.json is sized from it without model.vocab_size; the export's AutoTokenizer gives the
training ids on the validation sample (or the export is refused, naming the difference); the exported config
carries bos/eos/pad and the KV cache, and generation stops at the EOS."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import FAST, ROOT, env, make_recipe, train_here, write_tokenizer_json

QWEN2 = ["model.arch=qwen2", "data.source=stdlib:json", "data.val_fraction=0.3"]


@pytest.fixture(scope="module")
def qwen2_tokenizer(tmp_path_factory):
    return write_tokenizer_json(tmp_path_factory.mktemp("tok") / "tokenizer.json", "qwen2")


@pytest.fixture(scope="module")
def qwen2_run(tmp_path_factory, qwen2_tokenizer):
    """A 2-step qwen2 run on its own tokenizer.json, with its final model and the step-2 checkpoint."""
    out = tmp_path_factory.mktemp("qwen2") / "run"
    _, trainer, console = train_here([*FAST, *QWEN2, f"data.tokenizer={qwen2_tokenizer}", "train.max_steps=2",
                                      "checkpoint.every_steps=2", "eval.every_steps=2", f"output_dir={out}"])
    return out, (console, trainer.parts.memory.total_gib)


def training_tokenizer(path):
    from pretrain.data import build_tokenizer
    from pretrain.recipe.config import DataConfig

    return build_tokenizer(DataConfig(tokenizer=str(path)), log=lambda _: None)


def test_a_recipe_with_its_own_tokenizer_json_is_estimated_from_it(qwen2_tokenizer):
    from pretrain.recipe.shape import ModelShape, round_vocab

    num_tokens = len(training_tokenizer(qwen2_tokenizer))
    recipe = make_recipe(*FAST, *QWEN2, f"data.tokenizer={qwen2_tokenizer}")
    assert recipe.model.vocab_size is None
    assert ModelShape.from_recipe(recipe).vocab_size == round_vocab(num_tokens) == 512  # as the run rounds it
    proc = subprocess.run([sys.executable, "-m", "pretrain.cli.estimate", "--recipe", str(ROOT / "recipes/tiny.yaml"),
                           *FAST, *QWEN2, f"data.tokenizer={qwen2_tokenizer}", "--gpu", "H100-80GB", "--num-gpus", "1"],
                          capture_output=True, text=True, env=env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "vocab_size" not in proc.stderr and "GiB" in proc.stdout


def test_a_hub_tokenizer_is_sized_from_the_local_cache_and_never_downloaded(tmp_path, monkeypatch, qwen2_tokenizer):
    import huggingface_hub.constants

    from pretrain.errors import ConfigError
    from pretrain.recipe.shape import ModelShape

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # the cache's own layout:
    snapshot = tmp_path / "models--some-org--some-tokenizer" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    (snapshot / "tokenizer.json").write_bytes(qwen2_tokenizer.read_bytes())
    assert ModelShape.from_recipe(make_recipe(*FAST, "data.tokenizer=some-org/some-tokenizer")).vocab_size == 512
    with pytest.raises(ConfigError, match=r"not on this machine .*pretrain-prepare-data.*model\.vocab_size=N"):
        ModelShape.from_recipe(make_recipe(*FAST, "data.tokenizer=some-org/not-downloaded"))


def test_the_exported_qwen2_model_loads_its_training_tokenizer_and_stops_at_eos(qwen2_run, qwen2_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

    from pretrain.data import sample_val_texts
    from pretrain.recipe.config import load_recipe

    out, (console, estimated_gib) = qwen2_run
    # the tokenizer's vocabulary was enough for the run's own memory estimate
    assert estimated_gib is not None and "no memory estimate" not in console, console
    final = out / "final_model"
    config = json.loads((final / "config.json").read_text())
    tokenizer = training_tokenizer(qwen2_tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (eos, eos, None)
    assert config["use_cache"] is True
    assert json.loads((final / "generation_config.json").read_text())["eos_token_id"] == eos

    recipe = load_recipe(str(ROOT / "recipes/tiny.yaml"), [*FAST, *QWEN2, f"data.tokenizer={qwen2_tokenizer}"])
    texts = sample_val_texts(recipe.data)
    loaded = AutoTokenizer.from_pretrained(final)
    assert len(texts) >= 2
    assert loaded(texts, add_special_tokens=False)["input_ids"] == [
        e.ids for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]

    class EosAtThirdToken(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == prompt.shape[1] + 2:
                scores[:, eos] = scores.max() + 100.0
            return scores

    model = AutoModelForCausalLM.from_pretrained(final)
    prompt = loaded("import json\n", return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=20, do_sample=False,
                                   logits_processor=[EosAtThirdToken()])
    assert generated.shape[1] == prompt.shape[1] + 3 and generated[0, -1].item() == eos  # stopped at its EOS


def test_pretrain_export_writes_the_same_verified_model(qwen2_run, tmp_path):
    from pretrain.cli.export import export

    out, _ = qwen2_run
    export(out / "checkpoints" / "step_00000002", tmp_path / "exported", log=lambda _: None)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert json.loads((tmp_path / "exported" / name).read_text()) == json.loads(
            (out / "final_model" / name).read_text()), name


def test_a_tokenizer_autotokenizer_would_change_is_refused_naming_the_first_difference(tmp_path):
    from pretrain.data import sample_val_texts
    from pretrain.errors import ConfigError
    from pretrain.model.build import hf_config
    from pretrain.model.export_checks import check_tokenizer_round_trip

    gpt2_style = write_tokenizer_json(tmp_path / "tokenizer.json", "gpt2")
    recipe = make_recipe(*FAST, *QWEN2, f"data.tokenizer={gpt2_style}")
    tokenizer = training_tokenizer(gpt2_style)
    texts = sample_val_texts(recipe.data)
    with pytest.raises(ConfigError, match=r"exported qwen2 model would not load its training tokenizer: AutoTokenizer "
                                          r"loads a Qwen2Tokenizer .* document 0 .* training ids \[.*\], loaded ids"):
        check_tokenizer_round_trip(hf_config(recipe.model, 512, 64), tokenizer, texts)
    # The same tokenizer under llama: AutoTokenizer keeps tokenizer.json as it is.
    llama = make_recipe(*FAST, f"data.tokenizer={gpt2_style}")
    check_tokenizer_round_trip(hf_config(llama.model, 512, 64), tokenizer, texts)
