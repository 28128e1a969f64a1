"""BatchNorm+ReLU and BatchNorm+Add+ReLU for training and inference, channels last: the
declaration (core/op.py).

Forward stage  jax_ops_bn_relu_fwd(x, z?, scale, bias, mean_in?, var_in?)
                 -> (y, mask, mean, var, rstd)
Backward stage jax_ops_bn_relu_bwd(dy, x, mask, mean, rstd, scale, gmean?, gvar?)
                 -> (dx, dz?, dscale, dbias)

x is (..., C): statistics per channel over all other axes (rows = their product).
Parameters and statistics are float32 at the stages (the public functions cast and
autodiff casts the gradients back). z is bound for batch_norm_add_relu only (dz is
produced with it), mean_in/var_in at inference only, gmean/gvar (the cotangents of the
returned batch statistics) in training where they are not zero. The kernels' float32
workspaces of per-block partials ((3, P, C) Welford partials forward in training,
(2, P, C) gradient sums backward; P = work_rows) are FFI scratch, the Pallas wrapper's
its own buffers: none is a stage result.

  training:  mean, var = batch mean and BIASED batch variance (two-stage Welford,
             no atomics), rstd = 1/sqrt(var + epsilon)
  inference: mean, var = the given running statistics; one elementwise pass
  pre = (x - mean) * (scale * rstd) + bias [+ z];  y = relu(pre);  mask: 1 bit per
  element, pre > 0 (core/bitmask.py, the layout of jax_ops.relu).
Backward, g = dy where the bit is set else 0, xhat = (x - mean) * rstd, N = rows:
  dbias = Σ g, dscale = Σ g·xhat, dz = g
  training:  dx = a·g + b·xhat + c, a = scale·rstd, b = (2·gvar/rstd − a·dscale)/N,
             c = (gmean − a·dbias)/N  (gmean/gvar absent: 0)
  inference: dx = a·g; the given mean/var get dmean = −a·dbias, dvar = −½·a·rstd·dscale.
Reverse mode keeps x, the mask, float32 mean/rstd per channel and scale.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from jax_ops.core import registry
from jax_ops.core.benchspec import BenchSpec
from jax_ops.core.validate import check_broadcastable, check_epsilon, check_vectors, check_x
from jax_ops.core.bitmask import MASK_DTYPE, mask_shape, pack_bits, sharding_policy, unpack_bits
from jax_ops.core.op import (Impl, Op, Stage, ffi, ffi_supports, local_uses_kernels,
                             match_vma, pallas_supports)
from jax_ops.core.sharding import merge_moments
from jax_ops.core.pattern import (BF16, OP_DTYPES, Formulation, Pattern, flax_available,
                                  flax_linen_normalize, out_dtypes, sds, wider_x)
from jax_ops.core.validate import dtype_name as _fmt_dtype
from pallas_kernels import batch_norm as pallas_bn

_F32 = jnp.dtype(jnp.float32)


def _rows_channels(shape) -> tuple[int, int]:
    """(rows, C); rows may be a symbolic dim (jax.export)."""
    return math.prod(shape[:-1]), shape[-1]


def work_rows(rows, channels: int) -> int:
    """P: rows of per-block partials the kernels may write (at most 16 MiB a plane);
    with a symbolic row count bounded by the channels alone (a static shape)."""
    p = min(1024, (16 << 20) // (4 * max(channels, 1)))
    return max(1, min(p, rows) if isinstance(rows, int) else p)


def _op_name(has_z: bool) -> str:
    return "batch_norm_add_relu" if has_z else "batch_norm_relu"


# ------------------------------------------------------------- validation ---

def _check_inputs(op, x, scale, bias, epsilon) -> None:
    """TypeError/ValueError naming the argument, expected and actual value."""
    check_x(op, x, min_rank=2, rank_rule="rank >= 2 (channels on the last axis, statistics over the others)")
    check_vectors(op, x, scale=scale, bias=bias)
    check_epsilon(op, epsilon)


def _check_stat(op, name, a, c):
    if a is None:
        raise ValueError(f"jax_ops.{op}: {name} is required when training=False "
                         f"(the running statistics to normalize with)")
    a = jnp.asarray(a)
    if tuple(a.shape) != (c,):
        raise ValueError(f"jax_ops.{op}: {name} must have shape ({c},) to match x's last axis; "
                         f"got shape {tuple(a.shape)}")
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"jax_ops.{op}: {name} must be a floating array; got {_fmt_dtype(a.dtype)}")
    return a


# ---------------------------------------------------------------- forward ---

def _fwd_abstract(x, z, scale, bias, mean_in, var_in, *, epsilon, training):
    op = _op_name(z is not None)
    if x.ndim < 2:
        raise ValueError(f"jax_ops.{op}: x must have rank >= 2 (channels last); got shape {x.shape}")
    c = x.shape[-1]
    if z is not None and (z.shape != x.shape or z.dtype != x.dtype):
        raise ValueError(f"jax_ops.{op} forward: z must match x; got z {z.shape} "
                         f"{_fmt_dtype(z.dtype)} and x {x.shape} {_fmt_dtype(x.dtype)}")
    if (mean_in is None, var_in is None) != (training, training):
        raise ValueError(f"jax_ops.{op} forward: mean_in and var_in are bound exactly at "
                         f"inference (training=False); got training={training}")
    stats = [scale, bias] + ([] if training else [mean_in, var_in])
    if any(a.shape != (c,) or a.dtype != _F32 for a in stats):
        raise ValueError(f"jax_ops.{op} forward: scale/bias{'' if training else '/mean/var'} must be "
                         f"float32 of shape ({c},); got {[(a.shape, _fmt_dtype(a.dtype)) for a in stats]}")
    chan = core.ShapedArray((c,), _F32)
    return (core.ShapedArray(x.shape, x.dtype),
            core.ShapedArray(mask_shape(x.shape), MASK_DTYPE), chan, chan, chan)


def _row_axes(a):
    return tuple(range(a.ndim - 1))


def batch_stats(x):
    """Per-channel (last axis) mean and biased variance over all other axes, two-pass in
    float32."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=_row_axes(x))
    return mean, jnp.mean(jnp.square(xf - mean), axis=_row_axes(x))


def _fwd_reference(x, z, scale, bias, mean_in, var_in, *, epsilon, training):
    # on x's axes (not reshaped to rows): shardings in x's type (explicit mesh axes) carry over
    mean, var = batch_stats(x) if training else (mean_in, var_in)
    rstd = jax.lax.rsqrt(var + epsilon)
    pre = (x.astype(jnp.float32) - mean) * (scale * rstd) + bias
    if z is not None:
        pre = pre + z.astype(jnp.float32)
    # jnp.maximum keeps NaN; the mask bit of NaN is clear
    return jnp.maximum(pre, 0).astype(x.dtype), pack_bits(pre > 0), mean, var, rstd


# ---------------------------------------------------------------- sharding ---
# Channels sharded: statistics are per channel, each device runs the kernels on its
# channels. Rows sharded (data parallelism) in training: the statistics are those of
# the global batch (jit semantics): each device's per-channel mean and M2 (the STATS
# stage's kernels over its rows; jnp two-pass with xla), one all_gather over the row
# axes (O(C × devices) data) merged exactly in device order (core/sharding.merge_moments),
# then the kernel's inference pass normalizes the local rows with them; the backward
# psums the local Σg and Σg·x̂ per channel (GRAD_SUMS) and DX forms dx with them. At inference each device normalizes its rows; dscale/dbias are
# psum'ed.

def _rows_sharded_training(layout, params):
    return bool(params["training"]) and bool(layout.row_axes)


def _global_rows(layout):
    return math.prod(layout.shape[:-1])


def _fwd_local(layout, mesh, x, z, scale, bias, mean_in, var_in, *, epsilon, training,
               implementation):
    n_local = _rows_channels(x.shape)[0]
    if not local_uses_kernels(
            mesh, (FWD, (x, z, scale, bias, mean_in, var_in),
                   dict(epsilon=epsilon, training=training, implementation=implementation)),
            (STATS, (x,), dict(epsilon=epsilon, implementation=implementation))):
        xf = x.astype(jnp.float32)  # this device's rows: exact two-pass
        mean_local = jnp.mean(xf, axis=_row_axes(x))
        m2_local = jnp.sum(jnp.square(xf - mean_local), axis=_row_axes(x))
    else:  # the kernels' Welford partials of this device's rows
        mean_local, var_local, _ = STATS.call(x, epsilon=epsilon, implementation=implementation)
        m2_local = var_local * n_local
    # One all_gather of every device's (mean, M2) per channel, merged in device order
    # (Chan: exact): one collective on the critical path, where Σx then Σ(x − mean)²
    # psum'ed were two in sequence.
    mean, m2 = merge_moments(mean_local, m2_local, layout.row_axes, n_local)
    var = m2 / _global_rows(layout)
    y, mask, _, _, rstd = FWD.call(x, z, scale, bias, mean, var, epsilon=epsilon, training=False,
                                   implementation=implementation)
    return y, mask, mean, var, rstd


def _bwd_local(layout, mesh, dy, x, mask, mean, rstd, scale, gmean, gvar, *, implementation,
               training, has_z):
    """The rows sharded, training: with kernels GRAD_SUMS writes this device's Σg and
    Σg·x̂ per channel, one psum makes them global, DX writes dx (and dz) with them and
    the global row count; else jnp with the same psum."""
    def col_sums(arrays):
        return jax.lax.psum(tuple(jnp.sum(a, axis=_row_axes(a)) for a in arrays), layout.row_axes)
    if not local_uses_kernels(
            mesh, (BWD, (dy, x, mask, mean, rstd, scale, gmean, gvar),
                   dict(training=training, has_z=has_z, implementation=implementation)),
            (GRAD_SUMS, (dy, x, mask, mean, rstd), dict(implementation=implementation))):
        return _bwd_reference(dy, x, mask, mean, rstd, scale, gmean, gvar, training=training,
                              has_z=has_z, col_sums=col_sums, total_rows=_global_rows(layout))
    dscale, dbias = GRAD_SUMS.call(dy, x, mask, mean, rstd, implementation=implementation)
    dscale, dbias = jax.lax.psum((dscale, dbias), layout.row_axes)
    gmean, gvar = _statistics_cotangents(mean, gmean, gvar, True)
    dx, dz = DX.call(dy, x, mask, mean, rstd, scale, gmean, gvar, dscale, dbias, has_z=has_z,
                     count=float(_global_rows(layout)), implementation=implementation)
    return dx, dz, dscale, dbias


# ------------------------------------- batch-sharded training stages (issue 23) ---
# Per-device stages of `_fwd_local`/`_bwd_local` (rows split over devices, training;
# bound only there, on the local shards). Kernels: "cuda" (CUDA; the host handlers on
# CPU); "xla" runs the references.
#   jax_ops_bn_stats(x) -> (mean, var, rstd)            the local rows' batch statistics
#   jax_ops_bn_grad_sums(dy, x, mask, mean, rstd) -> (dscale, dbias)   local Σg·x̂, Σg
#   jax_ops_bn_dx(dy, x, mask, mean, rstd, scale, gmean, gvar, dscale, dbias) -> (dx, dz?)
#       params has_z, count (the global row count N; dscale/dbias the global sums)

def _chan(x):
    return core.ShapedArray((x.shape[-1],), _F32)


def _stats_abstract(x, *, epsilon):
    check_x("bn stats", x, min_rank=1, rank_rule="a channels axis (channels last)")
    if _rows_channels(x.shape)[0] == 0:
        raise ValueError(f"jax_ops bn stats: batch statistics need at least one row; x has shape "
                         f"{tuple(x.shape)}")
    return _chan(x), _chan(x), _chan(x)


def _stats_reference(x, *, epsilon):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=_row_axes(x))
    var = jnp.mean(jnp.square(xf - mean), axis=_row_axes(x))
    return mean, var, jax.lax.rsqrt(var + epsilon)


def _stage_bwd_check(stage, dy, x, mask, **chans):
    check_x(stage, x, min_rank=1, rank_rule="a channels axis (channels last)")
    _check_dy_mask(f"jax_ops {stage}", dy, x, mask)
    for name, a in chans.items():
        if tuple(a.shape) != (x.shape[-1],) or a.dtype != _F32:
            raise ValueError(f"jax_ops {stage}: {name} must be float32 of shape ({x.shape[-1]},) "
                             f"(x's last axis); got {tuple(a.shape)} {_fmt_dtype(a.dtype)}")


def _grad_sums_abstract(dy, x, mask, mean, rstd):
    _stage_bwd_check("bn grad sums", dy, x, mask, mean=mean, rstd=rstd)
    return _chan(x), _chan(x)


def _grad_sums_reference(dy, x, mask, mean, rstd):
    g = jnp.where(unpack_bits(mask, x.shape), dy.astype(jnp.float32), 0.0)
    xhat = (x.astype(jnp.float32) - mean) * rstd
    return jnp.sum(g * xhat, axis=_row_axes(x)), jnp.sum(g, axis=_row_axes(x))


def _dx_abstract(dy, x, mask, mean, rstd, scale, gmean, gvar, dscale, dbias, *, has_z, count):
    _stage_bwd_check("bn dx", dy, x, mask, mean=mean, rstd=rstd, scale=scale, gmean=gmean,
                     gvar=gvar, dscale=dscale, dbias=dbias)
    rows = _rows_channels(x.shape)[0]
    if isinstance(rows, int) and not count >= max(rows, 1):
        raise ValueError(f"jax_ops bn dx: count (the global row count) must be >= the local rows "
                         f"({rows}) and > 0; got {count}")
    out = core.ShapedArray(x.shape, x.dtype)
    return out, (out if has_z else None)


def _dx_reference(dy, x, mask, mean, rstd, scale, gmean, gvar, dscale, dbias, *, has_z, count):
    g = jnp.where(unpack_bits(mask, x.shape), dy.astype(jnp.float32), 0.0)
    xhat = (x.astype(jnp.float32) - mean) * rstd
    a = scale * rstd
    dx = a * g + ((2.0 * gvar / rstd - a * dscale) / count) * xhat + (gmean - a * dbias) / count
    return dx.astype(x.dtype), (g.astype(x.dtype) if has_z else None)


STATS = Stage("bn_stats", "partials", ("x",), ("mean", "var", "rstd"),
              op_of=lambda p: "batch_norm_relu", abstract=_stats_abstract, reference=_stats_reference)
GRAD_SUMS = Stage("bn_grad_sums", "bwd_partials", ("dy", "x", "mask", "mean", "rstd"),
                  ("dscale", "dbias"), op_of=lambda p: "batch_norm_relu",
                  abstract=_grad_sums_abstract, reference=_grad_sums_reference)
DX = Stage("bn_dx", "bwd_apply",
           ("dy", "x", "mask", "mean", "rstd", "scale", "gmean", "gvar", "dscale", "dbias"),
           ("dx", "dz?"), op_of=lambda p: _op_name(p["has_z"]), abstract=_dx_abstract,
           reference=_dx_reference)


def _stats_workspace(call, operands, params):
    rows, c = _rows_channels(operands[0].shape)
    return core.ShapedArray((3, work_rows(rows, c), c), _F32)


def _grad_sums_workspace(call, operands, params):
    rows, c = _rows_channels(operands[1].shape)
    return core.ShapedArray((2, work_rows(rows, c), c), _F32)


_STAGE_KERNELS = {
    "partials": ffi("jax_ops_bn_stats", lambda p: {"epsilon": np.float32(p["epsilon"])},
                    scratch=_stats_workspace),
    "bwd_partials": ffi("jax_ops_bn_grad_sums", flat_operands=(2,), scratch=_grad_sums_workspace),
    "bwd_apply": ffi("jax_ops_bn_dx",
                     lambda p: {"has_z": bool(p["has_z"]), "count": np.float32(p["count"])},
                     flat_operands=(2,)),
}


# --------------------------------------------------------------- backward ---

def _check_dy_mask(prefix, dy, x, mask):
    """dy like x, and the mask of x's shape (prefix: "jax_ops.<op> backward" or a stage's)."""
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"{prefix}: dy must match x; got dy {dy.shape} "
                         f"{_fmt_dtype(dy.dtype)} and x {x.shape} {_fmt_dtype(x.dtype)}")
    if tuple(mask.shape) != mask_shape(x.shape) or mask.dtype != MASK_DTYPE:
        raise ValueError(f"{prefix}: mask must be uint32 of shape "
                         f"{mask_shape(x.shape)}; got {mask.shape} {_fmt_dtype(mask.dtype)}")


def _bwd_abstract(dy, x, mask, mean, rstd, scale, gmean, gvar, *, training, has_z):
    op = _op_name(has_z)
    c = x.shape[-1]
    _check_dy_mask(f"jax_ops.{op} backward", dy, x, mask)
    if not training and (gmean is not None or gvar is not None):
        raise ValueError(f"jax_ops.{op} backward: gmean/gvar (the cotangents of the batch "
                         f"statistics) are bound in training only")
    chan = core.ShapedArray((c,), _F32)
    return (core.ShapedArray(x.shape, x.dtype), core.ShapedArray(x.shape, x.dtype) if has_z else None,
            chan, chan)


def _bwd_reference(dy, x, mask, mean, rstd, scale, gmean, gvar, *, training, has_z,
                   col_sums=None, total_rows=None):
    """col_sums(arrays): their per-channel sums over all rows, total_rows: their count
    (psum'ed over devices when the rows are sharded). On x's axes, like _fwd_reference."""
    if col_sums is None:
        def col_sums(arrays):
            return tuple(jnp.sum(a, axis=_row_axes(a)) for a in arrays)
    total_rows = _rows_channels(x.shape)[0] if total_rows is None else total_rows
    g = jnp.where(unpack_bits(mask, x.shape), dy.astype(jnp.float32), 0.0)
    xhat = (x.astype(jnp.float32) - mean) * rstd
    dbias, dscale = col_sums((g, g * xhat))
    a = scale * rstd
    dx = a * g
    if training:
        gmean = 0.0 if gmean is None else gmean
        gvar = 0.0 if gvar is None else gvar
        dx = dx + ((2.0 * gvar / rstd - a * dscale) / total_rows) * xhat + (gmean - a * dbias) / total_rows
    dz = g.astype(x.dtype) if has_z else None
    return dx.astype(x.dtype), dz, dscale, dbias


# --------------------------------------------------------- implementations ---

def _statistics_cotangents(mean, gmean, gvar, training):
    """(gmean, gvar) as the kernels take them: both (C,) in training (zeros where
    absent), None at inference."""
    if not training:
        return None, None
    zeros = jnp.zeros_like(mean)
    return (zeros if gmean is None else gmean), (zeros if gvar is None else gvar)


def _fwd_workspace(call, operands, params):
    rows, c = _rows_channels(operands[0].shape)
    return core.ShapedArray((3, work_rows(rows, c), c) if params["training"] else (0,), _F32)


def _bwd_workspace(call, operands, params):
    rows, c = _rows_channels(operands[1].shape)
    return core.ShapedArray((2, work_rows(rows, c), c), _F32)


_ffi_fwd = ffi("jax_ops_bn_relu_fwd",
               lambda p: {"epsilon": np.float32(p["epsilon"]), "training": bool(p["training"]),
                          "has_z": p["has_z"]},
               flat_results=(1,), scratch=_fwd_workspace)
_ffi_bwd = ffi("jax_ops_bn_relu_bwd",
               lambda p: {"training": bool(p["training"]), "has_z": bool(p["has_z"])},
               flat_operands=(2,), scratch=_bwd_workspace)


def _cuda_fwd(call, x, z, scale, bias, mean_in, var_in, *, epsilon, training):
    # The handler's has_z attribute says whether z is bound.
    return _ffi_fwd(call, x, z, scale, bias, mean_in, var_in, epsilon=epsilon, training=training,
                    has_z=z is not None)


def _cuda_bwd(call, dy, x, mask, mean, rstd, scale, gmean, gvar, *, training, has_z):
    gmean, gvar = _statistics_cotangents(mean, gmean, gvar, training)
    return _ffi_bwd(call, dy, x, mask, mean, rstd, scale, gmean, gvar, training=training,
                    has_z=has_z)


def _pallas_fwd(call, x, z, scale, bias, mean_in, var_in, *, epsilon, training):
    rows, c = _rows_channels(x.shape)
    y, mask, mean, var, rstd = pallas_bn.bn_relu_fwd(
        x.reshape(rows, c), None if z is None else z.reshape(rows, c), scale, bias, mean_in,
        var_in, epsilon=epsilon, training=training, config=call.config, interpret=call.interpret)
    return y.reshape(x.shape), mask.reshape(mask_shape(x.shape)), mean, var, rstd


def _pallas_bwd(call, dy, x, mask, mean, rstd, scale, gmean, gvar, *, training, has_z):
    rows, c = _rows_channels(x.shape)
    gmean, gvar = _statistics_cotangents(mean, gmean, gvar, training)
    dx, dz, dscale, dbias = pallas_bn.bn_relu_bwd(
        dy.reshape(rows, c), x.reshape(rows, c), mask.reshape(-1), mean, rstd, scale, gmean, gvar,
        training=training, has_z=has_z, config=call.config, interpret=call.interpret)
    return dx.reshape(x.shape), None if dz is None else dz.reshape(x.shape), dscale, dbias


def _pallas_configs(q):
    rows, c = (q.rows or 1, q.cols or 1)
    return pallas_bn.candidate_configs(max(rows, 1), c, q.stage)


def _user_adapter(fn, backward, tunable):
    """register_implementation's adapter. fn(x, z, scale, bias, mean, var, *, epsilon,
    training) with x, z (rows, C) (z None for batch_norm_relu), float32 (C,) parameters,
    mean/var None when training; returns y, or (y, batch_mean, batch_var) when training
    (statistics computed by jnp where it returns y only). The mask is packed from y > 0.
    backward(dy, x, mask, mean, rstd, scale, gmean, gvar, *, training) -> (dx, dz|None,
    dscale, dbias), gmean/gvar None at inference."""
    def fwd(call, x, z, scale, bias, mean_in, var_in, *, epsilon, training):
        rows, c = _rows_channels(x.shape)
        kw = {"config": call.config} if tunable else {}
        out = fn(x.reshape(rows, c), None if z is None else z.reshape(rows, c), scale, bias,
                 mean_in, var_in, epsilon=epsilon, training=training, **kw)
        y = out[0] if isinstance(out, (tuple, list)) else out
        if training and isinstance(out, (tuple, list)):
            mean, var = (jnp.asarray(v, jnp.float32) for v in out[1:3])
        elif training:
            mean, var = batch_stats(x)
        else:
            mean, var = mean_in, var_in
        y = jnp.asarray(y).astype(x.dtype).reshape(x.shape)
        return (y, pack_bits(y > 0), mean, var,
                jax.lax.rsqrt(var + epsilon))

    def bwd(call, dy, x, mask, mean, rstd, scale, gmean, gvar, *, training, has_z):
        rows, c = _rows_channels(x.shape)
        kw = {"config": call.config} if tunable else {}
        gmean, gvar = _statistics_cotangents(mean, gmean, gvar, training)
        dx, dz, dscale, dbias = backward(
            dy.reshape(rows, c), x.reshape(rows, c), mask.reshape(-1), mean, rstd, scale,
            gmean, gvar, training=training, **kw)
        return (jnp.asarray(dx).astype(x.dtype).reshape(x.shape),
                jnp.asarray(dz).astype(x.dtype).reshape(x.shape) if has_z else None,
                jnp.asarray(dscale, jnp.float32), jnp.asarray(dbias, jnp.float32))

    return {"fwd": fwd, **({"bwd": bwd} if backward is not None else {})}


# ----------------------------------------------------------- declaration ---

# Batching (both stages): statistics are per example, so the vmapped reference.
FWD = Stage("bn_relu_fwd", "fwd", ("x", "z?", "scale", "bias", "mean_in?", "var_in?"),
            ("y", "mask", "mean", "var", "rstd"),
            op_of=lambda p: _op_name(p["present"][1]), abstract=_fwd_abstract,
            reference=_fwd_reference,
            roles={"x": "x", "z": "x", "scale": "cols", "bias": "cols", "mean_in": "cols",
                   "var_in": "cols", "y": "x", "mask": "mask", "mean": "cols", "var": "cols",
                   "rstd": "cols"},
            policy=sharding_policy, needs_local=_rows_sharded_training, local=_fwd_local,
            variant=lambda p: "stats" if p["training"] else "")
# has_z: whether the forward added z (dz is produced; which op's implementation runs)
BWD = Stage("bn_relu_bwd", "bwd", ("dy", "x", "mask", "mean", "rstd", "scale", "gmean?", "gvar?"),
            ("dx", "dz?", "dscale", "dbias"),
            op_of=lambda p: _op_name(p["has_z"]), abstract=_bwd_abstract, reference=_bwd_reference,
            roles={"dy": "x", "x": "x", "mask": "mask", "mean": "cols", "rstd": "cols",
                   "scale": "cols", "gmean": "cols", "gvar": "cols", "dx": "x", "dz": "x",
                   "dscale": "colsum", "dbias": "colsum"},
            policy=sharding_policy, needs_local=_rows_sharded_training, local=_bwd_local)


def _outputs(params):
    # training returns the batch statistics (their cotangents reach dx); inference y only
    return ("y", "mean", "var") if params["training"] else ("y",)


def _residuals(ops, outs, params):
    return ops["x"], outs["mask"], outs["mean"], outs["rstd"], ops["scale"]


def _backward(res, cts, wanted, params, in_avals):
    x, mask, mean, rstd, scale = res
    training = params["training"]
    # only the statistics' cotangents may be nonzero: dx still has their terms
    dy = jnp.zeros(x.shape, x.dtype) if cts["y"] is None else cts["y"]
    gmean, gvar = (cts["mean"], cts["var"]) if training else (None, None)
    dx, dz, dscale, dbias = BWD.call(dy, x, mask, mean, rstd, scale, gmean, gvar, training=training,
                                     has_z=in_avals["z"] is not None,
                                     implementation=params["implementation"])
    grads = {"x": dx, "z": dz, "scale": dscale, "bias": dbias}
    if not training:  # the given statistics (normalized with) get their gradients
        a = scale * rstd
        grads["mean_in"] = -a * dbias
        grads["var_in"] = -0.5 * a * rstd * dscale
    return grads


BN_RELU = Op(
    ("batch_norm_relu", "batch_norm_add_relu"), FWD, BWD,
    outputs=_outputs, residuals=_residuals, backward=_backward, user_adapter=_user_adapter,
    stages=(STATS, GRAD_SUMS, DX),
    impls={
        "cuda": Impl({"fwd": _cuda_fwd, "bwd": _cuda_bwd, **_STAGE_KERNELS},
                     supports=ffi_supports("jax_ops_bn_relu_fwd"),
                     description="hand CUDA kernels through XLA FFI (host C++ on CPU)"),
        "pallas": Impl({"fwd": _pallas_fwd, "bwd": _pallas_bwd},
                       supports=pallas_supports(
                           lambda q: pallas_bn.supports(max(q.rows or 1, 1), q.cols or 1)),
                       configs=_pallas_configs, description="Pallas kernels (Triton back end)"),
    },
    bench=lambda: batch_norm_specs(),  # the benchmark specs and
    patterns=lambda: batch_norm_patterns())  # the rewrite patterns: end of this module


# ------------------------------------------------------------- public API ---

def _call(op, x, z, scale, bias, epsilon, training, mean, var, implementation):
    registry.check_name(op, implementation)
    x = jnp.asarray(x)
    scale = None if scale is None else jnp.asarray(scale)
    bias = None if bias is None else jnp.asarray(bias)
    _check_inputs(op, x, scale, bias, epsilon)
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(f"jax_ops.{op}: training must be a Python bool; got {type(training).__name__}")
    rows, c = _rows_channels(x.shape)
    if z is not None:
        z = jnp.asarray(z)
        check_broadcastable(op, "z", x, z)
        if z.shape != x.shape:
            z = jnp.broadcast_to(z, x.shape)
    if training:
        if mean is not None or var is not None:
            raise ValueError(f"jax_ops.{op}: mean/var are the running statistics used when "
                             f"training=False; with training=True the batch statistics are used "
                             f"(pass mean=None, var=None)")
        if rows == 0:
            raise ValueError(f"jax_ops.{op}: batch statistics need at least one row; x has "
                             f"shape {tuple(x.shape)}")
        mean_in = var_in = None
    else:
        mean_in = _check_stat(op, "mean", mean, c).astype(jnp.float32)
        var_in = _check_stat(op, "var", var, c).astype(jnp.float32)
    scale32 = jnp.ones((c,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    bias32 = jnp.zeros((c,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    implementation = implementation or registry.override_for(op)
    x, z, scale32, bias32, mean_in, var_in = match_vma(x, z, scale32, bias32, mean_in, var_in)
    y, _, batch_mean, batch_var, _ = FWD.call(x, z, scale32, bias32, mean_in, var_in,
                                              epsilon=float(epsilon), training=bool(training),
                                              implementation=implementation)
    return (y, batch_mean, batch_var) if training else y


def batch_norm_relu(x, scale=None, bias=None, *, epsilon: float = 1e-5, training: bool = True,
                    mean=None, var=None, implementation: str | None = None):
    """relu(BatchNorm(x)) with channels on the last axis, statistics over all others.

    Args:
      x: float32, bfloat16 or float16, rank >= 2 (e.g. NHWC).
      scale, bias: optional (C,) arrays, float32 or x's dtype.
      epsilon: added to the variance.
      training: True: normalize with the batch statistics and return
        (y, batch_mean, batch_var), float32, var BIASED (what flax.linen.BatchNorm's
        running average uses: ra_var = momentum * ra_var + (1 - momentum) * batch_var;
        PyTorch's running_var instead takes the unbiased var * n / (n - 1)).
        False: normalize with the given `mean`/`var` (required, (C,)) and return y.
      implementation: None (automatic), "xla", "cuda" or "pallas".

    The backward keeps x, a 1-bit mask and float32 mean/rstd per channel.
    """
    return _call("batch_norm_relu", x, None, scale, bias, epsilon, training, mean, var,
                 implementation)


def batch_norm_add_relu(x, z, scale=None, bias=None, *, epsilon: float = 1e-5,
                        training: bool = True, mean=None, var=None,
                        implementation: str | None = None):
    """relu(BatchNorm(x) + z) (a ResNet block's residual add), z of x's dtype and shape
    (or broadcastable to it); gradients flow to x, z, scale and bias. Otherwise as
    batch_norm_relu."""
    return _call("batch_norm_add_relu", x, z, scale, bias, epsilon, training, mean, var,
                 implementation)


# ---------------------------------------------------------- batch_norm family: benchmark specs (jax_ops.bench) ---
# The BatchNorm fusions, training mode. cols are the channels (an NHWC activation
# flattened to (N*H*W, C)); the mask residual is 1 bit per element.

BN_EPSILON = 1e-5


def batch_norm_specs() -> dict[str, BenchSpec]:
    """Benchmarks of the batch_norm family: batch_norm_relu, batch_norm_add_relu."""

    def spec(add: bool) -> BenchSpec:
        op = "batch_norm_add_relu" if add else "batch_norm_relu"

        def make_inputs(kx, kp, kq, dtype, rows, cols):
            x = 0.5 + jax.random.normal(kx, (rows, cols), dtype)
            scale = 1.0 + 0.1 * jax.random.normal(kp, (cols,), jnp.float32)
            bias = 0.1 * jax.random.normal(kq, (cols,), jnp.float32)
            z = (jax.random.normal(jax.random.fold_in(kq, 1), (rows, cols), dtype),) if add else ()
            return x, (*z, scale, bias)

        def kernel(impl):  # training forward; y only (the statistics are for the running averages)
            if add:
                return lambda x, z, s, b: batch_norm_add_relu(
                    x, z, s, b, epsilon=BN_EPSILON, implementation=impl)[0]
            return lambda x, s, b: batch_norm_relu(x, s, b, epsilon=BN_EPSILON,
                                                           implementation=impl)[0]

        def reference(dtype):  # BatchNorm in float32 jnp + jax.nn.relu, autodiff
            def bn(x, s, b):
                xf = x.astype(jnp.float32)
                mean = jnp.mean(xf, axis=0)
                var = jnp.mean(jnp.square(xf - mean), axis=0)
                return ((xf - mean) * jax.lax.rsqrt(var + BN_EPSILON) * s + b).astype(x.dtype)
            if add:
                return lambda x, z, s, b: jax.nn.relu(bn(x, s, b) + z)
            return lambda x, s, b: jax.nn.relu(bn(x, s, b))

        def flax(dtype):  # flax.linen.BatchNorm (training, batch_stats updated) + jax.nn.relu
            import flax.linen as nn
            m = nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=BN_EPSILON,
                             dtype=dtype, param_dtype=jnp.float32)

            def bn(x, s, b):
                c = x.shape[-1]
                stats = {"mean": jnp.zeros((c,), jnp.float32), "var": jnp.ones((c,), jnp.float32)}
                y, _ = m.apply({"params": {"scale": s, "bias": b}, "batch_stats": stats}, x,
                               mutable=["batch_stats"])
                return y
            if add:
                return lambda x, z, s, b: jax.nn.relu(bn(x, s, b) + z)
            return lambda x, s, b: jax.nn.relu(bn(x, s, b))

        def nbytes(rows, cols, itemsize):
            # Two-pass floors: the per-channel reduction over all rows must finish before
            # the elementwise pass, so x (and dy) are read twice.
            x, m, p = rows * cols * itemsize, -(-rows * cols // 32) * 4, cols * 4
            z = x if add else 0
            fwd = 3 * x + z + m + 2 * p            # stats: read x; then read x (z), write y, mask
            bwd = 5 * x + z + 2 * m + 4 * p        # reduce: dy, x, mask; then dy, x, mask -> dx (dz)
            return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}

        return BenchSpec(make_inputs=make_inputs, kernel=kernel, reference=reference,
                         flax=flax, nbytes=nbytes, num_params=2, epsilon=BN_EPSILON,
                         table_stages=("bwd",), table_alias=(op, "fwd_stats"),
                         title=" training, (rows, C) = (N*H*W, C)")

    return {"batch_norm_relu": spec(add=False), "batch_norm_add_relu": spec(add=True)}


# ------------------------------------------------ batch_norm family: rewrite patterns (jax_ops.fx) ---
# flax.linen.BatchNorm over the last axis (statistics over all others) followed by
# jax.nn.relu, or by a residual add and jax.nn.relu. Training (use_running_average=False)
# normalizes with the batch statistics, and flax's running averages read them: the
# batch mean and the biased batch variance are outputs of the pattern (used outside the
# match), which the op returns as it normalizes with them (float32; flax computes them
# in float32 too, with use_fast_variance E[x^2] - E[x]^2 clipped at 0 where the op
# takes the two-pass variance: equal up to rounding). Inference normalizes with the
# given running statistics. jnp.maximum(., 0) is not matched (its derivative at 0 is
# 0.5; the op's, like jax.nn.relu's, 0).

def flax_linen_batch_norm(x, scale, bias, mean, var, *, epsilon, training, fast, dtype):
    """flax.linen.BatchNorm(axis=-1) (flax/linen/normalization.py: BatchNorm.__call__,
    _compute_stats, _normalize) with its parameters and running statistics passed in;
    training: also the batch statistics."""
    from flax.linen import normalization as flax_norm
    reduction_axes = tuple(range(x.ndim - 1))
    if training:
        mean, var = flax_norm._compute_stats(x, reduction_axes, dtype=dtype,
                                             use_fast_variance=fast)
    stats = (mean, var)
    return flax_linen_normalize(x, mean, var, scale, bias, reduction_axes, epsilon, dtype), stats


def _bn_relu_reference(add: bool, training: bool):
    def reference(x, *args, epsilon, fast=True, dtype=None):
        z, args = (args[0], args[1:]) if add else (None, args)
        scale, bias, *stats = args
        mean, var = stats if stats else (None, None)
        y, stats = flax_linen_batch_norm(x, scale, bias, mean, var, epsilon=epsilon,
                                          training=training, fast=fast, dtype=dtype)
        y = jax.nn.relu(y + z) if add else jax.nn.relu(y)
        return (y, *stats) if training else y
    reference.__name__ = f"flax_linen_batch_norm{'_add' if add else ''}_relu"
    return reference


def _bn_static(training: bool):
    def static(avals, out_aval):
        return [{"dtype": d, **({"fast": fast} if training else {})}
                for fast in ((True, False) if training else (None,))
                for d in out_dtypes(avals, out_aval)]
    return static


def _bn_examples(add: bool, training: bool):
    """x f32/bf16 at rank 2 and 4 (NHWC), parameters float32 or x's dtype (present or
    absent), float32 running statistics at inference, z of x's dtype or float32."""
    out = []
    for shape in ((4, 8), (2, 2, 2, 8)):
        for xd, pd in ((_F32, _F32), (BF16, BF16), (BF16, _F32)):
            for has_scale, has_bias in ((True, True), (False, True), (True, False), (False, False)):
                zs = ((sds(shape, xd),) + ((sds(shape, _F32),) if xd != _F32 else ())) if add else (None,)
                for z in zs:
                    args = (sds(shape, xd),) + ((z,) if add else ())
                    args += (sds((8,), pd) if has_scale else None, sds((8,), pd) if has_bias else None)
                    if not training:
                        args += (sds((8,), _F32), sds((8,), _F32))
                    out.append(args)
    return out


def _bn_accepts(add: bool):
    def accepts(avals):
        x = avals[0]
        if x.dtype not in OP_DTYPES:
            return f"x is {x.dtype}; the jax_ops op takes float32, bfloat16, float16"
        if len(x.shape) < 2:
            return "x has rank < 2 (BatchNorm over the last axis needs rows)"
        if math.prod(x.shape[:-1]) == 0:
            return "x has no rows"
        c = x.shape[-1]
        rest = avals[2:] if add else avals[1:]
        for p in rest:
            if p is not None and (tuple(p.shape) != (c,) or p.dtype not in OP_DTYPES):
                return f"a parameter or statistic is {p.dtype}{list(p.shape)}, not ({c},) float"
        return None
    return accepts


def _bn_params(x, scale, bias):
    """scale, bias in float32 or x's dtype, one dtype (what the op takes)."""
    ps = [p for p in (scale, bias) if p is not None]
    if any(p.dtype not in (_F32, x.dtype) for p in ps) or len({p.dtype for p in ps}) > 1:
        scale = None if scale is None else scale.astype(jnp.float32)
        bias = None if bias is None else bias.astype(jnp.float32)
    return scale, bias


def _bn_relu_replacement(add: bool, training: bool):
    def replacement(x, *args, epsilon, out_dtype, **_):
        z, args = (args[0], args[1:]) if add else (None, args)
        scale, bias, *stats = args
        x = wider_x(x, out_dtype)  # flax computes from x widened to its result's dtype
        scale, bias = _bn_params(x, scale, bias)
        kw = {"epsilon": epsilon, "training": training}
        if not training:
            kw["mean"], kw["var"] = stats
        if add:
            return batch_norm_add_relu(x, z.astype(x.dtype), scale, bias, **kw)
        return batch_norm_relu(x, scale, bias, **kw)
    return replacement


def batch_norm_patterns() -> list[Pattern]:
    """batch_norm_add_relu, batch_norm_relu; training (outputs y and the batch mean and
    variance) and inference. They contain relu/add_relu patterns: priority 1."""
    if not flax_available():
        return []
    out = []
    for add in (True, False):
        name = "batch_norm_add_relu" if add else "batch_norm_relu"
        for training in (True, False):
            label = (f"flax.linen.BatchNorm({'training' if training else 'inference'}), "
                     f"jax.nn.relu{'(y + z)' if add else ''}")
            out.append(Pattern(
                name, [Formulation(_bn_relu_reference(add, training), _bn_static(training), label)],
                _bn_relu_replacement(add, training), _bn_examples(add, training),
                params={"epsilon": BN_EPSILON}, accepts=_bn_accepts(add),
                outputs=("y", "mean", "var") if training else ("y",),
                no_broadcast=(1,) if add else (), priority=1,
                note="BatchNorm over all but the last axis, then relu"))
    return out
