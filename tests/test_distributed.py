"""Scale-out on one CPU: tensor-parallel targets under torchrun (gloo), layer-split targets, data-parallel bench.

The torchrun launches run ``tests/tp_worker.py`` (or ``-m ddtree.bench``) in
subprocesses, each bounded by a timeout, so a hang fails the test instead of
the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import tp_worker
from tiny import tiny_drafter, tiny_target

import ddtree
from ddtree import SpeculativeGenerator
from ddtree.bench.main import run_main_bench

try:
    import accelerate  # noqa: F401

    HAVE_ACCELERATE = True
except ImportError:
    HAVE_ACCELERATE = False
needs_accelerate = pytest.mark.skipif(not HAVE_ACCELERATE, reason="tp_plan and device_map loading need accelerate "
                                      "(transformers 5.0 requires it for both), which this environment lacks")

WORKER = Path(__file__).with_name("tp_worker.py")
RANKS = 2


def _env() -> dict:
    """The children import this worktree's ddtree and the tests' helpers, one thread per rank."""
    root = str(Path(ddtree.__file__).resolve().parent.parent)
    paths = [root, str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1"}


def torchrun(*args: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS), *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """Tiny float64 Llama and Qwen3 pairs on disk (Llama's drafter with a draft vocabulary: the sliced lm_head)."""
    root = tmp_path_factory.mktemp("pairs")
    for kind in tp_worker.KINDS:
        target = tiny_target(kind)
        cfg = target.config
        # tp_plan shards attention heads and MLP columns: each must split evenly over the ranks.
        assert cfg.num_attention_heads % RANKS == 0 and cfg.num_key_value_heads % RANKS == 0
        assert cfg.intermediate_size % RANKS == 0
        target.save_pretrained(root / kind / "target")
        drafter = tiny_drafter(target)
        if kind == "llama":
            drafter.draft_vocab = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(3))[:60]
            tiny_drafter(target, seed=7).save_pretrained(root / kind / "other_drafter")
        drafter.save_pretrained(root / kind / "drafter")
    tiny_drafter(tiny_target("llama", hidden_size=32, head_dim=8)).save_pretrained(root / "wrong_drafter")
    return root


@pytest.fixture(scope="module")
def tp_run(pairs) -> subprocess.CompletedProcess:
    """The ranks' checks, ended by an uncaught error on rank 1 once they are written (``tp_worker`` ``checks``)."""
    return torchrun(str(WORKER), "checks", str(pairs), timeout=300)


@pytest.fixture(scope="module")
def tp_results(pairs, tp_run) -> list[dict]:
    files = [pairs / f"checks_rank{r}.json" for r in range(RANKS)]
    assert all(f.exists() for f in files), tp_run.stderr[-4000:]  # every check ran on every rank
    results = [json.loads(f.read_text()) for f in files]
    assert all("unexpected" not in r for r in results), tp_run.stderr[-4000:]
    return results


@pytest.fixture(scope="module")
def single_cases(pairs) -> dict:
    """``tp_worker.cases`` of each kind in this one process, the reference the ranks must equal."""
    return {kind: tp_worker.cases(tp_worker.load(pairs, kind)) for kind in tp_worker.KINDS}


@needs_accelerate
def test_tensor_parallel_equals_single_process(tp_results, single_cases):
    for kind in tp_worker.KINDS:
        single = single_cases[kind]
        assert single["chain/scripted"]["acceptance"] != single["best_first/scripted"]["acceptance"]
        assert max(single["best_first/scripted"]["acceptance"]) > 2  # acceptance worth comparing
        for r, res in enumerate(tp_results):
            for name, want in single.items():
                got = res[kind]["cases"][name]
                assert got["tokens"] == want["tokens"], (kind, r, name)
                assert got["acceptance"] == want["acceptance"], (kind, r, name)
                assert got["budgets"] == want["budgets"], (kind, r, name)
    assert tp_results[0]["sharded_lm_head"] == "DTensor"  # the drafter really read a sharded lm_head


@needs_accelerate
def test_ranks_share_budget_and_seed_decisions(tp_results, single_cases):
    reference = single_cases["llama"]["plain"]["tokens"][0]
    for kind in tp_worker.KINDS:
        rank0, rank1 = (res[kind] for res in tp_results)
        skew0, skew1 = rank0["skewed"], rank1["skewed"]
        # Alone, each rank's clock would pick other budgets; the rounds used rank 0's, on both ranks.
        assert skew0["local"] != skew1["local"]
        # (budget 0: a plain step, decided by rank 0 from its measured rates and shared; the rest are choose's)
        assert skew0["budgets"] == skew1["budgets"] and [b for b in skew0["budgets"] if b] == skew0["local"]
        assert rank0["auto"]["budgets"] == rank1["auto"]["budgets"] and rank0["auto"]["budgets"]
        for name in ("skewed", "auto", "sampled/default_seed"):
            assert rank0[name]["tokens"] == rank1[name]["tokens"], (kind, name)
            assert rank0[name]["acceptance"] == rank1[name]["acceptance"], (kind, name)
        assert rank0["decided"] == rank1["decided"] == 7 and rank1["shared_tensor"] == [0.0, 0.0]
        if kind == "llama":  # greedy whatever the budgets: the plain decoding's tokens
            assert skew0["tokens"][0] == rank0["auto"]["tokens"][0] == reference


@needs_accelerate
def test_failing_rank_fails_every_rank_in_step(tp_results):
    f0, f1 = tp_results[0]["failures"], tp_results[1]["failures"]
    assert f1["bad_input"].startswith("ValueError: token id 500 in row 0 is outside the vocabulary")
    assert f0["bad_input"].startswith("RankFailedError: rank 1 failed while checking generate's inputs: ValueError")
    assert "ranks disagree on generate's inputs" in f0["different_prompts"] == f1["different_prompts"]
    assert f1["wrong_drafter"].startswith("ValueError: drafter hidden size")
    # refused from the configs, before either model is read, on both ranks at once
    assert f0["wrong_drafter"].startswith("RankFailedError: rank 1 failed while checking the drafter")
    assert "drafter hidden size 32 does not match the target's 64" in f0["wrong_drafter"]
    assert "ranks disagree on the drafter" in f0["other_weights"] == f1["other_weights"]
    assert f0["after"] == f1["after"]  # still in step afterwards


@needs_accelerate
def test_uncaught_error_on_one_rank_exits_every_rank(tp_run, tp_results):
    proc = tp_run  # the checks' run ends with rank 1's bad input, uncaught (tp_results: the checks got that far)
    assert proc.returncode != 0
    assert "RANK 1 ERROR ValueError: token id 500 in row 0 is outside the vocabulary" in proc.stderr
    assert "RANK 0 ERROR RankFailedError: rank 1 failed while checking generate's inputs" in proc.stderr


@needs_accelerate
def test_layer_split_target_with_disk_offload(pairs, tmp_path):
    """accelerate hooks on every layer, two layers offloaded to disk, output and acceptance unchanged.

    One CPU cannot show hidden states arriving from several devices: here every
    executed layer runs on the CPU. ``ddtree.bench.gpu_check`` covers the
    cross-device case (layers split over GPUs) where more than one GPU exists.
    """
    from accelerate import dispatch_model

    plain = tp_worker.load(pairs, "qwen3")
    split = tp_worker.load(pairs, "qwen3")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    dispatch_model(split.target, device_map=device_map, offload_dir=str(tmp_path / "offload"))
    assert hasattr(split.target.model.layers[1], "_hf_hook")
    assert split.target.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # really offloaded
    for builder in ("chain", "best_first"):
        want = SpeculativeGenerator(plain.target, plain.drafter, tree_budget=8, builder=builder)
        got = SpeculativeGenerator(split.target, split.drafter, tree_budget=8, builder=builder)
        for prompt in tp_worker.PROMPTS:
            a = want.generate(prompt, max_new_tokens=16)
            b = got.generate(prompt, max_new_tokens=16)
            assert b.row_tokens == a.row_tokens and b.acceptance_lengths == a.acceptance_lengths
        a, b = (g.generate(tp_worker.PROMPTS, max_new_tokens=8) for g in (want, got))
        assert b.row_tokens == a.row_tokens and b.acceptance_lengths == a.acceptance_lengths
    # The loading path: from_pretrained(device_map=...) places the target and puts the drafter with its embedding.
    loaded = tp_worker.load(pairs, "qwen3", device_map={"model": "cpu", "lm_head": "cpu"})
    assert loaded.drafter.model.fc.weight.device == loaded.target.get_input_embeddings().weight.device
    a, b = (g.generate(tp_worker.PROMPTS[1], max_new_tokens=16) for g in (plain, loaded))
    assert b.row_tokens == a.row_tokens and b.acceptance_lengths == a.acceptance_lengths


@needs_accelerate
def test_offloaded_lm_head_is_refused_with_the_fix(pairs, tmp_path):
    from accelerate import dispatch_model

    gen = tp_worker.load(pairs, "llama")
    dispatch_model(gen.target, device_map={"model": "cpu", "lm_head": "disk"}, offload_dir=str(tmp_path / "o"))
    with pytest.raises(ValueError, match="lm_head is offloaded .* keep it on a device"):
        ddtree.blocks.DFlashDrafter(gen.drafter.model, gen.target)


def test_data_parallel_bench_equals_single_process(pairs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n"
                               for i, p in enumerate(tp_worker.PROMPTS + [[3, 1, 4, 1, 5], [9, 2, 6]])))
    common = ["--target", str(pairs / "llama" / "target"), "--drafter", str(pairs / "llama" / "drafter"),
              "--prompts", str(prompts), "--methods", "ar,chain,best_first@4", "--max-new-tokens", "12",
              "--repeats", "1", "--dtype", "float64", "--device", "cpu", "--no-plots", "--no-warmup",
              "--no-progress", "--save-trees"]
    proc = torchrun("-m", "ddtree.bench", *common, "--out", str(tmp_path / "dp"), timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert run_main_bench([*common, "--out", str(tmp_path / "one")]) == 0
    dp, one = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("dp", "one"))
    assert dp["meta"]["data_parallel_ranks"] == RANKS and dp["meta"]["num_prompts"] == one["meta"]["num_prompts"] == 4
    assert sorted(r["rank"] for r in dp["runs"]) == [0] * 6 + [1] * 6  # each rank ran half the prompts

    def by_key(result):
        return {(r["method"], r["prompt"]): (r["new_tokens"], r["acceptance"], r["budgets"]) for r in result["runs"]}

    assert by_key(dp) == by_key(one)
    for a, b in zip(dp["methods"], one["methods"]):
        assert a["method"] == b["method"] and a["lossless"] == b["lossless"] in (True, None)
        for key in ("tau", "depth_acceptance", "rounds", "new_tokens"):
            assert a[key] == b[key], (a["method"], key)
    # Outputs: every tree method's rounds (tree, accepted path, bonus) are the same, and equal to ar (lossless).
    def rounds(paths):
        rows = [json.loads(line) for p in paths for line in p.read_text().splitlines()]
        return sorted(json.dumps(r, sort_keys=True) for r in rows)

    assert rounds(sorted((tmp_path / "dp").glob("trees.rank*.jsonl"))) == rounds([tmp_path / "one" / "trees.jsonl"])
    assert sorted(p.name for p in (tmp_path / "dp").glob("results*")) == ["results.json", "results.md"]


# --------------------------------------------------------------------------- no ranks: the hooks stay out of the way


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_leaving_the_data_parallel_group_stops_its_threads(pairs):
    """A group kept alive past ``destroy_process_group`` (torch.distributed.nn, imported by transformers' loading
    after the group exists, binds it as a default argument) leaves gloo threads running into the interpreter's
    exit, where they can abort a rank that succeeded ("terminate called without an active exception")."""
    proc = torchrun(str(WORKER), "leave", str(pairs), timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for r in range(RANKS):
        threads = json.loads((pairs / f"leave_rank{r}.json").read_text())["threads_after_leaving"]
        assert not [t for t in threads if "gloo" in t], threads


def test_lockstep_is_a_no_op_without_ranks():
    from ddtree.runtime.distributed import Lockstep, is_distributed

    gen = SpeculativeGenerator(tiny_target("llama"), tiny_drafter(tiny_target("llama")), tree_budget=4)
    assert not is_distributed() and not gen.lockstep.active
    value = {"t": torch.arange(3)}
    assert gen.lockstep.share(value) is value and gen.lockstep.decide(lambda: 7) == 7
    with pytest.raises(ValueError, match="boom"), Lockstep().fail_together("testing"):
        raise ValueError("boom")  # raised as it is: nothing to tell other ranks


def test_tp_plan_refuses_heads_that_do_not_divide_before_loading():
    from transformers import LlamaConfig

    from ddtree.runtime.distributed import check_tp_divides

    smollm2 = LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    with pytest.raises(ValueError, match=r"num_attention_heads=9, num_key_value_heads=3: launch torchrun with "
                                         r"--nproc_per_node in \[1, 3\]"):
        check_tp_divides(smollm2, 2)
    check_tp_divides(smollm2, 3)


def test_features_are_gathered_on_the_drafters_device():
    """Each chosen layer is moved to ``device`` before the concatenation (``meta`` stands in for another device)."""
    hidden = [torch.full((1, 2, 3), float(i)) for i in range(5)]
    feats = ddtree.blocks.extract_context_feature(hidden, [0, 3])
    assert feats.shape == (1, 2, 6) and feats[0, 0].tolist() == [1.0] * 3 + [4.0] * 3
    assert ddtree.blocks.extract_context_feature(hidden, [0, 3], device="meta").device.type == "meta"


def test_bench_tokens_per_second_add_up_over_data_parallel_ranks():
    from ddtree.bench.methods import parse_methods
    from ddtree.bench.report import summarize
    from ddtree.bench.runner import Run

    def run(method, prompt, rank, tokens, seconds):
        tree = method != "ar"
        return Run(method, prompt, 0, tokens, seconds, [1] * tokens if tree else [], {}, [4] * tokens if tree else [],
                   [0] * tokens, rank=rank)

    runs = [run("ar", "a", 0, 10, 1.0), run("ar", "b", 0, 10, 1.0), run("ar", "c", 1, 30, 2.0),
            run("chain", "a", 0, 10, 0.5), run("chain", "b", 0, 10, 0.5), run("chain", "c", 1, 30, 1.0)]
    rows = {r["method"]: r for r in summarize(runs, parse_methods("ar,chain"), depth=4, greedy=True)}
    # Side by side: rank 0 at 20 tokens / 2 s, rank 1 at 30 tokens / 2 s (ar); each twice as fast with chain.
    assert rows["ar"]["tokens_per_second"] == pytest.approx(10 + 15)
    assert rows["chain"]["tokens_per_second"] == pytest.approx(20 + 30)
    assert rows["chain"]["speedup"] == pytest.approx(2.0)
    one_rank = [Run(**{**r.__dict__, "rank": 0}) for r in runs]
    assert summarize(one_rank, parse_methods("ar,chain"), 4, True)[0]["tokens_per_second"] == pytest.approx(50 / 4)
