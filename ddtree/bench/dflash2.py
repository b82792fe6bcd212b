"""``python -m ddtree.bench dflash2``: DDTree over a DFlash2 drafter's pairwise selector against its chain.

No trained DFlash2 drafter is published for a model this machine can train against, so the bench makes
one: a small random Qwen3 target (hidden 64, 4 layers, vocabulary 97, its lm_head sharpened so greedy
continuations are not degenerate), and a DFlash2 drafter (2 layers, block 8, selector top-k 8) trained
for a few CPU minutes on that target's own greedy continuations of random prompts (cross-entropy of the
drafter's logits plus the selector's scores given the true previous token). Acceptance is then measured
on held-out prompts, greedy, for the chain (the selector's greedy path), the pairwise DDTree, and
``best_first`` over the per-depth log-probs along the greedy path (the same tree builder, blind to the
pairwise structure). Every output is checked against the target's own greedy decoding.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

from ddtree.core.builders import best_first
from ddtree.drafters.dflash2.config import DFlash2Config
from ddtree.drafters.dflash2.drafter import DFlash2Drafter
from ddtree.drafters.dflash2.model import DFlash2DraftModel
from ddtree.generation.generator import SpeculativeGenerator

VOCAB, MASK = 97, 96


def make_target(seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.generation_config.eos_token_id = None
    return model.eval()


def make_drafter(target, block_size: int, top_k: int, seed: int) -> DFlash2DraftModel:
    cfg = {"architectures": ["DFlash2DraftModel"], "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "num_hidden_layers": 2,
           "vocab_size": VOCAB, "num_target_layers": 4, "rope_theta": 10000.0, "max_position_embeddings": 512,
           "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [0, 2], "block_size": block_size,
                             "conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 16,
                             "selector_top_k": top_k}}
    torch.manual_seed(seed)
    model = DFlash2DraftModel(DFlash2Config.from_dict(cfg))
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0  # start as the identity tap
                conv.kernel_projection.weight.mul_(0.1)
        sel = model.candidate_selector
        for book in (sel.predecessor_codebook, sel.successor_codebook):
            book.weight.normal_(0.0, 0.3)
    return model


def continuations(target, n: int, prompt_len: int, new: int, seed: int):
    """Random prompts and the target's greedy continuations ``[n, prompt_len + new]``, with its features."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, MASK, (n, prompt_len), generator=g)
    with torch.no_grad():
        seqs = target.generate(prompts, max_new_tokens=new, do_sample=False, pad_token_id=0)
        hidden = target(seqs, output_hidden_states=True).hidden_states
    return prompts, seqs, hidden


def train(model, target, steps: int, batch: int, seed: int, log) -> list[float]:
    """Teacher-forced blocks at random anchors of the target's own continuations."""
    prompt_len, new, size = 8, 72, model.config.block_size
    _, seqs, hidden = continuations(target, 128, prompt_len, new, seed)
    feats = torch.cat([hidden[i + 1] for i in model.config.target_layer_ids], dim=-1)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    total = seqs.shape[1]
    losses = []
    for step in range(steps):
        rows = torch.randint(0, seqs.shape[0], (batch,), generator=g)
        anchors = torch.randint(prompt_len, total - size, (batch,), generator=g)
        seq, feat = seqs[rows], feats[rows]
        positions = anchors[:, None] + torch.arange(size)
        block = torch.cat([seq.gather(1, anchors[:, None]), torch.full((batch, size - 1), MASK)], dim=1)
        labels = seq.gather(1, positions[:, 1:])
        prev = seq.gather(1, positions[:, :-1])  # each slot's true previous token
        width = int(anchors.max())
        kv = model.context_kv(model.project_context(feat[:, :width]), torch.arange(width).expand(batch, -1))
        h = model(F.embedding(block, embed.weight), positions, kv, anchors)[:, 1:]
        logits = model.logits(h, head)
        sel = model.candidate_selector
        pair = torch.einsum("bdr,vr->bdv", sel.predecessor_codebook(prev) * sel.hidden_projection(h),
                            sel.successor_codebook.weight)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + \
            F.cross_entropy((logits + pair).flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % 200 == 0 or step == steps - 1:
            log(f"step {step}: loss {loss.item():.3f}")
    return losses


def measure(target, drafter, prompts, new: int, cases) -> dict:
    refs = target.generate(prompts, max_new_tokens=new, do_sample=False, pad_token_id=0)[:, prompts.shape[1]:]
    out = {}
    for name, builder, budget in cases:
        gen = SpeculativeGenerator(target, drafter, tree_budget=budget, builder=builder, prompt_lookup=False)
        acc = []
        for i in range(prompts.shape[0]):
            res = gen.generate(prompts[i : i + 1], max_new_tokens=new)
            if res.new_tokens[0].tolist() != refs[i].tolist():
                raise AssertionError(f"{name} at budget {budget}: output differs from the target's greedy decoding")
            acc += res.acceptance_lengths
        out[f"{name}@{budget}"] = sum(acc) / len(acc)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddtree.bench dflash2", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1500, help="training steps of the drafter (batch --batch)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--budgets", default="7,16,32", help="tree budgets (the chain is the block's 7 nodes)")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts")
    p.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = make_target(args.seed)
    model = make_drafter(target, block_size=8, top_k=8, seed=args.seed + 1)
    t0 = time.perf_counter()
    losses = train(model, target, args.steps, args.batch, args.seed + 2, print)
    model.eval()
    drafter = DFlash2Drafter(model, target)
    held_out = torch.randint(3, MASK, (args.prompts, 8), generator=torch.Generator().manual_seed(args.seed + 99))

    def blind(roots, logprobs, budget):  # best_first on the greedy-path view only (no pairwise form)
        return best_first(roots, logprobs, budget)

    depth = model.config.block_size - 1
    cases = [("chain", "chain", depth)]
    for b in (int(x) for x in args.budgets.split(",")):
        cases += [("pairwise_tree", "best_first", b), ("greedy_path_tree", blind, b)]
    with torch.inference_mode():
        tau = measure(target, drafter, held_out, args.new, cases)
    result = {"tau": tau, "train_steps": args.steps, "final_loss": sum(losses[-50:]) / len(losses[-50:]),
              "train_seconds": round(time.perf_counter() - t0, 1),
              "machine": platform.processor() or platform.machine(),
              "threads": args.threads, "prompts": args.prompts, "new_tokens": args.new}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
