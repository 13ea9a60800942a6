"""data.document_masking: a packed row with per-document attention is its documents run one by one."""

from __future__ import annotations

import importlib.util
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pretrain.checkpoint.resume import check_compatible
from pretrain.data.loader import Collate, DocumentMasking
from pretrain.errors import ConfigError
from pretrain.model.build import build_model
from pretrain.recipe.config import DOCUMENT_MASKING_ARCHS, ModelConfig, load_recipe
from tests.helpers import FAST, TINY, check_ok, train, val_losses

EOS, VOCAB, SEQ = 3, 128, 16
# Two rows of seq_len + 1 tokens of an eos-joined stream: a row may start inside a document or with the
# eos that ends one, hold an empty document (eos eos), end with an eos, or hold no boundary at all.
ROWS = np.array([
    [5, 6, 7, EOS, 9, 10, EOS, EOS, 11, 12, 13, 14, 15, EOS, 20, 21, 22],
    [EOS, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, EOS],
    [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, EOS, 66],
])
POSITIONS = [
    [0, 1, 2, 3, 0, 1, 2, 0, 0, 1, 2, 3, 4, 5, 0, 1],
    [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
]
ARCH_FIELDS = {"llama": dict(num_kv_heads=2, intermediate_size=64), "mistral": dict(num_kv_heads=2, intermediate_size=64),
               "qwen2": dict(num_kv_heads=2, intermediate_size=64), "gpt_neox": dict(intermediate_size=64), "gpt2": {}}


def documents(position_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document, from where the positions restart."""
    out = []
    for row, positions in enumerate(position_ids):
        starts = [*(positions == 0).nonzero().flatten().tolist(), len(positions)]
        out += [(row, s, e) for s, e in itertools.pairwise(starts)]
    return out


def token_losses(model, input_ids, targets, **kwargs) -> torch.Tensor:
    logits = model(input_ids=input_ids, **kwargs).logits
    return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")


def one_by_one(model, batch) -> torch.Tensor:
    """Each document alone, with the targets its positions have in the row."""
    out = torch.empty(batch.targets.shape, dtype=torch.float32, device=batch.targets.device)
    for row, s, e in documents(batch.position_ids.cpu()):
        out[row, s:e] = token_losses(model, batch.input_ids[row:row + 1, s:e], batch.targets[row:row + 1, s:e])[0]
    return out


def test_positions_restart_after_each_eos_and_targets_are_unchanged():
    plain = Collate()(ROWS)
    batch = Collate(DocumentMasking(EOS, varlen=False))(ROWS)
    assert batch.position_ids.tolist() == POSITIONS
    # The eos keeps its target (the next document's first token): every position is still a target.
    assert torch.equal(batch.input_ids, plain.input_ids) and torch.equal(batch.targets, plain.targets)
    assert batch.attention_kwargs().keys() == {"position_ids"} and plain.attention_kwargs() == {}
    assert batch.cu_seq_lens is None


def test_varlen_arguments_are_what_transformers_derives_from_flattened_positions():
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    batch = Collate(DocumentMasking(EOS, varlen=True))(ROWS)
    (cu_q, cu_k), (max_q, _) = prepare_fa_kwargs_from_position_ids(batch.position_ids.reshape(1, -1))
    assert torch.equal(batch.cu_seq_lens, cu_q) and torch.equal(batch.cu_seq_lens, cu_k)
    assert batch.cu_seq_lens.dtype == torch.int32 and isinstance(batch.max_length, int)
    assert batch.max_length == int(max_q) == SEQ
    # Every row starts a document of the flattened batch, so no document spans two rows.
    assert {0, SEQ, 2 * SEQ, 3 * SEQ} <= set(batch.cu_seq_lens.tolist())
    kwargs = batch.to("cpu").attention_kwargs()
    assert kwargs.keys() == {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", DOCUMENT_MASKING_ARCHS)
def test_packed_loss_equals_the_documents_run_one_by_one(arch, attention):
    model_cfg = ModelConfig(arch=arch, hidden_size=32, num_layers=2, num_heads=4, attention=attention,
                            **ARCH_FIELDS[arch])
    model = build_model(model_cfg, VOCAB, SEQ, seed=0).eval()
    batch = Collate(DocumentMasking(EOS, varlen=False))(ROWS)
    with torch.no_grad():
        separate = one_by_one(model, batch)
        packed = token_losses(model, batch.input_ids, batch.targets, **batch.attention_kwargs())
        unmasked = token_losses(model, batch.input_ids, batch.targets)
        # The loss train.py computes: shift_labels, normalised by the number of targets (all positions).
        loss = model(input_ids=batch.input_ids, labels=batch.targets, shift_labels=batch.targets,
                     num_items_in_batch=batch.targets.numel(), **batch.attention_kwargs()).loss
    assert (packed - separate).abs().max() < 1e-5
    assert abs(loss.item() - separate.mean().item()) < 1e-5
    # Without the position ids, tokens after a boundary see the document before it.
    assert (unmasked - separate).abs().max() > 1e-3
    assert torch.allclose(unmasked[2], separate[2], atol=1e-5)  # the row without a boundary is unchanged


def test_resume_may_switch_document_masking_with_a_warning():
    saved = load_recipe(TINY).to_dict()
    changed = load_recipe(TINY, ["data.document_masking=true"]).to_dict()
    assert check_compatible(Path("ckpt"), saved, changed) == ["data.document_masking: False -> True"]


def test_unverified_architecture_is_refused_at_recipe_load():
    with pytest.raises(ConfigError, match=r"data.document_masking=true is not supported for model.arch = 'phi3'"):
        load_recipe(TINY, ["data.document_masking=true", "model.arch=phi3"])
    assert load_recipe(TINY, ["model.arch=phi3"]).data.document_masking is False


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs the flash-attn package")
def test_flash_attention_2_varlen_equals_the_documents_run_one_by_one():
    model_cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                            attention="flash_attention_2")
    model = build_model(model_cfg, VOCAB, SEQ, seed=0).to("cuda", torch.bfloat16).eval()
    batch = Collate(DocumentMasking(EOS, varlen=True))(ROWS).to("cuda")
    with torch.no_grad():
        separate = one_by_one(model, batch)
        packed = token_losses(model, batch.input_ids, batch.targets, **batch.attention_kwargs())
        positions_only = token_losses(model, batch.input_ids, batch.targets, position_ids=batch.position_ids)
    # bf16: the same kernel on the same documents, up to the rounding of the differently shaped calls.
    assert (packed - separate).abs().mean() < 2e-3 and (packed - separate).abs().max() < 1e-2
    # flash_attention_2 reads packed position ids only for one row: with MBS > 1 they would not be enough.
    assert (positions_only - separate).abs().max() > 5e-2


@pytest.mark.slow
def test_tiny_run_with_document_masking(tmp_path):
    """Short documents, so that rows hold boundaries; a DataLoader worker computes the positions."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "the cat sat on a mat while data flows through tokens and every model learns words".split()
    rng = np.random.default_rng(0)
    for i in range(120):
        (corpus / f"doc{i:03d}.txt").write_text(" ".join(rng.choice(words, size=rng.integers(5, 40))))
    common = [*FAST, "train.max_steps=3", f"data.source={corpus}", "data.tokenizer_vocab_size=300",
              f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.2"]
    masked, plain = tmp_path / "masked", tmp_path / "plain"
    check_ok(train([*common, "data.document_masking=true", "data.num_workers=1", f"output_dir={masked}"]))
    unmasked = train([*common, "train.max_steps=1", "lr_schedule.warmup_steps=0", f"output_dir={plain}"])
    check_ok(unmasked)
    # the store does not depend on the masking: the second run opens it, builds nothing
    assert "from the store at" in unmasked.stdout and "built in" not in unmasked.stdout
    val = val_losses(masked)
    assert sorted(val) == [0, 3] and all(math.isfinite(v) for v in val.values())
    # The same untrained weights on the same validation rows: only the attention differs.
    assert abs(val[0] - val_losses(plain)[0]) > 1e-4
    assert "document_masking: true" in (masked / "recipe.resolved.yaml").read_text()
