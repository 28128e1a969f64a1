"""Where a real model's step time goes between kernels: the GPU timeline of a few
back-to-back steps (original vs `jax_ops.optimize`), as compiled for timing (command
buffers as XLA_FLAGS sets them; recorded while profiling).

Per variant: wall-clock ms/step (median of --repeats × --steps), and from a profiler
trace of --trace-steps steps queued back to back: kernels per step, kernel time per
step (sum of durations), the GPU span per step (first start to last end / steps), idle
= span − kernel time, and the largest idle gaps with the kernels on either side. The
model builders are benchmarks/model_step.py's.

  python benchmarks/step_timeline.py --models resnet50 --modes train infer --out t.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_trace  # noqa: E402  (the trace and its gaps)
import model_step  # noqa: E402  (the model builders and the training step)

import jax_ops  # noqa: E402


def kernel_events(run, steps: int) -> list:
    """(start ns, end ns, name, hlo_op) of every GPU kernel of `steps` calls of run()."""
    def call():
        out = None
        for _ in range(steps):
            out = run()
        return out
    return sorted(ev for evs in gpu_trace.gpu_events(call).values() for ev in evs)


def timeline_summary(events, steps: int, top: int) -> dict:
    if not events:
        return {"kernels": 0}
    busy, gaps = gpu_trace.busy_and_gaps(events)
    span = max(e for _, e, *_ in events) - events[0][0]
    label = lambda ev: ev[2][:60] + f" [{ev[3]}]" if ev else ""  # noqa: E731
    return {"kernels_per_step": len(events) / steps,
            "kernel_us_per_step": sum(e - s for s, e, *_ in events) / steps / 1e3,
            "busy_us_per_step": busy / steps / 1e3,
            "span_us_per_step": span / steps / 1e3,
            "idle_us_per_step": (span - busy) / steps / 1e3,
            "gaps_over_5us_per_step": sum(1 for g in gaps if g[0] > 5e3) / steps,
            "idle_in_gaps_over_5us_per_step": sum(g[0] for g in gaps if g[0] > 5e3) / steps / 1e3,
            "largest_gaps": [dict(us=g / 1e3, after=label(a), before=label(b)) for g, a, b in gaps[:top]]}


def variants(name, mode, cfg, dtype, policy):
    params, stats, batch, loss_fn, infer_fn = model_step.MODELS[name](cfg, dtype)
    fns = {"original": loss_fn if mode == "train" else infer_fn}
    fns["optimized"] = jax_ops.optimize(fns["original"], policy=policy)
    for label, fn in fns.items():
        if mode == "train":
            _, run = model_step.train_runner(fn, name == "resnet50", params, stats, batch)
        else:
            _, run = model_step.infer_runner(fn, params, stats, batch[:1])
        yield label, run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet50"], choices=list(model_step.MODELS))
    ap.add_argument("--modes", nargs="+", default=["train", "infer"], choices=["train", "infer"])
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--trace-steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    sizes = model_step.SMALL if a.small else model_step.GPU
    result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "argv": sys.argv[1:], "runs": {}}
    for name in a.models:
        for mode in a.modes:
            for label, run in variants(name, mode, sizes[name], jnp.bfloat16, a.policy):
                times = model_step.time_steps(run, a.steps, a.repeats)
                r = dict(ms=statistics.median(times), times=times,
                         **timeline_summary(kernel_events(run, a.trace_steps), a.trace_steps, a.top))
                result["runs"][f"{name}/{mode}/{label}"] = r
                print(f"{name} {mode} {label}: {r['ms']:.2f} ms/step; per step "
                      + ", ".join(f"{k[:-9]} {v:.1f}" for k, v in r.items() if k.endswith("_per_step")),
                      flush=True)
                for g in r.get("largest_gaps", [])[:a.top]:
                    print(f"    gap {g['us']:7.1f} us  after {g['after']}  before {g['before']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
