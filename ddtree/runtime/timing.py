"""Per-stage wall-clock accounting, the one place timing lives."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

STAGES = ("calibration", "prefill", "draft", "tree_build", "mask", "verify", "commit")
"""``calibration`` is the auto budget's verify profiling, kept apart from the stages of a round."""


class StageTimer:
    """Accumulates seconds per named stage; synchronises CUDA so GPU work is charged to its stage."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.seconds = {s: 0.0 for s in STAGES}
        self._cuda = torch.device(device).type == "cuda" if device is not None else False

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self._cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._cuda:
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    @property
    def total(self) -> float:
        return sum(self.seconds.values())
