"""The LayerNorm / RMSNorm cuda forward at long rows, each case run twice, for a profiler
(ncu) to read the block tier's memory traffic: LayerNorm with float32, bfloat16 and no
scale/bias, RMSNorm with a float32 scale. bf16 x, 49152 rows (ROWS in the environment).
Usage: python3 benchmarks/norm_fwd_ncu.py [COLS,...] (default 16384)."""
import os
import sys

import jax
import jax.numpy as jnp

import jax_ops

ROWS = int(os.environ.get("ROWS", 49152))
for cols in [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "16384").split(",")]:
    x = jax.random.normal(jax.random.key(0), (ROWS, cols), jnp.bfloat16)
    s32 = jax.random.uniform(jax.random.key(7), (cols,), minval=0.5, maxval=1.5)
    b32 = jax.random.normal(jax.random.key(8), (cols,))
    cases = [
        ("LN f32 params", jax.jit(lambda x, s, b: jax_ops.layer_norm(x, s, b, implementation="cuda")), (s32, b32)),
        ("LN bf16 params", jax.jit(lambda x, s, b: jax_ops.layer_norm(x, s, b, implementation="cuda")),
         (s32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16))),
        ("LN no params", jax.jit(lambda x: jax_ops.layer_norm(x, None, None, implementation="cuda")), ()),
        ("RMS f32 scale", jax.jit(lambda x, s: jax_ops.rms_norm(x, s, implementation="cuda")), (s32,)),
    ]
    for name, fn, params in cases:
        for _ in range(2):
            jax.block_until_ready(fn(x, *params))
        print(f"cols {cols} {name}: done", flush=True)
