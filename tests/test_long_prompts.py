"""Long prompts: the prefill keeps only what the round reads, and chunked prefill equals the one-shot one.

The prefill's logits cover the last position only; the forwards keep only the drafter's target layers
(HF's ``hidden_states`` layout, the last entry after the final norm); ``prefill_chunk`` splits the
prefill without changing a token or an acceptance length, on attention and GDN hybrid targets.
"""

from __future__ import annotations

import pytest
import torch
from test_batch import prompts_of
from test_generator import expected_acceptance
from tiny import FAMILIES, ScriptedDrafter, family_target, tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.blocks import PromptLookup, speculative_round
from ddtree.drafters.features import extract_context_feature
from ddtree.targets.cache import new_target_cache
from ddtree.targets.forward import chunked_prefill, target_forward

NEW = 20


def _head_rows(target):
    """Record the positions the lm_head sees per call (a logits row per position)."""
    seen: list[int] = []
    target.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    return seen


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_the_prefill_computes_logits_at_the_last_position_only(kind):
    target = tiny_target(kind)
    gen = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=6, prefill_chunk=64)
    seen = _head_rows(target)
    state = gen.start(prompts_of([150])[0], max_new_tokens=4, record_trees=True)
    speculative_round(state)
    assert seen == [1, 1, 1]  # three chunks of 64, 64, 22 prompt tokens: one logits row each
    speculative_round(state)  # a verify round reads every node's logits (after the drafter's block)
    assert seen[-1] == state.records[0][0].tree.num_nodes > 1


def _captured(target, layer_ids):
    """Which ``hidden_states`` entries a drafter's ``context_features`` is handed, per call."""
    drafter = tiny_drafter(target, target_layer_ids=layer_ids)
    gen = SpeculativeGenerator(target, drafter, tree_budget=6)
    calls: list[list[int]] = []
    original = gen.drafter.context_features

    def spy(hidden_states):
        calls.append([j for j, h in enumerate(hidden_states) if h is not None])
        assert len(hidden_states) == target.config.num_hidden_layers + 1  # HF's layout, entry 0 the embeddings
        return original(hidden_states)

    gen.drafter.context_features = spy
    gen.generate(prompts_of([12])[0], max_new_tokens=10)
    return calls


@pytest.mark.parametrize("layer_ids", [[1], [0, 3], [2, 3]])
def test_prefill_and_verify_keep_exactly_the_drafters_layers(layer_ids):
    calls = _captured(tiny_target("qwen3"), layer_ids)
    assert len(calls) >= 3  # the prefill and the verify rounds
    assert all(c == [i + 1 for i in layer_ids] for c in calls)


@pytest.mark.parametrize("kind", ["qwen3", "llama", *FAMILIES])
def test_kept_layers_equal_output_hidden_states_bit_for_bit(kind):
    """Hooks on the decoder layers give HF's hidden_states[i + 1] exactly, and the last layer id the post-norm
    entry, so the drafter's features are those of the output_hidden_states path to the bit."""
    target = family_target(kind) if kind in FAMILIES else tiny_target(kind)
    ids = torch.tensor(prompts_of([9, 9], seed=3))
    full = target_forward(target, ids, None, new_target_cache(target), hidden=True)
    num = target.config.num_hidden_layers
    for layer_ids in ([0], [1, num - 1], list(range(num))):
        kept = target_forward(target, ids, None, new_target_cache(target), hidden=True, layers=layer_ids)
        assert [j for j, h in enumerate(kept.hidden_states) if h is not None] == [i + 1 for i in layer_ids]
        assert torch.equal(extract_context_feature(kept.hidden_states, layer_ids),
                           extract_context_feature(full.hidden_states, layer_ids))
        assert torch.equal(kept.logits, full.logits)
    last = target_forward(target, ids, None, new_target_cache(target), hidden=True, layers=[num - 1])
    normed = target.get_decoder()(input_ids=ids).last_hidden_state
    assert torch.equal(last.hidden_states[num], normed)  # the last layer id reads after the final norm


def test_a_drafter_that_reads_no_hidden_states_keeps_none():
    target = tiny_target("qwen3")
    gen = SpeculativeGenerator(target, PromptLookup.for_target(target, block_size=4), tree_budget=6)
    flags, hooks = [], []
    layers = target.get_decoder().layers
    target.register_forward_pre_hook(lambda m, a, kw: flags.append(kw.get("output_hidden_states")),
                                     with_kwargs=True)
    target.get_output_embeddings().register_forward_hook(
        lambda m, a, o: hooks.append(sum(len(layer._forward_hooks) for layer in layers)))
    prompt = [5, 6, 7, 8] * 6
    gen.generate(prompt, max_new_tokens=10)
    assert flags and not any(flags) and hooks and not any(hooks)


def _pair(kind):
    target = family_target(kind) if kind in FAMILIES else tiny_target(kind)
    return target, tiny_drafter(target)


CASES = [("qwen3", [45], (45, 16, 7)), ("qwen3", [45, 17, 30], (16, 7)),
         ("qwen3_5", [150], (128, 64, 7)), ("qwen3_5", [150, 60, 100], (64,))]  # GDN: whole 64-token blocks


@pytest.mark.parametrize(("kind", "lengths", "chunks"), CASES)
def test_chunked_prefill_equals_one_shot_tokens_and_acceptance(kind, lengths, chunks):
    """A DFlash drafter reads the prompt's features, so a chunk boundary that lost or shifted one would
    change its acceptance; a padded batch takes the left-padded path (attention) or the per-row one (GDN)."""
    target, drafter = _pair(kind)
    prompts = prompts_of(lengths, seed=2)
    runs = {}
    for chunk in (None, *chunks):
        gen = SpeculativeGenerator(target, drafter, tree_budget=8, prefill_chunk=chunk)
        seen = _head_rows(target)
        state = gen.start(prompts if len(prompts) > 1 else prompts[0], max_new_tokens=NEW)
        speculative_round(state)
        target.get_output_embeddings()._forward_hooks.clear()
        per_row = 1 if len(lengths) == 1 or kind == "qwen3" else len(lengths)
        rows = lengths if per_row > 1 else [max(lengths)]
        step = chunk or max(lengths)
        if kind != "qwen3":
            step = -(-step // 64) * 64
        assert len(seen) == sum(-(-n // step) for n in rows)  # the prefill ran in chunks of `step`
        draft = state.catch_up_draft()
        width = int(draft.lengths.max())
        kv = [k[:, :, :width].clone() for k, _ in draft.kv]
        out = gen.generate(prompts if len(prompts) > 1 else prompts[0], max_new_tokens=NEW)
        runs[chunk] = (out.sequences, out.acceptance_lengths, kv)
    seq, acc, kv = runs[None]
    assert max(a for row in (acc if len(lengths) > 1 else [acc]) for a in row) > 1  # the drafter gets accepted
    for chunk, (s, a, k) in runs.items():
        assert torch.equal(s, seq), chunk
        assert a == acc, chunk
        for x, y in zip(k, kv):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-12)  # the drafter context: same features


@pytest.mark.parametrize(("kind", "lengths", "chunk"), [("qwen3", [45], 16), ("qwen3", [45, 17, 30], 16),
                                                       ("qwen3_5", [150, 60, 100], 64)])
def test_the_first_token_does_not_wait_for_the_drafters_last_chunk(kind, lengths, chunk):
    """The prefill emits the first token with each prompt's last chunk still held back from the drafter; the
    next round takes it in first, and the context then equals one built from a plain HF forward."""
    target, drafter = _pair(kind)
    prompts = prompts_of(lengths, seed=2)
    gen = SpeculativeGenerator(target, drafter, tree_budget=8, prefill_chunk=chunk)
    state = gen.start(prompts if len(prompts) > 1 else prompts[0], max_new_tokens=NEW)
    first = speculative_round(state)
    assert all(len(t) == 1 for t in first.tokens)
    in_context = state.on_device.draft.lengths.tolist()
    width = max(lengths)  # a padded attention batch is chunked over its padded width, a hybrid's row by row
    last = [width - (width - 1) // chunk * chunk] * len(lengths) if kind == "qwen3" else \
        [n - (n - 1) // chunk * chunk for n in lengths]
    assert in_context == [max(0, n - k) for n, k in zip(lengths, last)]  # every chunk but the last
    assert len(state.on_device.deferred) == (1 if kind == "qwen3" else len(lengths))  # the hybrid prefills row by row
    draft = state.catch_up_draft()
    assert draft.lengths.tolist() == lengths and not state.on_device.deferred
    for row, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            hs = target(ids, output_hidden_states=True).hidden_states
        fresh = gen.drafter.new_context(1)
        fresh.append(gen.drafter.context_features(hs), ids)
        for (k, v), (k1, v1) in zip(draft.kv, fresh.kv):
            n = len(prompt)
            torch.testing.assert_close(k[row:row + 1, :, :n], k1[:, :, :n], rtol=0, atol=1e-5)
            torch.testing.assert_close(v[row:row + 1, :, :n], v1[:, :, :n], rtol=0, atol=1e-5)
    out = gen.generate(prompts if len(prompts) > 1 else prompts[0], max_new_tokens=NEW)
    acc = out.acceptance_lengths if len(prompts) > 1 else [out.acceptance_lengths]
    assert max(a for row in acc for a in row) > 1  # the drafter gets accepted after the deferred intake


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_chunked_prefill_with_a_scripted_drafter_accepts_what_it_expects(kind):
    target = family_target(kind) if kind in FAMILIES else tiny_target(kind)
    prompt = prompts_of([33], seed=4)[0]
    plain = SpeculativeGenerator(target, ScriptedDrafter(torch.tensor(prompt), 97), tree_budget=0)
    ref = plain.generate(prompt, max_new_tokens=NEW, prefill_chunk=None).sequences[0].tolist()
    gen = SpeculativeGenerator(target, ScriptedDrafter(torch.tensor(ref + [0] * 8), 97, decoy_at={2: 3}),
                               tree_budget=6, prefill_chunk=10)
    out = gen.generate(prompt, max_new_tokens=NEW, record_trees=True)
    assert out.sequences[0].tolist() == ref
    assert out.acceptance_lengths == [expected_acceptance(r, ref) for r in out.rounds]


def test_chunked_prefill_matches_the_one_shot_cache_and_logits():
    target = tiny_target("qwen3")
    ids = torch.tensor(prompts_of([50], seed=5))
    one, many = new_target_cache(target), new_target_cache(target)
    a = chunked_prefill(target, ids, one, None)
    b = chunked_prefill(target, ids, many, 12)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for x, y in zip(one.layers, many.layers):
        torch.testing.assert_close(x.keys, y.keys, rtol=0, atol=1e-12)


def test_a_hybrid_prefill_in_whole_gdn_blocks_is_the_one_shot_to_the_bit():
    target = family_target("qwen3_5")
    ids = torch.tensor(prompts_of([150], seed=5))
    ref = chunked_prefill(target, ids, new_target_cache(target), None)
    for chunk in (64, 100):  # 100 rounds up to 128
        assert torch.equal(chunked_prefill(target, ids, new_target_cache(target), chunk), ref)


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True, "4096"])
def test_a_bad_prefill_chunk_is_refused_by_name(chunk):
    target = tiny_target("qwen3")
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        SpeculativeGenerator(target, tiny_drafter(target), prefill_chunk=chunk)
    gen = SpeculativeGenerator(target, tiny_drafter(target))
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        gen.start([1, 2, 3], max_new_tokens=2, prefill_chunk=chunk)


def _proposals(gen, prompts, trim: bool, monkeypatch):
    from ddtree.drafters.dflash.context import DFlashContext

    monkeypatch.setattr(DFlashContext, "trim_sliding", trim)
    logged, contexts = [], []
    original = DFlashContext.propose

    def spy(self, roots):
        proposal = original(self, roots)
        logged.append(proposal.logprobs.clone())
        contexts.append(self)
        return proposal

    monkeypatch.setattr(DFlashContext, "propose", spy)
    out = gen.generate(prompts, max_new_tokens=200)
    monkeypatch.setattr(DFlashContext, "propose", original)
    return out, logged, contexts[-1]


@pytest.mark.parametrize("lengths", [[40], [40, 13, 70]])
def test_trimming_sliding_layers_context_changes_no_draft(lengths, monkeypatch):
    """A sliding layer's context keeps only its window's keys: every proposal of a long generation equals the
    untrimmed context's, while its buffer stays bounded by the window (full layers keep everything)."""
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    gen = SpeculativeGenerator(target, drafter, tree_budget=8, prefill_chunk=16)
    prompts = prompts_of(lengths, seed=6)
    prompts = prompts if len(prompts) > 1 else prompts[0]
    kept, untrimmed, whole = _proposals(gen, prompts, False, monkeypatch)
    out, trimmed, ctx = _proposals(gen, prompts, True, monkeypatch)
    assert torch.equal(out.sequences, kept.sequences) and out.acceptance_lengths == kept.acceptance_lengths
    assert len(trimmed) == len(untrimmed) > 10
    for a, b in zip(trimmed, untrimmed):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert ctx.front > 0 and whole.front == 0
    sliding, full = ctx.kv[0][0].shape[2], ctx.kv[1][0].shape[2]
    assert sliding < full  # 300 positions of which the window shows 8
    if len(lengths) == 1:  # the 64 dropped at once, the window, a round: one doubling past 64
        assert sliding == 128 + 1
    assert whole.kv[0][0].shape[2] == whole.kv[1][0].shape[2]
