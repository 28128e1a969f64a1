"""Input checks the op declarations share. Each raises TypeError/ValueError naming the
op, the argument, the expected and the actual value, before anything runs."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

#: activation dtypes every op takes
ACT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
F32 = jnp.dtype(jnp.float32)


def dtype_name(d) -> str:
    return jnp.dtype(d).name


def check_x(op: str, x, *, min_rank: int, rank_rule: str) -> None:
    """x: a float32/bfloat16/float16 array of rank >= min_rank (rank_rule says why) whose
    last axis is not empty."""
    if x.dtype not in ACT_DTYPES:
        raise TypeError(f"jax_ops.{op}: x must be float32, bfloat16 or float16; "
                        f"got dtype {dtype_name(x.dtype)}")
    if x.ndim < min_rank:
        raise ValueError(f"jax_ops.{op}: x must have {rank_rule}; got shape {tuple(x.shape)}")
    if x.shape[-1] < 1:
        raise ValueError(f"jax_ops.{op}: x's last axis must have size >= 1; got shape {tuple(x.shape)}")


def check_vectors(op: str, x, **vectors) -> None:
    """Per-channel parameters (None: absent): shape (x.shape[-1],), float32 or x's dtype,
    one dtype for all."""
    cols = x.shape[-1]
    for name, p in vectors.items():
        if p is None:
            continue
        if tuple(p.shape) != (cols,):
            raise ValueError(f"jax_ops.{op}: {name} must have shape ({cols},) to match x's last "
                             f"axis; got shape {tuple(p.shape)} (x has shape {tuple(x.shape)})")
        if p.dtype not in (F32, x.dtype):
            raise TypeError(f"jax_ops.{op}: {name} must be float32 or x's dtype "
                            f"{dtype_name(x.dtype)}; got {dtype_name(p.dtype)}")
    present = [(n, p) for n, p in vectors.items() if p is not None]
    for (n1, p1), (n2, p2) in zip(present, present[1:]):
        if p1.dtype != p2.dtype:
            raise TypeError(f"jax_ops.{op}: {n1} and {n2} must share a dtype; got {n1} "
                            f"{dtype_name(p1.dtype)} and {n2} {dtype_name(p2.dtype)}")


def check_epsilon(op: str, epsilon) -> None:
    if not isinstance(epsilon, (int, float, np.floating)) or isinstance(epsilon, bool):
        raise TypeError(f"jax_ops.{op}: epsilon must be a Python float; got {type(epsilon).__name__}")
    if not (float(epsilon) >= 0.0 and np.isfinite(epsilon)):
        raise ValueError(f"jax_ops.{op}: epsilon must be finite and >= 0; got {epsilon}")


def check_broadcastable(op: str, name: str, x, z) -> None:
    """z must have x's dtype and a shape that broadcasts to x's."""
    if z.dtype != x.dtype:
        raise TypeError(f"jax_ops.{op}: {name} must have x's dtype {dtype_name(x.dtype)}; "
                        f"got {dtype_name(z.dtype)}")
    try:
        shape = jnp.broadcast_shapes(tuple(z.shape), tuple(x.shape))
    except ValueError:
        shape = None
    if shape != tuple(x.shape):
        raise ValueError(f"jax_ops.{op}: {name} must have x's shape {tuple(x.shape)} (or one that "
                         f"broadcasts to it); got shape {tuple(z.shape)}")
