"""``python -m ddtree.bench.full_size``: a round's cost at full model size, and the speed it would give.

Builds whole random-weight targets at published widths (``--scale full``: Qwen3-8B, then the Qwen3.6-27B GDN
hybrid; :data:`SHAPES`), each with a random DFlash drafter of its published drafter's configuration, and times
per batch size (1, 8, 32), method (plain, the chain, best_first at each budget, ``auto``) and mode (``eager``:
the dynamic round; ``compiled``: ``compile=True``, CUDA graphs on CUDA) the median milliseconds per round,
beside the baseline an engineer would compile instead: transformers' own forward over its static cache under
``torch.compile`` (``hf_static``, greedy, one host read a step).
Random weights accept about one token a round, so each row pairs its round time with the tokens per round the
default pair commits with the same builder and budget (:data:`DEFAULT_PAIR_ACCEPTANCE`, each figure naming the
``docs/benchmarks.md`` section it comes from, or "not measured") and the tokens per second that would give,
labelled as projected. Every row's tokens are compared with plain decoding's at the same batch size.

The run keeps to ``--time-budget`` seconds (one device call): the first model's eager cases, then its compiled
ones, then the next model's, each case started only when its expected seconds (a compile's first call, once
one has been measured) fit in what is left, less what the later models keep (the eager cases and the compiled
chain and smallest tree at the first batch may spend that too); what does not fit is reported as skipped with
the reason. ``--scale tiny`` runs the same path at tiny widths (float32, the CPU, dynamo's
``eager`` backend for the compiled mode) in seconds. Writes ``full_size.json`` after every case (a run cut
short keeps what it measured) and ``full_size.md`` (the table) at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FULL_ATTENTION, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


@dataclass(frozen=True)
class DrafterShape:
    """A DFlash drafter's configuration: layers, block, the target layers it reads, its mask id and windows;
    its widths are the target's."""

    layers: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None


@dataclass(frozen=True)
class ModelShape:
    """A target's family, widths, depth and vocabulary, its drafter, and where each figure comes from."""

    name: str
    family: str  # "qwen3" (Qwen3ForCausalLM) or "qwen3_5" (the GDN hybrid, qwen3_5_text)
    widths: dict
    layers: int
    vocab: int
    drafter: DrafterShape
    sources: tuple[str, ...] = ()
    prior_case_s: float = 0.0  # the seconds an eager case is expected to take before one is measured
    prior_compile_s: float = 0.0  # the seconds a compiled case's first call is expected to take, likewise
    keep_s: float = 0.0  # the seconds the models before this one leave it (its build and first cases)


QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128)
QWEN36_27B = dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4,
                  head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                  linear_value_head_dim=128)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY_GDN = dict(TINY, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16)
TINY_VOCAB = 32
"""Small enough that a 16-node tree's first depth covers half of it: random drafts are accepted now and then,
so the tiny run's acceptance is above zero."""

SHAPES: dict[str, dict[str, ModelShape]] = {
    "full": {
        "qwen3-8b": ModelShape(
            "qwen3-8b", "qwen3", QWEN3_8B, 36, 151936,
            DrafterShape(5, 16, (1, 9, 17, 25, 33), 151669),
            ("target: Qwen3-8B's published config (36 layers, hidden 4096, intermediate 12288, 32 heads, 8 KV "
             "heads, head_dim 128, vocab 151936, rope_theta 1e6, untied lm_head)",
             "drafter: z-lab Qwen3-8B-DFlash-b16 (/work/shared/notes/anchors.md 'Published configs'): block 16, "
             "target layers [1, 9, 17, 25, 33], 5 full-attention layers, mask 151669",
             "assumed: the drafter's widths (hidden, heads, head_dim, intermediate) are the target's; the notes "
             "do not give them"),
            prior_case_s=15.0, prior_compile_s=150.0),
        "qwen36-27b-hybrid": ModelShape(
            "qwen36-27b-hybrid", "qwen3_5", QWEN36_27B, 64, 248320,
            DrafterShape(5, 16, (1, 16, 31, 46, 61), 248070, (SLIDING,) * 4 + (FULL_ATTENTION,), 2048),
            ("target widths: Qwen3.6-27B's layer stack as in ddtree.bench.linear's 'qwen36-27b' preset (hidden "
             "5120, intermediate 17408, 24 heads, 4 KV heads, head_dim 256; GDN 16 key / 48 value heads of 128)",
             "drafter: z-lab/Qwen3.6-27B-DFlash (/work/shared/notes/anchors.md 'Published configs'): block 16, "
             "target layers [1, 16, 31, 46, 61], 4 sliding + 1 full, window 2048, mask 248070",
             "assumed: 64 target layers (the drafter's last target layer 61 is the published formula's "
             "num_target_layers - 3), every 4th full attention and the others GDN, vocab 248320 (above the mask "
             "id 248070), the drafter's widths the target's, the full layer last; not in the notes"),
            prior_case_s=30.0, prior_compile_s=240.0, keep_s=150.0),
    },
    "tiny": {
        "qwen3-8b": ModelShape("qwen3-8b", "qwen3", TINY, 4, TINY_VOCAB,
                               DrafterShape(2, 16, (1, 2), TINY_VOCAB - 1),
                               ("tiny widths standing in for Qwen3-8B: the run's path, not its figures",)),
        "qwen36-27b-hybrid": ModelShape("qwen36-27b-hybrid", "qwen3_5", TINY_GDN, 4, TINY_VOCAB,
                                        DrafterShape(2, 16, (1, 2), TINY_VOCAB - 1, (SLIDING, FULL_ATTENTION), 8),
                                        ("tiny widths standing in for the Qwen3.6-27B hybrid",)),
    },
}


@dataclass(frozen=True)
class Figure:
    """Tokens a round (accepted drafts plus the bonus) the default pair committed, and where that is written."""

    tokens_per_round: float | None  # None: not measured
    source: str


FIXED_BUDGETS = ("docs/benchmarks.md, 'Fixed budgets and auto' (the default pair, code prompts, batch 1, commit "
                 "2d1ea7c; 'Batches': the fixed-budget trees accept the same at batch 4 and 8)")
DEFAULT_PAIR_ACCEPTANCE: dict[tuple[str, int | None], Figure] = {
    ("plain", 0): Figure(1.0, "exact: plain decoding commits one token a round"),
    ("chain", None): Figure(1.67, FIXED_BUDGETS + "; the default pair's chain is 5 deep (block 6), this drafter's "
                                                  "15"),
    ("best_first", 2): Figure(1.60, FIXED_BUDGETS),
    ("best_first", 4): Figure(1.78, FIXED_BUDGETS),
    ("best_first", 8): Figure(1.97, FIXED_BUDGETS),
    ("best_first", 16): Figure(2.17, FIXED_BUDGETS),
}
"""The acceptance a trained pair reaches per builder and budget: the default pair's, measured on the dev VM."""

NOT_MEASURED = ("not measured: docs/benchmarks.md, 'Fixed budgets and auto', measured no budget above 16 with the "
                "current drafter")
AUTO = ("not measured: auto picks its trees from the acceptance it measures in the run (about one token a round "
        "under random weights, so it decodes plainly here); the default pair's auto tau was chosen by a CPU's "
        "costs. Its ms/round against plain's is the never-slower check")


def default_pair_figure(builder: str, budget: int | str) -> Figure:
    """The default pair's tokens per round for ``builder`` at ``budget``, or why there is none."""
    if budget == "auto":
        return Figure(None, AUTO)
    if budget == 0:
        return DEFAULT_PAIR_ACCEPTANCE[("plain", 0)]
    key: tuple[str, int | None] = (builder, None if builder == "chain" else int(budget))
    return DEFAULT_PAIR_ACCEPTANCE.get(key, Figure(None, NOT_MEASURED))


@dataclass
class Settings:
    """What one run measures and how long it may take; every size comes from ``shapes``."""

    shapes: list[ModelShape]
    device: torch.device
    dtype: torch.dtype
    batches: tuple[int, ...] = (1, 8, 32)
    compiled_batches: tuple[int, ...] | None = None  # the batch sizes the compiled mode runs (None: every one)
    budgets: tuple[int, ...] = (16, 32, 64)
    context: int = 512
    new_tokens: int = 32
    repeats: int = 2
    backend: str = "inductor"  # the compiled mode's torch.compile backend; inductor is compile=True
    time_budget: float = 420.0
    lm_head_scale: float = 1.0  # sharpens a random target's logits (tiny: fewer fp32 near-ties)
    scale: str = "full"  # what the widths are, for the report


def settings_for(scale: str, **overrides: Any) -> Settings:
    """The run's settings at ``scale`` (``full``: CUDA, bf16, the published widths; ``tiny``: the CPU, fp32,
    tiny widths, dynamo's ``eager`` backend), each one overridable by keyword."""
    if scale not in SHAPES:
        raise ValueError(f"unknown scale {scale!r}; pick one of {', '.join(SHAPES)}")
    if scale == "full":
        base = Settings(list(SHAPES["full"].values()), torch.device("cuda"), torch.bfloat16)
    else:
        base = Settings(list(SHAPES["tiny"].values()), torch.device("cpu"), torch.float32, context=12,
                        new_tokens=8, repeats=1, backend="eager", time_budget=600.0, lm_head_scale=4.0)
    return dataclasses.replace(base, scale=scale, **overrides)


def methods(budgets: tuple[int, ...], block_size: int) -> list[tuple[str, str, int | str]]:
    """(label, builder, budget) in the order they run: plain, the chain, best_first at each budget, ``auto``."""
    return [("plain", "best_first", 0), ("chain", "chain", block_size - 1),
            *[(f"best_first@{b}", "best_first", b) for b in budgets], ("auto", "best_first", "auto")]


HF_STATIC = ("hf_static", "hf", 0)
"""The compiled mode's baseline: transformers' forward with its static cache under ``torch.compile``."""


def compile_refusal(budget: int | str) -> str | None:
    """Why ``compile=True`` refuses ``budget`` (the generator's own check), or None where it takes it."""
    from ddtree.generation.options import GeneratorOptions

    try:
        GeneratorOptions(compile=True, tree_budget=budget)
    except ValueError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------- models


def build_target(shape: ModelShape, device: torch.device, dtype: torch.dtype, lm_head_scale: float = 1.0):
    """A random-weight target of ``shape``, built on ``device`` in ``dtype``."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    def make_config(model_type: str, **kwargs: Any) -> Any:
        config_class: Any = CONFIG_MAPPING[model_type]
        return config_class(**kwargs)

    common = dict(vocab_size=shape.vocab, num_hidden_layers=shape.layers, max_position_embeddings=40960,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, **shape.widths)
    if shape.family == "qwen3":
        config = make_config("qwen3", rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                                         **common)
    elif shape.family == "qwen3_5":
        if "qwen3_5_text" not in CONFIG_MAPPING:
            import transformers

            raise RuntimeError(f"transformers {transformers.__version__} has no qwen3_5_text (the GDN hybrid): "
                               "install a newer transformers for the hybrid's widths")
        types = [FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR for i in range(shape.layers)]
        config = make_config("qwen3_5_text", layer_types=types, **common)
    else:
        raise ValueError(f"unknown family {shape.family!r}: 'qwen3' or 'qwen3_5'")
    torch.manual_seed(0)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lm_head_scale != 1.0:
        with torch.no_grad():
            target.lm_head.weight.mul_(lm_head_scale)
    target.generation_config.eos_token_id = None  # fixed-length runs
    return target.eval()


def build_drafter(shape: ModelShape, target: Any, dtype: torch.dtype):
    """A random DFlash drafter of ``shape.drafter``'s configuration for ``target``, on the target's device."""
    from ddtree.drafters.dflash.drafter import DFlashDrafter
    from ddtree.drafters.dflash.model import DFlashDraftModel

    torch.manual_seed(1)
    with torch.device(target.get_input_embeddings().weight.device):
        model = DFlashDraftModel(drafter_config(shape, target.config)).to(dtype).eval()
    return DFlashDrafter(model, target)


def drafter_config(shape: ModelShape, target_config: Any):
    """``shape.drafter`` as a :class:`DFlashConfig` for a target of ``target_config`` (its widths)."""
    from ddtree.drafters.dflash.config import DFlashConfig

    d = shape.drafter
    return DFlashConfig.for_target(target_config, num_hidden_layers=d.layers, block_size=d.block_size,
                                   mask_token_id=d.mask_token_id, target_layer_ids=list(d.target_layer_ids),
                                   layer_types=list(d.layer_types) if d.layer_types else None,
                                   sliding_window=d.sliding_window)


def random_prompts(shape: ModelShape, batch: int, context: int) -> torch.Tensor:
    """``[batch, context]`` random ids (seeded: the same for every run of the same sizes)."""
    return torch.randint(2, shape.vocab - 2, (batch, context), generator=torch.Generator().manual_seed(2))


# --------------------------------------------------------------------- the run


class Budget:
    """The seconds left of the run's time budget."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.perf_counter()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


WARM_UPS = 4
"""Warm-up generations at most before a compiled case is timed."""


def measure(target: Any, drafter: Any, builder: str, budget: int | str, compile: bool | str, prompts: torch.Tensor,
            new_tokens: int, repeats: int) -> dict:
    """Warm-up generations (the first compiles and ``auto`` learns its costs; under ``compile`` more follow, up
    to :data:`WARM_UPS`, while one still compiles a graph: ``auto`` meets its ladder's budgets as it learns),
    then ``repeats`` timed ones: the median ms per decode round and tokens per round, each row's tokens, the
    budgets the rounds used, and the graphs compiled while timed (0 unless the warm-ups ran out)."""
    from ddtree.generation.generator import SpeculativeGenerator

    gen = SpeculativeGenerator(target, drafter, tree_budget=budget, builder=builder, attention="sdpa",
                               compile=compile, prompt_lookup=False)
    t0 = time.perf_counter()
    gen.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=())
    warm = time.perf_counter() - t0
    for _ in range(WARM_UPS - 1):
        graphs = gen.compile_log.graphs
        if compile is False or graphs == 0:
            break
        gen.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=())
        if gen.compile_log.graphs == graphs:
            break
    graphs = gen.compile_log.graphs
    round_ms, per_round = [], []
    for _ in range(repeats):
        out = gen.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=())
        stats = out.stats
        round_ms.append(1e3 * (stats.total_seconds - stats.seconds.get("prefill", 0.0)) / max(stats.rounds, 1))
        per_round.append(stats.mean_acceptance)
    return {"ms_per_round": round(statistics.median(round_ms), 3), "rounds": stats.rounds,
            "measured_tokens_per_round": round(statistics.median(per_round), 3),
            "first_call_seconds": round(warm, 2), "graphs_compiled_while_timed": gen.compile_log.graphs - graphs,
            "budgets_used": {str(k): v for k, v in sorted(Counter(stats.budgets).items())},
            "tokens": [list(map(int, t)) for t in out.row_tokens]}



def measure_hf_static(target: Any, prompts: torch.Tensor, new_tokens: int, repeats: int,
                      compile: bool | str) -> dict:
    """Greedy decoding through transformers' forward over its ``StaticCache``, compiled as ``compile`` says
    (``True``: inductor, CUDA graphs on CUDA), the prefill eager: one warm-up (it compiles), then ``repeats``
    timed runs; the median ms per decode step and each row's tokens. Stock linears (ddtree's CPU routing
    suspended): the baseline is transformers' own."""
    from transformers import StaticCache

    from ddtree.targets import cpu_linear
    from ddtree.targets.cache import cache_kwargs, check_cache_length

    cuda = prompts.device.type == "cuda"
    options: dict[str, Any] = ({"mode": "reduce-overhead" if cuda else None} if compile is True
                               else {"backend": compile})
    step = torch.compile(target.forward, fullgraph=True, dynamic=False, **options)
    batch, n = prompts.shape

    def decode() -> tuple[list[list[int]], float]:
        cache = StaticCache(config=target.config, max_cache_len=n + new_tokens)
        kept = cache_kwargs(target, cache)
        out = target(input_ids=prompts, cache_position=torch.arange(n, device=prompts.device), use_cache=True,
                     **kept)
        token = out.logits[:, -1].argmax(-1)
        columns = [token.tolist()]
        start = time.perf_counter()
        for i in range(new_tokens - 1):
            if cuda:
                torch.compiler.cudagraph_mark_step_begin()
            out = step(input_ids=token[:, None], cache_position=torch.tensor([n + i], device=prompts.device),
                       use_cache=True, **kept)
            token = out.logits[:, -1].argmax(-1)
            columns.append(token.tolist())  # a step's one host read, as generate's stopping check makes
        seconds = time.perf_counter() - start
        check_cache_length(cache, n + new_tokens - 1, "hf_static decoding")
        return [list(row) for row in zip(*columns)], seconds

    with torch.inference_mode(), cpu_linear.suspended(target):
        t0 = time.perf_counter()
        decode()
        warm = time.perf_counter() - t0
        step_ms = []
        for _ in range(repeats):
            tokens, seconds = decode()
            step_ms.append(1e3 * seconds / max(new_tokens - 1, 1))
    return {"ms_per_round": round(statistics.median(step_ms), 3), "rounds": new_tokens - 1,
            "measured_tokens_per_round": 1.0, "first_call_seconds": round(warm, 2), "tokens": tokens}


def plan(settings: Settings, shape: ModelShape) -> list[dict]:
    """The model's cases in the order they run: first the comparison that matters most, at the first compiled
    batch: eager plain decoding and the smallest tree (the compiled rows' references), then transformers'
    compiled static-cache decoding (:data:`HF_STATIC`), ddtree's compiled plain decoding and smallest tree;
    then every other eager case by batch; then the compiled ones, the baseline, plain decoding and the smallest
    tree at each batch first, then the chain, the wider trees and ``auto``. ``core``: the eager cases and the
    compiled headline, which may spend the seconds the later models keep."""
    methods_ = methods(settings.budgets, shape.drafter.block_size)
    compiled = settings.batches if settings.compiled_batches is None else settings.compiled_batches
    first = {HF_STATIC[0], methods_[0][0], methods_[2][0]}  # the baseline, plain decoding, the smallest tree
    headline = compiled[0] if compiled else None
    cases = [dict(batch=b, method=m, builder=k, budget=n, mode=mode,
                  core=mode == "eager" or (m in first and b == headline))
             for mode, batches in (("eager", settings.batches), ("compiled", compiled))
             for b in batches for m, k, n in ([HF_STATIC] if mode == "compiled" else []) + methods_]

    def phase(case: dict) -> int:
        lead = case["method"] in first and case["batch"] == headline
        if case["mode"] == "eager":
            return 0 if lead else 2
        if lead:
            return 1
        if case["method"] in first:
            return 3
        return {methods_[1][0]: 4, "auto": 6}.get(case["method"], 5)  # the chain, then wider trees, then auto

    return sorted(cases, key=phase)


def run_model(settings: Settings, shape: ModelShape, budget: Budget, keep: float, emit: Callable[[dict], None]):
    """Every case of ``shape`` that fits in ``budget`` less ``keep`` (the later models' seconds)."""
    compiled_mode: bool | str = True if settings.backend == "inductor" else settings.backend
    expected = {"eager": shape.prior_case_s, "compiled": shape.prior_compile_s}
    measured: dict[str, list[float]] = {"eager": [], "compiled": []}
    base = dict(model=shape.name, layers=shape.layers, dtype=str(settings.dtype).removeprefix("torch."))
    t0 = time.perf_counter()
    try:
        target = build_target(shape, settings.device, settings.dtype, settings.lm_head_scale)
        drafter = build_drafter(shape, target, settings.dtype)
    except Exception as exc:  # report it; the next model still runs
        emit({**base, "error": f"building the pair: {type(exc).__name__}: {exc}",
              "traceback": traceback.format_exc(limit=8)})
        return
    built = round(time.perf_counter() - t0, 2)
    prompts = {b: random_prompts(shape, b, settings.context).to(settings.device)
               for b in {*settings.batches, *(settings.compiled_batches or ())}}
    plain: dict[int, dict] = {}
    eager: dict[tuple[int, str], dict] = {}
    baseline: dict[int, dict] = {}
    for case in plan(settings, shape):
        row = {**base, **case, "build_seconds": built}
        mode, batch = case["mode"], case["batch"]
        refusal = compile_refusal(case["budget"]) if mode == "compiled" else None
        need = max(measured[mode], default=expected[mode])
        kept = 0.0 if row.pop("core") else keep
        if refusal:
            row["skipped"] = f"compile=True refuses it: {refusal}"
        elif budget.left() - kept < need:
            row["skipped"] = (f"time budget: {budget.left():.0f} s left, {kept:.0f} kept for the later models, "
                              f"and a {mode} case takes about {need:.0f} s")
        else:
            if mode == "compiled":
                torch._dynamo.reset()  # each case is a new generator: its graphs replace the last case's
            started = time.perf_counter()
            try:
                if case["method"] == HF_STATIC[0]:
                    row.update(measure_hf_static(target, prompts[batch], settings.new_tokens, settings.repeats,
                                                 compiled_mode))
                else:
                    row.update(measure(target, drafter, case["builder"], case["budget"],
                                       compiled_mode if mode == "compiled" else False, prompts[batch],
                                       settings.new_tokens, settings.repeats))
            except Exception as exc:  # one failing case must not hide the others
                row["error"] = f"{type(exc).__name__}: {exc}"
                row["traceback"] = traceback.format_exc(limit=8)
                if settings.device.type == "cuda":
                    torch.cuda.empty_cache()
            measured[mode].append(time.perf_counter() - started)
        finish_row(row, plain, eager, settings.dtype, baseline)
        emit(row)
    del target, drafter
    gc.collect()
    torch._dynamo.reset()
    if settings.device.type == "cuda":
        torch.cuda.empty_cache()


def finish_row(row: dict, plain: dict[int, dict], eager: dict[tuple[int, str], dict], dtype: torch.dtype,
               baseline: dict[int, dict] | None = None) -> None:
    """The row's comparisons: its tokens against plain decoding's (and a compiled row's against its eager
    twin's), its projection at the default pair's acceptance, and against transformers' compiled static-cache
    decoding at the same batch (``baseline``, filled here as its rows come)."""
    batch = row["batch"]
    figure = default_pair_figure(row["builder"], row["budget"])
    row["default_pair_tokens_per_round"] = figure.tokens_per_round
    row["default_pair_source"] = figure.source
    if "ms_per_round" not in row:
        return
    if row["budget"] == 0 and row["mode"] == "eager":
        plain[batch] = row
    if row["mode"] == "eager":
        eager[(batch, row["method"])] = row
    baseline = {} if baseline is None else baseline
    if row["method"] == HF_STATIC[0]:
        baseline[batch] = row
    reference = plain.get(batch)
    if reference is not None:
        row["plain_ms_per_round"] = reference["ms_per_round"]
        row["same_tokens_as_plain"] = row["tokens"] == reference["tokens"]
    twin = eager.get((batch, row["method"]))
    if row["mode"] == "compiled" and twin is not None:
        row["same_tokens_as_eager"] = row["tokens"] == twin["tokens"]
        row["compiled_speedup_over_eager"] = round(twin["ms_per_round"] / row["ms_per_round"], 3)
    if figure.tokens_per_round is not None:
        row["projected_tokens_per_second"] = round(batch * figure.tokens_per_round * 1e3 / row["ms_per_round"], 1)
        if reference is not None:
            row["projected_speedup_over_plain"] = round(
                figure.tokens_per_round * reference["ms_per_round"] / row["ms_per_round"], 3)
        hf = baseline.get(batch)
        if hf is not None and row["mode"] == "compiled":
            row["hf_static_ms_per_round"] = hf["ms_per_round"]
            row["projected_speedup_over_hf_static"] = round(
                figure.tokens_per_round * hf["ms_per_round"] / row["ms_per_round"], 3)
    # fp32 must be exact; bf16's argmax near-ties can differ between a tree verify and a one-token step
    row["lossless_required"] = dtype == torch.float32


def notes() -> list[str]:
    """What the table's columns mean, and what it cannot show."""
    plain = compile_refusal(0)
    return [
        "ms/round: the median decode round (prefill excluded) of random-weight models, which accept about one "
        "token a round: the 'measured tok/round' column says so",
        "projected tok/s = batch x the default pair's tokens per round for the same builder and budget / "
        "ms per round; projected vs plain = that tokens per round x plain decoding's ms/round (eager, same "
        "batch) / the row's ms/round",
        "vs plain: against ddtree's eager plain decoding at the same batch"
        + (f" (compile=True refuses budget 0: {plain})" if plain else ""),
        "hf_static: transformers' forward over its StaticCache under torch.compile (CUDA graphs on CUDA), greedy, "
        "the prefill eager; a compiled row's 'vs HF static' = its tokens per round (the default pair's) x "
        "hf_static's ms per step / the row's ms per round (for compiled plain decoding: the step against the "
        "step)",
        "same tokens as plain: the row's greedy tokens against plain decoding's at the same batch; required in "
        "float32, reported only in bf16/fp16 (argmax near-ties can differ between a tree verify and a one-token "
        "step)",
    ]


def environment(device: torch.device) -> dict:
    import transformers

    env: dict[str, str | None] = {"torch": torch.__version__, "transformers": transformers.__version__,
                                  "device": str(device)}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return env


def run(settings: Settings, out: Path | None = None) -> dict:
    """Measure every model of ``settings`` inside its time budget; writes ``out/full_size.json`` as it goes."""
    budget = Budget(settings.time_budget)
    report: dict = {
        "what": f"ms per round of random-weight targets at {settings.scale} widths; tokens per round and tokens/s "
                "at the default pair's measured acceptance are PROJECTED, not measured",
        "scale": settings.scale,
        "environment": environment(settings.device),
        "settings": {"device": str(settings.device), "dtype": str(settings.dtype).removeprefix("torch."),
                     "batches": list(settings.batches), "budgets": list(settings.budgets),
                     "compiled_batches": list(settings.batches if settings.compiled_batches is None
                                              else settings.compiled_batches),
                     "context": settings.context, "new_tokens": settings.new_tokens, "repeats": settings.repeats,
                     "backend": settings.backend, "time_budget": settings.time_budget,
                     "lm_head_scale": settings.lm_head_scale},
        "models": [{"name": s.name, "family": s.family, "layers": s.layers, "vocab": s.vocab, "widths": s.widths,
                    "drafter": dataclasses.asdict(s.drafter), "sources": list(s.sources)} for s in settings.shapes],
        "notes": notes(),
        "rows": [],
    }

    def emit(row: dict) -> None:
        report["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("tokens", "traceback", "default_pair_source")}),
              flush=True)
        if out is not None:
            write(report, out)

    for i, shape in enumerate(settings.shapes):
        keep = sum(s.keep_s for s in settings.shapes[i + 1:])
        need = shape.prior_case_s + shape.keep_s * 0.5  # its build and first case (its eager cases are core)
        if budget.left() < need:
            emit({"model": shape.name, "skipped": f"time budget: {budget.left():.0f} s left, and building "
                                                  f"the pair and a first case take about {need:.0f} s"})
            continue
        run_model(settings, shape, budget, keep, emit)
    if settings.device.type == "cuda":
        report["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(settings.device) / 2**30, 2)
    report["seconds"] = round(settings.time_budget - budget.left(), 1)
    report["failures"] = failures(report)
    if out is not None:
        write(report, out)
        (out / "full_size.md").write_text(table(report) + "\n")
    return report


def failures(report: dict) -> list[dict]:
    """The rows that failed: an error, or tokens other than plain decoding's where the dtype must be exact."""
    return [{k: r.get(k) for k in ("model", "batch", "method", "mode", "error")} for r in report["rows"]
            if "error" in r or (r.get("lossless_required") and r.get("same_tokens_as_plain") is False)]


def write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "full_size.json").write_text(json.dumps(report, indent=1) + "\n")


COLUMNS = ("model", "batch", "method", "mode", "ms/round", "plain ms/round", "measured tok/round",
           "default-pair tok/round", "projected tok/s", "projected vs plain", "projected vs HF static",
           "same tokens as plain", "first call s")


def table(report: dict) -> str:
    """The rows as a markdown table; skipped and failed cases say so in the ms/round column."""

    def cell(value: Any) -> str:
        return "-" if value is None else str(value)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in report["rows"]:
        if "method" not in r:
            lines.append(f"| {r['model']} | | | | {r.get('skipped') or r.get('error')} |" + " |" * (len(COLUMNS) - 5))
            continue
        timing = r.get("ms_per_round") or ("skipped" if "skipped" in r else "error")
        figure = r["default_pair_tokens_per_round"]
        values = (r["model"], r["batch"], r["method"], r["mode"], timing, r.get("plain_ms_per_round"),
                  r.get("measured_tokens_per_round"), "not measured" if figure is None else figure,
                  r.get("projected_tokens_per_second"), r.get("projected_speedup_over_plain"),
                  r.get("projected_speedup_over_hf_static"), r.get("same_tokens_as_plain"),
                  r.get("first_call_seconds"))
        lines.append("| " + " | ".join(cell(v) for v in values) + " |")
    notes = sorted({r["default_pair_source"] for r in report["rows"] if "default_pair_source" in r})
    skips = sorted({f"{r.get('mode', '')}: {r['skipped']}" for r in report["rows"] if "skipped" in r})
    return "\n".join([report["what"] + ".", "", *[f"- {n}" for n in report["notes"]], "", *lines, "",
                      "Default-pair figures:",
                      *[f"- {n}" for n in notes], "", "Skipped:", *[f"- {s}" for s in skips]])


def main(argv: list[str] | None = None) -> int:
    from ddtree.apps.cli import parser

    p = parser("python -m ddtree.bench.full_size", __doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=sorted(SHAPES), default="full" if torch.cuda.is_available() else "tiny",
                   help="full: the published widths, CUDA, bf16; tiny: tiny widths, the CPU, fp32")
    p.add_argument("--models", default=None, help="comma-separated, in order (default: every model of the scale)")
    p.add_argument("--layers", type=int, default=None, help="target layers instead of the model's (a shorter run)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--batches", default=None, help="batch sizes, e.g. 1,8,32")
    p.add_argument("--compiled-batches", default=None, help="batch sizes of the compiled mode (default: --batches)")
    p.add_argument("--budgets", default=None, help="best_first budgets, e.g. 16,32,64")
    p.add_argument("--context", type=int, default=None, help="prompt tokens per row")
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--backend", default=None, help="the compiled mode's torch.compile backend (inductor: "
                                                   "compile=True)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds for the whole run")
    p.add_argument("--out", default=None, help="directory for full_size.json and full_size.md")
    args = p.parse_args(argv)
    settings = settings_from_args(args)
    report = run(settings, Path(args.out) if args.out else None)
    print(table(report), flush=True)
    return 1 if report["failures"] else 0


def with_layers(shape: ModelShape, layers: int) -> ModelShape:
    """``shape`` with ``layers`` target layers, its drafter reading the published formula's layers for them."""
    from ddtree.drafters.features import build_target_layer_ids

    ids = tuple(build_target_layer_ids(layers, shape.drafter.layers))
    return dataclasses.replace(shape, layers=layers, drafter=dataclasses.replace(shape.drafter, target_layer_ids=ids),
                               sources=(*shape.sources, f"shortened: {layers} target layers, drafter reads {ids}"))


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    shapes = SHAPES[args.scale]
    if args.models:
        unknown = [m for m in args.models.split(",") if m not in shapes]
        if unknown:
            raise SystemExit(f"unknown model(s) {', '.join(unknown)}: pick from {', '.join(shapes)}")
        overrides["shapes"] = [shapes[m] for m in args.models.split(",")]
    if args.layers:
        overrides["shapes"] = [with_layers(s, args.layers) for s in overrides.get("shapes", list(shapes.values()))]
    for name in ("context", "new_tokens", "repeats", "backend", "time_budget"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.device:
        overrides["device"] = torch.device(args.device)
    if args.dtype:
        overrides["dtype"] = DTYPES[args.dtype]
    for name in ("batches", "compiled_batches", "budgets"):
        if getattr(args, name) is not None:
            overrides[name] = tuple(int(x) for x in getattr(args, name).split(",") if x.strip())
    return settings_for(args.scale, **overrides)


if __name__ == "__main__":
    sys.exit(main())
