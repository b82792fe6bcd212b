"""The device tree builders against the numpy reference builders, node for node (tokens, parents, depths,
visibility, scores and their order, dtypes), on random and on adversarial, tied distributions; and the
structural fact that a device build reads nothing back to the host.

Example counts: ``examples(n)`` in CI (derandomized), 20x with ``--slow`` (see docs/reliability.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import examples

from ddtree.core import builders
from ddtree.core import reference_builders as ref
from ddtree.core.builders import beam, best_first, chain, ranked_topk, resolve_builder, top_stable
from ddtree.core.pairwise import PairwiseScores, best_first_pairwise, chain_pairwise
from ddtree.core.tree import DraftTree
from ddtree.runtime.host_reads import count_host_reads

# (device builder, its numpy reference): every plain builder shape the library ships.
BEAMS = [(1, 1), (1, None), (2, 3), (3, 8), (4, None)]
PAIRS = [(best_first, ref.best_first), (chain, ref.chain)] + [(beam(w, d), ref.beam(w, d)) for w, d in BEAMS]
PAIRWISE = [(best_first_pairwise, ref.best_first_pairwise), (chain_pairwise, ref.chain_pairwise)]
FIELDS = ("tokens", "parents", "depths", "scores", "visibility")


def assert_same_tree(got: DraftTree, want: DraftTree) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device, (name, a.shape, b.shape)
        assert torch.equal(a, b), f"{name} differs:\n{a}\n{b}"


def check_all(root: torch.Tensor, logprobs: torch.Tensor, budgets) -> None:
    for budget in budgets:
        for device_builder, numpy_builder in PAIRS:
            assert_same_tree(device_builder(root, logprobs, budget), numpy_builder(root, logprobs, budget))


def distribution(gen: torch.Generator, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    """Log-probs of one kind: ``random``, ``levels`` (few distinct values: ties within and across depths),
    ``uniform``, ``sparse`` (most entries -inf), ``integer`` (path scores tie across depths)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if kind == "levels":
        x = (x * 1.5).round() / 2
    elif kind == "uniform":
        x = torch.zeros(shape, dtype=torch.float64)
    elif kind == "integer":
        return -torch.randint(0, 3, shape, generator=gen).float()
    lp = x.log_softmax(-1)
    if kind == "sparse":
        keep = torch.rand(shape, generator=gen) < 0.25
        keep[..., 0] = True
        lp = lp.masked_fill(~keep, float("-inf"))
    return lp.float()


KINDS = ["random", "levels", "uniform", "sparse", "integer"]


@settings(max_examples=examples(120), deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), depth=st.integers(0, 6), vocab=st.integers(1, 40),
       kind=st.sampled_from(KINDS), budgets=st.lists(st.integers(0, 90), min_size=1, max_size=3))
def test_device_builders_equal_the_numpy_builders(seed, batch, depth, vocab, kind, budgets):
    gen = torch.Generator().manual_seed(seed)
    lp = distribution(gen, (batch, depth, vocab), kind)
    check_all(torch.randint(0, vocab, (batch,), generator=gen), lp, budgets)


def test_rows_of_different_kinds_in_one_batch():
    """Each row gets its own tree: a uniform row, a peaked one, a sparse one and a tied-integer one together."""
    gen = torch.Generator().manual_seed(1)
    lp = torch.cat([distribution(gen, (1, 5, 30), kind) for kind in ("uniform", "random", "sparse", "integer")])
    check_all(torch.tensor([3, 1, 4, 1]), lp, [0, 1, 5, 16, 64, 200])
    # Rows really differ, so a builder mixing them up would fail above.
    tree = best_first(torch.tensor([3, 1, 4, 1]), lp, 16)
    assert not torch.equal(tree.tokens[0], tree.tokens[1])


def test_all_tied_picks_lowest_ids_then_shallow_first():
    """Every log-prob equal at every depth: the tree by the tie rule is known without a reference."""
    lp = torch.full((1, 3, 10), -float(np.log(10)))
    check_all(torch.tensor([7]), lp, [4, 12, 40])
    tree = best_first(torch.tensor([7]), lp, 4)
    # Depth 1 ranks tokens 0..9 alike and depth-1 scores beat deeper ones: the four lowest ids, all at depth 1.
    assert tree.tokens.tolist() == [[7, 0, 1, 2, 3]] and tree.parents.tolist() == [[-1, 0, 0, 0, 0]]


def test_equal_path_scores_across_depths():
    """Log-probs 0 and -1 only: a depth-2 node of score -1 ties depth-1 nodes of score -1; depth wins."""
    lp = torch.tensor([[[0.0, -1.0, -1.0, -5.0], [-1.0, 0.0, -1.0, -5.0], [0.0, 0.0, -1.0, -5.0]]])
    check_all(torch.tensor([2]), lp, list(range(0, 14)))
    tree = best_first(torch.tensor([2]), lp, 5)
    assert tree.depths.tolist() == [[0, 1, 2, 3, 3, 1]]
    assert tree.tokens.tolist() == [[2, 0, 1, 0, 1, 1]]


def test_minus_inf_and_budget_beyond_the_candidates():
    """Two finite tokens per depth: a larger budget keeps -inf nodes by the tie rule (lowest ids first), and a
    budget beyond every candidate keeps them all."""
    lp = torch.full((2, 3, 6), float("-inf"))
    lp[0, :, 4], lp[0, :, 1] = -0.1, -2.4
    lp[1, :, 0] = 0.0
    check_all(torch.tensor([0, 5]), lp, [0, 1, 2, 3, 7, 20, 6 + 36 + 216, 1000])
    assert best_first(torch.tensor([0, 5]), lp, 1000).num_nodes == 1 + 6 + 36 + 216


def test_negative_zero_ties_positive_zero():
    lp = torch.tensor([[[0.0, -0.0, float("-inf"), -0.0], [-0.0, 0.0, 0.0, -3.0]]])
    check_all(torch.tensor([1]), lp, [1, 2, 5, 9])
    vals, toks = ranked_topk(lp, 2)
    assert toks.tolist() == [[[0, 1], [0, 1]]]


@pytest.mark.parametrize("kind", KINDS)
def test_ranked_topk_equals_the_reference(kind):
    gen = torch.Generator().manual_seed(3)
    lp = distribution(gen, (3, 4, 25), kind)
    for k in range(0, 26):
        got, want = ranked_topk(lp, k), ref.ranked_topk(lp, k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), k


def test_ranked_topk_ties_straddling_the_kth_place_take_the_lowest_ids():
    lp = torch.tensor([[[-1.0, -2.0, -2.0, -0.5, -2.0, -2.0, -9.0]]])
    vals, toks = ranked_topk(lp, 4)
    assert toks.tolist() == [[[3, 0, 1, 2]]] and vals.tolist() == [[[-0.5, -1.0, -2.0, -2.0]]]


def test_ranked_topk_ties_across_chunks_of_the_vocabulary():
    """Ties spread over several of the search's vocabulary chunks, with a vocabulary that is not a multiple of
    the chunk: the lowest tied ids still win, whatever the count of values above the tie."""
    gen = torch.Generator().manual_seed(9)
    lp = torch.full((2, 3, 1000), -5.0)
    lp[..., torch.randperm(1000, generator=gen)[:40]] = -1.0  # 40 ties, scattered
    lp[0, :, 999] = lp[1, 0, 700] = -0.5  # one value above the tie in some rows, high ids
    for k in (1, 2, 5, 39, 40, 41, 64, 999):
        got, want = ranked_topk(lp, k), ref.ranked_topk(lp, k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), k
    tied = torch.nonzero(lp[1, 1] == -1.0).flatten()
    assert ranked_topk(lp, 5)[1][1, 1].tolist() == tied[:5].tolist()


def test_ranked_topk_values_above_the_tie_each_in_their_own_chunk():
    """The values above the tie fill the first chunks the search looks at (up to ``k - 1`` of them), and the
    tied values come later: the search must still reach the first tied ids."""
    lp = torch.full((1, 1, 4000), -9.0)
    lp[0, 0, [0, 130, 260, 390]] = torch.tensor([-0.1, -0.2, -0.3, -0.4])
    lp[0, 0, [3999, 3000, 2000, 1000, 800, 700]] = -1.0
    vals, toks = ranked_topk(lp, 7)
    assert toks.tolist() == [[[0, 130, 260, 390, 700, 800, 1000]]]
    assert torch.equal(vals, ref.ranked_topk(lp, 7)[0])


@pytest.mark.parametrize("seed", range(4))
def test_ranked_topk_on_wide_tied_vocabularies(seed):
    gen = torch.Generator().manual_seed(seed)
    lp = distribution(gen, (2, 3, 777), "integer")
    lp[0, 1, torch.randperm(777, generator=gen)[:5]] = 0.5  # a few above the ties
    for k in (1, 3, 6, 7, 50, 300, 776):
        got, want = ranked_topk(lp, k), ref.ranked_topk(lp, k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), k


def python_ranked(lp: torch.Tensor, k: int) -> list:
    """Each row's ``k`` best token ids by log-prob descending, then id ascending: a plain Python sort."""
    rows = lp.reshape(-1, lp.shape[-1]).tolist()
    return [sorted(range(len(row)), key=lambda t, row=row: (-row[t], t))[:k] for row in rows]


def test_top_stable_equals_a_stable_sort_on_wide_tied_rows():
    """Above the sort's size limit the selection runs on integer keys: ties (-0.0 with 0.0 among them), -inf and
    +inf must come out as a stable descending sort would give them, for 32- and 16-bit floats."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 3001, generator=gen) * 2).round() / 2
    x[0, ::7], x[1, ::5], x[2, :40] = -0.0, float("-inf"), float("inf")
    x[0, 3::11] = 0.0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        y = x.to(dtype)
        want = y.sort(dim=1, descending=True, stable=True)
        for m in (1, 2, 3, 50, 3001, 5000):
            values, indices = top_stable(y, m)
            assert torch.equal(indices, want.indices[:, :m]), (dtype, m)
            assert torch.equal(values, want.values[:, :m]) and values.dtype == dtype, (dtype, m)
    # The keys' index part fits in int32, as inductor's Triton code needs (its indices are int32 there).
    assert int(builders._index_keys(x.shape[1], x.device).max()) < 2**31


def test_ranked_topk_blocks_with_tied_best_tokens():
    """Blocks whose best tokens tie, ties inside the finer blocks, ties in the vocabulary's last partial block,
    and rows where every token is -inf but a few: the lowest ids still win at every step of the narrowing."""
    gen = torch.Generator().manual_seed(4)
    vocab = 5000  # not a multiple of the block size: a padded tail
    lp = torch.full((3, 4, vocab), -7.0)
    lp[0] = -torch.randint(0, 3, (4, vocab), generator=gen).float()  # ties everywhere
    lp[1, :, torch.randperm(vocab, generator=gen)[:60]] = -1.0  # 60 ties, scattered over blocks
    lp[1, :, 4990:] = -1.0  # and in the tail
    lp[1, 1, [3, 4000]] = -0.0
    lp[1, 1, 200] = 0.0
    lp[2] = float("-inf")
    lp[2, :, [4999, 17, 2600]] = torch.tensor([-2.0, -3.0, -2.0])
    for dtype in (torch.float32, torch.bfloat16):
        x = lp.to(dtype)
        for k in (1, 2, 3, 4, 5, 8, 17, 39, 40, 41, 70, 200):
            vals, toks = ranked_topk(x, k)
            assert toks.reshape(-1, k).tolist() == python_ranked(x.float(), k), (dtype, k)
            assert torch.equal(vals, x.gather(-1, toks)) and vals.dtype == dtype
            if dtype == torch.float32:
                want = ref.ranked_topk(x, k)
                assert torch.equal(vals, want[0]) and torch.equal(toks, want[1]), k


def pairwise_scores(gen: torch.Generator, batch: int, depth: int, k: int, kind: str) -> PairwiseScores:
    cands = torch.stack([torch.randperm(500, generator=gen)[:k].sort().values for _ in range(batch * depth)])
    first = distribution(gen, (batch, k), kind)
    table = distribution(gen, (batch, max(depth - 1, 0), k, k), kind)
    return PairwiseScores(cands.view(batch, depth, k), first, table)


@settings(max_examples=examples(100), deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), depth=st.integers(1, 5), k=st.integers(1, 8),
       kind=st.sampled_from(KINDS), budgets=st.lists(st.integers(0, 60), min_size=1, max_size=3))
def test_pairwise_device_builders_equal_the_numpy_builders(seed, batch, depth, k, kind, budgets):
    gen = torch.Generator().manual_seed(seed)
    scores = pairwise_scores(gen, batch, depth, k, kind)
    root = torch.randint(0, 500, (batch,), generator=gen)
    for budget in budgets:
        for device_builder, numpy_builder in PAIRWISE:
            assert_same_tree(device_builder(root, scores, budget), numpy_builder(root, scores, budget))


def test_pairwise_all_tied_and_budget_beyond_the_candidates():
    scores = PairwiseScores(torch.tensor([[[2, 5, 9], [1, 4, 6]]]), torch.zeros(1, 3), torch.zeros(1, 1, 3, 3))
    root = torch.tensor([0])
    for budget in (0, 1, 2, 3, 4, 7, 12, 100):
        for device_builder, numpy_builder in PAIRWISE:
            assert_same_tree(device_builder(root, scores, budget), numpy_builder(root, scores, budget))
    tree = best_first_pairwise(root, scores, 100)
    assert tree.num_nodes == 1 + 3 + 9 and tree.tokens[0, 1:4].tolist() == [2, 5, 9]
    assert tree.parents[0, 4:].tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3]


def builds():
    """One call of every device builder, as (name, thunk), on a batch of two distinct rows with ties."""
    gen = torch.Generator().manual_seed(5)
    lp = torch.cat([distribution(gen, (1, 6, 50), "levels"), distribution(gen, (1, 6, 50), "random")])
    root = torch.tensor([4, 9])
    scores = pairwise_scores(gen, 2, 6, 5, "levels")
    out = [(name, lambda b=b, n=n: b(root, lp, n)) for name, b in
           [("best_first", best_first), ("chain", chain), ("beam@3x4", resolve_builder("beam@3x4"))]
           for n in (0, 1, 16, 64)]
    out += [(b.__name__, lambda b=b, n=n: b(root, scores, n)) for b in (best_first_pairwise, chain_pairwise)
            for n in (0, 16, 64)]
    return out


@pytest.mark.parametrize("name,build", builds())
def test_device_builds_make_no_host_reads(name, build):
    build()  # the first call fills the per-shape index tables
    with count_host_reads() as reads:
        tree = build()
    assert reads.count == 0, reads.reads
    assert tree.num_nodes >= 1


def test_the_counter_sees_the_reference_builders_reads():
    """The same counter finds the numpy builders' copies and the reference top-k's tie check: a zero above is
    not a counter that sees nothing."""
    lp = torch.zeros(1, 3, 10)
    with count_host_reads() as reads:
        ref.best_first(torch.tensor([0]), lp, 8)
    assert "scalar" in reads.reads and "numpy" in reads.reads and "cpu" in reads.reads


def test_the_counter_counts_each_kind_of_read_once():
    x = torch.arange(4.0)
    for read, name in [(lambda: x[1].item(), "scalar"), (lambda: bool(x[1]), "scalar"), (lambda: int(x[2]), "scalar"),
                       (lambda: float(x.sum()), "scalar"), (x.tolist, "tolist"), (x.numpy, "numpy"),
                       (lambda: np.asarray(x), "__array__"), (x.cpu, "cpu")]:
        with count_host_reads() as reads:
            read()
        assert reads.reads == [name]
    with count_host_reads() as reads:
        (x + 1).sort()
        x.to("cpu")  # already on the host: no copy
    assert reads.count == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device-to-host copy needs an accelerator")
def test_the_counter_sees_device_to_host_copies():
    x = torch.arange(4.0, device="cuda")
    host = torch.empty(4)
    with count_host_reads() as reads:
        x.to("cpu")
        host.copy_(x)
    assert reads.count == 2
