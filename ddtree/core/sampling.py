"""The target's decoding rule: temperature, top-k and top-p applied to logits, and the draw from them.

The same processing serves the verifier (one choice per tree node) and plain
decoding, so speculative and target-only sampling draw from one distribution.
The order follows HF ``generate``: temperature, then top-k, then top-p. A keyed draw
(:mod:`ddtree.core.noise`) is a pure function of the row's key and the token's position, so a tree node and
the plain decoder at the same position draw the same token from the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.core.noise import gumbel_noise, keyed_argmax


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature == 0`` means greedy (argmax; ties go to the lowest token id)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature is None or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive int or None, got {self.top_k!r}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingConfig()
"""The greedy rule (frozen, so one shared default is safe)."""


def processed_logprobs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Log-probs of the processed distribution (float32, ``-inf`` where filtered), over the last dim.

    Greedy (temperature 0) is the point mass on the argmax (lowest id on ties).
    """
    if cfg.greedy:
        x = torch.full(logits.shape, float("-inf"), dtype=torch.float32, device=logits.device)
        return x.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 0.0)
    x = logits.float() / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < x.shape[-1]:
        kth = x.topk(cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= 1.0 - cfg.top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.log_softmax(dim=-1)


LOG_SOFTMAX_CHUNK = 1 << 20
"""Elements per slice of :func:`log_softmax_inplace`: its scratch is a few MB however wide the vocabulary."""


def log_softmax_inplace(x: torch.Tensor) -> torch.Tensor:
    """``x.log_softmax(-1)`` written into ``x`` a few rows at a time, so a vocabulary-wide block needs no second
    copy (a 15-position block of a 152k vocabulary is 9 MB of float32). Each row's arithmetic is the one
    ``log_softmax`` does: the bits are the same."""
    if x.numel() == 0:
        return x
    flat = x.view(-1, x.shape[-1])
    step = max(1, LOG_SOFTMAX_CHUNK // x.shape[-1])
    for start in range(0, flat.shape[0], step):
        rows = flat[start : start + step]
        rows.copy_(rows.log_softmax(dim=-1))
    return x


ARGMAX_BLOCK = 512
"""Vocabulary entries per block of :func:`greedy_tokens`' two-step argmax on a CPU."""


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``. On a CPU, torch's argmax compares one element at a time (about 1 ns each: 0.3 ms
    for a batch-12 step over a 49k vocabulary) while its max is vectorised, so the index is found in two steps:
    the first block of :data:`ARGMAX_BLOCK` whose max is the row's (the argmax of the block maxima), then the
    first entry of that block that is. The same index: ties go to the first, the first NaN wins."""
    if logits.device.type != "cpu" or logits.shape[-1] < 2 * ARGMAX_BLOCK or logits.numel() == 0:
        return logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    # half-width types widened first (exact): torch's max over them converts each element on its own
    rows = logits.reshape(-1, vocab)
    rows = rows.float() if rows.dtype in (torch.bfloat16, torch.float16) else rows
    whole = vocab - vocab % ARGMAX_BLOCK
    blocks = rows[:, :whole].unflatten(-1, (-1, ARGMAX_BLOCK))
    maxima = blocks.amax(-1)  # exact: a max rounds nothing, and a NaN in a block makes its max NaN
    which = maxima.argmax(-1)
    ids = which * ARGMAX_BLOCK + blocks[torch.arange(rows.shape[0]), which].argmax(-1)
    if whole < vocab:  # the last partial block wins only above the rest, or as the first NaN
        tail = rows[:, whole:]
        best, last = maxima.gather(1, which[:, None])[:, 0], tail.amax(-1)
        ids = torch.where((last > best) | (last.isnan() & ~best.isnan()), tail.argmax(-1) + whole, ids)
    return ids.view(logits.shape[:-1])


def choose_tokens(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None, *,
                  keys: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """One token per position of ``logits`` ``[B, ..., V]``: the argmax under greedy; else a keyed draw when
    ``keys`` ``[B]`` and ``positions`` ``[B, ...]`` (the sequence index of each chosen token) are given, or one
    independent draw from ``generator``."""
    if cfg.greedy:
        return greedy_tokens(logits)
    if keys is not None:
        if positions is None:
            raise ValueError("a keyed draw needs the positions of the tokens it chooses (positions=)")
        return keyed_argmax(processed_logprobs(logits, cfg), keys, positions)
    probs = processed_logprobs(logits, cfg).exp()
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def coupled_logprobs(logprobs: torch.Tensor, cfg: SamplingConfig, keys: torch.Tensor,
                     start: torch.Tensor) -> torch.Tensor:
    """A drafter's per-depth log-probs ``[B, D, V]`` at the target's temperature, plus the noise the target
    draws with at the same positions (depth ``d + 1`` after a root at ``start``: position ``start + d + 1``),
    renormalised. Their argmax is the drafter's own keyed sample, which is the target's token whenever the two
    distributions agree, so a tree built from them puts first what the target will pick. Top-k and top-p are
    not applied: the drafter's top-k is not the target's, and cutting it cost acceptance. Greedy: unchanged."""
    if cfg.greedy:
        return logprobs
    depth = logprobs.shape[1]
    positions = start.view(-1, 1).to(logprobs.device) + torch.arange(1, depth + 1, device=logprobs.device)
    tempered = logprobs.float() / cfg.temperature  # no top-k/top-p: the drafter's top-k is not the target's
    return (tempered + gumbel_noise(keys, positions, logprobs.shape[-1])).log_softmax(-1)
