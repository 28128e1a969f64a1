"""Autotune on the benchmark shapes, then benchmark the automatic choice with the winners.

    python benchmarks/autotune_check.py [--cols 32,...] [--max-configs 6]

1. jax_ops.autotune(grad of a loss) for LayerNorm and RMSNorm, bf16, rows=49152, at each
   cols: every implementation that supports the shape, Pallas with up to --max-configs
   tile configs, forward and backward. Winners go to a fresh cache file
   ($JAX_OPS_AUTOTUNE_CACHE, default /tmp/jax_ops_autotune.json).
2. jax_ops.bench over the same shapes with cuda, pallas (default config), xla and auto:
   its "auto/best" summary shows what the tuned automatic choice gives; compare with a
   bench run without the cache (the "verify" step of gpu_session.sh).
   --skip-bench instead compares, within autotune's own timings, the winner with what
   the measured table picks (that implementation at its default config).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_OPS_AUTOTUNE_CACHE", "/tmp/jax_ops_autotune.json")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_ops  # noqa: E402
from jax_ops import bench, tuning  # noqa: E402


def print_vs_table(results) -> None:
    """Autotune's winner vs the measured table's choice, both timed by autotune."""
    from jax_ops.core import dispatch, registry
    from jax_ops.core.op import default_platform
    kind = dispatch.device_kind(default_platform())
    print(f"\nautotune winner vs the measured table's choice ({kind}), autotune's timings (us)")
    print(f"{'query':<44} {'table pick':>10} {'its us':>8} {'winner':>36} {'us':>8} {'ratio':>6}")
    ratios = []
    for r in results:
        q = r["q"]
        op = q.op
        picked = dispatch.table_pick(q)
        if picked is None:
            continue
        name = picked[0]
        impl = registry.get(op, name)
        label = tuning.label(name, impl.default_config(q))
        if label not in r["us"]:
            continue
        win_label = min(r["us"], key=r["us"].get)
        ratio = r["us"][win_label] / r["us"][label]
        ratios.append(ratio)
        print(f"{r['query']:<44} {name:>10} {r['us'][label]:>8.1f} {win_label:>36} "
              f"{r['us'][win_label]:>8.1f} {ratio:>6.3f}")
    if ratios:
        print(f"winner/table pick: geometric mean {float(np.exp(np.mean(np.log(ratios)))):.3f}, "
              f"worst {max(ratios):.3f} (<= 1: autotune improves or matches)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cols", default=",".join(map(str, bench.GPU_DEFAULTS["cols"])))
    ap.add_argument("--rows", type=int, default=49152)
    ap.add_argument("--max-configs", type=int, default=6)
    ap.add_argument("--skip-bench", action="store_true")
    a = ap.parse_args()
    if os.path.exists(tuning.cache_path()):
        os.remove(tuning.cache_path())
    t0 = time.time()
    results = []
    for op in ("layer_norm", "rms_norm"):
        for cols in map(int, a.cols.split(",")):
            k = jax.random.split(jax.random.key(cols), 3)
            x = jax.random.normal(k[0], (a.rows, cols), jnp.bfloat16)
            s = 1 + 0.1 * jax.random.normal(k[1], (cols,), jnp.float32)
            if op == "layer_norm":
                b = 0.1 * jax.random.normal(k[2], (cols,), jnp.float32)
                loss = lambda x, s, b: jnp.sum(jax_ops.layer_norm(x, s, b).astype(jnp.float32))
                args = (x, s, b)
            else:
                loss = lambda x, s: jnp.sum(jax_ops.rms_norm(x, s).astype(jnp.float32))
                args = (x, s)
            grad = jax.grad(loss, argnums=tuple(range(len(args))))
            results += jax_ops.autotune(grad, *args, max_configs=a.max_configs, repeats=5)
    print(f"autotune: {time.time() - t0:.0f} s for {len(a.cols.split(',')) * 2} shapes "
          f"(forward and backward), cache {tuning.cache_path()}", flush=True)
    print_vs_table(results)
    if a.skip_bench:
        return 0
    for op in ("layer_norm", "rms_norm"):
        bench.main(["--op", op, "--mode", "fwd,fwd_bwd,bwd", "--impl", "cuda,pallas,xla,auto",
                    "--rows", str(a.rows), "--cols", a.cols])
    return 0


if __name__ == "__main__":
    sys.exit(main())
