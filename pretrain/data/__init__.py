"""Data: corpus -> documents -> train/val split -> tokenizer -> a token store -> rows of seq_len + 1 tokens.

Preparing and training are two steps. ``pretrain-prepare-data --recipe R --workers N`` (``prepare_data``)
writes the recipe's token store (a mixture: one per source); a run only opens it (``open_data``). A
single-node launch whose store is missing prepares it before the process group exists (``ensure_data``:
local rank 0 builds, the other processes poll for the manifest); a multi-node launch stops with the
command to run.

Building a store:

1. Resolve ``data.source`` to a list of files (or an ``hf:`` dataset) and fingerprint it cheaply from
   (path, size, mtime_ns). The store's key is a hash of that fingerprint, the tokenizer's identity and
   ``val_fraction``; it lives at ``data.store`` or ``cache_root/stores/<key>/``.
2. Get the tokenizer: a pretrained one, or a byte-level BPE trained on a bounded sample of the training
   documents (all of a corpus of at most ``data.tokenizer_train_bytes``, else the first share of every
   file), cached on its own.
3. Cut the corpus into shards by input file (consecutive files up to ``data.store_shard_bytes``; ``hf:`` in row
   ranges), independent of the number of workers, and tokenize the shards in N processes. Each
   document's tokens are followed by eos and go to the shard's train or val file by a hash of the text.
   A shard's files are written under temporary names and renamed; its record is written last, and a
   rerun keeps complete shards. The manifest (tokenizer identity, sources and their fingerprints,
   counts, dtype, every shard's checksums) is written when all shards are done.

The split is by document and depends on nothing but the text: a document goes to val when the first 8
bytes of sha1(text) read as a fraction fall below ``val_fraction``. It is the same for any training
seed, file order, file name or number of workers, and identical documents always land on the same side.
If no document falls below the threshold (tiny corpora) the document with the smallest hash goes to val;
if all of them do, the one with the largest hash stays in train. A corpus of a single document is split
inside its token stream instead: the last ``val_fraction`` of its tokens (at least one) are the
validation stream, and each part ends with eos (the BPE tokenizer is then trained on all of it).

Reading: each split is the concatenation of its shards' token files in shard (= corpus) order, cut into
rows of ``seq_len + 1`` tokens (the trainer takes inputs = row[:-1] and targets = row[1:]); the remainder
that does not fill a row is dropped. Rows are read from memory-mapped shard files, so a rank holds
O(number of shards) memory whatever the corpus size; ``seq_len``, ``train_subset`` and ``val_subset``
apply when the store is opened, so changing them reuses it.

The modules, in the order of the flow (each imports only those listed before it):

- ``cache``: where the cache is, the keys and versions of its entries, publishing an entry atomically.
- ``sources``: which corpus ``data.source`` names, and its fingerprint.
- ``readers``: the documents in one text / jsonl / parquet file; the data.on_decode_error policy.
- ``split``: the train / val split by document hash.
- ``documents``: the corpus's documents: as a ``datasets.Dataset`` (``load_documents``), per shard, sampled.
- ``tokenizer``: pretrained tokenizers and the cached byte-level BPE (``build_tokenizer``).
- ``store``: the store's on-disk format: shard writers, the manifest, rows read from memory maps.
- ``store_build``: shards planned, tokenized in parallel and resumed; the split's tie rules; the manifest.
- ``prepare``: one store: ``locate_store``, ``prepare_store``, ``open_store``, ``ensure_store``.
- ``mixture``: ``data.mixture``, one store per source and a shared tokenizer; ``prepare_data``, ``open_data``,
  ``ensure_data`` take a mixture or a single source.
"""

from pretrain.data.cache import cache_root
from pretrain.data.documents import load_documents, sample_val_texts
from pretrain.data.mixture import (
    MixtureData,
    MixtureRows,
    check_data,
    data_changes,
    data_identity,
    ensure_data,
    open_data,
    planned_data_identity,
    prepare_data,
)
from pretrain.data.prepare import StoreMissing, ensure_store, locate_store, open_store, prepare_store
from pretrain.data.store import PackedData
from pretrain.data.tokenizer import build_tokenizer

__all__ = [
    "MixtureData",
    "MixtureRows",
    "PackedData",
    "StoreMissing",
    "build_tokenizer",
    "cache_root",
    "check_data",
    "data_changes",
    "data_identity",
    "ensure_data",
    "ensure_store",
    "load_documents",
    "locate_store",
    "open_data",
    "open_store",
    "planned_data_identity",
    "prepare_data",
    "sample_val_texts",
    "prepare_store",
]
