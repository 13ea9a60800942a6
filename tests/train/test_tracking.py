"""The same metrics in every backend: metrics.jsonl, wandb (offline) and tensorboard, read back from disk."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import FAST, check_ok, metrics, train

pytestmark = pytest.mark.slow

INTERNAL_WANDB = {"_runtime", "_step", "_timestamp"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tracking") / "run"
    # No WANDB_MODE, no API key, no netrc: wandb must choose offline by itself.
    no_wandb_login = {"WANDB_MODE": None, "WANDB_API_KEY": None, "HOME": str(out.parent), "NETRC": None}
    proc = train([*FAST, "train.max_steps=4", "logging.backends=[jsonl, wandb, tensorboard]", f"output_dir={out}"],
                 extra_env=no_wandb_login)
    check_ok(proc)
    return out


def wandb_records(run_dir: Path) -> list[dict]:
    """Records of the offline run file, decoded by wandb's own reader (`wandb leet inspect --json`)."""
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    wandb = shutil.which("wandb") or str(Path(__import__("sys").executable).parent / "wandb")
    out = subprocess.run([wandb, "leet", "inspect", "--json", str(run_file)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_jsonl_wandb_and_tensorboard_have_the_same_metric_keys(run_dir):
    jsonl_keys = {k for record in metrics(run_dir) for k in record} - {"step", "time"}

    wandb_keys = set()
    for record in wandb_records(run_dir):
        if record.get("type") == "history":
            wandb_keys |= set(record["history"]["item"]) - INTERNAL_WANDB

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events_dir,) = {p.parent for p in run_dir.glob("tensorboard/*/events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events_dir))
    accumulator.Reload()
    tensorboard_keys = set(accumulator.Tags()["scalars"])

    assert {"train/loss", "perf/mfu", "perf/tokens_per_s", "batch/gbs", "val/loss", "memory/peak_gib"} <= jsonl_keys
    assert jsonl_keys == wandb_keys == tensorboard_keys
    assert list(run_dir.glob("wandb/offline-run-*")), "wandb chose offline mode by itself"


def test_run_config_in_every_backend_names_the_mfu_convention(run_dir):
    config = json.loads((run_dir / "run_config.json").read_text())
    for key in ("perf/flops_per_token", "perf/peak_tflops", "perf/mfu_convention", "perf/peak_source",
                "plan/global_batch_size", "recipe/model/hidden_size", "dist/world_size"):
        assert key in config, key
    assert config["perf/peak_source"] == "measured"  # CPU: this machine's matmul benchmark
    assert "6 x N + 12 x L x H x head_dim x seq_len" in config["perf/mfu_convention"]

    wandb_config = {}
    for record in wandb_records(run_dir):
        if record.get("type") == "config":
            wandb_config.update(record["config"]["update"])
    assert {"perf/flops_per_token", "perf/mfu_convention", "plan/global_batch_size"} <= set(wandb_config)

    hparams = list(run_dir.glob("tensorboard/*/*/hparams.yml"))
    assert hparams and "perf/mfu_convention" in hparams[0].read_text()


def test_logged_mfu_is_flops_times_throughput_over_peak(run_dir):
    config = json.loads((run_dir / "run_config.json").read_text())
    checked = 0
    for record in metrics(run_dir):
        if "perf/mfu" not in record:
            continue
        expected = record["perf/flops_per_token"] * record["perf/tokens_per_s_per_device"] / (
            record["perf/peak_tflops"] * 1e12)
        assert record["perf/mfu"] == pytest.approx(expected, rel=1e-9)
        assert record["perf/flops_per_token"] == config["perf/flops_per_token"]
        assert record["perf/tflops_per_device"] == pytest.approx(
            record["perf/flops_per_token"] * record["perf/tokens_per_s_per_device"] / 1e12, rel=1e-9)
        checked += 1
    assert checked == 3  # steps 2-4: step 1 is the throughput warm-up
