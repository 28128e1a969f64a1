"""Issues 7/21/23 on several GPUs: every op family under jax.jit with its input sharded over
all local GPUs, once along the batch (row) axis and once along the normalized/hidden axis
(the vocabulary for cross_entropy). Per case: forward + gradients against one GPU
(relative error), the collectives in the compiled HLO (kind and largest array, in
elements) and the time of value_and_grad under jit against one GPU:

  * step: a training step's time, dispatched as a model trains: 10 steps queued, then one
    block_until_ready; median over `--repeats` such runs of the time per step (>= 5x10);
  * graph: 10 and 20 steps in one jitted program each (each step's inputs chained to
    the previous step's outputs by an optimization barrier, so XLA can neither merge nor
    overlap them), one call, median over `--repeats`; per step, the slope between the
    two: the devices' time for a step, collectives included, without what a call costs
    once (the host's dispatch, the per-execution rendezvous of a multi-device launch,
    which made `step` vary by up to 1.8x between two runs of the same commit on
    2 x H100; on 2 x H200 about 1 ms a call, against 0.7 ms on one GPU). That fixed cost
    is printed too, and "10 a call": the 10-step call / 10 (the metric before
    2026-11-26, which spread the fixed cost over the 10 steps);
  * call: one call, dispatched and waited for (what issue 7's and the first issue-23 run
    measured: host dispatch and the multi-device launch included in every call);
  * kernels: CUPTI, the sum of the kernel times of one call over all devices, divided by
    the devices (NCCL kernels included, so their waits count), and the NCCL share.

  python benchmarks/sharding_gpu.py [--out results.json] [--small] [--only op,op]
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ops
from jax_ops import bench

_COLL = re.compile(r"=\s*(.*?)\s(all-gather|all-reduce|all-to-all|collective-permute|"
                   r"reduce-scatter)(?:-start)?\(")


def collectives(compiled_text: str) -> list[tuple[str, int]]:
    """(kind, largest result array in elements) of each collective in compiled HLO."""
    out = []
    for line in compiled_text.splitlines():
        m = _COLL.search(line)
        if m:
            sizes = [math.prod(int(d) for d in s.split(",") if d)
                     for s in re.findall(r"[a-z]+\d*\[([\d,]*)\]", m.group(1))]
            out.append((m.group(2), max(sizes, default=0)))
    return out


def _weighted(fn):
    """loss(x, ct, *params) = Σ out·ct over fn's outputs (a tuple: each output)."""
    def loss(x, ct, *p):
        out = fn(x, *p)
        outs = out if isinstance(out, tuple) else (out,)
        return sum(jnp.sum(o.astype(jnp.float32) * ct.astype(jnp.float32)) for o in outs)
    return loss


def _jnp_layer_norm(x, scale, bias, eps=1e-5):
    """flax.linen.LayerNorm's computation (float32 statistics, output in x's dtype)."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)


def cases(small: bool):
    """(name, loss(x, ct, *params), x shape, dtype, params, batch spec, hidden spec,
    param specs or None)."""
    b, s, h = (4, 64, 256) if small else (16, 2048, 4096)
    n, hw, c = (4, 8, 64) if small else (128, 56, 256)
    q = (4, 4, 64, 128) if small else (4, 16, 1024, 2048)
    ce_rows, vocab = (256, 512) if small else (16384, 50304)
    key = jax.random.key(1)
    ones = lambda k: jnp.ones((k,), jnp.float32)  # noqa: E731
    resid = jax.random.normal(key, (b, s, h), jnp.float32).astype(jnp.bfloat16)
    zres = jax.random.normal(key, (n, hw, hw, c), jnp.float32).astype(jnp.bfloat16)
    labels = jax.random.randint(key, (ce_rows,), 0, vocab, jnp.int32)
    bsh, nhwc = (P("d"), P(None, None, "d")), (P("d"), P(None, None, None, "d"))
    return [
        ("layer_norm", _weighted(lambda x, sc, bi: jax_ops.layer_norm(x, sc, bi)), (b, s, h),
         (ones(h), ones(h) * 0), *bsh, None),
        ("rms_norm", _weighted(lambda x, sc: jax_ops.rms_norm(x, sc)), (b, s, h), (ones(h),), *bsh, None),
        ("add_layer_norm", _weighted(lambda x, r, sc, bi: jax_ops.add_layer_norm(x, r, sc, bi)),
         (b, s, h), (resid, ones(h), ones(h) * 0), *bsh, "x"),
        ("add_rms_norm", _weighted(lambda x, r, sc: jax_ops.add_rms_norm(x, r, sc)), (b, s, h),
         (resid, ones(h)), *bsh, "x"),
        ("softmax_causal", _weighted(lambda x: jax_ops.softmax(x, causal=True, scale=0.125)), q,
         (), P("d"), P(None, None, None, "d"), None),
        ("log_softmax", _weighted(lambda x: jax_ops.log_softmax(x)), q, (), P("d"),
         P(None, None, None, "d"), None),
        ("relu", _weighted(jax_ops.relu), (b, s, h), (), *bsh, None),
        ("add_relu", _weighted(jax_ops.add_relu), (b, s, h), (resid,), *bsh, "x"),
        ("batch_norm_relu", _weighted(lambda x, sc, bi: jax_ops.batch_norm_relu(x, sc, bi)[0]),
         (n, hw, hw, c), (ones(c), ones(c) * 0), *nhwc, None),
        ("batch_norm_add_relu",
         _weighted(lambda x, z, sc, bi: jax_ops.batch_norm_add_relu(x, z, sc, bi)[0]),
         (n, hw, hw, c), (zres, ones(c), ones(c) * 0), *nhwc, "x"),
        # XLA alone, for scale: an elementwise op (the harness's own cost: the loss's
        # reduction, its all-reduce, the step's launch) and flax-style jnp LayerNorm
        # partitioned by XLA's SPMD partitioner.
        ("xla_elementwise", _weighted(lambda x: x * 2), (b, s, h), (), *bsh, None),
        ("xla_layer_norm", _weighted(_jnp_layer_norm), (b, s, h), (ones(h), ones(h) * 0), *bsh, None),
        # The mean loss (the training use): ct unused; the labels follow the rows.
        ("cross_entropy",
         lambda x, ct, lab: jax_ops.cross_entropy(x, lab, reduction="mean"), (ce_rows, vocab),
         (labels,), P("d"), P(None, "d"), "rows"),
    ]


def case_inputs(loss, shape, params):
    """(x, ct, value_and_grad of loss over x and the floating params) of a case."""
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.bfloat16)
    ct = jnp.cos(jnp.arange(x.size, dtype=jnp.float32) * 0.37).reshape(shape).astype(jnp.bfloat16)
    grads = (0, *(2 + i for i, p in enumerate(params) if jnp.issubdtype(p.dtype, jnp.floating)))
    return x, ct, jax.value_and_grad(loss, argnums=grads)


def place(mesh, spec, pspec, shape, x, ct, params) -> list:
    """x and ct sharded by `spec`, each param as the case's `pspec` says ("x": like x
    where it has x's shape; "rows": a per-row vector along spec's first axis), else
    replicated."""
    def param_spec(p):
        if pspec == "x" and p.shape == shape:
            return spec
        if pspec == "rows" and p.ndim == 1 and p.shape[0] == shape[0]:
            return P(*spec[:1])
        return P()
    return [jax.device_put(x, NamedSharding(mesh, spec)), jax.device_put(ct, NamedSharding(mesh, spec)),
            *[jax.device_put(p, NamedSharding(mesh, param_spec(p))) for p in params]]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def call_ms(fn, args, repeats: int) -> float:
    """One call dispatched and waited for, median of `repeats`."""
    return bench.measure(fn, *args, repeats=repeats, timer="wall", jit=False) / 1e3


def step_ms(fn, args, repeats: int, steps: int = 10) -> float:
    """Per step, `steps` calls queued and one wait (as a training loop runs), median of
    `repeats`."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(steps)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / steps)
        del outs
    return statistics.median(times) * 1e3


@functools.cache
def chained_program(fn, steps: int):
    """A jitted program of `steps` chained steps of fn, every step's results returned
    (none can be dropped as dead code); one per (fn, steps), so that its callers share
    the compiled program."""
    def run(*a):
        outs = []
        for _ in range(steps):
            if outs:
                a, _ = jax.lax.optimization_barrier((a, outs[-1]))
            outs.append(fn(*a))
        return outs
    return jax.jit(run)


def _chained_ms(fn, args, repeats: int, steps: int) -> float:
    """ms of one call of chained_program(fn, steps), median of `repeats`."""
    return bench.measure(chained_program(fn, steps), *args, repeats=repeats, timer="wall", jit=False) / 1e3


def graph_ms(fn, args, repeats: int, steps: int = 10) -> tuple[float, float, float]:
    """(per step: the slope between programs of `steps` and 2·`steps` chained steps,
    which leaves out what a call costs once however many steps it holds; the call's
    fixed cost, ms; per step of the `steps` program with that cost spread over it)."""
    t1 = _chained_ms(fn, args, repeats, steps)
    t2 = _chained_ms(fn, args, repeats, 2 * steps)
    per_step = (t2 - t1) / steps
    return per_step, t1 - steps * per_step, t1 / steps


def kernel_ms(fn, args, devices: int) -> tuple[float | None, float | None, list]:
    """(CUPTI kernel time of one call summed over devices / devices, NCCL share of it,
    [(kernel name, ms summed over devices)] largest first); Nones off GPUs."""
    if jax.default_backend() != "gpu":
        return None, None, []
    from jax.experimental.mosaic.gpu import profiler
    _, kernels = profiler.measure(lambda a: fn(*a), aggregate=False)(tuple(args))
    if not kernels:
        return None, None, []
    total = sum(t for _, t in kernels)
    nccl = sum(t for name, t in kernels if "nccl" in name.lower())
    by_name: dict[str, float] = {}
    for name, t in kernels:
        by_name[name[:90]] = by_name.get(name[:90], 0.0) + t
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return total / devices, nccl / max(total, 1e-30), top


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    devices = jax.devices()
    nd = len(devices)
    mesh = jax.make_mesh((nd,), ("d",), devices=devices)
    rows = []
    print(f"# {nd} x {devices[0].device_kind}, jax {jax.__version__}, commit {bench.git_commit()}")
    print("# ms per value_and_grad: step (10 queued, median of "
          f"{args.repeats}), graph (per step: slope of 10 and 20 chained in one program), call (dispatched and waited "
          "for), kernels (CUPTI sum / devices)")
    only = set(args.only.split(",")) if args.only else None
    for name, loss, shape, params, batch_spec, hidden_spec, pspec in cases(args.small):
        if only and name not in only:
            continue
        x, ct, vg = case_inputs(loss, shape, params)
        vg = jax.jit(vg)
        one = devices[0]
        ref_args = [jax.device_put(a, one) for a in (x, ct, *params)]
        ref = vg(*ref_args)
        t1_step, t1_call = step_ms(vg, ref_args, args.repeats), call_ms(vg, ref_args, args.repeats)
        t1_graph, t1_fixed, t1_graph10 = graph_ms(vg, ref_args, args.repeats)
        k1, _, top1 = kernel_ms(vg, ref_args, 1)
        for what, spec in (("batch", batch_spec), ("hidden", hidden_spec)):
            placed = place(mesh, spec, pspec, shape, x, ct, params)
            got = vg(*placed)
            errs = [rel_err(g, r) for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref))]
            colls = collectives(vg.lower(*placed).compile().as_text())
            biggest = max((n for _, n in colls), default=0)
            t_step, t_call = step_ms(vg, placed, args.repeats), call_ms(vg, placed, args.repeats)
            t_graph, t_fixed, t_graph10 = graph_ms(vg, placed, args.repeats)
            k, nccl, top = kernel_ms(vg, placed, nd)
            row = dict(op=name, shape=list(shape), dtype="bfloat16", sharded=what,
                       max_rel_err=max(errs), collectives=colls,
                       largest_collective_elems=biggest, activation_elems=x.size // nd,
                       ms_one_gpu=t1_step, ms_sharded=t_step, speedup=t1_step / t_step,
                       call_ms_one_gpu=t1_call, call_ms_sharded=t_call,
                       call_speedup=t1_call / t_call, graph_ms_one_gpu=t1_graph,
                       graph_ms_sharded=t_graph, graph_speedup=t1_graph / t_graph,
                       call_fixed_ms_one_gpu=t1_fixed, call_fixed_ms_sharded=t_fixed,
                       graph10_ms_one_gpu=t1_graph10, graph10_ms_sharded=t_graph10,
                       graph10_speedup=t1_graph10 / t_graph10,
                       kernel_ms_one_gpu=k1,
                       kernel_ms_per_device=k, nccl_share=nccl,
                       kernel_speedup=(k1 / k) if k and k1 else None,
                       kernels_one_gpu=top1, kernels_sharded=top)
            rows.append(row)
            kinds = sorted({kd for kd, _ in colls})
            kern = (f"kernels {k1:6.3f} -> {k:6.3f} x{k1 / k:.2f} (nccl {nccl:.0%})"
                    if k and k1 else "kernels -")
            print(f"{name:19s} {what:6s} err {max(errs):.1e} {kinds} largest {biggest} "
                  f"(shard {x.size // nd}) | step {t1_step:6.3f} -> {t_step:6.3f} "
                  f"x{t1_step / t_step:.2f} | graph {t1_graph:6.3f} -> {t_graph:6.3f} "
                  f"x{t1_graph / t_graph:.2f} (fixed {t1_fixed:.2f} / {t_fixed:.2f} ms a call; 10 a call "
                  f"x{t1_graph10 / t_graph10:.2f}) | call x{t1_call / t_call:.2f} | {kern}", flush=True)
    if args.out:
        meta = dict(devices=nd, device_kind=devices[0].device_kind,
                    jax=jax.__version__, commit=bench.git_commit(),
                    date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
