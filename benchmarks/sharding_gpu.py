"""Issue 7 on several GPUs: every op family under jax.jit with its input sharded over all
local GPUs, once along the batch (row) axis and once along the normalized/hidden axis.
Per case: forward + gradients against one GPU (relative error), the collectives in the
compiled HLO (kind and largest array, in elements) and the step time (value_and_grad
under jit, wall-clock median of 20) against one GPU.

  python benchmarks/sharding_gpu.py [--out results.json] [--small]
"""
from __future__ import annotations

import argparse
import json
import math
import re
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


def cases(small: bool):
    """(name, fn(x, *params), x shape, dtype, params, batch spec, hidden spec)."""
    b, s, h = (4, 64, 256) if small else (16, 2048, 4096)
    n, hw, c = (4, 8, 64) if small else (128, 56, 256)
    q = (4, 4, 64, 128) if small else (4, 16, 1024, 2048)
    ones = lambda k: jnp.ones((k,), jnp.float32)  # noqa: E731
    return [
        ("layer_norm", lambda x, sc, bi: jax_ops.layer_norm(x, sc, bi), (b, s, h), jnp.bfloat16,
         (ones(h), ones(h) * 0), P("d"), P(None, None, "d")),
        ("rms_norm", lambda x, sc: jax_ops.rms_norm(x, sc), (b, s, h), jnp.bfloat16, (ones(h),),
         P("d"), P(None, None, "d")),
        ("softmax_causal", lambda x: jax_ops.softmax(x, causal=True, scale=0.125), q, jnp.bfloat16,
         (), P("d"), P(None, None, None, "d")),
        ("relu", jax_ops.relu, (b, s, h), jnp.bfloat16, (), P("d"), P(None, None, "d")),
        ("batch_norm_relu", lambda x, sc, bi: jax_ops.batch_norm_relu(x, sc, bi)[0],
         (n, hw, hw, c), jnp.bfloat16, (ones(c), ones(c) * 0), P("d"), P(None, None, None, "d")),
    ]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def wall_ms(fn, *args, reps: int = 20) -> float:
    return bench.measure(fn, *args, repeats=reps, timer="wall", jit=False) / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("d",), devices=devices)
    rows = []
    print(f"# {len(devices)} x {devices[0].device_kind}, jax {jax.__version__}, commit {bench.git_commit()}")
    for name, fn, shape, dtype, params, batch_spec, hidden_spec in cases(args.small):
        x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
        ct = jnp.cos(jnp.arange(x.size, dtype=jnp.float32) * 0.37).reshape(shape).astype(dtype)

        def loss(x, ct, *p):
            return jnp.sum(fn(x, *p).astype(jnp.float32) * ct.astype(jnp.float32))
        vg = jax.jit(jax.value_and_grad(loss, argnums=(0, *range(2, 2 + len(params)))))
        one = jax.devices()[0]
        ref_args = [jax.device_put(a, one) for a in (x, ct, *params)]
        ref = vg(*ref_args)
        t_one = wall_ms(vg, *ref_args)
        for what, spec in (("batch", batch_spec), ("hidden", hidden_spec)):
            placed = [jax.device_put(x, NamedSharding(mesh, spec)),
                      jax.device_put(ct, NamedSharding(mesh, spec)),
                      *[jax.device_put(p, NamedSharding(mesh, P())) for p in params]]
            got = vg(*placed)
            errs = [rel_err(g, r) for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref))]
            colls = collectives(vg.lower(*placed).compile().as_text())
            biggest = max((n for _, n in colls), default=0)
            t = wall_ms(vg, *placed)
            row = dict(op=name, shape=list(shape), dtype=jnp.dtype(dtype).name, sharded=what,
                       max_rel_err=max(errs), collectives=colls,
                       largest_collective_elems=biggest, activation_elems=x.size // len(devices),
                       ms_one_gpu=t_one, ms_sharded=t, speedup=t_one / t)
            rows.append(row)
            kinds = sorted({k for k, _ in colls})
            print(f"{name:16s} {what:6s} err {max(errs):.1e}  collectives {kinds} largest "
                  f"{biggest} elems (shard {x.size // len(devices)})  one GPU {t_one:8.3f} ms  "
                  f"{len(devices)} GPUs {t:8.3f} ms  x{t_one / t:.2f}")
    if args.out:
        meta = dict(devices=len(devices), device_kind=devices[0].device_kind,
                    jax=jax.__version__, commit=bench.git_commit(),
                    date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
