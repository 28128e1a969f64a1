"""Issue 20, item 1: the automatic choice against the best of what a user could run, from
`python -m jax_ops.bench --json` files (one or more; records of the same run compared).

For every (op, mode, dtype, rows, cols) with an "auto" record: best = the fastest of the
other timed implementations in that file (cuda / pallas / xla and the autodiff baseline,
flax), and best / auto (the target is >= 0.98). Prints one line a point, flags the
misses, and a summary per (op, dtype).
Usage: python benchmarks/auto_vs_best.py RESULTS.json [...] [--target 0.98]"""
import argparse
import json
from collections import defaultdict

CANDIDATES = ("cuda", "pallas", "xla", "flax", "jnp")


def points(paths):
    """(op, mode, dtype, rows, cols) -> {impl: median µs}, per file."""
    for path in paths:
        with open(path) as f:
            records = json.load(f)["records"]
        group = defaultdict(dict)
        for r in records:
            if r.get("time_us") is not None and not r.get("error"):
                group[(r["op"], r["mode"], r["dtype"], r["rows"], r["cols"])][r["impl"]] = r["time_us"]
        yield from group.items()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("paths", nargs="+")
    p.add_argument("--target", type=float, default=0.98)
    a = p.parse_args()
    print(f"{'op':15} {'mode':8} {'dtype':5} {'rows':>6} {'cols':>6} {'auto us':>9} {'best':>6} "
          f"{'best us':>9} {'best/auto':>9} {'flax/auto':>9}")
    worst = defaultdict(lambda: (9.0, None))
    misses = []
    for key, t in sorted(points(a.paths)):
        if "auto" not in t:
            continue
        others = {i: t[i] for i in CANDIDATES if i in t}
        if not others:
            continue
        best = min(others, key=others.get)
        ratio = others[best] / t["auto"]
        base = t.get("flax", t.get("jnp"))
        vs = f"{base / t['auto']:9.3f}" if base else f"{'-':>9}"
        flag = "" if ratio >= a.target else "   MISS"
        print(f"{key[0]:15} {key[1]:8} {key[2]:5} {key[3]:>6} {key[4]:>6} {t['auto']:9.1f} {best:>6} "
              f"{others[best]:9.1f} {min(ratio, 9.99):9.3f} {vs}{flag}")
        k = (key[0], key[2])
        if ratio < worst[k][0]:
            worst[k] = (ratio, key)
        if flag:
            misses.append(key)
    print()
    for (op, dtype), (ratio, key) in sorted(worst.items()):
        print(f"{op:15} {dtype:5} lowest best/auto {min(ratio, 1.0):.3f} at {key[1]} {key[4]} columns"
              if ratio < 1 else f"{op:15} {dtype:5} auto is the fastest everywhere")
    print(f"{len(misses)} point(s) below {a.target}")


if __name__ == "__main__":
    main()
