"""End-to-end greedy generation: lossless output AND the acceptance it should have."""

from __future__ import annotations

import pytest
import torch

from ddtree import SpeculativeGenerator, beam
from tiny import ScriptedDrafter, tiny_drafter, tiny_target

PROMPTS = [[5, 17, 3], [11, 2, 2, 40, 61, 7, 9, 33, 12, 1, 80], list(range(10, 50))]
NEW = 64
CONFIGS = [("chain", 32), ("best_first", 1), ("best_first", 4), ("best_first", 16), ("best_first", 64), ("beam@3x4", 12)]


def reference(target, prompt, new=NEW, stop=None):
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=new, do_sample=False, pad_token_id=0)
    if stop is not None:
        kwargs["eos_token_id"] = stop
    return target.generate(ids, **kwargs)


def expected_acceptance(record, ref_tokens: list[int]) -> int:
    """1 + the deepest tree node whose path spells the reference continuation after the root."""
    tree = record.tree
    toks, parents, depths = (t[0].tolist() for t in (tree.tokens, tree.parents, tree.depths))
    ok = [True] + [False] * (len(toks) - 1)
    best = 0
    for i in range(1, len(toks)):
        pos = record.start + depths[i]
        ok[i] = ok[parents[i]] and pos < len(ref_tokens) and toks[i] == ref_tokens[pos]
        if ok[i]:
            best = max(best, depths[i])
    return best + 1


@pytest.mark.parametrize("builder,budget", CONFIGS)
def test_lossless_greedy_and_acceptance_matches_recompute(tiny_pair, builder, budget):
    target, draft = tiny_pair
    gen = SpeculativeGenerator(target, draft, tree_budget=budget, builder=builder)
    for prompt in PROMPTS:
        ref = reference(target, prompt)
        out = gen.generate(torch.tensor([prompt]), max_new_tokens=NEW, record_trees=True)
        assert torch.equal(out.sequences, ref)
        ref_tokens = ref[0].tolist()
        # Every round accepted exactly what a from-scratch walk of its tree against the reference gives.
        assert out.acceptance_lengths == [expected_acceptance(r, ref_tokens) for r in out.rounds]
        assert sum(out.acceptance_lengths[:-1]) + 1 < NEW <= sum(out.acceptance_lengths) + 1
        assert out.stats.rounds == len(out.acceptance_lengths)


def test_lossless_with_stop_tokens(tiny_pair):
    target, draft = tiny_pair
    prompt = PROMPTS[1]
    full = reference(target, prompt)[0, len(prompt):].tolist()
    stop = full[20]
    ref = reference(target, prompt, stop=stop)
    assert ref.shape[1] == len(prompt) + full.index(stop) + 1
    for builder in ("chain", "best_first"):
        out = SpeculativeGenerator(target, draft, tree_budget=16, builder=builder).generate(
            torch.tensor([prompt]), max_new_tokens=NEW, stop_token_ids=[stop, 10_000]
        )
        assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("builder", ["chain", "best_first"])
def test_agreeing_drafter_accepts_full_depth_every_round(builder):
    target = tiny_target("qwen3")
    prompt = PROMPTS[1]
    ref = reference(target, prompt, new=61)
    drafter = ScriptedDrafter(ref, vocab=target.config.vocab_size, block_size=5)
    out = SpeculativeGenerator(target, drafter, tree_budget=8, builder=builder).generate(
        torch.tensor([prompt]), max_new_tokens=61
    )
    assert torch.equal(out.sequences, ref)
    # 1 token from prefill, then 15 rounds of 4 drafts + bonus.
    assert out.acceptance_lengths == [5] * 12


def test_tree_recovers_a_second_ranked_token_the_chain_misses():
    target = tiny_target("llama")
    prompt = PROMPTS[0]
    ref = reference(target, prompt, new=41)
    vocab = target.config.vocab_size
    chain_out = SpeculativeGenerator(
        target, ScriptedDrafter(ref, vocab, decoy_at={2: 3}), tree_budget=32, builder="chain"
    ).generate(torch.tensor([prompt]), max_new_tokens=41)
    tree_out = SpeculativeGenerator(
        target, ScriptedDrafter(ref, vocab, decoy_at={2: 3}), tree_budget=7, builder="best_first"
    ).generate(torch.tensor([prompt]), max_new_tokens=41)
    assert torch.equal(chain_out.sequences, ref) and torch.equal(tree_out.sequences, ref)
    assert chain_out.acceptance_lengths == [2] * 20  # depth 1 right, depth 2 a decoy
    assert tree_out.acceptance_lengths == [5] * 8  # the budget-7 tree holds the rank-1 branch


def test_tokens_equal_to_mask_id_are_kept():
    target = tiny_target("qwen3")
    prompt = PROMPTS[2]
    ref = reference(target, prompt)
    generated = ref[0, len(prompt):].tolist()
    mask_id = max(set(generated), key=generated.count)  # a token the target really emits
    draft = tiny_drafter(target)
    draft.config.mask_token_id = mask_id
    gen = SpeculativeGenerator(target, draft, tree_budget=16)
    assert gen.drafter.mask_token_id == mask_id
    out = gen.generate(torch.tensor([prompt]), max_new_tokens=NEW)
    assert torch.equal(out.sequences, ref)
    assert out.new_tokens[0].tolist().count(mask_id) == generated.count(mask_id) > 0


def test_repeated_calls_do_not_leak_state(tiny_pair):
    target, draft = tiny_pair
    gen = SpeculativeGenerator(target, draft, tree_budget=16)
    a = gen.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=40)
    b = gen.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=40)
    c = gen.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=40)
    d = gen.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=40)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.sequences, d.sequences)
    assert a.acceptance_lengths == b.acceptance_lengths == d.acceptance_lengths
    assert torch.equal(c.sequences, reference(target, PROMPTS[0], new=40))


def test_stream_yields_what_generate_returns(tiny_pair):
    """Each round yields its accepted path and bonus token; the last round's chunk is cut at max_new_tokens."""
    target, _ = tiny_pair
    prompt = PROMPTS[1]
    ref = reference(target, prompt, new=60)[0].tolist()
    gen = SpeculativeGenerator(target, ScriptedDrafter(torch.tensor(ref), 97, decoy_at={3: 0}), tree_budget=16)
    out = gen.generate(torch.tensor([prompt]), max_new_tokens=50, record_trees=True)
    acc = out.acceptance_lengths
    assert acc == [expected_acceptance(r, ref) for r in out.rounds] and acc[0] == 5  # the decoy's runner-up is in
    chunks = list(gen.stream(torch.tensor([prompt]), max_new_tokens=50))
    assert len(chunks) == 1 + len(acc) and len(chunks[0]) == 1  # the prefill's token, then one chunk per round
    assert [len(c) for c in chunks[1:-1]] == acc[:-1]
    assert len(chunks[-1]) == 50 - 1 - sum(acc[:-1]) <= acc[-1]
    assert sum(chunks, []) == out.new_tokens[0].tolist() == ref[len(prompt):len(prompt) + 50]


def test_budget_zero_is_plain_decoding(tiny_pair):
    target, draft = tiny_pair
    out = SpeculativeGenerator(target, draft, tree_budget=0).generate(torch.tensor([PROMPTS[0]]), max_new_tokens=20)
    assert torch.equal(out.sequences, reference(target, PROMPTS[0], new=20))
    assert out.acceptance_lengths == [1] * 19


def test_callable_builder_is_used(tiny_pair):
    target, draft = tiny_pair
    calls = []

    def narrow(root, logprobs, budget):
        calls.append(budget)
        return beam(1, 2)(root, logprobs, budget)

    out = SpeculativeGenerator(target, draft, tree_budget=5, builder=narrow).generate(
        torch.tensor([PROMPTS[0]]), max_new_tokens=20, record_trees=True
    )
    assert torch.equal(out.sequences, reference(target, PROMPTS[0], new=20))
    assert calls and set(calls) == {5}
    assert all(r.tree.num_nodes <= 3 for r in out.rounds)


def test_stats_cover_every_stage(tiny_pair):
    target, draft = tiny_pair
    out = SpeculativeGenerator(target, draft, tree_budget=8).generate(torch.tensor([PROMPTS[0]]), max_new_tokens=20)
    for stage in ("prefill", "draft", "tree_build", "mask", "verify", "commit"):
        assert out.stats.seconds[stage] > 0
    assert out.stats.new_tokens == 20
    assert out.stats.mean_acceptance == pytest.approx(sum(out.acceptance_lengths) / len(out.acceptance_lengths))
    assert out.stats.budgets == [8] * out.stats.rounds
