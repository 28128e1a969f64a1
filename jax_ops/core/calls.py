"""Finding the jax_ops calls in a function (its jaxpr, nested bodies included) and
explaining the automatic choice for each."""
from __future__ import annotations

from collections.abc import Callable

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr

from jax_ops.core.dispatch import Decision, choose
from jax_ops.core.op import PRIMITIVES, default_platform, query


def equations(jaxpr):
    """Every equation of a jaxpr, nested bodies (jit, custom_jvp/vjp, scan, cond, while)
    included, in program order."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for item in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(item, ClosedJaxpr):
                    yield from equations(item.jaxpr)
                elif isinstance(item, Jaxpr):
                    yield from equations(item)


def op_calls(fn: Callable, *args, **kwargs) -> list[tuple]:
    """(primitive, operand avals, params) of every jax_ops stage call in fn(*args,
    **kwargs), in program order, nested bodies included."""
    return [(e.primitive, tuple(v.aval for v in e.invars), dict(e.params))
            for e in equations(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr) if e.primitive in PRIMITIVES]


def op_names(fn: Callable, *args, **kwargs) -> set[str]:
    """The names of the jax_ops ops fn(*args, **kwargs) calls."""
    return {PRIMITIVES[p].op_of(params) for p, _, params in op_calls(fn, *args, **kwargs)}


class Explanation(list):
    """Decisions for one function, in program order; str() is a readable table."""

    def __str__(self) -> str:
        if not self:
            return "jax_ops.explain: no jax_ops ops in this function"
        return "\n".join(str(d) for d in self)


def explain(fn, *args, platform: str | None = None, **kwargs) -> Explanation:
    """Which implementation each jax_ops call in fn(*args, **kwargs) gets when lowered for
    `platform` (default: the default backend's), and why. Traces fn; runs nothing.
    Forward and backward ops both show when fn takes gradients."""
    platform = platform or default_platform()
    decisions: list[Decision] = [choose(query(prim, avals, params, platform), params["implementation"])
                                 for prim, avals, params in op_calls(fn, *args, **kwargs)]
    return Explanation(decisions)
