"""The max_pool pattern (jax_ops/fx/max_pool.py): reduce_window_max whose gradient keeps
the window index instead of running select_and_scatter. Against jax's own gradient of
the original (XLA's select_and_scatter_add) on CPU: values bitwise, gradients to float32
rounding (an input in several windows sums in another order), ties, -inf and padding
included; near misses are not rewritten."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ops
from jax_ops import fx

# (window, strides, padding) of flax.linen.max_pool on NHWC / NWC inputs
CASES = [((3, 3), (2, 2), ((1, 1), (1, 1))),   # ResNet's stem
         ((2, 2), (2, 2), "VALID"),
         ((3, 3), (1, 1), "SAME"),
         ((3, 2), (2, 3), ((0, 2), (1, 0))),   # uneven windows, strides and padding
         ((3,), (2,), ((1, 1),))]               # 1-D pooling, (N, L, C)


def _pool(window, strides, padding):
    return lambda x: nn.max_pool(x, window, strides=strides, padding=padding)


def _inputs(shape, dtype, kind, seed):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    if kind == "ties":  # few distinct values: many windows with several maxima
        x = jnp.round(x * 1.5)
    elif kind == "-inf":  # -inf inputs, and a whole window of them
        x = jnp.where(x > 0.8, -jnp.inf, x)
        x = x.at[:, :3].set(-jnp.inf)
    elif kind == "nan":  # NaN propagates to the value; the selection follows ge's rule
        x = jnp.where(x > 1.5, jnp.nan, x)
    return x.astype(dtype)


def _grad(f, x, ct):
    return jax.vjp(f, x)[1](ct)[0]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", ["normal", "ties", "-inf", "nan"])
def test_max_pool_matches_the_original(case, dtype, kind):
    window, strides, padding = CASES[case]
    f = _pool(window, strides, padding)
    shape = (2, 11, 13, 5) if len(window) == 2 else (3, 17, 4)
    x = _inputs(shape, dtype, kind, 10 * case + len(kind))
    recs = fx.rewrites(f, x, policy="always")
    assert [r.pattern for r in recs if r.replaced] == ["max_pool"], recs
    fast = jax_ops.optimize(f, policy="always")
    y, y_ref = jax.jit(fast)(x), f(x)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    ct = jax.random.normal(jax.random.key(99), y.shape, jnp.float32).astype(dtype)
    g = np.asarray(jax.jit(lambda x: _grad(fast, x, ct))(x), np.float64)
    g_ref = np.asarray(_grad(f, x, ct), np.float64)
    # float64 reference: each input's cotangents summed over the windows that select it
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert np.linalg.norm(g - g_ref) <= tol * max(np.linalg.norm(g_ref), 1e-30), (case, kind)
    assert g.shape == x.shape and np.isfinite(g).all() and np.isfinite(g_ref).all()


def test_max_pool_gradient_skips_select_and_scatter():
    f = _pool((3, 3), (2, 2), ((1, 1), (1, 1)))
    x = _inputs((2, 9, 9, 4), jnp.bfloat16, "normal", 0)
    fast = jax_ops.optimize(f, policy="always")

    def loss(fn):
        return lambda x: fn(x).astype(jnp.float32).sum()
    assert "select_and_scatter_add" in str(jax.make_jaxpr(jax.grad(loss(f)))(x))
    hlo = jax.jit(jax.grad(loss(fast))).lower(x).as_text()
    assert "select_and_scatter" not in hlo and "reduce_window" not in hlo
    # without differentiation: the original reduce_window_max
    assert "reduce_window_max" in str(jax.make_jaxpr(fast)(x))


def test_max_pool_forward_mode_and_second_order():
    # a custom_jvp: jvp, jacfwd and Hessian-vector products work as on the original
    f = _pool((3, 3), (2, 2), ((1, 1), (1, 1)))
    x = _inputs((2, 7, 6, 3), jnp.float32, "ties", 5)
    t = jax.random.normal(jax.random.key(6), x.shape)
    fast = jax_ops.optimize(f, policy="always")
    (y1, ty1), (y2, ty2) = jax.jvp(fast, (x,), (t,)), jax.jvp(f, (x,), (t,))
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(ty1, ty2)

    def loss(fn):
        return lambda x: jnp.sum(jnp.sin(fn(x)) * fn(x))
    # second order away from ties: at ties the original's Hessian-vector product picks
    # other window elements than its own jvp and vjp do (CPU: 18 of 252 outputs differ)
    xn = _inputs(x.shape, jnp.float32, "normal", 7)
    hvp = [jax.jvp(jax.grad(loss(fn)), (xn,), (t,))[1] for fn in (fast, f)]
    np.testing.assert_allclose(hvp[0], hvp[1], rtol=1e-6, atol=1e-6)
    vm = jax.vmap(fast)(x[:, None]), jax.vmap(f)(x[:, None])
    np.testing.assert_array_equal(vm[0], vm[1])


def test_max_pool_near_misses_are_not_rewritten():
    x = _inputs((2, 9, 9, 4), jnp.float32, "normal", 1)

    def dilated(x):  # window dilation: another computation
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "VALID",
                                     window_dilation=(1, 2, 2, 1))

    def zero_init(x):  # max with 0: relu-like, reduce_window with another init
        return jax.lax.reduce_window(x, 0.0, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    def avg(x):
        return nn.avg_pool(x, (2, 2), strides=(2, 2))

    recs = fx.rewrites(dilated, x, policy="always")
    assert not any(r.replaced for r in recs), recs
    assert any(r.pattern == "max_pool" and "dilat" in r.reason for r in recs), recs
    for fn in (zero_init, avg):
        recs = fx.rewrites(fn, x, policy="always")
        assert not any(r.pattern == "max_pool" and r.replaced for r in recs), recs
        np.testing.assert_array_equal(jax_ops.optimize(fn, policy="always")(x), fn(x))
    x8 = x.astype(jnp.float8_e4m3fn)  # no -inf to pad with: not rewritten
    recs = fx.rewrites(_pool((2, 2), (2, 2), "VALID"), x8, policy="always")
    assert not any(r.replaced for r in recs), recs
    xi = jnp.round(x * 4).astype(jnp.int32)
    recs = fx.rewrites(_pool((2, 2), (2, 2), "VALID"), xi, policy="always")
    assert not any(r.replaced for r in recs), recs


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the automatic choice off the GPU")
def test_max_pool_auto_keeps_xla_off_the_gpu():
    f = _pool((3, 3), (2, 2), ((1, 1), (1, 1)))
    x = _inputs((2, 9, 9, 4), jnp.float32, "normal", 2)
    (r,) = [r for r in fx.rewrites(f, x, policy="auto") if r.pattern == "max_pool"]
    assert not r.replaced and "not faster on cpu" in r.reason, r
