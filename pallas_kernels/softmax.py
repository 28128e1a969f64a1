"""Softmax / LogSoftmax forward and backward as Pallas kernels (Triton back end).

Layout: x is (rows, cols), the softmax axis last; one program owns `block_rows`
whole rows as a (block_rows, next_pow2(cols)) tile in registers, masked at the
column tail and the last row block (the tile is addressed with index arrays,
common.tile_index: a static slice past the array's end is an error since jax 0.12).
Math in float32, one pass over HBM each way.

Masks: `mask` is (mask_rows, cols), bool (True = keep; read in place as PRED
bytes, no conversion kernel) or floating (added to the scaled logits); row r of
x uses mask row Σ ((r // inner) % size) * stride over `mask_map`'s (inner, size,
stride) groups, gathered in the kernel, so broadcast masks are never materialized.
causal: keep column j of row r iff j <= r % q_len + offset.

Backward from y only (see jax_ops/softmax.py for the formulas); no workspace.
Limits: cols <= MAX_COLS (a whole row in one program's registers).
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

MAX_COLS = 32768


def supports(cols: int) -> tuple[bool, str]:
    if cols > MAX_COLS:
        return False, f"pallas keeps a whole row in registers: cols <= {MAX_COLS}, got {cols}"
    return True, ""


def default_config(rows: int, cols: int, stage: str) -> dict:
    """Heuristic tile: ~8K elements a program (4K in the backward, which holds y and
    dy), ~16 elements a thread."""
    return default_tile(rows, cols, 8192 if stage == "fwd" else 4096)


def candidate_configs(rows: int, cols: int, stage: str) -> list[dict]:
    """The tunable space autotune explores (the default first)."""
    return unique_configs([default_config(rows, cols, stage)] + tile_configs(cols))


# ---------------------------------------------------------------- forward ---

def _fwd_kernel(*refs, rows, cols, block_rows, scale, log, causal, q_len, offset, mask_kind,
                mask_map):
    x_ref = refs[0]
    mask_ref = refs[1] if mask_kind != "none" else None
    y_ref = refs[-1]
    cp = next_pow2(cols)
    r = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    c = jnp.arange(cp)
    row_ok = r < rows
    ok = row_ok[:, None] & (c < cols)[None, :]
    tile = tile_index(pl.program_id(0) * block_rows, block_rows, cp)  # masked by ok

    z = plgpu.load(x_ref.at[tile], mask=ok, other=0.0).astype(jnp.float32)
    if scale != 1.0:
        z = z * scale
    keep = ok
    if mask_ref is not None:
        mrow = jnp.zeros_like(r)
        for inner, size, stride in mask_map:
            mrow = mrow + ((r // inner) % size) * stride
        mrow = jnp.where(row_ok, mrow, 0)
        mv = plgpu.load(mask_ref.at[mrow[:, None], c[None, :]], mask=ok,
                        other=False if mask_ref.dtype == jnp.bool_ else 0)
        if mask_kind == "bool":
            keep = keep & (mv != 0)
        else:
            z = z + mv.astype(jnp.float32)
    if causal:
        keep = keep & (c[None, :] <= (r % q_len)[:, None] + offset)
    z = jnp.where(keep, z, -jnp.inf)

    m = jnp.max(z, axis=1)
    m = jnp.where(m == -jnp.inf, 0.0, m)  # every logit masked (or a padding row)
    e = jnp.exp(z - m[:, None])
    s = jnp.sum(e, axis=1)
    empty = s == 0.0  # a NaN makes s NaN and reaches the whole row
    if log:  # (z - m) - log s keeps log s's bits when |m| is large
        y = jnp.where(empty[:, None], -jnp.inf, (z - m[:, None]) - jnp.log(s)[:, None])
    else:
        y = e * jnp.where(empty, 0.0, 1.0 / s)[:, None]
    plgpu.store(y_ref.at[tile], y.astype(y_ref.dtype), mask=ok)


def softmax_fwd(x, mask, *, scale: float, log: bool, causal: bool, q_len: int, offset: int,
                mask_kind: str, mask_map: tuple, config: dict | None = None,
                interpret: bool = False):
    """x: (rows, cols); mask: (mask_rows, cols) bool (kind "bool") or floating ("add"),
    or None (kind "none"). Returns y, x's dtype."""
    rows, cols = x.shape
    cfg = config or default_config(rows, cols, "fwd")
    block_rows = cfg["block_rows"]
    kernel = functools.partial(
        _fwd_kernel, rows=rows, cols=cols, block_rows=block_rows, scale=float(scale), log=log,
        causal=causal, q_len=max(int(q_len), 1), offset=int(offset), mask_kind=mask_kind,
        mask_map=tuple(tuple(int(v) for v in g) for g in mask_map))
    operands = [x] + ([] if mask is None else [mask])
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows, cols), x.dtype),
        grid=(pl.cdiv(rows, block_rows),), compiler_params=compiler_params(cfg["num_warps"]),
        interpret=interpret,
        name="jax_ops_log_softmax_fwd" if log else "jax_ops_softmax_fwd")(*operands)


# --------------------------------------------------------------- backward ---

def _bwd_kernel(y_ref, dy_ref, dx_ref, *, rows, cols, block_rows, scale, log):
    cp = next_pow2(cols)
    row0 = pl.program_id(0) * block_rows
    ok = (row0 + jnp.arange(block_rows) < rows)[:, None] & (jnp.arange(cp) < cols)[None, :]
    tile = tile_index(row0, block_rows, cp)  # masked by ok
    # Padding reads as a masked element: y = 0 (softmax) or -inf (log_softmax).
    y = plgpu.load(y_ref.at[tile], mask=ok, other=-jnp.inf if log else 0.0).astype(jnp.float32)
    dy = plgpu.load(dy_ref.at[tile], mask=ok, other=0.0).astype(jnp.float32)
    if log:
        live = y != -jnp.inf
        dot = jnp.sum(jnp.where(live, dy, 0.0), axis=1)
        dx = jnp.where(live, scale * (dy - jnp.exp(y) * dot[:, None]), 0.0)
    else:
        dot = jnp.sum(dy * y, axis=1)
        dx = scale * (y * (dy - dot[:, None]))
    plgpu.store(dx_ref.at[tile], dx.astype(dx_ref.dtype), mask=ok)


def softmax_bwd(y, dy, *, scale: float, log: bool, config: dict | None = None,
                interpret: bool = False):
    """y, dy: (rows, cols). Returns dx, y's dtype."""
    rows, cols = y.shape
    cfg = config or default_config(rows, cols, "bwd")
    block_rows = cfg["block_rows"]
    kernel = functools.partial(_bwd_kernel, rows=rows, cols=cols, block_rows=block_rows,
                               scale=float(scale), log=log)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows, cols), y.dtype),
        grid=(pl.cdiv(rows, block_rows),), compiler_params=compiler_params(cfg["num_warps"]),
        interpret=interpret,
        name="jax_ops_log_softmax_bwd" if log else "jax_ops_softmax_bwd")(y, dy)
