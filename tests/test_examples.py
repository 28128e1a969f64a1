"""The examples (examples/transformer_block.py, examples/resnet_block.py) train, and the
models built from our layers match the ones built from flax's: the same variable trees
(a flax initialization loads unchanged), the same losses step by step, the same final
parameters, batch_stats and eval outputs. Toy sizes: CPU CI runs this in well under a
minute (each `train` call compiles its own step; the runs are cached across tests)."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_ops.core.calls import op_names

# examples/ is not a package; append (not prepend) so the installed jax_ops stays first
sys.path.append(str(Path(__file__).resolve().parents[1] / "examples"))
import resnet_block as rb  # noqa: E402
import transformer_block as tb  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
STEPS = 6
TF = dict(vocab=32, d_model=32, heads=2, seq=16, batch=4)
RN = dict(batch=8, size=6, channels=8, num_classes=5)
RN_SHAPE = (RN["batch"], RN["size"], RN["size"], RN["channels"])

@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    # On GPUs float32 matmuls/convolutions default to TF32, whose ~1e-3 rounding would
    # swamp the float32 comparisons with flax; bfloat16 ones are unaffected.
    with jax.default_matmul_precision("highest"):
        yield



def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ over all leaves of two trees together."""
    flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float64))  # noqa: E731
                                     for x in jax.tree.leaves(t)])
    a, b = flat(a), flat(b)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_same_layout(a, b):
    """Variable trees with the same structure, shapes and dtypes."""
    spec = lambda t: jax.tree.map(lambda v: (v.shape, jnp.dtype(v.dtype)), t)  # noqa: E731
    assert spec(a) == spec(b)


def assert_leaves_close(ours, theirs, rtol, skip=()):
    """Each leaf within `rtol` (relative norm), except paths containing all of a `skip` tuple."""
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs)):
        name = jax.tree_util.keystr(path)
        if any(all(s in name for s in parts) for parts in skip):
            continue
        assert rel_err(a, b) <= rtol, f"{name}: relative error {rel_err(a, b):.2e} > {rtol:.0e}"


def ops_used(fn, *args) -> set[str]:
    """The jax_ops ops in fn's jaxpr."""
    return op_names(fn, *args)


# In exact arithmetic the attention key bias has a zero gradient (softmax is invariant to
# the q·b_k shift it adds to a whole row of logits): both models get rounding noise
# there, which adam scales to ±lr steps. It is not compared.
KEY_BIAS = (("attn", "key", "bias"),)


# --- Transformer block -------------------------------------------------------------------

TF_MODEL = {k: TF[k] for k in ("vocab", "d_model", "heads")}


@functools.cache
def transformer_init(norm: str):
    """Parameters initialized by the flax model (the checkpoint both models start from)."""
    return tb.init_params(tb.make_model(False, norm=norm, **TF_MODEL), jax.random.key(0),
                          TF["seq"])


@functools.cache
def transformer_run(ours: bool, norm: str, dtype):
    return tb.train(ours, STEPS, norm=norm, dtype=dtype, params=transformer_init(norm), **TF)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_transformer_variables_and_kernels(norm):
    """Our model's variables are flax's; it runs our kernels, flax's model none."""
    flax_model = tb.make_model(False, norm=norm, **TF_MODEL)
    our_model = tb.make_model(True, norm=norm, **TF_MODEL)
    params = transformer_init(norm)
    assert_same_layout(params, jax.eval_shape(
        lambda key: tb.init_params(our_model, key, TF["seq"]), jax.random.key(0)))
    tokens = tb.synthetic_tokens(jax.random.key(1), TF["batch"], TF["seq"], TF["vocab"])[:, :-1]
    apply = lambda model: lambda p, t: model.apply({"params": p}, t)  # noqa: E731
    assert ops_used(apply(our_model), params, tokens) == {f"{norm}_norm", "softmax"}
    assert ops_used(apply(flax_model), params, tokens) == set()


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_transformer_trains_like_flax_float32(norm):
    flax_losses, flax_params = transformer_run(False, norm, F32)
    our_losses, our_params = transformer_run(True, norm, F32)
    assert np.all(np.diff(our_losses) < 0) and our_losses[-1] < 0.8 * our_losses[0], our_losses
    np.testing.assert_allclose(our_losses, flax_losses, rtol=1e-4)
    assert_leaves_close(our_params, flax_params, rtol=1e-4, skip=KEY_BIAS)


def test_transformer_trains_like_flax_bfloat16():
    """bfloat16 activations: flax's and our rounding differ, and adam turns small gradient
    differences into ±lr steps, so the parameters are compared by their distance to the
    float32 run (ours no farther from it than flax's), the losses step by step."""
    ref_losses, ref_params = transformer_run(False, "rms", F32)
    flax_losses, flax_params = transformer_run(False, "rms", BF16)
    our_losses, our_params = transformer_run(True, "rms", BF16)
    assert our_losses[-1] < 0.8 * our_losses[0], our_losses
    np.testing.assert_allclose(our_losses, flax_losses, rtol=5e-3)
    ours_err, flax_err = rel_err(our_params, ref_params), rel_err(flax_params, ref_params)
    assert ours_err <= 1.5 * flax_err, (ours_err, flax_err)


# --- ResNet block -------------------------------------------------------------------------

@functools.cache
def resnet_init():
    model = rb.make_model(False, num_classes=RN["num_classes"])
    return rb.init_variables(model, jax.random.key(0), RN_SHAPE)


@functools.cache
def resnet_run(ours: bool, dtype):
    return rb.train(ours, STEPS, dtype=dtype, variables=resnet_init(), **RN)


def eval_batch(dtype):
    return rb.synthetic_batch(jax.random.key(2), RN_SHAPE, RN["num_classes"], dtype)[0]


def test_resnet_variables_and_kernels():
    flax_model = rb.make_model(False, num_classes=RN["num_classes"])
    our_model = rb.make_model(True, num_classes=RN["num_classes"])
    variables = resnet_init()
    assert set(variables["params"]["block"]) == {"Conv_0", "Conv_1", "BatchNorm_0", "BatchNorm_1"}
    assert_same_layout(variables, jax.eval_shape(
        lambda key: rb.init_variables(our_model, key, RN_SHAPE), jax.random.key(0)))
    x = eval_batch(F32)
    for train in (True, False):
        apply = lambda model: lambda v, x: model.apply(v, x, train=train,  # noqa: E731
                                                       mutable=["batch_stats"])
        assert ops_used(apply(our_model), variables, x) == {"batch_norm_relu",
                                                            "batch_norm_add_relu"}
        assert ops_used(apply(flax_model), variables, x) == set()


def test_resnet_trains_like_flax_float32():
    flax_losses, flax_vars, flax_eval = resnet_run(False, F32)
    our_losses, our_vars, our_eval = resnet_run(True, F32)
    assert np.all(np.diff(our_losses) < 0) and our_losses[-1] < 0.8 * our_losses[0], our_losses
    np.testing.assert_allclose(our_losses, flax_losses, rtol=1e-4)
    assert_leaves_close(our_vars, flax_vars, rtol=1e-4)   # params and batch_stats
    assert rel_err(our_eval, flax_eval) <= 1e-4


def test_resnet_eval_matches_flax():
    """Inference with the running averages, the same (flax-trained) variables through both
    models: the same logits in float32; in bfloat16 ours as close to them as flax's."""
    variables, x = resnet_run(False, F32)[1], eval_batch(F32)

    def logits(ours, dtype):
        model = rb.make_model(ours, num_classes=RN["num_classes"], dtype=dtype)
        return rb.make_eval_step(model)(variables, x.astype(dtype))
    reference = logits(False, F32)
    assert rel_err(logits(True, F32), reference) <= 1e-5
    ours_err = rel_err(logits(True, BF16), reference)
    flax_err = rel_err(logits(False, BF16), reference)
    assert ours_err <= 1.5 * flax_err, (ours_err, flax_err)


def test_resnet_trains_like_flax_bfloat16():
    """As for the Transformer: losses step by step, parameters and batch_stats by their
    distance to the float32 run."""
    ref_losses, ref_vars, _ = resnet_run(False, F32)
    flax_losses, flax_vars, _ = resnet_run(False, BF16)
    our_losses, our_vars, _ = resnet_run(True, BF16)
    assert our_losses[-1] < 0.8 * our_losses[0], our_losses
    np.testing.assert_allclose(our_losses, flax_losses, rtol=5e-3)
    for collection in ("params", "batch_stats"):
        ours_err = rel_err(our_vars[collection], ref_vars[collection])
        flax_err = rel_err(flax_vars[collection], ref_vars[collection])
        assert ours_err <= 1.5 * flax_err, (collection, ours_err, flax_err)


# --- NNX ----------------------------------------------------------------------------------

def test_nnx_resnet_trains_like_flax():
    """The NNX model from jax_ops.nnx layers loads the flax.nnx model's state unchanged,
    trains to the same losses and state (nnx.Optimizer, nnx.jit), evaluates the same."""
    x, labels = rb.synthetic_batch(jax.random.key(1), RN_SHAPE, RN["num_classes"])
    def make(ours):
        return rb.NNXResNetBlock(RN["channels"], RN["num_classes"], ours=ours, rngs=nnx.Rngs(0))
    flax_model = make(False)
    flax_state = nnx.state(flax_model)
    our_graph, our_abstract_state = nnx.split(nnx.eval_shape(lambda: make(True)))
    assert_same_layout(our_abstract_state, flax_state)
    our_model = nnx.merge(our_graph, jax.tree.map(jnp.copy, flax_state))  # flax's state as it is
    assert ops_used(lambda s, x: nnx.merge(our_graph, s)(x), flax_state, x) == {
        "batch_norm_relu", "batch_norm_add_relu"}
    models = [flax_model, our_model]

    losses = []
    for model in models:
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
        losses.append([float(rb.nnx_train_step(model, optimizer, x, labels)) for _ in range(STEPS)])
    flax_losses, our_losses = losses
    assert our_losses[-1] < 0.8 * our_losses[0], our_losses
    np.testing.assert_allclose(our_losses, flax_losses, rtol=1e-4)
    assert_leaves_close(nnx.state(models[1]), nnx.state(models[0]), rtol=1e-4)

    for model in models:
        model.eval()
    flax_logits, our_logits = (nnx.jit(lambda m, x: m(x))(m, x) for m in models)
    assert rel_err(our_logits, flax_logits) <= 1e-5
