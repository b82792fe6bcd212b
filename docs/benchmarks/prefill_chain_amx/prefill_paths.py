"""The default pair's exact prefill through the C decoder layers as a chain against transformers' modules
(``exact_forward.start_cache`` answering False), in one process, alternating:

    python docs/benchmarks/prefill_chain_amx/prefill_paths.py

Checks first that both give the same logits, cache and kept hidden states, bit for bit (6 prompts; whole, in
chunks of 16, and keeping three of the drafter's layers), then prints the median over 5 passes of the 12
prompts' prefill time per prompt.
"""
import statistics
import time

import torch

from ddtree import SpeculativeGenerator
from ddtree.bench.prompts import load_prompts
from ddtree.targets import exact_forward
from ddtree.targets import forward as target_forward
from ddtree.targets.cache import new_target_cache

REAL = exact_forward.start_cache


def prefill(target, prompt, chain, chunk=None, layers=None):
    """``chunked_prefill`` on a fresh cache, through the C layers (``chain``) or transformers' modules."""
    exact_forward.start_cache = REAL if chain else (lambda *a: False)
    cache, kept = new_target_cache(target), []
    try:
        with torch.inference_mode():
            logits = target_forward.chunked_prefill(
                target, prompt.view(1, -1), cache, chunk, hidden=layers is not None, layers=layers,
                on_chunk=(lambda s, e, out: kept.append(out.hidden_states)) if layers else None)
    finally:
        exact_forward.start_cache = REAL
    return logits, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers], kept


for dtype in ("bfloat16", "float32"):
    gen = SpeculativeGenerator.from_pretrained(dtype=dtype, threads=2)
    target = gen.target
    vocab = target.get_input_embeddings().weight.shape[0]
    prompts = [torch.tensor(p.input_ids) for p in load_prompts(None, gen.tokenizer, vocab, limit=12)]
    same = True
    for prompt in prompts[:6]:
        for chunk, layers in ((None, None), (16, None), (None, [1, 5, 9])):
            a, b = prefill(target, prompt, True, chunk, layers), prefill(target, prompt, False, chunk, layers)
            same &= torch.equal(a[0], b[0]) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                                    for x, y in zip(a[1], b[1]))
            same &= all(torch.equal(h, g) for ka, kb in zip(a[2], b[2]) for h, g in zip(ka, kb) if h is not None)
    times = {True: [], False: []}
    for _ in range(5):
        for chain in (True, False):
            t0 = time.perf_counter()
            for prompt in prompts:
                prefill(target, prompt, chain)
            times[chain].append((time.perf_counter() - t0) / len(prompts))
    print(f"{dtype}: bitwise equal {same}; ms a prompt: chain {statistics.median(times[True]) * 1e3:.1f}, "
          f"modules {statistics.median(times[False]) * 1e3:.1f}")
