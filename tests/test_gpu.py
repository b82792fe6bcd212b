"""The GPU exactness checks (``gpu_exactness.py``) as tests, marker ``gpu``: skipped without CUDA.

``pytest -m gpu tests/test_gpu.py`` on a CUDA machine runs them at the full level;
``python -m ddtree.bench.gpu_check`` runs this file first and its benchmarks after. Settings come from the
environment, so that tool can pass them through a pytest subprocess:

- ``DDTREE_GPU_DEVICE``: torch device (default ``cuda``; ``cpu`` runs them on the CPU).
- ``DDTREE_GPU_LEVEL``: ``full`` (default), ``quick`` or ``tiny``.
- ``DDTREE_GPU_REPORT``: a folder; each check writes its rows there as ``<check>.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from gpu_exactness import CHECKS, LEVELS, run_check, split_shapes

DEVICE = os.environ.get("DDTREE_GPU_DEVICE", "cuda")
LEVEL = os.environ.get("DDTREE_GPU_LEVEL", "full")

needs_the_device = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                      reason="needs CUDA (set DDTREE_GPU_DEVICE=cpu to run the checks on the CPU)")


def failing_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["ok"]]


@pytest.mark.gpu
@needs_the_device
@pytest.mark.parametrize("check", CHECKS)
def test_exactness(check):
    """Every case of the check within its tolerance of the float32 reference (rows are written for the report
    before the assertion, so a failing check still shows every case)."""
    assert LEVEL in LEVELS, f"DDTREE_GPU_LEVEL={LEVEL!r}: use one of {LEVELS}"
    rows = run_check(check, torch.device(DEVICE), LEVEL)
    report = os.environ.get("DDTREE_GPU_REPORT")
    if report:
        Path(report).mkdir(parents=True, exist_ok=True)
        (Path(report) / f"{check}.json").write_text(json.dumps({"check": check, "level": LEVEL, "device": DEVICE,
                                                                "rows": rows}, indent=2) + "\n")
    worst = max((r["max_abs_err"] for r in rows), default=float("nan"))
    print(f"{check}: {len(rows)} cases, worst max abs err {worst:.3e}")
    assert rows, f"{check} ran no case"
    assert not failing_rows(rows), f"{check}: cases over tolerance: {failing_rows(rows)}"


# --------------------------------------------------------------------------- the tool that runs them (CPU)


def test_gpu_check_runs_the_exactness_tests_and_reports_their_rows(tmp_path):
    """``python -m ddtree.bench.gpu_check`` runs this file's gpu tests under pytest and gathers every case."""
    from ddtree.bench import gpu_check

    code = gpu_check.main(["--device", "cpu", "--level", "tiny", "-k", "split_fp32 or causal_bf16", "--skip-bench",
                           "--skip-scale-out", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    exactness = report["exactness"]
    assert code == 0 and report["failures"] == [], report["failures"]
    assert exactness["junit"] == {"tests": 2, "failures": 0, "errors": 0, "skipped": 0}
    assert (exactness["passed"], exactness["returncode"]) == (2, 0)
    assert [c["check"] for c in exactness["checks"]] == ["causal_bf16", "split_fp32"]
    cpu_backends = 2  # split and fused; flash_attn only on CUDA
    expected = {"split_fp32": len(split_shapes("tiny")) * cpu_backends, "causal_bf16": 6 * cpu_backends}
    for c in exactness["checks"]:
        assert (c["level"], c["device"], len(c["rows"])) == ("tiny", "cpu", expected[c["check"]])
        assert all(r["ok"] and r["max_abs_err"] <= r["tol"] for r in c["rows"])
    assert (tmp_path / "gpu_tests.xml").is_file()


def test_gpu_check_fails_when_no_exactness_test_ran(tmp_path):
    """A selection that matches nothing (or a machine where every test skips) must not read as a pass."""
    from ddtree.bench import gpu_check

    code = gpu_check.main(["--device", "cpu", "--level", "tiny", "-k", "no_such_check", "--skip-bench",
                           "--skip-scale-out", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 1
    assert [f["check"] for f in report["failures"]] == ["pytest"]
    assert report["exactness"]["passed"] == 0


def test_gpu_check_reads_the_tests_and_never_imports_them():
    """Tools import the library; tests import what they test. The tool runs the tests as a subprocess."""
    import ast

    from ddtree.bench import gpu_check

    tree = ast.parse(Path(gpu_check.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] in ("tests", "gpu_exactness", "test_gpu", "tiny")}, imported
    assert gpu_check.find_exactness_tests().resolve() == Path(__file__).resolve()


FAILING_CHECK = '''
import json, os, pathlib, pytest

@pytest.mark.gpu
def test_exactness():
    report = pathlib.Path(os.environ["DDTREE_GPU_REPORT"])
    report.mkdir(parents=True, exist_ok=True)
    rows = [dict(case=0, max_abs_err=0.0, tol=1e-4, ok=True), dict(case=1, max_abs_err=0.5, tol=1e-4, ok=False)]
    (report / "broken.json").write_text(json.dumps(dict(check="broken", rows=rows)))
    assert all(r["ok"] for r in rows)
'''


def test_gpu_check_reports_a_failing_check_and_exits_non_zero(tmp_path):
    """A check over tolerance: its failing case lands in the report, and the tool exits 1."""
    from ddtree.bench import gpu_check

    tests = tmp_path / "repo" / "tests" / "test_gpu.py"
    tests.parent.mkdir(parents=True)
    tests.write_text(FAILING_CHECK)
    code = gpu_check.main(["--device", "cpu", "--tests", str(tests), "--skip-bench", "--skip-scale-out",
                           "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert code == 1
    assert report["failures"][0] == {"check": "broken", "case": 1, "max_abs_err": 0.5, "tol": 1e-4, "ok": False}
    assert report["failures"][1]["check"] == "pytest"
    assert report["exactness"]["junit"]["failures"] == 1 and report["exactness"]["passed"] == 0


def test_gpu_check_skips_the_benchmarks_its_time_budget_has_no_room_for(tmp_path, capsys):
    """One device call has 8 minutes: a stage that would start with less than it needs is skipped and named, not
    started and cut off."""
    from ddtree.bench import gpu_check

    skipped = gpu_check.run_benchmarks(torch.device("cpu"), tmp_path, True, left=lambda: 16.0)
    assert skipped == ["attention_bench", "linear_bench", "compiled_bench", "compiled_bench_hybrid"]
    assert [p.name for p in tmp_path.iterdir()] == ["attention_bench_window.json"]  # the one that fits 16 s
    assert "[skip ] compiled_bench: 16 s left" in capsys.readouterr().out
