"""The LayerNorm (or OP=rms_norm: RMSNorm) cuda backward (bf16 x, float32 scale and bias;
49152 rows, ROWS in the environment) at the given widths, run twice each, for a profiler
(ncu) to read where the group tier's time goes.
Usage: python3 benchmarks/norm_bwd_ncu.py [COLS,...] (default 256)."""
import os
import sys

import jax
import jax.numpy as jnp

import jax_ops

ROWS = int(os.environ.get("ROWS", 49152))
RMS = os.environ.get("OP", "layer_norm") == "rms_norm"


def norm(x, s, b):
    if RMS:
        return jax_ops.rms_norm(x, s, implementation="cuda")
    return jax_ops.layer_norm(x, s, b, implementation="cuda")


for cols in [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "256").split(",")]:
    k = jax.random.split(jax.random.key(cols), 4)
    x = jax.random.normal(k[0], (ROWS, cols), jnp.bfloat16)
    dy = jax.random.normal(k[1], (ROWS, cols), jnp.bfloat16)
    s = jax.random.uniform(k[2], (cols,), minval=0.5, maxval=1.5)
    b = jax.random.normal(k[3], (cols,))
    y, vjp = jax.vjp(norm, x, s, b)
    bwd = jax.jit(lambda dy: vjp(dy))
    for _ in range(2):
        jax.block_until_ready(bwd(dy))
    print(f"cols {cols}: done", flush=True)
