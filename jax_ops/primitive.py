"""One helper that defines a jax_ops primitive: abstract eval, eager impl, batching, and
a lowering per platform that asks jax_ops.dispatch which registered implementation
serves the call; plus helpers that build the common kinds of Implementation."""
from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_ops import _extension, dispatch, registry
from jax_ops import sharding as _sharding

LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

#: activation dtypes every op takes
ACT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def empty():
    """The placeholder of an absent operand/result: a zero-element float32 array."""
    return jnp.zeros((0,), jnp.float32)


def present(a) -> bool:
    return a.shape != (0,)


def dtype_name(d) -> str:
    return jnp.dtype(d).name

#: primitive -> (stage, op_of(params), variant_of(params), shape_of(shape, params));
#: dispatch.explain and autotune read it
PRIMITIVES: dict[Primitive, tuple] = {}


def query(prim: Primitive, avals, params: dict, platform: str) -> registry.Query:
    """The dispatch query of one call of `prim` (operand 0 has x's shape and dtype)."""
    stage, op_of, variant_of, shape_of = PRIMITIVES[prim]
    x = avals[0]
    return registry.Query(op_of(params), stage, platform, tuple(shape_of(tuple(x.shape), params)),
                          x.dtype.name, dispatch.device_kind(platform), variant_of(params))


def op_calls(fn: Callable, *args, **kwargs) -> list[tuple]:
    """(primitive, operand avals, params) of every jax_ops call in fn(*args, **kwargs), in
    program order, nested jits, custom_vjp bodies, scans and conds included."""
    from jax.extend.core import ClosedJaxpr, Jaxpr
    calls = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive in PRIMITIVES:
                calls.append((eqn.primitive, tuple(v.aval for v in eqn.invars), dict(eqn.params)))
            for v in eqn.params.values():
                for item in (v if isinstance(v, (tuple, list)) else (v,)):
                    if isinstance(item, ClosedJaxpr):
                        walk(item.jaxpr)
                    elif isinstance(item, Jaxpr):
                        walk(item)

    walk(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr)
    return calls


def default_platform() -> str:
    """The jax lowering platform of the default backend ("gpu" -> "cuda")."""
    backend = jax.default_backend()
    return {"gpu": "cuda"}.get(backend, backend)


def _with_vma(abstract_eval, *avals, **params):
    """abstract_eval's results, varying over the manual mesh axes (shard_map) any
    operand varies over: per-device results of per-device data."""
    outs = abstract_eval(*avals, **params)
    vma = frozenset().union(*(a.mat.varying for a in avals if hasattr(a, "mat")))
    if not vma:
        return outs
    from jax._src import core as _core
    return type(outs)(
        o.update(sharding=_core.get_cur_mesh_sharding() if o.sharding.mesh.empty else o.sharding,
                 manual_axis_type=o.mat.update(varying=vma)) for o in outs)


def match_vma(*arrays):
    """The arrays, each made varying over every manual mesh axis (shard_map) that any of
    them varies over, placeholders excepted (jax.lax.pcast to="varying"; its transpose psums the gradient of a
    replicated parameter). Identity outside shard_map. The custom VJPs call it on their
    differentiable inputs, so per-device gradients match their inputs' types."""
    def vma(a):
        aval = jax.typeof(a) if a is not None else None
        return getattr(getattr(aval, "mat", None), "varying", frozenset())
    every = frozenset().union(*(vma(a) for a in arrays))
    if not every:
        return arrays
    return tuple(a if a is None or a.shape == (0,) or not (every - vma(a)) else
                 jax.lax.pcast(a, tuple(sorted(every - vma(a))), to="varying") for a in arrays)


def define_primitive(name: str, *, stage: str, op_of: Callable[[dict], str],
                     abstract_eval: Callable, batching_rule: Callable | None = None,
                     variant_of: Callable[[dict], str] = lambda params: "",
                     shape_of: Callable[[tuple, dict], tuple] = lambda shape, params: shape,
                     sharding=None) -> Primitive:
    """Creates primitive `jax_ops_<name>` (multiple results) for one stage of an op.

    variant_of(params) names a flavour of the stage that the measured tables time
    separately (a training forward that also writes statistics: "stats").
    shape_of(x's shape, params) is the (rows..., cols) shape the dispatcher sees, where
    the reduced axis need not be x's last (softmax over another axis).

    Every such primitive carries an `implementation` param (None = automatic); the
    others are passed to the chosen implementation's lowering.

    sharding: a `jax_ops.sharding.Rules` (roles of operands and results, per-device
    code where a sharded axis needs cross-device statistics); on several devices the
    lowering wraps the call in a custom_partitioning built from it.
    """
    prim = Primitive(f"jax_ops_{name}")
    prim.multiple_results = True
    prim.def_impl(partial(jax._src.dispatch.apply_primitive, prim))
    prim.def_abstract_eval(partial(_with_vma, abstract_eval))
    PRIMITIVES[prim] = (stage, op_of, variant_of, shape_of)

    def lowering(ctx, *args, platform, implementation, **params):
        if sharding is not None and _sharding.spans_devices(ctx):
            out = _sharding.lower_partitioned(prim, sharding, ctx, args,
                                              dict(params, implementation=implementation))
            if out is not None:
                return out
        q = query(prim, ctx.avals_in, params, platform)
        d = dispatch.choose(q, implementation)
        lower = registry.get(q.op, d.implementation).lower[stage]
        return lower(ctx, *args, platform=platform, config=d.config, **params)

    for platform in LOWERING_PLATFORMS:
        mlir.register_lowering(prim, partial(lowering, platform=platform), platform=platform)
    if batching_rule is not None:
        batching.primitive_batchers[prim] = batching_rule
    if sharding is not None:  # the partitioner needs the device assignment at lowering
        jax._src.dispatch.prim_requires_devices_during_lowering.add(prim)
    return prim


# ------------------------------------------------ kinds of implementations ---

def jnp_lowering(fn: Callable, *, takes_config: bool = False) -> Callable:
    """Lowering of a JAX-traceable fn(*operands, **params) -> outputs (list/tuple);
    takes_config: fn also gets the chosen tunable config as `config=`."""
    def lower(ctx, *args, platform, config, **params):
        del platform
        if takes_config:
            params = dict(params, config=config)
        return mlir.lower_fun(partial(fn, **params), multiple_results=True)(ctx, *args)
    return lower


def user_lowerings(fwd: Callable, bwd: Callable | None) -> dict[str, Callable]:
    """{stage: lowering} of an op's adapted user kernels (jnp code taking config=);
    without a backward the stage is left to the automatic choice."""
    lower = {"fwd": jnp_lowering(fwd, takes_config=True)}
    if bwd is not None:
        lower["bwd"] = jnp_lowering(bwd, takes_config=True)
    return lower


def ffi_lowering(target: str, attrs: Callable[[dict], dict], *, flat_operands=(),
                 flat_results=()) -> Callable:
    """Lowering to XLA FFI custom call `target`; attrs(params) gives its attributes.
    flat_operands/flat_results: indices of arrays the handler takes as 1-D (the bit
    masks, whose primitive shape follows x's axes): reshaped, a bitcast."""
    def lower(ctx, *args, platform, config, **params):
        del platform, config
        if not (flat_operands or flat_results):
            return jax.ffi.ffi_lowering(target)(ctx, *args, **attrs(params))

        def call(*a):
            a = [v.reshape(-1) if i in flat_operands else v for i, v in enumerate(a)]
            outs = [jax.ShapeDtypeStruct((math.prod(o.shape),) if i in flat_results else o.shape,
                                         o.dtype) for i, o in enumerate(ctx.avals_out)]
            res = jax.ffi.ffi_call(target, outs)(*a, **attrs(params))
            return [r.reshape(o.shape) for r, o in zip(res, ctx.avals_out)]
        return mlir.lower_fun(call, multiple_results=True)(ctx, *args)
    return lower


def ffi_supports(target: str) -> Callable[[registry.Query], tuple[bool, str]]:
    def supports(q):
        if _extension.has_target(q.platform, target):
            return True, ""
        why = f"no {target} kernel is registered for platform {q.platform!r}"
        if _extension.IMPORT_ERROR is not None:
            why += f" (the jax_ops._ffi extension failed to import: {_extension.IMPORT_ERROR})"
        return False, why
    return supports


def pallas_lowering(fn: Callable) -> Callable:
    """Lowering of fn(*operands, config=, interpret=, **params) built on pallas_call:
    compiled for the GPU on "cuda", run by the Pallas interpreter elsewhere."""
    def lower(ctx, *args, platform, config, **params):
        body = partial(fn, config=config, interpret=platform != "cuda", **params)
        with warnings.catch_warnings():  # the Triton back end's deprecation notice
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            return mlir.lower_fun(body, multiple_results=True)(ctx, *args)
    return lower


def pallas_supports(limit: Callable[[registry.Query], tuple[bool, str]]):
    """Pallas needs static shapes, and on GPUs the Triton back end's compute capability >= 8.0."""
    def supports(q):
        if not q.static:
            return False, "pallas needs static shapes (symbolic dims under jax.export)"
        if q.platform not in ("cuda", "cpu"):
            return False, f"pallas kernels target CUDA GPUs (interpreted on CPU), not {q.platform!r}"
        if q.platform == "cuda":
            cc = _compute_capability()
            if cc is not None and cc < (8, 0):
                return False, f"pallas (Triton back end) needs compute capability >= 8.0; got {cc}"
        return limit(q)
    return supports


@functools.cache
def _compute_capability():
    try:
        d = jax.devices("cuda")[0]
        return tuple(int(c) for c in str(d.compute_capability).split("."))
    except Exception:
        return None


def vmap_reference(reference: Callable, args, dims, params):
    """Fallback batching: vmap the jnp reference (used where rows cannot be folded)."""
    params = {k: v for k, v in params.items() if k != "implementation"}
    out = jax.vmap(partial(reference, **params), in_axes=tuple(dims))(*args)
    return out, (0,) * len(out)
