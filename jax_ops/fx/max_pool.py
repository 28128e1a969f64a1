"""max_pool: a max pooling window (flax.linen.max_pool, lax.reduce_window with lax.max
and a -inf init: the `reduce_window_max` primitive) whose gradient XLA computes with
select_and_scatter, replaced by the same forward and a gradient without it.

XLA's gradient of reduce_window_max re-reads the input x to find each window's maximum
again and scatters dy into it (select_and_scatter: 380 µs, 1.17 TB/s over its 444 MB
for ResNet-50's stem pool at batch 64 on the H100). The replacement, a custom_jvp,
records per output which window position was selected (uint8, in the same pass as the
maximum) and takes the tangent there; reverse mode transposes that into: for each
window offset k, dy where the index is k, placed at the inputs of that offset (an
interior-padded copy), summed. The backward reads dy and the index and writes dx; x is
no longer kept for it.

Selection rule (XLA's select_and_scatter with jax's ge): a window's first position in
row-major window order, replaced by each later v where not (selected >= v): the first
maximum; padding positions are candidates holding -inf (their gradient is dropped).
Without differentiation the forward is the original reduce_window_max, so inference is
unchanged. The replacement is XLA code, not one of our ops; policy="auto" replaces it
on GPU only, where the gradient was measured faster (`_decide`).
"""
from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp

from jax_ops.core.pattern import F32, BF16, Formulation, Pattern, sds

#: the equation whose params (window, strides, padding, dilations) the formulation and
#: the replacement take from the graph
POOL = "reduce_window_max"
MAX_WINDOW = 256  # positions a uint8 index can name


def _pool_params(params):
    """The graph's reduce_window_max params, or a 3x3 stride-2 padded NHWC pool for the
    templates (only the structure matters there)."""
    if params is None:
        return dict(window_dimensions=(1, 3, 3, 1), window_strides=(1, 2, 2, 1),
                    padding=((0, 0), (1, 1), (1, 1), (0, 0)), base_dilation=(1, 1, 1, 1),
                    window_dilation=(1, 1, 1, 1))
    return dict(params)


def _reduce_window_max(x, p):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, p["window_dimensions"],
                                 p["window_strides"], p["padding"], p["base_dilation"],
                                 p["window_dilation"])


def _flax_max_pool(x, *, reduce_window_max):
    """flax.linen.max_pool / lax.reduce_window(x, -inf, lax.max, ...)."""
    return _reduce_window_max(x, _pool_params(reduce_window_max))


def _out_shape(shape, p):
    return [(n + lo + hi - w) // s + 1 for n, (lo, hi), w, s in
            zip(shape, p["padding"], p["window_dimensions"], p["window_strides"])]


def _window_views(x, p, fill):
    """One view per window position, in row-major order: view[o] = x_padded[o * stride +
    offset], of the output's shape; the padding holds `fill`."""
    window, strides, padding = p["window_dimensions"], p["window_strides"], p["padding"]
    xp = jax.lax.pad(x, jnp.array(fill, x.dtype), [(lo, hi, 0) for lo, hi in padding])
    out = _out_shape(x.shape, p)
    for offset in itertools.product(*(range(w) for w in window)):
        limit = [o + (m - 1) * s + 1 for o, m, s in zip(offset, out, strides)]
        yield jax.lax.slice(xp, offset, limit, strides)


def _pool_with_index(x, p):
    """The maximum (reduce_window's value: NaN propagates as lax.max does) and the
    selected window position: XLA's select_and_scatter rule with jax's ge, i.e. the
    first position in window order, replaced by each later v where not (selected >= v).
    Padding positions are candidates holding -inf (a window whose inputs are all -inf
    and whose padding comes first selects the padding: no input gets its gradient)."""
    y = best = idx = None
    for k, v in enumerate(_window_views(x, p, -jnp.inf)):
        if y is None:
            y = best = v
            idx = jnp.zeros(v.shape, jnp.uint8)
            continue
        take = ~(best >= v)
        best = jnp.where(take, v, best)
        idx = jnp.where(take, jnp.uint8(k), idx)
        y = jax.lax.max(y, v)
    return y, idx


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _max_pool(x, pool):
    return _reduce_window_max(x, dict(pool))


@_max_pool.defjvp
def _max_pool_jvp(pool, primals, tangents):
    """The tangent at each window's selected position: select_n over the tangent's
    window views by the index. Linear in the tangent, so reverse mode transposes it
    into the scatter: dy where the index is k, interior-padded to the inputs of offset
    k, summed in float32 (the views are float32) and rounded once; the index is what
    the backward keeps (x is not). Forward mode and higher orders work as for any jnp."""
    (x,), (t,) = primals, tangents
    p = dict(pool)
    y, idx = _pool_with_index(x, p)
    views = list(_window_views(t.astype(jnp.float32), p, 0.0))
    return y, jax.lax.select_n(idx, *views).astype(t.dtype)


def _freeze(v):
    return tuple(_freeze(e) for e in v) if isinstance(v, (tuple, list)) else v


def max_pool_replacement(x, *, reduce_window_max, **_):
    """reduce_window_max(x) whose gradient keeps the window index instead of x."""
    p = _pool_params(reduce_window_max)
    return _max_pool(x, tuple(sorted((k, _freeze(v)) for k, v in p.items())))


def _examples():
    return [(sds((2, 9, 9, 4), d),) for d in (F32, BF16)]


def _accepts(avals):
    x = avals[0]
    if x.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64):
        # the padding and the selection need -inf (float8_e4m3fn has none)
        return f"x is {x.dtype}; the rewrite takes float16, bfloat16, float32, float64"
    return None


def _specialize(args, avals, params):
    p = _pool_params(params.get(POOL))
    if any(d != 1 for d in (*p["base_dilation"], *p["window_dilation"])):
        return "dilated pooling window (base or window dilation != 1)"
    size = math.prod(p["window_dimensions"])
    if size > MAX_WINDOW:
        return f"a window of {size} positions (at most {MAX_WINDOW})"
    if any(n + lo + hi < w for n, (lo, hi), w in zip(avals[0].shape, p["padding"], p["window_dimensions"])):
        return "a window larger than the padded input"
    return {}


def _decide(avals, params):
    """policy="auto": select_and_scatter is the slow part on GPU; elsewhere keep XLA's."""
    if jax.default_backend() != "gpu":
        return f"not faster on {jax.default_backend()}: the replacement targets XLA's GPU select_and_scatter"
    return None


def patterns() -> list[Pattern]:
    return [Pattern("max_pool",
                    [Formulation(_flax_max_pool, label="flax.linen.max_pool / lax.reduce_window(max)",
                                 node_params=(POOL,))],
                    max_pool_replacement, _examples(), accepts=_accepts, specialize=_specialize,
                    decide=_decide,
                    note="max pooling whose gradient skips select_and_scatter (the window index kept)")]
