"""The benchmark's ops: {name: BenchSpec}, from the op declarations and the sections below.

`specs()` merges the specs the declarations carry (`Op(bench={...})`, read through
`jax_ops.core.op.OPS`), which take precedence, with the spec-building functions of
this module, one section per op family (`layer_norm_specs()`, `softmax_specs()`,
`relu_specs()`, `batch_norm_specs()`). Each section uses only the public ops
(`jax_ops.layer_norm`, ...), looked up when a benchmark calls them, and imports flax
inside functions, so building a spec imports no op module; a section can move verbatim
into its declaration (jax_ops/ops/<op>.py, as `Op(bench=<family>_specs())`), after
which its entries here are shadowed and the section can go.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jax_ops
from jax_ops.core.benchspec import BenchSpec, view_len
from jax_ops.core.op import OPS as DECLARATIONS

IMPLS = ("cuda", "pallas", "xla", "auto", "flax", "jnp")
KERNEL_IMPLS = ("cuda", "pallas", "xla")  # what the automatic choice picks among
MODES = ("fwd", "fwd_bwd", "bwd", "fwd_res")
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32, "f16": jnp.float16}


@functools.cache
def flax_available() -> bool:
    """Whether flax.linen imports (the "flax" baselines; "jnp" stands in otherwise)."""
    try:
        import flax.linen  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken: either way not usable
        return False
    return True


# ---------------------------------------------------------- layer_norm family ---
# LayerNorm and RMSNorm over the last axis. params: float32 scale (and bias),
# differentiated.

NORM_EPSILON = {"layer_norm": 1e-5, "rms_norm": 1e-6}  # jax_ops' defaults, used by every impl


def layer_norm_specs() -> dict[str, BenchSpec]:
    """Benchmarks of the layer_norm family: layer_norm, rms_norm."""

    def jnp_norm(op: str, eps: float) -> Callable:
        """Plain jax.numpy norm with float32 math, output in x's dtype."""
        def layer_norm(x, scale, bias):
            xf = x.astype(jnp.float32)
            mean = jnp.mean(xf, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
            return ((xf - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)

        def rms_norm(x, scale):
            xf = x.astype(jnp.float32)
            ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
            return (xf * jax.lax.rsqrt(ms + eps) * scale).astype(x.dtype)

        return layer_norm if op == "layer_norm" else rms_norm

    def flax_norm(op: str, eps: float, dtype) -> Callable:
        import flax.linen as nn
        if op == "layer_norm":
            ln = nn.LayerNorm(epsilon=eps, dtype=dtype, param_dtype=jnp.float32)
            return lambda x, scale, bias: ln.apply({"params": {"scale": scale, "bias": bias}}, x)
        rms = nn.RMSNorm(epsilon=eps, dtype=dtype, param_dtype=jnp.float32)
        return lambda x, scale: rms.apply({"params": {"scale": scale}}, x)

    def spec(op: str) -> BenchSpec:
        eps = NORM_EPSILON[op]
        n = 2 if op == "layer_norm" else 1  # scale, bias / scale

        def make_inputs(kx, ks, kb, dtype, rows, cols):
            x = jax.random.normal(kx, (rows, cols), dtype)
            scale = 1.0 + 0.1 * jax.random.normal(ks, (cols,), jnp.float32)
            return x, (scale, 0.1 * jax.random.normal(kb, (cols,), jnp.float32))[:n]

        def kernel(impl):
            if op == "layer_norm":
                return lambda x, scale, bias: jax_ops.layer_norm(
                    x, scale, bias, epsilon=eps, implementation=impl)
            return lambda x, scale: jax_ops.rms_norm(x, scale, epsilon=eps, implementation=impl)

        def nbytes(rows, cols, itemsize):
            x, p = rows * cols * itemsize, cols * 4
            s = rows * 4 * n  # float32 stats: layer_norm mean + rstd; rms_norm rstd
            fwd = 2 * x + n * p
            bwd = 3 * x + s + p + n * p
            return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + s + bwd}

        return BenchSpec(make_inputs=make_inputs, kernel=kernel, nbytes=nbytes,
                         reference=lambda dtype: jnp_norm(op, eps),
                         flax=lambda dtype: flax_norm(op, eps, dtype), num_params=n,
                         epsilon=eps, table_stages=("fwd", "bwd", "fwd_stats"))

    return {"layer_norm": spec("layer_norm"), "rms_norm": spec("rms_norm")}


# ------------------------------------------------------------- softmax family ---
# Kernels call jax_ops.softmax / log_softmax on the (B, Q, cols) view for the masked
# variants and reshape y back to (rows, cols) (free: a bitcast).

SOFTMAX_X_SCALE = 4.0            # softmax inputs: x = 4 * N(0, 1), peaked rows
MASK_KEEP = 0.9                  # softmax_mask: P(mask element is True)
MASK_Q_CAP, CAUSAL_Q_CAP = 512, 2048  # Q of the (rows // Q, Q, cols) views, at most


def softmax_specs() -> dict[str, BenchSpec]:
    """Benchmarks of the softmax family: softmax, log_softmax, softmax_mask, softmax_causal."""

    def softmax_inputs(kx, kp, kq, dtype, rows, cols):
        return SOFTMAX_X_SCALE * jax.random.normal(kx, (rows, cols), dtype), ()

    def mask_inputs(kx, kp, kq, dtype, rows, cols):
        """x and a key-padding mask (B, 1, cols), True = keep (~90%), never a fully masked
        row (column 0 always kept)."""
        x, _ = softmax_inputs(kx, kp, kq, dtype, rows, cols)
        b = rows // view_len(rows, cols, MASK_Q_CAP)
        keep = jax.random.bernoulli(kp, MASK_KEEP, (b, 1, cols)).at[..., 0].set(True)
        return x, (keep,)

    def softmax_kernel(log: bool = False, masked: bool = False, causal: bool = False) -> Callable:
        def make(impl):
            def fn(x, *mask):
                rows, cols = x.shape
                op = jax_ops.log_softmax if log else jax_ops.softmax  # looked up at call time
                if masked:
                    y = op(x.reshape(mask[0].shape[0], -1, cols), mask=mask[0], implementation=impl)
                elif causal:
                    q = view_len(rows, cols, CAUSAL_Q_CAP)
                    y = op(x.reshape(rows // q, q, cols), causal=True, implementation=impl)
                else:
                    y = op(x, axis=-1, implementation=impl)
                return y.reshape(rows, cols)
            return fn
        return make

    def jnp_softmax(log: bool = False, masked: bool = False, causal: bool = False) -> Callable:
        """dtype -> plain jax.nn (log_)softmax on float32 logits, -inf where masked, output
        in x's dtype; differentiated by JAX autodiff."""
        def fn(x, *mask):
            rows, cols = x.shape
            z = x.astype(jnp.float32)
            if masked:
                z = jnp.where(mask[0], z.reshape(mask[0].shape[0], -1, cols), -jnp.inf)
            elif causal:
                q = view_len(rows, cols, CAUSAL_Q_CAP)
                keep = jnp.tril(jnp.ones((q, cols), bool), cols - q)  # j <= i + (cols - q)
                z = jnp.where(keep, z.reshape(rows // q, q, cols), -jnp.inf)
            y = (jax.nn.log_softmax if log else jax.nn.softmax)(z, axis=-1)
            return y.astype(x.dtype).reshape(rows, cols)
        return lambda dtype: fn

    def softmax_bytes(mask_cap: int | None = None) -> Callable:
        def nbytes(rows, cols, itemsize):
            x = rows * cols * itemsize
            m = 0 if mask_cap is None else rows // view_len(rows, cols, mask_cap) * cols  # bool
            fwd, bwd = 2 * x + m, 3 * x  # bwd: read y and dy, write dx
            return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}
        return nbytes

    def spec(log: bool = False, masked: bool = False, causal: bool = False) -> BenchSpec:
        flags = dict(log=log, masked=masked, causal=causal)
        common = dict(kernel=softmax_kernel(**flags), reference=jnp_softmax(**flags),
                      diff_params=False)
        if masked:
            return BenchSpec(make_inputs=mask_inputs, nbytes=softmax_bytes(MASK_Q_CAP),
                             unmasked="softmax", view_cap=MASK_Q_CAP,
                             table_alias=("softmax", "fwd_mask"),
                             title=f" as (B, Q, cols), Q = min(cols, {MASK_Q_CAP}), "
                                   f"mask (B, 1, cols) {MASK_KEEP:.0%} True", **common)
        if causal:
            return BenchSpec(make_inputs=softmax_inputs, nbytes=softmax_bytes(),
                             unmasked="softmax", view_cap=CAUSAL_Q_CAP,
                             title=f" as (B, Q, cols), Q = min(cols, {CAUSAL_Q_CAP}), causal",
                             **common)
        return BenchSpec(make_inputs=softmax_inputs, nbytes=softmax_bytes(),
                         table_stages=("fwd", "bwd"), xla_summary=True, **common)

    return {"softmax": spec(), "log_softmax": spec(log=True),
            "softmax_mask": spec(masked=True), "softmax_causal": spec(causal=True)}


# ---------------------------------------------------------------- relu family ---
# x is (rows, cols). The mask residual is 1 bit per element: M = rows * cols / 8 bytes.

def relu_specs() -> dict[str, BenchSpec]:
    """Benchmarks of the relu family: relu, add_relu (y + 1-bit mask)."""

    def spec(add: bool) -> BenchSpec:
        def make_inputs(kx, kp, kq, dtype, rows, cols):
            x = jax.random.normal(kx, (rows, cols), dtype)
            return x, ((jax.random.normal(kp, (rows, cols), dtype),) if add else ())

        def kernel(impl):
            if add:
                return lambda x, z: jax_ops.add_relu(x, z, implementation=impl)
            return lambda x: jax_ops.relu(x, implementation=impl)

        def reference(dtype):  # XLA's relu, autodiff keeps what it likes (x or a predicate)
            if add:
                return lambda x, z: jax.nn.relu(x + z)
            return jax.nn.relu

        def nbytes(rows, cols, itemsize):
            x, m = rows * cols * itemsize, -(-rows * cols // 32) * 4
            fwd = (3 if add else 2) * x + m      # read x (and z), write y and the mask
            bwd = 2 * x + m                      # read dy and the mask, write dx (= dz)
            return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}

        return BenchSpec(make_inputs=make_inputs, kernel=kernel, reference=reference,
                         nbytes=nbytes, diff_params=add, table_stages=("fwd", "bwd"),
                         title=" (y + 1-bit mask)")

    return {"relu": spec(add=False), "add_relu": spec(add=True)}


# ---------------------------------------------------------- batch_norm family ---
# The BatchNorm fusions, training mode. cols are the channels (an NHWC activation
# flattened to (N*H*W, C)); the mask residual is 1 bit per element.

BN_EPSILON = 1e-5


def batch_norm_specs() -> dict[str, BenchSpec]:
    """Benchmarks of the batch_norm family: batch_norm_relu, batch_norm_add_relu."""

    def spec(add: bool) -> BenchSpec:
        op = "batch_norm_add_relu" if add else "batch_norm_relu"

        def make_inputs(kx, kp, kq, dtype, rows, cols):
            x = 0.5 + jax.random.normal(kx, (rows, cols), dtype)
            scale = 1.0 + 0.1 * jax.random.normal(kp, (cols,), jnp.float32)
            bias = 0.1 * jax.random.normal(kq, (cols,), jnp.float32)
            z = (jax.random.normal(jax.random.fold_in(kq, 1), (rows, cols), dtype),) if add else ()
            return x, (*z, scale, bias)

        def kernel(impl):  # training forward; y only (the statistics are for the running averages)
            if add:
                return lambda x, z, s, b: jax_ops.batch_norm_add_relu(
                    x, z, s, b, epsilon=BN_EPSILON, implementation=impl)[0]
            return lambda x, s, b: jax_ops.batch_norm_relu(x, s, b, epsilon=BN_EPSILON,
                                                           implementation=impl)[0]

        def reference(dtype):  # BatchNorm in float32 jnp + jax.nn.relu, autodiff
            def bn(x, s, b):
                xf = x.astype(jnp.float32)
                mean = jnp.mean(xf, axis=0)
                var = jnp.mean(jnp.square(xf - mean), axis=0)
                return ((xf - mean) * jax.lax.rsqrt(var + BN_EPSILON) * s + b).astype(x.dtype)
            if add:
                return lambda x, z, s, b: jax.nn.relu(bn(x, s, b) + z)
            return lambda x, s, b: jax.nn.relu(bn(x, s, b))

        def flax(dtype):  # flax.linen.BatchNorm (training, batch_stats updated) + jax.nn.relu
            import flax.linen as nn
            m = nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=BN_EPSILON,
                             dtype=dtype, param_dtype=jnp.float32)

            def bn(x, s, b):
                c = x.shape[-1]
                stats = {"mean": jnp.zeros((c,), jnp.float32), "var": jnp.ones((c,), jnp.float32)}
                y, _ = m.apply({"params": {"scale": s, "bias": b}, "batch_stats": stats}, x,
                               mutable=["batch_stats"])
                return y
            if add:
                return lambda x, z, s, b: jax.nn.relu(bn(x, s, b) + z)
            return lambda x, s, b: jax.nn.relu(bn(x, s, b))

        def nbytes(rows, cols, itemsize):
            # Two-pass floors: the per-channel reduction over all rows must finish before
            # the elementwise pass, so x (and dy) are read twice.
            x, m, p = rows * cols * itemsize, -(-rows * cols // 32) * 4, cols * 4
            z = x if add else 0
            fwd = 3 * x + z + m + 2 * p            # stats: read x; then read x (z), write y, mask
            bwd = 5 * x + z + 2 * m + 4 * p        # reduce: dy, x, mask; then dy, x, mask -> dx (dz)
            return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}

        return BenchSpec(make_inputs=make_inputs, kernel=kernel, reference=reference,
                         flax=flax, nbytes=nbytes, num_params=2, epsilon=BN_EPSILON,
                         table_stages=("bwd",), table_alias=(op, "fwd_stats"),
                         title=" training, (rows, C) = (N*H*W, C)")

    return {"batch_norm_relu": spec(add=False), "batch_norm_add_relu": spec(add=True)}


# ------------------------------------------------------------------ merging ---

#: the families of this module, in the order the CLI lists their ops
FAMILIES = (layer_norm_specs, softmax_specs, relu_specs, batch_norm_specs)
_local: dict[str, BenchSpec] | None = None


def _local_specs() -> dict[str, BenchSpec]:
    global _local
    if _local is None:
        _local = {name: s for family in FAMILIES for name, s in family().items()}
    return _local


def specs() -> dict[str, BenchSpec]:
    """{benchmark name: BenchSpec} of every op the benchmark knows.

    The declarations' specs (`Op(bench=...)` of the op modules imported so far) come
    first and win over this module's sections for the same name. Order: this module's
    names (layer_norm, rms_norm, softmax, ..., batch_norm_add_relu), then names only a
    declaration has."""
    declared: dict[str, BenchSpec] = {}
    for op in DECLARATIONS.values():
        declared.update(op.bench)
    local = _local_specs()
    merged = {name: declared.get(name, s) for name, s in local.items()}
    merged.update((name, s) for name, s in declared.items() if name not in merged)
    return merged


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
    their residuals (mask, statistics) in any case."""
    itemsize = dtype if isinstance(dtype, int) else jnp.dtype(DTYPES.get(dtype, dtype)).itemsize
    return spec(op).nbytes(rows, cols, itemsize)["fwd" if mode == "fwd_res" else mode]


def num_params(op: str) -> int:
    """The number of float32 parameter vectors of op (2, 1, or 0 for the softmax ops)."""
    return spec(op).num_params
