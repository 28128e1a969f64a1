"""Loads the compiled FFI extension (jax_ops._ffi) and registers its handlers with XLA."""
from __future__ import annotations

import jax

try:  # the extension is optional: without it only the "xla" implementations exist
    from jax_ops import _ffi  # type: ignore[attr-defined]
    IMPORT_ERROR: Exception | None = None
except ImportError as e:  # pragma: no cover - exercised only on broken installs
    _ffi = None
    IMPORT_ERROR = e

# XLA platform name used at registration -> lowering platform name used by jax.
_LOWERING_PLATFORM = {"cpu": "cpu", "CUDA": "cuda"}

#: lowering platform ("cpu", "cuda") -> names of the FFI targets registered for it
REGISTERED: dict[str, frozenset[str]] = {}


def _register() -> None:
    if _ffi is None:
        return
    for xla_platform, targets in _ffi.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
        if targets:
            REGISTERED[_LOWERING_PLATFORM[xla_platform]] = frozenset(targets)


def has_target(platform: str, target: str) -> bool:
    """Whether FFI target `target` can be lowered for jax platform `platform`."""
    return target in REGISTERED.get(platform, ())


_register()
