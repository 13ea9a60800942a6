"""A checkpoint on another layout: resume under another engine, ZeRO stage or number of processes, or read its weights.

What a resume needs besides the model and optimizer does not depend on the layout: the data cursor is the
optimizer step (``pretrain/data/loader.py``), the LR schedule counts optimizer steps and ``tokens_seen`` is a
number in ``trainer_state.json``. What does depend on it is how the state was written:

- DDP / one process: the state is complete and loads on any number of processes. accelerate registers a
  model before wrapping it in DDP and saves and loads that registered module, so the keys are the model's
  own on any process count; a file whose keys carry DDP's ``module.`` prefix (written by other tools) is
  renamed once into the sibling ``<checkpoint>.single/`` (other files linked).
- FSDP: torch.distributed.checkpoint reshards on load; nothing to convert.
- Across engines (DDP / one process, FSDP2, DeepSpeed) and DeepSpeed ZeRO on another DP world size or stage
  (DeepSpeed refuses another world size): converted once into the neutral form (``neutral.py``: per parameter,
  by name, the fp32 weight and optimizer states) in the sibling ``<checkpoint>.neutral/``, which every engine
  loads, each rank its share. (DeepSpeed's universal checkpoint, which pretrain used within ZeRO-1/2 before, is
  converted on one node at ~60 bytes of I/O per parameter, loads each kind's files only into the same kind, and its
  ZeRO-3 load gives every parameter group the first group's hyperparameters, weight decay included.) Refused:
  ZeRO-0 (no ZeRO optimizer to read or set partitioned states through), NVMe-offloaded states (they live outside
  the checkpoint, per rank), FSDP's full state dict, and a DDP checkpoint written before checkpoints recorded their
  optimizer's parameter names.
- Each process's RNG file (``random_states_{i}.pkl``) belongs to a process of the old layout; when the
  world size or the engine changes every process is re-seeded from (seed, step, process index) after the load.

The saved layout is read from the checkpoint (``trainer_state.json``'s ``layout``; for checkpoints written
before it was recorded, from the files) and compared with the launch by ``plan_resume``, which pretrain-launch
asks before any process starts and every process asks before its process group exists: an impossible
combination is refused there.

The conversion runs before the process group exists, so that one that outlasts a collective timeout (a 70B
checkpoint) cannot kill the job. Every rank converts its share: a contiguous run of the parameters, about 1/N of
the bytes (``neutral.Source.share``), read from the checkpoint and written as its own safetensors shards into
``.tmp-<view>.part-<rank>-of-<N>/``, with their checksums. The ranks agree through the key-value store of the
launcher (``pretrain/distributed/peers.py``): rank 0 gathers the parts, moves them into ``.tmp-<view>``, writes
the index and the stamp, and renames it into place; a rank that fails fails the conversion on every rank with its
message. Where there is no launcher store (one process; a launcher other than torchrun), rank 0 converts all of
it and the others wait on the shared filesystem.

A converted sibling (a view) records what it was made from and what it holds (``converted_from.json``): its
checkpoint's name, save time, step, the kind of view and the SHA-256 of the checkpoint's manifest (every file's
size and CRCs), and the size and CRC-32s of each of its own files. A later resume reuses it only when both still
hold: rank 0 checks the source, the file list and the sizes, and every rank the CRC-32s of its share of the
view's 256 MiB segments (``integrity.changed_segments``), so that together they read the view once. A view that
does not hold (made from another save or state of the checkpoint, a file changed or missing in it, or made by an
earlier pretrain that recorded no checksums) is pretrain's own, derived data: rank 0 says why in one line and
every rank converts it again, never loads it.

``pretrain/checkpoint/weights.py`` reads the fp32 weights of a checkpoint of any layout, with no process group.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pretrain.checkpoint import neutral
from pretrain.checkpoint.integrity import (
    ALGORITHM,
    MANIFEST_FILE,
    SEGMENT_BYTES,
    changed_files,
    changed_segments,
    checkpoint_files,
    manifest_digest,
    record_files,
)
from pretrain.checkpoint.rundir import STATE_FILE, read_state
from pretrain.distributed.layout import Launch
from pretrain.distributed.peers import Peers
from pretrain.errors import ConfigError
from pretrain.recipe.init_from import HF_VIEW
from pretrain.trust import check_files, contained, weights_only

DEEPSPEED_DIR = "pytorch_model"  # accelerate save_state: DeepSpeed's save_checkpoint(output_dir, tag=this)
MODEL_FILE = "model.safetensors"  # accelerate save_state: the model of a DDP / one-process run
FSDP_SHARDED_DIR = "pytorch_model_fsdp_0"  # accelerate save_state: FSDP SHARDED_STATE_DICT (DCP)
FSDP_FULL_FILE = "pytorch_model_fsdp.bin"  # accelerate save_state: FSDP FULL_STATE_DICT
FSDP_OPTIMIZER_DIR = "optimizer_0"  # accelerate save_state: FSDP SHARDED_STATE_DICT's optimizer (DCP)
OPTIMIZER_FILE = "optimizer.bin"  # accelerate save_state: the optimizer of a DDP / one-process run
STAMP_FILE = "converted_from.json"
SINGLE_KEYS, NEUTRAL = "single", "neutral"  # the sibling's suffix: what it holds
# ".ddp" siblings (keys given the "module." prefix) and ".universal" ones (DeepSpeed's universal checkpoint) were
# written by earlier versions: still deleted with their checkpoint
VIEW_SUFFIXES = ("universal", NEUTRAL, "ddp", SINGLE_KEYS, HF_VIEW)  # HF_VIEW: model.init_from's (checkpoint/export.py)
WAIT_TIMEOUT_S = 4 * 3600.0  # the other processes wait this long for rank 0's conversion
DEEPSPEED_CONFIGS = "accelerate_configs/zero1.yaml, zero2.yaml or zero3.yaml"

Log = Callable[[str], None]


@dataclass(frozen=True)
class CheckpointLayout:
    """How a checkpoint was (or will be) distributed: the parts of ``Launch.to_dict()`` its files depend on."""

    engine: str  # ddp (or one process), fsdp, deepspeed
    world_size: int
    zero_stage: int | None = None  # DeepSpeed only; None: recorded by no one (older checkpoint, ZeRO-1 or 2)
    offload_optimizer: str = "none"
    tp_size: int = 1  # FSDP2 x TP: the DCP files hold DTensors over a (dp_shard, tp) mesh
    ep_size: int = 1  # FSDP2 x EP: the expert weights' DTensors are over an (efsdp, ep) mesh; DCP reshards them

    @classmethod
    def of(cls, launch: Launch) -> CheckpointLayout:
        return cls.from_dict(launch.to_dict())

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CheckpointLayout:
        return cls(engine=values["engine"], world_size=int(values["world_size"]),
                   zero_stage=values.get("zero_stage") if values["engine"] == "deepspeed" else None,
                   offload_optimizer=values.get("offload_optimizer") or "none",
                   tp_size=int(values.get("tp_size") or 1), ep_size=int(values.get("ep_size") or 1))

    def describe(self) -> str:
        processes = f"{self.world_size} process{'es' if self.world_size > 1 else ''}"
        if self.engine == "deepspeed":
            stage = "1 or 2" if self.zero_stage is None else self.zero_stage
            return f"DeepSpeed ZeRO-{stage} on {processes}"
        if self.engine == "fsdp":
            parallel = "".join(f" x {name} {size}" for name, size in (("TP", self.tp_size), ("EP", self.ep_size))
                               if size > 1)
            return f"FSDP{parallel} on {processes}"
        return f"DDP on {processes}" if self.world_size > 1 else "one process"


def saved_layout(checkpoint: Path, state: dict[str, Any]) -> CheckpointLayout:
    """The layout a checkpoint was written by: recorded in its trainer state, else read from its files
    (checkpoints written before the layout was recorded; their plan records the world size)."""
    if state.get("layout"):
        return CheckpointLayout.from_dict(state["layout"])
    world = int(state["plan"]["world_size"])
    ds = checkpoint / DEEPSPEED_DIR
    if ds.is_dir():
        if any(ds.glob("zero_pp_rank_*_mp_rank_*_model_states.pt")):
            stage = 3
        elif any(ds.glob("*zero_pp_rank_*_optim_states.pt")):
            stage = None  # ZeRO-1 and ZeRO-2 write the same files
        else:
            stage = 0
        return CheckpointLayout("deepspeed", world, stage)
    if (checkpoint / FSDP_SHARDED_DIR).is_dir() or (checkpoint / FSDP_FULL_FILE).is_file():
        return CheckpointLayout("fsdp", world)
    return CheckpointLayout("ddp", world)


class LayoutRefused(ConfigError):
    """A checkpoint this launch cannot resume. ``saved``: the layout that wrote it; ``same_world``: it resumes
    only on its own number of processes (ZeRO-0). pretrain-launch turns these into a command that resumes it."""

    def __init__(self, message: str, saved: CheckpointLayout, *, same_world: bool = False):
        super().__init__(message)
        self.saved, self.same_world = saved, same_world


def conversion(checkpoint: Path, saved: CheckpointLayout, target: CheckpointLayout) -> str | None:
    """What resuming ``checkpoint`` (written by ``saved``) under ``target`` needs: None (load as it is),
    NEUTRAL (the neutral form: across engines, and ZeRO on another count or stage), or LayoutRefused naming what
    to do instead.
    (DDP key renaming is decided from the weights file itself, see ``plan_resume``.)"""
    change = f"{saved.describe()} -> {target.describe()}"
    if "nvme" in (saved.offload_optimizer, target.offload_optimizer) and saved != target:
        raise LayoutRefused(
            f"cannot resume {checkpoint} across {change} with NVMe optimizer offload: DeepSpeed keeps those "
            "states per rank outside the checkpoint. Resume with the saved layout and offload, or use "
            "offload_optimizer_device: cpu / none on both sides", saved, same_world=True
        )
    zero0 = [layout for layout in (saved, target) if layout.engine == "deepspeed" and layout.zero_stage == 0]
    if zero0 and saved != target:
        raise LayoutRefused(
            f"cannot resume {checkpoint} across {change}: ZeRO-0 has no ZeRO optimizer whose states can be "
            f"converted or set. Resume it with {saved.describe()} as saved, or take its weights with "
            f"pretrain-export {checkpoint} <dir>", saved, same_world=saved.zero_stage == 0
        )
    if saved.engine != target.engine:
        if saved.engine == "fsdp" and (checkpoint / FSDP_FULL_FILE).is_file():
            raise LayoutRefused(
                f"cannot resume {checkpoint} with {target.describe()}: it holds FSDP's full state dict, which "
                "pretrain converts only in its sharded form (fsdp_state_dict_type: SHARDED_STATE_DICT). Resume it "
                f"with accelerate_configs/fsdp.yaml, or take its weights with pretrain-export {checkpoint} <dir>",
                saved
            )
        return NEUTRAL
    if saved.engine != "deepspeed":
        return None
    same_stage = saved.zero_stage == target.zero_stage or (saved.zero_stage is None and target.zero_stage in (1, 2))
    if saved.world_size == target.world_size and same_stage:
        return None
    # Another DP world size or stage: the neutral form, converted by every rank and loaded by its share. (DeepSpeed's
    # universal checkpoint is converted on one node, ~60 bytes of I/O per parameter, loads each kind's files only
    # into the same kind, and its ZeRO-3 load gives every parameter group the first group's hyperparameters.)
    return NEUTRAL


@dataclass(frozen=True)
class ResumeSource:
    """A checkpoint prepared for this launch: where its state is read, and what the load must do."""

    checkpoint: Path  # the checkpoint (its trainer_state.json)
    load_dir: Path  # what accelerator.load_state reads: the checkpoint, or its converted sibling
    saved: CheckpointLayout | None  # None: not read (loaded as saved)
    neutral: bool = False  # load_dir is the neutral form (pretrain/checkpoint/neutral.py)
    world_changed: bool = False  # the per-process RNG files belong to other processes: re-seed instead


def view_path(checkpoint: Path, kind: str) -> Path:
    return checkpoint.with_name(f"{checkpoint.name}.{kind}")


def views(checkpoint: Path) -> list[Path]:
    """The converted siblings of a checkpoint that exist (removed with it)."""
    return [p for kind in VIEW_SUFFIXES if (p := view_path(checkpoint, kind)).exists()]


@dataclass(frozen=True)
class ResumePlan:
    """The decision for one checkpoint under one launch: what the run does, and what pretrain-launch checks."""

    checkpoint: Path
    saved: CheckpointLayout
    target: CheckpointLayout
    kind: str | None  # the sibling to convert into (NEUTRAL, SINGLE_KEYS), or None: load the checkpoint itself

    @property
    def world_changed(self) -> bool:
        return self.saved.world_size != self.target.world_size

    def describe(self) -> str:
        """What the run does with the checkpoint, in a few words (the dry run's resume line)."""
        written = f"layout {self.saved.describe()}"
        if self.kind == NEUTRAL:
            return (f"{written}, converted by every rank to the neutral form (weights and optimizer states by name) "
                    f"and loaded into {self.target.describe()}")
        if self.kind == SINGLE_KEYS:
            return f"{written}, converted by rank 0: DDP's module. prefix taken off its weights' keys"
        if self.saved != self.target:
            return f"{written}, loaded as saved by {self.target.describe()}"
        return f"{written}, loaded as saved"


def plan_resume(checkpoint: Path, launch: Launch) -> ResumePlan:
    """How ``checkpoint`` resumes under ``launch``, or LayoutRefused: plain file reads (the trainer state, a
    safetensors header), no conversion. The run (``prepare_resume``) and pretrain-launch's check before any
    process starts both decide here, so they cannot disagree."""
    state = read_state(checkpoint)
    assert state is not None, f"{checkpoint} is not a complete checkpoint"
    saved, target = saved_layout(checkpoint, state), CheckpointLayout.of(launch)
    kind = conversion(checkpoint, saved, target)
    if kind == NEUTRAL and saved.engine == "ddp" and not state.get("optimizer_params"):
        raise LayoutRefused(
            f"cannot resume {checkpoint} with {target.describe()}: it was written by {saved.describe()} before "
            "checkpoints recorded their optimizer's parameter names, which its conversion needs. Resume it once "
            f"with {saved.describe()} and resume that run's next checkpoint on the new layout", saved
        )
    if kind is None and saved.engine == "ddp":
        kind = _ddp_keys_kind(checkpoint)
    return ResumePlan(checkpoint, saved, target, kind)


def prepare_resume(checkpoint: Path, launch: Launch, log: Log = print, peers: Peers | None = None) -> ResumeSource:
    """Check that ``checkpoint`` can be resumed under ``launch`` and convert it if needed; call before any process
    group exists (plain file reads). With ``peers`` (the launcher's store) every rank checks its share of a
    converted view and converts its share of the checkpoint; without (one process, or no store), rank 0 does it
    all and the others wait for its result on the filesystem."""
    plan = plan_resume(checkpoint, launch)
    saved, target, kind, world_changed = plan.saved, plan.target, plan.kind, plan.world_changed
    if kind is None:
        if saved != target:
            log(f"resume: {checkpoint} was written by {saved.describe()}; loading it with {target.describe()}")
        return ResumeSource(checkpoint, checkpoint, saved, world_changed=world_changed)
    view = view_path(checkpoint, kind)
    made_from = _made_from(checkpoint, kind)
    if peers is None and not launch.is_main:
        _wait_for(view, made_from)
    else:
        peers = peers.scope(f"{kind}-{checkpoint.name}") if peers is not None else None
        stale = _stale_shared(view, made_from, peers)
        if stale is None:
            if launch.is_main:
                log(f"resume: {saved.describe()} -> {target.describe()}: reusing the converted {view} (checked "
                    f"against {checkpoint.name} and its own checksums{', each rank its share' if peers else ''})")
        else:
            if view.exists() and launch.is_main:
                log(f"resume: the converted {view} {stale}; converting it again")
            _convert(checkpoint, view, kind, made_from, saved, target, log, peers)
    return ResumeSource(checkpoint, view, saved, neutral=kind == NEUTRAL, world_changed=world_changed or kind == NEUTRAL)


def _stale_shared(view: Path, made_from: dict[str, Any], peers: Peers | None) -> str | None:
    """``_stale``, decided by rank 0 from the stamp and the files' sizes, the checksums checked by every rank for
    its share of the view's segments (alone: all of them); the same answer on every rank."""
    if peers is None:
        return _stale(view, made_from)
    stale = peers.decide("stale", _stale(view, made_from, checksums=False) if peers.is_main else None)
    if stale is not None:
        return stale
    files = _stamp(view)["files"]
    peers.publish("damaged", changed_segments(view, files, peers.rank, peers.world, f"its {STAMP_FILE} records"))
    problems = [p for found in peers.gather("damaged") for p in found] if peers.is_main else []
    return peers.decide("damaged", f"is damaged ({'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''})"
                        if problems else None)


def _ddp_keys_kind(checkpoint: Path) -> str | None:
    """SINGLE_KEYS when the saved weights carry DDP's ``module.`` prefix, else None (the safetensors header is
    read, not the weights). accelerate's ``prepare`` registers the model before wrapping it in DDP, and
    ``save_state`` / ``load_state`` use the registered module: the keys it reads and writes are the model's
    own on one process and on many alike, so only a prefixed file from elsewhere needs renaming, for any
    process count (tests/checkpoint/test_reshard.py resumes 1 -> 2, 2 -> 3 and 2 -> 1 processes end to end)."""
    from safetensors import safe_open

    weights = checkpoint / MODEL_FILE
    if not weights.is_file():
        return None  # .bin weights (safe_serialization=False): accelerate reports what it cannot load
    with safe_open(str(weights), framework="pt") as f:
        prefixed = any(key.startswith("module.") for key in f.keys())
    return SINGLE_KEYS if prefixed else None


def _made_from(checkpoint: Path, kind: str) -> dict[str, Any]:
    """What a view of ``checkpoint`` of ``kind`` must record as its source (the first part of its stamp)."""
    state = read_state(checkpoint)
    return {"checkpoint": checkpoint.name, "saved_at": state.get("saved_at"), "step": state["step"], "kind": kind,
            "manifest_sha256": manifest_digest(checkpoint)}


def _stamp(view: Path) -> dict[str, Any] | None:
    try:
        stamp = json.loads((view / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def _stale(view: Path, made_from: dict[str, Any], checksums: bool = True) -> str | None:
    """Why ``view`` cannot be loaded for the source ``made_from``, in words that follow its name ("is missing",
    "was made from ..."), or None when its stamp names that source and its files are the ones it records (sizes;
    ``checksums``: every CRC-32 too)."""
    if not view.is_dir():
        return "is missing"
    stamp = _stamp(view)
    if stamp is None:
        return f"has no readable {STAMP_FILE}"
    files = stamp.get("files")
    if ("manifest_sha256" not in stamp or not isinstance(files, dict) or stamp.get("algorithm") != ALGORITHM
            or stamp.get("segment_bytes") != SEGMENT_BYTES):
        return "was made by an earlier pretrain, which recorded no checksums of it"
    if {key: stamp.get(key) for key in made_from} != made_from:
        if stamp.get("kind") != made_from["kind"] or stamp.get("checkpoint") != made_from["checkpoint"]:
            return f"records another source ({stamp.get('checkpoint')!r}, {stamp.get('kind')!r})"
        if stamp.get("saved_at") != made_from["saved_at"] or stamp.get("step") != made_from["step"]:
            return f"was made from an earlier save of {made_from['checkpoint']}"
        return (f"was made from {made_from['checkpoint']} as it was before: its manifest (every file's size and "
                "checksums) has changed since")
    for rel, entry in files.items():
        try:
            contained(view, rel, f"{view / STAMP_FILE}")
        except ConfigError:
            return f"records a file outside it ({rel!r})"
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get(ALGORITHM), list)):
            return f"records {rel!r} as {entry!r}, not a size and its checksums"
    unrecorded = sorted(set(checkpoint_files(view)) - set(files) - {STAMP_FILE})
    if unrecorded:
        return f"holds files it does not record ({', '.join(unrecorded[:3])})"
    problems = changed_files(view, files, checksums=checksums, recorder=f"its {STAMP_FILE} records")
    if problems:
        return f"is damaged ({'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''})"
    return None


def view_problem(checkpoint: Path, view: Path, kind: str, checksums: bool = True) -> str | None:
    """Why ``view`` (a view of ``checkpoint`` of ``kind``: a resume's, or model.init_from's transformers view) cannot
    be used, in words that follow its name, or None when it can (``_stale``)."""
    return _stale(view, _made_from(checkpoint, kind), checksums)


def stamp_view(checkpoint: Path, view: Path, kind: str) -> None:
    """Record in ``view`` what it was made from and what it holds (its STAMP_FILE, written atomically, last)."""
    stamp = {**_made_from(checkpoint, kind), "algorithm": ALGORITHM, "segment_bytes": SEGMENT_BYTES,
             "files": record_files(view, [f for f in checkpoint_files(view) if f != STAMP_FILE])}
    tmp = view / f".{STAMP_FILE}.tmp"
    tmp.write_text(json.dumps(stamp, indent=1, sort_keys=True))
    os.replace(tmp, view / STAMP_FILE)


def _failure_marker(view: Path) -> Path:
    return view.with_name(f".{view.name}.failed")


def _convert(checkpoint: Path, view: Path, kind: str, made_from: dict, saved: CheckpointLayout,
             target: CheckpointLayout, log: Log, peers: Peers | None) -> None:
    """Convert ``checkpoint`` into ``view``: each rank of ``peers`` its share into its own part directory (the
    neutral form; a key renaming is rank 0's alone), then rank 0 moves the parts into ``.tmp-<view>``, writes the
    index and the stamp (each part's checksums recorded by its writer) and renames it into place."""
    rank, world = (peers.rank, peers.world) if peers is not None else (0, 1)
    failed = _failure_marker(view)
    start = time.perf_counter()
    if rank == 0:
        failed.unlink(missing_ok=True)
        if view.is_dir():  # a stale view: the processes that wait for this conversion must not take it meanwhile
            (view / STAMP_FILE).unlink(missing_ok=True)
        size_gib = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()) / 2**30
        what = {NEUTRAL: "the neutral form: weights and optimizer states by parameter name",
                SINGLE_KEYS: "model keys renamed"}[kind]
        who = (f"each of the {world} processes converts its share" if world > 1 and kind == NEUTRAL
               else "the other processes wait")
        log(f"resume: {saved.describe()} -> {target.describe()}: converting {checkpoint} ({size_gib:.2f} GiB) into "
            f"{view} ({what}); {who}. This reads the checkpoint's weights and optimizer states once and writes about "
            "as much again.")
    # every pickle checked before any rank unpickles one (rank 0 decides, the others follow)
    refused = _refusal(checkpoint) if rank == 0 and kind == NEUTRAL else None
    if peers is not None:
        refused = peers.decide("refused", refused)
    if refused:
        raise ConfigError(refused)
    part_dir = view.with_name(f".tmp-{view.name}.part-{rank:05d}-of-{world:05d}")
    try:
        part = _convert_share(checkpoint, part_dir, kind, saved, rank, world)
    except BaseException as exc:
        part = {"failed": f"{type(exc).__name__}: {exc}"}
        if peers is None:
            failed.write_text(part["failed"])
            shutil.rmtree(part_dir, ignore_errors=True)
            raise
        peers.publish("part", part)
        if rank == 0:  # the others wait for rank 0's word (torchrun stops them too once a process fails)
            peers.decide("done", f"rank 0: {part['failed']}")
        raise
    if peers is not None:
        peers.publish("part", part)
    if rank != 0:
        done = peers.decide("done")
        if done != "ok":
            raise ConfigError(f"rank 0 could not complete the conversion into {view}: {done}")
        return
    try:
        parts = peers.gather("part") if peers is not None else [part]
        failures = [f"rank {r}: {p['failed']}" for r, p in enumerate(parts) if "failed" in p]
        if failures:
            raise ConfigError(f"converting {checkpoint} into {view} failed on {len(failures)} rank(s): "
                              f"{'; '.join(failures[:3])}")
        _assemble(checkpoint, view, kind, made_from, saved, parts, world)
    except BaseException as exc:
        failed.write_text(f"{type(exc).__name__}: {exc}")
        if peers is not None:
            peers.decide("done", f"{type(exc).__name__}: {exc}")
        raise
    if peers is not None:
        peers.decide("done", "ok")
    mib = 2**20
    log(f"resume: converted in {time.perf_counter() - start:.1f}s ({_size_gib(view):.2f} GiB in {view}); rank 0 read "
        f"{part['read'] / mib:.2f} MiB of the checkpoint's {part['total'] / mib:.2f} MiB of tensors (largest "
        f"{part['largest'] / mib:.2f} MiB) and wrote {part['written'] / mib:.2f} MiB")


def _convert_share(checkpoint: Path, part_dir: Path, kind: str, saved: CheckpointLayout, rank: int,
                   world: int) -> dict[str, Any]:
    """This rank's share of the conversion into ``part_dir``: the part of the neutral form's index it wrote, the
    size and checksums of its files, and the bytes of tensors it read and wrote."""
    shutil.rmtree(part_dir, ignore_errors=True)  # left by a conversion that was killed
    part_dir.mkdir(parents=True)
    if kind == SINGLE_KEYS:
        if rank == 0:
            _strip_ddp_prefix(checkpoint / MODEL_FILE, part_dir / MODEL_FILE)
        size = (checkpoint / MODEL_FILE).stat().st_size if rank == 0 else 0
        part: dict[str, Any] = {"read": size, "total": size, "largest": size}
    else:
        with weights_only(checkpoint):
            source = _neutral_source(checkpoint, saved)
            params, extras = source.share(rank, world)
            part = neutral.write(part_dir, source.entries(params), source.extra_tensors(extras),
                                 prefix=f"state-{rank:05d}")
        sizes = {**source.params, **source.extras}
        part["read"] = sum(sizes[n] for n in [*params, *extras])
        part["total"], part["largest"] = sum(sizes.values()), max(sizes.values(), default=0)
    written = checkpoint_files(part_dir)
    part["records"] = record_files(part_dir, written)
    part["written"] = sum(r["size"] for r in part["records"].values())
    part["dir"] = part_dir.name
    return part


def _assemble(checkpoint: Path, view: Path, kind: str, made_from: dict, saved: CheckpointLayout,
              parts: list[dict[str, Any]], world: int) -> None:
    """Rank 0: the parts moved into ``.tmp-<view>`` with the checkpoint's other files linked, the index and the
    stamp written, then renamed into ``view`` (a view is whole or absent)."""
    tmp = view.with_name(f".tmp-{view.name}")
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a conversion that was killed
    tmp.mkdir(parents=True)
    # The manifest describes the checkpoint as saved, not the converted files: a view is derived data.
    skip = {STATE_FILE, MANIFEST_FILE, MODEL_FILE}
    if kind == NEUTRAL:  # the weights and optimizer states become the neutral form; the scheduler etc. linked
        skip |= {OPTIMIZER_FILE, FSDP_FULL_FILE}
    linked = []
    for item in checkpoint.iterdir():
        if item.is_file() and item.name not in skip:
            _link_or_copy(item, tmp / item.name)
            linked.append(item.name)
    records: dict[str, Any] = {}
    for part in parts:
        for rel, record in part["records"].items():
            os.rename(view.with_name(part["dir"]) / rel, tmp / rel)
            records[rel] = record
    if kind == NEUTRAL:
        neutral.write_index(tmp, neutral.merge(parts, asdict(saved)))
        linked.append(neutral.INDEX_FILE)
    records.update(record_files(tmp, linked))
    # what it was made from and what it holds, read by every reuse (written last)
    stamp = {**made_from, "algorithm": ALGORITHM, "segment_bytes": SEGMENT_BYTES, "files": records}
    (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=1, sort_keys=True))
    if view.exists():
        shutil.rmtree(view)  # converted from an earlier save of the same step
    os.rename(tmp, view)
    for part in parts:
        shutil.rmtree(view.with_name(part["dir"]), ignore_errors=True)
    for old in view.parent.glob(f".tmp-{view.name}.part-*"):  # parts of a killed conversion on another world size
        shutil.rmtree(old, ignore_errors=True)


def _size_gib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30


def _link_or_copy(source: Path, dest: Path) -> None:
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


def _neutral_source(checkpoint: Path, saved: CheckpointLayout) -> neutral.Source:
    """The checkpoint's state by parameter (``neutral.Source``), from DDP's files, FSDP2's DCP shards, or DeepSpeed's
    per-rank partitions."""
    if saved.engine == "ddp":
        if not (checkpoint / MODEL_FILE).is_file():
            raise ConfigError(f"{checkpoint} has no {MODEL_FILE} (saved without safetensors?): it cannot be converted")
        return neutral.from_single(checkpoint, read_state(checkpoint).get("optimizer_params"), MODEL_FILE,
                                   OPTIMIZER_FILE)
    if saved.engine == "fsdp":
        return neutral.from_fsdp(checkpoint, FSDP_SHARDED_DIR, FSDP_OPTIMIZER_DIR)
    return neutral.from_zero(checkpoint / DEEPSPEED_DIR)


def _strip_ddp_prefix(source: Path, dest: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(source))
    renamed = {k.removeprefix("module."): v for k, v in weights.items()}
    save_file(renamed, str(dest), metadata={"format": "pt"})


def _wait_for(view: Path, made_from: dict[str, Any], timeout_s: float = WAIT_TIMEOUT_S, poll_s: float = 1.0) -> None:
    """Until ``view`` is a view of ``made_from`` whose files have the sizes it records (rank 0 checks the checksums
    before it joins the process group, and converts again what fails them), or rank 0's conversion failed."""
    started, deadline = time.time(), time.monotonic() + timeout_s
    failed = _failure_marker(view)
    while _stale(view, made_from, checksums=False) is not None:
        if failed.is_file() and failed.stat().st_mtime >= started - 1:
            raise ConfigError(f"rank 0 failed converting the checkpoint into {view}: {failed.read_text()}")
        if time.monotonic() > deadline:
            raise ConfigError(
                f"waited {timeout_s / 3600:.1f} h for rank 0 to convert the checkpoint into {view}; check rank 0's "
                "log, or convert by resuming once with a single process of the new layout"
            )
        time.sleep(poll_s)


def _refusal(checkpoint: Path) -> str | None:
    """Why a pickle of ``checkpoint`` is refused (read without running it), or None."""
    return check_files(checkpoint, checkpoint_files(checkpoint)) or None


def _refuse_crafted(checkpoint: Path) -> None:
    """Every pickle of ``checkpoint`` read without running it, before one process loads them all."""
    refused = check_files(checkpoint, checkpoint_files(checkpoint))
    if refused:
        raise ConfigError(refused)
