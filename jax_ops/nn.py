"""Flax linen layers on jax_ops kernels, drop-in replacements for flax.linen's.

`LayerNorm`, `RMSNorm` subclass `flax.linen.LayerNorm` / `RMSNorm`; `BatchNormReLU`
(relu(BatchNorm(x))) and `BatchNormAddReLU` (relu(BatchNorm(x) + z), called `m(x, z)`)
subclass `flax.linen.BatchNorm`. Same fields, defaults, variables (names, shapes, dtypes,
collections) and output dtypes as flax, plus `implementation` (None: automatic, or
"xla" / "cuda" / "pallas"). The BatchNorm layers name themselves `BatchNorm_<k>` (flax
BatchNorm's counter), so a flax model's variables load unchanged when
`nn.relu(nn.BatchNorm(...)(x))` becomes `BatchNormReLU(...)(x)`.

Our kernels serve the call when it normalizes over the last axis with float32
statistics and no `mask`; otherwise (other axes, `mask`, `force_float32_reductions=False`,
float64, ...) the layer runs flax's own code. `axis_name` (shard_map/pmap): the
BatchNorm layers combine statistics across devices with jnp and normalize with our
kernels; LayerNorm/RMSNorm with `axis_name` run flax's code. `use_fast_variance` is
accepted and ignored by the kernels, which always compute the numerically stable
variance.

`dot_product_attention` is a drop-in `attention_fn` for
`flax.linen.MultiHeadDotProductAttention` with our softmax.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from flax.linen import dtypes as flax_dtypes
from flax.linen import module as flax_module

from jax_ops import _flax

__all__ = ["LayerNorm", "RMSNorm", "BatchNormReLU", "BatchNormAddReLU", "dot_product_attention"]


def _out_dtype(x, dtype, param_dtype, has_params: bool):
    """flax's result dtype: x promoted with the parameters', unless `dtype` is given."""
    args = (x, jnp.zeros((), param_dtype)) if has_params else (x,)
    return flax_dtypes.canonicalize_dtype(*args, dtype=dtype)


class LayerNorm(nn.LayerNorm):
    """flax.linen.LayerNorm on jax_ops.layer_norm (see the module docstring)."""
    implementation: str | None = None

    @nn.compact
    def __call__(self, x, *, mask=None):
        x = jnp.asarray(x)
        out_dtype = _out_dtype(x, self.dtype, self.param_dtype, self.use_scale or self.use_bias)
        if not _flax.kernels_serve(x, out_dtype, mask=mask, axis_name=self.axis_name,
                                   last_axis_only=(self.reduction_axes, self.feature_axes),
                                   float32_reductions=self.force_float32_reductions):
            return super().__call__(x, mask=mask)
        features = (x.shape[-1],)
        scale = (self.param("scale", self.scale_init, features, self.param_dtype)
                 if self.use_scale else None)
        bias = self.param("bias", self.bias_init, features, self.param_dtype) if self.use_bias else None
        return _flax.norm(x, scale, bias, rms=False, epsilon=self.epsilon, out_dtype=out_dtype,
                          implementation=self.implementation)


class RMSNorm(nn.RMSNorm):
    """flax.linen.RMSNorm on jax_ops.rms_norm (see the module docstring)."""
    implementation: str | None = None

    @nn.compact
    def __call__(self, x, *, mask=None):
        x = jnp.asarray(x)
        out_dtype = _out_dtype(x, self.dtype, self.param_dtype, self.use_scale)
        if not _flax.kernels_serve(x, out_dtype, mask=mask, axis_name=self.axis_name,
                                   last_axis_only=(self.reduction_axes, self.feature_axes),
                                   float32_reductions=self.force_float32_reductions):
            return super().__call__(x, mask=mask)
        scale = (self.param("scale", self.scale_init, (x.shape[-1],), self.param_dtype)
                 if self.use_scale else None)
        return _flax.norm(x, scale, None, rms=True, epsilon=self.epsilon, out_dtype=out_dtype,
                          implementation=self.implementation)


class _BatchNormActivation(nn.BatchNorm):
    """flax.linen.BatchNorm followed by relu (and a residual add), on jax_ops kernels."""
    implementation: str | None = None

    def __post_init__(self):
        # Take the name flax's BatchNorm would get here ("BatchNorm_<k>", same counter), so
        # variables of a flax model that used BatchNorm + relu load unchanged.
        if self.name is None and self.parent is flax_module._unspecified_parent:
            parent = flax_module._context.module_stack[-1]
            if isinstance(parent, nn.Module) and not parent._state.in_setup:
                cursor = parent._state.autoname_cursor.get("BatchNorm", 0)
                parent._state.autoname_cursor["BatchNorm"] = cursor + 1
                object.__setattr__(self, "name", f"BatchNorm_{cursor}")
        super().__post_init__()

    def _apply(self, x, z, call_use_running_average, mask):
        use_running_average = flax_module.merge_param(
            "use_running_average", self.use_running_average, call_use_running_average)
        x = jnp.asarray(x)
        out_dtype = _out_dtype(x, self.dtype, self.param_dtype, self.use_scale or self.use_bias)
        if (not _flax.kernels_serve(x, out_dtype, mask=mask, last_axis_only=(self.axis,),
                                    float32_reductions=self.force_float32_reductions, min_rank=2)
                or (z is not None and jnp.asarray(z).dtype not in _flax.ACT_DTYPES)):
            y = super().__call__(x, call_use_running_average, mask=mask)
            return nn.relu(y if z is None else y + z)
        features = (x.shape[-1],)
        ra_mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32), features)
        ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, jnp.float32), features)
        scale = self.param("scale", self.scale_init, features, self.param_dtype) if self.use_scale else None
        bias = self.param("bias", self.bias_init, features, self.param_dtype) if self.use_bias else None
        initializing = self.is_initializing()
        y, mean, var = _flax.bn_relu(
            x, z, scale, bias, training=not use_running_average, mean=ra_mean.value,
            var=ra_var.value, epsilon=self.epsilon, out_dtype=out_dtype,
            implementation=self.implementation,
            axis_name=None if initializing else self.axis_name,
            axis_index_groups=self.axis_index_groups)
        if not use_running_average and not initializing:
            ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
            ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var
        return y


class BatchNormReLU(_BatchNormActivation):
    """relu(flax.linen.BatchNorm(...)(x)) in fused kernels; the backward keeps a 1-bit mask."""

    @nn.compact
    def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
        return self._apply(x, None, use_running_average, mask)


class BatchNormAddReLU(_BatchNormActivation):
    """relu(flax.linen.BatchNorm(...)(x) + z) in fused kernels (a ResNet block's residual
    add); z of x's shape or broadcastable to it."""

    @nn.compact
    def __call__(self, x, z, use_running_average: bool | None = None, *, mask=None):
        return self._apply(x, z, use_running_average, mask)


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                          dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                          dtype=None, precision=None, module=None,
                          force_fp32_for_softmax: bool = False, einsum_dot_general=None,
                          qk_attn_weights_einsum=None, attn_weights_value_einsum=None):
    """flax.linen.dot_product_attention with our softmax (pass as `attention_fn=`).

    Custom einsums fall back to flax's function. A fully masked row gets zero weights
    (flax: uniform)."""
    if einsum_dot_general is not None or qk_attn_weights_einsum or attn_weights_value_einsum:
        return nn.dot_product_attention(
            query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
            deterministic, dtype, precision, module, force_fp32_for_softmax,
            einsum_dot_general=einsum_dot_general, qk_attn_weights_einsum=qk_attn_weights_einsum,
            attn_weights_value_einsum=attn_weights_value_einsum)
    query, key, value = flax_dtypes.promote_dtype(query, key, value, dtype=dtype)
    dtype = query.dtype
    sow = None
    if module is not None:
        def sow(w):
            module.sow("intermediates", "attention_weights", w)
    return _flax.attention(query, key, value, bias, mask, causal=False, dtype=dtype, sow=sow,
                           force_fp32_for_softmax=force_fp32_for_softmax and dtype != jnp.float32,
                           precision=precision, dropout_rng=dropout_rng,
                           dropout_rate=dropout_rate, broadcast_dropout=broadcast_dropout,
                           deterministic=deterministic)
