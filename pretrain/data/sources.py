"""Which corpus ``data.source`` names (local files, the ``stdlib`` corpus or an ``hf:`` dataset) and its
fingerprint, taken from (path, size, mtime_ns) without reading the files.

The fingerprint costs a listing and two stats per input file. In a launched run (torchrun / accelerate launch: an
elastic agent starts the node's processes) only local rank 0 computes it; it publishes the result for this launch in
a node-local file (``shared_path``: the temporary directory, named by the agent's pid and start time and the source),
and the node's other processes read that file instead of stat-ing the corpus. They never wait for it: local rank 0
prepares the data first (``ensure_data``: the others poll for its store), so they usually find it, and one that does
not (it got there first, rank 0 took another path or failed, or its working directory differs) computes its own, as
every rank did before. A new launch has a new agent, so a corpus changed between launches is still seen."""

from __future__ import annotations

import difflib
import glob
import json
import os
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from pretrain.data.cache import DOCUMENTS_VERSION, _hash
from pretrain.errors import DataError
from pretrain.recipe.config import DataConfig

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass(frozen=True)
class _Corpus:
    kind: str  # "stdlib", "local" or "hf"
    files: tuple[tuple[str, str], ...]  # (path, format) in sorted path order; empty for hf
    key: str  # hash of everything that determines the documents
    description: str
    root: str = ""  # what a document's input file is named relative to: the source directory (a file's, a glob's)


def _stdlib_files(subdir: str = "") -> list[Path]:
    """The standard library's .py files (tests and site-packages left out); ``subdir``: only under that
    package directory (``stdlib:email``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if subdir:
        packages = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in STDLIB_EXCLUDED_DIRS
                          and not p.name.startswith((".", "_")))
        if subdir not in packages or not Path(subdir).parts == (subdir,):
            near = difflib.get_close_matches(subdir, packages, n=1)
            hint = f"did you mean stdlib:{near[0]}? " if near else ""
            raise DataError(f"data.source = 'stdlib:{subdir}': the standard library at {root} has no package "
                            f"directory {subdir!r}; {hint}give one of: {', '.join(packages)}")
        root = root / subdir
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS]
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(files)


def _suffixes_for(fmt: str) -> tuple[str, ...]:
    return {
        "auto": TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES,
        "text": TEXT_SUFFIXES,
        "jsonl": JSONL_SUFFIXES,
        "parquet": PARQUET_SUFFIXES,
    }[fmt]


def _file_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    return "text"


def _local_files(data_cfg: DataConfig) -> list[Path]:
    source = data_cfg.source
    path = Path(source).expanduser()
    suffixes = _suffixes_for(data_cfg.format)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix.lower() in suffixes
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise DataError(
                f"data.source = {source!r}: the directory has no {' / '.join(suffixes)} files "
                f"(data.format = {data_cfg.format}); point data.source at a directory, file or glob of text, "
                "jsonl or parquet files"
            )
        return files
    if glob.has_magic(source):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(
                f"data.source = {source!r}: the glob matches no files; check the pattern (use ** for "
                "subdirectories) or give a file or directory"
            )
        return files
    raise DataError(
        f"data.source = {source!r}: no such file or directory (looked in {Path.cwd()}); give an existing file, "
        "directory or glob of .txt / .md / .jsonl / .parquet files, `stdlib` for the built-in corpus, "
        "or `hf:NAME` for a Hugging Face dataset"
    )


def _agent() -> str | None:
    """This launch on this node: the elastic agent that started the process (its pid and start time, so that a reused
    pid is another launch), or None outside a launched run."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "LOCAL_RANK" not in os.environ:
        return None
    parent = os.getppid()
    try:  # /proc/PID/stat's 22nd field, after the command in parentheses
        start = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        start = "0"
    return f"{parent}-{start}"


def shared_path(data_cfg: DataConfig) -> Path | None:
    """Where local rank 0 of this launch publishes this source's corpus (None outside a launched run)."""
    agent = _agent()
    if agent is None:
        return None
    what = _hash({"source": data_cfg.source, "format": data_cfg.format, "text_field": data_cfg.text_field,
                  "on_decode_error": data_cfg.on_decode_error, "hf_config": data_cfg.hf_config,
                  "hf_split": data_cfg.hf_split, "cwd": os.getcwd()})
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"pretrain-corpus-{uid}-{agent}-{what}.json"


def _read_shared(path: Path) -> _Corpus | None:
    try:
        fields = json.loads(path.read_text())
        return _Corpus(**{**fields, "files": tuple(tuple(f) for f in fields["files"])})
    except (OSError, ValueError, TypeError):
        return None


def _publish(path: Path, corpus: _Corpus) -> None:
    """Write this launch's corpus for the node's other processes; those of launches whose agent has exited go."""
    prefix = path.name.split("-")[:3]  # pretrain, corpus, uid
    for old in path.parent.glob("-".join(prefix) + "-*.json") if Path("/proc/self").exists() else ():
        pid = old.name.split("-")[3]
        if old != path and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            old.unlink(missing_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        tmp.write_text(json.dumps(asdict(corpus)))
        os.replace(tmp, path)
    except OSError:  # the others compute it themselves
        tmp.unlink(missing_ok=True)


def _resolve_corpus(data_cfg: DataConfig) -> _Corpus:
    """Find the corpus and fingerprint it without reading it (stat only); in a launched run, once per node (local
    rank 0, which publishes it: see the module's docstring)."""
    shared = shared_path(data_cfg)
    if shared is None:
        return _fingerprint(data_cfg)
    if int(os.environ["LOCAL_RANK"]) > 0:
        corpus = _read_shared(shared)
        return corpus if corpus is not None else _fingerprint(data_cfg)  # no wait: a rank that could hang never does
    corpus = _fingerprint(data_cfg)
    _publish(shared, corpus)
    return corpus


def _fingerprint(data_cfg: DataConfig) -> _Corpus:
    source = data_cfg.source
    common = {
        "version": DOCUMENTS_VERSION,
        "text_field": data_cfg.text_field,
        "on_decode_error": data_cfg.on_decode_error,
    }
    if source.startswith("hf:"):
        name = source[3:]
        if not name:
            raise DataError("data.source = 'hf:' names no dataset; write it like hf:roneneldan/TinyStories")
        key = _hash({**common, "hf": name, "config": data_cfg.hf_config, "split": data_cfg.hf_split})
        return _Corpus("hf", (), key, f"hf:{name} (config {data_cfg.hf_config}, split {data_cfg.hf_split})", name)
    if source == "stdlib" or source.startswith("stdlib:"):
        subdir = source.partition(":")[2]
        kind, paths, fmt = "stdlib", _stdlib_files(subdir), "text"
        description = f"Python {sys.version_info.major}.{sys.version_info.minor} standard library"
        description += f": {subdir}/" if subdir else ""
        root = Path(sysconfig.get_paths()["stdlib"])
    else:
        kind, paths, fmt = "local", _local_files(data_cfg), data_cfg.format
        description = source
        root = _source_root(source)
    files = tuple((str(p.absolute()), _file_format(p, fmt)) for p in paths)
    stats = []
    for path, file_fmt in files:
        st = os.stat(path)
        stats.append((path, file_fmt, st.st_size, st.st_mtime_ns))
    return _Corpus(kind, files, _hash({**common, "files": stats}), description, str(root.absolute()))


def _source_root(source: str) -> Path:
    """The directory a local source's files are named relative to: itself, a file's directory, or the part of a
    glob before its first wildcard."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        return path.parent
    parts = []
    for part in Path(os.path.expanduser(source)).parts:
        if glob.has_magic(part):
            break
        parts.append(part)
    return Path(*parts) if parts else Path(".")
