"""The export writes a model a shard at a time, reading a checkpoint a group of tensors at a time: the files are
save_pretrained's own (byte for byte where it writes one shard; the same tensors and a valid index where it writes
several), an MoE's fused experts are written in the hub's per-expert form as save_pretrained writes them, and a
checkpoint's weights are read lazily (nothing of a layout is materialized until a tensor is asked for)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import FAST_MODEL, make_recipe

MOE = ["model.num_kv_heads=2", "model.intermediate_size=null", "model.moe.num_experts=4",
       "model.moe.experts_per_token=2", "model.moe.expert_intermediate_size=64"]


def built(arch: str):
    from pretrain.model.build import build_model

    recipe = make_recipe(*FAST_MODEL, f"model.arch={arch}", *(MOE if arch == "qwen3_moe" else []))
    return build_model(recipe.model, 256, 64, seed=0, pretrained=False, log=lambda _: None)


def written(model, directory: Path, shard_bytes: int) -> dict[str, bytes]:
    from pretrain.model.hf_save import in_memory, write_pretrained

    directory.mkdir()
    specs, read = in_memory(model.state_dict())
    write_pretrained(model, specs, read, directory, shard_bytes)
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_one_shard_is_save_pretrained_s_files_byte_for_byte(tmp_path, arch):
    model = built(arch)
    model.save_pretrained(tmp_path / "reference", safe_serialization=True)
    reference = {p.name: p.read_bytes() for p in sorted((tmp_path / "reference").iterdir())}
    ours = written(model, tmp_path / "ours", shard_bytes=10**9)
    assert sorted(ours) == sorted(reference)
    for name in reference:
        assert ours[name] == reference[name], name  # an MoE's experts reverted to the hub's per-expert tensors too


def test_several_shards_hold_save_pretrained_s_tensors_and_index(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = built("llama")
    shard = 64 * 1024  # bytes: several shards of this tiny model
    model.save_pretrained(tmp_path / "reference", safe_serialization=True, max_shard_size=shard)
    ours = written(model, tmp_path / "ours", shard_bytes=shard)
    shards = [n for n in ours if n.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in ours
    reference = json.loads((tmp_path / "reference" / "model.safetensors.index.json").read_text())
    assert json.loads(ours["model.safetensors.index.json"]) == reference
    for name in shards:
        assert load_file(tmp_path / "ours" / name).keys() == load_file(tmp_path / "reference" / name).keys()
        assert ours[name] == (tmp_path / "reference" / name).read_bytes(), name
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_a_checkpoint_s_weights_are_read_one_group_at_a_time(tmp_path, monkeypatch):
    """A one-process checkpoint's reader gives every tensor's shape up front and reads only what it is asked for."""
    from safetensors.torch import save_file

    from pretrain.checkpoint import weights as weights_module

    tensors = {f"layer{i}.weight": torch.full((64, 32), float(i), dtype=torch.bfloat16) for i in range(6)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = weights_module._from_safetensors(tmp_path / "model.safetensors")
    assert {n: s.shape for n, s in reader.specs.items()} == {n: (64, 32) for n in tensors}
    assert {s.dtype for s in reader.specs.values()} == {torch.float32}  # what read() gives: fp32
    asked: list[list[str]] = []
    fetch = reader._fetch
    reader._fetch = lambda names: asked.append(names) or fetch(names)
    groups = list(reader.groups(sorted(tensors), budget_bytes=2 * 64 * 32 * 4))
    assert asked == [["layer0.weight", "layer1.weight"], ["layer2.weight", "layer3.weight"],
                     ["layer4.weight", "layer5.weight"]]
    for group in groups:
        for name, value in group.items():
            assert value.dtype == torch.float32 and torch.equal(value, tensors[name].float())


@pytest.mark.parametrize("layout, files, read", [
    ({"engine": "ddp", "world_size": 2}, ["model.safetensors", "optimizer.bin", "scheduler.bin"],
     ["model.safetensors"]),
    ({"engine": "fsdp", "world_size": 2},
     ["pytorch_model_fsdp_0/__0_0.distcp", "optimizer_0/__0_0.distcp", "random_states_0.pkl"],
     ["pytorch_model_fsdp_0/__0_0.distcp"]),
    ({"engine": "deepspeed", "world_size": 2, "zero_stage": 3},
     ["pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt", "scheduler.bin"],
     ["pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt"]),
])
def test_the_export_checks_the_checksums_of_the_files_it_reads(tmp_path, layout, files, read):
    """Every file's size is checked; the checksums of the weights' files (and the trainer state), not of the
    optimizer's other states, the scheduler or the random states, which the export never reads."""
    from pretrain.checkpoint.weights import read_by_export
    from tests.checkpoint.test_reshard import make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "step_00000003", world=2, layout=layout, files=files)
    selected = read_by_export(checkpoint)
    assert sorted(f for f in [*files, "trainer_state.json"] if selected(f)) == sorted([*read, "trainer_state.json"])
