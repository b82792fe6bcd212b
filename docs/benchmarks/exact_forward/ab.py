"""Side by side in one process, alternating: ddtree's decode forward straight through the model's parts
(``ddtree.targets.exact_forward``) against transformers' model forward (``direct``), its layers as one C call
against one call each (``stack``), the default budget against plain decoding (``default``), or the drafter's
linears on the packed kernel against torch's (``drafter``, the default budget or ``BUDGET``), on the default
pair.

    python docs/benchmarks/exact_forward/ab.py direct DTYPE BATCH PAIRS [auto]
    python docs/benchmarks/exact_forward/ab.py stack DTYPE BATCH PAIRS
    python docs/benchmarks/exact_forward/ab.py default DTYPE BATCH PAIRS
    python docs/benchmarks/exact_forward/ab.py drafter DTYPE BATCH PAIRS [BUDGET]

Prints the median wall seconds of a call (64 new tokens for ``direct``, 96 for ``default``) and, for
``direct`` and ``stack``, the verify stage's seconds a round; and whether the two sides' tokens were equal.
"""

import statistics
import sys
import time

from ddtree import SpeculativeGenerator
from ddtree.bench.prompts import load_prompts
from ddtree.targets import cpu_linear, exact_forward, exact_layers, row_kernels

ONE_CALL = exact_layers._DecoderStack.run


def one_call_each(stack, x, embeddings, spec, mask, store):
    """``_DecoderStack.run`` with every layer its own C call, each prepared from Python as transformers' path
    prepares it (``_prepare``)."""
    if not stack._check(x, False):
        return None
    plans = [vars(m)[exact_layers._PLAN] for m in stack.modules]
    tables = exact_layers._row_tables(embeddings, x.shape[0], x.shape[1], plans[0].d)
    outputs = x.new_empty((len(plans), *x.shape))
    calls, inp = [], x.contiguous()
    for plan, out in zip(plans, outputs):
        calls.append((plan, exact_layers._prepare(plan, store.layers, inp, out, tables, spec, mask, stack)))
        inp = out
    for plan, (layer, room, held, _) in calls:
        row_kernels.decoder_layer(plan.ints, plan.floats)
        layer.keys, layer.values = room[0].narrow(2, 0, held + x.shape[1]), room[1].narrow(2, 0, held + x.shape[1])
    return outputs


def main() -> None:
    what, dtype, batch, pairs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    gen = SpeculativeGenerator.from_pretrained(None, None, dtype=dtype, threads=2)
    vocab = gen.target.get_input_embeddings().weight.shape[0]
    prompts = [p.input_ids for p in load_prompts(None, gen.tokenizer, vocab, limit=12)][:batch]
    if what in ("direct", "stack"):
        sides = ("transformers", "direct") if what == "direct" else ("one call each", "one call")
        fixed = {} if sys.argv[5:] == ["auto"] else {"tree_budget": 0}
        options = {side: fixed for side in sides}
        new_tokens = 64
    elif what == "drafter":
        sides = ("torch", "kernel")
        fixed = {} if sys.argv[5:] in ([], ["auto"]) else {"tree_budget": int(sys.argv[5])}
        options = {side: fixed for side in sides}
        new_tokens = 96
    else:
        sides = ("plain", "default")
        options = {"plain": {"tree_budget": 0}, "default": {}}
        new_tokens = 96
    drafter_model = gen.drafter.cpu_linear_model
    for side in sides:
        gen.generate(prompts, max_new_tokens=8, **options[side])
    seconds: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    tokens: dict[str, list] = {}
    for pair in range(pairs):
        for side in sides if pair % 2 == 0 else sides[::-1]:
            if what == "direct":
                if side == "direct":
                    assert exact_forward.install(gen.target)
                else:
                    exact_forward.uninstall(gen.target)
            elif what == "stack":
                exact_layers._DecoderStack.run = ONE_CALL if side == "one call" else one_call_each
            elif what == "drafter":
                if side == "kernel":
                    cpu_linear.install(drafter_model, exact=True)
                else:
                    cpu_linear.uninstall(drafter_model)
            start = time.perf_counter()
            out = gen.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=(), **options[side])
            wall = time.perf_counter() - start
            seconds[side].append((wall, out.stats.seconds["verify"] / out.stats.rounds))
            tokens.setdefault(side, out.sequences.tolist())
    exact_forward.install(gen.target)
    exact_layers._DecoderStack.run = ONE_CALL
    for side in sides:
        walls, rounds = zip(*seconds[side])
        verify = 1000 * statistics.median(rounds)
        print(f"{side}: wall {statistics.median(walls):.3f} s, verify {verify:.2f} ms a round")
    ratio = statistics.median(w for w, _ in seconds[sides[1]]) / statistics.median(w for w, _ in seconds[sides[0]])
    print(f"{sides[1]} / {sides[0]} wall: {ratio:.3f}; same tokens: {tokens[sides[0]] == tokens[sides[1]]}")


if __name__ == "__main__":
    main()
