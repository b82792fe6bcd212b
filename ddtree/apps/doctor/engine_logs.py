"""Parse serving-engine speculative-decoding log lines into one acceptance profile.

Stdlib only. ``python -m ddtree doctor`` compares the profile returned here with its reference and
fault-injected profiles.

Definitions (vLLM's, used for every engine):

* mean acceptance length = 1 + accepted / drafts  (includes the bonus token; 1.0 = nothing accepted)
* per-position rate k    = drafts whose first k draft tokens were all accepted / drafts
  (a prefix rate, so the list never increases; sum(rates) == accepted / drafts)

Formats recognised (see tests/fixtures/engine_logs/SOURCES.md for real lines and where they come from):

``vllm-v1``
    ``SpecDecoding metrics: ...`` from vllm/v1/spec_decode/metrics.py, any of its versions:
    current ``Mean acceptance length, Accepted throughput, Drafted throughput, Accepted: N tokens,
    Drafted: N tokens, Per-position acceptance rate: ..., Avg Draft acceptance rate: X%``, and the
    earlier orders that lead with ``Draft acceptance rate: X%`` (with or without throughputs).
    Counts are per logging interval, so lines are summed.
``vllm-v0``
    ``Speculative metrics: Draft acceptance rate: ..., System efficiency: ..., Number of speculative
    tokens: k, Number of accepted tokens: N, Number of draft tokens: N, Number of emitted tokens: N.``
    (vllm/engine/metrics.py + vllm/spec_decode/metrics.py; early builds print ``tokens tokens:``).
    Counts are cumulative since engine start, so the last line of each run is taken.
``sglang``
    ``Decode batch. ...`` / ``Decode batch, ...`` scheduler lines with ``accept len: X.XX`` (and,
    in newer builds, ``accept rate: X.XX``). Mean only.

Recognised but unusable on their own: the first vLLM V1 lines (v0.8.2-v0.8.4), which print
accepted/drafted token counts but no draft count (``Speculative metrics: Draft acceptance rate:
1.000, Number of accepted tokens: 66, Number of draft tokens: 66,`` and ``SpecDecoding metrics:
Draft acceptance rate: 100.0%, Accepted: 66 tokens, Drafted: 66 tokens``). With no draft count
there is no mean acceptance length.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "KNOWN_FORMATS",
    "EngineProfile",
    "parse_engine_log",
    "profile_from_figures",
    "recover_num_drafts",
]

KNOWN_FORMATS = (
    "vLLM V1 'SpecDecoding metrics: Mean acceptance length: ..., Accepted: N tokens, "
    "Drafted: N tokens, Per-position acceptance rate: ...' (vllm/v1/spec_decode/metrics.py)",
    "vLLM V0 'Speculative metrics: Draft acceptance rate: ..., System efficiency: ..., "
    "Number of speculative tokens: k, ..., Number of emitted tokens: N.' (vllm/engine/metrics.py)",
    "SGLang 'Decode batch ... accept len: X.XX[, accept rate: X.XX]' "
    "(python/sglang/srt/managers/scheduler_metrics_mixin.py)",
)


@dataclass
class EngineProfile:
    """Acceptance profile of one engine run.

    ``per_position`` is None where the format has no per-position rates (vLLM V0, SGLang,
    or a user who typed only a mean). Counts are None where the format prints none (SGLang,
    typed figures). ``num_drafts`` is recovered, not printed, for vLLM V1 (see
    :func:`recover_num_drafts`). ``num_accepted`` always means prefix-accepted draft tokens
    (the vLLM V1 meaning), also for vLLM V0, whose own "accepted" count is different.
    """

    engine: str  # "vllm", "sglang" or "user"
    mean_acceptance_length: float
    per_position: list[float] | None
    num_drafts: int | None
    num_draft_tokens: int | None
    num_accepted: int | None
    lines_aggregated: int
    source_format: str  # "vllm-v1", "vllm-v0", "sglang" or "figures"
    notes: list[str] = field(default_factory=list)
    contradictions: list[str] = field(default_factory=list)  # lines whose printed figures disagree with each other

    @property
    def num_spec_tokens(self) -> int | None:
        """Draft length k, where the rates reveal it."""
        return None if self.per_position is None else len(self.per_position)


# --------------------------------------------------------------------------- regexes

_NUM = r"(?:nan|inf|-?\d+(?:\.\d+)?)"

_V1_MARK = re.compile(r"SpecDecoding metrics:(?P<body>.*)$")
_V1_MEAN = re.compile(r"Mean acceptance length:\s*(?P<v>" + _NUM + ")")
_V1_ACC = re.compile(r"Accepted:\s*(?P<v>\d+)\s*tokens")
_V1_DRAFTED = re.compile(r"Drafted:\s*(?P<v>\d+)\s*tokens")
_V1_RATES = re.compile(
    r"Per-position acceptance rate:\s*(?P<v>" + _NUM + r"(?:\s*,\s*" + _NUM + r")*)"
)

_SPEC_MARK = re.compile(r"Speculative metrics:(?P<body>.*)$")
_V0_K = re.compile(r"Number of speculative tokens:\s*(?P<v>\d+)")
_V0_ACC = re.compile(r"Number of accepted tokens:\s*(?P<v>\d+)")
_V0_DRAFT = re.compile(r"Number of draft tokens(?: tokens)?:\s*(?P<v>\d+)")
_V0_EMIT = re.compile(r"Number of emitted tokens(?: tokens)?:\s*(?P<v>\d+)")

_SGL_MARK = re.compile(r"Decode batch\b.*?\baccept len:\s*(?P<v>" + _NUM + ")")
_SGL_RUNNING = re.compile(r"#running-req:\s*(?P<v>\d+)")
_SGL_RATE = re.compile(r"\baccept rate:\s*(?P<v>" + _NUM + ")")


def _f(s: str) -> float:
    return float(s)


# --------------------------------------------------------------------------- draft count


def recover_num_drafts(
    accepted: int, drafted: int, mean: float | None, rates: Sequence[float] | None
) -> tuple[int, str]:
    """Recover the number of drafts behind one vLLM V1 ``SpecDecoding metrics`` line.

    vLLM V1 keeps ``num_drafts`` but never prints it: the line has ``Accepted`` and
    ``Drafted`` token counts, ``Mean acceptance length`` = 1 + accepted/drafts (``%.2f``) and
    per-position rates = accepted_at_pos/drafts (``%.3f``, one per speculative token, so
    their count is k). ``drafted / k`` is exact only when every draft is full length
    (EAGLE/MTP/DFlash usually; not n-gram or suffix decoding, whose drafts can be shorter).
    So: take every integer D that reproduces the printed, rounded mean and rates (each rate
    must be some integer count / D and those counts must sum to ``accepted``) and is at least
    ``drafted / k``; prefer ``drafted / k`` when it is among them, else the one closest to
    ``accepted / sum(rates)``. Returns (D, how) with how in ``exact-full-drafts``,
    ``rounding-consistent``, ``estimate`` (nothing fitted the rounding; nearest estimate) or
    ``assumed-full-drafts`` (nothing accepted, so only ``drafted / k`` says anything).
    """
    if drafted <= 0:
        return 0, "no-drafts"
    k = len(rates) if rates else 0
    lo = math.ceil(drafted / k) if k else 1
    full = drafted // k if k and drafted % k == 0 else None

    if accepted == 0:
        return (full if full is not None else lo), "assumed-full-drafts"

    ratio = None  # accepted / drafts, best estimate
    if rates and sum(rates) > 0:
        ratio = sum(rates)
    elif mean is not None and mean > 1:
        ratio = mean - 1

    # Range of D allowed by the rounded mean (%.2f -> half-width 0.005).
    if mean is not None and math.isfinite(mean):
        m_hi = mean - 1 + 0.005
        m_lo = mean - 1 - 0.005
        d_min = max(lo, math.floor(accepted / m_hi) if m_hi > 0 else lo)
        d_max = math.ceil(accepted / m_lo) if m_lo > 0 else None
    else:
        d_min, d_max = lo, None
    if d_max is None:  # mean too close to 1 to bound D from above: bound it with the rates
        if ratio:
            d_max = math.ceil(accepted / max(ratio - 0.0005 * max(k, 1), 1e-9)) + 1
        else:
            d_max = max(d_min, drafted)
    d_max = min(d_max, max(d_min, 10 * drafted + 10))  # keep the scan finite

    def fits(d: int) -> bool:
        if mean is not None and math.isfinite(mean):
            if abs((1 + accepted / d) - mean) > 0.005 + 1e-9:
                return False
        if rates:
            lo_sum = hi_sum = 0
            for r in rates:
                c_lo = math.ceil((r - 0.0005) * d - 1e-9)
                c_hi = math.floor((r + 0.0005) * d + 1e-9)
                c_lo, c_hi = max(c_lo, 0), min(c_hi, d)
                if c_lo > c_hi:
                    return False
                lo_sum += c_lo
                hi_sum += c_hi
            if not lo_sum <= accepted <= hi_sum:
                return False
        return True

    feasible = [d for d in range(d_min, d_max + 1) if fits(d)]
    if full is not None and full in feasible:
        return full, "exact-full-drafts"
    target = accepted / ratio if ratio else float(lo)
    if feasible:
        return min(feasible, key=lambda d: (abs(d - target), d)), "rounding-consistent"
    return max(lo, round(target)), "estimate"


# --------------------------------------------------------------------------- records


@dataclass
class _V1Line:
    accepted: int
    drafted: int
    mean: float | None
    rates: list[float] | None
    drafts: int
    how: str
    contradiction: str | None = None
    lineno: int = 0


# how each line's draft count was recovered, in words (the tags are recover_num_drafts')
RECOVERED = {
    "exact-full-drafts": "drafted tokens / k (every draft full length), which reproduces the printed mean and rates",
    "rounding-consistent": "the count that reproduces the printed mean (and per-position rates, where printed) "
                           "after rounding (drafts of varying length, so drafted tokens / k does not)",
    "estimate": "accepted / sum(rates), an estimate: no count reproduces the printed figures",
    "assumed-full-drafts": "drafted tokens / k, assumed: nothing was accepted, so the mean and rates say nothing",
}


def contradiction(accepted: int, drafted: int, mean: float | None, rates: Sequence[float] | None,
                  drafts: int) -> str | None:
    """Why one line's printed counts cannot all be true at once (None when they agree within print rounding):
    accepted <= drafted tokens, drafts <= drafted <= k x drafts, mean = 1 + accepted / drafts (``%.2f``) and
    sum(rates) = accepted / drafts (``%.3f`` each)."""
    reasons = []
    k = len(rates) if rates else 0
    if accepted > drafted:
        reasons.append(f"{accepted} accepted of {drafted} drafted tokens")
    if drafts > 0 and mean is not None and math.isfinite(mean) and abs(1 + accepted / drafts - mean) > 0.005 + 1e-9:
        by_mean = f"about {accepted / (mean - 1):.0f} drafts" if mean > 1 else "nothing accepted"
        reasons.append(f"mean acceptance length {mean:.2f} means {by_mean}, while the {accepted} accepted tokens "
                       f"give {1 + accepted / drafts:.2f} over the {drafts} drafts that the "
                       + (f"{drafted} drafted tokens at k = {k} and the rates" if k else "drafted tokens") + " imply")
    if drafts > 0 and rates and abs(sum(rates) - accepted / drafts) > 0.0005 * k + 1e-9:
        reasons.append(f"the per-position rates sum to {sum(rates):.3f}, not accepted / drafts = "
                       f"{accepted / drafts:.3f}")
    if drafts > 0 and k and drafted > k * drafts:
        reasons.append(f"{drafted} drafted tokens are more than k = {k} per draft over {drafts} drafts")
    return "; ".join(reasons) or None


@dataclass
class _V0Line:
    k: int
    accepted_any: int
    draft_tokens: int
    emitted: int


@dataclass
class _SglLine:
    accept_len: float
    running: int | None
    accept_rate: float | None


def _parse_v1(body: str) -> _V1Line | None | str:
    acc = _V1_ACC.search(body)
    dr = _V1_DRAFTED.search(body)
    if not (acc and dr):
        return None
    mean_m = _V1_MEAN.search(body)
    rates_m = _V1_RATES.search(body)
    if mean_m is None:
        return "no-drafts-logged"  # v0.8.2-v0.8.4 V1 line: no draft count, no mean
    mean = _f(mean_m.group("v"))
    rates = [_f(x) for x in re.split(r"\s*,\s*", rates_m.group("v"))] if rates_m else None
    accepted, drafted = int(acc.group("v")), int(dr.group("v"))
    if rates is not None and not all(math.isfinite(r) for r in rates):
        rates = None
    drafts, how = recover_num_drafts(
        accepted, drafted, mean if math.isfinite(mean) else None, rates
    )
    return _V1Line(accepted, drafted, mean, rates, drafts, how,
                   contradiction(accepted, drafted, mean if math.isfinite(mean) else None, rates, drafts))


def _parse_speculative(body: str) -> _V0Line | None | str:
    k, acc, dt, em = (p.search(body) for p in (_V0_K, _V0_ACC, _V0_DRAFT, _V0_EMIT))
    if k and dt and em and acc:
        return _V0Line(int(k.group("v")), int(acc.group("v")), int(dt.group("v")), int(em.group("v")))
    if acc and dt:
        return "no-drafts-logged"  # first vLLM V1 format (v0.8.2): accepted/draft tokens only
    return None


def _parse_sglang(line: str) -> _SglLine | None:
    m = _SGL_MARK.search(line)
    if not m:
        return None
    run = _SGL_RUNNING.search(line)
    rate = _SGL_RATE.search(line)
    return _SglLine(
        _f(m.group("v")),
        int(run.group("v")) if run else None,
        _f(rate.group("v")) if rate else None,
    )


# --------------------------------------------------------------------------- aggregation


def _aggregate_v1(recs: list[_V1Line], notes: list[str]) -> EngineProfile:
    used = [r for r in recs if r.drafts > 0]
    skipped = len(recs) - len(used)
    if skipped:
        notes.append(f"{skipped} vLLM line(s) with no drafts in their interval were skipped")
    if not used:
        raise ValueError("vLLM 'SpecDecoding metrics' lines found, but every one reports 0 drafted tokens")
    drafts = sum(r.drafts for r in used)
    hows = sorted({r.how for r in used})
    notes.append(f"vLLM does not print its number of drafts; the {drafts} here are recovered per line, as "
                 + "; ".join(f"{RECOVERED.get(h, h)} ({sum(r.how == h for r in used)} line(s), {h})" for h in hows))
    contradictions = [f"line {r.lineno}: {r.contradiction}" for r in used if r.contradiction]
    accepted = sum(r.accepted for r in used)
    drafted = sum(r.drafted for r in used)

    per_position: list[float] | None
    with_rates = [r for r in used if r.rates]
    if len(with_rates) == len(used):
        ks = {len(r.rates) for r in used}  # type: ignore[arg-type]
        if len(ks) > 1:
            notes.append(f"lines disagree on the number of speculative tokens {sorted(ks)}; "
                         "missing positions counted as 0 accepted")
        kmax = max(ks)
        counts = [0.0] * kmax
        for r in used:
            for i, rate in enumerate(r.rates):  # type: ignore[arg-type]
                counts[i] += rate * r.drafts
        per_position = [c / drafts for c in counts]
    else:
        per_position = None
        notes.append("some vLLM lines carry no per-position rates; per_position left out")

    return EngineProfile(
        engine="vllm",
        mean_acceptance_length=1 + accepted / drafts,
        per_position=per_position,
        num_drafts=drafts,
        num_draft_tokens=drafted,
        num_accepted=accepted,
        lines_aggregated=len(used),
        source_format="vllm-v1",
        notes=notes,
        contradictions=contradictions,
    )


def _aggregate_v0(recs: list[_V0Line], notes: list[str]) -> EngineProfile:
    # Counters are cumulative since engine start; a drop means a restart (new run).
    runs: list[_V0Line] = []
    prev: _V0Line | None = None
    for r in recs:
        if prev is not None and (r.draft_tokens < prev.draft_tokens or r.emitted < prev.emitted
                                 or r.k != prev.k):
            runs.append(prev)
        prev = r
    if prev is not None:
        runs.append(prev)
    runs = [r for r in runs if r.draft_tokens > 0 and r.k > 0]
    if not runs:
        raise ValueError("vLLM V0 'Speculative metrics' lines found, but no draft tokens in them")
    if len(runs) > 1:
        notes.append(f"counters reset {len(runs) - 1} time(s) (engine restarts); runs summed")
    notes.append("vLLM V0 counters are cumulative: the last line of each run is used")
    notes.append("vLLM V0 'Number of accepted tokens' counts accepted tokens anywhere in a draft, "
                 "not only the accepted prefix; prefix-accepted = emitted - drafts is used instead")
    drafts = sum(r.draft_tokens // r.k for r in runs)
    draft_tokens = sum(r.draft_tokens for r in runs)
    emitted = sum(r.emitted for r in runs)
    accepted_prefix = emitted - drafts
    return EngineProfile(
        engine="vllm",
        mean_acceptance_length=emitted / drafts,
        per_position=None,
        num_drafts=drafts,
        num_draft_tokens=draft_tokens,
        num_accepted=accepted_prefix,
        lines_aggregated=len(recs),
        source_format="vllm-v0",
        notes=notes,
    )


def _aggregate_sglang(recs: list[_SglLine], notes: list[str]) -> EngineProfile:
    weights = [r.running if r.running is not None else 1 for r in recs]
    if sum(weights) <= 0:
        weights = [1] * len(recs)
    total = sum(weights)
    mean = sum(w * r.accept_len for w, r in zip(weights, recs)) / total
    if all(r.running is not None for r in recs):
        notes.append("SGLang lines print no draft counts; each line's 'accept len' is weighted by its "
                     "#running-req (each line covers the same number of decode steps, so the verify "
                     "count it averages over is about steps x running requests)")
    else:
        notes.append("SGLang lines print no draft counts; lines without #running-req weigh 1")
    notes.append("SGLang 'accept rate' is not used: its denominator differs between SGLang versions "
                 "and for tree drafts it is not a per-position prefix rate")
    return EngineProfile(
        engine="sglang",
        mean_acceptance_length=mean,
        per_position=None,
        num_drafts=None,
        num_draft_tokens=None,
        num_accepted=None,
        lines_aggregated=len(recs),
        source_format="sglang",
        notes=notes,
    )


def _no_match_error() -> ValueError:
    known = "\n  - ".join(KNOWN_FORMATS)
    return ValueError(
        "no speculative-decoding metrics line found in the log"
        + ". Known formats:\n  - " + known
        + "\nOr give the figures directly: profile_from_figures(mean=..., per_position=[...])."
    )


def parse_engine_log(text: str | Iterable[str]) -> EngineProfile:
    """Find every speculative-decoding metrics line in ``text`` and aggregate them.

    ``text`` is arbitrary log text (or an iterable of lines): timestamps, process prefixes
    such as ``(APIServer pid=1) INFO 05-12 10:11:12 [metrics.py:123]`` and unrelated lines
    are ignored. vLLM V1 lines are combined by their counts (per-position accepted counts =
    rate x drafts, summed, then divided by total drafts), never as a mean of means.
    Raises ValueError naming the known formats when nothing usable matches.
    """
    lines = text.splitlines() if isinstance(text, str) else [line.rstrip("\n") for line in text]
    v1: list[_V1Line] = []
    v0: list[_V0Line] = []
    sgl: list[_SglLine] = []
    no_drafts = 0
    for lineno, line in enumerate(lines, 1):
        m = _V1_MARK.search(line)
        if m:
            rec = _parse_v1(m.group("body"))
            if isinstance(rec, _V1Line):
                rec.lineno = lineno
                v1.append(rec)
            elif rec == "no-drafts-logged":
                no_drafts += 1
            continue
        m = _SPEC_MARK.search(line)
        if m:
            rec0 = _parse_speculative(m.group("body"))
            if isinstance(rec0, _V0Line):
                v0.append(rec0)
            elif rec0 == "no-drafts-logged":
                no_drafts += 1
            continue
        s = _parse_sglang(line)
        if s is not None:
            sgl.append(s)

    notes: list[str] = []
    if (v1 or v0) and sgl:
        raise ValueError("the log mixes vLLM and SGLang metrics lines; pass one engine's log at a time")
    if no_drafts:
        notes.append(f"{no_drafts} early vLLM V1 line(s) without a draft count were ignored")
    if v1:
        if v0:
            notes.append(f"{len(v0)} vLLM V0 line(s) ignored in favour of the V1 lines")
        return _aggregate_v1(v1, notes)
    if v0:
        return _aggregate_v0(v0, notes)
    if sgl:
        return _aggregate_sglang(sgl, notes)
    if no_drafts:
        raise ValueError(
            f"found {no_drafts} vLLM line(s) from v0.8.2-v0.8.4, which log accepted and drafted token "
            "counts but not the number of drafts, so the mean acceptance length cannot be recovered; "
            "upgrade vLLM (v0.8.5+ logs 'Mean acceptance length' and per-position rates), or read "
            "vllm:spec_decode_num_drafts from /metrics and use profile_from_figures()"
        )
    raise _no_match_error()


# --------------------------------------------------------------------------- typed figures


def profile_from_figures(
    mean: float | None = None,
    per_position: Sequence[float] | str | None = None,
) -> EngineProfile:
    """Build a profile from figures a user types (vLLM definitions, see module docstring).

    ``per_position`` may be a sequence or a string like ``"0.80, 0.62 0.41"``. With rates
    only, the mean is 1 + sum(rates). With both, they must agree within print rounding.
    """
    rates: list[float] | None = None
    if isinstance(per_position, str):
        parts = [p for p in re.split(r"[,\s]+", per_position.strip()) if p]
        try:
            rates = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"per_position: cannot read numbers from {per_position!r}") from None
    elif per_position is not None:
        rates = [float(r) for r in per_position]
    if rates is not None and not rates:
        rates = None

    notes: list[str] = []
    if rates is not None:
        for i, r in enumerate(rates):
            if not (math.isfinite(r) and 0.0 <= r <= 1.0):
                raise ValueError(f"per_position[{i}] = {r} is not a rate in [0, 1]")
        for i in range(1, len(rates)):
            if rates[i] > rates[i - 1] + 1e-9:
                raise ValueError(
                    f"per_position rises at position {i + 1} ({rates[i - 1]} -> {rates[i]}): "
                    "expected vLLM's prefix rates (drafts whose first k tokens were accepted / drafts), "
                    "which cannot rise; conditional per-step rates must be multiplied out first"
                )
    if mean is not None:
        mean = float(mean)
        if not math.isfinite(mean) or mean < 1.0:
            raise ValueError(
                f"mean acceptance length {mean} is below 1: vLLM's definition counts the bonus token "
                "(1 + accepted/drafts); if yours excludes it, add 1"
            )
        if rates is not None:
            implied = 1 + sum(rates)
            tol = 0.005 + 0.0005 * len(rates) + 1e-9
            if abs(mean + 1 - implied) <= tol:
                raise ValueError(f"mean {mean} disagrees with per_position, which imply 1 + sum = {implied:.4f} "
                                 "(off by about 1: does your mean exclude the bonus token? add 1)")
            if abs(mean - implied) > max(tol, 0.1 * (implied - 1) + 0.02):
                raise ValueError(
                    f"mean {mean} disagrees with per_position, which imply 1 + sum = {implied:.4f}: "
                    "give figures from the same run"
                )
            if abs(mean - implied) > tol:  # figures from neighbouring runs (a user typing a range's middle)
                notes.append(f"mean {mean} and per_position (1 + sum = {implied:.4f}) differ by more than print "
                             "rounding; the ranking uses the per-position rates")
    elif rates is not None:
        mean = 1 + sum(rates)
        notes.append("mean derived as 1 + sum(per_position)")
    else:
        raise ValueError("give mean, per_position, or both")

    if rates is not None:
        notes.append(f"k = {len(rates)} speculative tokens (from the number of rates)")
    return EngineProfile(
        engine="user",
        mean_acceptance_length=mean,
        per_position=rates,
        num_drafts=None,
        num_draft_tokens=None,
        num_accepted=None,
        lines_aggregated=0,
        source_format="figures",
        notes=notes,
    )
