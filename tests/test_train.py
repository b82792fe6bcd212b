"""The training recipe on a tiny random Llama target (float32, seconds on CPU)."""

import json

import pytest
import torch
from tiny import tiny_target as shared_tiny_target

from ddtree.drafters.dflash.drafter import DFlashDrafter
from ddtree.drafters.dflash.model import DFlashDraftModel
from ddtree.drafters.features import extract_context_feature
from ddtree.train import TrainConfig, run
from ddtree.train.data import DIR_KEY_STRIDE, FeatureDataset, load_dataset, split_train_heldout
from ddtree.train.loop import build_drafter, draft_hidden, make_batch


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


def test_defaults_are_the_shipped_recipe():
    """With no options, the run is the recipe of models/smollm2-135m-dflash (its config and model card)."""
    from pathlib import Path

    from transformers import LlamaConfig

    from ddtree.drafters.features import build_target_layer_ids
    from ddtree.train import parse_args
    from ddtree.train.__main__ import layer_ids_for

    cfg = parse_args([])
    shipped = json.loads((Path(__file__).parent.parent / "models" / "smollm2-135m-dflash" / "config.json").read_text())
    assert cfg.block_size == shipped["block_size"] == 6
    assert cfg.num_layers == shipped["num_hidden_layers"] == 1
    assert cfg.num_feature_layers == len(shipped["dflash_config"]["target_layer_ids"]) == 4
    # the card's training settings
    assert (cfg.loss_gamma, cfg.soft_weight, cfg.vocab_subset, cfg.vocab_negatives) == (2.5, 0.5, 2048, 512)
    assert (cfg.seqs_per_step, cfg.anchors_per_seq, cfg.topk, cfg.max_new_tokens) == (8, 24, 16, 160)
    assert (cfg.lr, cfg.min_lr, cfg.draft_vocab, cfg.eval_blocks) == (2e-3, 1e-4, 8192, 1536)
    # the layer ids: the published formula over the target's layers, never its last one (SmolLM2 has 30)
    smollm2 = type("T", (), {"config": LlamaConfig(num_hidden_layers=shipped["num_target_layers"])})()
    ids, cache = layer_ids_for(cfg, smollm2)
    assert ids == cache == build_target_layer_ids(30, 4) == [1, 10, 18, 27]
    for layers in (8, 16, 24, 28, 32, 36, 48, 64):
        big = type("T", (), {"config": LlamaConfig(num_hidden_layers=layers)})()
        ids, _ = layer_ids_for(cfg, big)
        assert len(ids) == 4 and layers - 1 not in ids and ids == sorted(set(ids)), (layers, ids)
    # a target too shallow for the formula reads the layers below its last (tests/test_train_small.py)
    tiny = type("T", (), {"config": LlamaConfig(num_hidden_layers=4)})()
    assert layer_ids_for(cfg, tiny)[0] == [0, 1, 2]
    # the help says where the export goes, and that is where it goes (see test_training_beats_untrained_and_exports)
    from ddtree.train.config import build_parser

    helps = {a.dest: a.help for a in build_parser()._actions}
    assert "out_dir/best" in helps["out_dir"] and "export" not in helps["out_dir"].replace("exported", "")
    assert "cuda" in helps["device"] and "float32 on cpu" in helps["target_dtype"]


def test_device_and_dtype_options_on_the_cpu(tmp_path):
    """--device / --target-dtype / --autocast resolve per device; the target is loaded there in that dtype."""
    from ddtree.train import parse_args
    from ddtree.train.__main__ import load_target

    cfg = parse_args(["--device", "cpu"])
    assert cfg.resolved_device() == "cpu" and cfg.resolved_target_dtype("cpu") == torch.float32
    assert cfg.resolved_target_dtype("cuda:0") == torch.bfloat16
    assert not cfg.use_autocast("cpu")  # bf16 autocast is slow on CPUs without avx512_bf16: only where asked
    assert parse_args(["--autocast", "bfloat16"]).use_autocast("cpu")
    auto = parse_args([]).resolved_device()
    assert auto == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device; use --device cpu"):
            parse_args(["--device", "cuda"]).resolved_device()
    with pytest.raises(ValueError, match="use auto, cpu, cuda or cuda:N"):
        parse_args(["--device", "tpu"]).resolved_device()
    with pytest.raises(ValueError, match="--target-dtype 'float33'"):
        parse_args(["--target-dtype", "float33"]).resolved_target_dtype("cpu")
    with pytest.raises(ValueError, match="--autocast 'fp8'"):
        parse_args(["--autocast", "fp8"]).use_autocast("cpu")
    from tiny import tiny_tokenizer

    tiny_target().save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    for name, want in (("auto", torch.float32), ("bfloat16", torch.bfloat16), ("float64", torch.float64)):
        model, _ = load_target(parse_args(["--target", str(tmp_path / "target"), "--target-dtype", name]), "cpu")
        assert ({p.dtype for p in model.parameters()} == {want}
                and {p.device.type for p in model.parameters()} == {"cpu"})


def test_realised_acceptance_of_the_export_is_ddtrees(tmp_path):
    """After training, the export runs through ddtree's generation; what the run reports is what ddtree measures."""
    from ddtree import SpeculativeGenerator
    from ddtree.drafters.dflash.drafter import DFlashDrafter
    from ddtree.train.acceptance import acceptance_gap

    target = tiny_target()
    # Prompts the tiny drafter has learnt (on new ones its answers are degenerate and nothing is accepted): the
    # point is that the figure the run reports is the one ddtree's generation measures.
    held_out = tiny_prompts(48)[:3]
    cfg = tiny_cfg(tmp_path, accept_prompts=3, accept_new_tokens=24, accept_tree_budget=5, accept_gap=0.5)
    lines = []
    best = run(cfg, target=target, tokenizer=None, prompts=tiny_prompts(48), log_fn=lines.append,
               eval_prompts=held_out)
    got = best["inference"]
    assert got["prompts"] == 3 and got["chain_len"] == 3 and got["estimate"] == best["acceptance"]
    # independently: the exported directory through SpeculativeGenerator, prompt by prompt, greedy
    drafter = DFlashDrafter.from_pretrained(tmp_path / "run" / "best", target, dtype=torch.float32)
    for name, builder, budget in (("chain", "chain", 3), ("tree", "best_first", 5)):
        gen = SpeculativeGenerator(target, drafter, builder=builder, tree_budget=budget, threads=None)
        accepted, rounds = 0, 0
        for ids in held_out:
            out = gen.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, stop_token_ids=())
            plain = target.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None)
            assert out.sequences[0].tolist() == plain[0].tolist()  # lossless
            assert out.stats.mean_acceptance == pytest.approx(sum(out.acceptance_lengths) / len(out.acceptance_lengths))
            accepted += sum(out.acceptance_lengths)
            rounds += len(out.acceptance_lengths)
        assert got[name] == pytest.approx(accepted / rounds, abs=1e-12), name
        assert got[f"{name}_rounds"] == rounds
    assert got["chain"] > 2.0  # the trained drafter gets tokens accepted
    assert got["tree"] > 1.5
    # written beside the log, reported, and checked by the doctor's config check
    saved = json.loads((tmp_path / "run" / "acceptance.json").read_text())
    assert saved["chain"] == got["chain"] and isinstance(saved["config_problems"], list)
    assert any(m.startswith("[accept]") and f"chain {got['chain']:.3f}" in m for m in lines)
    from ddtree.train.report import read_inference, summary

    assert read_inference(tmp_path / "run")[-1]["tree"] == got["tree"]
    assert "Through ddtree's generation" in summary(tmp_path / "run")
    # the gap flag: realised gains below the fraction of the estimate's gain
    assert acceptance_gap(2.8, 1.67, 0.5) is not None and "doctor" in acceptance_gap(2.8, 1.67, 0.5)
    assert acceptance_gap(2.0, 1.6, 0.5) is None and acceptance_gap(1.0, 1.0, 0.5) is None
    assert (got["gap"] is None) == (got["chain"] - 1 >= 0.5 * (got["estimate"] - 1))


def test_config_check_of_the_export_flags_a_bad_field(tmp_path):
    """The doctor's config check runs on the export: a drafter reading the target's last layer is reported."""
    from ddtree.train.acceptance import config_problems

    target = tiny_target()
    run(tiny_cfg(tmp_path, num_prompts=16, steps=5, eval_every=5), target=target, prompts=tiny_prompts(16),
        log_fn=lambda m: None)
    best = tmp_path / "run" / "best"
    assert config_problems(best, target) == []
    raw = json.loads((best / "config.json").read_text())
    raw["vocab_size"] = 100
    (best / "config.json").write_text(json.dumps(raw))
    problems = config_problems(best, target)
    assert len(problems) == 1 and "vocab_size" in problems[0] and problems[0].startswith("error")
