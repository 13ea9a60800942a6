"""Trust boundaries (pretrain/trust.py): a checkpoint cannot run code, and no path read from a file leads out.

The attack: a checkpoint's optimizer file replaced by a pickle whose ``__reduce__`` creates a marker directory,
the manifest's CRC updated to match (CRCs detect accidents, not attacks). Real 2-process ZeRO-2 and DDP
checkpoints (one module fixture) are resumed and exported: exit 2 naming the file, and the marker never
appears. The path rules are checked on hand-made run directories, with no launch.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.integrity import read_manifest, record_own, verify_all, write_manifest
from pretrain.checkpoint.resume import ResumeChoice
from pretrain.checkpoint.state import TrainerState
from pretrain.errors import ConfigError
from pretrain.recipe.config import CheckpointConfig, load_recipe
from pretrain.trust import FORCE_ENV, check_output_dir, weights_only
from tests.helpers import FAST, ROOT, TINY, accelerate_launch, check_ok, train


class _Payload:
    """Unpickled, it creates the directory ``marker``: proof that the file's code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def _craft(checkpoint: Path, rel: str, marker: Path, **save_kwargs) -> None:
    """Replace ``rel`` by the payload and record its size and CRC in the manifest, as an attacker can."""
    torch.save({"state": _Payload(marker)}, checkpoint / rel, **save_kwargs)
    manifest = read_manifest(checkpoint)
    manifest["files"].update(record_own(checkpoint, 0, 1))
    write_manifest(checkpoint, manifest["files"], manifest["world_size"])
    assert verify_all(checkpoint) is None  # the checksums do not see it


STEPS_ARGS = [*FAST, "train.max_steps=2", "checkpoint.every_steps=2", "checkpoint.save_final_model=false"]
LAYOUTS = {  # layout: (accelerate config, the optimizer file rank 0 writes)
    "ZeRO-2": ("zero2.yaml", "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    "DDP": ("cpu_ddp.yaml", "optimizer.bin"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("trust")
    out = {}
    for name, (config, _) in LAYOUTS.items():
        run = root / name
        check_ok(accelerate_launch(config, [*STEPS_ARGS, f"output_dir={run}"], extra=["--num_processes", "2"]))
        out[name] = run / "checkpoints" / "step_00000002"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_crafted_optimizer_file_is_refused_by_resume_and_export_and_never_runs(checkpoints, layout, tmp_path,
                                                                                  capsys, monkeypatch):
    from pretrain.cli import export
    from pretrain.cli import launch as launch_cli

    crafted = tmp_path / "crafted" / "step_00000002"
    shutil.copytree(checkpoints[layout], crafted)
    marker = tmp_path / "MARKER"
    rel = LAYOUTS[layout][1]
    _craft(crafted, rel, marker)
    # pretrain-launch and pretrain-export run in this process (their exit code and stderr are main()'s); what
    # pretrain.trust.enforce() sets in os.environ there is undone after the test (set then removed: recorded).
    for name in (FORCE_ENV, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    launched = []
    monkeypatch.setattr(launch_cli, "run_launcher", lambda argv, environment: launched.append(argv) or 0)

    resume = [*STEPS_ARGS, "train.max_steps=4", f"output_dir={tmp_path / 'run'}", f"checkpoint.resume={crafted}"]
    # pretrain-launch refuses it before any process starts: exit 2, the file named
    code = launch_cli.main(["--config_file", str(ROOT / "accelerate_configs" / LAYOUTS[layout][0]), "--num_processes",
                            "2", "--recipe", TINY, *resume])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and launched == [], err[-3000:]
    assert f"{crafted / rel} holds a pickle that names os.makedirs" in err and "launch:" not in out
    assert not marker.exists()

    # launched as a user would (nothing of this process's enforce() inherited): the run's own checks refuse it
    proc = accelerate_launch(LAYOUTS[layout][0], resume, extra=["--num_processes", "2"], extra_env={FORCE_ENV: None})
    # every rank refuses with exit 2 (torchrun's summary; accelerate launch itself then exits 1), one message
    assert proc.returncode != 0 and proc.stderr.count("exitcode  : 2") == 2, proc.stderr[-3000:]
    assert proc.stderr.count(f"rank 0 (host {socket.gethostname()}) {crafted / rel} holds a pickle that names "
                             "os.makedirs") == 1, proc.stderr[-3000:]
    assert "pretrain/" not in proc.stderr.split("error: cannot resume")[0]  # no traceback of pretrain's
    assert not marker.exists()

    code = export.main([str(crafted), str(tmp_path / "exported")])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert f"{crafted / rel} holds a pickle that names os.makedirs" in err and "Traceback" not in err
    assert not marker.exists() and not (tmp_path / "exported").exists()


def _replace(checkpoint: Path, rel: str, write) -> None:
    """Replace ``rel`` with what ``write(path)`` writes and update the manifest's size and CRC, as an attacker can."""
    write(checkpoint / rel)
    manifest = read_manifest(checkpoint)
    manifest["files"].update(record_own(checkpoint, 0, 1))
    write_manifest(checkpoint, manifest["files"], manifest["world_size"])
    assert verify_all(checkpoint) is None


RANK1_SHARD = "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt"


@pytest.mark.slow
def test_a_bad_file_in_one_ranks_shard_stops_every_rank_with_one_message(checkpoints, tmp_path, capsys, monkeypatch):
    """Issue 36's agreement: rank 1's ZeRO shard alone is a crafted pickle in torch's legacy format (which torch
    reads only by loading it): every rank exits 2 and no rank prints a traceback, rank 0 says why once, and the
    payload never runs. Before, rank 1 refused it inside DeepSpeed's load while rank 0 trained on into a
    collective and died with gloo's traceback (exit 1), and the message named "Check the documentation of
    torch.load" for the type. pretrain-launch refuses it before any process starts; random bytes in rank 0's RNG
    state (checksums updated) are refused, not replaced by fresh state."""
    from pretrain.cli import launch as launch_cli

    crafted = tmp_path / "crafted" / "step_00000002"
    shutil.copytree(checkpoints["ZeRO-2"], crafted)
    marker = tmp_path / "MARKER"
    _replace(crafted, RANK1_SHARD, lambda path: torch.save({"state": _Payload(marker)}, path,
                                                           _use_new_zipfile_serialization=False))
    resume = [*STEPS_ARGS, "train.max_steps=4", f"output_dir={tmp_path / 'run'}", f"checkpoint.resume={crafted}"]
    proc = accelerate_launch("zero2.yaml", resume, extra=["--num_processes", "2"], extra_env={FORCE_ENV: None})
    assert proc.returncode != 0 and proc.stderr.count("exitcode  : 2") == 2, proc.stderr[-3000:]
    message = f"{crafted / RANK1_SHARD} is not an archive torch.save writes"
    assert proc.stderr.count(message) == 1 and "rank 1 (host" in proc.stderr, proc.stderr[-3000:]
    workers = proc.stderr.split('Traceback (most recent call last):\n  File "<frozen runpy>"')[0]  # then the launcher's
    assert "Traceback" not in workers, proc.stderr[-3000:]
    assert not marker.exists()

    for name in (FORCE_ENV, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    launched = []
    monkeypatch.setattr(launch_cli, "run_launcher", lambda argv, environment: launched.append(argv) or 0)
    config = ["--config_file", str(ROOT / "accelerate_configs" / "zero2.yaml"), "--num_processes", "2", "--recipe", TINY]
    code = launch_cli.main([*config, *resume])
    out, err = capsys.readouterr()
    assert code == 2 and launched == [] and message in err and "Traceback" not in err, err[-3000:]

    shutil.copytree(checkpoints["ZeRO-2"], crafted, dirs_exist_ok=True)  # rank 1's shard restored
    rng = next(p.name for p in crafted.glob("random_states_0.pkl"))
    _replace(crafted, rng, lambda path: path.write_bytes(os.urandom(path.stat().st_size)))
    code = launch_cli.main([*config, *resume])
    out, err = capsys.readouterr()
    assert code == 2 and launched == [] and f"{crafted / rng} is not an archive" in err, err[-3000:]


@pytest.mark.parametrize("zip_format", [True, False])
def test_a_library_load_with_weights_only_false_is_made_weights_only(tmp_path, monkeypatch, zip_format):
    """The second line of defence, for a file no check read first: DeepSpeed's own call
    ``torch.load(..., weights_only=False)`` inside pretrain's load is weights-only (torch's
    TORCH_FORCE_WEIGHTS_ONLY_LOAD), in the zip and in the legacy format; the refusal names the file."""
    monkeypatch.setenv(FORCE_ENV, "0")  # restored after the test: enforce() sets it for this process
    marker = tmp_path / "MARKER"
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    torch.save({"state": _Payload(marker)}, checkpoint / "optim_states.pt", _use_new_zipfile_serialization=zip_format)
    # the zip: the type named; the legacy format (whose pickle torch reads only by loading it): refused as a file
    # that is not a zip archive, which pretrain's checks refuse before any load (check_files)
    expected = "holds a pickle that names os.makedirs" if zip_format else "optim_states.pt is not an archive torch.save"
    with pytest.raises(ConfigError, match=expected), weights_only(checkpoint):
        torch.load(checkpoint / "optim_states.pt", weights_only=False)
    assert not marker.exists()


def test_a_dcp_metadata_naming_storage_outside_its_checkpoint_is_refused_before_any_read(tmp_path):
    """Issue 36: an FSDP checkpoint's DCP .metadata maps each tensor to a storage file by relative path, which torch's
    FileSystemReader joins to the checkpoint directory whatever it is: resume and export read a file outside it.
    The check every load goes through (check_files) refuses it, naming the file; an intact one passes."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from pretrain.trust import check_files

    checkpoint = tmp_path / "step_00000002" / "pytorch_model_fsdp_0"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(checkpoint), no_dist=True)
    assert check_files(checkpoint, [".metadata", "__0_0.distcp"]) is None
    (tmp_path / "secret.distcp").write_bytes((checkpoint / "__0_0.distcp").read_bytes())
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # the test's own file: plain pickle is fine
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret.distcp"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    refused = check_files(checkpoint, [".metadata"])
    assert refused.startswith(f"{checkpoint / '.metadata'} names storage files outside its checkpoint {checkpoint} "
                              "('../../secret.distcp')"), refused


def test_a_dcp_shard_that_is_not_a_tensor_file_is_refused_naming_it(tmp_path):
    """Issue 36: an FSDP checkpoint's DCP shard (``.distcp``) replaced by random bytes (checksums updated) was read by
    DCP in every rank, each failing with its traceback. The check every load goes through (check_files, as a rank
    checks its own shard: against rank 0's .metadata) refuses it naming the file and the entry; so is an entry that
    is a crafted pickle, and a metadata that places an entry past the end of the file."""
    import pickle

    import torch.distributed.checkpoint as dcp

    from pretrain.trust import check_files

    checkpoint = tmp_path / "step_00000002" / "pytorch_model_fsdp_0"
    dcp.save({"w": torch.ones(4), "b": torch.zeros(2)}, checkpoint_id=str(checkpoint), no_dist=True)
    shard = checkpoint / "__0_0.distcp"
    intact = shard.read_bytes()
    assert check_files(checkpoint, ["__0_0.distcp"]) is None and check_files(checkpoint, [".metadata"]) is None

    shard.write_bytes(os.urandom(len(intact)))
    refused = check_files(checkpoint, ["__0_0.distcp"])
    assert refused.startswith(f"{shard} is not a tensor file torch.distributed.checkpoint writes (its entry w at "
                              "byte 0 is not a torch.save archive)") and "Restore the checkpoint" in refused, refused

    marker = tmp_path / "MARKER"
    torch.save({"state": _Payload(marker)}, shard)  # one archive: the metadata's entries all point at it
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # the test's own file: plain pickle is fine
    for info in metadata.storage_data.values():
        info.offset, info.length = 0, shard.stat().st_size
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    refused = check_files(checkpoint, [".metadata", "__0_0.distcp"])
    assert refused.startswith(f"{shard} holds a pickle that names os.makedirs (its entry "), refused
    assert not marker.exists()

    shard.write_bytes(intact[:100])
    refused = check_files(checkpoint, ["__0_0.distcp"])
    assert refused.startswith(f"{shard} is not a tensor file") and "of a 100-byte file" in refused, refused


# ---- paths ------------------------------------------------------------------------------------------------
def _checkpoint(path: Path, step: int = 2) -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(os.urandom(64))
    (path / "trainer_state.json").write_text(TrainerState(step=step, tokens_seen=0, num_steps=4, plan={},
                                                          recipe={}).to_json())
    write_manifest(path, record_own(path, 0, 1), 1)
    return path


def test_a_manifest_entry_outside_its_checkpoint_is_refused_and_not_read(tmp_path):
    checkpoint = _checkpoint(tmp_path / "run" / "checkpoints" / "step_00000002")
    outside = tmp_path / "secret"
    outside.write_text("not the checkpoint's")
    for entry in ("../../../secret", str(outside)):
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        manifest["files"] = {entry: {"size": 20, "crc32": ["00000000"]}}
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ValueError, match=f"names {entry!r}, which is not inside {checkpoint}"):
            read_manifest(checkpoint)
        assert "is not inside" in verify_all(checkpoint)  # pretrain-export: "damaged", exit 2
        choice = ResumeChoice.decide(tmp_path / "other", CheckpointConfig(resume=str(checkpoint)))
        assert choice.path is None and f"names {entry!r}" in choice.error


@pytest.mark.parametrize("pointer", ["../../victim/checkpoints/step_00000002", "ABSOLUTE", ".."])
def test_latest_naming_a_directory_outside_checkpoints_is_refused_and_nothing_outside_is_renamed(tmp_path, pointer):
    """``latest`` of a run pointing at a damaged checkpoint of another run: refused (exit 2 on every rank),
    and the other run's checkpoint is neither loaded nor moved aside as damaged."""
    victim = _checkpoint(tmp_path / "victim" / "checkpoints" / "step_00000002")
    os.truncate(victim / "model.safetensors", 1)  # damaged: a resume would move it to .damaged-step_*
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    pointer = str(victim) if pointer == "ABSOLUTE" else pointer
    (run / "checkpoints" / "latest").write_text(pointer + "\n")
    choice = ResumeChoice.decide(run, CheckpointConfig())
    assert choice.path is None and choice.error.startswith(f"{run / 'checkpoints' / 'latest'} names {pointer!r}")
    assert victim.is_dir() and sorted(p.name for p in victim.parent.iterdir()) == ["step_00000002"]


def test_a_run_whose_latest_points_outside_stops_with_exit_2(tmp_path):
    victim = _checkpoint(tmp_path / "victim" / "checkpoints" / "step_00000002")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("../../victim/checkpoints/step_00000002\n")
    proc = train([*FAST, "train.max_steps=2", f"output_dir={run}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "latest names '../../victim/checkpoints/step_00000002', which is not inside" in proc.stderr
    assert "Traceback" not in proc.stderr and victim.is_dir()


@pytest.mark.parametrize("name", ["../escape", "../../tmp/x", "/etc/x", ".."])
def test_a_recipe_name_that_leaves_runs_is_refused(name, monkeypatch):
    monkeypatch.delenv("PRETRAIN_RUNS_DIR")  # the default runs/ (tests/conftest.py sets the suite's own)
    with pytest.raises(ConfigError, match="the recipe's name .* is not inside runs"):
        load_recipe(TINY, [f"name={name}"])
    assert load_recipe(TINY, ["name=ok.v2"]).output_dir == str(Path("runs") / "ok.v2")


@pytest.mark.parametrize("output_dir", ["/", str(Path.home()), "/tmp/.."])
def test_an_output_dir_that_is_a_root_or_the_home_directory_is_refused(output_dir):
    with pytest.raises(ConfigError, match="a filesystem root or the home directory"):
        load_recipe(TINY, [f"output_dir={output_dir}"])
    check_output_dir("/tmp/some-run")  # a directory of its own is fine
