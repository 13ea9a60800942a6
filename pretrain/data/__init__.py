"""Data: corpus -> documents -> train/val split -> tokenizer -> token stream -> packed sequences, cached.

The flow of ``prepare_data``:

1. Resolve ``data.source`` to a list of files (or an ``hf:`` dataset) and fingerprint it cheaply from
   (path, size, mtime_ns), so that a cache hit never reads the corpus.
2. Look up ``cache_root/packed/<key>/``; on a hit, memory-map the arrays and return (well under 1 s).
3. Otherwise read the documents into a ``datasets.Dataset`` (one column ``text``, one row per file,
   jsonl line or parquet row, empty documents dropped), split them into train / val by a hash of the
   text, get the tokenizer (a byte-level BPE trained on the training documents, cached on its own),
   tokenize with ``Dataset.map``, append eos to every document, concatenate each split into one token
   stream and cut it into rows of ``seq_len + 1`` tokens (the trainer takes inputs = row[:-1] and
   targets = row[1:]). The remainder of each stream that does not fill a row is dropped.

The split is by document, before tokenization, and depends on nothing but the text: a document goes
to val when the first 8 bytes of sha1(text) read as a fraction fall below ``val_fraction``. It is the
same for any training seed, file order or file name, and identical documents always land on the same
side. If no document falls below the threshold (tiny corpora) the document with the smallest hash goes
to val; if all of them do, the one with the largest hash stays in train. A corpus of a single document
is split inside its token stream instead: the last ``val_fraction`` of its tokens (at least one) are
the validation stream, and each part ends with eos (the BPE tokenizer is then trained on all of it).

Caches are directories written under a temporary name and renamed into place, so a reader never sees a
half-written cache and concurrent builders agree: the first rename wins, the others discard their copy
and load the winner's. ``train_subset`` / ``val_subset`` are applied when the arrays are returned
(the first N rows), so changing them reuses the cached arrays.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.config import DataConfig
from pretrain.data.cache import (
    PACKED_VERSION,
    TOKENIZER_VERSION,
    _hash,
    _make_tmp_dir,
    _publish,
    cache_root,
)
from pretrain.data.documents import Log, _default_num_proc, _Documents, load_documents
from pretrain.data.sources import _Corpus, _resolve_corpus
from pretrain.errors import DataError

EOS_TOKEN = "<|endoftext|>"
TOKENS_DTYPE = np.int32

__all__ = ["PackedData", "build_tokenizer", "cache_root", "load_documents", "prepare_data"]


@dataclass
class PackedData:
    """Packed token sequences of both splits, the tokenizer that made them and what it took."""

    train: np.ndarray  # int32 [num_train_sequences, seq_len + 1], usually a read-only memory map
    val: np.ndarray  # int32 [num_val_sequences, seq_len + 1]
    tokenizer: Any  # transformers.PreTrainedTokenizerFast with eos_token set
    stats: dict[str, Any]  # JSON-serialisable counts and provenance, see prepare_data


def _count(n: float) -> str:
    """Human-readable count: 734, 12.3k, 3.19M."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{int(n)}"


@contextlib.contextmanager
def _tokenizers_fork_safe():
    """Forked map workers would otherwise each print a warning and disable Rust parallelism anyway."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


# --------------------------------------------------------------------------------------------------
# Tokenizer


def _looks_local(name: str) -> bool:
    return (
        name.startswith((".", "/", "~"))
        or name.endswith(".json")
        or name.count("/") > 1
        or os.sep in name
        and os.sep != "/"
    )


def _check_tokenizer(tok, name: str):
    if not getattr(tok, "is_fast", False):
        raise DataError(
            f"data.tokenizer = {name!r}: {type(tok).__name__} is not a fast (Rust `tokenizers`) tokenizer; "
            "give a directory with a tokenizer.json, or use data.tokenizer=bpe"
        )
    if tok.eos_token is None or tok.eos_token_id is None:
        raise DataError(
            f"data.tokenizer = {name!r} has no eos_token; documents are joined with eos, so give a tokenizer "
            "that defines one (eos_token in tokenizer_config.json) or use data.tokenizer=bpe"
        )
    return tok


def _load_pretrained_tokenizer(data_cfg: DataConfig):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    name = data_cfg.tokenizer
    path = Path(name).expanduser()
    try:
        if path.is_file():
            if path.name == "tokenizer.json" and (path.parent / "tokenizer_config.json").is_file():
                tok = AutoTokenizer.from_pretrained(str(path.parent), trust_remote_code=False)
            else:
                tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
                if EOS_TOKEN in tok.get_vocab():
                    tok.eos_token = EOS_TOKEN
        elif path.is_dir():
            if (path / "tokenizer_config.json").is_file():
                tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
            elif (path / "tokenizer.json").is_file():
                tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
                if EOS_TOKEN in tok.get_vocab():
                    tok.eos_token = EOS_TOKEN
            else:
                raise DataError(
                    f"data.tokenizer = {name!r}: the directory has no tokenizer.json or tokenizer_config.json; "
                    "give a directory written by save_pretrained, a tokenizer.json, or use data.tokenizer=bpe"
                )
        elif _looks_local(name):
            raise DataError(
                f"data.tokenizer = {name!r}: no such file or directory (looked in {Path.cwd()}); give a tokenizer "
                "directory or tokenizer.json that exists, a Hugging Face tokenizer name, or `bpe` to train one"
            )
        else:
            tok = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(
            f"data.tokenizer = {name!r}: could not load the tokenizer ({type(exc).__name__}: {exc}); give a local "
            "tokenizer directory or tokenizer.json, or use data.tokenizer=bpe to train one on the corpus"
        ) from None
    return _check_tokenizer(tok, name)


def _tokenizer_identity(tok) -> str:
    return _hash(
        {"tokenizer": hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest(), "eos": tok.eos_token}
    )


def _bpe_key(data_cfg: DataConfig, corpus: _Corpus) -> str:
    # The BPE is trained on the training documents, so the split (val_fraction) is part of its identity.
    return _hash(
        {
            "version": TOKENIZER_VERSION,
            "documents": corpus.key,
            "vocab_size": data_cfg.tokenizer_vocab_size,
            "val_fraction": data_cfg.val_fraction,
        }
    )


def _train_bpe(texts: Iterator[list[str]], num_texts: int, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer, length=num_texts)
    # One token marks document boundaries; it also serves as bos and pad (GPT-2 convention).
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )


def _train_texts(docs, is_val: np.ndarray) -> Iterator[list[str]]:
    start = 0
    for batch in docs.iter(batch_size=1000):
        texts = batch["text"]
        mask = is_val[start : start + len(texts)]
        start += len(texts)
        yield [t for t, v in zip(texts, mask, strict=True) if not v]


def _load_saved_tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _get_tokenizer(data_cfg: DataConfig, corpus: _Corpus, documents: _Documents, log: Log):
    """(tokenizer, identity string for cache keys, description)."""
    if data_cfg.tokenizer != "bpe":
        tok = _load_pretrained_tokenizer(data_cfg)
        identity = _tokenizer_identity(tok)
        log(f"tokenizer: {data_cfg.tokenizer} ({len(tok):,} tokens, eos {tok.eos_token!r})")
        return tok, identity, data_cfg.tokenizer
    key = _bpe_key(data_cfg, corpus)
    target = cache_root(data_cfg) / "tokenizers" / key
    description = f"bpe-{data_cfg.tokenizer_vocab_size}"
    if target.is_dir():
        tok = _load_saved_tokenizer(target)
        log(f"tokenizer: cached byte-level BPE, {len(tok):,} tokens, at {target}")
        return tok, key, description
    docs, is_val, _ = documents.get()
    start = time.perf_counter()
    tok = _train_bpe(_train_texts(docs, is_val), int((~is_val).sum()), data_cfg.tokenizer_vocab_size)
    tmp = _make_tmp_dir(target.parent, key)
    tok.save_pretrained(str(tmp))
    _publish(tmp, target)
    log(
        f"tokenizer: trained byte-level BPE on {int((~is_val).sum()):,} training documents in "
        f"{time.perf_counter() - start:.1f}s, {len(tok):,} tokens, cached at {target}"
    )
    return _load_saved_tokenizer(target), key, description


def build_tokenizer(data_cfg: DataConfig, log: Log = print):
    """The tokenizer of data.tokenizer: a byte-level BPE trained on the training documents (cached under
    cache_root/tokenizers/<key>/), or a local / hub tokenizer. It always has an eos_token."""
    corpus = _resolve_corpus(data_cfg) if data_cfg.tokenizer == "bpe" else None
    return _get_tokenizer(data_cfg, corpus, _Documents(data_cfg, corpus, log), log)[0]


# --------------------------------------------------------------------------------------------------
# Tokenize and pack


class _Encode:
    """Batched map function: token ids of each document followed by eos (picklable for num_proc)."""

    def __init__(self, backend, eos_id: int):
        self.backend, self.eos_id = backend, eos_id

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        encodings = self.backend.encode_batch_fast(batch["text"], add_special_tokens=False)
        return {"input_ids": [e.ids + [self.eos_id] for e in encodings]}


def _tokenize(docs, tokenizer, num_proc: int, work_dir: Path, fingerprint: str):
    import datasets

    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
    with _tokenizers_fork_safe() if num_proc > 1 else contextlib.nullcontext():
        return docs.map(
            _Encode(tokenizer.backend_tokenizer, tokenizer.eos_token_id),
            batched=True,
            batch_size=256,
            num_proc=num_proc if num_proc > 1 else None,
            remove_columns=docs.column_names,
            features=features,
            cache_file_name=str(work_dir / "tokens.arrow"),
            new_fingerprint=fingerprint,
            desc="tokenize",
        )


def _token_batches(tokens) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(per-document lengths, flat token ids) for consecutive batches of documents."""
    import pyarrow.compute as pc

    for table in tokens.with_format("arrow").iter(batch_size=4096):
        column = table.column("input_ids")
        for chunk in column.chunks:
            yield (
                pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64),
                pc.list_flatten(chunk).to_numpy(zero_copy_only=False),
            )


class _SequenceWriter:
    """Fills an .npy file of shape [num_sequences, row_len] from a token stream; surplus is dropped."""

    def __init__(self, path: Path, num_sequences: int, row_len: int):
        self.array = np.lib.format.open_memmap(path, mode="w+", dtype=TOKENS_DTYPE, shape=(num_sequences, row_len))
        self.flat = self.array.reshape(-1)
        self.pos = 0

    def write(self, tokens: np.ndarray):
        n = min(len(tokens), len(self.flat) - self.pos)
        self.flat[self.pos : self.pos + n] = tokens[:n]
        self.pos += n

    def close(self):
        assert self.pos == len(self.flat), (self.pos, len(self.flat))
        self.array.flush()
        del self.flat, self.array


def _too_few_tokens(split: str, num_tokens: int, num_docs: int, data_cfg: DataConfig, hint: str) -> DataError:
    return DataError(
        f"data: the {split} split has {num_tokens:,} tokens ({num_docs:,} documents of data.source = "
        f"{data_cfg.source!r}), fewer than one sequence of data.seq_len + 1 = {data_cfg.seq_len + 1} tokens; "
        f"use a smaller data.seq_len{hint} or more data"
    )


def _pack(tokens, is_val: np.ndarray, data_cfg: DataConfig, work_dir: Path) -> dict[str, int]:
    """Write train.npy and val.npy into work_dir; return the token and sequence counts."""
    row_len = data_cfg.seq_len + 1
    lengths = np.concatenate([lengths for lengths, _ in _token_batches(tokens)])
    single = len(lengths) == 1
    if single:
        # The one document's stream (text tokens + eos) is cut before its last val_fraction of text tokens.
        num_text = int(lengths[0]) - 1
        num_val_text = max(1, round(num_text * data_cfg.val_fraction)) if num_text >= 2 else 0
        cut = num_text - num_val_text
        num_tokens = {"train": cut + 1, "val": num_val_text + 1 if num_val_text else 0}
        num_docs = {"train": 1, "val": 1 if num_val_text else 0}
    else:
        num_tokens = {"train": int(lengths[~is_val].sum()), "val": int(lengths[is_val].sum())}
        num_docs = {"train": int((~is_val).sum()), "val": int(is_val.sum())}
    hints = {"train": "", "val": ", a larger data.val_fraction"}
    for split in ("train", "val"):
        if num_tokens[split] < row_len:
            raise _too_few_tokens(split, num_tokens[split], num_docs[split], data_cfg, hints[split])
    num_sequences = {split: num_tokens[split] // row_len for split in ("train", "val")}
    writers = {split: _SequenceWriter(work_dir / f"{split}.npy", num_sequences[split], row_len) for split in num_tokens}
    start = 0
    for batch_lengths, flat in _token_batches(tokens):
        if single:
            writers["train"].write(np.concatenate([flat[:cut], flat[-1:]]))  # flat[-1] is the eos
            writers["val"].write(flat[cut:])
            continue
        doc_is_val = is_val[start : start + len(batch_lengths)]
        start += len(batch_lengths)
        token_is_val = np.repeat(doc_is_val, batch_lengths)
        writers["train"].write(flat[~token_is_val])
        writers["val"].write(flat[token_is_val])
    for writer in writers.values():
        writer.close()
    return {
        "num_train_documents": num_docs["train"],
        "num_val_documents": num_docs["val"],
        "num_train_tokens": num_tokens["train"],
        "num_val_tokens": num_tokens["val"],
        "num_train_sequences": num_sequences["train"],
        "num_val_sequences": num_sequences["val"],
    }


# --------------------------------------------------------------------------------------------------
# Everything, cached


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


def _load_packed(path: Path, data_cfg: DataConfig, tokenizer=None) -> PackedData:
    stats = json.loads((path / "stats.json").read_text())
    train = np.load(path / "train.npy", mmap_mode="r")
    val = np.load(path / "val.npy", mmap_mode="r")
    if data_cfg.train_subset:
        train = train[: data_cfg.train_subset]
    if data_cfg.val_subset:
        val = val[: data_cfg.val_subset]
    stats.update(
        num_train_sequences=len(train),
        num_val_sequences=len(val),
        train_subset=data_cfg.train_subset,
        val_subset=data_cfg.val_subset,
        cache_dir=str(path),
    )
    if tokenizer is None:
        tokenizer = _load_saved_tokenizer(path / "tokenizer")
    return PackedData(train=train, val=val, tokenizer=tokenizer, stats=stats)


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
