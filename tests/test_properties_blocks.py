"""Property-based tests of the building blocks on random inputs: DraftTree, the builders, the tree attention
mask, longest-branch verification and cache compaction, each against a from-scratch reference.

Example counts: ``examples(n)`` in CI (derandomized), 20x with ``--slow`` (see docs/reliability.md).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import examples
from transformers import DynamicCache

from ddtree.bench.tree_build import heap_best_first, same_tree
from ddtree.blocks import (
    DraftTree,
    SamplingConfig,
    accept_longest_branch,
    beam,
    best_first,
    chain,
    commit_accepted,
    tree_attention_mask,
    verify_tree,
)


@st.composite
def parent_arrays(draw, max_nodes: int = 130):
    """A valid parent array: root -1, every other node's parent an earlier node (biased to recent ones, so
    both deep chains and wide fans occur)."""
    n = draw(st.integers(1, max_nodes))
    style = draw(st.sampled_from(["any", "recent", "fan"]))
    parents = [-1]
    for i in range(1, n):
        if style == "recent":
            parents.append(draw(st.integers(max(0, i - 3), i - 1)))
        elif style == "fan":
            parents.append(draw(st.integers(0, min(i - 1, 2))))
        else:
            parents.append(draw(st.integers(0, i - 1)))
    return parents


def naive_ancestry(parents: list[int]) -> tuple[list[int], list[set[int]]]:
    depths, anc = [], []
    for i, p in enumerate(parents):
        depths.append(0 if p < 0 else depths[p] + 1)
        anc.append({i} | (anc[p] if p >= 0 else set()))
    return depths, anc


@settings(max_examples=examples(150))
@given(parents=parent_arrays(), data=st.data())
def test_draft_tree_from_random_parents(parents, data):
    n = len(parents)
    tokens = data.draw(st.lists(st.integers(0, 96), min_size=n, max_size=n))
    tree = DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents))
    depths, anc = naive_ancestry(parents)
    assert tree.num_nodes == n and tree.budget == n - 1
    assert tree.depths[0].tolist() == depths and tree.max_depth == max(depths)
    vis = tree.visibility[0]
    assert all(vis[i, j].item() == (j in anc[i]) for i in range(n) for j in range(n))
    for node in range(n):
        assert tree.children(node) == [c for c in range(n) if parents[c] == node]
    again = DraftTree.from_dict(tree.to_dict())
    assert torch.equal(again.parents, tree.parents) and torch.equal(again.visibility, tree.visibility)
    g = tree.to_networkx()
    assert g.number_of_edges() == n - 1 and all(g.nodes[i]["depth"] == depths[i] for i in range(n))


@settings(max_examples=examples(120))
@given(parents=parent_arrays(), prefix=st.integers(0, 40), window=st.none() | st.integers(1, 12),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_tree_attention_mask_from_random_parents(parents, prefix, window, dtype):
    n = len(parents)
    tree = DraftTree.from_parents(torch.zeros(n, dtype=torch.long), torch.tensor(parents))
    mask = tree_attention_mask(tree.visibility, prefix, dtype, sliding_window=window, depths=tree.depths)
    assert mask.shape == (1, 1, n, prefix + n) and mask.dtype == dtype
    depths, anc = naive_ancestry(parents)
    key_pos = list(range(prefix)) + [prefix + d for d in depths]
    for i in range(n):
        for j in range(prefix + n):
            seen = j < prefix or (j - prefix) in anc[i]
            if window is not None:
                seen = seen and (prefix + depths[i]) - key_pos[j] < window
            assert mask[0, 0, i, j].item() == (0.0 if seen else torch.finfo(dtype).min), (i, j)


def naive_walk(tokens: list[int], parents: list[int], choices: list[int]) -> tuple[int, int]:
    """(deepest accepted depth, bonus) by following, from the root, any child equal to the node's choice."""
    depths, _ = naive_ancestry(parents)
    ok = [True] + [False] * (len(tokens) - 1)
    best = 0
    for i in range(1, len(tokens)):
        ok[i] = ok[parents[i]] and tokens[i] == choices[parents[i]]
        if ok[i] and depths[i] > depths[best]:
            best = i
    return depths[best], choices[best]


@settings(max_examples=examples(150))
@given(parents=parent_arrays(), rows=st.integers(1, 3), alphabet=st.integers(1, 6), data=st.data())
def test_accept_longest_branch_on_random_trees(parents, rows, alphabet, data):
    """Small alphabets force matches, deep acceptance and duplicate siblings."""
    n = len(parents)
    draw_row = st.lists(st.integers(0, alphabet - 1), min_size=n, max_size=n)
    tokens = [data.draw(draw_row) for _ in range(rows)]
    choices = [data.draw(draw_row) for _ in range(rows)]
    tree = DraftTree.from_parents(torch.tensor(tokens), torch.tensor([parents] * rows))
    res = accept_longest_branch(tree, torch.tensor(choices))
    for b in range(rows):
        depth, _ = naive_walk(tokens[b], parents, choices[b])
        path = [i for i in res.accepted[b].tolist() if i >= 0]
        assert int(res.num_accepted[b]) == len(path) == depth + 1
        assert path[0] == 0 and all(parents[c] == p for p, c in zip(path, path[1:]))
        assert all(tokens[b][c] == choices[b][p] for p, c in zip(path, path[1:]))
        assert int(res.bonus[b]) == choices[b][path[-1]]
        # Logits whose argmax is the choice give the same verdict through verify_tree (greedy).
        logits = torch.nn.functional.one_hot(torch.tensor(choices), 7).double() * 3 + torch.rand(rows, n, 7) * 0.1
        again = verify_tree(tree, logits, SamplingConfig())
        assert torch.equal(again.accepted, res.accepted) and torch.equal(again.bonus, res.bonus)


@settings(max_examples=examples(200))
@given(parents=parent_arrays(max_nodes=40), prefix=st.integers(0, 30), layers=st.integers(1, 3),
       alphabet=st.integers(1, 4), data=st.data())
def test_commit_accepted_keeps_prefix_and_path(parents, prefix, layers, alphabet, data):
    n = len(parents)
    tokens = data.draw(st.lists(st.integers(0, alphabet - 1), min_size=n, max_size=n))
    choices = data.draw(st.lists(st.integers(0, alphabet - 1), min_size=n, max_size=n))
    tree = DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents))
    path = accept_longest_branch(tree, torch.tensor([choices])).accepted
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    cache, full = DynamicCache(), []
    for layer in range(layers):
        k, v = torch.randn(1, 2, prefix + n, 8, generator=g), torch.randn(1, 2, prefix + n, 8, generator=g)
        cache.update(k, v, layer)
        full.append((k, v))
    commit_accepted(cache, prefix, path)
    keep = list(range(prefix)) + [prefix + i for i in path[0].tolist()]
    assert cache.get_seq_length() == len(keep)
    for layer, (k, v) in enumerate(full):
        assert (torch.equal(cache.layers[layer].keys, k[:, :, keep])
                and torch.equal(cache.layers[layer].values, v[:, :, keep]))


@st.composite
def drafter_logprobs(draw):
    """Log-probs ``[1, D, V]`` in float32, float64 or a 16-bit float, contiguous or a strided view (transposed,
    or every other token of a wider row): a builder takes any of them."""
    depth, vocab = draw(st.integers(1, 8)), draw(st.integers(2, 60))
    seed, scale = draw(st.integers(0, 2**31)), draw(st.sampled_from([0.5, 2.0, 8.0]))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, depth, vocab, generator=g) * scale
    if draw(st.booleans()):
        logits = (logits * 2).round() / 2  # exact ties
    lp = logits.log_softmax(-1).to(draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16,
                                                         torch.float16])))
    layout = draw(st.sampled_from(["contiguous", "transposed", "stepped"]))
    if layout == "transposed":
        return lp.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "stepped":
        return torch.stack([lp, lp], dim=-1)[..., 0]
    return lp


@settings(max_examples=examples(300))
@given(lp=drafter_logprobs(), budget=st.integers(0, 128), root=st.integers(0, 96),
       width=st.integers(1, 4), beam_depth=st.integers(1, 6))
def test_builders_give_valid_trees(lp, budget, root, width, beam_depth):
    depth, vocab = lp.shape[1:]
    root_t = torch.tensor([root])
    trees = {"best_first": best_first(root_t, lp, budget), "chain": chain(root_t, lp, budget),
             "beam": beam(width, beam_depth)(root_t, lp, budget)}
    for name, tree in trees.items():
        parents = tree.parents[0].tolist()
        assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
        assert int(tree.tokens[0, 0]) == root and tree.budget <= budget
        assert tree.max_depth <= depth
        toks = tree.tokens[0].tolist()
        for i in range(1, tree.num_nodes):
            assert lp[0, tree.depths[0, i] - 1, toks[i]] > float("-inf")
        sibling_tokens = {}
        for i, p in enumerate(parents[1:], start=1):
            assert toks[i] not in sibling_tokens.setdefault(p, set()), f"{name}: duplicate sibling"
            sibling_tokens[p].add(toks[i])
        DraftTree.from_parents(tree.tokens, tree.parents)  # the tree's own depths/visibility are consistent
        again = DraftTree.from_parents(tree.tokens, tree.parents)
        assert torch.equal(again.depths, tree.depths) and torch.equal(again.visibility, tree.visibility)
    # best_first is exactly the published heap construction; it fills its budget when the tree can hold it.
    assert same_tree(trees["best_first"], heap_best_first(root_t, lp, budget))
    possible = sum(vocab ** d for d in range(1, depth + 1))
    assert trees["best_first"].budget == min(budget, possible)
    assert trees["chain"].budget == min(budget, depth)
    assert trees["chain"].tokens[0, 1:].tolist() == [
        int(lp[0, d].max(-1).values.eq(lp[0, d]).nonzero()[0]) for d in range(min(budget, depth))]
    assert trees["beam"].budget <= min(budget, width * beam_depth)
