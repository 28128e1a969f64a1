"""The loud extension-import failure (jax_ops/_extension.py), `python -m jax_ops.info`,
and which jax_ops the tests import (CI tests the installed wheel, not the checkout).

Both run in a subprocess: a failed `import jax_ops` is simulated there by putting
None at sys.modules["jax_ops._ffi"] (so `from jax_ops import _ffi` raises ImportError),
and jax_ops imports only once per process.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

BREAK_EXTENSION = "import sys; sys.modules['jax_ops._ffi'] = None; "


def _run(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("PYTHONWARNINGS", None)  # the interpreter's default filters
    cmd = [sys.executable, *args] + (["-c", code] if code is not None else [])
    # Not from the checkout: `-c`/`-m` put the working directory first on sys.path, and
    # the checkout's jax_ops/ has no compiled extension unless installed in place.
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300,
                          cwd=tempfile.gettempdir())
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_extension_import_failure_warns_once():
    code = BREAK_EXTENSION + """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import jax_ops
    import jax_ops._extension, jax_ops.ops.layer_norm  # again: no second warning
ours = [w for w in caught if "jax_ops._ffi" in str(w.message)]
print(json.dumps({"messages": [str(w.message) for w in ours],
                  "categories": [w.category.__name__ for w in ours],
                  "user": [issubclass(w.category, UserWarning) for w in ours],
                  "impls": jax_ops.implementations("layer_norm")}))
"""
    out = json.loads(_run(code=code).stdout.strip().splitlines()[-1])
    assert len(out["messages"]) == 1, out
    assert out["categories"] == ["ExtensionImportWarning"] and out["user"] == [True]
    message = out["messages"][0]
    assert "ModuleNotFoundError: import of jax_ops._ffi halted" in message, message  # the error
    assert '"xla" implementations' in message, message
    assert "xla" in out["impls"]


def test_extension_import_failure_is_shown_by_default():
    # No filters set: a UserWarning subclass reaches stderr (ImportWarning would not).
    proc = _run(code=BREAK_EXTENSION + "import jax_ops")
    assert proc.stderr.count("ExtensionImportWarning") == 1, proc.stderr
    assert "jax_ops._ffi failed to import" in proc.stderr


def test_no_warning_when_the_extension_loads():
    from jax_ops import _extension
    if _extension.IMPORT_ERROR is not None:
        pytest.skip(f"the extension does not load here: {_extension.IMPORT_ERROR}")
    proc = _run("-W", "error::UserWarning", code="import jax_ops")
    assert "ExtensionImportWarning" not in proc.stderr


SECTIONS = ("versions:", "  jax: ", "  jaxlib: ", "  flax: ", "  jax_ops: ", "  python: ",
            "devices:", "extension (jax_ops._ffi):", "CUDA kernels built:", "dispatch:",
            "autotune cache:")


def test_info_runs_on_cpu():
    proc = _run("-m", "jax_ops.info")
    out = proc.stdout
    for section in SECTIONS:
        assert section in out, f"{section!r} missing from:\n{out}"
    assert "platform cpu" in out, out
    assert "heuristics" in out, out  # no GPU: no measured table applies
    from jax_ops import _extension, tuning
    assert str(tuning.cache_path()) in out, out
    if _extension.IMPORT_ERROR is None:
        assert "loaded: yes" in out, out


def test_info_reports_a_broken_extension():
    proc = _run(code=BREAK_EXTENSION + "from jax_ops import info; info.main()")
    assert "loaded: no (ModuleNotFoundError: import of jax_ops._ffi halted" in proc.stdout, proc.stdout
    assert "CUDA kernels built: no" in proc.stdout, proc.stdout


def test_ci_tests_the_installed_wheel_not_the_checkout():
    """CI's test runs (under .ci/installed-env: the README's test command and stage 2)
    must exercise the wheel installed into the venv: pytest's rootdir, the working
    directory or an editable install could otherwise put the checkout's jax_ops first on
    sys.path, and CI would pass without testing what users install. The wrapper sets
    JAX_OPS_EXPECT_INSTALLED=1 and hides nvcc; elsewhere this test is skipped, saying
    where jax_ops comes from (-ra prints it)."""
    import jax_ops
    from jax_ops import _extension
    package = Path(jax_ops.__file__).resolve().parent
    if os.environ.get("JAX_OPS_EXPECT_INSTALLED") != "1":
        pytest.skip(f"jax_ops imported from {package}; JAX_OPS_EXPECT_INSTALLED=1 "
                    f"(.ci/installed-env) checks that it is an installed wheel")
    print(f"jax_ops imported from {package}")
    checkout = Path(__file__).resolve().parents[1]
    site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    assert package != checkout / "jax_ops", f"the tests import the checkout's jax_ops ({package})"
    assert package.parent in site, \
        f"jax_ops imported from {package}, not from this venv's site-packages {sorted(map(str, site))}"
    dist = importlib.metadata.distribution("jax_ops")
    origin = json.loads(dist.read_text("direct_url.json") or "{}")
    assert "archive_info" in origin and origin.get("url", "").endswith(".whl"), \
        f"jax_ops was not installed from a wheel file: its direct_url.json is {origin}"
    installed = {f.as_posix() for f in dist.files or ()}
    assert "jax_ops/__init__.py" in installed, sorted(installed)[:20]
    assert _extension.IMPORT_ERROR is None, f"the wheel's extension does not load: {_extension.IMPORT_ERROR}"
    ffi = Path(_extension._ffi.__file__).resolve()
    assert ffi.parent == package and f"jax_ops/{ffi.name}" in installed, \
        f"the extension {ffi} is not the wheel's (package {package})"
    assert shutil.which("nvcc") is None, f"nvcc is on PATH: {shutil.which('nvcc')}"
