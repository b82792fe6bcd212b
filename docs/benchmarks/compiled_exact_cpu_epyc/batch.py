"""The compiled exact round against the eager exact default on the default pair, in one process, alternating:
a batch of the held-out prompts, 64 new tokens, three timed calls each after one warm-up call (which compiles).

    python docs/benchmarks/compiled_exact_cpu_epyc/batch.py DTYPE BUDGET BATCH

``BUDGET``: an int (0: plain decoding) or ``auto``. Prints each side's numerics, warm-up seconds, the timed
calls' wall seconds and median, whether the two sides' tokens were equal, and the compiled / eager time.
"""

import statistics
import sys
import time

import torch

from ddtree import SpeculativeGenerator
from ddtree.bench.prompts import load_prompts

torch.set_num_threads(2)
dtype, budget_arg, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
budget = budget_arg if budget_arg == "auto" else int(budget_arg)
gens = {name: SpeculativeGenerator.from_pretrained(dtype=dtype, tree_budget=budget, compile=compiled, threads=2)
        for name, compiled in (("default", False), ("compiled", True))}
tokenizer = gens["default"].tokenizer
vocab = gens["default"].target.get_input_embeddings().weight.shape[0]
prompts = [list(p.input_ids) for p in load_prompts(None, tokenizer, vocab, limit=12)][:batch]
print({name: gen.options.numerics for name, gen in gens.items()})
for name, gen in gens.items():
    start = time.perf_counter()
    gen.generate(prompts, max_new_tokens=16)
    print("warm-up", name, round(time.perf_counter() - start, 1), "s")
times: dict[str, list[float]] = {name: [] for name in gens}
tokens = {}
for _ in range(3):
    for name, gen in gens.items():
        start = time.perf_counter()
        out = gen.generate(prompts, max_new_tokens=64)
        times[name].append(time.perf_counter() - start)
        tokens.setdefault(name, out.row_tokens)
print("same tokens", tokens["default"] == tokens["compiled"])
for name, seconds in times.items():
    print(name, [round(s, 2) for s in seconds], "median", round(statistics.median(seconds), 2))
print("compiled / default time", round(statistics.median(times["compiled"]) / statistics.median(times["default"]), 3))
