"""BatchNorm+ReLU and BatchNorm+Add+ReLU for training and inference, channels last.

Forward primitive  jax_ops_bn_relu_fwd(x, z, scale, bias, mean_in, var_in)
                     -> (y, mask, mean, var, rstd, work)
Backward primitive jax_ops_bn_relu_bwd(dy, x, mask, mean, rstd, scale, gmean, gvar)
                     -> (dx, dz, dscale, dbias, work)

x is (..., C): statistics per channel over all other axes (rows = their product).
Parameters and statistics are float32 at the primitive (the public functions cast
and autodiff casts the gradients back). Absent operands/results are zero-element
float32 arrays. `work` is the kernels' float32 workspace of per-block partials
((3, P, C) Welford partials forward, (2, P, C) gradient sums backward; P = work_rows).

  training:  mean, var = batch mean and BIASED batch variance (two-stage Welford,
             no atomics), rstd = 1/sqrt(var + epsilon)
  inference: mean, var = the given running statistics; one elementwise pass
  pre = (x - mean) * (scale * rstd) + bias [+ z];  y = relu(pre);  mask: 1 bit per
  element, pre > 0 (the layout of jax_ops.relu).
Backward, g = dy where the bit is set else 0, xhat = (x - mean) * rstd, N = rows:
  dbias = Σ g, dscale = Σ g·xhat, dz = g
  training:  dx = a·g + b·xhat + c, a = scale·rstd, b = (2·gvar/rstd − a·dscale)/N,
             c = (gmean − a·dbias)/N  (gmean/gvar: cotangents of the returned mean/var)
  inference: dx = a·g; the given mean/var get dmean = −a·dbias, dvar = −½·a·rstd·dscale.
The VJP keeps x, the mask, float32 mean/rstd per channel and scale.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from jax_ops import registry
from jax_ops.layer_norm import check_inputs
from jax_ops.primitive import empty as _empty, dtype_name as _fmt_dtype  # shared helpers
from jax_ops.primitive import (define_primitive, ffi_lowering, ffi_supports, jnp_lowering,
                               match_vma, pallas_lowering, pallas_supports, user_lowerings,
                               vmap_reference)
from jax_ops.relu import MASK_DTYPE, check_z, mask_policy, mask_shape, pack_bits, relu_out, unpack_bits
from jax_ops.sharding import Rules
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


def _op_of(params) -> str:
    return "batch_norm_add_relu" if params["has_z"] else "batch_norm_relu"


# ---------------------------------------------------------------- forward ---

def _fwd_abstract(x, z, scale, bias, mean_in, var_in, *, epsilon, training, has_z, implementation):
    op = _op_of({"has_z": has_z})
    if x.ndim < 2:
        raise ValueError(f"jax_ops.{op}: x must have rank >= 2 (channels last); got shape {x.shape}")
    rows, c = _rows_channels(x.shape)
    if has_z and (z.shape != x.shape or z.dtype != x.dtype):
        raise ValueError(f"jax_ops.{op} forward: z must match x; got z {z.shape} "
                         f"{_fmt_dtype(z.dtype)} and x {x.shape} {_fmt_dtype(x.dtype)}")
    stats = [scale, bias] + ([] if training else [mean_in, var_in])
    if any(a.shape != (c,) or a.dtype != _F32 for a in stats):
        raise ValueError(f"jax_ops.{op} forward: scale/bias{'' if training else '/mean/var'} must be "
                         f"float32 of shape ({c},); got {[(a.shape, _fmt_dtype(a.dtype)) for a in stats]}")
    chan = core.ShapedArray((c,), _F32)
    work = core.ShapedArray((3, work_rows(rows, c), c) if training else (0,), _F32)
    return (core.ShapedArray(x.shape, x.dtype),
            core.ShapedArray(mask_shape(x.shape), MASK_DTYPE), chan, chan, chan, work)


def batch_stats(x2):
    """Per-channel mean and biased variance of (rows, C), two-pass in float32."""
    xf = x2.astype(jnp.float32)
    mean = jnp.mean(xf, axis=0)
    return mean, jnp.mean(jnp.square(xf - mean), axis=0)


def _fwd_reference(x, z, scale, bias, mean_in, var_in, *, epsilon, training, has_z):
    rows, c = _rows_channels(x.shape)
    x2 = x.reshape(rows, c)
    mean, var = batch_stats(x2) if training else (mean_in, var_in)
    rstd = jax.lax.rsqrt(var + epsilon)
    pre = (x2.astype(jnp.float32) - mean) * (scale * rstd) + bias
    if has_z:
        pre = pre + z.reshape(rows, c).astype(jnp.float32)
    work = jnp.zeros((3, work_rows(rows, c), c) if training else (0,), jnp.float32)
    return (relu_out(pre).astype(x.dtype).reshape(x.shape),
            pack_bits(pre > 0).reshape(mask_shape(x.shape)), mean, var, rstd, work)


def _fwd_batch(args, dims, **params):
    # Statistics are per example under vmap: the jnp reference, vmapped.
    return vmap_reference(_fwd_reference, args, dims, params)


# ---------------------------------------------------------------- sharding ---
# Channels sharded: statistics are per channel, each device runs the kernels on its
# channels. Rows sharded (data parallelism) in training: the statistics are those of
# the global batch (jit semantics): per-channel partial sums psum'ed over the row axes
# (two-pass: Σx, then Σ(x − mean)²; O(C) data each), then the kernel's inference pass
# normalizes the local rows with them; the backward psums Σg and Σg·x̂ per channel and
# forms dx with jnp. At inference each device normalizes its rows; dscale/dbias are
# psum'ed.

def _rows_sharded_training(layout, params):
    return bool(params["training"]) and bool(layout.row_axes)


def _global_rows(layout):
    return math.prod(layout.shape[:-1])


def _fwd_local(layout, mesh, x, z, scale, bias, mean_in, var_in, *, epsilon, training, has_z,
               implementation):
    rows, c = _rows_channels(x.shape)
    xf = x.reshape(rows, c).astype(jnp.float32)
    n = _global_rows(layout)
    mean = jax.lax.psum(jnp.sum(xf, axis=0), layout.row_axes) / n
    var = jax.lax.psum(jnp.sum(jnp.square(xf - mean), axis=0), layout.row_axes) / n
    y, mask, _, _, rstd, _ = bn_fwd_p.bind(x, z, scale, bias, mean, var, epsilon=epsilon,
                                           training=False, has_z=has_z,
                                           implementation=implementation)
    return y, mask, mean, var, rstd, None


def _bwd_local(layout, mesh, *args, implementation, **params):
    def col_sums(arrays):
        return jax.lax.psum(tuple(jnp.sum(a, axis=0) for a in arrays), layout.row_axes)
    return _bwd_reference(*args, col_sums=col_sums, total_rows=_global_rows(layout), **params)


FWD_RULES = Rules(ins=lambda p: ("x", "x", "cols", "cols", "cols", "cols"),
                  outs=lambda p: ("x", "mask", "cols", "cols", "cols", "none"),
                  policy=mask_policy, needs_local=_rows_sharded_training, local=_fwd_local)
BWD_RULES = Rules(ins=lambda p: ("x", "x", "mask", "cols", "cols", "cols", "cols", "cols"),
                  outs=lambda p: ("x", "x", "colsum", "colsum", "none"),
                  policy=mask_policy, needs_local=_rows_sharded_training, local=_bwd_local)


bn_fwd_p = define_primitive("bn_relu_fwd", stage="fwd", op_of=_op_of, abstract_eval=_fwd_abstract,
                            batching_rule=_fwd_batch, sharding=FWD_RULES,
                            variant_of=lambda p: "stats" if p["training"] else "")


# --------------------------------------------------------------- backward ---

def _bwd_abstract(dy, x, mask, mean, rstd, scale, gmean, gvar, *, training, has_z, implementation):
    op = _op_of({"has_z": has_z})
    rows, c = _rows_channels(x.shape)
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"jax_ops.{op} backward: dy must match x; got dy {dy.shape} "
                         f"{_fmt_dtype(dy.dtype)} and x {x.shape} {_fmt_dtype(x.dtype)}")
    if tuple(mask.shape) != mask_shape(x.shape) or mask.dtype != MASK_DTYPE:
        raise ValueError(f"jax_ops.{op} backward: mask must be uint32 of shape "
                         f"{mask_shape(x.shape)}; got {mask.shape} {_fmt_dtype(mask.dtype)}")
    chan = core.ShapedArray((c,), _F32)
    dz = core.ShapedArray(x.shape, x.dtype) if has_z else core.ShapedArray((0,), _F32)
    return (core.ShapedArray(x.shape, x.dtype), dz, chan, chan,
            core.ShapedArray((2, work_rows(rows, c), c), _F32))


def _bwd_reference(dy, x, mask, mean, rstd, scale, gmean, gvar, *, training, has_z,
                   col_sums=None, total_rows=None):
    """col_sums(a): a's per-channel sums over all rows, total_rows: their count (psum'ed
    over devices when the rows are sharded)."""
    rows, c = _rows_channels(x.shape)
    if col_sums is None:
        def col_sums(arrays):
            return tuple(jnp.sum(a, axis=0) for a in arrays)
    total_rows = rows if total_rows is None else total_rows
    g = jnp.where(unpack_bits(mask, (rows, c)), dy.reshape(rows, c).astype(jnp.float32), 0.0)
    xhat = (x.reshape(rows, c).astype(jnp.float32) - mean) * rstd
    dbias, dscale = col_sums((g, g * xhat))
    a = scale * rstd
    dx = a * g
    if training:
        dx = dx + ((2.0 * gvar / rstd - a * dscale) / total_rows) * xhat + (gmean - a * dbias) / total_rows
    dz = g.astype(x.dtype).reshape(x.shape) if has_z else _empty()
    work = jnp.zeros((2, work_rows(rows, c), c), jnp.float32)
    return dx.astype(x.dtype).reshape(x.shape), dz, dscale, dbias, work


def _bwd_batch(args, dims, **params):
    return vmap_reference(_bwd_reference, args, dims, params)


bn_bwd_p = define_primitive("bn_relu_bwd", stage="bwd", op_of=_op_of, abstract_eval=_bwd_abstract,
                            batching_rule=_bwd_batch, sharding=BWD_RULES)


# --------------------------------------------------------- implementations ---

def _pallas_fwd(x, z, scale, bias, mean_in, var_in, *, epsilon, training, has_z, config, interpret):
    rows, c = _rows_channels(x.shape)
    if rows == 0:
        return _fwd_reference(x, z, scale, bias, mean_in, var_in, epsilon=epsilon,
                              training=training, has_z=has_z)
    y, mask, mean, var, rstd = pallas_bn.bn_relu_fwd(
        x.reshape(rows, c), z.reshape(rows, c) if has_z else None, scale, bias,
        None if training else mean_in, None if training else var_in, epsilon=epsilon,
        training=training, config=config, interpret=interpret)
    work = jnp.zeros((3, work_rows(rows, c), c) if training else (0,), jnp.float32)
    return y.reshape(x.shape), mask.reshape(mask_shape(x.shape)), mean, var, rstd, work


def _pallas_bwd(dy, x, mask, mean, rstd, scale, gmean, gvar, *, training, has_z, config, interpret):
    rows, c = _rows_channels(x.shape)
    if rows == 0:
        return _bwd_reference(dy, x, mask, mean, rstd, scale, gmean, gvar, training=training,
                              has_z=has_z)
    dx, dz, dscale, dbias = pallas_bn.bn_relu_bwd(
        dy.reshape(rows, c), x.reshape(rows, c), mask.reshape(-1), mean, rstd, scale,
        gmean if training else None, gvar if training else None, training=training, has_z=has_z,
        config=config, interpret=interpret)
    work = jnp.zeros((2, work_rows(rows, c), c), jnp.float32)
    return (dx.reshape(x.shape), dz.reshape(x.shape) if has_z else _empty(), dscale, dbias, work)


def _pallas_configs(q):
    rows, c = (q.rows or 1, q.cols or 1)
    return pallas_bn.candidate_configs(max(rows, 1), c, q.stage)


def _user_lowerings(op):
    """Adapter for register_implementation. fn(x, z, scale, bias, mean, var, *, epsilon,
    training) with x, z (rows, C) (z None for batch_norm_relu), float32 (C,) parameters,
    mean/var None when training; returns y, or (y, batch_mean, batch_var) when training
    (statistics computed by jnp where it returns y only). The mask is packed from y > 0.
    backward(dy, x, mask, mean, rstd, scale, gmean, gvar, *, training) -> (dx, dz|None,
    dscale, dbias), gmean/gvar None at inference."""
    def adapt(fn, backward, tunable):
        def fwd(x, z, scale, bias, mean_in, var_in, *, epsilon, training, has_z, config):
            rows, c = _rows_channels(x.shape)
            kw = {"config": config} if tunable else {}
            out = fn(x.reshape(rows, c), z.reshape(rows, c) if has_z else None, scale, bias,
                     None if training else mean_in, None if training else var_in,
                     epsilon=epsilon, training=training, **kw)
            y = out[0] if isinstance(out, (tuple, list)) else out
            if training and isinstance(out, (tuple, list)):
                mean, var = (jnp.asarray(v, jnp.float32) for v in out[1:3])
            elif training:
                mean, var = batch_stats(x.reshape(rows, c))
            else:
                mean, var = mean_in, var_in
            y = jnp.asarray(y).astype(x.dtype).reshape(x.shape)
            work = jnp.zeros((3, work_rows(rows, c), c) if training else (0,), jnp.float32)
            return (y, pack_bits(y > 0).reshape(mask_shape(x.shape)), mean, var,
                    jax.lax.rsqrt(var + epsilon), work)

        def bwd(dy, x, mask, mean, rstd, scale, gmean, gvar, *, training, has_z, config):
            rows, c = _rows_channels(x.shape)
            kw = {"config": config} if tunable else {}
            dx, dz, dscale, dbias = backward(
                dy.reshape(rows, c), x.reshape(rows, c), mask.reshape(-1), mean, rstd, scale,
                gmean if training else None, gvar if training else None, training=training, **kw)
            return (jnp.asarray(dx).astype(x.dtype).reshape(x.shape),
                    jnp.asarray(dz).astype(x.dtype).reshape(x.shape) if has_z else _empty(),
                    jnp.asarray(dscale, jnp.float32), jnp.asarray(dbias, jnp.float32),
                    jnp.zeros((2, work_rows(rows, c), c), jnp.float32))

        return user_lowerings(fwd, bwd if backward is not None else None)
    return adapt


def _register_builtins():
    for op in ("batch_norm_relu", "batch_norm_add_relu"):
        registry.add(registry.Implementation(
            op, "xla", {"fwd": jnp_lowering(_fwd_reference), "bwd": jnp_lowering(_bwd_reference)},
            supports=lambda q: True, description="plain jax.numpy, fused by XLA"))
        registry.add(registry.Implementation(
            op, "cuda",
            {"fwd": ffi_lowering("jax_ops_bn_relu_fwd", lambda p: {
                "epsilon": np.float32(p["epsilon"]), "training": bool(p["training"]),
                "has_z": bool(p["has_z"])}, flat_results=(1,)),
             "bwd": ffi_lowering("jax_ops_bn_relu_bwd", lambda p: {
                 "training": bool(p["training"]), "has_z": bool(p["has_z"])}, flat_operands=(2,))},
            supports=ffi_supports("jax_ops_bn_relu_fwd"),
            description="hand CUDA kernels through XLA FFI (host C++ on CPU)"))
        registry.add(registry.Implementation(
            op, "pallas", {"fwd": pallas_lowering(_pallas_fwd), "bwd": pallas_lowering(_pallas_bwd)},
            supports=pallas_supports(lambda q: pallas_bn.supports(max(q.rows or 1, 1), q.cols or 1)),
            configs=_pallas_configs, description="Pallas kernels (Triton back end)"))
        registry.define_user_adapter(op, _user_lowerings(op))


_register_builtins()


# ------------------------------------------------------------- custom VJP ---

@partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _bn(x, z, scale, bias, mean_in, var_in, epsilon, training, has_z, implementation):
    y, _, mean, var, _, _ = bn_fwd_p.bind(x, z, scale, bias, mean_in, var_in, epsilon=epsilon,
                                          training=training, has_z=has_z,
                                          implementation=implementation)
    return y, mean, var


def _bn_fwd(x, z, scale, bias, mean_in, var_in, epsilon, training, has_z, implementation):
    y, mask, mean, var, rstd, _ = bn_fwd_p.bind(x, z, scale, bias, mean_in, var_in,
                                                epsilon=epsilon, training=training, has_z=has_z,
                                                implementation=implementation)
    return (y, mean, var), (x, mask, mean, rstd, scale)


def _bn_bwd(epsilon, training, has_z, implementation, res, cts):
    x, mask, mean, rstd, scale = res
    dy, gmean, gvar = cts
    dx, dz, dscale, dbias, _ = bn_bwd_p.bind(
        dy, x, mask, mean, rstd, scale, gmean if training else _empty(),
        gvar if training else _empty(), training=training, has_z=has_z,
        implementation=implementation)
    if training:  # mean_in/var_in are placeholders
        dmean_in = dvar_in = _empty()
    else:  # the given statistics (returned unchanged as mean/var) get their gradients
        a = scale * rstd
        dmean_in = gmean - a * dbias
        dvar_in = gvar - 0.5 * a * rstd * dscale
    return dx, (dz if has_z else _empty()), dscale, dbias, dmean_in, dvar_in


_bn.defvjp(_bn_fwd, _bn_bwd)


# ------------------------------------------------------------- public API ---

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


def _call(op, x, z, scale, bias, epsilon, training, mean, var, implementation):
    registry.check_name(op, implementation)
    x = jnp.asarray(x)
    scale = None if scale is None else jnp.asarray(scale)
    bias = None if bias is None else jnp.asarray(bias)
    check_inputs(op, x, scale, bias, epsilon)
    if x.ndim < 2:
        raise ValueError(f"jax_ops.{op}: x must have rank >= 2 (channels on the last axis, "
                         f"statistics over the others); got shape {tuple(x.shape)}")
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(f"jax_ops.{op}: training must be a Python bool; got {type(training).__name__}")
    rows, c = _rows_channels(x.shape)
    if z is not None:
        z = jnp.asarray(z)
        check_z(op, x, z)
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
        mean_in = var_in = _empty()
    else:
        mean_in = _check_stat(op, "mean", mean, c).astype(jnp.float32)
        var_in = _check_stat(op, "var", var, c).astype(jnp.float32)
    scale32 = jnp.ones((c,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    bias32 = jnp.zeros((c,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    implementation = implementation or registry.override_for(op)
    x, z, scale32, bias32, mean_in, var_in = match_vma(x, z, scale32, bias32, mean_in, var_in)
    y, batch_mean, batch_var = _bn(x, _empty() if z is None else z, scale32, bias32, mean_in,
                                   var_in, float(epsilon), bool(training), z is not None,
                                   implementation)
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
