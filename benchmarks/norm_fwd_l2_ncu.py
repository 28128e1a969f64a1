"""At 4096 x 65536 bf16 with float32 scale and bias: XLA's `x * scale + bias` fusion, or
(WHAT=layer_norm / rms_norm) our cuda forward, run twice, for ncu to compare where the
parameters' bytes come from (L1 hits against L2 traffic).
Usage: WHAT=xla|layer_norm|rms_norm python3 benchmarks/norm_fwd_l2_ncu.py"""
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_ops

ROWS, COLS = int(os.environ.get("ROWS", 4096)), 65536
WHAT = os.environ.get("WHAT", "xla")
# Inputs made on the host: the only kernels launched are f's (launch 1 is its second call).
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((ROWS, COLS), np.float32).astype(jnp.bfloat16))
s = jnp.asarray(1 + 0.1 * rng.standard_normal(COLS, np.float32))
b = jnp.asarray(0.1 * rng.standard_normal(COLS, np.float32))
if WHAT == "xla":
    f = jax.jit(lambda x, s, b: (x.astype(jnp.float32) * s + b).astype(jnp.bfloat16))
elif WHAT == "layer_norm":
    f = jax.jit(lambda x, s, b: jax_ops.layer_norm(x, s, b, implementation="cuda"))
else:
    f = jax.jit(lambda x, s, b: jax_ops.rms_norm(x, s, implementation="cuda"))
for _ in range(2):
    jax.block_until_ready(f(x, s, b))
print(f"{WHAT}: done", flush=True)
