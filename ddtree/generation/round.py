"""``speculative_round(state)``: one step of a generation, the loop body every caller shares.

The first call prefills the prompts and emits each row's first token (the drafter takes in the
prompt's last chunk at the start of the next round, so the token does not wait for it). Every
later call runs one round for the active rows:

1. ``draft.propose(roots)``: per-depth log-probs after each row's root;
2. ``policy.choose`` and :func:`~ddtree.drafters.base.proposal_tree`: one tree per row (the
   builder's pairwise form when the proposal carries pairwise scores, grafted paths added);
3. the backend's tree-attention kwargs (rows padded in the cache get a dense mask);
4. one target forward over every row's tree, at positions ``length + depth``;
5. ``verify_tree``: each row's accepted path and bonus token;
6. one host read: each row's accepted count, bonus, path and path tokens (one packed tensor), from which
   the host knows every row's new length; nothing else in a round waits for the device;
7. ``commit_accepted``: compact the cache per row; the drafter context gets
   the accepted nodes' features.

With budget 0 (no policy) a round is one plain decode step per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from ddtree.budget.policy import BudgetPolicy
from ddtree.core.masks import tree_position_ids
from ddtree.core.sampling import choose_tokens
from ddtree.core.tree import SOURCE_NAMES, DraftTree, root_only
from ddtree.core.verify import VerifyResult, verify_tree
from ddtree.drafters.base import DraftContext, check_proposal, proposal_tree
from ddtree.generation.prefill import prefill_padded
from ddtree.generation.state import DecodeState, RoundRecord, RoundResult
from ddtree.targets.cache import (
    cache_length,
    check_cache_length,
    commit_accepted,
    new_target_cache,
    padding_mask,
    stack_rows,
    truncate_front,
)
from ddtree.targets.cache import select_rows as select_cache_rows
from ddtree.targets.description import describe
from ddtree.targets.forward import chunked_prefill, target_forward


def speculative_round(state: DecodeState) -> RoundResult:
    """Advance ``state`` by one round (the prefill on the first call); returns what each row committed."""
    if state.done:
        raise RuntimeError("this generation is finished: every row has stopped")
    with torch.inference_mode():
        if not state.prefilled:
            return _prefill(state)
        if state.policy is None:
            return _plain_step(state)
        return _tree_round(state, state.policy)


def _prefill(state: DecodeState) -> RoundResult:
    gen, timer = state.generator, state.timer
    target = gen.target
    device = target.get_input_embeddings().weight.device
    host_lengths = [len(p) for p in state.prompts]
    lengths = torch.tensor(host_lengths, dtype=torch.long, device=device)
    width = max(host_lengths)
    padded = len(set(host_lengths)) > 1
    ids = torch.full((len(state.prompts), width), gen.pad_token_id, dtype=torch.long, device=device)
    for b, p in enumerate(state.prompts):
        ids[b, width - len(p):] = p.to(device)
    state.cache = new_target_cache(target)
    state.host_lengths = host_lengths
    plain = state.policy is None
    hidden = not plain and gen.drafter.needs_hidden_states
    with timer.stage("prefill"):
        if not plain:
            state.draft = gen.drafter.new_context(len(state.prompts))
        if padded and not describe(target).padded_prefill_exact:
            last = _prefill_each_row(state, hidden, width)
        else:
            append = None if plain else (lambda features, tokens, counts, last_chunk, host_counts:
                                         _to_context(state, last_chunk, features, tokens, counts, host_counts))
            last = prefill_padded(target, ids, lengths, state.cache, drafter=gen.drafter, append=append,
                                  chunk_size=state.prefill_chunk, host_lengths=host_lengths)
        roots = gen.lockstep.share(choose_tokens(last.to(device), state.sampling, state.rng))
    state.lengths, state.roots, state.prefilled = lengths, roots, True
    first = roots.tolist()
    tokens: list[list[int]] = [[] for _ in state.prompts]
    for i, row in enumerate(state.active):
        tokens[row] = state.emit(row, [first[i]])
    return _finish_round(state, tokens, [None] * len(state.prompts))


def _to_context(state: DecodeState, last: bool, features: torch.Tensor | None, tokens: torch.Tensor,
                counts: torch.Tensor | None, host_counts: list[int] | None) -> None:
    """A prefill chunk's append to the drafter context: at once, or for a prompt's last chunk after the first
    token is out (:meth:`DecodeState.catch_up_draft`)."""
    if last:
        state.deferred.append((features, tokens, counts, host_counts))
    else:
        state.append_draft(features, tokens, counts, host_counts)


def _prefill_each_row(state: DecodeState, hidden: bool, width: int) -> torch.Tensor:
    """Prefill the prompts one by one and stack the caches, for a target whose stateful layers a left-padded
    batch forward leaves inexact (GDN: see ``padded_prefill_exact`` of its kind): each row's state is then
    exactly its batch-1 prefill's. Each chunk's features go to the drafter
    context as that row's alone (the other rows append nothing). Returns the last logits ``[B, V]``."""
    gen = state.generator
    target = gen.target
    rows = len(state.prompts)
    caches: list[Any] = []
    last: list[torch.Tensor] = []
    for b, prompt in enumerate(state.prompts):

        def to_drafter(start: int, end: int, out: Any, b: int = b, prompt: torch.Tensor = prompt) -> None:
            if state.draft is None:
                return
            t = end - start
            tokens = torch.zeros((rows, t), dtype=torch.long, device=prompt.device)
            tokens[b] = prompt[start:end]
            counts = torch.zeros(rows, dtype=torch.long, device=prompt.device)
            counts[b] = t
            host_counts = [0] * rows
            host_counts[b] = t
            features = None
            if hidden:
                own = gen.drafter.context_features(out.hidden_states)
                assert own is not None  # a drafter that needs hidden states returns features
                features = own.new_zeros((rows, *own.shape[1:]))
                features[b] = own[0]
            _to_context(state, end == len(prompt), features, tokens, counts, host_counts)

        cache = new_target_cache(target)
        logits = chunked_prefill(target, prompt.view(1, -1), cache, state.prefill_chunk, hidden=hidden,
                                 layers=gen.drafter.target_layer_ids if hidden else None, on_chunk=to_drafter)
        caches.append(cache)
        last.append(logits)
    state.cache = stack_rows(caches, [len(p) for p in state.prompts])
    check_cache_length(state.cache, width, "prefill")
    return torch.cat(last)


def _plain_step(state: DecodeState) -> RoundResult:
    target, cache = state.generator.target, state.cache
    lengths, roots = cast(torch.Tensor, state.lengths), cast(torch.Tensor, state.roots)  # set by the prefill
    width = cache_length(cache)
    with state.timer.stage("verify"):
        if all(n == width for n in state.host_lengths):
            out = target_forward(target, roots.view(-1, 1), None, cache, hidden=False, last=1)
        else:
            valid = torch.cat([padding_mask(lengths, width), torch.ones_like(lengths[:, None], dtype=torch.bool)], 1)
            out = target_forward(target, roots.view(-1, 1), lengths[:, None], cache, hidden=False, last=1,
                                 attention_mask=valid.long())
        check_cache_length(cache, width + 1, "decode step")
        logits = out.logits[:, -1].to(roots.device)
        roots = state.generator.lockstep.share(choose_tokens(logits, state.sampling, state.rng))
    state.roots = roots
    state.lengths = lengths + 1
    state.host_lengths = [n + 1 for n in state.host_lengths]
    state.rounds += 1
    chosen = roots.tolist()  # the step's one host read
    tokens: list[list[int]] = [[] for _ in state.prompts]
    acceptance: list[int | None] = [None] * len(state.prompts)
    for i, row in enumerate(state.active):
        acceptance[row] = 1
        state.acceptance[row].append(1)
        tokens[row] = state.emit(row, [chosen[i]])
    return _finish_round(state, tokens, acceptance)


def _tree_round(state: DecodeState, policy: BudgetPolicy) -> RoundResult:
    """Draft, build, verify and commit one tree per active row."""
    draft = cast(DraftContext, state.catch_up_draft())  # made by the prefill whenever there is a policy
    context = max(state.host_lengths)
    with state.timer.stage("calibration"):
        policy.prepare(context, len(state.active))
    tree = _draft_tree(state, policy, draft, context)
    out, result, verify_seconds = _verify(state, tree)
    with state.timer.stage("commit"):
        accepted = _read_accepted(tree, result)
        _commit(state, tree, out, result, accepted)
    _count_sources(state, accepted)
    emitted = _emit_accepted(state, tree, accepted, result)
    policy.observe([a for a in emitted.acceptance if a is not None], verify_seconds, context)
    finish = getattr(policy, "finish", None)  # a policy not derived from BudgetPolicy may lack it
    if state.done and finish is not None:
        finish()
    return emitted


def _draft_tree(state: DecodeState, policy: BudgetPolicy, draft: DraftContext, context: int) -> DraftTree:
    """This round's trees: the drafter's proposal built under the policy's budget (lookup branches grafted in),
    or the roots alone while the policy says no tree pays (rank 0 decides both under tensor parallelism)."""
    gen, roots = state.generator, cast(torch.Tensor, state.roots)  # set by the prefill
    if gen.lockstep.share(bool(policy.skip_draft)):
        state.budgets.append(0)
        return root_only(roots)
    with state.timer.stage("draft"):
        proposal = check_proposal(draft.propose(roots), draft)
    with state.timer.stage("tree_build"):
        size = gen.lockstep.share(policy.choose(proposal.logprobs, context))  # each rank's clock differs
        tree = proposal_tree(proposal, roots, gen.builder, size)
    state.budgets.append(size)
    return tree


def _verify(state: DecodeState, tree: DraftTree) -> tuple[Any, VerifyResult, float]:
    """One target forward over every row's tree at positions ``length + depth``, then the acceptance walk.
    Returns the forward's output, the :class:`VerifyResult` and the verify forward's seconds."""
    gen, cache, lengths = state.generator, state.cache, cast(torch.Tensor, state.lengths)  # set by the prefill
    width = cache_length(cache)
    with state.timer.stage("mask"):
        uniform = all(n == width for n in state.host_lengths)  # rows padded in the cache need a dense mask
        extra = {} if uniform else {"prefix_valid": padding_mask(lengths, width)}
        kwargs = gen.backend.tree_forward_kwargs(gen.target, tree, width, gen.dtype, **extra)
        positions = tree_position_ids(tree.depths, width if uniform else lengths)
    before = state.timer.seconds["verify"]
    with state.timer.stage("verify"):
        try:
            out = target_forward(gen.target, tree.tokens, positions, cache,
                                 hidden=gen.drafter.needs_hidden_states, layers=gen.drafter.target_layer_ids,
                                 **kwargs)
        except RuntimeError:  # a mask sized for a prefix the forward never saw fails inside attention: say why
            check_cache_length(cache, width + tree.num_nodes, "verify forward")
            raise
        check_cache_length(cache, width + tree.num_nodes, "verify forward")
        logits = out.logits.to(tree.tokens.device)
        # accepted padded to the tree's nodes, so the walk needs no read: the round reads once, after it
        result = gen.lockstep.share(verify_tree(tree, logits, state.sampling, state.rng, length=tree.num_nodes))
    return out, result, state.timer.seconds["verify"] - before


@dataclass
class AcceptedOnHost:
    """A round's one host read: per active row, the accepted count (root included), the bonus token, the
    accepted node indices and their tokens (root first), and their proposers' flags when the tree has them."""

    counts: list[int]
    bonus: list[int]
    paths: list[list[int]]
    tokens: list[list[int]]
    sources: list[list[int]] | None


def _read_accepted(tree: DraftTree, result: VerifyResult) -> AcceptedOnHost:
    """Read each row's accepted count, bonus, path and path tokens back in one packed tensor."""
    n = tree.num_nodes
    device = tree.tokens.device
    path = result.accepted.clamp(min=0)
    parts = [result.num_accepted[:, None], result.bonus[:, None], result.accepted, tree.tokens.gather(1, path)]
    if tree.sources is not None:
        parts.append(tree.sources.gather(1, path))
    rows = torch.cat([p.to(device=device, dtype=torch.long) for p in parts], dim=1).tolist()
    counts = [r[0] for r in rows]
    return AcceptedOnHost(
        counts=counts,
        bonus=[r[1] for r in rows],
        paths=[r[2 : 2 + c] for r, c in zip(rows, counts)],
        tokens=[r[2 + n : 2 + n + c] for r, c in zip(rows, counts)],
        sources=None if tree.sources is None else [r[2 + 2 * n : 2 + 2 * n + c] for r, c in zip(rows, counts)],
    )


def _commit(state: DecodeState, tree: DraftTree, out: Any, result: VerifyResult, host: AcceptedOnHost) -> None:
    """Keep each row's accepted nodes in the target cache and give their features to the drafter context
    (everything sized and branched from ``host``: no read)."""
    gen = state.generator
    width = cache_length(state.cache) - tree.num_nodes
    accepted = result.accepted[:, : max(host.counts)]  # [A, L]: rows past their count hold -1
    uniform = all(n == width for n in state.host_lengths)
    commit_accepted(state.cache, width, accepted, None if uniform else state.lengths, paths=host.paths,
                    host_lengths=state.host_lengths)
    path = accepted.clamp(min=0)
    features = gen.drafter.context_features(out.hidden_states) if gen.drafter.needs_hidden_states else None
    if features is not None:
        features = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
    state.append_draft(features, tree.tokens.gather(1, path), result.num_accepted, host.counts)


def _count_sources(state: DecodeState, host: AcceptedOnHost) -> None:
    """Accepted draft tokens by the proposer that put them in the tree (when the tree says)."""
    if host.sources is None:
        return
    for flags in host.sources:
        for flag in flags[1:]:
            state.accepted_by_source[SOURCE_NAMES[flag]] += 1


def _emit_accepted(state: DecodeState, tree: DraftTree, host: AcceptedOnHost, result: VerifyResult) -> RoundResult:
    """Emit each row's accepted tokens and bonus token, record the round, and advance the row tensors."""
    tokens: list[list[int]] = [[] for _ in state.prompts]
    acceptance: list[int | None] = [None] * len(state.prompts)
    for i, row in enumerate(state.active):
        count = host.counts[i]
        acceptance[row] = count
        state.acceptance[row].append(count)
        if state.record:
            state.records[row].append(RoundRecord(state.host_lengths[i], tree.row(i), host.paths[i], host.bonus[i]))
        tokens[row] = state.emit(row, host.tokens[i][1:] + [host.bonus[i]])
    lengths = cast(torch.Tensor, state.lengths)  # set by the prefill
    state.lengths = lengths + result.num_accepted.to(lengths.device)
    state.host_lengths = [n + c for n, c in zip(state.host_lengths, host.counts)]
    state.roots = result.bonus
    state.rounds += 1
    return _finish_round(state, tokens, acceptance)


def _finish_round(state: DecodeState, tokens: list[list[int]], acceptance: list[int | None]) -> RoundResult:
    """Drop rows that finished this round from the cache, the drafter context and the row tensors."""
    finished = [row for row in state.active if state.finished[row]]
    if finished:
        keep = [i for i, row in enumerate(state.active) if not state.finished[row]]
        state.active = [state.active[i] for i in keep]
        if keep:
            lengths, roots = cast(torch.Tensor, state.lengths), cast(torch.Tensor, state.roots)  # set by the prefill
            index = torch.tensor(keep, dtype=torch.long, device=lengths.device)
            select_cache_rows(state.cache, index)
            draft = state.draft
            if draft is not None:
                state.catch_up_draft()
                draft.select_rows(index)
            state.lengths = lengths.index_select(0, index)
            state.host_lengths = [state.host_lengths[i] for i in keep]
            state.roots = roots.index_select(0, index.to(roots.device))
            _trim_leading_padding(state)
        else:
            state.cache = state.draft = None  # nothing left to decode: free the memory now
            state.deferred.clear()
    return RoundResult(tokens, acceptance, finished)


def _trim_leading_padding(state: DecodeState) -> None:
    """Drop cache columns that are padding in every remaining row."""
    extra = cache_length(state.cache) - max(state.host_lengths)
    if extra > 0:
        truncate_front(state.cache, extra)
