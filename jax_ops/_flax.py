"""What the linen (`jax_ops.nn`) and NNX (`jax_ops.nnx`) layers share: when our kernels
can serve a layer's call (else the layer runs flax's own code), the dtype the kernel runs
in, and the calls into the ops with flax's dtype semantics."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_ops import batch_norm_add_relu, batch_norm_relu, layer_norm, rms_norm, softmax
from jax_ops.core.validate import ACT_DTYPES


def _axes(ndim: int, axes) -> tuple[int, ...]:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return tuple(sorted(a % ndim for a in axes)) if ndim else axes


def kernel_dtype(x_dtype, out_dtype):
    """The dtype our kernel runs in: x's own when the result is no wider (the kernel
    computes in float32 and rounds once), else the result's (flax computes the result
    from the widened x)."""
    x_dtype, out_dtype = jnp.dtype(x_dtype), jnp.dtype(out_dtype)
    return x_dtype if jnp.promote_types(x_dtype, out_dtype) == x_dtype else out_dtype


def kernels_serve(x, out_dtype, *, last_axis_only: tuple = (), mask=None, axis_name=None,
                  float32_reductions: bool = True, min_rank: int = 1) -> bool:
    """Whether our kernels compute this layer call exactly as flax defines it. They
    normalize over (or per channel of) the last axis with float32 statistics and no
    masked positions; anything else runs flax's code (never a wrong answer)."""
    x = jnp.asarray(x)
    if x.ndim < min_rank or x.size == 0 or mask is not None or not float32_reductions:
        return False
    if axis_name is not None:
        return False
    if any(_axes(x.ndim, a) != (x.ndim - 1,) for a in last_axis_only):
        return False
    return (x.dtype in ACT_DTYPES and jnp.dtype(out_dtype) in ACT_DTYPES
            and kernel_dtype(x.dtype, out_dtype) in ACT_DTYPES)


def _f32(a):
    return None if a is None else jnp.asarray(a).astype(jnp.float32)


def norm(x, scale, bias, *, rms: bool, epsilon: float, out_dtype, implementation):
    """LayerNorm/RMSNorm over the last axis, result in `out_dtype` (flax's rule)."""
    x = x.astype(kernel_dtype(x.dtype, out_dtype))
    if rms:
        y = rms_norm(x, _f32(scale), epsilon=epsilon, implementation=implementation)
    else:
        y = layer_norm(x, _f32(scale), _f32(bias), epsilon=epsilon,
                       implementation=implementation)
    return y.astype(out_dtype)


def cross_device_stats(x, axis_name, axis_index_groups):
    """Batch mean and biased variance per channel (last axis) over all devices of
    `axis_name` (shard_map/pmap), float32: the mean first, then the mean squared
    deviation from it (no E[x²]−E[x]² cancellation). Two O(channels) all-reduces."""
    xf = x.astype(jnp.float32)
    axes = tuple(range(x.ndim - 1))
    mean = lax.pmean(xf.mean(axes), axis_name, axis_index_groups=axis_index_groups)
    var = lax.pmean(jnp.square(xf - mean).mean(axes), axis_name,
                    axis_index_groups=axis_index_groups)
    return mean, var


def bn_relu(x, z, scale, bias, *, training: bool, mean, var, epsilon: float, out_dtype,
            implementation, axis_name=None, axis_index_groups=None):
    """relu(BatchNorm(x) [+ z]) over the last axis.

    Returns (y, mean, var): in training the batch statistics (float32, biased var), else
    the given ones. With `axis_name` the statistics are combined across devices first
    and our kernels normalize with them (their gradient reaches x through the jnp
    statistics)."""
    kd = kernel_dtype(x.dtype, out_dtype if z is None else jnp.promote_types(out_dtype, z.dtype))
    x = x.astype(kd)
    kwargs = dict(epsilon=epsilon, implementation=implementation)
    call = ((lambda **kw: batch_norm_relu(x, _f32(scale), _f32(bias), **kw)) if z is None else
            (lambda **kw: batch_norm_add_relu(x, jnp.asarray(z).astype(kd), _f32(scale),
                                              _f32(bias), **kw)))
    if training and axis_name is None:
        y, mean, var = call(training=True, **kwargs)
    else:
        if training:
            mean, var = cross_device_stats(x, axis_name, axis_index_groups)
        mean, var = _f32(mean), _f32(var)
        y = call(training=False, mean=mean, var=var, **kwargs)
    result_dtype = out_dtype if z is None else jnp.promote_types(out_dtype, z.dtype)
    return y.astype(result_dtype), mean, var


def attention(query, key, value, bias, mask, *, causal: bool, dtype, sow=None,
              force_fp32_for_softmax: bool = False, precision=None, dropout_rng=None,
              dropout_rate: float = 0.0, broadcast_dropout: bool = True,
              deterministic: bool = True):
    """softmax(q·kᵀ/√d + bias, masked) · v with our softmax: the 1/√d scale, the boolean
    mask (broadcast, never materialized) and the causal limit are applied inside the
    kernel. q, k, v: [batch..., length, heads, depth], already of one dtype.

    Attention dropout is flax's (unless `deterministic` or rate 0); `sow(weights)`
    records the weights. Differences from flax: a fully masked row gets all-zero weights (flax: uniform
    over the row), and the scale multiplies the float32 logits instead of q."""
    scale = float(query.shape[-1]) ** -0.5
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)
    if bias is not None:  # the bias is not scaled: apply the scale before adding it
        logits, scale = logits * jnp.asarray(scale, logits.dtype) + bias, 1.0
    if force_fp32_for_softmax:
        logits = logits.astype(jnp.float32)
    if mask is not None:
        mask = jnp.asarray(mask).astype(jnp.bool_)
    weights = softmax(logits, axis=-1, scale=scale, mask=mask, causal=causal)
    if not force_fp32_for_softmax:
        weights = weights.astype(dtype)
    if sow is not None:
        sow(weights)
    if not deterministic and dropout_rate > 0.0:
        weights = dropout_weights(weights, rng=dropout_rng, rate=dropout_rate,
                                  broadcast=broadcast_dropout, dtype=dtype,
                                  batch_ndim=key.ndim - 2)
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


def dropout_weights(weights, *, rng, rate: float, broadcast: bool, dtype, batch_ndim: int):
    """Attention dropout as flax applies it (the same bernoulli draw from the same key,
    one mask shared by the batch and head axes when `broadcast`)."""
    keep_prob = 1.0 - rate
    shape = ((1,) * batch_ndim + weights.shape[-2:]) if broadcast else weights.shape
    keep = jax.random.bernoulli(rng, keep_prob, shape)
    return weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype))
