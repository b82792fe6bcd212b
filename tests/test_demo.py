"""``python -m ddtree demo`` explains what it prints: the table's columns and rows, why a method can be slower
than plain decoding, and the marks of its tree drawing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ddtree.apps.demo as demo
from ddtree.budget.decide import BEST, EXPLORE, FIRST, RETRY
from ddtree.generation.generator import GenerationOutput, GenerationStats
from ddtree.runtime import threads


def _run(tokens: int, rounds: int, seconds: float, acceptance: float) -> GenerationOutput:
    stats = GenerationStats(rounds=rounds, new_tokens=tokens, mean_acceptance=acceptance,
                            tokens_per_second=tokens / seconds, total_seconds=seconds, seconds={})
    return GenerationOutput(torch.zeros(1, tokens, dtype=torch.long), [], stats)


def test_round_cost_and_the_reason_a_method_loses():
    """A round's cost is in plain steps, so accept len / round cost is the speedup; the slowest method that
    loses to plain decoding is named with its own figures, one that wins is not."""
    plain = _run(100, 99, 10.0, 1.0)  # 0.1 s per token
    chain = _run(100, 80, 12.5, 1.25)  # 0.15625 s per round: 1.5625 plain steps, 0.8x
    tree = _run(100, 50, 7.5, 2.0)  # 0.15 s per round: 1.5 plain steps, 1.33x
    assert demo.round_cost(chain, plain) == pytest.approx(1.5625)
    assert demo.round_cost(tree, plain) == pytest.approx(1.5)
    assert 100 / 80 / demo.round_cost(chain, plain) == pytest.approx(chain.stats.tokens_per_second / 10)
    text = " ".join(demo.explain_table({"chain": chain, "ddtree@4": tree}, plain, 5).split())  # unwrapped
    assert "chain is slower than plain here: 1.25 tokens a round at 1.56 plain steps each." in text
    assert "ddtree@4 is slower" not in text
    assert "chain: DFlash's one path of 5 draft tokens" in text and "+lookup:" in text
    assert "On a CPU a round" in text and "on a GPU" in text
    assert "slower than plain" not in demo.explain_table({"ddtree@4": tree}, plain, 5)


def test_the_default_row_says_how_auto_spent_its_rounds():
    """Under ``"auto"`` the legend counts the call's drafted and plain rounds and those that measured an option
    it was not taking (first measurements, explorations, retries); a fixed default gets no such line."""
    plain = _run(100, 99, 10.0, 1.0)
    run = _run(100, 6, 8.0, 1.5)
    run.stats.budgets = [4, 4, 0, 0, 8, 0, 2]
    run.stats.reasons = [FIRST, BEST, FIRST, BEST, EXPLORE, RETRY, BEST]
    assert "4 drafted, 3 plain; 4 of them measured an option" in " ".join(demo.default_rounds(run).split())
    auto = SimpleNamespace(tree_budget="auto", options=SimpleNamespace(prompt_lookup=True))
    fixed = SimpleNamespace(tree_budget=4, options=SimpleNamespace(prompt_lookup=False))
    assert "default's rounds here" in demo.explain_table({"default": run}, plain, 5, auto)
    assert "default's rounds here" not in demo.explain_table({"default": run}, plain, 5, fixed)


def test_the_demo_prints_its_legend(saved_tiny_pair, capsys, monkeypatch):
    """The whole demo on the tiny pair: lossless for all five methods, and every mark it prints is explained."""
    monkeypatch.setattr(threads, "_explicit", None)
    target, drafter = saved_tiny_pair
    code = demo.main(["--target", str(target), "--drafter", str(drafter), "--max-new-tokens", "12",
                      "--threads", "1", "--prompt", "the tree"])
    out = capsys.readouterr().out
    assert code == 0 and "output identical for all 5 methods: yes" in out
    table = out.split("\nmethod ", 1)[1].split("\n\n", 1)[0].splitlines()  # the header's tail, then the rows
    assert [line.split()[0] for line in table[1:]] == ["plain", "chain", "ddtree@4", "ddtree@4+lookup", "default"]
    header = next(line for line in out.splitlines() if line.startswith("method"))
    assert header.split() == ["method", "accept", "len", "round", "cost", "tokens/s", "speedup"]
    text = " ".join(out.split())  # the explanation is wrapped
    assert "accept len: tokens per verify round" in text and "round cost: a round's time in plain steps" in text
    assert "+lookup: each tree also gets a branch" in text
    assert "default: SpeculativeGenerator's own settings, tree_budget=4 (4 draft nodes), without the lookup" in text
    assert "On a CPU a round" in text
    if "one DDTree round" in out:  # a round was recorded (it always is past the prefill's token)
        assert ("* = accepted by the target, no mark = drafted and rejected, -> = the bonus token the target's "
                "verify adds") in text
        assert "\n* root" in out and "then bonus -> " in out


def test_the_demo_under_sampling_draws_the_same_tokens_for_every_method(saved_tiny_pair, capsys, monkeypatch):
    """Keyed draws: with a seed, every row of the table samples plain decoding's tokens, and the demo says so."""
    monkeypatch.setattr(threads, "_explicit", None)
    target, drafter = saved_tiny_pair
    code = demo.main(["--target", str(target), "--drafter", str(drafter), "--max-new-tokens", "12",
                      "--threads", "1", "--prompt", "the tree", "--temperature", "0.8", "--seed", "3"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "temperature 0.8, seed 3: the same sampled tokens for all 5 methods: yes" in out
