"""A rank that refuses alone (pretrain/distributed/supervise.py ``refuse``): its peers say why, not gloo's traceback.

Refusals every rank reaches together are decided before any collective (``rank_problems``: the resume's checks,
tests/checkpoint/test_trust.py); this is the net for the rest: one rank raises ConfigError where its peers do not
(its own file, its own device) and leaves, and a peer's next collective fails. Two real processes over gloo
under torchrun.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.helpers import ROOT

SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
from pretrain.distributed.agreement import refuse
from pretrain.distributed.supervise import run_worker
from pretrain.errors import ConfigError

ALONE = os.environ["REFUSING_RANK"]


def body():
    dist.init_process_group("gloo")
    try:
        if str(dist.get_rank()) == ALONE:
            raise ConfigError("shard_7.pt of this rank is damaged")
        for _ in range(3):  # the others go on into collectives with a peer that has left
            dist.all_reduce(torch.ones(1))
        return 0
    except ConfigError as exc:  # as pretrain/run.py does
        refuse(str(exc))
        if dist.get_rank() == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2


sys.exit(run_worker(body))
"""


def _launch(tmp_path, refusing: int) -> subprocess.CompletedProcess:
    script = tmp_path / "refuse_alone.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "REFUSING_RANK": str(refusing)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], env=env, capture_output=True, text=True, timeout=300)


def test_a_rank_refusing_alone_ends_its_peers_with_its_message_and_exit_2(tmp_path):
    """Rank 1 refuses alone while rank 0 enters a collective: rank 0 prints rank 1's message once, both exit 2
    (torchrun's summary), and neither prints a traceback; before, rank 0 died with gloo's "Connection closed by
    peer" traceback and exit 1, and rank 1's message was printed by no one."""
    proc = _launch(tmp_path, 1)
    # the workers print no traceback (torchrun's own ChildFailedError report follows them)
    workers = proc.stderr.split("Traceback (most recent call last):\n  File \"<frozen runpy>\"")[0]
    assert proc.returncode != 0 and "Traceback" not in workers, proc.stderr[-3000:]
    assert "Connection closed by peer" not in proc.stderr and 'refuse_alone.py", line' not in proc.stderr
    assert proc.stderr.count("shard_7.pt of this rank is damaged") == 1, proc.stderr[-3000:]
    assert "error: rank 1 (host " in proc.stderr, proc.stderr[-3000:]
    assert "exitcode  : 1" not in proc.stderr, proc.stderr[-3000:]
