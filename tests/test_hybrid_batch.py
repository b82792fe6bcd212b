"""Hybrid GDN targets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) at batch > 1: every row is exactly its own batch-1 run.

A GDN layer's state is per row, so the batch must never mix rows: the prefill gives each row its
unpadded prefill's state, a finished row's state leaves with it, and a padded one-token step does
not disturb the recurrence.
"""

from __future__ import annotations

import pytest
import torch
from test_batch import BUILDERS, RowDecoys, assert_rows_are_their_own_runs, hf_greedy, prompts_of
from test_generator import expected_acceptance
from tiny import HYBRIDS, family_target, tiny_drafter

import ddtree.targets.linear_attention
from ddtree import SpeculativeGenerator
from ddtree.blocks import speculative_round
from ddtree.targets.cache import _kv_layers
from ddtree.targets.linear_attention import _linear_layer_ids, _states

NEW = 24
LENGTHS = [1, 13, 6, 20]  # row 0 is a 1-token prompt; 20 - 13 pads cross no GDN chunk but shift the conv windows


def _own_token(free, row, start):
    """The first token of ``free[row]`` from ``start`` on that no other row's run (nor this one's before) holds:
    as a stop token it ends that row there and no other."""
    others = {t for r, run in enumerate(free) if r != row for t in run}
    for i in range(start, len(free[row])):
        if free[row][i] not in others and free[row][i] not in free[row][:i]:
            return free[row][i]
    raise AssertionError(f"row {row}'s run has no token of its own after {start}: pick other prompts")


def _case(family):
    """The target, its prompts, each prompt's free greedy run, and stop tokens that end rows 0 and 2 early."""
    target = family_target(family)
    prompts = prompts_of(LENGTHS, seed=1)
    free = [hf_greedy(target, p, new=NEW) for p in prompts]
    stops = {_own_token(free, 0, 0), _own_token(free, 2, 5)}  # row 2 stops mid-run, row 0 early
    return target, prompts, free, stops


def _check_rows(target, prompts, free, stops, builder, budget):
    """Each row's output equals HF greedy alone; its acceptance equals its batch-1 run with its own drafter."""
    refs = [hf_greedy(target, p, new=NEW, stops=stops) for p in prompts]
    assert len(refs[0]) < NEW and 5 < len(refs[2]) < NEW and len(refs[1]) == len(refs[3]) == NEW  # others go on
    references = [torch.tensor(p + r + [0] * 8) for p, r in zip(prompts, free)]
    vocab = target.config.vocab_size
    gen = SpeculativeGenerator(target, RowDecoys(references, vocab, list(range(len(prompts)))), tree_budget=budget,
                               builder=builder)
    out = gen.generate(prompts, max_new_tokens=NEW, stop_token_ids=stops, record_trees=True)
    assert out.row_tokens == refs
    for b, prompt in enumerate(prompts):
        alone = SpeculativeGenerator(target, RowDecoys([references[b]], vocab, [b]), tree_budget=budget,
                                     builder=builder)
        one = alone.generate(prompt, max_new_tokens=NEW, stop_token_ids=stops)
        assert one.row_tokens[0] == refs[b]
        assert out.acceptance_lengths[b] == one.acceptance_lengths
        assert out.acceptance_lengths[b] == [expected_acceptance(r, prompt + free[b]) for r in out.rounds[b]]
    return out


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_batch_rows_equal_their_own_runs(family):
    target, prompts, free, stops = _case(family)
    for builder, budget in BUILDERS:
        out = _check_rows(target, prompts, free, stops, builder, budget)
        accs = [a for a in out.acceptance_lengths if len(a) > 3]
        assert any(len(set(r)) > 1 for r in zip(*accs))  # rows accept differently in one round
        assert max(max(a) for a in accs) >= 4  # and deep trees are accepted


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_plain_decoding_at_batch_gt_1(family):
    """Budget 0: one-token steps with a padding mask; the GDN layers see no padding after the prefill."""
    target, prompts, _, stops = _case(family)
    gen = SpeculativeGenerator(target, RowDecoys([torch.tensor([0])], target.config.vocab_size, [0]), tree_budget=0)
    out = gen.generate(prompts, max_new_tokens=NEW, stop_token_ids=stops)
    assert out.row_tokens == [hf_greedy(target, p, new=NEW, stops=stops) for p in prompts]


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_batch_with_the_dflash_drafter_matches_batch_one(family):
    """A real (random) DFlash drafter reads the per-row prefill's features: each row drafts the trees of its own run."""
    target = family_target(family)
    gen = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=8)
    prompts = prompts_of([3, 17, 9, 1], seed=4)
    assert_rows_are_their_own_runs(gen, target, prompts, new=16)


def _row_states(cache, row):
    return [tuple(s[row] for s in _states(cache, idx)) for idx in _linear_layer_ids(cache)]


@pytest.mark.parametrize("budget", [0, 6])
def test_hybrid_prefill_gives_each_row_its_unpadded_state(budget):
    """Bit for bit: each row's GDN states and attention columns after the batch prefill are its batch-1
    prefill's (a left-padded batch forward differs far past rounding: its chunked rule sees the pads)."""
    target = family_target("qwen3_next")
    prompts = prompts_of([1, 13, 70, 6], seed=1)  # 70 - 13 pads put row 1 across a 64-token chunk boundary
    drafter = RowDecoys([torch.tensor(p + [0] * 8) for p in prompts], target.config.vocab_size, [0, 1, 2, 3])
    gen = SpeculativeGenerator(target, drafter, tree_budget=budget)
    batch = gen.start(prompts, max_new_tokens=4)
    speculative_round(batch)
    width = max(len(p) for p in prompts)
    for b, prompt in enumerate(prompts):
        one = gen.start(prompt, max_new_tokens=4)
        speculative_round(one)
        assert int(batch.on_device.roots[b]) == int(one.on_device.roots[0])
        for got, want in zip(_row_states(batch.on_device.cache, b), _row_states(one.on_device.cache, 0)):
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        for (k, v, _), (k1, v1, _) in zip(_kv_layers(batch.on_device.cache), _kv_layers(one.on_device.cache)):
            assert (torch.equal(k[b, :, width - len(prompt):], k1[0])
                    and torch.equal(v[b, :, width - len(prompt):], v1[0]))


def _select_first_rows(cache, rows):
    """A broken select: keeps the first ``len(rows)`` rows' GDN states, not the remaining rows'."""
    for idx in _linear_layer_ids(cache):
        conv, state = _states(cache, idx)
        ddtree.targets.linear_attention._set_states(cache, idx, conv[: len(rows)], state[: len(rows)])


def _keep_all_rows(cache, rows):
    """A broken select: the finished rows' GDN states stay in the batch."""


@pytest.mark.parametrize("broken,caught", [(_select_first_rows, AssertionError),  # wrong tokens or acceptance
                                           (_keep_all_rows, RuntimeError)])  # the batch no longer lines up
def test_a_wrong_gdn_row_select_is_caught(broken, caught, monkeypatch):
    """With a finished row's GDN state kept, or the wrong rows' states kept, the batch checks fail."""
    target, prompts, free, stops = _case("qwen3_next")
    monkeypatch.setattr(ddtree.targets.linear_attention, "select_linear_rows", broken)
    with pytest.raises(caught):
        _check_rows(target, prompts, free, stops, "best_first", 8)
