"""Tests of jax_ops.cross_entropy.

Every implementation that can lower on the platform jax runs on ("cuda" means our C++
host handlers on a CPU, "pallas" the Pallas interpreter) is checked against a float64
NumPy reference written here (loss and the gradient of the logits), and, for the default
options, against optax.softmax_cross_entropy_with_integer_labels itself (values, `where`,
`axis`, label conventions). The reference gets the same (possibly low-precision) logits
upcast to float64.

Reference, per example (classes last), K the kept classes (all, or an element-wise
where's), n = |K|, lse = log Σ_K exp z, label l (negative labels in [-V, -1] count from
the end; others outside [0, V) give a NaN loss):
  loss = (1 - ls)(lse - z_l) + ls (lse - Σ_K z / n) + z_loss lse²
  dloss/dz = softmax_K(z)(1 + 2 z_loss lse) - (1 - ls) onehot(l) - (ls / n)[K]
Ignored examples (ignore_index, a False per-example where, an element-wise where with no
kept class) have loss 0 and gradient 0; "mean" divides by the number of counted examples
(0 when there is none), "sum" adds them.

Error metric: ‖out − ref‖ / ‖ref‖ (TOL per logits dtype; losses are float32 math on the
exact inputs in every dtype); outputs must be finite where the reference is, and exactly
0 where the reference is an ignored example.
"""
from __future__ import annotations

import functools
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
from pallas_kernels import cross_entropy as pallas_ce

OP = "cross_entropy"
IMPLS = ("xla", "cuda", "pallas")
DTYPES = ("float32", "bfloat16", "float16")
FWD_TARGET, BWD_TARGET = "jax_ops_ce_fwd", "jax_ops_ce_bwd"
LOSS_TOL = 3e-6                                   # float32 math on exact inputs
GRAD_TOL = {"float32": 3e-6, "bfloat16": 1e-2, "float16": 2e-3}  # dlogits in logits' dtype
PLATFORM = support.PLATFORM


def need(impl):
    support.need(OP, impl)


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode())


def make_logits(rng, shape, dtype="float32", spread=3.0):
    return jnp.asarray(spread * rng.standard_normal(shape), dtype)


def make_labels(rng, shape, V):
    return jnp.asarray(rng.integers(0, V, size=shape), jnp.int32)


def ce(x, labels, impl, **kw):
    return jax_ops.cross_entropy(x, labels, implementation=impl, **kw)


# ------------------------------------------------------- float64 reference ---

def ref(x, labels, *, where=None, label_smoothing=0.0, z_loss=0.0, ignore_index=None,
        reduction="none", ct=None):
    """(loss, dloss/dlogits) in float64, classes last. where: None, labels' shape (per
    example) or logits' shape (per class). ct: the loss's cotangent (labels' shape for
    "none", a scalar otherwise; default ones)."""
    z = np.asarray(x, np.float64)
    lab = np.asarray(labels).astype(np.int64)
    V = z.shape[-1]
    keep = np.ones(z.shape, bool)
    valid = np.ones(lab.shape, bool)
    if where is not None:
        w = np.asarray(where)
        if w.shape == lab.shape:
            valid &= w
        else:
            keep = np.broadcast_to(w, z.shape).copy()
            valid &= keep.any(-1)
    if ignore_index is not None:
        valid &= lab != ignore_index
    in_range = (lab >= -V) & (lab < V)
    lab = np.where(lab < 0, lab + V, lab)
    zk = np.where(keep, z, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = np.max(zk, -1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(zk - m)
        s = e.sum(-1)
        lse = m[..., 0] + np.log(s)
        z_l = np.take_along_axis(z, np.clip(lab, 0, V - 1)[..., None], -1)[..., 0]
        z_l = np.where(in_range, z_l, np.nan)
        n = keep.sum(-1)
        loss = (1 - label_smoothing) * (lse - z_l) + z_loss * lse ** 2
        if label_smoothing:  # Σ z is -inf with -inf logits: only then the loss is inf
            loss = loss + label_smoothing * (lse - np.where(keep, z, 0.0).sum(-1) / np.maximum(n, 1))
        p = e / s[..., None]
        onehot = (np.arange(V) == lab[..., None]) & in_range[..., None]
        g = (p * (1 + 2 * z_loss * lse)[..., None] - (1 - label_smoothing) * onehot
             - np.where(keep, label_smoothing / np.maximum(n, 1)[..., None], 0.0))
    wt = valid.astype(np.float64)
    if reduction == "mean":
        wt = wt / max(valid.sum(), 1)
    loss = np.where(valid, wt * np.where(valid, loss, 0.0), 0.0)
    g = np.where(valid[..., None], wt[..., None] * np.where(valid[..., None], g, 0.0), 0.0)
    if reduction == "none":
        ct = np.ones(lab.shape) if ct is None else np.asarray(ct, np.float64)
        return loss, g * ct[..., None]
    ct = 1.0 if ct is None else float(ct)
    return loss.sum(), g * ct


def rel_err(out, want):
    out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
    # an absolute floor: a loss of exactly 0 (one class) against a GPU's ~1e-8
    return np.linalg.norm(out - want) / max(np.linalg.norm(want), 1e-6 * np.sqrt(max(want.size, 1)))


def assert_close(name, out, want, tol):
    out, want = np.asarray(out, np.float64), np.asarray(want, np.float64)
    assert out.shape == want.shape, f"{name}: shape {out.shape} != {want.shape}"
    fin = np.isfinite(want)
    assert np.array_equal(np.isnan(out), np.isnan(want)), f"{name}: NaN where the reference has {np.isnan(want).sum()}"
    assert np.all(np.isfinite(out[fin])), f"{name}: non-finite outputs where the reference is finite"
    assert np.array_equal(out[~fin & ~np.isnan(want)], want[~fin & ~np.isnan(want)]), f"{name}: infinities differ"
    err = rel_err(np.where(fin, out, 0), np.where(fin, want, 0))
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@functools.lru_cache(maxsize=None)
def _runner(impl, options):
    """One jitted (loss, dlogits) function per implementation and options (shapes, where
    and ct are its arguments: repeated calls reuse its compilations)."""
    kw = dict(options)

    def f(x, labels, where, ct):
        loss, vjp = jax.vjp(lambda x: ce(x, labels, impl, where=where, **kw), x)
        return loss, vjp(jnp.ones(loss.shape, jnp.float32) if ct is None else ct)[0]
    return jax.jit(f)


def run(x, labels, impl, ct=None, **kw):
    """(loss, dlogits) of our op under jit: jax.vjp with cotangent ct (ones by default)."""
    where = kw.pop("where", None)
    return _runner(impl, tuple(sorted(kw.items())))(
        x, labels, where, None if ct is None else jnp.asarray(ct, jnp.float32))


def check(name, x, labels, impl, ct=None, **kw):
    loss, g = run(x, labels, impl, ct, **kw)
    rl, rg = ref(x, labels, ct=ct, **kw)
    assert_close(f"{name} loss", loss, rl, LOSS_TOL)
    assert g.dtype == x.dtype
    assert_close(f"{name} dlogits", g, rg, GRAD_TOL[jnp.dtype(x.dtype).name])
    return loss, g


def optax_ce(x, labels, **kw):
    import optax
    return optax.softmax_cross_entropy_with_integer_labels(x, labels, **kw)


# ------------------------------------------------------------------ optax ---

VOCABS = (1, 2, 3, 31, 33, 127, 1000, 1031, 4100)
PALLAS_VOCABS = (1, 3, 33, 1031, 4100)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", VOCABS)
def test_matches_optax(V, dtype, impl):
    """reduction="none" equals optax (on the same logits in float32), loss and gradient
    with a random per-example cotangent; every vocabulary size, multiples of the 16-byte
    pack or not."""
    need(impl)
    if impl == "pallas" and V not in PALLAS_VOCABS:
        pytest.skip("Pallas interpreter: a subset of the sizes")
    rng = np.random.default_rng(seed_of(f"optax{V}{dtype}"))
    rows = 3 if impl == "pallas" else 7
    x = make_logits(rng, (rows, V), dtype)
    labels = make_labels(rng, (rows,), V)
    ct = jnp.asarray(rng.standard_normal(rows), jnp.float32)
    xf = x.astype(jnp.float32)
    want, vjp = jax.vjp(lambda x: optax_ce(x, labels), xf)
    loss, g = run(x, labels, impl, ct)
    assert loss.dtype == jnp.float32 and loss.shape == (rows,)
    if V == 1:  # loss = lse - x = 0 up to the rounding of x itself (GPU: ~1e-7 |x|)
        bound = 4 * np.finfo(np.float32).eps * max(1.0, float(jnp.abs(xf).max()))
        assert float(jnp.abs(loss - want).max()) <= bound
    else:
        assert_close("loss vs optax", loss, want, LOSS_TOL)
    assert_close("dlogits vs optax", g, vjp(ct)[0], GRAD_TOL[dtype])
    if V > 1:  # one class: the loss is 0 up to rounding, checked above
        check("reference", x, labels, impl, ct)


@pytest.mark.parametrize("impl", IMPLS)
def test_optax_where_and_axis(impl):
    """optax's where (per example, per class, with a masked label, with a row of no
    kept class) and axis (non-last, tuple) conventions, values and gradients."""
    need(impl)
    import optax
    rng = np.random.default_rng(seed_of("where_axis"))
    x = make_logits(rng, (2, 3, 11))
    labels = make_labels(rng, (2, 3), 11)
    w_row = jnp.asarray(rng.random((2, 3)) > 0.3).at[0, 0].set(False)
    w_el = jnp.asarray(rng.random((2, 3, 11)) > 0.4)
    w_el = w_el.at[1, 2].set(False)                       # no class kept: loss 0
    w_el = w_el.at[0, 1, labels[0, 1]].set(False)         # the label itself masked
    cases = [
        (x, labels, dict()),
        (x, labels, dict(where=w_row)),
        (x, labels, dict(where=w_el)),
        (x, labels, dict(where=w_row[..., None])),        # logits' rank, size 1: per example
        (jnp.moveaxis(x, -1, 0), labels, dict(axis=0)),
        (jnp.moveaxis(x, -1, 1), labels, dict(axis=1, where=jnp.moveaxis(w_el, -1, 1))),
        (x.reshape(2, 3, 11, 1), labels, dict(axis=(2, 3))),
        (x, jnp.asarray(rng.integers(0, 6, (11,)), jnp.int32), dict(axis=(0, 1))),
        (x, jnp.asarray(rng.integers(0, 6, (11,)), jnp.int32), dict(axis=(1, 0), where=w_el)),
        (x.reshape(2, 3, 11), labels, dict(axis=(-1,))),
    ]
    for i, (xi, li, kw) in enumerate(cases):
        ct = jnp.asarray(rng.standard_normal(li.shape), jnp.float32)
        want, vjp = jax.vjp(lambda x: optax.softmax_cross_entropy_with_integer_labels(x, li, **kw), xi)
        loss, g = run(xi, li, impl, ct, **kw)
        assert_close(f"case {i} loss", loss, want, LOSS_TOL)
        assert_close(f"case {i} dlogits", g, vjp(ct)[0], GRAD_TOL["float32"])
    # the where=all-False example: loss and gradient exactly 0
    loss, g = run(x, labels, impl, where=w_el)
    assert float(loss[1, 2]) == 0.0 and not np.any(np.asarray(g[1, 2]))


@pytest.mark.parametrize("impl", IMPLS)
def test_label_conventions(impl):
    """Negative labels count from the end, out-of-range labels give NaN (optax's gather);
    any integer dtype."""
    need(impl)
    rng = np.random.default_rng(seed_of("labels"))
    V = 10
    x = make_logits(rng, (6, V))
    raw = np.array([-1, -10, 9, 10, -11, 3])
    want, vjp = jax.vjp(lambda x: optax_ce(x, jnp.asarray(raw)), x)
    loss, g = run(x, jnp.asarray(raw, jnp.int32), impl)
    assert_close("loss", loss, want, LOSS_TOL)
    assert_close("dlogits", g, vjp(jnp.ones(6))[0], GRAD_TOL["float32"])
    ok = np.array([0, 1, 2, 5])
    for dt in (jnp.int8, jnp.uint8, jnp.int16, jnp.uint16, jnp.uint32):
        lab = np.where(raw < 0, raw + V, raw)[ok].astype(np.int64)
        out = ce(x[ok], jnp.asarray(lab).astype(dt), impl)
        assert_close(f"{jnp.dtype(dt).name}", out, want[ok], LOSS_TOL)
    big = ce(x[:2], jnp.asarray([2**31 + 1, 3], jnp.uint32), impl)  # not a negative int32
    assert np.isnan(big[0]) and np.isfinite(big[1])


# ---------------------------------------------------------------- options ---

OPTION_CASES = {
    "smooth": dict(label_smoothing=0.1),
    "smooth_all": dict(label_smoothing=1.0),
    "z_loss": dict(z_loss=1e-2),
    "smooth_z": dict(label_smoothing=0.2, z_loss=1e-3),
    "mean": dict(reduction="mean"),
    "sum": dict(reduction="sum"),
    "ignore": dict(ignore_index=-100),
    "ignore_mean_smooth_z": dict(ignore_index=-100, reduction="mean", label_smoothing=0.1, z_loss=1e-4),
    "where_row_mean": dict(where="row", reduction="mean"),
    "where_class_smooth": dict(where="class", label_smoothing=0.3, z_loss=1e-3),
    "where_class_bcast_sum": dict(where="vocab", reduction="sum", label_smoothing=0.1),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # float16: test_matches_optax, extremes
@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_options(case, dtype, impl):
    need(impl)
    kw = dict(OPTION_CASES[case])
    rng = np.random.default_rng(seed_of(case + dtype))
    V = 37 if impl == "pallas" else 300
    x = make_logits(rng, (3, 4, V), dtype)
    labels = make_labels(rng, (3, 4), V)
    if "ignore_index" in kw:
        labels = labels.at[0, 1].set(-100).at[2, 3].set(-100)
    where = kw.pop("where", None)
    if where == "row":
        kw["where"] = jnp.asarray(rng.random((3, 4)) > 0.3)
    elif where == "class":
        kw["where"] = jnp.asarray(rng.random((3, 4, V)) > 0.3).at[1, 1].set(False)
    elif where == "vocab":  # a padded vocabulary: one row of classes for every example
        kw["where"] = jnp.asarray(np.arange(V) < V - 5)[None, None]
    ct = rng.standard_normal((3, 4)) if kw.get("reduction", "none") == "none" else 0.7
    check(case, x, labels, impl, ct, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_ignore_index_at_every_position(reduction, impl):
    need(impl)
    rng = np.random.default_rng(seed_of("ignore" + reduction))
    x = make_logits(rng, (6, 40))
    labels = make_labels(rng, (6,), 40)
    for i in range(6):
        lab = labels.at[i].set(-100)
        loss, g = check(f"ignore {i}", x, lab, impl, ignore_index=-100, reduction=reduction)
        assert not np.any(np.asarray(g[i]))
        if reduction == "none":
            assert float(loss[i]) == 0.0
    # an ignored label that is also a valid class index
    check("ignore 0", x, labels.at[2].set(0), impl, ignore_index=0, reduction=reduction)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_everything_ignored_gives_zero_not_nan(reduction, impl):
    need(impl)
    rng = np.random.default_rng(seed_of("allignored"))
    x = make_logits(rng, (4, 33), "bfloat16")
    x = x.at[0, 3].set(jnp.nan).at[1].set(-jnp.inf)  # garbage in ignored rows changes nothing
    labels = make_labels(rng, (4,), 33)
    for kw in (dict(ignore_index=7, labels=jnp.full((4,), 7, jnp.int32)),
               dict(where=jnp.zeros((4,), bool)),
               dict(where=jnp.zeros((4, 33), bool))):
        lab = kw.pop("labels", labels)
        loss, g = run(x, lab, impl, reduction=reduction, **kw)
        assert not np.any(np.isnan(np.asarray(loss, np.float32)))
        assert not np.any(np.asarray(loss)) and not np.any(np.asarray(g, np.float32))
    loss, g = run(x[:0], labels[:0], impl, reduction=reduction)  # no examples at all
    assert float(jnp.sum(loss)) == 0.0 and g.shape == (0, 33)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_logits(dtype, impl):
    """±1e4 (±6e4 in float16), -inf entries, a row of -inf but its label: finite losses
    and gradients where optax's are, equal to the reference."""
    need(impl)
    rng = np.random.default_rng(seed_of("extreme" + dtype))
    big = 6e4 if dtype == "float16" else 1e4
    V = 45
    x = np.array(make_logits(rng, (6, V), "float32"))
    labels = np.array(make_labels(rng, (6,), V))
    x[0, :] = big * np.sign(rng.standard_normal(V))
    x[1, labels[1]] = -big                                    # the label far below the max
    x[2, (labels[2] + 1) % V] = big
    x[3, ::3] = -np.inf
    x[3, labels[3]] = 1.0
    x[4, :] = -np.inf
    x[4, labels[4]] = 0.5                                     # only the label is finite
    x[5, :] = -big
    x = jnp.asarray(x, dtype)
    labels = jnp.asarray(labels)
    for kw in (dict(), dict(z_loss=1e-4), dict(reduction="mean")):
        want = optax_ce(x.astype(jnp.float32), labels)
        loss, g = check(f"extreme {kw}", x, labels, impl, **kw)
        assert np.all(np.isfinite(np.asarray(want)))
        assert np.all(np.isfinite(np.asarray(loss))) and np.all(np.isfinite(np.asarray(g, np.float32)))


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_logit_poisons_its_row_only(impl):
    need(impl)
    rng = np.random.default_rng(seed_of("nan"))
    x = make_logits(rng, (3, 20)).at[1, 4].set(jnp.nan)
    labels = make_labels(rng, (3,), 20)
    loss, g = run(x, labels, impl)
    assert np.isnan(loss[1]) and np.all(np.isnan(np.asarray(g[1])))
    assert np.all(np.isfinite(np.asarray(loss[::2]))) and np.all(np.isfinite(np.asarray(g[::2])))


@pytest.mark.parametrize("impl", ["xla", "cuda"])
@pytest.mark.parametrize("V", [50257, 262144])
def test_large_vocabulary(V, impl):
    """LM vocabularies (GPT-2's odd 50257; 262144), bf16, a mean with ignored tokens."""
    need(impl)
    rng = np.random.default_rng(seed_of(f"large{V}"))
    x = make_logits(rng, (3, V), "bfloat16")
    labels = make_labels(rng, (3,), V).at[1].set(-100)
    check("large", x, labels, impl, ignore_index=-100, reduction="mean", label_smoothing=0.1)


@pytest.mark.parametrize("impl", IMPLS)
def test_pallas_long_rows_tile_path(impl):
    """Rows longer than one Pallas tile (online pass + second pass), float32."""
    need(impl)
    rng = np.random.default_rng(seed_of("tiles"))
    V = 2 * pallas_ce.MAX_BLOCK_V + 7
    x = make_logits(rng, (2, V))
    labels = make_labels(rng, (2,), V)
    check("tiles", x, labels, impl, jnp.asarray([0.5, -2.0]), label_smoothing=0.1, z_loss=1e-3,
          where=jnp.asarray(rng.random((1, V)) > 0.2))


# ---------------------------------------------------------- shapes, jax API ---

@pytest.mark.parametrize("impl", IMPLS)
def test_shapes(impl):
    """Rank 1 (one example), one row, leading axes, and empty batches."""
    need(impl)
    rng = np.random.default_rng(seed_of("shapes"))
    x1 = make_logits(rng, (9,))
    loss, g = check("rank1", x1, jnp.int32(4), impl)
    assert loss.shape == () and g.shape == (9,)
    check("one row", make_logits(rng, (1, 9)), jnp.asarray([8]), impl)
    check("leading", make_logits(rng, (2, 3, 5)), make_labels(rng, (2, 3), 5), impl,
          reduction="mean")
    for shape in ((0, 9), (2, 0, 9)):
        x = jnp.zeros(shape)
        loss, g = run(x, jnp.zeros(shape[:-1], jnp.int32), impl)
        assert loss.shape == shape[:-1] and g.shape == shape and loss.dtype == jnp.float32
        assert float(ce(x, jnp.zeros(shape[:-1], jnp.int32), impl, reduction="mean")) == 0.0


@pytest.mark.parametrize("impl", IMPLS)
def test_check_grads(impl):
    """First and second order, forward and reverse mode, by finite differences."""
    need(impl)
    rng = np.random.default_rng(seed_of("check_grads"))
    x = make_logits(rng, (3, 7), spread=1.0).astype(jnp.float32)
    labels = make_labels(rng, (3,), 7)
    w = jnp.asarray(rng.random((3, 7)) > 0.3).at[:, 0].set(True)
    for kw in (dict(), dict(reduction="mean", label_smoothing=0.2, z_loss=0.05),
               dict(where=w, label_smoothing=0.1)):
        f = lambda x: jnp.sum(jnp.sin(ce(x, labels, impl, **kw)))  # noqa: E731
        check_grads(f, (x,), order=2, modes=("fwd", "rev"), atol=2e-2, rtol=2e-2, eps=1e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_vmap_and_grad_of_vmap(impl):
    need(impl)
    rng = np.random.default_rng(seed_of("vmap"))
    x = make_logits(rng, (3, 4, 21), "bfloat16")
    labels = make_labels(rng, (3, 4), 21)
    where = jnp.asarray(rng.random((1, 21)) > 0.2)  # logits' rank: per class

    def f(x, labels, where):
        return ce(x, labels, impl, where=where, reduction="mean", label_smoothing=0.1)
    loop = jnp.stack([f(x[i], labels[i], where) for i in range(3)])
    vm = jax.jit(jax.vmap(f, in_axes=(0, 0, None)))(x, labels, where)
    np.testing.assert_allclose(np.asarray(vm), np.asarray(loop), rtol=1e-6)  # XLA fuses differently
    vm_t = jax.vmap(f, in_axes=(1, 1, None))(jnp.swapaxes(x, 0, 1), labels.T, where)
    np.testing.assert_allclose(np.asarray(vm_t), np.asarray(loop), rtol=1e-6)
    g = jax.jit(jax.grad(lambda x: jnp.sum(jax.vmap(f, in_axes=(0, 0, None))(x, labels, where) ** 2)))(x)
    g_loop = jnp.stack([jax.grad(lambda x: f(x, labels[i], where) ** 2)(x[i]) for i in range(3)])
    assert_close("grad(vmap)", g, g_loop, GRAD_TOL["bfloat16"])
    # per-example where under vmap (batched mask)
    wb = jnp.asarray(rng.random((3, 4, 21)) > 0.3)
    vm = jax.vmap(lambda x, l, w: ce(x, l, impl, where=w))(x, labels, wb)
    assert_close("vmap where", vm, ref(x, labels, where=wb)[0], LOSS_TOL)
    v, g = jax.jit(jax.value_and_grad(lambda x: ce(x, labels, impl, reduction="sum")))(x)
    rl, rg = ref(x, labels, reduction="sum")
    assert_close("jit value", v, rl, LOSS_TOL)
    assert_close("jit grad", g, rg, GRAD_TOL["bfloat16"])


def test_reverse_mode_runs_the_backward_stage():
    """grad is the training forward (dlogits in the same pass) plus the backward stage;
    the jnp tangent map only serves forward mode."""
    x, labels = jnp.ones((4, 8)), jnp.zeros((4,), jnp.int32)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: jax_ops.cross_entropy(x, labels, reduction="mean")))(x))
    assert "jax_ops_ce_bwd" in jaxpr and "with_grad=True" in jaxpr and "tangent" not in jaxpr
    jvp = str(jax.make_jaxpr(lambda x, t: jax.jvp(lambda x: jax_ops.cross_entropy(x, labels), (x,), (t,)))(x, x))
    assert "jax_ops_ce_fwd_tangent" in jvp and "jax_ops_ce_bwd" not in jvp
    fwd = str(jax.make_jaxpr(lambda x: jax_ops.cross_entropy(x, labels))(x))
    assert "with_grad=False" in fwd and "jax_ops_ce_bwd" not in fwd


@pytest.mark.parametrize("impl", IMPLS)
def test_lowering_uses_the_chosen_implementation_and_aliases_the_backward(impl):
    """"cuda" lowers to our FFI custom calls, the backward writing in place (its result
    aliases dlogits); the others lower to neither."""
    need(impl)
    x, labels = make_logits(np.random.default_rng(1), (4, 16)), jnp.arange(4, dtype=jnp.int32)
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(ce(x, labels, impl))))
    text = jax.jit(grad).lower(x).as_text()
    for target in (FWD_TARGET, BWD_TARGET):
        found = re.search(rf"custom_call\s*@{target}\b", text) is not None
        assert found == (impl == "cuda"), f"custom_call @{target} in lowering: {found}"
    if impl == "cuda" or (impl == "pallas" and PLATFORM == "cuda"):
        assert "output_operand_alias" in text
    decisions = jax_ops.explain(grad, x)
    assert [(d.query.stage, d.implementation) for d in decisions] == [("fwd", impl), ("bwd", impl)], decisions
    assert decisions[0].query.variant == "grad"


@pytest.mark.parametrize("impl", IMPLS)
def test_backward_keeps_the_residual_and_skips_unit_rows(impl):
    """The in-place backward never changes a residual the caller still holds (a vjp
    function called twice), scales rows with g != 1 and leaves g == 1 rows as the
    forward wrote them."""
    need(impl)
    rng = np.random.default_rng(seed_of("inplace"))
    x = make_logits(rng, (5, 19), "bfloat16")
    labels = make_labels(rng, (5,), 19)
    loss, vjp = jax.vjp(lambda x: ce(x, labels, impl), x)
    ones = vjp(jnp.ones(5))[0]
    ct = jnp.asarray([1.0, 2.0, 1.0, -0.5, 0.0])
    g1 = vjp(ct)[0]
    g2 = vjp(ct)[0]
    np.testing.assert_array_equal(np.asarray(g1, np.float32), np.asarray(g2, np.float32))
    np.testing.assert_array_equal(np.asarray(vjp(jnp.ones(5))[0], np.float32), np.asarray(ones, np.float32))
    np.testing.assert_array_equal(np.asarray(g1[::2][:2], np.float32), np.asarray(ones[::2][:2], np.float32))
    assert_close("scaled", g1, ref(x, labels, ct=ct)[1], GRAD_TOL["bfloat16"])
    jitted = jax.jit(lambda x, ct: jax.vjp(lambda x: ce(x, labels, impl), x)[1](ct)[0])
    np.testing.assert_array_equal(np.asarray(jitted(x, ct), np.float32), np.asarray(g1, np.float32))


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic(impl):
    need(impl)
    rng = np.random.default_rng(seed_of("det"))
    x = make_logits(rng, (6, 1500 if impl != "pallas" else 300), "bfloat16")
    labels = make_labels(rng, (6,), x.shape[-1])
    f = lambda x: jax.value_and_grad(lambda x: ce(x, labels, impl, reduction="mean", label_smoothing=0.1))(x)  # noqa: E731
    a, b = jax.jit(f)(x), jax.jit(lambda x: f(x))(x)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(u).tobytes() == np.asarray(v).tobytes()


def test_automatic_choice_and_use():
    x, labels = jnp.ones((4, 8)), jnp.zeros((4,), jnp.int32)
    d = jax_ops.explain(lambda x: jax_ops.cross_entropy(x, labels), x)
    assert d[0].implementation == ("cuda" if PLATFORM == "cuda" and "cuda" in support.available(OP) else "xla")
    with jax_ops.use(cross_entropy="xla"):
        d = jax_ops.explain(lambda x: jax_ops.cross_entropy(x, labels), x)
    assert d[0].implementation == "xla"
    assert set(jax_ops.implementations(OP)) >= set(IMPLS)


@pytest.mark.parametrize("impl", [None, "cuda"], ids=["auto", "cuda"])
def test_export_symbolic_batch(impl):
    need(impl)
    pytest.importorskip("flatbuffers")
    from jax import export
    b = export.symbolic_shape("b")[0]

    def f(x, labels):
        return ce(x, labels, impl, reduction="mean", ignore_index=-1, label_smoothing=0.1)
    g = jax.value_and_grad(f)
    exp = jax_ops.export(g, jax.ShapeDtypeStruct((b, 24), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32))
    if impl == "cuda":
        assert "jax_ops_ce_" in exp.mlir_module()
    back = export.deserialize(exp.serialize())
    rng = np.random.default_rng(3)
    for n in (1, 3, 8):
        x, labels = make_logits(rng, (n, 24)), make_labels(rng, (n,), 24).at[0].set(-1)
        for u, v in zip(jax.tree.leaves(back.call(x, labels)), jax.tree.leaves(jax.jit(g)(x, labels))):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-6, atol=1e-7)


# -------------------------------------------------------------- bad input ---

X = jnp.ones((2, 5))
L = jnp.zeros((2,), jnp.int32)
BAD = [
    ("logits_int", dict(logits=jnp.ones((2, 5), jnp.int32)), TypeError, r"logits must be float32.*int32"),
    ("logits_scalar", dict(logits=jnp.float32(1)), ValueError, r"at least 1 dimension.*\(\)"),
    ("labels_float", dict(labels=jnp.zeros((2,))), TypeError, r"labels must have an integer dtype.*float32"),
    ("labels_shape", dict(labels=jnp.zeros((3,), jnp.int32)), ValueError, r"labels must have shape \(2,\).*\(3,\)"),
    ("labels_bcast", dict(labels=jnp.zeros((1,), jnp.int32)), ValueError, r"labels must have shape \(2,\).*\(1,\)"),
    ("no_classes", dict(logits=jnp.ones((2, 0))), ValueError, r"at least one class"),
    ("axis_range", dict(axis=2), ValueError, r"axis 2 is out of range.*rank 2"),
    ("axis_type", dict(axis=1.0), TypeError, r"axis must be an int"),
    ("axis_repeat", dict(axis=(1, -1)), ValueError, r"distinct"),
    ("where_dtype", dict(where=jnp.ones((2,), jnp.int32)), TypeError, r"where must be a bool array.*int32"),
    ("where_shape", dict(where=jnp.ones((3,), bool)), ValueError, r"where must broadcast.*\(2,\).*\(2, 5\).*\(3,\)"),
    ("smoothing_range", dict(label_smoothing=1.5), ValueError, r"label_smoothing must be in \[0.0, 1.0\]; got 1.5"),
    ("smoothing_type", dict(label_smoothing="0.1"), TypeError, r"label_smoothing must be a real number"),
    ("z_loss_negative", dict(z_loss=-1.0), ValueError, r"z_loss must be finite and >= 0.0; got -1.0"),
    ("z_loss_nan", dict(z_loss=float("nan")), ValueError, r"z_loss must be finite"),
    ("reduction", dict(reduction="avg"), ValueError, r"reduction must be one of .*'avg'"),
    ("ignore_type", dict(ignore_index=1.0), TypeError, r"ignore_index must be an int or None; got float"),
    ("implementation", dict(implementation="nope"), ValueError, r"unknown implementation='nope'"),
]


@pytest.mark.parametrize("name,kw,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_before_anything_runs(name, kw, exc, match):
    args = dict(kw)
    logits, labels = args.pop("logits", X), args.pop("labels", L)
    with pytest.raises(exc, match=match):
        jax_ops.cross_entropy(logits, labels, **args)
    with pytest.raises(exc, match=match):  # while tracing too
        jax.jit(lambda: jax_ops.cross_entropy(logits, labels, **args))()


def test_traced_options_rejected():
    with pytest.raises(TypeError, match="label_smoothing must be a concrete real number"):
        jax.jit(lambda s: jax_ops.cross_entropy(X, L, label_smoothing=s))(0.1)


def test_pallas_supports_and_configs():
    assert pallas_ce.supports(262144)[0]
    cfgs = pallas_ce.candidate_configs(16384, 50304, "fwd")
    assert cfgs[0] == pallas_ce.default_config(16384, 50304, "fwd") and len(cfgs) > 1
    assert all(c["block_v"] <= pallas_ce.MAX_BLOCK_V for c in cfgs)


def test_poisoned_donation_does_not_leak():
    """An ignored row's gradient is written (zeros), not left as whatever the output
    buffer held: the donated NaN buffer becomes dlogits' storage where XLA aliases it."""
    need("cuda")
    rng = np.random.default_rng(seed_of("poison"))
    x = make_logits(rng, (3, 50))
    labels = make_labels(rng, (3,), 50).at[1].set(-100)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        f = jax.jit(lambda p, x: jax.grad(lambda x: ce(x, labels, "cuda", ignore_index=-100,
                                                      reduction="mean"))(x),
                    donate_argnums=0, keep_unused=True)
        g = f(jnp.full(x.shape, jnp.nan), x)
    assert not np.any(np.asarray(g[1])) and np.all(np.isfinite(np.asarray(g)))


# --------------------------------------------------------------- sharding ---


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
@pytest.mark.parametrize("impl", ["xla", "cuda"])
@pytest.mark.parametrize("spec", [("a", None, None), (None, "a", "b"), ("a", None, "b"), (None, None, "a")],
                         ids=["batch", "seq_vocab", "batch_vocab", "vocab"])
def test_sharded_equals_unsharded(spec, impl):
    """Batch axes sharded: the kernels run per device; the vocabulary sharded (tensor
    parallel): O(rows) all-reduces of the row statistics, no gathered logits."""
    need(impl)
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((4, 2), ("a", "b"), devices=jax.devices()[:8])
    rng = np.random.default_rng(seed_of(f"shard{spec}"))
    x = make_logits(rng, (4, 8, 64))
    labels = make_labels(rng, (4, 8), 64).at[1, 2].set(-100)
    where = jnp.asarray(rng.random((1, 1, 64)) > 0.1)
    kw = dict(ignore_index=-100, label_smoothing=0.1, z_loss=1e-3, where=where)

    def f(x, labels):
        return jax.value_and_grad(lambda x: ce(x, labels, impl, reduction="mean", **kw))(x)

    def g(x, labels):  # "none" with a non-unit cotangent
        return jax.vjp(lambda x: ce(x, labels, impl, **kw), x)[1](jnp.cos(labels.astype(jnp.float32)))[0]
    xs = jax.device_put(x, NamedSharding(mesh, P(*spec)))
    ls = jax.device_put(labels, NamedSharding(mesh, P(*spec[:2])))
    want, got = jax.jit(f)(x, labels), jax.jit(f)(xs, ls)
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-6, atol=1e-8)
    np.testing.assert_allclose(np.asarray(jax.jit(g)(xs, ls)), np.asarray(jax.jit(g)(x, labels)),
                               rtol=2e-6, atol=1e-8)
    # O(rows): all-reduces of per-row values; with the kernels' stages one all_gather of
    # every vocabulary device's 5 statistics a row (the logits are 2048 elements)
    vocab_devices = mesh.shape[spec[2]] if spec[2] else 1
    for kind, sizes in support.collectives(f, xs, ls):
        assert (kind == "all-reduce" and all(n <= 32 for n in sizes)) or (
            kind == "all-gather" and impl == "cuda" and all(n <= 5 * 32 * vocab_devices for n in sizes)), (kind, sizes)
    if vocab_devices > 1:
        # the forward alone (its own branch: statistics merged, no dlogits) with a NaN
        # logit, no options (label smoothing's Σz would make the row NaN anyway): NaN as on
        # one device (a shard's max skips the NaN its Σ exp keeps)
        xn = x.at[0, 1, 5].set(jnp.nan)

        def fwd(x, labels):
            return ce(x, labels, impl)
        xns = jax.device_put(xn, NamedSharding(mesh, P(*spec)))
        np.testing.assert_allclose(np.asarray(jax.jit(fwd)(xns, ls)), np.asarray(jax.jit(fwd)(xn, labels)),
                                   rtol=2e-6, atol=1e-8)
        assert np.isnan(np.asarray(jax.jit(fwd)(xns, ls))[0, 1])
        text = jax.jit(f).lower(xs, ls).compile().as_text()
        for target in ("jax_ops_ce_partials", "jax_ops_ce_apply"):
            assert (f'custom_call_target="{target}"' in text) == (impl == "cuda"), target


@pytest.mark.parametrize("impl", ["xla", "cuda"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("options", ["plain", "smoothing_zloss_mask"])
@pytest.mark.parametrize("V,shards", [(64, 2), (99, 3), (4100, 2)])
def test_vocab_stages_equal_one_device(V, shards, options, dtype, impl):
    """The vocabulary-sharded stages on column shards of the logits (as each device runs
    them): PARTIALS per shard with its local labels, the merge, APPLY per shard, against
    the one-device forward with the gradient: the same loss, lse and dlogits (labels out
    of range, ignored rows (weight 0), -inf logits, a row whose kept logits are all
    -inf, a class mask)."""
    need(impl)
    from jax_ops.ops.cross_entropy import APPLY, FWD, PARTIALS, merge_stat_parts
    rng = np.random.default_rng(seed_of(f"vstages{V}{shards}{options}{dtype}{impl}"))
    x = np.array(make_logits(rng, (3, 5, V), "float32"))
    x[0, 1, ::7] = -np.inf
    masked = options != "plain"
    mask = None
    if masked:
        mask = jnp.asarray(rng.random((1, 1, V)) > 0.2)
        x[1, 2, np.asarray(mask)[0, 0]] = -np.inf  # every kept logit -inf
    x = jnp.asarray(x, dtype)
    labels = make_labels(rng, (3, 5), V).at[0, 0].set(V).at[2, 4].set(V - 1).at[1, 0].set(0)
    weight = jnp.asarray(rng.random((3, 5)) > 0.2, jnp.float32) * 0.5
    kw = dict(label_smoothing=0.1 if masked else 0.0, z_loss=1e-3 if masked else 0.0)
    loss, lse, d = FWD.call(x, labels, weight, mask, with_grad=True, implementation=impl, **kw)
    k = V // shards
    cut = [(i * k, (i + 1) * k) for i in range(shards)]
    local = [(labels - c0).astype(jnp.int32) for c0, _ in cut]
    pieces = [(x[..., c0:c1], None if mask is None else mask[..., c0:c1]) for c0, c1 in cut]
    parts = [PARTIALS.call(xs, lab, ms, implementation=impl)[0] for (xs, ms), lab in zip(pieces, local)]
    stats = merge_stat_parts(jnp.stack(parts), labels, V)
    outs = [APPLY.call(xs, lab, weight, ms, stats, implementation=impl, **kw)
            for (xs, ms), lab in zip(pieces, local)]
    for got_loss, got_lse, _ in outs:
        np.testing.assert_allclose(np.asarray(got_loss), np.asarray(loss), rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got_lse), np.asarray(lse), rtol=2e-5, atol=1e-6)
    got_d = np.concatenate([np.asarray(o[2], np.float32) for o in outs], axis=-1)
    tol = 1e-5 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(got_d, np.asarray(d, np.float32), rtol=tol, atol=tol * 1e-2)
    # and the float64 reference of the public semantics, for the rows that count
    want_loss, want_g = ref(np.asarray(x, np.float64), labels, where=None if mask is None else mask, **kw)
    live = (np.asarray(weight) > 0) & np.isfinite(want_loss)
    np.testing.assert_allclose(np.asarray(outs[0][0])[live], 0.5 * want_loss[live], rtol=1e-4 if dtype == "float32" else 1e-2)


# --------------------------------------------------- linear_cross_entropy ---

LCE = "linear_cross_entropy"


def lce_ref(h, w, labels, *, bias=None, transposed_w=False, ct=None, **kw):
    """(loss, dh, dw, dbias) in float64 from the float64 logits h @ w + bias."""
    h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
    wm = w64.T if transposed_w else w64
    logits = h64 @ wm + (0.0 if bias is None else np.asarray(bias, np.float64))
    loss, g = ref(logits, labels, ct=ct, **kw)
    dh = g @ wm.T
    dwm = h64.reshape(-1, h64.shape[-1]).T @ g.reshape(-1, g.shape[-1])
    return loss, dh, (dwm.T if transposed_w else dwm), (None if bias is None else g.reshape(-1, g.shape[-1]).sum(0))


def run_lce(h, w, labels, impl, ct=None, bias=None, **kw):
    def f(h, w, bias):
        return jax_ops.linear_cross_entropy(h, w, labels, bias=bias, implementation=impl, **kw)
    loss, vjp = jax.vjp(f, h, w, bias)
    ct = jnp.ones(loss.shape, jnp.float32) if ct is None else jnp.asarray(ct, jnp.float32)
    return (loss,) + tuple(vjp(ct))


LCE_CASES = {
    "mean": dict(reduction="mean"),
    "sum_bias_transposed": dict(reduction="sum", bias=True, transposed_w=True),
    "none_options": dict(label_smoothing=0.1, z_loss=1e-3, ignore_index=-100),
    "mean_where_class": dict(reduction="mean", where="class", bias=True),
    "none_where_row_transposed": dict(where="row", transposed_w=True),
}


@pytest.fixture
def highest_precision():
    """float32 matmuls in float32 (a GPU's default is TF32) for the float64 comparisons."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.usefixtures("highest_precision")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(LCE_CASES))
def test_linear_cross_entropy(case, dtype, impl):
    """Loss and gradients of h, w, bias against float64, over several chunks with a
    padded last one (37 rows in chunks of 8)."""
    need(impl)
    kw = dict(LCE_CASES[case])
    rng = np.random.default_rng(seed_of("lce" + case + dtype))
    N, d, V = 37, 24, 67
    h = jnp.asarray(rng.standard_normal((N, d)), dtype)
    w = jnp.asarray(rng.standard_normal((V, d) if kw.get("transposed_w") else (d, V)) * 0.4, dtype)
    labels = make_labels(rng, (N,), V).at[5].set(-100).at[30].set(-100)
    bias = jnp.asarray(rng.standard_normal(V), jnp.float32) if kw.pop("bias", False) else None
    where = kw.pop("where", None)
    if where == "row":
        kw["where"] = jnp.asarray(rng.random(N) > 0.3)
    elif where == "class":
        kw["where"] = jnp.asarray(rng.random((1, V)) > 0.2)
    if "ignore_index" not in kw:
        labels = labels.at[5].set(1).at[30].set(2)
    ct = rng.standard_normal(N) if kw.get("reduction", "none") == "none" else 1.3
    loss, dh, dw, db = run_lce(h, w, labels, impl, ct, bias=bias, chunk_rows=8, **kw)
    rl, rdh, rdw, rdb = lce_ref(h, w, labels, bias=bias, ct=ct, **kw)
    # bfloat16: the logits are rounded to bfloat16 before the loss (as h @ w would be)
    tol = dict(loss=LOSS_TOL if dtype == "float32" else 1e-2, grad=GRAD_TOL[dtype] * 3)
    assert_close("loss", loss, rl, tol["loss"])
    assert dh.dtype == h.dtype and dw.dtype == w.dtype
    assert_close("dh", dh, rdh, tol["grad"])
    assert_close("dw", dw, rdw, tol["grad"])
    if bias is not None:
        assert db.dtype == bias.dtype
        assert_close("dbias", db, rdb, tol["grad"])


@pytest.mark.usefixtures("highest_precision")
@pytest.mark.parametrize("impl", ["xla", "cuda"])
def test_linear_cross_entropy_never_makes_the_logits(impl):
    """No array of the full logits' size in the gradient's jaxpr (only chunks); the
    default chunk and an explicit one agree; leading axes and all-ignored batches."""
    need(impl)
    rng = np.random.default_rng(seed_of("lce_chunks"))
    N, d, V = 256, 16, 96
    h = jnp.asarray(rng.standard_normal((4, N // 4, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((d, V)) * 0.3, jnp.float32)
    labels = make_labels(rng, (4, N // 4), V)

    def f(h, w, chunk=64):
        return jax_ops.linear_cross_entropy(h, w, labels, reduction="mean", chunk_rows=chunk,
                                            implementation=impl)
    jaxpr = jax.make_jaxpr(jax.grad(f, (0, 1)))(h, w)
    from jax_ops.core.calls import equations
    sizes = [np.prod(v.aval.shape) for e in equations(jaxpr.jaxpr) for v in e.outvars
             if hasattr(v.aval, "shape")]
    assert max(sizes) < N * V and 64 * V in sizes
    g1 = jax.grad(f, (0, 1))(h, w)
    g2 = jax.grad(lambda h, w: f(h, w, None), (0, 1))(h, w)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    rl, rdh, rdw, _ = lce_ref(h, w, labels, reduction="mean")
    assert_close("loss", f(h, w), rl, LOSS_TOL)
    assert_close("dh", g1[0], rdh, 1e-5)
    assert_close("dw", g1[1], rdw, 1e-5)
    loss, dh, dw, _ = run_lce(h, w, jnp.full(labels.shape, -1), impl, reduction="mean", ignore_index=-1)
    assert float(loss) == 0.0 and not np.any(np.asarray(dh)) and not np.any(np.asarray(dw))
    jitted = jax.jit(jax.value_and_grad(f, (0, 1)))(h, w)
    assert_close("jit loss", jitted[0], rl, LOSS_TOL)


LCE_BAD = [
    ("h_int", dict(h=jnp.ones((2, 4), jnp.int32)), TypeError, r"h must be float32.*int32"),
    ("w_shape", dict(w=jnp.ones((5, 7))), ValueError, r"w must have shape \(4, V\).*\(5, 7\)"),
    ("w_transposed", dict(w=jnp.ones((4, 7)), transposed_w=True), ValueError, r"w must have shape \(V, 4\)"),
    ("w_dtype", dict(w=jnp.ones((4, 7), jnp.bfloat16)), ValueError, r"h's dtype float32.*bfloat16"),
    ("bias_shape", dict(bias=jnp.ones((6,))), ValueError, r"bias must have shape \(7,\)"),
    ("labels_shape", dict(labels=jnp.zeros((3,), jnp.int32)), ValueError, r"labels must have shape \(2,\)"),
    ("where_shape", dict(where=jnp.ones((2, 6), bool)), ValueError, r"where must broadcast"),
    ("chunk", dict(chunk_rows=0), ValueError, r"chunk_rows must be a positive int"),
    ("smoothing", dict(label_smoothing=2.0), ValueError, r"linear_cross_entropy: label_smoothing"),
]


@pytest.mark.parametrize("name,kw,exc,match", LCE_BAD, ids=[b[0] for b in LCE_BAD])
def test_linear_cross_entropy_bad_input(name, kw, exc, match):
    args = dict(kw)
    h, w, labels = args.pop("h", jnp.ones((2, 4))), args.pop("w", jnp.ones((4, 7))), args.pop("labels", L)
    with pytest.raises(exc, match=match):
        jax_ops.linear_cross_entropy(h, w, labels, **args)


# ------------------------------------------- rewrite patterns (jax_ops.optimize) ---

def _ce_records(fn, *args):
    from jax_ops import fx
    return [r for r in fx.rewrites(fn, *args, policy="always") if r.pattern == "cross_entropy"]


def _lm_batch(dtype=jnp.bfloat16, b=2, t=9, v=37):
    logits = jax.random.normal(jax.random.key(5), (b, t, v), jnp.float32).astype(dtype)
    ids = jax.random.randint(jax.random.key(6), (b, t), 0, v)
    return logits, ids


def _optimized_agrees(fn, logits, ids):
    fast = jax_ops.optimize(fn, policy="always")
    grad_names = {e.primitive.name for e in jax.make_jaxpr(
        jax.grad(lambda l: jnp.sum(fast(l, ids))))(logits).eqns}
    assert {"jax_ops_ce_fwd", "jax_ops_ce_bwd"} <= grad_names, grad_names
    np.testing.assert_allclose(jax.jit(fast)(logits, ids), fn(logits, ids), rtol=1e-5, atol=1e-5)
    g1 = jax.grad(lambda l: jnp.sum(fast(l, ids)))(logits).astype(jnp.float32)
    g2 = jax.grad(lambda l: jnp.sum(fn(l, ids)))(logits).astype(jnp.float32)
    np.testing.assert_allclose(g1, g2, rtol=1e-2, atol=1e-2 * float(jnp.abs(g2).max()))


@pytest.mark.parametrize("upcast", [False, True])
def test_pattern_optax_lm_loss_shifted_mean(upcast):
    import optax

    def loss(logits, ids):
        x = logits[:, :-1]
        x = x.astype(jnp.float32) if upcast else x
        return optax.softmax_cross_entropy_with_integer_labels(x, ids[:, 1:]).mean()
    recs = _ce_records(loss, *_lm_batch())
    assert len(recs) == 1 and recs[0].replaced, recs
    assert recs[0].params == {"shift": True, "mean": True}
    _optimized_agrees(loss, *_lm_batch())


def test_pattern_hand_written_per_example():
    def loss(logits, ids):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, ids[..., None], axis=-1)[..., 0]
    recs = _ce_records(loss, *_lm_batch())
    assert len(recs) == 1 and recs[0].replaced and recs[0].params == {"shift": False, "mean": False}
    _optimized_agrees(loss, *_lm_batch())


def test_pattern_near_misses():
    import optax
    logits, ids = _lm_batch(jnp.float32)

    def shifted_other_end(logits, ids):   # logits[:, 1:]: not the rows [0, n)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, 1:], ids[:, 1:]).mean()
    recs = _ce_records(shifted_other_end, logits, ids)
    assert all(r.params.get("shift") is not True for r in recs if r.replaced), recs
    fast = jax_ops.optimize(shifted_other_end, policy="always")
    np.testing.assert_allclose(fast(logits, ids), shifted_other_end(logits, ids), rtol=1e-5)

    def normalizer_reused(logits, ids):  # log_softmax also returned: intermediate used twice
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, ids[..., None], axis=-1)[..., 0]
        return nll + 0 * logp.sum(-1)
    recs = _ce_records(normalizer_reused, logits, ids)
    assert recs and not any(r.replaced for r in recs) and "used elsewhere" in recs[0].reason

    def other_axis(logits, ids):  # log_softmax over the sequence axis
        logp = jax.nn.log_softmax(logits, axis=1)
        return -jnp.take_along_axis(logp, ids[..., None], axis=-1)[..., 0]
    assert not any(r.replaced for r in _ce_records(other_axis, logits, ids))


# ---------------------------- linear_cross_entropy pattern (jax_ops.optimize) ---
# The LM head feeding a cross-entropy: replaced by linear_cross_entropy (which wins over
# the cross_entropy pattern it contains); near misses keep the matmul and, where the
# cross-entropy itself still matches, get the cross_entropy pattern.

def _loss_records(fn, *args, policy="always", **kw):
    from jax_ops import fx
    return [r for r in fx.rewrites(fn, *args, policy=policy, **kw)
            if r.pattern in ("linear_cross_entropy", "cross_entropy")]


def _head_batch(dtype=jnp.float32, b=2, t=9, d=16, v=37, tied=False, seed=7):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (b, t, d), jnp.float32).astype(dtype)
    w = (jax.random.normal(k[1], (v, d) if tied else (d, v), jnp.float32) * 0.3).astype(dtype)
    bias = (jax.random.normal(k[2], (v,), jnp.float32) * 0.1).astype(dtype)
    ids = jax.random.randint(k[3], (b, t), 0, v)
    return h, w, bias, ids


def _optimized_like_original(fn, args, argnums, *, rtol=1e-6, grad_rtol=1e-5, policy="always", **kw):
    """optimize(fn) gives fn's value and gradients (float32 at highest precision)."""
    fast = jax_ops.optimize(fn, policy=policy, **kw)
    v1, g1 = jax.jit(jax.value_and_grad(fast, argnums))(*args)
    v2, g2 = jax.value_and_grad(fn, argnums)(*args)
    np.testing.assert_allclose(np.asarray(v1, np.float64), np.asarray(v2, np.float64), rtol=rtol, atol=rtol)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=grad_rtol, atol=grad_rtol * np.abs(b).max())
    return fast


def _ce_optax_shift_mean(logits, ids):
    import optax
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), ids[:, 1:]).mean()


def _ce_take_per_example(logits, ids):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, ids[..., None], axis=-1)[..., 0]


def _ce_take_mean_shift(logits, ids):  # as tests/test_fx_models.py writes GPT-2's loss
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()


def _flax_attend(h, w):
    import flax.linen as nn
    emb = nn.Embed(w.shape[0], w.shape[1])
    return emb.apply({"params": {"embedding": w}}, h, method=emb.attend)


def _flax_dense(h, w, b):
    import flax.linen as nn
    return nn.Dense(w.shape[1]).apply({"params": {"kernel": w, "bias": b}}, h)


# head form -> (logits from h, w, bias; w is (V, d); bias used; expected transposed_w)
LCE_HEADS = {
    "matmul": (lambda h, w, b: h @ w, False, False, False),
    "dot_bias": (lambda h, w, b: jnp.dot(h, w) + b, False, True, False),
    "tied_dot_T": (lambda h, w, b: jnp.dot(h, w.T), True, False, True),
    "tied_matmul_T_bias": (lambda h, w, b: h @ w.T + b, True, True, True),
    "tied_einsum": (lambda h, w, b: jnp.einsum("btd,vd->btv", h, w), True, False, True),
    "flax_embed_attend": (lambda h, w, b: _flax_attend(h, w), True, False, True),
    "flax_dense_bias": (lambda h, w, b: _flax_dense(h, w, b), False, True, False),
}
LCE_LOSSES = {"optax_shift_mean": (_ce_optax_shift_mean, dict(shift=True, mean=True)),
              "take_per_example": (_ce_take_per_example, dict(shift=False, mean=False)),
              "take_mean_shift": (_ce_take_mean_shift, dict(shift=True, mean=True))}


@pytest.mark.usefixtures("highest_precision")
@pytest.mark.parametrize("head,loss", [(h, l) for i, h in enumerate(LCE_HEADS)
                                       for j, l in enumerate(LCE_LOSSES) if (i + j) % 2 == 0 or h == "matmul"])
def test_lce_pattern_heads_and_losses(head, loss):
    """Each LM-head form x cross-entropy formulation: one linear_cross_entropy replacement
    (the cross_entropy pattern it contains is not reported: its equations are taken), the
    right transposed_w, and the original's loss and gradients of h, w, bias."""
    make, tied, uses_bias, transposed = LCE_HEADS[head]
    ce, params = LCE_LOSSES[loss]
    h, w, bias, ids = _head_batch(tied=tied)

    def fn(h, w, bias, ids):
        return ce(make(h, w, bias if uses_bias else None), ids)
    recs = _loss_records(fn, h, w, bias, ids)
    assert [r.pattern for r in recs] == ["linear_cross_entropy"] and recs[0].replaced, recs
    assert recs[0].params == {**params, "transposed_w": transposed}, recs[0]
    fast = jax_ops.optimize(fn, policy="always")
    names = {e.primitive.name for e in jax.make_jaxpr(fast)(h, w, bias, ids).eqns}
    assert "custom_vjp_call" in names and "dot_general" not in names, names  # the matmul: in the op
    per_example = not params["mean"]
    f = (lambda *a: jnp.sum(fn(*a) * jnp.arange(1.0, 1.0 + fn(*a).size).reshape(fn(*a).shape))
         ) if per_example else fn  # distinct cotangents: the op's "none" backward
    _optimized_like_original(f, (h, w, bias, ids), (0, 1, 2) if uses_bias else (0, 1))


@pytest.mark.usefixtures("highest_precision")
def test_lce_pattern_bfloat16_upcast_and_rank2():
    """bfloat16 h and w with the float32 upcast (Hugging Face's loss), and a 2-D h."""
    h, w, _, ids = _head_batch(jnp.bfloat16)

    def fn(h, w, ids):
        return _ce_optax_shift_mean(h @ w, ids)
    recs = _loss_records(fn, h, w, ids)
    assert len(recs) == 1 and recs[0].replaced and recs[0].pattern == "linear_cross_entropy", recs
    fast = jax_ops.optimize(fn, policy="always")
    np.testing.assert_allclose(float(jax.jit(fast)(h, w, ids)), float(fn(h, w, ids)), rtol=2e-3)
    g1 = jax.grad(fast, (0, 1))(h, w, ids)
    g2 = jax.grad(fn, (0, 1))(h, w, ids)
    for a, b in zip(g1, g2):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.dtype == b.dtype and np.abs(a - b).max() <= 2e-2 * np.abs(b).max()

    def flat(h2, w, ids2):  # (rows, d): no shift
        import optax
        return optax.softmax_cross_entropy_with_integer_labels(h2 @ w, ids2).mean()
    h2, ids2 = h.reshape(-1, h.shape[-1]).astype(jnp.float32), ids.reshape(-1)
    recs = _loss_records(flat, h2, w.astype(jnp.float32), ids2)
    assert [r.pattern for r in recs.__iter__() if r.replaced] == ["linear_cross_entropy"], recs
    _optimized_like_original(flat, (h2, w.astype(jnp.float32), ids2), (0, 1))


def _kept_lce(fn, *args, reason=None, ce_replaced=True):
    """linear_cross_entropy not replaced (its record, if any, says `reason`), the
    cross_entropy pattern replaced or not as said, and optimize(fn) still equal to fn."""
    recs = _loss_records(fn, *args)
    lce = [r for r in recs if r.pattern == "linear_cross_entropy"]
    assert not any(r.replaced for r in lce), recs
    if reason is not None:
        assert lce and reason in lce[0].reason, recs
    assert any(r.replaced and r.pattern == "cross_entropy" for r in recs) == ce_replaced, recs
    fast = jax_ops.optimize(fn, policy="always")
    out, ref = jax.tree.leaves(fast(*args)), jax.tree.leaves(fn(*args))
    for a, b in zip(out, ref):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)
    return recs


def test_lce_pattern_near_misses():
    """Each fails if matching is too lax: it would compute something else."""
    h, w, bias, ids = _head_batch()
    hi = jax.lax.Precision.HIGHEST

    def logits_also_returned(h, w, ids):  # a model returning logits and loss
        logits = h @ w
        return _ce_optax_shift_mean(logits, ids), logits
    _kept_lce(logits_also_returned, h, w, ids, reason="intermediate logits used elsewhere")

    def logits_used_twice(h, w, ids):
        logits = h @ w
        return _ce_optax_shift_mean(logits, ids) + 1e-3 * jnp.sum(logits ** 2)
    _kept_lce(logits_used_twice, h, w, ids, reason="intermediate logits used elsewhere")

    def other_contraction(h, w, ids):  # h is (b, d, t): its axis 1 is contracted
        return _ce_take_per_example(jnp.einsum("bdt,dv->btv", h, w), ids)
    h_bdt = jnp.swapaxes(h, 1, 2)[:, :, :8]  # d=16 > t=8: no shift either
    _kept_lce(other_contraction, h_bdt, w, ids[:, :8], reason="contracts axes (1,)")

    def logits_transposed(h, w, ids):  # (wᵀ hᵀ)ᵀ: the matmul's result is transposed
        return _ce_take_per_example((w.T @ h[0].T).T, ids[0])
    _kept_lce(logits_transposed, h, w, ids)

    def bias_on_rows(h, w, b, ids):  # a bias per row (square logits): not a (V,) bias
        return _ce_take_per_example(h[0, :, :] @ w[:, :9] + b[:9, None], ids[0] % 9)
    _kept_lce(bias_on_rows, h, w, bias, ids)

    def scaled(h, w, ids):  # logits * 0.5 between the matmul and the loss
        return _ce_optax_shift_mean((h @ w) * 0.5, ids)
    _kept_lce(scaled, h, w, ids)

    def wrong_shift(h, w, ids):  # logits[:, 1:]: not the rows the labels belong to
        import optax
        return optax.softmax_cross_entropy_with_integer_labels((h @ w)[:, 1:], ids[:, 1:]).mean()
    _kept_lce(wrong_shift, h, w, ids)

    def other_precision(h, w, ids):  # the op's matmuls run at the default precision
        return _ce_optax_shift_mean(jnp.dot(h, w, precision=hi), ids)
    _kept_lce(other_precision, h, w, ids, reason="precision=(Precision.HIGHEST")

    hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)

    def float32_logits(h, w, ids):  # bf16 inputs, float32 products: the op's logits are bf16
        return _ce_optax_shift_mean(jnp.dot(h, w, preferred_element_type=jnp.float32), ids)
    _kept_lce(float32_logits, hb, wb, ids, reason="gives float32 logits")

    def float32_bias(h, w, b, ids):  # bf16 logits + a float32 bias: the sum is float32
        return _ce_optax_shift_mean(h @ w + b, ids)
    _kept_lce(float32_bias, hb, wb, bias, ids)


@pytest.mark.usefixtures("highest_precision")
def test_lce_pattern_square_w_keeps_its_orientation():
    """d == V: h @ W and h @ W.T are both heads, with transposed_w False and True; a
    wrong flag would give other numbers (W is not symmetric)."""
    h, _, _, ids = _head_batch(d=16, v=16)
    W = jax.random.normal(jax.random.key(3), (16, 16)) * 0.3
    for transposed, head in ((False, lambda h, W: h @ W), (True, lambda h, W: h @ W.T)):
        def fn(h, W, ids, head=head):
            return _ce_optax_shift_mean(head(h, W), ids)
        recs = _loss_records(fn, h, W, ids)
        assert recs[0].replaced and recs[0].params["transposed_w"] is transposed, recs
        _optimized_like_original(fn, (h, W, ids), (0, 1))


def test_lce_pattern_policies(monkeypatch):
    """auto keeps it where it is not faster (CPU; a modelled H100) and the cross_entropy
    pattern then still applies; "memory" and "always" take it; the larger pattern wins
    whatever order the patterns are named in; exclude gives the cross_entropy pattern."""
    import importlib
    from jax_ops import fx
    rw = importlib.import_module("jax_ops.fx.rewrite")
    ce_mod = importlib.import_module("jax_ops.ops.cross_entropy")
    sds = jax.ShapeDtypeStruct  # GPT-2 small's head: 16 x 1024 tokens, d 768, V 50304
    big = (sds((16, 1024, 768), jnp.bfloat16), sds((768, 50304), jnp.bfloat16), sds((16, 1024), jnp.int32))

    def fn(h, w, ids):
        return _ce_optax_shift_mean(h @ w, ids)

    def replaced(policy, *args, **kw):
        return [r.pattern for r in fx.rewrites(fn, *args, policy=policy, **kw) if r.replaced]
    assert replaced("always", *big) == ["linear_cross_entropy"]
    assert replaced("always", *big, patterns=["cross_entropy", "linear_cross_entropy"]) == ["linear_cross_entropy"]
    assert replaced("always", *big, exclude=["linear_cross_entropy"]) == ["cross_entropy"]
    assert replaced("memory", *big) == ["linear_cross_entropy"]
    recs = _loss_records(fn, *big, policy="auto")
    assert recs[0].pattern == "linear_cross_entropy" and not recs[0].replaced, recs
    assert "not faster on" in recs[0].reason, recs
    if PLATFORM == "cpu":  # neither is faster than XLA's own code there
        assert not any(r.replaced for r in recs) and "not faster on cpu" in recs[0].reason, recs
    # where our cross_entropy is the faster choice (a GPU), auto still takes that one
    monkeypatch.setattr(rw, "_not_faster", lambda m, avals: None)
    recs = _loss_records(fn, *big, policy="auto")
    assert [(r.pattern, r.replaced) for r in recs] == [("linear_cross_entropy", False), ("cross_entropy", True)]
    # on a (modelled) H100: slower by the model, with the numbers and the way to take it
    monkeypatch.setattr(importlib.import_module("jax_ops.core.op"), "default_platform", lambda: "cuda")
    monkeypatch.setattr(importlib.import_module("jax_ops.core.dispatch"), "device_kind",
                        lambda platform: "NVIDIA H100 80GB HBM3")
    recs = _loss_records(fn, *big, policy="auto")
    assert recs[0].pattern == "linear_cross_entropy" and not recs[0].replaced
    assert re.search(r"not faster on NVIDIA H100 80GB HBM3: estimated 7\.\d+ ms vs 6\.\d+ ms .*"
                     r"8 chunks .*policy=\"memory\" takes it", recs[0].reason), recs[0].reason
    est = ce_mod.lce_estimate(16384, 768, 50304, 2, "NVIDIA H100 80GB HBM3")
    assert est["extra_ms"] > 0 and est["lce_mib"] < est["unfused_mib"] / 5
    # few rows, a wide h: the float32 dw accumulator (4 d V bytes) outweighs the logits
    # and their gradient (2 N V itemsize bytes), so "memory" keeps it too
    small = (sds((2, 3, 64), jnp.float32), sds((64, 37), jnp.float32), sds((2, 3), jnp.int32))
    recs = _loss_records(fn, *small, policy="memory")
    assert recs[0].pattern == "linear_cross_entropy" and "saves no memory" in recs[0].reason, recs
