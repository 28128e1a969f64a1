"""linear_cross_entropy on the GPU (issue 21): chunk size at the issue's shape, the unfused alternative it is compared with (h @ w, then our fused
cross_entropy: what the graph becomes without the linear_cross_entropy rewrite), the
three GEMMs alone (the floor), the optimized HLO's GEMM custom calls (is the dw
accumulation in the GEMM's epilogue?), kernel profiles, and a few more shapes for the
policy="auto" model (lce_estimate in jax_ops/ops/cross_entropy.py).

Times: wall clock of the jitted value_and_grad of the mean loss (h and w), median of 5
runs of 10 calls (benchmarks/ce_step.py's timer); temp: XLA's temporary buffers.

  python benchmarks/lce_sweep.py --out lce_sweep.json [--quick]
"""
import argparse
import json
import re
import sys
import time

import jax
import jax.numpy as jnp

import jax_ops
from jax_ops.ops import cross_entropy as ce_mod

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ce_step import timed  # noqa: E402


def inputs(N, d, V, dtype=jnp.bfloat16, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k[0], (N, d), dtype)
    w = (jax.random.normal(k[1], (d, V), jnp.float32) * d ** -0.5).astype(dtype)
    labels = jax.random.randint(k[2], (N,), 0, V)
    return h, w, labels


def lce_fn(chunk=None):
    return jax.value_and_grad(lambda h, w, y: jax_ops.linear_cross_entropy(
        h, w, y, reduction="mean", chunk_rows=chunk), argnums=(0, 1))


def unfused_fn():
    return jax.value_and_grad(lambda h, w, y: jax_ops.cross_entropy(h @ w, y, reduction="mean"),
                              argnums=(0, 1))


def gemm_hlo(fn, args):
    """The GEMM custom calls of the optimized HLO: target, beta, aliasing, shapes."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    out = []
    for line in text.splitlines():
        if "custom_call_target=\"__cublas" in line:
            tgt = re.search(r'custom_call_target="([^"]+)"', line).group(1)
            beta = re.search(r'"beta":\s*([0-9.]+)', line)
            alias = "output_to_operand_aliasing" in line
            shape = line.split("=", 1)[1].split("custom-call", 1)[0].strip()[:80]
            out.append(dict(target=tgt, beta=beta.group(1) if beta else None, aliased=alias,
                            result=shape))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="main shape only")
    ap.add_argument("--small", action="store_true", help="toy sizes (CPU smoke run)")
    a = ap.parse_args()
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    N, d, V = (16384, 768, 50304) if not a.small else (512, 32, 96)
    h, w, y = inputs(N, d, V)
    main_ = res["main"] = {"shape": [N, d, V], "dtype": "bfloat16"}

    # the floor: the three GEMMs alone, at full size
    dl = jax.random.normal(jax.random.key(9), (N, V), jnp.bfloat16)
    main_["gemm_logits"] = timed(lambda h, w: h @ w, (h, w))
    main_["gemm_dh"] = timed(lambda dl, w: dl @ w.T, (dl, w))
    main_["gemm_dw_bf16"] = timed(lambda h, dl: h.T @ dl, (h, dl))
    del dl
    print({k: v for k, v in main_.items() if k.startswith("gemm")}, flush=True)
    main_["unfused"] = timed(unfused_fn(), (h, w, y))
    print("unfused", main_["unfused"], flush=True)
    # the same loss and gradients as the unfused computation (max |diff| / max |ref|)
    ref = jax.jit(unfused_fn())(h, w, y)
    got = jax.jit(lce_fn())(h, w, y)
    main_["rel_diff_vs_unfused"] = [
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
              max(float(jnp.max(jnp.abs(b.astype(jnp.float32)))), 1e-30))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))]
    print("rel diff loss, dh, dw", main_["rel_diff_vs_unfused"], flush=True)
    del ref, got
    # (The committed run, commit b16b975, also timed a variant that took the first chunk
    # out of the loop, "peel1": slower, removed; see the results' README.)
    for chunk in (2048, 4096, 8192, 16384):
        chunk = chunk if not a.small else chunk // 32
        key = f"lce_chunk{chunk}"
        main_[key] = timed(lce_fn(chunk), (h, w, y))
        print(key, main_[key], flush=True)
    main_["default_chunk_rows"] = ce_mod.default_chunk_rows(N, V, 2)
    main_["hlo_gemms_lce_default"] = gemm_hlo(lce_fn(), (h, w, y))
    for g in main_["hlo_gemms_lce_default"]:
        print("gemm", g, flush=True)
    try:
        from jax_ops import fx
        for key, fn in (("profile_lce_default", lce_fn()),):
            p = str(fx.profile(fn, h, w, y))
            main_[key] = "\n".join(p.splitlines()[:16])
            print(main_[key], flush=True)
    except Exception as e:  # keep the timings
        main_["profile_error"] = f"{type(e).__name__}: {e}"
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)
    if not a.quick:
        res["shapes"] = []
        for (N, d, V) in ((8192, 768, 50304), (32768, 768, 50304),
                          (8192, 4096, 128256)) if not a.small else ((256, 16, 64),):
            h, w, y = inputs(N, d, V)
            r = {"shape": [N, d, V], "chunk_rows": ce_mod.default_chunk_rows(N, V, 2),
                 "unfused": timed(unfused_fn(), (h, w, y)), "lce_default": timed(lce_fn(), (h, w, y))}
            print(r, flush=True)
            res["shapes"].append(r)
            if a.out:
                json.dump(res, open(a.out, "w"), indent=1)
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
