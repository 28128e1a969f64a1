"""Flax layers (jax_ops.nn: linen, jax_ops.nnx: NNX) against flax's own modules: the same
variables both ways, outputs, gradients and batch_stats updates within dtype tolerance,
our kernels actually used (or flax's code where ours can't serve), cross-device
statistics under shard_map on 8 host devices."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ops
from jax_ops.core.calls import op_names
from support import need

import jax_ops.nn as jnn  # noqa: E402  (flax must import first for the error to be clear)
import jax_ops.nnx as jnnx  # noqa: E402

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
DTYPES = [F32, BF16, F16]
TOL = {jnp.dtype(F32): 2e-5, jnp.dtype(BF16): 2e-2, jnp.dtype(F16): 4e-3}
IMPLS = [None, "xla", "cuda", "pallas"]

@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    # On GPUs float32 matmuls/convolutions default to TF32, whose ~1e-3 rounding would
    # swamp the float32 comparisons with flax; bfloat16 ones are unaffected.
    with jax.default_matmul_precision("highest"):
        yield



def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_close(ours, theirs, dtype, what="", ref=None):
    """Trees equal in structure, dtypes, shapes; leaves within the tolerance of `dtype`
    or of their own dtype, whichever is looser. With `ref` (the same computation in
    float32), a leaf may instead be closer to ref than flax's own low-precision result."""
    assert jax.tree.structure(ours) == jax.tree.structure(theirs), what
    refs = jax.tree.leaves(ref) if ref is not None else [None] * len(jax.tree.leaves(ours))
    for path, a, b, r in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(ours),
                             jax.tree.leaves(theirs), refs):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, path[0], a.dtype, b.dtype)
        err, tol = rel_err(a, b), max(TOL[jnp.dtype(dtype)], TOL[a.dtype])
        if err > tol and r is not None:
            err = rel_err(a, r) if rel_err(a, r) <= rel_err(b, r) else err
        assert err <= tol, f"{what} {jax.tree_util.keystr(path[0])}: {err:.2e}"


def same_layout(a, b):
    """Variables/state with the same tree, shapes and dtypes."""
    spec = lambda t: jax.tree.map(lambda v: (v.shape, v.dtype), t)  # noqa: E731
    assert spec(a) == spec(b)


def ops_used(fn, *args) -> set[str]:
    """jax_ops ops in fn's jaxpr."""
    return op_names(fn, *args)


def randomize(variables, key):
    """Parameters away from their ones/zeros init so their gradients matter."""
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [
        (v + 0.3 * jax.random.normal(k, v.shape)).astype(v.dtype) for v, k in zip(leaves, keys)])


def data(key, shape, dtype, offset=1.5):
    return (offset + 2.0 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


# ----------------------------------------------------------------- linen norms ---

NORMS = [(nn.LayerNorm, jnn.LayerNorm, "layer_norm"), (nn.RMSNorm, jnn.RMSNorm, "rms_norm")]
# (x dtype, layer dtype, param_dtype, implementation)
NORM_CASES = ([(d, None, F32, None) for d in DTYPES]
              + [(BF16, BF16, F32, None), (F32, BF16, F32, None), (F16, F32, F32, None),
                 (BF16, None, BF16, None), (F32, None, BF16, None)]
              + [(F32, None, F32, impl) for impl in IMPLS[1:]] + [(BF16, BF16, F32, "cuda")])


@pytest.mark.parametrize("flax_cls,our_cls,op", NORMS, ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype,layer_dtype,param_dtype,impl", NORM_CASES)
def test_linen_norm_matches_flax(flax_cls, our_cls, op, dtype, layer_dtype, param_dtype, impl):
    need(op, impl)
    kx, kc, kp = jax.random.split(jax.random.key(3), 3)
    x = data(kx, (3, 5, 33), dtype)
    kw = dict(dtype=layer_dtype, param_dtype=param_dtype, epsilon=1e-5)
    theirs, ours = flax_cls(**kw), our_cls(**kw, implementation=impl)
    variables = randomize(theirs.init(jax.random.key(0), x), kp)
    same_layout(ours.init(jax.random.key(0), x), variables)

    y_theirs, y_ours = theirs.apply(variables, x), ours.apply(variables, x)
    assert y_ours.dtype == y_theirs.dtype
    out = y_theirs.dtype
    assert_close(y_ours, y_theirs, out, "y")
    assert op in ops_used(lambda v, x: ours.apply(v, x), variables, x)

    cot = jax.random.normal(kc, y_theirs.shape, jnp.float32)
    loss = lambda m: lambda v, x: (m.apply(v, x).astype(jnp.float32) * cot).sum()  # noqa: E731
    g_theirs = jax.grad(loss(theirs), (0, 1))(variables, x)
    g_ours = jax.grad(loss(ours), (0, 1))(variables, x)
    assert_close(g_ours, g_theirs, jnp.promote_types(out, dtype), "grads")


@pytest.mark.parametrize("flax_cls,our_cls,op", NORMS, ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("case", ["two_axes", "mask", "no_f32_reductions", "no_params"])
def test_linen_norm_fallback_matches_flax(flax_cls, our_cls, op, case):
    """Calls our kernels can't compute exactly run flax's code (and give flax's result)."""
    x = data(jax.random.key(1), (4, 6, 10), F32)
    kw, call = {}, {}
    if case == "two_axes":
        kw = dict(reduction_axes=(-2, -1), feature_axes=-1)
    elif case == "mask":
        call = dict(mask=jax.random.bernoulli(jax.random.key(2), 0.7, x.shape))
    elif case == "no_f32_reductions":
        kw = dict(force_float32_reductions=False)
    else:
        kw = dict(use_scale=False) if op == "rms_norm" else dict(use_scale=False, use_bias=False)
    theirs, ours = flax_cls(**kw), our_cls(**kw)
    variables = theirs.init(jax.random.key(0), x, **call)
    same_layout(ours.init(jax.random.key(0), x, **call), variables)
    assert_close(ours.apply(variables, x, **call), theirs.apply(variables, x, **call), F32)
    used = ops_used(lambda v, x: ours.apply(v, x, **call), variables, x)
    assert used == ({op} if case == "no_params" else set())


# ------------------------------------------------------------- linen batchnorm ---

class FlaxBlock(nn.Module):
    """The pattern our BatchNorm layers replace."""
    momentum: float = 0.9
    axis_name: str | None = None
    dtype: object = None

    @nn.compact
    def __call__(self, x, z, train: bool):
        kw = dict(use_running_average=not train, momentum=self.momentum, epsilon=1e-4,
                  axis_name=self.axis_name, dtype=self.dtype)
        y = nn.relu(nn.BatchNorm(**kw)(x))
        return nn.relu(nn.BatchNorm(**kw)(y) + z)


class OurBlock(FlaxBlock):
    implementation: str | None = None

    @nn.compact
    def __call__(self, x, z, train: bool):
        kw = dict(use_running_average=not train, momentum=self.momentum, epsilon=1e-4,
                  axis_name=self.axis_name, dtype=self.dtype, implementation=self.implementation)
        y = jnn.BatchNormReLU(**kw)(x)
        return jnn.BatchNormAddReLU(**kw)(y, z)


def _block_step(model, variables, x, z, cot):
    """(y, new batch_stats, grads of Σ y·cot wrt params, x, z) in training mode."""
    def loss(params, x, z):
        y, state = model.apply({"params": params, "batch_stats": variables["batch_stats"]},
                               x, z, True, mutable=["batch_stats"])
        return (y.astype(jnp.float32) * cot).sum(), (y, state["batch_stats"])
    grads, (y, stats) = jax.grad(loss, (0, 1, 2), has_aux=True)(variables["params"], x, z)
    return y, stats, grads


BN_CASES = ([(d, None, None) for d in DTYPES] + [(BF16, BF16, None)]
            + [(F32, None, impl) for impl in IMPLS[1:]] + [(BF16, BF16, "cuda")])


@pytest.mark.parametrize("dtype,layer_dtype,impl", BN_CASES)
def test_linen_batch_norm_matches_flax(dtype, layer_dtype, impl):
    need("batch_norm_relu", impl)
    kx, kz, kc, kp = jax.random.split(jax.random.key(7), 4)
    x, z = data(kx, (4, 5, 3, 33), dtype), data(kz, (4, 5, 3, 33), dtype, offset=-0.5)
    theirs, ours = FlaxBlock(dtype=layer_dtype), OurBlock(dtype=layer_dtype, implementation=impl)
    variables = theirs.init(jax.random.key(0), x, z, True)
    same_layout(ours.init(jax.random.key(0), x, z, True), variables)
    variables = {"params": randomize(variables["params"], kp),
                 "batch_stats": randomize(variables["batch_stats"], kc)}
    variables["batch_stats"] = jax.tree.map(jnp.abs, variables["batch_stats"])  # var > 0

    y_theirs = theirs.apply(variables, x, z, True, mutable=["batch_stats"])[0]
    cot = jax.random.normal(kc, y_theirs.shape, jnp.float32)
    y_t, stats_t, g_t = _block_step(theirs, variables, x, z, cot)
    y_o, stats_o, g_o = _block_step(ours, variables, x, z, cot)
    out = y_t.dtype
    assert_close(y_o, y_t, out, "train y")
    assert_close(stats_o, stats_t, F32, "batch_stats")
    assert_close(g_o, g_t, jnp.promote_types(out, dtype), "grads")
    assert {"batch_norm_relu", "batch_norm_add_relu"} <= ops_used(
        lambda v: ours.apply(v, x, z, True, mutable=["batch_stats"]), variables)

    # inference with the running averages: the same, and no update asked for
    assert_close(ours.apply(variables, x, z, False), theirs.apply(variables, x, z, False), out, "eval")
    ge_t = jax.grad(lambda v: (theirs.apply(v, x, z, False).astype(jnp.float32) * cot).sum())(variables)
    ge_o = jax.grad(lambda v: (ours.apply(v, x, z, False).astype(jnp.float32) * cot).sum())(variables)
    assert_close(ge_o["params"], ge_t["params"], jnp.promote_types(out, dtype), "eval grads")


def test_linen_batch_norm_variables_load_both_ways():
    x, z = data(jax.random.key(1), (2, 4, 4, 8), F32), data(jax.random.key(2), (2, 4, 4, 8), F32)
    from_ours = randomize(OurBlock().init(jax.random.key(0), x, z, True), jax.random.key(3))
    from_flax = randomize(FlaxBlock().init(jax.random.key(0), x, z, True), jax.random.key(4))
    assert set(from_ours["params"]) == {"BatchNorm_0", "BatchNorm_1"}
    for v in (from_ours, from_flax):
        v["batch_stats"] = jax.tree.map(jnp.abs, v["batch_stats"])
        assert_close(OurBlock().apply(v, x, z, False), FlaxBlock().apply(v, x, z, False), F32)


def test_linen_batch_norm_auto_names_share_flax_counter():
    class Mixed(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jnn.BatchNormReLU(use_running_average=True)(x)
            x = nn.BatchNorm(use_running_average=True)(x)
            x = jnn.BatchNormAddReLU(use_running_average=True)(x, x)
            return jnn.BatchNormReLU(use_running_average=True, name="head")(x)

    class InSetup(nn.Module):
        def setup(self):
            self.bn = jnn.BatchNormReLU(use_running_average=True)
            self.blocks = [jnn.BatchNormReLU(use_running_average=True) for _ in range(2)]

        def __call__(self, x):
            for m in (self.bn, *self.blocks):
                x = m(x)
            return x

    x = jnp.ones((2, 3))
    assert set(Mixed().init(jax.random.key(0), x)["params"]) == {
        "BatchNorm_0", "BatchNorm_1", "BatchNorm_2", "head"}
    assert set(InSetup().init(jax.random.key(0), x)["params"]) == {"bn", "blocks_0", "blocks_1"}


@pytest.mark.parametrize("case", ["axis", "mask", "rank1"])
def test_linen_batch_norm_fallback_matches_flax(case):
    shape = (6,) if case == "rank1" else (4, 6, 5)
    x = data(jax.random.key(1), shape, F32)
    kw = dict(use_running_average=False, axis=1) if case == "axis" else dict(use_running_average=False)
    call = dict(mask=jax.random.bernoulli(jax.random.key(2), 0.8, x.shape)) if case == "mask" else {}
    theirs, ours = nn.BatchNorm(**kw), jnn.BatchNormReLU(**kw)
    v = theirs.init(jax.random.key(0), x, **call)
    y_t, s_t = theirs.apply(v, x, mutable=["batch_stats"], **call)
    y_o, s_o = ours.apply(v, x, mutable=["batch_stats"], **call)
    assert_close(y_o, nn.relu(y_t), F32)
    assert_close(s_o, s_t, F32)
    assert not ops_used(lambda v: ours.apply(v, x, mutable=["batch_stats"], **call), v)


def test_linen_batch_norm_requires_use_running_average():
    with pytest.raises(ValueError, match="use_running_average"):
        jnn.BatchNormReLU().init(jax.random.key(0), jnp.ones((2, 3)))


def test_linen_batch_norm_add_relu_bad_residual_names_argument():
    m = jnn.BatchNormAddReLU(use_running_average=False)
    with pytest.raises(ValueError, match="z"):
        m.init(jax.random.key(0), jnp.ones((4, 3)), jnp.ones((4, 5)))


# ---------------------------------------------------------- cross-device stats ---

def host_mesh():
    """Eight host devices (tests/conftest.py), also on a one-GPU machine."""
    return jax.make_mesh((8,), ("batch",), devices=jax.devices("cpu")[:8])


@pytest.mark.parametrize("impl", [None, "cuda"])
def test_linen_batch_norm_axis_name_under_shard_map(impl):
    need("batch_norm_relu", impl)
    mesh = host_mesh()
    x = data(jax.random.key(1), (16, 3, 4, 12), F32)
    z = data(jax.random.key(2), (16, 3, 4, 12), F32, offset=0.0)
    cot = jax.random.normal(jax.random.key(3), x.shape, jnp.float32)
    theirs, ours = FlaxBlock(axis_name="batch"), OurBlock(axis_name="batch", implementation=impl)
    variables = randomize(FlaxBlock().init(jax.random.key(0), x, z, True), jax.random.key(4))
    variables["batch_stats"] = jax.tree.map(jnp.abs, variables["batch_stats"])

    def run(model):
        def per_device(params, x, z, cot):
            def loss(params, x):
                y, s = model.apply({"params": params, "batch_stats": variables["batch_stats"]},
                                   x, z, True, mutable=["batch_stats"])
                return (y * cot).sum(), (y, s["batch_stats"])
            (gp, gx), (y, stats) = jax.grad(loss, (0, 1), has_aux=True)(params, x)
            return y, stats, gp, gx   # gp: replicated params' gradient, summed by jax
        specs = (P(), P("batch"), P("batch"), P("batch"))
        args = [jax.device_put(a, NamedSharding(mesh, s))
                for a, s in zip((variables["params"], x, z, cot), specs)]
        return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=specs,
                                     out_specs=(P("batch"), P(), P(), P("batch"))))(*args)

    assert_close(run(ours), run(theirs), F32, "sharded")
    # ... and both equal one device normalizing the whole batch (global statistics)
    y, stats, g = _block_step(FlaxBlock(), variables, x, z, cot)
    assert_close(run(ours)[:3], (y, stats, g[0]), F32, "vs unsharded")


def test_linen_batch_norm_axis_name_under_pmap():
    cpus = jax.devices("cpu")[:8]
    x = data(jax.random.key(1), (8, 2, 3, 4, 12), F32)
    z = data(jax.random.key(2), (8, 2, 3, 4, 12), F32, offset=0.0)
    variables = randomize(FlaxBlock().init(jax.random.key(0), x[0], z[0], True), jax.random.key(4))
    variables["batch_stats"] = jax.tree.map(jnp.abs, variables["batch_stats"])

    def run(model):
        def per_device(x, z):
            y, s = model.apply(variables, x, z, True, mutable=["batch_stats"])
            return y, s["batch_stats"]
        return jax.pmap(per_device, axis_name="batch", devices=cpus)(x, z)

    y_o, stats_o = run(OurBlock(axis_name="batch"))
    y_t, stats_t = run(FlaxBlock(axis_name="batch"))
    assert_close((y_o, stats_o), (y_t, stats_t), F32)


# --------------------------------------------------------------------- NNX ---

NNX_NORMS = [(nnx.LayerNorm, jnnx.LayerNorm, "layer_norm"), (nnx.RMSNorm, jnnx.RMSNorm, "rms_norm")]


@pytest.mark.parametrize("flax_cls,our_cls,op", NNX_NORMS, ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype,layer_dtype,impl", [(F32, None, None), (BF16, None, None),
                                                    (F16, F16, None), (BF16, BF16, "cuda"),
                                                    (F32, None, "pallas")])
def test_nnx_norm_matches_flax(flax_cls, our_cls, op, dtype, layer_dtype, impl):
    need(op, impl)
    x = data(jax.random.key(5), (3, 4, 33), dtype)
    theirs = flax_cls(33, dtype=layer_dtype, epsilon=1e-5, rngs=nnx.Rngs(0))
    ours = our_cls(33, dtype=layer_dtype, epsilon=1e-5, rngs=nnx.Rngs(0), implementation=impl)
    nnx.update(theirs, randomize(nnx.state(theirs, nnx.Param), jax.random.key(6)))
    nnx.update(ours, nnx.state(theirs))                      # flax state loads into ours
    same_layout(nnx.state(ours), nnx.state(theirs))
    assert_close(ours(x), theirs(x), theirs(x).dtype)
    fresh = flax_cls(33, dtype=layer_dtype, epsilon=1e-5, rngs=nnx.Rngs(1))
    nnx.update(fresh, nnx.state(ours))                       # ... and ours into flax's
    assert_close(fresh(x), theirs(x), theirs(x).dtype)
    cot = jax.random.normal(jax.random.key(8), x.shape)
    loss = lambda m, x: (m(x).astype(jnp.float32) * cot).sum()  # noqa: E731
    g_t = nnx.grad(loss, argnums=(0, 1))(theirs, x)
    g_o = nnx.grad(loss, argnums=(0, 1))(ours, x)
    assert_close(nnx.state(g_o[0]), nnx.state(g_t[0]), jnp.promote_types(theirs(x).dtype, dtype))
    assert_close(g_o[1], g_t[1], jnp.promote_types(theirs(x).dtype, dtype))
    assert op in ops_used(lambda x: ours(x), x)


@pytest.mark.parametrize("add", [False, True], ids=["relu", "add_relu"])
@pytest.mark.parametrize("dtype,layer_dtype,impl", [(F32, None, None), (BF16, None, None),
                                                    (BF16, BF16, None), (F16, F16, "cuda"),
                                                    (F32, None, "pallas")])
def test_nnx_batch_norm_matches_flax(add, dtype, layer_dtype, impl):
    need("batch_norm_relu", impl)
    x = data(jax.random.key(9), (4, 3, 5, 17), dtype)
    z = data(jax.random.key(10), (4, 3, 5, 17), dtype, offset=-0.5)
    kw = dict(momentum=0.8, epsilon=1e-4, dtype=layer_dtype, rngs=nnx.Rngs(0))
    theirs = nnx.BatchNorm(17, use_running_average=False, **kw)
    our_cls = jnnx.BatchNormAddReLU if add else jnnx.BatchNormReLU
    ours = our_cls(17, use_running_average=False, implementation=impl, **kw)
    nnx.update(theirs, randomize(nnx.state(theirs, nnx.Param), jax.random.key(11)))
    ours_state = nnx.state(ours)
    nnx.update(ours, nnx.state(theirs))
    same_layout(ours_state, nnx.state(theirs))
    zs = (z,) if add else ()
    flax_fn = lambda m, x, *z: jax.nn.relu(m(x) + z[0] if z else m(x))  # noqa: E731
    cot = jax.random.normal(jax.random.key(12), x.shape)

    def step(fn, m):
        loss = lambda m, x, *z: (fn(m, x, *z).astype(jnp.float32) * cot).sum()  # noqa: E731
        y = fn(nnx.clone(m), x, *zs)
        grads = nnx.grad(loss, argnums=(0, 1))(m, x, *zs)   # updates m's batch stats once
        return y, nnx.state(grads[0]), grads[1], nnx.state(m, nnx.BatchStat)

    r_t, r_o = step(flax_fn, theirs), step(lambda m, x, *z: m(x, *z), ours)
    # flax in float32 on the same (rounded) values: the judge where flax's bf16/f16
    # arithmetic is itself the larger error
    precise = nnx.BatchNorm(17, use_running_average=False, momentum=0.8, epsilon=1e-4,
                            dtype=jnp.float32, rngs=nnx.Rngs(0))
    rounded = jax.tree.map(lambda a: a.astype(layer_dtype or a.dtype).astype(jnp.float32),
                           nnx.state(theirs, nnx.Param))
    nnx.update(precise, rounded)
    r_ref = step(flax_fn, precise)
    out = r_t[0].dtype
    assert_close(r_o[0], r_t[0], out, "y")
    assert_close(r_o[1:3], r_t[1:3], jnp.promote_types(out, dtype), "grads", ref=r_ref[1:3])
    assert_close(r_o[3], r_t[3], F32, "batch stats")
    graphdef, state = nnx.split(ours)
    assert ("batch_norm_add_relu" if add else "batch_norm_relu") in ops_used(
        lambda state, x: nnx.merge(graphdef, state)(x, *zs), state, x)
    ours.use_running_average = theirs.use_running_average = True
    assert_close(ours(x, *zs), flax_fn(theirs, x, *zs), out, "eval")


def test_nnx_batch_norm_axis_name_under_shard_map():
    mesh = host_mesh()
    x = data(jax.random.key(1), (16, 2, 3, 6), F32)
    results = []
    for cls, activation in ((nnx.BatchNorm, jax.nn.relu), (jnnx.BatchNormReLU, lambda y: y)):
        graphdef, state = nnx.split(cls(6, use_running_average=False, axis_name="batch",
                                        rngs=nnx.Rngs(0)))

        def per_device(state, x):
            m = nnx.merge(graphdef, state)
            return activation(m(x)), nnx.state(m, nnx.BatchStat)
        results.append(jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("batch")),
                                             out_specs=(P("batch"), P())))(
            jax.device_put(state, NamedSharding(mesh, P())),
            jax.device_put(x, NamedSharding(mesh, P("batch")))))
    assert_close(results[1], results[0], F32)


# ------------------------------------------------------------------ attention ---

@pytest.mark.parametrize("dtype", [F32, BF16])
def test_linen_attention_fn_matches_flax(dtype):
    b, q, h, d = 2, 9, 3, 8
    x = jax.random.normal(jax.random.key(0), (b, q, h * d), dtype)
    mask = nn.make_causal_mask(jnp.ones((b, q)))
    # no q/k/v biases: the key bias's gradient is zero in exact arithmetic (it adds a
    # constant to each row of logits), so both sides would be rounding noise
    kw = dict(num_heads=h, qkv_features=h * d, dtype=dtype, dropout_rate=0.25, deterministic=False,
              use_bias=False)
    theirs = nn.MultiHeadDotProductAttention(**kw)
    ours = nn.MultiHeadDotProductAttention(**kw, attention_fn=jnn.dot_product_attention)
    rngs = {"params": jax.random.key(1), "dropout": jax.random.key(2)}
    v = theirs.init(rngs, x, mask=mask)
    same_layout(ours.init(rngs, x, mask=mask), v)
    run = lambda m: lambda v, x: m.apply(v, x, mask=mask, rngs={"dropout": jax.random.key(3)})  # noqa
    assert_close(run(ours)(v, x), run(theirs)(v, x), dtype)
    assert "softmax" in ops_used(run(ours), v, x)
    loss = lambda m: lambda v, x: run(m)(v, x).astype(jnp.float32).sum()  # noqa: E731
    assert_close(jax.grad(loss(ours), (0, 1))(v, x), jax.grad(loss(theirs), (0, 1))(v, x), dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_nnx_attention_fn_matches_flax(causal):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(4), 4)
    q, k, v = (jax.random.normal(kk, (2, 7, 2, 16)) for kk in (k1, k2, k3))
    bias = 0.1 * jax.random.normal(k4, (2, 1, 7, 7))
    mask = jax.random.bernoulli(k4, 0.8, (2, 1, 7, 7)).at[..., 0].set(True)
    kw = dict(bias=bias, mask=mask, is_causal=causal, dropout_rng=jax.random.key(5),
              dropout_rate=0.1)
    assert_close(jnnx.dot_product_attention(q, k, v, **kw),
                 nnx.dot_product_attention(q, k, v, **kw), F32)
    assert "softmax" in ops_used(lambda q: jnnx.dot_product_attention(q, k, v, **kw), q)


def test_layers_reachable_from_package():
    assert jax_ops.nn.LayerNorm is jnn.LayerNorm and jax_ops.nnx.BatchNormReLU is jnnx.BatchNormReLU
    assert issubclass(jnn.BatchNormAddReLU, nn.BatchNorm)
    assert issubclass(jnnx.RMSNorm, nnx.RMSNorm)
