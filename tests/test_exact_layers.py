"""Exact numerics' row-wise layer ops and the modules they stand in for (``ddtree.targets.exact_layers``).

The ops must compute what transformers' modules compute (rotary embedding bit for bit, the norms and the
SwiGLU activation to the dtype's rounding), give each row the same bits whatever shares the call, and the
taken modules must decode as transformers' own: the same tokens and acceptance, windows, biases, q/k norms and
padded rows included. That a tree node still gets the one-token step's bits through them is
``tests/test_exact_numerics.py``'s node-level test, for every family.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny import WINDOW, family_target, tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.targets import exact_layers, native, row_kernels

pytestmark = pytest.mark.skipif(not native.available(), reason=f"kernels: {native.unavailable_reason()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(*shape, dtype, seed=0, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + shift).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_transformers_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = _rand(2, 5, 6, 64, dtype=dtype), _rand(2, 5, 2, 64, dtype=dtype, seed=1)
    angles = _rand(2, 5, 64, dtype=torch.float32, seed=2, scale=30.0)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert torch.equal(row_kernels.rotary(q.clone(), cos, sin), want_q.transpose(1, 2))
    assert torch.equal(row_kernels.rotary(k.clone(), cos, sin), want_k.transpose(1, 2))
    # the check sees one rounding: rotating in float32 and rounding once is not transformers' arithmetic
    if dtype != torch.float32:
        once = (q.float() * cos.float()[:, :, None] + torch.cat((-q[..., 32:], q[..., :32]), -1).float()
                * sin.float()[:, :, None]).to(dtype)
        assert not torch.equal(once, want_q.transpose(1, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_activation_compute_their_modules_functions(dtype):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = _rand(7, 320, dtype=dtype, scale=3.0, shift=0.5)
    eps = torch.finfo(dtype).eps
    llama, gemma = LlamaRMSNorm(320, eps=1e-6).to(dtype), Gemma2RMSNorm(320, eps=1e-6).to(dtype)
    with torch.no_grad():
        for norm in (llama, gemma):
            norm.weight.copy_(_rand(320, dtype=dtype, seed=3, scale=0.5))
        for norm, style in ((llama, "llama"), (gemma, "gemma")):
            want = norm(x).float()
            got = row_kernels.rms_norm(x, norm.weight, 1e-6, style).float()
            assert ((got - want).abs() <= 4 * eps * want.abs() + 1e-30).all(), style
        # the styles are different functions: Llama's style is not a Gemma norm
        assert not torch.allclose(row_kernels.rms_norm(x, gemma.weight, 1e-6, "llama").float(), gemma(x).float())
    gate, up = _rand(7, 1000, dtype=dtype, seed=4, scale=4.0), _rand(7, 1000, dtype=dtype, seed=5)
    want = (torch.nn.functional.silu(gate) * up).float()
    got = row_kernels.silu_mul(gate, up).float()
    assert ((got - want).abs() <= 2 * eps * want.abs() + 2 * eps * want.abs().amax() * 1e-3).all()


@pytest.fixture(params=["native", "avx2"])
def build(request, monkeypatch):
    """This CPU's widest build and the portable AVX2 one."""
    monkeypatch.setenv("DDTREE_KERNEL_ARCH", request.param)
    native.library.cache_clear()
    row_kernels._LIB[0] = None
    yield request.param
    monkeypatch.undo()
    native.library.cache_clear()
    row_kernels._LIB[0] = None


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_gets_the_same_bits_whatever_shares_the_call(dtype, build):
    """37 rows on 4 threads against each row alone on one: equal bits (widths with partial blocks), on both
    builds."""
    rows, width = 37, 1000
    x = _rand(rows, width, dtype=dtype, scale=2.0)
    w = _rand(width, dtype=dtype, seed=1)
    up = _rand(rows, width, dtype=dtype, seed=2)
    q = _rand(rows, 3, 72, dtype=dtype, seed=3)
    angles = _rand(rows, 72, dtype=torch.float32, seed=4, scale=10.0)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        together = (row_kernels.rms_norm(x, w, 1e-5), row_kernels.silu_mul(x, up),
                    row_kernels.rotary(q.clone(), cos, sin))
        torch.set_num_threads(1)
        for r in range(rows):
            alone = (row_kernels.rms_norm(x[r:r + 1], w, 1e-5), row_kernels.silu_mul(x[r:r + 1], up[r:r + 1]),
                     row_kernels.rotary(q[r:r + 1].clone(), cos[r:r + 1], sin[r:r + 1]))
            for a, t in zip(alone, together):
                assert torch.equal(a[0], t[r]), r
    finally:
        torch.set_num_threads(threads)


def test_bad_inputs_are_refused_by_name():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="rms_norm: the weight must be a contiguous \\(8,\\) vector"):
        row_kernels.rms_norm(x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="style must be one of llama, float, gemma"):
        row_kernels.rms_norm(x, torch.ones(8), 1e-6, "t5")
    with pytest.raises(ValueError, match="one dtype among float32, bfloat16 and float16"):
        row_kernels.silu_mul(x, x.double())
    with pytest.raises(ValueError, match="rotary: x must be contiguous"):
        row_kernels.rotary(torch.randn(2, 3, 7), torch.randn(2, 7), torch.randn(2, 7))


def _taken(target) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for module in target.modules():
        if "_ddtree_exact_layer" in vars(module):
            name = type(module).__name__
            kind = ("attention" if "Attention" in name else "mlp" if "MLP" in name else "layer"
                    if "DecoderLayer" in name else vars(module)["_ddtree_norm_style"][0])
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def test_which_modules_are_taken_and_given_back():
    """Recognised modules only: Llama's norms, MLPs, attention and whole layers; Gemma's (1 + weight) norms as
    Gemma's; not Cohere's LayerNorm (it subtracts the mean) nor Gemma's GELU MLP; a fast generator gives them all
    back."""
    llama = tiny_target("llama", dtype=torch.float32)
    SpeculativeGenerator(llama, tiny_drafter(llama), numerics="exact")
    layers = llama.config.num_hidden_layers
    assert _taken(llama) == {"attention": layers, "mlp": layers, "llama": 2 * layers + 1, "layer": layers}
    assert exact_layers.installed(llama) == 5 * layers + 1
    gemma = family_target("gemma2", dtype=torch.bfloat16)
    SpeculativeGenerator(gemma, tiny_drafter(gemma), numerics="exact")
    assert _taken(gemma) == {"gemma": 4 * gemma.config.num_hidden_layers + 1}
    cohere = family_target("cohere2", dtype=torch.bfloat16)
    SpeculativeGenerator(cohere, tiny_drafter(cohere), numerics="exact")
    assert set(_taken(cohere)) == {"mlp"}
    SpeculativeGenerator(llama, tiny_drafter(llama), numerics="fast")
    assert exact_layers.installed(llama) == 0 and "forward" not in vars(llama.model.layers[0].self_attn)


PROMPTS = [[(7 * i + 3) % 90 + 1 for i in range(3 * WINDOW + 1)], [(5 * i + 11) % 90 + 1 for i in range(2 * WINDOW)]]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2"])
def test_taken_modules_decode_as_transformers_modules_do(family, monkeypatch):
    """Exact decoding with the modules taken and with transformers' own (the kernels for the products either
    way), float32, a padded batch of two rows longer than the sliding window: the same tokens and acceptance."""
    def run(take: bool):
        target = (tiny_target("qwen3", dtype=torch.float32) if family == "qwen3"
                  else family_target(family, dtype=torch.float32))
        if not take:
            monkeypatch.setattr(exact_layers, "install", lambda model: 0)
        gen = SpeculativeGenerator(target, tiny_drafter(target), numerics="exact", tree_budget=6,
                                   prompt_lookup=False)
        assert (exact_layers.installed(target) > 0) == take
        width = max(map(len, PROMPTS))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
        monkeypatch.undo()
        return gen.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, stop_token_ids=())

    taken, own = run(True), run(False)
    assert taken.sequences.tolist() == own.sequences.tolist()
    assert taken.row_acceptance == own.row_acceptance
    assert max(a for row in taken.row_acceptance for a in row) > 1  # the trees were verified, not only roots


@contextlib.contextmanager
def _prefill_on_modules():
    """A setup prefill through transformers' modules, as every prefill ran before the C layers took unpadded
    ones (``tests/test_exact_forward.py`` checks those): the tests here count the verify's and the step's
    checks and C calls alone."""
    from ddtree.targets import exact_forward

    real = exact_forward.start_cache
    exact_forward.start_cache = lambda *a: False
    try:
        yield
    finally:
        exact_forward.start_cache = real


def _tree_logits(target, prompts, tree, module_path: bool):
    """A verify forward of ``tree`` over ``prompts`` (left-padded), through the C decoder layers or, with a
    no-op hook on every attention block, module by module; returns the logits and the number of C layer calls."""
    from ddtree.targets.cache import new_target_cache, padding_mask, stack_rows, truncate
    from ddtree.targets.forward import chunked_prefill, target_forward

    gen = SpeculativeGenerator(target, tiny_drafter(target), numerics="exact", prompt_lookup=False)
    with _c_layer_calls(target, module_path) as calls, torch.inference_mode():
        caches = []
        for p in prompts:
            cache = new_target_cache(target)
            with _prefill_on_modules():
                chunked_prefill(target, torch.tensor([p]), cache, None)
            caches.append(cache)
        lengths = [len(p) for p in prompts]
        cache = stack_rows(caches, lengths)
        width = max(lengths)
        kwargs = gen.backend.tree_forward_kwargs(target, tree, width, gen.dtype,
                                                 prefix_valid=padding_mask(torch.tensor(lengths), width))
        out = target_forward(target, tree.tokens, torch.tensor(lengths)[:, None] + tree.depths, cache,
                             hidden=False, **kwargs)
        keys = [layer.keys.clone() for layer in cache.layers]
        truncate(cache, width)  # then a one-token step without a tree spec (a padding mask), as HF steps
        mask = torch.cat([padding_mask(torch.tensor(lengths), width), torch.ones(len(prompts), 1)], 1).long()
        step = target_forward(target, tree.tokens[:, :1], torch.tensor(lengths)[:, None], cache, hidden=False,
                              attention_mask=mask)
    return torch.cat([out.logits, step.logits], 1), keys, len(calls)


@contextlib.contextmanager
def _c_layer_calls(target, module_path: bool):
    """Inside, a list that grows by one per C decoder layer call; with ``module_path``, a no-op hook on every
    attention block sends each layer to its modules."""
    calls, real, real_stack = [], row_kernels.decoder_layer, row_kernels.decoder_stack
    handles = [m.register_forward_hook(lambda *a: None) for m in target.modules()
               if module_path and type(m).__name__.endswith("Attention")]
    try:
        row_kernels.decoder_layer = lambda *a: (calls.append(1), real(*a))[1]
        row_kernels.decoder_stack = lambda i, f, count, s: (calls.extend([1] * count), real_stack(i, f, count, s))[1]
        yield calls
    finally:
        row_kernels.decoder_layer, row_kernels.decoder_stack = real, real_stack
        for h in handles:
            h.remove()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_decoder_layer_is_the_module_paths_bits(family, dtype):
    """A padded two-row tree verify and a one-token step through the C decoder layers give the module-by-module
    path's logits and cache, bit for bit (so a forward may take either); the C path ran in every layer."""
    from ddtree.core.tree import DraftTree

    target = tiny_target("qwen3", dtype=dtype) if family == "qwen3" else family_target(family, dtype=dtype)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5]).expand(2, -1)
    tree = DraftTree.from_parents(torch.randint(3, 90, parents.shape, generator=torch.Generator().manual_seed(0)),
                                  parents)
    fused, fused_keys, calls = _tree_logits(target, PROMPTS, tree, module_path=False)
    modules, module_keys, none = _tree_logits(target, PROMPTS, tree, module_path=True)
    assert calls == 2 * target.config.num_hidden_layers and none == 0  # the tree and the one-token step
    assert torch.equal(fused, modules)
    assert all(torch.equal(a, b) for a, b in zip(fused_keys, module_keys))


def test_control_the_comparison_sees_one_rounding(monkeypatch):
    """With the module path's activation computed by torch (silu, then the product: other last bits in float32)
    the same comparison fails."""
    from ddtree.core.tree import DraftTree

    target = family_target("llama", dtype=torch.float32)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5]).expand(2, -1)
    tree = DraftTree.from_parents(torch.randint(3, 90, parents.shape, generator=torch.Generator().manual_seed(0)),
                                  parents)
    fused, _, _ = _tree_logits(target, PROMPTS, tree, module_path=False)
    monkeypatch.setattr(row_kernels, "silu_mul", lambda g, u: torch.nn.functional.silu(g) * u)
    modules, _, _ = _tree_logits(target, PROMPTS, tree, module_path=True)
    assert not torch.equal(fused, modules)


def test_the_c_layer_follows_a_weight_changed_in_place():
    """A weight changed in place after the C layer's plan was made: the next forward repacks it (the module
    path's logits, and not the old ones)."""
    from ddtree.core.tree import DraftTree

    target = family_target("llama", dtype=torch.float32)
    parents = torch.tensor([-1, 0, 0, 1]).expand(2, -1)
    tree = DraftTree.from_parents(torch.randint(3, 90, parents.shape, generator=torch.Generator().manual_seed(1)),
                                  parents)
    before, _, _ = _tree_logits(target, PROMPTS, tree, module_path=False)
    with torch.no_grad():
        target.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    after, _, calls = _tree_logits(target, PROMPTS, tree, module_path=False)
    modules, _, _ = _tree_logits(target, PROMPTS, tree, module_path=True)
    assert calls > 0 and not torch.equal(after, before) and torch.equal(after, modules)


def _four_node_tree(seed: int):
    """A two-row tree of four nodes (root, two children, a grandchild) with random tokens."""
    from ddtree.core.tree import DraftTree

    parents = torch.tensor([-1, 0, 0, 1]).expand(2, -1)
    return DraftTree.from_parents(torch.randint(3, 90, parents.shape, generator=torch.Generator().manual_seed(seed)),
                                  parents)


def _record_checks_and_calls(monkeypatch) -> list[str]:
    """The order of plan checks ("check") and C layer calls ("C") from here on."""
    events: list[str] = []
    current, call, stack = exact_layers._LayerPlan.current, row_kernels.decoder_layer, row_kernels.decoder_stack
    monkeypatch.setattr(exact_layers._LayerPlan, "current", lambda plan: events.append("check") or current(plan))
    monkeypatch.setattr(row_kernels, "decoder_layer", lambda *a: events.append("C") or call(*a))
    monkeypatch.setattr(row_kernels, "decoder_stack",
                        lambda i, f, count, s: events.extend(["C"] * count) or stack(i, f, count, s))
    return events


def test_a_forward_checks_its_layers_once_and_sees_a_later_layers_hook(monkeypatch):
    """The C layers of a forward are checked together before its first C call (each layer's plan once per
    forward), and a hook put on the last layer's projection between forwards sends that layer (only) back to its
    modules."""
    target = tiny_target("qwen3", dtype=torch.float32)
    layers = target.config.num_hidden_layers
    tree = _four_node_tree(3)
    before, _, calls = _tree_logits(target, PROMPTS, tree, module_path=False)
    events = _record_checks_and_calls(monkeypatch)
    again, _, again_calls = _tree_logits(target, PROMPTS, tree, module_path=False)
    assert again_calls == calls == 2 * layers and torch.equal(again, before)
    assert events == (["check"] * layers + ["C"] * layers) * 2  # two forwards: the tree verify and a step
    assert vars(target.model.layers[0])[exact_layers._STACK].chain is None  # no forward's tensors held past it
    seen = []
    handle = target.model.layers[-1].mlp.down_proj.register_forward_hook(lambda *a: seen.append(1))
    hooked, _, hooked_calls = _tree_logits(target, PROMPTS, tree, module_path=False)
    handle.remove()
    assert seen and hooked_calls == calls - 2 and torch.allclose(hooked, before, atol=1e-4)


def test_a_forward_runs_ahead_past_output_readers_only(monkeypatch):
    """A hook marked as reading a decoder layer's output (the target forward's capture of hidden states) keeps a
    forward's C calls together and sees that layer's output; any other hook on a decoder layer sends each layer
    back to checking itself before its own call."""
    from ddtree.targets.registration import OUTPUT_READER

    target = tiny_target("qwen3", dtype=torch.float32)
    layers = target.config.num_hidden_layers
    tree = _four_node_tree(5)
    before, _, _ = _tree_logits(target, PROMPTS, tree, module_path=False)
    events, seen = _record_checks_and_calls(monkeypatch), []

    def reader(module, args, output):
        seen.append(output)

    setattr(reader, OUTPUT_READER, True)
    handle = target.model.layers[1].register_forward_hook(reader)
    read, _, _ = _tree_logits(target, PROMPTS, tree, module_path=False)
    handle.remove()
    assert events == (["check"] * layers + ["C"] * layers) * 2 and torch.equal(read, before)
    assert len(seen) == len(PROMPTS) + 2  # each prompt's prefill, the verify and the step
    events.clear()
    handle = target.model.layers[1].register_forward_hook(lambda *a: None)  # not marked
    other, _, _ = _tree_logits(target, PROMPTS, tree, module_path=False)
    handle.remove()
    assert events != (["check"] * layers + ["C"] * layers) * 2 and events.count("C") == 2 * layers
    assert torch.equal(other, before)


def _captured_step(target, prompt, module_path: bool, grad: bool = False, prepare: bool = True):
    """A one-token step after ``prompt``'s prefill through transformers' own forward with
    ``output_hidden_states`` (its capture hooks collecting), through the C layers or module by module (or with
    ``grad`` enabled); returns the hidden states, the logits and the number of C layer calls."""
    from ddtree.targets.cache import cache_kwargs, new_target_cache
    from ddtree.targets.forward import chunked_prefill

    if prepare:
        SpeculativeGenerator(target, tiny_drafter(target), numerics="exact", prompt_lookup=False)
    with _c_layer_calls(target, module_path) as calls:
        with torch.no_grad(), _prefill_on_modules():
            cache = new_target_cache(target)
            chunked_prefill(target, torch.tensor([prompt]), cache, None)
        with torch.enable_grad() if grad else torch.inference_mode():
            out = target(input_ids=torch.tensor([[prompt[-1]]]), position_ids=torch.tensor([[len(prompt)]]),
                         use_cache=True, output_hidden_states=True, **cache_kwargs(target, cache))
    return out.hidden_states, out.logits, len(calls)


def test_transformers_output_capture_left_on_the_layers_keeps_the_c_calls(monkeypatch):
    """A forward with ``output_hidden_states`` leaves transformers' capture hooks on every layer for good (they
    used to send every later exact forward module by module): idle, they keep a forward's C calls together; capturing
    hidden states, they read the C layers' outputs, the module path's bits."""
    from ddtree.targets import registration

    target = tiny_target("qwen3", dtype=torch.float32)
    layers = target.config.num_hidden_layers
    tree = _four_node_tree(7)
    before, _, calls = _tree_logits(target, PROMPTS, tree, module_path=False)
    with torch.inference_mode():
        target(torch.tensor([PROMPTS[0]]), output_hidden_states=True)
    left = [h for m in target.modules() for h in m._forward_hooks.values()]
    if not any(registration._capture_key(h) == "hidden_states" for h in left):
        pytest.skip("this transformers captures hidden states without hooks on the layers")
    assert all(registration.idle(h) for h in left)  # no forward collecting now
    events = _record_checks_and_calls(monkeypatch)
    after, _, after_calls = _tree_logits(target, PROMPTS, tree, module_path=False)
    assert after_calls == calls == 2 * layers and torch.equal(after, before)
    assert events == (["check"] * layers + ["C"] * layers) * 2
    hidden, logits, c_calls = _captured_step(target, PROMPTS[1], module_path=False)
    hidden_modules, logits_modules, module_calls = _captured_step(target, PROMPTS[1], module_path=True)
    assert c_calls == layers and module_calls == 0 and len(hidden) == len(hidden_modules) == layers + 1
    assert all(torch.equal(a, b) for a, b in zip(hidden, hidden_modules)) and torch.equal(logits, logits_modules)


def test_a_forward_with_autograd_or_another_attention_takes_no_c_layer():
    """The forward's checks, made once for all its layers: a forward that autograd records (weights that
    require grad, grad on) and one whose config names another attention make no C call, and the next exact
    decode forward makes them all again."""
    target = tiny_target("qwen3", dtype=torch.float32)
    layers = target.config.num_hidden_layers
    _, logits, calls = _captured_step(target, PROMPTS[1], module_path=False)
    assert calls == layers
    for p in target.parameters():
        p.requires_grad_(True)
    _, graded, grad_calls = _captured_step(target, PROMPTS[1], module_path=False, grad=True, prepare=False)
    assert grad_calls == 0 and graded.requires_grad
    for p in target.parameters():
        p.requires_grad_(False)
    exact = target.config._attn_implementation
    target.config._attn_implementation = "sdpa"
    try:
        _, _, sdpa_calls = _captured_step(target, PROMPTS[1], module_path=False, prepare=False)
    finally:
        target.config._attn_implementation = exact
    _, again, again_calls = _captured_step(target, PROMPTS[1], module_path=False, prepare=False)
    assert sdpa_calls == 0 and again_calls == layers and torch.equal(again, logits)


def test_rotary_tables_that_are_not_contiguous_take_each_layer_alone():
    """A forward whose rotary tables are not contiguous (copied per layer, so no table identifies the forward)
    runs each layer's own C call once, not a chain per layer: the same calls and logits."""
    target = tiny_target("qwen3", dtype=torch.float32)
    tree = _four_node_tree(6)
    before, _, calls = _tree_logits(target, PROMPTS, tree, module_path=False)
    rotary = target.model.rotary_emb
    inner = rotary.forward

    def strided(*a, **k):
        return tuple(t.new_empty(t.shape[0], t.shape[2], t.shape[1]).transpose(1, 2).copy_(t) for t in inner(*a, **k))

    rotary.forward = strided
    try:
        after, _, after_calls = _tree_logits(target, PROMPTS, tree, module_path=False)
    finally:
        rotary.forward = inner
    assert after_calls == calls == 2 * target.config.num_hidden_layers and torch.equal(after, before)


def test_a_layer_given_another_input_than_the_chain_gave_it_computes_again():
    """A forward's first C layer runs the C calls of the layers after it; a layer that receives another input
    (here scaled on its way in) computes again, as does every layer after it: the module path's logits."""
    target = tiny_target("qwen3", dtype=torch.float32)
    layers = target.config.num_hidden_layers
    assert layers >= 3
    tree = _four_node_tree(4)
    before, _, calls = _tree_logits(target, PROMPTS, tree, module_path=False)
    layer = target.model.layers[2]
    inner = layer.forward
    layer.forward = lambda hidden_states, *a, **k: inner(hidden_states * 1.5, *a, **k)
    try:
        scaled, _, scaled_calls = _tree_logits(target, PROMPTS, tree, module_path=False)
        modules, _, _ = _tree_logits(target, PROMPTS, tree, module_path=True)
    finally:
        layer.forward = inner
    assert calls == 2 * layers and scaled_calls == 2 * (layers + layers - 2)  # layers 2.. again, each forward
    assert torch.equal(scaled, modules) and not torch.equal(scaled, before)


def test_a_padding_mask_changed_in_place_is_read_again():
    """A one-token step's key ranges are made once per forward and kept on the padding mask; an inference-mode
    mask (no version counter) changed in place and passed again at the same length gives its new ranges."""
    with torch.inference_mode():
        mask = torch.ones(2, 7, dtype=torch.long)
        first, _ = exact_layers._step_keys(mask, 2, 7, None, mask.device)
        assert exact_layers._step_keys(mask, 2, 7, None, mask.device)[0] is first  # kept for the next layer
        mask[0, :2] = 0
        again, _ = exact_layers._step_keys(mask, 2, 7, None, mask.device)
    assert first.tolist() == [[0], [0]] and again.tolist() == [[2], [0]]


def test_the_c_layer_sees_a_hook_or_a_part_added_after_its_plan():
    """A plan, once made, keeps no stale view of the modules: a forward hook registered on one linear after C
    calls ran sends that layer back to its modules, where the MLP calls that linear as a module (the hook
    fires; one C call fewer per forward), and its removal brings the C call back; a projection replaced by
    another linear is used (the module path's logits for the new weights, not the old ones)."""
    from ddtree.core.tree import DraftTree

    target = tiny_target("qwen3", dtype=torch.float32)
    parents = torch.tensor([-1, 0, 0, 1]).expand(2, -1)
    tree = DraftTree.from_parents(torch.randint(3, 90, parents.shape, generator=torch.Generator().manual_seed(2)),
                                  parents)
    before, _, calls = _tree_logits(target, PROMPTS, tree, module_path=False)
    seen = []
    handle = target.model.layers[0].mlp.down_proj.register_forward_hook(lambda *a: seen.append(1))
    hooked, _, hooked_calls = _tree_logits(target, PROMPTS, tree, module_path=False)
    handle.remove()
    again, _, again_calls = _tree_logits(target, PROMPTS, tree, module_path=False)
    assert seen and hooked_calls == calls - 2 and again_calls == calls  # two forwards: the verify and a step
    # the hooked MLP runs transformers' own forward (its activation rounds as torch's does): close, not equal
    assert torch.allclose(hooked, before, atol=1e-4) and torch.equal(again, before)
    old = target.model.layers[1].self_attn.o_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(old.weight * 0.5)
    target.model.layers[1].self_attn.o_proj = new
    swapped, _, swapped_calls = _tree_logits(target, PROMPTS, tree, module_path=False)
    modules, _, _ = _tree_logits(target, PROMPTS, tree, module_path=True)
    assert swapped_calls == calls and not torch.equal(swapped, before) and torch.equal(swapped, modules)


def test_a_scope_vouching_for_the_model_checks_its_layers_at_its_first_forward_only(monkeypatch):
    """Inside ``unchanged_between_forwards`` the first forward checks every layer's plan and the later ones run
    their C calls unchecked, to the same logits; a new scope checks again, so a weight changed between two
    scopes (two ``generate`` calls) is seen."""
    target = tiny_target("qwen3", dtype=torch.float32)
    layers = target.config.num_hidden_layers
    tree = _four_node_tree(3)
    before, _, _ = _tree_logits(target, PROMPTS, tree, module_path=False)
    events = _record_checks_and_calls(monkeypatch)
    with exact_layers.unchanged_between_forwards():
        again, _, _ = _tree_logits(target, PROMPTS, tree, module_path=False)
    assert torch.equal(again, before)
    assert events == ["check"] * layers + ["C"] * layers * 2  # the tree verify checked, the step not
    events.clear()
    with torch.no_grad():
        target.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    with exact_layers.unchanged_between_forwards():
        after, _, _ = _tree_logits(target, PROMPTS, tree, module_path=False)
    assert events == ["check"] * layers + ["C"] * layers * 2
    modules, _, _ = _tree_logits(target, PROMPTS, tree, module_path=True)
    assert not torch.equal(after, before) and torch.equal(after, modules)


def test_generate_checks_the_layers_once_and_stream_every_round(monkeypatch):
    """``generate`` without a streamer hands nothing to the caller until it returns: its C layers are checked at
    its first forward (the prefill, a chain through them) only. ``stream`` yields each round to the caller's
    code, and a streamer is the caller's code, either of which may change the model: every round's forward
    checks them. All give the same tokens."""
    target = tiny_target("qwen3", dtype=torch.float32)
    layers = target.config.num_hidden_layers
    gen = SpeculativeGenerator(target, tiny_drafter(target), numerics="exact", prompt_lookup=False, tree_budget=0)
    gen.generate([PROMPTS[0]], max_new_tokens=3)
    events = _record_checks_and_calls(monkeypatch)
    out = gen.generate([PROMPTS[0]], max_new_tokens=8, stop_token_ids=())
    generated = list(events)
    events.clear()
    streamed = [t for chunk in gen.stream([PROMPTS[0]], max_new_tokens=8, stop_token_ids=()) for t in chunk[0]]
    steps = generated.count("C") // layers  # the prefill's forward and the 7 decode steps
    assert steps == 8 and streamed == out.row_tokens[0]
    assert generated.count("check") == layers and events.count("check") == layers * steps
    events.clear()

    class Streamer:
        def put(self, ids):
            pass

        def end(self):
            pass

    fed = gen.generate([PROMPTS[0]], max_new_tokens=8, stop_token_ids=(), streamer=Streamer())
    assert fed.row_tokens == out.row_tokens and events.count("check") == layers * steps


def test_rows_sharing_their_positions_each_read_their_own_rotary_row(monkeypatch):
    """Prompts of one length give positions without a batch, so transformers makes one rotary table for every
    row: a short batch prefills on the row kernels and a long one (past ``ROW_PREFILL_MOST``) decodes its plain
    steps with that shared table. Each row must get its own batch-1 tokens, and a tree run the tokens and
    acceptance of the same batch through transformers' modules (a shared table once sent the C layer's later rows
    past its end, and the row-kernel prefill refused it)."""
    from ddtree.targets.description import ROW_PREFILL_MOST

    def run(take: bool, budget: int, batch):
        target = family_target("llama", dtype=torch.float32)
        if not take:
            monkeypatch.setattr(exact_layers, "install", lambda model: 0)
        gen = SpeculativeGenerator(target, tiny_drafter(target), numerics="exact", tree_budget=budget,
                                   prompt_lookup=False)
        monkeypatch.undo()
        return gen.generate(batch, max_new_tokens=12, stop_token_ids=())

    accepted = []
    for length in (10, ROW_PREFILL_MOST + 5):
        prompts = [[(7 * i + 3) % 90 + 1 for i in range(length)], [(5 * i + 11) % 89 + 2 for i in range(length)]]
        plain = run(True, 0, prompts)
        assert plain.sequences.tolist() == [run(True, 0, [p]).sequences[0].tolist() for p in prompts]
        tree, own = run(True, 6, prompts), run(False, 6, prompts)
        assert tree.sequences.tolist() == own.sequences.tolist() == plain.sequences.tolist()
        assert tree.row_acceptance == own.row_acceptance
        accepted += [a for row in tree.row_acceptance for a in row]
    assert max(accepted) > 1  # trees were verified and accepted, not only roots


def test_bfloat16_rounding_keeps_denormal_results():
    """The kernels round float32 to bfloat16 as torch does, denormal results included (the hardware
    conversion where the CPU has one flushes them to zero; those vectors are rounded in integer steps)."""
    g = torch.Generator().manual_seed(0)
    gate = ((torch.rand(3, 64, generator=g) + 1) * 1e-20).to(torch.bfloat16)
    sign = torch.randint(0, 2, (3, 64), generator=g) * 2 - 1
    up = (sign * (torch.rand(3, 64, generator=g) + 1) * 2e-20).to(torch.bfloat16)
    want = torch.nn.functional.silu(gate) * up  # about 1e-40: float32 denormals, then bfloat16 ones
    got = row_kernels.silu_mul(gate, up)
    assert (want != 0).all() and (want.float().abs() < torch.finfo(torch.float32).tiny).all()
    assert torch.equal(got, want)
