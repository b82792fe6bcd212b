"""Sampling through the whole generator: the output distribution is the target's, and
the first round's acceptance of independent (uncoupled) trees has the mean the verification rule predicts;
coupled trees give the same tokens.

Exact target probabilities over the first H tokens are enumerated on a tiny
vocabulary; the speculative samples are compared with a chi-square test at a
false-alarm rate of 1e-3 per case (fixed seeds, so the outcome is deterministic).
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny import tiny_target

from ddtree import SpeculativeGenerator
from ddtree.blocks import DFlashConfig, DFlashDraftModel, SamplingConfig, processed_logprobs

VOCAB, PROMPT, HORIZON, SAMPLES = 8, [1, 2, 3], 3, 1500


def chi2_critical(df: int, alpha: float = 1e-3) -> float:
    """Wilson-Hilferty approximation of the chi-square upper quantile."""
    z = {1e-3: 3.090232, 1e-4: 3.719016}[alpha]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def target_probs(target, prefixes: list[list[int]], cfg: SamplingConfig) -> torch.Tensor:
    with torch.no_grad():
        logits = target(torch.tensor(prefixes)).logits[:, -1]
    return processed_logprobs(logits, cfg).exp().double()


def exact_distribution(target, cfg: SamplingConfig, prompt=PROMPT, horizon=HORIZON) -> dict[tuple, float]:
    dist = {(): 1.0}
    for _ in range(horizon):
        seqs = list(dist)
        probs = target_probs(target, [prompt + list(s) for s in seqs], cfg)
        dist = {s + (t,): dist[s] * float(probs[i, t]) for i, s in enumerate(seqs) for t in range(probs.shape[-1])
                if probs[i, t] > 0}
    return dist


def chi2_statistic(counts: dict[tuple, int], exact: dict[tuple, float], samples: int) -> tuple[float, int]:
    """Chi-square over cells, pooling those with expected count < 5; returns (statistic, degrees of freedom)."""
    stat, pooled_obs, pooled_exp, df = 0.0, 0, 0.0, -1
    for seq, p in exact.items():
        e, o = p * samples, counts.get(seq, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    return stat, df


def expected_first_round_acceptance(target, record, first: int, cfg: SamplingConfig) -> float:
    """1 + sum over draft nodes of the probability that the target's draws reach it."""
    tree = record.tree
    toks, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()
    paths = {0: []}
    for i in range(1, len(toks)):
        paths[i] = paths[parents[i]] + [toks[i]]
    reach = {0: 1.0}
    for i in range(1, len(toks)):
        probs = target_probs(target, [PROMPT + [first] + paths[parents[i]]], cfg)
        reach[i] = reach[parents[i]] * float(probs[0, toks[i]])
    return 1.0 + sum(v for k, v in reach.items() if k > 0)


@pytest.mark.parametrize(
    "cfg,builder,budget",
    [
        (SamplingConfig(temperature=0.8, top_k=3), "best_first", 6),
        (SamplingConfig(temperature=1.5, top_p=0.95), "best_first", 10),
        (SamplingConfig(temperature=1.0, top_k=4, top_p=0.9), "beam@2x3", 6),
    ],
)
def test_speculative_sampling_matches_target_distribution(cfg, builder, budget):
    check_sampling(tiny_target("qwen3", vocab=VOCAB), cfg, builder, budget)


def test_speculative_sampling_on_a_hybrid_gdn_target():
    """The same distribution and acceptance checks through a Qwen3.5-style GDN hybrid."""
    from tiny import family_target

    check_sampling(family_target("qwen3_5", vocab=VOCAB), SamplingConfig(temperature=0.8, top_k=3), "best_first", 6,
                   samples=600)  # fewer draws (a hybrid forward costs more): a weaker but equally valid test


def check_sampling(target, cfg, builder, budget, samples: int = SAMPLES):
    torch.manual_seed(3)
    dcfg = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=VOCAB - 1)
    drafter = DFlashDraftModel(dcfg).double().eval()
    # Independent trees (no coupling) for the acceptance formula, which assumes the tree does not know the draws.
    gen = SpeculativeGenerator(target, drafter, tree_budget=budget, builder=builder, coupled_drafts=False)
    coupled = SpeculativeGenerator(target, drafter, tree_budget=budget, builder=builder, coupled_drafts=True)
    exact = exact_distribution(target, cfg)
    counts: dict[tuple, int] = {}
    acc, expected, by_first, coupled_acc = [], [], {}, []
    for seed in range(samples):
        call = dict(max_new_tokens=HORIZON, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, seed=seed)
        out = gen.generate(torch.tensor([PROMPT]), record_trees=True, **call)
        both = coupled.generate(torch.tensor([PROMPT]), **call)
        assert both.row_tokens == out.row_tokens  # keyed draws: coupling changes the trees, never the tokens
        coupled_acc.append(both.acceptance_lengths[0])
        seq = tuple(out.new_tokens[0].tolist())
        counts[seq] = counts.get(seq, 0) + 1
        acc.append(out.acceptance_lengths[0])
        # The first round's tree depends only on the first token: memoise its exact expectation.
        if seq[0] not in by_first:
            by_first[seq[0]] = expected_first_round_acceptance(target, out.rounds[0], seq[0], cfg)
        expected.append(by_first[seq[0]])
    assert set(counts) <= set(exact), "a sequence the target cannot produce was sampled"
    stat, df = chi2_statistic(counts, exact, samples)
    assert df >= 3
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} over {df} dof"
    # Acceptance: the observed mean equals the rule's prediction, and drafting did get accepted.
    acc_t, exp_t = torch.tensor(acc, dtype=torch.float64), torch.tensor(expected)
    se = acc_t.std() / math.sqrt(samples)
    assert abs(acc_t.mean() - exp_t.mean()) <= 4.5 * se + 1e-9, (acc_t.mean(), exp_t.mean(), se)
    assert acc_t.mean() > 1.2
    # Coupled trees (ranked with the target's own noise) draft other trees: they too are accepted past the root.
    assert sum(coupled_acc) / samples > 1.2
