"""The examples run as written and check themselves."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_custom_loop_both_loops_are_lossless_and_agree(capsys):
    _load("custom_loop").main(["--max-new-tokens", "24"])  # asserts losslessness and equal acceptance itself
    out = capsys.readouterr().out
    assert "lossless" in out and "round " in out
