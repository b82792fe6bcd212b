"""DFlash2: loading the published form, drafting exactly as the authors' package does, lossless generation,
and DDTree over the candidate selector's pairwise scores (each child ranked given its own parent)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from test_generator import expected_acceptance, reference
from tiny import MASK_ID, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.blocks import SamplingConfig
from ddtree.core.pairwise import best_first_pairwise, chain_pairwise
from ddtree.drafters.dflash.drafter import DFlashDrafter
from ddtree.drafters.dflash2.drafter import DFlash2Drafter
from ddtree.drafters.dflash2.model import DFlash2DraftModel
from ddtree.loading.drafter import load_drafter

BLOCK = 6


def dflash2_config(target, *, block_size=BLOCK, top_k=5, mask_token_id=MASK_ID, **extra) -> dict:
    """A DFlash2 ``config.json`` for ``target`` in the published layout (DFlash2 fields in ``dflash_config``)."""
    tc = target.config
    cfg = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": tc.hidden_size,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
        "hidden_act": "silu", "num_hidden_layers": 2, "vocab_size": tc.vocab_size,
        "num_target_layers": tc.num_hidden_layers, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "attention_bias": False, "block_size": 16,
        "layer_types": ["full_attention", "full_attention"],
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": [0, 2], "block_size": block_size,
                          "conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": top_k},
    }
    cfg.update(extra)
    return cfg


def fill(model: torch.nn.Module, seed: int) -> None:
    """Every weight set (a model built from a config leaves the conv base kernel uninitialised)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.2 * noise
            elif name.endswith("base_kernel"):
                value = 0.4 * noise
            elif "codebook" in name:
                value = noise
            elif p.dim() == 2:
                value = noise / p.shape[1] ** 0.5
            else:
                value = 0.2 * noise
            p.copy_(value.to(p.dtype))


def write(path, cfg: dict, state: dict) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))


def published_state(model) -> dict:
    """The state dict as published files store it: the two codebooks without ``.weight``."""
    state = {k: v.detach().double().clone() for k, v in model.state_dict().items()}
    for name in ("predecessor_codebook", "successor_codebook"):
        state[f"candidate_selector.{name}"] = state.pop(f"candidate_selector.{name}.weight")
    return state


def ddtree_checkpoint(target, path, seed=0, **cfg_kw):
    """A DFlash2 directory written by ddtree's own model (no authors' package needed)."""
    from ddtree.drafters.dflash2.config import DFlash2Config

    model = DFlash2DraftModel(DFlash2Config.from_dict(dflash2_config(target, **cfg_kw))).double()
    fill(model, seed)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


# ------------------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------------------

def test_a_dflash2_directory_loads_through_the_registry_and_round_trips(target, tmp_path):
    path = ddtree_checkpoint(target, tmp_path / "d2")
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "candidate_selector.predecessor_codebook" in keys and "layers.0.attention_conv.base_kernel" in keys
    assert not any(k.endswith("codebook.weight") for k in keys)  # the published (bare) form
    drafter = load_drafter(path, target)  # the class from config.json's architectures
    assert isinstance(drafter, DFlash2Drafter) and drafter.block_size == BLOCK  # dflash_config.block_size wins
    with pytest.raises(ValueError, match=r"is a DFlash2DraftModel checkpoint, which DFlashDrafter does not load.*"
                                         r"load_drafter\(path, target\).*DFlash2Drafter"):
        DFlashDrafter.from_pretrained(path, target)
    with pytest.raises(ValueError, match="full vocabulary"):
        load_drafter(path, target, draft_vocab=8)
    again = DFlash2DraftModel.from_pretrained(path)
    for (k, a), (_, b) in zip(drafter.model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    gen = SpeculativeGenerator(target, again, tree_budget=8)  # a bare DFlash2 model binds too
    assert isinstance(gen.drafter, DFlash2Drafter)


def test_a_dflash2_directory_given_to_the_generator_drafts_as_the_bound_object(target, tmp_path):
    path = ddtree_checkpoint(target, tmp_path / "d2", seed=2)
    prompts = [[5, 17, 3, 44, 9, 61, 2], [8, 40, 13]]
    runs = [SpeculativeGenerator(target, drafter, tree_budget=8).generate(
        [torch.tensor(p) for p in prompts], max_new_tokens=30, record_trees=True)
        for drafter in (DFlash2Drafter.from_pretrained(path, target), str(path), path)]
    for row, prompt in enumerate(prompts):
        ref = reference(target, prompt, 30)[0].tolist()
        assert runs[0].acceptance_lengths[row] == [expected_acceptance(r, ref) for r in runs[0].rounds[row]]
        for out in runs:
            assert out.row_tokens[row] == ref[len(prompt):]
            assert out.acceptance_lengths[row] == runs[0].acceptance_lengths[row]
            assert all(torch.equal(a.tree.tokens, b.tree.tokens) for a, b in zip(out.rounds[row], runs[0].rounds[row]))
    assert max(max(a) for a in runs[0].acceptance_lengths) > 1


@pytest.mark.parametrize("change,message", [
    (lambda c, s: c["dflash_config"].pop("selector_top_k"), "lacks selector_top_k"),
    (lambda c, s: c["dflash_config"].update(conv_group_size=24), "does not divide hidden_size"),
    (lambda c, s: c.pop("head_dim"), "no head_dim"),
    (lambda c, s: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c, s: s.pop("layers.1.mlp_conv.kernel_projection.weight"), "missing"),
    (lambda c, s: s.update({"candidate_selector.extra": torch.zeros(2)}), "unexpected"),
    (lambda c, s: s.update({"layers.0.attention_conv.base_kernel": torch.zeros(2, 4, 64)}), "has shape"),
    (lambda c, s: s["fc.weight"].fill_(float("nan")), "NaN"),
])
def test_malformed_dflash2_checkpoints_are_refused_by_name(target, tmp_path, change, message):
    from safetensors.torch import load_file

    path = ddtree_checkpoint(target, tmp_path / "good")
    cfg, state = json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))
    change(cfg, state)
    write(tmp_path / "bad", cfg, state)
    with pytest.raises(ValueError, match=message):
        load_drafter(tmp_path / "bad", target)


# ------------------------------------------------------------------------------------------------------------
# against the authors' package
# ------------------------------------------------------------------------------------------------------------

def authors_checkpoint(target, path, seed=0, **cfg_kw):
    """A DFlash2 directory written from the authors' own class, with every weight filled."""
    dm = pytest.importorskip("dflash.model")
    from transformers import Qwen3Config

    cfg = dflash2_config(target, **cfg_kw)
    model = dm.DFlash2DraftModel(Qwen3Config(**cfg)).double()
    fill(model, seed)
    write(path, cfg, published_state(model))
    theirs = dm.DFlash2DraftModel.from_pretrained(str(path), dtype=torch.float64).eval()
    return path, theirs


@pytest.fixture
def float64_norms(monkeypatch):
    """The authors' RMSNorm computes in float32 whatever the dtype; in float64 throughout, the two
    implementations agree to rounding (with float32 norms they differ by ~1e-6)."""
    from transformers.models.qwen3 import modeling_qwen3

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", forward)


@pytest.mark.parametrize("precise", [True, False], ids=["float64_norms", "their_float32_norms"])
def test_hidden_states_and_selector_scores_equal_the_authors(target, tmp_path, request, precise):
    dm = pytest.importorskip("dflash.model")
    if precise:
        request.getfixturevalue("float64_norms")
    path, theirs = authors_checkpoint(target, tmp_path / "d2", seed=3)
    ours = DFlash2Drafter.from_pretrained(path, target)
    tol = 1e-10 if precise else 2e-5  # float32 norms: ~1e-6 on these sizes, measured
    prompt = torch.tensor([[5, 17, 3, 44, 9, 61, 2, 30, 8]])
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
    feats = dm.extract_context_feature(out.hidden_states, theirs.target_layer_ids)
    root = out.logits[0, -1].argmax().view(1)
    block = torch.cat([root, torch.full((BLOCK - 1,), MASK_ID)])[None]
    start = prompt.shape[1]
    with torch.no_grad():
        h_theirs = theirs(position_ids=torch.arange(start + BLOCK)[None], target_hidden=feats,
                          noise_embedding=dm._raw_input_embeddings(target, block, 1.0))
        tokens, _, _ = theirs.propose(h_theirs[:, 1:], block[:, 0], dm._output_head(target), 0.0)
        ctx = ours.new_context(1)
        ctx.append(ours.context_features(out.hidden_states), prompt)
        proposal = ctx.propose(root)
        model = ours.model
        kv = model.context_kv(model.project_context(feats), torch.arange(start)[None])
        h_ours = model(torch.nn.functional.embedding(block, target.get_input_embeddings().weight),
                       torch.arange(start, start + BLOCK)[None], kv)
        logits_t = theirs.compute_logits(h_theirs[:, 1:], dm._output_head(target))
        cand, first, table = model.candidate_selector.scores(h_ours[:, 1:], model.logits(h_ours[:, 1:],
                                                                                        target.lm_head), root)
    assert (h_ours - h_theirs).abs().max() < tol
    # Their selector's scores, recomputed from their modules for every (previous, candidate) pair.
    sel = theirs.candidate_selector
    _, their_cand = logits_t.topk(sel.top_k, dim=-1)
    assert torch.equal(their_cand.sort(-1).values, cand)
    proj = sel.hidden_projection(h_theirs[:, 1:])[0]
    pred, succ = sel.predecessor_codebook.weight, sel.successor_codebook.weight
    their_first = logits_t[0, 0, cand[0, 0]] + (pred[root[0]] * proj[0]) @ succ[cand[0, 0]].T
    assert (first[0] - their_first).abs().max() < tol
    for d in range(BLOCK - 2):
        want = logits_t[0, d + 1, cand[0, d + 1]][None] + (pred[cand[0, d]] * proj[d + 1]) @ succ[cand[0, d + 1]].T
        assert (table[0, d] - want).abs().max() < tol * 10
    # The proposal's greedy chain is their propose() at temperature 0.
    chain = chain_pairwise(root, proposal.pairwise, BLOCK - 1)
    assert chain.tokens[0, 1:].tolist() == tokens[0].tolist()
    assert proposal.logprobs.argmax(-1)[0].tolist() == tokens[0].tolist()


def authors_rounds(theirs, target, prompt, new):
    """The authors' greedy generation, with the draft of every full block recorded."""
    dm = pytest.importorskip("dflash.model")
    drafts = []
    propose = theirs.propose

    def recording(hidden, anchors, head, temperature):
        tokens, cand, q = propose(hidden, anchors, head, temperature)
        drafts.append(tokens[0].tolist())
        return tokens, cand, q

    theirs.propose = recording
    out = dm.dflash_generate(theirs, target, prompt, new, None, temperature=0.0)
    return out[0, prompt.shape[1]:].tolist(), drafts


def bigram_pair(tmp_path):
    """A target whose next token depends only on the last one (its layers' outputs zeroed), and a DFlash2
    drafter whose selector knows that map for two tokens in three: drafts then run deep, and break where
    the map is wrong, so acceptance varies from round to round. Built from the authors' class."""
    target = tiny_target("qwen3", seed=1)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        nxt = target(torch.arange(target.config.vocab_size)[None]).logits[0].argmax(-1)
    vocab = target.config.vocab_size
    wrong = torch.arange(vocab) % 3 == 2
    known = torch.where(wrong, (nxt + 1) % vocab, nxt)
    dm = pytest.importorskip("dflash.model")
    from transformers import Qwen3Config

    cfg = dflash2_config(target, top_k=vocab)
    cfg["dflash_config"].update(selector_rank=vocab, output_multiplier=0.0)  # the selector alone ranks
    theirs = dm.DFlash2DraftModel(Qwen3Config(**cfg)).double()
    fill(theirs, 11)
    with torch.no_grad():
        for layer in theirs.layers:  # the block keeps its embeddings: every mask slot's hidden state is alike
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        h0 = theirs.norm(target.get_input_embeddings().weight[MASK_ID][None])[0]
        sel = theirs.candidate_selector
        sel.hidden_projection.weight.copy_((h0 / h0.dot(h0)).expand(vocab, -1))  # proj(h0) = 1
        sel.predecessor_codebook.weight.copy_(torch.eye(vocab))
        sel.successor_codebook.weight.copy_(10.0 * (torch.arange(vocab)[:, None] == known[None, :]))
    write(tmp_path, cfg, published_state(theirs))
    return target, tmp_path, dm.DFlash2DraftModel.from_pretrained(str(tmp_path), dtype=torch.float64).eval()


@pytest.mark.parametrize("kind", ["random", "bigram"])
def test_chain_drafts_equal_the_authors_round_by_round(target, tmp_path, float64_norms, kind):
    if kind == "random":
        path, theirs = authors_checkpoint(target, tmp_path / "d2", seed=5)
    else:
        target, path, theirs = bigram_pair(tmp_path / "d2")
    prompt = torch.tensor([[11, 4, 27, 80, 3, 19, 52]])
    new = 48 if kind == "random" else 160
    their_tokens, drafts = authors_rounds(theirs, target, prompt, new)
    gen = SpeculativeGenerator(target, DFlash2Drafter.from_pretrained(path, target), tree_budget=BLOCK - 1,
                               builder="chain")
    out = gen.generate(prompt, max_new_tokens=new, record_trees=True)
    ours = out.new_tokens[0].tolist()
    assert ours == reference(target, prompt[0].tolist(), new)[0, prompt.shape[1]:].tolist()  # lossless
    assert ours == their_tokens[: len(ours)]
    full = [d for d in drafts if len(d) == BLOCK - 1]  # their last blocks shrink to the remaining length
    assert len(full) >= 30
    for r, (record, draft) in enumerate(zip(out.rounds, full)):
        assert record.tree.tokens[0, 1:].tolist() == draft, f"round {r}"
    # Equal acceptance: theirs is the longest prefix of each draft that the output continues.
    start, theirs_acc = 0, []
    for draft in full:
        acc = next((i for i, t in enumerate(draft) if start + 1 + i >= len(their_tokens)
                    or their_tokens[start + 1 + i] != t), len(draft))
        theirs_acc.append(acc + 1)
        start += acc + 1
    assert out.acceptance_lengths[: len(full)] == theirs_acc
    if kind == "bigram":  # deep drafts that break where the selector's map is wrong
        assert len(set(theirs_acc)) >= 3 and sum(theirs_acc) / len(theirs_acc) > 2.5, theirs_acc


# ------------------------------------------------------------------------------------------------------------
# DDTree over the selector
# ------------------------------------------------------------------------------------------------------------

def selector_logprob(model, hidden_slot, logits_slot, prev: int) -> dict[int, float]:
    """From scratch: the selector's log-softmax over one slot's top-k given the previous token."""
    sel = model.candidate_selector
    unary, cand = logits_slot.topk(sel.top_k)
    proj = sel.hidden_projection(hidden_slot)
    raw = unary + (sel.predecessor_codebook.weight[prev] * proj) @ sel.successor_codebook.weight[cand].T
    return dict(zip(cand.tolist(), raw.float().log_softmax(-1).tolist()))


def test_pairwise_tree_scores_each_child_given_its_own_parent(target, tmp_path):
    path = ddtree_checkpoint(target, tmp_path / "d2", seed=7, top_k=3, block_size=5)
    drafter = DFlash2Drafter.from_pretrained(path, target)
    model = drafter.model
    prompt = torch.tensor([[5, 17, 3, 44, 9, 61]])
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
        root = out.logits[0, -1].argmax().view(1)
        ctx = drafter.new_context(1)
        ctx.append(drafter.context_features(out.hidden_states), prompt)
        proposal = ctx.propose(root)
        kv = model.context_kv(model.project_context(drafter.context_features(out.hidden_states)),
                              torch.arange(6)[None])
        block = torch.cat([root, torch.full((4,), MASK_ID)])[None]
        hidden = model(torch.nn.functional.embedding(block, target.get_input_embeddings().weight),
                       torch.arange(6, 11)[None], kv)[0, 1:]
        logits = model.logits(hidden, target.lm_head)
    depth, budget = 4, 12
    tree = best_first_pairwise(root, proposal.pairwise, budget)
    toks, parents, depths, scores = (t[0].tolist() for t in (tree.tokens, tree.parents, tree.depths, tree.scores))
    assert len(toks) == budget + 1
    with torch.no_grad():
        for i in range(1, len(toks)):
            table = selector_logprob(model, hidden[depths[i] - 1], logits[depths[i] - 1], toks[parents[i]])
            assert math.isclose(scores[i], scores[parents[i]] + table[toks[i]], abs_tol=1e-5), i
        # The best `budget` of every path up to the block depth, enumerated from scratch.
        paths = {(): 0.0}
        for d in range(depth):
            for p in [p for p in paths if len(p) == d]:
                prev = p[-1] if p else int(root)
                for tok, lp in selector_logprob(model, hidden[d], logits[d], prev).items():
                    paths[p + (tok,)] = paths[p] + lp
    del paths[()]
    best = sorted(paths.items(), key=lambda kv: -kv[1])[:budget]
    spelled = {i: (toks[i],) if parents[i] == 0 else None for i in range(1, len(toks))}
    for i in range(1, len(toks)):
        spelled[i] = (spelled[parents[i]] if parents[i] > 0 else ()) + (toks[i],)
    assert set(spelled.values()) == {p for p, _ in best}
    # Pairwise matters: the same token at one depth scores differently under different parents.
    tab = proposal.pairwise.table[0]
    assert (tab.max(dim=1).values - tab.min(dim=1).values).max() > 1e-3


@pytest.mark.parametrize("builder,budget", [("best_first", 16), ("chain", 5), ("beam@2x3", 6)])
def test_greedy_generation_is_lossless_and_acceptance_matches_a_walk_of_each_tree(target, tmp_path, builder,
                                                                                     budget):
    path = ddtree_checkpoint(target, tmp_path / "d2", seed=2)
    gen = SpeculativeGenerator(target, DFlash2Drafter.from_pretrained(path, target), tree_budget=budget,
                               builder=builder)
    prompts = [[5, 17, 3, 44, 9, 61, 2], [8, 40, 13]]
    refs = [reference(target, p, 40)[0].tolist() for p in prompts]
    out = gen.generate([torch.tensor(p) for p in prompts], max_new_tokens=40, record_trees=True)
    for row, (prompt, ref) in enumerate(zip(prompts, refs)):
        assert out.row_tokens[row] == ref[len(prompt):]
        assert out.acceptance_lengths[row] == [expected_acceptance(r, ref) for r in out.rounds[row]]
        # A ragged batch drafts each row as its own generation does.
        alone = gen.generate(torch.tensor([prompt]), max_new_tokens=40, record_trees=True)
        assert alone.acceptance_lengths == out.acceptance_lengths[row]
        for a, b in zip(alone.rounds, out.rounds[row]):
            assert torch.equal(a.tree.tokens, b.tree.tokens)


def test_sampling_keeps_the_target_distribution(tmp_path):
    """At temperature > 0 the tree is still a deterministic function of the drafter (the selector's most
    likely branches): the verifier's draws make the output the target's own distribution (chi-square)."""
    from test_sampling_e2e import (
        PROMPT,
        chi2_critical,
        chi2_statistic,
        exact_distribution,
        expected_first_round_acceptance,
    )

    small = tiny_target("qwen3", vocab=8)
    path = ddtree_checkpoint(small, tmp_path / "d2", seed=4, block_size=4, top_k=4, mask_token_id=7)
    gen = SpeculativeGenerator(small, DFlash2Drafter.from_pretrained(path, small), tree_budget=6)
    cfg, samples, rows = SamplingConfig(temperature=0.9, top_k=4), 1200, 200
    exact = exact_distribution(small, cfg)
    counts, acc, expected, by_first = {}, [], [], {}
    for seed in range(samples // rows):  # a batch of one prompt repeated: its rows draw independently
        out = gen.generate([torch.tensor(PROMPT)] * rows, max_new_tokens=3, temperature=cfg.temperature,
                           top_k=cfg.top_k, seed=seed, record_trees=True)
        for row in range(rows):
            seq = tuple(out.row_tokens[row])
            counts[seq] = counts.get(seq, 0) + 1
            acc.append(out.acceptance_lengths[row][0])
            if seq[0] not in by_first:
                by_first[seq[0]] = expected_first_round_acceptance(small, out.rounds[row][0], seq[0], cfg)
            expected.append(by_first[seq[0]])
    assert set(counts) <= set(exact)
    stat, df = chi2_statistic(counts, exact, samples)
    assert df >= 3 and stat < chi2_critical(df), (stat, df)
    acc_t, exp_t = torch.tensor(acc, dtype=torch.float64), torch.tensor(expected)
    assert abs(acc_t.mean() - exp_t.mean()) <= 4.5 * acc_t.std() / math.sqrt(samples) + 1e-9
    assert acc_t.mean() > 1.1


def test_pairwise_builders_agree_with_their_plain_forms_when_scores_are_not_pairwise():
    """With every table row equal (the previous token does not matter), the pairwise builders give the
    trees that the per-depth builders give on those distributions."""
    from ddtree.core.builders import best_first, chain
    from ddtree.core.pairwise import PairwiseScores

    g = torch.Generator().manual_seed(0)
    bsz, depth, k, vocab = 2, 5, 4, 30
    cand = torch.stack([torch.randperm(vocab, generator=g)[:k].sort().values for _ in range(bsz * depth)])
    cand = cand.view(bsz, depth, k)
    rows = torch.randn(bsz, depth, k, generator=g).log_softmax(-1)
    scores = PairwiseScores(cand, rows[:, 0], rows[:, 1:, None, :].expand(-1, -1, k, -1).contiguous())
    roots = torch.tensor([1, 2])
    logprobs = torch.full((bsz, depth, vocab), float("-inf")).scatter_(-1, cand, rows)
    for budget in (1, 7, 20):
        a, b = best_first_pairwise(roots, scores, budget), best_first(roots, logprobs, budget)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
        assert torch.allclose(a.scores, b.scores)
    a, b = chain_pairwise(roots, scores, 4), chain(roots, logprobs, 4)
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.scores, b.scores)
    assert list(itertools.islice(iter(a.parents[0].tolist()), 3)) == [-1, 0, 1]


# ------------------------------------------------------------------------------------------------------------
# combinators
# ------------------------------------------------------------------------------------------------------------

def test_lookup_over_dflash2_keeps_the_pairwise_tree_and_grafts_the_lookup_branch(target, tmp_path):
    """``WithLookup`` keeps every field of the DFlash2 proposal: each round's tree is the pairwise tree (each child
    scored given its own parent) with the lookup branch grafted in, and acceptance follows a walk of it."""
    from ddtree.core.builders import best_first
    from ddtree.core.graft import graft_paths
    from ddtree.core.tree import LOOKUP
    from ddtree.drafters.lookup import PromptLookup, WithLookup, lookup_continuation

    drafter = load_drafter(ddtree_checkpoint(target, tmp_path / "d2", seed=2), target)
    lookup = PromptLookup.for_target(target, block_size=drafter.block_size)
    prompt = torch.tensor([[5, 17, 3, 44, 9, 61, 5, 17, 3, 44]])
    # One proposal, field by field: the DFlash2 context's own, plus the lookup's paths.
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
    root = out.logits[0, -1].argmax().view(1)
    merged, own, alone = (c.new_context(1) for c in (WithLookup(drafter, lookup), drafter, lookup))
    for ctx in (merged, own):
        ctx.append(drafter.context_features(out.hidden_states), prompt)
    alone.append(None, prompt)
    got, want = merged.propose(root), own.propose(root)
    assert torch.equal(got.logprobs, want.logprobs)
    for name in ("candidates", "first", "table"):
        assert torch.equal(getattr(got.pairwise, name), getattr(want.pairwise, name)), name
    branch = alone.paths(root)
    for name in ("tokens", "scores", "lengths"):
        assert torch.equal(getattr(got.paths, name), getattr(branch, name)), name
    cont, n = lookup_continuation(np.append(prompt[0].numpy(), int(root)), drafter.block_size - 1)
    assert branch.tokens[0, 0, : len(cont)].tolist() == cont and int(branch.lengths[0, 0]) == len(cont)
    # Generation: record what each round proposed, and rebuild its tree from scratch.
    seen = []

    class Recorded(WithLookup):
        def new_context(self, batch_size: int = 1):
            ctx = super().new_context(batch_size)
            propose = ctx.propose

            def recorded(roots):
                proposal = propose(roots)
                seen.append((roots.clone(), proposal))
                return proposal

            ctx.propose = recorded
            return ctx

    gen = SpeculativeGenerator(target, Recorded(drafter, lookup), tree_budget=8)
    new = 60
    result = gen.generate(prompt, max_new_tokens=new, record_trees=True)
    ref = reference(target, prompt[0].tolist(), new)[0].tolist()
    assert result.sequences[0].tolist() == ref  # lossless
    assert result.acceptance_lengths == [expected_acceptance(r, ref) for r in result.rounds]
    assert len(seen) == len(result.rounds)
    differs = 0
    for (roots, proposal), record, size in zip(seen, result.rounds, result.stats.budgets):
        assert proposal.pairwise is not None
        tree = best_first_pairwise(roots, proposal.pairwise, size)
        if proposal.has_paths:
            tree = graft_paths(tree, proposal.paths, size)
        for name in ("tokens", "parents", "scores"):
            assert torch.equal(getattr(record.tree, name), getattr(tree, name)), name
        plain = best_first(roots, proposal.logprobs, size)  # what the round built when the merge dropped pairwise
        plain = graft_paths(plain, proposal.paths, size) if proposal.has_paths else plain
        differs += not torch.equal(plain.tokens, tree.tokens)
    assert differs > 0  # the pairwise scores changed some trees
    lookup_nodes = sum(int((r.tree.sources & LOOKUP).bool().sum()) for r in result.rounds if r.tree.sources is not None)
    assert lookup_nodes > 0 and sum(p.has_paths for _, p in seen) > 0
    assert result.stats.accepted_by_source is not None
