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


def pack_bits(pred) -> jax.Array:
    """bool array (any shape) -> uint32 (ceil(n/32),): bit i % 32 of word i // 32 = flat pred[i]."""
    flat = pred.reshape(-1)
    n = flat.shape[0]
    words = mask_words(n)
    bits = jnp.pad(flat, (0, words * WORD - n)).reshape(words, WORD).astype(MASK_DTYPE)
    return jnp.sum(bits << jnp.arange(WORD, dtype=MASK_DTYPE), axis=1, dtype=MASK_DTYPE)


def unpack_bits(mask, shape) -> jax.Array:
    """uint32 words (any shape of ceil(n/32) words) -> bool array of `shape` (n
    elements), inverse of pack_bits."""
    n = math.prod(shape)
    bits = (mask.reshape(-1)[:, None] >> jnp.arange(WORD, dtype=MASK_DTYPE)) & 1
    return bits.reshape(-1)[:n].reshape(shape).astype(bool)


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
