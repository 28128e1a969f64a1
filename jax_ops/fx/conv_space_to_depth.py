"""conv_space_to_depth: a strided convolution with few input channels (an image model's
stem: ResNet's 7x7 stride-2 conv over 3 colour channels) computed as a stride-1
convolution over the space-to-depth input.

cuDNN's kernels for 3 input channels are far from its tensor-core speed: ResNet-50's
stem conv (64 x 224² x 3 -> 112² x 64, bf16) takes 386 µs forward and 234 µs for its
weight gradient on the H100, for 15 GFLOP and 120 MB. Regrouping each s x s block of
input pixels into s·s·C channels turns a k x k stride-s conv into a ceil(k/s) x ceil(k/s)
stride-1 conv over s·s·C channels (12 for RGB, padded with zero channels to a multiple
of 8 for the tensor cores); the kernel is regrouped the same way, its taps past k being
zeros:

    x'[n, b, c, (r, q, ch)] = x_padded[n, s·b + r, s·c + q, ch]
    w'[j, i, (r, q, ch), o] = w[s·j + r, s·i + q, ch, o]     (0 where s·j + r >= k)
    conv(x, w, stride s)[n, y, z, o] = conv(x', w', stride 1)[n, y, z, o]

The products are the original's plus products with zero weights, summed in another
order: equal up to rounding for finite inputs (an infinite or NaN input pixel can reach
outputs whose original window just misses it, through a zero weight). Gradients follow
by autodiff through the regrouping (both are reshapes, transposes and pads).
policy="auto" takes it on GPU only, for at most MAX_CHANNELS input channels (measured:
perf-notes, "Sixth session"); conv_batch_norm's fold regroups its stem conv the same way.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_ops.core.pattern import F32, BF16, Formulation, Pattern, sds
from jax_ops.fx.conv_layout import (CONV, canonical, conv_formulation, conv_params,
                                    floating_inputs, from_canonical, in_features, kernel_size,
                                    on_gpu_only, plain)

#: input channels at most: wider inputs already suit cuDNN's kernels
MAX_CHANNELS = 4
#: regrouped channels are padded to a multiple of this (tensor-core tiles)
CHANNEL_MULTIPLE = 8


def unsupported(x_shape, w_shape, params) -> str | None:
    """Why the regrouping does not apply to this conv (None: it does)."""
    why = plain(x_shape, w_shape, params)
    if why:
        return why
    strides = conv_params(params)["window_strides"]
    if len(strides) > 3:
        return f"{len(strides)} spatial dimensions (at most 3)"
    if all(s == 1 for s in strides):
        return "stride 1 (nothing to regroup)"
    if all(k == 1 for k in kernel_size(w_shape, params)):
        return "a 1x1 kernel (pointwise_conv's: regrouped, most weights would be zeros)"
    return None


def worthwhile(x_shape, w_shape, params) -> str | None:
    """Why the regrouped conv is not expected faster (None: it is): only narrow inputs."""
    c = in_features(x_shape, params)
    if c > MAX_CHANNELS:
        return f"{c} input channels (regrouped only up to {MAX_CHANNELS})"
    return None


def space_to_depth_conv(x, w, params):
    """conv_general_dilated(x, w, **params) as a stride-1 conv over the space-to-depth
    regrouped input and kernel (module doc); the result has the original's shape, dtype
    and layout."""
    p = conv_params(params)
    why = unsupported(x.shape, w.shape, p)
    if why:
        raise ValueError(f"conv_space_to_depth: {why}")
    dn = p["dimension_numbers"]
    strides, padding = tuple(p["window_strides"]), tuple(tuple(q) for q in p["padding"])
    nsp = len(strides)
    xc, wc = canonical(x, w, dn)
    n, spatial, c = xc.shape[0], xc.shape[1:-1], xc.shape[-1]
    ksize, o_feat = wc.shape[:-2], wc.shape[-1]
    out = [(h + lo + hi - k) // s + 1 for h, (lo, hi), k, s in zip(spatial, padding, ksize, strides)]
    taps = [-(-k // s) for k, s in zip(ksize, strides)]  # regrouped kernel size per dim
    blocks = [o + t - 1 for o, t in zip(out, taps)]       # regrouped input size per dim
    # pad (or crop: positions past the last window are never read) to whole blocks
    pads = [(0, 0, 0)] + [(lo, b * s - h - lo, 0) for h, (lo, _), b, s in
                          zip(spatial, padding, blocks, strides)] + [(0, 0, 0)]
    xp = jax.lax.pad(xc, jnp.zeros((), x.dtype), pads)
    split = [n] + [d for b, s in zip(blocks, strides) for d in (b, s)] + [c]
    # (N, b0, s0, b1, s1, ..., C) -> (N, b0, b1, ..., s0, s1, ..., C)
    perm = [0] + [1 + 2 * i for i in range(nsp)] + [2 + 2 * i for i in range(nsp)] + [2 * nsp + 1]
    depth = math.prod(strides) * c
    width = -(-depth // CHANNEL_MULTIPLE) * CHANNEL_MULTIPLE
    xs = jnp.transpose(xp.reshape(split), perm).reshape([n, *blocks, depth])
    wp = jax.lax.pad(wc, jnp.zeros((), w.dtype),
                     [(0, t * s - k, 0) for t, s, k in zip(taps, strides, ksize)] + [(0, 0, 0)] * 2)
    wsplit = [d for t, s in zip(taps, strides) for d in (t, s)] + [c, o_feat]
    wperm = [2 * i for i in range(nsp)] + [2 * i + 1 for i in range(nsp)] + [2 * nsp, 2 * nsp + 1]
    ws = jnp.transpose(wp.reshape(wsplit), wperm).reshape([*taps, depth, o_feat])
    if width != depth:  # zero channels: the same sums, in tensor-core-sized tiles
        xs = jax.lax.pad(xs, jnp.zeros((), x.dtype), [(0, 0, 0)] * (nsp + 1) + [(0, width - depth, 0)])
        ws = jax.lax.pad(ws, jnp.zeros((), w.dtype), [(0, 0, 0)] * nsp + [(0, width - depth, 0), (0, 0, 0)])
    canon = "".join("DHW"[3 - nsp:])  # spatial dim letters for the canonical specs
    dims = jax.lax.conv_dimension_numbers(xs.shape, ws.shape,
                                          (f"N{canon}C", f"{canon}IO", f"N{canon}C"))
    yc = jax.lax.conv_general_dilated(xs, ws, (1,) * nsp, "VALID", dimension_numbers=dims,
                                      precision=p["precision"],
                                      preferred_element_type=p["preferred_element_type"])
    return from_canonical(yc, dn)


def conv_space_to_depth_replacement(x, w, *, conv_general_dilated, **_):
    """The graph's conv, regrouped (module doc)."""
    return space_to_depth_conv(x, w, conv_general_dilated)


def _examples():
    return [(sds((2, 16, 16, 3), d), sds((7, 7, 3, 8), d)) for d in (F32, BF16)]


def _candidate(avals, params):
    """Only strided convs over few input channels are what the pattern is for; other
    convs are not reported."""
    shapes = (avals[0].shape, avals[1].shape, params.get(CONV))
    return unsupported(*shapes) is None and worthwhile(*shapes) is None


#: policy="auto": cuDNN's narrow-input kernels are the slow part on GPU
_decide = on_gpu_only("cuDNN's narrow-input convolutions")


def patterns() -> list[Pattern]:
    return [Pattern("conv_space_to_depth",
                    [Formulation(conv_formulation, label="lax.conv_general_dilated (strided, few input channels)",
                                 node_params=(CONV,))],
                    conv_space_to_depth_replacement, _examples(), accepts=floating_inputs,
                    candidate=_candidate, decide=_decide,
                    note="strided conv over few input channels as a stride-1 conv over the "
                         "space-to-depth input")]
