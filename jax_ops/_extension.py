"""Loads the compiled FFI extension (jax_ops._ffi) and registers its handlers with XLA."""
from __future__ import annotations

import functools
import warnings

import jax


class ExtensionImportWarning(UserWarning):
    """`import jax_ops` could not load the compiled extension jax_ops._ffi. A UserWarning
    subclass, so it is shown by default (ImportWarning is hidden by default)."""


try:  # the extension is optional: without it the "cuda" implementations are missing
    from jax_ops import _ffi  # type: ignore[attr-defined]
    IMPORT_ERROR: Exception | None = None
except ImportError as e:  # exercised by tests/test_info.py in a subprocess
    _ffi = None
    IMPORT_ERROR = e
    # Loud, once (module import runs once): a broken build otherwise only shows up as
    # slower "xla" picks or a ValueError on implementation="cuda".
    warnings.warn(
        f"jax_ops: the compiled extension jax_ops._ffi failed to import ({type(e).__name__}: "
        f"{e}); the \"cuda\" implementations (our XLA FFI handlers) are unavailable, only "
        "the \"xla\" implementations (and the \"pallas\" kernels, which do not need the "
        "extension) are. `python -m jax_ops.info` shows the install.",
        ExtensionImportWarning)

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


@functools.lru_cache(maxsize=None)
def norm_bwd_partial_rows(x_dtype: str, param_dtype: str, rows: int, cols: int, *, rms: bool, add: bool,
                          dscale: bool, dbias: bool) -> int | None:
    """Rows of the CUDA LayerNorm/RMSNorm backward's [2, P, cols] partial-sum workspace
    on the current GPU: the grid its launchers would use (resident blocks), asked of
    the extension at lowering time. rows < 0: not known yet (symbolic). None when the
    extension has no CUDA kernels or no GPU answers."""
    fn = getattr(_ffi, "norm_bwd_partial_rows", None)
    if fn is None:
        return None
    n = fn(x_dtype, param_dtype, rows, cols, rms, add, dscale, dbias)
    return None if n < 0 else int(n)
