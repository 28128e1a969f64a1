"""The wall-clock timer autotune (jax_ops/tuning.py) and the benchmark
(jax_ops/bench/timing.py) share."""
from __future__ import annotations

import time
from collections.abc import Callable

import jax


def wall_seconds(f: Callable, args, repeats: int) -> list[float]:
    """Seconds per call of f(args): wall clock after a warm-up (compiling) call."""
    jax.block_until_ready(f(args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = f(args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        del out
    return times
