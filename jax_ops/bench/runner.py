"""Running a benchmark: the implementations and modes of an op as functions of one input
set, the --check comparison, and the sweep over (op, dtype, cols, mode, impl) that
`jax_ops.bench.run` and the CLI share."""
from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jax_ops.bench.report import Record, fill_ratios, log as _stderr_log, short_error
from jax_ops.bench.specs import DTYPES, IMPLS, KERNEL_IMPLS, MODES, flax_available, min_bytes, spec, specs
from jax_ops.bench.timing import (GB, MB, TIMERS, batched, make_sets, measure_copy, num_sets,
                                  summarize, timer_name)

GPU_DEFAULTS = dict(rows=49152, cols=(32, 64, 128, 256, 512, 768, 1024, 2048, 4096, 8192,
                                      16384, 32768), footprint_mb=512)
CPU_DEFAULTS = dict(rows=4096, cols=(32, 128, 512, 1024, 4096), footprint_mb=32)


# --------------------------------------------------- implementations, modes ---

def make_op(op: str, impl: str, dtype) -> Callable:
    """fn(x, *params) -> y for an implementation (params: see make_sets)."""
    s = spec(op)
    if impl in KERNEL_IMPLS or impl == "auto":
        return s.kernel(None if impl == "auto" else impl)
    if impl == "flax":
        return (s.flax or s.reference)(dtype)
    if impl == "jnp":
        return s.reference(dtype)
    raise ValueError(f"unknown implementation {impl!r}")


def _vjp(fn: Callable, x, params, diff_params: bool):
    """jax.vjp of fn at (x, *params), or w.r.t. x only (params held constant)."""
    if diff_params:
        return jax.vjp(fn, x, *params)
    return jax.vjp(lambda x: fn(x, *params), x)


def _distinct(grads: tuple) -> tuple:
    """grads without repeats of one array: add+norm's dx and dresidual are the same
    value, and a jitted function that returns one array twice makes XLA copy it (a
    read and a write of x that no model pays, where the two feed their consumers)."""
    seen, out = set(), []
    for g in grads:
        if id(g) not in seen:
            seen.add(id(g))
            out.append(g)
    return tuple(out)


def per_set_fn(fn: Callable, mode: str, diff_params: bool = True) -> Callable:
    """The function applied to one input set (see mode_args for its arguments)."""
    if mode == "fwd":
        return lambda x, params: fn(x, *params)
    if mode in ("fwd_bwd", "step"):
        def fwd_bwd(x, params, dy):
            y, vjp_fn = _vjp(fn, x, params, diff_params)
            if mode == "step":  # dy known only once y is: a training step's order
                y, dy = jax.lax.optimization_barrier((y, dy))
            return (y, *_distinct(vjp_fn(dy)))
        return fwd_bwd
    if mode == "bwd":
        return lambda vjp_fn, dy: _distinct(vjp_fn(dy))
    if mode == "fwd_res":  # the forward of a training step: y and what the VJP keeps
        def fwd_res(x, params):
            y, vjp_fn = _vjp(fn, x, params, diff_params)
            # Not the residuals that are inputs (x, scale) or outputs (add+norm's h): the
            # forward writes nothing more for them, and returned again they would be
            # copied (H100, bf16 LayerNorm at 128 columns: 22.3 us a set for a 10.2 us
            # forward kernel; H200 add_layer_norm: 23.1 against 15.1 us).
            written = (x, *params, *jax.tree.leaves(y))
            return y, [r for r in jax.tree.leaves(vjp_fn) if not any(r is a for a in written)]
        return fwd_res
    raise ValueError(f"unknown mode {mode!r}")


def mode_args(fn: Callable, mode: str, sets: Sequence[tuple],
              diff_params: bool = True) -> list[tuple]:
    """Arguments of per_set_fn for each set; for "bwd" this runs the forward (jax.vjp)."""
    if mode in ("fwd", "fwd_res"):
        return [(x, params) for x, params, _ in sets]
    if mode in ("fwd_bwd", "step"):
        return [(x, params, dy) for x, params, dy in sets]
    make_vjp = jax.jit(lambda x, params: _vjp(fn, x, params, diff_params)[1])
    return [(make_vjp(x, params), dy) for x, params, dy in sets]


def timed_call(op: str, impl: str, mode: str, dtype, sets: Sequence[tuple]) -> tuple[Callable, list]:
    """(f, args): the jitted call the benchmark times for (op, impl, mode) over the input
    sets (make_sets), f(args) processing every set in turn. For "bwd" the forwards run
    here. To time it your own way, e.g. per kernel with
    jax.experimental.mosaic.gpu.profiler.measure(f, aggregate=False)(args)."""
    fn = make_op(op, impl, dtype)
    diff = spec(op).diff_params
    return batched(per_set_fn(fn, mode, diff)), mode_args(fn, mode, sets, diff)


# ---------------------------------------------------------------- checks ----

@jax.jit
def _rel_err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(jnp.square(a - b))) / jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(b))), 1e-30)


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖, the worst over the leaves of two output pytrees (b: reference).

    A relative norm, not max|a − b| / max|b|: at a ReLU kink (pre-activation within an
    ulp of 0) float32 rounding may set the mask bit either way, and that one element's
    gradient then differs by a·dy — e.g. 77 of 1e8 elements have |pre| < 1e-6 at
    (401408, 256) float32, and a max-norm check reported 0.1 for a correct kernel."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max((float(_rel_err(x, y)) for x, y in pairs if y.size), default=0.0)


def check(op: str, mode: str, dtype, impls: Sequence[str], first_set: tuple) -> dict:
    """impl -> relative error of its outputs vs "xla" on one set, or the error string."""
    diff = spec(op).diff_params

    def outputs(impl):
        fn = make_op(op, impl, dtype)
        (args,) = mode_args(fn, mode, [first_set], diff)
        out = jax.jit(per_set_fn(fn, mode, diff))(*args)
        # fwd_res: only y compares; the residuals are each implementation's own
        return out[0] if mode == "fwd_res" else out

    try:
        ref = outputs("xla")
    except Exception as e:  # noqa: BLE001
        return {impl: f"the xla reference failed: {short_error(e)}" for impl in impls}
    errs = {}
    for impl in impls:
        if impl == "xla":
            continue
        try:
            errs[impl] = rel_err(outputs(impl), ref)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            errs[impl] = short_error(e)
    return errs


# ------------------------------------------------------------ the sweep ----

@dataclasses.dataclass
class Config:
    """What one benchmark run measures (the CLI's flags, defaults resolved)."""
    ops: list[str]
    dtypes: list[str]
    rows: int
    cols: list[int]
    modes: list[str]
    impls: list[str]
    repeats: int = 5
    check: bool = False
    timer: str = "wall"           # "cupti" or "wall"
    footprint_mb: int = 32
    max_mem_gb: float = 20.0
    max_sets: int = 256
    seed: int = 0
    baseline: str | None = None   # the impl of the "vs" column: flax, else jnp, else None
    log: Callable[[str], None] = _stderr_log


def resolve_impls(asked: Sequence[str] | None, on_gpu: bool = True,
                  log: Callable[[str], None] = _stderr_log) -> list[str]:
    """The asked implementations (default cuda, pallas (GPU only), xla, auto, flax);
    flax -> jnp when missing."""
    default = ["cuda", "pallas", "xla", "auto", "flax"] if on_gpu else ["cuda", "xla", "auto", "flax"]
    impls = list(asked or default)
    if "flax" in impls and not flax_available():
        log("flax is not importable: using the plain jax.numpy autodiff reference 'jnp' instead")
        impls = [i for i in impls if i != "flax"] + ([] if "jnp" in impls else ["jnp"])
    return list(dict.fromkeys(impls))


def make_config(ops: Sequence[str], *, dtypes: Sequence[str] = ("bf16",), rows: int | None = None,
                cols: Sequence[int] | None = None, modes: Sequence[str] = ("fwd", "fwd_bwd"),
                impls: Sequence[str] | None = None, repeats: int = 5, check: bool = False,
                timer: str = "auto", footprint_mb: int | None = None, max_mem_gb: float = 20.0,
                max_sets: int = 256, seed: int = 0,
                log: Callable[[str], None] = _stderr_log) -> Config:
    """A Config with the platform's defaults (GPU_DEFAULTS, CPU_DEFAULTS) for what is
    None, "auto" timer resolved and the impls resolved (resolve_impls)."""
    on_gpu = jax.default_backend() == "gpu"
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    impls = resolve_impls(impls, on_gpu, log)
    return Config(ops=list(ops), dtypes=list(dtypes), rows=rows or defaults["rows"],
                  cols=list(cols or defaults["cols"]), modes=list(modes), impls=impls,
                  repeats=repeats, check=check, timer=timer_name(timer),
                  footprint_mb=footprint_mb or defaults["footprint_mb"], max_mem_gb=max_mem_gb,
                  max_sets=max_sets, seed=seed,
                  baseline="flax" if "flax" in impls else "jnp" if "jnp" in impls else None,
                  log=log)


def measure_impl(base: dict, op: str, mode: str, dtype, impl: str, sets, timer: Callable,
                 repeats: int) -> Record:
    rec = Record(impl=impl, **base)
    try:
        f, args = timed_call(op, impl, mode, dtype, sets)
        call_times = timer(f, args, repeats)
        del args
        summarize(rec, call_times)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: record it, go on
        rec.error = short_error(e)
    return rec


def bench_shape(cfg: Config, op: str, dtype_name: str, cols: int, timer: Callable) -> list[Record]:
    """All modes and implementations for one (op, dtype, cols)."""
    dtype = DTYPES[dtype_name]
    nbytes = {m: min_bytes(op, m, cfg.rows, cols, dtype) for m in cfg.modes}
    ks = {m: num_sets(nbytes[m], cfg.footprint_mb * MB, int(cfg.max_mem_gb * GB), cfg.max_sets)
          for m in cfg.modes}
    records = []
    try:
        sets = make_sets(op, dtype, cfg.rows, cols, max(ks.values()),
                         with_dy=any(m not in ("fwd", "fwd_res") for m in cfg.modes), seed=cfg.seed)
    except Exception as e:  # noqa: BLE001
        for m in cfg.modes:
            records.append(Record(op, m, dtype_name, cfg.rows, cols, "inputs", cfg.timer,
                                  ks[m], nbytes[m], error=short_error(e)))
        cfg.log(f"{op} {dtype_name} cols={cols}: inputs failed: {short_error(e)}")
        return records

    for mode in cfg.modes:
        k = ks[mode]
        base = dict(op=op, mode=mode, dtype=dtype_name, rows=cfg.rows, cols=cols,
                    timer=cfg.timer, k_sets=k, min_bytes=nbytes[mode])
        errs = check(op, mode, dtype, cfg.impls, sets[0]) if cfg.check else {}
        if errs:
            cfg.log(f"check {op} {mode} {dtype_name} cols={cols}: rel err (norm) vs xla: " +
                    ", ".join(f"{i} {e:.2e}" if isinstance(e, float) else f"{i} ERROR {e}"
                              for i, e in errs.items()))
        group = [measure_copy(base, timer, cfg.repeats, cfg.seed)]
        for impl in cfg.impls:
            group.append(measure_impl(base, op, mode, dtype, impl, sets[:k], timer, cfg.repeats))
            if isinstance(errs.get(impl), float):
                group[-1].max_rel_err = errs[impl]
            elif impl in errs:
                group[-1].check_error = errs[impl]
        fill_ratios(group, cfg.baseline)
        cfg.log(f"{op} {mode} {dtype_name} rows={cfg.rows} cols={cols} K={k}: " + ", ".join(
            f"{r.impl} {r.time_us:.1f}us" if r.time_us is not None else f"{r.impl} ERROR"
            for r in group))
        records += group
    del sets
    gc.collect()  # tracebacks of recorded errors may hold frames with big arrays
    return records


def run_config(cfg: Config) -> list[Record]:
    """Every (op, dtype, cols) of cfg, in that order of loops."""
    timer = TIMERS[cfg.timer]
    records: list[Record] = []
    for op in cfg.ops:
        for dtype_name in cfg.dtypes:
            for cols in cfg.cols:
                records += bench_shape(cfg, op, dtype_name, cols, timer)
    return records


def validate(cfg: Config) -> None:
    """ValueError for names and sizes the benchmark does not know."""
    for what, got, known in (("op", cfg.ops, specs()), ("impl", cfg.impls, IMPLS),
                             ("mode", cfg.modes, MODES), ("dtype", cfg.dtypes, DTYPES)):
        bad = [g for g in got if g not in known]
        if bad or not got:
            raise ValueError(f"jax_ops.bench: {what} {bad or got!r}; expected some of "
                             f"{', '.join(known)}")
    if cfg.repeats < 1 or cfg.rows < 1 or any(c < 1 for c in cfg.cols):
        raise ValueError("jax_ops.bench: repeats, rows and cols must be positive")
