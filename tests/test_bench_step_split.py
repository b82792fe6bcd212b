"""``python -m ddtree.bench step-split``: the op classes, the per-step split's arithmetic, the timers on a tiny
target (they see every linear and attention call, and leave the model as they found it) and the driver's
profile command against the stand-in vLLM."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from test_bench_engines import FAKE_VLLM, make_fake_vllm_python
from tiny import tiny_drafter, tiny_target

from ddtree import SpeculativeGenerator
from ddtree.bench import step_split, vllm_driver


def test_op_classes():
    for name in ("_C::onednn_mm", "_C::weight_packed_linear", "aten::addmm", "aten::mm", "mkldnn::_linear_pointwise"):
        assert step_split.op_class(name) == "linear", name
    for name in ("_C::cpu_attention_with_kv_cache", "_C::paged_attention_v1", "_C_cache_ops::reshape_and_cache",
                 "aten::_scaled_dot_product_flash_attention_for_cpu"):
        assert step_split.op_class(name) == "attention", name
    for name in ("aten::add", "Torch-Compiled Region: 0/0", "aten::copy_", "aten::argmax"):
        assert step_split.op_class(name) == "other", name


def test_split_ops_per_step():
    ops = [{"name": "_C::onednn_mm", "self_cpu_us": 6000.0}, {"name": "aten::mm", "self_cpu_us": 2000.0},
           {"name": "_C::cpu_attention_with_kv_cache", "self_cpu_us": 1000.0},
           {"name": "aten::add", "self_cpu_us": 9.0}]
    ms = step_split.split_ops(ops, seconds=0.02, steps=4)
    assert ms == {"linear": 2.0, "attention": 0.25, "other": 2.75, "step": 5.0}
    with pytest.raises(ValueError, match="no engine steps"):
        step_split.split_ops(ops, 1.0, 0)


def test_split_ddtree_parts_sum_to_the_timed_round():
    timers = step_split.Timers(linear=0.6, attention_module=0.5, attention_linear=0.2, attention_kernel=0.1,
                               forward=1.0, forwards=10)
    ms = step_split.split_ddtree({"rounds": 10, "tokens": 20, "seconds": 1.1},
                                 {"rounds": 10, "tokens": 20, "seconds": 1.2}, timers)
    parts = ms["linear"] + ms["attention"] + ms["attention_glue"] + ms["forward_other"] + ms["outside_forward"]
    assert parts == pytest.approx(ms["round_timed"]) and ms["round_timed"] == pytest.approx(120.0)
    assert ms["attention_glue"] == pytest.approx(20.0) and ms["forward_other"] == pytest.approx(10.0)
    assert ms["round"] == pytest.approx(110.0) and ms["ms_per_token"] == pytest.approx(55.0)
    assert ms["forwards_per_round"] == 1.0


def test_timers_see_every_call_and_undo_themselves():
    target = tiny_target("llama", dtype=torch.float32)
    gen = SpeculativeGenerator(target, tiny_drafter(target), tree_budget=0)
    linears = [m for m in target.modules() if isinstance(m, torch.nn.Linear)]
    before = {id(m): m.__dict__.get("forward") for m in target.modules()}
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        reference = target(input_ids=ids).logits
    calls = []
    from transformers import modeling_utils

    functions = dict(modeling_utils.ALL_ATTENTION_FUNCTIONS.items())
    with step_split.timed_target(target) as timers:
        timers.on = True
        original = linears[0].forward
        linears[0].forward = lambda x, f=original: (calls.append(1), f(x))[1]
        with torch.inference_mode():
            got = target(input_ids=ids).logits
        linears[0].forward = original
        timers.on = False
        assert torch.equal(got, reference)  # timing changes no bit
        assert timers.forwards == 1 and calls == [1]
        assert timers.linear > 0 and timers.attention_kernel > 0 and timers.attention_module > timers.attention_linear
        assert timers.forward >= timers.linear + timers.attention_kernel
        out = step_split.rounds_after_prefill(gen, [[5, 6, 7]], 4, {"tree_budget": 0, "stop_token_ids": ()}, timers)
        assert out["rounds"] == 3 and out["tokens"] == 3 and timers.forwards == 3  # prefill left out
    assert {id(m): m.__dict__.get("forward") for m in target.modules()} == before
    from transformers import modeling_utils
    interface = modeling_utils.ALL_ATTENTION_FUNCTIONS
    assert "get_interface" not in interface.__dict__
    assert all(interface[key] is fn for key, fn in functions.items())  # every attention function as it was


def test_driver_profile_command(monkeypatch, tmp_path, capsys):
    fake = SimpleNamespace()
    exec(compile(FAKE_VLLM, "fake_vllm", "exec"), fake.__dict__)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setenv("FAKE_VLLM_MATMUL", "1")
    spec = vllm_driver.check_spec({"model": "m", "prompts": [[1, 2], [3]], "batch_sizes": [1, 2],
                                   "max_new_tokens": 5, "warmup_tokens": 1})
    out = tmp_path / "p.json"
    vllm_driver.serve(spec, [f"profile {out}\n"])
    assert any('"done"' in line for line in capsys.readouterr().out.splitlines())
    result = json.loads(out.read_text())
    for size, rows in (("1", 1), ("2", 2)):
        r = result[size]
        assert r["steps"] == 5 and r["new_tokens"] == 5 * rows and r["seconds"] > 0
        assert any(op["name"] == "aten::mm" and op["calls"] == 1 for op in r["ops"])
        ms = step_split.split_ops(r["ops"], r["seconds"], r["steps"])
        assert ms["linear"] > 0 and ms["step"] == pytest.approx(1e3 * r["seconds"] / 5)


def test_step_split_command_on_the_tiny_pair(saved_tiny_pair, tmp_path, monkeypatch):
    """The whole command: ddtree's cells (both numerics settings) and the stand-in vLLM's profiled steps."""
    fake_vllm_python = make_fake_vllm_python(tmp_path)
    monkeypatch.setenv("FAKE_VLLM_MATMUL", "1")
    target, drafter = saved_tiny_pair
    out = tmp_path / "split"
    argv = ["--target", str(target), "--drafter", str(drafter), "--batch-size", "1,2", "--max-new-tokens", "5",
            "--threads", "1", "--dtype", "float32", "--numerics", "fast,exact", "--ignore-eos",
            "--vllm-python", str(fake_vllm_python), "--vllm-dtype", "float32", "--out", str(out)]
    assert step_split.main(argv) == 0
    rows = json.loads((out / "step_split.json").read_text())["rows"]
    cells = {(r["engine"], r["numerics"], r["method"], r["batch"]) for r in rows}
    assert cells == {("ddtree", n, m, b) for n in ("fast", "exact") for m in ("plain", "default") for b in (1, 2)} | {
        ("vllm", "-", "plain", b) for b in (1, 2)}
    for r in rows:
        assert r["round"] > 0 and r["linear"] > 0 and r["tokens_per_round"] >= 1
    text = (out / "step_split.md").read_text()
    assert "| ddtree | float32 | exact | plain | 2 |" in text and "| vllm | float32 | - | plain | 1 |" in text
