"""The packed row kernel as a torch operator, ``torch.ops.ddtree.packed_linear``, for compiled graphs.

A compiled graph cannot call into ctypes: traced as Python, a routed linear would become torch's own product,
which on a CPU is slower for a few rows than the packed kernel. As an operator it stays one opaque call in the
graph (inductor generates nothing for it and fuses nothing into it), at a few microseconds of dispatch, and
computes what the eager routing computes, bit for bit. The operator is registered for CPU tensors only, with a
shape function for tracing.
"""

from __future__ import annotations

import torch

from ddtree.targets import row_kernels

_LIBRARY = torch.library.Library("ddtree", "DEF")  # noqa: TOR901 (a plain CPU kernel, no autograd formula)
_LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor packed, Tensor? bias, int n, int k) -> Tensor")


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
                   k: int) -> torch.Tensor:
    held = row_kernels.packed_for(packed)
    if held is not None and not held.packed_from(weight):  # the weight changed since: as the eager routing does
        held.repack(weight)
    return row_kernels.packed_product(x, packed, n, k, bias)


def _packed_linear_shape(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                         n: int, k: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], n)


_LIBRARY.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("ddtree::packed_linear", _packed_linear_shape, lib=_LIBRARY)

packed_linear = torch.ops.ddtree.packed_linear.default
"""``packed_linear(x, weight, packed.data, bias, packed.n, packed.k)`` for a
:class:`~ddtree.targets.row_kernels.PackedWeight` ``packed`` of ``weight``: what
:func:`~ddtree.targets.row_kernels.packed_linear` computes, as one operator; a weight changed in place since
it was packed is packed again first, into the same bytes."""
