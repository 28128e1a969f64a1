"""A pre-norm Transformer block (causal self-attention + MLP, residuals) in flax.linen,
written once and built from either flax's layers or jax_ops's (`ours=True`), trained
with optax on a synthetic next-token task.

The two layer sets differ only in classes (`LayerNorm`/`RMSNorm`) and the attention
`attention_fn`; the parameter trees are identical, so a flax checkpoint loads unchanged.

    python examples/transformer_block.py --ours --steps 20
    python examples/transformer_block.py --flax --dtype bfloat16 --norm layer
"""
from __future__ import annotations

import argparse
import functools
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


def layer_set(ours: bool) -> SimpleNamespace:
    """The layers a model is built from: flax's, or their jax_ops drop-ins."""
    if ours:
        import jax_ops.nn as jnn
        return SimpleNamespace(LayerNorm=jnn.LayerNorm, RMSNorm=jnn.RMSNorm,
                               attention_fn=jnn.dot_product_attention)
    return SimpleNamespace(LayerNorm=nn.LayerNorm, RMSNorm=nn.RMSNorm,
                           attention_fn=nn.dot_product_attention)


class Block(nn.Module):
    """x + Attn(Norm(x)), then x + MLP(Norm(x)); causal attention."""
    d_model: int
    heads: int
    norm: str = "rms"              # "rms" or "layer"
    mlp_ratio: int = 4
    ours: bool = False
    dtype: jnp.dtype = jnp.float32  # activations; parameters stay float32

    @nn.compact
    def __call__(self, x):
        layers = layer_set(self.ours)
        Norm = {"rms": layers.RMSNorm, "layer": layers.LayerNorm}[self.norm]
        # (1, 1, seq, seq): broadcast over batch and heads (our softmax never expands it)
        causal = nn.make_causal_mask(jnp.ones((1, x.shape[-2]), bool))
        h = Norm(dtype=self.dtype, name="attn_norm")(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.heads, dtype=self.dtype, attention_fn=layers.attention_fn,
            name="attn")(h, mask=causal)
        x = x + h
        h = Norm(dtype=self.dtype, name="mlp_norm")(x)
        h = nn.Dense(self.mlp_ratio * self.d_model, dtype=self.dtype, name="mlp_in")(h)
        h = nn.Dense(self.d_model, dtype=self.dtype, name="mlp_out")(nn.gelu(h))
        return x + h


class TinyLM(nn.Module):
    """Token embedding → Block → final norm → logits (float32)."""
    vocab: int
    d_model: int
    heads: int
    norm: str = "rms"
    ours: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        layers = layer_set(self.ours)
        Norm = {"rms": layers.RMSNorm, "layer": layers.LayerNorm}[self.norm]
        x = nn.Embed(self.vocab, self.d_model, dtype=self.dtype, name="embed")(tokens)
        x = Block(self.d_model, self.heads, self.norm, ours=self.ours, dtype=self.dtype,
                  name="block")(x)
        x = Norm(dtype=self.dtype, name="final_norm")(x)
        return nn.Dense(self.vocab, dtype=self.dtype, name="head")(x).astype(jnp.float32)


def make_model(ours: bool, *, vocab: int = 64, d_model: int = 64, heads: int = 4,
               norm: str = "rms", dtype=jnp.float32) -> TinyLM:
    return TinyLM(vocab, d_model, heads, norm, ours=ours, dtype=jnp.dtype(dtype))


def synthetic_tokens(key, batch: int, seq: int, vocab: int):
    """Sequences start + stride·i (mod vocab) with a random start and stride per sequence:
    the next token follows from the previous two, so the loss can go well below log(vocab)."""
    k_start, k_stride = jax.random.split(key)
    start = jax.random.randint(k_start, (batch, 1), 0, vocab)
    stride = jax.random.randint(k_stride, (batch, 1), 1, 4)
    return (start + stride * jnp.arange(seq + 1)) % vocab   # (batch, seq + 1)


def init_params(model: TinyLM, key, seq: int):
    # one jit instead of an eager dispatch (and a compile) per initializer op
    return jax.jit(model.init)(key, jnp.zeros((1, seq), jnp.int32))["params"]


def make_train_step(model: TinyLM, optimizer: optax.GradientTransformation, donate: bool = True):
    """jit(step)(params, opt_state, tokens) -> (params, opt_state, loss): next-token
    cross-entropy, forward + backward + optimizer update. params and opt_state are donated
    unless `donate=False` (for a profiler that replays the step on the same inputs)."""
    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def train(ours: bool, steps: int = 10, *, vocab: int = 64, d_model: int = 64, heads: int = 4,
          seq: int = 32, batch: int = 8, norm: str = "rms", dtype=jnp.float32,
          lr: float = 3e-3, seed: int = 0, params=None):
    """Trains `steps` steps on one fixed synthetic batch; returns (losses, params).
    `params` (e.g. initialized with the other layer set) replaces the initialization."""
    model = make_model(ours, vocab=vocab, d_model=d_model, heads=heads, norm=norm, dtype=dtype)
    k_init, k_data = jax.random.split(jax.random.key(seed))
    if params is None:
        params = init_params(model, k_init, seq)
    params = jax.tree.map(jnp.copy, params)   # the step donates its inputs: keep the caller's
    tokens = synthetic_tokens(k_data, batch, seq, vocab)
    optimizer = optax.adamw(lr)
    opt_state = optimizer.init(params)
    step = make_train_step(model, optimizer)
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(loss))
    return losses, params


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--ours", dest="ours", action="store_true", default=True,
                       help="jax_ops layers (default)")
    which.add_argument("--flax", dest="ours", action="store_false", help="flax's layers")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--norm", choices=["rms", "layer"], default="rms")
    p.add_argument("--dtype", default="float32", help="activation dtype, e.g. bfloat16")
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)
    losses, _ = train(args.ours, args.steps, vocab=args.vocab, d_model=args.d_model,
                      heads=args.heads, seq=args.seq, batch=args.batch, norm=args.norm,
                      dtype=jnp.dtype(args.dtype), lr=args.lr)
    print(f"layers: {'jax_ops' if args.ours else 'flax'}, backend: {jax.default_backend()}")
    for i, loss in enumerate(losses):
        print(f"step {i:4d}  loss {loss:.4f}")


if __name__ == "__main__":
    main()
