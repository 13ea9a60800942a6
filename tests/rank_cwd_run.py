"""``pretrain/run.py`` with every process in a working directory of its own, ``ROOT/rank<RANK>``: a relative
path (or a symlink through ``/proc/self/cwd``) then names a different directory on each rank, as a path on
node-local disk does on each node of a cluster. Two processes on one machine, two views of the "same" path.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/rank_cwd_run.py ROOT --recipe R [k=v ...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pretrain.run import main

if __name__ == "__main__":
    rank_dir = Path(sys.argv[1]) / f"rank{os.environ['RANK']}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    os.chdir(rank_dir)
    sys.exit(main(sys.argv[2:]))
