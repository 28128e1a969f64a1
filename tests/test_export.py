"""jax_ops.export: jitted functions using our ops with a symbolic batch dimension
serialize, deserialize and run for several batch sizes, equal to the unexported call."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_ops
from support import need

pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")

B = export.symbolic_shape("b")[0]

# name -> (op for need(), fn(impl) -> f(*args), argument shapes with B symbolic)
CASES = {
    "layer_norm": ("layer_norm", lambda i: lambda x, s, b: jax_ops.layer_norm(x, s, b, implementation=i),
                   [(B, 4, 256), (256,), (256,)]),
    "rms_norm": ("rms_norm", lambda i: lambda x, s: jax_ops.rms_norm(x, s, implementation=i),
                 [(B, 256), (256,)]),
    "softmax": ("softmax", lambda i: lambda x: jax_ops.softmax(x, causal=True, implementation=i),
                [(B, 16, 16)]),
    "log_softmax": ("log_softmax", lambda i: lambda x: jnp.maximum(
        jax_ops.log_softmax(x, implementation=i), -1e4), [(B, 64)]),
    "add_relu": ("add_relu", lambda i: lambda x, z: jax_ops.add_relu(x, z, implementation=i),
                 [(B, 256), (B, 256)]),
    "relu_flat_mask": ("relu", lambda i: lambda x: jax_ops.relu(x, implementation=i), [(B, 7)]),
    "batch_norm_add_relu": ("batch_norm_add_relu", lambda i: lambda x, z, s: jax_ops.batch_norm_add_relu(
        x, z, s, s, implementation=i), [(B, 4, 64), (B, 4, 64), (64,)]),
}


def assert_close(u, v):
    """‖u − v‖ / ‖v‖ ≤ 2e-6: exact on CPU; on a GPU the symbolic-shape export may run
    another kernel or grid than the static-shape call, so sums (dscale over the rows)
    differ in their last bits."""
    u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
    assert u.shape == v.shape
    assert np.linalg.norm(u - v) <= 2e-6 * max(np.linalg.norm(v), 1e-30), (u, v)


def _loss(f):
    def loss(*a):
        return sum(jnp.sum(jnp.cos(o.astype(jnp.float32))) for o in jax.tree.leaves(f(*a)))
    return loss


@pytest.mark.parametrize("impl", [None, "cuda"], ids=["auto", "cuda"])
@pytest.mark.parametrize("name", list(CASES))
def test_export_symbolic_batch(name, impl):
    op, make, shapes = CASES[name]
    need(op, impl)
    f = make(impl)
    g = jax.value_and_grad(_loss(f), argnums=tuple(range(len(shapes))))
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    exp = jax_ops.export(g, *specs)
    if impl == "cuda":  # our custom calls are in the artifact
        assert "jax_ops_" in exp.mlir_module()
    back = export.deserialize(exp.serialize())
    for n in (1, 3, 8):
        args = [jax.random.normal(jax.random.key(i), tuple(n if d is B else d for d in s))
                for i, s in enumerate(shapes)]
        got, want = back.call(*args), jax.jit(g)(*args)
        for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_close(u, v)
        fwd = export.deserialize(jax_ops.export(f, *specs).serialize()).call(*args)
        for u, v in zip(jax.tree.leaves(fwd), jax.tree.leaves(jax.jit(f)(*args))):
            assert_close(u, v)


def test_export_pallas_needs_static_shapes():
    need("layer_norm", "pallas")
    spec = jax.ShapeDtypeStruct((B, 128), jnp.float32)
    with pytest.raises(ValueError, match="pallas needs static shapes"):
        jax_ops.export(lambda x: jax_ops.layer_norm(x, implementation="pallas"), spec)
    # the automatic choice skips it; with static shapes it may still be taken
    jax_ops.export(lambda x: jax_ops.layer_norm(x), spec)
    jax_ops.export(lambda x: jax_ops.layer_norm(x, implementation="pallas"),
                   jax.ShapeDtypeStruct((8, 128), jnp.float32))


def test_export_without_helper_names_targets():
    """Plain jax.export refuses our custom calls; the helper lists what to allow."""
    need("layer_norm", "cuda")
    assert "jax_ops_norm_fwd" in jax_ops.custom_call_targets()
    spec = jax.ShapeDtypeStruct((B, 128), jnp.float32)
    f = jax.jit(lambda x: jax_ops.layer_norm(x, implementation="cuda"))
    with pytest.raises(ValueError, match="custom calls whose targets"):
        export.export(f)(spec)
    export.export(f, disabled_checks=jax_ops.disabled_checks())(spec)
