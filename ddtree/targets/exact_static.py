"""The exact decode forward as one torch operator, so that ``compile=True`` keeps ``numerics="exact"``.

Traced, a target's layers would become torch's own ops, and inductor generates its own kernels for each shape:
a tree of N nodes and a one-token step would reduce in different orders, and their bits would part. Under exact
numerics the compiled static round calls ``torch.ops.ddtree.exact_decode`` instead: one opaque operator that
runs :func:`~ddtree.targets.exact_forward.forward_packed` (the embedding, the rotary table, every decoder layer
in one C call, the norm and the head) eagerly, on the static round's row-packed cache, appending to it in place.
It is the eager exact round's code and kernels, so the compiled round's tokens are the eager round's, bit for
bit, and a compiled graph holds no copy of the cache. It takes the families :mod:`~ddtree.targets.exact_forward`
takes with every decoder layer taken (:func:`unavailable` says why not, for the rest); :class:`ExactDecode`
is what a compiled step calls.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, cast

import torch

from ddtree.targets import exact_forward
from ddtree.targets.exact_attention import key_ranges

_LIBRARY = torch.library.Library("ddtree", "FRAGMENT")  # noqa: TOR901 (a plain CPU kernel, no autograd formula)
_LIBRARY.define("exact_decode(int model, Tensor input_ids, Tensor position_ids, Tensor(a!)[] keys, "
                "Tensor(b!)[] values, Tensor lengths, Tensor visibility, Tensor depths, int[] layers) "
                "-> (Tensor, Tensor)")

_MODELS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_HANDLE = "_ddtree_exact_handle"
_NEXT = itertools.count(1)


def may_take(model: Any) -> bool:
    """Whether ``model``'s class is one the exact forward takes whole, before it is prepared (:func:`unavailable`
    says for certain after)."""
    return type(model).__name__ in exact_forward.FAMILIES


def unavailable(model: Any) -> str | None:
    """Why the compiled round cannot run ``model`` with exact numerics (its forward is not one the exact
    forward takes whole), or None."""
    if exact_forward.taken(model) is None:
        return (f"{type(model).__name__}'s decode forward is not one the exact kernels run whole (they take "
                f"{', '.join(exact_forward.FAMILIES)} with every decoder layer taken and no hooks on their parts)")
    return None


def check(model: Any) -> None:
    """Refuse ``compile=True`` with exact numerics for ``model`` where the operator cannot run it, with the way out."""
    why = unavailable(model)
    if why is not None:
        raise ValueError(f"compile=True with numerics='exact' runs the target's forward as one exact operator, and "
                         f"{why}. Pass numerics='fast' to compile it, or compile=False")


def handle(model: Any) -> int:
    """The operator's number for ``model`` (made once; the model is held weakly)."""
    number = vars(model).get(_HANDLE)
    if number is None or _MODELS.get(number) is not model:
        number = next(_NEXT)
        vars(model)[_HANDLE] = number
        _MODELS[number] = model
    return number


def _model(number: int) -> Any:
    model = _MODELS.get(number)
    if model is None:
        raise RuntimeError("exact_decode: its model is gone (the compiled steps outlived their generator)")
    return model


def _exact_decode(number: int, input_ids: torch.Tensor, position_ids: torch.Tensor, keys: list[torch.Tensor],
                  values: list[torch.Tensor], lengths: torch.Tensor, visibility: torch.Tensor, depths: torch.Tensor,
                  layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    model = _model(number)
    ends = lengths[:, None]

    def ranges(window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        start, visible = key_ranges(visibility, depths, ends, None, window)
        return start.to(torch.int64).contiguous(), visible.to(torch.uint8).contiguous()

    out = exact_forward.forward_packed(model, input_ids, position_ids, list(zip(keys, values)), lengths, ranges,
                                       layers)
    if out is None:
        raise RuntimeError(f"exact_decode: the exact forward no longer takes {type(model).__name__} (a hook or a "
                           "forward added to its layers since the steps were compiled?); build a new generator")
    logits, hidden = out
    kept = [h for h in hidden or () if h is not None]
    return logits, torch.stack(kept) if kept else logits.new_empty(0)


def _exact_decode_shape(number: int, input_ids: torch.Tensor, position_ids: torch.Tensor, keys: list[torch.Tensor],
                        values: list[torch.Tensor], lengths: torch.Tensor, visibility: torch.Tensor,
                        depths: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    model = _model(number)
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    bsz, n = input_ids.shape
    logits = input_ids.new_empty(bsz, n, head.shape[0], dtype=head.dtype)
    if not layers:
        return logits, logits.new_empty(0)
    return logits, input_ids.new_empty(len(set(layers)), bsz, n, embed.shape[1], dtype=embed.dtype)


_LIBRARY.impl("exact_decode", _exact_decode, "CPU")
torch.library.register_fake("ddtree::exact_decode", _exact_decode_shape, lib=_LIBRARY)


class ExactDecode:
    """One target's exact forward through row-packed buffers as the operator call, for a compiled step: made
    outside the graph (the model's number and layer count are constants of the trace)."""

    def __init__(self, model: Any) -> None:
        check(model)
        self.number = handle(model)
        self.num_layers = cast(int, exact_forward.taken(model))

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, keys: list[torch.Tensor],
                 values: list[torch.Tensor], lengths: torch.Tensor, visibility: torch.Tensor, depths: torch.Tensor,
                 layers: list[int] | None) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...] | None]:
        """Logits of every input position and the hidden states ``layers`` names (HF indexing: id ``i`` at
        ``i + 1``, ``None`` elsewhere; None without ``layers``) of an exact forward through row-packed
        ``keys``/``values`` (row ``b``: ``lengths[b]`` committed columns, the forward's tokens written after
        them; ``visibility`` ``[B, N, N]`` ancestors-or-self, ``depths`` ``[B, N]``)."""
        ids = sorted({int(i) for i in layers or ()})
        logits, stacked = torch.ops.ddtree.exact_decode(self.number, input_ids, position_ids, keys, values,
                                                        lengths, visibility, depths, ids)
        if layers is None:
            return logits, None
        kept: list[torch.Tensor | None] = [None] * (self.num_layers + 1)
        for i, j in enumerate(ids):
            kept[j + 1] = stacked[i]
        return logits, tuple(kept)
