"""``python -m ddtree chat`` driven through stdin: streamed replies, live switches, a clean exit on EOF."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import torch

from ddtree import SpeculativeGenerator
from ddtree.apps.chat import encode, main, stop_ids

ROOT = Path(__file__).resolve().parent.parent


def expected_reply(gen, messages, max_new_tokens):
    out = gen.generate(encode(gen.tokenizer, messages), max_new_tokens=max_new_tokens,
                       stop_token_ids=stop_ids(gen, gen.tokenizer))
    return gen.tokenizer.decode(out.new_tokens[0], skip_special_tokens=True)


def test_two_turns_with_live_switches_then_eof(saved_tiny_pair):
    target_dir, drafter_dir = map(str, saved_tiny_pair)
    stdin = io.StringIO("w5 w6 w7\n/budget 2\n/builder chain\n/builder nonsense\nw8 w9\n")
    stdout = io.StringIO()
    assert main(["--target", target_dir, "--drafter", drafter_dir, "--max-new-tokens", "12", "--threads", "1"],
                stdin=stdin, stdout=stdout) == 0
    text = stdout.getvalue()
    stats = re.findall(r"\[(\d+) tokens, ([\d.]+) per round, [\d.]+ tok/s, budget (\S+), (\S+)\]", text)
    assert [(s[2], s[3]) for s in stats] == [("auto", "best_first"), ("2", "chain")]  # the default, then /budget 2
    assert "budget 2\n" in text and "builder chain\n" in text and "nonsense" in text  # the bad builder is reported
    # Each reply is exactly what generate gives for the same conversation.
    gen = SpeculativeGenerator.from_pretrained(target_dir, drafter_dir, dtype=torch.float32)
    first = expected_reply(gen, [{"role": "user", "content": "w5 w6 w7"}], 12)
    history = [{"role": "user", "content": "w5 w6 w7"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "w8 w9"}]
    second = expected_reply(gen, history, 12)
    assert f"> {first}\n[" in text and f"> {second}\n[" in text
    assert int(stats[0][0]) == len(gen.tokenizer(first)["input_ids"]) or int(stats[0][0]) == 12


def test_cli_subprocess_exits_zero_on_eof(saved_tiny_pair):
    target_dir, drafter_dir = map(str, saved_tiny_pair)
    proc = subprocess.run(
        [sys.executable, "-m", "ddtree", "chat", "--target", target_dir, "--drafter", drafter_dir,
         "--max-new-tokens", "6", "--threads", "1"],
        input="w5 w6\nw7\n", capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(re.findall(r"\[\d+ tokens, ", proc.stdout)) == 2
