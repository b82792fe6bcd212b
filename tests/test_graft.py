"""The device graft and the device prompt lookup against their Python references, node for node and token for
token, on random, tied and repetitive inputs; pads that the walk never accepts; and no host read in either.

Example counts: ``examples(n)`` in CI (derandomized), 20x with ``--slow`` (see docs/reliability.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_device_builders import assert_same_tree, distribution
from tiny import examples

from ddtree.core import reference_builders as ref
from ddtree.core.builders import beam, best_first, chain
from ddtree.core.graft import Branches, graft_cuts, graft_paths
from ddtree.core.tree import DRAFTER, LOOKUP, DraftTree, first_path
from ddtree.core.verify import accept_longest_branch
from ddtree.drafters.lookup import PromptLookup, lookup_continuation
from ddtree.runtime.host_reads import count_host_reads

BUILDERS = {"best_first": best_first, "chain": chain, "beam@2x3": beam(2, 3)}


def assert_same_graft(tree, paths, budget):
    got, want = graft_paths(tree, paths, budget), ref.graft_paths(tree, paths, budget)
    assert_same_tree(got, want)
    assert (got.sources is None) == (want.sources is None)  # None: no branches, the tree as it was
    assert got.sources is None or torch.equal(got.sources, want.sources), (got.sources, want.sources)
    return got


def random_paths(gen: torch.Generator, tree, vocab: int, max_branches: int, depth: int, tied: bool):
    """Per row up to ``max_branches`` branches that often follow the tree's own nodes for a while (so they merge)
    and then leave it; scores non-increasing, from a few levels when ``tied``."""
    paths = []
    for b in range(tree.batch_size):
        table = tree.child_table(b)
        row = []
        for _ in range(int(torch.randint(0, max_branches + 1, (1,), generator=gen))):
            length = int(torch.randint(1, depth + 1, (1,), generator=gen))
            node, toks = 0, []
            for _ in range(length):
                kids = table.get(node, {})
                if kids and float(torch.rand(1, generator=gen)) < 0.6:
                    tok = list(kids)[int(torch.randint(0, len(kids), (1,), generator=gen))]
                    node = kids[tok]
                else:
                    tok, node = int(torch.randint(0, vocab, (1,), generator=gen)), -1
                toks.append(tok)
                if node < 0:
                    table = {}
            steps = torch.rand(length, generator=gen) * 2
            steps = (steps * 2).round() / 2 if tied else steps
            row.append((toks, (-steps.cumsum(0)).float().tolist()))
            table = tree.child_table(b)
        paths.append(row)
    return paths


@settings(max_examples=examples(80), deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), depth=st.integers(1, 5), vocab=st.integers(2, 12),
       builder=st.sampled_from(sorted(BUILDERS)), budget=st.integers(1, 24), branches=st.integers(0, 3),
       tied=st.booleans())
def test_device_graft_equals_the_reference(seed, batch, depth, vocab, builder, budget, branches, tied):
    gen = torch.Generator().manual_seed(seed)
    lp = distribution(gen, (batch, depth, vocab), "levels" if tied else "random")
    tree = BUILDERS[builder](torch.randint(0, vocab, (batch,), generator=gen), lp, budget)
    paths = random_paths(gen, tree, vocab, branches, depth + 2, tied)
    grafted = assert_same_graft(tree, paths, budget)
    assert grafted.num_nodes - 1 <= budget
    # Every kept node's parent is kept before it, and scores never rise from a parent to its child.
    real = grafted.parents >= 0
    index = torch.arange(grafted.num_nodes)
    assert bool(((grafted.parents < index) | ~real).all())
    above = grafted.scores.gather(1, grafted.parents.clamp(min=0))
    assert bool(((grafted.scores <= above) | ~real).all())
    # The tree's first path (its best guess at each depth) survives whole, whatever the branches score.
    on = first_path(tree)
    for b in range(batch):
        table, node = grafted.child_table(b), 0
        for token in tree.tokens[b][on[b]].tolist():
            node = table[node][token]


def test_a_branch_on_the_tree_raises_its_nodes_and_new_ones_rank_in():
    """Known by hand: row 0's branch follows the drafter's best child, then adds two nodes that outrank the
    drafter's others; row 1's branch is hopeless and left out; the node count is the budget's."""
    lp = torch.log_softmax(torch.randn(2, 4, 20, generator=torch.Generator().manual_seed(0)) * 2, -1)
    tree = best_first(torch.tensor([3, 4]), lp, 6)
    top = int(lp[0, 0].argmax())
    paths = [[([top, 11, 12], [-0.1, -0.2, -0.3])], [([15, 16], [-50.0, -60.0])]]
    grafted = assert_same_graft(tree, paths, 6)
    assert grafted.num_nodes == 7
    t0 = grafted.child_table(0)
    first = t0[0][top]
    assert grafted.sources[0, first] == DRAFTER | LOOKUP and grafted.scores[0, first] == pytest.approx(-0.1)
    assert grafted.sources[0, t0[first][11]] == LOOKUP and 12 in t0[t0[first][11]]
    assert 15 not in grafted.child_table(1)[0]
    assert grafted.sources[1].tolist().count(LOOKUP) == 0


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), depth=st.integers(1, 5), vocab=st.integers(2, 12),
       builder=st.sampled_from(sorted(BUILDERS)), top=st.integers(1, 24), branches=st.integers(1, 3),
       tied=st.booleans())
def test_graft_cuts_are_the_trees_each_budget_grafts(seed, batch, depth, vocab, builder, top, branches, tied):
    """The budget policy's one merge: each cut of the largest tree, grafted, is the tree the round grafts at
    that budget (the builder's own tree at it), node for node, then pads."""
    gen = torch.Generator().manual_seed(seed)
    lp = distribution(gen, (batch, depth, vocab), "levels" if tied else "random")
    roots = torch.randint(0, vocab, (batch,), generator=gen)
    tree = BUILDERS[builder](roots, lp, top)
    paths = random_paths(gen, tree, vocab, branches, depth + 2, tied)
    budgets = sorted({1, top // 2, top} & set(range(1, tree.num_nodes)))
    cuts = graft_cuts(tree, paths, budgets)
    for b in range(batch):
        for i, n in enumerate(budgets):
            got, want = cuts.row(b * len(budgets) + i), graft_paths(BUILDERS[builder](roots, lp, n), paths, n).row(b)
            m = want.num_nodes
            mine = DraftTree(got.tokens[:, :m], got.parents[:, :m], got.depths[:, :m], got.scores[:, :m],
                             got.visibility[:, :m, :m], None if got.sources is None else got.sources[:, :m])
            assert_same_tree(mine, want)
            assert bool((got.parents[:, m:] == -1).all()) and bool((got.scores[:, m:] == float("-inf")).all())


def test_first_path_follows_each_nodes_first_child():
    """From the root through each node's lowest-index child; pads (parent -1) and the root are off it."""
    tree = DraftTree.from_parents(torch.tensor([9, 1, 2, 3, 4, 5, 6]), torch.tensor([-1, 0, 0, 1, 2, 1, 3]))
    assert first_path(tree)[0].tolist() == [False, True, False, True, False, False, True]
    pads = graft_paths(chain(torch.tensor([7]), torch.full((1, 2, 5), -1.0), 2), [[([4], [-9.0])]], 6)
    assert pads.num_nodes == 4 and first_path(pads)[0].tolist() == [False, True, True, False]


def test_a_branch_that_outscores_the_first_path_takes_only_the_other_places():
    """Known by hand: a drafter unsure at every depth and a sure branch (3, 3). Under a chain of 3 at budget 3
    the branch has no room and the chain stays whole. best_first at budget 5 holds the first path 0, 0 and the
    alternatives 1, 2, 3 at depth 1; the branch follows 3 (raised to -0.05) and adds 3 under it (-0.1), and
    the two outrank everything, yet the first path's depth-2 node (-2.12) stays: the branch takes the place
    of the drafter's weakest alternative (2 at depth 1, -1.39, after 1 by id), listed by score."""
    lp = torch.log(torch.tensor([[[0.3, 0.25, 0.25, 0.2], [0.4, 0.3, 0.2, 0.1], [0.5, 0.5, 0.0, 0.0]]]))
    paths = [[([3, 3], [-0.05, -0.1])]]
    tree = chain(torch.tensor([1]), lp, 3)
    assert assert_same_graft(tree, paths, 3).tokens[0].tolist() == tree.tokens[0].tolist() == [1, 0, 0, 0]
    wide = best_first(torch.tensor([1]), lp, 5)
    assert wide.tokens[0].tolist() == [1, 0, 1, 2, 3, 0] and first_path(wide)[0].tolist() == [
        False, True, False, False, False, True]
    grafted = assert_same_graft(wide, paths, 5)
    assert grafted.tokens[0].tolist() == [1, 3, 3, 0, 1, 0]
    assert grafted.parents[0].tolist() == [-1, 0, 1, 0, 0, 3]
    assert grafted.sources[0].tolist() == [0, DRAFTER | LOOKUP, LOOKUP, DRAFTER, DRAFTER, DRAFTER]


def test_a_small_tree_keeps_every_branch_node_and_pads_rows_with_fewer():
    """A chain of 3 under a budget of 10 with one branch of 4 per row: keep = min(10, 3 + 4) = 7 for every row.
    Row 0's branch leaves the chain at once (7 real nodes); row 1's follows the chain for 3 tokens (4 real
    nodes, 3 pads); row 2 has no branch (3 real, 4 pads). Pads copy the root, see only themselves, and the
    walk never accepts one, even where the target's choice equals their token."""
    lp = torch.full((3, 3, 10), -5.0)
    lp[:, torch.arange(3), torch.tensor([1, 2, 3])] = -0.01
    roots = torch.tensor([7, 8, 9])
    tree = chain(roots, lp, 10)
    paths = [[([5, 6, 5, 6], [-0.5, -1.0, -1.5, -2.0])], [([1, 2, 3, 4], [-0.5, -1.0, -1.5, -2.0])], []]
    grafted = assert_same_graft(tree, paths, 10)
    assert grafted.num_nodes == 8
    pads = grafted.parents[:, 1:] < 0
    assert pads.sum(dim=1).tolist() == [0, 3, 4]
    assert bool((grafted.tokens[:, 1:][pads] == roots[:, None].expand(3, 7)[pads]).all())
    assert bool((grafted.depths[:, 1:][pads] == 0).all())
    eye = torch.eye(8, dtype=torch.bool)
    for b in range(3):
        for i in (1 + torch.nonzero(pads[b]).flatten()).tolist():
            assert torch.equal(grafted.visibility[b, i], eye[i])
            assert not bool(grafted.visibility[b, :, i].sum() > 1)  # no other node sees a pad
    # The target's choice everywhere is the root's token: a pad "matches" it, and still only the root is kept.
    choices = roots[:, None].expand(3, 8).clone()
    result = accept_longest_branch(grafted, choices, length=8)
    assert result.num_accepted.tolist() == [1, 1, 1] and result.accepted[:, 0].tolist() == [0, 0, 0]
    # Row 1 follows the chain and its branch's fourth token: 1, 2, 3, 4 accepted, bonus the choice at the last.
    choices = torch.zeros(3, 8, dtype=torch.long)
    table = grafted.child_table(1)
    node = 0
    for tok in (1, 2, 3, 4):
        choices[1, node] = tok
        node = table[node][tok]
    choices[1, node] = 8
    result = accept_longest_branch(grafted, choices, length=8)
    assert result.num_accepted[1] == 5 and result.bonus[1] == 8


def test_the_list_and_tensor_forms_graft_alike():
    gen = torch.Generator().manual_seed(4)
    lp = distribution(gen, (2, 4, 9), "levels")
    tree = best_first(torch.tensor([1, 2]), lp, 8)
    paths = random_paths(gen, tree, 9, 2, 5, tied=True)
    assert_same_tree(graft_paths(tree, paths, 8), graft_paths(tree, Branches.from_lists(paths), 8))
    with pytest.raises(ValueError, match="3 rows, the tree has 2"):
        graft_paths(tree, paths + [[]], 8)
    with pytest.raises(ValueError, match="2 tokens and 1 scores"):
        graft_paths(tree, [[([1, 2], [-1.0])], []], 8)


def test_device_graft_makes_no_host_reads():
    gen = torch.Generator().manual_seed(6)
    lp = distribution(gen, (2, 5, 30), "random")
    tree = best_first(torch.tensor([1, 2]), lp, 16)
    branches = Branches.from_lists(random_paths(gen, tree, 30, 2, 6, tied=False))
    graft_paths(tree, branches, 16)
    with count_host_reads() as reads:
        graft_paths(tree, branches, 16)
    assert reads.count == 0, reads.by_site
    with count_host_reads() as reads:  # the counter sees the reference's reads
        ref.graft_paths(tree, as_lists(branches), 16)
    assert reads.count > 0


def as_lists(branches: Branches):
    out = []
    for b in range(branches.tokens.shape[0]):
        row = []
        for k in range(branches.tokens.shape[1]):
            n = int(branches.lengths[b, k])
            if n:
                row.append((branches.tokens[b, k, :n].tolist(), branches.scores[b, k, :n].tolist()))
        out.append(row)
    return out


# ------------------------------------------------------------------------------------------------------------
# prompt lookup on the device
# ------------------------------------------------------------------------------------------------------------

def lookup_rows(lookup: PromptLookup, rows: list[list[int]], roots: list[int], chunk: int):
    """A lookup context fed ``rows`` (ragged) in chunks of up to ``chunk`` tokens, with host counts."""
    ctx = lookup.new_context(len(rows))
    longest = max(len(r) for r in rows)
    for start in range(0, longest, chunk):
        counts = [max(0, min(chunk, len(r) - start)) for r in rows]
        t = max(counts)
        if t == 0:
            continue
        tokens = torch.zeros(len(rows), t, dtype=torch.long)
        for b, r in enumerate(rows):
            tokens[b, : counts[b]] = torch.tensor(r[start : start + counts[b]], dtype=torch.long)
            tokens[b, counts[b]:] = 99  # stale columns past a row's count must never match
        ctx.append(None, tokens, torch.tensor(counts), host_counts=counts)
    return ctx, torch.tensor(roots)


@settings(max_examples=examples(80), deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), vocab=st.integers(2, 6), block=st.integers(2, 9),
       ngrams=st.sampled_from([(1, 4), (2, 3), (1, 1), (3, 5)]), chunk=st.integers(1, 40))
def test_device_lookup_equals_the_numpy_lookup(seed, batch, vocab, block, ngrams, chunk):
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, vocab, (int(torch.randint(0, 60, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(batch)]
    roots = torch.randint(0, vocab, (batch,), generator=gen).tolist()
    lookup = PromptLookup(vocab + 1, block_size=block, min_ngram=ngrams[0], max_ngram=ngrams[1])
    ctx, root_t = lookup_rows(lookup, rows, roots, chunk)
    cont, found = ctx.continuations(root_t)
    branches = ctx.paths(root_t)
    lp = ctx.propose(root_t).logprobs
    for b, (row, root) in enumerate(zip(rows, roots)):
        want, n = lookup_continuation(np.array(row + [root], dtype=np.int64), block - 1, ngrams[1], ngrams[0])
        assert int(found[b]) == n
        assert int(branches.lengths[b, 0]) == len(want)
        if n:
            assert cont[b].tolist() == want == branches.tokens[b, 0].tolist()
            assert branches.scores[b, 0].tolist() == pytest.approx([lookup.score(n) * (d + 1)
                                                                    for d in range(block - 1)])
            c = lookup.confidence[min(n, len(lookup.confidence)) - 1]
            assert lp[b].argmax(-1).tolist() == want
            assert float(lp[b, 0, want[0]]) == pytest.approx(np.log(c))
            assert lp[b].exp().sum(-1).tolist() == pytest.approx([1.0] * (block - 1), rel=1e-5)
        else:
            assert bool((lp[b] == -float(np.log(vocab + 1))).all())


def test_lookup_rows_dropped_and_buffers_grown_keep_each_rows_text():
    """Rows selected away and a buffer grown past its first capacity (256 columns) leave each kept row's
    continuation what its own text gives."""
    lookup = PromptLookup(50, block_size=5)
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 6, (300,), generator=gen).tolist(), [1, 2, 3, 1, 2], list(range(40)) * 3]
    ctx, roots = lookup_rows(lookup, rows, [4, 3, 0], chunk=64)
    ctx.select_rows(torch.tensor([0, 2]), host_rows=[0, 2])
    cont, found = ctx.continuations(roots[[0, 2]])
    for i, b in enumerate((0, 2)):
        want, n = lookup_continuation(np.array(rows[b] + [int(roots[b])]), 4)
        assert (cont[i].tolist(), int(found[i])) == (want, n)
    assert ctx.tokens is not None and ctx.tokens.shape == (2, 512)


def test_device_lookup_makes_no_host_reads():
    lookup = PromptLookup(50, block_size=6)
    ctx, roots = lookup_rows(lookup, [[1, 2, 3, 1, 2, 3, 1], [4, 4, 5]], [2, 4], chunk=3)
    ctx.paths(roots)
    with count_host_reads() as reads:
        ctx.append(None, torch.tensor([[3, 1], [4, 0]]), torch.tensor([2, 1]), host_counts=[2, 1])
        ctx.paths(roots)
        ctx.propose(roots)
    assert reads.count == 0, reads.by_site
