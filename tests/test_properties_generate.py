"""Property-based end-to-end tests on tiny float64 targets.

Random prompts (1-64 tokens), budgets (0-128), builders (chain, best_first, beam, random valid custom trees),
stop tokens and max_new_tokens, with a drafter that is sometimes right and sometimes a decoy (or the real
DFlash drafter with random weights). Every greedy case: the output equals HF greedy, and every round accepted
exactly what a from-scratch walk of its tree gives. Sampling cases: a seed fixes the output, and every token
is allowed by top-k/top-p given its true prefix. A building-block loop checks that the target cache after
every round equals a fresh prefill of the committed tokens, and that the hidden states fed to the drafter
are those of the committed tokens.

Example counts: ``examples(n)`` in CI (derandomized), 20x with ``--slow`` (see docs/reliability.md).
"""

from __future__ import annotations

import functools
import random

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_generator import expected_acceptance  # acceptance recomputed from scratch by a walk of the tree
from tiny import VOCAB, examples, tiny_drafter, tiny_target

import ddtree
from ddtree import DraftContext, Drafter, Proposal, SpeculativeGenerator
from ddtree.blocks import DraftTree, SamplingConfig, processed_logprobs
from ddtree.targets.cache import cache_kwargs

MAX_NEW = 48


@functools.cache
def target_of(kind: str):
    target = tiny_target(kind, seed=0 if kind == "qwen3" else 2)
    target.generation_config.eos_token_id = None  # HF would stop at the config's eos id (2 for Llama); stops are ours
    return target


@functools.cache
def dflash_of(kind: str, block_size: int):
    return tiny_drafter(target_of(kind), block_size=block_size)


class FuzzDrafter(Drafter):
    """Proposals built from the true continuation, perturbed per slot by a seeded RNG: the right token at
    rank 0 (probability ``p_right``), pushed down by a decoy, or missing; the rest of the row is random.

    Implements the Drafter protocol; each generation's context restarts the RNG from the seed."""

    def __init__(self, reference: list[int], block_size: int, p_right: float, p_decoy: float, seed: int):
        self.reference, self.block_size = reference, block_size
        self.p_right, self.p_decoy = p_right, p_decoy
        self.target_layer_ids = [0]
        self.seed = seed

    def context_features(self, hidden_states):
        return hidden_states[-1]

    def new_context(self, batch_size: int = 1):
        return _FuzzContext(self)


class _FuzzContext(DraftContext):
    def __init__(self, drafter: FuzzDrafter):
        self.d = drafter
        self.context_len = 0
        self.rng = random.Random(drafter.seed)
        self.gen = torch.Generator().manual_seed(drafter.seed)

    def append(self, features, tokens, counts=None, host_counts=None):
        self.context_len += int(counts[0]) if counts is not None else tokens.shape[1]

    def select_rows(self, rows):
        pass

    def propose(self, root_tokens):
        d = self.d
        depth = d.block_size - 1
        logits = torch.randn(1, depth, VOCAB, generator=self.gen) * 2
        for k in range(1, depth + 1):
            pos = self.context_len + k
            if pos >= len(d.reference):
                continue
            right, u = d.reference[pos], self.rng.random()
            if u < d.p_right:
                logits[0, k - 1, right] = 12.0
            elif u < d.p_right + d.p_decoy:
                logits[0, k - 1, right] = 10.0
                logits[0, k - 1, (right + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB] = 12.0
        return Proposal(logits.log_softmax(-1))


def random_tree_builder(seed: int):
    """A callable builder that grows a random valid tree (any shape, any depth) within the budget: tokens are
    the drafter's top-ranked ones at that depth or random ids, siblings may repeat. The shape is a function
    of the seed and the call's inputs (not of earlier calls), so a seeded generate call repeats exactly."""

    def build(root, logprobs, budget):
        ranked = logprobs[0].argsort(dim=-1, descending=True)[:, :3].tolist()
        rng = random.Random(f"{seed}/{int(root.view(-1)[0])}/{budget}/{ranked}")
        n = rng.randint(0, budget)
        parents, depths, tokens = [-1], [0], [int(root.view(-1)[0])]
        for i in range(1, n + 1):
            p = rng.randint(max(0, i - rng.choice([1, 2, 4, i])), i - 1)
            parents.append(p)
            depths.append(depths[p] + 1)
            d = min(depths[-1], len(ranked)) - 1
            tokens.append(rng.choice(ranked[d]) if rng.random() < 0.7 else rng.randrange(VOCAB))
        return DraftTree.from_parents(torch.tensor([tokens]), torch.tensor([parents]))

    build.__name__ = f"random_tree_{seed}"
    return build


def hf_generate(target, prompt: list[int], new: int, **kwargs) -> list[int]:
    """HF greedy. The explicit all-ones attention mask matters: without one, HF masks every prompt token
    equal to pad_token_id, and random prompts contain that id."""
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                          pad_token_id=0, **kwargs)
    return out[0].tolist()


def hf_greedy(target, prompt: list[int], new: int) -> list[int]:
    return hf_generate(target, prompt, new)


builders = st.one_of(
    st.sampled_from(["best_first", "chain"]),
    st.integers(0, 2**31).map(random_tree_builder),
    st.builds(lambda w, d: f"beam@{w}x{d}", st.integers(1, 4), st.integers(1, 6)),
)
drafters = st.one_of(
    st.tuples(st.just("fuzz"), st.sampled_from([0.95, 0.8, 0.5, 1.0, 0.0]), st.sampled_from([0.3, 0.0]),
              st.integers(0, 2**31)),
    st.just(("dflash",)),
)


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["qwen3", "llama"]))
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=64))
    return dict(
        kind=kind, prompt=prompt, new=draw(st.integers(1, MAX_NEW)), budget=draw(st.integers(0, 128)),
        builder=draw(builders), drafter=draw(drafters), block_size=draw(st.sampled_from([2, 5, 9])),
        stop=draw(st.sampled_from(["none", "from_output", "random"])), stop_pick=draw(st.integers(0, 10**6)),
    )


def make_generator(case, reference: list[int]):
    target = target_of(case["kind"])
    if case["drafter"][0] == "dflash":
        drafter = dflash_of(case["kind"], case["block_size"])
    else:
        _, p_right, p_decoy, seed = case["drafter"]
        drafter = FuzzDrafter(reference, case["block_size"], p_right, p_decoy, seed)
    return SpeculativeGenerator(target, drafter, tree_budget=case["budget"], builder=case["builder"])


def describe(case) -> None:
    builder = case["builder"] if isinstance(case["builder"], str) else "random tree"
    event(f"builder {builder.split('@')[0]}")
    event(f"drafter {case['drafter'][0]}" + (f" p_right={case['drafter'][1]}" if case["drafter"][0] == "fuzz" else ""))


@settings(max_examples=examples(80))
@given(case=cases())
def test_greedy_equals_hf_and_acceptance_equals_a_walk_of_each_tree(case):
    target, prompt, new = target_of(case["kind"]), case["prompt"], case["new"]
    # The reference runs past max_new_tokens: far enough for every position a FuzzDrafter proposal reads (its
    # context stays under prompt + new, its block reaches block_size - 1 further), then, after the run, for the
    # deepest node of any recorded tree, so the last round's walk sees every node it may accept.
    reference = hf_greedy(target, prompt, new + 2 * case["block_size"])
    continuation = reference[len(prompt):]
    stops = None
    if case["stop"] == "from_output":
        stops = [continuation[case["stop_pick"] % new]]
    elif case["stop"] == "random":
        stops = [case["stop_pick"] % VOCAB, case["stop_pick"] // VOCAB % VOCAB]  # both in the vocabulary
    expected = continuation[:new]
    for i, tok in enumerate(expected):
        if stops and tok in stops:
            expected = expected[: i + 1]
            break
    gen = make_generator(case, reference)
    out = gen.generate(torch.tensor([prompt]), max_new_tokens=new, stop_token_ids=stops, record_trees=True)
    deepest = max((r.start + int(r.tree.depths.max()) for r in out.rounds), default=0)
    if deepest >= len(reference):
        reference = hf_greedy(target, prompt, deepest + 1 - len(prompt))
    assert out.new_tokens[0].tolist() == expected
    describe(case)
    event(f"longest acceptance {max(out.acceptance_lengths, default=0)}")
    event("stopped at a stop token" if len(expected) < new else "ran to max_new_tokens")
    # HF greedy with the same stop token, directly (it agrees with the cut of the longer run above).
    if stops:
        assert hf_generate(target, prompt, new, eos_token_id=stops)[len(prompt):] == expected
    assert out.stats.rounds == len(out.acceptance_lengths) and out.stats.new_tokens == len(expected)
    if case["budget"] == 0:  # plain decoding: one token per step, no trees
        assert out.rounds == [] and out.acceptance_lengths == [1] * (len(expected) - 1)
    else:
        assert out.acceptance_lengths == [expected_acceptance(r, reference) for r in out.rounds]
        assert all(r.tree.budget <= case["budget"] for r in out.rounds)
    # Every round but the last commits exactly its acceptance; the last may be cut by the stop or the limit.
    assert 1 + sum(out.acceptance_lengths[:-1]) < len(expected) + (1 if out.rounds else 0) or len(expected) == 1
    assert 1 + sum(out.acceptance_lengths) >= len(expected)


@settings(max_examples=examples(30))
@given(case=cases(), temperature=st.floats(0.2, 2.0), top_k=st.none() | st.integers(1, 12),
       top_p=st.none() | st.floats(0.3, 1.0), seed=st.integers(0, 2**31))
def test_sampling_is_seeded_and_every_token_is_allowed(case, temperature, top_k, top_p, seed):
    target, prompt, new = target_of(case["kind"]), case["prompt"], case["new"]
    reference = hf_greedy(target, prompt, new + 10) if case["drafter"][0] == "fuzz" else []
    stops = [case["stop_pick"] % VOCAB] if case["stop"] != "none" else None
    gen = make_generator(case, reference)
    kwargs = dict(max_new_tokens=new, temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=stops)
    a = gen.generate(torch.tensor([prompt]), seed=seed, **kwargs)
    b = gen.generate(torch.tensor([prompt]), seed=seed, **kwargs)
    assert torch.equal(a.sequences, b.sequences) and a.acceptance_lengths == b.acceptance_lengths
    describe(case)
    tokens = a.new_tokens[0].tolist()
    assert 1 <= len(tokens) <= new
    if stops:
        assert all(t not in stops for t in tokens[:-1])
        assert len(tokens) == new or tokens[-1] in stops
    else:
        assert len(tokens) == new
    # Each token is in the support of the processed distribution given its true prefix (tiny relaxation
    # of top-p for float rounding between a tree forward and this full forward).
    with torch.no_grad():
        logits = target(a.sequences).logits[0, len(prompt) - 1 : -1]
    relaxed = SamplingConfig(temperature, top_k, None if top_p is None else min(1.0, top_p + 1e-9))
    allowed = processed_logprobs(logits, relaxed) > float("-inf")
    assert all(allowed[i, t] for i, t in enumerate(tokens))


@settings(max_examples=examples(40))
@given(kind=st.sampled_from(["qwen3", "llama"]), prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=64),
       budget=st.integers(0, 128), builder=builders, block_size=st.sampled_from([2, 5, 9]),
       rounds=st.integers(1, 10), drafter=drafters)
def test_cache_after_each_round_equals_a_fresh_prefill(kind, prompt, budget, builder, block_size, rounds, drafter):
    """A loop of the public blocks (as examples/custom_loop.py): after every commit, each layer's keys and
    values equal a fresh prefill of the committed tokens, and the accepted nodes' hidden states (the drafter's
    next context) equal that prefill's hidden states at the same positions."""
    target = target_of(kind)
    if drafter[0] == "fuzz":
        reference = hf_greedy(target, prompt, rounds * block_size + 1)
        drafter = FuzzDrafter(reference, block_size, *drafter[1:])
    else:
        drafter = ddtree.blocks.DFlashDrafter(dflash_of(kind, block_size), target)
    build = ddtree.blocks.resolve_builder(builder)
    with torch.inference_mode():
        cache = ddtree.blocks.new_target_cache(target)
        out = target(torch.tensor([prompt]), use_cache=True, output_hidden_states=True,
                     **cache_kwargs(target, cache))
        context = drafter.new_context()
        context.append(drafter.context_features(out.hidden_states), torch.tensor([prompt]))
        root = out.logits[:, -1].argmax(-1)
        committed = list(prompt)
        for _ in range(rounds):
            start = cache.get_seq_length()
            tree = build(root, context.propose(root).logprobs, budget)
            out = target(tree.tokens, position_ids=ddtree.blocks.tree_position_ids(tree.depths, start),
                         attention_mask=ddtree.blocks.tree_attention_mask(tree.visibility, start, target.dtype),
                         use_cache=True, output_hidden_states=True, **cache_kwargs(target, cache))
            result = ddtree.blocks.verify_tree(tree, out.logits)
            path = result.accepted
            ddtree.blocks.commit_accepted(cache, start, path)
            committed += tree.tokens[0, path[0]].tolist()  # the root, then the accepted drafts
            fresh_cache = ddtree.blocks.new_target_cache()
            fresh = target(torch.tensor([committed]), use_cache=True, output_hidden_states=True,
                           **cache_kwargs(target, fresh_cache))
            assert cache.get_seq_length() == len(committed)
            for mine, ref in zip(cache.layers, fresh_cache.layers):
                torch.testing.assert_close(mine.keys, ref.keys, rtol=0, atol=1e-10)
                torch.testing.assert_close(mine.values, ref.values, rtol=0, atol=1e-10)
            for h_tree, h_ref in zip(out.hidden_states, fresh.hidden_states):
                torch.testing.assert_close(h_tree[:, path[0]], h_ref[:, start:], rtol=0, atol=1e-10)
            torch.testing.assert_close(out.logits[:, path[0][-1]], fresh.logits[:, -1], rtol=0, atol=1e-10)
            context.append(drafter.context_features(out.hidden_states)[:, path[0]], tree.tokens[:, path[0]])
            root = result.bonus
    assert len(committed) >= len(prompt) + rounds
    event(f"committed {len(committed) - len(prompt)} tokens over {rounds} rounds"
          if len(committed) - len(prompt) > rounds else "one token per round")
