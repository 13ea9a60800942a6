"""Tokenize and pack a recipe's data ahead of training, and show what it holds.

    pretrain-prepare-data --recipe recipes/tiny.yaml [key.path=value ...]

The result is cached exactly where training looks for it (see pretrain/data.py), so a run started
afterwards loads it in well under a second.
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
        ("cache", stats["cache_dir"]),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prepare_data",
        description="Tokenize and pack a recipe's data into the cache that training reads.",
    )
    add_recipe_arguments(parser, "recipes/tiny.yaml")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        from pretrain.data import prepare_data  # heavy imports only once the recipe is valid

        data = prepare_data(recipe.data)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(format_stats(data.stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
