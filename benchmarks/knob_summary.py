"""Side by side, the times of a knob sweep (gpu_stages.sh's knob_sweep output: "== KNOB=V"
headers, then the benchmark's per-point lines): one row per op / mode / dtype / cols, the
time of every run of each knob value in run order, and the ratio of the medians (last
value against the first).

Usage: python3 benchmarks/knob_summary.py SWEEP.txt [...]
"""
import collections
import re
import statistics
import sys

POINT = re.compile(r"^(\w+) (fwd|bwd|fwd_bwd|step) (\w+) rows=(\d+) cols=(\d+) .*?cuda ([\d.]+)us")


def summarize(path):
    times = collections.defaultdict(lambda: collections.defaultdict(list))
    values = []
    value = None
    for line in open(path):
        if line.startswith("== "):
            value = line.strip().split("=")[-1]
            if value not in values:
                values.append(value)
            continue
        m = POINT.match(line)
        if m and value is not None:
            op, mode, dtype, rows, cols, us = m.groups()
            times[(op, mode, dtype, int(rows), int(cols))][value].append(float(us))
    print(f"# {path}: knob values {values}; us per run; last / first = ratio of the medians")
    for key in sorted(times):
        runs = times[key]
        cells = "  ".join(f"{v}: {'/'.join(f'{t:g}' for t in runs.get(v, []))}" for v in values)
        ratio = ""
        if runs.get(values[0]) and runs.get(values[-1]):
            ratio = f"  {statistics.median(runs[values[-1]]) / statistics.median(runs[values[0]]):.3f}"
        op, mode, dtype, rows, cols = key
        print(f"{op:15s} {mode:8s} {dtype:5s} {rows:6d} x {cols:6d}  {cells}{ratio}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        summarize(p)
