"""Every shipped accelerate config loads with accelerate's own loader and leaves recipe fields alone."""

from __future__ import annotations

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from tests.helpers import ROOT

CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
EXPECTED = {"cpu", "cpu_ddp", "single_gpu", "ddp", "fsdp", "zero1", "zero2", "zero3", "zero2_offload",
            "zero3_offload", "multinode_zero3"}
RECIPE_OWNED_DS_FIELDS = {"gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                          "train_micro_batch_size_per_gpu", "optimizer", "scheduler", "fp16", "bf16"}


def test_the_documented_set_is_shipped():
    assert {p.stem for p in CONFIGS} >= EXPECTED


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_leaves_precision_and_batches_to_the_recipe(path):
    loaded = load_config_from_file(str(path))
    raw = yaml.safe_load(path.read_text())
    assert raw.get("mixed_precision", "no") == "no", "the recipe owns precision"
    assert loaded.num_processes >= 1
    ds = raw.get("deepspeed_config") or {}
    assert not (RECIPE_OWNED_DS_FIELDS & set(ds)), f"{path.name} sets recipe-owned DeepSpeed fields"
    if path.stem.startswith("zero"):
        stage = int(path.stem[4])
        assert raw["distributed_type"] == "DEEPSPEED" and ds["zero_stage"] == stage
        assert ("offload" in path.stem) == (ds["offload_optimizer_device"] != "none")
    if path.stem == "multinode_zero3":
        assert ds["deepspeed_multinode_launcher"] == "standard" and raw["num_machines"] > 1
