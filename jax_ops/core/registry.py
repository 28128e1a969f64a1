"""The implementation registry: (op, name) -> how to lower it, and where it applies.

Every op has the built-in implementations "xla" (plain jax.numpy), "cuda" (our FFI
kernels) and "pallas" (pallas_kernels/), and users may add their own with
`register_implementation`. An Implementation lowers one or more *stages* of an
op ("fwd", "bwd"); `supports(query)` says whether it can serve a given platform,
shape and dtype, and why not. The choice among them is jax_ops.dispatch's job.

`use(...)` overrides the automatic choice in a scope. Its value is part of
jax.jit's cache key (a jax config state), so a function traced outside the scope
is traced again inside it; the override is read when an op is called (traced)
and recorded in the primitive's `implementation` parameter.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax._src import config as jax_config  # for a jit-keyed context state (see use())

# fwd/bwd: every op. The others are the per-device stages of an op whose reduced axis is
# split over devices (only bound by the ops' sharding rules, core/sharding.py): per-row
# partial statistics, then the pass that finishes with the combined statistics
# (LayerNorm/RMSNorm, softmax; issue 23).
STAGES = ("fwd", "bwd", "partials", "apply", "bwd_partials", "bwd_apply")


@dataclasses.dataclass(frozen=True)
class Query:
    """What the dispatcher knows when it lowers one op call (all static)."""
    op: str                      # "layer_norm", "rms_norm", ...
    stage: str                   # "fwd", "bwd" (or a per-device stage, STAGES)
    platform: str                # jax lowering platform: "cpu", "cuda", "rocm", "tpu"
    shape: tuple                 # x's shape (dims may be symbolic under jax.export)
    dtype: str                   # x's dtype name
    device_kind: str | None = None  # e.g. "NVIDIA H200"; None when unknown (CPU, export)
    variant: str = ""            # e.g. "stats": a training forward that also writes statistics

    @property
    def static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    @property
    def cols(self) -> int | None:
        return self.shape[-1] if self.shape and isinstance(self.shape[-1], int) else None

    @property
    def rows(self) -> int | None:
        lead = self.shape[:-1]
        return math.prod(lead) if all(isinstance(d, int) for d in lead) else None

    def describe(self) -> str:
        dims = ",".join(str(d) for d in self.shape)
        stage = f"{self.stage}+{self.variant}" if self.variant else self.stage
        return f"{self.op} {stage} {self.dtype}[{dims}] on {self.platform}"

    @property
    def table_stage(self) -> str:
        """The stage name in measured tables: "fwd", "fwd_stats", "bwd"."""
        return f"{self.stage}_{self.variant}" if self.variant else self.stage


Supports = Callable[[Query], "tuple[bool, str] | bool"]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to run an op.

    lower[stage](call, *operands or None, **params) -> results or None: a JAX-traceable
      stage function (core/op.py: `call.config`, `call.interpret`, `call.out_avals`).
    supports(query) -> (ok, reason) or bool.
    configs(query) -> tunable parameter sets autotune tries (first = default), or None.
    prefer: the automatic choice takes it, where it is supported, over the measured
      tables and heuristics (autotune results still come first).
    tile_cols(cols) -> the row width its kernels work on (e.g. padded to a power of two),
      or None: between two measured widths the table then estimates it from the one
      of the same tile width (core/dispatch.py).
    load_words: the load widths in bytes its kernels take of a row that is a whole number
      of them, any other row a value at a time (None: 16 bytes only). The measured table
      keeps rows of each class of the op's cuda implementation apart (core/dispatch.py).
    automatic(query) -> (ok, reason) or bool: where the automatic choice may take it
      (default: wherever supported); e.g. kernels that would need a transpose copy
      leave a softmax over a non-last axis to XLA unless asked for by name.
    """
    op: str
    name: str
    lower: Mapping[str, Callable]
    supports: Supports
    configs: Callable[[Query], list[dict]] | None = None
    prefer: bool = False
    builtin: bool = True
    description: str = ""
    automatic: Supports | None = None
    tile_cols: Callable[[int], int] | None = None
    load_words: tuple[int, ...] | None = None

    def why_not(self, q: Query) -> str | None:
        """None if this implementation can serve q, else the reason it can't."""
        if q.stage not in self.lower:
            return f"{self.name!r} has no {q.stage} stage"
        res = self.supports(q)
        ok, why = (res, "") if isinstance(res, bool) else res
        return None if ok else (why or f"{self.name!r} does not support {q.describe()}")

    def why_not_automatic(self, q: Query) -> str | None:
        """None if the automatic choice may pick this implementation for q, else why not."""
        why = self.why_not(q)
        if why is not None or self.automatic is None:
            return why
        res = self.automatic(q)
        ok, why = (res, "") if isinstance(res, bool) else res
        return None if ok else (why or f"{self.name!r} is not chosen automatically for {q.describe()}")

    def default_config(self, q: Query) -> dict | None:
        return self.configs(q)[0] if self.configs is not None else None


_REGISTRY: dict[str, dict[str, Implementation]] = {}
_USER_ADAPTERS: dict[str, Callable] = {}


def add(impl: Implementation) -> None:
    _REGISTRY.setdefault(impl.op, {})[impl.name] = impl


def define_user_adapter(op: str, adapter: Callable) -> None:
    """adapter(fn, backward) -> {stage: lowering}: turns a user's Python kernel into lowerings."""
    _USER_ADAPTERS[op] = adapter


def ops() -> list[str]:
    return list(_REGISTRY)


def get(op: str, name: str) -> Implementation:
    check_name(op, name)
    return _REGISTRY[op][name]


def all_of(op: str) -> list[Implementation]:
    return list(_REGISTRY.get(op, {}).values())


def check_name(op: str, name: str | None) -> None:
    """ValueError for an op or implementation name that does not exist."""
    if op not in _REGISTRY:
        raise ValueError(f"jax_ops: unknown op {op!r}; expected one of {ops()}")
    if name is not None and name not in _REGISTRY[op]:
        raise ValueError(f"jax_ops.{op}: unknown implementation={name!r}; expected None "
                         f"(automatic) or one of {list(_REGISTRY[op])}")


def implementations(op: str, *, platform: str | None = None, shape: Sequence[int] | None = None,
                    dtype: Any = None, stage: str = "fwd") -> list[str]:
    """Names of op's implementations; with platform (and shape/dtype), only those that can
    serve it. e.g. jax_ops.implementations("layer_norm", platform="cuda", shape=(8, 1024),
    dtype="bfloat16")."""
    check_name(op, None)
    names = list(_REGISTRY[op])
    if platform is None:
        return names
    import numpy as np
    q = Query(op, stage, platform, tuple(shape) if shape is not None else (1, 1),
              np.dtype(dtype or "float32").name)
    return [n for n in names if _REGISTRY[op][n].why_not(q) is None]


def register_implementation(op: str, name: str, fn: Callable, *, backward: Callable | None = None,
                            supports: Supports | None = None, configs: Callable | None = None,
                            prefer: bool = False, description: str = "") -> None:
    """Adds a user implementation of `op` (see each op's docstring for fn's signature).

    fn: the forward kernel, any JAX-traceable Python function (jnp code, a pallas_call,
      a jax.ffi call...). backward: optional backward kernel; without it the backward
      stage is chosen automatically among the other implementations.
    supports(query) -> bool or (bool, reason): where it applies (default: everywhere).
    configs(query) -> list of keyword dicts fn accepts as `config=`; autotune tries them.
    prefer: make the automatic choice take it wherever supports() accepts.
    The implementation then takes part in implementation=name, jax_ops.use(name),
    automatic choice (autotune results, prefer) and jax_ops.autotune.
    """
    check_name(op, None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"jax_ops.register_implementation: name must be an identifier; got {name!r}")
    existing = _REGISTRY[op].get(name)
    if existing is not None and existing.builtin:
        raise ValueError(f"jax_ops.register_implementation: {name!r} is a built-in implementation "
                         f"of {op}; pick another name")
    if not callable(fn) or (backward is not None and not callable(backward)):
        raise TypeError("jax_ops.register_implementation: fn and backward must be callables")
    lower = _USER_ADAPTERS[op](fn, backward, configs is not None)
    add(Implementation(op, name, lower, supports or (lambda q: True), configs=configs,
                       prefer=prefer, builtin=False, description=description or fn.__doc__ or ""))


def unregister_implementation(op: str, name: str) -> None:
    """Removes a user implementation (built-ins cannot be removed)."""
    impl = get(op, name)
    if impl.builtin:
        raise ValueError(f"jax_ops.unregister_implementation: {name!r} is built in")
    del _REGISTRY[op][name]


# --------------------------------------------------------------- overrides ---

def _parse_override(value) -> tuple:
    """"pallas" | "layer_norm=pallas,rms_norm=cuda" | tuple of pairs -> sorted pairs."""
    if value is None or value == "":
        return ()
    if isinstance(value, tuple):
        return value
    pairs = []
    for part in str(value).split(","):
        op, sep, name = part.strip().partition("=")
        pairs.append((op.strip(), name.strip()) if sep else ("*", op.strip()))
    return tuple(sorted(pairs))


_OVERRIDE = jax_config.string_or_object_state(
    "jax_ops_implementation", default=None,
    help="jax_ops implementation override: a name for every op that has it, or "
         "'op=name,...' (also settable by the JAX_OPS_IMPLEMENTATION environment variable).",
    include_in_jit_key=True, include_in_trace_context=True)


def override_for(op: str) -> str | None:
    """The implementation use()/JAX_OPS_IMPLEMENTATION asks for op, or None."""
    pairs = dict(_parse_override(_OVERRIDE.value))
    if op in pairs:
        return pairs[op]
    name = pairs.get("*")
    return name if name in _REGISTRY.get(op, {}) else None


@contextlib.contextmanager
def use(implementation: str | None = None, /, **per_op: str):
    """Overrides the automatic choice inside the scope, e.g.

        with jax_ops.use("pallas"):                # every op that has "pallas"
        with jax_ops.use(layer_norm="cuda"):       # one op
    An explicit implementation= argument still wins. Nested scopes merge per op; an
    inner global name replaces all outer choices.
    """
    pairs = dict(_parse_override(_OVERRIDE.value))
    if implementation is not None:
        if not any(implementation in impls for impls in _REGISTRY.values()):
            raise ValueError(f"jax_ops.use: no op has an implementation named {implementation!r}")
        pairs = {"*": implementation}  # the innermost global choice replaces outer ones
    for op, name in per_op.items():
        check_name(op, name)
        pairs[op] = name
    with _OVERRIDE(tuple(sorted(pairs.items()))):
        yield
