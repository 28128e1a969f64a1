"""A read-only graph view of a closed jaxpr: nodes with their primitive, operands,
results, params and source (user file:line and Flax module path), nested bodies as
subgraphs. The matcher and the rewriting interpreter work on this view (with jit
bodies inlined), never on jaxpr objects directly, so no jaxpr is ever built by hand.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator

import jax
import numpy as np
from jax.extend import core as jcore
from jax._src import source_info_util  # private: user_frames (file:line of an equation)

#: primitives whose body is inlined by `trace(..., inline_jit=True)`: a jit boundary
#: inside a traced function changes nothing about what it computes.
JIT_PRIMITIVES = ("jit", "pjit")

_SITE = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def _dtype_name(dtype) -> str:
    if dtype is None:
        return "?"
    try:
        return np.dtype(dtype).name
    except TypeError:  # extended dtypes (PRNG keys)
        return str(dtype)


def aval_str(aval) -> str:
    shape = getattr(aval, "shape", None)
    if shape is None:
        return str(aval)
    return f"{_dtype_name(aval.dtype)}[{','.join(str(d) for d in shape)}]"


class _Typed:
    """shape and dtype from `aval` (Values and Literals)."""
    __slots__ = ()

    @property
    def shape(self):
        return tuple(self.aval.shape)

    @property
    def dtype(self):
        return self.aval.dtype


class Value(_Typed):
    """A variable of the graph: a graph input, a closed-over constant (`const` holds
    its value) or a node's result."""
    __slots__ = ("aval", "name", "producer", "index", "users", "const", "is_const", "__weakref__")

    def __init__(self, aval, name, producer=None, index=0, const=None, is_const=False):
        self.aval, self.name, self.producer, self.index = aval, name, producer, index
        self.users: list[Node] = []
        self.const, self.is_const = const, is_const

    def __repr__(self):
        return f"{self.name}:{aval_str(self.aval)}"


class Literal(_Typed):
    """A literal operand (a scalar written into the jaxpr, e.g. epsilon)."""
    __slots__ = ("value", "aval")

    def __init__(self, value, aval):
        self.value, self.aval = value, aval

    def __repr__(self):
        v = np.asarray(self.value)
        return f"{v.item() if v.size == 1 else v}:{aval_str(self.aval)}"


@dataclasses.dataclass(frozen=True)
class Source:
    """Where an equation came from: the innermost frame outside jax (`frame`, may be
    inside Flax), the innermost frame outside installed packages (`user`: the model's
    own code) and the name stack (Flax module path, jax transformations)."""
    frame: Any
    user: Any
    name_stack: str

    @property
    def location(self) -> str:
        f = self.user or self.frame
        return f"{f.file_name}:{f.start_line}" if f is not None else "?"

    @property
    def short_location(self) -> str:
        f = self.user or self.frame
        return f"{os.path.basename(f.file_name)}:{f.start_line}" if f is not None else "?"

    @property
    def module_path(self) -> str:
        return self.name_stack


def _source(source_info) -> Source:
    if source_info is None:
        return Source(None, None, "")
    frames = list(source_info_util.user_frames(source_info.traceback))
    user = next((f for f in frames if not any(s in f.file_name for s in _SITE)), None)
    return Source(frames[0] if frames else None, user, str(source_info.name_stack))


class Node:
    """One equation: `primitive` applied to `inputs` (Values or Literals) giving
    `outputs` (Values), with `params` as in the jaxpr."""
    __slots__ = ("primitive", "inputs", "outputs", "params", "source_info", "graph", "index",
                 "_source", "_subgraphs", "eqn_ctx", "call_site", "__weakref__")

    def __init__(self, primitive, inputs, params, source_info, eqn_ctx, graph):
        self.primitive, self.inputs, self.params = primitive, inputs, params
        self.source_info, self.eqn_ctx, self.graph = source_info, eqn_ctx, graph
        self.outputs: list[Value] = []
        self.index = -1
        self._source = None
        self._subgraphs = None
        self.call_site = None  # source_info of the jit call this equation was inlined from

    @property
    def name(self) -> str:
        return self.primitive.name

    @property
    def source(self) -> Source:
        if self._source is None:
            src = _source(self.source_info)
            if src.frame is None and self.call_site is not None:
                # Inlined from a jax-internal jit (e.g. jnp.var's): where it was called.
                outer = _source(self.call_site)
                src = dataclasses.replace(outer, name_stack=src.name_stack or outer.name_stack)
            if src.frame is None and self.graph.parent is not None:
                # An equation of a library body (e.g. jax.nn.relu's): where it is called.
                src = dataclasses.replace(self.graph.parent.source, name_stack=src.name_stack
                                          or self.graph.parent.source.name_stack)
            self._source = src
        return self._source

    @property
    def location(self) -> str:
        return self.source.location

    @property
    def module_path(self) -> str:
        return self.source.module_path

    @property
    def subgraphs(self) -> list[tuple[str, "Graph"]]:
        """(param name, Graph) for each jaxpr in the params (bodies of jit, custom_jvp,
        custom_vjp, remat, scan, while, cond branches...)."""
        if self._subgraphs is None:
            subs = []
            for label, item in self._subgraph_params():
                if isinstance(item, jcore.ClosedJaxpr):
                    g = Graph.from_jaxpr(item.jaxpr, item.consts, parent=self,
                                         inline_jit=self.graph.inline_jit)
                else:
                    g = Graph.from_jaxpr(item, (), parent=self, inline_jit=self.graph.inline_jit)
                if not g.prefix:  # several bodies: name them by their param
                    g.prefix = f"{self.outputs[0].name if self.outputs else self.name}/{label}/"
                    g._rename()
                subs.append((label, g))
            self._subgraphs = subs
        return self._subgraphs

    def _subgraph_params(self) -> list:
        """(label, jaxpr) for each jaxpr among the params."""
        out = []
        for key, val in self.params.items():
            items = val if isinstance(val, (tuple, list)) else [val]
            for i, item in enumerate(items):
                if isinstance(item, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    label = f"{key}[{i}]" if isinstance(val, (tuple, list)) else key
                    out.append((label, item))
        return out

    def __repr__(self):
        outs = ", ".join(map(repr, self.outputs))
        ins = ", ".join(v.name if isinstance(v, Value) else repr(v) for v in self.inputs)
        return f"{outs} = {self.name}({ins})"


class Graph:
    """Nodes in program order over `inputs` (and constants) giving `outputs`."""

    def __init__(self, parent: Node | None = None, inline_jit: bool = False, prefix: str = ""):
        self.inline_jit = inline_jit
        self.prefix = prefix  # names in a body: "<parent node's result>/a", ...
        self.inputs: list[Value] = []
        self.consts: list[Value] = []
        self.outputs: list[Value | Literal] = []
        self.nodes: list[Node] = []
        self.parent = parent
        self._names = 0

    # ------------------------------------------------------------ building ---

    def _new_name(self) -> str:
        n, s = self._names, ""
        self._names += 1
        while True:
            s = chr(ord("a") + n % 26) + s
            n = n // 26 - 1
            if n < 0:
                return self.prefix + s

    @classmethod
    def from_jaxpr(cls, jaxpr, consts=(), *, inline_jit=False, parent=None) -> "Graph":
        prefix = ""
        if parent is not None:
            base = parent.outputs[0].name if parent.outputs else parent.name
            prefix = f"{base}/" if len(parent._subgraph_params()) == 1 else ""
        g = cls(parent, inline_jit, prefix)
        env: dict = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = v = Value(var.aval, g._new_name(), const=c, is_const=True)
            g.consts.append(v)
        for var in jaxpr.invars:
            env[var] = v = Value(var.aval, g._new_name())
            g.inputs.append(v)
        g._add_eqns(jaxpr, env, inline_jit, None)
        g.outputs = [g._read(env, a) for a in jaxpr.outvars]
        for i, n in enumerate(g.nodes):
            n.index = i
        return g

    def _rename(self):
        self._names = 0
        for v in [*self.consts, *self.inputs, *(o for n in self.nodes for o in n.outputs)]:
            v.name = self._new_name()

    def _read(self, env, atom):
        if isinstance(atom, jcore.Literal):
            return Literal(atom.val, atom.aval)
        return env[atom]

    def _add_eqns(self, jaxpr, env, inline_jit, call_site):
        for eqn in jaxpr.eqns:
            ins = [self._read(env, a) for a in eqn.invars]
            if inline_jit and eqn.primitive.name in JIT_PRIMITIVES:
                inner = eqn.params["jaxpr"]
                sub_env = {}
                for var, c in zip(inner.jaxpr.constvars, inner.consts):
                    sub_env[var] = v = Value(var.aval, self._new_name(), const=c, is_const=True)
                    self.consts.append(v)
                for var, val in zip(inner.jaxpr.invars, ins):
                    sub_env[var] = val
                site = eqn.source_info if call_site is None or _source(eqn.source_info).frame \
                    else call_site
                self._add_eqns(inner.jaxpr, sub_env, inline_jit, site)
                for var, atom in zip(eqn.outvars, inner.jaxpr.outvars):
                    env[var] = self._read(sub_env, atom)
                continue
            node = Node(eqn.primitive, ins, dict(eqn.params), eqn.source_info, eqn.ctx, self)
            node.call_site = call_site
            for i, var in enumerate(eqn.outvars):
                v = Value(var.aval, self._new_name(), producer=node, index=i)
                node.outputs.append(v)
                if not isinstance(var, jcore.DropVar):
                    env[var] = v
            for a in ins:
                if isinstance(a, Value):
                    a.users.append(node)
            self.nodes.append(node)

    # ------------------------------------------------------------- reading ---

    def walk(self, depth: int = 0) -> Iterator[tuple[int, Node]]:
        """(depth, node) for every node, nested bodies right after their node."""
        for n in self.nodes:
            yield depth, n
            for _, sub in n.subgraphs:
                yield from sub.walk(depth + 1)

    def is_output(self, v: Value) -> bool:
        return any(o is v for o in self.outputs)

    def tabular(self, nested: bool = True) -> str:
        """A table like torch.fx's print_tabular: opcode, name, target, args, shape,
        dtype, location (file:line) and module (name stack)."""
        header = ("opcode", "name", "target", "args", "shape", "dtype", "location", "module")
        rows = []
        for v in self.inputs:
            rows.append(("placeholder", v.name, v.name, "", str(list(v.shape)), _dtype_name(v.dtype), "", ""))
        for v in self.consts:
            rows.append(("get_attr", v.name, "const", "", str(list(v.shape)), _dtype_name(v.dtype), "", ""))
        items = self.walk() if nested else ((0, n) for n in self.nodes)
        for depth, n in items:
            out = n.outputs[0] if n.outputs else None
            args = ", ".join(v.name if isinstance(v, Value) else repr(v) for v in n.inputs)
            opcode = "call_primitive" if not n.subgraphs else "call_body"
            rows.append((("  " * depth) + opcode, ",".join(o.name for o in n.outputs), n.name,
                         _clip(args, 40), str(list(out.shape)) if out is not None else "",
                         _dtype_name(out.dtype) if out is not None else "",
                         n.source.short_location, n.module_path))
        outs = ", ".join(v.name if isinstance(v, Value) else repr(v) for v in self.outputs)
        rows.append(("output", "output", "output", _clip(outs, 40), "", "", "", ""))
        return _table(header, rows)

    def __str__(self):
        return self.tabular()

    def __repr__(self):
        return f"<jax_ops.fx.Graph: {len(self.inputs)} inputs, {len(self.nodes)} nodes>"


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _table(header, rows) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def make_closed_jaxpr(fn, args, kwargs):
    """fn's closed jaxpr over the flattened (args, kwargs), and the output tree."""
    flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    out_tree = []

    def flat_fn(*leaves):
        a, k = jax.tree_util.tree_unflatten(in_tree, leaves)
        out = fn(*a, **k)
        leaves_out, tree = jax.tree_util.tree_flatten(out)
        out_tree.append(tree)
        return leaves_out

    closed = jax.make_jaxpr(flat_fn)(*flat)
    return closed, in_tree, out_tree[0], flat


def trace(fn, *args, inline_jit: bool = False, **kwargs) -> Graph:
    """The Graph of fn(*args, **kwargs): fn's closed jaxpr (traced with jax.make_jaxpr;
    args may be arrays or jax.ShapeDtypeStruct). inline_jit=True inlines the bodies
    of jit calls (jnp functions are often jitted) into one flat graph."""
    if not callable(fn):
        raise TypeError(f"jax_ops.fx.trace: fn must be callable; got {type(fn).__name__}")
    closed, _, _, _ = make_closed_jaxpr(fn, args, kwargs)
    return Graph.from_jaxpr(closed.jaxpr, closed.consts, inline_jit=inline_jit)
