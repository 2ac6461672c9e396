"""One direction of dependency: every package imports only from layers below its own.

Layers, bottom to top: ``hostagent`` (transport, policy, wire format); ``controller`` and
``dlcp_torch`` (the switches' controller and PyTorch's integration, neither importing the
other); ``topologies`` (the Mininet testbed and its experiments); ``dlcp_sim`` (the ns-3
simulator, which reuses the testbed's schemes and workloads); ``dlcp`` (the program, which
gathers every layer's commands); ``examples`` and ``bench`` (scripts over all of it). A package
never imports one above it nor one beside it in its layer, and no module imports its way back to
itself. Inside ``hostagent`` the protocol core stays I/O-free: nothing it reaches imports the
data path, the transport or the exchange, and the data path reaches neither of the latter two.

Imports are read with :mod:`ast` wherever they are (module level, functions, ``TYPE_CHECKING``
blocks), so a lazy import counts as much as any other. ``tests`` is outside the layers: it may
import anything. There is no exception list.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Bottom to top; packages in one layer do not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("hostagent",),
    ("controller", "dlcp_torch"),
    ("topologies",),
    ("dlcp_sim",),
    ("dlcp",),
    ("examples", "bench"),
)
LAYER_OF = {pkg: level for level, pkgs in enumerate(LAYERS) for pkg in pkgs}
#: Folders of the repository that install inside the ``dlcp`` package (``hostagent/`` is
#: ``dlcp.hostagent``): the rules are about layers, whatever name a layer imports by.
INSIDE_DLCP = ("hostagent", "controller", "topologies")
#: Free to import any layer, and imported by none.
UNLAYERED = ("tests",)

#: Inside hostagent: what each part must not reach, directly or through other modules.
HOSTAGENT_RULES: dict[str, tuple[str, ...]] = {
    "dlcp.hostagent.protocol": ("dlcp.hostagent.datapath", "dlcp.hostagent.transport", "dlcp.hostagent.exchange"),
    "dlcp.hostagent.datapath": ("dlcp.hostagent.transport", "dlcp.hostagent.exchange"),
}


def _module_name(path: Path) -> str:
    """``hostagent/protocol/core.py`` -> ``dlcp.hostagent.protocol.core``; a package is its ``__init__``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in INSIDE_DLCP:
        parts.insert(0, "dlcp")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    """The layer (a key of LAYER_OF) a dotted module name belongs to."""
    parts = module.split(".")
    return parts[1] if parts[0] == "dlcp" and len(parts) > 1 and parts[1] in INSIDE_DLCP else parts[0]


def _files(pkg: str) -> list[Path]:
    """The package's own modules: ``dlcp/hostagent`` etc. are links to the folders beside it."""
    return sorted(f for f in (ROOT / pkg).rglob("*.py")
                  if not any((ROOT / folder).is_symlink() for folder in f.relative_to(ROOT).parents))


def _modules() -> dict[str, Path]:
    """Every module of every layered package, by dotted name."""
    return {_module_name(f): f for pkg in LAYER_OF for f in _files(pkg)}


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every import in ``path``, relative ones resolved and ``from X import Y``
    read as ``X.Y`` when Y is a module; a name outside the repository's packages is kept as written."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                yield node.lineno, sub if sub in MODULES else module


def _known(module: str) -> str | None:
    """The repository module ``module`` names (its longest known prefix), or None for a third party's."""
    while module and module not in MODULES:
        module = module.rpartition(".")[0]
    return module or None


def _graph() -> dict[str, dict[str, int]]:
    """Module -> {imported repository module: first line importing it}."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in MODULES.items():
        edges: dict[str, int] = {}
        for line, imported in _imports(name, path):
            target = _known(imported)
            if target is not None and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


GRAPH = _graph()


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


def test_every_package_has_a_layer():
    """A new top-level package fails here until it is placed, so no package escapes the rules."""
    generated = {line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
                 if line.strip().endswith("/") and not line.startswith("!")}
    found = {d.name for d in ROOT.iterdir()
             if d.is_dir() and not d.name.startswith(".") and d.name not in generated and any(d.rglob("*.py"))}
    assert found - set(UNLAYERED) == set(LAYER_OF), "place the package in LAYERS (and docs/README.md)"


@pytest.mark.parametrize("pkg", sorted(LAYER_OF))
def test_imports_only_go_down(pkg):
    wrong = []
    for module, edges in GRAPH.items():
        if _layer(module) != pkg:
            continue
        for target, line in sorted(edges.items()):
            other = _layer(target)
            if other == pkg or LAYER_OF[other] < LAYER_OF[pkg]:
                continue
            how = "beside it in its layer" if LAYER_OF[other] == LAYER_OF[pkg] else "above it"
            wrong.append(f"{_where(module, line)} imports {target} ({how})")
    for path in _files(pkg):
        for line, imported in _imports(_module_name(path), path):
            if imported.split(".")[0] in UNLAYERED:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {imported} (tests)")
    assert wrong == []


def test_no_module_imports_its_way_back_to_itself():
    """Module by module across every package, lazy imports included: a cycle at any depth fails."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                loop = path[path.index(target):] + [target]
                cycles.append(" -> ".join(loop))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


@pytest.mark.parametrize("part", sorted(HOSTAGENT_RULES))
def test_hostagent_parts_keep_their_direction(part):
    """The protocol core is I/O-free (fake-clock tests drive it alone); the data path moves bytes
    for whoever holds it. What a part reaches through any chain of imports counts."""
    forbidden = HOSTAGENT_RULES[part]
    reached: dict[str, str] = {}  # module -> the module that first imported it
    todo = [m for m in GRAPH if m == part or m.startswith(part + ".")]
    assert todo, f"{part} is gone: update HOSTAGENT_RULES"
    for m in todo:
        reached[m] = m
    while todo:
        module = todo.pop()
        for target in GRAPH[module]:
            if target not in reached:
                reached[target] = module
                todo.append(target)
    wrong = []
    for module in sorted(reached):
        if any(module == f or module.startswith(f + ".") for f in forbidden):
            chain = [module]
            while reached[chain[-1]] != chain[-1]:
                chain.append(reached[chain[-1]])
            wrong.append(" <- ".join(chain))
    assert wrong == []


def test_the_reader_sees_lazy_relative_and_from_imports(tmp_path):
    """The rules are only as good as the import reader: a function's import, a relative one and
    ``from package import module`` all name the module they load."""
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from dlcp_sim import run\n    from . import commands\n\n    import dlcp.cli\n")
    assert list(_imports("dlcp.topologies.x", src)) == [(2, "dlcp_sim.run"), (3, "dlcp.topologies.commands"),
                                                         (5, "dlcp.cli")]
