"""An exception or KeyboardInterrupt inside a stream() consumer, a custom builder or a drafter's proposal
leaves the generator usable: the next call equals HF greedy and accepts exactly what a fresh generator does."""

from __future__ import annotations

import gc

import pytest
import torch
from tiny import tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.blocks import best_first

PROMPT = torch.tensor([[11, 2, 2, 40, 61, 7, 9, 33]])
OTHER = torch.tensor([[5, 17, 3]])
NEW = 40


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3")
    return target, tiny_drafter(target)


@pytest.fixture(scope="module")
def expected(pair):
    """HF greedy and a fresh generator's acceptance for both prompts."""
    target, draft = pair
    out = {}
    for name, prompt in (("prompt", PROMPT), ("other", OTHER)):
        ref = target.generate(prompt, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        fresh = SpeculativeGenerator(target, draft, tree_budget=8).generate(prompt, max_new_tokens=NEW)
        assert torch.equal(fresh.sequences, ref)
        out[name] = (ref, fresh.acceptance_lengths)
    return out


def assert_usable(gen, expected, grad_mode_before=True):
    assert torch.is_grad_enabled() == grad_mode_before and not torch.is_inference_mode_enabled()
    for name, prompt in (("other", OTHER), ("prompt", PROMPT)):
        out = gen.generate(prompt, max_new_tokens=NEW)
        ref, acceptance = expected[name]
        assert torch.equal(out.sequences, ref)
        assert out.acceptance_lengths == acceptance
    assert list(gen.stream(PROMPT, max_new_tokens=NEW)) and torch.is_grad_enabled() == grad_mode_before


class Boom(Exception):
    pass


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("after", [1, 3])
@pytest.mark.parametrize("drop", [True, False])
def test_raise_inside_stream_consumer(pair, expected, error, after, drop):
    target, draft = pair
    gen = SpeculativeGenerator(target, draft, tree_budget=8)
    seen = []
    stream = gen.stream(PROMPT, max_new_tokens=NEW)
    with pytest.raises(error):
        for chunk in stream:
            seen += chunk[0]
            if len(seen) >= after:
                raise error()
    assert seen == expected["prompt"][0][0, PROMPT.shape[1]:].tolist()[: len(seen)]
    if drop:  # the abandoned stream is closed (as CPython does when its last reference goes) ...
        del stream
        gc.collect()
    # ... or kept alive, suspended, while the generator serves new calls.
    assert_usable(gen, expected)


def test_abandoned_stream_closed_after_another_call(pair, expected):
    """The suspended stream is finalised only after a later call finished: nothing it restores on exit
    may disturb that call's result or the caller's grad mode."""
    target, draft = pair
    gen = SpeculativeGenerator(target, draft, tree_budget=8)
    stream = gen.stream(PROMPT, max_new_tokens=NEW)
    next(stream), next(stream)
    out = gen.generate(OTHER, max_new_tokens=NEW)
    assert torch.equal(out.sequences, expected["other"][0])
    stream.close()
    assert_usable(gen, expected)


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_raise_inside_custom_builder(pair, expected, error):
    target, draft = pair
    calls = []

    def flaky(root, logprobs, budget):
        calls.append(budget)
        if len(calls) == 3:
            raise error()
        return best_first(root, logprobs, budget)

    gen = SpeculativeGenerator(target, draft, tree_budget=8, builder=flaky)
    with pytest.raises(error):
        gen.generate(PROMPT, max_new_tokens=NEW)
    assert len(calls) == 3
    assert_usable(gen, expected)


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_raise_inside_proposer(pair, expected, error):
    target, draft = pair
    gen = SpeculativeGenerator(target, draft, tree_budget=8)
    real_context = gen.drafter.new_context
    calls = []

    def flaky_context(batch_size=1):
        ctx = real_context(batch_size)
        real = ctx.propose

        def flaky(root):
            calls.append(1)
            if len(calls) == 4:
                raise error()
            return real(root)

        ctx.propose = flaky
        return ctx

    gen.drafter.new_context = flaky_context
    with pytest.raises(error):
        gen.generate(PROMPT, max_new_tokens=NEW)
    del gen.drafter.new_context  # back to the class's method
    assert_usable(gen, expected)


def test_interrupted_under_no_grad_keeps_the_callers_mode(pair, expected):
    target, draft = pair
    gen = SpeculativeGenerator(target, draft, tree_budget=8)
    with torch.no_grad():
        with pytest.raises(Boom):
            for _ in gen.stream(PROMPT, max_new_tokens=NEW):
                raise Boom()
        assert not torch.is_grad_enabled()
    assert_usable(gen, expected)


def test_stream_consumer_runs_in_the_callers_grad_mode(pair, expected):
    """Between yields the consumer's code is outside inference mode (it may train, or keep tensors)."""
    target, draft = pair
    gen = SpeculativeGenerator(target, draft, tree_budget=8)
    tokens = []
    for chunk in gen.stream(PROMPT, max_new_tokens=NEW):
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        tokens += chunk[0]
    assert tokens == expected["prompt"][0][0, PROMPT.shape[1]:].tolist()
