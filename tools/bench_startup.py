"""Start-up benchmark: seconds from the command to the first optimizer step, the tiny recipe against a minimal
accelerate loop on the same model.

    python tools/bench_startup.py [--repeats 5] [--launcher accelerate|python] [--eval-at-start]

Both are started as fresh processes, alternately (pretrain first in odd repeats, the minimal loop first in
even ones, so a drift of a shared machine weighs on both), with the same launcher: ``accelerate launch
--config_file accelerate_configs/cpu.yaml SCRIPT`` (the README's demo command) or ``python SCRIPT``. The time
of a run is from the moment the process is started to the moment it prints the line of its first optimizer
step (read from its stdout as it comes, unbuffered); the whole process's time is printed beside it.

- pretrain: ``pretrain/run.py --recipe recipes/tiny.yaml`` with one optimizer step (GAS 2 micro-batches of
  16 x 128 tokens, the recipe's), its plain log line ``step 1/1`` as the marker, no checkpoint and no final
  model; without ``--eval-at-start``, no step-0 evaluation (start-up, not evaluation, is measured). Its data
  cache is warm: an untimed run first prepares the token store (and whatever else a first run caches).
- minimal: this file with ``--minimal``: accelerate's Accelerator (GAS 2), the same Llama built by
  ``AutoModelForCausalLM.from_config`` from the tiny recipe's shape (vocabulary 4,096, tied embeddings,
  sdpa), torch's AdamW, and one optimizer step on two random micro-batches of the same size; then
  ``step 1/1``.

It prints each run's seconds, the min and median of each, and the ratios of the medians and of the minima
(the goal: pretrain <= 1.5 x minimal). Run it on a quiet machine; other jobs only ever slow a run down, which
is why the minima are printed too.

    python tools/bench_startup.py --init recipes/llama-1b.yaml [--repeats 3] [key.path=value ...]

times the weights' init alone (``pretrain.model.build.init_weights`` on the recipe's model, built on CPU): the
decoder layers drawn on threads (the default: this process's share of the cores) against one thread, alternately,
in this process, with the same values (checked); medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "step 1/"
GOAL_RATIO = 1.5
# The tiny recipe's model, batch and optimizer (recipes/tiny.yaml), for the minimal loop.
TINY_MODEL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=384, vocab_size=4096, max_position_embeddings=128, tie_word_embeddings=True)
MBS, SEQ_LEN, GAS = 16, 128, 2


def minimal_loop() -> None:
    """The baseline: what any accelerate user writes for one optimizer step of this model."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, LlamaConfig

    accelerator = Accelerator(gradient_accumulation_steps=GAS)
    config = LlamaConfig(**TINY_MODEL, use_cache=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(0)
    for _ in range(GAS):
        ids = torch.randint(0, TINY_MODEL["vocab_size"], (MBS, SEQ_LEN), generator=generator).to(accelerator.device)
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    print(f"{MARKER}1 loss {loss.item():.4f}", flush=True)


def pretrain_args(output_dir: Path, eval_at_start: bool) -> list[str]:
    return [str(ROOT / "pretrain" / "run.py"), "--recipe", str(ROOT / "recipes" / "tiny.yaml"),
            "train.max_steps=1", "train.max_tokens=null", "lr_schedule.warmup_steps=0",
            f"eval.at_start={'true' if eval_at_start else 'false'}", "eval.batches=1",
            "checkpoint.every_steps=0", "checkpoint.save_last=false", "checkpoint.save_final_model=false",
            "checkpoint.resume=none", "logging.progress=plain", "logging.backends=[jsonl]", f"output_dir={output_dir}"]


def command(launcher: str, script_args: list[str]) -> list[str]:
    if launcher == "python":
        return [sys.executable, *script_args]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / "accelerate_configs" / "cpu.yaml"), *script_args]


def timed(cmd: list[str]) -> tuple[float, float]:
    """(seconds to the first-step marker, seconds to the end of the process)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_step, output = None, []
    for line in proc.stdout:
        output.append(line)
        if first_step is None and line.startswith(MARKER):
            first_step = time.perf_counter() - start
    code = proc.wait()
    total = time.perf_counter() - start
    if code != 0 or first_step is None:
        sys.exit(f"bench_startup: {' '.join(cmd)} exited {code} without printing {MARKER!r}:\n{''.join(output)[-3000:]}")
    return first_step, total


def bench_init(recipe_path: str, overrides: list[str], repeats: int) -> int:
    """init_weights on threads against one thread, on the recipe's model (CPU, fp32)."""
    import torch

    from pretrain.errors import ConfigError
    from pretrain.model.build import _repeated_blocks, build_model, init_threads, init_weights
    from pretrain.recipe.config import load_recipe
    from pretrain.recipe.shape import ModelShape

    try:
        recipe = load_recipe(recipe_path, overrides)
    except ConfigError as exc:
        print(f"bench_startup: {exc}", file=sys.stderr)
        return 2
    vocab = ModelShape.from_recipe(recipe).vocab_size  # the tokenizer's, as the run resolves it
    model = build_model(recipe.model, vocab, recipe.data.seq_len, seed=recipe.train.seed)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    threads = init_threads(len(_repeated_blocks(model)))
    params = sum(p.numel() for p in model.parameters())
    print(f"{recipe_path}: {params / 1e9:.2f}B parameters, {len(_repeated_blocks(model))} blocks, "
          f"{len(os.sched_getaffinity(0))} cores, torch intra-op threads {torch.get_num_threads()}")
    times: dict[int, list[float]] = {1: [], threads: []}
    for i in range(repeats):
        for n in ((1, threads) if i % 2 == 0 else (threads, 1)):
            start = time.perf_counter()
            init_weights(model, recipe.train.seed, threads=n)
            times[n].append(time.perf_counter() - start)
            same = all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
            print(f"repeat {i + 1}  threads {n:<3} {times[n][-1]:6.2f} s   same values: {same}", flush=True)
            if not same:
                return 1
    one, many = statistics.median(times[1]), statistics.median(times[threads])
    print(f"init_weights: one thread {one:.2f} s, {threads} threads {many:.2f} s (medians of {repeats}): "
          f"{one / many:.2f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--init", metavar="RECIPE", help="time the weights' init alone, threads against one thread")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="--init: recipe overrides")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each (default 5)")
    parser.add_argument("--launcher", choices=("accelerate", "python"), default="accelerate",
                        help="accelerate launch with accelerate_configs/cpu.yaml (default), or python")
    parser.add_argument("--eval-at-start", action="store_true", help="keep the tiny recipe's step-0 evaluation")
    parser.add_argument("--minimal", action="store_true", help=argparse.SUPPRESS)  # the baseline's own process
    args = parser.parse_args(argv)
    if args.minimal:
        minimal_loop()
        return 0
    if args.init:
        return bench_init(args.init, args.overrides, max(args.repeats, 1))
    if args.overrides:
        parser.error("key.path=value overrides go with --init")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        runs = {
            "pretrain": lambda i: command(args.launcher, pretrain_args(Path(tmp) / f"run{i}", args.eval_at_start)),
            "minimal": lambda i: command(args.launcher, [str(Path(__file__).resolve()), "--minimal"]),
        }
        print("warm-up (untimed): the token store, tokenizer and other caches of a first run", flush=True)
        for cmd in runs.values():
            timed(cmd("warmup"))
        first: dict[str, list[float]] = {name: [] for name in runs}
        whole: dict[str, list[float]] = {name: [] for name in runs}
        for i in range(args.repeats):
            for name in (runs if i % 2 == 0 else reversed(runs)):
                to_step, total = timed(runs[name](i))
                first[name].append(to_step)
                whole[name].append(total)
                print(f"repeat {i + 1}  {name:<9} first step {to_step:6.2f} s   whole process {total:6.2f} s", flush=True)
    print(f"\nlauncher: {args.launcher}; seconds from the command to the first optimizer step "
          f"({args.repeats} runs each{', step-0 evaluation included' if args.eval_at_start else ''})")
    print(f"{'':<10}{'min':>8}{'median':>8}   whole process min / median")
    for name in runs:
        print(f"{name:<10}{min(first[name]):8.2f}{statistics.median(first[name]):8.2f}   "
              f"{min(whole[name]):.2f} / {statistics.median(whole[name]):.2f}")
    ratio_median = statistics.median(first["pretrain"]) / statistics.median(first["minimal"])
    ratio_min = min(first["pretrain"]) / min(first["minimal"])
    verdict = "meets" if ratio_median <= GOAL_RATIO else "misses"
    print(f"pretrain / minimal: {ratio_median:.2f}x (medians), {ratio_min:.2f}x (minima); {verdict} the goal "
          f"<= {GOAL_RATIO}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
