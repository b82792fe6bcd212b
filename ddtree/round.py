"""``speculative_round(state)``: one step of a generation, the loop body every caller shares.

The first call prefills the prompts and emits each row's first token. Every
later call runs one round for the active rows:

1. ``draft.propose(roots)``: per-depth log-probs after each row's root;
2. ``policy.choose`` and ``builder(roots, logprobs, budget)``: one tree per row;
3. the backend's tree-attention kwargs (rows padded in the cache get a dense mask);
4. one target forward over every row's tree, at positions ``length + depth``;
5. ``verify_tree``: each row's accepted path and bonus token;
6. ``commit_accepted``: compact the cache per row; the drafter context gets
   the accepted nodes' features.

With budget 0 (no policy) a round is one plain decode step per row.
"""

from __future__ import annotations

import torch

from .cache import (
    cache_kwargs,
    cache_length,
    check_cache_length,
    commit_accepted,
    new_target_cache,
    padding_mask,
    stack_rows,
    truncate_front,
)
from .cache import select_rows as select_cache_rows
from .linear_attention import gdn_modules
from .lookup import Proposal
from .masks import tree_position_ids
from .sampling import choose_tokens
from .state import DecodeState, RoundRecord, RoundResult
from .tree import graft_paths, root_only
from .verify import verify_tree

SOURCE_NAMES = {1: "drafter", 2: "lookup", 3: "both"}


def target_forward(target, input_ids, position_ids, cache, hidden: bool = True, **kwargs):
    """One target forward that extends ``cache`` (under whichever keyword this transformers takes)."""
    return target(
        input_ids=input_ids,
        position_ids=position_ids,
        use_cache=True,
        output_hidden_states=hidden,
        **cache_kwargs(target, cache),
        **kwargs,
    )


def speculative_round(state: DecodeState) -> RoundResult:
    """Advance ``state`` by one round (the prefill on the first call); returns what each row committed."""
    if state.done:
        raise RuntimeError("this generation is finished: every row has stopped")
    with torch.inference_mode():
        if not state.prefilled:
            return _prefill(state)
        if state.policy is None:
            return _plain_step(state)
        return _tree_round(state)


def _prefill(state: DecodeState) -> RoundResult:
    gen, timer = state.generator, state.timer
    target = gen.target
    device = target.get_input_embeddings().weight.device
    lengths = torch.tensor([len(p) for p in state.prompts], dtype=torch.long, device=device)
    width = int(lengths.max())
    padded = not bool((lengths == width).all())
    ids = torch.full((len(state.prompts), width), gen.pad_token_id, dtype=torch.long, device=device)
    for b, p in enumerate(state.prompts):
        ids[b, width - len(p):] = p.to(device)
    state.cache = new_target_cache(target)
    plain = state.policy is None
    hidden = not plain and _reads_features(gen.drafter)
    with timer.stage("prefill"):
        if padded and gdn_modules(target):
            last, features, ids = _prefill_each_row(state, hidden, width, device)
        else:
            if padded:
                valid = padding_mask(lengths, width)
                positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
                out = target_forward(target, ids, positions, state.cache, hidden=hidden,
                                     attention_mask=valid.long())
            else:
                out = target_forward(target, ids, None, state.cache, hidden=hidden)
            last = out.logits[:, -1]
            features = gen.drafter.context_features(out.hidden_states) if hidden else None
            if padded and not plain:  # left-align each row's real positions for the drafter
                take = (torch.arange(width, device=device) + (width - lengths)[:, None]).clamp(max=width - 1)
                ids = ids.gather(1, take)
                features = None if features is None else features.gather(
                    1, take[..., None].expand(-1, -1, features.shape[-1]))
        check_cache_length(state.cache, width, "prefill")
        roots = gen.lockstep.share(choose_tokens(last.to(device), state.sampling, state.rng))
        if not plain:
            state.draft = gen.drafter.new_context(len(state.prompts))
            state.draft.append(features, ids, lengths)
    state.lengths, state.roots, state.prefilled = lengths, roots, True
    tokens = [[] for _ in state.prompts]
    for i, row in enumerate(state.active):
        tokens[row] = [int(roots[i])]
        state.emit(row, tokens[row])
    return _finish_round(state, tokens, [None] * len(state.prompts))


def _prefill_each_row(state: DecodeState, hidden: bool, width: int, device):
    """Prefill a hybrid GDN target's prompts one by one and stack the caches: each row's GDN state is then
    exactly its batch-1 prefill's. A left-padded batch forward is not: transformers zeroes the pad inputs,
    but its chunked gated-delta rule still decays through the pads (float64, 57 pads: a row's last logits
    2e-7 off its own prefill's, on transformers 5.0 and 5.24). Returns the last logits ``[B, V]``, the drafter
    features (left-aligned, ``None`` when not read) and the left-aligned token ids ``[B, width]``."""
    gen = state.generator
    target = gen.target
    caches, last, features = [], [], []
    ids = torch.full((len(state.prompts), width), gen.pad_token_id, dtype=torch.long, device=device)
    for b, prompt in enumerate(state.prompts):
        cache = new_target_cache(target)
        out = target_forward(target, prompt.view(1, -1), None, cache, hidden=hidden)
        check_cache_length(cache, len(prompt), "prefill")
        caches.append(cache)
        last.append(out.logits[:, -1])
        if hidden:
            feats = gen.drafter.context_features(out.hidden_states)
            features.append(torch.nn.functional.pad(feats, (0, 0, 0, width - feats.shape[1])))
        ids[b, : len(prompt)] = prompt.to(ids.device)
    state.cache = stack_rows(caches, [len(p) for p in state.prompts])
    return torch.cat(last), torch.cat(features) if hidden else None, ids


def _plain_step(state: DecodeState) -> RoundResult:
    target, cache, lengths = state.generator.target, state.cache, state.lengths
    width = cache_length(cache)
    with state.timer.stage("verify"):
        if bool((lengths == width).all()):
            out = target_forward(target, state.roots.view(-1, 1), None, cache, hidden=False)
        else:
            valid = torch.cat([padding_mask(lengths, width), torch.ones_like(lengths[:, None], dtype=torch.bool)], 1)
            out = target_forward(target, state.roots.view(-1, 1), lengths[:, None], cache, hidden=False,
                                 attention_mask=valid.long())
        check_cache_length(cache, width + 1, "decode step")
        logits = out.logits[:, -1].to(state.roots.device)
        state.roots = state.generator.lockstep.share(choose_tokens(logits, state.sampling, state.rng))
    state.lengths = lengths + 1
    state.rounds += 1
    tokens = [[] for _ in state.prompts]
    acceptance: list[int | None] = [None] * len(state.prompts)
    for i, row in enumerate(state.active):
        tokens[row] = [int(state.roots[i])]
        acceptance[row] = 1
        state.acceptance[row].append(1)
        state.emit(row, tokens[row])
    return _finish_round(state, tokens, acceptance)


def _tree_round(state: DecodeState) -> RoundResult:
    gen, timer, policy = state.generator, state.timer, state.policy
    target, cache, lengths, roots = gen.target, state.cache, state.lengths, state.roots
    width = cache_length(cache)
    rows = len(state.active)
    context = int(lengths.max())
    with timer.stage("calibration"):
        if hasattr(policy, "prepare"):
            policy.prepare(context, rows)
    if gen.lockstep.share(bool(getattr(policy, "skip_draft", False))):  # no tree pays now: a plain step
        tree = root_only(roots)
        state.budgets.append(0)
    else:
        with timer.stage("draft"):
            proposal = state.draft.propose(roots)
        logprobs, paths = (proposal.logprobs, proposal.paths) if isinstance(proposal, Proposal) else (proposal, None)
        with timer.stage("tree_build"):
            size = gen.lockstep.share(policy.choose(logprobs, context))  # each rank's clock differs: rank 0's
            tree = gen.builder(roots, logprobs, size)
            if paths is not None and any(paths):
                tree = graft_paths(tree, paths, size)
            state.budgets.append(size)
    with timer.stage("mask"):
        uniform = bool((lengths == width).all())
        valid = None if uniform else padding_mask(lengths, width)
        kwargs = gen.backend.tree_forward_kwargs(target, tree, width, gen.dtype, **({} if uniform else
                                                                                  {"prefix_valid": valid}))
        positions = tree_position_ids(tree.depths, width if uniform else lengths)
    verify_before = timer.seconds["verify"]
    with timer.stage("verify"):
        try:
            out = target_forward(target, tree.tokens, positions, cache, hidden=_reads_features(gen.drafter),
                                 **kwargs)
        except RuntimeError:  # a mask sized for a prefix the forward never saw fails inside attention
            check_cache_length(cache, width + tree.num_nodes, "verify forward")
            raise
        check_cache_length(cache, width + tree.num_nodes, "verify forward")
        result = gen.lockstep.share(verify_tree(tree, out.logits.to(tree.tokens.device), state.sampling, state.rng))
    policy.observe(tree, result, timer.seconds["verify"] - verify_before, context)
    with timer.stage("commit"):
        commit_accepted(cache, width, result.accepted, None if uniform else lengths)
        path = result.accepted.clamp(min=0)  # [A, L]; rows past their count repeat node 0, never read
        features = gen.drafter.context_features(out.hidden_states) if _reads_features(gen.drafter) else None
        if features is not None:
            features = features.gather(1, path[..., None].expand(-1, -1, features.shape[-1]))
        path_tokens = tree.tokens.gather(1, path)
        state.draft.append(features, path_tokens, result.num_accepted)
    counts = result.num_accepted.tolist()
    if tree.sources is not None:  # accepted draft tokens by the proposer that put them in the tree
        accepted_sources = tree.sources.gather(1, path).tolist()
        for i in range(rows):
            for flag in accepted_sources[i][1 : counts[i]]:
                state.accepted_by_source[SOURCE_NAMES[flag]] += 1
    path_tokens = path_tokens.tolist()
    bonus = result.bonus.tolist()
    tokens = [[] for _ in state.prompts]
    acceptance: list[int | None] = [None] * len(state.prompts)
    for i, row in enumerate(state.active):
        tokens[row] = path_tokens[i][1 : counts[i]] + [bonus[i]]
        acceptance[row] = counts[i]
        state.acceptance[row].append(counts[i])
        if state.record:
            state.records[row].append(RoundRecord(int(lengths[i]), tree.row(i), path[i, : counts[i]].tolist(),
                                                  bonus[i]))
        state.emit(row, tokens[row])
    state.lengths = lengths + result.num_accepted.to(lengths.device)
    state.roots = result.bonus
    state.rounds += 1
    return _finish_round(state, tokens, acceptance)


def _reads_features(drafter) -> bool:
    return getattr(drafter, "needs_hidden_states", True)


def _finish_round(state: DecodeState, tokens, acceptance) -> RoundResult:
    """Drop rows that finished this round from the cache, the drafter context and the row tensors."""
    finished = [row for row in state.active if state.finished[row]]
    if finished:
        keep = [i for i, row in enumerate(state.active) if not state.finished[row]]
        state.active = [state.active[i] for i in keep]
        if keep:
            index = torch.tensor(keep, dtype=torch.long, device=state.lengths.device)
            select_cache_rows(state.cache, index)
            if state.draft is not None:
                state.draft.select_rows(index)
            state.lengths = state.lengths.index_select(0, index)
            state.roots = state.roots.index_select(0, index.to(state.roots.device))
            _trim_leading_padding(state)
        else:
            state.cache = state.draft = None  # nothing left to decode: free the memory now
    return RoundResult(tokens, acceptance, finished)


def _trim_leading_padding(state: DecodeState) -> None:
    """Drop cache columns that are padding in every remaining row."""
    extra = cache_length(state.cache) - int(state.lengths.max())
    if extra > 0:
        truncate_front(state.cache, extra)
