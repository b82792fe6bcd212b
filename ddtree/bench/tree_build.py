"""``python -m ddtree.bench tree-build``: the vectorised best_first against a heap loop.

:func:`heap_best_first` is the straightforward construction of the published
DDTree reference, kept here as the yardstick: pop the best frontier node, push
its next sibling and its first child. Its heap key is
``(-score, depth, parent_pop_index, rank)`` over the top-k lists of
:func:`ddtree.core.builders.ranked_topk`, the tie rule documented in :mod:`ddtree.core.builders`,
so both builders must return the very same tree.

Both builders share the top-k step, so it is timed once and reported apart;
the ratio that matters is the part after top-k (tree growth plus the
:class:`~ddtree.core.tree.DraftTree` with its visibility matrix).
"""

from __future__ import annotations

import heapq
import json
import platform
import struct
import time
from pathlib import Path

import torch

from ddtree.budget.latency import synthetic_logprobs
from ddtree.core.builders import best_first, best_first_from_topk, ranked_topk
from ddtree.core.tree import DraftTree

_F32 = struct.Struct("f")


def _f32(x: float) -> float:
    """Round a sum of two float32 values to float32, as the tensor builders add, so near-ties order alike."""
    return _F32.unpack(_F32.pack(x))[0]


def heap_best_first_from_topk(root_token: int, vals: torch.Tensor, toks: torch.Tensor, budget: int) -> DraftTree:
    """The heap loop over precomputed ranked top-k ``vals``/``toks`` ``[D, k]`` (one row)."""
    depth_max, k = vals.shape
    v, t = vals.float().tolist(), toks.tolist()
    tokens, parents, scores = [root_token], [-1], [0.0]
    if budget == 0 or depth_max == 0 or k == 0:
        return DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores))
    # Entry: (-score, depth, parent_pop_index, rank, parent_score)
    heap = [(-v[0][0], 1, 0, 0, 0.0)]
    while heap and len(tokens) <= budget:
        neg, depth, parent, rank, parent_score = heapq.heappop(heap)
        index = len(tokens)
        tokens.append(t[depth - 1][rank])
        parents.append(parent)
        scores.append(-neg)
        if rank + 1 < k:
            heapq.heappush(heap, (-_f32(parent_score + v[depth - 1][rank + 1]), depth, parent, rank + 1, parent_score))
        if depth < depth_max:
            heapq.heappush(heap, (-_f32(v[depth][0] - neg), depth + 1, index, 0, -neg))
    return DraftTree.from_parents(
        torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores, dtype=torch.float32)
    )


def heap_best_first(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """Builder-protocol wrapper (batch 1): top-k then the heap loop."""
    if logprobs.shape[0] != 1:
        raise ValueError("the heap-loop reference builds one tree at a time (batch 1)")
    k = min(budget, logprobs.shape[-1])
    vals, toks = ranked_topk(logprobs[0].float(), max(k, 1))
    return heap_best_first_from_topk(int(root_tokens.view(-1)[0]), vals[:, :k], toks[:, :k], budget)


def same_tree(a: DraftTree, b: DraftTree) -> bool:
    """Same tokens and parents in the same order, scores equal up to float rounding."""
    return (
        a.tokens.shape == b.tokens.shape
        and torch.equal(a.tokens.long(), b.tokens.long())
        and torch.equal(a.parents.long(), b.parents.long())
        and torch.allclose(a.scores.float(), b.scores.float(), atol=1e-4, rtol=1e-5)
    )


def _min_seconds(fns: dict, repeats: int) -> dict[str, float]:
    """Fastest of ``repeats`` runs of each function, interleaved so that a busy moment on a
    shared machine hits all of them alike; the minimum is the least disturbed figure."""
    for fn in fns.values():
        fn()  # warm-up
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def time_tree_build(budget: int, vocab: int, depth: int = 15, repeats: int = 5, seed: int = 0) -> dict:
    """Seconds (fastest of ``repeats``) for top-k, core best_first and the heap loop; checks the trees are equal."""
    lp = synthetic_logprobs(depth, vocab, seed)
    root = torch.tensor([0])
    k = min(budget, vocab)
    core_tree = best_first(root, lp, budget)
    heap_tree = heap_best_first(root, lp, budget)
    equal = same_tree(core_tree, heap_tree)
    vals, toks = ranked_topk(lp.float(), k)
    t = _min_seconds({
        "topk": lambda: ranked_topk(lp.float(), k),
        "core": lambda: best_first_from_topk(root, vals, toks, budget),
        "heap": lambda: heap_best_first_from_topk(0, vals[0], toks[0], budget),
    }, repeats)
    topk_s, core_after_s, heap_after_s = t["topk"], t["core"], t["heap"]
    core_s = topk_s + core_after_s
    return {
        "budget": budget,
        "vocab": vocab,
        "depth": depth,
        "max_tree_depth": core_tree.max_depth,
        "same_tree": equal,
        "topk_ms": topk_s * 1e3,
        "core_total_ms": core_s * 1e3,
        "core_after_topk_ms": core_after_s * 1e3,
        "heap_after_topk_ms": heap_after_s * 1e3,
        "heap_total_ms": (heap_after_s + topk_s) * 1e3,
        "ratio_after_topk": heap_after_s / core_after_s,
        "ratio_total": (heap_after_s + topk_s) / core_s,
    }


def markdown_table(rows: list[dict]) -> str:
    head = (
        "| budget | vocab | same tree | top-k ms | heap after top-k ms | core after top-k ms | "
        "ratio after top-k | heap total ms | core total ms | ratio total |\n"
        "|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['budget']} | {r['vocab']} | {'yes' if r['same_tree'] else 'NO'} | {r['topk_ms']:.2f} | "
        f"{r['heap_after_topk_ms']:.2f} | {r['core_after_topk_ms']:.2f} | {r['ratio_after_topk']:.1f}x | "
        f"{r['heap_total_ms']:.2f} | {r['core_total_ms']:.2f} | {r['ratio_total']:.1f}x |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


EXAMPLES = ["python -m ddtree.bench tree-build --budgets 64,256 --vocabs 49152 --out bench_out/tree_build"]


def build_parser():
    from ddtree.apps.cli import parser

    p = parser("python -m ddtree.bench tree-build", __doc__, EXAMPLES)
    p.add_argument("--budgets", default="64,256,1024", help="comma-separated tree budgets")
    p.add_argument("--vocabs", default="49152,151936", help="comma-separated vocabulary sizes")
    p.add_argument("--depth", type=int, default=15, help="draft depth D (block size - 1)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per case (the median is reported)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random draft log-probs")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: these ops are too small to split; spare threads only wait)")
    p.add_argument("--out", type=Path, default=None, help="write tree_build.json and tree_build.md here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for vocab in (int(x) for x in args.vocabs.split(",")):
        for budget in (int(x) for x in args.budgets.split(",")):
            rows.append(time_tree_build(budget, vocab, args.depth, args.repeats, args.seed))
            r = rows[-1]
            print(
                f"budget {budget:5d} vocab {vocab:6d}: same={r['same_tree']} "
                f"after top-k heap {r['heap_after_topk_ms']:.2f} ms / core {r['core_after_topk_ms']:.2f} ms "
                f"= {r['ratio_after_topk']:.1f}x",
                flush=True,
            )
    table = markdown_table(rows)
    print()
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"machine": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "depth": args.depth, "repeats": args.repeats}
        (args.out / "tree_build.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (args.out / "tree_build.md").write_text(table)
    return 0 if all(r["same_tree"] for r in rows) else 1
