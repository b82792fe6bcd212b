"""A round reads the device once: its accepted counts and tokens, in one packed tensor.

Counted with :func:`ddtree.runtime.host_reads.count_host_reads` on tiny float64 pairs, for DFlash, DFlash2 and
prompt-lookup proposals (alone and grafted), chain-shaped and wider trees, batch 1 and a ragged batch, greedy
and sampled. The tree builders of ``ddtree.core.builders`` build on the device too; the first tests use a
fixed-shape torch builder written here (so a read in a builder cannot hide one in the round), the later ones
the shipped builders. The output and acceptance are checked alongside.
"""

from __future__ import annotations

import pytest
import torch
from test_dflash2 import dflash2_config, fill
from test_generator import expected_acceptance, reference
from tiny import tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.budget.policy import AutoBudget
from ddtree.core.tree import LOOKUP, DraftTree
from ddtree.drafters.dflash.drafter import DFlashDrafter
from ddtree.drafters.dflash2.config import DFlash2Config
from ddtree.drafters.dflash2.model import DFlash2DraftModel
from ddtree.drafters.lookup import PromptLookup, WithLookup
from ddtree.generation.round import speculative_round
from ddtree.runtime.host_reads import count_host_reads

PROMPTS = [[5, 17, 42, 8, 9, 33], [7, 7, 21, 60, 12, 5, 44, 3, 19], [11, 4], [90, 2, 36, 51, 8, 14, 27]]
NEW = 12  # 9-10 steady rounds a case, some accepting 2 nodes


def spine_tree(width: int, from_parents: bool = False):
    """A builder of a spine (each depth's top token) with ``width - 1`` siblings per depth, every shape fixed by
    the budget: ``width`` 1 is a chain. Structure from Python ints, tokens and scores by tensor ops only."""

    def build(roots: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
        bsz, depth, _ = logprobs.shape
        d = max(1, min(depth, budget // width))
        top = logprobs[:, :d].topk(width, dim=-1)  # [B, d, width]
        parents = [-1] + [0 if k == 0 else 1 + (k - 1) * width for k in range(d) for _ in range(width)]
        depths = [0] + [k + 1 for k in range(d) for _ in range(width)]
        n = len(parents)
        tokens = torch.cat([roots.view(bsz, 1).long(), top.indices.reshape(bsz, d * width)], dim=1)
        spine = top.values[..., 0].cumsum(1)
        before = torch.cat([spine.new_zeros(bsz, 1), spine[:, :-1]], dim=1)
        scores = torch.cat([spine.new_zeros(bsz, 1), (before[..., None] + top.values).reshape(bsz, -1)], 1).float()
        parent_t = torch.tensor(parents, device=roots.device).expand(bsz, n).contiguous()
        if from_parents:  # the library's own construction of depths and visibility (it reads the device)
            return DraftTree.from_parents(tokens, parent_t, scores)
        vis = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            vis[i] |= vis[parents[i]]
        return DraftTree(tokens, parent_t, torch.tensor(depths, device=roots.device).expand(bsz, n).contiguous(),
                         scores, vis.to(roots.device).expand(bsz, n, n).contiguous())

    return build


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def references(target):
    """HF greedy's full sequence for each of ``PROMPTS`` on ``target``, computed once for every case, past the
    end (a last round may accept beyond ``NEW``, and its walk must see those tokens)."""
    return {tuple(p): reference(target, p, new=NEW + 5)[0].tolist() for p in PROMPTS}


def drafter(kind: str, target):
    if kind == "dflash":
        return tiny_drafter(target, block_size=5)
    model = DFlash2DraftModel(DFlash2Config.from_dict(dflash2_config(target))).double()
    fill(model, 0)
    return model.eval()


def run_counted(gen, prompts, sampled: bool):
    """Every round of one generation, and the host reads of each round after the prefill (the first of them
    takes in the prompt's deferred last chunk too; rounds where a row finishes are apart)."""
    options = dict(do_sample=True, temperature=0.8, seed=3) if sampled else dict(do_sample=False)
    state = gen.start(prompts, max_new_tokens=NEW, stop_token_ids=(), record_trees=True, **options)
    speculative_round(state)
    steady, finishing = [], []
    while not state.done:
        with count_host_reads() as reads:
            result = speculative_round(state)
        (finishing if result.finished else steady).append(reads)
    return state, steady, finishing


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("rows", [1, 4])
def test_greedy_rounds_read_once_and_accept_what_the_target_would(target, references, kind, width, rows):
    prompts = PROMPTS[:rows]
    gen = SpeculativeGenerator(target, drafter(kind, target), tree_budget=4 * width, builder=spine_tree(width))
    state, steady, finishing = run_counted(gen, prompts, sampled=False)
    assert len(steady) >= 3
    assert [r.count for r in steady] == [1] * len(steady), [dict(r.by_site) for r in steady if r.count != 1]
    assert [r.count for r in finishing] == [1] * len(finishing), [dict(r.by_site) for r in finishing]
    assert all(r.by_kind == {"tolist": 1} for r in steady)
    for b, prompt in enumerate(prompts):
        ref = references[tuple(prompt)]
        assert state.new_tokens[b] == ref[len(prompt):len(prompt) + NEW]
        assert state.acceptance[b] == [expected_acceptance(rec, ref) for rec in state.records[b]]
        assert all(1 <= a <= 4 + 1 for a in state.acceptance[b])


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("rows", [1, 4])
def test_sampled_rounds_read_once_and_equal_the_library_built_trees(target, kind, width, rows):
    prompts = PROMPTS[:rows]
    model = drafter(kind, target)
    gen = SpeculativeGenerator(target, model, tree_budget=4 * width, builder=spine_tree(width))
    state, steady, finishing = run_counted(gen, prompts, sampled=True)
    assert len(steady) >= 3
    assert [r.count for r in steady] == [1] * len(steady), [dict(r.by_site) for r in steady if r.count != 1]
    assert [r.count for r in finishing] == [1] * len(finishing), [dict(r.by_site) for r in finishing]
    same = SpeculativeGenerator(target, model, tree_budget=4 * width, builder=spine_tree(width, from_parents=True))
    again = same.generate(prompts, max_new_tokens=NEW, stop_token_ids=(), do_sample=True, temperature=0.8, seed=3)
    assert state.new_tokens == again.row_tokens
    assert state.acceptance == again.row_acceptance
    for b in range(rows):  # each round emitted its accepted path's tokens and its bonus, the path a root path
        emitted = []
        for rec in state.records[b]:
            tree = rec.tree
            parents = tree.parents[0].tolist()
            assert rec.accepted[0] == 0
            assert all(parents[c] == p for p, c in zip(rec.accepted, rec.accepted[1:]))
            emitted += [tree.tokens[0, i].item() for i in rec.accepted[1:]] + [rec.bonus]
        assert emitted[: len(state.new_tokens[b]) - 1] == state.new_tokens[b][1:]
        assert [len(rec.accepted) for rec in state.records[b]] == state.acceptance[b]


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("builder, budget", [("best_first", 8), ("chain", 4), ("beam@2x3", 6)])
@pytest.mark.parametrize("rows", [1, 4])
def test_rounds_with_the_shipped_builders_read_once(target, references, kind, builder, budget, rows):
    """The device builders (and their pairwise forms for DFlash2) add no read to the round's one."""
    prompts = PROMPTS[:rows]
    gen = SpeculativeGenerator(target, drafter(kind, target), tree_budget=budget, builder=builder)
    state, steady, finishing = run_counted(gen, prompts, sampled=False)
    assert len(steady) >= 3
    assert [r.count for r in steady] == [1] * len(steady), [dict(r.by_site) for r in steady if r.count != 1]
    assert [r.count for r in finishing] == [1] * len(finishing), [dict(r.by_site) for r in finishing]
    for b, prompt in enumerate(prompts):
        ref = references[tuple(prompt)]
        assert state.new_tokens[b] == ref[len(prompt):len(prompt) + NEW]
        assert state.acceptance[b] == [expected_acceptance(rec, ref) for rec in state.records[b]]


@pytest.mark.parametrize("attention", ["fused", "split"])
@pytest.mark.parametrize("width", [1, 3])
def test_split_attention_rounds_on_a_windowed_target_read_once(attention, width):
    """The split backends bound the tree depth by its shape, so a sliding-window layer adds no read to the round."""
    windowed = tiny_target("qwen3", use_sliding_window=True, sliding_window=6, max_window_layers=2)
    prompt = PROMPTS[1]
    windowed.set_attn_implementation("sdpa")
    ref = reference(windowed, prompt, new=NEW)[0].tolist()
    gen = SpeculativeGenerator(windowed, drafter("dflash", windowed), tree_budget=4 * width,
                               builder=spine_tree(width), attention=attention)
    state, steady, finishing = run_counted(gen, [prompt], sampled=False)
    assert windowed.config._attn_implementation.startswith("ddtree_")
    assert len(steady) >= 3
    assert [r.count for r in steady] == [1] * len(steady), [dict(r.by_site) for r in steady if r.count != 1]
    assert [r.count for r in finishing] == [1] * len(finishing), [dict(r.by_site) for r in finishing]
    assert state.new_tokens[0] == ref[len(prompt):]
    assert state.acceptance[0] == [expected_acceptance(rec, ref) for rec in state.records[0]]
    assert all(1 <= a <= 4 + 1 for a in state.acceptance[0])


@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("sampled", [False, True])
def test_prompt_lookup_rounds_read_once(target, references, merged, rows, sampled):
    """Prompt lookup alone and grafted into a DFlash tree: the n-gram match, the branch and the graft run on the
    device, so the round still reads once; greedy acceptance is the walk's, sampled paths are root paths."""
    prompts = [p * 2 for p in PROMPTS[:rows]]  # each prompt twice: the lookup branch has something to match
    lookup = PromptLookup.for_target(target, block_size=5)
    proposer = WithLookup(DFlashDrafter(drafter("dflash", target), target), lookup) if merged else lookup
    gen = SpeculativeGenerator(target, proposer, tree_budget=6, builder="best_first" if merged else "chain")
    state, steady, finishing = run_counted(gen, prompts, sampled=sampled)
    assert len(steady) >= 3
    assert [r.count for r in steady] == [1] * len(steady), [dict(r.by_site) for r in steady if r.count != 1]
    assert [r.count for r in finishing] == [1] * len(finishing), [dict(r.by_site) for r in finishing]
    lookup_nodes = sum(int((rec.tree.sources & LOOKUP).bool().sum()) for recs in state.records for rec in recs
                       if rec.tree.sources is not None)
    assert lookup_nodes > 0 if merged else all(rec.tree.sources is None for recs in state.records for rec in recs)
    for b, prompt in enumerate(prompts):
        if sampled:
            for rec in state.records[b]:
                parents = rec.tree.parents[0].tolist()
                assert rec.accepted[0] == 0 and all(parents[c] == p for p, c in zip(rec.accepted, rec.accepted[1:]))
            continue
        ref = reference(target, prompt, new=NEW + 5)[0].tolist()  # past the end: the last round may accept beyond
        assert state.new_tokens[b] == ref[len(prompt):len(prompt) + NEW]
        assert state.acceptance[b] == [expected_acceptance(rec, ref) for rec in state.records[b]]


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dflash with lookup"])
@pytest.mark.parametrize("rows", [1, 4])
def test_auto_reads_the_price_once_and_the_round_once(target, references, kind, rows):
    """Under ``"auto"`` the budget is a shape chosen from this round's proposal, so a drafting round reads twice:
    the candidates' price (one packed tensor) and the accepted tokens; a plain round once. On the policy's clock
    a plain round takes a second and a drafting round 10 ms, so it drafts but for its retries of plain."""
    prompts = PROMPTS[:rows]
    model = drafter("dflash2" if kind == "dflash2" else "dflash", target)
    proposer = WithLookup(DFlashDrafter(model, target), PromptLookup.for_target(target, block_size=5)) \
        if kind == "dflash with lookup" else model
    gen = SpeculativeGenerator(target, proposer)
    now, budgets = [0.0], []

    def clock() -> float:  # read once per round, as the last one ends
        now[0] += 0.01 if budgets and budgets[-1] else 1.0
        return now[0]

    policy = AutoBudget.for_generator(gen, clock=clock, candidates=(1, 2, 4, 8))
    state = gen.start(prompts, max_new_tokens=NEW, stop_token_ids=(), record_trees=True, tree_budget=policy)
    speculative_round(state)
    reads = []
    while not state.done:
        with count_host_reads() as counted:
            speculative_round(state)
        budgets.append(state.stats.budgets[-1])
        reads.append(counted)
    assert sum(b > 0 for b in budgets) >= 5 and 0 in budgets
    for counted, budget in zip(reads, budgets):
        sites = {site.rsplit(":", 1)[0] for site in counted.by_site}
        assert counted.count == (2 if budget else 1), dict(counted.by_site)
        assert sites == {"ddtree.generation.round._read_accepted"} | ({"ddtree.budget.acceptance.price"} if budget
                                                                      else set())
    for b, prompt in enumerate(prompts):
        ref = references[tuple(prompt)]
        assert state.new_tokens[b] == ref[len(prompt):len(prompt) + NEW]
        assert state.acceptance[b] == [expected_acceptance(rec, ref) for rec in state.records[b]]
