"""BUILD.bazel and MODULE.bazel stay consistent with the CMake build and the source tree.

CI has no Bazel, so this reads the Bazel files as data instead: Starlark is syntactically
a subset of Python, so `ast` parses them, and only literal strings and lists, `glob([...])`,
`select({...})`, names bound to those at top level and `+` are evaluated (nothing is
executed). Checked: the handler and module sources equal CMakeLists.txt's; the handler
libraries' headers cover cuda_src/ and ffi/*.h; the py_library targets cover every module
and data file of pyproject.toml's wheel packages; every path, glob and local label in
BUILD.bazel names something that exists; every external repository BUILD.bazel uses is
declared in MODULE.bazel; the requirements lock pins versions inside pyproject.toml's ranges.
Not checked: that Bazel can fetch, analyze or build any of it."""
from __future__ import annotations

import ast
import fnmatch
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "BUILD.bazel"
MODULE = ROOT / "MODULE.bazel"
# Directories no glob of BUILD.bazel may reach into (.bazelignore, tool output).
SKIP_DIRS = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache"}
PATH_ATTRS = ("srcs", "hdrs", "textual_hdrs", "data", "src", "main", "deps", "actual")


# --- a minimal, literal-only Starlark reader ------------------------------------------------

@dataclass(frozen=True)
class Glob:
    include: tuple[str, ...]
    exclude: tuple[str, ...] = ()


@dataclass
class Rule:
    kind: str
    name: str
    attrs: dict = field(default_factory=dict)
    line: int = 0


class Opaque:
    """A value this reader does not evaluate (a function call other than glob/select)."""


def _evaluate(node: ast.AST, env: dict):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return env.get(node.id, Opaque())
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_evaluate(e, env) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_evaluate(k, env): _evaluate(v, env) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _evaluate(node.left, env), _evaluate(node.right, env)
        return _as_list(left) + _as_list(right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        args = [_evaluate(a, env) for a in node.args]
        kwargs = {k.arg: _evaluate(k.value, env) for k in node.keywords}
        if node.func.id == "glob":
            include = args[0] if args else kwargs.get("include", [])
            return [Glob(tuple(include), tuple(kwargs.get("exclude", [])))]
        if node.func.id == "select":
            # Every branch can be taken: the union of their values.
            return [item for branch in args[0].values() for item in _as_list(branch)]
    return Opaque()


def _as_list(value) -> list:
    if isinstance(value, list):
        return value
    if isinstance(value, Opaque):
        return []
    return [value]


@dataclass
class Starlark:
    rules: dict[str, Rule]          # targets by name
    calls: list[tuple[str, list, dict]]  # every top-level call: (function, args, kwargs)
    loads: list[str]                # the labels of the load() statements
    env: dict


def read_starlark(path: Path) -> Starlark:
    tree = ast.parse(path.read_text(), filename=str(path))
    env: dict = {}
    rules: dict[str, Rule] = {}
    calls: list[tuple[str, list, dict]] = []
    loads: list[str] = []
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            env[stmt.targets[0].id] = _evaluate(stmt.value, env)
            continue
        if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
            continue
        call = stmt.value
        func = ast.unparse(call.func)
        kwargs = {k.arg: _evaluate(k.value, env) for k in call.keywords if k.arg}
        if func == "load":
            loads.append(_evaluate(call.args[0], env))
            continue
        calls.append((func, [_evaluate(a, env) for a in call.args], kwargs))
        if isinstance(kwargs.get("name"), str):
            rules[kwargs["name"]] = Rule(func, kwargs["name"], kwargs, stmt.lineno)
    return Starlark(rules, calls, loads, env)


# --- files and globs -----------------------------------------------------------------------------

def _repo_files() -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith("bazel-")]
        rel = Path(dirpath).relative_to(ROOT)
        files.extend((rel / f).as_posix() for f in filenames)
    return sorted(files)


FILES = _repo_files()


def _match_segments(pattern: list[str], path: list[str]) -> bool:
    if not pattern:
        return not path
    if pattern[0] == "**":  # any number of directories, zero included
        return any(_match_segments(pattern[1:], path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], pattern[0]) and _match_segments(pattern[1:], path[1:])


def glob_match(pattern: str, path: str) -> bool:
    """Bazel's glob: `*` stays within one path segment, `**` spans any number of them."""
    return _match_segments(pattern.split("/"), path.split("/"))


def expand(items, *, files=FILES) -> set[str]:
    """The repository files that a srcs/hdrs/data value names (labels are left out)."""
    out: set[str] = set()
    for item in _as_list(items):
        if isinstance(item, Glob):
            out.update(f for f in files
                       if any(glob_match(p, f) for p in item.include)
                       and not any(glob_match(p, f) for p in item.exclude))
        elif isinstance(item, str) and not item.startswith((":", "@", "//")):
            out.add(item)
    return out


def local_labels(items) -> set[str]:
    """Target names of the `:name` labels in a value."""
    return {i[1:] for i in _as_list(items) if isinstance(i, str) and i.startswith(":")}


@pytest.fixture(scope="module")
def build() -> Starlark:
    return read_starlark(BUILD)


@pytest.fixture(scope="module")
def module() -> Starlark:
    return read_starlark(MODULE)


def _rule(build: Starlark, name: str) -> Rule:
    assert name in build.rules, f"BUILD.bazel has no target //:{name}"
    return build.rules[name]


def _handler_rules(build: Starlark) -> list[Rule]:
    """The libraries //:ffi_handlers chooses from (the C++ and the CUDA build)."""
    alias = _rule(build, "ffi_handlers")
    names = sorted(local_labels(alias.attrs.get("actual")))
    rules = [_rule(build, n) for n in names]
    kinds = sorted(r.kind for r in rules)
    assert kinds == ["cc_library", "cuda_library"], (
        f"//:ffi_handlers should select between a cc_library and a cuda_library, got {kinds}")
    return rules


def _names(files) -> str:
    return ", ".join(sorted(files))


def _cmake_list(pattern: str) -> list[str]:
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(pattern, text, re.S)
    assert m, f"CMakeLists.txt: no match for {pattern!r}"
    return m.group(1).split()


# --- (a) sources equal CMake's ---------------------------------------------------------------------

def test_handler_sources_match_cmake(build):
    cmake = set(_cmake_list(r"set\(JAX_OPS_HANDLER_SOURCES\s+([^)]*)\)"))
    assert cmake, "CMakeLists.txt's JAX_OPS_HANDLER_SOURCES is empty"
    for rule in _handler_rules(build):
        srcs = expand(rule.attrs.get("srcs"))
        assert not cmake - srcs, (f"{_names(cmake - srcs)}: in CMakeLists.txt's JAX_OPS_HANDLER_SOURCES"
                                  f" but not in the srcs of //:{rule.name}")
        assert not srcs - cmake, (f"{_names(srcs - cmake)}: in the srcs of //:{rule.name}"
                                  " but not in CMakeLists.txt's JAX_OPS_HANDLER_SOURCES")


def test_module_source_matches_cmake(build):
    cmake = {t for t in _cmake_list(r"nanobind_add_module\(\s*_ffi\s+([^)]*)\)") if "/" in t}
    assert cmake == {"ffi/module.cc"}, f"unexpected nanobind_add_module(_ffi ...) sources {cmake}"
    rule = _rule(build, "_ffi")
    assert rule.kind == "nanobind_extension", f"//:_ffi is a {rule.kind}, not a nanobind_extension"
    srcs = expand(rule.attrs.get("srcs"))
    assert not cmake - srcs, f"{_names(cmake - srcs)}: CMake's _ffi module source but not in the srcs of //:_ffi"
    assert not srcs - cmake, f"{_names(srcs - cmake)}: in the srcs of //:_ffi but not CMake's _ffi module source"
    assert "ffi_handlers" in local_labels(rule.attrs.get("deps")), "//:_ffi does not depend on //:ffi_handlers"


def test_every_ffi_source_is_built(build):
    built = expand(_rule(build, "_ffi").attrs.get("srcs"))
    for rule in _handler_rules(build):
        built |= expand(rule.attrs.get("srcs"))
    missing = [f for f in FILES if glob_match("ffi/*.cc", f) and f not in built]
    assert not missing, f"{_names(missing)}: compiled by no target of BUILD.bazel"


# --- (b) headers -----------------------------------------------------------------------------------

def test_handler_headers_cover_cuda_src_and_ffi_headers(build):
    wanted = [f for f in FILES if glob_match("cuda_src/*", f) or glob_match("ffi/*.h", f)]
    assert wanted, "no files in cuda_src/ or ffi/*.h"
    for rule in _handler_rules(build):
        hdrs = expand(rule.attrs.get("hdrs")) | expand(rule.attrs.get("textual_hdrs"))
        missing = [f for f in wanted if f not in hdrs]
        assert not missing, f"{_names(missing)}: not in the hdrs/textual_hdrs of //:{rule.name}"


# --- (c) Python packages ---------------------------------------------------------------------------

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
WHEEL_PACKAGES = PYPROJECT["tool"]["scikit-build"]["wheel"]["packages"]


@pytest.mark.parametrize("package", WHEEL_PACKAGES)
def test_py_library_covers_package(build, package):
    rule = _rule(build, package)
    assert rule.kind == "py_library", f"//:{package} is a {rule.kind}, not a py_library"
    srcs, data = expand(rule.attrs.get("srcs")), expand(rule.attrs.get("data"))
    modules = [f for f in FILES if glob_match(f"{package}/**/*.py", f)]
    assert modules, f"no Python files in {package}/"
    missing = [f for f in modules if f not in srcs]
    assert not missing, f"{_names(missing)}: not in the srcs of //:{package}"
    # Package data (jax_ops/tables/*.json): what the wheel ships besides modules and
    # the extension the build makes.
    missing = [f for f in FILES if f.startswith(package + "/") and f not in data
               and Path(f).suffix not in (".py", ".pyc", ".so", ".pyd")]
    assert not missing, f"{_names(missing)}: not in the data of //:{package}"


def test_jax_ops_library_wiring(build):
    jax_ops = _rule(build, "jax_ops")
    assert "pallas_kernels" in local_labels(jax_ops.attrs.get("deps")), \
        "//:jax_ops does not depend on //:pallas_kernels"
    # The extension reaches the package as jax_ops/_ffi.so, a copy of //:_ffi.
    copies = [r for r in build.rules.values()
              if r.kind == "copy_file" and r.attrs.get("src") == ":_ffi"]
    assert [r.attrs.get("out") for r in copies] == ["jax_ops/_ffi.so"], \
        "//:_ffi is not copied to jax_ops/_ffi.so"
    data = local_labels(jax_ops.attrs.get("data"))
    assert copies[0].name in data or "jax_ops/_ffi.so" in data, \
        "jax_ops/_ffi.so is not in the data of //:jax_ops"


def test_tests_and_bench_targets(build):
    tests = _rule(build, "tests")
    assert tests.kind == "py_test" and tests.attrs.get("main_module") == "pytest", \
        "//:tests is not a py_test running pytest"
    srcs, data = expand(tests.attrs.get("srcs")), expand(tests.attrs.get("data"))
    missing = [f for f in FILES if glob_match("tests/*.py", f) and f not in srcs]
    assert not missing, f"{_names(missing)}: not in the srcs of //:tests"
    # tests/test_examples.py imports examples/*.py
    missing = [f for f in FILES if glob_match("examples/*.py", f) and f not in data]
    assert not missing, f"{_names(missing)}: not in the data of //:tests"
    bench = _rule(build, "bench")
    assert bench.kind == "py_binary", f"//:bench is a {bench.kind}, not a py_binary"
    entry = PYPROJECT["project"]["scripts"]["jax-ops-bench"].split(":")[0]
    assert bench.attrs.get("main_module") == entry, \
        f"//:bench runs {bench.attrs.get('main_module')!r}, pyproject.toml's jax-ops-bench {entry!r}"


# --- (d) everything named exists -------------------------------------------------------------------

def test_every_path_and_glob_exists(build):
    outputs = {r.attrs["out"] for r in build.rules.values() if isinstance(r.attrs.get("out"), str)}
    names = set(build.rules) | outputs
    for rule in build.rules.values():
        for attr in PATH_ATTRS:
            value = rule.attrs.get(attr)
            for item in _as_list(value):
                where = f"{attr} of //:{rule.name} (BUILD.bazel line {rule.line})"
                if isinstance(item, Glob):
                    for p in item.include:
                        assert expand([Glob((p,), item.exclude)]), f"glob {p!r} in the {where} matches no file"
                elif isinstance(item, str) and item.startswith(":"):
                    assert item[1:] in names, f"{item} in the {where} is no target of BUILD.bazel"
                elif isinstance(item, str) and not item.startswith(("@", "//")):
                    assert item in outputs or (ROOT / item).is_file(), f"{item} in the {where} does not exist"
        module = rule.attrs.get("main_module")
        if isinstance(module, str) and module != "pytest":
            path = module.replace(".", "/") + ".py"
            assert (ROOT / path).is_file(), f"main_module {module} of //:{rule.name}: {path} does not exist"
    for name, value in build.env.items():  # top-level lists (HANDLER_SRCS, ...)
        for item in _as_list(value):
            if isinstance(item, Glob):
                for p in item.include:
                    assert expand([Glob((p,), item.exclude)]), f"glob {p!r} ({name} in BUILD.bazel) matches no file"
            elif isinstance(item, str):
                assert (ROOT / item).is_file(), f"{item} ({name} in BUILD.bazel) does not exist"


def test_module_files_exist(module):
    for func, _, kwargs in module.calls:
        for key, value in kwargs.items():
            if isinstance(value, str) and value.startswith("//:"):
                assert (ROOT / value[3:]).is_file(), f"{value} ({func} {key} in MODULE.bazel) does not exist"


def test_external_repositories_are_declared(build, module):
    declared = {"bazel_tools"}
    for func, args, kwargs in module.calls:
        if func == "bazel_dep":
            declared.add(kwargs.get("repo_name") or kwargs["name"])
        elif func == "use_repo":  # use_repo(extension, "repo", ...)
            declared.update(a for a in args[1:] if isinstance(a, str))
    hub_aliases = {}
    for func, _, kwargs in module.calls:
        if func == "pip.parse":
            hub_aliases.update(kwargs.get("extra_hub_aliases") or {})
    referenced = set(build.loads)
    for rule in build.rules.values():
        for value in rule.attrs.values():
            referenced.update(i for i in _as_list(value) if isinstance(i, str))
    for label in sorted(referenced):
        if not label.startswith("@"):
            continue
        repo, _, target = label[1:].partition("//")
        assert repo in declared, f"{label} in BUILD.bazel: @{repo} is no bazel_dep or use_repo of MODULE.bazel"
        package, _, name = target.partition(":")
        if repo == "pypi" and name and name != package:  # an extra target of a wheel's repository
            assert name in hub_aliases.get(package, []), \
                f"{label} in BUILD.bazel is not in pip.parse's extra_hub_aliases of MODULE.bazel"


# --- (e) pins ----------------------------------------------------------------------------------------

def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(requirements: list[str]) -> dict[str, Requirement]:
    """{normalized name: Requirement} of requirement strings."""
    return {_normalize(r.name): r for r in map(Requirement, requirements)}


def _lock() -> dict[str, str]:
    lock = {}
    for line in (ROOT / "requirements_lock.txt").read_text().splitlines():
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s\\;]+)", line)
        if m:
            lock[_normalize(m.group(1))] = m.group(2)
    return lock


def test_requirements_lock_pins_match_pyproject():
    """pyproject.toml gives ranges (jax/jaxlib >=0.11.2,<0.13, ...); the lock pins one
    version of each, which must lie inside pyproject.toml's range, and jax and jaxlib
    must be pinned to the same version."""
    lock = _lock()
    project = PYPROJECT["project"]
    wanted = _requirements(project["dependencies"])
    assert wanted.get("jax") and wanted["jax"].specifier and wanted.get("jaxlib") \
        and wanted["jaxlib"].specifier, "pyproject.toml no longer constrains jax and jaxlib"
    extras = project.get("optional-dependencies", {})
    for extra in ("test", "bench"):
        wanted.update({k: v for k, v in _requirements(extras.get(extra, [])).items()
                       if k != "pytest-xdist"})
    for name, req in sorted(wanted.items()):
        assert name in lock, f"{name} (pyproject.toml) is not in requirements_lock.txt"
        assert req.specifier.contains(lock[name], prereleases=True), \
            f"{name}: requirements_lock.txt has {lock[name]}, outside pyproject.toml's {req}"
    assert lock["jax"] == lock["jaxlib"], \
        f"requirements_lock.txt pins jax {lock['jax']} but jaxlib {lock['jaxlib']}"
    # The extension is built against the oldest supported jaxlib's FFI headers (XLA
    # refuses handlers built with newer headers than its own: pyproject.toml says why).
    build = _requirements(PYPROJECT["build-system"]["requires"])["jaxlib"]
    pins = [s.version for s in build.specifier if s.operator == "=="]
    lowest = [s.version for s in wanted["jaxlib"].specifier if s.operator == ">="]
    assert len(pins) == 1 and lowest == pins, \
        f"pyproject.toml's build-system should pin jaxlib=={lowest}, the oldest supported; has {build}"


def test_python_version_matches_pyproject(module):
    toolchains = [kw["python_version"] for f, _, kw in module.calls if f == "python.toolchain"]
    parses = [kw for f, _, kw in module.calls if f == "pip.parse"]
    assert toolchains and parses, "MODULE.bazel has no python.toolchain or pip.parse"
    minimum = re.match(r">=\s*(\d+\.\d+)", PYPROJECT["project"]["requires-python"]).group(1)
    for version in toolchains + [kw.get("python_version") for kw in parses]:
        assert version == minimum, f"MODULE.bazel uses Python {version}, pyproject.toml requires-python {minimum}"
    for kw in parses:
        assert kw.get("requirements_lock") == "//:requirements_lock.txt", \
            "pip.parse does not read //:requirements_lock.txt"
