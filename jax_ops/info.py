"""`python -m jax_ops.info`: what this install of jax_ops runs on and with.

Prints the versions (jax, jaxlib, flax, jax_ops and where it is imported from, Python),
the devices, whether the compiled extension loaded (and why not), whether it carries the
CUDA kernels (and for which architectures), which measured dispatch table applies to the
GPU (else heuristics) and where autotune results are cached. Paste it into bug reports.
"""
from __future__ import annotations

import importlib.metadata
import platform
import sys
import warnings
from pathlib import Path


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> str:
    """The report `main()` prints, as one string."""
    # The extension's import warning (if any) is reported below, once, in its section.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import jax
        import jax_ops
        from jax_ops import _extension
        from jax_ops.core import cache, dispatch

    lines = ["versions:"]
    lines += [f"  {name}: {_version(name)}" for name in ("jax", "jaxlib", "flax")]
    lines.append(f"  jax_ops: {_version('jax_ops')} ({Path(jax_ops.__file__).parent})")
    lines.append(f"  python: {platform.python_version()} ({sys.executable})")

    lines.append("devices:")
    gpu_kinds = []
    try:
        devices = jax.devices()
    except RuntimeError as e:  # no usable backend
        devices = []
        lines.append(f"  none: {e}")
    for d in devices:
        lines.append(f"  {d.id}: platform {d.platform}, device_kind {d.device_kind!r}")
        if d.platform in ("gpu", "cuda", "rocm") and d.device_kind not in gpu_kinds:
            gpu_kinds.append(d.device_kind)

    lines.append("extension (jax_ops._ffi):")
    if _extension.IMPORT_ERROR is None:
        lines.append(f"  loaded: yes ({getattr(_extension._ffi, '__file__', '?')})")
        targets = {p: len(t) for p, t in sorted(_extension.REGISTERED.items())}
        lines.append(f"  FFI targets registered: {targets}")
    else:
        err = _extension.IMPORT_ERROR
        lines.append(f"  loaded: no ({type(err).__name__}: {err})")
        lines.append('  only the "xla" and "pallas" implementations are available')
    lines.append(f"  CUDA kernels built: {'yes' if jax_ops.with_cuda() else 'no'}")
    if jax_ops.with_cuda():
        archs = getattr(_extension._ffi, "cuda_archs", "") or "not recorded by this build"
        lines.append(f"  CUDA architectures: {archs}")

    lines.append("dispatch:")
    if not gpu_kinds:
        lines.append("  no GPU: heuristics (\"xla\" on CPU)")
    for kind in gpu_kinds:
        table, why = dispatch.table_match(kind)
        lines.append(f"  {dispatch.device(kind).describe()}: {why}"
                     + (f" (jax {table.get('jax_version')})" if table else ""))
    path = cache.cache_path()
    lines.append(f"  autotune cache: {path} ({'exists' if path.exists() else 'absent'})")
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
