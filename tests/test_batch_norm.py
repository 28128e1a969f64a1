"""Tests of jax_ops.batch_norm_relu and jax_ops.batch_norm_add_relu.

Against a float64 NumPy reference (same low-precision inputs upcast): y, the batch
mean and biased variance, every mask bit (== y > 0 of the same output, and the bits
past n clear), and the gradients of x, z, scale, bias (and of the running mean/var in
inference) for a loss that also uses the returned statistics, so their cotangents are
exercised. Channel counts 1, 3, 32, 33, 2048; element counts not multiples of 32 or
of the vector width; vmap; determinism; errors; residual memory.
Metric: ||out - ref|| / ||ref|| <= tol and max|out - ref| <= tol * max|ref|.
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
from jax_ops.ops.batch_norm import BWD, DX, FWD, GRAD_SUMS, STATS

IMPLS = ("xla", "cuda", "pallas")
DTYPES = ("float32", "bfloat16", "float16")
OPS = ("batch_norm_relu", "batch_norm_add_relu")
EPS = 1e-5
TOL = {"float32": 2e-6, "bfloat16": 1e-2, "float16": 2e-3}
GRAD_TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 5e-3}
SHAPES = [(7, 1), (5, 3), (64, 32), (2, 5, 7, 33), (3, 2048), (9, 11, 13, 3), (2, 6, 6, 32),
          (1, 3), (4099, 5)]


def need(impl):
    support.need("batch_norm_relu", impl)


def seed_of(text):
    return zlib.crc32(text.encode())


def make(rng, shape, dtype, spread=1.5, offset=0.0):
    return jnp.asarray((rng.standard_normal(shape) * spread + offset).astype(np.float32)).astype(dtype)


def f64(a):
    return np.asarray(a).astype(np.float64)


def assert_close(name, out, ref, tol):
    out, ref = f64(out), f64(ref)
    assert out.shape == ref.shape, (name, out.shape, ref.shape)
    assert np.all(np.isfinite(out)), f"{name}: non-finite output"
    norm = np.linalg.norm(ref)
    err = np.linalg.norm(out - ref) / max(norm, 1e-30)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"
    peak = np.abs(ref).max() if ref.size else 0.0
    if ref.size:
        worst = np.abs(out - ref).max()
        assert worst <= tol * max(peak, 1e-30) * 4, f"{name}: max error {worst:.3g} vs peak {peak:.3g}"


def bits_of(mask, n):
    m = np.asarray(mask, np.uint32).reshape(-1)  # words in flat order, whatever the shape
    bits = ((m[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(bool).reshape(-1)
    return bits[:n], bits[n:]


def call(op, x, z, scale, bias, impl, **kw):
    if op == "batch_norm_add_relu":
        return jax_ops.batch_norm_add_relu(x, z, scale, bias, implementation=impl, **kw)
    return jax_ops.batch_norm_relu(x, scale, bias, implementation=impl, **kw)


def ref_forward(x, z, scale, bias, *, training=True, mean=None, var=None):
    c = x.shape[-1]
    x2 = f64(x).reshape(-1, c)
    if training:
        mean, var = x2.mean(0), x2.var(0)
    else:
        mean, var = f64(mean), f64(var)
    rstd = 1.0 / np.sqrt(var + EPS)
    pre = (x2 - mean) * rstd * f64(scale) + f64(bias)
    if z is not None:
        pre = pre + f64(z).reshape(-1, c)
    return np.maximum(pre, 0).reshape(x.shape), mean, var, rstd, pre


def ref_backward(x, keep, w, u, t, scale, mean, rstd, training):
    """Gradients of L = Σ y·w + Σ mean·u + Σ var·t (training) with the kernels' mask."""
    c = x.shape[-1]
    x2 = f64(x).reshape(-1, c)
    n = x2.shape[0]
    g = np.where(keep.reshape(-1, c), f64(w).reshape(-1, c), 0.0)
    xhat = (x2 - mean) * rstd
    dbias, dscale = g.sum(0), (g * xhat).sum(0)
    a = f64(scale) * rstd
    if training:
        dx = a * (g - dbias / n - xhat * dscale / n) + f64(u) / n + f64(t) * 2 * (x2 - mean) / n
        dmean = dvar = None
    else:
        dx = a * g
        dmean, dvar = -a * dbias, -0.5 * a * rstd * dscale
    return dx.reshape(x.shape), g.reshape(x.shape), dscale, dbias, dmean, dvar


def _inputs(shape, dtype, seed, offset=0.0):
    rng = np.random.default_rng(seed)
    c = shape[-1]
    x = make(rng, shape, dtype, offset=offset)
    z = make(rng, shape, dtype, 0.5)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, c).astype(np.float32))
    bias = jnp.asarray(rng.normal(0, 0.3, c).astype(np.float32))
    w = make(rng, shape, dtype, 1.0)
    u = jnp.asarray(rng.normal(0, 1, c).astype(np.float32))
    t = jnp.asarray(rng.normal(0, 1, c).astype(np.float32))
    return x, z, scale, bias, w, u, t


def _check(op, shape, dtype, impl, training, offset=0.0):
    x, z, scale, bias, w, u, t = _inputs(shape, dtype, seed_of(f"{op}{shape}{dtype}{training}"), offset)
    zz = z if op == "batch_norm_add_relu" else None
    c = shape[-1]
    rmean = jnp.asarray(np.random.default_rng(1).normal(0, 0.5, c).astype(np.float32))
    rvar = jnp.asarray(np.random.default_rng(2).uniform(0.5, 2, c).astype(np.float32))
    kw = {} if training else {"training": False, "mean": rmean, "var": rvar}

    def loss(x, z, scale, bias, rmean, rvar):
        kwl = {} if training else {"training": False, "mean": rmean, "var": rvar}
        out = call(op, x, z, scale, bias, impl, **kwl)
        if training:
            y, m, v = out
            return (y.astype(jnp.float32) * w.astype(jnp.float32)).sum() + (m * u).sum() + (v * t).sum()
        return (out.astype(jnp.float32) * w.astype(jnp.float32)).sum()

    out = jax.jit(lambda *a: call(op, a[0], a[1], a[2], a[3], impl, **kw))(x, zz, scale, bias)
    y = out[0] if training else out
    ry, rm, rv, rstd, _ = ref_forward(x, zz, scale, bias, training=training, mean=rmean, var=rvar)
    assert y.dtype == x.dtype and y.shape == x.shape
    # |mean| >> std: y inherits the float32 rounding of mean (ulp(offset) / std)
    assert_close("y", y, ry, 1e-4 if offset else TOL[dtype])
    if training:
        assert out[1].dtype == jnp.float32 and out[2].dtype == jnp.float32
        assert_close("batch mean", out[1], rm, TOL["float32"])
        # E[x²] - E[x]² in float32 would be off by ~5% here
        assert_close("batch var", out[2], rv, 1e-4 if offset else 4 * TOL["float32"])

    # mask bits of the same call (the primitive), bit by bit against y > 0
    yp, mask, *_ = FWD.call(x, zz, scale, bias, None if training else rmean,
                            None if training else rvar, epsilon=EPS, training=training,
                            implementation=impl)
    bits, tail = bits_of(mask, x.size)
    np.testing.assert_array_equal(bits, (f64(yp) > 0).reshape(-1))
    assert not tail.any()

    grads = jax.jit(jax.grad(loss, (0, 1, 2, 3, 4, 5)))(x, zz, scale, bias, rmean, rvar)
    keep = bits.reshape(x.shape)
    dx, dz, dscale, dbias, dmean, dvar = ref_backward(
        x, keep, w, u, t, scale, f64(rm) if training else f64(rmean), rstd, training)
    gt = 1e-4 if offset else GRAD_TOL[dtype]
    assert_close("dx", grads[0], dx, gt)
    if zz is not None:
        np.testing.assert_array_equal(f64(grads[1]), f64(jnp.asarray(dz).astype(dtype)))
    assert grads[2].dtype == jnp.float32
    assert_close("dscale", grads[2], dscale, gt)
    assert_close("dbias", grads[3], dbias, gt)
    if not training:
        assert_close("dmean", grads[4], dmean, gt)
        assert_close("dvar", grads[5], dvar, gt)


def _matrix():
    cases = []
    for shape in SHAPES:
        for dtype in DTYPES:
            if shape[-1] == 2048 and dtype != "bfloat16":
                continue
            for op in OPS:
                cases.append((op, shape, dtype))
    return cases


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("op,shape,dtype", _matrix(), ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_matches_reference(op, shape, dtype, training, impl):
    need(impl)
    _check(op, shape, dtype, impl, training)


@pytest.mark.parametrize("impl", IMPLS)
def test_statistics_with_large_mean_are_stable(impl):
    """Welford: |mean| >> std in float32 keeps the variance's digits."""
    need(impl)
    _check("batch_norm_relu", (512, 33), "float32", impl, True, offset=1000.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_check_grads(impl):
    need(impl)
    x, z, scale, bias, *_ = _inputs((6, 5, 3), "float32", 17)

    def f(x, z, scale, bias):
        y, m, v = jax_ops.batch_norm_add_relu(x, z, scale, bias, implementation=impl)
        return y * 1.0, m, v
    check_grads(f, (x, z, scale, bias), order=1, modes=("rev",), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_per_example_statistics(impl):
    need(impl)
    x, z, scale, bias, *_ = _inputs((3, 10, 4), "float32", 23)
    f = lambda x, z: jax_ops.batch_norm_add_relu(x, z, scale, bias, implementation=impl)  # noqa: E731
    yb, mb, vb = jax.vmap(f)(x, z)
    gb = jax.vmap(jax.grad(lambda x, z: (f(x, z)[0] ** 2).sum()))(x, z)
    for i in range(3):
        y, m, v = f(x[i], z[i])
        np.testing.assert_allclose(yb[i], y, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(mb[i], m, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(vb[i], v, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(gb[i], jax.grad(lambda x: (f(x, z[i])[0] ** 2).sum())(x[i]),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["cuda", "pallas"])
def test_kernels_are_deterministic(impl):
    need(impl)
    x, z, scale, bias, w, *_ = _inputs((4099, 33), "bfloat16", 31)
    fn = jax.jit(jax.value_and_grad(
        lambda x, s, b: (jax_ops.batch_norm_relu(x, s, b, implementation=impl)[0].astype(jnp.float32) * w).sum(),
        (0, 1, 2)))
    a, b = fn(x, scale, bias), fn(x, scale, bias)
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert np.asarray(u).tobytes() == np.asarray(v).tobytes()


@pytest.mark.parametrize("impl", IMPLS)
def test_inference_with_empty_batch_and_optional_params(impl):
    need(impl)
    c = 5
    mean, var = jnp.zeros(c), jnp.ones(c)
    y = jax_ops.batch_norm_relu(jnp.zeros((0, c), jnp.bfloat16), training=False, mean=mean, var=var,
                                implementation=impl)
    assert y.shape == (0, c)
    x = make(np.random.default_rng(3), (8, c), "float32")
    y, m, v = jax_ops.batch_norm_relu(x, implementation=impl)  # no scale, no bias
    ry, *_ = ref_forward(x, None, np.ones(c), np.zeros(c))
    assert_close("y", y, ry, TOL["float32"])
    # bfloat16 parameters: gradients come back in their dtype
    s16, b16 = jnp.ones(c, jnp.bfloat16), jnp.zeros(c, jnp.bfloat16)
    gs, gb = jax.grad(lambda s, b: jax_ops.batch_norm_relu(x.astype(jnp.bfloat16), s, b,
                                                             implementation=impl)[0].astype(jnp.float32).sum(),
                      (0, 1))(s16, b16)
    assert gs.dtype == jnp.bfloat16 and gb.dtype == jnp.bfloat16


def _residual_bytes(fn, *args):
    _, vjp = jax.jit(lambda *a: jax.vjp(fn, *a))(*args)
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(vjp) if hasattr(leaf, "nbytes"))


@pytest.mark.parametrize("impl", IMPLS)
def test_residuals_are_x_mask_and_channel_statistics(impl):
    need(impl)
    x, z, scale, bias, *_ = _inputs((64, 8, 8, 32), "bfloat16", 41)
    c = x.shape[-1]
    for op in OPS:
        got = _residual_bytes(lambda x, z: call(op, x, z, scale, bias, impl)[0], x, z)
        # x + 1 bit per element + mean/rstd/scale float32 (+ small constants)
        assert got <= x.nbytes + x.size // 8 + 3 * 4 * c + 256, (op, got, x.nbytes)


@pytest.mark.parametrize("impl", ["xla", "cuda"])
def test_poisoned_outputs(impl):
    need(impl)
    x, z, scale, bias, w, *_ = _inputs((37, 33), "float16", 43)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        fwd = jax.jit(lambda p, x, z: jax_ops.batch_norm_add_relu(x, z, scale, bias, implementation=impl)[0],
                      donate_argnums=0, keep_unused=True)

        def bwd_fn(p, x, z, w):
            _, vjp = jax.vjp(lambda x: jax_ops.batch_norm_add_relu(x, z, scale, bias, implementation=impl)[0], x)
            return vjp(w)[0]
        bwd = jax.jit(bwd_fn, donate_argnums=0, keep_unused=True)
        poison = lambda: jnp.full(x.shape, jnp.nan, x.dtype)  # noqa: E731
        cf, cb = fwd.lower(poison(), x, z).compile(), bwd.lower(poison(), x, z, w).compile()
        if any("input_output_alias" not in c.as_text() for c in (cf, cb)):
            pytest.skip(f"no donation aliasing on {support.PLATFORM!r}")
        y, dx = cf(poison(), x, z), cb(poison(), x, z, w)
    ry, rm, rv, rstd, _ = ref_forward(x, z, scale, bias)
    assert_close("y", y, ry, TOL["float16"])
    keep = f64(y) > 0
    rdx, *_ = ref_backward(x, keep, w, np.zeros(33), np.zeros(33), scale, rm, rstd, True)
    assert_close("dx", dx, rdx, GRAD_TOL["float16"])


@pytest.mark.parametrize("impl", IMPLS)
def test_lowering_uses_the_chosen_implementation(impl):
    need(impl)
    x = jnp.ones((4, 8, 16), jnp.float32)
    f = lambda x: jax_ops.batch_norm_relu(x, implementation=impl)[0].sum()  # noqa: E731
    text = jax.jit(jax.grad(f)).lower(x).as_text()
    # the FFI custom calls (a Pallas kernel's name may contain the same words)
    found = [re.search(rf"custom_call\s*@{t}\b", text) is not None for t in ("jax_ops_bn_relu_fwd", "jax_ops_bn_relu_bwd")]
    assert found == [impl == "cuda"] * 2, found


def test_errors_name_the_argument():
    x = jnp.ones((4, 8), jnp.float32)
    c8 = jnp.ones(8)
    with pytest.raises(ValueError, match=r"batch_norm_relu: x must have rank >= 2.*got shape \(8,\)"):
        jax_ops.batch_norm_relu(c8)
    with pytest.raises(TypeError, match=r"x must be float32, bfloat16 or float16; got dtype int32"):
        jax_ops.batch_norm_relu(x.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"scale must have shape \(8,\).*got shape \(4,\)"):
        jax_ops.batch_norm_relu(x, jnp.ones(4))
    with pytest.raises(TypeError, match=r"bias must be float32 or x's dtype float32; got float16"):
        jax_ops.batch_norm_relu(x, c8, c8.astype(jnp.float16))
    with pytest.raises(ValueError, match=r"mean/var are the running statistics used when training=False"):
        jax_ops.batch_norm_relu(x, mean=c8, var=c8)
    with pytest.raises(ValueError, match=r"var is required when training=False"):
        jax_ops.batch_norm_relu(x, training=False, mean=c8)
    with pytest.raises(ValueError, match=r"mean must have shape \(8,\).*got shape \(3,\)"):
        jax_ops.batch_norm_relu(x, training=False, mean=jnp.ones(3), var=c8)
    with pytest.raises(ValueError, match=r"batch statistics need at least one row"):
        jax_ops.batch_norm_relu(jnp.ones((0, 8)))
    with pytest.raises(TypeError, match=r"training must be a Python bool"):
        jax_ops.batch_norm_relu(x, training=jnp.array(True))
    with pytest.raises(ValueError, match=r"epsilon must be finite and >= 0; got -1"):
        jax_ops.batch_norm_relu(x, epsilon=-1.0)
    with pytest.raises(ValueError, match=r"batch_norm_add_relu: z must have x's shape \(4, 8\).*\(4, 9\)"):
        jax_ops.batch_norm_add_relu(x, jnp.ones((4, 9)))
    with pytest.raises(TypeError, match=r"batch_norm_add_relu: z must have x's dtype float32; got bfloat16"):
        jax_ops.batch_norm_add_relu(x, x.astype(jnp.bfloat16))


def _close_tree(got, want, rel):
    """Every leaf within rel of the largest magnitude of its reference."""
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        g, w = f64(g), f64(w)
        assert g.shape == w.shape, (g.shape, w.shape)
        scale = max(float(np.max(np.abs(w))), 1e-30) if w.size else 1.0
        err = float(np.max(np.abs(g - w))) if w.size else 0.0
        assert err <= rel * scale, f"max error {err:.3g} > {rel} * {scale:.3g}"


def _flax_like(x, z, scale, bias, mean, var, *, training):
    """flax.linen.BatchNorm (biased batch variance) + relu in float32 jnp."""
    xf = x.astype(jnp.float32)
    axes = tuple(range(x.ndim - 1))
    if training:
        mean = jnp.mean(xf, axes)
        var = jnp.mean(jnp.square(xf - mean), axes)
    pre = (xf - mean) * jax.lax.rsqrt(var + EPS) * scale + bias
    y = jax.nn.relu(pre if z is None else pre + z.astype(jnp.float32)).astype(x.dtype)
    return (y, mean, var) if training else y


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("op", OPS)
def test_autodiff_matches_jnp(op, training, impl):
    """Forward mode, reverse mode and second order against a flax-like jnp BatchNorm+ReLU:
    jvp, linearize, jacfwd, jacrev, the Hessian of a smooth scalar function (relu³ is C²;
    in training it also uses the returned statistics), grad of grad and a Hessian-vector
    product, w.r.t. x, z, scale, bias (and the given mean/var at inference). Reverse mode
    runs the backward stage, not the tangent map."""
    need(impl)
    x, z, scale, bias, w, u, t = _inputs((4, 3, 5), "float32", seed_of(f"autodiff{op}{training}"))
    rng = np.random.default_rng(seed_of(f"stats{op}{training}"))
    mean = jnp.asarray(rng.normal(0, 0.5, 5).astype(np.float32))
    var = jnp.asarray(rng.uniform(0.5, 2, 5).astype(np.float32))
    has_z = op == "batch_norm_add_relu"
    args = (x, scale, bias) + ((z,) if has_z else ()) + (() if training else (mean, var))

    def split(a):  # args -> (x, z, scale, bias, mean, var)
        x, scale, bias, *rest = a
        zz = rest.pop(0) if has_z else None
        m, v = (None, None) if training else rest
        return x, zz, scale, bias, m, v

    def ours(*a):
        x, zz, scale, bias, m, v = split(a)
        kw = {} if training else {"training": False, "mean": m, "var": v}
        return call(op, x, zz, scale, bias, impl, **kw)

    def ref(*a):
        x, zz, scale, bias, m, v = split(a)
        return _flax_like(x, zz, scale, bias, m, v, training=training)

    def smooth(fn):
        def loss(*a):
            out = fn(*a)
            if not training:
                return jnp.sum(out ** 3 * w)
            y, m, v = out
            return jnp.sum(y ** 3 * w) + jnp.sum(m * u) + jnp.sum(v ** 2 * t)
        return loss
    f, f_ref = smooth(ours), smooth(ref)
    argnums = tuple(range(len(args)))
    trng = np.random.default_rng(7)
    tangents = tuple(jnp.asarray(trng.standard_normal(a.shape).astype(np.float32)) for a in args)

    _close_tree(jax.jvp(ours, args, tangents), jax.jvp(ref, args, tangents), 1e-4)
    y, f_lin = jax.linearize(f, *args)
    y_ref, f_lin_ref = jax.linearize(f_ref, *args)
    _close_tree((y, f_lin(*tangents)), (y_ref, f_lin_ref(*tangents)), 1e-4)
    _close_tree(jax.jacfwd(ours, argnums)(*args), jax.jacfwd(ref, argnums)(*args), 1e-4)
    _close_tree(jax.jacrev(ours, argnums)(*args), jax.jacrev(ref, argnums)(*args), 1e-4)
    _close_tree(jax.hessian(f, argnums)(*args), jax.hessian(f_ref, argnums)(*args), 1e-4)

    def grad_of_grad(fn):
        return jax.grad(lambda *a: sum(jnp.sum(g * d) for g, d in
                                       zip(jax.grad(fn, argnums)(*a), tangents)), argnums)(*args)
    _close_tree(grad_of_grad(f), grad_of_grad(f_ref), 1e-4)

    def hvp(fn):
        return jax.jvp(jax.grad(fn, argnums), args, tangents)[1]
    _close_tree(hvp(f), hvp(f_ref), 1e-4)

    names = support.primitive_names(jax.make_jaxpr(jax.grad(f, argnums))(*args))
    assert BWD.prim.name in names, names
    assert not any(n.endswith("_tangent") for n in names), names


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
@pytest.mark.parametrize("impl", ["xla", "cuda"])
def test_rows_sharded_training_keeps_the_implementation(impl):
    """Rows sharded in training: each device normalizes its rows with the global
    statistics by binding the forward stage with the implementation asked for (the
    automatic choice on CPU would be XLA's)."""
    need(impl)
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((2,), ("a",), devices=jax.devices()[:2])
    x = jax.device_put(make(np.random.default_rng(5), (8, 4, 64), "float32"), NamedSharding(mesh, P("a")))
    text = jax.jit(lambda x: jax_ops.batch_norm_relu(x, implementation=impl)).lower(x).compile().as_text()
    assert ('custom_call_target="jax_ops_bn_relu_fwd"' in text) == (impl == "cuda")
    assert "all-gather" in text  # the global statistics: every device's (mean, M2) per channel
    # the per-device stages: the local statistics forward; Σg/Σg·x̂, psum, dx backward
    grad = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(jax_ops.batch_norm_relu(x, implementation=impl)[0]))))
    text = grad.lower(x).compile().as_text()
    for target in ("jax_ops_bn_stats", "jax_ops_bn_grad_sums", "jax_ops_bn_dx"):
        assert (f'custom_call_target="{target}"' in text) == (impl == "cuda"), target
    assert 'custom_call_target="jax_ops_bn_relu_bwd"' not in text


# ------------------------------------------- batch-sharded training stages ---

def _stage_inputs(rng, shape, dtype):
    """x, dy, the forward's mask (inference pass with mean/var of x), mean, rstd, scale."""
    x = make(rng, shape, dtype, offset=0.3)
    dy = make(rng, shape, dtype)
    c = shape[-1]
    xf = f64(x).reshape(-1, c)
    mean = jnp.asarray(xf.mean(0), jnp.float32)
    var = jnp.asarray(xf.var(0), jnp.float32)
    scale = jnp.asarray(1 + 0.1 * rng.standard_normal(c), jnp.float32)
    _, mask, _, _, rstd = FWD.call(x, None, scale, jnp.zeros(c, jnp.float32), mean, var, epsilon=EPS,
                                   training=False, implementation="xla")
    return x, dy, mask, mean, rstd, scale


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_stages_against_float64(shape, dtype, impl):
    """The stages of the batch-sharded training path (STATS, GRAD_SUMS, DX) against
    float64, each called alone on one device's rows; DX with sums and a row count N
    larger than the local rows (as the global ones are), and the statistics' cotangents."""
    need(impl)
    rng = np.random.default_rng(seed_of(f"stages{shape}{dtype}{impl}"))
    x, dy, mask, mean, rstd, scale = _stage_inputs(rng, shape, dtype)
    c = shape[-1]
    xf = f64(x).reshape(-1, c)
    m, v, r = STATS.call(x, epsilon=EPS, implementation=impl)
    assert_close("mean", m, xf.mean(0), TOL["float32"] * 4)
    assert_close("var", v, xf.var(0), TOL["float32"] * 4)
    assert_close("rstd", r, 1 / np.sqrt(xf.var(0) + EPS), TOL["float32"] * 4)

    bits = f64(jax_ops.core.bitmask.unpack_bits(mask, x.shape)).reshape(-1, c)
    g = bits * f64(dy).reshape(-1, c)
    xhat = (xf - f64(mean)) * f64(rstd)
    ds, db = GRAD_SUMS.call(dy, x, mask, mean, rstd, implementation=impl)
    assert_close("dscale sum", ds, (g * xhat).sum(0), GRAD_TOL[dtype])
    assert_close("dbias sum", db, g.sum(0), GRAD_TOL[dtype])

    n = 3 * xf.shape[0] + 1  # the global rows
    gds, gdb = 2.5 * f64(ds), -0.5 + f64(db)
    gmean, gvar = (jnp.asarray(0.1 * rng.standard_normal(c), jnp.float32) for _ in range(2))
    for has_z in (False, True):
        dx, dz = DX.call(dy, x, mask, mean, rstd, scale, gmean, gvar, jnp.asarray(gds, jnp.float32),
                         jnp.asarray(gdb, jnp.float32), has_z=has_z, count=float(n), implementation=impl)
        a = f64(scale) * f64(rstd)
        want = (a * g + ((2 * f64(gvar) / f64(rstd) - a * gds) / n) * xhat + (f64(gmean) - a * gdb) / n)
        assert_close("dx", f64(dx).reshape(-1, c), want, GRAD_TOL[dtype])
        if has_z:
            assert_close("dz", f64(dz).reshape(-1, c), g, TOL[dtype])
        else:
            assert dz is None


@pytest.mark.parametrize("impl", ["xla", "cuda"])
def test_stage_errors(impl):
    need(impl)
    x = jnp.ones((4, 8), jnp.float32)
    mask = jnp.zeros((1,), jnp.uint32)
    c = jnp.ones((8,), jnp.float32)
    with pytest.raises(ValueError, match="at least one row"):
        STATS.call(jnp.ones((0, 8)), epsilon=EPS, implementation=impl)
    with pytest.raises(ValueError, match="dy must match x"):
        GRAD_SUMS.call(x.astype(jnp.bfloat16), x, mask, c, c, implementation=impl)
    with pytest.raises(ValueError, match=r"rstd must be float32 of shape \(8,\)"):
        GRAD_SUMS.call(x, x, mask, c, c[:4], implementation=impl)
    with pytest.raises(ValueError, match="mask must be uint32"):
        GRAD_SUMS.call(x, x, jnp.zeros((2,), jnp.uint32), c, c, implementation=impl)
    with pytest.raises(ValueError, match="count"):
        DX.call(x, x, mask, c, c, c, c, c, c, c, has_z=False, count=3.0, implementation=impl)
