"""The autotune cache file: where it lives, reading it (re-read when it changes) and
writing it atomically. Lowest layer: dispatch reads it, jax_ops.tuning writes it.

File: $JAX_OPS_AUTOTUNE_CACHE, else $XDG_CACHE_HOME/jax_ops/autotune.json, else
~/.cache/jax_ops/autotune.json. JSON: {"format": FORMAT, "devices": {device kind:
{"op|stage|dtype|shape": entry}}}, each entry {"implementation", "config", "us",
"version"} (the jax_ops version that measured it). A file of another format, an entry of
another version, and an unreadable file are ignored with one warning each: a cache never
breaks lowering, it only stops helping until jax_ops.autotune runs again.
"""
from __future__ import annotations

import json
import os
import warnings
from importlib import metadata
from pathlib import Path

FORMAT = 2


def library_version() -> str:
    try:
        return metadata.version("jax_ops")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


class AutotuneCacheWarning(UserWarning):
    """An autotune cache file or entry that is ignored."""


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(f"jax_ops: {message}", AutotuneCacheWarning, stacklevel=3)

_CACHE: dict = {"path": None, "mtime": None, "data": {}}


def cache_path() -> Path:
    env = os.environ.get("JAX_OPS_AUTOTUNE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jax_ops" / "autotune.json"


def load_cache() -> dict:
    """The cache file's raw contents (re-read when the file changes; {} when absent or
    unreadable)."""
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
            warn_once(f"ignoring unreadable autotune cache {path}: {e}")
            data = {}
        if not isinstance(data, dict):
            warn_once(f"ignoring autotune cache {path}: not a JSON object")
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


def entries(kind: str) -> dict:
    """The valid entries of device `kind`: this format, this library version."""
    data = load_cache()
    if not data:
        return {}
    if data.get("format") != FORMAT:
        warn_once(f"ignoring autotune cache {cache_path()}: format {data.get('format')!r}, "
                  f"expected {FORMAT} (written by another jax_ops; re-run jax_ops.autotune)")
        return {}
    bucket = data.get("devices", {}).get(kind, {})
    version = library_version()
    ok = {}
    for key, e in (bucket.items() if isinstance(bucket, dict) else ()):
        if not isinstance(e, dict) or e.get("version") != version or \
                not isinstance(e.get("implementation"), str):
            warn_once(f"ignoring autotune entry {key} for {kind} measured by jax_ops "
                      f"{e.get('version') if isinstance(e, dict) else '?'} (this is {version})")
            continue
        ok[key] = e
    return ok


def store(kind: str, new: dict[str, dict]) -> Path:
    """Adds entries {key: {"implementation", "config", "us"}} for device `kind`."""
    data = load_cache()
    if data.get("format") != FORMAT:
        data = {"format": FORMAT, "devices": {}}
    devices = dict(data.get("devices", {}))
    bucket = dict(devices.get(kind, {}))
    version = library_version()
    bucket.update({k: dict(v, version=version) for k, v in new.items()})
    devices[kind] = bucket
    return save({"format": FORMAT, "devices": devices})
