"""Model building: vocabulary, config mapping and its errors, layout-independent init, meta builds."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pretrain.errors import ConfigError
from pretrain.model.build import (
    build_model,
    closed_form_num_params,
    count_parameters,
    hf_config,
    init_weights,
    resolve_vocab_size,
)
from pretrain.recipe.config import ModelConfig
from pretrain.recipe.shape import ModelShape

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
VOCAB, SEQ = 128, 16


def small(**changes) -> ModelConfig:
    return ModelConfig(**{**SMALL, **changes})


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- vocabulary ------------------------------------------------------------------------------------


def test_vocab_from_tokenizer_is_rounded_up_to_64():
    assert resolve_vocab_size(small(vocab_size=None), 50257) == 50304
    assert resolve_vocab_size(small(vocab_size=None), 4096) == 4096


def test_explicit_vocab_wins_if_it_holds_the_tokenizer():
    assert resolve_vocab_size(small(vocab_size=32000), 32000) == 32000
    assert resolve_vocab_size(small(vocab_size=50304), 50257) == 50304
    assert resolve_vocab_size(small(vocab_size=1000), None) == 1000


def test_vocab_errors_name_both_sizes():
    with pytest.raises(ConfigError, match=r"model.vocab_size \(1000\).*tokenizer's vocabulary \(50257\)"):
        resolve_vocab_size(small(vocab_size=1000), 50257)
    with pytest.raises(ConfigError, match="model.vocab_size is null and there is no tokenizer"):
        resolve_vocab_size(small(vocab_size=None), None)


# --- config mapping --------------------------------------------------------------------------------


def test_llama_config_mapping_with_gqa():
    cfg = hf_config(small(rope_theta=5e5, norm_eps=1e-5, init_std=0.01, tie_embeddings=True), VOCAB, SEQ)
    assert cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (32, 2, 4)
    assert cfg.num_key_value_heads == 2
    assert (cfg.intermediate_size, cfg.head_dim, cfg.vocab_size) == (64, 8, VOCAB)
    assert cfg.max_position_embeddings == SEQ  # null = data.seq_len
    assert cfg.rope_parameters["rope_theta"] == 5e5
    assert (cfg.rms_norm_eps, cfg.initializer_range, cfg.tie_word_embeddings) == (1e-5, 0.01, True)
    assert cfg.use_cache is False


def test_null_fields_keep_defaults_and_kv_heads_default_to_heads():
    cfg = hf_config(small(num_kv_heads=None, max_position_embeddings=64), VOCAB, SEQ)
    assert cfg.num_key_value_heads == 4
    assert cfg.max_position_embeddings == 64
    assert cfg.rope_parameters["rope_theta"] == 10000.0  # llama's default
    # mistral's own default is 8 kv heads: null must still mean num_heads, not the arch default
    assert hf_config(small(arch="mistral", num_kv_heads=None), VOCAB, SEQ).num_key_value_heads == 4


def test_gpt2_config_mapping():
    model_cfg = ModelConfig(arch="gpt2", hidden_size=48, num_layers=3, num_heads=4, norm_eps=1e-4, tie_embeddings=True)
    cfg = hf_config(model_cfg, VOCAB, SEQ)
    assert (cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_positions, cfg.n_inner) == (48, 3, 4, SEQ, None)
    assert (cfg.layer_norm_epsilon, cfg.tie_word_embeddings, cfg.initializer_range) == (1e-4, True, 0.02)
    assert hf_config(model_cfg.model_copy(update={"intermediate_size": 100}), VOCAB, SEQ).n_inner == 100


def test_default_token_ids_past_the_vocabulary_are_dropped():
    """Phi-3's default pad id (32000) cannot build a 128-token embedding; GPT-2's eos (50256) is no token here."""
    phi3 = hf_config(small(arch="phi3"), VOCAB, SEQ)
    assert (phi3.bos_token_id, phi3.eos_token_id, phi3.pad_token_id) == (1, None, None)
    gpt2 = hf_config(small(arch="gpt2", num_kv_heads=None, intermediate_size=None), VOCAB, SEQ)
    assert (gpt2.bos_token_id, gpt2.eos_token_id) == (None, None)
    build_model(small(arch="phi3"), VOCAB, SEQ, seed=0, meta=True)
    assert hf_config(small(arch="phi3", config_overrides={"pad_token_id": 5}), VOCAB, SEQ).pad_token_id == 5


def test_config_overrides_are_applied_last():
    overrides = {"hidden_act": "gelu", "num_key_value_heads": 1, "use_cache": True}
    cfg = hf_config(small(config_overrides=overrides), VOCAB, SEQ)
    assert (cfg.hidden_act, cfg.num_key_value_heads, cfg.use_cache) == ("gelu", 1, True)


def test_unknown_arch_suggests_causal_lm_types():
    with pytest.raises(ConfigError, match=r"model.arch = 'lama' is not a transformers model .* did you mean llama"):
        hf_config(small(arch="lama"), VOCAB, SEQ)
    with pytest.raises(ConfigError, match="causal-LM head; valid types include llama, mistral, qwen2, gpt2"):
        hf_config(small(arch="t5"), VOCAB, SEQ)  # a real model type, but an encoder-decoder


def test_bad_override_keys_are_all_reported_with_close_matches():
    model_cfg = ModelConfig(arch="gpt2", config_overrides={"resid_drop": 0.0, "n_embed": 64})
    with pytest.raises(ConfigError) as err:
        hf_config(model_cfg, VOCAB, SEQ)
    message = str(err.value)
    assert "config_overrides.resid_drop is not an attribute of the gpt2 config; did you mean resid_pdrop" in message
    assert "config_overrides.n_embed is not an attribute of the gpt2 config; did you mean n_embd" in message


def test_override_with_a_wrong_type_is_a_config_error():
    with pytest.raises(ConfigError, match="transformers rejects the config.*hidden_act"):
        hf_config(small(config_overrides={"hidden_act": 3}), VOCAB, SEQ)


def test_fields_the_arch_cannot_hold_are_errors():
    with pytest.raises(ConfigError, match="model.num_kv_heads = 2, but the gpt2 config has no grouped-query attention"):
        hf_config(ModelConfig(arch="gpt2", num_heads=4, num_kv_heads=2), VOCAB, SEQ)
    with pytest.raises(ConfigError, match="model.rope_theta = 10000.0, but the gpt2 config has no rotary"):
        hf_config(ModelConfig(arch="gpt2", rope_theta=1e4), VOCAB, SEQ)
    hf_config(ModelConfig(arch="gpt2", num_heads=4, num_kv_heads=4), VOCAB, SEQ)  # = multi-head: fine


def test_llama_needs_intermediate_size():
    with pytest.raises(ConfigError, match="model.intermediate_size is required for arch llama .*11008"):
        hf_config(small(intermediate_size=None), VOCAB, SEQ)


def test_positions_must_cover_seq_len():
    with pytest.raises(ConfigError, match=r"model.max_position_embeddings \(8\) is shorter than data.seq_len \(16\)"):
        hf_config(small(max_position_embeddings=8), VOCAB, SEQ)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_unavailable_attention_kernel_is_a_config_error():
    with pytest.raises(ConfigError, match="model.attention = flash_attention_2 cannot be used here"):
        build_model(small(attention="flash_attention_2"), VOCAB, SEQ, seed=0)


# --- init ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_init_depends_only_on_the_seed(arch):
    model_cfg = small() if arch == "llama" else ModelConfig(arch="gpt2", hidden_size=32, num_layers=2, num_heads=4)
    first = weights(build_model(model_cfg, VOCAB, SEQ, seed=1))
    torch.manual_seed(999)  # a different global RNG state must not matter
    torch.rand(1000)
    again = weights(build_model(model_cfg, VOCAB, SEQ, seed=1))
    other = weights(build_model(model_cfg, VOCAB, SEQ, seed=2))
    assert first.keys() == again.keys() == other.keys()
    for key, value in first.items():
        assert torch.equal(value, again[key]), key
        if value.std() > 0:  # constant tensors (norm weights = 1, biases = 0) are the same for every seed
            assert not torch.equal(value, other[key]), key


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3_moe", "gpt_neox", "phi3"])
def test_init_on_threads_draws_the_one_thread_values_bit_for_bit(arch, monkeypatch):
    """The decoder layers are drawn on several threads at once (start-up: a CPU normal_ is one sequential stream),
    each module from its own generator: the same values as one thread, GPT-2's parent rule (c_proj rescaled after
    its child's draw) and MoE experts included, whatever the global generator does meanwhile."""
    from pretrain.model import build

    plain = arch in ("gpt2", "gpt_neox")
    extra = ({"moe": {"num_experts": 4, "experts_per_token": 2, "expert_intermediate_size": 48},
              "intermediate_size": None} if arch == "qwen3_moe" else {})
    cfg = small(arch=arch, num_layers=4, **({"num_kv_heads": None} if plain else {}), **extra,
                **({"config_overrides": {"pad_token_id": None}} if arch == "phi3" else {}))
    model = build_model(cfg, VOCAB, SEQ, seed=11)
    assert len(build._repeated_blocks(model)) == 4
    one = weights(model)
    calls, draws = [], []
    real, draw = build._draw_blocks, build._draw
    monkeypatch.setattr(build, "_draw_blocks", lambda *a: calls.append(a[-1]) or real(*a))
    monkeypatch.setattr(build, "_draw", lambda model, name, *a: draws.append(name) or draw(model, name, *a))
    for param in model.parameters():
        param.data.fill_(float("nan"))
    init_weights(model, seed=11, threads=3)
    assert calls == [3]  # the threaded path ran, each module drawn once (no fallback to one thread)
    assert sorted(draws) == sorted(name for name, _ in model.named_modules())
    for key, value in weights(model).items():
        assert torch.equal(value, one[key]), key


def test_a_rule_that_draws_from_the_global_generator_on_threads_is_drawn_again_in_order(monkeypatch):
    """A draw _OwnGenerator does not route (here torch.rand_like, which takes no generator) would race on the
    process-wide generator: the changed default state shows it, and the blocks are drawn again one at a time."""
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    model = build_model(small(num_layers=3), VOCAB, SEQ, seed=4)
    real = LlamaPreTrainedModel._init_weights

    def with_global_draw(self, module):
        real(self, module)
        if isinstance(module, torch.nn.Linear):
            module.weight.add_(torch.rand_like(module.weight) * 1e-3)

    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", with_global_draw)
    init_weights(model, seed=4, threads=1)
    one = weights(model)
    init_weights(model, seed=4, threads=3)
    for key, value in weights(model).items():
        assert torch.equal(value, one[key]), key


def test_init_threads_share_the_node_between_its_processes(monkeypatch):
    from pretrain.model.build import init_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert init_threads(32) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert init_threads(32) == 16 and init_threads(4) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert init_threads(32) == 1


def test_init_weights_redraws_tensors_transformers_marks_as_loaded():
    model = build_model(small(), VOCAB, SEQ, seed=3)
    expected = weights(model)
    for param in model.parameters():
        param.data.zero_()
        param._is_hf_initialized = True
    init_weights(model, seed=3)
    for key, value in weights(model).items():
        assert torch.equal(value, expected[key]), key


def test_init_of_a_layer_does_not_depend_on_the_depth():
    shallow = weights(build_model(small(num_layers=2), VOCAB, SEQ, seed=5))
    deep = weights(build_model(small(num_layers=3), VOCAB, SEQ, seed=5))
    assert set(shallow) < set(deep)
    for key, value in shallow.items():
        assert torch.equal(value, deep[key]), key


def test_init_follows_transformers_rules():
    llama = build_model(small(init_std=0.05), VOCAB, SEQ, seed=0)
    layer = llama.model.layers[0]
    assert layer.mlp.gate_proj.weight.std().item() == pytest.approx(0.05, rel=0.15)
    assert torch.all(layer.input_layernorm.weight == 1)
    gpt2 = build_model(ModelConfig(arch="gpt2", hidden_size=64, num_layers=8, num_heads=4), VOCAB, SEQ, seed=0)
    block = gpt2.transformer.h[0]
    assert block.mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    # the parent's rule (0.02 / sqrt(2 x layers)) runs after the child's plain 0.02: children first
    assert block.attn.c_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.1)
    assert torch.all(block.attn.c_attn.bias == 0)


@pytest.mark.parametrize(
    "model_cfg",
    [
        small(),
        small(tie_embeddings=True),
        small(arch="qwen2"),
        ModelConfig(arch="gpt2", hidden_size=32, num_layers=2, num_heads=4),
        ModelConfig(arch="gpt_neox", hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64),
    ],
    ids=["llama", "llama-tied", "qwen2", "gpt2", "gpt_neox"],
)
def test_meta_build_equals_an_eager_build_redrawn(model_cfg):
    """The meta build allocates and draws each tensor once; it must give what building every tensor on CPU
    (transformers' construction-time init included) and re-drawing it with init_weights gives, buffers too."""
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_config(hf_config(model_cfg, VOCAB - 1, SEQ), dtype=torch.float32)
    eager.tie_weights()
    init_weights(eager, seed=4)
    built = build_model(model_cfg, VOCAB - 1, SEQ, seed=4)  # an odd vocabulary: shards are uneven elsewhere
    expected = weights(eager)
    assert weights(built).keys() == expected.keys()
    for key, value in weights(built).items():
        assert torch.equal(value, expected[key]), key
    assert {p.device.type for p in built.parameters()} == {"cpu"}


def test_a_parameter_the_architecture_does_not_init_is_an_error(monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    rule = LlamaPreTrainedModel._init_weights

    def skip_norms(self, module):
        if "RMSNorm" not in type(module).__name__:
            rule(self, module)

    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", skip_norms)
    with pytest.raises(ConfigError, match=r"does not initialise model.layers.0.input_layernorm.weight"):
        build_model(small(), VOCAB, SEQ, seed=0)


@pytest.mark.parametrize("meta", [False, True])
def test_tied_embeddings_stay_tied(meta):
    model = build_model(small(tie_embeddings=True), VOCAB, SEQ, seed=0, meta=meta)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert count_parameters(model) == closed_form_num_params(small(tie_embeddings=True), VOCAB, SEQ)
    untied = build_model(small(), VOCAB, SEQ, seed=0, meta=meta)
    assert count_parameters(untied) == count_parameters(model) + VOCAB * 32


@pytest.mark.floors
def test_activation_checkpointing_recomputes_blocks_in_backward():
    """Forward runs of each block (a hook on its attention module, the block's first sub-module: torch stops a
    recompute early once backward has what it needs): 2 for a checkpointed block, 1 for the others. every_2
    checkpoints blocks 0 and 2 of 3; selective recomputes every block (its cheap ops); names do not change."""
    def attention_forwards(policy):
        model_cfg = small(num_layers=3, activation_checkpointing=policy)
        model = build_model(model_cfg, VOCAB, SEQ, seed=0)
        model.train()
        calls = [0] * model_cfg.num_layers
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        ids = torch.randint(0, VOCAB, (2, SEQ))
        model(input_ids=ids, labels=ids).loss.backward()
        return model, calls

    names = [name for name, _ in build_model(small(num_layers=3), VOCAB, SEQ, seed=0).named_modules()]
    expected = {"none": [1, 1, 1], "full": [2, 2, 2], "every_2": [2, 1, 2], "selective": [2, 2, 2]}
    for policy, calls in expected.items():
        model, counted = attention_forwards(policy)
        # transformers' per-block flag (its is_activation_checkpointing property is 5.23+; the floor is older)
        checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        assert (checkpointing, counted) == (policy != "none", calls), policy
        assert [name for name, _ in model.named_modules()] == names
    assert attention_forwards(True)[1] == expected["full"]  # old recipes: true = full


@pytest.mark.floors
def test_selective_checkpointing_under_regional_compile_recomputes_no_matmul():
    """Regional compile (each block ``module.compile()``d in place, as a GPU run's default): the backward's
    matmuls, counted by torch's profiler in the compiled code, and the bytes the forward saves for it. Selective
    keeps every matmul's output, so its backward runs none's matmuls (full's recomputes the forward's) and it
    saves less than none and more than full. On transformers 5.17-5.22, whose layers checkpoint outside the
    compiled forward, selective replayed each whole compiled block: 60 matmuls here, more than full's."""
    from pretrain.distributed.accelerator import compile_in_place
    from pretrain.distributed.layout import Launch

    matmuls = {"aten::mm", "aten::addmm", "aten::bmm"}

    def backward(policy):
        torch._dynamo.reset()
        model = build_model(small(activation_checkpointing=policy), VOCAB, 64, seed=0)
        model.train()
        compile_in_place(model, "regional", Launch("ddp"))
        ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()  # compiles
        saved = [0]

        def pack(tensor):
            saved[0] += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(input_ids=ids, labels=ids).loss
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            loss.backward()
        return sum(event.count for event in profile.key_averages() if event.key in matmuls), saved[0]

    (none_mm, none_saved), (full_mm, full_saved), (sel_mm, sel_saved) = map(backward, ("none", "full", "selective"))
    assert full_mm > none_mm  # the checkpoint is live: full recomputes the forward's matmuls
    assert sel_mm == none_mm, f"selective recomputed {sel_mm - none_mm} matmuls under regional compile"
    assert full_saved < sel_saved < none_saved


@pytest.mark.floors
def test_every_policy_trains_to_the_same_losses():
    """The tiny recipe's model (fp32) trained 3 AdamW steps under each policy: the per-step losses of
    no checkpointing, to 1e-6 relative (recomputation replays the same ops on the same inputs)."""
    from pretrain.recipe.config import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "tiny.yaml")
    vocab, seq_len = 4096, 32
    # one batch, seen every step: the loss must fall (the policies are compared on a model that learns)
    batches = torch.randint(0, vocab, (2, seq_len + 1), generator=torch.Generator().manual_seed(0)).expand(3, -1, -1)

    def losses(policy: str) -> list[float]:
        model_cfg = recipe.model.model_copy(update={"activation_checkpointing": policy})
        model = build_model(model_cfg, vocab, seq_len, seed=recipe.train.seed)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.optim.lr, betas=(0.9, 0.95), weight_decay=0.1)
        out = []
        for batch in batches:
            loss = model(input_ids=batch[:, :-1], labels=batch[:, 1:], shift_labels=batch[:, 1:]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        return out

    reference = losses("none")
    assert reference[-1] < reference[0]  # it trains
    for policy in ("full", "every_2", "selective"):
        assert losses(policy) == pytest.approx(reference, rel=1e-6), policy


def test_meta_build_allocates_nothing_and_is_fast():
    big = ModelConfig(hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=11008)
    start = time.perf_counter()
    model = build_model(big, 32000, 4096, seed=0, meta=True)
    assert time.perf_counter() - start < 10
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert count_parameters(model) == 6_738_415_616


@pytest.mark.parametrize(
    "model_cfg",
    [
        small(config_overrides={"attention_bias": True}),
        small(config_overrides={"mlp_bias": True, "head_dim": 16}),
        small(arch="mistral"),
        small(arch="qwen2"),  # biases on q/k/v only
        ModelConfig(arch="gpt2", hidden_size=32, num_layers=2, num_heads=4, intermediate_size=80),
    ],
    ids=["llama-attention-bias", "llama-mlp-bias-head-dim", "mistral", "qwen2", "gpt2-untied"],
)
def test_closed_form_matches_the_built_model(model_cfg):
    model = build_model(model_cfg, VOCAB, SEQ, seed=0, meta=True)
    assert count_parameters(model) == closed_form_num_params(model_cfg, VOCAB, SEQ)


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_recipe_shape_without_transformers_equals_the_built_configs(path):
    """The estimator's and planner's shape (the recipe section, no transformers) is the shape of the config
    transformers builds: one constructor, two inputs."""
    from pretrain.recipe.shape import ModelShape, recipe_vocab_size
    from tests.helpers import shipped_recipe

    recipe = shipped_recipe(path)
    vocab = recipe_vocab_size(recipe.model, recipe.data)
    built = ModelShape.from_hf_config(hf_config(recipe.model, vocab, recipe.data.seq_len), source="model")
    assert ModelShape.from_recipe(recipe) == built


# Every architecture with a closed form beyond the Llama family: GQA, and a head size other than hidden / heads
# where the config has one (qwen3's and gemma's defaults, 128 and 256, are not 32 / 4 either).
COUNTED_CASES = {
    "qwen3": small(arch="qwen3", head_dim=16),
    "qwen3-default-head": small(arch="qwen3"),
    "gemma-tied": small(arch="gemma", head_dim=16, tie_embeddings=True),
    "gemma-default-head": small(arch="gemma"),
    "olmo": small(arch="olmo"),
    "olmo2": small(arch="olmo2"),
    "phi3": small(arch="phi3", config_overrides={"pad_token_id": None}),  # its default pad id is 32000
    "gpt_neox": small(arch="gpt_neox", num_kv_heads=None),
    "gpt_neox-no-attention-bias": small(arch="gpt_neox", num_kv_heads=None, config_overrides={"attention_bias": False}),
}


@pytest.mark.parametrize("case", list(COUNTED_CASES))
def test_closed_form_matches_every_counted_architecture(case):
    """The closed form from the recipe section alone (no transformers) counts the meta-built model exactly."""
    model_cfg = COUNTED_CASES[case]
    model = build_model(model_cfg, VOCAB, SEQ, seed=0, meta=True)
    assert count_parameters(model) == closed_form_num_params(model_cfg, VOCAB, SEQ)
    assert ModelShape.from_model_config(model_cfg, VOCAB, SEQ) == ModelShape.from_hf_config(model.config)


def test_qwen3_head_dim_gives_the_count_the_closed_form_predicts():
    """model.head_dim sizes qwen3's heads (null: hidden / heads, not transformers' fixed 128): embeddings
    4096 x 384 (tied) + 6 x (q, o 384 x 384, k, v 384 x 128, MLP 3 x 384 x 1024, 2 norms 384, q/k norms 64) + 384."""
    model_cfg = ModelConfig(arch="qwen3", hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2,
                            intermediate_size=1024, head_dim=64, tie_embeddings=True)
    model = build_model(model_cfg, 4096, 256, seed=0, meta=True)
    assert model.config.head_dim == 64
    assert count_parameters(model) == ModelShape.from_model_config(model_cfg, 4096, 256).num_params == 11_015_808
    default = build_model(model_cfg.model_copy(update={"head_dim": None}), 4096, 256, seed=0, meta=True)
    assert default.config.head_dim == 384 // 6 and count_parameters(default) == 11_015_808
    wide = model_cfg.model_copy(update={"head_dim": 128})
    assert count_parameters(build_model(wide, 4096, 256, seed=0, meta=True)) == closed_form_num_params(
        wide, 4096, 256) > 11_015_808


def test_head_dim_on_an_architecture_without_one():
    """gpt2's heads are hidden / heads wide: that value is accepted, another is refused with the fix."""
    gpt2 = dict(arch="gpt2", num_kv_heads=None)
    assert hf_config(small(**gpt2, head_dim=8), VOCAB, SEQ).n_embd == 32
    with pytest.raises(ConfigError, match=r"model.head_dim = 16, but the gpt2 config has no head size .*null"):
        hf_config(small(**gpt2, head_dim=16), VOCAB, SEQ)


def test_closed_form_refuses_archs_without_a_formula():
    with pytest.raises(ConfigError, match="no parameter-count formula for model.arch = stablelm"):
        closed_form_num_params(small(arch="stablelm"), VOCAB, SEQ)


ZERO3_SCRIPT = """
import os

import deepspeed, torch
from transformers.integrations import HfDeepSpeedConfig
from pretrain.recipe.config import ModelConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel
from pretrain.model.build import build_model, count_parameters

draws = []
for base in (LlamaPreTrainedModel, GPT2PreTrainedModel):
    def counted(self, module, rule=base._init_weights):
        # init_weights first runs a parent's rule on meta stand-ins (which children's tensors does it use?)
        if not any(p.is_meta for m in (module, *module.children()) for p in m.parameters(recurse=False)):
            draws.append(module)
        rule(self, module)
    base._init_weights = counted

deepspeed.init_distributed(dist_backend="gloo")
for model_cfg in (
    ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, tie_embeddings=True),
    ModelConfig(arch="gpt2", hidden_size=32, num_layers=2, num_heads=4, tie_embeddings=True),
):
    reference = build_model(model_cfg, 128, 16, seed=7)
    zero3 = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    draws.clear()
    model = build_model(model_cfg, 128, 16, seed=7)
    # one draw per module: transformers' own gathered init at construction is skipped
    assert len(draws) == len(list(model.named_modules())), (len(draws), len(list(model.named_modules())))
    params = list(model.parameters())
    assert all(hasattr(p, "ds_id") and p.ds_tensor.numel() < p.ds_numel for p in params), "not partitioned"
    assert count_parameters(model) == count_parameters(reference)
    with deepspeed.zero.GatheredParameters(params):
        for name, param in model.named_parameters():
            assert torch.equal(param, reference.get_parameter(name)), (model_cfg.arch, name)
    del zero3
print("ZERO3 OK", flush=True)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
# DeepSpeed on CPU/gloo sometimes aborts in C++ destructors at interpreter exit ("terminate called
# without an active exception"), with transformers' own ZeRO-3 init too; the checks are done, skip them.
os._exit(0)
"""


def run_on_two_processes(script_text: str, tmp_path: Path) -> str:
    """Run a script under torch.distributed.run on 2 CPU processes; its stdout (it must exit 0)."""
    script = tmp_path / "two_processes.py"
    script.write_text(textwrap.dedent(script_text))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


@pytest.mark.slow
def test_zero3_partitioned_init_equals_the_unpartitioned_one(tmp_path):
    assert run_on_two_processes(ZERO3_SCRIPT, tmp_path).count("ZERO3 OK") == 2


FSDP2_SCRIPT = """
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from pretrain.recipe.config import ModelConfig
from pretrain.model.build import build_model, init_weights
from pretrain.distributed.supervise import leave

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))


def shard(model):  # FSDP2 as accelerate wraps a transformers model: each decoder layer, then the root
    assert {p.device.type for p in model.parameters()} == {"meta"}, "sharded before any storage exists"
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


for tied in (False, True):
    model_cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                            tie_embeddings=tied)
    reference = build_model(model_cfg, 127, 16, seed=7)  # 127 rows: the two shards are uneven
    model = build_model(model_cfg, 127, 16, seed=7, shard=shard)
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) and p.to_local().shape[0] < p.shape[0] for p in params.values())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    for name, param in params.items():
        assert torch.equal(param.full_tensor(), reference.get_parameter(name)), (tied, name)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, reference.get_buffer(name)), (tied, name)
    # the decoder layers drawn on threads (init_weights' default on a node with cores to spare): the same shards
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().fill_(float("nan"))
    init_weights(model, seed=7, threads=2)
    for name, param in params.items():
        assert torch.equal(param.full_tensor(), reference.get_parameter(name)), ("threads", tied, name)
print("FSDP2 OK", flush=True)
# destroy_process_group does not stop gloo's threads from aborting the interpreter's teardown (SIGABRT,
# pretrain/distributed/supervise.py): leave as a worker of pretrain does.
leave(0)
"""


@pytest.mark.slow
def test_fsdp2_sharded_init_equals_the_unsharded_one(tmp_path):
    """The shard -> materialize -> init path is torch's FSDP2 on any device mesh: here on CPU over gloo, sharded
    while still on the meta device, compared tensor by tensor (tests/multiprocess/test_distributed.py's FSDP run then trains
    the golden curve from it)."""
    assert run_on_two_processes(FSDP2_SCRIPT, tmp_path).count("FSDP2 OK") == 2


# --- dropout -----------------------------------------------------------------------------------------


def test_a_gpt2_recipe_builds_with_dropout_0():
    """transformers' GPT-2 config defaults to 0.1 (attention, residual, embedding); pretraining recipes get 0."""
    from transformers import GPT2Config

    assert GPT2Config().attn_pdrop == GPT2Config().resid_pdrop == GPT2Config().embd_pdrop == 0.1
    model = build_model(small(arch="gpt2", num_kv_heads=None, intermediate_size=None), VOCAB, SEQ, seed=0)
    config = model.config
    assert (config.attn_pdrop, config.resid_pdrop, config.embd_pdrop) == (0.0, 0.0, 0.0)
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0.0 for m in dropouts)
    model.train()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # training mode, yet deterministic: nothing is dropped
        assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("arch, names", [
    ("gpt2", {"attn_pdrop", "resid_pdrop", "embd_pdrop"}),
    ("llama", {"attention_dropout"}),
    ("qwen2", {"attention_dropout"}),
    ("gpt_neox", {"attention_dropout", "hidden_dropout"}),
    ("phi3", {"attention_dropout", "resid_pdrop", "embd_pdrop"}),
    ("opt", {"dropout", "attention_dropout"}),  # OPT defaults to dropout 0.1 too
    ("gpt_neo", {"attention_dropout", "resid_dropout", "embed_dropout"}),
])
def test_model_dropout_sets_every_dropout_of_each_architecture(arch, names):
    from transformers import AutoConfig

    from pretrain.model.build import dropout_attributes

    assert names <= set(dropout_attributes(AutoConfig.for_model(arch)))
    if arch == "opt":
        return  # pretrain cannot build OPT (its config has no initializer_range); its dropouts are still found
    kwargs = dict(num_kv_heads=None) if arch in ("gpt2", "opt", "gpt_neo", "gpt_neox") else {}
    if arch == "gpt_neo":
        kwargs["config_overrides"] = {"attention_types": [[["global"], 2]]}
    for p in (0.0, 0.25):
        config = hf_config(small(arch=arch, dropout=p, **kwargs), VOCAB, SEQ)
        assert {name: getattr(config, name) for name in names} == dict.fromkeys(names, p)


def test_dropout_is_one_field_not_a_config_override():
    from pretrain.recipe.config import load_recipe

    with pytest.raises(ConfigError, match="config_overrides sets attn_pdrop, resid_pdrop: every dropout of the model "
                                          "is model.dropout"):
        load_recipe(REPO / "recipes" / "gpt2-124m.yaml", ["model.config_overrides={attn_pdrop: 0.1, resid_pdrop: 0.1}"])
    with pytest.raises(ConfigError, match="model.dropout"):
        load_recipe(REPO / "recipes" / "tiny.yaml", ["model.dropout=1.5"])


def test_the_estimator_follows_model_dropout():
    from pretrain.recipe.config import load_recipe
    from pretrain.recipe.shape import ModelShape

    recipe = load_recipe(REPO / "recipes" / "gpt2-124m.yaml")
    assert ModelShape.from_recipe(recipe).resid_dropout == 0.0
    dropped = ModelShape.from_recipe(load_recipe(REPO / "recipes" / "gpt2-124m.yaml", ["model.dropout=0.1"]))
    assert (dropped.resid_dropout, dropped.embd_dropout, dropped.attn_dropout) == (0.1, 0.1, 0.1)
