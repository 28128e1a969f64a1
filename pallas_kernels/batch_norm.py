"""BatchNorm+ReLU / BatchNorm+Add+ReLU with a 1-bit mask, forward and backward, as
Pallas kernels (Triton back end).

Layout: x (and z, dy) are (rows, C), channels last; per-channel parameters and
statistics are float32 (C,). The mask is uint32 (mask_words(rows * C),): bit
i % 32 of word i // 32 belongs to flat element i = r * C + c and is 1 iff
pre = (x - mean) * (scale * rstd) + bias [+ z] (float32, this order) is > 0.
y = pre > 0 ? pre : (NaN ? NaN : 0), rounded once to x's dtype.

Forward:
- training: batch statistics, two-stage. Grid (P, column blocks): program
  (p, j) walks a contiguous run of row blocks of a (block_rows, block_cols) tile
  (channels on the fast axis), computes each tile's exact two-pass mean/M2 and
  Chan-merges it into its running (count, mean, M2) per channel, stored as
  work[0..2, p, c] = (mean, M2, count). jnp combines the P partials in a fixed
  order (mean = Σ n_p mean_p / N, M2 = Σ M2_p + n_p (mean_p - mean)^2,
  var = M2 / N, biased), so results are identical run to run (no atomics).
- the elementwise pass works on the flat view with relu.py's tiling: a program
  owns `block_words` mask words as a (block_words, 32) tile of flat elements
  (a word's 32 bits can span two rows when C % 32 != 0); channel i % C of each
  element indexes gathers of mean, scale * rstd and bias (C,). When 32 % C == 0
  the channel depends on the bit only (32 values a program); when C % 32 == 0
  it is 32 * (word % (C / 32)) + bit, contiguous along a row (vector loads).
- inference: mean = mean_in, var = var_in, rstd = rsqrt(var_in + eps); the
  elementwise pass only.

Backward: (block_rows, block_cols) tiles of (rows, C); the mask bit of (r, c) is
gathered from word (r*C + c) // 32. g = bit ? dy : 0, xhat = (x - mean) * rstd.
One kernel (grid (P, column blocks), programs walking contiguous row blocks as
above) writes per-program Σg and Σg·xhat partials into a [2, P, C] workspace,
dz = g, and in inference dx = scale * rstd * g; jnp adds the partials in a fixed
order (dbias, dscale). Training then runs an elementwise kernel (one tile a
program): dx = a*g + b*xhat + c, a = scale*rstd, b = (-a*dscale + 2*gvar/rstd)/N,
c = (-a*dbias + gmean)/N, N = rows.

The [3, P, C] / [2, P, C] partials are outputs of the pallas_calls, consumed here
and not returned; P <= work_rows(rows, C) (<= 16 MiB).
Limits: rows * C <= relu.MAX_ELEMENTS (int32 flat indices). On CPU the kernels run
with interpret=True.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (MASK_BITS, compiler_params, mask_words, next_pow2,
                                   unique_configs, word_tile_configs)
from pallas_kernels.relu import MAX_BLOCK_WORDS, MAX_ELEMENTS, pack_bits, relu_of, word_tile
from pallas_kernels.relu import default_config as _word_tile_default

_F32 = jnp.float32


def work_rows(rows: int, channels: int) -> int:
    """Rows P of the [3 or 2, P, C] partials workspace (the primitives' contract)."""
    return max(1, min(1024, rows, (16 << 20) // (4 * channels)))


def supports(rows: int, channels: int) -> tuple[bool, str]:
    n = rows * channels
    if n > MAX_ELEMENTS:
        return False, (f"pallas batch_norm_relu indexes elements with int32: rows * C <= "
                       f"{MAX_ELEMENTS}, got {rows} * {channels} = {n}")
    return True, ""


# ---------------------------------------------------------------- configs ---
# fwd: block_words/num_warps (elementwise pass, flat) and block_rows/block_cols/
#      red_warps/programs (training statistics).
# bwd: block_rows/block_cols/num_warps (both kernels) and programs (reduction).
# programs = P, the row ranges per column block (capped at work_rows and at the
# number of row blocks).

def _reduction_tile(rows: int, channels: int, tile: int) -> dict:
    """~`tile` elements, <= 128 channels wide (512 contiguous bytes of f32 a row),
    ~8 elements a thread."""
    block_cols = min(128, next_pow2(max(channels, 1)))
    block_rows = max(1, min(tile // block_cols, next_pow2(max(rows, 1))))
    return {"block_rows": block_rows, "block_cols": block_cols,
            "num_warps": max(1, min(8, block_rows * block_cols // 256))}


def _default_programs(channels: int, block_cols: int, total: int = 528) -> int:
    """~`total` programs in all (four per SM on an H100/H200)."""
    return max(1, total // pl.cdiv(max(channels, 1), block_cols))


def default_config(rows: int, channels: int, stage: str) -> dict:
    red = _reduction_tile(rows, channels, 2048)
    programs = _default_programs(channels, red["block_cols"])
    if stage.startswith("bwd"):
        return dict(red, programs=programs)
    flat = _word_tile_default(rows * channels, "fwd")
    return dict(flat, block_rows=red["block_rows"], block_cols=red["block_cols"],
                red_warps=red["num_warps"], programs=programs)


def candidate_configs(rows: int, channels: int, stage: str) -> list[dict]:
    """The tunable space autotune explores (the default first): the reduction tile
    and P, and (forward) the elementwise tile with the reduction's default."""
    default = default_config(rows, channels, stage)
    reductions = []
    for tile in (1024, 2048, 4096, 8192):
        red = _reduction_tile(rows, channels, tile)
        for total in (264, 528, 1056):
            reductions.append(dict(red, programs=_default_programs(channels, red["block_cols"],
                                                                   total)))
    if stage.startswith("bwd"):
        return unique_configs([default] + reductions)
    max_words = min(MAX_BLOCK_WORDS, next_pow2(mask_words(max(rows * channels, 1))))
    out = [default]
    out += [dict(default, **flat) for flat in word_tile_configs(max_words)]
    out += [dict(default, block_rows=r["block_rows"], block_cols=r["block_cols"],
                 red_warps=r["num_warps"], programs=r["programs"]) for r in reductions]
    return unique_configs(out)


def _row_ranges(rows: int, channels: int, block_rows: int, programs: int) -> tuple[int, int]:
    """(P, row blocks a program): contiguous runs of row blocks, P <= work_rows."""
    n_blocks = pl.cdiv(rows, block_rows)
    programs = max(1, min(programs, work_rows(rows, channels), n_blocks))
    blocks_per_program = pl.cdiv(n_blocks, programs)
    return pl.cdiv(n_blocks, blocks_per_program), blocks_per_program


def _column_tile(block_cols: int, channels: int):
    """This program's channels as a slice, their indices (block_cols,) and which exist."""
    cols = pl.ds(pl.program_id(1) * block_cols, block_cols)
    col = pl.program_id(1) * block_cols + jnp.arange(block_cols)
    return cols, col, col < channels


def _load_channels(ref, cols, col_ok):
    return plgpu.load(ref.at[cols], mask=col_ok, other=0.0)


def _store_partials(work_ref, parts, cols, col_ok):
    # Unit slices, not integer indices: interpret mode can't discharge a store at a
    # Python-int index. parts[i] goes to row program_id(0) of work[i].
    p = pl.program_id(0)
    for i, part in enumerate(parts):
        plgpu.store(work_ref.at[pl.ds(i, 1), pl.ds(p, 1), cols], part[None, None, :],
                    mask=col_ok[None, None, :])


# ------------------------------------------------------------- statistics ---

def _stats_kernel(x_ref, work_ref, *, rows, block_rows, block_cols, channels,
                  blocks_per_program):
    cols, _, col_ok = _column_tile(block_cols, channels)
    first_row = pl.program_id(0) * (blocks_per_program * block_rows)

    def block(i, carry):
        count, mean, m2 = carry
        row0 = first_row + i * block_rows
        ok = (row0 + jnp.arange(block_rows) < rows)[:, None] & col_ok[None, :]
        x = plgpu.load(x_ref.at[pl.ds(row0, block_rows), cols], mask=ok, other=0.0)
        x = x.astype(_F32)
        # Exact two-pass statistics of the tile, then Chan's merge into the run.
        n_tile = jnp.clip(rows - row0, 0, block_rows)
        tile_mean = jnp.sum(x, axis=0) / jnp.maximum(n_tile, 1).astype(_F32)
        d = jnp.where(ok, x - tile_mean[None, :], 0.0)
        tile_m2 = jnp.sum(d * d, axis=0)
        total = count + n_tile
        w_tile = n_tile.astype(_F32) / jnp.maximum(total, 1).astype(_F32)
        delta = tile_mean - mean
        mean = mean + delta * w_tile
        m2 = m2 + tile_m2 + delta * delta * (count.astype(_F32) * w_tile)
        return total, mean, m2

    zeros = jnp.zeros((block_cols,), _F32)
    count, mean, m2 = jax.lax.fori_loop(0, blocks_per_program, block,
                                        (jnp.int32(0), zeros, zeros))
    _store_partials(work_ref, (mean, m2, jnp.full((block_cols,), count.astype(_F32))),
                    cols, col_ok)


def batch_stats(x, *, config: dict, interpret: bool = False):
    """x: (rows >= 1, C). Returns float32 (mean, biased var) per channel."""
    rows, channels = x.shape
    block_rows, block_cols = config["block_rows"], config["block_cols"]
    programs, blocks_per_program = _row_ranges(rows, channels, block_rows, config["programs"])
    kernel = functools.partial(_stats_kernel, rows=rows, block_rows=block_rows,
                               block_cols=block_cols, channels=channels,
                               blocks_per_program=blocks_per_program)
    work = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((3, programs, channels), _F32),
        grid=(programs, pl.cdiv(channels, block_cols)),
        compiler_params=compiler_params(config["red_warps"]), interpret=interpret,
        name="jax_ops_bn_relu_stats")(x)
    # Stage 2: the contract's combine, over p in a fixed order.
    part_mean, part_m2, part_n = work[0], work[1], work[2]
    n = jnp.sum(part_n, axis=0)
    mean = jnp.sum(part_n * part_mean, axis=0) / n
    m2 = jnp.sum(part_m2 + part_n * jnp.square(part_mean - mean), axis=0)
    return mean, m2 / n


# ------------------------------------------------------ forward elementwise ---

def _channel_of(word, bit, idx, channels):
    """The channel of each flat element of the (block_words, 32) tile."""
    if MASK_BITS % channels == 0:  # depends on the bit only: (32,) gathers, broadcast
        return bit % channels
    if channels % MASK_BITS == 0:  # contiguous along a word: vectorizable gathers
        return (word % (channels // MASK_BITS))[:, None] * MASK_BITS + bit[None, :]
    return idx % channels


def _fwd_kernel(*refs, n, channels, block_words, has_z):
    it = iter(refs)
    x_ref = next(it)
    z_ref = next(it) if has_z else None
    mean_ref, a_ref, bias_ref, y_ref, mask_ref = it
    word, bit, idx = word_tile(block_words)
    ok = idx < n
    ch = _channel_of(word, bit, idx, channels)
    if ch.ndim == 1:  # one value per bit, the same for every word
        mean, a, bias = (plgpu.load(r.at[ch])[None, :] for r in (mean_ref, a_ref, bias_ref))
    else:
        mean, a, bias = (plgpu.load(r.at[ch], mask=ok, other=0.0)
                         for r in (mean_ref, a_ref, bias_ref))
    x = plgpu.load(x_ref.at[idx], mask=ok, other=0.0).astype(_F32)
    pre = (x - mean) * a + bias
    if has_z:
        pre = pre + plgpu.load(z_ref.at[idx], mask=ok, other=0.0).astype(_F32)
    # Padding entries must not set bits past n (they would hold bias > 0).
    pre = jnp.where(ok, pre, 0.0)
    plgpu.store(y_ref.at[idx], relu_of(pre).astype(y_ref.dtype), mask=ok)
    plgpu.store(mask_ref.at[pl.ds(pl.program_id(0) * block_words, block_words)],
                pack_bits(pre > 0, bit), mask=word < mask_words(n))


def _bn_relu_apply(x, z, mean, a, bias, *, config, interpret):
    rows, channels = x.shape
    n = rows * channels
    words = mask_words(n)
    block_words = config["block_words"]
    kernel = functools.partial(_fwd_kernel, n=n, channels=channels, block_words=block_words,
                               has_z=z is not None)
    operands = [x.reshape(n)] + ([] if z is None else [z.reshape(n)]) + [mean, a, bias]
    y, mask = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((n,), x.dtype), jax.ShapeDtypeStruct((words,), jnp.uint32)],
        grid=(pl.cdiv(words, block_words),), compiler_params=compiler_params(config["num_warps"]),
        interpret=interpret,
        name="jax_ops_bn_add_relu_fwd" if z is not None else "jax_ops_bn_relu_fwd",
    )(*operands)
    return y.reshape(rows, channels), mask


def bn_relu_fwd(x, z, scale, bias, mean_in, var_in, *, epsilon: float, training: bool,
                config: dict | None = None, interpret: bool = False):
    """x: (rows >= 1, C) float32/bfloat16/float16; z: None or like x; scale, bias (C,)
    float32; mean_in, var_in (C,) float32 (inference) or None (training).
    Returns (y like x, mask uint32 (mask_words(rows*C),), mean, var, rstd (C,) float32)."""
    rows, channels = x.shape
    if z is not None and z.shape != x.shape:
        raise ValueError(f"bn_relu_fwd: z must have x's shape {x.shape}, got {z.shape}")
    cfg = config or default_config(rows, channels, "fwd")
    scale, bias = scale.astype(_F32), bias.astype(_F32)
    if training:
        if rows * channels == 0:  # nothing to launch; no statistics without rows
            nan = jnp.full((channels,), jnp.nan, _F32)
            return jnp.zeros_like(x), jnp.zeros((0,), jnp.uint32), nan, nan, nan
        mean, var = batch_stats(x, config=cfg, interpret=interpret)
    else:
        mean, var = mean_in.astype(_F32), var_in.astype(_F32)
    rstd = jax.lax.rsqrt(var + jnp.float32(epsilon))
    if rows * channels == 0:
        return jnp.zeros_like(x), jnp.zeros((0,), jnp.uint32), mean, var, rstd
    y, mask = _bn_relu_apply(x, z, mean, scale * rstd, bias, config=cfg, interpret=interpret)
    return y, mask, mean, var, rstd


# --------------------------------------------------------------- backward ---

def _tile_grads(dy_ref, x_ref, mask_ref, row0, cols, col, mean, rstd, *, rows, channels,
                block_rows):
    """The tile (rows [row0, row0 + block_rows), channels cols), which entries exist,
    g = bit ? dy : 0 (in dy's dtype) and xhat."""
    row = row0 + jnp.arange(block_rows)
    row_ok, col_ok = row < rows, col < channels
    ok = row_ok[:, None] & col_ok[None, :]
    # Clamped so the flat index of a padding entry stays < rows * C (int32).
    flat = (jnp.where(row_ok, row, 0)[:, None] * channels
            + jnp.where(col_ok, col, 0)[None, :])
    packed = plgpu.load(mask_ref.at[jnp.right_shift(flat, 5)], mask=ok, other=0)  # flat // 32
    bit = jnp.right_shift(packed, (flat & (MASK_BITS - 1)).astype(jnp.uint32)) & jnp.uint32(1)
    tile = (pl.ds(row0, block_rows), cols)
    dy = plgpu.load(dy_ref.at[tile], mask=ok, other=0.0)
    g = jnp.where(bit != 0, dy, jnp.zeros_like(dy))
    x = plgpu.load(x_ref.at[tile], mask=ok, other=0.0).astype(_F32)
    xhat = (x - mean[None, :]) * rstd[None, :]
    return tile, ok, g, xhat


def _bwd_reduce_kernel(*refs, rows, channels, block_rows, block_cols, blocks_per_program,
                       has_z, write_dx):
    it = iter(refs)
    dy_ref, x_ref, mask_ref, mean_ref, rstd_ref = (next(it) for _ in range(5))
    a_ref = next(it) if write_dx else None
    work_ref = next(it)
    dz_ref = next(it) if has_z else None
    dx_ref = next(it) if write_dx else None

    cols, col, col_ok = _column_tile(block_cols, channels)
    mean, rstd = _load_channels(mean_ref, cols, col_ok), _load_channels(rstd_ref, cols, col_ok)
    a = _load_channels(a_ref, cols, col_ok) if write_dx else None
    first_row = pl.program_id(0) * (blocks_per_program * block_rows)

    def block(i, acc):
        tile, ok, g, xhat = _tile_grads(dy_ref, x_ref, mask_ref, first_row + i * block_rows,
                                        cols, col, mean, rstd, rows=rows, channels=channels,
                                        block_rows=block_rows)
        if has_z:
            plgpu.store(dz_ref.at[tile], g.astype(dz_ref.dtype), mask=ok)
        g = g.astype(_F32)
        if write_dx:  # inference: dx needs no batch sums
            plgpu.store(dx_ref.at[tile], (a[None, :] * g).astype(dx_ref.dtype), mask=ok)
        acc_gx, acc_g = acc
        return acc_gx + jnp.sum(g * xhat, axis=0), acc_g + jnp.sum(g, axis=0)

    zeros = jnp.zeros((block_cols,), _F32)
    sums = jax.lax.fori_loop(0, blocks_per_program, block, (zeros, zeros))
    _store_partials(work_ref, sums, cols, col_ok)


def _bwd_dx_kernel(dy_ref, x_ref, mask_ref, mean_ref, rstd_ref, a_ref, b_ref, c_ref, dx_ref, *,
                   rows, channels, block_rows, block_cols):
    cols, col, col_ok = _column_tile(block_cols, channels)
    mean, rstd, a, b, c = (_load_channels(r, cols, col_ok)
                           for r in (mean_ref, rstd_ref, a_ref, b_ref, c_ref))
    tile, ok, g, xhat = _tile_grads(dy_ref, x_ref, mask_ref, pl.program_id(0) * block_rows,
                                    cols, col, mean, rstd, rows=rows, channels=channels,
                                    block_rows=block_rows)
    dx = a[None, :] * g.astype(_F32) + b[None, :] * xhat + c[None, :]
    plgpu.store(dx_ref.at[tile], dx.astype(dx_ref.dtype), mask=ok)


def bn_relu_bwd(dy, x, mask, mean, rstd, scale, gmean, gvar, *, training: bool, has_z: bool,
                config: dict | None = None, interpret: bool = False):
    """dy, x: (rows, C); mask uint32 (mask_words(rows*C),); mean, rstd, scale (C,) float32;
    gmean, gvar (C,) float32 (training) or None. Returns (dx like x, dz like x or None,
    dscale (C,) float32, dbias (C,) float32)."""
    rows, channels = x.shape
    mean, rstd, scale = mean.astype(_F32), rstd.astype(_F32), scale.astype(_F32)
    if rows * channels == 0:
        zeros = jnp.zeros((channels,), _F32)
        return jnp.zeros_like(x), (jnp.zeros_like(x) if has_z else None), zeros, zeros
    cfg = config or default_config(rows, channels, "bwd")
    block_rows, block_cols = cfg["block_rows"], cfg["block_cols"]
    col_blocks = pl.cdiv(channels, block_cols)
    programs, blocks_per_program = _row_ranges(rows, channels, block_rows, cfg["programs"])
    params = compiler_params(cfg["num_warps"])
    a = scale * rstd
    write_dx = not training

    out_shape = [jax.ShapeDtypeStruct((2, programs, channels), _F32)]
    if has_z:
        out_shape.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
    if write_dx:
        out_shape.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
    kernel = functools.partial(
        _bwd_reduce_kernel, rows=rows, channels=channels, block_rows=block_rows,
        block_cols=block_cols, blocks_per_program=blocks_per_program, has_z=has_z,
        write_dx=write_dx)
    operands = [dy, x, mask, mean, rstd] + ([a] if write_dx else [])
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(programs, col_blocks), compiler_params=params,
        interpret=interpret, name="jax_ops_bn_relu_bwd_reduce")(*operands)
    work = outs[0]
    dz = outs[1] if has_z else None
    # Stage 2: fixed-order sums over p.
    dscale = jnp.sum(work[0], axis=0)
    dbias = jnp.sum(work[1], axis=0)
    if write_dx:
        return outs[-1], dz, dscale, dbias

    n = jnp.float32(rows)
    b = (-a * dscale + 2.0 * gvar.astype(_F32) / rstd) / n
    c = (-a * dbias + gmean.astype(_F32)) / n
    kernel = functools.partial(_bwd_dx_kernel, rows=rows, channels=channels,
                               block_rows=block_rows, block_cols=block_cols)
    dx = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(rows, block_rows), col_blocks), compiler_params=params,
        interpret=interpret, name="jax_ops_bn_relu_bwd_dx",
    )(dy, x, mask, mean, rstd, a, b, c)
    return dx, dz, dscale, dbias
