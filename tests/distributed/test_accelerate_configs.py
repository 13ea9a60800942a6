"""Every shipped accelerate config loads with accelerate's own loader and leaves recipe fields alone."""

from __future__ import annotations

import json

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from tests.helpers import ROOT

CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
EXPECTED = {"cpu", "cpu_ddp", "single_gpu", "ddp", "fsdp", "zero1", "zero2", "zero3", "zero2_offload",
            "zero3_offload", "multinode_zero3", "multinode_zero3_hpz", "multinode_hsdp"}
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
    if path.stem.startswith("multinode_zero3"):
        assert ds["deepspeed_multinode_launcher"] == "standard" and raw["num_machines"] > 1
    if path.stem == "multinode_zero3_hpz":
        # accelerate has no hpZ key: the ZeRO block is a DeepSpeed JSON, and accelerate refuses its own ZeRO keys
        # beside one; "auto" is filled with the GPUs per node by pretrain
        user = json.loads((ROOT / ds["deepspeed_config_file"]).read_text())
        assert user == {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": "auto"}}
        assert not {"zero_stage", "offload_optimizer_device", "offload_param_device", "zero3_save_16bit_model"} & set(ds)
    if path.stem == "multinode_hsdp":
        sizes = loaded.parallelism_config  # as accelerate's loader reads it: what accelerate launch exports
        assert raw["fsdp_config"]["fsdp_version"] == 2 and raw["num_machines"] > 1
        assert (sizes["parallelism_config_dp_replicate_size"] * sizes["parallelism_config_dp_shard_size"]
                == loaded.num_processes)
        assert sizes["parallelism_config_dp_replicate_size"] == raw["num_machines"]
