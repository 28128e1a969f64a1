"""The package's layering, read from the source (every import, function-local ones
included): no import cycle, no module importing a layer above its own, and no op
module importing another op module (what ops share lives in jax_ops/core)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jax_ops", "pallas_kernels")

# Lowest first; a module may import its own layer (acyclically) and those below.
LAYERS = [
    ("pallas_kernels",),
    ("jax_ops._extension", "jax_ops._ffi"),  # _ffi: the compiled FFI module
    ("jax_ops.core",),
    ("jax_ops.ops",),
    ("jax_ops.tuning", "jax_ops._export"),
    ("jax_ops.fx",),
    ("jax_ops", "jax_ops.info"),  # the package's public names (jax_ops/__init__.py)
    # loaded on demand, users of the public API: the benchmark and the Flax layers
    ("jax_ops.bench", "jax_ops._flax", "jax_ops.nn", "jax_ops.nnx"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports (absolute and relative, at any depth)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` depends on mod; `from mod import name` on mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
              and node.args and isinstance(node.args[0], ast.JoinedStr)):
            continue  # jax_ops.__getattr__'s lazy flax layers: the top layer's own
        else:
            continue
        for t in targets:
            while t and t not in known:  # "jax_ops.core.op.Stage" -> "jax_ops.core.op"
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def layer_of(name: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if name == p or name.startswith(p + "."):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best[0]


KNOWN = set(modules()) | {"jax_ops._ffi"}
GRAPH = {n: imports_of(n, p, KNOWN) for n, p in modules().items()}


def test_every_module_has_a_layer():
    for name in GRAPH:
        layer_of(name)


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_no_import_from_a_layer_above(name):
    # Importing the package itself (`import jax_ops`) runs jax_ops/__init__: the top layer.
    above = sorted(t for t in GRAPH[name] if layer_of(t) > layer_of(name))
    assert not above, f"{name} (layer {layer_of(name)}) imports {above} from above"


def test_ops_do_not_import_each_other():
    bad = [(n, t) for n, ts in GRAPH.items() if n.startswith("jax_ops.ops.")
           for t in ts if t.startswith("jax_ops.ops.")]
    assert not bad, f"op modules importing other op modules: {bad}"


def test_no_import_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for t in sorted(GRAPH[n]):
            if t not in GRAPH:
                continue  # the compiled extension
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if not state.get(t):
                visit(t)
        stack.pop()
        state[n] = 2

    for n in sorted(GRAPH):
        if not state.get(n):
            visit(n)


def test_the_checker_sees_local_imports(tmp_path):
    """A function-local import counts (the checker is not fooled by where it stands)."""
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from jax_ops.core import op\n    return op\n")
    assert imports_of("jax_ops.ops.m", p, {"jax_ops.core.op", "jax_ops.core"}) == {"jax_ops.core.op"}
