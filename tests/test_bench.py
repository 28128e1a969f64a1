"""The benchmark's own logic on CPU: the training-forward mode, the error measure, the
CLI with its dispatch-table writer, the public Python API (run, measure) and the charts
(--plot, --plot --from; matplotlib is a test dependency)."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ops
from jax_ops import bench

# ReLU's op module is being moved to the op-declaration framework: until jax_ops.relu is
# back, its benchmark can't run (its spec still builds: specs import no op module).
needs_relu = pytest.mark.skipif(not hasattr(jax_ops, "relu"), reason="jax_ops.relu is not importable")


@pytest.mark.parametrize("impl", ["cuda", "pallas", "xla"])
def test_fwd_res_leaves_out_residuals_that_are_inputs_or_outputs(impl):
    """fwd_res returns y and the residuals the forward writes besides y: layer_norm's VJP
    keeps x and scale (inputs), add_layer_norm's also h (an output); returned again they
    would be copied inside the timed call. What stays is each norm's mean and rstd."""
    (xn, norm_params, _) = bench.make_sets("layer_norm", jnp.float32, 16, 40, 1, True, seed=3)[0]
    norm = bench.make_op("layer_norm", impl, jnp.float32)
    _, res = jax.jit(bench.per_set_fn(norm, "fwd_res"))(xn, norm_params)
    assert [(r.shape, r.dtype) for r in res] == [((16,), jnp.float32)] * 2
    np.testing.assert_allclose(np.asarray(res[0]), np.asarray(xn, np.float64).mean(-1), rtol=1e-5, atol=1e-6)

    (xa, add_params, _) = bench.make_sets("add_layer_norm", jnp.bfloat16, 16, 40, 1, True, seed=4)[0]
    add_norm = bench.make_op("add_layer_norm", impl, jnp.bfloat16)
    (_, h), res = jax.jit(bench.per_set_fn(add_norm, "fwd_res"))(xa, add_params)
    _, vjp_fn = jax.vjp(add_norm, xa, *add_params)
    assert any(k.shape == h.shape and k.dtype == h.dtype for k in jax.tree.leaves(vjp_fn))  # h is kept...
    assert [(r.shape, r.dtype) for r in res] == [((16,), jnp.float32)] * 2  # ...but not returned again
    h_ref = np.asarray(xa, np.float64) + np.asarray(add_params[0], np.float64)
    np.testing.assert_allclose(np.asarray(res[0]), h_ref.astype(jnp.bfloat16).astype(np.float64).mean(-1),
                               rtol=1e-4, atol=1e-4)


@needs_relu
def test_fwd_res_returns_the_residuals_the_forward_writes(tmp_path):
    """fwd_res times jax.vjp's forward: y and the residuals of the VJP the backward of
    the same implementation consumes, but not those that are the inputs themselves (the
    forward writes nothing for them; returned, they would be copied)."""
    (x, params, dy) = bench.make_sets("relu", jnp.bfloat16, 64, 96, 1, True, seed=3)[0]
    fn = bench.make_op("relu", "xla", jnp.bfloat16)
    (args,) = bench.mode_args(fn, "fwd_res", [(x, params, dy)])
    y, res = jax.jit(bench.per_set_fn(fn, "fwd_res"))(*args)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.maximum(np.asarray(x, np.float32), 0))
    _, vjp_fn = jax.vjp(fn, x, *params)
    kept = jax.tree.leaves(vjp_fn)
    # The packed mask is the residual, so it is written, and it is the VJP's own.
    (mask,) = [r for r in res if r.dtype == jnp.uint32]
    assert any(k.dtype == jnp.uint32 and np.array_equal(np.asarray(k), np.asarray(mask)) for k in kept)

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


def test_step_mode_is_fwd_bwd_with_dy_after_y():
    """step: the same outputs as fwd_bwd, but dy passes an optimization barrier with y,
    so XLA can't start the backward's reductions over dy in the forward's pass over x
    (no model can: dy depends on y)."""
    (x, params, dy) = bench.make_sets("layer_norm", jnp.float32, 8, 40, 1, True, seed=5)[0]
    fn = bench.make_op("layer_norm", "flax", jnp.float32)
    outs = {}
    for mode in ("fwd_bwd", "step"):
        (args,) = bench.mode_args(fn, mode, [(x, params, dy)])
        f = jax.jit(bench.per_set_fn(fn, mode))
        outs[mode] = f(*args)
        barrier = "optimization_barrier" in f.lower(*args).as_text()
        assert barrier == (mode == "step"), mode
    jax.tree.map(np.testing.assert_array_equal, outs["step"], outs["fwd_bwd"])
    assert bench.min_bytes("layer_norm", "step", 8, 40, "f32") == \
        bench.min_bytes("layer_norm", "fwd_bwd", 8, 40, "f32")


def test_table_training_forward_from_step_and_no_stale_xla_entry(tmp_path):
    """--table: the training forward is step - bwd where the run has step (fwd_bwd lets
    XLA fuse across the stages); an xla training forward from an older run goes when
    this run's fastest backward is not xla's (it was only real next to xla's backward);
    other implementations' older times of an entry are kept."""
    from jax_ops.bench.report import Record
    from jax_ops.bench.tables import write_table
    path = tmp_path / "t.json"
    key = dict(op="rms_norm", stage="fwd_stats", dtype="bfloat16", rows=64, cols=4096)
    path.write_text(json.dumps({"device_kind": "cpu", "entries": [
        {**key, "us": {"xla": 50.0, "pallas": 70.0}}]}))
    times = {("bwd", "cuda"): 100.0, ("bwd", "xla"): 130.0, ("fwd_bwd", "cuda"): 160.0,
             ("step", "cuda"): 170.0, ("fwd_bwd", "xla"): 180.0, ("step", "xla"): 240.0}
    recs = [Record("rms_norm", m, "bf16", 64, 4096, impl, "wall", 1, 1, time_us=t)
            for (m, impl), t in times.items()]
    meta = dict(device_kind="cpu", command="test", date="d", git_commit="c", jax_version="j", timer="wall")
    write_table(path, meta, recs)
    entries = json.loads(path.read_text())["entries"]
    (stats,) = [e for e in entries if e["stage"] == "fwd_stats"]
    assert stats["us"] == {"cuda": 70.0, "pallas": 70.0}


def test_table_training_forward_timed_alone_beats_the_difference(tmp_path):
    """--table: where the run times a kernel implementation's training forward alone
    (fwd_res), that time is its fwd_stats entry; step - bwd where it has none, and for
    xla (its fwd_res writes residuals its own step fuses away)."""
    from jax_ops.bench.report import Record
    from jax_ops.bench.tables import write_table
    path = tmp_path / "t.json"
    times = {("bwd", "cuda"): 15.0, ("step", "cuda"): 25.0, ("fwd_res", "cuda"): 10.2,
             ("bwd", "pallas"): 27.7, ("step", "pallas"): 36.8, ("fwd_res", "pallas"): 10.6,
             ("bwd", "xla"): 14.0, ("step", "xla"): 40.0, ("fwd_res", "xla"): 11.5}
    recs = [Record("layer_norm", m, "bf16", 49152, 128, impl, "wall", 1, 1, time_us=t)
            for (m, impl), t in times.items()]
    recs.append(Record("layer_norm", "step", "bf16", 49152, 64, "cuda", "wall", 1, 1, time_us=20.0))
    recs.append(Record("layer_norm", "bwd", "bf16", 49152, 64, "cuda", "wall", 1, 1, time_us=12.0))
    meta = dict(device_kind="cpu", command="test", date="d", git_commit="c", jax_version="j", timer="wall")
    write_table(path, meta, recs)
    stats = {e["cols"]: e["us"] for e in json.loads(path.read_text())["entries"] if e["stage"] == "fwd_stats"}
    assert stats == {128: {"cuda": 10.2, "pallas": 10.6, "xla": 26.0}, 64: {"cuda": 8.0}}


def test_table_keeps_entries_timed_at_another_load_width(tmp_path):
    """--table: an entry with a "word" (timed at another load width than the tree's
    kernels take there) stays beside this run's entry of the same shape, which replaces
    only the one without."""
    from jax_ops.bench.report import Record
    from jax_ops.bench.tables import write_table
    path = tmp_path / "t.json"
    key = dict(op="layer_norm", stage="fwd", dtype="bfloat16", rows=64, cols=268)
    path.write_text(json.dumps({"device_kind": "cpu", "entries": [
        {**key, "word": 2, "us": {"cuda": 39.4}}, {**key, "us": {"cuda": 30.0}}]}))
    meta = dict(device_kind="cpu", command="test", date="d", git_commit="c", jax_version="j", timer="wall")
    write_table(path, meta, [Record("layer_norm", "fwd", "bf16", 64, 268, "cuda", "wall", 1, 1, time_us=21.4)])
    entries = json.loads(path.read_text())["entries"]
    assert sorted((e.get("word", 0), e["us"]["cuda"]) for e in entries if e["stage"] == "fwd") == [(0, 21.4), (2, 39.4)]
    assert sum("word" in e for e in entries) == 1  # no "word" written where none was


def test_rel_err_is_a_relative_norm_not_a_max():
    """One element of many flipped at a ReLU kink must not read as a 100 % error."""
    ref = jnp.ones((1000,), jnp.float32)
    got = ref.at[7].set(0.0)
    assert abs(bench.rel_err(got, ref) - (1 / 1000) ** 0.5) < 1e-6
    assert bench.rel_err((ref, got), (ref, ref)) == bench.rel_err(got, ref)  # worst leaf
    assert bench.rel_err(ref, ref) == 0.0


def test_cli_layer_norm_records_and_dispatch_table(tmp_path):
    """jax-ops-bench end to end on layer_norm: JSON records, fwd_res at the forward's
    floor, and --table's fwd / bwd / fwd_stats entries."""
    out, table = tmp_path / "r.json", tmp_path / "t.json"
    assert bench.main(["--op", "layer_norm", "--rows", "64", "--cols", "96", "--mode",
                       "fwd,fwd_bwd,bwd,fwd_res", "--impl", "xla,jnp", "--repeats", "1",
                       "--dtype", "f32", "--footprint-mb", "1", "--json", str(out),
                       "--table", str(table)]) == 0
    data = json.loads(out.read_text())
    assert data["metadata"]["command"].startswith("python -m jax_ops.bench --op layer_norm")
    assert data["metadata"]["epsilon"] == {"layer_norm": 1e-5}
    recs = data["records"]
    timed = {(r["mode"], r["impl"]) for r in recs if r["time_us"] is not None}
    assert {(m, i) for m in ("fwd", "fwd_bwd", "bwd", "fwd_res") for i in ("xla", "jnp")} <= timed
    res = {r["impl"]: r["min_bytes"] for r in recs if r["mode"] == "fwd_res"}
    assert set(res.values()) == {bench.min_bytes("layer_norm", "fwd", 64, 96, "f32")}
    entries = json.loads(table.read_text())["entries"]
    stages = {e["stage"] for e in entries if e["op"] == "layer_norm" and e["cols"] == 96}
    assert {"fwd", "bwd"} <= stages  # fwd_stats too where fwd_bwd > bwd
    assert all(e["dtype"] == "float32" and e["rows"] == 64 for e in entries)


def test_run_returns_records_with_time_and_bandwidth():
    records = bench.run("layer_norm", rows=64, cols=96, dtype="f32", modes=("fwd",),
                        impls=("xla",), repeats=2, footprint_mb=1)
    by_impl = {r.impl: r for r in records}
    assert set(by_impl) == {"copy", "xla"}
    xla = by_impl["xla"]
    assert (xla.op, xla.mode, xla.dtype, xla.rows, xla.cols) == ("layer_norm", "fwd", "f32", 64, 96)
    assert xla.error is None and xla.time_us > 0 and xla.gbps > 0
    assert xla.min_bytes == bench.min_bytes("layer_norm", "fwd", 64, 96, jnp.float32)
    assert xla.min_bytes == 2 * 64 * 96 * 4 + 2 * 96 * 4  # read x, write y, scale + bias
    assert xla.gbps == pytest.approx(xla.min_bytes / (xla.time_us * 1e-6) / 1e9)
    assert len(xla.times_us) == 2 and xla.k_sets >= 2
    text = bench.format_table(records)
    assert "layer_norm fwd f32, rows=64" in text and "xla" in text
    with pytest.raises(ValueError, match="no_such_op"):
        bench.run("no_such_op", rows=64, cols=96)


def test_measure_times_a_function_and_rotated_sets():
    x = jnp.ones((128, 64), jnp.float32)
    us = bench.measure(lambda a: jnp.tanh(a) * 2, x, repeats=3)
    assert isinstance(us, float) and 0 < us < 1e6
    sets = [(jnp.full((128, 64), i, jnp.float32),) for i in range(4)]
    per_set = bench.measure(jnp.tanh, sets=sets, repeats=3, timer="wall")
    assert 0 < per_set < 1e6
    with pytest.raises(TypeError):
        bench.measure(jnp.tanh, x, sets=sets)


def test_every_benchmark_has_a_spec_from_its_declaration():
    """Every benchmark of the CLI has a spec, whichever op modules import."""
    names = list(bench.specs())
    assert names[:2] == ["layer_norm", "rms_norm"]
    assert {"softmax", "softmax_mask", "relu", "batch_norm_add_relu"} <= set(names)
    assert bench.specs()["softmax_mask"].table_alias == ("softmax", "fwd_mask")
    assert bench.min_bytes("rms_norm", "fwd_res", 8, 16, 2) == bench.min_bytes("rms_norm", "fwd", 8, 16, 2)


def test_two_output_op_gets_a_cotangent_per_result():
    """add_layer_norm returns (y, h): its backward takes (dy, dh), and the records count
    its bytes (read x, residual; write y, h)."""
    recs = bench.run("add_layer_norm", rows=64, cols=96, dtype="f32", modes=("fwd", "fwd_bwd"),
                     impls=("xla", "cuda"), repeats=2, verbose=False)
    timed = [r for r in recs if r.impl in ("xla", "cuda")]
    assert {r.mode for r in timed} == {"fwd", "fwd_bwd"} and all(r.time_us > 0 for r in timed)
    assert bench.min_bytes("add_layer_norm", "fwd", 64, 96, "f32") == 4 * 64 * 96 * 4 + 2 * 96 * 4


@pytest.mark.parametrize("impl", ["flax", "cuda", "xla"])
def test_step_returns_add_norms_shared_gradient_once(impl):
    """add+norm's dx and dresidual are one array: the step returns it once, so XLA
    does not copy it into a second output (a read and a write of x that no model pays),
    and the compiled step has no copy of an activation-sized array."""
    (x, params, dy) = bench.make_sets("add_layer_norm", jnp.float32, 16, 48, 1, True, seed=3)[0]
    fn = bench.make_op("add_layer_norm", impl, jnp.float32)
    (args,) = bench.mode_args(fn, "step", [(x, params, dy)])
    f = jax.jit(bench.per_set_fn(fn, "step"))
    (y, h), *grads = f(*args)
    assert [g.shape for g in grads] == [(16, 48), (48,), (48,)]  # dx (= dresidual), dscale, dbias
    ref = jax.vjp(fn, x, *params)[1](dy)
    np.testing.assert_allclose(grads[0], ref[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(ref[0], ref[1])
    hlo = f.lower(*args).compile().as_text()
    copies = [line for line in hlo.splitlines() if " copy(" in line and "[16,48]" in line]
    assert not copies, copies


# ----------------------------------------------------------------- charts ----

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _pngs(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.png"))}


def test_cli_plot_when_measuring_and_from_the_saved_json(tmp_path):
    """--plot writes a valid PNG per (op, mode, dtype), and --plot --from redraws the
    same charts from the --json file of that run."""
    out = tmp_path / "r.json"
    assert bench.main(["--op", "rms_norm", "--rows", "64", "--cols", "32,128", "--mode",
                       "fwd,fwd_bwd", "--impl", "xla,jnp", "--repeats", "1", "--dtype", "f32",
                       "--footprint-mb", "1", "--json", str(out),
                       "--plot", str(tmp_path / "measured")]) == 0
    measured = _pngs(tmp_path / "measured")
    assert set(measured) == {"rms_norm_fwd_f32.png", "rms_norm_fwd_bwd_f32.png"}
    for name, data in measured.items():
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name
    assert bench.main(["--plot", str(tmp_path / "redrawn"), "--from", str(out)]) == 0
    redrawn = _pngs(tmp_path / "redrawn")
    assert set(redrawn) == set(measured)
    # Same records (JSON floats round-trip exactly), same metadata: the same pixels.
    assert redrawn == measured


def test_cli_plot_from_a_missing_or_invalid_file_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "nope.json"
    assert bench.main(["--plot", str(tmp_path / "p"), "--from", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "--from" in err and "no such file" in err and "nope.json" in err, err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert bench.main(["--plot", str(tmp_path / "p"), "--from", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--from" in err and "is not JSON" in err, err
    table = tmp_path / "table.json"  # JSON, but a dispatch table, not a --json result
    table.write_text(json.dumps({"device_kind": "cpu", "entries": []}))
    assert bench.main(["--plot", str(tmp_path / "p"), "--from", str(table)]) == 2
    err = capsys.readouterr().err
    assert '"records"' in err and "device_kind" in err, err
    assert not (tmp_path / "p").exists() or not list((tmp_path / "p").iterdir())
    with pytest.raises(SystemExit):  # --from only redraws: without --plot it is refused
        bench.main(["--from", str(table)])
    assert "--from" in capsys.readouterr().err


def test_chart_data_points_are_the_json_numbers(tmp_path):
    """Each line of each chart is its implementation's (cols, gbps, 100 * frac_of_copy)
    from the JSON, in increasing cols; an errored size is a gap (NaN); copy is at 100 %."""
    records = [
        bench.Record("softmax", "fwd", "bf16", 256, cols, impl, "wall", 2, 1000 * cols,
                     time_us=t, gbps=g, frac_of_copy=f)
        for cols, impl, t, g, f in [
            (512, "copy", 1.0, 512.0, 1.0), (128, "copy", 0.5, 256.0, 1.0),
            (512, "cuda", 2.0, 256.0, 0.5), (128, "cuda", 0.25, 512.0, 2.0),
            (512, "xla", None, None, None), (128, "xla", 1.0, 128.0, 0.5),
            (128, "mine", 4.0, 32.0, 0.125),  # a name the chart has no colour for
            (128, "pallas", None, None, None)]]  # failed everywhere: no line
    records.append(bench.Record("softmax", "bwd", "bf16", 256, 128, "xla", "wall", 2, 10,
                                time_us=1.0, gbps=10.0, frac_of_copy=None))
    path = tmp_path / "r.json"
    bench.write_json(path, {"device_kind": "cpu"}, records)
    meta, loaded = bench.read_json(path)
    assert meta == {"device_kind": "cpu"} and loaded == records
    raw = json.loads(path.read_text())["records"]
    charts = bench.chart_data(loaded)
    assert [(c.op, c.mode, c.dtype, c.rows) for c in charts] == [("softmax", "fwd", "bf16", 256),
                                                                 ("softmax", "bwd", "bf16", 256)]
    fwd, bwd = charts
    assert [s.impl for s in fwd.series] == ["cuda", "xla", "copy", "mine"]
    for s in fwd.series:
        mine = sorted((r for r in raw if r["mode"] == "fwd" and r["impl"] == s.impl),
                      key=lambda r: r["cols"])
        assert s.cols == tuple(r["cols"] for r in mine)
        expect_gbps = [np.nan if r["gbps"] is None else r["gbps"] for r in mine]
        expect_pct = [np.nan if r["frac_of_copy"] is None else 100 * r["frac_of_copy"] for r in mine]
        np.testing.assert_array_equal(s.gbps, expect_gbps)
        np.testing.assert_array_equal(s.pct_of_copy, expect_pct)
    assert fwd.series[2].pct_of_copy == (100.0, 100.0)
    assert fwd.filename() == "softmax_fwd_bf16.png"
    (xla_bwd,) = bwd.series
    assert xla_bwd.gbps == (10.0,) and np.isnan(xla_bwd.pct_of_copy[0])
    with pytest.raises(TypeError, match="records: expected jax_ops.bench.Record"):
        bench.chart_data(raw)
    from jax_ops.bench import plot
    assert [s.label for s in fwd.series] == ["cuda", "xla", "copy (ceiling)", "mine"]
    # "flax" on softmax (no flax layer) ran the jnp baseline: the legend says which
    assert (plot.label("layer_norm", "flax"), plot.label("softmax", "flax")) == \
        ("flax baseline", "jnp baseline (no flax layer)")


def test_write_plots_names_charts_by_rows_when_a_file_mixes_row_counts(tmp_path):
    records = [bench.Record("relu", "fwd", "f32", rows, 64, impl, "wall", 2, 100,
                            time_us=1.0, gbps=1.0, frac_of_copy=1.0)
               for rows in (32, 64) for impl in ("copy", "xla")]
    paths = bench.write_plots(records, {}, tmp_path / "charts")
    assert sorted(p.name for p in paths) == ["relu_fwd_f32_rows32.png", "relu_fwd_f32_rows64.png"]
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in paths)
    with pytest.raises(ValueError, match="no timed record"):
        bench.write_plots([dataclasses.replace(records[0], time_us=None)], {}, tmp_path / "x")


def test_plot_without_matplotlib_fails_before_measuring(monkeypatch, capsys):
    """A missing matplotlib is reported at once, naming the extra, and nothing is measured."""
    import sys

    from jax_ops.bench import cli
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(cli, "run_config", lambda cfg: pytest.fail("measured without matplotlib"))
    assert bench.main(["--op", "relu", "--rows", "8", "--cols", "32", "--plot", "unused"]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "jax_ops[plot]" in err, err
