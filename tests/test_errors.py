"""Bad inputs fail early with a ValueError whose message names the problem."""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
from test_generator import expected_acceptance
from tiny import MASK_ID, VOCAB, ScriptedDrafter, tiny_config, tiny_drafter, tiny_target  # noqa: F401

from ddtree import SpeculativeGenerator
from ddtree.blocks import SamplingConfig
from ddtree.core.builders import beam, best_first, chain
from ddtree.core.noise import row_key
from ddtree.drafters.base import DraftContext, Drafter, Proposal, check_proposal
from ddtree.drafters.dflash.config import DFlashConfig
from ddtree.drafters.dflash.drafter import DFlashDrafter, check_compatible
from ddtree.drafters.features import build_target_layer_ids

# A published-format drafter config (the shape of z-lab's Qwen3-8B DFlash b16 config.json).
PUBLISHED = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def published(**changes) -> dict:
    d = copy.deepcopy(PUBLISHED)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


@pytest.fixture(scope="module")
def target():
    return tiny_target()


PROMPT = torch.tensor([[5, 17, 3]])
OTHER = [1, 2, 3]


@pytest.fixture(scope="module")
def gen(target):
    """A drafter that proposes the target's greedy continuations of PROMPT and OTHER: rounds accept 4 + 1."""
    refs = [target.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=0)[0]
            for p in (PROMPT[0].tolist(), OTHER)]
    return SpeculativeGenerator(target, ScriptedDrafter(refs, VOCAB, match_prompt=True), tree_budget=4)

# --------------------------------------------------------------------------- drafter vs target


def test_hidden_size_mismatch(target):
    other = tiny_drafter(tiny_config("qwen3", hidden_size=32, head_dim=8))
    with pytest.raises(ValueError, match=r"drafter hidden size 32 does not match the target's 64"):
        SpeculativeGenerator(target, other)
    with pytest.raises(ValueError, match=r"hidden size 32 .* 64"):
        DFlashDrafter(other, target)


def test_vocab_mismatch(target):
    other = tiny_drafter(tiny_config("qwen3", vocab_size=101))
    with pytest.raises(ValueError, match=r"drafter vocab size 101 does not match the target's lm_head \(97\)"):
        SpeculativeGenerator(target, other)


def test_target_layer_ids_out_of_range(target):
    # A drafter made for an 8-layer target reads layer 6: the 4-layer target has no layer 6.
    other = tiny_drafter(tiny_config("qwen3", num_hidden_layers=8), target_layer_ids=[1, 6])
    with pytest.raises(ValueError, match=r"\[6\] out of range: the target has 4 decoder layers"):
        SpeculativeGenerator(target, other)
    with pytest.raises(ValueError, match=r"target has 4 decoder layers"):
        check_compatible(other.config, target)
    # And in the config itself, against its own num_target_layers.
    with pytest.raises(ValueError, match=r"\[36\] out of range: the target has 36 decoder layers"):
        DFlashConfig.from_dict(published(dflash_config={"mask_token_id": 5, "target_layer_ids": [1, 36]}))
    with pytest.raises(ValueError, match=r"\[-1\] out of range"):
        DFlashConfig.from_dict(published(dflash_config={"mask_token_id": 5, "target_layer_ids": [-1, 3]}))
    with pytest.raises(ValueError, match=r"target_layer_ids is empty"):
        DFlashConfig.from_dict(published(dflash_config={"mask_token_id": 5, "target_layer_ids": []}))


def test_mask_token_outside_target_vocab(target):
    other = tiny_drafter(target.config, mask_token_id=VOCAB + 3)
    with pytest.raises(ValueError, match=r"mask_token_id 100 is outside the target's vocabulary \(size 97\)"):
        SpeculativeGenerator(target, other)


def test_no_mask_token_id():
    with pytest.raises(ValueError, match=r"no mask token id"):
        DFlashConfig.from_dict(published(dflash_config={"target_layer_ids": [1, 9, 17, 25, 33]}))
    with pytest.raises(ValueError, match=r"no mask token id"):
        DFlashConfig.from_dict(published(dflash_config=None))
    with pytest.raises(ValueError, match=r"no mask token id"):
        DFlashConfig.for_target(tiny_config("qwen3"), mask_token_id=None)


def test_a_config_without_dflash_config_is_not_a_dflash_drafter_config():
    from ddtree.drafters.registry import drafter_class

    target_like = {k: v for k, v in PUBLISHED.items() if k not in ("dflash_config", "architectures", "block_size")}
    with pytest.raises(ValueError, match=r"this is not a DFlash drafter config: it has no dflash_config.*"
                                         r"pass the drafter's directory, not the target's"):
        DFlashConfig.from_dict(target_like)
    with pytest.raises(ValueError, match=r"this is not a DFlash drafter config.*registered: DFlash2DraftModel, "
                                         r"DFlashDraftModel"):
        drafter_class(target_like)
    # A top-level mask_token_id without dflash_config still reads (the published precedence), ids by formula.
    cfg = DFlashConfig.from_dict({**target_like, "block_size": 16, "mask_token_id": 5})
    assert cfg.mask_token_id == 5 and cfg.target_layer_ids == [1, 9, 17, 25, 33]


def test_unknown_architectures_list_the_registered_ones(saved_tiny_pair, tmp_path):
    import json
    import shutil

    from ddtree.drafters.registry import drafter_class, register_drafter, registered_architectures
    from ddtree.loading.drafter import load_drafter

    assert registered_architectures() == ["DFlash2DraftModel", "DFlashDraftModel"]
    with pytest.raises(ValueError, match=r"names the architecture\(s\) LlamaForCausalLM, which no ddtree drafter "
                                         r"serves; registered: DFlash2DraftModel, DFlashDraftModel"):
        drafter_class({**PUBLISHED, "architectures": ["LlamaForCausalLM"]})
    assert drafter_class({**PUBLISHED, "architectures": None}) is DFlashDrafter  # older exports name none
    bad = tmp_path / "drafter"
    shutil.copytree(saved_tiny_pair[1], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["EagleDraftModel"]}))
    target = tiny_target("llama", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"EagleDraftModel, which no ddtree drafter serves; registered: "
                                         r"DFlash2DraftModel, DFlashDraftModel"):
        load_drafter(bad, target)
    with pytest.raises(TypeError, match=r"int cannot serve checkpoints: it lacks from_pretrained, check_config, "
                                        r"model_class"):
        register_drafter("EagleDraftModel", int)
    assert "EagleDraftModel" not in registered_architectures()


class _BareContext(DraftContext):
    """Returns uniform log-probs unwrapped: the mistake a custom proposer makes first."""

    def __init__(self, rows: int):
        self.rows = rows

    def append(self, features, tokens, counts=None):
        pass

    def select_rows(self, rows):
        self.rows = len(rows)

    def propose(self, root_tokens):
        return torch.full((self.rows, 3, VOCAB), -math.log(VOCAB))


class _BareDrafter(Drafter):
    block_size = 4
    target_layer_ids: list[int] = []
    needs_hidden_states = False

    def context_features(self, hidden_states):
        return None

    def new_context(self, batch_size: int = 1):
        return _BareContext(batch_size)


def test_a_propose_that_returns_a_bare_tensor_is_refused_by_name():
    gen = SpeculativeGenerator(tiny_target("qwen3"), _BareDrafter(), tree_budget=4)
    with pytest.raises(TypeError, match=r"_BareContext.propose returned a Tensor, not a ddtree Proposal: wrap the "
                                        r"log-probs: return Proposal\(logprobs=logprobs\)"):
        gen.generate([3, 4, 5], max_new_tokens=8)
    with pytest.raises(TypeError, match=r"propose returned a dict, not a ddtree Proposal"):
        check_proposal({"logprobs": torch.zeros(1, 3, VOCAB)})
    proposal = Proposal(torch.zeros(1, 3, VOCAB))
    assert check_proposal(proposal) is proposal


def test_no_num_target_layers():
    with pytest.raises(ValueError, match=r"no num_target_layers"):
        DFlashConfig.from_dict(published(num_target_layers=None))


def test_bad_layer_types_and_sliding_window():
    with pytest.raises(ValueError, match=r"layer_types has 4 entries for 5 drafter layers"):
        DFlashConfig.from_dict(published(layer_types=["full_attention"] * 4))
    with pytest.raises(ValueError, match=r"unknown layer_types \['local_attention'\]"):
        DFlashConfig.from_dict(published(layer_types=["full_attention"] * 4 + ["local_attention"]))
    with pytest.raises(ValueError, match=r"sliding_attention layers but the config sets no sliding_window"):
        DFlashConfig.from_dict(published(layer_types=["sliding_attention"] * 4 + ["full_attention"]))
    with pytest.raises(ValueError, match=r"no sliding_window"):
        DFlashConfig.for_target(
            tiny_config("qwen3"), num_hidden_layers=2, mask_token_id=MASK_ID, layer_types=["sliding_attention"] * 2
        )
    # A window that is not a positive int would mask every key (or none): refused.
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"sliding_window \(a positive int\), got"):
            DFlashConfig.from_dict(
                published(layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=bad)
            )
    # The Qwen3.6 kind (4 sliding + 1 full, with a window) is fine.
    cfg = DFlashConfig.from_dict(
        published(layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048)
    )
    assert cfg.layer_types[:4] == ["sliding_attention"] * 4 and cfg.sliding_window == 2048


def test_block_size_too_small():
    with pytest.raises(ValueError, match=r"block_size must be >= 2"):
        DFlashConfig.from_dict(published(block_size=1))


# --------------------------------------------------------------------------- published config: target_layer_ids


def test_target_layer_ids_default_formula():
    no_ids = published(dflash_config={"mask_token_id": 151669})
    assert DFlashConfig.from_dict(no_ids).target_layer_ids == [1, 9, 17, 25, 33]
    one_layer = published(
        dflash_config={"mask_token_id": 151669}, num_hidden_layers=1, layer_types=["full_attention"]
    )
    assert DFlashConfig.from_dict(one_layer).target_layer_ids == [18]
    assert DFlashConfig.from_dict(dict(one_layer, num_target_layers=35)).target_layer_ids == [17]
    # The config's own ids win over the formula.
    own = published(dflash_config={"mask_token_id": 151669, "target_layer_ids": [2, 3, 5, 7, 11]})
    cfg = DFlashConfig.from_dict(own)
    assert cfg.target_layer_ids == [2, 3, 5, 7, 11] and cfg.mask_token_id == 151669
    # Round trip keeps the ids where the published format puts them.
    assert cfg.to_dict()["dflash_config"]["target_layer_ids"] == [2, 3, 5, 7, 11]


def test_build_target_layer_ids_formula():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert build_target_layer_ids(32, 3) == [1, 15, 29]
    # Python's round, half to even: 1 + 3.5 = 4.5 -> 4 (not 5), 1 + 2.5 = 3.5 -> 4.
    assert build_target_layer_ids(11, 3) == [1, 4, 8]
    assert build_target_layer_ids(9, 3) == [1, 4, 6]
    assert build_target_layer_ids(36, 1) == [18]
    with pytest.raises(ValueError, match=r"at least one target and one drafter layer"):
        build_target_layer_ids(36, 0)


# --------------------------------------------------------------------------- budgets


def test_budget_below_zero(target, gen):
    draft = tiny_drafter(target.config)
    with pytest.raises(ValueError, match=r"tree_budget must be an int >= 0.*got -1"):
        SpeculativeGenerator(target, draft, tree_budget=-1)
    with pytest.raises(ValueError, match=r"tree_budget must be an int >= 0.*got -1"):
        gen.generate(PROMPT, max_new_tokens=4, tree_budget=-1)
    with pytest.raises(ValueError, match=r"tree_budget must be an int >= 0.*got 2.5"):
        gen.generate(PROMPT, max_new_tokens=4, tree_budget=2.5)
    with pytest.raises(ValueError, match=r"tree_budget must be an int >= 0"):
        SpeculativeGenerator(target, draft, tree_budget=True)
    lp = torch.zeros(1, 4, VOCAB).log_softmax(-1)
    for builder in (best_first, chain, beam(2, 3)):
        with pytest.raises(ValueError, match=r"tree budget must be an int >= 0.*got -1"):
            builder(torch.tensor([0]), lp, -1)


def test_beam_specs_state_their_bounds(target, gen):
    """``beam@0x3`` has the right shape but an impossible width: the message says each must be at least 1."""
    draft = tiny_drafter(target.config)
    for spec, got in (("beam@0x3", "width 0 and depth 3"), ("beam@4x0", "width 4 and depth 0"),
                      ("beam@-2x5", "width -2 and depth 5")):
        message = rf"beam builder '{spec}': width and depth must each be at least 1 \(e\.g\. 'beam@4x8'\), got {got}"
        with pytest.raises(ValueError, match=message):
            SpeculativeGenerator(target, draft, builder=spec)
        with pytest.raises(ValueError, match=message):
            gen.generate(PROMPT, max_new_tokens=4, builder=spec)
    for spec in ("beam@4", "beam@4x", "beam@axb", "beam@2x3x4"):
        with pytest.raises(ValueError, match=r"must look like 'beam@4x8' \(width x depth, each at least 1\)"):
            SpeculativeGenerator(target, draft, builder=spec)
    assert SpeculativeGenerator(target, draft, builder="beam@1x1").builder.__name__ == "beam_1x1"


# --------------------------------------------------------------------------- the target itself


def test_a_target_path_is_refused_naming_from_pretrained(saved_tiny_pair):
    """The constructor takes a loaded target (it loads only the drafter, which it binds to that target): a
    directory or hub id there is refused at once, naming the loader, instead of failing inside the drafter."""
    target_dir, drafter_dir = saved_tiny_pair
    for given in (str(target_dir), target_dir):
        with pytest.raises(TypeError, match=r"not a model: load a target and its drafter from directories or hub ids "
                                            r"with SpeculativeGenerator\.from_pretrained\(target, drafter\)"):
            SpeculativeGenerator(given, str(drafter_dir))
    with pytest.raises(TypeError, match=r"must be a loaded Hugging Face causal LM .* got NoneType; .*from_pretrained"):
        SpeculativeGenerator(None, str(drafter_dir))
    loaded = SpeculativeGenerator.from_pretrained(str(target_dir), str(drafter_dir), tree_budget=4)
    assert loaded.target.config.vocab_size == VOCAB and loaded.tokenizer is not None  # the loader it names works


# --------------------------------------------------------------------------- prompts and lengths


def test_empty_prompt(gen):
    with pytest.raises(ValueError, match=r"the prompt is empty"):
        gen.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"the prompt is empty"):
        gen.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"row 1 of the prompt is empty"):
        gen.generate([[1, 2], []], max_new_tokens=4)


def test_max_new_tokens_below_one(gen):
    for bad in (0, -3, 2.0):
        with pytest.raises(ValueError, match=r"max_new_tokens must be an int >= 1"):
            gen.generate(PROMPT, max_new_tokens=bad)


def test_prompt_longer_than_max_positions(gen):
    with pytest.raises(ValueError, match=r"513 tokens, more than the target's max_position_embeddings \(512\)"):
        gen.generate(torch.ones(1, 513, dtype=torch.long), max_new_tokens=1)


def test_prompt_plus_max_new_tokens_beyond_max_positions():
    """The issue's case: a 250-token prompt and max_new_tokens=20 on a 256-position target would run to 270
    positions; refused with both numbers and the largest max_new_tokens that fits. An exact fit runs."""
    target = tiny_target("qwen3", max_position_embeddings=256)
    prompt = torch.arange(250).remainder(VOCAB - 1)[None]
    ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                          pad_token_id=0)
    gen = SpeculativeGenerator(target, ScriptedDrafter(ref[0], VOCAB), tree_budget=4)
    with pytest.raises(ValueError, match=r"the prompt has 250 tokens and max_new_tokens is 20: 270 positions, more "
                                         r"than the target's max_position_embeddings \(256\); lower max_new_tokens "
                                         r"to 6 or shorten the prompt"):
        gen.generate(prompt, max_new_tokens=20)
    with pytest.raises(ValueError, match=r"the longest prompt \(row 1\) has 253 tokens and max_new_tokens is 8: "
                                         r"261 positions.*lower max_new_tokens to 3"):
        gen.generate([[1, 2, 3], [4] * 253], max_new_tokens=8)
    with pytest.raises(ValueError, match=r"has 256 tokens .* \(256\); shorten the prompt$"):
        gen.generate(torch.ones(1, 256, dtype=torch.long), max_new_tokens=1)
    with pytest.raises(ValueError, match=r"positions, more than the target's max_position_embeddings"):
        next(gen.stream(prompt, max_new_tokens=7))
    out = gen.generate(prompt, max_new_tokens=6, stop_token_ids=())  # 250 + 6 = 256: fits
    assert torch.equal(out.sequences, ref) and out.acceptance_lengths == [5]  # the prefill's token, then 4 + 1


def test_stop_ids_outside_the_vocabulary(gen):
    """A stop id the target cannot emit would never stop anything: refused naming the id and the vocabulary."""
    for given in ({"stop_token_ids": [1_000_000]}, {"stop_token_ids": [3, VOCAB]}, {"eos_token_id": -1},
                  {"eos_token_id": VOCAB}):
        bad = [v for v in (given.get("stop_token_ids") or [given.get("eos_token_id")]) if not 0 <= v < VOCAB][0]
        with pytest.raises(ValueError, match=rf"stop token id {bad} is outside the target's vocabulary \[0, {VOCAB}\)"
                                             r".*tokenizer\.eos_token_id.*stop_token_ids=\(\)"):
            gen.generate(PROMPT, max_new_tokens=4, **given)
    ref = gen.drafter.references[0]
    unused = next(t for t in range(VOCAB - 1, -1, -1) if t not in ref.tolist())  # the last id that never stops it
    out = gen.generate(PROMPT, max_new_tokens=12, stop_token_ids=[unused])
    assert out.sequences[0].tolist() == ref[:15].tolist() and out.acceptance_lengths == [5, 5, 5]


def test_bad_batches_are_refused_before_any_state(gen):
    with pytest.raises(ValueError, match=r"cannot read a prompt"):
        gen.generate(torch.ones(1, 2, 3, dtype=torch.long), max_new_tokens=2)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(ValueError, match=r"not left padding"):
        gen.generate(ids, attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"do not match the prompt rows"):
        gen.generate(ids, attention_mask=torch.ones(2, 3, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"token id 10000 in row 1 is outside the vocabulary"):
        gen.generate([[1, 2], [3, 10_000]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"a text prompt needs a tokenizer"):
        gen.generate("hello", max_new_tokens=2)
    # nothing was left behind: the same generator still gives the single-prompt answer
    ok = gen.generate(OTHER, max_new_tokens=4)
    assert ok.sequences[0].tolist() == gen.drafter.references[1][:7].tolist() and ok.acceptance_lengths == [5]


# --------------------------------------------------------------------------- sampling settings


@pytest.mark.parametrize("top_p", [0, 0.0, 1.5, -0.1])
def test_top_p_outside_unit_interval(gen, top_p):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingConfig(1.0, top_p=top_p)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        gen.generate(PROMPT, max_new_tokens=2, temperature=1.0, top_p=top_p)


def test_temperature_below_zero(gen):
    with pytest.raises(ValueError, match=r"temperature must be >= 0"):
        SamplingConfig(-0.5)
    with pytest.raises(ValueError, match=r"temperature must be >= 0"):
        gen.generate(PROMPT, max_new_tokens=2, temperature=-1.0)


@pytest.mark.parametrize("top_k", [0, -3, 2.5])
def test_top_k_below_one(gen, top_k):
    with pytest.raises(ValueError, match=r"top_k must be a positive int"):
        SamplingConfig(1.0, top_k=top_k)
    with pytest.raises(ValueError, match=r"top_k must be a positive int"):
        gen.generate(PROMPT, max_new_tokens=2, temperature=1.0, top_k=top_k)


@pytest.mark.parametrize("name, value", [("temperature", "hot"), ("temperature", math.nan), ("top_p", "x"),
                                         ("top_k", "5"), ("temperature", [0.7])])
@pytest.mark.parametrize("hf", [False, True])
def test_a_sampling_setting_that_is_no_number_is_refused_by_name(gen, name, value, hf):
    """``float("hot")`` says only "could not convert string to float": the refusal names the parameter."""
    options = {"temperature": 1.0, name: value, **({"do_sample": True} if hf else {})}
    with pytest.raises(ValueError, match=rf"^{name} must be .*got {re.escape(repr(value))}$"):
        gen.generate(PROMPT, max_new_tokens=2, **options)


@pytest.mark.parametrize("seed", [2**64, 2**70, -1, [3, -1]])
def test_a_seed_outside_its_64_bits_is_refused_not_wrapped(gen, seed):
    """Keys are made from a seed's 64 bits: 2**70 would draw seed 0's tokens and -1 seed 2**64-1's while
    ``out.seed`` reported the seed given. Refused, naming the range and the seed it would have drawn."""
    wraps = (seed[1] if isinstance(seed, list) else seed) % 2**64
    with pytest.raises(ValueError, match=rf"outside \[0, 2\*\*64\).*draw seed {wraps}'s tokens"):
        gen.generate([PROMPT[0].tolist()] * (2 if isinstance(seed, list) else 1), max_new_tokens=2,
                     temperature=1.0, seed=seed)
    with pytest.raises(ValueError, match=r"outside \[0, 2\*\*64\)"):
        row_key(seed[1] if isinstance(seed, list) else seed)


def test_the_edges_of_the_seed_range_draw_their_own_tokens(gen):
    top = gen.generate(PROMPT, max_new_tokens=6, temperature=1.0, seed=2**64 - 1)
    assert top.seed == 2**64 - 1 and top.row_tokens == gen.generate(PROMPT, max_new_tokens=6, temperature=1.0,
                                                                     seed=2**64 - 1).row_tokens
    assert row_key(2**64 - 1) != row_key(0) and row_key(2**64 - 1, 1) != row_key(0, 1)


@pytest.mark.parametrize("builder, most, deepest", [("chain", 4, 4), ("beam@2x3", 6, 3)])
def test_a_budget_past_the_builders_reach_reports_the_nodes_built_and_says_so_once(target, builder, most, deepest):
    """``chain`` builds one node per drafted depth and ``beam@WxD`` at most ``W x D``: at ``tree_budget=64``
    the rounds verify that many, ``stats.nodes`` says so beside ``stats.budgets`` (64), and one warning per
    generator names the most it builds and the fix. Every round accepts what its recorded tree predicts."""
    ref = target.generate(PROMPT, max_new_tokens=24, do_sample=False, pad_token_id=0)[0]
    gen = SpeculativeGenerator(target, ScriptedDrafter(ref, VOCAB), builder=builder, tree_budget=64,
                               prompt_lookup=False)
    with pytest.warns(UserWarning, match=rf"tree_budget=64 is more than builder '{builder}' builds: at most "
                                         rf"{most} draft nodes .* verifies at most {most} .*tree_budget={most} or"):
        out = gen.generate(PROMPT, max_new_tokens=12, record_trees=True)
    assert set(out.stats.budgets) == {64} and set(out.stats.nodes) == {most}
    assert all(r.tree.num_nodes == most + 1 for r in out.rounds)
    assert out.acceptance_lengths == [expected_acceptance(r, ref.tolist()) for r in out.rounds]
    assert out.acceptance_lengths[0] == deepest + 1  # the scripted drafter is right: its path to the deepest
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen.generate(PROMPT, max_new_tokens=4)  # said once
    lookup = SpeculativeGenerator(target, ScriptedDrafter(ref, VOCAB), builder=builder, tree_budget=64,
                                  prompt_lookup=True)
    with pytest.warns(UserWarning, match=rf"plus the lookup branch's 4, so each round verifies at most {most + 4}"):
        out = lookup.generate(PROMPT, max_new_tokens=12)
    assert set(out.stats.nodes) == {most + 4}
    fits = SpeculativeGenerator(target, ScriptedDrafter(ref, VOCAB), builder=builder, tree_budget=most)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(fits.generate(PROMPT, max_new_tokens=6).stats.nodes) == {most}


def test_valid_inputs_still_run(gen):
    # The same generator accepts good inputs: the errors above are about the inputs, not the setup.
    out = gen.generate(PROMPT, max_new_tokens=3, temperature=1.0, top_k=5, top_p=0.9, seed=0)
    assert out.new_tokens.shape == (1, 3)
    ref = gen.target.generate(PROMPT, max_new_tokens=12, do_sample=False, pad_token_id=0)
    good = gen.generate(PROMPT, max_new_tokens=12)
    assert torch.equal(good.sequences, ref) and good.acceptance_lengths == [5, 5, 5]
