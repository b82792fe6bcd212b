"""Every supported family, every builder: lossless greedy output and full tree acceptance.

A tiny random target per family (float64), a prompt longer than every sliding window, and
a drafter that proposes the target's own continuation. The chain gets the true token
ranked first; the trees also get a decoy ranked above the true token at depth 2, which
only a tree that keeps the runner-up recovers. A wrong window or a GDN state shared
between siblings must change the output or the acceptance, which the last tests show.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_generator import expected_acceptance
from tiny import FAMILIES, HYBRIDS, WINDOW, ScriptedDrafter, family_target

import ddtree.targets.linear_attention
from ddtree import SpeculativeGenerator
from ddtree.targets.description import describe

PROMPT = [(7 * i + 3) % 90 + 1 for i in range(3 * WINDOW)]
NEW = 32
BLOCK = 5
BUILDERS = [("chain", 8, {}), ("best_first", 8, {2: 3}), ("beam@2x4", 8, {2: 3})]


def _reference(target):
    """HF greedy decoding, one block past ``NEW`` so the drafter (and the expected acceptance) know every round."""
    return target.generate(torch.tensor([PROMPT]), max_new_tokens=NEW + BLOCK, do_sample=False, pad_token_id=0)


def _run(target, ref, builder, budget, decoy, attention="auto"):
    drafter = ScriptedDrafter(ref, target.get_input_embeddings().weight.shape[0], block_size=BLOCK, decoy_at=decoy)
    gen = SpeculativeGenerator(target, drafter, tree_budget=budget, builder=builder, attention=attention)
    return gen.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, record_trees=True)


def _check(out, ref):
    """Output equals HF greedy; every round accepts what its tree allows, which is the full block."""
    assert torch.equal(out.sequences, ref[:, : len(PROMPT) + NEW])
    ref_tokens = ref[0].tolist()
    assert out.acceptance_lengths == [expected_acceptance(r, ref_tokens) for r in out.rounds]
    assert out.acceptance_lengths == [BLOCK] * len(out.rounds)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_lossless_at_full_acceptance(family):
    target = family_target(family)
    ref = _reference(target)
    assert ref.shape[1] == len(PROMPT) + NEW + BLOCK
    for builder, budget, decoy in BUILDERS:
        _check(_run(target, ref, builder, budget, decoy), ref)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_a_missing_window_is_caught(family, monkeypatch):
    """With the window dropped from the dense mask, the family test's checks fail."""
    target = family_target(family)
    ref = _reference(target)
    monkeypatch.setattr(describe(target), "windows", {0: None})
    out = _run(target, ref, "best_first", 8, {2: 3}, attention="sdpa")
    with pytest.raises(AssertionError):
        _check(out, ref)


def _flat_recurrence(fn, p, plan, state):
    """The naive tree forward: the nodes in index order as one chain (siblings share state)."""
    return ddtree.targets.linear_attention._run(fn, p.q, p.k, p.v, p.g, p.beta, state, False)[0]


def _flat_conv_index(self, kernel, device):
    """The naive conv: each node's window is the nodes before it in index order."""
    n = self.num_nodes
    idx = torch.arange(n)[:, None] + 1 + torch.arange(kernel)[None, :]
    return idx.reshape(1, n * kernel).expand(self.batch, -1).to(device)


@pytest.mark.parametrize("broken", ["recurrence", "conv"])
def test_a_shared_gdn_state_is_caught(broken, monkeypatch):
    target = family_target("qwen3_5")
    ref = _reference(target)
    if broken == "recurrence":
        monkeypatch.setattr(ddtree.targets.linear_attention, "_tree_recurrence", _flat_recurrence)
    else:
        monkeypatch.setattr(ddtree.targets.linear_attention.LinearTreePlan, "conv_index", _flat_conv_index)
    out = _run(target, ref, "best_first", 8, {2: 3})
    with pytest.raises(AssertionError):
        _check(out, ref)


def test_families_table_matches_the_tested_families():
    """docs/families.md lists exactly the families this file tests, with their model types."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "families.md").read_text()
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| ([^|]+) \|", text, flags=re.M)
    table = {name: {t.strip(" `") for t in types.split(",")} for name, types in rows}
    assert set(table) == set(FAMILIES)
    for name, (model_type, _, _) in FAMILIES.items():
        assert model_type in table[name], name
    assert set(HYBRIDS) <= set(table)


_BASE_REFUSED = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
REFUSED = {
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, head_dim=16),
    "bamba": dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, attn_layer_indices=[1]),
    "jamba": dict(mamba_d_state=8, mamba_expand=2, num_experts=2, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1),
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1,
                       hybrid_override_pattern="M*", head_dim=16),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
}


def _refused_target(model_type):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type!r}")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**_BASE_REFUSED, **REFUSED[model_type])).eval()


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_unsupported_recurrent_families_are_refused_when_built(model_type):
    target = _refused_target(model_type)
    drafter = ScriptedDrafter(torch.tensor(PROMPT), 97)
    for attention in ("auto", "sdpa", "split"):
        with pytest.raises(ValueError, match=rf"cannot verify .*\({model_type}\).*Supported: .*qwen3_5.*qwen3_next"):
            SpeculativeGenerator(target, drafter, tree_budget=4, attention=attention)


def test_an_unknown_recurrent_layer_is_refused_by_its_modules():
    """A model type ddtree has never heard of is still refused when a layer carries a recurrent state."""
    target = _refused_target("falcon_h1")
    target.config.model_type = "my_new_hybrid"
    with pytest.raises(ValueError, match="recurrent .*Mixer.*my_new_hybrid"):
        SpeculativeGenerator(target, ScriptedDrafter(torch.tensor(PROMPT), 97), tree_budget=4)


def test_gpt_oss_split_refusal_names_what_works():
    target = family_target("gpt_oss")
    auto = SpeculativeGenerator(target, ScriptedDrafter(torch.tensor(PROMPT), 97), attention="auto")
    assert auto.backend.name == "sdpa" and target.config._attn_implementation == "eager"  # what works for sinks
    with pytest.raises(ValueError, match=r"sinks.*attention=\"sdpa\".*\"auto\""):
        SpeculativeGenerator(target, ScriptedDrafter(torch.tensor(PROMPT), 97), attention="fused")


def test_qwen3_5_multimodal_checkpoint_verifies_its_text_as_trees():
    """A composite ``qwen3_5`` config (the published Qwen3.5/3.6 checkpoints) loaded as image-text-to-text."""
    from tiny import _BASE, _GDN
    from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

    if "qwen3_5" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no 'qwen3_5' model type")
    config = CONFIG_MAPPING["qwen3_5"](
        text_config=dict(_BASE, **_GDN),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64),
    )
    torch.manual_seed(0)
    target = AutoModelForImageTextToText.from_config(config).double().eval()
    target.generation_config.eos_token_id = None
    ref = _reference(target)
    for builder, budget, decoy in BUILDERS:
        _check(_run(target, ref, builder, budget, decoy), ref)
