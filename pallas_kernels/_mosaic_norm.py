"""LayerNorm / RMSNorm forward over the last axis, Pallas Mosaic GPU back end (sm_90).

jax 0.11.2 has no Mosaic GPU lowering for `pl.pallas_call` (only Triton
CompilerParams register one), so this uses `plgpu.kernel` (Lane semantics).
pipelined=True: up to `max_ctas` CUDA blocks of one warpgroup (128 threads);
each walks a contiguous run of (block_rows, cols) tiles via `plgpu.emit_pipeline`
(2-deep when SMEM allows).  pipelined=False: one block per tile, plain
copy -> compute -> copy (also the interpret-mode body).  Either way:
tile -> SMEM by bulk async copy (rows are full and contiguous, so Mosaic uses
the plain `cp.async.bulk`, which has no 256-element box limit), SMEM ->
registers, float32 math, y / mean / rstd back through SMEM.

Register layout (the part that decides whether the reduction lowers):
`_ROW_LAYOUT` tiles the block by (4, 128): each of the 4 warps owns one row of
a 4-row group, its 32 lanes hold 4 consecutive columns each.  A sum along the
columns is then in-thread adds plus warp shuffles only (no cross-warp SMEM
scratch), and the per-row result has layout `_ROW_LAYOUT.reduce(1)`
(row per warp, replicated over lanes) which broadcasts back for free.
`scale`/`bias` use `_ROW_LAYOUT.reduce(0)` (replicated over warps).

Rows not divisible by block_rows: cdiv(rows, block_rows) tiles; the copy
engine clamps the last tile (the copy is byte-clamped to the array end), the
stale rows it leaves in SMEM are computed row-independently and their stores
are clamped too, so x is never padded.  mean/rstd go to a buffer padded to
whole tiles and are sliced after (a ragged f32 tail is not a 16-B multiple).

Checked on an H100 (jax 0.11.2, both bodies): all cases of
_mosaic_norm_check.py --gpu pass, incl. ragged tails and multi-step pipelines.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_WARPS = 4            # one warpgroup
_VEC = 4              # elements per lane per register (16 B for f32)
_COL_TILE = 32 * _VEC  # 128 columns per warp-row
_SMEM_BYTES = 227 * 1024  # opt-in SMEM per block on H100/H200
_SMEM_SLACK = 4 * 1024    # barriers, alignment, reduction scratch
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# (4, 128) tile -> dims (4 rows: warps, 32: lanes, 4: vector).  Already canonical.
_ROW_LAYOUT = plgpu.Layout.TILED(
    plgpu.Tiling(((_WARPS, _COL_TILE), (_VEC,))),
    warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1)


def _smem_bytes(block_rows, cols, dtype, buffers=2):
  itemsize = jnp.dtype(dtype).itemsize
  tiles = buffers * 2 * block_rows * cols * itemsize   # x in, y out
  stats = buffers * 2 * block_rows * 4                 # mean, rstd
  return tiles + stats + 2 * cols * 4                  # + scale, bias (f32)


def mosaic_supports(rows: int, cols: int, dtype, block_rows: int = 8,
                    buffers: int = 2):
  """(ok, reason) for the shape limits of `norm_fwd_mosaic`.

  buffers: SMEM copies of each tile (pipeline depth; 1 for pipelined=False).
  """
  dtype = jnp.dtype(dtype)
  if dtype not in [jnp.dtype(d) for d in _DTYPES]:
    return False, f"dtype {dtype} not in f32/bf16/f16"
  if rows < 1:
    return False, "rows must be >= 1"
  if cols % _COL_TILE:
    # Register layout needs whole (4, 128) tiles; this also makes every row
    # 16-byte aligned, which the bulk copy engine requires.
    return False, f"cols={cols} must be a multiple of {_COL_TILE}"
  if block_rows % _WARPS or block_rows < _WARPS:
    return False, f"block_rows={block_rows} must be a positive multiple of {_WARPS}"
  # mean/rstd tiles are block_rows f32 = 4*block_rows bytes; 16-B multiple.
  if (4 * block_rows) % 16:
    return False, "block_rows*4 bytes must be a multiple of 16"
  need = _smem_bytes(block_rows, cols, dtype, buffers) + _SMEM_SLACK
  if need > _SMEM_BYTES:
    return False, (f"SMEM {need} B > {_SMEM_BYTES} B for block_rows={block_rows},"
                   f" cols={cols}, {dtype}; lower block_rows")
  # Registers: each thread holds block_rows/4 * cols/32 f32 of the tile, which
  # must stay live across both reduction passes; above 128 ptxas spills.
  if block_rows // _WARPS * cols // 32 > 128:
    return False, (f"{block_rows // _WARPS * cols // 32} f32 regs/thread for the"
                   " tile (>128 would spill); lower block_rows")
  return True, "ok"


def default_block_rows(cols: int, dtype) -> int:
  """8 rows unless SMEM (single-buffered) or registers say 4."""
  for br in (8, 4):
    if mosaic_supports(1, cols, dtype, br, buffers=1)[0]:
      return br
  return 4


def _norm_tile(x_ref, s_ref, b_ref, y_ref, mean_ref, rstd_ref, *, epsilon,
               rms, cols, block_rows, cast):
  """One (block_rows, cols) tile, all refs in SMEM."""
  shape = (block_rows, cols)
  row_layout = _ROW_LAYOUT.reduce(1)
  col_layout = _ROW_LAYOUT.reduce(0)

  def rows_to_tile(v):  # (block_rows,) -> (block_rows, cols)
    return cast(lax.broadcast_in_dim(v, shape, (0,)), _ROW_LAYOUT)

  def cols_to_tile(v):  # (cols,) -> (block_rows, cols)
    return cast(lax.broadcast_in_dim(v, shape, (1,)), _ROW_LAYOUT)

  inv_n = 1.0 / cols
  # A layout cast right after a load is a hint to the load's lowering rule.
  x = cast(x_ref[...], _ROW_LAYOUT).astype(jnp.float32)
  if rms:
    ms = cast(jnp.sum(x * x, axis=1), row_layout) * inv_n
    rstd = lax.rsqrt(ms + epsilon)
    y = x * rows_to_tile(rstd)
    mean = None
  else:
    # Two-pass on the register-resident tile: numerically like the reference.
    mean = cast(jnp.sum(x, axis=1), row_layout) * inv_n
    xc = x - rows_to_tile(mean)
    var = cast(jnp.sum(xc * xc, axis=1), row_layout) * inv_n
    rstd = lax.rsqrt(var + epsilon)
    y = xc * rows_to_tile(rstd)
  if s_ref is not None:
    y = y * cols_to_tile(cast(s_ref[...], col_layout))
  if b_ref is not None:
    y = y + cols_to_tile(cast(b_ref[...], col_layout))
  y_ref[...] = y.astype(y_ref.dtype)
  if mean_ref is not None:
    mean_ref[...] = mean
  if rstd_ref is not None:
    rstd_ref[...] = rstd


def norm_fwd_mosaic(x, scale, bias, *, epsilon: float, rms: bool,
                    with_stats: bool, block_rows: int | None = 8,
                    interpret: bool = False, pipelined: bool = True,
                    max_ctas: int = 264, max_concurrent_steps: int | None = None):
  """x: (rows, cols) f32/bf16/f16; scale/bias: (cols,) or None.

  Returns (y, mean, rstd): y like x; mean/rstd f32 (rows,) (mean zeros for
  rms).  If with_stats=False, mean and rstd are None.  rms=True ignores bias.
  block_rows=None picks `default_block_rows(cols, dtype)`.
  pipelined=True: min(max_ctas, tiles) CUDA blocks (264 = 2 per SM on the 132
  SMs of H100/H200), each walking a contiguous run of tiles through
  `plgpu.emit_pipeline`, `max_concurrent_steps` deep (None: 2 if SMEM allows,
  else 1).  pipelined=False (forced by interpret=True, since the Mosaic GPU
  interpreter cannot run emit_pipeline's predicated stores): one CUDA block per
  tile with plain copy -> compute -> copy.
  """
  rows, cols = x.shape
  if block_rows is None:
    block_rows = default_block_rows(cols, x.dtype)
  pipelined = pipelined and not interpret
  if max_concurrent_steps is None:
    max_concurrent_steps = 2 if mosaic_supports(
        rows, cols, x.dtype, block_rows, buffers=2)[0] else 1
  buffers = max_concurrent_steps if pipelined else 1
  ok, why = mosaic_supports(rows, cols, x.dtype, block_rows, buffers=buffers)
  if not ok:
    raise ValueError(f"norm_fwd_mosaic: unsupported: {why}")
  if rms:
    bias = None
  has_scale, has_bias = scale is not None, bias is not None
  # scale/bias as f32 so the kernel multiplies in f32 whatever their dtype.
  vecs = [v.astype(jnp.float32) for v in (scale, bias) if v is not None]
  n_vec = len(vecs)
  # Kernel writes mean only for LayerNorm (RMS mean is zeros, made outside).
  n_stats = (1 if rms else 2) if with_stats else 0

  n_tiles = pl.cdiv(rows, block_rows)
  # Stats are written whole tiles at a time into a padded buffer: a clamped
  # bulk copy of a ragged tail would be (rows % block_rows) * 4 bytes, not a
  # 16-byte multiple as cp.async.bulk requires.
  stat_len = n_tiles * block_rows
  # UNDEFINED (not the default ZEROS) lets Mosaic use the plain contiguous
  # cp.async.bulk: full rows are contiguous, it has no 256-element box limit
  # and it clamps the byte count at the array end (ragged last y tile; rows
  # are whole, so the clamped size stays a 16-byte multiple).
  undef = plgpu.OOBFillMode.UNDEFINED
  tile_kw = dict(epsilon=float(epsilon), rms=rms, cols=cols,
                 block_rows=block_rows, cast=plgpu.layout_cast)

  def split(refs):
    it = iter(refs)
    take = lambda n: [next(it) for _ in range(n)]
    x_g, vec_g, y_g, stat_g = next(it), take(n_vec), next(it), take(n_stats)
    return x_g, vec_g, y_g, stat_g, list(it)

  def vec_args(vec_s):
    it_v = iter(vec_s)
    return (next(it_v) if has_scale else None), (next(it_v) if has_bias else None)

  def stat_args(stat_s):
    if not with_stats:
      return None, None
    return (None, stat_s[0]) if rms else tuple(stat_s)

  def body_pipelined(*refs):
    x_g, vec_g, y_g, stat_g, scratch = split(refs)
    vec_s, bar = scratch[:n_vec], (scratch[n_vec] if n_vec else None)
    cta = lax.axis_index("cta")
    # Clamp: the last CUDA block may run past n_tiles; it then recomputes and
    # rewrites the last tile with identical values instead of touching
    # entirely out-of-range rows.
    tile_idx = lambda s: jnp.minimum(cta * steps + s, n_tiles - 1)
    # scale/bias: one copy per CUDA block, reused by every tile.
    for g, sm in zip(vec_g, vec_s):
      plgpu.copy_gmem_to_smem(g, sm, bar, oob_mode=undef)
    if n_vec:
      plgpu.barrier_wait(bar)
    s_s, b_s = vec_args(vec_s)

    def step(_, x_s, y_s, *stat_s):
      _norm_tile(x_s, s_s, b_s, y_s, *stat_args(stat_s), **tile_kw)

    tile = plgpu.BlockSpec((block_rows, cols), lambda s: (tile_idx(s), 0),
                           oob_fill_mode=undef)
    stat = plgpu.BlockSpec((block_rows,), lambda s: (tile_idx(s),),
                           oob_fill_mode=undef)
    plgpu.emit_pipeline(
        step, grid=(steps,), in_specs=[tile], out_specs=[tile] + [stat] * n_stats,
        max_concurrent_steps=max_concurrent_steps,
    )(x_g, y_g, *stat_g)

  def body_simple(*refs):
    x_g, vec_g, y_g, stat_g, scratch = split(refs)
    x_s, y_s = scratch[:2]
    stat_s = scratch[2:2 + n_stats]
    vec_s = scratch[2 + n_stats:2 + n_stats + n_vec]
    bar = scratch[-1]
    t = lax.axis_index("cta")
    rows_sl = pl.ds(t * block_rows, block_rows)
    plgpu.copy_gmem_to_smem(x_g.at[rows_sl], x_s, bar, oob_mode=undef)
    for g, sm in zip(vec_g, vec_s):
      plgpu.copy_gmem_to_smem(g, sm, bar, oob_mode=undef)
    plgpu.barrier_wait(bar)
    _norm_tile(x_s, *vec_args(vec_s), y_s, *stat_args(stat_s), **tile_kw)
    plgpu.commit_smem()  # make the SMEM stores visible to the copy engine
    plgpu.copy_smem_to_gmem(y_s, y_g.at[rows_sl])
    for sm, g in zip(stat_s, stat_g):
      plgpu.copy_smem_to_gmem(sm, g.at[rows_sl])
    plgpu.wait_smem_to_gmem(0)  # SMEM must outlive the copies

  out_type = [jax.ShapeDtypeStruct((rows, cols), x.dtype)]
  out_type += [jax.ShapeDtypeStruct((stat_len,), jnp.float32)] * n_stats
  vec_scratch = [plgpu.SMEM((cols,), jnp.float32) for _ in vecs]
  if pipelined:
    steps = pl.cdiv(n_tiles, max_ctas)     # tiles per CUDA block
    n_ctas = pl.cdiv(n_tiles, steps)
    body = body_pipelined
    scratch = vec_scratch + ([plgpu.Barrier(num_arrivals=n_vec)] if n_vec else [])
  else:
    n_ctas = n_tiles
    body = body_simple
    scratch = ([plgpu.SMEM((block_rows, cols), x.dtype)] * 2
               + [plgpu.SMEM((block_rows,), jnp.float32)] * n_stats
               + vec_scratch + [plgpu.Barrier(num_arrivals=1 + n_vec)])
  outs = plgpu.kernel(
      body,
      out_type=out_type,
      scratch_types=scratch,
      grid=(n_ctas,),
      grid_names=("cta",),
      compiler_params=plgpu.CompilerParams(
          # Lane semantics: the explicit FragmentedArray layouts above drive
          # the lowering (Warpgroup semantics would run layout inference).
          lowering_semantics=plgpu.LoweringSemantics.Lane,
      ),
      # The generic interpreter has no rules for Mosaic GPU copies/barriers;
      # the Mosaic GPU interpreter (threads, SMEM, barriers emulated) does.
      interpret=plgpu.InterpretGPUParams() if interpret else False,
      kernel_name="mosaic_rms_norm_fwd" if rms else "mosaic_layer_norm_fwd",
  )(x, *vecs)
  y, stats = outs[0], [o[:rows] for o in outs[1:]]
  if not with_stats:
    return y, None, None
  if rms:
    return y, jnp.zeros((rows,), jnp.float32), stats[0]
  return y, stats[0], stats[1]
