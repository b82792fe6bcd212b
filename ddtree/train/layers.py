"""Which target layers a drafter in training reads, and the checks of the flags that choose them.

The published formula (:func:`ddtree.drafters.features.build_target_layer_ids`) stays what loading a
published drafter without ``target_layer_ids`` uses; a run writes its ids into the export's config, so the
choice here never changes how a checkpoint loads. Errors name the training flags
(``--num-feature-layers``, ``--target-layer-ids``, ``--cache-layer-ids``), since a run has no drafter config
to fix yet.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from ddtree.drafters.features import build_target_layer_ids


def default_layer_ids(num_target_layers: int, num_feature_layers: int) -> list[int]:
    """The layers a run reads when ``--target-layer-ids`` is not given.

    The published formula wherever its ids ascend, distinct, and stay below the target's last layer (so the shipped
    recipe keeps its spread: 30 layers -> 1, 10, 18, 27). A shallower target has too few layers for it:
    then ``min(num_feature_layers, L - 1)`` distinct layers spread evenly over 1..L-2, or over 0..L-2
    where 1..L-2 holds too few. The last layer is read only by a one-layer target, which has no other.
    """
    if num_target_layers < 1:
        raise ValueError(f"the target has {num_target_layers} decoder layers: a drafter reads at least one")
    check_num_feature_layers(num_feature_layers)
    last = num_target_layers - 1
    ids = build_target_layer_ids(num_target_layers, num_feature_layers)
    if ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < last:
        return ids
    if last == 0:
        return [0]
    n = min(num_feature_layers, last)  # layers 0..L-2 are the ones below the last
    lo, hi = (1 if last - 1 >= n else 0), last - 1
    if n == 1:
        return [(lo + hi + 1) // 2]
    return [lo + round(k * (hi - lo) / (n - 1)) for k in range(n)]


def check_num_feature_layers(n: int) -> None:
    if n < 1:
        raise ValueError(f"--num-feature-layers {n}: the drafter reads at least one target layer; pass 1 or more "
                         "(the default, 4, is what the shipped drafter reads)")


def check_layer_flags(num_feature_layers: int, target_layer_ids: Sequence[int],
                      cache_layer_ids: Sequence[int]) -> None:
    """What the layer flags must satisfy before the target's depth is known (at argument parsing)."""
    check_num_feature_layers(num_feature_layers)
    for flag, ids in (("--target-layer-ids", target_layer_ids), ("--cache-layer-ids", cache_layer_ids)):
        negative = [i for i in ids if i < 0]
        if negative:
            raise ValueError(f"{flag} {list(ids)}: {negative} are negative; ids count the target's decoder layers "
                             "from 0 (not from the end)")
        repeated = sorted({i for i in ids if list(ids).count(i) > 1})
        if repeated:
            raise ValueError(f"{flag} {list(ids)} repeats {repeated}: give each layer once")
    missing = [i for i in target_layer_ids if cache_layer_ids and i not in cache_layer_ids]
    if missing:
        raise ValueError(f"--target-layer-ids {missing} are not in --cache-layer-ids {list(cache_layer_ids)}: the "
                         "cache must hold every layer the drafter reads; add them, or leave --cache-layer-ids out "
                         "(it defaults to the layers the drafter reads)")


def choose_layer_ids(num_target_layers: int, num_feature_layers: int, target_layer_ids: Sequence[int] = (),
                     cache_layer_ids: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """``(the layers the drafter reads, the layers the cache holds)`` for a target of ``num_target_layers``.

    Raises, naming the flag, when a given id is not a layer of this target; warns when the drafter reads
    the last layer (Hugging Face's last hidden state is after the final norm, vLLM's before it).
    """
    check_layer_flags(num_feature_layers, target_layer_ids, cache_layer_ids)
    last = num_target_layers - 1
    default = default_layer_ids(num_target_layers, num_feature_layers)
    for flag, given in (("--target-layer-ids", target_layer_ids), ("--cache-layer-ids", cache_layer_ids)):
        bad = [i for i in given if i > last]
        if bad:
            raise ValueError(f"{flag} {bad} out of range: the target has {num_target_layers} decoder layers (ids "
                             f"0..{last}); pass ids in that range, or leave {flag} out (the default reads "
                             f"{default} of this target)")
    ids = list(target_layer_ids) or default
    if last in ids:
        why = ("a one-layer target has no other layer" if last == 0 else
               "the default ids avoid it: leave --target-layer-ids out, or pick layers below it")
        warnings.warn(f"target_layer_ids {ids} include the target's last layer ({last}): its Hugging Face hidden "
                      f"state is after the final norm, vLLM's before it, so the drafter will draft poorly in vLLM; "
                      f"{why}", stacklevel=2)
    return ids, list(cache_layer_ids) or list(ids)
