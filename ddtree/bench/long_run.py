"""``python -m ddtree.bench long-run``: one long generation, checked exact, and the memory it holds.

Three passes over the same prompt, all through public interfaces:

1. ``SpeculativeGenerator.start`` and ``speculative_round``: the tokens (compared with HF greedy token for
   token), rounds and acceptance, the wall time per round early and late in the run, and at checkpoints
   the process RSS, the live Python object count, the generation's target-cache bytes and its drafter
   context's bytes (buffers that grow by doubling, capacity included);
2. a loop of the public building blocks (``propose``, the builder, ``tree_attention_mask``,
   ``verify_tree``, ``commit_accepted``, as ``examples/custom_loop.py``), which owns its target cache:
   the cache's bytes at each checkpoint, against the bytes one token needs
   (2 x layers x kv heads x head dim x dtype size);
3. two short ``generate`` calls: the Python objects a finished call leaves behind.

``--tiny`` runs a random float64 target (a 4-layer Qwen3, vocabulary 97) built here; without it, the shipped
default pair (or ``--target/--drafter``) with the tokenizer's chat template over ``--prompt``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

from ddtree.core.masks import tree_attention_mask, tree_position_ids
from ddtree.core.verify import verify_tree
from ddtree.targets.cache import cache_kwargs, commit_accepted, new_target_cache

DEFAULT_PROMPT = "Write a long story about a lighthouse keeper and the sea, chapter by chapter."


# --------------------------------------------------------------------- measurements


def rss_bytes() -> int:
    """The process's resident set size now (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def python_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def cache_bytes(cache) -> int:
    return sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None and t.numel())


def drafter_context_bytes(state) -> int:
    """Bytes the generation's drafter context holds (its buffers, capacity included)."""
    nbytes = getattr(state.on_device.draft, "nbytes", None)
    return nbytes() if nbytes is not None else 0


def kv_bytes_per_token(target) -> int:
    """What one token needs in a full-attention KV cache: keys and values of every layer."""
    cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dtype = next(target.parameters()).dtype
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def checkpoints_for(n: int, count: int) -> list[int]:
    return sorted({max(1, round(n * (i + 1) / count)) for i in range(count)})


# --------------------------------------------------------------------- passes


def hf_greedy(target, input_ids: torch.Tensor, new: int) -> list[int]:
    """HF ``generate`` greedy, no EOS stop, an explicit all-ones attention mask (so no prompt token equal
    to the pad id is masked)."""
    eos = target.generation_config.eos_token_id
    target.generation_config.eos_token_id = None
    try:
        out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0)
    finally:
        target.generation_config.eos_token_id = eos
    return out[0, input_ids.shape[1]:].tolist()


def stream_pass(gen, input_ids: torch.Tensor, new: int, checkpoints: list[int]) -> dict:
    """The generation itself, round by round through ``speculative_round``; samples memory at each checkpoint."""
    from ddtree.generation.round import speculative_round

    tokens: list[int] = []
    round_seconds: list[float] = []
    samples = []
    todo = list(checkpoints)
    objects_before = python_objects()
    state = gen.start(input_ids, max_new_tokens=new, stop_token_ids=())
    t0 = last = time.perf_counter()
    while not state.done:
        chunk = speculative_round(state).tokens[0]
        now = time.perf_counter()
        round_seconds.append(now - last)
        tokens += chunk
        while todo and len(tokens) >= todo[0]:
            todo.pop(0)
            samples.append({
                "committed": len(tokens),
                "rss_mb": rss_bytes() / 2**20,
                "python_objects_delta": python_objects() - objects_before,
                "drafter_context_bytes": drafter_context_bytes(state),
                "cache_bytes": cache_bytes(state.on_device.cache) if state.on_device.cache is not None else 0,
            })
        last = time.perf_counter()  # the sampling above is not part of the next round
    total = time.perf_counter() - t0
    rounds = round_seconds[1:]  # the first chunk is the prefill
    tenth = max(1, len(rounds) // 10)
    return {
        "tokens": tokens,
        "seconds": total,
        "rounds": len(rounds),
        "mean_acceptance": (len(tokens) - 1) / len(rounds) if rounds else 0.0,
        "round_ms_first_tenth": 1e3 * sum(rounds[:tenth]) / tenth if rounds else 0.0,
        "round_ms_last_tenth": 1e3 * sum(rounds[-tenth:]) / tenth if rounds else 0.0,
        "samples": samples,
    }


@torch.inference_mode()
def block_loop_pass(gen, input_ids: torch.Tensor, new: int, checkpoints: list[int], budget: int) -> dict:
    """Greedy DDTree with the public blocks and a cache of our own; the cache's bytes at each checkpoint."""
    target, drafter, builder = gen.target, gen.drafter, gen.builder
    cache = new_target_cache(target)
    context = drafter.new_context()
    out = target(input_ids=input_ids, use_cache=True, output_hidden_states=True, **cache_kwargs(target, cache))
    context.append(drafter.context_features(out.hidden_states), input_ids)
    root = out.logits[:, -1].argmax(-1)
    tokens = [int(root)]
    samples, todo = [], list(checkpoints)
    while len(tokens) < new:
        start = cache.get_seq_length()
        tree = builder(root.view(-1), context.propose(root).logprobs, budget)
        out = target(input_ids=tree.tokens, position_ids=tree_position_ids(tree.depths, start),
                     attention_mask=tree_attention_mask(tree.visibility, start, next(target.parameters()).dtype),
                     use_cache=True, output_hidden_states=True, **cache_kwargs(target, cache))
        result = verify_tree(tree, out.logits)
        path = result.accepted
        commit_accepted(cache, start, path)
        context.append(drafter.context_features(out.hidden_states)[:, path[0]], tree.tokens[:, path[0]])
        root = result.bonus
        tokens += tree.tokens[0, path[0, 1:]].tolist() + [int(root)]
        while todo and len(tokens) >= todo[0]:
            todo.pop(0)
            samples.append({"committed": len(tokens), "cache_positions": cache.get_seq_length(),
                            "cache_bytes": cache_bytes(cache)})
    return {"tokens": tokens[:new], "samples": samples}


def leak_pass(gen, input_ids: torch.Tensor, new: int) -> dict:
    """Python objects left behind by one finished ``generate`` call, after a first call warmed every path."""
    out = gen.generate(input_ids, max_new_tokens=new, stop_token_ids=())
    del out
    before = python_objects()
    out = gen.generate(input_ids, max_new_tokens=new, stop_token_ids=())
    del out
    after = python_objects()
    return {"tokens_per_call": new, "python_objects_left_by_a_call": after - before}


def long_run(gen, input_ids: torch.Tensor, new: int, *, budget: int, checkpoints: int = 8,
             reference: bool = True, loop: bool = True, leak_tokens: int = 200) -> dict:
    """All three passes; returns the figures (see the module docstring)."""
    gen.tree_budget = budget
    points = checkpoints_for(new, checkpoints)
    rss_start = rss_bytes()
    result: dict = {"new_tokens": new, "prompt_tokens": int(input_ids.shape[1]), "budget": budget,
                    "builder": getattr(gen.builder, "__name__", str(gen.builder)),
                    "rss_mb_at_start": rss_start / 2**20}
    t0 = time.perf_counter()
    ref = hf_greedy(gen.target, input_ids, new) if reference else None
    result["reference_seconds"] = time.perf_counter() - t0 if reference else None
    s = stream_pass(gen, input_ids, new, points)
    result["stream"] = {k: v for k, v in s.items() if k != "tokens"}
    result["exact_vs_hf_greedy"] = (s["tokens"] == ref) if ref is not None else None
    if ref is not None and s["tokens"] != ref:
        result["first_mismatch"] = next((i for i, (a, b) in enumerate(zip(s["tokens"], ref)) if a != b),
                                        min(len(ref), len(s["tokens"])))
    if loop:
        b = block_loop_pass(gen, input_ids, new, points, budget)
        result["block_loop"] = b["samples"]
        result["block_loop_equals_stream"] = b["tokens"] == s["tokens"]
        last = b["samples"][-1]
        result["target_cache_bytes_per_token"] = last["cache_bytes"] / last["cache_positions"]
    result["kv_bytes_per_token_expected"] = kv_bytes_per_token(gen.target)
    last = s["samples"][-1]
    prompt = int(input_ids.shape[1])
    result["drafter_context_bytes_per_token"] = last["drafter_context_bytes"] / (prompt + last["committed"])
    result.update(leak_pass(gen, input_ids, min(leak_tokens, new)))
    result["peak_rss_mb"] = peak_rss_bytes() / 2**20
    return result


# --------------------------------------------------------------------- models


def tiny_generator(max_positions: int, budget: int, builder: str = "best_first", seed: int = 0):
    """A random float64 4-layer Qwen3 target (vocabulary 97) and a random 2-layer DFlash drafter."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ddtree.drafters.dflash.config import DFlashConfig
    from ddtree.drafters.dflash.model import DFlashDraftModel
    from ddtree.generation.generator import SpeculativeGenerator

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=max_positions)
    target = Qwen3ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # as the test targets: greedy continuations less degenerate
    dcfg = DFlashConfig.for_target(cfg, num_hidden_layers=2, block_size=8, mask_token_id=96)
    drafter = DFlashDraftModel(dcfg).double().eval()
    return SpeculativeGenerator(target, drafter, tree_budget=budget, builder=builder, threads="auto",
                                prompt_lookup=False)


def encode(tokenizer, prompt: str) -> torch.Tensor:
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        ids = enc["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[-1] == 0:
        raise SystemExit("the target's tokenizer encoded the prompt to no tokens: the target directory probably "
                         "lacks its tokenizer files (e.g. tokenizer.json); copy them there")
    return ids


# --------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddtree.bench long-run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a random float64 tiny target built here (no download)")
    p.add_argument("--target", help="target model directory (default: the shipped pair)")
    p.add_argument("--drafter", help="DFlash drafter directory")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=2000)
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--builder", default="best_first")
    p.add_argument("--checkpoints", type=int, default=8, help="memory samples along the run")
    p.add_argument("--no-reference", action="store_true", help="skip the HF greedy reference")
    p.add_argument("--no-loop", action="store_true", help="skip the building-block pass (no target-cache bytes)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("bench_out/long_run"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        prompt_ids = torch.tensor([[5, 17, 3, 9, 40, 61, 7, 33]])
        gen = tiny_generator(prompt_ids.shape[1] + args.max_new_tokens + 64, args.budget, args.builder)
        which = "tiny random float64 Qwen3 (4 layers, hidden 64, vocab 97) + random 2-layer DFlash drafter"
    else:
        from ddtree.generation.generator import SpeculativeGenerator

        if (args.target is None) != (args.drafter is None):
            raise SystemExit("give --drafter along with --target (or neither, for the shipped pair)")
        gen = SpeculativeGenerator.from_pretrained(args.target, args.drafter, tree_budget=args.budget,
                                                   builder=args.builder, threads="auto", prompt_lookup=False)
        if gen.tokenizer is None:
            raise SystemExit("the target has no tokenizer: pass --tiny or a target directory with tokenizer files")
        prompt_ids = encode(gen.tokenizer, args.prompt)
        which = args.target or "default pair (SmolLM2-135M-Instruct + shipped drafter)"
    result = long_run(gen, prompt_ids, args.max_new_tokens, budget=args.budget, checkpoints=args.checkpoints,
                      reference=not args.no_reference, loop=not args.no_loop)
    import transformers

    result["meta"] = {
        "command": "python -m ddtree.bench long-run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "models": which,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": platform.platform(), "torch": torch.__version__, "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "dtype": str(next(gen.target.parameters()).dtype).removeprefix("torch."),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long_run.json").write_text(json.dumps(result, indent=1))
    (args.out / "long_run.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {args.out / 'long_run.json'} and {args.out / 'long_run.md'}")
    return 0 if result["exact_vs_hf_greedy"] is not False and result.get("block_loop_equals_stream", True) else 1


def markdown(r: dict) -> str:
    s = r["stream"]
    m = r.get("meta", {})
    exact = {True: "yes", False: "**NO**", None: "not checked"}[r["exact_vs_hf_greedy"]]
    lines = [
        f"`{m.get('command', '')}`\n",
        f"{m.get('models', '')}; {m.get('dtype', '')}, torch {m.get('torch', '')} ({m.get('torch_threads', '')} "
        f"threads), transformers {m.get('transformers', '')}, {m.get('date_utc', '')}.\n",
        "| figure | value |\n|---|---:|",
        f"| new tokens (prompt) | {r['new_tokens']} ({r['prompt_tokens']}) |",
        f"| builder @ budget | {r['builder']} @ {r['budget']} |",
        f"| exact vs HF greedy | {exact} |",
        f"| rounds, mean acceptance | {s['rounds']}, {s['mean_acceptance']:.2f} |",
        f"| generation seconds (HF reference seconds) | {s['seconds']:.1f} ({r['reference_seconds'] or 0:.1f}) |",
        f"| ms per round, first / last tenth of the run | {s['round_ms_first_tenth']:.1f} / "
        f"{s['round_ms_last_tenth']:.1f} |",
        f"| peak RSS (RSS at start) | {r['peak_rss_mb']:.0f} MB ({r['rss_mb_at_start']:.0f} MB) |",
    ]
    if "target_cache_bytes_per_token" in r:
        lines.append(f"| target cache bytes per committed token (expected) | "
                     f"{r['target_cache_bytes_per_token']:.0f} ({r['kv_bytes_per_token_expected']}) |")
    lines += [
        f"| drafter context bytes per context token | {r['drafter_context_bytes_per_token']:.0f} |",
        f"| Python objects left by a finished {r['tokens_per_call']}-token generate call | "
        f"{r['python_objects_left_by_a_call']} |",
        "",
        "| committed | RSS MB | Python objects (delta) | drafter context bytes |"
        + (" target cache bytes |" if "block_loop" in r else ""),
        "|---:|---:|---:|---:|" + ("---:|" if "block_loop" in r else ""),
    ]
    loop = {x["committed"]: x for x in r.get("block_loop", [])}
    for x, y in zip(s["samples"], r.get("block_loop", [None] * len(s["samples"]))):
        row = (f"| {x['committed']} | {x['rss_mb']:.0f} | {x['python_objects_delta']} | "
               f"{x['drafter_context_bytes']} |")
        if loop:
            row += f" {y['cache_bytes'] if y else ''} |"
        lines.append(row)
    return "\n".join(lines) + "\n"
