"""The long-run benchmark on the tiny target: exact, and the memory it holds grows with committed tokens only.

CI runs a short generation; ``--slow`` runs the 8,000-token one (exact vs HF greedy)."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree.bench.long_run import kv_bytes_per_token, long_run, main, tiny_generator
from ddtree.targets import kv_room

PROMPT = torch.tensor([[5, 17, 3, 9, 40, 61, 7, 33]])


def drafter_kv_bytes_per_token(gen) -> int:
    cfg = gen.drafter.config
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 8  # float64


def check_memory(r: dict, gen, budget: int) -> None:
    prompt = PROMPT.shape[1]
    per_token = kv_bytes_per_token(gen.target)
    assert per_token == 2 * 4 * 2 * 16 * 8
    for s in r["block_loop"]:
        # The cache holds the committed prefix (the last bonus token is not in it yet): at least its bytes,
        # and at most one tree's rows more (a slice of a compacted cache may keep the rejected rows' storage),
        # with the room its layers keep ahead for appending in place.
        positions = prompt + s["committed"] - 1
        assert s["cache_positions"] == positions
        assert positions * per_token <= s["cache_bytes"] <= kv_room.capacity(positions + budget + 1) * per_token
    samples = r["stream"]["samples"]
    draft_kv = drafter_kv_bytes_per_token(gen)
    for s in samples:
        context = prompt + s["committed"] - 1
        assert s["drafter_context_bytes"] <= 2 * (context + gen.drafter.block_size) * draft_kv + 4096
    # Live Python objects do not grow with rounds: a leak of one object per round would show here.
    rounds_between = r["stream"]["rounds"] * (samples[-1]["committed"] - samples[1]["committed"]) / r["new_tokens"]
    assert samples[-1]["python_objects_delta"] - samples[1]["python_objects_delta"] < rounds_between / 4
    assert r["python_objects_left_by_a_call"] < r["tokens_per_call"] / 4


def test_long_run_is_exact_and_memory_tracks_committed_tokens():
    new, budget = 160, 6
    gen = tiny_generator(PROMPT.shape[1] + new + 64, budget)
    r = long_run(gen, PROMPT, new, budget=budget, checkpoints=4, leak_tokens=80)
    assert r["exact_vs_hf_greedy"] is True and r["block_loop_equals_stream"] is True
    assert r["stream"]["rounds"] >= new // gen.drafter.block_size
    check_memory(r, gen, budget)


def test_long_run_command(tmp_path):
    assert main(["--tiny", "--max-new-tokens", "40", "--budget", "4", "--checkpoints", "3",
                 "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "long_run.json").read_text())
    assert r["exact_vs_hf_greedy"] is True and r["meta"]["command"].startswith("python -m ddtree.bench long-run")
    assert "| exact vs HF greedy | yes |" in (tmp_path / "long_run.md").read_text()


@pytest.mark.slow
def test_8000_tokens_on_the_tiny_target():
    new, budget = 8000, 8
    gen = tiny_generator(PROMPT.shape[1] + new + 64, budget)
    r = long_run(gen, PROMPT, new, budget=budget, checkpoints=8)
    assert r["exact_vs_hf_greedy"] is True and r["block_loop_equals_stream"] is True
    check_memory(r, gen, budget)
