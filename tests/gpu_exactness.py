"""The GPU exactness checks: split tree attention, causal calls, drafter block attention, a tiny target's
tree verify, batch rows against batch 1, and the GDN tree forward, each against a float32 reference.

Each ``check_*`` returns one row per case (``max_abs_err``, ``tol``, ``ok``) so a report shows every case.
``tests/test_gpu.py`` runs them on CUDA (marker ``gpu``, level ``full``), the normal suite runs the ``tiny``
level on the CPU, and ``python -m ddtree.bench.gpu_check`` runs ``tests/test_gpu.py`` before its benchmarks.
"""

from __future__ import annotations

import math
import random

import torch

from ddtree.bench.attention import _Layer, random_tree
from ddtree.core.masks import tree_attention_mask
from ddtree.core.tree import DraftTree
from ddtree.drafters.dflash.attention import block_attention
from ddtree.targets.backends import get_backend
from ddtree.targets.cache import cache_kwargs
from ddtree.targets.kernels import flash_attn_available
from ddtree.targets.registration import (
    IMPLEMENTATIONS,
    TREE_KWARG,
    TreeAttentionSpec,
    register_attention_implementations,
)

BF16_TOL = 2e-2  # max abs error of bf16 results against float32 dense attention
FP32_TOL = 1e-4
GDN_BF16_TOL = 5e-2  # relative: a bf16 tree row and a bf16 one-token decode round differently through the stack


def _backends(device: torch.device) -> list[str]:
    names = ["split", "fused"]
    if device.type == "cuda" and flash_attn_available():
        names.append("flash_attn")
    return names


def _dense_fp32(q, k, v, allowed) -> torch.Tensor:
    """float32 softmax attention with a bool ``[B, 1, N, S]`` mask, ``[B, Hq, N, D]``."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def _tree_inputs(device, dtype, heads, kv_heads, head_dim, prefix_len, n, seed):
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(n, 15, gen)
    tree = DraftTree.from_parents(tree.tokens.to(device), tree.parents.to(device))
    shape = lambda h, s: torch.randn(1, h, s, head_dim, generator=gen).to(device, dtype)  # noqa: E731
    return tree, shape(heads, n), shape(kv_heads, prefix_len + n), shape(kv_heads, prefix_len + n)


def check_split(device, dtype, tol, shapes) -> list[dict]:
    """Registered split attention (every backend) against float32 dense attention under the lead's mask."""
    from transformers import AttentionInterface

    register_attention_implementations()
    functions = AttentionInterface()
    rows = []
    for i, (heads, kv_heads, head_dim, prefix_len, n, window) in enumerate(shapes):
        tree, q, k, v = _tree_inputs(device, dtype, heads, kv_heads, head_dim, prefix_len, n, seed=i)
        mask = tree_attention_mask(tree.visibility, prefix_len, torch.float32, sliding_window=window,
                                   depths=tree.depths)
        ref = _dense_fp32(q, k, v, mask == 0)
        spec = TreeAttentionSpec.from_tree(tree)
        layer = _Layer(heads, kv_heads, window)
        for name in _backends(device):
            fn = functions[IMPLEMENTATIONS[name][0]]
            out, _ = fn(layer, q, k, v, None, scaling=1 / math.sqrt(head_dim), sliding_window=window,
                        **{TREE_KWARG: spec})
            err = float((out.transpose(1, 2).float() - ref).abs().max())
            rows.append(dict(backend=name, heads=heads, kv_heads=kv_heads, head_dim=head_dim, prefix=prefix_len,
                             nodes=n, window=window, max_abs_err=err, tol=tol, ok=err <= tol))
        del ref, mask
    return rows


def check_causal(device, dtype, tol, tiny: bool = False) -> list[dict]:
    """Prefill / chunk / decode calls (no tree) against float32 bottom-right causal attention."""
    from transformers import AttentionInterface

    register_attention_implementations()
    functions = AttentionInterface()
    rows = []
    gen = torch.Generator().manual_seed(0)
    cases = [(512, 512, None), (512, 512, 100), (64, 700, None), (64, 700, 50), (1, 900, None), (1, 900, 128)]
    heads, head_dim = (16, 128) if not tiny else (4, 32)
    if tiny:
        cases = [(c[0] // 8 or 1, c[1] // 8, c[2] and c[2] // 8) for c in cases]
    for q_len, kv_len, window in cases:
        q = torch.randn(1, heads, q_len, head_dim, generator=gen).to(device, dtype)
        k = torch.randn(1, heads // 4, kv_len, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(1, heads // 4, kv_len, head_dim, generator=gen).to(device, dtype)
        dist = (kv_len - q_len + torch.arange(q_len, device=device))[:, None] - torch.arange(kv_len, device=device)
        allowed = (dist >= 0) & (dist < (window or 1 << 30))
        ref = _dense_fp32(q, k, v, allowed)
        for name in _backends(device):
            fn = functions[IMPLEMENTATIONS[name][0]]
            out, _ = fn(_Layer(heads, heads // 4, window), q, k, v, None, scaling=1 / math.sqrt(head_dim),
                        sliding_window=window)
            err = float((out.transpose(1, 2).float() - ref).abs().max())
            rows.append(dict(backend=name, q_len=q_len, kv_len=kv_len, window=window, max_abs_err=err, tol=tol,
                             ok=err <= tol))
    return rows


def check_block(device, dtype, tol, tiny: bool = False) -> list[dict]:
    """Drafter block attention (flash-attn when it applies) against float32 with the DFlash window."""
    rows = []
    gen = torch.Generator().manual_seed(1)
    cases = [(300, 16, None), (300, 16, 64), (2000, 16, 256), (10, 16, 4)]
    cases = cases if not tiny else [(c[0] // 10, 8, c[2] and max(2, c[2] // 16)) for c in cases]
    for (ctx, block, window), causal in [(c, causal) for c in cases for causal in (False, True)]:
        q = torch.randn(1, 32, block, 128, generator=gen).to(device, dtype)
        k = torch.randn(1, 8, ctx + block, 128, generator=gen).to(device, dtype)
        v = torch.randn(1, 8, ctx + block, 128, generator=gen).to(device, dtype)
        dist = (ctx + torch.arange(block, device=device))[:, None] - torch.arange(ctx + block, device=device)
        near = (dist < (window or 1 << 30)) if causal else dist.abs() < (window or 1 << 30)
        ref = _dense_fp32(q, k, v, near & (dist >= 0) if causal else near)
        for backend in ("auto", "sdpa"):
            out = block_attention(q, k, v, window=window, causal=causal, backend=backend)
            err = float((out.float() - ref).abs().max())
            rows.append(dict(backend=backend, flash_attn=flash_attn_available() and device.type == "cuda",
                             ctx=ctx, block=block, window=window, causal=causal, max_abs_err=err, tol=tol,
                             ok=err <= tol))
    return rows


def check_model(device, dtype, tol, tiny: bool = False) -> list[dict]:
    """A tiny Qwen3 target with a sliding layer: tree-verify logits of each backend against the dense mask."""
    from transformers import AutoModelForCausalLM, DynamicCache, Qwen3Config

    torch.manual_seed(0)
    width, prompt_len, nodes = (256, 200, 65) if not tiny else (64, 30, 17)
    cfg = Qwen3Config(vocab_size=128, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=width // 4, use_sliding_window=True,
                      sliding_window=prompt_len // 5, max_window_layers=2)
    model = AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(3)
    tree = random_tree(nodes, 15, gen)
    tree = DraftTree.from_parents(torch.randint(0, 128, (1, nodes), generator=gen).to(device), tree.parents.to(device))
    prompt = torch.randint(0, 128, (1, prompt_len), generator=gen).to(device)

    def verify_logits(backend_name):
        backend = get_backend(backend_name)
        backend.prepare(model)
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=prompt[:, :-1], use_cache=True, **cache_kwargs(model, cache))
            model(input_ids=prompt[:, -1:], use_cache=True, **cache_kwargs(model, cache))
            kw = backend.tree_forward_kwargs(model, tree, prompt.shape[1], dtype)
            return model(input_ids=tree.tokens, position_ids=prompt.shape[1] + tree.depths, use_cache=True,
                         **cache_kwargs(model, cache), **kw).logits.float()

    ref = verify_logits("sdpa")
    rows = []
    for name in _backends(device):
        err = float((verify_logits(name) - ref).abs().max())
        rows.append(dict(backend=name, dtype=str(dtype), logit_scale=float(ref.abs().max()), max_abs_err=err, tol=tol,
                         ok=err <= tol))
    return rows


def check_batch(device, dtype, level: str) -> list[dict]:
    """Batch > 1 on a random target at Qwen3-8B widths (a few layers): every row equals its batch-1 run in
    float32, and the throughput table (tokens/s, verify ms per round) for batch 1, 4, 8, 16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ddtree.core.builders import resolve_builder
    from ddtree.drafters.dflash.config import DFlashConfig
    from ddtree.drafters.dflash.model import DFlashDraftModel
    from ddtree.generation.generator import SpeculativeGenerator

    torch.manual_seed(0)
    if level == "tiny":
        dims, layers, sizes, new = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16), 2, (1, 3), 8
    else:
        dims = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128)
        layers, sizes, new = 2 if level == "quick" else 6, (1, 4, 8, 16), 32
    cfg = Qwen3Config(vocab_size=32000, num_hidden_layers=layers, max_position_embeddings=4096, **dims)
    target = Qwen3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    dcfg = DFlashConfig.for_target(cfg, num_hidden_layers=1, block_size=16, mask_token_id=31999)
    drafter = DFlashDraftModel(dcfg).to(device=device, dtype=dtype).eval()
    gen = SpeculativeGenerator(target, drafter, attention="auto")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 32000, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 200, (16,), generator=g)]
    single = {b: gen.generate(prompts[b], max_new_tokens=new, tree_budget=16) for b in range(max(sizes))}
    rows = []
    for size in sizes:
        for name, budget, builder in (("plain", 0, "best_first"), ("chain", 15, "chain"),
                                      ("best_first@16", 16, "best_first")):
            gen.builder = resolve_builder(builder)
            gen.generate(prompts[:size], max_new_tokens=4, tree_budget=budget)  # warm-up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out = gen.generate(prompts[:size] if size > 1 else prompts[0], max_new_tokens=new, tree_budget=budget)
            s = out.stats
            equal = (sum(out.row_tokens[b] == single[b].row_tokens[0] for b in range(size))
                     if name == "best_first@16" else None)
            mismatch = 0.0 if equal is None else 1.0 - equal / size
            rows.append(dict(batch=size, method=name, dtype=str(dtype), tokens_per_second=round(s.tokens_per_second, 1),
                             verify_ms_per_round=round(1e3 * s.seconds["verify"] / max(s.rounds, 1), 2),
                             rows_equal_batch_1=equal, max_abs_err=mismatch, tol=0.0,
                             ok=dtype != torch.float32 or mismatch == 0.0))
    for r in rows:
        print(f"        batch {r['batch']:>2} {r['method']:<14} {r['tokens_per_second']:>8} tok/s  "
              f"verify {r['verify_ms_per_round']} ms/round  rows = batch 1: {r['rows_equal_batch_1']}", flush=True)
    return rows


def check_compiled(device, level: str) -> list[dict]:
    """The static round (``compile=True``: inductor, CUDA graphs on CUDA; ``aot_eager`` at the tiny level, where
    inductor would take minutes on a CPU) against the dynamic round, float32 with TF32 off: tokens and
    acceptance equal, best_first@16 (the bench adds the chain), on a Qwen3 target at batch 1 and a ragged
    batch, and on a Qwen3.5-style GDN hybrid (3 GDN : 1 attention) at the ragged batch.
    ``cudagraph_skips`` counts the steps inductor ran without a CUDA graph (0 expected on CUDA)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ddtree.bench.linear import hybrid_target
    from ddtree.drafters.dflash.config import DFlashConfig
    from ddtree.drafters.dflash.drafter import DFlashDrafter
    from ddtree.drafters.dflash.model import DFlashDraftModel
    from ddtree.targets.cache import new_target_cache

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    if level == "tiny":
        dims, layers, new, compile = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16), 2, 12, "aot_eager"
    else:
        dims = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                    head_dim=64)
        layers, new, compile = 4, 48, True
    vocab = 4096
    cfg = Qwen3Config(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=4096, **dims)

    def pair(target):
        with torch.no_grad():
            target.lm_head.weight.mul_(4.0)  # greedy continuations that are not one repeated token
        dcfg = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=8, mask_token_id=vocab - 1)
        return target, DFlashDrafter(DFlashDraftModel(dcfg).to(device=device, dtype=torch.float32).eval(), target)

    qwen3 = pair(Qwen3ForCausalLM(cfg).to(device=device, dtype=torch.float32).eval())
    hybrid = pair(hybrid_target("tiny", 4, vocab=vocab, dtype=torch.float32, device=device))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (37, 12, 80)]
    torch._dynamo.utils.counters.clear()
    rows = _compiled_rows("qwen3", *qwen3, (prompts[:1], prompts), new, compile)
    if getattr(new_target_cache(hybrid[0]), "layers", None) is not None:  # else compile=True refuses it, saying so
        rows += _compiled_rows("gdn_hybrid", *hybrid, (prompts,), new, compile)
    return rows


def _compiled_rows(name, target, drafter, batches, new, compile) -> list[dict]:
    from ddtree.generation.generator import SpeculativeGenerator

    rows = []
    for builder, budget in (("best_first", 16),):  # each (builder, budget) compiles its own steps: one here
        dynamic = SpeculativeGenerator(target, drafter, tree_budget=budget, builder=builder, attention="sdpa")
        static = SpeculativeGenerator(target, drafter, tree_budget=budget, builder=builder, compile=compile)
        for batch in batches:
            want = dynamic.generate(batch, max_new_tokens=new, stop_token_ids=())
            got = static.generate(batch, max_new_tokens=new, stop_token_ids=())
            equal = sum(a == b and x == y for a, b, x, y in zip(got.row_tokens, want.row_tokens,
                                                                  got.row_acceptance, want.row_acceptance))
            mismatch = 1.0 - equal / len(batch)
            skips = torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0)
            graphed = compile is True and next(target.parameters()).device.type == "cuda"
            rows.append(dict(target=name, builder=builder, budget=budget, batch=len(batch), compile=str(compile),
                             graph_breaks=sum(torch._dynamo.utils.counters["graph_break"].values()),
                             cudagraph_skips=skips, mean_acceptance=round(got.stats.mean_acceptance, 3),
                             max_abs_err=mismatch, tol=0.0,
                             # on CUDA a step run without its graph is a silent loss of what compile=True is for
                             ok=mismatch == 0.0 and not torch._dynamo.utils.counters["graph_break"]
                             and not (graphed and skips)))
    return rows


def check_linear(device, dtype, tol, level: str = "full") -> list[dict]:
    """A GDN hybrid layer stack: every tree node's hidden state against its path decoded token by token,
    and the committed GDN state against that chain's. ``full``: Qwen3.6-27B widths (3 GDN + 1 attention
    layers), a 1k context, 16- and 64-node trees; otherwise a tiny stack. Errors are relative to the
    reference's largest magnitude, so one tolerance serves both widths."""
    import copy

    from ddtree.bench.linear import hybrid_target
    from ddtree.core.masks import tree_position_ids
    from ddtree.targets.cache import commit_accepted, new_target_cache
    from ddtree.targets.linear_attention import _states, gdn_modules

    full = level == "full"
    model = hybrid_target("qwen36-27b" if full else "tiny", 4, dtype=dtype, device=device)
    context, node_counts = (1024, (16, 64)) if full else (48, (16,))
    vocab = model.get_input_embeddings().weight.shape[0]
    backend = get_backend("auto")
    backend.prepare(model)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, vocab, (1, context), generator=gen).to(device)
    rows = []
    with torch.inference_mode():
        base = new_target_cache(model)
        model(prompt, use_cache=True, **cache_kwargs(model, base))

        def decode(cache, tokens):
            for i, tok in enumerate(tokens):
                out = model(torch.tensor([[tok]], device=device),
                            position_ids=torch.tensor([[context + i]], device=device), use_cache=True,
                            output_hidden_states=True, **cache_kwargs(model, cache))
            return out.hidden_states[-1][0, -1].float()

        for nodes in node_counts:
            shape = random_tree(nodes, 15, gen)
            tree = DraftTree.from_parents(torch.randint(0, vocab, (1, nodes), generator=gen).to(device),
                                          shape.parents.to(device))
            cache = copy.deepcopy(base)
            kw = backend.tree_forward_kwargs(model, tree, context, dtype)
            out = model(tree.tokens, position_ids=tree_position_ids(tree.depths, context), use_cache=True,
                        output_hidden_states=True, **cache_kwargs(model, cache), **kw)
            parents = tree.parents[0].tolist()
            worst, deepest = 0.0, []
            for node in range(nodes):
                path = [node]
                while parents[path[-1]] >= 0:
                    path.append(parents[path[-1]])
                path = path[::-1]
                deepest = max(deepest, path, key=len)
                ref = decode(copy.deepcopy(base), tree.tokens[0, path].tolist())
                worst = max(worst, float((out.hidden_states[-1][0, node].float() - ref).abs().max() / ref.abs().max()))
            rows.append(dict(part="nodes", nodes=nodes, dtype=str(dtype), max_abs_err=worst, tol=tol, ok=worst <= tol))
            commit_accepted(cache, context, torch.tensor([deepest], device=device))
            chain = copy.deepcopy(base)
            decode(chain, tree.tokens[0, deepest].tolist())
            err = 0.0
            for m in gdn_modules(model):
                for got, want in zip(_states(cache, m.layer_idx), _states(chain, m.layer_idx)):
                    err = max(err, float((got.float() - want.float()).abs().max() / want.float().abs().max()))
            rows.append(dict(part="commit", nodes=nodes, dtype=str(dtype), max_abs_err=err, tol=tol, ok=err <= tol))
    return rows


def split_shapes(level: str) -> list[tuple]:
    """(heads, kv_heads, head_dim, prefix, nodes, window): edge cases, then Qwen3-8B-layer shapes up to 32k x 1025."""
    if level == "tiny":
        return [(4, 2, 64, 0, 1, None), (4, 2, 64, 0, 17, 3), (4, 4, 32, 1, 9, None), (8, 2, 64, 60, 33, 2),
                (8, 1, 128, 100, 20, 50)]
    shapes = [(4, 2, 64, 0, 1, None), (4, 2, 64, 0, 17, 3), (8, 8, 128, 1, 33, None), (16, 4, 64, 7, 64, 2),
              (32, 8, 128, 300, 257, None), (32, 8, 128, 300, 257, 150), (8, 1, 128, 2048, 100, 1000)]
    if level == "quick":
        return shapes
    rng = random.Random(0)
    for prefix in (1024, 4096, 16384, 32768):
        for n in (17, 65, 257, 1025):
            window = rng.choice([None, None, 4096, 8])
            shapes.append((32, 8, 128, prefix, n, window))
    return shapes


def _plan(level: str) -> dict:
    tiny = level == "tiny"
    return {
        "split_bf16": lambda d: check_split(d, torch.bfloat16, BF16_TOL, split_shapes(level)),
        "split_fp32": lambda d: check_split(d, torch.float32, FP32_TOL, split_shapes("tiny" if tiny else "quick")),
        "causal_bf16": lambda d: check_causal(d, torch.bfloat16, BF16_TOL, tiny),
        "block_bf16": lambda d: check_block(d, torch.bfloat16, BF16_TOL, tiny),
        "model_fp32": lambda d: check_model(d, torch.float32, FP32_TOL, tiny),
        "model_bf16": lambda d: check_model(d, torch.bfloat16, 0.1, tiny),
        "batch_fp32": lambda d: check_batch(d, torch.float32, level),
        "gdn_fp32": lambda d: check_linear(d, torch.float32, FP32_TOL, level),
        "gdn_bf16": lambda d: check_linear(d, torch.bfloat16, GDN_BF16_TOL, level),
        "compiled_fp32": lambda d: check_compiled(d, level),
    }


LEVELS = ("full", "quick", "tiny")
CHECKS = tuple(_plan("full"))
"""Every check's name, in the order a report lists them."""


def run_check(name: str, device: torch.device, level: str = "full") -> list[dict]:
    """The rows of check ``name`` at ``level`` full (GPU shapes up to 32k x 1025), quick or tiny (the CPU test)."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}: use one of {LEVELS}")
    if name not in CHECKS:
        raise ValueError(f"unknown check {name!r}: use one of {CHECKS}")
    return _plan(level)[name](torch.device(device))
