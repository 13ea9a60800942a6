"""pretrain-export of one checkpoint in this fresh process, its anonymous memory sampled (run by
tests/checkpoint/test_export_memory.py and tools/scale_ckpt.py).

Prints one JSON line: the process's anonymous resident memory (RssAnon: what the kernel cannot reclaim; a
memory-mapped checkpoint file's pages are the page cache's, reclaimed under pressure) just before the export
and its peak during it (sampled every millisecond), and the seconds the export took.

    python tools/export_probe.py CHECKPOINT OUT SHARD_BYTES [--whole | --convert RANK WORLD]

``--whole`` measures the comparison instead: the whole fp32 model read into memory at once, as pretrain-export
did before it read a group at a time (``pretrain.checkpoint.weights.full_state_dict``); nothing is written.
``--convert RANK WORLD`` measures rank RANK's share of a resume's conversion into the neutral form among WORLD
ranks (``reshard._convert_share``, written into OUT in neutral shards of SHARD_BYTES; WORLD 1: one rank converts it
all, as before issue 51), and adds the bytes of tensors it read, the checkpoint's total and what it wrote.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path


def anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main() -> None:
    checkpoint, out, shard_bytes = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    whole = "--whole" in sys.argv[4:]
    convert = None
    if "--convert" in sys.argv[4:]:
        at = sys.argv.index("--convert")
        convert = int(sys.argv[at + 1]), int(sys.argv[at + 2])
    # what the export imports, imported first: the baseline is the process before any weight is read
    import deepspeed.utils.zero_to_fp32  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import transformers  # noqa: F401

    from pretrain.checkpoint import neutral, reshard
    from pretrain.checkpoint.engine_files import ZeroFiles  # noqa: F401
    from pretrain.checkpoint.export import export
    from pretrain.checkpoint.rundir import read_state
    from pretrain.checkpoint.weights import full_state_dict
    from pretrain.model.build import build_model  # noqa: F401
    from pretrain.trust import enforce

    enforce()
    baseline = anon_bytes()
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anon_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    extra = {}
    if convert is not None:
        neutral.SHARD_BYTES = shard_bytes  # what one rank holds before it writes a shard (2 GiB in a run)
        saved = reshard.saved_layout(checkpoint, read_state(checkpoint))
        part = reshard._convert_share(checkpoint, out, reshard.NEUTRAL, saved, *convert)
        extra = {k: part[k] for k in ("read", "total", "largest", "written")}
    elif whole:
        weights = full_state_dict(checkpoint, log=lambda _: None)  # noqa: F841 - held until measured
    else:
        export(checkpoint, out, log=lambda _: None, shard_bytes=shard_bytes)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    peak[0] = max(peak[0], anon_bytes())
    print(json.dumps({"baseline_bytes": baseline, "peak_bytes": peak[0], "seconds": seconds, **extra}))


if __name__ == "__main__":
    main()
