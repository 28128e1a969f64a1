"""Multi-device tests on 8 host devices (tests/conftest.py): every op under jit with
NamedSharding (batch and hidden axes sharded) equals the unsharded computation, forward
and gradients, and the compiled HLO holds only the expected collectives (no all-gather
or all-to-all of activations; all-reduces of O(rows) or O(cols) data). Also shard_map
(per-device semantics)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ops
from jax_ops.ops.relu import FWD as RELU_FWD
from support import collectives
from support import need as _need

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")

MESHES = {"8": ((8,), ("a",)), "4x2": ((4, 2), ("a", "b")), "2x4": ((2, 4), ("a", "b"))}


def mesh_of(name):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, devices=jax.devices()[:math.prod(shape)])


def need(op, impl):
    _need(op, impl)


def case_mesh(op, impl, mesh_name, pallas_here=None):
    """The mesh of a parametrized case; skips what this build lacks, and interpreted
    Pallas (slow on CPU) except where pallas_here (default: on the 4x2 mesh)."""
    need(op, impl)
    if impl == "pallas" and not (mesh_name == "4x2" if pallas_here is None else pallas_here):
        pytest.skip("pallas (interpreted on CPU): one mesh")
    return mesh_of(mesh_name)


# ------------------------------------------------------------ HLO checks ---

def check_hlo(colls, *, small: int, want_reduce: int | None = None):
    """No all-gather/all-to-all/collective-permute/reduce-scatter of more than `small`
    elements (a per-row or per-column vector); every all-reduce moves at most `small`
    elements per array; want_reduce: some all-reduce has an array of that many elements."""
    for kind, sizes in colls:
        assert all(n <= small for n in sizes), (
            f"{kind} of {sizes} elements (limit {small}): {colls}")
    if want_reduce is not None:
        assert any(kind == "all-reduce" and want_reduce in sizes for kind, sizes in colls), (
            f"expected an all-reduce of {want_reduce} elements: {colls}")


def _axes(entry):
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def close(got, want, rel=2e-6):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    err = float(np.max(np.abs(got - want))) if want.size else 0.0
    assert err <= rel * scale, f"max abs error {err} > {rel} * {scale}"


def run_both(fn, args, shardings, argnums):
    """(value, grads) of sum(fn(*args) · cotangent) unsharded and with `args` placed by
    `shardings`; also returns the sharded args."""
    def loss(*a):
        outs = fn(*a)
        outs = outs if isinstance(outs, tuple) else (outs,)
        total = 0.0
        for i, o in enumerate(outs):
            ct = jnp.cos(jnp.arange(o.size, dtype=jnp.float32) * (0.37 + i)).reshape(o.shape)
            total = total + jnp.sum(o.astype(jnp.float32) * ct)
        return total
    vg = jax.value_and_grad(loss, argnums=argnums)
    ref = jax.jit(vg)(*args)
    placed = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    got = jax.jit(vg)(*placed)
    close(got[0], ref[0], rel=1e-5)
    for g, r in zip(got[1], ref[1]):
        close(g, r)
    fwd_ref = jax.jit(fn)(*args)
    fwd_got = jax.jit(fn)(*placed)
    for g, r in zip(jax.tree.leaves(fwd_got), jax.tree.leaves(fwd_ref)):
        close(g, r)
    return loss, vg, placed


def rnd(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


# ------------------------------------------------------------------ norms ---
# (mesh, spec of x (B, S, H), what is sharded)
NORM_CASES = [
    ("8", P("a"), "batch"),
    ("4x2", P("a", "b"), "batch"),
    ("2x4", P(None, None, "b"), "hidden"),
    ("4x2", P("a", None, "b"), "both"),
    ("8", P(None, None, "a"), "hidden"),
]


@pytest.mark.parametrize("impl", ["xla", "cuda", "pallas"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("mesh_name,spec,what", NORM_CASES, ids=lambda v: str(v))
def test_norms(mesh_name, spec, what, op, impl):
    mesh = case_mesh(op, impl, mesh_name)
    B, S, H = 16, 4, 64
    x, scale, bias = rnd((B, S, H), 0), 1 + 0.1 * rnd((H,), 1), 0.1 * rnd((H,), 2)
    if op == "layer_norm":
        fn = lambda x, s, b: jax_ops.layer_norm(x, s, b, implementation=impl)  # noqa: E731
        args, argnums = (x, scale, bias), (0, 1, 2)
    else:
        fn = lambda x, s: jax_ops.rms_norm(x, s, implementation=impl)  # noqa: E731
        args, argnums = (x, scale), (0, 1)
    rep = NamedSharding(mesh, P())
    sh = [NamedSharding(mesh, spec)] + [rep] * (len(args) - 1)
    loss, vg, placed = run_both(fn, args, sh, argnums)
    colls = collectives(vg, *placed)
    # per-row statistics are at most B*S (the kernels' stages gather 2 a row from each
    # column device), per-column sums H
    d_cols = math.prod(mesh.shape[a] for a in _axes(spec[2])) if len(spec) > 2 else 1
    h_local = H // d_cols
    rows_local = B * S // math.prod(mesh.shape[a] for d in spec[:2] for a in _axes(d))
    check_hlo(colls, small=max(B * S, H, 2 * d_cols * rows_local),
              want_reduce=h_local if what != "hidden" else None)
    if what != "batch":  # partial statistics combined per row (all rows of a column shard)
        if impl == "xla":  # jnp: psums
            assert any(k == "all-reduce" and rows_local in s for k, s in colls), colls
        else:  # the stages (pallas has none: dispatch picks them automatically): one gather
            n = (1 if op == "rms_norm" else 2) * d_cols * rows_local
            assert any(k == "all-gather" and n in s for k, s in colls), colls


# ---------------------------------------------------------------- softmax ---
SOFTMAX_CASES = [
    ("8", P("a"), False),
    ("4x2", P("a", "b"), False),
    ("4x2", P("a", None, None, "b"), False),   # softmax axis sharded
    ("2x4", P(None, "a", None, "b"), False),
    ("4x2", P(None, None, "a", "b"), True),    # causal: query and key axes sharded
]


@pytest.mark.parametrize("impl", ["xla", "cuda", "pallas"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("mesh_name,spec,causal", SOFTMAX_CASES, ids=lambda v: str(v))
def test_softmax(mesh_name, spec, causal, op, impl):
    mesh = case_mesh(op, impl, mesh_name)
    x = rnd((8, 4, 16, 32), 3)
    keep = jax.random.bernoulli(jax.random.key(4), 0.8, (8, 1, 1, 32))
    f = getattr(jax_ops, op)

    def fn(x, keep):
        y = f(x, mask=keep, causal=causal, scale=0.5, implementation=impl)
        return jnp.where(jnp.isfinite(y), y, 0.0)
    sh = [NamedSharding(mesh, spec), NamedSharding(mesh, P())]
    loss, vg, placed = run_both(fn, (x, keep), sh, (0,))
    rows = 8 * 4 * 16
    # kernels: (max, sum) of each row gathered from every key-axis device
    d_keys = math.prod(mesh.shape[a] for a in _axes(spec[3])) if len(spec) > 3 else 1
    rows_local = rows // math.prod(mesh.shape[a] for d in spec[:3] for a in _axes(d))
    check_hlo(collectives(vg, *placed), small=max(rows, 2 * d_keys * rows_local))


# ---------------------------------------------------------- relu family ---
RELU_CASES = [
    ("8", P("a")),
    ("4x2", P("a", None, "b")),     # last axis: 128 / 2 = 64 columns, two words a row
    ("2x4", P(None, "a", "b")),
    ("8", P(None, None, "a")),      # 256 / 8 = 32 columns: one word a row
]


@pytest.mark.parametrize("impl", ["xla", "cuda", "pallas"])
@pytest.mark.parametrize("op", ["relu", "add_relu"])
@pytest.mark.parametrize("mesh_name,spec", RELU_CASES, ids=lambda v: str(v))
def test_relu(mesh_name, spec, op, impl):
    mesh = case_mesh(op, impl, mesh_name)
    x, z = rnd((8, 4, 256), 5), rnd((8, 4, 256), 6)
    sh = NamedSharding(mesh, spec)
    if op == "relu":
        loss, vg, placed = run_both(lambda x: jax_ops.relu(x, implementation=impl), (x,), [sh], (0,))
    else:
        loss, vg, placed = run_both(lambda x, z: jax_ops.add_relu(x, z, implementation=impl),
                                    (x, z), [sh, sh], (0, 1))
    check_hlo(collectives(vg, *placed), small=1)  # nothing but the loss's scalar


def test_relu_mask_follows_x():
    """The mask residual has x's axes (last in words), so it is sharded like x."""
    mesh = mesh_of("4x2")
    x = jax.device_put(rnd((8, 4, 128), 7), NamedSharding(mesh, P("a", None, "b")))
    _, mask = jax.jit(lambda x: RELU_FWD.call(x, None, implementation="cuda"))(x)
    assert mask.shape == (8, 4, 4) and mask.dtype == jnp.uint32
    assert mask.sharding.spec[0] == "a" and mask.sharding.spec[2] == "b"


# -------------------------------------------------------------- BatchNorm ---
BN_CASES = [
    ("8", P("a")),                 # batch sharded: global statistics
    ("4x2", P("a", "b")),          # N and H sharded
    ("2x4", P("a", None, None, "b")),  # batch and channels
    ("8", P(None, None, None, "a")),   # channels only: statistics local
]


@pytest.mark.parametrize("impl", ["xla", "cuda", "pallas"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("op", ["batch_norm_relu", "batch_norm_add_relu"])
@pytest.mark.parametrize("mesh_name,spec", BN_CASES, ids=lambda v: str(v))
def test_batch_norm(mesh_name, spec, op, training, impl):
    mesh = case_mesh(op, impl, mesh_name,
                     pallas_here=mesh_name == "2x4" and training and op == "batch_norm_add_relu")
    C = 256
    x, z = rnd((8, 4, 4, C), 8), rnd((8, 4, 4, C), 9)
    scale, bias = 1 + 0.1 * rnd((C,), 10), 0.1 * rnd((C,), 11)
    mean, var = 0.1 * rnd((C,), 12), 1 + 0.1 * jnp.abs(rnd((C,), 13))
    f = getattr(jax_ops, op)
    kw = {} if training else {"mean": mean, "var": var}
    if op == "batch_norm_relu":
        fn = lambda x, s, b: f(x, s, b, training=training, implementation=impl, **kw)  # noqa: E731
        args = (x, scale, bias)
    else:
        fn = lambda x, s, b, z: f(x, z, s, b, training=training, implementation=impl, **kw)  # noqa: E731
        args = (x, scale, bias, z)
    xs = NamedSharding(mesh, spec)
    rep = NamedSharding(mesh, P())
    sh = [xs, rep, rep] + ([xs] if len(args) == 4 else [])
    loss, vg, placed = run_both(fn, args, sh, tuple(range(len(args))))
    batch_sharded = bool(spec[0]) or (len(spec) > 1 and bool(spec[1]))
    # per-channel statistics / sums (local channels when those are sharded too)
    c_local = C // math.prod(mesh.shape[a] for a in (_axes(spec[3]) if len(spec) > 3 else ()))
    # training, batch sharded: each row device's (mean, M2) per channel gathered
    d_rows = math.prod(mesh.shape[a] for d in spec[:3] for a in _axes(d))
    colls = collectives(vg, *placed)
    check_hlo(colls, small=max(C, 2 * d_rows * c_local),
              want_reduce=c_local if batch_sharded else None)
    if batch_sharded and training:
        assert ("all-gather", [2 * d_rows * c_local]) in colls, colls


def test_batch_norm_global_statistics():
    """Batch sharded over 8 devices: the returned mean/var are the global batch's."""
    mesh = mesh_of("8")
    x = rnd((16, 2, 64), 14) * 3 + 1
    xs = jax.device_put(x, NamedSharding(mesh, P("a")))
    _, m, v = jax.jit(lambda x: jax_ops.batch_norm_relu(x, implementation="cuda"))(xs)
    xf = np.asarray(x, np.float64).reshape(-1, 64)
    np.testing.assert_allclose(m, xf.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v, xf.var(0), rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------- shard_map ---

@pytest.mark.parametrize("impl", ["xla", "cuda"])
def test_shard_map_per_device(impl):
    """Inside shard_map the ops run on each device's block (BatchNorm statistics are per
    device), and the custom calls are not wrapped again."""
    mesh = mesh_of("8")
    x = rnd((16, 4, 64), 15)
    scale = 1 + 0.1 * rnd((64,), 16)

    def body(x):
        y = jax_ops.layer_norm(x, scale, implementation=impl)
        y = jax_ops.softmax(y, implementation=impl)
        y, m, _ = jax_ops.batch_norm_relu(y, implementation=impl)
        return y, m[None]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a"), out_specs=(P("a"), P("a"))))
    xs = jax.device_put(x, NamedSharding(mesh, P("a")))  # explicit mesh axes: place first
    y, m = (np.asarray(a) for a in f(xs))
    for i in range(8):
        yi, mi = jax.jit(body)(x[2 * i:2 * i + 2])
        close(y[2 * i:2 * i + 2], yi)
        close(m[i], mi[0])
    text = jax.jit(f).lower(xs).compile().as_text()
    assert "CustomSPMDPartitioning" not in text
    grad = jax.jit(jax.grad(lambda x: jnp.sum(f(x)[0] * jnp.cos(x))))(xs)
    assert np.all(np.isfinite(np.asarray(grad)))
