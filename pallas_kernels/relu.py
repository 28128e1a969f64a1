"""ReLU / Add+ReLU with a 1-bit mask, forward and backward, as Pallas kernels
(Triton back end).

Layout: x (and z) of any shape are used flat, n elements. The mask is uint32
(mask_words(n),): bit i % 32 of word i // 32 is 1 iff the float32 pre-activation
of flat element i (x, or x + z) is > 0 (NaN -> 0); bits past n are 0.
y = pre > 0 ? pre : (NaN ? NaN : 0), rounded once to x's dtype.
Backward: dx = bit ? dy : 0 (an exact 0, even where dy is NaN).

Tiling: one program owns `block_words` mask words, i.e. the flat elements
[32 * w0, 32 * (w0 + block_words)), held as a (block_words, 32) register tile
(row = word, column = bit) and addressed with a gather index
32 * word + bit into the flat ref (contiguous along a row, so Triton still
vectorizes the loads/stores). The elements past n and the words past
mask_words(n) are masked. A word is packed by summing its row of disjoint bits
(a tile reduction over 32 lanes), unpacked with a shift per element.

Limits: n <= MAX_ELEMENTS (flat indices are int32 in the kernels, including
the masked tail of the last tile). On CPU the kernels run with interpret=True.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (MASK_BITS, compiler_params, mask_words, next_pow2,
                                   unique_configs, word_tile_configs)

MAX_BLOCK_WORDS = 512  # the largest tile the configs use: 16K elements
# int32 flat indices: the tail of the last tile (< 32 * MAX_BLOCK_WORDS past n) must not wrap.
MAX_ELEMENTS = 2**31 - 2 * MASK_BITS * MAX_BLOCK_WORDS


def supports(n: int) -> tuple[bool, str]:
    if n > MAX_ELEMENTS:
        return False, f"pallas relu indexes elements with int32: n <= {MAX_ELEMENTS}, got {n}"
    return True, ""


# ---------------------------------------------------------------- configs ---

def default_config(n: int, stage: str) -> dict:
    """Heuristic tile: 128 words (4K elements) a program, ~16 elements a thread."""
    block_words = max(1, min(128, next_pow2(mask_words(max(n, 1)))))
    return {"block_words": block_words,
            "num_warps": max(1, min(8, block_words * MASK_BITS // 512))}


def candidate_configs(n: int, stage: str) -> list[dict]:
    """The tunable space autotune explores (the default first)."""
    max_words = min(MAX_BLOCK_WORDS, next_pow2(mask_words(max(n, 1))))
    return unique_configs([default_config(n, stage)] + word_tile_configs(max_words))


# ------------------------------------------------- tile helpers (shared) ---

def word_tile(block_words: int):
    """This program's words (block_words,), bit numbers (32,) and the flat element
    index of each tile entry (block_words, 32)."""
    word = pl.program_id(0) * block_words + jnp.arange(block_words)
    bit = jnp.arange(MASK_BITS)
    return word, bit, word[:, None] * MASK_BITS + bit[None, :]


def pack_bits(keep, bit):
    """(block_words, 32) bool -> (block_words,) uint32 words. The bits of a row are
    disjoint, so their sum is their bitwise or."""
    one_hot = jnp.left_shift(jnp.uint32(1), bit.astype(jnp.uint32))[None, :]
    return jnp.sum(jnp.where(keep, one_hot, jnp.uint32(0)), axis=1, dtype=jnp.uint32)


def unpack_bits(words, bit):
    """(block_words,) uint32 -> (block_words, 32) bool."""
    shifted = jnp.right_shift(words[:, None], bit.astype(jnp.uint32)[None, :])
    return (shifted & jnp.uint32(1)) != 0


def relu_of(pre):
    """pre > 0 ? pre : 0, NaN kept (NaN <= 0 is false); -0.0 becomes +0.0."""
    return jnp.where(pre <= 0, jnp.zeros_like(pre), pre)


# ---------------------------------------------------------------- forward ---

def _fwd_kernel(*refs, n, block_words, has_z):
    x_ref = refs[0]
    z_ref = refs[1] if has_z else None
    y_ref, mask_ref = refs[-2:]
    word, bit, idx = word_tile(block_words)
    ok = idx < n
    pre = plgpu.load(x_ref.at[idx], mask=ok, other=0.0).astype(jnp.float32)
    if has_z:
        pre = pre + plgpu.load(z_ref.at[idx], mask=ok, other=0.0).astype(jnp.float32)
    plgpu.store(y_ref.at[idx], relu_of(pre).astype(y_ref.dtype), mask=ok)
    # Padding entries hold pre = 0, so the bits past n are 0.
    plgpu.store(mask_ref.at[pl.ds(pl.program_id(0) * block_words, block_words)],
                pack_bits(pre > 0, bit), mask=word < mask_words(n))


def relu_fwd(x, z=None, *, config: dict | None = None, interpret: bool = False):
    """x: any shape, n >= 1 elements, float32/bfloat16/float16; z: None or like x.
    Returns (y like x, mask uint32 (mask_words(n),))."""
    n = x.size
    if n == 0:  # no grid to launch
        return jnp.zeros_like(x), jnp.zeros((0,), jnp.uint32)
    if z is not None and z.size != n:
        raise ValueError(f"relu_fwd: z must have x's {n} elements, got shape {z.shape}")
    cfg = config or default_config(n, "fwd")
    block_words = cfg["block_words"]
    words = mask_words(n)
    kernel = functools.partial(_fwd_kernel, n=n, block_words=block_words, has_z=z is not None)
    operands = [x.reshape(n)] + ([] if z is None else [z.reshape(n)])
    y, mask = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((n,), x.dtype), jax.ShapeDtypeStruct((words,), jnp.uint32)],
        grid=(pl.cdiv(words, block_words),), compiler_params=compiler_params(cfg["num_warps"]),
        interpret=interpret, name="jax_ops_add_relu_fwd" if z is not None else "jax_ops_relu_fwd",
    )(*operands)
    return y.reshape(x.shape), mask


# --------------------------------------------------------------- backward ---

def _bwd_kernel(dy_ref, mask_ref, dx_ref, *, n, block_words):
    word, bit, idx = word_tile(block_words)
    ok = idx < n
    packed = plgpu.load(mask_ref.at[pl.ds(pl.program_id(0) * block_words, block_words)],
                        mask=word < mask_words(n), other=0)
    dy = plgpu.load(dy_ref.at[idx], mask=ok, other=0.0)
    # In dy's own dtype: the kept values are copied bit for bit.
    dx = jnp.where(unpack_bits(packed, bit), dy, jnp.zeros_like(dy))
    plgpu.store(dx_ref.at[idx], dx, mask=ok)


def relu_bwd(dy, mask, *, config: dict | None = None, interpret: bool = False):
    """dy: any shape (n elements); mask: uint32 (mask_words(n),). Returns dx like dy."""
    n = dy.size
    if n == 0:
        return jnp.zeros_like(dy)
    words = mask_words(n)
    if mask.shape != (words,):
        raise ValueError(f"relu_bwd: mask must have shape ({words},) for {n} elements, "
                         f"got {mask.shape}")
    cfg = config or default_config(n, "bwd")
    block_words = cfg["block_words"]
    kernel = functools.partial(_bwd_kernel, n=n, block_words=block_words)
    dx = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((n,), dy.dtype),
        grid=(pl.cdiv(words, block_words),), compiler_params=compiler_params(cfg["num_warps"]),
        interpret=interpret, name="jax_ops_relu_bwd",
    )(dy.reshape(n), mask)
    return dx.reshape(dy.shape)
