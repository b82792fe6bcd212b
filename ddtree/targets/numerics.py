"""The ``numerics`` setting: ``"fast"`` (the library's kernels as they come) or ``"exact"`` (row-invariant ones).

Under ``"exact"`` every target forward after the prefill gives each token the bits a one-token step gives it,
whatever else shares the forward: the tree's other nodes, the batch's other rows. So the verified logits of a
tree node are bit for bit the logits plain decoding computes for the same token after the same prefix, and the
tokens (greedy, or a seed's keyed draws) are the same for every budget, builder, drafter and batch. What it
takes is kernels whose reductions run in an order fixed per output, swapped in behind the target seam:

- linear layers through the row-invariant kernel (:func:`ddtree.targets.cpu_linear.install` with ``exact``),
  and the matrix products that experts and routers compute in functional form (:class:`_RowInvariantMatmuls`);
- attention through :mod:`ddtree.targets.exact_attention` (the ``"exact"`` backend);
- everything else per row as torch runs it on a CPU (norms, activations, rotary embeddings, the sampler), on one
  thread during a decode forward (torch's threads split an op at sizes where a row's bits would follow its
  neighbours) and with the activations padded to whole vectors (:func:`~ddtree.runtime.invariant.elementwise`),
  checked bit for bit by the tests for every family in float32 and bfloat16.

The prefill stays on BLAS and the causal kernels (:func:`ddtree.targets.cpu_linear.bulk_rows`); both settings
share it, and under ``"exact"`` a batch prefills each row alone, so a row's bits do not depend on the others.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ddtree.runtime import invariant
from ddtree.runtime.distributed import Lockstep
from ddtree.targets import cpu_linear, exact_forward, exact_layers, native, row_kernels
from ddtree.targets.description import describe

NUMERICS = ("fast", "exact")


def check_numerics(value: Any) -> None:
    if value is not None and value not in NUMERICS:
        raise ValueError(f"numerics must be 'fast', 'exact' or None (the device's default), got {value!r}")


def exact_unavailable(model: Any) -> str | None:
    """Why ``numerics="exact"`` cannot run ``model`` here, or None."""
    param = next(model.parameters(), None)
    if param is None:
        return "the target has no parameters"
    if param.device.type != "cpu":
        return (f"its row-invariant kernels run on CPU targets, and this one is on {param.device.type}: "
                "the CUDA kernels are not built yet")
    if Lockstep.for_model(model).active:
        return ("under tensor parallelism each rank's partial products are summed by the all-reduce, in an order "
                "that follows the tensor's size, so a tree node and a one-token step would differ in the last bits")
    if param.dtype not in row_kernels.DTYPE_CODES:
        return f"the row-invariant kernels take float32, bfloat16, float16 or float64, not {param.dtype}"
    why = native.unavailable_reason()
    if why is not None:
        return f"the row-invariant CPU kernels cannot run here: {why}"
    return None


class _RowInvariantMatmuls(TorchFunctionMode):
    """Inside a module that computes products of its own weights in functional form (MoE experts and routers),
    ``F.linear`` and ``x @ w`` go to the row-invariant kernel, like the routed ``nn.Linear`` layers (outside
    :func:`~ddtree.targets.cpu_linear.bulk_rows`)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            return cpu_linear.linear(x, weight, bias, cpu_linear.EVERY_ROW)
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and not kwargs and len(args) == 2:
            x, weight = args
            if (isinstance(weight, torch.Tensor) and weight.dim() == 2 and isinstance(x, torch.Tensor)
                    and x.dim() >= 1 and cpu_linear.takes(x, weight, None, 1, cpu_linear.EVERY_ROW)):
                return row_kernels.linear(x, weight, transposed=True)
        return func(*args, **kwargs)


_ROUTED = "_ddtree_exact_matmuls"


def _functional_matmul_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules that hold matrices of their own outside ``nn.Linear`` (experts, routers): their forwards multiply
    by them in functional form."""
    plain = (torch.nn.Linear, torch.nn.Embedding, torch.nn.modules.conv._ConvNd)
    return [m for m in model.modules()
            if not isinstance(m, plain) and any(p.dim() >= 2 for p in m.parameters(recurse=False))]


def _route_matmuls(module: torch.nn.Module) -> None:
    if _ROUTED in vars(module):
        return
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with _RowInvariantMatmuls():
            return original(*args, **kwargs)

    module.forward = forward  # patches this instance
    vars(module)[_ROUTED] = True


_TAIL_FREE = "_ddtree_exact_elementwise"


def _activation_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The activation modules of ``model`` (transformers' ``ACT2FN`` classes)."""
    return [m for m in model.modules() if type(m).__module__ == "transformers.activations"]


def _tail_free(module: torch.nn.Module) -> None:
    """Route an activation module through :func:`~ddtree.runtime.invariant.elementwise`: an MLP width that is
    not a whole number of vectors would otherwise leave the last rows' activations to scalar code."""
    if _TAIL_FREE in vars(module):
        return
    original = module.forward

    @functools.wraps(original)
    def forward(x: torch.Tensor) -> torch.Tensor:
        return invariant.elementwise(original, x)

    module.forward = forward  # patches this instance
    vars(module)[_TAIL_FREE] = True


_PINNED = "_ddtree_exact_threads"


def _pin_torch_threads(model: torch.nn.Module) -> None:
    """Wrap ``model``'s forward so that a forward outside :func:`~ddtree.targets.cpu_linear.bulk_rows` runs torch's
    own ops on one thread (:func:`~ddtree.runtime.invariant.torch_single_threaded`); the prefill keeps them all."""
    if _PINNED in vars(model):
        return
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if cpu_linear.in_bulk():
            return original(*args, **kwargs)
        with invariant.torch_single_threaded():
            return original(*args, **kwargs)

    model.forward = forward  # patches this instance
    vars(model)[_PINNED] = True


def prepare_exact(model: Any) -> None:
    """Route ``model``'s products through the row-invariant kernels (idempotent); raises with the reason where
    they cannot run. The attention is the ``"exact"`` backend's (:class:`ddtree.targets.backends.ExactBackend`)."""
    why = exact_unavailable(model)
    if why is not None:
        raise ValueError(f"numerics='exact' cannot run {type(model).__name__}: {why}. Pass numerics='fast'")
    if any("experts" in name for name, _ in model.named_modules()) and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # the per-expert loop: each expert's rows through the kernel
    cpu_linear.install(model, exact=True)
    exact_layers.install(model)
    for module in _functional_matmul_modules(model):
        _route_matmuls(module)
    for module in _activation_modules(model):
        _tail_free(module)
    _pin_torch_threads(model)
    exact_forward.install(model)  # after the wrap: the forward it expects to find
    describe(model).numerics = "exact"


def release_exact(model: Any) -> bool:
    """Undo :func:`prepare_exact` (a ``"fast"`` generator built on a target an exact one prepared: the last
    generator built owns the target, and the exact one refuses its next call through :func:`check_exact`);
    returns whether there was anything to undo. The experts' implementation stays as it was set."""
    description = describe(model)
    if description.numerics != "exact":
        return False
    for kind in description.stateful:  # their forwards wrap the exact ones: the next backend prepares them anew
        kind.release(model)
    exact_forward.uninstall(model)
    exact_layers.uninstall(model)
    cpu_linear.uninstall(model)
    for module in model.modules():
        for mark in (_ROUTED, _TAIL_FREE):
            if vars(module).pop(mark, None):
                vars(module).pop("forward", None)  # a released stateful kind took it already
    if vars(model).pop(_PINNED, None):
        vars(model).pop("forward", None)
    description.numerics = "fast"
    return True


def check_exact(model: Any) -> None:
    """Refuse a forward of an exact generator whose target another generator gave back its BLAS linears."""
    head = model.get_output_embeddings()
    routed = isinstance(head, torch.nn.Linear) and cpu_linear.routed_exactly(head)
    if describe(model).numerics != "exact" or not routed:
        raise RuntimeError("this generator runs numerics='exact', but its target's linear layers are no longer "
                           "routed through the row-invariant kernel (a generator built later on this target with "
                           "numerics='fast' or compile=True, or cpu_linear.uninstall, took them back: the last "
                           "generator built prepares a target): build a new SpeculativeGenerator for this target")
