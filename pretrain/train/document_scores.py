"""A rollback's window scored per document: the loss per token of each document the window's rows held, by the
model the rollback reloaded.

One forward per micro-batch of the window (steps back_to + 1 .. stop, as the attempt given up read them), under
no_grad, the model in eval mode and back in train mode after; nothing else. Each target token's loss is the
document's its target belongs to: row i of a split is tokens [i x row_len, (i+1) x row_len) of the store's stream
(``provenance.row_spans``), the loader's inputs are the row's [:-1] and targets its [1:]. Each rank scores its own
micro-batches (every rank runs the same number of forwards: FSDP's and ZeRO-3's are collective) and the per-document
sums (loss, tokens) are gathered to every rank, so every rank ranks alike.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from accelerate.utils import gather_object

from pretrain.data.loader import Collate, RankBatchSampler
from pretrain.data.provenance import row_spans
from pretrain.data.quarantine import origin, source_parts

SCORES_DIR = "rollback_scores"
# The ranking's score: the loss per token shrunk towards the window's mean as if PRIOR_TOKENS more tokens at that mean
# had been read. The tail of one document and the first tokens of the next share a row: a fragment of 2 tokens at a
# document's start is hard to predict whatever the document, and ranked by its raw mean it would outrank a whole
# document of noise.
PRIOR_TOKENS = 16
Document = tuple[str, str, int]  # (source, file, document index): store coordinates


def _add_row(sums: dict, spans, losses: np.ndarray, source: str) -> None:
    """Row token j + 1 is target j: span [c_i, c_i+1) of the row holds targets [c_i - 1, c_i+1 - 1)."""
    cumulative = np.concatenate([[0.0], np.cumsum(losses, dtype=np.float64)])
    begin = 0
    for span in spans:
        end = begin + span.stop - span.start
        lo, hi = max(begin - 1, 0), min(end - 1, len(losses))
        if hi > lo:
            total = sums[(source, span.file, span.document)]
            total[0] += cumulative[hi] - cumulative[lo]
            total[1] += hi - lo
        begin = end


@torch.no_grad()
def score_window(model, accelerator, data, order, plan, rank: int, first_step: int, stop_step: int,
                 masking=None) -> list[dict[str, Any]]:
    """Every document of optimizer steps [first_step, stop_step) (0-based) of ``order``, ranked by loss per token
    (``score``: shrunk by PRIOR_TOKENS), highest first: {source, file, document, loss_per_token, tokens, score}, the
    same list on every rank."""
    names, parts, offsets, _ = source_parts(data)
    dataset, collate = data.train, Collate(masking)
    sampler = RankBatchSampler(order, plan, rank)
    sums: dict[Document, list] = defaultdict(lambda: [0.0, 0])
    was_training = model.training
    model.eval()
    try:
        for step in range(first_step, stop_step):
            for indices in sampler.micro_batch_indices(step):
                batch = collate(dataset[np.asarray(indices)]).to(accelerator.device)
                logits = model(input_ids=batch.input_ids, **batch.attention_kwargs()).logits
                for row, index in enumerate(indices):  # one row at a time: fp32 logits of one sequence
                    losses = F.cross_entropy(logits[row].float(), batch.targets[row], reduction="none")
                    source = int(np.searchsorted(offsets, index, side="right")) - 1
                    local = int(index) - int(offsets[source])
                    # expensive device-to-host synchronization: one per sequence, only at a rollback
                    _add_row(sums, row_spans(parts[source], local), losses.cpu().numpy(), names[source])
                del logits
    finally:
        if was_training:
            model.train()
    gathered = gather_object([(doc, loss, tokens) for doc, (loss, tokens) in sums.items()])
    merged: dict[Document, list] = defaultdict(lambda: [0.0, 0])
    for doc, loss, tokens in gathered:
        merged[tuple(doc)][0] += loss
        merged[tuple(doc)][1] += tokens
    total_loss, total_tokens = sum(v[0] for v in merged.values()), sum(v[1] for v in merged.values())
    mean = total_loss / max(total_tokens, 1)
    scores = [{"source": s, "file": f, "document": d, "loss_per_token": loss / tokens, "tokens": tokens,
               "score": (loss + PRIOR_TOKENS * mean) / (tokens + PRIOR_TOKENS)}
              for (s, f, d), (loss, tokens) in merged.items() if tokens]
    scores.sort(key=lambda r: (-r["score"], r["source"], r["file"], r["document"]))
    return scores


def write_scores(output_dir: Path, rollback: int, scores: list[dict[str, Any]]) -> Path:
    """``output_dir/rollback_scores/rollback-NNNN.jsonl``: one JSON line per document, highest loss first."""
    directory = Path(output_dir) / SCORES_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rollback-{rollback:04d}.jsonl"
    lines = [json.dumps({"rank": i + 1, **score}) for i, score in enumerate(scores)]
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    tmp.replace(path)
    return path


NAMED = 100  # the top of a ranking named by source document too (a window can hold 1e5 documents; nobody reads those)


def name_sources(data, scores: list[dict[str, Any]]) -> None:
    """The top NAMED documents' ``origin`` (input file and line, ``quarantine.origin``): a lookup each."""
    for score in scores[:NAMED]:
        score["origin"] = origin(data, score["source"], score["file"], score["document"])


def describe(scores: list[dict[str, Any]], count: int = 3) -> str:
    def name(s):
        where = f"{s['source']}:{s['file']}:{s['document']}"
        return f"{s['origin']['name']} ({where})" if s.get("origin") else where

    return ", ".join(f"{name(s)} {s['loss_per_token']:.3g} nats/token ({s['tokens']} tokens)" for s in scores[:count])

