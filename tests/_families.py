"""Tiny random targets, one per supported family (float64, eager MoE experts), shared by the family tests."""

from __future__ import annotations

import pytest
import torch

VOCAB = 97
WINDOW = 8  # every sliding window; prompts in the family tests are longer
_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)

FAMILIES = {
    # name: (model_type, config overrides, what it exercises)
    "llama": ("llama", {}, "full attention"),
    "mistral": ("mistral", dict(sliding_window=WINDOW), "config-level sliding_window, no layer_types"),
    "mixtral": ("mixtral", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
                "config-level window + MoE"),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
              "use_sliding_window / max_window_layers"),
    "qwen3_moe": ("qwen3_moe", dict(_MOE), "MoE"),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
               "alternating windows + logit softcapping"),
    "gemma3": ("gemma3_text", dict(sliding_window=WINDOW), "alternating windows"),
    "cohere2": ("cohere2", dict(sliding_window=WINDOW), "3 sliding : 1 full"),
    "gpt_oss": ("gpt_oss", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
                "attention sinks + alternating windows + MoE (eager only)"),
    "qwen3_5": ("qwen3_5_text", dict(_GDN), "GDN hybrid (3 GDN : 1 attention)"),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(_GDN, **_MOE, shared_expert_intermediate_size=32), "GDN hybrid + MoE"),
    "qwen3_next": ("qwen3_next", dict(_GDN, **_MOE, shared_expert_intermediate_size=32), "GDN hybrid + MoE"),
}
HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def family_target(name: str, seed: int = 0, dtype=torch.float64, vocab: int = VOCAB):
    """The tiny target of family ``name``; skips the test when this transformers lacks its model type."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    model_type, overrides, _ = FAMILIES[name]
    if model_type not in CONFIG_MAPPING:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} model type")
    torch.manual_seed(seed)
    config = CONFIG_MAPPING[model_type](**dict(_BASE, vocab_size=vocab), **overrides)
    model = AutoModelForCausalLM.from_config(config)
    if any("experts" in n for n, _ in model.named_modules()):
        model.set_experts_implementation("eager")  # the grouped-mm experts path takes no float64
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # sharper greedy continuations
        for name, param in model.named_parameters():
            if "linear_attn.out_proj" in name:
                param.mul_(8.0)  # let the GDN state matter to the logits, so a mis-forked state shows
    model.generation_config.eos_token_id = None  # the tests compare fixed-length greedy runs
    return model.to(dtype).eval()
