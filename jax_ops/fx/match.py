"""Matching a pattern's reference against a graph, exact by construction.

1. Templates: each formulation of a pattern is traced (jit bodies inlined) at a few
   example argument sets (ranks 1 and 2+, float32 and half inputs, parameters in
   float32 or x's dtype, optional inputs present or None) and static settings.
   Literal parameters (epsilon, a scale) are traced at sentinel values, so the
   literals that carry them can be found in the template.
2. Structural search (shape- and dtype-agnostic): from an anchor node with the
   template output's primitive, walk producers backwards comparing primitive names,
   output indices and dataflow; bind template inputs to graph values and parameter
   literals to the graph's literal values (the same parameter must get one value).
3. Verification: re-trace the formulation at the bound inputs' exact avals with the
   captured parameter values and require the re-traced graph to equal the matched
   subgraph node by node: primitive, params, output avals, literal values and
   dataflow. Only then is the match proven to compute exactly the reference.
"""
from __future__ import annotations

import dataclasses
import linecache
import re
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from jax_ops.fx.graph import Graph, Literal, Node, Value, make_closed_jaxpr

# Sentinels for literal parameters: exactly representable in float16/bfloat16/float32
# and unlikely to appear in a reference by accident.
SENTINELS = (93 / 1024, 101 / 1024, 105 / 1024, 107 / 1024, 109 / 1024, 113 / 1024)


@dataclasses.dataclass
class Template:
    """One traced formulation: its graph, main output, which argument each input is,
    and its other outputs (values inside it that may be used outside a match)."""
    formulation: Any
    graph: Graph
    output: Value
    arg_of_input: dict          # template input Value -> argument position
    none_args: tuple            # argument positions that were None
    param_slots: dict           # (node index, operand index) -> parameter name
    static: dict
    fixed: dict = dataclasses.field(default_factory=dict)
    # (node index, operand index) -> value of a literal that is the same at every shape
    # (0.0 in max(x, 0.0), -inf in softmax): the structural search compares it; other
    # literals (a row length 8.0 in a mean) are compared by verification only.
    extra_outputs: tuple = ()

    @property
    def anchor_primitive(self) -> str:
        return self.output.producer.name


def trace_reference(fn, args, kwargs, n_outputs: int = 1) -> tuple[Graph, dict, tuple]:
    """fn(*args, **kwargs) as a flat graph; None args stay None (absent inputs); fn
    returns n_outputs arrays (one, or a tuple). Returns (graph, template input ->
    argument position, None positions)."""
    positions = [i for i, a in enumerate(args) if a is not None]

    def call(*present):
        full = list(args)
        for i, a in zip(positions, present):
            full[i] = a
        return fn(*full, **kwargs)

    closed, _, out_tree, _ = make_closed_jaxpr(call, tuple(args[i] for i in positions), {})
    if out_tree.num_leaves != n_outputs:
        raise ValueError(f"a pattern reference must return {n_outputs} array(s); {fn} returns "
                         f"{out_tree}")
    g = Graph.from_jaxpr(closed.jaxpr, closed.consts, inline_jit=True)
    arg_of_input = {v: p for v, p in zip(g.inputs, positions)}
    return g, arg_of_input, tuple(i for i, a in enumerate(args) if a is None)


def build_template(formulation, args, literal_params: dict, static: dict,
                   n_outputs: int = 1) -> Template | None:
    sentinels = {name: SENTINELS[i] for i, name in enumerate(literal_params)}
    g, arg_of_input, none_args = trace_reference(formulation.reference, args,
                                                 {**sentinels, **static}, n_outputs)
    out = g.outputs[0]
    if not isinstance(out, Value) or out.producer is None:
        return None  # the reference returns an input or a constant: nothing to match
    inside = _ancestors(out)
    for k, o in enumerate(g.outputs[1:], 1):
        if not isinstance(o, Value) or o.producer not in inside:
            raise ValueError(f"pattern {formulation.pattern_name!r}: output {k} of the reference "
                             "is not computed on the way to its first output")
    slots = {}
    found = set()
    for node in g.nodes:
        for k, a in enumerate(node.inputs):
            if isinstance(a, Literal) and np.size(a.value) == 1:
                val = float(np.asarray(a.value).astype(np.float64))
                for name, s in sentinels.items():
                    if val == s:
                        slots[(node.index, k)] = name
                        found.add(name)
    missing = set(literal_params) - found
    if missing:
        raise ValueError(f"pattern {formulation.pattern_name!r}: literal parameter(s) {sorted(missing)} "
                         "never reach the traced reference as a literal operand (use each one "
                         "directly in a jnp/lax operation, e.g. var + epsilon)")
    t = Template(formulation, g, out, arg_of_input, none_args, slots, static,
                 extra_outputs=tuple(g.outputs[1:]))
    t.fixed = _fixed_literals(t, formulation, args, {**sentinels, **static}, n_outputs)
    return t


def _ancestors(v: Value) -> set:
    """The nodes v is computed by (its producer and theirs, recursively)."""
    seen: set = set()
    stack = [v]
    while stack:
        a = stack.pop()
        if isinstance(a, Value) and a.producer is not None and a.producer not in seen:
            seen.add(a.producer)
            stack.extend(a.producer.inputs)
    return seen


def _literal_values(g: Graph) -> dict:
    return {(n.index, k): np.asarray(a.value) for n in g.nodes for k, a in enumerate(n.inputs)
            if isinstance(a, Literal)}


def _fixed_literals(t: Template, formulation, args, kwargs, n_outputs: int = 1) -> dict:
    """Literals whose value doesn't change when every dimension of the arguments is
    doubled (same structure); none when the structure changes with the shape."""
    bigger = [None if a is None else jax.ShapeDtypeStruct(tuple(2 * d for d in a.shape), a.dtype)
              for a in args]
    try:
        g2, _, _ = trace_reference(formulation.reference, bigger, kwargs, n_outputs)
    except Exception:
        return {}
    if [(n.name, len(n.inputs)) for n in g2.nodes] != [(n.name, len(n.inputs)) for n in t.graph.nodes]:
        return {}
    first, second = _literal_values(t.graph), _literal_values(g2)
    fixed = {}
    for pos, v in first.items():
        w = second.get(pos)
        if w is not None and v.size == 1 and w.shape == v.shape and np.array_equal(v, w, equal_nan=True) \
                and pos not in t.param_slots:
            fixed[pos] = float(v.reshape(()).astype(np.float64))
    return fixed


def structure_key(t: Template) -> tuple:
    """Templates with equal keys match the same graphs structurally."""
    ids = {}
    rows = []
    for node in t.graph.nodes:
        ops = []
        for k, a in enumerate(node.inputs):
            if isinstance(a, Literal):
                ops.append(("param", t.param_slots[(node.index, k)]) if (node.index, k) in t.param_slots else "lit")
            elif a.producer is None:
                ops.append(("in", t.arg_of_input.get(a, "const")))
            else:
                ops.append((ids[a.producer], a.index))
        ids[node] = len(rows)
        rows.append((node.name, tuple(ops), len(node.outputs)))
    extras = tuple((ids[o.producer], o.index) for o in t.extra_outputs)
    return tuple(rows), t.none_args, extras


# ------------------------------------------------------------- structural ---

@dataclasses.dataclass
class Candidate:
    template: Template
    anchor: Node
    args: dict          # argument position -> graph Value or Literal
    params: dict        # literal parameter name -> float
    nodes: dict         # template node -> graph node
    conflict: str | None = None


def _scalar(a) -> float | None:
    """The value of a literal or a one-element constant, else None."""
    if isinstance(a, Literal) or (isinstance(a, Value) and a.is_const):
        v = np.asarray(a.value if isinstance(a, Literal) else a.const)
        if v.size == 1:
            return float(v.reshape(()).astype(np.float64))
    return None


def structural(t: Template, anchor: Node) -> Candidate | None:
    """Candidate if the graph around anchor has the template's structure (primitives
    and dataflow; no shapes, dtypes, params or literal values compared), else None.
    A candidate whose parameter literals disagree carries the conflict as its reason."""
    if anchor.name != t.anchor_primitive or t.output.index >= len(anchor.outputs):
        return None
    cand = Candidate(t, anchor, {}, {}, {})
    rev: dict = {}
    literal_mismatch: list = []
    slot_of = t.param_slots

    def walk(tv, gv) -> bool:
        if isinstance(tv, Literal) or (isinstance(tv, Value) and tv.is_const):
            return _scalar(gv) is not None or (isinstance(gv, Value) and gv.is_const)
        if tv.producer is None:  # a template input
            pos = t.arg_of_input[tv]
            bound = cand.args.get(pos)
            if bound is None:
                cand.args[pos] = gv
                return True
            return bound is gv
        tn = tv.producer
        if not isinstance(gv, Value) or gv.producer is None:
            return False
        gn = gv.producer
        if gn.name != tn.name or gv.index != tv.index or len(gn.inputs) != len(tn.inputs) \
                or len(gn.outputs) != len(tn.outputs):
            return False
        if tn in cand.nodes:
            return cand.nodes[tn] is gn
        if gn in rev:  # one graph node can't play two template nodes
            return False
        cand.nodes[tn], rev[gn] = gn, tn
        orders = operand_orders(tn)
        for i, order in enumerate(orders):
            last = i == len(orders) - 1
            saved = None if last else (dict(cand.nodes), dict(rev), dict(cand.args), dict(cand.params))
            if pair(tn, gn, order):
                return True
            if last or cand.conflict:
                return False
            for live, old in zip((cand.nodes, rev, cand.args, cand.params), saved):
                live.clear()
                live.update(old)
        return False

    def pair(tn, gn, order) -> bool:
        for k, kg in enumerate(order):
            ta, ga = tn.inputs[k], gn.inputs[kg]
            want = t.fixed.get((tn.index, k))
            if want is not None:
                got = _scalar(ga)
                if got is None:
                    return False
                if not _same_float(got, want):
                    # A near miss (jnp.var's ddof=1) if everything else fits.
                    literal_mismatch.append(f"{gn.name} at {gn.source.short_location}: literal "
                                            f"{got:g} where the pattern has {want:g}")
                continue
            name = slot_of.get((tn.index, k))
            if name is not None:
                val = _scalar(ga)
                if val is None:
                    return False
                if name in cand.params and not _same_float(cand.params[name], val):
                    cand.conflict = (f"parameter {name} is {cand.params[name]:g} in one place and "
                                     f"{val:g} in another")
                    return False
                cand.params.setdefault(name, val)
                continue
            if not walk(ta, ga):
                return False
        return True

    ok = walk(t.output, anchor.outputs[t.output.index])
    if ok and literal_mismatch:
        if len(t.graph.nodes) == 1:  # one equation with another constant: unrelated
            return None
        cand.conflict = literal_mismatch[0]
    if ok or cand.conflict:
        return cand
    return None


#: binary primitives whose operands may come in either order: IEEE add and mul are
#: commutative bit for bit; max/min up to the sign of a zero result.
COMMUTATIVE = frozenset({"add", "mul", "max", "min"})


def operand_orders(node: Node) -> list[tuple[int, ...]]:
    """Graph operand index for each template operand, in the orders to try."""
    n = len(node.inputs)
    if node.name in COMMUTATIVE and n == 2:
        return [(0, 1), (1, 0)]
    return [tuple(range(n))]


def _same_float(a, b) -> bool:
    return a == b or (np.isnan(a) and np.isnan(b))


# ----------------------------------------------------------- verification ---

@dataclasses.dataclass
class Verified:
    nodes: list            # graph nodes of the match (anchor last)
    pattern_of: dict       # graph node -> re-traced reference node
    static: dict
    out_aval: Any
    outputs: list = dataclasses.field(default_factory=list)
    # the graph values of the pattern's outputs: the main one, then the others


class Mismatch(Exception):
    def __init__(self, reason, depth):
        super().__init__(reason)
        self.reason, self.depth = reason, depth


def _open_jaxpr(j):
    """The Jaxpr of a nested jaxpr param (a ClosedJaxpr's, or j itself)."""
    return j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j


def _jaxpr_identity(j) -> tuple:
    """A comparable form of a nested jaxpr: its printed text (variables renamed
    canonically by the printer), its consts and, for custom_jvp/custom_vjp bodies,
    the Python function it was traced from (same function => same derivative rule)."""
    inner = _open_jaxpr(j)
    consts = j.consts if isinstance(j, jcore.ClosedJaxpr) else ()
    src = getattr(getattr(inner, "debug_info", None), "func_src_info", None)
    return str(inner), src, tuple(np.asarray(c).tobytes() for c in consts)


def _jaxpr_difference(key, a, b) -> str | None:
    """For two nested jaxprs (a custom_jvp_call's body, say), their first differing
    equation as the near miss's reason: "call_jaxpr=<jaxpr>" on both sides says nothing."""
    if not all(isinstance(j, (jcore.ClosedJaxpr, jcore.Jaxpr)) for j in (a, b)):
        return None
    lines = [[ln.strip() for ln in str(_open_jaxpr(j)).splitlines()] for j in (a, b)]
    for la, lb in zip(*lines):
        if la != lb:
            return f"{key}: {la} where the pattern has {lb}"
    return None


def _param_equal(a, b) -> bool:
    if isinstance(a, (jcore.ClosedJaxpr, jcore.Jaxpr)) or isinstance(b, (jcore.ClosedJaxpr, jcore.Jaxpr)):
        return type(a) is type(b) and _jaxpr_identity(a) == _jaxpr_identity(b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_param_equal(x, y) for x, y in zip(a, b))
    if _is_function(a) and _is_function(b):
        # Rules of custom_jvp/custom_vjp calls: fresh wrappers on every trace, so the
        # call's body jaxpr (compared with its source function above) identifies
        # them; plain functions must at least share their code.
        ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
        return ca is cb if (ca is not None and cb is not None) else True
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN params (gather's fill_value) are equal when both are NaN
    try:
        eq = a == b
        return bool(eq) if not isinstance(eq, np.ndarray) else bool(eq.all())
    except Exception:
        return repr(a) == repr(b)


def _is_function(f) -> bool:
    return (callable(f) and not isinstance(f, (type, np.dtype))) or hasattr(f, "call_wrapped")


def _literal_equal(p, g) -> bool:
    pv = np.asarray(p.value if isinstance(p, Literal) else p.const)
    if isinstance(g, Literal):
        gv = np.asarray(g.value)
    elif isinstance(g, Value) and g.is_const:
        gv = np.asarray(g.const)
    else:
        return False
    if pv.shape != gv.shape or p.aval.dtype != g.aval.dtype:
        return False
    return bool(np.array_equal(pv, gv, equal_nan=True))


def _aval_equal(a, b) -> bool:
    return (tuple(getattr(a, "shape", ())) == tuple(getattr(b, "shape", ())) and a.dtype == b.dtype
            and getattr(a, "weak_type", False) == getattr(b, "weak_type", False))


def exact(ref: Graph, arg_of_input: dict, args: dict, anchor: Node) -> Verified:
    """The re-traced reference `ref` equals the subgraph ending at anchor, with ref's
    inputs being exactly the bound graph values; else Mismatch naming the earliest
    difference in program order (the root cause, e.g. a reduction's axes, rather than
    the shapes that follow from it)."""
    out = ref.outputs[0]
    if not isinstance(out, Value) or out.producer is None:
        raise Mismatch("the reference has no equations at these shapes", 0)
    mapping: dict = {}
    rev: dict = {}
    order: list = []
    found: list = []   # (graph node index, reason)

    def differ(gn, what):
        found.append((gn.index, f"{gn.name} at {gn.source.short_location}: {what}"))

    def walk(pv, gv, user):
        if isinstance(pv, Literal) or (isinstance(pv, Value) and pv.is_const):
            if not _literal_equal(pv, gv):
                got, want = _scalar(gv), _scalar(pv)
                differ(user, f"literal {got if got is not None else gv!r} where the pattern has "
                             f"{want if want is not None else pv!r}")
            return
        if pv.producer is None:
            if args.get(arg_of_input[pv]) is not gv:
                differ(user, f"input {arg_of_input[pv]} of the pattern is not the same value "
                             "at every use")
            return
        pn = pv.producer
        if not isinstance(gv, Value) or gv.producer is None:
            differ(user, f"an input or literal where the pattern has {pn.name}")
            return
        gn = gv.producer
        if gn.name != pn.name or gv.index != pv.index or len(gn.inputs) != len(pn.inputs):
            differ(gn, f"found where the pattern has {pn.name}")
            return
        if pn in mapping or gn in rev:
            if mapping.get(pn) is not gn:
                differ(gn, "dataflow differs from the pattern")
            return
        mapping[pn], rev[gn] = gn, pn
        compare_node(pn, gn)
        orders = operand_orders(pn)
        if len(orders) == 1:
            for pa, ga in zip(pn.inputs, gn.inputs):
                walk(pa, ga, gn)
        else:  # commutative: the order that agrees (else the one that maps more equations)
            start = (dict(mapping), dict(rev), len(order), len(found))
            tried = []
            for o in orders:
                for live, old in zip((mapping, rev), start[:2]):
                    live.clear()
                    live.update(old)
                del order[start[2]:], found[start[3]:]
                for k, kg in enumerate(o):
                    walk(pn.inputs[k], gn.inputs[kg], gn)
                tried.append((len(found) - start[3], dict(mapping), dict(rev), order[start[2]:],
                              found[start[3]:]))
                if len(found) == start[3]:
                    break
            _, best_map, best_rev, best_order, best_found = min(
                tried, key=lambda t: (t[0] > 0, -len(t[3]), t[0]))
            for live, kept in ((mapping, best_map), (rev, best_rev)):
                live.clear()
                live.update(kept)
            order[start[2]:] = best_order
            found[start[3]:] = best_found
        order.append(gn)

    def compare_node(pn, gn):
        for key in sorted(set(gn.params) | set(pn.params)):
            if key not in gn.params or key not in pn.params or not _param_equal(gn.params[key], pn.params[key]):
                gp, pp = gn.params.get(key), pn.params.get(key)
                differ(gn, _jaxpr_difference(key, gp, pp) or f"{key}={_short(gp)} where the pattern has {key}={_short(pp)}")
                break
        else:
            if len(gn.outputs) != len(pn.outputs) or not all(
                    _aval_equal(a.aval, b.aval) for a, b in zip(gn.outputs, pn.outputs)):
                differ(gn, f"result {gn.outputs[0].aval.str_short()} where the pattern has "
                           f"{pn.outputs[0].aval.str_short()}")

    walk(out, anchor.outputs[out.index], anchor)
    for a in args.values():
        if isinstance(a, Value) and a.producer in rev:
            found.append((a.producer.index, "an input of the pattern is computed inside the match"))
    outputs = [anchor.outputs[out.index]]
    for k, pv in enumerate(ref.outputs[1:], 1):
        gn = mapping.get(pv.producer) if isinstance(pv, Value) else None
        if gn is None:
            found.append((anchor.index, f"output {k} of the pattern is not computed by the match"))
            continue
        outputs.append(gn.outputs[pv.index])
    if found:
        raise Mismatch(min(found)[1], len(order) - len(found))
    order.sort(key=lambda n: n.index)
    return Verified(order, {g: p for p, g in mapping.items()}, {}, out.aval, outputs)


def input_from_match(cand: Candidate) -> bool:
    """Whether an input of the candidate is computed from values inside it (e.g. an
    inference BatchNorm's "running" mean computed from the conv's output: the batch
    statistics of training). Then it is not a candidate: replacing it would need its
    own results to compute its inputs."""
    nodes = set(cand.nodes.values())
    if not nodes:
        return False
    first = min(n.index for n in nodes)
    return any(isinstance(a, Value) and a.producer not in nodes and _depends_on(a, nodes, first)
               for a in cand.args.values())


def _depends_on(v: Value, nodes, first: int) -> bool:
    """Whether v is computed from a result of `nodes` (whose earliest index is first:
    earlier equations can't depend on them, so the walk stays near the match)."""
    seen: set = set()
    stack = [v]
    while stack:
        a = stack.pop()
        if not isinstance(a, Value) or a.producer is None or a.producer.index < first:
            continue
        n = a.producer
        if n in nodes:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.inputs)
    return False


def _short(v) -> str:
    s = repr(v) if not isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)) else "<jaxpr>"
    return s if len(s) <= 60 else s[:57] + "..."


def intermediate_name(ref_node: Node) -> str:
    """A readable name for a pattern intermediate: the variable its reference line
    assigns ("mean = jnp.mean(...)" -> "mean"), else the primitive's name."""
    frame = ref_node.source.frame
    if frame is not None:
        line = linecache.getline(frame.file_name, frame.start_line)
        m = re.match(r"\s*([A-Za-z_]\w*)\s*(?:[-+*/]?=)(?!=)", line)
        if m:
            return m.group(1)
    return f"{ref_node.name} result"


_EFFECTFUL = ("debug_callback", "io_callback", "pure_callback", "debug_print")


def live_nodes(graph: Graph) -> set:
    """Equations whose results reach the graph's outputs (or that have effects): a dead
    use (logsumexp's unused sign) is no use."""
    live = getattr(graph, "_live_nodes", None)
    if live is None:
        live = set()
        for n in reversed(graph.nodes):
            if n.subgraphs or n.name in _EFFECTFUL or any(
                    graph.is_output(o) or any(u in live for u in o.users) for o in n.outputs):
                live.add(n)
        graph._live_nodes = live
    return live


def escaping_intermediate(v: Verified, graph: Graph) -> str | None:
    """Reason if a value computed inside the match (other than its outputs) is used
    outside it: replacing the match would then leave that use without its value."""
    inside = set(v.nodes)
    live = live_nodes(graph)
    anchor = v.nodes[-1]
    outputs = set(v.outputs)
    for n in v.nodes:
        if n is anchor:
            continue
        for o in n.outputs:
            if o in outputs:
                continue
            outside = [u for u in o.users if u not in inside and u in live]
            if outside or graph.is_output(o):
                name = intermediate_name(v.pattern_of[n])
                where = ("as an output of the function" if not outside else
                         f"by {outside[0].name} at {outside[0].source.short_location}")
                return f"intermediate {name} used elsewhere ({where})"
    for o in anchor.outputs[1:]:
        if o.users or graph.is_output(o):
            return "the matched equation has other results in use"
    return None


def avals_of(args: dict, n: int, none_args) -> list:
    """Argument avals (None where the argument is absent) for re-tracing."""
    out = []
    for i in range(n):
        a = args.get(i)
        if a is None:
            out.append(None)
        else:
            out.append(jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype,
                                            weak_type=getattr(a.aval, "weak_type", False)))
    return out

