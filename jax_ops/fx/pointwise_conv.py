"""pointwise_conv: a 1x1 convolution (ResNet's bottleneck and shortcut convs) as the
matrix multiplication it is, (N·H·W, C) @ (C, O), run by cuBLAS instead of cuDNN.

The sums are the conv's (over the input channels only), in the same dtype with the
same accumulation type (`preferred_element_type` and `precision` kept); a stride keeps
every s-th pixel first (a strided slice), padding adds zero rows. Its gradients are
the dot's (two more GEMMs) and the slice's (a pad).

Why: XLA's default command-buffer types include cuBLAS GEMMs but not cuDNN
convolutions, so each conv splits the CUDA graphs around it and the host launches most
of a ResNet training step's kernels one at a time (perf-notes, "Fifth session"). As
GEMMs, 36 of ResNet-50's 53 convs (and their backward's 72 dgrad/wgrad convs) join the
graphs. policy="auto" takes it on GPU only (measured: perf-notes, "Sixth session");
conv_batch_norm's fold does the same for its 1x1 convs.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp

from jax_ops.core.pattern import F32, BF16, Formulation, Pattern, sds
from jax_ops.fx.conv_layout import (CONV, canonical, conv_formulation, conv_params,
                                    floating_inputs, from_canonical, kernel_size, on_gpu_only,
                                    plain)


def unsupported(x_shape, w_shape, params) -> str | None:
    """Why this conv is not a pointwise one (None: it is)."""
    why = plain(x_shape, w_shape, params)
    if why:
        return why
    if any(k != 1 for k in kernel_size(w_shape, params)):
        return f"a {'x'.join(map(str, kernel_size(w_shape, params)))} kernel (not 1x1)"
    return None


def pointwise_dot(x, w, params):
    """conv_general_dilated(x, w, **params) for a 1x1 kernel, as a dot_general (module
    doc); the result has the original's shape, dtype and layout."""
    p = conv_params(params)
    why = unsupported(x.shape, w.shape, p)
    if why:
        raise ValueError(f"pointwise_conv: {why}")
    dn = p["dimension_numbers"]
    xc, wc = canonical(x, w, dn)
    nsp = xc.ndim - 2
    # padding first (zeros: their outputs are w·0), then every stride-th pixel
    pads = [(0, 0, 0)] + [(lo, hi, 0) for lo, hi in p["padding"]] + [(0, 0, 0)]
    if any(lo or hi for _, (lo, hi) in zip(range(nsp), p["padding"])):
        xc = jax.lax.pad(xc, jnp.zeros((), x.dtype), pads)
    strides = tuple(p["window_strides"])
    if any(s != 1 for s in strides):
        xc = jax.lax.slice(xc, (0,) * xc.ndim, xc.shape, (1, *strides, 1))
    w2 = wc.reshape(wc.shape[-2:])
    y = jax.lax.dot_general(xc, w2, (((xc.ndim - 1,), (0,)), ((), ())),
                            precision=p["precision"],
                            preferred_element_type=p["preferred_element_type"])
    return from_canonical(y, dn)


def pointwise_conv_replacement(x, w, *, conv_general_dilated, **_):
    """The graph's 1x1 conv as a dot (module doc)."""
    return pointwise_dot(x, w, conv_general_dilated)


def _examples():
    return [(sds((2, 6, 6, 8), d), sds((1, 1, 8, 16), d)) for d in (F32, BF16)]


def _candidate(avals, params):
    """Only 1x1 convs are what the pattern is for; other convs are not reported."""
    return unsupported(avals[0].shape, avals[1].shape, params.get(CONV)) is None


#: policy="auto": on GPU (cuBLAS joins XLA's default CUDA graphs)
_decide = on_gpu_only("cuDNN convs outside XLA's CUDA graphs")


def patterns() -> list[Pattern]:
    return [Pattern("pointwise_conv",
                    [Formulation(conv_formulation, label="lax.conv_general_dilated (1x1 kernel)",
                                 node_params=(CONV,))],
                    pointwise_conv_replacement, _examples(), accepts=floating_inputs,
                    candidate=_candidate, decide=_decide,
                    note="1x1 conv as a matrix multiplication (cuBLAS)")]
