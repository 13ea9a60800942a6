"""Peak memory of one forward + backward with the chunked loss against transformers' plain loss, on CPU.

    python tools/bench_loss_memory.py                      # vocab 32,000, MBS 4 x 2,048 tokens, bf16 autocast
    python tools/bench_loss_memory.py --tokens 1024 --json out.json

A small Llama (1 block, hidden 64) with a 32k vocabulary, so the LM head's logits are what a micro-batch's
memory is about, runs one forward and backward per loss implementation (``model.loss``: chunked, plain) on
the same weights and tokens, under bf16 autocast with fp32 weights as a bf16 run trains (``--dtype fp32``: no
autocast). The peak is the CPU allocator's own count: torch.profiler with ``profile_memory=True`` reports
every allocation and free with the running total of bytes allocated since the profile began ("Total
Allocated" of its ``[memory]`` events), whose maximum is the step's peak above the weights and inputs that
existed before it. Deterministic: the same shapes allocate the same tensors on every run.

The micro-batch matters: the chunked loss upcasts ``shape.loss_chunk_tokens(vocab)`` tokens at a time (2,097
at 32k), so a micro-batch of fewer tokens is one chunk and saves nothing over the plain loss's fp32 copy;
llama-1b's MBS 4 x 2,048 = 8,192 tokens (the default here) is four chunks.

Prints both peaks and the reduction (1 - chunked / plain); docs/performance.md has the figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, LlamaConfig

from pretrain.model.loss import install_loss

GIB = 2**30


def tiny_llama(vocab_size: int, hidden_size: int) -> torch.nn.Module:
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side prints its start and stop to file descriptor 2: not this tool's output."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_allocated_bytes(step) -> int:
    """The most CPU bytes allocated at once while ``step()`` runs, above what existed before it."""
    with tempfile.TemporaryDirectory() as tmp:
        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]  # 0: CPU
    if not totals:
        raise RuntimeError("torch.profiler reported no CPU allocation: cannot measure the peak")
    return max(totals)


def measure(implementation: str, *, vocab_size: int, hidden_size: int, micro_batch_size: int, seq_len: int,
            dtype: str) -> int:
    """Peak bytes of one forward + backward of the model with ``implementation``'s loss."""
    model = tiny_llama(vocab_size, hidden_size)
    install_loss(model, implementation)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (micro_batch_size, seq_len), generator=g)
    num_targets = float(ids.numel())

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = model(input_ids=ids, labels=ids, shift_labels=ids, num_items_in_batch=num_targets).loss
        loss.backward()

    return peak_allocated_bytes(step)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048, help="sequence length (tokens per sequence)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    shape = {"vocab_size": args.vocab_size, "hidden_size": args.hidden_size,
             "micro_batch_size": args.micro_batch_size, "seq_len": args.tokens, "dtype": args.dtype}
    peaks = {name: measure(name, **shape) for name in ("plain", "chunked")}
    reduction = 1 - peaks["chunked"] / peaks["plain"]
    logits_gib = args.micro_batch_size * args.tokens * args.vocab_size * 4 / GIB
    print(f"forward + backward, vocab {args.vocab_size:,}, MBS {args.micro_batch_size} x {args.tokens:,} tokens, "
          f"{args.dtype} (fp32 logits would be {logits_gib:.2f} GiB)")
    print(f"  plain   (transformers ForCausalLMLoss): peak {peaks['plain'] / GIB:.3f} GiB")
    print(f"  chunked (pretrain/model/loss.py):             peak {peaks['chunked'] / GIB:.3f} GiB")
    print(f"  chunked / plain = {peaks['chunked'] / peaks['plain']:.3f}: {reduction:.1%} lower")
    if args.json:
        args.json.write_text(json.dumps({**shape, "peak_bytes": peaks, "reduction": reduction}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
