"""The patterns jax_ops.fx uses: those the op declarations ship (core/pattern.py;
each op module's `Op(patterns=...)`), the fx-level ones (replacements that are not one
of our ops), and the user's (`register_pattern`); their traced templates, cached per
pattern; and calling a pattern's replacement at a match.
"""
from __future__ import annotations

import inspect
import weakref
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_ops.core import op as _op
from jax_ops.core.pattern import Formulation, Pattern

__all__ = ["Formulation", "Pattern", "builtin_patterns", "all_patterns", "register_pattern",
           "unregister_pattern", "resolve", "templates", "templates_by_anchor", "replace"]


# -------------------------------------------------------------- templates ---

_TEMPLATES: "weakref.WeakKeyDictionary[Pattern, list]" = weakref.WeakKeyDictionary()
_BY_ANCHOR: "weakref.WeakKeyDictionary[Pattern, dict]" = weakref.WeakKeyDictionary()


def templates(pattern: Pattern) -> list:
    """The pattern's structurally distinct traced formulations (match.Template), traced
    once per pattern object, on first use."""
    out = _TEMPLATES.get(pattern)
    if out is None:
        from jax_ops.fx.match import build_template, structure_key
        seen, out = set(), []
        for f in pattern.formulations:
            for args in pattern.example_args:
                for static in f.static(list(args), None):
                    static = {**static, **{name: None for name in f.node_params}}
                    try:
                        t = build_template(f, args, pattern.params, static,
                                           len(pattern.outputs))
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
            raise ValueError(f"pattern {pattern.name!r}: no formulation could be traced at "
                             "the example_args")
        _TEMPLATES[pattern] = out
    return out


def templates_by_anchor(pattern: Pattern) -> dict:
    """anchor primitive name -> the pattern's templates ending in it, in formulation order."""
    by = _BY_ANCHOR.get(pattern)
    if by is None:
        by = {}
        for t in templates(pattern):
            by.setdefault(t.anchor_primitive, []).append(t)
        _BY_ANCHOR[pattern] = by
    return by


def replace(pattern: Pattern, args: list, params: dict, out_dtypes: Sequence,
            formulation: Formulation | None = None) -> list:
    """The replacement (the formulation's own, if it has one) at the match's inputs and
    parameters: its results (one per `pattern.outputs`) in the matched outputs' dtypes."""
    fn = (formulation.replacement if formulation is not None else None) or pattern.replacement
    kw = dict(params)
    if _takes_out_dtype(fn):
        kw["out_dtype"] = out_dtypes[0]
    ys = fn(*args, **kw)
    ys = [ys] if len(pattern.outputs) == 1 else list(ys)
    if len(ys) != len(out_dtypes):
        raise ValueError(f"pattern {pattern.name!r}: the replacement returns {len(ys)} results, "
                         f"the pattern has outputs {pattern.outputs}")
    out = []
    for y, dtype in zip(ys, out_dtypes):
        y = jnp.asarray(y)
        out.append(y if y.dtype == dtype else y.astype(dtype))
    return out


def _takes_out_dtype(fn) -> bool:
    try:
        return "out_dtype" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------- registry ---

_BUILTIN: list[Pattern] | None = None
_USER: list[Pattern] = []


def fx_patterns() -> list[Pattern]:
    """Patterns whose replacement is not one of our ops (declared in jax_ops/fx)."""
    from jax_ops.fx import conv_batch_norm, conv_space_to_depth, max_pool, pointwise_conv
    from jax_ops.fx.attention import attention_patterns
    return [*attention_patterns(), *conv_batch_norm.patterns(),
            *conv_space_to_depth.patterns(), *pointwise_conv.patterns(), *max_pool.patterns()]


def builtin_patterns() -> list[Pattern]:
    """The op declarations' patterns (`Op.patterns()` of every declared op, in the order
    the package imports the ops) and the fx-level ones, sorted by decreasing
    `Pattern.priority` (stable): a pattern comes before those it contains."""
    global _BUILTIN
    if _BUILTIN is None:
        declared = [p for op in _op.OPS.values() for p in op.patterns()] + fx_patterns()
        _BUILTIN = sorted(declared, key=lambda p: -p.priority)
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
    templates(pattern)  # trace now: errors surface at registration
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
