"""Longest-branch verification: the walk itself, greedy, and losslessness when sampling.

The sampling test runs many independent verify rounds at once (one tree per
batch row) against a target whose conditional distribution for every prefix is
a fixed table, and compares the distribution of the first two emitted tokens
with the exact target distribution by a chi-square test.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ddtree.core.builders import best_first
from ddtree.core.sampling import ARGMAX_BLOCK, SamplingConfig, choose_tokens, greedy_tokens, processed_logprobs
from ddtree.core.tree import DraftTree
from ddtree.core.verify import accept_longest_branch, verify_tree

# --------------------------------------------------------------------------- the walk


def random_tree_row(pyrng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    """Random parents; each node's children get distinct tokens."""
    parents, tokens, used = [-1], [pyrng.randrange(vocab)], {0: set()}
    for i in range(1, n):
        free = []
        while not free:
            p = pyrng.randrange(i)
            free = [t for t in range(vocab) if t not in used[p]]
        tok = pyrng.choice(free)
        used[p].add(tok)
        used[i] = set()
        parents.append(p)
        tokens.append(tok)
    return tokens, parents


def slow_walk(tokens: list[int], parents: list[int], choices: list[int]) -> list[int]:
    path = [0]
    while True:
        node = path[-1]
        nxt = [c for c in range(len(tokens)) if parents[c] == node and tokens[c] == choices[node]]
        assert len(nxt) <= 1
        if not nxt:
            return path
        path.append(nxt[0])


def check_result(result, rows, choices):
    bsz = len(rows)
    paths = [slow_walk(t, p, c) for (t, p), c in zip(rows, choices.tolist())]
    width = max(len(p) for p in paths)
    assert result.accepted.shape == (bsz, width)
    for b, path in enumerate(paths):
        assert result.accepted[b].tolist() == path + [-1] * (width - len(path))
        assert int(result.num_accepted[b]) == len(path)
        assert int(result.bonus[b]) == int(choices[b, path[-1]])
    assert result.accepted_tokens_per_row == [len(p) for p in paths]
    return paths


def test_accept_longest_branch_matches_slow_walk():
    pyrng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    deep = 0
    for _trial in range(120):
        n, vocab, bsz = pyrng.randint(1, 24), pyrng.choice([2, 3, 5, 40]), pyrng.randint(1, 5)
        rows = [random_tree_row(pyrng, n, vocab) for _ in range(bsz)]
        tree = DraftTree.from_parents(torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]))
        choices = torch.randint(0, vocab, (bsz, n), generator=gen)
        # Bias most choices towards a random existing child so paths get deep.
        for b, (tokens, parents) in enumerate(rows):
            for node in range(n):
                kids = [c for c in range(n) if parents[c] == node]
                if kids and pyrng.random() < 0.8:
                    choices[b, node] = tokens[pyrng.choice(kids)]
        paths = check_result(accept_longest_branch(tree, choices), rows, choices)
        deep = max(deep, *(len(p) for p in paths))
    assert deep >= 6  # the walks really went deep


def test_accept_longest_branch_padding_in_batch():
    # Row 0 accepts root -> 1 -> 3, row 1 only the root.
    tokens = torch.tensor([[7, 1, 2, 3], [7, 1, 2, 3]])
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 0, 1]])
    tree = DraftTree.from_parents(tokens, parents)
    choices = torch.tensor([[1, 3, 0, 4], [5, 3, 0, 4]])
    res = accept_longest_branch(tree, choices)
    assert res.accepted.tolist() == [[0, 1, 3], [0, -1, -1]]
    assert res.num_accepted.tolist() == [3, 1]
    assert res.bonus.tolist() == [4, 5]


def test_root_only_tree():
    tree = DraftTree.from_parents(torch.tensor([[4], [5]]), torch.tensor([[-1], [-1]]))
    res = accept_longest_branch(tree, torch.tensor([[8], [9]]))
    assert res.accepted.tolist() == [[0], [0]] and res.bonus.tolist() == [8, 9]


def test_verify_tree_greedy_is_argmax():
    pyrng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    for _trial in range(30):
        n, vocab, bsz = pyrng.randint(1, 16), pyrng.choice([3, 6, 20]), pyrng.randint(1, 4)
        rows = [random_tree_row(pyrng, n, vocab) for _ in range(bsz)]
        tree = DraftTree.from_parents(torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]))
        logits = torch.randn(bsz, n, vocab, generator=gen, dtype=torch.float64)
        # Make the target agree with a child now and then.
        for b, (tokens, parents) in enumerate(rows):
            for node in range(n):
                kids = [c for c in range(n) if parents[c] == node]
                if kids and pyrng.random() < 0.7:
                    logits[b, node, tokens[pyrng.choice(kids)]] += 10
        res = verify_tree(tree, logits)
        assert torch.equal(res.choices, logits.argmax(-1))
        check_result(res, rows, logits.argmax(-1))
    # Ties: the lowest token id.
    assert choose_tokens(torch.zeros(2, 5), SamplingConfig()).tolist() == [0, 0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [3 * ARGMAX_BLOCK, 3 * ARGMAX_BLOCK + 7, 100])
def test_greedy_tokens_pick_what_argmax_picks(dtype, vocab):
    """The CPU's two-step argmax (block maxima, then within the block) gives torch's index where the two steps
    could part: the max in two blocks (the first wins), in the partial last block, a NaN after the max and
    before it, rows of -inf, -0.0 against 0.0, values float32 would merge but float64 keeps apart."""
    torch.manual_seed(7)
    rows = torch.randn(14, vocab, dtype=torch.float64)
    top = rows.max() + 1
    rows[0, [5, vocab - 5]] = top  # a tie across blocks: the first
    rows[1, vocab - 1] = top  # in the last (possibly partial) block
    rows[2, [3, vocab - 2]] = torch.tensor([top, float("nan")], dtype=torch.float64)  # a NaN after the max wins
    rows[3, [vocab // 2, 1]] = float("nan")  # the first NaN
    rows[4] = float("-inf")
    rows[5] = 0.0
    rows[5, ::3] = -0.0
    rows[6] = -1.0
    rows[6, [2, vocab - 3]] = torch.tensor([1.0, 1.0 + 1e-12], dtype=torch.float64)  # merged by float32
    rows[7:] = rows[7:].round()  # many ties
    logits = rows.to(dtype)
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert torch.equal(greedy_tokens(logits.view(2, 7, vocab)), logits.view(2, 7, vocab).argmax(-1))
    assert greedy_tokens(logits)[1] == vocab - 1 and greedy_tokens(logits)[0] == 5


def test_verify_tree_rejects_wrong_logits_shape():
    tree = DraftTree.from_parents(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 0]))
    with pytest.raises(ValueError, match="3 nodes"):
        verify_tree(tree, torch.zeros(1, 2, 5))


# --------------------------------------------------------------------------- processed_logprobs vs HF


def hf_processed(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    x = TemperatureLogitsWarper(cfg.temperature)(None, logits)
    if cfg.top_k is not None:
        x = TopKLogitsWarper(cfg.top_k)(None, x)
    if cfg.top_p is not None:
        x = TopPLogitsWarper(cfg.top_p)(None, x)
    return x.log_softmax(-1)


SAMPLING_CONFIGS = [
    SamplingConfig(1.0),
    SamplingConfig(0.7),
    SamplingConfig(1.8),
    SamplingConfig(1.0, top_k=1),
    SamplingConfig(0.8, top_k=3),
    SamplingConfig(1.0, top_k=1000),
    SamplingConfig(1.0, top_p=0.5),
    SamplingConfig(0.6, top_p=0.9),
    SamplingConfig(1.0, top_p=1.0),
    SamplingConfig(1.0, top_p=1e-6),
    SamplingConfig(1.3, top_k=5, top_p=0.7),
    SamplingConfig(0.5, top_k=2, top_p=0.95),
]


@pytest.mark.parametrize("cfg", SAMPLING_CONFIGS, ids=str)
def test_processed_logprobs_matches_hf_warpers(cfg):
    gen = torch.Generator().manual_seed(7)
    for vocab in (2, 7, 50, 300):
        logits = torch.randn(16, vocab, generator=gen) * 3
        logits[:4] = logits[:4].round()  # exact ties, also at the top-k boundary
        got = processed_logprobs(logits, cfg)
        want = hf_processed(logits, cfg)
        assert got.shape == logits.shape
        assert torch.equal(torch.isinf(got), torch.isinf(want)), cfg
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)
        # Still a distribution.
        torch.testing.assert_close(got.exp().sum(-1), torch.ones(16), rtol=1e-5, atol=1e-5)
    # Leading batch dims are kept.
    logits = torch.randn(2, 3, 11, generator=gen)
    torch.testing.assert_close(processed_logprobs(logits, cfg), hf_processed(logits.view(6, 11), cfg).view(2, 3, 11))


def test_processed_logprobs_greedy_is_the_argmax_point_mass():
    logits = torch.tensor([[1.0, 3.0, 2.0], [5.0, 5.0, 0.0]], dtype=torch.float64)
    got = processed_logprobs(logits, SamplingConfig())
    inf = float("-inf")
    assert got.tolist() == [[inf, 0.0, inf], [0.0, inf, inf]]  # ties: the lowest id, as choose_tokens
    assert got.dtype == torch.float32


def test_top_p_boundary_matches_hf():
    # Uniform over 4 tokens: cumulative sums 0.25, 0.5, 0.75, 1 are exact, so the
    # cut lands exactly on the boundary; HF drops a token whose cumulative mass is
    # <= 1 - top_p (so top_p 0.75 keeps 3 tokens, 0.5 keeps 2, 0.25 keeps 1).
    logits = torch.zeros(3, 4)
    for top_p, kept in [(0.75, 3), (0.5, 2), (0.25, 1), (0.76, 4), (1.0, 4)]:
        cfg = SamplingConfig(1.0, top_p=top_p)
        got = processed_logprobs(logits, cfg)
        assert (got > float("-inf")).sum(-1).tolist() == [kept] * 3
        assert torch.equal(torch.isinf(got), torch.isinf(hf_processed(logits, cfg)))
    # top_k keeps every token tied with the k-th, as HF does.
    got = processed_logprobs(torch.tensor([[3.0, 1.0, 1.0, 0.0]]), SamplingConfig(1.0, top_k=2))
    assert torch.isfinite(got).tolist() == [[True, True, True, False]]


# --------------------------------------------------------------------------- losslessness when sampling

V = 5
ROWS = 20_000
ALPHA = 1e-4  # false-alarm rate of each chi-square test (the seeds are fixed, so a run is reproducible)


def normal_quantile(p: float) -> float:
    """z with P(Z > z) = p, by bisection on erfc."""
    lo, hi = -10.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(mid / math.sqrt(2)) > p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def chi2_critical(df: int, alpha: float) -> float:
    """Wilson-Hilferty: (X/df)^(1/3) is about normal with mean 1 - 2/(9df) and variance 2/(9df)."""
    z = normal_quantile(alpha)
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def test_chi2_critical_values():
    # Textbook values: chi2_{0.999}(10) = 29.59, chi2_{0.99}(24) = 42.98, chi2_{0.9999}(20) = 52.39.
    assert chi2_critical(10, 1e-3) == pytest.approx(29.59, rel=0.01)
    assert chi2_critical(24, 1e-2) == pytest.approx(42.98, rel=0.01)
    assert chi2_critical(20, 1e-4) == pytest.approx(52.39, rel=0.01)
    assert normal_quantile(0.025) == pytest.approx(1.95996, abs=1e-4)


def chi2_statistic(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic; cells with expected count < 5 are pooled into one cell."""
    observed, expected = observed.flatten().double(), expected.flatten().double()
    assert observed[expected == 0].sum() == 0, "a token with target probability 0 was emitted"
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


class TableTarget:
    """A target whose logits after ``root, t1, ..., tk`` are ``tables[k][t1, ..., tk]``."""

    def __init__(self, seed: int, depth: int = 4):
        gen = torch.Generator().manual_seed(seed)
        self.tables = [torch.randn(*([V] * k), V, generator=gen, dtype=torch.float64) * 1.5 for k in range(depth + 1)]

    def node_logits(self, tree: DraftTree, context: list[int]) -> torch.Tensor:
        """``[B, N, V]``: each node's logits given ``context`` and its path below the root."""
        bsz, n = tree.tokens.shape
        out = torch.empty(bsz, n, V, dtype=torch.float64)
        for b in range(bsz):
            toks, pars = tree.tokens[b].tolist(), tree.parents[b].tolist()
            for i in range(n):
                path, j = [], i
                while pars[j] != -1:
                    path.append(toks[j])
                    j = pars[j]
                prefix = tuple(context) + tuple(reversed(path))
                out[b, i] = self.tables[len(prefix)][prefix]
        return out

    def exact_two(self, cfg: SamplingConfig) -> torch.Tensor:
        """``P(e1, e2)`` under the processed target distribution, by HF's warpers (independent of ddtree)."""
        p1 = hf_processed(self.tables[0][None].float(), cfg).exp()[0].double()
        p2 = hf_processed(self.tables[1].float(), cfg).exp().double()
        return p1[:, None] * p2


def drafter_tables(seed: int, depth: int) -> torch.Tensor:
    """Per-context drafter log-probs ``[V, depth, V]`` (context = the round's root token)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(V, depth, V, generator=gen) * 2).log_softmax(-1)


def emitted_tokens(tree: DraftTree, res, width: int) -> torch.Tensor:
    """``[B, width]``: the round's emitted tokens (accepted path below the root, then the bonus), ``-1`` after."""
    bsz = tree.batch_size
    path = tree.tokens.gather(1, res.accepted.clamp(min=0))[:, 1:]
    path = torch.cat([path, path.new_full((bsz, width), -1)], dim=1)[:, :width]
    j = torch.arange(width)[None]
    num = res.num_accepted[:, None]
    return torch.where(j + 1 < num, path, torch.where(j + 1 == num, res.bonus[:, None], torch.full_like(path, -1)))


def take_rows(tree: DraftTree, rows: torch.Tensor) -> DraftTree:
    return DraftTree(*(t[rows] for t in (tree.tokens, tree.parents, tree.depths, tree.scores, tree.visibility)))


def simulate_two_tokens(target: TableTarget, cfg: SamplingConfig, seed: int, budget: int, choose=None):
    """Counts ``[V, V]`` of the first two tokens emitted after a fixed root, one independent trial per row.

    Round 1 verifies a fixed best-first tree; rows that emit only the bonus token
    run round 2 on the tree the drafter builds for that bonus token as its root.
    """
    gen = torch.Generator().manual_seed(seed)
    choose = choose or (lambda logits: choose_tokens(logits, cfg, gen))
    draft = drafter_tables(seed + 1, 3)
    root = 2
    one = best_first(torch.tensor([root]), draft[root : root + 1], budget)
    rows1 = torch.zeros(ROWS, dtype=torch.long)
    tree1 = take_rows(one, rows1)
    res1 = accept_longest_branch(tree1, choose(target.node_logits(one, [])[rows1]))
    out1 = emitted_tokens(tree1, res1, 2)
    e1 = out1[:, 0]
    # Round 2: the drafter's tree for each possible root, and the target's logits on it.
    per_root = best_first(torch.arange(V), draft, budget)
    logits2 = torch.stack([target.node_logits(take_rows(per_root, torch.tensor([r])), [r])[0] for r in range(V)])
    tree2 = take_rows(per_root, e1)
    res2 = accept_longest_branch(tree2, choose(logits2[e1]))
    e2 = torch.where(out1[:, 1] >= 0, out1[:, 1], emitted_tokens(tree2, res2, 1)[:, 0])
    assert (e1 >= 0).all() and (e2 >= 0).all()
    counts = torch.zeros(V * V, dtype=torch.long).index_add_(0, e1 * V + e2, torch.ones(ROWS, dtype=torch.long))
    return counts.view(V, V), res1, one


LOSSLESS_CASES = [
    (SamplingConfig(1.0), 4, 10),
    (SamplingConfig(0.5), 8, 11),
    (SamplingConfig(1.6), 3, 12),
    (SamplingConfig(0.7, top_k=3), 6, 13),
    (SamplingConfig(1.3, top_p=0.8), 5, 14),
    (SamplingConfig(1.0, top_k=2, top_p=0.9), 3, 15),
]


@pytest.mark.parametrize("cfg,budget,seed", LOSSLESS_CASES, ids=lambda x: str(x))
def test_sampling_verify_is_lossless(cfg, budget, seed):
    target = TableTarget(seed)
    counts, res1, one = simulate_two_tokens(target, cfg, seed, budget)
    exact = target.exact_two(cfg)
    stat, df = chi2_statistic(counts, exact * ROWS)
    assert df >= 2
    assert stat < chi2_critical(df, ALPHA), (stat, df, counts, exact * ROWS)
    # Optimal acceptance at the root: P(accept a child) = target mass on the root's children.
    p_root = exact.sum(1)
    mass = float(p_root[one.tokens[0, one.children(0)]].sum())
    frac = float((res1.num_accepted >= 2).double().mean())
    assert abs(frac - mass) <= 5 * math.sqrt(mass * (1 - mass) / ROWS) + 1e-12
    assert 0 < frac  # the test exercised accepted paths, not only bonus tokens


def test_sampling_test_detects_a_biased_rule():
    """Power check: one uniform per row shared by every node (correlated draws) must fail."""
    cfg, budget, seed = SamplingConfig(1.0), 6, 21
    target = TableTarget(seed)
    gen = torch.Generator().manual_seed(seed)

    def correlated(logits):
        cdf = processed_logprobs(logits, cfg).exp().cumsum(-1)
        u = torch.rand(logits.shape[0], 1, 1, generator=gen, dtype=cdf.dtype)
        return (cdf < u).sum(-1).clamp(max=logits.shape[-1] - 1)

    counts, _, _ = simulate_two_tokens(target, cfg, seed, budget, choose=correlated)
    stat, df = chi2_statistic(counts, target.exact_two(cfg) * ROWS)
    assert stat > chi2_critical(df, ALPHA)
    # ... and so must sampling at the wrong temperature.
    counts, _, _ = simulate_two_tokens(target, SamplingConfig(1.3), seed, budget)
    stat, df = chi2_statistic(counts, target.exact_two(cfg) * ROWS)
    assert stat > chi2_critical(df, ALPHA)


def test_greedy_two_tokens_are_the_argmax_chain():
    target = TableTarget(5)
    counts, _, _ = simulate_two_tokens(target, SamplingConfig(), 5, 6)
    a = int(target.tables[0].argmax())
    b = int(target.tables[1][a].argmax())
    assert counts[a, b] == ROWS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_widens_half_width_logits_to_the_same_index(dtype):
    """Greedy's argmax on a CPU widens bf16/fp16 logits first (faster there): the same index as the narrow
    argmax on logits thick with ties, infinities, signed zeros and NaN."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randint(-3, 4, (64, 97), generator=g).float() / 2).to(dtype)  # few values: many ties
    logits[1, 5] = logits[2, 7] = float("inf")
    logits[3, :] = -float("inf")
    logits[4, :] = 0.0
    logits[4, 10] = -0.0
    logits[5, 30] = logits[5, 60] = float("nan")
    logits[6, :] = float("nan")
    got = choose_tokens(logits, SamplingConfig())
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1))
    assert got[5].item() == 30 and got[1].item() == 5  # NaN wins, and the first of equals
