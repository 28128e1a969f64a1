"""One helper that defines a jax_ops primitive: abstract eval, per-platform lowering
that picks an implementation (dispatch.choose), eager impl, and batching."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_ops import dispatch

LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def define_primitive(
    name: str,
    *,
    op: str,
    abstract_eval: Callable,
    reference: Callable,
    ffi_target: str,
    ffi_attrs: Callable[[dict], dict],
    batching_rule: Callable | None = None,
) -> Primitive:
    """Creates primitive `jax_ops_<name>` with multiple results.

    reference(*args, **params): the jnp implementation ("xla").
    ffi_target: the XLA FFI target of the "cuda" implementation; ffi_attrs(params)
      gives its attributes (params that only shape the outputs are left out).
    Every primitive carries an `implementation` param (None = automatic).
    """
    prim = Primitive(f"jax_ops_{name}")
    prim.multiple_results = True
    prim.def_impl(partial(jax._src.dispatch.apply_primitive, prim))
    prim.def_abstract_eval(abstract_eval)

    def lowering(ctx, *args, platform, implementation, **params):
        impl = dispatch.choose(op, implementation, platform, ffi_target)
        if impl == "xla":
            return mlir.lower_fun(partial(reference, **params), multiple_results=True)(ctx, *args)
        return jax.ffi.ffi_lowering(ffi_target)(ctx, *args, **ffi_attrs(params))

    for platform in LOWERING_PLATFORMS:
        mlir.register_lowering(prim, partial(lowering, platform=platform), platform=platform)
    if batching_rule is not None:
        batching.primitive_batchers[prim] = batching_rule
    return prim


def vmap_reference(reference: Callable, args, dims, params):
    """Fallback batching: vmap the jnp reference (used where rows cannot be folded)."""
    params = {k: v for k, v in params.items() if k != "implementation"}
    out = jax.vmap(partial(reference, **params), in_axes=tuple(dims))(*args)
    return out, (0,) * len(out)
