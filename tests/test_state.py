"""The per-call state's three parts: ``RowBook`` (host rows), ``DeviceState`` (cache, context, row tensors) and
``RoundStats`` (what the rounds did), each alone and as a generation advances them together."""

from __future__ import annotations

import torch
from tiny import ScriptedDrafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.core.tree import DRAFTER, LOOKUP
from ddtree.generation.round import speculative_round
from ddtree.generation.rows import RowBook
from ddtree.generation.stats import RoundStats
from ddtree.targets.cache import cache_length

BLOCK = 5  # the scripted drafter proposes 4 tokens: a fully accepted round verifies 5 nodes


def test_round_stats_count_each_round_once_per_row():
    stats = RoundStats(3)
    both = DRAFTER | LOOKUP
    stats.observe([2, 0], [4, 1], budget=6, sources=[[DRAFTER, DRAFTER, LOOKUP, both], [DRAFTER]])
    assert stats.acceptance == [[1], [], [4]]
    assert stats.budgets == [6] and stats.rounds == 1
    assert stats.accepted_by_source == {"drafter": 1, "lookup": 1, "both": 1}  # the roots are not counted
    assert stats.records == [[], [], []]  # nothing recorded unless asked
    stats.observe([2], [1])  # a plain step: no budget, no sources
    assert stats.acceptance == [[1], [], [4, 1]] and stats.budgets == [6] and stats.rounds == 2


def test_row_book_cuts_at_stops_and_max_new_tokens_and_drops_finished_rows():
    book = RowBook([torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([4, 5, 6])], max_new_tokens=4,
                   stops=frozenset({9}))
    book.host_lengths = [2, 1, 3]
    assert book.emit(0, [7, 9, 8]) == [7, 9] and book.finished[0]  # the stop token is kept, the rest cut
    assert book.emit(1, [7, 7, 7]) == [7, 7, 7] and not book.finished[1]
    assert book.emit(1, [8, 8]) == [8] and book.finished[1]  # max_new_tokens cuts the round
    assert book.emit(2, [5]) == [5] and not book.finished[2]
    assert book.drop_finished() == [2]  # the active position kept
    assert book.active == [2] and book.host_lengths == [3]
    assert book.new_tokens == [[7, 9], [7, 7, 7, 8], [5]]


def test_a_ragged_batch_keeps_its_parts_in_step_while_rows_finish():
    """Two prompts of different lengths; row 0 stops early. After every round the host rows, the device
    tensors and the statistics agree, and every round accepts the scripted drafter's whole block."""
    target = tiny_target("qwen3")
    prompts = [[5, 17, 3, 9], [11, 40, 2, 8, 33, 7]]
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
        refs.append(out[0].tolist())
    new = [r[len(p):] for r, p in zip(refs, prompts)]
    stop = next(t for t in new[0][6:] if t not in new[1][:25] and t not in new[0][:6])  # ends row 0 in round 2+
    drafter = ScriptedDrafter([torch.tensor(r + [0] * 8) for r in refs], 97, block_size=BLOCK)
    gen = SpeculativeGenerator(target, drafter, tree_budget=8, attention="sdpa")
    state = gen.start(prompts, max_new_tokens=25, stop_token_ids=[stop], record_trees=True)
    results = []
    while not state.done:
        results.append(speculative_round(state))
        rows, held, stats = state.rows, state.on_device, state.stats
        assert stats.rounds == len(results) - 1  # the prefill is not a round
        for b in range(2):
            assert stats.acceptance[b] == [r.acceptance[b] for r in results[1:] if r.acceptance[b] is not None]
            assert len(stats.records[b]) == len(stats.acceptance[b])
            assert rows.new_tokens[b] == [t for r in results for t in r.tokens[b]]
        if state.done:
            assert held.cache is None and held.draft is None and not held.deferred
            break
        assert held.lengths.tolist() == rows.host_lengths and held.roots.shape == (len(rows.active),)
        assert rows.host_lengths == [len(prompts[b]) + len(rows.new_tokens[b]) - 1 for b in rows.active]
        assert cache_length(held.cache) == max(rows.host_lengths)  # a finished row's padding is trimmed
    expected = [n[: n.index(stop) + 1] if b == 0 else n[:25] for b, n in enumerate(new)]
    assert state.new_tokens == state.rows.new_tokens == expected
    assert 1 < len(state.acceptance[0]) < len(state.acceptance[1])  # row 0 stopped rounds before row 1
    # the scripted drafter proposes the target's own continuation: every round verifies a whole block (counted
    # before a stop or max_new_tokens cuts what is emitted)
    assert all(a == BLOCK for row in state.acceptance for a in row)
    assert state.stats.budgets == [8] * state.stats.rounds
    again = gen.generate(prompts, max_new_tokens=25, stop_token_ids=[stop])
    assert again.row_tokens == expected and again.row_acceptance == state.stats.acceptance
    assert again.stats.rounds == state.stats.rounds and again.stats.budgets == state.stats.budgets
