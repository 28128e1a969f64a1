"""The implementation registry and the automatic choice: use(), implementations(),
register_implementation(), explain(), measured tables, autotune and its cache."""
from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ops
from jax_ops import tuning
from jax_ops.core import cache, dispatch, registry
from jax_ops.core.calls import op_calls
from jax_ops.core.registry import Query
from jax_ops.core.op import default_platform, query
from pallas_kernels import layer_norm as pallas_norm

PLATFORM = default_platform()


def _inputs(shape=(6, 40), dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape) * 2 + 1, dtype)
    s = jnp.asarray(rng.standard_normal(shape[-1:]) + 1, jnp.float32)
    b = jnp.asarray(rng.standard_normal(shape[-1:]), jnp.float32)
    return x, s, b


def _loss(x, s, b):
    return jnp.sum(jax_ops.layer_norm(x, s, b).astype(jnp.float32) ** 2)


def _choices(fn, *args):
    return [(d.query.op, d.query.stage, d.implementation) for d in jax_ops.explain(fn, *args)]


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("JAX_OPS_AUTOTUNE_CACHE", str(path))
    return path


def test_implementations_lists_builtins_and_filters_by_support():
    assert jax_ops.implementations("layer_norm")[:3] == ["xla", "cuda", "pallas"]
    assert "pallas" in jax_ops.implementations("rms_norm", platform="cpu", shape=(4, 1024))
    assert "pallas" not in jax_ops.implementations("rms_norm", platform="cpu", shape=(4, 65536))
    assert jax_ops.implementations("layer_norm", platform="tpu") == ["xla"]
    with pytest.raises(ValueError, match=r"unknown op 'softmaxx'"):
        jax_ops.implementations("softmaxx")


def test_use_overrides_and_retraces_under_jit():
    x, s, b = _inputs()
    grad = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))
    ref = grad(x, s, b)  # traced and compiled outside the scope: automatic choice
    assert {c[2] for c in _choices(jax.grad(_loss), x, s, b)} == {"xla"} or PLATFORM == "cuda"
    with jax_ops.use("pallas"):
        assert _choices(jax.grad(_loss), x, s, b) == [("layer_norm", "fwd", "pallas"),
                                                      ("layer_norm", "bwd", "pallas")]
        inside = grad(x, s, b)  # the same jitted function is traced again for the scope
        text = grad.lower(x, s, b).as_text()
    with jax_ops.use(layer_norm="cuda"):
        if "cuda" in jax_ops.implementations("layer_norm", platform=PLATFORM):
            assert "jax_ops_norm_fwd" in grad.lower(x, s, b).as_text()
        with jax_ops.use(rms_norm="xla"):  # nested: merges per op
            assert registry.override_for("layer_norm") == "cuda"
            assert registry.override_for("rms_norm") == "xla"
    assert "jax_ops_norm_fwd" not in text
    assert registry.override_for("layer_norm") is None
    for a, r in zip(inside, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=2e-5, atol=2e-5)
    # An explicit argument beats the scope.
    with jax_ops.use("pallas"):
        f = lambda x: jax_ops.layer_norm(x, implementation="xla")
        assert _choices(f, x) == [("layer_norm", "fwd", "xla")]


def test_use_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"no op has an implementation named 'tritonn'"):
        with jax_ops.use("tritonn"):
            pass
    with pytest.raises(ValueError, match=r"layer_norm: unknown implementation='fast'"):
        with jax_ops.use(layer_norm="fast"):
            pass


def test_environment_variable_override(monkeypatch):
    assert registry._parse_override("pallas") == (("*", "pallas"),)
    assert registry._parse_override("rms_norm=cuda, layer_norm=xla") == (
        ("layer_norm", "xla"), ("rms_norm", "cuda"))


def test_explain_reports_each_call_and_reason(capsys, monkeypatch):
    x, s, b = _inputs((3, 5, 64), jnp.bfloat16)

    def model(x, s, b):
        h = jax_ops.layer_norm(x, s, b)
        return jax_ops.rms_norm(h, s, implementation="pallas")

    out = jax_ops.explain(jax.grad(lambda *a: jnp.sum(model(*a).astype(jnp.float32)), argnums=(0, 1)), x, s, b)
    got = [(d.query.op, d.query.stage, d.implementation) for d in out]
    auto = "xla" if PLATFORM != "cuda" else got[0][2]
    assert got == [("layer_norm", "fwd", auto), ("rms_norm", "fwd", "pallas"),
                   ("rms_norm", "bwd", "pallas"), ("layer_norm", "bwd", got[3][2])]
    text = str(out)
    assert "rms_norm fwd+stats bfloat16[3,5,64]" in text and "asked for" in text
    if PLATFORM != "cuda":
        assert "heuristic: XLA on cpu" in text
    assert str(jax_ops.explain(lambda x: x + 1, x)).startswith("jax_ops.explain: no jax_ops ops")
    # The environment switch prints decisions as functions are lowered.
    monkeypatch.setenv("JAX_OPS_EXPLAIN", "1")
    jax.jit(lambda x: jax_ops.rms_norm(x * 3.0)).lower(x)
    assert "jax_ops: rms_norm fwd bfloat16[3,5,64]" in capsys.readouterr().err


def test_explicit_choice_that_cannot_serve_the_shape_says_why():
    x = jnp.ones((2, 40000), jnp.float32)
    with pytest.raises(ValueError, match=r"implementation='pallas' can't run layer_norm fwd "
                                         r"float32\[2,40000\].*cols <= 32768.*can: \[.*'xla'"):
        jax_ops.layer_norm(x, implementation="pallas")
    # The automatic choice skips it.
    assert "pallas" not in {d.implementation for d in jax_ops.explain(jax_ops.layer_norm, x)}


# ---------------------------------------------------- user implementations ---

def test_register_implementation_forward_only():
    calls = []

    def my_layer_norm(x, scale, bias, *, epsilon):
        """a two-pass jnp LayerNorm"""
        calls.append(x.shape)
        xf = x.astype(jnp.float32)
        mu = xf.mean(-1, keepdims=True)
        y = (xf - mu) * jax.lax.rsqrt(((xf - mu) ** 2).mean(-1, keepdims=True) + epsilon)
        return (y * scale + bias).astype(x.dtype)

    jax_ops.register_implementation("layer_norm", "mine", my_layer_norm)
    try:
        assert "mine" in jax_ops.implementations("layer_norm")
        x, s, b = _inputs((2, 3, 48))
        got = jax.grad(_loss, argnums=(0, 1, 2))
        ref = jax.jit(got)(x, s, b)
        with jax_ops.use(layer_norm="mine"):
            choices = jax_ops.explain(got, x, s, b)
            out = jax.jit(got)(x, s, b)
        assert [d.implementation for d in choices][0] == "mine"
        assert "has no bwd stage; automatic" in str(choices[1])  # backward chosen automatically
        assert calls and calls[-1] == (6, 48)  # fn sees (rows, cols)
        for a, r in zip(out, ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-5)
        y = jax_ops.layer_norm(x, s, b, implementation="mine")
        np.testing.assert_allclose(np.asarray(y), np.asarray(jax_ops.layer_norm(x, s, b)), rtol=1e-5, atol=1e-5)
    finally:
        jax_ops.unregister_implementation("layer_norm", "mine")
    assert "mine" not in jax_ops.implementations("layer_norm")


def test_register_implementation_with_backward_supports_and_prefer():
    def fwd(x, scale, *, epsilon):  # rms_norm: returns (y, rstd) so no statistics are recomputed
        xf = x.astype(jnp.float32)
        rstd = jax.lax.rsqrt(jnp.mean(xf * xf, -1) + epsilon)
        return (xf * rstd[:, None] * scale).astype(x.dtype), rstd

    def bwd(dy, x, mean, rstd, scale):
        assert mean is None
        xf, g = x.astype(jnp.float32), dy.astype(jnp.float32) * scale
        xhat = xf * rstd[:, None]
        dx = rstd[:, None] * (g - xhat * jnp.mean(g * xhat, -1, keepdims=True))
        return dx, jnp.sum(dy.astype(jnp.float32) * xhat, 0)

    jax_ops.register_implementation("rms_norm", "user_rms", fwd, backward=bwd, prefer=True,
                                    supports=lambda q: (q.cols % 16 == 0, "cols must be a multiple of 16"))
    try:
        x, s, _ = _inputs((5, 64))
        loss = lambda x, s: jnp.sum(jax_ops.rms_norm(x, s) ** 2)
        assert [d.implementation for d in jax_ops.explain(jax.grad(loss, (0, 1)), x, s)] == ["user_rms"] * 2
        dx, ds = jax.grad(loss, (0, 1))(x, s)
        rdx, rds = jax.grad(lambda x, s: jnp.sum(jax_ops.rms_norm(x, s, implementation="xla") ** 2), (0, 1))(x, s)
        np.testing.assert_allclose(np.asarray(dx), np.asarray(rdx), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(ds), np.asarray(rds), rtol=1e-5, atol=1e-5)
        x2, s2, _ = _inputs((5, 60))  # refused by supports(): automatic choice passes it by
        assert "user_rms" not in {d.implementation for d in jax_ops.explain(loss, x2, s2)}
        with pytest.raises(ValueError, match=r"'user_rms' can't run.*multiple of 16"):
            jax_ops.rms_norm(x2, s2, implementation="user_rms")
    finally:
        jax_ops.unregister_implementation("rms_norm", "user_rms")


def test_register_implementation_errors():
    with pytest.raises(ValueError, match=r"'cuda' is a built-in implementation"):
        jax_ops.register_implementation("layer_norm", "cuda", lambda x, s, b, *, epsilon: x)
    with pytest.raises(ValueError, match=r"name must be an identifier"):
        jax_ops.register_implementation("layer_norm", "my impl", lambda x, s, b, *, epsilon: x)
    with pytest.raises(ValueError, match=r"unknown op 'layernorm'"):
        jax_ops.register_implementation("layernorm", "mine", lambda x, s, b, *, epsilon: x)
    with pytest.raises(ValueError, match=r"'xla' is built in"):
        jax_ops.unregister_implementation("layer_norm", "xla")


# -------------------------------------------------------- measured tables ---

def _table(kind, entries, cc="9.0", sms=132):
    return {"device_kind": kind, "compute_capability": cc, "sm_count": sms, "command": "test",
            "_path": "test.json", "entries": entries}


def _entry(op, stage, dtype, rows, cols, **us):
    return {"op": op, "stage": stage, "dtype": dtype, "rows": rows, "cols": cols, "us": us}


def test_table_lookup_picks_nearest_entry_fastest_supported(monkeypatch):
    table = _table("NVIDIA H200", [
        _entry("layer_norm", "fwd", "bfloat16", 49152, 256, xla=10.0, cuda=8.0, pallas=9.0),
        _entry("layer_norm", "fwd", "bfloat16", 49152, 4096, xla=50.0, cuda=45.0, pallas=40.0),
        _entry("layer_norm", "bwd", "bfloat16", 49152, 4096, xla=90.0, cuda=60.0, pallas=70.0),
    ])
    monkeypatch.setattr(dispatch, "_tables", lambda: (table,))
    assert dispatch.table_for("NVIDIA H200") is table
    # another SKU with the same compute capability and SM count: the table, and why
    nvl = dispatch.Device("NVIDIA H200 NVL", "9.0", 132)
    assert dispatch.table_for(nvl) is table
    assert "same compute capability 9.0 and 132 SMs as NVIDIA H200 NVL" in dispatch.table_match(nvl)[1]
    # fewer SMs (an H100 PCIe has 114), another generation, or nothing known: heuristics
    assert dispatch.table_for(dispatch.Device("NVIDIA H100 PCIe", "9.0", 114)) is None
    assert dispatch.table_for(dispatch.Device("NVIDIA A100-SXM4-80GB", "8.0", 108)) is None
    assert dispatch.table_for("NVIDIA A100-SXM4-80GB") is None
    assert "no measured table for NVIDIA H100 PCIe (compute capability 9.0, 114 SMs): heuristics" == \
        dispatch.table_match(dispatch.Device("NVIDIA H100 PCIe", "9.0", 114))[1]
    impls = {i.name: i for i in registry.all_of("layer_norm")}

    def pick(stage, cols, names=("xla", "cuda", "pallas"), dtype="bfloat16"):
        q = Query("layer_norm", stage, "cuda", (8192, cols), dtype, "NVIDIA H200")
        return dispatch._from_table(q, {n: impls[n] for n in names})

    assert pick("fwd", 300)[0] == "cuda"
    assert pick("fwd", 3000)[0] == "pallas"
    assert pick("fwd", 3000, names=("xla", "cuda"))[0] == "cuda"
    assert pick("bwd", 8192)[0] == "cuda"
    assert "measured table test.json at bfloat16[49152,4096]: pallas 40.0us, cuda 45.0us" in pick("fwd", 5000)[1]
    assert pick("fwd", 300, dtype="float32")[0] == "cuda"  # other dtype: nearest still
    # The training forward has its own entries where measured, else the plain forward's.
    q = Query("layer_norm", "fwd", "cuda", (8192, 4096), "bfloat16", "NVIDIA H200", "stats")
    assert dispatch._from_table(q, impls)[0] == "pallas"
    table["entries"].append(_entry("layer_norm", "fwd_stats", "bfloat16", 49152, 4096, xla=70.0, cuda=50.0, pallas=60.0))
    assert dispatch._from_table(q, impls)[0] == "cuda"


def test_table_lookup_keeps_to_the_dtype_width_and_interpolates_between_widths(monkeypatch):
    table = _table("NVIDIA H100 80GB HBM3", [
        _entry("layer_norm", "fwd", "float32", 49152, 256, cuda=36.0, pallas=35.0),
        _entry("layer_norm", "fwd", "float32", 49152, 1024, cuda=136.0, pallas=150.0),
        _entry("layer_norm", "fwd", "bfloat16", 49152, 512, cuda=40.0, pallas=30.0),
        _entry("layer_norm", "fwd", "bfloat16", 49152, 2048, cuda=100.0, pallas=140.0),
    ])
    monkeypatch.setattr(dispatch, "_tables", lambda: (table,))
    impls = {i.name: i for i in registry.all_of("layer_norm") if i.name in ("cuda", "pallas")}

    def pick(cols, dtype):
        return dispatch._from_table(Query("layer_norm", "fwd", "cuda", (49152, cols), dtype,
                                          "NVIDIA H100 80GB HBM3"), impls)

    # float32 at 512: not bfloat16 512's pick (pallas) but its own widths', interpolated:
    # cuda (36 * 136) ** 0.5 = 70.0 against pallas (35 * 150) ** 0.5 = 72.5.
    name, reason = pick(512, "float32")
    assert name == "cuda" and "float32[49152,256..1024], interpolated: cuda 70.0us, pallas 72.5us" in reason
    # Nearer the 256 entry the interpolation follows it (pallas 35 vs cuda 36 there).
    assert pick(260, "float32")[0] == "pallas"
    # A measured width is taken as it is; float16 may stand in with bfloat16's entries (same
    # bytes a row), float32's never do.
    assert pick(1024, "float32")[1].count("float32[49152,1024]:") == 1
    name, reason = pick(512, "float16")
    assert name == "pallas" and "bfloat16[49152,512]: pallas 30.0us" in reason
    # Past the widest measured width: the nearest entry (no extrapolation).
    assert "float32[49152,1024]: cuda 136.0us" in pick(8192, "float32")[1]


def test_table_estimates_a_padding_kernel_from_the_width_of_its_tile(monkeypatch):
    # Pallas' norm kernels pad a row to a power of two: at 4352 columns they do the
    # 8192-column tile's work. Interpolated between 4096 (pallas narrowly first) and 8192,
    # pallas would win at 4352; from 8192's time, (4352 / 8192) ** 0.8 of it, cuda does.
    table = _table("NVIDIA H100 80GB HBM3", [
        _entry("rms_norm", "fwd", "bfloat16", 49152, 4096, cuda=274.7, pallas=272.3),
        _entry("rms_norm", "fwd", "bfloat16", 49152, 8192, cuda=578.9, pallas=565.5),
    ])
    monkeypatch.setattr(dispatch, "_tables", lambda: (table,))
    impls = {i.name: i for i in registry.all_of("rms_norm") if i.name in ("cuda", "pallas")}
    assert impls["pallas"].tile_cols(4352) == 8192 and impls["cuda"].tile_cols is None

    def pick(cols):
        return dispatch._from_table(Query("rms_norm", "fwd", "cuda", (49152, cols), "bfloat16",
                                          "NVIDIA H100 80GB HBM3"), impls)

    name, reason = pick(4352)
    pallas_us = 565.5 * (4352 / 8192) ** 0.8
    assert name == "cuda" and f"pallas {pallas_us:.1f}us" in reason and "pallas from 8192: same tile" in reason
    # At a measured width the entry decides as measured, and cuda, without a tile, is
    # interpolated as before.
    assert pick(4096)[0] == "pallas"
    cuda_us = 274.7 * (578.9 / 274.7) ** (math.log(4352 / 4096) / math.log(2))
    assert f"cuda {cuda_us:.1f}us" in pick(4352)[1]
    # Without the tile (an implementation that does not pad), the interpolation picks pallas.
    impls["pallas"] = dataclasses.replace(impls["pallas"], tile_cols=None)
    assert pick(4352)[0] == "pallas"


def test_table_tie_goes_to_the_hand_kernels(monkeypatch):
    # H200 add_rms_norm bf16 training forward at 256 columns: pallas 27.74 against cuda
    # 27.82 us (0.3 %, within an entry's spread) is a tie, and cuda takes it; at 1 % pallas
    # keeps its lead, and without cuda among the candidates the fastest is taken as before.
    table = _table("NVIDIA H200", [
        _entry("add_rms_norm", "fwd_stats", "bfloat16", 49152, 256, cuda=27.824, pallas=27.739),
        _entry("add_rms_norm", "fwd_stats", "bfloat16", 49152, 512, cuda=52.9, pallas=52.363, xla=52.4),
    ])
    monkeypatch.setattr(dispatch, "_tables", lambda: (table,))
    impls = {i.name: i for i in registry.all_of("add_rms_norm")}

    def pick(cols, names=("xla", "cuda", "pallas")):
        q = Query("add_rms_norm", "fwd", "cuda", (49152, cols), "bfloat16", "NVIDIA H200", "stats")
        return dispatch._from_table(q, {n: impls[n] for n in names})

    name, reason = pick(256)
    assert name == "cuda" and "pallas 27.7us, cuda 27.8us (within 0.5% of pallas: a tie, cuda taken)" in reason
    assert pick(512)[0] == "pallas"
    assert pick(256, names=("xla", "pallas"))[0] == "pallas"


def test_table_of_same_generation_serves_an_op_this_gpu_was_not_measured_for(monkeypatch):
    h200 = _table("NVIDIA H200", [_entry("layer_norm", "fwd", "bfloat16", 49152, 256, xla=10.0, cuda=8.0, pallas=9.0)])
    h100 = dict(_table("NVIDIA H100 80GB HBM3", [
        _entry("softmax", "fwd", "bfloat16", 49152, 256, xla=10.0, cuda=12.0, pallas=9.0)]), _path="h100.json")
    monkeypatch.setattr(dispatch, "_tables", lambda: (h200, h100))
    impls = {i.name: i for i in registry.all_of("softmax")}
    q = Query("softmax", "fwd", "cuda", (8192, 256), "bfloat16", "NVIDIA H200")
    name, reason = dispatch._from_table(q, impls)
    assert name == "pallas" and "h100.json" in reason
    # Another generation (A100) gets no table: heuristics decide.
    q = Query("softmax", "fwd", "cuda", (8192, 256), "bfloat16", "NVIDIA A100-SXM4-80GB")
    assert dispatch._from_table(q, impls) is None


def test_table_keeps_word_classes_apart(monkeypatch):
    # Rows of whole 16-byte words, of 8-byte words (the norms' half-word packs) and of
    # neither (a value a load: H100 bf16 LayerNorm 1001, cuda against xla 97.5 / 97.6 us
    # fwd) are looked up among their own class; an H200 table without them borrows the
    # H100's. Rows of 8-byte words without entries of theirs take those of single values.
    h100 = dict(_table("NVIDIA H100 80GB HBM3", [
        _entry("layer_norm", "fwd", "bfloat16", 49152, 256, xla=30.0, cuda=18.0, pallas=20.0),
        _entry("layer_norm", "fwd", "bfloat16", 49152, 512, xla=60.0, cuda=36.0, pallas=40.0),
        _entry("layer_norm", "fwd", "bfloat16", 49152, 268, xla=35.4, cuda=39.4, pallas=28.7),
        _entry("layer_norm", "fwd", "bfloat16", 49152, 1004, xla=97.0, cuda=120.0, pallas=131.0),
        _entry("layer_norm", "fwd", "bfloat16", 49152, 1001, xla=97.6, cuda=97.5, pallas=132.5),
        _entry("layer_norm", "fwd", "float32", 49152, 268, xla=70.0, cuda=40.0, pallas=50.0),
    ]), _path="h100.json")
    h200 = dict(_table("NVIDIA H200", [
        _entry("layer_norm", "fwd", "bfloat16", 49152, 256, xla=20.0, cuda=12.0, pallas=14.0),
        _entry("layer_norm", "fwd", "bfloat16", 49152, 512, xla=40.0, cuda=24.0, pallas=28.0),
    ]), _path="h200.json")
    monkeypatch.setattr(dispatch, "_tables", lambda: (h100, h200))
    impls = {i.name: i for i in registry.all_of("layer_norm")}

    def pick(cols, kind="NVIDIA H100 80GB HBM3", dtype="bfloat16"):
        return dispatch._from_table(Query("layer_norm", "fwd", "cuda", (49152, cols), dtype, kind), impls)

    half = (16, 8)  # the norms' cuda load_words
    assert [dispatch.row_word(c, "bfloat16", half) for c in (264, 268, 270, 1001)] == [16, 8, 2, 2]
    assert [dispatch.row_word(c, "float32", half) for c in (268, 270, 269)] == [16, 8, 4]
    assert [dispatch.row_word(c, "bfloat16") for c in (264, 268)] == [16, 2]  # no half words
    # 264 and 272 (16-byte words) interpolate between 256 and 512, never through 268.
    for cols in (264, 272):
        name, reason = pick(cols)
        assert name == "cuda" and "bfloat16[49152,256..512], interpolated" in reason
    # 268 is measured; 260 (8-byte words) is nearest 268; 300 and 500 interpolate between
    # 268 and 1004 (not 1001, of single values): pallas (28.7 -> 131) against xla (35.4 -> 97).
    assert pick(268)[0] == "pallas" and "bfloat16[49152,268]:" in pick(268)[1]
    assert pick(260)[0] == "pallas" and pick(300)[0] == "pallas"
    name, reason = pick(500)
    assert "bfloat16[49152,268..1004], interpolated" in reason
    # 270 and 999 (neither) take 1001, the one entry of their class.
    for cols in (270, 999):
        name, reason = pick(cols)
        assert name == "cuda" and "bfloat16[49152,1001]:" in reason
    # float16 takes bfloat16's entries of its class; float32 268 is 16-byte words (its own).
    assert pick(268, dtype="float16")[0] == "pallas"
    assert pick(268, dtype="float32")[0] == "cuda"
    # The H200: its own entries for whole words; the H100's for the others, saying so.
    assert pick(264, "NVIDIA H200")[1].startswith("measured table h200.json")
    name, reason = pick(268, "NVIDIA H200")
    assert name == "pallas" and "h100.json" in reason and "rows of whole 8-byte words, not 16-byte ones" in reason
    assert "rows loaded a value at a time" in pick(270, "NVIDIA H200")[1]
    # Of the class but of another value size (float32 270: 8-byte words) in this GPU's
    # table: bfloat16 268 still borrows the H100's bfloat16 entries; float32 270 takes its
    # own table's.
    h200["entries"].append(_entry("layer_norm", "fwd", "float32", 49152, 270, xla=60.0, cuda=30.0, pallas=80.0))
    assert pick(268, "NVIDIA H200")[0] == "pallas"
    assert pick(270, "NVIDIA H200", dtype="float32")[1].startswith("measured table h200.json")
    # Borrowed entries must time a candidate: with pallas the only one, the H100's bwd
    # entry of xla alone is no entry (it would leave nothing to pick), so the H200's own
    # entries decide.
    only = {n: impls[n] for n in ("pallas",)}
    h100["entries"].append(_entry("layer_norm", "bwd", "bfloat16", 49152, 268, xla=50.0))
    h200["entries"].append(_entry("layer_norm", "bwd", "bfloat16", 49152, 256, xla=9.0, pallas=8.0))
    qb = Query("layer_norm", "bwd", "cuda", (49152, 268), "bfloat16", "NVIDIA H200")
    name, reason = dispatch._from_table(qb, only)
    assert name == "pallas" and reason.startswith("measured table h200.json")
    # Of the class but of another value size only, and no other table: those entries
    # (float32 270's cuda); no entry of the class anywhere: all of them, as before.
    monkeypatch.setattr(dispatch, "_tables", lambda: (h200,))
    assert "float32[49152,270]" in pick(268, "NVIDIA H200")[1]
    bare = dict(_table("NVIDIA H200", h200["entries"][:2]), _path="bare.json")
    monkeypatch.setattr(dispatch, "_tables", lambda: (bare,))
    name, reason = pick(268, "NVIDIA H200")
    assert name == "cuda" and "bfloat16[49152,256..512], interpolated" in reason
    # Rows of 8-byte words with no entry of theirs anywhere take those of single values
    # (bfloat16 1001), before those of 16-byte words.
    single = dict(_table("NVIDIA H100 80GB HBM3", [e for e in h100["entries"] if e["cols"] != 268 and e["cols"] != 1004
                                                   and e["dtype"] == "bfloat16" and e["stage"] == "fwd"]), _path="s.json")
    monkeypatch.setattr(dispatch, "_tables", lambda: (single,))
    assert "bfloat16[49152,1001]:" in pick(268)[1]
    # An entry's "word" is the load width it was timed at: bfloat16 268 timed a value a
    # load is of the single values' class, beside 1001 (so 500 interpolates between them).
    single["entries"].append(_entry("layer_norm", "fwd", "bfloat16", 49152, 268, xla=35.4, cuda=39.4, pallas=28.7))
    single["entries"][-1]["word"] = 2
    assert "bfloat16[49152,268..1001], interpolated" in pick(500)[1] and pick(270)[0] == "pallas"
    # One width of q's value size in its class stands for no other: float32 entries of the
    # class (nearest by _distance) serve bfloat16 33, 1001 its neighbours.
    single["entries"] = [e for e in single["entries"] if e["cols"] != 268] + [
        _entry("layer_norm", "fwd", "float32", 49152, 35, xla=9.0, cuda=8.0, pallas=6.0),
        _entry("layer_norm", "fwd", "float32", 49152, 4099, xla=600.0, cuda=700.0, pallas=650.0)]
    assert pick(33)[0] == "pallas" and "float32[49152,35]" in pick(33)[1]
    assert "bfloat16[49152,1001]" in pick(999)[1]
    # Ops whose kernels have no half-word packs (load_words 16 only) keep rows of 8-byte
    # words with those of single values: softmax bfloat16 4099 interpolates between 1001
    # and 4100 (as (16, 8) would class 4100 apart, leaving 1001's cuda).
    sm = {i.name: i for i in registry.all_of("softmax")}
    smt = dict(_table("NVIDIA H100 80GB HBM3", [
        _entry("softmax", "fwd", "bfloat16", 49152, 256, xla=30.0, cuda=18.0, pallas=20.0),
        _entry("softmax", "fwd", "bfloat16", 49152, 1001, xla=108.0, cuda=100.0, pallas=132.0),
        _entry("softmax", "fwd", "bfloat16", 49152, 4100, xla=291.0, cuda=678.0, pallas=325.0)]), _path="sm.json")
    monkeypatch.setattr(dispatch, "_tables", lambda: (smt,))
    name, reason = dispatch._from_table(Query("softmax", "fwd", "cuda", (49152, 4099), "bfloat16",
                                              "NVIDIA H100 80GB HBM3"), sm)
    assert name == "xla" and "bfloat16[49152,1001..4100], interpolated" in reason
    # The classes are the op's cuda kernels', whatever the call may take: with pallas and
    # xla only, bfloat16 268 still skips the single-value entry of 268 (word 2).
    only2 = {n: impls[n] for n in ("pallas", "xla")}
    h100["entries"].insert(0, dict(_entry("layer_norm", "fwd", "bfloat16", 49152, 268, xla=5.0, pallas=50.0), word=2))
    monkeypatch.setattr(dispatch, "_tables", lambda: (h100,))
    name, reason = dispatch._from_table(
        Query("layer_norm", "fwd", "cuda", (49152, 268), "bfloat16", "NVIDIA H100 80GB HBM3"), only2)
    assert name == "pallas" and "bfloat16[49152,268]:" in reason


def test_shipped_tables_are_well_formed():
    tables = dispatch._tables()
    # H100 and H200 tables ship inside the package (installed, not just in the source tree).
    assert {"NVIDIA H100 80GB HBM3", "NVIDIA H200"} <= {t["device_kind"] for t in tables}
    # H100 NVL and GH200 (132 SMs, compute capability 9.0) use the H100's; the H100 PCIe
    # (114 SMs) none: a table is matched on the properties that set its times.
    assert dispatch.table_for(dispatch.Device("NVIDIA H100 NVL", "9.0", 132))["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert dispatch.table_for(dispatch.Device("NVIDIA GH200 480GB", "9.0", 132))["device_kind"] == "NVIDIA H100 80GB HBM3"
    assert dispatch.table_for(dispatch.Device("NVIDIA H100 PCIe", "9.0", 114)) is None
    for t in tables:
        assert t["device_kind"] and t["command"] and t["entries"], t["_path"]
        assert t["compute_capability"] and t["sm_count"] > 0, t["_path"]
        for e in t["entries"]:
            assert e["stage"] in ("fwd", "fwd_stats", "fwd_mask", "bwd") and e["op"] in registry.ops()
            assert set(e["us"]) <= set(jax_ops.IMPLEMENTATIONS) and min(e["us"].values()) > 0
            assert e.get("word", 2) in (2, 4, 8, 16), e


# --------------------------------------------------------------- autotune ---

def test_autotune_times_candidates_and_caches_winners(tmp_cache, capsys):
    x, s, b = _inputs((16, 64))
    grad = jax.grad(_loss, argnums=(0, 1, 2))
    results = jax_ops.autotune(grad, x, s, b, implementations=("xla", "pallas"), max_configs=2,
                               repeats=2)
    assert [r["query"].split(" ")[:2] for r in results] == [["layer_norm", "fwd+stats"], ["layer_norm", "bwd"]]
    for r in results:
        assert r["implementation"] in ("xla", "pallas")
        assert len(r["us"]) == 3 and min(r["us"].values()) == r["us"][next(iter(r["us"]))]
    err = capsys.readouterr().err
    assert "jax_ops.autotune [1/2] layer_norm fwd+stats float32[16,64]" in err and "saved to" in err
    data = json.loads(tmp_cache.read_text())
    kind = dispatch.device_kind(PLATFORM)
    assert data["format"] == cache.FORMAT
    assert set(data["devices"][kind]) == {"layer_norm|fwd_stats|float32|16,64", "layer_norm|bwd|float32|16,64"}
    assert {e["version"] for e in data["devices"][kind].values()} == {cache.library_version()}
    # Later automatic choices follow the cache...
    decisions = jax_ops.explain(grad, x, s, b)
    assert [d.implementation for d in decisions] == [r["implementation"] for r in results]
    assert all(d.reason == "autotune cache" for d in decisions)
    # ...with the tuned config, and only for that exact shape.
    assert decisions[0].config == results[0]["config"]
    other = jax_ops.explain(grad, *_inputs((16, 65)))
    assert all(d.reason != "autotune cache" for d in other)
    # A hand-edited cache entry steers the choice (and is bitwise what it names).
    assert jax_ops.explain(jax_ops.layer_norm, x, s, b)[0].reason != "autotune cache"  # inference fwd
    data["devices"][kind]["layer_norm|fwd|float32|16,64"] = {
        "implementation": "pallas", "config": {"block_rows": 4, "num_warps": 1}, "us": {},
        "version": cache.library_version()}
    tmp_cache.write_text(json.dumps(data))
    d = jax_ops.explain(jax_ops.layer_norm, x, s, b)[0]
    assert (d.implementation, d.config) == ("pallas", {"block_rows": 4, "num_warps": 1})
    y = jax.jit(jax_ops.layer_norm)(x, s, b)
    # The kernel with the named config: another block_rows may round differently (under
    # jax 0.12.1 the default tile's output differs from this one's in the last bits).
    named = pallas_norm.norm_fwd(x, s, b, epsilon=1e-5, rms=False, with_stats=False,
                                 config={"block_rows": 4, "num_warps": 1}, interpret=PLATFORM != "cuda")[0]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(named))


@pytest.mark.parametrize("content, warning", [
    ("{not json", "ignoring unreadable autotune cache"),
    ("[1, 2]", "not a JSON object"),
    # the format of earlier builds: {device kind: {key: entry}}
    ('{"cpu": {"layer_norm|fwd|float32|4,32": {"implementation": "pallas", "config": {}}}}',
     "format None, expected 2"),
])
def test_autotune_cache_unreadable_or_foreign_is_ignored_with_a_warning(tmp_cache, content, warning):
    cache._WARNED.clear()
    tmp_cache.write_text(content)
    x, s, b = _inputs()
    with pytest.warns(cache.AutotuneCacheWarning, match=warning):
        d = jax_ops.explain(jax_ops.layer_norm, x, s, b)[0]
    assert d.reason != "autotune cache"
    assert tuning.cache_path() == tmp_cache


@pytest.mark.parametrize("entry, warning", [
    # another jax_ops version measured it
    ({"implementation": "pallas", "config": None, "version": "0.0.1"}, "measured by jax_ops 0.0.1"),
    # a config the kernel no longer takes (the KeyError: 'block_rows' of older builds)
    ({"implementation": "pallas", "config": {"tile": 7}, "version": None}, "not an implementation/config"),
    ({"implementation": "gone", "config": None, "version": None}, "not an implementation/config"),
])
def test_stale_autotune_entries_are_ignored_with_a_warning(tmp_cache, entry, warning):
    cache._WARNED.clear()
    x, s, b = _inputs()
    kind = dispatch.device_kind(PLATFORM)
    entry = dict(entry, version=entry["version"] or cache.library_version(), us={})
    key = dispatch.cache_key(query(*op_calls(jax_ops.layer_norm, x, s, b)[0], PLATFORM))
    tmp_cache.write_text(json.dumps({"format": cache.FORMAT, "devices": {kind: {key: entry}}}))
    with pytest.warns(cache.AutotuneCacheWarning, match=warning):
        d = jax_ops.explain(jax_ops.layer_norm, x, s, b)[0]
    assert d.reason != "autotune cache"
    y = jax.jit(jax_ops.layer_norm)(x, s, b)  # lowering is unaffected
    assert bool(jnp.all(jnp.isfinite(y)))


def test_masked_softmax_has_its_own_table_stage():
    """Masked/causal softmax forwards are looked up as stage fwd_mask (their kernels'
    order differs from the unmasked one); a non-last axis is 'strided' and leaves the
    kernels out of the automatic choice."""
    import json
    from jax_ops.ops.softmax import FWD
    x = jnp.zeros((4, 8, 1024), jnp.bfloat16)
    params = dict(axis=-1, scale=1.0, log=False, causal=True, mask_kind="none", implementation=None,
                  present=(True, False))  # no mask: only x is bound
    q = query(FWD.prim, (x,), params, "cuda")
    assert (q.variant, q.table_stage) == ("mask", "fwd_mask")
    assert query(FWD.prim, (x,), dict(params, causal=False), "cuda").variant == ""
    strided = query(FWD.prim, (x,), dict(params, axis=-2, causal=False), "cuda")
    assert strided.variant == "strided" and strided.cols == 8
    impls = {i.name: i for i in registry.all_of("softmax")}
    assert impls["cuda"].why_not_automatic(strided) is not None
    table = json.loads((dispatch.TABLE_DIR / "nvidia_h100_80gb_hbm3.json").read_text())
    masked = [e for e in table["entries"] if e["op"] == "softmax" and e["stage"] == "fwd_mask"]
    assert masked, "the shipped H100 table has masked softmax times"
    e = masked[-1]
    q = registry.Query("softmax", "fwd", "cuda", (e["rows"], e["cols"]), e["dtype"],
                       table["device_kind"], "mask")
    name, reason = dispatch._from_table(q, impls)
    assert name == min(e["us"], key=e["us"].get) and f"{e['us'][name]:.1f}us" in reason
