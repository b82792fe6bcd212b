"""The DFlash drafter: published format, cache invariant, layer offset, sliding window."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from tiny import MASK_ID, tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.blocks import (
    DFlashConfig,
    DFlashDrafter,
    DFlashDraftModel,
    build_target_layer_ids,
    extract_context_feature,
)
from ddtree.targets import native


class RecordingDrafter(DFlashDrafter):
    """Records (context length, root, log-probs) of every proposal made inside generation."""

    def __init__(self, model, target):
        super().__init__(model, target)
        self.calls = []

    def new_context(self, batch_size=1):
        ctx = super().new_context(batch_size)
        propose = ctx.propose

        def recording(root_tokens):
            proposal = propose(root_tokens)
            self.calls.append((int(ctx.lengths[0]), int(root_tokens.view(-1)[0]), proposal.logprobs.clone()))
            return proposal

        ctx.propose = recording
        return ctx


def from_scratch_logprobs(model, target, sequence, context_len, root, layer_offset=1):
    """Drafter log-probs computed afresh: one target forward over the committed prefix."""
    ctx = DFlashDrafter(model, target).new_context()
    with torch.no_grad():
        hidden = target(sequence[:, :context_len], output_hidden_states=True).hidden_states
    ids = model.config.target_layer_ids
    features = torch.cat([hidden[i + layer_offset] for i in ids], dim=-1)
    ctx.append(features, sequence[:, :context_len])
    return ctx.propose(torch.tensor([root])).logprobs


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("builder,budget", [("best_first", 16), ("chain", 8)])
def test_incremental_cache_equals_recompute_and_detects_layer_offset(kind, builder, budget):
    target = tiny_target(kind)
    model = tiny_drafter(target, num_layers=2)
    model.config.target_layer_ids = [0, 2]
    model.fc = torch.nn.Linear(2 * 64, 64, bias=False).double()
    drafter = RecordingDrafter(model, target)
    gen = SpeculativeGenerator(target, drafter, tree_budget=budget, builder=builder)
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    out = gen.generate(prompt, max_new_tokens=40)
    assert len(drafter.calls) == len(out.acceptance_lengths) >= 8
    seq = out.sequences
    offset_gaps = []
    for context_len, root, logprobs in drafter.calls:
        assert seq[0, context_len] == root  # the root sits right after the committed context
        fresh = from_scratch_logprobs(model, target, seq, context_len, root)
        torch.testing.assert_close(logprobs, fresh, rtol=0, atol=1e-9)
        wrong = from_scratch_logprobs(model, target, seq, context_len, root, layer_offset=0)
        offset_gaps.append((logprobs - wrong).abs().max().item())
    assert min(offset_gaps) > 1e-3


def test_extract_context_feature_uses_the_plus_one_offset():
    hidden = tuple(torch.full((1, 3, 2), float(i)) for i in range(5))  # embeddings + 4 layers
    feat = extract_context_feature(hidden, [0, 3])
    assert feat[0, 0].tolist() == [1.0, 1.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="4 decoder layers"):
        extract_context_feature(hidden, [4])


def test_published_layer_id_formula():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(36, 1) == [18]
    assert build_target_layer_ids(28, 3) == [1, 13, 25]


def naive_dflash_layer(layer, x, ctx, q_pos, k_pos, window, causal=False):
    """Attention written out per query slot with an explicit rule, then the MLP: causal sees k <= p and
    p - k < window; non-causal |p - k| < window."""
    attn = layer.self_attn
    h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    rope = lambda t, pos: _rope(t, pos, d)  # noqa: E731
    hx = layer.input_layernorm(x)
    q = attn.q_norm(attn.q_proj(hx).view(-1, h, d))
    keys_in = torch.cat([ctx, hx], dim=0)
    k = attn.k_norm(attn.k_proj(keys_in).view(-1, kvh, d))
    v = attn.v_proj(keys_in).view(-1, kvh, d)
    q, k = rope(q, q_pos), rope(k, k_pos)
    out = torch.zeros(q.shape[0], h, d, dtype=x.dtype)
    for i, p in enumerate(q_pos.tolist()):
        for head in range(h):
            g = head // (h // kvh)
            scores = []
            for j, kp in enumerate(k_pos.tolist()):
                near = window is None or (p - kp < window if causal else abs(p - kp) < window)
                visible = near and (not causal or kp <= p)
                scores.append((q[i, head] @ k[j, g]).item() / math.sqrt(d) if visible else -math.inf)
            w = torch.tensor(scores, dtype=x.dtype).softmax(0)
            out[i, head] = w @ v[:, g]
    y = x + attn.o_proj(out.reshape(q.shape[0], h * d))
    return y + layer.mlp(layer.post_attention_layernorm(y))


def _rope(t, pos, d):
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    ang = pos[:, None].float() * inv
    emb = torch.cat([ang, ang], -1)  # float32 tables, as HF computes them
    cos, sin = emb.cos().to(t.dtype)[:, None], emb.sin().to(t.dtype)[:, None]
    rot = torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1)
    return t * cos + rot * sin


@pytest.mark.parametrize("window", [2, 3, 6])
def test_sliding_layer_equals_explicit_window_attention(window):
    target = tiny_target("qwen3")
    model = tiny_drafter(
        target, num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=window
    )
    ctx_len, block = 9, model.config.block_size
    torch.manual_seed(5)
    ctx = torch.randn(1, ctx_len, 64, dtype=torch.float64)
    x = torch.randn(1, block, 64, dtype=torch.float64)
    ctx_pos = torch.arange(ctx_len)[None]
    blk_pos = torch.arange(ctx_len, ctx_len + block)[None]
    with torch.no_grad():
        got = model(x, blk_pos, context=ctx, context_positions=ctx_pos)
        k_pos = torch.cat([ctx_pos, blk_pos], 1)[0]
        y = naive_dflash_layer(model.layers[0], x[0], ctx[0], blk_pos[0], k_pos, window, causal=True)
        y = naive_dflash_layer(model.layers[1], y, ctx[0], blk_pos[0], k_pos, None)
        want = model.norm(y)
        torch.testing.assert_close(got[0], want, rtol=0, atol=1e-10)
        # Shifted positions (not 0..C+Q-1) take the explicit-mask path: the same rule by position.
        shifted = model(x, blk_pos + 7, context=ctx, context_positions=ctx_pos + 7)
        y = naive_dflash_layer(model.layers[0], x[0], ctx[0], blk_pos[0] + 7, k_pos + 7, window, causal=True)
        y = naive_dflash_layer(model.layers[1], y, ctx[0], blk_pos[0] + 7, k_pos + 7, None)
        torch.testing.assert_close(shifted[0], model.norm(y), rtol=0, atol=1e-10)
        # The rule matters: the same weights, non-causal with the window, or full attention, give something else.
        spec = model.layers[0].self_attn.spec
        for other in (spec._replace(causal=False), spec._replace(causal=False, window=None)):
            model.layers[0].self_attn.spec = other
            assert (model(x, blk_pos, context=ctx, context_positions=ctx_pos) - got).abs().max() > 1e-4


PUBLISHED_KEYS = {
    "fc.weight", "hidden_norm.weight", "norm.weight",
    *(f"layers.{i}.{k}" for i in range(2) for k in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
    )),
}


def test_loads_a_published_directory_as_it_is(tmp_path):
    target = tiny_target("qwen3")
    source = tiny_drafter(target, num_layers=2)
    assert set(source.state_dict()) == PUBLISHED_KEYS
    # A directory written the way published drafters are, not by save_pretrained.
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False, "num_hidden_layers": 2,
        "vocab_size": 97, "num_target_layers": 4, "block_size": 5, "max_position_embeddings": 512,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
        "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": MASK_ID},
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {f"model.{k}" if k.startswith("layers.0") else k: v.clone() for k, v in source.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert loaded.config.target_layer_ids == [1, 2]
    assert loaded.config.layer_types == ["sliding_attention", "full_attention"]
    assert loaded.config.sliding_window == 4 and loaded.config.mask_token_id == MASK_ID
    for k, v in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    # save_pretrained round trip keeps the published config shape.
    loaded.save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["dflash_config"]["target_layer_ids"] == [1, 2] and again["block_size"] == 5
    assert DFlashConfig.from_pretrained(tmp_path / "again").layer_types == config["layer_types"]


def test_missing_weights_are_reported_by_name(tmp_path):
    target = tiny_target("qwen3")
    source = tiny_drafter(target, num_layers=1)
    source.save_pretrained(tmp_path)
    state = {k: v for k, v in source.state_dict().items() if k != "fc.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_drafter_for_another_target_depth_is_refused():
    target = tiny_target("qwen3")
    model = tiny_drafter(target)
    model.config.num_target_layers = 36
    with pytest.raises(ValueError, match="36 decoder layers.*has 4"):
        DFlashDrafter(model, target)


def _drafter_with_context(model, target, prompt):
    drafter = DFlashDrafter(model, target, draft_vocab=None)
    with torch.no_grad():
        hidden = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    ctx = drafter.new_context()
    ctx.append(drafter.context_features(hidden), torch.tensor([prompt]))
    return drafter, ctx


def test_draft_vocab_renormalises_over_the_subset(tmp_path):
    target = tiny_target("qwen3")
    model = tiny_drafter(target)
    drafter, ctx = _drafter_with_context(model, target, [5, 17, 3, 40, 22])
    full = ctx.propose(torch.tensor([9])).logprobs
    ids = torch.tensor([3, 90, 7, 41, 12, 66])
    drafter.set_draft_vocab(ids)
    sub = ctx.propose(torch.tensor([9])).logprobs
    keep = torch.zeros(full.shape[-1], dtype=torch.bool)
    keep[ids] = True
    assert torch.isinf(sub[..., ~keep]).all() and (sub[..., ~keep] < 0).all()
    expected = torch.log_softmax(full[..., keep], dim=-1)  # full log-probs differ from logits by a constant
    torch.testing.assert_close(sub[..., keep], expected, rtol=0, atol=2e-6)  # propose returns float32


def test_draft_vocab_file_round_trip_and_choices(tmp_path):
    target = tiny_target("qwen3")
    model = tiny_drafter(target)
    ranked = torch.tensor([40, 2, 17, 5, 80, 33, 9, 61])
    model.draft_vocab = ranked
    model.save_pretrained(tmp_path)
    loaded = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float64)
    assert torch.equal(loaded.draft_vocab, ranked)
    assert torch.equal(DFlashDrafter(loaded, target).draft_vocab, ranked.sort().values)  # "auto"
    assert torch.equal(DFlashDrafter(loaded, target, draft_vocab=3).draft_vocab, torch.tensor([2, 17, 40]))
    assert DFlashDrafter(loaded, target, draft_vocab=None).draft_vocab is None
    assert DFlashDrafter(loaded, target, draft_vocab=0).draft_vocab is None


@pytest.mark.parametrize("bad,match", [
    (torch.tensor([1, 2, 500]), r"\[0, 97\)"),
    (torch.tensor([1, 2, 2]), "repeat"),
    (torch.tensor([[1, 2]]), "1-D"),
    (7, "no ddtree_draft_vocab.json"),
    ("top", "'auto', None, an int"),
])
def test_bad_draft_vocab_is_refused(bad, match):
    target = tiny_target("qwen3")
    with pytest.raises(ValueError, match=match):
        DFlashDrafter(tiny_drafter(target), target, draft_vocab=bad)


def test_generation_with_a_draft_vocab_is_lossless_and_accepts_within_it():
    """A subset that holds the target's continuation keeps proposals the walk accepts; outside it, nothing."""
    from test_generator import expected_acceptance, reference

    target = tiny_target("qwen3")
    model = tiny_drafter(target)
    prompt = [11, 2, 2, 40, 61, 7, 9, 33, 12, 1, 80]
    ref = reference(target, prompt, new=48)
    ref_tokens = ref[0].tolist()
    used = sorted(set(ref_tokens[len(prompt):]))
    for vocab in (torch.tensor(used), torch.tensor([t for t in range(97) if t not in used])):
        gen = SpeculativeGenerator(target, model, tree_budget=16)
        gen.drafter.set_draft_vocab(vocab)
        out = gen.generate(torch.tensor([prompt]), max_new_tokens=48, record_trees=True)
        assert torch.equal(out.sequences, ref)
        assert out.acceptance_lengths == [expected_acceptance(r, ref_tokens) for r in out.rounds]
        drafted = torch.cat([r.tree.tokens[0, 1:] for r in out.rounds])
        assert torch.isin(drafted, vocab).all()
        if vocab.numel() == len(used):
            assert max(out.acceptance_lengths) > 1
        else:
            assert set(out.acceptance_lengths) == {1}


def test_a_float64_checkpoint_loads_without_rounding(tmp_path):
    """The loader builds the model in the checkpoint's dtype: float64 weights come back bit for bit."""
    target = tiny_target("qwen3", dtype=torch.float64)
    model = tiny_drafter(target, dtype=torch.float64)
    with torch.no_grad():
        model.fc.weight.add_(1e-12)  # below float32's resolution near these values
    model.save_pretrained(tmp_path / "d", dtype=torch.float64)
    back = DFlashDraftModel.from_pretrained(tmp_path / "d")
    assert back.fc.weight.dtype == torch.float64 and torch.equal(back.fc.weight, model.fc.weight)


@pytest.mark.parametrize("cap", [None, 3.0])
def test_block_logprobs_in_slices_are_log_softmax_to_the_bit(cap, monkeypatch):
    # The block's log-probs are written in place a few rows at a time (no second vocabulary-wide copy):
    # the bits must be log_softmax's over the whole block, softcapping included.
    import ddtree.core.sampling as sampling

    target = tiny_target(dtype=torch.float32)
    model = tiny_drafter(target, dtype=torch.float32)
    model.config.final_logit_softcapping, model.config.output_multiplier = cap, 0.7
    drafter = DFlashDrafter(model, target)
    hidden = torch.randn(2, 4, target.config.hidden_size, generator=torch.Generator().manual_seed(5))
    logits = target.get_output_embeddings()(hidden).float() * 0.7
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    want = torch.log_softmax(logits, dim=-1)
    monkeypatch.setattr(sampling, "LOG_SOFTMAX_CHUNK", 3 * logits.shape[-1])  # 3 rows per slice: 8 rows
    got = drafter.block_logprobs(hidden)
    assert torch.equal(got, want)


def _op_names(fn) -> set[str]:
    """The aten ops that ``fn()`` runs, as the profiler sees them (below ``aten::linear``'s own dispatch)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.inference_mode():
        fn()
    return {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliced_vocab", [False, True])
def test_the_block_head_multiplies_rows_not_a_batch_of_slices(dtype, sliced_vocab):
    """The depths a round uses are a strided slice of the drafter's block; the head multiplies them as rows (one
    product), not as a batch of matrices, for which torch's CPU matmul copies the whole head weight each call.
    The log-probs are the rows' own (the same bits as the rows passed contiguous)."""
    # weights that need no grad, as for inference (torch's matmul folds the rows for a weight that requires grad)
    target = tiny_target(dtype=dtype).requires_grad_(False)
    drafter = DFlashDrafter(tiny_drafter(target, dtype=dtype), target, draft_vocab=None)
    if sliced_vocab:
        drafter.set_draft_vocab(torch.arange(0, target.config.vocab_size, 3))
    block = torch.randn(3, 8, target.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    hidden = block[:, 1:4]  # [B, depth, H], rows strided by the block
    ops = _op_names(lambda: drafter.block_logprobs(hidden))
    assert "aten::bmm" not in ops and "aten::mm" in ops, sorted(ops)
    with torch.inference_mode():
        got = drafter.block_logprobs(hidden)
        want = drafter.block_logprobs(hidden.contiguous().view(-1, hidden.shape[-1])).view(*hidden.shape[:2], -1)
    assert got.shape == (3, 3, target.config.vocab_size) and torch.equal(got, want)
    # the control: the slice passed as it is takes the batched path
    assert "aten::bmm" in _op_names(lambda: torch.nn.functional.linear(hidden, target.get_output_embeddings().weight))


def test_a_drafter_for_a_target_with_rope_per_layer_type_takes_full_attentions():
    """Gemma 3 keeps RoPE parameters per layer type (transformers 5.0 also leaves a top-level ``rope_theta:
    None``): a drafter built for it takes the full-attention layers' base, never a missing one."""
    from tiny import family_target

    target = family_target("gemma3")
    config = DFlashConfig.for_target(target.config, mask_token_id=MASK_ID)
    full = target.config.get_text_config().rope_parameters["full_attention"]
    assert config.rope_parameters["rope_theta"] == full["rope_theta"] == 1_000_000.0
    assert config.rope_parameters["rope_type"] == "default"
    tiny_drafter(target)  # builds (its rotary table reads the base)


@pytest.mark.skipif(not native.available(), reason=f"kernels: {native.unavailable_reason()}")
@pytest.mark.parametrize("before", [True, False])
def test_a_draft_vocabularys_head_is_routed_with_the_drafters_linears(before):
    """The head over a draft vocabulary is one of the draft step's routed linears (the kernel, not BLAS), whether
    the vocabulary was chosen before the generator routed the drafter or after; the log-probs are the
    vocabulary's (BLAS's to float32 rounding) and ``-inf`` outside it."""
    from ddtree.targets import cpu_linear

    target = tiny_target(dtype=torch.float32).requires_grad_(False)
    drafter = DFlashDrafter(tiny_drafter(target), target, draft_vocab=None)
    ids = torch.arange(0, target.config.vocab_size, 3)
    if before:
        drafter.set_draft_vocab(ids)
    gen = SpeculativeGenerator(target, drafter, cpu_linear=True, numerics="fast")
    if not before:
        gen.drafter.set_draft_vocab(ids)
    head = drafter.cpu_linear_model.head
    assert head is not None and cpu_linear.routed(head) and cpu_linear.routed(drafter.model.fc)
    hidden = torch.randn(2, 4, target.config.hidden_size, generator=torch.Generator().manual_seed(3))
    assert "aten::mm" not in _op_names(lambda: drafter.block_logprobs(hidden))
    with torch.inference_mode():
        got = drafter.block_logprobs(hidden)
        logits = drafter.model.process_logits(torch.nn.functional.linear(hidden, target.lm_head.weight[ids]).float())
    torch.testing.assert_close(got[..., ids], logits.log_softmax(-1), atol=1e-5, rtol=1e-5)
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(got[..., outside]).all()
    cpu_linear.uninstall(drafter.cpu_linear_model)  # the control: BLAS once the head is not routed
    assert "aten::mm" in _op_names(lambda: drafter.block_logprobs(hidden))
