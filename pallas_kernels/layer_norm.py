"""LayerNorm / RMSNorm forward and backward as Pallas kernels (Triton back end).

Layout: x is (rows, cols); one program owns `block_rows` whole rows, held in
registers as a (block_rows, next_pow2(cols)) tile (Triton tiles must have
power-of-two sides, so the column tail and the last row block are masked).
Statistics are two-pass over the on-chip tile (mean, then mean of squared
deviations), in float32. add+norm: the forward also reads a residual, writes
h = x + residual (rounded to x's dtype) and normalizes h; the backward adds dh to dx.
The tile is addressed with index arrays (common.tile_index), not
`pl.ds(0, next_pow2(cols))`: a static slice past the array's end is an error since jax 0.12.

Backward: `programs` programs each walk a contiguous range of row blocks,
write dx, and keep running float32 sums of dy*xhat and dy per column in
registers; each program stores its sums as one row of the [2, P, cols]
workspace, and the wrapper adds the P rows (two-stage, no atomics, the same
result on every run).

Limits: cols <= MAX_COLS (a whole row must fit in one program's registers);
`supports()` says so and the dispatcher picks another implementation above it.
Mosaic GPU versus Triton: see docs/design.md ("Pallas back end").
On CPU the kernels run with interpret=True.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (compiler_params, default_tile, next_pow2, tile_configs,
                                   tile_index, unique_configs)

MAX_COLS = 32768  # one row of float32 sums per program: 64 values a thread at 16 warps


def supports(cols: int) -> tuple[bool, str]:
    if cols > MAX_COLS:
        return False, f"pallas keeps a whole row in registers: cols <= {MAX_COLS}, got {cols}"
    return True, ""


# ---------------------------------------------------------------- configs ---

def default_config(rows: int, cols: int, stage: str) -> dict:
    """Heuristic tile: ~8K elements a program, ~16 elements a thread."""
    cfg = default_tile(rows, cols, 8192)
    if stage == "bwd":
        cfg["programs"] = 264  # two per SM on an H100/H200 (132 SMs)
    return cfg


def candidate_configs(rows: int, cols: int, stage: str) -> list[dict]:
    """The tunable space autotune explores (the default first)."""
    tiles = tile_configs(cols)
    if stage == "bwd":
        tiles = [dict(t, programs=p) for t in tiles for p in (132, 264, 528)]
    return unique_configs([default_config(rows, cols, stage)] + tiles)


# ---------------------------------------------------------------- forward ---

def _fwd_kernel(*refs, rows, cols, block_rows, eps, rms, has_scale, has_bias, with_stats, add,
                interpret):
    it = iter(refs)
    x_ref = next(it)
    r_ref = next(it) if add else None
    s_ref = next(it) if has_scale else None
    b_ref = next(it) if has_bias else None
    y_ref = next(it)
    h_ref = next(it) if add else None
    mean_ref = next(it) if (with_stats and not rms) else None
    rstd_ref = next(it) if with_stats else None

    cp = next_pow2(cols)
    row0 = pl.program_id(0) * block_rows
    row_ok = row0 + jnp.arange(block_rows) < rows
    col = jnp.arange(cp)  # the padded columns: an index array, masked (see common.tile_index)
    col_ok = col < cols
    ok = row_ok[:, None] & col_ok[None, :]
    tile = tile_index(row0, block_rows, cp)

    x = plgpu.load(x_ref.at[tile], mask=ok, other=0.0)
    if add:  # h = x + residual in x's dtype (rounded once), stored, then normalized
        h = x + plgpu.load(r_ref.at[tile], mask=ok, other=0.0)
        plgpu.store(h_ref.at[tile], h, mask=ok)
        x = h.astype(jnp.float32)
        if interpret and h.dtype != jnp.float32:
            # Interpreted, the kernel is XLA code, whose excess precision would drop h's
            # rounding before the float32 math (Triton keeps it).
            fi = jnp.finfo(h.dtype)
            x = jax.lax.reduce_precision(x, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    x = x.astype(jnp.float32)
    if rms:
        mean = None
        d = x
    else:
        mean = jnp.sum(x, axis=1) / cols
        d = jnp.where(ok, x - mean[:, None], 0.0)
    rstd = jax.lax.rsqrt(jnp.sum(d * d, axis=1) / cols + eps)
    y = d * rstd[:, None]
    if has_scale:
        y = y * plgpu.load(s_ref.at[col], mask=col_ok, other=0.0).astype(jnp.float32)[None, :]
    if has_bias:
        y = y + plgpu.load(b_ref.at[col], mask=col_ok, other=0.0).astype(jnp.float32)[None, :]
    plgpu.store(y_ref.at[tile], y.astype(y_ref.dtype), mask=ok)
    if mean_ref is not None:
        plgpu.store(mean_ref.at[pl.ds(row0, block_rows)], mean, mask=row_ok)
    if rstd_ref is not None:
        plgpu.store(rstd_ref.at[pl.ds(row0, block_rows)], rstd, mask=row_ok)


def norm_fwd(x, scale, bias, *, epsilon: float, rms: bool, with_stats: bool, residual=None,
             config: dict | None = None, interpret: bool = False):
    """x: (rows, cols); scale/bias: (cols,) or None; residual: like x or None.

    Returns (y, h|None, mean|None, rstd|None); h = x + residual, normalized instead of x."""
    rows, cols = x.shape
    cfg = config or default_config(rows, cols, "fwd")
    block_rows = cfg["block_rows"]
    kernel = functools.partial(
        _fwd_kernel, rows=rows, cols=cols, block_rows=block_rows, eps=float(epsilon), rms=rms,
        has_scale=scale is not None, has_bias=bias is not None, with_stats=with_stats,
        add=residual is not None, interpret=bool(interpret))
    out_shape = [jax.ShapeDtypeStruct((rows, cols), x.dtype)] * (1 if residual is None else 2)
    if with_stats and not rms:
        out_shape.append(jax.ShapeDtypeStruct((rows,), jnp.float32))
    if with_stats:
        out_shape.append(jax.ShapeDtypeStruct((rows,), jnp.float32))
    operands = [a for a in (x, residual, scale, bias) if a is not None]
    prefix = "jax_ops_add_" if residual is not None else "jax_ops_"
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(pl.cdiv(rows, block_rows),),
        compiler_params=compiler_params(cfg["num_warps"]), interpret=interpret,
        name=prefix + ("rms_norm_fwd" if rms else "layer_norm_fwd"))(*operands)
    y = outs[0]
    h = None if residual is None else outs[1]
    stats = outs[1 if residual is None else 2:]
    mean = stats[0] if (with_stats and not rms) else None
    rstd = stats[-1] if with_stats else None
    return y, h, mean, rstd


# --------------------------------------------------------------- backward ---

def _bwd_kernel(*refs, rows, cols, block_rows, blocks_per_program, rms, has_scale, param_grads,
                has_dh):
    it = iter(refs)
    dy_ref = next(it)
    dh_ref = next(it) if has_dh else None
    x_ref = next(it)
    mean_ref = None if rms else next(it)
    rstd_ref = next(it)
    s_ref = next(it) if has_scale else None
    dx_ref = next(it)
    work_ref = next(it) if param_grads else None

    cp = next_pow2(cols)
    col = jnp.arange(cp)  # index arrays, not pl.ds(0, cp): see common.tile_index
    col_ok = col < cols
    scale = None
    if has_scale:
        scale = plgpu.load(s_ref.at[col], mask=col_ok, other=0.0).astype(jnp.float32)
    pid = pl.program_id(0)

    def block(i, acc):
        row0 = (pid * blocks_per_program + i) * block_rows
        row_ok = row0 + jnp.arange(block_rows) < rows
        ok = row_ok[:, None] & col_ok[None, :]
        tile = tile_index(row0, block_rows, cp)
        rsl = pl.ds(row0, block_rows)
        x = plgpu.load(x_ref.at[tile], mask=ok, other=0.0).astype(jnp.float32)
        dy = plgpu.load(dy_ref.at[tile], mask=ok, other=0.0).astype(jnp.float32)
        rstd = plgpu.load(rstd_ref.at[rsl], mask=row_ok, other=0.0)
        if rms:
            xhat = x * rstd[:, None]
        else:
            mean = plgpu.load(mean_ref.at[rsl], mask=row_ok, other=0.0)
            xhat = (x - mean[:, None]) * rstd[:, None]
        g = dy * scale[None, :] if has_scale else dy
        # Padded entries have dy = 0, so g, g*xhat and dy*xhat vanish there.
        mean_gx = jnp.sum(g * xhat, axis=1) / cols
        dx = g - xhat * mean_gx[:, None]
        if not rms:
            dx = dx - (jnp.sum(g, axis=1) / cols)[:, None]
        dx = dx * rstd[:, None]
        if has_dh:  # add+norm: h's cotangent flows into dx unchanged
            dx = dx + plgpu.load(dh_ref.at[tile], mask=ok, other=0.0).astype(jnp.float32)
        plgpu.store(dx_ref.at[tile], dx.astype(dx_ref.dtype), mask=ok)
        if param_grads:
            acc_s, acc_b = acc
            return acc_s + jnp.sum(dy * xhat, axis=0), acc_b + jnp.sum(dy, axis=0)
        return acc

    if param_grads:
        zeros = jnp.zeros((cp,), jnp.float32)
        acc_s, acc_b = jax.lax.fori_loop(0, blocks_per_program, block, (zeros, zeros))
        # Row pid of work[0] gets the dy*xhat sums, of work[1] the dy sums. Index arrays of
        # shape (1, 1, cp), not pl.ds(0, cp) (past the end: an error since jax 0.12) nor
        # Python-int indices (interpret mode can't discharge a store at one).
        mask = col_ok[None, None, :]
        for i, acc in enumerate((acc_s, acc_b)):
            plane = jnp.full((1, 1, cp), i, jnp.int32)
            prow = jnp.full((1, 1, cp), pid, jnp.int32)
            plgpu.store(work_ref.at[plane, prow, col[None, None, :]], acc[None, None, :],
                        mask=mask)
    else:
        jax.lax.fori_loop(0, blocks_per_program, block, 0)


def bwd_programs(rows: int, cols: int, config: dict | None = None) -> int:
    """Programs of the backward when it keeps dscale/dbias partials: the rows of its
    [2, P, cols] workspace (each program walks a contiguous range of row blocks)."""
    cfg = config or default_config(rows, cols, "bwd")
    n_blocks = max(1, pl.cdiv(rows, cfg["block_rows"]))
    programs = max(1, min(cfg["programs"], n_blocks))
    return pl.cdiv(n_blocks, pl.cdiv(n_blocks, programs))


def norm_bwd(dy, x, mean, rstd, scale, *, rms: bool, work_shape: tuple[int, ...], dh=None,
             config: dict | None = None, interpret: bool = False):
    """dy, x: (rows, cols); mean (LayerNorm only), rstd: (rows,) float32; scale: (cols,) or None;
    dh: like dy or None (add+norm: added to dx; x is then h).

    work_shape: the primitive's [2, P, cols] workspace, or (0,) when no parameter
    gradients are wanted. Returns (dx, dscale_f32|None, dbias_f32|None, work).
    """
    rows, cols = x.shape
    cfg = config or default_config(rows, cols, "bwd")
    block_rows = cfg["block_rows"]
    n_blocks = pl.cdiv(rows, block_rows)
    param_grads = work_shape != (0,)
    if param_grads:
        programs = max(1, min(cfg["programs"], work_shape[1], n_blocks))
        blocks_per_program = pl.cdiv(n_blocks, programs)
        programs = pl.cdiv(n_blocks, blocks_per_program)
    else:  # no partial sums to keep: one program per row block
        programs, blocks_per_program = n_blocks, 1
    kernel = functools.partial(
        _bwd_kernel, rows=rows, cols=cols, block_rows=block_rows,
        blocks_per_program=blocks_per_program, rms=rms, has_scale=scale is not None,
        param_grads=param_grads, has_dh=dh is not None)
    out_shape = [jax.ShapeDtypeStruct((rows, cols), x.dtype)]
    if param_grads:  # only rows [0, programs) of the workspace are written and read
        out_shape.append(jax.ShapeDtypeStruct(work_shape, jnp.float32))
    operands = ([dy] + ([] if dh is None else [dh]) + [x] + ([] if rms else [mean]) + [rstd]
                + ([] if scale is None else [scale]))
    prefix = "jax_ops_add_" if dh is not None else "jax_ops_"
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(programs,),
        compiler_params=compiler_params(cfg["num_warps"]), interpret=interpret,
        name=prefix + ("rms_norm_bwd" if rms else "layer_norm_bwd"))(*operands)
    if not param_grads:
        return outs[0], None, None, None
    work = outs[1]
    sums = jnp.sum(work[:, :programs], axis=1)
    return outs[0], sums[0], sums[1], work
