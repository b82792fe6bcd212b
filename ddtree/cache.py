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


def new_target_cache():
    """A cache whose layers keep every position.

    Built without the model config on purpose: sliding-window layer caches
    discard old states and refuse arbitrary compaction, while ddtree applies
    windows through its masks instead.
    """
    from transformers import DynamicCache

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
    if (accepted < 0).any():
        raise ValueError("ragged acceptance across batch rows is not supported yet (found padded indices)")
    contiguous = _is_leading_run(accepted)  # once per round, not once per layer
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "is_linear", False) or hasattr(layer, "recurrent_states"):
            raise ValueError(
                "targets with linear-attention (recurrent) layers are not supported yet: their state "
                "must be kept per tree node"
            )
        if getattr(layer, "is_sliding", False):
            raise ValueError(
                "the target cache has sliding-window layers that discard states; build it with "
                "ddtree.cache.new_target_cache() so every layer keeps all positions"
            )
        keys = getattr(layer, "keys", None)
        if keys is None or keys.numel() == 0:
            continue
        layer.keys = keep_positions(layer.keys, prefix_len, accepted, contiguous)
        layer.values = keep_positions(layer.values, prefix_len, accepted, contiguous)
