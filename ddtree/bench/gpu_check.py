"""One-shot GPU check of the split tree attention and the GDN tree forward: exactness, then the benchmarks.

Run on a CUDA machine from the repository root of a checkout (no flash-attn needed; used when it imports)::

    python -m ddtree.bench.gpu_check            # or: bash examples/gpu_attention_check.sh

How: the exactness checks are tests (``tests/test_gpu.py``, marker ``gpu``, the checks themselves in
``tests/gpu_exactness.py``), so this tool first runs ``python -m pytest -m gpu tests/test_gpu.py`` in a
subprocess, which needs pytest and the tests folder. Each check is its own test, so one failure does not
hide the others. Then the tensor-parallel / layer-split check and the benchmarks.

Writes into ``--out`` (default ``$OUT`` when set, else ``runs/gpu_check``): ``gpu_tests.xml`` (pytest's
junit report), ``exactness/<check>.json`` (every case with its max abs error and tolerance),
``gpu_check.json`` (the environment, those rows, the scale-out rows, every failure), and
``attention_bench.json``, ``attention_bench_window.json`` and ``linear_bench.json`` (GDN hybrid verify
at Qwen3.6-27B widths: 1k and 16k context, 16 and 64 nodes) and ``compiled_bench.json`` (the dynamic round
against ``compile=True``, CUDA graphs, for the chain and best_first at budgets 4 to 64, on 8 layers at
Qwen3-8B widths) and ``compiled_bench_hybrid.json`` (the same for a GDN hybrid at Qwen3.6-27B widths, 4
layers, the chain and best_first@16). Exits non-zero when a check fails, when
pytest fails, or when no exactness test ran. ``--device cpu --level tiny`` runs it all on the CPU.

``--full-size`` runs one stage instead, in a device call of its own: :mod:`ddtree.bench.full_size` (the whole
Qwen3-8B target at its widths, bf16, random weights, with a drafter of the published Qwen3-8B DFlash
configuration, batch 1, 8 and 32, plain, the chain, best_first@16/32/64 and ``auto``, eager and compiled; then
the Qwen3.6-27B GDN hybrid as far as the time budget allows), writing ``full_size.json`` and ``full_size.md``;
on a CPU it runs the same path at tiny widths.
``scale_out`` (:mod:`ddtree.bench.scale_out`) runs a random-weight target at Qwen3-8B widths
tensor-parallel over every GPU present (TP=1 on one GPU) and, with two GPUs or more, layer-split across
them, against one device.

Dependencies: it runs on the GPU image's preinstalled transformers (5.17 there), with no
wheel carried: ddtree picks the cache keyword that version takes (``past_key_values=``)
and raises rather than decode without a cache. CI runs the suite on 5.0.0 and the newest 5.x.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from ddtree.targets.kernels import flash_attn_available

EXACTNESS_TESTS = Path("tests") / "test_gpu.py"
"""The exactness tests, relative to the repository root (the tool reads them, never imports them)."""


def find_exactness_tests(path: str | None = None) -> Path:
    """``tests/test_gpu.py`` under the current directory, else beside the package (a source checkout)."""
    candidates = [Path(path)] if path else [Path.cwd() / EXACTNESS_TESTS,
                                            Path(__file__).resolve().parents[2] / EXACTNESS_TESTS]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no exactness tests at {', '.join(map(str, candidates))}: run from the repository "
                            "root of a ddtree checkout (the tests folder is not in the wheel), or pass --tests PATH")


def run_exactness_tests(tests: Path, out: Path, device: torch.device, level: str, select: str | None = None) -> dict:
    """``pytest -m gpu`` on ``tests`` in a subprocess; its junit XML and each check's rows land in ``out``.
    A run that ran no test counts as failed: a GPU check that checked nothing must not pass."""
    import importlib.util
    import subprocess
    import xml.etree.ElementTree as ET

    if importlib.util.find_spec("pytest") is None:
        raise ModuleNotFoundError("the exactness checks run under pytest: pip install 'ddtree[test]'")
    out = out.resolve()  # pytest runs from the checkout's root, which need not be the current directory
    rows_dir, junit = out / "exactness", out / "gpu_tests.xml"
    shutil.rmtree(rows_dir, ignore_errors=True)
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-rfEs", str(tests.resolve()),
           f"--junitxml={junit}", *(["-k", select] if select else [])]
    env = {**os.environ, "DDTREE_GPU_DEVICE": str(device), "DDTREE_GPU_LEVEL": level,
           "DDTREE_GPU_REPORT": str(rows_dir)}
    print("$ " + " ".join(cmd), flush=True)
    returncode = subprocess.run(cmd, env=env, cwd=tests.resolve().parents[1], check=False).returncode
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if junit.is_file():
        for suite in ET.parse(junit).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
    checks = [json.loads(p.read_text()) for p in sorted(rows_dir.glob("*.json"))]
    failures = [{"check": c["check"], **r} for c in checks for r in c["rows"] if not r["ok"]]
    for c in checks:
        worst = max((r["max_abs_err"] for r in c["rows"]), default=float("nan"))
        status = "ok" if all(r["ok"] for r in c["rows"]) else "FAIL"
        print(f"[{status:5}] {c['check']:12} {len(c['rows']):3} cases, worst max abs err {worst:.3e}", flush=True)
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    if returncode != 0 or passed <= 0:
        failures.append({"check": "pytest", "returncode": returncode, "junit": counts,
                         "error": f"pytest -m gpu exited {returncode} with {passed} test(s) passed; see the log "
                                  f"and {junit}"})
    return {"command": cmd, "returncode": returncode, "junit": counts, "passed": passed, "checks": checks,
            "failures": failures}


def check_scale_out(device: torch.device, quick: bool, timeout: float = 420.0) -> dict:
    """Tensor-parallel (every GPU present; TP=1 on one) and layer-split runs against one device, isolated:
    an error is reported with the other checks, never raised."""
    from ddtree.bench import scale_out

    t0 = time.perf_counter()
    try:
        report = scale_out.run(device, quick=quick, timeout=timeout)
        failures = [{"check": "scale_out", **r} for r in report["rows"] if not r["ok"]]
    except Exception:  # keep going: the attention bench still runs
        report, failures = {"rows": []}, [{"check": "scale_out", "error": traceback.format_exc()}]
    for r in report["rows"]:
        speed = f", {r['tokens_per_second']} tok/s on {r.get('target_device')} (one device " \
                f"{r['one_device_tokens_per_second']})" \
            if "tokens_per_second" in r else ""
        print(f"[{'ok' if r['ok'] else 'FAIL':5}] scale_out {r['placement']} {r['case']}{speed}", flush=True)
    for f in failures:
        if "error" in f:
            print(f"[ERROR] scale_out\n{f['error']}", flush=True)
    return {**report, "seconds": round(time.perf_counter() - t0, 2), "failures": failures}


def environment(device: torch.device) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
           "flash_attn": flash_attn_available()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def main(argv: list[str] | None = None) -> int:
    from ddtree.apps.cli import parser

    p = parser("python -m ddtree.bench.gpu_check", __doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check", help="output directory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--level", choices=("full", "quick", "tiny"), default=None,
                   help="exactness shapes: full (default), quick, or tiny (seconds on a CPU)")
    p.add_argument("--quick", action="store_true", help="quick shapes (unless --level says), and a tiny benchmark")
    p.add_argument("-k", dest="select", default=None, help="run only the exactness checks pytest -k selects")
    p.add_argument("--tests", default=None, help=f"the exactness tests (default {EXACTNESS_TESTS} of the checkout)")
    p.add_argument("--skip-bench", action="store_true", help="run the checks only, not the benchmark")
    p.add_argument("--skip-scale-out", action="store_true",
                   help="skip the tensor-parallel / layer-split check (ddtree.bench.scale_out)")
    p.add_argument("--time-budget", type=float, default=TIME_BUDGET,
                   help=f"seconds for the whole run (default {TIME_BUDGET:.0f}, inside one 8-minute device call): the "
                        "compiled benches' deadlines come out of what is left, and a stage that would start with "
                        "less than it needs is skipped and reported")
    p.add_argument("--full-size", action="store_true",
                   help="run only the full-size stage (ddtree.bench.full_size; tiny widths on a CPU) within the "
                        "time budget")
    args = p.parse_args(argv)
    started = time.perf_counter()

    def left() -> float:
        return args.time_budget - (time.perf_counter() - started)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    level = args.level or ("quick" if args.quick else "full")
    env = environment(device)
    print(json.dumps(env), flush=True)
    if args.full_size:
        return run_full_size(device, out, left() - FULL_SIZE_MARGIN)
    exactness = run_exactness_tests(find_exactness_tests(args.tests), out, device, level, args.select)
    report: dict = {"environment": env, "level": level, "exactness": exactness,
                    "failures": list(exactness["failures"])}
    if not args.skip_scale_out:
        report["scale_out"] = check_scale_out(device, args.quick or level == "tiny", timeout=max(60.0, left() - 240))
        report["failures"] += report["scale_out"]["failures"]
    if device.type == "cuda":
        report["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'gpu_check.json'}: {len(report['failures'])} failures", flush=True)
    if not args.skip_bench:
        report["skipped"] = run_benchmarks(device, out, args.quick, left)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["failures"] else 0


TIME_BUDGET = 450.0
"""Seconds for a whole run by default: one device call of 8 minutes, with room for the start and the transfers."""


FULL_SIZE_MARGIN = 15.0
"""Seconds of the time budget the full-size stage leaves for the process's start and end."""


def run_full_size(device: torch.device, out: Path, seconds: float) -> int:
    """The full-size stage: :mod:`ddtree.bench.full_size` at the published widths on CUDA (tiny widths
    elsewhere) within ``seconds``; non-zero when a case failed."""
    from ddtree.bench import full_size

    scale = "full" if device.type == "cuda" else "tiny"
    report = full_size.run(full_size.settings_for(scale, device=device, time_budget=seconds), out)
    print(full_size.table(report), flush=True)
    print(f"wrote {out / 'full_size.json'} and {out / 'full_size.md'}: {len(report['failures'])} failures",
          flush=True)
    return 1 if report["failures"] else 0


def run_benchmarks(device: torch.device, out: Path, quick: bool, left: Callable[[], float]) -> list[str]:
    """The attention, GDN-verify and compiled-round benchmarks, each started only with the seconds it needs left
    (``left()``: what remains of the run's budget); the compiled benches' deadlines leave the hybrid its share.
    Returns the stages skipped."""
    from ddtree.bench.attention import main as bench
    from ddtree.bench.compiled import main as compiled_bench
    from ddtree.bench.linear import main as linear_bench

    tiny = ["--contexts", "256,1k", "--budgets", "16,64", "--repeats", "3"] if quick else []
    common = ["--device", str(device), *tiny]
    window = ["--contexts", "256,1k"] if quick else ["--contexts", "4k,32k", "--budgets", "64,256"]
    sizes = (["--contexts", "256", "--nodes", "16", "--repeats", "3"] if quick else
             ["--preset", "qwen36-27b", "--dtype", "bf16", "--contexts", "1k,16k", "--nodes", "16,64"])
    # a compiled case compiles for up to a minute on a GPU machine: the deadline is when the last one may start
    shapes = (["--preset", "tiny", "--budgets", "4", "--new-tokens", "16", "--repeats", "1"] if quick else
              ["--preset", "qwen3-8b", "--layers", "8", "--dtype", "bf16", "--context", "1024",
               "--budgets", "4,16,64", "--new-tokens", "64"])
    hybrid = (["--preset", "tiny-hybrid", "--layers", "4", "--budgets", "4", "--new-tokens", "16", "--repeats",
               "1"] if quick else
              ["--preset", "qwen36-27b-hybrid", "--layers", "4", "--dtype", "bf16", "--context", "1024",
               "--budgets", "16", "--new-tokens", "32", "--repeats", "2"])
    stages: list[tuple[str, float, Callable[[], object]]] = [
        ("attention_bench", 20, lambda: bench([*common, "--out", str(out / "attention_bench.json")])),
        ("attention_bench_window", 15, lambda: bench([*common, *window, "--window", "4096",
                                                      "--out", str(out / "attention_bench_window.json")])),
        ("linear_bench", 20, lambda: linear_bench(["--device", str(device), *sizes,
                                                   "--out", str(out / "linear_bench.json")])),
        ("compiled_bench", 150, lambda: compiled_bench(
            ["--device", str(device), *shapes, "--deadline", f"{max(1.0, left() - 210):.0f}",
             "--out", str(out / "compiled_bench.json")])),
        ("compiled_bench_hybrid", 90, lambda: compiled_bench(
            ["--device", str(device), *hybrid, "--deadline", f"{max(1.0, left() - 80):.0f}",
             "--out", str(out / "compiled_bench_hybrid.json")])),
    ]
    skipped = []
    for name, need, run in stages:
        if left() < need:
            skipped.append(name)
            print(f"[skip ] {name}: {left():.0f} s left of the time budget, it needs about {need:.0f} "
                  "(--time-budget raises it)", flush=True)
            continue
        run()
    return skipped


if __name__ == "__main__":
    sys.exit(main())
