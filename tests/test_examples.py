"""The examples run as written and check themselves."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.real_default  # the generator's own defaults (lookup merged), as a user runs the example
def test_custom_loop_both_loops_are_lossless_and_agree(capsys):
    _load("custom_loop").main(["--max-new-tokens", "24"])  # asserts losslessness and equal acceptance itself
    out = capsys.readouterr().out
    assert "lossless" in out and "round " in out


def test_batched_block_loop_rows_equal_their_batch_1_runs_and_the_generator():
    """Ragged prompts in one batch: each row's tokens and acceptance equal its batch-1 ``block_loop`` and the
    generator's row; rows finish at different rounds, so the loop has dropped rows with ``select_rows``."""
    import torch

    import ddtree

    loop = _load("custom_loop")
    target, drafter, _ = loop.tiny_pair()
    prompts = [torch.tensor([3, 1, 4, 1, 5, 9, 2, 6]), torch.tensor([5, 3, 5]), torch.tensor([2, 7, 1, 8, 2])]
    with torch.inference_mode():
        tokens, acceptance = loop.batched_block_loop(target, drafter, prompts, 20, budget=6)
        alone = [loop.block_loop(target, drafter, p.view(1, -1), 20, budget=6) for p in prompts]
    gen = ddtree.SpeculativeGenerator(target, drafter, tree_budget=6, attention="sdpa", threads=None)
    out = gen.generate(prompts, max_new_tokens=20, stop_token_ids=())
    for b in range(len(prompts)):
        assert (tokens[b], acceptance[b]) == alone[b]
        assert tokens[b] == out.row_tokens[b] and acceptance[b] == out.row_acceptance[b]
        assert len(tokens[b]) == 20 and sum(acceptance[b]) + 1 >= 20  # every round's count is in the acceptance
    assert len({len(a) for a in acceptance}) > 1, "rows should finish at different rounds for this check to bite"
    assert max(max(a) for a in acceptance) > 1, "no draft token was ever accepted: the check would not bite"
