"""Benchmark of jax_ops' norms and softmax against XLA, autodiff baselines and a copy ceiling.

    python -m jax_ops.bench
        [--op layer_norm|rms_norm|softmax|log_softmax|softmax_mask|softmax_causal|
              relu|add_relu|batch_norm_relu|batch_norm_add_relu]
        [--impl cuda,pallas,xla,auto,flax,jnp] [--dtype bf16|f32|f16] [--rows N]
        [--cols 32,64,...] [--mode fwd,fwd_bwd,bwd] [--repeats 5] [--check]
        [--json [PATH]] [--csv PATH] [--table PATH]

Ops ("--op", comma list) and their input sets (x, params, dy), x and dy of shape
(rows, cols) in the --dtype:
  layer_norm      params (scale, bias) float32, differentiated; x, dy random normal.
  rms_norm        params (scale,).
  softmax         jax_ops.softmax(x) over the last axis; params (); x = 4 * random normal.
  log_softmax     jax_ops.log_softmax(x).
  softmax_mask    x viewed as (B, Q, cols), Q = min(cols, 512), B = rows // Q;
                  jax_ops.softmax(x3, mask=m) with a key-padding bool mask m of shape
                  (B, 1, cols), ~10% False, column 0 always True (no fully masked row);
                  params (m,), not differentiated (the vjp is w.r.t. x only).
  softmax_causal  x viewed as (B, Q, cols), Q = min(cols, 2048); jax_ops.softmax(x3,
                  causal=True) (keeps j <= i + (cols - Q)); params ().
  Q rule (view_len): min(cols, cap) when it divides rows (the default rows, 49152 =
  3 * 2^14, and 4096 on CPU, are divisible by every power-of-two cap and by 768), else the
  largest power of two dividing rows that is <= min(cols, cap). The views are recorded in
  the JSON metadata ("views").

Implementations ("--impl"):
  cuda    jax_ops.<op>(..., implementation="cuda"): our hand kernels (on CPU: host handlers).
  pallas  jax_ops.<op>(..., implementation="pallas"): our Pallas kernels (interpreted on CPU,
          so not in the CPU default).
  xla     jax_ops.<op>(..., implementation="xla"): our primitive lowered to plain XLA.
  auto    jax_ops.<op>(...): the automatic choice (measured table, autotune cache,
          heuristics; see jax_ops/dispatch.py). Under the tables, "auto/best" is its time
          over the fastest of cuda/pallas/xla in the same run.
  flax  norms: flax.linen.LayerNorm / RMSNorm (param_dtype float32, dtype = x's dtype so y
        has x's dtype), differentiated by JAX autodiff. Falls back to "jnp" when flax is
        not importable. Softmax ops: the same as "jnp".
  jnp   a plain jax.numpy op with float32 math, output cast to x's dtype, differentiated
        by JAX autodiff: the norm; jax.nn.softmax / log_softmax of x.astype(float32)
        (softmax_mask: jnp.where(mask, logits, -inf); softmax_causal: a tril mask).
The baseline of the "vs" column is "flax" when it ran, else "jnp".

Modes ("--mode"), per input set (x, params, dy):
  fwd      y = op(x, *params)
  fwd_bwd  y, vjp_fn = jax.vjp(op, x, *params); (dx, *dparams) = vjp_fn(dy), all in one
           jitted function (softmax ops: the vjp is w.r.t. x only, so just dx).
  bwd      vjp_fn is made beforehand (a jitted jax.vjp); only vjp_fn(dy) is timed. The
           residuals are whatever the implementation saves (autodiff baselines may
           save float32 intermediates and so read more than the minimum below).
  fwd_res  y, vjp_fn = jax.vjp(op, x, *params), returning both: the forward of a training
           step, which writes the residuals the backward keeps (jax.nn.relu: a bool
           per element; ours: 1 bit). fwd + bwd understates the baselines' training
           cost where their plain forward writes no residual; fwd_res + bwd does not.

Minimum bytes per call ("min_bytes"; effective GB/s = min_bytes / time). With
  X = rows * cols * itemsize(x)      one activation-sized array (x, y, dy or dx)
norms, with
  P = cols * 4                       one float32 parameter vector
  n = 2 for layer_norm (scale, bias), 1 for rms_norm (scale)
  S = rows * 4 * (2 for layer_norm: mean + rstd; 1 for rms_norm: rstd)   float32 stats
we count
  fwd     = 2X + n*P              read x, write y; read the parameters
  bwd     = 3X + S + P + n*P      read x and dy, write dx; read the stats and scale;
                                  write dscale (and dbias)
  fwd_bwd = fwd + S + bwd         two passes, as two separate kernels at best: the
                                  forward also writes the stats and x is read twice.
softmax ops, with M = B * cols (the bool mask, softmax_mask only; else 0)
  fwd     = 2X + M                read x (and the mask), write y; causal: no mask read
  bwd     = 3X                    read y and dy, write dx
  fwd_bwd = fwd + bwd = 5X + M    the backward reads the saved y.

Timing. Each measured call processes K distinct input sets (one jitted function, a
Python loop inside jit; an optimization barrier chains each set to the previous one's
outputs, so XLA can neither merge the sets' kernels horizontally nor overlap them:
each set gets its own kernels) and its time is divided by K.
K is chosen so that K * min_bytes >= --footprint-mb (default 512 MB on GPU, well
above the 50-60 MB L2; 32 MB on CPU), K >= 2, and K * min_bytes <= --max-mem-gb.
  GPU: CUPTI kernel time of one call, jax.experimental.mosaic.gpu.profiler.measure
       (which does its own warm-up call): the sum of the durations of all GPU
       kernels launched by the call.
  CPU: wall clock of one call after a warm-up call, with block_until_ready.
Repeated --repeats times; reported: median per-set time, and min/max (the spread).

Copy ceiling. The "jax_ops_device_copy" FFI target (a 16-byte vectorized copy on GPU,
memcpy on CPU) copies K distinct arrays of min_bytes / 2 bytes each, so it reads and
writes min_bytes per set like the op's floor; measured the same way, in the same run.
"%copy" = copy_time / op_time (the fraction of copy bandwidth the op reaches).

Summaries after the tables:
  auto/best          with --impl auto: the automatic choice vs the fastest kernel.
  masked/unmasked    softmax_mask and softmax_causal time over softmax's, same impl, mode,
                     dtype and cols, when both ran in the invocation (target <= 1.15 for
                     cuda/pallas/xla/auto).
  speedup over xla   softmax, log_softmax: xla time / each impl's time (target: fwd_bwd
                     >= 1.5 for cuda/pallas/auto).

--table writes per op the stages the dispatch reads: norms fwd, bwd and fwd_stats (the
training forward, fwd_bwd - bwd); softmax and log_softmax fwd and bwd only (their
training forward is the inference forward); softmax_mask and softmax_causal nothing
(they run the softmax kernels).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

import jax_ops  # registers the FFI targets, jax_ops_device_copy included
from jax_ops.tuning import wall_seconds

IMPLS = ("cuda", "pallas", "xla", "auto", "flax", "jnp")
KERNEL_IMPLS = ("cuda", "pallas", "xla")  # what the automatic choice picks among
MODES = ("fwd", "fwd_bwd", "bwd", "fwd_res")
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32, "f16": jnp.float16}
EPSILON = {"layer_norm": 1e-5, "rms_norm": 1e-6}  # jax_ops' defaults, used by every impl
MB, GB = 1 << 20, 1 << 30
COPY_WIDTH = 256  # words per row of the copy arrays (1 KiB)

GPU_DEFAULTS = dict(rows=49152, cols=(32, 64, 128, 256, 512, 768, 1024, 2048, 4096, 8192,
                                      16384, 32768), footprint_mb=512)
CPU_DEFAULTS = dict(rows=4096, cols=(32, 128, 512, 1024, 4096), footprint_mb=32)


# ---------------------------------------------------------------- results ---

@dataclasses.dataclass
class Record:
    """One (op, mode, dtype, cols, impl) measurement; impl "copy" is the ceiling."""
    op: str
    mode: str
    dtype: str
    rows: int
    cols: int
    impl: str
    timer: str
    k_sets: int
    min_bytes: int
    time_us: float | None = None      # median over repeats, per input set
    time_us_min: float | None = None
    time_us_max: float | None = None
    gbps: float | None = None         # min_bytes / time_us
    copy_us: float | None = None      # the copy ceiling for the same bytes
    copy_gbps: float | None = None
    frac_of_copy: float | None = None  # copy_us / time_us
    baseline: str | None = None
    vs_baseline: float | None = None   # baseline time_us / time_us
    max_rel_err: float | None = None   # vs "xla", with --check
    check_error: str | None = None     # why --check could not compare this impl
    error: str | None = None
    times_us: list[float] = dataclasses.field(default_factory=list)


# ------------------------------------------------------------ the ops -------
#
# Each op is an OpSpec: how to make one input set, the callable of each implementation,
# its minimum bytes and what it contributes to a dispatch table. An input set is
# (x, params, dy): x of shape (rows, cols) in the benchmarked dtype; params the op's other
# inputs (the norms' float32 scale[, bias], differentiated; softmax_mask's key-padding
# mask, not differentiated; () for the other softmax ops); dy like x, or None.

SOFTMAX_X_SCALE = 4.0            # softmax inputs: x = 4 * N(0, 1), peaked rows
MASK_KEEP = 0.9                  # softmax_mask: P(mask element is True)
MASK_Q_CAP, CAUSAL_Q_CAP = 512, 2048  # Q of the (rows // Q, Q, cols) views, at most


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """How the benchmark makes, calls and counts one op."""
    make_inputs: Callable    # (kx, kp, kq, dtype, rows, cols) -> (x, params)
    kernel: Callable         # implementation ("cuda"/"pallas"/"xla"/None: auto) -> fn(x, *params)
    reference: Callable      # dtype -> fn(x, *params): the "jnp" autodiff baseline
    nbytes: Callable         # (rows, cols, itemsize) -> {"fwd": ..., "bwd": ..., "fwd_bwd": ...}
    flax: Callable | None = None  # dtype -> fn: the "flax" baseline (None: the "jnp" one)
    diff_params: bool = True      # the vjp is w.r.t. (x, *params); False: w.r.t. x only
    num_params: int = 0           # float32 parameter vectors in params
    epsilon: float | None = None  # passed to every impl (recorded in the metadata)
    table_stages: tuple[str, ...] = ()  # dispatch-table stages --table writes
    table_alias: tuple[str, str] | None = None  # its fwd is written as (op, stage) instead
    unmasked: str | None = None   # a masked variant: the op its time is compared with
    xla_summary: bool = False     # in the "speedup over xla" summary
    view_cap: int | None = None   # x is viewed as (rows // Q, Q, cols), Q = view_len(.., cap)
    title: str = ""               # appended to its tables' titles


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


# norms

def _jnp_norm(op: str, eps: float) -> Callable:
    """Plain jax.numpy norm with float32 math, output in x's dtype."""
    def layer_norm(x, scale, bias):
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        return ((xf - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)

    def rms_norm(x, scale):
        xf = x.astype(jnp.float32)
        ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
        return (xf * jax.lax.rsqrt(ms + eps) * scale).astype(x.dtype)

    return layer_norm if op == "layer_norm" else rms_norm


def _flax_norm(op: str, eps: float, dtype) -> Callable:
    import flax.linen as nn
    if op == "layer_norm":
        ln = nn.LayerNorm(epsilon=eps, dtype=dtype, param_dtype=jnp.float32)
        return lambda x, scale, bias: ln.apply({"params": {"scale": scale, "bias": bias}}, x)
    rms = nn.RMSNorm(epsilon=eps, dtype=dtype, param_dtype=jnp.float32)
    return lambda x, scale: rms.apply({"params": {"scale": scale}}, x)


def _norm_spec(op: str) -> OpSpec:
    eps = EPSILON[op]
    n = 2 if op == "layer_norm" else 1  # scale, bias / scale

    def make_inputs(kx, ks, kb, dtype, rows, cols):
        x = jax.random.normal(kx, (rows, cols), dtype)
        scale = 1.0 + 0.1 * jax.random.normal(ks, (cols,), jnp.float32)
        return x, (scale, 0.1 * jax.random.normal(kb, (cols,), jnp.float32))[:n]

    def kernel(impl):
        if op == "layer_norm":
            return lambda x, scale, bias: jax_ops.layer_norm(
                x, scale, bias, epsilon=eps, implementation=impl)
        return lambda x, scale: jax_ops.rms_norm(x, scale, epsilon=eps, implementation=impl)

    def nbytes(rows, cols, itemsize):
        x, p = rows * cols * itemsize, cols * 4
        s = rows * 4 * n  # float32 stats: layer_norm mean + rstd; rms_norm rstd
        fwd = 2 * x + n * p
        bwd = 3 * x + s + p + n * p
        return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + s + bwd}

    return OpSpec(make_inputs=make_inputs, kernel=kernel, nbytes=nbytes,
                  reference=lambda dtype: _jnp_norm(op, eps),
                  flax=lambda dtype: _flax_norm(op, eps, dtype), num_params=n,
                  epsilon=eps, table_stages=("fwd", "bwd", "fwd_stats"))


# softmax family. Kernels call jax_ops.softmax / log_softmax on the (B, Q, cols) view
# for the masked variants and reshape y back to (rows, cols) (free: a bitcast).

def _softmax_inputs(kx, kp, kq, dtype, rows, cols):
    return SOFTMAX_X_SCALE * jax.random.normal(kx, (rows, cols), dtype), ()


def _mask_inputs(kx, kp, kq, dtype, rows, cols):
    """x and a key-padding mask (B, 1, cols), True = keep (~90%), never a fully masked
    row (column 0 always kept)."""
    x, _ = _softmax_inputs(kx, kp, kq, dtype, rows, cols)
    b = rows // view_len(rows, cols, MASK_Q_CAP)
    keep = jax.random.bernoulli(kp, MASK_KEEP, (b, 1, cols)).at[..., 0].set(True)
    return x, (keep,)


def _softmax_kernel(log: bool = False, masked: bool = False, causal: bool = False) -> Callable:
    def make(impl):
        def fn(x, *mask):
            rows, cols = x.shape
            op = jax_ops.log_softmax if log else jax_ops.softmax  # looked up at call time
            if masked:
                y = op(x.reshape(mask[0].shape[0], -1, cols), mask=mask[0], implementation=impl)
            elif causal:
                q = view_len(rows, cols, CAUSAL_Q_CAP)
                y = op(x.reshape(rows // q, q, cols), causal=True, implementation=impl)
            else:
                y = op(x, axis=-1, implementation=impl)
            return y.reshape(rows, cols)
        return fn
    return make


def _jnp_softmax(log: bool = False, masked: bool = False, causal: bool = False) -> Callable:
    """dtype -> plain jax.nn (log_)softmax on float32 logits, -inf where masked, output in
    x's dtype; differentiated by JAX autodiff."""
    def fn(x, *mask):
        rows, cols = x.shape
        z = x.astype(jnp.float32)
        if masked:
            z = jnp.where(mask[0], z.reshape(mask[0].shape[0], -1, cols), -jnp.inf)
        elif causal:
            q = view_len(rows, cols, CAUSAL_Q_CAP)
            keep = jnp.tril(jnp.ones((q, cols), bool), cols - q)  # j <= i + (cols - q)
            z = jnp.where(keep, z.reshape(rows // q, q, cols), -jnp.inf)
        y = (jax.nn.log_softmax if log else jax.nn.softmax)(z, axis=-1)
        return y.astype(x.dtype).reshape(rows, cols)
    return lambda dtype: fn


def _softmax_bytes(mask_cap: int | None = None) -> Callable:
    def nbytes(rows, cols, itemsize):
        x = rows * cols * itemsize
        m = 0 if mask_cap is None else rows // view_len(rows, cols, mask_cap) * cols  # bool
        fwd, bwd = 2 * x + m, 3 * x  # bwd: read y and dy, write dx
        return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}
    return nbytes


def _softmax_spec(log: bool = False, masked: bool = False, causal: bool = False) -> OpSpec:
    flags = dict(log=log, masked=masked, causal=causal)
    common = dict(kernel=_softmax_kernel(**flags), reference=_jnp_softmax(**flags),
                  diff_params=False)
    if masked:
        return OpSpec(make_inputs=_mask_inputs, nbytes=_softmax_bytes(MASK_Q_CAP),
                      unmasked="softmax", view_cap=MASK_Q_CAP,
                      table_alias=("softmax", "fwd_mask"),
                      title=f" as (B, Q, cols), Q = min(cols, {MASK_Q_CAP}), "
                            f"mask (B, 1, cols) {MASK_KEEP:.0%} True", **common)
    if causal:
        return OpSpec(make_inputs=_softmax_inputs, nbytes=_softmax_bytes(),
                      unmasked="softmax", view_cap=CAUSAL_Q_CAP,
                      title=f" as (B, Q, cols), Q = min(cols, {CAUSAL_Q_CAP}), causal", **common)
    return OpSpec(make_inputs=_softmax_inputs, nbytes=_softmax_bytes(),
                  table_stages=("fwd", "bwd"), xla_summary=True, **common)


# relu family and the BatchNorm fusions. x is (rows, cols); for BatchNorm cols are the
# channels (an NHWC activation flattened to (N*H*W, C)). The mask residual is 1 bit per
# element: M = rows * cols / 8 bytes.

BN_EPSILON = 1e-5


def _relu_spec(add: bool) -> OpSpec:
    def make_inputs(kx, kp, kq, dtype, rows, cols):
        x = jax.random.normal(kx, (rows, cols), dtype)
        return x, ((jax.random.normal(kp, (rows, cols), dtype),) if add else ())

    def kernel(impl):
        if add:
            return lambda x, z: jax_ops.add_relu(x, z, implementation=impl)
        return lambda x: jax_ops.relu(x, implementation=impl)

    def reference(dtype):  # XLA's relu, autodiff keeps what it likes (x or a predicate)
        if add:
            return lambda x, z: jax.nn.relu(x + z)
        return jax.nn.relu

    def nbytes(rows, cols, itemsize):
        x, m = rows * cols * itemsize, -(-rows * cols // 32) * 4
        fwd = (3 if add else 2) * x + m      # read x (and z), write y and the mask
        bwd = 2 * x + m                      # read dy and the mask, write dx (= dz)
        return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}

    return OpSpec(make_inputs=make_inputs, kernel=kernel, reference=reference, nbytes=nbytes,
                  diff_params=add, table_stages=("fwd", "bwd"),
                  title=" (y + 1-bit mask)")


def _bn_spec(add: bool) -> OpSpec:
    op = "batch_norm_add_relu" if add else "batch_norm_relu"

    def make_inputs(kx, kp, kq, dtype, rows, cols):
        x = 0.5 + jax.random.normal(kx, (rows, cols), dtype)
        scale = 1.0 + 0.1 * jax.random.normal(kp, (cols,), jnp.float32)
        bias = 0.1 * jax.random.normal(kq, (cols,), jnp.float32)
        z = (jax.random.normal(jax.random.fold_in(kq, 1), (rows, cols), dtype),) if add else ()
        return x, (*z, scale, bias)

    def kernel(impl):  # training forward; y only (the statistics are for the running averages)
        if add:
            return lambda x, z, s, b: jax_ops.batch_norm_add_relu(
                x, z, s, b, epsilon=BN_EPSILON, implementation=impl)[0]
        return lambda x, s, b: jax_ops.batch_norm_relu(x, s, b, epsilon=BN_EPSILON,
                                                       implementation=impl)[0]

    def reference(dtype):  # BatchNorm in float32 jnp + jax.nn.relu, autodiff
        def bn(x, s, b):
            xf = x.astype(jnp.float32)
            mean = jnp.mean(xf, axis=0)
            var = jnp.mean(jnp.square(xf - mean), axis=0)
            return ((xf - mean) * jax.lax.rsqrt(var + BN_EPSILON) * s + b).astype(x.dtype)
        if add:
            return lambda x, z, s, b: jax.nn.relu(bn(x, s, b) + z)
        return lambda x, s, b: jax.nn.relu(bn(x, s, b))

    def flax(dtype):  # flax.linen.BatchNorm (training, batch_stats updated) + jax.nn.relu
        import flax.linen as nn
        m = nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=BN_EPSILON,
                         dtype=dtype, param_dtype=jnp.float32)

        def bn(x, s, b):
            c = x.shape[-1]
            stats = {"mean": jnp.zeros((c,), jnp.float32), "var": jnp.ones((c,), jnp.float32)}
            y, _ = m.apply({"params": {"scale": s, "bias": b}, "batch_stats": stats}, x,
                           mutable=["batch_stats"])
            return y
        if add:
            return lambda x, z, s, b: jax.nn.relu(bn(x, s, b) + z)
        return lambda x, s, b: jax.nn.relu(bn(x, s, b))

    def nbytes(rows, cols, itemsize):
        # Two-pass floors: the per-channel reduction over all rows must finish before
        # the elementwise pass, so x (and dy) are read twice.
        x, m, p = rows * cols * itemsize, -(-rows * cols // 32) * 4, cols * 4
        z = x if add else 0
        fwd = 3 * x + z + m + 2 * p            # stats: read x; then read x (z), write y, mask
        bwd = 5 * x + z + 2 * m + 4 * p        # reduce: dy, x, mask; then dy, x, mask -> dx (dz)
        return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}

    return OpSpec(make_inputs=make_inputs, kernel=kernel, reference=reference, flax=flax,
                  nbytes=nbytes, num_params=2, epsilon=BN_EPSILON, table_stages=("bwd",),
                  table_alias=(op, "fwd_stats"),
                  title=" training, (rows, C) = (N*H*W, C)")


SPECS: dict[str, OpSpec] = {
    "layer_norm": _norm_spec("layer_norm"),
    "rms_norm": _norm_spec("rms_norm"),
    "softmax": _softmax_spec(),
    "log_softmax": _softmax_spec(log=True),
    "softmax_mask": _softmax_spec(masked=True),
    "softmax_causal": _softmax_spec(causal=True),
    "relu": _relu_spec(add=False),
    "add_relu": _relu_spec(add=True),
    "batch_norm_relu": _bn_spec(add=False),
    "batch_norm_add_relu": _bn_spec(add=True),
}
OPS = tuple(SPECS)


def num_params(op: str) -> int:
    """The number of float32 parameter vectors of op (2, 1, or 0 for the softmax ops)."""
    return SPECS[op].num_params


def min_bytes(op: str, mode: str, rows: int, cols: int, itemsize: int) -> int:
    """The op's minimum DRAM traffic per call; see the module docstring. fwd_res (the
    training forward) counts the forward's floor: our forwards write their residuals
    (mask, statistics) in any case."""
    return SPECS[op].nbytes(rows, cols, itemsize)["fwd" if mode == "fwd_res" else mode]


@functools.cache
def flax_available() -> bool:
    try:
        import flax.linen  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken: either way not usable
        return False
    return True


def make_op(op: str, impl: str, dtype) -> Callable:
    """fn(x, *params) -> y for an implementation (params: see make_sets)."""
    spec = SPECS[op]
    if impl in KERNEL_IMPLS or impl == "auto":
        return spec.kernel(None if impl == "auto" else impl)
    if impl == "flax":
        return (spec.flax or spec.reference)(dtype)
    if impl == "jnp":
        return spec.reference(dtype)
    raise ValueError(f"unknown implementation {impl!r}")


def _vjp(fn: Callable, x, params, diff_params: bool):
    """jax.vjp of fn at (x, *params), or w.r.t. x only (params held constant)."""
    if diff_params:
        return jax.vjp(fn, x, *params)
    return jax.vjp(lambda x: fn(x, *params), x)


def per_set_fn(fn: Callable, mode: str, diff_params: bool = True) -> Callable:
    """The function applied to one input set (see mode_args for its arguments)."""
    if mode == "fwd":
        return lambda x, params: fn(x, *params)
    if mode == "fwd_bwd":
        def fwd_bwd(x, params, dy):
            y, vjp_fn = _vjp(fn, x, params, diff_params)
            return (y, *vjp_fn(dy))
        return fwd_bwd
    if mode == "bwd":
        return lambda vjp_fn, dy: vjp_fn(dy)
    if mode == "fwd_res":  # the forward of a training step: y and what the VJP keeps
        return lambda x, params: _vjp(fn, x, params, diff_params)
    raise ValueError(f"unknown mode {mode!r}")


def mode_args(fn: Callable, mode: str, sets: Sequence[tuple],
              diff_params: bool = True) -> list[tuple]:
    """Arguments of per_set_fn for each set; for "bwd" this runs the forward (jax.vjp)."""
    if mode in ("fwd", "fwd_res"):
        return [(x, params) for x, params, _ in sets]
    if mode == "fwd_bwd":
        return [(x, params, dy) for x, params, dy in sets]
    make_vjp = jax.jit(lambda x, params: _vjp(fn, x, params, diff_params)[1])
    return [(make_vjp(x, params), dy) for x, params, dy in sets]


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


# ---------------------------------------------------------------- inputs ----

def num_sets(nbytes: int, footprint: int, max_mem: int, max_sets: int) -> int:
    """K: K * nbytes >= footprint (flushes the cache), within memory and compile limits, >= 2."""
    k = min(math.ceil(footprint / nbytes), max_mem // nbytes, max_sets)
    return max(2, k)


def make_sets(op: str, dtype, rows: int, cols: int, k: int, with_dy: bool, seed: int):
    """K seeded random input sets (x, params, dy): params as the op's spec makes them
    (norms: float32 (scale[, bias]); softmax_mask: (mask,); other softmax ops: ()),
    dy random normal in x's dtype, None if unneeded."""
    sets = []
    for i in range(k):
        kx, kp, kq, kd = jax.random.split(jax.random.fold_in(jax.random.key(seed), i), 4)
        x, params = SPECS[op].make_inputs(kx, kp, kq, dtype, rows, cols)
        dy = jax.random.normal(kd, (rows, cols), dtype) if with_dy else None
        sets.append((x, params, dy))
    jax.block_until_ready(sets)
    return sets


def device_copy(a):
    return jax.ffi.ffi_call("jax_ops_device_copy", jax.ShapeDtypeStruct(a.shape, a.dtype))(a)


# ---------------------------------------------------------------- timers ----

def cupti_timer(f: Callable, args, repeats: int) -> list[float]:
    """Seconds per call: CUPTI kernel time of all kernels of one call (measure warms up)."""
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


# ---------------------------------------------------------------- checks ----

@jax.jit
def _rel_err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(jnp.square(a - b))) / jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(b))), 1e-30)


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖, the worst over the leaves of two output pytrees (b: reference).

    A relative norm, not max|a − b| / max|b|: at a ReLU kink (pre-activation within an
    ulp of 0) float32 rounding may set the mask bit either way, and that one element's
    gradient then differs by a·dy — e.g. 77 of 1e8 elements have |pre| < 1e-6 at
    (401408, 256) float32, and a max-norm check reported 0.1 for a correct kernel."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max((float(_rel_err(x, y)) for x, y in pairs if y.size), default=0.0)


def check(op: str, mode: str, dtype, impls: Sequence[str], first_set: tuple) -> dict:
    """impl -> relative error of its outputs vs "xla" on one set, or the error string."""
    diff = SPECS[op].diff_params

    def outputs(impl):
        fn = make_op(op, impl, dtype)
        (args,) = mode_args(fn, mode, [first_set], diff)
        out = jax.jit(per_set_fn(fn, mode, diff))(*args)
        # fwd_res: only y compares; the residuals are each implementation's own
        return out[0] if mode == "fwd_res" else out

    try:
        ref = outputs("xla")
    except Exception as e:  # noqa: BLE001
        return {impl: f"the xla reference failed: {short_error(e)}" for impl in impls}
    errs = {}
    for impl in impls:
        if impl == "xla":
            continue
        try:
            errs[impl] = rel_err(outputs(impl), ref)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            errs[impl] = short_error(e)
    return errs


# ------------------------------------------------------------- measuring ----

def short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 600 else text[:600] + " ..."


def summarize(rec: Record, call_times: list[float]) -> None:
    """Fills the time fields of `rec` from seconds per call (of K sets)."""
    per_set = [t / rec.k_sets * 1e6 for t in call_times]
    rec.times_us = per_set
    rec.time_us = statistics.median(per_set)
    rec.time_us_min, rec.time_us_max = min(per_set), max(per_set)
    rec.gbps = rec.min_bytes / (rec.time_us * 1e-6) / 1e9


def measure_copy(base: dict, timer: Callable, repeats: int, seed: int) -> Record:
    """The copy ceiling: K arrays of ~min_bytes/2 bytes, copied in one call."""
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


def measure_impl(base: dict, op: str, mode: str, dtype, impl: str, sets, timer: Callable,
                 repeats: int) -> Record:
    rec = Record(impl=impl, **base)
    try:
        fn = make_op(op, impl, dtype)
        diff = SPECS[op].diff_params
        args = mode_args(fn, mode, sets, diff)
        call_times = timer(batched(per_set_fn(fn, mode, diff)), args, repeats)
        del args
        summarize(rec, call_times)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: record it, go on
        rec.error = short_error(e)
    return rec


def fill_ratios(records: list[Record], baseline: str | None) -> None:
    """copy ceiling and baseline ratios across the records of one (op, mode, dtype, cols)."""
    by_impl = {r.impl: r for r in records}
    copy = by_impl.get("copy")
    base = by_impl.get(baseline) if baseline else None
    for r in records:
        if r.time_us is None:
            continue
        if copy is not None and copy.time_us is not None:
            r.copy_us, r.copy_gbps = copy.time_us, copy.gbps
            r.frac_of_copy = copy.time_us / r.time_us
        if r.impl != "copy" and base is not None and base.time_us is not None:
            r.baseline, r.vs_baseline = baseline, base.time_us / r.time_us


def bench_shape(cfg, op: str, dtype_name: str, cols: int, timer: Callable) -> list[Record]:
    """All modes and implementations for one (op, dtype, cols)."""
    dtype = DTYPES[dtype_name]
    itemsize = jnp.dtype(dtype).itemsize
    nbytes = {m: min_bytes(op, m, cfg.rows, cols, itemsize) for m in cfg.modes}
    ks = {m: num_sets(nbytes[m], cfg.footprint_mb * MB, int(cfg.max_mem_gb * GB), cfg.max_sets)
          for m in cfg.modes}
    records = []
    try:
        sets = make_sets(op, dtype, cfg.rows, cols, max(ks.values()),
                         with_dy=any(m not in ("fwd", "fwd_res") for m in cfg.modes), seed=cfg.seed)
    except Exception as e:  # noqa: BLE001
        for m in cfg.modes:
            records.append(Record(op, m, dtype_name, cfg.rows, cols, "inputs", cfg.timer,
                                  ks[m], nbytes[m], error=short_error(e)))
        log(f"{op} {dtype_name} cols={cols}: inputs failed: {short_error(e)}")
        return records

    for mode in cfg.modes:
        k = ks[mode]
        base = dict(op=op, mode=mode, dtype=dtype_name, rows=cfg.rows, cols=cols,
                    timer=cfg.timer, k_sets=k, min_bytes=nbytes[mode])
        errs = check(op, mode, dtype, cfg.impls, sets[0]) if cfg.check else {}
        if errs:
            log(f"check {op} {mode} {dtype_name} cols={cols}: rel err (norm) vs xla: " +
                ", ".join(f"{i} {e:.2e}" if isinstance(e, float) else f"{i} ERROR {e}"
                          for i, e in errs.items()))
        group = [measure_copy(base, timer, cfg.repeats, cfg.seed)]
        for impl in cfg.impls:
            group.append(measure_impl(base, op, mode, dtype, impl, sets[:k], timer, cfg.repeats))
            if isinstance(errs.get(impl), float):
                group[-1].max_rel_err = errs[impl]
            elif impl in errs:
                group[-1].check_error = errs[impl]
        fill_ratios(group, cfg.baseline)
        log(f"{op} {mode} {dtype_name} rows={cfg.rows} cols={cols} K={k}: " + ", ".join(
            f"{r.impl} {r.time_us:.1f}us" if r.time_us is not None else f"{r.impl} ERROR"
            for r in group))
        records += group
    del sets
    gc.collect()  # tracebacks of recorded errors may hold frames with big arrays
    return records


# ---------------------------------------------------------------- output ----

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fmt(v, spec: str, width: int) -> str:
    return (format(v, spec) if v is not None else "-").rjust(width)


FIELDS = (("us", 9), ("GB/s", 7), ("%copy", 6), ("vs", 7), ("+-%", 5))  # per impl
GROUP_W = sum(w for _, w in FIELDS) + len(FIELDS) - 1


def _impl_cells(r: Record | None) -> str:
    if r is None or r.time_us is None:
        return f"{'ERROR':>{GROUP_W}}"
    spread = 100 * (r.time_us_max - r.time_us_min) / r.time_us
    frac = None if r.frac_of_copy is None else 100 * r.frac_of_copy
    values = (r.time_us, r.gbps, frac, r.vs_baseline, spread)
    specs = (".1f", ".1f", ".0f", ".2f", ".0f")
    return " ".join(_fmt(v, spec, w) for v, spec, (_, w) in zip(values, specs, FIELDS))


def _notes(cols: int, by_impl: dict[str, Record]) -> list[str]:
    """Errors (first line) and --check results under a table."""
    recs = by_impl.values()
    notes = [f"  cols={cols} {r.impl}: {r.error.splitlines()[0]}" for r in recs if r.error]
    notes += [f"  cols={cols} {r.impl}: check failed: {r.check_error.splitlines()[0]}"
              for r in recs if r.check_error]
    checked = [f"{r.impl} {r.max_rel_err:.2e}" for r in recs if r.max_rel_err is not None]
    if checked:
        notes.append(f"  cols={cols} rel err (norm) vs xla: " + ", ".join(checked))
    return notes


def format_table(recs: list[Record], impls: Sequence[str], baseline: str | None,
                 meta: dict) -> list[str]:
    """The table of one (op, mode, dtype): a row per cols, a column group per impl."""
    r0 = recs[0]
    names = [f"x{baseline}" if name == "vs" and baseline else name for name, _ in FIELDS]
    head1 = f"{'':>6} {'':>4} | {'copy':^15}"
    head2 = f"{'cols':>6} {'K':>4} | {'us':>9} {'GB/s':>5}"
    for impl in impls:
        head1 += f" | {impl:^{GROUP_W}}"
        head2 += " | " + " ".join(f"{n:>{w}}" for n, (_, w) in zip(names, FIELDS))
    lines = ["", f"{r0.op} {r0.mode} {r0.dtype}, rows={r0.rows}{SPECS[r0.op].title} | "
                 f"{meta['device_kind']} | "
                 f"{meta['timer']} time per call, median of {meta['repeats']}",
             head1, head2, "-" * len(head2)]
    notes = []
    for cols in dict.fromkeys(r.cols for r in recs):
        by_impl = {r.impl: r for r in recs if r.cols == cols}
        copy = by_impl.get("copy")
        line = f"{cols:>6} {next(iter(by_impl.values())).k_sets:>4} | "
        line += (f"{_fmt(copy.time_us, '.1f', 9)} {_fmt(copy.gbps, '.0f', 5)}"
                 if copy and copy.time_us is not None else f"{'ERROR':>15}")
        lines.append(line + "".join(f" | {_impl_cells(by_impl.get(i))}" for i in impls))
        notes += _notes(cols, by_impl)
    return lines + notes


def format_tables(records: list[Record], impls: Sequence[str], baseline: str | None,
                  meta: dict) -> str:
    """One table per (op, mode, dtype), then a legend."""
    lines = []
    for key in dict.fromkeys((r.op, r.mode, r.dtype) for r in records):
        recs = [r for r in records if (r.op, r.mode, r.dtype) == key]
        lines += format_table(recs, impls, baseline, meta)
    vs = f"x{baseline}: {baseline}" if baseline else "vs: baseline"
    lines += ["", "us: per call (one input set), median; GB/s: minimum bytes / time; "
                  f"%copy: copy time / time; {vs} time / time; +-%: (max - min) / median."]
    return "\n".join(lines)


def auto_vs_best(records: list[Record]) -> list[tuple]:
    """(op, mode, dtype, cols, best impl, best us, auto us, auto/best) per shape."""
    out = []
    for key in dict.fromkeys((r.op, r.mode, r.dtype, r.cols) for r in records):
        group = {r.impl: r for r in records if (r.op, r.mode, r.dtype, r.cols) == key
                 and r.time_us is not None}
        timed = [(group[i].time_us, i) for i in KERNEL_IMPLS if i in group]
        if "auto" in group and timed:
            best_us, best = min(timed)
            out.append((*key, best, best_us, group["auto"].time_us, group["auto"].time_us / best_us))
    return out


def format_auto_summary(records: list[Record]) -> str:
    rows = auto_vs_best(records)
    if not rows:
        return ""
    w = max(10, *(len(r[0]) for r in rows))  # op column
    lines = ["", "automatic choice vs the fastest of cuda/pallas/xla in this run "
                 "(auto/best <= 1.05 is the target)",
             f"{'op':<{w}} {'mode':<8} {'dtype':<5} {'cols':>6} {'best':>7} {'best us':>9} "
             f"{'auto us':>9} {'auto/best':>9}"]
    for op, mode, dtype, cols, best, best_us, auto_us, ratio in rows:
        flag = "" if ratio <= 1.05 else "  > 5%"
        lines.append(f"{op:<{w}} {mode:<8} {dtype:<5} {cols:>6} {best:>7} {best_us:>9.1f} "
                     f"{auto_us:>9.1f} {ratio:>9.3f}{flag}")
    worst = max(r[-1] for r in rows)
    lines.append(f"worst auto/best: {worst:.3f}; within 5%: "
                 f"{sum(r[-1] <= 1.05 for r in rows)}/{len(rows)} shapes")
    return "\n".join(lines)


MASK_TARGET = 1.15     # masked / unmasked softmax time, same impl
XLA_SPEEDUP_TARGET = 1.5  # softmax fwd_bwd: xla time / our kernels' time
OUR_IMPLS = ("cuda", "pallas", "auto")  # what the xla-speedup target is about
MASKED_TARGET_IMPLS = ("cuda", "pallas", "xla", "auto")  # and the masked/unmasked one


def _timed(records: list[Record]) -> dict[tuple, float]:
    """(op, mode, dtype, cols, impl) -> median us, the timed records (no copy ceiling)."""
    return {(r.op, r.mode, r.dtype, r.cols, r.impl): r.time_us for r in records
            if r.time_us is not None and r.impl != "copy"}


def _ratio_table(title: str, rows: list[tuple], impls: list[str], ref_head: str,
                 flag: Callable) -> list[str]:
    """rows: (op, mode, dtype, cols, ref us, {impl: ratio}); flag(mode, impl, ratio) -> bool
    marks a cell with "*"."""
    w = max(10, *(len(r[0]) for r in rows))
    lines = ["", title, f"{'op':<{w}} {'mode':<8} {'dtype':<5} {'cols':>6} {ref_head:>9} "
             + " ".join(f"{i:>8}" for i in impls)]
    for op, mode, dtype, cols, ref_us, ratios in rows:
        cells = [(f"{ratios[i]:.3f}" + ("*" if flag(mode, i, ratios[i]) else " ")).rjust(8)
                 if i in ratios else f"{'-':>7} " for i in impls]
        lines.append(f"{op:<{w}} {mode:<8} {dtype:<5} {cols:>6} {ref_us:>9.1f} " + " ".join(cells))
    return lines


def masked_vs_unmasked(records: list[Record]) -> list[tuple]:
    """(op, mode, dtype, cols, unmasked xla us (nan if xla did not run), {impl: masked us /
    unmasked us}) per masked-variant shape (softmax_mask, softmax_causal) whose unmasked
    op (softmax) ran in the same run for the same impl."""
    timed = _timed(records)
    out = []
    for op, mode, dtype, cols in dict.fromkeys(k[:4] for k in timed):
        plain = SPECS[op].unmasked
        if plain is None:
            continue
        ratios = {impl: us / timed[(plain, mode, dtype, cols, impl)]
                  for (o, m, d, c, impl), us in timed.items()
                  if (o, m, d, c) == (op, mode, dtype, cols)
                  and (plain, mode, dtype, cols, impl) in timed}
        if ratios:
            ref = timed.get((plain, mode, dtype, cols, "xla"))
            out.append((op, mode, dtype, cols, ref if ref is not None else math.nan, ratios))
    return out


def format_masked_summary(records: list[Record], impls: Sequence[str]) -> str:
    """Masked / unmasked softmax time per impl (softmax_mask, softmax_causal vs softmax)."""
    rows = masked_vs_unmasked(records)
    if not rows:
        return ""
    impls = [i for i in impls if any(i in r[-1] for r in rows)]
    lines = _ratio_table(
        f"masked / unmasked softmax time, same impl, mode, dtype and cols (target <= "
        f"{MASK_TARGET} for {'/'.join(MASKED_TARGET_IMPLS)}; * above); xla us: unmasked "
        f"softmax, xla", rows, impls, "xla us",
        lambda mode, impl, ratio: impl in MASKED_TARGET_IMPLS and ratio > MASK_TARGET)
    worst = []
    for i in impls:
        vals = [r[-1][i] for r in rows if i in r[-1]]
        if i not in MASKED_TARGET_IMPLS:
            continue
        worst.append(f"{i} {max(vals):.3f} ({sum(v <= MASK_TARGET for v in vals)}/{len(vals)} "
                     f"<= {MASK_TARGET})")
    lines.append("worst masked/unmasked: " + ", ".join(worst))
    return "\n".join(lines)


def speedup_over_xla(records: list[Record]) -> list[tuple]:
    """(op, mode, dtype, cols, xla us, {impl: xla us / impl us}) for the ops with
    xla_summary (softmax, log_softmax), per shape where xla ran."""
    timed = _timed(records)
    out = []
    for op, mode, dtype, cols in dict.fromkeys(k[:4] for k in timed):
        xla = timed.get((op, mode, dtype, cols, "xla"))
        if not SPECS[op].xla_summary or xla is None:
            continue
        ratios = {impl: xla / us for (o, m, d, c, impl), us in timed.items()
                  if (o, m, d, c) == (op, mode, dtype, cols) and impl != "xla"}
        if ratios:
            out.append((op, mode, dtype, cols, xla, ratios))
    return out


def format_xla_summary(records: list[Record], impls: Sequence[str]) -> str:
    """Speedup over xla of every impl on softmax / log_softmax."""
    rows = speedup_over_xla(records)
    if not rows:
        return ""
    impls = [i for i in impls if any(i in r[-1] for r in rows)]
    lines = _ratio_table(
        f"speedup over xla: xla time / impl time (target: fwd_bwd >= {XLA_SPEEDUP_TARGET} "
        f"for {'/'.join(OUR_IMPLS)}; * below)", rows, impls, "xla us",
        lambda mode, impl, s: mode == "fwd_bwd" and impl in OUR_IMPLS and s < XLA_SPEEDUP_TARGET)
    counts = []
    for i in impls:
        vals = [r[-1][i] for r in rows if r[1] == "fwd_bwd" and i in r[-1]]
        if vals and i in OUR_IMPLS:
            counts.append(f"{i} {sum(v >= XLA_SPEEDUP_TARGET for v in vals)}/{len(vals)} "
                          f"(min {min(vals):.3f})")
    if counts:
        lines.append(f"fwd_bwd >= {XLA_SPEEDUP_TARGET}x xla: " + ", ".join(counts))
    return "\n".join(lines)


def write_table(path: Path, meta: dict, records: list[Record]) -> Path:
    """Merges this run's fwd/bwd times of cuda/pallas/xla into dispatch table `path`.

    Each op writes the stages of its spec's table_stages: the norms fwd, bwd and the
    derived fwd_stats; softmax and log_softmax fwd and bwd (their training forward is
    the inference forward); softmax_mask its fwd as softmax's "fwd_mask" stage (the
    choice for masked and causal calls; their backward is the unmasked one);
    softmax_causal nothing (benchmarked for the masked / unmasked ratio)."""
    table = {"device_kind": meta["device_kind"], "entries": []}
    if path.exists():
        table = json.loads(path.read_text())
        if table.get("device_kind") != meta["device_kind"]:
            raise SystemExit(f"--table {path} is for {table.get('device_kind')!r}, "
                             f"this run is on {meta['device_kind']!r}")
    new = {}
    for r in records:  # the stages are the fwd and bwd modes; fwd_bwd is their sum
        if r.impl not in KERNEL_IMPLS or r.time_us is None:
            continue
        dtype = jnp.dtype(DTYPES[r.dtype]).name
        if r.mode in ("fwd", "bwd") and r.mode in SPECS[r.op].table_stages:
            new.setdefault((r.op, r.mode, dtype, r.rows, r.cols), {})[r.impl] = round(r.time_us, 3)
        alias = SPECS[r.op].table_alias
        if alias is not None and r.mode == "fwd":  # the masked forward of the softmax kernels
            new.setdefault((*alias, dtype, r.rows, r.cols), {})[r.impl] = round(r.time_us, 3)
    # The training forward (writes mean/rstd too) is what fwd_bwd adds to bwd. For xla
    # that difference is only real next to xla's own backward: XLA fuses its forward and
    # backward across the stages (seen on the H200: rms_norm 8192, xla fwd_bwd - bwd =
    # 406 us, but 666 us next to the Pallas backward). So xla gets a training-forward
    # time only where it also has the fastest backward.
    timed = {(r.op, r.mode, r.dtype, r.rows, r.cols, r.impl): r.time_us for r in records
             if r.time_us is not None and r.impl in KERNEL_IMPLS}
    fastest_bwd = {}
    for (op, mode, dtype, rows, cols, impl), us in timed.items():
        shape = (op, dtype, rows, cols)
        if mode == "bwd" and us < timed.get((op, mode, dtype, rows, cols, fastest_bwd.get(shape)), math.inf):
            fastest_bwd[shape] = impl
    for (op, mode, dtype, rows, cols, impl), us in timed.items():
        if "fwd_stats" not in SPECS[op].table_stages:
            continue
        bwd = timed.get((op, "bwd", dtype, rows, cols, impl))
        if mode != "fwd_bwd" or bwd is None or us <= bwd:
            continue
        if impl == "xla" and fastest_bwd[(op, dtype, rows, cols)] != "xla":
            continue
        key = (op, "fwd_stats", jnp.dtype(DTYPES[dtype]).name, rows, cols)
        new.setdefault(key, {})[impl] = round(us - bwd, 3)
    entries = {(e["op"], e["stage"], e["dtype"], e["rows"], e["cols"]): e["us"]
               for e in table["entries"]}
    entries.update(new)
    table.update(
        command=meta["command"], date=meta["date"], git_commit=meta["git_commit"],
        jax_version=meta["jax_version"], timer=meta["timer"],
        note="median kernel time per call (us) of each implementation; written by "
             "jax_ops.bench --table, read by jax_ops/dispatch.py",
        entries=[{"op": k[0], "stage": k[1], "dtype": k[2], "rows": k[3], "cols": k[4], "us": v}
                 for k, v in sorted(entries.items())])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return path


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str | None:
    """The JAX_OPS_COMMIT environment variable where set (a copy of the tree on the GPU
    machine, whose .git, if any, is stale); else HEAD's commit, with "+dirty" when
    tracked files differ from it."""
    if os.environ.get("JAX_OPS_COMMIT"):
        return os.environ["JAX_OPS_COMMIT"]
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return os.environ.get("JAX_OPS_COMMIT")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return commit


def metadata(cfg, argv: Sequence[str]) -> dict:
    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "git_commit": git_commit(),
        "command": shlex.join(["python", "-m", "jax_ops.bench", *argv]),
        "python": sys.version.split()[0],
        "flax_version": _flax_version(),
        "timer": cfg.timer,
        "repeats": cfg.repeats,
        "footprint_mb": cfg.footprint_mb,
        "baseline": cfg.baseline,
        "epsilon": {op: SPECS[op].epsilon for op in cfg.ops if SPECS[op].epsilon is not None},
        **_views(cfg),
    }


def _views(cfg) -> dict:
    """{"views": {op: {cols: [B, Q, cols]}}} for the ops that view x as (B, Q, cols)."""
    views = {op: {str(c): [cfg.rows // view_len(cfg.rows, c, SPECS[op].view_cap),
                           view_len(cfg.rows, c, SPECS[op].view_cap), c] for c in cfg.cols}
             for op in cfg.ops if SPECS[op].view_cap is not None}
    return {"views": views} if views else {}


def _flax_version() -> str | None:
    if not flax_available():
        return None
    import flax
    return getattr(flax, "__version__", None)


def default_json_path(op: str, device_kind: str) -> Path:
    device = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "device"
    date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("benchmarks") / "results" / f"{op}_{device}_{date}.json"


def write_json(path: Path, meta: dict, records: list[Record]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"metadata": meta,
                                "records": [dataclasses.asdict(r) for r in records]}, indent=1))


def write_csv(path: Path, records: list[Record]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [f.name for f in dataclasses.fields(Record) if f.name != "times_us"]
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=names, extrasaction="ignore")
        w.writeheader()
        for r in records:
            w.writerow(dataclasses.asdict(r))


# ------------------------------------------------------------------- CLI ----

def _list(choices: Sequence[str] | None = None, kind=str):
    def parse(text: str):
        items = [kind(t) for t in text.split(",") if t.strip()]
        bad = [t for t in items if choices is not None and t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma list of {list(choices or [])}; "
                                             f"got {text!r}")
        return items
    return parse


def parse_args(argv: Sequence[str] | None):
    p = argparse.ArgumentParser(prog="python -m jax_ops.bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", type=_list(OPS), default=["layer_norm"],
                   help=", ".join(OPS) + " (default layer_norm)")
    p.add_argument("--impl", type=_list(IMPLS), default=None,
                   help="default: cuda,xla,flax (jnp when flax is missing)")
    p.add_argument("--dtype", type=_list(tuple(DTYPES)), default=["bf16"], help="bf16, f32, f16")
    p.add_argument("--rows", type=int, default=None, help="default 49152 on GPU, 4096 on CPU")
    p.add_argument("--cols", type=_list(kind=int), default=None,
                   help="comma list; default 32..32768 on GPU, 32,128,512,1024,4096 on CPU")
    p.add_argument("--mode", type=_list(MODES), default=["fwd", "fwd_bwd"],
                   help="fwd, fwd_bwd, bwd (default fwd,fwd_bwd)")
    p.add_argument("--repeats", type=int, default=5, help="measurements per point (default 5)")
    p.add_argument("--check", action="store_true",
                   help="compare every impl with xla on the first input set before timing")
    p.add_argument("--json", nargs="?", const="", default=None, metavar="PATH",
                   help="write JSON; without PATH: benchmarks/results/<op>_<device>_<date>.json")
    p.add_argument("--csv", default=None, metavar="PATH", help="also write CSV")
    p.add_argument("--timer", choices=("auto", "cupti", "wall"), default="auto",
                   help="auto: cupti on GPU, wall clock elsewhere")
    p.add_argument("--footprint-mb", type=int, default=None,
                   help="min bytes touched per measured call (K sets); default 512 GPU, 32 CPU")
    p.add_argument("--max-mem-gb", type=float, default=20.0,
                   help="cap of K * min_bytes (default 20)")
    p.add_argument("--max-sets", type=int, default=256, help="cap of K (compile time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", default=None, metavar="PATH",
                   help="write (merge into) a dispatch table: the fwd and bwd times of "
                        "cuda/pallas/xla per shape, as jax_ops/tables/<gpu>.json expects")
    cfg = p.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    cfg.rows = cfg.rows or defaults["rows"]
    cfg.cols = cfg.cols or list(defaults["cols"])
    cfg.footprint_mb = cfg.footprint_mb or defaults["footprint_mb"]
    if cfg.timer == "auto":
        cfg.timer = "cupti" if on_gpu else "wall"
    if cfg.repeats < 1 or cfg.rows < 1 or any(c < 1 for c in cfg.cols):
        p.error("--repeats, --rows and --cols must be positive")
    cfg.impls = resolve_impls(cfg.impl, on_gpu)
    cfg.baseline = "flax" if "flax" in cfg.impls else "jnp" if "jnp" in cfg.impls else None
    cfg.ops = cfg.op
    cfg.dtypes = cfg.dtype
    cfg.modes = cfg.mode
    return cfg


def resolve_impls(asked: list[str] | None, on_gpu: bool = True) -> list[str]:
    """The asked implementations (default cuda, pallas (GPU only), xla, auto, flax);
    flax -> jnp when missing."""
    default = ["cuda", "pallas", "xla", "auto", "flax"] if on_gpu else ["cuda", "xla", "auto", "flax"]
    impls = list(asked or default)
    if "flax" in impls and not flax_available():
        log("flax is not importable: using the plain jax.numpy autodiff reference 'jnp' instead")
        impls = [i for i in impls if i != "flax"] + ([] if "jnp" in impls else ["jnp"])
    return list(dict.fromkeys(impls))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_args(argv)
    timer = TIMERS[cfg.timer]
    meta = metadata(cfg, argv)
    log(f"jax {meta['jax_version']} on {meta['device_kind']} ({meta['platform']}), timer "
        f"{cfg.timer}, impls {cfg.impls}, rows {cfg.rows}, cols {cfg.cols}")

    records: list[Record] = []
    for op in cfg.ops:
        for dtype_name in cfg.dtypes:
            for cols in cfg.cols:
                records += bench_shape(cfg, op, dtype_name, cols, timer)

    print(format_tables(records, cfg.impls, cfg.baseline, meta))
    if "auto" in cfg.impls:
        print(format_auto_summary(records))
    for summary in (format_masked_summary(records, cfg.impls),
                    format_xla_summary(records, cfg.impls)):
        if summary:
            print(summary)
    if cfg.table:
        path = write_table(Path(cfg.table), meta, records)
        log(f"wrote dispatch table {path}")
    if cfg.json is not None:
        path = Path(cfg.json) if cfg.json else default_json_path("-".join(cfg.ops),
                                                                 meta["device_kind"])
        write_json(path, meta, records)
        log(f"wrote {path}")
    if cfg.csv:
        write_csv(Path(cfg.csv), records)
        log(f"wrote {cfg.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
