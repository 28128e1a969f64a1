"""LayerNorm and RMSNorm over the last axis: the declaration (core/op.py).

Forward stage  jax_ops_norm_fwd(x, scale?, bias?) -> (y, mean?, rstd?)
Backward stage jax_ops_norm_bwd(dy, x, mean?, rstd, scale?) -> (dx, dscale?, dbias?)

Absent operands/results (no scale, no bias, statistics not wanted, RMSNorm's mean)
are not bound. Statistics and arithmetic are float32; y and dx take x's dtype,
dscale/dbias their parameter's dtype. Reverse mode keeps x, float32 mean/rstd per row
and the parameters; the CUDA backward gets a float32 workspace for its per-block
dscale/dbias partials (XLA allocates it and drops it right after).
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from jax_ops.core import registry
from jax_ops.core.op import (ACT_DTYPES, Impl, Op, Stage, ffi, ffi_supports, match_vma,
                             pallas_supports, vmap_reference)
from jax_ops.core.op import dtype_name as _fmt_dtype
from pallas_kernels import layer_norm as pallas_norm

_F32 = jnp.dtype(jnp.float32)


# ------------------------------------------------------------- validation ---

def check_inputs(op: str, x, scale, bias, epsilon=None) -> None:
    """TypeError/ValueError naming the argument, expected and actual value."""
    if x.dtype not in ACT_DTYPES:
        raise TypeError(f"jax_ops.{op}: x must be float32, bfloat16 or float16; "
                        f"got dtype {_fmt_dtype(x.dtype)}")
    if x.ndim < 1:
        raise ValueError(f"jax_ops.{op}: x must have at least 1 dimension "
                         f"(normalization runs over the last axis); got shape {tuple(x.shape)}")
    cols = x.shape[-1]
    if cols < 1:
        raise ValueError(f"jax_ops.{op}: x's last axis must have size >= 1; got shape {tuple(x.shape)}")
    for name, p in (("scale", scale), ("bias", bias)):
        if p is None:
            continue
        if tuple(p.shape) != (cols,):
            raise ValueError(f"jax_ops.{op}: {name} must have shape ({cols},) to match x's last "
                             f"axis; got shape {tuple(p.shape)} (x has shape {tuple(x.shape)})")
        if p.dtype not in (_F32, x.dtype):
            raise TypeError(f"jax_ops.{op}: {name} must be float32 or x's dtype "
                            f"{_fmt_dtype(x.dtype)}; got {_fmt_dtype(p.dtype)}")
    if scale is not None and bias is not None and scale.dtype != bias.dtype:
        raise TypeError(f"jax_ops.{op}: scale and bias must share a dtype; got scale "
                        f"{_fmt_dtype(scale.dtype)} and bias {_fmt_dtype(bias.dtype)}")
    if epsilon is not None:
        if not isinstance(epsilon, (int, float, np.floating)) or isinstance(epsilon, bool):
            raise TypeError(f"jax_ops.{op}: epsilon must be a Python float; got {type(epsilon).__name__}")
        if not (float(epsilon) >= 0.0 and np.isfinite(epsilon)):
            raise ValueError(f"jax_ops.{op}: epsilon must be finite and >= 0; got {epsilon}")


def _stat_shape(x):
    return x.shape[:-1]


# ---------------------------------------------------------------- forward ---

def _fwd_abstract(x, scale, bias, *, epsilon, rms, with_stats):
    op = "rms_norm" if rms else "layer_norm"
    check_inputs(op, x, scale, bias)
    stat = core.ShapedArray(_stat_shape(x), _F32) if with_stats else None
    return core.ShapedArray(x.shape, x.dtype), (None if rms else stat), stat


def _row_sums(*arrays):
    """Sums over the last axis (the normalized one)."""
    return tuple(jnp.sum(a, axis=-1) for a in arrays)


def _fwd_reference(x, scale, bias, *, epsilon, rms, with_stats, row_sums=_row_sums, cols=None):
    """row_sums/cols: the sums over whole rows and the row length, when x holds only
    some of each row's columns (the normalized axis sharded: the sums are psum'ed)."""
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
    return (y.astype(x.dtype), mean if (with_stats and not rms) else None,
            rstd if with_stats else None)


def _fwd_batch(stage, args, dims, **params):
    x, scale, bias = args
    xd, sd, bd = dims
    if sd is not None or bd is not None:  # per-example parameters: rows cannot be folded
        return vmap_reference(stage, args, dims, **params)
    # A batched x is just more leading (row) axes: move the batch axis to the front.
    outs = stage.call(jnp.moveaxis(x, xd, 0), scale, bias, **params)
    return outs, [None if o is None else 0 for o in outs]


def _op_of(params) -> str:
    return "rms_norm" if params["rms"] else "layer_norm"


def _hidden_sharded(layout, params):
    return bool(layout.col_axes)


def _fwd_local(layout, mesh, x, scale, bias, **params):
    """Per device, the normalized axis sharded: per-row partial sums psum'ed over the
    column axes (O(rows) data), then the local columns normalized (jnp)."""
    def row_sums(*a):
        return jax.lax.psum(_row_sums(*a), layout.col_axes)
    return _fwd_reference(x, scale, bias, row_sums=row_sums, cols=layout.shape[-1], **params)


def _bwd_local(layout, mesh, dy, x, mean, rstd, scale, **params):
    """Per device, the normalized axis sharded: Σg·x̂ and Σg per row psum'ed over the
    column axes (one collective), dscale/dbias psum'ed over the row axes."""
    rows = tuple(range(x.ndim - 1))

    def row_sums(*a):
        return jax.lax.psum(_row_sums(*a), layout.col_axes)

    def col_sums(a):
        s = jnp.sum(a, axis=rows)
        return jax.lax.psum(s, layout.row_axes) if layout.row_axes else s
    return _bwd_reference(dy, x, mean, rstd, scale, row_sums=row_sums, cols=layout.shape[-1],
                          col_sums=col_sums, **params)


# --------------------------------------------------------------- backward ---

def workspace_shape(x_shape, want_param_grads: bool) -> tuple[int, ...]:
    """[2, P, cols] float32 partials (the CUDA and Pallas backward); at most P blocks.

    Only the P' <= P rows its grid uses are written and read, so a generous P costs
    memory, not traffic: up to 4096 blocks, at most 128 MiB. With a symbolic row count
    (jax.export) P is bounded by cols alone, so the workspace shape stays static."""
    if not want_param_grads:
        return (0,)
    cols = x_shape[-1]
    rows = math.prod(x_shape[:-1])
    p = min(4096, (128 << 20) // (8 * cols))
    if isinstance(rows, int):
        p = min(p, rows)
    return (2, max(1, p), cols)


def _bwd_abstract(dy, x, mean, rstd, scale, *, rms, dscale_dtype, dbias_dtype):
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"jax_ops norm backward: dy must match x; got dy {dy.shape} "
                         f"{_fmt_dtype(dy.dtype)} and x {x.shape} {_fmt_dtype(x.dtype)}")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"jax_ops norm backward: x must have a last axis of size >= 1; got shape {x.shape}")
    cols = x.shape[-1]
    if dscale_dtype and dbias_dtype and jnp.dtype(dscale_dtype) != jnp.dtype(dbias_dtype):
        raise TypeError(f"jax_ops norm backward: dscale and dbias must share a dtype; got "
                        f"{_fmt_dtype(dscale_dtype)} and {_fmt_dtype(dbias_dtype)}")
    dscale = core.ShapedArray((cols,), dscale_dtype) if dscale_dtype else None
    dbias = core.ShapedArray((cols,), dbias_dtype) if dbias_dtype else None
    return core.ShapedArray(x.shape, x.dtype), dscale, dbias


def _bwd_reference(dy, x, mean, rstd, scale, *, rms, dscale_dtype, dbias_dtype,
                   row_sums=_row_sums, cols=None, col_sums=None):
    """row_sums/cols as in _fwd_reference; col_sums(a): a's sum over all rows (psum'ed
    over the devices holding other rows when the rows are sharded)."""
    xf, dyf = x.astype(jnp.float32), dy.astype(jnp.float32)
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
    rows = tuple(range(x.ndim - 1))
    if col_sums is None:
        col_sums = lambda a: jnp.sum(a, axis=rows)  # noqa: E731
    dscale = col_sums(dyf * xhat).astype(dscale_dtype) if dscale_dtype else None
    dbias = col_sums(dyf).astype(dbias_dtype) if dbias_dtype else None
    return dx.astype(x.dtype), dscale, dbias


def _bwd_batch(stage, args, dims, **params):
    dy, x, mean, rstd, scale = args
    if dims[4] is not None:  # per-example scale
        return vmap_reference(stage, args, dims, **params)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)

    def front(a, d):  # batch axis first; unbatched row operands broadcast to it
        return jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size,) + a.shape)

    dy, x, rstd = front(dy, dims[0]), front(x, dims[1]), front(rstd, dims[3])
    if not params["rms"]:
        mean = front(mean, dims[2])
    # dx: batch folded into rows. dscale/dbias are per example under vmap, so
    # they are summed per batch element here instead of over all rows.
    dx, _, _ = stage.call(dy, x, mean, rstd, scale, rms=params["rms"], dscale_dtype=None,
                          dbias_dtype=None, implementation=params["implementation"])
    rows = tuple(range(1, x.ndim - 1))
    dyf = dy.astype(jnp.float32)
    dscale = dbias = None
    if params["dscale_dtype"]:
        m = 0.0 if params["rms"] else mean[..., None]
        xhat = (x.astype(jnp.float32) - m) * rstd[..., None]
        dscale = jnp.sum(dyf * xhat, axis=rows).astype(params["dscale_dtype"])
    if params["dbias_dtype"]:
        dbias = jnp.sum(dyf, axis=rows).astype(params["dbias_dtype"])
    return (dx, dscale, dbias), (0, 0 if dscale is not None else None, 0 if dbias is not None else None)


# --------------------------------------------------------- implementations ---

def _rows_cols(shape):
    return int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]


def _pallas_fwd(call, x, scale, bias, *, epsilon, rms, with_stats):
    rows, cols = _rows_cols(x.shape)
    y, mean, rstd = pallas_norm.norm_fwd(
        x.reshape(rows, cols), scale, bias, epsilon=epsilon, rms=rms, with_stats=with_stats,
        config=call.config, interpret=call.interpret)
    stat = x.shape[:-1]
    return (y.reshape(x.shape), None if mean is None else mean.reshape(stat),
            None if rstd is None else rstd.reshape(stat))


def _pallas_bwd(call, dy, x, mean, rstd, scale, *, rms, dscale_dtype, dbias_dtype):
    rows, cols = _rows_cols(x.shape)
    ws = workspace_shape(x.shape, bool(dscale_dtype or dbias_dtype))
    dx, dscale, dbias, _ = pallas_norm.norm_bwd(
        dy.reshape(rows, cols), x.reshape(rows, cols), None if rms else mean.reshape(rows),
        rstd.reshape(rows), scale, rms=rms, work_shape=ws, config=call.config,
        interpret=call.interpret)
    return (dx.reshape(x.shape), dscale.astype(dscale_dtype) if dscale_dtype else None,
            dbias.astype(dbias_dtype) if dbias_dtype else None)


def _workspace(call, operands, params):
    x = operands[1]
    return core.ShapedArray(workspace_shape(x.shape, bool(params["dscale_dtype"] or params["dbias_dtype"])), _F32)


def _pallas_configs(q):
    return pallas_norm.candidate_configs(max(q.rows or 1, 1), q.cols, q.stage)


def _user_adapter(fn, backward, tunable):
    """register_implementation's adapter (signatures in layer_norm's docstring):
    fn(x2d, scale[, bias], *, epsilon[, config]) -> y or (y[, mean], rstd);
    backward(dy2d, x2d, mean | None, rstd, scale, [config]) -> (dx, dscale[, dbias])."""
    def fwd(call, x, scale, bias, *, epsilon, rms, with_stats):
        rows, cols = _rows_cols(x.shape)
        kw = {"config": call.config} if tunable else {}
        out = fn(x.reshape(rows, cols), *([scale] if rms else [scale, bias]), epsilon=epsilon, **kw)
        y = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(out, (tuple, list)) and with_stats:  # the kernel's own statistics
            mean = None if rms else jnp.asarray(out[1], jnp.float32).reshape(x.shape[:-1])
            rstd = jnp.asarray(out[-1], jnp.float32).reshape(x.shape[:-1])
        else:  # statistics by jnp where reverse mode needs them; XLA drops the unused y
            _, mean, rstd = _fwd_reference(x, scale, bias, epsilon=epsilon, rms=rms,
                                           with_stats=with_stats)
        return jnp.asarray(y).astype(x.dtype).reshape(x.shape), mean, rstd

    def bwd(call, dy, x, mean, rstd, scale, *, rms, dscale_dtype, dbias_dtype):
        rows, cols = _rows_cols(x.shape)
        kw = {"config": call.config} if tunable else {}
        out = backward(dy.reshape(rows, cols), x.reshape(rows, cols),
                       None if rms else mean.reshape(rows), rstd.reshape(rows), scale, **kw)
        dx, dscale = out[0], out[1]
        dbias = None if rms else out[2]
        return (jnp.asarray(dx).astype(x.dtype).reshape(x.shape),
                jnp.asarray(dscale).astype(dscale_dtype) if dscale_dtype else None,
                jnp.asarray(dbias).astype(dbias_dtype) if dbias_dtype else None)

    return {"fwd": fwd, **({"bwd": bwd} if backward is not None else {})}


# ----------------------------------------------------------- declaration ---

FWD = Stage("norm_fwd", "fwd", ("x", "scale?", "bias?"), ("y", "mean?", "rstd?"),
            op_of=_op_of, abstract=_fwd_abstract, reference=_fwd_reference, batch=_fwd_batch,
            roles={"x": "x", "scale": "cols", "bias": "cols", "y": "x", "mean": "rows", "rstd": "rows"},
            needs_local=_hidden_sharded, local=_fwd_local,
            variant=lambda p: "stats" if p["with_stats"] else "")
BWD = Stage("norm_bwd", "bwd", ("dy", "x", "mean?", "rstd", "scale?"), ("dx", "dscale?", "dbias?"),
            op_of=_op_of, abstract=_bwd_abstract, reference=_bwd_reference, batch=_bwd_batch,
            roles={"dy": "x", "x": "x", "mean": "rows", "rstd": "rows", "scale": "cols",
                   "dx": "x", "dscale": "colsum", "dbias": "colsum"},
            needs_local=_hidden_sharded, local=_bwd_local)


def _residuals(ops, outs, params):
    return ops["x"], outs["mean"], outs["rstd"], ops["scale"]


def _backward(res, cts, wanted, params, in_avals):
    x, mean, rstd, scale = res
    dtype = {n: (in_avals[n].dtype if n in wanted else None) for n in ("scale", "bias")}
    dx, dscale, dbias = BWD.call(cts["y"], x, mean, rstd, scale, rms=params["rms"],
                                 dscale_dtype=dtype["scale"], dbias_dtype=dtype["bias"],
                                 implementation=params["implementation"])
    return {"x": dx, "scale": dscale, "bias": dbias}


NORM = Op(
    ("layer_norm", "rms_norm"), FWD, BWD,
    outputs=lambda p: ("y",), train=lambda p: dict(p, with_stats=True),
    residuals=_residuals, backward=_backward, user_adapter=_user_adapter,
    impls={
        "cuda": Impl({"fwd": ffi("jax_ops_norm_fwd",
                                 lambda p: {"epsilon": np.float32(p["epsilon"]), "rms": bool(p["rms"])}),
                      "bwd": ffi("jax_ops_norm_bwd", lambda p: {"rms": bool(p["rms"])},
                                 scratch=_workspace)},
                     supports=ffi_supports("jax_ops_norm_fwd"),
                     description="hand CUDA kernels through XLA FFI (host C++ on CPU)"),
        "pallas": Impl({"fwd": _pallas_fwd, "bwd": _pallas_bwd},
                       supports=pallas_supports(lambda q: pallas_norm.supports(q.cols)),
                       configs=_pallas_configs, description="Pallas kernels (Triton back end)"),
    })


# ------------------------------------------------------------- public API ---

def _prepare(op, x, scale, bias, epsilon, implementation):
    registry.check_name(op, implementation)
    x = jnp.asarray(x)
    scale = None if scale is None else jnp.asarray(scale)
    bias = None if bias is None else jnp.asarray(bias)
    check_inputs(op, x, scale, bias, epsilon)
    return x, scale, bias


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
    x, scale, bias = _prepare("layer_norm", x, scale, bias, epsilon, implementation)
    implementation = implementation or registry.override_for("layer_norm")
    x, scale, bias = match_vma(x, scale, bias)
    return FWD.call(x, scale, bias, epsilon=float(epsilon), rms=False, with_stats=False,
                    implementation=implementation)[0]


def rms_norm(x, scale=None, *, epsilon: float = 1e-6, implementation: str | None = None):
    """RMSNorm over the last axis: x / sqrt(mean(x²) + epsilon) * scale.

    Same argument rules as `layer_norm` (no bias).
    """
    x, scale, _ = _prepare("rms_norm", x, scale, None, epsilon, implementation)
    implementation = implementation or registry.override_for("rms_norm")
    x, scale = match_vma(x, scale)
    return FWD.call(x, scale, None, epsilon=float(epsilon), rms=True, with_stats=False,
                    implementation=implementation)[0]
