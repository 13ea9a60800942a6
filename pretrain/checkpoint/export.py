"""A checkpoint of any layout as a transformers model directory: ``pretrain-export``'s work, and model.init_from's
view of a pretrain checkpoint (``step_N.hf`` beside ``step_N``), written once by the run's first process before
any process group exists while the others wait for it.

``export`` builds the recipe's model on the meta device for its config and writes it with the tokenizer through the
final model's writer (``build.save_pretrained_model``), the fp32 weights read one shard at a time from the checkpoint
(``pretrain.checkpoint.weights``: ZeRO's fp32 partitions gathered a tensor at a time, FSDP's DCP shards read by key)
and written as they are read (``pretrain.model.hf_save``), under a temporary name renamed into place: a view either
exists whole or not at all. Its peak memory is one shard (5 GB by default), not the model.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from pretrain.checkpoint.rundir import STATE_FILE, read_state
from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError

VIEW_WAIT_S = 6 * 3600.0  # a 70B export on one host takes tens of minutes; a rank that waits longer gives up


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
    from pretrain.checkpoint.weights import read_by_export

    # every file's size, and the checksums of the files the export reads (the weights'; not the optimizer's other
    # states, the scheduler or the random states): what it trusts is checked, and no more is read for it
    damage = verify_all(checkpoint, only=read_by_export(checkpoint))
    if damage:
        raise ConfigError(f"{checkpoint} is damaged ({damage}); export an older checkpoint, or restore this one "
                          "from a copy")


def export(checkpoint: Path, out: Path, log=print, shard_bytes: int | None = None) -> None:
    """``checkpoint`` (any layout) as a transformers model directory ``out``, its weights read and written a shard
    at a time (``shard_bytes``, default ``hf_save.SHARD_BYTES``): the peak memory is one shard plus the model's
    description, whatever the model's size."""
    check_paths(checkpoint, out)
    from pydantic import ValidationError

    from pretrain.checkpoint.state import TrainerState
    from pretrain.checkpoint.weights import open_weights
    from pretrain.data import build_tokenizer, sample_val_texts
    from pretrain.model.build import build_model, resolve_vocab_size, save_pretrained_model
    from pretrain.model.export_checks import check_tokenizer_round_trip
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
    with open_weights(checkpoint, log=log) as weights:
        expected = set(model.state_dict())
        missing = expected - set(weights.specs) - _tied(model)
        if missing:
            raise ConfigError(f"{checkpoint} lacks {len(missing)} of the recipe's model tensors "
                              f"(e.g. {sorted(missing)[:3]}); is it a checkpoint of this recipe?")
        specs = {k: v for k, v in weights.specs.items() if k in expected}
        if out.exists():
            out.rmdir()  # empty (checked): save_pretrained_model renames its temporary directory onto it
        out.parent.mkdir(parents=True, exist_ok=True)
        save_pretrained_model(model, None, tokenizer, out, texts, reader=(specs, weights.read),
                              shard_bytes=shard_bytes)
    log(f"export: step {state.step} of {checkpoint} -> {out} (transformers model, fp32, and tokenizer; "
        f"{time.perf_counter() - start:.1f}s)")


def _tied(model) -> set[str]:
    """Parameter names that save_pretrained drops because they are tied to another (the LM head)."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if model.config.tie_word_embeddings else set()


def prepare_init_from(recipe, launch: Launch, log=print, poll_s: float = 1.0, timeout_s: float = VIEW_WAIT_S) -> None:
    """model.init_from's files on this machine before any process group exists: a hub id's weights and tokenizer
    downloaded into the Hugging Face cache (every process; the hub's own file locks share one download), a pretrain
    checkpoint's transformers view written by global rank 0 while the others wait for it on the shared filesystem.
    Nothing to do for a local model directory, or when the run resumes its own checkpoint (``resuming``)."""
    from pretrain.recipe.init_from import HF_VIEW, hf_view, is_local, pretrain_checkpoint

    init_from = recipe.model.init_from
    if init_from is None:
        return
    checkpoint = pretrain_checkpoint(init_from)
    if checkpoint is None:
        if not is_local(init_from):
            from pretrain.model.pretrained import model_dir

            log(f"init_from: {init_from} in the Hugging Face cache: {model_dir(init_from)}")
        return
    from pretrain.checkpoint.reshard import stamp_view, view_problem

    view = hf_view(checkpoint)
    if launch.is_main:
        # Reused only while it is what this very checkpoint gave (its stamp: the source's manifest, the view's own
        # checksums); anything else is pretrain's own derived data, written again (model.init_from's weights are
        # read from it: a changed file would start the run from other weights).
        problem = view_problem(checkpoint, view, HF_VIEW)
        if problem is None:
            return
        if view.exists():
            log(f"init_from: {view} {problem}; writing it again from {checkpoint}")
            shutil.rmtree(view)
        else:
            log(f"init_from: writing {checkpoint}'s weights and tokenizer as a transformers model in {view} (once)")
        export(checkpoint, view, log=log)
        stamp_view(checkpoint, view, HF_VIEW)
        return
    # The others wait for a view whose stamp holds (sizes); they read it after rank 0 has joined the process group,
    # so after its check or rewrite.
    deadline = time.monotonic() + timeout_s
    while view_problem(checkpoint, view, HF_VIEW, checksums=False) is not None:
        if time.monotonic() > deadline:
            raise ConfigError(f"waited {timeout_s / 3600:.1f} h for rank 0 to write {view}; check rank 0's log, or "
                              f"write it once with pretrain-export {checkpoint} {view}")
        time.sleep(poll_s)
