"""``diagnose``: config check, reference profile, fault signatures and, given an engine's figures, a verdict."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ddtree.apps.doctor.config_check import ConfigReport, check_config, read_raw_config
from ddtree.apps.doctor.engine_logs import EngineProfile
from ddtree.apps.doctor.faults import FAULTS, FAULTS_BY_NAME, Pair, Skip
from ddtree.apps.doctor.profile import (
    Profile,
    accepted_counts,
    distance,
    encode_prompts,
    load_prompts,
    noise,
    paired,
    profile_from_counts,
    replay_counts,
    target_hidden_states,
)

PAIRED_Z = 3.0  # a paired loss this many standard errors above zero is a clear signature
MIN_DRAFTS = 100  # fewer drafts behind a profile: its per-position rates are uncertain by more than ~0.05

REFERENCE = "reference"


@dataclass
class Ranked:
    name: str
    title: str
    mean: float
    distance: float


@dataclass
class DoctorReport:
    """Everything the doctor found; ``to_json`` writes it, ``render`` prints it."""

    target: str
    drafter: str
    block_size: int
    prompts: int
    max_new_tokens: int
    config: ConfigReport
    reference: Profile
    trees: list[Profile] = field(default_factory=list)
    signatures: list[Profile] = field(default_factory=list)
    engine: EngineProfile | None = None
    ranking: list[Ranked] = field(default_factory=list)
    verdict: str = ""
    caveats: list[str] = field(default_factory=list)  # where the evidence behind the verdict is thin
    seconds: float = 0.0
    replay_tokens: int = 0  # tokens per prompt of the reference run the paired comparisons replay

    @property
    def chain_length(self) -> int:
        return self.block_size - 1

    def signature(self, name: str) -> Profile:
        return next(p for p in [self.reference, *self.signatures] if p.name == name)

    def distinct(self, name: str) -> bool:
        """Whether the fault's profile stands clear of the reference: more than twice the sampling noise
        of the two apart, or a paired loss at the reference's own rounds of more than ``PAIRED_Z`` standard
        errors. One that does neither is harmless on this pair, or needs more prompts to show."""
        return distinct(self.reference, self.signature(name))

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))


class Progress:
    """A one-line progress bar on stderr (``enabled=False``: silent)."""

    def __init__(self, total: int, enabled: bool = True, stream=None, width: int = 30):
        self.total, self.done, self.enabled, self.width = max(total, 1), 0, enabled, width
        self.stream = stream if stream is not None else sys.stderr
        self.label = ""

    def step(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        self.show()

    def show(self) -> None:
        if not self.enabled:
            return
        filled = int(self.width * self.done / self.total)
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                          f"{self.label:<28.28}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _load(target: str | None, drafter: str | None, dtype: torch.dtype, device: str = "cpu"):
    from ddtree.generation.generator import SpeculativeGenerator
    from ddtree.loading.pretrained import default_drafter_dir, smollm2_path

    if (target is None) != (drafter is None):
        raise ValueError("give the target and the drafter together (or neither, for the default pair)")
    target_path = str(smollm2_path()) if target is None else str(target)
    drafter_path = str(default_drafter_dir()) if drafter is None else str(drafter)
    # Engines run the drafter over the full vocabulary (they do not read draft_vocab.safetensors).
    gen = SpeculativeGenerator.from_pretrained(target_path, drafter_path, dtype=dtype, draft_vocab=None, device=device,
                                               prompt_lookup=False)
    return gen, target_path, drafter_path


def distinct(reference: Profile, signature: Profile) -> bool:
    if signature.mean is None or reference.mean is None:
        return False
    if signature.paired is not None and signature.paired.gap > 0 and signature.paired.z > PAIRED_Z:
        return True
    gap = distance(reference.mean, reference.per_position, signature)
    return gap > 2 * math.hypot(noise(reference), noise(signature))


def rank(engine: EngineProfile, profiles: Sequence[Profile]) -> list[Ranked]:
    rates = engine.per_position
    out = [Ranked(p.name, p.title, p.mean, distance(engine.mean_acceptance_length, rates, p))
           for p in profiles if p.mean is not None]
    return sorted(out, key=lambda r: r.distance)


def verdict(report: DoctorReport) -> str:
    """The finding in plain words: the closest signature and what a correct integration gives, then a caveat
    for each way its evidence is thin (also kept in ``report.caveats``)."""
    finding = _finding(report)
    report.caveats = caveats(report) if report.engine is not None else []
    return "\n".join([finding, *(f"Caveat: {c}" for c in report.caveats)]) if finding else finding


def caveats(report: DoctorReport) -> list[str]:
    """Why the ranking may not hold, each with how much to enlarge the run: a reference (or engine) profile on
    few drafts, the two closest profiles apart by less than the standard error of their gap, and engine log
    lines whose printed counts contradict each other."""
    out = []
    ref, eng = report.reference, report.engine
    if ref.mean is not None and ref.drafts < MIN_DRAFTS:
        more = MIN_DRAFTS / max(ref.drafts, 1)
        out.append(f"the correct integration's profile rests on {ref.drafts} drafts ({report.prompts} prompts x "
                   f"{report.max_new_tokens} new tokens), so its per-position rates are uncertain by about "
                   f"{noise(ref):.3f}; {MIN_DRAFTS} drafts or more need about {more:.1f}x the run "
                   f"(--num-prompts {math.ceil(report.prompts * more)}, or --max-new-tokens "
                   f"{math.ceil(report.max_new_tokens * more)}).")
    if eng is not None and eng.num_drafts is not None and eng.num_drafts < MIN_DRAFTS:
        out.append(f"the engine's figures rest on {eng.num_drafts} drafts: log a longer engine run "
                   f"({MIN_DRAFTS} drafts or more).")
    if len(report.ranking) > 1:
        first, second = report.ranking[0], report.ranking[1]
        se = math.hypot(noise(report.signature(first.name)), noise(report.signature(second.name)))
        gap = second.distance - first.distance
        if se > 0 and gap < se:
            more = (2 * se / gap) ** 2 if gap > 0 else math.inf
            size = ("no run size separates them: their profiles are the same here" if not math.isfinite(more) else
                    f"about {more:.0f}x the drafts (--num-prompts {math.ceil(report.prompts * more)}, or "
                    f"--max-new-tokens {math.ceil(report.max_new_tokens * more)}) would put the gap at 2 standard "
                    "errors")
            out.append(f"{first.name} and {second.name} are {gap:.3f} apart in distance to the engine, less than "
                       f"the standard error of that gap ({se:.3f}): these prompts cannot tell them apart; {size}.")
    for line in eng.contradictions if eng is not None else []:
        out.append(f"the engine log's {line} (these cannot all hold: the profile uses the counts, mean "
                   f"{eng.mean_acceptance_length:.2f}); check that the line is whole and from one run.")
    return out


def _finding(report: DoctorReport) -> str:
    eng, ref = report.engine, report.reference
    if eng is None:
        return ""
    if not report.ranking:
        return "no profile ran, so there is nothing to compare the engine with"
    lines = []
    k = report.chain_length
    if eng.per_position is not None and len(eng.per_position) != k:
        lines.append(f"Note: the engine drafts {len(eng.per_position)} tokens per step, this drafter's block gives "
                     f"{k} (block_size {report.block_size}); compared on the first "
                     f"{min(k, len(eng.per_position))} positions. Set num_speculative_tokens = {k}.")
    best = report.ranking[0]
    shown = _rates(eng.per_position) if eng.per_position else "no per-position rates"
    head = f"The engine's mean acceptance length is {eng.mean_acceptance_length:.2f} ({shown})"
    if best.name == REFERENCE:
        lines.append(f"{head}: that matches a correct integration, which gives {ref.mean:.2f} here "
                     f"(distance {best.distance:.3f}). The integration looks right; low acceptance, if any, is "
                     "the drafter's own on these prompts.")
        return "\n".join(lines)
    fault = FAULTS_BY_NAME.get(best.name)
    sig = report.signature(best.name)
    lines.append(f"{head}; a correct integration gives {ref.mean:.2f} here "
                 f"(per position {_rates(ref.per_position)}).")
    ref_d = next((r.distance for r in report.ranking if r.name == REFERENCE), math.inf)
    if not report.distinct(best.name):
        lines.append(f"The closest fault, {best.title}, gives {sig.mean:.2f}, within sampling noise of the correct "
                     "integration on these prompts: the figures do not point at a known fault. Run more prompts "
                     "(--num-prompts, --max-new-tokens) or compare the engine's prompts and sampling settings.")
        return "\n".join(lines)
    lines.append(f"Closest fault: {best.title}. Injected into ddtree it gives {sig.mean:.2f} "
                 f"(per position {_rates(sig.per_position)}; distance {best.distance:.3f}, the correct "
                 f"integration's {ref_d:.3f}).")
    close = [r for r in report.ranking[1:] if r.name != REFERENCE and report.distinct(r.name)
             and r.distance <= 4 * best.distance + 0.02 and r.distance < ref_d / 2]
    groups = list(dict.fromkeys(FAULTS_BY_NAME[r.name].group for r in [best, *close] if r.name in FAULTS_BY_NAME))
    if close:
        lines.append("Nearly as close: " + "; ".join(f"{r.title} ({r.mean:.2f}, distance {r.distance:.3f})"
                                                     for r in close) + ".")
        where = (f"all in one part of the integration: {groups[0]}" if len(groups) == 1
                 else "in different parts of the integration: " + ", ".join(groups))
        lines.append(f"These faults look alike ({where}); check each: "
                     + "; ".join(FAULTS_BY_NAME[r.name].check for r in [best, *close] if r.name in FAULTS_BY_NAME)
                     + ".")
    elif fault is not None:
        lines.append(f"Check: {fault.check}.")
    return "\n".join(lines)


def _z_text(z: float) -> str:
    return f"{z:.1f}" if math.isfinite(z) else "inf"


def _rates(rates: Sequence[float] | None) -> str:
    return ", ".join(f"{r:.3f}" for r in rates or [])


def diagnose(target: str | None = None, drafter: str | None = None, *, prompts: str | None = None,
             num_prompts: int = 4, max_new_tokens: int = 32, replay_tokens: int | None = None,
             tree_budgets: Sequence[int] = (8,),
             faults: Sequence[str] | None = None, engine: EngineProfile | None = None,
             dtype: torch.dtype = torch.float32, progress: bool = True, generator=None,
             drafter_dir: str | None = None, stream=None, device: str = "cpu") -> DoctorReport:
    """Diagnose a target / DFlash drafter pair (paths; both ``None``: the default pair).

    ``generator`` (with ``drafter_dir``) runs on an already-loaded pair instead of
    loading. ``faults``: names from :data:`~ddtree.apps.doctor.faults.FAULTS` (default all).
    ``engine``: what an engine reported (:func:`~ddtree.apps.doctor.engine_logs.parse_engine_log`
    or :func:`~ddtree.apps.doctor.engine_logs.profile_from_figures`), to rank the signatures against.

    Every profile runs ``max_new_tokens`` per prompt. ``replay_tokens`` (default: the same) is the length
    of the reference run whose rounds each fault is replayed at (:func:`~ddtree.apps.doctor.profile.replay_counts`):
    a replay costs a fraction of a free run, so a longer one buys the paired comparison its standard errors
    (they shrink with the square root of its rounds) at one longer reference run's cost.
    """
    t0 = time.perf_counter()
    loaded_here = generator is None
    if loaded_here:
        generator, target_path, drafter_dir = _load(target, drafter, dtype, device)
    else:
        if drafter_dir is None:
            raise ValueError("with a loaded generator, give drafter_dir (its directory holds config.json)")
        target_path = str(target or getattr(generator.target.config, "_name_or_path", "target"))
    raw = read_raw_config(drafter_dir)
    tok = generator.tokenizer
    config = check_config(raw, generator.target.config, tok)
    vocab = generator.target.get_input_embeddings().weight.shape[0]
    ids = encode_prompts(tok, load_prompts(prompts, num_prompts), vocab)
    block = int(generator.drafter.block_size)
    chain = block - 1
    names = [f.name for f in FAULTS] if faults is None else list(faults)
    unknown = [n for n in names if n not in FAULTS_BY_NAME]
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS_BY_NAME)}")
    replay_tokens = max_new_tokens if replay_tokens is None else int(replay_tokens)
    if replay_tokens < 2:
        raise ValueError(f"replay_tokens must be at least 2 (a round needs a true next token), got {replay_tokens}")
    longer = replay_tokens != max_new_tokens
    bar = Progress((1 + longer + len(tree_budgets) + len(names)) * len(ids), progress, stream)

    def run(gen, budget, builder, runs=None, tokens=max_new_tokens) -> list[int]:
        from ddtree.core.builders import resolve_builder

        gen.builder = resolve_builder(builder)
        return accepted_counts(gen, ids, budget, tokens, step=bar.step, runs=runs)

    bar.label = "reference chain"
    bar.show()
    t = time.perf_counter()
    runs: list = []
    reference = profile_from_counts(REFERENCE, "correct integration (ddtree)",
                                    run(generator, chain, "chain", None if longer else runs), chain)
    if longer:
        bar.label = f"reference, {replay_tokens} tokens"
        run(generator, chain, "chain", runs, replay_tokens)
    reference.seconds = time.perf_counter() - t
    trees = []
    for b in tree_budgets:
        bar.label = f"reference tree@{b}"
        trees.append(profile_from_counts(f"tree@{b}", f"DDTree, budget {b}", run(generator, b, "best_first"),
                                         chain, method=f"tree@{b}"))
    pair = Pair(generator.target, generator.drafter, Path(drafter_dir), raw, tok)
    # Every fault that leaves the target alone reads these: the drafter's layers and their neighbours.
    kept = sorted({min(max(int(i) + d, -1), pair.num_target_layers - 1)
                   for i in generator.drafter.target_layer_ids for d in (-1, 0, 1)})
    hidden = target_hidden_states(generator.target, runs, kept)
    ref_replay = replay_counts(generator.target, generator.drafter, runs, hidden)
    signatures = []
    for name in names:
        fault = FAULTS_BY_NAME[name]
        bar.label = name
        try:
            dr, hooks = fault.build(pair)
        except Skip as why:
            signatures.append(Profile(name, fault.title, skipped=str(why), check=fault.check))
            bar.step(len(ids))
            continue
        from ddtree.generation.generator import SpeculativeGenerator

        # A fault that changes the target does so inside its hooks.
        gen = SpeculativeGenerator(generator.target, dr, tree_budget=chain, builder="chain",
                                   attention=generator.backend, prompt_lookup=False)
        t = time.perf_counter()
        with hooks:
            counts = run(gen, chain, "chain")
            same = (isinstance(hooks, contextlib.nullcontext)
                    and set(getattr(dr, "target_layer_ids", kept)) <= set(kept))
            replayed = replay_counts(generator.target, dr, runs, hidden if same else None,
                                     own_tokens=fault.changes_target)
        note = getattr(dr, "fault_note", None)  # what a fault chose for this pair, e.g. the wrong token
        title = f"{fault.title} ({note})" if note else fault.title
        signatures.append(profile_from_counts(name, title, counts, chain, check=fault.check))
        signatures[-1].paired = paired(ref_replay, replayed)
        signatures[-1].seconds = time.perf_counter() - t
    bar.close()
    report = DoctorReport(target_path, str(drafter_dir), block, len(ids), max_new_tokens, config, reference,
                          trees, signatures, engine, replay_tokens=replay_tokens)
    if engine is not None:
        report.ranking = rank(engine, [reference, *signatures])
        report.verdict = verdict(report)
    report.seconds = time.perf_counter() - t0
    return report


# --------------------------------------------------------------------------- output


def render(report: DoctorReport) -> str:
    """The report as terminal text: config findings, the profile table, the verdict."""
    out = [f"target:  {report.target}", f"drafter: {report.drafter}",
           f"prompts: {report.prompts}, {report.max_new_tokens} new tokens each, greedy; "
           f"engines run a chain of block_size - 1 = {report.chain_length}", "", "== config check"]
    section = None
    for f in report.config.findings:
        if f.section != section:
            section = f.section
            out.append(f"  [{section}]")
        mark = {"ok": "ok  ", "info": "info", "warn": "WARN", "error": "ERR "}[f.status]
        out.append(f"    {mark} {f.name:<24} {f.value:<22} {f.note}")
    if not report.config.unknown_keys:
        out.append("  no unknown keys")
    k = report.chain_length
    out += ["", "== acceptance profiles (vLLM's definitions: mean = 1 + accepted/drafts; position k = drafts "
            "with their first k tokens accepted / drafts)"]
    head = f"  {'profile':<19}{'mean':>6}{'drafts':>8}  " + " ".join(f"{'p' + str(i + 1):>6}" for i in range(k))
    if report.engine is not None:
        head += f"{'dist':>8}"
    head += "   paired: lost/round (z), nats/position (z), drafts changed"
    rounds = next((p.paired.rounds for p in report.signatures if p.paired is not None), 0)
    if rounds:
        out.append(f"  (paired: each fault replayed at the reference's {rounds} rounds, "
                   f"{report.replay_tokens or report.max_new_tokens} tokens per prompt)")
    out.append(head)
    dist = {r.name: r.distance for r in report.ranking}

    def row(name, p: Profile | None = None, mean=None, rates=None, drafts=""):
        if p is not None and p.skipped:
            return f"  {name:<19}{'-':>6}{'':>8}  skipped: {p.skipped}"
        mean = p.mean if p is not None else mean
        rates = p.per_position if p is not None else (rates or [])
        drafts = p.drafts if p is not None else drafts
        cells = " ".join(f"{r:>6.3f}" for r in rates[:k]) + " " * (7 * max(0, k - len(rates)))
        line = f"  {name:<19}{mean:>6.2f}{drafts!s:>8}  {cells}"
        if report.engine is not None and name in dist:
            line += f"{dist[name]:>8.3f}"
        return line

    out.append(row(report.reference.name, report.reference))
    for p in report.trees:
        out.append(row(p.name, p))
    for p in report.signatures:
        line = row(p.name, p)
        if p.paired is not None and p.mean is not None:
            if report.engine is not None and p.name not in dist:
                line += " " * 8
            line += (f"   {p.paired.gap:+.2f} ({_z_text(p.paired.z)}), {p.paired.nats:+.2f} "
                     f"({_z_text(p.paired.nats_z)}), {100 * p.paired.changed:.0f}%")
        out.append(line + ("" if p.mean is None or report.distinct(p.name) else "  (~ reference)"))
    if report.engine is not None:
        e = report.engine
        out.append(row(f"ENGINE ({e.engine})", mean=e.mean_acceptance_length, rates=e.per_position,
                       drafts=e.num_drafts if e.num_drafts is not None else ""))
        out += [f"  engine figures: {note}" for note in e.notes]
        out += ["", "== verdict", *("  " + line for line in report.verdict.splitlines())]
    else:
        out += ["", "no engine figures given (--engine-log, or --engine-mean / --engine-rates): nothing to compare"]
    out.append(f"\n({report.seconds:.0f} s)")
    return "\n".join(out)


def plot(report: DoctorReport, path) -> str:
    """Per-position acceptance of the reference, each signature and the engine, as a PNG; a message if
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'ddtree[plot]')"
    k = report.chain_length
    xs = list(range(1, k + 1))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, report.reference.per_position, "k-o", lw=2.5, label=f"correct ({report.reference.mean:.2f})")
    for p in report.signatures:
        if p.mean is not None:
            ax.plot(xs, p.per_position, "--", marker=".", alpha=0.7, label=f"{p.name} ({p.mean:.2f})")
    if report.engine is not None and report.engine.per_position:
        r = report.engine.per_position
        ax.plot(list(range(1, len(r) + 1)), r, "r-s", lw=2.5,
                label=f"engine ({report.engine.mean_acceptance_length:.2f})")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("drafts with the first k tokens accepted")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"
