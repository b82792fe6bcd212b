"""``python -m ddtree.bench tree-build``: the device best_first and chain against the numpy ones and a heap loop.

The device builder (:mod:`ddtree.core.builders`, tensor operations with no host
reads) and the numpy builder (:mod:`ddtree.core.reference_builders`, top-k
copied to the host) are timed side by side, interleaved, at each budget, vocabulary
and batch size, and must return identical trees.

:func:`heap_best_first` is the straightforward construction of the published
DDTree reference, kept here as a second yardstick: pop the best frontier node, push
its next sibling and its first child. Its heap key is
``(-score, depth, parent_pop_index, rank)`` over the top-k lists of
:func:`ddtree.core.builders.ranked_topk`, the tie rule documented in :mod:`ddtree.core.builders`,
so all three builders must return the very same tree.

Top-k over the vocabulary and the growth after it (levels plus the
:class:`~ddtree.core.tree.DraftTree` with its visibility matrix) are timed apart.
"""

from __future__ import annotations

import heapq
import json
import platform
import statistics
import struct
import time
from pathlib import Path

import torch

from ddtree.core import reference_builders as reference
from ddtree.core.builders import best_first, best_first_from_topk, chain, ranked_topk
from ddtree.core.tree import DraftTree


def synthetic_logprobs(depth: int, vocab: int, seed: int) -> torch.Tensor:
    """Drafter-like rows ``[1, depth, vocab]``: a confident head (top-1 0.7 fading to 0.35) over a random tail.

    Peaked like a trained drafter, so best_first trees grow deep (a flat random
    distribution would only ever give depth-1 and depth-2 trees): the trees timed
    are shaped like the trees rounds verify.
    """
    g = torch.Generator().manual_seed(seed)
    fade = torch.linspace(1.0, 0.5, depth).view(depth, 1)
    head = fade * torch.tensor([0.7, 0.12, 0.05, 0.03])  # [depth, 4]
    tail = torch.softmax(torch.randn(depth, vocab, generator=g) * 1.5, dim=-1) * (1.0 - head.sum(-1, keepdim=True))
    ids = torch.stack([torch.randperm(vocab, generator=g)[:4] for _ in range(depth)])
    probs = tail.scatter_add(1, ids, head)
    return probs.log()[None]


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


def identical_trees(a: DraftTree, b: DraftTree) -> bool:
    """Every field equal, bit for bit and dtype for dtype: what the device builders promise the numpy ones."""
    return all(getattr(a, f).dtype == getattr(b, f).dtype and torch.equal(getattr(a, f), getattr(b, f))
               for f in ("tokens", "parents", "depths", "scores", "visibility"))


def _seconds(fns: dict, repeats: int, statistic: str = "median") -> dict[str, float]:
    """Median (or fastest: ``statistic="min"``) of ``repeats`` runs of each function, interleaved so that a
    busy moment on a shared machine hits all of them alike; on a loaded machine, where most runs are
    preempted, the fastest run is the one closest to the work's own cost."""
    for fn in fns.values():
        fn()  # warm-up (and the device builder's per-shape index tables)
    runs: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t0)
    pick = min if statistic == "min" else statistics.median
    return {name: pick(r) for name, r in runs.items()}


def time_tree_build(budget: int, vocab: int, depth: int = 15, repeats: int = 5, seed: int = 0,
                    batch: int = 1, statistic: str = "median") -> dict:
    """Median (or fastest) seconds of the device and the numpy best_first (top-k and the growth after it, each timed
    apart), of the device and the numpy chain and, at batch 1, of the heap loop after top-k; checks that the
    trees are identical."""
    lp = torch.cat([synthetic_logprobs(depth, vocab, seed + b) for b in range(batch)])
    root = torch.zeros(batch, dtype=torch.long)
    k = min(budget, vocab)
    device_tree, numpy_tree = best_first(root, lp, budget), reference.best_first(root, lp, budget)
    equal = identical_trees(device_tree, numpy_tree) and identical_trees(chain(root, lp, depth),
                                                                          reference.chain(root, lp, depth))
    if batch == 1:
        equal = equal and same_tree(device_tree, heap_best_first(root, lp, budget))
    vals, toks = ranked_topk(lp.float(), k)
    fns = {
        "device_topk": lambda: ranked_topk(lp.float(), k),
        "numpy_topk": lambda: reference.ranked_topk(lp.float(), k),
        "device_after": lambda: best_first_from_topk(root, vals, toks, budget),
        "numpy_after": lambda: reference.best_first_from_topk(root, vals, toks, budget),
        "device_chain": lambda: chain(root, lp, depth),
        "numpy_chain": lambda: reference.chain(root, lp, depth),
    }
    if batch == 1:
        fns["heap_after"] = lambda: heap_best_first_from_topk(0, vals[0], toks[0], budget)
    t = {name: s * 1e3 for name, s in _seconds(fns, repeats, statistic).items()}
    device_ms, numpy_ms = t["device_topk"] + t["device_after"], t["numpy_topk"] + t["numpy_after"]
    return {
        "budget": budget,
        "vocab": vocab,
        "batch": batch,
        "depth": depth,
        "max_tree_depth": device_tree.max_depth,
        "same_tree": equal,
        "device_topk_ms": t["device_topk"],
        "numpy_topk_ms": t["numpy_topk"],
        "device_after_topk_ms": t["device_after"],
        "numpy_after_topk_ms": t["numpy_after"],
        "heap_after_topk_ms": t.get("heap_after"),
        "device_total_ms": device_ms,
        "numpy_total_ms": numpy_ms,
        "ratio_after_topk": t["numpy_after"] / t["device_after"],
        "ratio_total": numpy_ms / device_ms,
        "device_chain_ms": t["device_chain"],
        "numpy_chain_ms": t["numpy_chain"],
    }


def markdown_table(rows: list[dict]) -> str:
    head = (
        "| budget | vocab | batch | same tree | top-k ms device / numpy | after top-k ms device / numpy / heap | "
        "ratio after top-k | total ms device / numpy | ratio total | chain ms device / numpy | ratio chain |\n"
        "|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        heap = "-" if r["heap_after_topk_ms"] is None else f"{r['heap_after_topk_ms']:.2f}"
        lines.append(
            f"| {r['budget']} | {r['vocab']} | {r['batch']} | {'yes' if r['same_tree'] else 'NO'} | "
            f"{r['device_topk_ms']:.2f} / {r['numpy_topk_ms']:.2f} | "
            f"{r['device_after_topk_ms']:.2f} / {r['numpy_after_topk_ms']:.2f} / {heap} | "
            f"{r['ratio_after_topk']:.2f}x | {r['device_total_ms']:.2f} / {r['numpy_total_ms']:.2f} | "
            f"{r['ratio_total']:.2f}x | {r['device_chain_ms']:.2f} / {r['numpy_chain_ms']:.2f} | "
            f"{r['numpy_chain_ms'] / r['device_chain_ms']:.2f}x |"
        )
    return head + "\n".join(lines) + "\n"


EXAMPLES = [
    "python -m ddtree.bench tree-build --budgets 4,16,64 --vocabs 49152 --batches 1,4 --out bench_out/tree_build"
]


def build_parser():
    from ddtree.apps.cli import parser

    p = parser("python -m ddtree.bench tree-build", __doc__, EXAMPLES)
    p.add_argument("--budgets", default="4,8,16,32,64", help="comma-separated tree budgets")
    p.add_argument("--vocabs", default="49152,152064", help="comma-separated vocabulary sizes")
    p.add_argument("--batches", default="1,4", help="comma-separated batch sizes (rows of distinct distributions)")
    p.add_argument("--depth", type=int, default=15, help="draft depth D (block size - 1)")
    p.add_argument("--repeats", type=int, default=15, help="timed repeats per case (the median is reported)")
    p.add_argument("--statistic", choices=("median", "min"), default="median",
                   help="per case and function: the median of the repeats, or the fastest (on a loaded machine)")
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
        for batch in (int(x) for x in args.batches.split(",")):
            for budget in (int(x) for x in args.budgets.split(",")):
                rows.append(time_tree_build(budget, vocab, args.depth, args.repeats, args.seed, batch, args.statistic))
                r = rows[-1]
                print(
                    f"budget {budget:5d} vocab {vocab:6d} batch {batch}: same={r['same_tree']} "
                    f"total device {r['device_total_ms']:.2f} ms / numpy {r['numpy_total_ms']:.2f} ms "
                    f"= {r['ratio_total']:.2f}x, ratio after top-k {r['ratio_after_topk']:.2f}x",
                    flush=True,
                )
    table = markdown_table(rows)
    print()
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"machine": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "depth": args.depth, "repeats": args.repeats,
                "statistic": args.statistic}
        (args.out / "tree_build.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (args.out / "tree_build.md").write_text(table)
    return 0 if all(r["same_tree"] for r in rows) else 1
