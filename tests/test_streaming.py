"""``stream()``, ``streamer=`` and ``custom_generate`` hand out exactly what ``generate`` returns, token for token,
under every stop: a stop token (first token, mid-round, last of a round), EOS from the target's config, and
``max_new_tokens`` cutting a round, for one prompt and a batch. A drafter that proposes the target's own
continuation makes every round accept a full block, so each cut lands inside a round."""

from __future__ import annotations

import pytest
import torch
from tiny import ScriptedDrafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.generation.inputs import streamed

PROMPTS = [[5, 17, 3, 9], [11, 40, 2, 8, 33, 7]]
BLOCK = 5  # the drafter proposes 4 tokens: a fully accepted round commits 5


class Collector:
    """A transformers-style streamer: keeps every ``put`` after the prompt."""

    def __init__(self):
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value):
        self.puts.append(value.view(-1).tolist())

    def end(self):
        self.ended += 1

    @property
    def tokens(self) -> list[int]:
        return [t for chunk in self.puts[1:] for t in chunk]  # puts[0] is the prompt


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("qwen3")
    refs = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
        refs.append(out[0].tolist())
    return target, refs


def _gen(target, refs):
    return SpeculativeGenerator(target, ScriptedDrafter([torch.tensor(r + [0] * 8) for r in refs], 97,
                                                        block_size=BLOCK), tree_budget=8, attention="sdpa")


CASES = {
    "max_new_tokens mid-round": dict(max_new_tokens=13, stop_token_ids=()),
    "max_new_tokens at the prefill": dict(max_new_tokens=1, stop_token_ids=()),
    "max_new_tokens two past a round": dict(max_new_tokens=7, stop_token_ids=()),
}


def _stop_cases(refs):
    """Stop tokens taken from the reference: the first new token, one inside a round, the last of a round."""
    new = refs[0][len(PROMPTS[0]):]
    inside = next(t for t in new[2:] if new.index(t) not in (0, 1, 6))
    return {
        "stop at the first token": dict(max_new_tokens=30, stop_token_ids=[new[0]]),
        "stop inside a round": dict(max_new_tokens=30, stop_token_ids=[inside]),
        "stop as a round's bonus token": dict(max_new_tokens=30, stop_token_ids=[new[5]]) if new[5] not in new[:5]
        else dict(max_new_tokens=30, stop_token_ids=[inside]),
    }


def _expected(ref: list[int], prompt_len: int, max_new_tokens: int, stops) -> list[int]:
    new = ref[prompt_len:][:max_new_tokens]
    for i, t in enumerate(new):
        if t in set(stops):
            return new[: i + 1]
    return new


def _all_cases(refs):
    return {**CASES, **_stop_cases(refs)}


def test_one_prompt_streams_equal_generate_under_every_cut(setup):
    target, refs = setup
    gen = _gen(target, refs[:1])
    for name, opts in _all_cases(refs).items():
        want = _expected(refs[0], len(PROMPTS[0]), opts["max_new_tokens"], opts["stop_token_ids"])
        out = gen.generate(PROMPTS[0], record_trees=True, **opts)
        assert out.row_tokens[0] == want, name
        # every verified round accepted the whole block the scripted drafter proposed (its last may be cut)
        assert out.acceptance_lengths == [BLOCK] * len(out.acceptance_lengths), name
        assert len(out.acceptance_lengths) == -(-(len(want) - 1) // BLOCK), name
        assert out.row_acceptance == [out.acceptance_lengths] and out.row_rounds == [out.rounds], name
        rows = list(gen.stream(PROMPTS[0], **opts))
        assert all(len(r) == 1 for r in rows), name  # one list per row, as for a batch
        chunks = [r[0] for r in rows]
        assert [t for c in chunks for t in c] == want, name
        assert all(chunks), name  # no empty yields for one prompt
        sink = Collector()
        gen.generate(PROMPTS[0], streamer=sink, **opts)
        assert sink.tokens == want and sink.ended == 1 and sink.puts[0] == PROMPTS[0], name
        sink = Collector()
        assert [t for c in gen.stream(PROMPTS[0], streamer=sink, **opts) for t in c[0]] == want, name
        assert sink.tokens == want and sink.ended == 1, name
        sink = Collector()
        got = [t for c in streamed(gen.stream(PROMPTS[0], **opts), sink, prompt=PROMPTS[0]) for t in c[0]]
        assert got == want and sink.tokens == want, name


def test_eos_from_the_target_config_cuts_streams_where_generate_stops(setup):
    target, refs = setup
    gen = _gen(target, refs[:1])
    new = refs[0][len(PROMPTS[0]):]
    eos = new[3]
    before = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = eos
    try:
        want = new[: new.index(eos) + 1]
        out = gen.generate(PROMPTS[0], max_new_tokens=30)
        assert out.row_tokens[0] == want and out.acceptance_lengths == [BLOCK]
        assert [t for c in gen.stream(PROMPTS[0], max_new_tokens=30) for t in c[0]] == want
        sink = Collector()
        gen.generate(PROMPTS[0], max_new_tokens=30, streamer=sink)
        assert sink.tokens == want
    finally:
        target.generation_config.eos_token_id = before


def test_batch_stream_rows_equal_generate_rows_under_every_cut(setup):
    target, refs = setup
    gen = _gen(target, refs)
    for name, opts in _all_cases(refs).items():
        out = gen.generate(PROMPTS, **opts)
        for b, p in enumerate(PROMPTS):
            assert out.row_tokens[b] == _expected(refs[b], len(p), opts["max_new_tokens"], opts["stop_token_ids"])
        assert all(a == BLOCK for row in out.row_acceptance for a in row), name
        assert out.row_acceptance is out.acceptance_lengths and len(out.row_acceptance) == len(PROMPTS), name
        rows: list[list[int]] = [[] for _ in PROMPTS]
        for chunk in gen.stream(PROMPTS, **opts):
            assert len(chunk) == len(PROMPTS)
            for b, toks in enumerate(chunk):
                rows[b] += toks
        assert rows == out.row_tokens, name


def test_round_results_carry_only_what_was_committed(setup):
    """The building block itself: a custom loop summing ``RoundResult.tokens`` gets ``generate``'s output."""
    from ddtree.blocks import speculative_round

    target, refs = setup
    gen = _gen(target, refs)
    state = gen.start(PROMPTS, max_new_tokens=13, stop_token_ids=())
    got: list[list[int]] = [[] for _ in PROMPTS]
    while not state.done:
        result = speculative_round(state)
        for b, toks in enumerate(result.tokens):
            got[b] += toks
            assert result.acceptance[b] is None or len(toks) <= result.acceptance[b]
    assert got == state.new_tokens and all(len(r) == 13 for r in got)


def test_custom_generate_streamer_gets_what_generate_returns(setup):
    import ddtree

    target, refs = setup
    drafter = ScriptedDrafter([torch.tensor(refs[0] + [0] * 8)], 97, block_size=BLOCK)
    ids = torch.tensor([PROMPTS[0]])
    for new, eos in ((13, None), (30, refs[0][len(PROMPTS[0]) + 2])):
        sink = Collector()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              pad_token_id=0, eos_token_id=eos, streamer=sink,
                              custom_generate=ddtree.decoding(drafter, tree_budget=8, attention="sdpa"))
        want = _expected(refs[0], len(PROMPTS[0]), new, [] if eos is None else [eos])
        assert out[0, len(PROMPTS[0]):].tolist() == want
        assert sink.tokens == want and sink.ended == 1
        assert len(drafter.proposals) <= -(-len(want) // BLOCK)  # whole blocks accepted: few rounds
        drafter.proposals.clear()
