"""What a proposer is: the ``Drafter`` and ``DraftContext`` protocols, the ``Proposal`` every context returns,
and the one way a proposal becomes a tree (:func:`proposal_tree`).

A drafter holds weights and settings only; each generation asks it for a fresh
context (``new_context``), so one drafter serves any number of interleaved
generations. Subclass the protocols to inherit the defaults of their optional
parts; the generator checks a drafter for every part before it decodes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ddtree.core.builders import TreeBuilder
from ddtree.core.graft import Branches, HostPaths, graft_paths
from ddtree.core.noise import gumbel_noise
from ddtree.core.pairwise import PairwiseScores, pairwise_builder
from ddtree.core.sampling import SamplingConfig, coupled_logprobs
from ddtree.core.tree import DraftTree


@dataclass
class Proposal:
    """One round's proposal for each row.

    ``logprobs`` ``[B, D, V]``: a distribution per depth after the root, for the
    tree builder. ``paths`` (optional): branches from each row's root that
    :func:`ddtree.core.graft.graft_paths` adds to the built tree under the same
    budget, as :class:`~ddtree.core.graft.Branches` (device tensors: prompt lookup's)
    or per-row ``(tokens, cumulative scores)`` lists. ``pairwise``
    (optional): scores of each depth's candidates given the token before them
    (a DFlash2 selector); the round then grows the tree from them with the
    builder's pairwise form (:func:`ddtree.core.pairwise.pairwise_builder`), and
    ``logprobs`` is the per-depth view along the greedy path.
    """

    logprobs: torch.Tensor
    paths: Branches | HostPaths | None = None
    pairwise: PairwiseScores | None = None

    @property
    def has_paths(self) -> bool:
        """Whether there are branches to graft (from shapes for :class:`Branches`: no read)."""
        if isinstance(self.paths, Branches):
            return not self.paths.empty
        return self.paths is not None and any(self.paths)


class DraftContext(Protocol):
    """One generation's drafter state: what each row has committed so far.

    Rows are the active rows of a batch. ``append`` takes left-aligned
    ``features`` ``[B, T, F]`` (``None`` for a drafter that reads none) and
    ``tokens`` ``[B, T]`` of the tokens each row just committed, of which row
    ``b`` has ``counts[b]`` (default all ``T``). To a context whose ``append`` takes ``host_counts``, the
    round also passes the counts as Python ints, which it has read anyway: the context sizes and slices with
    those instead of reading ``counts`` back from the device (on a GPU every such read waits for the
    device). A context without that parameter is called without it.
    """

    def append(self, features: torch.Tensor | None, tokens: torch.Tensor, counts: torch.Tensor | None = None,
               host_counts: Sequence[int] | None = None) -> None:
        ...

    def propose(self, root_tokens: torch.Tensor, depth: int | None = None) -> Proposal:
        """The proposal for the positions after each row's root (``root_tokens`` ``[B]`` or ``[B, 1]``). To a
        context whose ``propose`` takes ``depth``, the round passes the deepest position its tree can use
        (``None``: any): it may score only that many (at least one); one without the parameter is called
        without it."""
        ...

    def select_rows(self, rows: torch.Tensor, host_rows: Sequence[int] | None = None) -> None:
        """Keep only these rows (the others finished); ``host_rows``, the same rows as Python ints, is passed
        only to a context whose signature has it (an older context without it still works)."""
        ...


class StaticDraftContext(Protocol):
    """A drafter context in fixed buffers, for the static (compiled) round: every shape follows from the batch,
    the capacity and the block, never from values, and nothing is read back from the device.

    Row ``b``'s committed context fills positions ``0 .. lengths[b] - 1``; the round passes ``lengths`` (a
    device tensor) to each call. ``append`` writes ``T`` positions per row at ``lengths .. lengths + T - 1``
    whatever the row accepted: positions past the row's new length are stale, hidden from ``propose`` and
    overwritten later. ``reserve`` (on the host, outside the compiled step) makes room for ``capacity``
    positions."""

    capacity: int

    def propose(self, root_tokens: torch.Tensor, lengths: torch.Tensor) -> Proposal: ...

    def append(self, features: torch.Tensor | None, tokens: torch.Tensor, lengths: torch.Tensor) -> None: ...

    def reserve(self, capacity: int) -> None: ...


class Drafter(Protocol):
    """What a round needs from a drafter: which target features to read, and a fresh context per generation.

    ``needs_hidden_states`` (default ``True``): ``False`` lets the target keep
    no hidden states in any forward (a model-free proposer). ``target_layer_ids``
    are the target layers whose outputs the round keeps: ``context_features``
    gets HF's ``hidden_states`` layout (``num_layers + 1`` entries, layer ``i`` at
    ``i + 1``, the last one after the final norm) with only those entries set,
    the others ``None``, so the prefill and verify never hold every layer.
    ``cpu_linear_model`` (default ``None``): a module of the drafter's whose linear layers the generator's
    ``cpu_linear`` routes along with the target's (its forward is a few-row forward too).
    """

    block_size: int
    target_layer_ids: list[int]
    needs_hidden_states: bool = True
    cpu_linear_model: torch.nn.Module | None = None

    def context_features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The target features this drafter reads, ``[B, T, F]``, from a forward's ``hidden_states``
        (its ``target_layer_ids`` entries set, the rest ``None``)."""
        ...

    def new_context(self, batch_size: int = 1) -> DraftContext:
        ...


DRAFTER_PARTS = ("block_size", "target_layer_ids", "needs_hidden_states", "context_features", "new_context")
OPTIONAL_DRAFTER_PARTS = ("cpu_linear_model",)  # read with a default; a subclass of Drafter inherits it


def takes_host_counts(context: DraftContext) -> bool:
    """Whether ``context.append`` takes ``host_counts`` (by name, or through ``**kwargs``)."""
    return _takes(context.append, "host_counts")


def takes_host_rows(context: DraftContext) -> bool:
    """Whether ``context.select_rows`` takes ``host_rows`` (by name, or through ``**kwargs``)."""
    return _takes(context.select_rows, "host_rows")


def propose_to_depth(context: DraftContext, root_tokens: torch.Tensor, depth: int | None) -> Proposal:
    """``context.propose(root_tokens)``, with ``depth`` where it takes one (see :class:`DraftContext`)."""
    if depth is not None and _takes(context.propose, "depth"):
        return context.propose(root_tokens, depth=depth)
    return context.propose(root_tokens)


def _takes(method: Any, name: str) -> bool:
    function = getattr(method, "__func__", None)  # a bound method's function: read its signature once
    return _function_takes(function, name) if inspect.isfunction(function) else _signature_takes(method, name)


@functools.lru_cache(maxsize=256)
def _function_takes(function: Any, name: str) -> bool:
    return _signature_takes(function, name)


def _signature_takes(method: Any, name: str) -> bool:
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def check_drafter(drafter: object) -> None:
    """Refuse, by name, a drafter that lacks a part of the protocol (before any state is built)."""
    missing = [name for name in DRAFTER_PARTS if not hasattr(drafter, name)]
    if missing:
        raise TypeError(f"{type(drafter).__name__} is not a ddtree Drafter: it lacks {', '.join(missing)}; "
                        "subclass ddtree.Drafter (which gives needs_hidden_states=True) or define them")


def check_proposal(proposal: object, context: object | None = None) -> Proposal:
    """``proposal`` when it is a :class:`Proposal`; else a TypeError that says how to wrap what was returned
    (at once, not as an AttributeError inside the round)."""
    if isinstance(proposal, Proposal):
        return proposal
    who = f"{type(context).__name__}.propose" if context is not None else "propose"
    what = type(proposal).__name__
    hint = ("wrap the log-probs: return Proposal(logprobs=logprobs) ([B, D, V], one distribution per depth after "
            "the root; from ddtree import Proposal)")
    raise TypeError(f"{who} returned a {what}, not a ddtree Proposal: {hint}")


def coupled_proposal(proposal: Proposal, cfg: SamplingConfig, keys: torch.Tensor, start: torch.Tensor) -> Proposal:
    """``proposal`` with its scores perturbed by the target's keyed noise (:func:`coupled_logprobs`): a pairwise
    proposal's candidates get the noise of their own token at their depth. Grafted paths are kept as they are.
    The output does not depend on this (verification reads only the tree); under sampling, acceptance does."""
    if cfg.greedy:
        return proposal
    logprobs = coupled_logprobs(proposal.logprobs, cfg, keys, start)
    scores = proposal.pairwise
    if scores is not None:
        depth = scores.candidates.shape[1]
        positions = start.view(-1, 1).to(scores.first.device) + torch.arange(1, depth + 1, device=scores.first.device)
        noise = gumbel_noise(keys, positions, logprobs.shape[-1]).gather(-1, scores.candidates.long())  # [B, D, K]
        first = (scores.first.float() / cfg.temperature + noise[:, 0]).log_softmax(-1)
        table = (scores.table.float() / cfg.temperature + noise[:, 1:, None, :]).log_softmax(-1)
        scores = PairwiseScores(scores.candidates, first, table)
    return Proposal(logprobs, proposal.paths, scores)


def proposal_rows(proposal: Proposal, rows: Sequence[int]) -> Proposal:
    """The proposal of ``rows`` only (a batch's live rows): every part indexed on its own device, host paths by
    list."""
    index = torch.tensor(list(rows), device=proposal.logprobs.device)  # one copy to the device for every part

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, index.to(t.device))

    paths = proposal.paths
    if isinstance(paths, Branches):
        paths = Branches(pick(paths.tokens), pick(paths.scores), pick(paths.lengths))
    elif paths is not None:
        paths = [paths[r] for r in rows]
    scores = proposal.pairwise
    if scores is not None:
        scores = PairwiseScores(pick(scores.candidates), pick(scores.first), pick(scores.table))
    return Proposal(pick(proposal.logprobs), paths, scores)


def proposal_tree(proposal: Proposal, root_tokens: torch.Tensor, builder: TreeBuilder, budget: int,
                  built: DraftTree | None = None) -> DraftTree:
    """The tree a proposal asks for under ``budget`` draft nodes: :func:`built_tree`, then ``proposal.paths``
    grafted in under the same budget (:func:`~ddtree.core.graft.graft_paths`: the built tree's first path
    kept, the branches competing with the rest and taking the room it leaves)."""
    tree = built_tree(proposal, root_tokens, builder, budget, built)
    if proposal.paths is not None and proposal.has_paths:
        tree = graft_paths(tree, proposal.paths, budget)
    return tree


def built_tree(proposal: Proposal, root_tokens: torch.Tensor, builder: TreeBuilder, budget: int,
               built: DraftTree | None = None) -> DraftTree:
    """The drafter's own tree under ``budget``, before any graft: ``builder``'s pairwise form over
    ``proposal.pairwise`` when both exist (each child scored given its own parent), else ``builder`` over the
    per-depth ``logprobs`` (or ``built``, that tree when the caller has it already)."""
    scores = proposal.pairwise
    pairwise = None if scores is None else pairwise_builder(builder)
    if pairwise is not None and scores is not None:
        return pairwise(root_tokens, scores, budget)
    return builder(root_tokens, proposal.logprobs, budget) if built is None else built
