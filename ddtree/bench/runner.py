"""``Bench``: every method on every prompt in every repeat, interleaved, and the lossless check.

The order rotates per prompt, so machine drift lands on all methods alike. The warm-up before the clock
starts is one of :data:`WARMUPS`: ``full`` (each method once, ``auto`` in full, so it has learned the round
costs), ``short`` (what a new user meets: a fresh generator per method and repeat, one short call, then the
timed ones) or ``none``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ddtree.bench.methods import (
    STAGES,
    Method,
    _proposer,
    autoregressive,
    hf_prompt_lookup,
)
from ddtree.bench.prompts import Prompt
from ddtree.core.sampling import SamplingConfig
from ddtree.core.tree import DraftTree
from ddtree.targets import cpu_linear


@dataclass
class Run:
    """One generate call: what the tables and the lossless check need."""

    method: str
    prompt: str
    repeat: int
    new_tokens: int
    seconds: float
    acceptance: list[int]
    stage_seconds: dict[str, float]
    budgets: list[int]
    tokens: list[int] = field(repr=False)
    category: str = ""
    accepted_by_source: dict[str, int] | None = None
    rank: int = 0  # the data-parallel rank that ran it: tokens/s add up over ranks
    nodes_per_depth: list[int] = field(default_factory=list)  # draft nodes at depth 1, 2, ... summed over rounds
    round_seconds: list[float] = field(default_factory=list)  # each round after the prefill (plain: each step)
    round_tokens: list[int] = field(default_factory=list)  # the tokens each of those rounds committed
    reasons: list[str] = field(default_factory=list)  # each tree round's reason for its budget (stats.reasons)


WARMUPS = ("full", "short", "none")
SHORT_WARMUP_TOKENS = 16  # the new tokens of a short warm-up call


def warmup_mode(warmup: bool | str) -> str:
    """``True`` / ``False`` (the older flag) as ``"full"`` / ``"none"``; a name checked against :data:`WARMUPS`."""
    if isinstance(warmup, bool):
        return "full" if warmup else "none"
    if warmup not in WARMUPS:
        raise ValueError(f"warm-up must be one of {', '.join(WARMUPS)}, got {warmup!r}")
    return warmup


class Bench:
    """Runs methods on prompts with one target and drafter; ``generators`` holds one per builder and proposer,
    shared by every repeat; a ``short`` warm-up puts a new one per tree method in ``fresh`` each repeat."""

    def __init__(self, generator, methods: list[Method], *, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 stop_token_ids: Iterable[int] = ()):
        from ddtree.generation.generator import SpeculativeGenerator

        self.base = generator
        self.methods = methods
        self.max_new_tokens = max_new_tokens
        self.sampling = SamplingConfig(temperature, top_k, top_p)
        self.seed = seed
        self.stops = frozenset(int(t) for t in stop_token_ids)
        self.depth = generator.drafter.block_size - 1
        self.generators: dict[tuple[str, str], SpeculativeGenerator] = {}
        for m in methods:
            if m.kind == "tree" and (m.builder, m.proposer) not in self.generators:
                self.generators[(m.builder, m.proposer)] = self.new_generator(m)
        self.fresh: dict[str, SpeculativeGenerator] = {}  # by method name: this repeat's own (short warm-up)
        self.policies: dict[str, dict | None] = {}

    def new_generator(self, m: Method):
        """A generator for tree method ``m`` on the shared models: nothing learned yet (``auto``'s round costs
        live on the generator, in ``learned``)."""
        from ddtree.generation.generator import SpeculativeGenerator

        return SpeculativeGenerator(self.base.target, _proposer(self.base, m.proposer), tree_budget=0,
                                    builder=m.builder, attention=self.base.backend, prompt_lookup=False)

    def generator(self, m: Method):
        """The generator tree method ``m`` runs on: its fresh one under a short warm-up, else the shared one."""
        return self.fresh[m.name] if m.name in self.fresh else self.generators[(m.builder, m.proposer)]

    def budget(self, m: Method) -> int | str:
        return self.depth if m.budget is None else m.budget

    def run_one(self, m: Method, prompt: Prompt, repeat: int, max_new_tokens: int | None = None,
                record_trees: bool = False):
        """One generate call; returns the :class:`Run` and the round records (when asked)."""
        device = self.base.target.get_input_embeddings().weight.device
        ids = torch.tensor([prompt.input_ids], dtype=torch.long, device=device)
        n = max_new_tokens or self.max_new_tokens
        seed = self.seed + repeat
        if m.name == "hf_lookup":
            t0 = time.perf_counter()
            tokens = hf_prompt_lookup(self.base.target, ids, n, self.stops)
            return Run(m.name, prompt.id, repeat, len(tokens), time.perf_counter() - t0, [], {}, [], tokens,
                       prompt.category), []
        if m.kind == "ar":
            stock = cpu_linear.suspended(self.base.target) if m.name == "ar_stock" else contextlib.nullcontext()
            with stock:
                t0 = time.perf_counter()
                tokens, stages, steps = autoregressive(self.base.target, ids, n, self.sampling, seed, self.stops)
            return Run(m.name, prompt.id, repeat, len(tokens), time.perf_counter() - t0, [], stages, [], tokens,
                       prompt.category, round_seconds=steps, round_tokens=[1] * len(steps)), []
        gen = self.generator(m)
        clock = RoundClock()
        out = gen.generate(  # every round's tree is kept, for the per-depth node counts
            ids, max_new_tokens=n, temperature=self.sampling.temperature, top_k=self.sampling.top_k,
            top_p=self.sampling.top_p, stop_token_ids=self.stops, tree_budget=self.budget(m), seed=seed,
            record_trees=True, streamer=clock,
        )
        s = out.stats
        if s.budget_policy is not None:
            self.policies[m.name] = s.budget_policy
        stages = {k: v for k, v in s.seconds.items() if k in STAGES or k == "prefill"}
        rounds = out.row_rounds[0]
        run = Run(m.name, prompt.id, repeat, s.new_tokens, s.total_seconds, list(out.row_acceptance[0]),
                  stages, list(s.budgets), out.new_tokens[0].tolist(), prompt.category, s.accepted_by_source,
                  nodes_per_depth=nodes_per_depth(rounds, self.depth), round_seconds=clock.round_seconds(),
                  round_tokens=clock.tokens[1:], reasons=list(s.reasons))
        return run, rounds if record_trees else []

    def run(self, prompts: list[Prompt], repeats: int = 3, warmup: bool | str = "full", progress: bool | None = None,
            trees_path: Path | None = None) -> list[Run]:
        """All methods on all prompts, ``repeats`` times, interleaved; trees of repeat 0 go to ``trees_path``.
        ``warmup``: one of :data:`WARMUPS` (``True`` / ``False``: ``full`` / ``none``); ``progress``: a bar on
        stderr (``None``: only where stderr is a terminal, so a log file gets no bar)."""
        mode = warmup_mode(warmup)
        if mode == "full":
            self.warmup(prompts)
        bar = _Progress(len(self.methods) * len(prompts) * repeats, enabled=progress)
        runs: list[Run] = []
        tree_file = open(trees_path, "w") if trees_path is not None else None
        try:
            for r in range(repeats):
                if mode == "short":
                    self.short_warmup(prompts[0], r)
                for p_i, prompt in enumerate(prompts):
                    shift = (r * len(prompts) + p_i) % len(self.methods)
                    for m in self.methods[shift:] + self.methods[:shift]:
                        record = tree_file is not None and r == 0 and m.kind == "tree"
                        run, rounds = self.run_one(m, prompt, r, record_trees=record)
                        runs.append(run)
                        if record:
                            write_rounds(tree_file, m.name, prompt.id, rounds)
                        bar.update(f"{m.name} {run.new_tokens / max(run.seconds, 1e-9):.1f} tok/s")
        finally:
            self.fresh = {}
            bar.close()
            if tree_file is not None:
                tree_file.close()
        return runs

    def warmup(self, prompts: list[Prompt]) -> None:
        """Untimed: a short run of each method; ``auto`` runs in full on the longest prompt so that its
        verify profiles (one per context bucket) are taken before the clock starts."""
        longest = max(prompts, key=lambda p: len(p.input_ids))
        for m in self.methods:
            full = m.budget == "auto"
            self.run_one(m, longest if full else prompts[0], 0, None if full else min(16, self.max_new_tokens))

    def short_warmup(self, prompt: Prompt, repeat: int) -> None:
        """Untimed, before repeat ``repeat``: a new generator per tree method, then one short call of each method
        on ``prompt``, as a user's first call would be; the repeat's calls then learn only from there."""
        self.fresh = {m.name: self.new_generator(m) for m in self.methods if m.kind == "tree"}
        for m in self.methods:
            self.run_one(m, prompt, repeat, min(SHORT_WARMUP_TOKENS, self.max_new_tokens))


class RoundClock:
    """A streamer (``put`` / ``end``) that notes when each round's tokens arrive: the prompt comes first, then
    the prefill's token, then one put per round. The tokens are host ints by then, so the round has finished
    on any device."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.stamps.append(time.perf_counter())
        self.tokens.append(int(value.numel()))

    def end(self) -> None:
        pass

    def round_seconds(self) -> list[float]:
        """Seconds between one round's tokens and the next's (the first: the prefill's token)."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


def nodes_per_depth(rounds, depth: int) -> list[int]:
    """Draft nodes at depth 1, 2, ... (at least ``depth`` entries) summed over ``rounds`` (round records)."""
    counts = [0] * depth
    for rec in rounds:
        per_depth = torch.bincount(rec.tree.depths[0].cpu()).tolist()[1:]  # depth 0 is the root
        counts += [0] * (len(per_depth) - len(counts))
        for d, c in enumerate(per_depth):
            counts[d] += c
    return counts


def write_rounds(f, method: str, prompt: str, rounds) -> None:
    """One JSON line per round: the tree (``DraftTree.to_dict``), the accepted node path and the bonus."""
    for i, rec in enumerate(rounds):
        f.write(json.dumps({
            "method": method, "prompt": prompt, "round": i, "start": rec.start,
            "tree": rec.tree.to_dict(), "accepted": rec.accepted, "bonus": rec.bonus,
        }) + "\n")


def load_rounds(path: str | Path) -> list[dict]:
    """Rows written by ``--save-trees`` with ``tree`` turned back into a :class:`DraftTree`
    (``row["tree"].to_networkx()`` for a graph)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            row["tree"] = DraftTree.from_dict(row["tree"])
            rows.append(row)
    return rows


def lossless_check(runs: list[Run]) -> dict[str, dict]:
    """Per method: how many runs equal the ``ar`` run of the same prompt and repeat, token for token."""
    ref = {(r.prompt, r.repeat): r.tokens for r in runs if r.method == "ar"}
    out: dict[str, dict] = {}
    for r in runs:
        if r.method == "ar":
            continue
        row = out.setdefault(r.method, {"runs": 0, "equal": 0, "first_mismatch": None})
        want = ref.get((r.prompt, r.repeat))
        if want is None:
            continue
        row["runs"] += 1
        if r.tokens == want:
            row["equal"] += 1
        elif row["first_mismatch"] is None:
            at = next((i for i, (a, b) in enumerate(zip(r.tokens, want)) if a != b), min(len(r.tokens), len(want)))
            row["first_mismatch"] = {"prompt": r.prompt, "repeat": r.repeat, "token_index": at}
    for row in out.values():
        row["lossless"] = row["runs"] > 0 and row["equal"] == row["runs"]
    return out


class _Progress:
    """tqdm when it is installed, else a line every tenth of the way; silent when disabled. ``enabled=None``:
    only where stderr is a terminal (a bar redrawn into a log file is thousands of lines)."""

    def __init__(self, total: int, enabled: bool | None = None):
        if enabled is None:
            enabled = bool(getattr(sys.stderr, "isatty", lambda: False)())
        self.total, self.done, self.enabled = total, 0, enabled
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, note: str = "") -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(note)
            self.bar.update(1)
        elif self.enabled and (self.done == self.total or self.done % max(1, self.total // 10) == 0):
            print(f"[ddtree-bench] {self.done}/{self.total} {note}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
