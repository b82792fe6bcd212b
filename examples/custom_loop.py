"""A DDTree decoding loop written only with ddtree's public building blocks.

Run: python examples/custom_loop.py            (a tiny random pair, checks losslessness)
     python examples/custom_loop.py --default  (the shipped SmolLM2 pair)

Each round: draft -> build a tree -> one masked target forward -> verify -> commit.
"""

from __future__ import annotations

import argparse

import torch

import ddtree


def speculative_greedy(target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int, budget: int = 16):
    cache = ddtree.new_target_cache(target)
    drafter.reset()
    out = target(prompt_ids, use_cache=True, output_hidden_states=True, **ddtree.cache_kwargs(target, cache))
    drafter.append_context(drafter.context_features(out.hidden_states))
    root = out.logits[:, -1].argmax(-1)  # [1]
    generated, acceptance = [int(root)], []
    while len(generated) < max_new_tokens:
        start = cache.get_seq_length()
        logprobs = drafter.propose(root)  # [1, block_size - 1, vocab]
        tree = ddtree.best_first(root, logprobs, budget)
        mask = ddtree.tree_attention_mask(tree.visibility, start, target.dtype)
        out = target(
            tree.tokens,
            position_ids=ddtree.tree_position_ids(tree.depths, start),
            attention_mask=mask,
            use_cache=True,
            output_hidden_states=True,
            **ddtree.cache_kwargs(target, cache),  # `cache=` or `past_key_values=`, by transformers version
        )
        result = ddtree.verify_tree(tree, out.logits)  # greedy by default
        path = result.accepted  # [1, L], root first
        ddtree.commit_accepted(cache, start, path)
        drafter.append_context(drafter.context_features(out.hidden_states)[:, path[0]])
        root = result.bonus
        generated += tree.tokens[0, path[0, 1:]].tolist() + [int(root)]
        acceptance.append(int(result.num_accepted[0]))
    return generated[:max_new_tokens], acceptance


def tiny_pair():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    target = Qwen3ForCausalLM(cfg).double().eval()
    dcfg = ddtree.DFlashConfig.for_target(cfg, num_hidden_layers=1, block_size=8, mask_token_id=96)
    return target, ddtree.DFlashDrafter(ddtree.DFlashDraftModel(dcfg).double().eval(), target), None


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--default", action="store_true", help="use the shipped SmolLM2-135M pair")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.default:
        gen = ddtree.SpeculativeGenerator.from_pretrained()
        target, drafter, tok = gen.target, gen.drafter, gen.tokenizer
        msgs = [{"role": "user", "content": "Write a haiku about the sea."}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        prompt = prompt["input_ids"]
    else:
        target, drafter, tok = tiny_pair()
        prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        tokens, acceptance = speculative_greedy(target, drafter, prompt, args.max_new_tokens)
        plain = target.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0)
    plain = plain[0, prompt.shape[1]:].tolist()  # plain decoding may stop early at EOS
    assert tokens[: len(plain)] == plain, "speculative output differs from plain greedy"
    print("lossless: identical to plain greedy decoding")
    print(f"rounds {len(acceptance)}, mean acceptance {sum(acceptance) / len(acceptance):.2f}")
    if tok is not None:
        print(tok.decode(tokens))


if __name__ == "__main__":
    main()
