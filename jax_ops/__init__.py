"""jax_ops: fused memory-bound ops for JAX (hand CUDA through XLA FFI, Pallas, XLA)."""
from jax_ops import _extension
from jax_ops.dispatch import IMPLEMENTATIONS
from jax_ops.layer_norm import layer_norm, rms_norm

__all__ = ["layer_norm", "rms_norm", "IMPLEMENTATIONS", "with_cuda"]


def with_cuda() -> bool:
    """Whether the installed extension carries the CUDA kernels."""
    return bool(_extension._ffi is not None and getattr(_extension._ffi, "with_cuda", False))
