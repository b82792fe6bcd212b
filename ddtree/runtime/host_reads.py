"""``count_host_reads()``: count the places where Python waits for a tensor's value.

On a GPU every such read (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.numpy()``, ``.cpu()``, a copy
to the host) waits for the device and drains the launch queue, so a round's reads bound how well it overlaps
with the device. Counting them on a CPU tells the same story: the code makes the same reads wherever it runs.

A dispatch mode sees the scalar reads (``aten.item``, ``aten.is_nonzero``, ``aten._local_scalar_dense``, also
those made inside torch ops such as ``torch.arange(t)``) and device-to-host copies; ``.tolist()`` and
``.numpy()`` never reach the dispatcher on a CPU tensor, so a function mode counts those, ``np.asarray(t)`` and
``.cpu()`` (whatever the tensor's device, so a count taken on a CPU equals the count on a GPU).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_OPS = {"aten::item", "aten::is_nonzero", "aten::_local_scalar_dense"}
_COPY_OPS = {"aten::_to_copy", "aten::to", "aten::copy_"}
_METHODS = {"tolist", "numpy", "__array__", "cpu"}  # Tensor methods that hand values to the host (by name)
_SKIP = ("torch", "contextlib", __name__)


@dataclass
class HostReads:
    """What one ``count_host_reads()`` block read: ``count`` in all, ``reads`` (each read's kind, in order),
    ``by_kind`` (``scalar``: ``.item()``, ``int(t)``, ``bool(t)``...; ``tolist``, ``numpy``, ``__array__``
    (``np.asarray(t)``), ``cpu``, ``copy``) and ``by_site`` (``module.function:line`` of the first frame outside
    torch)."""

    count: int = 0
    reads: list[str] = field(default_factory=list)
    by_kind: Counter = field(default_factory=Counter)
    by_site: Counter = field(default_factory=Counter)

    def add(self, kind: str) -> None:
        self.count += 1
        self.reads.append(kind)
        self.by_kind[kind] += 1
        self.by_site[_call_site()] += 1

    def sites(self, prefix: str) -> int:
        """Reads made at sites whose module starts with ``prefix``."""
        return sum(n for site, n in self.by_site.items() if site.startswith(prefix))


def _call_site() -> str:
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in _SKIP and module != __name__:
            return f"{module}.{frame.f_code.co_name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class _Methods(TorchFunctionMode):
    def __init__(self, reads: HostReads, inside: list[int]) -> None:
        super().__init__()
        self.reads, self.inside = reads, inside

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name not in _METHODS:
            return func(*args, **(kwargs or {}))
        self.reads.add(name)
        self.inside[0] += 1  # the copy it makes inside is this read, not another
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.inside[0] -= 1


class _Ops(TorchDispatchMode):
    def __init__(self, reads: HostReads, inside: list[int]) -> None:
        super().__init__()
        self.reads, self.inside = reads, inside

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        if not self.inside[0]:
            if name in _SCALAR_OPS:
                self.reads.add("scalar")
            elif name in _COPY_OPS and _to_host(func, args, kwargs):
                self.reads.add("copy")
        return func(*args, **kwargs)


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """A copy whose source is on an accelerator and whose result lands on the CPU."""
    if func._schema.name == "aten::copy_":
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"
    src = args[0]
    if not isinstance(src, torch.Tensor) or src.device.type == "cpu":
        return False
    device = kwargs.get("device")
    if device is None:
        device = next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)
    return device is not None and torch.device(device).type == "cpu"


@contextlib.contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Count the host reads this thread makes inside the block."""
    reads = HostReads()
    inside = [0]
    with _Methods(reads, inside), _Ops(reads, inside):
        yield reads
