"""A custom tree builder in a few lines: the drafter's top-1 chain, hedged by the runner-up at each depth.

Run it through the bench:  python -m ddtree.bench --methods ar,chain,examples.custom_builder:spine@16,24
"""
import torch

from ddtree.blocks import DraftTree
from ddtree.core.builders import ranked_topk


def spine(root_tokens: torch.Tensor, logprobs: torch.Tensor, budget: int) -> DraftTree:
    """Nodes 1..m: the top-1 chain; then the rank-2 token at depths 1..a as a leaf beside the chain."""
    bsz, depth, _ = logprobs.shape
    vals, toks = ranked_topk(logprobs.float(), min(2, logprobs.shape[-1]))  # [B, D, k], best first
    m = min(budget, depth)
    a = min(budget - m, m) if vals.shape[-1] > 1 else 0
    chain_scores = vals[:, :m, 0].cumsum(dim=1)
    above = torch.cat([chain_scores.new_zeros(bsz, 1), chain_scores], dim=1)  # score of the parent
    dev = logprobs.device
    # Chain node i+1 hangs off node i; the alternate at depth d+1 hangs off chain node d (0 = root).
    parents = torch.cat([torch.tensor([-1], device=dev), torch.arange(m, device=dev), torch.arange(a, device=dev)])
    tokens = torch.cat([root_tokens.view(bsz, 1).long(), toks[:, :m, 0], toks[:, :a, -1]], dim=1)
    scores = torch.cat([above[:, :1] * 0, chain_scores, above[:, :a] + vals[:, :a, -1]], dim=1)
    return DraftTree.from_parents(tokens, parents.repeat(bsz, 1), scores)
