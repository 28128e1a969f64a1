"""Benchmark of jax_ops' norms and softmax against XLA, autodiff baselines and a copy ceiling.

    python -m jax_ops.bench
        [--op layer_norm|rms_norm|softmax|log_softmax|softmax_mask|softmax_causal|
              relu|add_relu|batch_norm_relu|batch_norm_add_relu]
        [--impl cuda,pallas,xla,auto,flax,jnp] [--dtype bf16|f32|f16] [--rows N]
        [--cols 32,64,...] [--mode fwd,fwd_bwd,bwd] [--repeats 5] [--check]
        [--json [PATH]] [--csv PATH] [--table PATH] [--plot DIR]
    python -m jax_ops.bench --plot DIR --from RESULTS.json

Ops ("--op", comma list) and their input sets (x, params, dy), x and dy of shape
(rows, cols) in the --dtype:
  layer_norm      params (scale, bias) float32, differentiated; x, dy random normal.
  rms_norm        params (scale,).
  softmax         jax_ops.softmax(x) over the last axis; params (); x = 4 * random normal.
  log_softmax     jax_ops.log_softmax(x).
  softmax_mask    x viewed as (B, Q, cols), Q = min(cols, 512), B = rows // Q;
                  jax_ops.softmax(x3, mask=m) with a key-padding bool mask m of shape
                  (B, 1, cols), ~10% False, column 0 always True (no fully masked row);
                  params (m,), not differentiated (the vjp is w.r.t. x only).
  softmax_causal  x viewed as (B, Q, cols), Q = min(cols, 2048); jax_ops.softmax(x3,
                  causal=True) (keeps j <= i + (cols - Q)); params ().
  Q rule (view_len): min(cols, cap) when it divides rows (the default rows, 49152 =
  3 * 2^14, and 4096 on CPU, are divisible by every power-of-two cap and by 768), else the
  largest power of two dividing rows that is <= min(cols, cap). The views are recorded in
  the JSON metadata ("views").

Implementations ("--impl"):
  cuda    jax_ops.<op>(..., implementation="cuda"): our hand kernels (on CPU: host handlers).
  pallas  jax_ops.<op>(..., implementation="pallas"): our Pallas kernels (interpreted on CPU,
          so not in the CPU default).
  xla     jax_ops.<op>(..., implementation="xla"): our primitive lowered to plain XLA.
  auto    jax_ops.<op>(...): the automatic choice (measured table, autotune cache,
          heuristics; see jax_ops/core/dispatch.py). Under the tables, "auto/best" is its time
          over the fastest of cuda/pallas/xla in the same run.
  flax  norms: flax.linen.LayerNorm / RMSNorm (param_dtype float32, dtype = x's dtype so y
        has x's dtype), differentiated by JAX autodiff. Falls back to "jnp" when flax is
        not importable. Softmax ops: the same as "jnp".
  jnp   a plain jax.numpy op with float32 math, output cast to x's dtype, differentiated
        by JAX autodiff: the norm; jax.nn.softmax / log_softmax of x.astype(float32)
        (softmax_mask: jnp.where(mask, logits, -inf); softmax_causal: a tril mask).
The baseline of the "vs" column is "flax" when it ran, else "jnp".

Modes ("--mode"), per input set (x, params, dy):
  fwd      y = op(x, *params)
  fwd_bwd  y, vjp_fn = jax.vjp(op, x, *params); (dx, *dparams) = vjp_fn(dy), all in one
           jitted function (softmax ops: the vjp is w.r.t. x only, so just dx).
  bwd      vjp_fn is made beforehand (a jitted jax.vjp); only vjp_fn(dy) is timed. The
           residuals are whatever the implementation saves (autodiff baselines may
           save float32 intermediates and so read more than the minimum below).
  step     fwd_bwd with an optimization barrier between y and dy: dy is known only once y
           is, as in any training step (dy = dL/dy depends on y through the model). In
           fwd_bwd, XLA may fuse the backward's row sums over dy into the forward's
           pass over x (seen for the flax norms at >= 16384 columns: 5.6X where two
           passes need 5X); no model can, so step is the baseline's cost in a model.
  fwd_res  y, vjp_fn = jax.vjp(op, x, *params), returning y and vjp_fn's residuals: the
           forward of a training step, which writes the residuals the backward keeps
           (jax.nn.relu: a bool per element; ours: 1 bit; the norms: the row
           statistics). Residuals that are the inputs themselves (x, scale) are left
           out: the forward writes nothing for them, and returning them from the timed
           call would copy them. fwd + bwd understates the baselines' training cost
           where their plain forward writes no residual; fwd_res + bwd does not.

Minimum bytes per call ("min_bytes"; effective GB/s = min_bytes / time). With
  X = rows * cols * itemsize(x)      one activation-sized array (x, y, dy or dx)
norms, with
  P = cols * 4                       one float32 parameter vector
  n = 2 for layer_norm (scale, bias), 1 for rms_norm (scale)
  S = rows * 4 * (2 for layer_norm: mean + rstd; 1 for rms_norm: rstd)   float32 stats
we count
  fwd     = 2X + n*P              read x, write y; read the parameters
  bwd     = 3X + S + P + n*P      read x and dy, write dx; read the stats and scale;
                                  write dscale (and dbias)
  fwd_bwd = fwd + S + bwd         two passes, as two separate kernels at best: the
                                  forward also writes the stats and x is read twice.
softmax ops, with M = B * cols (the bool mask, softmax_mask only; else 0)
  fwd     = 2X + M                read x (and the mask), write y; causal: no mask read
  bwd     = 3X                    read y and dy, write dx
  fwd_bwd = fwd + bwd = 5X + M    the backward reads the saved y.

Timing. Each measured call processes K distinct input sets (one jitted function, a
Python loop inside jit; an optimization barrier chains each set to the previous one's
outputs, so XLA can neither merge the sets' kernels horizontally nor overlap them:
each set gets its own kernels) and its time is divided by K.
K is chosen so that K * min_bytes >= --footprint-mb (default 512 MB on GPU, well
above the 50-60 MB L2; 32 MB on CPU), K >= 2, and K * min_bytes <= --max-mem-gb.
  GPU: CUPTI kernel time of one call, jax.experimental.mosaic.gpu.profiler.measure
       (which does its own warm-up call): the sum of the durations of all GPU
       kernels launched by the call.
  CPU: wall clock of one call after a warm-up call, with block_until_ready.
Repeated --repeats times; reported: median per-set time, and min/max (the spread).

Copy ceiling. The "jax_ops_device_copy" FFI target (a 16-byte vectorized copy on GPU,
memcpy on CPU) copies K distinct arrays of min_bytes / 2 bytes each, so it reads and
writes min_bytes per set like the op's floor; measured the same way, in the same run.
"%copy" = copy_time / op_time (the fraction of copy bandwidth the op reaches).

Summaries after the tables:
  auto/best          with --impl auto: the automatic choice vs the fastest kernel.
  masked/unmasked    softmax_mask and softmax_causal time over softmax's, same impl, mode,
                     dtype and cols, when both ran in the invocation (target <= 1.15 for
                     cuda/pallas/xla/auto).
  speedup over xla   softmax, log_softmax: xla time / each impl's time (target: fwd_bwd
                     >= 1.5 for cuda/pallas/auto).

--table writes per op the stages the dispatch reads: norms fwd, bwd and fwd_stats (the
training forward, step - bwd where the run has step, else fwd_bwd - bwd); softmax and
log_softmax fwd and bwd only (their training forward is the inference forward);
softmax_mask and softmax_causal nothing (they run the softmax kernels).

--plot DIR writes a PNG per (op, mode, dtype) into DIR (jax_ops/bench/plot.py): GB/s and
% of copy against cols (log2 axis), a line per implementation, baseline and the copy
ceiling. With --from RESULTS.json (a file --json wrote) it charts that run instead of
measuring (the measurement flags are then ignored). Needs matplotlib (extra "plot").

Python use: jax_ops.bench (its __init__) has the same run as a function, `run(...)`,
and the pieces for one's own microbenchmarks (`measure`, `min_bytes`, ...).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from jax_ops.bench import plot
from jax_ops.bench.report import (default_json_path, format_summaries, format_tables, log,
                                  metadata, read_json, write_csv, write_json)
from jax_ops.bench.runner import make_config, run_config
from jax_ops.bench.specs import DTYPES, IMPLS, MODES, specs
from jax_ops.bench.tables import write_table


# ------------------------------------------------------------------- CLI ----

def _list(choices: Sequence[str] | None = None, kind=str):
    def parse(text: str):
        items = [kind(t) for t in text.split(",") if t.strip()]
        bad = [t for t in items if choices is not None and t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma list of {list(choices or [])}; "
                                             f"got {text!r}")
        return items
    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags; the run itself (runner.Config, defaults resolved) is the "config"
    attribute."""
    ops = tuple(specs())
    p = argparse.ArgumentParser(prog="python -m jax_ops.bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", type=_list(ops), default=["layer_norm"],
                   help=", ".join(ops) + " (default layer_norm)")
    p.add_argument("--impl", type=_list(IMPLS), default=None,
                   help="default: cuda,xla,flax (jnp when flax is missing)")
    p.add_argument("--dtype", type=_list(tuple(DTYPES)), default=["bf16"], help="bf16, f32, f16")
    p.add_argument("--rows", type=int, default=None, help="default 49152 on GPU, 4096 on CPU")
    p.add_argument("--cols", type=_list(kind=int), default=None,
                   help="comma list; default 32..32768 on GPU, 32,128,512,1024,4096 on CPU")
    p.add_argument("--mode", type=_list(MODES), default=["fwd", "fwd_bwd"],
                   help="fwd, fwd_bwd, bwd, fwd_res, step (default fwd,fwd_bwd)")
    p.add_argument("--repeats", type=int, default=5, help="measurements per point (default 5)")
    p.add_argument("--check", action="store_true",
                   help="compare every impl with xla on the first input set before timing")
    p.add_argument("--json", nargs="?", const="", default=None, metavar="PATH",
                   help="write JSON; without PATH: benchmarks/results/<op>_<device>_<date>.json")
    p.add_argument("--csv", default=None, metavar="PATH", help="also write CSV")
    p.add_argument("--timer", choices=("auto", "cupti", "wall"), default="auto",
                   help="auto: cupti on GPU, wall clock elsewhere")
    p.add_argument("--footprint-mb", type=int, default=None,
                   help="min bytes touched per measured call (K sets); default 512 GPU, 32 CPU")
    p.add_argument("--max-mem-gb", type=float, default=20.0,
                   help="cap of K * min_bytes (default 20)")
    p.add_argument("--max-sets", type=int, default=256, help="cap of K (compile time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", default=None, metavar="PATH",
                   help="write (merge into) a dispatch table: the fwd and bwd times of "
                        "cuda/pallas/xla per shape, as jax_ops/tables/<gpu>.json expects")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write a PNG per (op, mode, dtype) into DIR: GB/s and %% of copy "
                        "against cols (needs matplotlib: extra 'plot')")
    p.add_argument("--from", dest="from_json", default=None, metavar="PATH",
                   help="with --plot: chart the results JSON at PATH (what --json writes) "
                        "instead of measuring")
    args = p.parse_args(argv)
    if args.from_json is not None:
        if args.plot is None:
            p.error(f"--from {args.from_json} needs --plot DIR (it only redraws charts)")
        clash = [f for f, v in (("--json", args.json), ("--csv", args.csv),
                                ("--table", args.table)) if v is not None]
        if clash:
            p.error(f"--from reads a saved run; {', '.join(clash)} need a measurement")
        args.config = None
        return args
    if args.repeats < 1 or (args.rows or 1) < 1 or any(c < 1 for c in args.cols or ()):
        p.error("--repeats, --rows and --cols must be positive")
    args.config = make_config(args.op, dtypes=args.dtype, rows=args.rows, cols=args.cols,
                              modes=args.mode, impls=args.impl, repeats=args.repeats,
                              check=args.check, timer=args.timer, footprint_mb=args.footprint_mb,
                              max_mem_gb=args.max_mem_gb, max_sets=args.max_sets, seed=args.seed)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """jax-ops-bench: argv the flags (default sys.argv[1:]); prints the tables and
    summaries, writes --table/--json/--csv/--plot (or only charts a saved run: --plot
    with --from); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.plot is not None:
        try:  # before measuring: a run must not end without its charts
            plot.require_matplotlib()
        except ImportError as e:
            return _fail(str(e))
    if args.from_json is not None:
        try:
            meta, records = read_json(Path(args.from_json), "--from")
            paths = plot.write_plots(records, meta, Path(args.plot))
        except (OSError, ValueError) as e:
            return _fail(str(e))
        log(f"wrote {len(paths)} charts into {args.plot}")
        return 0
    cfg = args.config
    meta = metadata(cfg, argv)
    log(f"jax {meta['jax_version']} on {meta['device_kind']} ({meta['platform']}), timer "
        f"{cfg.timer}, impls {cfg.impls}, rows {cfg.rows}, cols {cfg.cols}")

    records = run_config(cfg)

    print(format_tables(records, cfg.impls, cfg.baseline, meta))
    for summary in format_summaries(records, cfg.impls):
        print(summary)
    if args.table:
        path = write_table(Path(args.table), meta, records)
        log(f"wrote dispatch table {path}")
    if args.json is not None:
        path = Path(args.json) if args.json else default_json_path("-".join(cfg.ops),
                                                                   meta["device_kind"])
        write_json(path, meta, records)
        log(f"wrote {path}")
    if args.csv:
        write_csv(Path(args.csv), records)
        log(f"wrote {args.csv}")
    if args.plot is not None:
        try:
            paths = plot.write_plots(records, meta, Path(args.plot))
        except (OSError, ValueError) as e:
            return _fail(str(e))
        log(f"wrote {len(paths)} charts into {args.plot}")
    return 0


def _fail(message: str) -> int:
    """An error the user can act on: one line on stderr, exit status 2 (as argparse)."""
    print(f"jax-ops-bench: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
