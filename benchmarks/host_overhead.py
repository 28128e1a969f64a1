"""Host cost of a call of our ops: a jitted chain of K calls on a tiny input (GPU time per
kernel of a few µs), wall clock per call, our CUDA implementation against XLA's, with
XLA's command buffers off (every thunk launched by the host, as in a ResNet step under
XLA's default command-buffer types, where convolutions split the graphs) and as XLA sets
them by default.

Per op and mode: µs per call of the chain = max(host launch cost, GPU time) per call,
median of --repeats runs of --execs executions.

  python benchmarks/host_overhead.py --out host.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jax_ops


def chains(k: int):
    """name -> (fn of x, input): K dependent calls, forward and backward."""
    x = jax.random.normal(jax.random.key(0), (8, 8, 8, 64), jnp.bfloat16)
    s = jnp.ones((64,), jnp.float32)

    def grad_chain(step):
        def f(x):
            def loss(x):
                for _ in range(k):
                    x = step(x)
                return jnp.sum(x.astype(jnp.float32))
            return jax.grad(loss)(x)
        return f

    def bn(impl):
        return grad_chain(lambda x: jax_ops.batch_norm_relu(x, s, s, implementation=impl)[0])

    def ln(impl):
        return grad_chain(lambda x: jax_ops.layer_norm(x, s, s, implementation=impl))

    def relu(impl):
        return grad_chain(lambda x: jax_ops.relu(x, implementation=impl) + 0.5)

    # layer_norm last: XLA's GPU compile of a chain of 16 LayerNorm gradients took over
    # 40 s on the H100 (benchmarks/results/2026-11-25_H100_resnet)
    return {f"{name}/{impl}": (make(impl), x) for name, make in
            (("batch_norm_relu", bn), ("relu", relu), ("layer_norm", ln)) for impl in ("cuda", "xla")}


def time_chain(fn, x, options, execs: int, repeats: int) -> list[float]:
    compiled = jax.jit(fn).lower(x).compile(compiler_options=options) if options else jax.jit(fn).lower(x).compile()
    jax.block_until_ready(compiled(x))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = None
        for _ in range(execs):
            y = compiled(x)
        jax.block_until_ready(y)
        out.append((time.perf_counter() - t0) / execs)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=64, help="op calls in the chain (forward + backward)")
    ap.add_argument("--execs", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "calls": a.calls, "rows": {}}
    for cb, options in (("command buffers off", {"xla_gpu_enable_command_buffer": ""}), ("XLA default", None)):
        for name, (fn, x) in chains(a.calls).items():
            t = time_chain(fn, x, options, a.execs, a.repeats)
            us = statistics.median(t) * 1e6 / a.calls
            res["rows"][f"{name} | {cb}"] = us
            print(f"{name:24s} {cb:20s} {us:7.2f} us per call (fwd+bwd)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
