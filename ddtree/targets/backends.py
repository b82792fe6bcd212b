"""Attention backends for the target's tree-verify forward.

A backend turns a :class:`~ddtree.core.tree.DraftTree` into the extra keyword
arguments of one HF forward call. ``prepare(model)`` is called once per target.

- ``"sdpa"``: a dense additive ``[B, 1, N, prefix + N]`` mask; any HF attention
  implementation that accepts a 4D mask runs it.
- ``"split"``, ``"fused"``, ``"flash_attn"``: split attention (see
  :mod:`ddtree.targets.split_attention`). The committed prefix is attended with no mask
  by a kernel that returns the log-sum-exp, the tree block with its small dense
  mask, and the two are merged exactly. They differ only in the prefix kernel
  (:mod:`ddtree.targets.kernels`): plain torch (the reference), PyTorch's fused
  flash/memory-efficient kernels (CPU and CUDA, no extra package), or the
  flash-attn package (CUDA). They run through attention implementations that
  ``prepare`` registers with transformers (:mod:`ddtree.targets.registration`).
- ``"auto"``: ``flash_attn`` on CUDA when the package imports, else ``fused``;
  on the CPU ``fused``. ``fused`` takes the dense mask while the prefix is
  short, where the dense mask measured faster (under 1024 tokens on a CPU,
  16384 on CUDA; see docs/attention.md).

Layers with per-row state (:mod:`ddtree.targets.layer_kinds`) get their own tree kwargs from their kind.
This module is the documented home of :func:`get_backend` and :class:`TreeAttentionBackend`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ddtree.core.masks import tree_attention_mask
from ddtree.core.tree import DraftTree
from ddtree.targets import families
from ddtree.targets.description import describe
from ddtree.targets.exact_attention import EXACT_IMPLEMENTATION, ExactTreeSpec, register_exact_attention
from ddtree.targets.kernels import flash_attn_available
from ddtree.targets.numerics import check_exact
from ddtree.targets.registration import (
    IMPLEMENTATIONS,
    TREE_KWARG,
    TreeAttentionSpec,
    register_attention_implementations,
)


def window_plan(model: Any) -> dict[str | None, int | None] | None:
    """The sliding window of each attention layer kind, as a tree mask needs it: ``{None: window}`` when every
    attention layer shares one window (``None``: full attention), else ``{layer type: window}`` over the
    config's layer types (linear-attention types absent: they take no mask). ``None`` when windows differ
    within one layer type, which no per-kind mask can express."""
    description = describe(model)
    windows = description.windows
    kinds = set(windows.values())
    if len(kinds) <= 1:
        return {None: next(iter(kinds), None)}
    types = description.layer_types
    by_type: dict[str | None, int | None] = {}
    for idx, window in windows.items():
        kind = types[idx] if idx < len(types) else None
        if kind is None or by_type.setdefault(kind, window) != window:
            return None
    return by_type


def masks_for_plan(plan: dict[str | None, int | None], layer_types: Sequence[str],
                   mask: Callable[[int | None], torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor | None]:
    """One mask (``mask(window)``) per entry of a :func:`window_plan`: a tensor for a single kind, else a dict
    keyed by layer type, ``None`` for the types without attention (how HF models take per-kind masks)."""
    if None in plan:
        return mask(plan[None])
    masks: dict[str, torch.Tensor | None] = {str(kind): mask(window) for kind, window in plan.items()}
    for kind in set(layer_types) - set(masks):
        masks[kind] = None  # linear-attention layers take no attention mask
    return masks


def dense_tree_mask(model: Any, tree: DraftTree, prefix_len: int, dtype: torch.dtype,
                    prefix_valid: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor | None]:
    """The dense additive tree mask for ``model``: one tensor when every attention layer has the same window,
    else a dict keyed by the config's layer types (how HF models take per-layer-kind masks).
    ``prefix_valid`` hides a batch's padding columns (see :func:`ddtree.core.masks.tree_attention_mask`)."""
    plan = window_plan(model)
    if plan is None:
        raise ValueError(
            f"{type(model).__name__} has attention layers with different windows that its config's layer_types "
            "do not separate, so one dense mask per layer kind cannot express them; use attention=\"split\""
        )

    def mask(window: int | None) -> torch.Tensor:
        return tree_attention_mask(tree.visibility, prefix_len, dtype, sliding_window=window, depths=tree.depths,
                                   prefix_valid=prefix_valid)

    return masks_for_plan(plan, describe(model).layer_types, mask)


def prepare_target(model: Any) -> None:
    """What every backend does to a target first: refuse families a tree cannot verify, route stateful layers."""
    families.check_supported(model)
    description = describe(model)
    for kind in description.stateful:
        kind.prepare(model, exact=description.numerics == "exact")


def _with_stateful_kwargs(model: Any, tree: DraftTree, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Add what the model's stateful layers need to see the tree (attention layers never read it)."""
    for kind in describe(model).stateful:
        kwargs.update(kind.tree_forward_kwargs(model, tree))
    return kwargs


_DENSE_RUNNERS = frozenset({"sdpa", "eager"} | {impl for impl, *_ in IMPLEMENTATIONS.values()})
"""Attention implementations that apply a dense 4D tree mask as given (the split ones run it like sdpa)."""
_SPLIT_RUNNERS = frozenset(impl for impl, *_ in IMPLEMENTATIONS.values())
"""The registered split implementations: each reads the tree spec exactly (they differ only in kernels)."""


def attention_implementation(model: Any) -> str | None:
    """The attention implementation ``model`` runs now (its text config's, for composite models)."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl is None:
        impl = getattr(describe(model).text_config, "_attn_implementation", None)
    return impl


def check_implementation(model: Any, backend_name: str, allowed: frozenset[str]) -> None:
    """Refuse a verify forward whose target no longer runs an attention implementation that honours the
    backend's kwargs: another generator (or ``set_attn_implementation``) switched it, and the tree would be
    verified under a plain causal mask, silently wrong."""
    impl = attention_implementation(model)
    if impl not in allowed:
        raise RuntimeError(
            f"attention={backend_name!r} verifies trees through the {' / '.join(sorted(allowed))} attention "
            f"implementation, but {type(model).__name__} now runs {impl!r} (another SpeculativeGenerator with a "
            "different attention= on the same target, or set_attn_implementation, changed it): its tree forward "
            "would ignore the tree mask. Give every generator on one target the same attention=, or use "
            "attention=\"sdpa\" for all of them (it runs under every implementation ddtree sets)"
        )


class TreeAttentionBackend(Protocol):
    """How a target's attention sees a tree: ``prepare`` sets the model up once (its attention
    implementation), ``tree_forward_kwargs`` gives one verify forward's extra kwargs (a dense mask, or the
    tree spec a registered implementation reads). ``prefix_valid`` ``[B, prefix_len]`` marks real columns of
    rows padded in the cache."""

    @property
    def name(self) -> str: ...

    def prepare(self, model: Any) -> None: ...

    def tree_forward_kwargs(self, model: Any, tree: DraftTree, prefix_len: int, dtype: torch.dtype,
                            prefix_valid: torch.Tensor | None = None) -> dict[str, Any]: ...


@dataclass
class DenseMaskBackend:
    """Dense additive mask; works with any HF attention implementation that accepts a 4D mask."""

    name: str = "sdpa"

    def prepare(self, model: Any) -> None:
        prepare_target(model)
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in ("sdpa", "eager"):
            # sdpa where the model has it; eager for models that only run eager (gpt-oss and its sinks)
            model.set_attn_implementation("sdpa" if getattr(model, "_supports_sdpa", True) else "eager")

    def tree_forward_kwargs(self, model: Any, tree: DraftTree, prefix_len: int, dtype: torch.dtype,
                            prefix_valid: torch.Tensor | None = None) -> dict[str, Any]:
        check_implementation(model, self.name, _DENSE_RUNNERS)
        mask = dense_tree_mask(model, tree, prefix_len, dtype, prefix_valid)
        return _with_stateful_kwargs(model, tree, {"attention_mask": mask})


@dataclass
class SplitBackend:
    """Split prefix/tree attention through a registered transformers attention implementation.

    ``dense_below``: for prefixes shorter than this the dense mask is passed
    instead (the registered function runs it like sdpa), since on a CPU the
    split only pays off once the prefix dominates (see docs/attention.md).
    """

    name: str = "split"
    dense_below: int = 0

    @property
    def implementation(self) -> str:
        return IMPLEMENTATIONS[self.name][0]

    def prepare(self, model: Any) -> None:
        if describe(model).sinks:
            raise ValueError(
                f"attention={self.name!r} cannot run {type(model).__name__}: its attention sinks (s_aux) need the "
                "model's own eager attention; use attention=\"sdpa\" (the dense tree mask through eager) or \"auto\""
            )
        prepare_target(model)
        register_attention_implementations()
        model.set_attn_implementation(self.implementation)

    def tree_forward_kwargs(self, model: Any, tree: DraftTree, prefix_len: int, dtype: torch.dtype,
                            prefix_valid: torch.Tensor | None = None) -> dict[str, Any]:
        if prefix_len < self.dense_below or prefix_valid is not None:  # the split kernels take no padding
            return DenseMaskBackend(self.name).tree_forward_kwargs(model, tree, prefix_len, dtype, prefix_valid)
        check_implementation(model, self.name, _SPLIT_RUNNERS)
        return _with_stateful_kwargs(model, tree, {TREE_KWARG: TreeAttentionSpec.from_tree(tree)})


@dataclass
class ExactBackend:
    """Exact tree attention (``numerics="exact"``, :mod:`ddtree.targets.exact_attention`): each node attends to
    its logical key sequence with the one-token step's arithmetic, padded rows and sinks included."""

    name: str = "exact"

    def prepare(self, model: Any) -> None:
        prepare_target(model)
        register_exact_attention()
        model.set_attn_implementation(EXACT_IMPLEMENTATION)

    def tree_forward_kwargs(self, model: Any, tree: DraftTree, prefix_len: int, dtype: torch.dtype,
                            prefix_valid: torch.Tensor | None = None) -> dict[str, Any]:
        check_exact(model)  # first: a later fast generator released the whole target, not only its attention
        check_implementation(model, self.name, frozenset({EXACT_IMPLEMENTATION}))
        return _with_stateful_kwargs(model, tree, {TREE_KWARG: ExactTreeSpec.from_tree(tree, prefix_valid)})


@dataclass
class AutoBackend:
    """Picks the best backend for the target's device at ``prepare`` time."""

    chosen: DenseMaskBackend | SplitBackend | None = None

    @property
    def name(self) -> str:
        return self.chosen.name if self.chosen is not None else "auto"

    def prepare(self, model: Any) -> None:
        self._choose(model)

    def _choose(self, model: Any) -> DenseMaskBackend | SplitBackend:
        chosen: DenseMaskBackend | SplitBackend
        if describe(model).sinks:
            chosen = DenseMaskBackend()  # sinks run only in the model's own attention: the dense mask serves it
        else:
            chosen = _auto_backend(next(model.parameters()).device)
        self.chosen = chosen
        chosen.prepare(model)
        return chosen

    def tree_forward_kwargs(self, model: Any, tree: DraftTree, prefix_len: int, dtype: torch.dtype,
                            prefix_valid: torch.Tensor | None = None) -> dict[str, Any]:
        chosen = self.chosen if self.chosen is not None else self._choose(model)
        return chosen.tree_forward_kwargs(model, tree, prefix_len, dtype, prefix_valid)


_ALIASES = {None: "sdpa", "dense": "sdpa", "torch": "split", "torch_cuda": "fused", "flash": "flash_attn"}


BACKENDS = ("auto", "sdpa", "split", "fused", "flash_attn", "exact")


CPU_DENSE_BELOW = 1024
"""On a CPU, ``auto`` verifies with the dense mask below this prefix length and splits above it (measured crossover)."""

CUDA_DENSE_BELOW = 16384
"""On CUDA without flash-attn, likewise for ``fused`` (on an H200 the dense mask was faster up to 16k, fused at 32k)."""


def auto_backend_name(device: torch.device | str) -> str:
    """``flash_attn`` > ``fused`` on CUDA; ``fused`` on CPU (dense mask below :data:`CPU_DENSE_BELOW`);
    else ``sdpa``."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "flash_attn" if flash_attn_available() else "fused"
    return "fused" if kind == "cpu" else "sdpa"


def static_backend_name(model: Any) -> str:
    """The backend a compiled (static) round verifies through; both run its dense mask. On a CPU ``fused``,
    which hands sdpa the grouped key/value heads: transformers' sdpa copies them out per query head first there
    (a cache's worth of copying per layer and step, in a compiled graph too). Elsewhere ``sdpa``, and for
    attention sinks (which ``fused`` does not run) and sliding windows (transformers 5.0 hands a windowed
    layer's causal calls a mask ``fused`` does not take)."""
    param = next(model.parameters(), None)
    description = describe(model)
    windowed = any(window is not None for window in description.windows.values())
    on_cpu = param is not None and param.device.type == "cpu"
    return "fused" if on_cpu and not description.sinks and not windowed else "sdpa"


def get_backend(
    name: str | None = "sdpa", device: torch.device | str | None = None
) -> TreeAttentionBackend:
    """The tree-verify attention backend called ``name``; one of :data:`BACKENDS` (aliases: ``torch_cuda`` = fused).

    ``"auto"`` resolves at once when ``device`` is given, else at ``prepare(model)``.
    """
    name = _ALIASES.get(name, name)
    if name == "auto":
        return AutoBackend() if device is None else _auto_backend(device)
    return _named_backend(name)


def _auto_backend(device: torch.device | str) -> DenseMaskBackend | SplitBackend:
    """The backend ``"auto"`` picks for ``device``."""
    chosen = _named_backend(auto_backend_name(device))
    assert not isinstance(chosen, ExactBackend)  # "auto" picks attention for numerics="fast"
    if isinstance(chosen, SplitBackend) and chosen.name == "fused":
        chosen.dense_below = {"cpu": CPU_DENSE_BELOW, "cuda": CUDA_DENSE_BELOW}.get(torch.device(device).type, 0)
    return chosen


def _named_backend(name: str | None) -> DenseMaskBackend | SplitBackend | ExactBackend:
    if name == "sdpa":
        return DenseMaskBackend()
    if name == "exact":
        return ExactBackend()
    if name == "flash_attn" and not flash_attn_available():
        raise ValueError("attention='flash_attn' needs the flash-attn package (CUDA); use 'fused' or 'auto' instead")
    if name in IMPLEMENTATIONS:
        return SplitBackend(name)
    raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
