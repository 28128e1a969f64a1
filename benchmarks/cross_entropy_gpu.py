"""GPU check of cross_entropy / linear_cross_entropy through JAX: every implementation the
install has (cuda when the extension was built with CUDA) against xla and optax, then
forward + backward wall-clock times and XLA temporary memory at the issue's shapes
(docs/perf-notes.md, "Cross-entropy").
  python benchmarks/cross_entropy_gpu.py check bench      (add "lce" to skip the plain CE timings)"""
import sys, time
import warnings
warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
import optax
import jax_ops

IMPLS = tuple(i for i in ("xla", "pallas", "cuda") if i in jax_ops.implementations("cross_entropy", platform="cuda"))
print(jax.__version__, jax.devices(), IMPLS, flush=True)
f32, bf16 = jnp.float32, jnp.bfloat16


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check():
    rng = np.random.default_rng(0)
    for rows, V, dt in [(64, 1, f32), (37, 33, bf16), (128, 1031, bf16), (64, 4100, f32),
                        (32, 50257, bf16), (16, 50304, bf16), (8, 262144, bf16), (300, 5000, jnp.float16)]:
        x = jnp.asarray(3 * rng.standard_normal((rows, V)), dt)
        lab = jnp.asarray(rng.integers(0, V, rows), jnp.int32).at[0].set(-100)
        ct = jnp.asarray(rng.standard_normal(rows), f32)
        where = jnp.asarray(rng.random((1, V)) > 0.1).at[0, 0].set(True)
        out = {}
        for impl in IMPLS:
            for red in ("none", "mean"):
                kw = dict(ignore_index=-100, label_smoothing=0.1, z_loss=1e-4, where=where, reduction=red)
                def g(x):
                    l, vjp = jax.vjp(lambda x: jax_ops.cross_entropy(x, lab, implementation=impl, **kw), x)
                    return l, vjp(ct if red == "none" else jnp.float32(1.0))[0]
                out[impl, red] = jax.jit(g)(x)
        for red in ("none", "mean"):
            for impl in IMPLS[1:]:
                (l1, g1), (l2, g2) = out[impl, red], out["xla", red]
                print(f"check rows {rows} V {V} {jnp.dtype(dt).name} {red}: {impl} vs xla loss {rel(l1, l2):.1e} "
                      f"grad {rel(g1, g2):.1e} finite {bool(np.all(np.isfinite(np.asarray(g1, np.float32))))}",
                      flush=True)
        xo = x.astype(f32)
        l = jax.jit(lambda x: jax_ops.cross_entropy(x, lab % V, implementation=IMPLS[-1]))(x)
        print(f"  vs optax: {rel(l, optax.softmax_cross_entropy_with_integer_labels(xo, lab % V)):.1e}", flush=True)


def timeit(f, *args, n=10):
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(n):
        r = f(*args)
    jax.block_until_ready(r)
    return (time.perf_counter() - t) / n * 1e3


def temp_mib(f, *args):
    m = f.lower(*args).compile().memory_analysis()
    return m.temp_size_in_bytes / 2**20


def bench():
    rng = np.random.default_rng(1)
    N, V, d = 16384, 50304, 768
    x = jnp.asarray(2 * rng.standard_normal((N, V)), bf16)
    lab = jnp.asarray(rng.integers(0, V, N), jnp.int32)
    cases = {
        "optax f32 (users' form)": lambda x: optax.softmax_cross_entropy_with_integer_labels(x.astype(f32), lab).mean(),
        "ours xla": lambda x: jax_ops.cross_entropy(x, lab, reduction="mean", implementation="xla"),
    }
    for impl in IMPLS[1:]:
        cases[f"ours {impl}"] = (lambda i: lambda x: jax_ops.cross_entropy(x, lab, reduction="mean", implementation=i))(impl)
    for name, f in ({} if globals().get("SKIP_CE") else cases).items():
        g = jax.jit(jax.value_and_grad(f))
        fw = jax.jit(f)
        print(f"CE (16384, 50304) bf16 {name}: fwd+bwd {timeit(g, x):.2f} ms, temp {temp_mib(g, x):.0f} MiB; "
              f"fwd {timeit(fw, x):.2f} ms", flush=True)
    del x
    h = jnp.asarray(rng.standard_normal((N, d)), bf16)
    w = jnp.asarray(0.05 * rng.standard_normal((d, V)), bf16)
    lcases = {
        "optax f32 on h @ w": lambda h, w: optax.softmax_cross_entropy_with_integer_labels((h @ w).astype(f32), lab).mean(),
        "ours xla": lambda h, w: jax_ops.linear_cross_entropy(h, w, lab, reduction="mean", implementation="xla"),
    }
    for impl in IMPLS[1:]:
        for cr in (None, 1024, 4096):
            lcases[f"ours {impl} chunk {cr or 'default'}"] = (lambda i, cr: lambda h, w: jax_ops.linear_cross_entropy(
                h, w, lab, reduction="mean", implementation=i, chunk_rows=cr))(impl, cr)
    import re
    g = jax.jit(jax.value_and_grad(lcases[f"ours {IMPLS[-1]} chunk default"], (0, 1)))
    txt = g.lower(h, w).compile().as_text()
    for line in txt.splitlines():
        if "cublas" in line and "custom-call" in line:
            m = re.search(r'"beta":\s*([0-9.]+)', line)
            print("GEMM:", line.split("=")[0].strip()[:40], line.split("custom-call(")[1][:80] if "custom-call(" in line else "",
                  "beta", m.group(1) if m else "?", flush=True)
    for name, f in lcases.items():
        g = jax.jit(jax.value_and_grad(f, (0, 1)))
        print(f"linear CE h (16384, 768) w (768, 50304) bf16 {name}: fwd+bwd {timeit(g, h, w, n=5):.2f} ms, "
              f"temp {temp_mib(g, h, w):.0f} MiB", flush=True)


if "lce" in sys.argv:
    bench.__globals__["SKIP_CE"] = True
if "check" in sys.argv:
    check()
if "bench" in sys.argv:
    bench()
