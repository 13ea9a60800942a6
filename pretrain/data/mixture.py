"""A data mixture (``data.mixture``): several weighted sources, one token store each, one tokenizer for all;
and the entry points that take either a mixture or a single source (``prepare_data``, ``open_data``,
``ensure_data``).

Each source is a single source of its own (``DataConfig.source_config``): its store is located, built,
resumed and checked exactly as one source's, at ``data.store/<name>`` or under the cache by its key. The
tokenizer is shared: a pretrained one, or a byte-level BPE trained on a weighted sample of the sources'
training documents (each gives at most weight x ``data.tokenizer_train_bytes`` bytes; see
``tokenizer._get_mixture_tokenizer``), so a source's store key includes the whole mixture's tokenizer.

A run reads a mixture through ``MixtureRows``: the sources' training rows side by side in one index space
(source i's row j is ``offsets[i] + j``), so that the loader's batches are lists of ints as for one source;
which rows a step takes is the loader's ``MixtureSampleOrder``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pretrain.data.documents import Log
from pretrain.data.prepare import (
    StoreMissing,
    StoreTarget,
    check_store,
    corpus_file_changes,
    ensure_store,
    ensure_stores,
    find_store,
    locate_store,
    open_store,
    planned_identity,
    prepare_store,
    store_ready,
)
from pretrain.data.sources import _resolve_corpus
from pretrain.data.store import STREAM_FIELDS, PackedData, TokenRows
from pretrain.data.tokenizer import _get_mixture_tokenizer, _mixture_bpe_key
from pretrain.errors import DataError
from pretrain.recipe.config import DataConfig


@contextlib.contextmanager
def _source(name: str):
    """Errors about one source say which source of the mixture they concern."""
    try:
        yield
    except DataError as exc:
        raise type(exc)(f"data.mixture source {name!r}: {exc}") from None


@dataclass
class SourceTarget:
    name: str
    weight: float  # normalised
    data_cfg: DataConfig  # the source as a single source (DataConfig.source_config)
    target: StoreTarget


def locate_mixture(data_cfg: DataConfig, log: Log = print, load_tokenizer: bool = False) -> list[SourceTarget]:
    """Every source's store and identity (stat only, as for one source). The shared tokenizer is loaded
    when it is pretrained, or with ``load_tokenizer`` (a BPE: trained first if it is not cached)."""
    weights = data_cfg.mixture_weights()
    sources = []
    for name, weight in weights.items():
        with _source(name):
            source_cfg = data_cfg.source_config(name)
            sources.append((name, weight, source_cfg, _resolve_corpus(source_cfg)))
    if data_cfg.tokenizer == "bpe" and not load_tokenizer:
        key = _mixture_bpe_key(data_cfg, [(name, weight, corpus) for name, weight, _, corpus in sources])
        tokenizer = (None, key, f"bpe-{data_cfg.tokenizer_vocab_size}")
    else:
        tokenizer = _get_mixture_tokenizer(data_cfg, sources, log)
    out = []
    for name, weight, source_cfg, corpus in sources:
        with _source(name):
            out.append(SourceTarget(name, weight, source_cfg, locate_store(source_cfg, log, tokenizer, corpus)))
    return out


def prepare_mixture(data_cfg: DataConfig, num_workers: int | None = None, log: Log = print,
                    progress: bool = False) -> list[SourceTarget]:
    """Build every source's store that is not complete (the tokenizer first, if a store needs it)."""
    sources = locate_mixture(data_cfg, log)
    missing = []
    for source in sources:
        with _source(source.name):
            if not store_ready(source.target):
                missing.append(source)
    if missing and missing[0].target.tokenizer is None:
        sources = locate_mixture(data_cfg, log, load_tokenizer=True)
        missing = [s for s in sources if s.name in {m.name for m in missing}]
    for source in missing:
        log(f"data: source {source.name!r} (weight {source.weight:.4g}): {source.data_cfg.source}")
        with _source(source.name):
            prepare_store(source.data_cfg, num_workers, log, progress, target=source.target)
    return sources


class MixtureRows:
    """The sources' training rows in one index space: source i's row j is index ``offsets[i] + j``.
    Indexing with an int gives one row, with an array a [len, row_len] int64 array (read per source)."""

    def __init__(self, names: list[str], parts: list[TokenRows]):
        self.names, self.parts = names, parts
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts], dtype=np.int64)])
        self.row_len = parts[0].row_len

    @property
    def rows_per_source(self) -> dict[str, int]:
        return {name: len(part) for name, part in zip(self.names, self.parts, strict=True)}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, (int, np.integer)):
            source = int(np.searchsorted(self.offsets, index, side="right")) - 1
            return self.parts[source].row(int(index - self.offsets[source]))
        indices = np.asarray(index, dtype=np.int64).reshape(-1)
        out = np.empty((len(indices), self.row_len), dtype=np.int64)
        which = np.searchsorted(self.offsets, indices, side="right") - 1
        for source in np.unique(which):
            mask = which == source
            out[mask] = self.parts[source][indices[mask] - self.offsets[source]]
        return out


@dataclass
class MixtureData:
    """A mixture's stores opened: every source's rows, the shared tokenizer, the weights, the counts."""

    train: MixtureRows  # the sources' training rows in one index space
    sources: dict[str, PackedData]  # each source's store, in the recipe's order
    weights: dict[str, float]  # normalised, in the recipe's order
    tokenizer: Any
    stats: dict[str, Any]  # JSON-serialisable: the shared tokenizer, and per source its store's counts


def open_mixture(data_cfg: DataConfig, log: Log = print,
                 prepare_command: str = "pretrain-prepare-data --recipe RECIPE",
                 checksums: bool | None = None) -> MixtureData:
    """Every source's store opened (StoreMissing if one is not prepared, DataError if one was made for other
    data or another tokenizer, the error naming the source)."""
    opened: dict[str, PackedData] = {}
    tokenizer = None
    for source in locate_mixture(data_cfg, log):
        log(f"data: source {source.name!r}, weight {source.weight:.4g}:")
        with _source(source.name):
            target = replace(source.target, tokenizer=source.target.tokenizer or tokenizer)
            opened[source.name] = open_store(source.data_cfg, log, target, prepare_command, checksums)
        tokenizer = tokenizer or opened[source.name].tokenizer
    weights = data_cfg.mixture_weights()
    first = next(iter(opened.values())).stats
    stats = {
        "tokenizer": first["tokenizer"],
        "vocab_size": first["vocab_size"],
        "eos_token_id": first["eos_token_id"],
        "seq_len": data_cfg.seq_len,
        "num_train_sequences": sum(d.stats["num_train_sequences"] for d in opened.values()),
        "num_val_sequences": sum(d.stats["num_val_sequences"] for d in opened.values()),
        "mixture": {name: {"weight": weights[name], **data.stats} for name, data in opened.items()},
    }
    train = MixtureRows(list(opened), [d.train for d in opened.values()])
    return MixtureData(train=train, sources=opened, weights=weights, tokenizer=tokenizer, stats=stats)


# ---- either a mixture or one source ------------------------------------------------------------------


def prepare_data(data_cfg: DataConfig, log: Log = print, num_workers: int | None = None,
                 progress: bool = False, checksums: bool | None = None) -> PackedData | MixtureData:
    """The recipe's store(s), built first where needed, opened (see the pretrain.data docstring); ``checksums``:
    True verifies every shard file's SHA-256 (pretrain-prepare-data --verify), None as open_store decides."""
    if data_cfg.mixture:
        prepare_mixture(data_cfg, num_workers, log, progress)
        return open_mixture(data_cfg, log, checksums=checksums)
    return open_store(data_cfg, log, prepare_store(data_cfg, num_workers, log, progress), checksums=checksums)


def open_data(data_cfg: DataConfig, log: Log = print,
              prepare_command: str = "pretrain-prepare-data --recipe RECIPE") -> PackedData | MixtureData:
    """The recipe's prepared store(s), opened; StoreMissing with ``prepare_command`` if one is not there."""
    if data_cfg.mixture:
        return open_mixture(data_cfg, log, prepare_command)
    return open_store(data_cfg, log, prepare_command=prepare_command)


def ensure_data(data_cfg: DataConfig, launch, prepare_command: str, log: Log = print, poll_s: float = 1.0) -> None:
    """The recipe's store(s) exist before the process group does (``prepare.ensure_stores``)."""
    if not data_cfg.mixture:
        ensure_store(data_cfg, launch, prepare_command, log, poll_s)
        return
    sources = locate_mixture(data_cfg, log=lambda _: None)
    ensure_stores([s.target for s in sources], launch,
                  lambda: prepare_mixture(data_cfg, log=log, progress=launch.world_size == 1),
                  prepare_command, log, poll_s)


def check_data(data_cfg: DataConfig, num_nodes: int, prepare_command: str) -> None:
    """Before a launch, in one process (pretrain-launch, pretrain-slurm): ``prepare.check_store`` for one
    source; for a mixture, a multi-node launch needs every source's store, refused with the command that
    prepares them all."""
    if not data_cfg.mixture:
        check_store(data_cfg, num_nodes, prepare_command)
        return
    if num_nodes == 1:
        return  # a single node prepares missing stores itself, before the process group (ensure_data)
    missing = [s for s in locate_mixture(data_cfg, log=lambda _: None) if not store_ready(s.target)]
    if missing:
        where = ", ".join(f"{s.name!r} at {s.target.path}" for s in missing)
        raise StoreMissing(
            f"data: the mixture has no token store for source(s) {where}; a {num_nodes}-node launch does not "
            "tokenize (every node would wait on one). Prepare them once, on a machine that sees the data and "
            f"these paths, then launch again:\n    {prepare_command.splitlines()[0]}"
        )


# ---- what a checkpoint was trained on ----------------------------------------------------------------

SINGLE = "data"  # the name of a single source's store in an identity; a mixture's are "mixture:<name>"


def data_identity(data: PackedData | MixtureData) -> dict[str, dict[str, Any]]:
    """Every opened store's ``store_identity``, by name: what a checkpoint records as the data it was trained on."""
    if isinstance(data, MixtureData):
        return {f"mixture:{name}": packed.identity for name, packed in data.sources.items()}
    return {SINGLE: data.identity}


def planned_data_identity(data_cfg: DataConfig, log: Log = print) -> dict[str, tuple[dict[str, Any], DataConfig]]:
    """What the recipe's store(s) are made from, before any is built or opened (a stat of the corpus, the
    tokenizer's identity; a named store's manifest), by name, each with its single-source data section."""
    if not data_cfg.mixture:
        return {SINGLE: (planned_identity(find_store(data_cfg, log)), data_cfg)}
    return {f"mixture:{s.name}": (planned_identity(s.target), s.data_cfg) for s in locate_mixture(data_cfg, log)}


def _stream_value(identity: dict[str, Any], key: str) -> Any:
    """A field of an identity as compared: a tokenizer by its identity (a digest of its vocabulary, merges and
    EOS: the token ids), not its name, which for a tokenizer.json is its path: the same file moved to another
    directory (another cluster, a copied run) writes the same ids. A manifest adds counts, not compared."""
    value = identity.get(key)
    if key == "tokenizer" and isinstance(value, dict):
        return value["identity"] if value.get("identity") is not None else value["name"]
    return value


def _label(name: str) -> str:
    return "data.source" if name == SINGLE else f"data.mixture source {name.partition(':')[2]!r}"


def data_changes(saved: dict[str, dict[str, Any]], planned: dict[str, tuple[dict[str, Any], DataConfig]],
                 opened: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """How the data a checkpoint was trained on (``saved``: its ``data_identity``) differs from what this run
    reads: ``planned`` (before building), and with ``opened`` (the opened stores' identities) their contents.
    [] when the token stream is the same."""
    changes = []
    for name in sorted(set(saved) | set(planned)):
        label = _label(name)
        if name not in planned or name not in saved:
            changes.append(f"{label}: {'only in the checkpoint' if name not in planned else 'not in the checkpoint'}")
            continue
        old, (new, source_cfg) = saved[name], planned[name]
        for key in STREAM_FIELDS:
            if _stream_value(old, key) == _stream_value(new, key):
                continue
            if key == "corpus_fingerprint":
                files = corpus_file_changes(old["store"], source_cfg)
                changes.append(f"{label}: the files of {old['corpus']} changed since the checkpoint"
                               + (f" ({files})" if files else f" (fingerprint {old[key]} -> {new[key]}; the store "
                                  f"trained on, {old['store']}, no longer lists them)"))
            elif key == "tokenizer":
                changes.append(f"{label}: tokenizer {old[key]['name']} (identity {old[key]['identity']}) -> "
                               f"{new[key]['name']} (identity {new[key]['identity']})"
                               + (": a BPE trained on the changed files" if old[key]["name"].startswith("bpe-")
                                  and old.get("corpus_fingerprint") != new.get("corpus_fingerprint") else ""))
            else:
                changes.append(f"{label}: {key} {old.get(key)!r} -> {new.get(key)!r}")
        if opened is not None and not changes and name in opened and old.get("content") != opened[name]["content"]:
            changes.append(f"{label}: the token store at {opened[name]['store']} holds other tokens than the one "
                           f"trained on (content {old.get('content')} -> {opened[name]['content']}: shard checksums)")
    return changes
