"""BenchSpec: how the benchmark (jax_ops.bench) makes, calls and counts one op.

An op declaration lists its benchmarks as `Op(bench={name: BenchSpec})`; the benchmark
reads them through `jax_ops.core.op.OPS`. This module imports nothing from jax_ops, so
declarations can use it without depending on the benchmark harness.

An input set is (x, params, dy): x of shape (rows, cols) in the benchmarked dtype;
params the op's other inputs (the norms' float32 scale[, bias], differentiated;
softmax_mask's key-padding mask, not differentiated; () for the other softmax ops);
dy like x, or None. The benchmark makes K seeded sets per shape and times them in one
call (see jax_ops/bench/timing.py).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    """How the benchmark makes, calls and counts one op.

    make_inputs(kx, kp, kq, dtype, rows, cols) -> (x, params): one input set without dy
      (three PRNG keys to draw from).
    kernel(implementation) -> fn(x, *params) -> y: the op with implementation "cuda",
      "pallas", "xla" or None (the automatic choice).
    reference(dtype) -> fn(x, *params): the "jnp" baseline, a plain jax.numpy op
      differentiated by JAX autodiff.
    nbytes(rows, cols, itemsize) -> {"fwd": ..., "bwd": ..., "fwd_bwd": ...}: the
      minimum DRAM bytes per call of each mode (effective GB/s = nbytes / time).
    flax(dtype) -> fn: the "flax" baseline; None: the "jnp" one stands in.
    diff_params: the vjp is w.r.t. (x, *params); False: w.r.t. x only.
    num_params: float32 parameter vectors in params.
    epsilon: passed to every implementation (recorded in the JSON metadata).
    table_stages: the dispatch-table stages `--table` writes ("fwd", "bwd",
      "fwd_stats": the training forward: fwd_res for cuda / pallas where timed, else
      step - bwd, else fwd_bwd - bwd).
    table_alias: (op, stage): its fwd time is also written as that op's stage
      (softmax_mask -> ("softmax", "fwd_mask")).
    unmasked: for a masked variant, the op its time is compared with (masked/unmasked).
    xla_summary: in the "speedup over xla" summary.
    view_cap: x is viewed as (rows // Q, Q, cols), Q = view_len(rows, cols, view_cap)
      (recorded in the JSON metadata).
    title: appended to its tables' titles.
    outputs: how many (rows, cols) results the op returns (add+norm: y and h); the
      backward then takes a cotangent for each.
    cotangent(key, rows, cols, dtype) -> dy: the backward's cotangent, for an op whose
      result is not (rows, cols) (cross_entropy's mean loss: a float32 1.0, what
      training differentiates); None: random normal (rows, cols) in x's dtype.
    """
    make_inputs: Callable
    kernel: Callable
    reference: Callable
    nbytes: Callable
    flax: Callable | None = None
    diff_params: bool = True
    num_params: int = 0
    epsilon: float | None = None
    table_stages: tuple[str, ...] = ()
    table_alias: tuple[str, str] | None = None
    unmasked: str | None = None
    xla_summary: bool = False
    view_cap: int | None = None
    title: str = ""
    outputs: int = 1
    cotangent: Callable | None = None


def view_len(rows: int, cols: int, cap: int) -> int:
    """Q of the (rows // Q, Q, cols) view of softmax_mask / softmax_causal: min(cols, cap)
    when that divides rows, else the largest power of two that divides rows and is
    <= min(cols, cap) (1 for odd rows)."""
    q = min(cols, cap)
    if rows % q == 0:
        return q
    p = rows & -rows  # the largest power of two dividing rows
    while p > q:
        p //= 2
    return p
