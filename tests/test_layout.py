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
             and m not in ("ddtree.__main__", "ddtree.models_data", "ddtree.blocks")]
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


# The modules of one layer family: what a round, the cache and the forward reach only through
# ddtree.targets.description and the layer-kind interface (ddtree.targets.layer_kinds).
FAMILY_MODULES = {"ddtree.targets.linear_attention", "ddtree.targets.families"}
FAMILY_FREE = ["ddtree.targets.cache", "ddtree.targets.forward", "ddtree.generation.round",
               "ddtree.targets.static_cache", "ddtree.generation.static_round", "ddtree.generation.accepted"]
FAMILY_NAME_PARTS = ("gdn", "linear_states", "linear_layer", "linearlayer", "linearstates", "deltanet",
                     "recurrent_states", "conv_state")


def family_names_in(source: str) -> set[str]:
    """The identifiers (names and attributes) of ``source`` that name a layer family's code."""
    tree = ast.parse(source)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return {n for n in names if any(part in n.lower() for part in FAMILY_NAME_PARTS)}


def test_cache_forward_and_round_name_no_layer_family():
    mods = modules()
    for name in FAMILY_FREE:
        source = mods[name].read_text()
        found = imports_of(source, name, False, set(mods)) & FAMILY_MODULES
        assert not found, f"{name} imports the layer-family module(s) {sorted(found)}: ask describe(model) instead"
        family_names = family_names_in(source)
        assert not family_names, f"{name} names GDN code {sorted(family_names)}"


def test_the_family_check_sees_family_code_named_directly():
    """What the static cache once held: a GDN layer class by name and the GDN cache's own attribute."""
    src = ("def f(cache, owner, conv, state):\n    layer = StaticLinearLayer(owner, conv, state)\n"
           "    return [x for x in cache.layers if hasattr(x, 'r')], layer.recurrent_states\n")
    assert family_names_in(src) == {"StaticLinearLayer", "recurrent_states"}


def test_the_family_check_sees_a_function_level_import():
    src = "def f():\n    from ddtree.targets.linear_attention import gdn_modules\n"
    assert imports_of(src, "ddtree.targets.cache", False, set(modules())) & FAMILY_MODULES


REGISTRY_PROBE = """
import importlib, pkgutil
import ddtree, ddtree.targets
for info in pkgutil.iter_modules(ddtree.targets.__path__, "ddtree.targets."):
    importlib.import_module(info.name)
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
print(sorted(n for n in {*AttentionInterface(), *AttentionMaskInterface()} if n.startswith("ddtree")))
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2))
ddtree.blocks.get_backend("fused").prepare(model)
print(sorted(n for n in AttentionInterface() if n.startswith("ddtree")), model.config._attn_implementation)
"""


def test_importing_ddtree_registers_nothing_until_a_backend_prepares_a_model():
    """Registration with transformers is an explicit step of a split backend's prepare, never an import's."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    out = subprocess.run([sys.executable, "-c", REGISTRY_PROBE], capture_output=True, text=True, env=env,
                         timeout=300, check=True).stdout.splitlines()
    assert out[0] == "[]", f"importing ddtree registered {out[0]} with transformers"
    assert out[1] == "['ddtree_fa', 'ddtree_fused', 'ddtree_split'] ddtree_fused"



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


# The library and its tools: the tools (benchmarks, training, the doctor and the apps) import the library,
# never the reverse, so the library carries none of their code or dependencies.
LIBRARY = LAYERS[: LAYERS.index("integrations") + 1]
TOOLS = ("ddtree.apps", "ddtree.train", "ddtree.bench")


def is_library(module: str) -> bool:
    return module == "ddtree" or (layer(module) is not None and LAYERS[layer(module)] in LIBRARY)


def is_tool(module: str) -> bool:
    return any(module == t or module.startswith(t + ".") for t in TOOLS)


def library_imports_of_tools(graph: nx.DiGraph) -> list[tuple[str, str]]:
    return [(a, b) for a, b in graph.edges if is_library(a) and is_tool(b)]


def test_no_library_module_imports_a_tool():
    """The rule on its own: no module of runtime .. integrations (nor ``ddtree`` itself) imports bench, train,
    the apps or the doctor, at any level of its body."""
    found = library_imports_of_tools(import_graph())
    assert not found, "library modules import tools: " + ", ".join(f"{a} -> {b}" for a, b in found)


def test_a_library_import_of_a_tool_is_caught():
    graph = import_graph()
    graph.add_edge("ddtree", "ddtree.apps.doctor.diagnose")
    graph.add_edge("ddtree.generation.generator", "ddtree.bench.runner")
    graph.add_edge("ddtree.bench.runner", "ddtree.core.tree")  # a tool importing the library is fine
    assert set(library_imports_of_tools(graph)) == {("ddtree", "ddtree.apps.doctor.diagnose"),
                                                    ("ddtree.generation.generator", "ddtree.bench.runner")}
    assert all(is_library(f"ddtree.{name}") for name in LIBRARY)
    assert not any(is_library(t) for t in TOOLS) and all(is_tool(t + ".x") for t in TOOLS)


TOOLS_PROBE = """
import importlib, pkgutil, sys
TOOLS = {tools!r}
loaded = lambda: sorted(m for m in sys.modules if any(m == t or m.startswith(t + ".") for t in TOOLS))
import ddtree
print(loaded())
for name in {library!r}:
    package = importlib.import_module("ddtree." + name)
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
print(loaded())
"""


def test_importing_the_library_loads_no_tool():
    """``import ddtree``, then every library module, in a fresh interpreter: no tool module is loaded."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    probe = TOOLS_PROBE.format(tools=TOOLS, library=LIBRARY)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300,
                         check=True).stdout.splitlines()
    assert out[0] == "[]", f"import ddtree loaded the tool modules {out[0]}"
    assert out[1] == "[]", f"importing the library modules loaded the tool modules {out[1]}"
