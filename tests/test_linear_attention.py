"""The GDN tree forward: per-node outputs from each node's own path, and the commit a chain would leave."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import family_target

from ddtree.blocks import DraftTree, commit_accepted, new_target_cache
from ddtree.core.masks import tree_position_ids
from ddtree.targets.backends import get_backend
from ddtree.targets.cache import cache_kwargs
from ddtree.targets.linear_attention import (
    LinearTreePlan,
    StaticPending,
    _states,
    commit_linear_states,
    gdn_modules,
    gdn_tree_forward,
    static_commit,
    static_tree_forward,
    tree_conv_index,
)

TOL = 1e-10
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]


def _random_tree(n: int, seed: int, batch: int = 1) -> DraftTree:
    """Several branches per depth: each node hangs under one of the last few nodes."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, n), -1, dtype=torch.long)
    for b in range(batch):
        for i in range(1, n):
            parents[b, i] = int(torch.randint(max(0, i - 4), i, (1,), generator=gen))
    tokens = torch.randint(1, 90, (batch, n), generator=gen)
    return DraftTree.from_parents(tokens, parents)


def _prefill(model, prompt_ids):
    cache = new_target_cache(model)
    with torch.no_grad():
        model(prompt_ids, use_cache=True, **cache_kwargs(model, cache))
    return cache


def _chain(model, cache, tokens: list[int], start: int, row_ids=None):
    """Decode ``tokens`` one at a time (transformers' own path) on ``cache``; the last hidden state of each step."""
    hidden = []
    with torch.no_grad():
        for i, tok in enumerate(tokens):
            out = model(torch.tensor([[tok]]), position_ids=torch.tensor([[start + i]]), use_cache=True,
                        output_hidden_states=True, **cache_kwargs(model, cache))
            hidden.append(out.hidden_states[-1][0, -1])
    return hidden


def _path(tree: DraftTree, node: int, row: int = 0) -> list[int]:
    path = [node]
    while tree.parents[row, path[-1]] >= 0:
        path.append(int(tree.parents[row, path[-1]]))
    return path[::-1]


def _tree_forward(model, cache, tree: DraftTree, start: int, backend):
    kwargs = backend.tree_forward_kwargs(model, tree, start, torch.float64)
    with torch.no_grad():
        return model(tree.tokens, position_ids=tree_position_ids(tree.depths, start), use_cache=True,
                     output_hidden_states=True, **cache_kwargs(model, cache), **kwargs)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("attention", ["sdpa", "split"])
def test_every_node_equals_its_path_run_as_a_chain(family, attention):
    model = family_target(family)
    backend = get_backend(attention)
    backend.prepare(model)
    prompt = torch.tensor([PROMPT])
    for seed in (0, 1):
        tree = _random_tree(14, seed)
        cache = _prefill(model, prompt)
        before = copy.deepcopy(cache)
        states_before = [tuple(t.clone() for t in _states(cache, m.layer_idx)) for m in gdn_modules(model)]
        out = _tree_forward(model, cache, tree, len(PROMPT), backend)
        for m, (conv, rec) in zip(gdn_modules(model), states_before):  # the verify never writes the GDN state
            now_conv, now_rec = _states(cache, m.layer_idx)
            assert torch.equal(now_conv, conv) and torch.equal(now_rec, rec)
        assert len(set(tree.depths[0].tolist())) < tree.num_nodes  # really a tree: siblings share depths
        for node in range(tree.num_nodes):
            path = _path(tree, node)
            chain = _chain(model, copy.deepcopy(before), tree.tokens[0, path].tolist(), len(PROMPT))
            err = (out.hidden_states[-1][0, node] - chain[-1]).abs().max().item()
            assert err <= TOL, (seed, node, path, err)


def _assert_same_state(model, got, want, row: int | None = None, tol: float = TOL):
    for m in gdn_modules(model):
        for a, b in zip(_states(got, m.layer_idx), _states(want, m.layer_idx)):
            a = a if row is None else a[row : row + 1]
            assert a.shape == b.shape and (a - b).abs().max().item() <= tol


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_commit_equals_a_chain_prefill_of_the_accepted_path(family):
    model = family_target(family)
    backend = get_backend("sdpa")
    backend.prepare(model)
    prompt = torch.tensor([PROMPT])
    tree = _random_tree(12, seed=3)
    start = len(PROMPT)
    for node in (0, 5, tree.num_nodes - 1):  # root only, a middle node, the last node
        path = _path(tree, node)
        cache = _prefill(model, prompt)
        want = _prefill(model, prompt)
        _tree_forward(model, cache, tree, start, backend)
        commit_accepted(cache, start, torch.tensor([path]))
        _chain(model, want, tree.tokens[0, path].tolist(), start)
        _assert_same_state(model, cache, want)
        assert cache.get_seq_length() == want.get_seq_length() == start + len(path)
        attn = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
        for i in attn:  # the attention KV kept exactly the accepted nodes
            got_k = cache.layers[i].keys if hasattr(cache, "layers") else cache.key_cache[i]
            want_k = want.layers[i].keys if hasattr(want, "layers") else want.key_cache[i]
            assert (got_k - want_k).abs().max().item() <= TOL
        # and the next step decodes as if the path had been decoded token by token
        nxt = 7
        a = _chain(model, cache, [nxt], start + len(path))[0]
        b = _chain(model, want, [nxt], start + len(path))[0]
        assert (a - b).abs().max().item() <= TOL


def test_ragged_commit_takes_each_rows_own_last_node():
    """Batch 2, different trees and acceptance lengths (-1 padded): each row's GDN state is its own chain's."""
    model = family_target("qwen3_5")
    backend = get_backend("sdpa")
    backend.prepare(model)
    prompts = torch.tensor([PROMPT, PROMPT[::-1]])
    tree = _random_tree(10, seed=5, batch=2)
    start = len(PROMPT)
    cache = _prefill(model, prompts)
    _tree_forward(model, cache, tree, start, backend)
    paths = [_path(tree, 9, row=0), _path(tree, 4, row=1)]
    assert len(paths[0]) != len(paths[1])
    width = max(map(len, paths))
    accepted = torch.tensor([p + [-1] * (width - len(p)) for p in paths])
    commit_linear_states(cache, accepted)
    for row, path in enumerate(paths):
        want = _prefill(model, prompts[row : row + 1])
        _chain(model, want, tree.tokens[row, path].tolist(), start)
        _assert_same_state(model, cache, want, row=row)


def test_a_tree_forward_without_ddtree_is_refused_at_commit():
    """A hybrid cache whose verify ran transformers' own GDN forward (siblings mixed) cannot be committed."""
    model = family_target("qwen3_5")
    cache = _prefill(model, torch.tensor([PROMPT]))
    tree = _random_tree(6, seed=0)
    with torch.no_grad():
        model(tree.tokens, position_ids=tree_position_ids(tree.depths, len(PROMPT)), use_cache=True,
              **cache_kwargs(model, cache))
    with pytest.raises(ValueError, match="linear-attention"):
        commit_accepted(cache, len(PROMPT), torch.tensor([[0, 1]]))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_long_chain_runs_the_chunked_rule_and_commits_exactly(family):
    """From CHUNKED_CHAIN_FROM nodes a chain runs transformers' chunked rule (its own multi-token path):
    close to the token-by-token decode at float32 rounding (the GDN math runs in float32 either way), and so is
    the committed state, whose later layers' inputs come from that forward."""
    from ddtree.targets.linear_attention import CHUNKED_CHAIN_FROM

    model = family_target(family)
    backend = get_backend("sdpa")
    backend.prepare(model)
    n = CHUNKED_CHAIN_FROM + 3
    tokens = torch.randint(1, 90, (1, n), generator=torch.Generator().manual_seed(0))
    chain = DraftTree.from_parents(tokens, torch.arange(-1, n - 1)[None])
    cache = _prefill(model, torch.tensor([PROMPT]))
    want = _prefill(model, torch.tensor([PROMPT]))
    out = _tree_forward(model, cache, chain, len(PROMPT), backend)
    hidden = torch.stack(_chain(model, want, tokens[0].tolist(), len(PROMPT)))
    assert (out.hidden_states[-1][0] - hidden).abs().max().item() <= 1e-5
    commit_accepted(cache, len(PROMPT), torch.arange(n)[None])
    _assert_same_state(model, cache, want, tol=1e-5)


def test_prepare_is_instance_level_and_reversible():
    from ddtree.targets.linear_attention import is_prepared, prepare, unprepare

    model = family_target("qwen3_5")
    other = family_target("qwen3_5")
    assert prepare(model) and prepare(model) and is_prepared(model) and not is_prepared(other)
    assert all("forward" in vars(m) for m in gdn_modules(model))
    assert not any("forward" in vars(m) for m in gdn_modules(other))  # the class is untouched
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, other(ids).logits)  # without a tree: transformers' own forward
    unprepare(model)
    assert not is_prepared(model) and not any("forward" in vars(m) for m in [model, *gdn_modules(model)])


def test_a_prepared_target_still_gets_last_position_logits_from_hf_generate():
    """HF ``generate`` reads the forward's parameters to decide ``logits_to_keep``: the routed forward keeps
    the original signature, so a prompt's prefill still computes one logits row, not one per prompt token."""
    import inspect

    from ddtree.targets.linear_attention import prepare

    model = family_target("qwen3_5")
    prepare(model)
    assert "logits_to_keep" in inspect.signature(model.forward).parameters
    rows = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    ids = torch.tensor([PROMPT * 3])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert rows == [1, 1]


def test_the_pending_tree_state_lives_in_ddtree_not_in_the_cache_object():
    """A verify forward leaves its per-node inputs in ddtree's table keyed by the cache; transformers' cache
    object gains no attribute, the commit consumes them and a truncate drops them."""
    from ddtree.targets import linear_attention
    from ddtree.targets.cache import truncate

    model = family_target("qwen3_5")
    backend = get_backend("sdpa")
    backend.prepare(model)
    cache = _prefill(model, torch.tensor([PROMPT]))
    attributes = set(vars(cache))
    tree = _random_tree(6, seed=5)
    _tree_forward(model, cache, tree, len(PROMPT), backend)
    assert set(vars(cache)) == attributes
    assert linear_attention.has_pending(cache) and set(linear_attention._PENDING[cache]) == {
        m.layer_idx for m in gdn_modules(model)}
    commit_accepted(cache, len(PROMPT), torch.tensor([_path(tree, 3)]))
    assert not linear_attention.has_pending(cache) and cache.get_seq_length() == len(PROMPT) + len(_path(tree, 3))
    _tree_forward(model, cache, tree, cache.get_seq_length(), backend)
    assert linear_attention.has_pending(cache)
    truncate(cache, cache.get_seq_length() - tree.num_nodes)
    assert not linear_attention.has_pending(cache)


def test_the_description_names_the_stateful_kind_and_its_prefill_rules():
    """The hybrid's description carries the GDN kind (what the round, cache and forward ask for); an
    attention-only target has none. Both are read once per model object."""
    from ddtree.targets.description import describe
    from ddtree.targets.layer_kinds import STATEFUL_KINDS, kinds_in_cache
    from ddtree.targets.linear_attention import GatedDeltaNet, chunk_continues_state

    hybrid, plain = family_target("qwen3_5"), family_target("llama")
    gdn = describe(hybrid).stateful
    assert len(gdn) == 1 and isinstance(gdn[0], GatedDeltaNet) and gdn[0] in STATEFUL_KINDS
    assert describe(hybrid) is describe(hybrid) and describe(plain).stateful == ()
    assert not describe(hybrid).padded_prefill_exact and describe(plain).padded_prefill_exact
    assert kinds_in_cache(new_target_cache(hybrid)) == gdn and kinds_in_cache(new_target_cache(plain)) == ()
    assert describe(plain).prefill_step(1000, 100) == 100 and describe(plain).prefill_step(1000, None) == 1000
    # a hybrid's chunk is rounded up to whole 64-token GDN blocks where transformers continues the state
    assert describe(hybrid).prefill_step(1000, 100) == (128 if chunk_continues_state() else 1000)
    assert describe(hybrid).prefill_step(1000, None) == 1000
    linear = [i for i, t in enumerate(hybrid.config.get_text_config().layer_types) if t == "linear_attention"]
    assert linear and not set(linear) & set(describe(hybrid).windows)


@pytest.mark.parametrize("kernel", [1, 4, 6])
def test_the_static_conv_table_equals_the_plan_s(kernel):
    """The static round's conv window table (tensor ops) is the dynamic plan's (numpy), on ragged random trees
    deeper than the kernel, and on chains."""
    for seed in range(4):
        tree = _random_tree(17, seed, batch=3)
        want = LinearTreePlan.from_tree(tree).conv_index(kernel, "cpu")
        assert torch.equal(tree_conv_index(tree.parents, tree.depths, kernel), want)
    chain = DraftTree.from_parents(torch.zeros(2, 9, dtype=torch.long), torch.arange(-1, 8).expand(2, 9))
    plan = LinearTreePlan.from_tree(chain)
    plan.is_chain = False  # the plan's table even where its forward takes the strided view
    assert torch.equal(tree_conv_index(chain.parents, chain.depths, kernel), plan.conv_index(kernel, "cpu"))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_the_static_tree_forward_and_commit_equal_the_dynamic_ones(family):
    """One GDN layer: the static round's fixed-shape forward gives the dynamic forward's outputs bit for bit,
    and its in-place commit the dynamic commit's conv windows and states for live rows (paths of different
    lengths), while a finished row's stay as they were."""
    model = family_target(family)
    if getattr(new_target_cache(model), "layers", None) is None:
        pytest.skip("this transformers' hybrid cache has no layers: compile=True refuses it, so no static forward")
    module = gdn_modules(model)[0]
    cache = _prefill(model, torch.tensor([PROMPT, PROMPT[::-1]]))
    tree = _random_tree(12, seed=7, batch=2)
    hidden = torch.randn(2, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64)
    deepest = tree.depths.argmax(dim=1).tolist()
    paths = [_path(tree, deepest[0], 0), _path(tree, 3, 1)]
    accepted = torch.tensor([p + [-1] * (12 - len(p)) for p in paths])
    max_depth = int(tree.depths.max())
    conv, state = (t.clone() for t in _states(cache, module.layer_idx))
    with torch.no_grad():
        want = gdn_tree_forward(module, hidden, LinearTreePlan.from_tree(tree), cache)
        commit_linear_states(cache, accepted)
        for alive in ([True, True], [True, False]):
            bufs = conv.clone(), state.clone()
            pending = StaticPending.empty(*bufs, 12)
            got = static_tree_forward(module, hidden, *bufs, pending, tree.parents, tree.depths,
                                      tree_conv_index(tree.parents, tree.depths, conv.shape[-1]), max_depth)
            assert torch.equal(got, want)
            static_commit(*bufs, pending, accepted[:, : max_depth + 1], torch.tensor(alive))
            for row, live in enumerate(alive):
                expected = _states(cache, module.layer_idx) if live else (conv, state)
                assert all(torch.equal(b[row], e[row]) for b, e in zip(bufs, expected))
