"""The conv_space_to_depth pattern (jax_ops/fx/conv_space_to_depth.py): a strided conv
over few input channels computed as a stride-1 conv over the space-to-depth input.
Against a float64 conv (values and both gradients) in every layout, stride, padding
and dimensionality it takes; convs it is not for are neither replaced nor reported;
the inference fold regroups its stem conv only where the pattern would."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ops
from jax_ops import fx
from support import conv64, conv_params, highest_precision, rel  # noqa: F401 (a fixture)
from jax_ops.fx import conv_space_to_depth as s2d

pytestmark = pytest.mark.usefixtures("highest_precision")

# (x shape, kernel, strides, padding, dimension numbers)
CASES = [
    ((2, 17, 19, 3), (7, 7), (2, 2), ((3, 3), (3, 3)), ("NHWC", "HWIO", "NHWC")),  # a stem
    ((2, 16, 16, 1), (3, 5), (2, 3), ((1, 0), (2, 2)), ("NHWC", "HWIO", "NHWC")),
    ((2, 3, 15, 14), (4, 4), (4, 4), ((0, 0), (0, 0)), ("NCHW", "OIHW", "NCHW")),
    ((3, 20, 2), (5,), (2,), ((2, 2),), ("NWC", "WIO", "NWC")),
    ((2, 9, 9, 4), (2, 2), (2, 1), ((0, 1), (1, 0)), ("NHWC", "HWIO", "NCHW")),
    ((2, 5, 9, 9, 2), (3, 3, 3), (2, 2, 2), ((1, 1),) * 3, ("NDHWC", "DHWIO", "NDHWC")),
    ((1, 8, 8, 3), (3, 3), (3, 3), ((5, -1), (0, 4)), ("NHWC", "HWIO", "NHWC")),  # crop + pad
]


def _case(i, dtype, seed):
    shape, k, s, pad, dn = CASES[i]
    rng = np.random.default_rng(seed)
    c = shape[dn[0].index("C")]
    w_shape = [{"O": 8, "I": c}.get(ch) or k["DHW"[3 - len(k):].index(ch)] for ch in dn[1]]
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    w = jnp.asarray(rng.standard_normal(w_shape) / np.sqrt(np.prod(k) * c), dtype)
    return x, w, conv_params(x.shape, w.shape, s, pad, dn)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_regrouped_conv_matches_a_float64_conv(case, dtype):
    x, w, params = _case(case, dtype, case)
    conv = lambda x, w: jax.lax.conv_general_dilated(x, w, **params)  # noqa: E731
    recs = fx.rewrites(conv, x, w, policy="always")
    assert [(r.pattern, r.replaced) for r in recs] == [("conv_space_to_depth", True)], recs
    fast = jax.jit(jax_ops.optimize(conv, policy="always"))
    y = fast(x, w)
    assert y.shape == conv(x, w).shape and y.dtype == dtype
    y64 = conv64(x, w, params)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert rel(y, y64) < tol
    ct = jnp.asarray(np.random.default_rng(7).standard_normal(y.shape), dtype)
    dx, dw = jax.jit(lambda x, w: jax.vjp(fast, x, w)[1](ct))(x, w)
    dx64, dw64 = conv64(x, w, params, ct)
    assert rel(dx, dx64) < tol and rel(dw, dw64) < tol


def test_regrouping_one_image_and_empty():
    x, w, params = _case(0, jnp.float32, 3)
    x1 = x[:1, :7]  # one image of 7 rows: (7 + 6 - 7) // 2 + 1 = 4 output rows
    y = s2d.space_to_depth_conv(x1, w, params)
    ref = conv64(x1, w, params)
    assert np.isfinite(np.asarray(y)).all() and rel(y, ref) < 1e-6
    empty = jnp.zeros((0, 17, 19, 3), jnp.float32)
    assert s2d.space_to_depth_conv(empty, w, params).shape == (0, 9, 10, 8)


def test_convs_it_is_not_for_are_not_reported():
    """Stride 1, more than MAX_CHANNELS inputs, dilation and groups: not candidates."""
    rng = np.random.default_rng(0)
    x3 = jnp.asarray(rng.standard_normal((2, 12, 12, 3)), jnp.float32)
    x8 = jnp.asarray(rng.standard_normal((2, 12, 12, 8)), jnp.float32)
    w3 = jnp.asarray(rng.standard_normal((3, 3, 3, 4)), jnp.float32)
    w8 = jnp.asarray(rng.standard_normal((3, 3, 8, 4)), jnp.float32)
    wg = jnp.asarray(rng.standard_normal((3, 3, 1, 3)), jnp.float32)
    dn = ("NHWC", "HWIO", "NHWC")
    near = {
        "stride 1": lambda: (lambda x, w: jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=dn), x3, w3),
        "wide input": lambda: (lambda x, w: jax.lax.conv_general_dilated(
            x, w, (2, 2), "SAME", dimension_numbers=dn), x8, w8),
        "dilated": lambda: (lambda x, w: jax.lax.conv_general_dilated(
            x, w, (2, 2), "SAME", rhs_dilation=(2, 2), dimension_numbers=dn), x3, w3),
        "grouped": lambda: (lambda x, w: jax.lax.conv_general_dilated(
            x, w, (2, 2), "SAME", dimension_numbers=dn, feature_group_count=3), x3, wg),
    }
    for label, make in near.items():
        f, x, w = make()
        recs = fx.rewrites(f, x, w, policy="always", patterns=["conv_space_to_depth"])
        assert list(recs) == [], (label, recs)
    assert s2d.unsupported((2, 8, 8, 3), (3, 3, 3, 4), None) == "stride 1 (nothing to regroup)"
    p4 = {**s2d.conv_params(None), "window_strides": (2,) * 4,
          "dimension_numbers": jax.lax.ConvDimensionNumbers((0, 5, 1, 2, 3, 4), (5, 4, 0, 1, 2, 3),
                                                            (0, 5, 1, 2, 3, 4))}
    assert "4 spatial dimensions" in s2d.unsupported((1, 4, 4, 4, 4, 3), (3, 3, 3, 3, 3, 4), p4)
    p2 = {**s2d.conv_params(None), "window_strides": (2, 2)}
    assert "1x1 kernel" in s2d.unsupported((2, 8, 8, 3), (1, 1, 3, 4), p2)
    with pytest.raises(ValueError, match="stride 1"):
        s2d.space_to_depth_conv(x3, w3, None)


def test_auto_keeps_xla_off_the_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("the automatic choice off the GPU")
    x, w, params = _case(0, jnp.float32, 1)
    conv = lambda x, w: jax.lax.conv_general_dilated(x, w, **params)  # noqa: E731
    [rec] = fx.rewrites(conv, x, w, policy="auto")
    assert not rec.replaced and "not faster on cpu" in rec.reason


class _Stem(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.Conv(16, (7, 7), strides=(2, 2), padding=((3, 3), (3, 3)), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.relu(x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_flax_stem_in_training_and_the_fold_at_inference(dtype, monkeypatch):
    """Training: the stem conv is regrouped (with batch_norm_relu after it). Inference:
    conv_batch_norm folds it and regroups its conv where conv_space_to_depth would (on
    GPU; here made to decide so), and not when it is excluded."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 32, 32, 3)), dtype)
    m = _Stem()
    v = m.init(jax.random.key(0), x, False)
    v = jax.tree.map(lambda a: a + 0.1 * jax.random.uniform(jax.random.key(2), a.shape), v)

    def loss(params, x):
        y, _ = m.apply({**v, "params": params}, x, True, mutable=["batch_stats"])
        return jnp.sum(y.astype(jnp.float32) ** 2)
    recs = fx.rewrites(loss, v["params"], x, policy="always")
    assert "conv_space_to_depth" in [r.pattern for r in recs if r.replaced], recs
    g = jax.jit(jax.grad(jax_ops.optimize(loss, policy="always")))(v["params"], x)
    g_ref = jax.grad(loss)(v["params"], x)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        assert rel(a, b) < (1e-5 if dtype == jnp.float32 else 3e-2)

    infer = lambda v, x: m.apply(v, x, False)  # noqa: E731
    # the fold asks conv_space_to_depth's decide afresh: make it decide as on a GPU
    monkeypatch.setattr(s2d, "_decide", lambda avals, params: None)
    recs = fx.rewrites(infer, v, x, policy="auto")
    [fold] = [r for r in recs if r.pattern == "conv_batch_norm"]
    assert fold.replaced and fold.params.get("conv_rewrite") == "conv_space_to_depth", recs
    y = jax.jit(jax_ops.optimize(infer, policy="auto"))(v, x)
    y32 = _Stem().apply(jax.tree.map(lambda a: a.astype(jnp.float32), v), x.astype(jnp.float32), False)
    assert rel(y, y32) < (1e-5 if dtype == jnp.float32 else 2e-2)
    excl = fx.rewrites(infer, v, x, policy="auto", exclude=["conv_space_to_depth"])
    assert not any(r.params.get("conv_rewrite") for r in excl), excl
