"""cross_entropy and linear_cross_entropy through JAX (the issue's shapes): jitted
value_and_grad of the mean loss, ours (automatic choice) vs optax on float32 logits.
Wall-clock ms (median of 5 runs of 10 calls) and XLA's temporary memory.

  python benchmarks/ce_step.py --out ce_step.json
"""
import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import jax_ops


def timed(fn, args, steps=10, repeats=5):
    c = jax.jit(fn).lower(*args).compile()
    temp = c.memory_analysis().temp_size_in_bytes / 2**20
    jax.block_until_ready(c(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = c(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) * 1e3 / steps)
    return dict(ms=statistics.median(ts), temp_mib=temp)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--out")
    a = ap.parse_args()
    k = jax.random.split(jax.random.key(0), 3)
    logits = jax.random.normal(k[0], (a.rows, a.vocab), jnp.bfloat16)
    labels = jax.random.randint(k[1], (a.rows,), 0, a.vocab)
    h = jax.random.normal(k[2], (a.rows, a.d), jnp.bfloat16)
    w = (jax.random.normal(k[0], (a.d, a.vocab), jnp.float32) * a.d ** -0.5).astype(jnp.bfloat16)
    optax_ce = lambda z, y: optax.softmax_cross_entropy_with_integer_labels(z.astype(jnp.float32), y).mean()  # noqa: E731
    res = {"device": jax.devices()[0].device_kind, "shapes": vars(a)}
    res["ce_optax"] = timed(jax.value_and_grad(optax_ce), (logits, labels))
    for impl in (None, "cuda", "pallas"):
        f = lambda z, y, impl=impl: jax_ops.cross_entropy(z, y, reduction="mean", implementation=impl)  # noqa: E731
        res[f"ce_ours_{impl or 'auto'}"] = timed(jax.value_and_grad(f), (logits, labels))
    lin_optax = lambda h, w, y: optax_ce(h @ w, y)  # noqa: E731
    res["linear_ce_optax"] = timed(jax.value_and_grad(lin_optax, argnums=(0, 1)), (h, w, labels))
    lin = lambda h, w, y: jax_ops.linear_cross_entropy(h, w, y, reduction="mean")  # noqa: E731
    res["linear_ce_ours"] = timed(jax.value_and_grad(lin, argnums=(0, 1)), (h, w, labels))
    for key, v in res.items():
        print(key, v, flush=True)
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
