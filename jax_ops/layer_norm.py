"""LayerNorm and RMSNorm over the last axis, as JAX primitives with a custom VJP.

Forward primitive  jax_ops_norm_fwd(x, scale, bias) -> (y, mean, rstd)
Backward primitive jax_ops_norm_bwd(dy, x, mean, rstd, scale) -> (dx, dscale, dbias, work)
  (work: float32 workspace for the CUDA kernels' per-block dscale/dbias partials;
  XLA allocates it and drops it right after)

Absent operands/results (no scale, no bias, statistics not wanted, RMSNorm's
mean) are zero-element float32 arrays, so one primitive serves every variant.
Statistics and arithmetic are float32; y and dx take x's dtype, dscale/dbias
their parameter's dtype. The VJP keeps x, float32 mean/rstd per row and the
parameters as residuals.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from jax_ops import registry
from jax_ops.sharding import Rules
from jax_ops.primitive import ACT_DTYPES, empty as _empty, present as _present, dtype_name as _fmt_dtype  # noqa: F401 - shared helpers
from jax_ops.primitive import (define_primitive, ffi_lowering, ffi_supports, jnp_lowering,
                               match_vma, pallas_lowering, pallas_supports, user_lowerings,
                               vmap_reference)
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

def _fwd_abstract(x, scale, bias, *, epsilon, rms, with_stats, implementation):
    op = "rms_norm" if rms else "layer_norm"
    check_inputs(op, x, scale if _present(scale) else None, bias if _present(bias) else None)
    stat = core.ShapedArray(_stat_shape(x) if with_stats else (0,), _F32)
    mean = stat if (with_stats and not rms) else core.ShapedArray((0,), _F32)
    return core.ShapedArray(x.shape, x.dtype), mean, stat


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
    if _present(scale):
        y = y * scale.astype(jnp.float32)
    if _present(bias):
        y = y + bias.astype(jnp.float32)
    mean_out = mean if (with_stats and not rms) else _empty()
    return y.astype(x.dtype), mean_out, rstd if with_stats else _empty()


def _fwd_batch(args, dims, **params):
    x, scale, bias = args
    xd, sd, bd = dims
    if sd is not None or bd is not None:  # per-example parameters: rows cannot be folded
        return vmap_reference(_fwd_reference, args, dims, params)
    # A batched x is just more leading (row) axes: move the batch axis to the front.
    x = jnp.moveaxis(x, xd, 0)
    y, mean, rstd = norm_fwd_p.bind(x, scale, bias, **params)
    # Statistics exist (and are batched) as the params say; their shape can't tell
    # when the batch is empty.
    stats = params["with_stats"]
    return (y, mean, rstd), (0, 0 if stats and not params["rms"] else None, 0 if stats else None)


def _op_of(params) -> str:
    return "rms_norm" if params["rms"] else "layer_norm"


def _hidden_sharded(layout, params):
    return bool(layout.col_axes)


def _fwd_local(layout, mesh, x, scale, bias, *, implementation, **params):
    """Per device, the normalized axis sharded: per-row partial sums psum'ed over the
    column axes (O(rows) data), then the local columns normalized (jnp)."""
    def row_sums(*a):
        return jax.lax.psum(_row_sums(*a), layout.col_axes)
    return _fwd_reference(x, scale, bias, row_sums=row_sums, cols=layout.shape[-1], **params)


def _bwd_local(layout, mesh, dy, x, mean, rstd, scale, *, implementation, **params):
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


FWD_RULES = Rules(ins=lambda p: ("x", "cols", "cols"), outs=lambda p: ("x", "rows", "rows"),
                  needs_local=_hidden_sharded, local=_fwd_local)
BWD_RULES = Rules(ins=lambda p: ("x", "x", "rows", "rows", "cols"),
                  outs=lambda p: ("x", "colsum", "colsum", "none"),
                  needs_local=_hidden_sharded, local=_bwd_local)


norm_fwd_p = define_primitive("norm_fwd", stage="fwd", op_of=_op_of, abstract_eval=_fwd_abstract,
                              batching_rule=_fwd_batch, sharding=FWD_RULES,
                              variant_of=lambda p: "stats" if p["with_stats"] else "")


# --------------------------------------------------------------- backward ---

def workspace_shape(x_shape, want_param_grads: bool) -> tuple[int, ...]:
    """[2, P, cols] float32 partials; the CUDA backward runs at most P blocks.

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


def _bwd_abstract(dy, x, mean, rstd, scale, *, rms, dscale_dtype, dbias_dtype, implementation):
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"jax_ops norm backward: dy must match x; got dy {dy.shape} "
                         f"{_fmt_dtype(dy.dtype)} and x {x.shape} {_fmt_dtype(x.dtype)}")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"jax_ops norm backward: x must have a last axis of size >= 1; got shape {x.shape}")
    cols = x.shape[-1]
    if dscale_dtype and dbias_dtype and jnp.dtype(dscale_dtype) != jnp.dtype(dbias_dtype):
        raise TypeError(f"jax_ops norm backward: dscale and dbias must share a dtype; got "
                        f"{_fmt_dtype(dscale_dtype)} and {_fmt_dtype(dbias_dtype)}")
    dscale = core.ShapedArray((cols,) if dscale_dtype else (0,), dscale_dtype or _F32)
    dbias = core.ShapedArray((cols,) if dbias_dtype else (0,), dbias_dtype or _F32)
    work = core.ShapedArray(workspace_shape(x.shape, bool(dscale_dtype or dbias_dtype)), _F32)
    return core.ShapedArray(x.shape, x.dtype), dscale, dbias, work


def _bwd_reference(dy, x, mean, rstd, scale, *, rms, dscale_dtype, dbias_dtype,
                   row_sums=_row_sums, cols=None, col_sums=None):
    """row_sums/cols as in _fwd_reference; col_sums(a): a's sum over all rows (psum'ed
    over the devices holding other rows when the rows are sharded)."""
    xf, dyf = x.astype(jnp.float32), dy.astype(jnp.float32)
    cols = x.shape[-1] if cols is None else cols
    mean = 0.0 if rms else mean[..., None]
    xhat = (xf - mean) * rstd[..., None]
    g = dyf * scale.astype(jnp.float32) if _present(scale) else dyf
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
    dscale = col_sums(dyf * xhat).astype(dscale_dtype) if dscale_dtype else _empty()
    dbias = col_sums(dyf).astype(dbias_dtype) if dbias_dtype else _empty()
    work = jnp.zeros(workspace_shape(x.shape, bool(dscale_dtype or dbias_dtype)), jnp.float32)
    return dx.astype(x.dtype), dscale, dbias, work


def _bwd_batch(args, dims, **params):
    dy, x, mean, rstd, scale = args
    if dims[4] is not None:  # per-example scale
        return vmap_reference(_bwd_reference, args, dims, params)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)

    def front(a, d):  # batch axis first; unbatched row operands broadcast to it
        return jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size,) + a.shape)

    dy, x, rstd = front(dy, dims[0]), front(x, dims[1]), front(rstd, dims[3])
    if not params["rms"]:
        mean = front(mean, dims[2])
    # dx: batch folded into rows. dscale/dbias are per example under vmap, so
    # they are summed per batch element here instead of over all rows.
    dx, _, _, work = norm_bwd_p.bind(dy, x, mean, rstd, scale, rms=params["rms"], dscale_dtype=None,
                               dbias_dtype=None, implementation=params["implementation"])
    rows = tuple(range(1, x.ndim - 1))
    dyf = dy.astype(jnp.float32)
    dscale = dbias = _empty()
    if params["dscale_dtype"]:
        m = 0.0 if params["rms"] else mean[..., None]
        xhat = (x.astype(jnp.float32) - m) * rstd[..., None]
        dscale = jnp.sum(dyf * xhat, axis=rows).astype(params["dscale_dtype"])
    if params["dbias_dtype"]:
        dbias = jnp.sum(dyf, axis=rows).astype(params["dbias_dtype"])
    # The workspace is unused by the caller; any shape-correct value will do.
    work = jnp.zeros((size,) + workspace_shape(x.shape[1:], bool(params["dscale_dtype"] or params["dbias_dtype"])), jnp.float32)
    return (dx, dscale, dbias, work), (0, 0 if params["dscale_dtype"] else None,
                                       0 if params["dbias_dtype"] else None, 0)


norm_bwd_p = define_primitive("norm_bwd", stage="bwd", op_of=_op_of, abstract_eval=_bwd_abstract,
                              batching_rule=_bwd_batch, sharding=BWD_RULES)


# --------------------------------------------------------- implementations ---

def _rows_cols(shape):
    return int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]


def _pallas_fwd(x, scale, bias, *, epsilon, rms, with_stats, config, interpret):
    rows, cols = _rows_cols(x.shape)
    if rows == 0:
        return _fwd_reference(x, scale, bias, epsilon=epsilon, rms=rms, with_stats=with_stats)
    y, mean, rstd = pallas_norm.norm_fwd(
        x.reshape(rows, cols), scale if _present(scale) else None, bias if _present(bias) else None,
        epsilon=epsilon, rms=rms, with_stats=with_stats, config=config, interpret=interpret)
    stat = x.shape[:-1]
    return (y.reshape(x.shape), _empty() if mean is None else mean.reshape(stat),
            _empty() if rstd is None else rstd.reshape(stat))


def _pallas_bwd(dy, x, mean, rstd, scale, *, rms, dscale_dtype, dbias_dtype, config, interpret):
    rows, cols = _rows_cols(x.shape)
    if rows == 0:
        return _bwd_reference(dy, x, mean, rstd, scale, rms=rms, dscale_dtype=dscale_dtype,
                              dbias_dtype=dbias_dtype)
    ws = workspace_shape(x.shape, bool(dscale_dtype or dbias_dtype))
    dx, dscale, dbias, work = pallas_norm.norm_bwd(
        dy.reshape(rows, cols), x.reshape(rows, cols), None if rms else mean.reshape(rows),
        rstd.reshape(rows), scale if _present(scale) else None, rms=rms, work_shape=ws,
        config=config, interpret=interpret)
    return (dx.reshape(x.shape), dscale.astype(dscale_dtype) if dscale_dtype else _empty(),
            dbias.astype(dbias_dtype) if dbias_dtype else _empty(),
            _empty() if work is None else work)


def _pallas_configs(q):
    return pallas_norm.candidate_configs(max(q.rows or 1, 1), q.cols, q.stage)


def _user_lowerings(op):
    """Adapter for register_implementation (signatures in layer_norm's docstring)."""
    def adapt(fn, backward, tunable):
        def fwd(x, scale, bias, *, epsilon, rms, with_stats, config):
            rows, cols = _rows_cols(x.shape)
            x2 = x.reshape(rows, cols)
            p = [scale if _present(scale) else None] + ([] if rms else [bias if _present(bias) else None])
            kw = {"config": config} if tunable else {}
            out = fn(x2, *p, epsilon=epsilon, **kw)
            y = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(out, (tuple, list)) and with_stats:  # the kernel's own statistics
                mean = _empty() if rms else jnp.asarray(out[1], jnp.float32).reshape(x.shape[:-1])
                rstd = jnp.asarray(out[-1], jnp.float32).reshape(x.shape[:-1])
            else:  # statistics by jnp where the VJP needs them; XLA drops the unused y
                _, mean, rstd = _fwd_reference(x, scale, bias, epsilon=epsilon, rms=rms,
                                               with_stats=with_stats)
            return jnp.asarray(y).astype(x.dtype).reshape(x.shape), mean, rstd

        def bwd(dy, x, mean, rstd, scale, *, rms, dscale_dtype, dbias_dtype, config):
            rows, cols = _rows_cols(x.shape)
            kw = {"config": config} if tunable else {}
            out = backward(dy.reshape(rows, cols), x.reshape(rows, cols),
                           None if rms else mean.reshape(rows), rstd.reshape(rows),
                           scale if _present(scale) else None, **kw)
            dx, dscale = out[0], out[1]
            dbias = None if rms else out[2]
            work = jnp.zeros(workspace_shape(x.shape, bool(dscale_dtype or dbias_dtype)), jnp.float32)
            return (jnp.asarray(dx).astype(x.dtype).reshape(x.shape),
                    jnp.asarray(dscale).astype(dscale_dtype) if dscale_dtype else _empty(),
                    jnp.asarray(dbias).astype(dbias_dtype) if dbias_dtype else _empty(), work)

        return user_lowerings(fwd, bwd if backward is not None else None)
    return adapt


def _register_builtins():
    for op in ("layer_norm", "rms_norm"):
        registry.add(registry.Implementation(
            op, "xla", {"fwd": jnp_lowering(_fwd_reference), "bwd": jnp_lowering(_bwd_reference)},
            supports=lambda q: True, description="plain jax.numpy, fused by XLA"))
        registry.add(registry.Implementation(
            op, "cuda",
            {"fwd": ffi_lowering("jax_ops_norm_fwd",
                                 lambda p: {"epsilon": np.float32(p["epsilon"]), "rms": bool(p["rms"])}),
             "bwd": ffi_lowering("jax_ops_norm_bwd", lambda p: {"rms": bool(p["rms"])})},
            supports=ffi_supports("jax_ops_norm_fwd"),
            description="hand CUDA kernels through XLA FFI (host C++ on CPU)"))
        registry.add(registry.Implementation(
            op, "pallas", {"fwd": pallas_lowering(_pallas_fwd), "bwd": pallas_lowering(_pallas_bwd)},
            supports=pallas_supports(lambda q: pallas_norm.supports(q.cols)),
            configs=_pallas_configs, description="Pallas kernels (Triton back end)"))
        registry.define_user_adapter(op, _user_lowerings(op))


_register_builtins()


# ------------------------------------------------------------- custom VJP ---

def _or_empty(a):
    return _empty() if a is None else a


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm(x, scale, bias, epsilon, rms, implementation):
    y, _, _ = norm_fwd_p.bind(x, _or_empty(scale), _or_empty(bias), epsilon=epsilon, rms=rms,
                              with_stats=False, implementation=implementation)
    return y


def _norm_fwd(x, scale, bias, epsilon, rms, implementation):
    y, mean, rstd = norm_fwd_p.bind(x, _or_empty(scale), _or_empty(bias), epsilon=epsilon,
                                    rms=rms, with_stats=True, implementation=implementation)
    return y, (x, mean, rstd, scale, bias)


def _norm_bwd(epsilon, rms, implementation, res, dy):
    x, mean, rstd, scale, bias = res
    bias_dtype = None if bias is None else bias.dtype
    dx, dscale, dbias, _ = norm_bwd_p.bind(
        dy, x, mean, rstd, _or_empty(scale), rms=rms,
        dscale_dtype=None if scale is None else scale.dtype, dbias_dtype=bias_dtype,
        implementation=implementation)
    return dx, (None if scale is None else dscale), (None if bias_dtype is None else dbias)


_norm.defvjp(_norm_fwd, _norm_bwd)


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
    return _norm(x, scale, bias, float(epsilon), False, implementation)


def rms_norm(x, scale=None, *, epsilon: float = 1e-6, implementation: str | None = None):
    """RMSNorm over the last axis: x / sqrt(mean(x²) + epsilon) * scale.

    Same argument rules as `layer_norm` (no bias).
    """
    x, scale, _ = _prepare("rms_norm", x, scale, None, epsilon, implementation)
    implementation = implementation or registry.override_for("rms_norm")
    x, scale = match_vma(x, scale)
    return _norm(x, scale, None, float(epsilon), True, implementation)
