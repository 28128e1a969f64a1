"""Which implementation serves an op: explicit choice, availability and the automatic rule.

Implementations:
  "xla"  - plain jax.numpy, lowered by XLA; the reference, available everywhere.
  "cuda" - our hand kernels through XLA FFI: CUDA kernels on GPU, the same math
           compiled for the host on CPU.

Automatic choice (implementation=None), made at lowering time from static shapes:
  GPU (cuda platform): "cuda" whenever the extension was built with CUDA.
  CPU: "xla". XLA's fused, multi-threaded CPU code beat our single-threaded host
       handlers in the CPU benchmark (docs/perf-notes.md); the host handlers stay
       selectable with implementation="cuda" and are what CI uses to test the FFI path.
  Anything else (TPU, ROCm): "xla".
"""
from __future__ import annotations

from jax_ops import _extension

IMPLEMENTATIONS = ("xla", "cuda")


def check_name(op: str, implementation: str | None) -> None:
    """Raises ValueError for a name that is no implementation at all."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"jax_ops.{op}: unknown implementation={implementation!r}; "
            f"expected None (automatic) or one of {list(IMPLEMENTATIONS)}")


def available(platform: str, ffi_target: str) -> list[str]:
    """Implementations that can lower on `platform` for an op whose kernel is `ffi_target`."""
    names = ["xla"]
    if _extension.has_target(platform, ffi_target):
        names.append("cuda")
    return names


def choose(op: str, implementation: str | None, platform: str, ffi_target: str) -> str:
    """The implementation to lower `op` with on `platform`; raises if the asked one can't."""
    check_name(op, implementation)
    names = available(platform, ffi_target)
    if implementation is None:
        return "cuda" if platform == "cuda" and "cuda" in names else "xla"
    if implementation not in names:
        why = ""
        if _extension.IMPORT_ERROR is not None:
            why = f" (the jax_ops._ffi extension failed to import: {_extension.IMPORT_ERROR})"
        raise ValueError(
            f"jax_ops.{op}: implementation={implementation!r} is not available on platform "
            f"{platform!r}{why}; available there: {names}")
    return implementation
