"""jax_ops.fx: inspect a JAX function as a graph, profile it, and rewrite known
subgraphs (LayerNorm, RMSNorm, softmax, ReLU, BatchNorm...) into jax_ops ops, exactly,
and fold inference BatchNorm into the preceding convolution.

  g = jax_ops.fx.trace(fn, *args)           # Graph; print(g.tabular())
  jax_ops.fx.profile(fn, *args)             # where the time goes
  fast = jax_ops.optimize(fn)               # same function, our ops where faster
  jax_ops.fx.rewrites(fn, *args)            # each candidate match: replaced or why not
  jax_ops.fx.register_pattern(name, reference, replacement, example_args=...)

Private JAX APIs used (keep this list short and current):
  jax._src.source_info_util.user_frames   graph.py: file:line of an equation (the
                                            innermost frame outside jax, and the
                                            innermost outside installed packages)
  jax._src.source_info_util.user_context,
  current_name_stack                        rewrite.py: the interpreter binds each
                                            equation under its original source info and
                                            name stack, so HLO metadata (used by the GPU
                                            profile) and errors still point to user code
  Primitive.get_bind_params, eqn.ctx.manager, eqn.source_info (via jax.extend.core
  objects)                                  re-binding equations, as jax.core.eval_jaxpr
  Jaxpr.debug_info.func_src_info            match.py: identifies the function a
                                            custom_jvp/custom_vjp body was traced from
  scan's params["ft_in"].update(...).unpack()
                                            rewrite.py: scan's (consts, carry, xs) operand
                                            groups, to re-issue a scan with a rewritten body
  jax.experimental.mosaic.gpu.profiler.measure (experimental, public)
                                            profile.py: CUPTI per-kernel times on GPU
  flax.linen.normalization._compute_stats,
  flax.nnx.nn.normalization._compute_stats/_normalize (flax-private)
                                            ops/layer_norm.py, ops/batch_norm.py: the
                                            exact flax formulations
"""
from jax_ops.fx.graph import Graph, Literal, Node, Value, trace
from jax_ops.fx.patterns import Formulation, Pattern, register_pattern, unregister_pattern
from jax_ops.fx.profile import Profile, profile
from jax_ops.fx.rewrite import Rewrite, Rewrites, optimize, rewrites

__all__ = ["trace", "Graph", "Node", "Value", "Literal", "profile", "Profile", "optimize",
           "rewrites", "Rewrite", "Rewrites", "register_pattern", "unregister_pattern",
           "Pattern", "Formulation"]
