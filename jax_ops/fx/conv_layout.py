"""Shared by the conv rewrites (conv_space_to_depth, pointwise_conv, conv_batch_norm's
fold): a conv equation's params, and its operands in the canonical layouts x (N,
*spatial, C), w (*spatial, C, O), y (N, *spatial, O) and back."""
from __future__ import annotations

import jax
import jax.numpy as jnp

#: the equation whose params (strides, padding, dimension numbers...) the formulations
#: and the replacements take from the graph
CONV = "conv_general_dilated"


def conv_params(params, strides=(1, 1), padding=((0, 0), (0, 0))):
    """The graph's conv params, or a 2-D NHWC/HWIO conv with these strides and padding
    for the templates (only the structure matters there)."""
    if params is None:
        return dict(window_strides=tuple(strides), padding=tuple(padding), lhs_dilation=(1, 1),
                    rhs_dilation=(1, 1),
                    dimension_numbers=jax.lax.conv_dimension_numbers(
                        (1, 1, 1, 1), (1, 1, 1, 1), ("NHWC", "HWIO", "NHWC")),
                    feature_group_count=1, batch_group_count=1, precision=None,
                    preferred_element_type=None)
    return dict(params)


def conv(x, w, params):
    """lax.conv_general_dilated as flax.linen.Conv / haiku / equinox call it."""
    return jax.lax.conv_general_dilated(x, w, **conv_params(params))


def plain(x_shape, w_shape, params) -> str | None:
    """Why this conv is not a plain one the rewrites regroup (None: it is): no dilation,
    no groups, matching input features."""
    p = conv_params(params)
    dn = p["dimension_numbers"]
    if any(d != 1 for d in (*p["lhs_dilation"], *p["rhs_dilation"])):
        return "dilated convolution"
    if p["feature_group_count"] != 1 or p["batch_group_count"] != 1:
        return "grouped convolution"
    if w_shape[dn.rhs_spec[1]] != x_shape[dn.lhs_spec[1]]:
        return "input features differ from the kernel's"
    return None


def in_features(x_shape, params) -> int:
    return x_shape[conv_params(params)["dimension_numbers"].lhs_spec[1]]


def kernel_size(w_shape, params) -> tuple:
    return tuple(w_shape[d] for d in conv_params(params)["dimension_numbers"].rhs_spec[2:])


def canonical(x, w, dn):
    """x as (N, *spatial, C) and w as (*spatial, C, O) (transposes; none for NHWC/HWIO)."""
    return (jnp.transpose(x, (dn.lhs_spec[0], *dn.lhs_spec[2:], dn.lhs_spec[1])),
            jnp.transpose(w, (*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0])))


def from_canonical(y, dn):
    """y (N, *spatial, O) in the conv's output layout (out_spec: batch dim, feature dim,
    spatial dims)."""
    nsp = y.ndim - 2
    axis_of = {dn.out_spec[0]: 0, dn.out_spec[1]: nsp + 1}
    axis_of.update({d: 1 + i for i, d in enumerate(dn.out_spec[2:])})
    return jnp.transpose(y, [axis_of[a] for a in range(nsp + 2)])


def conv_formulation(x, w, *, conv_general_dilated):
    """A lone conv_general_dilated, the formulation of the conv rewrites (its params
    are the matched equation's)."""
    return conv(x, w, conv_general_dilated)


def floating_inputs(avals) -> str | None:
    """The conv rewrites' `accepts`: x and w of floating dtypes."""
    for name, a in zip(("x", "w"), avals):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            return f"{name} is {a.dtype}; the rewrite takes floating inputs"
    return None


def on_gpu_only(target: str):
    """A `decide` for a rewrite measured faster on GPU only (`target`: what it speeds
    up there); elsewhere the original stays."""
    def decide(avals, params):
        if jax.default_backend() != "gpu":
            return f"not faster on {jax.default_backend()}: the rewrite targets {target}"
        return None
    return decide
