"""Activation memory of relu/add_relu and the BatchNorm fusions vs XLA's (jax.nn.relu,
flax.linen.BatchNorm + jax.nn.relu, or plain jnp BatchNorm where flax is missing):

  residual MB   bytes the VJP keeps between forward and backward (jax.vjp under jit: the
                leaves of the returned vjp function), i.e. what a training step holds per
                layer until its backward runs;
  step temp MB  XLA's compiled memory analysis of one jitted forward+backward
                (temp_size_in_bytes; arguments and outputs are the same for both);
  fwd out MB    output_size_in_bytes of the jitted forward that returns y + residuals.

Usage: python benchmarks/memory_relu_bn.py [impl]   (impl: None = automatic)
"""
import sys

import jax
import jax.numpy as jnp

import jax_ops

IMPL = sys.argv[1] if len(sys.argv) > 1 else None
EPS = 1e-5
ON_GPU = jax.default_backend() == "gpu"
RELU_SHAPE = (49152, 1024) if ON_GPU else (512, 1024)
BN_SHAPES = [(16, 112, 112, 32), (128, 56, 56, 256)] if ON_GPU else [(2, 28, 28, 32)]


def flax_bn(dtype, add):
    try:
        import flax.linen as nn
    except Exception:  # noqa: BLE001
        def bn(x, s, b):
            xf = x.astype(jnp.float32)
            m = xf.mean(axis=tuple(range(x.ndim - 1)))
            v = jnp.square(xf - m).mean(axis=tuple(range(x.ndim - 1)))
            return ((xf - m) * jax.lax.rsqrt(v + EPS) * s + b).astype(x.dtype)
    else:
        mod = nn.BatchNorm(use_running_average=False, epsilon=EPS, dtype=dtype, param_dtype=jnp.float32)

        def bn(x, s, b):
            c = x.shape[-1]
            st = {"mean": jnp.zeros((c,)), "var": jnp.ones((c,))}
            return mod.apply({"params": {"scale": s, "bias": b}, "batch_stats": st}, x,
                             mutable=["batch_stats"])[0]
    if add:
        return lambda x, z, s, b: jax.nn.relu(bn(x, s, b) + z)
    return lambda x, s, b: jax.nn.relu(bn(x, s, b))


def measure(fn, args):
    mb = 1 / (1 << 20)
    _, vjp = jax.jit(lambda *a: jax.vjp(fn, *a))(*args)
    residual = sum(l.nbytes for l in jax.tree_util.tree_leaves(vjp) if hasattr(l, "nbytes"))
    del vjp

    def step(*a):
        y, v = jax.vjp(fn, *a)
        return v(jnp.ones_like(y))
    step_mem = jax.jit(step).lower(*args).compile().memory_analysis()
    fwd_mem = jax.jit(lambda *a: jax.vjp(fn, *a)).lower(*args).compile().memory_analysis()
    return residual * mb, step_mem.temp_size_in_bytes * mb, fwd_mem.output_size_in_bytes * mb


def row(name, ours, theirs):
    cells = [f"{a:9.1f} {b:9.1f} " + (f"{a / b:5.2f}" if b > 0.05 else "    -") for a, b in zip(ours, theirs)]
    print(f"{name:44s} " + "  ".join(cells))


print(f"device {jax.devices()[0].device_kind}; jax_ops implementation={IMPL or 'auto'}")
print(f"{'':44s} " + "  ".join(f"{h:>25s}" for h in ("residual MB ours xla ratio", "step temp MB ours xla", "fwd out MB ours xla")))
key = jax.random.key(0)
for dtype in (jnp.bfloat16, jnp.float32):
    dn = jnp.dtype(dtype).name
    x = jax.random.normal(key, RELU_SHAPE, dtype)
    row(f"relu {dn}{RELU_SHAPE}", measure(lambda x: jax_ops.relu(x, implementation=IMPL), (x,)),
        measure(jax.nn.relu, (x,)))
    row(f"add_relu {dn}{RELU_SHAPE}", measure(lambda x, z: jax_ops.add_relu(x, z, implementation=IMPL), (x, x)),
        measure(lambda x, z: jax.nn.relu(x + z), (x, x)))
    del x
    for shape in BN_SHAPES:
        x = jax.random.normal(key, shape, dtype)
        c = shape[-1]
        s, b = jnp.ones((c,)), jnp.zeros((c,))
        row(f"batch_norm_relu {dn}{shape}",
            measure(lambda x, s, b: jax_ops.batch_norm_relu(x, s, b, implementation=IMPL)[0], (x, s, b)),
            measure(flax_bn(dtype, False), (x, s, b)))
        row(f"batch_norm_add_relu {dn}{shape}",
            measure(lambda x, z, s, b: jax_ops.batch_norm_add_relu(x, z, s, b, implementation=IMPL)[0], (x, x, s, b)),
            measure(flax_bn(dtype, True), (x, x, s, b)))
        del x
