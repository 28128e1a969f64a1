"""Which implementation lowers an op call, and why. Decided at lowering time from
static shapes, in this order:

1. explicit: implementation="name" on the op, or jax_ops.use(...) around the call.
   If it can't serve the call, a ValueError says why and what can.
2. autotune: a winner stored by jax_ops.autotune for this GPU, op, stage, dtype and
   shape (the user cache file, see tuning.py).
3. a user implementation registered with prefer=True, where it is supported (the
   measured tables do not know it; autotune does).
4. measured table: jax_ops/tables/<gpu>.json, written by the benchmark
   (`jax-ops-bench --table ...`; the command is recorded in each file). The entry of
   the same op/stage/dtype nearest in (log cols, log rows) gives each
   implementation's time; the fastest one that supports the call wins. Stages:
   "fwd" (inference forward), "fwd_stats" (training forward, which also writes the
   statistics; timed as fwd_bwd - bwd), "fwd_mask" (masked or causal softmax) and
   "bwd"; a stage without entries falls back to the plain stage's. An op this GPU's
   table has no entries for (added after its run) uses the table of a GPU of the same
   generation that has them (H200 <- H100; the reason names the file).
5. heuristics, for GPUs without a table and for other platforms:
   - cuda platform: "cuda" (the hand kernels) where built, else "pallas", else "xla";
   - CPU: "xla". XLA's multi-threaded CPU code beat our single-threaded host
     handlers 6-10x in the CPU benchmark, and Pallas runs interpreted there
     (docs/perf-notes.md); both stay selectable by name (that is how CI tests them).
   - anything else (TPU, ROCm): "xla".
An implementation whose stage is missing (a user kernel without a backward), that
refuses the shape, or whose `automatic` rule declines the call (softmax kernels over
a non-last axis) is skipped by the automatic choice.

JAX_OPS_EXPLAIN=1 prints every decision as it is made; jax_ops.explain(fn, *args)
(core/calls.py) lists them for one function without running it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import sys
import threading
from pathlib import Path

from jax_ops.core import cache, registry
from jax_ops.core.registry import Implementation, Query

TABLE_DIR = Path(__file__).parent.parent / "tables"  # jax_ops/tables


@dataclasses.dataclass(frozen=True)
class Decision:
    query: Query
    implementation: str
    config: dict | None
    reason: str

    def __str__(self) -> str:
        cfg = "" if not self.config else " " + json.dumps(self.config, sort_keys=True)
        return f"{self.query.describe()} -> {self.implementation}{cfg}: {self.reason}"


# ------------------------------------------------------------ device kind ---

@functools.lru_cache(maxsize=None)
def device_kind(platform: str) -> str | None:
    """The device kind jax reports for the platform's first device, e.g. "NVIDIA H200"."""
    import jax
    for backend in (platform, "gpu" if platform in ("cuda", "rocm") else None):
        try:
            return jax.devices(backend)[0].device_kind if backend else None
        except Exception:  # platform absent (e.g. lowering for export)
            continue
    return None


def _model(kind: str | None) -> str | None:
    """"NVIDIA H100 80GB HBM3" -> "H100"; used to match tables across SKUs."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", kind or "")
    return m.group(1) if m else None


# -------------------------------------------------------- measured tables ---

@functools.lru_cache(maxsize=None)
def _tables() -> tuple[dict, ...]:
    out = []
    for path in sorted(TABLE_DIR.glob("*.json")):
        with open(path) as f:
            table = json.load(f)
        table["_path"] = path.name
        out.append(table)
    return tuple(out)


def table_for(kind: str | None) -> dict | None:
    """The measured table of this GPU: same device kind, else same model (H100, H200...)."""
    if kind is None:
        return None
    tables = _tables()
    for t in tables:
        if t.get("device_kind") == kind:
            return t
    model = _model(kind)
    for t in tables:
        if model is not None and _model(t.get("device_kind")) == model:
            return t
    return None


def _distance(q: Query, e: dict) -> float:
    d = abs(math.log2(e["cols"]) - math.log2(max(q.cols or 1, 1)))
    if q.rows is not None and q.rows > 0:
        d += 0.25 * abs(math.log2(e["rows"]) - math.log2(q.rows))
    return d + (0.0 if e["dtype"] == q.dtype else 0.5)


def _generation(kind: str | None) -> str | None:
    """"H100" -> "H": GPUs of one architecture generation (Hopper: H100, H200)."""
    model = _model(kind)
    return model[0] if model else None


def _table_with_op(q: Query) -> dict | None:
    """This GPU's table; where it has no entry for q's op (an op added after that GPU's
    run), the table of another GPU of the same generation that has (H200 <- H100)."""
    table = table_for(q.device_kind)
    if table is None or any(e["op"] == q.op for e in table["entries"]):
        return table
    for other in _tables():
        if (_generation(other.get("device_kind")) == _generation(q.device_kind)
                and any(e["op"] == q.op for e in other["entries"])):
            return other
    return table


def _from_table(q: Query, candidates: dict[str, Implementation]) -> tuple[str, str] | None:
    table = _table_with_op(q)
    if table is None or q.cols is None:
        return None
    entries = [e for e in table["entries"] if e["op"] == q.op and e["stage"] == q.table_stage]
    if not entries:  # e.g. no training-forward times: the plain forward's
        entries = [e for e in table["entries"] if e["op"] == q.op and e["stage"] == q.stage]
    entries = [e for e in entries if any(n in candidates for n in e["us"])]
    if not entries:
        return None
    best = min(entries, key=lambda e: _distance(q, e))
    timed = sorted((t, n) for n, t in best["us"].items() if n in candidates)
    name = timed[0][1]
    times = ", ".join(f"{n} {t:.1f}us" for t, n in timed)
    return name, (f"measured table {table['_path']} at {best['dtype']}[{best['rows']},"
                  f"{best['cols']}]: {times}")


# ---------------------------------------------------------- autotune cache ---

_FORCED = threading.local()  # autotune pins (implementation, config) while it compiles


def _forced() -> dict:
    if not hasattr(_FORCED, "pins"):
        _FORCED.pins = {}
    return _FORCED.pins


def cache_key(q: Query) -> str:
    return f"{q.op}|{q.table_stage}|{q.dtype}|{','.join(str(d) for d in q.shape)}"


def _from_autotune(q: Query) -> dict | None:
    if q.device_kind is None or not q.static:
        return None
    return cache.load_cache().get(q.device_kind, {}).get(cache_key(q))


# ---------------------------------------------------------------- choose ---

def choose(q: Query, implementation: str | None) -> Decision:
    """The implementation (and its tunable config) that lowers q; see the module docstring."""
    registry.check_name(q.op, implementation)
    impls = {i.name: i for i in registry.all_of(q.op)}

    def decide(name, reason, config=None):
        impl = impls[name]
        d = Decision(q, name, config if config is not None else impl.default_config(q), reason)
        _report(d)
        return d

    pinned = _forced().get(cache_key(q))
    if pinned is not None and implementation is None:
        return decide(pinned[0], "pinned by autotune while timing", pinned[1])

    if implementation is not None:
        impl = impls[implementation]
        why = impl.why_not(q)
        if why is None:
            return decide(implementation, "asked for (implementation= or jax_ops.use)")
        if q.stage not in impl.lower:  # e.g. a user forward-only kernel: the backward is automatic
            d = choose(q, None)
            return dataclasses.replace(d, reason=f"{why}; automatic: {d.reason}")
        can = [n for n, i in impls.items() if i.why_not(q) is None]
        raise ValueError(f"jax_ops.{q.op}: implementation={implementation!r} can't run "
                         f"{q.describe()}: {why}. Implementations that can: {can}")

    ok = {n: i for n, i in impls.items() if i.why_not_automatic(q) is None}
    if not ok:  # "xla" supports everything; only reachable with a broken registry
        raise ValueError(f"jax_ops.{q.op}: no implementation can run {q.describe()}")

    tuned = _from_autotune(q)
    if tuned is not None and tuned["implementation"] in ok:
        return decide(tuned["implementation"], "autotune cache", tuned.get("config"))

    preferred = [n for n, i in ok.items() if i.prefer]
    if preferred:
        return decide(preferred[-1], "user implementation registered with prefer=True")

    picked = _from_table(q, ok)
    if picked is not None:
        return decide(*picked)
    if q.platform == "cuda":
        for name, why in (("cuda", "hand kernels (no measured table for this GPU)"),
                          ("pallas", "Pallas kernels (CUDA kernels not built)")):
            if name in ok:
                return decide(name, f"heuristic: {why}")
    return decide("xla", f"heuristic: XLA on {q.platform}")


# ------------------------------------------------------------- explaining ---

def _report(d: Decision) -> None:
    if os.environ.get("JAX_OPS_EXPLAIN", "") not in ("", "0"):
        print(f"jax_ops: {d}", file=sys.stderr)
