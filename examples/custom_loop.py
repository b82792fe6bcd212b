"""Three ways to own the decoding loop with ddtree's building blocks (``ddtree.blocks``).

Run: python examples/custom_loop.py            (a tiny random pair, checks losslessness)
     python examples/custom_loop.py --default  (the shipped SmolLM2 pair)

1. ``round_loop``: the generator's own round, ``ddtree.blocks.speculative_round``, driven
   by your loop (here: stop on a token budget, print each round as it commits).
2. ``block_loop``: the round spelled out with the building blocks: draft -> build a
   tree -> one masked target forward -> verify -> commit.
3. ``batched_block_loop``: the same for prompts of different lengths in one batch
   (``ddtree.blocks.prefill`` left-pads them; ``padding_mask`` hides the pads; a row that
   stops leaves the cache and the drafter context through ``select_rows``).
"""

from __future__ import annotations

import argparse

import torch

import ddtree
from ddtree import blocks


def round_loop(gen: ddtree.SpeculativeGenerator, prompt_ids: torch.Tensor, max_new_tokens: int, budget: int = 16):
    state = gen.start(prompt_ids, max_new_tokens=max_new_tokens, tree_budget=budget)
    while not state.done:
        result = blocks.speculative_round(state)  # what each row committed this round
        print(f"round {len(state.acceptance[0]):3d}: +{result.tokens[0]} (accepted {result.acceptance[0]})")
    return state.new_tokens[0], state.acceptance[0]


def block_loop(target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int, budget: int = 16, stops=()):
    stops = set(stops)
    cache = blocks.new_target_cache(target)
    context = drafter.new_context()  # this generation's drafter state
    out = blocks.target_forward(target, prompt_ids, None, cache)
    context.append(drafter.context_features(out.hidden_states), prompt_ids)
    root = out.logits[:, -1].argmax(-1)  # [1]
    generated, acceptance = [int(root)], []
    while len(generated) < max_new_tokens and not stops & set(generated):
        start = cache.get_seq_length()
        logprobs = context.propose(root).logprobs  # [1, block_size - 1, vocab]
        tree = blocks.best_first(root, logprobs, budget)
        mask = blocks.tree_attention_mask(tree.visibility, start, target.dtype)
        positions = blocks.tree_position_ids(tree.depths, start)
        out = blocks.target_forward(target, tree.tokens, positions, cache, attention_mask=mask)
        result = blocks.verify_tree(tree, out.logits)  # greedy by default
        path = result.accepted  # [1, L], root first
        blocks.commit_accepted(cache, start, path)
        context.append(drafter.context_features(out.hidden_states)[:, path[0]], tree.tokens[:, path[0]])
        root = result.bonus
        generated += tree.tokens[0, path[0, 1:]].tolist() + [int(root)]
        acceptance.append(int(result.num_accepted[0]))
    return _cut(generated, stops, max_new_tokens), acceptance


def batched_block_loop(target, drafter, prompts, max_new_tokens: int, budget: int = 16, stops=()):
    """``block_loop`` over ``prompts`` of any lengths at once; returns each prompt's tokens and acceptance."""
    stops = set(stops)
    start = blocks.prefill(target, prompts, drafter)  # cache left-padded to the longest prompt
    cache, context, lengths = start.cache, start.context, start.lengths  # lengths [B]: each row's real columns
    root = start.logits.argmax(-1)  # [B]
    rows = list(range(len(prompts)))  # the prompt each active row decodes
    generated, acceptance = [[int(t)] for t in root], [[] for _ in prompts]
    while True:
        keep = [i for i, r in enumerate(rows) if len(generated[r]) < max_new_tokens and not stops & set(generated[r])]
        if not keep:
            break
        if len(keep) < len(rows):  # finished rows stop costing compute
            index = torch.tensor(keep)
            blocks.select_rows(cache, index)
            context.select_rows(index)
            lengths, root, rows = lengths[index], root[index], [rows[i] for i in keep]
        width = cache.get_seq_length()  # the longest row's length; shorter rows are padded on the left
        logprobs = context.propose(root).logprobs  # [B, block_size - 1, vocab]
        tree = blocks.best_first(root, logprobs, budget)
        mask = blocks.tree_attention_mask(tree.visibility, width, target.dtype,
                                    prefix_valid=blocks.padding_mask(lengths, width))
        positions = blocks.tree_position_ids(tree.depths, lengths)  # each row's own next positions
        out = blocks.target_forward(target, tree.tokens, positions, cache, attention_mask=mask)
        result = blocks.verify_tree(tree, out.logits)
        blocks.commit_accepted(cache, width, result.accepted, lengths)
        path = result.accepted.clamp(min=0)  # [B, L]; -1 past a row's count, never read
        features = drafter.context_features(out.hidden_states)
        features = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
        context.append(features, tree.tokens.gather(1, path), result.num_accepted)
        counts, tokens = result.num_accepted.tolist(), tree.tokens.gather(1, path).tolist()
        for i, r in enumerate(rows):
            generated[r] += tokens[i][1 : counts[i]] + [int(result.bonus[i])]
            acceptance[r].append(counts[i])
        lengths, root = lengths + result.num_accepted, result.bonus
    return [_cut(g, stops, max_new_tokens) for g in generated], acceptance


def _cut(generated: list[int], stops, max_new_tokens: int) -> list[int]:
    """The tokens up to and including the first stop token, at most ``max_new_tokens``."""
    cut = next((i + 1 for i, t in enumerate(generated) if t in stops), max_new_tokens)
    return generated[: min(cut, max_new_tokens)]


def tiny_pair():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    target = Qwen3ForCausalLM(cfg).double().eval()
    dcfg = blocks.DFlashConfig.for_target(cfg, num_hidden_layers=1, block_size=8, mask_token_id=96)
    return target, blocks.DFlashDrafter(blocks.DFlashDraftModel(dcfg).double().eval(), target), None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--default", action="store_true",
                    help="use the shipped SmolLM2-135M pair (default: a tiny random pair)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    args = ap.parse_args(argv)
    # The spelled-out loops grow their trees from the drafter's log-probs alone; the generator's default also
    # grafts a prompt-lookup branch into each tree (ddtree.drafters.lookup), so it is off here to compare like
    # with like. They pass a dense tree mask (blocks.tree_attention_mask), which exact numerics' attention (the
    # CPU default) refuses, since it takes each node's key order from the backend's tree spec: numerics="fast".
    if args.default:
        gen = ddtree.SpeculativeGenerator.from_pretrained(prompt_lookup=False, numerics="fast")
        tok = gen.tokenizer
        msgs = [{"role": "user", "content": "Write a haiku about the sea."}]
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        prompt = prompt["input_ids"]
    else:
        target, drafter, tok = tiny_pair()
        gen = ddtree.SpeculativeGenerator(target, drafter, prompt_lookup=False, numerics="fast")
        prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        eos = gen.target.generation_config.eos_token_id  # the round loop stops there by default; so does this one
        stops = set([eos] if isinstance(eos, int) else eos or [])
        tokens, acceptance = block_loop(gen.target, gen.drafter, prompt, args.max_new_tokens, stops=stops)
        round_tokens, round_acceptance = round_loop(gen, prompt, args.max_new_tokens)
        plain = gen.target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.max_new_tokens,
                                    do_sample=False, pad_token_id=0)
    plain = plain[0, prompt.shape[1]:].tolist()  # plain decoding may stop early at EOS
    assert tokens[: len(plain)] == plain and round_tokens[: len(plain)] == plain, "output differs from plain greedy"
    assert acceptance == round_acceptance, "the spelled-out round and speculative_round accepted differently"
    prompts = [prompt[0], prompt[0, 3:], prompt[0, :2]] if args.default else [prompt[0], prompt[0, 3:], prompt[0, 5:]]
    with torch.inference_mode():
        row_tokens, row_acceptance = batched_block_loop(gen.target, gen.drafter, prompts, args.max_new_tokens,
                                                        stops=stops)
        for b, p in enumerate(prompts):
            alone = block_loop(gen.target, gen.drafter, p.view(1, -1), args.max_new_tokens, stops=stops)
            assert (row_tokens[b], row_acceptance[b]) == alone, f"batched row {b} differs from its batch-1 run"
    print("lossless: identical to plain greedy decoding, and both loops accepted the same nodes every round")
    print(f"rounds {len(acceptance)}, mean acceptance {sum(acceptance) / len(acceptance):.2f}")
    print(f"batched: {len(prompts)} prompts of lengths {[len(p) for p in prompts]}, each row's tokens and "
          "acceptance equal to its batch-1 run")
    if tok is not None:
        print(tok.decode(tokens))


if __name__ == "__main__":
    main()
