"""The tree attention kernel of two builds of row_invariant.c side by side in one process (alternating).

    git show 2d6ac8c:ddtree/targets/csrc/row_invariant.c > /tmp/before.c
    python docs/benchmarks/prefill_chain_amx/attention_builds.py /tmp/before.c ddtree/targets/csrc/row_invariant.c

Each case is 30 calls (a 30-layer model), SmolLM2's heads (9 query, 3 key-value, 64 wide); prints the median of 7
passes per build and whether the builds' outputs are bitwise equal.
"""
import statistics
import sys
import time
from pathlib import Path

import torch

from ddtree.targets import native, row_kernels

torch.set_num_threads(2)
builds = sys.argv[1:]
libs = {}
for source in builds:
    native.SOURCE = Path(source)
    native.library.cache_clear()
    libs[source] = native.library()[0]


def use(source):
    row_kernels._LIB[0] = libs[source]
    native.library = lambda lib=libs[source]: (lib, None)


torch.manual_seed(0)
cases = {}
for name, bsz, n, prefix, dtype in [("prefill 46 tokens bf16", 1, 46, 0, torch.bfloat16),
                                    ("prefill 12 x 55 tokens bf16", 12, 55, 0, torch.bfloat16),
                                    ("padded prefill 12 x 55 tokens bf16", 12, 55, 0, torch.bfloat16),
                                    ("prefill 46 tokens f32", 1, 46, 0, torch.float32),
                                    ("chain of 16 after 300 bf16", 1, 16, 300, torch.bfloat16),
                                    ("decode step batch 12 after 150 bf16", 12, 1, 150, torch.bfloat16)]:
    q = torch.randn(bsz, 9, n, 64).to(dtype)
    k, v = (torch.randn(bsz, 3, prefix + n, 64).to(dtype) for _ in range(2))
    visible = torch.tril(torch.ones(n, n, dtype=torch.bool)).expand(bsz, n, n).contiguous()
    if name.startswith("padded"):  # row b's first 2b columns padding, seen by no token (a pad sees nothing)
        pads = torch.arange(bsz) * 2
        visible = visible & (torch.arange(n) >= pads.view(-1, 1, 1))
    cases[name] = (q, k, v, torch.zeros(bsz, n, dtype=torch.long), visible, torch.full((bsz,), prefix))
times = {(c, b): [] for c in cases for b in builds}
outs = {}
for _ in range(7):
    for b in builds:
        use(b)
        for c, (q, k, v, start, visible, ends) in cases.items():
            t0 = time.perf_counter()
            for _ in range(30):
                outs[(c, b)] = row_kernels.tree_attention(q, k, v, start, visible, scale=0.125, prefix_end=ends)
            times[(c, b)].append(time.perf_counter() - t0)
for c in cases:
    cells = " | ".join(f"{Path(b).name}: {statistics.median(times[(c, b)]) * 1e3:.2f} ms" for b in builds)
    print(f"{c}: {cells} | bitwise equal: {all(torch.equal(outs[(c, builds[0])], outs[(c, b)]) for b in builds)}")
