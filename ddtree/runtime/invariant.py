"""torch's own CPU ops with bits that do not depend on a tensor's size: one thread, whole vectors.

torch runs an elementwise op over the flattened tensor in vector blocks and computes the last partial block
with scalar code, whose transcendentals (exp, log, sigmoid, silu, ...) can differ from the vector code in the
last bit; on several threads every thread's chunk ends in such a block. Which elements land there depends on
the tensor's size, so a row's bits would depend on the rows beside it. :func:`torch_single_threaded` removes
the chunks and :func:`elementwise` (or a caller that sizes its tensors to :data:`VECTOR_MULTIPLE`) the partial
block: every element then takes the vector code. Used by exact numerics' forwards and by the keyed sampler.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

VECTOR_MULTIPLE = 64
"""Elements in the widest block torch's CPU elementwise loops take at once (two AVX-512 vectors of 16-bit floats)."""

_CALLER_THREADS: contextvars.ContextVar[int | None] = contextvars.ContextVar("ddtree_caller_threads", default=None)


@contextmanager
def torch_single_threaded() -> Iterator[None]:
    """Run torch's own ops on one thread for the block; :func:`caller_threads` keeps the count it had, for
    kernels that split their work by output (whose bits do not depend on the thread count)."""
    threads = torch.get_num_threads()
    outer = _CALLER_THREADS.get()
    token = _CALLER_THREADS.set(threads if outer is None else outer)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _CALLER_THREADS.reset(token)


def caller_threads() -> int:
    """torch's thread count outside :func:`torch_single_threaded` (inside it: the count before it)."""
    threads = _CALLER_THREADS.get()
    return torch.get_num_threads() if threads is None else threads


def padded_length(n: int) -> int:
    """``n`` rounded up to whole blocks of :data:`VECTOR_MULTIPLE`."""
    return n + (-n % VECTOR_MULTIPLE)


def elementwise(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn(*tensors)`` for an elementwise ``fn`` on tensors of one shape, every element through the vector code
    (the flattened tensors padded to whole blocks; with torch on one thread, :func:`torch_single_threaded`)."""
    shape = tensors[0].shape
    numel = tensors[0].numel()
    flat = [torch.nn.functional.pad(t.reshape(-1), (0, padded_length(numel) - numel)) for t in tensors]
    return fn(*flat)[:numel].view(shape)
