"""Resume on another layout (pretrain/checkpoint/reshard.py), pretrain-launch's check of it, and pretrain-export's argument
checks.

The decisions are pure file reads and are tested here on hand-made checkpoint directories (pretrain-launch's
refusals too, each with the command it prints, which must pass); the real conversions and continued curves
are in the slow tests at the end (a 2-process ZeRO-2 run resumed on 1 and on 3 processes; 2-process ZeRO-3
and FSDP runs resumed on 3; DDP 1 -> 2 -> 1 processes, the first through pretrain-launch; every kind of checkpoint
on another kind, through the neutral form) and in tests/multiprocess/test_distributed.py (exports of the shared
curves' checkpoints, FSDP's among them)."""

from __future__ import annotations

import json
import math
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pretrain.checkpoint import reshard
from pretrain.checkpoint.reshard import NEUTRAL, CheckpointLayout, conversion, prepare_resume, saved_layout
from pretrain.checkpoint.state import TrainerState
from pretrain.checkpoint.weights import full_state_dict
from pretrain.cli import export
from pretrain.distributed.layout import Launch
from pretrain.errors import ConfigError
from pretrain.train.stability import LOSS_FACTORS_ENV
from tests.helpers import (
    FAST,
    ROOT,
    TINY,
    OneThread,
    accelerate_launch,
    check_ok,
    free_port,
    metrics,
    run_cmd,
    train_here,
    train_losses,
)

DS2_W2 = CheckpointLayout("deepspeed", 2, 2)


def make_checkpoint(path: Path, *, world: int, layout: dict | None = None, files=(), saved_at=1.0,
                    optimizer_params: list | None = None) -> Path:
    path.mkdir(parents=True)
    state = TrainerState(step=3, tokens_seen=3, num_steps=6, plan={"world_size": world}, recipe={},
                         layout=layout, saved_at=saved_at, optimizer_params=optimizer_params)
    (path / "trainer_state.json").write_text(state.to_json())
    for name in files:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text("x")
    return path


# ---- which layout wrote a checkpoint --------------------------------------------------------------------
def test_recorded_layout_is_read_back(tmp_path):
    launch = Launch("deepspeed", zero_stage=3, gpus_per_node=4)
    ckpt = make_checkpoint(tmp_path / "c", world=4, layout=launch.to_dict())
    assert saved_layout(ckpt, json.loads((ckpt / "trainer_state.json").read_text())) == CheckpointLayout("deepspeed", 4, 3)


@pytest.mark.parametrize("files, expected", [
    (["pytorch_model/mp_rank_00_model_states.pt", "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt"],
     CheckpointLayout("deepspeed", 2, None)),
    (["pytorch_model/zero_pp_rank_0_mp_rank_00_model_states.pt",
      "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt"], CheckpointLayout("deepspeed", 2, 3)),
    (["pytorch_model/mp_rank_00_model_states.pt"], CheckpointLayout("deepspeed", 2, 0)),
    (["pytorch_model_fsdp_0/__0_0.distcp", "optimizer_0/__0_0.distcp"], CheckpointLayout("fsdp", 2)),
    (["model.safetensors", "optimizer.bin"], CheckpointLayout("ddp", 2)),
])
def test_older_checkpoints_without_a_recorded_layout_are_read_from_their_files(tmp_path, files, expected):
    ckpt = make_checkpoint(tmp_path / "c", world=2, files=files)
    assert saved_layout(ckpt, json.loads((ckpt / "trainer_state.json").read_text())) == expected


# ---- what a resume on another layout needs ----------------------------------------------------------------
@pytest.mark.parametrize("saved, target, expected", [
    (DS2_W2, DS2_W2, None),
    (CheckpointLayout("deepspeed", 2, None), CheckpointLayout("deepspeed", 2, 1), None),  # older ZeRO-1/2 files on ZeRO-1/2
    # ZeRO on another DP world size or stage: the neutral form, converted by every rank (see reshard.conversion)
    (DS2_W2, CheckpointLayout("deepspeed", 1, 2), NEUTRAL),
    (DS2_W2, CheckpointLayout("deepspeed", 3, 2), NEUTRAL),
    (DS2_W2, CheckpointLayout("deepspeed", 2, 1), NEUTRAL),
    (CheckpointLayout("deepspeed", 4, 1), CheckpointLayout("deepspeed", 2, 2), NEUTRAL),
    (CheckpointLayout("deepspeed", 4, 3), CheckpointLayout("deepspeed", 2, 3), NEUTRAL),  # see reshard.conversion
    (CheckpointLayout("ddp", 2), CheckpointLayout("ddp", 3), None),  # full state; model keys are checked in the file
    (CheckpointLayout("fsdp", 8), CheckpointLayout("fsdp", 4), None),  # torch.distributed.checkpoint reshards on load
    # across engines, and between ZeRO-1/2 and ZeRO-3: the neutral form, on any process count
    (DS2_W2, CheckpointLayout("ddp", 2), NEUTRAL),
    (CheckpointLayout("ddp", 1), CheckpointLayout("deepspeed", 2, 2), NEUTRAL),
    (CheckpointLayout("fsdp", 2), CheckpointLayout("ddp", 1), NEUTRAL),
    (CheckpointLayout("fsdp", 2, tp_size=2), CheckpointLayout("deepspeed", 4, 3), NEUTRAL),
    (DS2_W2, CheckpointLayout("deepspeed", 3, 3), NEUTRAL),
    (CheckpointLayout("deepspeed", 2, 3), CheckpointLayout("deepspeed", 2, 2), NEUTRAL),
    (CheckpointLayout("deepspeed", 2, 2, "cpu"), CheckpointLayout("fsdp", 4), NEUTRAL),
])
def test_conversion_needed(saved, target, expected):
    assert conversion(Path("ckpt"), saved, target) == expected


@pytest.mark.parametrize("saved, target, words", [
    (CheckpointLayout("deepspeed", 2, 0), CheckpointLayout("deepspeed", 4, 0), ["ZeRO-0", "no ZeRO optimizer",
                                                              "DeepSpeed ZeRO-0 on 2 processes as saved"]),
    (DS2_W2, CheckpointLayout("deepspeed", 2, 0), ["ZeRO-0"]),
    (CheckpointLayout("deepspeed", 2, 0), CheckpointLayout("ddp", 2), ["ZeRO-0", "pretrain-export ckpt"]),
    (CheckpointLayout("deepspeed", 2, 2, "nvme"), CheckpointLayout("deepspeed", 4, 2, "nvme"), ["NVMe"]),
    (CheckpointLayout("deepspeed", 2, 2, "nvme"), CheckpointLayout("fsdp", 2), ["NVMe"]),
])
def test_impossible_combinations_are_refused_with_what_to_do(saved, target, words):
    with pytest.raises(ConfigError) as info:
        conversion(Path("ckpt"), saved, target)
    for word in words:
        assert word in str(info.value)


def test_what_the_neutral_form_cannot_read_is_refused_before_any_process_starts(tmp_path):
    """FSDP's full state dict, and a one-process / DDP checkpoint that does not record its optimizer's
    parameter names (written before they were recorded): one message each, with what resumes it."""
    full = make_checkpoint(tmp_path / "full", world=2, layout=Launch("fsdp", gpus_per_node=2).to_dict(),
                           files=["pytorch_model_fsdp.bin", "optimizer.bin"])
    with pytest.raises(ConfigError, match="FSDP's full state dict.*SHARDED_STATE_DICT.*fsdp.yaml"):
        reshard.plan_resume(full, Launch("ddp", gpus_per_node=2))
    old = make_checkpoint(tmp_path / "old", world=1, layout=Launch("ddp").to_dict())
    with pytest.raises(ConfigError, match="before checkpoints recorded their optimizer's parameter names.*Resume it "
                                          "once with one process"):
        reshard.plan_resume(old, Launch("deepspeed", zero_stage=2, gpus_per_node=2))
    assert reshard.plan_resume(old, Launch("ddp", gpus_per_node=3)).kind is None  # its own engine: as it is
    named = make_checkpoint(tmp_path / "named", world=1, layout=Launch("ddp").to_dict(),
                            optimizer_params=[["w"], ["b"]])
    plan = reshard.plan_resume(named, Launch("deepspeed", zero_stage=2, gpus_per_node=2))
    assert plan.kind == NEUTRAL and "converted by every rank to the neutral form" in plan.describe()


def _ddp_checkpoint(tmp_path: Path, prefixed: bool, world: int = 2) -> Path:
    ckpt = make_checkpoint(tmp_path / "checkpoints" / "step_00000003", world=world,
                           files=["optimizer.bin", "scheduler.bin", "random_states_0.pkl"])
    save_file({("module." if prefixed else "") + "w": torch.arange(4.0)}, str(ckpt / "model.safetensors"))
    return ckpt


@pytest.mark.parametrize("world", [1, 3])
def test_ddp_weights_with_the_module_prefix_are_renamed_for_any_process_count_and_reused(tmp_path, world):
    """accelerate saves and loads the model it registered before wrapping it in DDP (its own keys on any process
    count); weights whose keys carry DDP's ``module.`` are renamed into a sibling (the rest linked)."""
    ckpt = _ddp_checkpoint(tmp_path, prefixed=True)
    logged = []
    source = prepare_resume(ckpt, Launch("ddp", gpus_per_node=world), log=logged.append)
    assert source.load_dir == ckpt.with_name("step_00000003.single")
    assert source.world_changed == (world != 2) and not source.neutral
    assert list(load_file(str(source.load_dir / "model.safetensors"))) == ["w"]
    assert {p.name for p in source.load_dir.iterdir()} == {"model.safetensors", "optimizer.bin", "scheduler.bin",
                                                          "random_states_0.pkl", "converted_from.json"}
    assert "converting" in logged[0] and "trainer_state.json" not in {p.name for p in source.load_dir.iterdir()}
    # not a checkpoint of its own: the run directory still holds one
    from pretrain.checkpoint.rundir import complete_checkpoints
    assert [p for _, p in complete_checkpoints(tmp_path)] == [ckpt]
    again = prepare_resume(ckpt, Launch("ddp", gpus_per_node=world), log=logged.append)
    assert again == source and "reusing" in logged[-1]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ddp_weights_as_accelerate_saves_them_load_as_they_are_on_any_process_count(tmp_path, world):
    ckpt = _ddp_checkpoint(tmp_path, prefixed=False, world=1)
    source = prepare_resume(ckpt, Launch("ddp", gpus_per_node=world), log=lambda _: None)
    assert (source.load_dir, source.world_changed) == (ckpt, world != 1)
    assert reshard.views(ckpt) == []


def test_a_converted_sibling_of_an_earlier_save_is_not_reused(tmp_path):
    ckpt = _ddp_checkpoint(tmp_path, prefixed=True)
    first = prepare_resume(ckpt, Launch("ddp"), log=lambda _: None)
    assert first.load_dir != ckpt
    state = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "trainer_state.json").write_text(json.dumps({**state, "saved_at": 2.0}))  # the step saved again
    logged = []
    assert prepare_resume(ckpt, Launch("ddp"), log=logged.append).load_dir == first.load_dir
    assert "converting" in logged[0]
    assert json.loads((first.load_dir / "converted_from.json").read_text())["saved_at"] == 2.0


def test_a_converted_view_is_reused_only_while_it_matches_its_source_and_its_own_checksums(tmp_path):
    """Issue 36: a converted view was reused on its stamp (the checkpoint's name, save time and step) alone, so a file
    changed in it (same size) trained silently on other weights. The view records its source's manifest and its own
    files' checksums; rank 0 checks both at every reuse and converts again what does not hold, saying why in one
    line: a view file changed at the same size, the checkpoint's weights replaced under the same save time (its
    manifest updated), a view of an earlier pretrain; a process that is not rank 0 waits for a view whose sizes do
    not match. Every rebuilt view holds the checkpoint's weights as they are."""
    from pretrain.checkpoint.integrity import record_own, write_manifest

    ckpt = _ddp_checkpoint(tmp_path, prefixed=True)
    write_manifest(ckpt, record_own(ckpt, 0, 1), 1)
    logged = []
    view = prepare_resume(ckpt, Launch("ddp"), log=logged.append).load_dir
    stamp = json.loads((view / "converted_from.json").read_text())
    assert stamp["manifest_sha256"] and sorted(stamp["files"]) == ["model.safetensors", "optimizer.bin",
                                                                  "random_states_0.pkl", "scheduler.bin"]
    assert prepare_resume(ckpt, Launch("ddp"), log=logged.append).load_dir == view
    assert "reusing the converted" in logged[-1] and "and its own checksums" in logged[-1]

    save_file({"w": torch.full((4,), 7.0)}, str(view / "model.safetensors"), metadata={"format": "pt"})  # same size
    assert (view / "model.safetensors").stat().st_size == stamp["files"]["model.safetensors"]["size"]
    del logged[:]
    assert prepare_resume(ckpt, Launch("ddp"), log=logged.append).load_dir == view
    assert logged[0].startswith(f"resume: the converted {view} is damaged ({view / 'model.safetensors'} has another "
                                "crc32 than its converted_from.json records (bytes from 0)); converting it again")
    assert torch.equal(load_file(str(view / "model.safetensors"))["w"], torch.arange(4.0))

    save_file({"module.w": torch.full((4,), 5.0)}, str(ckpt / "model.safetensors"))  # replaced, manifest updated
    write_manifest(ckpt, record_own(ckpt, 0, 1), 1)
    del logged[:]
    prepare_resume(ckpt, Launch("ddp"), log=logged.append)
    assert logged[0] == (f"resume: the converted {view} was made from {ckpt.name} as it was before: its manifest "
                         "(every file's size and checksums) has changed since; converting it again")
    assert torch.equal(load_file(str(view / "model.safetensors"))["w"], torch.full((4,), 5.0))

    stamp = json.loads((view / "converted_from.json").read_text())
    made_from = {k: v for k, v in stamp.items() if k in ("checkpoint", "saved_at", "step", "kind")}
    (view / "converted_from.json").write_text(json.dumps(made_from))  # as pretrain wrote it before
    del logged[:]
    prepare_resume(ckpt, Launch("ddp"), log=logged.append)
    assert "was made by an earlier pretrain, which recorded no checksums of it; converting it again" in logged[0]

    prepare_resume(ckpt, Launch("ddp", rank=1, gpus_per_node=1), log=print)  # intact: taken at once
    with open(view / "model.safetensors", "ab") as f:
        f.write(b"x")
    with pytest.raises(ConfigError, match="waited"):  # rank 0 converts it again: the others wait for that
        reshard._wait_for(view, reshard._made_from(ckpt, "single"), timeout_s=0.05, poll_s=0.01)


def test_same_layout_loads_the_checkpoint_itself_quietly(tmp_path):
    ckpt = _ddp_checkpoint(tmp_path, prefixed=False, world=2)
    logged = []
    source = prepare_resume(ckpt, Launch("ddp", gpus_per_node=2), log=logged.append)
    assert (source.load_dir, source.world_changed, logged) == (ckpt, False, [])
    three = prepare_resume(ckpt, Launch("ddp", gpus_per_node=3), log=logged.append)
    assert three.load_dir == ckpt and three.world_changed  # the RNG files of 2 processes are not used by 3
    assert "written by DDP on 2 processes; loading it with DDP on 3 processes" in logged[-1]


def test_other_processes_wait_for_rank0s_conversion_and_report_its_failure(tmp_path):
    ckpt = _ddp_checkpoint(tmp_path, prefixed=True)
    view = ckpt.with_name("step_00000003.single")
    stamp = {"checkpoint": ckpt.name, "saved_at": 1.0, "step": 3, "kind": "single"}
    reshard._failure_marker(view).write_text("OSError: disk full")
    with pytest.raises(ConfigError, match="rank 0 failed converting .*disk full"):
        prepare_resume(ckpt, Launch("ddp", rank=1, gpus_per_node=1), log=print)
    with pytest.raises(ConfigError, match="waited"):
        reshard._wait_for(ckpt.with_name("elsewhere"), stamp, timeout_s=0.05, poll_s=0.01)


# ---- the conversion shared by every rank through the launcher's store --------------------------------------
SHAPES = {"embed.weight": (1024, 64), **{f"layer.{i}.weight": (512, 64) for i in range(4)}, "norm.weight": (64,),
          "head.weight": (1024, 64)}  # 3 MiB of fp32 weights and Adam states: a third is 1 MiB


def _adam_checkpoint(tmp_path: Path) -> Path:
    """A one-process checkpoint as accelerate writes it: the model's safetensors, a torch AdamW state_dict that
    indexes parameters by position, and the names the trainer state records for those positions."""
    names = list(SHAPES)
    ckpt = make_checkpoint(tmp_path / "checkpoints" / "step_00000003", world=1, layout=Launch("ddp").to_dict(),
                           optimizer_params=[names[:3], names[3:]])
    torch.save({"last_epoch": 3}, ckpt / "scheduler.bin")
    torch.manual_seed(0)
    weights = {n: torch.randn(shape) for n, shape in SHAPES.items()}
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    state = {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(SHAPES[n]), "exp_avg_sq": torch.rand(SHAPES[n])}
             for i, n in enumerate(names)}
    groups = [{"params": [0, 1, 2], "lr": 1e-3, "weight_decay": 0.1},
              {"params": list(range(3, len(names))), "lr": 1e-3, "weight_decay": 0.0}]
    torch.save({"state": state, "param_groups": groups}, ckpt / "optimizer.bin")
    return ckpt


def _on_ranks(world: int, call, port: int) -> list:
    """``call(rank, peers)`` on ``world`` threads, each a rank with its own client of one TCPStore (the launcher's
    agent's, as torchrun hosts it); each thread's result, or the exception it raised."""
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    from pretrain.distributed.peers import Peers

    host = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    results: list = [None] * world

    def run(rank: int) -> None:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)
        try:
            results[rank] = call(rank, Peers(store, rank, world, "pretrain/0", timeout_s=60))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    del host
    return results


def _neutral_tensors(view: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(view.glob("state-*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 7, 64])
def test_the_ranks_shares_cover_every_tensor_once_each_about_one_nth_of_the_bytes(world):
    from pretrain.checkpoint.neutral import Source

    sizes = {f"layer.{i}": (i % 5 + 1) * 100 for i in range(40)}
    extras = {"rotary.inv_freq": 8, "lm_head.weight": 300}
    source = Source(sizes, extras, entries=lambda names: iter(()), extra_tensors=lambda names: {})
    shares = [source.share(rank, world) for rank in range(world)]
    params = [n for share, _ in shares for n in share]
    assert params == list(sizes)  # each once, in order: every rank a contiguous run
    assert sorted(n for _, extra in shares for n in extra) == sorted(extras)
    total, largest = sum(sizes.values()) + sum(extras.values()), max([*sizes.values(), *extras.values()])
    for params, extra in shares:
        assert sum(sizes[n] for n in params) + sum(extras[n] for n in extra) <= total / world + largest


@pytest.mark.parametrize("world", [1, 2, 5])
def test_every_segment_of_a_view_is_checked_by_exactly_one_rank(tmp_path, world, monkeypatch):
    from pretrain.checkpoint import integrity
    from pretrain.checkpoint.integrity import changed_segments, record_files, share_of_segments

    monkeypatch.setattr(integrity, "SEGMENT_BYTES", 2**20)  # 1 MiB segments: 6 for the first file

    for name, size in {"a.safetensors": 5 * 2**20 + 3, "b.safetensors": 0, "c.json": 10}.items():
        (tmp_path / name).write_bytes(bytes(size))
    recorded = record_files(tmp_path, ["a.safetensors", "b.safetensors", "c.json"])
    seg = integrity.SEGMENT_BYTES
    shares = [share_of_segments(recorded, rank, world, seg) for rank in range(world)]
    everything = [(rel, i) for rel in sorted(recorded) for i in range(max(1, -(-recorded[rel]["size"] // seg)))]
    assert [s for share in shares for s in share] == everything
    assert all(changed_segments(tmp_path, recorded, rank, world) == [] for rank in range(world))
    with open(tmp_path / "a.safetensors", "r+b") as f:  # one byte changed: found by the rank whose segment it is
        f.seek(2**20)
        f.write(b"x")
    found = {rank: changed_segments(tmp_path, recorded, rank, world, "the stamp records") for rank in range(world)}
    owner = next(rank for rank, share in enumerate(shares) if ("a.safetensors", 1) in share)
    assert found[owner] == [f"{tmp_path / 'a.safetensors'} has another crc32 than the stamp records (bytes from "
                            "1,048,576)"]
    assert all(problems == [] for rank, problems in found.items() if rank != owner)


def test_the_launchers_store_is_torchruns_agent_store_only():
    from pretrain.distributed.layout import launcher_store

    torchrun = {"WORLD_SIZE": "4", "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "node-0",
                "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert launcher_store(torchrun) == ("node-0", 29500, "2")
    assert launcher_store({**torchrun, "WORLD_SIZE": "1"}) is None  # one process: nobody to agree with
    assert launcher_store({k: v for k, v in torchrun.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}) is None
    assert launcher_store({**torchrun, "MASTER_PORT": ""}) is None


def test_every_rank_converts_its_share_and_the_view_equals_one_process_conversion(tmp_path):
    """Issue 51: the neutral form is converted by every rank of the launch, each reading and writing its share (a
    contiguous run of the parameters by bytes), and rank 0 assembles the parts. The result holds exactly what one
    process's conversion holds; a reuse is checked by every rank for its share of the view's segments."""
    from tests.helpers import free_port

    ckpt = _adam_checkpoint(tmp_path / "alone")
    alone = prepare_resume(ckpt, Launch("fsdp"), log=lambda _: None).load_dir
    ckpt = _adam_checkpoint(tmp_path / "shared")
    logs: list[list[str]] = [[], [], []]

    def resume(rank, peers):
        return prepare_resume(ckpt, Launch("fsdp", gpus_per_node=3, rank=rank), log=logs[rank].append, peers=peers)

    sources = _on_ranks(3, resume, free_port())
    assert all(not isinstance(s, BaseException) for s in sources), sources
    view = sources[0].load_dir
    assert all(s == sources[0] for s in sources) and view == ckpt.with_name("step_00000003.neutral")
    assert "each of the 3 processes converts its share" in logs[0][0] and logs[1] == logs[2] == []
    shared, reference = _neutral_tensors(view), _neutral_tensors(alone)
    assert sorted(shared) == sorted(reference) and all(torch.equal(shared[k], reference[k]) for k in reference)
    writers = {f.name.split("-")[1] for f in view.glob("state-*.safetensors")}
    assert writers == {"00000", "00001", "00002"}  # every rank wrote its part
    read = [float(x) for x in re.findall(r"rank 0 read ([\d.]+) MiB of the checkpoint's ([\d.]+) MiB", logs[0][-1])[0]]
    assert read[0] < read[1] / 2  # about a third, whole tensors
    index = json.loads((view / "neutral.json").read_text())
    assert index["step"] == 3.0 and sorted(index["params"]) == sorted(SHAPES)
    assert not list(view.parent.glob(".tmp-*"))  # the parts moved in, their directories gone

    # reused: rank 0 checks the stamp and the sizes, every rank the checksums of its share of the segments
    logs = [[], [], []]
    again = _on_ranks(3, resume, free_port())
    assert again == sources and "reusing the converted" in logs[0][0] and "each rank its share" in logs[0][0]

    # a changed byte in the last segment (the last rank's share) is found there, and every rank converts again
    last = sorted(view.glob("state-*.safetensors"))[-1]
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF
    last.write_bytes(bytes(data))
    logs = [[], [], []]
    third = _on_ranks(3, resume, free_port())
    assert third == sources, third
    assert logs[0][0].startswith(f"resume: the converted {view} is damaged ({last} has another crc32")
    assert _neutral_tensors(view).keys() == reference.keys()
    assert all(torch.equal(_neutral_tensors(view)[k], reference[k]) for k in reference)


@pytest.mark.parametrize("file", ["../outside.safetensors", "/etc/passwd", "sub/state-00000-00000.safetensors"])
def test_a_neutral_index_that_names_a_file_outside_its_view_is_refused_before_it_is_opened(tmp_path, file):
    """Issue 52's case in the neutral form: ``neutral.json``'s ``files`` were opened wherever they led."""
    from pretrain.checkpoint import neutral

    ckpt = _adam_checkpoint(tmp_path)
    view = prepare_resume(ckpt, Launch("fsdp"), log=lambda _: None).load_dir
    index = json.loads((view / "neutral.json").read_text())
    index["files"]["param/embed.weight"] = file
    (view / "neutral.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=f"names '{re.escape(file)}'.*refused"):
        neutral.read_index(view)


def test_a_rank_that_fails_its_share_fails_the_conversion_on_every_rank(tmp_path, monkeypatch):
    from tests.helpers import free_port

    ckpt = _adam_checkpoint(tmp_path)
    convert = reshard._convert_share

    def flaky(checkpoint, part_dir, kind, saved, rank, world):
        if rank == 2:
            raise OSError("No space left on device")
        return convert(checkpoint, part_dir, kind, saved, rank, world)

    monkeypatch.setattr(reshard, "_convert_share", flaky)
    results = _on_ranks(3, lambda rank, peers: prepare_resume(ckpt, Launch("fsdp", gpus_per_node=3, rank=rank),
                                                               log=lambda _: None, peers=peers), free_port())
    assert isinstance(results[2], OSError)
    for rank in (0, 1):
        assert isinstance(results[rank], ConfigError), results[rank]
        assert "rank 2: OSError: No space left on device" in str(results[rank])
    assert not ckpt.with_name("step_00000003.neutral").exists()  # nothing half-made is ever loaded


def test_converted_siblings_go_with_their_checkpoint(tmp_path):
    from pretrain.checkpoint.checkpointer import Checkpointer
    from pretrain.recipe.config import CheckpointConfig
    from tests.fakes import FakeAccelerator

    checkpointer = Checkpointer(FakeAccelerator(), tmp_path, CheckpointConfig(keep_last=1), num_steps=10,
                                log=lambda _: None)
    first = checkpointer.save(TrainerState(step=3, tokens_seen=3, num_steps=10, plan={}, recipe={}))
    (tmp_path / "checkpoints" / "step_00000003.universal").mkdir()
    checkpointer.save(TrainerState(step=3, tokens_seen=3, num_steps=10, plan={}, recipe={}))  # saved again
    assert not (tmp_path / "checkpoints" / "step_00000003.universal").exists()  # converted from the old save
    (tmp_path / "checkpoints" / "step_00000003.single").mkdir()
    checkpointer.save(TrainerState(step=6, tokens_seen=6, num_steps=10, plan={}, recipe={}))
    assert sorted(p.name for p in first.parent.iterdir()) == ["latest", "step_00000006"]


# ---- pretrain-launch: the same decision before any process starts ----------------------------------------
CONFIGS = ROOT / "accelerate_configs"
# GBS 6 divides over 1, 2 and 3 processes (MBS 1).
SMALL = [*FAST, "batch.global_batch_size=6", "batch.micro_batch_size=1"]


def preflight(capsys, monkeypatch, *argv: str) -> tuple[int, str, list]:
    """pretrain-launch in this process: its exit code, stderr, and the command it would start."""
    from pretrain.cli import launch as launch_cli

    execs = []
    monkeypatch.setattr(launch_cli, "run_launcher", lambda argv, environment: execs.append(argv) or 0)
    code = launch_cli.main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err, execs


@pytest.mark.parametrize("saved, config, num", [
    (Launch("ddp"), "zero2.yaml", 2),  # the demo's checkpoint under ZeRO-2
    (Launch("ddp"), "fsdp.yaml", 3),
    (Launch("deepspeed", zero_stage=2, gpus_per_node=2), "cpu_ddp.yaml", 2),
    (Launch("deepspeed", zero_stage=2, gpus_per_node=2), "zero3.yaml", 3),
    (Launch("deepspeed", zero_stage=3, gpus_per_node=2), "zero1.yaml", 1),
    (Launch("fsdp", gpus_per_node=2), "zero2.yaml", 2),
])
def test_pretrain_launch_passes_a_checkpoint_of_another_kind(tmp_path, capsys, monkeypatch, saved, config, num):
    """Found as the run finds it (checkpoint.resume=auto: output_dir's latest), decided as the run decides it: the
    neutral form converts it (on rank 0, in the run), so the launch goes ahead and converts nothing itself."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    ckpt = make_checkpoint(out / "checkpoints" / "step_00000003", world=saved.world_size, layout=saved.to_dict(),
                           optimizer_params=[["w"]])
    code, err, execs = preflight(capsys, monkeypatch, "--config_file", str(CONFIGS / config), "--num_processes",
                                 str(num), "--recipe", TINY, *SMALL, f"output_dir={out}")
    assert code == 0 and len(execs) == 1, err
    assert reshard.views(ckpt) == []


def test_pretrain_launch_refuses_a_checkpoint_it_cannot_convert_with_a_command_that_passes(tmp_path, capsys,
                                                                                         monkeypatch):
    """A one-process checkpoint of an older pretrain (no optimizer parameter names) under ZeRO-2: exit 2 before
    any process starts, and the command printed passes the same checks and reaches accelerate launch."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    make_checkpoint(out / "checkpoints" / "step_00000003", world=1, layout=Launch("ddp").to_dict())
    code, err, execs = preflight(capsys, monkeypatch, "--config_file", str(CONFIGS / "zero2.yaml"), "--num_processes",
                                 "2", "--recipe", TINY, *SMALL, f"output_dir={out}")
    assert code == 2 and execs == [], err
    assert "written by one process before checkpoints recorded" in err
    command = shlex.split(err.splitlines()[-1])
    assert err.splitlines()[-2] == "This launch resumes it:" and command[0] == "pretrain-launch"
    assert shlex.join(command[1:5]) == "--config_file accelerate_configs/cpu_ddp.yaml --num_processes 2", command
    code, err, execs = preflight(capsys, monkeypatch, *command[1:])
    assert code == 0 and len(execs) == 1, err


def test_pretrain_launch_refuses_zero0_on_another_count_naming_the_saved_one(tmp_path, capsys, monkeypatch):
    ckpt = make_checkpoint(tmp_path / "c", world=2, layout=Launch("deepspeed", zero_stage=0, gpus_per_node=2).to_dict())
    code, err, _ = preflight(capsys, monkeypatch, "--config_file", str(CONFIGS / "zero2.yaml"), "--num_processes",
                             "3", "--recipe", TINY, *SMALL, f"output_dir={tmp_path / 'run'}", f"checkpoint.resume={ckpt}")
    assert code == 2 and "ZeRO-0 on 2 processes as saved" in err and "This launch" not in err


def test_pretrain_launch_refuses_an_nvme_offloaded_checkpoint_on_another_count(tmp_path, capsys, monkeypatch):
    saved = Launch("deepspeed", zero_stage=2, offload_optimizer="nvme", gpus_per_node=2)
    ckpt = make_checkpoint(tmp_path / "c", world=2, layout=saved.to_dict())
    code, err, _ = preflight(capsys, monkeypatch, "--config_file", str(CONFIGS / "zero2.yaml"), "--num_processes",
                             "3", "--recipe", TINY, *SMALL, f"output_dir={tmp_path / 'run'}", f"checkpoint.resume={ckpt}")
    assert code == 2 and "NVMe" in err and "This launch" not in err


def test_pretrain_launch_passes_the_changes_a_resume_converts(tmp_path, capsys, monkeypatch):
    """ZeRO-2 on 2 processes -> ZeRO-1 on 3 (through the neutral form) is decided supported before any process
    starts, and converts nothing there (the run converts, on rank 0)."""
    ckpt = make_checkpoint(tmp_path / "c", world=2, layout=Launch("deepspeed", zero_stage=2, gpus_per_node=2).to_dict())
    code, err, execs = preflight(capsys, monkeypatch, "--config_file", str(CONFIGS / "zero1.yaml"), "--num_processes",
                                 "3", "--recipe", TINY, *SMALL, f"output_dir={tmp_path / 'run'}",
                                 f"checkpoint.resume={ckpt}")
    assert code == 0 and len(execs) == 1, err
    assert reshard.views(ckpt) == []


def test_pretrain_launch_refuses_what_the_run_would_refuse_about_its_checkpoints(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    make_checkpoint(out / "checkpoints" / "step_00000003", world=1, layout=Launch("ddp").to_dict())
    code, err, _ = preflight(capsys, monkeypatch, "--config_file", str(CONFIGS / "cpu.yaml"), "--recipe", TINY,
                             *SMALL, f"output_dir={out}", "checkpoint.resume=none")
    assert code == 2 and "checkpoint.resume=none but" in err


# ---- --dry-run: the same decision as its resume line ----------------------------------------------------
def dry_run(capsys, *argv: str) -> tuple[int, list[str]]:
    """python pretrain/run.py --dry-run in this process: its exit code and its resume line(s)."""
    from pretrain import run

    code = run.main(["--recipe", TINY, "--dry-run", *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and err == "", err
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("resume "))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" " * 17))
    return code, lines[start:end]


def test_dry_run_refuses_what_pretrain_launch_refuses_with_its_command(tmp_path, capsys, monkeypatch):
    """A one-process checkpoint of an older pretrain planned under ZeRO-2: the dry run's answer is no (exit 2),
    with pretrain-launch's refusal and the command that resumes it, which pretrain-launch then runs."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    make_checkpoint(out / "checkpoints" / "step_00000003", world=1, layout=Launch("ddp").to_dict())
    code, resume = dry_run(capsys, "--config_file", str(CONFIGS / "zero2.yaml"), "--num-processes", "2", *SMALL,
                           f"output_dir={out}")
    assert code == 2
    assert resume[0].startswith(f"resume           refused: cannot resume {out / 'checkpoints' / 'step_00000003'} "
                                "with DeepSpeed ZeRO-2 on 2 processes: it was written by one process before"), resume
    assert resume[1].strip() == "This launch resumes it:"
    command = shlex.split(resume[2])
    assert command[:5] == ["pretrain-launch", "--config_file", "accelerate_configs/cpu_ddp.yaml", "--num_processes", "2"]
    code, err, execs = preflight(capsys, monkeypatch, *command[1:])
    assert code == 0 and len(execs) == 1, err
    # Planned for a GPU (from this CPU machine), the command is the GPU one.
    code, resume = dry_run(capsys, "--config_file", str(CONFIGS / "zero2.yaml"), "--num-processes", "2", "--gpu",
                           "H100-80GB", *SMALL, f"output_dir={out}")
    assert code == 2 and resume[2].split()[:3] == ["pretrain-launch", "--config_file", "accelerate_configs/ddp.yaml"]
    assert "--gpu H100-80GB --recipe" in resume[2]


def test_dry_run_reports_the_checkpoint_it_resumes_and_its_conversion_or_a_fresh_start(tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--config_file", str(CONFIGS / "zero1.yaml"), "--num-processes", "3", *SMALL, f"output_dir={out}"]
    assert dry_run(capsys, *common) == (0, [f"resume           fresh start (no checkpoint in {out})"])
    make_checkpoint(out / "checkpoints" / "step_00000003", world=2,
                    layout=Launch("deepspeed", zero_stage=2, gpus_per_node=2).to_dict())
    assert dry_run(capsys, *common) == (0, [
        "resume           from checkpoints/step_00000003 (step 3; layout DeepSpeed ZeRO-2 on 2 processes, converted by "
        "every rank to the neutral form (weights and optimizer states by name) and loaded into DeepSpeed ZeRO-1 on 3 "
        "processes)"])
    assert reshard.views(out / "checkpoints" / "step_00000003") == []  # decided, not converted
    fsdp = tmp_path / "fsdp"
    make_checkpoint(fsdp / "checkpoints" / "step_00000003", world=2, layout=Launch("fsdp", gpus_per_node=2).to_dict())
    assert dry_run(capsys, *common, f"output_dir={fsdp}") == (0, [
        "resume           from checkpoints/step_00000003 (step 3; layout FSDP on 2 processes, converted by every rank "
        "to the neutral form (weights and optimizer states by name) and loaded into DeepSpeed ZeRO-1 on 3 processes)"])
    code, resume = dry_run(capsys, *common, "checkpoint.resume=none")
    assert code == 2 and resume[0].startswith("resume           refused: checkpoint.resume=none but"), resume


# ---- pretrain-export: bad input --------------------------------------------------------------------------
def test_export_refuses_what_is_not_a_checkpoint_and_a_non_empty_out(tmp_path, capsys):
    assert export.main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "is not a complete checkpoint (no readable trainer_state.json)" in capsys.readouterr().err
    ckpt = _ddp_checkpoint(tmp_path, prefixed=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    assert export.main([str(ckpt), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "already exists and is not an empty directory" in err and "Traceback" not in err


# ---- real runs: a 2-process ZeRO-2 checkpoint continues on 1 and on 3 processes -----------------------------
STEPS = 6  # checkpoint at 3, continue to 6: N=3 keeps three 2-core launches near a minute each
# GBS 6 divides over 1, 2 and 3 processes (MBS 1: GAS 6, 3 and 2); the recipe is the same in every launch.
ARGS = [*FAST, "batch.global_batch_size=6", "batch.micro_batch_size=1", f"train.max_steps={STEPS}",
        "checkpoint.every_steps=3", "checkpoint.keep_last=0", "checkpoint.save_final_model=false"]


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    runs = {"2 processes ZeRO-2": root / "base"}
    check_ok(accelerate_launch("zero2.yaml", [*ARGS, f"output_dir={root / 'base'}"], extra=["--num_processes", "2"]))
    source = root / "base" / "checkpoints" / "step_00000003"
    logs = {}
    for name, config, num in [("1 process ZeRO-2", "zero2.yaml", 1), ("3 processes ZeRO-1", "zero1.yaml", 3)]:
        out = root / name.replace(" ", "_")
        proc = accelerate_launch(config, [*ARGS, f"output_dir={out}", f"checkpoint.resume={source}"],
                                 extra=["--num_processes", str(num)])
        check_ok(proc)
        runs[name], logs[name] = out, proc.stdout
    return runs, logs


@pytest.mark.slow
def test_zero2_checkpoint_of_2_processes_continues_on_1_and_3_processes_on_the_same_curve(resharded):
    """Step 3 of a 2-process ZeRO-2 run, continued on 1 process (ZeRO-2) and on 3 (ZeRO-1: another stage of
    the same kind too), gives the uninterrupted run's steps 4-6: loss, LR and tokens seen."""
    runs, logs = resharded
    by_step = {name: {m["step"]: m for m in metrics(run) if "train/loss" in m} for name, run in runs.items()}
    reference = by_step.pop("2 processes ZeRO-2")
    for name, curve in by_step.items():
        assert sorted(curve) == list(range(4, STEPS + 1)), name
        for step, m in curve.items():
            ref = reference[step]
            assert m["train/loss"] == pytest.approx(ref["train/loss"], rel=1e-4), (name, step)
            assert m["train/lr"] == pytest.approx(ref["train/lr"], rel=1e-9), (name, step)  # the schedule continues
            assert m["train/tokens_seen"] == ref["train/tokens_seen"], (name, step)
            assert m["batch/gas"] == 6 // int(name[0]), name
    # the first resume converts (the neutral form), the second reuses it, its 3 ranks each checking a third
    assert "converting" in logs["1 process ZeRO-2"] and "the neutral form" in logs["1 process ZeRO-2"]
    assert "reusing the converted" in logs["3 processes ZeRO-1"] and "each rank its share" in logs["3 processes ZeRO-1"]
    assert "re-seeded" in logs["3 processes ZeRO-1"]
    view = runs["2 processes ZeRO-2"] / "checkpoints" / "step_00000003.neutral"
    assert (view / "neutral.json").is_file()
    state = json.loads((runs["3 processes ZeRO-1"] / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert (state["layout"]["engine"], state["layout"]["zero_stage"], state["layout"]["world_size"]) == ("deepspeed", 1, 3)


@pytest.mark.slow
def test_export_of_a_zero2_checkpoint_matches_the_step_reached_by_a_resumed_run(resharded, tmp_path):
    """The step-6 checkpoints of the 2-process ZeRO-2 run and of its 1-process continuation hold the same
    model up to reduction order: exported, they give the same logits."""
    from transformers import AutoModelForCausalLM

    runs, _ = resharded
    models = []
    for name in ("2 processes ZeRO-2", "1 process ZeRO-2"):
        out = tmp_path / name.replace(" ", "_")
        assert export.main([str(runs[name] / "checkpoints" / "step_00000006"), str(out)]) == 0
        models.append(AutoModelForCausalLM.from_pretrained(out))
    ids = torch.arange(32).reshape(2, 16) % models[0].config.vocab_size
    with torch.no_grad():
        a, b = (m(ids).logits for m in models)
    assert (a - b).abs().max().item() < 1e-3 * a.abs().max().item()


@pytest.mark.slow
def test_a_rollback_after_a_resume_on_another_process_count_reloads_the_runs_own_checkpoint(resharded, tmp_path):
    """Step 3 of the 2-process ZeRO-2 run resumed on 1 process (through its neutral form), then a persistent
    spike on the batches of steps 7-9: the rollback goes back to step 6, which this run wrote itself and DeepSpeed
    reads as a plain checkpoint, not through a view like the checkpoint it resumed. Killed after the rollback, the
    run resumes from step 6 and gives the same losses."""
    from tests.train.test_rollback import _resumed_copy

    runs, _ = resharded
    source = runs["2 processes ZeRO-2"] / "checkpoints" / "step_00000003"
    out = tmp_path / "run"
    args = [*ARGS, "train.max_steps=10", "stability.window_steps=3", "stability.spike_sigma=100",
            "stability.max_consecutive_skips=3", "stability.rollback.enabled=true"]
    spike = {LOSS_FACTORS_ENV: "7:1e3,8:1e3,9:1e3"}
    proc = accelerate_launch("zero2.yaml", [*args, f"output_dir={out}", f"checkpoint.resume={source}"],
                             extra=["--num_processes", "1"], extra_env=spike)
    check_ok(proc)
    assert "DeepSpeed ZeRO-2 on 2 processes -> DeepSpeed ZeRO-2 on 1 process: reusing the converted" in proc.stdout
    assert (f"stability: rollback 1/3 to {out / 'checkpoints' / 'step_00000006'} (step 6) after steps 7-9 were "
            "skipped in a row") in proc.stdout
    losses = train_losses(out)
    assert sorted(losses) == list(range(4, 11)) and all(math.isfinite(v) for v in losses.values())
    resumed = _resumed_copy(out, tmp_path / "resumed", 6, keep_records=True)
    proc = accelerate_launch("zero2.yaml", [*args, f"output_dir={resumed}"], extra=["--num_processes", "1"],
                             extra_env=spike)
    check_ok(proc)
    assert "stability: rollback" not in proc.stdout
    assert train_losses(resumed) == losses


# ---- real runs: ZeRO-3 and FSDP checkpoints of 2 processes continue on 3 --------------------------------------
SHARDED = {"ZeRO-3": "zero3.yaml", "FSDP": "fsdp.yaml"}


@pytest.fixture(scope="module")
def resharded_sharded(tmp_path_factory):
    """For ZeRO-3 (the neutral form) and FSDP2 (torch.distributed.checkpoint reshards on load):
    an uninterrupted 2-process run, and its step-3 checkpoint continued on 3 processes."""
    root = tmp_path_factory.mktemp("reshard_sharded")
    runs, logs = {}, {}
    for name, config in SHARDED.items():
        base, resumed = root / f"{config[:-5]}_2", root / f"{config[:-5]}_3"
        check_ok(accelerate_launch(config, [*ARGS, f"output_dir={base}"], extra=["--num_processes", "2"]))
        proc = accelerate_launch(config, [*ARGS, f"output_dir={resumed}",
                                          f"checkpoint.resume={base / 'checkpoints' / 'step_00000003'}"],
                                 extra=["--num_processes", "3"])
        check_ok(proc)
        runs[name, 2], runs[name, 3], logs[name] = base, resumed, proc.stdout
    return runs, logs


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SHARDED))
def test_sharded_checkpoint_of_2_processes_continues_on_3_on_the_same_curve(resharded_sharded, layout):
    runs, logs = resharded_sharded
    reference = {m["step"]: m for m in metrics(runs[layout, 2]) if "train/loss" in m}
    curve = {m["step"]: m for m in metrics(runs[layout, 3]) if "train/loss" in m}
    assert sorted(curve) == list(range(4, STEPS + 1))
    for step, m in curve.items():
        assert m["train/loss"] == pytest.approx(reference[step]["train/loss"], rel=1e-4), step
        assert m["train/lr"] == pytest.approx(reference[step]["train/lr"], rel=1e-9), step
        assert m["train/tokens_seen"] == reference[step]["train/tokens_seen"], step
        assert m["batch/gas"] == 2
    assert "re-seeded" in logs[layout]
    if layout == "ZeRO-3":
        assert "the neutral form" in logs[layout]
    else:  # nothing to convert: the shards are read by the new layout as they are
        assert "written by FSDP on 2 processes; loading it with FSDP on 3 processes" in logs[layout]
        assert "converting" not in logs[layout]
    state = json.loads((runs[layout, 3] / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert state["layout"]["world_size"] == 3


# ---- real runs: DDP across one process and several, and the refusal pretrain-launch prints ---------------------
# Checkpoints at 2 and 4: one process's step 2 continues on 2 processes (through the command pretrain-launch's
# refusal of ZeRO-2 prints), whose step 4 continues on 3 processes and on one. GBS 6, MBS 1: GAS 6, 3, 2.
DDP_ARGS = [*SMALL, "train.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=0",
            "checkpoint.save_final_model=false"]


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def ddp_resumes(tmp_path_factory):
    """The uninterrupted one-process run, and the resumes 1 -> 2 and 2 -> 1 processes of its curve (DDP on 3: the
    ring below resumes a ZeRO-3 checkpoint there)."""
    root = tmp_path_factory.mktemp("ddp_resume")
    runs, logs = {"1 process": root / "one"}, {}
    # The one-process runs train in this process (what run.py runs on one process, without an interpreter start)
    with OneThread():
        train_here([*DDP_ARGS, f"output_dir={runs['1 process']}"])
    runs["1 -> 2 processes"] = root / "two"
    proc = run_cmd([sys.executable, "-m", "pretrain.cli.launch", "--config_file", "accelerate_configs/cpu_ddp.yaml",
                    "--num_processes", "2", "--main_process_port", str(free_port()), "--recipe", TINY, *DDP_ARGS,
                    f"output_dir={runs['1 -> 2 processes']}", f"checkpoint.resume={_step(runs['1 process'], 2)}"])
    check_ok(proc)
    logs["1 -> 2 processes"] = proc.stdout
    name = "2 -> 1 process"
    runs[name] = root / "2-1process"
    with OneThread():
        logs[name] = train_here([*DDP_ARGS, f"output_dir={runs[name]}",
                                 f"checkpoint.resume={_step(runs['1 -> 2 processes'], 4)}"])[2]
    return runs, logs


@pytest.mark.slow
def test_ddp_resumes_across_one_and_several_processes_continue_the_curve(ddp_resumes):
    """1 -> 2 and 2 -> 1 processes: the uninterrupted run's per-step loss (1e-5 relative: only the
    reduction order differs), LR and tokens seen; nothing converted, the RNG re-seeded."""
    runs, logs = ddp_resumes
    reference = {m["step"]: m for m in metrics(runs["1 process"]) if "train/loss" in m}
    assert sorted(reference) == list(range(1, 7))
    for name, first, world in [("1 -> 2 processes", 3, 2), ("2 -> 1 process", 5, 1)]:
        curve = {m["step"]: m for m in metrics(runs[name]) if "train/loss" in m}
        assert sorted(curve) == list(range(first, 7)), name
        worst = max(abs(m["train/loss"] / reference[step]["train/loss"] - 1) for step, m in curve.items())
        print(f"{name}: steps {sorted(curve)}, largest relative loss difference {worst:.1e}")
        for step, m in curve.items():
            assert m["train/loss"] == pytest.approx(reference[step]["train/loss"], rel=1e-5), (name, step)
            assert m["train/lr"] == pytest.approx(reference[step]["train/lr"], rel=1e-9), (name, step)
            assert m["train/tokens_seen"] == reference[step]["train/tokens_seen"], (name, step)
            assert m["batch/gas"] == 6 // world, name
        assert "re-seeded" in logs[name] and "converting" not in logs[name], name
        state = json.loads((_step(runs[name], 6) / "trainer_state.json").read_text())
        assert (state["layout"]["engine"], state["layout"]["world_size"]) == ("ddp", world), name
    assert reshard.views(_step(runs["1 process"], 2)) == [] and reshard.views(_step(runs["1 -> 2 processes"], 4)) == []


# ---- real runs: any checkpoint on any layout, through the neutral form -------------------------------------
# Six kinds of checkpoint, each the step-3 checkpoint of an uninterrupted 6-step run with ARGS (the ZeRO-2, ZeRO-3
# and FSDP2 runs are the fixtures' above). Each one's neutral form holds exactly the weights pretrain-export reads
# from it (DeepSpeed's zero_to_fp32, accelerate's merge_fsdp_weights, the saved module), and the optimizer states
# of the one-process run within what the engines' own arithmetic differs by (the same curve, trained by ZeRO's flat
# partitions or FSDP's DTensors: 1.3e-4 and 6.9e-5 of a tensor's largest value measured, in exp_avg_sq): what
# every kind writes is read right. A ring of resumes takes each kind once as the source and once as the target
# (process counts 1 -> 2, 2 -> 1, 2 -> 3 among them): each continues its source's curve, and the state it saves at
# step 6, read back through the neutral form, is its source's (a state loaded wrong, such as fresh moments or
# two tensors swapped, differs by O(1)). Every resume across kinds is (source -> neutral form) then (neutral form
# -> target), so the two checks cover each pair; tools/resume_matrix.py runs all 30 pairs end to end.
RING = [  # source -> (target config, processes)
    ("one process", "ZeRO-2 with CPU offload", "zero2_offload.yaml", 2),
    ("ZeRO-2", "FSDP2", "fsdp.yaml", 2),
    ("FSDP2", "ZeRO-3", "zero3.yaml", 2),
    ("ZeRO-3", "DDP", "cpu_ddp.yaml", 3),
    ("DDP", "ZeRO-1", "zero1.yaml", 2),
    ("ZeRO-1", "one process", None, 1),
]
STATE_RTOL = 1e-3  # of each tensor's largest magnitude, across engines (the test prints what it measures)


@pytest.fixture(scope="module")
def any_layout(tmp_path_factory, resharded, resharded_sharded):
    root = tmp_path_factory.mktemp("any_layout")
    sources = {"ZeRO-2": resharded[0]["2 processes ZeRO-2"], "ZeRO-3": resharded_sharded[0]["ZeRO-3", 2],
               "FSDP2": resharded_sharded[0]["FSDP", 2], "one process": root / "one", "DDP": root / "ddp",
               "ZeRO-1": root / "zero1"}
    with OneThread():
        train_here([*ARGS, f"output_dir={sources['one process']}"])
    for name, config in [("DDP", "cpu_ddp.yaml"), ("ZeRO-1", "zero1.yaml")]:
        check_ok(accelerate_launch(config, [*ARGS, f"output_dir={sources[name]}"], extra=["--num_processes", "2"]))
    resumed, logs = {}, {}
    for source, target, config, num in RING:
        out = root / f"{source}_to_{target}".replace(" ", "_")
        args = [*ARGS, f"output_dir={out}", f"checkpoint.resume={_step(sources[source], 3)}"]
        if config is None:
            with OneThread():
                logs[target] = train_here(args)[2]
        else:
            proc = accelerate_launch(config, args, extra=["--num_processes", str(num), "--main_process_port",
                                                          str(free_port())])
            check_ok(proc)
            logs[target] = proc.stdout
        resumed[target] = out
    return sources, resumed, logs


def neutral_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's neutral form, as a resume on another engine converts it (and reuses it): per parameter
    its weight and optimizer states, by name (converted in this process)."""
    from pretrain.checkpoint import neutral

    engine = saved_layout(checkpoint, json.loads((checkpoint / "trainer_state.json").read_text())).engine
    source = prepare_resume(checkpoint, Launch("fsdp" if engine == "ddp" else "ddp"), log=lambda _: None)
    assert source.neutral
    index = neutral.read_index(source.load_dir)
    return {f"{kind}/{name}": load_file(str(source.load_dir / index["files"][f"{kind}/{name}"]))[f"{kind}/{name}"]
            for name, saved in index["params"].items() for kind in ["param", *saved["states"]]}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30)) for k in a)


@pytest.mark.slow
def test_every_kind_of_checkpoint_reads_into_the_same_neutral_state(any_layout):
    sources, _, _ = any_layout
    states = {name: neutral_state(_step(run, 3)) for name, run in sources.items()}
    for name, run in sources.items():
        weights = full_state_dict(_step(run, 3), log=lambda _: None)
        for key, value in states[name].items():
            if key.startswith("param/"):
                assert torch.equal(value, weights[key.removeprefix("param/")]), (name, key)
    reference = states["one process"]
    assert {k.split("/")[0] for k in reference} == {"param", "exp_avg", "exp_avg_sq"}
    for name, state in states.items():
        worst = largest_difference(reference, state)
        print(f"step 3, {name}: largest difference from one process's state {worst:.1e} (of each tensor's largest)")
        assert worst <= STATE_RTOL, name


@pytest.mark.slow
@pytest.mark.parametrize("source, target, config, num", RING)
def test_a_checkpoint_resumes_on_another_kind_on_its_curve_and_state(any_layout, source, target, config, num):
    sources, resumed, logs = any_layout
    reference = {m["step"]: m for m in metrics(sources[source]) if "train/loss" in m}
    curve = {m["step"]: m for m in metrics(resumed[target]) if "train/loss" in m}
    assert sorted(curve) == [4, 5, 6]
    worst = max(abs(m["train/loss"] / reference[step]["train/loss"] - 1) for step, m in curve.items())
    print(f"{source} -> {target} on {num}: largest relative loss difference {worst:.1e}")
    for step, m in curve.items():
        assert m["train/loss"] == pytest.approx(reference[step]["train/loss"], rel=1e-5), step
        assert m["train/lr"] == pytest.approx(reference[step]["train/lr"], rel=1e-9), step
        assert m["train/tokens_seen"] == reference[step]["train/tokens_seen"], step
        assert m["batch/gas"] == 6 // num
    assert "the neutral form" in logs[target] and "re-seeded" in logs[target]
    # the load: each rank of a sharded layout read its share of the neutral form, a replica all of it
    read, total = map(float, re.search(r"this rank read ([\d.]+) MiB of the neutral form's ([\d.]+) MiB",
                                       logs[target]).groups())
    shards = num if target.startswith(("ZeRO", "FSDP")) else 1
    print(f"{source} -> {target} on {num}: rank 0 loaded {read:.2f} of {total:.2f} MiB")
    assert read <= total / shards + 0.06  # its partitions / shards, whole rows at their ends, and the buffers
    # the conversion: each of the target's ranks converted its share of the source (whole tensors), or the view an
    # earlier resume of the same checkpoint made was reused, each rank checking its share of its checksums
    found = re.search(r"rank 0 read ([\d.]+) MiB of the checkpoint's ([\d.]+) MiB of tensors \(largest ([\d.]+) MiB\)",
                      logs[target])
    if found is None:
        assert "reusing the converted" in logs[target] and "each rank its share" in logs[target]
    else:
        converted, tensors, largest = map(float, found.groups())
        print(f"{source} -> {target} on {num}: rank 0 converted {converted:.2f} of {tensors:.2f} MiB")
        assert converted <= tensors / num + largest + 0.01
        if num > 1:
            assert converted < tensors and f"each of the {num} processes converts its share" in logs[target]
    worst = largest_difference(neutral_state(_step(sources[source], 6)), neutral_state(_step(resumed[target], 6)))
    print(f"step 6 state after {source} -> {target}: largest difference {worst:.1e}")
    assert worst <= STATE_RTOL
