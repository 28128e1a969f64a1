"""ReLU and Add+ReLU whose backward keeps one bit per element: the declaration (core/op.py).

Forward stage  jax_ops_relu_fwd(x, z?) -> (y, mask)
Backward stage jax_ops_relu_bwd(dy, mask) -> (dx,)

y = relu(x) (no z: the op is relu) or relu(x + z) (add_relu; the sum in float32,
rounded once to x's dtype; NaN propagates like jnp.maximum). The residual is `mask`
alone, the 1-bit mask of core/bitmask.py (bit set iff the pre-activation is > 0, NaN:
clear): for bfloat16 1/16 of x's bytes (jax.nn.relu keeps x or a byte per element).
dx = dy where the bit is set, else 0; add_relu's dz is the same array.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import core

from jax_ops.core import registry
from jax_ops.core.benchspec import BenchSpec
from jax_ops.core.validate import check_broadcastable
from jax_ops.core.bitmask import MASK_DTYPE, WORD, mask_shape, pack_bits, sharding_policy, unpack_bits
from jax_ops.core.op import (Impl, Op, Stage, ffi, ffi_supports, match_vma,
                             pallas_supports, vmap_reference)
from jax_ops.core.pattern import BF16, CLAIMED_BY, Formulation, Pattern, accepts_x, sds
from jax_ops.core.validate import ACT_DTYPES
from jax_ops.core.validate import dtype_name as _fmt_dtype
from pallas_kernels import relu as pallas_relu


def _op_name(has_z: bool) -> str:
    return "add_relu" if has_z else "relu"


# ------------------------------------------------------------- validation ---

def _check_x(op, x):
    if x.dtype not in ACT_DTYPES:
        raise TypeError(f"jax_ops.{op}: x must be float32, bfloat16 or float16; "
                        f"got dtype {_fmt_dtype(x.dtype)}")


# ---------------------------------------------------------------- forward ---

def _fwd_abstract(x, z):
    _check_x(_op_name(z is not None), x)
    if z is not None and (z.shape != x.shape or z.dtype != x.dtype):
        raise ValueError(f"jax_ops.add_relu forward: z must match x; got z {z.shape} "
                         f"{_fmt_dtype(z.dtype)} and x {x.shape} {_fmt_dtype(x.dtype)}")
    return core.ShapedArray(x.shape, x.dtype), core.ShapedArray(mask_shape(x.shape), MASK_DTYPE)


def _fwd_reference(x, z):
    pre = x.astype(jnp.float32)
    if z is not None:
        pre = pre + z.astype(jnp.float32)
    # jnp.maximum keeps NaN; the mask bit of NaN is clear
    return jnp.maximum(pre, 0).astype(x.dtype), pack_bits(pre > 0)


def _front(a, d, size):
    """Batch axis first; an unbatched operand is broadcast to the batch."""
    return jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size,) + a.shape)


def _example_shape(a, d):
    return a.shape if d is None else a.shape[:d] + a.shape[d + 1:]


def _fwd_batch(stage, args, dims, **params):
    x, z = args
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    example = _example_shape(x, dims[0])
    if math.prod(example) % WORD:  # the examples' masks would not start on word boundaries
        return vmap_reference(stage, args, dims, **params)
    x = _front(x, dims[0], size)
    z = None if z is None else _front(z, dims[1], size)
    y, mask = stage.call(x, z, **params)
    return (y, mask.reshape((size,) + mask_shape(example))), (0, 0)


# --------------------------------------------------------------- backward ---

def _bwd_abstract(dy, mask, *, has_z):
    if mask.dtype != MASK_DTYPE or tuple(mask.shape) != mask_shape(dy.shape):
        raise ValueError(f"jax_ops.{_op_name(has_z)} backward: mask must be uint32 of shape "
                         f"{mask_shape(dy.shape)} for dy of shape {dy.shape}; got {mask.shape} "
                         f"{_fmt_dtype(mask.dtype)}")
    return (core.ShapedArray(dy.shape, dy.dtype),)


def _bwd_reference(dy, mask, *, has_z):
    return (jnp.where(unpack_bits(mask, dy.shape), dy, jnp.zeros((), dy.dtype)),)


def _bwd_batch(stage, args, dims, **params):
    dy, mask = args
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if math.prod(_example_shape(dy, dims[0])) % WORD:
        return vmap_reference(stage, args, dims, **params)
    dy = _front(dy, dims[0], size)
    mask = _front(mask, dims[1], size).reshape(mask_shape(dy.shape))
    return stage.call(dy, mask, **params), (0,)


# --------------------------------------------------------- implementations ---

_ffi_fwd = ffi("jax_ops_relu_fwd", lambda p: {"has_z": p["has_z"]}, flat_results=(1,))


def _cuda_fwd(call, x, z):
    # The handler's has_z attribute says whether z is bound.
    return _ffi_fwd(call, x, z, has_z=z is not None)


def _pallas_fwd(call, x, z):
    y, mask = pallas_relu.relu_fwd(x, z, config=call.config, interpret=call.interpret)
    return y, mask.reshape(mask_shape(x.shape))


def _pallas_bwd(call, dy, mask, *, has_z):
    return (pallas_relu.relu_bwd(dy, mask.reshape(-1), config=call.config, interpret=call.interpret),)


def _pallas_configs(q):
    n = int(np.prod(q.shape, dtype=np.int64)) if q.static else 1 << 20
    return pallas_relu.candidate_configs(max(n, 1), q.stage)


def _pallas_limit(q):
    return pallas_relu.supports(int(np.prod(q.shape, dtype=np.int64)))


def _user_adapter(fn, backward, tunable):
    """register_implementation's adapter: fn(x) -> y for relu, fn(x, z) -> y for
    add_relu (the mask is packed from y > 0 by jnp); backward(dy, mask) -> dx, the mask
    flat (ceil(n / 32),)."""
    def fwd(call, x, z):
        kw = {"config": call.config} if tunable else {}
        y = fn(x, **kw) if z is None else fn(x, z, **kw)
        y = jnp.asarray(y).astype(x.dtype).reshape(x.shape)
        return y, pack_bits(y > 0)

    def bwd(call, dy, mask, *, has_z):
        kw = {"config": call.config} if tunable else {}
        return (jnp.asarray(backward(dy, mask.reshape(-1), **kw)).astype(dy.dtype).reshape(dy.shape),)

    return {"fwd": fwd, **({"bwd": bwd} if backward is not None else {})}


# ----------------------------------------------------------- declaration ---

# relu is elementwise: every device runs the kernels on its shard; the mask shards like
# x where its last axis holds whole words (bitmask.sharding_policy).
FWD = Stage("relu_fwd", "fwd", ("x", "z?"), ("y", "mask"),
            op_of=lambda p: _op_name(p["present"][1]), abstract=_fwd_abstract,
            reference=_fwd_reference, batch=_fwd_batch,
            roles={"x": "x", "z": "x", "y": "x", "mask": "mask"}, policy=sharding_policy)
# has_z: whether the forward added z (which op's implementation the backward takes)
BWD = Stage("relu_bwd", "bwd", ("dy", "mask"), ("dx",),
            op_of=lambda p: _op_name(p["has_z"]), abstract=_bwd_abstract,
            reference=_bwd_reference, batch=_bwd_batch,
            roles={"dy": "x", "mask": "mask", "dx": "x"}, policy=sharding_policy)


def _residuals(ops, outs, params):
    return (outs["mask"],)


def _backward(res, cts, wanted, params, in_avals):
    (mask,) = res
    (dx,) = BWD.call(cts["y"], mask, has_z=in_avals["z"] is not None,
                     implementation=params["implementation"])
    return {"x": dx, "z": dx}


RELU = Op(
    ("relu", "add_relu"), FWD, BWD,
    outputs=lambda p: ("y",), residuals=_residuals, backward=_backward,
    user_adapter=_user_adapter,
    impls={
        "cuda": Impl({"fwd": _cuda_fwd, "bwd": ffi("jax_ops_relu_bwd", flat_operands=(1,))},
                     supports=ffi_supports("jax_ops_relu_fwd"),
                     description="hand CUDA kernels through XLA FFI (host C++ on CPU)"),
        "pallas": Impl({"fwd": _pallas_fwd, "bwd": _pallas_bwd},
                       supports=pallas_supports(_pallas_limit), configs=_pallas_configs,
                       description="Pallas kernels (Triton back end)"),
    },
    bench=lambda: relu_specs(),  # the benchmark specs and
    patterns=lambda: relu_patterns())  # the rewrite patterns: end of this module


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
    return FWD.call(x, None, implementation=implementation or registry.override_for("relu"))[0]


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
    check_broadcastable("add_relu", "z", x, z)
    if z.shape != x.shape:
        z = jnp.broadcast_to(z, x.shape)
    x, z = match_vma(x, z)
    return FWD.call(x, z, implementation=implementation or registry.override_for("add_relu"))[0]


# ---------------------------------------------------------------- relu family: benchmark specs (jax_ops.bench) ---
# x is (rows, cols). The mask residual is 1 bit per element: M = rows * cols / 8 bytes.

def relu_specs() -> dict[str, BenchSpec]:
    """Benchmarks of the relu family: relu, add_relu (y + 1-bit mask)."""

    def spec(add: bool) -> BenchSpec:
        def make_inputs(kx, kp, kq, dtype, rows, cols):
            x = jax.random.normal(kx, (rows, cols), dtype)
            return x, ((jax.random.normal(kp, (rows, cols), dtype),) if add else ())

        def kernel(impl):
            if add:
                return lambda x, z: add_relu(x, z, implementation=impl)
            return lambda x: relu(x, implementation=impl)

        def reference(dtype):  # XLA's relu, autodiff keeps what it likes (x or a predicate)
            if add:
                return lambda x, z: jax.nn.relu(x + z)
            return jax.nn.relu

        def nbytes(rows, cols, itemsize):
            x, m = rows * cols * itemsize, -(-rows * cols // 32) * 4
            fwd = (3 if add else 2) * x + m      # read x (and z), write y and the mask
            bwd = 2 * x + m                      # read dy and the mask, write dx (= dz)
            return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}

        return BenchSpec(make_inputs=make_inputs, kernel=kernel, reference=reference,
                         nbytes=nbytes, diff_params=add, table_stages=("fwd", "bwd"),
                         title=" (y + 1-bit mask)")

    return {"relu": spec(add=False), "add_relu": spec(add=True)}


# ---------------------------------------------------- relu family: rewrite patterns (jax_ops.fx) ---
# jax.nn.relu's derivative at 0 is 0, as relu's; jnp.maximum(x, 0)'s is 0.5 (lax.max
# splits ties), so its replacement keeps our forward kernel and restates that
# derivative.

def _relu_ref(x):
    return jax.nn.relu(x)


def _maximum_ref(x):
    return jnp.maximum(x, 0)


def _add_relu_ref(x, z):
    return jax.nn.relu(x + z)


def _add_maximum_ref(x, z):
    return jnp.maximum(x + z, 0)


def _add_relu_accepts(avals):
    x, z = avals
    why = accepts_x(avals)
    if why:
        return why
    if x.dtype != z.dtype:
        return "x and z differ in dtype"
    try:
        fits = np.broadcast_shapes(tuple(z.shape), tuple(x.shape)) == tuple(x.shape)
    except ValueError:
        fits = False
    if not fits or len(z.shape) > len(x.shape):
        return f"z of shape {tuple(z.shape)} does not broadcast to x's {tuple(x.shape)}"
    return None


def relu_replacement(x):
    return relu(x)


def add_relu_replacement(x, z):
    return add_relu(x, z)


def _max_tie_slope(pre):
    """d max(pre, 0) / d pre as lax.max differentiates it: 1 above, 0.5 at a tie
    (either zero), 0 below and at NaN."""
    return jnp.where(pre > 0, 1.0, jnp.where(pre == 0, 0.5, 0.0)).astype(pre.dtype)


@jax.custom_jvp
def maximum_relu_replacement(x):
    return relu_replacement(x)


@maximum_relu_replacement.defjvp
def _maximum_relu_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    return maximum_relu_replacement(x), dx * _max_tie_slope(x)


@jax.custom_jvp
def maximum_add_relu_replacement(x, z):
    return add_relu_replacement(x, z)


@maximum_add_relu_replacement.defjvp
def _maximum_add_relu_jvp(primals, tangents):
    (x, z), (dx, dz) = primals, tangents
    slope = _max_tie_slope(x + z)  # the tie on the sum rounded as the original rounds it
    return maximum_add_relu_replacement(x, z), (dx + dz) * slope


def _relu_examples(n):
    return [tuple(sds(s, d) for _ in range(n)) for s in ((8,), (4, 8))
            for d in (jnp.dtype(jnp.float32), BF16)]


#: what a conv's output may pass through before a relu that XLA still fuses into the
#: conv (cuDNN's epilogue: bias, side input, relu)
_EPILOGUE_STEPS = ("convert_element_type", "add", "add_any")


def _after_conv(value, claimed_by, depth=4) -> bool:
    """Whether `value` (an fx graph Value) is a conv's output, or a folded conv +
    BatchNorm's (conv_batch_norm took its producer), directly or through up to `depth`
    converts and adds (a bias, a residual)."""
    node = getattr(value, "producer", None)
    if node is None:
        return False
    name = node.primitive.name
    if name == "conv_general_dilated" or claimed_by.get(node) == "conv_batch_norm":
        return True
    return (depth > 0 and name in _EPILOGUE_STEPS
            and any(_after_conv(v, claimed_by, depth - 1) for v in node.inputs))


#: fewer elements than this: XLA's relu, fused into its neighbours, costs nothing,
#: a kernel of ours is a launch (flax BatchNorm's variance clamp, max(var, 0), on C
#: channels matched `relu` in ResNet-50's training step)
SMALL_ELEMENTS = 1 << 16


def _context(args, avals, params):
    """policy="auto": a relu after a convolution stays XLA's: XLA hands conv + bias
    (+ residual) + relu to cuDNN as one fused convolution, where a kernel of ours is a
    pass more (ResNet-50 inference on the H200: 53-60 µs per relu that was free;
    perf-notes, "Sixth session"); so does a relu of a small array."""
    claimed_by = params.get(CLAIMED_BY) or {}
    if any(_after_conv(a, claimed_by) for a in args):
        return "XLA fuses it into the convolution before it (cuDNN's epilogue)"
    size = max(math.prod(a.shape) for a in avals if a is not None)
    if size < SMALL_ELEMENTS:
        return f"{size} elements: XLA fuses it into its neighbours (a kernel of ours is a launch)"
    return None


def relu_patterns() -> list[Pattern]:
    """add_relu (relu of a sum, z broadcastable), then relu (which it contains)."""
    return [Pattern("add_relu", [Formulation(_add_relu_ref, label="jax.nn.relu(x + z)"),
                                 Formulation(_add_maximum_ref, label="jnp.maximum(x + z, 0)",
                                             replacement=maximum_add_relu_replacement)],
                    add_relu_replacement, _relu_examples(2), accepts=_add_relu_accepts,
                    context=_context),
            Pattern("relu", [Formulation(_relu_ref, label="jax.nn.relu"),
                             Formulation(_maximum_ref, label="jnp.maximum(x, 0)",
                                         replacement=maximum_relu_replacement)],
                    relu_replacement, _relu_examples(1), accepts=accepts_x,
                    context=_context)]
