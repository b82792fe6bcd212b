"""The row-invariant CPU kernels as torch functions: :func:`linear` and :func:`tree_attention`.

Each output is reduced in one fixed order that depends only on that output's own inputs (``csrc/row_invariant.c``),
never on how many rows, nodes or threads share the call: a tree-verify forward through them gives every node
the bits a one-token forward gives it. float32, bfloat16 and float16 are computed in float32 and rounded once;
float64 in float64. Inputs are CPU tensors with no gradient; :func:`ddtree.targets.native.library` says where the
kernels cannot run.
"""

from __future__ import annotations

import contextvars
import ctypes
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ddtree.runtime.invariant import caller_threads
from ddtree.targets import native

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
"""The dtypes the kernels take, by the code the C side switches on."""


def _threads() -> int:
    return caller_threads()


SMALL_PRODUCT = 1 << 17
"""Multiply-adds below which a product runs on one thread (the bits do not depend on the thread count)."""

_LIB: list = [None]  # the loaded library, for checked_linear's per-call path


def checked_library() -> None:
    """Load the library for :func:`checked_linear` (raises where it cannot run)."""
    _library()


def _library():
    lib, why = native.library()
    if lib is None:
        raise RuntimeError(f"the ddtree row-invariant CPU kernels cannot run here: {why}")
    _LIB[0] = lib
    return lib


def _check_cpu(name: str, *tensors: torch.Tensor | None) -> torch.dtype:
    dtypes = {t.dtype for t in tensors if t is not None}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPE_CODES:
        raise ValueError(f"{name}: the row-invariant kernels take one dtype among float32, bfloat16, float16 and "
                         f"float64, got {sorted(str(d) for d in dtypes)}")
    if any(t is not None and t.device.type != "cpu" for t in tensors):
        raise ValueError(f"{name}: the row-invariant C kernels run on CPU tensors")
    return next(iter(dtypes))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           transposed: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``weight`` ``[N, K]``), or ``x @ weight + bias`` with ``transposed``
    (``weight`` ``[K, N]``), each output row summed in the same order whatever the number of rows."""
    if weight.dim() != 2:
        raise ValueError(f"linear: the weight must be 2-D, got shape {tuple(weight.shape)}")
    k, n = (weight.shape[0], weight.shape[1]) if transposed else (weight.shape[1], weight.shape[0])
    if x.shape[-1] != k:
        raise ValueError(f"linear: input has {x.shape[-1]} features but the weight {tuple(weight.shape)} expects {k}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"linear: bias has shape {tuple(bias.shape)}, expected ({n},)")
    _check_cpu("linear", x, weight, bias)
    _library()
    return checked_linear(x, weight.contiguous(), None if bias is None else bias.contiguous(), transposed)


def checked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   transposed: bool = False) -> torch.Tensor:
    """:func:`linear` for inputs already known to fit (one dtype the kernels take, CPU, ``weight`` and ``bias``
    contiguous, the library loaded): a routed layer's per-call path, without the checks."""
    k = weight.shape[0] if transposed else weight.shape[1]
    n = weight.shape[1] if transposed else weight.shape[0]
    rows = x.numel() // k if k else 0
    x2 = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    if rows and n:
        threads = 1 if rows * k * n < SMALL_PRODUCT else _threads()  # a tiny product costs less than waking threads
        _LIB[0].ddtree_row_linear(x2.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                  y.data_ptr(), rows, k, n, DTYPE_CODES[x.dtype], int(transposed), threads)
    return y


def version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter (-1 for an inference tensor, which keeps none: only its identity and
    storage tell it apart)."""
    return -1 if t.is_inference() else t._version


class PackedWeight:
    """A linear's weight packed once for :func:`packed_linear`: panels of 64 output columns, each streamed in
    order, so a few-row product runs at the speed of the memory and many rows share each panel. It is a copy:
    it remembers which tensor and version it was packed from (:meth:`packed_from`) so a caller can repack after
    the weight changes."""

    __slots__ = ("data", "n", "k", "dtype", "transposed", "_source", "__weakref__")

    def __init__(self, weight: torch.Tensor, transposed: bool = False):
        if weight.dim() != 2:
            raise ValueError(f"PackedWeight: the weight must be 2-D, got shape {tuple(weight.shape)}")
        dtype = _check_cpu("PackedWeight", weight)
        if dtype == torch.float64:
            raise ValueError("PackedWeight: float64 weights are not packed (use linear)")
        lib = _library()
        self.k, self.n = (weight.shape[0], weight.shape[1]) if transposed else (weight.shape[1], weight.shape[0])
        self.dtype, self.transposed = dtype, transposed
        self.data = torch.empty(lib.ddtree_packed_bytes(self.n, self.k, DTYPE_CODES[dtype]), dtype=torch.uint8)
        self.repack(weight)
        _PACKS[self.data.data_ptr()] = self

    def packed_from(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is, unchanged, the tensor this was packed from (its storage, version, dtype and
        shape: an in-place update, a load or a ``.to()`` all make it False)."""
        return self._source == (weight.data_ptr(), version(weight), weight.dtype, tuple(weight.shape))

    def fits(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` has the shape and dtype this holds, so :meth:`repack` can take it in place."""
        shape = (self.k, self.n) if self.transposed else (self.n, self.k)
        return weight.dtype == self.dtype and tuple(weight.shape) == shape and weight.device.type == "cpu"

    def repack(self, weight: torch.Tensor) -> None:
        """Pack ``weight`` (of the shape and dtype this holds) into the same bytes: whatever holds them (a
        compiled graph, a C layer's plan) multiplies by the new weight."""
        if not self.fits(weight):
            raise ValueError(f"PackedWeight.repack: a {tuple(weight.shape)} {weight.dtype} weight does not fit the "
                             f"packed {self.n} x {self.k} {self.dtype} one; pack it anew")
        w = weight.detach().contiguous()
        _library().ddtree_pack_weight(w.data_ptr(), self.data.data_ptr(), self.n, self.k, DTYPE_CODES[self.dtype],
                                      int(self.transposed))
        self._source = (weight.data_ptr(), version(weight), weight.dtype, tuple(weight.shape))


_PACKS: weakref.WeakValueDictionary[int, PackedWeight] = weakref.WeakValueDictionary()
"""Each live :class:`PackedWeight` by the address of its bytes, for :func:`packed_for`."""


def packed_for(data: torch.Tensor) -> PackedWeight | None:
    """The :class:`PackedWeight` whose bytes ``data`` is, or None (an operator receives the bytes alone)."""
    return _PACKS.get(data.data_ptr())


_ONLY: contextvars.ContextVar[tuple[torch.Size, torch.Tensor] | None] = contextvars.ContextVar(
    "ddtree_only_rows", default=None)


@contextmanager
def only_rows(valid: torch.Tensor | None) -> Iterator[None]:
    """Inside, a :func:`packed_linear` whose input rows are laid out as ``valid`` (``[B, T]``, a padded
    prefill's real tokens) computes only the ``True`` rows and gives the others zeros: a padded batch's
    padding costs no products, and each real row's bits are what they would be anyway."""
    held = None if valid is None else (valid.shape, valid.reshape(-1).nonzero().reshape(-1).to(torch.int64))
    token = _ONLY.set(held)
    try:
        yield
    finally:
        _ONLY.reset(token)


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for the weight ``packed`` holds (``x`` and ``bias`` of its dtype, on the
    CPU): each output one accumulation over the input features in order, whatever the number of rows."""
    if x.dtype != packed.dtype or x.shape[-1] != packed.k or x.device.type != "cpu":
        raise ValueError(f"packed_linear: input {tuple(x.shape)} {x.dtype} on {x.device} does not fit the packed "
                         f"weight ({packed.n} x {packed.k}, {packed.dtype}, CPU)")
    return packed_product(x, packed.data, packed.n, packed.k, bias)


def packed_product(x: torch.Tensor, data: torch.Tensor, n: int, k: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`packed_linear` given the packed bytes and the weight's ``[n, k]`` (``x`` known to fit: a CPU tensor
    of the dtype ``data`` was packed from, ``k`` features)."""
    rows = x.numel() // k if k else 0
    x2 = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    if rows and n:
        if _LIB[0] is None:
            _library()
        only = _ONLY.get()
        pick = only[1] if only is not None and x.shape[:-1] == only[0] else None
        work = rows if pick is None else pick.numel()
        threads = 1 if work * k * n < SMALL_PRODUCT else _threads()
        b = None if bias is None else bias.contiguous()
        _LIB[0].ddtree_packed_linear(x2.data_ptr(), data.data_ptr(), 0 if b is None else b.data_ptr(),
                                     y.data_ptr(), rows, k, n, DTYPE_CODES[x.dtype], threads,
                                     0 if pick is None else pick.data_ptr(), work)
    return y


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, visible: torch.Tensor, *,
                   scale: float, sinks: torch.Tensor | None = None, softcap: float | None = None,
                   prefix_end: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``N`` tree nodes per row over the committed prefix and their own paths, in logical order.

    ``q`` ``[B, Hq, N, D]``; ``k``/``v`` ``[B, Hkv, S, D]``: row ``b``'s prefix ends at column ``P_b``
    (``prefix_end[b]``; default ``S - N`` for every row) and its nodes sit at ``P_b .. P_b + N - 1``; node ``n``
    sees the prefix columns ``start[b, n] .. P_b - 1`` and the node columns ``m`` with ``visible[b, n, m]`` (its
    ancestors and itself: index order is path order). ``sinks`` ``[Hq]``: a learned logit per head in every
    softmax's denominator (gpt-oss). Returns ``[B, N, Hq, D]``. A one-token step is the case ``N = 1``: the same
    keys in the same order give the same bits.
    """
    bsz, hq, n, d = q.shape
    hkv, width = k.shape[1], k.shape[2]
    if hq % hkv or k.shape[0] != bsz or v.shape[:3] != k.shape[:3] or k.shape[3] != d or v.shape[3] != d:
        raise ValueError(f"tree_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                         "[B, Hq, N, D] / [B, Hkv, P + N, D] with Hq a multiple of Hkv")
    if start.shape != (bsz, n) or visible.shape != (bsz, n, n):
        raise ValueError(f"tree_attention: start must be [{bsz}, {n}] and visible [{bsz}, {n}, {n}], got "
                         f"{tuple(start.shape)} and {tuple(visible.shape)}")
    dtype = _check_cpu("tree_attention", q, k, v)
    lib = _library()
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(bsz, n, hq, d, dtype=dtype)
    starts = start.to(device="cpu", dtype=torch.int64).contiguous()
    vis = visible.to(device="cpu", dtype=torch.uint8).contiguous()
    sink = None
    if sinks is not None:
        sink = sinks.detach().to(device="cpu", dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        sink = sink.reshape(hq).contiguous()
    if prefix_end is None:
        ends = torch.full((bsz,), width - n, dtype=torch.int64)
    else:
        ends = prefix_end.to(device="cpu", dtype=torch.int64).contiguous()
        if ends.shape != (bsz,) or bool((ends < 0).any()) or bool((ends + n > width).any()):
            raise ValueError(f"tree_attention: prefix_end must be [{bsz}] with each row's nodes inside the {width} "
                             f"key columns, got {ends.tolist()}")
    strides = [(ctypes.c_long * 3)(*t.stride()[:3]) for t in (q, k, v)]
    lib.ddtree_row_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), DTYPE_CODES[dtype], bsz, hq,
                             hkv, n, d, *strides, starts.data_ptr(), ends.data_ptr(),
                             vis.data_ptr(), 0 if sink is None else sink.data_ptr(), float(softcap or 0.0),
                             float(scale), _threads())
    return out


ROW_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes of the row-wise layer ops (:func:`rms_norm`, :func:`rotary`, :func:`silu_mul`)."""

_SMALL_ROWS = 1 << 15
"""Elements below which a row-wise op runs on one thread."""


def _row_op_check(name: str, *tensors: torch.Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    if dtype not in ROW_OP_DTYPES or any(t.dtype != dtype for t in tensors):
        raise ValueError(f"{name}: takes tensors of one dtype among float32, bfloat16 and float16, got "
                         f"{sorted({str(t.dtype) for t in tensors})}")
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"{name}: the row-invariant C kernels run on CPU tensors")
    if _LIB[0] is None:
        _library()
    return dtype


def _row_threads(elements: int) -> int:
    return 1 if elements < _SMALL_ROWS else _threads()


NORM_STYLES = {"llama": 0, "float": 1, "gemma": 3}
"""How an RMSNorm scales by its weight: ``llama`` rounds the normalised row to the dtype, then multiplies by the
weight in the dtype; ``float`` multiplies in float32 and rounds once (gpt-oss); ``gemma`` the same by
``1 + weight``."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str = "llama") -> torch.Tensor:
    """``weight * (x / sqrt(mean(x**2) + eps))`` over the last dimension, normalised in float32 and scaled as
    ``style`` says (:data:`NORM_STYLES`); each row alone, in one order."""
    h = x.shape[-1]
    dtype = _row_op_check("rms_norm", x, weight)
    if weight.shape != (h,) or not weight.is_contiguous():
        raise ValueError(f"rms_norm: the weight must be a contiguous ({h},) vector, got {tuple(weight.shape)}")
    if style not in NORM_STYLES:
        raise ValueError(f"rms_norm: style must be one of {', '.join(NORM_STYLES)}, got {style!r}")
    x2 = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(x.shape, dtype=dtype)
    rows = x2.numel() // h if h else 0
    if rows:
        _LIB[0].ddtree_rms_norm(x2.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, h, h, h, float(eps),
                                NORM_STYLES[style], DTYPE_CODES[dtype], _row_threads(rows * h))
    return y


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[..., T, heads, D]`` in place, by ``cos``/``sin`` ``[..., T, D]`` (one angle set
    per token, shared by its heads): ``x * cos + rotate_half(x) * sin`` with transformers' roundings. Returns
    ``x``."""
    dtype = _row_op_check("rotary", x, cos, sin)
    d = x.shape[-1]
    if (x.dim() < 3 or d % 2 or cos.shape != sin.shape or cos.shape != (*x.shape[:-2], d)
            or not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous())):
        raise ValueError(f"rotary: x must be contiguous [..., T, heads, D] with D even and cos/sin contiguous "
                         f"[..., T, D]; got x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    heads = x.shape[-2]
    rows = x.numel() // (heads * d) if heads * d else 0
    if rows:
        _LIB[0].ddtree_rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, heads, d, heads * d,
                              DTYPE_CODES[dtype], _row_threads(x.numel()))
    return x


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (a SwiGLU MLP's activation), each product rounded to the dtype as torch's two ops
    round it; each row alone, in blocks of 8 from its first element."""
    dtype = _row_op_check("silu_mul", gate, up)
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    g = gate if gate.is_contiguous() else gate.contiguous()
    u = up if up.is_contiguous() else up.contiguous()
    y = torch.empty(gate.shape, dtype=dtype)
    width = gate.shape[-1] if gate.dim() else 1
    rows = g.numel() // width if width else 0
    if rows:
        _LIB[0].ddtree_silu_mul(g.data_ptr(), u.data_ptr(), y.data_ptr(), rows, width, width, width, width,
                                DTYPE_CODES[dtype], _row_threads(rows * width))
    return y


def decoder_stack(ints: ctypes.Array, floats: ctypes.Array, count: int, shared: ctypes.Array) -> None:
    """``count`` decoder layers' decode forwards in turn in C (``ddtree_decoder_stack``: ``ints``/``floats``
    arrays of each layer's argument arrays, ``shared`` what the forward gives every layer, as
    :mod:`ddtree.targets.exact_layers` packs them, after checking them). Raises, with no layer run, where a
    row's new columns would not fit its cache room."""
    if _LIB[0] is None:
        _library()
    if _LIB[0].ddtree_decoder_stack(ints, floats, count, shared):
        raise ValueError("decoder_stack: a row's new columns run past its cache room (a prefix end past the "
                         "capacity less the new tokens); make room before the forward")


def decoder_layer(ints: ctypes.Array, floats: ctypes.Array) -> None:
    """One decoder layer's decode forward in C (``ddtree_decoder_layer``; arguments as
    :mod:`ddtree.targets.exact_layers` packs them, after checking them)."""
    if _LIB[0] is None:
        _library()
    _LIB[0].ddtree_decoder_layer(ints, floats)
