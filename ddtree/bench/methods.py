"""What the bench compares: the method mini-language (``ar``, ``chain``, ``best_first@N``, ...) and the plain
decoding baselines it times against."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ddtree.core.noise import row_keys
from ddtree.core.sampling import SamplingConfig, choose_tokens
from ddtree.targets.cache import cache_kwargs, new_target_cache

STAGES = ("draft", "tree_build", "mask", "verify", "commit")


@dataclass(frozen=True)
class Method:
    """One row of the benchmark: ``kind`` is ``"ar"`` or ``"tree"``; ``budget`` None means the draft depth."""

    name: str
    kind: str = "tree"
    builder: str = "best_first"
    budget: int | str | None = None
    proposer: str = "drafter"  # "drafter", "lookup" (prompt lookup alone) or "merged" (drafter + lookup branch)


def _budget_list(text: str, spec: str) -> list[int]:
    """``"16"`` or ``"1-256"`` (powers of two from 1 to 256)."""
    if re.fullmatch(r"\d+", text):
        return [int(text)]
    m = re.fullmatch(r"(\d+)-(\d+)", text)
    if not m or int(m[1]) < 1 or int(m[1]) > int(m[2]):
        raise ValueError(f"bad budget {text!r} in method {spec!r}: use N or A-B (powers of two from A to B)")
    lo, hi = int(m[1]), int(m[2])
    out, b = [], 1
    while b <= hi:
        if b >= lo:
            out.append(b)
        b *= 2
    return out


def parse_methods(specs: str | Sequence[str], default_budget: int = 32) -> list[Method]:
    """Parse method specs; ``ar`` is always included (first) since speedups and the lossless check need it."""
    items: list[str] = []
    for spec in [specs] if isinstance(specs, str) else specs:
        items.extend(s.strip() for s in spec.split(",") if s.strip())
    methods: list[Method] = []
    last_tree: Method | None = None
    for item in items:
        merged = item.endswith("+lookup")
        item = item.removesuffix("+lookup")
        if re.fullmatch(r"\d+(-\d+)?", item):
            if last_tree is None or not isinstance(last_tree.budget, int):
                raise ValueError(f"bare budget {item!r} must follow a method with '@N' (e.g. best_first@16,32)")
            new = [_with_budget(last_tree, b) for b in _budget_list(item, item)]
        elif item == "ar":
            new = [Method("ar", kind="ar", builder="", budget=0)]
        elif item == "ar_stock":
            new = [Method("ar_stock", kind="ar", builder="", budget=0)]
        elif item == "hf_lookup":
            new = [Method("hf_lookup", kind="ar", builder="", budget=0)]
        elif item == "lookup":
            new = [Method("lookup", builder="chain", budget=None, proposer="lookup")]
        elif item == "auto":
            new = [Method("auto", builder="best_first", budget="auto")]
        elif item.startswith("beam@"):
            m = re.fullmatch(r"beam@(\d+)x(\d+)", item.lower())
            if not m or int(m[1]) < 1 or int(m[2]) < 1:
                raise ValueError(f"beam method must look like beam@4x8 (width x depth), got {item!r}")
            new = [Method(item.lower(), builder=item.lower(), budget=int(m[1]) * int(m[2]))]
        else:
            base, _, at = item.partition("@")
            if base == "chain":
                new = [Method("chain" if not at else f"chain@{b}", builder="chain", budget=int(b) if at else None)
                       for b in (_budget_list(at, item) if at else [0])]
            elif base == "best_first" or ":" in base:
                if ":" in base and not re.fullmatch(r"[\w.]+:\w+", base):
                    raise ValueError(f"custom builder must be module:function, got {item!r}")
                budgets = _budget_list(at, item) if at else [default_budget]
                new = [Method(f"{base}@{b}", builder=base, budget=b) for b in budgets]
            else:
                raise ValueError(
                    f"unknown method {item!r}: use ar, ar_stock, hf_lookup, lookup, chain, best_first@N, beam@WxD, "
                    "auto or module:function[@N], tree methods optionally with +lookup"
                )
        if merged:
            if any(m.kind != "tree" or m.proposer != "drafter" for m in new):
                raise ValueError(f"+lookup extends a tree method (chain, best_first@N, beam@WxD, auto), not {item!r}")
            new = [Method(m.name + "+lookup", m.kind, m.builder, m.budget, "merged") for m in new]
        for m in new:
            if m.name not in {x.name for x in methods}:
                methods.append(m)
        if new and new[-1].kind == "tree" and isinstance(new[-1].budget, int):
            last_tree = new[-1]
    if not any(m.name == "ar" for m in methods):
        methods.insert(0, Method("ar", kind="ar", builder="", budget=0))
    return methods


def _with_budget(m: Method, budget: int) -> Method:
    base = m.name.split("@")[0]
    suffix = "+lookup" if m.proposer == "merged" else ""
    return Method(f"{base}@{budget}{suffix}", kind=m.kind, builder=m.builder, budget=budget, proposer=m.proposer)


@torch.inference_mode()
def autoregressive(target, input_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig,
                   seed: int, stops: frozenset[int]) -> tuple[list[int], dict[str, float], list[float]]:
    """Target-only decoding with a KV cache: the baseline every speedup is over. Returns the tokens, the
    prefill and decode seconds, and each decode step's seconds (the spread a comparison's noise comes from)."""
    keys = row_keys(seed, 1, input_ids.device)  # the generator's keyed draws: the same tokens for a seed
    position = input_ids.shape[1]
    cache = new_target_cache()
    t0 = time.perf_counter()
    out = target(input_ids=input_ids, use_cache=True, **cache_kwargs(target, cache))
    tok = choose_tokens(out.logits[:, -1], sampling, keys=keys, positions=torch.tensor([position]))
    tokens = [int(tok)]
    t1 = last = time.perf_counter()
    steps = []
    while len(tokens) < max_new_tokens and tokens[-1] not in stops:
        out = target(input_ids=tok.view(1, 1), use_cache=True, **cache_kwargs(target, cache))
        position += 1
        tok = choose_tokens(out.logits[:, -1], sampling, keys=keys, positions=torch.tensor([position]))
        tokens.append(int(tok))  # a host read: the step has finished on any device
        now = time.perf_counter()
        steps.append(now - last)
        last = now
    return tokens, {"prefill": t1 - t0, "decode": last - t1}, steps


def _proposer(generator, kind: str):
    """The drafter a method drafts with: the generator's own, prompt lookup alone, or both merged."""
    from ddtree.drafters.lookup import PromptLookup, WithLookup

    if kind == "drafter":
        return generator.drafter
    lookup = PromptLookup.for_target(generator.target, block_size=generator.drafter.block_size)
    return lookup if kind == "lookup" else WithLookup(generator.drafter, lookup)


def _never_emitted(target) -> int:
    """An id past the vocabulary, as a stop that never fires: transformers 5.0's prompt-lookup candidate
    generator fails on ``eos_token_id=None`` (it tests candidates against it)."""
    return int(target.get_output_embeddings().weight.shape[0])


@torch.inference_mode()
def hf_prompt_lookup(target, input_ids: torch.Tensor, max_new_tokens: int, stops: frozenset[int],
                     num_tokens: int = 10) -> list[int]:
    """transformers' own prompt-lookup decoding (greedy), the baseline for ddtree's lookup branch."""
    out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                          do_sample=False, prompt_lookup_num_tokens=num_tokens,
                          eos_token_id=sorted(stops) or [_never_emitted(target)], pad_token_id=0)
    new = out[0, input_ids.shape[1]:].tolist()
    cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
    return new[:cut]
