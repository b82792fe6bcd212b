"""Keyed Gumbel noise: a pure function of (row key, position, token id), computed on the device.

A sampled token is ``argmax(processed_logprobs + g)`` (the Gumbel-max rule: an exact draw from the processed
distribution) with ``g = -log(-log(u))`` and ``u`` a counter-based hash of the row's key, the token's position in
its sequence and the token id. Nothing is drawn from an RNG: the same key gives the same noise at a position
whatever was drawn before, so the tokens a seed gives do not depend on how many tree nodes, rows or rounds
there were, and a compiled graph or another rank computes the same noise without sharing state.

The hash is splitmix64's finaliser in wrapping int64 tensor arithmetic, chained over the three coordinates;
``u = (top 53 bits + 1/2) / 2**53`` lies in ``[2**-54, 1 - 2**-54]``, so ``g`` is always finite.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """``x`` modulo 2**64 as a signed int64 (the tensors' wrapping arithmetic is then the unsigned one)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


GOLDEN, MIX1, MIX2 = _signed(_GOLDEN), _signed(_MIX1), _signed(_MIX2)
_CPU_MULTIPLIERS = tuple(torch.tensor(c, dtype=torch.long) for c in (GOLDEN, MIX1, MIX2))


def _multipliers(device: torch.device) -> tuple[int | torch.Tensor, ...]:
    """``(GOLDEN, MIX1, MIX2)`` for arithmetic on ``device``: on a CPU as 0-dim tensors, since inductor's C++
    inlines an int literal into expressions whose int64 wraparound it leaves undefined (under compile=True: heap
    corruption, hangs), while a tensor stays a loaded value; elsewhere as ints (a CUDA graph takes no CPU
    tensor)."""
    return _CPU_MULTIPLIERS if device.type == "cpu" else (GOLDEN, MIX1, MIX2)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic on signed values)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    _, mix1, mix2 = _multipliers(x.device)
    x = (x ^ _shift_right(x, 30)) * mix1
    x = (x ^ _shift_right(x, 27)) * mix2
    return x ^ _shift_right(x, 31)


def _chain(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Hash ``x`` into the running hash ``h`` (a splitmix step from state ``h`` at counter ``x + 1``)."""
    return _mix(h + (x + 1) * _multipliers(x.device)[0])


def _mix_int(x: int) -> int:
    """:func:`_mix` on one Python int (for keys made on the host)."""
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * _MIX1) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * _MIX2) & ((1 << 64) - 1)
    return x ^ (x >> 31)


SEED_LIMIT = 2**64
"""Seeds are ints in ``[0, SEED_LIMIT)``: a key is made from a seed's 64 bits, so a larger or negative seed
would draw the tokens of another seed in the range (``seed % 2**64``'s) while reporting its own."""


def check_seed(seed: object) -> int:
    """``seed`` when it is an int in ``[0, 2**64)``; else an error naming the range and the fix."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"a seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed {seed} is outside [0, 2**64): ddtree keys draws with a seed's 64 bits, so it would "
                         f"draw seed {seed % SEED_LIMIT}'s tokens; pass a seed in range (e.g. seed % 2**64)")
    return seed


def row_key(seed: int, row: int = 0) -> int:
    """The key of row ``row`` under ``seed`` (a signed int64): ``seed=s`` keys row ``b`` of a batch by
    ``row_key(s, b)``; a per-row seed list keys each row by ``row_key(s_b)``, so a one-prompt call with
    ``seed=s`` and a row seeded ``s`` in a list draw the same tokens. ``seed`` lies in ``[0, 2**64)``."""
    check_seed(seed)
    h = _mix_int((seed + _GOLDEN) & ((1 << 64) - 1))
    return _signed(_mix_int((h + (row + 1) * _GOLDEN) & ((1 << 64) - 1)))


def row_keys(seed: int | Sequence[int], rows: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[rows]`` int64 keys: an int seed keys row ``b`` by ``(seed, b)``; a list gives row ``b`` the key of
    ``seed[b]`` alone (its tokens then do not depend on its place in the batch)."""
    if isinstance(seed, int):
        keys = [row_key(seed, b) for b in range(rows)]  # row_key refuses a bool
    else:
        seeds = list(seed)
        if len(seeds) != rows:
            raise ValueError(f"seed has {len(seeds)} entries for {rows} prompts: pass one seed per prompt, "
                             "or one int for the whole batch")
        keys = [row_key(s) for s in seeds]
    return torch.tensor(keys, dtype=torch.long, device=device)


def _token_bits(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[*positions.shape, vocab]`` int64 in ``[0, 2**53)``: the hash of (key, position, token), computed in
    place on one buffer (this runs over the whole vocabulary at every drawn position)."""
    if keys.dim() != 1 or positions.shape[0] != keys.shape[0]:
        raise ValueError(f"keys {tuple(keys.shape)} must be one per row of positions {tuple(positions.shape)}")
    h = _chain(keys.view(-1, *([1] * (positions.dim() - 1))), positions.long()).unsqueeze(-1)
    golden, mix1, mix2 = _multipliers(keys.device)
    x = torch.arange(1, vocab + 1, dtype=torch.long, device=keys.device) * golden + h  # _chain's argument
    spare = torch.empty_like(x)
    for bits, multiplier in ((30, mix1), (27, mix2), (31, None)):  # _mix, in place
        torch.bitwise_right_shift(x, bits, out=spare)
        x.bitwise_xor_(spare.bitwise_and_((1 << (64 - bits)) - 1))
        if multiplier is not None:
            x.mul_(multiplier)
    return x.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1)


def uniforms(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[*positions.shape, vocab]`` float64 uniforms in ``(0, 1)``: ``keys`` ``[B]`` one per row (dim 0 of
    ``positions``), ``positions`` ``[B, ...]`` the sequence index each draw is for."""
    return _token_bits(keys, positions, vocab).double().add_(0.5).mul_(2.0**-53)


def gumbel_noise(keys: torch.Tensor, positions: torch.Tensor, vocab: int,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[*positions.shape, vocab]`` standard Gumbel noise ``-log(-log(u))`` (see :func:`uniforms`). A token's
    noise is the same bits however many positions are drawn at once (``tests/test_keyed_sampling.py`` checks
    it on several threads: torch's float64 log gives its scalar tail and its vector blocks the same bits)."""
    return uniforms(keys, positions, vocab).log_().neg_().log_().neg_().to(dtype)


def keyed_argmax(logprobs: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One Gumbel-max draw per position from ``logprobs`` ``[B, ..., V]`` (``-inf`` where filtered): the token
    maximising ``logprobs + g(key, position, token)``; ``positions`` ``[B, ...]`` matches ``logprobs[..., 0]``."""
    noise = gumbel_noise(keys, positions.expand(logprobs.shape[:-1]), logprobs.shape[-1], logprobs.dtype)
    return (logprobs + noise).argmax(dim=-1)
