"""Where a sharded step's time goes (issue 23): the per-device GPU timeline of
sharding_gpu.py's "graph" program (10 chained value_and_grad steps in one jitted call)
for chosen cases, one GPU and sharded.

Per device, from a profiler trace of one call: the span per step (first kernel start to
last kernel end / steps), the compute kernels' busy time (NCCL's kernels apart: they run
on their own stream and mostly wait), idle = span − busy, the largest idle gaps with the
kernels on either side, and the mean time of each kernel name per step. With --hlo, the
sharded program's compiled HLO text is written too (the schedule XLA chose: where the
async collectives start and end).

  python benchmarks/sharding_timeline.py --only layer_norm --sharded hidden --out t.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_trace  # noqa: E402  (the trace and its gaps)
import sharding_gpu  # noqa: E402  (the cases, their inputs and the chained program)


def summary(events, steps: int, top: int) -> dict:
    if not events:
        return {}
    nccl = [e for e in events if "nccl" in e[2].lower()]
    comp = [e for e in events if "nccl" not in e[2].lower()]
    span = max(e for _, e, *_ in events) - min(s for s, *_ in events)
    busy, gaps = gpu_trace.busy_and_gaps(comp)
    per_name: dict[str, float] = {}
    for s, e, name, _ in events:
        per_name[name[:70]] = per_name.get(name[:70], 0.0) + (e - s) / steps / 1e3
    return {"span_us_per_step": span / steps / 1e3,
            "compute_busy_us_per_step": busy / steps / 1e3,
            "compute_idle_us_per_step": (span - busy) / steps / 1e3,
            "compute_kernels_per_step": len(comp) / steps,
            "nccl_us_per_step": sum(e - s for s, e, *_ in nccl) / steps / 1e3,
            "gaps_over_3us_per_step": sum(1 for g in gaps if g[0] > 3e3) / steps,
            "idle_in_gaps_over_3us_per_step": sum(g[0] for g in gaps if g[0] > 3e3) / steps / 1e3,
            "largest_gaps": [dict(us=g / 1e3, after=a[2][:70] if a else "", before=b[2][:70])
                             for g, a, b in gaps[:top]],
            "us_per_step_by_kernel": dict(sorted(per_name.items(), key=lambda kv: -kv[1]))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="layer_norm")
    ap.add_argument("--sharded", default="hidden", choices=("batch", "hidden"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--hlo", help="write the sharded program's compiled HLO here")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("d",), devices=devices)
    only = set(args.only.split(","))
    res = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "devices": len(devices),
           "device_kind": devices[0].device_kind, "jax": jax.__version__, "cases": {}}
    for name, loss, shape, params, batch_spec, hidden_spec, pspec in sharding_gpu.cases(args.small):
        if name not in only:
            continue
        spec = hidden_spec if args.sharded == "hidden" else batch_spec
        x, ct, vg = sharding_gpu.case_inputs(loss, shape, params)
        one = [jax.device_put(a, devices[0]) for a in (x, ct, *params)]
        placed = sharding_gpu.place(mesh, spec, pspec, shape, x, ct, params)
        case = {}
        for label, a in (("one_gpu", one), ("sharded", placed)):
            prog = sharding_gpu.chained_program(vg, args.steps)
            ms = sharding_gpu.graph_ms(vg, a, args.repeats, args.steps)[0]
            evs = gpu_trace.gpu_events(lambda: prog(*a))
            case[label] = {"graph_ms": ms, "devices": {dev: summary(e, args.steps, args.top)
                                                       for dev, e in evs.items() if e}}
            if label == "sharded" and args.hlo:
                with open(f"{args.hlo}.{name}.txt", "w") as f:
                    f.write(jax.jit(vg).lower(*a).compile().as_text())
        case["graph_speedup"] = case["one_gpu"]["graph_ms"] / case["sharded"]["graph_ms"]
        res["cases"][name] = case
        for label in ("one_gpu", "sharded"):
            for dev, s in case[label]["devices"].items():
                print(f"{name:16s} {label:8s} {dev[-5:]} graph {case[label]['graph_ms']:.3f} ms | span "
                      f"{s['span_us_per_step']:6.1f} busy {s['compute_busy_us_per_step']:6.1f} idle "
                      f"{s['compute_idle_us_per_step']:5.1f} us/step ({s['compute_kernels_per_step']:.0f} kernels, "
                      f"gaps>3us {s['gaps_over_3us_per_step']:.1f} = {s['idle_in_gaps_over_3us_per_step']:.1f} us) "
                      f"nccl {s['nccl_us_per_step']:.1f}", flush=True)
        print(f"{name:16s} speedup x{case['graph_speedup']:.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
