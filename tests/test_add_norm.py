"""Tests of jax_ops.add_layer_norm and jax_ops.add_rms_norm (fused residual add + norm).

Same method as tests/test_layer_norm.py (whose float64 reference and error metric this
file reuses): every implementation that can lower on the default backend, against
float64 references. h = x + residual must be *exactly* jnp's `x + residual` (the sum
rounded once to x's dtype); y is the norm of that rounded h; the gradient of x and of
residual is one array, norm_backward(dy, h) + dh, checked with both cotangents non-zero
and with each one alone (the other a symbolic zero: no dh operand, or no backward kernel).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ops
import support
from jax_ops.ops.layer_norm import BWD, FWD
from pallas_kernels import layer_norm as pallas_norm
from test_layer_norm import (ELEM_TOL, TOL, assert_close, bitwise_equal, f64, ref_backward,
                             ref_forward, seed_of)

OPS = ("add_layer_norm", "add_rms_norm")
IMPLS = ("xla", "cuda", "pallas")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_EPS = {"add_layer_norm": 1e-5, "add_rms_norm": 1e-6}
COTANGENTS = ("both", "dy", "dh")
f32 = jnp.float32


def need(impl):
    support.need("add_layer_norm", impl)


def add_norm(op, x, residual, scale=None, bias=None, *, impl=None, epsilon=None):
    kw = {"implementation": impl}
    if epsilon is not None:
        kw["epsilon"] = epsilon
    if op == "add_layer_norm":
        return jax_ops.add_layer_norm(x, residual, scale, bias, **kw)
    assert bias is None, "add_rms_norm takes no bias"
    return jax_ops.add_rms_norm(x, residual, scale, **kw)


def make_inputs(seed, shape, dtype="float32", scale_dtype=None, bias_dtype=None):
    """x, residual, scale, bias, dy, dh (jnp; scale/bias None where their dtype is)."""
    rng = np.random.default_rng(seed)
    cols = shape[-1]
    x = jnp.asarray(rng.standard_normal(shape) * 3 + 5, dtype)
    residual = jnp.asarray(rng.standard_normal(shape) * 2 - 1, dtype)
    scale = None if scale_dtype is None else jnp.asarray(rng.standard_normal(cols) * 0.5 + 1, scale_dtype)
    bias = None if bias_dtype is None else jnp.asarray(rng.standard_normal(cols), bias_dtype)
    dy = jnp.asarray(rng.standard_normal(shape), dtype)
    dh = jnp.asarray(rng.standard_normal(shape), dtype)
    return x, residual, scale, bias, dy, dh


def fwd_bwd_fn(op, impl, cotangents="both", epsilon=None):
    """jit: (x, residual, scale, bias, dy, dh) -> ((y, h), (dx, dresidual, dscale, dbias)).
    cotangents "dy"/"dh": only y/h is differentiated (the other's cotangent is a symbolic
    zero, as when a model uses one output only)."""
    pick = {"both": lambda o: o, "dy": lambda o: o[0], "dh": lambda o: o[1]}[cotangents]

    @jax.jit
    def run(x, r, s, b, dy, dh):
        f = lambda *a: add_norm(op, *a, impl=impl, epsilon=epsilon)  # noqa: E731
        out, pullback = jax.vjp(lambda *a: pick(f(*a)), x, r, s, b)
        ct = {"both": (dy, dh), "dy": dy, "dh": dh}[cotangents]
        return (out if cotangents == "both" else f(x, r, s, b)), pullback(ct)
    return run


def check(op, x, r, scale, bias, dy, dh, out, grads, *, cotangents="both", epsilon=None):
    """(y, h) and (dx, dresidual, dscale, dbias) against the float64 reference."""
    dtype = jnp.dtype(x.dtype).name
    tol, elem_tol = TOL[dtype], ELEM_TOL[dtype]
    eps = DEFAULT_EPS[op] if epsilon is None else epsilon
    rms = op == "add_rms_norm"
    y, h = out
    dx, dr, dscale, dbias = grads
    for name, a in (("y", y), ("h", h), ("dx", dx), ("dresidual", dr)):
        assert a.dtype == x.dtype and a.shape == x.shape, f"{name}: {a.dtype}{a.shape}"
    h_ref = x + r  # jnp's sum, rounded once to x's dtype: h must be exactly this
    assert bitwise_equal(h, h_ref), "h differs from x + residual"
    assert_close("y", y, ref_forward(h_ref, scale, bias, eps, rms), tol=tol, elem_tol=elem_tol)
    assert bitwise_equal(dx, dr), "dx and dresidual differ"
    use_dy, use_dh = cotangents in ("both", "dy"), cotangents in ("both", "dh")
    rdx, rds, rdb, dx_scale = ref_backward(dy if use_dy else jnp.zeros_like(dy), h_ref, scale, eps, rms)
    if use_dh:
        rdx, dx_scale = rdx + f64(dh), np.abs(dx_scale) + np.abs(f64(dh))
    if cotangents == "dh":
        assert bitwise_equal(dx, dh), "with y unused, dx must be dh exactly"
    assert_close("dx", dx, rdx, tol=tol, elem_tol=elem_tol, scale=dx_scale)
    for name, p, got, want in (("dscale", scale, dscale, rds), ("dbias", bias, dbias, rdb)):
        if p is None:
            assert got is None, f"{name} should be None without the parameter"
            continue
        assert got.dtype == p.dtype and got.shape == p.shape, f"{name}: {got.dtype}{got.shape}"
        if cotangents == "dh":
            np.testing.assert_array_equal(f64(got), np.zeros(p.shape))
        else:
            assert_close(name, got, want, tol=tol, elem_tol=elem_tol)


# -------------------------------------------------------------- the matrix ---

COLS = [1, 2, 3, 31, 32, 33, 127, 1024, 1025, 8200, 20001, 40960]
SHAPES = [(), (1,), (3,), (2, 5)]
LONG_SHAPES = [(), (1,), (2,)]
PARAM_VARIANTS = {
    "add_layer_norm": [("f32", "f32"), (None, None), ("x", "x"), ("f32", None), (None, "x")],
    "add_rms_norm": [("f32", None), (None, None), ("x", None)],
}


def _matrix():
    params = []
    for op in OPS:
        for i, (dtype, cols) in enumerate((d, c) for d in DTYPES for c in COLS):
            shapes = LONG_SHAPES if cols > 8192 else SHAPES
            shape = shapes[i % len(shapes)] + (cols,)
            sdt, bdt = support.param_dtypes(PARAM_VARIANTS[op], i, dtype)
            cts = COTANGENTS[i % len(COTANGENTS)]
            cid = f"{op}-{dtype}-{'x'.join(map(str, shape))}-scale_{sdt}-bias_{bdt}-ct_{cts}"
            params.append(pytest.param(op, dtype, shape, sdt, bdt, cts, id=cid))
    return params


# 16-bit rows of 257-384 columns: the cuda forward (to 352 columns) and backward (every
# width for add_layer_norm, to 288 for add_rms_norm; some, such as bfloat16 add_rms_norm
# at 281-288, only at >= 4.4 TB/s of DRAM bandwidth) hold a 16-byte pack a lane and the
# last cols - 256 columns 1, 2 or 4 a lane on the first lanes (fwd_tail_kernel,
# bwd_tail_kernel, one or two rows a warp); 360 / 384 the forward's two packs a lane
# beside them. Each parameter variant and cotangent, odd row counts.
TAIL_CASES = [(cols, dtype, i) for i, (cols, dtype) in enumerate(
    [(264, "bfloat16"), (280, "float16"), (296, "bfloat16"), (320, "float16"), (336, "bfloat16"),
     (352, "float16"), (360, "bfloat16"), (384, "float16")])]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("cols,dtype,i", TAIL_CASES)
def test_tail_widths(op, impl, cols, dtype, i):
    need(impl)
    sdt, bdt = support.param_dtypes(PARAM_VARIANTS[op], i, dtype)
    cts = COTANGENTS[i % len(COTANGENTS)]
    x, r, scale, bias, dy, dh = make_inputs(seed_of(f"tail{op}{cols}{dtype}"), (41 + 2 * i, cols), dtype, sdt, bdt)
    run = fwd_bwd_fn(op, impl, cts)
    nan = jnp.full_like(x, jnp.nan)
    jax.block_until_ready(run(nan, nan, scale, bias, nan, nan))
    out, grads = run(x, r, scale, bias, dy, dh)
    check(op, x, r, scale, bias, dy, dh, out, grads, cotangents=cts)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op,dtype,shape,sdt,bdt,cts", _matrix())
def test_matches_reference(op, dtype, shape, sdt, bdt, cts, impl):
    need(impl)
    x, r, scale, bias, dy, dh = make_inputs(seed_of(f"{op}{dtype}{shape}"), shape, dtype, sdt, bdt)
    run = fwd_bwd_fn(op, impl, cts)
    if impl == "pallas" and shape[-1] > pallas_norm.MAX_COLS:
        with pytest.raises(ValueError, match=r"implementation='pallas' can't run.*cols <="):
            run(x, r, scale, bias, dy, dh)
        return
    nan = jnp.full_like(x, jnp.nan)  # poison: buffers handed out again hold NaN where unwritten
    jax.block_until_ready(run(nan, nan, scale, bias, nan, nan))
    out, grads = run(x, r, scale, bias, dy, dh)
    check(op, x, r, scale, bias, dy, dh, out, grads, cotangents=cts)


# Rows of whole 8-byte words, not of 16-byte ones: the cuda kernels' half-word packs
# (as test_layer_norm.HALF_WORD_CASES), each parameter variant and cotangent.
HALF_WORD_CASES = [(cols, rows, dtype, i) for i, (rows, cols, dtype) in enumerate(
    [(17, 4, "bfloat16"), (41, 36, "float16"), (301, 100, "bfloat16"), (97, 268, "float16"),
     (61, 1004, "bfloat16"), (37, 4100, "float16"), (13, 12292, "bfloat16"), (7, 20484, "float16"),
     (17, 2, "float32"), (41, 34, "float32"), (97, 266, "float32"), (61, 1002, "float32"),
     (37, 4098, "float32"), (13, 8194, "float32"), (29, 514, "float32")])]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("cols,rows,dtype,i", HALF_WORD_CASES)
def test_cuda_rows_of_half_words(op, cols, rows, dtype, i):
    check_cuda_rows(op, cols, rows, dtype, i, "half")


def check_cuda_rows(op, cols, rows, dtype, i, tag):
    """The cuda implementation's outputs and gradients of (rows, cols) against the float64
    reference, after a run on NaN rows; parameter variant and cotangents by i."""
    need("cuda")
    sdt, bdt = support.param_dtypes(PARAM_VARIANTS[op], i, dtype)
    cts = COTANGENTS[i % len(COTANGENTS)]
    x, r, scale, bias, dy, dh = make_inputs(seed_of(f"{tag}{op}{cols}{dtype}"), (rows, cols), dtype, sdt, bdt)
    run = fwd_bwd_fn(op, "cuda", cts)
    nan = jnp.full_like(x, jnp.nan)
    jax.block_until_ready(run(nan, nan, scale, bias, nan, nan))
    out, grads = run(x, r, scale, bias, dy, dh)
    check(op, x, r, scale, bias, dy, dh, out, grads, cotangents=cts)


# 16-bit rows of the backward's block tier that are not whole 16-byte words (widths like
# test_layer_norm.UNALIGNED_ROW_CASES), each parameter variant and cotangent set (dh added
# as dx is stored).
UNALIGNED_ROW_CASES = [(cols, rows, dtype, i) for i, (rows, cols, dtype) in enumerate(
    [(4001, 1025, "bfloat16"), (2401, 1030, "float16"), (1201, 2052, "bfloat16"), (1201, 4100, "float16"),
     (601, 4611, "bfloat16"), (600, 6150, "float16"), (5, 2051, "bfloat16")])]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("cols,rows,dtype,i", UNALIGNED_ROW_CASES)
def test_cuda_backward_block_unaligned_rows(op, cols, rows, dtype, i):
    check_cuda_rows(op, cols, rows, dtype, i, "unaligned")


@pytest.mark.heavy
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape,dtype", [((1201, 8192), "bfloat16"), ((2501, 4096), "float16"),
                                         ((801, 16384), "bfloat16"), ((30011, 128), "bfloat16"),
                                         ((1201, 4352), "bfloat16"), ((97, 18440), "float16"), ((61, 22536), "float16"),
                                         ((20011, 256), "float32"), ((3001, 2048), "bfloat16"),
                                         ((1501, 3000), "float16"), ((2001, 1536), "float16"),
                                         ((20011, 384), "bfloat16"), ((12001, 520), "float16"),
                                         ((9001, 768), "bfloat16"), ((3001, 2056), "bfloat16"),
                                         ((2001, 3072), "bfloat16"), ((8001, 448), "float16"),
                                         ((20001, 264), "bfloat16"), ((15001, 328), "float16"),
                                         ((20011, 312), "bfloat16"), ((1201, 2052), "bfloat16"),
                                         ((1200, 3076), "float16"), ((801, 6148), "bfloat16")], ids=str)
def test_many_rows(op, shape, dtype):
    """More rows than a GPU runs blocks at once: the sm_90 bulk-staged backward (x and dy
    in shared memory, 3 rows a block, dh added as dx is written) refills its stages
    several times over; 16384 columns walk the cluster tier's rows; 128 columns the group
    tier's tiles (dh loaded with the row); 4352 columns the one-pack bulk block, two an
    SM. 18440 and 22536 (fewer rows) are for the block forward's 5 and 6 packs a thread,
    h computed a 16-byte word at a time, the last thread's packs partly past the row.
    2048 / 3000: the warp-tier forward's bfloat16 words (h a word at a time) and the bulk
    backward at 129-1024 packs, 3000 columns with the last lane's packs past the row;
    float16 at 1536: the warp tier's Pack (or the block tier: perf-notes, 28th session).
    384 / 520 / 768: the warp tier at three packs a lane (16 or 32 lanes a row); 2056 /
    3072 at twelve a lane (32 lanes; at 2056 one pack past 2048, most slots past the row);
    448 float16: two packs a lane, the backward's scale in registers across rows. 264 / 312
    / 328: the last columns spread over the lanes, 1 / 2 / 4 a lane, many tiles a warp
    (fwd_tail_kernel; bwd_tail_kernel, two rows a warp for add_layer_norm). 2052 / 3076 /
    6148: 16-bit rows of 8-byte words in the backward's block tier, two half-word packs a
    thread (the last threads' second ones past the row)."""
    need("cuda")
    x, r, scale, bias, dy, dh = make_inputs(seed_of(f"many{op}{shape}{dtype}"), shape, dtype, "float32",
                                            "float32" if op == "add_layer_norm" else None)
    run = fwd_bwd_fn(op, "cuda", "both")
    nan = jnp.full_like(x, jnp.nan)
    jax.block_until_ready(run(nan, nan, scale, bias, nan, nan))
    out, grads = run(x, r, scale, bias, dy, dh)
    check(op, x, r, scale, bias, dy, dh, out, grads, cotangents="both")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cts", COTANGENTS)
@pytest.mark.parametrize("op", OPS)
def test_each_cotangent(op, cts, impl):
    """Both cotangents, and each alone, at a width the CUDA kernels vectorize."""
    need(impl)
    x, r, scale, bias, dy, dh = make_inputs(seed_of(f"ct{op}{cts}"), (4, 3, 256), "bfloat16", "float32",
                                            None if op == "add_rms_norm" else "float32")
    out, grads = fwd_bwd_fn(op, impl, cts)(x, r, scale, bias, dy, dh)
    check(op, x, r, scale, bias, dy, dh, out, grads, cotangents=cts)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_matches_plain_norm_of_the_sum(op, impl):
    """y is the plain norm of h = x + residual, bitwise, for the same implementation."""
    need(impl)
    x, r, scale, bias, _, _ = make_inputs(seed_of(f"plain{op}"), (5, 1000), "bfloat16", "bfloat16",
                                          None if op == "add_rms_norm" else "bfloat16")
    y, h = jax.jit(lambda *a: add_norm(op, *a, impl=impl))(x, r, scale, bias)
    if op == "add_layer_norm":
        want = jax.jit(lambda h, s, b: jax_ops.layer_norm(h, s, b, implementation=impl))(x + r, scale, bias)
    else:
        want = jax.jit(lambda h, s: jax_ops.rms_norm(h, s, implementation=impl))(x + r, scale)
    assert bitwise_equal(h, x + r)
    if impl == "cuda":  # the same kernel: bitwise
        assert bitwise_equal(y, want)
    else:
        np.testing.assert_allclose(f64(y), f64(want), rtol=1e-2, atol=1e-2)


# Sums at the ends of each 16-bit format: halfway cases (round to even), float16's
# subnormal sums (normal in float32), overflow to infinity, cancellation to +0 (x,
# residual, as exact values of the dtype).
ROUNDING_PAIRS = {
    "float16": [(1.0, 2.0 ** -11), (1 + 2.0 ** -10, 2.0 ** -11), (-1 - 2.0 ** -10, -2.0 ** -11),
                (2.0 ** -24, 2.0 ** -24), (2.0 ** -14 - 2.0 ** -24, 2.0 ** -24), (2.0 ** -24, -2.0 ** -23),
                (65504.0, 16.0), (65504.0, 8.0), (-65504.0, -32.0), (3.5, -3.5), (1000.0, 0.25)],
    "bfloat16": [(1.0, 2.0 ** -8), (1 + 2.0 ** -7, 2.0 ** -8), (-1 - 2.0 ** -7, -2.0 ** -8),
                 (2.0 ** -126, 2.0 ** -126), (3.3895313892515355e38, 3.3895313892515355e38),
                 (3.3895313892515355e38, 2.0 ** 119), (3.5, -3.5), (256.0, 0.5)],
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cols", [16, 2048, 4104])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_h_rounds_like_jnp_at_the_ends_of_the_format(dtype, cols, impl):
    """h = x + residual bitwise at ties, subnormals, overflow and cancellation: the cuda
    kernels add float16 pairs as f16x2 (one rounding) and the rest in float then round;
    the widths reach the narrow, warp and block tiers (float16 4104: past 4 KiB)."""
    need(impl)
    rng = np.random.default_rng(seed_of(f"ends{dtype}{cols}"))
    x = rng.standard_normal((3, cols)).astype(np.float32)
    r = rng.standard_normal((3, cols)).astype(np.float32)
    pairs = np.asarray(ROUNDING_PAIRS[dtype], np.float32)
    for row in range(3):  # each row the pairs at another offset, the rest random
        at = (row * 5) % max(cols - len(pairs), 1)
        n = min(len(pairs), cols)
        x[row, at:at + n], r[row, at:at + n] = pairs[:n, 0], pairs[:n, 1]
    x, r = jnp.asarray(x, dtype), jnp.asarray(r, dtype)
    assert np.array_equal(f64(x[0, :min(len(pairs), cols)]), pairs[:cols, 0])  # exact in dtype
    for op in OPS:
        _, h = jax.jit(lambda a, b, op=op: add_norm(op, a, b, impl=impl))(x, r)
        assert bitwise_equal(h, x + r), f"{op}: h differs from x + residual"
    assert np.isinf(f64(x + r)).any()  # the overflow pairs were in the rows


# ------------------------------------------------------------------- edges ---

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16)], ids=["0x16", "2x0x16"])
@pytest.mark.parametrize("op", OPS)
def test_empty_rows(op, shape, impl):
    need(impl)
    x, r, scale, bias, dy, dh = make_inputs(1, shape, "bfloat16", "bfloat16",
                                            None if op == "add_rms_norm" else "bfloat16")
    (y, h), (dx, dr, dscale, dbias) = fwd_bwd_fn(op, impl)(x, r, scale, bias, dy, dh)
    for a in (y, h, dx, dr):
        assert a.shape == shape and a.dtype == x.dtype
    assert dscale.shape == (16,) and dscale.dtype == scale.dtype
    np.testing.assert_array_equal(f64(dscale), np.zeros(16))
    if bias is not None:
        np.testing.assert_array_equal(f64(dbias), np.zeros(16))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_rank1_and_one_row(op, impl):
    need(impl)
    x, r, scale, bias, dy, dh = make_inputs(seed_of(f"rank1{op}"), (300,), "float32", "float32",
                                            None if op == "add_rms_norm" else "float32")
    run = fwd_bwd_fn(op, impl)
    out1, g1 = run(x, r, scale, bias, dy, dh)
    check(op, x, r, scale, bias, dy, dh, out1, g1)
    out2, g2 = run(x[None], r[None], scale, bias, dy[None], dh[None])
    check(op, x[None], r[None], scale, bias, dy[None], dh[None], out2, g2)
    np.testing.assert_allclose(f64(out2[0][0]), f64(out1[0]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["cuda", "pallas"])
def test_kernels_are_deterministic(impl):
    need(impl)
    for op in OPS:
        args = make_inputs(seed_of(f"det{op}"), (64, 1025), "bfloat16", "float32",
                           None if op == "add_rms_norm" else "float32")
        runs = [jax.tree.leaves(fwd_bwd_fn(op, impl)(*args)) for _ in range(2)]
        for a, b in zip(*runs):
            assert bitwise_equal(a, b)


# ------------------------------------------------------------------ errors ---

ERROR_CASES = [  # id, ops, x, residual, scale, bias, kwargs, exception, message regex
    ("residual_shape", OPS, jnp.ones((2, 8), f32), jnp.ones((2, 7), f32), None, None, {}, ValueError,
     r"\bresidual\b.*x's shape \(2, 8\).*float32.*got shape \(2, 7\)"),
    ("residual_broadcast", OPS, jnp.ones((2, 8), f32), jnp.ones((8,), f32), None, None, {}, ValueError,
     r"\bresidual\b.*\(2, 8\).*got shape \(8,\)"),
    ("residual_dtype", OPS, jnp.ones((2, 8), f32), jnp.ones((2, 8), jnp.bfloat16), None, None, {},
     ValueError, r"\bresidual\b.*dtype float32.*dtype bfloat16"),
    ("x_int32", OPS, jnp.ones((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32), None, None, {}, TypeError,
     r"\bx\b.*int32"),
    ("x_scalar", OPS, jnp.float32(1.0), jnp.float32(1.0), None, None, {}, ValueError,
     r"\bx\b.*at least 1 dim"),
    ("scale_shape", OPS, jnp.ones((2, 8), f32), jnp.ones((2, 8), f32), jnp.ones((7,), f32), None, {},
     ValueError, r"\bscale\b.*\(8,\).*\(7,\)"),
    ("bias_dtype", ("add_layer_norm",), jnp.ones((2, 8), jnp.bfloat16), jnp.ones((2, 8), jnp.bfloat16),
     None, jnp.ones((8,), jnp.float16), {}, TypeError, r"\bbias\b.*bfloat16.*float16"),
    ("epsilon_negative", OPS, jnp.ones((2, 8), f32), jnp.ones((2, 8), f32), None, None,
     {"epsilon": -1.0}, ValueError, r"\bepsilon\b"),
    ("implementation_unknown", OPS, jnp.ones((2, 8), f32), jnp.ones((2, 8), f32), None, None,
     {"implementation": "triton"}, ValueError, r"\bimplementation\b.*'triton'"),
]


def _error_params():
    return [pytest.param(op, *c[2:], id=f"{op}-{c[0]}") for c in ERROR_CASES for op in c[1]]


@pytest.mark.parametrize("op,x,r,scale,bias,kw,exc,match", _error_params())
def test_invalid_arguments_raise(op, x, r, scale, bias, kw, exc, match):
    with pytest.raises(exc, match=match):
        add_norm(op, x, r, scale, bias, impl=kw.get("implementation"), epsilon=kw.get("epsilon"))
    if "implementation" in kw or "epsilon" in kw:
        return
    specs = [None if a is None else jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
             for a in (x, r, scale, bias)]
    with pytest.raises(exc, match=match):  # while tracing: before any kernel runs
        jax.jit(lambda *a: add_norm(op, *a)).trace(*specs)


def test_primitive_rejects_bad_residual_and_dh():
    x, r2 = jnp.ones((2, 8), f32), jnp.ones((2,), f32)
    with pytest.raises(ValueError, match=r"add_layer_norm: residual.*\(2, 8\).*\(2, 4\)"):
        FWD.call(x, jnp.ones((2, 4), f32), None, None, epsilon=1e-5, rms=False, with_stats=False,
                      implementation="xla")
    with pytest.raises(ValueError, match=r"dh must match x.*bfloat16"):
        BWD.call(x, x.astype(jnp.bfloat16), x, r2, r2, None, rms=False, dscale_dtype=None,
                      dbias_dtype=None, implementation="xla")


# -------------------------------------------------------------------- vmap ---

VMAP_CASES = [  # id, in_axes (x, residual, scale, bias)
    ("x_r_axis0", (0, 0, None, None)),
    ("x_axis0_r_axis1", (0, 1, None, None)),
    ("r_only", (None, 0, None, None)),
    ("x_only", (0, None, None, None)),
    ("params_too", (0, 0, 0, 0)),
]


def _vmap_args(axes, seed, batch=3, rows=4, cols=33):
    rng = np.random.default_rng(seed)

    def arr(ax, shape):
        if ax is None:
            return jnp.asarray(rng.standard_normal(shape), f32)
        shape = list(shape)
        shape.insert(ax, batch)
        return jnp.asarray(rng.standard_normal(shape), f32)
    return (arr(axes[0], (rows, cols)) * 3 + 5, arr(axes[1], (rows, cols)),
            arr(axes[2], (cols,)) * 0.5 + 1, arr(axes[3], (cols,)))


def _fn(op, impl):
    if op == "add_layer_norm":
        return lambda x, r, s, b: jax_ops.add_layer_norm(x, r, s, b, implementation=impl)
    return lambda x, r, s, b: jax_ops.add_rms_norm(x, r, s, implementation=impl)


def _take(a, ax, i):
    return a if ax is None else jnp.take(a, i, axis=ax)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("vid,axes", VMAP_CASES, ids=[c[0] for c in VMAP_CASES])
def test_vmap_and_vmap_of_grad(vid, axes, op, impl):
    need(impl)
    args = _vmap_args(axes, seed_of(vid + op))
    f = _fn(op, impl)
    got = jax.jit(jax.vmap(f, in_axes=axes))(*args)
    loop = [f(*(_take(a, ax, i) for a, ax in zip(args, axes))) for i in range(3)]
    for k in range(2):
        np.testing.assert_allclose(f64(got[k]), f64(jnp.stack([o[k] for o in loop])), rtol=1e-6, atol=1e-6)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((4, 33)), f32)

    def loss(*a):
        y, h = f(*a)
        return jnp.sum(y * w) + jnp.sum(jnp.sin(h))
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    got = jax.jit(jax.vmap(grad, in_axes=axes))(*args)
    loop = [grad(*(_take(a, ax, i) for a, ax in zip(args, axes))) for i in range(3)]
    for k in range(4):  # per-example gradients, of unbatched inputs too
        np.testing.assert_allclose(f64(got[k]), f64(jnp.stack([g[k] for g in loop])), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- autodiff ---

def _jnp_add_norm(op, eps):
    def f(x, r, scale, bias=None):
        h = x + r
        m = 0.0 if op == "add_rms_norm" else jnp.mean(h, -1, keepdims=True)
        v = jnp.mean(jnp.square(h - m), -1, keepdims=True)
        y = (h - m) * jax.lax.rsqrt(v + eps) * scale
        return (y if bias is None else y + bias), h
    return f


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_autodiff_modes(op, impl):
    """jvp, jacrev and a Hessian-vector product agree with the jnp reference (f32)."""
    need(impl)
    eps = DEFAULT_EPS[op]
    rng = np.random.default_rng(seed_of(f"ad{op}{impl}"))
    x, r = (jnp.asarray(rng.standard_normal((3, 7)), f32) for _ in range(2))
    params = [jnp.asarray(1 + 0.3 * rng.standard_normal(7), f32)]
    if op == "add_layer_norm":
        params.append(jnp.asarray(0.3 * rng.standard_normal(7), f32))
    w = jnp.asarray(rng.standard_normal((3, 7)), f32)
    ours = lambda x, r, *p: add_norm(op, x, r, *p, impl=impl, epsilon=eps)  # noqa: E731
    ref = _jnp_add_norm(op, eps)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)[0]) * w) + jnp.sum(f(*a)[1] ** 3)  # noqa: E731
    primals = (x, r, *params)
    tangents = tuple(jnp.asarray(rng.standard_normal(a.shape), f32) for a in primals)
    argnums = tuple(range(len(primals)))

    def close(name, a, b):
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            err = float(jnp.linalg.norm((u - v).ravel()) / max(float(jnp.linalg.norm(v.ravel())), 1e-30))
            assert err <= 1e-5, f"{name}: relative error {err:.2e}"

    close("jvp", jax.jvp(ours, primals, tangents), jax.jvp(ref, primals, tangents))
    close("jacrev", jax.jacrev(ours, argnums)(*primals), jax.jacrev(ref, argnums)(*primals))
    close("grad", jax.grad(loss(ours), argnums)(*primals), jax.grad(loss(ref), argnums)(*primals))
    hvp = lambda f: jax.jvp(jax.grad(loss(f), argnums), primals, tangents)[1]  # noqa: E731
    close("hvp", hvp(ours), hvp(ref))


def _eqns(jaxpr, name):
    return [e for e in jaxpr.eqns if e.primitive.name == name]


@pytest.mark.parametrize("op", OPS)
def test_reverse_mode_runs_the_backward_kernel_on_h(op):
    """grad = the forward stage (with statistics) + the backward stage, no tangent map;
    the backward reads the forward's h output (what the VJP keeps), not x or residual,
    and gets dh when h is used."""
    x, r, s = jnp.ones((4, 8), f32), jnp.ones((4, 8), f32), jnp.ones((8,), f32)

    def loss(x, r, s):
        y, h = add_norm(op, x, r, s)
        return jnp.sum(y) + jnp.sum(h * h)
    closed = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, r, s)
    text = str(closed)
    assert "jax_ops_norm_bwd" in text and "with_stats=True" in text
    assert "tangent" not in text
    jaxpr = closed.jaxpr
    (fwd,), (bwd,) = _eqns(jaxpr, "jax_ops_norm_fwd"), _eqns(jaxpr, "jax_ops_norm_bwd")
    assert fwd.params["present"][:2] == (True, True)
    assert bwd.params["present"] == (True, True, True, op == "add_layer_norm", True, True)
    h_out = fwd.outvars[1]
    assert bwd.invars[2] is h_out  # the backward's x is h
    assert not set(map(id, jaxpr.invars[:2])) & set(map(id, bwd.invars))
    # only y used: no dh operand; only h used: no backward kernel at all
    g = jax.make_jaxpr(jax.grad(lambda x, r, s: jnp.sum(add_norm(op, x, r, s)[0]), (0, 1, 2)))(x, r, s)
    (bwd,) = _eqns(g.jaxpr, "jax_ops_norm_bwd")
    assert bwd.params["present"][1] is False
    g = jax.make_jaxpr(jax.grad(lambda x, r, s: jnp.sum(add_norm(op, x, r, s)[1] ** 2), (0, 1, 2)))(x, r, s)
    assert not _eqns(g.jaxpr, "jax_ops_norm_bwd")


def test_vjp_keeps_h_not_x_and_residual():
    """The VJP's saved values: h, float32 mean/rstd, scale (bias is not needed)."""
    x, r = jnp.full((4, 8), 2.0, f32), jnp.full((4, 8), 3.0, f32)
    s, b = jnp.ones((8,), f32), jnp.zeros((8,), f32)
    _, vjp = jax.vjp(lambda x, r, s, b: jax_ops.add_layer_norm(x, r, s, b, implementation="xla"), x, r, s, b)
    saved = [a for a in jax.tree.leaves(vjp) if hasattr(a, "shape")]
    shapes = sorted((tuple(a.shape), jnp.dtype(a.dtype).name) for a in saved)
    assert shapes.count(((4, 8), "float32")) == 1, shapes  # h only: neither x nor residual
    assert any(bitwise_equal(a, x + r) for a in saved if a.shape == (4, 8))


# ------------------------------------------------ lowering, dispatch, export ---

@pytest.mark.parametrize("impl", IMPLS)
def test_lowering_uses_the_chosen_implementation(impl):
    need(impl)
    x = jnp.ones((4, 16), f32)
    grad = jax.grad(lambda x, r: jnp.sum(jax_ops.add_rms_norm(x, r, implementation=impl)[0] ** 2), (0, 1))
    text = jax.jit(grad).lower(x, x).as_text()
    for target in ("jax_ops_norm_fwd", "jax_ops_norm_bwd"):
        assert (target in text) == (impl == "cuda")


def test_registry_and_explain():
    for op in OPS:
        assert set(IMPLS) <= set(jax_ops.implementations(op))
    x = jnp.ones((4, 16), f32)
    ex = jax_ops.explain(jax.grad(lambda x, r: jnp.sum(sum(jax_ops.add_layer_norm(x, r))), (0, 1)), x, x)
    assert [d.query.op for d in ex] == ["add_layer_norm", "add_layer_norm"], str(ex)
    with jax_ops.use(add_layer_norm="xla"):
        assert "jax_ops_norm_fwd" not in jax.jit(lambda x: jax_ops.add_layer_norm(x, x)[0]).lower(x).as_text()


def test_export_symbolic_rows_round_trip():
    support.need("add_layer_norm", "cuda")
    spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 64"), jnp.bfloat16)
    f = lambda x, r: jax_ops.add_layer_norm(x, r, implementation="cuda")  # noqa: E731
    exp = jax_ops.export(f, spec, spec)
    x, r = (jnp.asarray(np.random.default_rng(i).standard_normal((5, 64)), jnp.bfloat16) for i in range(2))
    got = jax.export.deserialize(exp.serialize()).call(x, r)
    want = jax.jit(f)(x, r)
    assert bitwise_equal(got[0], want[0]) and bitwise_equal(got[1], want[1])


# --------------------------------------------------------------- sharding ---

@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
@pytest.mark.parametrize("impl", ["xla", "cuda"])
@pytest.mark.parametrize("spec", [P("a", None, None), P(None, None, "a"), P("a", None, "b")],
                         ids=["rows", "hidden", "both"])
def test_sharded_matches_unsharded(spec, impl):
    need(impl)
    mesh = jax.make_mesh((4, 2), ("a", "b"), devices=jax.devices()[:8])
    rng = np.random.default_rng(0)
    x, r = (jnp.asarray(rng.standard_normal((8, 4, 64)), f32) for _ in range(2))
    s, b = jnp.asarray(1 + 0.1 * rng.standard_normal(64), f32), jnp.asarray(rng.standard_normal(64), f32)

    def loss(x, r, s, b):
        y, h = jax_ops.add_layer_norm(x, r, s, b, implementation=impl)
        return jnp.sum(jnp.sin(y)) + jnp.sum(h * h)
    vg = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))
    want = vg(x, r, s, b)
    sh, rep = NamedSharding(mesh, spec), NamedSharding(mesh, P())
    got = vg(*(jax.device_put(a, d) for a, d in zip((x, r, s, b), (sh, sh, rep, rep))))
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(f64(u), f64(v), rtol=2e-5, atol=2e-5 * math.sqrt(64))
