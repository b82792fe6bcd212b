"""Whether a bench difference is larger than the run's own noise.

Two sources, each used where the run has it: the per-repeat ratios (interleaved repeats: every repeat on one
side of 1, or not), and the spread of the rounds (a 95% interval for a ratio of decode rates, tokens over
seconds summed over rounds, from the delta method, so short runs get wide intervals). A difference is called
real only when every source the run has agrees on its direction; one without any source cannot be told.
"""

from __future__ import annotations

import math
import statistics

Z95 = 1.96  # two-sided 95% normal quantile


def round_rate(tokens: list[int], seconds: list[float]) -> tuple[float | None, float | None]:
    """Tokens per second over the rounds, and its relative standard error (None under 2 rounds).

    The rate is a ratio of sums, so its variance comes from the residuals ``tokens - rate * seconds``
    (delta method); rounds that take longer for the tokens they commit widen it."""
    total_s = sum(seconds)
    if not seconds or total_s <= 0:
        return None, None
    rate = sum(tokens) / total_s
    n = len(seconds)
    if n < 2 or rate <= 0:
        return rate, None
    mean_s = total_s / n
    var = sum((t - rate * s) ** 2 for t, s in zip(tokens, seconds)) / (n - 1)
    return rate, math.sqrt(var / n) / mean_s / rate


def spread_ms(seconds: list[float]) -> dict[str, float] | None:
    """Median, 10th and 90th percentile of per-round times, in milliseconds."""
    if not seconds:
        return None
    s = sorted(seconds)
    return {"median": 1e3 * statistics.median(s), "p10": 1e3 * s[int(0.1 * (len(s) - 1))],
            "p90": 1e3 * s[int(0.9 * (len(s) - 1))]}


def mean_and_se(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and its standard error (None under 2 values)."""
    if not values:
        return None, None
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None)


def compare(row: dict, other: dict) -> dict:
    """``row`` against ``other``: the tokens/s ratio (median of per-repeat ratios), the per-repeat range, the
    rounds' 95% interval, and the verdict: ``faster``, ``slower``, ``within noise`` or ``cannot tell``."""
    mine, theirs = row["tokens_per_second_per_repeat"], other["tokens_per_second_per_repeat"]
    ratios = [a / b for a, b in zip(mine, theirs) if b > 0]
    out: dict = {"method": row["method"], "against": other["method"],
                 "ratio": statistics.median(ratios) if ratios else None,
                 "repeat_range": [min(ratios), max(ratios)] if len(ratios) > 1 else None,
                 "rounds_ratio": None, "rounds_interval": None}
    a, b = row.get("decode_tokens_per_second"), other.get("decode_tokens_per_second")
    sa, sb = row.get("decode_rate_rel_se"), other.get("decode_rate_rel_se")
    if a and b and sa is not None and sb is not None:
        ratio, half = a / b, Z95 * math.hypot(sa, sb)
        out["rounds_ratio"] = ratio
        out["rounds_interval"] = [ratio * math.exp(-half), ratio * math.exp(half)]
    signs = [_side(*band) for band in (out["repeat_range"], out["rounds_interval"]) if band is not None]
    if not signs:
        out["verdict"] = "cannot tell"
    elif all(s == signs[0] for s in signs) and signs[0] != 0:
        out["verdict"] = "faster" if signs[0] > 0 else "slower"
    else:
        out["verdict"] = "within noise"
    return out


def _side(lo: float, hi: float) -> int:
    return 1 if lo > 1 else -1 if hi < 1 else 0


def comparisons(rows: list[dict]) -> dict:
    """Each method against ``ar`` and against the fastest method (highest median tokens/s)."""
    by_name = {r["method"]: r for r in rows}
    timed = [r for r in rows if r["tokens_per_second"] > 0]
    best = max(timed, key=lambda r: r["tokens_per_second"]) if timed else None
    plain = by_name.get("ar")
    out: dict = {"best": best["method"] if best else None, "against_ar": [], "against_best": []}
    for r in rows:
        if plain is not None and r is not plain:
            out["against_ar"].append(compare(r, plain))
        if best is not None and r is not best:
            out["against_best"].append(compare(r, best))
    return out


def verify_order_notes(rows: list[dict]) -> list[str]:
    """Where a round with more nodes verified faster than one with fewer: whether the gap is within the
    run-to-run noise of the verify times (their standard errors over runs) or beyond it."""
    costs = sorted((r for r in rows if r.get("verify_ms") is not None and r.get("nodes_per_verify")),
                   key=lambda r: r["nodes_per_verify"])
    notes = []
    for i, small in enumerate(costs):
        for big in costs[i + 1:]:
            if big["nodes_per_verify"] < small["nodes_per_verify"] + 0.5 or big["verify_ms"] >= small["verify_ms"]:
                continue
            gap = small["verify_ms"] - big["verify_ms"]
            what = (f"{big['method']} ({big['nodes_per_verify']:.1f} nodes) verified in {big['verify_ms']:.2f} ms, "
                    f"faster than {small['method']} ({small['nodes_per_verify']:.1f} nodes) in "
                    f"{small['verify_ms']:.2f} ms")
            se_small, se_big = small.get("verify_ms_se"), big.get("verify_ms_se")
            if se_small is None or se_big is None:
                notes.append(f"{what}: one run each, too short to tell (more prompts or --repeats)")
            elif gap <= Z95 * math.hypot(se_small, se_big):
                notes.append(f"{what}: within the run-to-run noise (± {Z95 * math.hypot(se_small, se_big):.2f} ms)")
            else:
                notes.append(f"{what}: beyond the run-to-run noise (± {Z95 * math.hypot(se_small, se_big):.2f} ms); "
                             "the node count alone does not set the verify cost here (attention path, context, or "
                             "drift the interleaving did not even out)")
    return notes


def comparison_lines(comps: dict) -> str:
    """Markdown: the fastest method, then one line per comparison with its verdict and the noise behind it."""
    if comps["best"] is None:
        return ""
    real = [c["method"] for c in comps["against_best"] if c["verdict"] == "slower"]
    tied = [c["method"] for c in comps["against_best"] if c["verdict"] != "slower"]
    head = (f"\nFastest here: **{comps['best']}** (highest median tokens/s). "
            + (f"Slower beyond the noise: {', '.join(real)}. " if real else "")
            + (f"Not told apart from it: {', '.join(tied)}." if tied else "Every other method is slower beyond the "
               "noise.") + "\n")
    parts = [head]
    sections = [("Against plain decoding (ar)", "against_ar"), (f"Against the fastest ({comps['best']})",
                                                                  "against_best")]
    if comps["best"] == "ar":
        sections = [("Against plain decoding (ar), the fastest", "against_ar")]
    for title, key in sections:
        if comps[key]:
            parts.append(f"\n{title}:\n\n" + "\n".join(f"- {_line(c)}" for c in comps[key]) + "\n")
    return "".join(parts)


def _line(c: dict) -> str:
    ratio = "–" if c["ratio"] is None else f"{c['ratio']:.3f}x"
    noise = []
    if c["repeat_range"] is not None:
        noise.append(f"repeats {c['repeat_range'][0]:.3f}–{c['repeat_range'][1]:.3f}")
    if c["rounds_interval"] is not None:
        lo, hi = c["rounds_interval"]
        noise.append(f"rounds {c['rounds_ratio']:.3f}x, 95% {lo:.3f}–{hi:.3f}")
    verdict = {"faster": "faster, beyond the noise", "slower": "slower, beyond the noise",
               "within noise": "within the noise", "cannot tell": "cannot tell (no repeats, no round times)"}
    return (f"{c['method']} vs {c['against']}: {ratio}"
            + (f" ({'; '.join(noise)})" if noise else "") + f": {verdict[c['verdict']]}")
