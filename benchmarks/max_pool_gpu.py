"""The max_pool rewrite at ResNet-50's stem pool (64, 112, 112, 64) bf16, 3x3 stride 2,
padding 1: forward + gradient of the original (XLA: reduce_window, select_and_scatter)
against jax_ops.optimize's replacement, kernel time per row from jax_ops.fx.profile
(profiler trace), with each row's bytes and GB/s.

  python benchmarks/max_pool_gpu.py
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

import jax_ops
from jax_ops import fx


def main():
    x = jax.random.normal(jax.random.key(0), (64, 112, 112, 64), jnp.bfloat16)
    ct = jax.random.normal(jax.random.key(1), (64, 56, 56, 64), jnp.bfloat16)

    def pool(x):
        return nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for label, f in (("original", pool), ("optimized", jax_ops.optimize(pool, policy="always"))):
        def step(x, f=f):
            y, vjp = jax.vjp(f, x)
            return y, vjp(ct)[0]
        prof = fx.profile(step, x)
        print(f"== {label}: forward + gradient, kernels {prof.total_us:.1f} us")
        print("\n".join(str(prof).splitlines()[:8]), flush=True)


if __name__ == "__main__":
    main()
