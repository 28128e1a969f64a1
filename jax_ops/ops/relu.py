"""ReLU and Add+ReLU whose backward keeps one bit per element.

Forward primitive  jax_ops_relu_fwd(x, z) -> (y, mask)
Backward primitive jax_ops_relu_bwd(dy, mask) -> (dx,)

y = relu(x) or relu(x + z) (the sum in float32, rounded once to x's dtype; NaN
propagates like jnp.maximum). The VJP residual is `mask` alone: uint32 words of shape
(ceil(n / 32),) for the n elements of x flattened row-major, bit i % 32 of word i // 32
set iff the pre-activation of element i is > 0 (NaN: clear), the bits past n clear.
For bfloat16 that is 1/16 of x's bytes (jax.nn.relu keeps x or a byte per element).
dx = dy where the bit is set, else 0; add_relu's dz is the same array.
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from jax_ops import registry
from jax_ops.sharding import Rules, mask_is_rowwise
from jax_ops.primitive import ACT_DTYPES, empty as _empty, dtype_name as _fmt_dtype  # noqa: F401 - shared helpers
from jax_ops.primitive import (define_primitive, ffi_lowering, ffi_supports, jnp_lowering,
                               match_vma, pallas_lowering, pallas_supports, user_lowerings,
                               vmap_reference)
from pallas_kernels import relu as pallas_relu

MASK_DTYPE = jnp.dtype(jnp.uint32)


def mask_words(n) -> int:
    """uint32 words of the 1-bit mask of n elements (n may be a symbolic dim)."""
    return -(-(int(n) if isinstance(n, (int, np.integer)) else n) // 32)


def mask_shape(shape) -> tuple:
    """The mask's shape for x of `shape`: when x's last axis is a whole number of words,
    x's shape with that axis in words (x.shape[:-1] + (cols // 32,)) — the bytes of the
    flat layout, but on x's axes, so the mask shards like x across devices —, else the
    flat (ceil(n / 32),)."""
    shape = tuple(shape)
    if mask_is_rowwise(shape):
        return shape[:-1] + (shape[-1] // 32,)
    return (mask_words(math.prod(shape)),)


# -------------------------------------------------- bit mask pack / unpack ---

def pack_bits(pred) -> jax.Array:
    """bool array (any shape) -> uint32 (ceil(n/32),): bit i % 32 of word i // 32 = flat pred[i]."""
    flat = pred.reshape(-1)
    n = flat.shape[0]
    words = mask_words(n)
    bits = jnp.pad(flat, (0, words * 32 - n)).reshape(words, 32).astype(MASK_DTYPE)
    return jnp.sum(bits << jnp.arange(32, dtype=MASK_DTYPE), axis=1, dtype=MASK_DTYPE)


def unpack_bits(mask, shape) -> jax.Array:
    """uint32 words (any shape of ceil(n/32) words) -> bool array of `shape` (n
    elements), inverse of pack_bits."""
    n = math.prod(shape)
    bits = (mask.reshape(-1)[:, None] >> jnp.arange(32, dtype=MASK_DTYPE)) & 1
    return bits.reshape(-1)[:n].reshape(shape).astype(bool)


def relu_out(pre):
    """max(pre, 0) with NaN kept (jnp.maximum's rule), in pre's dtype."""
    return jnp.maximum(pre, 0)


# ------------------------------------------------------------- validation ---

def _check_x(op, x):
    if x.dtype not in ACT_DTYPES:
        raise TypeError(f"jax_ops.{op}: x must be float32, bfloat16 or float16; "
                        f"got dtype {_fmt_dtype(x.dtype)}")


def check_z(op, x, z):
    """z must have x's dtype and a shape that broadcasts to x's."""
    if z.dtype != x.dtype:
        raise TypeError(f"jax_ops.{op}: z must have x's dtype {_fmt_dtype(x.dtype)}; "
                        f"got {_fmt_dtype(z.dtype)}")
    try:
        shape = jnp.broadcast_shapes(tuple(z.shape), tuple(x.shape))
    except ValueError:
        shape = None
    if shape != tuple(x.shape):
        raise ValueError(f"jax_ops.{op}: z must have x's shape {tuple(x.shape)} (or one that "
                         f"broadcasts to it); got shape {tuple(z.shape)}")


# ---------------------------------------------------------------- forward ---

def _op_of(params) -> str:
    return "add_relu" if params["has_z"] else "relu"


def _fwd_abstract(x, z, *, has_z, implementation):
    _check_x(_op_of({"has_z": has_z}), x)
    if has_z and (z.shape != x.shape or z.dtype != x.dtype):
        raise ValueError(f"jax_ops.add_relu forward: z must match x; got z {z.shape} "
                         f"{_fmt_dtype(z.dtype)} and x {x.shape} {_fmt_dtype(x.dtype)}")
    return core.ShapedArray(x.shape, x.dtype), core.ShapedArray(mask_shape(x.shape), MASK_DTYPE)


def _fwd_reference(x, z, *, has_z):
    pre = x.astype(jnp.float32)
    if has_z:
        pre = pre + z.astype(jnp.float32)
    return relu_out(pre).astype(x.dtype), pack_bits(pre > 0).reshape(mask_shape(x.shape))


def _fold_batch(a, d, size):
    """Batch axis first; an unbatched operand is broadcast to the batch."""
    return jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size,) + a.shape)


def _fwd_batch(args, dims, **params):
    x, z = args
    size = x.shape[dims[0]] if dims[0] is not None else z.shape[dims[1]]
    per_example = int(np.prod(x.shape, dtype=np.int64)) // (x.shape[dims[0]] if dims[0] is not None else 1)
    if per_example % 32:  # examples' masks don't start on word boundaries
        return vmap_reference(_fwd_reference, args, dims, params)
    x = _fold_batch(x, dims[0], size)
    if params["has_z"]:
        z = _fold_batch(z, dims[1], size)
    y, mask = relu_fwd_p.bind(x, z, **params)
    return (y, mask.reshape((size,) + mask_shape(x.shape[1:]))), (0, 0)


def mask_policy(layout, mesh, params):
    """Shardings the mask can follow: with a row-wise mask, any sharding of x whose
    local last axis is a whole number of words; with a flat mask (x's last axis not a
    multiple of 32), none — x is gathered (documented)."""
    if not mask_is_rowwise(layout.shape):
        return layout.replace(dims=((),) * len(layout.dims))
    k = math.prod(mesh.shape[a] for a in layout.dims[-1])
    if (layout.shape[-1] // k) % 32:
        return layout.replace(dims=layout.dims[:-1] + ((),))
    return layout


# relu is elementwise: every device runs the kernel on its shard; the mask shards like x.
FWD_RULES = Rules(ins=lambda p: ("x", "x"), outs=lambda p: ("x", "mask"), policy=mask_policy)
BWD_RULES = Rules(ins=lambda p: ("x", "mask"), outs=lambda p: ("x",), policy=mask_policy)

relu_fwd_p = define_primitive("relu_fwd", stage="fwd", op_of=_op_of, abstract_eval=_fwd_abstract,
                              batching_rule=_fwd_batch, sharding=FWD_RULES)


# --------------------------------------------------------------- backward ---

def _bwd_abstract(dy, mask, *, has_z, implementation):
    if mask.dtype != MASK_DTYPE or tuple(mask.shape) != mask_shape(dy.shape):
        raise ValueError(f"jax_ops.{_op_of({'has_z': has_z})} backward: mask must be uint32 of shape "
                         f"{mask_shape(dy.shape)} for dy of shape {dy.shape}; got {mask.shape} "
                         f"{_fmt_dtype(mask.dtype)}")
    return (core.ShapedArray(dy.shape, dy.dtype),)


def _bwd_reference(dy, mask, *, has_z):
    del has_z
    return (jnp.where(unpack_bits(mask, dy.shape), dy, jnp.zeros((), dy.dtype)),)


def _bwd_batch(args, dims, **params):
    dy, mask = args
    size = dy.shape[dims[0]] if dims[0] is not None else mask.shape[dims[1]]
    per_example = int(np.prod(dy.shape, dtype=np.int64)) // (dy.shape[dims[0]] if dims[0] is not None else 1)
    if per_example % 32:
        return vmap_reference(_bwd_reference, args, dims, params)
    dy = _fold_batch(dy, dims[0], size)
    mask = _fold_batch(mask, dims[1], size).reshape(mask_shape(dy.shape))
    return relu_bwd_p.bind(dy, mask, **params), (0,)


relu_bwd_p = define_primitive("relu_bwd", stage="bwd", op_of=_op_of, abstract_eval=_bwd_abstract,
                              batching_rule=_bwd_batch, sharding=BWD_RULES)


# --------------------------------------------------------- implementations ---

def _pallas_fwd(x, z, *, has_z, config, interpret):
    if x.size == 0:
        return _fwd_reference(x, z, has_z=has_z)
    y, mask = pallas_relu.relu_fwd(x, z if has_z else None, config=config, interpret=interpret)
    return y, mask.reshape(mask_shape(x.shape))


def _pallas_bwd(dy, mask, *, has_z, config, interpret):
    del has_z
    if dy.size == 0:
        return (dy,)
    return (pallas_relu.relu_bwd(dy, mask.reshape(-1), config=config, interpret=interpret),)


def _pallas_configs(q):
    n = int(np.prod(q.shape, dtype=np.int64)) if q.static else 1 << 20
    return pallas_relu.candidate_configs(max(n, 1), q.stage)


def _pallas_limit(q):
    n = int(np.prod(q.shape, dtype=np.int64))
    return pallas_relu.supports(n)


def _user_lowerings(op):
    """Adapter for register_implementation: fn(x) -> y for relu, fn(x, z) -> y for
    add_relu (the mask is packed from y > 0 by jnp); backward(dy, mask) -> dx."""
    def adapt(fn, backward, tunable):
        def fwd(x, z, *, has_z, config):
            kw = {"config": config} if tunable else {}
            y = jnp.asarray(fn(x, z, **kw) if has_z else fn(x, **kw)).astype(x.dtype).reshape(x.shape)
            return y, pack_bits(y > 0).reshape(mask_shape(x.shape))

        def bwd(dy, mask, *, has_z, config):
            kw = {"config": config} if tunable else {}
            return (jnp.asarray(backward(dy, mask.reshape(-1), **kw)).astype(dy.dtype).reshape(dy.shape),)

        return user_lowerings(fwd, bwd if backward is not None else None)
    return adapt


def _register_builtins():
    for op in ("relu", "add_relu"):
        registry.add(registry.Implementation(
            op, "xla", {"fwd": jnp_lowering(_fwd_reference), "bwd": jnp_lowering(_bwd_reference)},
            supports=lambda q: True, description="plain jax.numpy (bit packing by a reduction)"))
        registry.add(registry.Implementation(
            op, "cuda",
            {"fwd": ffi_lowering("jax_ops_relu_fwd", lambda p: {"has_z": bool(p["has_z"])},
                                 flat_results=(1,)),
             "bwd": ffi_lowering("jax_ops_relu_bwd", lambda p: {}, flat_operands=(1,))},
            supports=ffi_supports("jax_ops_relu_fwd"),
            description="hand CUDA kernels through XLA FFI (host C++ on CPU)"))
        registry.add(registry.Implementation(
            op, "pallas", {"fwd": pallas_lowering(_pallas_fwd), "bwd": pallas_lowering(_pallas_bwd)},
            supports=pallas_supports(_pallas_limit), configs=_pallas_configs,
            description="Pallas kernels (Triton back end)"))
        registry.define_user_adapter(op, _user_lowerings(op))


_register_builtins()


# ------------------------------------------------------------- custom VJP ---

@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _relu(x, z, has_z, implementation):
    y, _ = relu_fwd_p.bind(x, z, has_z=has_z, implementation=implementation)
    return y


def _relu_fwd(x, z, has_z, implementation):
    y, mask = relu_fwd_p.bind(x, z, has_z=has_z, implementation=implementation)
    return y, mask


def _relu_bwd(has_z, implementation, mask, dy):
    (dx,) = relu_bwd_p.bind(dy, mask, has_z=has_z, implementation=implementation)
    return dx, (dx if has_z else _empty())


_relu.defvjp(_relu_fwd, _relu_bwd)


# ------------------------------------------------------------- public API ---

def relu(x, *, implementation: str | None = None):
    """max(x, 0), like jax.nn.relu (gradient 0 at x <= 0 and at NaN), keeping one bit
    per element for the backward.

    Args:
      x: float32, bfloat16 or float16 array of any shape.
      implementation: None (automatic), "xla", "cuda" or "pallas".
    """
    registry.check_name("relu", implementation)
    x = jnp.asarray(x)
    _check_x("relu", x)
    return _relu(x, _empty(), False, implementation or registry.override_for("relu"))


def add_relu(x, z, *, implementation: str | None = None):
    """relu(x + z) in one pass; the gradient flows to both x and z (one bit per element kept).

    Args:
      x: float32, bfloat16 or float16 array of any shape.
      z: x's dtype; x's shape or one that broadcasts to it (then materialized by
        jnp.broadcast_to, and its gradient summed over the broadcast axes).
      implementation: None (automatic), "xla", "cuda" or "pallas".

    The sum is formed in float32 and rounded once.
    """
    registry.check_name("add_relu", implementation)
    x, z = jnp.asarray(x), jnp.asarray(z)
    _check_x("add_relu", x)
    check_z("add_relu", x, z)
    if z.shape != x.shape:
        z = jnp.broadcast_to(z, x.shape)
    x, z = match_vma(x, z)
    return _relu(x, z, True, implementation or registry.override_for("add_relu"))
