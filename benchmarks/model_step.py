"""Real models, unmodified, original vs `jax_ops.optimize`: Hugging Face's Flax GPT-2
(FlaxGPT2LMHeadModel) and ResNet-50 (FlaxResNetForImageClassification), transformers
4.57 (the last release with Flax models; pinned in the test extra).

Per model and mode: wall-clock ms/step (median over `--repeats` runs of `--steps`
back-to-back steps, each run ended by block_until_ready), XLA's temporary memory of
the compiled step (`compiled.memory_analysis().temp_size_in_bytes`), the loss of the
first step (original vs optimized: same parameters and batch), the rewrite report,
and `jax_ops.fx.profile` of the step before and after (top rows).

Training steps: forward, backward and an optax.adamw update, jitted, parameters and
optimizer state donated. GPT-2's loss is the integer-label cross-entropy as users write
it (optax on float32 logits); ResNet's is softmax cross-entropy on its logits with
flax BatchNorm in training mode (batch_stats updated).

  python benchmarks/model_step.py --out results.json            # GPU sizes, bfloat16
  python benchmarks/model_step.py --small                       # CPU smoke run
  python benchmarks/model_step.py --models gpt2 --modes train --policy always
  python benchmarks/model_step.py --models gpt2 --modes train --policy auto memory --no-original
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_ops
from jax_ops import fx

GPU = {"gpt2": dict(n_layer=12, n_embd=768, n_head=12, seq=1024, batch=16, vocab=50304),
       "resnet50": dict(depths=[3, 4, 6, 3], hidden=[256, 512, 1024, 2048], batch=64, size=224)}
SMALL = {"gpt2": dict(n_layer=2, n_embd=64, n_head=4, seq=32, batch=2, vocab=97),
         "resnet50": dict(depths=[1, 1], hidden=[32, 64], batch=2, size=32)}


# ------------------------------------------------------------------ models ---

def gpt2(cfg, dtype):
    from transformers import FlaxGPT2LMHeadModel, GPT2Config
    config = GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["seq"], n_embd=cfg["n_embd"],
                        n_layer=cfg["n_layer"], n_head=cfg["n_head"], resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    model = FlaxGPT2LMHeadModel(config, input_shape=(1, cfg["seq"]), seed=0, dtype=dtype)
    ids = jax.random.randint(jax.random.key(1), (cfg["batch"], cfg["seq"]), 0, cfg["vocab"])

    def loss_fn(params, ids):
        logits = model(ids, params=params, train=False).logits
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1].astype(jnp.float32), ids[:, 1:]).mean()
    return model.params, {}, (ids,), loss_fn, None


def resnet50(cfg, dtype):
    from transformers import FlaxResNetForImageClassification, ResNetConfig
    config = ResNetConfig(depths=cfg["depths"], hidden_sizes=cfg["hidden"], layer_type="bottleneck",
                          num_labels=1000)
    n, s = cfg["batch"], cfg["size"]
    model = FlaxResNetForImageClassification(config, input_shape=(1, s, s, 3), seed=0, dtype=dtype)
    pixels = jax.random.normal(jax.random.key(1), (n, 3, s, s), jnp.float32)
    labels = jax.random.randint(jax.random.key(2), (n,), 0, 1000)
    params, stats = model.params["params"], model.params["batch_stats"]

    def loss_fn(params, stats, pixels, labels):
        out, new = model(pixels, params={"params": params, "batch_stats": stats}, train=True)
        loss = optax.softmax_cross_entropy_with_integer_labels(
            out.logits.astype(jnp.float32), labels).mean()
        return loss, new["batch_stats"]

    def infer_fn(params, stats, pixels):
        return model(pixels, params={"params": params, "batch_stats": stats}, train=False).logits
    return params, stats, (pixels, labels), loss_fn, infer_fn


# ------------------------------------------------------------------- steps ---

def make_train(loss_fn, has_stats):
    opt = optax.adamw(1e-4)
    grad = jax.value_and_grad(loss_fn, has_aux=has_stats)

    def step(params, opt_state, stats, *batch):
        if has_stats:
            (loss, stats), g = grad(params, stats, *batch)
        else:
            loss, g = grad(params, *batch)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats, loss
    return opt, jax.jit(step, donate_argnums=(0, 1, 2))


def train_runner(fn, has_stats, params, stats, batch):
    """(compiled training step, run(): one step on fresh copies of params/stats and an
    adamw state, carried from call to call, returning the loss)."""
    opt, step = make_train(fn, has_stats)
    p = jax.tree.map(jnp.array, params)
    s = jax.tree.map(jnp.array, stats)
    o = opt.init(p)
    compiled = step.lower(p, o, s, *batch).compile()
    state = {"p": p, "o": o, "s": s}

    def run():
        state["p"], state["o"], state["s"], loss = compiled(state["p"], state["o"], state["s"], *batch)
        return loss
    return compiled, run


def infer_runner(fn, params, stats, batch):
    """(compiled inference, run(): one call on the batch)."""
    compiled = jax.jit(fn).lower(params, stats, *batch).compile()
    return compiled, lambda: compiled(params, stats, *batch)


def time_steps(run, steps, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(steps):
            out = run()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3 / steps)
    return times


def _variants(fn, policies, original):
    """{"original": fn, "optimized": ...} (one policy) or "optimized_<policy>" per policy."""
    out = {"original": fn} if original else {}
    for p in policies:
        out["optimized" if len(policies) == 1 else f"optimized_{p}"] = jax_ops.optimize(
            fn, policy=p, exclude=EXCLUDE)
    return out


def _summary(out):
    opt = [k for k in out if k.startswith("optimized")]
    if "original" in out:
        for k in opt:
            suffix = k[len("optimized"):]
            out["speedup" + suffix] = out["original"]["ms"] / out[k]["ms"]
            out["temp_ratio" + suffix] = out[k]["temp_mib"] / max(out["original"]["temp_mib"], 1e-9)
    return out


def bench_train(name, cfg, dtype, policies, steps, repeats, profile_rows, original=True):
    params, stats, batch, loss_fn, _ = MODELS[name](cfg, dtype)
    has_stats = name == "resnet50"
    variants = _variants(loss_fn, policies, original)
    out = {}
    report_args = (params, stats, *batch) if has_stats else (params, *batch)
    for p in policies:
        out["rewrites" if len(policies) == 1 else f"rewrites_{p}"] = str(
            fx.rewrites(loss_fn, *report_args, policy=p, exclude=EXCLUDE))
    for label, fn in variants.items():
        compiled, run = train_runner(fn, has_stats, params, stats, batch)
        temp = compiled.memory_analysis().temp_size_in_bytes
        first_loss = float(run())
        times = time_steps(run, steps, repeats)
        prof = None
        if profile_rows:  # the loss and its gradient (the step without the optimizer update)
            pr = fx.profile(jax.value_and_grad(fn, has_aux=has_stats), *report_args)
            prof = "\n".join(str(pr).splitlines()[:profile_rows + 3])
        out[label] = dict(ms=statistics.median(times), times=times, temp_mib=temp / 2**20,
                          first_loss=first_loss, profile=prof)
        print(f"{name} train {label}: {out[label]['ms']:.2f} ms/step, temp {temp / 2**20:.0f} MiB, "
              f"loss {first_loss:.5f}", flush=True)
    return _summary(out)


def bench_infer(name, cfg, dtype, policies, steps, repeats, profile_rows, original=True):
    params, stats, batch, _, infer_fn = MODELS[name](cfg, dtype)
    if infer_fn is None:
        return None
    batch = batch[:1]
    variants = _variants(infer_fn, policies, original)
    out = {}
    for p in policies:
        out["rewrites" if len(policies) == 1 else f"rewrites_{p}"] = str(
            fx.rewrites(infer_fn, params, stats, *batch, policy=p, exclude=EXCLUDE))
    ref = None
    for label, fn in variants.items():
        compiled, run = infer_runner(fn, params, stats, batch)
        temp = compiled.memory_analysis().temp_size_in_bytes
        y = run()
        if ref is None:
            ref = np.asarray(y, np.float64)
        err = float(np.linalg.norm(np.asarray(y, np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))
        times = time_steps(run, steps, repeats)
        prof = None
        if profile_rows:
            pr = fx.profile(fn, params, stats, *batch)
            prof = "\n".join(str(pr).splitlines()[:profile_rows + 3])
        out[label] = dict(ms=statistics.median(times), times=times, temp_mib=temp / 2**20,
                          rel_err_vs_original=err, profile=prof)
        print(f"{name} infer {label}: {out[label]['ms']:.2f} ms/step, temp {temp / 2**20:.0f} MiB, "
              f"rel err {err:.2e}", flush=True)
    return _summary(out)


MODELS = {"gpt2": gpt2, "resnet50": resnet50}
EXCLUDE: tuple = ()  # --exclude: patterns the optimized variants leave out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--modes", nargs="+", default=["train", "infer"], choices=["train", "infer"])
    ap.add_argument("--policy", nargs="+", default=["auto"], choices=["auto", "always", "memory"],
                    help="one optimized variant per policy")
    ap.add_argument("--no-original", action="store_true", help="time the optimized variants only")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile-rows", type=int, default=15)
    ap.add_argument("--small", action="store_true", help="toy sizes (CPU smoke run)")
    ap.add_argument("--exclude", nargs="*", default=[], help="patterns optimize leaves out")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    global EXCLUDE
    EXCLUDE = tuple(a.exclude)
    sizes = SMALL if a.small else GPU
    dtype = jnp.dtype(a.dtype)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "argv": sys.argv[1:], "models": {}}
    for name in a.models:
        for mode in a.modes:
            fn = bench_train if mode == "train" else bench_infer
            r = fn(name, sizes[name], dtype, a.policy, a.steps, a.repeats, a.profile_rows,
                   original=not a.no_original)
            if r is not None:
                result["models"][f"{name}/{mode}"] = dict(config=sizes[name], **r)
                for k, v in r.items():
                    if k.startswith("rewrites"):  # the header and the loss's rows
                        lines = v.splitlines()
                        print(k, *[ln for i, ln in enumerate(lines) if i == 0 or "entropy" in ln],
                              sep="\n", flush=True)
                    if k.startswith("speedup"):
                        print(f"== {name} {mode} {k}: {v:.3f}x", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
