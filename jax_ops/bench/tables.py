"""The dispatch-table writer (`jax-ops-bench --table PATH`): a run's fwd and bwd times
of cuda/pallas/xla merged into jax_ops/tables/<gpu>.json, which the automatic choice
(jax_ops/core/dispatch.py) reads."""
from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from jax_ops.bench.report import Record
from jax_ops.bench.specs import DTYPES, KERNEL_IMPLS, specs


def write_table(path: Path, meta: dict, records: list[Record]) -> Path:
    """Merges this run's fwd/bwd times of cuda/pallas/xla into dispatch table `path`.

    Each op writes the stages of its spec's table_stages: the norms fwd, bwd and
    fwd_stats (cuda's / pallas' fwd_res time where the run has it, else step - bwd);
    softmax and log_softmax fwd and bwd (their training forward is the inference
    forward); softmax_mask its fwd as softmax's "fwd_mask" stage (the
    choice for masked and causal calls; their backward is the unmasked one);
    softmax_causal nothing (benchmarked for the masked / unmasked ratio)."""
    path = Path(path)
    all_specs = specs()
    table = {"device_kind": meta["device_kind"], "entries": []}
    if path.exists():
        table = json.loads(path.read_text())
        if table.get("device_kind") != meta["device_kind"]:
            raise SystemExit(f"--table {path} is for {table.get('device_kind')!r}, "
                             f"this run is on {meta['device_kind']!r}")
    new = {}
    for r in records:  # the stages are the fwd and bwd modes; fwd_bwd is their sum
        if r.impl not in KERNEL_IMPLS or r.time_us is None:
            continue
        dtype = jnp.dtype(DTYPES[r.dtype]).name
        if r.mode in ("fwd", "bwd") and r.mode in all_specs[r.op].table_stages:
            new.setdefault((r.op, r.mode, dtype, r.rows, r.cols), {})[r.impl] = round(r.time_us, 3)
        alias = all_specs[r.op].table_alias
        if alias is not None and r.mode == "fwd":  # the masked forward of the softmax kernels
            new.setdefault((*alias, dtype, r.rows, r.cols), {})[r.impl] = round(r.time_us, 3)
    # The training forward (writes mean/rstd too) is what fwd_bwd adds to bwd. For xla
    # that difference is only real next to xla's own backward: XLA fuses its forward and
    # backward across the stages (seen on the H200: rms_norm 8192, xla fwd_bwd - bwd =
    # 406 us, but 666 us next to the Pallas backward). So xla gets a training-forward
    # time only where it also has the fastest backward.
    timed = {(r.op, r.mode, r.dtype, r.rows, r.cols, r.impl): r.time_us for r in records
             if r.time_us is not None and r.impl in KERNEL_IMPLS}
    fastest_bwd = {}
    for (op, mode, dtype, rows, cols, impl), us in timed.items():
        shape = (op, dtype, rows, cols)
        if mode == "bwd" and us < timed.get((op, mode, dtype, rows, cols, fastest_bwd.get(shape)), math.inf):
            fastest_bwd[shape] = impl
    # A kernel implementation's training forward timed alone ("fwd_res": y and the
    # residuals it writes) is preferred to a difference: step - bwd also counts what its
    # own backward costs more or less in a step than alone (H100, bf16 LayerNorm at 128
    # columns: pallas' step - bwd 9.1 us against its forward kernel's 10.6-10.8 in a step,
    # cuda's 10.2; the automatic choice of pallas' made fwd_bwd 0.98x of cuda's). Not
    # xla's: its fwd_res writes residuals that its own step fuses away.
    direct = {(op, dtype, rows, cols, impl): us for (op, mode, dtype, rows, cols, impl), us in timed.items()
              if mode == "fwd_res" and impl != "xla" and "fwd_stats" in all_specs[op].table_stages}
    for (op, dtype, rows, cols, impl), us in direct.items():
        new.setdefault((op, "fwd_stats", jnp.dtype(DTYPES[dtype]).name, rows, cols), {})[impl] = round(us, 3)
    # "step" (dy only after y, as in a model) is preferred to fwd_bwd where the run has it.
    stale = set()  # xla training forwards that an older run measured beside a slower backward
    for (op, mode, dtype, rows, cols, impl), us in timed.items():
        if "fwd_stats" not in all_specs[op].table_stages or mode not in ("fwd_bwd", "step"):
            continue
        if (op, dtype, rows, cols, impl) in direct:
            continue
        if mode == "fwd_bwd" and (op, "step", dtype, rows, cols, impl) in timed:
            continue
        bwd = timed.get((op, "bwd", dtype, rows, cols, impl))
        key = (op, "fwd_stats", jnp.dtype(DTYPES[dtype]).name, rows, cols)
        if impl == "xla" and fastest_bwd.get((op, dtype, rows, cols)) not in (None, "xla"):
            stale.add(key)
            continue
        if bwd is None or us <= bwd:
            continue
        new.setdefault(key, {})[impl] = round(us - bwd, 3)
    # An entry's "word" (bytes a load, where set) marks times measured at another load
    # width than the tree's kernels take at its width (e.g. before half-word packs):
    # kept beside this run's, which replace only entries without one (core/dispatch.py).
    entries = {(e["op"], e["stage"], e["dtype"], e["rows"], e["cols"], e.get("word", 0)): e["us"]
               for e in table["entries"]}
    new = {(*k, 0): us for k, us in new.items()}
    stale = {(*k, 0) for k in stale}
    for key in stale:
        if "xla" in entries.get(key, {}):
            entries[key] = {k: v for k, v in entries[key].items() if k != "xla"}
    for key, us in new.items():  # per implementation: this run's times replace older ones
        entries[key] = {**entries.get(key, {}), **us}
    dev = jax.devices()[0]  # what core/dispatch.table_match matches a GPU on
    if dev.device_kind == meta["device_kind"]:  # (not when merging a run's JSON elsewhere)
        cc = getattr(dev, "compute_capability", None)
        table.update(compute_capability=str(cc) if cc else None,
                     sm_count=getattr(dev, "core_count", None))
    table.update(
        command=meta["command"], date=meta["date"], git_commit=meta["git_commit"],
        jax_version=meta["jax_version"], timer=meta["timer"],
        note="median kernel time per call (us) of each implementation; written by "
             "jax_ops.bench --table, read by jax_ops/core/dispatch.py",
        entries=[{"op": k[0], "stage": k[1], "dtype": k[2], "rows": k[3], "cols": k[4],
                  **({"word": k[5]} if k[5] else {}), "us": v}
                 for k, v in sorted(entries.items())])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    return path
