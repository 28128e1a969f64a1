"""jax_ops.autotune: time every implementation (and tunable config) of the ops in a
function on this device, and keep the winners for later automatic choices.

The cache file (core/cache.py: where it lives, its versioned format): per device kind,
"op|stage|dtype|shape" -> {"implementation", "config", "us": {candidate: median
microseconds}, "version"}. Entries are exact-shape; other shapes keep using the measured
table / heuristics.
"""
from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_ops.core import cache, dispatch, registry
from jax_ops.core.calls import op_calls
from jax_ops.core.op import default_platform, query
from jax_ops.core.cache import cache_path  # noqa: F401 - public: jax_ops.tuning.cache_path
from jax_ops.core.timing import wall_seconds

# ---------------------------------------------------------- finding calls ---

def find_calls(fn: Callable, *args, **kwargs) -> list[tuple]:
    """(primitive, operand avals, params) of each distinct jax_ops call in fn(*args)."""
    found, seen = [], set()
    for prim, avals, params in op_calls(fn, *args, **kwargs):
        key = (prim, tuple((a.shape, a.dtype) for a in avals),
               tuple(sorted((k, str(v)) for k, v in params.items())))
        if key not in seen:
            seen.add(key)
            found.append((prim, avals, params))
    return found


# ----------------------------------------------------------------- timing ---

def _operands(avals, seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for a in avals:
        v = rng.standard_normal(a.shape).astype(np.float32)
        if a.dtype == jnp.float32 and len(a.shape) < 2:  # statistics / parameters: keep rstd > 0
            v = np.abs(v) + 0.5
        out.append(jnp.asarray(v, a.dtype))
    return out


def _timer(platform: str) -> Callable:
    if platform == "cuda":
        try:
            from jax.experimental.mosaic.gpu import profiler

            def cupti(compiled, ops, repeats):
                measured = profiler.measure(compiled)
                return [measured(*ops)[1] * 1e3 for _ in range(repeats)]
            return cupti
        except Exception:  # CUPTI unavailable: wall clock below
            pass

    def wall(compiled, ops, repeats):
        return [t * 1e6 for t in wall_seconds(lambda o: compiled(*o), ops, repeats)]
    return wall


def label(name: str, config: dict | None) -> str:
    """"pallas[block_rows=8,num_warps=4]": how autotune names a candidate."""
    if not config:
        return name
    return name + "[" + ",".join(f"{k}={v}" for k, v in sorted(config.items())) + "]"


def autotune(fn: Callable, *args, implementations: Sequence[str] | None = None,
             max_configs: int | None = 12, repeats: int = 10, verbose: bool = True,
             **kwargs) -> list[dict]:
    """Times every supporting implementation (and tunable config) of each jax_ops call
    in fn(*args, **kwargs) on the default device, stores the winners in the cache file
    and clears jax's caches so that functions compiled from now on use them.

    Pass the function you will run: for training, the one that takes gradients (its
    backward ops are tuned too). implementations: restrict the candidates by name.
    Returns one dict per call: query, winner, config and every candidate's time (us).
    """
    platform = default_platform()
    kind = dispatch.device_kind(platform) or platform
    calls = find_calls(fn, *args, **kwargs)
    timer = _timer(platform)
    results = []
    for n, (prim, avals, params) in enumerate(calls, 1):
        q = query(prim, avals, params, platform)
        candidates = []
        for impl in registry.all_of(q.op):
            if implementations is not None and impl.name not in implementations:
                continue
            if impl.why_not(q) is not None:
                continue
            configs = impl.configs(q) if impl.configs is not None else [None]
            candidates += [(impl.name, c) for c in configs[:max_configs]]
        ops = _operands(avals, seed=n)
        bind_params = dict(params, implementation=None)
        times = {}
        for name, config in candidates:
            cand = label(name, config)
            pins = dispatch._forced()
            pins[dispatch.cache_key(q)] = (name, config)
            try:
                compiled = jax.jit(lambda *a: prim.bind(*a, **bind_params)).lower(*ops).compile()
                times[cand] = (statistics.median(timer(compiled, ops, repeats)), name, config)
            except Exception as e:  # a config that does not compile/fit is just not a winner
                if verbose:
                    print(f"  {cand}: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})",
                          file=sys.stderr)
            finally:
                pins.pop(dispatch.cache_key(q), None)
        if not times:
            continue
        best_label = min(times, key=lambda k: times[k][0])
        us, name, config = times[best_label]
        entry = {"implementation": name, "config": config,
                 "us": {k: round(v[0], 3) for k, v in sorted(times.items(), key=lambda kv: kv[1][0])}}
        results.append({"query": q.describe(), "key": dispatch.cache_key(q), "q": q, **entry})
        if verbose:
            print(f"jax_ops.autotune [{n}/{len(calls)}] {q.describe()}: {best_label} {us:.1f}us "
                  f"({len(times)} candidates; next {', '.join(f'{k} {v[0]:.1f}us' for k, v in sorted(times.items(), key=lambda kv: kv[1][0])[1:4])})",
                  file=sys.stderr)
    if results:
        path = cache.store(kind, {r["key"]: {k: r[k] for k in ("implementation", "config", "us")}
                                  for r in results})
        if verbose:
            print(f"jax_ops.autotune: {len(results)} winners saved to {path}", file=sys.stderr)
        jax.clear_caches()  # compiled functions re-lower and see the winners
    return results
