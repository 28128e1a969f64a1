"""Per-kernel CUPTI times of one op's forward and backward (where the time goes).

    python3 benchmarks/kernel_breakdown.py OP DTYPE ROWS COLS [IMPL ...]
    (env MODES: comma list of fwd, bwd, step, fwd_res; default fwd,bwd)

For each implementation and stage (fwd; bwd from the saved residuals) this runs K
rotated input sets in one call (as jax_ops.bench does, >= 512 MB touched a call),
times every kernel with CUPTI (`profiler.measure(aggregate=False)`), and prints each
kernel's median time per set, next to the stage's byte floor at a same-bytes copy's
speed. GPU only.
"""
import os
import statistics
import sys
from collections import defaultdict

import jax
from jax.experimental.mosaic.gpu import profiler

from jax_ops import bench

REPEATS = 5


def per_kernel_us(f, args, k: int) -> dict[str, float]:
    """kernel name -> median over REPEATS of its summed time in one call, per set."""
    measured = profiler.measure(f, aggregate=False)
    runs = []
    for _ in range(REPEATS):
        out, timings = measured(args)
        del out
        per_name = defaultdict(float)
        for name, ms in timings or []:
            per_name[name] += ms * 1e3 / k
        runs.append(per_name)
    names = sorted({n for r in runs for n in r}, key=lambda n: -runs[0].get(n, 0.0))
    return {n: statistics.median(r.get(n, 0.0) for r in runs) for n in names}


def main() -> None:
    op, dtype_name, rows, cols = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    impls = sys.argv[5:] or ["cuda", "pallas", "xla", "flax"]
    dtype = bench.DTYPES[dtype_name]
    print(f"{op} {dtype_name} rows={rows} cols={cols} on {jax.devices()[0].device_kind}")
    for mode in os.environ.get("MODES", "fwd,bwd").split(","):
        nbytes = bench.min_bytes(op, mode, rows, cols, dtype)
        k = bench.num_sets(nbytes, 512 * bench.MB, 20 * bench.GB, 48)
        sets = bench.make_sets(op, dtype, rows, cols, k, with_dy=True, seed=0)
        try:
            copy_us = bench.copy_us(nbytes, k, timer="cupti", repeats=REPEATS)
        except Exception as e:  # noqa: BLE001
            raise SystemExit(f"copy failed (GPU only): {e}") from e
        print(f"\n{mode}: floor {nbytes / 1e6:.1f} MB, copy of it {copy_us:.1f} us (K={k})")
        for impl in impls:
            try:
                f, args = bench.timed_call(op, impl, mode, dtype, sets)
                times = per_kernel_us(f, args, k)
                del args
            except Exception as e:  # noqa: BLE001
                print(f"  {impl}: ERROR {bench.short_error(e)}")
                continue
            total = sum(times.values())
            print(f"  {impl}: {total:.1f} us = {copy_us / total:.2f} of copy")
            for name, us in times.items():
                print(f"      {us:8.1f} us  {name[:100]}")
        del sets

if __name__ == "__main__":
    main()
