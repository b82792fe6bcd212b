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
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ddtree.bench.commands import SUBCOMMANDS
from ddtree.bench.methods import parse_methods
from ddtree.bench.noise import comparisons
from ddtree.bench.prompts import DEFAULT_PROMPTS, load_prompts
from ddtree.bench.report import (
    _md_header,
    _meta,
    category_table,
    comparison_section,
    cost_table,
    depth_tables,
    markdown_table,
    reasons_section,
    summarize,
    write_plots,
)
from ddtree.bench.runner import SHORT_WARMUP_TOKENS, WARMUPS, Bench
from ddtree.runtime import distributed

EXAMPLES = [
    "python -m ddtree.bench --methods ar,chain,best_first@4,8,16,auto --num-prompts 8",
    "python -m ddtree.bench --methods ar,examples.custom_builder:spine@8,16 --per-category 1",
    "python -m ddtree.bench tree-build --budgets 64,256",
    "python -m ddtree.bench cpu-linear --rows 1,4,8",
    "python -m ddtree.bench attention --contexts 1k,4k --budgets 16,64 --device cpu --dtype fp32",
]


def build_parser() -> argparse.ArgumentParser:
    from ddtree.apps.cli import parser

    p = parser(
        "python -m ddtree.bench",
        "Speculative decoding benchmark: tau, per-depth acceptance, tokens/s, speedup, stages and the lossless "
        "check, per method.\n\nsubcommands (each has its own --help):\n"
        + "\n".join(f"  {name:<12} {what}" for name, (_, what) in SUBCOMMANDS.items()),
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
    p.add_argument("--attention", default="auto",
                   help="tree-verify attention backend, as SpeculativeGenerator's attention= (default: auto, the "
                        "generator's default; the one used is recorded in the results; see ddtree.targets.backends)")
    p.add_argument("--draft-vocab", default="auto",
                   help="drafter proposal vocabulary: 'auto' (the drafter's draft_vocab file), 'full', "
                        "or N top-ranked ids")
    p.add_argument("--cpu-linear", default="auto", choices=["auto", "on", "off"],
                   help="route a float32 CPU target's linears through ddtree.targets.cpu_linear (method ar_stock "
                        "times plain decoding without it)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (None: OMP_NUM_THREADS, else the free physical cores; "
                        "see ddtree.runtime.threads)")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="output directory")
    p.add_argument("--save-trees", action="store_true", help="write every round's tree to OUT/trees.jsonl")
    p.add_argument("--no-plots", action="store_true", help="skip the matplotlib plots")
    p.add_argument("--warmup", choices=WARMUPS, default="full",
                   help="untimed warm-up before the clock: 'full' (each method once on generators kept for the "
                        "whole run; auto runs in full on the longest prompt, or on one batch per --batch-size, so "
                        "it has learned the round costs), 'short' (what a new user meets: before every repeat, and "
                        "per batch size, a fresh generator per method, nothing learned, then one untimed "
                        f"{SHORT_WARMUP_TOKENS}-token call of each method on the first prompt or batch; auto then "
                        "learns only from that call and the repeat's own calls) or 'none'")
    p.add_argument("--no-warmup", dest="warmup", action="store_const", const="none", default="full",
                   help="the same as --warmup none")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr (default: only when stderr is a terminal, so a log file gets none)")
    return p


def load_generator(args):
    from ddtree.generation.generator import SpeculativeGenerator

    dtype = args.dtype or ("bfloat16" if str(args.device).startswith("cuda") else "float32")
    if (args.target is None) != (args.drafter is None) and args.target is not None:
        raise SystemExit("give --drafter along with --target (or neither, for the shipped pair)")
    vocab = {"auto": "auto", "full": None}.get(args.draft_vocab)
    if vocab is None and args.draft_vocab != "full":
        try:
            vocab = int(args.draft_vocab)
        except ValueError:
            raise SystemExit(
                f"--draft-vocab takes 'auto', 'full' or a number of tokens, got {args.draft_vocab!r}"
            ) from None
    return SpeculativeGenerator.from_pretrained(
        args.target, args.drafter, device=args.device, dtype=dtype, attention=args.attention, draft_vocab=vocab,
        cpu_linear={"auto": "auto", "on": True, "off": False}[args.cpu_linear], prompt_lookup=False,
    )


def run_main_bench(argv: Sequence[str] | None = None) -> int:
    """The main bench behind ``python -m ddtree.bench`` (subcommands are dispatched in ``__main__``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
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
    from ddtree.runtime.threads import configure_threads

    threads = configure_threads(args.threads, fix="python -m ddtree.bench --threads 1, or OMP_NUM_THREADS=1")
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
        return _run_batch_bench(args, argv, gen, methods, prompts, stops, bench.depth, t0, threads)
    rank = distributed.rank()
    trees = args.out / (f"trees.rank{rank}.jsonl" if distributed.is_distributed() else "trees.jsonl")
    with distributed.fail_together("running the bench"):
        runs = bench.run(prompts, repeats=args.repeats, warmup=args.warmup, progress=args.progress,
                         trees_path=trees if args.save_trees else None)
    runs = [replace(r, rank=k) for k, rank_runs in enumerate(distributed.gather_lists(runs)) for r in rank_runs]
    rows = summarize(runs, methods, bench.depth, greedy=args.temperature == 0)
    for r in rows:
        if r["method"] in bench.policies:
            r["budget_policy"] = bench.policies[r["method"]]
    if rank != 0:  # rank 0 writes the one result set
        return 1 if any(r["lossless"] is False for r in rows) else 0
    meta = _meta(args, gen, all_prompts, time.time() - t0, argv, threads)
    comps = comparisons(rows)
    table = markdown_table(rows) + reasons_section(rows) + cost_table(rows) + comparison_section(comps)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "methods": rows, "comparisons": comps, "runs": [
        {k: v for k, v in asdict(r).items() if k != "tokens"} for r in runs]}, indent=1))
    (args.out / "results.md").write_text(_md_header(meta) + table + depth_tables(rows) + category_table(rows))
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


def _run_batch_bench(args, argv, gen, methods, prompts, stops, depth, t0, threads) -> int:
    from ddtree.bench.batch import markdown_batch_table, run_batches, summarize_batches

    try:
        sizes = sorted({int(x) for x in str(args.batch_size).split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--batch-size takes comma-separated ints, e.g. 1,4,8, got {args.batch_size!r}") from None
    if not sizes or sizes[0] < 1:
        raise SystemExit(f"--batch-size values must be >= 1, got {args.batch_size!r}")
    runs = run_batches(gen, methods, prompts, sizes, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                       stops=stops, depth=depth, warmup=args.warmup)
    rows = summarize_batches(runs)
    meta = _meta(args, gen, prompts, time.time() - t0, argv, threads)
    table = markdown_batch_table(rows)
    (args.out / "batch_results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "batch_results.md").write_text(_md_header(meta) + table)
    print(table)
    print(f"wrote {args.out / 'batch_results.json'} and {args.out / 'batch_results.md'}")
    return 0
