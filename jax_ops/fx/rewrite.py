"""optimize() and rewrites(): find pattern matches in a traced function, decide which
to replace, and evaluate the rewritten program with an interpreter that binds each
primitive (or calls the replacement) under whatever trace is active, so the result
composes with jit, grad and vmap."""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable

import jax
import numpy as np

from jax_ops.core.pattern import ACTIVE_PATTERNS, CLAIMED_BY
from jax_ops.fx import match as M
from jax_ops.fx import patterns as P
from jax_ops.fx.graph import Graph, Literal, Node, Value, _table, make_closed_jaxpr
from jax._src import source_info_util  # private: user_context (keeps source/name stack in HLO)
from jax_ops.core.calls import explain
from jax_ops.core.dispatch import device_kind
from jax_ops.core.op import default_platform

POLICIES = ("auto", "always", "memory")

#: bodies optimize() rewrites in place (the node is re-issued through the public API)
REWRITABLE_BODIES = ("checkpoint", "remat", "remat2", "scan", "cond", "while")
#: bodies whose matches can't be replaced: their rules refer to the original body
FROZEN_BODIES = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


@dataclasses.dataclass
class Rewrite:
    """One candidate match: `replaced`, or the `reason` it was not."""
    pattern: str
    location: str
    replaced: bool
    reason: str | None
    module: str = ""
    formulation: str = ""
    params: dict = dataclasses.field(default_factory=dict)
    equations: int = 0
    context: str = ""
    order: int = dataclasses.field(default=0, repr=False, compare=False)

    def __str__(self):
        what = "replaced" if self.replaced else f"kept: {self.reason}"
        return f"{self.pattern} at {self.location}: {what}"


class Rewrites(list):
    """rewrites()'s records in program order; str() is a table."""

    def __str__(self):
        if not self:
            return "jax_ops.fx.rewrites: no candidate matches"
        header = ("pattern", "replaced", "location", "module", "formulation", "params", "reason")
        rows = [(r.pattern, "yes" if r.replaced else "no", _short_loc(r.location), r.module,
                 r.formulation, _params_str(r.params),
                 (r.reason or "") + (f" [{r.context}]" if r.context else ""))
                for r in self]
        return _table(header, rows)

    @property
    def replaced(self) -> list:
        return [r for r in self if r.replaced]


def _params_str(params: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in params.items())


def _short_loc(loc: str) -> str:
    path, _, line = loc.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else loc


@dataclasses.dataclass
class Match:
    pattern: P.Pattern
    args: list              # graph operands by argument position (None: absent)
    params: dict
    outputs: list           # graph values the replacement gives (main output first)
    out_dtypes: list
    nodes: list             # the matched nodes, anchor last
    formulation: Any = None
    at: Any = None          # the node before which the replacement is evaluated

    def replace(self, vals) -> list:
        return P.replace(self.pattern, vals, self.params, self.out_dtypes, self.formulation)


@dataclasses.dataclass
class Plan:
    at: dict = dataclasses.field(default_factory=dict)        # Node -> [Match] evaluated before it
    skip: set = dataclasses.field(default_factory=set)        # matched nodes
    match_of: dict = dataclasses.field(default_factory=dict)  # matched node -> its Match
    bodies: dict = dataclasses.field(default_factory=dict)    # Node -> [Plan per subgraph]

    @property
    def empty(self) -> bool:
        return not self.at and not self.bodies

    def add(self, m: Match):
        """Schedule m before m.at, after the matches there that it reads from and before
        those that read its outputs."""
        queue = self.at.setdefault(m.at, [])
        outs = set(m.outputs)
        pos = next((i for i, other in enumerate(queue)
                    if any(a in outs for a in other.args if isinstance(a, Value))), len(queue))
        queue.insert(pos, m)
        self.skip.update(m.nodes)
        self.match_of.update((n, m) for n in m.nodes)


# --------------------------------------------------------------- planning ---

def _not_faster(m: Match, avals) -> str | None:
    """policy="auto": the library's own choice for the replacement at these shapes.
    None when it would run a kernel of ours, else why not."""

    call, sds = _present_call(m, avals)
    try:
        decisions = explain(call, *sds)
    except Exception as e:  # keep the original rather than guess
        return f"jax_ops.explain could not decide: {type(e).__name__}: {e}"
    if any(d.implementation == "xla" for d in decisions):
        platform = default_platform()
        return f"not faster on {device_kind(platform) or platform}"
    return None


def _present_call(m: Match, avals):
    present = [i for i, a in enumerate(avals) if a is not None]

    def call(*xs):
        full = [None] * len(avals)
        for i, x in zip(present, xs):
            full[i] = x
        return m.replace(full)
    return call, [avals[i] for i in present]


def _replacement_refuses(m: Match, avals) -> str | None:
    """Trace the replacement at the match's inputs (nothing runs): it must accept them
    (e.g. epsilon >= 0) and give the matched results' shapes."""
    call, sds = _present_call(m, avals)
    try:
        outs = jax.eval_shape(call, *sds)
    except Exception as e:  # the op's own validation, e.g. a negative epsilon
        return f"the replacement refuses these inputs: {type(e).__name__}: {e}"
    for out, want in zip(outs, m.outputs):
        if not hasattr(out, "shape") or tuple(out.shape) != tuple(want.shape):
            return (f"the replacement gives {getattr(out, 'shape', type(out).__name__)}, "
                    f"the match {tuple(want.shape)}")
    return None


def _schedule(plan: Plan, v: M.Verified, args) -> tuple:
    """(node before which to evaluate the replacement, None) or (.., reason). The anchor,
    unless an output other than the main one is used outside the match earlier in
    program order (flax's running-average update of BatchNorm's batch statistics
    comes before the normalization): then before that use, if every input of the match
    is available there."""
    inside = set(v.nodes)
    at = v.nodes[-1]
    for o in v.outputs[1:]:
        for u in o.users:
            if u not in inside:
                other = plan.match_of.get(u)
                t = other.at if other is not None else u
                if t.index < at.index:
                    at = t
    for a in args:
        if isinstance(a, Value) and a.producer is not None:
            other = plan.match_of.get(a.producer)
            ready = other.at.index <= at.index if other is not None else a.producer.index < at.index
            if not ready:
                return at, (f"an input of the match is computed after {at.name} at "
                            f"{at.source.short_location} uses one of its outputs")
    return at, None


def _broadcast_input(pattern, cand: M.Candidate) -> bool:
    """Whether an input the pattern wants whole (`no_broadcast`: a residual) is a
    broadcast: a literal, an array of another shape than the main output (a bias
    vector), or a broadcast_in_dim's result. Then the candidate is not one."""
    shape = cand.anchor.outputs[cand.template.output.index].aval.shape
    for i in pattern.no_broadcast:
        a = cand.args.get(i)
        if a is None:
            continue
        if not isinstance(a, Value) or tuple(a.aval.shape) != tuple(shape) or (
                a.producer is not None and a.producer.name == "broadcast_in_dim"):
            return True
    return False


@functools.lru_cache(maxsize=512)
def _retrace(formulation, avals: tuple, kwargs: tuple, n_outputs: int):
    """The formulation traced at exact inputs: one trace serves every equal match
    (a model's 24 identical LayerNorms)."""
    ref, arg_of_input, _ = M.trace_reference(formulation.reference, list(avals), dict(kwargs),
                                             n_outputs)
    return ref, arg_of_input


def _verify(pattern, cand: M.Candidate, graph: Graph):
    """(Verified, avals), (stage, reason), or None where the match is not what the
    pattern is for (`Pattern.candidate`: neither replaced nor reported)."""
    t = cand.template
    nargs = len(pattern.example_args[0])
    avals = M.avals_of(cand.args, nargs, t.none_args)
    # the params of the matched equations the formulation takes (a conv's strides...)
    node_kw = {tn.name: tuple(sorted(gn.params.items())) for tn, gn in cand.nodes.items()
               if tn.name in t.formulation.node_params}
    if pattern.candidate is not None and not pattern.candidate(avals, {**cand.params, **node_kw}):
        return None
    why = pattern.accepts(avals)
    if why:
        return 0, why
    out_aval = cand.anchor.outputs[t.output.index].aval
    best = None
    for static in t.formulation.static(avals, out_aval):
        static = {**node_kw, **static}
        try:
            ref, arg_of_input = _retrace(t.formulation, tuple(avals),
                                         tuple(sorted({**cand.params, **static}.items(), key=str)),
                                         len(pattern.outputs))
        except Exception as e:  # the reference refuses these shapes/dtypes
            best = best or M.Mismatch(f"the reference does not trace at these inputs: "
                                      f"{type(e).__name__}: {e}", -1)
            continue
        try:
            v = M.exact(ref, arg_of_input, cand.args, cand.anchor)
        except M.Mismatch as mm:
            if best is None or mm.depth > best.depth:
                best = mm
            continue
        v.static = static
        return v, avals
    return 2, (best.reason if best else "no static setting to verify with")


def plan_graph(graph: Graph, patterns, policy: str, records: list, context: str = "",
               frozen: str | None = None) -> Plan:
    plan = Plan()
    claimed: dict = {}  # node -> the name of the pattern whose replacement took it
    considered: set = set()  # nodes of verified candidates: their bodies are not searched
    failed: list = []   # (pattern name, node set) of recorded failures: no duplicates
    failures: list = []  # (record, anchor, stage, nodes) of near misses
    verified_by: dict = {}  # node -> names of the patterns with a verified match over it
    active = frozenset(p.name for p in patterns)
    for pattern in patterns:
        by_anchor = P.templates_by_anchor(pattern)
        for node in reversed(graph.nodes):
            if node.name not in by_anchor or node in claimed:
                continue
            failure = None
            for t in by_anchor[node.name]:
                cand = M.structural(t, node)
                if cand is None or _broadcast_input(pattern, cand) or M.input_from_match(cand):
                    continue
                if claimed.keys() & set(cand.nodes.values()):
                    continue
                if cand.conflict:
                    failure = _later(failure, (1, cand, cand.conflict, set(cand.nodes.values())))
                    continue
                result = _verify(pattern, cand, graph)
                if result is None:
                    continue  # not what the pattern is for (not reported)
                if isinstance(result[0], int):  # (stage, reason): the inputs don't fit
                    failure = _later(failure, (result[0], cand, result[1], set(cand.nodes.values())))
                    continue
                v, avals = result
                considered.update(v.nodes)
                for n in v.nodes:
                    verified_by.setdefault(n, set()).add(pattern.name)
                if claimed.keys() & set(v.nodes):
                    continue
                reason = M.escaping_intermediate(v, graph)
                params = {**cand.params, **v.static}
                graph_args = [cand.args.get(i) for i in range(len(avals))]
                in_graph = {ACTIVE_PATTERNS: active, CLAIMED_BY: claimed}  # specialize/context only
                if reason is None and pattern.specialize is not None:
                    facts = pattern.specialize(graph_args, avals, {**params, **in_graph})
                    if isinstance(facts, str):
                        reason = facts
                    else:
                        params.update(facts)
                m = Match(pattern, graph_args, params,
                          v.outputs, [np.dtype(o.aval.dtype) for o in v.outputs], v.nodes,
                          t.formulation)
                if reason is None:
                    m.at, reason = _schedule(plan, v, m.args)
                if reason is None and frozen:
                    reason = frozen
                if reason is None:
                    reason = _replacement_refuses(m, avals)
                if reason is None and policy in ("auto", "memory") and pattern.context is not None:
                    reason = pattern.context(graph_args, avals, {**params, **in_graph})
                if reason is None and policy == "memory" and pattern.decide_memory is not None:
                    reason = pattern.decide_memory(avals, params)
                elif reason is None and policy in ("auto", "memory"):
                    reason = (pattern.decide(avals, params) if pattern.decide is not None
                              else _not_faster(m, avals))
                shown = {k: v for k, v in params.items()
                         if k in cand.params or k in pattern.reported}
                rec = _record(pattern, t, node, shown, v.nodes, reason, context)
                if reason is None:
                    plan.add(m)
                    claimed.update((n, pattern.name) for n in v.nodes)
                    failure = None
                    records.append(rec)
                    break
                failure = _later(failure, (3, cand, reason, set(v.nodes)))
            if failure is not None:
                stage, cand, reason, nodes = failure
                if not any(name == pattern.name and nodes <= other for name, other in failed):
                    failed.append((pattern.name, nodes))
                    rec = _record(pattern, cand.template, node, cand.params,
                                  sorted(nodes, key=lambda n: n.index), reason, context)
                    records.append(rec)
                    failures.append((rec, node, stage, nodes))
    # Near misses superseded by a replacement at the same anchor under the same name
    # (attention has several Pattern objects), or by a near miss of that name that
    # covers more of the graph (it got further); and a near miss that failed before
    # verification where another pattern verifiably matches the anchor: that pattern's
    # computation (a LayerNorm + relu is no BatchNorm + relu).
    replaced_at = {(m.pattern.name, m.nodes[-1]) for queue in plan.at.values() for m in queue}
    for rec, node, stage, nodes in failures:
        covered = any(o is not rec and o.pattern == rec.pattern and nodes < o_nodes
                      for o, _, _, o_nodes in failures)
        other = stage < 3 and verified_by.get(node, set()) - {rec.pattern}
        if covered or other or (rec.pattern, node) in replaced_at:
            records.remove(rec)
    # Bodies: rewritten in place where the primitive can be re-issued, reported otherwise.
    for node in graph.nodes:
        if node in claimed or node in considered or not node.subgraphs:
            continue
        name = node.name
        if name in FROZEN_BODIES:
            if _is_jax_ops_call(node):
                continue
            why = f"inside a {name} body (only the whole call can be replaced)"
            for label, sub in node.subgraphs:
                if label in ("call_jaxpr", "fun_jaxpr"):
                    plan_graph(sub, patterns, policy, records, _ctx(context, node, label), frozen=why)
        elif name in REWRITABLE_BODIES or frozen:
            subplans = [plan_graph(sub, patterns, policy, records, _ctx(context, node, label),
                                   frozen=frozen) for label, sub in node.subgraphs]
            if not frozen and any(not sp.empty for sp in subplans):
                plan.bodies[node] = subplans
    records.sort(key=lambda r: (r.context, r.order))  # program order within each body
    return plan


def _later(failure, new):
    """The failure that got furthest (a verified match rejected for its context says
    more than a structural near miss of another formulation), then the larger one (a
    rank-1 template bound to broadcast parameters says less)."""
    if failure is None or (new[0], len(new[3])) > (failure[0], len(failure[3])):
        return new
    return failure


def _is_jax_ops_call(node: Node) -> bool:
    return any(n.name.startswith("jax_ops_") for _, sub in node.subgraphs for _, n in sub.walk())


def _ctx(context, node, label) -> str:
    here = f"{node.name}.{label}"
    return f"{context} > {here}" if context else here


def _record(pattern, t, anchor: Node, params, nodes, reason, context) -> Rewrite:
    first = min(nodes, key=lambda n: n.index) if nodes else anchor
    return Rewrite(pattern.name, anchor.location if anchor.source.user else first.location,
                   reason is None, reason, anchor.module_path, t.formulation.label,
                   {k: v for k, v in params.items()}, len(nodes), context, anchor.index)


# ------------------------------------------------------------ interpreter ---

def _read(env, a):
    return a.value if isinstance(a, Literal) else env[a]


def _output(env, a):
    if isinstance(a, Literal):  # a literal result: an array, as fn returned
        return jax.numpy.asarray(a.value, a.aval.dtype)
    return env[a]


def _context(node: Node):
    si = node.source_info
    if si is None:
        return source_info_util.user_context(None)
    name_stack = source_info_util.current_name_stack() + si.name_stack
    return source_info_util.user_context(si.traceback, name_stack=name_stack)


def evaluate(graph: Graph, plan: Plan, args) -> list:
    """graph's outputs for args, with plan's matches replaced."""
    env: dict = {}
    for v in graph.consts:
        env[v] = v.const
    for v, a in zip(graph.inputs, args):
        env[v] = a
    live = M.live_nodes(graph)
    for node in graph.nodes:
        for m in plan.at.get(node, ()):
            vals = [None if a is None else _read(env, a) for a in m.args]
            with _context(m.nodes[-1]):
                outs = m.replace(vals)
            for o, val in zip(m.outputs, outs):
                env[o] = val
        if node in plan.skip or (plan.skip and node not in live):
            continue  # matched, or dead (it may read a value the rewrite removed)
        vals = [_read(env, a) for a in node.inputs]
        subplans = plan.bodies.get(node)
        if subplans is not None:
            with _context(node):
                outs = _reissue(node, subplans, vals)
        else:
            with _context(node), node.eqn_ctx.manager:
                outs = node.primitive.bind(*vals, **node.primitive.get_bind_params(node.params))
            if not node.primitive.multiple_results:
                outs = [outs]
        for o, val in zip(node.outputs, outs):
            env[o] = val
    return [_output(env, o) for o in graph.outputs]


def _reissue(node: Node, subplans, vals) -> list:
    """A control-flow / remat node with rewritten bodies, re-issued through jax's
    public API (which traces the interpreter over each body)."""
    subs = [g for _, g in node.subgraphs]
    p = node.params
    name = node.name
    if name in ("checkpoint", "remat", "remat2"):
        body = functools.partial(evaluate, subs[0], subplans[0])
        return list(jax.checkpoint(lambda *a: body(a), prevent_cse=p.get("prevent_cse", True),
                                   policy=p.get("policy"))(*vals))
    if name == "scan":
        if "ft_in" in p:  # jax >= 0.10: operands grouped (consts, carry, xs) by a FlatTree
            consts, init, xs = map(list, p["ft_in"].update(vals).unpack())
        else:
            nc, ncarry = p["num_consts"], p["num_carry"]
            consts, init, xs = vals[:nc], vals[nc:nc + ncarry], vals[nc + ncarry:]
        ncarry = len(init)

        def step(carry, x):
            outs = evaluate(subs[0], subplans[0], [*consts, *carry, *x])
            return outs[:ncarry], outs[ncarry:]
        carry, ys = jax.lax.scan(step, list(init), list(xs), length=p["length"],
                                 reverse=p["reverse"], unroll=p.get("unroll", 1))
        return [*carry, *ys]
    if name == "cond":
        index, ops = vals[0], vals[1:]
        branches = [functools.partial(lambda g, sp, *a: evaluate(g, sp, a), g, sp)
                    for g, sp in zip(subs, subplans)]
        return list(jax.lax.switch(index, branches, *ops))
    if name == "while":
        labels = [label for label, _ in node.subgraphs]
        cond_g, body_g = subs[labels.index("cond_jaxpr")], subs[labels.index("body_jaxpr")]
        cond_p, body_p = subplans[labels.index("cond_jaxpr")], subplans[labels.index("body_jaxpr")]
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, init = vals[:cn], vals[cn:cn + bn], vals[cn + bn:]
        out = jax.lax.while_loop(lambda c: evaluate(cond_g, cond_p, [*cconsts, *c])[0],
                                 lambda c: evaluate(body_g, body_p, [*bconsts, *c]), list(init))
        return list(out)
    raise NotImplementedError(f"jax_ops.fx: can't re-issue {name} with a rewritten body")


# ------------------------------------------------------------- public API ---

def _check_policy(where: str, policy):
    if policy not in POLICIES:
        raise ValueError(f"{where}: policy must be one of {POLICIES}; got {policy!r}")


def _signature(leaves) -> tuple:
    return tuple(jax.typeof(x) for x in leaves)


def _abstract(leaves):
    out = []
    for x in leaves:
        a = jax.typeof(x)
        out.append(jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)))
    return out


def _analyse(fn, args, kwargs, policy, patterns, exclude):
    flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    abstract = jax.tree_util.tree_unflatten(in_tree, _abstract(flat))
    closed, _, out_tree, _ = make_closed_jaxpr(fn, *abstract)
    graph = Graph.from_jaxpr(closed.jaxpr, closed.consts, inline_jit=True)
    records: list = []
    plan = plan_graph(graph, P.resolve(patterns, exclude), policy, records)
    return graph, plan, out_tree, closed, Rewrites(records)


def rewrites(fn: Callable, *args, policy: str = "auto", patterns=None, exclude=(), **kwargs) -> Rewrites:
    """One record per candidate match in fn(*args, **kwargs): its pattern, location,
    whether optimize() with this policy replaces it and, if not, why."""
    if not callable(fn):
        raise TypeError(f"jax_ops.fx.rewrites: fn must be callable; got {type(fn).__name__}")
    _check_policy("jax_ops.fx.rewrites", policy)
    return _analyse(fn, args, kwargs, policy, patterns, exclude)[4]


def optimize(fn: Callable, *, policy: str = "auto", patterns=None, exclude=()) -> Callable:
    """fn with its matched subgraphs replaced by jax_ops ops; same signature and
    semantics. Traced per input signature (pytree structure and avals, cached) when
    called; composes with jit, grad and vmap.

    The rewritten program is evaluated equation by equation: wrap the result in
    jax.jit (or call it under one) to compile it as a whole.

    Args:
      fn: the function (all of its arguments are traced: pass static settings by
        closure or functools.partial).
      policy: "auto" replaces a match only where the library's automatic choice runs
        one of our kernels for it on this device (jax_ops.explain; a user pattern whose
        replacement calls no jax_ops op is always replaced) or, for a pattern that
        decides itself (Pattern.decide), where it says the replacement is not slower;
        "memory" is "auto" plus the replacements that trade time for memory where they
        save it (Pattern.decide_memory: linear_cross_entropy); "always" replaces every
        verified match.
      patterns: pattern names or Pattern objects to use (None: all registered).
      exclude: pattern names not to use.
    """
    if not callable(fn):
        raise TypeError(f"jax_ops.optimize: fn must be callable; got {type(fn).__name__}")
    _check_policy("jax_ops.optimize", policy)
    P.resolve(patterns, exclude)  # bad names fail now, not at the first call
    cache: dict = {}

    @functools.wraps(fn)
    def optimized(*args, **kwargs):
        flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        key = (in_tree, _signature(flat))
        entry = cache.get(key)
        if entry is None:
            graph, plan, out_tree, closed, _ = _analyse(fn, args, kwargs, policy, patterns, exclude)
            entry = (graph, plan, out_tree)
            # Constants that are tracers of an outer transformation belong to this call only.
            if not any(isinstance(c, jax.core.Tracer) for c in closed.consts):
                cache[key] = entry
        graph, plan, out_tree = entry
        outs = evaluate(graph, plan, flat)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    optimized.rewrites = lambda *a, **k: rewrites(fn, *a, policy=policy, patterns=patterns,
                                                 exclude=exclude, **k)
    return optimized
