"""``from_pretrained(target, drafter)``: local directories, hub ids (the local cache; offline errors that say
what to do) and a wrong pair refused from the two configs before any weight is read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny import VOCAB, tiny_drafter, tiny_target

import ddtree.drafters.dflash.model as drafter_mod
from ddtree import SpeculativeGenerator
from ddtree.loading import hub


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No hub: HF_HUB_OFFLINE set and an empty hub cache of our own."""
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def _cache(hub_root, repo_id: str, src) -> None:
    """Lay a local directory out as the hub cache holds a downloaded repo."""
    folder = hub_root / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    shutil.copytree(src, folder / "snapshots" / commit)


@pytest.fixture
def no_weights_read(monkeypatch):
    """Fail if a drafter's or a target's weights are read."""
    from transformers import PreTrainedModel

    def refuse(*a, **k):
        raise AssertionError("weights were read before the pair was checked")

    monkeypatch.setattr(drafter_mod, "read_weights", refuse)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))


def test_missing_local_target_directory_says_so(tmp_path, saved_tiny_pair):
    _, drafter = saved_tiny_pair
    for missing in (tmp_path / "nope", "./no/such/target", "~/no-such-ddtree-target"):
        with pytest.raises(FileNotFoundError, match=r"the target directory .* does not exist"):
            SpeculativeGenerator.from_pretrained(str(missing), str(drafter))
    target, _ = saved_tiny_pair
    with pytest.raises(FileNotFoundError, match=r"the drafter directory .* does not exist"):
        SpeculativeGenerator.from_pretrained(str(target), str(tmp_path / "no-drafter"))
    with pytest.raises(NotADirectoryError, match="is a file, not a model directory"):
        SpeculativeGenerator.from_pretrained(str(target / "config.json"), str(drafter))


def test_hub_ids_offline_say_what_to_do(offline, saved_tiny_pair):
    target, drafter = saved_tiny_pair
    with pytest.raises(OSError, match=r"the drafter 'z-lab/Qwen3-8B-DFlash-b16' is not a local directory.*"
                                      r"HF_HUB_OFFLINE is set.*hf download z-lab/Qwen3-8B-DFlash-b16"):
        SpeculativeGenerator.from_pretrained(str(target), "z-lab/Qwen3-8B-DFlash-b16")
    with pytest.raises(OSError, match=r"the target 'Qwen/Qwen3-8B' is not a local directory.*pass a local"):
        SpeculativeGenerator.from_pretrained("Qwen/Qwen3-8B", str(drafter))


def test_hub_ids_load_from_the_local_cache(offline, saved_tiny_pair):
    target_dir, drafter_dir = saved_tiny_pair
    _cache(offline, "someone/tiny-target", target_dir)
    _cache(offline, "someone/tiny-dflash", drafter_dir)
    assert hub.model_dir("someone/tiny-dflash", "drafter").name == "0" * 40
    gen = SpeculativeGenerator.from_pretrained("someone/tiny-target", "someone/tiny-dflash", cpu_linear=False)
    local = SpeculativeGenerator.from_pretrained(str(target_dir), str(drafter_dir), cpu_linear=False)
    prompt = [5, 17, 3, 9]
    a = gen.generate(prompt, max_new_tokens=10, tree_budget=4, record_trees=True)
    b = local.generate(prompt, max_new_tokens=10, tree_budget=4, record_trees=True)
    ref = local.target.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=2)
    assert torch.equal(a.sequences, ref) and torch.equal(b.sequences, ref)
    # the same drafter weights: the same trees, round for round, so the same acceptance
    assert a.acceptance_lengths == b.acceptance_lengths
    assert all(torch.equal(x.tree.scores, y.tree.scores) for x, y in zip(a.rounds, b.rounds)) and a.rounds
    assert gen.tokenizer is not None


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", 32, "hidden size 32 does not match the target's 64"),
    ("vocab_size", VOCAB + 4, "vocab size 101 does not match"),
    ("mask_token_id", VOCAB + 9, "mask_token_id 106 is outside the target's vocabulary"),
])
def test_a_wrong_pair_is_refused_from_the_configs_before_any_weight(tmp_path, saved_tiny_pair, field, value,
                                                                   message, no_weights_read):
    target_dir, drafter_dir = saved_tiny_pair
    bad = tmp_path / "drafter"
    shutil.copytree(drafter_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (cfg["dflash_config"] if field == "mask_token_id" else cfg)[field] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        SpeculativeGenerator.from_pretrained(str(target_dir), str(bad))


def test_layer_ids_out_of_the_targets_range_are_refused_before_any_weight(tmp_path, saved_tiny_pair,
                                                                        no_weights_read):
    target_dir, drafter_dir = saved_tiny_pair
    bad = tmp_path / "drafter"
    shutil.copytree(drafter_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 9]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"target_layer_ids \[9\] out of range: the target has 4 decoder layers"):
        SpeculativeGenerator.from_pretrained(str(target_dir), str(bad))


def test_looks_like_path():
    assert hub.looks_like_path("/abs/dir") and hub.looks_like_path("./x") and hub.looks_like_path("a/b/c")
    assert not hub.looks_like_path("owner/name") and not hub.looks_like_path("gpt2")
    target = tiny_target("llama")
    assert tiny_drafter(target).config.hidden_size == 64  # the pair the checks above compare against


def test_a_drafter_directory_or_hub_id_serves_as_the_bound_object_does(offline, saved_tiny_pair):
    """``SpeculativeGenerator(target, drafter)`` and ``ddtree.decoding(drafter)`` take the drafter as a bound object,
    a directory (str or Path) or a cached hub id, and draft the same trees from each: same tokens, same acceptance."""
    from test_generator import expected_acceptance
    from transformers import AutoModelForCausalLM

    import ddtree
    from ddtree.drafters.dflash.drafter import DFlashDrafter

    target_dir, drafter_dir = saved_tiny_pair
    _cache(offline, "someone/tiny-dflash", drafter_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    prompt, new = [5, 17, 3, 9, 44], 24
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=2)
    bound = DFlashDrafter.from_pretrained(drafter_dir, target)
    runs = {}
    for name, drafter in (("object", bound), ("str", str(drafter_dir)), ("path", drafter_dir),
                          ("hub id", "someone/tiny-dflash")):
        gen = SpeculativeGenerator(target, drafter, tree_budget=4, threads=None)
        assert isinstance(gen.drafter, DFlashDrafter) and gen.drafter.model.fc.weight.dtype == torch.float32
        runs[name] = gen.generate(prompt, max_new_tokens=new, record_trees=True)
    want = runs["object"]
    assert torch.equal(want.sequences, ref)  # lossless
    assert want.acceptance_lengths == [expected_acceptance(r, ref[0].tolist()) for r in want.rounds]
    assert max(want.acceptance_lengths) > 1  # some round accepted a draft token, so equal acceptance says something
    for name, out in runs.items():
        assert torch.equal(out.sequences, ref), name
        assert out.acceptance_lengths == want.acceptance_lengths, name
        assert all(torch.equal(a.tree.tokens, b.tree.tokens) and torch.equal(a.tree.scores, b.tree.scores)
                   for a, b in zip(out.rounds, want.rounds)), name
    # Inside transformers: the directory is loaded against the target on first use, then reused.
    dec = ddtree.decoding(str(drafter_dir), tree_budget=4, threads=None)
    assert dec.drafter == str(drafter_dir)  # nothing loaded yet: the target is not known
    out = target.generate(torch.tensor([prompt]), custom_generate=dec, max_new_tokens=new, pad_token_id=2)
    assert torch.equal(out, ref)
    gen = dec.generator_for(target)
    assert isinstance(gen.drafter, DFlashDrafter) and dec.generator_for(target) is gen
    again = gen.generate(prompt, max_new_tokens=new, record_trees=True)
    assert again.acceptance_lengths == want.acceptance_lengths


def test_a_drafter_hub_id_not_in_the_offline_cache_says_what_to_do(offline):
    target = tiny_target("llama", dtype=torch.float32)
    with pytest.raises(OSError, match=r"the drafter 'someone/no-such-dflash' is not a local directory, and its "
                                      r"config.json is not available: HF_HUB_OFFLINE is set.*"
                                      r"hf download someone/no-such-dflash"):
        SpeculativeGenerator(target, "someone/no-such-dflash")
    import ddtree

    dec = ddtree.decoding("someone/no-such-dflash", tree_budget=4)
    with pytest.raises(OSError, match=r"the drafter 'someone/no-such-dflash'.*HF_HUB_OFFLINE is set"):
        target.generate(torch.tensor([[5, 17, 3]]), custom_generate=dec, max_new_tokens=4, pad_token_id=2)
    with pytest.raises(FileNotFoundError, match=r"the drafter directory .*no-such-dir does not exist"):
        SpeculativeGenerator(target, "./no-such-dir")
