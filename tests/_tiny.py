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


def tiny_tokenizer():
    """A word-level tokenizer over the tiny vocabulary: ids 3..95 are the words ``w3``..``w95``.

    ``<eos>`` is 1, ``<pad>`` 2 and ``<mask>`` 96; the chat template joins turns as
    ``role: text <eos>``, so no network or model download is needed.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "<pad>": 2, **{f"w{i}": i for i in range(3, VOCAB - 1)}, "<mask>": MASK_ID}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }} <eos> {% endfor %}{% if add_generation_prompt %}w3 {% endif %}"
    )
    return tok
