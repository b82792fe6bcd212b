"""``speculative_round(state)``: one step of a generation, the loop body every caller shares.

The first call prefills the prompts and emits each row's first token (the drafter takes in the
prompt's last chunk at the start of the next round, so the token does not wait for it). Every
later call runs one round for the active rows:

1. ``draft.propose(roots)``: per-depth log-probs after each row's root;
2. under sampling, the proposal coupled to the target's keyed noise
   (:func:`~ddtree.drafters.base.coupled_proposal`); ``policy.choose`` and
   :func:`~ddtree.drafters.base.proposal_tree`: one tree per row (the
   builder's pairwise form when the proposal carries pairwise scores, grafted paths added);
3. the backend's tree-attention kwargs (rows padded in the cache get a dense mask);
4. one target forward over every row's tree, at positions ``length + depth``;
5. ``verify_tree``: each row's accepted path and bonus token;
6. one host read: each row's accepted count, bonus, path and path tokens (one packed tensor), from which
   the host knows every row's new length; nothing else in a round waits for the device;
7. ``commit_accepted``: compact the cache per row; the drafter context gets
   the accepted nodes' features;
8. ``state.stats.observe`` counts the round from the host read; each row's tokens are emitted.

With budget 0 (no policy) a round is one plain decode step per row.
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch

from ddtree.budget.policy import BudgetPolicy
from ddtree.core.builders import best_first
from ddtree.core.masks import tree_position_ids
from ddtree.core.sampling import choose_tokens
from ddtree.core.tree import DraftTree, root_only
from ddtree.core.verify import VerifyResult, verify_tree
from ddtree.drafters.base import (
    DraftContext,
    check_proposal,
    coupled_proposal,
    proposal_rows,
    proposal_tree,
    propose_to_depth,
)
from ddtree.generation.accepted import AcceptedOnHost, emit_accepted, observe_accepted, pack_accepted, unpack_accepted
from ddtree.generation.prefill import prefill_each_row, prefill_padded
from ddtree.generation.state import DecodeState, RoundResult
from ddtree.generation.static_round import StaticRows, static_budget, static_round, to_static
from ddtree.targets.cache import (
    cache_length,
    check_cache_length,
    commit_accepted,
    new_target_cache,
    padding_mask,
    truncate_front,
)
from ddtree.targets.description import describe
from ddtree.targets.forward import target_forward

HELD_BACK_MOST = 64
"""Appends to the drafter context that rounds without a tree hold back before taking them in as one pass: the
pass reads the drafter's projections once instead of once per round, and the held features stay bounded."""


def speculative_round(state: DecodeState) -> RoundResult:
    """Advance ``state`` by one round (the prefill on the first call); returns what each row committed."""
    if state.done:
        raise RuntimeError("this generation is finished: every row has stopped")
    with torch.inference_mode():
        if not state.rows.prefilled:
            return _prefill(state)
        if state.generator.compile:
            return _static_tree_round(state)
        if state.policy is None:
            return _plain_step(state)
        return _tree_round(state, state.policy)


def _static_tree_round(state: DecodeState) -> RoundResult:
    """A tree round as the static, compiled steps (``compile=True``; see :mod:`ddtree.generation.static_round`):
    a fixed budget's, plain decoding's (``tree_budget=0``), or under ``"auto"`` the policy's choice among the
    compiled ladder's budgets."""
    gen, held = state.generator, state.on_device
    if held.static is None:
        held.static = to_static(state)
    rows = cast(StaticRows, held.static)
    if state.policy is None:
        return static_round(state, gen.static_steps(0, state.sampling, drafting=False), rows)
    budget = static_budget(state)
    if budget is not None:
        return static_round(state, gen.static_steps(budget, state.sampling), rows)
    policy = cast(BudgetPolicy, state.policy)  # static_budget: an adaptive policy
    context, live = max(state.rows.host_lengths), len(state.rows.active)
    with state.timer.stage("calibration"):
        policy.prepare(context, live)
    keys = rows.keys if state.coupled_drafts else None
    if policy.skip_draft:
        steps = gen.static_steps(0, state.sampling)
        tree = None
    else:
        steps = gen.static_steps(1, state.sampling)  # any rung's propose step: it does not depend on the budget
        if steps.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the round's one CUDA-graph generation starts here
        with state.timer.stage("draft"):
            proposal = steps.propose(rows.draft, rows.roots, rows.lengths, keys)
        with state.timer.stage("tree_build"):
            live_rows = proposal_rows(proposal, rows.slots)  # finished rows ride along unpriced
            steps = gen.static_steps(chosen_budget(policy, policy.choose(live_rows, context)), state.sampling)
            tree = steps.build(proposal, rows.roots)
    result = static_round(state, steps, rows, tree, policy.reason)
    policy.observe([a for a in result.acceptance if a is not None], state.timer.last("verify"), context)
    if state.done:
        policy.finish()
    return result


def _prefill(state: DecodeState) -> RoundResult:
    gen, timer, rows, held = state.generator, state.timer, state.rows, state.on_device
    target = gen.target
    device = target.get_input_embeddings().weight.device
    host_lengths = [len(p) for p in rows.prompts]
    lengths = torch.tensor(host_lengths, dtype=torch.long, device=device)
    width = max(host_lengths)
    padded = len(set(host_lengths)) > 1
    ids = torch.full((rows.batch_size, width), gen.pad_token_id, dtype=torch.long, device=device)
    for b, p in enumerate(rows.prompts):
        ids[b, width - len(p):] = p.to(device)
    held.cache = new_target_cache(target)
    rows.host_lengths = host_lengths
    plain = state.policy is None
    with timer.stage("prefill"):
        if not plain:
            held.draft = gen.drafter.new_context(rows.batch_size)
        append = None if plain else (lambda features, tokens, counts, last_chunk, host_counts:
                                     _to_context(state, last_chunk, features, tokens, counts, host_counts))
        if describe(target).prefill_rows_alone(rows.batch_size, padded, width):
            held.cache, last = prefill_each_row(target, rows.prompts, drafter=gen.drafter, append=append,
                                                chunk_size=state.prefill_chunk)
            check_cache_length(held.cache, width, "prefill")
        else:
            last = prefill_padded(target, ids, lengths, held.cache, drafter=gen.drafter, append=append,
                                  chunk_size=state.prefill_chunk, host_lengths=host_lengths)
        roots = gen.lockstep.share(choose_tokens(last.to(device), state.sampling, keys=held.keys,
                                                 positions=lengths))
    held.lengths, held.roots, rows.prefilled = lengths, roots, True
    first = roots.tolist()
    tokens: list[list[int]] = [[] for _ in rows.prompts]
    for i, row in enumerate(rows.active):
        tokens[row] = rows.emit(row, [first[i]])
    return _finish_round(state, tokens, [None] * rows.batch_size)


def _to_context(state: DecodeState, last: bool, features: torch.Tensor | None, tokens: torch.Tensor,
                counts: torch.Tensor | None, host_counts: list[int] | None) -> None:
    """A prefill chunk's append to the drafter context: at once, or for a prompt's last chunk after the first
    token is out (:meth:`DecodeState.catch_up_draft`)."""
    if last:
        state.on_device.deferred.append((features, tokens, counts, host_counts))
    else:
        state.on_device.append_draft(features, tokens, counts, host_counts)


def _plain_step(state: DecodeState) -> RoundResult:
    rows, held = state.rows, state.on_device
    target, cache = state.generator.target, held.cache
    lengths, roots = cast(torch.Tensor, held.lengths), cast(torch.Tensor, held.roots)  # set by the prefill
    width = cache_length(cache)
    with state.timer.stage("verify"):
        if all(n == width for n in rows.host_lengths):
            out = target_forward(target, roots.view(-1, 1), None, cache, hidden=False, last=1)
        else:
            valid = torch.cat([padding_mask(lengths, width), torch.ones_like(lengths[:, None], dtype=torch.bool)], 1)
            out = target_forward(target, roots.view(-1, 1), lengths[:, None], cache, hidden=False, last=1,
                                 attention_mask=valid.long())
        check_cache_length(cache, width + 1, "decode step")
        logits = out.logits[:, -1].to(roots.device)
        roots = state.generator.lockstep.share(choose_tokens(logits, state.sampling, keys=held.keys,
                                                             positions=lengths + 1))
    held.roots = roots
    held.lengths = lengths + 1
    rows.host_lengths = [n + 1 for n in rows.host_lengths]
    chosen = roots.tolist()  # the step's one host read
    state.stats.observe(rows.active, [1] * len(rows.active))
    tokens: list[list[int]] = [[] for _ in rows.prompts]
    acceptance: list[int | None] = [None] * rows.batch_size
    for i, row in enumerate(rows.active):
        acceptance[row] = 1
        tokens[row] = rows.emit(row, [chosen[i]])
    return _finish_round(state, tokens, acceptance)


def _tree_round(state: DecodeState, policy: BudgetPolicy) -> RoundResult:
    """Draft, build, verify and commit one tree per active row."""
    context = max(state.rows.host_lengths)
    with state.timer.stage("calibration"):
        policy.prepare(context, len(state.rows.active))
    skip = state.generator.lockstep.share(bool(policy.skip_draft))  # rank 0 decides under tensor parallelism
    if skip and not state.stats.record:  # (a recorded round keeps its root-only tree)
        return _root_round(state, policy, context)
    tree, budget = _draft_tree(state, policy, context, skip)
    out, result = _verify(state, tree)
    with state.timer.stage("commit"):
        accepted = _read_accepted(tree, result)
        _commit(state, tree, out, result, accepted)
    _observe(state, tree, accepted, budget, policy.reason)
    emitted = _emit_accepted(state, accepted, result)
    verify_seconds = state.timer.last("verify")  # after the host read: on CUDA its events are complete
    policy.observe([a for a in emitted.acceptance if a is not None], verify_seconds, context)
    if state.done:
        policy.finish()
    return emitted


def _root_round(state: DecodeState, policy: BudgetPolicy, context: int) -> RoundResult:
    """A round the policy does not draft, as the plain step runs it (no tree mask, walk or commit), keeping
    the target features the drafter context takes in when a later round drafts; the same token a root-only
    tree's verify gives (the same logits under exact numerics, the same draw at ``length + 1``)."""
    gen, rows, held = state.generator, state.rows, state.on_device
    cache, lengths, roots = held.cache, cast(torch.Tensor, held.lengths), cast(torch.Tensor, held.roots)
    width = cache_length(cache)
    hidden = gen.drafter.needs_hidden_states
    with state.timer.stage("verify"):
        extra: dict[str, Any] = {}
        positions = None
        if not all(n == width for n in rows.host_lengths):
            positions = lengths[:, None]
            extra["attention_mask"] = torch.cat([padding_mask(lengths, width),
                                                 torch.ones_like(lengths[:, None], dtype=torch.bool)], 1).long()
        out = target_forward(gen.target, roots.view(-1, 1), positions, cache, hidden=hidden, last=1,
                             layers=gen.drafter.target_layer_ids, **extra)
        check_cache_length(cache, width + 1, "decode step")
        bonus = gen.lockstep.share(choose_tokens(out.logits[:, -1].to(roots.device), state.sampling,
                                                 keys=held.keys, positions=lengths + 1))
    with state.timer.stage("commit"):  # the drafter context's append waits for a round that drafts
        features = gen.drafter.context_features(cast(Any, out.hidden_states)) if hidden else None
        ones = torch.ones_like(lengths)
        held.deferred.append((features, roots.view(-1, 1), ones, [1] * len(rows.active)))
        if len(held.deferred) >= HELD_BACK_MOST:
            state.catch_up_draft()
    chosen = bonus.tolist()  # the round's one host read
    n = len(rows.active)
    state.stats.observe(rows.active, [1] * n, budget=0, sources=None, records=None, reason=policy.reason, nodes=0)
    tokens, acceptance = emit_accepted(state, AcceptedOnHost([1] * n, chosen, [[0]] * n, [[0]] * n, None))
    held.lengths, held.roots = lengths + 1, bonus
    result = _finish_round(state, tokens, acceptance)
    policy.observe([a for a in acceptance if a is not None], state.timer.last("verify"), context)
    if state.done:
        policy.finish()
    return result


def _draft_tree(state: DecodeState, policy: BudgetPolicy, context: int, skip: bool) -> tuple[DraftTree, int]:
    """This round's trees and budget: the drafter's proposal built under the policy's budget (lookup branches
    grafted in), or the roots alone while the policy says no tree pays (rank 0 decides both under tensor
    parallelism). Only a drafting round takes in the drafter context's held-back appends."""
    gen, roots = state.generator, cast(torch.Tensor, state.on_device.roots)  # set by the prefill
    if skip:
        return root_only(roots), 0
    draft = cast(DraftContext, state.catch_up_draft())  # made by the prefill whenever there is a policy
    with state.timer.stage("draft"):
        # the deepest position a tree can use this round (best-first: the budget's): the drafter scores no more
        deepest = getattr(policy, "deepest", None)
        depth = gen.lockstep.share(deepest(context, len(state.rows.active))
                                   if deepest is not None and gen.builder is best_first else None)
        proposal = check_proposal(propose_to_depth(draft, roots, depth), draft)
        keys = state.on_device.keys
        if keys is not None and state.coupled_drafts:  # rank by the target's own noise (the tokens stay the same)
            proposal = coupled_proposal(proposal, state.sampling, keys, cast(torch.Tensor, state.on_device.lengths))
    with state.timer.stage("tree_build"):
        size = gen.lockstep.share(chosen_budget(policy, policy.choose(proposal, context)))  # ranks' clocks differ
        built = policy.tree(proposal, roots, size, gen.builder)  # grown while choosing, if it was
        tree = proposal_tree(proposal, roots, gen.builder, size, built)
    return tree, size


def chosen_budget(policy: BudgetPolicy, value: Any) -> int:
    """A policy's choice as an int (a numpy or 0-dim tensor integer is one), refused here, naming the policy,
    when it is not a budget."""
    try:
        budget = operator.index(value)
    except TypeError:
        budget = -1
    if budget < 0 or isinstance(value, bool):
        raise ValueError(f"{type(policy).__name__}.choose returned {value!r}: a tree budget is an int >= 0 (draft "
                         "nodes this round; 0 is a root-only round)")
    return budget


def _verify(state: DecodeState, tree: DraftTree) -> tuple[Any, VerifyResult]:
    """One target forward over every row's tree at positions ``length + depth``, then the acceptance walk.
    Returns the forward's output and the :class:`VerifyResult`."""
    held = state.on_device
    gen, cache, lengths = state.generator, held.cache, cast(torch.Tensor, held.lengths)  # set by the prefill
    width = cache_length(cache)
    with state.timer.stage("mask"):
        uniform = all(n == width for n in state.rows.host_lengths)  # rows padded in the cache need a dense mask
        extra = {} if uniform else {"prefix_valid": padding_mask(lengths, width)}
        kwargs = gen.backend.tree_forward_kwargs(gen.target, tree, width, gen.dtype, **extra)
        positions = tree_position_ids(tree.depths, width if uniform else lengths)
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
        result = gen.lockstep.share(verify_tree(tree, logits, state.sampling, length=tree.num_nodes,
                                                keys=held.keys, start=lengths))
    return out, result


def _read_accepted(tree: DraftTree, result: VerifyResult) -> AcceptedOnHost:
    """Read each row's accepted count, bonus, path and path tokens back in one packed tensor."""
    return unpack_accepted(pack_accepted(tree, result).tolist(), tree)  # the round's one host read


def _commit(state: DecodeState, tree: DraftTree, out: Any, result: VerifyResult, host: AcceptedOnHost) -> None:
    """Keep each row's accepted nodes in the target cache and give their features to the drafter context
    (everything sized and branched from ``host``: no read)."""
    gen, held, host_lengths = state.generator, state.on_device, state.rows.host_lengths
    width = cache_length(held.cache) - tree.num_nodes
    accepted = result.accepted[:, : max(host.counts)]  # [A, L]: rows past their count hold -1
    uniform = all(n == width for n in host_lengths)
    commit_accepted(held.cache, width, accepted, None if uniform else held.lengths, paths=host.paths,
                    host_lengths=host_lengths)
    path = accepted.clamp(min=0)
    features = gen.drafter.context_features(out.hidden_states) if gen.drafter.needs_hidden_states else None
    if features is not None:
        features = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
    append = (features, tree.tokens.gather(1, path), result.num_accepted, host.counts)
    if tree.num_nodes == 1:  # a round that did not draft: its append waits for the next one that does
        state.on_device.deferred.append(append)
        if len(state.on_device.deferred) >= HELD_BACK_MOST:
            state.catch_up_draft()
    else:
        state.on_device.append_draft(*append)


def _observe(state: DecodeState, tree: DraftTree, host: AcceptedOnHost, budget: int, reason: str) -> None:
    """Count the round from its one host read (:func:`observe_accepted`, shared with the static round), with the
    policy's reason for its budget."""
    observe_accepted(state, tree, host, budget, reason=reason)


def _emit_accepted(state: DecodeState, host: AcceptedOnHost, result: VerifyResult) -> RoundResult:
    """Emit each row's accepted tokens and bonus token (:func:`emit_accepted`, shared with the static round),
    and advance the row tensors."""
    tokens, acceptance = emit_accepted(state, host)
    held = state.on_device
    lengths = cast(torch.Tensor, held.lengths)  # set by the prefill
    held.lengths = lengths + result.num_accepted.to(lengths.device)
    held.roots = result.bonus
    return _finish_round(state, tokens, acceptance)


def _finish_round(state: DecodeState, tokens: list[list[int]], acceptance: list[int | None]) -> RoundResult:
    """Drop rows that finished this round from the cache, the drafter context and the row tensors."""
    rows = state.rows
    finished = [row for row in rows.active if rows.finished[row]]
    if finished:
        keep = rows.drop_finished()
        if keep:
            state.catch_up_draft()  # the held-back prompt chunk still has every row
            state.on_device.select_rows(keep)
            _trim_leading_padding(state)
        else:
            state.on_device.release()
    return RoundResult(tokens, acceptance, finished)


def _trim_leading_padding(state: DecodeState) -> None:
    """Drop cache columns that are padding in every remaining row."""
    extra = cache_length(state.on_device.cache) - max(state.rows.host_lengths)
    if extra > 0:
        truncate_front(state.on_device.cache, extra)
