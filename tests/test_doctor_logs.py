"""Tests for engine_logs.py against real log lines.

tests/fixtures/engine_logs/SOURCES.md says where each comes from.
"""

from pathlib import Path

import pytest

from ddtree.apps.doctor.engine_logs import (
    EngineProfile,
    parse_engine_log,
    profile_from_figures,
    recover_num_drafts,
)

FIX = Path(__file__).parent / "fixtures" / "engine_logs"


def load(name: str) -> str:
    return (FIX / name).read_text()


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-12)


# ----------------------------------------------------------------------------- vLLM V1


def test_current_format_aggregates_by_counts_not_mean_of_means():
    p = parse_engine_log(load("vllm_v1_current_multiline.log"))
    # Hand computation. k = 5 (five rates). Both lines are full-length drafts:
    #   line 1: 620 drafted / 5 = 124 drafts, 513 accepted, 1 + 513/124 = 5.137 -> printed 5.14
    #   line 2: 1175 / 5 = 235 drafts, 925 accepted, 1 + 925/235 = 4.936 -> printed 4.94
    assert p.engine == "vllm" and p.source_format == "vllm-v1"
    assert p.lines_aggregated == 2
    assert p.num_drafts == 124 + 235 == 359
    assert p.num_accepted == 513 + 925 == 1438
    assert p.num_draft_tokens == 620 + 1175
    assert p.mean_acceptance_length == approx(1 + 1438 / 359)
    assert p.mean_acceptance_length != approx((5.14 + 4.94) / 2)  # not a mean of means
    r1 = [0.960, 0.863, 0.823, 0.782, 0.710]
    r2 = [0.945, 0.877, 0.800, 0.694, 0.621]
    assert p.per_position == [approx((a * 124 + b * 235) / 359) for a, b in zip(r1, r2)]
    assert p.num_spec_tokens == 5
    # Check the numbers add up: sum of the rates ~ accepted / drafts (rates are printed to 3 places).
    assert sum(p.per_position) == pytest.approx(1438 / 359, abs=5 * 0.0005)


def test_current_format_with_process_prefix():
    p = parse_engine_log(load("vllm_v1_current_prefixed.log"))
    assert p.lines_aggregated == 1
    assert p.num_drafts == 609 // 3 == 203
    assert p.num_accepted == 206
    assert p.mean_acceptance_length == approx(1 + 206 / 203)
    assert p.per_position == [approx(0.601), approx(0.286), approx(0.128)]


def test_rate_first_format_v0_9_two_lines_between_engine_lines():
    p = parse_engine_log(load("vllm_v1_rate_first_0.9.log"))
    # 387/3 = 129 and 1488/3 = 496 drafts; 150 + 725 accepted.
    assert p.lines_aggregated == 2
    assert p.num_drafts == 129 + 496
    assert p.num_accepted == 875
    assert p.mean_acceptance_length == approx(1 + 875 / 625) == approx(2.4)
    assert p.per_position == [
        approx((0.543 * 129 + 0.615 * 496) / 625),
        approx((0.357 * 129 + 0.464 * 496) / 625),
        approx((0.264 * 129 + 0.383 * 496) / 625),
    ]


def test_rate_first_format_with_throughput():
    p = parse_engine_log(load("vllm_v1_rate_first_throughput.log"))
    assert p.num_drafts == 59  # 295 / 5
    assert p.mean_acceptance_length == approx(1 + 262 / 59)
    assert p.per_position == [approx(x) for x in (0.983, 0.949, 0.915, 0.881, 0.712)]


def test_variable_length_drafts_recovered_from_rounding():
    # Suffix decoding: 1190 drafted tokens, 24 positions; 1190/24 is not a whole number, so
    # drafted/k would be wrong. Only D = 466 matches the printed mean 1.78 and all 24 printed
    # rates (e.g. 158/466 = 0.33906 -> 0.339; 467 would give 0.338).
    p = parse_engine_log(load("vllm_v1_suffix_variable_drafts.log"))
    assert p.num_drafts == 466
    assert p.mean_acceptance_length == approx(1 + 364 / 466)
    assert round(p.mean_acceptance_length, 2) == 1.78
    assert len(p.per_position) == 24
    assert any("rounding-consistent" in n for n in p.notes)


def test_recover_num_drafts_cases():
    assert recover_num_drafts(262, 295, 5.44, [0.983, 0.949, 0.915, 0.881, 0.712]) == (59, "exact-full-drafts")
    # Nothing accepted: mean and rates say nothing, fall back to drafted / k.
    assert recover_num_drafts(0, 40, 1.0, [0.0] * 4) == (10, "assumed-full-drafts")
    assert recover_num_drafts(0, 0, None, None) == (0, "no-drafts")


def test_empty_interval_lines_are_skipped():
    # Made for this test: an interval with no drafts (vLLM prints nan), then a real line.
    empty = ("INFO 01-01 00:00:00 [metrics.py:96] SpecDecoding metrics: Mean acceptance length: nan, "
             "Accepted throughput: 0.00 tokens/s, Drafted throughput: 0.00 tokens/s, Accepted: 0 tokens, "
             "Drafted: 0 tokens, Per-position acceptance rate: nan, nan, nan, Avg Draft acceptance rate: nan%")
    p = parse_engine_log(empty + "\n" + load("vllm_v1_current_prefixed.log"))
    assert p.lines_aggregated == 1
    assert p.num_drafts == 203
    assert any("skipped" in n for n in p.notes)


def test_accepts_iterable_of_lines():
    with open(FIX / "vllm_v1_current_multiline.log") as fh:
        p = parse_engine_log(fh)
    assert p.num_drafts == 359


def test_early_v1_without_draft_count_is_refused_clearly():
    with pytest.raises(ValueError, match="number of drafts"):
        parse_engine_log(load("vllm_v1_early_no_drafts.log"))


# ----------------------------------------------------------------------------- vLLM V0


def test_v0_cumulative_takes_last_line():
    p = parse_engine_log(load("vllm_v0_cumulative.log"))
    # Counters since start: the last line (15 draft tokens, k = 5, 3 emitted) covers everything.
    assert p.source_format == "vllm-v0"
    assert p.per_position is None
    assert p.num_drafts == 3
    assert p.num_draft_tokens == 15
    assert p.num_accepted == 0  # emitted - drafts; the logged "accepted: 1" is not prefix-accepted
    assert p.mean_acceptance_length == approx(1.0)
    assert p.lines_aggregated == 2


def test_v0_mean_recovered_from_counts():
    p = parse_engine_log(load("vllm_v0_0.6.3.log"))
    # k = 3: 13311 / 3 = 4437 drafts; 10616 emitted = accepted prefix + 1 per draft.
    assert p.num_drafts == 4437
    assert p.num_accepted == 10616 - 4437 == 6179
    assert p.mean_acceptance_length == approx(10616 / 4437)
    # Check: system efficiency 0.598 = emitted / (drafts * (k + 1)).
    assert round(10616 / (4437 * 4), 3) == 0.598


def test_v0_counter_reset_starts_a_new_run():
    # Two real logs joined for this test: counters drop from 13311 to 5, i.e. a restart.
    p = parse_engine_log(load("vllm_v0_0.6.3.log") + load("vllm_v0_cumulative.log"))
    assert p.num_drafts == 4437 + 3
    assert p.mean_acceptance_length == approx((10616 + 3) / (4437 + 3))
    assert any("reset" in n for n in p.notes)


def test_v0_early_tokens_tokens_spelling():
    # Built from the format string at vllm commit 00c33e81 (vllm/engine/metrics.py), which prints
    # "Number of draft tokens tokens:"; numbers reused from the 0.6.3 fixture.
    line = ("INFO 05-01 10:00:00 metrics.py:300] Speculative metrics: Draft acceptance rate: 0.642, "
            "System efficiency: 0.598, Number of speculative tokens: 3, Number of accepted tokens: 8547, "
            "Number of draft tokens tokens: 13311, Number of emitted tokens tokens: 10616.")
    p = parse_engine_log(line)
    assert p.num_drafts == 4437
    assert p.mean_acceptance_length == approx(10616 / 4437)


# ----------------------------------------------------------------------------- SGLang


def test_sglang_period_form_with_accept_rate():
    p = parse_engine_log(load("sglang_accept_rate_period.log"))
    assert p.engine == "sglang" and p.source_format == "sglang"
    assert p.lines_aggregated == 5  # the Prefill line is not counted
    assert p.mean_acceptance_length == approx((2.17 + 1.95 + 1.80 + 2.05 + 1.80) / 5)
    assert p.per_position is None
    assert (p.num_drafts, p.num_draft_tokens, p.num_accepted) == (None, None, None)


def test_sglang_comma_form_pd_decode():
    p = parse_engine_log(load("sglang_comma_pd_decode.log"))
    assert p.lines_aggregated == 4
    assert p.mean_acceptance_length == approx((1.67 + 1.68 + 1.73 + 1.72) / 4)


def test_sglang_old_form_without_accept_rate():
    p = parse_engine_log(load("sglang_old_no_rate.log"))
    assert p.lines_aggregated == 1
    assert p.mean_acceptance_length == approx(2.74)


def test_sglang_lines_weighted_by_running_requests():
    # Two real logs joined for this test: a line with #running-req 4 and five with 1.
    p = parse_engine_log(load("sglang_old_no_rate.log") + load("sglang_accept_rate_period.log"))
    assert p.lines_aggregated == 6
    assert p.mean_acceptance_length == approx((4 * 2.74 + 2.17 + 1.95 + 1.80 + 2.05 + 1.80) / 9)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("text", ["", "hello world\nnot a log\n", load("no_spec_metrics.log")])
def test_garbage_raises_naming_known_formats(text):
    with pytest.raises(ValueError) as ei:
        parse_engine_log(text)
    msg = str(ei.value)
    assert "SpecDecoding metrics" in msg
    assert "Speculative metrics" in msg
    assert "accept len" in msg


def test_mixed_engines_refused():
    with pytest.raises(ValueError, match="mixes vLLM and SGLang"):
        parse_engine_log(load("vllm_v1_current_prefixed.log") + load("sglang_old_no_rate.log"))


# ----------------------------------------------------------------------------- typed figures


def test_figures_mean_only():
    p = profile_from_figures(mean=2.5)
    assert isinstance(p, EngineProfile)
    assert (p.engine, p.source_format, p.lines_aggregated) == ("user", "figures", 0)
    assert p.mean_acceptance_length == 2.5 and p.per_position is None


def test_figures_rates_only_give_mean():
    p = profile_from_figures(per_position=[0.8, 0.6, 0.4])
    assert p.per_position == [0.8, 0.6, 0.4]
    assert p.mean_acceptance_length == approx(2.8)


def test_figures_string_rates_and_consistent_mean():
    p = profile_from_figures(mean=2.01, per_position="0.601, 0.286, 0.128")
    assert p.per_position == [0.601, 0.286, 0.128]
    assert p.mean_acceptance_length == 2.01


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "give mean"),
        ({"mean": 0.9}, "bonus token"),
        ({"mean": 3.5, "per_position": [0.8, 0.6, 0.4]}, "disagrees"),
        ({"mean": 1.8, "per_position": [0.8, 0.6, 0.4]}, "exclude the bonus"),
        ({"per_position": [0.5, 0.7]}, "rises"),
        ({"per_position": [1.2]}, r"\[0, 1\]"),
        ({"per_position": "0.8, abc"}, "cannot read"),
    ],
)
def test_figures_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        profile_from_figures(**kwargs)


def test_figures_from_neighbouring_runs_are_kept_with_a_note():
    """The issue's vLLM figures: mean 1.04 from one run, rates summing to 0.049 from another."""
    p = profile_from_figures(1.04, "0.045, 0.004, 0, 0, 0")
    assert p.mean_acceptance_length == 1.04 and p.per_position == [0.045, 0.004, 0, 0, 0]
    assert any("differ by more than print rounding" in n for n in p.notes)


def test_contradictions_between_a_lines_counts_are_found_and_consistent_lines_pass():
    from ddtree.apps.doctor.engine_logs import contradiction

    assert contradiction(262, 295, 5.44, [0.983, 0.949, 0.915, 0.881, 0.712], 59) is None  # a real line
    assert "about 1000 drafts" in contradiction(50, 1000, 1.05, [0.2, 0.05, 0, 0, 0], 200)
    assert "the per-position rates sum to 0.500, not accepted / drafts = 0.250" in contradiction(
        50, 1000, 1.25, [0.4, 0.1, 0, 0, 0], 200)
    assert "1200 drafted tokens are more than k = 5 per draft" in contradiction(
        50, 1200, 1.25, [0.2, 0.05, 0, 0, 0], 200)
    assert "60 accepted of 50 drafted tokens" in contradiction(60, 50, None, None, 10)
    p = parse_engine_log(load("vllm_v1_suffix_variable_drafts.log"))
    assert p.contradictions == []  # rounding-consistent lines are not contradictions
