"""Small helpers shared by test_tree / test_masks / test_verify / test_errors (not fixtures of conftest)."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from ddtree.drafter import DFlashConfig, DFlashDraftModel

VOCAB = 97
MASK_ID = 96


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    cfg = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    )
    cfg.update(overrides)
    return Qwen3Config(**cfg)


def tiny_target(seed: int = 0, **overrides) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_qwen3_config(**overrides)).double().eval()


def tiny_drafter(target_config, seed: int = 1, **overrides) -> DFlashDraftModel:
    torch.manual_seed(seed)
    kwargs = dict(num_hidden_layers=2, block_size=5, mask_token_id=MASK_ID)
    kwargs.update(overrides)
    return DFlashDraftModel(DFlashConfig.for_target(target_config, **kwargs)).double().eval()
