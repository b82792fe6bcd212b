"""The training recipe on a tiny random Llama target (float32, seconds on CPU)."""

import json

import pytest
import torch

from ddtree.drafters.dflash.model import DFlashDraftModel
from ddtree.drafters.dflash.drafter import DFlashDrafter
from ddtree.drafters.features import extract_context_feature
from ddtree.train import TrainConfig, run
from ddtree.train.data import DIR_KEY_STRIDE, FeatureDataset, load_dataset, split_train_heldout
from ddtree.train.loop import build_drafter, draft_hidden, make_batch
from tiny import tiny_target as shared_tiny_target


def tiny_target(seed=0):
    return shared_tiny_target("llama", seed=seed, dtype=torch.float32, vocab=128, sharpen=False,
                              tie_word_embeddings=True)


def tiny_prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 120, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def tiny_cfg(tmp_path, **kw):
    base = dict(target="tiny", out_dir=str(tmp_path / "run"), num_prompts=48, max_new_tokens=40, gen_batch=16,
                topk=8, heldout_frac=0.25, num_layers=1, block_size=4, mask_token_id=127, steps=80,
                seqs_per_step=8, anchors_per_seq=8, lr=3e-3, min_lr=3e-4, warmup=10, eval_every=40,
                eval_blocks=256, save_every=40, log_every=20, vocab_subset=0, autocast="none", threads=0,
                num_feature_layers=1, device="cpu", accept_prompts=0)
    base.update(kw)
    return TrainConfig(**base)


def test_training_beats_untrained_and_exports(tmp_path):
    target = tiny_target()
    cfg = tiny_cfg(tmp_path)
    best = run(cfg, target=target, tokenizer=None, prompts=tiny_prompts(48), log_fn=lambda m: None)
    evals = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl") if '"eval"' in line]
    untrained = evals[0]["eval"]["acceptance"]
    assert evals[0]["step"] == 0
    assert best["acceptance"] > untrained + 0.05, (untrained, best)
    assert len(best["per_depth"]) == cfg.block_size - 1
    # the exported drafter loads as a published-format directory and drafts for the target
    model = DFlashDraftModel.from_pretrained(tmp_path / "run" / "best", dtype=torch.float32)
    assert model.config.block_size == 4 and model.config.mask_token_id == 127
    drafter = DFlashDrafter(model, target)
    ids = torch.tensor([tiny_prompts(1, seed=5)[0]])
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    ctx = drafter.new_context()
    ctx.append(extract_context_feature(hs, model.config.target_layer_ids), ids)
    lp = ctx.propose(ids[:, -1:]).logprobs
    assert lp.shape == (1, 3, 128)
    # An export holds only what a published directory has, plus the proposal vocabulary (not a *.safetensors
    # file: vLLM loads every one as weights); best/ has no other *.safetensors either.
    from ddtree.train.report import export

    out = export(tmp_path / "run", tmp_path / "exported")
    assert {f.name for f in out.iterdir()} == {"config.json", "model.safetensors", "ddtree_draft_vocab.json"}
    assert [f.name for f in (tmp_path / "run" / "best").glob("*.safetensors")] == ["model.safetensors"]
    assert DFlashDraftModel.from_pretrained(out).draft_vocab is not None


def test_default_layer_ids_never_read_the_targets_last_layer():
    """HF's last hidden state is after the final norm, vLLM's before it: the default ids avoid that layer."""
    from ddtree.drafters.features import build_target_layer_ids

    for layers in range(4, 80):
        for n in range(1, 9):
            assert layers - 1 not in build_target_layer_ids(layers, n), (layers, n)


def test_resume_continues_from_checkpoint(tmp_path):
    target = tiny_target()
    prompts = tiny_prompts(24)
    cfg = tiny_cfg(tmp_path, num_prompts=24, steps=20, eval_every=10, save_every=10)
    run(cfg, target=target, prompts=prompts, log_fn=lambda m: None)
    logs = []
    cfg2 = tiny_cfg(tmp_path, num_prompts=24, steps=30, eval_every=10, save_every=10)
    run(cfg2, target=target, prompts=prompts, log_fn=logs.append)
    assert any("resumed" in m and "step 20" in m for m in logs)
    ck = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)
    assert ck["step"] == 30


def test_warm_start_from_a_drafter(tmp_path):
    target = tiny_target()
    prompts = tiny_prompts(24)
    run(tiny_cfg(tmp_path, num_prompts=24, steps=20, eval_every=10, save_every=10), target=target, prompts=prompts,
        log_fn=lambda m: None)
    trained = DFlashDraftModel.from_pretrained(tmp_path / "run" / "best", dtype=torch.float32)
    cfg = tiny_cfg(tmp_path / "b", init_from_drafter=str(tmp_path / "run" / "best"))
    warm = build_drafter(cfg, target, 127, trained.config.target_layer_ids)
    for (k, a), b in zip(warm.state_dict().items(), trained.state_dict().values()):
        assert torch.equal(a, b), k
    cold = build_drafter(tiny_cfg(tmp_path / "c"), target, 127, trained.config.target_layer_ids)
    assert not torch.equal(cold.fc.weight, trained.fc.weight)
    with pytest.raises(ValueError, match="block_size: drafter has 4, run asks for 6"):
        build_drafter(tiny_cfg(tmp_path / "d", block_size=6, init_from_drafter=str(tmp_path / "run" / "best")),
                      target, 127, trained.config.target_layer_ids)


def test_warm_start_onto_other_target_layers_rescales_the_replaced_columns(tmp_path):
    """Moving a drafter off one target layer (the last, say) keeps its weights and rescales that layer's fc block."""
    target = tiny_target()
    run(tiny_cfg(tmp_path, num_prompts=16, steps=5, eval_every=5, save_every=5), target=target,
        prompts=tiny_prompts(16), log_fn=lambda m: None)
    trained = DFlashDraftModel.from_pretrained(tmp_path / "run" / "best", dtype=torch.float32)
    old = list(trained.config.target_layer_ids)
    new = old[:-1] + [old[-1] - 1 if old[-1] > 0 else old[-1] + 1]
    h = trained.config.hidden_size
    ids = sorted(set(old + new))
    feats = torch.randn(50, h * len(ids))
    col = {i: k * h for k, i in enumerate(ids)}
    feats[:, col[new[-1]]:col[new[-1]] + h] *= 4.0  # the replacement layer runs 4x hotter
    cache = {"layer_ids": ids, "features": feats}
    cfg = tiny_cfg(tmp_path / "b", init_from_drafter=str(tmp_path / "run" / "best"))
    lines = []
    warm = build_drafter(cfg, target, 127, new, cache=cache, log=lines.append)
    rms = lambda i: feats[:, col[i]:col[i] + h].pow(2).mean().sqrt()
    ratio = float(rms(old[-1]) / rms(new[-1]))
    assert 0.2 < ratio < 0.3
    slot = len(old) - 1
    torch.testing.assert_close(warm.fc.weight[:, slot * h:], trained.fc.weight[:, slot * h:] * ratio)
    assert torch.equal(warm.fc.weight[:, :slot * h], trained.fc.weight[:, :slot * h])
    assert torch.equal(warm.layers[0].mlp.down_proj.weight, trained.layers[0].mlp.down_proj.weight)
    assert list(warm.config.target_layer_ids) == new
    assert len(lines) == 1 and f"target layer {old[-1]} -> {new[-1]}" in lines[0]
    with pytest.raises(ValueError, match=r"lacks \[" + str(new[-1]) + r"\]"):
        build_drafter(cfg, target, 127, new, cache={"layer_ids": old, "features": feats[:, :h * len(old)]})
    with pytest.raises(ValueError, match="target_layer_ids: drafter has"):
        build_drafter(cfg, target, 127, new + [0], cache=cache)


def test_training_block_matches_runtime_propose(tmp_path):
    """The block-sparse training forward equals the runtime drafter on the same prefix."""
    target = tiny_target()
    cfg = tiny_cfg(tmp_path, num_prompts=8, steps=0)
    from ddtree.train.__main__ import prepare_data

    prepare_data(cfg, target, None, tiny_prompts(8), [2])
    with pytest.raises(ValueError, match=r"layer_ids: cache has \[2\], run asks for \[1, 2\]"):
        prepare_data(cfg, target, None, tiny_prompts(8), [1, 2])  # would mix layers in one cache
    data = load_dataset(cfg.resolved_data_dir())
    ds = FeatureDataset(data, list(range(8)), feature_layers=[2])
    torch.manual_seed(1)
    model = build_drafter(cfg, target, 127, [2]).eval()
    for p in model.parameters():  # make the layers matter
        p.data.normal_(0, 0.2) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(ds, [0, 3], 5, cfg.block_size, 127, gen)
    with torch.no_grad():
        h = draft_hidden(model, target.get_input_embeddings(), batch)  # [S, A, B-1, H]
    lm = target.get_output_embeddings()
    drafter = DFlashDrafter(model, target)
    checked = 0
    for s, k in enumerate([0, 3]):
        start, n, _ = ds.sequence(k)
        for a_idx in range(5):
            anchor = int(batch["block_pos"].view(2, 5, -1)[s, a_idx, 0])
            ctx = drafter.new_context()
            ctx.append(ds.features[start:start + anchor][None], data["input_ids"][start:start + anchor][None].long())
            lp = ctx.propose(data["input_ids"][start + anchor].long().view(1, 1)).logprobs
            ref = torch.log_softmax(lm(h[s, a_idx]).float(), -1)
            torch.testing.assert_close(lp[0], ref, atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked == 10


@pytest.mark.parametrize("layer_types", [["sliding_attention"]])
def test_sliding_window_drafter_trains(tmp_path, layer_types):
    from ddtree.train import loop

    target = tiny_target()
    cfg = tiny_cfg(tmp_path, num_prompts=16, steps=5, eval_every=5)
    orig = loop.build_drafter

    def build(cfg_, target_, mask, ids, **kw):
        from ddtree.drafters.dflash.config import DFlashConfig
        dcfg = DFlashConfig.for_target(target_.config, num_hidden_layers=1, block_size=cfg_.block_size,
                                       mask_token_id=mask, target_layer_ids=ids, layer_types=layer_types,
                                       sliding_window=6)
        return DFlashDraftModel(dcfg).float()

    loop.build_drafter = build
    try:
        best = run(cfg, target=target, prompts=tiny_prompts(16), log_fn=lambda m: None)
    finally:
        loop.build_drafter = orig
    assert best["blocks"] > 0
    cfg_saved = json.loads(open(tmp_path / "run" / "best" / "config.json").read())
    assert cfg_saved["layer_types"] == layer_types


def test_text_caches_only_train(tmp_path):
    """Held-out sequences come from the self-distilled cache only; text windows all go to training."""
    from ddtree.train.__main__ import split_for_run
    from ddtree.train.data import Sequence_, build_dataset, self_distill_jobs, target_features

    target = tiny_target()
    own, text = tmp_path / "own", tmp_path / "text"
    build_dataset(own, self_distill_jobs(target, None, tiny_prompts(40), max_new_tokens=12, batch_size=8,
                                         eos_token_id=None, pad_token_id=0), [1, 3], 4, log=lambda m: None)
    windows = [Sequence_(p * 4, 2) for p in tiny_prompts(40, seed=3)]
    build_dataset(text, [lambda ids, k, b=windows[i:i + 8]: target_features(target, b, ids, k)
                         for i in range(0, 40, 8)], [1, 3], 4, log=lambda m: None)
    (text / "meta.json").write_text(json.dumps({"source": "text"}))
    both = f"{own},{text}"
    data = load_dataset(both)
    cfg = tiny_cfg(tmp_path, heldout_frac=0.3)
    tr, ho = split_for_run(data, both, cfg)
    assert sorted(tr + ho) == list(range(80))
    from_text = [i for i in range(80) if int(data["keys"][i]) // DIR_KEY_STRIDE == 1]
    assert len(from_text) == 40 and not set(from_text) & set(ho)
    assert len(ho) >= 5  # the self-distilled cache still gives a held-out set
    # without a text cache the split is the plain hash split
    assert split_for_run(load_dataset(str(own)), str(own), cfg) == split_train_heldout(load_dataset(str(own)), 0.3)
