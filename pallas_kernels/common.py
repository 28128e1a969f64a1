"""Helpers shared by the Pallas kernels (Triton back end)."""
from __future__ import annotations

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
