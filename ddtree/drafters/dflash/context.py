"""``DFlashContext``: one generation's DFlash drafter state, the per-layer keys/values of its committed context."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

import torch

from ddtree.drafters.base import DraftContext, Proposal
from ddtree.drafters.dflash.static_context import StaticDFlashContext

if TYPE_CHECKING:
    from ddtree.drafters.features import FeatureDrafter


class _BlockHead(Protocol):
    """The DFlash drafter's head, as :meth:`DFlashContext.propose` calls it (a protocol: the drafter module
    imports this one)."""

    def block_logprobs(self, hidden: torch.Tensor) -> torch.Tensor: ...


class DFlashContext(DraftContext):
    """The DFlash drafter's per-generation state: each layer's keys/values of the committed context.

    Row ``b``'s context fills buffer columns ``0 .. lengths[b] - 1`` (column =
    token position) of a full layer's buffer. Buffers grow by doubling, so
    appending a round's tokens copies only those tokens, never the whole context.
    Block entries are never stored: nothing has to be cropped after a round.

    A sliding layer keeps only what its window can still show a block: a block's
    queries sit at ``lengths[b]`` and after, so keys before
    ``min(lengths) - sliding_window + 1`` are dropped (``front`` of them; its
    column ``c`` holds position ``front + c``), in steps of at least a window so
    the shift is paid once per window of tokens. Its memory is then bounded by the
    window, not the context.
    """

    trim_sliding = True  # False keeps every sliding-layer key (the tests compare both)

    def __init__(self, drafter: FeatureDrafter, batch_size: int = 1) -> None:
        self.drafter = drafter
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # [B, Hkv, capacity + 1, d]; the last is scratch
        self.lengths = torch.zeros(batch_size, dtype=torch.long)
        self.host_lengths = [0] * batch_size  # the same, on the host: buffers are sized and sliced from these
        config = drafter.config
        windowed = [a for a in config.resolve_attention() if a.window is not None]
        self.sliding = [a.index for a in windowed]  # layers whose window hides old context keys
        self.window = max((a.window for a in windowed), default=None)
        self.front = 0  # positions dropped from the sliding layers' buffers

    @property
    def capacity(self) -> int:
        """Positions a full layer's buffer holds (with sliding layers only: the positions up to the
        sliding buffers' end)."""
        if self.kv is None:
            return 0
        return max(k.shape[2] - 1 + off for (k, _), off in zip(self.kv, self._offsets()))

    def _offsets(self) -> list[int]:
        """Per layer, the position of its buffer's column 0."""
        return [self.front if i in self.sliding else 0 for i in range(len(self.drafter.config.layer_types))]

    def nbytes(self) -> int:
        """Bytes held by the context buffers."""
        return 0 if self.kv is None else sum(k.numel() * k.element_size() * 2 for k, _ in self.kv)

    @torch.no_grad()
    def append(self, features: torch.Tensor | None, tokens: torch.Tensor | None = None,
               counts: torch.Tensor | None = None, host_counts: Sequence[int] | None = None) -> None:
        """Take in the target features of each row's committed tokens (``counts[b]`` of row ``b``; give them as
        ``host_counts`` too when known on the host, and the append reads nothing back from the device)."""
        if features is None:
            raise ValueError("the DFlash drafter needs target features for every committed token")
        bsz, t, _ = features.shape
        if bsz != self.lengths.numel():
            raise ValueError(f"features are for {bsz} rows, the context has {self.lengths.numel()}")
        if t == 0:
            return
        model = self.drafter.model
        device = features.device
        self.lengths = self.lengths.to(device)
        if counts is None:
            counts, host_counts = torch.full((bsz,), t, dtype=torch.long, device=device), [t] * bsz
        else:
            counts = counts.to(device)
            host_counts = counts.tolist() if host_counts is None else list(host_counts)
        positions = self.lengths[:, None] + torch.arange(t, device=device)  # [B, T]
        new = model.context_kv(model.project_context(features), positions)
        ends = [n + c for n, c in zip(self.host_lengths, host_counts)]
        kv = self._reserve(max(ends), new)
        uniform = all(c == t for c in host_counts) and len(set(self.host_lengths)) == 1
        for (kb, vb), (k, v), off in zip(kv, new, self._offsets()):
            if uniform:
                at = self.host_lengths[0] - off
                kb[:, :, at : at + t] = k
                vb[:, :, at : at + t] = v
                continue
            scratch = kb.shape[2] - 1
            cols = torch.where(torch.arange(t, device=device) < counts[:, None], positions - off, scratch)
            idx = cols[:, None, :, None].expand(bsz, k.shape[1], t, k.shape[-1])
            kb.scatter_(2, idx, k)
            vb.scatter_(2, idx, v)
        self.lengths = self.lengths + counts
        self.host_lengths = ends
        self._trim()

    def _reserve(self, need: int,
                 like: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Room for positions up to ``need`` in every layer's buffer (each grown by doubling); returns the buffers."""
        grown: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, ((k, v), off) in enumerate(zip(like, self._offsets())):
            old = None if self.kv is None else self.kv[i]
            cap = 0 if old is None else old[0].shape[2] - 1
            if old is not None and need - off <= cap:
                grown.append(old)
                continue
            bsz, heads, _, dim = k.shape
            size = max(need - off, 2 * cap, 64)
            kb = k.new_zeros(bsz, heads, size + 1, dim)
            vb = v.new_zeros(bsz, heads, size + 1, v.shape[-1])
            if old is not None:
                kb[:, :, :cap] = old[0][:, :, :cap]
                vb[:, :, :cap] = old[1][:, :, :cap]
            grown.append((kb, vb))
        self.kv = grown
        return grown

    def _trim(self) -> None:
        """Drop the sliding layers' keys no block can see any more (once a window's worth has piled up)."""
        window = self.window
        if not self.sliding or not self.trim_sliding or self.kv is None or window is None:
            return
        front = max(0, min(self.host_lengths) - window + 1)
        drop = front - self.front
        if drop < max(window, 64):
            return
        for i in self.sliding:
            k, v = self.kv[i]
            keep = k.shape[2] - 1 - drop
            shifted = []
            for buf in (k, v):
                out = torch.zeros_like(buf)
                out[:, :, :keep] = buf[:, :, drop : drop + keep]
                shifted.append(out)
            self.kv[i] = (shifted[0], shifted[1])
        self.front = front

    def select_rows(self, rows: torch.Tensor, host_rows: Sequence[int] | None = None) -> None:
        """Keep ``rows``; ``host_rows``, the same as ints, spares reading them from the device."""
        keep = rows.tolist() if host_rows is None else host_rows
        self.host_lengths = [self.host_lengths[i] for i in keep]
        self.lengths = self.lengths.index_select(0, rows.to(self.lengths.device))
        if self.kv is not None:
            self.kv = [(k.index_select(0, rows.to(k.device)), v.index_select(0, rows.to(v.device))) for k, v in self.kv]

    def to_static(self, capacity: int) -> StaticDFlashContext:
        """This context's keys and values in fixed buffers of ``capacity`` positions per row (column =
        position), for the static round. Keys a sliding layer dropped stay zero there: its window hides them."""
        if self.kv is None:
            raise RuntimeError("the drafter has no context yet: append the prompt's target features first")
        if capacity < max(self.host_lengths):
            raise ValueError(f"capacity {capacity} is below the longest row's {max(self.host_lengths)} positions")
        kv = []
        for (k, v), off in zip(self.kv, self._offsets()):
            kb = k.new_zeros(k.shape[0], k.shape[1], capacity, k.shape[3])
            vb = v.new_zeros(v.shape[0], v.shape[1], capacity, v.shape[3])
            end = min(k.shape[2] - 1 + off, capacity)  # the last column of a buffer is its scratch
            kb[:, :, off:end] = k[:, :, : end - off]
            vb[:, :, off:end] = v[:, :, : end - off]
            kv.append((kb, vb))
        return StaticDFlashContext(self.drafter, kv)

    @torch.no_grad()
    def propose(self, root_tokens: torch.Tensor, depth: int | None = None) -> Proposal:
        """Log-probs ``[B, block_size - 1, V]`` for positions ``lengths + 1 ..``, in float32; with ``depth``,
        the first ``depth`` of them only (the block's forward is the same: its positions see each other, and
        the LM head, the costliest part at a batch, scores only what the tree can use)."""
        if self.kv is None or 0 in self.host_lengths:
            raise RuntimeError("the drafter has no context yet: append the prompt's target features first")
        drafter = self.drafter
        model = drafter.model
        embed = drafter._target_parts[0]
        root_tokens = root_tokens.view(-1, 1)
        bsz = root_tokens.shape[0]
        size = drafter.block_size
        device = root_tokens.device
        lengths = self.lengths.to(device)
        block = torch.cat([root_tokens, root_tokens.new_full((bsz, size - 1), drafter.mask_token_id)], dim=1)
        block_pos = lengths[:, None] + torch.arange(size, device=device)
        width = max(self.host_lengths)
        ragged = len(set(self.host_lengths)) > 1
        offsets = self._offsets()
        kv = [(k[:, :, : width - off], v[:, :, : width - off]) for (k, v), off in zip(self.kv, offsets)]
        key_mask = None
        if ragged:  # ragged rows: hide each row's unused columns from every layer
            col = torch.arange(width, device=device)
            key_mask = torch.cat([col[None] < lengths[:, None], torch.ones_like(block_pos, dtype=torch.bool)], dim=1)
            key_mask = key_mask[:, None, None]  # [B, 1, 1, S]; each layer adds its own rule by position
        hidden = model(model.embed_block(block, embed), block_pos, context_kv=kv, key_mask=key_mask,
                       context_offsets=offsets, contiguous=not ragged)[:, 1:]
        if depth is not None:
            hidden = hidden[:, :max(1, depth)]
        return Proposal(cast(_BlockHead, drafter).block_logprobs(hidden))  # DFlash2Context has its own propose
