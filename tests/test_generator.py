"""End-to-end greedy generation: lossless output AND the acceptance it should have."""

from __future__ import annotations

import pytest
import torch
from tiny import ScriptedDrafter, tiny_drafter, tiny_target

from ddtree import BudgetPolicy, SpeculativeGenerator
from ddtree.blocks import beam
from ddtree.core.tree import LOOKUP
from ddtree.drafters.base import Proposal
from ddtree.drafters.lookup import PromptLookup, WithLookup
from ddtree.generation.generator import default_numerics

PROMPTS = [[5, 17, 3], [11, 2, 2, 40, 61, 7, 9, 33, 12, 1, 80], list(range(10, 50))]
NEW = 64
CONFIGS = [("chain", 32), ("best_first", 1), ("best_first", 4), ("best_first", 16), ("best_first", 64),
           ("beam@3x4", 12)]


def reference(target, prompt, new=NEW, stop=None):
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=new, do_sample=False, pad_token_id=0)
    if stop is not None:
        kwargs["eos_token_id"] = stop
    return target.generate(ids, **kwargs)


def expected_acceptance(record, ref_tokens: list[int]) -> int:
    """1 + the deepest tree node whose path spells the reference continuation after the root."""
    tree = record.tree
    toks, parents, depths = (t[0].tolist() for t in (tree.tokens, tree.parents, tree.depths))
    ok = [True] + [False] * (len(toks) - 1)
    best = 0
    for i in range(1, len(toks)):
        pos = record.start + depths[i]
        ok[i] = ok[parents[i]] and pos < len(ref_tokens) and toks[i] == ref_tokens[pos]
        if ok[i]:
            best = max(best, depths[i])
    return best + 1


@pytest.fixture(scope="module")
def references():
    """HF greedy of each of ``PROMPTS`` on a fresh ``tiny_target`` of each kind (the weights ``tiny_pair`` has),
    computed once for every builder and budget."""
    return {kind: {tuple(p): reference(tiny_target(kind), p) for p in PROMPTS} for kind in ("qwen3", "llama")}


@pytest.mark.parametrize("builder,budget", CONFIGS)
def test_lossless_greedy_and_acceptance_matches_recompute(tiny_pair, references, builder, budget):
    target, draft = tiny_pair
    gen = SpeculativeGenerator(target, draft, tree_budget=budget, builder=builder)
    for prompt in PROMPTS:
        ref = references[target.config.model_type][tuple(prompt)]
        out = gen.generate(torch.tensor([prompt]), max_new_tokens=NEW, record_trees=True)
        assert torch.equal(out.sequences, ref)
        ref_tokens = ref[0].tolist()
        # Every round accepted exactly what a from-scratch walk of its tree against the reference gives.
        assert out.acceptance_lengths == [expected_acceptance(r, ref_tokens) for r in out.rounds]
        assert sum(out.acceptance_lengths[:-1]) + 1 < NEW <= sum(out.acceptance_lengths) + 1
        assert out.stats.rounds == len(out.acceptance_lengths)


def test_lossless_with_stop_tokens(tiny_pair):
    target, draft = tiny_pair
    prompt = PROMPTS[1]
    full = reference(target, prompt)[0, len(prompt):].tolist()
    stop = full[20]
    ref = reference(target, prompt, stop=stop)
    assert ref.shape[1] == len(prompt) + full.index(stop) + 1
    never = next(t for t in range(target.config.vocab_size) if t not in full)  # a second stop id that never fires
    for builder in ("chain", "best_first"):
        out = SpeculativeGenerator(target, draft, tree_budget=16, builder=builder).generate(
            torch.tensor([prompt]), max_new_tokens=NEW, stop_token_ids=[stop, never]
        )
        assert torch.equal(out.sequences, ref)


@pytest.mark.parametrize("builder", ["chain", "best_first"])
def test_agreeing_drafter_accepts_full_depth_every_round(builder):
    target = tiny_target("qwen3")
    prompt = PROMPTS[1]
    ref = reference(target, prompt, new=61)
    drafter = ScriptedDrafter(ref, vocab=target.config.vocab_size, block_size=5)
    out = SpeculativeGenerator(target, drafter, tree_budget=8, builder=builder).generate(
        torch.tensor([prompt]), max_new_tokens=61
    )
    assert torch.equal(out.sequences, ref)
    # 1 token from prefill, then 15 rounds of 4 drafts + bonus.
    assert out.acceptance_lengths == [5] * 12


def test_tree_recovers_a_second_ranked_token_the_chain_misses():
    target = tiny_target("llama")
    prompt = PROMPTS[0]
    ref = reference(target, prompt, new=41)
    vocab = target.config.vocab_size
    chain_out = SpeculativeGenerator(
        target, ScriptedDrafter(ref, vocab, decoy_at={2: 3}), tree_budget=32, builder="chain"
    ).generate(torch.tensor([prompt]), max_new_tokens=41)
    tree_out = SpeculativeGenerator(
        target, ScriptedDrafter(ref, vocab, decoy_at={2: 3}), tree_budget=7, builder="best_first"
    ).generate(torch.tensor([prompt]), max_new_tokens=41)
    assert torch.equal(chain_out.sequences, ref) and torch.equal(tree_out.sequences, ref)
    assert chain_out.acceptance_lengths == [2] * 20  # depth 1 right, depth 2 a decoy
    assert tree_out.acceptance_lengths == [5] * 8  # the budget-7 tree holds the rank-1 branch


def test_tokens_equal_to_mask_id_are_kept():
    target = tiny_target("qwen3")
    prompt = PROMPTS[2]
    ref = reference(target, prompt)
    generated = ref[0, len(prompt):].tolist()
    mask_id = max(set(generated), key=generated.count)  # a token the target really emits
    draft = tiny_drafter(target)
    draft.config.mask_token_id = mask_id
    gen = SpeculativeGenerator(target, draft, tree_budget=16)
    assert gen.drafter.mask_token_id == mask_id
    out = gen.generate(torch.tensor([prompt]), max_new_tokens=NEW)
    assert torch.equal(out.sequences, ref)
    assert out.new_tokens[0].tolist().count(mask_id) == generated.count(mask_id) > 0


def test_repeated_calls_do_not_leak_state(tiny_pair):
    target, draft = tiny_pair
    gen = SpeculativeGenerator(target, draft, tree_budget=16)
    a = gen.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=40)
    b = gen.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=40)
    c = gen.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=40)
    d = gen.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=40)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.sequences, d.sequences)
    assert a.acceptance_lengths == b.acceptance_lengths == d.acceptance_lengths
    assert torch.equal(c.sequences, reference(target, PROMPTS[0], new=40))


def test_stream_yields_what_generate_returns(tiny_pair):
    """Each round yields its accepted path and bonus token; the last round's chunk is cut at max_new_tokens."""
    target, _ = tiny_pair
    prompt = PROMPTS[1]
    ref = reference(target, prompt, new=60)[0].tolist()
    gen = SpeculativeGenerator(target, ScriptedDrafter(torch.tensor(ref), 97, decoy_at={3: 0}), tree_budget=16)
    out = gen.generate(torch.tensor([prompt]), max_new_tokens=50, record_trees=True)
    acc = out.acceptance_lengths
    assert acc == [expected_acceptance(r, ref) for r in out.rounds] and acc[0] == 5  # the decoy's runner-up is in
    rows = list(gen.stream(torch.tensor([prompt]), max_new_tokens=50))
    assert all(len(r) == 1 for r in rows)  # one list per row, for one prompt too
    chunks = [r[0] for r in rows]
    assert len(chunks) == 1 + len(acc) and len(chunks[0]) == 1  # the prefill's token, then one chunk per round
    assert [len(c) for c in chunks[1:-1]] == acc[:-1]
    assert len(chunks[-1]) == 50 - 1 - sum(acc[:-1]) <= acc[-1]
    assert sum(chunks, []) == out.new_tokens[0].tolist() == ref[len(prompt):len(prompt) + 50]


def test_budget_zero_is_plain_decoding(tiny_pair):
    target, draft = tiny_pair
    out = SpeculativeGenerator(target, draft, tree_budget=0).generate(torch.tensor([PROMPTS[0]]), max_new_tokens=20)
    assert torch.equal(out.sequences, reference(target, PROMPTS[0], new=20))
    assert out.acceptance_lengths == [1] * 19


def test_callable_builder_is_used(tiny_pair):
    target, draft = tiny_pair
    calls = []

    def narrow(root, logprobs, budget):
        calls.append(budget)
        return beam(1, 2)(root, logprobs, budget)

    out = SpeculativeGenerator(target, draft, tree_budget=5, builder=narrow).generate(
        torch.tensor([PROMPTS[0]]), max_new_tokens=20, record_trees=True
    )
    assert torch.equal(out.sequences, reference(target, PROMPTS[0], new=20))
    assert calls and set(calls) == {5}
    assert all(r.tree.num_nodes <= 3 for r in out.rounds)


def test_stats_cover_every_stage(tiny_pair):
    target, draft = tiny_pair
    out = SpeculativeGenerator(target, draft, tree_budget=8).generate(torch.tensor([PROMPTS[0]]), max_new_tokens=20)
    for stage in ("prefill", "draft", "tree_build", "mask", "verify", "commit"):
        assert out.stats.seconds[stage] > 0
    assert out.stats.new_tokens == 20
    assert out.stats.mean_acceptance == pytest.approx(sum(out.acceptance_lengths) / len(out.acceptance_lengths))
    assert out.stats.budgets == [8] * out.stats.rounds


# --------------------------------------------------------------------- settings: GeneratorOptions, per call


def test_options_are_checked_once_when_made_and_each_refusal_names_its_fix(tiny_pair):
    """Every setting is checked when the options are made (before any model is touched); a generator's
    keywords are the same settings and override ``options=``; ``replace`` checks its copy."""
    import dataclasses

    from ddtree import GeneratorOptions

    target, draft = tiny_pair
    bad = {
        "tree_budget": (-1, ValueError, "tree_budget must be an int >= 0"),
        "builder": ("widest", ValueError, "unknown tree builder 'widest'"),
        "attention": ("flashy", ValueError, "unknown attention backend 'flashy'"),
        "cpu_linear": ("yes", ValueError, "cpu_linear must be True, False or 'auto'"),
        "threads": (0, ValueError, "threads must be 'auto', an int >= 1 or None"),
        "compile": ("", ValueError, "compile must be True, False or a torch.compile backend name"),
        "prefill_chunk": (0, ValueError, "prefill_chunk must be an int >= 1"),
        "coupled_drafts": ("yes", ValueError, "coupled_drafts must be True, False or None"),
        "prompt_lookup": (1, ValueError, "prompt_lookup must be True, False or None"),
        "numerics": ("bitwise", ValueError, "numerics must be 'fast', 'exact' or None"),
    }
    assert set(bad) == {f.name for f in dataclasses.fields(GeneratorOptions)}  # every setting has its check
    for name, (value, error, message) in bad.items():
        with pytest.raises(error, match=message):
            GeneratorOptions(**{name: value})
        with pytest.raises(error, match=message):
            GeneratorOptions().replace(**{name: value})
        with pytest.raises(error, match=message):
            SpeculativeGenerator(target, draft, **{name: value})
    with pytest.raises(TypeError, match="attention must be a backend name.*got int"):
        GeneratorOptions(attention=3)
    with pytest.raises(TypeError, match="unknown generator setting.*budget; the settings are tree_budget, builder, "
                                        "attention, cpu_linear, threads, prefill_chunk"):
        SpeculativeGenerator(target, draft, budget=4)
    with pytest.raises(TypeError, match="options must be a ddtree GeneratorOptions, got dict"):
        SpeculativeGenerator(target, draft, options={"tree_budget": 4})
    with pytest.raises(dataclasses.FrozenInstanceError):
        GeneratorOptions().builder = "chain"

    opts = GeneratorOptions(tree_budget=16, builder="chain", prefill_chunk=None)
    gen = SpeculativeGenerator(target, draft, options=opts, tree_budget=8)
    # the generator fills its defaults in: here no merged prompt lookup (the suite's default, conftest), and the
    # device's numerics
    assert gen.options == opts.replace(tree_budget=8, prompt_lookup=False, numerics=default_numerics(target))
    assert (gen.tree_budget, gen.prefill_chunk) == (8, None)
    assert gen.builder is beam.__globals__["BUILDERS"]["chain"]
    assert SpeculativeGenerator(target, draft).options.tree_budget == 4  # the suite's fixed default (conftest)


class Replay(BudgetPolicy):
    """The budgets another generation chose, round by round (0: a round without a tree)."""

    def __init__(self, budgets: list[int]) -> None:
        self.budgets, self.rounds = budgets, 0

    def prepare(self, context_len: int, batch: int) -> None:
        self.rounds += 1
        self.skip_draft = self.budgets[self.rounds - 1] == 0

    def choose(self, proposal: Proposal, context_len: int) -> int:
        return self.budgets[self.rounds - 1]


@pytest.mark.real_default
def test_the_default_budget_is_auto_and_a_fixed_one_under_compile(tiny_pair):
    """A generator built without a budget decodes under ``"auto"`` (compile=True, which needs an int: 4 on a
    CPU): the target's greedy tokens, and each round's acceptance what the same budgets give when replayed."""
    target, draft = tiny_pair
    assert SpeculativeGenerator(target, draft, compile=True).tree_budget == 4  # first: the last one built owns
    gen = SpeculativeGenerator(target, draft)  # the target (compile=True takes exact numerics' kernels back)
    assert gen.options.tree_budget == gen.tree_budget == "auto"
    gen.tree_budget = 8
    gen.tree_budget = None  # back to the default
    assert gen.tree_budget == "auto"
    for prompt in PROMPTS:
        out = gen.generate(prompt, max_new_tokens=40)
        assert out.stats.budget_policy["policy"] == "auto"
        assert out.sequences[0].tolist() == reference(target, prompt, new=40)[0].tolist()
        replayed = gen.generate(prompt, max_new_tokens=40, tree_budget=Replay(out.stats.budgets))
        assert replayed.acceptance_lengths == out.acceptance_lengths and replayed.stats.budgets == out.stats.budgets


@pytest.mark.real_default
def test_the_default_generator_merges_prompt_lookup_and_accepts_its_branch(tiny_pair):
    """By default every tree gets a prompt-lookup branch (``prompt_lookup=False`` keeps the bare drafter; prompt
    lookup itself is not wrapped again). On a prompt that repeats itself the target's greedy tokens, each round
    accepting what its recorded tree gives under them, and lookup nodes among the accepted ones."""
    target, draft = tiny_pair
    gen = SpeculativeGenerator(target, draft, tree_budget=6)
    assert gen.options.prompt_lookup is True and isinstance(gen.drafter, WithLookup)
    assert not isinstance(SpeculativeGenerator(target, draft, prompt_lookup=False).drafter, WithLookup)
    lookup = PromptLookup.for_target(target, block_size=5)
    assert SpeculativeGenerator(target, lookup).drafter is lookup
    ref = reference(target, PROMPTS[2], new=40)[0].tolist()
    prompt = ref[:len(PROMPTS[2]) + 20] * 2  # the target's own continuation, twice: lookup has it to match
    want = reference(target, prompt, new=24 + 6)[0].tolist()  # the last round may accept past the end
    out = gen.generate(prompt, max_new_tokens=24, record_trees=True, stop_token_ids=())
    assert out.sequences[0].tolist() == want[:len(prompt) + 24]
    assert out.acceptance_lengths == [expected_acceptance(rec, want) for rec in out.rounds]
    accepted_lookup = [int(rec.tree.sources[0, i]) & LOOKUP for rec in out.rounds if rec.tree.sources is not None
                       for i in rec.accepted[1:]]
    assert any(accepted_lookup)


def _decoy_case(target):
    """A drafter whose depth-3 top token is wrong: best_first keeps the runner-up (acceptance 5 in the
    first round), a chain of the top tokens stops before it (acceptance 3)."""
    ref = reference(target, PROMPTS[1], new=40)[0]
    return ref, ScriptedDrafter(ref, 97, decoy_at={3: 0})


def test_builder_per_call_equals_a_generator_built_with_it_and_leaves_the_generator_alone(tiny_pair):
    from ddtree.core.builders import BUILDERS

    target, _ = tiny_pair
    ref, drafter = _decoy_case(target)
    gen = SpeculativeGenerator(target, drafter, tree_budget=16)
    chain_gen = SpeculativeGenerator(target, drafter, tree_budget=16, builder="chain")
    want = ref[len(PROMPTS[1]):len(PROMPTS[1]) + 30].tolist()
    own = gen.generate(PROMPTS[1], max_new_tokens=30, record_trees=True)
    call = gen.generate(PROMPTS[1], max_new_tokens=30, record_trees=True, builder="chain")
    built = chain_gen.generate(PROMPTS[1], max_new_tokens=30, record_trees=True)
    assert own.row_tokens[0] == call.row_tokens[0] == built.row_tokens[0] == want
    ref_tokens = ref.tolist()
    for out in (own, call, built):
        assert out.acceptance_lengths == [expected_acceptance(r, ref_tokens) for r in out.rounds]
    assert own.acceptance_lengths[0] == 5 and call.acceptance_lengths[0] == 3
    assert call.acceptance_lengths == built.acceptance_lengths
    for record in call.rounds:  # a chain: every node's parent is the node before it
        parents = record.tree.parents[0].tolist()
        assert parents[1:] == list(range(len(parents) - 1))
    # the generator's own builder is untouched by the call
    assert gen.builder is BUILDERS["best_first"] and gen.options.builder == "best_first"
    again = gen.generate(PROMPTS[1], max_new_tokens=30)
    assert again.acceptance_lengths == own.acceptance_lengths
    # per call through stream() and start() as well, and into an auto budget's tree sizing
    streamed_rows = list(gen.stream(PROMPTS[1], max_new_tokens=30, builder="chain"))
    assert [t for rows in streamed_rows for t in rows[0]] == want
    assert [len(rows[0]) for rows in streamed_rows[1:-1]] == call.acceptance_lengths[:-1]
    state = gen.start(PROMPTS[1], max_new_tokens=4, builder="chain", tree_budget="auto")
    assert state.generator.builder is BUILDERS["chain"] and state.policy.builder is BUILDERS["chain"]
    assert state.generator.target is gen.target and gen.start(PROMPTS[1], max_new_tokens=4).generator is gen


def test_per_call_settings_and_their_refusals(tiny_pair):
    target, draft = tiny_pair
    gen = SpeculativeGenerator(target, draft, tree_budget=8)
    ref = reference(target, PROMPTS[2], new=12)
    for call in (dict(tree_budget=0), dict(prefill_chunk=7), dict(prefill_chunk=None), dict(builder="beam@2x3"),
                 dict(tree_budget=None, builder=None)):  # None for budget/builder: the generator's own
        out = gen.generate(PROMPTS[2], max_new_tokens=12, **call)
        assert torch.equal(out.sequences, ref), call
        if call.get("tree_budget") == 0:
            assert out.acceptance_lengths == [1] * 11 and out.stats.tree_budget == 0
        else:
            assert out.stats.tree_budget == 8
    for name, value in (("attention", "sdpa"), ("cpu_linear", "auto"), ("threads", 1), ("prompt_lookup", True)):
        for method in (gen.generate, gen.start, lambda *a, **k: next(gen.stream(*a, **k))):
            with pytest.raises(ValueError, match=f"{name} prepares the models, so it is set on the generator, "
                                                 "not per call.*per call: tree_budget, builder, prefill_chunk, "
                                                 "coupled_drafts"):
                method(PROMPTS[0], max_new_tokens=3, **{name: value})
    with pytest.raises(ValueError, match="unknown tree builder 'widest'"):
        gen.generate(PROMPTS[0], max_new_tokens=3, builder="widest")
    with pytest.raises(ValueError, match="tree_budget must be an int >= 0"):
        gen.generate(PROMPTS[0], max_new_tokens=3, tree_budget=-2)
    accepted = ("max_new_tokens, max_length, do_sample, temperature, top_k, top_p, eos_token_id, stop_token_ids, "
                "seed, tree_budget, builder, prefill_chunk, coupled_drafts, attention_mask, record_trees, streamer")
    with pytest.raises(TypeError, match=r"unknown option\(s\) num_tokens; accepted: " + accepted):
        gen.generate(PROMPTS[0], num_tokens=3)
    assert gen.options.tree_budget == 8 and gen.options.prefill_chunk == 4096  # calls change nothing


def test_generator_setters_go_through_the_options(tiny_pair):
    """``gen.builder = ...`` and friends replace the options (checked); the per-model settings cannot change."""
    from ddtree.core.builders import BUILDERS

    target, draft = tiny_pair
    gen = SpeculativeGenerator(target, draft, tree_budget=8)
    gen.builder = "chain"
    gen.tree_budget = None  # back to the default (the suite's fixed one: conftest)
    assert gen.options.builder == "chain" and gen.builder is BUILDERS["chain"] and gen.tree_budget == 4
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        gen.prefill_chunk = -1
    with pytest.raises(ValueError, match="attention prepared the models when this generator was built: build a new"):
        gen.options = gen.options.replace(attention="sdpa")
    assert gen.options.prefill_chunk == 4096 and gen.options.attention == "auto"


def test_tokenizer_is_a_constructor_argument(tiny_pair):
    from tiny import tiny_tokenizer

    target, draft = tiny_pair
    tok = tiny_tokenizer()
    gen = SpeculativeGenerator(target, draft, tokenizer=tok, tree_budget=8)
    assert gen.tokenizer is tok
    out = gen.generate("w11 w5 w17 w40", max_new_tokens=6, record_trees=True)
    ids = torch.tensor([tok("w11 w5 w17 w40")["input_ids"]])
    ref = target.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out.sequences, ref) and out.text == [tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)]
    assert out.acceptance_lengths == [expected_acceptance(r, ref[0].tolist()) for r in out.rounds]
    assert SpeculativeGenerator(target, draft).tokenizer is None
