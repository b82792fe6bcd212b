"""``python -m ddtree.bench numerics``: what ``numerics="exact"`` costs against ``"fast"``, and what it buys.

Per dtype it loads the pair twice (one copy per setting: each setting prepares its target) and, per batch
size, times every method under both settings in one loop, the order rotating from batch to batch so drift
lands on all alike. It reports median tokens/s, the exact/fast ratio per method, each speculative method's
speedup over its own setting's plain decoding, and how many rows of each method fork from that plain
decoding (exact: none, by construction; fast: the near-ties a tree forward resolves another way). With
``--hf`` it also counts the rows where exact plain decoding forks from HF ``generate`` (batch 1): exact mode
promises invariance to speculation, not HF's kernels' bits.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from ddtree.bench.methods import parse_methods
from ddtree.bench.prompts import load_prompts

SETTINGS = ("fast", "exact")


def _first_fork(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _method(gen, method) -> dict:
    """A bench method as ``generate`` settings (``chain`` without a budget: the drafter's whole draft)."""
    budget = method.budget
    if budget is None:
        budget = getattr(gen.drafter, "block_size", 17) - 1
    return {"tree_budget": budget, "builder": method.builder or None}


def _generators(dtype: str, target: str | None, drafter: str | None) -> dict[str, object]:
    from ddtree import SpeculativeGenerator

    return {s: SpeculativeGenerator.from_pretrained(target, drafter, dtype=dtype, numerics=s) for s in SETTINGS}


def run(args) -> dict:
    methods = [m for m in parse_methods(args.methods) if m.kind == "tree" or m.name == "ar"]
    sizes = [int(x) for x in args.batch_size.split(",")]
    results: dict = {"rows": [], "forks": [], "hf": []}
    for dtype in args.dtype.split(","):
        gens = _generators(dtype, args.target, args.drafter)
        tok = gens["exact"].tokenizer
        prompts = load_prompts(args.prompts, tok, gens["exact"].target.get_input_embeddings().weight.shape[0],
                               args.num_prompts)
        stops = () if tok is None or tok.eos_token_id is None else (tok.eos_token_id,)
        for size in sizes:
            batches = [[p.input_ids for p in prompts[i:i + size]] for i in range(0, len(prompts), size)]
            cells = [(s, m) for s in SETTINGS for m in methods]
            for s, m in cells:  # untimed warm-up: kernels built, auto's round costs learned once
                gens[s].generate(batches[0], max_new_tokens=16, stop_token_ids=stops, **_method(gens[s], m))
            seconds: dict = {c: [] for c in cells}
            tokens: dict = {c: 0 for c in cells}
            outputs: dict = {}
            for rep in range(args.repeats):
                for j, batch in enumerate(batches):
                    shift = (rep * len(batches) + j) % len(cells)
                    for s, m in cells[shift:] + cells[:shift]:
                        out = gens[s].generate(batch, max_new_tokens=args.max_new_tokens, stop_token_ids=stops,
                                               **_method(gens[s], m))
                        seconds[(s, m)].append(out.stats.total_seconds)
                        tokens[(s, m)] += out.stats.new_tokens
                        outputs[(s, m, j)] = out.row_tokens
            for s, m in cells:
                per = tokens[(s, m)] / args.repeats
                rates = []
                for r in range(args.repeats):  # tokens/s of each repeat over all batches
                    span = seconds[(s, m)][r * len(batches):(r + 1) * len(batches)]
                    rates.append(per / sum(span))
                rate = statistics.median(rates)
                forked = sum(_first_fork(a, b) is not None for j in range(len(batches))
                             for a, b in zip(outputs[(s, m, j)], outputs[(s, methods[0], j)]))
                results["rows"].append({"dtype": dtype, "batch": size, "numerics": s, "method": m.name,
                                        "tokens_per_s": rate, "rows_forked_from_plain": forked,
                                        "rows": sum(len(b) for b in batches)})
            if args.hf and size == 1:
                target = gens["exact"].target
                for j, batch in enumerate(batches):
                    ids = torch.tensor(batch)
                    with torch.inference_mode():
                        ref = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                              eos_token_id=list(stops) or None, pad_token_id=gens["exact"].pad_token_id)
                    hf_tokens = ref[0, ids.shape[1]:].tolist()
                    exact_plain = outputs[("exact", methods[0], j)][0]
                    results["hf"].append({"dtype": dtype, "prompt": j,
                                          "exact_plain_forks_from_hf_at": _first_fork(exact_plain, hf_tokens)})
        del gens
    return results


def markdown(results: dict) -> str:
    lines = ["| dtype | batch | method | fast tok/s | exact tok/s | exact / fast | exact / exact plain | "
             "rows forked (fast) | rows forked (exact) |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    rows = results["rows"]
    for r in rows:
        if r["numerics"] != "exact":
            continue
        fast = next(f for f in rows if f["numerics"] == "fast" and f["dtype"] == r["dtype"]
                    and f["batch"] == r["batch"] and f["method"] == r["method"])
        plain = next(p for p in rows if p["numerics"] == "exact" and p["dtype"] == r["dtype"]
                     and p["batch"] == r["batch"] and p["method"] == "ar")
        lines.append(f"| {r['dtype']} | {r['batch']} | {r['method']} | {fast['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / fast['tokens_per_s']:.2f}x | "
                     f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}x | "
                     f"{fast['rows_forked_from_plain']}/{r['rows']} | {r['rows_forked_from_plain']}/{r['rows']} |")
    if results["hf"]:
        for dtype in sorted({h["dtype"] for h in results["hf"]}):
            hf = [h for h in results["hf"] if h["dtype"] == dtype]
            forks = [h["exact_plain_forks_from_hf_at"] for h in hf if h["exact_plain_forks_from_hf_at"] is not None]
            lines.append(f"\n{dtype}: exact plain decoding forks from HF generate on {len(forks)} of {len(hf)} "
                         f"prompts" + (f" (at tokens {sorted(forks)})" if forks else ""))
    return "\n".join(lines) + "\n"


EXAMPLES = ["python -m ddtree.bench numerics --dtype float32,bfloat16 --batch-size 1,4 "
            "--methods ar,best_first@4,16,auto --num-prompts 8 --max-new-tokens 96 --repeats 3 --hf"]


def build_parser():
    from ddtree.apps.cli import parser

    p = parser("python -m ddtree.bench numerics", __doc__, EXAMPLES)
    p.add_argument("--target", help="target model directory (None: the shipped SmolLM2-135M pair)")
    p.add_argument("--drafter", help="drafter directory (None: the shipped drafter)")
    p.add_argument("--prompts", type=Path, default=None, help="JSONL prompt file (None: the shipped set)")
    p.add_argument("--num-prompts", type=int, default=8, help="the first N prompts")
    p.add_argument("--methods", default="ar,best_first@4,16,auto", help="methods as the main bench takes them")
    p.add_argument("--dtype", default="float32,bfloat16", help="comma-separated dtypes")
    p.add_argument("--batch-size", default="1,4", help="comma-separated batch sizes")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; tokens/s are medians over them")
    p.add_argument("--threads", type=int, default=None, help="torch threads (None: the bench's thread policy)")
    p.add_argument("--hf", action="store_true", help="also count exact plain decoding's forks from HF generate")
    p.add_argument("--out", type=Path, default=Path("bench_out/numerics"), help="output directory")
    return p


def main(argv=None) -> int:
    from ddtree.runtime.threads import configure_threads

    args = build_parser().parse_args(argv)
    threads = configure_threads(args.threads)
    print(threads.describe(), file=sys.stderr, flush=True)
    t0 = time.time()
    results = run(args)
    results["meta"] = {"argv": sys.argv, "machine": platform.processor() or platform.machine(),
                       "threads": threads.as_dict(), "seconds": time.time() - t0, "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "numerics.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (args.out / "numerics.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
