"""Every builder on every layout: ``chain``, ``best_first``, ``beam``, the pairwise builders and ``graft_paths``
on float32, float64, bfloat16 and float16 inputs, contiguous or strided (transposed, sliced, stepped, expanded
views), batches of 1 to 8, budgets 0 to 4x the block and vocabularies below, at and above ``ranked_topk``'s block
sizes. Each build must not raise, must have the documented node count, and must equal the reference builder
run on the float32 values of the same inputs, node for node (the tie rule in :mod:`ddtree.core.builders`:
values compared as float32, then the lower id).

The default run covers each (dtype, layout, vocabulary, budget) once, the batch size cycling; ``--slow`` runs
the full product with every batch size, and the hypothesis tests 20x more examples.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batch import hf_greedy
from test_device_builders import assert_same_tree
from test_generator import expected_acceptance
from test_graft import random_paths
from tiny import ScriptedDrafter, examples, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.blocks import chain as public_chain
from ddtree.core import reference_builders as ref
from ddtree.core.builders import _BLOCKS, _FEW, _SORT_MAX, beam, best_first, chain, ranked_topk
from ddtree.core.graft import Branches, graft_paths
from ddtree.core.pairwise import PairwiseScores, best_first_pairwise, chain_pairwise
from ddtree.core.tree import DraftTree
from ddtree.runtime.host_reads import count_host_reads

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LAYOUTS = ["contiguous", "transposed", "depth_major", "sliced", "stepped", "expanded"]
DEPTH = 7  # the block: a DFlash block of 8 drafts 7 positions after the root
BUDGETS = [0, 1, 2, 3, DEPTH - 1, DEPTH, DEPTH + 1, 2 * DEPTH, 4 * DEPTH]
BATCHES = [1, 2, 3, 5, 8]
# Below, at and above each block size of ranked_topk (128, 16) and the tokens it ranks unnarrowed (512); 2049:
# one row past the 2048 entries above which top_stable selects on integer keys; 4100 > 28 * 128, so budget 28
# narrows in both block sizes, over a padded last block.
VOCABS = sorted({2, 5, *(b + d for b in _BLOCKS for d in (-1, 0, 1)), _FEW, 700, _SORT_MAX + 1, 4100})
WIDTHS = [(3, 4), (5, None)]  # beam 5: 5 * 128 > 512 tokens, so wide vocabularies take the finer blocks
KINDS = ["random", "tied", "near_tied", "sparse"]


def logprobs(seed: int, shape: tuple[int, int, int], dtype: torch.dtype, kind: str) -> torch.Tensor:
    """Contiguous log-probs in ``dtype``: ``tied`` has few distinct values (ties within and across depths);
    ``near_tied`` pairs values closer than float32 can tell apart (ties only after the float32 rounding);
    ``sparse`` is -inf but for about a quarter of the tokens (and token 0)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
    if kind == "tied":
        x = x.round()
    lp = x.log_softmax(-1)
    if kind == "near_tied":
        lp[..., 1::2] = lp[..., ::2][..., : lp.shape[-1] // 2] + 1e-12
    if kind == "sparse":
        drop = torch.rand(shape, generator=gen) > 0.25
        drop[..., 0] = False
        lp = lp.masked_fill(drop, float("-inf"))
    return lp.to(dtype)


def lay_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor of the same shape in another memory layout (``expanded``: row 0 repeated over the batch)."""
    if layout == "contiguous":
        return x.contiguous()
    if layout == "transposed":  # the last dim is the slowest: stored [..., V, D]
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "depth_major":  # stored with the second dim first
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "sliced":  # a window of a larger tensor, every dim offset, the first one stepped
        big = torch.zeros(2 * x.shape[0], *(n + 3 for n in x.shape[1:]), dtype=x.dtype)
        window = (slice(None, None, 2), *(slice(1, n + 1) for n in x.shape[1:]))
        big[window] = x
        return big[window]
    if layout == "stepped":  # every other element of the last dim
        big = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        big[..., ::2] = x
        return big[..., ::2]
    if layout == "expanded":
        return x[:1].expand(x.shape)
    raise ValueError(layout)


def roots(batch: int) -> torch.Tensor:
    return torch.arange(3, 3 + 2 * batch)[::2]  # strided too


def batches(request, case: int, dtype: torch.dtype, layout: str) -> list[int]:
    """Every batch size under ``--slow``; else one, cycling with the case and shifted per (dtype, layout), so
    each case meets several batch sizes over the grid's tests."""
    if request.config.getoption("--slow"):
        return BATCHES
    return [BATCHES[(case + DTYPES.index(dtype) + LAYOUTS.index(layout)) % len(BATCHES)]]


def plain_builders():
    """(name, device builder, reference builder, node count for budget/depth/vocab)."""

    def full(budget, depth, vocab):
        total, level = 0, 1
        for _ in range(depth):
            level = min(level * vocab, budget)
            total += level
        return min(budget, total)

    def beam_count(width, beam_depth):
        def count(budget, depth, vocab):
            levels = depth if beam_depth is None else min(beam_depth, depth)
            k, sizes = min(width, vocab), [min(width, vocab)]
            for _ in range(levels - 1):
                sizes.append(min(width, sizes[-1] * k))
            return min(budget, sum(sizes)) if levels else 0
        return count

    return [("chain", chain, ref.chain, lambda budget, depth, vocab: min(budget, depth)),
            ("best_first", best_first, ref.best_first, full)] + [
        (f"beam@{w}x{d}", beam(w, d), ref.beam(w, d), beam_count(w, d)) for w, d in WIDTHS]


PLAIN = plain_builders()


def check_plain(root: torch.Tensor, lp: torch.Tensor, budget: int) -> None:
    """Each plain builder on ``lp`` as laid out: the documented node count and the reference's tree on the float32
    values of the same log-probs."""
    upcast = lp.float().contiguous()
    _, depth, vocab = lp.shape
    for name, build, reference, count in PLAIN:
        tree = build(root, lp, budget)
        assert tree.num_nodes == 1 + count(budget, depth, vocab), (name, tree.num_nodes)
        assert_same_tree(tree, reference(root, upcast, budget))


def test_chain_on_a_row_slice_of_float32_logprobs():
    """The reported case: budget 1 cuts depth 1 from ``[5, 7, 512]`` log-probs, a slice whose rows are not
    adjacent; ``ranked_topk`` flattened its blocks with ``view`` and raised."""
    lp = torch.randn(5, 7, 512, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    tree = public_chain(torch.zeros(5, dtype=torch.long), lp, 1)
    assert tree.tokens.tolist() == [[0, t] for t in lp[:, 0].argmax(-1).tolist()]
    assert torch.equal(tree.scores[:, 1], lp[:, 0].amax(-1))
    assert_same_tree(tree, ref.chain(torch.zeros(5, dtype=torch.long), lp, 1))
    vals, toks = ranked_topk(lp[:, :1], 1)  # the step that raised, on the slice itself
    assert torch.equal(toks[..., 0], lp[:, :1].argmax(-1)) and torch.equal(vals[..., 0], lp[:, :1].amax(-1))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plain_builders_on_the_grid(request, dtype, layout):
    for i, (vocab, budget) in enumerate(itertools.product(VOCABS, BUDGETS)):
        for batch in batches(request, i, dtype, layout):
            kind = KINDS[i % len(KINDS)]
            lp = lay_out(logprobs(i, (batch, DEPTH, vocab), dtype, kind), layout)
            check_plain(roots(batch), lp, budget)


@settings(max_examples=examples(40))
@given(dtype=st.sampled_from(DTYPES), layout=st.sampled_from(LAYOUTS), batch=st.integers(1, 8),
       depth=st.integers(1, 9), vocab=st.sampled_from(VOCABS) | st.integers(1, 1100), data=st.data(),
       kind=st.sampled_from(KINDS), seed=st.integers(0, 2**31 - 1))
def test_plain_builders_on_random_shapes(dtype, layout, batch, depth, vocab, data, kind, seed):
    budget = data.draw(st.integers(0, 4 * depth), label="budget")
    check_plain(roots(batch), lay_out(logprobs(seed, (batch, depth, vocab), dtype, kind), layout), budget)


def test_chain_at_budget_one_in_a_batch_of_five_generates():
    """The reported failure in a generation: ``chain`` at budget 1 over a batch of 5 drafts of ``[5, 7, 512]``
    (what the budget policy builds to price its candidates). Each row gets its greedy tokens, and each round
    accepts what a walk of its tree against them gives: the scripted drafter's one node, right every round."""
    target = tiny_target("qwen3", vocab=512)
    prompts = [torch.randint(1, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (3, 9, 5, 12, 7)]
    free = [hf_greedy(target, p, new=8) for p in prompts]
    drafter = ScriptedDrafter([p + f + [0] * 8 for p, f in zip(prompts, free)], 512, block_size=8)
    out = SpeculativeGenerator(target, drafter, tree_budget=1, builder="chain").generate(
        prompts, max_new_tokens=8, record_trees=True)
    assert drafter.proposals[0].shape == (5, 7, 512)
    assert out.row_tokens == free
    for b, (prompt, row) in enumerate(zip(prompts, free)):
        assert out.acceptance_lengths[b] == [expected_acceptance(r, prompt + row) for r in out.rounds[b]]
        assert out.acceptance_lengths[b] == [2] * len(out.acceptance_lengths[b])  # root and its one node


def test_near_ties_in_float64_go_to_the_lower_id():
    """Two float64 log-probs that round to one float32 tie: the lower id wins, as the tie rule says, whichever
    of the two is larger in float64."""
    lp = torch.full((2, 1, 300), -30.0, dtype=torch.float64)
    lp[0, 0, [40, 200]] = torch.tensor([-0.5, -0.5 + 1e-12], dtype=torch.float64)
    lp[1, 0, [40, 200]] = torch.tensor([-0.5 + 1e-12, -0.5], dtype=torch.float64)
    for build in (chain, best_first, beam(2, 1)):
        assert build(torch.tensor([0, 0]), lp, 1).tokens[:, 1].tolist() == [40, 40]
    assert best_first(torch.tensor([0, 0]), lp, 2).tokens[:, 1:].tolist() == [[40, 200], [40, 200]]


# ------------------------------------------------------------------------------------------------------------
# pairwise builders
# ------------------------------------------------------------------------------------------------------------

PAIRWISE_KS = [1, 2, 5, 16, 17]


def pairwise(seed: int, batch: int, depth: int, k: int, dtype: torch.dtype, kind: str, layout: str) -> PairwiseScores:
    gen = torch.Generator().manual_seed(seed)
    cands = torch.stack([torch.randperm(300, generator=gen)[:k].sort().values for _ in range(batch * depth)])
    first = logprobs(seed, (batch, 1, k), dtype, kind)[:, 0]
    table = logprobs(seed + 1, (batch * max(depth - 1, 0), k, k), dtype, kind).view(batch, max(depth - 1, 0), k, k)
    return PairwiseScores(lay_out(cands.view(batch, depth, k), layout), lay_out(first[:, None], layout)[:, 0],
                          lay_out(table.flatten(0, 1), layout).unflatten(0, (batch, max(depth - 1, 0))))


def check_pairwise(root: torch.Tensor, scores: PairwiseScores, budget: int) -> None:
    upcast = PairwiseScores(scores.candidates.contiguous(), scores.first.float().contiguous(),
                            scores.table.float().contiguous())
    bsz, depth, k = scores.candidates.shape
    sizes = [min(budget, k)]
    for _ in range(depth - 1):
        sizes.append(min(budget, sizes[-1] * k))
    for build, reference, count in [(best_first_pairwise, ref.best_first_pairwise, min(budget, sum(sizes))),
                                    (chain_pairwise, ref.chain_pairwise, min(budget, depth))]:
        tree = build(root, scores, budget)
        assert tree.num_nodes == 1 + count, (build.__name__, tree.num_nodes)
        assert_same_tree(tree, reference(root, upcast, budget))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pairwise_builders_on_the_grid(request, dtype, layout):
    depth = 4  # pairwise tables grow as K^2 per depth: a shorter block keeps the grid quick
    for i, (k, budget) in enumerate(itertools.product(PAIRWISE_KS, [0, 1, 2, 3, 4, 5, 8, 16])):
        for batch in batches(request, i, dtype, layout):
            check_pairwise(roots(batch), pairwise(i, batch, depth, k, dtype, KINDS[i % len(KINDS)], layout), budget)


# ------------------------------------------------------------------------------------------------------------
# graft_paths
# ------------------------------------------------------------------------------------------------------------

def branches_laid_out(paths, dtype: torch.dtype, layout: str) -> Branches:
    """``paths`` as :class:`Branches` with scores in ``dtype``, each tensor in ``layout`` (``expanded``: the
    branches of the row with the most, for every row, sized by that row alone as the reference sizes them)."""
    if layout == "expanded":
        one = Branches.from_lists([max(paths, key=len)], dtype=dtype)
        return Branches(*(x.expand(len(paths), *x.shape[1:]) for x in (one.tokens, one.scores, one.lengths)))
    b = Branches.from_lists(paths, dtype=dtype)
    return Branches(lay_out(b.tokens, layout), lay_out(b.scores, layout), lay_out(b.lengths[..., None], layout)[..., 0])


def as_lists(branches: Branches, dtype: torch.dtype):
    """Per row ``(tokens, scores)`` lists, scores in the tree's dtype (what the device graft compares)."""
    scores = branches.scores.to(dtype)
    return [[(branches.tokens[b, j, :n].tolist(), scores[b, j, :n].tolist())
             for j, n in enumerate(branches.lengths[b].tolist()) if n] for b in range(branches.tokens.shape[0])]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_graft_on_the_grid(request, dtype, layout):
    gen = torch.Generator().manual_seed(DTYPES.index(dtype) * 10 + LAYOUTS.index(layout))
    cases = itertools.product([5, 700], [0, 1, 3, DEPTH, 2 * DEPTH, 4 * DEPTH], PLAIN)
    for i, (vocab, budget, (name, build, _, _)) in enumerate(cases):
        for batch in batches(request, i, dtype, layout):
            lp = lay_out(logprobs(i, (batch, DEPTH, vocab), dtype, KINDS[i % len(KINDS)]), layout)
            tree = build(roots(batch), lp, budget)
            branches = branches_laid_out(random_paths(gen, tree, vocab, 3, DEPTH, tied=i % 2 == 0), dtype, layout)
            got = graft_paths(tree, branches, budget)
            want = ref.graft_paths(tree, as_lists(branches, tree.scores.dtype), budget)
            if branches.empty:
                assert got is tree
                continue
            assert got.num_nodes == 1 + min(budget, tree.num_nodes - 1 + branches.tokens.shape[1] *
                                            branches.tokens.shape[2]), name
            assert_same_tree(got, want)
            assert want.sources is not None and torch.equal(got.sources, want.sources)


# ------------------------------------------------------------------------------------------------------------
# no host reads on strided inputs
# ------------------------------------------------------------------------------------------------------------

def strided_builds():
    """Builds that take ``ranked_topk``'s block path (one and two narrowings) on strided inputs."""
    out = []
    for vocab, budget in [(512, 1), (512, 3), (4100, 28)]:
        lp = lay_out(logprobs(vocab, (5, DEPTH, vocab), torch.float32, "random"), "transposed")
        out += [(f"{name}-{vocab}-{budget}", lambda b=b, lp=lp, n=budget: b(roots(5), lp, n))
                for name, b, _, _ in PLAIN]
        out.append((f"chain-slice-{vocab}", lambda lp=lp: chain(roots(5), lp.contiguous(), 1)))
    return out


@pytest.mark.parametrize("build", [b for _, b in strided_builds()], ids=[n for n, _ in strided_builds()])
def test_strided_builds_make_no_host_reads(build):
    build()  # fills the per-shape index tables
    with count_host_reads() as reads:
        tree = build()
    assert reads.count == 0, reads.reads
    assert isinstance(tree, DraftTree) and tree.num_nodes > 1


def _is_a_tree(tree) -> bool:
    """Every node after its parent, one deeper, seeing exactly its ancestors."""
    for b in range(tree.tokens.shape[0]):
        parents, depths = tree.parents[b].tolist(), tree.depths[b].tolist()
        for i in range(1, len(parents)):
            if not (0 <= parents[i] < i and depths[i] == depths[parents[i]] + 1):
                return False
            ancestors, j = set(), i
            while j >= 0:
                ancestors.add(j)
                j = parents[j]
            if set(torch.nonzero(tree.visibility[b, i]).flatten().tolist()) != ancestors:
                return False
    return True


@pytest.mark.parametrize("builder", ["best_first", "beam@3x4"])
def test_unnormalised_scores_still_build_a_tree(builder):
    """A drafter's scores need not be log-probs: a positive score (or a NaN) must not let a child outrank its
    parent. Before scores were capped at 0, a depth-2 token scored above its parent was placed first, and the
    round emitted the accepted tokens out of order."""
    from ddtree.core.builders import resolve_builder
    from ddtree.core.verify import accept_longest_branch

    torch.manual_seed(0)
    build = resolve_builder(builder)
    lp = torch.randn(3, 5, 40).log_softmax(-1)
    top = lp.argmax(-1)
    lp.scatter_(-1, top[..., None], 2e-3)  # each depth's best token scored above 0, rising with depth
    lp[:, 1].scatter_(-1, top[:, 1:2], 4e-3)
    lp[2, 3, 5] = float("nan")
    tree = build(torch.zeros(3, dtype=torch.long), lp, 8)
    assert _is_a_tree(tree)
    # the target agrees with the drafter's best tokens: the walk accepts them in depth order
    choices = torch.zeros_like(tree.tokens)
    for b in range(3):
        for i in range(tree.num_nodes):
            d = int(tree.depths[b, i])
            choices[b, i] = top[b, d] if d < 5 else 0
    result = accept_longest_branch(tree, choices)
    for b in range(3):
        path = [int(tree.tokens[b, i]) for i in result.accepted[b].tolist() if i >= 0][1:]
        assert path == top[b, : len(path)].tolist() and len(path) >= 2


def test_unnormalised_pairwise_scores_still_build_a_tree():
    from ddtree.core.pairwise import PairwiseScores, best_first_pairwise

    torch.manual_seed(1)
    cands = torch.arange(4).expand(2, 3, 4).contiguous()
    first = torch.randn(2, 4).log_softmax(-1) + 0.5
    table = torch.randn(2, 2, 4, 4).log_softmax(-1) + 0.5
    tree = best_first_pairwise(torch.zeros(2, dtype=torch.long), PairwiseScores(cands, first, table), 6)
    assert _is_a_tree(tree)
