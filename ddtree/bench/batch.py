"""``python -m ddtree.bench --batch-size 1,4,8,16``: throughput and acceptance as the batch grows.

For each batch size B the prompt set is cut into batches of B prompts (cycled
to fill the last one) and every method decodes every batch, methods
interleaved within each repeat. Methods: ``hf`` (HF ``generate`` with left
padding, greedy), ``ar`` (ddtree's own plain path, budget 0), and the tree
methods given with ``--methods``. Per batch size and method it reports total
tokens/s (median over repeats), the speedup over both plain baselines,
acceptance per round pooled over rows, whether each row's acceptance equals
its batch-1 run, verify milliseconds per round, how many rows equal their
batch-1 plain output token for token, and the tree rounds by the reason for
their budget (``stats.reasons``). The warm-up is one of ``runner.WARMUPS``:
``full`` (per batch size, one untimed batch of each method, ``auto``'s in full,
on generators kept across sizes and repeats), ``short`` (per batch size and
repeat, a fresh generator per method and one 16-token batch) or ``none``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from ddtree.bench.methods import Method, _proposer
from ddtree.bench.prompts import Prompt
from ddtree.bench.report import budget_reasons, reasons_section
from ddtree.bench.runner import SHORT_WARMUP_TOKENS, warmup_mode


@dataclass
class BatchRun:
    method: str
    batch_size: int
    repeat: int
    prompts: list[str]
    new_tokens: int
    seconds: float
    verify_seconds: float = 0.0
    rounds: int = 0
    acceptance: list[list[int]] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list, repr=False)
    reasons: list[str] = field(default_factory=list)  # each tree round's reason for its budget (stats.reasons)


def _batches(prompts: list[Prompt], size: int) -> list[list[Prompt]]:
    count = -(-len(prompts) // size)
    return [[prompts[(i * size + j) % len(prompts)] for j in range(size)] for i in range(count)]


def _hf_generate(target, batch: list[Prompt], max_new_tokens: int, pad: int, stops: list[int]) -> list[list[int]]:
    device = target.get_input_embeddings().weight.device
    width = max(len(p.input_ids) for p in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(batch):
        ids[b, width - len(p.input_ids):] = torch.tensor(p.input_ids, device=device)
        mask[b, width - len(p.input_ids):] = 1
    out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=pad, eos_token_id=stops or None)
    rows = []
    for b in range(len(batch)):
        new = out[b, width:].tolist()
        if stops:  # HF pads a finished row with the pad id after its stop token
            cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
            new = new[:cut]
        rows.append(new)
    return rows


def run_batches(gen, methods: list[Method], prompts: list[Prompt], batch_sizes: list[int], *,
                max_new_tokens: int, repeats: int, stops: list[int], depth: int,
                warmup: bool | str = "full") -> list[BatchRun]:
    """Every method on every batch of every size, ``repeats`` times, methods interleaved (order rotating);
    ``warmup`` as in the module docstring (``True`` / ``False``: ``full`` / ``none``)."""
    mode = warmup_mode(warmup)
    alone = [m.name for m in methods if m.kind == "ar" and m.name not in ("ar", "ar_stock")]
    if alone:
        raise ValueError(f"the batch bench does not run {', '.join(alone)} (batch 1 only): leave it out of --methods "
                         "or run without --batch-size")
    names = ["hf"] + [m.name for m in methods if m.name not in ("hf", "ar_stock")]
    by_name = {m.name: m for m in methods}
    shared = {m.name: _tree_generator(gen, m) for m in methods if m.kind == "tree"}  # full and none
    runs: list[BatchRun] = []
    with torch.inference_mode():
        for size in batch_sizes:
            batches = _batches(prompts, size)
            if mode == "full":  # untimed: one batch each (auto learns this batch size's costs here)
                for name in names:
                    _one(gen, shared, name, by_name.get(name), batches[0], size, 0,
                         max_new_tokens if name == "auto" else 8, stops, depth)
            for r in range(repeats):
                gens = shared
                if mode == "short":  # a new user's start: new generators, one short untimed batch each
                    gens = {m.name: _tree_generator(gen, m) for m in methods if m.kind == "tree"}
                    for name in names:
                        _one(gen, gens, name, by_name.get(name), batches[0], size, r,
                             min(SHORT_WARMUP_TOKENS, max_new_tokens), stops, depth)
                for i, batch in enumerate(batches):
                    shift = (r + i) % len(names)
                    for name in names[shift:] + names[:shift]:
                        runs.append(_one(gen, gens, name, by_name.get(name), batch, size, r, max_new_tokens, stops,
                                         depth))
    return runs


def _tree_generator(gen, m: Method):
    """A generator of its own for tree method ``m`` on ``gen``'s models (its proposer: the drafter, lookup or
    both); nothing learned yet."""
    from ddtree.generation.generator import SpeculativeGenerator

    return SpeculativeGenerator(gen.target, _proposer(gen, m.proposer), tree_budget=0, builder=m.builder,
                                attention=gen.backend, prompt_lookup=False)


def _one(plain, gens, name, method, batch, size, repeat, max_new_tokens, stops, depth) -> BatchRun:
    """One timed call: ``plain`` (the caller's generator) runs ``hf`` and ``ar``, ``gens[name]`` a tree method."""
    ids = [p.input_ids for p in batch]
    gen = plain if name in ("hf", "ar") else gens[name]
    if name == "hf":
        t0 = time.perf_counter()
        tokens = _hf_generate(gen.target, batch, max_new_tokens, gen.pad_token_id, stops)
        seconds = time.perf_counter() - t0
        return BatchRun(name, size, repeat, [p.id for p in batch], sum(map(len, tokens)), seconds, tokens=tokens)
    budget = 0 if name == "ar" else (depth if method.budget is None else method.budget)
    out = gen.generate(ids if size > 1 else ids[0], max_new_tokens=max_new_tokens, stop_token_ids=stops,
                       tree_budget=budget, seed=repeat)
    acc = out.row_acceptance
    s = out.stats
    return BatchRun(name, size, repeat, [p.id for p in batch], s.new_tokens, s.total_seconds,
                    s.seconds.get("verify", 0.0), s.rounds, acc, out.row_tokens, list(s.reasons))


def summarize_batches(runs: list[BatchRun]) -> list[dict]:
    """One row per (batch size, method); acceptance and outputs compared with batch 1 where it ran."""
    base_acc = {(r.method, pid): acc for r in runs if r.batch_size == 1 and r.repeat == 0
                for pid, acc in zip(r.prompts, r.acceptance)}
    base_tok = {pid: toks for r in runs if r.batch_size == 1 and r.repeat == 0 and r.method == "ar"
                for pid, toks in zip(r.prompts, r.tokens)}
    rows = []
    sizes = sorted({r.batch_size for r in runs})
    for size in sizes:
        at = [r for r in runs if r.batch_size == size]
        repeats = sorted({r.repeat for r in at})

        def tps(method, rep, at=at):
            rs = [r for r in at if r.method == method and r.repeat == rep]
            return sum(r.new_tokens for r in rs) / max(sum(r.seconds for r in rs), 1e-12)

        for method in dict.fromkeys(r.method for r in at):
            rs = [r for r in at if r.method == method]
            per_rep = [tps(method, k) for k in repeats]
            pooled = [a for r in rs for row in r.acceptance for a in row]
            rounds = sum(r.rounds for r in rs)
            first = [r for r in rs if r.repeat == 0]
            same_acc = [base_acc.get((method, pid)) == acc for r in first for pid, acc in zip(r.prompts, r.acceptance)]
            same_out = [base_tok.get(pid) == toks for r in first for pid, toks in zip(r.prompts, r.tokens)
                        if pid in base_tok]
            rows.append({
                "batch_size": size,
                "method": method,
                "tokens_per_second": statistics.median(per_rep),
                "speedup_vs_hf": statistics.median(tps(method, k) / tps("hf", k) for k in repeats),
                "speedup_vs_ar": statistics.median(tps(method, k) / tps("ar", k) for k in repeats)
                if any(r.method == "ar" for r in at) else None,
                "tau": statistics.fmean(pooled) if pooled else None,
                "acceptance_equals_batch_1": (sum(same_acc), len(same_acc)) if pooled and base_acc else None,
                "verify_ms_per_round": 1e3 * sum(r.verify_seconds for r in rs) / rounds if rounds else None,
                "rows_equal_to_batch_1_plain": (sum(same_out), len(same_out)) if same_out else None,
                "budget_reasons": budget_reasons(x for r in rs for x in r.reasons) or None,
            })
    return rows


def markdown_batch_table(rows: list[dict]) -> str:
    head = ("| batch | method | tok/s | vs HF batched | vs ddtree plain | tau | acceptance = batch 1 | verify ms/round "
            "| rows = batch-1 plain |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        def frac(x):
            return "–" if x is None else f"{x[0]}/{x[1]}"

        lines.append(
            f"| {r['batch_size']} | {r['method']} | {r['tokens_per_second']:.1f} | {r['speedup_vs_hf']:.2f}x | "
            + ("–" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}x")
            + f" | {'–' if r['tau'] is None else format(r['tau'], '.2f')} | {frac(r['acceptance_equals_batch_1'])} | "
            f"{'–' if r['verify_ms_per_round'] is None else format(r['verify_ms_per_round'], '.1f')} | "
            f"{frac(r['rows_equal_to_batch_1_plain'])} |"
        )
    return head + "\n".join(lines) + "\n" + reasons_section(rows, lambda r: f"batch {r['batch_size']}, {r['method']}")
