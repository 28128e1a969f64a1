"""Measured bounds for the norms' remaining issue-20 misses (GPU only).

    python3 benchmarks/norm_bounds.py kernels [OPS] [COLS]   # the kernel-structure bound
    python3 benchmarks/norm_bounds.py narrow [OPS] [COLS]    # the two-kernel bound at narrow rows
    python3 benchmarks/norm_bounds.py params [COLS]          # float32 parameters at long rows

kernels: a training norm runs three kernels (the forward; the backward, which writes
float32 dscale/dbias partials, one row a resident block; the column sums of those
partials), each with its own bytes. The target's bound is ONE copy of the fwd+bwd floor
(5X, add+norm 8X). A copy of each kernel's own bytes, timed the same way (K rotated sets,
CUPTI, a kernel a set), is what any kernel of that structure can at best take, fixed
per-kernel cost included. This prints, per op and width: each cuda kernel's time next to
the copy of its bytes, their sums, and both percentages (the target's 5X copy over the
three copies: the most this structure can reach; over ours: where we are).

narrow: at 32-128 columns every kernel is a few MB and its fixed cost weighs. Any training
step runs at least two kernels (the backward needs dy, which the user's code makes after
the forward). Each is timed against the fastest kernel of its floor bytes measured here:
a copy, XLA's fusion of an elementwise map over the same arrays (forward: x*2, add+norm
(x+r, x-r); backward: x+dy, add+norm h+dy+dh), and our own kernel (which moves more: the
statistics, the partial rows). The sum of the two fastest over the target's one copy is an
upper bound on a two-kernel step, not a reachable figure: it assumes a backward that
recomputes the statistics and reduces dscale / dbias for free.

params: at 65536 columns a row's float32 scale and bias are 4x its bf16 bytes and are
re-read from L2 by every row. XLA's own fusion of the same affine map with broadcast
parameters, y = x * scale + bias (bf16 x, float32 / bf16 / no parameters), and of
dx = dy * scale + x (the backward's streams), measured next to the 2X / 3X copies and our
LayerNorm / RMSNorm kernels, shows what streaming a row past L2-resident float32 parameters
costs any row-at-a-time kernel on this GPU.
"""
import functools
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp

import jax_ops
from jax_ops import bench
from jax_ops.ops.layer_norm import cuda_workspace_rows

# TIMER / ROWS / PARAM_ROWS_MB from the environment only for a CPU smoke run of the script.
TIMER = os.environ.get("TIMER", "cupti")
ROWS = int(os.environ.get("ROWS", 49152))
PARAM_MB = int(os.environ.get("PARAM_ROWS_MB", 512))
REPEATS = 5


@functools.cache
def _breakdown():
    """benchmarks/kernel_breakdown.py as a module (loaded once)."""
    path = os.path.join(os.path.dirname(__file__), "kernel_breakdown.py")
    mod_spec = importlib.util.spec_from_file_location("kernel_breakdown", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def kernel_times(f, args, k: int) -> dict[str, float]:
    """kernel name -> us per set (CUPTI); the smoke run's wall time as one "other" entry."""
    if TIMER == "cupti":
        return _breakdown().per_kernel_us(f, args, k)
    return {"wall": bench.get_timer(TIMER)(f, args, REPEATS)[0] * 1e6 / k}


def kernel_kind(name: str) -> str:
    n = name.lower()
    if "sum_partials" in n:
        return "sums"
    if "bwd" in n:
        return "bwd"
    if "fwd" in n:
        return "fwd"
    return "other"


def structure_bytes(op: str, rows: int, cols: int, itemsize: int) -> dict[str, int]:
    """Bytes each cuda kernel must move (read + written) in a training step (the
    parameter vectors left out), and the backward's partial rows P they count."""
    rms, add = "rms" in op, op.startswith("add_")
    arrays = 1 if rms else 2                     # dscale[, dbias] partials
    stats = (1 if rms else 2) * 4 * rows         # float32 rstd[, mean] a row
    x = rows * cols * itemsize
    p = cuda_workspace_rows((rows, cols), jnp.bfloat16 if itemsize == 2 else jnp.float32, jnp.float32,
                            rms=rms, add=add, dscale=True, dbias=not rms)
    partials = 4 * arrays * p * cols
    return {
        "fwd": (4 if add else 2) * x + stats,                # x[, residual] in; y[, h] out
        "bwd": (4 if add else 3) * x + stats + partials,     # x|h, dy[, dh] in; dx out
        "sums": partials + 4 * arrays * cols,
        "partial_rows": p,
    }


def _header(title: str, columns: str):
    """Prints the table's title and column line; the dtype measured (bf16)."""
    print(f"{title}, bf16, rows {ROWS}, {jax.devices()[0].device_kind}; us per call")
    print(columns)
    return bench.DTYPES["bf16"]


def _cuda_step(op: str, cols: int, dtype):
    """(fwd_bwd floor bytes, K sets, kernel name -> us, us by kernel_kind) of op's cuda
    training step at ROWS x cols."""
    floor = bench.min_bytes(op, "fwd_bwd", ROWS, cols, dtype)
    k = bench.num_sets(floor, 512 * bench.MB, 20 * bench.GB, 48)
    sets = bench.make_sets(op, dtype, ROWS, cols, k, with_dy=True, seed=0)
    f, args = bench.timed_call(op, "cuda", "fwd_bwd", dtype, sets)
    times = kernel_times(f, args, k)
    by = {"fwd": 0.0, "bwd": 0.0, "sums": 0.0, "other": 0.0}
    for name, us in times.items():
        by[kernel_kind(name)] += us
    return floor, k, times, by


def kernels(ops: list[str], cols_list: list[int]) -> None:
    dtype = _header("kernel-structure bound", "op cols | fwd ours/copy | bwd ours/copy | sums ours/copy | other "
                    "| ours 3-copy target-copy | target%: 3-copy ours | ours/3-copy")
    for op in ops:
        for cols in cols_list:
            floor, k, times, by = _cuda_step(op, cols, dtype)
            nb = structure_bytes(op, ROWS, cols, 2)
            copies = {part: bench.copy_us(nb[part], k, timer=TIMER, repeats=REPEATS)
                      for part in ("fwd", "bwd", "sums")}
            target = bench.copy_us(floor, k, timer=TIMER, repeats=REPEATS)
            ours, three = sum(by.values()), sum(copies.values())
            print(f"{op} {cols} | {by['fwd']:.1f}/{copies['fwd']:.1f} | {by['bwd']:.1f}/{copies['bwd']:.1f} "
                  f"| {by['sums']:.1f}/{copies['sums']:.1f} | {by['other']:.1f} | {ours:.1f} {three:.1f} "
                  f"{target:.1f} | {100 * target / three:.1f} {100 * target / ours:.1f} | {ours / three:.3f}"
                  f"  (P={nb['partial_rows']}, K={k})")
            for name, us in times.items():
                print(f"      {us:7.2f} us  {kernel_kind(name):5s} {name[:90]}")
            sys.stdout.flush()


def _elementwise(op: str, mode: str):
    """XLA's fusion of an elementwise map over the arrays of op's `mode` kernel."""
    add = op.startswith("add_")
    if mode == "fwd":
        return (lambda x, r: (x + r, x - r)) if add else (lambda x: x * 2)
    return (lambda h, d, dh: h + d + dh) if add else (lambda x, d: x + d)


def narrow(ops: list[str], cols_list: list[int]) -> None:
    dtype = _header("two-kernel bound at narrow rows", "op cols | fwd: copy xla ours -> min | bwd: copy xla "
                    "ours(main) -> min | two-kernel floor, target copy, ours step | %: most ours "
                    "| floor speed-up for 0.85")
    for op in ops:
        add = op.startswith("add_")
        for cols in cols_list:
            floor, k, _, by = _cuda_step(op, cols, dtype)
            key = jax.random.key(1)
            arrays = [[jax.random.normal(jax.random.fold_in(key, 8 * i + j), (ROWS, cols), dtype)
                       for j in range(3 if add else 2)] for i in range(k)]
            jax.block_until_ready(arrays)
            fwd_in = [tuple(a[:2]) if add else (a[0],) for a in arrays]
            row = {}
            for mode, ins, ours in (("fwd", fwd_in, by["fwd"]), ("bwd", arrays, by["bwd"])):
                row[mode] = (bench.copy_us(bench.min_bytes(op, mode, ROWS, cols, dtype), k, timer=TIMER,
                                           repeats=REPEATS),
                             _median_us(_elementwise(op, mode), ins), ours)
            del arrays, fwd_in
            target = bench.copy_us(floor, k, timer=TIMER, repeats=REPEATS)
            # The smoke run (TIMER=wall) has no kernel breakdown: ours is 0 there, left out.
            fastest = {m: min(t for t in row[m] if t > 0) for m in row}
            two = fastest["fwd"] + fastest["bwd"]
            step = sum(by.values())
            print(f"{op} {cols} | " + " | ".join(f"{m}: " + " ".join(f"{t:.2f}" for t in row[m])
                                                   + f" -> {fastest[m]:.2f}" for m in ("fwd", "bwd"))
                  + f" | {two:.2f} {target:.2f} {step:.2f} | {100 * target / two:.1f} {100 * target / step:.1f}"
                  f" | {two * 0.85 / target:.3f}  (sums {by['sums']:.2f}, K={k})")
            sys.stdout.flush()


def _median_us(fn, sets) -> float:
    return bench.measure(fn, sets=sets, repeats=REPEATS, timer=TIMER)


def params(cols_list: list[int]) -> None:
    f32, bf16 = jnp.float32, jnp.bfloat16
    print(f"float32 parameters at long rows, bf16 x, {jax.devices()[0].device_kind}; us per call")
    for cols in cols_list:
        rows = (PARAM_MB << 20) // (cols * 2)  # 512 MiB of x a set: 8192 rows at 65536
        x_bytes = rows * cols * 2
        k = bench.num_sets(2 * x_bytes, 512 * bench.MB, 20 * bench.GB, 48)
        key = jax.random.key(0)
        sets = []
        for i in range(k):
            kx, kd, ks, kb = jax.random.split(jax.random.fold_in(key, i), 4)
            sets.append((jax.random.normal(kx, (rows, cols), bf16), jax.random.normal(kd, (rows, cols), bf16),
                         1 + 0.1 * jax.random.normal(ks, (cols,), f32), 0.1 * jax.random.normal(kb, (cols,), f32)))
        jax.block_until_ready(sets)
        fwd_sets = [(x, s, b) for x, _, s, b in sets]
        fwd_sets16 = [(x, s.astype(bf16), b.astype(bf16)) for x, s, b in fwd_sets]
        bwd_sets = [(x, d, s) for x, d, s, _ in sets]
        rows_out = {
            "copy 2X": bench.copy_us(2 * x_bytes, k, timer=TIMER, repeats=REPEATS),
            "xla x*s+b, f32 params": _median_us(lambda x, s, b: (x.astype(f32) * s + b).astype(bf16), fwd_sets),
            "xla x*s+b, bf16 params": _median_us(lambda x, s, b: (x.astype(f32) * s.astype(f32)
                                                                  + b.astype(f32)).astype(bf16), fwd_sets16),
            "xla -x (no params)": _median_us(lambda x, s, b: -x, fwd_sets),
            "cuda layer_norm fwd, f32 params": _median_us(
                lambda x, s, b: jax_ops.layer_norm(x, s, b, implementation="cuda"), fwd_sets),
            "cuda rms_norm fwd, f32 scale": _median_us(
                lambda x, s, b: jax_ops.rms_norm(x, s, implementation="cuda"), fwd_sets),
            "copy 3X": bench.copy_us(3 * x_bytes, k, timer=TIMER, repeats=REPEATS),
            "xla dy*s+x, f32 scale": _median_us(lambda x, d, s: (d.astype(f32) * s + x.astype(f32)).astype(bf16),
                                                bwd_sets),
            "xla dy+x (no params)": _median_us(lambda x, d, s: d + x, bwd_sets),
        }
        del sets, fwd_sets, fwd_sets16, bwd_sets
        for op in ("layer_norm", "rms_norm"):
            op_sets = bench.make_sets(op, bf16, rows, cols, k, with_dy=True, seed=0)
            for mode in ("bwd", "fwd_bwd"):
                f, args = bench.timed_call(op, "cuda", mode, bf16, op_sets)
                rows_out[f"cuda {op} {mode}"] = sum(kernel_times(f, args, k).values())
                del args
            del op_sets
        rows_out["copy 5X"] = bench.copy_us(5 * x_bytes, k, timer=TIMER, repeats=REPEATS)
        print(f"\ncols {cols}, rows {rows}, K={k}")
        for name, us in rows_out.items():
            ref = rows_out["copy 5X" if "fwd_bwd" in name or "5X" in name else
                           "copy 3X" if "3X" in name or "dy" in name or "bwd" in name else "copy 2X"]
            print(f"  {name:34s} {us:9.1f} us  {100 * ref / us:5.1f} % of its copy")
        sys.stdout.flush()


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "kernels"
    if what == "kernels":
        ops = (sys.argv[2] if len(sys.argv) > 2 else "layer_norm,rms_norm,add_layer_norm,add_rms_norm").split(",")
        cols = [int(c) for c in (sys.argv[3] if len(sys.argv) > 3 else "32,64,128,256,1024").split(",")]
        kernels(ops, cols)
    elif what == "narrow":
        ops = (sys.argv[2] if len(sys.argv) > 2 else "layer_norm,rms_norm,add_layer_norm,add_rms_norm").split(",")
        narrow(ops, [int(c) for c in (sys.argv[3] if len(sys.argv) > 3 else "32,64,128").split(",")])
    elif what == "params":
        params([int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "16384,65536").split(",")])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
