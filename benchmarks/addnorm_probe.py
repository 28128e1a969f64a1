"""One call each of the cuda add+norm forward and backward at (ROWS, COLS) bf16, and the
LayerNorm forward at 16384 columns with float32 / no parameters: the kernels that
`benchmarks/gpu_addnorm.sh` hands to Nsight Compute (registers, occupancy, L1 and DRAM
throughput). Env COLS (comma list), ROWS."""
import os

import jax
import jax.numpy as jnp

import jax_ops

ROWS = int(os.environ.get("ROWS", 49152))
for cols in map(int, os.environ.get("COLS", "4096").split(",")):
    ks = jax.random.split(jax.random.key(cols), 4)
    x, r = (jax.random.normal(k, (ROWS, cols), jnp.bfloat16) for k in ks[:2])
    s = jax.random.uniform(ks[2], (cols,), minval=0.5, maxval=1.5)
    b = jax.random.normal(ks[3], (cols,))

    def loss(x, r, s, b):
        y, h = jax_ops.add_layer_norm(x, r, s, b, implementation="cuda")
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(h.astype(jnp.float32) ** 2)

    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, r, s, b))
    jax.block_until_ready(jax.jit(lambda x, s, b: jax_ops.layer_norm(x, s, b, implementation="cuda"))(x, s, b))
    jax.block_until_ready(jax.jit(lambda x: jax_ops.layer_norm(x, None, None, implementation="cuda"))(x))
    print("done", cols, flush=True)
