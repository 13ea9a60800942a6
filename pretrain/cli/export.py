"""pretrain-export: any checkpoint as a transformers model, to evaluate an intermediate step.

    pretrain-export runs/tiny/checkpoints/step_00000200 exported/tiny-200
    pretrain export CHECKPOINT OUT

Writes OUT as ``save_pretrained`` (safetensors, fp32) plus the tokenizer, the same way a run writes its
``final_model/`` (``pretrain.model.build.save_pretrained_model``), from a checkpoint of any layout (DDP or one
process, DeepSpeed ZeRO-0..3, FSDP sharded or full), on CPU, with no process group and no GPU. The
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
import time
from pathlib import Path

from pretrain.checkpoint.rundir import STATE_FILE, read_state
from pretrain.errors import EXIT_USAGE, ConfigError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pretrain-export",
        description="Write a checkpoint (any layout) as a transformers save_pretrained model (fp32) and tokenizer.",
    )
    parser.add_argument("checkpoint", help="a checkpoint directory, e.g. runs/tiny/checkpoints/step_00000200")
    parser.add_argument("out", help="the model directory to write (must not exist, or be empty)")
    return parser.parse_args(argv)


def check_paths(checkpoint: Path, out: Path) -> None:
    if read_state(checkpoint) is None:
        raise ConfigError(
            f"{checkpoint} is not a complete checkpoint (no readable {STATE_FILE}); give a directory like "
            "<output_dir>/checkpoints/step_00000200"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not an empty directory; choose a new OUT (nothing is "
                          "overwritten)")
    from pretrain.checkpoint.integrity import verify_all

    damage = verify_all(checkpoint)  # reads the checkpoint once more, in this one process
    if damage:
        raise ConfigError(f"{checkpoint} is damaged ({damage}); export an older checkpoint, or restore this one "
                          "from a copy")


def export(checkpoint: Path, out: Path, log=print) -> None:
    check_paths(checkpoint, out)
    from pydantic import ValidationError

    from pretrain.checkpoint.checkpointer import TrainerState
    from pretrain.checkpoint.reshard import full_state_dict
    from pretrain.data import build_tokenizer, sample_val_texts
    from pretrain.model.build import build_model, resolve_vocab_size, save_pretrained_model
    from pretrain.model.export import check_tokenizer_round_trip
    from pretrain.recipe.config import Recipe, renamed_keys

    start = time.perf_counter()
    state = TrainerState.read(checkpoint)
    try:
        recipe = Recipe.model_validate(renamed_keys(state.recipe))  # an older pretrain's keys
    except ValidationError as exc:
        raise ConfigError(f"the recipe recorded in {checkpoint / STATE_FILE} does not validate with this version "
                          f"of pretrain ({exc.error_count()} problems, first: {exc.errors()[0]['msg']} at "
                          f"{'.'.join(map(str, exc.errors()[0]['loc']))}); export with the version that wrote it") from None
    tokenizer = build_tokenizer(recipe.data, log=log)
    vocab = resolve_vocab_size(recipe.model, len(tokenizer))
    model = build_model(recipe.model, vocab, recipe.data.seq_len, seed=recipe.train.seed, meta=True)
    texts = sample_val_texts(recipe.data)
    check_tokenizer_round_trip(model.config, tokenizer, texts)  # before any file of OUT is written
    weights = full_state_dict(checkpoint, log=log)
    expected = set(model.state_dict())
    missing = expected - set(weights) - _tied(model)
    if missing:
        raise ConfigError(f"{checkpoint} lacks {len(missing)} of the recipe's model tensors "
                          f"(e.g. {sorted(missing)[:3]}); is it a checkpoint of this recipe?")
    if out.exists():
        out.rmdir()  # empty (checked): save_pretrained_model renames its temporary directory onto it
    out.parent.mkdir(parents=True, exist_ok=True)
    save_pretrained_model(model, {k: v for k, v in weights.items() if k in expected}, tokenizer, out,
                          texts)
    log(f"export: step {state.step} of {checkpoint} -> {out} (transformers model, fp32, and tokenizer; "
        f"{time.perf_counter() - start:.1f}s)")


def _tied(model) -> set[str]:
    """Parameter names that save_pretrained drops because they are tied to another (the LM head)."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if model.config.tie_word_embeddings else set()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pretrain.trust import enforce

    enforce()  # every torch.load of the export is weights-only (pretrain/trust.py)
    try:
        export(Path(args.checkpoint), Path(args.out))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
