"""pretrain-export: any checkpoint as a transformers model, to evaluate an intermediate step.

    pretrain-export runs/tiny/checkpoints/step_00000200 exported/tiny-200
    pretrain export CHECKPOINT OUT

Writes OUT as ``save_pretrained`` (safetensors, fp32) plus the tokenizer, the same way a run writes its
``final_model/`` (``pretrain.model.build.save_pretrained_model``), from a checkpoint of any layout (DDP or one
process, DeepSpeed ZeRO-0..3, FSDP sharded or full), on CPU, with no process group and no GPU, one shard
(``--max-shard-size``, 5GB) at a time: the export of a 70B checkpoint holds one shard, not the model. The
weights are the fp32 ones the optimizer updates (ZeRO's fp32 master partitions, merged): cast them with
``from_pretrained(..., dtype=torch.bfloat16)`` to evaluate in the recipe's precision. The model's config
and tokenizer come from the recipe recorded in the checkpoint; the tokenizer is read from the data cache
(a byte-level BPE missing there is trained again on the recipe's data). The config carries the tokenizer's
bos / eos / pad ids and ``use_cache: true``, and the tokenizer is checked on a sample of the validation text to
load through ``AutoTokenizer`` with the training ids (saved so that it does, or refused naming the difference).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrain.checkpoint.export import export
from pretrain.errors import EXIT_USAGE, ConfigError

__all__ = ["export", "main"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pretrain-export",
        description="Write a checkpoint (any layout) as a transformers save_pretrained model (fp32) and tokenizer.",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory, e.g. runs/tiny/checkpoints/step_00000200")
    parser.add_argument("out", help="the model directory to write (must not exist, or be empty)")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="the largest safetensors file of OUT, e.g. 5GB or 500MB (default 5GB): the weights are "
                        "read and written one such shard at a time, so this bounds the export's memory")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pretrain.trust import enforce

    enforce()  # every torch.load of the export is weights-only (pretrain/trust.py)
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        shard_bytes = parse_size_to_int(args.max_shard_size)
    except ValueError:
        print(f"error: --max-shard-size {args.max_shard_size!r} is not a size; write it like 5GB or 500MB",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        export(Path(args.checkpoint), Path(args.out), shard_bytes=shard_bytes)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
