"""Prompt forms, generate-style options and streamers.

Each accepted form means the same thing, each refusal says why.
"""

from __future__ import annotations

import re

import pytest
import torch
from tiny import tiny_tokenizer
from transformers import GenerationConfig, TextIteratorStreamer

from ddtree.generation.inputs import (
    ACCEPTED_PROMPTS,
    GenerationSettings,
    StreamerFeed,
    check_room,
    check_stop_ids,
    prompt_rows,
    resolve_generation,
    streamed,
)

ROW = [5, 17, 3, 9]


def _lists(rows):
    return [r.tolist() for r in rows]


@pytest.mark.parametrize("form", [
    torch.tensor(ROW), torch.tensor([ROW]), ROW, [ROW], [torch.tensor(ROW)], (5, 17, 3, 9),
    {"input_ids": torch.tensor([ROW])}, {"input_ids": [ROW], "attention_mask": [[1, 1, 1, 1]]},
])
def test_every_accepted_form_gives_the_tensor_rows(form):
    rows = prompt_rows(form)
    assert _lists(rows) == [ROW]
    assert all(r.dtype == torch.long and r.dim() == 1 for r in rows)


def test_batch_encoding_left_padding_is_removed_per_row():
    tok = tiny_tokenizer()
    tok.padding_side = "left"
    enc = tok(["w5 w7 w9", "w4"], padding=True, return_tensors="pt")
    assert enc["input_ids"][1].tolist() == [2, 2, 4]  # really padded
    assert _lists(prompt_rows(enc)) == [[5, 7, 9], [4]]
    # The same with the mask passed separately, and ragged lists with a ragged mask.
    assert _lists(prompt_rows(enc["input_ids"], enc["attention_mask"])) == [[5, 7, 9], [4]]
    assert _lists(prompt_rows([[2, 5, 6], [7]], [[0, 1, 1], [1]])) == [[5, 6], [7]]


def test_strings_go_through_the_tokenizer():
    tok = tiny_tokenizer()
    assert _lists(prompt_rows("w5 w17 w3 w9", tokenizer=tok)) == [ROW]
    assert _lists(prompt_rows(["w5 w17", "w4"], tokenizer=tok)) == [[5, 17], [4]]


def test_a_string_without_tokenizer_says_how_to_fix_it():
    with pytest.raises(ValueError, match="from_pretrained.*or pass token ids"):
        prompt_rows("Hello")


@pytest.mark.parametrize("bad", [
    torch.tensor([[[1, 2]]]), torch.tensor([1.0, 2.0]), torch.tensor([True, False]), [1.5, 2], [[1, 2], "x"],
    3, None, object(), [[1, 2], 3],
])
def test_rejected_forms_name_the_accepted_ones(bad):
    with pytest.raises(ValueError) as err:
        prompt_rows(bad)
    assert ACCEPTED_PROMPTS in str(err.value)


def test_dict_without_input_ids_names_the_accepted_forms():
    with pytest.raises(ValueError, match="no 'input_ids'.*BatchEncoding"):
        prompt_rows({"ids": [1, 2]})


@pytest.mark.parametrize("empty", [[], torch.zeros(0, dtype=torch.long), [[1, 2], []],
                                   torch.zeros(1, 0, dtype=torch.long)])
def test_empty_rows_are_refused(empty):
    with pytest.raises(ValueError, match="empty"):
        prompt_rows(empty)


def test_an_all_padding_row_is_empty():
    with pytest.raises(ValueError, match="row 1 of the prompt is empty"):
        prompt_rows([[1, 2], [2, 2]], [[1, 1], [0, 0]])


def test_right_padding_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="not left padding.*padding_side = 'left'"):
        prompt_rows([[5, 6, 2]], [[1, 1, 0]])
    with pytest.raises(ValueError, match="do not match"):
        prompt_rows([[5, 6, 2]], [[1, 1]])


def test_out_of_vocabulary_ids_are_refused():
    assert _lists(prompt_rows([0, 96], vocab_size=97)) == [[0, 96]]
    with pytest.raises(ValueError, match="token id 97 in row 0 is outside the vocabulary"):
        prompt_rows([5, 97], vocab_size=97)
    with pytest.raises(ValueError, match="token id -1"):
        prompt_rows([[5], [-1]], vocab_size=97)


# --------------------------------------------------------------------- resolve_generation

TARGET = GenerationConfig(eos_token_id=[1, 7], pad_token_id=2, bos_token_id=0)


def test_defaults_stop_at_every_target_eos_and_decode_greedily():
    s = resolve_generation(target_generation_config=TARGET, max_new_tokens=9)
    assert s == GenerationSettings(max_new_tokens=9, temperature=0.0, stop_token_ids=(1, 7))
    assert s.sampling.greedy
    single = resolve_generation(target_generation_config=GenerationConfig(eos_token_id=4), max_new_tokens=1)
    assert single.stop_token_ids == (4,)


def test_stopping_can_be_turned_off_or_replaced():
    assert resolve_generation(target_generation_config=TARGET, max_new_tokens=9, stop_token_ids=()).stop_token_ids == ()
    assert resolve_generation(target_generation_config=TARGET, max_new_tokens=9, eos_token_id=[]).stop_token_ids == ()
    assert resolve_generation(target_generation_config=TARGET, max_new_tokens=9, eos_token_id=3).stop_token_ids == (3,)
    cfg = GenerationConfig(eos_token_id=5, max_new_tokens=4)
    assert resolve_generation(cfg, target_generation_config=TARGET).stop_token_ids == (5,)
    with pytest.raises(ValueError, match="not both"):
        resolve_generation(max_new_tokens=2, eos_token_id=3, stop_token_ids=4)


def test_do_sample_false_is_greedy_whatever_the_temperature():
    s = resolve_generation(max_new_tokens=5, do_sample=False, temperature=0.7, top_k=3, top_p=0.5)
    assert (s.temperature, s.top_k, s.top_p) == (0.0, None, None)


def test_do_sample_true_takes_hf_defaults_and_the_targets_values():
    s = resolve_generation(max_new_tokens=5, do_sample=True)
    assert (s.temperature, s.top_k, s.top_p) == (1.0, 50, None)  # HF's top_k=50 applies when sampling
    target = GenerationConfig(temperature=0.6, top_p=0.9, top_k=0)
    s = resolve_generation(max_new_tokens=5, do_sample=True, target_generation_config=target)
    assert (s.temperature, s.top_k, s.top_p) == (0.6, None, 0.9)  # top_k=0 means no top-k filter
    s = resolve_generation(max_new_tokens=5, do_sample=True, temperature=0.3, target_generation_config=target)
    assert s.temperature == 0.3
    # A target that samples by default samples under HF rules (a GenerationConfig given), not under ddtree's.
    sampling_target = GenerationConfig(do_sample=True, temperature=0.5)
    assert resolve_generation(GenerationConfig(max_new_tokens=3),
                              target_generation_config=sampling_target).temperature == 0.5
    assert resolve_generation(max_new_tokens=3, target_generation_config=sampling_target).temperature == 0.0


def test_generation_config_object_is_read_like_generate_reads_it():
    cfg = GenerationConfig(do_sample=True, temperature=0.8, top_k=20, top_p=0.95, max_new_tokens=33, eos_token_id=4)
    s = resolve_generation(cfg, seed=11)
    assert s == GenerationSettings(33, 0.8, 20, 0.95, (4,), 11)
    # Keywords win over the config, as in generate.
    assert resolve_generation(cfg, max_new_tokens=2, top_k=5).top_k == 5
    # max_length counts the prompt.
    assert resolve_generation(GenerationConfig(max_length=30), prompt_length=10).max_new_tokens == 20


def test_ddtree_rule_without_do_sample():
    s = resolve_generation(max_new_tokens=5, temperature=0.7)
    assert (s.temperature, s.top_k, s.top_p) == (0.7, None, None)  # no HF top_k=50 sneaking in
    assert resolve_generation(max_new_tokens=5, temperature=0.7, top_p=0.9).top_p == 0.9


@pytest.mark.parametrize("option,value", [
    ("num_beams", 4), ("repetition_penalty", 1.2), ("min_new_tokens", 3), ("typical_p", 0.9),
    ("no_repeat_ngram_size", 2), ("suppress_tokens", [5]), ("min_p", 0.1), ("num_return_sequences", 2),
    ("min_length", 8),
])
def test_options_that_change_the_distribution_are_refused_by_name(option, value):
    with pytest.raises(ValueError, match=re.escape(f"{option}={value!r} cannot be honoured")):
        resolve_generation(max_new_tokens=5, **{option: value})
    with pytest.raises(ValueError, match=option):  # by ddtree, or by GenerationConfig itself
        resolve_generation(GenerationConfig(max_new_tokens=5, **{option: value}))


def test_options_at_their_default_are_fine_and_override_the_target():
    assert resolve_generation(max_new_tokens=5, num_beams=1, repetition_penalty=1.0, pad_token_id=0).max_new_tokens == 5
    target = GenerationConfig(repetition_penalty=1.1)
    with pytest.raises(ValueError, match="repetition_penalty=1.1.*pass repetition_penalty=1.0"):
        resolve_generation(max_new_tokens=5, do_sample=False, target_generation_config=target)
    s = resolve_generation(max_new_tokens=5, do_sample=False, repetition_penalty=1.0, target_generation_config=target)
    assert s.temperature == 0.0


def test_bad_values_are_refused():
    with pytest.raises(TypeError, match="unknown option.*beams; accepted: max_new_tokens, max_length, do_sample, "
                                        "temperature, top_k, top_p, eos_token_id, stop_token_ids, seed "):
        resolve_generation(max_new_tokens=5, beams=3)
    with pytest.raises(TypeError, match=r"unknown option\(s\) beams; accepted: .*seed, tree_budget, builder \("):
        resolve_generation(max_new_tokens=5, beams=3, other_names=("tree_budget", "builder"))
    with pytest.raises(ValueError, match="pass max_new_tokens"):
        resolve_generation()
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        resolve_generation(max_new_tokens=0)
    with pytest.raises(ValueError, match="do_sample=True needs temperature > 0"):
        resolve_generation(max_new_tokens=5, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        resolve_generation(max_new_tokens=5, temperature=1.0, top_p=1.5)


# --------------------------------------------------------------------- streamers


class Recorder:
    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(("put", value.tolist()))

    def end(self):
        self.calls.append(("end",))


def test_streamer_feed_puts_the_prompt_then_rounds_then_ends_once():
    rec = Recorder()
    out = list(streamed([[4], [5, 6, 7], [], [8]], rec, prompt=torch.tensor([[1, 2]])))
    assert out == [[4], [5, 6, 7], [], [8]]
    assert rec.calls == [("put", [[1, 2]]), ("put", [4]), ("put", [5, 6, 7]), ("put", [8]), ("end",)]


def test_streamer_feed_ends_when_the_consumer_stops_early_or_the_loop_fails():
    rec = Recorder()
    gen = streamed(iter([[1], [2], [3]]), rec)
    assert next(gen) == [1]
    gen.close()
    assert rec.calls == [("put", [1]), ("end",)]

    def failing():
        yield [1]
        raise RuntimeError("boom")

    rec = Recorder()
    with pytest.raises(RuntimeError):
        list(streamed(failing(), rec))
    assert rec.calls[-1] == ("end",)
    feed = StreamerFeed(rec)
    feed.end()
    feed.end()
    assert rec.calls.count(("end",)) == 2  # one per feed


def test_text_iterator_streamer_gets_the_decoded_output():
    tok = tiny_tokenizer()
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    rounds = [[5, 6], [7], [8, 9, 10]]
    list(streamed(rounds, streamer, prompt=[3, 4]))
    assert "".join(streamer) == tok.decode(sum(rounds, []))


def test_streamed_takes_what_stream_yields_for_one_prompt_and_refuses_a_batch():
    """``stream()`` yields one list per row; ``streamed`` feeds the one row and passes the chunks on unchanged."""
    rec = Recorder()
    out = list(streamed([[[4]], [[5, 6]], [[]], [[7]]], rec, prompt=[1, 2]))
    assert out == [[[4]], [[5, 6]], [[]], [[7]]]
    assert rec.calls == [("put", [[1, 2]]), ("put", [4]), ("put", [5, 6]), ("put", [7]), ("end",)]
    rec = Recorder()
    with pytest.raises(ValueError, match="streamers take one sequence"):
        list(streamed([[[4], [5]]], rec))
    assert rec.calls == [("end",)]
    with pytest.raises(ValueError, match="mixes ids and rows"):
        list(streamed([[4, [5]]], Recorder()))


def test_raw_text_that_stops_at_its_first_token_warns_once_toward_the_chat_template():
    """HF's behaviour is kept (the one stop token is returned), with one warning naming apply_chat_template;
    a templated prompt, or a generation that runs past its first token, gives no warning."""
    import warnings

    from tiny import VOCAB, ScriptedDrafter, tiny_target, tiny_tokenizer

    from ddtree import SpeculativeGenerator

    target = tiny_target("llama")
    tok = tiny_tokenizer()
    raw = "w5 w17 w9"
    templated = tok.apply_chat_template([{"role": "user", "content": raw}], add_generation_prompt=True,
                                        return_dict=True, return_tensors="pt")
    cases = {"raw": tok(raw)["input_ids"], "templated": templated["input_ids"][0].tolist()}
    for name, ids in cases.items():
        ref = target.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=2)[0]
        gen = SpeculativeGenerator(target, ScriptedDrafter(ref, VOCAB), tokenizer=tok, tree_budget=4)
        first, later = int(ref[len(ids)]), int(ref[len(ids) + 3])
        prompt = raw if name == "raw" else templated
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = gen.generate(prompt, max_new_tokens=8, stop_token_ids=[first])
            streamed = list(gen.stream(prompt, max_new_tokens=8, stop_token_ids=[first]))
            batch = gen.generate([prompt, prompt] if name == "raw" else [ids, ids], max_new_tokens=8,
                                 stop_token_ids=[first])
            if later != first and first not in ref[len(ids):len(ids) + 4].tolist()[1:]:
                past = gen.generate(prompt, max_new_tokens=8, stop_token_ids=[later])
                assert len(past.row_tokens[0]) > 1
        assert out.row_tokens[0] == [first] and streamed == [[[first]]] and batch.row_tokens == [[first], [first]]
        hints = [w for w in caught if "apply_chat_template" in str(w.message)]
        if name == "raw":
            assert len(hints) == 3  # once per call: generate, stream, and the batch (not once per row)
            assert "stopped at its first token" in str(hints[0].message)
        else:
            assert hints == []


def test_limits_the_target_sets():
    """Stop ids inside [0, vocab) and an exact fit of prompt + new tokens pass; one past either is refused; an
    unknown limit (a config without max_position_embeddings) checks nothing."""
    check_stop_ids((0, 96), 97)
    check_stop_ids((10**6,), None)
    for bad in (97, -1):
        with pytest.raises(ValueError, match=rf"stop token id {bad} is outside the target's vocabulary \[0, 97\)"):
            check_stop_ids((0, bad), 97)
    check_room([250], 6, 256)
    check_room([3, 250], 6, 256)
    check_room([10**6], 10**6, None)
    with pytest.raises(ValueError, match=r"the prompt has 250 tokens and max_new_tokens is 7: 257 positions.*"
                                         r"lower max_new_tokens to 6 or shorten the prompt"):
        check_room([250], 7, 256)
    with pytest.raises(ValueError, match=r"the longest prompt \(row 2\) has 255 tokens.*lower max_new_tokens to 1 or"):
        check_room([3, 4, 255], 2, 256)
