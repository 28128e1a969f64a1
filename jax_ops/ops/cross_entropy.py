"""Fused softmax cross-entropy with integer labels: the declaration (core/op.py).

Forward stage  jax_ops_ce_fwd(logits, labels, weight, mask?) -> (loss, lse, dlogits?)
Backward stage jax_ops_ce_bwd(dlogits, g) -> (dlogits,)

logits (..., V): the vocabulary last (the public function moves it there); labels (...)
int32 in [0, V], V meaning "out of range" (the loss is then NaN, as optax's gather
gives); weight (...) float32, the row's factor (0 for ignored rows, 1/count for a
mean); mask: optax's element-wise `where`, bool of logits' rank, its leading axes
either logits' or broadcast (size 1). Params: label_smoothing, z_loss, with_grad,
in_place (with_grad: the kernels write dlogits over the logits' buffer; for logits that
die there, as linear_cross_entropy's chunks do).

Per row, with K the kept columns (all, or the mask's), n = |K|, m = max_K z,
s = Σ_K exp(z - m), lse = m + log s (cuda_src/cross_entropy_math.h):
  loss = w · ((1 - ls)(lse - z_label) + ls (lse - Σ_K z / n) + z_loss · lse²),
exactly 0 where w == 0 (whatever the logits hold). The label's logit counts whether or
not the mask keeps it (optax's softmax_cross_entropy_with_integer_labels). lse is an
internal result (no tangent unless differentiated).

Training (with_grad, Op.train): the forward also writes the gradient of `loss` with
respect to the logits, in the logits' dtype, from the same pass over them:
  dlogits = w · (softmax_K(z) (1 + 2 z_loss lse) - (1 - ls) onehot(label) - (ls / n) [K]).
That is the whole residual (no float32 probabilities). The backward scales row r of it
by the loss cotangent g_r, in place (the kernels' result aliases dlogits), and skips the
rows with g_r == 1: the cotangent of a mean or sum, so a reduced loss costs one pass
over the logits plus one write of their gradient.
The weight is a constant of the call (computed from labels, where and ignore_index): it
has no tangent.
"""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from jax_ops.core import registry
from jax_ops.core.benchspec import BenchSpec
from jax_ops.core.op import Impl, Op, Stage, ffi, ffi_supports, local_uses_kernels, pallas_supports
from jax_ops.core.sharding import gather_parts, ordered_sum
from jax_ops.core.pattern import BF16, F32, OP_DTYPES, Formulation, Pattern, sds
from jax_ops.core.validate import ACT_DTYPES
from jax_ops.core.validate import dtype_name as _fmt_dtype
from pallas_kernels import cross_entropy as pallas_ce

OP = "cross_entropy"
_F32 = jnp.dtype(jnp.float32)
_I32 = jnp.dtype(jnp.int32)
REDUCTIONS = ("none", "mean", "sum")


# ------------------------------------------------------------- validation ---

def _check_logits(logits):
    if logits.dtype not in ACT_DTYPES:
        raise TypeError(f"jax_ops.{OP}: logits must be float32, bfloat16 or float16; "
                        f"got dtype {_fmt_dtype(logits.dtype)}")
    if logits.ndim < 1:
        raise ValueError(f"jax_ops.{OP}: logits must have at least 1 dimension (the classes); "
                         f"got shape {tuple(logits.shape)}")


def _check_real(op, name, value, lo, hi=None) -> float:
    if isinstance(value, (jax.Array, np.ndarray)) and np.ndim(value) == 0:
        try:
            value = float(value)
        except (jax.errors.ConcretizationTypeError, TypeError):
            raise TypeError(f"jax_ops.{op}: {name} must be a concrete real number (it is compiled "
                            "into the kernel); got a traced array") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"jax_ops.{op}: {name} must be a real number; got {type(value).__name__}")
    v = float(value)
    if not (np.isfinite(v) and v >= lo and (hi is None or v <= hi)):
        want = f"in [{lo}, {hi}]" if hi is not None else f"finite and >= {lo}"
        raise ValueError(f"jax_ops.{op}: {name} must be {want}; got {value}")
    return v


def _check_options(op, labels, label_smoothing, z_loss, reduction, ignore_index):
    """labels' dtype and the scalar options; returns (label_smoothing, z_loss) as floats."""
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"jax_ops.{op}: labels must have an integer dtype; got {_fmt_dtype(labels.dtype)}")
    ls = _check_real(op, "label_smoothing", label_smoothing, 0.0, 1.0)
    zl = _check_real(op, "z_loss", z_loss, 0.0)
    if reduction not in REDUCTIONS:
        raise ValueError(f"jax_ops.{op}: reduction must be one of {REDUCTIONS}; got {reduction!r}")
    if ignore_index is not None and (isinstance(ignore_index, bool)
                                     or not isinstance(ignore_index, (int, np.integer))):
        raise TypeError(f"jax_ops.{op}: ignore_index must be an int or None; got "
                        f"{type(ignore_index).__name__}")
    return ls, zl


def _normalize_axes(axis, ndim) -> tuple[int, ...]:
    """axis (int or tuple of ints) -> non-negative axes in the given order."""
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    out = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
            raise TypeError(f"jax_ops.{OP}: axis must be an int or a tuple of ints; got {axis!r}")
        if not -ndim <= a < ndim:
            raise ValueError(f"jax_ops.{OP}: axis {a} is out of range for logits of rank {ndim} "
                             f"(expected -{ndim} <= axis < {ndim})")
        out.append(int(a) % ndim)
    if not out or len(set(out)) != len(out):
        raise ValueError(f"jax_ops.{OP}: axis must name distinct axes; got {axis!r}")
    return tuple(out)


def _check_abstract(logits, labels, weight, mask):
    _check_logits(logits)
    rows = tuple(logits.shape[:-1])
    if labels.dtype != _I32 or tuple(labels.shape) != rows:
        raise ValueError(f"jax_ops {OP} primitive: labels must be int32 of shape {rows}; got "
                         f"{tuple(labels.shape)} {_fmt_dtype(labels.dtype)}")
    if weight.dtype != _F32 or tuple(weight.shape) != rows:
        raise ValueError(f"jax_ops {OP} primitive: weight must be float32 of shape {rows}; got "
                         f"{tuple(weight.shape)} {_fmt_dtype(weight.dtype)}")
    if mask is not None and (mask.dtype != jnp.bool_ or mask.ndim != logits.ndim
                             or mask.shape[-1] != logits.shape[-1]
                             or any(m not in (1, n) for m, n in zip(mask.shape[:-1], rows))):
        raise ValueError(f"jax_ops {OP} primitive: mask must be bool of logits' rank with its last "
                         f"axis and broadcast (size-1) or equal leading axes; got "
                         f"{tuple(mask.shape)} {_fmt_dtype(mask.dtype)} for logits {tuple(logits.shape)}")


# ---------------------------------------------------------------- forward ---

def _fwd_abstract(logits, labels, weight, mask, *, label_smoothing, z_loss, with_grad, in_place=False):
    _check_abstract(logits, labels, weight, mask)
    rows = core.ShapedArray(logits.shape[:-1], _F32)
    dlogits = core.ShapedArray(logits.shape, logits.dtype) if with_grad else None
    return rows, rows, dlogits


def _identity(a):
    return a


def _fwd_reference(logits, labels, weight, mask, *, label_smoothing, z_loss, with_grad,
                   in_place=False, psum=_identity, pmax=_identity, col0=0, vocab=None):
    """The jnp math (module docstring). With the vocabulary sharded (per-device code):
    psum/pmax combine per-row partial results over the vocabulary's mesh axes, col0 is
    the global column of this shard's first column and vocab the global V."""
    V = logits.shape[-1] if vocab is None else vocab
    z = logits.astype(jnp.float32)
    keep = _kept(z, mask)
    zk = z if keep is None else jnp.where(keep, z, -jnp.inf)
    m = pmax(jnp.max(zk, axis=-1))
    shift = jnp.where(m == -jnp.inf, 0.0, m)
    s = psum(jnp.sum(jnp.exp(zk - shift[..., None]), axis=-1))
    cols = col0 + jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
    # A select and a row sum, not a gather: fused into the row's reductions, and with the
    # vocabulary sharded the device holding the label's column contributes it.
    z_lab = psum(jnp.sum(jnp.where(cols == labels[..., None], z, 0.0), axis=-1))
    z_lab = jnp.where((labels >= 0) & (labels < V), z_lab, jnp.nan)
    n = sum_z = jnp.zeros_like(m)  # only label smoothing reads them
    if label_smoothing > 0.0:
        if keep is None:
            n = jnp.full_like(m, float(V))
            sum_z = psum(jnp.sum(z, axis=-1))
        else:
            n = psum(jnp.sum(keep, axis=-1, dtype=jnp.float32))
            sum_z = psum(jnp.sum(jnp.where(keep, z, 0.0), axis=-1))
    stats = jnp.stack([m, s, sum_z, n, z_lab], axis=-1)
    return _finish_reference(logits, labels - col0, mask, weight, stats, label_smoothing, z_loss,
                             with_grad)


def _front(a, d, size):
    """Batch axis first; an unbatched operand is broadcast to the batch."""
    if a is None:
        return None
    return jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size,) + a.shape)


def _fwd_batch(stage, args, dims, **params):
    logits, labels, weight, mask = args
    ld, bd, wd, md = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if a is not None and d is not None)
    logits, labels, weight = _front(logits, ld, size), _front(labels, bd, size), _front(weight, wd, size)
    if mask is not None:  # keeps logits' rank: a size-1 (broadcast) axis where unbatched
        mask = jnp.moveaxis(mask, md, 0) if md is not None else mask[None]
    outs = stage.call(logits, labels, weight, mask, **params)
    return outs, [None if o is None else 0 for o in outs]


def _variant(params) -> str:
    """"grad": the training forward, which also writes dlogits (timed apart)."""
    return "grad" if params.get("with_grad") else ""


# --------------------------------------------------------------- backward ---

def _bwd_abstract(dlogits, g):
    rows = tuple(dlogits.shape[:-1])
    if g.dtype != _F32 or tuple(g.shape) != rows:
        raise ValueError(f"jax_ops {OP} backward: g must be float32 of shape {rows} for dlogits "
                         f"{tuple(dlogits.shape)}; got {tuple(g.shape)} {_fmt_dtype(g.dtype)}")
    return (core.ShapedArray(dlogits.shape, dlogits.dtype),)


def _bwd_reference(dlogits, g):
    return ((dlogits.astype(jnp.float32) * g[..., None]).astype(dlogits.dtype),)


def _bwd_batch(stage, args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    dlogits, g = (_front(a, d, size) for a, d in zip(args, dims))
    return stage.call(dlogits, g, **params), (0,)


# ---------------------------------------------------------------- sharding ---
# Rows sharded: the kernels run on each device's rows. The vocabulary sharded (tensor
# parallel), with kernels: PARTIALS writes each row's statistics over the device's
# columns (max, Σ exp, Σ z, kept count, the label's logit where the device holds it),
# one all_gather over the vocabulary's mesh axes brings every device's (5 floats a row
# each), merged in device order (exact, bitwise the same on every device), and APPLY
# writes the local columns' dlogits and the loss from the whole rows' statistics: the
# logits are read twice (once by each stage), none are gathered. Else (xla) jnp with
# pmax/psum of the per-row partial results.

def _fwd_local(layout, mesh, logits, labels, weight, mask, *, implementation, **params):
    cols = layout.col_axes
    col0 = jax.lax.axis_index(cols) * logits.shape[-1]
    if local_uses_kernels(
            mesh, (FWD, (logits, labels, weight, mask), dict(params, implementation=implementation)),
            (PARTIALS, (logits, labels, mask), dict(implementation=implementation))):
        local = (labels - col0).astype(jnp.int32)  # the label's column in this shard
        (parts,) = PARTIALS.call(logits, local, mask, implementation=implementation)
        stats = merge_stat_parts(gather_parts([parts], cols)[0], labels, layout.shape[-1])
        ls, zl = params["label_smoothing"], params["z_loss"]
        if params["with_grad"]:
            return APPLY.call(logits, local, weight, mask, stats, label_smoothing=ls, z_loss=zl,
                              implementation=implementation)
        loss, lse, _ = _finish_reference(None, None, None, weight, stats, ls, zl, with_grad=False)
        return loss, lse, None
    return _fwd_reference(logits, labels, weight, mask, **params,
                          psum=lambda a: jax.lax.psum(a, cols), pmax=lambda a: jax.lax.pmax(a, cols),
                          col0=col0, vocab=layout.shape[-1])


def merge_stat_parts(parts, labels, vocab):
    """The whole rows' statistics (..., 5) from the shards' (stacked on a leading device
    axis, in device order): the max of the maxima, Σ exp rescaled to it, Σ z, the kept
    count, the label's logit (0 from the shards without it; NaN for an out-of-range
    label, labels being in [0, vocab] with vocab out of range)."""
    m, s, sum_z, n, z_lab = (parts[..., i] for i in range(_STATS))
    top = m[0]
    for i in range(1, m.shape[0]):
        top = jnp.maximum(top, m[i])
    shift = jnp.where(top == -jnp.inf, 0.0, top)
    total = ordered_sum(jnp.where(m == -jnp.inf, s, s * jnp.exp(m - shift)))
    z_lab = jnp.where((labels >= 0) & (labels < vocab), ordered_sum(z_lab), jnp.nan)
    return jnp.stack([top, total, ordered_sum(sum_z), ordered_sum(n), z_lab], axis=-1)


# Per-device stages of the vocabulary-sharded local (labels: columns of the shard, others
# out of range):
#   jax_ops_ce_partials(logits, labels, mask?) -> (parts [..., 5],)
#   jax_ops_ce_apply(logits, labels, weight, mask?, stats [..., 5]) -> (loss, lse, dlogits)
#     params label_smoothing, z_loss; stats the whole rows' (max, Σ exp(z − max), Σ z,
#     kept count, label logit)
_STATS = 5


def _stats_aval(logits):
    return core.ShapedArray(tuple(logits.shape[:-1]) + (_STATS,), _F32)


def _partials_abstract(logits, labels, mask):
    _check_abstract(logits, labels, core.ShapedArray(labels.shape, _F32), mask)
    if logits.shape[-1] < 1:
        raise ValueError(f"jax_ops {OP} partials: logits need at least one column; got shape "
                         f"{tuple(logits.shape)}")
    return (_stats_aval(logits),)


def _kept(z, mask):
    return None if mask is None else jnp.broadcast_to(mask, z.shape)


def _partials_reference(logits, labels, mask):
    z = logits.astype(jnp.float32)
    keep = _kept(z, mask)
    zk = z if keep is None else jnp.where(keep, z, -jnp.inf)
    m = jnp.max(zk, axis=-1)
    shift = jnp.where(m == -jnp.inf, 0.0, m)
    s = jnp.sum(jnp.exp(zk - shift[..., None]), axis=-1)
    sum_z = jnp.sum(z if keep is None else jnp.where(keep, z, 0.0), axis=-1)
    n = (jnp.full(m.shape, float(z.shape[-1]), jnp.float32) if keep is None
         else jnp.sum(keep, axis=-1, dtype=jnp.float32))
    cols = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
    z_lab = jnp.sum(jnp.where(cols == labels[..., None], z, 0.0), axis=-1)
    return (jnp.stack([m, s, sum_z, n, z_lab], axis=-1),)


def _apply_abstract(logits, labels, weight, mask, stats, *, label_smoothing, z_loss):
    _check_abstract(logits, labels, weight, mask)
    if stats.dtype != _F32 or tuple(stats.shape) != _stats_aval(logits).shape:
        raise ValueError(f"jax_ops {OP} apply: stats must be float32 of shape "
                         f"{_stats_aval(logits).shape}; got {tuple(stats.shape)} {_fmt_dtype(stats.dtype)}")
    rows = core.ShapedArray(logits.shape[:-1], _F32)
    return rows, rows, core.ShapedArray(logits.shape, logits.dtype)


def _finish_reference(logits, labels, mask, weight, stats, ls, zl, with_grad=True):
    """loss, lse (and dlogits of the given columns) from the whole rows' statistics: the
    formulas of cross_entropy_math.h's finish_row and grad_elem."""
    m, s, sum_z, n, z_lab = (stats[..., i] for i in range(_STATS))
    shift = jnp.where(m == -jnp.inf, 0.0, m)
    # Dead rows: no kept logit above -inf (s == 0). A NaN sum is live (NaN throughout, as
    # the kernels give): a shard's max skips a NaN logit that its Σ exp keeps.
    live = ~(s <= 0)
    s_safe = jnp.where(live, s, 1.0)
    log_s = jnp.where(live, jnp.log(s_safe), -jnp.inf)
    lse = shift + log_s
    loss = (shift - z_lab) + log_s
    if ls > 0.0:
        mean_z = jnp.where(n > 0, sum_z / jnp.maximum(n, 1.0), 0.0)
        loss = (1.0 - ls) * loss + ls * ((shift - mean_z) + log_s)
    if zl > 0.0:
        loss = loss + zl * lse * lse
    zero = weight == 0.0
    out = jnp.where(zero, 0.0, weight * jnp.where(zero, 0.0, loss))
    if not with_grad:
        return out, lse, None
    z = logits.astype(jnp.float32)
    keep = _kept(z, mask)
    zk = z if keep is None else jnp.where(keep, z, -jnp.inf)
    p = jnp.exp(zk - shift[..., None]) / s_safe[..., None]
    if zl > 0.0:
        p = p * (1.0 + 2.0 * zl * jnp.where(live, lse, 0.0))[..., None]
    cols = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
    d = p - jnp.where(cols == labels[..., None], 1.0 - ls, 0.0)
    if ls > 0.0:
        step = jnp.where(n > 0, ls / jnp.maximum(n, 1.0), 0.0)[..., None]
        d = d - (step if keep is None else jnp.where(keep, step, 0.0))
    d = jnp.where(zero[..., None], 0.0, weight[..., None] * d)
    return out, lse, d.astype(logits.dtype)


def _apply_reference(logits, labels, weight, mask, stats, *, label_smoothing, z_loss):
    return _finish_reference(logits, labels, mask, weight, stats, label_smoothing, z_loss)


PARTIALS = Stage("ce_partials", "partials", ("logits", "labels", "mask?"), ("parts",),
                 op_of=lambda p: OP, abstract=_partials_abstract, reference=_partials_reference)
APPLY = Stage("ce_apply", "apply", ("logits", "labels", "weight", "mask?", "stats"),
              ("loss", "lse", "dlogits"), op_of=lambda p: OP, abstract=_apply_abstract,
              reference=_apply_reference, variant=lambda p: "grad")


# --------------------------------------------------------- implementations ---

def _kernel_mask(mask, logits):
    """The mask as the kernels take it: (1, V) for one row used by every row, else
    (rows, V) (other broadcasts materialized)."""
    if mask is None:
        return None
    V = logits.shape[-1]
    if all(d == 1 for d in mask.shape[:-1]):
        return mask.reshape(1, V)
    if mask.shape != logits.shape:
        mask = jnp.broadcast_to(mask, logits.shape)
    return mask.reshape(-1, V)


def _ffi_attrs(p):
    return {"label_smoothing": np.float32(p["label_smoothing"]), "z_loss": np.float32(p["z_loss"]),
            "with_grad": bool(p["with_grad"]), "has_mask": bool(p["has_mask"])}


_ffi_fwd = ffi("jax_ops_ce_fwd", _ffi_attrs)
_ffi_fwd_in_place = ffi("jax_ops_ce_fwd", _ffi_attrs, aliases={0: 2})  # logits -> dlogits


def _cuda_fwd(call, logits, labels, weight, mask, *, in_place=False, **params):
    fn = _ffi_fwd_in_place if in_place and params["with_grad"] else _ffi_fwd
    return fn(call, logits, labels, weight, _kernel_mask(mask, logits), has_mask=mask is not None, **params)


_ffi_partials = ffi("jax_ops_ce_partials", lambda p: {"has_mask": bool(p["has_mask"])})
_ffi_apply = ffi("jax_ops_ce_apply",
                 lambda p: {"label_smoothing": np.float32(p["label_smoothing"]),
                            "z_loss": np.float32(p["z_loss"]), "has_mask": bool(p["has_mask"])})


def _cuda_partials(call, logits, labels, mask):
    return _ffi_partials(call, logits, labels, _kernel_mask(mask, logits), has_mask=mask is not None)


def _cuda_apply(call, logits, labels, weight, mask, stats, **params):
    return _ffi_apply(call, logits, labels, weight, _kernel_mask(mask, logits), stats,
                      has_mask=mask is not None, **params)


def _pallas_fwd(call, logits, labels, weight, mask, *, label_smoothing, z_loss, with_grad,
                in_place=False):
    V = logits.shape[-1]
    loss, lse, d = pallas_ce.ce_fwd(
        logits.reshape(-1, V), labels.reshape(-1), weight.reshape(-1), _kernel_mask(mask, logits),
        label_smoothing=label_smoothing, z_loss=z_loss, with_grad=with_grad, in_place=in_place,
        config=call.config, interpret=call.interpret)
    rows = logits.shape[:-1]
    return loss.reshape(rows), lse.reshape(rows), (None if d is None else d.reshape(logits.shape))


def _pallas_bwd(call, dlogits, g):
    V = dlogits.shape[-1]
    out = pallas_ce.ce_bwd(dlogits.reshape(-1, V), g.reshape(-1), config=call.config,
                           interpret=call.interpret)
    return (out.reshape(dlogits.shape),)


def _pallas_configs(q):
    return pallas_ce.candidate_configs(max(q.rows or 1, 1), q.cols, q.stage)


def _user_adapter(fn, backward, tunable):
    """register_implementation's adapter: fn(logits2d, labels, weight, mask2d, *,
    label_smoothing, z_loss, with_grad) -> (loss, lse, dlogits or None) with logits
    (rows, V), labels (rows,) int32 in [0, V] (V: out of range), weight (rows,) float32,
    mask None or bool (1 or rows, V); backward(dlogits2d, g) -> dlogits * g[:, None]."""
    def fwd(call, logits, labels, weight, mask, *, in_place=False, **params):
        V = logits.shape[-1]
        kw = {"config": call.config} if tunable else {}
        loss, lse, d = fn(logits.reshape(-1, V), labels.reshape(-1), weight.reshape(-1),
                          _kernel_mask(mask, logits), **params, **kw)
        rows = logits.shape[:-1]
        return (jnp.asarray(loss, jnp.float32).reshape(rows), jnp.asarray(lse, jnp.float32).reshape(rows),
                None if not params["with_grad"] else jnp.asarray(d).astype(logits.dtype).reshape(logits.shape))

    def bwd(call, dlogits, g):
        V = dlogits.shape[-1]
        kw = {"config": call.config} if tunable else {}
        out = backward(dlogits.reshape(-1, V), g.reshape(-1), **kw)
        return (jnp.asarray(out).astype(dlogits.dtype).reshape(dlogits.shape),)

    return {"fwd": fwd, **({"bwd": bwd} if backward is not None else {})}


# ----------------------------------------------------------- declaration ---

FWD = Stage("ce_fwd", "fwd", ("logits", "labels", "weight", "mask?"), ("loss", "lse", "dlogits?"),
            op_of=lambda p: OP, abstract=_fwd_abstract, reference=_fwd_reference, batch=_fwd_batch,
            roles={"logits": "x", "labels": "rows", "weight": "rows", "mask": "bmask",
                   "loss": "rows", "lse": "rows", "dlogits": "x"},
            needs_local=lambda layout, params: bool(layout.col_axes), local=_fwd_local,
            variant=_variant)
BWD = Stage("ce_bwd", "bwd", ("dlogits", "g"), ("dlogits",),
            op_of=lambda p: OP, abstract=_bwd_abstract, reference=_bwd_reference, batch=_bwd_batch,
            roles={"dlogits": "x", "g": "rows"})


def _residuals(ops, outs, params):
    return (outs["dlogits"],)


def _backward(res, cts, wanted, params, in_avals):
    (dlogits,) = res
    if "weight" in wanted:
        raise NotImplementedError(f"jax_ops.{OP}: the row weights are constants (no tangent)")
    g = cts["loss"]
    if g is None:
        return {"logits": jnp.zeros(dlogits.shape, dlogits.dtype)}
    (dx,) = BWD.call(dlogits, g.astype(jnp.float32), implementation=params["implementation"])
    return {"logits": dx}


CROSS_ENTROPY = Op(
    (OP,), FWD, BWD, stages=(PARTIALS, APPLY),
    outputs=lambda p: ("loss",), train=lambda p: dict(p, with_grad=True),
    residuals=_residuals, backward=_backward, user_adapter=_user_adapter,
    impls={
        "cuda": Impl({"fwd": _cuda_fwd, "bwd": ffi("jax_ops_ce_bwd", aliases={0: 0}),
                      "partials": _cuda_partials, "apply": _cuda_apply},
                     supports=ffi_supports("jax_ops_ce_fwd"),
                     description="hand CUDA kernels through XLA FFI (host C++ on CPU)"),
        "pallas": Impl({"fwd": _pallas_fwd, "bwd": _pallas_bwd},
                       supports=pallas_supports(lambda q: pallas_ce.supports(q.cols)),
                       configs=_pallas_configs, description="Pallas kernels (Triton back end)"),
    },
    bench=lambda: cross_entropy_specs(),  # the benchmark specs: end of this module
    patterns=lambda: cross_entropy_patterns())  # the rewrite patterns: end of this module


# ------------------------------------------------------------- public API ---

def _check_where(op, where, logits_shape, expect, rank_of, add_class_axes):
    """optax's `where`: bool, one flag per example (labels' shape `expect`, given the
    class axes back by add_class_axes) or of the logits' rank (one per class)."""
    where = jnp.asarray(where)
    if where.dtype != jnp.bool_:
        raise TypeError(f"jax_ops.{op}: where must be a bool array; got dtype {_fmt_dtype(where.dtype)}")
    given, logits_shape = tuple(where.shape), tuple(logits_shape)
    try:
        if where.ndim != len(logits_shape):  # as optax: a per-example where
            where = add_class_axes(where)
        ok = where.ndim == len(logits_shape) and np.broadcast_shapes(where.shape, logits_shape) == logits_shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"jax_ops.{op}: where must broadcast to labels' shape {expect} (one flag "
                         f"per example) or, with {rank_of} rank, to the logits' shape {logits_shape} "
                         f"(one per class); got shape {given}")
    return where


def _labels_int32(labels, V):
    """labels (any integer dtype) -> int32 in [0, V]: negative labels in [-V, -1] count
    from the end (as optax's take_along_axis does), others outside [0, V) become V."""
    dt = labels.dtype
    if dt.itemsize < 4 or dt == _I32:
        lab = labels.astype(jnp.int32)
        bad = (lab < -V) | (lab >= V)
    else:  # 32-bit unsigned or 64-bit: compare before narrowing
        bad = labels >= jnp.asarray(V, dt)
        if jnp.issubdtype(dt, jnp.signedinteger):
            bad = bad | (labels < jnp.asarray(-V, dt))
        lab = jnp.where(bad, jnp.asarray(0, dt), labels).astype(jnp.int32)
    lab = jnp.where(lab < 0, lab + V, lab)
    return jnp.where(bad, V, lab)


def _not_ignored(labels, ignore_index):
    info = jnp.iinfo(labels.dtype)
    if not info.min <= ignore_index <= info.max:  # no label can equal it
        return None
    return labels != jnp.asarray(ignore_index, labels.dtype)


def cross_entropy(logits, labels, *, axis: int | tuple[int, ...] = -1, where=None,
                  label_smoothing: float = 0.0, ignore_index: int | None = None,
                  z_loss: float = 0.0, reduction: str = "none",
                  implementation: str | None = None):
    """Softmax cross-entropy with integer labels, fused: the loss and (when differentiated)
    the logits' gradient from one pass over the logits.

    With the defaults it is `optax.softmax_cross_entropy_with_integer_labels(logits,
    labels, axis, where)` (same values, where, axis and label conventions; the result is
    float32 whatever the logits' dtype): swap
    `optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()` for
    `jax_ops.cross_entropy(logits, labels, reduction="mean")`.

    Args:
      logits: float32, bfloat16 or float16, rank >= 1. Never copied to float32 (the math
        is float32 on chip).
      labels: any integer dtype, logits' shape without the class axes. Labels in [-V, -1]
        count from the end; others outside [0, V) give a NaN loss (optax's gather).
      axis: the class axis, or a tuple of axes (moved last and merged; a label is then a
        flat index into them, as optax does).
      where: optax's `where`: bool, either of labels' shape (or broadcastable to it:
        which examples count) or of logits' rank (which classes take part in each
        example's softmax; an example with none counts as ignored). Ignored examples have
        loss 0 and a zero gradient.
      label_smoothing: ls in [0, 1]: the target is (1 - ls) one_hot(label) + ls / n over
        the n kept classes (optax.smooth_labels then softmax_cross_entropy).
      ignore_index: examples whose label equals it are ignored (loss 0, zero gradient,
        not counted by "mean"), e.g. -100 for padding.
      z_loss: PaLM's auxiliary loss: z_loss · logsumexp(logits)² added per example.
      reduction: "none" (per-example losses, labels' shape), "mean" (over the counted
        examples; 0 when none counts) or "sum".
      implementation: None (automatic), "xla", "cuda" or "pallas".

    Returns: float32, labels' shape ("none") or a scalar.
    """
    registry.check_name(OP, implementation)
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)
    _check_logits(logits)
    ls, zl = _check_options(OP, labels, label_smoothing, z_loss, reduction, ignore_index)
    axes = _normalize_axes(axis, logits.ndim)
    if where is not None:
        expect = tuple(logits.shape[i] for i in range(logits.ndim) if i not in axes)
        where = _check_where(OP, where, logits.shape, expect, "logits'",
                             lambda w: jnp.expand_dims(w, axis if isinstance(axis, int) else tuple(axis)))
    logits, where = _move_classes_last(logits, where, axes)
    expect = tuple(logits.shape[:-1])
    if tuple(labels.shape) != expect:
        raise ValueError(f"jax_ops.{OP}: labels must have shape {expect} (logits' shape "
                         f"without the class axes); got shape {tuple(labels.shape)}")
    V = logits.shape[-1]
    if V < 1:
        raise ValueError(f"jax_ops.{OP}: there must be at least one class; got logits of shape "
                         f"{tuple(logits.shape)} with classes along {axes}")

    lab, weight, mask = _row_weights(labels, where, ignore_index, reduction, V)
    if logits.size == 0:
        out = jnp.zeros(expect, jnp.float32)
        return out if reduction == "none" else jnp.sum(out)
    loss = FWD.call(logits, lab, weight, mask, label_smoothing=ls, z_loss=zl, with_grad=False,
                    in_place=False, implementation=implementation or registry.override_for(OP))[0]
    return loss if reduction == "none" else jnp.sum(loss)


def _row_weights(labels, where, ignore_index, reduction, V):
    """(labels as int32 in [0, V], the float32 weight of each example, the per-class
    mask or None) from where (classes last, logits' rank, or None), ignore_index and the
    reduction: weight 0 for ignored examples, 1 (1/count for "mean") for the others."""
    expect = tuple(labels.shape)
    valid, mask = None, None
    if where is not None:
        if where.shape[-1] == 1:  # a where per example
            valid = jnp.broadcast_to(where[..., 0], expect)
        else:  # per class: examples with no kept class are ignored (optax gives them 0)
            mask = where
            valid = jnp.broadcast_to(jnp.any(where, axis=-1), expect)
    if ignore_index is not None:
        keep = _not_ignored(labels, int(ignore_index))
        if keep is not None:
            valid = keep if valid is None else valid & keep
    lab = _labels_int32(labels, V)
    if valid is None:
        weight = jnp.ones(expect, jnp.float32)
        count = jnp.float32(max(int(np.prod(expect)), 1))
    else:
        weight = valid.astype(jnp.float32)
        count = jnp.maximum(jnp.sum(valid, dtype=jnp.int32), 1).astype(jnp.float32)
    if reduction == "mean":
        weight = weight / count
    return lab, weight, mask


def _move_classes_last(logits, where, axes):
    """logits and where (logits' rank or None) with the class axes moved last and merged
    into one (in the given order, as optax does; a transposed copy unless the class axis
    is already last)."""
    nd = logits.ndim
    if axes == (nd - 1,):
        return logits, where
    batch = tuple(i for i in range(nd) if i not in axes)
    perm, nb = batch + axes, len(batch)
    classes = tuple(logits.shape[i] for i in axes)
    logits = jnp.transpose(logits, perm).reshape(tuple(logits.shape[i] for i in batch) + (-1,))
    if where is not None:
        w = jnp.transpose(where, perm)
        if not all(n == 1 for n in w.shape[nb:]):  # merge the class axes at full size
            w = jnp.broadcast_to(w, w.shape[:nb] + classes)
        where = w.reshape(w.shape[:nb] + (-1,))
    return logits, where


# ------------------------------------------------------ linear_cross_entropy ---
# The LM head and the loss without the logits: chunks of rows, each chunk's logits by an
# XLA matmul (cuBLAS), the loss and dlogits by the CE forward stage in one pass over
# them, then the chunk's dh and its share of dw by two more matmuls. Only one chunk's
# logits and dlogits exist at a time.

LCE = "linear_cross_entropy"
CHUNK_BYTES = 256 * 2**20  # a chunk's logits (dlogits overwrite them): at most this, about


def default_chunk_rows(rows: int, vocab: int, itemsize: int) -> int:
    """Rows per chunk: logits of at most about CHUNK_BYTES (at least 128 rows), in as few
    chunks as that allows, of equal size: a divisor of rows that is a multiple of 16 where
    one is near (no padding rows, whose matmuls would be wasted), else the balanced size
    rounded up to a multiple of 16 (the last chunk padded)."""
    cap = max(128, CHUNK_BYTES // max(vocab * itemsize, 1))
    if rows <= cap:
        return max(rows, 1)
    n0 = -(-rows // cap)
    for n in range(n0, 2 * n0 + 1):
        if rows % n == 0 and (rows // n) % 16 == 0:
            return rows // n
    return -(-(-(-rows // n0)) // 16) * 16


#: policy="auto"'s model of linear_cross_entropy against h @ w + cross_entropy (the
#: unfused path: what the graph becomes without the linear_cross_entropy rewrite), fitted
#: to wall-clock times of the jitted value_and_grad of the mean loss on the H100
#: (benchmarks/results/2026-11-24_H100_lce, bf16, rows 8192-32768, d 768-4096, V 50304
#: and 128256, chunks of 1024-16384 rows; the model is within 3 % of each of them):
#:   unfused = 3 GEMMs of 2·N·d·V flops at `tflops` + the cross-entropy's 2·N·V·itemsize
#:             bytes at `copy_tbps` (the same-bytes copy speed; × 1.46 past shared memory)
#:   linear_cross_entropy = unfused + per chunk (`chunk_us` + 8·d·V bytes at `rmw_tbps`:
#:             the float32 dw accumulator's read and write, in the GEMM's epilogue)
#: (A kernel profile at the issue's shape puts most of the per-chunk cost outside the
#: kernels: the chunk loop's; docs/perf-notes.md.)
#: So it is never faster: it runs the same GEMMs and cross-entropy as the unfused path in
#: pieces, plus a cost per piece. Temporaries: one chunk's logits (dlogits overwrite
#: them) and the float32 dw accumulator, against the logits and their gradient.
LCE_MODEL = {"NVIDIA H100 80GB HBM3": dict(tflops=718.0, copy_tbps=2.84, chunk_us=87.0, rmw_tbps=4.98)}
#: a GPU without its own measurements uses the H100's (its ratios of compute to bandwidth
#: to launch cost are what matter; the rule only needs the sign of the difference)
LCE_MODEL_FALLBACK = "NVIDIA H100 80GB HBM3"
#: vocabularies past this (bfloat16/float16; half for float32) read the logits twice
CE_SMEM_VOCAB = 113_000


def lce_estimate(rows: int, d: int, vocab: int, itemsize: int, kind: str | None,
                 chunk: int | None = None) -> dict:
    """linear_cross_entropy vs h @ w + cross_entropy at (rows, d) @ (d, vocab): chunks,
    temporaries (MiB) and, on a CUDA GPU (kind: jax's device kind; None or a non-NVIDIA
    kind: no times), the estimated forward + backward times (ms) and the difference
    `extra_ms` (LCE_MODEL). `why` says what the difference is made of."""
    chunk = min(chunk or default_chunk_rows(rows, vocab, itemsize), rows)
    n = -(-rows // chunk)
    out = dict(chunks=n, chunk_rows=chunk,
               lce_mib=(4 * d * vocab + chunk * vocab * itemsize) / 2**20,
               unfused_mib=2 * rows * vocab * itemsize / 2**20,
               lce_ms=None, unfused_ms=None, extra_ms=None)
    if kind is None or not str(kind).startswith("NVIDIA"):
        out["why"] = "linear_cross_entropy is measured on NVIDIA GPUs only"
        return out
    m = LCE_MODEL.get(kind) or LCE_MODEL[LCE_MODEL_FALLBACK]
    ce_bytes = 2 * rows * vocab * itemsize * (1.46 if vocab * itemsize > 2 * CE_SMEM_VOCAB else 1.0)
    unfused = 3 * 2 * rows * d * vocab / (m["tflops"] * 1e9) + ce_bytes / (m["copy_tbps"] * 1e9)
    per_chunk = m["chunk_us"] * 1e-3 + 8 * d * vocab / (m["rmw_tbps"] * 1e9)
    out.update(unfused_ms=unfused, lce_ms=unfused + n * per_chunk, extra_ms=n * per_chunk)
    out["why"] = (f"{n} chunks of {chunk} rows, each about {per_chunk * 1e3:.0f} us more: the chunk "
                  f"loop's cost and the float32 dw accumulation"
                  + ("" if kind in LCE_MODEL else f"; {LCE_MODEL_FALLBACK}'s model"))
    return out


#: Chunks per iteration of the chunk loop (lax.scan's unroll), read at trace time; a
#: measurement knob (benchmarks/lce_unroll.py).
LCE_SCAN_UNROLL = 1


def _lce_chunks(h, w, bias, lab, weight, mask, cfg, with_grad):
    """Scan over row chunks. h (N, d); lab/weight (N,); mask None, (1, V) or (N, V).
    Returns the per-row weighted losses (N,) and, with_grad, (dh (N, d) in h's dtype,
    dw float32 like w, dbias float32 (V,) or None)."""
    transposed, chunk, ls, zl, impl = cfg
    N, d = h.shape
    V = w.shape[0] if transposed else w.shape[1]
    n = -(-N // chunk)
    pad = n * chunk - N
    per_row_mask = mask is not None and mask.shape[0] != 1

    def rows_of(a, fill):
        if pad:
            a = jnp.concatenate([a, jnp.full((pad,) + a.shape[1:], fill, a.dtype)])
        return a.reshape((n, chunk) + a.shape[1:])
    xs = (rows_of(h, 0), rows_of(lab, 0), rows_of(weight, 0.0),
          rows_of(mask, False) if per_row_mask else None)

    def body(carry, x):
        h_c, lab_c, w_c, m_c = x
        logits = jnp.dot(h_c, w.T if transposed else w)
        if bias is not None:
            logits = logits + bias.astype(logits.dtype)
        loss_c, _, d_c = FWD.call(logits, lab_c, w_c, m_c if per_row_mask else mask,
                                  label_smoothing=ls, z_loss=zl, with_grad=with_grad,
                                  in_place=True, implementation=impl)  # dlogits over the logits
        if not with_grad:
            return carry, (loss_c, None)
        dw, db = carry
        dh_c = jnp.dot(d_c, w if transposed else w.T).astype(h.dtype)
        if transposed:
            dw = dw + jnp.dot(d_c.T, h_c, preferred_element_type=jnp.float32)
        else:
            dw = dw + jnp.dot(h_c.T, d_c, preferred_element_type=jnp.float32)
        if db is not None:
            db = db + jnp.sum(d_c, axis=0, dtype=jnp.float32)
        return (dw, db), (loss_c, dh_c)

    init = (jnp.zeros(w.shape, jnp.float32), None if bias is None else jnp.zeros((V,), jnp.float32))
    if not with_grad:
        init = ()
    carry, (loss, dh) = jax.lax.scan(body, init, xs, unroll=LCE_SCAN_UNROLL)
    loss = loss.reshape(-1)[:N]
    if not with_grad:
        return loss, None
    return loss, (dh.reshape(-1, d)[:N], carry[0], carry[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _lce_reduced(h, w, bias, lab, weight, mask, cfg, reduced):
    loss, _ = _lce_chunks(h, w, bias, lab, weight, mask, cfg, with_grad=False)
    return jnp.sum(loss) if reduced else loss


def _lce_reduced_fwd(h, w, bias, lab, weight, mask, cfg, reduced):
    if reduced:  # the gradients in the forward: the backward only scales them
        loss, (dh, dw, db) = _lce_chunks(h, w, bias, lab, weight, mask, cfg, with_grad=True)
        return jnp.sum(loss), (dh, dw.astype(w.dtype), None if db is None else db.astype(bias.dtype))
    loss, _ = _lce_chunks(h, w, bias, lab, weight, mask, cfg, with_grad=False)
    return loss, (h, w, bias, lab, weight, mask)


def _lce_reduced_bwd(cfg, reduced, res, g):
    if reduced:
        dh, dw, db = res
        g = g.astype(jnp.float32)
        scale = lambda a: None if a is None else (a.astype(jnp.float32) * g).astype(a.dtype)  # noqa: E731
        return scale(dh), scale(dw), scale(db), None, None, None
    # per-example losses: the cotangent joins the row weights, and the chunks run again
    h, w, bias, lab, weight, mask = res
    _, (dh, dw, db) = _lce_chunks(h, w, bias, lab, weight * g.astype(jnp.float32), mask, cfg,
                                  with_grad=True)
    return dh, dw.astype(w.dtype), None if db is None else db.astype(bias.dtype), None, None, None


_lce_reduced.defvjp(_lce_reduced_fwd, _lce_reduced_bwd)


def linear_cross_entropy(h, w, labels, *, bias=None, transposed_w: bool = False, where=None,
                         label_smoothing: float = 0.0, ignore_index: int | None = None,
                         z_loss: float = 0.0, reduction: str = "none", chunk_rows: int | None = None,
                         implementation: str | None = None):
    """cross_entropy(h @ w + bias, labels, ...) without the logits: the LM head and the loss.

    The rows (every axis of h but the last) are processed in chunks of `chunk_rows`:
    a chunk's logits come from an XLA matmul (cuBLAS), the cross-entropy forward stage
    (our kernels) computes its loss and dlogits in one pass over them, and two more matmuls
    give its dh and add its h^T dlogits to dw (float32). Only one chunk's logits and
    dlogits exist at a time. With reduction "mean" or "sum" the gradients are computed in
    the forward and the backward scales them by the cotangent (3 matmuls in all); with
    "none" the backward runs the chunks again with the per-example cotangents folded into
    the row weights (4 matmuls). Reverse-mode differentiation only (a custom VJP).

    Args:
      h: (..., d) float32, bfloat16 or float16: the last hidden states.
      w: (d, V) in h's dtype, or (V, d) with transposed_w=True (a tied embedding).
      labels: h's shape without the last axis, any integer dtype (cross_entropy's rules).
      bias: None or (V,), h's dtype or float32.
      where, label_smoothing, ignore_index, z_loss, reduction: as in cross_entropy with
        the classes last: where of labels' shape (per example) or of h's rank, broadcast
        to (..., V) (per class, e.g. (1, V) for a padded vocabulary).
      chunk_rows: rows per chunk; default: logits of about 256 MiB a chunk (a multiple of
        128 rows), which dlogits then overwrite.
      implementation: the cross-entropy stage's (None: automatic, "xla", "cuda", "pallas").

    Returns: float32 losses, labels' shape ("none") or a scalar. Gradients flow to h, w and
    bias (in their dtypes).
    """
    registry.check_name(OP, implementation)
    h, w, labels = jnp.asarray(h), jnp.asarray(w), jnp.asarray(labels)
    if h.dtype not in ACT_DTYPES:
        raise TypeError(f"jax_ops.{LCE}: h must be float32, bfloat16 or float16; got dtype {_fmt_dtype(h.dtype)}")
    if h.ndim < 1:
        raise ValueError(f"jax_ops.{LCE}: h must have at least 1 dimension (the hidden size last); "
                         f"got shape {tuple(h.shape)}")
    d = h.shape[-1]
    if not isinstance(transposed_w, (bool, np.bool_)):
        raise TypeError(f"jax_ops.{LCE}: transposed_w must be a bool; got {type(transposed_w).__name__}")
    if w.dtype != h.dtype or w.ndim != 2 or w.shape[1 if transposed_w else 0] != d:
        want = f"(V, {d})" if transposed_w else f"({d}, V)"
        raise ValueError(f"jax_ops.{LCE}: w must have shape {want} and h's dtype {_fmt_dtype(h.dtype)}"
                         f"{' (transposed_w=True)' if transposed_w else ''}; got {tuple(w.shape)} "
                         f"{_fmt_dtype(w.dtype)}")
    V = w.shape[0] if transposed_w else w.shape[1]
    if V < 1:
        raise ValueError(f"jax_ops.{LCE}: there must be at least one class; got w of shape {tuple(w.shape)}")
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (V,) or bias.dtype not in (_F32, h.dtype):
            raise ValueError(f"jax_ops.{LCE}: bias must have shape ({V},) and dtype float32 or "
                             f"{_fmt_dtype(h.dtype)}; got {tuple(bias.shape)} {_fmt_dtype(bias.dtype)}")
    ls, zl = _check_options(LCE, labels, label_smoothing, z_loss, reduction, ignore_index)
    expect = tuple(h.shape[:-1])
    if tuple(labels.shape) != expect:
        raise ValueError(f"jax_ops.{LCE}: labels must have shape {expect} (h's shape without its "
                         f"last axis); got shape {tuple(labels.shape)}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, (int, np.integer))
                                   or chunk_rows < 1):
        raise ValueError(f"jax_ops.{LCE}: chunk_rows must be a positive int or None; got {chunk_rows!r}")
    logits_shape = expect + (V,)
    if where is not None:
        where = _check_where(LCE, where, logits_shape, expect, "h's", lambda w: w[..., None])
    lab, weight, mask = _row_weights(labels, where, ignore_index, reduction, V)
    N = int(np.prod(expect))
    if N == 0:
        out = jnp.zeros(expect, jnp.float32)
        return out if reduction == "none" else jnp.sum(out)
    if mask is not None:  # (1, V): one row for every example, else (N, V)
        mask = (mask.reshape(1, V) if all(n == 1 for n in mask.shape[:-1])
                else jnp.broadcast_to(mask, logits_shape).reshape(N, V))
    chunk = int(chunk_rows) if chunk_rows is not None else default_chunk_rows(N, V, h.dtype.itemsize)
    cfg = (bool(transposed_w), min(chunk, N), ls, zl, implementation or registry.override_for(OP))
    out = _lce_reduced(h.reshape(N, d), w, bias, lab.reshape(N), weight.reshape(N), mask, cfg,
                       reduction != "none")
    return out if reduction != "none" else out.reshape(expect)


# ----------------------------------------------- cross_entropy: benchmark specs (jax_ops.bench) ---
# logits (rows, cols) = (tokens, vocabulary); the op is the mean loss (what training
# differentiates, cotangent 1), labels uniform over the vocabulary.

LOGIT_SCALE = 2.0  # logits = 2 * N(0, 1)


def cross_entropy_specs() -> dict[str, BenchSpec]:
    """Benchmark of cross_entropy: the mean loss over (rows, cols) logits."""

    def make_inputs(kx, kp, kq, dtype, rows, cols):
        x = LOGIT_SCALE * jax.random.normal(kx, (rows, cols), dtype)
        return x.astype(dtype), (jax.random.randint(kp, (rows,), 0, cols, jnp.int32),)

    def kernel(impl):
        return lambda x, labels: cross_entropy(x, labels, reduction="mean", implementation=impl)

    def reference(dtype):
        """optax on float32 logits, as users write it (jnp with the same formula where
        optax is not installed)."""
        try:
            import optax
            ce = optax.softmax_cross_entropy_with_integer_labels
        except ImportError:  # pragma: no cover - optax is a bench/test extra
            def ce(z, labels):
                lab = jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
                return jax.nn.logsumexp(z, axis=-1) - lab
        return lambda x, labels: ce(x.astype(jnp.float32), labels).mean()

    def nbytes(rows, cols, itemsize):
        x = rows * cols * itemsize
        # forward: read the logits; training forward + backward: read them, write dlogits
        # (the backward only scales it, and skips it for the cotangent 1 of a mean).
        return {"fwd": x + 8 * rows, "bwd": 2 * x, "fwd_bwd": 2 * x + 8 * rows}

    return {"cross_entropy": BenchSpec(
        make_inputs=make_inputs, kernel=kernel, reference=reference, nbytes=nbytes,
        diff_params=False, table_stages=("fwd", "bwd"),
        cotangent=lambda key, rows, cols, dtype: jnp.ones((), jnp.float32),
        title=" (mean loss, labels uniform)")}


# -------------------------------------------- rewrite patterns (jax_ops.fx) ---
# optax's softmax_cross_entropy_with_integer_labels and the hand-written
# -take_along_axis(log_softmax(logits), labels), each optionally on logits cast to
# float32 first (the cast is exact, and the op's math is float32: the replacement reads
# the narrow logits), optionally averaged (reduction="mean"), and optionally on the
# logits sliced along the sequence axis to the labels' length (a language model's
# `logits[:, :-1]` against `ids[:, 1:]`): then the op reads the whole logits and the
# rows past the labels are excluded with `where` (no sliced copy; their gradient is 0,
# the transpose of the slice).

def _shifted(logits, labels):
    return logits[:, :labels.shape[1]]


def _optax_ce_ref(logits, labels, *, upcast, shift, mean):
    import optax
    if shift:
        logits = _shifted(logits, labels)
    if upcast:
        logits = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return loss.mean() if mean else loss


def _log_softmax_take_ref(logits, labels, *, upcast, shift, mean):
    if shift:
        logits = _shifted(logits, labels)
    if upcast:
        logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, labels[..., None], axis=-1)
    nll = -picked[..., 0]
    return nll.mean() if mean else nll


def _take_mean_ref(logits, labels, *, upcast, shift, mean):
    """-take_along_axis(log_softmax(logits), labels[..., None]).mean(): the mean of the
    picked log-probabilities, negated: the mean of the per-example losses exactly
    (negation is exact and commutes with rounding, so -(Σ x / n) == Σ(-x) / n)."""
    if shift:
        logits = _shifted(logits, labels)
    if upcast:
        logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


def _mean_only(static):
    def only(avals, out_aval):
        return [s for s in static(avals, out_aval) if s["mean"]]
    return only


def _ce_static(avals, out_aval):
    logits, labels = avals[0], avals[1]
    if logits is None or labels is None or len(logits.shape) != len(labels.shape) + 1:
        return []
    shifts = [False]
    if len(logits.shape) == 3 and logits.shape[0] == labels.shape[0] and \
            logits.shape[1] > labels.shape[1]:
        shifts = [True]
    upcasts = [False] if logits.dtype == jnp.float32 else [True, False]
    means = [False, True] if out_aval is None else [len(out_aval.shape) == 0]
    return [{"upcast": u, "shift": s, "mean": m} for u in upcasts for s in shifts for m in means]


def _ce_examples():
    """The shifted structure first: it contains the unshifted one and must win."""
    out = [(sds((2, 8, 16), dt), sds((2, 7), jnp.int32)) for dt in (F32, BF16)]
    for dt in (F32, BF16):
        out.append((sds((8, 16), dt), sds((8,), jnp.int32)))
        out.append((sds((2, 8, 16), dt), sds((2, 8), jnp.int32)))
    return out


def _ce_accepts(avals):
    logits, labels = avals[0], avals[1]
    if logits.dtype not in OP_DTYPES:
        return f"logits are {logits.dtype}; jax_ops.cross_entropy takes float32, bfloat16, float16"
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        return f"labels are {labels.dtype}, not integers"
    return None


def _shifted_loss(loss_fn, labels, t, shift, mean):
    """loss_fn(labels, where, reduction) on the whole sequence of length t: labels
    shorter than t (a shift) are padded and the rows past them left out with `where`
    (their gradient is 0, the transpose of the slice); per-example losses are cut back
    to the labels' length."""
    reduction = "mean" if mean else "none"
    if not shift:
        return loss_fn(labels, None, reduction)
    n = labels.shape[1]
    full = jnp.concatenate([labels, jnp.zeros((labels.shape[0], t - n), labels.dtype)], axis=1)
    keep = jnp.broadcast_to(jnp.arange(t) < n, full.shape)
    loss = loss_fn(full, keep, reduction)
    return loss if mean else loss[:, :n]


def cross_entropy_replacement(logits, labels, *, shift=False, mean=False, **_):
    return _shifted_loss(lambda lab, where, reduction: cross_entropy(
        logits, lab, where=where, reduction=reduction), labels, logits.shape[-2] if shift else 0,
        shift, mean)


def cross_entropy_patterns() -> list[Pattern]:
    return [*linear_cross_entropy_patterns(), Pattern("cross_entropy",
                    [Formulation(_optax_ce_ref, _ce_static,
                                 "optax.softmax_cross_entropy_with_integer_labels"),
                     Formulation(_log_softmax_take_ref, _ce_static,
                                 "-take_along_axis(log_softmax(logits), labels)"),
                     Formulation(_take_mean_ref, _mean_only(_ce_static),
                                 "-take_along_axis(log_softmax(logits), labels).mean()")],
                    cross_entropy_replacement, _ce_examples(), accepts=_ce_accepts,
                    reported=("shift", "mean"), priority=1)]  # before log_softmax, which it contains


# ------------------------------ linear_cross_entropy: rewrite pattern (jax_ops.fx) ---
# The LM head feeding any cross_entropy formulation above: `logits = h @ w` (w (d, V)),
# the tied embedding `jnp.dot(h, E.T)` (flax nn.Embed.attend; E (V, d)), or flax
# nn.Dense's lax.dot_general, optionally plus a bias of the logits' dtype (`+ b`, or
# flax Dense's reshaped bias), then the float32 upcast, the CE, the mean and the LM
# shift as the cross_entropy pattern accepts them. The matmul's params are taken from
# the graph (Formulation(node_params=...): its re-traced equation then equals the
# graph's whatever they are) and `specialize` accepts only what the op's chunk matmuls
# compute: h's last axis contracted with one axis of w, no batch axes, the default
# precision, the logits in h's dtype. The logits must have no other use (escaping
# intermediates are refused by fx), so a model returning logits and loss keeps both.

DOT = "dot_general"


def _lce_logits(h, w, bias, *, tied, bias_form, dot_general):
    ww = jnp.transpose(w) if tied else w
    if dot_general is None:  # templates: only the structure matters
        logits = jnp.matmul(h, ww)
    else:  # the graph's equation, params and all (specialize judges them)
        logits = jax.lax.dot_general_p.bind(h, ww, **dict(dot_general))
    if bias is not None:
        if bias_form == "flax":  # flax.linen.Dense: y += reshape(bias, (1, ..., 1, V))
            logits += jnp.reshape(bias, (1,) * (logits.ndim - 1) + (-1,))
        else:
            logits = logits + bias
    return logits


def _lce_optax_ref(h, w, bias, labels, *, tied, bias_form, dot_general, upcast, shift, mean):
    logits = _lce_logits(h, w, bias, tied=tied, bias_form=bias_form, dot_general=dot_general)
    return _optax_ce_ref(logits, labels, upcast=upcast, shift=shift, mean=mean)


def _lce_take_ref(h, w, bias, labels, *, tied, bias_form, dot_general, upcast, shift, mean):
    logits = _lce_logits(h, w, bias, tied=tied, bias_form=bias_form, dot_general=dot_general)
    return _log_softmax_take_ref(logits, labels, upcast=upcast, shift=shift, mean=mean)


def _lce_take_mean_ref(h, w, bias, labels, *, tied, bias_form, dot_general, upcast, shift, mean):
    logits = _lce_logits(h, w, bias, tied=tied, bias_form=bias_form, dot_general=dot_general)
    return _take_mean_ref(logits, labels, upcast=upcast, shift=shift, mean=mean)


def _lce_static(avals, out_aval):
    h, w, bias, labels = avals
    if h is None or w is None or labels is None or len(w.shape) != 2 or \
            len(h.shape) != len(labels.shape) + 1:
        return []
    d = h.shape[-1]
    # templates: w's shape says which; verification: both (the dimension numbers say
    # which axis of w is contracted: einsum's "btd,vd->btv" has no transpose; another
    # contraction is then refused by specialize, with the reason)
    tieds = [t for t in (False, True) if w.shape[1 if t else 0] == d] if out_aval is None else [True, False]
    shifts = [False]
    if len(h.shape) == 3 and h.shape[0] == labels.shape[0] and h.shape[1] > labels.shape[1]:
        # verification: unshifted too, for an h whose axis 1 is not the sequence (its
        # contraction is then refused by specialize, with the reason)
        shifts = [True] if out_aval is None else [True, False]
    upcasts = [False] if h.dtype == jnp.float32 else [True, False]
    means = [False, True] if out_aval is None else [len(out_aval.shape) == 0]
    forms = [None] if bias is None else ["add", "flax"]
    return [{"tied": t, "bias_form": f, "upcast": u, "shift": s, "mean": m}
            for t in tieds for f in forms for u in upcasts for s in shifts for m in means]


def _lce_examples():
    """h (rows, d) or (b, t, d) with labels one shorter (the shift), w (V, d) (tied) or
    (d, V), bias absent or (V,); d != V so w's shape says which. float32, and bfloat16
    for the structures with the upcast. The tied structure first: it contains the other
    (whose w would be the transposed copy) and must win."""
    out = []
    d, V = 16, 12
    for dt in (F32, BF16):
        for h, lab in (((2, 8, d), (2, 7)), ((8, d), (8,))):
            for w in ((V, d), (d, V)):
                for b in (None, sds((V,), dt)):
                    out.append((sds(h, dt), sds(w, dt), b, sds(lab, jnp.int32)))
    return out


def _lce_accepts(avals):
    h, w, bias, labels = avals
    if h.dtype not in OP_DTYPES:
        return f"h is {h.dtype}; jax_ops.linear_cross_entropy takes float32, bfloat16, float16"
    if w.dtype != h.dtype:
        return f"w is {w.dtype}, h {h.dtype}: jax_ops.linear_cross_entropy takes both in one dtype"
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        return f"labels are {labels.dtype}, not integers"
    if bias is not None and (len(bias.shape) != 1 or bias.dtype != h.dtype):
        return (f"the bias is {bias.dtype}{list(bias.shape)}: linear_cross_entropy adds a "
                f"(V,) bias in the logits' dtype {h.dtype}")
    return None


def _default_precision():
    """The precision jnp.dot records now (None, or the default_matmul_precision in
    effect): what linear_cross_entropy's chunk matmuls get."""
    j = jax.make_jaxpr(jnp.dot)(jax.ShapeDtypeStruct((2, 2), jnp.float32),
                                jax.ShapeDtypeStruct((2, 2), jnp.float32))
    return j.eqns[0].params["precision"]


def _lce_specialize(graph_args, avals, params):
    """transposed_w from the matmul's dimension numbers; the reason where the matmul
    is not the op's (another contraction, batch axes, precision, result dtype)."""
    h, w = avals[0], avals[1]
    dg = dict(params[DOT])
    (lc, rc), (lb, rb) = dg["dimension_numbers"]
    if tuple(lb) or tuple(rb):
        return "the matmul has batch axes (linear_cross_entropy: one (d, V) or (V, d) w)"
    if tuple(lc) != (len(h.shape) - 1,) or len(rc) != 1:
        return (f"the matmul contracts axes {tuple(lc)} of h {tuple(h.shape)}; "
                "linear_cross_entropy contracts h's last axis")
    w_axis = rc[0] if not params["tied"] else 1 - rc[0]  # the axis of w (as passed) contracted
    prec, want = dg.get("precision"), _default_precision()
    if prec != want:
        return (f"the matmul has precision={prec}; linear_cross_entropy's matmuls run at the "
                f"default precision ({want})")
    pet = dg.get("preferred_element_type")
    if pet is not None and np.dtype(pet) != np.dtype(h.dtype):
        return (f"the matmul gives {np.dtype(pet)} logits from {np.dtype(h.dtype)} inputs; "
                f"linear_cross_entropy's logits are {np.dtype(h.dtype)}")
    if dg.get("out_sharding") is not None:
        return "the matmul has an out_sharding"
    return {"transposed_w": bool(w_axis == 1)}


def _lce_shape(avals, params):
    """(rows N, d, V, itemsize) of a match."""
    h, w = avals[0], avals[1]
    d = h.shape[-1]
    V = w.shape[0] if params.get("transposed_w") else w.shape[1]
    return int(np.prod(h.shape[:-1])), d, V, np.dtype(h.dtype).itemsize


def lce_decide(avals, params) -> str | None:
    """policy="auto": replace only where linear_cross_entropy is estimated not slower
    than what the match becomes otherwise, h @ w and our fused cross_entropy (the
    cross_entropy pattern), by the measured model LCE_MODEL (lce_estimate). On the GPUs
    measured it never is: the record says by how much, and policy="memory" takes it."""
    from jax_ops.core.dispatch import device_kind
    from jax_ops.core.op import default_platform
    platform = default_platform()
    kind = device_kind(platform) or platform
    est = lce_estimate(*_lce_shape(avals, params), kind)
    if est["extra_ms"] is None:
        return f"not faster on {kind}: {est['why']}"
    if est["extra_ms"] > 0:
        return (f"not faster on {kind}: estimated {est['lce_ms']:.2f} ms vs {est['unfused_ms']:.2f} ms "
                f"for h @ w + cross_entropy ({est['why']}); policy=\"memory\" takes it "
                f"({est['lce_mib']:.0f} vs {est['unfused_mib']:.0f} MiB)")
    return None


def lce_decide_memory(avals, params) -> str | None:
    """policy="memory": replace where linear_cross_entropy's temporaries (one chunk's
    logits, the float32 dw accumulator) are smaller than those of h @ w + cross_entropy
    (the logits and their gradient), whatever the time (lce_estimate)."""
    est = lce_estimate(*_lce_shape(avals, params), None)
    if est["lce_mib"] >= est["unfused_mib"]:
        return (f"saves no memory: {est['lce_mib']:.0f} MiB for a chunk's logits and the float32 "
                f"dw accumulator vs {est['unfused_mib']:.0f} MiB for the logits and their gradient")
    return None


def linear_cross_entropy_replacement(h, w, bias, labels, *, shift=False, mean=False,
                                     transposed_w=False, **_):
    return _shifted_loss(lambda lab, where, reduction: linear_cross_entropy(
        h, w, lab, bias=bias, transposed_w=transposed_w, where=where, reduction=reduction),
        labels, h.shape[-2] if shift else 0, shift, mean)


def linear_cross_entropy_patterns() -> list[Pattern]:
    return [Pattern(LCE,
                    [Formulation(_lce_optax_ref, _lce_static,
                                 "h @ w, optax.softmax_cross_entropy_with_integer_labels",
                                 node_params=(DOT,)),
                     Formulation(_lce_take_ref, _lce_static,
                                 "h @ w, -take_along_axis(log_softmax(logits), labels)",
                                 node_params=(DOT,)),
                     Formulation(_lce_take_mean_ref, _mean_only(_lce_static),
                                 "h @ w, -take_along_axis(log_softmax(logits), labels).mean()",
                                 node_params=(DOT,))],
                    linear_cross_entropy_replacement, _lce_examples(), accepts=_lce_accepts,
                    specialize=_lce_specialize, decide=lce_decide, decide_memory=lce_decide_memory,
                    reported=("shift", "mean", "transposed_w"),
                    priority=2)]  # before cross_entropy (priority 1), which it contains
