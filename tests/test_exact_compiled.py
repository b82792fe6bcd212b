"""``compile=True`` under ``numerics="exact"``: the compiled round's target forward is one operator that runs the
exact kernels, so its tokens are plain decoding's and its trees and acceptance the eager exact round's.

Bitwise at the operator: every node of a random tree, verified through the row-packed cache of a ragged batch,
equals (``torch.equal``) one-token steps along its path; the control is the fast compiled verify, which
differs in bfloat16. End to end, traced (``aot_eager``, which functionalizes the operator's cache writes) and
under inductor.
"""

from __future__ import annotations

import pytest
import torch
from test_exact_numerics import _one_token_logits, _prefilled, _tree
from test_generator import expected_acceptance
from test_static_round import (  # noqa: F401 (fresh_dynamo: an autouse fixture, applied here too)
    BACKEND,
    NEW,
    assert_one_read_per_round,
    assert_same_rounds,
    fresh_dynamo,
    graph_breaks,
    run,
)
from tiny import WINDOW, tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.drafters.dflash.drafter import DFlashDrafter
from ddtree.targets import native
from ddtree.targets.static_cache import RowPackedCache, packed_tree_mask

pytestmark = pytest.mark.skipif(not native.available(), reason=f"kernels: {native.unavailable_reason()}")

PROMPTS = [[(7 * i + 3) % 90 + 1 for i in range(3 * WINDOW + 1)], [(5 * i + 11) % 90 + 1 for i in range(2 * WINDOW)]]
SAMPLED = dict(do_sample=True, temperature=1.0, top_p=0.9, seed=[5, 6])


def _packed(target, prompts) -> tuple[RowPackedCache, torch.Tensor]:
    """Each row prefilled alone, then copied row-packed (the static round's layout), and the rows' lengths."""
    from ddtree.targets.cache import stack_rows

    lengths = [len(p) for p in prompts]
    cache = stack_rows([_prefilled(target, p)[0] for p in prompts], lengths)
    return RowPackedCache.from_cache(cache, lengths, 256), torch.tensor(lengths)


def _verify_logits(gen, target, prompts, tree) -> torch.Tensor:
    """The tree's logits ``[B, N, V]`` from the compiled round's verify: the exact operator, or under fast
    numerics the dense-mask forward through the same row-packed cache."""
    cache, lengths = _packed(target, prompts)
    positions = lengths[:, None] + tree.depths
    if gen.options.numerics == "exact":
        from ddtree.targets.exact_static import ExactDecode

        logits, _ = ExactDecode(target)(tree.tokens, positions, cache.keys, cache.values, lengths, tree.visibility,
                                        tree.depths, None)
        return logits
    from ddtree.generation.static_round import _takes_cache_position

    cache.set_write_columns(lengths[:, None] + torch.arange(tree.num_nodes))
    mask = packed_tree_mask(tree.visibility, tree.depths, lengths, cache.capacity, gen.dtype)
    extra = {"cache_position": torch.arange(tree.num_nodes)} if _takes_cache_position(type(target)) else {}
    return target(input_ids=tree.tokens, position_ids=positions, attention_mask=mask, past_key_values=cache,
                  use_cache=True, **extra).logits


def _node_mismatches(family: str, dtype: torch.dtype, numerics: str) -> list[tuple[int, int]]:
    target = tiny_target(family, dtype=dtype)
    gen = SpeculativeGenerator(target, tiny_drafter(target), numerics=numerics, compile=BACKEND,
                               prompt_lookup=False, tree_budget=4)
    tree = _tree(len(PROMPTS), seed=0)
    with torch.inference_mode():
        logits = _verify_logits(gen, target, PROMPTS, tree)
        bad = []
        for b, prompt in enumerate(PROMPTS):
            single = _prefilled(target, prompt)[0]
            for n in range(tree.num_nodes):
                path = tree.visibility[b, n].nonzero().flatten().tolist()
                step = _one_token_logits(target, single, tree.tokens[b, path].tolist(), len(prompt))
                if not torch.equal(step, logits[b, n]):
                    bad.append((b, n))
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "qwen2"])
def test_the_operators_nodes_have_the_one_token_steps_bits(family, dtype):
    """Every node of a random tree (depths past the window's edge), in a ragged batch of two rows in the
    row-packed cache, equals one-token steps along its path after its row's own prefill."""
    assert _node_mismatches(family, dtype, "exact") == []


def test_control_the_fast_compiled_verify_differs_in_bf16():
    assert _node_mismatches("llama", torch.bfloat16, "fast")


def _pair(family: str, dtype: torch.dtype):
    target = tiny_target(family, dtype=dtype, sharpen=False)  # flat logits: near-ties are common
    return target, DFlashDrafter(tiny_drafter(target, block_size=5), target)


@pytest.mark.parametrize("rule", ["greedy", "sampled"])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_the_compiled_exact_round_decodes_plainly(family, rule):
    """bfloat16, a ragged batch, with the lookup branch: the traced round's tokens are plain decoding's (the
    eager exact generator's, each row alone), and each round accepted exactly what its tree spells of them (the
    target's keyed draw at a node is plain decoding's at its position); so does a plain compiled step (budget
    0). The drafter's own bf16 bits may differ from the eager round's (its static context), so trees are not
    compared here: float32 below."""
    target, drafter = _pair(family, torch.bfloat16)
    call = {"stop_token_ids": ()} if rule == "greedy" else dict(SAMPLED, stop_token_ids=())
    eager = SpeculativeGenerator(target, drafter, numerics="exact", tree_budget=0, prompt_lookup=True)
    plain = [eager.generate(torch.tensor([p]), max_new_tokens=NEW + 8,
                            **dict(call, seed=call["seed"][b]) if "seed" in call else call).row_tokens[0]
             for b, p in enumerate(PROMPTS)]
    gen = SpeculativeGenerator(target, drafter, numerics="exact", tree_budget=4, prompt_lookup=True,
                               compile=BACKEND)
    static, _ = run(gen, PROMPTS, **call)
    assert graph_breaks() == 0
    for b in range(len(PROMPTS)):
        assert static.new_tokens[b] == plain[b][:NEW]
        assert static.acceptance[b] == [expected_acceptance(r, PROMPTS[b] + plain[b]) for r in static.records[b]]
    assert max(max(a) for a in static.acceptance) > 1  # trees were accepted past their root
    flat = SpeculativeGenerator(target, drafter, numerics="exact", tree_budget=0, compile=BACKEND)
    out = flat.generate(PROMPTS, max_new_tokens=NEW, **call)
    assert out.row_tokens == [t[:NEW] for t in plain]


def test_one_host_read_per_round():
    target, drafter = _pair("llama", torch.bfloat16)
    gen = SpeculativeGenerator(target, drafter, numerics="exact", tree_budget=4, compile=BACKEND)
    compiled, _ = run(gen, PROMPTS, stop_token_ids=())
    assert_one_read_per_round(target, drafter, PROMPTS, compiled, numerics="exact", tree_budget=4)


def test_inductor_compiles_the_round_around_one_operator():
    """``compile=True`` itself, float32, with a draft vocabulary: the verify's code calls the operator once and
    holds no copy of a layer's cache (its writes stay in place), and the draft's every routed linear, the head
    over the draft vocabulary among them, is one packed-kernel call; trees, acceptance and tokens are the eager
    exact round's."""
    from torch._inductor.utils import run_and_get_code

    from ddtree.targets import cpu_linear

    target, drafter = _pair("qwen3", torch.float32)
    drafter.set_draft_vocab(torch.arange(0, target.config.vocab_size, 2))
    prompt = [PROMPTS[1]]
    dynamic, _ = run(SpeculativeGenerator(target, drafter, numerics="exact", tree_budget=6, prompt_lookup=True),
                     prompt, stop_token_ids=())
    gen = SpeculativeGenerator(target, drafter, numerics="exact", tree_budget=6, prompt_lookup=True, compile=True)
    (static, _), code = run_and_get_code(run, gen, prompt, stop_token_ids=())
    assert graph_breaks() == 0
    assert_same_rounds(static, dynamic, 1)
    assert len(code) == 3 and code[1].count("torch.ops.ddtree.exact_decode.default(") == 1
    linears = drafter.cpu_linear_model
    assert linears.head is not None and cpu_linear.routed(linears.head)
    # every routed linear but the context projection (the commit's append runs it) in the draft, and no BLAS
    assert code[0].count("ddtree.packed_linear.default(") == cpu_linear.installed(linears) - 1 > 0
    assert "extern_kernels.mm(" not in code[0] and "extern_kernels.addmm(" not in code[0]
    config, capacity = target.config, static.on_device.static.cache.capacity
    assert f"empty_strided_cpu((1, {config.num_key_value_heads}, {capacity}, {config.head_dim})" not in "\n".join(code)


def test_what_it_cannot_run_is_refused_and_a_later_fast_generator_is_caught():
    target, drafter = _pair("gemma2", torch.float32)
    with pytest.raises(ValueError, match="compile=True with numerics='exact' runs the target's forward as one "
                                         "exact operator, and Gemma2ForCausalLM's decode forward is not one"):
        SpeculativeGenerator(target, drafter, numerics="exact", compile=BACKEND)
    target, drafter = _pair("llama", torch.float32)
    gen = SpeculativeGenerator(target, drafter, numerics="exact", tree_budget=4, compile=BACKEND)
    SpeculativeGenerator(target, drafter, numerics="fast", tree_budget=4)
    with pytest.raises(RuntimeError, match="numerics='exact', but a generator built later on its target prepared "
                                           "it for numerics='fast'.*build a new SpeculativeGenerator"):
        gen.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=4)


@pytest.mark.real_default
def test_compile_defaults_to_exact_where_the_compiled_round_takes_the_target():
    """On a CPU, ``compile=True`` without ``numerics`` is exact for the families the operator runs whole (then
    faster than fast numerics compiled, docs/benchmarks.md) and fast for the rest, whose layers stay as they
    were (an MoE's experts implementation untouched)."""
    target, drafter = _pair("llama", torch.float32)
    assert SpeculativeGenerator(target, drafter, compile=BACKEND).options.numerics == "exact"
    moe = tiny_target("qwen3_moe", dtype=torch.float32)
    moe.set_experts_implementation("batched_mm")
    gen = SpeculativeGenerator(moe, tiny_drafter(moe), compile=BACKEND)
    assert gen.options.numerics == "fast" and moe.config._experts_implementation == "batched_mm"
    assert SpeculativeGenerator(moe, tiny_drafter(moe)).options.numerics == "exact"  # eager: exact as ever


def test_columns_past_the_room_are_refused_before_any_write():
    """The C stack checks every row's new columns against each room's capacity before it runs a layer: a
    row whose length leaves no room for the tree gets a ValueError and the cache keeps its bits (a write past
    the buffer would have gone into other memory)."""
    from ddtree.targets.exact_static import ExactDecode

    target = tiny_target("llama", dtype=torch.float32)
    SpeculativeGenerator(target, tiny_drafter(target), numerics="exact", compile=BACKEND)
    cache, lengths = _packed(target, PROMPTS)
    tree = _tree(len(PROMPTS), seed=0)
    before = [t.clone() for t in (*cache.keys, *cache.values)]
    full = torch.tensor([lengths[0].item(), cache.capacity - tree.num_nodes + 1])  # row 1: one column short
    with torch.inference_mode(), pytest.raises(ValueError, match="past its cache room"):
        ExactDecode(target)(tree.tokens, full[:, None] + tree.depths, cache.keys, cache.values, full,
                            tree.visibility, tree.depths, None)
    assert all(torch.equal(a, b) for a, b in zip(before, (*cache.keys, *cache.values)))
    fits = full - 1
    with torch.inference_mode():
        ExactDecode(target)(tree.tokens, fits[:, None] + tree.depths, cache.keys, cache.values, fits,
                            tree.visibility, tree.depths, None)
    assert not all(torch.equal(a, b) for a, b in zip(before, (*cache.keys, *cache.values)))
