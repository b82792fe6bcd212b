"""``python -m ddtree.bench``: tree width, depth and budget, measured end to end on one model pair.

Every method runs on every prompt in every repeat, interleaved (the order
rotates per prompt) so machine drift lands on all methods alike; tokens/s and
the speedup over ``ar`` (plain target decoding, run in the same loop) are
medians over repeats. Per method it reports tau (tokens per round) and its
spread, how often each depth is reached, seconds per stage, the budget trace of
``auto`` and whether the output equals ``ar`` token for token (greedy).

Methods (comma-separated; bare numbers extend the previous ``@`` list):
``ar``, ``chain`` (``chain@N``), ``best_first@16,32`` (``best_first@1-256``
means the powers of two from 1 to 256), ``beam@WxD``, ``auto`` and any builder
``module:function`` (``module:function@N`` for budget N). A ``+lookup`` suffix
(``best_first@8+lookup``) grafts a prompt-lookup branch into each tree;
``lookup`` drafts with prompt lookup alone (no model drafter); ``hf_lookup`` is
transformers' own prompt-lookup decoding (``prompt_lookup_num_tokens``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable, Sequence

import torch

from .. import cpu_linear, distributed
from ..cache import cache_kwargs, new_target_cache
from ..sampling import SamplingConfig, choose_tokens
from ..threads import thread_info
from ..tree import DraftTree

STAGES = ("draft", "tree_build", "mask", "verify", "commit")
DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "prompts.jsonl"


# --------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    """One row of the benchmark: ``kind`` is ``"ar"`` or ``"tree"``; ``budget`` None means the draft depth."""

    name: str
    kind: str = "tree"
    builder: str = "best_first"
    budget: int | str | None = None
    proposer: str = "drafter"  # "drafter", "lookup" (prompt lookup alone) or "merged" (drafter + lookup branch)


def _budget_list(text: str, spec: str) -> list[int]:
    """``"16"`` or ``"1-256"`` (powers of two from 1 to 256)."""
    if re.fullmatch(r"\d+", text):
        return [int(text)]
    m = re.fullmatch(r"(\d+)-(\d+)", text)
    if not m or int(m[1]) < 1 or int(m[1]) > int(m[2]):
        raise ValueError(f"bad budget {text!r} in method {spec!r}: use N or A-B (powers of two from A to B)")
    lo, hi = int(m[1]), int(m[2])
    out, b = [], 1
    while b <= hi:
        if b >= lo:
            out.append(b)
        b *= 2
    return out


def parse_methods(specs: str | Sequence[str], default_budget: int = 32) -> list[Method]:
    """Parse method specs; ``ar`` is always included (first) since speedups and the lossless check need it."""
    items: list[str] = []
    for spec in [specs] if isinstance(specs, str) else specs:
        items.extend(s.strip() for s in spec.split(",") if s.strip())
    methods: list[Method] = []
    last_tree: Method | None = None
    for item in items:
        merged = item.endswith("+lookup")
        item = item.removesuffix("+lookup")
        if re.fullmatch(r"\d+(-\d+)?", item):
            if last_tree is None or not isinstance(last_tree.budget, int):
                raise ValueError(f"bare budget {item!r} must follow a method with '@N' (e.g. best_first@16,32)")
            new = [_with_budget(last_tree, b) for b in _budget_list(item, item)]
        elif item == "ar":
            new = [Method("ar", kind="ar", builder="", budget=0)]
        elif item == "ar_stock":
            new = [Method("ar_stock", kind="ar", builder="", budget=0)]
        elif item == "hf_lookup":
            new = [Method("hf_lookup", kind="ar", builder="", budget=0)]
        elif item == "lookup":
            new = [Method("lookup", builder="chain", budget=None, proposer="lookup")]
        elif item == "auto":
            new = [Method("auto", builder="best_first", budget="auto")]
        elif item.startswith("beam@"):
            m = re.fullmatch(r"beam@(\d+)x(\d+)", item.lower())
            if not m or int(m[1]) < 1 or int(m[2]) < 1:
                raise ValueError(f"beam method must look like beam@4x8 (width x depth), got {item!r}")
            new = [Method(item.lower(), builder=item.lower(), budget=int(m[1]) * int(m[2]))]
        else:
            base, _, at = item.partition("@")
            if base == "chain":
                new = [Method("chain" if not at else f"chain@{b}", builder="chain", budget=int(b) if at else None)
                       for b in (_budget_list(at, item) if at else [0])]
            elif base == "best_first" or ":" in base:
                if ":" in base and not re.fullmatch(r"[\w.]+:\w+", base):
                    raise ValueError(f"custom builder must be module:function, got {item!r}")
                budgets = _budget_list(at, item) if at else [default_budget]
                new = [Method(f"{base}@{b}", builder=base, budget=b) for b in budgets]
            else:
                raise ValueError(
                    f"unknown method {item!r}: use ar, ar_stock, hf_lookup, lookup, chain, best_first@N, beam@WxD, "
                    "auto or module:function[@N], tree methods optionally with +lookup"
                )
        if merged:
            if any(m.kind != "tree" or m.proposer != "drafter" for m in new):
                raise ValueError(f"+lookup extends a tree method (chain, best_first@N, beam@WxD, auto), not {item!r}")
            new = [Method(m.name + "+lookup", m.kind, m.builder, m.budget, "merged") for m in new]
        for m in new:
            if m.name not in {x.name for x in methods}:
                methods.append(m)
        if new and new[-1].kind == "tree" and isinstance(new[-1].budget, int):
            last_tree = new[-1]
    if not any(m.name == "ar" for m in methods):
        methods.insert(0, Method("ar", kind="ar", builder="", budget=0))
    return methods


def _with_budget(m: Method, budget: int) -> Method:
    base = m.name.split("@")[0]
    suffix = "+lookup" if m.proposer == "merged" else ""
    return Method(f"{base}@{budget}{suffix}", kind=m.kind, builder=m.builder, budget=budget, proposer=m.proposer)


# --------------------------------------------------------------------- prompts


@dataclass
class Prompt:
    id: str
    input_ids: list[int]
    category: str = ""


def load_prompts(path: str | Path | None, tokenizer=None, vocab_size: int | None = None,
                 limit: int | None = None, per_category: int | None = None) -> list[Prompt]:
    """JSONL rows with ``messages`` (chat template), ``prompt`` (plain text) or ``input_ids``.

    ``per_category`` keeps the first N rows of each ``category`` (a cheap spread over
    the kinds of text). Without a tokenizer, text falls back to UTF-8 bytes modulo the
    vocabulary, enough to drive a tokenizer-less (random test) target.
    """
    path = Path(path) if path is not None else DEFAULT_PROMPTS
    prompts = []
    seen: dict[str, int] = {}
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if per_category is not None:
            cat = str(row.get("category", ""))
            seen[cat] = seen.get(cat, 0) + 1
            if seen[cat] > per_category:
                continue
        pid = str(row.get("id", i))
        if "input_ids" in row:
            ids = [int(t) for t in row["input_ids"]]
        elif "messages" in row or "prompt" in row:
            ids = _encode(row, tokenizer, vocab_size)
        else:
            raise ValueError(f"{path}:{i + 1}: a prompt row needs 'messages', 'prompt' or 'input_ids'")
        if not ids:
            raise ValueError(
                f"{path}:{i + 1}: prompt {pid!r} is empty after tokenization"
                + (" (the target's tokenizer encoded its text to no tokens: the target directory probably lacks "
                   "its tokenizer files, e.g. tokenizer.json; copy them there)" if tokenizer is not None
                   else ": give at least one token")
            )
        prompts.append(Prompt(pid, ids, str(row.get("category", ""))))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


def _encode(row: dict, tokenizer, vocab_size: int | None) -> list[int]:
    if tokenizer is not None:
        if "messages" in row and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
            return list(tokenizer(text, add_special_tokens=False).input_ids)
        text = row.get("prompt") or "\n".join(m["content"] for m in row["messages"])
        return list(tokenizer(text).input_ids)
    if vocab_size is None:
        raise ValueError("text prompts need a tokenizer (or a vocabulary size for the byte fallback)")
    text = row.get("prompt") or "\n".join(m["content"] for m in row["messages"])
    return [b % vocab_size for b in text.encode("utf-8")] or [0]


# --------------------------------------------------------------------- runs


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


@torch.inference_mode()
def autoregressive(target, input_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig,
                   seed: int, stops: frozenset[int]) -> tuple[list[int], dict[str, float]]:
    """Target-only decoding with a KV cache: the baseline every speedup is over."""
    rng = torch.Generator(device=input_ids.device)
    rng.manual_seed(seed)
    cache = new_target_cache()
    t0 = time.perf_counter()
    out = target(input_ids=input_ids, use_cache=True, **cache_kwargs(target, cache))
    tok = choose_tokens(out.logits[:, -1], sampling, rng)
    tokens = [int(tok)]
    t1 = time.perf_counter()
    while len(tokens) < max_new_tokens and tokens[-1] not in stops:
        out = target(input_ids=tok.view(1, 1), use_cache=True, **cache_kwargs(target, cache))
        tok = choose_tokens(out.logits[:, -1], sampling, rng)
        tokens.append(int(tok))
    if input_ids.device.type == "cuda":
        torch.cuda.synchronize()
    return tokens, {"prefill": t1 - t0, "decode": time.perf_counter() - t1}


def _proposer(generator, kind: str):
    """The drafter a method drafts with: the generator's own, prompt lookup alone, or both merged."""
    from ..lookup import PromptLookup, WithLookup

    if kind == "drafter":
        return generator.drafter
    lookup = PromptLookup.for_target(generator.target, block_size=generator.drafter.block_size)
    return lookup if kind == "lookup" else WithLookup(generator.drafter, lookup)


@torch.inference_mode()
def hf_prompt_lookup(target, input_ids: torch.Tensor, max_new_tokens: int, stops: frozenset[int],
                     num_tokens: int = 10) -> list[int]:
    """transformers' own prompt-lookup decoding (greedy), the baseline for ddtree's lookup branch."""
    out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                          do_sample=False, prompt_lookup_num_tokens=num_tokens,
                          eos_token_id=sorted(stops) or None, pad_token_id=0)
    new = out[0, input_ids.shape[1]:].tolist()
    cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
    return new[:cut]


class Bench:
    """Runs methods on prompts with one target and drafter; ``generators`` holds one per builder."""

    def __init__(self, generator, methods: list[Method], *, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 stop_token_ids: Iterable[int] = ()):
        from ..generator import SpeculativeGenerator

        self.base = generator
        self.methods = methods
        self.max_new_tokens = max_new_tokens
        self.sampling = SamplingConfig(temperature, top_k, top_p)
        self.seed = seed
        self.stops = frozenset(int(t) for t in stop_token_ids)
        self.depth = generator.drafter.block_size - 1
        self.generators = {}
        for m in methods:
            if m.kind == "tree" and (m.builder, m.proposer) not in self.generators:
                self.generators[(m.builder, m.proposer)] = SpeculativeGenerator(
                    generator.target, _proposer(generator, m.proposer), tree_budget=0, builder=m.builder,
                    attention=generator.backend,
                )
        self.policies: dict[str, dict | None] = {}

    def budget(self, m: Method) -> int | str:
        return self.depth if m.budget is None else m.budget

    def run_one(self, m: Method, prompt: Prompt, repeat: int, max_new_tokens: int | None = None,
                record_trees: bool = False):
        """One generate call; returns the :class:`Run` and the round records (when asked)."""
        device = self.base.target.get_input_embeddings().weight.device
        ids = torch.tensor([prompt.input_ids], dtype=torch.long, device=device)
        n = max_new_tokens or self.max_new_tokens
        seed = self.seed + repeat
        if m.kind == "ar":
            stock = cpu_linear.suspended(self.base.target) if m.name == "ar_stock" else contextlib.nullcontext()
            with stock:
                t0 = time.perf_counter()
                tokens, stages = autoregressive(self.base.target, ids, n, self.sampling, seed, self.stops)
            return Run(m.name, prompt.id, repeat, len(tokens), time.perf_counter() - t0, [], stages, [], tokens,
                       prompt.category), []
        if m.name == "hf_lookup":
            t0 = time.perf_counter()
            tokens = hf_prompt_lookup(self.base.target, ids, n, self.stops)
            return Run(m.name, prompt.id, repeat, len(tokens), time.perf_counter() - t0, [], {}, [], tokens,
                       prompt.category), []
        gen = self.generators[(m.builder, m.proposer)]
        out = gen.generate(
            ids, max_new_tokens=n, temperature=self.sampling.temperature, top_k=self.sampling.top_k,
            top_p=self.sampling.top_p, stop_token_ids=self.stops, tree_budget=self.budget(m), seed=seed,
            record_trees=record_trees,
        )
        s = out.stats
        if s.budget_policy is not None:
            self.policies[m.name] = s.budget_policy
        stages = {k: v for k, v in s.seconds.items() if k in STAGES or k == "prefill"}
        run = Run(m.name, prompt.id, repeat, s.new_tokens, s.total_seconds, list(out.acceptance_lengths),
                  stages, list(s.budgets), out.new_tokens[0].tolist(), prompt.category, s.accepted_by_source)
        return run, out.rounds

    def run(self, prompts: list[Prompt], repeats: int = 3, warmup: bool = True, progress: bool = True,
            trees_path: Path | None = None) -> list[Run]:
        """All methods on all prompts, ``repeats`` times, interleaved; trees of repeat 0 go to ``trees_path``."""
        if warmup:
            self.warmup(prompts)
        bar = _Progress(len(self.methods) * len(prompts) * repeats, enabled=progress)
        runs: list[Run] = []
        tree_file = open(trees_path, "w") if trees_path is not None else None
        try:
            for r in range(repeats):
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


# --------------------------------------------------------------------- trees on disk


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


# --------------------------------------------------------------------- summary


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


def summarize(runs: list[Run], methods: list[Method], depth: int, greedy: bool) -> list[dict]:
    """One dict per method: tau, per-depth acceptance, tokens/s, speedup, stage seconds, lossless."""
    repeats = sorted({r.repeat for r in runs})
    checks = lossless_check(runs) if greedy else {}

    def tps(name: str, rep: int) -> float:  # summed over data-parallel ranks, which run side by side
        rs = [r for r in runs if r.method == name and r.repeat == rep]
        return sum(sum(r.new_tokens for r in rs if r.rank == k) / max(sum(r.seconds for r in rs if r.rank == k),
                                                                      1e-12) for k in {r.rank for r in rs})

    rows = []
    for m in methods:
        rs = [r for r in runs if r.method == m.name]
        if not rs:
            continue
        acc = [a for r in rs for a in r.acceptance]
        per_rep = [tps(m.name, k) for k in repeats]
        speedups = [tps(m.name, k) / tps("ar", k) for k in repeats]
        stage_totals: dict[str, float] = {}
        for r in rs:
            for k, v in r.stage_seconds.items():
                stage_totals[k] = stage_totals.get(k, 0.0) + v
        rounds = len(acc)
        row = {
            "method": m.name,
            "builder": m.builder or None,
            "budget": m.budget if m.budget is not None else depth,
            "tau": statistics.fmean(acc) if acc else 1.0,
            "tau_std": statistics.pstdev(acc) if len(acc) > 1 else 0.0,
            "tau_p10_p90": _quantiles(acc) if acc else [1, 1],
            "depth_acceptance": [sum(a - 1 >= d for a in acc) / rounds for d in range(1, depth + 1)] if acc else [],
            "tokens_per_second": statistics.median(per_rep),
            "tokens_per_second_per_repeat": per_rep,
            "speedup": statistics.median(speedups),
            "speedup_per_repeat": speedups,
            "rounds": rounds,
            "new_tokens": sum(r.new_tokens for r in rs),
            "stage_seconds_per_run": {k: v / len(rs) for k, v in stage_totals.items()},
            "stage_ms_per_round": {k: 1e3 * v / rounds for k, v in stage_totals.items()} if rounds else {},
            "mean_budget": statistics.fmean(b for r in rs for b in r.budgets) if rounds else 0,
            "lossless": checks.get(m.name, {}).get("lossless") if m.name != "ar" else (True if greedy else None),
            "lossless_detail": checks.get(m.name),
            "tau_by_category": _tau_by_category(rs) if acc else {},
            "accepted_by_source": _sum_sources(rs),
        }
        if m.kind == "tree":
            row["budget_histogram"] = _histogram(b for r in rs for b in r.budgets) if m.budget == "auto" else None
        rows.append(row)
    return rows


def _tau_by_category(rs: list[Run]) -> dict[str, float]:
    cats: dict[str, list[int]] = {}
    for r in rs:
        cats.setdefault(r.category or "-", []).extend(r.acceptance)
    return {c: round(statistics.fmean(a), 3) for c, a in sorted(cats.items()) if a}


def _sum_sources(rs: list[Run]) -> dict[str, int] | None:
    total: dict[str, int] = {}
    for r in rs:
        for k, v in (r.accepted_by_source or {}).items():
            total[k] = total.get(k, 0) + v
    return total or None


def _quantiles(xs: list[int]) -> list[float]:
    s = sorted(xs)
    return [s[int(0.1 * (len(s) - 1))], s[int(0.9 * (len(s) - 1))]]


def _histogram(xs: Iterable[int]) -> dict[str, int]:
    h: dict[int, int] = {}
    for x in xs:
        h[x] = h.get(x, 0) + 1
    return {str(k): v for k, v in sorted(h.items())}


def markdown_table(rows: list[dict]) -> str:
    head = (
        "| method | budget | tau (± std) | tok/s | speedup vs ar (min–max) | draft | build | mask | verify | commit "
        "| lossless |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|\n"
    )
    lines = []
    for r in rows:
        ms = r["stage_ms_per_round"]
        stages = " | ".join(f"{ms.get(s, 0.0):.1f}" if ms else "–" for s in STAGES)
        budget = r["budget"] if r["budget"] != "auto" else f"auto (mean {r['mean_budget']:.0f})"
        lossless = {True: "yes", False: "**NO**", None: "n/a"}[r["lossless"]]
        sp = r["speedup_per_repeat"]
        lines.append(
            f"| {r['method']} | {budget} | {r['tau']:.2f} ± {r['tau_std']:.2f} | {r['tokens_per_second']:.1f} | "
            f"{r['speedup']:.2f}x ({min(sp):.2f}–{max(sp):.2f}) | {stages} | {lossless} |"
        )
    note = ("\nStage columns are milliseconds per verify round; "
            "tau counts the tokens a round commits (accepted + bonus).\n")
    return head + "\n".join(lines) + "\n" + note


# --------------------------------------------------------------------- plots


def write_plots(rows: list[dict], out_dir: Path, depth: int) -> list[Path]:
    """tau and speedup vs budget, per-depth acceptance, stage breakdown; none without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    tree_rows = [r for r in rows if r["method"] not in ("ar", "ar_stock")]
    sweep = sorted((r for r in tree_rows if r["builder"] == "best_first" and isinstance(r["budget"], int)),
                   key=lambda r: r["budget"])
    others = [r for r in tree_rows if r not in sweep]
    for key, label, fname in (("tau", "tau (tokens per round)", "tau_vs_budget.png"),
                              ("speedup", "speedup over ar", "speedup_vs_budget.png")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        if sweep:
            ax.plot([r["budget"] for r in sweep], [r[key] for r in sweep], "o-", label="best_first")
        for r in others:
            if r["budget"] == "auto":
                ax.axhline(r[key], ls="--", color="C3", label=f"auto (mean budget {r['mean_budget']:.0f})")
            else:
                ax.plot([r["budget"]], [r[key]], "s", label=r["method"])
        if key == "speedup":
            ax.axhline(1.0, color="gray", lw=0.8, label="ar")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget (draft nodes)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_dir / fname)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in tree_rows:
        if r["depth_acceptance"]:
            ax.plot(range(1, len(r["depth_acceptance"]) + 1), r["depth_acceptance"], marker=".", label=r["method"])
    ax.set_xlabel("depth d")
    ax.set_ylabel("P(round reaches depth d)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(out_dir / "depth_acceptance.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.4, 0.8 + 0.28 * len(tree_rows)))
    left = [0.0] * len(tree_rows)
    for i, stage in enumerate(STAGES):
        vals = [r["stage_ms_per_round"].get(stage, 0.0) for r in tree_rows]
        ax.barh([r["method"] for r in tree_rows], vals, left=left, label=stage, color=f"C{i}")
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("ms per verify round")
    ax.invert_yaxis()
    ax.legend(fontsize=7, ncol=5, loc="lower right")
    fig.tight_layout()
    paths.append(out_dir / "stage_breakdown.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


# --------------------------------------------------------------------- CLI


class _Progress:
    """tqdm when it is installed, else a line every tenth of the way; silent when disabled."""

    def __init__(self, total: int, enabled: bool = True):
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


EXAMPLES = [
    "python -m ddtree.bench --methods ar,chain,best_first@4,8,16,auto --num-prompts 8",
    "python -m ddtree.bench --methods ar,examples.custom_builder:spine@8,16 --per-category 1",
    "python -m ddtree.bench tree-build --budgets 64,256",
    "python -m ddtree.bench cpu-linear --rows 1,4,8",
    "python -m ddtree.bench attention --contexts 1k,4k --budgets 16,64 --device cpu --dtype fp32",
]


def build_parser() -> argparse.ArgumentParser:
    from ..cli import parser

    p = parser(
        "python -m ddtree.bench",
        "Speculative decoding benchmark: tau, per-depth acceptance, tokens/s, speedup, stages and the lossless "
        "check, per method.\n\nsubcommands (each has its own --help):\n"
        "  tree-build   tree construction: the vectorised best_first against a heap loop\n"
        "  cpu-linear   the few-row CPU linear kernel against BLAS on a layer stack\n"
        "  attention    one tree-verify attention layer per backend\n"
        "  long-run     one long generation: exactness and memory per committed token\n"
        "  linear       hybrid GDN verify: tree against chain",
        EXAMPLES,
    )
    p.add_argument("--target", help="target model directory (None: the shipped SmolLM2-135M pair)")
    p.add_argument("--drafter", help="DFlash drafter directory (None: the shipped drafter)")
    p.add_argument("--prompts", type=Path, default=None, help=f"JSONL prompt file (None: {DEFAULT_PROMPTS.name})")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts (None: all)")
    p.add_argument("--per-category", type=int, default=None,
                   help="use only the first N prompts of each 'category' (before --num-prompts)")
    p.add_argument("--methods", action="append", default=None,
                   help="comma-separated methods: ar, chain, best_first@N (N,M,.. or A-B powers of two), beam@WxD, "
                        "auto, module:function@N, e.g. 'ar,chain,best_first@16,32,beam@4x8,auto,"
                        "examples.custom_builder:spine@16' (None: ar,chain,best_first@8,32,auto)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (checked lossless against ar)")
    p.add_argument("--top-k", type=int, default=None, help="top-k filter when sampling (None: off)")
    p.add_argument("--top-p", type=float, default=None, help="top-p filter when sampling (None: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; tokens/s are medians over them")
    p.add_argument("--batch-size", default=None,
                   help="e.g. '1,4,8,16': decode the prompts in batches of each size (HF batched generate and "
                        "ddtree's plain path as baselines) and write batch_results.md (default: off, batch 1)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (CUDA default), float16")
    p.add_argument("--attention", default="sdpa", help="tree-verify attention backend (see ddtree.attention)")
    p.add_argument("--draft-vocab", default="auto",
                   help="drafter proposal vocabulary: 'auto' (the drafter's draft_vocab file), 'full', or N top-ranked ids")
    p.add_argument("--cpu-linear", default="auto", choices=["auto", "on", "off"],
                   help="route a float32 CPU target's linears through ddtree.cpu_linear (method ar_stock "
                        "times plain decoding without it)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (None: OMP_NUM_THREADS, else the free physical cores; see ddtree.threads)")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="output directory")
    p.add_argument("--save-trees", action="store_true", help="write every round's tree to OUT/trees.jsonl")
    p.add_argument("--no-plots", action="store_true", help="skip the matplotlib plots")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation of every method")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def load_generator(args):
    from ..generator import SpeculativeGenerator

    dtype = args.dtype or ("bfloat16" if str(args.device).startswith("cuda") else "float32")
    if (args.target is None) != (args.drafter is None) and args.target is not None:
        raise SystemExit("give --drafter along with --target (or neither, for the shipped pair)")
    vocab = {"auto": "auto", "full": None}.get(args.draft_vocab)
    if vocab is None and args.draft_vocab != "full":
        try:
            vocab = int(args.draft_vocab)
        except ValueError:
            raise SystemExit(f"--draft-vocab takes 'auto', 'full' or a number of tokens, got {args.draft_vocab!r}")
    return SpeculativeGenerator.from_pretrained(
        args.target, args.drafter, device=args.device, dtype=dtype, attention=args.attention, draft_vocab=vocab,
        cpu_linear={"auto": "auto", "on": True, "off": False}[args.cpu_linear],
    )


def run_main_bench(argv: Sequence[str] | None = None) -> int:
    """Entry point behind ``python -m ddtree.bench`` (all but the ``attention`` subcommand)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "tree-build":
        from .tree_build import main as tree_build_main

        return tree_build_main(argv[1:])
    if argv and argv[0] == "long-run":
        from .long_run import main as long_run_main

        return long_run_main(argv[1:])
    if argv and argv[0] == "cpu-linear":
        from .cpu_linear import main as cpu_linear_main

        return cpu_linear_main(argv[1:])
    args = build_parser().parse_args(argv)
    args.device = distributed.start_data_parallel(args.device)  # under torchrun: one replica per rank
    try:
        code = _run_bench(args, argv)
    except BaseException:
        distributed.stop_data_parallel(wait=False)
        raise
    distributed.stop_data_parallel()
    return code


def _run_bench(args, argv) -> int:
    from ..threads import configure_threads

    threads = configure_threads(args.threads)
    print(threads.describe(), file=sys.stderr, flush=True)
    methods = parse_methods(args.methods or ["ar,chain,best_first@8,32,auto"])
    gen = load_generator(args)
    tok = gen.tokenizer
    vocab = gen.target.get_input_embeddings().weight.shape[0]
    prompts = load_prompts(args.prompts, tok, vocab, args.num_prompts, args.per_category)
    all_prompts, prompts = prompts, distributed.shard(prompts)  # data parallel: this rank's share
    if args.batch_size and distributed.is_distributed():
        raise SystemExit("--batch-size runs in one process: launch it without torchrun")
    stops = [] if args.ignore_eos or tok is None or tok.eos_token_id is None else [tok.eos_token_id]
    bench = Bench(gen, methods, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_token_ids=stops)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.batch_size:
        return _run_batch_bench(args, argv, gen, methods, prompts, stops, bench.depth, t0)
    rank = distributed.rank()
    trees = args.out / (f"trees.rank{rank}.jsonl" if distributed.is_distributed() else "trees.jsonl")
    with distributed.fail_together("running the bench"):
        runs = bench.run(prompts, repeats=args.repeats, warmup=not args.no_warmup, progress=not args.no_progress,
                         trees_path=trees if args.save_trees else None)
    runs = [replace(r, rank=k) for k, rank_runs in enumerate(distributed.gather_lists(runs)) for r in rank_runs]
    rows = summarize(runs, methods, bench.depth, greedy=args.temperature == 0)
    for r in rows:
        if r["method"] in bench.policies:
            r["budget_policy"] = bench.policies[r["method"]]
    if rank != 0:  # rank 0 writes the one result set
        return 1 if any(r["lossless"] is False for r in rows) else 0
    meta = _meta(args, gen, all_prompts, time.time() - t0, argv)
    table = markdown_table(rows)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "methods": rows, "runs": [
        {k: v for k, v in asdict(r).items() if k != "tokens"} for r in runs]}, indent=1))
    (args.out / "results.md").write_text(_md_header(meta) + table)
    plots = [] if args.no_plots else write_plots(rows, args.out, bench.depth)
    print(table)
    print(f"wrote {args.out / 'results.json'}, {args.out / 'results.md'}"
          + (f" and {len(plots)} plots" if plots else " (no plots: pip install 'ddtree[plot]')" if not args.no_plots
             else ""))
    bad = [r["method"] for r in rows if r["lossless"] is False]
    if bad:
        print(f"LOSSLESS CHECK FAILED for {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def _run_batch_bench(args, argv, gen, methods, prompts, stops, depth, t0) -> int:
    from .batch import markdown_batch_table, run_batches, summarize_batches

    try:
        sizes = sorted({int(x) for x in str(args.batch_size).split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--batch-size takes comma-separated ints, e.g. 1,4,8, got {args.batch_size!r}")
    if not sizes or sizes[0] < 1:
        raise SystemExit(f"--batch-size values must be >= 1, got {args.batch_size!r}")
    runs = run_batches(gen, methods, prompts, sizes, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                       stops=stops, depth=depth)
    rows = summarize_batches(runs)
    meta = _meta(args, gen, prompts, time.time() - t0, argv)
    table = markdown_batch_table(rows)
    (args.out / "batch_results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "batch_results.md").write_text(_md_header(meta) + table)
    print(table)
    print(f"wrote {args.out / 'batch_results.json'} and {args.out / 'batch_results.md'}")
    return 0


def _meta(args, gen, prompts, seconds, argv) -> dict:
    import transformers

    cfg = gen.target.config
    return {
        "command": "python -m ddtree.bench " + " ".join(argv),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "threads": thread_info().as_dict(),
        "device": str(args.device),
        "dtype": str(next(gen.target.parameters()).dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "target": args.target or f"default ({getattr(cfg, '_name_or_path', '')})",
        "drafter": args.drafter or "default (shipped)",
        "draft_depth": gen.drafter.block_size - 1,
        "cpu_linear_layers": cpu_linear.installed(gen.target),
        "draft_vocab": (None if getattr(gen.drafter, "draft_vocab", None) is None
                        else int(gen.drafter.draft_vocab.numel())),
        "prompts": str(args.prompts or DEFAULT_PROMPTS.name),
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "repeats": args.repeats,
        "wall_seconds": round(seconds, 1),
        "data_parallel_ranks": distributed.world_size(),
    }


def _md_header(meta: dict) -> str:
    routed = meta.get("cpu_linear_layers")
    linears = f"ddtree.cpu_linear on {routed} target linears" if routed else "stock linears"
    return (
        f"`{meta['command']}`\n\n{meta['machine']}, {meta['processor']}, {meta['device']} {meta['dtype']}, "
        f"torch {meta['torch']} ({meta['torch_threads']} threads), transformers {meta['transformers']}, "
        f"{linears}; "
        f"{meta['num_prompts']} prompts x {meta['max_new_tokens']} new tokens, temperature {meta['temperature']}, "
        f"{meta['repeats']} interleaved repeats, {meta['wall_seconds']} s.\n\n"
    )
