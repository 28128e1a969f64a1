"""Op declarations: the one small framework that turns a declaration into JAX primitives.

A declaration (one per op family, in `jax_ops/ops/<op>.py`) states:

* its stages — `Stage`: one primitive each (a forward, a backward), with the operand
  and result names (a trailing "?" marks one that may be absent: absent operands are
  not bound and absent results are not produced, no placeholder arrays), the abstract
  evaluation (which also validates), the jnp reference (float32 math; the "xla"
  implementation and the source of the second-order derivatives), the batching rule
  and the sharding roles;
* the `Op`: which stage outputs are differentiable, the residuals the forward keeps,
  the backward (cotangents of the outputs -> cotangents of the inputs, binding the
  backward stage), the implementations (`ffi`, Pallas functions, configs, support
  predicates), the user-registration adapter and the benchmark specs.

From it the framework makes the primitives with abstract eval, eager impl, batching,
a lowering per platform through the automatic choice (`dispatch.choose`), the
registry entries, the sharding rules, and every kind of differentiation:

* forward mode: the forward stage's JVP rule runs the forward kernel (with the
  residual-writing params, `Op.train`) and a *tangent* primitive that is linear in the
  input tangents. Its evaluation is jnp (the transpose of the jnp backward);
* reverse mode (`grad`, `vjp`, `jacrev`): JAX transposes the tangent primitive, and its
  transpose rule is `Op.backward`, i.e. our backward kernel; nothing else runs;
* higher order: the tangent primitive and the backward stage differentiate through
  their jnp references (`jax.jvp`), so `hessian`, grad-of-grad and jvp-of-grad work.

Under `vmap` the tangent primitive records, per vmap level, which operands carry the
level's axis (`levels`); its transpose maps the backward over the same levels, where
the backward stage's batching rule folds them into rows (one kernel launch).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_ops import _extension
from jax_ops.core import dispatch, registry
from jax_ops.core import sharding as _sharding

LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

from jax_ops.core.validate import F32


def default_platform() -> str:
    """The jax lowering platform of the default backend ("gpu" -> "cuda")."""
    backend = jax.default_backend()
    return {"gpu": "cuda"}.get(backend, backend)


# ------------------------------------------------------ present / absent ---

def _names(spec: Sequence[str]) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """("x", "scale?") -> (("x", "scale"), (False, True)): names and which are optional."""
    return tuple(s.rstrip("?") for s in spec), tuple(s.endswith("?") for s in spec)


def _fill(values: Sequence, present: Sequence[bool]) -> list:
    """The present values placed at their positions, None elsewhere."""
    it = iter(values)
    return [next(it) if p else None for p in present]


def _present_only(values: Sequence) -> list:
    return [v for v in values if v is not None]


# --------------------------------------------------------- reference mode ---

_REFERENCE = contextvars.ContextVar("jax_ops_reference", default=False)


@contextlib.contextmanager
def reference_mode():
    """Inside, Stage.call runs the stage's jnp reference instead of binding it (how the
    framework derives jnp tangents from an op's backward)."""
    token = _REFERENCE.set(True)
    try:
        yield
    finally:
        _REFERENCE.reset(token)


# ------------------------------------------------------------ shard_map ---

def _with_vma(abstract_eval, *avals, **params):
    """abstract_eval's results, varying over the manual mesh axes (shard_map) any
    operand varies over: per-device results of per-device data."""
    outs = abstract_eval(*avals, **params)
    vma = frozenset().union(*(a.mat.varying for a in avals if hasattr(a, "mat")))
    if not vma:
        return outs
    from jax._src import core as _core  # no public way to re-type an aval's varying axes
    return type(outs)(
        o.update(sharding=_core.get_cur_mesh_sharding() if o.sharding.mesh.empty else o.sharding,
                 manual_axis_type=o.mat.update(varying=vma)) for o in outs)


def match_vma(*arrays):
    """The arrays, each made varying over every manual mesh axis (shard_map) that any of
    them varies over (jax.lax.pcast to="varying"; its transpose psums the gradient of a
    replicated parameter). None stays None; identity outside shard_map. The public
    functions call it on their differentiable inputs, so per-device gradients match
    their inputs' types."""
    def vma(a):
        aval = jax.typeof(a) if a is not None else None
        return getattr(getattr(aval, "mat", None), "varying", frozenset())
    every = frozenset().union(*(vma(a) for a in arrays))
    if not every:
        return arrays
    return tuple(a if a is None or not (every - vma(a)) else
                 jax.lax.pcast(a, tuple(sorted(every - vma(a))), to="varying") for a in arrays)


# ----------------------------------------------------------------- stages ---

@dataclasses.dataclass(frozen=True)
class Call:
    """What an implementation's stage function learns about the call it lowers."""
    platform: str                 # "cpu", "cuda", ...
    config: dict | None           # the tunable config chosen (autotune, defaults)
    out_avals: tuple              # the stage's result avals, None where absent

    @property
    def interpret(self) -> bool:
        """Pallas kernels compile for CUDA GPUs and run interpreted elsewhere."""
        return self.platform != "cuda"


#: primitive -> its Stage; explain, autotune and the graph layer read it
PRIMITIVES: dict[Primitive, "Stage"] = {}


class Stage:
    """One primitive of an op (see the module docstring).

    operands/results: names, "name?" for optional ones.
    abstract(*operand avals or None, **params) -> result avals (None where absent);
      validates, raising the errors users see for primitive-level misuse.
    reference(*operands or None, **params) -> results (None where absent): jnp.
    batch(stage, args, dims, **params) -> (results, dims), args/results with None where
      absent; default: the vmapped reference.
    roles: {operand or result name: sharding role} (core/sharding.py); with `local`,
      `needs_local`, `policy`, `axis`: the partitioning rules. None: not partitioned.
      local(layout, mesh, *operands or None, **params) -> results (None where absent);
      it also gets `implementation`, for a local that binds a stage (BatchNorm's kernel
      pass with the global statistics).
    variant(params): a flavour the measured tables time separately ("stats", "mask").
    query_shape(x's shape, params): the (rows..., cols) shape the dispatcher sees.
    """

    def __init__(self, name: str, kind: str, operands: Sequence[str], results: Sequence[str], *,
                 op_of: Callable[[dict], str], abstract: Callable, reference: Callable,
                 batch: Callable | None = None, roles: dict[str, str] | None = None,
                 local: Callable | None = None, needs_local: Callable | None = None,
                 policy: Callable | None = None, axis: Callable[[dict], int] = lambda p: -1,
                 variant: Callable[[dict], str] = lambda p: "",
                 query_shape: Callable[[tuple, dict], tuple] = lambda shape, p: shape):
        assert kind in registry.STAGES, kind
        self.name, self.kind = name, kind
        self.operands, self.optional = _names(operands)
        self.results, self.optional_results = _names(results)
        self.op_of, self.abstract, self.reference = op_of, abstract, reference
        self.batch_rule = batch
        self.roles, self.local, self.needs_local, self.policy, self.axis = (
            roles, local, needs_local, policy, axis)
        self.variant, self.query_shape = variant, query_shape
        self.prim = self._define()

    # -- binding --------------------------------------------------------------
    def call(self, *operands, **params) -> tuple:
        """Binds the stage (operands and results with None where absent); in
        reference_mode() it evaluates the jnp reference instead."""
        if len(operands) != len(self.operands):
            raise TypeError(f"jax_ops {self.name}: expected operands {self.operands}; "
                            f"got {len(operands)}")
        if _REFERENCE.get():
            params = {k: v for k, v in params.items() if k != "implementation"}
            return tuple(self.reference(*operands, **params))
        present = tuple(o is not None for o in operands)
        for name, opt, p in zip(self.operands, self.optional, present):
            if not p and not opt:
                raise TypeError(f"jax_ops {self.name}: operand {name!r} is required")
        outs = self.prim.bind(*_present_only(operands), present=present, **params)
        avals = self.result_avals([jax.typeof(o) for o in _present_only(operands)], present, params)
        return tuple(_fill(outs, [a is not None for a in avals]))

    def result_avals(self, avals_in: Sequence, present: Sequence[bool], params: dict) -> list:
        params = {k: v for k, v in params.items() if k != "implementation"}
        return list(self.abstract(*_fill(avals_in, present), **params))

    # -- the primitive --------------------------------------------------------
    def _define(self) -> Primitive:
        prim = Primitive(f"jax_ops_{self.name}")
        prim.multiple_results = True
        prim.def_impl(partial(jax._src.dispatch.apply_primitive, prim))

        def abstract_eval(*avals, present, **params):
            return [a for a in self.result_avals(avals, present, params) if a is not None]
        prim.def_abstract_eval(partial(_with_vma, abstract_eval))
        PRIMITIVES[prim] = self
        for platform in LOWERING_PLATFORMS:
            mlir.register_lowering(prim, partial(self._lower, platform=platform), platform=platform)
        batching.primitive_batchers[prim] = self._batch
        ad.primitive_jvps[prim] = self._reference_jvp  # the forward's is replaced by Op
        if self.roles is not None:  # the partitioner needs the device assignment at lowering
            jax._src.dispatch.prim_requires_devices_during_lowering.add(prim)
        return prim

    def _lower(self, ctx, *args, platform, implementation, present, **params):
        out_present = [a is not None for a in self.result_avals(ctx.avals_in, present, params)]
        if self.roles is not None and _sharding.spans_devices(ctx):
            out = _sharding.lower_partitioned(self.prim, self._rules(present, out_present), ctx, args,
                                              dict(params, implementation=implementation,
                                                   present=present))
            if out is not None:
                return out
        q = query(self.prim, ctx.avals_in, dict(params, present=present), platform)
        d = dispatch.choose(q, implementation)
        fn = registry.get(q.op, d.implementation).lower[self.kind]
        x = ctx.avals_in[0]
        if all(isinstance(n, int) for n in x.shape) and math.prod(x.shape) == 0:
            fn = reference_impl(self)  # nothing for a kernel to do
        call = Call(platform, d.config, tuple(self.result_avals(ctx.avals_in, present, params)))

        def body(*present_args):
            outs = fn(call, *_fill(present_args, present), **params)
            got = [o is not None for o in outs]
            if got != out_present:
                raise AssertionError(f"jax_ops {self.name}: implementation {d.implementation!r} "
                                     f"returned results {got}, expected {out_present}")
            return _present_only(outs)
        with warnings.catch_warnings():  # the Pallas Triton back end's deprecation notice
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            return mlir.lower_fun(body, multiple_results=True)(ctx, *args)

    def _rules(self, present, out_present) -> _sharding.Rules:
        roles_in = tuple(self.roles[n] for n, p in zip(self.operands, present) if p)
        roles_out = tuple(self.roles[n] for n, p in zip(self.results, out_present) if p)

        def per_device(layout, mesh, *shards, present, **params):
            return _present_only(self.local(layout, mesh, *_fill(shards, present), **params))
        return _sharding.Rules(ins=lambda p: roles_in, outs=lambda p: roles_out, axis=self.axis,
                               policy=self.policy, needs_local=self.needs_local,
                               local=per_device if self.local is not None else None)

    def _batch(self, args, dims, *, present, **params):
        full_args, full_dims = _fill(args, present), _fill(dims, present)
        rule = self.batch_rule or vmap_reference
        outs, out_dims = rule(self, full_args, full_dims, **params)
        keep = [o is not None for o in outs]
        return _present_only(outs), [d for d, k in zip(out_dims, keep) if k]

    def _reference_jvp(self, primals, tangents, *, present, **params):
        """The stage's outputs by its kernel, their tangents through the jnp reference:
        the second-order path of every stage."""
        outs = self.prim.bind(*primals, present=present, **params)
        return outs, self.reference_tangents(primals, tangents, present, params)

    def reference_tangents(self, primals, tangents, present, params) -> list:
        """Tangents of the (present) results by jax.jvp of the jnp reference (its primal
        results are dead code, dropped under jit)."""
        params = {k: v for k, v in params.items() if k != "implementation"}

        def f(*ops):
            return _present_only(self.reference(*_fill(ops, present), **params))
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        return jax.jvp(f, tuple(primals), tuple(tangents))[1]


def vmap_reference(stage: Stage, args, dims, **params):
    """Batching by the vmapped jnp reference (where rows cannot be folded)."""
    params = {k: v for k, v in params.items() if k != "implementation"}
    present = [a is not None for a in args]

    def f(*ops):
        return stage.reference(*_fill(ops, present), **params)
    outs = jax.vmap(f, in_axes=tuple(d for d, p in zip(dims, present) if p))(*_present_only(args))
    return outs, [None if o is None else 0 for o in outs]


def local_implementation(stage: Stage, mesh, *operands, **params) -> str:
    """The implementation dispatch picks for `stage` called on these operands (None where
    absent) on the platform of `mesh`'s devices: how a `local` (per-device code, given
    the local shards) learns whether `implementation` (a name, or None: automatic)
    resolves to kernels or to "xla" for this call."""
    platform = mesh.devices.flat[0].platform
    platform = {"gpu": "cuda"}.get(platform, platform)
    present = tuple(o is not None for o in operands)
    avals = [jax.typeof(o) for o in operands if o is not None]
    params = dict(params)
    implementation = params.pop("implementation", None)
    q = query(stage.prim, avals, dict(params, present=present), platform)
    return dispatch.choose(q, implementation).implementation


def local_uses_kernels(mesh, *calls) -> bool:
    """Whether a `local` runs our per-device stage kernels rather than jnp: any of
    `calls`, (stage, operands, params) as for local_implementation, resolving to other
    than "xla". A local asks about its one-device stage (the implementation the user
    named) and its first per-device stage (on a GPU the automatic choice takes its
    kernels even where one device's table prefers XLA's fusion for the one-device
    stage: the jnp path on shards needs more collectives in sequence)."""
    return any(local_implementation(stage, mesh, *operands, **params) != "xla"
               for stage, operands, params in calls)


def query(prim: Primitive, avals, params: dict, platform: str) -> registry.Query:
    """The dispatch query of one call of `prim` (operand 0 has x's shape and dtype)."""
    stage = PRIMITIVES[prim]
    x = avals[0]
    return registry.Query(stage.op_of(params), stage.kind, platform,
                          tuple(stage.query_shape(tuple(x.shape), params)), x.dtype.name,
                          dispatch.device_kind(platform), stage.variant(params))


# -------------------------------------------------------- implementations ---
# An implementation's stage function: fn(call: Call, *operands or None, **params) ->
# results or None (absent results None), JAX-traceable; lowered by mlir.lower_fun.

def reference_impl(stage: Stage) -> Callable:
    def fn(call, *operands, **params):
        return stage.reference(*operands, **params)
    return fn


def ffi(target: str, attrs: Callable[[dict], dict] = lambda p: {}, *, flat_operands=(),
        flat_results=(), scratch: Callable | None = None,
        aliases: dict[int, int] | None = None) -> Callable:
    """A stage function calling XLA FFI target `target`; attrs(params) -> attributes.

    The handlers have a fixed arity: an absent operand is passed, and an absent result
    requested, as a zero-element float32 buffer (the handlers' ABI; the primitives have
    no such placeholders). flat_operands/flat_results: indices of arrays the handler
    takes 1-D (a bitcast). scratch(call, operands, params) -> a ShapedArray: a trailing
    workspace result the kernels use and XLA frees right after. aliases: {operand index:
    result index} (jax.ffi.ffi_call's input_output_aliases): the result is written in the
    operand's buffer (in place; XLA copies the operand first only where it is still
    needed elsewhere).
    """
    def fn(call, *operands, **params):
        args = [jnp.zeros((0,), F32) if o is None else
                (o.reshape(-1) if i in flat_operands else o) for i, o in enumerate(operands)]
        outs = [jax.ShapeDtypeStruct((0,), F32) if a is None else
                jax.ShapeDtypeStruct((math.prod(a.shape),) if i in flat_results else a.shape, a.dtype)
                for i, a in enumerate(call.out_avals)]
        if scratch is not None:
            s = scratch(call, operands, params)
            outs.append(jax.ShapeDtypeStruct(s.shape, s.dtype))
        res = jax.ffi.ffi_call(target, outs, input_output_aliases=aliases)(*args, **attrs(params))
        return tuple(None if a is None else r.reshape(a.shape)
                     for r, a in zip(res, call.out_avals))
    fn.ffi_target = target
    return fn


def ffi_supports(target: str) -> Callable[[registry.Query], tuple[bool, str]]:
    def supports(q):
        if _extension.has_target(q.platform, target):
            return True, ""
        why = f"no {target} kernel is registered for platform {q.platform!r}"
        if _extension.IMPORT_ERROR is not None:
            why += f" (the jax_ops._ffi extension failed to import: {_extension.IMPORT_ERROR})"
        return False, why
    return supports


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


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of an op: {stage kind: stage function} and where it applies
    (registry.Implementation's fields)."""
    stages: dict[str, Callable]
    supports: Callable = lambda q: True
    configs: Callable | None = None
    automatic: Callable | None = None
    description: str = ""
    tile_cols: Callable | None = None
    load_words: tuple[int, ...] | None = None


# -------------------------------------------------------------------- ops ---

class Op:
    """An op family's declaration (see the module docstring).

    names: the op names the family serves (each has its own registry entry and
      measured tables); fwd.op_of(params) tells which.
    outputs(params): names of the forward's results the public function returns, with
      tangents (the others are internal: masks, statistics).
    train(params): the params of the forward that also writes the residuals.
    residuals(operands, results, params): what the backward keeps (arrays or None);
      operands/results: dicts by name (None where absent).
    backward(residuals, cts, wanted, params, in_avals): {input name: cotangent} for the
      input names in `wanted`; cts: {output name: cotangent or None (zero)}; in_avals:
      {operand name: aval or None}. It binds the backward stage (Stage.call), so reverse
      mode runs the backward kernel; in reference_mode() the same code is jnp.
    impls: {name: Impl}; "xla" (the references) is added.
    user_adapter(fn, backward, tunable) -> {stage kind: stage function}: turns a user
      kernel with the op's documented signature into stage functions.
    bench: () -> {benchmark name: BenchSpec} (core/benchspec.py): the benchmark's inputs,
      implementations, baselines and minimum bytes; called when the benchmark asks.
    patterns: () -> [Pattern] (core/pattern.py): the computations jax_ops.optimize
      rewrites into this op's public functions; called when jax_ops.fx first needs them.
    stages: further stages of the op (kinds other than fwd/bwd, one of each kind): the
      per-device stages its sharding rules bind (`Stage.local`), e.g. per-row partial
      statistics and the pass that finishes with the combined ones. "xla" runs their
      references; other implementations list them in their Impl where they have kernels
      (where one has not, dispatch chooses automatically for that stage).
    """

    def __init__(self, names: Sequence[str], fwd: Stage, bwd: Stage, *,
                 outputs: Callable[[dict], tuple[str, ...]], residuals: Callable,
                 backward: Callable, train: Callable[[dict], dict] = lambda p: p,
                 impls: dict[str, Impl] | None = None, user_adapter: Callable | None = None,
                 bench: Callable[[], dict] | None = None,
                 patterns: Callable[[], list] | None = None, stages: Sequence[Stage] = ()):
        self.names, self.fwd, self.bwd = tuple(names), fwd, bwd
        self.stages = tuple(stages)
        kinds = [fwd.kind, bwd.kind] + [st.kind for st in self.stages]
        assert len(set(kinds)) == len(kinds), f"one stage of each kind: {kinds}"
        self.outputs, self.residuals, self.backward, self.train = outputs, residuals, backward, train
        self.user_adapter = user_adapter
        self.bench = bench or dict
        self.patterns = patterns or list
        self.tangent_prim = self._define_tangent()
        ad.primitive_jvps[fwd.prim] = self._fwd_jvp
        impls = {"xla": Impl({"fwd": reference_impl(fwd), "bwd": reference_impl(bwd),
                              **{st.kind: reference_impl(st) for st in self.stages}},
                             description="plain jax.numpy, fused by XLA"), **(impls or {})}
        for op in self.names:
            for name, impl in impls.items():
                registry.add(registry.Implementation(
                    op, name, impl.stages, impl.supports, configs=impl.configs,
                    automatic=impl.automatic, description=impl.description, tile_cols=impl.tile_cols,
                    load_words=impl.load_words))
            if user_adapter is not None:
                registry.define_user_adapter(op, user_adapter)
        OPS[self.fwd.name] = self

    # -- forward mode -----------------------------------------------------------
    def _fwd_jvp(self, primals, tangents, *, present, **params):
        fwd = self.fwd
        ops = dict(zip(fwd.operands, _fill(primals, present)))
        tans = dict(zip(fwd.operands, _fill(tangents, present)))
        wanted = tuple(n for n in fwd.operands if ops[n] is not None and tans[n] is not None
                       and type(tans[n]) is not ad.Zero
                       and jnp.issubdtype(ops[n].dtype, jnp.inexact))
        avals = tuple(fwd.result_avals([jax.typeof(p) for p in primals], present, params))
        names = [n for n, a in zip(fwd.results, avals) if a is not None]
        train = self.train(params)
        outs = dict(zip(fwd.results, fwd.call(*ops.values(), **train)))
        primal_out = [outs[n] for n in names]
        public = tuple(n for n in self.outputs(params) if n in names)
        tangent = {}
        if wanted and public:
            res = tuple(self.residuals(ops, outs, params))
            in_avals = tuple(None if o is None else jax.typeof(o) for o in ops.values())
            out_types = tuple(jax.typeof(outs[n]) for n in public)
            clean = {k: v for k, v in params.items() if k != "implementation"}
            t = self.tangent_prim.bind(
                *_present_only(res), *(tans[n] for n in wanted), res_present=tuple(r is not None for r in res),
                wanted=wanted, public=public, out_types=out_types, in_avals=in_avals, levels=(),
                implementation=params.get("implementation"), op_params=tuple(sorted(clean.items())))
            tangent = dict(zip(public, t))
        rest = [n for n in names if n not in tangent and jnp.issubdtype(outs[n].dtype, jnp.inexact)]
        if rest and wanted:  # internal outputs (statistics): jnp, dead code unless differentiated
            ref_t = dict(zip(names, fwd.reference_tangents(primals, tangents, present, params)))
            tangent.update({n: ref_t[n] for n in rest})
        tangent_out = [tangent[n] if n in tangent else ad.Zero(jax.typeof(outs[n]).to_tangent_aval())
                       for n in names]
        return primal_out, tangent_out

    # -- the tangent primitive ----------------------------------------------------
    def _backward(self, res, cts, *, res_present, wanted, public, in_avals, implementation, op_params):
        params = dict(op_params, implementation=implementation)
        grads = self.backward(tuple(_fill(res, res_present)), dict(zip(public, cts)), wanted, params,
                              dict(zip(self.fwd.operands, in_avals)))
        return tuple(grads[n] for n in wanted)

    def _tangent(self, *operands, res_present, wanted, public, out_types, in_avals, levels,
                 implementation, op_params):
        """The tangent map in jnp: the transpose of the jnp backward."""
        n = sum(res_present)

        def one(*ops):
            res, tans = ops[:n], ops[n:]

            def lin(*cts):
                with reference_mode():
                    return self._backward(res, cts, res_present=res_present, wanted=wanted,
                                          public=public, in_avals=in_avals,
                                          implementation=implementation, op_params=op_params)
            return jax.linear_transpose(lin, *(jax.ShapeDtypeStruct(t.shape, t.dtype) for t in out_types))(tuple(tans))
        return list(_map_levels(one, levels, operands))

    def _define_tangent(self) -> Primitive:
        prim = Primitive(f"jax_ops_{self.fwd.name}_tangent")
        prim.multiple_results = True
        prim.def_impl(lambda *ops, **params: self._tangent(*ops, **params))

        def abstract(*avals, out_types, levels, **params):
            sizes = _level_sizes(avals, levels)
            return [jax.core.ShapedArray(sizes + tuple(t.shape), t.dtype) for t in out_types]
        prim.def_abstract_eval(partial(_with_vma, abstract))
        mlir.register_lowering(prim, mlir.lower_fun(lambda *ops, **params: self._tangent(*ops, **params),
                                                    multiple_results=True))

        def transpose(cts, *operands, res_present, wanted, levels, **params):
            n = sum(res_present)
            res = operands[:n]
            if any(ad.is_undefined_primal(r) for r in res):
                raise NotImplementedError(f"jax_ops {self.fwd.name}: the tangent map is linear in "
                                          "the tangents only")
            cts = [None if type(c) is ad.Zero else c for c in cts]
            tangent_avals = [t.aval for t in operands[n:]]
            if all(c is None for c in cts):
                return [None] * n + [ad.Zero(a) for a in tangent_avals]

            def one(*ops):
                return self._backward(ops[:n], ops[n:], res_present=res_present, wanted=wanted,
                                      **{k: params[k] for k in ("public", "in_avals",
                                                                 "implementation", "op_params")})
            cts_levels = tuple(flags[:n] + (True,) * len(cts) for flags in levels)
            grads = _map_levels(one, cts_levels, list(res) + cts)
            out = []
            for i, g in enumerate(grads):  # sum over the levels this tangent did not carry
                for depth in reversed(range(len(levels))):
                    if not levels[depth][n + i]:
                        g = jnp.sum(g, axis=sum(f[n + i] for f in levels[:depth]))
                out.append(g.astype(tangent_avals[i].dtype))
            return [None] * n + out
        ad.primitive_transposes[prim] = transpose

        def batch(args, dims, *, levels, **params):
            args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
            levels = (tuple(d is not None for d in dims),) + levels
            outs = prim.bind(*args, levels=levels, **params)
            return outs, [0] * len(outs)
        batching.primitive_batchers[prim] = batch

        def jvp(primals, tangents, **params):
            tangents = [ad.instantiate_zeros(t) for t in tangents]
            return jax.jvp(lambda *ops: self._tangent(*ops, **params), tuple(primals), tuple(tangents))
        ad.primitive_jvps[prim] = jvp
        return prim


def _level_sizes(avals, levels) -> tuple:
    """The sizes of the vmap levels (outermost first), read from an operand carrying each."""
    sizes = []
    for depth, flags in enumerate(levels):
        i = flags.index(True)
        sizes.append(avals[i].shape[sum(1 for g in levels[:depth] if g[i])])
    return tuple(sizes)


def _map_levels(fn: Callable, levels: tuple, operands: Sequence) -> Any:
    """fn mapped over the vmap levels (outermost first): at each, the operands whose
    flag is set carry the level as their leading axis."""
    if not levels:
        return fn(*operands)
    flags = levels[0]
    axes = tuple(0 if f else None for f in flags)
    return jax.vmap(lambda *ops: _map_levels(fn, levels[1:], ops), in_axes=axes)(*operands)


#: forward stage name -> Op
OPS: dict[str, Op] = {}
