"""The command line: ``pretrain <command> ...`` (also ``python -m pretrain``), one module per command.

Each command is also installed as its own script (``pretrain-launch``, ``pretrain-estimate``, ...).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pretrain.system.quiet import drop_torchao_import_messages

# Every pretrain-* command lives under pretrain.cli: transformers imports torchao where it is installed, and what
# that import logs is for nobody (pretrain/system/quiet.py, TORCHAO_IMPORT).
drop_torchao_import_messages()

# command -> (module with a main(argv) function, one line of help)
COMMANDS = {
    "train": ("pretrain.run", "train in this process (under accelerate launch: in each process)"),
    "launch": ("pretrain.cli.launch", "check a launch, then start accelerate launch"),
    "prepare-data": ("pretrain.cli.prepare_data", "tokenize and pack a recipe's data into the cache"),
    "estimate": ("pretrain.cli.estimate", "estimate memory per device for a recipe and a layout"),
    "plan": ("pretrain.cli.plan", "rank the layouts that fit a recipe on N GPUs"),
    "sweep": ("pretrain.cli.sweep", "measure tokens/s and memory over micro batch sizes"),
    "plot": ("pretrain.cli.plot", "plot a run's metrics.jsonl"),
    "slurm": ("pretrain.cli.slurm", "submit to SLURM with preemption-safe auto-resume; show a run's jobs"),
    "bench": ("pretrain.cli.bench", "time the training loop against a minimal accelerate loop"),
    "doctor": ("pretrain.cli.doctor", "check every rank of a launch (compute, memory, collectives, output_dir)"),
    "data": ("pretrain.cli.data", "which data a run read at a step, and which steps read a document"),
    "export": ("pretrain.cli.export", "write any checkpoint as a transformers model and tokenizer (CPU)"),
    "eval": ("pretrain.cli.evaluate", "score multiple-choice tasks on a checkpoint or an exported model"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "usage: pretrain <command> [options]\n\ncommands:\n" + "\n".join(lines) + (
        "\n\n`pretrain <command> --help` describes each command.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv[0] = f"pretrain {name}"
    return importlib.import_module(COMMANDS[name][0]).main(rest)


def add_recipe_arguments(parser, example: str = "recipes/tiny.yaml", overrides_example: str = "train.max_steps=40"):
    """--recipe R and the trailing key.path=value overrides, as every command that reads a recipe takes them."""
    parser.add_argument("--recipe", required=True, help=f"recipe YAML, e.g. {example}")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help=f"recipe overrides (values are YAML), e.g. {overrides_example}")


def recipe_parser(prog: str, description: str, example: str = "recipes/tiny.yaml",
                  overrides_example: str = "train.max_steps=40") -> argparse.ArgumentParser:
    """A command's parser that starts with --recipe and the overrides."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     epilog=f"Overrides: trailing key.path=value pairs applied to the recipe, "
                                     f"e.g. {overrides_example}")
    add_recipe_arguments(parser, example, overrides_example)
    return parser
