"""The cache: where it is, the keys of its entries, and entries published atomically.

Each entry is a directory named by a hash of everything that determines its content, written under a
temporary name and renamed into place (see ``_publish``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pretrain.recipe.config import DataConfig
from pretrain.system.environment import cache_home

# Bump a version when the code that produces the corresponding cache changes its output.
DOCUMENTS_VERSION = 1
TOKENIZER_VERSION = 1

# The fix when the cache cannot be written (a shared, read-only cache; another user's). A run that finds all it
# needs there writes nothing into it: a complete store is only read, and the CPU peak (metrics.py) is measured
# again instead of cached.
CACHE_FIX = ("point data.cache_dir (or the PRETRAIN_CACHE_DIR environment variable) at a directory this user can "
             "write, or prepare the store where it can be written (pretrain-prepare-data) and name it with data.store")
STORE_FIX = ("point data.store (or data.cache_dir, or the PRETRAIN_CACHE_DIR environment variable) at a directory "
             "this user can write, or prepare the store where it can be written (pretrain-prepare-data) and name it "
             "with data.store")


def cache_root(data_cfg: DataConfig | None = None) -> Path:
    """Where tokenizers and token stores are cached: data.cache_dir, $PRETRAIN_CACHE_DIR or ~/.cache/pretrain (without
    a data section: the last two)."""
    if data_cfg is not None and data_cfg.cache_dir:
        return Path(data_cfg.cache_dir).expanduser().absolute()
    return cache_home()


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _publish(tmp_dir: Path, target: Path) -> bool:
    """Rename a finished temporary directory into place. False if another process got there first."""
    try:
        os.rename(tmp_dir, target)
        return True
    except OSError:
        if not target.is_dir():
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)
        return False


def _make_tmp_dir(parent: Path, name: str) -> Path:
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=parent))
    path.chmod(0o755)  # mkdtemp makes it private; a cache may be shared by the users of a machine
    return path
