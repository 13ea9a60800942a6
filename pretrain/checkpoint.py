"""Checkpoints that survive a kill at any moment and resume exactly.

A checkpoint is ``accelerator.save_state`` (model, optimizer, scheduler, grad scaler, RNG of every
process) plus ``trainer_state.json`` (step, tokens seen, data cursor, recipe), written into
``checkpoints/.tmp-step_XXXXXXXX`` and renamed to ``step_XXXXXXXX`` only when complete; then the
``latest`` pointer is replaced atomically. The data cursor is the optimizer step: the sample order is
a pure function of (seed, step), see ``pretrain/loader.py``. Resume reads ``latest`` (or, if it is
missing, the newest complete checkpoint by the step recorded inside it, never by folder name).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from pretrain.config import CheckpointConfig
from pretrain.errors import ConfigError
from pretrain.rundir import (
    CHECKPOINTS_DIR,
    LATEST_FILE,
    STATE_FILE,
    complete_checkpoints,
    latest_checkpoint,
    read_state,
)

# Recipe keys whose change makes a checkpoint unusable: the weights' shapes or the sample stream differ.
# Anything else (horizon, lr, precision, kernels, logging) may change on resume, with a logged warning.
_MUST_MATCH = (
    *(f"model.{k}" for k in ("arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                             "intermediate_size", "vocab_size", "tie_embeddings", "config_overrides")),
    *(f"data.{k}" for k in ("source", "format", "text_field", "hf_config", "hf_split", "tokenizer",
                            "tokenizer_vocab_size", "seq_len", "train_subset", "val_fraction", "shuffle",
                            "drop_last", "on_decode_error")),
    "batch.global_batch_size",
    "train.seed",
)


def _lookup(tree: dict, dotted: str):
    node: Any = tree
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += _diff(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else key)
        return out
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


class Checkpointer:
    def __init__(self, accelerator: Accelerator, output_dir: Path, cfg: CheckpointConfig, log=print):
        self.accelerator = accelerator
        self.dir = Path(output_dir) / CHECKPOINTS_DIR
        self.cfg = cfg
        self.log = log

    # ---- cadence -------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

    # ---- finding a checkpoint -------------------------------------------------------------------
    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        return complete_checkpoints(self.dir.parent)

    def latest(self) -> Path | None:
        return latest_checkpoint(self.dir.parent)

    def resume_path(self) -> Path | None:
        """The checkpoint to resume from according to checkpoint.resume, or None to start fresh."""
        resume = self.cfg.resume
        if resume == "none":
            if self.complete_checkpoints():
                raise ConfigError(
                    f"checkpoint.resume=none but {self.dir} already holds checkpoints; resume them with "
                    "checkpoint.resume=auto, or choose a new output_dir (nothing is overwritten)"
                )
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        if read_state(path) is None:
            raise ConfigError(
                f"checkpoint.resume = {resume!r} is not a complete checkpoint directory (no {STATE_FILE}); "
                f"give a path like {self.dir}/step_00000100, or use auto / none"
            )
        return path

    # ---- save / load ------------------------------------------------------------------------------
    def save(self, step: int, trainer_state: dict[str, Any]) -> Path:
        acc = self.accelerator
        name = f"step_{step:08d}"
        final, tmp = self.dir / name, self.dir / f".tmp-{name}"
        if acc.is_main_process:
            self.dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a run killed while saving
        acc.wait_for_everyone()
        start = time.perf_counter()
        acc.save_state(str(tmp), safe_serialization=True)
        acc.wait_for_everyone()
        if acc.is_main_process:
            state = {**trainer_state, "step": step, "saved_at": time.time()}
            # The state file is written last: a directory without it is never resumed from.
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
            if final.exists():
                shutil.rmtree(final)  # the same step saved again after a resume: the new one is equivalent
            os.rename(tmp, final)
            pointer_tmp = self.dir / f".{LATEST_FILE}.tmp"
            pointer_tmp.write_text(name + "\n")
            os.replace(pointer_tmp, self.dir / LATEST_FILE)
            self._prune(keep=final)
            self.log(f"checkpoint: saved step {step} to {final} ({time.perf_counter() - start:.1f}s)")
        acc.wait_for_everyone()
        return final

    def _prune(self, keep: Path) -> None:
        if self.cfg.keep_last == 0:
            return
        complete = self.complete_checkpoints()
        for _, path in complete[: max(0, len(complete) - self.cfg.keep_last)]:
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)

    def load(self, path: Path, recipe: dict[str, Any]) -> dict[str, Any]:
        """Restore everything from ``path``; returns its trainer state. Refuses an incompatible recipe."""
        state = read_state(path)
        assert state is not None
        saved = state.get("recipe", {})
        changed = [key for key in _MUST_MATCH if _lookup(saved, key) != _lookup(recipe, key)]
        if changed:
            details = "; ".join(d for key in changed for d in _diff(_lookup(saved, key), _lookup(recipe, key), key))
            raise ConfigError(
                f"cannot resume from {path}: the recipe changed where an exact continuation needs it unchanged "
                f"({details}); restore those values, set checkpoint.resume=none with a new output_dir, "
                "or delete the checkpoints"
            )
        other = [d for d in _diff(saved, recipe) if not d.startswith(("checkpoint.", "logging."))]
        if other:
            self.log(f"resume: recipe differs from the checkpoint's in: {'; '.join(other)}")
        self.accelerator.load_state(str(path))
        self.log(f"resume: continuing from {path} at step {state['step']}")
        return state
