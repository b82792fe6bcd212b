"""``python -m ddtree.bench compiled``: the dynamic round against the static, compiled one, per method.

A random-weight Qwen3 target (``--preset qwen3-8b``: Qwen3-8B's widths, ``--layers`` of them; ``tiny``:
hidden 64), or a Qwen3.5-style GDN hybrid (``qwen36-27b-hybrid``: Qwen3.6-27B's widths; ``tiny-hybrid``; every
4th layer attention, the others GDN), and a one-layer DFlash drafter (block 16), or the shipped default pair
(``--preset default-pair``, float32, the demo's prompt through the chat template). Per method (the chain at
the drafter's depth, best_first at each budget) and mode (``eager``: the dynamic round; ``compiled``:
``compile=True``, inductor, CUDA graphs on CUDA; both with the dense-mask attention and ``numerics="fast"``,
the linears routed as ``--cpu-linear`` says; on a CPU also ``default``: the eager generator's own settings,
exact numerics, and ``compiled-exact``: ``compile=True`` with exact numerics) it runs one warm-up generation
(which compiles) and then ``--repeats`` timed ones, and reports the median milliseconds per round and its
share per stage, the tokens per round, the tokens/s, and whether the compiled run's tokens and acceptance
equal the eager one's (``compiled-exact``: the default's). Random weights accept about one token per round,
so tokens/s there is a per-round cost: with a trained pair, tokens/s is the tokens per round over these round
times. A case that fails is reported with its error; the others still run. ``--deadline`` (seconds) skips
the cases left when time runs out, so a one-call GPU check stays inside its limit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

from ddtree.targets import cpu_linear, exact_static

PRESETS = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=97),
}
HYBRID_PRESETS = {"qwen36-27b-hybrid": ("qwen36-27b", 151936), "tiny-hybrid": ("tiny", 97)}
"""GDN hybrids: the :mod:`ddtree.bench.linear` preset of their widths, and the vocabulary."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BLOCK = 16


def build_pair(preset: str, layers: int, device: torch.device, dtype: torch.dtype):
    """A random target of ``preset`` widths and ``layers`` layers, and a one-layer DFlash drafter for it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ddtree.bench.linear import hybrid_target
    from ddtree.drafters.dflash.config import DFlashConfig
    from ddtree.drafters.dflash.drafter import DFlashDrafter
    from ddtree.drafters.dflash.model import DFlashDraftModel

    torch.manual_seed(0)
    if preset in HYBRID_PRESETS:
        widths, vocab = HYBRID_PRESETS[preset]
        target = hybrid_target(widths, layers, vocab=vocab, dtype=dtype, device=device)
        config = target.config
    else:
        vocab = PRESETS[preset]["vocab_size"]
        config = Qwen3Config(num_hidden_layers=layers, max_position_embeddings=32768, tie_word_embeddings=False,
                             **PRESETS[preset])
        with torch.device(device):
            target = Qwen3ForCausalLM(config).to(dtype).eval()
    with torch.device(device):
        dconfig = DFlashConfig.for_target(config, num_hidden_layers=1, block_size=BLOCK, mask_token_id=vocab - 1)
        drafter = DFlashDraftModel(dconfig).to(dtype).eval()
    return target, DFlashDrafter(drafter, target)


def methods(budgets: list[int], block: int = BLOCK) -> list[tuple[str, str, int]]:
    """(label, builder, budget): the chain (its depth is the block's) and best_first at each budget."""
    return [("chain", "chain", block - 1)] + [(f"best_first@{b}", "best_first", b) for b in budgets]


def default_pair(cpu_linear: bool) -> tuple:
    """The shipped pair in float32 (its linears routed through the few-row kernel with ``cpu_linear``), and the
    demo's prompt through its chat template."""
    from ddtree.apps.demo import DEFAULT_PROMPT
    from ddtree.generation.generator import SpeculativeGenerator

    gen = SpeculativeGenerator.from_pretrained(dtype=torch.float32, cpu_linear="auto" if cpu_linear else False,
                                               prompt_lookup=False, numerics="fast")
    ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": DEFAULT_PROMPT}],
                                            add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return gen.target, gen.drafter, ids


def measure(target, drafter, builder: str, budget: int, compile: bool | str, prompt: torch.Tensor,
            new_tokens: int, repeats: int, routed: bool = False, exact: bool = False) -> dict:
    """One case; ``exact``: exact numerics with the generator's own attention (eager, the CPU default; or
    compiled) instead of the dense-mask attention and fast numerics."""
    from ddtree.generation.generator import SpeculativeGenerator

    settings: dict = {"numerics": "exact"} if exact else {"attention": "sdpa", "numerics": "fast"}
    gen = SpeculativeGenerator(target, drafter, tree_budget=budget, builder=builder, compile=compile,
                               prompt_lookup=False, cpu_linear="auto" if routed else False, **settings)
    t0 = time.perf_counter()
    gen.generate(prompt, max_new_tokens=new_tokens, stop_token_ids=())  # warm-up: compiles the steps
    warm = time.perf_counter() - t0
    round_ms, per_token, shares, tps = [], [], [], []
    for _ in range(repeats):
        out = gen.generate(prompt, max_new_tokens=new_tokens, stop_token_ids=())
        output = (out.sequences.tolist(), out.acceptance_lengths)
        stats = out.stats
        decode = stats.total_seconds - stats.seconds.get("prefill", 0.0)
        rounds = max(stats.rounds, 1)
        round_ms.append(1e3 * decode / rounds)
        per_token.append(stats.mean_acceptance)
        tps.append(stats.tokens_per_second)
        staged = {k: v for k, v in stats.seconds.items() if k != "prefill" and v > 0}
        shares.append({k: v / max(sum(staged.values()), 1e-12) for k, v in staged.items()})
    return {"warmup_seconds": round(warm, 2), "ms_per_round": round(statistics.median(round_ms), 3),
            "tokens_per_round": round(statistics.median(per_token), 3),
            "tokens_per_second": round(statistics.median(tps), 2),
            "stage_share": {k: round(statistics.median(s.get(k, 0.0) for s in shares), 3) for k in shares[0]},
            "output": output}


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    routed = args.cpu_linear == "auto"
    if args.preset == "default-pair":
        target, drafter, prompt = default_pair(routed)
    else:
        target, drafter = build_pair(args.preset, args.layers, device, DTYPES[args.dtype])
        if routed and device.type == "cpu" and cpu_linear.available() and cpu_linear.fast_dtype(DTYPES[args.dtype]):
            cpu_linear.install(target)
            cpu_linear.install(drafter.cpu_linear_model)
        torch.manual_seed(2)
        vocab = target.get_input_embeddings().weight.shape[0]
        prompt = torch.randint(3, vocab - 2, (1, args.context), device=device)
    start = time.perf_counter()
    rows = []
    compiled = True if args.backend == "inductor" else args.backend
    modes = [("eager", False), ("compiled", compiled)]
    if device.type == "cpu":  # the eager generator as built by default (exact numerics), and exact compiled
        modes += [("default", False), ("compiled-exact", compiled)]
    for label, builder, budget in methods([int(b) for b in args.budgets.split(",")], drafter.block_size):
        for mode, compile in modes:
            row = {"method": label, "mode": mode, "budget": budget}
            if args.deadline and time.perf_counter() - start > args.deadline:
                row["skipped"] = f"past the {args.deadline} s deadline"
            elif mode == "compiled-exact" and not exact_static.may_take(target):
                row["skipped"] = f"the exact operator does not run {type(target).__name__} (compiled, it is fast)"
            else:
                try:
                    row.update(measure(target, drafter, builder, budget, compile, prompt, args.new_tokens,
                                       args.repeats, routed=routed, exact=mode in ("default", "compiled-exact")))
                except Exception as exc:  # report and go on: one failing case must not hide the others
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    row["traceback"] = traceback.format_exc(limit=8)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("traceback", "output")}), flush=True)
    eager = {r["method"]: r for r in rows if r["mode"] == "eager" and "ms_per_round" in r}
    default = {r["method"]: r for r in rows if r["mode"] == "default" and "ms_per_round" in r}
    for r in rows:
        if r["mode"] == "compiled" and "ms_per_round" in r and r["method"] in eager:
            r["speedup_over_eager"] = round(eager[r["method"]]["ms_per_round"] / r["ms_per_round"], 3)
            r["same_tokens_and_acceptance_as_eager"] = r["output"] == eager[r["method"]]["output"]
        if r["mode"].startswith("compiled") and "ms_per_round" in r and r["method"] in default:
            r["speedup_over_default"] = round(default[r["method"]]["ms_per_round"] / r["ms_per_round"], 3)
        if r["mode"] == "compiled-exact" and "ms_per_round" in r and r["method"] in default:
            r["same_tokens_and_acceptance_as_default"] = r["output"] == default[r["method"]]["output"]
    for r in rows:
        r.pop("output", None)
    return {"preset": args.preset, "layers": args.layers, "dtype": args.dtype, "device": str(device),
            "cpu_linear_layers": cpu_linear.installed(target),
            "context": args.context, "new_tokens": args.new_tokens, "backend": args.backend, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    from ddtree.apps.cli import parser

    p = parser("python -m ddtree.bench compiled", __doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", choices=[*sorted(PRESETS), *sorted(HYBRID_PRESETS), "default-pair"], default="tiny")
    p.add_argument("--layers", type=int, default=4, help="target decoder layers (at the preset's widths)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--budgets", default="4,16,64", help="best_first budgets (the chain runs at the block's depth)")
    p.add_argument("--context", type=int, default=256, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled mode")
    p.add_argument("--cpu-linear", choices=["auto", "off"], default="auto",
                   help="auto: a CPU target's linears through the few-row kernel (an operator in compiled steps), "
                        "as a generator routes them; off: torch's own")
    p.add_argument("--deadline", type=float, default=None, help="skip the cases left after this many seconds")
    p.add_argument("--out", default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    report = run(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    failed = [r for r in report["rows"] if "error" in r or r.get("same_tokens_and_acceptance_as_eager") is False
              or r.get("same_tokens_and_acceptance_as_default") is False]
    return 1 if failed else 0
