"""Hidden-sharded norms and softmax (issue 23) on 8 host devices (tests/conftest.py):
with the normalized / softmax axis split over devices, implementation="cuda" runs our
per-device stage kernels (CPU: the same handlers compiled for the host) and "xla" the
jnp path. Values and gradients against float64 references computed here, the compiled
HLO's collectives (all-reduce / all-gather of O(rows × devices) or O(cols) elements, no
all-to-all or collective-permute, nothing activation-sized) and, for cuda, the stage
kernels' custom calls in the per-device program. Also one run across two processes
(jax.distributed, 2 x 4 CPU devices), and the stages on one device with the row split
into pieces by hand (on a GPU: the CUDA kernels, every tier)."""
from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ops
from support import hlo_collectives as collectives
from support import need

needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")

BF16 = jnp.bfloat16
TOL = {jnp.dtype(jnp.float32): 2e-6, jnp.dtype(BF16): 1e-2, jnp.dtype(jnp.float16): 5e-3}
NORM_STAGES = ("jax_ops_norm_partials", "jax_ops_norm_apply")
NORM_BWD_STAGES = ("jax_ops_norm_bwd_partials", "jax_ops_norm_bwd_apply")
SOFTMAX_STAGES = ("jax_ops_softmax_partials", "jax_ops_softmax_apply")
SOFTMAX_BWD_STAGES = ("jax_ops_softmax_bwd_partials", "jax_ops_softmax_bwd_apply")


def mesh_of(shape, names=("a", "b")):
    return jax.make_mesh(shape, names[:len(shape)], devices=jax.devices()[:math.prod(shape)])


def axes_of(entry):
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def ways(mesh, spec, dim):
    """How many devices split x's dim `dim` under spec."""
    return math.prod(mesh.shape[a] for a in axes_of(spec[dim] if dim < len(spec) else None))


def rnd(shape, seed, dtype=jnp.float32, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)).astype(dtype)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.array_equal(np.isfinite(got), np.isfinite(want)), "non-finite entries differ"
    fin = np.isfinite(want)
    if not fin.any():
        return 0.0
    return float(np.linalg.norm(got[fin] - want[fin]) / max(np.linalg.norm(want[fin]), 1e-30))


def cotangents(outs):
    return [jnp.cos(jnp.arange(o.size, dtype=jnp.float32) * (0.37 + i)).reshape(o.shape)
            for i, o in enumerate(outs)]


# ------------------------------------------------------------ HLO checks ---


def custom_calls(text):
    return set(re.findall(r'custom_call_target="([^"]+)"', text))


def check_hlo(text, *, limit, activation):
    """Only all-reduces and all-gathers, none of more than `limit` elements (per-row
    partials of every column device, per-column sums), which is below the local
    activation's size (so an activation-sized collective cannot pass)."""
    assert limit < activation, (limit, activation)
    colls = collectives(text)
    for kind, sizes in colls:
        assert kind in ("all-reduce", "all-gather"), f"{kind} in {colls}"
        assert all(n <= limit for n in sizes), f"{kind} of {sizes} elements (limit {limit}): {colls}"
    return colls


# ----------------------------------------------------- float64 references ---

def with_x64(fn):
    def run(*args):
        with jax.enable_x64(True):
            args64 = [None if a is None else
                      jnp.asarray(np.asarray(a, bool if np.asarray(a).dtype == bool else np.float64))
                      for a in args]
            return fn(*args64)
    return run


def ref_norm(h, scale, bias, *, eps, rms):
    """float64 LayerNorm/RMSNorm over the last axis."""
    mean = 0.0 if rms else jnp.mean(h, -1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
    y = (h - mean) / jnp.sqrt(var + eps)
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y


NORM_OPS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")


def norm_case(op, impl, x, residual, scale, bias):
    eps = 1e-5 if "layer" in op else 1e-6
    f = getattr(jax_ops, op)
    add, rms = op.startswith("add_"), "rms" in op
    params = (scale,) if rms else (scale, bias)

    def fn(*a):
        return f(*a, implementation=impl)

    def ref(x64, r64, s64, b64, ct_y, ct_h, h_rounded):
        """(outputs, grads of Σ out·ct) in float64; h as the op rounds it."""
        def g(h, s, b):
            return ref_norm(h, s, b, eps=eps, rms=rms)
        y, vjp = jax.vjp(g, h_rounded, s64, b64)
        dh, ds, db = vjp(ct_y)
        if add:
            dh = dh + ct_h
            return (y, h_rounded), (dh, dh, ds) + (() if rms else (db,))
        return (y,), (dh, ds) + (() if rms else (db,))

    args = (x, residual, *params) if add else (x, *params)
    return fn, args, ref, eps


def run_norm(op, impl, mesh, spec, x, residual, scale, bias, dtype):
    fn, args, ref, _ = norm_case(op, impl, x, residual, scale, bias)
    rep = NamedSharding(mesh, P())
    xs = NamedSharding(mesh, spec)
    add = op.startswith("add_")
    shard = [xs, xs] if add else [xs]
    placed = [jax.device_put(a, s) for a, s in zip(args, shard + [rep] * (len(args) - len(shard)))]
    outs = jax.jit(fn)(*placed)
    outs = outs if isinstance(outs, tuple) else (outs,)
    cts = cotangents(outs)

    def loss(*a):
        o = fn(*a)
        o = o if isinstance(o, tuple) else (o,)
        return sum(jnp.sum(u.astype(jnp.float32) * c) for u, c in zip(o, cts))
    argnums = tuple(range(len(args)))
    grad = jax.jit(jax.grad(loss, argnums=argnums))
    grads = grad(*placed)
    h_rounded = (x + residual) if add else x  # rounded in x's dtype, as the op does
    rms = "rms" in op
    want_outs, want_grads = with_x64(
        lambda x64, r64, s64, b64, cy, ch, h64: ref(x64, r64, s64, b64, cy, ch, h64))(
        x, residual, scale, None if rms else bias, cts[0], cts[1] if add else None, h_rounded)
    tol = TOL[jnp.dtype(dtype)]
    for name, g, w in zip(("y", "h"), outs, want_outs):
        assert g.dtype == jnp.dtype(dtype)
        assert rel_err(g, w) <= tol, f"{op} {name}: {rel_err(g, w):.2e} > {tol}"
    names = ("dx", "dresidual") if add else ("dx",)
    names += ("dscale",) + (() if rms else ("dbias",))
    for name, g, w in zip(names, grads, want_grads):
        assert rel_err(g, w) <= tol, f"{op} {name}: {rel_err(g, w):.2e} > {tol}"
    return jax.jit(fn).lower(*placed).compile().as_text(), grad.lower(*placed).compile().as_text()


# ------------------------------------------------------------------ norms ---
# (mesh shape, spec of x (B, S, H)): the hidden axis H sharded, alone, over two mesh
# axes, and with the batch
NORM_MESHES = [
    ((8,), P(None, None, "a")),
    ((4, 2), P(None, None, ("a", "b"))),
    ((4, 2), P("a", None, "b")),
    ((2, 4), P("a", None, "b")),
]


@needs8
@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", ["cuda", "xla"])
@pytest.mark.parametrize("op", NORM_OPS)
@pytest.mark.parametrize("mesh_shape,spec", NORM_MESHES, ids=lambda v: str(v))
def test_hidden_sharded_norms(mesh_shape, spec, op, impl, dtype):
    need(op, impl)
    mesh = mesh_of(mesh_shape)
    B, S, H = 8, 4, 256
    x, r = rnd((B, S, H), 0, dtype, 2.0) + 0.5, rnd((B, S, H), 1, dtype)
    scale, bias = 1 + 0.1 * rnd((H,), 2), 0.1 * rnd((H,), 3)
    fwd_text, grad_text = run_norm(op, impl, mesh, spec, x.astype(dtype), r, scale, bias, dtype)
    d_cols, d_rows = ways(mesh, spec, 2), ways(mesh, spec, 0)
    rows_local, cols_local = B * S // d_rows, H // d_cols
    limit = max(2 * d_cols * rows_local, H)  # partials of every column device; dscale/dbias
    for text in (fwd_text, grad_text):
        colls = check_hlo(text, limit=limit, activation=rows_local * cols_local)
        assert colls, "the row statistics are combined across devices"
    calls = custom_calls(fwd_text) | custom_calls(grad_text)
    ours = {c for c in calls if c.startswith("jax_ops")}
    if impl == "cuda":  # the stage kernels run on every device, nothing else of ours
        assert set(NORM_STAGES) <= custom_calls(fwd_text), custom_calls(fwd_text)
        assert ours == set(NORM_STAGES + NORM_BWD_STAGES), ours
        # the combine: one all-gather of every column device's partials per pass
        gather = (1 if "rms" in op else 2) * d_cols * rows_local
        assert ("all-gather", [gather]) in collectives(fwd_text), collectives(fwd_text)
    else:
        assert not ours, ours


# (x shape, mesh shape, spec): local column counts 1, 3, 33 (odd, unaligned), one row
# (rank 1 and rank 2), a row split two ways
NORM_EDGES = [
    ((5, 8), (8,), P(None, "a")),           # local cols 1
    ((3, 24), (8,), P(None, "a")),          # 3
    ((2, 264), (8,), P(None, "a")),         # 33
    ((1, 66), (2,), P(None, "a")),          # one row, 33 columns each
    ((264,), (8,), P("a")),                 # rank 1: one row, 0-d statistics
    ((4, 2, 66), (2, 4), P("b", None, "a")),  # 33 columns, rows split 4 ways
]


@needs8
@pytest.mark.parametrize("impl", ["cuda", "xla"])
@pytest.mark.parametrize("op", NORM_OPS)
@pytest.mark.parametrize("shape,mesh_shape,spec", NORM_EDGES, ids=lambda v: str(v))
def test_hidden_sharded_norm_shapes(shape, mesh_shape, spec, op, impl):
    need(op, impl)
    mesh = mesh_of(mesh_shape)
    H = shape[-1]
    x, r = rnd(shape, 4, scale=3.0) - 1.0, rnd(shape, 5)
    scale, bias = 1 + 0.1 * rnd((H,), 6), 0.1 * rnd((H,), 7)
    fwd_text, grad_text = run_norm(op, impl, mesh, spec, x, r, scale, bias, jnp.float32)
    if impl == "cuda":
        assert set(NORM_STAGES) <= custom_calls(fwd_text) and set(NORM_BWD_STAGES) <= custom_calls(grad_text)


@needs8
@pytest.mark.parametrize("impl", ["cuda", "xla"])
@pytest.mark.parametrize("op", ["layer_norm", "add_rms_norm"])
def test_hidden_sharded_norm_empty_rows(op, impl):
    """No rows: nothing to partition; the unsharded lowering gives empty results."""
    need(op, impl)
    mesh = mesh_of((8,))
    x = jax.device_put(jnp.zeros((0, 64), jnp.float32), NamedSharding(mesh, P(None, "a")))
    scale = jnp.ones((64,), jnp.float32)
    if op == "layer_norm":
        y = jax.jit(lambda x: jax_ops.layer_norm(x, scale, implementation=impl))(x)
        g = jax.jit(jax.grad(lambda s: jnp.sum(jax_ops.layer_norm(x, s, implementation=impl))))(scale)
    else:
        y, _ = jax.jit(lambda x: jax_ops.add_rms_norm(x, x, scale, implementation=impl))(x)
        g = jax.jit(jax.grad(lambda s: jnp.sum(jax_ops.add_rms_norm(x, x, s, implementation=impl)[0])))(scale)
    assert y.shape == (0, 64)
    np.testing.assert_array_equal(np.asarray(g), np.zeros(64))


@needs8
def test_hidden_sharded_statistics_match_every_device():
    """The training forward's mean/rstd (combined on every device from the gathered
    partials) equal the float64 statistics of the whole rows."""
    mesh = mesh_of((8,))
    x = rnd((6, 128), 8, scale=4.0) + 3.0
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "a")))
    from jax_ops.ops.layer_norm import FWD
    _, _, mean, rstd = jax.jit(lambda x: FWD.call(x, None, None, None, epsilon=1e-5, rms=False,
                                                  with_stats=True, implementation="cuda"))(xs)
    xf = np.asarray(x, np.float64)
    np.testing.assert_allclose(mean, xf.mean(-1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(xf.var(-1) + 1e-5), rtol=2e-6)


# ---------------------------------------------------------------- softmax ---

def ref_softmax(x, mask, *, scale, log, causal, mask_kind):
    """float64 (log_)softmax over the last axis with the op's rules (fully masked rows:
    0 / -inf); masked entries of log_softmax are -inf."""
    z = x * scale
    keep = None
    if mask_kind == "bool":
        keep = mask
    elif mask_kind == "add":
        z = z + mask
    if causal:
        q, k = x.shape[-2], x.shape[-1]
        tri = jnp.arange(k)[None, :] <= jnp.arange(q)[:, None] + (k - q)
        keep = tri if keep is None else keep & tri
    if keep is not None:
        z = jnp.where(keep, z, -jnp.inf)
    m = jnp.max(z, -1, keepdims=True)
    empty = m == -jnp.inf
    m = jnp.where(empty, 0.0, m)
    e = jnp.exp(z - m)
    s = jnp.sum(e, -1, keepdims=True)
    s = jnp.where(empty, 1.0, s)
    if log:
        return jnp.where(empty, -jnp.inf, (z - m) - jnp.log(s))
    return jnp.where(empty, 0.0, e / s)


# (mesh shape, spec of x (B, N, Q, K), mask kind, causal, (Q, K)): the key axis sharded
# (alone, with the batch, with the query axis), a key-padding bool mask, a full additive
# mask sharded with x, the causal rule with the device's column (and row) offsets. Local
# rows hold more columns than the gathered partials (2 per column device).
SOFTMAX_CASES = [
    ((8,), P(None, None, None, "a"), "none", False, (16, 256)),
    ((8,), P(None, None, None, "a"), "bool", True, (16, 256)),
    ((4, 2), P("a", None, None, "b"), "bool", False, (16, 64)),
    ((2, 4), P(None, "a", None, "b"), "add", True, (16, 64)),
    ((4, 2), P(None, None, "a", "b"), "none", True, (16, 64)),   # query and key axes sharded
    ((8,), P(None, None, "a", None), "bool", True, (16, 64)),    # causal, only the query axis
    ((4, 2), P(None, None, "a", "b"), "add", True, (48, 32)),    # q > k: rows fully masked
]


def softmax_inputs(shape, mask_kind, dtype):
    x = rnd(shape, 10, dtype, 3.0)
    B, N, Q, K = shape
    if mask_kind == "bool":
        mask = jax.random.bernoulli(jax.random.key(11), 0.8, (B, 1, 1, K))
        mask = mask.at[0, 0, 0, 5:].set(False)  # a row with keys only on the first device
    elif mask_kind == "add":
        mask = rnd(shape, 12, dtype)
        mask = jnp.where(jax.random.bernoulli(jax.random.key(13), 0.1, shape), -jnp.inf, mask).astype(dtype)
    else:
        mask = None
    return x, mask


def run_softmax(op, impl, mesh, spec, x, mask, causal, dtype, scale=0.5):
    f = getattr(jax_ops, op)
    log = op == "log_softmax"
    mask_kind = "none" if mask is None else ("bool" if mask.dtype == jnp.bool_ else "add")

    def fn(x, *m):
        y = f(x, mask=m[0] if m else None, causal=causal, scale=scale, implementation=impl)
        return jnp.where(jnp.isfinite(y), y, 0.0)
    xs = NamedSharding(mesh, spec)
    args = (x,) if mask is None else (x, mask)
    if mask is not None:
        mspec = P(*(s if mask.shape[i] == x.shape[i] else None for i, s in enumerate(spec)))
        shard = [xs, NamedSharding(mesh, mspec)]
    else:
        shard = [xs]
    placed = [jax.device_put(a, s) for a, s in zip(args, shard)]
    y = jax.jit(fn)(*placed)
    (ct,) = cotangents([y])
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct)))
    dx = grad(*placed)

    def ref(x64, *m64):
        def g(x64):
            yy = ref_softmax(x64, m64[0] if m64 else None, scale=scale, log=log, causal=causal,
                             mask_kind=mask_kind)
            return jnp.where(jnp.isfinite(yy), yy, 0.0)
        yy, vjp = jax.vjp(g, x64)
        return yy, vjp(ct.astype(jnp.float64))[0]
    want_y, want_dx = with_x64(ref)(*args)
    tol = TOL[jnp.dtype(dtype)]
    assert rel_err(y, want_y) <= tol, f"{op} y: {rel_err(y, want_y):.2e}"
    # dx = y·(dy − Σ dy·y) cancels: the unsharded op's own float32 error on peaked rows
    # reaches 1e-5; the sharded one may not be worse than twice that
    unsharded = rel_err(grad(*args), want_dx)
    assert rel_err(dx, want_dx) <= max(tol, 2 * unsharded), \
        f"{op} dx: {rel_err(dx, want_dx):.2e} (unsharded {unsharded:.2e})"
    return jax.jit(fn).lower(*placed).compile().as_text(), grad.lower(*placed).compile().as_text()


@needs8
@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", ["cuda", "xla"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("mesh_shape,spec,mask_kind,causal,qk", SOFTMAX_CASES, ids=lambda v: str(v))
def test_hidden_sharded_softmax(mesh_shape, spec, mask_kind, causal, qk, op, impl, dtype):
    need(op, impl)
    mesh = mesh_of(mesh_shape)
    shape = (4, 2) + qk
    x, mask = softmax_inputs(shape, mask_kind, dtype)
    fwd_text, grad_text = run_softmax(op, impl, mesh, spec, x, mask, causal, dtype)
    d_cols = ways(mesh, spec, 3)
    rows_local = math.prod(shape[:3]) // math.prod(ways(mesh, spec, i) for i in range(3))
    cols_local = shape[3] // d_cols
    limit = 2 * d_cols * rows_local
    for text in (fwd_text, grad_text):
        check_hlo(text, limit=limit, activation=rows_local * cols_local)
    ours = {c for c in custom_calls(fwd_text) | custom_calls(grad_text) if c.startswith("jax_ops")}
    if impl == "cuda":
        assert set(SOFTMAX_STAGES) <= custom_calls(fwd_text), custom_calls(fwd_text)
        want = set(SOFTMAX_STAGES + SOFTMAX_BWD_STAGES) if d_cols > 1 else set(SOFTMAX_STAGES)
        assert want <= ours <= set(SOFTMAX_STAGES + SOFTMAX_BWD_STAGES) | {"jax_ops_softmax_bwd"}, ours
        if d_cols > 1:
            assert ("all-gather", [2 * d_cols * rows_local]) in collectives(fwd_text)
        else:  # only the query axis: nothing to combine
            assert not collectives(fwd_text), collectives(fwd_text)
    else:
        assert not ours, ours


# (x shape, mesh shape, spec): local key counts 1, 3, 33; one row
SOFTMAX_EDGES = [
    ((3, 8), (8,), P(None, "a")),
    ((2, 2, 24), (8,), P(None, None, "a")),
    ((2, 264), (8,), P(None, "a")),
    ((264,), (8,), P("a")),                  # rank 1: one row
    ((1, 66), (2,), P(None, "a")),
]


@needs8
@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("impl", ["cuda", "xla"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("shape,mesh_shape,spec", SOFTMAX_EDGES, ids=lambda v: str(v))
def test_hidden_sharded_softmax_shapes(shape, mesh_shape, spec, op, impl, causal):
    need(op, impl)
    if causal and len(shape) < 2:
        pytest.skip("causal needs (..., q, k)")
    mesh = mesh_of(mesh_shape)
    x = rnd(shape, 14, scale=4.0)
    fwd_text, grad_text = run_softmax(op, impl, mesh, spec, x, None, causal, jnp.float32, scale=1.0)
    if impl == "cuda":
        assert set(SOFTMAX_STAGES) <= custom_calls(fwd_text)
        assert set(SOFTMAX_BWD_STAGES) <= custom_calls(grad_text)


@needs8
def test_explicit_pallas_hidden_sharded():
    """implementation="pallas": the stages have no Pallas kernels, so dispatch chooses
    for them automatically; the result is still the op's."""
    need("layer_norm", "pallas")
    mesh = mesh_of((8,))
    x = rnd((4, 64), 16)
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "a")))
    y = jax.jit(lambda x: jax_ops.layer_norm(x, implementation="pallas"))(xs)
    assert rel_err(y, with_x64(lambda v: ref_norm(v, None, None, eps=1e-5, rms=False))(x)) <= 2e-6


# ------------------------------------------------------------- multi-host ---

_WORKER = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=sys.argv[2], num_processes=2,
                               process_id=int(sys.argv[1]), initialization_timeout=60)
    import numpy as np
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax.experimental import multihost_utils
    import jax_ops
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    x = np.asarray(jax.random.normal(jax.random.key(0), (8, 4, 128)), np.float32)
    sc = np.asarray(1 + 0.1 * jax.random.normal(jax.random.key(1), (128,)), np.float32)
    sh = NamedSharding(mesh, P("a", None, "b"))
    xs = jax.make_array_from_callback(x.shape, sh, lambda i: x[i])
    scs = jax.make_array_from_callback(sc.shape, NamedSharding(mesh, P()), lambda i: sc[i])
    def loss(x, s):
        return jnp.sum(jax_ops.layer_norm(x, s, implementation="cuda") * jnp.cos(x))
    f = jax.jit(lambda x, s: jax_ops.layer_norm(x, s, implementation="cuda"))
    text = f.lower(xs, scs).compile().as_text()
    assert "jax_ops_norm_partials" in text and "jax_ops_norm_apply" in text
    y = multihost_utils.process_allgather(f(xs, scs), tiled=True)
    gx, gs = jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, scs)
    gx = multihost_utils.process_allgather(gx, tiled=True)
    gs = multihost_utils.process_allgather(gs, tiled=True)
    if jax.process_index() == 0:
        np.savez(sys.argv[3], y=y, gx=gx, gs=gs)
    jax.distributed.shutdown()
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@needs8
def test_multi_process_hidden_sharded_layer_norm(tmp_path):
    """Two processes x 4 CPU devices (jax.distributed, gloo collectives, coordinator on
    localhost): a hidden+batch-sharded layer_norm and its gradients equal the
    single-process results. Skipped where this jax cannot run CPU collectives across
    processes."""
    need("layer_norm", "cuda")
    try:
        jax.config.jax_cpu_collectives_implementation  # noqa: B018
    except AttributeError:
        pytest.skip("this jax has no CPU collectives option (jax_cpu_collectives_implementation)")
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    out = tmp_path / "result.npz"
    addr = f"localhost:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    procs = [subprocess.Popen([sys.executable, str(script), str(i), addr, str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.skip("jax.distributed on CPU did not finish in time here")
    if any(p.returncode for p in procs):
        text = "\n".join(logs)
        if re.search(r"gloo|collectives|Multiprocess|not supported|UNIMPLEMENTED", text) and \
                "AssertionError" not in text:
            pytest.skip(f"multi-process CPU collectives unavailable: {text[-500:]}")
        raise AssertionError(text[-4000:])
    got = np.load(out)
    x = np.asarray(jax.random.normal(jax.random.key(0), (8, 4, 128)), np.float32)
    sc = np.asarray(1 + 0.1 * jax.random.normal(jax.random.key(1), (128,)), np.float32)
    mesh = mesh_of((2, 4))
    xs = jax.device_put(x, NamedSharding(mesh, P("a", None, "b")))

    def loss(x, s):
        return jnp.sum(jax_ops.layer_norm(x, s, implementation="cuda") * jnp.cos(x))
    y = jax.jit(lambda x, s: jax_ops.layer_norm(x, s, implementation="cuda"))(xs, sc)
    gx, gs = jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, sc)
    np.testing.assert_allclose(got["y"], y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["gx"], gx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["gs"], gs, rtol=1e-5, atol=1e-5)


# ------------------------------------------- the stages on one device, split by hand ---
# The per-device pipeline of the locals, with the row split into `pieces` column slices
# on one device and the partials merged by the same helpers: on a GPU this runs the CUDA
# stage kernels (every tier: lanes per row 1..32, a block per row for few long rows,
# 16-byte packs and scalars, the column-tiled passes with their dscale/dbias partials).

from jax_ops.core.sharding import merge_moment_parts, ordered_sum  # noqa: E402
from jax_ops.ops import layer_norm as LN, softmax as SM  # noqa: E402

# (rows, columns of a piece, pieces, dtype)
SPLIT_NORM = [
    (37, 1, 8, jnp.float32),
    (64, 3, 4, BF16),
    (130, 33, 2, jnp.float32),
    (1, 264, 2, BF16),
    (4096, 128, 2, BF16),          # many rows: column-tiled chunks
    (300, 1024, 2, jnp.float16),   # 128 packs: 32 lanes a row
    (3, 8192, 2, jnp.float32),     # few long rows: a block per row
]


def _pieces(a, n):
    return jnp.split(a, n, axis=-1)


@pytest.mark.parametrize("op", NORM_OPS)
@pytest.mark.parametrize("rows,cols,pieces,dtype", SPLIT_NORM, ids=lambda v: str(v))
def test_norm_stages_split_on_one_device(rows, cols, pieces, dtype, op):
    need(op, "cuda")
    H = cols * pieces
    add, rms = op.startswith("add_"), "rms" in op
    eps = 1e-5 if not rms else 1e-6
    x, r = rnd((rows, H), 20, dtype, 3.0) + 1.0, rnd((rows, H), 21, dtype)
    pdt = dtype if op == "layer_norm" else jnp.float32  # parameters in x's dtype or float32
    scale, bias = (1 + 0.1 * rnd((H,), 22)).astype(pdt), (0.1 * rnd((H,), 23)).astype(pdt)
    bias = None if rms else bias
    dy, dh = rnd((rows, H), 24, dtype), (rnd((rows, H), 25, dtype) if add else None)

    @jax.jit
    def run(x, r, scale, bias, dy, dh):
        kw = dict(implementation="cuda")
        xs, rs = _pieces(x, pieces), (_pieces(r, pieces) if add else [None] * pieces)
        ss, bs = _pieces(scale, pieces), (_pieces(bias, pieces) if bias is not None else [None] * pieces)
        parts = [LN.PARTIALS.call(a, b, rms=rms, **kw) for a, b in zip(xs, rs)]
        hs = [p[2] if add else a for p, a in zip(parts, xs)]
        if rms:
            mean, m2 = None, ordered_sum(jnp.stack([p[1] for p in parts]))
        else:
            mean, m2 = merge_moment_parts(jnp.stack([p[0] for p in parts]),
                                          jnp.stack([p[1] for p in parts]), cols)
        rstd = jax.lax.rsqrt(m2 / H + eps)
        y = jnp.concatenate([LN.APPLY.call(h, mean, rstd, s_, b_, **kw)[0]
                             for h, s_, b_ in zip(hs, ss, bs)], -1)
        dys, dhs = _pieces(dy, pieces), (_pieces(dh, pieces) if add else [None] * pieces)
        sums = [LN.BWD_PARTIALS.call(d, h, mean, rstd, s_, rms=rms, **kw) for d, h, s_ in zip(dys, hs, ss)]
        sum_g = None if rms else ordered_sum(jnp.stack([p[0] for p in sums]))
        sum_gx = ordered_sum(jnp.stack([p[1] for p in sums]))
        outs = [LN.BWD_APPLY.call(d, e, h, mean, rstd, s_, sum_g, sum_gx, rms=rms, inv_n=1.0 / H,
                                  want_dscale=True, want_dbias=not rms, **kw)
                for d, e, h, s_ in zip(dys, dhs, hs, ss)]
        dx = jnp.concatenate([o[0] for o in outs], -1)
        ds = jnp.concatenate([o[1] for o in outs], -1)
        db = None if rms else jnp.concatenate([o[2] for o in outs], -1)
        return y, jnp.concatenate(hs, -1), dx, ds, db

    y, h, dx, ds, db = run(x, r, scale, bias, dy, dh)
    text = run.lower(x, r, scale, bias, dy, dh).compile().as_text()
    assert {"jax_ops_norm_partials", "jax_ops_norm_apply", "jax_ops_norm_bwd_partials",
            "jax_ops_norm_bwd_apply"} <= custom_calls(text)
    h_rounded = (x + r) if add else x
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h_rounded, np.float32))

    def ref(h64, s64, b64, dy64, dh64):
        yy, vjp = jax.vjp(lambda h, s, b: ref_norm(h, s, b, eps=eps, rms=rms), h64, s64, b64)
        g_h, g_s, g_b = vjp(dy64)
        return yy, g_h + (0.0 if dh64 is None else dh64), g_s, g_b
    want_y, want_dx, want_ds, want_db = with_x64(ref)(h_rounded, scale, bias, dy, dh)
    tol = TOL[jnp.dtype(dtype)]
    for name, g, w in (("y", y, want_y), ("dx", dx, want_dx), ("dscale", ds, want_ds),
                       ("dbias", db, want_db)):
        if w is not None:
            assert rel_err(g, w) <= tol, f"{name}: {rel_err(g, w):.2e} > {tol}"


# (batch, q, columns of a piece, pieces, dtype, mask kind, causal)
SPLIT_SOFTMAX = [
    (3, 5, 1, 8, jnp.float32, "bool", True),
    (2, 16, 3, 4, BF16, "add", False),
    (2, 24, 33, 2, jnp.float32, "add32", True),      # q < k, unaligned pieces
    (8, 64, 128, 2, BF16, "bool", True),              # 16 packs: 4 lanes a row
    (1, 2, 8192, 2, jnp.float32, "none", True),       # few long rows: a block per row
    (4, 40, 16, 2, jnp.float16, "none", True),        # q > k: fully masked rows
]


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("b,q,cols,pieces,dtype,mask_kind,causal", SPLIT_SOFTMAX, ids=lambda v: str(v))
def test_softmax_stages_split_on_one_device(b, q, cols, pieces, dtype, mask_kind, causal, op):
    need(op, "cuda")
    K = cols * pieces
    log = op == "log_softmax"
    x = rnd((b, q, K), 30, dtype, 3.0)
    if mask_kind == "bool":
        mask = jax.random.bernoulli(jax.random.key(31), 0.7, (b, 1, K)).at[0, 0, 1:].set(False)
    elif mask_kind in ("add", "add32"):
        mask = rnd((b, q, K), 32, dtype if mask_kind == "add" else jnp.float32)
        drop = jax.random.bernoulli(jax.random.key(33), 0.2, (b, q, K))
        mask = jnp.where(drop, -jnp.inf, mask).astype(mask.dtype)
    else:
        mask = None
    kind = "none" if mask is None else ("bool" if mask_kind == "bool" else "add")
    scale = 0.7
    dy = rnd((b, q, K), 34, dtype)

    @jax.jit
    def run(x, mask, dy):
        kw = dict(scale=scale, causal=causal, mask_kind=kind, implementation="cuda")
        xs = _pieces(x, pieces)
        ms = _pieces(mask, pieces) if mask is not None else [None] * pieces
        offs = [jnp.int32(K - q - i * cols) if causal else None for i in range(pieces)]
        parts = [SM.PARTIALS.call(a, m, o, **kw) for a, m, o in zip(xs, ms, offs)]
        mx, sm = SM.merge_max_sum_parts(jnp.stack([p[0] for p in parts]), jnp.stack([p[1] for p in parts]))
        ys = [SM.APPLY.call(a, m, o, mx, sm, log=log, **kw)[0] for a, m, o in zip(xs, ms, offs)]
        dys = _pieces(dy, pieces)
        dot = ordered_sum(jnp.stack([SM.BWD_PARTIALS.call(y_, d, log=log, implementation="cuda")[0]
                                     for y_, d in zip(ys, dys)]))
        dxs = [SM.BWD_APPLY.call(y_, d, dot, scale=scale, log=log, implementation="cuda")[0]
               for y_, d in zip(ys, dys)]
        return jnp.concatenate(ys, -1), jnp.concatenate(dxs, -1)

    y, dx = run(x, mask, dy)
    text = run.lower(x, mask, dy).compile().as_text()
    assert set(SOFTMAX_STAGES + SOFTMAX_BWD_STAGES) <= custom_calls(text)

    def ref(x64, m64, dy64):
        def f(v):
            return ref_softmax(v, m64, scale=scale, log=log, causal=causal, mask_kind=kind)
        yy = f(x64)
        # the op's backward from y (log: masked entries -inf get no gradient)
        yf = yy
        if log:
            live = jnp.isfinite(yf)
            dot = jnp.sum(jnp.where(live, dy64, 0.0), -1, keepdims=True)
            dz = jnp.where(live, dy64 - jnp.exp(yf) * dot, 0.0)
        else:
            dz = yf * (dy64 - jnp.sum(dy64 * yf, -1, keepdims=True))
        return yy, scale * dz
    want_y, want_dx = with_x64(ref)(x, mask, dy)
    tol = TOL[jnp.dtype(dtype)]
    assert rel_err(y, want_y) <= tol, f"y: {rel_err(y, want_y):.2e}"
    # dx from the op's own y (rounded to x's dtype): the reference takes the float64 y
    assert rel_err(dx, want_dx) <= max(tol, 1e-5), f"dx: {rel_err(dx, want_dx):.2e}"


def test_stage_errors():
    """The stages validate their operands with errors naming them."""
    x = jnp.ones((4, 8), jnp.float32)
    rows = jnp.ones((4,), jnp.float32)
    with pytest.raises(ValueError, match=r"residual must match x"):
        LN.PARTIALS.call(x, jnp.ones((4, 8), BF16), rms=False, implementation="xla")
    with pytest.raises(ValueError, match=r"rstd must be float32 of shape \(4,\)"):
        LN.APPLY.call(x, rows, jnp.ones((4,), BF16), None, None, implementation="xla")
    with pytest.raises(ValueError, match=r"sum_gx must be float32 of shape \(4,\)"):
        LN.BWD_APPLY.call(x, None, x, rows, rows, None, rows, jnp.ones((8,), jnp.float32), rms=False,
                          inv_n=0.125, want_dscale=False, want_dbias=False, implementation="xla")
    with pytest.raises(ValueError, match=r"want_dscale needs scale"):
        LN.BWD_APPLY.call(x, None, x, rows, rows, None, rows, rows, rms=False, inv_n=0.125,
                          want_dscale=True, want_dbias=False, implementation="xla")
    with pytest.raises(ValueError, match=r"offset is the causal rule's int32 scalar"):
        SM.PARTIALS.call(x, None, jnp.int32(0), scale=1.0, causal=False, mask_kind="none",
                         implementation="xla")
    with pytest.raises(ValueError, match=r"max must be float32 of shape \(4,\)"):
        SM.APPLY.call(x, None, None, jnp.ones((4, 1), jnp.float32), rows, scale=1.0, log=False,
                      causal=False, mask_kind="none", implementation="xla")
