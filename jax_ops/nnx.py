"""Flax NNX layers on jax_ops kernels, drop-in replacements for flax.nnx's.

`LayerNorm`, `RMSNorm` subclass `flax.nnx.LayerNorm` / `RMSNorm`; `BatchNormReLU`
(relu(BatchNorm(x))) and `BatchNormAddReLU` (relu(BatchNorm(x) + z), called `m(x, z)`)
subclass `flax.nnx.BatchNorm`: the same constructor (plus `implementation=`), state
(`scale`, `bias` Params, `mean`, `var` BatchStats) and dtype promotion (`promote_dtype`).
When our kernels can't compute a call exactly as flax defines it (`mask`, other axes,
float64, `axis_name` for the norms) the layer runs flax's code; see `jax_ops.nn`.

`dot_product_attention` is a drop-in `attention_fn` for `flax.nnx.MultiHeadAttention`
with our softmax; `is_causal=True` applies the causal limit inside the kernel (no mask).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from jax_ops import _flax

__all__ = ["LayerNorm", "RMSNorm", "BatchNormReLU", "BatchNormAddReLU", "dot_product_attention"]


def _value(v):
    return None if v is None else v[...]


class LayerNorm(nnx.LayerNorm):
    """flax.nnx.LayerNorm on jax_ops.layer_norm."""

    def __init__(self, num_features: int, *, implementation: str | None = None, **kwargs):
        super().__init__(num_features, **kwargs)
        self.implementation = implementation

    def __call__(self, x, *, mask=None):
        x, scale, bias = self.promote_dtype((x, _value(self.scale), _value(self.bias)),
                                            dtype=self.dtype)
        if not _flax.kernels_serve(x, x.dtype, mask=mask, axis_name=self.axis_name,
                                   last_axis_only=(self.reduction_axes, self.feature_axes)):
            return super().__call__(x, mask=mask)
        return _flax.norm(x, scale, bias, rms=False, epsilon=self.epsilon, out_dtype=x.dtype,
                          implementation=self.implementation)


class RMSNorm(nnx.RMSNorm):
    """flax.nnx.RMSNorm on jax_ops.rms_norm."""

    def __init__(self, num_features: int, *, implementation: str | None = None, **kwargs):
        super().__init__(num_features, **kwargs)
        self.implementation = implementation

    def __call__(self, x, mask=None):
        x, scale = self.promote_dtype((x, _value(self.scale)), dtype=self.dtype)
        if not _flax.kernels_serve(x, x.dtype, mask=mask, axis_name=self.axis_name,
                                   last_axis_only=(self.reduction_axes, self.feature_axes)):
            return super().__call__(x, mask=mask)
        return _flax.norm(x, scale, None, rms=True, epsilon=self.epsilon, out_dtype=x.dtype,
                          implementation=self.implementation)


class _BatchNormActivation(nnx.BatchNorm):
    def __init__(self, num_features: int, *, implementation: str | None = None, **kwargs):
        super().__init__(num_features, **kwargs)
        self.implementation = implementation

    def _apply(self, x, z, use_running_average, mask):
        use_running_average = (self.use_running_average if use_running_average is None
                               else use_running_average)
        if use_running_average is None:
            # flax's error (with its advice) for the missing flag
            return super().__call__(x, use_running_average, mask=mask)
        x, mean, var, scale, bias = self.promote_dtype(
            (x, self.mean[...], self.var[...], _value(self.scale), _value(self.bias)),
            dtype=self.dtype)
        if (not _flax.kernels_serve(x, x.dtype, mask=mask, last_axis_only=(self.axis,), min_rank=2)
                or (z is not None and jnp.asarray(z).dtype not in _flax.ACT_DTYPES)):
            y = super().__call__(x, use_running_average, mask=mask)
            return jax.nn.relu(y if z is None else y + z)
        y, batch_mean, batch_var = _flax.bn_relu(
            x, z, scale, bias, training=not use_running_average, mean=mean, var=var,
            epsilon=self.epsilon, out_dtype=x.dtype, implementation=self.implementation,
            axis_name=self.axis_name, axis_index_groups=self.axis_index_groups)
        if not use_running_average:
            # as flax: stop_gradient only for array refs
            can_update = getattr(self.mean, "_can_update", False) or getattr(self.var, "_can_update", False)
            stop = jax.lax.stop_gradient if can_update else (lambda a: a)
            self.mean[...] = stop(self.momentum * self.mean[...] + (1 - self.momentum) * batch_mean)
            self.var[...] = stop(self.momentum * self.var[...] + (1 - self.momentum) * batch_var)
        return y


class BatchNormReLU(_BatchNormActivation):
    """relu(flax.nnx.BatchNorm(x)) in fused kernels; the backward keeps a 1-bit mask."""

    def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
        return self._apply(x, None, use_running_average, mask)


class BatchNormAddReLU(_BatchNormActivation):
    """relu(flax.nnx.BatchNorm(x) + z) in fused kernels, called `m(x, z)`."""

    def __call__(self, x, z, use_running_average: bool | None = None, *, mask=None):
        return self._apply(x, z, use_running_average, mask)


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                          dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                          dtype=None, precision=None, module=None,
                          promote_dtype=nnx_dtypes.promote_dtype, is_causal: bool = False):
    """flax.nnx.dot_product_attention with our softmax (pass as `attention_fn=`).
    Grouped-query attention (fewer key/value heads) and `is_causal` with different query
    and key lengths fall back to flax's function. A
    fully masked row gets zero weights (flax: uniform)."""
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    if (key.shape[-2] != query.shape[-2] or value.shape[-2] != query.shape[-2]
            or (is_causal and query.shape[-3] != key.shape[-3])):
        # grouped-query attention; causal with q_len != kv_len (flax keeps the top-left
        # triangle, our kernel the bottom-right one)
        return nnx.dot_product_attention(query, key, value, bias, mask, broadcast_dropout,
                                         dropout_rng, dropout_rate, deterministic, dtype,
                                         precision, module, promote_dtype, is_causal)
    dtype = query.dtype
    sow = None
    if module is not None:
        def sow(w):
            module.sow(nnx.Intermediate, "attention_weights", w)
    return _flax.attention(query, key, value, bias, mask, causal=is_causal, dtype=dtype, sow=sow,
                           precision=precision, dropout_rng=dropout_rng,
                           dropout_rate=dropout_rate, broadcast_dropout=broadcast_dropout,
                           deterministic=deterministic)
