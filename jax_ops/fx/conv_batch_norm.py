"""conv_batch_norm: an inference convolution followed by flax.linen.BatchNorm with its
running statistics (use_running_average=True), folded into the convolution's weights
and bias inside the graph (One-fx's `fuse`):

    s  = scale / sqrt(var + epsilon)                 per output channel
    w' = w * s                                       along w's output-feature dimension
    b' = (b - mean) * s + bias                       (b: the conv's bias, else 0)
    y  = conv(x, w') + b'

computed in float32, w' cast to the conv's weight dtype, b' to the conv's output dtype
where that is the result's (bf16 models): the BatchNorm pass over the activations
disappears, and XLA fuses the bias (and a following relu, with or without a residual
add) into cuDNN's convolution. Equal to the original up to rounding (the original
rounds the conv's output before normalizing it; the fold rounds w * s to w's dtype). The
replacement is not one of our ops, so policy="auto" replaces it on every device
(`Pattern.decide`: always).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ops.core.pattern import (ACTIVE_PATTERNS, F32, BF16, Formulation, Pattern, flax_available,
                                  out_dtypes, sds)
from jax_ops.fx import conv_space_to_depth
from jax_ops.ops.batch_norm import BN_EPSILON, flax_linen_batch_norm

#: the equation whose params (strides, padding, dimension numbers...) the formulation
#: and the replacement take from the graph
CONV = "conv_general_dilated"


def _conv(x, w, conv):
    """The graph's convolution (conv: its params), or a 2-D NHWC/HWIO one for the
    templates (only the structure matters there)."""
    if conv is None:
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.lax.conv_general_dilated(x, w, **dict(conv))


def _flax_conv_batch_norm(x, w, conv_bias, scale, bias, mean, var, *, epsilon, dtype,
                          conv_general_dilated):
    """flax.linen.Conv (its conv_general_dilated, then + bias reshaped to the output's
    last axis) followed by flax.linen.BatchNorm(use_running_average=True)."""
    y = _conv(x, w, conv_general_dilated)
    if conv_bias is not None:
        y += conv_bias.reshape((1,) * (y.ndim - 1) + conv_bias.shape)
    y, _ = flax_linen_batch_norm(y, scale, bias, mean, var, epsilon=epsilon, training=False,
                                 fast=None, dtype=dtype)
    return y


def _static(avals, out_aval):
    # the BatchNorm's result dtype: flax's dtype=None (promoted) or dtype=the conv's
    if out_aval is not None:
        return [{"dtype": np.dtype(out_aval.dtype)}]
    y = jax.ShapeDtypeStruct((), jnp.result_type(avals[0].dtype, avals[1].dtype))
    return [{"dtype": d} for d in out_dtypes([y, *avals[2:]], None)]


def _examples():
    """x NHWC, w HWIO in float32 or bfloat16; conv bias, scale and bias present or not
    (float32, flax's param_dtype); float32 running statistics."""
    out = []
    for d in (F32, BF16):
        for has_cb in (True, False):
            for has_scale, has_bias in ((True, True), (True, False), (False, True), (False, False)):
                out.append((sds((2, 6, 6, 3), d), sds((3, 3, 3, 8), d),
                            sds((8,), d) if has_cb else None,
                            sds((8,), F32) if has_scale else None,
                            sds((8,), F32) if has_bias else None, sds((8,), F32), sds((8,), F32)))
    return out


def _accepts(avals):
    x, w = avals[:2]
    for a in avals:
        if a is not None and not jnp.issubdtype(a.dtype, jnp.floating):
            return f"an input is {a.dtype}"
    return None


def fold_replacement(x, w, conv_bias, scale, bias, mean, var, *, epsilon, out_dtype,
                     conv_general_dilated, conv_rewrite=None, **_):
    """conv(x, w * s) + (b - mean) * s + bias, s = scale * rsqrt(var + epsilon) (float32);
    the conv computed as the conv rewrite named `conv_rewrite` does, if any
    (`_specialize`)."""
    p = dict(conv_general_dilated)
    dn = p["dimension_numbers"]
    y_rank = len(dn.out_spec)
    out_dim, w_dim = dn.out_spec[1], dn.rhs_spec[0]
    c = w.shape[w_dim]
    if out_dim != y_rank - 1:
        raise ValueError(f"the conv's output features are on axis {out_dim}, the BatchNorm "
                         f"normalizes the last axis")
    if mean.shape != (c,):
        raise ValueError(f"the BatchNorm has {mean.shape} statistics for {c} conv features")
    s = jax.lax.rsqrt(var.astype(jnp.float32) + epsilon)
    if scale is not None:
        s = s * scale.astype(jnp.float32)
    shape = [1] * w.ndim
    shape[w_dim] = c
    w_folded = (w.astype(jnp.float32) * s.reshape(shape)).astype(w.dtype)
    b = -mean.astype(jnp.float32) if conv_bias is None else (
        conv_bias.astype(jnp.float32) - mean.astype(jnp.float32))
    b = b * s
    if bias is not None:
        b = b + bias.astype(jnp.float32)
    if conv_rewrite is not None:
        y = _CONV_REWRITES[conv_rewrite][1](x, w_folded, p)
    else:
        y = jax.lax.conv_general_dilated(x, w_folded, **p)
    if y.dtype == out_dtype:
        # conv + bias in the conv's own dtype: the form XLA hands to cuDNN as one fused
        # convolution (bias, a side input and a following relu in its epilogue). With a
        # float32 bias it keeps a separate elementwise pass (bf16 ResNet-50 shapes on the
        # H100: benchmarks/conv_fusion_probe.py).
        return y + b.astype(out_dtype)
    return (y.astype(jnp.float32) + b).astype(out_dtype)


#: the conv rewrites the fold applies to its conv where they would replace it alone.
#: Not pointwise_conv: as GEMMs, ResNet-50's folded 1x1 convs took more kernel time
#: than cuDNN's fused convs (H100, inference: 2.40 ms of kernels with convs, 2.58 with the
#: 1x1 convs not feeding a residual add as GEMMs, 2.96 with all of them; perf-notes,
#: "Sixth session").
_CONV_REWRITES = {"conv_space_to_depth": (conv_space_to_depth.patterns,
                                           conv_space_to_depth.space_to_depth_conv)}


def _specialize(args, avals, params):
    """The conv rewrite applied to the folded conv: the one that would replace the conv
    under policy="auto" (they overlap at an inference conv, and the fold, of higher
    priority, takes it), unless optimize's patterns/exclude leave it out."""
    conv = {CONV: params.get(CONV)}
    for name, (patterns_of, _) in _CONV_REWRITES.items():
        if name not in params.get(ACTIVE_PATTERNS, ()):
            continue
        [pattern] = [q for q in patterns_of() if q.name == name]
        if (pattern.candidate(avals[:2], conv) and pattern.accepts(avals[:2]) is None
                and pattern.decide(avals[:2], conv) is None):
            return {"conv_rewrite": name}
    return {}


def _always(avals, params):
    """policy="auto": the fold removes the BatchNorm's pass on any device."""
    return None


def patterns() -> list[Pattern]:
    if not flax_available():
        return []
    return [Pattern("conv_batch_norm",
                    [Formulation(_flax_conv_batch_norm, _static,
                                 "flax.linen.Conv, flax.linen.BatchNorm(inference)",
                                 node_params=(CONV,))],
                    fold_replacement, _examples(), params={"epsilon": BN_EPSILON},
                    accepts=_accepts, priority=2, decide=_always, specialize=_specialize,
                    reported=("conv_rewrite",),
                    note="inference conv + BatchNorm folded into the conv's weights and bias")]
