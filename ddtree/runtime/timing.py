"""Per-stage wall-clock accounting, the one place timing lives."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

STAGES = ("calibration", "prefill", "draft", "tree_build", "mask", "verify", "commit")
"""``calibration`` is the auto budget's verify profiling, kept apart from the stages of a round."""


class StageTimer:
    """Accumulates seconds per named stage.

    On the CPU each stage is timed with the host clock. On CUDA a stage records a pair of CUDA events and
    never synchronises: the GPU work is charged to its stage when the seconds are read, which waits only
    for events not yet complete (after a round's one host read, none are). Reading ``seconds`` mid-round
    would wait for the device, so the round reads them after its host read.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._seconds = {s: 0.0 for s in STAGES}
        self._last = {s: 0.0 for s in STAGES}
        self._cuda = torch.device(device).type == "cuda" if device is not None else False
        self._pending: list[tuple[str, Any, Any]] = []

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._pending.append((name, start, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._add(name, time.perf_counter() - t0)

    def _add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds
        self._last[name] = seconds

    def _resolve(self) -> None:
        for name, start, end in self._pending:
            end.synchronize()
            self._add(name, start.elapsed_time(end) / 1e3)
        self._pending.clear()

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds per stage so far (on CUDA this waits for the stages recorded and not yet complete)."""
        self._resolve()
        return self._seconds

    def last(self, name: str) -> float:
        """The seconds of the latest ``name`` stage."""
        self._resolve()
        return self._last.get(name, 0.0)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def work_clock(device: torch.device | str) -> tuple[Callable[[], float], Callable[[], float] | None]:
    """The clock a budget policy prices rounds with, and the wall clock beside it when they differ.

    A CPU target run on one torch thread: this process's CPU time, which counts the round's own work and not
    the time other processes take the core (under a competing process, wall seconds swing with the scheduler
    while the work, and so which option is cheaper, stays the same). Elsewhere wall time (a GPU's work is not
    the host's CPU time; several threads' CPU time overcounts their parallel parts)."""
    if torch.device(device).type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time, time.perf_counter
    return time.perf_counter, None
