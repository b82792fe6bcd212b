"""Keyed sampling: a seed fixes the tokens, whatever the budget, builder, batch, lookup or compile mode.

Every sampled token is a Gumbel-max draw with noise hashed from (row key, position, token id), so the accepted
path of any tree is the plain decoder's sequence under the same noise. The tests compare each speculative run
with plain keyed decoding (budget 0) token for token, check the acceptance against a drafter that proposes the
plain sequence (every drafted node on it must be accepted), and check the draws' distribution.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny import VOCAB, ScriptedDrafter, tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.blocks import PromptLookup, SamplingConfig, WithLookup, choose_tokens, processed_logprobs
from ddtree.core import noise
from ddtree.core.noise import gumbel_noise, row_key, row_keys

PROMPT = [5, 9, 14, 3, 22, 9, 14]
NEW = 20
RULES = [dict(temperature=1.0), dict(temperature=0.7, top_k=8, top_p=0.9)]


def python_gumbel(key: int, position: int, token: int) -> float:
    """The hash written out on Python ints (unsigned 64-bit), as the module docstring states it."""
    mask = (1 << 64) - 1

    def mix(x: int) -> int:
        x &= mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    h = mix(key + (position + 1) * 0x9E3779B97F4A7C15)
    bits = mix(h + (token + 1) * 0x9E3779B97F4A7C15) >> 11
    return -math.log(-math.log((bits + 0.5) * 2.0**-53))


def test_the_noise_is_the_stated_hash():
    keys = row_keys(7, 3)
    positions = torch.tensor([[0, 5], [1, 1000], [2**40, 3]])
    g = gumbel_noise(keys, positions, 50, dtype=torch.float64)
    for b in range(3):
        for j in range(2):
            for v in (0, 17, 49):
                want = python_gumbel(int(keys[b]) & ((1 << 64) - 1), int(positions[b, j]), v)
                assert g[b, j, v].item() == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("vocab", [97, 49152, 151936])
def test_a_positions_noise_does_not_depend_on_what_is_drawn_with_it(vocab):
    """Drawn with 25 other positions on 5 threads (torch then splits the logs into chunks whose ends take scalar
    code) or alone, a position's noise is the same bits: a tree node and plain decoding draw alike."""
    torch.set_num_threads(5)
    keys = row_keys(3, 2)
    positions = torch.arange(13).expand(2, 13) + 7
    together = gumbel_noise(keys, positions, vocab)
    for b in range(2):
        for i in range(13):
            assert torch.equal(gumbel_noise(keys[b:b + 1], positions[b:b + 1, i:i + 1], vocab)[0, 0], together[b, i])


def test_row_keys_follow_the_seed_rule():
    assert row_keys(11, 3).tolist() == [row_key(11, b) for b in range(3)]
    assert row_keys([11, 12, 11], 3).tolist() == [row_key(11), row_key(12), row_key(11)]
    assert row_keys(11, 1).tolist() == row_keys([11], 1).tolist()  # one prompt: an int and a list agree
    assert len(set(row_keys(11, 8).tolist())) == 8
    with pytest.raises(ValueError, match="one seed per prompt"):
        row_keys([1, 2], 3)
    with pytest.raises(TypeError, match="must be an int"):
        row_key(True)


def chi2_critical(df: int) -> float:
    """Upper 1e-4 quantile (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + 3.719016 * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("rule", [SamplingConfig(1.0), SamplingConfig(0.8, top_k=3), SamplingConfig(1.5, top_p=0.9)])
def test_keyed_draws_follow_the_processed_distribution(rule):
    """Over many keys (and, separately, many positions of one key) the draws' frequencies match the processed
    distribution (chi-square, false alarm 1e-4; the keys are fixed, so the outcome is too)."""
    torch.manual_seed(0)
    logits = torch.randn(8, dtype=torch.float64) * 1.5
    p = processed_logprobs(logits, rule).exp().double()
    n = 20000
    by_key = choose_tokens(logits.expand(n, 8), rule, keys=row_keys(list(range(n)), n),
                           positions=torch.full((n,), 7))
    by_position = choose_tokens(logits.expand(1, n, 8), rule, keys=row_keys(5, 1),
                                positions=torch.arange(n).view(1, n))[0]
    for draws in (by_key, by_position):
        counts = torch.bincount(draws, minlength=8).double()
        assert (counts[p == 0] == 0).all(), "a filtered token was drawn"
        kept = p > 0
        expected = p[kept] * n
        stat = float(((counts[kept] - expected) ** 2 / expected).sum())
        df = int(kept.sum()) - 1
        assert stat < chi2_critical(df), (stat, df)


def test_greedy_ignores_keys():
    logits = torch.randn(3, 4, 11)
    keyed = choose_tokens(logits, SamplingConfig(), keys=row_keys(1, 3), positions=torch.zeros(3, 4))
    assert torch.equal(keyed, logits.argmax(-1))


@pytest.fixture(scope="module", params=[torch.float32, torch.float64], ids=["fp32", "fp64"])
def pair(request):
    target = tiny_target("qwen3", dtype=request.param)
    return target, tiny_drafter(target)


def plain(target, drafter, prompt=PROMPT, seed=3, new=NEW, **rule):
    out = SpeculativeGenerator(target, drafter, tree_budget=0).generate(
        torch.tensor([prompt]), max_new_tokens=new, stop_token_ids=(), seed=seed, **rule)
    return out.row_tokens[0]


def scripted(target, drafter, seed=3, **rule):
    """A drafter that proposes plain keyed decoding's continuation (past the NEW tokens compared)."""
    return ScriptedDrafter(torch.tensor(PROMPT + plain(target, drafter, seed=seed, new=NEW + 8, **rule)), VOCAB,
                           block_size=5)


def scripted_acceptance(out, builder: str) -> list[int]:
    """What a drafter proposing the plain sequence must get accepted each round: every drafted depth, i.e. the
    round's budget (at most the block's 4 depths; a beam's depth), plus the bonus token."""
    cap = {"chain": 4, "best_first": 4, "beam@2x3": 3}[builder]
    return [min(b, cap) + 1 for b in out.stats.budgets]


@pytest.mark.parametrize("rule", RULES, ids=["T1", "T0.7-k8-p0.9"])
def test_a_seed_fixes_the_tokens_for_every_budget_and_builder(pair, rule):
    target, drafter = pair
    want = plain(target, drafter, **rule)
    oracle = scripted(target, drafter, **rule)
    assert plain(target, drafter, seed=4, **rule) != want  # the seed really drives the draws
    for builder in ("chain", "best_first", "beam@2x3"):
        for budget in (1, 4, 16, "auto"):
            gen = SpeculativeGenerator(target, drafter, tree_budget=budget, builder=builder)
            out = gen.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, stop_token_ids=(), seed=3, **rule)
            assert out.row_tokens[0] == want, (builder, budget)
            assert out.seed == 3
            # a drafter that proposes the plain sequence: every drafted node on it is accepted
            gen = SpeculativeGenerator(target, oracle, tree_budget=budget, builder=builder)
            out = gen.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, stop_token_ids=(), seed=3, **rule)
            assert out.row_tokens[0] == want, (builder, budget, "scripted")
            assert out.acceptance_lengths == scripted_acceptance(out, builder), (builder, budget)
            assert max(out.acceptance_lengths) > 1


def test_a_prompt_draws_the_same_tokens_at_any_row_with_a_seed_list(pair):
    """A ragged batch with one seed per row: each row's tokens are its batch-1 run's with its own seed, so
    the same prompt at rows 0 and 2 with the same seed gets the same tokens; an int seed keys rows apart."""
    target, drafter = pair
    other = [7, 7, 30, 2]
    rule = dict(temperature=1.0)
    alone = {s: plain(target, drafter, seed=s, **rule) for s in (3, 8)}
    alone_other = plain(target, drafter, prompt=other, seed=8, **rule)
    for budget in (0, 4, "auto"):
        gen = SpeculativeGenerator(target, drafter, tree_budget=budget)
        out = gen.generate([PROMPT, other, PROMPT], max_new_tokens=NEW, stop_token_ids=(), seed=[3, 8, 3], **rule)
        assert out.row_tokens == [alone[3], alone_other, alone[3]], budget
        assert out.seed == [3, 8, 3]
        one = gen.generate([PROMPT, other, PROMPT], max_new_tokens=NEW, stop_token_ids=(), seed=3, **rule)
        assert one.row_tokens[0] == alone[3]  # row 0 under an int seed is the batch-1 run
        assert one.row_tokens[2] != one.row_tokens[0]  # the same prompt at row 2 draws with its own key


def test_rows_that_stop_early_keep_the_other_rows_tokens(pair):
    """A row that stops drops out of the batch; the others keep their keys (their tokens equal their own runs)."""
    target, drafter = pair
    rule = dict(temperature=1.0)
    want = plain(target, drafter, seed=5, **rule)
    stop = want[3]
    gen = SpeculativeGenerator(target, drafter, tree_budget=4)
    short = [9, 9, 9]
    out = gen.generate([short, PROMPT], max_new_tokens=NEW, stop_token_ids=[stop], seed=[6, 5], **rule)
    assert out.row_tokens[1] == want[: want.index(stop) + 1]
    alone = gen.generate([short], max_new_tokens=NEW, stop_token_ids=[stop], seed=6, **rule)
    assert out.row_tokens[0] == alone.row_tokens[0]


def test_lookup_branches_do_not_change_the_tokens(pair):
    target, drafter = pair
    rule = dict(temperature=0.8, top_k=20)
    want = plain(target, drafter, **rule)
    wrapped = SpeculativeGenerator(target, drafter).drafter  # the Drafter that wraps the model
    merged = WithLookup(wrapped, PromptLookup.for_target(target, block_size=wrapped.block_size))
    out = SpeculativeGenerator(target, merged, tree_budget=6).generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW, stop_token_ids=(), seed=3, **rule)
    assert out.row_tokens[0] == want
    oracle = WithLookup(scripted(target, drafter, **rule), PromptLookup.for_target(target, block_size=5))
    out = SpeculativeGenerator(target, oracle, tree_budget=6).generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW, stop_token_ids=(), seed=3, **rule)
    assert out.row_tokens[0] == want
    assert out.acceptance_lengths == [5] * len(out.acceptance_lengths)  # the scripted chain is in every tree


@pytest.mark.parametrize("compile", ["eager", True])
def test_the_static_round_draws_the_same_tokens(pair, compile):
    """compile=True samples inside its verify step: the same tokens and acceptance as the dynamic round, traced
    by the 'eager' backend and compiled by inductor (whose CPU code once broke the hash's int64 wraparound:
    out-of-vocabulary tokens, heap corruption)."""
    target, drafter = pair
    if compile is True and target.dtype == torch.float64:
        pytest.skip("inductor is compiled once, in float32 (20 s)")
    rule = dict(temperature=1.0, top_p=0.95)
    dynamic = SpeculativeGenerator(target, drafter, tree_budget=4).generate(
        [PROMPT, [7, 7, 30]], max_new_tokens=NEW, stop_token_ids=(), seed=[3, 8], **rule)
    static = SpeculativeGenerator(target, drafter, tree_budget=4, compile=compile).generate(
        [PROMPT, [7, 7, 30]], max_new_tokens=NEW, stop_token_ids=(), seed=[3, 8], **rule)
    assert static.row_tokens == dynamic.row_tokens
    assert static.row_tokens[0] == plain(target, drafter, **rule)
    assert static.row_acceptance == dynamic.row_acceptance


def test_without_a_seed_torch_manual_seed_repeats_the_call(pair):
    target, drafter = pair
    gen = SpeculativeGenerator(target, drafter, tree_budget=4)
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        outs.append(gen.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, stop_token_ids=(), temperature=1.0))
    assert outs[0].row_tokens == outs[1].row_tokens
    assert isinstance(outs[0].seed, int) and outs[0].seed == outs[1].seed
    plain_out = SpeculativeGenerator(target, drafter, tree_budget=0).generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW, stop_token_ids=(), temperature=1.0, seed=outs[0].seed)
    assert plain_out.row_tokens == outs[0].row_tokens  # the reported seed reproduces the call


def test_greedy_leaves_the_global_rng_alone(pair):
    target, drafter = pair
    torch.manual_seed(9)
    before = torch.get_rng_state()
    out = SpeculativeGenerator(target, drafter, tree_budget=4).generate(torch.tensor([PROMPT]), max_new_tokens=4)
    assert torch.equal(torch.get_rng_state(), before)
    assert out.seed is None


@pytest.mark.parametrize("seed,message", [([1, 2], "2 entries for 3 prompts"), ("7", "seed must be an int"),
                                          (True, "seed must be an int"), ([1, 2.5, 3], "seed must be an int")])
def test_bad_seeds_are_refused_by_name(pair, seed, message):
    target, drafter = pair
    gen = SpeculativeGenerator(target, drafter, tree_budget=4)
    with pytest.raises(ValueError, match=message):
        gen.generate([PROMPT, PROMPT, PROMPT], max_new_tokens=4, temperature=1.0, seed=seed)


def test_the_hash_runs_on_wrapping_int64():
    """The constants are the unsigned ones taken modulo 2**64, so tensor arithmetic wraps to the same bits."""
    assert noise.GOLDEN % (1 << 64) == 0x9E3779B97F4A7C15
    assert noise.MIX1 % (1 << 64) == 0xBF58476D1CE4E5B9
    big = torch.tensor([2**62, -(2**62)], dtype=torch.long)
    assert (big * noise.MIX1).dtype == torch.long  # no promotion: the product wraps


def test_a_coupled_drafters_first_guess_is_the_targets_draw_when_they_agree():
    """Coupling ranks each depth by the drafter's tempered log-probs plus the target's noise at that position:
    where the drafter's distribution is the target's, its top candidate is exactly the target's keyed draw."""
    from ddtree.core.sampling import coupled_logprobs

    torch.manual_seed(1)
    logits = torch.randn(3, 4, 50)  # [B, D, V]: the target's (and the drafter's) distribution at depths 1..4
    start = torch.tensor([7, 30, 2])
    keys = row_keys([4, 5, 6], 3)
    for rule in (SamplingConfig(1.0), SamplingConfig(0.7)):  # (the drafter's ranks are not cut by top-k/top-p)
        coupled = coupled_logprobs(logits.log_softmax(-1), rule, keys, start)
        drawn = choose_tokens(logits, rule, keys=keys, positions=start[:, None] + torch.arange(1, 5))
        assert torch.equal(coupled.argmax(-1), drawn)
        assert torch.allclose(coupled.exp().sum(-1), torch.ones(3, 4))  # renormalised
    assert coupled_logprobs(logits, SamplingConfig(), keys, start) is logits  # greedy: untouched


def test_coupling_changes_the_trees_not_the_tokens(pair):
    """Forced on or off, coupling builds other trees and the same tokens; by default it is on from T = 1.0."""
    from ddtree.generation.options import coupled_at

    assert [coupled_at(None, t) for t in (0.0, 0.6, 0.99, 1.0, 1.2)] == [False, False, False, True, True]
    assert coupled_at(True, 0.5) and not coupled_at(False, 1.5) and not coupled_at(True, 0.0)
    target, drafter = pair
    rule = dict(temperature=1.2)
    want = plain(target, drafter, **rule)
    for budget in (4, 16):
        trees = {}
        for coupled in (False, True):
            out = SpeculativeGenerator(target, drafter, tree_budget=budget, coupled_drafts=coupled).generate(
                torch.tensor([PROMPT]), max_new_tokens=NEW, stop_token_ids=(), seed=3, record_trees=True, **rule)
            assert out.row_tokens[0] == want, (budget, coupled)
            trees[coupled] = [r.tree.tokens.tolist() for r in out.rounds]
        assert trees[False] != trees[True]  # the noise did reach the builder


def test_dflash2_pairwise_trees_keep_the_tokens_coupled_or_not(tmp_path):
    """A DFlash2 drafter's pairwise scores take the noise of each candidate's own token."""
    from test_dflash2 import ddtree_checkpoint

    target = tiny_target("qwen3")
    path = ddtree_checkpoint(target, tmp_path / "d2")
    rule = dict(temperature=0.9, top_k=30)
    want = None
    for budget, coupled in ((0, False), (6, False), (6, True), ("auto", True)):
        out = SpeculativeGenerator(target, str(path), tree_budget=budget, coupled_drafts=coupled).generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW, stop_token_ids=(), seed=11, **rule)
        want = want or out.row_tokens[0]
        assert out.row_tokens[0] == want, (budget, coupled)


def test_the_benchs_plain_baseline_draws_the_generators_tokens(pair):
    """``python -m ddtree.bench``'s ``ar`` (target-only decoding with its own loop) keys its draws as the
    generator does, so under sampling its tokens are every method's tokens for the same seed."""
    from ddtree.bench.methods import autoregressive

    target, drafter = pair
    rule = SamplingConfig(0.9, top_k=16)
    tokens, _, _ = autoregressive(target, torch.tensor([PROMPT]), NEW, rule, 3, frozenset())
    out = SpeculativeGenerator(target, drafter, tree_budget=4).generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW, stop_token_ids=(), seed=3, temperature=0.9, top_k=16)
    assert tokens == out.row_tokens[0]
    assert sum(out.acceptance_lengths) + 1 >= NEW  # the rounds' acceptance covers every token after the first


@pytest.mark.real_default
def test_prompt_lookup_setting_wraps_the_drafter_once(pair):
    """``prompt_lookup=True`` merges a lookup branch into the trees (a drafter that merges one already is kept):
    the tokens stay plain decoding's, and on a prompt that repeats itself the lookup branch is accepted."""
    target, drafter = pair
    gen = SpeculativeGenerator(target, drafter, prompt_lookup=True, tree_budget=6)
    assert isinstance(gen.drafter, WithLookup) and gen.options.prompt_lookup is True
    assert SpeculativeGenerator(target, gen.drafter, prompt_lookup=True).drafter is gen.drafter
    assert not isinstance(SpeculativeGenerator(target, drafter, prompt_lookup=False).drafter, WithLookup)
    with pytest.raises(ValueError, match="prompt_lookup"):
        gen.generate(torch.tensor([PROMPT]), max_new_tokens=4, prompt_lookup=False)
    rule = dict(temperature=1.0)
    repeat = PROMPT * 3
    out = gen.generate(torch.tensor([repeat]), max_new_tokens=NEW, stop_token_ids=(), seed=3, **rule)
    assert out.row_tokens[0] == plain(target, drafter, prompt=repeat, **rule)
    greedy = gen.generate(torch.tensor([repeat]), max_new_tokens=NEW, stop_token_ids=())
    assert (greedy.stats.accepted_by_source or {}).get("lookup", 0) > 0
