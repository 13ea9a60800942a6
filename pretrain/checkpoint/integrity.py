"""Verified checkpoints: a manifest of every file's size and checksum, written last, checked on resume.

Every rank hashes the files it wrote itself (while they are still in its page cache), in parallel with the
others, and rank 0 writes the union as ``manifest.json``, after every other file and before the checkpoint
directory is renamed into place. Which rank wrote a file follows from accelerate's names: ``random_states_<i>``
(process i), DeepSpeed's ``*zero_pp_rank_<r>_*`` (data-parallel rank r), torch.distributed.checkpoint's
``__<r>_<k>.distcp`` (rank r, FSDP); everything else (the DDP model and optimizer, DeepSpeed's model states,
the scheduler, ``trainer_state.json``) is rank 0's. Resume verifies the same split: rank r checks the files
rank r would have written (their index modulo the world size after a resize).

Checksum: CRC-32 (``zlib.crc32``) of every 256 MiB segment of a file, streamed in 8 MiB chunks, the segments
of a rank's files hashed by up to 8 threads (zlib releases the GIL), so one big file is hashed in parallel
too. Measured here: ~1 GiB/s per thread on a file in the page cache (blake2b 0.42, sha256 0.49 GiB/s).
It detects every burst error up to 32 bits and any other damage of a segment with probability
1 - 2^-32; it is not a defence against tampering. The manifest names its algorithm, so another can be added without breaking
older checkpoints.

Two levels of checking, both cheap: ``check_sizes`` (one stat per file: catches missing and truncated
files) runs on rank 0 before any process group exists, over every candidate checkpoint; ``verify_own``
(the checksums of this rank's files) runs on every rank once the process group does, for the checkpoint
about to be loaded. A checkpoint written before manifests existed has none; it is resumed unverified, with
a warning.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pretrain.errors import ConfigError
from pretrain.trust import contained

MANIFEST_FILE = "manifest.json"
FORMAT = "pretrain-checkpoint-manifest"
VERSION = 1
ALGORITHM = "crc32"
CHUNK_BYTES = 8 * 2**20
# A file is checksummed in segments, each its own CRC, so that the threads share one big file too: rank 0's
# DeepSpeed ZeRO-1/2 model states are the whole bf16 model (140 GB at 70B).
SEGMENT_BYTES = 256 * 2**20
MIN_SEGMENT_BYTES = 2**20
MAX_SEGMENT_BYTES = 2**40
MAX_WORLD_SIZE = 2**20
MAX_HASH_THREADS = min(8, os.cpu_count() or 1)

# A file's writer, from accelerate's / DeepSpeed's / DCP's names; anything else is rank 0's.
_RANK_PATTERNS = (
    re.compile(r"^random_states_(\d+)\.pkl$"),
    re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_"),
    re.compile(r"^__(\d+)_\d+\.distcp$"),
)


def crc32_segment(path: Path, start: int, length: int) -> str:
    """CRC-32 of bytes [start, start + length) of ``path`` (fewer at the end of the file)."""
    crc = 0
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while length > 0 and (n := f.readinto(view[: min(CHUNK_BYTES, length)])):
            crc = zlib.crc32(view[:n], crc)
            length -= n
    return f"{crc:08x}"


CHECKSUMS = {"crc32": crc32_segment}


def owner(relpath: str, world_size: int) -> int:
    """The rank that writes (and verifies) the checkpoint file ``relpath`` in a world of ``world_size``."""
    name = relpath.rsplit("/", 1)[-1]
    for pattern in _RANK_PATTERNS:
        if match := pattern.search(name):
            return int(match.group(1)) % world_size
    return 0


def checkpoint_files(directory: Path) -> list[str]:
    """Every file of a checkpoint directory (relative, '/'-separated, sorted), the manifest left out."""
    out = []
    for root, _, names in os.walk(directory):
        for name in names:
            rel = (Path(root) / name).relative_to(directory).as_posix()
            if rel != MANIFEST_FILE:
                out.append(rel)
    return sorted(out)


def own_files(directory: Path, rank: int, world_size: int) -> list[str]:
    """The files of ``directory`` that ``rank`` writes and verifies (those on disk, listed or not)."""
    return [rel for rel in checkpoint_files(directory) if owner(rel, world_size) == rank]


def _checksums(directory: Path, relpaths: Iterable[str], algorithm: str, segment_bytes: int) -> dict[str, list[str]]:
    """Each file's segment checksums, the segments of all files hashed by a pool of threads."""
    checksum = CHECKSUMS[algorithm]
    segments = [(rel, start) for rel in relpaths
                for start in range(0, max(1, (directory / rel).stat().st_size), segment_bytes)]
    out: dict[str, list[str]] = {rel: [] for rel in relpaths}
    if segments:
        with ThreadPoolExecutor(max_workers=min(MAX_HASH_THREADS, len(segments))) as pool:
            found = pool.map(lambda seg: checksum(directory / seg[0], seg[1], segment_bytes), segments)
            for (rel, _), value in zip(segments, found, strict=True):
                out[rel].append(value)
    return out


def record_files(directory: Path, relpaths: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Size and checksum (ALGORITHM, per SEGMENT_BYTES) of each of ``relpaths`` of ``directory``."""
    relpaths = list(relpaths)
    sums = _checksums(directory, relpaths, ALGORITHM, SEGMENT_BYTES)
    return {rel: {"size": (directory / rel).stat().st_size, ALGORITHM: sums[rel]} for rel in relpaths}


def record_own(directory: Path, rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """Size and checksum of every file of ``directory`` this rank wrote."""
    return record_files(directory, [rel for rel in checkpoint_files(directory) if owner(rel, world_size) == rank])


def changed_files(directory: Path, recorded: dict[str, dict[str, Any]], algorithm: str = ALGORITHM,
                  segment_bytes: int = SEGMENT_BYTES, *, sizes: bool = True, checksums: bool = True,
                  recorder: str = "recorded") -> list[str]:
    """What differs between the files of ``directory`` and ``recorded`` (``record_files``' form, ``recorder`` naming
    where it was read in messages): missing, of another size (``sizes``: one stat per file), of another checksum
    (``checksums``); [] when nothing does."""
    present = [rel for rel in sorted(recorded) if (directory / rel).is_file()]
    problems = [f"{directory / rel} is missing" for rel in sorted(recorded) if not (directory / rel).is_file()]
    if sizes:
        for rel in list(present):
            size = (directory / rel).stat().st_size
            if size != recorded[rel]["size"]:
                problems.append(f"{directory / rel} is {size:,} bytes, {recorder} {recorded[rel]['size']:,}")
                present.remove(rel)
    if not checksums:
        return problems
    for rel, found in _checksums(directory, present, algorithm, segment_bytes).items():
        expected = recorded[rel][algorithm]
        if found != expected:
            bad = next((i for i, (a, b) in enumerate(zip(found, expected, strict=False)) if a != b), None)
            where = (f"bytes from {bad * segment_bytes:,}" if bad is not None
                     else f"{len(found)} segments, {len(expected)} recorded")
            problems.append(f"{directory / rel} has another {algorithm} than {recorder} ({where})")
    return problems


def share_of_segments(recorded: dict[str, dict[str, Any]], rank: int, world_size: int,
                      segment_bytes: int = SEGMENT_BYTES) -> list[tuple[str, int]]:
    """The (file, segment index) pairs of ``recorded`` that ``rank`` of ``world_size`` checks: a contiguous run of
    every file's segments in name order, about 1/world_size of them (each segment at most ``segment_bytes``)."""
    segments = [(rel, i) for rel in sorted(recorded)
                for i in range(max(1, -(-int(recorded[rel]["size"]) // segment_bytes)))]
    return segments[len(segments) * rank // world_size:len(segments) * (rank + 1) // world_size]


def changed_segments(directory: Path, recorded: dict[str, dict[str, Any]], rank: int, world_size: int,
                     recorder: str = "recorded") -> list[str]:
    """``changed_files`` for this rank's share of the segments only (``share_of_segments``): each of its files'
    size, and the checksum of each of its segments; the ranks together check every byte once."""
    problems: list[str] = []
    mine = share_of_segments(recorded, rank, world_size, SEGMENT_BYTES)
    for rel in dict.fromkeys(rel for rel, _ in mine):
        path = directory / rel
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif (size := path.stat().st_size) != recorded[rel]["size"]:
            problems.append(f"{path} is {size:,} bytes, {recorder} {recorded[rel]['size']:,}")
    if problems:
        return problems
    expected = [recorded[rel][ALGORITHM][i] if i < len(recorded[rel][ALGORITHM]) else None for rel, i in mine]
    with ThreadPoolExecutor(max_workers=max(1, min(MAX_HASH_THREADS, len(mine)))) as pool:
        found = list(pool.map(lambda seg: crc32_segment(directory / seg[0], seg[1] * SEGMENT_BYTES, SEGMENT_BYTES),
                              mine))
    for (rel, i), value, want in zip(mine, found, expected, strict=True):
        if value != want:
            problems.append(f"{directory / rel} has another {ALGORITHM} than {recorder} (bytes from "
                            f"{i * SEGMENT_BYTES:,})")
    return problems


def manifest_digest(directory: Path) -> str | None:
    """The SHA-256 of a checkpoint's manifest (which holds every file's size and checksums): what identifies the
    checkpoint's contents to what is derived from it (a converted view); None without a manifest."""
    import hashlib

    try:
        return hashlib.sha256((directory / MANIFEST_FILE).read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def write_manifest(directory: Path, files: dict[str, dict[str, Any]], world_size: int) -> None:
    """The manifest, atomically (a temporary name, then a rename)."""
    manifest = {"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM, "segment_bytes": SEGMENT_BYTES,
                "world_size": world_size, "files": dict(sorted(files.items()))}
    tmp = directory / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, directory / MANIFEST_FILE)


class Unverified(Exception):
    """The checkpoint has no manifest (written before manifests existed)."""


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest; Unverified if there is none; ValueError naming the problem if it is unreadable."""
    path = directory / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise Unverified(str(directory)) from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is unreadable ({exc})") from None
    if (not isinstance(manifest, dict) or manifest.get("format") != FORMAT
            or manifest.get("algorithm") not in CHECKSUMS or not isinstance(manifest.get("files"), dict)
            or not isinstance(manifest.get("segment_bytes"), int) or manifest["segment_bytes"] <= 0):
        raise ValueError(f"{path} is not a checkpoint manifest this version reads")
    # Every number read from the file is bounded before it sizes any work: a segment of 1 byte would make the
    # checksums of a 7B checkpoint's 80 GB billions of calls (hours of every resume and export).
    segment, world = manifest["segment_bytes"], manifest.get("world_size")
    if not MIN_SEGMENT_BYTES <= segment <= MAX_SEGMENT_BYTES:
        raise ValueError(f"{path} records segment_bytes = {segment:,}, outside the {MIN_SEGMENT_BYTES:,} to "
                         f"{MAX_SEGMENT_BYTES:,} a manifest of pretrain's holds ({SEGMENT_BYTES:,} written): "
                         "damaged or not written by pretrain")
    if not isinstance(world, int) or not 1 <= world <= MAX_WORLD_SIZE:
        raise ValueError(f"{path} records world_size = {world!r}, not a number of processes from 1 to "
                         f"{MAX_WORLD_SIZE:,}: damaged or not written by pretrain")
    algorithm = manifest["algorithm"]
    for rel, entry in manifest["files"].items():
        try:
            contained(directory, rel, f"the manifest {path}")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        size = entry.get("size") if isinstance(entry, dict) else None
        sums = entry.get(algorithm) if isinstance(entry, dict) else None
        if (not isinstance(size, int) or size < 0 or not isinstance(sums, list)
                or len(sums) != max(1, -(-size // segment)) or not all(isinstance(c, str) for c in sums)):
            raise ValueError(f"{path} records {rel!r} as {entry!r}, not a size and one {algorithm} per "
                             f"{segment:,}-byte segment: damaged or not written by pretrain")
    return manifest


def check_sizes(directory: Path) -> str | None:
    """The damage one stat per file finds (missing, truncated or grown files, an unreadable manifest), or
    None. Unverified if the checkpoint has no manifest."""
    try:
        manifest = read_manifest(directory)
    except ValueError as exc:
        return str(exc)
    problems = []
    for rel, entry in manifest["files"].items():
        try:
            size = (directory / rel).stat().st_size
        except OSError:
            problems.append(f"{directory / rel} is missing")
            continue
        if size != entry["size"]:
            problems.append(f"{directory / rel} is {size:,} bytes, the manifest records {entry['size']:,}")
    return "; ".join(problems) or None


def verify_own(directory: Path, rank: int, world_size: int) -> str | None:
    """The checksum damage among the files ``rank`` verifies, or None (also when there is no manifest)."""
    try:
        manifest = read_manifest(directory)
    except Unverified:
        return None
    except ValueError as exc:
        return str(exc)
    mine = {rel: entry for rel, entry in manifest["files"].items() if owner(rel, world_size) == rank}
    problems = changed_files(directory, mine, manifest["algorithm"], manifest["segment_bytes"], sizes=False,
                             recorder="the manifest records")
    return "; ".join(problems) or None


def verify_all(directory: Path, only: Callable[[str], bool] | None = None) -> str | None:
    """Every file's size, and the checksums of every file (or of those ``only`` selects: the files a reader will
    read), in this one process (pretrain-export); None when intact or unverified."""
    try:
        manifest = read_manifest(directory)
    except Unverified:
        return None
    except ValueError as exc:
        return str(exc)
    sizes = check_sizes(directory)
    if sizes or only is None:
        return sizes or verify_own(directory, 0, 1)
    selected = {rel: entry for rel, entry in manifest["files"].items() if only(rel)}
    problems = changed_files(directory, selected, manifest["algorithm"], manifest["segment_bytes"], sizes=False,
                             recorder="the manifest records")
    return "; ".join(problems) or None
