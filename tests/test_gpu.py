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
from gpu_exactness import CHECKS, LEVELS, run_check

DEVICE = os.environ.get("DDTREE_GPU_DEVICE", "cuda")
LEVEL = os.environ.get("DDTREE_GPU_LEVEL", "full")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                       reason="needs CUDA (set DDTREE_GPU_DEVICE=cpu to run the checks on the CPU)"),
]


def failing_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["ok"]]


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
