"""``python -m ddtree.bench cpu-linear``: the few-row kernel against BLAS on a whole layer stack.

One pass runs every linear of a target-shaped stack (default: SmolLM2-135M,
30 layers of q/k/v/o/gate/up/down plus the lm_head, about 540 MB of float32
weights, so they come from memory as in a real forward) on ``rows`` input rows.
The figure per row count is the median pass time; its ratio to one row is what
a tree verify of that many nodes costs against a decode step in these layers.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree.targets import cpu_linear, row_kernels

SMOLLM2 = dict(hidden=576, kv=192, intermediate=1536, layers=30, vocab=49152)


def layer_stack(hidden: int, kv: int, intermediate: int, layers: int, vocab: int, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
              (intermediate, hidden), (intermediate, hidden), (hidden, intermediate)] * layers + [(vocab, hidden)]
    return [(torch.randn(o, i, generator=gen) * 0.02).to(dtype) for o, i in shapes]


def time_pass(fn, weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    """Median seconds for one pass of ``fn(x, w)`` over all weights."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(weights[0].dtype) for w in weights}
    times = []
    for _ in range(repeats + 1):  # the first pass is a warm-up
        t0 = time.perf_counter()
        for w in weights:
            fn(xs[w.shape[1]], w)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def run(rows_list: list[int], repeats: int, dims: dict, dtype: torch.dtype = torch.float32) -> list[dict]:
    if not cpu_linear.available():
        raise SystemExit(f"the kernel cannot run here: {cpu_linear.unavailable_reason()}")
    weights = layer_stack(**dims, dtype=dtype)
    packed = {id(w): row_kernels.PackedWeight(w) for w in weights}  # what a routed layer multiplies by
    kernel = lambda x, w: row_kernels.packed_linear(x, packed[id(w)])  # noqa: E731
    out = []
    for rows in rows_list:  # interleaved, so drift hits both alike
        blas = time_pass(F.linear, weights, rows, repeats)
        kern = time_pass(kernel, weights, rows, repeats)
        out.append({"rows": rows, "blas_ms": 1e3 * blas, "kernel_ms": 1e3 * kern, "speedup": blas / kern})
    one = out[0]
    for r in out:
        r["blas_vs_1row_blas"] = r["blas_ms"] / one["blas_ms"]
        r["kernel_vs_1row_blas"] = r["kernel_ms"] / one["blas_ms"]
    return out


def markdown_table(rows: list[dict]) -> str:
    lines = ["| rows | BLAS ms | kernel ms | kernel speedup | BLAS / 1-row BLAS | kernel / 1-row BLAS |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['rows']} | {r['blas_ms']:.1f} | {r['kernel_ms']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['blas_vs_1row_blas']:.2f} | {r['kernel_vs_1row_blas']:.2f} |")
    return "\n".join(lines) + "\n"


EXAMPLES = ["python -m ddtree.bench cpu-linear --rows 1,4,8,16 --threads 1 --out bench_out/cpu_linear"]


def build_parser():
    from ddtree.apps.cli import parser

    p = parser("python -m ddtree.bench cpu-linear", __doc__, EXAMPLES)
    p.add_argument("--rows", default="1,2,4,5,8,9,12,17,24,32", help="comma-separated row counts (first = baseline)")
    p.add_argument("--repeats", type=int, default=5, help="timed passes per row count (the median is reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (the kernel uses as many)")
    p.add_argument("--dims", default=None,
                   help="hidden,kv,intermediate,layers,vocab of the stack (None: SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and inputs (the kernel accumulates in float32 either way)")
    p.add_argument("--out", type=Path, default=None, help="write cpu_linear.json and cpu_linear.md here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dims = dict(SMOLLM2)
    if args.dims:
        dims = dict(zip(SMOLLM2, (int(v) for v in args.dims.split(","))))
        if len(dims) != len(SMOLLM2):
            raise SystemExit("--dims takes five numbers: hidden,kv,intermediate,layers,vocab")
    rows = run([int(r) for r in args.rows.split(",")], args.repeats, dims, getattr(torch, args.dtype))
    table = markdown_table(rows)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"machine": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "dims": dims, "repeats": args.repeats, "dtype": args.dtype}
        (args.out / "cpu_linear.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        (args.out / "cpu_linear.md").write_text(table)
    return 0
