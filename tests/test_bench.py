"""The bench: method and prompt parsing, the lossless check, an end-to-end run, and the tree-build reference."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from tiny import VOCAB, ScriptedDrafter, tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.bench.main import run_main_bench
from ddtree.bench.methods import Method, parse_methods
from ddtree.bench.prompts import Prompt, load_prompts
from ddtree.bench.report import markdown_table, summarize
from ddtree.bench.runner import Bench, Run, load_rounds, lossless_check
from ddtree.bench.tree_build import heap_best_first, same_tree
from ddtree.bench.tree_build import main as tree_build_main
from ddtree.blocks import best_first


def names(spec):
    return [m.name for m in parse_methods(spec)]


def test_parse_methods_lists_and_ranges():
    ms = parse_methods("ar,chain,best_first@16,32,beam@4x8,auto,examples.custom_builder:spine@8,12")
    assert [m.name for m in ms] == [
        "ar", "chain", "best_first@16", "best_first@32", "beam@4x8", "auto",
        "examples.custom_builder:spine@8", "examples.custom_builder:spine@12",
    ]
    by = {m.name: m for m in ms}
    assert by["ar"].kind == "ar"
    assert by["chain"] == Method("chain", builder="chain", budget=None)
    assert by["beam@4x8"].budget == 32 and by["beam@4x8"].builder == "beam@4x8"
    assert by["auto"].budget == "auto" and by["auto"].builder == "best_first"
    assert by["examples.custom_builder:spine@12"].builder == "examples.custom_builder:spine"
    assert names("best_first@1-16") == ["ar", "best_first@1", "best_first@2", "best_first@4", "best_first@8",
                                        "best_first@16"]
    assert names(["chain", "best_first@4,4,3-8"]) == ["ar", "chain", "best_first@4", "best_first@8"]
    assert names("best_first,chain@3") == ["ar", "best_first@32", "chain@3"]


@pytest.mark.parametrize("bad", ["16", "auto,8", "beam@4", "beam@0x3", "greedy", "best_first@8-2", "chain,4",
                                 "mod:fn-x@4"])
def test_parse_methods_rejects(bad):
    with pytest.raises(ValueError):
        parse_methods(bad)


class WordTokenizer:
    """A stand-in tokenizer: one id per word, a chat template that joins the turns."""

    chat_template = "x"
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        ids = [len(w) for w in text.split()]
        return type("Enc", (), {"input_ids": ([1] if add_special_tokens else []) + ids})()

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"


def test_load_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [
        {"id": "m", "messages": [{"role": "user", "content": "hello big world"}]},
        {"prompt": "abc de"},
        {"input_ids": [5, 6, 7]},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ps = load_prompts(f, WordTokenizer())
    assert [p.id for p in ps] == ["m", "1", "2"]
    assert ps[0].input_ids == [6, 5, 3, 5, 11] and ps[1].input_ids == [1, 3, 2] and ps[2].input_ids == [5, 6, 7]
    assert load_prompts(f, None, vocab_size=50, limit=2)[1].input_ids == [b % 50 for b in b"abc de"]
    shipped = load_prompts(None, WordTokenizer())
    assert len(shipped) >= 8
    spread = load_prompts(None, WordTokenizer(), per_category=1)
    assert 1 < len(spread) < len(shipped) and len({p.id.split("-")[0] for p in spread}) == len(spread)
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="needs 'messages', 'prompt' or 'input_ids'"):
        load_prompts(tmp_path / "bad.jsonl", WordTokenizer())


def _run(method, prompt, repeat, tokens):
    return Run(method, prompt, repeat, len(tokens), 1.0, [2] * 2, {}, [4, 4], tokens)


def test_lossless_check_finds_the_first_mismatch():
    runs = [
        _run("ar", "a", 0, [1, 2, 3, 4]), _run("ar", "b", 0, [5, 6]), _run("ar", "a", 1, [1, 2, 3, 4]),
        _run("good", "a", 0, [1, 2, 3, 4]), _run("good", "b", 0, [5, 6]), _run("good", "a", 1, [1, 2, 3, 4]),
        _run("bad", "a", 0, [1, 2, 3, 4]), _run("bad", "b", 0, [5, 7]), _run("short", "a", 0, [1, 2]),
    ]
    check = lossless_check(runs)
    assert check["good"] == {"runs": 3, "equal": 3, "first_mismatch": None, "lossless": True}
    assert check["bad"]["lossless"] is False and check["bad"]["equal"] == 1
    assert check["bad"]["first_mismatch"] == {"prompt": "b", "repeat": 0, "token_index": 1}
    assert check["short"]["first_mismatch"]["token_index"] == 2  # a prefix of the reference is not equal


def scripted_generator(target, prompts: list[list[int]], new: int) -> SpeculativeGenerator:
    """A generator whose drafter proposes each prompt's own greedy continuation: acceptance is known."""
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new + 8, do_sample=False,
                              pad_token_id=0, eos_token_id=None)  # past the cut: the last round drafts there too
        refs.append(out[0])
    return SpeculativeGenerator(target, ScriptedDrafter(refs, VOCAB, block_size=5, match_prompt=True))


def test_bench_end_to_end_on_tiny_pair(tmp_path):
    torch.manual_seed(0)
    target = tiny_target("qwen3")
    prompts = [Prompt("p0", list(range(3, 14))), Prompt("p1", [40, 41, 42, 7])]
    gen = scripted_generator(target, [p.input_ids for p in prompts], 8)
    methods = parse_methods("chain,best_first@8,beam@2x2,examples.custom_builder:spine@6")
    bench = Bench(gen, methods, max_new_tokens=8, seed=1)
    runs = bench.run(prompts, repeats=2, warmup=False, progress=False, trees_path=tmp_path / "trees.jsonl")
    assert len(runs) == len(methods) * len(prompts) * 2
    rows = summarize(runs, methods, bench.depth, greedy=True)
    assert [r["method"] for r in rows] == [m.name for m in methods]
    for r in rows:
        assert r["lossless"] is True
        assert len(r["speedup_per_repeat"]) == 2 and r["tokens_per_second"] > 0
        if r["method"] != "ar":
            # the drafter proposes the continuation: every round accepts the tree's full depth (beam@2x2: 2)
            deep = 2 if r["method"] == "beam@2x2" else bench.depth
            assert r["tau"] == pytest.approx(1 + deep), r["method"]
            assert r["depth_acceptance"] == pytest.approx([1.0] * deep + [0.0] * (bench.depth - deep)), r["method"]
            assert set(r["stage_ms_per_round"]) >= {"draft", "tree_build", "mask", "verify", "commit"}
    assert {r["method"]: r["budget"] for r in rows}["chain"] == bench.depth
    assert "| best_first@8 | 8 |" in markdown_table(rows)
    saved = load_rounds(tmp_path / "trees.jsonl")
    assert {s["method"] for s in saved} == {m.name for m in methods if m.kind == "tree"}
    row = next(s for s in saved if s["method"] == "best_first@8")
    tree = row["tree"]
    assert tree.num_nodes <= 9 and row["accepted"][0] == 0 and len(row["accepted"]) == 1 + bench.depth
    graph = tree.to_networkx()
    assert graph.number_of_edges() == tree.num_nodes - 1
    assert all(graph.has_edge(a, b) for a, b in zip(row["accepted"], row["accepted"][1:]))


def test_cli_on_saved_tiny_pair(tmp_path, monkeypatch):
    """One repeat on the tiny pair: rounds per method (plain: its decode steps), each round timed as it commits,
    a plain step beside each verify by node count, a comparison per method with its noise, no spread column
    without repeats, and the thread count's source as the console says it."""
    from ddtree.runtime import threads

    monkeypatch.setattr(threads, "_explicit", None)  # restored after: --threads 1 sets it for the process
    torch.manual_seed(0)
    target = tiny_target("llama", dtype=torch.float32)
    drafter = tiny_drafter(target)
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "x", "prompt": "hello tree"}\n{"id": "y", "input_ids": [4, 9, 2, 30]}\n')
    out = tmp_path / "out"
    rc = run_main_bench([
        "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts),
        "--methods", "chain,best_first@4", "--max-new-tokens", "6", "--repeats", "1", "--out", str(out),
        "--no-plots", "--no-warmup", "--no-progress", "--save-trees", "--threads", "1",
    ])
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    assert [m["method"] for m in result["methods"]] == ["ar", "chain", "best_first@4"]
    assert result["meta"]["num_prompts"] == 2 and result["meta"]["command"].startswith("python -m ddtree.bench")
    assert result["meta"]["threads"]["source"] == "argument" and result["meta"]["threads"]["threads"] == 1
    md = (out / "results.md").read_text()
    assert "| chain |" in md
    assert load_rounds(out / "trees.jsonl")
    rows = {r["method"]: r for r in result["methods"]}
    for run in result["runs"]:  # the prefill's token is not a round; every later token is in one
        assert sum(run["round_tokens"]) == run["new_tokens"] - 1 and len(run["round_seconds"]) == \
            len(run["round_tokens"]), run["method"]
        assert all(s > 0 for s in run["round_seconds"])
        if run["method"] == "ar":
            assert run["round_tokens"] == [1] * (run["new_tokens"] - 1)
        else:  # one timed round per verify round, committing what it accepted (the last one cut at the limit)
            assert run["round_tokens"][:-1] == run["acceptance"][:-1] and run["round_tokens"][-1] <= \
                run["acceptance"][-1]
    assert rows["ar"]["rounds"] == sum(r["new_tokens"] - 1 for r in result["runs"] if r["method"] == "ar")
    assert rows["chain"]["rounds"] == sum(len(r["acceptance"]) for r in result["runs"] if r["method"] == "chain")
    assert rows["ar"]["nodes_per_verify"] == 1.0 and rows["chain"]["nodes_per_verify"] == 5.0  # root + depth 4
    assert 1.0 < rows["best_first@4"]["nodes_per_verify"] <= 5.0
    assert all(rows[m]["verify_ms"] > 0 and rows[m]["verify_ms_se"] is not None for m in rows)  # two runs each
    assert "speedup vs ar |" in md and "min–max" not in md  # no spread without repeats
    assert "| method | budget | rounds | tokens/round (± std) |" in md
    assert f"| ar | 1.0 | {rows['ar']['verify_ms']:.2f} ± " in md  # a plain step beside the verifies
    comps = result["comparisons"]
    assert {c["method"] for c in comps["against_ar"]} == {"chain", "best_first@4"}
    assert comps["best"] in rows and len(comps["against_best"]) == 2
    for c in comps["against_ar"] + comps["against_best"]:
        assert c["repeat_range"] is None and c["rounds_interval"][0] < c["rounds_ratio"] < c["rounds_interval"][1]
        assert c["verdict"] in ("faster", "slower", "within noise")
        assert f"- {c['method']} vs {c['against']}: " in md


def test_heap_reference_builds_the_same_trees():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        lp = torch.randn(1, 1 + trial % 6, 30, generator=g) * (1 + trial % 4)
        if trial % 2:
            lp = (lp * 2).round() / 2  # many exact ties
        lp = lp.log_softmax(-1)
        for budget in (0, 1, 4, 17, 60, 200):
            root = torch.tensor([trial % 30])
            assert same_tree(heap_best_first(root, lp, budget), best_first(root, lp, budget)), (trial, budget)


def test_heap_reference_matches_on_wide_and_deep_trees():
    """Budgets where the deep levels outgrow best_first's first cap (and it must lift it), and peaked
    drafter-like rows where the pruning bounds bite."""
    from ddtree.bench.tree_build import synthetic_logprobs

    g = torch.Generator().manual_seed(1)
    root = torch.tensor([0])
    for _ in range(4):
        logits = torch.randn(1, 4, 300, generator=g) * 0.2
        logits.scatter_add_(2, torch.randint(0, 300, (1, 4, 40), generator=g), torch.full((1, 4, 40), 8.0))
        lp = logits.log_softmax(-1)  # ~40 equally likely tokens per depth: wide trees
        for budget in (64, 128, 300):
            assert same_tree(heap_best_first(root, lp, budget), best_first(root, lp, budget))
    for seed in range(2):
        lp = synthetic_logprobs(15, 3000, seed)
        for budget in (64, 256, 1024):
            assert same_tree(heap_best_first(root, lp, budget), best_first(root, lp, budget))


def test_tree_build_command(tmp_path, capsys):
    assert tree_build_main(["--budgets", "8,32", "--vocabs", "500", "--batches", "1,3", "--repeats", "1",
                            "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "tree_build.json").read_text())["rows"]
    assert [(r["budget"], r["vocab"], r["batch"], r["same_tree"]) for r in rows] == [
        (8, 500, 1, True), (32, 500, 1, True), (8, 500, 3, True), (32, 500, 3, True)]
    assert [r["heap_after_topk_ms"] is None for r in rows] == [False, False, True, True]  # the heap loop: batch 1
    assert all(r["device_chain_ms"] > 0 and r["numpy_chain_ms"] > 0 for r in rows)
    assert "ratio after top-k" in capsys.readouterr().out


def test_batch_bench_keeps_batch_one_acceptance_and_outputs():
    from ddtree.bench.batch import markdown_batch_table, run_batches, summarize_batches

    target = tiny_target("qwen3")
    methods = parse_methods("chain,best_first@6")
    prompts = [Prompt("p0", list(range(3, 14))), Prompt("p1", [40, 41, 42, 7]), Prompt("p2", [9, 8, 7, 6, 5, 4])]
    gen = scripted_generator(target, [p.input_ids for p in prompts], 10)
    runs = run_batches(gen, methods, prompts, [1, 3], max_new_tokens=10, repeats=1, stops=[], depth=4)
    rows = summarize_batches(runs)
    assert {(r["batch_size"], r["method"]) for r in rows} == {
        (b, m) for b in (1, 3) for m in ("hf", "ar", "chain", "best_first@6")}
    for r in rows:
        assert r["tokens_per_second"] > 0
        if r["method"] in ("chain", "best_first@6"):
            assert r["acceptance_equals_batch_1"] == (3, 3)  # the same trees at batch 3
            # 10 tokens: the prefill's, then rounds of a full chain (5) and the 4 left of the next
            assert r["tau"] == pytest.approx(5.0) and r["verify_ms_per_round"] > 0
        assert r["rows_equal_to_batch_1_plain"] == (3, 3)  # float64: every method, every row, exact
    assert "| 3 | best_first@6 |" in markdown_batch_table(rows)


def test_lookup_methods_parse_run_and_report_sources():
    methods = parse_methods("lookup,best_first@6+lookup,chain+lookup,hf_lookup")
    names = [m.name for m in methods]
    assert names == ["ar", "lookup", "best_first@6+lookup", "chain+lookup", "hf_lookup"]
    assert {m.name: m.proposer for m in methods}["best_first@6+lookup"] == "merged"
    with pytest.raises(ValueError, match=r"\+lookup extends a tree method"):
        parse_methods("ar+lookup")
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, tiny_drafter(target))
    bench = Bench(gen, methods, max_new_tokens=40, seed=1)
    prompts = [Prompt("p0", [5, 17, 3, 9, 22], "code"), Prompt("p1", [40, 41, 42, 7], "chat")]
    runs = bench.run(prompts, repeats=1, warmup=False, progress=False)
    rows = {r["method"]: r for r in summarize(runs, methods, bench.depth, greedy=True)}
    for name in names:
        assert rows[name]["lossless"] is True, name
    # transformers' prompt lookup ran (not the plain loop): no decode stage of ours, no steps timed
    assert all(r.stage_seconds == {} and r.round_seconds == [] for r in runs if r.method == "hf_lookup")
    assert all("decode" in r.stage_seconds for r in runs if r.method == "ar")
    merged = rows["best_first@6+lookup"]
    assert set(merged["tau_by_category"]) == {"code", "chat"}
    assert merged["accepted_by_source"]["lookup"] + merged["accepted_by_source"]["both"] > 0
    assert rows["lookup"]["tau"] > 1.0


def test_linear_bench_runs_on_a_tiny_hybrid(tmp_path):
    """``python -m ddtree.bench linear``: every case row and the JSON (its numbers are docs, not assertions)."""
    pytest.importorskip("transformers.models.qwen3_next")
    from ddtree.bench.__main__ import main

    out = tmp_path / "linear.json"
    result = main(["linear", "--contexts", "24", "--nodes", "6,9", "--repeats", "1", "--out", str(out)])
    assert [(r["context"], r["nodes"]) for r in result["rows"]] == [(24, 6), (24, 9)]
    for row in result["rows"]:
        # the deepest path's depth nodes are no leaves (nor is the root)
        assert 1 <= row["leaves"] <= row["nodes"] - row["depth"] and 1 <= row["depth"] < row["nodes"]
        assert all(row[k] > 0 for k in ("tree_ms", "chain_ms", "plain_ms", "paths_ms", "commit_ms"))
    assert json.loads(out.read_text())["rows"] == result["rows"]


def test_linear_bench_leaf_paths_of_known_trees():
    from ddtree.bench.linear import _leaf_paths
    from ddtree.blocks import DraftTree

    chain = DraftTree.from_parents(torch.zeros(1, 4, dtype=torch.long), torch.tensor([[-1, 0, 1, 2]]))
    star = DraftTree.from_parents(torch.zeros(1, 4, dtype=torch.long), torch.tensor([[-1, 0, 0, 0]]))
    fork = DraftTree.from_parents(torch.zeros(1, 5, dtype=torch.long), torch.tensor([[-1, 0, 1, 1, 0]]))
    assert _leaf_paths(chain) == [[0, 1, 2, 3]]
    assert _leaf_paths(star) == [[0, 1], [0, 2], [0, 3]]
    assert _leaf_paths(fork) == [[0, 1, 2], [0, 1, 3], [0, 4]]


def test_memory_bench_measures_both_methods_side_by_side(tmp_path):
    """The long-prompt bench: each method in its own child, the same tokens, a chunked ddtree prefill, and the
    drafter's share of ddtree's time to first token reported (it is what HF's prefill does not do)."""
    from ddtree.bench import memory

    out = tmp_path / "memory.json"
    assert memory.main(["--config", "tiny", "--layers", "1", "--lengths", "300", "--chunk", "128", "--new", "3",
                        "--dtype", "float64", "--out", str(out)]) == 0  # float64: no near-tie can split the tokens
    rows = json.loads(out.read_text())["rows"]
    assert [r["length"] for r in rows] == [300]
    hf, dd = rows[0]["hf"], rows[0]["ddtree"]
    assert hf["tokens"] == dd["tokens"] and len(dd["tokens"]) == 3
    assert hf["peak_bytes"] >= 0 and dd["peak_bytes"] >= 0  # above the warmed-up level: a tiny run may need none
    assert 0 < dd["drafter_context_s"] < dd["ttft_s"]  # chunks 1-2 before the first token,
    assert dd["drafter_after_first_s"] > 0  # the last one after it
    per_token = 2 * 2 * 16 * 8  # K and V of one drafter layer: 2 KV heads x 16 dims, float64
    assert 300 * per_token <= dd["drafter_context_bytes"] <= (2 * 300 + 64) * per_token  # the prompt, grown capacity


def test_results_md_has_per_depth_and_category_tables_recomputed_from_the_trees(tmp_path):
    """Per depth: P(reach d), acceptance at d and mean nodes at d; tau per category. The nodes are recounted
    from the saved trees and the reach from the acceptance lengths (float64 tiny pair, scripted drafter)."""
    from ddtree.bench.report import category_table, depth_tables

    target = tiny_target("qwen3")
    prompts = [Prompt("p0", list(range(3, 14)), "code"), Prompt("p1", [40, 41, 42, 7], "chat")]
    gen = scripted_generator(target, [p.input_ids for p in prompts], 8)
    methods = parse_methods("chain,best_first@8,beam@2x2")
    bench = Bench(gen, methods, max_new_tokens=8, seed=1)
    runs = bench.run(prompts, repeats=1, warmup=False, progress=False, trees_path=tmp_path / "trees.jsonl")
    rows = {r["method"]: r for r in summarize(runs, methods, bench.depth, greedy=True)}
    saved = load_rounds(tmp_path / "trees.jsonl")
    assert rows["ar"]["depth_acceptance"] == [] and rows["ar"]["nodes_per_depth"] == []
    for name in ("chain", "best_first@8", "beam@2x2"):
        row = rows[name]
        trees = [s["tree"] for s in saved if s["method"] == name]
        depths = [t.depths[0].tolist() for t in trees]
        want = [sum(ds.count(d) for ds in depths) / len(trees) for d in range(1, bench.depth + 1)]
        assert row["nodes_per_depth"] == pytest.approx(want), name
        acc = [a for r in runs if r.method == name for a in r.acceptance]
        assert len(acc) == len(trees) and row["rounds"] == len(trees)
        reach = [sum(a - 1 >= d for a in acc) / len(acc) for d in range(1, bench.depth + 1)]
        assert row["depth_acceptance"] == pytest.approx(reach)
        above = [1.0] + reach
        assert row["acceptance_at_depth"] == [None if above[d] == 0 else pytest.approx(reach[d] / above[d])
                                              for d in range(bench.depth)]
        cats = {c: [a for r in runs if r.method == name and r.category == c for a in r.acceptance]
                for c in ("code", "chat")}
        assert row["tau_by_category"] == {c: pytest.approx(sum(a) / len(a), abs=1e-3) for c, a in cats.items()}
    assert rows["chain"]["nodes_per_depth"] == [1.0] * bench.depth  # a chain: one node per depth
    assert rows["beam@2x2"]["nodes_per_depth"][2:] == [0.0] * (bench.depth - 2)  # two levels deep
    md = depth_tables(list(rows.values()))
    assert "P(round reaches depth d)" in md and "Mean draft nodes at depth d" in md
    assert "| chain | " + " | ".join(["1.0"] * bench.depth) + " |" in md
    assert "| beam@2x2 | 1.00 | 1.00 | 0.00 | – |" in md  # depth 3 is never accepted; depth 4 never tried
    cat = category_table(list(rows.values()))
    assert "| category | chain | best_first@8 | beam@2x2 |" in cat
    assert f"| code | {rows['chain']['tau_by_category']['code']:.2f} |" in cat


def test_depth_plot_has_whole_ticks_and_the_stage_legend_sits_beside_the_bars():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from ddtree.bench.methods import STAGES
    from ddtree.bench.report import depth_figure, stage_figure

    rows = [{"method": f"m{i}", "depth_acceptance": [0.9, 0.6, 0.3][: i + 1],
             "stage_ms_per_round": {s: 1.0 + i for s in STAGES}} for i in range(3)]
    ax = depth_figure(rows).axes[0]
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    fig = stage_figure(rows)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend, axes = fig.axes[0].get_legend().get_window_extent(renderer), fig.axes[0].get_window_extent(renderer)
    assert legend.x0 >= axes.x1  # wholly right of the plotting area: it covers no bar
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == list(STAGES)


def test_bench_default_attention_is_the_generators_and_is_recorded(tmp_path):
    from ddtree import GeneratorOptions
    from ddtree.bench.main import build_parser

    default = GeneratorOptions().attention
    assert build_parser().parse_args([]).attention == default == "auto"
    target = tiny_target("llama", dtype=torch.float32)
    target.save_pretrained(tmp_path / "target")
    tiny_drafter(target).save_pretrained(tmp_path / "drafter")
    (tmp_path / "prompts.jsonl").write_text('{"id": "y", "input_ids": [4, 9, 2, 30], "category": "misc"}\n')
    out = tmp_path / "out"
    assert run_main_bench(["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                           "--prompts", str(tmp_path / "prompts.jsonl"), "--methods", "best_first@4",
                           "--max-new-tokens", "6", "--repeats", "1", "--out", str(out), "--no-plots",
                           "--no-warmup", "--no-progress"]) == 0
    meta = json.loads((out / "results.json").read_text())["meta"]
    from ddtree.targets.backends import get_backend

    assert meta["attention_requested"] == "auto" and meta["attention"] == get_backend("auto", device="cpu").name
    md = (out / "results.md").read_text()
    assert f"tree attention {meta['attention']}" in md and "| best_first@4 | " in md
    assert "P(round reaches depth d)" in md and "| misc |" in md


def test_batch_bench_runs_auto_beside_plain_and_fixed_budgets(monkeypatch):
    """The side-by-side that issue 33 asks for, as a smoke run on the tiny pair (float64): auto at batch 1 and 3,
    interleaved with plain, chain and best_first@2; its output equals plain decoding's for every row, and every
    round accepts what a budget allows with a drafter that is always right (a full chain to depth 4, or the root
    alone on a plain step); the first round of each call drafts. Auto prices rounds on an injected clock where
    every round costs the same: on the real one a loaded machine can make a tiny model's drafted round dearer
    than its five tokens, and a call may then rightly start plain."""
    import ddtree.generation.generator as generator
    from ddtree.bench.batch import run_batches, summarize_batches

    ticks = iter(range(1, 1 << 30))
    monkeypatch.setattr(generator, "work_clock", lambda device: (lambda: float(next(ticks)), None))

    target = tiny_target("qwen3")
    methods = parse_methods("chain,best_first@2,auto")
    prompts = [Prompt("p0", list(range(3, 14))), Prompt("p1", [40, 41, 42, 7]), Prompt("p2", [9, 8, 7, 6, 5, 4])]
    gen = scripted_generator(target, [p.input_ids for p in prompts], 12)
    runs = run_batches(gen, methods, prompts, [1, 3], max_new_tokens=12, repeats=1, stops=[], depth=4)
    rows = {(r["batch_size"], r["method"]): r for r in summarize_batches(runs)}
    for size in (1, 3):
        assert rows[size, "auto"]["rows_equal_to_batch_1_plain"] == (3, 3)
        assert rows[size, "auto"]["tokens_per_second"] > 0
    allowed = {min(b, 4) + 1 for b in (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)}
    for run in (r for r in runs if r.method == "auto"):
        for acc in run.acceptance:
            assert set(acc) <= allowed and acc[0] > 1


class GenerateSpy:
    """Wraps ``SpeculativeGenerator.generate``: per call, the generator, its budget and new tokens, the round
    costs its ``auto`` calls had learned before the call and after it, and the call's ``stats.reasons``."""

    def __init__(self, monkeypatch):
        self.calls: list[dict] = []
        real = SpeculativeGenerator.generate

        def generate(gen, *args, **kwargs):
            before = gen.learned.costs.rounds
            out = real(gen, *args, **kwargs)
            self.calls.append({"gen": gen, "budget": kwargs.get("tree_budget"), "new": kwargs["max_new_tokens"],
                               "before": before, "after": gen.learned.costs.rounds,
                               "reasons": list(out.stats.reasons), "batch": out.stats.batch_size})
            return out

        monkeypatch.setattr(SpeculativeGenerator, "generate", generate)

    def timed_reasons(self, budget, new: int, batch: int = 1) -> dict[str, int]:
        """The rounds by reason summed over the calls of ``new`` tokens at ``budget`` and ``batch`` (the timed
        ones: warm-ups have 16)."""
        from collections import Counter

        return dict(Counter(x for c in self.calls if (c["budget"], c["new"], c["batch"]) == (budget, new, batch)
                            for x in c["reasons"]))


def test_the_reasons_text_does_not_depend_on_which_reason_came_first():
    from ddtree.bench.report import reasons_text

    assert reasons_text({"retry": 2, "best rate": 66}) == reasons_text({"best rate": 66, "retry": 2}) == \
        "best rate 66, retry 2"
    assert reasons_text({"retry": 2, "explore": 2}) == "explore 2, retry 2" and reasons_text({}) == "–"


def test_short_warmup_starts_every_method_and_repeat_on_a_fresh_generator(monkeypatch):
    """``warmup="short"``: before each repeat every tree method gets a generator of its own that has learned
    nothing, and one 16-token call; auto's first timed call starts from that call's round costs alone (a
    generator kept from the last repeat, or a full warm-up, would have more). The rounds by reason in the
    summary and in results.md are the timed calls' stats.reasons summed."""
    from ddtree.bench.report import reasons_section, reasons_text

    target = tiny_target("qwen3")
    prompts = [Prompt("p0", list(range(3, 14))), Prompt("p1", [40, 41, 42, 7])]
    gen = scripted_generator(target, [p.input_ids for p in prompts], 20)
    methods = parse_methods("chain,best_first@8,auto")
    spy = GenerateSpy(monkeypatch)
    bench = Bench(gen, methods, max_new_tokens=20, seed=1)
    runs = bench.run(prompts, repeats=2, warmup="short", progress=False)
    assert len(runs) == 2 * len(prompts) * len(methods)
    by_budget = {b: [c for c in spy.calls if c["budget"] == b] for b in (bench.depth, 8, "auto")}  # chain: depth
    assert sum(map(len, by_budget.values())) == len(spy.calls) == 2 * (1 + len(prompts)) * 3
    gens = {b: list(dict.fromkeys(id(c["gen"]) for c in calls)) for b, calls in by_budget.items()}
    assert all(len(g) == 2 for g in gens.values())  # one per repeat
    assert len({g for ids in gens.values() for g in ids}) == 6  # and per method
    assert not {id(g) for g in bench.generators.values()} & {g for ids in gens.values() for g in ids}
    for auto_gen in gens["auto"]:
        calls = [c for c in by_budget["auto"] if id(c["gen"]) == auto_gen]
        warm, first = calls[0], calls[1]
        assert [c["new"] for c in calls] == [16, 20, 20]
        assert warm["before"] == 0 and warm["after"] > 0  # nothing learned before the warm-up, its rounds after
        assert first["before"] == warm["after"]
    rows = {r["method"]: r for r in summarize(runs, methods, bench.depth, greedy=True)}
    assert all(r["lossless"] for r in rows.values())
    assert rows["ar"]["budget_reasons"] is None
    for name, budget in (("chain", bench.depth), ("best_first@8", 8), ("auto", "auto")):
        want = spy.timed_reasons(budget, 20)
        assert rows[name]["budget_reasons"] == want and sum(want.values()) == rows[name]["rounds"], name
    assert set(rows["chain"]["budget_reasons"]) == {"fixed"}
    assert set(rows["auto"]["budget_reasons"]) - {"fixed"}
    counts = list(rows["auto"]["budget_reasons"].values())
    assert counts == sorted(counts, reverse=True)  # the most common first
    section = reasons_section(list(rows.values()))
    for name in ("chain", "best_first@8", "auto"):
        assert f"- {name}: {reasons_text(rows[name]['budget_reasons'])}\n" in section
    assert f"- chain: fixed {rows['chain']['rounds']}\n" in section and "- ar:" not in section
    with pytest.raises(ValueError, match="warm-up must be one of full, short, none"):
        bench.run(prompts, repeats=1, warmup="brief", progress=False)


def test_cli_short_warmup_at_batch_sizes_writes_the_reasons(saved_tiny_pair, tmp_path, monkeypatch):
    """``--batch-size 1,2 --warmup short``: per batch size and repeat a fresh generator per method and one
    16-token batch first; batch_results.json and .md carry each method's rounds by reason, summed over the timed
    calls. ``--no-warmup`` still parses, as ``--warmup none``."""
    from ddtree.bench.main import build_parser
    from ddtree.bench.report import reasons_text
    from ddtree.runtime import threads

    assert build_parser().parse_args(["--no-warmup"]).warmup == "none"
    assert build_parser().parse_args([]).warmup == "full"
    monkeypatch.setattr(threads, "_explicit", None)  # restored after: --threads 1 sets it for the process
    target, drafter = saved_tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "x", "input_ids": [5, 17, 3, 9, 22]}\n{"id": "y", "input_ids": [4, 9, 2, 30]}\n')
    spy = GenerateSpy(monkeypatch)
    out = tmp_path / "out"
    assert run_main_bench([
        "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts), "--methods", "chain,auto",
        "--max-new-tokens", "18", "--repeats", "2", "--batch-size", "1,2", "--warmup", "short", "--out", str(out),
        "--no-plots", "--no-progress", "--threads", "1", "--ignore-eos",
    ]) == 0
    auto = [c for c in spy.calls if c["budget"] == "auto"]
    # per size and repeat: a fresh generator, its 16-token warm-up, then the timed batches (2 at batch 1, 1 at 2)
    assert [c["new"] for c in auto] == [16, 18, 18] * 2 + [16, 18] * 2
    assert len({id(c["gen"]) for c in auto}) == 4 and all(c["before"] == 0 for c in auto if c["new"] == 16)
    result = json.loads((out / "batch_results.json").read_text())
    assert result["meta"]["warmup"] == "short"
    md = (out / "batch_results.md").read_text()
    for row in result["rows"]:
        size, method = row["batch_size"], row["method"]
        if method in ("hf", "ar"):
            assert row["budget_reasons"] is None
            continue
        want = spy.timed_reasons("auto" if method == "auto" else 4, 18, size)  # chain: the draft depth, 4
        assert row["budget_reasons"] == want and want, (size, method)
        assert f"- batch {size}, {method}: {reasons_text(want)}\n" in md
    assert "warm-up short" in md


def test_eager_regression_runs_each_tree_in_its_own_process(saved_tiny_pair, tmp_path):
    """This tree against itself on the tiny pair, one child process each: each child imports the tree it is
    given, both agree token for token and acceptance for acceptance, and plain decoding accepts one a round."""
    from ddtree.bench.eager_regression import NEW_TREE
    from ddtree.bench.eager_regression import main as eager_main

    target, drafter = saved_tiny_pair
    assert eager_main(["--old", str(NEW_TREE), "--target", str(target), "--drafter", str(drafter),
                       "--num-prompts", "1", "--methods", "plain,best_first@4", "--max-new-tokens", "5",
                       "--repeats", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "eager_regression.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == ["plain", "best_first@4"] and result["meta"]["prompts"] == 2
    assert all(r["identical"] and len(r["old_runs"]) == len(r["new_runs"]) == 1 for r in rows.values())
    assert rows["plain"]["mean_acceptance"] == 1.0 and rows["best_first@4"]["mean_acceptance"] >= 1.0
    assert rows["plain"]["new_tokens"] == rows["best_first@4"]["new_tokens"] <= 10
    assert "| best_first@4 |" in (tmp_path / "eager_regression.md").read_text()


def test_eager_regression_summary_flags_a_difference_between_trees():
    from ddtree.bench.eager_regression import summarize

    def run(seconds, tokens, acceptance):
        return {"results": [{"prompt": 0, "method": "chain", "seconds": seconds, "tokens": tokens,
                             "acceptance": acceptance}]}

    same = {"old": [run(2.0, [5, 6, 7, 8], [2, 2]), run(4.0, [5, 6, 7, 8], [2, 2])],
            "new": [run(1.0, [5, 6, 7, 8], [2, 2]), run(1.0, [5, 6, 7, 8], [2, 2])]}
    (row,) = summarize(same, ["chain"])
    assert row["identical"] and row["old_tok_s"] == 1.5 and row["new_tok_s"] == 4.0 and row["ratio"] == 4.0 / 1.5
    assert (row["paired_min"], row["paired_max"]) == (2.0, 4.0) and row["mean_acceptance"] == 2.0
    other_acceptance = {"old": same["old"], "new": [run(1.0, [5, 6, 7, 8], [3, 1]), same["new"][1]]}
    assert not summarize(other_acceptance, ["chain"])[0]["identical"]


@pytest.mark.parametrize("preset,layers", [("tiny", 1), ("tiny-hybrid", 4)])
def test_compiled_bench_compares_the_rounds_and_checks_their_output(tmp_path, preset, layers):
    """``bench compiled`` on the tiny presets, attention-only and GDN hybrid (dynamo's ``eager`` backend, so it
    traces in seconds): every mode of each method measured, and the compiled run's tokens and acceptance found
    equal to the dynamic run's (the exact compiled run's to the exact default's)."""
    from ddtree.bench.compiled import main

    if preset.endswith("hybrid"):
        pytest.importorskip("transformers.models.qwen3_5")  # the hybrid is qwen3_5 where this transformers has it
    out = tmp_path / "compiled.json"
    code = main(["--device", "cpu", "--preset", preset, "--layers", str(layers), "--budgets", "4", "--context", "12",
                 "--new-tokens", "6", "--repeats", "1", "--backend", "eager", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0
    assert [(r["method"], r["mode"]) for r in report["rows"]] == [  # on a CPU also the default (exact) generator
        (method, mode) for method in ("chain", "best_first@4")
        for mode in ("eager", "compiled", "default", "compiled-exact")]
    compiled = [r for r in report["rows"] if r["mode"] == "compiled"]
    assert all(r["same_tokens_and_acceptance_as_eager"] and r["speedup_over_eager"] > 0
               and r["speedup_over_default"] > 0 for r in compiled)
    exact = [r for r in report["rows"] if r["mode"] == "compiled-exact"]
    if preset.endswith("hybrid"):  # the exact operator runs attention-only Llama-family targets
        assert all("does not run" in r["skipped"] for r in exact)
    else:
        assert all(r["same_tokens_and_acceptance_as_default"] and r["speedup_over_default"] > 0 for r in exact)
    assert all(r["tokens_per_round"] >= 1 and r["ms_per_round"] > 0 for r in report["rows"] if "skipped" not in r)


def _timed(method: str, repeat: int, seconds: list[float], tokens: list[int], prompt: str = "p") -> Run:
    """A run whose rounds took ``seconds`` and committed ``tokens`` (plus the prefill's token, in no time)."""
    return Run(method, prompt, repeat, 1 + sum(tokens), sum(seconds), [] if method == "ar" else list(tokens),
               {}, [] if method == "ar" else [4] * len(tokens), [], round_seconds=list(seconds),
               round_tokens=list(tokens))


def test_round_rate_is_a_ratio_of_sums_with_a_delta_method_error():
    from ddtree.bench.noise import round_rate

    rate, rel = round_rate([1, 1], [0.1, 0.3])
    # rate 2 / 0.4; residuals 1 - 5 * 0.1 = 0.5 and 1 - 5 * 0.3 = -0.5: variance 0.5, se sqrt(0.5 / 2) / 0.2
    assert rate == pytest.approx(5.0) and rel == pytest.approx(0.5)
    assert round_rate([2, 4], [0.1, 0.2]) == (pytest.approx(20.0), pytest.approx(0.0))  # no spread in the rate
    assert round_rate([3], [0.1])[1] is None and round_rate([], []) == (None, None)


def test_comparisons_tell_a_real_difference_from_the_runs_noise():
    """Plain decoding at 100 tok/s, steady; a method at 150 tok/s, steady (faster); one at 100 tok/s whose
    rounds swing 2-18 ms (within the noise); one timed over a single round in one repeat (cannot tell)."""
    from ddtree.bench.noise import comparisons

    methods = [Method("ar", kind="ar", builder="", budget=0)] + [Method(n, builder="chain", budget=4)
                                                                   for n in ("fast", "swingy", "short")]
    steady = [0.0099, 0.0101] * 50
    runs = [_timed("ar", 0, steady, [1] * 100), _timed("fast", 0, [2 * s for s in steady], [3] * 100),
            _timed("swingy", 0, [0.002, 0.018] * 5, [1] * 10), _timed("short", 0, [0.05], [1])]
    rows = summarize(runs, methods, depth=4, greedy=False)
    by = {r["method"]: r for r in rows}
    assert by["ar"]["rounds"] == 100 and by["fast"]["rounds"] == 100 and by["fast"]["tau"] == 3.0
    assert by["fast"]["decode_tokens_per_second"] == pytest.approx(150.0)
    assert by["ar"]["round_ms"]["median"] == pytest.approx(10.0)
    comps = comparisons(rows)
    assert comps["best"] == "fast"
    verdicts = {c["method"]: c["verdict"] for c in comps["against_ar"]}
    assert verdicts == {"fast": "faster", "swingy": "within noise", "short": "cannot tell"}
    against_best = {c["method"]: c["verdict"] for c in comps["against_best"]}
    assert against_best == {"ar": "slower", "swingy": "within noise", "short": "cannot tell"}
    fast = next(c for c in comps["against_ar"] if c["method"] == "fast")
    assert fast["ratio"] == pytest.approx((301 / 2.0) / (101 / 1.0)) and fast["repeat_range"] is None  # tokens/s
    assert fast["rounds_ratio"] == pytest.approx(1.5)  # the decode rounds alone
    assert fast["rounds_interval"][0] > 1.4 and fast["rounds_interval"][1] < 1.6
    from ddtree.bench.report import comparison_section

    md = comparison_section(comps)
    assert "Fastest here: **fast**" in md and "Not told apart from it: swingy, short." in md
    assert "- swingy vs ar: " in md and ": within the noise" in md and "cannot tell" in md


def test_repeats_that_disagree_keep_a_difference_within_the_noise():
    """Steady rounds in each repeat, but the method is faster than plain in one repeat and slower in the other:
    the per-repeat ratios straddle 1, so the difference is not called real; the spread column appears."""
    from ddtree.bench.noise import comparisons

    methods = [Method("ar", kind="ar", builder="", budget=0), Method("m", builder="chain", budget=4)]
    runs = [_timed("ar", 0, [0.010] * 50, [1] * 50), _timed("m", 0, [0.009] * 50, [1] * 50),
            _timed("ar", 1, [0.010] * 50, [1] * 50), _timed("m", 1, [0.011] * 50, [1] * 50)]
    rows = summarize(runs, methods, depth=4, greedy=False)
    (c,) = comparisons(rows)["against_ar"]
    assert c["repeat_range"] == [pytest.approx(10 / 11), pytest.approx(10 / 9)] and c["verdict"] == "within noise"
    md = markdown_table(rows)
    assert "speedup vs ar (min–max over repeats)" in md and "(0.91–1.11)" in md
    same_side = runs[:2] + [_timed("ar", 1, [0.010] * 50, [1] * 50), _timed("m", 1, [0.0095] * 50, [1] * 50)]
    (c,) = comparisons(summarize(same_side, methods, depth=4, greedy=False))["against_ar"]
    assert c["verdict"] == "faster"


def test_verify_times_out_of_node_order_say_whether_that_is_noise():
    from ddtree.bench.noise import verify_order_notes

    def row(name, nodes, ms, se):
        return {"method": name, "nodes_per_verify": nodes, "verify_ms": ms, "verify_ms_se": se}

    chain, tree = row("chain", 6.0, 100.0, 3.0), row("best_first@4", 5.0, 134.0, 4.0)
    (note,) = verify_order_notes([chain, tree])
    assert note.startswith("chain (6.0 nodes) verified in 100.00 ms, faster than best_first@4 (5.0 nodes)")
    assert "beyond the run-to-run noise" in note
    (note,) = verify_order_notes([{**chain, "verify_ms_se": 20.0}, tree])
    assert "within the run-to-run noise (± 39.98 ms)" in note  # 1.96 * hypot(20, 4)
    (note,) = verify_order_notes([{**chain, "verify_ms_se": None}, tree])
    assert "one run each, too short to tell" in note
    assert verify_order_notes([row("ar", 1.0, 20.0, 1.0), tree, row("best_first@8", 9.0, 150.0, 5.0)]) == []


def test_the_progress_bar_shows_only_on_a_terminal(capsys, monkeypatch):
    """A bar redrawn into a log file floods it: by default the bar shows only where stderr is a terminal;
    ``--progress`` / ``--no-progress`` decide either way. The run it reports on accepts the scripted depth."""
    from ddtree.bench.main import build_parser

    assert [build_parser().parse_args(a).progress for a in ([], ["--progress"], ["--no-progress"])] == [
        None, True, False]
    target = tiny_target("qwen3")
    prompts = [Prompt("p0", list(range(3, 14)))]
    bench = Bench(scripted_generator(target, [p.input_ids for p in prompts], 8), parse_methods("chain"),
                  max_new_tokens=8)

    def bar_lines(progress, terminal: bool) -> str:
        monkeypatch.setattr(type(sys.stderr), "isatty", lambda self: terminal, raising=False)
        runs = bench.run(prompts, repeats=1, warmup=False, progress=progress)
        assert all(r.acceptance[:-1] == [bench.depth + 1] * (len(r.acceptance) - 1)
                   for r in runs if r.method != "ar")
        return capsys.readouterr().err

    assert bar_lines(None, terminal=False) == ""  # a log file: no bar
    assert "2/2" in bar_lines(None, terminal=True)  # a terminal: the bar (ar and chain)
    assert "2/2" in bar_lines(True, terminal=False) and bar_lines(False, terminal=True) == ""
