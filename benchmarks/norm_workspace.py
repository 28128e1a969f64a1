"""Temporary memory of a lone norm's jitted forward + backward (vjp with a given dy):
jax_ops (cuda) against flax.linen's LayerNorm / RMSNorm under JAX autodiff, from
compiled.memory_analysis() (compile only, nothing runs), and the CUDA backward's
workspace rows on this GPU (issue 20, item 4). Prints a table; --json PATH writes it.
Environment: WS_SHAPES (ROWSxCOLS,...) replaces the shapes."""
import argparse
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp

import jax_ops
from jax_ops import _extension

SHAPES = [(8192, 4096), (8192, 4352), (49152, 32), (49152, 128), (49152, 768), (49152, 1024), (49152, 4096),
          (49152, 4352), (49152, 8192), (2048, 16384), (16384, 16384), (8192, 32768), (512, 65536),
          (4096, 65536)]
if os.environ.get("WS_SHAPES"):
    SHAPES = [tuple(int(d) for d in s.split("x")) for s in os.environ["WS_SHAPES"].split(",")]
MiB = 1 << 20


def temp(f, shape, dtype, n_params):
    args = [jax.ShapeDtypeStruct(shape, dtype)] + [jax.ShapeDtypeStruct(shape[-1:], jnp.float32)] * n_params
    dy = jax.ShapeDtypeStruct(shape, dtype)
    vjp = jax.jit(lambda dy, *a: jax.vjp(f, *a)[1](dy))
    return vjp.lower(dy, *args).compile().memory_analysis().temp_size_in_bytes


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dtype = jnp.dtype(a.dtype)
    rows_out = []
    print(f"{'op':10} {'shape':>14} {'ws rows':>8} {'ws MiB':>7} {'ours MiB':>9} {'flax MiB':>9} {'input MiB':>9}")
    for op in ("layer_norm", "rms_norm"):
        for shape in SHAPES:
            rms = op == "rms_norm"
            mod = (nn.RMSNorm(dtype=dtype, param_dtype=jnp.float32) if rms
                   else nn.LayerNorm(dtype=dtype, param_dtype=jnp.float32))
            names = ("scale",) if rms else ("scale", "bias")

            def flax_f(x, *ps):
                return mod.apply({"params": dict(zip(names, ps))}, x)

            def ours(x, *ps):
                return (jax_ops.rms_norm(x, ps[0], implementation="cuda") if rms
                        else jax_ops.layer_norm(x, ps[0], ps[1], implementation="cuda"))
            rows, cols = shape
            ws = _extension.norm_bwd_partial_rows(dtype.name, "float32", rows, cols, rms=rms, add=False,
                                                  dscale=True, dbias=not rms)
            t_ours, t_flax = temp(ours, shape, dtype, len(names)), temp(flax_f, shape, dtype, len(names))
            r = dict(op=op, shape=shape, dtype=dtype.name, workspace_rows=ws,
                     workspace_bytes=None if ws is None else (1 if rms else 2) * ws * cols * 4,
                     temp_ours=t_ours, temp_flax=t_flax, input_bytes=rows * cols * dtype.itemsize)
            rows_out.append(r)
            print(f"{op:10} {str(shape):>14} {ws!s:>8} {(r['workspace_bytes'] or 0) / MiB:7.2f} "
                  f"{t_ours / MiB:9.1f} {t_flax / MiB:9.1f} {r['input_bytes'] / MiB:9.1f}"
                  + ("" if t_ours <= t_flax else "   OURS > FLAX"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
