"""Tokenize a recipe's data into its token store ahead of training, and show what it holds.

    pretrain-prepare-data --recipe recipes/tiny.yaml [--workers N] [key.path=value ...]
    pretrain-prepare-data --recipe R --slurm --array N [sbatch options]   (pretrain/data/array_build.py)

The store is written exactly where training looks for it (data.store, or the cache; see
pretrain/data/__init__.py; a data.mixture: one store per source, the tokenizer first) by N processes on
this machine, or (one source) by the N tasks of a SLURM array job, byte-identical either way. A rerun after
an interruption keeps the finished shards. A run started afterwards only opens it. `--task I --num-tasks N`
and `--finish` are the steps the array's jobs run.
"""

from __future__ import annotations

import argparse
import signal
import sys

from pretrain.cli import add_recipe_arguments
from pretrain.cli.options import add_sbatch_options, count
from pretrain.errors import EXIT_INTERRUPTED, EXIT_USAGE, ConfigError
from pretrain.recipe.config import load_recipe


def format_stats(stats: dict) -> str:
    """What the store holds; a mixture: the shared tokenizer, then each source's store."""
    tokenizer = [("tokenizer", f"{stats['tokenizer']} ({stats['vocab_size']:,} tokens, eos id {stats['eos_token_id']})")]
    if "mixture" not in stats:
        return _table(tokenizer + _source_rows(stats))
    blocks = [_table(tokenizer)]
    for name, source in stats["mixture"].items():
        blocks.append(f"\nsource {name!r} (weight {source['weight']:.4g})\n" + _table(_source_rows(source)))
    return "\n".join(blocks)


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _source_rows(stats: dict) -> list[tuple[str, str]]:
    seq_len = stats["seq_len"]
    return [
        (
            "data.source",
            f"{stats['source']} ({stats['corpus']})" if stats["corpus"] != stats["source"] else stats["source"],
        ),
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


def add_slurm_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SLURM (with --slurm)")
    group.add_argument("--slurm", action="store_true",
                       help="submit the tokenization as a SLURM array job instead of running it here")
    group.add_argument("--array", type=count(), metavar="N", help="array tasks (one node each); shard i goes to task i mod N")
    group.add_argument("--max-running", type=count(), metavar="M", help="at most M tasks at once (--array=0-N%%M)")
    group.add_argument("--cpus-per-task", type=count(), metavar="C",
                       help="#SBATCH --cpus-per-task; each task's default --workers is what SLURM gives it")
    add_sbatch_options(group)
    group.add_argument("--dry-run", action="store_true", help="print the batch scripts; submit nothing")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain-prepare-data",
        description="Tokenize a recipe's data into the token store that training reads.",
    )
    add_recipe_arguments(parser, "recipes/tiny.yaml")
    parser.add_argument("--workers", type=count(), default=None, metavar="N",
                        help="tokenizing processes on this machine (default: data.num_proc, else min(cores, 8))")
    add_slurm_arguments(parser)
    parser.add_argument("--verify", action="store_true",
                        help="hash every shard file of a complete store against its record's SHA-256 with --workers "
                        "processes (a damaged shard is named, exit 2); resumable: shards recorded in "
                        "<store>/verified.jsonl whose files are unchanged are not hashed again. Opening a store checks "
                        "each shard's size as it is read, and every checksum only of a store up to 1 GiB")
    steps = parser.add_argument_group("the steps of an array build (what the SLURM jobs run)")
    steps.add_argument("--task", type=count(0), metavar="I", help="tokenize only the shards i with i mod --num-tasks == I")
    steps.add_argument("--num-tasks", type=count(), metavar="N", help="the number of tasks that share the shards")
    steps.add_argument("--finish", action="store_true",
                       help="write the manifest once every shard is complete; tokenize nothing")
    return parser


def check_steps(args: argparse.Namespace) -> None:
    if (args.task is None) != (args.num_tasks is None):
        raise ConfigError("--task I and --num-tasks N go together (task I of N takes the shards i with i mod N == I)")
    if args.task is not None and not 0 <= args.task < args.num_tasks:
        raise ConfigError(f"--task {args.task} --num-tasks {args.num_tasks}: the task must be 0 .. {args.num_tasks - 1}")
    if args.task is not None and args.finish:
        raise ConfigError("--finish runs after every --task; give one of them")


def main(argv: list[str] | None = None) -> int:
    from pretrain.data import array_build  # the data package only when the command runs (module level it was not)

    args = build_parser().parse_intermixed_args(argv)
    # SIGTERM (a scheduler, kill) stops the build as Ctrl-C does: the pool ended, one line on what was kept.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        check_steps(args)
        array_build.check_arguments(args)
        recipe = load_recipe(args.recipe, args.overrides)
        if recipe.data.mixture and (args.slurm or args.task is not None or args.finish):
            raise ConfigError(
                "--slurm (and its --task / --finish steps) prepares the store of one data.source; a data.mixture "
                "is prepared on one machine: pretrain-prepare-data --recipe R --workers N (one store per source)"
            )
        if recipe.model.init_from is not None:  # its tokenizer (and a hub model's weights) before tokenizing
            from pretrain.checkpoint.export import prepare_init_from
            from pretrain.distributed.layout import Launch
            from pretrain.trust import enforce

            enforce()  # a pretrain checkpoint's view reads it weights-only (pretrain/trust.py)
            prepare_init_from(recipe, Launch.from_env())
        if args.slurm:
            return array_build.prepare_on_slurm(args, recipe)
        # heavy imports only once the recipe is valid
        from pretrain.data import open_store, prepare_data
        from pretrain.data.prepare import finish_store, prepare_store_part

        if args.task is not None:
            prepare_store_part(recipe.data, args.task, args.num_tasks, args.workers, progress=True)
            return 0
        # --verify: opened without the checksums of a small store, then every store hashed in parallel, resumably
        checksums = False if args.verify else None
        if args.finish:
            data = open_store(recipe.data, target=finish_store(recipe.data), checksums=checksums)
        else:
            data = prepare_data(recipe.data, num_workers=args.workers, progress=True, checksums=checksums)
        if args.verify:
            from pathlib import Path

            from pretrain.data.prepare import verify_stores

            stores = data.sources.values() if hasattr(data, "sources") else [data]
            verify_stores([Path(store.identity["store"]) for store in stores], args.workers)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as exc:  # build.BuildInterrupted says what was kept
        print(f"interrupted: {exc}" if str(exc) else "interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(format_stats(data.stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
