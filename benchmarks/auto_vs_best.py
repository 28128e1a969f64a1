"""Issue 20, item 1: the automatic choice against the best of what a user could run, from
`python -m jax_ops.bench --json` files (one or more; records of the same file compared).

For every (op, mode, dtype, cols) with an "auto" record: best = the fastest of cuda /
pallas / xla and the autodiff baseline (flax, or jnp without flax) timed in that file
(`jax_ops.bench.report.auto_vs_best`), and best / auto (the target is >= 0.98). Prints one
line a point, flags the misses, and the lowest ratio per (op, dtype).
Usage: python benchmarks/auto_vs_best.py RESULTS.json [...] [--target 0.98]"""
import argparse
from collections import defaultdict

from jax_ops.bench.report import auto_vs_best, read_json
from jax_ops.bench.specs import KERNEL_IMPLS

BASELINES = ("flax", "jnp")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("paths", nargs="+")
    p.add_argument("--target", type=float, default=0.98)
    a = p.parse_args()
    print(f"{'op':15} {'mode':8} {'dtype':5} {'rows':>6} {'cols':>6} {'auto us':>9} {'best':>6} "
          f"{'best us':>9} {'best/auto':>9} {'flax/auto':>9}")
    worst = defaultdict(lambda: (9.0, None))
    misses = 0
    for path in a.paths:
        records = read_json(path)[1]
        rows = {(r.op, r.mode, r.dtype, r.cols): r.rows for r in records}
        base = {(r.op, r.mode, r.dtype, r.cols): r.time_us for r in records
                if r.impl in BASELINES and r.time_us is not None}
        for op, mode, dtype, cols, best, best_us, auto_us, _ in auto_vs_best(records, KERNEL_IMPLS + BASELINES):
            ratio, key = best_us / auto_us, (op, mode, dtype, cols)
            vs = f"{base[key] / auto_us:9.3f}" if key in base else f"{'-':>9}"
            flag = "" if ratio >= a.target else "   MISS"
            print(f"{op:15} {mode:8} {dtype:5} {rows[key]:>6} {cols:>6} {auto_us:9.1f} {best:>6} "
                  f"{best_us:9.1f} {min(ratio, 9.99):9.3f} {vs}{flag}")
            if ratio < worst[op, dtype][0]:
                worst[op, dtype] = (ratio, key)
            misses += bool(flag)
    print()
    for (op, dtype), (ratio, key) in sorted(worst.items()):
        print(f"{op:15} {dtype:5} lowest best/auto {ratio:.3f} at {key[1]} {key[3]} columns"
              if ratio < 1 else f"{op:15} {dtype:5} auto is the fastest everywhere")
    print(f"{misses} point(s) below {a.target}")


if __name__ == "__main__":
    main()
