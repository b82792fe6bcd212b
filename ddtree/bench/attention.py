"""Micro-benchmark of one tree-verify attention layer: each backend against dense-mask SDPA.

``python -m ddtree.bench attention`` times the per-layer attention call of the
verify forward at the shape of one Qwen3-8B layer (32 query heads, 8 KV heads,
head_dim 128, bf16) for contexts 1k..32k and tree budgets 16..1024, prints a
table and writes JSON. The dense baseline is transformers' own
``sdpa_attention_forward`` with the additive ``[prefix | tree]`` mask, exactly
what a target runs under ``attention="sdpa"``; its mask is built once per
forward and shared by all layers, so it is timed separately (``mask_ms``).
The split backends are timed through their registered attention functions; ``exact`` (a CPU with the
row-invariant kernels) is :func:`ddtree.targets.row_kernels.tree_attention`, what ``numerics="exact"`` runs.
A budget of 0 is a one-token decoding step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from ddtree.core.masks import tree_attention_mask
from ddtree.core.tree import DraftTree
from ddtree.targets import native, row_kernels
from ddtree.targets.kernels import flash_attn_available
from ddtree.targets.registration import (
    IMPLEMENTATIONS,
    TREE_KWARG,
    TreeAttentionSpec,
    register_attention_implementations,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


class _Layer(torch.nn.Module):
    """Stands in for an HF attention module: the attributes attention functions read."""

    def __init__(self, num_heads: int, num_kv_heads: int, window: int | None):
        super().__init__()
        self.num_key_value_groups = num_heads // num_kv_heads
        self.is_causal = True
        self.sliding_window = window


def random_tree(num_nodes: int, max_depth: int, generator: torch.Generator) -> DraftTree:
    """A random tree of ``num_nodes`` nodes (root included) no deeper than ``max_depth``, parents before children."""
    parents, depths = [-1], [0]
    for i in range(1, num_nodes):
        while True:
            p = int(torch.randint(0, i, (1,), generator=generator))
            if depths[p] < max_depth:
                break
        parents.append(p)
        depths.append(depths[p] + 1)
    return DraftTree.from_parents(torch.zeros(num_nodes, dtype=torch.long), torch.tensor(parents))


def parse_sizes(text: str) -> list[int]:
    """``"1k,4k,300"`` -> ``[1024, 4096, 300]``."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return out


def time_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall-clock milliseconds of ``fn()`` (CUDA synchronised around each call)."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(samples)


def available_backends(device: torch.device) -> list[str]:
    """Backends that can run on ``device`` (flash_attn needs CUDA and the package; exact, a CPU and the
    row-invariant kernels)."""
    names = ["sdpa", "split", "fused"]
    if device.type == "cuda" and flash_attn_available():
        names.append("flash_attn")
    if device.type == "cpu" and native.available():
        names.append("exact")
    return names


def _dense_reference(q, k, v, mask, scale) -> torch.Tensor:
    """float32 dense masked attention, ``[B, N, Hq, D]`` like the attention functions return."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = _Layer(q.shape[1], k.shape[1], None)
    out, _ = sdpa_attention_forward(layer, q.float(), k.float(), v.float(), mask.float(), scaling=scale)
    return out


def bench_case(
    context: int, budget: int, *, backends: list[str], num_heads: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device, window: int | None, max_depth: int, warmup: int, repeats: int,
    seed: int = 0, check: bool = True,
) -> list[dict]:
    """Time every backend on one (context, budget) case; rows carry ms, speed-up and error vs float32 dense."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(seed)
    n = budget + 1
    tree = random_tree(n, max_depth, gen)
    tree = DraftTree.from_parents(tree.tokens.to(device), tree.parents.to(device))
    q = torch.randn(1, num_heads, n, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(1, num_kv_heads, context + n, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(1, num_kv_heads, context + n, head_dim, generator=gen).to(device, dtype)
    scale = 1.0 / math.sqrt(head_dim)
    layer = _Layer(num_heads, num_kv_heads, window)

    def build_mask():
        return tree_attention_mask(tree.visibility, context, dtype, sliding_window=window, depths=tree.depths)

    mask = build_mask()
    mask_ms = time_ms(build_mask, device, warmup, repeats)
    reference = _dense_reference(q, k, v, mask, scale) if check else None
    spec = TreeAttentionSpec.from_tree(tree)
    register_attention_implementations()
    functions = AttentionInterface()
    calls = {
        "sdpa": lambda: sdpa_attention_forward(layer, q, k, v, mask, scaling=scale)[0],
    }
    for name in backends:
        if name in IMPLEMENTATIONS:
            fn = functions[IMPLEMENTATIONS[name][0]]
            calls[name] = lambda fn=fn: fn(
                layer, q, k, v, None, scaling=scale, sliding_window=window, **{TREE_KWARG: spec}
            )[0]
    if "exact" in backends:
        depths = tree.depths.view(1, n).cpu()
        start = ((context + depths - window + 1).clamp(min=0) if window else torch.zeros_like(depths))
        visible = tree.visibility.view(1, n, n).cpu()
        calls["exact"] = lambda: row_kernels.tree_attention(q, k, v, start, visible, scale=scale)
    rows, base = [], None
    for name in backends:
        ms = time_ms(calls[name], device, warmup, repeats)
        base = ms if name == "sdpa" else base
        err = float((calls[name]().float() - reference).abs().max()) if check else None
        rows.append({
            "context": context, "budget": budget, "nodes": n, "max_depth": tree.max_depth, "backend": name,
            "ms": ms, "mask_ms": mask_ms if name == "sdpa" else 0.0, "speedup_vs_sdpa": None,
            "max_abs_err_vs_fp32_dense": err,
        })
    for row in rows:
        if base is not None:
            row["speedup_vs_sdpa"] = base / row["ms"]
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'context':>8} {'budget':>6} {'backend':>10} {'ms':>9} {'mask_ms':>8} {'vs sdpa':>8} {'max err':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        speed = f"{r['speedup_vs_sdpa']:.2f}x" if r["speedup_vs_sdpa"] is not None else "-"
        err = f"{r['max_abs_err_vs_fp32_dense']:.2e}" if r["max_abs_err_vs_fp32_dense"] is not None else "-"
        lines.append(
            f"{r['context']:>8} {r['budget']:>6} {r['backend']:>10} {r['ms']:>9.3f} {r['mask_ms']:>8.3f} "
            f"{speed:>8} {err:>9}"
        )
    return "\n".join(lines)


EXAMPLES = [
    "python -m ddtree.bench attention",
    "python -m ddtree.bench attention --device cpu --dtype fp32 --contexts 1k,4k --budgets 16,64 "
    "--heads 8 --kv-heads 2",
    "python -m ddtree.bench attention --device cpu --dtype bf16 --contexts 128,1k --budgets 0,8 --heads 9 "
    "--kv-heads 3 --head-dim 64 --backends exact",
]


def build_parser() -> argparse.ArgumentParser:
    from ddtree.apps.cli import parser

    p = parser("python -m ddtree.bench attention", __doc__, EXAMPLES)
    p.add_argument("--contexts", default="1k,4k,16k,32k", help="committed prefix lengths (k = 1024)")
    p.add_argument("--budgets", "--trees", dest="budgets", default="16,64,256,1024",
                   help="tree budgets (non-root nodes)")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="tensor dtype")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--backends", default="all",
                   help="comma list of sdpa,split,fused,flash_attn,exact, or all available")
    p.add_argument("--window", type=int, default=None, help="time a sliding-window layer with this window")
    p.add_argument("--max-depth", type=int, default=15, help="tree depth cap (DFlash block size - 1)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before timing")
    p.add_argument("--repeats", type=int, default=10, help="timed calls (the median is reported)")
    p.add_argument("--no-check", action="store_true", help="skip the float32 dense reference (saves memory)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random queries, keys and values")
    p.add_argument("--out", default=None, help="JSON path (None: $OUT/attention_bench.json when OUT is set)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    backends = available_backends(device)
    if args.backends != "all":
        wanted = [b.strip() for b in args.backends.split(",")]
        unknown = [b for b in wanted if b not in backends]
        if unknown:
            raise SystemExit(f"backends not available on {device}: {unknown}; available: {backends}")
        backends = ["sdpa"] + [b for b in wanted if b != "sdpa"]
    dtype = DTYPES[args.dtype]
    rows = []
    print(f"attention bench on {device} ({args.dtype}, {args.heads} q heads, {args.kv_heads} kv heads, "
          f"head_dim {args.head_dim}, window {args.window})")
    print("\n".join(format_table([]).split("\n")[:2]), flush=True)
    for context in parse_sizes(args.contexts):
        for budget in parse_sizes(args.budgets):
            rows += bench_case(
                context, budget, backends=backends, num_heads=args.heads, num_kv_heads=args.kv_heads,
                head_dim=args.head_dim, dtype=dtype, device=device, window=args.window, max_depth=args.max_depth,
                warmup=args.warmup, repeats=args.repeats, seed=args.seed, check=not args.no_check,
            )
            print(format_table(rows[-len(backends):]).split("\n", 2)[-1], flush=True)
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "flash_attn": _flash_attn_version(),
        "rows": rows,
    }
    write_result(result, args.out, "attention_bench.json")
    return result


def write_result(result: dict, out: str | None, default_name: str) -> None:
    """Write a micro-benchmark's JSON to ``out``, else to ``$OUT/default_name`` when ``$OUT`` is set."""
    out = out or (os.path.join(os.environ["OUT"], default_name) if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")


def _flash_attn_version() -> str | None:
    if not flash_attn_available():
        return None
    try:
        import flash_attn

        return getattr(flash_attn, "__version__", "unknown")
    except Exception as exc:  # a broken install is worth reporting, not crashing the bench
        return f"import failed: {exc}"


if __name__ == "__main__":
    main()
