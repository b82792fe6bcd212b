"""``python -m ddtree.bench eager-regression --old DIR``: the eager path's tokens/s against another source tree's.

Both trees run the same greedy generations on the same pair, prompts and methods, each in its own child process
whose ``PYTHONPATH`` names its tree; the children alternate (old then new, then new then old, ...) so machine
drift lands on both alike. Each child loads the pair once, warms every method up, then generates every prompt
with every method. Per method: each tree's tokens/s (new tokens over generate's wall time, all prompts), medians
over repeats, the new/old ratio of the medians and the range of the per-repeat ratios, and whether the tokens
and acceptance lengths are identical across trees and repeats. ``DIR`` is a source tree (the folder holding
``ddtree/``), e.g. an older commit unpacked with ``git archive COMMIT | tar -x -C DIR``.
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

NEW_TREE = Path(__file__).resolve().parents[2]
METHODS = "plain,chain,best_first@4,best_first@16"


def _child(spec_json: str) -> None:
    """One tree's run, in a bare interpreter (``python -c``), so it imports the ``ddtree`` its ``PYTHONPATH``
    names; it uses only what every tree since the first published one has."""
    import json
    import time

    import torch

    import ddtree
    from ddtree import SpeculativeGenerator

    spec = json.loads(spec_json)
    torch.set_num_threads(spec["threads"])
    base = SpeculativeGenerator.from_pretrained(spec["target"], spec["drafter"], dtype=torch.float32,
                                                threads=spec["threads"], prompt_lookup=False)
    depth = base.drafter.block_size - 1
    gens = {}

    def call(method: str, ids: list[int], new_tokens: int) -> tuple[float, object]:
        name, _, budget = method.partition("@")
        if name == "plain":
            gen, budget = base, "0"
        else:
            if name not in gens:  # as the bench does: one generator per builder, sharing the models
                gens[name] = SpeculativeGenerator(base.target, base.drafter, tree_budget=0, builder=name,
                                                  attention=base.backend, prompt_lookup=False)
            gen, budget = gens[name], budget or str(depth)
        t0 = time.perf_counter()
        out = gen.generate(ids, max_new_tokens=new_tokens, tree_budget=int(budget))
        return time.perf_counter() - t0, out

    for method in spec["methods"]:
        call(method, spec["prompts"][0], 8)
    results = []
    for p, ids in enumerate(spec["prompts"]):
        for method in spec["methods"]:
            seconds, out = call(method, ids, spec["max_new_tokens"])
            results.append({"prompt": p, "method": method, "seconds": seconds, "tokens": out.row_tokens[0],
                            "acceptance": [int(a) for a in out.acceptance_lengths]})
    print("RESULT " + json.dumps({"ddtree": ddtree.__file__, "results": results}))


def run_child(tree: Path, spec: dict, timeout: float) -> dict:
    """Run :func:`_child` under ``tree`` and return its results (checked to come from that tree)."""
    source = inspect.getsource(_child) + "\nimport sys\n_child(sys.argv[1])\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(tree), OMP_NUM_THREADS=str(spec["threads"]))
    with tempfile.TemporaryDirectory() as cwd:  # not the caller's folder: it may hold another ddtree/
        proc = subprocess.run([sys.executable, "-c", source, json.dumps(spec)], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the run under {tree} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1][len("RESULT "):])
    if not Path(out["ddtree"]).resolve().is_relative_to(tree):
        raise RuntimeError(f"the run meant for {tree} imported ddtree from {out['ddtree']}")
    return out


def summarize(runs: dict[str, list[dict]], methods: list[str]) -> list[dict]:
    """Per method: tokens/s per tree and repeat, medians, the new/old ratio, and whether tokens and acceptance
    agree across trees and repeats."""
    rows = []
    for method in methods:
        rates: dict[str, list[float]] = {}
        outputs = set()
        for tree, tree_runs in runs.items():
            for run in tree_runs:
                mine = [r for r in run["results"] if r["method"] == method]
                rates.setdefault(tree, []).append(sum(len(r["tokens"]) for r in mine) / sum(r["seconds"] for r in mine))
                outputs.add(json.dumps([(r["prompt"], r["tokens"], r["acceptance"]) for r in mine]))
        mine = [r for r in runs["new"][0]["results"] if r["method"] == method]
        paired = [n / o for n, o in zip(rates["new"], rates["old"])]
        rows.append({
            "method": method,
            "old_tok_s": statistics.median(rates["old"]),
            "new_tok_s": statistics.median(rates["new"]),
            "ratio": statistics.median(rates["new"]) / statistics.median(rates["old"]),
            "paired_min": min(paired),
            "paired_max": max(paired),
            "old_runs": rates["old"],
            "new_runs": rates["new"],
            "new_tokens": sum(len(r["tokens"]) for r in mine),
            "mean_acceptance": sum(sum(r["acceptance"]) for r in mine) / sum(len(r["acceptance"]) for r in mine),
            "identical": len(outputs) == 1,
        })
    return rows


def markdown_table(rows: list[dict]) -> str:
    head = ("| method | old tok/s | new tok/s | new/old | per-repeat new/old | new tokens | mean acceptance | "
            "identical tokens and acceptance |\n|---|---:|---:|---:|---:|---:|---:|:---:|\n")
    return head + "\n".join(
        f"| {r['method']} | {r['old_tok_s']:.1f} | {r['new_tok_s']:.1f} | {r['ratio']:.2f}x | "
        f"{r['paired_min']:.2f}-{r['paired_max']:.2f} | {r['new_tokens']} | {r['mean_acceptance']:.2f} | "
        f"{'yes' if r['identical'] else 'NO'} |" for r in rows) + "\n"


def prompt_ids(target: str | None, path: Path | None, num_prompts: int) -> list[list[int]]:
    """The demo's prompt, then the first ``num_prompts`` bench prompts, through the target's chat template."""
    from transformers import AutoTokenizer

    from ddtree.apps.demo import DEFAULT_PROMPT
    from ddtree.bench.prompts import encode_row, load_prompts
    from ddtree.loading.pretrained import smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(target or smollm2_path())
    demo = encode_row({"messages": [{"role": "user", "content": DEFAULT_PROMPT}]}, tokenizer, None)
    more = load_prompts(path, tokenizer, limit=num_prompts) if num_prompts > 0 else []
    return [demo] + [p.input_ids for p in more]


EXAMPLES = [
    "python -m ddtree.bench eager-regression --old ../old --repeats 5 --max-new-tokens 96 --out bench_out/eager",
]


def build_parser():
    from ddtree.apps.cli import parser

    p = parser("python -m ddtree.bench eager-regression", __doc__, EXAMPLES)
    p.add_argument("--old", type=Path, required=True, help="the other source tree (the folder holding ddtree/)")
    p.add_argument("--new", type=Path, default=NEW_TREE, help="this tree, or another to compare (default: this)")
    p.add_argument("--target", default=None, help="target model directory (None: the shipped SmolLM2-135M pair)")
    p.add_argument("--drafter", default=None, help="drafter directory (None: the shipped drafter)")
    p.add_argument("--prompts", type=Path, default=None, help="JSONL prompt file (None: the bench's prompts)")
    p.add_argument("--num-prompts", type=int, default=2,
                   help="bench prompts after the demo's prompt (0: the demo's alone)")
    p.add_argument("--methods", default=METHODS,
                   help="comma-separated: plain (target alone), chain (block size - 1 deep), NAME@BUDGET")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per prompt and method")
    p.add_argument("--repeats", type=int, default=5, help="child runs per tree, alternating; medians over them")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one child may run")
    p.add_argument("--out", type=Path, default=None, help="write eager_regression.json and .md here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    for name, tree in trees.items():
        if not (tree / "ddtree" / "__init__.py").is_file():
            raise SystemExit(f"--{name} {tree}: no ddtree/ package there; give the folder that holds ddtree/")
    methods = [m for m in args.methods.split(",") if m]
    spec = {"target": args.target, "drafter": args.drafter, "threads": args.threads, "methods": methods,
            "max_new_tokens": args.max_new_tokens, "prompts": prompt_ids(args.target, args.prompts, args.num_prompts)}
    load = [os.getloadavg()[0]]
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(args.repeats):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            runs[name].append(run_child(trees[name], spec, args.timeout))
            load.append(os.getloadavg()[0])
            print(f"repeat {r + 1}/{args.repeats}: {name} done (load {load[-1]:.1f})", flush=True)
    rows = summarize(runs, methods)
    table = markdown_table(rows)
    print()
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"trees": {k: str(v) for k, v in trees.items()}, "threads": args.threads, "methods": methods,
                "prompts": len(spec["prompts"]), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                "load_average_1min": load}
        (args.out / "eager_regression.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (args.out / "eager_regression.md").write_text(table)
    return 0 if all(r["identical"] for r in rows) else 1
