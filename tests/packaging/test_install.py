"""DLCP stands alone: a non-editable install into a new venv trains from any directory.

The slow tests build the wheel once (the C++ data path through scikit-build-core and nanobind,
from the package index) and install it into new venvs: one with only the ``torch``, ``mnist1d``
and ``converge`` extras runs ``dlcp converge`` from outside the source tree; one with the
``testbed`` extra runs ``dlcp run --workload mnist1d`` on BMv2 switches (root, BMv2 and Mininet
present). So nothing installed may lean on the checkout (``examples/``, ``p4/``, a
``PYTHONPATH``). The fast tests guard the same property without building anything.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import venv
from collections.abc import Sequence
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
#: Names a user's site-packages must not get from us: the repository's folders of these names
#: install as dlcp.hostagent, dlcp.controller and dlcp.topologies.
GENERIC = ("hostagent", "controller", "topologies")


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
    code = ("import sys, dlcp_torch, dlcp_torch.workloads, dlcp.hostagent.policy, dlcp.topologies.converge_run; "
            "print(sorted(m for m in ('torch', 'sklearn', 'mnist1d', 'matplotlib', 'scipy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "[]", proc.stdout


# ------------------------------------------------------------------------- the install, for real

def _run(cmd: Sequence[object], cwd: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def _tail(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this checkout, built once (not editable) for every venv below; skips (one line)
    when building or fetching cannot happen here."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to build the data path")
    root = tmp_path_factory.mktemp("wheel")
    try:
        venv.EnvBuilder(with_pip=True).create(root / "venv")
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create a venv with pip here ({exc})")
    pip = [root / "venv" / "bin" / "python", "-m", "pip"]
    probe = _run(pip + ["download", "--no-deps", "-d", root / "probe", "nanobind", "scikit-build-core"], root, 300)
    if probe.returncode != 0:
        pytest.skip("the package index is unreachable (the build needs nanobind and scikit-build-core from it)")
    # a build directory of its own, so the checkout's editable build (build/) is neither reused nor touched
    built = _run(pip + ["wheel", "--no-deps", "-C", f"build-dir={root / 'build'}", "-w", root / "dist", REPO],
                 root, 1200)
    assert built.returncode == 0, f"pip wheel {REPO} failed: {_tail(built)}"
    (found,) = (root / "dist").glob("dlcp-*.whl")
    return found


def _venv_with(wheel: Path, root: Path, extras: str) -> Path:
    """A new venv under ``root`` with torch's CPU build and ``dlcp[extras]`` from ``wheel``."""
    venv.EnvBuilder(with_pip=True).create(root / "venv")
    pip = [root / "venv" / "bin" / "python", "-m", "pip"]
    got_torch = _run(pip + ["install", TORCH], root, 900)
    if got_torch.returncode != 0:
        pytest.skip(f"cannot install {TORCH} here: {got_torch.stderr.strip().splitlines()[-1:]}")
    got = _run(pip + ["install", f"dlcp[{extras}] @ {wheel.as_uri()}"], root, 900)
    assert got.returncode == 0, f"pip install {wheel.name}[{extras}] failed: {_tail(got)}"
    return root / "venv"


def _outside_env(venv_dir: Path, tmp_path: Path) -> dict[str, str]:
    """The environment of a user of ``venv_dir``: its programs first, no source tree on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}", DLCP_CACHE_DIR=str(tmp_path / "cache"))
    return env


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    """A training environment: torch's CPU build and ``dlcp[torch,mnist1d,converge]``."""
    return _venv_with(wheel, tmp_path_factory.mktemp("install"), EXTRAS)


@pytest.mark.packaging
@pytest.mark.timeout(2400)
def test_a_non_editable_install_runs_dlcp_converge_and_version_from_any_directory(fresh_venv, tmp_path):
    bin_ = fresh_venv / "bin"
    env = _outside_env(fresh_venv, tmp_path)
    # installed, compiled, and without the source tree or what a training environment does not need
    code = ("import importlib.util as u, dlcp.hostagent as h, dlcp.hostagent._datapath, dlcp_torch.workloads; "
            "print(h.__file__); "
            f"print(sorted(m for m in {NOT_INSTALLED + ('examples',) + GENERIC!r} if u.find_spec(m)))")
    proc = _run([bin_ / "python", "-c", code], tmp_path, 120, env)
    assert proc.returncode == 0, _tail(proc)
    where, extra = proc.stdout.split("\n")[:2]
    assert str(fresh_venv) in where and str(REPO) not in where, where
    assert extra == "[]", f"a training environment got {extra}"
    # what the install put at the top of site-packages (its RECORD): DLCP's own names only
    record = next((fresh_venv / "lib").glob("python3*/site-packages/dlcp-*.dist-info/RECORD"))
    tops = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines() if line}
    assert {t for t in tops if not t.startswith("dlcp")} <= {"..", "bin"} and "dlcp" in tops, sorted(tops)

    # the compiled P4 program goes with the package (the testbed and dlcpctl read it)
    code = "import dlcp.controller.pipeline as p; print(p.BMV2_JSON.exists() and p.P4INFO.exists(), p.BUILD_DIR)"
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


#: Debian's Mininet (not on the package index); the Makefile links it into its venv the same way.
MININET = Path("/usr/lib/python3/dist-packages/mininet")


@pytest.mark.packaging
@pytest.mark.bmv2
@pytest.mark.root
@pytest.mark.timeout(2400)
def test_a_non_editable_install_runs_the_testbed_from_any_directory(wheel, tmp_path):
    """``dlcp run --workload mnist1d`` on BMv2 switches from an installed copy: the P4 program,
    the agents and the workload all come from the venv, none from the checkout."""
    if not MININET.is_dir():
        pytest.skip(f"needs Debian's Mininet package ({MININET})")
    venv_dir = _venv_with(wheel, tmp_path / "install", "torch,mnist1d,testbed")
    (site,) = (venv_dir / "lib").glob("python3*/site-packages")
    (site / "mininet").symlink_to(MININET)
    env = _outside_env(venv_dir, tmp_path)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    out = tmp_path / "runs"
    proc = _run([venv_dir / "bin" / "dlcp", "run", "--topology", "star", "--workers", "2", "--workload", "mnist1d",
                 "--iterations", "4", "--eval-every", "2", "--capacity", "5000", "--quiet", "--out", out],
                cwd, 900, env)
    assert proc.returncode == 0, _tail(proc)
    (run_dir,) = out.iterdir()
    results = json.loads((run_dir / "results.json").read_text())
    assert results["options"]["workload"] == "mnist1d", results["options"]
    ran = {r["scheme"]: len(r["iterations"]) for r in results["runs"]}
    assert set(ran) == {"baseline", "dlcp"} and min(ran.values()) >= 4, ran
    # the runner ran from the venv, outside any checkout (inside one it would record a commit), and
    # no agent fell back on the checkout (a traceback would name its files)
    assert results["provenance"]["commit"] is None, results["provenance"]
    logs = "\n".join(p.read_text(errors="replace") for p in run_dir.rglob("*.log"))
    assert str(REPO) not in logs, "an agent ran code from the source tree"
