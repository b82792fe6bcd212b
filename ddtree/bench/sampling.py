"""Sampling with a seed: acceptance and speed of keyed draws, with and without coupled drafting.

``python -m ddtree.bench.sampling`` decodes each prompt plainly (budget 0) and with each method, at each
temperature, under one seed per prompt, and reports per (temperature, method, coupling) the tokens committed
per round, tokens per second, and how many outputs equal plain decoding's (all of them must: a seed fixes the
tokens). It also times one round's draw for a tree of N nodes: keyed (hash + Gumbel-max) against an
independent multinomial draw per node (what the draws cost before keys).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ddtree import SpeculativeGenerator
from ddtree.bench.prompts import load_prompts
from ddtree.core.noise import row_keys
from ddtree.core.sampling import SamplingConfig, choose_tokens


def draw_cost(vocab: int, nodes: int, repeats: int = 20) -> dict[str, float]:
    """Median ms of one round's choice over ``nodes`` nodes: keyed, and independent multinomial draws."""
    logits = torch.randn(1, nodes, vocab)
    cfg = SamplingConfig(1.0)
    keys, positions = row_keys(1, 1), torch.arange(nodes).view(1, nodes)
    rng = torch.Generator().manual_seed(0)

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return {"keyed_ms": median_ms(lambda: choose_tokens(logits, cfg, keys=keys, positions=positions)),
            "multinomial_ms": median_ms(lambda: choose_tokens(logits, cfg, rng))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ddtree.bench.sampling", description=__doc__)
    ap.add_argument("--target", default=None, help="target dir or hub id (default: the shipped default pair)")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--prompts", default=None, help="JSONL prompts (default: ddtree/data/prompts.jsonl)")
    ap.add_argument("--limit", type=int, default=6, help="prompts to take")
    ap.add_argument("--temperatures", default="0.6,1.0,1.2")
    ap.add_argument("--methods", default="chain,best_first@4,best_first@16",
                    help="builder@budget (chain: the block's depth)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0, help="prompt i is decoded with seed + i")
    ap.add_argument("--coupled", choices=["both", "on", "off"], default="both", help="coupled drafting runs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="write results.json and results.md here")
    args = ap.parse_args(argv)

    pair = () if args.target is None else (args.target, args.drafter)
    gen = SpeculativeGenerator.from_pretrained(*pair, threads=args.threads, prompt_lookup=False)
    prompts = load_prompts(args.prompts, gen.tokenizer, limit=args.limit)
    depth = gen.drafter.block_size - 1
    methods = []
    for spec in args.methods.split(","):
        builder, _, budget = spec.partition("@")
        methods.append((spec, builder, int(budget) if budget else depth))
    rows: list[dict] = []
    gen.generate(prompts[0].input_ids, max_new_tokens=8, temperature=1.0, seed=0)  # warm-up
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        for i, prompt in enumerate(prompts):
            call = dict(max_new_tokens=args.max_new_tokens, temperature=temperature, seed=args.seed + i)
            t0 = time.perf_counter()
            plain = gen.generate(prompt.input_ids, tree_budget=0, **call)
            rows.append(dict(temperature=temperature, method="plain", coupled=False, prompt=prompt.id,
                             tokens=len(plain.row_tokens[0]), rounds=plain.stats.rounds,
                             seconds=time.perf_counter() - t0, equal=True))
            for spec, builder, budget in methods:
                for coupled in {"both": (False, True), "on": (True,), "off": (False,)}[args.coupled]:
                    t0 = time.perf_counter()
                    out = gen.generate(prompt.input_ids, tree_budget=budget, builder=builder, coupled_drafts=coupled,
                                       **call)
                    rows.append(dict(temperature=temperature, method=spec, coupled=coupled, prompt=prompt.id,
                                     tokens=len(out.row_tokens[0]), rounds=out.stats.rounds,
                                     seconds=time.perf_counter() - t0,
                                     equal=out.row_tokens[0] == plain.row_tokens[0],
                                     acceptance=out.acceptance_lengths))
    table = summarise(rows)
    cost = {n: draw_cost(gen.target.config.vocab_size, n) for n in (1, 5, 17)}
    text = render(table, cost, args)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"rows": rows, "draw_cost": cost}, indent=1))
        (args.out / "results.md").write_text(text)


def summarise(rows: list[dict]) -> list[dict]:
    """Per (temperature, method, coupling): tokens per round pooled over prompts (the prefill's token left
    out), tokens per second over the summed time, outputs equal to plain, against plain's tokens/s."""
    out = []
    keys = sorted({(r["temperature"], r["method"], r["coupled"]) for r in rows},
                  key=lambda k: (k[0], k[1] != "plain", k[1], k[2]))
    plain_rate = {}
    for t, method, coupled in keys:
        group = [r for r in rows if (r["temperature"], r["method"], r["coupled"]) == (t, method, coupled)]
        accepted = [a for r in group for a in r.get("acceptance", [])]
        rate = sum(r["tokens"] for r in group) / sum(r["seconds"] for r in group)
        if method == "plain":
            plain_rate[t] = rate
        out.append(dict(temperature=t, method=method, coupled=coupled,
                        tokens_per_round=sum(accepted) / len(accepted) if accepted else 1.0,
                        tokens_per_second=rate, vs_plain=rate / plain_rate[t],
                        equal=sum(r["equal"] for r in group), runs=len(group)))
    return out


def render(table: list[dict], cost: dict, args: argparse.Namespace) -> str:
    lines = [f"python -m ddtree.bench.sampling --limit {args.limit} --temperatures {args.temperatures} "
             f"--methods {args.methods} --max-new-tokens {args.max_new_tokens} --threads {args.threads} "
             f"--coupled {args.coupled}", "",
             "| T | method | coupled | tokens/round | tok/s | vs plain | equal to plain |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for r in table:
        lines.append(f"| {r['temperature']} | {r['method']} | {'yes' if r['coupled'] else 'no'} | "
                     f"{r['tokens_per_round']:.2f} | {r['tokens_per_second']:.1f} | {r['vs_plain']:.2f}x | "
                     f"{r['equal']}/{r['runs']} |")
    lines += ["", "| nodes | keyed draw (ms) | multinomial draw (ms) |", "|---:|---:|---:|"]
    for n, c in cost.items():
        lines.append(f"| {n} | {c['keyed_ms']:.2f} | {c['multinomial_ms']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
