"""Timing: the timers (CUPTI kernel time on GPU, wall clock elsewhere), K rotated input
sets per measured call (so L2 holds none of them), the copy ceiling and `measure`.

Each measured call processes K distinct input sets (one jitted function, a Python loop
inside jit; an optimization barrier chains each set to the previous one's outputs, so
XLA can neither merge the sets' kernels horizontally nor overlap them) and its time is
divided by K.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

import jax_ops  # noqa: F401 - registers the FFI targets, jax_ops_device_copy included
from jax_ops.bench.report import Record, short_error
from jax_ops.bench.specs import spec
from jax_ops.core.timing import wall_seconds

MB, GB = 1 << 20, 1 << 30
COPY_WIDTH = 256  # words per row of the copy arrays (1 KiB)


# ---------------------------------------------------------------- timers ----

def cupti_timer(f: Callable, args, repeats: int) -> list[float]:
    """Seconds per call of f(args): CUPTI kernel time of all kernels of one call
    (jax.experimental.mosaic.gpu.profiler.measure, which warms up)."""
    from jax.experimental.mosaic.gpu import profiler
    measured = profiler.measure(f)
    times = []
    for _ in range(repeats):
        out, ms = measured(args)
        del out
        if ms is None:
            raise RuntimeError("CUPTI recorded no kernel for this call")
        times.append(ms * 1e-3)
    return times


TIMERS = {"wall": wall_seconds, "cupti": cupti_timer}  # seconds per call of f(args)


def timer_name(name: str = "auto") -> str:
    """"auto" -> "cupti" on GPU, "wall" elsewhere; other names are returned checked."""
    if name == "auto":
        return "cupti" if jax.default_backend() == "gpu" else "wall"
    if name not in TIMERS:
        raise ValueError(f"unknown timer {name!r}; expected auto, {', '.join(TIMERS)}")
    return name


def get_timer(name: str = "auto") -> Callable:
    """The timer `name` ("auto", "cupti", "wall"): timer(f, args, repeats) -> seconds per
    call of f(args), one per repeat."""
    return TIMERS[timer_name(name)]


# ---------------------------------------------------------- input rotation ---

def batched(one: Callable) -> Callable:
    """One jitted call that applies `one` to every set in turn (a Python loop in jit).

    An optimization barrier makes each set wait for the previous set's outputs, so
    XLA can neither fuse the K independent computations horizontally into fewer
    kernels nor run them concurrently: each set gets its own kernels, as alone.
    """
    def run(sets):
        outs = []
        for s in sets:
            if outs:
                s, _ = jax.lax.optimization_barrier((s, outs[-1]))
            outs.append(one(*s))
        return outs
    return jax.jit(run)


def num_sets(nbytes: int, footprint: int, max_mem: int = 20 * GB, max_sets: int = 256) -> int:
    """K: K * nbytes >= footprint bytes (flushes the cache), K * nbytes <= max_mem,
    K <= max_sets (compile time), K >= 2."""
    k = min(math.ceil(footprint / nbytes), max_mem // nbytes, max_sets)
    return max(2, k)


def make_sets(op: str, dtype, rows: int, cols: int, k: int, with_dy: bool, seed: int):
    """K seeded random input sets (x, params, dy): params as the op's spec makes them
    (norms: float32 (scale[, bias]); softmax_mask: (mask,); other softmax ops: ()),
    dy random normal in x's dtype, None if unneeded."""
    make_inputs, outputs, cotangent = spec(op).make_inputs, spec(op).outputs, spec(op).cotangent
    sets = []
    for i in range(k):
        kx, kp, kq, kd = jax.random.split(jax.random.fold_in(jax.random.key(seed), i), 4)
        x, params = make_inputs(kx, kp, kq, dtype, rows, cols)
        dy = None
        if with_dy and cotangent is not None:  # e.g. a scalar loss's 1.0
            dy = cotangent(kd, rows, cols, dtype)
        elif with_dy:  # one cotangent per result (add+norm: dy and dh)
            dys = [jax.random.normal(kd_i, (rows, cols), dtype) for kd_i in jax.random.split(kd, outputs)]
            dy = dys[0] if outputs == 1 else tuple(dys)
        sets.append((x, params, dy))
    jax.block_until_ready(sets)
    return sets


# -------------------------------------------------------------- measuring ---

def summarize(rec: Record, call_times: list[float]) -> None:
    """Fills the time fields of `rec` from seconds per call (of K sets)."""
    per_set = [t / rec.k_sets * 1e6 for t in call_times]
    rec.times_us = per_set
    rec.time_us = statistics.median(per_set)
    rec.time_us_min, rec.time_us_max = min(per_set), max(per_set)
    rec.gbps = rec.min_bytes / (rec.time_us * 1e-6) / 1e9


def device_copy(a):
    """The "jax_ops_device_copy" FFI target: a 16-byte vectorized copy on GPU, memcpy on CPU."""
    return jax.ffi.ffi_call("jax_ops_device_copy", jax.ShapeDtypeStruct(a.shape, a.dtype))(a)


def measure_copy(base: dict, timer: Callable, repeats: int, seed: int) -> Record:
    """The copy ceiling as a Record (impl "copy"; base: the other Record fields): K
    arrays of ~min_bytes/2 bytes each, copied in one call, so each set reads and writes
    min_bytes like the op's floor. An error is recorded, not raised."""
    rec = Record(impl="copy", **base)
    # uint32 words, each 4 B read + 4 B written; 2D to keep every dimension small.
    shape = (max(1, round(base["min_bytes"] / (8 * COPY_WIDTH))), COPY_WIDTH)
    words = shape[0] * shape[1]
    try:
        key = jax.random.key(seed + 1)
        arrays = [jax.random.bits(jax.random.fold_in(key, i), shape, jnp.uint32)
                  for i in range(rec.k_sets)]
        call_times = timer(batched(device_copy), [(a,) for a in arrays], repeats)
        del arrays
        # Scale to exactly min_bytes (the array size was rounded to whole words).
        summarize(rec, [t * base["min_bytes"] / (8 * words) for t in call_times])
        rec.copy_us, rec.copy_gbps, rec.frac_of_copy = rec.time_us, rec.gbps, 1.0
    except Exception as e:  # noqa: BLE001
        rec.error = short_error(e)
    return rec


def copy_us(nbytes: int, k: int, *, timer: str = "auto", repeats: int = 5, seed: int = 0) -> float:
    """Microseconds per set of the copy ceiling: a device copy reading and writing
    `nbytes` per set, K sets per call, median of `repeats`. Raises if it can't run."""
    name = timer_name(timer)
    rec = measure_copy(dict(op="copy", mode="copy", dtype="u32", rows=0, cols=0, timer=name,
                            k_sets=k, min_bytes=nbytes), TIMERS[name], repeats, seed)
    if rec.time_us is None:
        raise RuntimeError(f"jax_ops.bench: the copy ceiling failed: {rec.error}")
    return rec.time_us


def measure(fn: Callable, *args, repeats: int = 5, timer: str = "auto",
            sets: Sequence[tuple] | None = None, jit: bool = True) -> float:
    """Microseconds per call of fn(*args), the median of `repeats` measurements.

    timer: "auto" (CUPTI kernel time on GPU: the sum of the kernels one call launches;
    wall clock after a warm-up call elsewhere), "cupti" or "wall". fn is wrapped in
    jax.jit unless jit=False.

    sets: instead of args, a list of argument tuples: one measured call applies fn to
    each in turn (see `batched`) and the time per set is returned. Use enough sets that
    they do not fit in L2 (num_sets) to time DRAM-bound code as it runs in a model.
    """
    f = jax.jit(fn) if jit else fn
    t = get_timer(timer)
    if sets is None:
        times = t(lambda a: f(*a), tuple(args), repeats)
        return statistics.median(times) * 1e6
    if args:
        raise TypeError("jax_ops.bench.measure: pass args or sets, not both")
    sets = [tuple(s) for s in sets]
    times = t(batched(f), sets, repeats)
    return statistics.median(times) / len(sets) * 1e6
