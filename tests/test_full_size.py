"""``ddtree.bench.full_size`` (and ``gpu_check --full-size``) at tiny widths on the CPU: the path a lent GPU runs
at full size, its table, its losslessness and its projections."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ddtree.bench import full_size as fs

TINY = dict(batches=(1, 2), compiled_batches=(2,), budgets=(16,), new_tokens=6, time_budget=900.0)


def hf_greedy(shape: fs.ModelShape, settings: fs.Settings, batch: int) -> list[list[int]]:
    """Transformers' own greedy decoding of the run's prompts on the run's target (rebuilt from its seed)."""
    target = fs.build_target(shape, settings.device, settings.dtype, settings.lm_head_scale)
    prompts = fs.random_prompts(shape, batch, settings.context)
    out = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=settings.new_tokens,
                          do_sample=False, pad_token_id=0)
    return out[:, settings.context:].tolist()


def test_the_full_size_run_at_tiny_widths_is_lossless_and_projects_from_the_default_pair(tmp_path):
    """Every method and mode the GPU run measures, at batch 1 and 2: each row's tokens equal plain decoding's,
    which equal transformers' greedy ones (so do those of transformers' compiled static-cache baseline); the
    trees accept drafts; the projections use the cited figure and the baseline's step."""
    shape = fs.SHAPES["tiny"]["qwen3-8b"]
    settings = fs.settings_for("tiny", shapes=[shape], **TINY)
    report = fs.run(settings, tmp_path)
    rows = report["rows"]
    assert json.loads((tmp_path / "full_size.json").read_text())["rows"] == json.loads(json.dumps(rows))
    done = {(r["batch"], r["method"], r["mode"]) for r in rows if "ms_per_round" in r}
    methods = {"plain", "chain", "best_first@16", "auto"}
    compiled = {(2, m, "compiled") for m in ("hf_static", "plain", "chain", "best_first@16")}
    optional = set() if fs.compile_refusal("auto") else {(2, "auto", "compiled")}  # run where its time is left
    eager = {(b, m, "eager") for b in (1, 2) for m in methods}
    assert eager | compiled <= done <= eager | compiled | optional
    refused = {(r["method"], r["mode"]) for r in rows if "compile=True refuses" in r.get("skipped", "")}
    assert refused == ({("auto", "compiled")} if fs.compile_refusal("auto") else set())
    assert report["failures"] == []
    for batch in (1, 2):
        plain = next(r for r in rows if r["batch"] == batch and r["method"] == "plain" and r["mode"] == "eager")
        assert plain["tokens"] == hf_greedy(shape, settings, batch)
    for r in (r for r in rows if "ms_per_round" in r):
        assert r["same_tokens_as_plain"] is True and r["lossless_required"] is True
        assert r["ms_per_round"] > 0 and r["plain_ms_per_round"] > 0 and r["rounds"] >= 1
        assert len(r["tokens"]) == r["batch"] and all(len(t) == settings.new_tokens for t in r["tokens"])
        if r["mode"] == "compiled" and r["method"] != "hf_static":
            assert r["same_tokens_as_eager"] is True
            assert r["graphs_compiled_while_timed"] == 0  # the warm-ups compiled every graph the timing met
        if r["mode"] == "compiled" and r["default_pair_tokens_per_round"] is not None:
            hf = next(h for h in rows if h["method"] == "hf_static" and h["batch"] == r["batch"])
            assert r["hf_static_ms_per_round"] == hf["ms_per_round"]
            assert r["projected_speedup_over_hf_static"] == pytest.approx(
                r["default_pair_tokens_per_round"] * hf["ms_per_round"] / r["ms_per_round"], abs=1e-3)
        if r["method"] == "best_first@16":
            assert r["measured_tokens_per_round"] > 1.0  # drafts accepted, not only bonus tokens
            assert r["default_pair_tokens_per_round"] == 2.17 and "Fixed budgets and auto" in r["default_pair_source"]
            expected = r["batch"] * 2.17 * 1e3 / r["ms_per_round"]
            assert r["projected_tokens_per_second"] == pytest.approx(expected, abs=0.06)
            assert r["projected_speedup_over_plain"] == pytest.approx(2.17 * r["plain_ms_per_round"]
                                                                      / r["ms_per_round"], abs=1e-3)
        if r["method"] == "auto":
            assert r["default_pair_tokens_per_round"] is None and "projected_tokens_per_second" not in r
            assert r["default_pair_source"].startswith("not measured")
    table = (tmp_path / "full_size.md").read_text()
    header = "| " + " | ".join(fs.COLUMNS) + " |"
    assert header in table and "PROJECTED" in table
    assert sum(line.startswith("| qwen3-8b |") for line in table.splitlines()) == len(rows)


def test_an_unmeasured_budget_says_so_and_is_never_projected():
    assert fs.default_pair_figure("best_first", 64).tokens_per_round is None
    assert fs.default_pair_figure("best_first", 64).source.startswith("not measured")
    assert fs.default_pair_figure("chain", 15).tokens_per_round == 1.67
    assert fs.default_pair_figure("best_first", 0).tokens_per_round == 1.0
    row = {"batch": 1, "method": "best_first@64", "builder": "best_first", "budget": 64, "mode": "eager",
           "ms_per_round": 10.0, "tokens": [[1]]}
    fs.finish_row(row, {1: {"ms_per_round": 5.0, "tokens": [[1]]}}, {}, torch.bfloat16)
    assert "projected_tokens_per_second" not in row and row["same_tokens_as_plain"] is True
    assert row["lossless_required"] is False  # bf16 near-ties are reported, not failed


def test_the_published_shapes_are_the_ones_the_run_builds():
    """Qwen3-8B at its widths with the published drafter's block, layers and target layers; the hybrid's
    drafter reads the layers the published formula gives a 64-layer target."""
    from ddtree.drafters.features import build_target_layer_ids

    q = fs.SHAPES["full"]["qwen3-8b"]
    assert (q.layers, q.vocab, q.widths["hidden_size"], q.widths["intermediate_size"]) == (36, 151936, 4096, 12288)
    assert (q.widths["num_attention_heads"], q.widths["num_key_value_heads"], q.widths["head_dim"]) == (32, 8, 128)
    assert (q.drafter.block_size, q.drafter.layers) == (16, 5)
    assert list(q.drafter.target_layer_ids) == build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    h = fs.SHAPES["full"]["qwen36-27b-hybrid"]
    assert list(h.drafter.target_layer_ids) == build_target_layer_ids(h.layers, 5)
    assert any(s.startswith("assumed") for s in h.sources)
    short = fs.with_layers(q, 8)
    assert short.layers == 8 and list(short.drafter.target_layer_ids) == build_target_layer_ids(8, 5)


def test_what_the_time_budget_cannot_fit_is_skipped_and_named(tmp_path):
    """A case expected to take longer than what is left is skipped with the reason, and a later model that
    cannot start is named; nothing is built for either."""
    shapes = [dataclasses.replace(s, prior_case_s=1e6) for s in fs.SHAPES["tiny"].values()]
    report = fs.run(fs.settings_for("tiny", shapes=shapes, batches=(1,), compiled_batches=(), budgets=(16,),
                                    time_budget=5.0), tmp_path)
    assert [r["model"] for r in report["rows"]] == ["qwen3-8b", "qwen36-27b-hybrid"]
    assert all("time budget" in r["skipped"] for r in report["rows"])
    assert report["failures"] == []


def test_gpu_check_runs_the_full_size_stage_alone(tmp_path, monkeypatch):
    """``gpu_check --full-size`` runs this stage only (no exactness tests, no other bench), within its budget."""
    from ddtree.bench import gpu_check

    seen = {}
    real = fs.settings_for

    def small(scale, **overrides):
        seen.update(scale=scale, **overrides)
        return real(scale, **{**overrides, "shapes": [fs.SHAPES["tiny"]["qwen3-8b"]], "batches": (1,),
                              "compiled_batches": (), "budgets": (16,), "new_tokens": 4})

    monkeypatch.setattr(fs, "settings_for", small)
    code = gpu_check.main(["--device", "cpu", "--full-size", "--out", str(tmp_path), "--time-budget", "300"])
    assert code == 0
    assert seen["scale"] == "tiny" and 250 < seen["time_budget"] <= 300 - gpu_check.FULL_SIZE_MARGIN
    assert not (tmp_path / "gpu_check.json").exists() and not (tmp_path / "gpu_tests.xml").exists()
    rows = json.loads((tmp_path / "full_size.json").read_text())["rows"]
    assert {r["method"] for r in rows if "ms_per_round" in r} == {"plain", "chain", "best_first@16", "auto"}


def test_the_plan_runs_the_headline_comparison_first():
    """At the first batch: eager plain decoding and the smallest tree (the references), then transformers'
    compiled static-cache decoding, ddtree's compiled plain decoding and smallest tree; then every other eager
    case; then the compiled baseline, plain decoding and smallest tree at the other batches, the chain, the
    wider trees and auto. Only the eager cases and the compiled headline may spend the later models' seconds."""
    settings = fs.settings_for("tiny")  # batches 1, 8, 32; budgets 16, 32, 64
    cases = fs.plan(settings, fs.SHAPES["full"]["qwen3-8b"])
    order = [(c["batch"], c["method"], c["mode"]) for c in cases]
    assert len(cases) == 3 * 6 + 3 * 7 and "hf_static" not in {c["method"] for c in cases if c["mode"] == "eager"}
    assert order[:5] == [(1, "plain", "eager"), (1, "best_first@16", "eager"), (1, "hf_static", "compiled"),
                         (1, "plain", "compiled"), (1, "best_first@16", "compiled")]
    assert {c["mode"] for c in cases[5:5 + 16]} == {"eager"} and {c["mode"] for c in cases[21:]} == {"compiled"}
    assert [c[:2] for c in order if c[2] == "eager"][:2] == [(1, "plain"), (1, "best_first@16")]
    assert [(c["batch"], c["method"]) for c in cases if c["core"] and c["mode"] == "compiled"] == [
        (1, "hf_static"), (1, "plain"), (1, "best_first@16")]
    assert all(c["core"] for c in cases if c["mode"] == "eager")
    rest = [(b, m) for b, m, mode in order[21:]]
    assert rest[:6] == [(b, m) for b in (8, 32) for m in ("hf_static", "plain", "best_first@16")]
    assert rest[6:9] == [(b, "chain") for b in (1, 8, 32)]
    assert {m for _, m in rest[-3:]} == {"auto"}


def test_the_full_widths_build_models_of_the_published_sizes():
    """On the meta device (no memory): the Qwen3-8B target has Qwen3-8B's 8.2B parameters and the hybrid
    Qwen3.6-27B's 27B, so the widths, depths and vocabularies add up; each drafter's fc reads its five target
    layers, and the hybrid's drafter has 4 sliding layers of window 2048 and one full."""
    from ddtree.drafters.dflash.model import DFlashDraftModel

    meta = torch.device("meta")
    from transformers import CONFIG_MAPPING

    sizes = {"qwen3-8b": (8.1e9, 8.3e9), "qwen36-27b-hybrid": (26.5e9, 27.5e9)}
    if "qwen3_5_text" not in CONFIG_MAPPING:  # an older transformers (the lowest admitted): no GDN hybrid
        del sizes["qwen36-27b-hybrid"]
    for name, (low, high) in sizes.items():
        shape = fs.SHAPES["full"][name]
        target = fs.build_target(shape, meta, torch.bfloat16)
        assert low < sum(p.numel() for p in target.parameters()) < high
        config = fs.drafter_config(shape, target.config)
        with meta:
            drafter = DFlashDraftModel(config)
        assert drafter.fc.weight.shape == (shape.widths["hidden_size"], 5 * shape.widths["hidden_size"])
        assert config.block_size == 16 and config.target_layer_ids == list(shape.drafter.target_layer_ids)
    if "qwen36-27b-hybrid" in sizes:  # the last built: the hybrid and its drafter
        assert config.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and config.sliding_window == 2048
        assert target.config.layer_types.count("full_attention") == 16


def test_the_headline_compiled_pair_may_spend_what_the_later_models_keep(tmp_path):
    """With the next model keeping more than the whole budget, the first model still runs its eager cases and
    the compiled baseline, plain decoding and best_first at the first batch; its other compiled cases are
    skipped for the kept seconds, and the next model, left too little to build, is skipped and named."""
    first, second = fs.SHAPES["tiny"].values()
    second = dataclasses.replace(second, keep_s=1e5)
    report = fs.run(fs.settings_for("tiny", shapes=[first, second], batches=(1,), compiled_batches=(1, 2),
                                    budgets=(16,), new_tokens=4, time_budget=600.0), tmp_path)
    rows = report["rows"]
    ran = {(r["batch"], r["method"], r["mode"]) for r in rows if "ms_per_round" in r}
    assert {(1, m, "compiled") for m in ("hf_static", "plain", "best_first@16")} <= ran
    kept = {(r["batch"], r["method"]) for r in rows if "kept for the later models" in r.get("skipped", "")}
    auto = set() if fs.compile_refusal("auto") else {(1, "auto"), (2, "auto")}  # compiled auto: after the rest
    assert kept == {(1, "chain"), (2, "hf_static"), (2, "plain"), (2, "chain"), (2, "best_first@16")} | auto
    assert rows[-1]["model"] == second.name and "time budget" in rows[-1]["skipped"]
    assert report["failures"] == []
