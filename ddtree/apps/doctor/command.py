"""``python -m ddtree doctor``: why an engine's speculative acceptance is low.

Checks the drafter's config against the target, measures ddtree's reference
acceptance profile (vLLM's definitions: mean = 1 + accepted / drafts; position k
= drafts whose first k tokens were accepted / drafts) for the chain an engine
runs (block_size - 1 tokens) and for DDTree, then the same profile with each
known integration fault injected. Given what an engine reported (its log, or
the figures), it ranks the faults by distance and says which one fits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

EXAMPLES = [
    "python -m ddtree doctor",
    "python -m ddtree doctor --engine-mean 1.04 --engine-rates 0.045,0.004,0,0,0",
    "python -m ddtree doctor --engine-log vllm.log --json doctor.json",
]


def build_parser() -> argparse.ArgumentParser:
    from ddtree.apps.cli import parser
    from ddtree.apps.doctor.faults import FAULTS

    ap = parser("python -m ddtree doctor", __doc__, EXAMPLES)
    ap.add_argument("--target", default=None, help="target model directory or hub id (None: the default pair)")
    ap.add_argument("--drafter", default=None, help="DFlash drafter directory for --target")
    ap.add_argument("--prompts", default=None,
                    help="a .jsonl (messages, prompt or text per line) or a text file, one prompt per line "
                         "(None: a built-in mixed set of chat, code, math and story prompts)")
    ap.add_argument("--num-prompts", type=int, default=4, help="prompts to run")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per prompt and profile")
    ap.add_argument("--replay-tokens", type=int, default=128,
                    help="tokens per prompt of the reference run each fault is replayed at (the paired comparison; "
                         "a replay costs a fraction of a run, and more rounds give smaller standard errors)")
    ap.add_argument("--budgets", default="8", help="DDTree budgets for the reference tree profiles (comma list; "
                                                   "empty: none)")
    ap.add_argument("--faults", default="all",
                    help=f"faults to inject (comma list of {', '.join(f.name for f in FAULTS)})")
    ap.add_argument("--engine-log", default=None, help="an engine log with vLLM 'SpecDecoding metrics' or SGLang "
                                                       "'accept len' lines")
    ap.add_argument("--engine-mean", type=float, default=None, help="the engine's mean acceptance length "
                                                                    "(1 + accepted / drafts)")
    ap.add_argument("--engine-rates", default=None, help="the engine's per-position acceptance rates, comma list")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="reference model dtype")
    ap.add_argument("--device", default="cpu", help="device for the models (cpu, cuda, ...)")
    ap.add_argument("--json", default=None, help="write the full report as JSON here")
    ap.add_argument("--plot", default=None, help="write a per-position acceptance plot (PNG) here (needs matplotlib)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (None: OMP_NUM_THREADS, else the free physical cores)")
    return ap


def main(argv: list[str] | None = None) -> int:
    from ddtree.apps.doctor.diagnose import diagnose, plot, render
    from ddtree.apps.doctor.engine_logs import parse_engine_log, profile_from_figures
    from ddtree.runtime.threads import configure_threads

    args = build_parser().parse_args(argv)
    configure_threads(args.threads)
    engine = None
    try:
        if args.engine_log is not None:
            if args.engine_mean is not None or args.engine_rates is not None:
                raise ValueError("give --engine-log or the figures (--engine-mean / --engine-rates), not both")
            engine = parse_engine_log(Path(args.engine_log).read_text(errors="replace"))
        elif args.engine_mean is not None or args.engine_rates is not None:
            engine = profile_from_figures(args.engine_mean, args.engine_rates)
        budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
        faults = None if args.faults == "all" else [f.strip() for f in args.faults.split(",") if f.strip()]
    except (ValueError, OSError) as exc:
        print(f"doctor: {exc}", file=sys.stderr)
        return 2
    report = diagnose(args.target, args.drafter, prompts=args.prompts, num_prompts=args.num_prompts,
                      max_new_tokens=args.max_new_tokens, replay_tokens=args.replay_tokens, tree_budgets=budgets,
                      faults=faults, engine=engine, dtype=getattr(torch, args.dtype), progress=not args.no_progress,
                      device=args.device)
    print(render(report))
    if args.json:
        report.to_json(args.json)
        print(f"json: {args.json}")
    if args.plot:
        print(plot(report, args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
