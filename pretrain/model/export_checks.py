"""What an exported model needs to be used as trained: its config's special token ids and KV cache, its
generation config, and a tokenizer that ``AutoTokenizer.from_pretrained`` loads with the training ids.

``save_pretrained_model`` (pretrain.model.build) calls ``ready_for_generation`` and
``save_verified_tokenizer``; the trainer calls ``check_tokenizer_round_trip`` at set-up, so that a tokenizer
transformers would load differently stops the run before it trains, not after.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from pretrain.errors import ConfigError

# transformers 5 calls a tokenizer.json wrapped as is TokenizersBackend (PreTrainedTokenizerFast is its alias).
ROUND_TRIP_CLASS = "TokenizersBackend"


def special_token_ids(tokenizer) -> dict[str, int | None]:
    """bos / eos / pad ids of an exported config. The EOS is the token the training data put between
    documents (pretrain.data joins documents with ``eos_token``), so generation stops where a document
    ended; pad falls back to it (a causal LM never attends to padding)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos, "pad_token_id": eos if pad is None else pad}


def ready_for_generation(model, tokenizer) -> None:
    """The model's config and generation config as an exported model needs them: the tokenizer's special
    ids (an architecture's defaults, e.g. llama's bos 1 / eos 2, name other tokens of our vocabulary) and
    the KV cache on (training turns it off; decoding without it is quadratic)."""
    from transformers import GenerationConfig

    ids = special_token_ids(tokenizer)
    for key, value in ids.items():
        setattr(model.config, key, value)
    model.config.use_cache = True
    model.generation_config = GenerationConfig(**ids, use_cache=True)


def first_difference(tokenizer, directory: Path, texts: list[str]) -> str | None:
    """None when ``AutoTokenizer.from_pretrained(directory)`` encodes every text to the training ids, else
    the first differing document, named."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(directory))  # a local directory: nothing is downloaded
    # The ids the token store holds: the backend's encoding without special tokens (pretrain.data.store_build).
    expected = [e.ids for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    got = loaded(texts, add_special_tokens=False)["input_ids"] if texts else []
    differing = [i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b]
    if not differing:
        return None
    index = differing[0]
    a, b = expected[index], got[index]
    # One may be a prefix of the other: then they differ where the shorter ends.
    at = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return (f"AutoTokenizer loads a {type(loaded).__name__} that encodes {len(differing)} of {len(texts)} "
            f"validation documents differently; the first, document {index} ({texts[index][:40]!r}...), from "
            f"token {at}: training ids {a[at:at + 8]}, loaded ids {b[at:at + 8]}")


def save_verified_tokenizer(tokenizer, directory: Path, texts: list[str]) -> None:
    """``tokenizer.save_pretrained(directory)`` (beside the model's config.json, which AutoTokenizer also
    reads), then checked on ``texts``: if AutoTokenizer's load differs, the tokenizer_config.json is rewritten
    to name the class that wraps tokenizer.json as it is, and checked again; still different is one
    ConfigError naming the first difference (transformers maps some model types, e.g. qwen2, to their own
    tokenizer class whatever tokenizer_config.json says, and rebuilds it with that model's pre-tokenizer)."""
    tokenizer.save_pretrained(directory)
    if first_difference(tokenizer, directory, texts) is None:
        return
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = ROUND_TRIP_CLASS
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    difference = first_difference(tokenizer, directory, texts)
    if difference is not None:
        model_type = json.loads((directory / "config.json").read_text()).get("model_type", "?")
        raise ConfigError(
            f"the exported {model_type} model would not load its training tokenizer: {difference}, also with "
            f"tokenizer_class {ROUND_TRIP_CLASS}. Train with a tokenizer whose pre-tokenizer is the one "
            f"transformers gives {model_type} (or its own tokenizer), or choose a model.arch whose AutoTokenizer "
            "keeps tokenizer.json as it is (llama, mistral)"
        )


def check_tokenizer_round_trip(config, tokenizer, texts: list[str]) -> None:
    """The export's tokenizer check, before training: ``config`` (the model's transformers config) and the
    tokenizer saved to a scratch directory and loaded back as a user of the exported model will."""
    with tempfile.TemporaryDirectory(prefix="pretrain-tokenizer-check-") as scratch:
        config.to_json_file(str(Path(scratch) / "config.json"))
        save_verified_tokenizer(tokenizer, Path(scratch), texts)
