"""Downstream evaluation: multiple-choice tasks scored by log-likelihood, in the loop and on one checkpoint.

The form of HellaSwag, ARC, PIQA and lm-evaluation-harness's ``multiple_choice`` tasks: a context, choices
and the index of the right one. Each choice is scored by the sum of the log-probabilities of its tokens
given the context. ``acc`` takes the argmax of the sums; ``acc_norm`` the argmax of the sums divided by the
choice's length in characters: lm-evaluation-harness's ``completion_len = len(choice)`` (its docs call it
byte-length normalisation; for ASCII text the two are the same).

Tokenization is lm-evaluation-harness's ``_encode_pair``: trailing spaces of the context move to the
continuation, the whole string is encoded, and the continuation's tokens are the whole string's tokens after
as many as the context alone encodes to (a merge across the boundary belongs to the continuation, as the
model would read it). Strings are encoded with the tokenizer's own special tokens (a Llama tokenizer's
bos; pretrain's BPE adds none), except a string that already starts with the prefix token's text: HFLM's default
since lm-evaluation-harness 0.4.9 (``add_bos_token=None``; 0.4.8 and earlier added none). An empty context is the bos token (else eos),
lm-evaluation-harness's ``prefix_token_id``, unless the continuation starts with that token. A request longer
than the window keeps its last max_len + 1 tokens (left truncation, as lm-evaluation-harness does).

Batching: requests longest first, as many per forward call as fit a budget of padded tokens (the training
micro-batch's MBS x seq_len in a run, so the logits are no larger than training's). Sharding: data-parallel
rank r scores examples r, r + W, ...; the counts are summed with one reduction. Every rank makes the same
number of forward calls (a rank with fewer pads with one-token calls; the counts are gathered once):
FSDP and ZeRO-3 gather parameters inside each forward, so a rank that stopped early would leave the others
waiting in a collective. Requests are right-padded and need no attention mask: under causal attention no
real position attends to the padding after it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain.errors import ConfigError

MAX_PROBLEMS = 5  # of one file, in one error: enough to see the pattern


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    gold: int


@dataclass(frozen=True)
class Task:
    name: str
    path: Path
    examples: tuple[Example, ...]
    every_steps: int | None = None  # None: eval.every_steps

    @property
    def chance(self) -> float:
        """The accuracy of a uniform guess: the mean of 1 / number of choices."""
        return math.fsum(1 / len(e.choices) for e in self.examples) / len(self.examples)


def read_task(path: str | Path, name: str | None = None, limit: int | None = None, key: str = "task") -> Task:
    """A jsonl task file: one ``{"context": str, "choices": [str, ...], "gold": int}`` per line (other keys are
    left alone: an example's id, its source). One ConfigError naming the file, the lines and the fix."""
    path = Path(path)
    if not path.is_file():
        where = "" if path.is_absolute() else f" (relative to the current directory {Path.cwd()})"
        raise ConfigError(f"{key}: task file {str(path)!r} not found{where}; give the path of a jsonl file of "
                          '{"context": ..., "choices": [...], "gold": i} lines')
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}: cannot read task file {path} as UTF-8 text ({exc})") from None
    examples, problems = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        example, problem = _parse_example(line)
        if problem:
            problems.append(f"line {number}: {problem}")
        else:
            examples.append(example)
        if limit is not None and len(examples) >= limit:
            break
    if problems:
        more = f" (and {len(problems) - MAX_PROBLEMS} more)" if len(problems) > MAX_PROBLEMS else ""
        raise ConfigError(f"{key}: task file {path}: " + "; ".join(problems[:MAX_PROBLEMS]) + more +
                          '; each line must be {"context": str, "choices": [str, str, ...], "gold": index}')
    if not examples:
        raise ConfigError(f"{key}: task file {path} holds no examples; write one JSON object per line")
    return Task(name or path.stem, path, tuple(examples))


def _parse_example(line: str) -> tuple[Example | None, str | None]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg})"
    if not isinstance(obj, dict):
        return None, f"a JSON {type(obj).__name__}, not an object"
    missing = [k for k in ("context", "choices", "gold") if k not in obj]
    if missing:
        return None, f"no {', '.join(missing)}"
    context, choices, gold = obj["context"], obj["choices"], obj["gold"]
    if not isinstance(context, str):
        return None, f"context is a {type(context).__name__}, not a string"
    if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)):
        return None, "choices must be a list of at least 2 non-empty strings"
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        return None, f"gold = {gold!r} is not an index of the {len(choices)} choices (0 to {len(choices) - 1})"
    return Example(context, tuple(choices), gold), None


def read_tasks(eval_cfg) -> list[Task]:
    """The recipe's ``eval.tasks``, read and checked (pre-flight: before any process starts); every file's
    problems in one ConfigError."""
    tasks, problems = [], []
    for i, cfg in enumerate(eval_cfg.tasks):
        try:
            task = read_task(cfg.path, cfg.name, cfg.limit, key=f"eval.tasks[{i}] ({cfg.name})")
        except ConfigError as exc:
            problems += exc.problems
        else:
            tasks.append(Task(task.name, task.path, task.examples, cfg.every_steps))
    if problems:
        raise ConfigError(problems)
    return tasks


# ---- tokens ------------------------------------------------------------------------------------------------


def encode(tokenizer, text: str, add_special_tokens: bool | None = None) -> list[int]:
    """HFLM's ``tok_encode``: the tokenizer's default special tokens (None), unless ``text`` already starts with
    the prefix token's text."""
    if add_special_tokens is None:
        add_special_tokens = not text.startswith(tokenizer.decode([prefix_token_id(tokenizer)]))
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def prefix_token_id(tokenizer) -> int:
    """The context of an empty context: bos if the tokenizer has one, else eos (lm-evaluation-harness)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos if bos is not None else tokenizer.eos_token_id


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-evaluation-harness's ``_encode_pair`` splits them."""
    if not context:
        # lm-evaluation-harness's loglikelihood: the prefix token as the context, or the continuation's first
        # token where it is that token already.
        continuation_ids = encode(tokenizer, continuation, add_special_tokens=False)
        prefix = prefix_token_id(tokenizer)
        if continuation_ids[0] == prefix and len(continuation_ids) > 1:
            return continuation_ids[:1], continuation_ids[1:]
        return [prefix], continuation_ids
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = encode(tokenizer, context + continuation)
    context_ids = encode(tokenizer, context) if context else []
    continuation_ids = whole[len(context_ids):]
    if not context_ids:
        context_ids = [prefix_token_id(tokenizer)]
    if not continuation_ids:
        # The context's own tokens outnumber the whole string's (a merge across the boundary swallowed the
        # continuation; lm-evaluation-harness asserts here): the whole string's last token is scored instead.
        context_ids, continuation_ids = (whole[:-1] or [prefix_token_id(tokenizer)]), whole[-1:]
    return context_ids, continuation_ids


@dataclass(frozen=True)
class Request:
    """One choice of one example: the window's tokens (input + the last target) and how many of its last
    targets are the continuation's."""

    example: int  # index into the task's examples
    choice: int
    tokens: tuple[int, ...]
    num_scored: int


def build_requests(task: Task, tokenizer, max_len: int, indices: Sequence[int]) -> list[Request]:
    requests = []
    for i in indices:
        example = task.examples[i]
        for c, choice in enumerate(example.choices):
            context_ids, continuation_ids = encode_pair(tokenizer, example.context, choice)
            window = (context_ids + continuation_ids)[-(max_len + 1):]
            requests.append(Request(i, c, tuple(window), min(len(continuation_ids), len(window) - 1)))
    return requests


def shard(num_examples: int, rank: int, world: int) -> range:
    """The examples data-parallel rank ``rank`` scores."""
    return range(rank, num_examples, world)


def plan_batches(requests: list[Request], batch_tokens: int) -> list[list[int]]:
    """Requests (indices) in forward calls of at most ``batch_tokens`` padded tokens (rows x the longest row),
    longest first (as lm-evaluation-harness sorts them): rows of a call have similar lengths, little padding."""
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * (len(requests[batches[-1][0]].tokens) - 1) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


Logits = Callable[[torch.Tensor], torch.Tensor]  # input ids [B, T] -> logits [B, T, V]


def loglikelihoods(logits_of: Logits, requests: list[Request], batches: list[list[int]], device: torch.device,
                   calls: int = 0, pad_id: int = 0) -> torch.Tensor:
    """Each request's summed continuation log-probability, on ``device`` (no host synchronisation), in the
    order of ``requests``, computed in ``batches`` (plan_batches); ``calls``: pad with one-token forward calls
    up to this many."""
    scores = torch.zeros(len(requests), dtype=torch.float64, device=device)
    for batch in batches:
        width = max(len(requests[i].tokens) for i in batch) - 1
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        rows, positions, targets, owners = [], [], [], []
        for row, index in enumerate(batch):
            tokens = requests[index].tokens
            ids[row, :len(tokens) - 1] = torch.tensor(tokens[:-1])
            n = requests[index].num_scored
            end = len(tokens) - 1
            rows += [row] * n
            positions += range(end - n, end)
            targets += tokens[-n:]
            owners += [index] * n
        logits = logits_of(ids.to(device))
        # Only the continuation's positions are upcast: [scored tokens, V], not the batch's [B, T, V].
        picked = logits[torch.tensor(rows, device=device), torch.tensor(positions, device=device)].float()
        logprobs = torch.log_softmax(picked, dim=-1)
        token_ll = logprobs.gather(1, torch.tensor(targets, device=device)[:, None]).squeeze(1)
        scores.index_add_(0, torch.tensor(owners, device=device), token_ll.double())
        del logits, picked, logprobs
    for _ in range(calls - len(batches)):
        logits_of(torch.full((1, 1), pad_id, dtype=torch.long, device=device))
    return scores


def count_correct(task: Task, requests: list[Request], scores: Sequence[float]) -> tuple[int, int, int]:
    """(examples whose gold has the highest sum, ... the highest sum per character, examples scored). Ties go
    to the first choice (numpy's argmax, as lm-evaluation-harness)."""
    by_example: dict[int, dict[int, float]] = {}
    for request, score in zip(requests, scores, strict=True):
        by_example.setdefault(request.example, {})[request.choice] = score
    acc = acc_norm = 0
    for i, lls in by_example.items():
        example = task.examples[i]
        order = range(len(example.choices))
        acc += max(order, key=lambda c: lls[c]) == example.gold
        acc_norm += max(order, key=lambda c: lls[c] / len(example.choices[c])) == example.gold
    return acc, acc_norm, len(by_example)


def hf_logits(model) -> Logits:
    """The model called as the Evaluator calls it (the prepared model: DDP, FSDP2 or the DeepSpeed engine),
    without labels, so the output holds the logits; no KV cache."""
    return lambda ids: model(input_ids=ids, use_cache=False).logits


@dataclass(frozen=True)
class Score:
    acc: float
    acc_norm: float
    num_examples: int
    seconds: float

    def line(self, task: Task) -> str:
        return (f"{task.name} acc {self.acc:.4f} acc_norm {self.acc_norm:.4f} (chance {task.chance:.4f}, "
                f"{self.num_examples} examples, {self.seconds:.1f}s)")


@torch.no_grad()
def score_task(logits_of: Logits, task: Task, requests: list[Request], batches: list[list[int]],
               device: torch.device, calls: int = 0, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
               pad_id: int = 0) -> Score:
    """This rank's requests scored and counted; ``reduce`` sums the counts over ranks (None: one process)."""
    start = time.perf_counter()
    scores = loglikelihoods(logits_of, requests, batches, device, calls, pad_id)
    # Expensive device-to-host synchronization: once per task and evaluation.
    counts = torch.tensor(count_correct(task, requests, scores.tolist()), dtype=torch.float64, device=device)
    if reduce is not None:
        counts = reduce(counts)
    # Under tensor parallelism every rank of a TP group counts its group's share: the ratios are the same.
    acc, acc_norm, total = counts.tolist()
    return Score(acc / total, acc_norm / total, len(task.examples), time.perf_counter() - start)


@dataclass
class DownstreamEvaluator:
    """The recipe's tasks in a run: each rank's requests tokenized once, every task scored at step 0
    (``eval.at_start``), at its ``every_steps`` (else ``eval.every_steps``) and after the last step; logs
    ``eval/<task>/acc`` and ``eval/<task>/acc_norm`` and one console line per task."""

    accelerator: Any
    tasks: list[Task]
    tokenizer: Any
    max_len: int  # tokens per request (the training seq_len)
    batch_tokens: int  # padded tokens per forward (MBS x seq_len / CP: logits no larger than a training micro-batch's)
    data_rank: int
    data_world: int
    every_steps: int
    num_steps: int
    at_start: bool
    console: Any

    def __post_init__(self):
        self.requests = [build_requests(t, self.tokenizer, self.max_len,
                                        shard(len(t.examples), self.data_rank, self.data_world)) for t in self.tasks]
        self.batches = [plan_batches(r, self.batch_tokens) for r in self.requests]
        self.pad_id = prefix_token_id(self.tokenizer)
        self.calls: list[int] | None = None  # every rank's most forward calls per task: at the first evaluation

    @classmethod
    def for_run(cls, accelerator, tasks, tokenizer, recipe, plan, launch, num_steps: int, console
                ) -> DownstreamEvaluator | None:
        """eval.tasks (read and checked by check_run) in a training run: each rank's share tokenized once, scored in
        forward calls of at most MBS x seq_len padded tokens (logits no larger than a training micro-batch's)."""
        if not tasks:
            return None
        return cls(
            accelerator, list(tasks), tokenizer, max_len=recipe.data.seq_len,
            # under CP every rank scores whole requests: the rows a CP rank's share of a micro-batch holds
            batch_tokens=plan.micro_batch_size * recipe.data.seq_len // launch.cp_size,
            data_rank=launch.data_rank, data_world=launch.data_parallel_size, every_steps=recipe.eval.every_steps,
            num_steps=num_steps, at_start=recipe.eval.at_start, console=console,
        )

    def forward_calls(self) -> list[int]:
        """Per task, the most forward calls any rank needs (every rank makes that many): one gather, once."""
        if self.calls is None:
            mine = torch.tensor([len(b) for b in self.batches], dtype=torch.long, device=self.accelerator.device)
            gathered = self.accelerator.gather(mine).view(-1, len(self.tasks))
            self.calls = gathered.max(dim=0).values.tolist()
        return self.calls

    def due_tasks(self, step: int) -> list[int]:
        if step == 0:
            return list(range(len(self.tasks))) if self.at_start else []
        due = []
        for i, task in enumerate(self.tasks):
            every = task.every_steps or self.every_steps
            if step == self.num_steps or (every > 0 and step % every == 0):
                due.append(i)
        return due

    def due(self, step: int) -> bool:
        return bool(self.due_tasks(step))

    @torch.no_grad()
    def evaluate(self, model, step: int, every_task: bool = False, tasks: list[int] | None = None) -> dict[str, float]:
        """The tasks due at ``step`` (``every_task``: all of them; ``tasks``: these, by index)."""
        due = tasks if tasks is not None else range(len(self.tasks)) if every_task else self.due_tasks(step)
        if not due:
            return {}
        calls = self.forward_calls()
        model.eval()
        metrics = {}
        for i in due:
            task = self.tasks[i]
            score = score_task(hf_logits(model), task, self.requests[i], self.batches[i], self.accelerator.device,
                               calls[i], lambda t: self.accelerator.reduce(t, reduction="sum"), self.pad_id)
            metrics[f"eval/{task.name}/acc"] = score.acc
            metrics[f"eval/{task.name}/acc_norm"] = score.acc_norm
            self.console.print(f"eval step {step}: {score.line(task)}")
        model.train()
        self.accelerator.log(metrics, step=step)
        return metrics


# ---- one checkpoint or model, one process (pretrain-eval) ---------------------------------------------------


LOAD_GROUP_BYTES = 2**30  # pretrain-eval reads a checkpoint's weights into its model this much at a time


def load_checkpoint_model(checkpoint: Path, device: torch.device | str = "cpu", log=print):
    """(model in eval mode, tokenizer, window in tokens, step) of any checkpoint layout, in fp32, through
    pretrain-export's pieces: the recipe recorded in the checkpoint, its tokenizer from the data cache, the
    fp32 weights read a group at a time (``pretrain.checkpoint.weights``, weights-only loads)."""
    from pydantic import ValidationError

    from pretrain.checkpoint.rundir import STATE_FILE, read_state
    from pretrain.checkpoint.state import TrainerState
    from pretrain.checkpoint.weights import open_weights
    from pretrain.data import build_tokenizer
    from pretrain.model.build import build_model, resolve_vocab_size
    from pretrain.recipe.config import Recipe, renamed_keys

    if read_state(checkpoint) is None:
        raise ConfigError(f"{checkpoint} is not a complete checkpoint (no readable {STATE_FILE}); give a directory "
                          "like <output_dir>/checkpoints/step_00000200, or --model DIR for a transformers model")
    state = TrainerState.read(checkpoint)
    try:
        recipe = Recipe.model_validate(renamed_keys(state.recipe))
    except ValidationError as exc:
        raise ConfigError(f"the recipe recorded in {checkpoint / STATE_FILE} does not validate with this version "
                          f"of pretrain ({exc.error_count()} problems); evaluate with the version that wrote it") from None
    tokenizer = build_tokenizer(recipe.data, log=log)
    vocab = resolve_vocab_size(recipe.model, len(tokenizer))
    # Built (and drawn) on the device, then overwritten a group of tensors at a time (the model, plus one group, in
    # memory: not a second full copy): the buffers the checkpoint leaves out (RoPE's) are real. The checkpoint's
    # weights replace the model's: model.init_from's are not read
    model = build_model(recipe.model, vocab, recipe.data.seq_len, seed=recipe.train.seed, device=device,
                        pretrained=False)
    expected = set(model.state_dict())
    with open_weights(checkpoint, log=log) as weights:
        missing = [k for k in expected if k not in weights.specs and not _tied(model, k)]
        if missing:
            raise ConfigError(f"{checkpoint} lacks {len(missing)} of the recipe's model tensors (e.g. "
                              f"{missing[:3]}); is it a checkpoint of this recipe?")
        for group in weights.groups([k for k in weights.specs if k in expected], LOAD_GROUP_BYTES):
            model.load_state_dict(group, strict=False)
    return model.eval(), tokenizer, recipe.data.seq_len, state.step


def _tied(model, key: str) -> bool:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return bool(model.config.tie_word_embeddings) and key in set(tied)


def load_exported_model(directory: Path, device: torch.device | str = "cpu"):
    """(model in eval mode, tokenizer, window in tokens) of a transformers model directory (pretrain-export's,
    a run's final_model/, or any causal LM saved with its tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (directory / "config.json").is_file():
        raise ConfigError(f"{directory} is not a transformers model directory (no config.json); give "
                          "<output_dir>/final_model, a pretrain-export output, or --checkpoint DIR")
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device)
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as exc:  # an unknown model_type, missing weights or tokenizer files
        raise ConfigError(f"{directory} does not load as a transformers causal LM with its tokenizer: "
                          f"{str(exc).splitlines()[0]}; give <output_dir>/final_model, a pretrain-export output, or "
                          "--checkpoint DIR") from None
    window = getattr(model.config, "max_position_embeddings", None) or 2048  # lm-evaluation-harness's default
    return model.eval(), tokenizer, window


def evaluate_model(model, tokenizer, max_len: int, tasks: list[Task], batch_tokens: int,
                   device: torch.device | None = None) -> list[Score]:
    """Every task on one process."""
    device = device or next(model.parameters()).device
    scores = []
    for task in tasks:
        requests = build_requests(task, tokenizer, max_len, range(len(task.examples)))
        scores.append(score_task(hf_logits(model), task, requests, plan_batches(requests, batch_tokens), device,
                                 pad_id=prefix_token_id(tokenizer)))
    return scores
