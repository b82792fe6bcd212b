"""A transformers version whose forward ignores ddtree's cache keyword must fail loudly, never decode wrongly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ddtree import SpeculativeGenerator, cache_kwargs, new_target_cache
from ddtree.target.cache import SUPPORTED_TRANSFORMERS, CacheNotUpdatedError
from tiny import tiny_drafter, tiny_target


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


@pytest.mark.parametrize("after_calls,step", [(0, "prefill"), (1, "verify forward")])
def test_a_forward_that_ignores_the_cache_is_refused(after_calls, step):
    target = tiny_target("qwen3")
    gen = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=4)
    _drop_cache(target, after_calls)
    with pytest.raises(CacheNotUpdatedError, match=rf"after the {step} .*Installed transformers \d") as err:
        gen.generate(torch.tensor([[5, 17, 3, 9]]), max_new_tokens=8)
    assert SUPPORTED_TRANSFORMERS in str(err.value)


def test_plain_decoding_is_guarded_too():
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=0)
    _drop_cache(target, after_calls=1)
    with pytest.raises(CacheNotUpdatedError, match="decode step"):
        gen.generate(torch.tensor([[5, 17, 3, 9]]), max_new_tokens=4)


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
