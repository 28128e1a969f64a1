"""jax_ops.fx: trace/tabular, optimize (exact rewrites), near misses, rewrites(),
register_pattern, profile. CPU; policy="always" (the automatic choice is XLA on CPU,
so policy="auto" never rewrites there, which one test checks)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ops
from jax_ops import fx

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}


def _ops_in(fn, *args):
    """Names of jax_ops primitives anywhere in fn's jaxpr."""
    g = fx.trace(fn, *args)
    return {n.name for _, n in g.walk() if n.name.startswith("jax_ops_")}


def _close(a, b, dtype):
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=tol, atol=tol)


def _f32(tree):
    return jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _agree(fast, orig, truth, dtype):
    """fast within tolerance of orig; in half precision, where the original is itself
    further off (it rounds its intermediates to bf16, jax_ops computes in float32),
    fast must be at least as close to the float32 truth as the original is."""
    fast, orig, truth = (np.asarray(a, np.float32) for a in (fast, orig, truth))
    tol = TOL[dtype]
    if np.allclose(fast, orig, rtol=tol, atol=tol):
        return
    assert dtype != jnp.float32, np.abs(fast - orig).max()
    err_fast, err_orig = np.abs(fast - truth).max(), np.abs(orig - truth).max()
    assert err_fast <= err_orig + tol, (err_fast, err_orig)


def _check(fn, args, dtype, *, expect_op, grad_argnums=0):
    """fast = optimize(fn, "always") contains expect_op and agrees with fn in value,
    under jit, under grad and under vmap."""
    fast = jax_ops.optimize(fn, policy="always")
    assert expect_op in _ops_in(fast, *args), fx.rewrites(fn, *args, policy="always")
    assert not _ops_in(fn, *args)
    truth = fn(*_f32(args))
    _agree(fast(*args), fn(*args), truth, dtype)
    _agree(jax.jit(fast)(*args), fn(*args), truth, dtype)

    def loss(f):
        return lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))
    g_fast = jax.grad(loss(fast), argnums=grad_argnums)(*args)
    g_ref = jax.grad(loss(fn), argnums=grad_argnums)(*args)
    g_truth = jax.grad(loss(fn), argnums=grad_argnums)(*_f32(args))
    jax.tree_util.tree_map(lambda a, b, c: _agree(a, b, c, dtype), g_fast, g_ref, g_truth)
    batched = [jnp.stack([a, a * 0.5]) for a in args[:1]] + list(args[1:])
    in_axes = (0,) + (None,) * (len(args) - 1)
    _agree(jax.vmap(fast, in_axes)(*batched), jax.vmap(fn, in_axes)(*batched),
           jax.vmap(fn, in_axes)(*_f32(batched)), dtype)
    return fast


def _x(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * 2 + 0.5, dtype)


# ------------------------------------------------------------------ trace ---

class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        x = nn.LayerNorm()(x)
        return nn.relu(x)


def test_trace_tabular_shows_module_paths_and_source_lines():
    m = MLP()
    x = _x((4, 8))
    params = m.init(jax.random.key(0), x)
    g = fx.trace(m.apply, params, x)
    table = g.tabular()
    assert "MLP/Dense_0" in table and "MLP/LayerNorm_0" in table
    assert "test_fx.py:" in table  # the user frame, not flax's file
    dot = next(n for n in g.nodes if n.name == "dot_general")
    assert dot.module_path == "MLP/Dense_0"
    dense_line = next(i for i, line in enumerate(open(__file__), 1) if "nn.Dense(16)(x)" in line)
    assert dot.location.endswith(f"test_fx.py:{dense_line}")
    assert dot.outputs[0].shape == (4, 16) and dot.outputs[0].dtype == jnp.float32
    relu = [n for n in g.nodes if n.name == "custom_jvp_call"]
    assert relu and relu[0].subgraphs  # jax.nn.relu's body can be walked
    assert any(depth > 0 for depth, _ in g.walk())


def test_trace_walks_nested_bodies():
    def f(x):
        def body(c, xi):
            return c + jnp.sin(xi), c
        c, ys = jax.lax.scan(body, 0.0, x)
        return jax.checkpoint(lambda y: jnp.cos(y))(ys) + c
    g = fx.trace(f, jnp.ones(3))
    names = [n.name for _, n in g.walk()]
    assert "scan" in names and "sin" in names and "cos" in names


def test_trace_rejects_non_callable():
    with pytest.raises(TypeError, match="fn must be callable"):
        fx.trace(3, jnp.ones(2))


# --------------------------------------------------------------- optimize ---

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fast_var", [True, False])
def test_flax_linen_layer_norm(dtype, fast_var):
    m = nn.LayerNorm(use_fast_variance=fast_var, epsilon=1e-5)
    x = _x((3, 5, 32), dtype)
    params = m.init(jax.random.key(0), x)
    params = jax.tree_util.tree_map(lambda p: p + 0.3 * _x(p.shape, p.dtype, 1), params)
    _check(lambda x, p: m.apply(p, x), (x, params), dtype, expect_op="jax_ops_norm_fwd",
           grad_argnums=(0, 1))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_flax_linen_rms_norm(dtype):
    m = nn.RMSNorm()
    x = _x((6, 64), dtype)
    params = m.init(jax.random.key(0), x)
    _check(lambda x, p: m.apply(p, x), (x, params), dtype, expect_op="jax_ops_norm_fwd",
           grad_argnums=(0, 1))


def test_flax_linen_layer_norm_with_dtype_bf16_output():
    m = nn.LayerNorm(dtype=jnp.bfloat16)
    x = _x((4, 16))
    params = m.init(jax.random.key(0), x)
    fast = jax_ops.optimize(lambda x: m.apply(params, x), policy="always")
    assert fast(x).dtype == jnp.bfloat16
    assert "jax_ops_norm_fwd" in _ops_in(fast, x)
    _close(fast(x), m.apply(params, x), jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_flax_nnx_layer_norm(dtype):
    m = nnx.LayerNorm(24, rngs=nnx.Rngs(0), param_dtype=dtype)
    x = _x((5, 24), dtype)
    _check(lambda x: m(x), (x,), dtype, expect_op="jax_ops_norm_fwd")


def test_flax_nnx_rms_norm():
    m = nnx.RMSNorm(24, rngs=nnx.Rngs(0))
    x = _x((5, 24))
    _check(lambda x: m(x), (x,), jnp.float32, expect_op="jax_ops_norm_fwd")


@pytest.mark.parametrize("algorithm", ["fast", "stable"])
def test_jax_nn_standardize(algorithm):
    x = _x((7, 48))
    _check(lambda x: jax.nn.standardize(x, epsilon=1e-4, algorithm=algorithm), (x,),
           jnp.float32, expect_op="jax_ops_norm_fwd")


def test_handwritten_layer_norm_in_float32_with_cast_back():
    def ln(x, s, b):
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.var(xf, axis=-1, keepdims=True)
        y = (xf - mean) / jnp.sqrt(var + 1e-6)
        y = y * s
        y = y + b
        return y.astype(x.dtype)
    x, s, b = _x((4, 32), jnp.bfloat16), _x((32,), seed=2), _x((32,), seed=3)
    _check(ln, (x, s, b), jnp.bfloat16, expect_op="jax_ops_norm_fwd", grad_argnums=(0, 1, 2))
    recs = fx.rewrites(ln, x, s, b, policy="always")
    assert [r.pattern for r in recs.replaced] == ["layer_norm"]
    assert recs[0].params["epsilon"] == pytest.approx(1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_handwritten_rms_norm_inside_a_user_jit(dtype):
    @jax.jit
    def rms(x, s):
        ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(ms + 1e-6) * s
    _check(lambda x, s: rms(x, s) + 1.0, (_x((3, 4, 16), dtype), _x((16,), dtype, seed=1)), dtype,
           expect_op="jax_ops_norm_fwd", grad_argnums=(0, 1))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("log", [False, True])
def test_softmax_and_log_softmax(dtype, log):
    f = jax.nn.log_softmax if log else jax.nn.softmax
    x = _x((4, 3, 40), dtype)
    _check(lambda x: f(x), (x,), dtype, expect_op="jax_ops_softmax_fwd")


def test_scaled_softmax_keeps_scale():
    x = _x((4, 40))
    fast = _check(lambda x: jax.nn.softmax(x * 0.125), (x,), jnp.float32,
                  expect_op="jax_ops_softmax_fwd")
    eqn = next(n for _, n in fx.trace(fast, x).walk() if n.name == "jax_ops_softmax_fwd")
    assert eqn.params["scale"] == 0.125


def test_softmax_over_another_axis_passes_axis():
    x = _x((6, 5, 7))
    fast = _check(lambda x: jax.nn.softmax(x, axis=0), (x,), jnp.float32,
                  expect_op="jax_ops_softmax_fwd")
    eqn = next(n for _, n in fx.trace(fast, x).walk() if n.name == "jax_ops_softmax_fwd")
    assert eqn.params["axis"] == -3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_relu_models(dtype):
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.relu(nn.Dense(16, dtype=dtype, param_dtype=dtype)(x))
    m = M()
    x = _x((4, 8), dtype)
    p = m.init(jax.random.key(0), x)
    _check(lambda x: m.apply(p, x), (x,), dtype, expect_op="jax_ops_relu_fwd")
    _check(lambda x: jnp.maximum(x, 0), (x,), dtype, expect_op="jax_ops_relu_fwd")


def test_add_relu():
    x, z = _x((4, 16)), _x((4, 16), seed=1)
    fast = jax_ops.optimize(lambda x, z: jax.nn.relu(x + z), policy="always")
    g = fx.trace(fast, x, z)
    fwd = [n for _, n in g.walk() if n.name == "jax_ops_relu_fwd"]
    assert fwd and fwd[0].params["present"] == (True, True)  # x and z
    _close(fast(x, z), jax.nn.relu(x + z), jnp.float32)
    gf = jax.grad(lambda x, z: jnp.sum(fast(x, z) ** 2), argnums=(0, 1))(x, z)
    gr = jax.grad(lambda x, z: jnp.sum(jax.nn.relu(x + z) ** 2), argnums=(0, 1))(x, z)
    jax.tree_util.tree_map(lambda a, b: _close(a, b, jnp.float32), gf, gr)


def test_rewrites_inside_checkpoint_and_scan_bodies():
    def block(c, x):
        return c, jax.nn.relu(x)

    def f(xs):
        _, ys = jax.lax.scan(block, 0.0, xs)
        return jax.checkpoint(lambda y: jax.nn.softmax(y))(ys)
    xs = _x((3, 4, 8))
    fast = jax_ops.optimize(f, policy="always")
    assert {"jax_ops_relu_fwd", "jax_ops_softmax_fwd"} <= _ops_in(fast, xs)
    _close(fast(xs), f(xs), jnp.float32)
    _close(jax.grad(lambda x: jnp.sum(jnp.sin(fast(x))))(xs),
           jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(xs), jnp.float32)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the automatic choice is XLA on CPU only")
def test_auto_policy_does_not_rewrite_on_cpu():
    x = _x((4, 32))
    fast = jax_ops.optimize(jax.nn.softmax)
    assert not _ops_in(fast, x)
    recs = fx.rewrites(jax.nn.softmax, x)
    assert len(recs) == 1 and not recs[0].replaced
    assert recs[0].reason == "not faster on cpu"


def test_signature_cache_and_pytrees():
    calls = []

    def f(d):
        calls.append(1)
        return {"y": jax.nn.relu(d["a"]) + d["b"]}
    fast = jax_ops.optimize(f, policy="always")
    d = {"a": _x((3, 4)), "b": _x((3, 4), seed=1)}
    out1 = fast(d)
    out2 = fast({"a": d["a"] * 2, "b": d["b"]})
    assert len(calls) == 1  # one trace for one signature
    fast({"a": _x((5, 4)), "b": _x((5, 4))})
    assert len(calls) == 2
    _close(out1["y"], f(d)["y"], jnp.float32)
    assert out2["y"].shape == (3, 4)


def test_optimize_rejects_bad_arguments():
    with pytest.raises(TypeError, match="fn must be callable"):
        jax_ops.optimize(None)
    with pytest.raises(ValueError, match="policy must be one of"):
        jax_ops.optimize(jax.nn.relu, policy="sometimes")
    with pytest.raises(ValueError, match="patterns: unknown pattern 'gelu'"):
        jax_ops.optimize(jax.nn.relu, patterns=["gelu"])
    with pytest.raises(ValueError, match="exclude: unknown pattern"):
        jax_ops.optimize(jax.nn.relu, exclude=["nope"])


def test_exclude_and_patterns_select():
    x = _x((4, 16))

    def f(x):
        return jax.nn.relu(jax.nn.softmax(x))
    assert _ops_in(jax_ops.optimize(f, policy="always", exclude=["relu"]), x) == {"jax_ops_softmax_fwd"}
    assert _ops_in(jax_ops.optimize(f, policy="always", patterns=["relu"]), x) == {"jax_ops_relu_fwd"}


# ------------------------------------------------------------- near misses ---

def _not_rewritten(fn, *args, pattern="layer_norm"):
    fast = jax_ops.optimize(fn, policy="always", patterns=[pattern])
    assert not _ops_in(fast, *args), fx.rewrites(fn, *args, policy="always")
    recs = fx.rewrites(fn, *args, policy="always", patterns=[pattern])
    assert not recs.replaced
    _close(fast(*args), fn(*args), jnp.float32)
    return recs


X, S, B = _x((4, 32)), _x((32,), seed=2), _x((32,), seed=3)


def test_near_miss_eps_outside_sqrt():
    def f(x, s, b):
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        return (x - mean) / (jnp.sqrt(var) + 1e-5) * s + b
    _not_rewritten(f, X, S, B)


def test_near_miss_mean_also_returned():
    def f(x, s, b):
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * s + b, mean
    fast = jax_ops.optimize(f, policy="always", patterns=["layer_norm"])
    assert not _ops_in(fast, X, S, B)
    recs = fx.rewrites(f, X, S, B, policy="always", patterns=["layer_norm"])
    assert recs and not recs.replaced
    assert any("intermediate mean used elsewhere" in r.reason for r in recs), str(recs)


def test_near_miss_scale_applied_before_the_mean():
    def f(x, s, b):
        xs = x * s
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        return (xs - mean) * jax.lax.rsqrt(var + 1e-5) + b
    _not_rewritten(f, X, S, B)


def test_near_miss_variance_with_ddof_1():
    def f(x, s, b):
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.var(x, -1, keepdims=True, ddof=1)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * s + b
    recs = _not_rewritten(f, X, S, B)
    assert recs and all("literal" in r.reason for r in recs), str(recs)


def test_near_miss_normalization_over_axis_0():
    def f(x):
        mean = jnp.mean(x, 0, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), 0, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5)
    recs = _not_rewritten(f, X)
    assert recs and all("axes=" in r.reason for r in recs), str(recs)


def test_near_miss_softmax_over_two_axes():
    x = _x((4, 5, 6))
    recs = _not_rewritten(lambda x: jax.nn.softmax(x, axis=(1, 2)), x, pattern="softmax")
    assert recs and "axes=" in recs[0].reason


def test_near_miss_parameter_differs_between_its_uses():
    fx.register_pattern("softcap", lambda x, *, cap: cap * jnp.tanh(x / cap),
                        lambda x, *, cap: jnp.clip(x, -cap, cap),  # a stand-in replacement
                        example_args=(jax.ShapeDtypeStruct((4, 8), jnp.float32),),
                        params={"cap": 30.0})
    try:
        x = _x((4, 8)) * 20
        recs = _not_rewritten(lambda x: 30.0 * jnp.tanh(x / 50.0), x, pattern="softcap")
        assert "parameter cap is" in recs[0].reason and "in another" in recs[0].reason
        fast = jax_ops.optimize(lambda x: 30.0 * jnp.tanh(x / 30.0), policy="always",
                                patterns=["softcap"])
        np.testing.assert_allclose(fast(x), jnp.clip(x, -30.0, 30.0))  # the match is used
    finally:
        fx.unregister_pattern("softcap")


def test_relu_of_a_sum_with_broadcast_is_add_relu_of_the_broadcast():
    x, b = _x((4, 16)), _x((16,), seed=1)
    fast = jax_ops.optimize(lambda x, b: jax.nn.relu(x + b), policy="always")
    _close(fast(x, b), jax.nn.relu(x + b), jnp.float32)
    gf = jax.grad(lambda x, b: jnp.sum(fast(x, b) ** 2), argnums=1)(x, b)
    gr = jax.grad(lambda x, b: jnp.sum(jax.nn.relu(x + b) ** 2), argnums=1)(x, b)
    _close(gf, gr, jnp.float32)


def test_custom_vjp_body_is_reported_not_rewritten():
    @jax.custom_vjp
    def f(x):
        return jax.nn.relu(x)
    f.defvjp(lambda x: (f(x), x), lambda x, g: (g * 3.0,))
    x = _x((4, 8))
    fast = jax_ops.optimize(f, policy="always")
    assert not _ops_in(fast, x)
    recs = fx.rewrites(f, x, policy="always")
    assert recs and not recs.replaced and "inside a custom_vjp_call body" in recs[0].reason
    np.testing.assert_allclose(jax.grad(lambda x: fast(x).sum())(x), 3.0)


# -------------------------------------------------------- register_pattern ---

def _gelu_tanh(x):
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def test_register_pattern_gelu_tanh():
    fx.register_pattern("gelu_tanh", _gelu_tanh, lambda x: jax.nn.gelu(x, approximate=True),
                        example_args=(jnp.ones((4, 8)),))
    try:
        x = _x((3, 8))

        def model(x):
            return _gelu_tanh(x * 2.0) + 1.0
        fast = jax_ops.optimize(model, policy="always", patterns=["gelu_tanh"])
        recs = fx.rewrites(model, x, policy="always", patterns=["gelu_tanh"])
        assert len(recs.replaced) == 1 and recs[0].pattern == "gelu_tanh"
        _close(fast(x), model(x), jnp.float32)
        # gelu written with another constant is not gelu
        off = lambda x: 0.5 * x * (1.0 + jnp.tanh(0.8 * (x + 0.044715 * x ** 3)))  # noqa: E731
        assert not fx.rewrites(off, x, policy="always", patterns=["gelu_tanh"]).replaced
    finally:
        fx.unregister_pattern("gelu_tanh")


def test_register_pattern_rejects_bad_input():
    with pytest.raises(TypeError, match="reference must be callable"):
        fx.register_pattern("p", 1, jax.nn.relu, example_args=(jnp.ones(3),))
    with pytest.raises(TypeError, match="example_args must be"):
        fx.register_pattern("p", jax.nn.relu, jax.nn.relu, example_args=3)
    with pytest.raises(ValueError, match="never reach the traced reference"):
        fx.register_pattern("p", lambda x, *, a: x * math.sqrt(a), jax.nn.relu,
                            example_args=(jnp.ones(3),), params={"a": 2.0})


# ----------------------------------------------------------------- profile ---

def test_profile_on_cpu():
    m = MLP()
    x = _x((64, 8))
    params = m.init(jax.random.key(0), x)
    prof = fx.profile(m.apply, params, x)
    assert prof.rows and all(r.time_us >= 0 and r.count >= 1 for r in prof.rows)
    assert any(r.kind == "matmul" and "test_fx.py:" in r.location for r in prof.rows)
    assert abs(sum(r.percent for r in prof.rows) - 100.0) < 1e-6
    assert [r.time_us for r in prof.rows] == sorted((r.time_us for r in prof.rows), reverse=True)
    assert "time_us" in str(prof) and "GB/s" in str(prof)
    # bytes: every equation's array inputs and outputs once; the first Dense's dot_general
    # reads x (64, 8) and its kernel (8, h) and writes (64, h), float32
    h = params["params"]["Dense_0"]["kernel"].shape[1]
    dots = [r for r in prof.rows if r.kind == "matmul"]
    assert any(r.bytes == 4 * (64 * 8 + 8 * h + 64 * h) for r in dots), [(r.location, r.bytes) for r in dots]
    assert all(r.bytes > 0 and r.gbps > 0 for r in dots)


def test_profile_kernel_kinds():
    from jax_ops.fx.profile import _kernel_kind
    assert _kernel_kind("loop_convert_fusion", "loop_convert_fusion.3", "jit(f)/convert_element_type") == "fusion"
    assert _kernel_kind("sm90_xmma_fprop_implicit_gemm_bf16", "cudnn-conv.5", "") == "conv"
    assert _kernel_kind("sm90_xmma_gemm_bf16bf16", "custom-call.2", "jit(f)/dot_general") == "matmul"
    assert _kernel_kind("nhwcAddPaddingKernel", "cudnn-conv.53", "jit(f)/conv_general_dilated") == "conv"
    assert _kernel_kind("input_reduce_fusion_3", "input_reduce_fusion.3", "") == "reduction fusion"
    # a layout transpose of a conv's operand carries the conv's name in its op_name
    assert _kernel_kind("loop_transpose_fusion", "input_transpose_fusion.41",
                        "jit(f)/transpose(jvp(conv_general_dilated))") == "fusion"


def test_profile_bytes_of_hlo_instructions():
    # The GPU rows' bytes are their HLO instructions' operands and results, once each.
    from jax_ops.fx.profile import hlo_metadata, instruction_bytes
    rhs = ("bf16[64,56,56,256]{3,2,1,0} fusion(bf16[64,56,56,256]{3,2,1,0} %p0, f32[256]{0} %p1, "
           "pred[]{:T(256)} %c), kind=kLoop, calls=%fused_computation.3, metadata={op_name=\"a[1]\"}")
    act = 64 * 56 * 56 * 256 * 2
    assert instruction_bytes(rhs) == 2 * act + 256 * 4 + 1
    rhs = ("(bf16[8,16]{1,0}, f32[16]{0}, u8[4096]{0}) custom-call(bf16[8,16]{1,0} %x, s32[8]{0} %l), "
           "custom_call_target=\"jax_ops_x\", backend_config={\"f32[99]\": 1}")
    assert instruction_bytes(rhs) == 8 * 16 * 2 + 16 * 4 + 8 * 16 * 2 + 8 * 4  # u8 scratch left out
    assert instruction_bytes("f32[] constant(1)") == 4
    # operands printed by name only (newer XLA): their definitions' result bytes
    assert instruction_bytes("f32[8,32]{1,0} fusion(%x.1, %w.1), kind=kCustom, calls=%c",
                             {"x.1": 512, "w.1": 2048, "c": 7}) == 1024 + 512 + 2048
    assert instruction_bytes("f32[8]{0} add(f32[8]{0} %a, %b)", {"b": 32}) == 96  # partly shaped
    assert instruction_bytes("f32[8]{0} add(a, b)", {"a": 32, "b": 32}) == 96     # names without %
    # a custom call's scratch workspace (last tuple element, s8/u8) is not moved data
    assert instruction_bytes('(bf16[64,64]{1,0}, s8[33554432]{0}) custom-call(bf16[64,64]{1,0} %a, '
                             'bf16[64,64]{1,0} %b), custom_call_target="__cublas$lt$matmul"') == 3 * 8192

    def f(x, w):
        return jnp.sin(x @ w) * 2
    text = jax.jit(f).lower(jnp.ones((8, 16)), jnp.ones((16, 32))).compile().as_text()
    meta, _ = hlo_metadata(text)
    # some instruction reads both operands and writes the product (the dot, or a fusion of it)
    assert any(m["bytes"] >= 4 * (8 * 16 + 16 * 32 + 8 * 32) for m in meta.values()), meta


def test_rewrites_inside_cond_and_while_bodies():
    def f(x, i):
        y = jax.lax.switch(i, [jax.nn.relu, lambda v: jax.nn.softmax(v)], x)
        return jax.lax.while_loop(lambda c: c[1] < 2, lambda c: (jax.nn.relu(c[0] - 0.5), c[1] + 1),
                                  (y, 0))[0]
    x = _x((4, 8))
    fast = jax_ops.optimize(f, policy="always")
    assert {"jax_ops_relu_fwd", "jax_ops_softmax_fwd"} <= _ops_in(fast, x, 1)
    for i in (0, 1):
        _close(fast(x, i), f(x, i), jnp.float32)
        _close(jax.jit(fast)(x, i), f(x, i), jnp.float32)


def test_softmax_with_where_is_not_rewritten():
    # jax_ops' mask semantics differ on fully masked rows: where= is never matched
    x = _x((4, 8))
    keep = jnp.arange(8) < 5
    f = lambda x: jax.nn.softmax(x, where=keep)  # noqa: E731
    fast = jax_ops.optimize(f, policy="always")
    assert not _ops_in(fast, x)
    np.testing.assert_allclose(fast(x), f(x), rtol=1e-6)


def test_rewrites_report_table_and_trace_of_optimized_model():
    m = MLP()
    x = _x((4, 8))
    p = m.init(jax.random.key(0), x)
    recs = fx.rewrites(m.apply, p, x, policy="always")
    assert [r.pattern for r in recs] == ["layer_norm", "relu"]
    assert all(r.replaced and r.module.startswith("MLP") for r in recs)
    assert "flax.linen.LayerNorm" in str(recs) and "test_fx.py:" in str(recs)


def test_match_the_replacement_refuses_is_kept():
    def ln(x):  # a negative epsilon: jax_ops.layer_norm refuses it
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + -1e-9)
    x = _x((4, 16))
    recs = fx.rewrites(ln, x, policy="always")
    assert len(recs) == 1 and not recs[0].replaced
    assert "refuses" in recs[0].reason and "epsilon" in recs[0].reason
    _close(jax_ops.optimize(ln, policy="always")(x), ln(x), jnp.float32)


def test_commuted_operands_match():
    def ln(x, s, b):  # gamma * xhat + beta, operands the other way round
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        return b + s * ((x - mean) * jax.lax.rsqrt(var + 1e-5))
    _check(ln, (X, S, B), jnp.float32, expect_op="jax_ops_norm_fwd", grad_argnums=(0, 1, 2))
    _check(lambda x: jnp.maximum(0.0, x), (X,), jnp.float32, expect_op="jax_ops_relu_fwd")
    recs = fx.rewrites(lambda x, z: jax.nn.relu(z + x), X, X * 2, policy="always")
    assert [r.pattern for r in recs.replaced] == ["add_relu"]


def test_commuted_near_miss_still_rejected():
    def f(x, s, b):  # the scale multiplies the mean, not the normalized value
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        return b + (x - s * mean) * jax.lax.rsqrt(var + 1e-5)
    _not_rewritten(f, X, S, B)


def test_hlo_metadata_maps_instructions_to_source_lines():
    # The GPU profile maps each CUPTI kernel to the HLO instruction of its name; the
    # mapping from instruction to file:line is checked here on CPU-compiled HLO.
    from jax_ops.fx.profile import hlo_metadata

    def f(x, w):
        y = x @ w
        return jnp.sin(y) * 2
    text = jax.jit(f).lower(jnp.ones((8, 8)), jnp.ones((8, 8))).compile().as_text()
    meta, _ = hlo_metadata(text)
    lines = {m["location"] for m in meta.values() if "location" in m}
    first = f.__code__.co_firstlineno
    assert f"{__file__}:{first + 1}" in lines and f"{__file__}:{first + 2}" in lines, lines


def test_prng_keys_and_integer_inputs_pass_through():
    def f(key, x, n):
        noise = jax.random.normal(key, x.shape)
        return jax.nn.relu(x + noise) * n
    key, x = jax.random.key(1), _x((4, 8))
    assert "key<" in fx.trace(f, key, x, 3).tabular()
    fast = jax_ops.optimize(f, policy="always")
    assert "jax_ops_relu_fwd" in _ops_in(fast, key, x, 3)
    _close(fast(key, x, 3), f(key, x, 3), jnp.float32)
    _close(jax.jit(fast)(key, x, 3), f(key, x, 3), jnp.float32)


def test_relu_ties_keep_the_original_derivative():
    # jax.nn.relu: slope 0 at 0 (as jax_ops.relu); jnp.maximum(x, 0): 0.5 (lax.max)
    x = jnp.asarray([-1.0, 0.0, -0.0, 2.0, 0.0])
    z = jnp.asarray([1.0, 0.0, 0.0, -1.0, 1.0])
    for fn, args in ((lambda x: jnp.maximum(x, 0.0), (x,)), (jax.nn.relu, (x,)),
                     (lambda x, z: jnp.maximum(x + z, 0.0), (x, z)),
                     (lambda x, z: jax.nn.relu(x + z), (x, z))):
        fast = jax_ops.optimize(fn, policy="always")
        assert "jax_ops_relu_fwd" in _ops_in(fast, *args)
        argnums = tuple(range(len(args)))
        got = jax.grad(lambda *a: fast(*a).sum(), argnums)(*args)
        want = jax.grad(lambda *a: fn(*a).sum(), argnums)(*args)
        jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)


def test_auto_policy_follows_the_library_choice(monkeypatch):
    # Where jax_ops.explain picks one of our kernels (as on a GPU), auto replaces.
    import importlib
    from jax_ops.core.calls import Explanation
    calls = []

    def fake_explain(fn, *args, **kw):
        calls.append(args)
        return Explanation([type("D", (), {"implementation": "pallas"})()])
    monkeypatch.setattr(importlib.import_module("jax_ops.fx.rewrite"), "explain", fake_explain)
    x = _x((4, 32))
    fast = jax_ops.optimize(jax.nn.softmax)
    assert "jax_ops_softmax_fwd" in _ops_in(fast, x)
    assert calls and calls[0][0].shape == (4, 32)
    assert fx.rewrites(jax.nn.softmax, x)[0].replaced


def test_patterns_keep_priority_order_whatever_order_they_are_named_in():
    x, z = _x((4, 16)), _x((4, 16), seed=1)
    recs = fx.rewrites(lambda x, z: jax.nn.relu(x + z), x, z, policy="always",
                       patterns=["relu", "add_relu"])
    assert [r.pattern for r in recs.replaced] == ["add_relu"]


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="stubs CUPTI with CPU fusion names; test_gpu_profile_on_the_gpu runs it for real")
def test_gpu_profile_maps_kernels_to_source(monkeypatch):
    # The CUPTI path, run on CPU with measure() stubbed: kernels named like the
    # compiled module's fusions (as XLA:GPU names them) plus an unnamed cuBLAS kernel.
    from jax.experimental.mosaic.gpu import profiler
    import importlib
    prof_mod = importlib.import_module("jax_ops.fx.profile")  # jax_ops.fx.profile is also the function

    def f(x, w):
        y = x @ w
        return jnp.sin(y) * 2
    x, w = jnp.ones((8, 8)), jnp.ones((8, 8))
    meta, _ = prof_mod.hlo_metadata(jax.jit(f).lower(x, w).compile().as_text())
    fusions = [k for k in meta if "fusion" in k and "location" in meta[k]]
    assert fusions

    def fake_measure(compiled, aggregate, iterations):
        runs = [[(name.replace(".", "_"), 0.002) for name in fusions] + [("sm90_xmma_gemm", 0.004)]]
        return lambda *a, **k: (compiled(*a, **k), runs * iterations)
    monkeypatch.setattr(profiler, "measure", fake_measure)
    prof = prof_mod._gpu_profile(f, (x, w), {}, repeat=2)
    assert abs(prof.total_us - (2 * len(fusions) + 4)) < 1e-6
    assert any(r.kind == "matmul" and r.time_us == pytest.approx(4.0) for r in prof.rows)
    first = f.__code__.co_firstlineno
    assert any(r.location.endswith(f"test_fx.py:{first + 2}") for r in prof.rows), str(prof)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="CUPTI kernel times: GPU only")
def test_gpu_profile_on_the_gpu():
    def f(x, w):
        y = x @ w
        return jnp.sin(y) * 2
    x = jax.random.normal(jax.random.key(0), (512, 512))
    prof = fx.profile(f, x, x)
    assert "profiler trace" in prof.method or "CUPTI" in prof.method, prof.method
    assert prof.total_us > 0 and all(r.time_us > 0 for r in prof.rows)
    matmuls = [r for r in prof.rows if r.kind == "matmul"]
    first = f.__code__.co_firstlineno
    # every kernel of the product, cuBLAS's included, maps to the line of `x @ w`
    assert matmuls and all(r.location.endswith(f"test_fx.py:{first + 1}") for r in matmuls), str(prof)


def test_profile_rows_from_trace_events():
    """The trace path's attribution: each kernel event names its HLO instruction."""
    import importlib
    prof_mod = importlib.import_module("jax_ops.fx.profile")
    meta = {"custom-call.3": {"location": "model.py:7", "op_name": "jit(f)/ln/ffi_call",
                              "custom_call_target": "jax_ops_layer_norm_bwd"},
            "fusion.1": {"location": "model.py:9", "op_name": "jit(f)/mul"}}
    events = [("_ZN7jax_ops4norm10bwd_kernel", 4000, {"hlo_op": "custom-call.3"}),
              ("_ZN7jax_ops4norm15reduce_partials", 1000, {"hlo_op": "custom-call.3"}),
              ("loop_multiply_fusion", 2000, {"hlo_op": "fusion.1"}),
              ("memcpy", 500, {})] * 2  # two runs
    rows = {r.location: r for r in prof_mod.rows_from_trace(events, meta, repeat=2)}
    assert rows["model.py:7"].time_us == pytest.approx(5.0) and rows["model.py:7"].count == 2
    assert rows["model.py:7"].kind.startswith("jax_ops")
    assert rows["model.py:9"].time_us == pytest.approx(2.0)
    assert rows["model.py:9"].bytes == 0  # no bytes known for the instruction
    meta["custom-call.3"]["bytes"] = 10_000_000  # once per instruction, however many kernels and runs
    rows = {r.location: r for r in prof_mod.rows_from_trace(events, meta, repeat=2)}
    assert rows["model.py:7"].bytes == 10_000_000 and rows["model.py:7"].gbps == pytest.approx(2000.0)
    # one instruction in two rows (a memset and its reduction): its bytes in one of them
    meta["fusion.1"]["bytes"] = 1000
    two = [("Memset", 100, {"hlo_op": "fusion.1"}), ("input_reduce_fusion", 900, {"hlo_op": "fusion.1"})]
    got = prof_mod.rows_from_trace(two, meta, repeat=1)
    assert sorted(r.bytes for r in got) == [0, 1000] and max(got, key=lambda r: r.bytes).time_us == 0.9
    # a loop body's fusion run 10 times a run: its bytes 10 times
    loop = [("loop_multiply_fusion", 1000, {"hlo_op": "fusion.1"})] * 20
    (r,) = prof_mod.rows_from_trace(loop, meta, repeat=2)
    assert r.count == 10 and r.bytes == 10_000 and r.gbps == pytest.approx(1.0)
    assert prof_mod.rows_from_trace(events[3:4], meta, 1) is None  # no tags: CUPTI fallback


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="profiler trace on the GPU")
def test_gpu_profile_attributes_custom_call_kernels():
    """Our FFI kernels (two per LayerNorm backward) and cuBLAS's land on their own
    lines, whatever the number of kernels a custom call launches."""
    def f(x, w, s):
        h = x @ w
        y = jax_ops.layer_norm(h, s, implementation="cuda")
        return jnp.sum(y.astype(jnp.float32) ** 2)
    x = jax.random.normal(jax.random.key(0), (4096, 1024), jnp.bfloat16)
    s = jnp.ones((1024,), jnp.float32)
    prof = fx.profile(jax.grad(f, argnums=(0, 1, 2)), x, x[:1024], s)
    first = f.__code__.co_firstlineno
    ours = [r for r in prof.rows if r.kind.startswith("jax_ops")]
    assert ours and all(r.location.endswith(f"test_fx.py:{first + 2}") for r in ours), str(prof)
    assert "profiler trace" in prof.method, prof.method


def test_every_autodiff_mode_through_a_rewrite():
    """The replacements are our ops, which differentiate in every mode: jvp and a
    Hessian-vector product of a rewritten function equal the original's."""
    def f(x):
        return jnp.sum(jnp.sin(jax.nn.softmax(jax.nn.standardize(x, epsilon=1e-5))))
    x, t = _x((4, 32)), _x((4, 32), seed=3)
    fast = jax_ops.optimize(f, policy="always")
    assert {"jax_ops_norm_fwd", "jax_ops_softmax_fwd"} <= _ops_in(fast, x)
    _close(jax.jvp(fast, (x,), (t,))[1], jax.jvp(f, (x,), (t,))[1], jnp.float32)
    _close(jax.jvp(jax.grad(fast), (x,), (t,))[1], jax.jvp(jax.grad(f), (x,), (t,))[1], jnp.float32)


# ------------------------------------------- add + norm (two outputs: y and h) ---

def _norm_fwd_eqns(fast, *args):
    return [n for _, n in fx.trace(fast, *args).walk() if n.name == "jax_ops_norm_fwd"]


def _pre_norm(x, r, s, b):
    """A pre-norm block's residual add and LayerNorm: h is the next residual."""
    h = x + r
    mean = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
    y = (h - mean) * jax.lax.rsqrt(var + 1e-5) * s + b
    return h + jnp.sin(y)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_add_layer_norm_handwritten(dtype):
    x, r = _x((4, 32), dtype), _x((4, 32), dtype, seed=5)
    fast = _check(_pre_norm, (x, r, S, B), dtype, expect_op="jax_ops_norm_fwd",
                  grad_argnums=(0, 1, 2, 3))
    (eqn,) = _norm_fwd_eqns(fast, x, r, S, B)
    # x and the residual: the fused op. bfloat16: the norm is bfloat16 math, then * s + b
    # promote to float32: the fused op (y in x's dtype) replaces the norm without them
    f32 = dtype == jnp.float32
    assert eqn.params["present"] == (True, True, f32, f32)
    recs = fx.rewrites(_pre_norm, x, r, S, B, policy="always").replaced
    assert [r.pattern for r in recs] == ["add_layer_norm"]
    assert recs[0].params["epsilon"] == pytest.approx(1e-5, rel=1e-2)  # bf16 literal


def test_add_layer_norm_commuted_add_and_h_used_before_the_norm():
    def f(x, r, s, b):
        h = r + x
        u = h * 3.0          # a use of h before the norm's equations (program order)
        mean = jnp.mean(h, -1, keepdims=True)
        var = jnp.var(h, -1, keepdims=True)
        y = (h - mean) / jnp.sqrt(var + 1e-6) * s + b
        return y + u
    x, r = _x((4, 32)), _x((4, 32), seed=5)
    fast = _check(f, (x, r, S, B), jnp.float32, expect_op="jax_ops_norm_fwd",
                  grad_argnums=(0, 1, 2, 3))
    assert _norm_fwd_eqns(fast, x, r, S, B)[0].params["present"][1]


class PreNormBlock(nn.Module):
    norm: str = "layer"
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            norm = nn.LayerNorm if self.norm == "layer" else nn.RMSNorm
            y = norm(dtype=self.dtype, param_dtype=self.dtype)(x)
            x = x + nn.Dense(x.shape[-1], dtype=self.dtype, param_dtype=self.dtype)(y)
        return norm(dtype=self.dtype, param_dtype=self.dtype)(x)


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_flax_linen_pre_norm_blocks(norm, dtype):
    m = PreNormBlock(norm, dtype)
    x = _x((2, 3, 16), dtype)
    p = m.init(jax.random.key(0), x)
    p = jax.tree_util.tree_map(lambda a: a + 0.3 * _x(a.shape, a.dtype, 1), p)
    fn = lambda x, p: m.apply(p, x)  # noqa: E731
    _check(fn, (x, p), dtype, expect_op="jax_ops_norm_fwd", grad_argnums=(0, 1))
    recs = fx.rewrites(fn, x, p, policy="always")
    # first norm: of the input; then (add, norm) twice: the last h is the last norm's input
    assert [r.pattern for r in recs] == [f"{norm}_norm", f"add_{norm}_norm", f"add_{norm}_norm"], str(recs)
    assert all(r.replaced for r in recs)
    assert recs[1].formulation == f"x + r, then flax.linen.{'LayerNorm' if norm == 'layer' else 'RMSNorm'}"


def test_flax_nnx_add_rms_norm():
    norm = nnx.RMSNorm(24, rngs=nnx.Rngs(0))
    lin = nnx.Linear(24, 24, rngs=nnx.Rngs(1))

    def f(x):
        h = x + lin(x)
        return h + norm(h)
    x = _x((5, 24))
    _check(f, (x,), jnp.float32, expect_op="jax_ops_norm_fwd")
    assert [r.pattern for r in fx.rewrites(f, x, policy="always").replaced] == ["add_rms_norm"]


def _patterns_replaced(fn, *args):
    return [r.pattern for r in fx.rewrites(fn, *args, policy="always").replaced]


def test_near_miss_add_of_a_bias_vector_is_plain_layer_norm():
    def f(x, b0, s, b):  # x + bias: not a residual
        h = x + b0
        mean = jnp.mean(h, -1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + 1e-5) * s + b
    x = _x((4, 32))
    recs = fx.rewrites(f, x, S, S, B, policy="always")
    assert [(r.pattern, r.replaced) for r in recs] == [("layer_norm", True)], str(recs)
    fast = jax_ops.optimize(f, policy="always")
    assert not _norm_fwd_eqns(fast, x, S, S, B)[0].params["present"][1]
    _close(fast(x, S, S, B), f(x, S, S, B), jnp.float32)

    def g(x, b0, s, b):  # the bias broadcast to x's shape first: still not a residual
        return f(x, jnp.broadcast_to(b0, x.shape), s, b)
    recs = fx.rewrites(g, x, S, S, B, policy="always")
    assert [(r.pattern, r.replaced) for r in recs] == [("layer_norm", True)], str(recs)


def test_near_miss_add_whose_result_is_not_the_norms_input():
    def f(x, r, s, b):
        h = x + r
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * s + b + h
    x, r = _x((4, 32)), _x((4, 32), seed=5)
    assert _patterns_replaced(f, x, r, S, B) == ["layer_norm"]
    _close(jax_ops.optimize(f, policy="always")(x, r, S, B), f(x, r, S, B), jnp.float32)


def test_near_miss_add_then_eps_outside_the_sqrt():
    def f(x, r, s, b):
        h = x + r
        mean = jnp.mean(h, -1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
        return (h - mean) / (jnp.sqrt(var) + 1e-5) * s + b + h
    x, r = _x((4, 32)), _x((4, 32), seed=5)
    assert not fx.rewrites(f, x, r, S, B, policy="always").replaced
    assert not _ops_in(jax_ops.optimize(f, policy="always"), x, r, S, B)


def test_near_miss_add_norm_intermediate_used_elsewhere():
    def f(x, r, s, b):
        h = x + r
        mean = jnp.mean(h, -1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + 1e-5) * s + b + h, var
    x, r = _x((4, 32)), _x((4, 32), seed=5)
    recs = fx.rewrites(f, x, r, S, B, policy="always")
    assert not recs.replaced
    assert {r.pattern for r in recs} == {"add_layer_norm", "layer_norm"}
    # the value's name comes from the source line where it can be read ("var"); on a
    # GPU the reported value may be the equation's ("div result")
    assert all("used elsewhere" in r.reason for r in recs), str(recs)


def test_add_norm_with_a_wider_result_falls_back_to_the_plain_norm():
    # flax LayerNorm with float32 parameters and dtype=None: bfloat16 x, float32 y. The
    # fused op's y is x's dtype, so only the norm is replaced (on x widened).
    m = nn.LayerNorm()
    x, r = _x((4, 16), jnp.bfloat16), _x((4, 16), jnp.bfloat16, seed=5)
    p = m.init(jax.random.key(0), x)

    def f(x, r):
        h = x + r
        return m.apply(p, h), h
    recs = fx.rewrites(f, x, r, policy="always")
    assert [r.pattern for r in recs.replaced] == ["layer_norm"], str(recs)
    assert any(r.pattern == "add_layer_norm" and "float32" in r.reason for r in recs), str(recs)
    fast = jax_ops.optimize(f, policy="always")
    for a, b in zip(fast(x, r), f(x, r)):
        assert a.dtype == b.dtype
        _close(a, b, jnp.float32)


def test_add_norm_input_computed_after_a_use_of_h_is_kept():
    # h is used (u) before the scale is computed: the fused op can't run before that use
    def f(x, r, s, b):
        h = x + r
        u = h * 3.0
        s2 = s * 2.0
        mean = jnp.mean(h, -1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + 1e-5) * s2 + b + u
    x, r = _x((4, 32)), _x((4, 32), seed=5)
    recs = fx.rewrites(f, x, r, S, B, policy="always")
    assert any(r.pattern == "add_layer_norm" and not r.replaced and "computed after" in r.reason
               for r in recs), str(recs)
    _close(jax_ops.optimize(f, policy="always")(x, r, S, B), f(x, r, S, B), jnp.float32)


# ------------------------------------------------------ BatchNorm + ReLU (NHWC) ---

class ResBlock(nn.Module):
    """A ResNet basic block: conv-BN-relu, conv-BN, + the input, relu (NHWC)."""
    train: bool = True
    dtype: object = jnp.float32
    momentum: float = 0.9

    @nn.compact
    def __call__(self, x):
        conv = lambda: nn.Conv(x.shape[-1], (3, 3), use_bias=False, dtype=self.dtype)  # noqa: E731
        bn = lambda: nn.BatchNorm(use_running_average=not self.train,  # noqa: E731
                                  momentum=self.momentum, dtype=self.dtype)
        y = nn.relu(bn()(conv()(x)))
        y = bn()(conv()(y))
        return nn.relu(x + y)


def _tree_agree(fast, orig, truth, dtype):
    """_agree per leaf, relative to the leaf's magnitude (gradients of a network reach
    10^3: float32 sums in another order differ there by 10^-2)."""
    def one(a, b, c):
        scale = max(1.0, float(np.abs(np.asarray(c, np.float32)).max(initial=0.0)))
        _agree(*(np.asarray(t, np.float32) / scale for t in (a, b, c)), dtype)
    jax.tree_util.tree_map(one, fast, orig, truth)


def _check_tree(fn, args, dtype, grad_argnums, main=lambda out: out, exclude=()):
    """optimize(fn) agrees with fn on every output (Flax state updates included), under
    jit, and in the gradient of a loss of main(output)."""
    fast = jax_ops.optimize(fn, policy="always", exclude=exclude)
    truth = fn(*_f32(args))
    _tree_agree(fast(*args), fn(*args), truth, dtype)
    _tree_agree(jax.jit(fast)(*args), fn(*args), truth, dtype)

    def loss(f):
        return lambda *a: jnp.sum(jnp.sin(main(f(*a)).astype(jnp.float32)))
    g = [jax.grad(loss(f), argnums=grad_argnums)(*a) for f, a in
         ((fast, args), (fn, args), (fn, _f32(args)))]
    _tree_agree(*g, dtype)
    return fast


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("train", [True, False])
def test_flax_resnet_block_batch_norm_relu(train, dtype):
    m = ResBlock(train, dtype)
    x = _x((2, 5, 5, 8), dtype)
    v = m.init(jax.random.key(0), x)
    v = jax.tree_util.tree_map(lambda a: a + 0.2 * jnp.abs(_x(a.shape, a.dtype, 1)), v)
    if not train:  # running statistics as training leaves them: the data's (momentum 0)
        v = {**v, **ResBlock(True, dtype, momentum=0.0).apply(v, x, mutable=["batch_stats"])[1]}

    def fn(x, v):
        return m.apply(v, x, mutable=["batch_stats"])
    # at inference conv_batch_norm (tried first) folds these BatchNorms into the convs
    exclude = () if train else ("conv_batch_norm",)
    fast = _check_tree(fn, (x, v), dtype, (0, 1), main=lambda out: out[0], exclude=exclude)
    assert "jax_ops_bn_relu_fwd" in _ops_in(fast, x, v)
    recs = fx.rewrites(fn, x, v, policy="always", exclude=exclude)
    mode = "training" if train else "inference"
    assert [(r.pattern, r.replaced) for r in recs] == [
        ("batch_norm_relu", True), ("batch_norm_add_relu", True)], str(recs)
    assert all(r.formulation.startswith(f"flax.linen.BatchNorm({mode})") for r in recs)
    if train:  # the batch statistics reach the running averages
        new = fast(x, v)[1]["batch_stats"]["BatchNorm_0"]
        assert not np.allclose(new["mean"], v["batch_stats"]["BatchNorm_0"]["mean"])


def _flax_bn_train(x, s, b, *, eps=1e-5, axes=(0, 1, 2), extra=False):
    """flax.linen.BatchNorm's training computation, written out (as flax writes it)."""
    from flax.linen import normalization as flax_norm
    mean, var = flax_norm._compute_stats(x, axes, None)
    m = jnp.expand_dims(mean, axes)
    v = jnp.expand_dims(var, axes)
    y = x - m
    mul = jax.lax.rsqrt(v + eps)
    mul *= s.reshape(1, 1, 1, -1)
    y *= mul
    y += b.reshape(1, 1, 1, -1)
    return (y, mean, var, mul) if extra else (y, mean, var)


XB, SB, BB = _x((2, 3, 3, 8)), 1 + 0.1 * _x((8,), seed=2), _x((8,), seed=3)


def test_batch_norm_unbiased_running_variance_is_still_the_pattern():
    # PyTorch's running variance takes var * n / (n - 1): a use of the returned batch
    # variance, which the op computes exactly as the pattern's
    def f(x, s, b):
        y, mean, var = _flax_bn_train(x, s, b)
        n = x.size // x.shape[-1]
        return jax.nn.relu(y), 0.9 + 0.1 * mean, 0.9 + 0.1 * var * (n / (n - 1))
    fast = _check_tree(f, (XB, SB, BB), jnp.float32, (0, 1, 2), main=lambda out: out[0])
    assert _patterns_replaced(f, XB, SB, BB) == ["batch_norm_relu"]
    assert "jax_ops_bn_relu_fwd" in _ops_in(fast, XB, SB, BB)


def test_near_miss_batch_norm_intermediate_used_by_the_stats():
    # the "running statistics" take the normalizer, not the batch variance
    def f(x, s, b):
        y, mean, var, mul = _flax_bn_train(x, s, b, extra=True)
        return jax.nn.relu(y), 0.9 + 0.1 * mean, mul
    fast = jax_ops.optimize(f, policy="always", patterns=["batch_norm_relu"])
    assert not _ops_in(fast, XB, SB, BB)
    recs = fx.rewrites(f, XB, SB, BB, policy="always", patterns=["batch_norm_relu"])
    assert recs and not recs.replaced
    assert all("used elsewhere" in r.reason for r in recs), str(recs)


def test_near_miss_batch_norm_over_another_axis():
    m = nn.BatchNorm(use_running_average=False, axis=1)  # NCHW: channels on axis 1
    x = _x((2, 8, 3, 3))
    v = m.init(jax.random.key(0), x)

    def fn(x, v):
        y, state = m.apply(v, x, mutable=["batch_stats"])
        return jax.nn.relu(y), state
    recs = fx.rewrites(fn, x, v, policy="always", patterns=["batch_norm_relu"])
    assert not recs.replaced, str(recs)
    fast = jax_ops.optimize(fn, policy="always", patterns=["batch_norm_relu"])
    assert not _ops_in(fast, x, v)


def test_near_miss_batch_norm_relu_before_the_add():
    def f(x, z, s, b):  # relu(bn(x)) + z: batch_norm_relu, then an add
        return jax.nn.relu(_flax_bn_train(x, s, b)[0]) + z
    z = _x(XB.shape, seed=7)
    assert _patterns_replaced(f, XB, z, SB, BB) == ["batch_norm_relu"]
    _check(f, (XB, z, SB, BB), jnp.float32, expect_op="jax_ops_bn_relu_fwd", grad_argnums=(0, 1, 2, 3))


def test_near_miss_batch_norm_eps_outside_the_rsqrt():
    def f(x, s, b):
        mean = jnp.mean(x, (0, 1, 2))
        var = jnp.mean(jnp.square(x - mean), (0, 1, 2))
        return jax.nn.relu((x - mean) / (jnp.sqrt(var) + 1e-5) * s + b)
    assert _patterns_replaced(f, XB, SB, BB) == ["add_relu"]  # relu(... + b) only


# ---------------------------------------------- conv + BatchNorm folding (inference) ---

def _inference_block(dtype):
    m = ResBlock(False, dtype)
    x = _x((2, 5, 5, 8), dtype)
    v = m.init(jax.random.key(0), x)
    v = jax.tree_util.tree_map(lambda a: a + 0.2 * jnp.abs(_x(a.shape, a.dtype, 1)), v)
    v = {**v, **ResBlock(True, dtype, momentum=0.0).apply(v, x, mutable=["batch_stats"])[1]}
    return m, x, v


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_conv_batch_norm_folds_a_resnet_block_in_inference(dtype):
    m, x, v = _inference_block(dtype)

    def fn(x, v):
        return m.apply(v, x)
    if dtype == jnp.float32:
        with jax.default_matmul_precision("highest"):  # a GPU's default conv is TF32
            _check_tree(fn, (x, v), dtype, (0, 1))
    else:
        # bfloat16: w * s is rounded where the original rounds the conv's output, so a
        # few relu masks flip (pre-activations within an ulp of 0): the gradients agree
        # in norm, not element by element
        fast = jax_ops.optimize(fn, policy="always")
        m32 = ResBlock(False, jnp.float32)
        truth = m32.apply(*_f32((v, x)))
        _tree_agree(fast(x, v), fn(x, v), truth, dtype)
        c = _x(x.shape, seed=9)
        loss = lambda f: lambda x, v: jnp.sum(f(x, v).astype(jnp.float32) * c)  # noqa: E731
        g_fast, g_orig = (jax.grad(loss(f), argnums=(0, 1))(x, v) for f in (fast, fn))
        g_true = jax.grad(loss(lambda x, v: m32.apply(v, x)), argnums=(0, 1))(*_f32((x, v)))
        jax.tree_util.tree_map(lambda a, b, t: _rel_l2(a, t) < 0.1 and _rel_l2(b, t) < 0.1 or
                               pytest.fail(f"{_rel_l2(a, t)}, {_rel_l2(b, t)}"), g_fast, g_orig, g_true)
    # policy "auto" folds on every device (it removes the BatchNorm pass)
    recs = fx.rewrites(fn, x, v)
    assert [(r.pattern, r.replaced) for r in recs if r.pattern == "conv_batch_norm"] == \
        [("conv_batch_norm", True)] * 2, str(recs)
    assert recs[0].module == "ResBlock/BatchNorm_0" and recs[0].params["epsilon"] == pytest.approx(1e-5)
    fast = jax_ops.optimize(fn)
    g = fx.trace(fast, x, v)
    convs = [n for _, n in g.walk() if n.name == "conv_general_dilated"]
    assert len(convs) == 2
    assert not any(n.name == "rsqrt" and n.outputs[0].shape != (8,) for _, n in g.walk())
    # each conv's output takes the folded bias in its own dtype (bf16: no float32 round
    # trip), the form XLA fuses into cuDNN's convolution with the bias and relu
    for conv in convs:
        (user,) = conv.outputs[0].users
        assert user.name == "add" and user.outputs[0].dtype == dtype, user
    with jax.default_matmul_precision("highest"):  # a GPU's default conv is TF32
        _tree_agree(fast(x, v), fn(x, v), fn(*_f32((x, v))), dtype)


def test_relu_after_a_conv_stays_xla_under_auto():
    """policy="auto" leaves a relu after a conv (through a bias or residual add, or a
    folded conv + BatchNorm) to XLA, which fuses it into cuDNN's convolution; a relu
    elsewhere is decided as before; "always" still replaces both."""
    m, x, v = _inference_block(jnp.bfloat16)
    fused = "XLA fuses it into the convolution before it"
    recs = fx.rewrites(lambda x, v: m.apply(v, x), x, v)
    relus = [r for r in recs if r.pattern in ("relu", "add_relu")]
    # both relus (the last one also as a relu inside add_relu) kept, for that reason
    assert len(relus) >= 2 and all(not r.replaced and fused in r.reason for r in relus), recs
    recs = fx.rewrites(lambda x, v: m.apply(v, x), x, v, policy="always")
    assert sum(r.replaced for r in recs if r.pattern in ("relu", "add_relu")) == 2, recs
    w = _x((3, 3, 8, 8), seed=4)
    b = _x((8,), seed=5)

    def conv_relu(x, w, b):  # conv + bias + relu, no BatchNorm
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.nn.relu(y + b)
    xs = _x((2, 6, 6, 8), seed=6)
    recs = [r for r in fx.rewrites(conv_relu, xs, w, b) if r.pattern in ("relu", "add_relu")]
    assert recs and all(not r.replaced and fused in r.reason for r in recs), recs
    # four adds (bias, residual...) between the conv and the relu: still its epilogue
    def four_adds(x, w, b):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.nn.relu(y + b + b + b + b)
    big = _x((4, 64, 64, 8), seed=8)  # above the small-array rule
    recs = [r for r in fx.rewrites(four_adds, big, w, b) if r.pattern in ("relu", "add_relu")]
    assert recs and all(fused in r.reason for r in recs), recs
    # a large relu after a matmul is decided as before (CPU: not faster)
    y = _x((300, 300), seed=7)
    recs = [r for r in fx.rewrites(lambda x: jax.nn.relu(x @ x.T + 1.0), y)
            if r.pattern in ("relu", "add_relu")]
    assert recs and all(fused not in (r.reason or "") and "elements" not in (r.reason or "")
                        for r in recs), recs


def test_relu_of_a_small_array_stays_xla_under_auto():
    """flax BatchNorm's variance clamp, max(var, 0) on C channels, matches relu: under
    "auto" a relu of fewer than SMALL_ELEMENTS elements stays XLA's (fused into its
    neighbours); a large one is decided as before; "always" replaces both."""
    from jax_ops.ops.relu import SMALL_ELEMENTS
    f = lambda x: jnp.maximum(x, 0.0)  # noqa: E731
    small, large = _x((SMALL_ELEMENTS - 1,)), _x((SMALL_ELEMENTS // 128, 128))
    [rec] = fx.rewrites(f, small)
    assert not rec.replaced and "elements: XLA fuses it into its neighbours" in rec.reason, rec
    [rec] = fx.rewrites(f, large)
    assert "elements" not in (rec.reason or ""), rec
    assert all(r.replaced for x in (small, large) for r in fx.rewrites(f, x, policy="always"))


def test_conv_batch_norm_with_conv_bias_strides_and_padding():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Conv(6, (3, 3), strides=2, padding="VALID", use_bias=True)(x)
            return nn.BatchNorm(use_running_average=True, use_scale=False)(y)
    m = M()
    x = _x((2, 7, 7, 4))
    v = m.init(jax.random.key(0), x)
    v = jax.tree_util.tree_map(lambda a: a + 0.3 * jnp.abs(_x(a.shape, a.dtype, 4)), v)
    fn = lambda x, v: m.apply(v, x)  # noqa: E731
    _check_tree(fn, (x, v), jnp.float32, (0, 1))
    assert _patterns_replaced(fn, x, v) == ["conv_batch_norm"]


def _rel_l2(a, b):
    a, b = (np.asarray(t, np.float32).ravel() for t in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_near_miss_conv_batch_norm_in_training_is_batch_statistics():
    m, x, v = _inference_block(jnp.float32)
    m = ResBlock(True)
    fn = lambda x, v: m.apply(v, x, mutable=["batch_stats"])  # noqa: E731
    assert _patterns_replaced(fn, x, v) == ["batch_norm_relu", "batch_norm_add_relu"]
    # the statistics are computed from the conv's output: no inference BatchNorm, and
    # as batch_norm_relu verifies there, the near miss is not even reported
    assert not fx.rewrites(fn, x, v, policy="always", patterns=["conv_batch_norm"]).replaced
    assert "conv_batch_norm" not in {r.pattern for r in fx.rewrites(fn, x, v, policy="always")}


def test_near_miss_conv_output_used_elsewhere():
    bn = nn.BatchNorm(use_running_average=True)
    x, w = _x((2, 5, 5, 4)), _x((3, 3, 4, 8), seed=1) * 0.2
    v = bn.init(jax.random.key(0), jnp.ones((2, 5, 5, 8)))

    def fn(x, w):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return bn.apply(v, y), y
    recs = fx.rewrites(fn, x, w, policy="always", patterns=["conv_batch_norm"])
    assert recs and not recs.replaced and "used elsewhere" in recs[0].reason, str(recs)


def test_near_miss_conv_features_not_on_the_normalized_axis():
    # NCHW conv output, BatchNorm over the last axis (W, of the same size as the
    # channels): folding per conv feature would be wrong
    bn = nn.BatchNorm(use_running_average=True)
    x, w = _x((2, 4, 8, 8)), _x((8, 4, 3, 3), seed=1) * 0.2
    v = bn.init(jax.random.key(0), jnp.ones((2, 8, 8, 8)))
    v = jax.tree_util.tree_map(lambda a: a + 0.3 * jnp.abs(_x(a.shape, a.dtype, 4)), v)

    def fn(x, w):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return bn.apply(v, y)
    recs = fx.rewrites(fn, x, w, policy="always", patterns=["conv_batch_norm"])
    assert recs and not recs.replaced and "axis 1" in recs[0].reason, str(recs)
    fast = jax_ops.optimize(fn, policy="always")
    _close(fast(x, w), fn(x, w), jnp.float32)
