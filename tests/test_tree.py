"""Tree builders and ``DraftTree`` against slow, obviously-correct references.

The best-first reference is the published DDTree heap loop, written out in plain
Python: top-k per depth (k = min(budget, vocab)), a max-heap over path score,
pop a node, push its next sibling and its first child, depth capped at D. The
heap key is ``(-score, depth, parent_pop_index, rank)``, the tie rule that
``ddtree.core.builders`` documents. Scores are accumulated in float32, ``parent + value``,
exactly as the library adds them, so ties are compared bit for bit.
"""

from __future__ import annotations

import heapq
import itertools
import random
import sys

import numpy as np
import pytest
import torch

from ddtree.core.builders import BUILDERS, beam, best_first, chain, ranked_topk, resolve_builder
from ddtree.core.tree import DraftTree

BUDGETS = [0, 1, 2, 3, 7, 16, 64, 200]


# --------------------------------------------------------------------------- references


def ref_heap(root: int, logprobs: torch.Tensor, budget: int):
    """The published heap construction for one row; ``logprobs`` is ``[D, V]``."""
    depth_limit, vocab = logprobs.shape
    tokens, parents, depths, scores = [root], [-1], [0], [np.float32(0.0)]
    if budget == 0 or depth_limit == 0:
        return tokens, parents, depths, scores
    k = min(budget, vocab)
    vals, toks = ranked_topk(logprobs[None].float(), k)
    vals, toks = vals[0].numpy(), toks[0].tolist()
    heap = [(-vals[0, 0], 1, 0, 0, vals[0, 0])]  # key (-score, depth, parent_pop_index, rank), then score
    while heap and len(tokens) - 1 < budget:
        _, depth, parent, rank, score = heapq.heappop(heap)
        index = len(tokens)
        tokens.append(toks[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        scores.append(score)
        if rank + 1 < k:  # next sibling: same parent, same depth, next rank
            sib = np.float32(scores[parent] + vals[depth - 1, rank + 1])
            heapq.heappush(heap, (-sib, depth, parent, rank + 1, sib))
        if depth < depth_limit:  # first child: next depth, rank 0
            child = np.float32(score + vals[depth, 0])
            heapq.heappush(heap, (-child, depth + 1, index, 0, child))
    return tokens, parents, depths, scores


def ref_beam(root: int, logprobs: torch.Tensor, budget: int, width: int, depth: int | None):
    """Plain beam search over ALL vocab extensions, union of the beams, best ``budget`` kept."""
    depth_limit, vocab = logprobs.shape
    max_depth = depth_limit if depth is None else min(depth, depth_limit)
    if budget == 0 or max_depth == 0:
        return [root], [-1], [0], [np.float32(0.0)]
    vals, toks = ranked_topk(logprobs[None].float(), vocab)  # full ranking: rank r is toks[d][r]
    vals, toks = vals[0].numpy(), toks[0].tolist()
    # A node: (score, depth, level_position, parent_node_or_None, token)
    levels = []
    prev = [(np.float32(0.0), None)]  # (score, node) of the virtual root
    for d in range(max_depth):
        cands = []
        for pi, (pscore, pnode) in enumerate(prev):
            for r in range(vocab):
                s = vals[d, r] if pnode is None else np.float32(pscore + vals[d, r])
                cands.append((-s, pi, r, s, pnode, toks[d][r]))
        cands.sort(key=lambda c: c[:3])
        level = []
        for pos, (_, _, _, s, pnode, tok) in enumerate(cands[:width]):
            level.append({"score": s, "depth": d + 1, "pos": pos, "parent": pnode, "token": tok})
        levels.append(level)
        prev = [(n["score"], n) for n in level]
    nodes = [n for level in levels for n in level]
    nodes.sort(key=lambda n: (-n["score"], n["depth"], n["pos"]))
    chosen = nodes[:budget]
    index = {id(n): i + 1 for i, n in enumerate(chosen)}
    tokens = [root] + [n["token"] for n in chosen]
    parents = [-1] + [0 if n["parent"] is None else index[id(n["parent"])] for n in chosen]
    depths = [0] + [n["depth"] for n in chosen]
    scores = [np.float32(0.0)] + [n["score"] for n in chosen]
    return tokens, parents, depths, scores


def check_against(tree: DraftTree, refs, exact_scores: bool = True):
    assert tree.batch_size == len(refs)
    for row, (toks, pars, deps, scs) in enumerate(refs):
        assert tree.tokens[row].tolist() == toks, f"row {row} tokens"
        assert tree.parents[row].tolist() == pars, f"row {row} parents"
        assert tree.depths[row].tolist() == deps, f"row {row} depths"
        got = tree.scores[row].double().numpy()
        want = np.array(scs, dtype=np.float64)
        if exact_scores:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        idx = torch.arange(tree.num_nodes)
        assert (tree.parents[row, 1:] < idx[1:]).all() and (tree.parents[row, 1:] >= 0).all()


def random_logprobs(rng: torch.Generator, bsz: int, depth: int, vocab: int, scale: float) -> torch.Tensor:
    return (torch.randn(bsz, depth, vocab, generator=rng, dtype=torch.float64) * scale).log_softmax(-1)


def run_best_first(logprobs: torch.Tensor, budget: int, roots: torch.Tensor | None = None):
    bsz = logprobs.shape[0]
    roots = torch.arange(bsz) + 3 if roots is None else roots
    tree = best_first(roots, logprobs, budget)
    check_against(tree, [ref_heap(int(roots[b]), logprobs[b], budget) for b in range(bsz)])
    return tree


# --------------------------------------------------------------------------- best_first


def test_ranked_topk_against_python_sort():
    # Ties straddling the k-th place must go to the lowest token ids (torch.topk
    # alone picks among them arbitrarily).
    rng = torch.Generator().manual_seed(21)
    cases = [torch.zeros(3, 11), torch.full((2, 40), float("-inf"))]
    cases += [-torch.randint(0, 3, (4, v), generator=rng).float() for v in (2, 5, 17, 64, 300)]
    cases += [torch.randn(3, 50, generator=rng).log_softmax(-1)]
    one_hot = torch.full((2, 9), float("-inf"))
    one_hot[:, 4] = 0.0
    cases.append(one_hot)
    for lp in cases:
        for k in range(1, lp.shape[-1] + 1, max(1, lp.shape[-1] // 7)):
            vals, toks = ranked_topk(lp[:, None], k)
            for r in range(lp.shape[0]):
                row = lp[r].tolist()
                want = sorted(range(len(row)), key=lambda t: (-row[t], t))[:k]
                assert toks[r, 0].tolist() == want, (lp[r], k)
                assert vals[r, 0].tolist() == [row[t] for t in want]


def test_ref_heap_on_a_hand_checked_example():
    # Depth 1: p = .6/.3/.1, depth 2: p = .9/.1 (whatever the parent). Budget 4:
    # A(.6), A->x(.54), B(.3), B->x(.27) -- and not A->y(.06) or C(.1).
    lp = torch.tensor([[[0.6, 0.3, 0.1], [0.9, 0.1, 0.0]]]).log()
    toks, pars, deps, _ = ref_heap(7, lp[0], 4)
    assert (toks, pars, deps) == ([7, 0, 0, 1, 0], [-1, 0, 1, 0, 3], [0, 1, 2, 1, 2])
    run_best_first(lp, 4)


@pytest.mark.parametrize("budget", BUDGETS)
def test_best_first_matches_heap_grid(budget):
    rng = torch.Generator().manual_seed(1000 + budget)
    for depth in (1, 2, 3, 5, 8, 15):
        for vocab in (2, 3, 5, 17):
            run_best_first(random_logprobs(rng, 2, depth, vocab, 2.0), budget)


def test_best_first_matches_heap_random():
    rng = torch.Generator().manual_seed(0)
    pyrng = random.Random(0)
    vocabs = [2, 3, 4, 7, 10, 31, 100, 257, 1000]
    for _ in range(150):
        budget = pyrng.choice(BUDGETS)
        depth = pyrng.randint(1, 15)
        vocab = pyrng.choice(vocabs)
        bsz = pyrng.randint(1, 3)
        scale = pyrng.choice([0.3, 1.0, 3.0, 8.0])
        run_best_first(random_logprobs(rng, bsz, depth, vocab, scale), budget)


def test_best_first_budget_beyond_vocab_and_depth():
    rng = torch.Generator().manual_seed(5)
    # vocab 2, depth 3: at most 2 + 4 + 8 = 14 nodes exist, whatever the budget.
    lp = random_logprobs(rng, 2, 3, 2, 1.0)
    tree = run_best_first(lp, 200)
    assert tree.budget == 14
    assert sorted(tree.depths[0].tolist()) == [0] + [1] * 2 + [2] * 4 + [3] * 8
    # Depth 1: at most vocab nodes.
    tree = run_best_first(random_logprobs(rng, 1, 1, 5, 1.0), 64)
    assert tree.budget == 5 and tree.max_depth == 1
    assert sorted(tree.tokens[0, 1:].tolist()) == [0, 1, 2, 3, 4]
    # Depth 0 (no drafted positions): root only.
    tree = best_first(torch.tensor([4]), torch.zeros(1, 0, 9), 16)
    assert tree.tokens.tolist() == [[4]] and tree.parents.tolist() == [[-1]]


def test_best_first_budget_zero_is_root_only():
    tree = best_first(torch.tensor([5, 6]), torch.randn(2, 4, 11).log_softmax(-1), 0)
    assert tree.tokens.tolist() == [[5], [6]]
    assert tree.parents.tolist() == [[-1], [-1]] and tree.depths.tolist() == [[0], [0]]


def test_best_first_equal_logits():
    # Uniform drafts: every path at one depth ties, so only the tie rule orders them.
    for depth, vocab, budget in [(4, 3, 16), (3, 5, 7), (6, 2, 64), (2, 50, 200), (15, 4, 200), (3, 9, 2), (5, 30, 7)]:
        lp = torch.zeros(2, depth, vocab).log_softmax(-1)
        tree = run_best_first(lp, budget)
        # Ties at one depth go to the lowest token id first.
        assert tree.tokens[0, 1] == 0


def test_best_first_one_hot_and_minus_inf():
    # One-hot drafts: log-prob 0 for one token, -inf for the rest.
    for depth, vocab, budget in [(5, 4, 3), (5, 4, 5), (5, 4, 12), (3, 6, 200), (8, 2, 16)]:
        logits = torch.full((2, depth, vocab), float("-inf"))
        hot = torch.randint(0, vocab, (2, depth), generator=torch.Generator().manual_seed(depth))
        logits.scatter_(-1, hot[..., None], 0.0)
        tree = run_best_first(logits.log_softmax(-1), budget)
        # The chain of hot tokens comes first (score 0), shallow before deep.
        n = min(budget, depth)
        assert tree.tokens[0, 1 : n + 1].tolist() == hot[0, :n].tolist()
        assert tree.depths[0, 1 : n + 1].tolist() == list(range(1, n + 1))
    # Some -inf entries mixed with finite ones.
    rng = torch.Generator().manual_seed(9)
    for trial in range(24):
        logits = torch.randn(2, 6, 7, generator=rng)
        logits[torch.rand(2, 6, 7, generator=rng) < 0.5] = float("-inf")
        logits[..., 3] = 0.0  # keep every row finite somewhere
        run_best_first(logits.log_softmax(-1), BUDGETS[trial % len(BUDGETS)])


def test_best_first_integer_scores_tie_across_depths():
    # Non-positive integer log-scores: path sums are exact, so nodes at different
    # depths and under different parents tie all the time (including zeros).
    rng = torch.Generator().manual_seed(3)
    for trial in range(60):
        depth = 1 + trial % 7
        vocab = 2 + trial % 5
        lp = -torch.randint(0, 3, (2, depth, vocab), generator=rng).float()
        run_best_first(lp, BUDGETS[trial % len(BUDGETS)])


def test_best_first_quantised_logits():
    rng = torch.Generator().manual_seed(4)
    for trial in range(40):
        lp = (torch.randn(1, 6, 9, generator=rng) * 2).round().log_softmax(-1)
        run_best_first(lp, BUDGETS[trial % len(BUDGETS)])


def test_best_first_batch_rows_are_independent():
    rng = torch.Generator().manual_seed(11)
    lp = random_logprobs(rng, 4, 6, 13, 2.0)
    roots = torch.tensor([1, 2, 3, 4])
    batched = best_first(roots, lp, 16)
    for b in range(4):
        single = best_first(roots[b : b + 1], lp[b : b + 1], 16)
        assert torch.equal(single.tokens[0], batched.tokens[b])
        assert torch.equal(single.parents[0], batched.parents[b])


def test_best_first_is_the_top_budget_set():
    # Independent of the heap: brute-force all paths and check the chosen nodes
    # are exactly the budget highest-scoring ones (scores distinct here).
    rng = torch.Generator().manual_seed(2)
    depth, vocab, budget = 3, 4, 9
    lp = random_logprobs(rng, 1, depth, vocab, 1.5).float()
    paths = {}
    for d in range(1, depth + 1):
        for toks in itertools.product(range(vocab), repeat=d):
            paths[toks] = sum(float(lp[0, i, t]) for i, t in enumerate(toks))
    best = sorted(paths, key=paths.get, reverse=True)[:budget]
    tree = best_first(torch.tensor([0]), lp, budget)
    toks, pars = tree.tokens[0].tolist(), tree.parents[0].tolist()

    def path(i):
        return () if i == 0 else path(pars[i]) + (toks[i],)

    assert sorted(path(i) for i in range(1, tree.num_nodes)) == sorted(best)


# --------------------------------------------------------------------------- chain and beam


def test_chain_is_argmax_per_depth():
    rng = torch.Generator().manual_seed(6)
    for depth, vocab, budget in [(4, 7, 16), (6, 3, 2), (5, 11, 5), (3, 5, 0), (8, 2, 8)]:
        lp = random_logprobs(rng, 2, depth, vocab, 2.0)
        lp[1, 0, :] = lp[1, 0, 0]  # ties: lowest id wins
        tree = chain(torch.tensor([9, 8]), lp, budget)
        n = min(budget, depth)
        assert tree.num_nodes == n + 1
        assert tree.parents[0].tolist() == list(range(-1, n))
        assert tree.depths[0].tolist() == list(range(n + 1))
        for b in range(2):
            want = [int(lp[b, d].argmax()) for d in range(n)]
            assert tree.tokens[b].tolist() == [[9, 8][b]] + want
            want_scores = np.cumsum([0.0] + [float(lp[b, d].max()) for d in range(n)])
            np.testing.assert_allclose(tree.scores[b].double().numpy(), want_scores, rtol=1e-5, atol=1e-5)
        if n:
            assert tree.tokens[1, 1] == 0


@pytest.mark.parametrize("width,depth", [(1, 1), (1, 4), (2, 3), (3, None), (4, 2), (5, 8)])
def test_beam_matches_reference(width, depth):
    rng = torch.Generator().manual_seed(100 + width)
    builder = beam(width, depth)
    for trial in range(12):
        d, v = 1 + trial % 6, [2, 3, 5, 9][trial % 4]
        budget = [0, 1, 3, 7, 16, 200][trial % 6]
        if trial % 3 == 0:
            lp = -torch.randint(0, 3, (2, d, v), generator=rng).float()  # heavy ties
        else:
            lp = random_logprobs(rng, 2, d, v, 2.0)
        tree = builder(torch.tensor([1, 2]), lp, budget)
        check_against(tree, [ref_beam(b + 1, lp[b], budget, width, depth) for b in range(2)])
        assert tree.budget <= width * (d if depth is None else min(depth, d))


def test_beam_width_one_is_chain():
    lp = random_logprobs(torch.Generator().manual_seed(8), 1, 6, 10, 2.0)
    a, b = beam(1, None)(torch.tensor([0]), lp, 64), chain(torch.tensor([0]), lp, 64)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


@pytest.mark.parametrize("builder", [best_first, chain, beam(2, 3)])
def test_budget_caps_node_count(builder):
    lp = random_logprobs(torch.Generator().manual_seed(7), 1, 8, 20, 1.0)
    for budget in (0, 1, 2, 3, 5):
        assert builder(torch.tensor([0]), lp, budget).num_nodes == budget + 1


def test_beam_rejects_bad_shape():
    with pytest.raises(ValueError, match="width"):
        beam(0, 3)
    with pytest.raises(ValueError, match="depth"):
        beam(2, 0)


# --------------------------------------------------------------------------- resolve_builder


def test_resolve_builder_names():
    assert resolve_builder("best_first") is best_first
    assert resolve_builder("chain") is chain
    assert BUILDERS["best_first"] is best_first
    assert resolve_builder("ddtree.core.builders:chain") is chain

    def mine(root_tokens, logprobs, budget):
        return chain(root_tokens, logprobs, budget)

    assert resolve_builder(mine) is mine
    lp = random_logprobs(torch.Generator().manual_seed(1), 1, 5, 6, 2.0)
    got = resolve_builder("beam@2x3")(torch.tensor([0]), lp, 64)
    want = beam(2, 3)(torch.tensor([0]), lp, 64)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
    assert got.max_depth == 3 and got.budget == 6


@pytest.mark.parametrize(
    "name,match",
    [
        ("nope", "unknown tree builder"),
        ("beam@2", "beam@4x8"),
        ("beam@axb", "beam@4x8"),
        ("beam@0x3", "beam@4x8"),
        ("beam@2x3x4", "beam@4x8"),
        ("ddtree.core.builders:no_such_builder", "does not name a callable"),
        ("ddtree.core.builders:BUILDERS", "does not name a callable"),
        ("no_such_module_xyz:build", "no_such_module_xyz"),
    ],
)
def test_resolve_builder_bad_names(name, match):
    with pytest.raises(ValueError, match=match):
        resolve_builder(name)


def test_resolve_builder_bad_type():
    with pytest.raises(TypeError, match="name or a callable"):
        resolve_builder(3)


@pytest.mark.parametrize("builder", [best_first, chain, beam(2, 2)])
def test_builders_reject_bad_inputs(builder):
    lp = torch.zeros(1, 3, 5).log_softmax(-1)
    with pytest.raises(ValueError, match="budget"):
        builder(torch.tensor([0]), lp, -1)
    with pytest.raises(ValueError, match=r"\[batch, depth, vocab\]"):
        builder(torch.tensor([0]), lp[0], 4)
    with pytest.raises(ValueError, match="root tokens"):
        builder(torch.tensor([0, 1]), lp, 4)


# --------------------------------------------------------------------------- DraftTree


def slow_depths_visibility(parents: list[int]):
    n = len(parents)
    depths, vis = [], [[False] * n for _ in range(n)]
    for i in range(n):
        j, d = i, 0
        while j != -1:
            vis[i][j] = True
            j = parents[j]
            d += 1
        depths.append(d - 1)
    return depths, vis


def random_parents(pyrng: random.Random, n: int) -> list[int]:
    return [-1] + [pyrng.randrange(0, i) for i in range(1, n)]


def test_from_parents_depths_and_visibility():
    pyrng = random.Random(0)
    for n in (1, 2, 3, 8, 30, 65):
        rows = [random_parents(pyrng, n) for _ in range(3)]
        rows.append(list(range(-1, n - 1)))  # a chain: deepest possible
        tokens = torch.randint(0, 50, (len(rows), n))
        tree = DraftTree.from_parents(tokens, torch.tensor(rows))
        for b, pars in enumerate(rows):
            depths, vis = slow_depths_visibility(pars)
            assert tree.depths[b].tolist() == depths
            assert tree.visibility[b].tolist() == vis
        assert tree.scores.shape == (len(rows), n) and not tree.scores.any()
        assert tree.max_depth == n - 1 and tree.budget == n - 1


def test_from_parents_one_dimensional_and_scores():
    tree = DraftTree.from_parents(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0]), torch.tensor([0.0, -1.0, -2.0]))
    assert tree.tokens.shape == (1, 3) and tree.scores.tolist() == [[0.0, -1.0, -2.0]]
    assert tree.depths.tolist() == [[0, 1, 1]]


@pytest.mark.parametrize(
    "tokens,parents,match",
    [
        ([1, 2, 3], [-1, 0], "differ in shape"),
        ([1, 2, 3], [0, 0, 1], "parents must be -1 for the root"),
        ([1, 2, 3], [-1, 0, 2], "earlier node"),  # self loop
        ([1, 2, 3], [-1, 2, 0], "earlier node"),  # forward pointer
        ([1, 2, 3], [-1, 0, -1], "earlier node"),  # a second root
        ([1, 2, 3], [-1, -5, 0], "earlier node"),
        ([], [], "at least the root"),
    ],
)
def test_from_parents_validation(tokens, parents, match):
    with pytest.raises(ValueError, match=match):
        DraftTree.from_parents(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def test_children_and_child_table():
    #        0
    #      / | \
    #     1  2  5
    #    / \     \
    #   3   4     6
    parents = [-1, 0, 0, 1, 1, 0, 5]
    tokens = [9, 10, 11, 12, 13, 14, 15]
    tree = DraftTree.from_parents(torch.tensor([tokens, tokens]), torch.tensor([parents, [-1, 0, 1, 2, 3, 4, 5]]))
    assert tree.children(0) == [1, 2, 5]
    assert tree.children(1) == [3, 4]
    assert tree.children(5) == [6]
    assert tree.children(3) == []
    assert tree.children(0, row=1) == [1]
    assert tree.child_table() == {0: {10: 1, 11: 2, 14: 5}, 1: {12: 3, 13: 4}, 5: {15: 6}}
    assert tree.child_table(row=1) == {i: {tokens[i + 1]: i + 1} for i in range(6)}


def test_to_networkx():
    nx = pytest.importorskip("networkx")
    lp = random_logprobs(torch.Generator().manual_seed(12), 1, 5, 8, 2.0)
    tree = best_first(torch.tensor([3]), lp, 20)
    g = tree.to_networkx()
    assert nx.is_arborescence(g)
    assert set(g.edges) == {(p, i) for i, p in enumerate(tree.parents[0].tolist()) if p >= 0}
    assert sorted(g.nodes) == list(range(tree.num_nodes))
    for i in range(tree.num_nodes):
        assert g.nodes[i]["token"] == int(tree.tokens[0, i])
        assert g.nodes[i]["depth"] == int(tree.depths[0, i]) == nx.shortest_path_length(g, 0, i)
        assert g.nodes[i]["score"] == pytest.approx(float(tree.scores[0, i]))


def test_to_networkx_without_networkx_names_the_extra(monkeypatch):
    """networkx is optional: without it the method says how to install it, and the rest of the tree works."""
    import builtins

    real_import = builtins.__import__

    def no_networkx(name, *args, **kwargs):
        if name == "networkx" or name.startswith("networkx."):
            raise ModuleNotFoundError("No module named 'networkx'", name="networkx")
        return real_import(name, *args, **kwargs)

    monkeypatch.setitem(sys.modules, "networkx", None)
    monkeypatch.setattr(builtins, "__import__", no_networkx)
    tree = DraftTree.from_parents(torch.tensor([[5, 6, 7]]), torch.tensor([[-1, 0, 0]]))
    with pytest.raises(ImportError, match=r"pip install 'ddtree\[graph\]'"):
        tree.to_networkx()
    assert tree.children(0) == [1, 2]
    assert tree.to_dict()["parents"] == [-1, 0, 0]


def test_to_dict_round_trip():
    import json

    lp = random_logprobs(torch.Generator().manual_seed(13), 2, 6, 9, 2.0)
    tree = best_first(torch.tensor([3, 4]), lp, 25)
    for row in range(2):
        data = json.loads(json.dumps(tree.to_dict(row)))
        back = DraftTree.from_dict(data)
        assert torch.equal(back.tokens[0], tree.tokens[row])
        assert torch.equal(back.parents[0], tree.parents[row])
        assert torch.equal(back.depths[0], tree.depths[row])
        assert torch.equal(back.visibility[0], tree.visibility[row])
        assert torch.equal(back.scores[0], tree.scores[row])
    # Without scores: zeros.
    back = DraftTree.from_dict({"tokens": [1, 2], "parents": [-1, 0]})
    assert back.scores.tolist() == [[0.0, 0.0]] and back.depths.tolist() == [[0, 1]]
