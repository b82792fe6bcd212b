"""Long-prompt memory: peak memory and time to first token of ddtree against HF ``generate``, side by side.

Each measurement runs in a fresh child process (``--child``), so one run's allocator high-water mark never
shows in another's: the child builds the models, resets its peak RSS (Linux ``/proc/self/clear_refs``),
generates, and reports its peak RSS above what it held before generating (on CUDA:
``torch.cuda.max_memory_allocated`` above the allocated bytes before). The methods take turns per prompt
length. Configurations are real-width, few-layer, random-weight targets (``qwen3-8b``: Qwen3-8B's width and
vocabulary; ``qwen36-27b``: Qwen3.6-27B's hybrid width, GDN then attention), with a one-layer DFlash drafter
of matching width.

    python -m ddtree.bench memory --config qwen3-8b --lengths 1024,4096 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

CONFIGS = {
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen36-27b": dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                       num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                       linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320),
    "narrow": dict(model_type="qwen3", hidden_size=256, intermediate_size=768, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, vocab_size=151936),  # issue 21's case, with --layers 8
    "tiny": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=151936),
}
METHODS = ("hf", "ddtree")
WARMUP_TOKENS = 32
"""Prompt tokens of the untimed warm-up generation each child runs first (``--warmup``, the default): the
first call of a method pays one-off costs (lazy initialisation, the first touch of its kernels' code pages,
which count in the RSS) that a serving process pays once, not per prompt."""


def build_target(name: str, layers: int, dtype, device):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    spec = dict(CONFIGS[name])
    model_type = spec.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        raise SystemExit(f"this transformers has no {model_type!r} model type: install transformers>=5.2")
    if model_type == "qwen3_5_text":  # GDN layers, the last one full attention (Qwen3.6's 3 : 1 ends so)
        spec["layer_types"] = ["full_attention" if i == layers - 1 else "linear_attention" for i in range(layers)]
    config = CONFIG_MAPPING[model_type](num_hidden_layers=layers, max_position_embeddings=1 << 17,
                                        tie_word_embeddings=False, **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None  # random weights: generate the full count
    return model.eval()


def build_drafter(target):
    from ddtree.drafters.dflash.config import DFlashConfig
    from ddtree.drafters.dflash.model import DFlashDraftModel

    vocab = target.config.get_text_config().vocab_size
    cfg = DFlashConfig.for_target(target.config, block_size=16, num_hidden_layers=1, mask_token_id=vocab - 1)
    torch.manual_seed(1)
    param = next(target.parameters())
    return DFlashDraftModel(cfg).to(device=param.device, dtype=param.dtype).eval()


class _Peak:
    """Peak memory above the level at ``start``: RSS on a CPU (the kernel's high-water mark, reset), the
    allocator's on CUDA."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self.base = _status_kb("VmRSS") * 1024

    def bytes(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _status_kb("VmHWM") * 1024 - self.base


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: the CPU measurement needs Linux")


class _FirstToken:
    """A transformers streamer that notes when the first generated token arrives (its first put is the prompt)."""

    def __init__(self):
        self.puts, self.at = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2 and self.at is None:
            self.at = time.perf_counter()

    def end(self):
        pass


def _time_context_appends(drafter, device) -> list[float]:
    """Seconds the drafter spends taking in the prompt's features (its projection and K/V of every prompt
    token), HF's prefill has no such work: a one-item list the drafter's contexts add to."""
    seconds = [0.0]
    make = drafter.new_context

    def new_context(batch_size=1):
        ctx = make(batch_size)
        append = ctx.append

        def timed(*a, **k):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = append(*a, **k)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds[0] += time.perf_counter() - t0
            return out

        ctx.append = timed
        return ctx

    drafter.new_context = new_context
    return seconds


def child(args) -> dict:
    """One measurement in this (fresh) process."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    target = build_target(args.config, args.layers, dtype, device)
    vocab = target.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab - 1, (1, args.length), generator=torch.Generator().manual_seed(2)).to(device)
    extra = {}
    warm = prompt[:, : min(args.length, WARMUP_TOKENS)]
    if args.method == "ddtree":
        from ddtree import SpeculativeGenerator
        from ddtree.blocks import speculative_round

        drafter = build_drafter(target)
        gen = SpeculativeGenerator(target, drafter, tree_budget=args.budget, prefill_chunk=args.chunk or None,
                                   prompt_lookup=False)
        if args.warmup:
            gen.generate(warm, max_new_tokens=args.new, stop_token_ids=())
        context_seconds = _time_context_appends(gen.drafter, device)
        peak = _Peak(device)
        peak.start()
        t0 = time.perf_counter()
        state = gen.start(prompt, max_new_tokens=args.new, stop_token_ids=())
        speculative_round(state)
        if device.type == "cuda":
            torch.cuda.synchronize()
        ttft = time.perf_counter() - t0
        extra["drafter_context_s"] = context_seconds[0]  # the chunks before the last, taken in before the token
        state.catch_up_draft()  # the last chunk's intake, which the first tree round does first
        if device.type == "cuda":
            torch.cuda.synchronize()
        extra["drafter_after_first_s"] = context_seconds[0] - extra["drafter_context_s"]
        draft = state.on_device.draft
        draft_bytes = draft.nbytes() if hasattr(draft, "nbytes") else 0
        while not state.done:
            speculative_round(state)
        extra["drafter_context_bytes"] = draft_bytes
        tokens = state.new_tokens[0]
    else:
        if args.warmup:
            with torch.inference_mode():
                target.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=args.new,
                                do_sample=False, pad_token_id=0)
        peak = _Peak(device)
        streamer = _FirstToken()
        peak.start()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new,
                                  do_sample=False, pad_token_id=0, streamer=streamer)
        ttft = streamer.at - t0
        tokens = out[0, args.length:].tolist()
    return dict(method=args.method, length=args.length, peak_bytes=peak.bytes(), ttft_s=ttft,
                bytes_per_token=peak.bytes() / args.length, tokens=tokens, **extra)


def run_child(args, method: str, length: int) -> dict:
    cmd = [sys.executable, "-m", "ddtree.bench.memory", "--child", "--method", method, "--length", str(length),
           "--config", args.config, "--layers", str(args.layers), "--dtype", args.dtype, "--device", args.device,
           "--threads", str(args.threads), "--new", str(args.new), "--budget", str(args.budget),
           "--chunk", str(args.chunk)] + ([] if args.warmup else ["--no-warmup"])
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {method} measurement at {length} tokens failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict]) -> str:
    lines = ["| prompt | HF peak | ddtree peak | drafter context | ratio (peak / (HF + context)) | HF TTFT | "
             "ddtree TTFT | TTFT ratio | of which drafter context | ratio without it | drafter context after it | "
             "ddtree bytes/token | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hf, dd = r["hf"], r["ddtree"]
        ctx = dd.get("drafter_context_bytes", 0)
        lines.append(
            f"| {r['length']} | {hf['peak_bytes'] / 2**20:.0f} MB | {dd['peak_bytes'] / 2**20:.0f} MB | "
            f"{ctx / 2**20:.0f} MB | {dd['peak_bytes'] / max(1, hf['peak_bytes'] + ctx):.2f} | "
            f"{hf['ttft_s']:.2f} s | {dd['ttft_s']:.2f} s | {dd['ttft_s'] / hf['ttft_s']:.2f} | "
            f"{dd.get('drafter_context_s', 0.0):.2f} s | "
            f"{(dd['ttft_s'] - dd.get('drafter_context_s', 0.0)) / hf['ttft_s']:.2f} | "
            f"{dd.get('drafter_after_first_s', 0.0):.2f} s | "
            f"{dd['bytes_per_token']:.0f} | {hf['tokens'] == dd['tokens']} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddtree.bench memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="qwen3-8b")
    p.add_argument("--lengths", default="1024,4096,16384", help="prompt lengths, comma-separated")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--new", type=int, default=4, help="tokens to generate per measurement")
    p.add_argument("--budget", type=int, default=16, help="ddtree's tree budget")
    p.add_argument("--chunk", type=int, default=4096, help="ddtree's prefill_chunk (0: one forward)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="measure each method's first call (no untimed warm-up generation before it)")
    p.add_argument("--repeats", type=int, default=1, help="measurements per method and length (medians)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    return p


def _median(values):
    values = sorted(values)
    return values[len(values) // 2]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    rows = []
    for length in [int(x) for x in args.lengths.split(",") if x]:
        runs = {m: [] for m in METHODS}
        for _ in range(args.repeats):
            for method in METHODS:  # interleaved: a burst of load elsewhere hits both
                runs[method].append(run_child(args, method, length))
        row = {"length": length}
        for method, rs in runs.items():
            row[method] = dict(rs[0], peak_bytes=_median([r["peak_bytes"] for r in rs]),
                               ttft_s=_median([r["ttft_s"] for r in rs]))
            if method == "ddtree":
                for key in ("drafter_context_s", "drafter_after_first_s"):
                    row[method][key] = _median([r[key] for r in rs])
        rows.append(row)
        print(format_table(rows[-1:]).split("\n", 2)[-1], flush=True)
    print(f"config {args.config}, {args.layers} layers, {args.dtype}, {args.device}, threads {args.threads}, "
          f"prefill_chunk {args.chunk}, warm-up {args.warmup}, torch {torch.__version__}, pid {os.getpid()}")
    print(format_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k not in ("child", "method", "length")},
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
