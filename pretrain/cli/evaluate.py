"""pretrain-eval: downstream multiple-choice tasks on one checkpoint or one exported model.

    pretrain-eval --checkpoint runs/tiny/checkpoints/step_00000300 --task recipes/tasks/stdlib_lines.jsonl
    pretrain-eval --model runs/tiny/final_model --task hellaswag.jsonl --limit 500

One process (CUDA if there is one, else CPU), fp32 weights. The scoring and the task format are the run's
(``pretrain/train/downstream.py``; docs/evaluation.md): a checkpoint scores as the in-loop evaluation of its
step does, with the recipe's seq_len as the window.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pretrain.cli.options import count
from pretrain.errors import EXIT_USAGE, ConfigError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pretrain-eval",
        description="Score multiple-choice tasks (jsonl: context, choices, gold) by log-likelihood: acc, acc_norm.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a checkpoint directory of any layout, e.g. "
                        "runs/tiny/checkpoints/step_00000300")
    source.add_argument("--model", help="a transformers model directory with its tokenizer (a run's final_model/, "
                        "a pretrain-export output)")
    parser.add_argument("--task", action="append", required=True,
                        help="a jsonl task file (repeat for several); its name is the file's stem")
    parser.add_argument("--limit", type=count(1), default=None, help="score only the first N examples of each task")
    parser.add_argument("--batch-tokens", type=count(1, 2**24), default=8192,
                        help="padded tokens per forward call, the longest requests first (default 8192)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pretrain.trust import enforce

    enforce()  # every torch.load below is weights-only (pretrain/trust.py)
    try:
        results = evaluate(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def evaluate(args: argparse.Namespace) -> dict:
    from pretrain.train.downstream import read_task

    tasks = [read_task(path, limit=args.limit, key=f"--task {path}") for path in args.task]  # before any model
    import torch

    from pretrain.train.downstream import evaluate_model, load_checkpoint_model, load_exported_model

    log = (lambda _message: None) if args.json else print
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.checkpoint:
        model, tokenizer, window, step = load_checkpoint_model(Path(args.checkpoint), device, log=log)
        source = {"checkpoint": args.checkpoint, "step": step}
    else:
        model, tokenizer, window = load_exported_model(Path(args.model), device)
        source = {"model": args.model}
    scores = evaluate_model(model, tokenizer, window, tasks, args.batch_tokens, device)
    for task, score in zip(tasks, scores, strict=True):
        log(score.line(task))
    return {**source, "tasks": {task.name: {"acc": s.acc, "acc_norm": s.acc_norm, "num_examples": s.num_examples,
                                            "chance": task.chance, "seconds": round(s.seconds, 3)}
                                for task, s in zip(tasks, scores, strict=True)}}


if __name__ == "__main__":
    sys.exit(main())
