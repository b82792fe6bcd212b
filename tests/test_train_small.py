"""Training for a shallow target: the default layer ids are valid at every depth, and a bad layer flag is
refused before any data is generated, naming the flag (not the drafter config a run does not have yet)."""

import json
import re
import shlex
import warnings
from pathlib import Path

import pytest
import torch
from tiny import tiny_target, tiny_tokenizer

from ddtree.drafters.features import build_target_layer_ids
from ddtree.train import parse_args
from ddtree.train.__main__ import main
from ddtree.train.layers import choose_layer_ids, default_layer_ids

GUIDE = (Path(__file__).resolve().parents[1] / "docs" / "train.md").read_text()


def smallest_run() -> list[str]:
    """docs/train.md's smallest run as written, less its --target and --out-dir, with one training step."""
    block = GUIDE.split("## The smallest run", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "ddtree.train"] and argv[3:5] == ["--target", "smollm2"]
    assert argv[5] == "--out-dir"
    rest = argv[7:]
    rest[rest.index("--steps") + 1] = "1"
    return rest + ["--device", "cpu"]


SMALLEST = smallest_run()


@pytest.mark.parametrize(("layers", "want"), [(1, [0]), (2, [0]), (3, [0, 1]), (4, [0, 1, 2]), (5, [0, 1, 2, 3]),
                                              (6, [1, 2, 3, 4]), (7, [1, 2, 3, 4]), (30, [1, 10, 18, 27])])
def test_default_layer_ids_at_four_feature_layers(layers, want):
    assert default_layer_ids(layers, 4) == want


def test_default_layer_ids_rule_at_every_depth():
    """Distinct, ascending, in range, below the last layer (one layer: its only one), as many as asked up to
    L - 1, and the published formula wherever that is valid; the formula itself is the authors'."""
    assert build_target_layer_ids(2, 4) == [1, 0, 0, -1] and build_target_layer_ids(4, 4) == [1, 1, 1, 1]
    published_kept = 0
    for layers in range(1, 81):
        for n in range(1, 9):
            ids = default_layer_ids(layers, n)
            assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < max(layers - 1, 1), (layers, n, ids)
            assert len(ids) == min(n, max(layers - 1, 1)), (layers, n, ids)
            pub = build_target_layer_ids(layers, n)
            if pub == sorted(set(pub)) and 0 <= pub[0] and pub[-1] < layers - 1:
                assert ids == pub, (layers, n)
                published_kept += 1
    assert published_kept > 400  # the formula stands for all but the shallow targets
    with pytest.raises(ValueError, match="--num-feature-layers 0"):
        default_layer_ids(6, 0)


def test_the_guides_table_is_the_rule():
    table = GUIDE.split("### Which layers a small target's drafter reads", 1)[1].split("\n\n")[2]
    depths, reads = ([c.strip() for c in row.strip("|").split("|")][1:] for row in table.splitlines()[::2])
    assert len(depths) == len(reads) > 5
    for depth, read in zip(depths, reads):
        assert [int(x) for x in read.split(" (")[0].split(", ")] == default_layer_ids(int(depth), 4), depth


def test_only_a_one_layer_target_reads_its_last_layer():
    with pytest.warns(UserWarning, match="one-layer target has no other layer"):
        assert choose_layer_ids(1, 4) == ([0], [0])
    for layers in (2, 4, 6, 30):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ids, cache = choose_layer_ids(layers, 4)
        assert ids == cache == default_layer_ids(layers, 4)
    with pytest.warns(UserWarning, match=r"include the target's last layer \(5\).*leave --target-layer-ids out"):
        assert choose_layer_ids(6, 4, [2, 5]) == ([2, 5], [2, 5])


@pytest.mark.parametrize(("argv", "says"), [
    (["--num-feature-layers", "0"], "--num-feature-layers 0: the drafter reads at least one target layer"),
    (["--target-layer-ids", "-1"], r"--target-layer-ids \[-1\]: \[-1\] are negative"),
    (["--target-layer-ids=0,-2"], r"--target-layer-ids \[0, -2\]: \[-2\] are negative; ids count the target's"),
    (["--cache-layer-ids", "2,2"], r"--cache-layer-ids \[2, 2\] repeats \[2\]"),
    (["--target-layer-ids", "1,3", "--cache-layer-ids", "1,2"],
     r"--target-layer-ids \[3\] are not in --cache-layer-ids \[1, 2\]"),
])
def test_layer_flags_refused_at_argument_parsing(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert re.search(says, err.replace("\n", " ")), err
    assert "drafter config" not in err


def saved_target(tmp_path, layers: int):
    path = tmp_path / f"target{layers}"
    tiny_target("llama", dtype=torch.float32, num_hidden_layers=layers).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_out_of_range_ids_refused_before_the_target_loads(tmp_path, monkeypatch):
    import ddtree.train.__main__ as entry

    target = saved_target(tmp_path, 2)
    monkeypatch.setattr(entry, "load_target", lambda *a, **k: pytest.fail("the weights loaded before the check"))
    for flag in ("--target-layer-ids", "--cache-layer-ids"):
        with pytest.raises(ValueError) as e:
            main(["--target", str(target), "--out-dir", str(tmp_path / "run"), flag, "0,2", *SMALLEST])
        assert str(e.value).startswith(f"{flag} [2] out of range: the target has 2 decoder layers (ids 0..1)")
        assert f"leave {flag} out (the default reads [0] of this target)" in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing generated


@pytest.mark.parametrize("layers", [2, 4, 6])
def test_a_shallow_target_trains_with_the_default_flags(layers, tmp_path, capsys):
    """The smallest run on a 2-, 4- and 6-layer target: one step, exported, loaded and run by ddtree."""
    from ddtree import SpeculativeGenerator
    from ddtree.drafters.dflash.drafter import DFlashDrafter

    target_dir = saved_target(tmp_path, layers)
    out = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["--target", str(target_dir), "--out-dir", str(out), *SMALLEST]) == 0
    assert not [w for w in caught if "last layer" in str(w.message)]
    want = default_layer_ids(layers, 4)
    config = json.loads((out / "best" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == want and config["num_target_layers"] == layers
    logged = capsys.readouterr().out
    assert f"target layers {want}" in logged and "[train] step 1/1" in logged
    assert (f"the drafter reads {len(want)} of them, {want}, not --num-feature-layers 4" in logged) == (layers < 5)
    # the run's own acceptance pass ran the export through ddtree's generation, and the doctor found it clean
    accept = json.loads((out / "acceptance.json").read_text())
    assert accept["chain_rounds"] > 0 and 1.0 <= accept["chain"] <= config["block_size"]
    # (the tiny tokenizer's <mask> is an ordinary word, which the check flags; nothing about the layers)
    assert [p for p in accept["config_problems"] if not p.startswith("warn: mask token")] == []
    # and so does this one: lossless, with acceptance lengths in range that cover the tokens after the prefill's
    target = tiny_target("llama", dtype=torch.float32, num_hidden_layers=layers)
    drafter = DFlashDrafter.from_pretrained(out / "best", target, dtype=torch.float32)
    gen = SpeculativeGenerator(target, drafter, builder="chain", tree_budget=config["block_size"] - 1, threads=None)
    ids = torch.tensor([[5, 9, 14, 3, 22, 7]])
    got = gen.generate(ids, max_new_tokens=12, do_sample=False, stop_token_ids=())
    plain = target.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert got.sequences[0].tolist() == plain[0].tolist()
    lengths = got.acceptance_lengths
    assert all(1 <= n <= config["block_size"] for n in lengths) and sum(lengths) >= 12 - 1
    assert got.stats.mean_acceptance == pytest.approx(sum(lengths) / len(lengths))
