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

The modules, in the order of the flow (each imports only those listed before it):

- ``cache``: where the cache is, the keys and versions of its entries, publishing an entry atomically.
- ``sources``: which corpus ``data.source`` names, and its fingerprint.
- ``readers``: the documents in one text / jsonl / parquet file; the data.on_decode_error policy.
- ``split``: the train / val split by document hash.
- ``documents``: the corpus read into a ``datasets.Dataset`` (``load_documents``), and its split.
- ``tokenizer``: pretrained tokenizers and the cached byte-level BPE (``build_tokenizer``).
- ``store``: the packed arrays on disk (``PackedData``): writing the rows, memory-mapping them back.
- ``packing``: tokenizing with ``Dataset.map`` and cutting each split's token stream into rows.
- ``prepare``: ``prepare_data``, all of the above cached as one entry.
"""

from pretrain.data.cache import cache_root
from pretrain.data.documents import load_documents
from pretrain.data.prepare import prepare_data
from pretrain.data.store import PackedData
from pretrain.data.tokenizer import build_tokenizer

__all__ = ["PackedData", "build_tokenizer", "cache_root", "load_documents", "prepare_data"]
