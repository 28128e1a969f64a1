"""Softmax and LogSoftmax over any axis: the declaration (core/op.py).

Forward stage  jax_ops_softmax_fwd(x, mask?) -> (y,)
Backward stage jax_ops_softmax_bwd(y, dy) -> (dx,)
With the softmax axis sharded the per-device code (`_fwd_local`, `_bwd_local`) binds four
more stages (partials, apply, bwd_partials, bwd_apply: "hidden-sharded stages" below)
and combines their per-row partials across devices.

Params: axis (negative: counted from the end, so batching never shifts it), scale,
log (log_softmax), causal, mask_kind ("none" | "bool" | "add"). The mask operand,
where present, has x's rank (a broadcast mask keeps its size-1 axes). Logits
z = x * scale, then the mask (bool: False -> -inf; additive: + mask) and the causal
rule (x is (..., q, k): keep j <= i + k - q, bottom-right aligned). Math in float32,
y in x's dtype.

Rows whose logits are all -inf (fully masked): softmax 0, log_softmax -inf.
Reverse mode keeps y only:
  softmax      dx = scale * y * (dy - Σ dy·y)
  log_softmax  dx = scale * (dy - exp(y) * Σ dy), 0 where y = -inf (masked)
An additive mask gets the logits' gradient dz = dx / scale, summed over the axes
it is broadcast along. Bool masks have no gradient.

The kernels (cuda, pallas) see the softmax axis last: for another axis they work on
a transposed copy (jnp.moveaxis), so the automatic choice leaves those calls to XLA,
which reduces over a strided axis in place.
"""
from __future__ import annotations

import math
import numbers

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from jax_ops.core import registry
from jax_ops.core.benchspec import BenchSpec, view_len
from jax_ops.core.op import (Impl, Op, Stage, ffi, ffi_supports, local_uses_kernels,
                             match_vma, pallas_supports)
from jax_ops.core.sharding import gather_parts, ordered_sum
from jax_ops.core.pattern import BF16, Formulation, Pattern, accepts_x, sds
from jax_ops.core.validate import ACT_DTYPES
from jax_ops.core.validate import dtype_name as _fmt_dtype
from pallas_kernels import softmax as pallas_softmax

_F32 = jnp.dtype(jnp.float32)
MAX_MASK_GROUPS = 4  # cuda_src/softmax_math.h kMaxMaskGroups


def _op_of(params) -> str:
    return "log_softmax" if params["log"] else "softmax"


# ------------------------------------------------------------- validation ---

def _check_x(op, x):
    if x.dtype not in ACT_DTYPES:
        raise TypeError(f"jax_ops.{op}: x must be float32, bfloat16 or float16; "
                        f"got dtype {_fmt_dtype(x.dtype)}")
    if x.ndim < 1:
        raise ValueError(f"jax_ops.{op}: x must have at least 1 dimension; got shape {tuple(x.shape)}")


def _normalize_axis(op, axis, ndim) -> int:
    """axis -> the same axis counted from the end (-1 = last)."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"jax_ops.{op}: axis must be an int; got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"jax_ops.{op}: axis {axis} is out of range for x of rank {ndim} "
                         f"(expected -{ndim} <= axis < {ndim})")
    return int(axis) - ndim if axis >= 0 else int(axis)


def _check_scale(op, scale) -> float:
    if scale is None:
        return 1.0
    if isinstance(scale, (jax.Array, np.ndarray)) and np.ndim(scale) == 0:
        try:  # a concrete 0-d array is a number; a traced one can't be a static scale
            scale = float(scale)
        except (jax.errors.ConcretizationTypeError, TypeError):
            raise TypeError(f"jax_ops.{op}: scale must be a concrete real number (it is "
                            "compiled into the kernel); got a traced array. Multiply x by "
                            "it instead") from None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"jax_ops.{op}: scale must be a real number or None; got "
                        f"{type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"jax_ops.{op}: scale must be finite; got {scale}")
    return float(scale)


def _prepare_mask(op, x, mask):
    """The mask with x's rank (float masks widened to float32 unless in x's dtype);
    raises on bad dtype or shape. Its kind follows from its dtype (_mask_kind)."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if jnp.issubdtype(mask.dtype, jnp.floating):
        if mask.dtype not in (_F32, x.dtype):  # e.g. float16 with bfloat16 x: widen
            mask = mask.astype(jnp.float32)
    elif mask.dtype != jnp.bool_:
        raise TypeError(f"jax_ops.{op}: mask must be bool (True = keep) or floating (added to "
                        f"the logits); got dtype {_fmt_dtype(mask.dtype)}")
    try:
        ok = mask.ndim <= x.ndim and np.broadcast_shapes(mask.shape, x.shape) == tuple(x.shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"jax_ops.{op}: mask of shape {tuple(mask.shape)} does not broadcast "
                         f"to x's shape {tuple(x.shape)}")
    return mask.reshape((1,) * (x.ndim - mask.ndim) + tuple(mask.shape))


# ---------------------------------------------------------- mask row maps ---

def mask_groups(x_shape, mask_shape) -> list[tuple[int, int, int]]:
    """(inner, size, stride) groups mapping a row of x to a row of the mask, both with
    the softmax axis last and the same rank: mask row = Σ ((row // inner) % size) * stride.
    Consecutive kept axes merge; broadcast axes contribute nothing."""
    groups, inner, stride = [], 1, 1
    open_group = False
    for xs, ms in zip(reversed(x_shape[:-1]), reversed(mask_shape[:-1])):
        if xs == 1:
            continue
        if ms == xs:
            if open_group:
                g = groups[-1]
                groups[-1] = (g[0], g[1] * xs, g[2])
            else:
                groups.append((inner, xs, stride))
                open_group = True
            stride *= xs
        else:
            open_group = False
        inner *= xs
    return groups or [(1, 1, 0)]


# ---------------------------------------------------------------- forward ---

def _mask_kind(mask) -> str:
    return "none" if mask is None else ("bool" if mask.dtype == jnp.bool_ else "add")


def _causal_dims(shape):
    q = shape[-2] if len(shape) >= 2 else 1
    return q, shape[-1] - q


def _fwd_abstract(x, mask, *, axis, scale, log, causal, mask_kind):
    op = "log_softmax" if log else "softmax"
    _check_x(op, x)
    if mask_kind != _mask_kind(mask):
        got = "no mask" if mask is None else f"a {_fmt_dtype(mask.dtype)} mask"
        raise ValueError(f"jax_ops {op} primitive: mask_kind={mask_kind!r} with {got}")
    if mask is not None and mask.ndim != x.ndim:
        raise ValueError(f"jax_ops {op} primitive: mask must have x's rank; got {mask.shape} for {x.shape}")
    return (core.ShapedArray(x.shape, x.dtype),)


def _fwd_reference(x, mask, *, axis, scale, log, causal, mask_kind, reduce=None, causal_at=None):
    """reduce(kind, a): a's max/sum over the softmax axis (keepdims), psum'ed/pmax'ed
    over devices when that axis is sharded; causal_at: the global (row, column) indices
    of x's last two axes (broadcastable), when x holds a shard of them."""
    if reduce is None:
        def reduce(kind, a):
            return (jnp.max if kind == "max" else jnp.sum)(a, axis=axis, keepdims=True)
    if causal and causal_at is None:
        q, offset = _causal_dims(x.shape)
        causal_at = ((jnp.arange(q)[:, None], jnp.arange(x.shape[-1])[None, :]), offset)
    elif causal:
        (rows, cols), (q, k) = causal_at
        causal_at = ((rows, cols), k - q)
    z = _logits(x, mask, scale=scale, mask_kind=mask_kind, causal_at=causal_at if causal else None)
    # Empty (fully masked) rows from the max, not from the sum: XLA fuses this form
    # into one kernel (measured on the H100: testing the sum took two, at half speed).
    # jnp.max propagates NaN, so a NaN still reaches its whole row.
    m = reduce("max", z)
    empty = m == -jnp.inf
    m = jnp.where(empty, 0.0, m)
    e = jnp.exp(z - m)
    s = reduce("sum", e)
    if log:  # (z - m) - log s: z - (m + log s) would round log s away when |m| is large
        y = jnp.where(empty, -jnp.inf, (z - m) - jnp.log(s))
    else:
        y = jnp.where(empty, 0.0, e / s)
    return (y.astype(x.dtype),)


def _logits(x, mask, *, scale, mask_kind, causal_at=None):
    """z = x * scale with the mask and the causal rule (-inf where dropped), float32.
    causal_at: ((rows, cols), offset), x's (local) row and column indices along its last
    two axes, broadcastable, and the offset: keep col <= row + offset."""
    z = x.astype(jnp.float32)
    if scale != 1.0:
        z = z * scale
    keep = None
    if mask_kind == "bool":
        keep = mask
    elif mask_kind == "add":
        z = z + mask.astype(jnp.float32)
    if causal_at is not None:
        (rows, cols), offset = causal_at
        tri = cols <= rows + offset
        keep = tri if keep is None else keep & tri
    if keep is not None:
        z = jnp.where(keep, z, -jnp.inf)
    return z


def _fwd_batch(stage, args, dims, **params):
    x, mask = args
    xd, md = dims
    size = x.shape[xd] if xd is not None else mask.shape[md]
    x = jnp.moveaxis(x, xd, 0) if xd is not None else jnp.broadcast_to(x, (size,) + x.shape)
    if mask is not None:  # keeps x's rank: a size-1 (broadcast) axis where unbatched
        mask = jnp.moveaxis(mask, md, 0) if md is not None else mask[None]
    # axis counts from the end and causal uses the last two axes: a new leading axis
    # changes neither.
    return stage.call(x, mask, **params), (0,)


def _query_shape(shape, params):
    axis = params["axis"]
    return shape[:axis] + shape[axis + 1:] + (shape[axis],) if axis != -1 else shape


def _variant(params):
    """"strided" (softmax axis not last: the kernels decline it automatically), "mask"
    (a masked or causal forward: timed as its own table stage, fwd_mask), else ""."""
    if params["axis"] != -1:
        return "strided"
    if params.get("mask_kind", "none") != "none" or params.get("causal", False):
        return "mask"
    return ""


# ---------------------------------------------------------------- sharding ---
# Rows (every axis but the softmax axis) sharded: the kernel runs on each device's
# rows. The softmax axis sharded: per-device max and sum-exp (the partials stage, or jnp
# for xla), combined over its mesh axes (O(rows) data), then the local columns written
# (the apply stage, or jnp). Causal with the query or key axis sharded: the device's
# global row/column offsets.

def _needs_local(layout, params):
    if layout.col_axes:
        return True
    return bool(params.get("causal")) and bool(layout.dims[-2] or layout.dims[-1])


def _reducer(layout, axis):
    def reduce(kind, a):
        if kind == "max":
            r = jnp.max(a, axis=axis, keepdims=True)
            return jax.lax.pmax(r, layout.col_axes) if layout.col_axes else r
        r = jnp.sum(a, axis=axis, keepdims=True)
        return jax.lax.psum(r, layout.col_axes) if layout.col_axes else r
    return reduce


def _global_index(layout, dim, local):
    """The global indices of this device's `local` entries of x's dim `dim`."""
    i = jnp.arange(local)
    if layout.dims[dim]:
        i = i + jax.lax.axis_index(layout.dims[dim]) * local
    return i


def _kernel_stages(mesh, *calls, axis) -> bool:
    """Whether the per-device code runs our stage kernels: softmax over the last axis,
    and local_uses_kernels for `calls` (the one-device stage and the first per-device
    stage)."""
    return axis == -1 and local_uses_kernels(mesh, *calls)


def _causal_offset(layout, x):
    """The causal rule's offset on this device: keep local column c of local row r
    (along the query axis) iff c <= r + offset, offset = row0 − col0 + k − q with row0,
    col0 the shard's first global query row and key column. An int32 scalar: it depends
    on the device's position (axis_index)."""
    nd = x.ndim
    q, k = layout.shape[-2], layout.shape[-1]
    offset = jnp.int32(k - q)
    if layout.dims[nd - 2]:
        offset = offset + jax.lax.axis_index(layout.dims[nd - 2]).astype(jnp.int32) * x.shape[-2]
    if layout.dims[nd - 1]:
        offset = offset - jax.lax.axis_index(layout.dims[nd - 1]).astype(jnp.int32) * x.shape[-1]
    return offset


def merge_max_sum_parts(ms, ss):
    """The whole rows' (max, Σ exp(z − max)) from the parts' (stacked along the leading
    axis), merged in part order."""
    top = ms[0]
    for i in range(1, ms.shape[0]):
        top = jnp.maximum(top, ms[i])
    shift = jnp.where(top == -jnp.inf, 0.0, top)
    return top, ordered_sum(jnp.where(ms == -jnp.inf, ss, ss * jnp.exp(ms - shift)))


def _combine_max_sum(m, s, axes):
    """merge_max_sum_parts of every device's along the mesh axes `axes`."""
    return merge_max_sum_parts(*gather_parts([m, s], axes))


def _fwd_local(layout, mesh, x, mask, *, axis, scale, log, causal, mask_kind, implementation):
    """Per device, the softmax axis (or, causal, the query axis) sharded. With kernels:
    PARTIALS writes each row's local (max, Σ exp) of the logits (scale, mask, causal rule
    with the device's offset), one all_gather over the column axes brings every
    device's (O(rows × devices) floats), merged in device order, and APPLY writes y.
    Else jnp: pmax/psum over the column axes, causal from global indices."""
    params = dict(axis=axis, scale=scale, log=log, causal=causal, mask_kind=mask_kind)
    if _kernel_stages(mesh, (FWD, (x, mask), dict(params, implementation=implementation)),
                      (PARTIALS, (x, mask, None), dict(scale=scale, causal=causal, mask_kind=mask_kind,
                                                       implementation=implementation)), axis=axis):
        offset = _causal_offset(layout, x) if causal else None
        kw = dict(scale=scale, causal=causal, mask_kind=mask_kind, implementation=implementation)
        m, s = PARTIALS.call(x, mask, offset, **kw)
        if layout.col_axes:
            m, s = _combine_max_sum(m, s, layout.col_axes)
        return APPLY.call(x, mask, offset, m, s, log=log, **kw)
    causal_at = None
    if causal:
        nd = x.ndim
        rows = _global_index(layout, nd - 2, x.shape[-2])[:, None]
        cols = _global_index(layout, nd - 1, x.shape[-1])[None, :]
        causal_at = ((rows, cols), (layout.shape[-2], layout.shape[-1]))
    return _fwd_reference(x, mask, axis=axis, scale=scale, log=log, causal=causal,
                          mask_kind=mask_kind, reduce=_reducer(layout, axis), causal_at=causal_at)


def _bwd_local(layout, mesh, y, dy, *, axis, scale, log, implementation):
    """Per device, the softmax axis sharded: with kernels BWD_PARTIALS (Σ dy·y; log: Σ dy
    per row), all_gather and an in-order sum, BWD_APPLY; else jnp with a psum."""
    if _kernel_stages(mesh, (BWD, (y, dy), dict(axis=axis, scale=scale, log=log,
                                                implementation=implementation)),
                      (BWD_PARTIALS, (y, dy), dict(log=log, implementation=implementation)), axis=axis):
        (dot,) = BWD_PARTIALS.call(y, dy, log=log, implementation=implementation)
        dot = ordered_sum(gather_parts([dot], layout.col_axes)[0])
        return BWD_APPLY.call(y, dy, dot, scale=scale, log=log, implementation=implementation)
    reduce = _reducer(layout, axis)
    return ((scale * _logit_grad(y, dy, axis, log, lambda a: reduce("sum", a))).astype(y.dtype),)


# --------------------------------------------------------------- backward ---

def _bwd_abstract(y, dy, *, axis, scale, log):
    if dy.shape != y.shape or dy.dtype != y.dtype:
        raise ValueError(f"jax_ops softmax backward: dy must match y; got dy {dy.shape} "
                         f"{_fmt_dtype(dy.dtype)} and y {y.shape} {_fmt_dtype(y.dtype)}")
    return (core.ShapedArray(y.shape, y.dtype),)


def _logit_grad(y, dy, axis, log, reduce_sum=None):
    """dz (float32): the gradient of the logits, from y and dy; reduce_sum(a): a's sum
    over the softmax axis (keepdims), psum'ed when that axis is sharded."""
    if reduce_sum is None:
        def reduce_sum(a):
            return jnp.sum(a, axis=axis, keepdims=True)
    yf, dyf = y.astype(jnp.float32), dy.astype(jnp.float32)
    if log:
        live = yf != -jnp.inf
        dot = reduce_sum(jnp.where(live, dyf, 0.0))
        return jnp.where(live, dyf - jnp.exp(yf) * dot, 0.0)
    dot = reduce_sum(dyf * yf)
    return yf * (dyf - dot)


def _bwd_reference(y, dy, *, axis, scale, log):
    return ((scale * _logit_grad(y, dy, axis, log)).astype(y.dtype),)


def _bwd_batch(stage, args, dims, **params):
    y, dy = args
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    y, dy = (jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size,) + a.shape)
             for a, d in zip(args, dims))
    return stage.call(y, dy, **params), (0,)


# --------------------------------------------------------- implementations ---

def _kernel_layout(x, mask, axis):
    """x and mask with the softmax axis last, the mask's last axis at full length and
    at most MAX_MASK_GROUPS groups (else materialized); (x, mask2d | None, groups | None)."""
    x = jnp.moveaxis(x, axis, -1)
    if mask is None:
        return x, None, None
    mask = jnp.moveaxis(mask, axis, -1)
    if mask.shape[-1] != x.shape[-1]:
        mask = jnp.broadcast_to(mask, mask.shape[:-1] + x.shape[-1:])
    groups = mask_groups(x.shape, mask.shape)
    if len(groups) > MAX_MASK_GROUPS:
        mask = jnp.broadcast_to(mask, x.shape)
        groups = mask_groups(x.shape, mask.shape)
    return x, mask.reshape(-1, x.shape[-1]), groups


def _kernel_mask(xk, mask2, groups):
    """The mask operand and its attributes as the forward handlers take them."""
    if mask2 is None:  # the handler's ABI: a zero-element buffer stands for no mask
        m = jnp.zeros((0,), _F32)
    else:  # the handler wants x's rank: (mask rows, 1, ..., 1, cols)
        m = mask2.reshape(mask2.shape[-1:]) if xk.ndim == 1 else \
            mask2.reshape(mask2.shape[:1] + (1,) * (xk.ndim - 2) + mask2.shape[-1:])
    return m, dict(has_mask=mask2 is not None,
                   mask_map=np.asarray(groups or [(1, 1, 0)], np.int64).reshape(-1))


def _cuda_fwd(call, x, mask, *, axis, scale, log, causal, mask_kind):
    xk, mask2, groups = _kernel_layout(x, mask, axis)
    m, mask_attrs = _kernel_mask(xk, mask2, groups)
    y = jax.ffi.ffi_call("jax_ops_softmax_fwd", jax.ShapeDtypeStruct(xk.shape, xk.dtype))(
        xk, m, scale=np.float32(scale), log=bool(log), causal=bool(causal), **mask_attrs)
    return (jnp.moveaxis(y, -1, axis),)


def _cuda_bwd(call, y, dy, *, axis, scale, log):
    yk, dyk = jnp.moveaxis(y, axis, -1), jnp.moveaxis(dy, axis, -1)
    dx = jax.ffi.ffi_call("jax_ops_softmax_bwd", jax.ShapeDtypeStruct(yk.shape, yk.dtype))(
        yk, dyk, scale=np.float32(scale), log=bool(log))
    return (jnp.moveaxis(dx, -1, axis),)


def _pallas_fwd(call, x, mask, *, axis, scale, log, causal, mask_kind):
    xk, mask2, groups = _kernel_layout(x, mask, axis)
    q, offset = _causal_dims(xk.shape)
    cols = xk.shape[-1]
    y = pallas_softmax.softmax_fwd(
        xk.reshape(-1, cols), mask2, scale=scale, log=log, causal=causal, q_len=q,
        offset=offset, mask_kind=mask_kind, mask_map=tuple(groups or ()), config=call.config,
        interpret=call.interpret)
    return (jnp.moveaxis(y.reshape(xk.shape), -1, axis),)


def _pallas_bwd(call, y, dy, *, axis, scale, log):
    yk, dyk = jnp.moveaxis(y, axis, -1), jnp.moveaxis(dy, axis, -1)
    cols = yk.shape[-1]
    dx = pallas_softmax.softmax_bwd(yk.reshape(-1, cols), dyk.reshape(-1, cols), scale=scale,
                                    log=log, config=call.config, interpret=call.interpret)
    return (jnp.moveaxis(dx.reshape(yk.shape), -1, axis),)


def _pallas_configs(q):
    return pallas_softmax.candidate_configs(max(q.rows or 1, 1), q.cols, q.stage)


def _last_axis_only(q):
    if q.variant == "strided":
        return False, ("the softmax axis is not x's last: the kernel would work on a transposed "
                       "copy, XLA reduces in place")
    return True, ""


def _user_adapter(fn, backward, tunable):
    """register_implementation's adapter: fn(x2d, mask2d | None, *, scale, causal_q,
    mask_map) is too much to ask of users; they get fn(x2d, *, scale) -> y on unmasked,
    non-causal calls over the last axis (supports() should say so) and
    backward(y2d, dy2d, *, scale) -> dx."""
    def fwd(call, x, mask, *, axis, scale, log, causal, mask_kind):
        if mask is not None or causal:
            raise ValueError(f"jax_ops.{'log_softmax' if log else 'softmax'}: user "
                             "implementations take unmasked, non-causal calls only (make "
                             "supports() refuse the others)")
        xk = jnp.moveaxis(x, axis, -1)
        kw = {"config": call.config} if tunable else {}
        y = fn(xk.reshape(-1, xk.shape[-1]), scale=scale, **kw)
        return (jnp.moveaxis(jnp.asarray(y).astype(x.dtype).reshape(xk.shape), -1, axis),)

    def bwd(call, y, dy, *, axis, scale, log):
        yk, dyk = jnp.moveaxis(y, axis, -1), jnp.moveaxis(dy, axis, -1)
        kw = {"config": call.config} if tunable else {}
        dx = backward(yk.reshape(-1, yk.shape[-1]), dyk.reshape(-1, yk.shape[-1]), scale=scale, **kw)
        return (jnp.moveaxis(jnp.asarray(dx).astype(y.dtype).reshape(yk.shape), -1, axis),)

    return {"fwd": fwd, **({"bwd": bwd} if backward is not None else {})}


# ----------------------------------------------------------- declaration ---

def _axis(params) -> int:
    return params["axis"]


FWD = Stage("softmax_fwd", "fwd", ("x", "mask?"), ("y",),
            op_of=_op_of, abstract=_fwd_abstract, reference=_fwd_reference, batch=_fwd_batch,
            roles={"x": "x", "mask": "bmask", "y": "x"}, needs_local=_needs_local,
            local=_fwd_local, axis=_axis, variant=_variant, query_shape=_query_shape)
BWD = Stage("softmax_bwd", "bwd", ("y", "dy"), ("dx",),
            op_of=_op_of, abstract=_bwd_abstract, reference=_bwd_reference, batch=_bwd_batch,
            roles={"y": "x", "dy": "x", "dx": "x"},
            needs_local=lambda layout, params: bool(layout.col_axes), local=_bwd_local,
            axis=_axis, variant=_variant, query_shape=_query_shape)


# ------------------------------------------------ hidden-sharded stages (issue 23) ---
# Per-device stages of `_fwd_local`/`_bwd_local` (the softmax axis, the last, split over
# devices, or causal with the query axis split; bound only there, on the local shards).
# Per-row values are float32 of x's shape without the last axis. The logits are the
# unsharded op's: scale, the mask (bool or additive, its local columns: a mask's key
# axis is sharded with x's, or broadcast), and the causal rule with `offset`, an int32
# scalar operand (the device's row0 − col0 + k − q: it depends on the device, so it
# cannot be a static attribute). Kernels: "cuda" (the host handlers on CPU); "xla" runs
# the references; no Pallas kernels (a pallas call gets the automatic choice for them).
#   jax_ops_softmax_partials(x, mask?, offset?) -> (max, sum)   sum = Σ exp(z − safe max)
#   jax_ops_softmax_apply(x, mask?, offset?, max, sum) -> (y,)   max/sum: the whole rows'
#   jax_ops_softmax_bwd_partials(y, dy) -> (dot,)                Σ dy·y (log: Σ dy)
#   jax_ops_softmax_bwd_apply(y, dy, dot) -> (dx,)

def _stage_rows(x):
    return core.ShapedArray(x.shape[:-1], _F32)


def _check_stage_rows(stage, x, **arrays):
    for name, a in arrays.items():
        if tuple(a.shape) != tuple(x.shape[:-1]) or a.dtype != _F32:
            raise ValueError(f"jax_ops {stage}: {name} must be float32 of shape {tuple(x.shape[:-1])} "
                             f"(one value per row of x {tuple(x.shape)}); got {tuple(a.shape)} "
                             f"{_fmt_dtype(a.dtype)}")


def _check_stage_x(stage, x, mask, offset, causal, mask_kind):
    _fwd_abstract(x, mask, axis=-1, scale=1.0, log=False, causal=causal, mask_kind=mask_kind)
    if causal and x.ndim < 2:
        raise ValueError(f"jax_ops {stage}: causal needs x of rank >= 2; got {tuple(x.shape)}")
    if offset is not None and (not causal or offset.shape != () or offset.dtype != jnp.int32):
        raise ValueError(f"jax_ops {stage}: offset is the causal rule's int32 scalar; got "
                         f"{tuple(offset.shape)} {_fmt_dtype(offset.dtype)} with causal={causal}")


def _partials_abstract(x, mask, offset, *, scale, causal, mask_kind):
    _check_stage_x("softmax partials", x, mask, offset, causal, mask_kind)
    return _stage_rows(x), _stage_rows(x)


def _stage_logits(x, mask, offset, scale, causal, mask_kind):
    causal_at = None
    if causal:
        q, k_minus_q = _causal_dims(x.shape)
        causal_at = ((jnp.arange(q)[:, None], jnp.arange(x.shape[-1])[None, :]),
                     k_minus_q if offset is None else offset)
    return _logits(x, mask, scale=scale, mask_kind=mask_kind, causal_at=causal_at)


def _partials_reference(x, mask, offset, *, scale, causal, mask_kind):
    z = _stage_logits(x, mask, offset, scale, causal, mask_kind)
    m = jnp.max(z, axis=-1)
    shift = jnp.where(m == -jnp.inf, 0.0, m)
    return m, jnp.sum(jnp.exp(z - shift[..., None]), axis=-1)


def _apply_abstract(x, mask, offset, m, s, *, scale, log, causal, mask_kind):
    _check_stage_x("softmax apply", x, mask, offset, causal, mask_kind)
    _check_stage_rows("softmax apply", x, max=m, sum=s)
    return (core.ShapedArray(x.shape, x.dtype),)


def _apply_reference(x, mask, offset, m, s, *, scale, log, causal, mask_kind):
    """y from the whole row's max m and sum s (rows with s = 0 are fully masked)."""
    z = _stage_logits(x, mask, offset, scale, causal, mask_kind)
    shift = jnp.where(m == -jnp.inf, 0.0, m)[..., None]
    s = s[..., None]
    empty = s == 0.0
    if log:
        y = jnp.where(empty, -jnp.inf, (z - shift) - jnp.log(jnp.where(empty, 1.0, s)))
    else:
        y = jnp.where(empty, 0.0, jnp.exp(z - shift) / jnp.where(empty, 1.0, s))
    return (y.astype(x.dtype),)


def _bwd_partials_abstract(y, dy, *, log):
    _bwd_abstract(y, dy, axis=-1, scale=1.0, log=log)
    return (_stage_rows(y),)


def _bwd_partials_reference(y, dy, *, log):
    yf, dyf = y.astype(jnp.float32), dy.astype(jnp.float32)
    term = jnp.where(yf != -jnp.inf, dyf, 0.0) if log else dyf * yf
    return (jnp.sum(term, axis=-1),)


def _bwd_apply_abstract(y, dy, dot, *, scale, log):
    _bwd_abstract(y, dy, axis=-1, scale=scale, log=log)
    _check_stage_rows("softmax bwd apply", y, dot=dot)
    return (core.ShapedArray(y.shape, y.dtype),)


def _bwd_apply_reference(y, dy, dot, *, scale, log):
    yf, dyf, dot = y.astype(jnp.float32), dy.astype(jnp.float32), dot[..., None]
    if log:
        dz = jnp.where(yf != -jnp.inf, dyf - jnp.exp(yf) * dot, 0.0)
    else:
        dz = yf * (dyf - dot)
    return ((scale * dz).astype(y.dtype),)


PARTIALS = Stage("softmax_partials", "partials", ("x", "mask?", "offset?"), ("max", "sum"),
                 op_of=lambda p: "softmax", abstract=_partials_abstract, reference=_partials_reference)
APPLY = Stage("softmax_apply", "apply", ("x", "mask?", "offset?", "max", "sum"), ("y",),
              op_of=_op_of, abstract=_apply_abstract, reference=_apply_reference)
BWD_PARTIALS = Stage("softmax_bwd_partials", "bwd_partials", ("y", "dy"), ("dot",),
                     op_of=_op_of, abstract=_bwd_partials_abstract, reference=_bwd_partials_reference)
BWD_APPLY = Stage("softmax_bwd_apply", "bwd_apply", ("y", "dy", "dot"), ("dx",),
                  op_of=_op_of, abstract=_bwd_apply_abstract, reference=_bwd_apply_reference)


def _stage_ffi_call(target, call, x, mask, offset, extra, **attrs):
    xk, mask2, groups = _kernel_layout(x, mask, -1)
    m, mask_attrs = _kernel_mask(xk, mask2, groups)
    off = jnp.zeros((0,), _F32) if offset is None else offset
    outs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in call.out_avals]
    return tuple(jax.ffi.ffi_call(target, outs)(xk, m, off, *extra, **attrs, **mask_attrs))


def _cuda_partials(call, x, mask, offset, *, scale, causal, mask_kind):
    return _stage_ffi_call("jax_ops_softmax_partials", call, x, mask, offset, (),
                           scale=np.float32(scale), causal=bool(causal))


def _cuda_apply(call, x, mask, offset, m, s, *, scale, log, causal, mask_kind):
    return _stage_ffi_call("jax_ops_softmax_apply", call, x, mask, offset, (m, s),
                           scale=np.float32(scale), log=bool(log), causal=bool(causal))


_STAGE_KERNELS = {
    "partials": _cuda_partials,
    "apply": _cuda_apply,
    "bwd_partials": ffi("jax_ops_softmax_bwd_partials", lambda p: {"log": bool(p["log"])}),
    "bwd_apply": ffi("jax_ops_softmax_bwd_apply",
                     lambda p: {"scale": np.float32(p["scale"]), "log": bool(p["log"])}),
}


def _residuals(ops, outs, params):
    return (outs["y"],)


def _backward(res, cts, wanted, params, in_avals):
    (y,), dy = res, cts["y"]
    axis, scale, log = params["axis"], params["scale"], params["log"]
    grads = {}
    if "x" in wanted:
        (grads["x"],) = BWD.call(y, dy, axis=axis, scale=scale, log=log,
                                 implementation=params["implementation"])
    if "mask" in wanted:  # the logits' gradient, summed over the mask's broadcast axes
        mask = in_avals["mask"]
        over = tuple(i for i, (m, n) in enumerate(zip(mask.shape, y.shape)) if m == 1 and n != 1)
        dz = _logit_grad(y, dy, axis, log)
        grads["mask"] = jnp.sum(dz, axis=over, keepdims=True).astype(mask.dtype)
    return grads


SOFTMAX = Op(
    ("softmax", "log_softmax"), FWD, BWD,
    outputs=lambda p: ("y",), residuals=_residuals, backward=_backward,
    user_adapter=_user_adapter,
    stages=(PARTIALS, APPLY, BWD_PARTIALS, BWD_APPLY),
    impls={
        "cuda": Impl({"fwd": _cuda_fwd, "bwd": _cuda_bwd, **_STAGE_KERNELS},
                     supports=ffi_supports("jax_ops_softmax_fwd"), automatic=_last_axis_only,
                     load_words=(16,),  # 16-byte packs, else a value at a time
                     description="hand CUDA kernels through XLA FFI (host C++ on CPU)"),
        "pallas": Impl({"fwd": _pallas_fwd, "bwd": _pallas_bwd},
                       supports=pallas_supports(lambda q: pallas_softmax.supports(q.cols)),
                       configs=_pallas_configs, automatic=_last_axis_only,
                       description="Pallas kernels (Triton back end)"),
    },
    bench=lambda: softmax_specs(),  # the benchmark specs and
    patterns=lambda: softmax_patterns())  # the rewrite patterns: end of this module


# ------------------------------------------------------------- public API ---

def _combine_where(x, mask, where):
    """jax.nn's `where` (True = the entry takes part) folded into `mask`."""
    where = jnp.asarray(where)
    if where.dtype != jnp.bool_:
        raise TypeError(f"where must be a bool array; got dtype {_fmt_dtype(where.dtype)}")
    if mask is None:
        return where
    mask = jnp.asarray(mask)
    if mask.dtype == jnp.bool_:
        return mask & where
    return jnp.where(where, mask, -jnp.inf).astype(mask.dtype)  # an additive mask: -inf out


def _call(op, x, axis, scale, mask, causal, implementation, where=None):
    registry.check_name(op, implementation)
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        x = x.astype(jnp.float32)  # jax.nn promotes integer logits to the default float
    _check_x(op, x)
    if where is not None:
        try:
            mask = _combine_where(x, mask, where)
        except (TypeError, ValueError) as e:
            raise type(e)(f"jax_ops.{op}: {e}") from None
    if isinstance(axis, (tuple, list)):
        return _over_axes(op, x, tuple(axis), scale, mask, causal, implementation)
    axis = _normalize_axis(op, axis, x.ndim)
    scale = _check_scale(op, scale)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"jax_ops.{op}: causal must be a bool; got {type(causal).__name__}")
    if causal and (x.ndim < 2 or axis != -1):
        raise ValueError(f"jax_ops.{op}: causal=True needs x of shape (..., q, k) with the "
                         f"softmax over the last axis; got shape {tuple(x.shape)}, axis {axis}")
    mask = _prepare_mask(op, x, mask)
    if x.shape[axis] == 0 or x.size == 0:  # nothing to normalize
        return jnp.zeros(x.shape, x.dtype)
    implementation = implementation or registry.override_for(op)
    if mask is not None and mask.dtype != jnp.bool_:
        x, mask = match_vma(x, mask)
    return FWD.call(x, mask, axis=axis, scale=scale, log=op == "log_softmax", causal=bool(causal),
                    mask_kind=_mask_kind(mask), implementation=implementation)[0]


def _over_axes(op, x, axes, scale, mask, causal, implementation):
    """A softmax over several axes (jax.nn's tuple axis): those axes moved last and
    merged into one (a transposed copy; a mask is broadcast to x's shape)."""
    norm = sorted({_normalize_axis(op, a, x.ndim) % x.ndim for a in axes})
    if len(norm) != len(axes) or not axes:
        raise ValueError(f"jax_ops.{op}: axis must name distinct axes; got {axes}")
    if causal:
        raise ValueError(f"jax_ops.{op}: causal=True needs one axis (the last); got axis {axes}")
    if len(norm) == 1:
        return _call(op, x, norm[0], scale, mask, causal, implementation)
    rest = [i for i in range(x.ndim) if i not in norm]
    perm = rest + norm
    moved = jnp.transpose(x, perm)
    merged = moved.shape[:len(rest)] + (math.prod(moved.shape[len(rest):]),)
    if mask is not None:
        mask = _prepare_mask(op, x, mask)
        mask = jnp.transpose(jnp.broadcast_to(mask, x.shape), perm).reshape(merged)
    y = _call(op, moved.reshape(merged), -1, scale, mask, False, implementation)
    return jnp.transpose(y.reshape(moved.shape), np.argsort(perm))


def softmax(x, axis: int | tuple[int, ...] = -1, where=None, *, scale: float | None = None,
            mask=None, causal: bool = False, implementation: str | None = None):
    """Softmax of x * scale along `axis`, with an optional mask; like jax.nn.softmax.

    Args:
      x: float32, bfloat16 or float16 array, rank >= 1 (integers are promoted to
        float32, as jax.nn does).
      axis: the axis to normalize over (any; the kernels prefer the last), or a tuple of
        axes (normalized together, as jax.nn does: they are moved last and merged, a
        transposed copy).
      where: like jax.nn's: a bool array broadcastable to x, True = the entry takes part;
        the others give 0 (log_softmax: -inf) and get no gradient. Combined with `mask`.
      scale: a real number multiplying the logits first (e.g. 1/sqrt(head_dim)).
      mask: bool array (True = keep) or floating array added to the scaled logits,
        broadcastable to x. A floating mask gets a gradient.
      causal: x is (..., q, k) and axis the last: keep column j of query row i iff
        j <= i + (k - q) (bottom-right aligned; with q > k the first q - k rows are
        fully masked).
      implementation: None (automatic), "xla", "cuda" or "pallas".

    Math runs in float32; the result has x's dtype. Rows with every logit masked
    give zeros (not NaN).
    """
    return _call("softmax", x, axis, scale, mask, causal, implementation, where)


def log_softmax(x, axis: int | tuple[int, ...] = -1, where=None, *, scale: float | None = None,
                mask=None, causal: bool = False, implementation: str | None = None):
    """LogSoftmax of x * scale along `axis`; same arguments as `softmax`. Masked
    entries, and every entry of fully masked rows, are -inf (their gradient is 0)."""
    return _call("log_softmax", x, axis, scale, mask, causal, implementation, where)


# ------------------------------------------------------------- softmax family: benchmark specs (jax_ops.bench) ---
# Kernels call softmax / log_softmax on the (B, Q, cols) view for the masked
# variants and reshape y back to (rows, cols) (free: a bitcast).

SOFTMAX_X_SCALE = 4.0            # softmax inputs: x = 4 * N(0, 1), peaked rows
MASK_KEEP = 0.9                  # softmax_mask: P(mask element is True)
MASK_Q_CAP, CAUSAL_Q_CAP = 512, 2048  # Q of the (rows // Q, Q, cols) views, at most


def softmax_specs() -> dict[str, BenchSpec]:
    """Benchmarks of the softmax family: softmax, log_softmax, softmax_mask, softmax_causal."""

    def softmax_inputs(kx, kp, kq, dtype, rows, cols):
        return SOFTMAX_X_SCALE * jax.random.normal(kx, (rows, cols), dtype), ()

    def mask_inputs(kx, kp, kq, dtype, rows, cols):
        """x and a key-padding mask (B, 1, cols), True = keep (~90%), never a fully masked
        row (column 0 always kept)."""
        x, _ = softmax_inputs(kx, kp, kq, dtype, rows, cols)
        b = rows // view_len(rows, cols, MASK_Q_CAP)
        keep = jax.random.bernoulli(kp, MASK_KEEP, (b, 1, cols)).at[..., 0].set(True)
        return x, (keep,)

    def softmax_kernel(log: bool = False, masked: bool = False, causal: bool = False) -> Callable:
        def make(impl):
            def fn(x, *mask):
                rows, cols = x.shape
                op = log_softmax if log else softmax  # looked up at call time
                if masked:
                    y = op(x.reshape(mask[0].shape[0], -1, cols), mask=mask[0], implementation=impl)
                elif causal:
                    q = view_len(rows, cols, CAUSAL_Q_CAP)
                    y = op(x.reshape(rows // q, q, cols), causal=True, implementation=impl)
                else:
                    y = op(x, axis=-1, implementation=impl)
                return y.reshape(rows, cols)
            return fn
        return make

    def jnp_softmax(log: bool = False, masked: bool = False, causal: bool = False) -> Callable:
        """dtype -> plain jax.nn (log_)softmax on float32 logits, -inf where masked, output
        in x's dtype; differentiated by JAX autodiff."""
        def fn(x, *mask):
            rows, cols = x.shape
            z = x.astype(jnp.float32)
            if masked:
                z = jnp.where(mask[0], z.reshape(mask[0].shape[0], -1, cols), -jnp.inf)
            elif causal:
                q = view_len(rows, cols, CAUSAL_Q_CAP)
                keep = jnp.tril(jnp.ones((q, cols), bool), cols - q)  # j <= i + (cols - q)
                z = jnp.where(keep, z.reshape(rows // q, q, cols), -jnp.inf)
            y = (jax.nn.log_softmax if log else jax.nn.softmax)(z, axis=-1)
            return y.astype(x.dtype).reshape(rows, cols)
        return lambda dtype: fn

    def softmax_bytes(mask_cap: int | None = None) -> Callable:
        def nbytes(rows, cols, itemsize):
            x = rows * cols * itemsize
            m = 0 if mask_cap is None else rows // view_len(rows, cols, mask_cap) * cols  # bool
            fwd, bwd = 2 * x + m, 3 * x  # bwd: read y and dy, write dx
            return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}
        return nbytes

    def spec(log: bool = False, masked: bool = False, causal: bool = False) -> BenchSpec:
        flags = dict(log=log, masked=masked, causal=causal)
        common = dict(kernel=softmax_kernel(**flags), reference=jnp_softmax(**flags),
                      diff_params=False)
        if masked:
            return BenchSpec(make_inputs=mask_inputs, nbytes=softmax_bytes(MASK_Q_CAP),
                             unmasked="softmax", view_cap=MASK_Q_CAP,
                             table_alias=("softmax", "fwd_mask"),
                             title=f" as (B, Q, cols), Q = min(cols, {MASK_Q_CAP}), "
                                   f"mask (B, 1, cols) {MASK_KEEP:.0%} True", **common)
        if causal:
            return BenchSpec(make_inputs=softmax_inputs, nbytes=softmax_bytes(),
                             unmasked="softmax", view_cap=CAUSAL_Q_CAP,
                             title=f" as (B, Q, cols), Q = min(cols, {CAUSAL_Q_CAP}), causal",
                             **common)
        return BenchSpec(make_inputs=softmax_inputs, nbytes=softmax_bytes(),
                         table_stages=("fwd", "bwd"), xla_summary=True, **common)

    return {"softmax": spec(), "log_softmax": spec(log=True),
            "softmax_mask": spec(masked=True), "softmax_causal": spec(causal=True)}


# ------------------------------------------------- softmax family: rewrite patterns (jax_ops.fx) ---
# jax.nn.softmax/log_softmax differ from these ops only where a row is all -inf
# (jax.nn: NaN, jax_ops: 0 / -inf) and in rounding (jax_ops computes in float32).
# where= is not matched: our mask differs on fully masked rows.

def _softmax_ref(x, *, axis):
    return jax.nn.softmax(x, axis=axis)


def _scaled_softmax_ref(x, *, scale, axis):
    return jax.nn.softmax(x * scale, axis=axis)


def _log_softmax_ref(x, *, axis):
    return jax.nn.log_softmax(x, axis=axis)


def _scaled_log_softmax_ref(x, *, scale, axis):
    return jax.nn.log_softmax(x * scale, axis=axis)


def _axis_static(avals, out_aval):
    """Template: the last axis. Verification: every axis (the re-trace decides)."""
    if out_aval is None:
        return [{"axis": -1}]
    return [{"axis": a} for a in range(-1, -len(avals[0].shape) - 1, -1)]


def _softmax_pattern(log: bool, scaled: bool) -> Pattern:
    op = log_softmax if log else softmax
    ref = {(False, False): _softmax_ref, (False, True): _scaled_softmax_ref,
           (True, False): _log_softmax_ref, (True, True): _scaled_log_softmax_ref}[log, scaled]
    name = ("log_softmax" if log else "softmax") + ("_scaled" if scaled else "")

    def replacement(x, *, axis, scale=None, **_):
        return op(x, axis=axis, scale=scale)
    examples = [(sds(s, d),) for s in ((8,), (4, 8)) for d in (_F32, BF16)]
    return Pattern(name, [Formulation(ref, _axis_static, f"jax.nn.{'log_' if log else ''}softmax")],
                   replacement, examples, params={"scale": 1.0} if scaled else {},
                   accepts=accepts_x)


def softmax_patterns() -> list[Pattern]:
    """log_softmax, softmax, each after its scaled form (`*_scaled`: of x * s), which
    contains it."""
    return [_softmax_pattern(True, True), _softmax_pattern(True, False),
            _softmax_pattern(False, True), _softmax_pattern(False, False)]
