"""A ResNet basic block (conv → BatchNorm+ReLU → conv → BatchNorm+Add+ReLU with the
identity shortcut, NHWC) with a small classifier head, written once and built from
either flax's layers or jax_ops's fused ones (`ours=True`); trained with optax
(batch_stats updated), then evaluated with the running averages.

flax: `nn.relu(nn.BatchNorm(...)(x))` and `nn.relu(nn.BatchNorm(...)(x) + residual)`;
ours: `jax_ops.nn.BatchNormReLU(...)(x)` and `BatchNormAddReLU(...)(x, residual)` — the
same variables (`BatchNorm_0`, `BatchNorm_1`), so a flax checkpoint loads unchanged.
`NNXResNetBlock` is the same model in flax.nnx (`jax_ops.nnx` vs `flax.nnx` layers).

    python examples/resnet_block.py --ours --steps 20
    python examples/resnet_block.py --flax --dtype bfloat16
"""
from __future__ import annotations

import argparse
import functools
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

BN = dict(momentum=0.9, epsilon=1e-5)


def layer_set(ours: bool) -> SimpleNamespace:
    """bn_relu(x, train, dtype) and bn_add_relu(x, z, train, dtype), called inside a
    compact method: flax's BatchNorm followed by relu, or our fused layers."""
    if ours:
        import jax_ops.nn as jnn
        return SimpleNamespace(
            bn_relu=lambda x, train, dtype: jnn.BatchNormReLU(
                use_running_average=not train, dtype=dtype, **BN)(x),
            bn_add_relu=lambda x, z, train, dtype: jnn.BatchNormAddReLU(
                use_running_average=not train, dtype=dtype, **BN)(x, z))
    return SimpleNamespace(
        bn_relu=lambda x, train, dtype: nn.relu(
            nn.BatchNorm(use_running_average=not train, dtype=dtype, **BN)(x)),
        bn_add_relu=lambda x, z, train, dtype: nn.relu(
            nn.BatchNorm(use_running_average=not train, dtype=dtype, **BN)(x) + z))


class BasicBlock(nn.Module):
    features: int
    ours: bool = False
    dtype: jnp.dtype = jnp.float32   # activations; parameters and statistics stay float32

    @nn.compact
    def __call__(self, x, train: bool):
        layers = layer_set(self.ours)
        conv = functools.partial(nn.Conv, self.features, (3, 3), use_bias=False, dtype=self.dtype)
        y = layers.bn_relu(conv()(x), train, self.dtype)
        return layers.bn_add_relu(conv()(y), x, train, self.dtype)


class ResNetBlockClassifier(nn.Module):
    """BasicBlock on NHWC features → global average pool → Dense logits (float32)."""
    num_classes: int = 10
    ours: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool):
        x = BasicBlock(x.shape[-1], ours=self.ours, dtype=self.dtype, name="block")(x, train)
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x).astype(jnp.float32)


def make_model(ours: bool, *, num_classes: int = 10, dtype=jnp.float32) -> ResNetBlockClassifier:
    return ResNetBlockClassifier(num_classes, ours=ours, dtype=jnp.dtype(dtype))


def synthetic_batch(key, shape, num_classes: int, dtype=jnp.float32):
    """NHWC features and a learnable label: the channel (< num_classes) with the largest mean."""
    x = jax.random.normal(key, shape, jnp.float32)
    labels = jnp.argmax(x.mean(axis=(1, 2))[:, :num_classes], axis=-1)
    return x.astype(dtype), labels


def training_batch(seed: int, shape, num_classes: int, dtype=jnp.float32):
    """The fixed batch `train(seed=...)` trains and evaluates on."""
    return synthetic_batch(jax.random.fold_in(jax.random.key(seed), 1), shape, num_classes, dtype)


def init_variables(model, key, shape):
    # one jit instead of an eager dispatch (and a compile) per initializer op
    return jax.jit(functools.partial(model.init, train=False))(key, jnp.zeros(shape, model.dtype))


def make_train_step(model, optimizer: optax.GradientTransformation, donate: bool = True):
    """jit(step)(variables, opt_state, x, labels) -> (variables, opt_state, loss): forward
    in training mode (batch statistics, running averages updated), backward, update.
    variables and opt_state are donated unless `donate=False` (for a profiler that replays
    the step on the same inputs)."""
    def loss_fn(params, batch_stats, x, labels):
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, x,
                                      train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, updates["batch_stats"]

    @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
    def step(variables, opt_state, x, labels):
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            variables["params"], variables["batch_stats"], x, labels)
        updates, opt_state = optimizer.update(grads, opt_state, variables["params"])
        params = optax.apply_updates(variables["params"], updates)
        return {"params": params, "batch_stats": batch_stats}, opt_state, loss

    return step


def make_eval_step(model):
    return jax.jit(lambda variables, x: model.apply(variables, x, train=False))


def train(ours: bool, steps: int = 10, *, batch: int = 8, size: int = 8, channels: int = 16,
          num_classes: int = 10, dtype=jnp.float32, lr: float = 1e-2, seed: int = 0,
          variables=None):
    """Trains `steps` steps on one fixed synthetic batch; returns (losses, variables,
    eval logits on that batch). `variables` (e.g. from the other layer set) replace the init."""
    model = make_model(ours, num_classes=num_classes, dtype=dtype)
    shape = (batch, size, size, channels)
    if variables is None:
        variables = init_variables(model, jax.random.key(seed), shape)
    variables = jax.tree.map(jnp.copy, variables)   # the step donates its inputs
    x, labels = training_batch(seed, shape, num_classes, dtype)
    optimizer = optax.adamw(lr)
    opt_state = optimizer.init(variables["params"])
    step = make_train_step(model, optimizer)
    losses = []
    for _ in range(steps):
        variables, opt_state, loss = step(variables, opt_state, x, labels)
        losses.append(float(loss))
    return losses, variables, make_eval_step(model)(variables, x)


# --- The same model in flax.nnx -------------------------------------------------------

class _FlaxBatchNormReLU(nnx.BatchNorm):
    """relu(nnx.BatchNorm(x)): flax's layers, the state layout of ours."""
    def __call__(self, x, use_running_average=None):
        return jax.nn.relu(super().__call__(x, use_running_average))


class _FlaxBatchNormAddReLU(nnx.BatchNorm):
    def __call__(self, x, z, use_running_average=None):
        return jax.nn.relu(super().__call__(x, use_running_average) + z)


def nnx_layer_set(ours: bool) -> SimpleNamespace:
    if ours:
        import jax_ops.nnx as jnnx
        return SimpleNamespace(BatchNormReLU=jnnx.BatchNormReLU,
                               BatchNormAddReLU=jnnx.BatchNormAddReLU)
    return SimpleNamespace(BatchNormReLU=_FlaxBatchNormReLU, BatchNormAddReLU=_FlaxBatchNormAddReLU)


class NNXResNetBlock(nnx.Module):
    """ResNetBlockClassifier in NNX; `model.train()` / `model.eval()` switch BatchNorm."""

    def __init__(self, channels: int, num_classes: int = 10, *, ours: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        layers = nnx_layer_set(ours)
        conv = functools.partial(nnx.Conv, channels, channels, (3, 3), use_bias=False,
                                 dtype=dtype, rngs=rngs)
        bn = dict(use_running_average=False, dtype=dtype, rngs=rngs, **BN)
        self.conv1, self.bn_relu = conv(), layers.BatchNormReLU(channels, **bn)
        self.conv2, self.bn_add_relu = conv(), layers.BatchNormAddReLU(channels, **bn)
        self.head = nnx.Linear(channels, num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        y = self.bn_relu(self.conv1(x))
        y = self.bn_add_relu(self.conv2(y), x)
        return self.head(y.mean(axis=(1, 2))).astype(jnp.float32)


@nnx.jit
def nnx_train_step(model: NNXResNetBlock, optimizer: nnx.Optimizer, x, labels):
    def loss_fn(model):
        logits = model(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--ours", dest="ours", action="store_true", default=True,
                       help="jax_ops layers (default)")
    which.add_argument("--flax", dest="ours", action="store_false", help="flax's layers")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=8, help="height = width")
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--dtype", default="float32", help="activation dtype, e.g. bfloat16")
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args(argv)
    losses, _, logits = train(args.ours, args.steps, batch=args.batch, size=args.size,
                              channels=args.channels, num_classes=args.classes,
                              dtype=jnp.dtype(args.dtype), lr=args.lr)
    print(f"layers: {'jax_ops' if args.ours else 'flax'}, backend: {jax.default_backend()}")
    for i, loss in enumerate(losses):
        print(f"step {i:4d}  loss {loss:.4f}")
    _, labels = training_batch(0, (args.batch, args.size, args.size, args.channels), args.classes)
    accuracy = float((logits.argmax(-1) == labels).mean())
    print(f"eval (running averages) accuracy on the training batch: {accuracy:.2f}")


if __name__ == "__main__":
    main()
