"""A tokenizer that encodes a prompt to no tokens (a target directory without its tokenizer files) gives a
clear error in generate, the demo and the bench, not a crash inside the target's attention."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_drafter, tiny_target

import ddtree.apps.demo as demo
import ddtree.bench.main as bench_main
import ddtree.bench.prompts as bench_prompts
from ddtree import SpeculativeGenerator


class EmptyTokenizer:
    """What transformers can hand back for a directory with no tokenizer files: every text encodes to nothing."""

    chat_template = None
    eos_token_id = None

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        ids = torch.zeros(1, 0, dtype=torch.long) if return_tensors == "pt" else []
        return type("Enc", (), {"input_ids": ids})()

    def decode(self, ids, **kwargs):
        return ""


@pytest.fixture(scope="module")
def gen():
    target = tiny_target("qwen3")
    return SpeculativeGenerator(target, tiny_drafter(target), tokenizer=EmptyTokenizer(), tree_budget=4)


def test_generate_and_stream(gen):
    empty = gen.tokenizer("hello", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match=r"the prompt is empty: give at least one token"):
        gen.generate(empty, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"the prompt is empty"):
        next(gen.stream(empty, max_new_tokens=4))


def test_demo(gen, monkeypatch):
    monkeypatch.setattr(demo.SpeculativeGenerator, "from_pretrained", classmethod(lambda cls, *args, **kw: gen))
    with pytest.raises(SystemExit, match=r"encoded the prompt 'hi there' to no tokens: the target directory "
                                         r"probably lacks its tokenizer files"):
        demo.main(["--prompt", "hi there", "--max-new-tokens", "4"])


def test_bench(gen, monkeypatch, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "q1", "prompt": "hello tree"}) + "\n")
    with pytest.raises(ValueError, match=r"prompt 'q1' is empty after tokenization \(the target's tokenizer "
                                         r"encoded its text to no tokens: .*tokenizer files"):
        bench_prompts.load_prompts(prompts, EmptyTokenizer())
    monkeypatch.setattr(bench_main, "load_generator", lambda args: gen)
    with pytest.raises(ValueError, match=r"prompt 'q1' is empty after tokenization"):
        bench_main.run_main_bench(["--prompts", str(prompts), "--methods", "chain", "--max-new-tokens", "4",
                               "--repeats", "1", "--out", str(tmp_path / "out"), "--no-plots", "--no-progress"])
    # A row of explicit ids that is empty is refused the same way.
    prompts.write_text(json.dumps({"id": "q2", "input_ids": []}) + "\n")
    with pytest.raises(ValueError, match=r"prompt 'q2' is empty after tokenization: give at least one token"):
        bench_prompts.load_prompts(prompts, None, vocab_size=97)
