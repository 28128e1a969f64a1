"""Tests of jax_ops.relu and jax_ops.add_relu (1-bit mask residual).

For every implementation that lowers on this platform ("cuda" = our C++ host handlers
on CPU, "pallas" = the Pallas interpreter): y against a float64 reference (relu is exact;
add_relu's float32 sum rounds once), every mask bit against the float32 pre-activation
(and the bits past n clear), dx/dz exactly dy where the bit is set and 0 elsewhere, at
element counts around the word (32) and vector widths; vmap, jit, donation-poisoned
outputs, errors, and the residual memory: 1 bit per element.
"""
from __future__ import annotations

import re
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_ops
import support
from jax_ops.ops.relu import BWD, FWD

IMPLS = ("xla", "cuda", "pallas")
DTYPES = ("float32", "bfloat16", "float16")
OPS = ("relu", "add_relu")
# element counts: word and 16-byte-vector boundaries, odd, > 1024, several blocks
SHAPES = [(1,), (2,), (3,), (31,), (32,), (33,), (7, 9), (4, 256), (3, 5, 67), (4099,), (65, 1027)]


def need(impl):
    support.need("relu", impl)


def seed_of(text):
    return zlib.crc32(text.encode())


def make(rng, shape, dtype, spread=2.0):
    return jnp.asarray((rng.standard_normal(shape) * spread).astype(np.float32)).astype(dtype)


def bits_of(mask, n):
    """uint32 words -> (bool array of n flat bits, the bits past n)."""
    m = np.asarray(mask, np.uint32).reshape(-1)  # words in flat order, whatever the shape
    bits = ((m[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(bool).reshape(-1)
    return bits[:n], bits[n:]


def run_fwd(op, x, z, impl):
    return FWD.call(x, z if op == "add_relu" else None, implementation=impl)


def pre_f32(op, x, z):
    """The pre-activation exactly as the kernels form it: float32, one rounding."""
    pre = np.asarray(x, np.float32)
    return pre + np.asarray(z, np.float32) if op == "add_relu" else pre


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_mask_bits(shape, op, dtype, impl):
    need(impl)
    rng = np.random.default_rng(seed_of(f"fwd{shape}{op}{dtype}"))
    x, z = make(rng, shape, dtype), make(rng, shape, dtype)
    y, mask = jax.jit(lambda x, z: run_fwd(op, x, z, impl))(x, z)
    n = int(np.prod(shape))
    assert y.shape == x.shape and y.dtype == x.dtype
    # x's shape with the last axis in words when it is a whole number of them, else flat
    want = tuple(shape[:-1]) + (shape[-1] // 32,) if shape and shape[-1] % 32 == 0 and shape[-1] else (-(-n // 32),)
    assert mask.dtype == jnp.uint32 and mask.shape == want
    pre = pre_f32(op, x, z)
    ref = np.maximum(pre.astype(np.float64), 0.0)
    out = np.asarray(y, np.float64)
    if op == "relu":
        np.testing.assert_array_equal(out, ref)
    else:  # the float32 sum rounded once to x's dtype
        np.testing.assert_array_equal(out, np.asarray(jnp.asarray(np.maximum(pre, 0)).astype(dtype), np.float64))
    bits, tail = bits_of(mask, n)
    np.testing.assert_array_equal(bits, (pre > 0).reshape(-1))
    np.testing.assert_array_equal(bits, (out > 0).reshape(-1))
    assert not tail.any(), "bits past the last element must be clear"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (33,), (3, 5, 67), (65, 1027)], ids=str)
def test_backward_selects_dy(shape, dtype, impl):
    need(impl)
    rng = np.random.default_rng(seed_of(f"bwd{shape}{dtype}"))
    x, z, dy = make(rng, shape, dtype), make(rng, shape, dtype), make(rng, shape, dtype, 1.0)
    dy = dy.reshape(-1).at[::7].set(jnp.nan).reshape(shape)  # NaN cotangents where clear -> 0
    for op in OPS:
        args = (x, z) if op == "add_relu" else (x,)
        f = lambda *a: getattr(jax_ops, op)(*a, implementation=impl)  # noqa: E731
        y, vjp = jax.vjp(f, *args)
        grads = jax.jit(vjp)(dy)
        keep = pre_f32(op, x, z) > 0
        want = np.where(keep, np.asarray(dy, np.float64), 0.0)
        for g in grads:
            assert g.dtype == x.dtype and g.shape == x.shape
            got = np.asarray(g, np.float64)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(want))


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_inf_and_signed_zero(impl):
    need(impl)
    x = jnp.array([jnp.nan, -jnp.nan, jnp.inf, -jnp.inf, 0.0, -0.0, 1e-30, -1e-30, 3.0] * 5, jnp.float32)
    y, mask = run_fwd("relu", x, None, impl)
    ref = np.maximum(np.asarray(x), 0)  # NaN propagates like jnp.maximum
    got = np.asarray(y)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(ref))
    bits, _ = bits_of(mask, x.size)
    np.testing.assert_array_equal(bits, np.asarray(x) > 0)  # NaN: clear
    g = jax.grad(lambda x: jax_ops.relu(x, implementation=impl).sum())(x)
    np.testing.assert_array_equal(np.asarray(g), (np.asarray(x) > 0).astype(np.float32))


@pytest.mark.parametrize("impl", IMPLS)
def test_add_relu_broadcast_z_gets_summed_gradient(impl):
    need(impl)
    rng = np.random.default_rng(5)
    x, z = make(rng, (6, 40), "float32"), make(rng, (40,), "float32")
    w = make(rng, (6, 40), "float32")
    f = lambda x, z: (jax_ops.add_relu(x, z, implementation=impl) * w).sum()  # noqa: E731
    gx, gz = jax.grad(f, (0, 1))(x, z)
    keep = (np.asarray(x, np.float64) + np.asarray(z, np.float64)) > 0
    np.testing.assert_allclose(gx, np.where(keep, w, 0), rtol=0, atol=0)
    np.testing.assert_allclose(gz, np.where(keep, w, 0).sum(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_check_grads(impl):
    need(impl)
    rng = np.random.default_rng(7)
    x = make(rng, (5, 37), "float32")
    x = jnp.where(jnp.abs(x) < 0.05, 0.5, x)  # away from the kink
    z = make(rng, (5, 37), "float32") * 0.01
    check_grads(lambda x: jax_ops.relu(x, implementation=impl), (x,), order=1, modes=("rev",))
    check_grads(lambda x, z: jax_ops.add_relu(x, z, implementation=impl), (x, z), order=1,
                modes=("rev",))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(4, 8, 32), (3, 5, 7)], ids=str)  # per example: n % 32 == 0 and not
def test_vmap_and_vmap_of_grad_match_loop(shape, impl):
    need(impl)
    rng = np.random.default_rng(seed_of(f"vmap{shape}"))
    x, z = make(rng, shape, "bfloat16"), make(rng, shape, "bfloat16")
    f = lambda x, z: jax_ops.add_relu(x, z, implementation=impl)  # noqa: E731
    loss = lambda x, z: (f(x, z).astype(jnp.float32) ** 2).sum()  # noqa: E731
    yb = jax.vmap(f)(x, z)
    gb = jax.jit(jax.vmap(jax.grad(loss, (0, 1))))(x, z)
    gz_unbatched = jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, None))(x, z[0])
    for i in range(shape[0]):
        np.testing.assert_array_equal(yb[i], f(x[i], z[i]))
        gx, gz = jax.grad(loss, (0, 1))(x[i], z[i])
        np.testing.assert_array_equal(gb[0][i], gx)
        np.testing.assert_array_equal(gb[1][i], gz)
        np.testing.assert_array_equal(gz_unbatched[0][i], jax.grad(loss)(x[i], z[0]))
    yr = jax.vmap(lambda x: jax_ops.relu(x, implementation=impl), in_axes=1, out_axes=1)(x)
    np.testing.assert_array_equal(yr, jax.nn.relu(x))


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_and_scalar(impl):
    need(impl)
    for shape in [(0,), (3, 0, 5)]:
        x = jnp.zeros(shape, jnp.bfloat16)
        y, g = jax.value_and_grad(lambda x: jax_ops.relu(x, implementation=impl).sum())(x)
        assert g.shape == shape
        _, mask = run_fwd("relu", x, None, impl)
        assert mask.shape == (0,)
    x = jnp.float32(2.5)
    assert float(jax_ops.relu(x, implementation=impl)) == 2.5
    assert float(jax.grad(lambda x: jax_ops.add_relu(x, jnp.float32(-3.0), implementation=impl))(x)) == 0.0


def _residual_bytes(fn, *args):
    """Bytes of the arrays the VJP keeps (under jit) for the backward."""
    _, vjp = jax.jit(lambda *a: jax.vjp(fn, *a))(*args)
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(vjp) if hasattr(leaf, "nbytes"))


@pytest.mark.parametrize("impl", IMPLS)
def test_residual_is_one_bit_per_element(impl):
    """relu/add_relu keep <= 1/16 of a bfloat16 x's bytes (plus a constant); jax.nn.relu
    keeps at least a byte per element."""
    need(impl)
    x = make(np.random.default_rng(3), (64, 1000), "bfloat16")
    ours = _residual_bytes(lambda x: jax_ops.relu(x, implementation=impl), x)
    ours_add = _residual_bytes(lambda x, z: jax_ops.add_relu(x, z, implementation=impl), x, x)
    theirs = _residual_bytes(jax.nn.relu, x)
    theirs_add = _residual_bytes(lambda x, z: jax.nn.relu(x + z), x, x)
    assert ours <= x.nbytes / 16 + 64, (ours, x.nbytes)
    assert ours_add <= x.nbytes / 16 + 64, (ours_add, x.nbytes)
    assert theirs >= x.size and theirs_add >= x.size, (theirs, theirs_add)


@pytest.mark.parametrize("impl", ["xla", "cuda"])
def test_poisoned_outputs(impl):
    """Donated NaN buffers become y and dx: any element not written stays NaN."""
    need(impl)
    rng = np.random.default_rng(11)
    x, dy = make(rng, (3, 1000 + 33), "bfloat16"), make(rng, (3, 1033), "bfloat16")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        fwd = jax.jit(lambda p, x: jax_ops.relu(x, implementation=impl), donate_argnums=0,
                      keep_unused=True)
        bwd = jax.jit(lambda p, x, dy: jax.vjp(lambda x: jax_ops.relu(x, implementation=impl), x)[1](dy)[0],
                      donate_argnums=0, keep_unused=True)
        poison = lambda: jnp.full(x.shape, jnp.nan, x.dtype)  # noqa: E731
        cf, cb = fwd.lower(poison(), x).compile(), bwd.lower(poison(), x, dy).compile()
        if any("input_output_alias" not in c.as_text() for c in (cf, cb)):
            pytest.skip(f"no donation aliasing on {support.PLATFORM!r}")
        y, dx = cf(poison(), x), cb(poison(), x, dy)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.maximum(np.asarray(x, np.float32), 0))
    np.testing.assert_array_equal(np.asarray(dx, np.float32),
                                  np.where(np.asarray(x, np.float32) > 0, np.asarray(dy, np.float32), 0))


@pytest.mark.parametrize("impl", IMPLS)
def test_lowering_uses_the_chosen_implementation(impl):
    need(impl)
    x = jnp.ones((4, 64), jnp.float32)
    text = jax.jit(jax.grad(lambda x: jax_ops.relu(x, implementation=impl).sum())).lower(x).as_text()
    # the FFI custom calls (a Pallas kernel's name may contain the same words)
    found = [re.search(rf"custom_call\s*@{t}\b", text) is not None for t in ("jax_ops_relu_fwd", "jax_ops_relu_bwd")]
    assert found == [impl == "cuda"] * 2, found


def test_errors_name_the_argument():
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(TypeError, match=r"relu: x must be float32, bfloat16 or float16; got dtype int32"):
        jax_ops.relu(jnp.ones((4,), jnp.int32))
    with pytest.raises(TypeError, match=r"add_relu: z must have x's dtype float32; got bfloat16"):
        jax_ops.add_relu(x, x.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"add_relu: z must have x's shape \(4, 8\).*got shape \(3, 8\)"):
        jax_ops.add_relu(x, jnp.ones((3, 8), jnp.float32))
    with pytest.raises(ValueError, match=r"unknown implementation='triton'"):
        jax_ops.relu(x, implementation="triton")
    with pytest.raises(ValueError, match=r"mask must be uint32 of shape \(1,\)"):
        BWD.call(x, jnp.zeros((2,), jnp.uint32), has_z=False, implementation=None)


def test_use_and_explain():
    x = jnp.ones((4, 64), jnp.bfloat16)
    with jax_ops.use(relu="xla"):
        d = jax_ops.explain(jax.grad(lambda x: jax_ops.relu(x).astype(jnp.float32).sum()), x)
    assert [e.implementation for e in d] == ["xla", "xla"]
    assert {"xla", "cuda", "pallas"} <= set(jax_ops.implementations("add_relu"))


def _close(got, want, rel):
    """Every leaf within rel of the largest magnitude of its reference."""
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, (g.shape, w.shape)
        scale = max(float(np.max(np.abs(w))), 1e-30) if w.size else 1.0
        err = float(np.max(np.abs(g - w))) if w.size else 0.0
        assert err <= rel * scale, f"max error {err:.3g} > {rel} * {scale:.3g}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_autodiff_matches_jnp(op, impl):
    """Forward mode, reverse mode and second order against jax.nn.relu: jvp, linearize,
    jacfwd, jacrev, the Hessian of a smooth scalar function (relu³ is C²), grad of grad
    and a Hessian-vector product. Reverse mode runs the backward stage, not the tangent map."""
    need(impl)
    rng = np.random.default_rng(seed_of(f"autodiff{op}"))
    shape = (3, 37)  # a flat mask (37 % 32 != 0)
    x = make(rng, shape, "float32")
    x = jnp.where(jnp.abs(x) < 0.1, 0.5, x)  # away from the kink
    z = make(rng, shape, "float32", 0.01)  # |z| < 0.1: x + z keeps x's sign
    w, v, t = (make(rng, shape, "float32", 1.0) for _ in range(3))
    if op == "relu":
        args, ours = (x,), lambda x: jax_ops.relu(x, implementation=impl)
        ref = jax.nn.relu
    else:
        args, ours = (x, z), lambda x, z: jax_ops.add_relu(x, z, implementation=impl)
        ref = lambda x, z: jax.nn.relu(x + z)  # noqa: E731
    argnums = tuple(range(len(args)))
    tangents = (v, t)[:len(args)]

    def smooth(fn):
        return lambda *a: jnp.sum(fn(*a) ** 3 * w)
    f, f_ref = smooth(ours), smooth(ref)

    _close(jax.jvp(ours, args, tangents), jax.jvp(ref, args, tangents), 1e-5)
    y, f_lin = jax.linearize(f, *args)
    y_ref, f_lin_ref = jax.linearize(f_ref, *args)
    _close((y, f_lin(*tangents)), (y_ref, f_lin_ref(*tangents)), 1e-5)
    _close(jax.jacfwd(ours, argnums)(*args), jax.jacfwd(ref, argnums)(*args), 1e-5)
    _close(jax.jacrev(ours, argnums)(*args), jax.jacrev(ref, argnums)(*args), 1e-5)
    _close(jax.hessian(f, argnums)(*args), jax.hessian(f_ref, argnums)(*args), 1e-5)

    def grad_of_grad(fn):
        return jax.grad(lambda *a: jnp.sum(jax.grad(fn)(*a) * v), argnums)(*args)
    _close(grad_of_grad(f), grad_of_grad(f_ref), 1e-5)

    def hvp(fn):
        return jax.jvp(jax.grad(fn, argnums), args, tangents)[1]
    _close(hvp(f), hvp(f_ref), 1e-5)

    names = support.primitive_names(jax.make_jaxpr(jax.grad(f, argnums))(*args))
    assert BWD.prim.name in names, names
    assert not any(n.endswith("_tangent") for n in names), names
