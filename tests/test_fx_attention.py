"""The `attention` pattern (jax_ops/fx/attention.py): flax and hand-written attention
matched exactly, a constant causal bias/mask recognised, near misses kept. CPU: the
replacement runs jax.nn.dot_product_attention's XLA implementation under
policy="always" (cuDNN is the GPU route, benchmarks/model_step.py)."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ops
from jax_ops import fx
from jax_ops.fx import attention as A

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402

B, T, H, D = 2, 16, 4, 8


@pytest.fixture(autouse=True)
def highest_precision():
    """float32 matmuls in float32 on a GPU too (its default is TF32)."""
    with jax.default_matmul_precision("highest"):
        yield


def _qkv(dtype=jnp.float32, layout="bthd", seed=0):
    shape = (B, T, H, D) if layout == "bthd" else (B, H, T, D)
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in ks)


def _records(fn, *args, policy="always"):
    return [r for r in fx.rewrites(fn, *args, policy=policy) if r.pattern == "attention"]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@contextlib.contextmanager
def _spy():
    """The is_causal of every jax.nn.dot_product_attention call made inside."""
    seen = []
    real = jax.nn.dot_product_attention

    def spy(*a, **k):
        seen.append(k.get("is_causal"))
        return real(*a, **k)
    jax.nn.dot_product_attention = spy
    try:
        yield seen
    finally:
        jax.nn.dot_product_attention = real


def _check_replaced(fn, args, *, causal, tol=1e-5):
    recs = _records(fn, *args)
    assert recs and all(r.replaced for r in recs), recs
    assert all(r.params.get("is_causal") is causal for r in recs), [r.params for r in recs]
    fast = jax_ops.optimize(fn, policy="always")
    fast(*args)  # analysed once per signature (that traces the replacement too)
    with _spy() as seen:
        fast(*args)
    assert seen == [causal] * len(recs), seen
    assert _rel(jax.jit(fast)(*args), fn(*args)) < tol
    loss = lambda *a: jnp.sum(jnp.sin(fn(*a).astype(jnp.float32)))  # noqa: E731
    floss = lambda *a: jnp.sum(jnp.sin(fast(*a).astype(jnp.float32)))  # noqa: E731
    for g, h in zip(jax.grad(floss, argnums=(0, 1, 2))(*args), jax.grad(loss, argnums=(0, 1, 2))(*args)):
        assert _rel(g, h) < tol * 10


def _causal_mask():
    return nn.make_causal_mask(jnp.ones((B, T)))          # (B, 1, T, T) bool


# ------------------------------------------------------------- formulations ---

def test_flax_linen_plain():
    _check_replaced(lambda q, k, v: nn.dot_product_attention(q, k, v), _qkv(), causal=False)


def test_flax_linen_causal_mask_built_in_the_graph():
    def f(q, k, v):
        return nn.dot_product_attention(q, k, v, mask=_causal_mask())
    _check_replaced(f, _qkv(), causal=True)


def test_flax_linen_causal_bias_float32_softmax_bf16():
    def f(q, k, v):
        bias = jnp.where(_causal_mask(), 0.0, jnp.finfo(jnp.float32).min).astype(jnp.bfloat16)
        return nn.dot_product_attention(q, k, v, bias, force_fp32_for_softmax=True)
    _check_replaced(f, _qkv(jnp.bfloat16), causal=True, tol=2e-2)


def test_flax_multi_head_module_with_causal_mask():
    layer = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * D)
    x = jax.random.normal(jax.random.key(3), (B, T, H * D))
    params = layer.init(jax.random.key(0), x, mask=_causal_mask())

    def f(params, x):
        return layer.apply(params, x, mask=_causal_mask())
    recs = _records(f, params, x)
    assert len(recs) == 1 and recs[0].replaced and recs[0].params["is_causal"] is True, recs
    fast = jax_ops.optimize(f, policy="always")
    assert _rel(jax.jit(fast)(params, x), f(params, x)) < 1e-5
    g1 = jax.grad(lambda p: jnp.sum(fast(p, x) ** 2))(params)
    g2 = jax.grad(lambda p: jnp.sum(f(p, x) ** 2))(params)
    scale = max(float(jnp.abs(b).max()) for b in jax.tree.leaves(g2))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):  # key bias: exactly 0 in math
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("causal", [False, True])
def test_handwritten_einsum_bthd(causal):
    def f(q, k, v):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
        if causal:
            mask = jnp.tril(jnp.ones((T, T), bool))
            logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        w = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)
    recs = _records(f, *_qkv())
    assert recs[0].params["scale"] == pytest.approx(0.3)
    _check_replaced(f, _qkv(), causal=causal)


def test_handwritten_matmul_bhtd_with_causal_bias():
    def f(q, k, v):
        bias = jnp.where(jnp.tril(jnp.ones((T, T), bool)), 0.0, -1e9)
        logits = q @ jnp.swapaxes(k, -1, -2) * 0.125 + bias
        return jax.nn.softmax(logits, axis=-1) @ v
    _check_replaced(f, _qkv(layout="bhtd"), causal=True)


def test_hugging_face_gpt2_attention():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
        pytest.skip("transformers without Flax models (>= 5): the test extra pins 4.57.6")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, n_positions=32, vocab_size=50)
    model = transformers.FlaxGPT2LMHeadModel(cfg, input_shape=(1, 8), seed=0)
    ids = jax.random.randint(jax.random.key(0), (2, 8), 0, 50)

    def f(params, ids):
        return model(ids, params=params).logits
    recs = _records(f, model.params, ids)
    assert len(recs) == 1 and recs[0].replaced and recs[0].params["is_causal"] is True, recs
    fast = jax_ops.optimize(f, policy="always")
    assert _rel(jax.jit(fast)(model.params, ids), f(model.params, ids)) < 1e-5


# ----------------------------------------------------------------- near misses ---

def _kept(fn, args, why):
    recs = _records(fn, *args)
    assert recs and not any(r.replaced for r in recs), recs
    assert any(why in (r.reason or "") for r in recs), [r.reason for r in recs]
    fast = jax_ops.optimize(fn, policy="always")
    with _spy() as seen:
        fast(*args)
    assert seen == []


def test_near_miss_padding_mask_from_an_input():
    def f(q, k, v, keep):
        return nn.dot_product_attention(q, k, v, mask=keep[:, None, None, :])
    _kept(f, (*_qkv(), jnp.arange(T)[None, :] < jnp.array([[T], [T - 3]])), "computed from inputs")


def test_near_miss_sliding_window_mask():
    i = jnp.arange(T)
    window = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 4)

    def f(q, k, v):
        return nn.dot_product_attention(q, k, v, mask=window[None, None])
    _kept(f, _qkv(), "neither causal nor empty")


def test_near_miss_anti_causal_and_alibi_bias():
    upper = jnp.triu(jnp.ones((T, T), bool))

    def f(q, k, v):
        return nn.dot_product_attention(q, k, v, mask=upper[None, None])
    _kept(f, _qkv(), "neither causal nor empty")
    alibi = -0.5 * jnp.abs(jnp.arange(T)[:, None] - jnp.arange(T)[None, :]).astype(jnp.float32)

    def g(q, k, v):
        return nn.dot_product_attention(q, k, v, alibi[None, None])
    _kept(g, _qkv(), "neither causal nor empty")


def test_near_miss_small_masked_bias_is_not_a_mask():
    # -1e4 does not make the weight exactly 0: not the causal mask
    def f(q, k, v):
        bias = jnp.where(jnp.tril(jnp.ones((T, T), bool)), 0.0, -1e4)
        logits = q @ jnp.swapaxes(k, -1, -2) * 0.125 + bias
        return jax.nn.softmax(logits, axis=-1) @ v
    _kept(f, _qkv(layout="bhtd"), "neither causal nor empty")


def test_near_miss_weights_used_twice():
    def f(q, k, v):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
        w = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v), w.mean()
    recs = _records(f, *_qkv())
    assert recs and not any(r.replaced for r in recs)
    assert "used elsewhere" in recs[0].reason


def test_near_miss_softmax_over_another_axis():
    def f(q, k, v):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
        w = jax.nn.softmax(logits, axis=-2)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)
    recs = _records(f, *_qkv())
    assert not any(r.replaced for r in recs)
    with _spy() as seen:
        jax_ops.optimize(f, policy="always")(*_qkv())
    assert seen == []


def test_near_miss_dropout_is_not_matched():
    def f(q, k, v):
        return nn.dot_product_attention(q, k, v, dropout_rng=jax.random.key(0), dropout_rate=0.1,
                                        deterministic=False)
    assert not any(r.replaced for r in _records(f, *_qkv()))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's reason")
def test_policy_auto_on_cpu_keeps_it_and_says_why():
    recs = _records(lambda q, k, v: nn.dot_product_attention(q, k, v), *_qkv(jnp.bfloat16),
                    policy="auto")
    assert recs and not recs[0].replaced and "CUDA GPU" in recs[0].reason


# ------------------------------------------------------------------- helpers ---

def test_constant_value_and_classify():
    g = fx.trace(lambda x: x + jnp.tril(jnp.ones((4, 4))), jnp.ones((4, 4)), inline_jit=True)
    add = [n for n in g.nodes if n.name == "add"][-1]
    const = [a for a in add.inputs if a is not g.inputs[0]][0]
    np.testing.assert_array_equal(A.constant_value(const), np.tril(np.ones((4, 4))))
    assert A.constant_value(g.inputs[0]) is None
    tril = np.tril(np.ones((4, 4), bool))
    assert A._classify(tril, True, (2, 3, 4, 4)) == "causal"
    assert A._classify(np.ones((1, 1, 4, 4), bool), True, (2, 3, 4, 4)) == "none"
    assert A._classify(np.where(tril, 0.0, -np.inf), False, (2, 3, 4, 4)) == "causal"
    assert A._classify(np.where(tril, 0.0, -1.0), False, (2, 3, 4, 4)) is None
    assert A._classify(tril[:3], True, (2, 3, 3, 4)) is None  # q != k: not jax's causal
