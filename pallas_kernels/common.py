"""Helpers shared by the Pallas kernels (Triton back end)."""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def default_tile(rows: int, cols: int, tile: int) -> dict:
    """block_rows whole rows of ~`tile` elements a program, ~16 elements a thread."""
    cp = next_pow2(cols)
    block_rows = max(1, min(64, tile // cp, next_pow2(max(rows, 1))))
    return {"block_rows": block_rows, "num_warps": max(1, min(16, block_rows * cp // 512))}


def tile_configs(cols: int) -> list[dict]:
    """The (block_rows, num_warps) tiles autotune explores: 2K-16K elements a program,
    8-32 elements a thread, 1-16 warps."""
    cp = next_pow2(cols)
    out = []
    for tile in (2048, 4096, 8192, 16384):
        block_rows = max(1, min(128, tile // cp))
        for per_thread in (8, 16, 32):
            num_warps = block_rows * cp // (32 * per_thread)
            if 1 <= num_warps <= 16:
                out.append({"block_rows": block_rows, "num_warps": num_warps})
    return out


def unique_configs(configs: list[dict]) -> list[dict]:
    """The configs in order, without repeats (the first is the default)."""
    seen, unique = set(), []
    for c in configs:
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            unique.append(c)
    return unique


def tile_index(row0, block_rows: int, block_cols: int):
    """Index arrays ((block_rows, 1), (1, block_cols)) of the tile of rows
    [row0, row0 + block_rows) and columns [0, block_cols) of a 2-D ref, for a masked
    plgpu.load/store: `ref.at[tile_index(...)]`.

    Why not `(pl.ds(row0, block_rows), pl.ds(0, block_cols))`: Triton tiles have
    power-of-two sides, so block_cols = next_pow2(cols) runs past the array, and since
    jax 0.12 Pallas rejects a slice whose static bounds leave the array ("Out of bound
    slice: start=0, size=64, stride=1, dim=40"; 0.11 skipped the check for start 0, a
    falsy value, by accident). Index arrays are not bounds-checked at trace time; the
    load/store mask keeps the accesses in bounds, as in jax's own Pallas GPU kernels.
    On the GPU they lower to the same pointer arithmetic as slices (a splat start plus
    tt.make_range, contiguous along a row, so loads stay vectorized); in interpret
    mode they become a gather/scatter instead of a dynamic slice. Both sides are
    index arrays: Pallas cannot discharge a mix of slices and arrays in interpret
    mode, and it would put the array's axis first. H100, jax 0.11.2, bf16, 49152 rows,
    cols 128-6000: norm and softmax kernel times unchanged (old and new within run-to-run
    noise, < 1 % from 1000 columns up), outputs bit-identical. Slices whose start is traced (pl.ds(program_id * n, n), as in
    relu.py and batch_norm.py) cannot be checked at trace time and stay slices."""
    rows = row0 + jnp.arange(block_rows)
    return rows[:, None], jnp.arange(block_cols)[None, :]


def compiler_params(num_warps: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=2)


# ------------------------------------------------- 1-bit masks (ReLU family) ---

MASK_BITS = 32  # a mask word is a uint32: bit i % 32 of word i // 32 belongs to flat element i


def mask_words(n: int) -> int:
    """uint32 words of a 1-bit mask over n elements."""
    return -(-int(n) // MASK_BITS)


def word_tile_configs(max_block_words: int) -> list[dict]:
    """The flat (block_words, num_warps) tiles autotune explores: 32-512 words
    (1K-16K elements) a program, 8-32 elements a thread, 1-16 warps."""
    out = []
    for block_words in (32, 64, 128, 256, 512):
        block_words = min(block_words, max_block_words)
        for per_thread in (8, 16, 32):
            num_warps = block_words * MASK_BITS // (32 * per_thread)
            if 1 <= num_warps <= 16:
                out.append({"block_words": block_words, "num_warps": num_warps})
    return out
