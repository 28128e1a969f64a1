"""Issue 20, items 2-3 from `python -m jax_ops.bench --json` sweeps: per (op, dtype, mode), at
each width, auto's % of the copy of the mode's minimum bytes (the bench's copy: fwd 2X, bwd
3X, fwd_bwd 5X for a plain norm; 4X / 4X / 8X for add+norm), the baseline's time over
auto's (xN), the baseline's time over the copy's (max xN: what a kernel at the copy's speed
would reach) and auto's µs. Points are keyed without rows: a later file's point replaces an
earlier one's. Files that are not sweeps (no records) are skipped.
Usage: python benchmarks/sweep_percent.py SWEEP.json [...]"""
import sys
from collections import defaultdict

from jax_ops.bench.report import read_json


def main():
    by = defaultdict(dict)
    for path in sys.argv[1:]:
        try:
            records = read_json(path)[1]
        except ValueError as e:
            print(f"skipped {path}: {e}", file=sys.stderr)
            continue
        for r in records:
            by[r.op, r.dtype, r.mode, r.cols][r.impl] = r
    for op, dtype, mode in sorted({k[:3] for k in by}):
        cells = []
        for cols in sorted(k[3] for k in by if k[:3] == (op, dtype, mode)):
            recs = by[op, dtype, mode, cols]
            auto, base = recs.get("auto"), recs.get("flax") or recs.get("jnp")
            if auto is None or auto.time_us is None:
                cells.append(f"{cols}: -")
                continue
            pct = f"{100 * auto.copy_us / auto.time_us:.1f}%" if auto.copy_us else "-"
            vs = f" x{base.time_us / auto.time_us:.2f}" if base and base.time_us else ""
            if vs and auto.copy_us:
                vs += f" (max x{base.time_us / auto.copy_us:.2f})"
            cells.append(f"{cols}: {pct}{vs} ({auto.time_us:.1f})")
        print(f"{op} {dtype} {mode}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
