"""The tokenizer: a pretrained one (local or from the hub) checked for what packing needs, or a byte-level
BPE trained on a bounded sample of the training documents (data.tokenizer_train_bytes) and cached under
cache_root/tokenizers/<key>/."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pretrain.data.cache import CACHE_FIX, TOKENIZER_VERSION, _hash, _make_tmp_dir, _publish, cache_root
from pretrain.data.documents import Log, _sample_train_texts
from pretrain.data.sources import _Corpus, _resolve_corpus
from pretrain.errors import DataError, writable_dir
from pretrain.recipe.config import DataConfig

EOS_TOKEN = "<|endoftext|>"


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
            "train_bytes": data_cfg.tokenizer_train_bytes,
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


def _load_saved_tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _batches(texts: list[str], size: int = 1000) -> Iterator[list[str]]:
    for start in range(0, len(texts), size):
        yield texts[start : start + size]


def _get_tokenizer(data_cfg: DataConfig, corpus: _Corpus | None, log: Log):
    """(tokenizer, identity string for cache keys, description)."""
    if data_cfg.tokenizer != "bpe":
        tok = _load_pretrained_tokenizer(data_cfg)
        identity = _tokenizer_identity(tok)
        log(f"tokenizer: {data_cfg.tokenizer} ({len(tok):,} tokens, eos {tok.eos_token!r})")
        return tok, identity, data_cfg.tokenizer
    key = _bpe_key(data_cfg, corpus)
    return _cached_bpe(data_cfg, key, lambda: _sample_train_texts(data_cfg, corpus, data_cfg.tokenizer_train_bytes),
                       log), key, f"bpe-{data_cfg.tokenizer_vocab_size}"


def _mixture_bpe_key(data_cfg: DataConfig, sources: list[tuple[str, float, _Corpus]]) -> str:
    """A mixture's BPE: trained on every source's sample, so each source's documents and weight are part of it."""
    return _hash(
        {
            "version": TOKENIZER_VERSION,
            "mixture": [[name, weight, corpus.key] for name, weight, corpus in sources],
            "vocab_size": data_cfg.tokenizer_vocab_size,
            "val_fraction": data_cfg.val_fraction,
            "train_bytes": data_cfg.tokenizer_train_bytes,
        }
    )


def _get_mixture_tokenizer(data_cfg: DataConfig, sources: list[tuple[str, float, DataConfig, _Corpus]], log: Log):
    """(tokenizer, identity, description) of a mixture: a pretrained tokenizer as for one source, or a BPE
    trained on a weighted sample: each source gives at most weight x data.tokenizer_train_bytes bytes of its
    training documents (sampled as one source's are), so the vocabulary follows the mixture."""
    if data_cfg.tokenizer != "bpe":
        return _get_tokenizer(data_cfg, None, log)
    key = _mixture_bpe_key(data_cfg, [(name, weight, corpus) for name, weight, _, corpus in sources])

    def sample() -> list[str]:
        texts: list[str] = []
        for _, weight, source_cfg, corpus in sources:
            texts += _sample_train_texts(source_cfg, corpus, max(1, int(weight * data_cfg.tokenizer_train_bytes)))
        return texts

    return _cached_bpe(data_cfg, key, sample, log), key, f"bpe-{data_cfg.tokenizer_vocab_size}"


def _cached_bpe(data_cfg: DataConfig, key: str, sample: Callable[[], list[str]], log: Log):
    """The byte-level BPE cached under ``key``, trained on ``sample()`` and published first if missing."""
    target = cache_root(data_cfg) / "tokenizers" / key
    if target.is_dir():
        tok = _load_saved_tokenizer(target)
        log(f"tokenizer: cached byte-level BPE, {len(tok):,} tokens, at {target}")
        return tok
    # Before the training, which a cache this user cannot write would throw away.
    writable_dir(target.parent, f"data: the tokenizer cache {target.parent}", CACHE_FIX, DataError)
    start = time.perf_counter()
    texts = sample()
    tok = _train_bpe(_batches(texts), len(texts), data_cfg.tokenizer_vocab_size)
    tmp = _make_tmp_dir(target.parent, key)
    tok.save_pretrained(str(tmp))
    _publish(tmp, target)
    log(
        f"tokenizer: trained byte-level BPE on {len(texts):,} training documents in "
        f"{time.perf_counter() - start:.1f}s, {len(tok):,} tokens, cached at {target}"
    )
    return _load_saved_tokenizer(target)


def build_tokenizer(data_cfg: DataConfig, log: Log = print):
    """The tokenizer of data.tokenizer: a byte-level BPE trained on a sample of the training documents
    (cached under cache_root/tokenizers/<key>/), or a local / hub tokenizer. It always has an eos_token."""
    corpus = _resolve_corpus(data_cfg) if data_cfg.tokenizer == "bpe" else None
    return _get_tokenizer(data_cfg, corpus, log)[0]
