"""Write the demo's downstream task: the end of a held-out line of Python, among the ends of other lines.

    python tools/make_stdlib_task.py [--out recipes/tasks/stdlib_lines.jsonl] [--num-examples 200]

Built from the tiny recipe's own corpus (this interpreter's standard library), from validation documents only
(the store's split: a document goes to val by a hash of its text, pretrain/data/split.py), so the model never
trained on these lines. Each example: the context is up to 3 lines of a file plus the start of the next line,
cut before a space at least 8 characters in; the gold choice is the rest of that line; the 3 distractors are the
ends of lines of other files with as many tokens (the tiny recipe's tokenizer) and about as many characters (within
30%): a model that knows nothing (uniform predictions) scores chance on acc and near it on acc_norm, instead of
winning by length. Choices are shuffled. Chance is 1/4.

Why the tiny model learns it in the demo's 300 steps: the true end of a line continues the syntax its start
opened (brackets, a call's arguments, an assignment's value) and reuses the names of the lines before it, which
is what a language model of Python picks up first; a random line's end of the same length matches neither.
Deterministic: the same interpreter and --seed give the same file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONTEXT_LINES = 3
MAX_CONTEXT_CHARS = 300
MIN_LINE_CHARS, MAX_LINE_CHARS = 24, 90  # the line being completed, without its indentation
MIN_CUT, MIN_CONTINUATION = 8, 6  # characters of the line before the cut; of the continuation
LENGTH_TOLERANCE = 0.3
NUM_CHOICES = 4
PER_DOCUMENT = 8  # examples drawn from one file at most: the task spans the 37 validation modules


def validation_documents(num_docs: int) -> list[str]:
    from pretrain.data import sample_val_texts
    from pretrain.data.split import _doc_hash, _val_threshold
    from pretrain.recipe.config import load_recipe

    data = load_recipe(ROOT / "recipes" / "tiny.yaml").data
    threshold = _val_threshold(data.val_fraction)
    texts = sample_val_texts(data, num_docs=num_docs, budget_bytes=256 * 2**20)
    return [t for t in texts if _doc_hash(t) < threshold]  # sample_val_texts tops up with training documents


def candidates(doc_index: int, text: str, rng: random.Random) -> list[dict]:
    """(context, continuation) of every line of ``text`` that qualifies, cut at a random space."""
    lines = text.splitlines()
    out = []
    for j in range(CONTEXT_LINES, len(lines)):
        line = lines[j].rstrip()
        body = line.lstrip()
        if not MIN_LINE_CHARS <= len(body) <= MAX_LINE_CHARS or body.startswith(("#", '"', "'")):
            continue
        indent = len(line) - len(body)
        cuts = [k for k, ch in enumerate(line) if ch == " " and k >= indent + MIN_CUT
                and len(line) - k >= MIN_CONTINUATION and line[k - 1] != " "]
        if not cuts:
            continue
        k = rng.choice(cuts)
        before = lines[j - CONTEXT_LINES:j]
        context = "\n".join(before) + "\n" + line[:k]
        while len(context) > MAX_CONTEXT_CHARS and before:
            before = before[1:]
            context = "\n".join(before) + "\n" + line[:k]
        if len(context) <= MAX_CONTEXT_CHARS:
            out.append({"doc": doc_index, "context": context, "gold": line[k:]})
    return out


def build(num_examples: int, seed: int) -> list[dict]:
    from pretrain.data import build_tokenizer
    from pretrain.recipe.config import load_recipe

    rng = random.Random(seed)
    docs = validation_documents(num_docs=400)
    pool = [c for i, text in enumerate(docs) for c in candidates(i, text, rng)]
    tokenizer = build_tokenizer(load_recipe(ROOT / "recipes" / "tiny.yaml").data, log=lambda _: None)
    # A continuation starts with a space: the byte-level pre-tokenizer splits there, so its tokens after any
    # context are its tokens alone (what pretrain/train/downstream.py's encode_pair scores).
    for c in pool:
        c["num_tokens"] = len(tokenizer.encode(c["gold"], add_special_tokens=False))
    by_doc: dict[int, list[dict]] = {}
    for c in pool:
        by_doc.setdefault(c["doc"], []).append(c)
    chosen = [c for cs in by_doc.values() for c in rng.sample(cs, min(PER_DOCUMENT, len(cs)))]
    rng.shuffle(chosen)
    examples = []
    for c in chosen:
        n = len(c["gold"])
        others = sorted({o["gold"] for o in pool if o["doc"] != c["doc"] and o["gold"] != c["gold"]
                         and o["num_tokens"] == c["num_tokens"] and abs(len(o["gold"]) - n) <= LENGTH_TOLERANCE * n})
        if len(others) < NUM_CHOICES - 1:
            continue
        choices = [c["gold"], *rng.sample(others, NUM_CHOICES - 1)]
        rng.shuffle(choices)
        examples.append({"context": c["context"], "choices": choices, "gold": choices.index(c["gold"])})
        if len(examples) == num_examples:
            return examples
    raise SystemExit(f"only {len(examples)} examples found in the validation documents; ask for fewer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "recipes" / "tasks" / "stdlib_lines.jsonl"))
    parser.add_argument("--num-examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    examples = build(args.num_examples, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(e) + "\n" for e in examples)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)  # atomic: a reader never sees half a file
    print(f"{out}: {len(examples)} examples, {len(text.encode()):,} bytes, {sys.version.split()[0]} stdlib")
    return 0


if __name__ == "__main__":
    sys.exit(main())
