"""LayerNorm and RMSNorm over the last axis, plain or fused with a residual add:
the declaration (core/op.py) of layer_norm, rms_norm, add_layer_norm, add_rms_norm.

Forward stage  jax_ops_norm_fwd(x, residual?, scale?, bias?) -> (y, h?, mean?, rstd?)
Backward stage jax_ops_norm_bwd(dy, dh?, x, mean?, rstd, scale?) -> (dx, dscale?, dbias?)
With the normalized axis sharded the per-device code (`_fwd_local`, `_bwd_local`) binds
four more stages (partials, apply, bwd_partials, bwd_apply: "hidden-sharded stages"
below) and combines their per-row partials across devices.

Absent operands/results (no residual, no scale, no bias, statistics not wanted,
RMSNorm's mean) are not bound. With a residual (add+norm) the forward also returns
h = x + residual rounded to x's dtype and normalizes h; the backward's x is then h and
dx = norm_backward(dy, h) + dh (dh: h's cotangent; the gradient of x and of residual).
Which op a call is: `present` (the framework's operand-presence param): residual (fwd)
or dh (bwd) present -> add_*; a backward without dh is the plain norm's.
Statistics and arithmetic are float32; y, h and dx take x's dtype, dscale/dbias their
parameter's dtype. Reverse mode keeps x (h for add+norm), float32 mean/rstd per row and
the parameters; the CUDA backward gets a float32 workspace for its per-block
dscale/dbias partials (XLA allocates it and drops it right after).
"""
from __future__ import annotations

import math

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from jax_ops import _extension
from jax_ops.core import registry
from jax_ops.core.benchspec import BenchSpec
from jax_ops.core.validate import check_epsilon, check_vectors, check_x
from jax_ops.core.op import (Impl, Op, Stage, ffi, ffi_supports, local_uses_kernels,
                             match_vma, pallas_supports, vmap_reference)
from jax_ops.core.sharding import gather_parts, merge_moments, ordered_sum
from jax_ops.core.pattern import (BF16, OP_DTYPES, Formulation, Pattern, accepts_x,
                                  flax_available, flax_linen_normalize, out_dtypes, sds,
                                  wider_x)
from jax_ops.core.validate import dtype_name as _fmt_dtype
from pallas_kernels import layer_norm as pallas_norm

_F32 = jnp.dtype(jnp.float32)


# ------------------------------------------------------------- validation ---

def check_inputs(op: str, x, scale, bias, epsilon=None) -> None:
    """TypeError/ValueError naming the argument, expected and actual value."""
    check_x(op, x, min_rank=1, rank_rule="at least 1 dimension (normalization runs over the last axis)")
    check_vectors(op, x, scale=scale, bias=bias)
    if epsilon is not None:
        check_epsilon(op, epsilon)


def check_residual(op: str, x, residual) -> None:
    """add+norm: residual must have x's shape and dtype (after check_inputs on x)."""
    if tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype:
        raise ValueError(f"jax_ops.{op}: residual must have x's shape {tuple(x.shape)} and dtype "
                         f"{_fmt_dtype(x.dtype)}; got shape {tuple(residual.shape)} and dtype "
                         f"{_fmt_dtype(residual.dtype)}")


def _stat_shape(x):
    return x.shape[:-1]


def _name(rms, add) -> str:
    return ("add_" if add else "") + ("rms_norm" if rms else "layer_norm")


# ---------------------------------------------------------------- forward ---

def _fwd_abstract(x, residual, scale, bias, *, epsilon, rms, with_stats):
    op = _name(rms, residual is not None)
    check_inputs(op, x, scale, bias)
    h = None
    if residual is not None:
        check_residual(op, x, residual)
        h = core.ShapedArray(x.shape, x.dtype)
    stat = core.ShapedArray(_stat_shape(x), _F32) if with_stats else None
    return core.ShapedArray(x.shape, x.dtype), h, (None if rms else stat), stat


def _row_sums(*arrays):
    """Sums over the last axis (the normalized one)."""
    return tuple(jnp.sum(a, axis=-1) for a in arrays)


def _f32(a):
    """a as float32, keeping a 16-bit a's rounding. XLA's excess precision
    (xla_allow_excess_precision, on by default) drops the rounding of a 16-bit value
    computed in float32 and used as float32 again — add+norm's h, within the forward
    and where the backward fuses with it; reduce_precision (exact on 16-bit values, so
    a no-op otherwise) keeps it. Subnormals flush to zero there: far below y's and dx's
    precision."""
    f = a.astype(jnp.float32)
    if a.dtype != jnp.float32:
        fi = jnp.finfo(a.dtype)
        f = jax.lax.reduce_precision(f, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    return f


def add_rounded(x, residual):
    """h = x + residual in x's dtype (jnp's sum, rounded once) and h as float32."""
    h = x + residual
    return h, _f32(h)


def _fwd_reference(x, residual, scale, bias, *, epsilon, rms, with_stats, row_sums=_row_sums,
                   cols=None):
    """row_sums/cols: the sums over whole rows and the row length, when x holds only
    some of each row's columns (the normalized axis sharded: the sums are psum'ed)."""
    h = None
    if residual is not None:  # add+norm: the sum rounded once to x's dtype, then normalized
        h, xf = add_rounded(x, residual)
        x = h
    else:
        xf = x.astype(jnp.float32)
    cols = x.shape[-1] if cols is None else cols
    if rms:
        mean = jnp.zeros(_stat_shape(x), jnp.float32)
        (ss,) = row_sums(jnp.square(xf))
        rstd = jax.lax.rsqrt(ss / cols + epsilon)
    else:  # two-pass: the mean, then the squares about it
        (s1,) = row_sums(xf)
        mean = s1 / cols
        (ss,) = row_sums(jnp.square(xf - mean[..., None]))
        rstd = jax.lax.rsqrt(ss / cols + epsilon)
    y = (xf - mean[..., None]) * rstd[..., None]
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return (y.astype(x.dtype), h, mean if (with_stats and not rms) else None,
            rstd if with_stats else None)


def _batch_front(args, dims):
    """The batch axis of each row operand moved to the front; unbatched ones (an
    unbatched x or residual beside a batched one) broadcast to it."""
    size = next(a.shape[d] for a, d in zip(args, dims) if a is not None and d is not None)
    return lambda a, d: (None if a is None else jnp.moveaxis(a, d, 0) if d is not None
                         else jnp.broadcast_to(a, (size,) + a.shape))


def _fwd_batch(stage, args, dims, **params):
    x, residual, scale, bias = args
    xd, rd, sd, bd = dims
    if sd is not None or bd is not None:  # per-example parameters: rows cannot be folded
        return vmap_reference(stage, args, dims, **params)
    # A batched x is just more leading (row) axes: move the batch axis to the front.
    front = _batch_front(args, dims)
    outs = stage.call(front(x, xd), front(residual, rd), scale, bias, **params)
    return outs, [None if o is None else 0 for o in outs]


def _fwd_op_of(params) -> str:  # operands: x, residual?, scale?, bias?
    return _name(params["rms"], params["present"][1])


def _bwd_op_of(params) -> str:  # operands: dy, dh?, x, mean?, rstd, scale?
    return _name(params["rms"], params["present"][1])


def _hidden_sharded(layout, params):
    return bool(layout.col_axes)


def _fwd_local(layout, mesh, x, residual, scale, bias, *, implementation, **params):
    """Per device, the normalized axis sharded. With kernels (cuda, or automatic picking
    them): PARTIALS writes each row's local mean/M2 (RMSNorm: Σx²; add+norm also h), one
    all_gather over the column axes brings every device's (O(rows × devices) floats),
    merged exactly in device order (Chan), then APPLY normalizes the local columns.
    With xla: jnp, per-row partial sums psum'ed over the column axes (Σx, then
    Σ(x − mean)²; O(rows) each)."""
    if not local_uses_kernels(
            mesh, (FWD, (x, residual, scale, bias), dict(params, implementation=implementation)),
            (PARTIALS, (x, residual), dict(rms=params["rms"], implementation=implementation))):
        def row_sums(*a):
            return jax.lax.psum(_row_sums(*a), layout.col_axes)
        return _fwd_reference(x, residual, scale, bias, row_sums=row_sums, cols=layout.shape[-1],
                              **params)
    rms, epsilon, cols = params["rms"], params["epsilon"], layout.shape[-1]
    mean_local, m2_local, h = PARTIALS.call(x, residual, rms=rms, implementation=implementation)
    if rms:
        mean, m2 = None, ordered_sum(gather_parts([m2_local], layout.col_axes)[0])
    else:
        mean, m2 = merge_moments(mean_local, m2_local, layout.col_axes, x.shape[-1])
    rstd = jax.lax.rsqrt(m2 / cols + epsilon)
    (y,) = APPLY.call(x if h is None else h, mean, rstd, scale, bias, implementation=implementation)
    stats = params["with_stats"]
    return y, h, mean if stats else None, rstd if stats else None


def _bwd_local(layout, mesh, dy, dh, x, mean, rstd, scale, *, implementation, **params):
    """Per device, the normalized axis sharded. With kernels: BWD_PARTIALS writes Σg and
    Σg·x̂ of the local columns per row, one all_gather over the column axes and an
    in-order sum make the whole rows', BWD_APPLY writes dx and the local rows' float32
    dscale/dbias. With xla: jnp, one psum of (Σg·x̂, Σg) per row. Either way
    dscale/dbias (local columns) are psum'ed over the row axes."""
    rows = tuple(range(x.ndim - 1))

    def col_total(a):
        return jax.lax.psum(a, layout.row_axes) if layout.row_axes else a

    if not local_uses_kernels(
            mesh, (BWD, (dy, dh, x, mean, rstd, scale), dict(params, implementation=implementation)),
            (BWD_PARTIALS, (dy, x, mean, rstd, scale), dict(rms=params["rms"],
                                                            implementation=implementation))):
        def row_sums(*a):
            return jax.lax.psum(_row_sums(*a), layout.col_axes)
        return _bwd_reference(dy, dh, x, mean, rstd, scale, row_sums=row_sums, cols=layout.shape[-1],
                              col_sums=lambda a: col_total(jnp.sum(a, axis=rows)), **params)
    rms, ds_dtype, db_dtype = params["rms"], params["dscale_dtype"], params["dbias_dtype"]
    sum_g, sum_gx = BWD_PARTIALS.call(dy, x, mean, rstd, scale, rms=rms, implementation=implementation)
    sums = [ordered_sum(p) for p in gather_parts([sum_gx] if rms else [sum_g, sum_gx], layout.col_axes)]
    sum_g, sum_gx = (None, sums[0]) if rms else sums
    dx, dscale, dbias = BWD_APPLY.call(dy, dh, x, mean, rstd, scale, sum_g, sum_gx, rms=rms,
                                       inv_n=1.0 / layout.shape[-1], want_dscale=bool(ds_dtype),
                                       want_dbias=bool(db_dtype), implementation=implementation)
    return (dx, None if dscale is None else col_total(dscale).astype(ds_dtype),
            None if dbias is None else col_total(dbias).astype(db_dtype))


# --------------------------------------------------------------- backward ---

def _static_rows(x_shape):
    """The row count, or -1 while it is symbolic (jax.export)."""
    rows = math.prod(x_shape[:-1])
    return rows if isinstance(rows, int) else -1


def cuda_workspace_rows(x_shape, x_dtype, param_dtype, *, rms, add, dscale, dbias,
                        platform="cuda") -> int:
    """Rows P of the CUDA backward's [arrays, P, cols] float32 dscale/dbias partials (an
    array for each of dscale and dbias that is wanted).

    On a GPU: the grid the backward launches there (its resident blocks or clusters),
    asked of the extension's launchers at lowering, so the workspace holds exactly the
    partial rows written (a few MiB: e.g. 132-264 rows at 4096 columns). When no GPU
    answers (exported for CUDA from a CPU machine): a bound, up to 4096 rows and
    128 MiB; the kernels cap their grid at P either way. The CPU handlers sum in
    float64 and use no partials: 1 row."""
    cols = x_shape[-1]
    if platform != "cuda":
        return 1
    rows = _static_rows(x_shape)
    n = _extension.norm_bwd_partial_rows(jnp.dtype(x_dtype).name, jnp.dtype(param_dtype).name, rows,
                                         cols, rms=rms, add=add, dscale=dscale, dbias=dbias)
    if n is None:
        n = min(4096, (128 << 20) // (8 * cols))
        if rows >= 0:
            n = min(n, rows)
    return max(1, n)


def _bwd_abstract(dy, dh, x, mean, rstd, scale, *, rms, dscale_dtype, dbias_dtype):
    for name, d in (("dy", dy), ("dh", dh)):
        if d is not None and (d.shape != x.shape or d.dtype != x.dtype):
            raise ValueError(f"jax_ops norm backward: {name} must match x; got {name} {d.shape} "
                             f"{_fmt_dtype(d.dtype)} and x {x.shape} {_fmt_dtype(x.dtype)}")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"jax_ops norm backward: x must have a last axis of size >= 1; got shape {x.shape}")
    cols = x.shape[-1]
    if dscale_dtype and dbias_dtype and jnp.dtype(dscale_dtype) != jnp.dtype(dbias_dtype):
        raise TypeError(f"jax_ops norm backward: dscale and dbias must share a dtype; got "
                        f"{_fmt_dtype(dscale_dtype)} and {_fmt_dtype(dbias_dtype)}")
    dscale = core.ShapedArray((cols,), dscale_dtype) if dscale_dtype else None
    dbias = core.ShapedArray((cols,), dbias_dtype) if dbias_dtype else None
    return core.ShapedArray(x.shape, x.dtype), dscale, dbias


def _bwd_reference(dy, dh, x, mean, rstd, scale, *, rms, dscale_dtype, dbias_dtype,
                   row_sums=_row_sums, cols=None, col_sums=None):
    """row_sums/cols as in _fwd_reference; col_sums(a): a's sum over all rows (psum'ed
    over the devices holding other rows when the rows are sharded). add+norm: x is h,
    and dh is added to dx (in float32, rounded once)."""
    xf, dyf = _f32(x), dy.astype(jnp.float32)
    cols = x.shape[-1] if cols is None else cols
    mean = 0.0 if rms else mean[..., None]
    xhat = (xf - mean) * rstd[..., None]
    g = dyf * scale.astype(jnp.float32) if scale is not None else dyf
    if rms:
        (sgx,) = row_sums(g * xhat)
        mean_g = 0.0
    else:
        sgx, sg = row_sums(g * xhat, g)
        mean_g = (sg / cols)[..., None]
    mean_gx = (sgx / cols)[..., None]
    dx = rstd[..., None] * (g - mean_g - xhat * mean_gx)
    if dh is not None:
        dx = dx + dh.astype(jnp.float32)
    rows = tuple(range(x.ndim - 1))
    if col_sums is None:
        col_sums = lambda a: jnp.sum(a, axis=rows)  # noqa: E731
    dscale = col_sums(dyf * xhat).astype(dscale_dtype) if dscale_dtype else None
    dbias = col_sums(dyf).astype(dbias_dtype) if dbias_dtype else None
    return dx.astype(x.dtype), dscale, dbias


def _bwd_batch(stage, args, dims, **params):
    dy, dh, x, mean, rstd, scale = args
    if dims[5] is not None:  # per-example scale
        return vmap_reference(stage, args, dims, **params)
    front = _batch_front(args, dims)  # batch axis first; unbatched row operands broadcast
    dy, dh, x, rstd = front(dy, dims[0]), front(dh, dims[1]), front(x, dims[2]), front(rstd, dims[4])
    if not params["rms"]:
        mean = front(mean, dims[3])
    # dx: batch folded into rows. dscale/dbias are per example under vmap, so
    # they are summed per batch element here instead of over all rows.
    dx, _, _ = stage.call(dy, dh, x, mean, rstd, scale, rms=params["rms"], dscale_dtype=None,
                          dbias_dtype=None, implementation=params["implementation"])
    rows = tuple(range(1, x.ndim - 1))
    dyf = dy.astype(jnp.float32)
    dscale = dbias = None
    if params["dscale_dtype"]:
        m = 0.0 if params["rms"] else mean[..., None]
        xhat = (_f32(x) - m) * rstd[..., None]
        dscale = jnp.sum(dyf * xhat, axis=rows).astype(params["dscale_dtype"])
    if params["dbias_dtype"]:
        dbias = jnp.sum(dyf, axis=rows).astype(params["dbias_dtype"])
    return (dx, dscale, dbias), (0, 0 if dscale is not None else None, 0 if dbias is not None else None)


# --------------------------------------------------------- implementations ---

def _rows_cols(shape):
    return int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]


def _pallas_fwd(call, x, residual, scale, bias, *, epsilon, rms, with_stats):
    rows, cols = _rows_cols(x.shape)
    y, h, mean, rstd = pallas_norm.norm_fwd(
        x.reshape(rows, cols), scale, bias, epsilon=epsilon, rms=rms, with_stats=with_stats,
        residual=None if residual is None else residual.reshape(rows, cols),
        config=call.config, interpret=call.interpret)
    stat = x.shape[:-1]
    return (y.reshape(x.shape), None if h is None else h.reshape(x.shape),
            None if mean is None else mean.reshape(stat), None if rstd is None else rstd.reshape(stat))


def _pallas_bwd(call, dy, dh, x, mean, rstd, scale, *, rms, dscale_dtype, dbias_dtype):
    rows, cols = _rows_cols(x.shape)
    # [2, P, cols] float32 partials, P = the programs that write them.
    ws = ((2, pallas_norm.bwd_programs(rows, cols, call.config) if isinstance(rows, int)
           else pallas_norm.default_config(1, cols, "bwd")["programs"], cols)
          if (dscale_dtype or dbias_dtype) else (0,))
    dx, dscale, dbias, _ = pallas_norm.norm_bwd(
        dy.reshape(rows, cols), x.reshape(rows, cols), None if rms else mean.reshape(rows),
        rstd.reshape(rows), scale, rms=rms, work_shape=ws,
        dh=None if dh is None else dh.reshape(rows, cols), config=call.config,
        interpret=call.interpret)
    return (dx.reshape(x.shape), dscale.astype(dscale_dtype) if dscale_dtype else None,
            dbias.astype(dbias_dtype) if dbias_dtype else None)


def _workspace(call, operands, params):
    dy, dh, x, mean, rstd, scale = operands
    dscale, dbias = params["dscale_dtype"], params["dbias_dtype"]
    if not (dscale or dbias):
        return core.ShapedArray((0,), _F32)
    # The handlers' parameter dtype: scale's, else dbias's, else float32.
    pdtype = scale.dtype if scale is not None else (dbias or _F32)
    p = cuda_workspace_rows(x.shape, x.dtype, pdtype, rms=params["rms"], add=dh is not None,
                            dscale=bool(dscale), dbias=bool(dbias), platform=call.platform)
    return core.ShapedArray((bool(dscale) + bool(dbias), p, x.shape[-1]), _F32)


def _pallas_configs(q):
    return pallas_norm.candidate_configs(max(q.rows or 1, 1), q.cols, q.stage)


def _user_adapter(fn, backward, tunable):
    """register_implementation's adapter (signatures in layer_norm's docstring):
    fn(x2d, scale[, bias], *, epsilon[, config]) -> y or (y[, mean], rstd);
    backward(dy2d, x2d, mean | None, rstd, scale, [config]) -> (dx, dscale[, dbias]).
    add_layer_norm/add_rms_norm take the same plain-norm kernels: h = x + residual and
    dx + dh are jnp around them."""
    def fwd(call, x, residual, scale, bias, *, epsilon, rms, with_stats):
        h = None
        if residual is not None:
            h = x = x + residual
        rows, cols = _rows_cols(x.shape)
        kw = {"config": call.config} if tunable else {}
        out = fn(x.reshape(rows, cols), *([scale] if rms else [scale, bias]), epsilon=epsilon, **kw)
        y = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(out, (tuple, list)) and with_stats:  # the kernel's own statistics
            mean = None if rms else jnp.asarray(out[1], jnp.float32).reshape(x.shape[:-1])
            rstd = jnp.asarray(out[-1], jnp.float32).reshape(x.shape[:-1])
        else:  # statistics by jnp where reverse mode needs them; XLA drops the unused y
            _, _, mean, rstd = _fwd_reference(x, None, scale, bias, epsilon=epsilon, rms=rms,
                                              with_stats=with_stats)
        return jnp.asarray(y).astype(x.dtype).reshape(x.shape), h, mean, rstd

    def bwd(call, dy, dh, x, mean, rstd, scale, *, rms, dscale_dtype, dbias_dtype):
        rows, cols = _rows_cols(x.shape)
        kw = {"config": call.config} if tunable else {}
        out = backward(dy.reshape(rows, cols), x.reshape(rows, cols),
                       None if rms else mean.reshape(rows), rstd.reshape(rows), scale, **kw)
        dx, dscale = out[0], out[1]
        dbias = None if rms else out[2]
        dx = jnp.asarray(dx).reshape(x.shape)
        if dh is not None:
            dx = dx.astype(jnp.float32) + dh.astype(jnp.float32)
        return (dx.astype(x.dtype),
                jnp.asarray(dscale).astype(dscale_dtype) if dscale_dtype else None,
                jnp.asarray(dbias).astype(dbias_dtype) if dbias_dtype else None)

    return {"fwd": fwd, **({"bwd": bwd} if backward is not None else {})}


# ----------------------------------------------------------- declaration ---

FWD = Stage("norm_fwd", "fwd", ("x", "residual?", "scale?", "bias?"), ("y", "h?", "mean?", "rstd?"),
                 op_of=_fwd_op_of, abstract=_fwd_abstract, reference=_fwd_reference, batch=_fwd_batch,
                 roles={"x": "x", "residual": "x", "scale": "cols", "bias": "cols", "y": "x", "h": "x",
                        "mean": "rows", "rstd": "rows"},
                 needs_local=_hidden_sharded, local=_fwd_local,
                 variant=lambda p: "stats" if p["with_stats"] else "")
BWD = Stage("norm_bwd", "bwd", ("dy", "dh?", "x", "mean?", "rstd", "scale?"), ("dx", "dscale?", "dbias?"),
                 op_of=_bwd_op_of, abstract=_bwd_abstract, reference=_bwd_reference, batch=_bwd_batch,
                 roles={"dy": "x", "dh": "x", "x": "x", "mean": "rows", "rstd": "rows", "scale": "cols",
                        "dx": "x", "dscale": "colsum", "dbias": "colsum"},
                 needs_local=_hidden_sharded, local=_bwd_local)


# ------------------------------------------------ hidden-sharded stages (issue 23) ---
# Per-device stages of `_fwd_local`/`_bwd_local` (the normalized axis split over
# devices; bound only there, on the local shards): per-row partials of the local
# columns, combined across devices by the local, then the pass that finishes with the
# combined statistics. Statistics and sums are float32 per row (x's shape without the
# last axis). Kernels: "cuda" (CUDA; the host handlers on CPU); "xla" runs the
# references; no Pallas kernels (a pallas call gets the automatic choice for them).
#   jax_ops_norm_partials(x, residual?) -> (mean?, m2, h?)     mean absent for RMSNorm (m2 = Σx²)
#   jax_ops_norm_apply(x, mean?, rstd, scale?, bias?) -> (y,)
#   jax_ops_norm_bwd_partials(dy, x, mean?, rstd, scale?) -> (sum_g?, sum_gx)
#   jax_ops_norm_bwd_apply(dy, dh?, x, mean?, rstd, scale?, sum_g?, sum_gx)
#       -> (dx, dscale?, dbias?)   params inv_n (1 / the whole row's length), want_dscale,
#                                  want_dbias; dscale/dbias float32 sums over the local rows

def _check_rows(stage, x, **arrays):
    for name, a in arrays.items():
        if a is not None and (tuple(a.shape) != tuple(x.shape[:-1]) or a.dtype != _F32):
            raise ValueError(f"jax_ops {stage}: {name} must be float32 of shape {tuple(x.shape[:-1])} "
                             f"(one value per row of x {tuple(x.shape)}); got {tuple(a.shape)} "
                             f"{_fmt_dtype(a.dtype)}")


def _check_like(stage, x, **arrays):
    for name, a in arrays.items():
        if a is not None and (tuple(a.shape) != tuple(x.shape) or a.dtype != x.dtype):
            raise ValueError(f"jax_ops {stage}: {name} must match x {tuple(x.shape)} "
                             f"{_fmt_dtype(x.dtype)}; got {tuple(a.shape)} {_fmt_dtype(a.dtype)}")


def _stage_x(stage, x, scale=None, bias=None):
    check_inputs(stage, x, scale, bias)
    if x.shape[-1] < 1:
        raise ValueError(f"jax_ops {stage}: x must have a last axis of size >= 1; got shape {x.shape}")


def _partials_abstract(x, residual, *, rms):
    _stage_x("norm partials", x)
    _check_like("norm partials", x, residual=residual)
    rows = core.ShapedArray(_stat_shape(x), _F32)
    return (None if rms else rows), rows, (None if residual is None else core.ShapedArray(x.shape, x.dtype))


def _partials_reference(x, residual, *, rms):
    h = None
    if residual is not None:
        h, xf = add_rounded(x, residual)
    else:
        xf = x.astype(jnp.float32)
    if rms:
        return None, jnp.sum(jnp.square(xf), axis=-1), h
    mean = jnp.mean(xf, axis=-1)
    return mean, jnp.sum(jnp.square(xf - mean[..., None]), axis=-1), h


def _apply_abstract(x, mean, rstd, scale, bias):
    _stage_x("norm apply", x, scale, bias)
    _check_rows("norm apply", x, mean=mean, rstd=rstd)
    return (core.ShapedArray(x.shape, x.dtype),)


def _apply_reference(x, mean, rstd, scale, bias):
    y = (_f32(x) - (0.0 if mean is None else mean[..., None])) * rstd[..., None]
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return (y.astype(x.dtype),)


def _bwd_partials_abstract(dy, x, mean, rstd, scale, *, rms):
    _stage_x("norm bwd partials", x, scale)
    _check_like("norm bwd partials", x, dy=dy)
    _check_rows("norm bwd partials", x, mean=mean, rstd=rstd)
    rows = core.ShapedArray(_stat_shape(x), _F32)
    return (None if rms else rows), rows


def _xhat_g(dy, x, mean, rstd, scale):
    dyf = dy.astype(jnp.float32)
    xhat = (_f32(x) - (0.0 if mean is None else mean[..., None])) * rstd[..., None]
    return dyf, xhat, (dyf * scale.astype(jnp.float32) if scale is not None else dyf)


def _bwd_partials_reference(dy, x, mean, rstd, scale, *, rms):
    _, xhat, g = _xhat_g(dy, x, mean, rstd, scale)
    return (None if rms else jnp.sum(g, axis=-1)), jnp.sum(g * xhat, axis=-1)


def _bwd_apply_abstract(dy, dh, x, mean, rstd, scale, sum_g, sum_gx, *, rms, inv_n, want_dscale,
                        want_dbias):
    _stage_x("norm bwd apply", x, scale)
    _check_like("norm bwd apply", x, dy=dy, dh=dh)
    _check_rows("norm bwd apply", x, mean=mean, rstd=rstd, sum_g=sum_g, sum_gx=sum_gx)
    if want_dscale and scale is None:
        raise ValueError("jax_ops norm bwd apply: want_dscale needs scale")
    col = core.ShapedArray(x.shape[-1:], _F32)
    return (core.ShapedArray(x.shape, x.dtype), col if want_dscale else None, col if want_dbias else None)


def _bwd_apply_reference(dy, dh, x, mean, rstd, scale, sum_g, sum_gx, *, rms, inv_n, want_dscale,
                         want_dbias):
    dyf, xhat, g = _xhat_g(dy, x, mean, rstd, scale)
    mean_g = 0.0 if sum_g is None else (sum_g * inv_n)[..., None]
    dx = rstd[..., None] * (g - mean_g - xhat * (sum_gx * inv_n)[..., None])
    if dh is not None:
        dx = dx + dh.astype(jnp.float32)
    rows = tuple(range(x.ndim - 1))
    return (dx.astype(x.dtype), jnp.sum(dyf * xhat, axis=rows) if want_dscale else None,
            jnp.sum(dyf, axis=rows) if want_dbias else None)


def _stage_op(rms_of: Callable[[dict], bool], add_at: int | None):
    def op_of(params):
        return _name(rms_of(params), add_at is not None and params["present"][add_at])
    return op_of


PARTIALS = Stage("norm_partials", "partials", ("x", "residual?"), ("mean?", "m2", "h?"),
                 op_of=_stage_op(lambda p: p["rms"], 1), abstract=_partials_abstract,
                 reference=_partials_reference)
APPLY = Stage("norm_apply", "apply", ("x", "mean?", "rstd", "scale?", "bias?"), ("y",),
              op_of=_stage_op(lambda p: not p["present"][1], None), abstract=_apply_abstract,
              reference=_apply_reference)
BWD_PARTIALS = Stage("norm_bwd_partials", "bwd_partials", ("dy", "x", "mean?", "rstd", "scale?"),
                     ("sum_g?", "sum_gx"), op_of=_stage_op(lambda p: p["rms"], None),
                     abstract=_bwd_partials_abstract, reference=_bwd_partials_reference)
BWD_APPLY = Stage("norm_bwd_apply", "bwd_apply",
                  ("dy", "dh?", "x", "mean?", "rstd", "scale?", "sum_g?", "sum_gx"),
                  ("dx", "dscale?", "dbias?"),
                  op_of=_stage_op(lambda p: p["rms"], 1), abstract=_bwd_apply_abstract,
                  reference=_bwd_apply_reference)


def _apply_workspace(call, operands, params):
    """[arrays, P, cols] float32 partials of the column-tiled dscale/dbias kernel (an array
    for each of dscale and dbias wanted): its row
    chunks fill the GPU about 8 times over with 32-lane column tiles (cuda_utils.cuh,
    tile_grid), so at most 8 * 264 / tiles (264: twice an H100's SMs, the margin for
    larger GPUs; the kernel caps its chunks at P either way). CPU: no partials, 1 row."""
    x = operands[2]
    if not (params["want_dscale"] or params["want_dbias"]):
        return core.ShapedArray((0,), _F32)
    cols, rows = x.shape[-1], _static_rows(x.shape)
    p = 1
    if call.platform == "cuda":
        tiles = -(-cols // 128)  # 32 lanes of 16-byte float32 packs; fewer tiles for 16-bit x
        p = -(-8 * 264 // tiles)
        p = min(p, rows) if rows >= 0 else p
    return core.ShapedArray((bool(params["want_dscale"]) + bool(params["want_dbias"]), max(1, p), cols), _F32)


_STAGE_KERNELS = {
    "partials": ffi("jax_ops_norm_partials", lambda p: {"rms": bool(p["rms"])}),
    "apply": ffi("jax_ops_norm_apply"),
    "bwd_partials": ffi("jax_ops_norm_bwd_partials", lambda p: {"rms": bool(p["rms"])}),
    "bwd_apply": ffi("jax_ops_norm_bwd_apply",
                     lambda p: {"rms": bool(p["rms"]), "inv_n": np.float32(p["inv_n"])},
                     scratch=_apply_workspace),
}


def _residuals(ops, outs, params):  # add+norm keeps h, not x and residual
    x = ops["x"] if ops["residual"] is None else outs["h"]
    return x, outs["mean"], outs["rstd"], ops["scale"]


def _backward(res, cts, wanted, params, in_avals):
    x, mean, rstd, scale = res  # x is h for add+norm
    dy, dh = cts["y"], cts.get("h")
    dtype = {n: (in_avals[n].dtype if n in wanted else None) for n in ("scale", "bias")}
    if dy is None:  # only h is used: its cotangent is x's and residual's, nothing to normalize
        dx = dh
        dscale, dbias = (None if d is None else jnp.zeros(x.shape[-1:], d) for d in dtype.values())
    else:
        dx, dscale, dbias = BWD.call(dy, dh, x, mean, rstd, scale, rms=params["rms"],
                                          dscale_dtype=dtype["scale"], dbias_dtype=dtype["bias"],
                                          implementation=params["implementation"])
    return {"x": dx, "residual": dx, "scale": dscale, "bias": dbias}


NORM = Op(
    ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"), FWD, BWD,
    outputs=lambda p: ("y", "h"), train=lambda p: dict(p, with_stats=True),
    residuals=_residuals, backward=_backward, user_adapter=_user_adapter,
    stages=(PARTIALS, APPLY, BWD_PARTIALS, BWD_APPLY),
    impls={
        "cuda": Impl({"fwd": ffi("jax_ops_norm_fwd",
                                 lambda p: {"epsilon": np.float32(p["epsilon"]), "rms": bool(p["rms"])}),
                      "bwd": ffi("jax_ops_norm_bwd", lambda p: {"rms": bool(p["rms"])},
                                 scratch=_workspace), **_STAGE_KERNELS},
                     supports=ffi_supports("jax_ops_norm_fwd"),
                     # launch_fwd / launch_bwd: 16-byte packs, else half words, else values
                     load_words=(16, 8),
                     description="hand CUDA kernels through XLA FFI (host C++ on CPU)"),
        "pallas": Impl({"fwd": _pallas_fwd, "bwd": _pallas_bwd},
                       supports=pallas_supports(lambda q: pallas_norm.supports(q.cols)),
                       configs=_pallas_configs, description="Pallas kernels (Triton back end)",
                       tile_cols=pallas_norm.next_pow2),
    },
    bench=lambda: layer_norm_specs(),  # the benchmark specs and
    patterns=lambda: norm_patterns())  # the rewrite patterns: end of this module


# ------------------------------------------------------------- public API ---

def _prepare(op, x, scale, bias, epsilon, implementation, residual=None):
    registry.check_name(op, implementation)
    x = jnp.asarray(x)
    scale = None if scale is None else jnp.asarray(scale)
    bias = None if bias is None else jnp.asarray(bias)
    check_inputs(op, x, scale, bias, epsilon)
    if residual is not None:
        residual = jnp.asarray(residual)
        check_residual(op, x, residual)
    return x, residual, scale, bias


def layer_norm(x, scale=None, bias=None, *, epsilon: float = 1e-5, implementation: str | None = None):
    """LayerNorm over the last axis: (x - mean) / sqrt(var + epsilon) * scale + bias.

    Args:
      x: float32, bfloat16 or float16 array of any rank >= 1; rows are its leading axes.
      scale, bias: optional arrays of shape (x.shape[-1],), float32 or x's dtype (same
        dtype for both).
      epsilon: added to the biased variance.
      implementation: None (automatic), "xla" or "cuda" (our kernels: CUDA on GPU,
        the same math compiled for the host on CPU).

    Statistics and math run in float32; the result has x's dtype.
    """
    x, _, scale, bias = _prepare("layer_norm", x, scale, bias, epsilon, implementation)
    implementation = implementation or registry.override_for("layer_norm")
    x, scale, bias = match_vma(x, scale, bias)
    return FWD.call(x, None, scale, bias, epsilon=float(epsilon), rms=False, with_stats=False,
                         implementation=implementation)[0]


def rms_norm(x, scale=None, *, epsilon: float = 1e-6, implementation: str | None = None):
    """RMSNorm over the last axis: x / sqrt(mean(x²) + epsilon) * scale.

    Same argument rules as `layer_norm` (no bias).
    """
    x, _, scale, _ = _prepare("rms_norm", x, scale, None, epsilon, implementation)
    implementation = implementation or registry.override_for("rms_norm")
    x, scale = match_vma(x, scale)
    return FWD.call(x, None, scale, None, epsilon=float(epsilon), rms=True, with_stats=False,
                         implementation=implementation)[0]


def _add_norm(op, x, residual, scale, bias, epsilon, implementation, rms):
    x, residual, scale, bias = _prepare(op, x, scale, bias, epsilon, implementation, residual)
    implementation = implementation or registry.override_for(op)
    x, residual, scale, bias = match_vma(x, residual, scale, bias)
    y, h, _, _ = FWD.call(x, residual, scale, bias, epsilon=float(epsilon), rms=rms,
                               with_stats=False, implementation=implementation)
    return y, h


def add_layer_norm(x, residual, scale=None, bias=None, *, epsilon: float = 1e-5,
                   implementation: str | None = None):
    """Fused residual add + LayerNorm: h = x + residual, y = layer_norm(h, scale, bias).

    Returns (y, h). h is the sum rounded once to x's dtype (exactly `x + residual`);
    y normalizes that rounded h (float32 statistics and math, x's dtype). One kernel
    reads x and residual once and writes h and y; the backward takes the cotangents of
    both and computes dx = dresidual = layer_norm's dx at h + dh in one kernel.

    Args: residual must have x's shape and dtype; the others as in `layer_norm`.
    """
    return _add_norm("add_layer_norm", x, residual, scale, bias, epsilon, implementation, rms=False)


def add_rms_norm(x, residual, scale=None, *, epsilon: float = 1e-6, implementation: str | None = None):
    """Fused residual add + RMSNorm: h = x + residual, y = rms_norm(h, scale); returns
    (y, h). Same rules as `add_layer_norm` (no bias)."""
    return _add_norm("add_rms_norm", x, residual, scale, None, epsilon, implementation, rms=True)


# ---------------------------------------------------------- layer_norm family: benchmark specs (jax_ops.bench) ---
# LayerNorm and RMSNorm over the last axis. params: float32 scale (and bias),
# differentiated.

NORM_EPSILON = {"layer_norm": 1e-5, "rms_norm": 1e-6}  # jax_ops' defaults, used by every impl


def layer_norm_specs() -> dict[str, BenchSpec]:
    """Benchmarks of the layer_norm family: layer_norm, rms_norm, add_layer_norm, add_rms_norm."""

    def jnp_norm(op: str, eps: float) -> Callable:
        """Plain jax.numpy norm with float32 math, output in x's dtype."""
        def layer_norm(x, scale, bias):
            xf = x.astype(jnp.float32)
            mean = jnp.mean(xf, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
            return ((xf - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)

        def rms_norm(x, scale):
            xf = x.astype(jnp.float32)
            ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
            return (xf * jax.lax.rsqrt(ms + eps) * scale).astype(x.dtype)

        return layer_norm if op == "layer_norm" else rms_norm

    def flax_norm(op: str, eps: float, dtype) -> Callable:
        import flax.linen as nn
        if op == "layer_norm":
            ln = nn.LayerNorm(epsilon=eps, dtype=dtype, param_dtype=jnp.float32)
            return lambda x, scale, bias: ln.apply({"params": {"scale": scale, "bias": bias}}, x)
        rms = nn.RMSNorm(epsilon=eps, dtype=dtype, param_dtype=jnp.float32)
        return lambda x, scale: rms.apply({"params": {"scale": scale}}, x)

    def spec(op: str) -> BenchSpec:
        eps = NORM_EPSILON[op]
        n = 2 if op == "layer_norm" else 1  # scale, bias / scale

        def make_inputs(kx, ks, kb, dtype, rows, cols):
            x = jax.random.normal(kx, (rows, cols), dtype)
            scale = 1.0 + 0.1 * jax.random.normal(ks, (cols,), jnp.float32)
            return x, (scale, 0.1 * jax.random.normal(kb, (cols,), jnp.float32))[:n]

        def kernel(impl):
            if op == "layer_norm":
                return lambda x, scale, bias: layer_norm(
                    x, scale, bias, epsilon=eps, implementation=impl)
            return lambda x, scale: rms_norm(x, scale, epsilon=eps, implementation=impl)

        def nbytes(rows, cols, itemsize):
            x, p = rows * cols * itemsize, cols * 4
            s = rows * 4 * n  # float32 stats: layer_norm mean + rstd; rms_norm rstd
            fwd = 2 * x + n * p
            bwd = 3 * x + s + p + n * p
            return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + s + bwd}

        return BenchSpec(make_inputs=make_inputs, kernel=kernel, nbytes=nbytes,
                         reference=lambda dtype: jnp_norm(op, eps),
                         flax=lambda dtype: flax_norm(op, eps, dtype), num_params=n,
                         epsilon=eps, table_stages=("fwd", "bwd", "fwd_stats"))

    def add_spec(op: str) -> BenchSpec:
        """add_layer_norm / add_rms_norm: params = (residual, scale[, bias]); results (y, h).
        Baselines: XLA's fused h = x + residual, then the jnp / flax norm of h."""
        norm_op = op[len("add_"):]
        eps = NORM_EPSILON[norm_op]
        n = 2 if norm_op == "layer_norm" else 1

        def make_inputs(kx, ks, kb, dtype, rows, cols):
            x, params = spec(norm_op).make_inputs(kx, ks, kb, dtype, rows, cols)
            residual = jax.random.normal(jax.random.fold_in(kx, 1), (rows, cols), dtype)
            return x, (residual, *params)

        def kernel(impl):
            if norm_op == "layer_norm":
                return lambda x, r, scale, bias: add_layer_norm(
                    x, r, scale, bias, epsilon=eps, implementation=impl)
            return lambda x, r, scale: add_rms_norm(x, r, scale, epsilon=eps, implementation=impl)

        def then_norm(norm):
            def f(x, r, *p):
                h = x + r
                return norm(h, *p), h
            return f

        def nbytes(rows, cols, itemsize):
            x, p = rows * cols * itemsize, cols * 4
            s = rows * 4 * n
            fwd = 4 * x + n * p                # read x, residual; write y, h
            bwd = 4 * x + s + p + n * p        # read dy, dh, h; write dx (= dresidual)
            return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + s + bwd}

        return BenchSpec(make_inputs=make_inputs, kernel=kernel, nbytes=nbytes,
                         reference=lambda dtype: then_norm(jnp_norm(norm_op, eps)),
                         flax=lambda dtype: then_norm(flax_norm(norm_op, eps, dtype)),
                         num_params=n, epsilon=eps, table_stages=("fwd", "bwd", "fwd_stats"),
                         outputs=2)

    return {"layer_norm": spec("layer_norm"), "rms_norm": spec("rms_norm"),
            "add_layer_norm": add_spec("add_layer_norm"), "add_rms_norm": add_spec("add_rms_norm")}


# ------------------------------------------------ layer_norm family: rewrite patterns (jax_ops.fx) ---
# The computations jax_ops.optimize replaces by these ops (core/pattern.py): LayerNorm
# and RMSNorm over the last axis as flax (linen, nnx), haiku, jax.nn.standardize and
# hand-written jnp compute them. Each formulation's variable names appear in rewrites()'s reasons
# ("intermediate mean used elsewhere"): keep one assignment per line.

def _norm_examples(with_bias: bool):
    """x f32/bf16 at rank 1 and 2 (ranks >= 2 share a structure), parameters in
    float32 or x's dtype, each optional parameter present or absent."""
    out = []
    for shape in ((8,), (4, 8)):
        for xd, pd in ((_F32, _F32), (BF16, BF16), (BF16, _F32), (_F32, BF16)):
            for has_scale in (True, False):
                for has_bias in ((True, False) if with_bias else (False,)):
                    args = (sds(shape, xd), sds((8,), pd) if has_scale else None)
                    if with_bias:
                        args += (sds((8,), pd) if has_bias else None,)
                    if not has_scale and (not with_bias or not has_bias) and pd != xd:
                        continue  # no parameters: the parameter dtype doesn't matter
                    out.append(args)
    return out


def _norm_accepts(avals):
    why = accepts_x(avals)
    if why:
        return why
    cols = avals[0].shape[-1]
    for p in avals[1:]:
        if p is None:
            continue
        if p.dtype not in OP_DTYPES:
            return f"a parameter is {p.dtype}"
        if tuple(p.shape) != (cols,):
            return f"a parameter has shape {tuple(p.shape)}, not ({cols},)"
    return None


def _flax_linen_norm(x, scale, bias, *, epsilon, fast, dtype, rms):
    """flax.linen LayerNorm/RMSNorm over the last axis (flax/linen/normalization.py
    _compute_stats + _normalize, with the parameters passed in)."""
    from flax.linen import normalization as flax_norm
    mean, var = flax_norm._compute_stats(x, -1, dtype, use_mean=not rms, use_fast_variance=fast)
    return flax_linen_normalize(x, mean, var, scale, bias, (x.ndim - 1,), epsilon, dtype)


def _flax_nnx_norm(x, scale, bias, *, epsilon, fast, dtype, rms):
    """flax.nnx LayerNorm/RMSNorm over the last axis (flax/nnx/nn/normalization.py)."""
    from flax.nnx.nn import dtypes as nnx_dtypes
    from flax.nnx.nn import normalization as nnx_norm
    x, scale, bias = nnx_dtypes.promote_dtype((x, scale, bias), dtype=dtype)
    mean, var = nnx_norm._compute_stats(x, -1, dtype, use_mean=not rms, use_fast_variance=fast)
    return nnx_norm._normalize(x, mean, var, scale, bias, -1, -1, dtype, epsilon)


def _flax_static(rms):
    def static(avals, out_aval):
        return [{"fast": fast, "dtype": d, "rms": rms}
                for fast in ((True, False) if not rms else (True,))
                for d in out_dtypes(avals, out_aval)]
    return static


def _standardize(x, scale, bias, *, epsilon, algorithm):
    """jax.nn.standardize over the last axis, then optional scale and bias."""
    y = jax.nn.standardize(x, -1, epsilon=epsilon, algorithm=algorithm)
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y


def _standardize_static(avals, out_aval):
    return [{"algorithm": a} for a in ("fast", "stable")]


def _handwritten_layer_norm(x, scale, bias, *, epsilon, upcast, var_form, denominator):
    """The common hand-written LayerNorm: mean, var = mean((x - mean)^2) (or jnp.var),
    (x - mean) * rsqrt(var + eps) (or / sqrt(var + eps)) * scale + bias, optionally
    computed on x.astype(float32) and cast back."""
    xf = x.astype(jnp.float32) if upcast else x
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    if var_form == "var":
        var = jnp.var(xf, axis=-1, keepdims=True)
    else:
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    if denominator == "rsqrt":
        y = (xf - mean) * jax.lax.rsqrt(var + epsilon)
    else:
        y = (xf - mean) / jnp.sqrt(var + epsilon)
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype) if upcast else y


def _handwritten_ln_static(avals, out_aval):
    return [{"upcast": u, "var_form": v, "denominator": d} for u in (False, True)
            for v in ("mean_sq", "var") for d in ("rsqrt", "sqrt_div")]


def _handwritten_rms_norm(x, scale, *, epsilon, upcast, denominator):
    """x * rsqrt(mean(x^2) + eps) * scale (or / sqrt(...)), optionally in float32."""
    xf = x.astype(jnp.float32) if upcast else x
    ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    if denominator == "rsqrt":
        y = xf * jax.lax.rsqrt(ms + epsilon)
    else:
        y = xf / jnp.sqrt(ms + epsilon)
    if scale is not None:
        y = y * scale
    return y.astype(x.dtype) if upcast else y


def _handwritten_rms_static(avals, out_aval):
    return [{"upcast": u, "denominator": d} for u in (False, True) for d in ("rsqrt", "sqrt_div")]


def _haiku_layer_norm(x, scale, bias, *, epsilon, fast):
    """haiku.LayerNorm(axis=-1, param_axis=-1) (haiku/_src/layer_norm.py): statistics and
    arithmetic in x's dtype, inv = scale * rsqrt(var + eps), then inv * (x - mean) + offset;
    without create_scale/create_offset the parameters are the constants 1 and 0."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    if fast:
        mean_of_squares = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        variance = mean_of_squares - jnp.square(mean)
    else:
        variance = jnp.var(x, axis=-1, keepdims=True)
    scale = np.array(1., dtype=x.dtype) if scale is None else scale
    offset = np.array(0., dtype=x.dtype) if bias is None else bias
    eps = jax.lax.convert_element_type(epsilon, variance.dtype)
    inv = scale * jax.lax.rsqrt(variance + eps)
    return inv * (x - mean) + offset


def _haiku_ln_static(avals, out_aval):
    return [{"fast": fast} for fast in (False, True)]


def _haiku_rms_norm(x, scale, *, epsilon):
    """haiku.RMSNorm(axis=-1): x * broadcast(scale) * rsqrt(broadcast(mean(x^2)) + eps)."""
    scale = 1. if scale is None else jnp.broadcast_to(scale, x.shape)
    mean_squared = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    mean_squared = jnp.broadcast_to(mean_squared, x.shape)
    return x * scale * jax.lax.rsqrt(mean_squared + epsilon)


def _haiku_rms_static(avals, out_aval):
    return [{}]


def _flax_rms(fn):
    def rms(x, scale, *, epsilon, fast, dtype, rms):
        return fn(x, scale, None, epsilon=epsilon, fast=fast, dtype=dtype, rms=rms)
    rms.__name__ = fn.__name__ + "_rms"
    return rms


def _norm_params(x, scale, bias):
    """Parameters in float32 or x's dtype (what the ops take)."""
    ps = [p for p in (scale, bias) if p is not None]
    if any(p.dtype not in (_F32, x.dtype) for p in ps) or len({p.dtype for p in ps}) > 1:
        scale = None if scale is None else scale.astype(jnp.float32)
        bias = None if bias is None else bias.astype(jnp.float32)
    return scale, bias


def layer_norm_replacement(x, scale=None, bias=None, *, epsilon, out_dtype, **_):
    x = wider_x(x, out_dtype)
    scale, bias = _norm_params(x, scale, bias)
    return layer_norm(x, scale, bias, epsilon=epsilon).astype(out_dtype)


def rms_norm_replacement(x, scale=None, *, epsilon, out_dtype, **_):
    x = wider_x(x, out_dtype)
    scale, _ = _norm_params(x, scale, None)
    return rms_norm(x, scale, epsilon=epsilon).astype(out_dtype)


def _layer_norm_formulations() -> list[Formulation]:
    forms = [Formulation(_handwritten_layer_norm, _handwritten_ln_static, "jnp"),
             Formulation(_standardize, _standardize_static, "jax.nn.standardize"),
             Formulation(_haiku_layer_norm, _haiku_ln_static, "haiku.LayerNorm")]
    if flax_available():
        forms += [Formulation(_flax_linen_norm, _flax_static(False), "flax.linen.LayerNorm"),
                  Formulation(_flax_nnx_norm, _flax_static(False), "flax.nnx.LayerNorm")]
    return forms


def _rms_norm_formulations() -> list[Formulation]:
    forms = [Formulation(_handwritten_rms_norm, _handwritten_rms_static, "jnp"),
             Formulation(_haiku_rms_norm, _haiku_rms_static, "haiku.RMSNorm")]
    if flax_available():
        forms += [Formulation(_flax_rms(_flax_linen_norm), _flax_static(True), "flax.linen.RMSNorm"),
                  Formulation(_flax_rms(_flax_nnx_norm), _flax_static(True), "flax.nnx.RMSNorm")]
    return forms


# add+norm: h = x + r, then any of the norm formulations of h; h is an output (the
# next residual of a pre-norm transformer is used later), rounded to x's dtype as the
# op's h is. y must not be wider than x: the fused op gives y in x's dtype (flax with
# float32 parameters and dtype=None: the plain norm pattern then takes the norm alone).

def _add_examples(examples):
    return [(a[0], a[0], *a[1:]) for a in examples]


def _add_then(norm, label):
    def add_norm(x, r, *params, **kw):
        h = x + r
        return norm(h, *params, **kw), h
    add_norm.__name__ = f"add_{norm.__name__}"
    return Formulation(add_norm, label=f"x + r, then {label}")


def _add_formulations(forms: list[Formulation]) -> list[Formulation]:
    out = []
    for f in forms:
        g = _add_then(f.reference, f.label)
        g.static = f.static
        out.append(g)
    return out


def _add_norm_accepts(avals):
    x, r = avals[:2]
    if tuple(r.shape) != tuple(x.shape) or r.dtype != x.dtype:
        return (f"the residual is {r.dtype}{list(r.shape)}, not x's {x.dtype}{list(x.shape)} "
                "(add_layer_norm's h takes x's shape and dtype)")
    return _norm_accepts([x, *avals[2:]])


def _check_not_wider(op, x, out_dtype):
    if jnp.finfo(out_dtype).bits > jnp.finfo(x.dtype).bits:
        raise ValueError(f"jax_ops.{op} gives y in x's dtype {_fmt_dtype(x.dtype)}; the matched "
                         f"norm's result is {_fmt_dtype(out_dtype)}")


def add_layer_norm_replacement(x, r, scale=None, bias=None, *, epsilon, out_dtype, **_):
    _check_not_wider("add_layer_norm", x, out_dtype)
    scale, bias = _norm_params(x, scale, bias)
    y, h = add_layer_norm(x, r, scale, bias, epsilon=epsilon)
    return y.astype(out_dtype), h


def add_rms_norm_replacement(x, r, scale=None, *, epsilon, out_dtype, **_):
    _check_not_wider("add_rms_norm", x, out_dtype)
    scale, _ = _norm_params(x, scale, None)
    y, h = add_rms_norm(x, r, scale, epsilon=epsilon)
    return y.astype(out_dtype), h


def norm_patterns() -> list[Pattern]:
    """add_layer_norm, add_rms_norm, then layer_norm, rms_norm (which they contain);
    docs/fx.md."""
    return [Pattern("add_layer_norm", _add_formulations(_layer_norm_formulations()),
                    add_layer_norm_replacement, _add_examples(_norm_examples(True)),
                    params={"epsilon": 1e-5}, accepts=_add_norm_accepts, outputs=("y", "h"),
                    no_broadcast=(0, 1),
                    note="residual add + LayerNorm over the last axis; h used later"),
            Pattern("add_rms_norm", _add_formulations(_rms_norm_formulations()),
                    add_rms_norm_replacement, _add_examples(_norm_examples(False)),
                    params={"epsilon": 1e-6}, accepts=_add_norm_accepts, outputs=("y", "h"),
                    no_broadcast=(0, 1),
                    note="residual add + RMSNorm over the last axis; h used later"),
            Pattern("layer_norm", _layer_norm_formulations(), layer_norm_replacement,
                    _norm_examples(True), params={"epsilon": 1e-5}, accepts=_norm_accepts,
                    note="LayerNorm over the last axis, statistics in float32"),
            Pattern("rms_norm", _rms_norm_formulations(), rms_norm_replacement,
                    _norm_examples(False), params={"epsilon": 1e-6}, accepts=_norm_accepts,
                    note="RMSNorm over the last axis, statistics in float32")]
