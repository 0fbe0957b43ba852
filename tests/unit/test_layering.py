"""The package's layering, read from the source with ``ast`` (no import runs, no Ray).

A module imports only from floors below it and nothing imports in a circle: a circle means
a piece sits in the wrong room, and one hidden under ``TYPE_CHECKING`` or inside a function
is still a circle of meaning, so every import statement counts here, wherever it stands.
The store is split by the side of the Ray boundary a file runs on: ``store/engine/`` (in an
engine's process) and ``store/shard/`` (in a shard actor or the fleet's driver) share only
what lies at ``store/`` itself (types, the ``BlockStore`` ABC, placement, checksums, the
published index's layout).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "ucm_ray"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _imported(module: str, path: Path) -> Iterator[str]:
    """Every module name an import statement of ``module`` names, absolute, in any block
    (``TYPE_CHECKING``, functions); ``from a import b`` names ``a.b`` as well as ``a``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _graph() -> dict[str, set[str]]:
    """Our module -> the names it imports (ours resolved to modules, others as written)."""
    sources = _sources()
    graph: dict[str, set[str]] = {}
    for module, path in sources.items():
        names = set()
        for name in _imported(module, path):
            if name.split(".")[0] != PACKAGE:
                names.add(name)
            elif name in sources and name != module:
                names.add(name)
        graph[module] = names
    return graph


GRAPH = _graph()


def _ours(names: set[str]) -> set[str]:
    return {name for name in names if name.split(".")[0] == PACKAGE}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _cycle() -> list[str] | None:
    """One import circle among our modules, as the path around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(_ours(GRAPH.get(module, set()))):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(GRAPH):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def test_the_graph_sees_the_package():
    assert f"{PACKAGE}.store.blockstore" in GRAPH
    assert f"{PACKAGE}.store.types" in _ours(GRAPH[f"{PACKAGE}.store.blockstore"])


def test_no_module_imports_in_a_circle():
    cycle = _cycle()
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("folder", ["store", "transport"])
def test_the_tier_never_imports_vllm(folder):
    """The store and its transports are usable without an engine."""
    offenders = {module: sorted(name for name in names if name.split(".")[0] == "vllm"
                                or _under(name, f"{PACKAGE}.vllm"))
                 for module, names in GRAPH.items() if _under(module, f"{PACKAGE}.{folder}")}
    assert not {module: names for module, names in offenders.items() if names}


def test_policy_imports_nothing_of_ours_nor_ray_nor_vllm():
    names = GRAPH[f"{PACKAGE}.policy"]
    assert not {name for name in names if name.split(".")[0] in (PACKAGE, "ray", "vllm")}


@pytest.mark.parametrize("side, other", [("engine", "shard"), ("shard", "engine")])
def test_a_store_side_never_imports_the_other(side, other):
    """What both sides need lives at ``store/`` itself."""
    assert f"{PACKAGE}.store.{side}" in GRAPH, f"no store/{side}/ package"
    offenders = {module: sorted(name for name in _ours(names) if _under(name, f"{PACKAGE}.store.{other}"))
                 for module, names in GRAPH.items() if _under(module, f"{PACKAGE}.store.{side}")}
    assert not {module: names for module, names in offenders.items() if names}


def test_shared_store_modules_import_neither_side():
    """``store/*.py`` (types, the ABC, placement, checksums, the index layout) are what both sides
    build on; ``store/local.py`` alone composes both, in one process, for tests."""
    shared = [module for module in GRAPH if module.count(".") == 2 and _under(module, f"{PACKAGE}.store")
              and module != f"{PACKAGE}.store.local"]
    offenders = {module: sorted(name for name in _ours(GRAPH[module])
                                if _under(name, f"{PACKAGE}.store.engine") or _under(name, f"{PACKAGE}.store.shard"))
                 for module in shared}
    assert not {module: names for module, names in offenders.items() if names}
