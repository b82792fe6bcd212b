"""``numerics="exact"``: a tree node's logits are bit for bit the one-token step's, so tokens never depend on
speculation.

Bitwise (``torch.equal``) for every family in float32, bfloat16 and (node by node) float16: each node of a
random tree, verified in one forward with the other nodes and another (padded) row, against one-token forwards
along its path from the row's own batch-1 prefill. End to end: the tokens of every budget, builder, lookup
setting and batch place equal plain decoding's, greedy and sampled. Each check has a control under
``numerics="fast"`` that fails it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_generator import expected_acceptance
from tiny import FAMILIES, WINDOW, family_target, tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.core.tree import DraftTree
from ddtree.targets import native
from ddtree.targets.cache import new_target_cache, padding_mask, stack_rows, truncate
from ddtree.targets.forward import chunked_prefill, target_forward

needs_kernels = pytest.mark.skipif(not native.available(), reason=f"kernels: {native.unavailable_reason()}")
pytestmark = needs_kernels

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROMPTS = [[(7 * i + 3) % 90 + 1 for i in range(3 * WINDOW + 1)], [(5 * i + 11) % 90 + 1 for i in range(2 * WINDOW)]]
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5, 6, 4, 8]  # depths up to 5: past the window's edge with the prompts above


def _tree(rows: int, seed: int) -> DraftTree:
    gen = torch.Generator().manual_seed(seed)
    parents = torch.tensor(PARENTS).expand(rows, -1)
    tokens = torch.randint(3, 90, parents.shape, generator=gen)
    return DraftTree.from_parents(tokens, parents)


def _prefilled(target, prompt):
    cache = new_target_cache(target)
    logits = chunked_prefill(target, torch.tensor([prompt]), cache, None)
    return cache, logits


def _one_token_logits(target, cache, tokens, start):
    """Plain one-token forwards of ``tokens`` from a copy of ``cache`` (``start`` committed tokens): the last
    step's logits. A stateful layer commits its step as plain decoding does."""
    cache = copy.deepcopy(cache)
    for i, token in enumerate(tokens):
        out = target_forward(target, torch.tensor([[token]]), torch.tensor([[start + i]]), cache, hidden=False)
    return out.logits[0, -1]


def _verify_logits(gen, target, prompts, tree):
    """The tree's logits ``[B, N, V]`` from one verify forward over rows prefilled alone and stacked (left padding),
    and each row's batch-1 cache."""
    singles = [_prefilled(target, p)[0] for p in prompts]
    caches = [_prefilled(target, p)[0] for p in prompts]
    lengths = [len(p) for p in prompts]
    cache = stack_rows(caches, lengths)
    width = max(lengths)
    valid = padding_mask(torch.tensor(lengths), width) if len(set(lengths)) > 1 else None
    kwargs = gen.backend.tree_forward_kwargs(target, tree, width, gen.dtype, prefix_valid=valid)
    positions = torch.tensor(lengths)[:, None] + tree.depths
    out = target_forward(target, tree.tokens, positions, cache, hidden=False, **kwargs)
    truncate(cache, width)
    return out.logits, singles


def _node_mismatches(family: str, dtype: torch.dtype, numerics: str, seed: int = 0) -> list[tuple[int, int]]:
    target = family_target(family, dtype=dtype)
    gen = SpeculativeGenerator(target, tiny_drafter(target), numerics=numerics, prompt_lookup=False)
    tree = _tree(len(PROMPTS), seed)
    with torch.inference_mode():
        logits, singles = _verify_logits(gen, target, PROMPTS, tree)
        bad = []
        for b, prompt in enumerate(PROMPTS):
            for n in range(tree.num_nodes):
                path = tree.visibility[b, n].nonzero().flatten().tolist()  # index order is path order
                step = _one_token_logits(target, singles[b], tree.tokens[b, path].tolist(), len(prompt))
                if not torch.equal(step, logits[b, n]):
                    bad.append((b, n))
    return bad


@pytest.mark.parametrize("dtype", [*DTYPES, "fp16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_node_has_the_one_token_steps_bits(family, dtype):
    """Every node of a random tree, in a padded batch of two rows, equals (torch.equal) one-token steps along its
    path after its row's own batch-1 prefill: the tree, the other row and the padding change no bit."""
    assert _node_mismatches(family, {**DTYPES, "fp16": torch.float16}[dtype], "exact") == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
def test_control_fast_numerics_differ_in_bf16(family, dtype):
    """The same check under numerics="fast" fails in bfloat16 and float16: the check can see a one-bit
    difference."""
    assert _node_mismatches(family, dtype, "fast")


# ------------------------------------------------------------------------------------------------------------
# end to end: every speculation setting gives plain decoding's tokens
# ------------------------------------------------------------------------------------------------------------

GRID_PROMPT = [5, 17, 33, 8, 21, 40, 12, 3, 9, 60, 61, 62, 70, 80, 5, 17, 33, 8]
GRID_NEW = 40
BUDGETS = (1, 4, 16, 64, "auto")
BUILDERS = ("chain", "best_first", "beam@2x4")
SAMPLING = dict(do_sample=True, temperature=1.0, top_p=0.9, seed=1234, stop_token_ids=())


def _near_tie_target(dtype):
    """A tiny target without the sharpened head: flat logits, so near-ties are common."""
    return tiny_target("llama", dtype=dtype, sharpen=False)


def _runs(target, drafter, numerics, prompt, **call):
    plain = None
    runs = {}
    for lookup in (False, True):
        gen = SpeculativeGenerator(target, drafter, numerics=numerics, prompt_lookup=lookup)
        if plain is None:  # past the runs' end by the deepest tree, so every round's acceptance is known
            plain = gen.generate(torch.tensor([prompt]), max_new_tokens=GRID_NEW + 66, tree_budget=0, **call)
        for budget in BUDGETS:
            for builder in BUILDERS:
                runs[(lookup, budget, builder)] = gen.generate(
                    torch.tensor([prompt]), max_new_tokens=GRID_NEW, tree_budget=budget, builder=builder,
                    record_trees=True, **call)
    return plain, runs


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rule", ["greedy", "sampled"])
def test_every_budget_builder_and_lookup_gives_plain_decodings_tokens(dtype, rule):
    target = _near_tie_target(DTYPES[dtype])
    call = {} if rule == "greedy" else SAMPLING
    plain, runs = _runs(target, tiny_drafter(target), "exact", GRID_PROMPT, **call)
    ref = plain.sequences[0].tolist()
    assert len(ref) == len(GRID_PROMPT) + GRID_NEW + 66  # no stop token cut it short
    for key, out in runs.items():
        assert out.sequences[0].tolist() == ref[: out.sequences.shape[1]], key
        if rule == "greedy":  # each round accepted exactly what its tree spells of plain decoding's text
            assert out.acceptance_lengths == [expected_acceptance(r, ref) for r in out.rounds], key


def _forks(numerics: str, **call) -> bool:
    target = _near_tie_target(torch.bfloat16)
    plain, runs = _runs(target, tiny_drafter(target), numerics, GRID_PROMPT, **call)
    ref = plain.sequences[0].tolist()
    return any(out.sequences[0].tolist() != ref[: out.sequences.shape[1]] for out in runs.values())


def test_control_the_grid_differs_under_fast_numerics_in_bf16():
    """Under numerics="fast" the same grid forks from plain decoding: greedy, and sampled for one of the first
    five seeds (the keyed noise hides most near-ties)."""
    assert _forks("fast")
    assert any(_forks("fast", **dict(SAMPLING, seed=seed)) for seed in range(5))


BATCH_PROMPTS = [GRID_PROMPT, [11, 2, 2, 40, 61, 7, 9, 33, 12], list(range(10, 41))]


@pytest.mark.parametrize("rule", ["greedy", "sampled"])
def test_a_ragged_batchs_rows_are_their_batch_one_runs(rule):
    """Rows of different lengths, one stopping early: each row's tokens are its own batch-1 plain decoding's, at
    budget 0, 4 and auto (a seed list keys each row by its own seed)."""
    target = _near_tie_target(torch.bfloat16)
    gen = SpeculativeGenerator(target, tiny_drafter(target), numerics="exact")
    seeds = [7, 8, 9]
    alone = [gen.generate(torch.tensor([p]), max_new_tokens=GRID_NEW, tree_budget=0,
                          **(dict(stop_token_ids=()) if rule == "greedy" else dict(SAMPLING, seed=s))).row_tokens[0]
             for p, s in zip(BATCH_PROMPTS, seeds)]
    stop = alone[1][12]  # row 1 stops at its 13th token (its first time at it)
    want = [t[: t.index(stop) + 1] if stop in t else t for t in alone]
    assert len(want[1]) < GRID_NEW
    call = {} if rule == "greedy" else dict(SAMPLING, seed=seeds)
    call["stop_token_ids"] = (stop,)
    for budget in (0, 4, "auto"):
        out = gen.generate(BATCH_PROMPTS, max_new_tokens=GRID_NEW, tree_budget=budget, **call)
        assert out.row_tokens == want, budget


def _prefill_forwards(target, prompts) -> tuple[int, object]:
    from ddtree.generation.prefill import prefill

    calls = []
    handle = target.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        with torch.inference_mode():
            done = prefill(target, prompts)
    finally:
        handle.remove()
    return len(calls), done


def _rows_differ_from_alone(target, prompts, done) -> list[int]:
    """Rows whose batched prefill (last logits and every layer's cached keys on its real columns) is not its
    batch-1 prefill's, bit for bit."""
    width, bad = max(map(len, prompts)), []
    for b, prompt in enumerate(prompts):
        _, alone = _prefill_forwards(target, [prompt])
        same = torch.equal(done.logits[b], alone.logits[0])
        for ours, theirs in zip(done.cache.layers, alone.cache.layers):
            same = same and torch.equal(ours.keys[b, :, width - len(prompt):], theirs.keys[0])
        if not same:
            bad.append(b)
    return bad


def test_short_prompts_prefill_in_one_forward_with_each_rows_batch_one_bits():
    """Prompts up to ROW_PREFILL_MOST tokens prefill as one padded batch on the row kernels (one forward), and
    each row's cache and logits are its batch-1 prefill's to the bit."""
    target = _near_tie_target(torch.bfloat16)
    SpeculativeGenerator(target, tiny_drafter(target), numerics="exact")
    forwards, done = _prefill_forwards(target, BATCH_PROMPTS)
    assert forwards == 1
    assert _rows_differ_from_alone(target, BATCH_PROMPTS, done) == []


def test_a_padded_row_prefill_multiplies_only_real_tokens(monkeypatch):
    """The batched row-kernel prefill hands every packed product its real tokens alone: the rows the products
    compute are the prompts' tokens, not the padded width (and the rows' bits stay their batch-1 bits: the test
    above). A product under only_rows gives the picked rows their own values and zeros elsewhere."""
    from ddtree.targets import row_kernels

    target = _near_tie_target(torch.bfloat16)
    SpeculativeGenerator(target, tiny_drafter(target), numerics="exact")
    rows, real = [], row_kernels.packed_linear

    def counted(x, packed, bias=None):
        only = row_kernels._ONLY.get()
        rows.append(x.shape[:-1].numel() if only is None or x.shape[:-1] != only[0] else only[1].numel())
        return real(x, packed, bias)

    monkeypatch.setattr(row_kernels, "packed_linear", counted)
    forwards, done = _prefill_forwards(target, BATCH_PROMPTS)
    assert forwards == 1 and rows
    layer_products = [r for r in rows if r != len(BATCH_PROMPTS)]  # the LM head takes each row's last token
    assert set(layer_products) == {sum(map(len, BATCH_PROMPTS))}  # not 3 x 31 padded rows
    monkeypatch.undo()
    layer = target.model.layers[0].mlp.up_proj
    packed = row_kernels.PackedWeight(layer.weight)
    x = torch.randn(3, 5, layer.in_features).to(layer.weight.dtype)
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    full = row_kernels.packed_linear(x, packed)
    with row_kernels.only_rows(valid):
        some = row_kernels.packed_linear(x, packed)
        assert torch.equal(row_kernels.packed_linear(x[:2], packed), full[:2])  # another layout: every row
    assert torch.equal(some[valid], full[valid]) and not some[~valid].any() and full[~valid].any()


def test_control_a_padded_blas_prefill_differs_from_rows_alone(monkeypatch):
    """The same batch through BLAS and the causal kernels in one forward (what exact numerics does not do):
    some row's bits differ from its batch-1 prefill's."""
    from ddtree.targets import description

    target = _near_tie_target(torch.bfloat16)
    SpeculativeGenerator(target, tiny_drafter(target), numerics="exact")
    monkeypatch.setattr(description, "ROW_PREFILL_MOST", 0)  # every prefill on BLAS...
    monkeypatch.setattr(description.TargetDescription, "prefill_rows_alone", lambda *a, **k: False)  # ...batched
    forwards, done = _prefill_forwards(target, BATCH_PROMPTS)
    assert forwards == 1
    assert _rows_differ_from_alone(target, BATCH_PROMPTS, done) != []


def test_a_prompt_too_long_for_the_row_kernels_prefills_alone_and_rows_keep_their_tokens(monkeypatch):
    """With one prompt past ROW_PREFILL_MOST the batch prefills row by row (that one on BLAS, the others on
    the row kernels, each as it would alone), and every row decodes its batch-1 tokens."""
    from ddtree.targets import description

    monkeypatch.setattr(description, "ROW_PREFILL_MOST", 20)  # BATCH_PROMPTS: 18, 9 and 31 tokens
    target = _near_tie_target(torch.bfloat16)
    gen = SpeculativeGenerator(target, tiny_drafter(target), numerics="exact")
    forwards, _ = _prefill_forwards(target, BATCH_PROMPTS)
    assert forwards == len(BATCH_PROMPTS)
    alone = [gen.generate(torch.tensor([p]), max_new_tokens=GRID_NEW, tree_budget=0, stop_token_ids=()).row_tokens[0]
             for p in BATCH_PROMPTS]
    for budget in (0, "auto"):
        out = gen.generate(BATCH_PROMPTS, max_new_tokens=GRID_NEW, tree_budget=budget, stop_token_ids=())
        assert out.row_tokens == alone, budget


def test_dflash2_trees_give_plain_decodings_tokens(tmp_path):
    from test_dflash2 import ddtree_checkpoint

    from ddtree.loading.drafter import load_drafter

    target = _near_tie_target(torch.bfloat16)
    drafter = load_drafter(ddtree_checkpoint(target, tmp_path / "d2"), target)
    gen = SpeculativeGenerator(target, drafter, numerics="exact")
    plain = gen.generate(torch.tensor([GRID_PROMPT]), max_new_tokens=GRID_NEW, tree_budget=0)
    for budget in (4, 16, "auto"):
        out = gen.generate(torch.tensor([GRID_PROMPT]), max_new_tokens=GRID_NEW, tree_budget=budget)
        assert torch.equal(out.sequences, plain.sequences), budget


def test_a_drafter_that_knows_the_text_is_accepted_whole():
    """A custom drafter that proposes plain decoding's own continuation (its runner-up ranked first at depth 2):
    every round accepts the whole block, so the exact verify agrees with plain decoding at every node."""
    from tiny import ScriptedDrafter

    target = _near_tie_target(torch.bfloat16)
    gen = SpeculativeGenerator(target, tiny_drafter(target), numerics="exact")
    ref = gen.generate(torch.tensor([GRID_PROMPT]), max_new_tokens=GRID_NEW + 8, tree_budget=0,
                       stop_token_ids=()).sequences
    scripted = ScriptedDrafter(ref, target.config.vocab_size, block_size=5, decoy_at={2: 3})
    gen = SpeculativeGenerator(target, scripted, numerics="exact", tree_budget=8, prompt_lookup=False)
    out = gen.generate(torch.tensor([GRID_PROMPT]), max_new_tokens=GRID_NEW, record_trees=True, stop_token_ids=())
    assert out.sequences.shape[1] == len(GRID_PROMPT) + GRID_NEW
    assert out.sequences[0].tolist() == ref[0, : out.sequences.shape[1]].tolist()
    assert out.acceptance_lengths == [5] * len(out.rounds)


def _wide_mismatches(intermediate: int, threads: int, nodes: int = 33) -> int:
    """Nodes of a tree of a wider llama, on ``threads`` threads, whose logits differ from one-token steps."""
    torch.set_num_threads(threads)
    target = tiny_target("llama", dtype=torch.float32, hidden_size=128, intermediate_size=intermediate, head_dim=32)
    gen = SpeculativeGenerator(target, tiny_drafter(target), numerics="exact", prompt_lookup=False)
    parents = torch.tensor([-1] + [i // 2 for i in range(nodes - 1)])
    tokens = torch.randint(3, 90, (1, nodes), generator=torch.Generator().manual_seed(0))
    tree = DraftTree.from_parents(tokens, parents[None])
    with torch.inference_mode():
        logits, singles = _verify_logits(gen, target, PROMPTS[:1], tree)
        return sum(not torch.equal(logits[0, n], _one_token_logits(
            target, singles[0], tree.tokens[0, tree.visibility[0, n]].tolist(), len(PROMPTS[0])))
            for n in range(nodes))


@pytest.mark.parametrize("intermediate,threads", [(4096, 5), (1000, 1)])
def test_many_threads_and_odd_widths_keep_the_bits(intermediate, threads):
    """On 5 threads torch splits a 33-row activation into chunks whose last partial vectors take scalar code, and an
    MLP width of 1000 leaves a partial vector at the end: exact forwards run torch's own ops on one thread (the
    kernels keep every thread) and activations padded to whole vectors, and every node keeps its bits."""
    assert _wide_mismatches(intermediate, threads) == 0


def test_control_without_those_guards_wide_trees_differ(monkeypatch):
    import contextlib

    from ddtree.runtime import invariant
    from ddtree.targets import exact_layers, numerics

    monkeypatch.setattr(exact_layers, "install", lambda model: 0)  # torch's own ops, as in families not taken
    monkeypatch.setattr(invariant, "torch_single_threaded", contextlib.nullcontext)
    assert _wide_mismatches(4096, 5) > 0
    monkeypatch.setattr(numerics, "_activation_modules", lambda model: [])
    assert _wide_mismatches(1000, 1) > 0


# ------------------------------------------------------------------------------------------------------------
# settings: what exact mode refuses, and why
# ------------------------------------------------------------------------------------------------------------


def test_the_setting_is_checked_and_explained(monkeypatch):
    from ddtree import GeneratorOptions
    from ddtree.runtime.distributed import Lockstep
    from ddtree.targets import numerics

    with pytest.raises(ValueError, match="numerics must be 'fast', 'exact' or None"):
        GeneratorOptions(numerics="bitwise")
    with pytest.raises(ValueError, match="its own row-invariant attention.*attention='auto'"):
        GeneratorOptions(numerics="exact", attention="sdpa")
    target = tiny_target("llama", dtype=torch.float32)
    gen = SpeculativeGenerator(target, tiny_drafter(target), numerics="exact")
    assert gen.options.numerics == "exact" and gen.backend.name == "exact"
    with pytest.raises(ValueError, match="numerics prepares the models, so it is set on the generator"):
        gen.generate(torch.tensor([GRID_PROMPT]), max_new_tokens=4, numerics="fast")
    monkeypatch.setattr(numerics.Lockstep, "for_model", classmethod(lambda cls, model: Lockstep(object())))
    with pytest.raises(ValueError, match="tensor parallelism.*all-reduce.*numerics='fast'"):
        SpeculativeGenerator(tiny_target("llama", dtype=torch.float32), tiny_drafter(target), numerics="exact")


def test_where_the_kernels_cannot_run_exact_is_refused_and_the_default_is_fast(monkeypatch):
    from ddtree.generation import generator

    monkeypatch.setattr(native, "_cpu_flags", lambda: {"sse2"})
    native.library.cache_clear()
    try:
        target = tiny_target("llama", dtype=torch.float32)
        with pytest.raises(ValueError, match="numerics='exact' cannot run LlamaForCausalLM: .*lacks avx2"):
            SpeculativeGenerator(target, tiny_drafter(target), numerics="exact")
        monkeypatch.setitem(generator.DEFAULT_NUMERICS, "cpu", "exact")
        assert SpeculativeGenerator(target, tiny_drafter(target)).options.numerics == "fast"
        meta = tiny_target("llama", dtype=torch.float32).to("meta")
        assert "run on CPU targets, and this one is on meta" in generator.exact_unavailable(meta)
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


def test_another_generator_that_takes_the_linears_back_is_caught():
    from ddtree.targets import cpu_linear

    target = tiny_target("llama", dtype=torch.float32)
    gen = SpeculativeGenerator(target, tiny_drafter(target), numerics="exact", tree_budget=4)
    cpu_linear.uninstall(target)
    with pytest.raises(RuntimeError, match="no longer routed through the row-invariant kernel"):
        gen.generate(torch.tensor([GRID_PROMPT]), max_new_tokens=8)


@pytest.mark.real_default
def test_exact_is_the_cpu_default_and_a_later_fast_generator_takes_the_target_back():
    """On a CPU a generator built without ``numerics`` is exact; one built later on the same target with
    ``compile=True`` (or ``numerics="fast"``) releases the exact kernels, and the exact one then refuses with the
    fix instead of decoding on kernels it does not promise."""
    target = tiny_target("llama", dtype=torch.float32)
    exact = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=4)
    assert exact.options.numerics == "exact"
    prompt = torch.tensor([GRID_PROMPT])
    first = exact.generate(prompt, max_new_tokens=12)
    fast = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=4, numerics="fast")
    assert fast.options.numerics == "fast" and not cpu_linear_routed_exactly(target)
    assert fast.generate(prompt, max_new_tokens=12).sequences.shape == first.sequences.shape
    with pytest.raises(RuntimeError, match="no longer routed.*numerics='fast' or compile=True.*build a new"):
        exact.generate(prompt, max_new_tokens=12)
    again = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=4)
    assert torch.equal(again.generate(prompt, max_new_tokens=12).sequences, first.sequences)


def test_a_hybrid_target_goes_from_exact_to_fast_and_back():
    """On a GDN hybrid the stateful layers' tree forward wraps the exact kernels' routing: a fast generator built
    after an exact one takes both back and routes the GDN layers anew (their tree forward was lost with the
    exact wrappers, and the verify then had no per-node state). Each decodes HF greedy's tokens, each round
    accepting what its tree spells of them."""
    from test_generator import reference

    target = family_target("qwen3_5")
    drafter = tiny_drafter(target)
    prompt = [5, 17, 42, 8, 9, 33, 61, 2]
    ref = reference(target, prompt, new=24)[0].tolist()
    for numerics in ("exact", "fast", "exact"):
        gen = SpeculativeGenerator(target, drafter, numerics=numerics, tree_budget=4)
        out = gen.generate(torch.tensor([prompt]), max_new_tokens=16, record_trees=True, stop_token_ids=())
        assert out.sequences[0].tolist() == ref[: len(prompt) + 16], numerics
        assert out.acceptance_lengths == [expected_acceptance(r, ref) for r in out.rounds], numerics


def cpu_linear_routed_exactly(target) -> bool:
    from ddtree.targets import cpu_linear

    return cpu_linear.routed_exactly(target.get_output_embeddings())


@pytest.mark.real_default
def test_a_generator_sharing_an_exact_ones_backend_stays_exact():
    """Tools build one generator per builder on shared models, passing ``attention=base.backend``: under the
    CPU default each is exact, and the first still decodes (none of them released the target)."""
    target = tiny_target("llama", dtype=torch.float32)
    base = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=0)
    other = SpeculativeGenerator(target, base.drafter, tree_budget=4, builder="chain", attention=base.backend)
    assert base.options.numerics == other.options.numerics == "exact"
    prompt = torch.tensor([GRID_PROMPT])
    plain = base.generate(prompt, max_new_tokens=12)
    assert torch.equal(other.generate(prompt, max_new_tokens=12).sequences, plain.sequences)
    assert torch.equal(base.generate(prompt, max_new_tokens=12).sequences, plain.sequences)
