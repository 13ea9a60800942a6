"""``prepare_data``: the whole flow of the pretrain.data docstring, cached as one entry per key."""

from __future__ import annotations

import json
import shutil
import time

from pretrain.config import DataConfig
from pretrain.data.cache import PACKED_VERSION, _hash, _make_tmp_dir, _publish, cache_root
from pretrain.data.documents import Log, _default_num_proc, _Documents
from pretrain.data.packing import _pack, _tokenize
from pretrain.data.sources import _Corpus, _resolve_corpus
from pretrain.data.store import PackedData, _load_packed
from pretrain.data.tokenizer import _bpe_key, _get_tokenizer


def _count(n: float) -> str:
    """Human-readable count: 734, 12.3k, 3.19M."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{int(n)}"


def _packed_key(data_cfg: DataConfig, corpus: _Corpus, tokenizer_identity: str) -> str:
    return _hash(
        {
            "version": PACKED_VERSION,
            "documents": corpus.key,
            "tokenizer": tokenizer_identity,
            "seq_len": data_cfg.seq_len,
            "val_fraction": data_cfg.val_fraction,
        }
    )


def prepare_data(data_cfg: DataConfig, log: Log = print) -> PackedData:
    """Tokenized, packed train and val sequences for data_cfg, built once and cached.

    The arrays are int32 [num_sequences, seq_len + 1] rows of the eos-joined token stream of each split
    (documents in corpus order), memory-mapped from cache_root/packed/<key>/. ``stats`` holds the
    document, token and sequence counts (before subsetting for tokens, after for sequences), the number
    of documents with non-UTF-8 bytes and the cache directory.
    """
    start = time.perf_counter()
    corpus = _resolve_corpus(data_cfg)
    documents = _Documents(data_cfg, corpus, log)
    root = cache_root(data_cfg)
    if data_cfg.tokenizer == "bpe":
        # The BPE's identity is known without loading it, so a cache hit reads nothing but the arrays.
        tokenizer, tokenizer_id, tokenizer_name = (
            None,
            _bpe_key(data_cfg, corpus),
            f"bpe-{data_cfg.tokenizer_vocab_size}",
        )
    else:
        tokenizer, tokenizer_id, tokenizer_name = _get_tokenizer(data_cfg, corpus, documents, log)
    key = _packed_key(data_cfg, corpus, tokenizer_id)
    target = root / "packed" / key
    if target.is_dir():
        data = _load_packed(target, data_cfg, tokenizer)
        log(
            f"data: cached {data.stats['num_train_sequences']:,} train / {data.stats['num_val_sequences']:,} val "
            f"sequences of {data_cfg.seq_len + 1} tokens from {target} ({time.perf_counter() - start:.2f}s)"
        )
        return data

    if tokenizer is None:
        tokenizer, _, _ = _get_tokenizer(data_cfg, corpus, documents, log)
    docs, is_val, num_bad = documents.get()
    num_proc = data_cfg.num_proc or _default_num_proc()
    work_dir = _make_tmp_dir(target.parent, key)
    try:
        tokens = _tokenize(docs, tokenizer, min(num_proc, len(docs)), work_dir / "tokens", key)
        counts = _pack(tokens, is_val, data_cfg, work_dir)
        del tokens
        shutil.rmtree(work_dir / "tokens")
        tokenizer.save_pretrained(str(work_dir / "tokenizer"))
        stats = {
            "source": data_cfg.source,
            "corpus": corpus.description,
            "num_documents": len(docs),
            **counts,
            "num_decode_errors": num_bad,
            "on_decode_error": data_cfg.on_decode_error,
            "tokenizer": tokenizer_name,
            "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id,
            "seq_len": data_cfg.seq_len,
            "val_fraction": data_cfg.val_fraction,
            "build_seconds": round(time.perf_counter() - start, 2),
            "key": key,
        }
        (work_dir / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    if not _publish(work_dir, target):
        log(f"data: another process built {target} first; using it")
    data = _load_packed(target, data_cfg)
    s = data.stats
    log(
        f"data: {s['num_documents']:,} documents ({s['num_train_documents']:,} train / {s['num_val_documents']:,} "
        f"val), {_count(s['num_train_tokens'])} train tokens → {s['num_train_sequences']:,} sequences of "
        f"{data_cfg.seq_len + 1}, {_count(s['num_val_tokens'])} val tokens → {s['num_val_sequences']:,}"
        f"{' (after data.train_subset / val_subset)' if data_cfg.train_subset or data_cfg.val_subset else ''}; "
        f"built in {time.perf_counter() - start:.1f}s, cached at {target}"
    )
    return data
