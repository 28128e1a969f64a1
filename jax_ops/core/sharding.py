"""Partitioning of jax_ops primitives over devices (jit + NamedSharding, Shardy).

A custom call is opaque to XLA's partitioner: without rules XLA would gather every
operand onto every device. Each primitive describes its operands and results by
*role* (below); from the roles this module derives

  * a Shardy sharding rule (einsum-like factors) so sharding propagates through the op,
  * a partition callback (jax.experimental.custom_partitioning) that picks the
    per-device shardings and builds the per-device computation: by default the same
    primitive bound on the local shards (so the dispatcher picks the implementation for
    the local shape) plus a psum of the per-column sums over the row axes; an op gives
    its own `local` function where a sharded axis needs cross-device statistics
    (LayerNorm/softmax with the normalized axis sharded, BatchNorm with rows sharded).

The wrapping happens at lowering time (define_primitive's lowering calls
`lower_partitioned` when the computation spans several devices that are not all
manual), so jaxprs keep our primitives: vmap, autodiff, op_calls/explain/autotune are
unchanged, and single-device or shard_map (fully manual) lowerings are direct.

Roles:
  "x"       activation: x's shape (the reduced axis `axis` plus row axes)
  "rows"    per-row values: x's shape without the reduced axis (norm statistics)
  "cols"    per-column vector (cols,) (scale, bias, BatchNorm channel statistics)
  "colsum"  (cols,) result that is a sum over rows: psum over the row axes
  "mask"    the 1-bit mask of relu/BatchNorm: x's shape with the last axis in uint32
            words (x.shape[:-1] + (cols // 32,)), or flat (ceil(n/32),) (core/bitmask.py)
  "bmask"   softmax mask operand: x's rank, size-1 (broadcast) axes replicated
  "none"    replicated (a "none" result is zeros)
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax._src import sharding_impls
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_ops.core.bitmask import WORD, is_rowwise as mask_is_rowwise


@dataclasses.dataclass(frozen=True)
class Rules:
    """How one primitive partitions.

    ins(params) / outs(params): roles of the operands / results (operand 0 is x).
    axis(params): the reduced axis of x, negative (counted from the end).
    policy(layout, params) -> layout: restricts the shardings the op takes (e.g.
      BatchNorm's channel axis may be sharded, relu's last axis only in whole words);
      default: any.
    local(layout, *shards, **params) -> results: the per-device computation when the
      default (bind on the shards, psum "colsum" results) is wrong for `layout`, else
      None (the op returns None from `needs_local(layout, params)`).
    """
    ins: Callable[[dict], tuple[str, ...]]
    outs: Callable[[dict], tuple[str, ...]]
    axis: Callable[[dict], int] = lambda params: -1
    policy: Callable | None = None
    needs_local: Callable | None = None
    local: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """The sharding chosen for one call: mesh axes of each of x's dims."""
    dims: tuple[tuple[str, ...], ...]
    axis: int  # the reduced axis, non-negative
    shape: tuple  # x's global shape

    @property
    def col_axes(self) -> tuple[str, ...]:
        return self.dims[self.axis]

    @property
    def row_axes(self) -> tuple[str, ...]:
        return tuple(a for i, d in enumerate(self.dims) if i != self.axis for a in d)

    def replace(self, **kw) -> "Layout":
        return dataclasses.replace(self, **kw)


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


# ------------------------------------------------------------- the rule ---

def _sdy_rule(roles_in, roles_out, in_avals, out_avals, axis, rowwise_mask):
    """Einsum-like Shardy rule and factor sizes for one call."""
    x = in_avals[0]
    nd = len(x.shape)
    axis = axis % nd
    names = [f"d{i}" for i in range(nd)]
    sizes: dict[str, int] = {}
    has_mask = "mask" in roles_in or "mask" in roles_out
    x_names = list(names)
    if has_mask and rowwise_mask:  # x's last axis = (words, 32 bits)
        x_names[-1] = f"(w {'t'})"
        sizes["t"] = WORD  # w is a whole dim of the mask
    used: list[str] = []

    def fresh_names():
        for i in range(1000):
            used.append(f"u{i}")
            yield used[-1]
    fresh = fresh_names()

    def spec(role, aval):
        if role == "none" or aval.shape == (0,):
            return " ".join(next(fresh) for _ in aval.shape)
        if role == "x":
            return " ".join(x_names)
        if role == "rows":
            return " ".join(n for i, n in enumerate(names) if i != axis)
        if role in ("cols", "colsum"):
            return names[axis] if not (has_mask and rowwise_mask and axis == nd - 1) else x_names[-1]
        if role == "mask":
            if rowwise_mask:
                return " ".join(names[:-1] + ["w"])
            return next(fresh)
        if role == "bmask":
            out = []
            for i, n in enumerate(aval.shape):
                if n == x.shape[i]:
                    out.append(names[i])
                else:
                    out.append(next(fresh))
            return " ".join(out)
        raise ValueError(role)

    lhs = ", ".join(spec(r, a) for r, a in zip(roles_in, in_avals))
    rhs = ", ".join(spec(r, a) for r, a in zip(roles_out, out_avals))
    # fresh factors (placeholders, flat masks, broadcast axes) are never sharded
    need_rep = tuple(used)
    return f"{lhs} -> {rhs}", sizes, need_rep


# ------------------------------------------------------ the partitioning ---

def _spec_for(role, shape, layout: Layout, rowwise_mask: bool):
    if role == "none" or shape == (0,):
        return P()
    if role == "x":
        return P(*layout.dims)
    if role == "rows":
        return P(*(d for i, d in enumerate(layout.dims) if i != layout.axis))
    if role == "cols":
        return P(layout.col_axes)
    if role == "colsum":
        return P(layout.col_axes)
    if role == "mask":
        return P(*layout.dims) if rowwise_mask else P()
    if role == "bmask":
        return P(*(d if shape[i] == layout.shape[i] else () for i, d in enumerate(layout.dims)))
    raise ValueError(role)


def _divisible(layout: Layout, mesh) -> Layout:
    """Drops the sharding of any dim whose size the mesh axes do not divide."""
    dims = []
    for n, d in zip(layout.shape, layout.dims):
        k = math.prod(mesh.shape[a] for a in d)
        dims.append(d if k > 0 and n % k == 0 else ())
    return layout.replace(dims=tuple(dims))


def lower_partitioned(prim, rules: Rules, ctx, args, params):
    """The lowering of one call of `prim` on several devices: a custom_partitioning
    whose partition callback applies `rules`; None where there is nothing to split
    (x empty or 0-d: the caller lowers directly)."""
    in_avals, out_avals = list(ctx.avals_in), list(ctx.avals_out)
    roles_in, roles_out = rules.ins(params), rules.outs(params)
    x = in_avals[0]
    if not x.shape or not all(isinstance(d, int) for d in x.shape) or math.prod(x.shape) == 0:
        return None
    axis = rules.axis(params) % len(x.shape)
    rowwise_mask = mask_is_rowwise(x.shape)
    rule, sizes, need_rep = _sdy_rule(roles_in, roles_out, in_avals, out_avals, axis, rowwise_mask)

    def partition(mesh, arg_shapes, result_shape):
        spec = arg_shapes[0].sharding.spec
        dims = tuple(_axes(spec[i]) if i < len(spec) else () for i in range(len(x.shape)))
        layout = _divisible(Layout(dims, axis, tuple(x.shape)), mesh)
        if rules.policy is not None:
            layout = _divisible(rules.policy(layout, mesh, params), mesh)
        arg_sh = [NamedSharding(mesh, _spec_for(r, a.shape, layout, rowwise_mask))
                  for r, a in zip(roles_in, in_avals)]
        out_sh = [NamedSharding(mesh, _spec_for(r, a.shape, layout, rowwise_mask))
                  for r, a in zip(roles_out, out_avals)]
        custom = rules.needs_local is not None and rules.needs_local(layout, params)

        def lower_fn(*shards):
            if custom:
                outs = rules.local(layout, mesh, *shards, **params)
            else:
                outs = list(prim.bind(*shards, **params))
            res = []
            for role, o, aval in zip(roles_out, outs, out_avals):
                if role == "colsum" and layout.row_axes and aval.shape != (0,) and not custom:
                    o = jax.lax.psum(o, layout.row_axes)
                if role == "none":
                    o = jnp.zeros(aval.shape, aval.dtype)
                res.append(o)
            return tuple(res)

        return mesh, lower_fn, tuple(out_sh), tuple(arg_sh)

    def body(*a):
        return tuple(prim.bind(*a, **params))

    cp = custom_partitioning(body)
    cp.def_partition(partition=partition, sharding_rule=rule, need_replication_factors=need_rep,
                     **sizes)
    return mlir.lower_fun(lambda *a: cp(*a), multiple_results=True)(ctx, *args)


# ------------------------------------------ combining per-device partials ---
# For an op's `local`: per-row (or per-channel) partials of the devices that share a row
# are gathered (one all_gather of O(rows × devices) floats: a single collective, where a
# two-pass psum needs two in sequence) and merged on every device in device order, so
# every device gets the bitwise same, exact statistics whatever algorithm the collective
# uses.

def gather_parts(parts, axes) -> list:
    """[a gathered over the mesh axes `axes`, shape (devices,) + a.shape] for each array
    of `parts` (same shape and dtype): one all_gather of them stacked."""
    gathered = jax.lax.all_gather(jnp.stack(parts), axes)
    return [gathered[:, i] for i in range(len(parts))]


def ordered_sum(a):
    """Σ over a's leading (device) axis, in index order."""
    total = a[0]
    for i in range(1, a.shape[0]):
        total = total + a[i]
    return total


def merge_moment_parts(means, m2s, count: int):
    """Mean and M2 (Σ (x − mean)²) of the union of parts, from each part's mean and M2
    over `count` elements (the same count for every part: the shards of a divisible
    axis), stacked along the leading axis: Chan's merge in part order, exact."""
    total_mean = ordered_sum(means) / means.shape[0]
    return total_mean, ordered_sum(m2s + count * jnp.square(means - total_mean))


def merge_moments(mean, m2, axes, count: int):
    """merge_moment_parts of every device's part along the mesh axes `axes`."""
    return merge_moment_parts(*gather_parts([mean, m2], axes), count)


def spans_devices(ctx) -> bool:
    """Whether this lowering is of a computation over several devices that XLA's SPMD
    partitioner will split (not a single device, not fully manual shard_map code)."""
    ac = ctx.module_context.axis_context
    if isinstance(ac, sharding_impls.SPMDAxisContext):
        return set(ac.manual_axes) != set(ac.mesh.axis_names)
    if isinstance(ac, sharding_impls.ShardingContext):
        return ac.num_devices > 1
    return False
