"""Helpers shared by the op test suites: the lowering platform, skipping
implementations that cannot lower on it, and the collectives of compiled HLO."""
from __future__ import annotations

import math
import re

import jax
import pytest

import jax_ops
from jax_ops import _extension


def lowering_platform() -> str:
    """The jax lowering platform of the default backend ("cpu", "cuda", "rocm", ...)."""
    backend = jax.default_backend()
    try:
        from jax._src import xla_bridge
        return xla_bridge.canonicalize_platform(backend)
    except Exception:  # pragma: no cover - private API moved
        return {"gpu": "cuda"}.get(backend, backend)


PLATFORM = lowering_platform()


def available(op: str) -> list[str]:
    return jax_ops.implementations(op, platform=PLATFORM)


def need(op: str, impl: str | None) -> None:
    """Skips the calling test when `impl` cannot lower op on this platform."""
    can = available(op)
    if impl is not None and impl not in can:
        why = "" if _extension.IMPORT_ERROR is None else f"; extension import failed: {_extension.IMPORT_ERROR}"
        pytest.skip(f"implementation={impl!r} is not available for {op} on platform {PLATFORM!r} "
                    f"(available: {can}{why})")


def param_dtypes(variants, i: int, dtype: str) -> tuple[str | None, str | None]:
    """The (scale, bias) dtypes of variant i (cycled) of a norm test's variants: "f32" is
    float32, "x" the input's dtype, None an absent parameter."""
    names = {"f32": "float32", "x": dtype, None: None}
    sv, bv = variants[i % len(variants)]
    return names[sv], names[bv]


def primitive_names(closed_jaxpr) -> set[str]:
    """Names of the primitives in a jaxpr, nested bodies (jit, scan, cond) included."""
    from jax_ops.core.calls import equations
    return {eqn.primitive.name for eqn in equations(closed_jaxpr.jaxpr)}


_COLL = re.compile(r"=\s*(.*?)\s(all-gather|all-reduce|all-to-all|collective-permute|"
                   r"reduce-scatter|all-gather-start|all-reduce-start)\(")


def hlo_collectives(text: str) -> list[tuple[str, list[int]]]:
    """[(kind, [element counts of its results])] of each collective in compiled HLO text."""
    out = []
    for line in text.splitlines():
        m = _COLL.search(line)
        if m:
            shapes = re.findall(r"[a-z]+\d*\[([\d,]*)\]", m.group(1))
            out.append((m.group(2).replace("-start", ""),
                        [math.prod(int(d) for d in s.split(",") if d) for s in shapes]))
    return out


def collectives(fn, *args) -> list[tuple[str, list[int]]]:
    """hlo_collectives of jit(fn)'s compiled HLO for args."""
    return hlo_collectives(jax.jit(fn).lower(*args).compile().as_text())


# ------------------------------------------------------- the conv rewrites ---

def conv_params(x_shape, w_shape, strides, padding, dn) -> dict:
    """conv_general_dilated's params (as a jaxpr equation holds them) for a plain conv."""
    nsp = len(strides)
    return dict(window_strides=tuple(strides), padding=tuple(padding), lhs_dilation=(1,) * nsp,
                rhs_dilation=(1,) * nsp,
                dimension_numbers=jax.lax.conv_dimension_numbers(x_shape, w_shape, dn),
                feature_group_count=1, batch_group_count=1, precision=None,
                preferred_element_type=None)


def conv64(x, w, params, ct=None):
    """The conv in float64 (and its vjp at ct: (dx, dw))."""
    import numpy as np
    with jax.enable_x64(True):
        x64, w64 = (np.asarray(a, np.float64) for a in (x, w))
        conv = lambda x, w: jax.lax.conv_general_dilated(x, w, **params)  # noqa: E731
        if ct is None:
            return np.asarray(conv(x64, w64))
        return tuple(np.asarray(g) for g in jax.vjp(conv, x64, w64)[1](np.asarray(ct, np.float64)))


def rel(a, b) -> float:
    """‖a − b‖/‖b‖ in float64."""
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture
def highest_precision():
    """float32 dots and convs in float32 on a GPU too (its default is TF32)."""
    with jax.default_matmul_precision("highest"):
        yield
