"""A transformers version whose forward ignores ddtree's cache keyword must fail loudly, never decode wrongly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tiny import VOCAB, ScriptedDrafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.blocks import new_target_cache
from ddtree.targets.cache import SUPPORTED_TRANSFORMERS, CacheNotUpdatedError, cache_kwargs


def _drop_cache(target, after_calls: int = 0):
    """Make ``target`` ignore any cache keyword after ``after_calls`` calls, as a renamed keyword would."""
    original = target.forward
    calls = {"n": 0}

    def forward(*args, cache=None, past_key_values=None, **kwargs):
        calls["n"] += 1
        if calls["n"] <= after_calls:
            kwargs.update(cache_kwargs(target, cache if cache is not None else past_key_values))
        return original(*args, **kwargs)

    target.forward = forward


PROMPT = torch.tensor([[5, 17, 3, 9]])


def _scripted(target, new: int = 16) -> ScriptedDrafter:
    """A drafter that proposes the target's greedy continuation of PROMPT (rounds accept 4 drafts + bonus)."""
    return ScriptedDrafter(target.generate(PROMPT, max_new_tokens=new, do_sample=False, pad_token_id=0)[0], VOCAB)


@pytest.mark.parametrize("after_calls,step", [(0, "prefill"), (1, "verify forward")])
def test_a_forward_that_ignores_the_cache_is_refused(after_calls, step):
    target = tiny_target("qwen3")
    gen = SpeculativeGenerator(target, _scripted(target), tree_budget=4)
    ok = gen.generate(PROMPT, max_new_tokens=8)  # the control: with the cache honoured, exact and accepted
    assert ok.row_tokens[0] == gen.drafter.reference[4:12].tolist() and ok.acceptance_lengths == [5, 5]
    _drop_cache(target, after_calls)
    with pytest.raises(CacheNotUpdatedError, match=rf"after the {step} .*Installed transformers \d") as err:
        gen.generate(PROMPT, max_new_tokens=8)
    assert SUPPORTED_TRANSFORMERS in str(err.value)


def test_plain_decoding_is_guarded_too():
    target = tiny_target("llama")
    drafter = _scripted(target)
    gen = SpeculativeGenerator(target, drafter, tree_budget=0)
    ok = gen.generate(PROMPT, max_new_tokens=4)
    assert ok.row_tokens[0] == drafter.reference[4:8].tolist() and ok.acceptance_lengths == [1, 1, 1]
    assert not drafter.proposals  # budget 0: the drafter does no work
    _drop_cache(target, after_calls=1)
    with pytest.raises(CacheNotUpdatedError, match="decode step"):
        gen.generate(PROMPT, max_new_tokens=4)


def test_cache_keyword_reaches_the_cache():
    target = tiny_target("qwen3")
    cache = new_target_cache()
    with torch.no_grad():
        target(torch.tensor([[1, 2, 3]]), use_cache=True, **cache_kwargs(target, cache))
    assert cache.get_seq_length() == 3


def test_supported_range_is_the_one_pyproject_admits():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    admitted = re.search(r'"transformers([^"]+)"', pyproject).group(1)
    assert admitted == SUPPORTED_TRANSFORMERS
