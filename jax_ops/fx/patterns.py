"""Patterns: a reference computation (plain jnp, one or more formulations) and the
function that replaces it. Each is a small declarative `Pattern` so it can later move
into the op declarations.

A formulation's reference takes the pattern's array inputs positionally (None for an
absent optional input) and its parameters as keywords: literal parameters (floats
such as epsilon, found in the graph as literals and passed to the replacement) and
static settings (which flax variant, the output dtype, the softmax axis) enumerated
by `static(avals, out_aval)`. Matching is exact by construction (see match.py): a
formulation only matches where its re-traced jaxpr equals the graph's.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax_ops.ops.layer_norm import layer_norm, rms_norm
from jax_ops.ops.relu import add_relu, relu
from jax_ops.ops.softmax import log_softmax, softmax

_F32, _BF16, _F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
_OP_DTYPES = (_F32, _BF16, _F16)


def _no_static(avals, out_aval):
    return [{}]


@dataclasses.dataclass(eq=False)  # hashed by identity (caches of re-traces)
class Formulation:
    """One way of writing the pattern's computation; `replacement` overrides the
    pattern's where this formulation's derivative differs (jnp.maximum's ties)."""
    reference: Callable
    static: Callable[[list, Any], list] = _no_static
    label: str = ""
    pattern_name: str = ""
    replacement: Callable | None = None


@dataclasses.dataclass
class Pattern:
    """name: what rewrites() reports; formulations: references (see module doc);
    replacement(*inputs, **params): the function put in their place (it may take
    `out_dtype`, the matched result's dtype); example_args: argument sets to trace
    the formulations at (tuples of jax.ShapeDtypeStruct or None), covering the
    structures to look for; params: literal parameter names -> default;
    accepts(avals) -> None or the reason the replacement can't take these inputs;
    specialize(graph_args, avals, params) -> extra params for the replacement (facts
    read from the graph, e.g. a constant causal mask) or the reason not to replace;
    decide(avals, params) -> None or why policy="auto" keeps the original (default:
    jax_ops.explain of the replacement picks one of our kernels)."""
    name: str
    formulations: Sequence[Formulation]
    replacement: Callable
    example_args: Sequence[tuple]
    params: dict = dataclasses.field(default_factory=dict)
    accepts: Callable[[list], str | None] = lambda avals: None
    note: str = ""
    specialize: Callable | None = None
    decide: Callable | None = None
    _templates: list | None = dataclasses.field(default=None, repr=False)
    _by_anchor: dict | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        for f in self.formulations:
            f.pattern_name = self.name


    def templates(self):
        """Structurally distinct traced formulations (built once, on first use)."""
        if self._templates is None:
            from jax_ops.fx.match import build_template, structure_key
            seen, out = set(), []
            for f in self.formulations:
                for args in self.example_args:
                    for static in f.static(list(args), None):
                        try:
                            t = build_template(f, args, self.params, static)
                        except (TypeError, ValueError) as e:
                            if "literal parameter" in str(e):
                                raise
                            continue  # this formulation doesn't take these arguments
                        if t is None:
                            continue
                        key = (id(f), structure_key(t))
                        if key not in seen:
                            seen.add(key)
                            out.append(t)
            if not out:
                raise ValueError(f"pattern {self.name!r}: no formulation could be traced at "
                                 "the example_args")
            self._templates = out
        return self._templates

    def templates_by_anchor(self) -> dict:
        """anchor primitive name -> templates ending in it, in formulation order."""
        if self._by_anchor is None:
            by: dict = {}
            for t in self.templates():
                by.setdefault(t.anchor_primitive, []).append(t)
            self._by_anchor = by
        return self._by_anchor

    def replace(self, args: list, params: dict, out_dtype, formulation: Formulation | None = None):
        """The replacement (the formulation's own, if it has one) at the match's inputs
        and parameters, in the matched result's dtype."""
        fn = (formulation.replacement if formulation is not None else None) or self.replacement
        kw = dict(params)
        if _takes_out_dtype(fn):
            kw["out_dtype"] = out_dtype
        y = fn(*args, **kw)
        y = jnp.asarray(y)
        return y if y.dtype == out_dtype else y.astype(out_dtype)


def _takes_out_dtype(fn) -> bool:
    try:
        return "out_dtype" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# ----------------------------------------------------------- example sets ---

def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _norm_examples(with_bias: bool):
    """x f32/bf16 at rank 1 and 2 (ranks >= 2 share a structure), parameters in
    float32 or x's dtype, each optional parameter present or absent."""
    out = []
    for shape in ((8,), (4, 8)):
        for xd, pd in ((_F32, _F32), (_BF16, _BF16), (_BF16, _F32), (_F32, _BF16)):
            for has_scale in (True, False):
                for has_bias in ((True, False) if with_bias else (False,)):
                    args = (_sds(shape, xd), _sds((8,), pd) if has_scale else None)
                    if with_bias:
                        args += (_sds((8,), pd) if has_bias else None,)
                    if not has_scale and (not with_bias or not has_bias) and pd != xd:
                        continue  # no parameters: the parameter dtype doesn't matter
                    out.append(args)
    return out


def _accepts_x(avals):
    x = avals[0]
    if x.dtype not in _OP_DTYPES:
        return f"x is {x.dtype}; the jax_ops op takes float32, bfloat16, float16"
    if len(x.shape) < 1:
        return "x is a scalar"
    return None


def _norm_accepts(avals):
    why = _accepts_x(avals)
    if why:
        return why
    cols = avals[0].shape[-1]
    for p in avals[1:]:
        if p is None:
            continue
        if p.dtype not in _OP_DTYPES:
            return f"a parameter is {p.dtype}"
        if tuple(p.shape) != (cols,):
            return f"a parameter has shape {tuple(p.shape)}, not ({cols},)"
    return None


def _out_dtypes(avals, out_aval):
    """Output dtypes to trace: the matched one, or (for templates) the promoted
    dtype and x's dtype (flax dtype=None vs dtype=x.dtype)."""
    if out_aval is not None:
        return [np.dtype(out_aval.dtype)]
    present = [a for a in avals if a is not None]
    return list(dict.fromkeys([np.dtype(jnp.result_type(*(a.dtype for a in present))),
                               np.dtype(avals[0].dtype)]))


# ------------------------------------------------------ norm formulations ---
# Each reads its variable names into rewrites()'s reasons ("intermediate mean used
# elsewhere"): keep one assignment per line.

def _flax_linen_norm(x, scale, bias, *, epsilon, fast, dtype, rms):
    """flax.linen LayerNorm/RMSNorm over the last axis (flax/linen/normalization.py
    _compute_stats + _normalize, with the parameters passed in)."""
    from flax.linen import dtypes as flax_dtypes
    from flax.linen import normalization as flax_norm
    mean, var = flax_norm._compute_stats(x, -1, dtype, use_mean=not rms, use_fast_variance=fast)
    axis = (x.ndim - 1,)
    feature_shape = (1,) * (x.ndim - 1) + (x.shape[-1],)
    mean = jnp.expand_dims(mean, axis)
    var = jnp.expand_dims(var, axis)
    centered = x - mean
    mul = jax.lax.rsqrt(var + epsilon)
    args = [x]
    if scale is not None:
        scale = scale.reshape(feature_shape)
        mul *= scale
        args.append(scale)
    centered *= mul
    if bias is not None:
        bias = bias.reshape(feature_shape)
        centered += bias
        args.append(bias)
    dtype = flax_dtypes.canonicalize_dtype(*args, dtype=dtype)
    return jnp.asarray(centered, dtype)


def _flax_nnx_norm(x, scale, bias, *, epsilon, fast, dtype, rms):
    """flax.nnx LayerNorm/RMSNorm over the last axis (flax/nnx/nn/normalization.py)."""
    from flax.nnx.nn import dtypes as nnx_dtypes
    from flax.nnx.nn import normalization as nnx_norm
    x, scale, bias = nnx_dtypes.promote_dtype((x, scale, bias), dtype=dtype)
    mean, var = nnx_norm._compute_stats(x, -1, dtype, use_mean=not rms, use_fast_variance=fast)
    return nnx_norm._normalize(x, mean, var, scale, bias, -1, -1, dtype, epsilon)


def _flax_static(rms):
    def static(avals, out_aval):
        return [{"fast": fast, "dtype": d, "rms": rms}
                for fast in ((True, False) if not rms else (True,))
                for d in _out_dtypes(avals, out_aval)]
    return static


def _standardize(x, scale, bias, *, epsilon, algorithm):
    """jax.nn.standardize over the last axis, then optional scale and bias."""
    y = jax.nn.standardize(x, -1, epsilon=epsilon, algorithm=algorithm)
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y


def _standardize_static(avals, out_aval):
    return [{"algorithm": a} for a in ("fast", "stable")]


def _handwritten_layer_norm(x, scale, bias, *, epsilon, upcast, var_form, denominator):
    """The common hand-written LayerNorm: mean, var = mean((x - mean)^2) (or jnp.var),
    (x - mean) * rsqrt(var + eps) (or / sqrt(var + eps)) * scale + bias, optionally
    computed on x.astype(float32) and cast back."""
    xf = x.astype(jnp.float32) if upcast else x
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    if var_form == "var":
        var = jnp.var(xf, axis=-1, keepdims=True)
    else:
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    if denominator == "rsqrt":
        y = (xf - mean) * jax.lax.rsqrt(var + epsilon)
    else:
        y = (xf - mean) / jnp.sqrt(var + epsilon)
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype) if upcast else y


def _handwritten_ln_static(avals, out_aval):
    return [{"upcast": u, "var_form": v, "denominator": d} for u in (False, True)
            for v in ("mean_sq", "var") for d in ("rsqrt", "sqrt_div")]


def _handwritten_rms_norm(x, scale, *, epsilon, upcast, denominator):
    """x * rsqrt(mean(x^2) + eps) * scale (or / sqrt(...)), optionally in float32."""
    xf = x.astype(jnp.float32) if upcast else x
    ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    if denominator == "rsqrt":
        y = xf * jax.lax.rsqrt(ms + epsilon)
    else:
        y = xf / jnp.sqrt(ms + epsilon)
    if scale is not None:
        y = y * scale
    return y.astype(x.dtype) if upcast else y


def _handwritten_rms_static(avals, out_aval):
    return [{"upcast": u, "denominator": d} for u in (False, True) for d in ("rsqrt", "sqrt_div")]


def _flax_rms(fn):
    def rms(x, scale, *, epsilon, fast, dtype, rms):
        return fn(x, scale, None, epsilon=epsilon, fast=fast, dtype=dtype, rms=rms)
    rms.__name__ = fn.__name__ + "_rms"
    return rms


def _norm_params(x, scale, bias):
    """x at its own dtype, parameters in float32 or x's dtype (what jax_ops takes)."""
    ps = [p for p in (scale, bias) if p is not None]
    if any(p.dtype not in (_F32, x.dtype) for p in ps) or len({p.dtype for p in ps}) > 1:
        scale = None if scale is None else scale.astype(jnp.float32)
        bias = None if bias is None else bias.astype(jnp.float32)
    return scale, bias


def _wider_x(x, out_dtype):
    """Compute at the result's precision where it is wider than x's (flax with float32
    parameters and dtype=None returns float32 for bfloat16 x)."""
    if jnp.finfo(out_dtype).bits > jnp.finfo(x.dtype).bits:
        return x.astype(out_dtype)
    return x


def layer_norm_replacement(x, scale=None, bias=None, *, epsilon, out_dtype, **_):
    x = _wider_x(x, out_dtype)
    scale, bias = _norm_params(x, scale, bias)
    return layer_norm(x, scale, bias, epsilon=epsilon).astype(out_dtype)


def rms_norm_replacement(x, scale=None, *, epsilon, out_dtype, **_):
    x = _wider_x(x, out_dtype)
    scale, _ = _norm_params(x, scale, None)
    return rms_norm(x, scale, epsilon=epsilon).astype(out_dtype)


def _flax_available() -> bool:
    try:
        import flax  # noqa: F401
        return True
    except ImportError:
        return False


def _layer_norm_pattern() -> Pattern:
    forms = [Formulation(_handwritten_layer_norm, _handwritten_ln_static, "jnp"),
             Formulation(_standardize, _standardize_static, "jax.nn.standardize")]
    if _flax_available():
        forms += [Formulation(_flax_linen_norm, _flax_static(False), "flax.linen.LayerNorm"),
                  Formulation(_flax_nnx_norm, _flax_static(False), "flax.nnx.LayerNorm")]
    return Pattern("layer_norm", forms, layer_norm_replacement, _norm_examples(True),
                   params={"epsilon": 1e-5}, accepts=_norm_accepts,
                   note="LayerNorm over the last axis, statistics in float32")


def _rms_norm_pattern() -> Pattern:
    forms = [Formulation(_handwritten_rms_norm, _handwritten_rms_static, "jnp")]
    if _flax_available():
        forms += [Formulation(_flax_rms(_flax_linen_norm), _flax_static(True), "flax.linen.RMSNorm"),
                  Formulation(_flax_rms(_flax_nnx_norm), _flax_static(True), "flax.nnx.RMSNorm")]
    return Pattern("rms_norm", forms, rms_norm_replacement, _norm_examples(False),
                   params={"epsilon": 1e-6}, accepts=_norm_accepts,
                   note="RMSNorm over the last axis, statistics in float32")


# ---------------------------------------------------------------- softmax ---
# jax.nn.softmax/log_softmax differ from jax_ops only where a row is all -inf
# (jax.nn: NaN, jax_ops: 0 / -inf) and in rounding (jax_ops computes in float32).
# where= is not matched: jax_ops' mask differs on fully masked rows.

def _softmax_ref(x, *, axis):
    return jax.nn.softmax(x, axis=axis)


def _scaled_softmax_ref(x, *, scale, axis):
    return jax.nn.softmax(x * scale, axis=axis)


def _log_softmax_ref(x, *, axis):
    return jax.nn.log_softmax(x, axis=axis)


def _scaled_log_softmax_ref(x, *, scale, axis):
    return jax.nn.log_softmax(x * scale, axis=axis)


def _axis_static(avals, out_aval):
    """Template: the last axis. Verification: every axis (the re-trace decides)."""
    if out_aval is None:
        return [{"axis": -1}]
    return [{"axis": a} for a in range(-1, -len(avals[0].shape) - 1, -1)]


def _softmax_examples():
    return [(_sds(s, d),) for s in ((8,), (4, 8)) for d in (_F32, _BF16)]


def _softmax_pattern(log: bool, scaled: bool) -> Pattern:
    op = log_softmax if log else softmax
    ref = {(False, False): _softmax_ref, (False, True): _scaled_softmax_ref,
           (True, False): _log_softmax_ref, (True, True): _scaled_log_softmax_ref}[log, scaled]
    name = ("log_softmax" if log else "softmax") + ("_scaled" if scaled else "")

    def replacement(x, *, axis, scale=None, **_):
        return op(x, axis=axis, scale=scale)
    return Pattern(name, [Formulation(ref, _axis_static, f"jax.nn.{'log_' if log else ''}softmax")],
                   replacement, _softmax_examples(), params={"scale": 1.0} if scaled else {},
                   accepts=_accepts_x)


# ------------------------------------------------------------------- relu ---
# jax.nn.relu's derivative at 0 is 0, as jax_ops.relu's; jnp.maximum(x, 0)'s is 0.5
# (lax.max splits ties), so its replacement keeps our forward kernel and restates
# that derivative.

def _relu_ref(x):
    return jax.nn.relu(x)


def _maximum_ref(x):
    return jnp.maximum(x, 0)


def _add_relu_ref(x, z):
    return jax.nn.relu(x + z)


def _add_maximum_ref(x, z):
    return jnp.maximum(x + z, 0)


def _add_relu_accepts(avals):
    x, z = avals
    why = _accepts_x(avals)
    if why:
        return why
    if x.dtype != z.dtype:
        return "x and z differ in dtype"
    try:
        fits = np.broadcast_shapes(tuple(z.shape), tuple(x.shape)) == tuple(x.shape)
    except ValueError:
        fits = False
    if not fits or len(z.shape) > len(x.shape):
        return f"z of shape {tuple(z.shape)} does not broadcast to x's {tuple(x.shape)}"
    return None


def relu_replacement(x):
    return relu(x)


def add_relu_replacement(x, z):
    return add_relu(x, z)


def _max_tie_slope(pre):
    """d max(pre, 0) / d pre as lax.max differentiates it: 1 above, 0.5 at a tie
    (either zero), 0 below and at NaN."""
    return jnp.where(pre > 0, 1.0, jnp.where(pre == 0, 0.5, 0.0)).astype(pre.dtype)


@jax.custom_jvp
def maximum_relu_replacement(x):
    return relu_replacement(x)


@maximum_relu_replacement.defjvp
def _maximum_relu_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    return maximum_relu_replacement(x), dx * _max_tie_slope(x)


@jax.custom_jvp
def maximum_add_relu_replacement(x, z):
    return add_relu_replacement(x, z)


@maximum_add_relu_replacement.defjvp
def _maximum_add_relu_jvp(primals, tangents):
    (x, z), (dx, dz) = primals, tangents
    slope = _max_tie_slope(x + z)  # the tie on the sum rounded as the original rounds it
    return maximum_add_relu_replacement(x, z), (dx + dz) * slope


def _relu_examples(n):
    return [tuple(_sds(s, d) for _ in range(n)) for s in ((8,), (4, 8)) for d in (_F32, _BF16)]


def _relu_pattern() -> Pattern:
    return Pattern("relu", [Formulation(_relu_ref, label="jax.nn.relu"),
                            Formulation(_maximum_ref, label="jnp.maximum(x, 0)",
                                        replacement=maximum_relu_replacement)],
                   relu_replacement, _relu_examples(1), accepts=_accepts_x)


def _add_relu_pattern() -> Pattern:
    return Pattern("add_relu", [Formulation(_add_relu_ref, label="jax.nn.relu(x + z)"),
                                Formulation(_add_maximum_ref, label="jnp.maximum(x + z, 0)",
                                            replacement=maximum_add_relu_replacement)],
                   add_relu_replacement, _relu_examples(2), accepts=_add_relu_accepts)


# --------------------------------------------------------------- registry ---

_BUILTIN: list[Pattern] | None = None
_USER: list[Pattern] = []


def builtin_patterns() -> list[Pattern]:
    """In priority order: larger patterns first (add_relu before relu, the scaled
    softmax before the plain one)."""
    global _BUILTIN
    if _BUILTIN is None:
        from jax_ops.fx.attention import attention_patterns
        _BUILTIN = [*attention_patterns(), _layer_norm_pattern(), _rms_norm_pattern(),
                    _softmax_pattern(True, True), _softmax_pattern(True, False),
                    _softmax_pattern(False, True), _softmax_pattern(False, False),
                    _add_relu_pattern(), _relu_pattern()]
    return _BUILTIN


def all_patterns() -> list[Pattern]:
    """User patterns (newest first), then the built-in ones."""
    return list(reversed(_USER)) + builtin_patterns()


def register_pattern(name: str, reference: Callable, replacement: Callable, *,
                     example_args: Sequence, params: dict | None = None) -> Pattern:
    """Add a user pattern written as plain jnp functions.

    Args:
      name: the pattern's name (replaces a user pattern of the same name).
      reference: reference(*inputs, **params) -> one array: the computation to find.
        It is traced and matched structurally; each parameter must reach a jnp/lax
        operation directly (it is found in graphs as a literal, e.g. `x / cap`).
      replacement: replacement(*inputs, **params) -> one array, put in its place.
      example_args: one argument set (a tuple of arrays / jax.ShapeDtypeStruct, None
        for an absent optional input) or a list of them: the ranks and dtypes whose
        structures to look for (matches are re-verified at their exact shapes).
      params: literal parameter names -> default value (floats).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"jax_ops.fx.register_pattern: name must be a non-empty str; got {name!r}")
    for arg, fn in (("reference", reference), ("replacement", replacement)):
        if not callable(fn):
            raise TypeError(f"jax_ops.fx.register_pattern: {arg} must be callable; got "
                            f"{type(fn).__name__}")
    params = dict(params or {})
    for k, v in params.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"jax_ops.fx.register_pattern: params must map names to numbers; "
                            f"got {k!r}: {v!r}")
    if len(params) > 6:
        raise ValueError("jax_ops.fx.register_pattern: at most 6 literal params")
    sets = _example_sets(example_args)
    pattern = Pattern(name, [Formulation(reference, label=name)], replacement, sets, params=params)
    pattern.templates()  # trace now: errors surface at registration
    _USER[:] = [p for p in _USER if p.name != name] + [pattern]
    return pattern


def unregister_pattern(name: str) -> None:
    before = len(_USER)
    _USER[:] = [p for p in _USER if p.name != name]
    if len(_USER) == before:
        raise ValueError(f"jax_ops.fx.unregister_pattern: no user pattern named {name!r}")


def _example_sets(example_args) -> list[tuple]:
    def one(s):
        return tuple(None if a is None else jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a))
                     if not isinstance(a, jax.ShapeDtypeStruct) else a for a in s)
    if isinstance(example_args, tuple) and example_args and all(
            a is None or hasattr(a, "shape") for a in example_args):
        return [one(example_args)]
    if isinstance(example_args, list) and example_args and all(isinstance(s, tuple) for s in example_args):
        return [one(s) for s in example_args]
    raise TypeError("jax_ops.fx.register_pattern: example_args must be a tuple of arrays / "
                    "jax.ShapeDtypeStruct (None for an absent input), or a list of such tuples; "
                    f"got {type(example_args).__name__}")


def resolve(patterns, exclude) -> list[Pattern]:
    """The patterns optimize()/rewrites() use: `patterns` (names or Pattern objects,
    None = all) minus `exclude` (names)."""
    every = all_patterns()
    if patterns is None:
        chosen = every
    else:
        if isinstance(patterns, (str, Pattern)):
            patterns = [patterns]
        chosen = []
        for p in patterns:
            if isinstance(p, Pattern):
                chosen.append(p)
            elif isinstance(p, str):
                hits = [q for q in every if q.name == p or q.name == p + "_scaled"]
                if not hits:
                    raise ValueError(f"patterns: unknown pattern {p!r}; known: "
                                     f"{sorted({q.name for q in every})}")
                chosen += hits
            else:
                raise TypeError(f"patterns: expected pattern names or Pattern objects; got {p!r}")
    if isinstance(exclude, str):
        exclude = (exclude,)
    for e in exclude:
        if not isinstance(e, str):
            raise TypeError(f"exclude: expected pattern names; got {e!r}")
        if not any(q.name in (e, e + "_scaled") for q in every):
            raise ValueError(f"exclude: unknown pattern {e!r}; known: {sorted({q.name for q in every})}")
    # Priority order (larger patterns first) whatever order they were named in.
    chosen = [p for p in every if any(p is c for c in chosen)] + \
        [c for c in chosen if not any(c is p for p in every)]
    return [p for p in chosen if p.name not in exclude and p.name.removesuffix("_scaled") not in exclude]
