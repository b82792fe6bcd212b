"""Tree attention masks and position ids against slow per-element references."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree.core.masks import tree_attention_mask, tree_position_ids
from ddtree.core.tree import DraftTree


def random_tree(pyrng: random.Random, bsz: int, n: int) -> tuple[DraftTree, list[list[int]]]:
    rows = [[-1] + [pyrng.randrange(0, i) for i in range(1, n)] for _ in range(bsz)]
    tokens = torch.tensor([[pyrng.randrange(100) for _ in range(n)] for _ in range(bsz)])
    return DraftTree.from_parents(tokens, torch.tensor(rows)), rows


def is_ancestor_or_self(parents: list[int], i: int, j: int) -> bool:
    while i != -1:
        if i == j:
            return True
        i = parents[i]
    return False


def depth_of(parents: list[int], i: int) -> int:
    d = 0
    while parents[i] != -1:
        i, d = parents[i], d + 1
    return d


def slow_mask(rows, prefix_len, dtype, window=None):
    bsz, n = len(rows), len(rows[0])
    hidden = torch.finfo(dtype).min
    out = torch.empty(bsz, 1, n, prefix_len + n, dtype=dtype)
    for b, parents in enumerate(rows):
        for i in range(n):
            q_pos = prefix_len + depth_of(parents, i)
            for key in range(prefix_len + n):
                if key < prefix_len:
                    visible, k_pos = True, key
                else:
                    j = key - prefix_len
                    visible, k_pos = is_ancestor_or_self(parents, i, j), prefix_len + depth_of(parents, j)
                if window is not None and not k_pos > q_pos - window:
                    visible = False
                out[b, 0, i, key] = 0.0 if visible else hidden
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_tree_mask_matches_slow_reference(dtype):
    pyrng = random.Random(str(dtype))
    for prefix_len, n, bsz in [(0, 1, 1), (0, 6, 2), (5, 1, 1), (7, 9, 3), (3, 17, 2)]:
        tree, rows = random_tree(pyrng, bsz, n)
        mask = tree_attention_mask(tree.visibility, prefix_len, dtype=dtype)
        assert mask.shape == (bsz, 1, n, prefix_len + n)
        assert mask.dtype == dtype
        assert torch.equal(mask, slow_mask(rows, prefix_len, dtype))


def test_tree_mask_default_dtype_and_values():
    tree = DraftTree.from_parents(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 0]))
    mask = tree_attention_mask(tree.visibility, 2)
    assert mask.dtype == torch.float32
    m = torch.finfo(torch.float32).min
    # Siblings 1 and 2 do not see each other; both see the root and the prefix.
    assert mask[0, 0].tolist() == [[0, 0, 0, m, m], [0, 0, 0, 0, m], [0, 0, 0, m, 0]]


def test_tree_mask_is_additive_not_bool():
    tree, _ = random_tree(random.Random(1), 1, 5)
    mask = tree_attention_mask(tree.visibility, 3)
    assert mask.is_floating_point()
    # Softmax over (scores + mask) puts zero weight on hidden keys.
    probs = (torch.randn(mask.shape) + mask).softmax(-1)
    assert torch.all(probs[mask < 0] == 0)


@pytest.mark.parametrize("window", [1, 2, 3, 4, 6, 50])
def test_sliding_window_tree_mask_matches_slow_reference(window):
    pyrng = random.Random(window)
    for prefix_len, n, bsz in [(0, 5, 1), (4, 8, 2), (9, 12, 2), (2, 1, 1)]:
        tree, rows = random_tree(pyrng, bsz, n)
        for dtype in (torch.float32, torch.float64):
            mask = tree_attention_mask(tree.visibility, prefix_len, dtype=dtype, sliding_window=window,
                                       depths=tree.depths)
            assert mask.shape == (bsz, 1, n, prefix_len + n)
            assert torch.equal(mask, slow_mask(rows, prefix_len, dtype, window))


def test_sliding_window_edge_positions():
    # A chain of 4 after a prefix of 6: node i (depth i) is at position 6 + i.
    tree = DraftTree.from_parents(torch.arange(4), torch.tensor([-1, 0, 1, 2]))
    mask = tree_attention_mask(tree.visibility, 6, sliding_window=3, depths=tree.depths)
    visible = (mask[0, 0] == 0).int().tolist()
    # Keys at positions > p - 3: the root (p=6) sees prefix 4, 5 and itself.
    assert visible[0] == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert visible[3] == [0] * 6 + [0, 1, 1, 1]
    # A window wider than everything changes nothing.
    wide = tree_attention_mask(tree.visibility, 6, sliding_window=100, depths=tree.depths)
    assert torch.equal(wide, tree_attention_mask(tree.visibility, 6))


def test_tree_mask_errors():
    tree = DraftTree.from_parents(torch.tensor([1, 2]), torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="depths"):
        tree_attention_mask(tree.visibility, 3, sliding_window=2)
    with pytest.raises(ValueError, match=r"\[B, N, N\]"):
        tree_attention_mask(tree.visibility[0], 3)
    with pytest.raises(ValueError, match=r"\[B, N, N\]"):
        tree_attention_mask(torch.ones(1, 2, 3, dtype=torch.bool), 3)


def test_tree_position_ids():
    pyrng = random.Random(4)
    tree, rows = random_tree(pyrng, 3, 10)
    want = [[12 + depth_of(r, i) for i in range(10)] for r in rows]
    assert tree_position_ids(tree.depths, 12).tolist() == want
    starts = torch.tensor([0, 5, 12])
    got = tree_position_ids(tree.depths, starts)
    assert got.tolist() == [[int(s) + depth_of(r, i) for i in range(10)] for s, r in zip(starts, rows)]
    assert got.dtype == torch.long
