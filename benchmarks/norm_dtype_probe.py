"""Why the cuda LayerNorm forward runs bfloat16 slower than float16 on the H200 at
2048-8192 columns (4096: 251 against 202 µs, same SASS but the conversions): the kernel
timed on bfloat16 and float16 rows, each with its own normal values and with the other
dtype's bits (the same bit patterns under the other dtype), so that a data effect and a
dtype effect come apart. CUPTI, inputs rotated past L2, median.
Environment: ROWS (49152), COLS (2048,4096,8192)."""
import os

import jax
import jax.numpy as jnp

import jax_ops
from jax_ops.bench.timing import measure

ROWS = int(os.environ.get("ROWS", 49152))
OTHER = {jnp.bfloat16: jnp.float16, jnp.float16: jnp.bfloat16}
for cols in [int(c) for c in os.environ.get("COLS", "2048,4096,8192").split(",")]:
    s32 = 1.0 + 0.1 * jax.random.normal(jax.random.key(7), (cols,))
    b32 = 0.1 * jax.random.normal(jax.random.key(8), (cols,))
    for dt in (jnp.bfloat16, jnp.float16):
        native = [jax.random.normal(jax.random.key(i), (ROWS, cols), dt) for i in range(3)]
        # The other dtype's normal values, bit for bit, read as dt (finite in both).
        foreign = [jax.lax.bitcast_convert_type(jax.random.normal(jax.random.key(i), (ROWS, cols), OTHER[dt]), dt)
                   for i in range(3)]
        zeros = [jnp.zeros((ROWS, cols), dt) + i for i in range(3)]
        for data_name, xs in (("own normal", native), ("other's bits", foreign), ("constant", zeros)):
            cases = {
                "LN": (lambda x, s, b: jax_ops.layer_norm(x, s, b, implementation="cuda"), (s32, b32)),
                "RMS": (lambda x, s: jax_ops.rms_norm(x, s, implementation="cuda"), (s32,)),
                "negate": (lambda x: -x, ()),
            }
            row = []
            for name, (fn, params) in cases.items():
                us = measure(fn, sets=[(x, *params) for x in xs])
                row.append(f"{name} {us:7.1f}")
            print(f"cols {cols:5d} {jnp.dtype(dt).name:8s} {data_name:12s} " + "  ".join(row) + "  (us)", flush=True)
        del native, foreign, zeros
