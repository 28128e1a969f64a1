"""The autotune cache file: where it lives, reading it (re-read when it changes) and
writing it atomically. Lowest layer: dispatch reads it, jax_ops.tuning writes it.

File: $JAX_OPS_AUTOTUNE_CACHE, else $XDG_CACHE_HOME/jax_ops/autotune.json, else
~/.cache/jax_ops/autotune.json. JSON: {device kind: {"op|stage|dtype|shape": entry}}.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_CACHE: dict = {"path": None, "mtime": None, "data": {}}


def cache_path() -> Path:
    env = os.environ.get("JAX_OPS_AUTOTUNE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jax_ops" / "autotune.json"


def load_cache() -> dict:
    """The cache file's contents (re-read when the file changes; {} when absent)."""
    path = cache_path()
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return {}
    if _CACHE["path"] != path or _CACHE["mtime"] != mtime:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            print(f"jax_ops.autotune: ignoring unreadable cache {path}: {e}", file=sys.stderr)
            data = {}
        _CACHE.update(path=path, mtime=mtime, data=data)
    return _CACHE["data"]


def save(data: dict) -> Path:
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: concurrent readers see the old or the new file
    return path
