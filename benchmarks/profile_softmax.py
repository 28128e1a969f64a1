"""One call each of the softmax kernels at a few shapes (bf16, rows 49152), for ncu:
    ncu --kernel-name regex:softmax --metrics ... python3 benchmarks/profile_softmax.py [cols,...] [impl]"""
import sys

import jax
import jax.numpy as jnp

import jax_ops

COLS = [int(c) for c in sys.argv[1].split(",")] if len(sys.argv) > 1 else [32, 1024, 4096]
IMPL = sys.argv[2] if len(sys.argv) > 2 else "cuda"
for cols in COLS:
    x = jax.random.normal(jax.random.key(cols), (49152, cols), jnp.bfloat16)
    for fn in (jax_ops.softmax, jax_ops.log_softmax):
        f = jax.jit(lambda x: jax.vjp(lambda x: fn(x, implementation=IMPL), x))
        y, vjp = f(x)
        jax.block_until_ready(jax.jit(vjp)(y))
print("done")
