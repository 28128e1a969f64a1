"""Runs each norm's jitted value-and-grad with the cuda implementation at the shapes given
(ROWSxCOLS,...; bf16) and prints ok or the error: a probe for launch errors that only
some shapes raise. Usage: python3 benchmarks/probe_norm_errors.py 49152x12288,301x12288"""
import sys

import jax
import jax.numpy as jnp

import jax_ops

OPS = {
    "layer_norm": lambda x, r, s, b: jax_ops.layer_norm(x, s, b, implementation="cuda"),
    "rms_norm": lambda x, r, s, b: jax_ops.rms_norm(x, s, implementation="cuda"),
    "add_layer_norm": lambda x, r, s, b: jax_ops.add_layer_norm(x, r, s, b, implementation="cuda")[0],
    "add_rms_norm": lambda x, r, s, b: jax_ops.add_rms_norm(x, r, s, implementation="cuda")[0],
}
for shape in sys.argv[1].split(","):
    rows, cols = (int(v) for v in shape.split("x"))
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (rows, cols), jnp.bfloat16)
    r = jax.random.normal(k[1], (rows, cols), jnp.bfloat16)
    s = jnp.ones((cols,), jnp.float32)
    b = jnp.zeros((cols,), jnp.float32)
    for name, f in OPS.items():
        for mode in ("fwd", "grad"):
            g = jax.jit(f) if mode == "fwd" else jax.jit(jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), (0, 2)))
            try:
                jax.block_until_ready(g(x, r, s, b))
                print(f"{name} {mode} {rows}x{cols}: ok", flush=True)
            except Exception as e:  # the probe reports every failure and goes on
                print(f"{name} {mode} {rows}x{cols}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
