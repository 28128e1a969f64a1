"""Runs our relu/add_relu and BatchNorm(+Add)+ReLU kernels (IMPL=cuda, the default, or
IMPL=pallas) forward and backward on boundary sizes (element counts around the 32-bit
mask word and the 16-byte vector, channels 1, 3, 32, 33, 2048); meant to run under
compute-sanitizer (memcheck/racecheck) on the GPU too. Compares every output and
gradient with the xla implementation (float32 math both) and the masks bit for bit."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_ops
from jax_ops.ops.relu import FWD as RELU_FWD

SIZES = [int(c) for c in sys.argv[1].split(",")] if len(sys.argv) > 1 else [
    1, 2, 3, 31, 32, 33, 255, 1000, 4099, 65537, 1 << 20]
CHANNELS = [int(c) for c in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 3, 32, 33, 256, 2048]
IMPL = os.environ.get("IMPL", "cuda")


def rel_err(g, r):
    g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
    if g.shape != r.shape or not np.isfinite(g).all():
        return np.inf
    return np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30) if r.size else 0.0


def run(impl, fn, args, dy):
    out, vjp = jax.vjp(lambda *a: fn(*a, implementation=impl), *args)
    return jax.tree_util.tree_leaves((out, vjp(dy)))


worst, mask_errors = 0.0, 0
for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    name = jnp.dtype(dtype).name
    for n in SIZES:
        k = jax.random.split(jax.random.key(n), 3)
        x, z, dy = (jax.random.normal(kk, (n,), dtype) for kk in k)
        for op, fn, args in (("relu", jax_ops.relu, (x,)), ("add_relu", jax_ops.add_relu, (x, z))):
            got, ref = run(IMPL, fn, args, dy), run("xla", fn, args, dy)
            for g, r in zip(got, ref):
                worst = max(worst, rel_err(g, r))
            m1 = RELU_FWD.call(x, args[-1] if op == "add_relu" else None, implementation=IMPL)[1]
            m2 = RELU_FWD.call(x, args[-1] if op == "add_relu" else None, implementation="xla")[1]
            if not np.array_equal(np.asarray(m1), np.asarray(m2)):
                mask_errors += 1
                print(f"MASK MISMATCH {op} {name} n={n}")
    for c in CHANNELS:
        rows = max(1, min(4099, (1 << 18) // c))
        k = jax.random.split(jax.random.key(c), 5)
        x = (jax.random.normal(k[0], (rows, c)) + 0.3).astype(dtype)
        z = jax.random.normal(k[1], (rows, c), dtype)
        dy = jax.random.normal(k[2], (rows, c), dtype)
        s = 1 + 0.2 * jax.random.normal(k[3], (c,))
        b = 0.2 * jax.random.normal(k[4], (c,))
        cases = [("bn_relu", lambda x, s, b, **kw: jax_ops.batch_norm_relu(x, s, b, **kw)[0], (x, s, b)),
                 ("bn_add_relu", lambda x, z, s, b, **kw: jax_ops.batch_norm_add_relu(x, z, s, b, **kw)[0], (x, z, s, b)),
                 ("bn_relu infer", lambda x, s, b, **kw: jax_ops.batch_norm_relu(
                     x, s, b, training=False, mean=0.1 * s, var=s * s, **kw), (x, s, b))]
        for op, fn, args in cases:
            got, ref = run(IMPL, fn, args, dy), run("xla", fn, args, dy)
            for what, g, r in zip(("y", "dx", "dz/dscale", "...", "..."), got, ref):
                err = rel_err(g, r)
                if err > 2e-2:
                    print(f"MISMATCH {op} {name} (rows, C)=({rows}, {c}) {what}: rel err {err:.2e}")
                worst = max(worst, err)
print(f"sanitize_relu_bn {IMPL}: worst rel err vs xla {worst:.2e}, mask mismatches {mask_errors}")
assert worst < 2e-2 and mask_errors == 0, (worst, mask_errors)
