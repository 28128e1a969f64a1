"""Tests of jax_ops.softmax and jax_ops.log_softmax.

Everything is checked against a float64 NumPy reference written here (forward, the
analytic backward, and the additive mask's gradient), for every implementation that
can lower on the platform jax runs on (the host CPU in CI: "cuda" means our C++ host
handlers there, "pallas" the Pallas interpreter). Derivatives of every order (forward
mode, Hessians) are checked against those of jax.nn.softmax / log_softmax instead
(test_autodiff_matches_jnp_reference).

Reference: z = x * scale (+ additive mask), masked elements (bool mask False, causal,
additive -inf, x == -inf) are -inf; softmax = exp(z - max) / sum, all zeros on a
fully masked row; log_softmax = z - max - log(sum), all -inf on a fully masked row.
The reference gets the *same* (possibly low-precision) inputs upcast to float64.

Backward, from the output y only (dz is the gradient of the logits, dx = scale * dz):
  softmax      dz = y * (dy - sum_row(dy * y))
  log_softmax  dz = dy - exp(y) * sum_row(dy), 0 where y == -inf
where log_softmax's row sum runs over the unmasked elements (y > -inf) only: a masked
output is the constant -inf, whatever x is, so its cotangent reaches nothing. That is
the derivative of the function (test_reference_backward_matches_finite_differences
checks it) and what jax.nn.log_softmax(where=...) gives. The gradient of an additive
mask is dz summed over the dimensions it was broadcast along.

Error metric: ||out - ref|| / ||ref|| over the finite reference elements, plus a
per-element bound max|out - ref| <= tol * max|ref|; every output must be finite except
where the reference is -inf (log_softmax's masked elements), which must be -inf
exactly, and masked softmax outputs and masked gradients must be exactly 0.
For dx the yardstick is the size of the terms it cancels (|scale| y (|dy| + |dot|)
for softmax, |scale| (|dy| + exp(y) |sum dy|) for log_softmax) instead of ||dx||: a
row of one column has dx == 0 exactly and only that scale is meaningful.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import warnings
import zlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_ops
import support
from pallas_kernels import softmax as pallas_softmax

OPS = ("softmax", "log_softmax")
IMPLS = ("xla", "cuda", "pallas")
DTYPES = ("float32", "bfloat16", "float16")
FWD_TARGET = "jax_ops_softmax_fwd"
BWD_TARGET = "jax_ops_softmax_bwd"

# ||out - ref|| / ||ref|| and max|out - ref| / max|ref|, per x dtype.
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2.5e-3}
HEAVY_COLS = 65536
TOL_HEAVY_F32 = 3e-5  # float32 row sums of 65536 terms


PLATFORM = support.PLATFORM
AVAILABLE = support.available("softmax")


def need(impl):
    """Skips the calling test when `impl` cannot lower on this platform."""
    support.need("softmax", impl)


def call(op, x, *, impl=None, **kw):
    """jax_ops.softmax / jax_ops.log_softmax with implementation=impl."""
    return getattr(jax_ops, op)(x, implementation=impl, **kw)


# ------------------------------------------------------- float64 reference ---

def f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def _is_bool(mask) -> bool:
    return mask is not None and np.asarray(mask).dtype == np.bool_


def ref_logits(x, *, scale=None, mask=None, causal=False):
    """z = x * scale (+ additive mask), -inf where masked (float64, x's shape)."""
    x = f64(x)
    z = x * (1.0 if scale is None else float(scale))
    keep = np.ones(x.shape, bool)
    if mask is not None:
        if _is_bool(mask):
            keep &= np.broadcast_to(np.asarray(mask), x.shape)
        else:
            z = z + np.broadcast_to(f64(mask), x.shape)
    if causal:
        q, k = x.shape[-2:]
        keep &= np.arange(k)[None, :] <= np.arange(q)[:, None] + (k - q)
    return np.where(keep, z, -np.inf)


def ref_forward(x, *, axis=-1, scale=None, mask=None, causal=False, log=False):
    """(y, masked): the float64 reference output and where the logit is -inf."""
    z = ref_logits(x, scale=scale, mask=mask, causal=causal)
    masked = np.isneginf(z)
    if z.size == 0:
        return z.copy(), masked
    m = np.max(z, axis=axis, keepdims=True)
    empty = np.isneginf(m)
    m = np.where(empty, 0.0, m)
    e = np.exp(z - m)
    s = np.sum(e, axis=axis, keepdims=True)
    s = np.where(empty, 1.0, s)
    if log:
        y = np.where(empty, -np.inf, z - m - np.log(s))
    else:
        y = np.where(empty, 0.0, e / s)
    return y, masked


def ref_backward(y, dy, *, axis=-1, scale=None, log=False):
    """(dx, dz, dx_scale, dz_scale) from the float64 output y (see module docstring)."""
    y, dy = f64(y), f64(dy)
    s = 1.0 if scale is None else float(scale)
    if log:
        fin = ~np.isneginf(y)
        p = np.exp(y)  # 0 where y == -inf
        tot = np.sum(np.where(fin, dy, 0.0), axis=axis, keepdims=True)
        dz = np.where(fin, dy - p * tot, 0.0)
        dz_scale = np.where(fin, np.abs(dy) + p * np.abs(tot), 0.0)
    else:
        dot = np.sum(dy * y, axis=axis, keepdims=True)
        dz = y * (dy - dot)
        dz_scale = y * (np.abs(dy) + np.abs(dot))
    return s * dz, dz, abs(s) * dz_scale, dz_scale


def sum_to_shape(a, shape):
    """Sums a (x's shape) over the axes a mask of `shape` was broadcast along."""
    a = np.asarray(a)
    lead = a.ndim - len(shape)
    a = a.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and a.shape[i] != 1)
    return a.sum(axis=axes, keepdims=True).reshape(shape)


def assert_close(name, out, ref, *, tol, elem_tol=None, scale=None, exact=None):
    """out vs ref (float64): same shape; -inf exactly where ref is -inf; finite elsewhere;
    exactly equal where `exact`; relative norm error <= tol and per-element error <=
    elem_tol * max|ref| (or max|scale|) over the finite elements."""
    elem_tol = tol if elem_tol is None else elem_tol
    out = f64(out)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, f"{name}: shape {out.shape}, expected {ref.shape}"
    if out.size == 0:
        return

    def first(bad):
        return tuple(int(i) for i in np.argwhere(bad)[0])

    inf_ref = np.isneginf(ref)
    bad = inf_ref & ~np.isneginf(out)
    assert not bad.any(), (f"{name}: {int(bad.sum())} elements should be -inf, first at "
                           f"{first(bad)}: {out[first(bad)]!r}")
    bad = ~inf_ref & ~np.isfinite(out)
    assert not bad.any(), (f"{name}: {int(bad.sum())} non-finite elements, first at {first(bad)}: "
                           f"{out[first(bad)]!r} (expected {ref[first(bad)]!r})")
    if exact is not None:
        bad = np.broadcast_to(exact, out.shape) & ~(out == ref)
        assert not bad.any(), (f"{name}: {int(bad.sum())} masked elements differ, first at "
                               f"{first(bad)}: {out[first(bad)]!r}, expected exactly {ref[first(bad)]!r}")
    fin = ~inf_ref
    o, r = np.where(fin, out, 0.0), np.where(fin, ref, 0.0)
    s = r if scale is None else np.where(fin, np.asarray(scale, np.float64), 0.0)
    diff = np.abs(o - r)
    denom = max(np.linalg.norm(r), np.linalg.norm(s))
    if denom == 0.0:  # e.g. log_softmax over one column: y == 0 exactly
        assert diff.max() <= tol, f"{name}: expected zeros, max |out - ref| = {diff.max():.3g}"
        return
    rel = np.linalg.norm(o - r) / denom
    worst = tuple(int(i) for i in np.unravel_index(np.argmax(diff), diff.shape))
    assert rel <= tol, (f"{name}: relative error {rel:.3g} > {tol:g} (worst element {worst}: "
                        f"{out[worst]!r}, expected {ref[worst]!r})")
    elem_scale = max(np.abs(r).max(), np.abs(s).max())
    assert diff[worst] <= elem_tol * elem_scale, (
        f"{name}: element {worst} is {out[worst]!r}, expected {ref[worst]!r} "
        f"(error {diff[worst]:.3g} > {elem_tol:g} * {elem_scale:.3g})")


def bitwise_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ------------------------------------------------------------ input factory ---

def seed_of(text):
    return zlib.crc32(text.encode())


def make_x(rng, shape, dtype="float32", spread=2.0):
    return jnp.asarray(rng.standard_normal(shape) * spread + 0.5, dtype)


def make_mask(rng, kind, shape, x_dtype="float32", p_masked=0.25):
    """kind "bool" (True = keep); "f32", "x" or a dtype name: additive, float32 / x's dtype /
    that dtype, with some -inf."""
    if kind is None:
        return None
    if kind == "bool":
        return jnp.asarray(rng.random(shape) >= p_masked)
    vals = rng.standard_normal(shape) * 1.5
    vals[rng.random(shape) < p_masked * 0.6] = -np.inf
    return jnp.asarray(vals, {"f32": "float32", "x": x_dtype}.get(kind, kind))


@functools.cache
def fwd_bwd_fn(impl, axis=-1, scale=None, causal=False, mask_grad=False, ops=OPS, grad=True):
    """jit: (x, mask, dy) -> {op: (y, dx, dmask)} through jax.vjp, every op in `ops` in one
    program (one compile); dmask is None unless mask_grad (an additive mask); dx and
    dmask are None without grad (forward only)."""
    def f(op, x, mask):
        return call(op, x, impl=impl, axis=axis, scale=scale, mask=mask, causal=causal)

    @jax.jit
    def run(x, mask, dy):
        out = {}
        for op in ops:
            if not grad:
                out[op] = (f(op, x, mask), None, None)
            elif mask_grad:
                y, vjp = jax.vjp(partial(f, op), x, mask)
                dx, dmask = vjp(dy)
                out[op] = (y, dx, dmask)
            else:
                y, vjp = jax.vjp(lambda x, op=op: f(op, x, mask), x)
                out[op] = (y, vjp(dy)[0], None)
        return out
    return run


def check_against_reference(op, x, mask, dy, y, dx, dmask, *, axis=-1, scale=None, causal=False,
                            tol=None):
    """Forward output, dx and (additive masks) dmask against the float64 reference."""
    log = op == "log_softmax"
    dtype = jnp.dtype(x.dtype).name
    tol = tol or TOL[dtype]
    assert y.dtype == x.dtype and y.shape == x.shape, f"y: {y.dtype}{y.shape}"
    ry, masked = ref_forward(x, axis=axis, scale=scale, mask=mask, causal=causal, log=log)
    assert_close(f"{op} y", y, ry, tol=tol, exact=masked)
    if dx is None:  # forward only
        return ry, masked
    assert dx.dtype == x.dtype and dx.shape == x.shape, f"dx: {dx.dtype}{dx.shape}"
    rdx, rdz, dx_scale, dz_scale = ref_backward(ry, dy, axis=axis, scale=scale, log=log)
    assert_close(f"{op} dx", dx, rdx, tol=tol, scale=dx_scale, exact=masked)
    if dmask is not None:
        assert dmask.dtype == mask.dtype and dmask.shape == mask.shape, f"dmask: {dmask.dtype}{dmask.shape}"
        assert_close(f"{op} dmask", dmask, sum_to_shape(rdz, mask.shape), tol=tol,
                     scale=sum_to_shape(dz_scale, mask.shape))
    return ry, masked


def run_and_check(impl, x, mask=None, *, axis=-1, scale=None, causal=False, seed=0, tol=None, ops=OPS,
                  grad=True):
    """Runs fwd+vjp of every op (dmask too for an additive mask; forward only without
    grad) in one jit and checks them against the reference; returns {op: (y, dx, dmask)}."""
    dy = make_x(np.random.default_rng(seed + 1), x.shape, x.dtype, spread=1.0)
    mask_grad = mask is not None and not _is_bool(mask)
    out = fwd_bwd_fn(impl, axis, scale, causal, mask_grad, tuple(ops), grad)(x, mask, dy)
    for op in ops:
        y, dx, dmask = out[op]
        check_against_reference(op, x, mask, dy, y, dx, dmask, axis=axis, scale=scale, causal=causal,
                                tol=tol)
    return out


# ------------------------------------------------------------ test oracle ---

@pytest.mark.parametrize("op", OPS)
def test_reference_backward_matches_finite_differences(op):
    """The float64 analytic backward used as oracle (dx and an additive mask's gradient,
    masked and fully masked rows included) agrees with central differences of
    sum(y * dy) over the finite outputs."""
    log = op == "log_softmax"
    rng = np.random.default_rng(seed_of("oracle" + op))
    q, k, scale = 4, 6, -0.7
    x = rng.standard_normal((2, q, k)) * 2
    add = rng.standard_normal((q, k))
    add[1, 2] = add[3, 0] = -np.inf
    add[0, :] = -np.inf  # a fully masked row
    keep = rng.random((2, 1, k)) > 0.2
    keep[1, 0, :3] = False
    dy = rng.standard_normal(x.shape)
    h = 1e-6

    for mask, causal in ((add, False), (keep, True)):
        y, masked = ref_forward(x, scale=scale, mask=mask, causal=causal, log=log)
        dx, dz, _, _ = ref_backward(y, dy, scale=scale, log=log)
        assert np.all(dx[masked] == 0.0)

        def loss(x, m):
            out = ref_forward(x, scale=scale, mask=m, causal=causal, log=log)[0]
            return np.sum(np.where(masked, 0.0, out * dy))

        def num_grad(i):
            args = [x, mask]
            g = np.zeros(args[i].shape)
            for idx in np.ndindex(g.shape):
                up = [a.copy() for a in args]
                dn = [a.copy() for a in args]
                up[i][idx] += h
                dn[i][idx] -= h
                g[idx] = (loss(*up) - loss(*dn)) / (2 * h)
            return g

        np.testing.assert_allclose(dx, num_grad(0), rtol=1e-6, atol=1e-7)
        if not _is_bool(mask):
            np.testing.assert_allclose(sum_to_shape(dz, mask.shape), num_grad(1), rtol=1e-6, atol=1e-7)


# -------------------------------------------------- forward/backward matrix ---

COLS = [1, 2, 3, 31, 32, 33, 127, 1000, 1024, 1025, 4097]
PALLAS_COLS = [1, 2, 3, 31, 33, 127, 1024, 1025, 4097]  # + MAX_COLS once
LEADS = [(), (1,), (3,), (2, 5)]
PALLAS_LEADS = [(), (1,), (3,), (2, 2)]
# (mask kind, mask shape: "full" = x's, "k" = (cols,), "qk" = x's last two axes; causal; scale)
VARIANTS = [
    (None, None, False, None),
    ("bool", "full", False, 0.125),
    ("f32", "k", True, None),
    ("x", "qk", False, -2.0),
    ("bool", "qk", True, 0.125),
]


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    shape: tuple
    mask_kind: str | None
    mask_shape: tuple | None
    causal: bool
    scale: float | None
    seed: int

    def inputs(self):
        rng = np.random.default_rng(self.seed)
        x = make_x(rng, self.shape, self.dtype)
        return x, make_mask(rng, self.mask_kind, self.mask_shape, self.dtype)


def _case(dtype, lead, cols, variant, tag=""):
    kind, rule, causal, scale = variant
    shape = lead + (cols,)
    causal = causal and len(shape) >= 2
    mshape = None if kind is None else {"full": shape, "k": (cols,), "qk": shape[-2:]}[rule]
    cid = (f"{dtype}-{'x'.join(map(str, shape))}-mask_{kind}{'' if mshape is None else mshape}"
           f"{'-causal' if causal else ''}-scale_{scale}{tag}").replace(" ", "")
    return cid, Case(dtype, shape, kind, mshape, causal, scale, seed_of(cid))


def _matrix():
    params = []
    for impl in IMPLS:
        if impl == "cuda":  # cheap on CPU: every dtype at every width
            combos = [(d, c) for d in DTYPES for c in COLS]
            leads = LEADS
        elif impl == "xla":  # ~0.5 s of XLA compile a case: dtype cycled
            combos = [(DTYPES[i % 3], c) for i, c in enumerate(COLS)]
            leads = LEADS
        else:  # interpreted on CPU: few rows, dtype cycled
            combos = [(DTYPES[i % 3], c) for i, c in enumerate(PALLAS_COLS + [pallas_softmax.MAX_COLS])]
            leads = PALLAS_LEADS
        for i, (dtype, cols) in enumerate(combos):
            lead = (1,) if cols >= 32768 else leads[i % len(leads)]
            cid, case = _case(dtype, lead, cols, VARIANTS[i % len(VARIANTS)])
            params.append(pytest.param(case, impl, id=f"{impl}-{cid}"))
        if impl != "pallas":
            cid, case = _case("float32", (2,), HEAVY_COLS, VARIANTS[1])
            params.append(pytest.param(case, impl, id=f"{impl}-{cid}", marks=[pytest.mark.heavy]))
    return params


@pytest.mark.parametrize("case,impl", _matrix())
def test_matches_reference(case, impl):
    need(impl)
    x, mask = case.inputs()
    tol = TOL_HEAVY_F32 if (case.dtype == "float32" and case.shape[-1] == HEAVY_COLS) else None
    run_and_check(impl, x, mask, scale=case.scale, causal=case.causal, seed=case.seed, tol=tol)


@pytest.mark.parametrize("impl", IMPLS)
def test_pallas_column_limit(impl):
    """Pallas runs up to MAX_COLS columns and refuses more with a ValueError (before
    anything runs); the others take the long row."""
    need(impl)
    x = make_x(np.random.default_rng(seed_of("limit" + impl)), (1, pallas_softmax.MAX_COLS + 1))
    if impl == "pallas":
        assert "pallas" not in jax_ops.implementations(
            "softmax", platform=PLATFORM, shape=x.shape, dtype="float32")
        for op in OPS:
            with pytest.raises(ValueError, match=r"pallas"):
                call(op, x, impl=impl)
            with pytest.raises(ValueError, match=r"pallas"):
                jax.jit(lambda x: call(op, x, impl=impl)).lower(x)
    else:
        y = call("softmax", x, impl=impl)
        assert_close("y", y, ref_forward(x)[0], tol=TOL_HEAVY_F32)


# ------------------------------------------------------------ long rows ---

# Rows past 16384 values (past the CUDA backward's register tier; the forward's
# long-row kernel runs from 1025 columns), compiled per mask kind and causal rule; a
# bool mask or the rule (scale > 0) is folded into the row cache as -inf entries. One
# case per compiled variant, the fold's exclusions (additive masks, scale <= 0) and
# the unvectorized runtime path (odd cols).
LONG = 16392  # a multiple of 8 (vectorized for every dtype), past 16384
LONG_CASES = [
    # id, dtype, shape, mask kind, mask shape, causal, scale
    ("plain", "bfloat16", (3, LONG), None, None, False, None),
    ("bool_key_padding", "bfloat16", (2, 3, LONG), "bool", (2, 1, LONG), False, 0.125),
    ("causal", "float16", (2, 3, LONG), None, None, True, None),
    ("causal_q_gt_rows", "float32", (5, LONG), None, None, True, 0.5),
    ("f32_qk_causal", "float32", (2, 3, LONG), "f32", (3, LONG), True, None),
    ("x_full_negative_scale", "bfloat16", (3, LONG), "x", (3, LONG), False, -2.0),
    ("bool_causal_negative_scale", "float16", (2, 3, LONG), "bool", (2, 3, LONG), True, -0.5),
    ("bool_causal_zero_scale", "float16", (3, LONG), "bool", (3, LONG), True, 0.0),
    ("unvectorized_bool_causal", "bfloat16", (2, 3, LONG - 1), "bool", (2, 1, LONG - 1), True, 0.125),
    ("long_bool_causal", "bfloat16", (2, 65536), "bool", (2, 65536), True, 0.125),
]


@pytest.mark.parametrize("impl", ("xla", "cuda"))
@pytest.mark.parametrize("cid,dtype,shape,kind,mshape,causal,scale", LONG_CASES, ids=[c[0] for c in LONG_CASES])
def test_long_rows(cid, dtype, shape, kind, mshape, causal, scale, impl):
    need(impl)
    seed = seed_of("long" + cid)
    rng = np.random.default_rng(seed)
    x = make_x(rng, shape, dtype)
    mask = make_mask(rng, kind, mshape, dtype)
    if kind == "bool":  # one fully masked row among partly masked ones
        m = np.array(mask)
        m[(0,) * (m.ndim - 1)] = False
        mask = jnp.asarray(m)
    out = run_and_check(impl, x, mask, causal=causal, seed=seed, scale=scale)
    if kind == "bool":
        y = f64(out["softmax"][0])
        assert np.all(y[(0,) * (y.ndim - 1)] == 0.0)


# ------------------------------------------------------------------- masks ---

B4 = (2, 3, 4, 33)  # (batch, heads, queries, keys)
R9 = (2,) * 8 + (9,)  # rank 9: the kernels map x rows to mask rows by up to 4 axis groups
R10 = (2,) * 9 + (9,)
# id, x shape, mask kind, mask shape, causal, x dtype, gradients for every impl (cuda: always)
MASK_CASES = [
    ("bool_full", B4, "bool", B4, False, "float32", False),
    ("bool_k", B4, "bool", (33,), False, "bfloat16", False),
    ("bool_qk", B4, "bool", (4, 33), False, "float16", False),
    ("bool_key_padding", B4, "bool", (2, 1, 1, 33), False, "float32", False),
    ("bool_query_rows", B4, "bool", (4, 1), False, "float32", False),
    ("bool_scalar", B4, "bool", (), False, "float32", False),
    ("f32_full", B4, "f32", B4, False, "bfloat16", False),
    ("f32_k", B4, "f32", (33,), False, "float32", False),
    ("x_qk", B4, "x", (4, 33), False, "bfloat16", True),
    ("f32_key_padding", B4, "f32", (2, 1, 1, 33), False, "float32", True),
    ("x_key_padding", B4, "x", (2, 1, 1, 33), False, "float16", False),
    ("f32_per_head_rows", B4, "f32", (3, 1, 1), False, "float32", False),
    ("f16_mask_bf16_x", B4, "float16", (3, 4, 33), False, "bfloat16", True),
    ("bf16_mask_f16_x", B4, "bfloat16", (2, 1, 4, 33), False, "float16", False),
    ("x_has_unit_axis", (2, 1, 4, 33), "f32", (1, 1, 4, 33), False, "float32", False),
    ("x_unit_axis_key_padding", (2, 1, 4, 33), "bool", (2, 1, 1, 33), True, "float32", False),
    ("four_axis_groups", R9, "f32", (1, 2, 1, 2, 1, 2, 1, 2, 9), False, "float32", False),
    ("five_axis_groups", R10, "f32", (2, 1, 2, 1, 2, 1, 2, 1, 2, 9), False, "float32", False),
    ("causal_bool_key_padding", (2, 3, 6, 5), "bool", (2, 1, 1, 5), True, "float32", False),
    ("causal_f32_qk", B4, "f32", (4, 33), True, "bfloat16", True),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mid,shape,kind,mshape,causal,dtype,grad", MASK_CASES,
                         ids=[c[0] for c in MASK_CASES])
def test_masks(mid, shape, kind, mshape, causal, dtype, grad, impl):
    """Bool and additive masks of every broadcast shape (the kernels see them through a
    row map of up to 4 axis groups, materialized beyond); the additive mask's gradient
    is dz summed over the broadcast dimensions, in the mask's dtype and shape."""
    need(impl)
    seed = seed_of("mask" + mid)
    rng = np.random.default_rng(seed)
    x = make_x(rng, shape, dtype)
    mask = make_mask(rng, kind, mshape, dtype)
    run_and_check(impl, x, mask, causal=causal, seed=seed, scale=0.5 if kind == "x" else None,
                  grad=grad or impl == "cuda")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("q,k", [(6, 4), (4, 6), (5, 5), (1, 7), (7, 1)], ids=lambda v: str(v))
def test_causal(q, k, impl):
    """Bottom-right aligned: element (i, j) kept iff j <= i + (k - q); with q > k the
    first q - k rows are fully masked (softmax zeros, log_softmax -inf, dx zeros)."""
    need(impl)
    seed = seed_of(f"causal{q}x{k}")
    x = make_x(np.random.default_rng(seed), (2, 3, q, k))
    keep = np.arange(k)[None, :] <= np.arange(q)[:, None] + (k - q)
    out = run_and_check(impl, x, causal=True, seed=seed)
    for op in OPS:
        y, dx = f64(out[op][0]), f64(out[op][1])
        masked = np.broadcast_to(~keep, y.shape)
        assert np.all(y[masked] == (-np.inf if op == "log_softmax" else 0.0))
        assert np.all(dx[masked] == 0.0)
        assert np.all(np.isfinite(y[~masked]))
        if q > k:
            assert (~keep[: q - k]).all()
    if (q, k) == (4, 6):  # causal with the last axis given as a positive number
        y3 = jax.jit(lambda x: call("softmax", x, impl=impl, causal=True, axis=3))(x)
        # Same math; XLA may fuse a jitted graph differently from the eager one (last bit).
        np.testing.assert_allclose(f64(y3), f64(out["softmax"][0]), rtol=1e-6, atol=0)


# ---------------------------------------------------------- masked rows ---

FULLY_MASKED = ["bool", "additive_neg_inf", "x_all_neg_inf", "causal_q_gt_k"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("how", FULLY_MASKED)
def test_fully_masked_rows(how, impl):
    """A fully masked row: softmax all zeros (not NaN), log_softmax all -inf, dx zeros;
    the other rows are unaffected."""
    need(impl)
    seed = seed_of("fully" + how)
    rng = np.random.default_rng(seed)
    x = make_x(rng, (4, 37))
    mask, causal = None, False
    dead = np.zeros(4, bool)
    if how == "bool":
        m = rng.random((4, 37)) > 0.3
        m[1] = False
        m[3] = False
        mask, dead[[1, 3]] = jnp.asarray(m), True
    elif how == "additive_neg_inf":
        m = rng.standard_normal((4, 37)).astype(np.float32)
        m[0] = -np.inf
        m[2, ::2] = -np.inf
        mask, dead[0] = jnp.asarray(m), True
    elif how == "x_all_neg_inf":
        x = x.at[2].set(-jnp.inf).at[0, 5].set(-jnp.inf)
        dead[2] = True
    else:
        x = make_x(rng, (2, 9, 4))
        causal = True
    out = run_and_check(impl, x, mask, causal=causal, seed=seed)
    for op in OPS:
        y, dx, dmask = out[op]
        y, dx = f64(y), f64(dx)
        rows = (y.reshape(-1, 9, 4)[:, :5] if causal else y[dead])
        drows = (dx.reshape(-1, 9, 4)[:, :5] if causal else dx[dead])
        assert np.all(rows == (-np.inf if op == "log_softmax" else 0.0)), rows
        assert np.all(drows == 0.0) and not np.isnan(dx).any()
        if dmask is not None:
            assert np.all(np.isfinite(f64(dmask)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cols", [5, 1025, LONG])
def test_rows_with_neg_inf_entries(cols, impl):
    """x == -inf entries are masked out: softmax 0, log_softmax -inf, dx 0 there."""
    need(impl)
    seed = seed_of(f"neginf{cols}")
    rng = np.random.default_rng(seed)
    x = np.array(make_x(rng, (3, cols)))
    x[rng.random(x.shape) < 0.3] = -np.inf
    x[1, 0] = -np.inf
    x = jnp.asarray(x)
    run_and_check(impl, x, seed=seed, scale=0.125)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_magnitudes_are_stable(dtype, impl):
    """Logits of +-1e4 (exp would overflow without subtracting the row max)."""
    need(impl)
    seed = seed_of("large" + dtype)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.uniform(-1e4, 1e4, (3, 1000)), dtype)
    x = x.at[1, 7].set(1e4).at[1, 8].set(1e4 - 1)  # two near-equal maxima
    run_and_check(impl, x, seed=seed)
    if dtype == "float32":  # all equal large values: a uniform distribution
        run_and_check(impl, jnp.full((2, 40), 1e4, jnp.float32), seed=1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cols", [33, 1025, LONG])
def test_nan_row_is_isolated(cols, impl):
    """A NaN in row 1 leaves NaN in row 1 (at least where it was) and rows 0 and 2
    exactly as without it, forward and backward."""
    need(impl)
    seed = seed_of(f"nan{cols}")
    x = make_x(np.random.default_rng(seed), (3, cols))
    dy = make_x(np.random.default_rng(seed + 1), (3, cols), spread=1.0)
    x_nan = x.at[1, cols // 2].set(jnp.nan)
    run = fwd_bwd_fn(impl)
    out_ok, out_nan = run(x, None, dy), run(x_nan, None, dy)
    for op in OPS:
        y_ok, dx_ok, _ = out_ok[op]
        check_against_reference(op, x, None, dy, y_ok, dx_ok, None)
        y, dx = np.asarray(out_nan[op][0]), np.asarray(out_nan[op][1])
        assert np.isnan(y[1, cols // 2]), (
            f"{op}: a NaN input must not give a finite output; row 1 is {y[1][:8]}...")
        for got, ok, name in ((y, y_ok, "y"), (dx, dx_ok, "dx")):
            for r in (0, 2):
                assert bitwise_equal(got[r], np.asarray(ok)[r]), \
                    f"{op} {name} row {r} changed by a NaN in row 1"


# ------------------------------------------------------------- axes, shapes ---

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("axis", [0, -2])
def test_non_last_axis(axis, impl):
    """Reduction over a non-last axis of 3-D x (kernels transpose internally), with masks
    given in x's layout: an additive one broadcast along the softmax axis (axis 0), a
    bool one broadcast along another (axis -2 == 1); and bfloat16 without a mask."""
    need(impl)
    seed = seed_of(f"axis{axis}")
    rng = np.random.default_rng(seed)
    shape = (5, 6, 7)
    x = make_x(rng, shape)
    mask = (make_mask(rng, "f32", (6, 7)) if axis == 0
            else make_mask(rng, "bool", (5, 1, 7), p_masked=0.2))
    run_and_check(impl, x, mask, axis=axis, seed=seed, scale=0.5)
    run_and_check(impl, make_x(rng, shape, "bfloat16"), axis=axis, seed=seed)


@pytest.mark.parametrize("impl", IMPLS)
def test_rank1_and_one_row(impl):
    need(impl)
    seed = seed_of("rank1")
    x = make_x(np.random.default_rng(seed), (300,))
    mask = make_mask(np.random.default_rng(seed), "f32", (300,))
    out1 = run_and_check(impl, x, mask, seed=seed)
    out2 = run_and_check(impl, x[None], mask, seed=seed)
    for op in OPS:
        (y1, dx1, dm1), (y2, dx2, dm2) = out1[op], out2[op]
        fin = np.isfinite(f64(y1))
        np.testing.assert_allclose(f64(y2[0])[fin], f64(y1)[fin], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(f64(dm2), f64(dm1), rtol=1e-5, atol=1e-6)
    # rank-1: axis 0 is axis -1
    y0 = jax.jit(lambda x, m: call("softmax", x, impl=impl, axis=0, mask=m))(x, mask)
    np.testing.assert_allclose(f64(y0), f64(out1["softmax"][0]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape,axis,causal", [
    ((0, 16), -1, False), ((2, 0, 16), -1, True), ((4, 0), -1, False), ((0,), -1, False),
    ((3, 0, 5), 1, False), ((2, 3, 0), -1, True)], ids=lambda v: str(v))
def test_empty(shape, axis, causal, impl):
    """Zero rows or an empty softmax axis: an empty result of x's shape and dtype, and
    empty gradients (the additive mask's gradient: zeros of its shape)."""
    need(impl)
    for dtype in ("float32", "bfloat16"):
        x = jnp.zeros(shape, dtype)
        for op in OPS:
            y = call(op, x, impl=impl, axis=axis, causal=causal)
            assert y.shape == shape and y.dtype == x.dtype
            mask = jnp.ones(shape[-1:], jnp.float32)
            y, vjp = jax.vjp(lambda x, m: call(op, x, impl=impl, axis=axis, causal=causal, mask=m), x, mask)
            dx, dm = vjp(jnp.zeros_like(y))
            assert y.shape == shape and y.dtype == x.dtype
            assert dx.shape == shape and dx.dtype == x.dtype
            assert dm.shape == mask.shape and dm.dtype == mask.dtype
            np.testing.assert_array_equal(f64(dm), np.zeros(mask.shape))


@pytest.mark.parametrize("impl", IMPLS)
def test_numpy_inputs(impl):
    """x and masks given as NumPy arrays work like jax arrays."""
    need(impl)
    rng = np.random.default_rng(seed_of("numpy"))
    x = np.asarray(make_x(rng, (3, 10)))
    keep = rng.random((3, 10)) > 0.3
    add = np.asarray(make_mask(rng, "f32", (10,)))
    for op in OPS:
        for mask in (keep, add):
            y = call(op, x, impl=impl, mask=mask)
            assert isinstance(y, jax.Array) and y.dtype == np.float32
            np.testing.assert_array_equal(f64(y), f64(call(op, jnp.asarray(x), impl=impl,
                                                           mask=jnp.asarray(mask))))
            assert_close(f"{op} y", y, ref_forward(x, mask=mask, log=op == "log_softmax")[0], tol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_scale_types(impl):
    """scale as a Python int, NumPy scalar or float; the logits are x * scale."""
    need(impl)
    seed = seed_of("scales")
    x = make_x(np.random.default_rng(seed), (3, 20))
    scales = (3, np.float32(0.25), np.float64(-1.5), 1.0, 0.0, None)
    outs = jax.jit(lambda x: [[call(op, x, impl=impl, scale=s) for op in OPS] for s in scales])(x)
    for scale, ys in zip(scales, outs):
        for op, y in zip(OPS, ys):
            assert y.dtype == x.dtype
            assert_close(f"{op} scale={scale!r}", y,
                         ref_forward(x, scale=scale, log=op == "log_softmax")[0], tol=1e-5)
    # scale=1.0 is the same function as no scale
    np.testing.assert_allclose(f64(outs[3][0]), f64(outs[-1][0]), rtol=1e-7, atol=0)


# --------------------------------------------------------------- gradients ---

@pytest.mark.parametrize("impl", IMPLS)
def test_check_grads(impl):
    need(impl)
    rng = np.random.default_rng(seed_of("check_grads"))
    x = make_x(rng, (3, 7), spread=1.0)
    add = jnp.asarray(rng.standard_normal((3, 7)), jnp.float32)
    add_k = jnp.asarray(rng.standard_normal((7,)), jnp.float32)
    keep = jnp.asarray(rng.random((3, 7)) > 0.3).at[:, 0].set(True)
    kw = dict(order=1, modes=["rev"], eps=1e-3, atol=2e-2, rtol=2e-2)
    check_grads(jax.jit(lambda x: jax_ops.softmax(x, mask=keep, scale=0.5, implementation=impl)), (x,), **kw)
    check_grads(jax.jit(lambda x, m: jax_ops.softmax(x, mask=m, scale=-2.0, causal=True,
                                                     implementation=impl)), (x, add_k), **kw)
    check_grads(jax.jit(lambda x, m: jax_ops.log_softmax(x, mask=m, scale=0.5, implementation=impl)),
                (x, add), **kw)
    check_grads(jax.jit(lambda x: jax_ops.log_softmax(x, axis=0, implementation=impl)), (x,), **kw)


@pytest.mark.parametrize("impl", IMPLS)
def test_value_and_grad_under_jit(impl):
    """jit(value_and_grad) equals the eager grad and the reference."""
    need(impl)
    rng = np.random.default_rng(seed_of("vag"))
    x = make_x(rng, (6, 40))
    add = make_mask(rng, "f32", (40,))
    w = make_x(rng, (6, 40), spread=1.0)
    for op in OPS:
        log = op == "log_softmax"

        def loss(x, m):
            y = call(op, x, impl=impl, mask=m, scale=0.5)
            y = jnp.where(jnp.isneginf(y), 0.0, y) if log else y
            return jnp.sum(y * w)

        val, (dx, dm) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, add)
        if op == "softmax":  # eager (op by op) once
            dx_e, dm_e = jax.grad(loss, argnums=(0, 1))(x, add)
            np.testing.assert_allclose(f64(dx), f64(dx_e), rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(f64(dm), f64(dm_e), rtol=1e-6, atol=1e-6)
        ry, masked = ref_forward(x, mask=add, scale=0.5, log=log)
        np.testing.assert_allclose(float(val), np.sum(np.where(masked, 0.0, ry) * f64(w)),
                                   rtol=1e-5, atol=1e-5)
        # jnp.where's cotangent is 0 at masked elements, as the reference's
        rdx, rdz, dx_scale, dz_scale = ref_backward(ry, np.where(masked, 0.0, f64(w)), scale=0.5, log=log)
        assert_close(f"{op} dx", dx, rdx, tol=1e-5, scale=dx_scale, exact=masked)
        assert_close(f"{op} dmask", dm, sum_to_shape(rdz, add.shape), tol=1e-5,
                     scale=sum_to_shape(dz_scale, add.shape))


@pytest.mark.parametrize("impl", IMPLS)
def test_checkpoint_inside_grad(impl):
    need(impl)
    rng = np.random.default_rng(seed_of("remat"))
    x = make_x(rng, (2, 4, 48))
    add = make_mask(rng, "f32", (4, 48))
    w = make_x(rng, (2, 4, 48), spread=1.0)

    def body(x, m):
        p = call("softmax", x, impl=impl, mask=m, causal=True)
        return jnp.tanh(p) * 2.0 + x  # so the output is needed by the backward

    def loss(f):
        return lambda x, m: jnp.sum(f(x, m) * w)

    g_plain = jax.jit(jax.grad(loss(body), argnums=(0, 1)))(x, add)
    g_remat = jax.jit(jax.grad(loss(jax.checkpoint(body)), argnums=(0, 1)))(x, add)
    for a, b in zip(g_plain, g_remat):
        np.testing.assert_allclose(f64(b), f64(a), rtol=1e-6, atol=1e-6)
    y, masked = ref_forward(x, mask=add, causal=True)
    dy = 2.0 * (1.0 - np.tanh(y) ** 2) * f64(w)
    rdx, rdz, dx_scale, dz_scale = ref_backward(y, dy)
    assert_close("dx", f64(g_remat[0]) - f64(w), rdx, tol=1e-5, scale=dx_scale)
    assert_close("dmask", g_remat[1], sum_to_shape(rdz, add.shape), tol=1e-5,
                 scale=sum_to_shape(dz_scale, add.shape))


@pytest.mark.parametrize("impl", IMPLS)
def test_jacrev_matches_reference_jacobian(impl):
    """jacrev vmaps the backward over cotangents with y unbatched."""
    need(impl)
    x = make_x(np.random.default_rng(seed_of("jac")), (2, 5))
    for op in OPS:
        log = op == "log_softmax"
        jac = jax.jit(jax.jacrev(lambda x: call(op, x, impl=impl, scale=0.5)))(x)
        assert jac.shape == (2, 5, 2, 5)
        y = ref_forward(x, scale=0.5, log=log)[0]
        ref = np.zeros((2, 5, 2, 5))
        for idx in np.ndindex(2, 5):
            e = np.zeros((2, 5))
            e[idx] = 1.0
            ref[idx] = ref_backward(y, e, scale=0.5, log=log)[0]
        np.testing.assert_allclose(f64(jac), ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------- autodiff of every order ---

AUTODIFF_CASES = ("plain", "scale", "add_mask", "bool_mask", "causal")


def jnp_softmax(op, x, *, scale=None, mask=None, causal=False):
    """The autodiff tests' jnp reference: jax.nn.softmax / log_softmax of the float32
    logits x * scale (+ an additive mask) over the last axis, where= the entries a bool
    mask and the causal rule keep (elsewhere softmax 0, log_softmax -inf)."""
    z = x.astype(jnp.float32) * (1.0 if scale is None else scale)
    keep = None
    if mask is not None and mask.dtype == jnp.bool_:
        keep = jnp.broadcast_to(mask, x.shape)
    elif mask is not None:
        z = z + mask.astype(jnp.float32)
    if causal:
        q, k = x.shape[-2:]
        tri = jnp.broadcast_to(jnp.arange(k)[None, :] <= jnp.arange(q)[:, None] + (k - q), x.shape)
        keep = tri if keep is None else keep & tri
    return (jax.nn.log_softmax if op == "log_softmax" else jax.nn.softmax)(z, axis=-1, where=keep)


@partial(jax.jit, static_argnums=(0, 1, 4))
def every_derivative(y, loss, args, tangents, argnums):
    """{kind: result} of every kind of differentiation of y(*args) and of the scalar
    loss(*args) with respect to args[argnums]: forward mode, reverse mode, second order."""
    grad = jax.grad(loss, argnums)

    def linearized(*a):
        out, lin = jax.linearize(y, *a)
        return out, lin(*tangents)

    def grad_dot_tangents(*a):  # <grad loss, t>: its gradient is the Hessian times t
        return sum(jnp.vdot(g, t) for g, t in zip(grad(*a), tangents))

    return {
        "jvp": jax.jvp(y, args, tangents),
        "linearize": linearized(*args),
        "jacfwd": jax.jacfwd(y, argnums)(*args),
        "jacrev": jax.jacrev(y, argnums)(*args),
        "grad": grad(*args),
        "hessian": jax.hessian(loss, argnums)(*args),
        "grad_of_grad": jax.grad(grad_dot_tangents, argnums)(*args),
        "hvp": jax.jvp(grad, args, tangents)[1],
        "grad_of_jvp": jax.grad(lambda *a: jax.jvp(loss, a, tangents)[1], argnums)(*args),
    }


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", AUTODIFF_CASES)
@pytest.mark.parametrize("op", OPS)
def test_autodiff_matches_jnp_reference(op, case, impl):
    """jvp, linearize, jacfwd, jacrev, grad, hessian, grad of grad, jvp of grad (a
    Hessian-vector product) and grad of jvp equal the jnp reference's (1e-5 relative),
    with a scale, an additive mask (differentiated too), a bool mask or the causal rule;
    reverse mode runs the backward stage, not the tangent map."""
    need(impl)
    rng = np.random.default_rng(seed_of(f"autodiff{op}{case}"))
    shape = (2, 3, 5)  # causal: q = 3 <= k = 5, no fully masked row
    x, w = make_x(rng, shape, spread=1.0), make_x(rng, shape, spread=1.0)
    kw = {"scale": -0.7} if case == "scale" else {"causal": True} if case == "causal" else {}
    if case == "bool_mask":  # key padding; column 0 kept, so no row is fully masked
        kw["mask"] = jnp.asarray(rng.random((2, 1, 5)) > 0.4).at[..., 0].set(True)
    args = (x,)
    if case == "add_mask":  # broadcast over the leading axis: its gradient sums over it
        args = (x, jnp.asarray(rng.standard_normal((3, 5)), jnp.float32))
    tangents = tuple(make_x(rng, a.shape, spread=1.0) for a in args)
    argnums = tuple(range(len(args)))

    def model(softmax_fn):
        def y(x, *add):
            return softmax_fn(x, **(dict(kw, mask=add[0]) if add else kw))

        def loss(*a):  # scalar, nonlinear in y; masked log_softmax outputs (-inf) dropped
            out = y(*a)
            return jnp.sum(jnp.sin(jnp.where(jnp.isneginf(out), 0.0, out)) * w)
        return y, loss

    ours = model(lambda x, **k: call(op, x, impl=impl, **k))
    ref = model(partial(jnp_softmax, op))
    got = every_derivative(*ours, args, tangents, argnums)
    want = every_derivative(*ref, args, tangents, argnums)
    for name in want:
        leaves_got, leaves_want = jax.tree.leaves(got[name]), jax.tree.leaves(want[name])
        assert len(leaves_got) == len(leaves_want), name
        for i, (a, b) in enumerate(zip(leaves_got, leaves_want)):
            assert a.shape == b.shape and a.dtype == b.dtype, \
                f"{name}[{i}]: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
            assert_close(f"{op} {case} {name}[{i}]", a, b, tol=1e-5)

    text = str(jax.make_jaxpr(jax.grad(ours[1], argnums))(*args))
    assert "jax_ops_softmax_bwd" in text, text
    assert "_tangent" not in text, text


# -------------------------------------------------------------------- vmap ---

def _tree_assert_close(got, want, rtol=1e-6, atol=1e-6):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        np.testing.assert_allclose(f64(a), f64(b), rtol=rtol, atol=atol)


def _take(a, axis, i):
    return a if axis is None else jnp.take(a, i, axis=axis)


VMAP_CASES = [  # id, batched x shape, x axis, mask kind, batched/unbatched mask shape, mask axis, kwargs
    ("x_axis0", (3, 4, 33), 0, None, None, None, {}),
    ("x_axis-1_causal_scale", (4, 6, 3), -1, None, None, None, {"causal": True, "scale": 0.5}),
    ("x_axis0_op_axis0", (3, 5, 7), 0, None, None, None, {"axis": 0}),
    ("x_and_addmask_axis0", (3, 4, 33), 0, "f32", (3, 4, 33), 0, {}),
    ("x_and_boolmask_axis0_causal", (3, 4, 33), 0, "bool", (3, 33), 0, {"causal": True}),
    ("x_axis0_mask_unbatched", (3, 4, 33), 0, "f32", (33,), None, {}),
    ("mask_only_axis1", (4, 33), None, "f32", (33, 3), 1, {}),
]


def _vmap_args(vid, shape, mkind, mshape):
    rng = np.random.default_rng(seed_of("vmap" + vid))
    return make_x(rng, shape), make_mask(rng, mkind, mshape)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vid,shape,xax,mkind,mshape,max_,kw", VMAP_CASES, ids=[c[0] for c in VMAP_CASES])
def test_vmap_matches_loop(vid, shape, xax, mkind, mshape, max_, kw, impl):
    need(impl)
    x, mask = _vmap_args(vid, shape, mkind, mshape)
    batch = shape[xax] if xax is not None else mshape[max_]

    def f(x, m):  # both ops at once: one compile
        return tuple(call(op, x, impl=impl, mask=m, **kw) for op in OPS)

    got = jax.jit(jax.vmap(f, in_axes=(xax, max_)))(x, mask)
    loop = jax.jit(lambda x, m: [f(_take(x, xax, i), _take(m, max_, i)) for i in range(batch)])(x, mask)
    for k, op in enumerate(OPS):
        want = jnp.stack([loop[i][k] for i in range(batch)])
        _tree_assert_close(got[k], want)
        for i in range(batch):  # ... and the loop itself is right
            ref = ref_forward(_take(x, xax, i), mask=_take(mask, max_, i), log=op == "log_softmax",
                              scale=kw.get("scale"), causal=kw.get("causal", False),
                              axis=kw.get("axis", -1))[0]
            assert_close(f"{op} y[{i}]", want[i], ref, tol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vid", ["x_and_addmask_axis0", "x_axis0_mask_unbatched", "x_axis0_op_axis0"])
def test_vmap_of_grad_matches_loop(vid, impl):
    """Per-example gradients (dmask per example where the mask is batched) equal a loop."""
    need(impl)
    _, shape, xax, mkind, mshape, max_, kw = next(c for c in VMAP_CASES if c[0] == vid)
    x, mask = _vmap_args(vid, shape, mkind or "f32", mshape or shape[1:])
    batch = shape[xax] if xax is not None else mshape[max_]
    x0 = _take(x, xax, 0)
    w = make_x(np.random.default_rng(seed_of("w" + vid)), x0.shape, spread=1.0)

    def loss(op, x, m):
        y = call(op, x, impl=impl, mask=m, **kw)
        return jnp.sum(jnp.where(jnp.isneginf(y), 0.0, y) * w)

    def grads(x, m):  # (dx, dmask) of both ops
        return tuple(jax.grad(partial(loss, op), argnums=(0, 1))(x, m) for op in OPS)

    got = jax.jit(jax.vmap(grads, in_axes=(xax, max_)))(x, mask)
    loop = jax.jit(lambda x, m: [grads(_take(x, xax, i), _take(m, max_, i)) for i in range(batch)])(x, mask)
    axis = kw.get("axis", -1)
    for k, op in enumerate(OPS):
        _tree_assert_close(got[k][0], jnp.stack([g[k][0] for g in loop]), rtol=1e-5, atol=1e-5)
        # vmap's outputs are per example (out_axes=0), the unbatched mask's gradient too
        _tree_assert_close(got[k][1], jnp.stack([g[k][1] for g in loop]), rtol=1e-5, atol=1e-5)
        log = op == "log_softmax"
        for i in range(batch):
            xi, mi = _take(x, xax, i), _take(mask, max_, i)
            y, masked = ref_forward(xi, mask=mi, log=log, axis=axis)
            rdx, rdz, dx_scale, dz_scale = ref_backward(y, np.where(masked, 0.0, f64(w)), log=log, axis=axis)
            assert_close(f"{op} dx[{i}]", loop[i][k][0], rdx, tol=1e-5, scale=dx_scale, exact=masked)
            assert_close(f"{op} dmask[{i}]", loop[i][k][1], sum_to_shape(rdz, mi.shape), tol=1e-5,
                         scale=sum_to_shape(dz_scale, mi.shape))


@pytest.mark.parametrize("impl", IMPLS)
def test_nested_vmap(impl):
    need(impl)
    rng = np.random.default_rng(seed_of("nested"))
    x = make_x(rng, (2, 4, 3, 33))
    mask = make_mask(rng, "f32", (2, 33))  # batched over the outer axis only
    op = "softmax"
    f = lambda x, m: call(op, x, impl=impl, mask=m, scale=0.5)  # noqa: E731
    # outer vmap over axis 0 of x (size 2), inner over axis 1 of the (4, 3, 33) slices (size 3)
    nested = jax.jit(jax.vmap(jax.vmap(f, in_axes=(1, None)), in_axes=(0, 0)))
    got = nested(x, mask)
    assert got.shape == (2, 3, 4, 33)
    want = jax.jit(lambda x, m: jnp.stack([jnp.stack([f(x[i, :, j], m[i]) for j in range(3)])
                                           for i in range(2)]))(x, mask)
    _tree_assert_close(got, want)
    y, _ = ref_forward(np.moveaxis(f64(x), 2, 1), mask=f64(mask)[:, None, None, :], scale=0.5)
    assert_close("nested y", got, y, tol=1e-5)
    grad = jax.grad(lambda x, m: jnp.sum(f(x, m) ** 2), argnums=(0, 1))
    got = jax.jit(jax.vmap(jax.vmap(grad, in_axes=(1, None)), in_axes=(0, 0)))(x, mask)
    want = jax.jit(lambda x, m: [[grad(x[i, :, j], m[i]) for j in range(3)] for i in range(2)])(x, mask)
    _tree_assert_close(got[0], jnp.stack([jnp.stack([w[j][0] for j in range(3)]) for w in want]),
                       rtol=1e-5, atol=1e-5)
    # per example of both vmaps (out_axes=0), the inner-unbatched mask's gradient too
    _tree_assert_close(got[1], jnp.stack([jnp.stack([w[j][1] for j in range(3)]) for w in want]),
                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_over_empty_batch(impl):
    need(impl)
    x = jnp.zeros((0, 3, 8), jnp.float32)
    for op in OPS:
        y = jax.vmap(lambda x: call(op, x, impl=impl, causal=True))(x)
        assert y.shape == x.shape and y.dtype == x.dtype


# ------------------------------------------------------- kernel properties ---

@pytest.mark.parametrize("impl", ["cuda", "pallas"])
def test_kernels_are_deterministic(impl):
    """Two runs (fresh jits) give bitwise-equal outputs and gradients."""
    need(impl)
    shapes = ([((4, 1025), "float32"), ((3, 33), "bfloat16")] if impl == "pallas"
              else [((256, 1024), "float32"), ((16, 4097), "bfloat16"), ((2, 3, 8, 40), "float16")])
    for shape, dtype in shapes:
        rng = np.random.default_rng(seed_of(f"det{shape}"))
        x = make_x(rng, shape, dtype)
        mask = make_mask(rng, "f32", shape[-1:])
        dy = make_x(rng, shape, dtype, spread=1.0)
        for op in OPS:
            def run(x, m, dy):
                y, vjp = jax.vjp(lambda x, m: call(op, x, impl=impl, mask=m, causal=True), x, m)
                return (y,) + tuple(vjp(dy))
            results = [jax.jit(run)(x, mask, dy) for _ in range(2)]
            for a, b in zip(*results):
                assert bitwise_equal(a, b), f"{op}{shape}{dtype}: runs differ"


POISON_DTYPE = {1: "float32", 33: "bfloat16", 1025: "float32", 4097: "float16"}


@pytest.mark.parametrize("impl", ["xla", "cuda"])
@pytest.mark.parametrize("cols", [1, 33, 1025, 4097])
def test_poisoned_outputs(cols, impl):
    """The donated NaN-filled buffer becomes the output (input_output_alias), so any
    element a kernel fails to write (e.g. masked or fully masked rows) stays NaN."""
    need(impl)
    dtype = POISON_DTYPE[cols]
    seed = seed_of(f"poison{cols}")
    rng = np.random.default_rng(seed)
    x = make_x(rng, (2, 5, cols), dtype)  # cols < 5: causal rows 0 .. 4-cols fully masked
    dy = make_x(rng, x.shape, dtype, spread=1.0)
    keep = jnp.asarray(rng.random(x.shape) > 0.3).at[1, 2].set(False)
    variants = [({}, None), ({"causal": True}, keep)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        for op in OPS:
            log = op == "log_softmax"
            for kw, mask in variants:
                fwd = jax.jit(lambda p, x, m: call(op, x, impl=impl, mask=m, **kw),
                              donate_argnums=0, keep_unused=True)

                def bwd_fn(p, x, m, dy):
                    _, vjp = jax.vjp(lambda x: call(op, x, impl=impl, mask=m, **kw), x)
                    return vjp(dy)[0]
                bwd = jax.jit(bwd_fn, donate_argnums=0, keep_unused=True)
                poison = lambda: jnp.full(x.shape, jnp.nan, x.dtype)  # noqa: E731
                cf = fwd.lower(poison(), x, mask).compile()
                cb = bwd.lower(poison(), x, mask, dy).compile()
                for c in (cf, cb):
                    if "input_output_alias" not in c.as_text():
                        pytest.skip("jax does not alias the donated buffer to the output on "
                                    f"{PLATFORM!r}: the poison would not reach the kernel")
                p_y, p_dx = poison(), poison()
                ptrs = (p_y.unsafe_buffer_pointer(), p_dx.unsafe_buffer_pointer())
                y = cf(p_y, x, mask)
                dx = cb(p_dx, x, mask, dy)
                if (y.unsafe_buffer_pointer(), dx.unsafe_buffer_pointer()) != ptrs:
                    pytest.skip("the outputs did not land in the donated (poisoned) buffers")
                ry, masked = ref_forward(x, mask=mask, log=log, **kw)
                assert_close(f"{op}{kw} y", y, ry, tol=TOL[dtype], exact=masked)
                rdx, _, dx_scale, _ = ref_backward(ry, dy, log=log)
                assert_close(f"{op}{kw} dx", dx, rdx, tol=TOL[dtype], scale=dx_scale, exact=masked)


@pytest.mark.parametrize("impl", IMPLS)
def test_lowering_uses_the_chosen_implementation(impl):
    """"cuda" lowers to our FFI custom calls (forward and backward), the others to
    neither: the tests above really exercise every path."""
    need(impl)
    x = make_x(np.random.default_rng(1), (4, 16))
    for op in OPS:
        grad = jax.grad(lambda x: jnp.sum(jnp.sin(call(op, x, impl=impl, causal=True))))
        text = jax.jit(grad).lower(x).as_text()
        for target in (FWD_TARGET, BWD_TARGET):
            found = re.search(rf"custom_call\s*@{target}\b", text) is not None
            assert found == (impl == "cuda"), f"{op}: custom_call @{target} in lowering: {found}"
        if PLATFORM == "cuda":
            assert ("triton" in text) == (impl == "pallas")
        decisions = jax_ops.explain(grad, x)
        assert [(d.query.stage, d.implementation) for d in decisions] == [("fwd", impl), ("bwd", impl)], \
            str(decisions)


def test_implementations_listed():
    names = jax_ops.implementations("softmax", platform=PLATFORM)
    assert "xla" in names
    if PLATFORM in ("cpu", "cuda"):
        assert "pallas" in names
    assert set(jax_ops.implementations("softmax")) >= set(IMPLS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_implementation_none_is_the_automatic_choice(dtype):
    rng = np.random.default_rng(seed_of("auto" + dtype))
    x = make_x(rng, (5, 129), dtype)
    mask = make_mask(rng, "f32", (129,))
    for op in OPS:
        decisions = jax_ops.explain(lambda x: call(op, x), x)
        assert len(decisions) >= 1
        grad = jax.grad(lambda x, m: jnp.sum(jnp.sin(call(op, x, mask=m))).astype(jnp.float32),
                        argnums=(0, 1))
        decisions_grad = jax_ops.explain(grad, x, mask)
        assert {d.query.stage for d in decisions_grad} == {"fwd", "bwd"}, str(decisions_grad)
        if PLATFORM != "cuda":  # the documented rule off the GPU: XLA
            for d in list(decisions) + list(decisions_grad):
                assert "-> xla" in str(d), str(d)
    out = run_and_check(None, x, mask, seed=1)
    if PLATFORM != "cuda":  # bitwise the same as asking for "xla" by name
        named = fwd_bwd_fn("xla", mask_grad=True)(x, mask, make_x(np.random.default_rng(2), x.shape, x.dtype))
        auto = fwd_bwd_fn(None, mask_grad=True)(x, mask, make_x(np.random.default_rng(2), x.shape, x.dtype))
        for op in OPS:
            for a, b in zip(named[op], auto[op]):
                assert bitwise_equal(a, b), f"{op}: implementation=None differs from 'xla'"


# ------------------------------------------------------------------ errors ---

f32 = jnp.float32
ERROR_CASES = [  # id, x, kwargs, exception, message regex
    # integers are promoted (as jax.nn does: test_jax_nn_parity); complex is refused
    ("x_complex64", jnp.ones((2, 8), jnp.complex64), {}, TypeError, r"\bx\b"),
    ("where_float", jnp.ones((2, 8), f32), {"where": jnp.ones((2, 8), f32)}, TypeError, r"\bwhere\b"),
    ("axis_tuple_repeated", jnp.ones((2, 8), f32), {"axis": (1, -1)}, ValueError, r"\baxis\b"),
    ("axis_tuple_causal", jnp.ones((2, 3, 8), f32), {"axis": (1, 2), "causal": True}, ValueError, r"\bcausal\b"),
    ("mask_int32", jnp.ones((2, 8), f32), {"mask": jnp.ones((8,), jnp.int32)}, TypeError, r"\bmask\b"),
    ("mask_int8", jnp.ones((2, 8), f32), {"mask": jnp.ones((2, 8), jnp.int8)}, TypeError, r"\bmask\b"),
    ("mask_shape_bool", jnp.ones((2, 8), f32), {"mask": jnp.ones((3,), bool)}, ValueError,
     r"(?s)(?=.*\bmask\b)(?=.*\(3,\))(?=.*\(2, 8\))"),
    ("mask_shape_f32", jnp.ones((2, 8), f32), {"mask": jnp.ones((2, 7), f32)}, ValueError,
     r"(?s)(?=.*\bmask\b)(?=.*\(2, 7\))(?=.*\(2, 8\))"),
    ("mask_rank_too_high", jnp.ones((2, 8), f32), {"mask": jnp.ones((3, 2, 8), f32)}, ValueError,
     r"(?s)(?=.*\bmask\b)(?=.*\(3, 2, 8\))(?=.*\(2, 8\))"),
    ("axis_too_big", jnp.ones((2, 8), f32), {"axis": 2}, ValueError, r"\baxis\b"),
    ("axis_too_small", jnp.ones((2, 8), f32), {"axis": -3}, ValueError, r"\baxis\b"),
    ("causal_rank1", jnp.ones((8,), f32), {"causal": True}, ValueError, r"\bcausal\b"),
    ("causal_axis0", jnp.ones((4, 8), f32), {"causal": True, "axis": 0}, ValueError, r"\bcausal\b"),
    ("causal_axis-2", jnp.ones((2, 4, 8), f32), {"causal": True, "axis": -2}, ValueError, r"\bcausal\b"),
    ("scale_string", jnp.ones((2, 8), f32), {"scale": "0.5"}, TypeError, r"\bscale\b"),
    ("scale_complex", jnp.ones((2, 8), f32), {"scale": 1 + 2j}, TypeError, r"\bscale\b"),
    ("implementation_unknown", jnp.ones((2, 8), f32), {"implementation": "triton"}, ValueError,
     r"\bimplementation\b.*'triton'"),
]


def _error_params():
    return [pytest.param(op, *c[1:], id=f"{op}-{c[0]}") for c in ERROR_CASES for op in OPS]


def _err_call(op, x, **kw):
    return getattr(jax_ops, op)(x, **kw)


@pytest.mark.parametrize("op,x,kw,exc,match", _error_params())
def test_invalid_arguments_raise(op, x, kw, exc, match):
    with pytest.raises(exc, match=match):
        _err_call(op, x, **kw)


@pytest.mark.parametrize("op,x,kw,exc,match", _error_params())
def test_invalid_arguments_raise_while_tracing(op, x, kw, exc, match):
    """Under jit the error comes from tracing abstract values: before anything runs."""
    mask = kw.get("mask")
    rest = {k: v for k, v in kw.items() if k != "mask"}

    def f(x, mask):
        return _err_call(op, x, mask=mask, **rest)
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype),
             None if mask is None else jax.ShapeDtypeStruct(mask.shape, mask.dtype)]
    with pytest.raises(exc, match=match):
        jax.jit(f).trace(*specs)
    with pytest.raises(exc, match=match):
        jax.jit(f)(x, mask)


@pytest.mark.parametrize("op", OPS)
def test_traced_scale_rejected(op):
    x = jnp.ones((2, 8), f32)
    with pytest.raises(TypeError, match=r"\bscale\b"):
        jax.jit(lambda x, s: _err_call(op, x, scale=s))(x, 0.5)
    with pytest.raises(TypeError, match=r"\bscale\b"):
        jax.jit(lambda x, s: _err_call(op, x, scale=s)).trace(jax.ShapeDtypeStruct((2, 8), f32),
                                                              jax.ShapeDtypeStruct((), f32))


@pytest.mark.parametrize("op", OPS)
def test_float64_x_rejected(op):
    with jax.enable_x64(True):
        x = jnp.asarray(np.ones((2, 8)), jnp.float64)
        assert x.dtype == jnp.float64
        with pytest.raises(TypeError, match=r"\bx\b"):
            _err_call(op, x)
        with pytest.raises(TypeError, match=r"\bx\b"):
            jax.jit(lambda x: _err_call(op, x))(x)


# ------------------------------------------------------------ jax.nn parity ---

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_jax_nn_parity(op, impl):
    """where=, a tuple axis and integer logits behave as in jax.nn (values and gradients)."""
    need(impl)
    ours, ref = getattr(jax_ops, op), getattr(jax.nn, op)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((3, 4, 6)), jnp.float32)
    where = jnp.asarray(rng.random((3, 1, 6)) < 0.7).at[:, :, 0].set(True)  # no empty row
    full = jnp.asarray(rng.random((3, 4, 6)) < 0.6).at[0, 0].set(False)  # one fully masked row
    cases = [
        ("where", lambda f, x: f(x, where=where)),
        ("where positional", lambda f, x: f(x, -1, where)),
        ("where, fully masked row", lambda f, x: f(x, where=full)),
        ("axis (1, 2)", lambda f, x: f(x, axis=(1, 2))),
        ("axis (0, -1) + where", lambda f, x: f(x, axis=(0, -1), where=where)),
        ("axis (-2,)", lambda f, x: f(x, axis=(-2,))),
    ]
    for name, call in cases:
        got, want = call(lambda *a, **k: ours(*a, **k, implementation=impl), x), call(ref, x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6, err_msg=name)
        if "fully" in name:  # jax.nn's gradient through an all-masked row is not finite
            continue
        w = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
        loss = lambda f: lambda x: jnp.sum(jnp.where(jnp.isfinite(call(f, x)), call(f, x), 0.0) * w)  # noqa: E731
        g_ours = jax.grad(loss(lambda *a, **k: ours(*a, **k, implementation=impl)))(x)
        np.testing.assert_allclose(np.asarray(g_ours), np.asarray(jax.grad(loss(ref))(x)),
                                   rtol=2e-5, atol=2e-6, err_msg=f"{name} gradient")
    xi = jnp.asarray(rng.integers(-3, 4, (2, 5)), jnp.int32)
    got = ours(xi, implementation=impl)
    assert got.dtype == ref(xi).dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref(xi)), rtol=2e-6, atol=2e-6)
