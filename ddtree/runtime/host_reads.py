"""Counting host reads: each is a device-to-host wait on an accelerator, where the launch queue drains.

A read is a scalar read of a tensor (``.item()``, ``int(t)``, ``bool(t)``, ``float(t)``: ``aten._local_scalar_dense``),
a ``.tolist()``, ``.numpy()``, ``np.asarray(t)`` or ``.cpu()``, and any copy from an accelerator into host
memory. The four Python-level calls are counted whatever the tensor's device, so a count taken on a CPU equals
the count on a GPU (on a CPU tensor ``.cpu()`` is free, on a GPU it waits). ``.to(device)`` is counted only when
it copies off an accelerator: code that moves tensors to another tensor's device costs nothing on one machine.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
_METHODS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.__array__: "__array__",
            torch.Tensor.cpu: "cpu"}


@dataclass
class HostReads:
    """What :func:`count_host_reads` saw: ``count`` reads, named in order in ``reads``."""

    reads: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.reads)


class _Functions(TorchFunctionMode):
    def __init__(self, seen: HostReads, inside: list[bool]):
        super().__init__()
        self.seen, self.inside = seen, inside

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _METHODS.get(func)
        if name is None:
            return func(*args, **kwargs)
        self.seen.reads.append(name)
        self.inside.append(True)  # the copy it dispatches is this read, not another
        try:
            return func(*args, **kwargs)
        finally:
            self.inside.pop()


class _Dispatch(TorchDispatchMode):
    def __init__(self, seen: HostReads, inside: list[bool]):
        super().__init__()
        self.seen, self.inside = seen, inside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside:
            return out
        if func is _SCALAR_READ:
            self.seen.reads.append("scalar")
        elif func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_) and _host_copy(args, out):
            self.seen.reads.append(str(func.overloadpacket.__name__))
        return out


def _host_copy(args: tuple, out) -> bool:
    src = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else args[0]
    return isinstance(out, torch.Tensor) and out.device.type == "cpu" and src.device.type != "cpu"


@contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Count the host reads made inside the ``with`` block: ``with count_host_reads() as reads: ...; reads.count``."""
    seen, inside = HostReads(), []
    with _Functions(seen, inside), _Dispatch(seen, inside):
        yield seen
