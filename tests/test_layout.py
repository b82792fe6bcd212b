"""The package's architecture, checked: imports run downward through the layers, and no module imports
itself back through any chain (top-level, function-level and type-only imports all count)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "ddtree"

# Bottom to top: a module may import its own layer and the layers below it, never one above.
LAYERS = ["runtime", "core", "targets", "drafters", "loading", "budget", "generation", "integrations", "apps",
          "train", "bench"]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """Every ddtree module that module ``name`` imports anywhere in its body (``from m import x`` counts
    ``m.x`` when that is a module, else ``m``)."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def import_graph() -> nx.DiGraph:
    mods = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(mods)
    for name, path in mods.items():
        deps = imports_of(path.read_text(), name, path.name == "__init__.py", set(mods))
        graph.add_edges_from((name, dep) for dep in deps)
    return graph


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles)


def test_imports_run_downward_through_the_layers():
    upward = [(a, b) for a, b in import_graph().edges
              if layer(a) is not None and layer(b) is not None and layer(b) > layer(a)]
    assert not upward, "imports that run upward: " + ", ".join(f"{a} -> {b}" for a, b in upward)


def test_every_module_sits_in_a_layer():
    loose = [m for m in modules() if m.count(".") >= 1 and layer(m) is None
             and m not in ("ddtree.__main__", "ddtree.models_data")]
    assert not loose, f"modules outside the layers {LAYERS}: {loose}"


def test_the_checker_sees_function_level_and_type_only_imports():
    """The walk is not fooled by an import hidden in a function or under TYPE_CHECKING, or by a relative one."""
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ddtree.core import tree\n"
           "def f():\n    from ..targets.cache import new_target_cache\n    import ddtree.runtime.timing\n")
    found = imports_of(src, "ddtree.core.masks", False, set(modules()))
    assert found == {"ddtree.core.tree", "ddtree.targets.cache", "ddtree.runtime.timing"}


def test_a_cycle_is_caught():
    graph = import_graph()
    graph.add_edge("ddtree.core.tree", "ddtree.generation.round")
    assert list(nx.simple_cycles(graph))



def concrete_proposer_imports(graph: nx.DiGraph) -> list[tuple[str, str]]:
    """Imports from ``ddtree.generation`` of any proposer module but the protocols (``ddtree.drafters.base``)."""
    return [(a, b) for a, b in graph.edges if a.startswith("ddtree.generation") and b.startswith("ddtree.drafters")
            and b not in ("ddtree.drafters", "ddtree.drafters.base")]


def test_generation_imports_no_concrete_proposer():
    """The loop sees proposers only through the protocols: a new drafter is a new class (registered in
    ``ddtree.drafters.registry``, loaded by ``ddtree.loading``), never an edit of generation."""
    concrete = concrete_proposer_imports(import_graph())
    assert not concrete, "generation imports concrete proposers: " + ", ".join(f"{a} -> {b}" for a, b in concrete)


def test_a_concrete_proposer_import_is_caught():
    graph = import_graph()
    graph.add_edge("ddtree.generation.round", "ddtree.drafters.lookup")
    graph.add_edge("ddtree.generation.generator", "ddtree.drafters.dflash2.model")
    assert set(concrete_proposer_imports(graph)) == {("ddtree.generation.round", "ddtree.drafters.lookup"),
                                                     ("ddtree.generation.generator", "ddtree.drafters.dflash2.model")}
