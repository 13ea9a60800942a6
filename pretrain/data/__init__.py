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
import glob
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.config import DataConfig
from pretrain.errors import DataError

# Bump a version when the code that produces the corresponding cache changes its output.
DOCUMENTS_VERSION = 1
TOKENIZER_VERSION = 1
PACKED_VERSION = 1

EOS_TOKEN = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
TOKENS_DTYPE = np.int32

Log = Callable[[str], Any]


@dataclass
class PackedData:
    """Packed token sequences of both splits, the tokenizer that made them and what it took."""

    train: np.ndarray  # int32 [num_train_sequences, seq_len + 1], usually a read-only memory map
    val: np.ndarray  # int32 [num_val_sequences, seq_len + 1]
    tokenizer: Any  # transformers.PreTrainedTokenizerFast with eos_token set
    stats: dict[str, Any]  # JSON-serialisable counts and provenance, see prepare_data


# --------------------------------------------------------------------------------------------------
# Small helpers


def cache_root(data_cfg: DataConfig) -> Path:
    """Where tokenizers and packed data are cached: data.cache_dir, $PRETRAIN_CACHE_DIR or ~/.cache/pretrain."""
    root = data_cfg.cache_dir or os.environ.get("PRETRAIN_CACHE_DIR") or "~/.cache/pretrain"
    return Path(root).expanduser().absolute()


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _count(n: float) -> str:
    """Human-readable count: 734, 12.3k, 3.19M."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{int(n)}"


def _default_num_proc() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))  # respects taskset / slurm cpu binding, unlike cpu_count
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


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


def _publish(tmp_dir: Path, target: Path) -> bool:
    """Rename a finished temporary directory into place. False if another process got there first."""
    try:
        os.rename(tmp_dir, target)
        return True
    except OSError:
        if not target.is_dir():
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)
        return False


def _make_tmp_dir(parent: Path, name: str) -> Path:
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=parent))
    path.chmod(0o755)  # mkdtemp makes it private; a cache may be shared by the users of a machine
    return path


def _find_data_error(exc: BaseException) -> DataError | None:
    """datasets wraps exceptions raised inside a generator; find ours to report it as it was raised."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, DataError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


# --------------------------------------------------------------------------------------------------
# Corpus: which files, their fingerprint, and the documents in them


@dataclass(frozen=True)
class _Corpus:
    kind: str  # "stdlib", "local" or "hf"
    files: tuple[tuple[str, str], ...]  # (path, format) in sorted path order; empty for hf
    key: str  # hash of everything that determines the documents
    description: str


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS]
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(files)


def _suffixes_for(fmt: str) -> tuple[str, ...]:
    return {
        "auto": TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES,
        "text": TEXT_SUFFIXES,
        "jsonl": JSONL_SUFFIXES,
        "parquet": PARQUET_SUFFIXES,
    }[fmt]


def _file_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    return "text"


def _local_files(data_cfg: DataConfig) -> list[Path]:
    source = data_cfg.source
    path = Path(source).expanduser()
    suffixes = _suffixes_for(data_cfg.format)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix.lower() in suffixes
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise DataError(
                f"data.source = {source!r}: the directory has no {' / '.join(suffixes)} files "
                f"(data.format = {data_cfg.format}); point data.source at a directory, file or glob of text, "
                "jsonl or parquet files"
            )
        return files
    if glob.has_magic(source):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(
                f"data.source = {source!r}: the glob matches no files; check the pattern (use ** for "
                "subdirectories) or give a file or directory"
            )
        return files
    raise DataError(
        f"data.source = {source!r}: no such file or directory (looked in {Path.cwd()}); give an existing file, "
        "directory or glob of .txt / .md / .jsonl / .parquet files, `stdlib` for the built-in corpus, "
        "or `hf:NAME` for a Hugging Face dataset"
    )


def _resolve_corpus(data_cfg: DataConfig) -> _Corpus:
    """Find the corpus and fingerprint it without reading it (stat only)."""
    source = data_cfg.source
    common = {
        "version": DOCUMENTS_VERSION,
        "text_field": data_cfg.text_field,
        "on_decode_error": data_cfg.on_decode_error,
    }
    if source.startswith("hf:"):
        name = source[3:]
        if not name:
            raise DataError("data.source = 'hf:' names no dataset; write it like hf:roneneldan/TinyStories")
        key = _hash({**common, "hf": name, "config": data_cfg.hf_config, "split": data_cfg.hf_split})
        return _Corpus("hf", (), key, f"hf:{name} (config {data_cfg.hf_config}, split {data_cfg.hf_split})")
    if source == "stdlib":
        kind, paths, fmt = "stdlib", _stdlib_files(), "text"
        description = f"Python {sys.version_info.major}.{sys.version_info.minor} standard library"
    else:
        kind, paths, fmt = "local", _local_files(data_cfg), data_cfg.format
        description = source
    files = tuple((str(p.absolute()), _file_format(p, fmt)) for p in paths)
    stats = []
    for path, file_fmt in files:
        st = os.stat(path)
        stats.append((path, file_fmt, st.st_size, st.st_mtime_ns))
    return _Corpus(kind, files, _hash({**common, "files": stats}), description)


def _decode(raw: bytes, policy: str) -> tuple[str | None, bool]:
    """(text, had_bad_bytes); text is None when the document is to be skipped."""
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        if policy == "skip":
            return None, True
        return raw.decode("utf-8", errors="replace"), True


def _clean_surrogates(text: str, policy: str) -> tuple[str | None, bool]:
    """JSON escapes can produce lone surrogates, which are not valid UTF-8 for Arrow or tokenizers."""
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:
        if policy == "skip":
            return None, True
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text), True


def _json_text(obj: Any, field: str, where: str) -> str | None:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with a {field!r} field, got {type(obj).__name__}")
    if field not in obj:
        fields = ", ".join(map(str, list(obj)[:20])) or "none"
        raise DataError(
            f"{where}: no field {field!r} (data.text_field); this record has fields: {fields}. "
            "Set data.text_field to the field that holds the text"
        )
    value = obj[field]
    if value is None:
        return None
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} is a {type(value).__name__}, not text")
    return value


def _json_records(path: str, field: str, policy: str) -> Iterator[tuple[str | None, bool]] | None:
    """Documents of a .json file holding one JSON value (a list of records or one record); None if the
    file is JSON lines instead. Non-UTF-8 bytes count once for the whole file; `skip` skips the file."""
    text, bad = _decode(_read_bytes(path), "replace")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            return None
        raise DataError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None

    def records():
        if bad and policy == "skip":
            yield None, True
            return
        for i, obj in enumerate(value if isinstance(value, list) else [value]):
            doc = _json_text(obj, field, f"{path}[{i}]")
            if doc is not None:
                doc, bad_doc = _clean_surrogates(doc, policy)
                yield doc, bad_doc or (bad and i == 0)

    return records()


def _jsonl_documents(path: str, field: str, policy: str) -> Iterator[tuple[str | None, bool]]:
    if path.lower().endswith(".json"):
        records = _json_records(path, field, policy)
        if records is not None:
            yield from records
            return
    try:
        f = open(path, "rb")  # streamed, not read whole: a .jsonl file may be larger than memory
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror}); fix its permissions or remove it") from None
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            text, bad = _decode(line, policy)
            if text is None:
                yield None, True
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}:{lineno}: invalid JSON ({exc.msg}); each line of a .jsonl file must be one JSON object"
                ) from None
            doc = _json_text(obj, field, f"{path}:{lineno}")
            if doc is not None:
                doc, bad_doc = _clean_surrogates(doc, policy)
                yield doc, bad or bad_doc


def _read_bytes(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read the file ({exc.strerror}); fix its permissions or remove it") from None


def _parquet_documents(path: str, field: str, policy: str) -> Iterator[tuple[str | None, bool]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: not a readable parquet file ({exc})") from None
    columns = parquet.schema_arrow.names
    if field not in columns:
        raise DataError(
            f"{path}: no column {field!r} (data.text_field); the columns are: {', '.join(columns)}. "
            "Set data.text_field to the column that holds the text"
        )
    for batch in parquet.iter_batches(columns=[field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            if value is None:
                continue
            if isinstance(value, bytes):
                yield _decode(value, policy)
            elif isinstance(value, str):
                yield value, False
            else:
                raise DataError(f"{path}: column {field!r} holds {type(value).__name__}, not text")


def _generate_documents(files: list[tuple[str, str]], text_field: str, on_decode_error: str):
    """Rows of the documents dataset; a skipped document is kept as "" so that it can be counted."""
    num_rows = 0
    for path, fmt in files:
        if fmt == "text":
            text, bad = _decode(_read_bytes(path), on_decode_error)
            if text is not None and text.startswith("\ufeff"):
                text = text[1:]
            docs: Iterator[tuple[str | None, bool]] = iter([(text, bad)])
        elif fmt == "jsonl":
            docs = _jsonl_documents(path, text_field, on_decode_error)
        else:
            docs = _parquet_documents(path, text_field, on_decode_error)
        for text, bad in docs:
            usable = text is not None and bool(text.strip())
            if bad:  # kept (as "" when unusable) so that load_documents can count it
                num_rows += 1
                yield {"text": text if usable else "", "decode_error": True}
            elif usable:
                num_rows += 1
                yield {"text": text, "decode_error": False}
    if num_rows == 0:  # datasets cannot build an empty split; one "" row is dropped like any empty one
        yield {"text": "", "decode_error": False}


def _load_files(data_cfg: DataConfig, corpus: _Corpus):
    import datasets

    features = datasets.Features({"text": datasets.Value("string"), "decode_error": datasets.Value("bool")})
    try:
        with _quiet_datasets():
            return datasets.Dataset.from_generator(
                _generate_documents,
                features=features,
                cache_dir=str(cache_root(data_cfg) / "datasets"),
                gen_kwargs={
                    "files": list(corpus.files),
                    "text_field": data_cfg.text_field,
                    "on_decode_error": data_cfg.on_decode_error,
                },
                fingerprint=corpus.key,
            )
    except Exception as exc:
        ours = _find_data_error(exc)
        if ours is not None:
            raise ours from None
        raise


def _load_hf(data_cfg: DataConfig, num_proc: int):
    import datasets

    name = data_cfg.source[3:]
    try:
        ds = datasets.load_dataset(name, data_cfg.hf_config, split=data_cfg.hf_split)
    except Exception as exc:
        raise DataError(
            f"data.source = {data_cfg.source!r}: the dataset could not be loaded ({type(exc).__name__}: {exc}). "
            "Check the name, data.hf_config and data.hf_split and the network connection, or download the "
            "data and point data.source at the local files"
        ) from None
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"data.source = {data_cfg.source!r}: expected one split, got {type(ds).__name__}")
    field = data_cfg.text_field
    if field not in ds.column_names:
        raise DataError(
            f"data.source = {data_cfg.source!r} has no column {field!r} (data.text_field); its columns are: "
            f"{', '.join(ds.column_names)}. Set data.text_field to the column that holds the text"
        )
    dtype = getattr(ds.features[field], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise DataError(
            f"data.source = {data_cfg.source!r}: column {field!r} (data.text_field) holds {ds.features[field]}, "
            "not text; set data.text_field to the column that holds the text"
        )
    ds = ds.select_columns([field])
    if field != "text":
        ds = ds.rename_column(field, "text")
    return ds.filter(
        _non_empty, batched=True, num_proc=num_proc if len(ds) >= 10_000 else None, desc="drop empty documents"
    )


def _non_empty(batch: dict[str, list]) -> list[bool]:
    return [isinstance(t, str) and bool(t.strip()) for t in batch["text"]]


@contextlib.contextmanager
def _quiet_datasets():
    """datasets logs a line per cache hit/miss at WARNING on some paths; our own log says what happened."""
    import datasets

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)


def _load_documents(data_cfg: DataConfig, corpus: _Corpus, log: Log):
    """(documents dataset with one column "text", number of documents with non-UTF-8 bytes)."""
    import pyarrow.compute as pc

    if corpus.kind == "hf":
        ds, num_bad = _load_hf(data_cfg, data_cfg.num_proc or _default_num_proc()), 0
    else:
        ds = _load_files(data_cfg, corpus)
        num_bad = int(pc.sum(ds.data.column("decode_error")).as_py() or 0)
        if num_bad:
            action = "skipped" if data_cfg.on_decode_error == "skip" else "replaced with U+FFFD"
            log(f"data: {num_bad} documents had non-UTF-8 bytes: {action}")
        keep = pc.greater(pc.utf8_length(ds.data.column("text")), 0).to_numpy(zero_copy_only=False)
        if not keep.all():
            ds = ds.select(np.flatnonzero(keep))
        ds = ds.remove_columns("decode_error")
    if len(ds) == 0:
        raise DataError(
            f"data.source = {data_cfg.source!r} has no text: every document is empty"
            + (" or was skipped for non-UTF-8 bytes (data.on_decode_error=skip)" if num_bad else "")
            + "; point data.source at files with text"
        )
    return ds, num_bad


def load_documents(data_cfg: DataConfig, log: Log = print):
    """The corpus as a ``datasets.Dataset`` with one column "text": one row per document, in a fixed order.

    ``stdlib``: one document per standard-library .py file. A local text file is one document, a jsonl
    line or parquet row is one document. Empty (whitespace-only) documents are dropped.
    """
    return _load_documents(data_cfg, _resolve_corpus(data_cfg), log)[0]


# --------------------------------------------------------------------------------------------------
# Train / val split by document


def _split_hashes(docs) -> np.ndarray:
    """uint64 per document: the first 8 bytes of sha1(text)."""
    hashes = np.empty(len(docs), dtype=np.uint64)
    i = 0
    for batch in docs.iter(batch_size=1000):
        for text in batch["text"]:
            hashes[i] = int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "big")
            i += 1
    return hashes


def _val_mask(hashes: np.ndarray, val_fraction: float) -> np.ndarray:
    """True for validation documents; see the module docstring for the rules."""
    is_val = hashes < np.uint64(min(int(val_fraction * 2**64), 2**64 - 1))
    if len(hashes) >= 2:
        if not is_val.any():
            is_val[np.argmin(hashes)] = True
        if is_val.all():
            is_val[np.argmax(hashes)] = False
    else:
        is_val[:] = False  # a single document is split inside its token stream
    return is_val


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


class _Documents:
    """The documents and their split, loaded on first use (a cache hit never needs them)."""

    def __init__(self, data_cfg: DataConfig, corpus: _Corpus, log: Log):
        self.data_cfg, self.corpus, self.log = data_cfg, corpus, log
        self._loaded = None

    def get(self):
        """(docs, is_val, num_decode_errors)."""
        if self._loaded is None:
            docs, num_bad = _load_documents(self.data_cfg, self.corpus, self.log)
            is_val = _val_mask(_split_hashes(docs), self.data_cfg.val_fraction)
            self._loaded = (docs, is_val, num_bad)
        return self._loaded


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
