"""``pretrain/run.py`` with every micro-batch the training loop takes written down: what each rank really trained
on, for tests that check a claim about the data order against it (``pretrain-data which``).

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/record_batches_run.py OUT --recipe R [k=v ...]

Each rank appends to OUT/rank<RANK>.jsonl one line per micro-batch as the loop takes it from the loader:
{"step": optimizer step (1-based, as in metrics.jsonl), "micro": micro-step, "rows": the rows' seq_len + 1 token
ids (the inputs and the last target)}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pretrain.data.loader as loader_module
from pretrain.run import main


class Recorded:
    """The run's own DataLoader; iterating it also writes each batch down, after the loop has taken it."""

    def __init__(self, loader, path: Path, start_step: int, grad_accum_steps: int):
        self.loader, self.path, self.start_step, self.gas = loader, path, start_step, grad_accum_steps

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        import torch

        with open(self.path, "a", buffering=1) as out:
            for i, batch in enumerate(self.loader):
                rows = torch.cat([batch.input_ids, batch.targets[:, -1:]], dim=1)
                step, micro = divmod(i, self.gas)
                out.write(json.dumps({"step": self.start_step + step + 1, "micro": micro, "rows": rows.tolist()}) + "\n")
                yield batch


def recording(build, directory: Path):
    def build_train_loader(data, data_cfg, plan, rank, seed, start_step, *args, **kwargs):
        loader, order = build(data, data_cfg, plan, rank, seed, start_step, *args, **kwargs)
        return Recorded(loader, directory / f"rank{rank}.jsonl", start_step, plan.grad_accum_steps), order

    return build_train_loader


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    loader_module.build_train_loader = recording(loader_module.build_train_loader, out)  # TrainData's
    sys.exit(main(sys.argv[2:]))
