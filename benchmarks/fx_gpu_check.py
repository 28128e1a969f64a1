"""jax_ops.fx on the GPU: profile and optimize an unmodified flax model's training step
(examples/transformer_block.py built from flax's own layers), original vs optimized.

Prints the rewrite report, both profiles (top rows), the loss/gradient agreement, the
step times (median over 5 x 10 steps) and the compiled temporary memory. A first
contact of the graph layer with the GPU (CUPTI profile path, policy="auto"), not the
real-model benchmark of the optimize issue.

    python benchmarks/fx_gpu_check.py [--d-model 1024 --seq 2048 --batch 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import transformer_block as tb  # noqa: E402

import jax_ops  # noqa: E402
from jax_ops import fx  # noqa: E402


def step_times(step, args, outer=5, inner=10):
    jax.block_until_ready(step(*args))
    times = []
    for _ in range(outer):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = step(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner * 1e3)
    return statistics.median(times), times


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--norm", default="layer")
    ap.add_argument("--policy", default="auto")
    a = ap.parse_args(argv)
    model = tb.make_model(False, vocab=a.vocab, d_model=a.d_model, heads=a.heads, norm=a.norm,
                          dtype=jnp.bfloat16)
    k_init, k_data = jax.random.split(jax.random.key(0))
    params = tb.init_params(model, k_init, a.seq)
    tokens = tb.synthetic_tokens(k_data, a.batch, a.seq, a.vocab)

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    fast_loss = jax_ops.optimize(loss_fn, policy=a.policy)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; with_cuda {jax_ops.with_cuda()}")
    print(fx.rewrites(loss_fn, params, tokens, policy=a.policy))

    grad = jax.jit(jax.value_and_grad(loss_fn))
    fast_grad = jax.jit(jax.value_and_grad(fast_loss))
    (l0, g0), (l1, g1) = grad(params, tokens), fast_grad(params, tokens)
    # Per parameter ||opt - orig|| / ||orig||; the attention key bias's exact gradient is
    # zero (softmax ignores a per-row shift), so leaves whose gradient is that small are
    # rounding noise either way and left out.
    norms = {jax.tree_util.keystr(k): float(jnp.linalg.norm(v.astype(jnp.float32).ravel()))
             for k, v in jax.tree_util.tree_flatten_with_path(g0)[0]}
    big = max(norms.values())
    errs = {jax.tree_util.keystr(k): float(jnp.linalg.norm((v1 - v0).astype(jnp.float32).ravel())) /
            norms[jax.tree_util.keystr(k)]
            for (k, v0), (_, v1) in zip(jax.tree_util.tree_flatten_with_path(g0)[0],
                                        jax.tree_util.tree_flatten_with_path(g1)[0])
            if norms[jax.tree_util.keystr(k)] > 1e-3 * big}
    worst = max(errs, key=errs.get)
    print(f"loss original {float(l0):.6f} optimized {float(l1):.6f}; worst gradient rel. err "
          f"{errs[worst]:.2e} ({worst}; {len(norms) - len(errs)} near-zero leaves skipped)")

    for name, f in (("original", grad), ("optimized", fast_grad)):
        mem = f.lower(params, tokens).compile().memory_analysis()
        med, times = step_times(f, (params, tokens))
        print(f"{name}: grad step {med:.3f} ms (median of {len(times)}x10: "
              f"{', '.join(f'{t:.3f}' for t in times)}); temp {mem.temp_size_in_bytes / 2**20:.1f} MiB")
    for name, f in (("original", jax.value_and_grad(loss_fn)), ("optimized", jax.value_and_grad(fast_loss))):
        prof = fx.profile(f, params, tokens)
        print(f"\n--- fx.profile, {name} (top 15 rows) ---")
        text = str(prof).splitlines()
        print("\n".join(text[:18]))
        print(f"rows {len(prof.rows)}, total {sum(r.time_us for r in prof.rows):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
