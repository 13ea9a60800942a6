"""Downstream multiple-choice evaluation (pretrain/train/downstream.py): the scoring on a hand-computed case,
lm-evaluation-harness's context/continuation split and, where lm-eval is installed, its evaluator's own acc and
acc_norm on the demo's task; sharding, the task files and the recipe's eval.tasks.
The in-loop figures on every layout and pretrain-eval on a checkpoint: tests/multiprocess/test_distributed.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pretrain.errors import ConfigError
from pretrain.train.downstream import (
    DownstreamEvaluator,
    Example,
    Task,
    build_requests,
    count_correct,
    encode_pair,
    loglikelihoods,
    plan_batches,
    read_task,
    score_task,
    shard,
)
from tests.helpers import ROOT, make_recipe, train

DEMO_TASK = ROOT / "recipes" / "tasks" / "stdlib_lines.jsonl"


class CharTokenizer:
    """One token per character of VOCAB; eos is the last id. No special tokens of its own (as pretrain's BPE)."""

    VOCAB = "abcd "
    bos_token_id = None
    eos_token_id = len(VOCAB)

    def encode(self, text, add_special_tokens=True):
        return [self.VOCAB.index(ch) for ch in text]

    def decode(self, ids):
        return "".join(self.VOCAB[i] if i < len(self.VOCAB) else "<eos>" for i in ids)


# P(next | previous) of a bigram model over a b c d space eos: the rows the examples below read are powers of 1/2.
_P = {
    "a": {"b": 1 / 4, "c": 1 / 2, "a": 1 / 16, "d": 1 / 16, " ": 1 / 16, "eos": 1 / 16},
    "b": {"a": 1 / 2, "c": 1 / 8, "d": 1 / 4, "b": 1 / 24, " ": 1 / 24, "eos": 1 / 24},
    "c": {"d": 1 / 4, "a": 1 / 8, "b": 5 / 32, "c": 5 / 32, " ": 5 / 32, "eos": 5 / 32},
}
_NAMES = [*CharTokenizer.VOCAB, "eos"]
LOGP = torch.tensor([[math.log(_P.get(prev, {}).get(nxt, 1 / 6)) for nxt in _NAMES] for prev in _NAMES])


class BigramStub:
    """Logits = log P(next | this token): log_softmax gives back log P exactly. Counts its forward calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, ids):
        self.calls += 1
        return LOGP[ids]


HAND = Task("hand", Path("hand.jsonl"), (
    # "b": log 1/4 = -1.386; "cd": log 1/2 + log 1/4 = log 1/8 = -2.079 -> acc picks "b" (wrong);
    # per character "cd" has -1.040 > -1.386 -> acc_norm picks "cd" (right)
    Example("a", ("b", "cd"), 1),
    # "a": log 1/2, "c": log 1/8 -> both pick "a" (right)
    Example("ab", ("a", "c"), 0),
    # "d": log 1/4, "a": log 1/8 -> both pick "d" (wrong)
    Example("c", ("d", "a"), 1),
))


def test_scoring_on_a_hand_computed_case():
    requests = build_requests(HAND, CharTokenizer(), max_len=16, indices=range(3))
    batches = plan_batches(requests, batch_tokens=8)
    assert sorted(i for b in batches for i in b) == list(range(6)) and len(batches) == 2  # 4 rows of 2 tokens, then 2 of 1
    scores = loglikelihoods(BigramStub(), requests, batches, device=torch.device("cpu")).tolist()
    expected = [math.log(1 / 4), math.log(1 / 8), math.log(1 / 2), math.log(1 / 8), math.log(1 / 4), math.log(1 / 8)]
    assert scores == pytest.approx(expected, abs=1e-6)
    assert count_correct(HAND, requests, scores) == (1, 2, 3)
    score = score_task(BigramStub(), HAND, requests, batches, device=torch.device("cpu"))
    assert (score.acc, score.acc_norm, score.num_examples) == (pytest.approx(1 / 3), pytest.approx(2 / 3), 3)
    assert HAND.chance == pytest.approx(0.5)


def test_acc_norm_divides_by_characters_and_ties_go_to_the_first_choice():
    task = Task("t", Path("t"), (Example("x", ("ab", "c"), 0),))
    requests = [SimpleNamespace(example=0, choice=c) for c in (0, 1)]
    cases = {(-1.0, -2.0): (1, 1),  # "ab" wins both
             (-2.0, -2.0): (1, 1),  # equal sums: the first choice; per character -1 against -2
             (-3.0, -2.0): (0, 1),  # "c" has the higher sum, "ab" the higher per character (-1.5)
             (-4.0, -2.0): (0, 1),  # equal per character (-2): the first choice
             (-4.5, -2.0): (0, 0)}  # "c" wins both
    for scores, (acc, acc_norm) in cases.items():
        assert count_correct(task, requests, scores) == (acc, acc_norm, 1), scores


def test_batches_pad_on_the_right_and_windows_keep_the_last_tokens():
    """A request scores the same alone and batched with longer ones; a long one keeps its last max_len + 1 tokens
    (left truncation), so its continuation is still scored whole."""
    task = Task("t", Path("t"), (Example("abcabcabc", ("d", "dd"), 0), Example("a", ("b", "cd"), 0)))
    cpu, requests = torch.device("cpu"), build_requests(task, CharTokenizer(), 16, range(2))
    alone = [loglikelihoods(BigramStub(), [r], [[0]], cpu).item() for r in requests]
    assert len(plan_batches(requests, 64)) == 1
    batched = loglikelihoods(BigramStub(), requests, plan_batches(requests, 64), cpu).tolist()
    assert batched == pytest.approx(alone, abs=1e-6)
    short = build_requests(task, CharTokenizer(), max_len=3, indices=[0])
    assert [len(r.tokens) for r in short] == [4, 4] and [r.num_scored for r in short] == [1, 2]
    assert short[1].tokens == tuple(CharTokenizer().encode("bcdd"))  # "abcabcabc" + "dd", its last 4 tokens
    assert loglikelihoods(BigramStub(), short, [[0, 1]], cpu).tolist() == pytest.approx(
        [math.log(1 / 4), math.log(1 / 4) + math.log(1 / 6)], abs=1e-6)


def bpe_tokenizer(bos: bool = False):
    """A byte-level BPE trained here on a little Python (what the tiny recipe's tokenizer is, smaller); ``bos``:
    its eos also starts every encoding, as a Llama tokenizer's bos does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["def foo(self, bar):\n    return self.foobar(bar)\n", "foobar = foo + bar\n"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<eos> $A", special_tokens=[("<eos>", 0)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<eos>")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_tokenization_follows_lm_evaluation_harness():
    """lm-evaluation-harness's _encode_pair: the context's trailing spaces move to the continuation; the
    continuation's tokens are the whole string's after the context's own tokens; an empty context is eos; the
    tokenizer's own bos starts the context (HFLM's default since lm-eval 0.4.9)."""
    tok = bpe_tokenizer()
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    context = enc("def foo(self,")
    ctx, cont = encode_pair(tok, "def foo(self, ", "bar):")
    assert (ctx, cont) == (context, enc("def foo(self, bar):")[len(context):])
    assert ctx + cont == enc("def foo(self, bar):")
    assert tok.decode(cont) == " bar):"  # the space went with the continuation
    assert encode_pair(tok, "def foo(self,", " bar):") == (ctx, cont)
    # Across a merge: "foobar" is one token of the whole string, in the place of the context's last token "foo".
    # The continuation is what the whole string holds after as many tokens as the context encodes to ("(bar)"),
    # not the tokens of "bar(bar)" encoded alone.
    ctx, cont = encode_pair(tok, "return self.foo", "bar(bar)")
    whole = enc("return self.foobar(bar)")
    assert ctx == enc("return self.foo") and cont == whole[len(ctx):]
    assert tok.decode(whole[len(ctx) - 1:len(ctx)]) == "foobar" and tok.decode(cont) == "(bar)"
    assert encode_pair(tok, "", " foo") == ([tok.eos_token_id], enc(" foo"))
    assert encode_pair(tok, "", "<eos> foo") == ([tok.eos_token_id], enc(" foo"))  # its own first token is eos

    with_bos = bpe_tokenizer(bos=True)
    eos = with_bos.eos_token_id
    assert eos == 0 and with_bos.encode("foo") == [eos, *enc("foo")]
    ctx, cont = encode_pair(with_bos, "def foo(self,", " bar):")
    assert (ctx, cont) == ([eos, *context], enc("def foo(self, bar):")[len(context):])
    assert encode_pair(with_bos, "<eos>def foo(self,", " bar):") == (ctx, cont)  # one bos, not two
    assert encode_pair(with_bos, "", " foo") == ([eos], enc(" foo"))


def test_two_ranks_count_what_one_counts_with_the_same_number_of_calls():
    """Each rank scores its share (r, r + W, ...); the summed counts are those of one process, and every rank
    makes the same number of forward calls (FSDP and ZeRO-3 gather parameters in each)."""
    examples = tuple(Example(ctx, choices, gold) for ctx, choices, gold in [
        ("a", ("b", "cd"), 1), ("ab", ("a", "c"), 0), ("c", ("d", "a"), 1), ("b", ("a", "d", "c"), 0),
        ("a", ("c", "b", "dd"), 2)])
    task = Task("t", Path("t"), examples)
    cpu = torch.device("cpu")

    def plan(world):
        """Each rank's requests and forward calls at 4 padded tokens per call, and the most calls of any rank."""
        requests = [build_requests(task, CharTokenizer(), 16, shard(len(examples), r, world)) for r in range(world)]
        batches = [plan_batches(r, batch_tokens=4) for r in requests]
        return requests, batches, max(map(len, batches))

    def counts(requests, batches, calls):
        model = BigramStub()
        scores = loglikelihoods(model, requests, batches, cpu, calls=calls).tolist()
        return count_correct(task, requests, scores), model.calls

    [one_requests], [one_batches], one_calls = plan(1)
    one, calls = counts(one_requests, one_batches, one_calls)
    assert one[2] == 5 and calls == 4  # 4 inputs of 2 tokens (2 per call), 8 of 1 (4 per call)
    requests, batches, most = plan(2)
    assert [len(b) for b in batches] == [3, 2]  # rank 0: 2 + 5 rows; rank 1: 2 + 3 rows
    (r0, calls0), (r1, calls1) = (counts(requests[r], batches[r], most) for r in range(2))
    assert tuple(a + b for a, b in zip(r0, r1, strict=True)) == one
    assert calls0 == calls1 == 3  # rank 1 pads one call


def test_cadence_of_each_task():
    tasks = [Task("x", Path("x"), HAND.examples), Task("y", Path("y"), HAND.examples, every_steps=3)]
    evaluator = DownstreamEvaluator(None, tasks, CharTokenizer(), 16, 4, 0, 1, every_steps=4, num_steps=10,
                                    at_start=True, console=None)
    due = {step: evaluator.due_tasks(step) for step in range(11) if evaluator.due(step)}
    assert due == {0: [0, 1], 3: [1], 4: [0], 6: [1], 8: [0], 9: [1], 10: [0, 1]}


def test_an_early_end_evaluates_what_was_not_due_at_its_step():
    """data.on_exhausted=stop ends the run at a step where the loop may have run only some evaluations: the rest run
    then, so that the last step has the validation loss and every task (and nothing twice)."""
    from pretrain.train.evaluation import Evaluator

    tasks = [Task("x", Path("x"), HAND.examples), Task("y", Path("y"), HAND.examples, every_steps=3)]
    downstream = DownstreamEvaluator(None, tasks, CharTokenizer(), 16, 4, 0, 1, every_steps=4, num_steps=10,
                                     at_start=True, console=None)
    scored = []
    downstream.evaluate = lambda model, step, every_task=False, tasks=None: scored.append((step, tasks)) or {}
    evaluator = Evaluator(None, {}, every_steps=5, num_steps=10, at_start=True, console=None, downstream=downstream)
    validated = []
    evaluator.validate = lambda model, step: validated.append(step) or {}
    evaluator.evaluate_rest(None, 6)  # task y was due at 6 (the loop scored it); val and x were not
    assert validated == [6] and scored == [(6, [0])]
    scored.clear()
    evaluator.evaluate_rest(None, 5)  # val was due; neither task
    assert validated == [6] and scored == [(5, [0, 1])]


def test_a_model_directory_that_does_not_load_is_one_message(tmp_path):
    from pretrain.train.downstream import load_exported_model

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(ConfigError, match=r"does not load as a transformers causal LM with its tokenizer: .*"
                                          r"give <output_dir>/final_model"):
        load_exported_model(tmp_path)


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_task_files_are_checked_line_by_line(tmp_path):
    good = {"context": "x", "choices": ["a", "b"], "gold": 1, "id": 7}
    task = read_task(write(tmp_path / "ok.jsonl", [good, "", good]), limit=None)
    assert task.name == "ok" and len(task.examples) == 2 and task.examples[0] == Example("x", ("a", "b"), 1)
    assert len(read_task(tmp_path / "ok.jsonl", limit=1).examples) == 1
    bad = write(tmp_path / "bad.jsonl", [good, "{not json", [1], {"context": "x", "choices": ["a"], "gold": 0},
                                         {"context": "x", "choices": ["a", "b"], "gold": 2},
                                         {"context": "x", "choices": ["a", ""], "gold": True}, {"context": "x"}])
    with pytest.raises(ConfigError) as exc:
        read_task(bad)
    message = str(exc.value)
    for part in ("bad.jsonl", "line 2: not JSON", "line 3: a JSON list", "line 4: choices must be a list of at least 2",
                 "line 5: gold = 2 is not an index of the 2 choices", "line 6: choices", "(and 1 more)"):
        assert part in message, (part, message)
    with pytest.raises(ConfigError, match="holds no examples"):
        read_task(write(tmp_path / "empty.jsonl", [""]))


def test_recipe_tasks_are_strict():
    recipe = make_recipe("eval.tasks=[{name: arc-e, path: a.jsonl, every_steps: 50, limit: 100}]")
    assert [(t.name, t.path, t.every_steps, t.limit) for t in recipe.eval.tasks] == [("arc-e", "a.jsonl", 50, 100)]
    for override, problem in [("eval.tasks=[{name: a, path: x}, {name: a, path: y}]", "appear more than once"),
                              ("eval.tasks=[{name: a/b, path: x}]", "must be letters, digits"),
                              ("eval.tasks=[{name: a, path: x, every: 3}]",
                               "unknown key 'eval.tasks.0.every': did you mean 'eval.tasks.0.every_steps'"),
                              ("eval.tasks=[{name: a, path: x, limit: 0}]", "limit"),
                              ("eval.tasks=[{name: a}]", "missing required key 'eval.tasks.0.path'")]:
        with pytest.raises(ConfigError, match=problem):
            make_recipe(override)


def test_task_paths_are_relative_to_the_recipe_file_that_names_them(tmp_path):
    from pretrain.recipe.config import load_recipe

    (tmp_path / "sub").mkdir()
    recipe = tmp_path / "sub" / "r.yaml"
    recipe.write_text(f"base: {ROOT / 'recipes' / 'tiny.yaml'}\neval:\n  tasks: [{{name: a, path: t.jsonl}}]\n")
    assert [t.path for t in load_recipe(recipe).eval.tasks] == [str(tmp_path / "sub" / "t.jsonl")]
    overridden = load_recipe(recipe, ["eval.tasks=[{name: b, path: here.jsonl}]"])
    assert [t.path for t in overridden.eval.tasks] == ["here.jsonl"]  # the command line's: the current directory


@pytest.mark.slow
def test_a_missing_task_file_is_exit_2_naming_it_before_training(tmp_path):
    proc = train([f"output_dir={tmp_path / 'run'}",
                  "eval.tasks=[{name: ok, path: recipes/tasks/stdlib_lines.jsonl}, {name: gone, path: no/such.jsonl}]"])
    assert proc.returncode == 2, proc.stderr
    assert "eval.tasks[1] (gone): task file 'no/such.jsonl' not found (relative to the current directory" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_demo_task_is_shipped_and_valid():
    """recipes/tiny.yaml's task (tools/make_stdlib_task.py): 200 examples of 4 choices, small, read by the run's
    reader; the gold is not always at the same place."""
    task = read_task(DEMO_TASK)
    assert len(task.examples) == 200 and {len(e.choices) for e in task.examples} == {4}
    assert task.chance == 0.25 and DEMO_TASK.stat().st_size < 100_000
    assert len({e.gold for e in task.examples}) == 4
    from pretrain.recipe.config import load_recipe

    [cfg] = load_recipe(ROOT / "recipes" / "tiny.yaml").eval.tasks
    assert Path(cfg.path) == DEMO_TASK  # relative to the recipe file: found from any directory


def test_acc_and_acc_norm_are_lm_evaluation_harness_figures(tmp_path, monkeypatch):
    """The cross-check the docs' claim rests on: lm-evaluation-harness's own evaluator (HFLM, a multiple_choice
    task on the same jsonl) and pretrain-eval's scoring give the same acc and acc_norm on a model pretrain wrote
    (a seeded FAST-shaped Llama, random init, with the demo's BPE tokenizer, as a run's final_model), example by
    example: the same tokens, the same log-likelihoods to fp32 rounding, the same choices. The window is 64 tokens,
    so the longest of the 800 requests are left-truncated, on both sides alike. Skipped where lm-eval is not installed
    (docs/evaluation.md says how to install it beside the project's environment)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # before datasets is imported: the task is a local file
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness (pip package lm-eval) is not installed")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from pretrain.data import build_tokenizer
    from pretrain.model.build import build_model, resolve_vocab_size, save_pretrained_model
    from pretrain.recipe.config import load_recipe
    from pretrain.train.downstream import hf_logits, load_exported_model, prefix_token_id
    from tests.helpers import FAST_MODEL, TINY

    task = read_task(DEMO_TASK)
    # init_std 0.2, not 0.02: near-uniform predictions make near-ties (a top-two margin of 7e-5 at 0.02), which
    # fp32 rounding (2.5e-5 between the two implementations here) could break either way on another machine.
    recipe = load_recipe(TINY, [*FAST_MODEL, "model.init_std=0.2"])
    tokenizer = build_tokenizer(recipe.data, log=lambda _: None)
    model = build_model(recipe.model, resolve_vocab_size(recipe.model, len(tokenizer)), recipe.data.seq_len,
                        seed=recipe.train.seed)
    save_pretrained_model(model, model.state_dict(), tokenizer, tmp_path / "model", [e.context for e in task.examples])

    # pretrain's side: pretrain-eval --model's pieces (evaluate_model), keeping every request's log-likelihood.
    model, tokenizer, window = load_exported_model(tmp_path / "model")
    assert window == 64
    requests = build_requests(task, tokenizer, window, range(len(task.examples)))
    scores = loglikelihoods(hf_logits(model), requests, plan_batches(requests, 8192), torch.device("cpu"),
                            pad_id=prefix_token_id(tokenizer)).tolist()
    acc, acc_norm, total = count_correct(task, requests, scores)
    ours = {(r.example, r.choice): s for r, s in zip(requests, scores, strict=True)}
    tolerance = 1e-4  # of a summed log-likelihood: fp32 rounding of two batchings
    margins = []
    for i, example in enumerate(task.examples):
        lls = [ours[i, c] for c in range(len(example.choices))]
        for values in (lls, [ll / len(choice) for ll, choice in zip(lls, example.choices, strict=True)]):
            top, second = sorted(values)[-2:][::-1]
            margins.append(top - second)
    assert min(margins) > 2 * tolerance, "a near-tie: rounding alone could make the two disagree; change the seed"

    # lm-evaluation-harness's side. The choices start with their space, so target_delimiter is "" (the harness's
    # default " " would double it); acc_norm's lengths are then len(choice) on both sides. logits_cache=False:
    # the harness's one-token-continuation cache (on by default) gives a request that shares all its tokens with a
    # request split at another point (in this task: 3 of 800) the other one's logits at the wrong positions.
    harness = HFLM(pretrained=str(tmp_path / "model"), dtype="float32", device="cpu", batch_size=64,
                   logits_cache=False)
    config = {"task": "stdlib_lines", "dataset_path": "json", "test_split": "test",
              "dataset_kwargs": {"data_files": {"test": str(DEMO_TASK)}, "cache_dir": str(tmp_path / "datasets")},
              "output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
              "doc_to_target": "gold", "target_delimiter": "",
              "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}
    results = simple_evaluate(model=harness, tasks=[config], task_manager=TaskManager(include_defaults=False),
                              bootstrap_iters=0, log_samples=True, random_seed=None, numpy_random_seed=None,
                              torch_random_seed=None, fewshot_random_seed=None)
    figures = results["results"]["stdlib_lines"]
    samples = results["samples"]["stdlib_lines"]
    assert len(samples) == total == 200
    truncated = 0

    assert (figures["acc,none"], figures["acc_norm,none"]) == (acc / total, acc_norm / total)
    for sample in samples:
        i = sample["doc_id"]
        example = task.examples[i]
        for c, (context, continuation) in enumerate(sample["arguments"]):
            assert (context, continuation) == (example.context, example.choices[c])
            pair = harness._encode_pair(context, continuation)
            assert pair == encode_pair(tokenizer, context, continuation)
            truncated += len(pair[0]) + len(pair[1]) > window + 1
        theirs = [float(response[0][0]) for response in sample["resps"]]
        assert theirs == pytest.approx([ours[i, c] for c in range(len(theirs))], abs=tolerance), i
        ours_correct = count_correct(task, [r for r in requests if r.example == i], [ours[i, c] for c in range(4)])
        assert ours_correct == (sample["acc"], sample["acc_norm"], 1), i
    assert truncated > 0  # the left truncation was compared too

    # A tokenizer that starts every encoding with its bos (as Llama's does): the harness keeps it (HFLM's default
    # since 0.4.9), and so does pretrain.
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    bos = tokenizer.bos_token
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    with_bos = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=bos)
    assert with_bos.encode("x")[0] == with_bos.bos_token_id == 0
    harness = HFLM(pretrained=model, tokenizer=with_bos, batch_size=64, logits_cache=False)
    for example in task.examples:
        for choice in example.choices:
            pair = encode_pair(with_bos, example.context, choice)
            assert pair[0][0] == 0 and pair == harness._encode_pair(example.context, choice)
