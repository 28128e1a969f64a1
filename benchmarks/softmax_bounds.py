"""fwd+bwd speed-up over jax.nn next to its bounds, from a table run's JSON
(`gpu_session.sh table-softmax` writes table_{softmax,log_softmax}.json).

For each cols: ours = jax.nn (the `flax` column) fwd_bwd time over the best of
cuda/pallas/xla; bound5X = jax.nn over a copy of the 5X floor in one kernel; pair =
jax.nn over a copy of 2X plus a copy of 3X, i.e. a forward and a backward kernel that both
run exactly at the copy kernel's speed (the forward must write y and the backward read it,
so a fwd+bwd is two kernels; at a few µs the second launch and ramp are not free).

Usage: python benchmarks/softmax_bounds.py RESULTS_DIR [RESULTS_DIR ...]
"""
import collections
import json
import pathlib
import sys

IMPLS = ("cuda", "pallas", "xla")


def bounds(path):
    """{cols: (ours, bound5X or None, pair)} from one table JSON."""
    times = collections.defaultdict(dict)
    for r in json.loads(pathlib.Path(path).read_text())["records"]:
        key = (r["mode"], r["cols"])
        if r["time_us"] is not None:
            times[key][r["impl"]] = r["time_us"]
        if r["copy_us"]:
            times[key]["copy"] = r["copy_us"]
    out = {}
    for cols in sorted({c for _, c in times}):
        fb, f, b = (times[(m, cols)] for m in ("fwd_bwd", "fwd", "bwd"))
        best = min(fb[i] for i in IMPLS if i in fb)
        out[cols] = (fb["flax"] / best, fb["flax"] / fb["copy"] if "copy" in fb else None,
                     fb["flax"] / (f["copy"] + b["copy"]))
    return out


def main(dirs):
    for d in dirs:
        for op in ("softmax", "log_softmax"):
            path = pathlib.Path(d) / f"table_{op}.json"
            if not path.exists():
                continue
            print(f"{path}: fwd_bwd x jax.nn, ours / bound5X / pair (target 1.5, 2 at >= 16384)")
            for cols, (ours, b5, pair) in bounds(path).items():
                target = 2.0 if cols >= 16384 else 1.5
                flag = "" if ours >= target else "  miss, pair bound below target" if pair < target \
                    else "  MISS with room"
                b5s = f"{b5:.2f}" if b5 else " n/a"
                print(f"  {cols:6d}  {ours:.2f} / {b5s} / {pair:.2f}{flag}")


if __name__ == "__main__":
    main(sys.argv[1:])
