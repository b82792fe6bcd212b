"""Acceptance of an exported drafter measured through ddtree's own generation, beside the training estimate.

The held-out estimate of :func:`ddtree.train.loop.evaluate` scores the drafter on cached features with
the training code; a drafter can look good there and still accept little when it is loaded from its
export and run by an engine (a layer read differently, a mask token, a lost embedding scale). This runs
the export the way users do: loaded from its directory by :class:`ddtree.SpeculativeGenerator`, greedy, on
prompts never trained on, for the chain an engine runs (``block_size - 1`` tokens) and for a tree; and
the doctor's config check reads its ``config.json`` against the target.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddtree.apps.doctor.config_check import check_config, read_raw_config


def encode_prompts(prompts, tokenizer) -> list[list[int]]:
    """Token ids of each prompt: ids as given, else text or a message list through the chat template."""
    from ddtree.train.data import encode_prompt

    out = []
    for p in prompts:
        if isinstance(p, dict):
            p = p.get("messages") or p.get("prompt")
        if isinstance(p, (list, tuple)) and p and isinstance(p[0], int):
            out.append([int(t) for t in p])
        elif tokenizer is None:
            raise ValueError("text prompts need the target's tokenizer: pass token ids, or load the target by path")
        else:
            out.append(encode_prompt(tokenizer, p))
    return out


@torch.no_grad()
def realised_acceptance(drafter_dir, target, prompts: list[list[int]], *, max_new_tokens: int,
                        tree_budget: int) -> dict:
    """Mean acceptance length (tokens per verify round, bonus included, pooled over the prompts' rounds) of
    the exported drafter in ddtree's generation: the chain of ``block_size - 1`` and best_first@``tree_budget``.

    Each prompt is generated alone, greedy, with no stop token, so every prompt runs ``max_new_tokens``.
    """
    from ddtree.drafters.dflash.drafter import DFlashDrafter
    from ddtree.generation.generator import SpeculativeGenerator

    dtype = next(target.parameters()).dtype
    device = target.get_input_embeddings().weight.device
    drafter = DFlashDrafter.from_pretrained(drafter_dir, target, dtype=dtype, device=device)
    chain_len = drafter.model.config.block_size - 1
    result = {}
    for name, builder, budget in (("chain", "chain", chain_len), ("tree", "best_first", tree_budget)):
        gen = SpeculativeGenerator(target, drafter, builder=builder, tree_budget=budget, threads=None,
                               prompt_lookup=False)
        lengths = []
        for ids in prompts:
            out = gen.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens, do_sample=False,
                               stop_token_ids=())
            lengths += [int(n) for n in out.row_acceptance[0]]
        result[name] = sum(lengths) / max(1, len(lengths))
        result[f"{name}_rounds"] = len(lengths)
    result.update(chain_len=chain_len, tree_budget=tree_budget, prompts=len(prompts), max_new_tokens=max_new_tokens)
    return result


def config_problems(drafter_dir, target, tokenizer=None) -> list[str]:
    """The doctor's config check on the export: one line per warning or error (empty when clean)."""
    report = check_config(read_raw_config(drafter_dir), target.config, tokenizer)
    return [f"{f.status}: {f.section} / {f.name} = {f.value}" + (f" ({f.note})" if f.note else "")
            for f in report.problems]


def acceptance_gap(estimate: float, realised_chain: float, fraction: float) -> str | None:
    """A warning when the realised chain gains (acceptance - 1) less than ``fraction`` of the estimate's gain."""
    if estimate <= 1.0 or realised_chain - 1.0 >= fraction * (estimate - 1.0):
        return None
    return (f"realised chain acceptance {realised_chain:.3f} gains less than {fraction:.0%} of the held-out "
            f"estimate {estimate:.3f}: the held-out answers come from the training prompt generators, so some gap "
            "is the prompts'; a large one points at the export (run `python -m ddtree doctor` on it) or at "
            "training data far from what users ask")


def check_export(drafter_dir, target, tokenizer, prompts, *, estimate: float, max_new_tokens: int,
                 tree_budget: int, gap_fraction: float) -> dict:
    """Realised chain and tree acceptance, the training estimate, the gap flag and the config check, as a dict."""
    ids = encode_prompts(prompts, tokenizer)
    real = realised_acceptance(drafter_dir, target, ids, max_new_tokens=max_new_tokens, tree_budget=tree_budget)
    gap = acceptance_gap(estimate, real["chain"], gap_fraction)
    return {"drafter": str(Path(drafter_dir)), "estimate": estimate, **real, "gap": gap,
            "config_problems": config_problems(drafter_dir, target, tokenizer)}
