"""Tensor-parallel generation with the default pair: the same tokens on every rank, and as one process.

    python examples/tensor_parallel.py --out one.json                                   # one process
    torchrun --standalone --nproc_per_node 3 examples/tensor_parallel.py --out tp3.json # 3 ranks (gloo on CPUs)

SmolLM2-135M has 9 attention heads and 3 KV heads, so it shards over 1 or 3
ranks (2 is refused before loading). Rank 0 prints tokens/s and acceptance and
writes ``--out``; compare two runs' ``tokens`` to check exactness.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from ddtree import SpeculativeGenerator

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What are some good ways to stay focused while working from home?",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--builder", default="best_first")
    p.add_argument("--budget", default="4", help="an int or 'auto'")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // ranks))
    budget = args.budget if args.budget == "auto" else int(args.budget)
    placement = {"tp_plan": "auto"} if ranks > 1 else {}
    # Stock linears in both runs: ddtree.targets.cpu_linear does not route sharded layers, and the comparison is exact.
    gen = SpeculativeGenerator.from_pretrained(cpu_linear=False, tree_budget=budget, builder=args.builder, **placement)
    tok = gen.tokenizer
    rows = []
    for text in PROMPTS[: args.num_prompts]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = list(getattr(ids, "input_ids", ids))
        gen.generate(ids, max_new_tokens=8)  # warm
        t0 = time.perf_counter()
        out = gen.generate(ids, max_new_tokens=args.max_new_tokens, stop_token_ids=tok.eos_token_id)
        seconds = time.perf_counter() - t0
        rows.append({"prompt": text, "tokens": out.row_tokens[0], "acceptance": out.row_acceptance[0],
                     "seconds": seconds, "budgets": out.stats.budgets})
    if int(os.environ.get("RANK", "0")) == 0:
        new = sum(len(r["tokens"]) for r in rows)
        rounds = sum(len(r["acceptance"]) for r in rows)
        seconds = sum(r["seconds"] for r in rows)
        print(f"{ranks} rank(s), {args.builder}@{args.budget}: {new} tokens in {seconds:.2f} s, "
              f"{new / seconds:.2f} tok/s, mean acceptance {sum(sum(r['acceptance']) for r in rows) / rounds:.3f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"ranks": ranks, "builder": args.builder, "budget": args.budget, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
