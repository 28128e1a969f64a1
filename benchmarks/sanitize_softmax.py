"""Runs our softmax/log_softmax kernels (IMPL=cuda, the default, or IMPL=pallas) on boundary
shapes, plain, masked (bool key padding, additive broadcast) and causal, forward and
backward; meant to run under compute-sanitizer (memcheck/racecheck) on the GPU too.
Compares with the xla implementation (float32 math both)."""
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_ops

COLS = [int(c) for c in sys.argv[1].split(",")] if len(sys.argv) > 1 else [
    1, 2, 3, 31, 32, 33, 127, 129, 1000, 1024, 1025, 2048, 4096, 5000, 8192, 8193, 16384,
    16385, 32768, 65536]
IMPL = os.environ.get("IMPL", "cuda")
# QUICK=1 (for racecheck, where every XLA compile crawls): bfloat16, plain and bool mask only
QUICK = os.environ.get("QUICK") == "1"
# Narrower runs under the sanitizers: DTYPES=bf16,f32 and CASES="plain,causal" (names below)
DTYPES = os.environ.get("DTYPES", "bf16" if QUICK else "f32,bf16").split(",")
CASES = os.environ.get("CASES", "plain,bool mask" if QUICK else "")
VERBOSE = os.environ.get("VERBOSE") == "1"  # a line per case (to see how far a slow run got)
if IMPL == "pallas":
    from pallas_kernels.softmax import MAX_COLS
    COLS = [c for c in COLS if c <= MAX_COLS]


def run(impl, fn, x, dy, kw):
    y, vjp = jax.vjp(lambda x: fn(x, implementation=impl, **kw), x)
    return [np.asarray(t, np.float64) for t in (y, *vjp(dy))]


def rel_err(g, r):
    fin = np.isfinite(r)
    if (np.isfinite(g) != fin).any() or (g[~fin] != r[~fin]).any():
        return np.inf  # -inf (or 0) exactly where the reference has it
    g, r = g[fin], r[fin]
    return np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30) if r.size else 0.0


worst = 0.0
for cols in COLS:
    rows = 4 if cols > 8192 else 24
    q = 4
    for dtype in [{"f32": jnp.float32, "bf16": jnp.bfloat16}[d] for d in DTYPES]:
        k = jax.random.split(jax.random.key(cols), 4)
        x = (jax.random.normal(k[0], (rows // q, q, cols)) * 3).astype(dtype)
        dy = jax.random.normal(k[1], x.shape).astype(dtype)
        pad = jax.random.bernoulli(k[2], 0.8, (rows // q, 1, cols)).at[0].set(False)  # a fully masked batch
        bias = jnp.where(jax.random.bernoulli(k[3], 0.9, (q, cols)), 0.5, -jnp.inf)
        cases = {"plain": {}, "scaled": {"scale": 0.125}, "bool mask": {"mask": pad},
                 "additive mask": {"mask": bias}, "causal": {"causal": True}}
        if CASES:
            cases = {k: cases[k] for k in CASES.split(",")}
        for name, kw in cases.items():
            for fn in (jax_ops.softmax, jax_ops.log_softmax):
                t0 = time.time()
                got, ref = run(IMPL, fn, x, dy, kw), run("xla", fn, x, dy, kw)
                if VERBOSE:
                    print(f"{fn.__name__} {name} {jnp.dtype(dtype).name} {x.shape}: "
                          f"{time.time() - t0:.1f} s", flush=True)
                for what, g, r in zip(("y", "dx"), got, ref):
                    err = rel_err(g, r)
                    if err > 2e-2:
                        print(f"MISMATCH {fn.__name__} {name} {jnp.dtype(dtype).name} "
                              f"shape={x.shape} {what}: rel err {err:.2e}")
                    worst = max(worst, err)
print(f"sanitize_softmax {IMPL}: {len(COLS)} cols values done, worst rel err vs xla {worst:.2e}")
assert worst < 2e-2, worst
