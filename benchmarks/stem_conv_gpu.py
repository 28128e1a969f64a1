"""ResNet-50's stem conv (64 x 224² x 3 -> 112² x 64, 7x7 stride 2, padding 3, bf16 NHWC)
as XLA/cuDNN runs it against conv_space_to_depth's regrouping (jax_ops/fx), kernel time
from jax_ops.fx.profile (profiler trace; XLA autotunes each conv):

- fwd:        conv(x, w)
- infer:      relu(conv(x, w) + b), b bf16 (the conv_batch_norm fold's form)
- wgrad:      the weight gradient for a given cotangent (x is the data; the forward is dead code)

variants: original; regrouped to 16 channels (12 + 4 zero channels, the shipped form);
regrouped to 12 channels (no channel padding); input channels zero-padded 3 -> 4 and
3 -> 8 without regrouping.

  python benchmarks/stem_conv_gpu.py [--batch 64]
"""
import argparse

import jax
import jax.numpy as jnp

from jax_ops import fx
from jax_ops.fx import conv_space_to_depth as s2d

DN = ("NHWC", "HWIO", "NHWC")


def params(x, w):
    return dict(window_strides=(2, 2), padding=((3, 3), (3, 3)), lhs_dilation=(1, 1),
                rhs_dilation=(1, 1),
                dimension_numbers=jax.lax.conv_dimension_numbers(x.shape, w.shape, DN),
                feature_group_count=1, batch_group_count=1, precision=None,
                preferred_element_type=None)


def original(x, w):
    return jax.lax.conv_general_dilated(x, w, **params(x, w))


def regrouped(multiple):
    def conv(x, w):
        old, s2d.CHANNEL_MULTIPLE = s2d.CHANNEL_MULTIPLE, multiple
        try:
            return s2d.space_to_depth_conv(x, w, params(x, w))
        finally:
            s2d.CHANNEL_MULTIPLE = old
    return conv


def channel_padded(c):
    def conv(x, w):
        extra = c - x.shape[-1]
        xp = jnp.pad(x, ((0, 0),) * 3 + ((0, extra),))
        wp = jnp.pad(w, ((0, 0),) * 2 + ((0, extra), (0, 0)))
        return jax.lax.conv_general_dilated(xp, wp, **params(xp, wp))
    return conv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (args.batch, 224, 224, 3), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (7, 7, 3, 64), jnp.float32) / 147 ** 0.5).astype(jnp.bfloat16)
    b = jax.random.normal(ks[2], (64,), jnp.bfloat16)
    ct = jax.random.normal(ks[3], (args.batch, 112, 112, 64), jnp.bfloat16)
    variants = {"original": original, "regrouped16": regrouped(8), "regrouped12": regrouped(1),
                "cin4": channel_padded(4), "cin8": channel_padded(8)}
    ref = original(x, w).astype(jnp.float32)
    for name, conv in variants.items():
        y = conv(x, w).astype(jnp.float32)
        err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
        modes = {
            "fwd": (lambda x, w, conv=conv: conv(x, w)),
            "infer": (lambda x, w, conv=conv: jax.nn.relu(conv(x, w) + b)),
            "wgrad": (lambda x, w, conv=conv: jax.vjp(lambda w: conv(x, w), w)[1](ct)[0]),
        }
        line = []
        for mode, f in modes.items():
            prof = fx.profile(f, x, w)
            line.append(f"{mode} {prof.total_us:8.1f} us")
            if mode == "wgrad":
                top = "; ".join(f"{r.time_us:.1f} {r.name[:40]}" for r in prof.rows[:4])
        print(f"{name:12s} {'  '.join(line)}  rel.err {err:.1e}\n    wgrad rows: {top}", flush=True)


if __name__ == "__main__":
    main()
