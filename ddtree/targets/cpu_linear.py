"""Route a CPU target's linear layers through the row-invariant kernel (:func:`ddtree.targets.row_kernels.linear`).

Two uses, one kernel:

- **fast** (``cpu_linear=True``/``"auto"``): a tree verify pushes 2-32 tokens through the target at once. On a
  CPU the weights are streamed from memory for every forward, so such a forward could cost about as much as a
  one-token step, but the BLAS small-M paths reach only half that speed or less. The kernel streams each weight
  row once and applies it to every row, so float32 calls (bfloat16 on a CPU with AMX) of at most ``max_rows``
  rows go to it; larger calls (a prompt's prefill) go to BLAS.
- **exact** (``numerics="exact"``): every call outside :func:`bulk_rows` goes to the kernel, in every dtype it
  takes, so a token's activations in these layers are the same bits whatever else shares its forward. The
  prefill runs inside :func:`bulk_rows` on BLAS: plain decoding and speculation share it.

A routed layer keeps a packed copy of its weight (:class:`~ddtree.targets.row_kernels.PackedWeight`, made on
its first call and again after the weight changes), so the routed model holds its linear weights twice.

Where the kernel cannot run (another CPU, no compiler, autograd, another dtype) :func:`linear` is plain
``torch.nn.functional.linear``. Under ``torch.compile`` a routed layer whose weight :func:`pack_routed` packed
calls the kernel as an operator (:mod:`ddtree.targets.kernel_ops`; the same calls, decided by the traced
shapes), so its products have the eager calls' bits; any other linear traces as ``F.linear``.
"""

from __future__ import annotations

import contextvars
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ddtree.targets import kernel_ops, native, row_kernels

DEFAULT_MAX_ROWS = 32  # above this BLAS is as fast (prefill always goes to BLAS)
EVERY_ROW = None
"""``max_rows`` of an exact routing: the kernel takes every call outside :func:`bulk_rows`."""

_INSTALLED = "_ddtree_cpu_linear"
_PACKED = "_ddtree_packed_weight"
_BULK: contextvars.ContextVar[bool] = contextvars.ContextVar("ddtree_bulk_rows", default=False)


@contextmanager
def bulk_rows() -> Iterator[None]:
    """A many-row forward (a prompt's prefill): exactly routed linears use BLAS inside it."""
    token = _BULK.set(True)
    try:
        yield
    finally:
        _BULK.reset(token)


def in_bulk() -> bool:
    """Whether a :func:`bulk_rows` forward is running."""
    return _BULK.get()


def available() -> bool:
    """Whether the kernel runs here (it is built on the first call)."""
    return native.available()


def unavailable_reason() -> str | None:
    """Why :func:`available` is False, or None."""
    return native.unavailable_reason()


def fast_dtype(dtype: torch.dtype) -> bool:
    """Whether the inexact routing takes ``dtype``: float32, and bfloat16 where its products run on AMX tiles
    (elsewhere oneDNN's bf16 products beat the vector kernel past a few rows)."""
    return dtype == torch.float32 or dtype == torch.bfloat16 and native.uses_amx()


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
          max_rows: int | None) -> bool:
    """Whether :func:`linear` gives this call to the kernel (an exact call takes a weight of any layout, copied
    contiguous: inexact BLAS is never the fallback for a layout)."""
    if rows == 0 or x.device.type != "cpu" or weight.device.type != "cpu":
        return False
    if max_rows is EVERY_ROW:
        if _BULK.get() or x.dtype not in row_kernels.DTYPE_CODES:
            return False
    elif rows > max_rows or not fast_dtype(x.dtype) or not weight.is_contiguous():
        return False
    if weight.dtype != x.dtype or (bias is not None and (bias.dtype != x.dtype or bias.device.type != "cpu")):
        return False
    needs_grad = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and needs_grad:
        return False  # no backward
    return native.available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           max_rows: int | None = DEFAULT_MAX_ROWS) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; through the kernel when ``x`` has at most ``max_rows`` rows (float32, or
    bfloat16 where :func:`fast_dtype` says), or
    with ``max_rows=EVERY_ROW`` for any row count and dtype outside :func:`bulk_rows`."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: input has {x.shape[-1]} features but the weight {tuple(weight.shape)} expects "
                         f"{weight.shape[1] if weight.dim() == 2 else '?'} (weight must be [out, in])")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"linear: bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
    if torch.compiler.is_compiling():  # decided at trace time: the traced graph holds torch's own linear
        return F.linear(x, weight, bias)
    k = weight.shape[1]
    rows = x.numel() // k if k else 0
    if not takes(x, weight, bias, rows, max_rows):
        return F.linear(x, weight, bias)
    return row_kernels.linear(x, weight, bias)


def packed_weight(layer: torch.nn.Linear) -> row_kernels.PackedWeight:
    """The layer's packed weight (packed on first use, again after the weight changed); float32, bfloat16 or
    float16 (float64 is not packed)."""
    packed = _packed(layer)
    if packed is None:
        raise ValueError(f"packed_weight: {layer.weight.dtype} weights are not packed")
    return packed


def _packed(layer: torch.nn.Linear) -> row_kernels.PackedWeight | None:
    """The layer's weight packed for :func:`~ddtree.targets.row_kernels.packed_linear`, packed on first use and
    again whenever the weight changed (None for float64, which is not packed)."""
    weight = layer.weight
    packed = layer.__dict__.get(_PACKED)
    if packed is None or not packed.packed_from(weight):
        if weight.dtype == torch.float64:
            return None
        if packed is not None and packed.fits(weight):
            packed.repack(weight)  # in place: a compiled graph or a C layer's plan holding the bytes sees it
        else:
            packed = row_kernels.PackedWeight(weight)
            layer.__dict__[_PACKED] = packed
    return packed


def _traced(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A routed layer's forward as ``torch.compile`` traces it: the kernel's operator for the calls the eager
    routing gives the kernel (a weight :func:`pack_routed` packed, the rows the routing takes), else
    ``F.linear``. Decided from the traced shapes, once per graph."""
    weight, bias = layer.weight, layer.bias
    packed = layer.__dict__.get(_PACKED)
    max_rows = getattr(layer, _INSTALLED)
    rows = x.numel() // packed.k if packed is not None and packed.k else 0
    if (packed is None or x.dtype != packed.dtype or x.device.type != "cpu" or x.dim() == 0
            or x.shape[-1] != packed.k or rows == 0 or (max_rows is not EVERY_ROW and rows > max_rows)
            or (bias is not None and bias.dtype != x.dtype)
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    return kernel_ops.packed_linear(x, weight, packed.data, bias, packed.n, packed.k)


def pack_routed(model: torch.nn.Module) -> int:
    """Pack every routed linear of ``model`` that the kernel takes (again where the weight changed), before a
    step that uses them is compiled: a traced graph reads the packed weight but cannot pack one (its operator
    repacks a weight changed in place). Returns how many are packed."""
    count = 0
    for mod in model.modules():
        if (hasattr(mod, _INSTALLED) and isinstance(mod, torch.nn.Linear)
                and _takes_dtype(mod.weight.dtype, getattr(mod, _INSTALLED) is EVERY_ROW) and _packed(mod) is not None):
            count += 1
    return count


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = self.weight, self.bias
    if torch.compiler.is_compiling():
        return _traced(self, x)
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        return linear(x, weight, bias, getattr(self, _INSTALLED))
    rows = x.numel() // weight.shape[1] if weight.shape[1] else 0
    if not takes(x, weight, bias, rows, getattr(self, _INSTALLED)):
        return F.linear(x, weight, bias)
    packed = _packed(self)
    return row_kernels.linear(x, weight, bias) if packed is None else row_kernels.packed_linear(x, packed, bias)


def _forward_exact(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An exactly routed layer's forward: its weight was checked when routed, so only the input is."""
    weight = self.weight
    if torch.compiler.is_compiling():
        return _traced(self, x)
    if (_BULK.get() or x.dtype != weight.dtype or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, self.bias)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: input has {x.shape[-1]} features but the weight {tuple(weight.shape)} expects "
                         f"{weight.shape[1]}")
    packed = _packed(self)
    if packed is None:
        return row_kernels.checked_linear(x, weight, self.bias)
    return row_kernels.packed_linear(x, packed, self.bias)


def exact_product(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An exactly routed layer's product for a caller that already knows ``x`` fits (a decode forward of the
    layer's dtype on the CPU, outside :func:`bulk_rows`): the packed kernel without the per-call checks."""
    packed = _packed(layer)
    if packed is None:
        return row_kernels.checked_linear(x, layer.weight, layer.bias)
    return row_kernels.packed_linear(x, packed, layer.bias)


def _routable(mod: torch.nn.Module, exact: bool) -> bool:
    if not isinstance(mod, torch.nn.Linear) or mod.weight.device.type != "cpu" or not mod.weight.is_contiguous():
        return False
    if exact and mod.bias is not None and (mod.bias.dtype != mod.weight.dtype or not mod.bias.is_contiguous()):
        return False
    return _takes_dtype(mod.weight.dtype, exact)


def _takes_dtype(dtype: torch.dtype, exact: bool) -> bool:
    """Whether a routing (exact, or the inexact one) gives a layer of this dtype to the kernel."""
    return dtype in row_kernels.DTYPE_CODES if exact else fast_dtype(dtype)


def install(model: torch.nn.Module, max_rows: int = DEFAULT_MAX_ROWS, *, exact: bool = False) -> int:
    """Route ``model``'s CPU ``nn.Linear`` layers through :func:`linear`; returns how many.

    Without ``exact``: float32 layers (bfloat16 too where :func:`fast_dtype` says), calls of at most
    ``max_rows`` rows (a prompt's prefill still uses
    BLAS). With ``exact``: layers of every dtype the kernel takes, every call outside :func:`bulk_rows`.
    Raises if the kernel cannot run here; :func:`uninstall` undoes it.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if not available():
        raise RuntimeError(f"the ddtree CPU linear kernel is unavailable: {unavailable_reason()}")
    row_kernels.checked_library()
    count = 0
    for mod in model.modules():
        if _routable(mod, exact):
            setattr(mod, _INSTALLED, EVERY_ROW if exact else int(max_rows))
            mod.forward = types.MethodType(_forward_exact if exact else _forward, mod)  # patches this instance
            count += 1
    return count


def uninstall(model: torch.nn.Module) -> int:
    """Give ``model``'s linears back their own forward; returns how many were routed."""
    count = 0
    for mod in model.modules():
        if hasattr(mod, _INSTALLED):
            delattr(mod, _INSTALLED)
            del mod.forward
            mod.__dict__.pop(_PACKED, None)
            count += 1
    return count


def route_like(layer: torch.nn.Linear, like: torch.nn.Linear) -> bool:
    """Route ``layer`` as ``like`` is routed (exactly, or with its row limit), where it is and ``layer`` can be;
    returns whether ``layer`` is routed now."""
    max_rows = getattr(like, _INSTALLED, None)
    if max_rows is None or not _routable(layer, max_rows is EVERY_ROW):
        return False
    routed_now = install(layer, exact=True) if max_rows is EVERY_ROW else install(layer, max_rows)
    return routed_now > 0


def routed(layer: torch.nn.Linear) -> bool:
    """Whether this one linear goes through the kernel (O(1), for per-round checks)."""
    return hasattr(layer, _INSTALLED)


def installed(model: torch.nn.Module) -> int:
    """How many of ``model``'s linears go through the kernel."""
    return sum(1 for mod in model.modules() if hasattr(mod, _INSTALLED))


def runs_exact_forward(layer: torch.nn.Module) -> bool:
    """Whether the layer's forward is the exact routing's own (not replaced since)."""
    forward = vars(layer).get("forward")
    return routed_exactly(layer) and getattr(forward, "__func__", None) is _forward_exact  # type: ignore[arg-type]


def routed_exactly(layer: torch.nn.Linear) -> bool:
    """Whether this one linear takes every call outside :func:`bulk_rows` (an exact routing; O(1))."""
    return hasattr(layer, _INSTALLED) and getattr(layer, _INSTALLED) is EVERY_ROW


@contextmanager
def suspended(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run the block with ``model``'s own linears (a stock baseline), then route them again."""
    saved = [(mod, getattr(mod, _INSTALLED)) for mod in model.modules() if hasattr(mod, _INSTALLED)]
    uninstall(model)
    try:
        yield model
    finally:
        for mod, max_rows in saved:
            setattr(mod, _INSTALLED, max_rows)
            mod.forward = types.MethodType(_forward_exact if max_rows is EVERY_ROW else _forward, mod)
