"""Which forms of conv + bias (+ side input) + relu does XLA on this GPU hand to cuDNN as one
fused convolution (custom call __cudnn$convBiasActivationForward)? bf16 NHWC, ResNet-50
stage-0 shapes. Prints, per form: the fused-conv custom calls and other kernels in the
optimized HLO, and the time per call (wall clock, median of 20 x 20 calls)."""
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

DN = ("NHWC", "HWIO", "NHWC")


def conv(x, w, pref=None):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=DN,
                                        preferred_element_type=pref)


def forms():
    f32, bf16 = jnp.float32, jnp.bfloat16
    return {
        # the conv_batch_norm fold as it is today: bf16 conv, + f32 bias, cast back; relu after
        "fold_f32_bias": lambda x, w, b, z: jax.nn.relu((conv(x, w).astype(f32) + b).astype(bf16)),
        "bf16_bias": lambda x, w, b, z: jax.nn.relu(conv(x, w) + b.astype(bf16)),
        "bf16_bias_max": lambda x, w, b, z: jnp.maximum(conv(x, w) + b.astype(bf16), 0),
        "f32_acc": lambda x, w, b, z: jax.nn.relu(conv(x, w, f32) + b).astype(bf16),
        "f32_conv_inputs": lambda x, w, b, z: jax.nn.relu(conv(x.astype(f32), w.astype(f32)) + b).astype(bf16),
        "bf16_side": lambda x, w, b, z: jax.nn.relu(conv(x, w) + b.astype(bf16) + z),
        "f32_acc_side": lambda x, w, b, z: jax.nn.relu(conv(x, w, f32) + b + z.astype(f32)).astype(bf16),
        "no_relu_bf16": lambda x, w, b, z: conv(x, w) + b.astype(bf16),
        "conv_only": lambda x, w, b, z: conv(x, w),
    }


def main():
    print(jax.__version__, jax.devices())
    key = jax.random.key(0)
    for (n, hw, cin, cout, k) in [(64, 56, 64, 64, 3), (64, 56, 64, 256, 1), (64, 28, 128, 512, 1)]:
        ks = jax.random.split(key, 4)
        x = jax.random.normal(ks[0], (n, hw, hw, cin), jnp.bfloat16)
        w = (jax.random.normal(ks[1], (k, k, cin, cout), jnp.float32) / (k * k * cin) ** 0.5).astype(jnp.bfloat16)
        b = jax.random.normal(ks[2], (cout,), jnp.float32)
        z = jax.random.normal(ks[3], (n, hw, hw, cout), jnp.bfloat16)
        print(f"\n== x {x.shape} w {w.shape}")
        for name, f in forms().items():
            jf = jax.jit(f)
            try:
                txt = jf.lower(x, w, b, z).compile().as_text()
            except Exception as e:  # noqa: BLE001
                print(f"{name:18s} compile failed: {str(e)[:200]}")
                continue
            calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', txt)))
            fusions = len(re.findall(r"^\s*\S+ = \S+ fusion\(", txt, re.M))
            y = jf(x, w, b, z); y.block_until_ready()
            ts = []
            for _ in range(20):
                t0 = time.perf_counter()
                for _ in range(20):
                    y = jf(x, w, b, z)
                y.block_until_ready()
                ts.append((time.perf_counter() - t0) / 20 * 1e6)
            print(f"{name:18s} {statistics.median(ts):8.1f} us  fusions={fusions}  calls={calls}")
            if "-v" in sys.argv:
                print("\n".join(l for l in txt.splitlines() if "custom-call" in l or " fusion(" in l))


if __name__ == "__main__":
    main()
