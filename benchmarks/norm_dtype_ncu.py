"""The cuda LayerNorm / RMSNorm forward at COLS (4096) in bfloat16 and float16, each run
twice after a warm-up, for ncu to compare the two dtypes' memory traffic and issue.
Environment: ROWS (49152), COLS."""
import os

import jax
import jax.numpy as jnp

import jax_ops

ROWS, COLS = int(os.environ.get("ROWS", 49152)), int(os.environ.get("COLS", 4096))
s32 = 1.0 + 0.1 * jax.random.normal(jax.random.key(7), (COLS,))
b32 = 0.1 * jax.random.normal(jax.random.key(8), (COLS,))
ln = jax.jit(lambda x, s, b: jax_ops.layer_norm(x, s, b, implementation="cuda"))
for dt in (jnp.bfloat16, jnp.float16):
    x = jax.random.normal(jax.random.key(0), (ROWS, COLS), dt)
    for _ in range(3):
        jax.block_until_ready(ln(x, s32, b32))
    print(f"{jnp.dtype(dt).name}: done", flush=True)
