"""The `attention` pattern: q·kᵀ → scale → bias/mask → softmax → ·v as model code
writes it, routed to cuDNN flash attention through jax.nn.dot_product_attention.

Formulations (each a plain reference function, matched exactly like every pattern):
- flax.linen.dot_product_attention / dot_product_attention_weights + einsum (Hugging
  Face's Flax models write the latter): q, k, v are (batch..., seq, heads, depth),
  q is divided by sqrt(depth) in its dtype, an optional additive bias and boolean
  mask (jnp.where with finfo.min), jax.nn.softmax, optionally in float32;
- the same with Hugging Face BERT's per-head weight mask (accepted when it is a
  constant of ones);
- hand-written einsum in the same (b, t, h, d) layout with a literal scale on the
  logits;
- hand-written (b, h, t, d) matmuls: `softmax(q @ kᵀ * scale) @ v`.

A bias or mask is only accepted when it is a compile-time constant of the graph
(computed from iotas and literals, as flax.linen.make_causal_mask and Hugging Face's
GPT-2 build theirs): it is evaluated while planning and must be "no mask" or exactly
the causal mask (keep j <= i), with masked bias entries <= -1e9 so their softmax weight
underflows to exactly 0 as cuDNN's causal mask gives. Then the replacement is
jax.nn.dot_product_attention(..., is_causal=True). Masks computed from inputs (padding)
are reported, not replaced.

policy="auto" replaces a match when cuDNN flash attention takes it: a CUDA GPU with
compute capability >= 8.0, bfloat16/float16 inputs, head depth a multiple of 8 up to
128 (jax.nn's cuDNN checks); "always" also replaces elsewhere, with jax.nn's XLA
implementation (how CPU tests check the matching and the causal analysis).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_ops.fx.graph import Literal, Value
from jax_ops.core.pattern import Formulation, Pattern

_F32, _BF16, _F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
#: a masked bias entry must be at most this: exp(masked logit - row max) is exactly 0
MASKED_BIAS = -1e9
#: constants larger than this (elements) are not evaluated while planning
MAX_CONSTANT_ELEMENTS = 1 << 26


# ---------------------------------------------------------- formulations ---

def _flax_attention(q, k, v, bias, mask, *, fp32_softmax, layout):
    import flax.linen as nn
    return nn.dot_product_attention(q, k, v, bias, mask, deterministic=True,
                                    force_fp32_for_softmax=fp32_softmax)


def _flax_weights_einsum(q, k, v, bias, mask, *, fp32_softmax, layout):
    """Hugging Face's Flax attention: the weights, then its own einsum."""
    import flax.linen as nn
    weights = nn.dot_product_attention_weights(q, k, bias, mask, deterministic=True,
                                               force_fp32_for_softmax=fp32_softmax)
    return jnp.einsum("...hqk,...khd->...qhd", weights, v)


def _flax_weights_head_mask_einsum(q, k, v, bias, mask, head_mask, *, fp32_softmax, layout):
    """Hugging Face's BERT-family attention: the weights scaled per head by
    layer_head_mask (all ones unless heads are pruned), then the einsum."""
    import flax.linen as nn
    weights = nn.dot_product_attention_weights(q, k, bias, mask, deterministic=True,
                                               force_fp32_for_softmax=fp32_softmax)
    weights = jnp.einsum("...hqk,h->...hqk", weights, head_mask)
    return jnp.einsum("...hqk,...khd->...qhd", weights, v)


def _einsum_bthd(q, k, v, bias, mask, *, scale, softmax_dtype, layout):
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits.astype(softmax_dtype), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)


def _matmul_bhtd(q, k, v, bias, mask, *, scale, softmax_dtype, layout):
    logits = q @ jnp.swapaxes(k, -1, -2) * scale
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits.astype(softmax_dtype), axis=-1)
    return weights.astype(v.dtype) @ v


# Static settings: `layout` (which axes are seq and heads) reaches the specialization
# and the replacement; the references ignore it.

def _fp32_static(avals, out_aval):
    return [{"fp32_softmax": f, "layout": "bthd"} for f in (False, True)]


def _softmax_dtype_static(layout):
    def static(avals, out_aval):
        return [{"softmax_dtype": d, "layout": layout}
                for d in dict.fromkeys([np.dtype(avals[0].dtype), _F32])]
    return static


def _flax_available() -> bool:
    try:
        import flax.linen  # noqa: F401
        return True
    except ImportError:
        return False


# -------------------------------------------------------------- examples ---

def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _examples():
    """q, k, v at (b, t=8, h=2, d=4) and (b, h=2, t=8, d=4), optional bias/mask in the
    broadcast shapes models use: (b, 1, t, t) (causal), (b, 1, 1, t) (padding), full;
    other broadcasts ((1, 1, t, t)) share one of these structures."""
    out = []
    for dt in (_F32, _BF16):
        for qkv in ((2, 8, 2, 4), (2, 2, 8, 4)):
            q = _sds(qkv, dt)
            full = (2, 2, 8, 8)
            for extra in (None, (2, 1, 8, 8), (2, 1, 1, 8), full):
                out.append((q, q, q, None, None) if extra is None else (q, q, q, _sds(extra, dt), None))
                if extra is not None:
                    out.append((q, q, q, None, _sds(extra, jnp.bool_)))
    return out


# --------------------------------------------------------- specialization ---

def constant_value(v) -> np.ndarray | None:
    """The value of graph value `v` when it is computed from literals and iotas only
    (no graph input, no randomness): evaluated now. None otherwise."""
    if isinstance(v, Literal):
        return np.asarray(v.value)
    order, seen, stack = [], set(), [v]
    while stack:
        val = stack.pop()
        if isinstance(val, Literal):
            continue
        if getattr(val, "const", None) is not None and val.producer is None:
            continue
        node = val.producer
        if node is None:
            return None  # a graph input
        if node in seen:
            continue
        if node.subgraphs or "random" in node.name or node.name in ("rng_bit_generator", "rng_uniform"):
            return None
        seen.add(node)
        order.append(node)
        stack.extend(node.inputs)
    if any(math.prod(o.aval.shape) > MAX_CONSTANT_ELEMENTS for n in order for o in n.outputs):
        return None
    env = {}
    with jax.ensure_compile_time_eval():
        for node in sorted(order, key=lambda n: n.index):
            args = []
            for a in node.inputs:
                if isinstance(a, Literal):
                    args.append(a.value)
                elif a.producer is None:
                    args.append(a.const)
                else:
                    args.append(env[a])
            outs = node.primitive.bind(*args, **node.primitive.get_bind_params(node.params))
            if not node.primitive.multiple_results:
                outs = [outs]
            for o, r in zip(node.outputs, outs):
                env[o] = r
    return np.asarray(env[v])


def _classify(value: np.ndarray, is_mask: bool, scores_shape) -> str | None:
    """'none', 'causal' or None (anything else) for a constant bias/mask broadcast to
    the logits' shape (..., q, k)."""
    try:
        full = np.broadcast_to(value, scores_shape)
    except ValueError:
        return None
    q, k = scores_shape[-2], scores_shape[-1]
    tril = np.arange(k)[None, :] <= np.arange(q)[:, None]
    if is_mask:
        keep = full.astype(bool)
    else:
        f = full.astype(np.float64)
        keep = f == 0
        if not np.all(keep | (f <= MASKED_BIAS)):
            return None  # a real bias, or a mask value whose weight isn't exactly 0
    if keep.all():
        return "none"
    if q == k and np.array_equal(keep, np.broadcast_to(tril, keep.shape)):
        return "causal"
    return None


def _specialize(graph_args, avals, params):
    """Static facts the replacement needs: the causal flag from a constant bias/mask."""
    q = avals[0]
    layout = params["layout"]
    b_h = (q.shape[-2],) if layout == "bthd" else (q.shape[-3],)
    t_q = q.shape[-3] if layout == "bthd" else q.shape[-2]
    t_k = avals[1].shape[-3] if layout == "bthd" else avals[1].shape[-2]
    scores = tuple(q.shape[:-3]) + b_h + (t_q, t_k)
    kinds = []
    for pos, is_mask in ((3, False), (4, True)):
        v = graph_args[pos]
        if v is None:
            continue
        const = constant_value(v)
        if const is None:
            return ("the " + ("mask" if is_mask else "bias") + " is computed from inputs "
                    "(only a constant causal mask is routed to cuDNN)")
        kind = _classify(const, is_mask, scores)
        if kind is None:
            return ("the " + ("mask" if is_mask else "bias") + " is neither causal nor empty")
        kinds.append(kind)
    if len(graph_args) > 5:
        head_mask = constant_value(graph_args[5]) if graph_args[5] is not None else None
        if head_mask is None or not np.all(head_mask == 1):
            return "the head mask is not a constant of ones"
    return {"is_causal": "causal" in kinds}


# ------------------------------------------------------------ replacement ---

def cudnn_refusal(avals) -> str | None:
    """Why jax.nn.dot_product_attention(implementation="cudnn") can't take these
    inputs on the default device (None: it can)."""
    from jax_ops.core.op import default_platform
    platform = default_platform()
    if platform != "cuda":
        return f"cuDNN flash attention needs a CUDA GPU (the default device is {platform})"
    try:
        cc = tuple(int(c) for c in str(jax.devices()[0].compute_capability).split("."))
    except Exception:
        cc = None
    if cc is not None and cc < (8, 0):
        return f"cuDNN flash attention needs compute capability >= 8.0; got {cc}"
    q = avals[0]
    if any(a.dtype != q.dtype for a in avals[:3]):
        return "q, k and v have different dtypes"
    if q.dtype not in (_BF16, _F16):
        return f"cuDNN flash attention takes bfloat16/float16; got {q.dtype}"
    depth = q.shape[-1]
    if depth % 8 or depth > 128:
        return f"head depth {depth} (cuDNN flash attention: a multiple of 8, at most 128)"
    return None


def _decide(avals, params) -> str | None:
    return cudnn_refusal(avals)


def attention_replacement(q, k, v, bias=None, mask=None, head_mask=None, *, layout="bthd", is_causal=False,
                          scale=None, out_dtype=None, **_):
    """jax.nn.dot_product_attention in (b, t, h, d); cuDNN where it takes the inputs."""
    if layout == "bhtd":
        q, k, v = (jnp.swapaxes(a, -2, -3) for a in (q, k, v))
    lead = q.shape[:-3]
    if len(lead) != 1:  # jax.nn wants exactly one batch axis
        q, k, v = (a.reshape((math.prod(lead),) + a.shape[-3:]) for a in (q, k, v))
    avals = [jax.typeof(a) for a in (q, k, v)]
    impl = "cudnn" if cudnn_refusal(avals) is None else "xla"
    if scale is None:  # flax: q / sqrt(depth)
        scale = 1.0 / math.sqrt(q.shape[-1])
    out = jax.nn.dot_product_attention(q, k, v, scale=float(scale), is_causal=is_causal,
                                       implementation=impl)
    if len(lead) != 1:
        out = out.reshape(lead + out.shape[-3:])
    if layout == "bhtd":
        out = jnp.swapaxes(out, -2, -3)
    return out


def _accepts(avals):
    q, k, v = avals[:3]
    if q is None or k is None or v is None:
        return "q, k or v missing"
    if not (len(q.shape) == len(k.shape) == len(v.shape) >= 4):
        return "q, k, v need (batch..., seq, heads, depth) or (batch, heads, seq, depth)"
    if q.dtype not in (_F32, _BF16, _F16):
        return f"q is {q.dtype}"
    if k.shape != v.shape:
        return "k and v differ in shape (cross-attention with another value depth)"
    return None


def attention_patterns() -> list[Pattern]:
    """Two patterns named "attention": flax's (scale 1/sqrt(depth) from the shape) and
    the hand-written ones (a literal scale)."""
    common = dict(accepts=_accepts, specialize=_specialize, decide=_decide, reported=("is_causal",),
                  priority=1,  # before softmax, which it contains
                  note="q·kᵀ, scale, constant causal bias/mask, softmax, ·v -> "
                       "jax.nn.dot_product_attention (cuDNN)")
    out = []
    if _flax_available():
        out.append(Pattern("attention", [
            Formulation(_flax_attention, _fp32_static, "flax.linen.dot_product_attention"),
            Formulation(_flax_weights_einsum, _fp32_static,
                        "flax dot_product_attention_weights + einsum")],
            attention_replacement, _examples(), **common))
        out.append(Pattern("attention", [
            Formulation(_flax_weights_head_mask_einsum, _fp32_static,
                        "flax weights + head mask + einsum (Hugging Face BERT)")],
            attention_replacement, [a + (_sds((2,), a[0].dtype),) for a in _examples()
                                    if a[0].shape[1] == 8], **common))
    out.append(Pattern("attention", [
        Formulation(_einsum_bthd, _softmax_dtype_static("bthd"), "einsum (b,t,h,d)"),
        Formulation(_matmul_bhtd, _softmax_dtype_static("bhtd"), "matmul (b,h,t,d)")],
        attention_replacement, _examples(), params={"scale": 0.125}, **common))
    return out
