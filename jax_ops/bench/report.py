"""Benchmark results: the Record, the tables, the summaries (auto/best, masked/unmasked,
speedup over xla), JSON and CSV."""
from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

from jax_ops.bench.specs import KERNEL_IMPLS, flax_available, specs
from jax_ops.core.benchspec import view_len


@dataclasses.dataclass
class Record:
    """One (op, mode, dtype, cols, impl) measurement; impl "copy" is the ceiling."""
    op: str
    mode: str
    dtype: str
    rows: int
    cols: int
    impl: str
    timer: str
    k_sets: int
    min_bytes: int
    time_us: float | None = None      # median over repeats, per input set
    time_us_min: float | None = None
    time_us_max: float | None = None
    gbps: float | None = None         # min_bytes / time_us
    copy_us: float | None = None      # the copy ceiling for the same bytes
    copy_gbps: float | None = None
    frac_of_copy: float | None = None  # copy_us / time_us
    baseline: str | None = None
    vs_baseline: float | None = None   # baseline time_us / time_us
    max_rel_err: float | None = None   # vs "xla", with --check
    check_error: str | None = None     # why --check could not compare this impl
    error: str | None = None
    times_us: list[float] = dataclasses.field(default_factory=list)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def short_error(e: BaseException) -> str:
    """"Type: message" of an exception, cut at 600 characters."""
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 600 else text[:600] + " ..."


def fill_ratios(records: list[Record], baseline: str | None) -> None:
    """copy ceiling and baseline ratios across the records of one (op, mode, dtype, cols)."""
    by_impl = {r.impl: r for r in records}
    copy = by_impl.get("copy")
    base = by_impl.get(baseline) if baseline else None
    for r in records:
        if r.time_us is None:
            continue
        if copy is not None and copy.time_us is not None:
            r.copy_us, r.copy_gbps = copy.time_us, copy.gbps
            r.frac_of_copy = copy.time_us / r.time_us
        if r.impl != "copy" and base is not None and base.time_us is not None:
            r.baseline, r.vs_baseline = baseline, base.time_us / r.time_us


# ---------------------------------------------------------------- tables ----

def _fmt(v, spec: str, width: int) -> str:
    return (format(v, spec) if v is not None else "-").rjust(width)


FIELDS = (("us", 9), ("GB/s", 7), ("%copy", 6), ("vs", 7), ("+-%", 5))  # per impl
GROUP_W = sum(w for _, w in FIELDS) + len(FIELDS) - 1


def _impl_cells(r: Record | None) -> str:
    if r is None or r.time_us is None:
        return f"{'ERROR':>{GROUP_W}}"
    spread = 100 * (r.time_us_max - r.time_us_min) / r.time_us
    frac = None if r.frac_of_copy is None else 100 * r.frac_of_copy
    values = (r.time_us, r.gbps, frac, r.vs_baseline, spread)
    specs_ = (".1f", ".1f", ".0f", ".2f", ".0f")
    return " ".join(_fmt(v, spec, w) for v, spec, (_, w) in zip(values, specs_, FIELDS))


def _notes(cols: int, by_impl: dict[str, Record]) -> list[str]:
    """Errors (first line) and --check results under a table."""
    recs = by_impl.values()
    notes = [f"  cols={cols} {r.impl}: {r.error.splitlines()[0]}" for r in recs if r.error]
    notes += [f"  cols={cols} {r.impl}: check failed: {r.check_error.splitlines()[0]}"
              for r in recs if r.check_error]
    checked = [f"{r.impl} {r.max_rel_err:.2e}" for r in recs if r.max_rel_err is not None]
    if checked:
        notes.append(f"  cols={cols} rel err (norm) vs xla: " + ", ".join(checked))
    return notes


def table_lines(recs: list[Record], impls: Sequence[str], baseline: str | None,
                meta: dict) -> list[str]:
    """The table of one (op, mode, dtype): a row per cols, a column group per impl."""
    r0 = recs[0]
    spec = specs().get(r0.op)
    title = spec.title if spec is not None else ""
    names = [f"x{baseline}" if name == "vs" and baseline else name for name, _ in FIELDS]
    head1 = f"{'':>6} {'':>4} | {'copy':^15}"
    head2 = f"{'cols':>6} {'K':>4} | {'us':>9} {'GB/s':>5}"
    for impl in impls:
        head1 += f" | {impl:^{GROUP_W}}"
        head2 += " | " + " ".join(f"{n:>{w}}" for n, (_, w) in zip(names, FIELDS))
    lines = ["", f"{r0.op} {r0.mode} {r0.dtype}, rows={r0.rows}{title} | "
                 f"{meta['device_kind']} | "
                 f"{meta['timer']} time per call, median of {meta['repeats']}",
             head1, head2, "-" * len(head2)]
    notes = []
    for cols in dict.fromkeys(r.cols for r in recs):
        by_impl = {r.impl: r for r in recs if r.cols == cols}
        copy = by_impl.get("copy")
        line = f"{cols:>6} {next(iter(by_impl.values())).k_sets:>4} | "
        line += (f"{_fmt(copy.time_us, '.1f', 9)} {_fmt(copy.gbps, '.0f', 5)}"
                 if copy and copy.time_us is not None else f"{'ERROR':>15}")
        lines.append(line + "".join(f" | {_impl_cells(by_impl.get(i))}" for i in impls))
        notes += _notes(cols, by_impl)
    return lines + notes


def format_tables(records: list[Record], impls: Sequence[str], baseline: str | None,
                  meta: dict) -> str:
    """One table per (op, mode, dtype), then a legend."""
    lines = []
    for key in dict.fromkeys((r.op, r.mode, r.dtype) for r in records):
        recs = [r for r in records if (r.op, r.mode, r.dtype) == key]
        lines += table_lines(recs, impls, baseline, meta)
    vs = f"x{baseline}: {baseline}" if baseline else "vs: baseline"
    lines += ["", "us: per call (one input set), median; GB/s: minimum bytes / time; "
                  f"%copy: copy time / time; {vs} time / time; +-%: (max - min) / median."]
    return "\n".join(lines)


# ------------------------------------------------------------- summaries ----

def auto_vs_best(records: list[Record], candidates: Sequence[str] = KERNEL_IMPLS) -> list[tuple]:
    """(op, mode, dtype, cols, best impl, best us, auto us, auto/best) per shape; best: the
    fastest of `candidates` (the implementations auto picks among, unless named)."""
    out = []
    for key in dict.fromkeys((r.op, r.mode, r.dtype, r.cols) for r in records):
        group = {r.impl: r for r in records if (r.op, r.mode, r.dtype, r.cols) == key
                 and r.time_us is not None}
        timed = [(group[i].time_us, i) for i in candidates if i in group]
        if "auto" in group and timed:
            best_us, best = min(timed)
            out.append((*key, best, best_us, group["auto"].time_us, group["auto"].time_us / best_us))
    return out


def format_auto_summary(records: list[Record]) -> str:
    rows = auto_vs_best(records)
    if not rows:
        return ""
    w = max(10, *(len(r[0]) for r in rows))  # op column
    lines = ["", "automatic choice vs the fastest of cuda/pallas/xla in this run "
                 "(auto/best <= 1.05 is the target)",
             f"{'op':<{w}} {'mode':<8} {'dtype':<5} {'cols':>6} {'best':>7} {'best us':>9} "
             f"{'auto us':>9} {'auto/best':>9}"]
    for op, mode, dtype, cols, best, best_us, auto_us, ratio in rows:
        flag = "" if ratio <= 1.05 else "  > 5%"
        lines.append(f"{op:<{w}} {mode:<8} {dtype:<5} {cols:>6} {best:>7} {best_us:>9.1f} "
                     f"{auto_us:>9.1f} {ratio:>9.3f}{flag}")
    worst = max(r[-1] for r in rows)
    lines.append(f"worst auto/best: {worst:.3f}; within 5%: "
                 f"{sum(r[-1] <= 1.05 for r in rows)}/{len(rows)} shapes")
    return "\n".join(lines)


MASK_TARGET = 1.15     # masked / unmasked softmax time, same impl
XLA_SPEEDUP_TARGET = 1.5  # softmax fwd_bwd: xla time / our kernels' time
OUR_IMPLS = ("cuda", "pallas", "auto")  # what the xla-speedup target is about
MASKED_TARGET_IMPLS = ("cuda", "pallas", "xla", "auto")  # and the masked/unmasked one


def _timed(records: list[Record]) -> dict[tuple, float]:
    """(op, mode, dtype, cols, impl) -> median us, the timed records (no copy ceiling)."""
    return {(r.op, r.mode, r.dtype, r.cols, r.impl): r.time_us for r in records
            if r.time_us is not None and r.impl != "copy"}


def _ratio_table(title: str, rows: list[tuple], impls: list[str], ref_head: str,
                 flag: Callable) -> list[str]:
    """rows: (op, mode, dtype, cols, ref us, {impl: ratio}); flag(mode, impl, ratio) -> bool
    marks a cell with "*"."""
    w = max(10, *(len(r[0]) for r in rows))
    lines = ["", title, f"{'op':<{w}} {'mode':<8} {'dtype':<5} {'cols':>6} {ref_head:>9} "
             + " ".join(f"{i:>8}" for i in impls)]
    for op, mode, dtype, cols, ref_us, ratios in rows:
        cells = [(f"{ratios[i]:.3f}" + ("*" if flag(mode, i, ratios[i]) else " ")).rjust(8)
                 if i in ratios else f"{'-':>7} " for i in impls]
        lines.append(f"{op:<{w}} {mode:<8} {dtype:<5} {cols:>6} {ref_us:>9.1f} " + " ".join(cells))
    return lines


def masked_vs_unmasked(records: list[Record]) -> list[tuple]:
    """(op, mode, dtype, cols, unmasked xla us (nan if xla did not run), {impl: masked us /
    unmasked us}) per masked-variant shape (softmax_mask, softmax_causal) whose unmasked
    op (softmax) ran in the same run for the same impl."""
    timed = _timed(records)
    all_specs = specs()
    out = []
    for op, mode, dtype, cols in dict.fromkeys(k[:4] for k in timed):
        plain = all_specs[op].unmasked if op in all_specs else None
        if plain is None:
            continue
        ratios = {impl: us / timed[(plain, mode, dtype, cols, impl)]
                  for (o, m, d, c, impl), us in timed.items()
                  if (o, m, d, c) == (op, mode, dtype, cols)
                  and (plain, mode, dtype, cols, impl) in timed}
        if ratios:
            ref = timed.get((plain, mode, dtype, cols, "xla"))
            out.append((op, mode, dtype, cols, ref if ref is not None else math.nan, ratios))
    return out


def format_masked_summary(records: list[Record], impls: Sequence[str]) -> str:
    """Masked / unmasked softmax time per impl (softmax_mask, softmax_causal vs softmax)."""
    rows = masked_vs_unmasked(records)
    if not rows:
        return ""
    impls = [i for i in impls if any(i in r[-1] for r in rows)]
    lines = _ratio_table(
        f"masked / unmasked softmax time, same impl, mode, dtype and cols (target <= "
        f"{MASK_TARGET} for {'/'.join(MASKED_TARGET_IMPLS)}; * above); xla us: unmasked "
        f"softmax, xla", rows, impls, "xla us",
        lambda mode, impl, ratio: impl in MASKED_TARGET_IMPLS and ratio > MASK_TARGET)
    worst = []
    for i in impls:
        vals = [r[-1][i] for r in rows if i in r[-1]]
        if i not in MASKED_TARGET_IMPLS:
            continue
        worst.append(f"{i} {max(vals):.3f} ({sum(v <= MASK_TARGET for v in vals)}/{len(vals)} "
                     f"<= {MASK_TARGET})")
    lines.append("worst masked/unmasked: " + ", ".join(worst))
    return "\n".join(lines)


def speedup_over_xla(records: list[Record]) -> list[tuple]:
    """(op, mode, dtype, cols, xla us, {impl: xla us / impl us}) for the ops with
    xla_summary (softmax, log_softmax), per shape where xla ran."""
    timed = _timed(records)
    all_specs = specs()
    out = []
    for op, mode, dtype, cols in dict.fromkeys(k[:4] for k in timed):
        xla = timed.get((op, mode, dtype, cols, "xla"))
        if op not in all_specs or not all_specs[op].xla_summary or xla is None:
            continue
        ratios = {impl: xla / us for (o, m, d, c, impl), us in timed.items()
                  if (o, m, d, c) == (op, mode, dtype, cols) and impl != "xla"}
        if ratios:
            out.append((op, mode, dtype, cols, xla, ratios))
    return out


def format_xla_summary(records: list[Record], impls: Sequence[str]) -> str:
    """Speedup over xla of every impl on softmax / log_softmax."""
    rows = speedup_over_xla(records)
    if not rows:
        return ""
    impls = [i for i in impls if any(i in r[-1] for r in rows)]
    lines = _ratio_table(
        f"speedup over xla: xla time / impl time (target: fwd_bwd >= {XLA_SPEEDUP_TARGET} "
        f"for {'/'.join(OUR_IMPLS)}; * below)", rows, impls, "xla us",
        lambda mode, impl, s: mode == "fwd_bwd" and impl in OUR_IMPLS and s < XLA_SPEEDUP_TARGET)
    counts = []
    for i in impls:
        vals = [r[-1][i] for r in rows if r[1] == "fwd_bwd" and i in r[-1]]
        if vals and i in OUR_IMPLS:
            counts.append(f"{i} {sum(v >= XLA_SPEEDUP_TARGET for v in vals)}/{len(vals)} "
                          f"(min {min(vals):.3f})")
    if counts:
        lines.append(f"fwd_bwd >= {XLA_SPEEDUP_TARGET}x xla: " + ", ".join(counts))
    return "\n".join(lines)


def format_summaries(records: list[Record], impls: Sequence[str]) -> list[str]:
    """The summaries that apply to `records`, as the CLI prints them after the tables:
    auto/best (when "auto" is in impls), masked/unmasked, speedup over xla."""
    out = [format_auto_summary(records)] if "auto" in impls else []
    return out + [s for s in (format_masked_summary(records, impls),
                              format_xla_summary(records, impls)) if s]


# ------------------------------------------------------------- metadata ----

def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str | None:
    """The JAX_OPS_COMMIT environment variable where set (a copy of the tree on the GPU
    machine, whose .git, if any, is stale); else HEAD's commit, with "+dirty" when
    tracked files differ from it; None outside a git checkout."""
    if os.environ.get("JAX_OPS_COMMIT"):
        return os.environ["JAX_OPS_COMMIT"]
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return os.environ.get("JAX_OPS_COMMIT")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return commit


def metadata(cfg, argv: Sequence[str] = ()) -> dict:
    """The JSON metadata of a run of cfg (runner.Config); argv: the CLI arguments."""
    dev = jax.devices()[0]
    all_specs = specs()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "git_commit": git_commit(),
        "command": shlex.join(["python", "-m", "jax_ops.bench", *argv]),
        "python": sys.version.split()[0],
        "flax_version": _flax_version(),
        "timer": cfg.timer,
        "repeats": cfg.repeats,
        "footprint_mb": cfg.footprint_mb,
        "baseline": cfg.baseline,
        "epsilon": {op: all_specs[op].epsilon for op in cfg.ops
                    if all_specs[op].epsilon is not None},
        **_views(cfg),
    }


def _views(cfg) -> dict:
    """{"views": {op: {cols: [B, Q, cols]}}} for the ops that view x as (B, Q, cols)."""
    all_specs = specs()
    views = {op: {str(c): [cfg.rows // view_len(cfg.rows, c, all_specs[op].view_cap),
                           view_len(cfg.rows, c, all_specs[op].view_cap), c] for c in cfg.cols}
             for op in cfg.ops if all_specs[op].view_cap is not None}
    return {"views": views} if views else {}


def _flax_version() -> str | None:
    if not flax_available():
        return None
    import flax
    return getattr(flax, "__version__", None)


# ------------------------------------------------------------ JSON, CSV ----

def default_json_path(op: str, device_kind: str) -> Path:
    device = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "device"
    date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("benchmarks") / "results" / f"{op}_{device}_{date}.json"


def write_json(path: Path, meta: dict, records: list[Record]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"metadata": meta,
                                "records": [dataclasses.asdict(r) for r in records]}, indent=1))


def read_json(path: Path, argument: str = "path") -> tuple[dict, list[Record]]:
    """(metadata, records) of a file write_json wrote (`jax-ops-bench --json PATH`).
    argument: how the caller names `path` in errors (the CLI: "--from"). FileNotFoundError
    for a missing file; ValueError naming the argument, what was expected and what the file
    holds when it is not such a file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{argument}: no such file {str(path)!r} (expected the JSON "
                                f"that `jax-ops-bench --json PATH` writes)")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{argument}: {str(path)!r} is not JSON ({e}); expected the file "
                         f"that `jax-ops-bench --json PATH` writes") from None
    if not (isinstance(data, dict) and isinstance(data.get("metadata"), dict)
            and isinstance(data.get("records"), list)):
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{argument}: {str(path)!r} is not a benchmark result: expected an "
                         f"object with \"metadata\" (object) and \"records\" (list); got {got}")
    fields = {f.name for f in dataclasses.fields(Record)}
    required = [f.name for f in dataclasses.fields(Record)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    records = []
    for i, r in enumerate(data["records"]):
        missing = [k for k in required if not isinstance(r, dict) or k not in r]
        if missing:
            got = sorted(r) if isinstance(r, dict) else type(r).__name__
            raise ValueError(f"{argument}: record {i} of {str(path)!r} lacks {missing}; "
                             f"expected the fields of jax_ops.bench.Record, got {got}")
        records.append(Record(**{k: v for k, v in r.items() if k in fields}))
    return data["metadata"], records


def write_csv(path: Path, records: list[Record]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [f.name for f in dataclasses.fields(Record) if f.name != "times_us"]
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=names, extrasaction="ignore")
        w.writeheader()
        for r in records:
            w.writerow(dataclasses.asdict(r))
