"""Helpers shared by the Pallas kernels (Triton back end)."""
from __future__ import annotations

from jax.experimental.pallas import triton as plgpu


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


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
