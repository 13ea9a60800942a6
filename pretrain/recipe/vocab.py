"""The vocabulary of a recipe's tokenizer, read without loading it: one fact for the estimator, the planner
and the dry run, and the same number the run gets from ``len(tokenizer)``.

A ``tokenizer.json`` (given as a file, as a directory holding one, or a hub tokenizer already in the local
Hugging Face cache) is read by ``tokenizers`` alone: no transformers, no torch, nothing downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

VOCAB_MULTIPLE = 64
"""A tokenizer's vocabulary is padded to a multiple of this (tensor-core friendly matmul shapes)."""


def round_vocab(num_tokens: int) -> int:
    """``num_tokens`` rounded up to a multiple of ``VOCAB_MULTIPLE`` (GPT-2's 50257 -> 50304)."""
    return -(-num_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def local_tokenizer_file(name: str) -> Path | None:
    """The ``tokenizer.json`` that ``data.tokenizer = name`` loads, if it is on this machine."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        return path / "tokenizer.json" if (path / "tokenizer.json").is_file() else None
    if name.count("/") > 1 or name.startswith((".", "/", "~")) or (os.sep != "/" and os.sep in name):
        return None  # a local path that does not exist: the data loader names it
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(name, "tokenizer.json")
    except Exception:  # not a valid repository id: only the loader's message is worth showing
        return None
    return Path(found) if isinstance(found, str) else None


def tokenizer_file_vocab_size(name: str) -> int | None:
    """``len(tokenizer)`` of ``data.tokenizer = name`` (its vocabulary with the added tokens), or None when
    its tokenizer.json is not on this machine (a hub tokenizer not yet downloaded) or does not parse."""
    file = local_tokenizer_file(name)
    if file is None:
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
    except Exception:  # a broken file: the data loader reports it with its fix when the run loads it
        return None
