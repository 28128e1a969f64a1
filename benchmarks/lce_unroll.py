"""linear_cross_entropy (issue 21) with the chunk loop unrolled 1, 2, 4 or 8 chunks per
iteration (cross_entropy.LCE_SCAN_UNROLL), at the issue's shape (16384 x 768) @ (768 x 50304)
bf16, mean loss, value_and_grad wall clock (benchmarks/ce_step.timed: median of 5 x 10
calls) and XLA's temporary memory; the unfused h @ w + cross_entropy for reference."""
import json
import sys

import jax
import jax.numpy as jnp

import jax_ops
from jax_ops.ops import cross_entropy as ce_mod

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ce_step import timed  # noqa: E402
from lce_sweep import inputs  # noqa: E402

h, w, y = inputs(16384, 768, 50304)
rows = []
unfused = jax.value_and_grad(lambda h, w, y: jax_ops.cross_entropy(h @ w, y, reduction="mean"), argnums=(0, 1))
rows.append(dict(variant="unfused", **timed(unfused, (h, w, y))))
for chunk in (None, 4096):
    for unroll in (1, 2, 4, 8):
        ce_mod.LCE_SCAN_UNROLL = unroll
        f = jax.value_and_grad(lambda h, w, y: jax_ops.linear_cross_entropy(
            h, w, y, reduction="mean", chunk_rows=chunk), argnums=(0, 1))
        rows.append(dict(variant=f"lce chunk={chunk or 'default'} unroll={unroll}", **timed(f, (h, w, y))))
for r in rows:
    print(f"{r['variant']:32} {r['ms']:8.3f} ms {r['temp_mib']:9.1f} MiB")
if len(sys.argv) > 1:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), open(sys.argv[1], "w"), indent=1)
