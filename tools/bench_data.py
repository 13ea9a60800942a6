"""Data benchmark: token store preparation against the tokenizer's own speed, and the loader on large stores.

    python tools/bench_data.py [--size-gb 2] [--loader-gb 0.5 4] [--workdir /tmp/bench-data] [--vocab 32000]

(a) Preparation. A deterministic jsonl corpus of --size-gb (documents of paragraphs of the Python
    standard library's sources, drawn by a seeded RNG; 64 MB files) is tokenized into a store by
    `prepare_store` with 1 and 2 workers. Compared with the same byte-level BPE's `encode_batch` on the same
    texts in one thread (the limit per worker: a worker is one process with one tokenizer thread), and with a
    plain `datasets.map` tokenization of the same texts (the one-pass path the store replaced is gone).
(b) The loader. Stores of each --loader-gb size (the (a) store's shards repeated) are read by 2 processes
    (ranks 0 and 1 of a 2-process run, the train loader exactly as the Trainer builds it): tokens/s per rank
    and resident memory (RSS, and its anonymous part: what memory-mapped shards do not explain).

Run it on a quiet machine: the figures are per process and the default sizes take a while.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import sys
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the figures are per worker

MAX_FILE_BYTES = 64 * 2**20  # per corpus file = per shard; smaller corpora get 16 files, so 2 workers share them
ENCODE_BATCH = 256  # documents per encode_batch call, as the store's builder does


# ---- the corpus -----------------------------------------------------------------------------------
def paragraphs() -> list[str]:
    from pretrain.data.sources import _stdlib_files

    out = []
    for path in _stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        out += [p for p in text.split("\n\n") if p.strip()]
    return out


def file_size(size_bytes: int) -> int:
    return max(2**20, min(MAX_FILE_BYTES, size_bytes // 16))


def generate_corpus(directory: Path, size_bytes: int, seed: int = 0) -> list[Path]:
    """jsonl files of documents (3-60 paragraphs each) until size_bytes; the same bytes for the same seed."""
    done = directory / ".complete"
    if done.is_file() and json.loads(done.read_text()) == {"size_bytes": size_bytes, "seed": seed}:
        return sorted(directory.glob("*.jsonl"))
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    rng, pool = random.Random(seed), paragraphs()
    written, files, file_bytes = 0, [], file_size(size_bytes)
    while written < size_bytes:
        path = directory / f"part-{len(files):05d}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            size = 0
            while size < min(file_bytes, size_bytes - written):
                doc = "\n\n".join(rng.choice(pool) for _ in range(rng.randint(3, 60)))
                line = json.dumps({"text": doc}) + "\n"
                f.write(line)
                size += len(line.encode())
        written += size
        files.append(path)
    done.write_text(json.dumps({"size_bytes": size_bytes, "seed": seed}))
    return files


def texts_of(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


# ---- (a) preparation ------------------------------------------------------------------------------
def data_config(corpus: Path, store: Path, args):
    from pretrain.recipe.config import DataConfig

    return DataConfig(source=str(corpus), store=str(store), cache_dir=str(args.workdir / "cache"),
                      tokenizer_vocab_size=args.vocab, tokenizer_train_bytes=args.tokenizer_train_mb * 2**20,
                      val_fraction=0.001, seq_len=args.seq_len,
                      store_shard_bytes=file_size(int(args.size_gb * 2**30)))


def raw_encode(tokenizer, files: list[Path]) -> tuple[int, float]:
    """(tokens, seconds) of encode_batch over every document in batches, reading excluded."""
    backend, tokens, seconds = tokenizer.backend_tokenizer, 0, 0.0
    for path in files:
        texts = texts_of(path)
        start = time.perf_counter()
        for i in range(0, len(texts), ENCODE_BATCH):
            tokens += sum(len(e.ids) + 1 for e in backend.encode_batch_fast(texts[i:i + ENCODE_BATCH],
                                                                            add_special_tokens=False))
        seconds += time.perf_counter() - start
    return tokens, seconds


def datasets_map(tokenizer, files: list[Path], cache: Path) -> tuple[int, float]:
    """(tokens, seconds) of the usual one-pass tokenization: load_dataset("json") then a batched map."""
    import datasets

    ds = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train", cache_dir=str(cache))
    start = time.perf_counter()
    out = ds.map(lambda b: {"input_ids": tokenizer(b["text"], add_special_tokens=False)["input_ids"]},
                 batched=True, batch_size=ENCODE_BATCH, remove_columns=["text"], load_from_cache_file=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(ids) + 1 for batch in out.iter(batch_size=4096) for ids in batch["input_ids"])
    return tokens, seconds


def bench_prepare(args) -> Path:
    from pretrain.data import build_tokenizer, prepare_store

    corpus = args.workdir / f"corpus-{args.size_gb:g}gb"
    start = time.perf_counter()
    files = generate_corpus(corpus, int(args.size_gb * 2**30))
    num_bytes = sum(f.stat().st_size for f in files)
    print(f"corpus      {len(files)} jsonl file(s), {num_bytes / 2**20:,.0f} MiB at {corpus} "
          f"({time.perf_counter() - start:.0f}s)")
    tokenizer = build_tokenizer(data_config(corpus, args.workdir / "unused", args), log=lambda _: None)
    print(f"tokenizer   byte-level BPE, {len(tokenizer):,} tokens (trained on {args.tokenizer_train_mb} MiB)")

    tokens, seconds = raw_encode(tokenizer, files)
    raw = tokens / seconds
    print(f"raw         encode_batch, 1 thread: {tokens:,} tokens in {seconds:.1f}s = {raw / 1e6:.3f}M tokens/s")
    rates = {}
    for workers in (1, 2):
        store = args.workdir / f"store-{args.size_gb:g}gb-w{workers}"
        shutil.rmtree(store, ignore_errors=True)
        start = time.perf_counter()
        prepare_store(data_config(corpus, store, args), num_workers=workers, log=lambda _: None)
        seconds = time.perf_counter() - start
        manifest = json.loads((store / "manifest.json").read_text())
        tokens = manifest["num_train_tokens"] + manifest["num_val_tokens"]
        rates[workers] = tokens / seconds
        print(f"prepare     {workers} worker(s): {tokens:,} tokens in {seconds:.1f}s = {rates[workers] / 1e6:.3f}M "
              f"tokens/s = {rates[workers] / workers / raw:.2f} x raw per worker")
        if workers == 2:
            shutil.rmtree(store)
    print(f"scaling     2 workers / 1 worker = {rates[2] / rates[1]:.2f}x")
    tokens, seconds = datasets_map(tokenizer, files, args.workdir / "hf-cache")
    print(f"datasets    .map(tokenizer(batch), batched, 1 process): {tokens / seconds / 1e6:.3f}M tokens/s "
          f"= {tokens / seconds / raw:.2f} x raw")
    return args.workdir / f"store-{args.size_gb:g}gb-w1"


# ---- (b) the loader -------------------------------------------------------------------------------
def tile_store(source: Path, target: Path, size_bytes: int) -> None:
    """A store of about size_bytes of train tokens: the source store's shards repeated (copied, not linked,
    so the page cache sees size_bytes of distinct files)."""
    from pretrain.data.store import _write_json, shard_name, shard_records
    from pretrain.data.store_build import write_manifest

    manifest = json.loads((source / "manifest.json").read_text())
    records = list(shard_records(source, manifest))  # a format-2 manifest lists no shards: their records
    shutil.rmtree(target, ignore_errors=True)
    (target / "shards").mkdir(parents=True)
    shutil.copytree(source / "tokenizer", target / "tokenizer")
    shutil.copy(source / "build.json", target / "build.json")
    shards, written = [], 0
    while written < size_bytes:
        for shard in records:
            name = shard_name(len(shards))
            new = {"name": name, "inputs": shard["inputs"]}
            for split in ("train", "val"):
                old = shard[split]["file"]
                for suffix in ("", ".index", ".metadata", ".origin"):
                    shutil.copy(source / "shards" / f"{old}{suffix}", target / "shards" / f"{name}.{split}.ds{suffix}")
                new[split] = {**shard[split], "file": f"{name}.{split}.ds"}
            shards.append(new)
            _write_json(target / "shards" / f"{name}.json", new)
            written += shard["train"]["num_bytes"]
            if written >= size_bytes:
                break
    build = {k: v for k, v in manifest.items() if not k.startswith("num_") and k not in ("shards", "index", "content")}
    write_manifest(target, build, shards)  # the index and the manifest, as a build writes them


def _rank(rank: int, cfg, seconds: float, queue) -> None:
    import psutil

    from pretrain.data import open_store
    from pretrain.data.loader import build_train_loader
    from pretrain.recipe.batching import plan_batches
    from pretrain.recipe.config import BatchConfig

    data = open_store(cfg, log=lambda _: None)
    plan = plan_batches(BatchConfig(global_batch_size=16, micro_batch_size=8), 2, cfg.seq_len)
    loader, _ = build_train_loader(data, cfg, plan, rank, seed=0, start_step=0, pin_memory=False)
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for batch in loader:
            tokens += batch.input_ids.numel()
            if time.perf_counter() - start >= seconds:
                break
    elapsed = time.perf_counter() - start
    info = psutil.Process().memory_full_info()
    queue.put((rank, tokens / elapsed, info.rss, info.rss - info.shared, len(data.train)))


def bench_loader(args, source: Path) -> None:

    for gb in args.loader_gb:
        store = args.workdir / f"loader-{gb:g}gb"
        start = time.perf_counter()
        tile_store(source, store, int(gb * 2**30))
        cfg = data_config(args.workdir / f"corpus-{args.size_gb:g}gb", store, args)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(rank, cfg, args.loader_seconds, queue)) for rank in (0, 1)]
        for p in procs:
            p.start()
        results = sorted(queue.get() for _ in procs)
        for p in procs:
            p.join()
        size = sum(f.stat().st_size for f in (store / "shards").glob("*.train.ds"))
        print(f"loader      {size / 2**30:.2f} GiB store ({results[0][4]:,} train rows of {args.seq_len + 1}; "
              f"built in {time.perf_counter() - start:.0f}s), 2 processes, {args.loader_seconds:g}s each:")
        for rank, rate, rss, private, _ in results:
            print(f"              rank {rank}: {rate / 1e6:.2f}M tokens/s, RSS {rss / 2**20:,.0f} MiB "
                  f"(not shared with the page cache: {private / 2**20:,.0f} MiB)")
        shutil.rmtree(store)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="corpus size for (a), GiB (default 2)")
    parser.add_argument("--loader-gb", type=float, nargs="*", default=[0.5, 4.0],
                        help="store sizes for (b), GiB of train tokens (default 0.5 4); none: skip (b)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/pretrain-bench-data"))
    parser.add_argument("--vocab", type=int, default=32000, help="BPE vocabulary size (default 32000)")
    parser.add_argument("--tokenizer-train-mb", type=int, default=64, help="BPE training sample, MiB (default 64)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence for (b) (default 2048)")
    parser.add_argument("--loader-from", type=Path, default=None,
                        help="skip (a): tile this store (made by an earlier run of (a)) for (b)")
    parser.add_argument("--loader-seconds", type=float, default=20.0, help="seconds each rank reads (default 20)")
    args = parser.parse_args(argv)
    args.workdir = args.workdir.absolute()
    args.workdir.mkdir(parents=True, exist_ok=True)
    source = args.loader_from.absolute() if args.loader_from else bench_prepare(args)
    if args.loader_gb:
        bench_loader(args, source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
