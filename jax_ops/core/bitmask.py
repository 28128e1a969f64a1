"""The 1-bit mask: the residual format of relu, add_relu and the BatchNorm+ReLU fusions,
shared by their declarations, their kernels' wrappers and the sharding rules.

uint32 words; bit i % 32 of word i // 32 is set iff the pre-activation of flat
(row-major) element i is > 0 (NaN: clear); the bits past n are clear. Its shape is x's
with the last axis in words (x.shape[:-1] + (cols // 32,)) when cols % 32 == 0 — the
same bytes as the flat layout, but on x's axes so that it shards like x —, else the
flat (ceil(n / 32),). The FFI handlers and Pallas kernels see it flattened (a bitcast).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

WORD = 32  # mask bits per uint32 word
MASK_DTYPE = jnp.dtype(jnp.uint32)


def mask_words(n) -> int:
    """uint32 words of the 1-bit mask of n elements (n may be a symbolic dim)."""
    return -(-(int(n) if isinstance(n, (int, np.integer)) else n) // WORD)


def is_rowwise(shape) -> bool:
    """Whether the mask of x of `shape` has x's shape with the last axis in words."""
    return len(shape) >= 1 and isinstance(shape[-1], int) and shape[-1] % WORD == 0 and shape[-1] > 0


def mask_shape(shape) -> tuple:
    """The mask's shape for x of `shape` (see the module docstring)."""
    shape = tuple(shape)
    if is_rowwise(shape):
        return shape[:-1] + (shape[-1] // WORD,)
    return (mask_words(math.prod(shape)),)


def _packable(pred):
    """pred with the shardings in its type (explicit mesh axes) that its packing keeps,
    the others gathered (as sharding_policy): with a row-wise mask those whose local last
    axis is a whole number of words, with a flat mask none."""
    sharding = jax.typeof(pred).sharding
    spec = tuple(sharding.spec) + (None,) * (pred.ndim - len(sharding.spec))
    if all(s is None for s in spec):
        return pred
    if is_rowwise(pred.shape):
        last = spec[-1] if isinstance(spec[-1], tuple) else (spec[-1],)
        k = math.prod(sharding.mesh.shape[a] for a in last if a is not None)
        if (pred.shape[-1] // k) % WORD == 0:
            return pred
        spec = spec[:-1] + (None,)
    else:
        spec = (None,) * pred.ndim
    return jax.sharding.reshard(pred, jax.sharding.NamedSharding(sharding.mesh,
                                                                 jax.sharding.PartitionSpec(*spec)))


def pack_bits(pred) -> jax.Array:
    """bool array -> its mask, uint32 words of shape mask_shape(pred.shape): bit i % 32
    of word i // 32 = flat pred[i]. A row-wise mask is packed along the last axis, not
    flattened, so that shardings in pred's type (explicit mesh axes) carry over."""
    pred = _packable(pred)
    shape = tuple(pred.shape)
    if is_rowwise(shape):
        bits = pred.reshape(shape[:-1] + (shape[-1] // WORD, WORD))
    else:
        flat = pred.reshape(-1)
        n = flat.shape[0]
        words = mask_words(n)
        bits = jnp.pad(flat, (0, words * WORD - n)).reshape(words, WORD)
    return jnp.sum(bits.astype(MASK_DTYPE) << jnp.arange(WORD, dtype=MASK_DTYPE), axis=-1,
                   dtype=MASK_DTYPE)


def unpack_bits(mask, shape) -> jax.Array:
    """uint32 words (any shape of ceil(n/32) words) -> bool array of `shape` (n
    elements), inverse of pack_bits; a row-wise mask (of shape mask_shape(shape)) is
    unpacked along its last axis, like pack_bits."""
    shape = tuple(shape)
    bits = (mask[..., None] >> jnp.arange(WORD, dtype=MASK_DTYPE)) & 1
    if is_rowwise(shape) and tuple(mask.shape) == mask_shape(shape):
        return bits.reshape(shape).astype(bool)
    return bits.reshape(-1)[:math.prod(shape)].reshape(shape).astype(bool)


def sharding_policy(layout, mesh, params):
    """Shardings a mask can follow: with a row-wise mask, any sharding of x whose local
    last axis is a whole number of words; with a flat mask (x's last axis not a multiple
    of 32), none — x is gathered (documented)."""
    if not is_rowwise(layout.shape):
        return layout.replace(dims=((),) * len(layout.dims))
    k = math.prod(mesh.shape[a] for a in layout.dims[-1])
    if (layout.shape[-1] // k) % WORD:
        return layout.replace(dims=layout.dims[:-1] + ((),))
    return layout
