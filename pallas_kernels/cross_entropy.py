"""Fused cross-entropy as Pallas kernels (Triton back end): the forward computes the loss
and, in training, dlogits in the same pass; the backward scales dlogits by the cotangent
row by row, in place. The math is jax_ops/ops/cross_entropy.py's (and
cuda_src/cross_entropy_math.h's).

Layout: logits (rows, cols), the vocabulary last; labels (rows,) int32 in [0, cols]
(cols: out of range, the loss is NaN); weight (rows,) float32; mask None or bool
(mask_rows, cols) with mask_rows 1 (one row for every row) or rows.

Forward: one program owns `block_rows` rows and walks them in (block_rows, block_v)
tiles, block_v a power of two (tiles are addressed with index arrays,
common.tile_index's reason: jax 0.12 rejects static slices past the array's end; the
column tail and the last row block are masked). A row of at most block_v columns is one
tile, read once: max, Σ exp, Σ z, then dlogits from the same registers. Longer rows
take an online pass (running max and Σ exp rescaled per tile), then, with the gradient,
a second pass that reads the tiles again to write dlogits.

Backward: a (row block, column block) grid; a program whose rows all have g == 1 does
nothing (the result aliases dlogits: input_output_aliases), the others scale the rows
with g != 1.
On CPU the kernels run with interpret=True.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import compiler_params, next_pow2, unique_configs

MAX_BLOCK_V = 4096  # vocabulary columns of a tile (longer rows: several tiles)
_F32 = jnp.float32


def supports(cols: int) -> tuple[bool, str]:
    if cols >= 2**31 - MAX_BLOCK_V:
        return False, f"pallas cross_entropy indexes columns with int32: cols < {2**31 - MAX_BLOCK_V}, got {cols}"
    return True, ""


def default_config(rows: int, cols: int, stage: str) -> dict:
    """About 8K elements a tile (4K in the backward), 16 a thread."""
    block_v = min(next_pow2(cols), MAX_BLOCK_V)
    tile = 8192 if stage == "fwd" else 4096
    block_rows = max(1, min(64, tile // block_v, next_pow2(max(rows, 1))))
    return {"block_rows": block_rows, "block_v": block_v,
            "num_warps": max(1, min(16, block_rows * block_v // 512))}


def candidate_configs(rows: int, cols: int, stage: str) -> list[dict]:
    """The tunable space autotune explores (the default first)."""
    out = [default_config(rows, cols, stage)]
    for block_v in (1024, 2048, 4096):
        block_v = min(block_v, next_pow2(cols))
        for tile in (4096, 8192, 16384):
            block_rows = max(1, min(64, tile // block_v))
            for per_thread in (8, 16, 32):
                num_warps = block_rows * block_v // (32 * per_thread)
                if 1 <= num_warps <= 16:
                    out.append({"block_rows": block_rows, "block_v": block_v, "num_warps": num_warps})
    return unique_configs(out)


# ---------------------------------------------------------------- forward ---

def _fwd_kernel(*refs, rows, cols, block_rows, block_v, ls, zl, with_grad, has_mask, per_row_mask):
    x_ref, lab_ref, w_ref = refs[:3]
    k = 3
    m_ref = refs[k] if has_mask else None
    k += int(has_mask)
    loss_ref, lse_ref = refs[k], refs[k + 1]
    d_ref = refs[k + 2] if with_grad else None

    r = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    row_ok = r < rows
    lab = plgpu.load(lab_ref.at[r], mask=row_ok, other=0)
    w = plgpu.load(w_ref.at[r], mask=row_ok, other=0.0)
    lab_ok = row_ok & (lab >= 0) & (lab < cols)
    # The label's logit, read whether or not the mask keeps it (optax's semantics).
    z_lab = plgpu.load(x_ref.at[r[:, None], jnp.where(lab_ok, lab, 0)[:, None]],
                       mask=lab_ok[:, None], other=0.0).astype(_F32)
    z_lab = jnp.where(lab_ok, jnp.sum(z_lab, axis=1), jnp.nan)
    mrow = r if per_row_mask else jnp.zeros_like(r)

    def tile(j):
        """Columns, float32 logits and the kept entries of vocabulary tile j."""
        c = j * block_v + jnp.arange(block_v)
        ok = row_ok[:, None] & (c < cols)[None, :]
        z = plgpu.load(x_ref.at[r[:, None], c[None, :]], mask=ok, other=0.0).astype(_F32)
        keep = ok
        if has_mask:
            mv = plgpu.load(m_ref.at[mrow[:, None], c[None, :]], mask=ok, other=False)
            keep = keep & (mv != 0)
        return c, ok, z, keep

    def stats(z, keep, m, s):
        """(max, Σ exp against it) merged with a running pair (online softmax)."""
        zk = jnp.where(keep, z, -jnp.inf)
        nm = jnp.maximum(m, jnp.max(zk, axis=1))
        shift = jnp.where(nm == -jnp.inf, 0.0, nm)
        s = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(zk - shift[:, None]), axis=1)
        return nm, s

    def sums(z, keep):
        sz = jnp.sum(jnp.where(keep, z, 0.0), axis=1)
        n = jnp.sum(keep.astype(_F32), axis=1) if has_mask else jnp.zeros_like(sz)
        return sz, n

    nvb = pl.cdiv(cols, block_v)
    zeros = jnp.zeros((block_rows,), _F32)
    neg = jnp.full((block_rows,), -jnp.inf, _F32)
    if nvb == 1:
        first = tile(0)
        _, _, z, keep = first
        m, s = stats(z, keep, neg, zeros)
        sz, n = sums(z, keep)
    else:
        first = None

        def body(j, carry):
            m, s, sz, n = carry
            _, _, z, keep = tile(j)
            m, s = stats(z, keep, m, s)
            dsz, dn = sums(z, keep)
            return m, s, sz + dsz, n + dn
        m, s, sz, n = jax.lax.fori_loop(0, nvb, body, (neg, zeros, zeros, zeros))
    if not has_mask:
        n = jnp.full((block_rows,), float(cols), _F32)

    ms = jnp.where(m == -jnp.inf, 0.0, m)
    log_s = jnp.log(s)
    lse = ms + log_s
    loss = (ms - z_lab) + log_s
    if ls > 0.0:
        mean_z = jnp.where(n > 0, sz / jnp.maximum(n, 1.0), 0.0)
        loss = (1.0 - ls) * loss + ls * ((ms - mean_z) + log_s)
    if zl > 0.0:
        loss = loss + zl * lse * lse
    zero = w == 0.0
    plgpu.store(loss_ref.at[r], jnp.where(zero, 0.0, w * loss), mask=row_ok)
    plgpu.store(lse_ref.at[r], lse, mask=row_ok)
    if not with_grad:
        return

    a = w * (1.0 + 2.0 * zl * lse if zl > 0.0 else 1.0) / s
    b = jnp.where(n > 0, w * ls / jnp.maximum(n, 1.0), 0.0)
    cl = w * (1.0 - ls)

    def write(c, ok, z, keep):
        e = jnp.where(keep, jnp.exp(z - ms[:, None]), 0.0)
        d = a[:, None] * e
        if ls > 0.0:
            d = d - jnp.where(keep, b[:, None], 0.0)
        d = d - jnp.where(c[None, :] == lab[:, None], cl[:, None], 0.0)
        d = jnp.where(zero[:, None], 0.0, d)
        plgpu.store(d_ref.at[r[:, None], c[None, :]], d.astype(d_ref.dtype), mask=ok)

    if first is not None:  # the row is still in registers
        write(*first)
    else:
        def write_body(j, carry):
            write(*tile(j))
            return carry
        jax.lax.fori_loop(0, nvb, write_body, 0)


def ce_fwd(logits, labels, weight, mask, *, label_smoothing: float, z_loss: float, with_grad: bool,
           in_place: bool = False, config: dict | None = None, interpret: bool = False):
    """logits (rows, cols), labels (rows,) int32, weight (rows,) float32, mask None or bool
    (1 or rows, cols). Returns (loss, lse) float32 (rows,), and dlogits (logits' shape and
    dtype) or None; in_place: dlogits written over the logits (input_output_aliases; every
    tile is read before it is written)."""
    rows, cols = logits.shape
    cfg = config or default_config(rows, cols, "fwd")
    block_rows, block_v = cfg["block_rows"], cfg["block_v"]
    kernel = functools.partial(
        _fwd_kernel, rows=rows, cols=cols, block_rows=block_rows, block_v=block_v,
        ls=float(label_smoothing), zl=float(z_loss), with_grad=with_grad, has_mask=mask is not None,
        per_row_mask=mask is not None and mask.shape[0] == rows and rows > 1)
    out_shape = [jax.ShapeDtypeStruct((rows,), _F32), jax.ShapeDtypeStruct((rows,), _F32)]
    if with_grad:
        out_shape.append(jax.ShapeDtypeStruct((rows, cols), logits.dtype))
    operands = [logits, labels, weight] + ([] if mask is None else [mask])
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(pl.cdiv(rows, block_rows),),
        compiler_params=compiler_params(cfg["num_warps"]), interpret=interpret,
        input_output_aliases={0: 2} if in_place and with_grad else {},
        name="jax_ops_ce_fwd")(*operands)
    return outs[0], outs[1], (outs[2] if with_grad else None)


# --------------------------------------------------------------- backward ---

def _bwd_kernel(in_ref, g_ref, out_ref, *, rows, cols, block_rows, block_v):
    r = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    row_ok = r < rows
    g = plgpu.load(g_ref.at[r], mask=row_ok, other=1.0)
    scale = row_ok & (g != 1.0)  # the result aliases dlogits: rows with g == 1 are done
    c = pl.program_id(1) * block_v + jnp.arange(block_v)  # (outside pl.when: interpret mode)

    @pl.when(jnp.max(scale.astype(jnp.int32)) > 0)  # (Triton lowers no reduce_or)
    def _():
        ok = scale[:, None] & (c < cols)[None, :]
        idx = (r[:, None], c[None, :])
        v = plgpu.load(in_ref.at[idx], mask=ok, other=0.0).astype(_F32)
        plgpu.store(out_ref.at[idx], (v * g[:, None]).astype(out_ref.dtype), mask=ok)


def ce_bwd(dlogits, g, *, config: dict | None = None, interpret: bool = False):
    """dlogits (rows, cols), g (rows,) float32 -> dlogits * g[:, None], written in place
    (input_output_aliases)."""
    rows, cols = dlogits.shape
    cfg = config or default_config(rows, cols, "bwd")
    block_rows, block_v = cfg["block_rows"], cfg["block_v"]
    kernel = functools.partial(_bwd_kernel, rows=rows, cols=cols, block_rows=block_rows, block_v=block_v)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows, cols), dlogits.dtype),
        grid=(pl.cdiv(rows, block_rows), pl.cdiv(cols, block_v)),
        compiler_params=compiler_params(cfg["num_warps"]), interpret=interpret,
        input_output_aliases={0: 0}, name="jax_ops_ce_bwd")(dlogits, g)
