"""Training-step time of the examples, flax's layers vs ours: the whole jitted step
(forward, backward, adamw update; params and optimizer state donated) of

  transformer   examples/transformer_block.py: embedding → pre-norm block (causal
                attention, MLP) → norm → small LM head; RMSNorm and LayerNorm;
  resnet        examples/resnet_block.py: a basic block (BatchNorm+ReLU,
                BatchNorm+Add+ReLU) on NHWC features → pool → Dense.

Both models of a row start from the same parameters (initialized by the flax model) on
the same batch. Per model: wall-clock ms/step (median over repeats of `--steps`
back-to-back steps, then jax.block_until_ready), on a GPU also the CUPTI kernel time of
one step (sum of its kernels, no launch gaps), XLA's temp memory of the compiled step,
and the first step's loss (ours vs flax: same parameters, so it should agree to the
dtype's rounding).

  python benchmarks/step_time.py --out step_time.json            # GPU sizes, bfloat16
  python benchmarks/step_time.py --small                          # CPU smoke run (toy sizes)
  python benchmarks/step_time.py --impl pallas --models resnet    # force our implementation
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

import jax_ops
from jax_ops.bench import git_commit

# examples/ is not a package; append so the installed jax_ops stays first on the path
sys.path.append(str(Path(__file__).resolve().parents[1] / "examples"))
import resnet_block as rb  # noqa: E402
import transformer_block as tb  # noqa: E402

# (model, label, config). Transformer: heads of 128 and 16k tokens a step (8 × 2048).
GPU_CASES = [
    *[("transformer", f"d{d} seq2048 b8",
       dict(d_model=d, heads=d // 128, seq=2048, batch=8, vocab=512)) for d in (1024, 4096)],
    ("resnet", "256x56x56x64", dict(shape=(256, 56, 56, 64), num_classes=1000))]
SMALL_CASES = [
    ("transformer", "d64 seq32 b4", dict(d_model=64, heads=2, seq=32, batch=4, vocab=64)),
    ("resnet", "8x8x8x16", dict(shape=(8, 8, 8, 16), num_classes=10))]


def transformer_setup(cfg, norm, dtype):
    """(make_step(ours, donate), params/opt-state, batch) for one Transformer size."""
    model_args = dict(vocab=cfg["vocab"], d_model=cfg["d_model"], heads=cfg["heads"], norm=norm,
                      dtype=dtype)
    k_init, k_data = jax.random.split(jax.random.key(0))
    params = tb.init_params(tb.make_model(False, **model_args), k_init, cfg["seq"])
    tokens = tb.synthetic_tokens(k_data, cfg["batch"], cfg["seq"], cfg["vocab"])
    optimizer = optax.adamw(1e-4)

    def make_step(ours, donate):
        return tb.make_train_step(tb.make_model(ours, **model_args), optimizer, donate)
    return make_step, (params, optimizer.init(params)), (tokens,)


def resnet_setup(cfg, dtype):
    model_args = dict(num_classes=cfg["num_classes"], dtype=dtype)
    k_init, k_data = jax.random.split(jax.random.key(0))
    variables = rb.init_variables(rb.make_model(False, **model_args), k_init, cfg["shape"])
    x, labels = rb.synthetic_batch(k_data, cfg["shape"], cfg["num_classes"], dtype)
    optimizer = optax.adamw(1e-4)

    def make_step(ours, donate):
        return rb.make_train_step(rb.make_model(ours, **model_args), optimizer, donate)
    return make_step, (variables, optimizer.init(variables["params"])), (x, labels)


def copy(tree):
    return jax.tree.map(jnp.copy, tree)


def measure(make_step, state, batch, *, ours, steps, repeats, cupti, top_kernels=0):
    """Times one model's training step; `state` is not consumed (copied before donating)."""
    step = make_step(ours, donate=True)
    compiled = step.lower(*state, *batch).compile()
    memory = compiled.memory_analysis()
    params, opt_state, first_loss = compiled(*copy(state), *batch)   # warm-up
    jax.block_until_ready(first_loss)
    per_step = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            params, opt_state, loss = compiled(params, opt_state, *batch)
        jax.block_until_ready((params, opt_state, loss))
        per_step.append((time.perf_counter() - start) / steps * 1e3)
    del params, opt_state
    result = dict(ms_per_step=statistics.median(per_step), ms_per_step_repeats=per_step,
                  first_loss=float(first_loss), last_loss=float(loss),
                  temp_bytes=getattr(memory, "temp_size_in_bytes", None))
    if cupti:
        # CUPTI replays the step on the same inputs, so this copy must not donate them.
        from jax.experimental.mosaic.gpu import profiler
        undonated = make_step(ours, donate=False)
        _, kernel_ms = profiler.measure(undonated, iterations=5)(*state, *batch)
        result["cupti_ms_per_step"] = None if kernel_ms is None else statistics.median(kernel_ms)
        if top_kernels:
            _, kernels = profiler.measure(undonated, aggregate=False)(*state, *batch)
            by_name = collections.Counter()
            for name, ms in kernels or ():
                by_name[name] += ms
            result["top_kernels_ms"] = by_name.most_common(top_kernels)
    if ours:
        result["decisions"] = sorted({str(d) for d in jax_ops.explain(step, *state, *batch)})
    return result


def markdown_table(rows) -> str:
    def fmt(value, spec, scale=1.0):
        return "—" if value is None else format(value / scale, spec)
    header = ["model", "size", "flax ms/step", "ours ms/step", "speedup", "flax kernels ms",
              "ours kernels ms", "flax temp MiB", "ours temp MiB", "first loss flax / ours"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in rows:
        f, o = r["flax"], r["ours"]
        cells = [r["model"] + (f" ({r['norm']})" if r["norm"] else ""), r["size"],
                 fmt(f["ms_per_step"], ".2f"), fmt(o["ms_per_step"], ".2f"),
                 fmt(r["speedup"], ".2f"),
                 fmt(f.get("cupti_ms_per_step"), ".2f"), fmt(o.get("cupti_ms_per_step"), ".2f"),
                 fmt(f["temp_bytes"], ".0f", 2**20), fmt(o["temp_bytes"], ".0f", 2**20),
                 f"{f['first_loss']:.4f} / {o['first_loss']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernel_lists(rows) -> str:
    out = []
    for r in rows:
        for who in ("flax", "ours"):
            if r[who].get("top_kernels_ms"):
                name = f"{r['model']} {r['size']} {r['norm'] or ''}"
                out.append(f"\n{name} {who}: slowest kernels, ms")
                out += [f"  {ms:8.3f}  {name[:100]}" for name, ms in r[who]["top_kernels_ms"]]
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="toy sizes (a CPU smoke run)")
    p.add_argument("--models", default="transformer,resnet")
    p.add_argument("--norms", default=None,
                   help="transformer norms (default rms,layer; --small: rms)")
    p.add_argument("--dtype", default="bfloat16", help="activation dtype (params stay float32)")
    p.add_argument("--impl", default=None, help="force our implementation (jax_ops.use): a "
                   "name for every op, or op=name pairs, comma-separated")
    p.add_argument("--steps", type=int, default=None, help="steps per repeat (20; --small: 3)")
    p.add_argument("--repeats", type=int, default=None, help="(5; --small: 2)")
    p.add_argument("--no-cupti", dest="cupti", action="store_false",
                   help="skip the CUPTI kernel times (they run on GPUs only)")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="also list each model's N slowest kernels (CUPTI, one step)")
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    args = p.parse_args(argv)

    device = jax.devices()[0]
    cases = SMALL_CASES if args.small else GPU_CASES
    norms = (args.norms or ("rms" if args.small else "rms,layer")).split(",")
    steps = args.steps or (3 if args.small else 20)
    repeats = args.repeats or (2 if args.small else 5)
    dtype = jnp.dtype(args.dtype)
    timing = dict(steps=steps, repeats=repeats, cupti=args.cupti and device.platform == "gpu",
                  top_kernels=args.kernels)
    # "--impl pallas" for every op, or per op: "--impl softmax=pallas,rms_norm=cuda"
    impl_pairs = dict(kv.split("=") for kv in (args.impl or "").split(",") if "=" in kv)
    impl_all = args.impl if args.impl and not impl_pairs else None
    meta = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                device_kind=device.device_kind, platform=device.platform,
                git_commit=git_commit(), jax_version=jax.__version__,
                flax_version=__import__("flax").__version__, dtype=dtype.name, impl=args.impl,
                steps=steps, repeats=repeats,
                command=shlex.join(["python", "benchmarks/step_time.py",
                                    *(sys.argv[1:] if argv is None else argv)]))
    print(f"# step time, {device.device_kind} ({device.platform}), {dtype.name}, commit "
          f"{meta['git_commit']}, median of {repeats} × {steps} steps", flush=True)

    rows = []
    for model, label, cfg in cases:
        if model not in args.models.split(","):
            continue
        for norm in (norms if model == "transformer" else [None]):
            setup = (transformer_setup(cfg, norm, dtype) if model == "transformer"
                     else resnet_setup(cfg, dtype))
            flax = measure(*setup, ours=False, **timing)
            with jax_ops.use(impl_all, **impl_pairs):
                ours = measure(*setup, ours=True, **timing)
            del setup   # frees this size's parameters before the next
            rows.append(dict(model=model, size=label, norm=norm, config=cfg, flax=flax, ours=ours,
                             speedup=flax["ms_per_step"] / ours["ms_per_step"]))
            print(f"{model} {label} {norm or ''}: flax {flax['ms_per_step']:.2f} ms, ours "
                  f"{ours['ms_per_step']:.2f} ms, first loss {flax['first_loss']:.5f} / "
                  f"{ours['first_loss']:.5f}", flush=True)

    table = markdown_table(rows)
    print(table + kernel_lists(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(meta=meta, results=rows, table=table), indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
