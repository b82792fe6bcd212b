"""The vLLM side of ``python -m ddtree.bench engines``: run by the vLLM venv's python, as a file, never imported
by ddtree's library.

It imports only ``json``, ``os``, ``sys``, ``time`` and (in :func:`serve`) ``vllm``, so it runs in a venv that
has vLLM and no ddtree. Protocol (one engine per process, kept alive across the bench's repeats so startup and
compilation are paid once and reported apart):

* ``python vllm_driver.py SPEC.json``: the spec (see :func:`check_spec`) names the model, dtype, speculative
  config, the prompts as token ids, the batch sizes and the decoding settings.
* The driver builds the engine, runs an untimed warm-up at every batch size, then prints one line
  ``DDTREE-VLLM {"event": "ready", ...}`` (dtype vLLM chose, startup and warm-up seconds).
* Each stdin line ``run OUT.json`` runs every batch of every batch size once and writes the outputs, each
  batch's wall seconds and the change in vLLM's own metrics to ``OUT.json``, then prints
  ``DDTREE-VLLM {"event": "done", "path": ...}``. ``profile OUT.json`` runs the first batch of each size under
  torch's profiler (vLLM's venv has torch) and writes its wall seconds, engine steps and every op's self CPU
  time instead. ``quit`` (or end of input) ends the process.
"""

from __future__ import annotations

import json
import os
import sys
import time

MARKER = "DDTREE-VLLM "
SPEC_KEYS = {"model", "prompts", "batch_sizes", "max_new_tokens"}
DEFAULTS = {"dtype": "auto", "speculative": None, "ignore_eos": False, "warmup_tokens": 32, "max_model_len": None,
            "enforce_eager": False, "seed": 0}


def check_spec(spec: dict) -> dict:
    """The spec with defaults filled in; a missing or malformed field is an error naming it."""
    missing = SPEC_KEYS - set(spec)
    if missing:
        raise ValueError(f"the driver's spec lacks {sorted(missing)}")
    unknown = set(spec) - SPEC_KEYS - set(DEFAULTS)
    if unknown:
        raise ValueError(f"the driver's spec has unknown fields {sorted(unknown)}")
    prompts = spec["prompts"]
    if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        raise ValueError("spec 'prompts' must be a non-empty list of non-empty lists of token ids")
    sizes = spec["batch_sizes"]
    if not sizes or not all(isinstance(s, int) and s >= 1 for s in sizes):
        raise ValueError(f"spec 'batch_sizes' must be positive ints, got {sizes!r}")
    if not isinstance(spec["max_new_tokens"], int) or spec["max_new_tokens"] < 1:
        raise ValueError(f"spec 'max_new_tokens' must be an int >= 1, got {spec['max_new_tokens']!r}")
    return {**DEFAULTS, **spec}


def batches(prompts: list[list[int]], size: int) -> list[list[list[int]]]:
    """The prompts in consecutive batches of ``size`` (the last may be shorter), as ddtree's side splits them."""
    return [prompts[i:i + size] for i in range(0, len(prompts), size)]


def snapshot(metrics) -> dict:
    """vLLM's metric objects (``LLM.get_metrics()``) as ``{name: number or list}``, summed over labels:
    counters and gauges by ``value``, vectors by ``values``, histograms as ``name:count`` and ``name:sum``."""
    out: dict = {}

    def add(key, value):
        if isinstance(value, list):
            old = out.get(key, [0] * len(value))
            out[key] = [a + b for a, b in zip(old, value)] + old[len(value):] + value[len(old):]
        else:
            out[key] = out.get(key, 0) + value

    for m in metrics:
        if hasattr(m, "values"):
            add(m.name, list(m.values))
        elif hasattr(m, "buckets"):
            add(m.name + ":count", m.count)
            add(m.name + ":sum", m.sum)
        elif hasattr(m, "value"):
            add(m.name, m.value)
    return out


def delta(before: dict, after: dict) -> dict:
    """What changed between two snapshots (lists element-wise); unchanged entries are left out."""
    out: dict = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, list):
            old = old or []
            diff = [v - (old[i] if i < len(old) else 0) for i, v in enumerate(value)]
            if any(diff):
                out[key] = diff
        elif value != (old or 0):
            out[key] = value - (old or 0)
    return out


def acceptance(metrics_delta: dict) -> float | None:
    """Mean tokens a verify step commits (accepted draft tokens + the bonus), from vLLM's spec-decode counters;
    None where no draft ran."""
    drafts = metrics_delta.get("vllm:spec_decode_num_drafts", 0)
    if not drafts:
        return None
    return 1.0 + metrics_delta.get("vllm:spec_decode_num_accepted_tokens", 0) / drafts


def engine_kwargs(spec: dict) -> dict:
    """``vllm.LLM``'s arguments for a spec: prefix caching off (the bench repeats its prompts), its own stats on
    (for the spec-decode counters), and a context long enough for the longest prompt plus its new tokens."""
    longest = max(len(p) for p in spec["prompts"]) + spec["max_new_tokens"]
    spec_cfg = spec["speculative"]
    if spec_cfg is not None:
        longest += int(spec_cfg.get("num_speculative_tokens", 0)) + 1
    kwargs = {"model": spec["model"], "dtype": spec["dtype"], "enable_prefix_caching": False,
              "disable_log_stats": False, "max_model_len": spec["max_model_len"] or longest,
              "max_num_seqs": max(spec["batch_sizes"]), "seed": spec["seed"],
              "enforce_eager": spec["enforce_eager"]}
    if spec_cfg is not None:
        kwargs["speculative_config"] = dict(spec_cfg)
    return kwargs


def outputs_of(request_outputs) -> list[dict]:
    """Per prompt, in order: its new token ids and why it stopped."""
    return [{"tokens": list(r.outputs[0].token_ids), "finish_reason": r.outputs[0].finish_reason}
            for r in request_outputs]


def emit(event: dict) -> None:
    print(MARKER + json.dumps(event), flush=True)


def run_once(llm, params, spec: dict, tokens: int | None = None) -> dict:
    """Every batch of every batch size once: per size, each batch's outputs and wall seconds, and the change
    in vLLM's metrics over that size's batches."""
    if tokens is not None:
        params = params.clone()
        params.max_tokens = tokens
    result = {}
    for size in spec["batch_sizes"]:
        before = snapshot(llm.get_metrics())
        seconds, outputs = [], []
        for batch in batches(spec["prompts"], size):
            prompts = [{"prompt_token_ids": ids} for ids in batch]
            t0 = time.perf_counter()
            got = llm.generate(prompts, params, use_tqdm=False)
            seconds.append(time.perf_counter() - t0)
            outputs.extend(outputs_of(got))
        result[str(size)] = {"seconds": seconds, "outputs": outputs,
                             "metrics": delta(before, snapshot(llm.get_metrics()))}
    return result


def profile_once(llm, params, spec: dict) -> dict:
    """The first batch of each size once under torch's CPU profiler: wall seconds, engine steps (scheduler
    iterations) and each op's self CPU microseconds and calls, so the parent can split a step's time."""
    import torch  # vLLM's own dependency; only this command needs it

    result = {}
    for size in spec["batch_sizes"]:
        prompts = [{"prompt_token_ids": ids} for ids in batches(spec["prompts"], size)[0]]
        before = snapshot(llm.get_metrics())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            got = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
        metrics = delta(before, snapshot(llm.get_metrics()))
        ops = [{"name": e.key, "self_cpu_us": e.self_cpu_time_total, "calls": e.count}
               for e in prof.key_averages() if e.self_cpu_time_total > 0]
        result[str(size)] = {"seconds": seconds, "steps": metrics.get("vllm:iteration_tokens_total:count", 0),
                             "new_tokens": sum(len(o["tokens"]) for o in outputs_of(got)), "metrics": metrics,
                             "ops": ops}
    return result


def serve(spec: dict, commands) -> None:
    import vllm

    t0 = time.perf_counter()
    llm = vllm.LLM(**engine_kwargs(spec))
    startup = time.perf_counter() - t0
    params = vllm.SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"], ignore_eos=spec["ignore_eos"])
    t0 = time.perf_counter()
    run_once(llm, params, spec, tokens=min(spec["warmup_tokens"], spec["max_new_tokens"]))
    warmup = time.perf_counter() - t0
    config = llm.llm_engine.model_config
    emit({"event": "ready", "vllm": vllm.__version__, "dtype": str(config.dtype).replace("torch.", ""),
          "startup_seconds": startup, "warmup_seconds": warmup, "max_model_len": config.max_model_len,
          "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
          "kvcache_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE")})
    for line in commands:
        verb, _, arg = line.strip().partition(" ")
        if verb == "quit":
            break
        if verb not in ("run", "profile") or not arg:
            emit({"event": "error", "message": f"unknown command {line.strip()!r}: send 'run OUT.json', "
                                               "'profile OUT.json' or 'quit'"})
            continue
        result = (run_once if verb == "run" else profile_once)(llm, params, spec)
        with open(arg, "w") as f:
            json.dump(result, f)
        emit({"event": "done", "path": arg})


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python vllm_driver.py SPEC.json  (then 'run OUT.json' / 'quit' lines on stdin)",
              file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = check_spec(json.load(f))
    serve(spec, sys.stdin)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
