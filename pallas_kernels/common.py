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
