"""jax_ops.bench: the benchmark of jax_ops' ops against XLA, autodiff baselines and a copy
ceiling, from Python and as `jax-ops-bench` (jax_ops/bench/cli.py documents the method:
input sets, modes, minimum bytes, timing).

    from jax_ops import bench
    records = bench.run("layer_norm", rows=4096, cols=(256, 1024), dtype="bf16",
                        modes=("fwd", "fwd_bwd"), impls=("cuda", "xla"))
    print(bench.format_table(records))
    us = bench.measure(my_fn, x)         # one's own microbenchmark: median us per call

Modules: specs (the ops, {name: BenchSpec}: from the op declarations' `Op(bench=...)`
and per-family sections), timing (timers, input sets rotated past L2, the copy
ceiling, measure), runner (implementations x modes, --check, the sweep), report
(Record, tables, summaries, JSON/CSV, metadata), tables (the dispatch-table writer),
plot (bandwidth charts, matplotlib) and cli (`main`). What this module exports is the
public API; benchmarks/*.py use only it.
"""
from __future__ import annotations

from collections.abc import Sequence

from jax_ops.bench.plot import chart_data, write_plots
from jax_ops.bench.report import (Record, format_summaries, format_tables, git_commit, log,
                                  read_json, short_error, write_csv, write_json)
from jax_ops.bench.runner import (CPU_DEFAULTS, GPU_DEFAULTS, check, make_config, make_op,
                                  mode_args, per_set_fn, rel_err, run_config, timed_call,
                                  validate)
from jax_ops.bench.specs import DTYPES, IMPLS, KERNEL_IMPLS, MODES, min_bytes, specs
from jax_ops.bench.tables import write_table
from jax_ops.bench.timing import GB, MB, batched, copy_us, get_timer, make_sets, measure, num_sets
from jax_ops.core.benchspec import BenchSpec, view_len

__all__ = [
    # running and reporting
    "run", "measure", "Record", "format_table", "main",
    # the ops
    "specs", "BenchSpec", "min_bytes", "view_len", "DTYPES", "IMPLS", "KERNEL_IMPLS", "MODES",
    # building blocks for one's own benchmarks
    "make_sets", "make_op", "per_set_fn", "mode_args", "timed_call", "batched", "num_sets",
    "copy_us", "get_timer", "check", "rel_err", "short_error", "MB", "GB",
    "GPU_DEFAULTS", "CPU_DEFAULTS",
    # files
    "git_commit", "write_json", "read_json", "write_csv", "write_table",
    # charts (matplotlib)
    "write_plots", "chart_data",
]


def _names(value) -> list:
    return [value] if isinstance(value, (str, int)) else list(value)


def run(op: str | Sequence[str], *, rows: int | None = None, cols: int | Sequence[int] | None = None,
        dtype: str | Sequence[str] = "bf16", modes: Sequence[str] = ("fwd", "fwd_bwd"),
        impls: Sequence[str] | None = None, repeats: int = 5, check: bool = False,
        timer: str = "auto", footprint_mb: int | None = None, max_mem_gb: float = 20.0,
        max_sets: int = 256, seed: int = 0, verbose: bool = False) -> list[Record]:
    """Benchmarks op(s) as `jax-ops-bench` does and returns the records (no printing).

    op: a name of specs() (or several); rows, cols (one or several), dtype ("bf16",
    "f32", "f16"; one or several), modes (of MODES) and impls (of IMPLS: "cuda",
    "pallas", "xla", "auto", "flax", "jnp") as the CLI's flags, None for its defaults
    (GPU_DEFAULTS / CPU_DEFAULTS; impls cuda, pallas (GPU), xla, auto, flax). Each
    (op, dtype, cols, mode) gives a "copy" record (the ceiling) and one per impl, with
    time_us (median per input set), gbps (min_bytes / time), frac_of_copy and, when
    "flax" or "jnp" ran, vs_baseline; a failing impl has `error` set instead.
    check: compare each impl with "xla" first (max_rel_err). verbose: progress on stderr.
    """
    cfg = make_config(_names(op), dtypes=_names(dtype), rows=rows,
                      cols=None if cols is None else _names(cols), modes=list(modes),
                      impls=None if impls is None else list(impls), repeats=repeats,
                      check=check, timer=timer, footprint_mb=footprint_mb,
                      max_mem_gb=max_mem_gb, max_sets=max_sets, seed=seed,
                      log=log if verbose else _quiet)
    validate(cfg)
    return run_config(cfg)


def format_table(records: Sequence[Record], impls: Sequence[str] | None = None,
                 baseline: str | None = None, meta: dict | None = None,
                 summaries: bool = True) -> str:
    """The text `jax-ops-bench` prints for `records`: a table per (op, mode, dtype),
    the legend and (summaries=True) the summaries that apply.

    impls: the column groups (default: the impls of the records, in order);
    baseline: the impl of the "vs" column (default: the records'); meta: "device_kind",
    "timer" and "repeats" for the titles (default: this process's device, the records')."""
    records = list(records)
    if not records:
        return ""
    impls = list(impls or dict.fromkeys(r.impl for r in records if r.impl not in ("copy", "inputs")))
    if baseline is None:
        baseline = next((r.baseline for r in records if r.baseline), None)
    if meta is None:
        import jax
        meta = {"device_kind": jax.devices()[0].device_kind, "timer": records[0].timer,
                "repeats": max((len(r.times_us) for r in records), default=0)}
    text = format_tables(records, impls, baseline, meta)
    if summaries:
        text = "\n".join([text, *(s for s in format_summaries(records, impls) if s)])
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """jax-ops-bench with argv as its flags (default sys.argv[1:]): prints the tables and
    summaries, writes --table/--json/--csv, returns the exit status. (Loads
    jax_ops.bench.cli on call, so `python -m jax_ops.bench.cli` runs it unimported.)"""
    from jax_ops.bench.cli import main as cli_main
    return cli_main(argv)


def _quiet(msg: str) -> None:
    pass
