"""``python -m ddtree.bench hostreads``: host reads per round at steady state, by method and batch.

Every ``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.numpy()``, ``.cpu()`` and device-to-host copy a
round makes is counted (:func:`ddtree.runtime.host_reads.count_host_reads`); on a GPU each one waits for the
device. The pair is tiny and random (a Qwen3 target of hidden 64 and 4 layers, vocabulary 97; a DFlash drafter
of 2 layers, block 8; an untrained DFlash2 drafter of the same size), since reads depend on the code path, not
on the weights. Rounds are counted after the prefill and two warm-up rounds. ``builder`` and ``lookup`` columns
are the reads made inside the tree builders and the graft (:mod:`ddtree.core.builders`,
:mod:`ddtree.core.pairwise`, :mod:`ddtree.core.graft`) and prompt lookup's n-gram matching
(:mod:`ddtree.drafters.lookup`), ``round`` the rest.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from ddtree.bench.dflash2 import MASK, make_drafter, make_target
from ddtree.drafters.dflash.config import DFlashConfig
from ddtree.drafters.dflash.model import DFlashDraftModel
from ddtree.drafters.lookup import PromptLookup, WithLookup
from ddtree.generation.generator import SpeculativeGenerator
from ddtree.generation.round import speculative_round
from ddtree.runtime.host_reads import count_host_reads

METHODS = ("chain", "best_first@4", "best_first@16", "lookup", "best_first@4+lookup", "dflash2@4")
BUILDER_SITES = ("ddtree.core.builders", "ddtree.core.pairwise", "ddtree.core.graft", "ddtree.core.tree")
LOOKUP_SITES = ("ddtree.drafters.lookup",)


@dataclass
class Row:
    method: str
    batch: int
    sampled: bool
    rounds: int
    total: float  # reads per round, all sources
    builder: float
    lookup: float
    round: float  # total less the builder's and lookup's
    sites: dict[str, float]


def make_generators(seed: int = 0, block_size: int = 8) -> dict[str, SpeculativeGenerator]:
    target = make_target(seed)
    torch.manual_seed(seed + 1)
    dflash = DFlashDraftModel(DFlashConfig.for_target(target.config, block_size=block_size, num_hidden_layers=2,
                                                       mask_token_id=MASK)).eval()
    dflash2 = make_drafter(target, block_size, top_k=8, seed=seed + 2).eval()
    gens = {}
    for method in METHODS:
        name, _, budget = method.partition("@")
        budget, merged = (budget.removesuffix("+lookup"), budget.endswith("+lookup"))
        common = dict(threads=None, attention="sdpa", prompt_lookup=False)
        if name == "lookup":
            gens[method] = SpeculativeGenerator(target, PromptLookup.for_target(target, block_size=block_size),
                                                tree_budget=block_size - 1, builder="chain", **common)
        elif name == "dflash2":
            gens[method] = SpeculativeGenerator(target, dflash2, tree_budget=int(budget), builder="best_first",
                                                **common)
        else:
            gen = SpeculativeGenerator(target, dflash, tree_budget=int(budget) if budget else block_size - 1,
                                       builder="chain" if name == "chain" else "best_first", **common)
            if merged:
                lookup = PromptLookup.for_target(target, block_size=block_size)
                gen = SpeculativeGenerator(target, WithLookup(gen.drafter, lookup), tree_budget=int(budget),
                                           builder="best_first", **common)
            gens[method] = gen
    return gens


def prompts(batch: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of different lengths (a ragged batch), with a repeat that lookup can match."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        head = torch.randint(3, MASK, (6 + 3 * b,), generator=g).tolist()
        rows.append(head + head[:5])
    return rows


def measure(gen: SpeculativeGenerator, batch: int, sampled: bool, rounds: int, warm: int = 2) -> Row | None:
    options = dict(do_sample=True, temperature=0.8, seed=0) if sampled else dict(do_sample=False)
    state = gen.start(prompts(batch), max_new_tokens=400, stop_token_ids=(), **options)
    for _ in range(1 + warm):
        speculative_round(state)
    counted = []
    for _ in range(rounds):
        if state.done:
            break
        with count_host_reads() as reads:
            speculative_round(state)
        counted.append(reads)
    if not counted:
        return None
    n = len(counted)
    total = sum(r.count for r in counted) / n
    builder = sum(r.sites(p) for r in counted for p in BUILDER_SITES) / n
    lookup = sum(r.sites(p) for r in counted for p in LOOKUP_SITES) / n
    sites: dict[str, float] = {}
    for r in counted:
        for site, k in r.by_site.items():
            sites[site] = sites.get(site, 0) + k / n
    return Row("", batch, sampled, n, total, builder, lookup, total - builder - lookup, sites)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddtree.bench hostreads", description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    ap.add_argument("--batches", default="1,4", help="batch sizes (rows of different prompt lengths)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds counted per case")
    ap.add_argument("--sites", action="store_true", help="also print where each case's reads come from")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(METHODS)}")
    gens = make_generators()
    rows = []
    print(f"{'method':<22}{'batch':>6}{'mode':>9}{'total':>8}{'builder':>9}{'lookup':>8}{'round':>8}")
    for method in methods:
        for batch in [int(b) for b in args.batches.split(",")]:
            for sampled in (False, True):
                row = measure(gens[method], batch, sampled, args.rounds)
                if row is None:
                    continue
                row.method = method
                rows.append(row)
                mode = "sampled" if sampled else "greedy"
                print(f"{method:<22}{batch:>6}{mode:>9}{row.total:>8.1f}{row.builder:>9.1f}{row.lookup:>8.1f}"
                      f"{row.round:>8.1f}")
                if args.sites:
                    for site, k in sorted(row.sites.items(), key=lambda kv: -kv[1]):
                        print(f"      {k:5.1f}  {site}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([row.__dict__ for row in rows], f, indent=1)
    return 0
