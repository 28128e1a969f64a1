"""The benchmark's own logic on CPU: the training-forward mode and the error measure."""
import json

import jax
import jax.numpy as jnp
import numpy as np

from jax_ops import bench


def test_fwd_res_returns_the_residuals_the_backward_uses(tmp_path):
    """fwd_res times jax.vjp's forward: y and the VJP (its residuals), which the
    backward of the same implementation then consumes to give the right gradient."""
    (x, params, dy) = bench.make_sets("relu", jnp.bfloat16, 64, 96, 1, True, seed=3)[0]
    fn = bench.make_op("relu", "xla", jnp.bfloat16)
    (args,) = bench.mode_args(fn, "fwd_res", [(x, params, dy)])
    y, vjp_fn = jax.jit(bench.per_set_fn(fn, "fwd_res"))(*args)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.maximum(np.asarray(x, np.float32), 0))
    (dx,) = vjp_fn(dy)[:1]
    expect = np.where(np.asarray(x, np.float32) > 0, np.asarray(dy, np.float32), 0)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), expect)
    # A residual (the packed mask) is part of what the mode returns, so it is written.
    assert any(leaf.dtype == jnp.uint32 for leaf in jax.tree.leaves(vjp_fn))

    out = tmp_path / "r.json"
    assert bench.main(["--op", "relu", "--rows", "64", "--cols", "96", "--mode", "fwd,fwd_res,bwd",
                       "--impl", "xla,jnp", "--repeats", "1", "--json", str(out)]) == 0
    recs = json.loads(out.read_text())["records"]
    timed = {(r["mode"], r["impl"]) for r in recs if r["time_us"] is not None}
    assert {("fwd_res", "xla"), ("fwd_res", "jnp"), ("bwd", "xla")} <= timed
    fwd = {r["impl"]: r["min_bytes"] for r in recs if r["mode"] == "fwd"}
    res = {r["impl"]: r["min_bytes"] for r in recs if r["mode"] == "fwd_res"}
    assert res == fwd  # the forward's floor: our forward writes the mask either way
    # --check compares y alone in fwd_res (residual pytrees differ between implementations)
    errs = bench.check("relu", "fwd_res", jnp.bfloat16, ["jnp"], (x, params, dy))
    assert errs == {"jnp": 0.0}


def test_rel_err_is_a_relative_norm_not_a_max():
    """One element of many flipped at a ReLU kink must not read as a 100 % error."""
    ref = jnp.ones((1000,), jnp.float32)
    got = ref.at[7].set(0.0)
    assert abs(bench.rel_err(got, ref) - (1 / 1000) ** 0.5) < 1e-6
    assert bench.rel_err((ref, got), (ref, ref)) == bench.rel_err(got, ref)  # worst leaf
    assert bench.rel_err(ref, ref) == 0.0
