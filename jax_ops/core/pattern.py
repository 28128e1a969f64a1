"""Rewrite patterns, declared with their op: what `jax_ops.optimize` looks for in a
traced function and what it puts in its place. Declarative only: jax_ops.fx traces,
matches and verifies them (fx/match.py); nothing here imports fx.

An op declares its patterns in its module (`Op(patterns=...)`, core/op.py; a function
returning a list of `Pattern`, called when fx first needs them), next to the public
function that replaces them. Patterns whose replacement is not one of our ops (a conv
with BatchNorm folded in, cuDNN attention) live in jax_ops/fx.

A formulation's reference takes the pattern's array inputs positionally (None for an
absent optional input) and its parameters as keywords: literal parameters (floats such
as epsilon, found in the graph as literals and passed to the replacement), static
settings (which flax variant, the output dtype, the softmax axis) enumerated by
`static(avals, out_aval)` and, for the primitives in `node_params`, the matched
equations' params. It returns one array, or a tuple of `len(pattern.outputs)` arrays.
Matching is exact by construction: a formulation only matches where its re-traced
jaxpr equals the graph's.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

#: keys of specialize's params: the names of the patterns in use; the graph nodes that
#: replacements of higher-priority patterns took so far -> those patterns' names
ACTIVE_PATTERNS = "active_patterns"
CLAIMED_BY = "claimed_by"

F32, BF16, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
#: the activation dtypes the ops take
OP_DTYPES = (F32, BF16, F16)


def no_static(avals, out_aval):
    return [{}]


@dataclasses.dataclass(eq=False)  # hashed by identity (fx caches re-traces per formulation)
class Formulation:
    """One way of writing the pattern's computation.

    reference(*inputs, **params, **static) -> the pattern's output(s) (module doc).
    static(avals, out_aval) -> the static keyword sets to try: with out_aval None when
      templates are traced at the example arguments, else the matched inputs' avals and
      the matched main output's aval (verification).
    label: what rewrites() reports as the formulation ("flax.linen.LayerNorm").
    replacement: overrides the pattern's where this formulation's derivative differs
      (jnp.maximum's ties).
    node_params: primitive names (e.g. "conv_general_dilated") whose matched equation's
      params the reference and the replacement receive as a keyword of that name: a
      tuple of (param name, value) pairs (None while the templates are traced). For
      settings that are neither literals nor derived from the avals (a conv's strides,
      padding, dimension numbers); verification still compares them.
    """
    reference: Callable
    static: Callable[[list, Any], list] = no_static
    label: str = ""
    pattern_name: str = ""
    replacement: Callable | None = None
    node_params: tuple = ()


@dataclasses.dataclass(eq=False)  # hashed by identity (fx caches templates per pattern)
class Pattern:
    """A computation to find and the function that replaces it.

    name: what rewrites() reports and optimize(patterns=/exclude=) select.
    formulations: references (module doc); the first that verifies is used.
    replacement(*inputs, **params) -> the output (a tuple of them, in `outputs` order),
      put in their place; it may take `out_dtype` (the matched main output's dtype);
      each result is cast to the matched output's dtype.
    example_args: argument sets to trace the formulations at (tuples of
      jax.ShapeDtypeStruct or None), covering the structures to look for; matches are
      re-verified at their exact shapes.
    params: literal parameter names -> default.
    accepts(avals) -> None, or the reason the replacement can't take these inputs.
    specialize(graph_args, avals, params) -> extra params for the replacement (facts
      read from the graph, e.g. a constant causal mask; graph_args are fx graph Values,
      Literals or None) or the reason not to replace. params[ACTIVE_PATTERNS] holds the
      names of the patterns in use (optimize's patterns/exclude), params[CLAIMED_BY]
      the nodes already replaced (-> pattern name; higher priorities go first).
    reported: static or specialized params rewrites() shows with the captured literals
      (attention's is_causal).
    context(graph_args, avals, params) -> None or why policy="auto"/"memory" keeps the
      original here because of its neighbours in the graph (a relu XLA fuses into the
      conv before it); params as specialize's. Not consulted under "always".
    candidate(avals, params) -> whether a verified match is one the pattern is for at
      all; where not, it is neither replaced nor reported (a stride-1 conv is no
      strided narrow-input conv). Default: every verified match.
    decide(avals, params) -> None or why policy="auto" keeps the original (default:
      jax_ops.explain of the replacement picks one of our kernels).
    decide_memory(avals, params) -> None or why policy="memory" keeps the original: for
      a replacement that trades time for memory (linear_cross_entropy never makes the
      logits); None (the default): the pattern follows `decide` under "memory" too.
    outputs: names of the reference's results. The first is the main output: the match
      ends at its equation. The others are values computed on the way to it that may
      also be used outside the match (add+norm's h, BatchNorm's batch mean and
      variance); any other intermediate used outside the match prevents the rewrite.
    priority: patterns are tried in decreasing priority, then in declaration order (the
      ops in the order the package imports them, each op's list in order, then the
      fx-level ones), and an equation matched by one is not matched again. An op lists
      a pattern before those it contains (add_relu before relu); a pattern containing
      another module's (batch_norm_add_relu contains add_relu) gets a higher priority.
    no_broadcast: argument positions that must be whole arrays of the main output's
      shape, not computed by broadcast_in_dim (a residual; a bias vector, or one
      broadcast to x's shape, is not one: the replacement would read it materialized).
      Where one is not, there is no candidate (nothing is reported).
    """
    name: str
    formulations: Sequence[Formulation]
    replacement: Callable
    example_args: Sequence[tuple]
    params: dict = dataclasses.field(default_factory=dict)
    accepts: Callable[[list], str | None] = lambda avals: None
    outputs: tuple = ("y",)
    priority: int = 0
    no_broadcast: tuple = ()
    note: str = ""
    specialize: Callable | None = None
    decide: Callable | None = None
    decide_memory: Callable | None = None
    reported: tuple = ()
    candidate: Callable | None = None
    context: Callable | None = None

    def __post_init__(self):
        self.outputs = tuple(self.outputs)
        for f in self.formulations:
            f.pattern_name = self.name

    def __repr__(self):
        return f"Pattern({self.name!r}, {len(self.formulations)} formulations)"


# ------------------------------------------------- helpers the ops share ---

def sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def accepts_x(avals) -> str | None:
    """x (argument 0) is a dtype the ops take, of rank >= 1."""
    x = avals[0]
    if x.dtype not in OP_DTYPES:
        return f"x is {x.dtype}; the jax_ops op takes float32, bfloat16, float16"
    if len(x.shape) < 1:
        return "x is a scalar"
    return None


def out_dtypes(avals, out_aval) -> list:
    """Output dtypes to trace: the matched one, or (for templates) the promoted dtype
    of the present inputs and x's dtype (flax's dtype=None vs dtype=x.dtype)."""
    if out_aval is not None:
        return [np.dtype(out_aval.dtype)]
    present = [a for a in avals if a is not None]
    return list(dict.fromkeys([np.dtype(jnp.result_type(*(a.dtype for a in present))),
                               np.dtype(avals[0].dtype)]))


def wider_x(x, out_dtype):
    """x widened to the result's dtype where that is wider (flax with float32 parameters
    and dtype=None returns float32 for bfloat16 x, computed from the widened x)."""
    if jnp.finfo(out_dtype).bits > jnp.finfo(x.dtype).bits:
        return x.astype(out_dtype)
    return x


def flax_available() -> bool:
    try:
        import flax  # noqa: F401
        return True
    except ImportError:
        return False


def flax_linen_normalize(x, mean, var, scale, bias, reduction_axes, epsilon, dtype):
    """flax.linen.normalization._normalize for a feature axis last: y = (x - mean) *
    rsqrt(var + eps) * scale + bias with flax's operation order and result dtype (the
    norm and BatchNorm formulations share it; mean/var are reduced over
    reduction_axes)."""
    from flax.linen import dtypes as flax_dtypes
    feature_shape = (1,) * (x.ndim - 1) + (x.shape[-1],)
    mean = jnp.expand_dims(mean, reduction_axes)
    var = jnp.expand_dims(var, reduction_axes)
    y = x - mean
    mul = jax.lax.rsqrt(var + epsilon)
    args = [x]
    if scale is not None:
        scale = scale.reshape(feature_shape)
        mul *= scale
        args.append(scale)
    y *= mul
    if bias is not None:
        bias = bias.reshape(feature_shape)
        y += bias
        args.append(bias)
    return jnp.asarray(y, flax_dtypes.canonicalize_dtype(*args, dtype=dtype))
