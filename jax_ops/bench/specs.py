"""The benchmark's ops: {name: BenchSpec}, from the op declarations (`Op(bench=...)`
in jax_ops/ops/<op>.py, read through `jax_ops.core.op.OPS`)."""
from __future__ import annotations

import functools

import jax.numpy as jnp

from jax_ops.core.benchspec import BenchSpec
from jax_ops.core.op import OPS as DECLARATIONS

IMPLS = ("cuda", "pallas", "xla", "auto", "flax", "jnp")
KERNEL_IMPLS = ("cuda", "pallas", "xla")  # what the automatic choice picks among
MODES = ("fwd", "fwd_bwd", "bwd", "fwd_res", "step")
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32, "f16": jnp.float16}


@functools.cache
def flax_available() -> bool:
    """Whether flax.linen imports (the "flax" baselines; "jnp" stands in otherwise)."""
    try:
        import flax.linen  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken: either way not usable
        return False
    return True


# ------------------------------------------------------------------ merging ---

@functools.cache
def specs() -> dict[str, BenchSpec]:
    """{benchmark name: BenchSpec} of every op the benchmark knows, from the op
    declarations (`Op(bench=...)`, jax_ops/ops/*.py), in their import order."""
    out: dict[str, BenchSpec] = {}
    for op in DECLARATIONS.values():
        out.update(op.bench())
    return out


def spec(op: str) -> BenchSpec:
    """The BenchSpec of benchmark `op` (KeyError naming the known ones)."""
    all_specs = specs()
    if op not in all_specs:
        raise KeyError(f"jax_ops.bench: no benchmark {op!r}; known: {', '.join(all_specs)}")
    return all_specs[op]


def min_bytes(op: str, mode: str, rows: int, cols: int, dtype) -> int:
    """The op's minimum DRAM traffic per call of `mode` (see jax_ops/bench/cli.py's
    docstring for the counts). dtype: "bf16"/"f32"/"f16", a dtype, or an item size in
    bytes. fwd_res (the training forward) counts the forward's floor: our forwards write
    their residuals (mask, statistics) in any case; step counts fwd_bwd's."""
    itemsize = dtype if isinstance(dtype, int) else jnp.dtype(DTYPES.get(dtype, dtype)).itemsize
    return spec(op).nbytes(rows, cols, itemsize)[{"fwd_res": "fwd", "step": "fwd_bwd"}.get(mode, mode)]


def num_params(op: str) -> int:
    """The number of float32 parameter vectors of op (2, 1, or 0 for the softmax ops)."""
    return spec(op).num_params
