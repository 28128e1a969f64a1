"""Where linear_cross_entropy's time goes beyond its kernels (issue 21): for the unfused
h @ w + cross_entropy and the chunked linear_cross_entropy (chunks of 2048 and 4096 rows,
and 2048 with the chunk loop fully unrolled), the value_and_grad wall clock (median of
5 x 10 calls), the sum of its kernels' CUPTI times and their difference (idle GPU). Run
it under different XLA_FLAGS (command buffers on/off) to see whether the gap moves.

  python benchmarks/lce_gaps.py [out.json]
"""
import json
import os
import sys

import jax
from jax.experimental.mosaic.gpu import profiler

import jax_ops
from jax_ops.ops import cross_entropy as ce_mod

sys.path.insert(0, os.path.dirname(__file__))
from ce_step import timed  # noqa: E402
from lce_sweep import inputs  # noqa: E402


def kernels_ms(fn, args):
    """Total kernel ms, the kernel count, and ms per kernel name (first 60 characters)."""
    c = jax.jit(fn)
    _, per_kernel = profiler.measure(c, aggregate=False)(*args)
    by_name = {}
    for name, t in per_kernel:
        by_name[name[:60]] = by_name.get(name[:60], 0.0) + t
    return sum(t for _, t in per_kernel), len(per_kernel), by_name


def main():
    h, w, y = inputs(16384, 768, 50304)
    variants = {"unfused": (lambda h, w, y: jax_ops.cross_entropy(h @ w, y, reduction="mean"), 1)}
    for chunk, unroll in ((2048, 1), (2048, 8), (4096, 1)):
        variants[f"lce chunk={chunk} unroll={unroll}"] = (
            lambda h, w, y, c=chunk: jax_ops.linear_cross_entropy(h, w, y, reduction="mean", chunk_rows=c), unroll)
    rows = []
    for name, (f, unroll) in variants.items():
        ce_mod.LCE_SCAN_UNROLL = unroll
        vg = jax.value_and_grad(f, argnums=(0, 1))
        r = timed(vg, (h, w, y))
        k_ms, n, by_name = kernels_ms(vg, (h, w, y))
        rows.append(dict(variant=name, wall_ms=r["ms"], kernels_ms=k_ms, kernels=n, temp_mib=r["temp_mib"],
                         by_kernel=by_name))
        print(f"{name:28} wall {r['ms']:7.3f} ms  kernels {k_ms:7.3f} ms ({n:3d})  gap {r['ms'] - k_ms:6.3f} ms"
              f"  temp {r['temp_mib']:7.1f} MiB  XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
        for kname, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:6]:
            print(f"    {t:7.3f} ms  {kname}")
    ce_mod.LCE_SCAN_UNROLL = 1
    if len(sys.argv) > 1:
        json.dump(dict(device=jax.devices()[0].device_kind, xla_flags=os.environ.get("XLA_FLAGS", ""),
                       rows=rows), open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
