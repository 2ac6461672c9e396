"""DLCP stands alone: a non-editable install into a new venv trains from any directory.

The slow test builds the wheel (the C++ data path through scikit-build-core and nanobind, from
the package index) into a fresh venv with only the ``torch``, ``mnist1d`` and ``converge``
extras, and runs ``dlcp converge`` from outside the source tree, so nothing installed may lean
on the checkout (``examples/``, ``p4/``, a ``PYTHONPATH``). The fast tests guard the same
property without building anything.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: What the wheel ships (pyproject's wheel.packages) plus the benchmarks, which run from a clone
#: but must not need the examples either.
INSTALLED = ("hostagent", "controller", "dlcp_torch", "topologies", "dlcp_sim", "dlcp", "bench")
#: The CPU build the Makefile installs; installed first so the torch extra keeps it.
TORCH = "torch==2.13.0"
#: Extras a training environment running ``dlcp converge`` on MNIST-1D needs.
EXTRAS = "torch,mnist1d,converge"
#: What a training environment must not pull in (the testbed's and the digits' extras).
NOT_INSTALLED = ("scapy", "p4runtime_sh", "p4", "grpc", "sklearn", "psutil")


def _imported_modules(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports, wherever in the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_nothing_installed_imports_the_examples():
    offenders = [str(p.relative_to(REPO)) for d in INSTALLED for p in sorted((REPO / d).rglob("*.py"))
                 if "examples" in _imported_modules(p)]
    assert not offenders, f"import examples/ (not packaged): {offenders}"


def test_the_examples_run_from_any_directory(tmp_path):
    """The examples are thin scripts over the installed package: no source tree on sys.path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for script in ("train_digits.py", "train_mnist1d.py", "synthetic_resnet50.py"):
        proc = subprocess.run([sys.executable, str(REPO / "examples" / script), "--help"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (script, proc.stderr[-2000:])


def test_the_core_imports_without_torch():
    """``dlcp_torch`` and its workload registry load without torch, so the host side stays light."""
    code = ("import sys, dlcp_torch, dlcp_torch.workloads, hostagent.policy, topologies.converge_run; "
            "print(sorted(m for m in ('torch', 'sklearn', 'mnist1d', 'matplotlib', 'scipy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "[]", proc.stdout


# ------------------------------------------------------------------------- the install, for real

def _run(cmd: list[str], cwd: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def _tail(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A new venv with torch's CPU build and ``dlcp[torch,mnist1d,converge]`` built from this
    checkout, not editable; skips (one line) when building or fetching cannot happen here."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to build the data path")
    root = tmp_path_factory.mktemp("install")
    try:
        venv.EnvBuilder(with_pip=True).create(root / "venv")
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create a venv with pip here ({exc})")
    pip = [root / "venv" / "bin" / "python", "-m", "pip"]
    probe = _run(pip + ["download", "--no-deps", "-d", root / "probe", "nanobind", "scikit-build-core"], root, 300)
    if probe.returncode != 0:
        pytest.skip("the package index is unreachable (the build needs nanobind and scikit-build-core from it)")
    got_torch = _run(pip + ["install", TORCH], root, 900)
    if got_torch.returncode != 0:
        pytest.skip(f"cannot install {TORCH} here: {got_torch.stderr.strip().splitlines()[-1:]}")
    # a build directory of its own, so the checkout's editable build (build/) is neither reused nor touched
    built = _run(pip + ["install", "-C", f"build-dir={root / 'build'}", f"{REPO}[{EXTRAS}]"], root, 1200)
    assert built.returncode == 0, f"pip install {REPO}[{EXTRAS}] failed: {_tail(built)}"
    return root / "venv"


@pytest.mark.packaging
@pytest.mark.timeout(2400)
def test_a_non_editable_install_runs_dlcp_converge_and_version_from_any_directory(fresh_venv, tmp_path):
    bin_ = fresh_venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_}{os.pathsep}{env.get('PATH', '')}", DLCP_CACHE_DIR=str(tmp_path / "cache"))
    # installed, compiled, and without the source tree or what a training environment does not need
    code = ("import importlib.util as u, hostagent, hostagent._datapath, dlcp_torch.workloads; "
            "print(hostagent.__file__); "
            f"print(sorted(m for m in {NOT_INSTALLED + ('examples',)!r} if u.find_spec(m)))")
    proc = _run([bin_ / "python", "-c", code], tmp_path, 120, env)
    assert proc.returncode == 0, _tail(proc)
    where, extra = proc.stdout.split("\n")[:2]
    assert str(fresh_venv) in where and str(REPO) not in where, where
    assert extra == "[]", f"a training environment got {extra}"

    # the compiled P4 program goes with the package (the testbed and dlcpctl read it)
    code = "import controller.pipeline as p; print(p.BMV2_JSON.exists() and p.P4INFO.exists(), p.BUILD_DIR)"
    proc = _run([bin_ / "python", "-c", code], tmp_path, 120, env)
    assert proc.returncode == 0, _tail(proc)
    found, where = proc.stdout.split()
    assert found == "True" and str(fresh_venv) in where, proc.stdout

    found_version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert found_version is not None
    version = found_version.group(1)
    proc = _run([bin_ / "dlcp", "--version"], tmp_path, 120, env)
    assert proc.returncode == 0 and proc.stdout.strip() == f"dlcp {version}", _tail(proc)

    out = tmp_path / "study"
    proc = _run([bin_ / "dlcp", "converge", "--seeds", "1", "--bounds", "0.1", "--workers", "2", "--steps", "30",
                 "--eval-every", "10", "--error-feedback", "off", "--patterns", "ps", "--out", out], tmp_path, 900, env)
    assert proc.returncode == 0, _tail(proc)
    assert "study directory" in proc.stdout
    assert (out / "converge.csv").exists() and (out / "converge.md").exists()
    assert (out / "accuracy-vs-bound.png").exists()
