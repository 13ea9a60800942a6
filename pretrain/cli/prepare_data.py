"""Tokenize a recipe's data into its token store ahead of training, and show what it holds.

    pretrain-prepare-data --recipe recipes/tiny.yaml [--workers N] [key.path=value ...]

The store is written exactly where training looks for it (data.store, or the cache; see
pretrain/data/__init__.py) by N processes on this machine, byte-identical for any N. A rerun after an
interruption keeps the finished shards. A run started afterwards only opens it.
"""

from __future__ import annotations

import argparse
import sys

from pretrain.cli import add_recipe_arguments
from pretrain.config import load_recipe
from pretrain.errors import EXIT_USAGE, ConfigError


def format_stats(stats: dict) -> str:
    seq_len = stats["seq_len"]
    rows = [
        (
            "data.source",
            f"{stats['source']} ({stats['corpus']})" if stats["corpus"] != stats["source"] else stats["source"],
        ),
        ("tokenizer", f"{stats['tokenizer']} ({stats['vocab_size']:,} tokens, eos id {stats['eos_token_id']})"),
        (
            "documents",
            f"{stats['num_documents']:,} ({stats['num_train_documents']:,} train / {stats['num_val_documents']:,} val)",
        ),
        ("tokens", f"{stats['num_train_tokens']:,} train / {stats['num_val_tokens']:,} val"),
        (
            "sequences",
            f"{stats['num_train_sequences']:,} train / {stats['num_val_sequences']:,} val, "
            f"{seq_len + 1} tokens each (seq_len {seq_len} + 1)",
        ),
        ("non-UTF-8 documents", f"{stats['num_decode_errors']:,} ({stats['on_decode_error']})"),
        ("store", f"{stats['cache_dir']} ({stats['num_shards']} shard(s), {stats['dtype']} tokens)"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prepare_data",
        description="Tokenize a recipe's data into the token store that training reads.",
    )
    add_recipe_arguments(parser, "recipes/tiny.yaml")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="tokenizing processes on this machine (default: data.num_proc, else min(cores, 8))")
    args = parser.parse_args(argv)
    try:
        if args.workers is not None and args.workers < 1:
            raise ConfigError(f"--workers {args.workers}: give at least 1 process")
        recipe = load_recipe(args.recipe, args.overrides)
        from pretrain.data import prepare_data  # heavy imports only once the recipe is valid

        data = prepare_data(recipe.data, num_workers=args.workers, progress=True)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(format_stats(data.stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
