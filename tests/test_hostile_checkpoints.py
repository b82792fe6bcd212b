"""Broken and hostile drafter directories: each is refused with an error that names the problem and the fix,
before any generation, before the model is built at its (possibly absurd) size, and without unpickling."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import tiny_drafter, tiny_target

import ddtree.drafters.dflash.model as drafter_mod
from ddtree import SpeculativeGenerator
from ddtree.blocks import DFlashConfig, DFlashDrafter, DFlashDraftModel


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.fixture
def good_dir(tmp_path, target):
    path = tmp_path / "drafter"
    tiny_drafter(target).save_pretrained(path)
    return path


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _write_config(path, cfg: dict) -> None:
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def no_real_build(monkeypatch):
    """Fail the test if the drafter model is built on a real device or its weights are read."""
    real_init = DFlashDraftModel.__init__

    def guarded(self, config, **kwargs):
        if torch.empty(0).device.type != "meta":
            raise AssertionError(f"the drafter was built at full size (hidden {config.hidden_size}) before the check")
        real_init(self, config, **kwargs)

    def no_read(*a, **k):
        raise AssertionError("weights were read before the check")

    monkeypatch.setattr(DFlashDraftModel, "__init__", guarded)
    monkeypatch.setattr(drafter_mod, "read_weights", no_read)


def test_the_untouched_directory_loads(good_dir, target):
    """Loaded from disk, the drafter drafts exactly what the model it was saved from drafts: the same trees
    (tokens and scores), so the same acceptance, round for round (a weight left at its init would differ)."""
    drafter = DFlashDrafter.from_pretrained(good_dir, target)
    gen = SpeculativeGenerator(target, drafter, tree_budget=4)
    prompt = torch.tensor([[3, 4, 5]])
    ref = target.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = gen.generate(prompt, max_new_tokens=12, record_trees=True)
    assert torch.equal(out.sequences, ref)
    saved = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=4)  # same seed: the saved weights
    want = saved.generate(prompt, max_new_tokens=12, record_trees=True)
    assert out.acceptance_lengths == want.acceptance_lengths and len(out.rounds) == len(want.rounds) > 0
    for got, exp in zip(out.rounds, want.rounds):
        assert torch.equal(got.tree.tokens, exp.tree.tokens) and torch.equal(got.tree.scores, exp.tree.scores)
    other = SpeculativeGenerator(target, tiny_drafter(target, seed=7), tree_budget=4)
    assert any(not torch.equal(a.tree.tokens, b.tree.tokens) for a, b in
               zip(other.generate(prompt, max_new_tokens=12, record_trees=True).rounds, want.rounds))


@pytest.mark.parametrize("keep", [0.5, 0.999, 20])
def test_truncated_safetensors(good_dir, keep):
    f = good_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)] if keep < 1 else data[:keep])
    with pytest.raises(ValueError, match=r"model.safetensors cannot be read .*truncated or damaged; re-download it"):
        DFlashDraftModel.from_pretrained(good_dir)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights(good_dir, bad):
    f = good_dir / "model.safetensors"
    state = load_file(str(f))
    state["layers.1.mlp.up_proj.weight"][3, 5] = bad
    save_file(state, str(f))
    with pytest.raises(ValueError, match=r"drafter weight layers.1.mlp.up_proj.weight holds 1 NaN or inf values: "
                                         r"the checkpoint is damaged .*re-download or retrain it"):
        DFlashDraftModel.from_pretrained(good_dir)


def test_invalid_json(good_dir):
    (good_dir / "config.json").write_text('{"hidden_size": 64, "block_size": ')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON \(.*line 1.*\).*re-download the drafter"):
        DFlashDraftModel.from_pretrained(good_dir)
    (good_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"a drafter config is a JSON object \(a dict\), got list"):
        DFlashDraftModel.from_pretrained(good_dir)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "block_size",
                                   "num_attention_heads", "intermediate_size"])
def test_missing_field(good_dir, field, no_real_build):
    cfg = _config(good_dir)
    del cfg[field]
    _write_config(good_dir, cfg)
    with pytest.raises(ValueError, match=rf"the drafter config lacks {field}: .*fix or re-download config.json"):
        DFlashDraftModel.from_pretrained(good_dir)


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", 10**9, r"hidden_size = 1000000000 is outside 1..65536"),
    ("intermediate_size", 10**12, r"intermediate_size = 1000000000000 is outside"),
    ("num_hidden_layers", -1, r"num_hidden_layers = -1 is outside 1..256"),
    ("num_hidden_layers", 0, r"num_hidden_layers = 0 is outside"),
    ("num_attention_heads", -4, r"num_attention_heads = -4 is outside"),
    ("num_target_layers", -2, r"num_target_layers = -2 is outside"),
    ("vocab_size", 10**10, r"vocab_size = 10000000000 is outside"),
    ("block_size", 10**6, r"block_size = 1000000 is outside 1..1024"),
    ("head_dim", 0, r"head_dim = 0 is outside"),
    ("hidden_size", 64.5, r"hidden_size must be an int, got 64.5"),
    ("block_size", "16", r"block_size must be an int, got '16'"),
    ("num_hidden_layers", True, r"num_hidden_layers must be an int, got True"),
    ("num_key_value_heads", 3, r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"),
])
def test_absurd_sizes_are_refused_before_building(good_dir, field, value, message, no_real_build):
    cfg = _config(good_dir)
    cfg[field] = value
    _write_config(good_dir, cfg)
    with pytest.raises(ValueError, match=message):
        DFlashDraftModel.from_pretrained(good_dir)


@pytest.mark.parametrize("field,value", [("hidden_size", 4096), ("intermediate_size", 200_000),
                                         ("num_hidden_layers", 200), ("head_dim", 2048)])
def test_large_config_with_small_weights_fails_on_shapes_before_building(good_dir, field, value, no_real_build):
    """Sizes within the caps but not those of the weights: the headers say so before anything is allocated."""
    cfg = _config(good_dir)
    cfg[field] = value
    if field == "num_hidden_layers":
        cfg["layer_types"] = ["full_attention"] * value
        cfg["dflash_config"]["target_layer_ids"] = [1, 2]
    _write_config(good_dir, cfg)
    with pytest.raises(ValueError, match=r"drafter weight|do not match its config"):
        DFlashDraftModel.from_pretrained(good_dir)


def test_layer_ids_out_of_range(good_dir, target):
    cfg = _config(good_dir)
    cfg["dflash_config"]["target_layer_ids"] = [1, 4]
    _write_config(good_dir, cfg)
    with pytest.raises(ValueError, match=r"target_layer_ids \[4\] out of range: the target has 4 decoder layers"
                                         r".*fix dflash_config.target_layer_ids"):
        DFlashDraftModel.from_pretrained(good_dir)
    # In range for the config's own num_target_layers but not for this target: refused before reading weights.
    cfg["num_target_layers"] = 8
    cfg["dflash_config"]["target_layer_ids"] = [1, 6]
    _write_config(good_dir, cfg)
    DFlashConfig.from_pretrained(good_dir)  # the config alone is consistent
    with pytest.raises(ValueError, match=r"\[6\] out of range: the target has 4 decoder layers"):
        DFlashDrafter.from_pretrained(good_dir, target)


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", 32,
     r"drafter hidden size 32 does not match the target's 64: use a drafter trained for this target"),
    ("vocab_size", 101, r"drafter vocab size 101 does not match the target's lm_head \(97\): use a drafter trained"),
])
def test_mismatch_with_target_is_refused_before_reading_weights(good_dir, target, field, value, message,
                                                                 no_real_build):
    cfg = _config(good_dir)
    cfg[field] = value
    _write_config(good_dir, cfg)
    with pytest.raises(ValueError, match=message):
        DFlashDrafter.from_pretrained(good_dir, target)


def test_pickled_checkpoint_is_refused_and_never_unpickled(good_dir, monkeypatch):
    state = load_file(str(good_dir / "model.safetensors"))
    (good_dir / "model.safetensors").unlink()
    torch.save(state, good_dir / "pytorch_model.bin")

    def refuse(*a, **k):
        raise AssertionError("something was unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    with pytest.raises(ValueError, match=r"holds only pickled weights \(pytorch_model.bin\); ddtree never unpickles "
                                         r"files .*Convert them once"):
        DFlashDraftModel.from_pretrained(good_dir)


def test_from_pretrained_pair_fails_before_generation(tmp_path, target, good_dir):
    """The whole entry point: a saved target plus a damaged drafter fails in from_pretrained, naming the file."""
    target.save_pretrained(tmp_path / "target")
    f = good_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"cannot be read .*re-download it"):
        SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), str(good_dir))


def test_truncated_draft_vocab_sidecar(good_dir, target):
    from ddtree.drafters.dflash.checkpoint import save_draft_vocab

    save_draft_vocab(good_dir, torch.arange(40))
    assert DFlashDraftModel.from_pretrained(good_dir).draft_vocab.tolist() == list(range(40))
    f = good_dir / "ddtree_draft_vocab.json"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(ValueError, match=r"ddtree_draft_vocab.json cannot be read .*delete it to draft over the full"):
        DFlashDraftModel.from_pretrained(good_dir)
    # The legacy sidecar (draft_vocab.safetensors, what ddtree wrote before) is still read, and checked alike.
    from safetensors.torch import save_file

    f.unlink()
    legacy = good_dir / "draft_vocab.safetensors"
    save_file({"token_ids": torch.arange(30)}, str(legacy))
    assert DFlashDraftModel.from_pretrained(good_dir).draft_vocab.tolist() == list(range(30))
    legacy.write_bytes(legacy.read_bytes()[:-7])
    with pytest.raises(ValueError, match=r"draft_vocab.safetensors cannot be read .*delete it to draft over the full"):
        DFlashDraftModel.from_pretrained(good_dir)


def test_pickled_mask_embedding_is_refused_by_name(good_dir):
    (good_dir / "mask_embedding.pt").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match=r"mask_embedding.pt, a pickled mask embedding; ddtree never unpickles.*"
                                         r"model.safetensors under the name 'mask_embedding'"):
        DFlashDraftModel.from_pretrained(good_dir)
