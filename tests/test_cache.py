"""Cache compaction keeps exactly the accepted nodes: it equals a cache built from scratch."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import tiny_target

from ddtree.blocks import DraftTree, commit_accepted, new_target_cache, tree_attention_mask
from ddtree.targets.cache import cache_kwargs, keep_positions


def random_tree(n: int, vocab: int, seed: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    tokens = torch.randint(0, vocab, (n,), generator=g)
    return DraftTree.from_parents(tokens, torch.tensor(parents))


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("seed", range(4))
def test_commit_equals_prefill_of_the_accepted_path(kind, seed):
    target = tiny_target(kind)
    prefix = torch.randint(0, 90, (1, 13), generator=torch.Generator().manual_seed(seed))
    tree = random_tree(12, 90, seed)
    leaf = int(torch.argmax(tree.depths[0] * 100 - torch.arange(12)))  # a deepest node
    path = torch.nonzero(tree.visibility[0, leaf]).flatten()
    with torch.no_grad():
        cache = new_target_cache()
        target(prefix, use_cache=True, **cache_kwargs(target, cache))
        start = cache.get_seq_length()
        mask = tree_attention_mask(tree.visibility, start, torch.float64)
        target(tree.tokens, position_ids=start + tree.depths, attention_mask=mask, use_cache=True,
               **cache_kwargs(target, cache))
        commit_accepted(cache, start, path[None])
        fresh = new_target_cache()
        target(torch.cat([prefix, tree.tokens[:, path]], 1), use_cache=True, **cache_kwargs(target, fresh))
    assert cache.get_seq_length() == fresh.get_seq_length() == start + len(path)
    for got, want in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(got.keys, want.keys, rtol=0, atol=1e-10)
        torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-10)


def test_keep_positions_slices_a_leading_run_and_gathers_otherwise():
    x = torch.arange(2 * 3 * 10 * 4, dtype=torch.float32).view(2, 3, 10, 4)
    run = keep_positions(x, 4, torch.tensor([[0, 1, 2], [0, 1, 2]]))
    assert run.data_ptr() == x.data_ptr() and run.shape[2] == 7
    got = keep_positions(x, 4, torch.tensor([[0, 2, 5], [0, 3, 4]]))
    assert torch.equal(got[0, :, 4:], x[0, :, [4, 6, 9]])
    assert torch.equal(got[1, :, 4:], x[1, :, [4, 7, 8]])
    assert torch.equal(got[:, :, :4], x[:, :, :4])


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_ragged_commit_equals_each_rows_own_prefill(kind):
    """Rows with different committed lengths (left padding) accept different paths: each row's cache after
    the commit equals a prefill of that row alone, right-aligned, and the padding is exactly the shortfall."""
    from ddtree.targets.cache import padding_mask

    target = tiny_target(kind)
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([9, 4, 7])
    width = int(lengths.max())
    prompts = [torch.randint(0, 90, (int(n),), generator=g) for n in lengths]
    trees = [random_tree(10, 90, seed) for seed in (11, 12, 13)]
    tree = DraftTree.from_parents(torch.cat([t.tokens for t in trees]), torch.cat([t.parents for t in trees]))
    paths = []
    for b, t in enumerate(trees):  # a different depth per row: the root only, a middle node, a deepest node
        node = [0, 4, int(torch.argmax(t.depths[0] * 100 - torch.arange(10)))][b]
        paths.append(torch.nonzero(t.visibility[0, node]).flatten())
    accepted = torch.full((3, max(len(p) for p in paths)), -1)
    for b, p in enumerate(paths):
        accepted[b, : len(p)] = p
    ids = torch.zeros(3, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = p
    valid = padding_mask(lengths, width)
    with torch.no_grad():
        cache = new_target_cache()
        target(ids, attention_mask=valid.long(), position_ids=(valid.cumsum(-1) - 1).clamp(min=0),
               use_cache=True, **cache_kwargs(target, cache))
        mask = tree_attention_mask(tree.visibility, width, torch.float64, prefix_valid=valid)
        target(tree.tokens, position_ids=lengths[:, None] + tree.depths, attention_mask=mask,
               use_cache=True, **cache_kwargs(target, cache))
        commit_accepted(cache, width, accepted, lengths)
        kept = lengths + torch.tensor([len(p) for p in paths])
        assert cache.get_seq_length() == int(kept.max())
        for b in range(3):
            fresh = new_target_cache()
            target(torch.cat([prompts[b], tree.tokens[b, paths[b]]])[None], use_cache=True,
                   **cache_kwargs(target, fresh))
            n = int(kept[b])
            for got, want in zip(cache.layers, fresh.layers):
                torch.testing.assert_close(got.keys[b : b + 1, :, -n:], want.keys, rtol=0, atol=1e-10)
                torch.testing.assert_close(got.values[b : b + 1, :, -n:], want.values, rtol=0, atol=1e-10)


def test_commit_refuses_paths_that_skip_the_root_or_have_inner_padding():
    cache = new_target_cache()
    with pytest.raises(ValueError, match="starts at the root"):
        commit_accepted(cache, 3, torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="padded at the end only"):
        commit_accepted(cache, 3, torch.tensor([[0, -1, 2]]))


def _filled_cache(rows: int, columns: int, seed: int):
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for layer in range(2):
        k, v = (torch.randn(rows, 2, columns, 4, generator=g, dtype=torch.float64) for _ in range(2))
        cache.update(k, v, layer)
    return cache


@pytest.mark.parametrize("accepted,lengths", [
    ([[0, 1, 2], [0, 1, 2]], None),  # a chain's leading run: a slice
    ([[0, 2, 5], [0, 1, 3]], None),  # equal counts off the leading run: one gather
    ([[0, 2, 5], [0, -1, -1]], [6, 4]),  # ragged counts and ragged rows: the whole cache re-packed
    ([[0, 1, -1], [0, 3, 4]], None),
])
def test_commit_from_host_paths_equals_the_device_checked_commit_and_reads_nothing(accepted, lengths):
    from ddtree.runtime.host_reads import count_host_reads

    prefix, nodes = 6, 6
    accepted_t = torch.tensor(accepted)
    paths = [[i for i in row if i >= 0] for row in accepted]
    lengths_t = None if lengths is None else torch.tensor(lengths)
    checked, host = _filled_cache(2, prefix + nodes, 0), _filled_cache(2, prefix + nodes, 0)
    commit_accepted(checked, prefix, accepted_t, lengths_t)
    with count_host_reads() as reads:
        commit_accepted(host, prefix, accepted_t, lengths_t, paths=paths, host_lengths=lengths)
    assert reads.count == 0
    for a, b in zip(checked.layers, host.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert checked.get_seq_length() == host.get_seq_length()
    with pytest.raises(ValueError, match="starts at the root"):
        commit_accepted(_filled_cache(2, prefix + nodes, 0), prefix, accepted_t, lengths_t,
                        paths=[p[1:] for p in paths], host_lengths=lengths)


def test_attention_layers_append_in_place_and_hold_what_concatenation_holds():
    """A decode step writes its columns into room behind the cache instead of copying the cache; after a
    truncation, a gathered commit and dropped rows the layers still hold what transformers' own
    concatenating layers hold, step for step (the control: a plain DynamicCache fed the same states)."""
    from transformers import DynamicCache

    from ddtree.targets.cache import select_rows, truncate

    target = tiny_target("llama")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 90, (3, 9), generator=g)
    with torch.no_grad():
        ours, theirs = new_target_cache(), DynamicCache()
        for cache in (ours, theirs):
            target(ids, use_cache=True, **cache_kwargs(target, cache))
        first = ours.layers[0]
        steps = [torch.randint(0, 90, (3, 1), generator=g) for _ in range(4)]
        for step in steps:
            for cache in (ours, theirs):
                target(step, use_cache=True, **cache_kwargs(target, cache))
        room = vars(first)["_ddtree_room"][0]
        assert first.keys.data_ptr() == room.data_ptr() and room.shape[-2] > first.keys.shape[-2]  # in place
        at = first.keys.data_ptr()
        target(steps[0], use_cache=True, **cache_kwargs(target, ours))
        assert first.keys.data_ptr() == at  # the step did not move the cache
        target(steps[0], use_cache=True, **cache_kwargs(target, theirs))
        for cache in (ours, theirs):
            truncate(cache, 12)  # a rejected tail: a later step writes over it
            commit_accepted(cache, 9, torch.tensor([[0, 1], [0, 2], [0, 1]]))  # row 1's path is gathered
            select_rows(cache, torch.tensor([0, 2]))  # a row finished
            target(steps[1][[0, 2]], use_cache=True, **cache_kwargs(target, cache))
        for got, want in zip(ours.layers, theirs.layers):
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
        assert ours.get_seq_length() == theirs.get_seq_length() == 12
        copied = copy.deepcopy(ours)  # a copy appends to itself, not to the cache it was copied from
        target(steps[2][[0, 2]], use_cache=True, **cache_kwargs(target, copied))
        assert copied.get_seq_length() == 13 and ours.get_seq_length() == 12
        assert torch.equal(copied.layers[0].keys[..., :12, :], ours.layers[0].keys)


def _roomed_cache(rows: int, columns: int, seed: int):
    """``_filled_cache``'s states in a ddtree cache whose layers hold them in their in-place room."""
    from ddtree.targets.kv_room import held_in_room

    g = torch.Generator().manual_seed(seed)
    cache = new_target_cache()
    for layer in range(2):
        k, v = (torch.randn(rows, 2, columns, 4, generator=g, dtype=torch.float64) for _ in range(2))
        cache.update(k[..., :-1, :], v[..., :-1, :], layer)
        cache.update(k[..., -1:, :], v[..., -1:, :], layer)  # the second update moves them into room
    assert all(held_in_room(layer) for layer in cache.layers)
    return cache


@pytest.mark.parametrize("accepted,lengths", [
    ([[0, 2, 5], [0, -1, -1]], [6, 4]),  # ragged counts and rows: row 1 moves right
    ([[0, 1, -1], [0, 3, 4]], None),
    ([[0, -1, -1], [0, 4, 5]], [6, 2]),  # the short row accepts most: it moves left, into its padding
    ([[0, 2, 5], [0, 1, 4]], None),  # equal counts off the leading run (batch 1's case): only the nodes move
    ([[0, 3], [0, 1]], [6, 3]),  # equal counts, ragged rows: the padding stays where it is
])
def test_a_tree_commit_moves_rows_within_their_room(accepted, lengths, monkeypatch):
    """A commit of a cache held in room, ragged or not, moves each row's columns there (no whole-cache gather
    or concatenation, the layers still append in place) and keeps what the gathering commit keeps, on every
    row's real columns."""
    from ddtree.targets import cache as cache_module

    prefix, nodes = 6, 6
    accepted_t = torch.tensor(accepted)
    paths = [[i for i in row if i >= 0] for row in accepted]
    host_lengths = [prefix, prefix] if lengths is None else lengths
    lengths_t = None if lengths is None else torch.tensor(lengths)
    want = _filled_cache(2, prefix + nodes, 0)
    commit_accepted(want, prefix, accepted_t, lengths_t)
    got = _roomed_cache(2, prefix + nodes, 0)
    gathers = []
    real = cache_module._gather_columns
    monkeypatch.setattr(cache_module, "_gather_columns", lambda *a: (gathers.append(1), real(*a))[1])
    commit_accepted(got, prefix, accepted_t, lengths_t, paths=paths, host_lengths=lengths)
    assert not gathers and got.get_seq_length() == want.get_seq_length()
    for a, b in zip(got.layers, want.layers):
        room = vars(a)["_ddtree_room"]
        assert a.keys.data_ptr() == room[0].data_ptr() and a.values.data_ptr() == room[1].data_ptr()
        for row, path in enumerate(paths):
            kept = host_lengths[row] + len(path)
            assert torch.equal(a.keys[row, :, -kept:], b.keys[row, :, -kept:])
            assert torch.equal(a.values[row, :, -kept:], b.values[row, :, -kept:])
