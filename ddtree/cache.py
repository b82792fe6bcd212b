"""KV-cache compaction after a verify round.

After the tree forward the target cache holds ``[prefix | all tree nodes]``.
:func:`commit_accepted` keeps the prefix and exactly the accepted nodes, in path
order. It is the one place every cache kind goes through, so version quirks of
transformers' cache classes stay here.
"""

from __future__ import annotations

import functools
import inspect

import torch

SUPPORTED_TRANSFORMERS = ">=5.0,<6"
"""The transformers versions ddtree is exact on (kept equal to pyproject.toml's range by a test)."""


class CacheNotUpdatedError(RuntimeError):
    """The target forward did not fill the cache it was given: continuing would decode without the prefix."""


@functools.lru_cache(maxsize=None)
def _cache_keyword(forward_owner: type) -> str:
    params = inspect.signature(forward_owner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """The keyword that passes ``cache`` to ``model``'s forward: ``cache=`` on transformers that renamed it,
    ``past_key_values=`` before (5.0 to 5.17 at least). An unknown keyword is swallowed by ``**kwargs``, so
    guessing wrong would silently drop the cache; :func:`check_cache_length` catches what this misses."""
    return {_cache_keyword(type(model)): cache}


def check_cache_length(cache, expected: int, step: str) -> None:
    """Raise :class:`CacheNotUpdatedError` unless ``cache`` holds ``expected`` positions after ``step``."""
    got = cache_length(cache)
    if got != expected:
        import transformers

        raise CacheNotUpdatedError(
            f"after the {step} the target cache holds {got} positions, expected {expected}: the target's forward "
            f"did not use the cache ddtree passed. Installed transformers {transformers.__version__}; ddtree "
            f"supports transformers{SUPPORTED_TRANSFORMERS} with models whose forward takes `cache=` or "
            "`past_key_values=`. Install a supported version, or pass the cache keyword your model expects."
        )


def new_target_cache(model=None):
    """A cache whose attention layers keep every position (and, for a hybrid GDN target, state slots).

    Attention layers are built without sliding-window caches on purpose: those discard
    old states and refuse arbitrary compaction, while ddtree applies windows through its
    masks instead. Pass ``model`` for targets with linear-attention layers, which need
    their conv/recurrent slots (see :mod:`ddtree.linear_attention`).
    """
    from transformers import DynamicCache

    if model is not None:
        from .linear_attention import gdn_modules, new_hybrid_cache

        if gdn_modules(model):
            return new_hybrid_cache(model)
    return DynamicCache()


def cache_length(cache) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


def keep_positions(
    tensor: torch.Tensor, prefix_len: int, accepted: torch.Tensor, contiguous: bool | None = None
) -> torch.Tensor:
    """``tensor[..., :prefix_len, :]`` followed by the tree rows ``accepted`` (``[B, L]`` node indices).

    Works on ``[B, heads, T, d]`` states. When the accepted nodes are the first
    ``L`` tree rows in order (always true for a chain) this is a slice, not a copy.
    """
    bsz, length = accepted.shape
    if bsz != tensor.shape[0]:
        raise ValueError(f"accepted indices are for {bsz} rows, the cache has {tensor.shape[0]}")
    if contiguous is None:
        contiguous = _is_leading_run(accepted)
    if contiguous:
        return tensor[..., : prefix_len + length, :]
    index = (prefix_len + accepted).to(tensor.device)  # [B, L]
    index = index[:, None, :, None].expand(bsz, tensor.shape[1], length, tensor.shape[-1])
    return torch.cat([tensor[..., :prefix_len, :], tensor.gather(2, index)], dim=2)


def _is_leading_run(accepted: torch.Tensor) -> bool:
    return bool((accepted == torch.arange(accepted.shape[1], device=accepted.device)).all())


def commit_accepted(cache, prefix_len: int, accepted: torch.Tensor) -> None:
    """Keep the committed prefix plus the accepted tree nodes in every layer of ``cache``, in place.

    ``accepted`` is ``[B, L]``: node indices along the accepted path, root first.
    Rows of a batch must accept the same number of nodes until ragged batches land.
    """
    if accepted.dim() != 2:
        raise ValueError(f"accepted must be [batch, length], got shape {tuple(accepted.shape)}")
    from .linear_attention import commit_linear_states, has_pending

    if (accepted < 0).any():
        # GDN layers already commit ragged rows (commit_linear_states); attention layers do not yet.
        raise ValueError("ragged acceptance across batch rows is not supported yet (found padded indices)")
    kv_layers = _kv_layers(cache)
    if has_pending(cache):
        commit_linear_states(cache, accepted)  # GDN layers: per row, from each row's own last accepted node
    elif _has_linear_layers(cache):
        raise ValueError(
            "the target cache has linear-attention (GDN) layers but the verify forward left no per-node state: "
            "transformers' own GDN forward would have mixed sibling nodes. Prepare the target with "
            "ddtree.linear_attention.prepare(model) and pass the backend's tree_forward_kwargs "
            "(SpeculativeGenerator does)"
        )
    contiguous = _is_leading_run(accepted)  # once per round, not once per layer
    for keys, values, store in kv_layers:
        if keys is None or keys.numel() == 0:
            continue
        store(keep_positions(keys, prefix_len, accepted, contiguous),
              keep_positions(values, prefix_len, accepted, contiguous))


def _has_linear_layers(cache) -> bool:
    layers = getattr(cache, "layers", None)
    if layers is None:
        return any(c is not None for c in getattr(cache, "conv_states", []))
    return any(hasattr(layer, "recurrent_states") for layer in layers)


def _kv_layers(cache) -> list[tuple]:
    """``(keys, values, store(keys, values))`` for every attention layer; refuses caches ddtree cannot compact."""
    found = []
    layers = getattr(cache, "layers", None)
    if layers is None and hasattr(cache, "key_cache"):  # transformers 5.0's Qwen3NextDynamicCache: plain lists
        for i in range(len(cache.key_cache)):
            def store(k, v, i=i):
                cache.key_cache[i], cache.value_cache[i] = k, v
            found.append((cache.key_cache[i], cache.value_cache[i], store))
        return found
    for layer in layers or []:
        if getattr(layer, "is_sliding", False):
            raise ValueError(
                "the target cache has sliding-window layers that discard states; build it with "
                "ddtree.new_target_cache(model) so every layer keeps all positions"
            )
        if hasattr(layer, "recurrent_states") and not hasattr(layer, "keys"):
            continue  # a GDN layer: committed by commit_linear_states, which needs the verify's pending inputs
        def store(k, v, layer=layer):
            layer.keys, layer.values = k, v
        found.append((getattr(layer, "keys", None), getattr(layer, "values", None), store))
    return found
