"""The train / val split by document, from a hash of each document's text (rules in the pretrain.data
docstring)."""

from __future__ import annotations

import hashlib

import numpy as np


def _doc_hash(text: str) -> int:
    """The first 8 bytes of sha1(text), as an unsigned 64-bit integer."""
    return int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "big")


def _val_threshold(val_fraction: float) -> int:
    """A document goes to val when its hash is below this."""
    return min(int(val_fraction * 2**64), 2**64 - 1)


def _split_hashes(docs) -> np.ndarray:
    """uint64 per document of a datasets.Dataset: _doc_hash of its text."""
    hashes = np.empty(len(docs), dtype=np.uint64)
    i = 0
    for batch in docs.iter(batch_size=1000):
        for text in batch["text"]:
            hashes[i] = _doc_hash(text)
            i += 1
    return hashes


def _val_mask(hashes: np.ndarray, val_fraction: float) -> np.ndarray:
    """True for validation documents; see the pretrain.data docstring for the rules."""
    is_val = hashes < np.uint64(_val_threshold(val_fraction))
    if len(hashes) >= 2:
        if not is_val.any():
            is_val[np.argmin(hashes)] = True
        if is_val.all():
            is_val[np.argmax(hashes)] = False
    else:
        is_val[:] = False  # a single document is split inside its token stream
    return is_val
