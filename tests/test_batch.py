"""Batch > 1: every row is exactly its own batch-1 run (output and acceptance), and the round is reentrant."""

from __future__ import annotations

import threading

import pytest
import torch
from test_generator import expected_acceptance
from test_sampling_e2e import chi2_critical, chi2_statistic, exact_distribution
from tiny import ScriptedDrafter, tiny_drafter, tiny_target

from ddtree import Proposal, SpeculativeGenerator
from ddtree.blocks import SamplingConfig, speculative_round
from ddtree.targets.cache import cache_length

NEW = 40
BUILDERS = [("chain", 6), ("best_first", 8), ("beam@2x3", 6)]


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(target, prompt, new=NEW, stops=None):
    kwargs = dict(max_new_tokens=new, do_sample=False, pad_token_id=0)
    if stops:
        kwargs["eos_token_id"] = list(stops)
    ids = torch.tensor([prompt])  # an explicit mask: HF would take prompt tokens equal to the pad id for padding
    out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, len(prompt):].tolist()


class RowDecoys(ScriptedDrafter):
    """A scripted drafter whose decoy depths differ per row and per round, so rows accept differently."""

    def __init__(self, references, vocab, salts, block_size=5):
        super().__init__(references, vocab, block_size)
        self.salts = salts

    def new_context(self, batch_size=1):
        ctx = super().new_context(batch_size)
        propose = ctx.propose

        def varied(roots):
            lp = propose(roots).logprobs.clone()
            for i, row in enumerate(ctx.rows):
                clock = self.salts[row] + ctx.lengths[i]  # the row's own clock, not the batch's
                depth = 1 + clock % (self.block_size - 1)
                if depth < self.block_size - 1 and clock % 3 == 0:
                    lp[i, depth - 1] = torch.roll(lp[i, depth - 1], 1)  # the true token loses its rank here
            return Proposal(lp)

        ctx.propose = varied
        return ctx


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("builder,budget", BUILDERS)
def test_each_row_equals_its_own_greedy_run_and_acceptance(kind, builder, budget):
    target = tiny_target(kind)
    prompts = prompts_of([1, 40, 7, 23, 12], seed=1)
    free = [hf_greedy(target, p) for p in prompts]
    # Stops: row 2 stops on its very first token; row 3 on a token it reaches mid-round.
    stops = {free[2][0], free[3][17]}
    refs = [hf_greedy(target, p, stops=stops) for p in prompts]
    assert len(refs[2]) == 1 and len(refs[3]) <= 18
    references = [torch.tensor(p + r + [0] * 8) for p, r in zip(prompts, free)]
    vocab = target.config.vocab_size
    gen = SpeculativeGenerator(target, RowDecoys(references, vocab, list(range(5))), tree_budget=budget,
                               builder=builder)
    out = gen.generate(prompts, max_new_tokens=NEW, stop_token_ids=stops, record_trees=True)
    assert out.row_tokens == refs
    assert out.stats.batch_size == 5
    for b, prompt in enumerate(prompts):
        alone = SpeculativeGenerator(target, RowDecoys([references[b]], vocab, [b]), tree_budget=budget,
                                     builder=builder)
        one = alone.generate(prompt, max_new_tokens=NEW, stop_token_ids=stops, record_trees=True)
        assert one.row_tokens[0] == refs[b]
        assert out.acceptance_lengths[b] == one.acceptance_lengths  # the same trees, the same acceptance
        full = prompt + free[b]  # the target walks its free continuation; stops only cut the output
        assert out.acceptance_lengths[b] == [expected_acceptance(r, full) for r in out.rounds[b]]
        # sequences: prompts left-padded to the longest, new tokens right-padded with the pad id
        row = out.sequences[b]
        assert row[40 - len(prompt):40].tolist() == prompt
        assert row[40:40 + len(refs[b])].tolist() == refs[b]
    accs = [a for a in out.acceptance_lengths if len(a) > 3]
    assert any(len(set(round_accs)) > 1 for round_accs in zip(*accs))  # rows really diverge
    assert max(max(a) for a in accs) >= 4  # and deep trees are accepted


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_batch_with_the_dflash_drafter_matches_batch_one(kind):
    """A real (random) DFlash drafter: padded drafter contexts give each row the proposals of its own run."""
    target = tiny_target(kind)
    gen = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=8)
    prompts = prompts_of([3, 17, 9], seed=4)
    assert_rows_are_their_own_runs(gen, target, prompts, new=24)


def assert_rows_are_their_own_runs(gen, target, prompts, new):
    """Each row of a batch: HF greedy's tokens, and the acceptance and trees of its own batch-1 run."""
    out = gen.generate(prompts, max_new_tokens=new, record_trees=True)
    for b, p in enumerate(prompts):
        one = gen.generate(p, max_new_tokens=new, record_trees=True)
        assert out.row_tokens[b] == one.row_tokens[0] == hf_greedy(target, p, new=new)
        assert out.acceptance_lengths[b] == one.acceptance_lengths
        for r1, r2 in zip(out.rounds[b], one.rounds):
            assert torch.equal(r1.tree.tokens, r2.tree.tokens)


def test_padded_tensor_with_attention_mask_equals_list_of_prompts():
    target = tiny_target("qwen3")
    gen = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=6)
    prompts = prompts_of([5, 2, 8], seed=2)
    ids = torch.zeros(3, 8, dtype=torch.long)
    mask = torch.zeros(3, 8, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 8 - len(p):] = torch.tensor(p)
        mask[b, 8 - len(p):] = 1
    a = gen.generate(ids, attention_mask=mask, max_new_tokens=12)
    b = gen.generate(prompts, max_new_tokens=12)
    assert a.row_tokens == b.row_tokens
    assert torch.equal(a.sequences, b.sequences)


def test_plain_decoding_batch_equals_rows():
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=0)
    prompts = prompts_of([6, 1, 11], seed=5)
    out = gen.generate(prompts, max_new_tokens=15)
    assert out.row_tokens == [hf_greedy(target, p, new=15) for p in prompts]


def test_interleaved_states_and_threads_are_independent():
    target = tiny_target("qwen3")
    prompts = prompts_of([9, 14], seed=7)
    refs = [hf_greedy(target, p, new=30) for p in prompts]
    drafter = ScriptedDrafter([torch.tensor(p + r + [0] * 8) for p, r in zip(prompts, refs)][0],
                              target.config.vocab_size, decoy_at={2: 0})
    gen = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=8)
    alone = [gen.generate(p, max_new_tokens=30) for p in prompts]
    # two streams on one generator, advanced in turn
    streams = [gen.stream(p, max_new_tokens=30) for p in prompts]
    got = [[], []]
    live = [True, True]
    while any(live):
        for i, s in enumerate(streams):
            if live[i]:
                chunk = next(s, None)
                live[i] = chunk is not None
                got[i] += chunk[0] if chunk else []
    assert got == [a.row_tokens[0] for a in alone] == refs
    # two states advanced round by round: acceptance too
    states = [gen.start(p, max_new_tokens=30) for p in prompts]
    while not all(s.done for s in states):
        for s in states:
            if not s.done:
                speculative_round(s)
    for s, a in zip(states, alone):
        assert s.new_tokens[0] == a.row_tokens[0]
        assert s.acceptance[0] == a.acceptance_lengths
    # a scripted drafter is shared by the generators below: its proposals depend on each call's own context
    sgen = SpeculativeGenerator(target, drafter, tree_budget=8)
    base = sgen.generate(prompts[0], max_new_tokens=30)
    results = []
    threads = [threading.Thread(target=lambda: results.append(sgen.generate(prompts[0], max_new_tokens=30)))
               for _ in range(2)]
    for t in threads:
        t.start()
        t.join()
    for r in results:
        assert r.row_tokens == base.row_tokens and r.acceptance_lengths == base.acceptance_lengths
    assert max(base.acceptance_lengths) >= 3


def test_cache_holds_only_committed_tokens_over_a_long_batch():
    """2,000 tokens at batch 4: every round, the cache is as wide as the longest row's committed tokens
    (the rest of a shorter row is its left padding) and the drafter context holds exactly each row's."""
    target = tiny_target("qwen3", max_position_embeddings=1024)
    prompts = prompts_of([3, 30, 11, 19], seed=8)
    gen = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=4)
    state = gen.start(prompts, max_new_tokens=500)
    widths = []
    while not state.done:
        speculative_round(state)
        if state.done:
            break
        committed = [len(prompts[r]) + len(state.new_tokens[r]) - 1 for r in state.rows.active]  # the root is pending
        assert state.on_device.lengths.tolist() == committed and state.rows.host_lengths == committed
        assert cache_length(state.on_device.cache) == max(committed)
        assert state.catch_up_draft().lengths.tolist() == committed  # (after the prefill: the deferred prompt)
        assert state.on_device.draft.capacity <= 2 * max(committed) + 64
        widths.append(cache_length(state.on_device.cache))
    assert sum(len(t) for t in state.new_tokens) == 2000
    assert max(widths) <= 30 + 500


def test_sampling_distribution_per_row_at_batch_3():
    vocab, horizon, samples = 8, 3, 1200
    target = tiny_target("qwen3", vocab=vocab)
    torch.manual_seed(3)
    from ddtree.blocks import DFlashConfig, DFlashDraftModel

    dcfg = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=vocab - 1)
    gen = SpeculativeGenerator(target, DFlashDraftModel(dcfg).double().eval(), tree_budget=6)
    cfg = SamplingConfig(temperature=0.9, top_k=4)
    prompts = [[1, 2, 3], [4, 5], [6, 1, 2, 7]]
    counts = [dict() for _ in prompts]
    for seed in range(samples):
        out = gen.generate(prompts, max_new_tokens=horizon, temperature=cfg.temperature, top_k=cfg.top_k, seed=seed)
        for b, toks in enumerate(out.row_tokens):
            counts[b][tuple(toks)] = counts[b].get(tuple(toks), 0) + 1
    again = gen.generate(prompts, max_new_tokens=horizon, temperature=0.9, top_k=4, seed=5)
    assert again.row_tokens == gen.generate(prompts, max_new_tokens=horizon, temperature=0.9, top_k=4,
                                            seed=5).row_tokens
    for b, prompt in enumerate(prompts):
        exact = exact_distribution(target, cfg, prompt, horizon)
        assert set(counts[b]) <= set(exact), f"row {b} sampled a sequence the target cannot produce"
        stat, df = chi2_statistic(counts[b], exact, samples)
        assert df >= 3 and stat < chi2_critical(df), f"row {b}: chi2 {stat:.1f} over {df} dof"
