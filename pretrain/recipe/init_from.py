"""``model.init_from``: where a pretrained model's files are, and what its ``config.json`` says of the recipe.

Read without torch or transformers (the estimator, the planner and ``--dry-run`` use it): a local directory
written by ``save_pretrained`` (a run's ``final_model/`` is one), a pretrain checkpoint (its weights are read through
a transformers view written beside it, ``step_N.hf``, by the run's first process: ``pretrain.checkpoint.export``; its
shape comes from the recipe it recorded), or a Hugging Face hub id, whose ``config.json`` comes from the local cache
or, where the hub is reachable, is downloaded alone (no weights).

The recipe is resolved once, while it is validated (``resolve_recipe_dict``): the checkpoint's shape fills the
``model`` section's shape keys, a shape key the recipe does give must agree with the checkpoint (one error
naming every key that does not, with both values), and ``data.tokenizer`` defaults to the checkpoint's own.
Everything downstream (the estimator, the planner, the trainer) then reads the checkpoint's shape from the
recipe, as it would a recipe written by hand.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from pretrain.errors import ConfigError

# What a model directory must hold to be loaded, and what a hub download fetches: the config, the weights
# (safetensors only: pickle weights are never loaded), the generation config and every tokenizer file.
HUB_PATTERNS = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")
STATE_FILE = "trainer_state.json"  # a pretrain checkpoint's (pretrain.checkpoint.rundir)
HF_VIEW = "hf"  # a pretrain checkpoint's transformers view: step_N.hf beside step_N (reshard's view naming)

# model.<field> -> the config.json attributes that hold it (first present wins; GPT-2's own names too).
SHAPE_FIELDS: dict[str, tuple[str, ...]] = {
    "arch": ("model_type",),
    "hidden_size": ("hidden_size", "n_embd"),
    "num_layers": ("num_hidden_layers", "n_layer"),
    "num_heads": ("num_attention_heads", "n_head"),
    "num_kv_heads": ("num_key_value_heads",),
    "intermediate_size": ("intermediate_size", "n_inner"),
    "head_dim": ("head_dim",),
    "vocab_size": ("vocab_size",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "rope_theta": ("rope_theta",),
    "norm_eps": ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps"),
    "tie_embeddings": ("tie_word_embeddings",),
}
MOE_FIELDS: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_experts", "num_local_experts"),
    "experts_per_token": ("num_experts_per_tok",),
    "expert_intermediate_size": ("moe_intermediate_size", "intermediate_size"),
    "router_aux_loss_coef": ("router_aux_loss_coef",),
}
# the recipe's MoE section: what the architectures pretrain builds call the experts' MLP width
_EXPERT_WIDTH = {"qwen3_moe": "moe_intermediate_size", "olmoe": "intermediate_size", "mixtral": "intermediate_size"}


def is_local(init_from: str) -> bool:
    """Whether ``init_from`` names a path on this machine rather than a hub id (``org/name``)."""
    path = Path(init_from).expanduser()
    return (path.exists() or init_from.startswith((".", "/", "~")) or init_from.count("/") != 1
            or (os.sep != "/" and os.sep in init_from))


def pretrain_checkpoint(init_from: str) -> Path | None:
    """``init_from`` as a pretrain checkpoint directory (``runs/x/checkpoints/step_N``), or None."""
    path = Path(init_from).expanduser()
    return path if is_local(init_from) and (path / STATE_FILE).is_file() else None


def hf_view(checkpoint: Path) -> Path:
    """Where a pretrain checkpoint's weights are written as a transformers model directory for model.init_from."""
    return checkpoint.with_name(f"{checkpoint.name}.{HF_VIEW}")


def local_dir(init_from: str) -> Path | None:
    """The directory ``init_from`` names on this machine: itself, or a hub id's snapshot in the local Hugging Face
    cache (None: not downloaded yet). A local path that is not a model directory is one ConfigError."""
    if is_local(init_from):
        path = Path(init_from).expanduser()
        if not path.is_dir():
            raise ConfigError(f"model.init_from = {init_from!r}: no such directory; give a model directory written by "
                              "save_pretrained (config.json and *.safetensors; a run's final_model/ is one) or a "
                              "Hugging Face hub id such as Qwen/Qwen3-1.7B")
        if (path / STATE_FILE).is_file():  # a pretrain checkpoint: its view, once written
            view = hf_view(path)
            return view if (view / CONFIG_FILE).is_file() else None
        if not (path / CONFIG_FILE).is_file():
            raise ConfigError(f"model.init_from = {init_from!r} has no {CONFIG_FILE}; give a directory written by "
                              "save_pretrained (config.json and *.safetensors), a pretrain checkpoint "
                              "(runs/x/checkpoints/step_N) or a hub id")
        return path
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency of transformers
        return None
    try:
        found = try_to_load_from_cache(init_from, CONFIG_FILE)
    except Exception as exc:  # noqa: BLE001 - an invalid repository id
        raise ConfigError(f"model.init_from = {init_from!r} is neither a local directory nor a valid Hugging Face hub "
                          f"id ({exc})") from None
    return Path(found).parent if isinstance(found, str) else None


def hub_error(init_from: str, exc: Exception, what: str) -> ConfigError:
    """One message for a hub download that failed: gated, missing, offline."""
    from huggingface_hub import errors

    name = type(exc).__name__
    if isinstance(exc, errors.GatedRepoError):
        return ConfigError(f"model.init_from = {init_from!r} is a gated model: accept its licence on its hub page with "
                           "your account, then `hf auth login` (or set HF_TOKEN) on this machine")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return ConfigError(f"model.init_from = {init_from!r}: no such model on the Hugging Face hub (or it is private: "
                           "log in with `hf auth login`); check the id, or give a local directory")
    offline = (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)
    if isinstance(exc, errors.EntryNotFoundError) and not isinstance(exc, offline):
        return ConfigError(f"model.init_from = {init_from!r} has no {what} on the hub; is it a transformers model?")
    return ConfigError(f"model.init_from = {init_from!r} is not in this machine's Hugging Face cache and the hub cannot "
                       f"be reached ({name}); download it where there is a network (`hf download {init_from}`, into "
                       "the same HF_HOME) or give a local directory")


def fetch_config(init_from: str) -> Path:
    """The directory holding ``init_from``'s config.json: local, cached, or its config.json downloaded alone."""
    found = local_dir(init_from)
    if found is not None:
        return found
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(init_from, CONFIG_FILE)).parent
    except Exception as exc:  # noqa: BLE001 - every failure is one message
        raise hub_error(init_from, exc, CONFIG_FILE) from None


@functools.cache
def _read_config(directory: str) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"model.init_from: {path} does not read as JSON ({exc}); is it a transformers model "
                          "directory?") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError(f"model.init_from: {path} has no model_type; is it a transformers model config?")
    return config


def checkpoint_config(init_from: str) -> dict[str, Any] | None:
    """``init_from``'s config.json as a dict (read once per process); None for a pretrain checkpoint whose
    transformers view is not written yet (its recorded recipe gives the shape: ``recorded_shape``)."""
    if pretrain_checkpoint(init_from) is not None and local_dir(init_from) is None:
        return None
    return dict(_read_config(str(fetch_config(init_from))))


def recorded_shape(checkpoint: Path) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """A pretrain checkpoint's model fields, its model.moe and its model.config_overrides, from the recipe it
    recorded (the model it built), the vocabulary from its tokenizer where the recipe left it null."""
    from pretrain.recipe.vocab import round_vocab

    try:
        state = json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))
        model = dict(state["recipe"]["model"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"model.init_from = {checkpoint}: its {STATE_FILE} does not read as a pretrain checkpoint's "
                          f"({exc})") from None
    fields = {field: model.get(field) for field in SHAPE_FIELDS}
    if fields["max_position_embeddings"] is None:  # null built the source with data.seq_len positions
        fields["max_position_embeddings"] = (state["recipe"].get("data") or {}).get("seq_len")
    if fields["vocab_size"] is None:
        sizes = [d.get("tokenizer", {}).get("vocab_size") for d in (state.get("data") or {}).values()
                 if isinstance(d, dict)]
        if not sizes or sizes[0] is None:
            raise ConfigError(f"model.init_from = {checkpoint}: its {STATE_FILE} records no vocabulary size (a "
                              "checkpoint of an older pretrain); export it with pretrain-export and start from that")
        fields["vocab_size"] = round_vocab(sizes[0])
    if model.get("init_from") is not None and fields["arch"] is None:
        raise ConfigError(f"model.init_from = {checkpoint}: its recorded recipe has no model.arch")
    return fields, model.get("moe"), dict(model.get("config_overrides") or {})


def _value(config: dict[str, Any], names: tuple[str, ...]) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
        if name == "rope_theta" and isinstance(config.get("rope_parameters"), dict):
            return config["rope_parameters"].get("rope_theta")
    return None


def shape_of(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The recipe's model fields (and model.moe, for an MoE) that a checkpoint's config.json fixes."""
    fields = {field: _value(config, names) for field, names in SHAPE_FIELDS.items()}
    arch = fields["arch"]
    if arch == "gpt2" and fields["intermediate_size"] is None:
        fields["intermediate_size"] = None  # GPT-2's null n_inner: 4 x hidden, as the recipe says it
    # tie_word_embeddings absent: the architecture's default (gemma ties, llama does not), neither filled nor checked
    moe = None
    if arch in _EXPERT_WIDTH:
        moe = {field: _value(config, (_EXPERT_WIDTH[arch],) if field == "expert_intermediate_size" else names)
               for field, names in MOE_FIELDS.items()}
        moe = {k: v for k, v in moe.items() if v is not None}
        fields["intermediate_size"] = None  # an MoE's MLP width is model.moe's
    return {k: v for k, v in fields.items() if v is not None or k in ("intermediate_size",)}, moe


def resolve_recipe_dict(data: dict[str, Any]) -> dict[str, Any]:
    """A recipe (as a dict, before validation) whose ``model.init_from`` is set, with the checkpoint's shape
    filled in and ``data.tokenizer`` defaulting to the checkpoint's own; a shape key the recipe gives that differs
    from the checkpoint is a ConfigError naming each (the recipe cannot reshape a trained model)."""
    model = dict(data["model"])
    init_from = str(model["init_from"])
    checkpoint = pretrain_checkpoint(init_from)
    if checkpoint is not None:
        fields, moe, overrides = recorded_shape(checkpoint)
        tokenizer = str(hf_view(checkpoint))  # written with the weights (pretrain.checkpoint.export)
        return _filled(data, model, init_from, fields, moe, tokenizer, overrides)
    config = checkpoint_config(init_from)
    if config.get("auto_map"):
        raise ConfigError(f"model.init_from = {init_from!r} is a model with custom code (auto_map in its config.json); "
                          "pretrain builds transformers' own architectures only and never runs a checkpoint's code")
    if config.get("quantization_config"):
        method = (config["quantization_config"] or {}).get("quant_method", "quantized")
        raise ConfigError(f"model.init_from = {init_from!r} holds {method} weights (quantization_config in its "
                          "config.json); pretraining continues from full-precision weights: use the unquantized "
                          "release of this model")
    fields, moe = shape_of(config)
    return _filled(data, model, init_from, fields, moe, init_from, {})


def _filled(data: dict[str, Any], model: dict[str, Any], init_from: str, fields: dict[str, Any],
            moe: dict[str, Any] | None, tokenizer: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The recipe dict with the checkpoint's ``fields`` and ``moe`` filled in, each one the recipe gives checked
    against it; ``overrides``: the source's own config_overrides (a pretrain checkpoint's), under the recipe's."""
    if not isinstance(data.get("data") or {}, dict) or not isinstance(model.get("config_overrides") or {}, dict):
        return data  # the schema names what is malformed
    problems = []
    seq_len = (data.get("data") or {}).get("seq_len")
    positions = {**overrides, **(model.get("config_overrides") or {})}.get("max_position_embeddings",
                                                                            fields.get("max_position_embeddings"))
    if isinstance(seq_len, int) and isinstance(positions, int) and seq_len > positions:
        problems.append(f"data.seq_len = {seq_len} is longer than {init_from}'s max_position_embeddings ({positions}); "
                        "shorten it, or extend the context with model.config_overrides (max_position_embeddings, "
                        "and rope_parameters for RoPE scaling)")
    for field, value in fields.items():
        given = model.get(field)
        if field in model and given is not None and value is not None and given != value \
                and not _same_number(given, value):
            problems.append(f"model.{field} = {given!r}, but {init_from} has {value!r}")
    given_moe = model.get("moe")
    if isinstance(given_moe, dict) and moe is not None:
        for field, value in moe.items():
            if field in given_moe and field != "router_aux_loss_coef" and given_moe[field] != value:
                problems.append(f"model.moe.{field} = {given_moe[field]!r}, but {init_from} has {value!r}")
    elif given_moe is not None and moe is not None:
        problems.append(f"model.moe = {given_moe!r} is not a mapping; leave it out ({init_from} gives it)")
    elif given_moe is not None and moe is None:
        problems.append(f"model.moe is set, but {init_from} ({fields['arch']}) is not a mixture of experts pretrain "
                        "builds; remove model.moe")
    if problems:
        raise ConfigError([*problems, "a pretrained model's shape is its checkpoint's: remove these keys from the "
                           "recipe (model.init_from fills them in)"] if len(problems) > 1 else
                          f"{problems[0]}; a pretrained model's shape is its checkpoint's: remove the key from the "
                          "recipe (model.init_from fills it in)")
    model.update({k: v for k, v in fields.items() if v is not None or k not in model})
    if moe is not None:
        model["moe"] = {**moe, **(given_moe if isinstance(given_moe, dict) else {})}
    if overrides:
        model["config_overrides"] = {**overrides, **(model.get("config_overrides") or {})}
    out = {**data, "model": model}
    data_section = dict(out.get("data") or {})
    if data_section.get("tokenizer") == "bpe":
        raise ConfigError(f"data.tokenizer = bpe with model.init_from = {init_from}: a tokenizer trained anew gives ids "
                          "the checkpoint never learned; leave data.tokenizer out (the checkpoint's own) or give one "
                          "that matches it (a recipe inheriting tokenizer: bpe through base: must drop it)")
    if "tokenizer" not in data_section:
        data_section["tokenizer"] = tokenizer  # the checkpoint's own tokenizer: its ids are what the embedding learned
        out["data"] = data_section
    return out


def _same_number(a: Any, b: Any) -> bool:
    return isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool) and float(a) == float(b)


def model_attributes(init_from: str, vocab_size: int, dropout_names: list[str], dropout: float,
                     overrides: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's config.json as the attributes the shape reads, with the recipe's dropout and
    ``config_overrides`` applied as ``pretrain.model.build.hf_config`` applies them (None: a pretrain checkpoint
    not yet viewed, whose recorded fields in the recipe say it all)."""
    config = checkpoint_config(init_from)
    if config is None:
        return None
    return {**config, "vocab_size": vocab_size, **dict.fromkeys(dropout_names, dropout), **overrides}
