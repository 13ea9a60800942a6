"""Shared pytest set-up: GPU tests skip where no CUDA device is present; one private SLURM cluster per session."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster, SlurmUnavailable, ensure_installed


def pytest_configure(config):
    """Runs go to a directory of this test process (PRETRAIN_RUNS_DIR, read by every process the tests start), never
    to the checkout's runs/, which holds the user's demo (README's quick start runs the demo, then the tests).

    Under pytest-xdist (README's test command: two workers on a 2-core machine) each worker and the processes it
    starts use one thread, so that two workers share the cores instead of oversubscribing them (torch's idle threads
    spin). Set before torch is imported."""
    os.environ["PRETRAIN_RUNS_DIR"] = tempfile.mkdtemp(prefix="pretrain-test-runs-")
    # --dist loadfile hands out files in the collection's order only without xdist's reorder (on by default since
    # 3.6: by number of tests per file, which put the long files of one or two tests, the fault harness and the
    # install, last, and the suite ended with one worker idle for a minute): LONGEST_FIRST decides.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    # No hub at run time in the tests (the processes they start get it from tests/helpers.env): in-process checks of
    # a hub tokenizer's recipe (recipes/7b.yaml) would otherwise retry an unreachable hub for tens of seconds. Before
    # huggingface_hub is imported (it reads the variable once).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    # DeepSpeed's ops (its CPU collectives: a minute to build) in one directory of this environment for the whole
    # suite, also for the tests that give their runs a cache of their own (PRETRAIN_CACHE_DIR, data.cache_dir): built
    # once, where tools/install.sh builds it under the suite's cache (pretrain/system/environment.py). Inherited by
    # every process the tests start; a TORCH_EXTENSIONS_DIR of the user's is kept.
    from pretrain.system.environment import CACHE_ENV, OP_BUILDS_ENV, op_build_dir
    from tests.helpers import SUITE_CACHE

    if not os.environ.get(OP_BUILDS_ENV):
        os.environ[OP_BUILDS_ENV] = str(op_build_dir({CACHE_ENV: os.environ.get(CACHE_ENV) or str(SUITE_CACHE)}))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        # xdist's workers ignore SIGINT (the controller handles Ctrl-C), and an ignored signal is inherited: the runs
        # they start would ignore Ctrl-C as a background job does. The tests of Ctrl-C need a foreground's.
        signal.signal(signal.SIGINT, signal.default_int_handler)


# The files whose runs take longest (their tests' durations summed, a full run on 2 cores: 449 s down to 31 s), in that
# order. Under xdist's --dist loadfile a worker takes the next file when it is free, in collection order (the reorder
# is off: pytest_configure): these go first, so that the suite does not end with one worker alone on a long file while
# the other idles (longest-first scheduling). Other files keep their order.
LONGEST_FIRST = ("test_readme.py", "test_distributed.py", "test_reshard.py", "test_memory_validation.py", "test_run.py",
                 "test_fault_harness.py", "test_init_from.py", "test_tools.py", "test_install.py", "test_reduce_dtype.py",
                 "test_slurm.py", "test_rollback.py", "test_preemption_phases.py", "test_architectures.py",
                 "test_trust.py", "test_hybrid.py", "test_launch.py", "test_long_runs.py", "test_stability.py",
                 "test_tensor_parallel.py", "test_expert_parallel.py", "test_moe.py", "test_store.py")


def pytest_unconfigure(config):
    runs = os.environ.get("PRETRAIN_RUNS_DIR", "")
    if "pretrain-test-runs-" in runs:  # the directory pytest_configure made, nothing else
        shutil.rmtree(runs, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cluster():
    try:
        ensure_installed()
    except SlurmUnavailable as exc:
        pytest.skip(f"SLURM could not be installed here, so the real-SLURM tests cannot run: {exc}")
    # A short root: the munge socket path must fit in a unix socket address (108 bytes).
    root = Path(tempfile.mkdtemp(prefix="pretrain-slurm-"))
    cluster = SlurmCluster(root)
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        cluster.stop()
        if os.geteuid() != 0:
            pytest.skip(f"SLURM is installed but cannot run jobs as this user: {exc}")
        pytest.fail(f"the test SLURM cluster did not start: {exc}")
    yield cluster
    cluster.stop()
    shutil.rmtree(root, ignore_errors=True)


# ---- in-process runs on one thread (trim2) --------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """The test's in-process runs (tests/helpers.train_here) on one torch thread, and the processes it starts with
    OMP_NUM_THREADS=1 (tests/helpers.OneThread says why)."""
    from tests.helpers import OneThread

    with OneThread():
        yield
