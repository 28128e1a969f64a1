"""Pallas back ends compared on one GPU: the Triton-back-end forward kernels that ship
(pallas_kernels/layer_norm.py) against a Mosaic GPU forward, with our CUDA kernels and a
device copy of the same bytes as yardsticks.

The Mosaic GPU kernel lost (docs/design.md) and is not in the tree; to measure it again:
    git show f163b66:pallas_kernels/_mosaic_norm.py > pallas_kernels/_mosaic_norm.py
    python benchmarks/pallas_backends.py [--cols 256,1024,4096,8192] [--rows 49152]

Same timing as jax_ops.bench: CUPTI kernel time, K input sets per call (L2 can't hold
them), median of repeats. Checks each output against the xla implementation first.
"""
from __future__ import annotations

import argparse
import warnings

import jax
import jax.numpy as jnp

from jax_ops import bench
from jax_ops.layer_norm import _fwd_reference
from pallas_kernels import layer_norm as triton_norm

warnings.filterwarnings("ignore", category=DeprecationWarning)


def variants(op):
    rms = op == "rms_norm"
    eps = bench.EPSILON[op]

    def triton(x, *p):
        return triton_norm.norm_fwd(x, p[0], None if rms else p[1], epsilon=eps, rms=rms,
                                    with_stats=False)[0]

    def mosaic(x, *p):
        from pallas_kernels import _mosaic_norm
        return _mosaic_norm.norm_fwd_mosaic(x, p[0], None if rms else p[1], epsilon=eps, rms=rms,
                                            with_stats=False)[0]

    def cuda(x, *p):
        if rms:
            return bench.jax_ops.rms_norm(x, p[0], epsilon=eps, implementation="cuda")
        return bench.jax_ops.layer_norm(x, *p, epsilon=eps, implementation="cuda")

    def ref(x, *p):
        bias = jnp.zeros((0,), jnp.float32) if rms else p[1]
        return _fwd_reference(x, None, p[0], bias, epsilon=eps, rms=rms, with_stats=False)[0]

    return {"triton": triton, "mosaic": mosaic, "cuda": cuda, "xla": ref}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cols", default="256,1024,4096,8192")
    ap.add_argument("--rows", type=int, default=49152)
    ap.add_argument("--ops", default="layer_norm,rms_norm")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    timer = bench.TIMERS["cupti" if jax.default_backend() == "gpu" else "wall"]
    print(f"{'op':<10} {'cols':>6} | {'copy us':>8} | " +
          " | ".join(f"{n:>8} us  %copy  err" for n in ("triton", "mosaic", "cuda", "xla")))
    for op in a.ops.split(","):
        fns = variants(op)
        for cols in map(int, a.cols.split(",")):
            nbytes = bench.min_bytes(op, "fwd", a.rows, cols, 2)
            k = bench.num_sets(nbytes, 512 * bench.MB, 20 * bench.GB, 256)
            sets = bench.make_sets(op, jnp.bfloat16, a.rows, cols, k, with_dy=False, seed=0)
            base = dict(op=op, mode="fwd", dtype="bf16", rows=a.rows, cols=cols, timer="cupti",
                        k_sets=k, min_bytes=nbytes)
            copy = bench.measure_copy(base, timer, a.repeats, 0)
            x0, p0, _ = sets[0]
            want = jax.jit(fns["xla"])(x0, *p0)
            cells = []
            for name in ("triton", "mosaic", "cuda", "xla"):
                try:
                    err = bench.rel_err(jax.jit(fns[name])(x0, *p0), want)
                    call = bench.batched(lambda x, p, f=fns[name]: f(x, *p))
                    us = sorted(t / k * 1e6 for t in timer(call, [(x, p) for x, p, _ in sets], a.repeats))
                    med = us[len(us) // 2]
                    cells.append(f"{med:>11.1f} {100 * copy.time_us / med:>6.0f} {err:>4.0e}")
                except Exception as e:  # noqa: BLE001 - report and go on
                    cells.append(f"{'FAILED':>11} {bench.short_error(e)[:60]}")
                    print(f"  {op} {cols} {name}: {bench.short_error(e)}", flush=True)
            print(f"{op:<10} {cols:>6} | {copy.time_us:>8.1f} | " + " | ".join(cells), flush=True)
            del sets


if __name__ == "__main__":
    main()
