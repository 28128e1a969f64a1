"""One LayerNorm fwd+bwd (cuda) at ROWSxCOLS bf16, compared with xla; run in a subprocess
with a timeout to tell a hung kernel from a wrong one (knobs from the environment)."""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_ops

rows, cols = int(sys.argv[1]), int(sys.argv[2])
k = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(k[0], (rows, cols), jnp.bfloat16)
s = jax.random.uniform(k[1], (cols,), minval=0.5, maxval=1.5)
dy = jax.random.normal(k[2], (rows, cols), jnp.bfloat16)


def grads(impl):
    f = jax.jit(jax.grad(lambda x, s: jnp.sum(jax_ops.layer_norm(x, s, implementation=impl).astype(jnp.float32)
                                               * dy.astype(jnp.float32)), argnums=(0, 1)))
    return [np.asarray(t, np.float64) for t in jax.block_until_ready(f(x, s))]


got, ref = grads("cuda"), grads("xla")
print(rows, cols, "rel err dx %.2e dscale %.2e" % tuple(
    np.linalg.norm(g - r) / np.linalg.norm(r) for g, r in zip(got, ref)), flush=True)
