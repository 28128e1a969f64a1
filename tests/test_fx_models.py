"""jax_ops.optimize on models we did not write, installed from PyPI at the versions
pinned in the test extra: Hugging Face transformers' Flax GPT-2 (decoder LM), BERT
(encoder) and ResNet, and dm-haiku's ResNet and MLP. Tiny sizes, CPU, policy="always":
every verified match is replaced, and the rewritten model agrees with the original in
outputs, gradients and (ResNet) BatchNorm state."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ops
from jax_ops import fx

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
    pytest.skip("transformers without Flax models (>= 5): the test extra pins 4.57.6",
                allow_module_level=True)


@pytest.fixture(autouse=True)
def highest_precision():
    """float32 matmuls and convolutions in float32 on a GPU too (its default is TF32)."""
    with jax.default_matmul_precision("highest"):
        yield


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _replaced(fn, *args):
    recs = fx.rewrites(fn, *args, policy="always")
    return collections.Counter(r.pattern for r in recs if r.replaced), recs


def _tree_close(a, b, rtol):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    scale = max(float(np.abs(np.asarray(x, np.float64)).max()) for x in lb)
    for x, y in zip(la, lb):  # relative to the largest leaf: some are exactly 0 in math
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=rtol, atol=rtol * scale)


def _tree_rel(a, ref):
    """‖a − ref‖/‖ref‖ over all leaves."""
    la = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(a)])
    lr = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(ref)])
    return np.linalg.norm(la - lr) / max(np.linalg.norm(lr), 1e-30)


def _as_float64(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64)
                        if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) else a, tree)


def test_hf_gpt2_lm_loss_and_grads():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=61)
    model = transformers.FlaxGPT2LMHeadModel(cfg, input_shape=(1, 16), seed=0)
    ids = jax.random.randint(jax.random.key(0), (2, 16), 0, 61)

    def loss(params, ids):
        logits = model(ids, params=params).logits
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()
    counts, recs = _replaced(loss, model.params, ids)
    # 2 blocks x (ln_1, ln_2) + ln_f, each of a residual sum (the first: token +
    # position embeddings): add_layer_norm; attention with HF's causal mask; log_softmax
    assert counts["add_layer_norm"] == 5 and counts["attention"] == 2, recs
    assert all(r.params.get("is_causal") for r in recs if r.pattern == "attention")
    fast = jax_ops.optimize(loss, policy="always")
    assert _rel(jax.jit(fast)(model.params, ids), loss(model.params, ids)) < 1e-5
    _tree_close(jax.jit(jax.grad(fast))(model.params, ids), jax.grad(loss)(model.params, ids), 1e-4)


@pytest.mark.parametrize("loss_form", ["optax_upcast", "take_mean"])
def test_hf_gpt2_lm_head_becomes_linear_cross_entropy(loss_form):
    """GPT-2's tied LM head (the wte embedding transposed into lm_head's dot_general)
    and the shifted mean loss, as users write it: one linear_cross_entropy (transposed_w:
    the embedding itself, no transposed copy), loss and gradients equal to the original's
    (float32, highest precision)."""
    import optax
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=61)
    model = transformers.FlaxGPT2LMHeadModel(cfg, input_shape=(1, 16), seed=0)
    ids = jax.random.randint(jax.random.key(0), (2, 16), 0, 61)

    def lm_loss(logits, ids):
        if loss_form == "optax_upcast":  # benchmarks/model_step.py's
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1].astype(jnp.float32), ids[:, 1:]).mean()
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()

    def loss(params, ids):
        return lm_loss(model(ids, params=params).logits, ids)
    counts, recs = _replaced(loss, model.params, ids)
    assert counts["linear_cross_entropy"] == 1 and counts["cross_entropy"] == 0, recs
    (r,) = [r for r in recs if r.pattern == "linear_cross_entropy"]
    assert r.params == {"shift": True, "mean": True, "transposed_w": True}, r
    fast = jax_ops.optimize(loss, policy="always")
    names = {n.name for _, n in fx.trace(jax.grad(fast), model.params, ids).walk()}
    assert "jax_ops_ce_fwd" in names, names
    l1, g1 = jax.jit(jax.value_and_grad(fast))(model.params, ids)
    l2, g2 = jax.value_and_grad(loss)(model.params, ids)
    assert _rel(l1, l2) < 1e-6
    _tree_close(g1, g2, 1e-5)
    # the same head with a model that also returns its logits: kept, and why
    def loss_and_logits(params, ids):
        logits = model(ids, params=params).logits
        return lm_loss(logits, ids), logits
    _, recs = _replaced(loss_and_logits, model.params, ids)
    kept = [r for r in recs if r.pattern == "linear_cross_entropy"]
    assert kept and not kept[0].replaced and "used elsewhere" in kept[0].reason, recs


def test_hf_bert_encoder():
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=32)
    model = transformers.FlaxBertModel(cfg, input_shape=(1, 12), seed=0)
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, 50)
    padded = jnp.array([[1] * 12, [1] * 8 + [0] * 4])

    def encode(params, ids):  # no attention_mask: HF's all-ones mask, a constant
        return model(ids, params=params).last_hidden_state

    def encode_padded(params, ids, padded):  # a padding mask from an input: attention kept
        return model(ids, attention_mask=padded, params=params).last_hidden_state

    counts, recs = _replaced(encode, model.params, ids)
    # embeddings + 2x2 post-norm LayerNorms, each of a sum: add_layer_norm
    assert counts["add_layer_norm"] == 5 and counts["attention"] == 2, recs
    assert not any(r.params.get("is_causal") for r in recs if r.pattern == "attention")
    fast = jax_ops.optimize(encode, policy="always")
    assert _rel(jax.jit(fast)(model.params, ids), encode(model.params, ids)) < 1e-5

    counts, recs = _replaced(encode_padded, model.params, ids, padded)
    assert counts["attention"] == 0 and counts["add_layer_norm"] == 5, recs
    kept = [r for r in recs if r.pattern == "attention"]
    assert kept and all("computed from inputs" in r.reason for r in kept), kept
    fast = jax_ops.optimize(encode_padded, policy="always")
    assert _rel(jax.jit(fast)(model.params, ids, padded), encode_padded(model.params, ids, padded)) < 1e-5


def test_hf_resnet_training_and_inference():
    cfg = transformers.ResNetConfig(depths=[1, 1], hidden_sizes=[16, 32], embedding_size=8,
                                    layer_type="bottleneck", num_labels=5)
    model = transformers.FlaxResNetForImageClassification(cfg, input_shape=(1, 16, 16, 3), seed=0)
    x = jax.random.normal(jax.random.key(2), (2, 3, 16, 16))
    params, stats = model.params["params"], model.params["batch_stats"]

    def train(params, stats, x):
        out, new = model(x, params={"params": params, "batch_stats": stats}, train=True)
        return jnp.sum(out.logits ** 2), new["batch_stats"]

    def infer(params, stats, x):
        return model(x, params={"params": params, "batch_stats": stats}, train=False).logits

    counts, recs = _replaced(train, params, stats, x)
    assert sum(counts.values()) > 0 and counts["max_pool"] == 1, recs  # the embedder's pool
    fast = jax_ops.optimize(train, policy="always")
    (l1, s1), g1 = jax.value_and_grad(fast, has_aux=True)(params, stats, x)
    (l2, s2), g2 = jax.value_and_grad(train, has_aux=True)(params, stats, x)
    assert _rel(l1, l2) < 1e-5
    _tree_close(s1, s2, 1e-5)
    _tree_close(g1, g2, 1e-4)
    counts, recs = _replaced(infer, params, stats, x)
    assert sum(counts.values()) > 0, recs
    fast = jax_ops.optimize(infer, policy="always")
    assert _rel(jax.jit(fast)(params, stats, x), infer(params, stats, x)) < 1e-5


def test_haiku_resnet_and_mlp():
    hk = pytest.importorskip("haiku")

    def net(x, is_training):
        return hk.nets.ResNet18(10, resnet_v2=False)(x, is_training=is_training)
    model = hk.transform_with_state(net)
    x = jax.random.normal(jax.random.key(3), (2, 64, 64, 3))
    params, state = model.init(jax.random.key(0), x, True)

    def train(params, state, x):
        y, new = model.apply(params, state, None, x, True)
        return jnp.sum((y - 1.0) ** 2), new  # haiku zero-initializes the logits layer

    counts, recs = _replaced(train, params, state, x)
    assert counts["add_relu"] >= 8, recs  # the blocks' relu(bn(conv) + shortcut)
    assert counts["max_pool"] == 1, recs  # the stem's hk.max_pool
    assert counts["conv_space_to_depth"] == 1, recs  # the stem's 7x7 stride-2 conv (3 channels)
    assert counts["pointwise_conv"] == 3, recs  # the 1x1 shortcut convs of groups 2-4
    fast = jax_ops.optimize(train, policy="always")
    (l1, s1), g1 = jax.value_and_grad(fast, has_aux=True)(params, state, x)
    (l2, s2), g2 = jax.value_and_grad(train, has_aux=True)(params, state, x)
    # Both float32 runs against a float64 run of the original: the rewritten one within
    # a few times the original's own error (~1.4e-6 here). 64x64 pixels, not 16x16: there
    # the last groups normalize 1x1 maps over a batch of 2, and any float32 rounding (the
    # stem conv's other summation order: 2.5e-7) grew to ~1e-1 in their statistics.
    with jax.enable_x64(True):
        (_, s64), g64 = jax.value_and_grad(train, has_aux=True)(
            _as_float64(params), _as_float64(state), np.asarray(x, np.float64))
    for fast_out, orig_out, ref in ((s1, s2, s64), (g1, g2, g64)):
        assert _tree_rel(fast_out, ref) <= 4 * _tree_rel(orig_out, ref) + 1e-6
    assert _rel(l1, l2) < 1e-5

    def mlp(x):
        return hk.Sequential([hk.Linear(16), jax.nn.relu, hk.Linear(4),
                              lambda h: jax.nn.log_softmax(h)])(x)
    m = hk.without_apply_rng(hk.transform(mlp))
    xs = jax.random.normal(jax.random.key(4), (3, 8))
    p = m.init(jax.random.key(0), xs)
    counts, recs = _replaced(m.apply, p, xs)
    assert counts["log_softmax"] == 1 and counts["add_relu"] + counts["relu"] == 1, recs
    fast = jax_ops.optimize(m.apply, policy="always")
    assert _rel(fast(p, xs), m.apply(p, xs)) < 1e-6


@pytest.mark.parametrize("fast_variance", [False, True])
def test_haiku_norms(fast_variance):
    """haiku's LayerNorm (plain and use_fast_variance, with and without its parameters)
    and RMSNorm become our ops, a residual add before one becomes add_layer_norm; over
    another axis, or with its mean used again, they stay."""
    hk = pytest.importorskip("haiku")

    def block(x):
        h = hk.Linear(32)(hk.LayerNorm(-1, True, True, eps=1e-3, use_fast_variance=fast_variance)(x))
        h = x + h  # pre-norm residual, then the next norm: add_layer_norm
        y = hk.LayerNorm(-1, False, False, use_fast_variance=fast_variance)(h)
        return hk.RMSNorm(-1, eps=1e-5)(hk.Linear(32)(y)) + h

    m = hk.without_apply_rng(hk.transform(block))
    x = jax.random.normal(jax.random.key(5), (4, 6, 32)) * 2 + 1
    p = m.init(jax.random.key(0), x)
    p = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(6), a.shape), p)

    def loss(p, x):
        return jnp.sum(m.apply(p, x) ** 2)
    counts, recs = _replaced(loss, p, x)
    assert counts == {"layer_norm": 1, "add_layer_norm": 1, "rms_norm": 1}, recs
    fast = jax_ops.optimize(loss, policy="always")
    l1, g1 = jax.value_and_grad(fast, argnums=(0, 1))(p, x)
    l2, g2 = jax.value_and_grad(loss, argnums=(0, 1))(p, x)
    assert _rel(l1, l2) < 1e-5
    _tree_close(g1, g2, 1e-4)

    # near misses: normalized over the rows' axis; over two axes
    for axis, param_axis in ((-2, -2), ((-2, -1), -1)):
        def other(x):
            return hk.LayerNorm(axis, True, True, param_axis=param_axis,
                                use_fast_variance=fast_variance)(x)
        mo = hk.without_apply_rng(hk.transform(other))
        po = mo.init(jax.random.key(0), x)
        counts, recs = _replaced(mo.apply, po, x)
        assert not counts, (axis, recs)
