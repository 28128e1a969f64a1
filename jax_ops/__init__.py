"""jax_ops: fused memory-bound ops for JAX (hand CUDA through XLA FFI, Pallas, XLA).

Layers, lowest first (no module imports one above it): `_extension` (the FFI module),
`core` (the op-declaration framework: registry, dispatch, sharding, op), `ops` (one
declaration per op family), then `tuning` (autotune), `bench`, `fx`, the Flax layers
and this package's public names.
"""
from jax_ops import _extension
from jax_ops.core.calls import explain
from jax_ops.core.registry import (implementations, register_implementation,
                                   unregister_implementation, use)
from jax_ops.ops.layer_norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from jax_ops.ops.softmax import log_softmax, softmax
from jax_ops.ops.relu import add_relu, relu
from jax_ops.ops.batch_norm import batch_norm_add_relu, batch_norm_relu
from jax_ops.ops.cross_entropy import cross_entropy, linear_cross_entropy
from jax_ops.tuning import autotune
from jax_ops._export import custom_call_targets, disabled_checks, export
from jax_ops.fx import optimize  # also binds the jax_ops.fx subpackage

#: the built-in implementations every op has
IMPLEMENTATIONS = ("xla", "cuda", "pallas")

__all__ = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "softmax", "log_softmax",
           "relu", "add_relu", "batch_norm_relu", "batch_norm_add_relu", "cross_entropy", "linear_cross_entropy", "IMPLEMENTATIONS", "implementations", "use",
           "register_implementation", "unregister_implementation", "explain", "autotune",
           "with_cuda", "export", "disabled_checks", "custom_call_targets", "fx", "optimize"]


def __getattr__(name):
    # The Flax layers load on first use: flax is an optional dependency.
    if name in ("nn", "nnx"):
        import importlib
        return importlib.import_module(f"jax_ops.{name}")
    raise AttributeError(f"module 'jax_ops' has no attribute {name!r}")


def with_cuda() -> bool:
    """Whether the installed extension carries the CUDA kernels."""
    return bool(_extension._ffi is not None and getattr(_extension._ffi, "with_cuda", False))
