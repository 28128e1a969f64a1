"""Checks every op declaration gets from the framework, parametrised over the
declarations (jax_ops.core.op.OPS) and their benchmark specs (each spec has the op, its
jnp reference and its inputs): the registry entries, and every autodiff mode of every op
and implementation against the jnp reference's, under vmap too. The per-op suites test
each op's own semantics against float64 references."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ops
import support
from jax_ops.core import registry
from jax_ops.core.op import OPS, PRIMITIVES

SPECS = {name: spec for op in OPS.values() for name, spec in op.bench().items()}
# (rows, cols) small enough for the Pallas interpreter; softmax_mask/_causal view x as (B, Q, cols)
SHAPE = (8, 40)


def test_every_declared_op_is_registered_with_every_implementation():
    for op in OPS.values():
        assert op.fwd.prim in PRIMITIVES and op.bwd.prim in PRIMITIVES
        for name in op.names:
            assert set(jax_ops.IMPLEMENTATIONS) <= set(registry.implementations(name)), name
            assert name in SPECS, f"{name} has no benchmark spec"


def _close(name, a, b, tol):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        err = np.linalg.norm(u - v) / max(np.linalg.norm(v), 1e-30)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("impl", ["xla", "cuda", "pallas"])
@pytest.mark.parametrize("bench_name", sorted(SPECS))
def test_autodiff_modes_match_the_jnp_reference(bench_name, impl):
    """jvp, a Hessian-vector product and vmap-of-grad of a smooth function of the op
    equal those of the spec's jnp reference (float32). Differentiates x and the float
    parameters the benchmark differentiates."""
    spec = SPECS[bench_name]
    op_name = next(n for op in OPS.values() for n in op.names if bench_name.startswith(n)
                   and bench_name in op.bench())
    support.need(op_name, impl)
    kx, kp, kq, kt = jax.random.split(jax.random.key(sum(map(ord, bench_name))), 4)
    x, params = spec.make_inputs(kx, kp, kq, jnp.float32, *SHAPE)
    diff = [i for i, p in enumerate(params) if spec.diff_params and jnp.issubdtype(p.dtype, jnp.floating)]
    ours, ref = spec.kernel(impl), spec.reference(jnp.float32)
    w = jax.random.normal(kt, SHAPE)

    def loss(f):
        def g(x, *dp):
            p = list(params)
            for i, v in zip(diff, dp):
                p[i] = v
            out = f(x, *p)
            return sum(jnp.sum(jnp.sin(o) * w) for o in (out if isinstance(out, tuple) else (out,)))
        return g

    primals = (x, *(params[i] for i in diff))
    tangents = tuple(jax.random.normal(jax.random.fold_in(kt, j), a.shape) for j, a in enumerate(primals))
    tol = 1e-4 if bench_name.startswith("batch_norm") else 2e-5
    _close("jvp", jax.jvp(loss(ours), primals, tangents), jax.jvp(loss(ref), primals, tangents), tol)
    argnums = tuple(range(len(primals)))
    hvp = lambda f: jax.jvp(jax.grad(loss(f), argnums), primals, tangents)[1]  # noqa: E731
    _close("hvp", hvp(ours), hvp(ref), tol)
    if not bench_name.startswith("batch_norm"):  # BatchNorm's statistics are per example under vmap
        xb = jnp.stack([x, 0.5 * x])
        gv = lambda f: jax.grad(lambda xb: jnp.sum(jax.vmap(lambda x: loss(f)(x, *primals[1:]))(xb)))(xb)  # noqa: E731
        _close("grad(vmap)", gv(ours), gv(ref), tol)
