"""Does a rollback find the document that caused it? A seeded poison document (random characters, several rows long)
in a small corpus of sentences of a small vocabulary: each trial trains the tiny model on it until the spike rule skips the
step that reads the poison, the run rolls back, and the reloaded model ranks the window's documents by loss per token
(stability.rollback). Prints the fraction of trials whose poison is in the top 3; with ``--documents`` each trial
also goes on with ``skip: documents`` (the poison quarantined) and a clean run (the corpus without the poison), and
prints both final losses.

    python tools/poison_bench.py --seeds 20 [--documents] [--work DIR]

In this process, on the CPU (one thread); a trial is a few seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import random
import shutil
import string
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VAL_FRACTION = 0.1
# The tests' small model (tests/helpers.py FAST) on 64-token rows; the spike rule judges from the 3rd update, and
# the first skip rolls back (max_consecutive_skips=1) to the checkpoint before it (every 2 steps).
ARGS = [
    "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.intermediate_size=128",
    "data.seq_len=64", "batch.global_batch_size=4", "batch.micro_batch_size=4", "lr_schedule.warmup_steps=1",
    "eval.batches=1", "eval.every_steps=0", "eval.tasks=[]", "logging.every_steps=1", "logging.progress=none",
    "data.tokenizer_vocab_size=512", f"data.val_fraction={VAL_FRACTION}", "train.max_steps=40",
    "checkpoint.every_steps=2", "checkpoint.keep_last=0", "checkpoint.save_final_model=false",
    "stability.window_steps=6", "stability.spike_sigma=3", "stability.max_consecutive_skips=1",
    "stability.rollback.enabled=true", "stability.rollback.max_attempts=10",
]
NUM_DOCUMENTS = 200
POISON_CHARS = 400  # random printable characters: several 65-token rows


WORDS = ("the model reads a row of tokens and learns which word comes next in the text of each document so that "
         "its loss falls step by step while the data stays the same").split()


def normal_documents() -> list[str]:
    """Sentences of a small vocabulary, learnt in a few dozen steps: the same for every trial."""
    rng = random.Random(12345)
    return [f"document {i}: " + " ".join(rng.choice(WORDS) for _ in range(50 + rng.randrange(50))) + "."
            for i in range(NUM_DOCUMENTS)]


def write_corpus(directory: Path, seed: int, poison: bool = True) -> tuple[Path, str | None]:
    """A jsonl corpus in ``directory``: the normal documents, the poison at a seeded place among them (``poison``);
    (its path, the poison's text)."""
    rng = random.Random(seed)
    documents = normal_documents()
    text = None
    if poison:
        alphabet = string.ascii_letters + string.digits + string.punctuation
        text = "".join(rng.choice(alphabet) for _ in range(POISON_CHARS))
        while _validation(text):  # the poison is trained on: drawn again until the split rule keeps it in training
            text = "".join(rng.choice(alphabet) for _ in range(POISON_CHARS))
        documents.insert(rng.randrange(len(documents) + 1), text)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    return path, text


def _validation(text: str) -> bool:
    """The store's split rule (docs/data.md): sha1(text)[:8] as a fraction of 2**64 below data.val_fraction."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big") < VAL_FRACTION * 2**64


def train(args: list[str]) -> tuple[object, str]:
    """The run.py Trainer in this process: (the trainer after train(), its console output)."""
    import torch
    from accelerate.state import AcceleratorState, GradientState

    from pretrain.errors import TrainingDiverged
    from pretrain.recipe.config import load_recipe
    from pretrain.train.trainer import Trainer

    torch.set_num_threads(1)
    console = io.StringIO()
    try:
        with contextlib.redirect_stdout(console), contextlib.redirect_stderr(console):
            trainer = Trainer(load_recipe(ROOT / "recipes" / "tiny.yaml", args))
            try:
                trainer.train()
            except TrainingDiverged as exc:  # rollback gave up (max_attempts): the trial says so, the others go on
                trainer.gave_up = str(exc)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return trainer, console.getvalue()


def poison_document(trainer, poison: str) -> tuple[str, str, int]:
    """The poison's store coordinates, found from its line of corpus.jsonl by the store's provenance (a lookup,
    ``provenance.find_source_document``)."""
    from pretrain.data.provenance import find_source_document

    corpus = Path(trainer.recipe.data.source)
    lines = corpus.read_text(encoding="utf-8").splitlines()
    line = next(n for n, text in enumerate(lines, start=1) if json.loads(text)["text"] == poison)
    found = find_source_document(trainer.data.train, corpus.name, line)
    return ("data", *found) if found is not None else ("data", "", -1)


def final_loss(out: Path) -> float:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    return sum(losses[-5:]) / len(losses[-5:])


def trial(work: Path, seed: int, documents: bool) -> dict:
    corpus, text = write_corpus(work / "corpus", seed)
    common = [*ARGS, f"data.source={corpus}", f"data.cache_dir={work / 'cache'}", f"train.seed={seed}"]
    trainer, console = train([*common, f"output_dir={work / 'window'}"])
    result = {"seed": seed, "rolled_back": (work / "window" / "rollbacks.jsonl").is_file(),
              "gave_up": hasattr(trainer, "gave_up")}
    poison = poison_document(trainer, text)
    scores = sorted((work / "window" / "rollback_scores").glob("rollback-*.jsonl"))
    ranks = []
    for path in scores:
        ranked = [json.loads(line) for line in path.read_text().splitlines()]
        names = [(r["source"], r["file"], r["document"]) for r in ranked]
        ranks.append(names.index(poison) + 1 if poison in names else None)
    # The first rollback whose window read the poison: is it in the top 3?
    result["poison_rank"] = next((r for r in ranks if r is not None), None)
    if documents:
        trainer, _ = train([*common, "stability.rollback.skip=documents", "stability.rollback.num_quarantined=3",
                            f"output_dir={work / 'documents'}"])
        quarantine = work / "documents" / "quarantine.json"
        listed = json.loads(quarantine.read_text())["documents"] if quarantine.is_file() else []
        result["quarantined"] = any((d["source"], d["file"], d["document"]) == poison for d in listed)
        result["loss_documents"] = final_loss(work / "documents")
        clean, _ = write_corpus(work / "clean_corpus", seed, poison=False)
        train([*ARGS, f"data.source={clean}", f"data.cache_dir={work / 'cache_clean'}", f"train.seed={seed}",
               f"output_dir={work / 'clean'}"])
        result["loss_clean"] = final_loss(work / "clean")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="trials, each with its own train.seed and poison place")
    parser.add_argument("--documents", action="store_true",
                        help="also rerun each trial with skip: documents, and a clean run, and compare final losses")
    parser.add_argument("--work", type=Path, help="keep the trials' runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    base = args.work or Path(tempfile.mkdtemp(prefix="poison_bench_"))
    results = []
    for seed in range(args.seeds):
        result = trial(base / f"seed_{seed:03d}", seed, args.documents)
        results.append(result)
        print(json.dumps(result), flush=True)
    top3 = sum(1 for r in results if r["poison_rank"] is not None and r["poison_rank"] <= 3)
    rolled = sum(1 for r in results if r["rolled_back"])
    gave_up = sum(1 for r in results if r["gave_up"])
    print(f"rolled back: {rolled}/{len(results)} trials; poison in the top 3 of the ranking: {top3}/{len(results)} "
          f"= {top3 / len(results):.0%}; rollback gave up (max_attempts) in {gave_up}")
    if args.documents:
        quarantined = sum(1 for r in results if r.get("quarantined"))
        finite = sum(1 for r in results if math.isfinite(r["loss_documents"]))
        mean = lambda key: sum(r[key] for r in results) / len(results)  # noqa: E731
        print(f"skip: documents: poison quarantined in {quarantined}/{len(results)}, finite final losses in "
              f"{finite}/{len(results)}; mean final loss (last 5 steps) with quarantine {mean('loss_documents'):.4f}, "
              f"clean corpus {mean('loss_clean'):.4f}")
    if args.work is None:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
