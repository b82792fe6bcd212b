"""A taken model's decode forward straight through its parts (``ddtree.targets.exact_forward``).

It must be transformers' forward to the bit (logits, kept hidden states, cache) wherever it takes a forward,
decode with the same tokens and acceptance, and leave to transformers every forward something could tell
apart: hooks on the model or its decoder, a layer's replaced forward, every hidden state asked for, an unknown
keyword, fast numerics.
"""

from __future__ import annotations

import pytest
import torch
from tiny import WINDOW, family_target, tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.targets import exact_forward, exact_layers, native

pytestmark = pytest.mark.skipif(not native.available(), reason=f"kernels: {native.unavailable_reason()}")

PROMPTS = [[(7 * i + 3) % 90 + 1 for i in range(3 * WINDOW + 1)], [(5 * i + 11) % 90 + 1 for i in range(2 * WINDOW)]]


def _target(family: str, dtype: torch.dtype):
    return tiny_target("qwen3", dtype=dtype) if family == "qwen3" else family_target(family, dtype=dtype)


def _tree(seed: int):
    from ddtree.core.tree import DraftTree

    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5]).expand(2, -1)
    return DraftTree.from_parents(torch.randint(3, 90, parents.shape, generator=torch.Generator().manual_seed(seed)),
                                  parents)


def _forwards(target, gen, monkeypatch, *, shift: int = 0):
    """After a padded two-row prefill: a tree verify keeping four hidden states (the embedding's, the first
    layer's, a middle one's, the last), a padded one-token step and an unpadded one; returns what each gave
    (logits, kept hidden states, the cache after it) and how many of them ran transformers' model forward."""
    from ddtree.targets.cache import new_target_cache, padding_mask, stack_rows, truncate
    from ddtree.targets.forward import chunked_prefill, target_forward

    decoder_class = type(target.model)
    inner, ran = decoder_class.forward, []
    monkeypatch.setattr(decoder_class, "forward", lambda *a, **k: ran.append(1) or inner(*a, **k))
    num = target.config.num_hidden_layers
    layers = [-1, 0, num // 2, num - 1]
    results, steps = [], 0

    def forward(cache, *args, **kwargs):
        nonlocal steps
        before = len(ran)
        out = target_forward(target, *args, **kwargs)
        steps += len(ran) > before
        results.append((out.logits, out.hidden_states if kwargs.get("hidden") else None,
                        [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]))

    def prefilled(prompts):
        caches = []
        for p in prompts:
            caches.append(new_target_cache(target))
            chunked_prefill(target, torch.tensor([p]), caches[-1], None)
        return stack_rows(caches, [len(p) for p in prompts])

    with torch.inference_mode():
        lengths = torch.tensor([len(p) for p in PROMPTS])
        width = int(lengths.max())
        cache = prefilled(PROMPTS)
        tree = _tree(0)
        kwargs = gen.backend.tree_forward_kwargs(target, tree, width, gen.dtype,
                                                 prefix_valid=padding_mask(lengths, width))
        forward(cache, tree.tokens, lengths[:, None] + tree.depths + shift, cache, hidden=True, layers=layers,
                **kwargs)
        truncate(cache, width)
        mask = torch.cat([padding_mask(lengths, width), torch.ones(2, 1)], 1).long()
        forward(cache, tree.tokens[:, :1], lengths[:, None] + shift, cache, hidden=True, last=1, layers=layers,
                attention_mask=mask)
        one = prefilled(PROMPTS[:1])
        forward(one, torch.tensor([[5]]), None, one, hidden=False, last=1)
    monkeypatch.setattr(decoder_class, "forward", inner)
    return results, steps


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_direct_forward_is_transformers_forward_to_the_bit(family, dtype, monkeypatch):
    """A tree verify, a padded step and an unpadded one, straight through the parts and through transformers'
    forward: the same logits, kept hidden states (the embedding's, the post-norm last one) and cache, bit for
    bit; transformers' model forward ran for none of them on the direct path."""
    target = _target(family, dtype)
    gen = SpeculativeGenerator(target, tiny_drafter(target), numerics="exact", prompt_lookup=False)
    direct, ran = _forwards(target, gen, monkeypatch)
    exact_forward.uninstall(target)
    own, own_ran = _forwards(target, gen, monkeypatch)
    assert ran == 0 and own_ran == 3
    for (logits, hidden, cache), (want_logits, want_hidden, want_cache) in zip(direct, own):
        assert torch.equal(logits, want_logits) and _same(hidden, want_hidden) and _same(cache, want_cache)
    assert direct[0][1][0] is not None and direct[0][1][-1] is not None and direct[0][1][2] is None


def test_control_the_comparison_sees_a_position_off_by_one(monkeypatch):
    """The same comparison with the positions one further on (the rotary tables' rounding only) fails."""
    target = _target("llama", torch.bfloat16)
    gen = SpeculativeGenerator(target, tiny_drafter(target), numerics="exact", prompt_lookup=False)
    shifted, _ = _forwards(target, gen, monkeypatch, shift=1)
    exact_forward.uninstall(target)
    own, _ = _forwards(target, gen, monkeypatch)
    assert not torch.equal(shifted[0][0], own[0][0]) and not torch.equal(shifted[1][0], own[1][0])


def test_hooks_replaced_forwards_and_unknown_keywords_go_to_transformers(monkeypatch):
    """A forward hook on the model, a pre-hook on its decoder, a decoder layer's forward replaced, every hidden
    state asked for, or a keyword the direct forward does not know: transformers' forward runs it (the hooks
    fire) with the same logits; with them gone the direct forward runs again. A fast generator built on the
    target afterwards takes it away."""
    from ddtree.targets.cache import new_target_cache
    from ddtree.targets.forward import chunked_prefill, target_forward

    target = _target("qwen3", torch.float32)
    SpeculativeGenerator(target, tiny_drafter(target), numerics="exact", prompt_lookup=False)
    inner, ran = type(target.model).forward, []
    monkeypatch.setattr(type(target.model), "forward", lambda *a, **k: ran.append(1) or inner(*a, **k))

    def step(hidden=False, **kwargs):
        with torch.inference_mode():
            cache = new_target_cache(target)
            chunked_prefill(target, torch.tensor([PROMPTS[1]]), cache, None)
            ran.clear()
            out = target_forward(target, torch.tensor([[9]]), None, cache, hidden=hidden, last=1, **kwargs)
        return out.logits, len(ran)

    want, direct = step()
    assert direct == 0
    seen: list[int] = []
    layer = target.model.layers[1]
    layer_forward = layer.forward
    for add, remove in (
            (lambda: target.register_forward_hook(lambda *a: seen.append(1)), lambda h: h.remove()),
            (lambda: target.model.register_forward_pre_hook(lambda *a: seen.append(1)), lambda h: h.remove()),
            (lambda: setattr(layer, "forward", lambda *a, **k: seen.append(1) or layer_forward(*a, **k)),
             lambda h: setattr(layer, "forward", layer_forward))):
        handle = add()
        logits, calls = step()
        remove(handle)
        assert calls == 1 and seen and torch.equal(logits, want)
        seen.clear()
        logits, calls = step()
        assert calls == 0 and not seen and torch.equal(logits, want)
    assert step(hidden=True)[1] == 1  # every layer's hidden state: transformers' capture
    assert step(output_attentions=False)[1] == 1
    SpeculativeGenerator(target, tiny_drafter(target), numerics="fast", prompt_lookup=False)
    assert step()[1] == 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decoding_through_the_direct_forward_is_decoding_through_transformers(family, monkeypatch):
    """Exact speculative decoding of a padded batch, float32, longer than the sliding window, with the direct
    forward and without it: the same tokens and the same acceptance per round, and trees were accepted."""
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])

    def run(direct: bool):
        target = _target(family, torch.float32)
        if not direct:
            monkeypatch.setattr(exact_forward, "install", lambda model: False)
        gen = SpeculativeGenerator(target, tiny_drafter(target), numerics="exact", tree_budget=6,
                                   prompt_lookup=False)
        monkeypatch.undo()
        assert (exact_forward._PARTS in vars(target)) == direct
        return gen.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, stop_token_ids=())

    direct, own = run(True), run(False)
    assert direct.sequences.tolist() == own.sequences.tolist()
    assert direct.row_acceptance == own.row_acceptance
    assert max(a for row in direct.row_acceptance for a in row) > 1


def test_the_argument_layouts_are_the_c_codes():
    """The layer's and the stack's argument arrays have as many slots as the C code reads (a slot added on one
    side only would shift every later one)."""
    lib = native.library()[0]
    assert lib.ddtree_decoder_layer_slots() == len(exact_layers._SLOTS)
    assert lib.ddtree_decoder_stack_slots() == len(exact_layers._SHARED)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_unpadded_prefill_runs_through_the_c_layers_as_a_chain(family, dtype, monkeypatch):
    """A prompt prefilled on the row kernels, whole and in chunks shorter than the window, keeping the drafter's
    hidden states: through the C layers as a chain (transformers' decoder forward runs for none of its
    forwards) and through transformers' modules, the same logits, kept hidden states and cache, bit for bit. A
    padded batch's prefill still goes to transformers."""
    from ddtree.targets.cache import new_target_cache
    from ddtree.targets.forward import chunked_prefill

    target = _target(family, dtype)
    SpeculativeGenerator(target, tiny_drafter(target), numerics="exact", prompt_lookup=False)
    inner, ran = type(target.model).forward, []
    monkeypatch.setattr(type(target.model), "forward", lambda *a, **k: ran.append(1) or inner(*a, **k))
    num = target.config.num_hidden_layers

    def prefill(ids, chunk, valid=None):
        cache, kept = new_target_cache(target), []
        ran.clear()
        with torch.inference_mode():
            logits = chunked_prefill(target, ids, cache, chunk, valid=valid, hidden=True, layers=[0, num - 1],
                                     on_chunk=lambda s, e, out: kept.append(out.hidden_states))
        return (logits, kept, [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]), len(ran)

    ids = torch.tensor([PROMPTS[0]])
    for chunk in (None, WINDOW - 1):
        chained, calls = prefill(ids, chunk)
        assert calls == 0
        with monkeypatch.context() as m:
            m.setattr(exact_forward, "start_cache", lambda *a: False)
            own, own_calls = prefill(ids, chunk)
        assert own_calls == len(own[1]) >= 1
        assert _same(chained, own)
    width = max(map(len, PROMPTS))
    padded = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    valid = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    assert prefill(padded, None, valid)[1] == 1
