"""Check pallas_kernels/_mosaic_norm.py against a float64 NumPy reference.

CPU: `python -m pallas_kernels._mosaic_norm_check` (interpret mode).
GPU: `python -m pallas_kernels._mosaic_norm_check --gpu [--simple]` (real Mosaic
GPU compile; --simple checks the one-tile-per-block body instead of the pipeline).
Exits non-zero on any mismatch.
"""
import sys

import numpy as np
import jax
import jax.numpy as jnp

from pallas_kernels._mosaic_norm import (
    default_block_rows, mosaic_supports, norm_fwd_mosaic)


def ref_norm(x, scale, bias, eps, rms):
  x = np.asarray(x, np.float64)
  if rms:
    mean = np.zeros(x.shape[0])
    rstd = 1.0 / np.sqrt(np.mean(x * x, -1) + eps)
    y = x * rstd[:, None]
  else:
    mean = x.mean(-1)
    rstd = 1.0 / np.sqrt(((x - mean[:, None]) ** 2).mean(-1) + eps)
    y = (x - mean[:, None]) * rstd[:, None]
  if scale is not None:
    y = y * np.asarray(scale, np.float64)
  if bias is not None and not rms:
    y = y + np.asarray(bias, np.float64)
  return y, mean, rstd


def rel(a, b):
  a = np.asarray(a, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
  gpu = "--gpu" in sys.argv
  interpret = not gpu
  # On GPU check both bodies; interpret mode always runs the simple one.
  pipelined = "--simple" not in sys.argv
  print("jax", jax.__version__, jax.devices(), "pipelined" if pipelined and gpu else "simple")
  key = jax.random.PRNGKey(0)
  fails = 0
  cases = [(r, c) for c in (128, 256, 1024, 4096) for r in (16, 40, 1)]
  if gpu:  # many tiles per CUDA block: pipeline steps, clamped last block
    cases += [(8 * 264 * 3 + 5, 1024), (4 * 264 * 2 + 3, 4096)]
  for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2),
                     (jnp.float16, 1e-3)):
    for rows, cols in cases:
      for rms in (False, True):
        for affine in (True, False):
          br = default_block_rows(cols, dtype)
          ok, why = mosaic_supports(rows, cols, dtype, br, buffers=1)
          if not ok:
            print(f"SKIP {rows}x{cols} {jnp.dtype(dtype).name}: {why}")
            continue
          k1, k2, k3, key = jax.random.split(key, 4)
          # Offset mean so the two-pass variance matters.
          x = (3.0 + 2.0 * jax.random.normal(k1, (rows, cols))).astype(dtype)
          scale = (1.0 + 0.1 * jax.random.normal(k2, (cols,))) if affine else None
          bias = 0.1 * jax.random.normal(k3, (cols,)) if affine else None
          try:
            y, mean, rstd = norm_fwd_mosaic(
                x, scale, bias, epsilon=1e-5, rms=rms, with_stats=True,
                block_rows=br, interpret=interpret, pipelined=pipelined)
            y = jax.block_until_ready(y)
          except Exception as e:  # report and keep going: one run shows all
            fails += 1
            msg = str(e).strip().splitlines()
            print(f"ERR  {jnp.dtype(dtype).name} {rows}x{cols} rms={rms} "
                  f"affine={affine}: {type(e).__name__}: {msg[-1] if msg else ''}"
                  [:400])
            if fails == 1:
              import traceback; traceback.print_exc()
            continue
          ry, rm, rr = ref_norm(np.asarray(x.astype(jnp.float32)), scale, bias,
                                1e-5, rms)
          ey = rel(np.asarray(y.astype(jnp.float32)), ry)
          er = rel(rstd, rr)
          em = float(np.abs(np.asarray(mean) - rm).max()) if rms else rel(mean, rm)
          good = (ey <= tol and er <= 1e-5 and em <= 1e-5 and y.dtype == x.dtype
                  and mean.shape == (rows,) and rstd.dtype == jnp.float32)
          fails += not good
          print(f"{'ok  ' if good else 'FAIL'} {jnp.dtype(dtype).name:8s} "
                f"{rows:3d}x{cols:<5d} br={br} rms={rms!s:5} affine={affine!s:5} "
                f"y={ey:.2e} mean={em:.2e} rstd={er:.2e}")
  # with_stats=False path.
  x = jax.random.normal(key, (40, 256), jnp.float32)
  y, m, r = norm_fwd_mosaic(x, None, None, epsilon=1e-6, rms=True,
                            with_stats=False, interpret=interpret,
                            pipelined=pipelined)
  e = rel(np.asarray(y), ref_norm(np.asarray(x), None, None, 1e-6, True)[0])
  good = m is None and r is None and e <= 1e-6
  fails += not good
  print(f"{'ok  ' if good else 'FAIL'} with_stats=False y={e:.2e}")
  print("unsupported examples:",
        mosaic_supports(8, 100, jnp.float32), mosaic_supports(8, 8192, jnp.float32, 8, buffers=1),
        mosaic_supports(8, 128, jnp.int32))
  print("FAILURES:", fails)
  return 1 if fails else 0


if __name__ == "__main__":
  sys.exit(main())
