"""Where the LayerNorm forward's long-row time goes: the cuda forward at 8192-32768
bf16 columns with float32 scale and bias (the benchmark's case), bf16 ones, and none;
RMSNorm with and without its scale. CUPTI, inputs rotated past L2, median of 5.
Environment: ROWS (49152), COLS (a comma list; 8192,16384,32768)."""
import os

import jax
import jax.numpy as jnp

import jax_ops
from jax_ops.bench.timing import measure

ROWS = int(os.environ.get("ROWS", 49152))
for cols in [int(c) for c in os.environ.get("COLS", "8192,16384,32768").split(",")]:
    k = 3
    xs = [jax.random.normal(jax.random.key(i), (ROWS, cols), jnp.bfloat16) for i in range(k)]
    s32 = jax.random.uniform(jax.random.key(7), (cols,), minval=0.5, maxval=1.5)
    b32 = jax.random.normal(jax.random.key(8), (cols,))
    cases = {
        "LN f32 params": (lambda x, s, b: jax_ops.layer_norm(x, s, b, implementation="cuda"), (s32, b32)),
        "LN bf16 params": (lambda x, s, b: jax_ops.layer_norm(x, s, b, implementation="cuda"),
                           (s32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16))),
        "LN no params": (lambda x: jax_ops.layer_norm(x, None, None, implementation="cuda"), ()),
        "RMS f32 scale": (lambda x, s: jax_ops.rms_norm(x, s, implementation="cuda"), (s32,)),
        "RMS no scale": (lambda x: jax_ops.rms_norm(x, None, implementation="cuda"), ()),
        "negate (XLA)": (lambda x: -x, ()),
    }
    for name, (fn, params) in cases.items():
        us = measure(fn, sets=[(x, *params) for x in xs])
        gbs = 2 * ROWS * cols * 2 / us * 1e-3
        print(f"cols {cols:6d} {name:15s} {us:8.1f} us  {gbs:7.1f} GB/s", flush=True)
    del xs
