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
   the same op/stage nearest in (log cols, log rows), of the same dtype or another of
   its width, gives each implementation's time (between two measured widths of that
   dtype, interpolated in log cols; an implementation with `tile_cols`, whose kernels
   pad a row, from the width of its own tile); the fastest one that supports the call
   wins (within 0.5 %, a tie, cuda). Rows are looked up among the entries of their word
   class (row_word by the op's cuda load_words: rows of whole 16-byte words, of
   8-byte ones where the kernels have half-word packs, else loaded a value at a time;
   an entry's "word" where it was timed at another load width), from a same-generation
   GPU's table where this GPU's has none of that class; rows of 8-byte words without
   any take those of single values; fewer than two widths of the call's value size in
   its class give way to the class's other sizes (_of_value_size). Stages:
   "fwd" (inference forward), "fwd_stats" (training forward, which also writes the
   statistics; timed alone (fwd_res) for cuda / pallas where the run did, else as
   step - bwd, or fwd_bwd - bwd in older runs), "fwd_mask"
   (masked or causal softmax) and "bwd"; a stage without entries falls back to the
   plain stage's. An op this GPU's table has no entries for (added after its run) uses
   the table of a GPU of the same compute capability that has them (H200 <- H100; the
   reason names the file). A GPU
   without its own table uses one measured on a GPU with the same compute capability
   and SM count (core/dispatch.table_match; the reason says which and why).
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

import jax.numpy as jnp

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

@dataclasses.dataclass(frozen=True)
class Device:
    """What the table lookup matches on: jax's device kind, the compute capability and
    the multiprocessor count (None where unknown: CPU, export without a GPU)."""
    kind: str
    compute_capability: str | None = None
    sm_count: int | None = None

    def describe(self) -> str:
        props = [f"compute capability {self.compute_capability}" if self.compute_capability else "",
                 f"{self.sm_count} SMs" if self.sm_count else ""]
        props = ", ".join(p for p in props if p)
        return f"{self.kind} ({props})" if props else self.kind


@functools.lru_cache(maxsize=None)
def device_kind(platform: str) -> str | None:
    """The device kind jax reports for the platform's first device, e.g. "NVIDIA H200"."""
    d = _first_device(platform)
    return None if d is None else d.device_kind


def _first_device(platform: str):
    import jax
    for backend in (platform, "gpu" if platform in ("cuda", "rocm") else None):
        try:
            return jax.devices(backend)[0] if backend else None
        except Exception:  # platform absent (e.g. lowering for export)
            continue
    return None


@functools.lru_cache(maxsize=None)
def device(kind: str | None) -> Device | None:
    """The properties of the local device of this kind (kind alone if none is here)."""
    if kind is None:
        return None
    import jax
    for d in jax.devices():
        if d.device_kind == kind:
            cc = getattr(d, "compute_capability", None)
            sms = getattr(d, "core_count", None)
            return Device(kind, str(cc) if cc else None, int(sms) if sms else None)
    return Device(kind)


def _model(kind: str | None) -> str | None:
    """"NVIDIA H100 80GB HBM3" -> "H100"."""
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


def _table_device(t: dict) -> Device:
    return Device(t.get("device_kind", ""), t.get("compute_capability"), t.get("sm_count"))


def table_match(dev: Device | str | None) -> tuple[dict | None, str]:
    """The measured table that applies to `dev` and why: the table measured on this
    device kind, else one measured on a GPU with the same compute capability and SM
    count (same model preferred: H100 NVL, GH200 <- H100 SXM); else none (heuristics).
    A GPU with another SM count (H100 PCIe: 114) gets none: its times differ."""
    if isinstance(dev, str):
        dev = device(dev)
    if dev is None:
        return None, "no GPU: heuristics"
    tables = _tables()
    for t in tables:
        if t.get("device_kind") == dev.kind:
            return t, f"{t['_path']}, measured on this GPU ({dev.kind})"
    alike = [t for t in tables if dev.compute_capability and dev.sm_count
             and _table_device(t).compute_capability == dev.compute_capability
             and _table_device(t).sm_count == dev.sm_count]
    alike.sort(key=lambda t: _model(t.get("device_kind")) != _model(dev.kind))
    if alike:
        t = alike[0]
        return t, (f"{t['_path']}, measured on {t['device_kind']}: same compute capability "
                   f"{dev.compute_capability} and {dev.sm_count} SMs as {dev.kind}")
    return None, f"no measured table for {dev.describe()}: heuristics"


def table_for(dev: Device | str | None) -> dict | None:
    """The measured table that applies to this device (see table_match), or None."""
    return table_match(dev)[0]


def _distance(q: Query, e: dict) -> float:
    d = abs(math.log2(e["cols"]) - math.log2(max(q.cols or 1, 1)))
    if q.rows is not None and q.rows > 0:
        d += 0.25 * abs(math.log2(e["rows"]) - math.log2(q.rows))
    return d + (0.0 if e["dtype"] == q.dtype else 0.5)


def _table_with_op(q: Query) -> dict | None:
    """This GPU's table; where it has no entry for q's op (an op added after that GPU's
    run), the table of another GPU of the same compute capability that has (H200 <-
    H100)."""
    table = table_for(q.device_kind)
    if table is None or any(e["op"] == q.op for e in table["entries"]):
        return table
    return next((o for o in _same_generation(table) if any(e["op"] == q.op for e in o["entries"])), table)


def _same_generation(table: dict) -> list[dict]:
    """The other measured tables of `table`'s compute capability (none where unknown)."""
    cc = _table_device(table).compute_capability
    return [t for t in _tables() if t is not table and cc and _table_device(t).compute_capability == cc]


@functools.cache
def _itemsize(dtype: str) -> int | None:
    try:
        return jnp.dtype(dtype).itemsize
    except TypeError:
        return None


# How a padded kernel's time follows its bytes within one tile width: 1 would be bytes
# alone, 0 the tile's work alone. Fitted to Pallas' RMSNorm forward against its 8192-column
# time (H100, bf16: 0.81 at 4352 columns, 0.84 at 4608).
_TILE_BYTES_EXPONENT = 0.8


# Table times closer than this (relative) are a tie (repeat-to-repeat spread of an entry).
_TIE = 0.005


def _times_between(q: Query, best: dict, entries: list[dict], candidates) -> tuple[dict, str] | None:
    """Each implementation's time at q.cols interpolated (log time against log cols)
    between the nearest measured widths below and above it, of best's dtype and rows;
    None where q.cols is measured or not bracketed."""
    same = [e for e in entries if e["dtype"] == best["dtype"] and e["rows"] == best["rows"]]
    lo = max((e for e in same if e["cols"] < q.cols), key=lambda e: e["cols"], default=None)
    hi = min((e for e in same if e["cols"] > q.cols), key=lambda e: e["cols"], default=None)
    if best["cols"] == q.cols or lo is None or hi is None:
        return None
    w = math.log(q.cols / lo["cols"]) / math.log(hi["cols"] / lo["cols"])
    us, scaled = {}, []
    for n in lo["us"]:
        if n not in hi["us"] or n not in candidates:
            continue
        tile = candidates[n].tile_cols
        same_tile = [] if tile is None else [e for e in (lo, hi) if tile(e["cols"]) == tile(q.cols)]
        if len(same_tile) == 1:
            # Its kernels work on the same tile as at one of the two widths (Pallas pads a
            # row to a power of two): that width's time, scaled by its bytes to the power
            # _TILE_BYTES_EXPONENT. Interpolated, its 4096-column time stood for 4352
            # columns (H100, RMSNorm bf16 forward: 290 us estimated, 339 measured, cuda's
            # 303; docs/perf-notes.md).
            e = same_tile[0]
            us[n] = e["us"][n] * (q.cols / e["cols"]) ** _TILE_BYTES_EXPONENT
            scaled.append(f"{n} from {e['cols']}")
        else:
            us[n] = math.exp((1 - w) * math.log(max(lo["us"][n], 1e-9)) + w * math.log(max(hi["us"][n], 1e-9)))
    how = "interpolated" + (f" ({', '.join(scaled)}: same tile)" if scaled else "")
    return (us, f"{best['dtype']}[{best['rows']},{lo['cols']}..{hi['cols']}], {how}") if us else None


def row_word(cols: int, dtype: str, words: tuple[int, ...] = (16,)) -> int:
    """Bytes a hand-kernel load takes of a row of `cols` values of `dtype`: the widest of
    `words` (an implementation's load_words) that tiles the row, else one value's. A dtype
    whose size does not divide 16 bytes: 16 (no class of its own)."""
    size = _itemsize(dtype) or 4
    if 16 % size:
        return 16
    return next((w for w in sorted(words, reverse=True) if w > size and cols * size % w == 0), size)


def _word_class(cols: int, dtype: str, words: tuple[int, ...], word: int | None = None) -> int:
    """row_word (or the `word` given), with rows loaded a value at a time one class (0)
    whatever the value size."""
    word = word or row_word(cols, dtype, words)
    return 0 if word == (_itemsize(dtype) or 4) else word


def _entry_class(e: dict, words: tuple[int, ...]) -> int:
    """An entry's word class: of its "word" where the table records the load width it was
    measured at (another than the tree's kernels take there: e.g. bfloat16 rows of 8-byte
    words timed before the half-word packs, at one value a load), else of its width."""
    return _word_class(e["cols"], e["dtype"], words, e.get("word"))


def describe_word(cols: int, dtype: str, words: tuple[int, ...] = (16,)) -> str:
    """The word class of a row, in words (the lookup's reason strings)."""
    return {16: "rows of whole 16-byte words", 8: "rows of whole 8-byte words, not 16-byte ones"}.get(
        _word_class(cols, dtype, words), "rows loaded a value at a time")


def _load_words(op: str) -> tuple[int, ...]:
    """The op's hand kernels' load widths (its cuda implementation's load_words; the
    table's classes are of their times, whichever implementations a call may take)."""
    cuda = next((i for i in registry.all_of(op) if i.name == "cuda"), None)
    return (cuda.load_words if cuda is not None else None) or (16,)


def _of_word_class(q: Query, table: dict, entries: list[dict], candidates) -> tuple[list[dict], dict]:
    """The entries (and their table) of q's word class (_word_class, by the op's
    _load_words), with a time of a candidate; where a class has none anywhere, for rows of
    8-byte words those of single values (the slower side). Within a class: from q's table
    where it has entries of q's value size, else from another table of the same compute
    capability that has (q's stage, else the plain stage's); else q's table's of any
    size, then another's. With none of q's classes anywhere, q's table's entries."""
    size, words = _itemsize(q.dtype), _load_words(q.op)

    def sized(es):
        return any(_itemsize(e["dtype"]) == size for e in es)

    want = _word_class(q.cols, q.dtype, words)
    for word in [want, 0] if want == 8 else [want]:
        def of_class(es):
            return [e for e in es if _entry_class(e, words) == word
                    and any(n in candidates for n in e["us"])]

        own = of_class(entries)
        if not entries or sized(own):
            return own or entries, table
        unsized = (own, table) if own else None
        for other in _same_generation(table):
            for stage in dict.fromkeys((q.table_stage, q.stage)):
                theirs = of_class([e for e in other["entries"] if e["op"] == q.op and e["stage"] == stage])
                if theirs:
                    break
            if sized(theirs):
                return theirs, other
            if theirs and unsized is None:
                unsized = (theirs, other)
        if unsized:
            return unsized
    return entries, table


def _of_value_size(q: Query, entries: list[dict]) -> list[dict]:
    """Entries of q's value size where they span two widths or more, else all: one width
    can be neither interpolated from nor stand for another tier's (860722d's H100 table
    had bf16 rows loaded a value at a time at 1001 columns only: cuda ties XLA there, and
    takes 3.0x its forward time at 4100), while _distance still prefers q's dtype at a
    width."""
    same = [e for e in entries if _itemsize(e["dtype"]) == _itemsize(q.dtype)]
    return same if len({e["cols"] for e in same}) > 1 else entries


def _from_table(q: Query, candidates: dict[str, Implementation]) -> tuple[str, str] | None:
    table = _table_with_op(q)
    if table is None or q.cols is None:
        return None
    entries = [e for e in table["entries"] if e["op"] == q.op and e["stage"] == q.table_stage]
    if not entries:  # e.g. no training-forward times: the plain forward's
        entries = [e for e in table["entries"] if e["op"] == q.op and e["stage"] == q.stage]
    entries = [e for e in entries if any(n in candidates for n in e["us"])]
    # Rows of whole 16-byte words, of 8-byte words and of neither are timed apart: the
    # hand kernels load them a 16-byte word, half a word (norms) or a value at a time
    # (H100, bf16, 4100 columns a value at a time: LayerNorm fwd+bwd 2.4x slower than
    # Pallas; docs/perf-notes.md, thirty-eighth session), so no class's times stand for
    # another's. A table without entries of q's class
    # and value size takes them from one of the same compute capability (H200 <- H100).
    entries, table = _of_word_class(q, table, entries, candidates)
    # Another dtype's entries stand in for one of the same width in bytes before any
    # other: which kernel tier serves a row depends on its bytes (H100, float32 LayerNorm
    # at 512 columns took bfloat16 512's choice, 0.97x of cuda's fwd_bwd). With none of
    # that width, any dtype's: still nearer the best than the cuda heuristic (H100,
    # float32 add+norms, 1 against 12 of 66 points below 0.98; perf-notes); so too with
    # fewer than two widths of it (_of_value_size).
    entries = _of_value_size(q, entries)
    if not entries:
        return None
    best = min(entries, key=lambda e: _distance(q, e))
    between = _times_between(q, best, entries, candidates)
    us, where = between or (best["us"], f"{best['dtype']}[{best['rows']},{best['cols']}]")
    timed = sorted((t, n) for n, t in us.items() if n in candidates)
    name = timed[0][1]
    if name != "cuda" and "cuda" in us and "cuda" in candidates and us["cuda"] <= timed[0][0] * (1 + _TIE):
        # A tie goes to the hand kernels, which the other stages mostly use: at a 0.3 %
        # table tie (H200, add_rms_norm bf16 training forward at 256 columns) a Pallas
        # forward before the cuda backward ran fwd+bwd 2 % slower than cuda's pair.
        name = "cuda"
    times = ", ".join(f"{n} {t:.1f}us" for t, n in timed) + \
        (f" (within {_TIE:.1%} of {timed[0][1]}: a tie, cuda taken)" if name != timed[0][1] else "")
    own = table_for(q.device_kind)
    if table is own:
        source = table_match(q.device_kind)[1]
    else:
        lacks = q.op if not any(e["op"] == q.op for e in own["entries"]) else (
            f"{q.op} at {describe_word(q.cols, q.dtype, _load_words(q.op))}")
        source = f"{table['_path']} (measured on {table['device_kind']}; this GPU's table lacks {lacks})"
    return name, f"measured table {table['_path']} at {where}: {times} [{source}]"


def table_pick(q: Query) -> tuple[str, str] | None:
    """(implementation, reason) the measured table picks for q among the implementations
    the automatic choice may take, or None (no table or no entry)."""
    ok = {i.name: i for i in registry.all_of(q.op) if i.why_not_automatic(q) is None}
    return _from_table(q, ok)


# ---------------------------------------------------------- autotune cache ---

_FORCED = threading.local()  # autotune pins (implementation, config) while it compiles


def _forced() -> dict:
    if not hasattr(_FORCED, "pins"):
        _FORCED.pins = {}
    return _FORCED.pins


def cache_key(q: Query) -> str:
    return f"{q.op}|{q.table_stage}|{q.dtype}|{','.join(str(d) for d in q.shape)}"


def _from_autotune(q: Query, impl_of: dict[str, Implementation]) -> dict | None:
    """This device's autotune winner for q, if it is still valid: its implementation
    exists and can serve q, and its config has the keys of the implementation's configs
    (an entry from an older build may name parameters that no longer exist: ignored,
    with a warning)."""
    if q.device_kind is None or not q.static:
        return None
    entry = cache.entries(q.device_kind).get(cache_key(q))
    if entry is None:
        return None
    impl = impl_of.get(entry.get("implementation"))
    config = entry.get("config")
    default = None if impl is None else impl.default_config(q)
    valid = impl is not None and (config is None if default is None else
                                  isinstance(config, dict) and set(config) == set(default))
    if not valid:
        cache.warn_once(f"ignoring autotune entry {cache_key(q)} for {q.device_kind}: "
                        f"{entry.get('implementation')!r} with config {config} is not an "
                        "implementation/config this build offers (re-run jax_ops.autotune)")
        return None
    return entry


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

    tuned = _from_autotune(q, ok)
    if tuned is not None:
        return decide(tuned["implementation"], "autotune cache", tuned.get("config"))

    preferred = [n for n, i in ok.items() if i.prefer]
    if preferred:
        return decide(preferred[-1], "user implementation registered with prefer=True")

    picked = _from_table(q, ok)
    if picked is not None:
        return decide(*picked)
    if q.platform == "cuda":
        why_no_table = table_match(q.device_kind)[1]
        for name, why in (("cuda", "hand kernels"), ("pallas", "Pallas kernels (CUDA kernels not built)")):
            if name in ok:
                return decide(name, f"heuristic: {why} ({why_no_table})")
    return decide("xla", f"heuristic: XLA on {q.platform}")


# ------------------------------------------------------------- explaining ---

def _report(d: Decision) -> None:
    if os.environ.get("JAX_OPS_EXPLAIN", "") not in ("", "0"):
        print(f"jax_ops: {d}", file=sys.stderr)
