"""DFlash2 drafters and prompt lookup under ``compile=True``: their static contexts draft in fixed shapes, and
the static round gives the dynamic round's tokens, trees and acceptance, greedy and sampled, with no graph
break (the steps compile with ``fullgraph=True``, which raises on one)."""

from __future__ import annotations

import pytest
import torch
from test_dflash2 import bigram_pair
from test_static_round import fresh_dynamo  # noqa: F401  (autouse: each test starts with dynamo reset)
from tiny import tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.drafters.dflash.drafter import DFlashDrafter
from ddtree.drafters.lookup import PromptLookup, WithLookup
from ddtree.generation.round import speculative_round

BACKEND = "aot_eager"
PROMPTS = [[5, 17, 42, 8, 9, 33, 5, 17, 42], [7, 7, 21, 60, 12, 5, 44, 3, 19, 7, 7], [11, 4, 11, 4, 11]]
NEW = 16


def rounds(gen, **call):
    state = gen.start(PROMPTS, max_new_tokens=NEW, stop_token_ids=(), record_trees=True, **call)
    while not state.done:
        speculative_round(state)
    trees = [[(r.tree.tokens.tolist(), r.accepted) for r in row] for row in state.records]
    return state.new_tokens, state.acceptance, trees, state.stats


def assert_static_equals_dynamic(target, drafter, budget, **call):
    dynamic = rounds(SpeculativeGenerator(target, drafter, tree_budget=budget), **call)
    static = rounds(SpeculativeGenerator(target, drafter, tree_budget=budget, compile=BACKEND), **call)
    assert static[0] == dynamic[0]
    assert static[1] == dynamic[1]
    assert static[2] == dynamic[2]
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert max(a for row in dynamic[1] for a in row) > 1  # something was accepted past the root
    return dynamic


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.mark.parametrize("call", [{}, dict(temperature=1.0, seed=[3, 4, 5])], ids=["greedy", "sampled"])
def test_a_dflash2_drafter_under_compile(tmp_path, call):
    """A DFlash2 selector that knows the target's next-token map for two tokens in three (deep, varying
    acceptance): its pairwise trees drafted in the static context equal the dynamic round's."""
    bigram_target, path, _ = bigram_pair(tmp_path / "d2")
    drafter = SpeculativeGenerator(bigram_target, str(path)).drafter
    assert_static_equals_dynamic(bigram_target, drafter, 6, **call)


@pytest.mark.parametrize("call", [{}, dict(temperature=0.8, top_k=20, seed=[3, 4, 5])], ids=["greedy", "sampled"])
def test_prompt_lookup_merged_under_compile(target, call):
    model = DFlashDrafter(tiny_drafter(target, block_size=5), target)
    merged = WithLookup(model, PromptLookup.for_target(target, block_size=5))
    assert_static_equals_dynamic(target, merged, 6, **call)


class Ticks:
    """A clock that advances one second a call: every stage costs the same, whatever its tree (a machine where
    verifying is free), so ``auto`` drafts, and its choices do not follow this machine's timings."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_auto_under_compile_picks_among_compiled_budgets(target):
    """``tree_budget="auto"`` with ``compile``: each round is a plain step or one rung of the ladder, compiled
    once; the tokens are greedy decoding's and each round's acceptance what the same budgets give when the
    dynamic round replays them."""
    from test_generator import Replay, reference

    from ddtree.budget.policy import AutoBudget
    from ddtree.generation.static_round import compiled_ladder

    assert compiled_ladder(torch.device("cpu")) == (1, 2, 4, 8)
    drafter = DFlashDrafter(tiny_drafter(target, block_size=5), target)
    gen = SpeculativeGenerator(target, drafter, tree_budget="auto", compile=BACKEND)
    assert gen.tree_budget == "auto"
    assert gen.budget_policy("auto").candidates == [1, 2, 4, 8]
    policy = AutoBudget(candidates=(1, 2, 4, 8), clock=Ticks())
    out = gen.generate(PROMPTS[0], max_new_tokens=NEW, stop_token_ids=(), tree_budget=policy)
    assert out.row_tokens[0] == reference(target, PROMPTS[0], new=NEW)[0, len(PROMPTS[0]):].tolist()
    assert set(out.stats.budgets) <= {0, 1, 2, 4, 8} and max(out.stats.budgets) > 0
    assert {b for _, b, _, _ in gen._static_steps} <= {0, 1, 2, 4, 8}  # one set of graphs per rung met
    replayed = SpeculativeGenerator(target, drafter).generate(
        PROMPTS[0], max_new_tokens=NEW, stop_token_ids=(), tree_budget=Replay(out.stats.budgets))
    assert replayed.acceptance_lengths == out.acceptance_lengths
    assert replayed.row_tokens == out.row_tokens
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0


def test_prompt_lookup_alone_under_compile(target):
    """The lookup as the only proposer (no model): its static context proposes from its token buffer."""
    assert_static_equals_dynamic(target, PromptLookup(target.config.vocab_size, block_size=5), 4)


def test_auto_under_compile_prices_only_the_rows_still_decoding(target):
    """Finished rows stay in the static buffers; the policy must see only the live rows (a batch whose rows stop
    at different rounds)."""
    from test_generator import reference

    from ddtree.budget.policy import AutoBudget

    drafter = DFlashDrafter(tiny_drafter(target, block_size=5), target)
    gen = SpeculativeGenerator(target, drafter, compile=BACKEND)
    prompts = [PROMPTS[0], PROMPTS[2]]
    first, second = (reference(target, p, new=NEW)[0, len(p):].tolist() for p in prompts)
    # row 1 stops after a few rounds, at a token row 0 never emits
    stop = next(t for i, t in enumerate(second) if i >= 3 and t not in second[:i] and t not in first)
    out = gen.generate(prompts, max_new_tokens=NEW, stop_token_ids=[stop],
                       tree_budget=AutoBudget(candidates=(1, 2, 4, 8), clock=Ticks()))
    assert out.row_tokens == [first, second[: second.index(stop) + 1]]
    assert len(out.stats.budgets) > len(out.row_acceptance[1]) and max(out.stats.budgets) > 0
