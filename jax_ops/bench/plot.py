"""Bandwidth charts of benchmark records (`jax-ops-bench --plot DIR`), in the manner of
OneFlow's LayerNorm bandwidth charts: one PNG per (op, mode, dtype), two panels over the
number of columns (log2 axis) — effective GB/s (minimum bytes / time, the records'
"gbps") and % of the same-bytes copy (100 × copy time / time, "frac_of_copy") — with a
line per implementation (cuda, pallas, xla, auto), per baseline (flax / jnp: jax.nn,
optax) and the copy ceiling.

chart_data() is the data each chart draws (no matplotlib needed); write_plots() draws
them with matplotlib's Agg canvas, without pyplot (no global state, no display). The
records come from a run (`jax_ops.bench.run`, the CLI) or from a saved --json file
(`report.read_json`), so `--plot DIR --from results.json` redraws a past run.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from jax_ops.bench.report import Record
from jax_ops.bench.specs import specs

# Line order and colours: the same implementation looks the same on every chart.
IMPLS_ORDER = ("cuda", "pallas", "xla", "auto", "flax", "jnp", "copy")
COLORS = {"cuda": "tab:green", "pallas": "tab:blue", "xla": "tab:orange", "auto": "tab:purple",
          "flax": "tab:red", "jnp": "tab:brown", "copy": "black"}
MARKERS = {"cuda": "o", "pallas": "s", "xla": "^", "auto": "x", "flax": "D", "jnp": "v"}
LABELS = {"flax": "flax baseline", "jnp": "jnp baseline", "copy": "copy (ceiling)"}


def label(op: str, impl: str) -> str:
    """The legend entry of impl's line. "flax" on an op without a flax layer (softmax,
    relu, cross_entropy) runs the jnp baseline (jax.nn, optax), and says so."""
    if impl == "flax":
        spec = specs().get(op)
        if spec is not None and spec.flax is None:
            return "jnp baseline (no flax layer)"
    return LABELS.get(impl, impl)


@dataclasses.dataclass(frozen=True)
class Series:
    """One line of a chart: an implementation's points, in increasing cols. A value is
    NaN where the record has none (an error at that size): the line has a gap there."""
    impl: str
    label: str
    cols: tuple[int, ...]
    gbps: tuple[float, ...]
    pct_of_copy: tuple[float, ...]  # 100 * frac_of_copy (the copy line: 100)


@dataclasses.dataclass(frozen=True)
class Chart:
    """One PNG: (op, mode, dtype, rows) and its lines."""
    op: str
    mode: str
    dtype: str
    rows: int
    series: tuple[Series, ...]

    def filename(self, with_rows: bool = False) -> str:
        name = f"{self.op}_{self.mode}_{self.dtype}" + (f"_rows{self.rows}" if with_rows else "")
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", name) + ".png"


def _value(v) -> float:
    return math.nan if v is None else float(v)


def chart_data(records: Iterable[Record]) -> list[Chart]:
    """The charts of `records`: one per (op, mode, dtype, rows) in the records' order,
    a Series per implementation that has a time at one size at least (IMPLS_ORDER
    first, then any other name), points sorted by cols."""
    records = list(records)
    bad = [r for r in records if not isinstance(r, Record)]
    if bad:
        raise TypeError(f"records: expected jax_ops.bench.Record items; got "
                        f"{type(bad[0]).__name__}")
    charts = []
    for key in dict.fromkeys((r.op, r.mode, r.dtype, r.rows) for r in records):
        group = [r for r in records if (r.op, r.mode, r.dtype, r.rows) == key]
        impls = list(dict.fromkeys(r.impl for r in group))
        impls.sort(key=lambda i: IMPLS_ORDER.index(i) if i in IMPLS_ORDER else len(IMPLS_ORDER))
        series = []
        for impl in impls:
            by_cols = {r.cols: r for r in group if r.impl == impl}
            if all(r.time_us is None for r in by_cols.values()):
                continue  # failed everywhere (or the "inputs" error records)
            cols = tuple(sorted(by_cols))
            pts = [by_cols[c] for c in cols]
            series.append(Series(
                impl=impl, label=label(key[0], impl), cols=cols,
                gbps=tuple(_value(r.gbps) for r in pts),
                pct_of_copy=tuple(100 * _value(r.frac_of_copy) for r in pts)))
        if series:
            charts.append(Chart(*key, series=tuple(series)))
    return charts


def require_matplotlib():
    """The matplotlib module; ImportError saying how to install it when it is missing
    (checked before a benchmark runs, not after)."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError as e:
        raise ImportError(f"--plot needs matplotlib, which does not import here ({e}): "
                          f"pip install 'jax_ops[plot]' (or matplotlib)") from None
    return matplotlib


def _draw(chart: Chart, meta: dict, path: Path) -> None:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    fig = Figure(figsize=(9, 7.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    for s in chart.series:
        style = dict(color=COLORS.get(s.impl), label=s.label, marker=MARKERS.get(s.impl, "o"),
                     markersize=4, linewidth=1.6)
        if s.impl == "copy":
            style.update(linestyle="--", marker=None)
        elif s.impl == "auto":  # it often lies on the implementation it picks: keep both visible
            style.update(linestyle=":", markersize=7, linewidth=2.2)
        top.plot(s.cols, s.gbps, **style)
        if s.impl == "copy":
            bottom.axhline(100, color="black", linestyle="--", linewidth=1.2, label=s.label)
        else:
            bottom.plot(s.cols, s.pct_of_copy, **style)
    cols = sorted({c for s in chart.series for c in s.cols})
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(cols))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, which="major", alpha=0.35)
    bottom.set_xticks(cols, [str(c) for c in cols], rotation=45 if len(cols) > 8 else 0)
    top.set_ylabel("GB/s (minimum bytes / time)")
    top.set_ylim(bottom=0)
    bottom.set_ylabel("% of copy")
    pct = [v for s in chart.series for v in s.pct_of_copy if math.isfinite(v)]
    bottom.set_ylim(0, max([110.0] + [1.08 * v for v in pct]))  # room above the 100 % line
    bottom.set_xlabel("cols")
    top.legend(loc="best", fontsize="small", ncols=2)
    spec = specs().get(chart.op)  # None: an op this version no longer benchmarks
    title = spec.title if spec is not None else ""
    top.set_title(f"{chart.op} {chart.mode} {chart.dtype}, rows={chart.rows}{title}")
    source = ", ".join(str(meta[k]) for k in ("device_kind", "timer") if meta.get(k))
    commit = re.sub(r"^([0-9a-f]{10})[0-9a-f]{30}", r"\1", str(meta.get("git_commit") or ""))
    extra = ", ".join(f"{k} {v}" for k, v in (("commit", commit), ("date", meta.get("date"))) if v)
    fig.suptitle(source + (f"  ({extra})" if extra else ""), fontsize="small")
    fig.savefig(path, format="png")


def write_plots(records: Sequence[Record], meta: dict, directory: Path | str) -> list[Path]:
    """One PNG per chart of chart_data(records) into `directory` (created), named
    <op>_<mode>_<dtype>.png (+ _rows<N> when the records hold several row counts for
    it); returns the paths written. meta: the run's metadata (report.metadata, or a
    --json file's), for the device, timer, commit and date in the heading."""
    if not isinstance(meta, dict):
        raise TypeError(f"meta: expected the run's metadata dict; got {type(meta).__name__}")
    require_matplotlib()
    charts = chart_data(records)
    if not charts:
        raise ValueError("records: no timed record to plot (every measurement failed, "
                         "or there were none)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rows_per = {}
    for c in charts:
        rows_per.setdefault((c.op, c.mode, c.dtype), set()).add(c.rows)
    paths = []
    for c in charts:
        path = directory / c.filename(with_rows=len(rows_per[(c.op, c.mode, c.dtype)]) > 1)
        _draw(c, meta, path)
        paths.append(path)
    return paths
