"""jax.export of functions that use jax_ops: the FFI custom calls are allowed through."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax import export as _jax_export

from jax_ops import _extension


def custom_call_targets() -> list[str]:
    """The FFI targets jax_ops registers (on any platform)."""
    return sorted(set().union(*_extension.REGISTERED.values())) if _extension.REGISTERED else []


#: the custom call our Pallas kernels lower to on GPUs (Triton back end); exported with
#: static shapes, it carries the compiled kernel, with no compatibility guarantee either
PALLAS_TRITON_TARGET = "__gpu$xla.gpu.triton"


def disabled_checks() -> list:
    """jax.export safety checks to disable for our custom calls (the FFI targets and the
    Pallas/Triton one): pass these as jax.export.export(..., disabled_checks=...)."""
    return [_jax_export.DisabledSafetyCheck.custom_call(t)
            for t in (*custom_call_targets(), PALLAS_TRITON_TARGET)]


def export(fn: Callable, *args, platforms: Sequence[str] | None = None,
           disabled: Sequence = (), **kwargs) -> _jax_export.Exported:
    """jax.export.export(jax.jit(fn), ...)(*args, **kwargs) with our custom-call targets
    allowed. args: arrays or jax.ShapeDtypeStruct, e.g. with symbolic shapes from
    jax.export.symbolic_shape("b, 4096"). fn may already be jitted.

    The automatic choice declines implementations that need static shapes (pallas)
    when a dim is symbolic; the exported artifact holds the chosen kernels' custom calls
    (its `platforms`: the default backend's, or those given), which the importing
    process must have registered (`import jax_ops`). Round trip:
    `jax.export.deserialize(exp.serialize()).call(*concrete_args)`.
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    exp = _jax_export.export(jitted, platforms=platforms,
                             disabled_checks=list(disabled) + disabled_checks())
    return exp(*args, **kwargs)
