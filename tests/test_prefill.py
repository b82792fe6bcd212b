"""``ddtree.blocks.prefill``: ragged prompts in one batch leave each row's cache, logits and drafter context as its
own batch-1 prefill would (float64, the tiny pair)."""

from __future__ import annotations

import pytest
import torch

import ddtree
from ddtree.generation.prefill import left_pad


def _pair():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    target = Qwen3ForCausalLM(cfg).double().eval()
    dcfg = ddtree.blocks.DFlashConfig.for_target(cfg, num_hidden_layers=1, block_size=8, mask_token_id=96)
    return target, ddtree.blocks.DFlashDrafter(ddtree.blocks.DFlashDraftModel(dcfg).double().eval(), target)


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [5, 3, 5], [2, 7, 1, 8, 2, 8]]


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_ragged_prefill_equals_each_rows_own(chunk_size):
    target, drafter = _pair()
    with torch.inference_mode():
        batch = ddtree.blocks.prefill(target, PROMPTS, drafter, chunk_size=chunk_size)
        roots = batch.logits.argmax(-1)
        proposed = batch.context.propose(roots).logprobs
        assert batch.lengths.tolist() == [len(p) for p in PROMPTS]
        assert batch.cache.get_seq_length() == max(map(len, PROMPTS))
        valid = ddtree.blocks.padding_mask(batch.lengths, max(map(len, PROMPTS)))
        assert valid.sum(1).tolist() == batch.lengths.tolist() and bool(valid[:, -1].all())
        for b, prompt in enumerate(PROMPTS):
            one = ddtree.blocks.prefill(target, [prompt], drafter)
            torch.testing.assert_close(batch.logits[b], one.logits[0], rtol=0, atol=1e-10)
            alone = one.context.propose(one.logits.argmax(-1)).logprobs  # the drafter saw the same features
            torch.testing.assert_close(proposed[b], alone[0], rtol=0, atol=1e-10)
            plain = target(torch.tensor([prompt])).logits[0, -1]  # and the target alone agrees
            torch.testing.assert_close(batch.logits[b], plain, rtol=0, atol=1e-10)


def test_prefill_without_a_drafter_fills_only_the_cache():
    target, _ = _pair()
    with torch.inference_mode():
        out = ddtree.blocks.prefill(target, [torch.tensor(p) for p in PROMPTS])
    assert out.context is None and out.cache.get_seq_length() == 10 and out.logits.shape == (3, 97)


def test_an_empty_prompt_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="BOS"):
        left_pad([[1, 2], []], 0)
