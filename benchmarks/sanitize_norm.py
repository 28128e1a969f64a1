"""Runs our LayerNorm/RMSNorm kernels (IMPL=cuda, the default, or IMPL=pallas) on boundary
shapes, and add+norm's with OPS (environment, a comma list of ln, rms, add_ln, add_rms;
default ln,rms); meant to run under compute-sanitizer (memcheck/racecheck) on the GPU. Compares
with the xla implementation. ROWS (environment) overrides the rows: more rows than the
GPU runs blocks at once make the sm_90 bulk tiers refill their stages. DTYPES (environment,
a comma list of float32, bfloat16, float16; default float32,bfloat16) the dtypes."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_ops

COLS = [int(c) for c in sys.argv[1].split(",")] if len(sys.argv) > 1 else [
    1, 2, 3, 31, 32, 33, 127, 129, 1000, 1024, 1025, 4096, 5000, 8192, 8193, 16384, 65536]


def run(impl, op, x, s, b, dy):
    if op.startswith("add_"):  # residual = dy, h's cotangent = x: both cotangents reach dx
        f = (lambda x, s, b: jax_ops.add_layer_norm(x, dy, s, b, implementation=impl)) if op == "add_ln" else \
            (lambda x, s, b: jax_ops.add_rms_norm(x, dy, s, implementation=impl))
        (y, h), vjp = jax.vjp(f, x, s, b)
        return [np.asarray(t, np.float64) for t in (y, *vjp((dy, x))) if t is not None]
    f = (lambda x, s, b: jax_ops.layer_norm(x, s, b, implementation=impl)) if op == "ln" else \
        (lambda x, s, b: jax_ops.rms_norm(x, s, implementation=impl))
    y, vjp = jax.vjp(f, x, s, b)
    return [np.asarray(t, np.float64) for t in (y, *vjp(dy)) if t is not None]


IMPL = os.environ.get("IMPL", "cuda")
if IMPL == "pallas":
    from pallas_kernels.layer_norm import MAX_COLS
    COLS = [c for c in COLS if c <= MAX_COLS]
worst = 0.0
for cols in COLS:
    for dtype in [jnp.dtype(d) for d in os.environ.get("DTYPES", "float32,bfloat16").split(",")]:
        for op in os.environ.get("OPS", "ln,rms").split(","):
            rows = int(os.environ.get("ROWS", 3 if cols > 8192 else 17))
            k = jax.random.split(jax.random.key(cols), 4)
            x = (jax.random.normal(k[0], (rows, cols)) * 2 + 1).astype(dtype)
            s = jax.random.uniform(k[1], (cols,), minval=0.5, maxval=1.5)
            b = jax.random.normal(k[2], (cols,))
            dy = jax.random.normal(k[3], (rows, cols)).astype(dtype)
            got, ref = run(IMPL, op, x, s, b, dy), run("xla", op, x, s, b, dy)
            for name, g, r in zip(("y", "dx", "dscale", "dbias"), got, ref):
                # floor: LayerNorm's dx over 1 column is 0 up to rounding
                err = np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-3 * np.sqrt(r.size))
                err = err if np.isfinite(err) else np.inf
                if err > 2e-2:
                    bad = np.argwhere(~np.isclose(g, r, rtol=5e-2, atol=5e-2))
                    print(f"MISMATCH {op} {jnp.dtype(dtype).name} rows={rows} cols={cols} {name}: "
                          f"rel err {err:.2e}; {len(bad)} bad elements, first {bad[:4].tolist()}")
                worst = max(worst, err)
print(f"sanitize_norm {IMPL}: {len(COLS)} cols values done, worst rel err vs xla {worst:.2e}")
assert worst < 2e-2, worst
