"""The per-call state's three parts: ``RowBook`` (host rows), ``DeviceState`` (cache, context, row tensors) and
``RoundStats`` (what the rounds did), each alone and as a generation advances them together."""

from __future__ import annotations

import pytest
import torch
from tiny import ScriptedDrafter, tiny_drafter, tiny_target

from ddtree import BudgetPolicy, SpeculativeGenerator
from ddtree.core.tree import DRAFTER, LOOKUP
from ddtree.drafters.base import Proposal
from ddtree.generation.round import HELD_BACK_MOST, speculative_round
from ddtree.generation.rows import RowBook
from ddtree.generation.state import _merge_full_runs
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


class SkipThenDraft(BudgetPolicy):
    """Tree rounds listed in ``plain`` (1-based) run without a tree; the others draft at ``budget``."""

    def __init__(self, plain: set[int], budget: int = 8) -> None:
        self.plain, self.budget, self.rounds = plain, budget, 0

    def prepare(self, context_len: int, batch: int) -> None:
        self.rounds += 1
        self.skip_draft = self.rounds in self.plain

    def choose(self, proposal: Proposal, context_len: int) -> int:
        return self.budget


PLAIN_RUNS = {1, 2, 3, 4, 5, 9, 10, 11, 12}


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("lengths", [[21], [21, 9, 14]])
def test_rounds_without_a_tree_hand_the_drafter_their_tokens_in_one_pass_at_the_next_drafting_round(
        lengths, window, monkeypatch):
    """The drafter is not run in a round that does not draft: its features wait and go in as one append when a
    round drafts. Tokens and acceptance equal a loop that takes every round's append at once, and the greedy
    target's own tokens (also with a sliding-window drafter layer, whose window the long append must keep)."""
    target = tiny_target("qwen3")
    slide = {} if window is None else {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": window}
    drafter = tiny_drafter(target, **slide)
    gen = SpeculativeGenerator(target, drafter, tree_budget=8, attention="sdpa")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in lengths]
    ids = prompts if len(prompts) > 1 else prompts[0]
    new = 40
    policy = SkipThenDraft(PLAIN_RUNS)
    appends: list[tuple[int, int, list[int]]] = []  # (tree round, tokens per row, host counts)
    context_type = type(gen.drafter.new_context(1))
    original = context_type.append

    def spy(self, features, tokens, counts=None, **kw):
        appends.append((policy.rounds, tokens.shape[1], list(kw.get("host_counts") or [])))
        return original(self, features, tokens, counts, **kw)

    monkeypatch.setattr(context_type, "append", spy)
    held = gen.generate(ids, max_new_tokens=new, tree_budget=policy)
    monkeypatch.setattr(context_type, "append", original)

    eager_policy = SkipThenDraft(PLAIN_RUNS)
    state = gen.start(ids, max_new_tokens=new, tree_budget=eager_policy)
    while not state.done:
        speculative_round(state)
        if not state.done:
            state.catch_up_draft()  # every round's append at once, as a plain step's used to go
    plain = gen.generate(ids, max_new_tokens=new, tree_budget=0)

    assert held.row_tokens == plain.row_tokens  # lossless
    assert state.new_tokens == held.row_tokens
    assert state.acceptance == (held.acceptance_lengths if len(prompts) > 1 else [held.acceptance_lengths])
    assert max(a for row in state.acceptance for a in row) > 1  # the drafter is accepted after the held intake
    assert not [a for a in appends if a[0] in PLAIN_RUNS]  # nothing reaches the drafter in a round without a tree
    rows = len(prompts)
    first_runs = [a for a in appends if a[0] == 6][:-1]  # round 6 takes in rounds 1-5 (and the prompt's last chunk)
    assert sum(a[1] for a in first_runs if a[2] == [a[1]] * rows) >= 5
    assert [a for a in appends if a[0] == 13][0][1:] == (4, [4] * rows)  # rounds 9-12: one append of 4 tokens


def test_held_appends_merge_only_runs_in_which_every_row_takes_all_its_tokens():
    def append(width, host_counts, mark):
        rows = len(host_counts)
        tokens = torch.full((rows, width), mark)
        return torch.full((rows, width, 2), float(mark)), tokens, torch.tensor(host_counts), host_counts

    ragged, full1, full2, ragged2, full3 = (append(3, [3, 1], 1), append(1, [1, 1], 2), append(2, [2, 2], 3),
                                            append(2, [0, 2], 4), append(1, [1, 1], 5))
    merged = _merge_full_runs([ragged, full1, full2, ragged2, full3])
    assert [m[1].tolist() for m in merged] == [ragged[1].tolist(), [[2, 3, 3], [2, 3, 3]], ragged2[1].tolist(),
                                               full3[1].tolist()]
    assert merged[1][2].tolist() == [3, 3] and merged[1][3] == [3, 3]
    assert merged[1][0][:, :, 0].tolist() == [[2.0, 3.0, 3.0]] * 2
    assert merged[0] is ragged and merged[2] is ragged2 and merged[3] is full3


def test_rounds_without_a_tree_hold_a_bounded_number_of_appends():
    target = tiny_target("qwen3")
    gen = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=8, attention="sdpa")
    state = gen.start([5, 17, 3, 9], max_new_tokens=HELD_BACK_MOST + 20, tree_budget=SkipThenDraft(set(range(1, 999))))
    most = 0
    while not state.done:
        speculative_round(state)
        most = max(most, len(state.on_device.deferred))
        if not state.done and len(state.rows.new_tokens[0]) == HELD_BACK_MOST + 10:
            draft = state.catch_up_draft()
            assert draft.lengths.tolist() == state.on_device.lengths.tolist()  # every committed token, once
    assert most == HELD_BACK_MOST - 1  # taken in as the bound is reached
