"""The public surface: a short ``ddtree`` top level, the building blocks in ``ddtree.blocks``, and the README's
"Building blocks" table naming exactly the names of ``ddtree.blocks``."""

from __future__ import annotations

import importlib
import re
import types
from pathlib import Path

import pytest

import ddtree
import ddtree.blocks

ROOT = Path(__file__).resolve().parents[1]

# What a user of the generator needs; anything more belongs in ddtree.blocks or its own module.
TOP_LEVEL = {
    "SpeculativeGenerator", "GeneratorOptions", "decoding",
    "Drafter", "DraftContext", "Proposal", "BudgetPolicy",
    "GenerationOutput", "GenerationStats", "RoundResult",
    "blocks", "__version__",
}

# Helpers of one module: importable from it, not from the public namespaces.
INTERNALS = {
    "ranked_topk": "ddtree.core.builders",
    "keep_positions": "ddtree.targets.cache",
    "cache_kwargs": "ddtree.targets.cache",
}


def table_rows(readme: str) -> list[tuple[str, list[str], list[str]]]:
    """The Building blocks table's rows as (step, the backticked names of its names column, its module paths)."""
    section = readme.split("\n## Building blocks\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header == ["step", "`ddtree.blocks` names", "module"], header
    assert set(lines[1].replace("|", "").strip()) <= {"-"}, lines[1]
    rows = []
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert len(cells) == 3, line
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1]), re.findall(r"`([^`]+)`", cells[2])))
    return rows


def readme_block_names() -> list[str]:
    return [name for _, names, _ in table_rows((ROOT / "README.md").read_text()) for name in names]


def test_the_readme_table_names_every_block_and_only_blocks():
    listed = readme_block_names()
    assert len(listed) == len(set(listed)), f"names listed twice: {sorted({n for n in listed if listed.count(n) > 1})}"
    in_blocks = set(ddtree.blocks.__all__)
    only_table, only_blocks = sorted(set(listed) - in_blocks), sorted(in_blocks - set(listed))
    assert not only_table, f"in the README table but not in ddtree.blocks: {only_table}"
    assert not only_blocks, f"in ddtree.blocks but not in the README table (add a row or a name): {only_blocks}"


def test_every_row_names_blocks_in_modules_that_exist():
    for step, names, paths in table_rows((ROOT / "README.md").read_text()):
        assert names, f"row {step!r} names no block"
        assert paths, f"row {step!r} names no module"
        for path in paths:
            assert (ROOT / path).exists(), f"the README table points at {path}, which does not exist"


def test_the_table_parser_sees_a_missing_and_an_extra_name():
    """The both-ways check is not vacuous: the parser reads names, so a dropped or added one shows."""
    readme = (ROOT / "README.md").read_text()
    dropped = readme.replace("`verify_tree`, ", "", 1)
    added = readme.replace("`verify_tree`, ", "`verify_tree`, `ranked_topk`, ", 1)
    names = lambda text: {n for _, row, _ in table_rows(text) for n in row}  # noqa: E731
    assert names(readme) - names(dropped) == {"verify_tree"}
    assert names(added) - names(readme) == {"ranked_topk"}


def test_every_public_name_resolves():
    for module in (ddtree, ddtree.blocks):
        assert len(module.__all__) == len(set(module.__all__)), module.__name__
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"{module.__name__}.__all__ names what it does not hold: {missing}"
        star: dict = {}
        exec(f"from {module.__name__} import *", star)
        assert set(module.__all__) <= set(star)


def test_the_top_level_stays_short():
    assert set(ddtree.__all__) == TOP_LEVEL
    assert ddtree.blocks is importlib.import_module("ddtree.blocks")
    # What the package exposes beyond __all__ is only its subpackages (imported as a side effect).
    extra = {name for name in vars(ddtree) if not name.startswith("_")} - set(ddtree.__all__)
    assert all(isinstance(getattr(ddtree, name), types.ModuleType) for name in extra), sorted(
        name for name in extra if not isinstance(getattr(ddtree, name), types.ModuleType))
    # Nothing below the generation layer's protocols and outputs: no core or targets internals.
    homes = {name: getattr(getattr(ddtree, name), "__module__", "") for name in ddtree.__all__}
    from_low_layers = [name for name, home in homes.items() if home.startswith(("ddtree.core", "ddtree.targets"))]
    assert not from_low_layers, from_low_layers


def test_blocks_are_the_objects_of_their_modules():
    """A re-export, never a copy: ``ddtree.blocks.X`` is the object its own module defines."""
    checked = 0
    for name in ddtree.blocks.__all__:
        obj = getattr(ddtree.blocks, name)
        if isinstance(obj, types.ModuleType):
            assert obj.__name__.startswith("ddtree."), name
        elif isinstance(obj, (type, types.FunctionType)):
            assert obj.__module__.startswith("ddtree."), name
            home = importlib.import_module(obj.__module__)
            assert getattr(home, name) is obj, f"{name} is not {obj.__module__}.{name}"
            checked += 1
    assert checked > len(ddtree.blocks.__all__) // 2


@pytest.mark.parametrize("name,home", sorted(INTERNALS.items()))
def test_internals_live_only_in_their_modules(name, home):
    assert hasattr(importlib.import_module(home), name)
    assert name not in ddtree.__all__ and not hasattr(ddtree, name)
    assert name not in ddtree.blocks.__all__ and not hasattr(ddtree.blocks, name)


def test_shared_names_are_one_object():
    """A protocol or output type in both namespaces is the same object."""
    for name in set(ddtree.__all__) & set(ddtree.blocks.__all__):
        assert getattr(ddtree, name) is getattr(ddtree.blocks, name), name
