"""The static round (``compile=...``): fixed-shape steps traced whole by ``torch.compile(fullgraph=True)``.

Each case runs a generation twice, through the dynamic round and through the static one, and checks the
tokens, every round's tree and accepted path, and the acceptance (equal to each other and to a recompute
against HF ``generate``), with zero graph breaks and one host read per round. Most cases compile with the
``aot_eager`` backend (dynamo's full trace and AOT autograd's functionalisation, which is what CUDA graphs
need, without inductor's code generation); one case runs inductor itself, which takes minutes on a CPU.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from test_batch import RowDecoys
from test_generator import expected_acceptance, reference
from test_hybrid_batch import _case
from tiny import ScriptedDrafter, family_target, tiny_drafter, tiny_target

from ddtree import Proposal, SpeculativeGenerator
from ddtree.budget.policy import BudgetPolicy
from ddtree.drafters.dflash.drafter import DFlashDrafter
from ddtree.generation import static_round
from ddtree.generation.round import speculative_round
from ddtree.runtime.host_reads import count_host_reads
from ddtree.targets import cpu_linear
from ddtree.targets.cache import new_target_cache

PROMPTS = [[5, 17, 42, 8, 9, 33], [7, 7, 21, 60, 12, 5, 44, 3, 19], [11, 4], [90, 2, 36, 51, 8, 14, 27]]
NEW = 20
BACKEND = "aot_eager"


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3")
    return target, DFlashDrafter(tiny_drafter(target, block_size=5), target)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def run(gen, prompts, count_reads=False, **options):
    """A generation round by round; returns the state and each steady round's host reads."""
    state = gen.start(prompts, max_new_tokens=NEW, record_trees=True, **options)
    speculative_round(state)
    reads = []
    while not state.done:
        if not count_reads:  # a read-counting dispatch mode cannot run under torch.compile
            speculative_round(state)
            continue
        with count_host_reads() as counted:
            result = speculative_round(state)
        if not result.finished and state.stats.rounds > 1:  # the first round converts the buffers
            reads.append(counted.count)
    return state, reads


def assert_one_read_per_round(target, drafter, prompts, compiled, stop_token_ids=(), **settings):
    """The static round with its steps run as plain Python (a read-counting dispatch mode cannot run inside a
    compiled graph, and a read inside one would have broken the full trace): one host read per round, and the
    compiled run's tokens and acceptance."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(static_round, "_compiled", lambda fn, compile, cuda=False: fn)
        gen = SpeculativeGenerator(target, drafter, compile=BACKEND, **settings)
        state, reads = run(gen, prompts, count_reads=True, stop_token_ids=stop_token_ids)
    assert reads and reads == [1] * len(reads)
    assert state.new_tokens == compiled.new_tokens and state.acceptance == compiled.acceptance


def assert_same_rounds(static, dynamic, rows):
    assert static.new_tokens == dynamic.new_tokens
    assert static.acceptance == dynamic.acceptance
    for b in range(rows):
        assert len(static.records[b]) == len(dynamic.records[b])
        for mine, theirs in zip(static.records[b], dynamic.records[b]):
            assert mine.start == theirs.start
            assert torch.equal(mine.tree.tokens, theirs.tree.tokens)
            assert torch.equal(mine.tree.parents, theirs.tree.parents)
            assert mine.accepted == theirs.accepted and mine.bonus == theirs.bonus


def assert_target_acceptance(target, state, prompts):
    for b, prompt in enumerate(prompts):
        ref = reference(target, prompt, new=NEW + 8)[0].tolist()  # past the cut: a last round verifies beyond it
        assert state.new_tokens[b] == ref[len(prompt) : len(prompt) + NEW]
        assert state.acceptance[b] == [expected_acceptance(rec, ref) for rec in state.records[b]]


@pytest.mark.parametrize("builder,budget,rows", [("best_first", 6, 1), ("best_first", 6, 4)])  # chain: test_bench
def test_static_round_traces_whole_and_equals_the_dynamic_round(pair, builder, budget, rows):
    target, drafter = pair
    prompts = PROMPTS[:rows]
    dynamic, _ = run(SpeculativeGenerator(target, drafter, tree_budget=budget, builder=builder), prompts,
                     stop_token_ids=())
    gen = SpeculativeGenerator(target, drafter, tree_budget=budget, builder=builder, compile=BACKEND)
    static, _ = run(gen, prompts, stop_token_ids=())
    assert graph_breaks() == 0
    assert_one_read_per_round(target, drafter, prompts, static, tree_budget=budget, builder=builder)
    assert_same_rounds(static, dynamic, rows)
    assert_target_acceptance(target, static, prompts)
    assert isinstance(static.on_device.static.cache, static_round.RowPackedCache)
    assert static.on_device.cache is None  # freed at the end


@pytest.mark.parametrize("sampled", [False, True])
def test_compiled_plain_decoding_is_plain_decoding(pair, sampled):
    """``tree_budget=0`` under ``compile``: plain decoding as the static steps (a one-node verify and its commit),
    traced whole, one host read a step, the drafter never run and no drafter context kept; the tokens are the
    eager plain step's (greedy: HF's; sampled: the same keyed draws), every step accepting the root alone."""
    target, drafter = pair
    options = dict(do_sample=True, temperature=0.8, seed=5) if sampled else {}
    calls = []
    hook = drafter.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        eager, _ = run(SpeculativeGenerator(target, drafter, tree_budget=0), PROMPTS, stop_token_ids=(), **options)
        gen = SpeculativeGenerator(target, drafter, tree_budget=0, compile=BACKEND)
        static, _ = run(gen, PROMPTS, stop_token_ids=(), **options)
    finally:
        hook.remove()
    assert graph_breaks() == 0
    assert not calls
    assert static.new_tokens == eager.new_tokens and all(len(t) == NEW for t in static.new_tokens)
    assert static.acceptance == eager.acceptance == [[1] * (NEW - 1)] * len(PROMPTS)  # the prefill emits one
    assert static.stats.budgets == eager.stats.budgets == []  # plain steps, not tree rounds the policy skipped
    assert static.on_device.static.draft is None
    assert [(n, drafting) for _, n, _, drafting in gen._static_steps] == [(0, False)]
    if not sampled:
        for b, prompt in enumerate(PROMPTS):
            ref = reference(target, prompt, new=NEW)[0].tolist()
            assert static.new_tokens[b] == ref[len(prompt):]
        assert_one_read_per_round(target, drafter, PROMPTS, static, tree_budget=0)


def test_sampled_static_round_draws_what_the_dynamic_round_draws(pair):
    target, drafter = pair
    options = dict(do_sample=True, temperature=0.8, seed=11, stop_token_ids=())
    dynamic, _ = run(SpeculativeGenerator(target, drafter, tree_budget=6), PROMPTS, **options)
    static, _ = run(SpeculativeGenerator(target, drafter, tree_budget=6, compile=BACKEND), PROMPTS, **options)
    assert graph_breaks() == 0
    assert_same_rounds(static, dynamic, len(PROMPTS))
    for b in range(len(PROMPTS)):
        assert [len(rec.accepted) for rec in static.records[b]] == static.acceptance[b]


def test_rows_that_stop_early_ride_along_and_capacity_grows(pair, monkeypatch):
    """A stop token ends some rows rounds before the others (they stay in the buffers, unseen), and a small
    capacity step makes the buffers grow mid-generation (a new graph, the same tokens)."""
    target, drafter = pair
    monkeypatch.setattr(static_round, "CAPACITY_STEP", 32)  # 32 columns at first, 64 after one growth
    free, _ = run(SpeculativeGenerator(target, drafter, tree_budget=6), PROMPTS, stop_token_ids=())
    stop = free.new_tokens[2][5]  # row 2's sixth token ends it early; other rows stop where it appears in theirs
    dynamic, _ = run(SpeculativeGenerator(target, drafter, tree_budget=6), PROMPTS, stop_token_ids=(stop,))
    static, _ = run(SpeculativeGenerator(target, drafter, tree_budget=6, compile=BACKEND), PROMPTS,
                    stop_token_ids=(stop,))
    assert len(static.new_tokens[2]) <= 6 < max(len(t) for t in static.new_tokens)
    assert graph_breaks() == 0
    assert_same_rounds(static, dynamic, len(PROMPTS))
    assert static.on_device.static.cache.capacity == 64  # grew once from the patched step


def test_a_cuda_graphed_round_begins_one_graph_generation(pair):
    """Under CUDA graphs (compile=True on a CUDA target) the three steps of a round are one generation of graphs:
    without a mark at each round's start every step begins its own, and the draft's tree is overwritten before
    verify reads it (what the first H200 run of the GPU check hit). Here the steps run uncompiled and the mark is
    counted; ``tests/gpu_exactness.py`` (compiled_fp32) runs it under real CUDA graphs."""
    target, drafter = pair
    gen = SpeculativeGenerator(target, drafter, tree_budget=6, compile=BACKEND)
    marks = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(static_round, "_compiled", lambda fn, compile, cuda=False: fn)
        patch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
        eager_graphs, _ = run(gen, PROMPTS[:2], stop_token_ids=())
        assert not marks  # not a CUDA target: no graph generations to mark
        gen.static_steps(6).cuda_graphs = True
        state, _ = run(gen, PROMPTS[:2], stop_token_ids=())
    assert len(marks) == state.stats.rounds  # one per tree round (stats count the rounds after the prefill)
    assert state.new_tokens == eager_graphs.new_tokens and state.acceptance == eager_graphs.acceptance


@pytest.mark.parametrize("family", ["cohere2"])
def test_windowed_targets_mask_by_position_in_the_packed_cache(family):
    """Windowed and full layers (cohere2, 3 sliding : 1 full: a mask per layer type), with prompts past the
    window."""
    target = family_target(family)
    drafter = DFlashDrafter(tiny_drafter(target, block_size=5), target)
    assert_static_equals_dynamic(target, drafter, [p * 2 for p in PROMPTS[:2]])


def assert_static_equals_dynamic(target, drafter, prompts, budget=6):
    """Both rounds on ``prompts``: a whole trace, the same rounds, and the target's own tokens and acceptance."""
    dynamic, _ = run(SpeculativeGenerator(target, drafter, tree_budget=budget), prompts, stop_token_ids=())
    static, _ = run(SpeculativeGenerator(target, drafter, tree_budget=budget, compile=BACKEND), prompts,
                    stop_token_ids=())
    assert graph_breaks() == 0
    assert_same_rounds(static, dynamic, len(prompts))
    assert_target_acceptance(target, static, prompts)


def test_moe_experts_trace_in_a_fixed_shape_implementation():
    """MoE (qwen3_moe): transformers' eager experts loop (its length depends on the tokens) is refused with the
    way out; with ``batched_mm`` the verify traces whole and the static round equals the dynamic one."""
    target = family_target("qwen3_moe")  # tiny.py picks the eager experts (grouped_mm takes no float64)
    if not hasattr(target, "set_experts_implementation"):
        pytest.skip("this transformers has no experts implementations to choose from")
    drafter = DFlashDrafter(tiny_drafter(target, block_size=5), target)
    with pytest.raises(ValueError, match="set_experts_implementation"):
        SpeculativeGenerator(target, drafter, tree_budget=6, compile=BACKEND)
    target.set_experts_implementation("batched_mm")
    try:
        assert_static_equals_dynamic(target, drafter, PROMPTS[:2])
    finally:
        target.set_experts_implementation("eager")


def test_inductor_compiled_round_equals_the_dynamic_round():
    """``compile=True`` itself (inductor's generated code), float32, batch 1, with the prompt-lookup graft (whose
    boolean gathers once failed inductor's C++ build) and the linears routed to the packed kernel. The code
    allocates no buffer of a layer's cache (a write into it stays in place) nor of its keys per query head
    (sdpa reads the grouped ones): see the control below."""
    from torch._inductor.utils import run_and_get_code

    target = tiny_target("qwen3", dtype=torch.float32)
    drafter = DFlashDrafter(tiny_drafter(target, block_size=5), target)
    prompt = [PROMPTS[1]]
    routed = cpu_linear.available()  # the packed kernel, as a pretrained float32 pair on a CPU runs
    dynamic, _ = run(SpeculativeGenerator(target, drafter, tree_budget=6, prompt_lookup=True, cpu_linear=routed),
                     prompt, stop_token_ids=())
    gen = SpeculativeGenerator(target, drafter, tree_budget=6, compile=True, prompt_lookup=True, cpu_linear=routed)
    (static, _), code = run_and_get_code(run, gen, prompt, stop_token_ids=())
    assert graph_breaks() == 0
    assert_same_rounds(static, dynamic, 1)
    assert_target_acceptance(target, static, prompt)
    config, capacity = target.config, static.on_device.static.cache.capacity
    assert len(code) == 3  # draft, verify, commit
    if routed:  # every routed linear of the target one packed-kernel call in the verify
        assert code[1].count("ddtree.packed_linear.default(") == cpu_linear.installed(target) > 0
    for heads in (config.num_key_value_heads, config.num_attention_heads):
        assert not _allocates((1, heads, capacity, config.head_dim), "\n".join(code))


def _allocates(shape: tuple, code: str) -> bool:
    return f"empty_strided_cpu({shape}" in code


def test_the_allocation_check_sees_a_copied_cache_and_expanded_keys():
    """The control of the check above: a scatter into a graph's input buffer compiles to a copy of the buffer,
    and keys repeated per query head to a buffer of their expanded shape; ``put_columns`` and grouped sdpa
    allocate neither, and write the scatter's bits."""
    from torch._inductor.utils import run_and_get_code

    from ddtree.targets.static_cache import put_columns

    torch.manual_seed(0)
    buf, states = torch.randn(2, 3, 40, 8), torch.randn(2, 3, 2, 8)
    cols = torch.tensor([[5, 6], [17, 18]])

    def scattered(buf, cols, states):
        buf.scatter_(2, cols[:, None, :, None].expand_as(states), states)
        return buf.sum()

    def put(buf, cols, states):
        put_columns(buf, cols, states)
        return buf.sum()

    q, mask = torch.randn(2, 6, 1, 8), torch.zeros(2, 1, 1, 40)

    def repeated(q, k, mask):
        k = k.repeat_interleave(2, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask)

    def grouped(q, k, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)

    outs = {}
    for fn, args, shape, allocates in ((scattered, (buf.clone(), cols, states), (2, 3, 40, 8), True),
                                       (put, (buf.clone(), cols, states), (2, 3, 40, 8), False),
                                       (repeated, (q, buf, mask), (2, 6, 40, 8), True),
                                       (grouped, (q, buf, mask), (2, 6, 40, 8), False)):
        torch._dynamo.reset()
        _, code = run_and_get_code(torch.compile(fn, fullgraph=True, dynamic=False), *args)
        assert _allocates(shape, "\n".join(code)) == allocates, fn.__name__
        outs[fn.__name__] = args[0]
    assert torch.equal(outs["put"], outs["scattered"]) and not torch.equal(outs["put"], buf)


def test_a_per_call_builder_and_budget_get_their_own_steps(pair):
    """``generate(builder=..., tree_budget=...)`` on a compiled generator runs that builder at that budget (its
    own steps), the same tokens and trees as a generator built with them."""
    target, drafter = pair
    gen = SpeculativeGenerator(target, drafter, tree_budget=6, compile="eager")
    prompt = [PROMPTS[3]]
    mine = gen.generate(prompt, max_new_tokens=8, builder="chain", tree_budget=3, record_trees=True)
    built = SpeculativeGenerator(target, drafter, tree_budget=3, builder="chain").generate(
        prompt, max_new_tokens=8, record_trees=True)
    assert mine.row_tokens == built.row_tokens and mine.row_acceptance == built.row_acceptance
    assert all(r.tree.num_nodes == 4 for r in mine.row_rounds[0])  # chain of 3 under the call's budget
    assert {(getattr(b, "__name__", b), n) for b, n, _, _ in gen._static_steps} == {("chain", 3)}


def test_what_the_static_round_cannot_run_is_refused_with_the_way_out(pair):
    target, drafter = pair
    class Own(BudgetPolicy):
        def choose(self, proposal, context_len):
            return 2

    with pytest.raises(ValueError, match="fixed int tree_budget >= 0 .* or \"auto\""):
        SpeculativeGenerator(target, drafter, tree_budget=Own(), compile=True)
    with pytest.raises(ValueError, match="attention='sdpa'"):
        SpeculativeGenerator(target, drafter, tree_budget=4, attention="split", compile=True)
    with pytest.raises(ValueError, match="compile must be"):
        SpeculativeGenerator(target, drafter, tree_budget=4, compile="")
    scripted = ScriptedDrafter(torch.tensor(PROMPTS[0] + [0] * 8), target.config.vocab_size)  # no static context
    gen = SpeculativeGenerator(target, scripted, tree_budget=4, compile=BACKEND)
    with pytest.raises(ValueError, match="to_static"):
        gen.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=4)


def test_a_sweep_of_budgets_and_batch_sizes_compiles_past_dynamos_recompile_limit(pair):
    """Each budget's steps hold their own graphs and may hold one per batch size: with dynamo's limit at 1, a
    second budget and a second batch size in one process compile (each run equal to HF's tokens, acceptance a
    walk of each tree against them), where one shared code object would have failed (the control)."""
    target, drafter = pair
    if "recompile_limit" not in inspect.signature(torch.compile).parameters:  # an older torch: the global is raised
        pytest.skip("this torch.compile takes no per-call recompile_limit")
    limited = torch._dynamo.config.patch(recompile_limit=1)
    with limited:
        for budget in (3, 5):
            gen = SpeculativeGenerator(target, drafter, tree_budget=budget, compile="eager")
            state, _ = run(gen, PROMPTS[:1], stop_token_ids=())
            assert_target_acceptance(target, state, PROMPTS[:1])
        state, _ = run(gen, PROMPTS[:2], stop_token_ids=())  # the last budget's steps at a second batch size
        assert_target_acceptance(target, state, PROMPTS[:2])
    assert graph_breaks() == 0

    class Steps:  # the control: a second instance's graph for one shared code object is a recompile
        def __init__(self, budget):
            self.budget = budget

        def step(self, x):
            return x + self.budget

    with limited, pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        for budget in (1, 2):
            torch.compile(Steps(budget).step, fullgraph=True, backend="eager")(torch.ones(2))


def test_a_compiled_generator_refuses_a_target_an_exact_one_took_since(pair):
    """The last generator built prepares a target: after an exact one, a compiled generator built before it says
    so and how to go on, rather than failing inside dynamo on the exact kernels."""
    _, drafter = pair
    target = tiny_target("qwen3")
    drafter = DFlashDrafter(tiny_drafter(target, block_size=5), target)
    compiled = SpeculativeGenerator(target, drafter, tree_budget=4, compile=BACKEND)
    SpeculativeGenerator(target, drafter, tree_budget=4, numerics="exact")
    with pytest.raises(RuntimeError, match="numerics='fast', but a generator built later on its target prepared it "
                                           "for numerics='exact'.* build a new SpeculativeGenerator"):
        compiled.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=4)
    again = SpeculativeGenerator(target, drafter, tree_budget=4, compile=BACKEND)
    state, _ = run(again, PROMPTS[:1], stop_token_ids=())
    assert_target_acceptance(target, state, PROMPTS[:1])


class StaticDecoys(RowDecoys):
    """``RowDecoys`` (a known continuation, the true token pushed to rank 1 at a depth that varies by row and
    round) with a static context that proposes the same in tensor ops: trees accepted deep and differently
    per row, so the GDN states follow long, branching paths (a random DFlash drafter rarely passes depth 1)."""

    def new_context(self, batch_size=1):
        ctx = super().new_context(batch_size)
        ctx.to_static = lambda capacity: _StaticDecoyContext(self, list(ctx.rows), capacity)
        return ctx


class _StaticDecoyContext:
    def __init__(self, drafter, rows, capacity):
        self.drafter, self.capacity = drafter, capacity
        refs = [drafter.references[min(r, len(drafter.references) - 1)] for r in rows]
        self.ends = torch.tensor([len(r) for r in refs])
        width = int(self.ends.max())
        self.refs = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in refs])
        self.salts = torch.tensor([drafter.salts[r] for r in rows])

    def reserve(self, capacity):
        self.capacity = max(self.capacity, capacity)

    def append(self, features, tokens, lengths):
        pass  # the proposals follow the rows' lengths alone

    def propose(self, root_tokens, lengths):
        depth, vocab = self.drafter.block_size - 1, self.drafter.vocab
        slots = torch.arange(1, depth + 1)
        pos = lengths[:, None] + slots  # slot k proposes the reference at the root's position + k
        right = self.refs.gather(1, pos.clamp(max=self.refs.shape[1] - 1))
        hit = (pos < self.ends[:, None])[..., None] & (torch.arange(vocab) == right[..., None])
        lp = torch.where(hit, 10.0, -30.0).log_softmax(-1)
        clock = self.salts + lengths  # RowDecoys' decoy rule, per row
        at = 1 + clock % depth
        decoy = ((at < depth) & (clock % 3 == 0))[:, None] & (slots == at[:, None])
        return Proposal(torch.where(decoy[..., None], lp.roll(1, -1), lp))


def _cut(tokens, stops):
    """``tokens`` up to and including the first stop token."""
    ends = [i for i, t in enumerate(tokens) if t in stops]
    return tokens[: ends[0] + 1] if ends else tokens


def _layered_cache_or_skip(target):
    """Skip where this transformers gives the hybrid a cache without per-layer objects (``compile=True``
    refuses it there, saying so)."""
    if getattr(new_target_cache(target), "layers", None) is None:
        pytest.skip("this transformers' hybrid cache has no layers: compile=True refuses it")


@pytest.fixture(scope="module")
def hybrid_case():
    case = _case("qwen3_5")  # skipped where this transformers has no qwen3_5
    _layered_cache_or_skip(case[0])
    return case


@pytest.mark.parametrize("builder,budget", [("best_first", 6), ("chain", 4)])
@pytest.mark.parametrize("rows", [1, 4])
def test_gdn_hybrid_static_round_equals_the_dynamic_round(hybrid_case, builder, budget, rows, monkeypatch):
    """A GDN hybrid (qwen3_5: 3 GDN : 1 attention), float64: the conv windows and recurrent states in fixed
    buffers, each tree node's state from its parent's, each row's accepted path committed in place. At
    batch 4 the prompts are ragged (1 to 20 tokens), stop tokens end rows 0 and 2 early while the
    others go on, and the attention buffers grow mid-generation (the GDN states stay where they are)."""
    target, prompts, free, stops = hybrid_case
    if rows == 4:
        monkeypatch.setattr(static_round, "CAPACITY_STEP", 32)  # 32 columns at first, 64 after one growth
    picked = [1] if rows == 1 else list(range(4))
    prompts, free = [prompts[b] for b in picked], [free[b] for b in picked]
    references = [torch.tensor(p + f + [0] * 8) for p, f in zip(prompts, free)]
    drafter = StaticDecoys(references, target.config.vocab_size, list(range(rows)))
    settings = dict(tree_budget=budget, builder=builder)
    dynamic, _ = run(SpeculativeGenerator(target, drafter, **settings), prompts, stop_token_ids=stops)
    static, _ = run(SpeculativeGenerator(target, drafter, compile=BACKEND, **settings), prompts,
                    stop_token_ids=stops)
    assert graph_breaks() == 0
    assert_same_rounds(static, dynamic, rows)
    for b, prompt in enumerate(prompts):
        assert static.new_tokens[b] == _cut(free[b][:NEW], stops)  # HF greedy (stops only cut its free run)
        assert static.acceptance[b] == [expected_acceptance(r, prompt + free[b]) for r in static.records[b]]
    if rows == 4:
        assert len(static.new_tokens[0]) < NEW and len(static.new_tokens[2]) < NEW == len(static.new_tokens[1])
        accs = [a for a in static.acceptance if len(a) > 3]
        assert len(accs) > 1 and any(len(set(r)) > 1 for r in zip(*accs))  # rows accept differently in one round
    assert max(max(a) for a in static.acceptance if a) >= 4  # deep paths reach the GDN commit
    stateful = static.on_device.static.cache.stateful  # the GDN layers ran in the buffers their kind made
    assert [sorted(states.layers) for states in stateful] == [[0, 1, 2]]
    assert static.on_device.static.cache.capacity == (64 if rows == 4 else 256)
    assert_one_read_per_round(target, drafter, prompts, static, stop_token_ids=stops, **settings)


@pytest.mark.parametrize("sampled", [False, True])
def test_gdn_hybrid_with_the_dflash_drafter(sampled):
    """The DFlash drafter's static context on a GDN hybrid (its features from the hybrid's layers), a ragged
    batch, float32; greedy (acceptance against HF ``generate``) and sampled (the dynamic round's draws)."""
    target = family_target("qwen3_5", dtype=torch.float32)
    _layered_cache_or_skip(target)
    drafter = DFlashDrafter(tiny_drafter(target, block_size=5), target)
    options = dict(do_sample=True, temperature=0.8, seed=11) if sampled else {}
    dynamic, _ = run(SpeculativeGenerator(target, drafter, tree_budget=6), PROMPTS, stop_token_ids=(), **options)
    static, _ = run(SpeculativeGenerator(target, drafter, tree_budget=6, compile=BACKEND), PROMPTS,
                    stop_token_ids=(), **options)
    assert graph_breaks() == 0
    assert_same_rounds(static, dynamic, len(PROMPTS))
    if not sampled:
        assert_target_acceptance(target, static, PROMPTS)


class TickClock:
    """Seconds that advance by ``tick`` at every read: each compile then takes exactly ``tick``."""

    def __init__(self, tick: float):
        self.tick, self.now = tick, 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_compiling_says_each_graph_how_many_and_how_long(pair, monkeypatch, caplog):
    """``compile=`` is silent for minutes otherwise: one header, then per graph the step, its budget, rows and
    capacity, and when done its seconds and the count so far (on an injected clock); a buffer that grows
    compiles new graphs and says so; a second call that compiles nothing says nothing; quiet at WARNING, and
    nothing without compile. The compiled rounds accept what a recompute against HF greedy says."""
    import logging

    target, drafter = pair
    monkeypatch.setattr(static_round, "CAPACITY_STEP", 32)  # 32 columns at first, 64 after one growth
    caplog.set_level(logging.INFO, logger="ddtree")
    gen = SpeculativeGenerator(target, drafter, tree_budget=6, compile="eager")
    gen.compile_log.clock = TickClock(7.5)
    state, _ = run(gen, PROMPTS[1:2], stop_token_ids=())
    assert_target_acceptance(target, state, PROMPTS[1:2])
    lines = [r.getMessage() for r in caplog.records if r.name == "ddtree"]
    assert lines[0].startswith("compile: compiling the static round's steps, 3 graphs per tree budget")
    steps = [line for line in lines if line.startswith("compiling graph")]
    done = [line for line in lines if line.startswith("compiled graph")]
    assert steps[:3] == ["compiling graph 1: the draft step, budget 6, 1 row, capacity 32 ...",
                         "compiling graph 2: the verify step, budget 6, 1 row, capacity 32 ...",
                         "compiling graph 3: the commit step, budget 6, 1 row, capacity 32 ..."]
    assert "capacity 64" in steps[3]  # the buffers grew: new graphs, said as such
    assert len(steps) == len(done) == gen.compile_log.graphs and len(lines) == 1 + 2 * len(steps)
    assert done[0] == "compiled graph 1 (draft, budget 6) in 7.5 s; 1 graph in 7.5 s so far"
    assert done[-1].endswith(f"{len(done)} graphs in {7.5 * len(done):.1f} s so far")
    caplog.clear()
    run(gen, PROMPTS[1:2], stop_token_ids=())  # the same shapes: compiled already
    assert not [r for r in caplog.records if r.name == "ddtree"]
    torch._dynamo.reset()
    logging.getLogger("ddtree").setLevel(logging.WARNING)  # quiet, as asked
    try:
        quiet = SpeculativeGenerator(target, drafter, tree_budget=6, compile="eager")
        run(quiet, PROMPTS[1:2], stop_token_ids=())
        assert quiet.compile_log.graphs >= 3 and not [r for r in caplog.records if r.name == "ddtree"]
    finally:
        logging.getLogger("ddtree").setLevel(logging.INFO)
    uncompiled = SpeculativeGenerator(target, drafter, tree_budget=6)
    run(uncompiled, PROMPTS[1:2], stop_token_ids=())
    assert uncompiled.compile_log.graphs == 0 and not [r for r in caplog.records if r.name == "ddtree"]


def test_a_target_changed_between_generations_is_compiled_again(pair):
    """Compiled steps skip dynamo's per-call guards on module state; each generation compares the models with
    what the steps were built for instead. A hook added to the target between generations (here negating the
    LM head's logits, which changes every choice) rebuilds the steps: the tokens and acceptance of the hooked
    target's dynamic round. An unchanged target keeps its steps (no rebuild each generation); without the
    comparison the old graphs would run on, blind to the hook (the control, where this torch skips guards)."""
    target, drafter = pair
    prompt = [PROMPTS[3]]
    gen = SpeculativeGenerator(target, drafter, tree_budget=4, compile="eager")
    before = gen.generate(prompt, max_new_tokens=8)
    steps = dict(gen._static_steps)
    again = gen.generate(prompt, max_new_tokens=8)
    assert again.row_tokens == before.row_tokens and gen._static_steps == steps  # kept: nothing changed
    hook = target.lm_head.register_forward_hook(lambda module, args, out: -out)
    try:
        expected = SpeculativeGenerator(target, drafter, tree_budget=4).generate(prompt, max_new_tokens=8)
        if static_round._unguarded_modules():
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(SpeculativeGenerator, "keep_static_steps", lambda self: None)
                stale = gen.generate(prompt, max_new_tokens=8)
            assert stale.row_tokens != expected.row_tokens  # the eager prefill saw the hook, the old graphs not
        changed = gen.generate(prompt, max_new_tokens=8)
    finally:
        hook.remove()
    assert changed.row_tokens == expected.row_tokens != before.row_tokens
    assert changed.row_acceptance == expected.row_acceptance
    assert all(gen._static_steps[key] is not steps[key] for key in steps)  # built again
    for b, tokens in enumerate(before.row_tokens):  # and the unhooked target's tokens are HF's
        assert tokens == reference(target, prompt[b], new=8)[0].tolist()[len(prompt[b]):]
