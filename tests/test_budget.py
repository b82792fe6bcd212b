"""AutoBudget: the documented cost model picks the known optimum; calibration behaves; the round's contract."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import ScriptedDrafter, tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.blocks import DFlashDrafter, VerifyResult, best_first, chain
from ddtree.budget.acceptance import expected_tokens
from ddtree.budget.costs import context_bucket
from ddtree.budget.learned import Learned
from ddtree.budget.policy import AutoBudget, BudgetPolicy
from ddtree.core.builders import beam
from ddtree.core.graft import Branches
from ddtree.core.pairwise import PairwiseScores
from ddtree.drafters.base import Proposal, proposal_tree
from ddtree.runtime.host_reads import count_host_reads


def certain_logprobs(depth: int, vocab: int = 11) -> torch.Tensor:
    """The drafter is sure at every depth: one token with probability 1 (log-prob 0)."""
    lp = torch.full((1, depth, vocab), float("-inf"))
    lp[0, torch.arange(depth), torch.arange(depth) % vocab] = 0.0
    return lp


def measured(verify, candidates=(1, 2, 4, 8, 16), batch: int = 1, overhead: float = 0.01, **kw) -> AutoBudget:
    """A policy whose cost table measured every candidate once: ``verify(nodes, batch)`` seconds of the verify
    and ``overhead`` seconds for the rest of the round."""
    learned = Learned()
    for n in candidates:
        v = verify(n + 1, batch)
        learned.costs.record_tree(n + 1, batch, 100, round_seconds=overhead + v, verify_seconds=v)
    return AutoBudget(learned=learned, candidates=candidates, **kw)


def linear_policy(fixed: float, per_node: float, candidates=(1, 2, 4, 8, 16), **kw) -> AutoBudget:
    return measured(lambda nodes, batch: fixed + per_node * nodes, candidates, **kw)


def test_known_optimum_cheap_nodes():
    # E[tokens | n] = 1 + min(n, 6); seconds = 0.01 + 0.01 + 0.001 * (n + 1):
    # n=4 -> 5 / 0.025 = 200, n=8 -> 7 / 0.029 = 241, n=16 -> 7 / 0.037 = 189 tokens/s.
    policy = linear_policy(0.01, 0.001)
    assert policy.choose(Proposal(certain_logprobs(6)), 100) == 8
    assert policy.last["expected_tokens"] == {1: 2.0, 2: 3.0, 4: 5.0, 8: 7.0, 16: 7.0}


def test_known_optimum_expensive_nodes():
    # seconds = 0.02 + 0.01 * (n + 1): n=2 -> 3 / 0.05 = 60, n=4 -> 5 / 0.07 = 71.4, n=8 -> 7 / 0.11 = 63.6.
    assert linear_policy(0.01, 0.01).choose(Proposal(certain_logprobs(6)), 100) == 4


def test_choice_is_argmax_of_documented_formula():
    """Brute force: build every candidate tree separately and evaluate the formula by hand."""
    g = torch.Generator().manual_seed(3)
    cands = (1, 3, 6, 12, 24, 48)
    for trial in range(5):
        lp = (torch.randn(1, 5, 40, generator=g) * 3).log_softmax(-1)
        per_node = [0.0005, 0.002, 0.01][trial % 3]
        policy = linear_policy(0.004, per_node, candidates=cands)
        rates = {}
        for n in cands:
            tree = best_first(torch.zeros(1, dtype=torch.long), lp, n)
            p = torch.zeros(5, dtype=torch.float64)
            p.scatter_add_(0, tree.depths[0, 1:] - 1, tree.scores[0, 1:].double().exp())
            r = torch.cummin(p.clamp(max=1), 0).values
            rates[n] = float(1 + r.sum()) / (0.01 + 0.004 + per_node * (n + 1))
        assert policy.choose(Proposal(lp), 50) == max(cands, key=lambda n: (rates[n], -n))


@pytest.mark.parametrize("builder", [best_first, chain, beam(3, 4)])
def test_candidate_trees_are_prefixes(builder):
    lp = (torch.randn(1, 4, 30, generator=torch.Generator().manual_seed(0)) * 2).log_softmax(-1)
    policy = AutoBudget(builder=builder, candidates=(1, 2, 5, 9))
    reach = policy.pricer.reach(Proposal(lp)).mean(dim=0)
    for i, n in enumerate(policy.candidates):
        tree = builder(torch.zeros(1, dtype=torch.long), lp, n)
        p = torch.zeros(4, dtype=torch.float64)
        p.scatter_add_(0, tree.depths[0, 1:] - 1, tree.scores[0, 1:].double().exp())
        assert torch.allclose(reach[i].double(), p.clamp(max=1), atol=1e-6)


@pytest.mark.parametrize("kind", ["random", "tied", "tiny vocabulary"])
def test_the_round_tree_cut_from_the_pricing_tree_is_the_built_one(kind):
    """Best-first trees nest, so the policy's pricing tree, cut at the chosen budget, is exactly the tree the
    builder grows there (node order, ties and all); another builder, other log-probs or a larger budget get
    none (the round then builds its own)."""
    gen = torch.Generator().manual_seed(3)
    vocab = 3 if kind == "tiny vocabulary" else 40
    lp = torch.randn(2, 5, vocab, generator=gen) * 2
    lp = ((lp * 2).round() / 2 if kind == "tied" else lp).log_softmax(-1)
    policy = AutoBudget(candidates=(1, 2, 4, 8, 16, 64))
    roots = torch.tensor([7, 9])
    proposal = Proposal(lp)
    policy.pricer.reach(proposal, 16)
    for n in (1, 2, 3, 4, 8, 16):
        want = best_first(roots, lp, n)
        got = policy.tree(proposal, roots, n, best_first)
        for name in ("tokens", "parents", "depths", "scores", "visibility"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (n, name)
    assert policy.tree(proposal, roots, 17, best_first) is None  # past the pricing tree
    assert policy.tree(Proposal(lp), roots, 4, best_first) is None  # another proposal, if with equal values
    assert policy.tree(proposal, roots, 4, chain) is None  # the round builds another builder's tree itself
    other = AutoBudget(builder=chain, candidates=(1, 2, 4))
    other.pricer.reach(proposal, 4)
    assert other.tree(proposal, roots, 4, best_first) is None


def _result(num_accepted: int) -> VerifyResult:
    path = torch.arange(num_accepted)[None]
    return VerifyResult(path, torch.tensor([num_accepted]), torch.tensor([0]), torch.zeros(1, 1))


def test_calibration_learns_that_deep_drafts_fail():
    policy = linear_policy(0.01, 0.001)
    lp = certain_logprobs(6)
    assert policy.choose(Proposal(lp), 10) == 8
    for i in range(30):  # the drafter is sure, yet the target never goes past depth 1
        policy.observe([2], verify_seconds=0.019, context_len=10 + i)
    c = policy.carried.calibration.factors(6, policy.settings.prior_rounds)
    assert c[0] > 0.95 and all(f < 0.2 for f in c[1:])
    assert policy.choose(Proposal(lp), 50) < 8  # the deep half of the tree no longer pays for itself
    d = policy.describe()
    assert d["policy"] == "auto" and d["rounds"] == 30 and len(d["depth_calibration"]) == 6
    assert "E[tokens|n]" in d["cost_model"]


def test_observe_names_a_row_count_mismatch():
    policy = measured(lambda nodes, batch: 0.01 + 0.001 * nodes * batch, candidates=(1, 2, 4), batch=2)
    policy.choose(Proposal(certain_logprobs(6).expand(2, -1, -1)), 10)
    with pytest.raises(ValueError, match="one count per active row"):
        policy.observe([3], verify_seconds=0.01, context_len=10)


def test_context_bucket():
    assert [context_bucket(c) for c in (0, 1, 63, 64, 100, 128, 300)] == [64, 64, 64, 128, 128, 256, 512]


def test_auto_on_tiny_pair_is_lossless_and_described():
    torch.manual_seed(0)
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    gen = SpeculativeGenerator(target, drafter)
    policy = AutoBudget.for_generator(gen, candidates=(1, 4, 16))
    ids = torch.randint(0, 90, (1, 12))
    out = gen.generate(ids, max_new_tokens=20, tree_budget=policy)
    ref = gen.generate(ids, max_new_tokens=20, tree_budget=0)
    assert torch.equal(out.sequences, ref.sequences)
    assert set(out.stats.budgets) <= {0, 1, 4, 16} and out.stats.budgets  # 0: a round that did not draft
    assert all(1 <= a <= min(b, 4) + 1 for a, b in zip(out.acceptance_lengths, out.stats.budgets))
    desc = out.stats.budget_policy
    assert desc["last_round"]["chosen"] in (1, 4, 16)
    assert len(out.stats.reasons) == len(out.stats.budgets) and out.stats.reasons[0] == "first measurement"
    assert desc["state"] and all(isinstance(line, str) for line in desc["state"])


def test_auto_learns_from_its_rounds_without_a_profiling_stall():
    """No forward runs outside the rounds (one prefill forward, then one per round); the costs the first call
    learned are the generator's, so a second call chooses from them at once instead of starting blind."""
    torch.manual_seed(0)
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, tiny_drafter(target))
    forwards = []
    target.register_forward_pre_hook(lambda module, args: forwards.append(1))
    out = gen.generate(torch.randint(0, 90, (1, 20)), max_new_tokens=24, tree_budget="auto")
    desc = out.stats.budget_policy
    assert len(forwards) == 1 + out.stats.rounds and "latency" not in desc
    budgets = out.stats.budgets
    assert budgets[:2] == [0, 4]  # a plain step first (it measures what trees must beat), then the start budget
    assert set(budgets) <= {0} | set(desc["candidates"])
    learned = desc["costs"]["verify_seconds"]
    assert any(str(b + 1) in table for b in budgets if b for table in learned.values())
    assert desc["plain_round_seconds"] is not None and desc["rounds"] == len(budgets)
    again = gen.generate(torch.randint(0, 90, (1, 20)), max_new_tokens=24, tree_budget="auto")
    first = again.stats.budgets[0]
    # from the measured rates at once: a plain step or a budget measured by the first call (never the start
    # budget unmeasured), and the drafter's depth calibration carried over
    assert first in {0} | {int(n) - 1 for table in learned.values() for n in table}
    assert again.stats.budget_policy["depth_calibration"][:1] != [1.0]
    assert again.stats.budget_policy["costs"]["plain_seconds"]  # shared with the first call


class TickClock:
    """A fake clock: every read advances it by ``tick`` seconds, so a round that reads it once lasts ``tick``."""

    def __init__(self, tick: float):
        self.tick, self.now, self.reads = tick, 0.0, 0

    def __call__(self) -> float:
        self.now += self.tick
        self.reads += 1
        return self.now


class ModelClock:
    """A fake clock the simulated rounds advance: the policy reads it, a :class:`Modelled` policy moves it."""

    def __init__(self):
        self.now, self.reads = 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


class Modelled(AutoBudget):
    """An AutoBudget whose rounds take exactly what ``verify(nodes)`` says (not what the machine did): a plain
    round ``verify(1)``, a drafting round ``overhead + verify(nodes)``, added to its :class:`ModelClock`."""

    def __init__(self, verify, overhead: float, **kw):
        super().__init__(clock=ModelClock(), **kw)
        self.verify, self.overhead = verify, overhead

    def observe(self, accepted, verify_seconds, context_len):
        nodes = 1 if self.skip_draft else self.last["chosen"] + 1
        seconds = self.verify(nodes)
        self.clock.now += seconds + (0.0 if self.skip_draft else self.overhead)
        super().observe(accepted, seconds, context_len)


def test_auto_decodes_plainly_while_no_tree_pays_and_stays_exact():
    """Verify cost proportional to the node count (a compute-bound batch), a plain round of 10 ms on a fake clock
    and a drafter that is confident and never right: a plain step first, then the start tree (55 ms for 1
    token; it was expected to commit 5, and that expectation is the call's prior: 3 tokens, 55 tokens/s
    against plain's 100), each a first measurement. The first drafting round is no evidence to back off on, so
    it is retried after 2, at round 4, on the one measured tree (budget 4). Confirmed, the wait is spaced so
    that a retry costs at most ``retry_cost`` of the rounds' time (its rate loss times its round's length in
    plain rounds): round 55. The context reaches 64 tokens at round 60, a new context bucket counting its own
    rounds and spacing its first retry the same way: round 95. Every other round is plain at the best rate.
    No wall-clock time enters the choice: the sequence of budgets and reasons is exact."""
    target = tiny_target("qwen3")
    prompt = [5, 17, 3, 9]
    ids = torch.tensor([prompt])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=120, do_sample=False,
                          pad_token_id=0)[0, 4:].tolist()
    wrong = torch.tensor(prompt + [(t + 1) % 97 for t in ref] + [0] * 8)
    drafter = ScriptedDrafter(wrong, 97)
    gen = SpeculativeGenerator(target, drafter)
    policy = Modelled(lambda n: 0.01 * n, 0.005, candidates=(1, 2, 4), retry_every=64, retry_cost=0.1)
    clock = policy.clock
    out = gen.generate(prompt, max_new_tokens=120, tree_budget=policy)
    assert out.row_tokens[0] == ref
    assert out.acceptance_lengths == [1] * 119  # the drafter is never right
    budgets = out.stats.budgets
    trees = [i for i, b in enumerate(budgets) if b > 0]
    assert trees == [1, 4, 55, 95] and [budgets[i] for i in trees] == [4, 4, 4, 4], budgets
    reasons = {0: "first measurement", 1: "first measurement", 4: "retry", 55: "retry", 95: "retry"}
    assert out.stats.reasons == [reasons.get(i, "best rate") for i in range(len(budgets))]
    assert desc_calibration_falls(out.stats.budget_policy)
    assert len(drafter.proposals) == len(trees)  # skipped rounds did not draft
    desc = out.stats.budget_policy
    assert desc["plain_rounds"] == budgets.count(0) and desc["plain_round_seconds"] == pytest.approx(0.01)
    assert clock.reads == len(budgets)
    # cheap trees and a drafter that is always right: after the plain step every round drafts the full budget-4
    # chain but for plain retried once at round 3 (its first round is no evidence yet) and the neighbour (2)
    # explored at round 4 (never measured) and round 8 (measured: next after 37 drafting rounds, as it is
    # priced well below the best); plain, at 0.23x the drafting rate, waits out the longest interval
    right = ScriptedDrafter(torch.tensor(prompt + ref + [0] * 8), 97)
    cheap = Modelled(lambda n: 0.01 + 0.0001 * n, 0.001, candidates=(1, 2, 4))
    out = SpeculativeGenerator(target, right).generate(prompt, max_new_tokens=40, tree_budget=cheap)
    assert out.row_tokens[0] == ref[:40] and out.stats.budgets == [0, 4, 4, 0, 2, 4, 4, 4, 2, 4, 4], out.stats.budgets
    reasons = {0: "first measurement", 1: "first measurement", 3: "retry", 4: "explore", 8: "explore"}
    assert out.stats.reasons == [reasons.get(i, "best rate") for i in range(11)]
    assert any("a neighbour is tried in 37 drafting rounds" in line for line in out.stats.budget_policy["state"])
    accepted = [1 if b == 0 else min(b, 4) + 1 for b in out.stats.budgets]
    assert out.acceptance_lengths[:-1] == accepted[:-1]  # every draft accepted


def desc_calibration_falls(desc: dict) -> bool:
    """The drafter's depth-1 calibration fell well below 1 (it was never right)."""
    return desc["depth_calibration"][0] < 0.5


def test_auto_at_batch_three_is_lossless_and_accepts_what_each_budget_allows():
    """Ragged rows, learned costs on the real clock (choices vary run to run), a drafter that is always right:
    every row's output is its own greedy continuation, and every round each row accepts exactly what the
    round's budget allows (a full chain to depth 4, or the root alone on a plain step)."""
    target = tiny_target("qwen3")
    prompts = [[5, 17, 3, 9], [8, 2, 44, 61, 7, 30], [71, 12]]
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        refs.append(target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                    pad_token_id=0)[0].tolist())
    drafter = ScriptedDrafter([torch.tensor(r + [0] * 8) for r in refs], 97)
    out = SpeculativeGenerator(target, drafter).generate(prompts, max_new_tokens=30, tree_budget="auto")
    for row, (p, ref) in enumerate(zip(prompts, refs)):
        assert out.row_tokens[row] == ref[len(p): len(p) + 30]
    budgets = out.stats.budgets
    # a plain step measured first, then the start budget shared by the rows (4 // 3 rows: budget 1)
    assert budgets[:2] == [0, 1] and set(budgets) <= {0} | set(desc_candidates(out))
    desc = out.stats.budget_policy
    assert desc["last_round"]["batch"] == 3 and list(desc["costs"]["verify_seconds"]) == ["64x3"]
    allowed = [min(b, 4) + 1 for b in budgets]
    assert out.row_acceptance == [allowed] * 3


def desc_candidates(out) -> list[int]:
    return out.stats.budget_policy["candidates"]


def test_batch_budget_sums_rows_and_hopeless_rows_add_only_their_bonus():
    """One budget for the batch (the verify is rectangular): the argmax over n of the rows' summed E[tokens | n]
    over the seconds of B x (n + 1) nodes. Rows the drafter has no idea about (uniform log-probs) bring about
    one token whatever the budget, so next to a sure row they pull the choice down (they widen the verify
    without adding to what a bigger tree earns)."""
    per_node = 0.002
    def policy(batch: int) -> AutoBudget:
        return measured(lambda nodes, batch: 0.01 + per_node * nodes * batch, batch=batch)

    sure = certain_logprobs(6, vocab=50)
    hopeless = torch.full((3, 6, 50), -math.log(50))
    alone = policy(1).choose(Proposal(sure), 100)
    mixed = policy(4)
    batch = torch.cat([sure, hopeless])
    chosen = mixed.choose(Proposal(batch), 100)
    rows = mixed.pricer.reach(Proposal(batch))
    expected = expected_tokens(rows, torch.tensor(mixed.carried.calibration.factors(6, 1.0)))  # [B, C]
    total = expected.sum(dim=0)
    rates = {n: float(total[i]) / (0.01 + 0.01 + per_node * (n + 1) * 4) for i, n in enumerate(mixed.candidates)}
    assert chosen == max(rates, key=lambda n: (rates[n], -n)) and chosen < alone, (chosen, alone, rates)
    row_tokens = mixed.last["row_expected_tokens"]
    assert row_tokens[0] == pytest.approx(1 + min(chosen, 6)) and all(t < 1.2 for t in row_tokens[1:])


def test_the_round_calls_finish_once_and_the_next_call_starts_from_what_it_learned():
    """The round calls ``finish`` once, when the last row stops: the call hands its figures on, and the
    generator's next call starts from them (its cost table goes on counting the first call's rounds)."""
    torch.manual_seed(0)
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, tiny_drafter(target))
    calls = []

    class Counted(AutoBudget):
        def finish(self):
            calls.append(self.rounds)
            super().finish()

    out = gen.generate([[5, 17, 3, 9], [8, 2, 44]], max_new_tokens=12,
                       tree_budget=Counted.for_generator(gen))
    assert calls == [out.stats.budget_policy["rounds"]]
    assert gen.learned.carried.retries  # handed on
    again = gen.generate([5, 17, 3, 9], max_new_tokens=12, tree_budget="auto")
    assert again.stats.budget_policy["costs"]["rounds"] > out.stats.budget_policy["rounds"]


def _pairwise_and_branches(bsz: int = 3, depth: int = 5, k: int = 6, vocab: int = 40):
    g = torch.Generator().manual_seed(1)
    cand = torch.stack([torch.randperm(vocab, generator=g)[:k].sort().values for _ in range(bsz * depth)])
    scores = PairwiseScores(cand.view(bsz, depth, k), (torch.randn(bsz, k, generator=g) * 2).log_softmax(-1),
                            (torch.randn(bsz, depth - 1, k, k, generator=g) * 2).log_softmax(-1))
    lp = scores.along(scores.greedy_indices(), vocab)
    cumulative = torch.tensor([0.6, 0.5, 0.4, 0.3, 0.2]).log().cumsum(0).expand(bsz, 2, depth).contiguous()
    branches = Branches(torch.randint(0, vocab, (bsz, 2, depth), generator=g), cumulative,
                        torch.tensor([[5, 3], [0, 2], [4, 0]]))
    return lp, scores, branches


@pytest.mark.parametrize("kind", ["grafted", "pairwise", "pairwise and grafted"])
def test_the_policy_prices_the_tree_the_round_verifies(kind):
    """A DFlash2 proposal is verified as its pairwise tree and lookup branches are grafted in: the price of each
    candidate is the per-depth mass of exactly that tree at that budget, not of a best-first tree over the
    per-depth view (which would price another tree)."""
    lp, scores, branches = _pairwise_and_branches()
    proposal = Proposal(lp, paths=None if kind == "pairwise" else branches,
                        pairwise=None if kind == "grafted" else scores)
    policy = AutoBudget(candidates=(1, 2, 4, 8, 16))
    reach, plain_view = policy.pricer.reach(proposal), policy.pricer.reach(Proposal(lp))
    for i, n in enumerate(policy.candidates):
        tree = proposal_tree(proposal, torch.zeros(3, dtype=torch.long), best_first, n)
        mass = torch.zeros(3, 5).scatter_add_(1, tree.depths[:, 1:] - 1, tree.scores[:, 1:].float().exp())
        assert torch.allclose(reach[:, i], mass.clamp(max=1), atol=1e-6), n
    assert not torch.allclose(reach, plain_view)


def test_choose_reads_the_device_once():
    """The price of every candidate comes back in one read (on a GPU each read waits for the device)."""
    lp, scores, branches = _pairwise_and_branches()
    policy = linear_policy(0.01, 0.001)
    with count_host_reads() as reads:
        policy.choose(Proposal(lp, paths=branches, pairwise=scores), 100)
    assert reads.count == 1, dict(reads.by_site)


class _Returns(BudgetPolicy):
    def __init__(self, value) -> None:
        self.value = value

    def choose(self, proposal, context_len):
        return self.value


def test_a_policys_choice_is_an_int_budget_or_refused_naming_the_policy():
    """An integer of any kind (numpy, a 0-dim tensor) is a budget; anything else is refused at the round, naming
    the policy, not deep inside a tree builder."""
    import numpy as np

    target = tiny_target("qwen3")
    drafter = DFlashDrafter(tiny_drafter(target), target)
    want = SpeculativeGenerator(target, drafter, tree_budget=5).generate([5, 9, 12], max_new_tokens=12)
    for value in (np.int64(5), torch.tensor(5)):
        out = SpeculativeGenerator(target, drafter, tree_budget=_Returns(value)).generate([5, 9, 12],
                                                                                       max_new_tokens=12)
        assert out.row_tokens == want.row_tokens and out.row_acceptance == want.row_acceptance
        assert out.stats.budgets == [5] * len(out.stats.budgets)
    for value in (2.5, -1, True, "4"):
        gen = SpeculativeGenerator(target, drafter, tree_budget=_Returns(value))
        with pytest.raises(ValueError, match=r"_Returns\.choose returned .*a tree budget is an int >= 0"):
            gen.generate([5, 9, 12], max_new_tokens=4)


@pytest.mark.parametrize("sampled", [False, True])
def test_a_round_the_policy_does_not_draft_runs_as_a_plain_step(monkeypatch, sampled):
    """A policy that drafts every other round: its plain rounds build no tree (no mask, no walk), and every
    token, acceptance, reason and drafted round equals what the root-only tree gives them (``record_trees``
    keeps that path), greedy and keyed-sampled; a drafting round after plain ones still accepts the scripted
    continuation (the drafter context took in the plain rounds' features)."""
    from ddtree.budget.policy import BudgetPolicy
    from ddtree.core import verify
    from ddtree.generation import round as round_module

    class EveryOther(BudgetPolicy):
        def __init__(self):
            self.rounds = 0

        def prepare(self, context_len, batch):
            self.rounds += 1
            self.skip_draft, self.reason = self.rounds % 2 == 1, "every other"

        def choose(self, proposal, context_len):
            return 4

    target = tiny_target("qwen3")
    prompts = [[5, 17, 3, 9, 22, 6], [8, 2, 44, 4]]
    refs = [target.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None)[0] for p in prompts]
    gen = SpeculativeGenerator(target, ScriptedDrafter(refs, 97, block_size=5, match_prompt=True),
                               prompt_lookup=False)
    walks = []
    real = verify.verify_tree
    monkeypatch.setattr(round_module, "verify_tree", lambda *a, **k: (walks.append(1), real(*a, **k))[1])
    options = dict(max_new_tokens=24, stop_token_ids=(), **({"temperature": 0.8, "seed": 3} if sampled else {}))
    plain = gen.generate(prompts, tree_budget=EveryOther(), **options)
    plain_walks, walks[:] = len(walks), []
    tree = gen.generate(prompts, tree_budget=EveryOther(), record_trees=True, **options)
    assert plain.row_tokens == tree.row_tokens and plain.row_acceptance == tree.row_acceptance
    assert plain.stats.reasons == tree.stats.reasons and plain.stats.budgets == tree.stats.budgets
    assert plain_walks == plain.stats.rounds // 2 < len(walks) == tree.stats.rounds  # no walk on plain rounds
    if not sampled:  # the scripted drafter is right: every drafted round accepts its whole chain
        assert all(a == 5 for row in plain.row_acceptance for a in row[1::2])


def test_the_drafter_scores_only_the_depths_the_budget_can_use(monkeypatch):
    """Best-first trees of ``n`` nodes are at most ``n`` deep: under a fixed budget the DFlash drafter scores
    ``n`` positions (not its whole block), under ``auto`` at most as deep as any budget the round then chooses,
    and every token, acceptance and budget equals the run whose drafter scores the whole block (a scripted
    ScriptedDrafter is not involved: the real DFlash context, with the lookup branch merged)."""
    from ddtree.budget.policy import AutoBudget
    from ddtree.drafters import base
    from ddtree.generation import round as round_module

    torch.manual_seed(0)
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    gen = SpeculativeGenerator(target, drafter)
    prompts = [[5, 17, 3, 9, 22, 6, 5, 17, 3], [8, 2, 44, 4]]
    depths, bounds, chosen = [], [], []
    real_propose, real_deepest, real_choose = base.propose_to_depth, AutoBudget.deepest, AutoBudget.choose

    def spy(context, roots, depth):
        proposal = real_propose(context, roots, depth)
        depths.append((depth, proposal.logprobs.shape[1]))
        return proposal

    monkeypatch.setattr(round_module, "propose_to_depth", spy)
    monkeypatch.setattr(AutoBudget, "deepest", lambda self, *a: bounds.append(real_deepest(self, *a)) or bounds[-1])
    monkeypatch.setattr(AutoBudget, "choose", lambda self, *a: chosen.append(real_choose(self, *a)) or chosen[-1])
    runs = {}
    for budget in (2, "auto"):
        depths.clear()
        runs[budget] = gen.generate(prompts, max_new_tokens=20, tree_budget=budget, stop_token_ids=(),
                                    record_trees=budget == 2)
        if budget == 2:
            assert depths and all(d == 2 and scored == 2 for d, scored in depths)
    assert bounds and len(bounds) == len(chosen) and all(c <= b for c, b in zip(chosen, bounds))
    monkeypatch.setattr(round_module, "propose_to_depth", lambda context, roots, depth: real_propose(context, roots,
                                                                                                      None))
    whole = gen.generate(prompts, max_new_tokens=20, tree_budget=2, stop_token_ids=(), record_trees=True)
    assert whole.row_tokens == runs[2].row_tokens and whole.row_acceptance == runs[2].row_acceptance
    for ours, theirs in zip(runs[2].row_rounds, whole.row_rounds):  # the same trees, round by round
        assert [(r.tree.tokens.tolist(), r.tree.parents.tolist()) for r in ours] == [
            (r.tree.tokens.tolist(), r.tree.parents.tolist()) for r in theirs]
    assert gen.generate(prompts, max_new_tokens=20, tree_budget="auto", stop_token_ids=()).row_tokens == runs[
        "auto"].row_tokens
